"""Property-based fuzzing (hypothesis) of the `.onnxz` readers and of the writer and passes on
odd-shaped models (issue 6 item 1). The CI profile is bounded and derandomised (the same examples
every run); `SURGEON_FUZZ_PROFILE=long` runs 50x more with a random seed (fuzz/README.md).

1. byte edits (overwrites + optional truncation, shrinkable) of packed samples: every reader
   gives a documented error or the original (fuzz/oracle.py);
2. crafted files (one index value changed, checksums recomputed): no crash, no escape;
3. generated models of odd dtypes, shapes (zeros, scalars), names and layouts: pack -> unpack is
   byte-identical, load and get_tensor give the original tensors;
4. the same models through quantize_weights and fold_dequantize: a valid model or a SurgeonError,
   no non-finite weight where the original was finite.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import SurgeonError

from fuzz.campaign import make_mutant
from fuzz.profiles import fuzz_settings

SWEPT = ["all_families", "ans_families", "external_data", "fpairs_forced", "typed_fields", "subgraph_const_empty", "quantized_int8"]
ALL = ("load", "open_packed", "unpack", "verify", "session")


@pytest.fixture(scope="module")
def oracles(samples, tmp_path_factory):
    from fuzz.oracle import Oracle

    base = tmp_path_factory.mktemp("hyp")
    return {name: Oracle(samples[name], base / name) for name in SWEPT}


@st.composite
def byte_edits(draw):
    name = draw(st.sampled_from(SWEPT))
    return name, draw(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6)), \
        draw(st.one_of(st.none(), st.integers(0, 1 << 20)))


@fuzz_settings(500)
@given(edit=byte_edits())
def test_byte_edits(oracles, edit):
    name, overwrites, cut = edit
    oracle = oracles[name]
    data = bytearray(oracle.sample.packed)
    for pos, value in overwrites:
        data[pos % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    v = oracle.judge(bytes(data), apis=ALL)
    assert not v.bad, v.findings
    if bytes(data) != oracle.sample.packed:
        assert v.verdict == "refused", (v.verdict, v.errors)


@fuzz_settings(400)
@given(name=st.sampled_from(SWEPT), seed=st.integers(0, 1 << 30))
def test_crafted_files(oracles, name, seed):
    packed = {n: o.sample.packed for n, o in oracles.items()}
    desc, data, crafted = make_mutant(("crafted", name, seed), packed)
    v = oracles[name].judge(data, crafted=crafted, apis=ALL)
    assert not v.bad, (desc, v.findings)


# ---------------------------------------------------------------------- generated models

DTYPES = {
    TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64,
    TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16,
    TensorProto.INT32: np.int32, TensorProto.INT64: np.int64, TensorProto.BOOL: np.bool_,
    TensorProto.UINT64: np.uint64, TensorProto.BFLOAT16: None,
}
SPECIAL = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -3.4e38, 65504.0, 6e-8]


@st.composite
def tensors(draw, index):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3).filter(lambda s: int(np.prod(s)) <= 1500))
    n = int(np.prod(shape)) if shape else 1
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "constant", "special", "small_ints"]))
    if kind == "normal":
        values = rng.standard_normal(n) * draw(st.sampled_from([1e-3, 1.0, 100.0]))
    elif kind == "constant":
        values = np.full(n, draw(st.sampled_from(SPECIAL[:4] + [7.5])))
    elif kind == "special":
        values = rng.choice(np.array(SPECIAL), n)
    else:
        values = rng.integers(-8, 8, n).astype(np.float64)
    name = draw(st.sampled_from(["w", "weight.0", "a/b:c", "ünïcode", "x" * 200, ""])) + f"_{index}"
    storage = draw(st.sampled_from(["raw", "typed"]))
    np_type = DTYPES[dtype]
    with np.errstate(all="ignore"):
        if dtype == TensorProto.BFLOAT16:
            bits = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            t = helper.make_tensor(name, dtype, shape, bits.tobytes(), raw=True)
        elif np.issubdtype(np_type, np.integer) or np_type is np.bool_:
            info = np.iinfo(np_type) if np_type is not np.bool_ else None
            ints = np.nan_to_num(values, nan=0, posinf=0, neginf=0)
            arr = (ints != 0) if info is None else np.clip(ints, info.min, info.max).astype(np_type)
            t = numpy_helper.from_array(np.asarray(arr, dtype=np_type).reshape(shape), name)
            if storage == "typed" and dtype not in (TensorProto.UINT64,):
                t = helper.make_tensor(name, dtype, shape, arr.astype(np.int64).tolist())
        else:
            arr = values.astype(np_type).reshape(shape)
            t = numpy_helper.from_array(arr, name)
            if storage == "typed" and dtype in (TensorProto.FLOAT, TensorProto.DOUBLE):
                t = helper.make_tensor(name, dtype, shape, arr.ravel().tolist())
    return t


@st.composite
def odd_models(draw):
    count = draw(st.integers(1, 4))
    inits = [draw(tensors(i)) for i in range(count)]
    nodes, outputs = [], []
    for t in inits:
        nodes.append(helper.make_node("Identity", [t.name], [t.name + "_out"]))
        outputs.append(helper.make_tensor_value_info(t.name + "_out", t.data_type, list(t.dims)))
    if draw(st.booleans()):  # one weight in a Constant inside an If branch
        c = draw(tensors(99))
        c.name = ""
        branch = helper.make_graph([helper.make_node("Constant", [], ["c_out"], value=c)], "then", [],
                                   [helper.make_tensor_value_info("c_out", c.data_type, list(c.dims))])
        nodes += [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cv", TensorProto.BOOL, [], [True])),
                  helper.make_node("If", ["cond"], ["if_out"], then_branch=branch, else_branch=branch)]
        outputs.append(helper.make_tensor_value_info("if_out", c.data_type, list(c.dims)))
    graph = helper.make_graph(nodes, "odd", [], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", draw(st.sampled_from([13, 17, 21])))])
    model.doc_string = draw(st.sampled_from(["", "doc", "ünïcode \u202e"]))
    return model, draw(st.booleans())


def _reference_tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return [numpy_helper.to_array(t) for t in _get_all_tensors(model)]


@fuzz_settings(120)
@given(case=odd_models())
def test_pack_round_trip_of_odd_models(fast_dir_module, case):
    model, external = case
    folder = fast_dir_module / "rt"
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    src = folder / "m.onnx"
    if external:
        onnx.save_model(model, src, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="m.data", size_threshold=0)
    else:
        src.write_bytes(model.SerializeToString())
    originals = {p.name: p.read_bytes() for p in folder.iterdir()}
    passes.pack(src, folder / "m.onnxz", threads=2)
    out = folder / "out"
    out.mkdir()
    passes.unpack(folder / "m.onnxz", out / "m.onnx", threads=2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == originals
    loaded = passes.load(folder / "m.onnxz")
    want = _reference_tensors(onnx.load(str(src)))
    got = _reference_tensors(loaded)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    with passes.open_packed(folder / "m.onnxz") as pm:
        for key in pm.keys():
            pm.get_tensor(key)  # every key decodes (values checked against load above)


@fuzz_settings(120)
@given(case=odd_models(), bits=st.sampled_from([2, 4, 8]),
       granularity=st.sampled_from(["tensor", "channel", "block"]), symmetric=st.booleans())
def test_passes_on_odd_models(case, bits, granularity, symmetric):
    model, _ = case
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        return  # the generator made an invalid model (e.g. If at an opset without bfloat16): nothing to judge
    before = model.SerializeToString()
    try:
        q = passes.quantize_weights(model, bits=bits, granularity=granularity, symmetric=symmetric, min_elements=0)
    except SurgeonError as exc:
        assert "\n" not in str(exc)
        return
    assert model.SerializeToString() == before  # the input is never modified
    onnx.checker.check_model(q, full_check=True)
    f = passes.fold_dequantize(q)
    onnx.checker.check_model(f, full_check=True)
    orig = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for t in f.graph.initializer:
        if t.name in orig and orig[t.name].dtype.kind == "f":
            a, b = numpy_helper.to_array(t), orig[t.name]
            assert a.shape == b.shape
            assert np.array_equal(np.isfinite(a), np.isfinite(b)), t.name


@pytest.fixture(scope="module")
def fast_dir_module(tmp_path_factory):
    import os
    import tempfile
    from pathlib import Path

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base:
        path = Path(tempfile.mkdtemp(prefix="surgeon-hyp-", dir=base))
        yield path
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("hyp-rt")


# ---------------------------------------------------------------------- mutated .onnx files

def _base_onnx_models():
    """Serialized small models: a MatMul network, a quantized one, one with an If subgraph."""
    from fuzz.samples import quantized_samples

    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 32])], [w])
    plain = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    return [plain] + [s.files[""] for s in quantized_samples()]


BASE_ONNX = None


@fuzz_settings(150)
@given(which=st.integers(0, 2), edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_mutated_onnx_into_loader_passes_and_pack(fast_dir_module, which, edits, cut):
    """A damaged .onnx file (protobuf bytes changed or cut): load_model, the passes and pack give
    a SurgeonError or a result (the damage may still be a valid model); pack -> unpack restores
    the damaged file byte for byte. Never a foreign exception."""
    global BASE_ONNX
    if BASE_ONNX is None:
        BASE_ONNX = _base_onnx_models()
    data = bytearray(BASE_ONNX[which])
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    folder = fast_dir_module / "mut"
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    src = folder / "m.onnx"
    src.write_bytes(bytes(data))
    try:
        model = passes.load_model(src)
    except SurgeonError:
        return
    for fn in (lambda: passes.quantize_weights(model, min_elements=0), lambda: passes.fold_dequantize(model)):
        try:
            fn()
        except SurgeonError as exc:
            assert "\n" not in str(exc)
    try:
        passes.pack(src, folder / "m.onnxz")
    except SurgeonError:
        return
    passes.unpack(folder / "m.onnxz", folder / "back.onnx")
    assert (folder / "back.onnx").read_bytes() == bytes(data)
