"""passes.cast_levels: quantized weights written as Cast+Mul of their levels hold the values
DequantizeLinear gives, bit for bit; fold_dequantize folds them bit-exactly; onnxruntime folds
them at load (a float MatMul, never MatMulNBits); the auto mode writes its fused MatMul weights so
and meets its target as the file runs; it says what is the case when nothing can be quantized."""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import passes
from passes import graph
from passes.cast_levels import as_cast_mul, fold_cast_mul, has_cast_mul
from passes.fold import fold_dequantize

from modelgen import conv_model, dense_model, feeds, run


def _folded(model):
    return {t.name: graph.tensor_to_array(t) for t in fold_dequantize(model).graph.initializer}


def _optimized_ops(model, tmp_path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = os.path.join(tmp_path, "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]


@pytest.mark.parametrize("dtype,bits,symmetric", [("float32", 8, True), ("float32", 4, True), ("float16", 8, True),
                                                  ("float32", 8, False), ("float16", 6, False)])
def test_same_values_as_dequantize_linear_and_folds_bit_exactly(dtype, bits, symmetric):
    m = dense_model(dtype=dtype)
    q = passes.quantize_weights(m, bits=bits, symmetric=symmetric, min_elements=16)
    before = q.SerializeToString()
    c = as_cast_mul(q, ["W2", "W3"])  # W1 is read twice: any weight may be named
    assert q.SerializeToString() == before, "the input is not modified"
    onnx.checker.check_model(c, full_check=True)
    ops = {n.output[0]: n.op_type for n in c.graph.node}
    # a float16 weight: the Mul in float32, then a Cast back to float16 writes W (module docstring)
    last = "Cast" if dtype == "float16" else "Mul"
    assert ops["W2"] == ops["W3"] == last and ops["W1"] == "DequantizeLinear" and has_cast_mul(c)
    ref, got = _folded(q), _folded(c)
    for name in ("W1", "W2", "W3"):
        assert got[name].dtype == ref[name].dtype and got[name].tobytes() == ref[name].tobytes()
    assert not has_cast_mul(fold_dequantize(c))
    # what onnxruntime's own Cast and Mul kernels compute for the weight = the fold's, bit for bit
    assert _runtime_weight(c, "W2").tobytes() == ref["W2"].tobytes()


def _runtime_weight(model, name):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(helper.make_tensor_value_info(name, graph.tensor_to_array(
        next(t for t in model.graph.initializer if t.name == name + "_scale")).dtype == np.float16
        and TensorProto.FLOAT16 or TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run([name], feeds(model, n=1)[0])[0]


def test_per_channel_conv_weights_and_scalar_scales():
    m = conv_model()
    q = passes.quantize_weights(m, bits=8, min_elements=16)
    names = [n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"]
    c = as_cast_mul(q, names)
    assert not any(n.op_type == "DequantizeLinear" for n in c.graph.node)
    ref, got = _folded(q), fold_cast_mul(c)
    got = {t.name: graph.tensor_to_array(t) for t in got.graph.initializer}
    assert all(got[n].tobytes() == ref[n].tobytes() for n in names)
    # a per-tensor (scalar) scale broadcasts as it is
    w = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
    qm = helper.make_model(helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"]), helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [onnx.numpy_helper.from_array(np.clip(np.round(w * 40), -127, 127).astype(np.int8), "Wq"),
         onnx.numpy_helper.from_array(np.float32(1 / 40), "Ws")]), opset_imports=[helper.make_opsetid("", 13)])
    cm = as_cast_mul(qm, ["W"])
    assert [n.op_type for n in cm.graph.node] == ["Cast", "Mul", "MatMul"]
    assert _folded(cm)["W"].tobytes() == _folded(qm)["W"].tobytes()


def test_onnxruntime_runs_the_matmul_on_float_weights(tmp_path):
    """onnxruntime folds Cast+Mul of constants at load: a float MatMul, whatever it does with
    DequantizeLinear+MatMul (1.25 and later: MatMulNBits with int8 activations)."""
    m = dense_model()
    q = passes.quantize_weights(m, bits=8, min_elements=16)
    c = as_cast_mul(q, ["W1", "W2", "W3"])
    ops = _optimized_ops(c, tmp_path)
    assert "MatMulNBits" not in ops and "Cast" not in ops and "Mul" not in ops
    f = feeds(m, n=2)
    np.testing.assert_allclose(np.concatenate(run(c, f)), np.concatenate(run(fold_dequantize(q), f)), rtol=1e-5, atol=1e-6)


def _float16_mul_form(model, names):
    """The float16 form files held before the float32 arithmetic: Cast(levels -> FLOAT16) [- zero
    point] * scale, all float16 (still read: folded and turned back into DequantizeLinear)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    nodes = []
    for n in out.graph.node:
        if n.op_type != "DequantizeLinear" or n.output[0] not in names:
            nodes.append(n)
            continue
        w = n.output[0]
        scale = inits[n.input[1]]
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        rank = len(inits[n.input[0]].dims)
        shape = (-1,) + (1,) * (rank - 1 - axis) if len(scale.dims) else ()
        scale.CopyFrom(onnx.numpy_helper.from_array(graph.tensor_to_array(scale).reshape(shape), scale.name))
        nodes += [helper.make_node("Cast", [n.input[0]], [w + "_lv"], to=TensorProto.FLOAT16),
                  helper.make_node("Mul", [w + "_lv", scale.name], [w])]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def test_float16_weights_fold_at_load_in_onnxruntime(tmp_path):
    """onnxruntime's CPU provider has no float16 Mul kernel, so it cannot constant-fold a float16
    Mul: the form computes in float32 and casts back, which it folds (nothing left at run time),
    and holds the same values bit for bit as DequantizeLinear and as the old float16-Mul form."""
    m = dense_model(dtype="float16")
    q = passes.quantize_weights(m, bits=8, min_elements=16)
    c = as_cast_mul(q, ["W2", "W3"])
    ops = _optimized_ops(c, tmp_path)
    assert "Mul" not in ops and "DequantizeLinear" in ops, ops  # (W1, read twice, stays DequantizeLinear)
    stored = {t.name: t.data_type for t in c.graph.initializer}
    assert stored["W2_scale"] == TensorProto.FLOAT16  # the file stores what it stored before
    old = _float16_mul_form(q, {"W2", "W3"})
    assert "Mul" in _optimized_ops(old, tmp_path)  # what the float32 arithmetic is for
    ref = _folded(q)
    for form in (c, old):
        got = _folded(form)
        from passes.cast_levels import as_dequantize
        back = _folded(as_dequantize(form))
        for name in ("W2", "W3"):
            assert got[name].dtype == np.float16 and got[name].tobytes() == ref[name].tobytes()
            assert back[name].tobytes() == ref[name].tobytes()
    assert _runtime_weight(c, "W2").tobytes() == ref["W2"].tobytes()


def test_blocked_and_shared_scales_are_left_as_they_are():
    m = dense_model()
    q = passes.quantize_weights(m, bits=4, granularity="block", block_size=16, min_elements=16)
    c = as_cast_mul(q, ["W1", "W2", "W3"])
    assert c.SerializeToString() == q.SerializeToString()


def _outlier_matmul_model(seed=0):
    """x[8,128] -> MatMul(W1[128,96]) -> Relu -> MatMul(W2[96,64]) -> y; feeds with a few large
    activation features (as transformers have), where int8 activation blocks lose most."""
    rng = np.random.default_rng(seed)
    w1 = (rng.normal(size=(128, 96)) / np.sqrt(128)).astype(np.float32)
    w2 = (rng.normal(size=(96, 64)) / np.sqrt(96)).astype(np.float32)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "W2"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])],
        [onnx.numpy_helper.from_array(w1, "W1"), onnx.numpy_helper.from_array(w2, "W2")]),
        opset_imports=[helper.make_opsetid("", 13)])
    f = []
    for i in range(8):
        x = rng.normal(size=(8, 128)).astype(np.float32)
        x[:, ::29] *= 30.0
        f.append({"x": x})
    return m, f


def test_auto_writes_fused_matmul_weights_as_cast_mul_and_meets_the_target():
    from passes import sensitivity as sens
    from passes.fidelity import evaluate

    m, f = _outlier_matmul_model()
    q = passes.quantize_weights(m, bits=8, min_elements=16)
    fused = sens.fused_matmul_blocks([q], ["W1", "W2"])
    out, rep = passes.compress(m, target="cosine>=0.9999", feeds=f[:4], min_elements=16)
    onnx.checker.check_model(out, full_check=True)
    assert rep["met_on_feeds"]
    assert passes.parse_requirement("cosine>=0.9999").check(evaluate(m, out, feeds=f[4:]))  # held out
    quantized = {r["name"] for r in rep["tensors"] if r["form"] != "float"}
    assert quantized, "something was quantized"
    producers = {n.output[0]: n.op_type for n in out.graph.node}
    for name in quantized:
        assert producers[name] == ("Mul" if name in fused else "DequantizeLinear")
        assert all(r["form"].endswith("/cast") == (r["name"] in fused) for r in rep["tensors"] if r["name"] == name)
    if fused:
        assert any("Cast+Mul" in n for n in rep["notes"])
    # the other form keeps DequantizeLinear (MatMulNBits where onnxruntime fuses it)
    out_dq, rep_dq = passes.compress(m, target="cosine>=0.9999", feeds=f[:4], min_elements=16,
                                     fused_matmul_form="dequantize")
    assert not any(n.op_type == "Mul" for n in out_dq.graph.node) and rep_dq["met_on_feeds"]
    if fused:
        assert rep["est_packed_weight_bytes"] <= rep_dq["est_packed_weight_bytes"]


def test_bad_fused_matmul_form():
    m, f = _outlier_matmul_model()
    with pytest.raises(passes.InvalidArgumentError, match="fused_matmul_form"):
        passes.compress(m, target="cosine>=0.999", feeds=f[:2], fused_matmul_form="nbits")


def test_nothing_quantizable_says_why():
    m, f = _outlier_matmul_model()
    _, rep = passes.compress(m, target="cosine>=0.999", feeds=f[:2], min_elements=1_000_000)
    note = next(n for n in rep["notes"] if n.startswith("nothing to quantize"))
    assert "1000000 elements" in note and "2 small (<1000000 elements)" in note
    assert not any("outside main-graph initializers" in n for n in rep["notes"])
    assert rep["met_on_feeds"] and all(r["form"] == "float" for r in rep["tensors"])


def test_auto_with_blocked_levels_keeps_dequantize_linear():
    """Blocked levels have no Cast+Mul form here: they stay DequantizeLinear, as built and as searched."""
    m, f = _outlier_matmul_model()
    out, rep = passes.compress(m, target="cosine>=0.999", feeds=f[:4], min_elements=16, granularity="block")
    assert rep["met_on_feeds"] and not any(r["form"].endswith("/cast") for r in rep["tensors"])
    assert not any(n.op_type == "Mul" for n in out.graph.node)


# ---------------------------------------------------------------------- as_dequantize (the inverse)

@pytest.mark.parametrize("dtype,bits,symmetric", [("float32", 8, True), ("float32", 4, True), ("float16", 8, True),
                                                  ("float32", 8, False), ("float16", 6, False), ("float32", 4, False)])
def test_as_dequantize_gives_back_the_dequantize_linear_values(dtype, bits, symmetric):
    from passes.cast_levels import as_dequantize

    q = passes.quantize_weights(dense_model(dtype=dtype), bits=bits, symmetric=symmetric, min_elements=16)
    names = [n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"]
    c = as_cast_mul(q, names)
    before = c.SerializeToString()
    d = as_dequantize(c)
    assert c.SerializeToString() == before, "the input is not modified"
    onnx.checker.check_model(d, full_check=True)
    assert not has_cast_mul(d)
    assert sorted(n.output[0] for n in d.graph.node if n.op_type == "DequantizeLinear") == sorted(names)
    ref, from_cast_mul, got = _folded(q), fold_cast_mul(c), _folded(d)
    from_cast_mul = {t.name: graph.tensor_to_array(t) for t in from_cast_mul.graph.initializer}
    for name in names:
        assert got[name].dtype == ref[name].dtype
        assert got[name].tobytes() == ref[name].tobytes() == from_cast_mul[name].tobytes()
    levels = {t.name: t.data_type for t in q.graph.initializer}
    assert all(t.data_type == levels[t.name] for t in d.graph.initializer if t.name in levels)  # same level types
    # what onnxruntime's DequantizeLinear computes = what its Cast and Mul computed, bit for bit
    for name in names:
        assert _runtime_weight(d, name).tobytes() == _runtime_weight(c, name).tobytes()
    for got_y, want_y in zip(run(d, feeds(d)), run(q, feeds(q))):
        assert got_y.tobytes() == want_y.tobytes()


def test_as_dequantize_named_weights_only_and_what_it_leaves():
    from passes.cast_levels import as_dequantize

    q = passes.quantize_weights(dense_model(), bits=8, symmetric=False, min_elements=16)
    c = as_cast_mul(q, ["W1", "W2", "W3"])
    d = as_dequantize(c, ["W2"])
    ops = {n.output[0]: n.op_type for n in d.graph.node}
    assert ops["W2"] == "DequantizeLinear" and ops["W1"] == ops["W3"] == "Mul"
    # a zero point that is not a level (a fraction) cannot be DequantizeLinear's: left as it is
    bad = onnx.ModelProto()
    bad.CopyFrom(c)
    sub = next(n for n in bad.graph.node if n.op_type == "Sub" and n.output[0].startswith("W2"))
    zp_t = next(t for t in bad.graph.initializer if t.name == sub.input[1])
    zp = graph.tensor_to_array(zp_t) + np.float32(0.5)
    zp_t.CopyFrom(graph.array_to_tensor(zp, zp_t.name, zp_t.data_type))
    kept = as_dequantize(bad)
    ops = {n.output[0]: n.op_type for n in kept.graph.node}
    assert ops["W2"] == "Mul" and ops["W1"] == ops["W3"] == "DequantizeLinear"
    onnx.checker.check_model(kept, full_check=True)
    # nothing to do: the model comes back as it is
    assert as_dequantize(q).SerializeToString() == q.SerializeToString()
