"""mode="int8" on float models: weights the main-graph quantizer of runtime_int8 does not reach
(a Constant weight inside an If branch, a main-graph weight read inside a branch, bfloat16 weights
behind a Cast; LSTM/GRU W and R when QUANTIZE_RECURRENT_WEIGHTS is on) are quantized at load by passes.quantize_weights, from the .onnx and from a
lossless pack; what stays float is said in session.notes.
"""
from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.runtime_source import read_split
from passes.runtime_int8 import prepare_quantized

# int8 per channel (weight SNR ~40 dB for Gaussian weights); MatMulNBits' int8 activations
# (accuracy level 4) cost a few dB more: 30 dB is a bound both paths meet with a margin
MIN_OUTPUT_SNR_DB = 30.0


def _w(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def _snr_db(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - got) ** 2), 1e-30))


def if_model():
    """y = If(c, then: x @ Wt (Constant node in the branch), else: x @ Wo (main-graph initializer
    read from the branch)); Wo's int8 levels (20 KB) are over what int8 mode folds as small."""
    then_w = helper.make_node("Constant", [], ["Wt"], value=numpy_helper.from_array(_w((320, 64), 1), "Wt"))
    then_g = helper.make_graph([then_w, helper.make_node("MatMul", ["x", "Wt"], ["yt"])], "then", [],
                               [helper.make_tensor_value_info("yt", TensorProto.FLOAT, [4, 64])])
    else_g = helper.make_graph([helper.make_node("MatMul", ["x", "Wo"], ["ye"])], "else", [],
                               [helper.make_tensor_value_info("ye", TensorProto.FLOAT, [4, 64])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)
    m = helper.make_model(
        helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                        helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 320])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])],
                          [numpy_helper.from_array(_w((320, 64), 2), "Wo")]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def bfloat16_model():
    """bfloat16 weights behind Cast(float): a Conv weight (big enough to stay int8 in memory) and a
    MatMul weight (which becomes MatMulNBits)."""
    conv_w = _w((64, 32, 3, 3), 3).astype(ml_dtypes.bfloat16)
    mm_w = _w((64, 96), 4).astype(ml_dtypes.bfloat16)
    nodes = [helper.make_node("Cast", ["Wc"], ["Wc_f"], to=TensorProto.FLOAT),
             helper.make_node("Conv", ["x", "Wc_f"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c"], ["p"], axes=[2, 3], keepdims=0),
             helper.make_node("Cast", ["Wm"], ["Wm_f"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["p", "Wm_f"], ["y"])]
    m = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32, 10, 10])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 96])],
                          [numpy_helper.from_array(conv_w, "Wc"), numpy_helper.from_array(mm_w, "Wm")]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _feeds(name):
    rng = np.random.default_rng(7)
    if name == "if":
        x = rng.standard_normal((4, 320)).astype(np.float32)
        return [{"c": np.array(True), "x": x}, {"c": np.array(False), "x": x}]
    return [{"x": rng.standard_normal((2, 32, 10, 10)).astype(np.float32)}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int8_subgraph")
    out = {}
    for name, build in (("if", if_model), ("bf16", bfloat16_model)):
        path = folder / f"{name}.onnx"
        onnx.save(build(), path)
        packed = folder / f"{name}.onnxz"
        passes.pack(path, packed)
        out[name] = {"onnx": path, "onnxz": packed}
    return out


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("source", ["onnx", "onnxz"])
@pytest.mark.parametrize("name", ["if", "bf16"])
def test_int8_quantizes_subgraph_and_bfloat16_weights(files, name, source):
    import onnxruntime as ort

    path = files[name][source]
    before = _digest(path)
    reference = ort.InferenceSession(str(files[name]["onnx"]), providers=["CPUExecutionProvider"])
    session = passes.InferenceSession(path, mode="int8")
    assert _digest(path) == before  # the input file is untouched
    quantized = [n for n in session.notes if "quantized at load by quantize_weights" in n]
    assert len(quantized) == 1, session.notes
    assert quantized[0].startswith("2 weight(s)")
    assert not [n for n in session.notes if "stay float" in n or "stays float" in n], session.notes
    for feed in _feeds(name):
        want = reference.run(None, feed)[0]
        got = session.run(None, feed)[0]
        assert not np.array_equal(want, got)  # the weights were really quantized
        assert _snr_db(want, got) >= MIN_OUTPUT_SNR_DB
    if name == "bf16":
        assert session.op_counts.get("MatMulNBits") == 1
        assert session.op_counts.get("DequantizeLinear") == 1  # the Conv weight, int8 in memory
        assert session.op_counts.get("Cast", 0) == 0  # DequantizeLinear -> Cast -> Cast shortened


def test_dequantize_runs_inside_the_branch(files):
    split = read_split(files["if"]["onnxz"])
    split.wait_weights()
    import onnxruntime as ort

    prepare_quantized(split, bits=8, options=ort.SessionOptions())
    graph = split.skeleton.graph
    branch = {a.name: a.g for a in graph.node[-1].attribute}
    then_ops = [n.op_type for n in branch["then_branch"].node]
    assert then_ops.count("DequantizeLinear") == 1 and "MatMul" in then_ops
    levels = [n for n in branch["then_branch"].node if n.op_type == "Constant" and n.output[0] == "Wt_quantized"]
    assert levels and levels[0].attribute[0].t.data_type == TensorProto.INT8
    # the outer weight read from the else branch: int8 levels fed from the main graph
    assert [n.op_type for n in graph.node].count("DequantizeLinear") == 1
    assert split.weights["Wo_quantized"].dtype == np.int8 and "Wo" not in split.weights


def recurrent_model():
    """x -> LSTM (W, R initializers) -> Squeeze -> GRU (W, R initializers) -> y. Hidden size 80:
    every W / R holds over 16 KB of int8 levels (over what int8 mode folds as small)."""
    hidden = 80
    nodes = [helper.make_node("LSTM", ["x", "Wl", "Rl", "Bl"], ["yl"], hidden_size=hidden),
             helper.make_node("Squeeze", ["yl", "axis1"], ["sl"]),
             helper.make_node("GRU", ["sl", "Wg", "Rg"], ["y"], hidden_size=hidden)]
    inits = [numpy_helper.from_array(_w((1, 4 * hidden, 64), 5), "Wl"),
             numpy_helper.from_array(_w((1, 4 * hidden, hidden), 6), "Rl"),
             numpy_helper.from_array(_w((1, 8 * hidden), 7) * 0.1, "Bl"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(_w((1, 3 * hidden, hidden), 8), "Wg"),
             numpy_helper.from_array(_w((1, 3 * hidden, hidden), 9), "Rg")]
    m = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 1, 2, hidden])], inits),
        opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.fixture
