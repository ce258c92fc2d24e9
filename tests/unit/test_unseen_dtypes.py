"""Every initializer element type onnx knows, through the public paths.

A model holds a float MatMul weight (what compress rewrites) beside one initializer `E` of each
type onnx 1.23 defines (float8 e4m3fn/e4m3fnuz/e5m2/e5m2fnuz/e8m0, float4e2m1, int4/uint4,
int2/uint2, bfloat16, complex, string, bool, ...), read by a node: pack -> unpack sha256-identical,
passes.load = onnx.load, verify, open_packed gives E's values and dtype, compress int8 and fold
leave E's bytes as they were and write a model onnx.checker accepts, InferenceSession runs the
packed int8 model (or refuses naming onnxruntime's reason where onnxruntime has no kernel for the
type). Where onnxruntime runs a Cast of E to float, E's values come out of every path unchanged.
"""
from __future__ import annotations

import hashlib

import ml_dtypes  # noqa: F401 - numpy dtypes of the narrow float types
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from tools.surgeon_compress import main

ort.set_default_logger_severity(3)

# onnx's own shape inference has no operator taking the 6-bit float types in onnx 1.23
# (Identity / Cast: "has unsupported type"): a model reading one fails onnx.checker itself
_UNREADABLE = {"FLOAT6E2M3", "FLOAT6E3M2"}
TYPES = [n for n in TensorProto.DataType.keys() if n not in ("UNDEFINED", "FLOAT") and n not in _UNREADABLE]
# onnxruntime 1.32 runs Cast from these to float32 on CPU (opset 21)
CASTABLE = {"UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "BOOL", "FLOAT16", "DOUBLE", "UINT32", "UINT64",
            "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "INT4", "UINT4"}


def exotic(type_name: str) -> TensorProto:
    """E [3, 5] of the type, values its type holds exactly."""
    elem = TensorProto.DataType.Value(type_name)
    rng = np.random.default_rng(elem)
    if elem == TensorProto.STRING:
        return helper.make_tensor("E", elem, [3], [b"a", b"bc", "\u00e9t\u00e9".encode()])
    if elem in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
        values = rng.normal(size=(3, 5)) + 1j * rng.normal(size=(3, 5))
        return numpy_helper.from_array(values.astype(np.complex64 if elem == TensorProto.COMPLEX64 else np.complex128), "E")
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    small = {"INT4": (-8, 8), "UINT4": (0, 16), "INT2": (-2, 2), "UINT2": (0, 4), "BOOL": (0, 2)}
    if type_name in small:
        values = rng.integers(*small[type_name], size=(3, 5))
    elif np.dtype(dtype).kind in "iu":
        values = rng.integers(0, 100, size=(3, 5))
    else:
        values = rng.normal(size=(3, 5)) * 4
    if type_name == "FLOAT8E8M0":
        values = np.abs(values) + 0.5  # a power-of-two scale type: no sign, no zero
    return numpy_helper.from_array(np.asarray(values).astype(dtype), "E")


def model_with(type_name: str) -> onnx.ModelProto:
    """x [2, 64] -> MatMul W -> y; E -> Cast to float (CASTABLE) or Identity -> output e."""
    e = exotic(type_name)
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.normal(size=(64, 32)) * 0.1).astype(np.float32), "W")
    castable = type_name in CASTABLE
    read = (helper.make_node("Cast", ["E"], ["e"], to=TensorProto.FLOAT) if castable
            else helper.make_node("Identity", ["E"], ["e"]))
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]), read], "dtypes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32]),
         helper.make_tensor_value_info("e", TensorProto.FLOAT if castable else e.data_type, list(e.dims))], [w, e])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 25 if type_name in ("INT2", "UINT2", "FLOAT8E8M0",
                                                                                         "FLOAT4E2M1") else 21)])
    m.ir_version = 12 if type_name in ("INT2", "UINT2", "FLOAT8E8M0") else 11 if type_name == "FLOAT4E2M1" else 10
    onnx.checker.check_model(m, full_check=True)
    return m


def _initializer(model: onnx.ModelProto, name: str) -> TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module", params=TYPES)
def case(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param.lower())
    src = d / "m.onnx"
    onnx.save(model_with(request.param), str(src))
    return request.param, src, d


