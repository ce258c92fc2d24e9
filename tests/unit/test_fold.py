"""fold_dequantize: bit-exact with onnxruntime's DequantizeLinear, structure restored, valid models."""
import itertools

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import modelgen as mg
from passes import InvalidArgumentError, Report, fold_dequantize, quantize_weights
from passes.graph import array_to_tensor, tensor_to_array

LEVELS = {TP.INT8: (-128, 128), TP.UINT8: (0, 256), TP.INT4: (-8, 8), TP.UINT4: (0, 16)}
SCALES = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.BFLOAT16: ml_dtypes.bfloat16}
FORMS = {  # name -> (axis, block_size, scale shape) for q of shape (6, 37, 5)
    "tensor": (None, 0, ()),
    "channel0": (0, 0, (6,)),
    "channel2": (2, 0, (5,)),
    "block": (1, 8, (6, 5, 5)),  # 37 = 4 full blocks of 8 + a block of 5
}


def _dq_model(q_type, s_type, form, with_zp, seed=0, exponents=(-14, 2)):
    rng = np.random.default_rng(seed)
    axis, block, sshape = FORMS[form]
    lo, hi = LEVELS[q_type]
    q = rng.integers(lo, hi, size=(6, 37, 5)).astype(np.int8 if lo < 0 else np.uint8)
    # scales spread over exponents so that rounding to the output type matters
    scale = (rng.uniform(0.5, 1.5, size=sshape) * 2.0 ** rng.integers(*exponents, size=sshape)).astype(SCALES[s_type])
    inits = [array_to_tensor(q, "q", q_type), array_to_tensor(scale, "s", s_type)]
    ins = ["q", "s"]
    if with_zp:
        zp = rng.integers(lo, hi, size=sshape).astype(q.dtype)
        inits.append(array_to_tensor(zp, "z", q_type))
        ins.append("z")
    attrs = {}
    if axis is not None:
        attrs["axis"] = axis
    if block:
        attrs["block_size"] = block
    node = helper.make_node("DequantizeLinear", ins, ["w"], **attrs)
    ident = helper.make_node("Identity", ["w"], ["y"])
    g = helper.make_graph([node, ident], "g", [], [helper.make_tensor_value_info("y", s_type, [6, 37, 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _ort(model):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {})[0]


@pytest.mark.parametrize("q_type,s_type,form,with_zp", list(itertools.product(
    [TP.INT8, TP.UINT8, TP.INT4, TP.UINT4], [TP.FLOAT, TP.FLOAT16], list(FORMS), [False, True])))
def test_fold_bit_exact_with_onnxruntime(q_type, s_type, form, with_zp):
    m = _dq_model(q_type, s_type, form, with_zp)
    expected = _ort(m)
    f = fold_dequantize(m)
    onnx.checker.check_model(f, full_check=True)
    inits = {t.name: t for t in f.graph.initializer}
    assert set(inits) == {"w"}  # dead levels / scales / zero points removed
    got = tensor_to_array(inits["w"])
    assert got.dtype == expected.dtype
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("q_type,form,with_zp", list(itertools.product(
    [TP.INT8, TP.UINT8, TP.INT4, TP.UINT4], list(FORMS), [False, True])))
def test_fold_float16_normal_scales(q_type, form, with_zp):
    """Scales whose products are all normal float16: the bit-level rounding path (the scales of
    the test above reach below 2**-14 and take numpy's cast instead)."""
    m = _dq_model(q_type, TP.FLOAT16, form, with_zp, seed=1, exponents=(-12, 0))
    got = tensor_to_array(fold_dequantize(m).graph.initializer[0])
    assert got.tobytes() == _ort(m).tobytes()


@pytest.mark.parametrize("q_type,form,with_zp", list(itertools.product(
    [TP.INT8, TP.UINT8, TP.INT4], list(FORMS), [False, True])))
def test_fold_bfloat16(q_type, form, with_zp):
    """onnxruntime has no CPU bfloat16 DequantizeLinear; its kernels compute in float32 and round
    once to the output type, so the reference is onnxruntime's float32 result rounded to bfloat16."""
    m = _dq_model(q_type, TP.BFLOAT16, form, with_zp)
    m32 = onnx.ModelProto()
    m32.CopyFrom(m)
    s = m32.graph.initializer[1]
    s32 = tensor_to_array(s).astype(np.float32)
    m32.graph.initializer[1].CopyFrom(array_to_tensor(s32, "s", TP.FLOAT))
    m32.graph.output[0].type.tensor_type.elem_type = TP.FLOAT
    expected = _ort(m32).astype(ml_dtypes.bfloat16)
    got = tensor_to_array(fold_dequantize(m).graph.initializer[0])
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("builder", ["conv", "dense", "gather", "subgraph"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kw", [dict(), dict(symmetric=False, granularity="block", block_size=16), dict(bits=4)])
def test_quantize_then_fold_restores_structure(builder, dtype, kw):
    m = mg.BUILDERS[builder](dtype, 13)
    q = quantize_weights(m, min_elements=64, **kw)
    before = q.SerializeToString()
    report = Report()
    f = fold_dequantize(q, report=report)
    assert q.SerializeToString() == before  # input untouched
    onnx.checker.check_model(f, full_check=True)

    def layout(model):
        out = []

        def walk(g, where):
            out.append((where, sorted(t.name for t in g.initializer),
                        [(n.op_type, tuple(n.output)) for n in g.node if n.op_type != "Constant"],
                        sorted(n.output[0] for n in g.node if n.op_type == "Constant")))
            for n in g.node:
                for a in n.attribute:
                    if a.type == onnx.AttributeProto.GRAPH:
                        walk(a.g, where + "/" + a.name)

        walk(model.graph, "")
        return out

    assert layout(f) == layout(m)
    assert report.tensors and all(t.scheme == "folded" for t in report.tensors)
    # folded model computes exactly what the quantized one computes (unoptimized sessions)
    feeds = mg.feeds(m)
    for a, b in zip(mg.run(q, feeds, optimize=False), mg.run(f, feeds, optimize=False)):
        assert a.tobytes() == b.tobytes()
    assert fold_dequantize(q).SerializeToString() == f.SerializeToString()  # deterministic


@pytest.mark.parametrize("src,dst", [("float32", "float16"), ("float16", "float32")])
def test_fold_dtype_inserts_cast(src, dst):
    m = mg.dense_model(src, 13)
    q = quantize_weights(m, min_elements=64)
    report = Report()
    f = fold_dequantize(q, dtype=dst, report=report)
    onnx.checker.check_model(f, full_check=True)
    stored = {t.name: t.data_type for t in f.graph.initializer}
    want = TP.FLOAT16 if dst == "float16" else TP.FLOAT
    assert stored[f"W1_{dst}"] == want
    casts = [n for n in f.graph.node if n.op_type == "Cast" and n.output[0] == "W1"]
    assert len(casts) == 1 and report.notes
    feeds = mg.feeds(m)
    for a, b in zip(mg.run(q, feeds), mg.run(f, feeds)):
        assert mg.cosine(a, b) > 0.999


def test_fold_same_dtype_is_plain():
    q = quantize_weights(mg.dense_model("float32", 13), min_elements=64)
    f = fold_dequantize(q, dtype="float32")
    assert not any(n.op_type == "Cast" and n.output[0] == "W1" for n in f.graph.node)


def test_non_constant_dq_left_alone():
    x = helper.make_tensor_value_info("x", TP.INT8, [4])
    node = helper.make_node("DequantizeLinear", ["x", "s"], ["y"])
    g = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", TP.FLOAT, [4])],
                          [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    f = fold_dequantize(m)
    assert [n.op_type for n in f.graph.node] == ["DequantizeLinear"]
    assert [t.name for t in f.graph.initializer] == ["s"]


def test_shared_scale_kept_while_read():
    """A scale read by a folded DQ and by a live node stays."""
    m = _dq_model(TP.INT8, TP.FLOAT, "tensor", False)
    m.graph.node.append(helper.make_node("Identity", ["s"], ["s_out"]))
    m.graph.output.append(helper.make_tensor_value_info("s_out", TP.FLOAT, []))
    f = fold_dequantize(m)
    onnx.checker.check_model(f, full_check=True)
    assert sorted(t.name for t in f.graph.initializer) == ["s", "w"]


def test_bad_dtype():
    with pytest.raises(InvalidArgumentError):
        fold_dequantize(mg.dense_model(), dtype="int8")


@pytest.mark.parametrize("levels,zp", [(np.arange(-128, 128, dtype=np.int8), None),
                                       (np.arange(0, 256, dtype=np.uint8), 255)])
def test_float16_rounding_every_normal_scale(levels, zp):
    """The bit-level float16 path against numpy's float32 -> float16 cast (round to nearest even),
    for every normal positive float16 scale and every 8-bit level difference."""
    from passes import forms

    scales = np.arange(0x0400, 0x5C00, dtype=np.uint16).view(np.float16)  # up to 256: no overflow
    scales = scales[scales.astype(np.float32) * 255 <= 65504]
    q = np.broadcast_to(levels, (scales.size, levels.size))
    z = None if zp is None else np.full(scales.size, zp, dtype=np.uint8)
    got = forms.dequantize_linear(np.ascontiguousarray(q), scales, z, axis=0)
    diff = q.astype(np.float32) - (0 if zp is None else np.float32(zp))
    expected = (diff * scales.astype(np.float32)[:, None]).astype(np.float16)
    assert got.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


def test_levels_still_read_elsewhere_keep_their_payload():
    """fold copies level tensors without payload; one another node still reads gets it back."""
    q = quantize_weights(mg.dense_model("float32", 13), min_elements=64)
    dq = next(n for n in q.graph.node if n.op_type == "DequantizeLinear")
    levels = dq.input[0]
    q.graph.node.append(helper.make_node("Identity", [levels], ["levels_out"]))
    q.graph.output.append(helper.make_tensor_value_info("levels_out", TP.INT8, None))
    before = {t.name: t.raw_data for t in q.graph.initializer}
    folded = fold_dequantize(q)
    after = {t.name: t for t in folded.graph.initializer}
    assert after[levels].raw_data == before[levels]
    assert dq.output[0] in after  # folded all the same
    other = [t for t in q.graph.initializer if t.name.endswith("_quantized") and t.name != levels]
    assert other and not any(t.name in after for t in other)  # dead levels removed
    assert {t.name: t.raw_data for t in q.graph.initializer} == before  # input untouched


def test_bfloat16_weight_folds_through_its_cast():
    """quantize_weights stores a bfloat16 weight as DequantizeLinear (float32 scale) -> Cast; fold
    gives the bfloat16 initializer under the weight's name, bit for bit what onnxruntime's
    DequantizeLinear + Cast compute (read back through an exact Cast to float32)."""
    import ml_dtypes
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from passes import graph

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 48)) * 37.0).astype(ml_dtypes.bfloat16)
    t = TensorProto(name="W", data_type=TensorProto.BFLOAT16, dims=w.shape, raw_data=w.tobytes())
    g = helper.make_graph([helper.make_node("Cast", ["W"], ["Wc"], to=TensorProto.FLOAT),
                           helper.make_node("MatMul", ["x", "Wc"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 48])], [t])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    q = quantize_weights(m)
    f = fold_dequantize(q)
    onnx.checker.check_model(f, full_check=True)
    assert [n.op_type for n in f.graph.node] == ["Cast", "MatMul"]
    folded = {t.name: t for t in f.graph.initializer}
    assert set(folded) == {"W"} and folded["W"].data_type == TensorProto.BFLOAT16
    probe = onnx.ModelProto()
    probe.CopyFrom(q)
    probe.graph.node.append(helper.make_node("Cast", ["W"], ["W32"], to=TensorProto.FLOAT))
    probe.graph.output.append(helper.make_tensor_value_info("W32", TensorProto.FLOAT, [64, 48]))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    w_ort = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        ["W32"], {"x": np.zeros((4, 64), np.float32)})[0]
    assert np.array_equal(w_ort, graph.tensor_to_array(folded["W"]).astype(np.float32))


def _odd_weight_then_normal_one(name: str, scale: float, k: float) -> onnx.ModelProto:
    """x -> MatMul(`name`: N(0, 1) x scale, 64x48) -> Mul(k) -> MatMul(SMALL: N(0, 0.1), 48x32) -> y:
    a weight of unusual magnitude, brought back to normal outputs by k, beside an ordinary one."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    odd = (rng.standard_normal((64, 48)) * scale).astype(np.float32)
    small = (rng.standard_normal((48, 32)) * 0.1).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", name], ["h"]),
                           helper.make_node("Mul", ["h", "k"], ["hs"]),
                           helper.make_node("MatMul", ["hs", "SMALL"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                          [onnx.numpy_helper.from_array(odd, name), onnx.numpy_helper.from_array(small, "SMALL"),
                           onnx.numpy_helper.from_array(np.array(k, np.float32), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_fold_to_float16_keeps_weights_beyond_its_range():
    """A weight with values past float16's 65504 stays float32 when folding to float16 (it would
    become inf), with a note; the others are stored as float16."""
    from onnx import TensorProto

    q = quantize_weights(_odd_weight_then_normal_one("BIG", 1e6, 1e-6))
    rep = Report()
    f = fold_dequantize(q, dtype="float16", report=rep)
    onnx.checker.check_model(f, full_check=True)
    types = {t.name: t.data_type for t in f.graph.initializer}
    assert types["BIG"] == TensorProto.FLOAT and types["SMALL_float16"] == TensorProto.FLOAT16
    assert any("1 weight(s) kept in their own type, values beyond float16's range: BIG" in n for n in rep.notes)
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    out = ort.InferenceSession(f.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.isfinite(out).all() and np.allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("dtype,scale,kept", [("float16", 1e-9, {"TINY"}), ("bfloat16", 1e-9, set()),
                                              ("float16", 1e-40, {"TINY"}), ("bfloat16", 1e-40, {"TINY"})])
def test_fold_to_a_narrower_type_keeps_weights_too_small_for_it(dtype, scale, kept):
    """A weight of values under float16's normal range (~1e-9: a few flush to zero, the rest keep a
    bit or two) stays float32 when folding to float16, with a note; bfloat16 holds float32's normal
    range, so there it is converted like the others (its own rounding, ~53 dB, is no reason to keep);
    float32 subnormals (~1e-40, whose float32 squares are 0) lose their bits in both."""
    from onnx import TensorProto

    q = quantize_weights(_odd_weight_then_normal_one("TINY", scale, min(0.1 / scale, 1e30)))
    rep = Report()
    f = fold_dequantize(q, dtype=dtype, report=rep)
    onnx.checker.check_model(f, full_check=True)
    types = {t.name: t.data_type for t in f.graph.initializer}
    assert {name for name, t in types.items() if t == TensorProto.FLOAT} - {"k"} == kept  # k: a scalar, never quantized
    assert any(f"values too small for {dtype}" in n for n in rep.notes) == bool(kept)
    if dtype == "bfloat16" or scale < 1e-38:
        # onnxruntime's CPU MatMul has no bfloat16 kernel, and products of float32 subnormals keep
        # a few bits (a few % apart between runs): the stored types are what is checked
        return
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    out = ort.InferenceSession(f.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("q_type,form", [(TP.INT8, "tensor"), (TP.UINT8, "channel0"), (TP.INT4, "channel2"),
                                         (TP.UINT4, "tensor"), (TP.INT16, "channel0")])
def test_fold_contrib_domain_dequantize(q_type, form):
    """onnxruntime's quantizer writes com.microsoft DequantizeLinear below opset 21 (int4, int16 weights):
    folded like onnx's, bit for bit with onnxruntime's contrib kernel."""
    model = _dq_model(TP.INT8 if q_type == TP.INT16 else q_type, TP.FLOAT, form, with_zp=True, seed=3)
    if q_type == TP.INT16:  # levels beyond int8's range
        for t in model.graph.initializer:
            if t.name in ("q", "z"):
                a = tensor_to_array(t).astype(np.int16) * 97
                t.CopyFrom(array_to_tensor(a, t.name, TP.INT16))
    model.graph.node[0].domain = "com.microsoft"
    model.opset_import.extend([helper.make_opsetid("com.microsoft", 1)])
    del model.opset_import[0]
    model.opset_import.insert(0, helper.make_opsetid("", 18))
    model.ir_version = 9
    want = _ort(model)
    folded = fold_dequantize(model)
    assert not any(n.op_type == "DequantizeLinear" for n in folded.graph.node)
    onnx.checker.check_model(folded, full_check=True)
    np.testing.assert_array_equal(_ort(folded), want)


@pytest.mark.parametrize("with_dq", [True, False])
def test_fold_sorts_an_unsorted_graph(with_dq):
    """A graph whose nodes are out of order (onnxruntime runs it; the checker refuses it) comes out
    sorted, with a note, whether or not anything folds."""
    model = _dq_model(TP.INT8, TP.FLOAT, "channel0", with_zp=False)
    g = model.graph
    if not with_dq:  # the levels already float: nothing to fold
        w = fold_dequantize(model)
        del g.node[:]
        del g.initializer[:]
        g.initializer.extend(w.graph.initializer)
        g.node.append(helper.make_node("Identity", ["w"], ["y"]))
    g.node.append(helper.make_node("Neg", ["y"], ["z"]))
    g.output[0].name = "z"
    g.node.insert(0, g.node.pop())  # Neg before the node making its input
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model, full_check=True)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    report = Report()
    out = fold_dequantize(model, report=report)
    onnx.checker.check_model(out, full_check=True)
    assert "nodes sorted topologically" in " ".join(report.notes)
    np.testing.assert_array_equal(_ort(out), want)