def recurrent_files(tmp_path):
    path = tmp_path / "recurrent.onnx"
    onnx.save(recurrent_model(), path)
    packed = tmp_path / "recurrent.onnxz"
    passes.pack(path, packed)
    return {"onnx": path, "onnxz": packed}


def _recurrent_feed():
    return {"x": np.random.default_rng(11).standard_normal((6, 2, 64)).astype(np.float32)}


def test_what_stays_float_is_said(recurrent_files):
    """Big float weights of an op the load-time quantizer does not take (LSTM, GRU: off by
    default, QUANTIZE_RECURRENT_WEIGHTS) are named in the notes with why; outputs are float's."""
    import onnxruntime as ort
    from passes import runtime_int8

    assert not runtime_int8.QUANTIZE_RECURRENT_WEIGHTS
    session = passes.InferenceSession(recurrent_files["onnx"], mode="int8")
    for op in ("LSTM", "GRU"):
        for index in (1, 2):
            assert any("1 float weight(s)" in n and f"stay float: consumed by {op}[{index}]: " in n
                       and "on every run" in n for n in session.notes), session.notes
    assert session.op_counts.get("DequantizeLinear", 0) == 0
    reference = ort.InferenceSession(str(recurrent_files["onnx"]), providers=["CPUExecutionProvider"])
    feed = _recurrent_feed()
    np.testing.assert_allclose(session.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("source", ["onnx", "onnxz"])
def test_recurrent_weights_quantized_when_turned_on(recurrent_files, source, monkeypatch):
    """QUANTIZE_RECURRENT_WEIGHTS on: the LSTM and GRU W / R go through quantize_weights
    (DequantizeLinear feeding the node, int8 levels in memory), said in the notes; output within
    MIN_OUTPUT_SNR_DB of float; the input file untouched."""
    import onnxruntime as ort
    from passes import runtime_int8

    monkeypatch.setattr(runtime_int8, "QUANTIZE_RECURRENT_WEIGHTS", True)
    path = recurrent_files[source]
    before = _digest(path)
    session = passes.InferenceSession(path, mode="int8")
    assert _digest(path) == before
    quantized = [n for n in session.notes if "quantized at load by quantize_weights" in n]
    assert len(quantized) == 1 and quantized[0].startswith("4 weight(s) (4 LSTM/GRU/RNN W/R)"), session.notes
    assert not [n for n in session.notes if "LSTM[1]" in n or "LSTM[2]" in n or "GRU[" in n], session.notes
    assert session.op_counts.get("DequantizeLinear") == 4
    reference = ort.InferenceSession(str(recurrent_files["onnx"]), providers=["CPUExecutionProvider"])
    feed = _recurrent_feed()
    want, got = reference.run(None, feed)[0], session.run(None, feed)[0]
    assert not np.array_equal(want, got)
    assert _snr_db(want, got) >= MIN_OUTPUT_SNR_DB

    # the prepared graph: int8 levels feed a DequantizeLinear that feeds each W / R input
    split = read_split(path)
    split.wait_weights()
    prepare_quantized(split, bits=8, options=ort.SessionOptions())
    producers = {o: n for n in split.skeleton.graph.node for o in n.output}
    for op in ("LSTM", "GRU"):
        node = next(n for n in split.skeleton.graph.node if n.op_type == op)
        for index in (1, 2):
            dq = producers[node.input[index]]
            assert dq.op_type == "DequantizeLinear"
            assert split.array(dq.input[0]).dtype == np.int8


def test_int4_raises_the_opset_by_conversion(tmp_path):
    """int4's blocked DequantizeLinear needs opset 21: the model is converted (ReduceMean's axes
    attribute becomes an input at 18), not just renumbered (onnxruntime refused the model)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["c"]),
             helper.make_node("MatMul", ["c", "W"], ["y"])]
    m = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
                          [numpy_helper.from_array(_w((256, 64), 8), "W")]),
        opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "reduce.onnx"
    onnx.save(m, path)
    import onnxruntime as ort

    x = np.random.default_rng(9).standard_normal((2, 256)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    session = passes.InferenceSession(path, mode="int4")
    assert session.op_counts.get("MatMulNBits") == 1
    assert _snr_db(want, session.run(None, {"x": x})[0]) >= 15.0  # 4-bit blocks of 32: ~20 dB