def test_lossless_paths_keep_every_byte(case):
    type_name, src, d = case
    packed, back = d / "m.onnxz", d / "back.onnx"
    passes.pack(str(src), str(packed), force=True)
    passes.unpack(str(packed), str(back), force=True)
    assert _sha(back) == _sha(src)
    assert passes.load(str(packed)).SerializeToString() == onnx.load(str(src)).SerializeToString()
    assert passes.verify(str(packed), str(src)).ok
    with passes.open_packed(str(packed)) as p:
        got = p.get_tensor("E")
    if type_name != "STRING":
        want = numpy_helper.to_array(exotic(type_name))
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    else:
        assert [bytes(v) if isinstance(v, bytes) else str(v).encode() for v in got.ravel()] == list(exotic(type_name).string_data)


def test_compress_and_fold_leave_it_and_stay_valid(case, capsys):
    type_name, src, d = case
    before = _sha(src)
    out, folded = d / "q.onnx", d / "f.onnx"
    assert main(["compress", str(src), "-o", str(out), "--force"]) == 0, capsys.readouterr().err
    assert main(["fold", str(out), "-o", str(folded), "--force"]) == 0, capsys.readouterr().err
    assert main(["info", str(out)]) == 0, capsys.readouterr().err
    for path in (out, folded):
        m = onnx.load(str(path))
        onnx.checker.check_model(m, full_check=True)
        assert _initializer(m, "E").SerializeToString() == exotic(type_name).SerializeToString()
        assert any(t.name == "W" for t in m.graph.initializer) == (path == folded)  # quantized, folded back
    assert _sha(src) == before


def test_sessions_run_the_packed_int8_model_or_name_the_reason(case, capsys):
    type_name, src, d = case
    out, packed = d / "q8.onnx", d / "q8.onnxz"
    assert main(["compress", str(src), "-o", str(out), "--force"]) == 0, capsys.readouterr().err
    passes.pack(str(out), str(packed), force=True)
    x = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
    try:
        reference = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        expected = reference.run(None, {"x": x})
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own: no kernel or no numpy type for the type
        refusal = str(exc)
        for mode in ("fold", "int8"):
            try:
                session = passes.InferenceSession(str(packed), mode=mode)
                session.run(None, {"x": x})
            except passes.InvalidModelError as ours:
                assert "onnxruntime cannot create a session" in str(ours)
            except RuntimeError as ours:  # the session was made; onnxruntime's run cannot hand e to numpy
                assert str(ours) == refusal
            else:
                raise AssertionError(f"{type_name}: onnxruntime refused ({refusal}) and {mode} ran")
        return
    for mode in ("fold", "int8"):
        got = passes.InferenceSession(str(packed), mode=mode).run(None, {"x": x})
        assert np.array_equal(got[1], expected[1])  # E's values (cast to float where CASTABLE), unchanged
        assert np.allclose(got[0], expected[0], atol=0.05)
    if type_name in CASTABLE:
        want = numpy_helper.to_array(exotic(type_name)).astype(np.float32)
        assert np.array_equal(expected[1], want)


def test_a_sparse_initializer_and_a_string_tensor_together(tmp_path, capsys):
    """A sparse weight (COO) beside string and bfloat16 initializers: packed byte for byte, and the
    command densifies the sparse one, quantizes it and leaves the others."""
    rng = np.random.default_rng(2)
    dense = (rng.normal(size=(64, 32)) * 0.1).astype(np.float32)
    dense[rng.random(dense.shape) < 0.7] = 0
    flat = np.flatnonzero(dense)
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(dense.ravel()[flat], "S"),
                                       numpy_helper.from_array(flat.astype(np.int64), "S_indices"), [64, 32])
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "S"], ["y"]), helper.make_node("Identity", ["labels"], ["l"]),
         helper.make_node("Cast", ["B"], ["b"], to=TensorProto.FLOAT)], "sparse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32]),
         helper.make_tensor_value_info("l", TensorProto.STRING, [2]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
        [helper.make_tensor("labels", TensorProto.STRING, [2], [b"cat", b"dog"]),
         numpy_helper.from_array(np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16), "B")],
        sparse_initializer=[sparse])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)  # onnx's full check has no shapes for sparse initializers: it refuses any
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    packed, back = tmp_path / "m.onnxz", tmp_path / "back.onnx"
    passes.pack(str(src), str(packed))
    passes.unpack(str(packed), str(back))
    assert _sha(back) == _sha(src)
    out = tmp_path / "q.onnx"
    assert main(["compress", str(src), "-o", str(out), "--min-elements", "0"]) == 0, capsys.readouterr().err
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    x = rng.normal(size=(2, 64)).astype(np.float32)
    y, labels, b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert list(labels) == ["cat", "dog"] and np.array_equal(b, np.arange(4, dtype=np.float32))
    assert np.allclose(y, x @ dense, atol=0.05)
