"""mode="int8" / "int4" on "float16 storage, float32 compute" models: float16 weights read
only through Cast(to=FLOAT), in the main graph and as Constant nodes in a Loop body (what onnxruntime's
float16 converter writes around its blocked ops, and some exporters for every weight).

Before: the main-graph weight stayed float ("consumed by Cast[0]") while its bfloat16 twin was
quantized at load, and the body weight was quantized and then folded to float for a "float16 model"
(the guard against onnxruntime's float16 body fusion looked at the scale's type, not at the type
the body computes in). Now both are int8 in memory: DequantizeLinear with a float32 scale feeding
the MatMul (MatMulNBits in the main graph), from the float model and from quantize_weights' output.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes

D = 128
# int8 per channel weights (~43 dB each) through MatMulNBits' int8 activations and a 2-step Loop:
# 36-38 dB measured
MIN_OUTPUT_SNR_DB = 30.0


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def float16_storage_model(shared_reader: bool = False) -> onnx.ModelProto:
    """x [b, D] -> MatMul(Cast(W16 float16 -> float)) -> Loop x2 { h = Tanh(h @ Cast(Wc float16 Constant)) }.
    `shared_reader`: W16 is also read as float16 (Cast(x -> float16) @ W16 -> Cast back, added in)."""
    rng = np.random.default_rng(0)
    w16 = (rng.standard_normal((D, D)) / 11).astype(np.float16)
    wc = (rng.standard_normal((D, D)) / 11).astype(np.float16)
    body = helper.make_graph(
        [helper.make_node("Constant", [], ["Wc"], value=numpy_helper.from_array(wc, "Wc_value")),
         helper.make_node("Cast", ["Wc"], ["Wc_float"], to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["h", "Wc_float"], ["hm"]), helper.make_node("Tanh", ["hm"], ["h_next"]),
         helper.make_node("Identity", ["cond"], ["cond_next"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond", [], TensorProto.BOOL), _vi("h", None)],
        [_vi("cond_next", [], TensorProto.BOOL), _vi("h_next", None)])
    nodes = [helper.make_node("Cast", ["W16"], ["W_float"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "W_float"], ["a"])]
    if shared_reader:
        nodes += [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
                  helper.make_node("MatMul", ["x16", "W16"], ["a16"]),
                  helper.make_node("Cast", ["a16"], ["a16_float"], to=TensorProto.FLOAT),
                  helper.make_node("Add", ["a", "a16_float"], ["a_sum"])]
    nodes.append(helper.make_node("Loop", ["trip", "", "a_sum" if shared_reader else "a"], ["y"], body=body))
    graph = helper.make_graph(nodes, "float16_storage", [_vi("x", ["b", D])], [_vi("y", ["b", D])],
                              [numpy_helper.from_array(w16, "W16"), numpy_helper.from_array(np.array(2, np.int64), "trip")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds():
    return {"x": np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)}


def _snr_db(ref, got) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - got) ** 2), 1e-300)))


def _reference(model) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, _feeds())[0]


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float16_weights_read_as_float_stay_integer(tmp_path, compressed, mode):
    model = float16_storage_model()
    path = str(tmp_path / "f16_storage.onnx")
    onnx.save(passes.quantize_weights(model, bits=8) if compressed else model, path)
    sess = passes.InferenceSession(path, mode=mode)
    got = sess.run(None, _feeds())[0]
    notes = sess.notes
    assert not any("stay float" in n or "stays float" in n for n in notes), notes
    assert not any("folded to float" in n for n in notes), notes  # the body computes in float32
    if not compressed:
        assert any(n.startswith("2 weight(s) (1 in subgraphs, 1 float16 read as float) quantized at load")
                   for n in notes), notes
    assert sess.op_counts.get("MatMulNBits") == 1  # the main-graph weight: its Cast is gone
    assert sess.dtype == np.float32 and got.dtype == np.float32
    snr = _snr_db(_reference(model), got)
    assert MIN_OUTPUT_SNR_DB <= snr < 80.0, snr  # quantized, within int8's error


def test_float16_weight_also_read_as_float16_stays_float(tmp_path):
    """A float16 weight that a float16 MatMul reads too is not "read only as float": it stays float,
    with the note it had."""
    model = float16_storage_model(shared_reader=True)
    path = str(tmp_path / "f16_shared.onnx")
    onnx.save(model, path)
    sess = passes.InferenceSession(path, mode="int8")
    assert any("1 float weight(s)" in n and "stay float" in n for n in sess.notes), sess.notes
    assert not any("float16 read as float" in n for n in sess.notes), sess.notes
    assert _snr_db(_reference(model), sess.run(None, _feeds())[0]) >= MIN_OUTPUT_SNR_DB


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float16_storage_with_float16_conversion(tmp_path, mode):
    """dtype="float16" on it: converted (it computes in float32: before, the session took it for a float16
    model and converted nothing) and still right; inputs and outputs keep their float32 type."""
    model = float16_storage_model()
    path = str(tmp_path / "f16_storage.onnx")
    onnx.save(model, path)
    sess = passes.InferenceSession(path, mode=mode, dtype="float16")
    got = sess.run(None, _feeds())[0]
    assert sess.dtype == np.float16
    # (the body then computes in float16: its weight folded, as for any float16 body)
    assert any("folded to float (dtype=float16)" in n for n in sess.notes), sess.notes
    assert _snr_db(_reference(model), got) >= MIN_OUTPUT_SNR_DB


def shared_scale_body_model() -> onnx.ModelProto:
    """A Loop body with two int8 weights sharing one float16 scale (a Constant node), each
    DequantizeLinear -> Cast(FLOAT) -> MatMul: the body computes in float32, but the shared scale
    cannot be stored as float32 for one of them alone (_float32_dequantize_before_casts leaves it)."""
    rng = np.random.default_rng(5)
    const = lambda name, array: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name + "_value"))
    body_nodes = [const("q1", rng.integers(-127, 128, (D, D), dtype=np.int8)),
                  const("q2", rng.integers(-127, 128, (D, D), dtype=np.int8)),
                  const("s", np.array(0.0008, np.float16))]
    h = "h"
    for i in (1, 2):
        body_nodes += [helper.make_node("DequantizeLinear", [f"q{i}", "s"], [f"w{i}"]),
                       helper.make_node("Cast", [f"w{i}"], [f"w{i}_float"], to=TensorProto.FLOAT),
                       helper.make_node("MatMul", [h, f"w{i}_float"], [f"m{i}"])]
        h = f"m{i}"
    body_nodes += [helper.make_node("Tanh", [h], ["h_next"]), helper.make_node("Identity", ["cond"], ["cond_next"])]
    body = helper.make_graph(body_nodes, "body", [_vi("i", [], TensorProto.INT64), _vi("cond", [], TensorProto.BOOL),
                                                  _vi("h", None)],
                             [_vi("cond_next", [], TensorProto.BOOL), _vi("h_next", None)])
    graph = helper.make_graph([helper.make_node("Loop", ["trip", "", "x"], ["y"], body=body)], "shared_scale",
                              [_vi("x", ["b", D])], [_vi("y", ["b", D])],
                              [numpy_helper.from_array(np.array(2, np.int64), "trip")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_body_read_as_float_is_not_folded_as_a_float16_body(tmp_path, mode):
    """The guard that folds a float16 body's DequantizeLinear nodes (onnxruntime's
    float16 fusion there yields zeros) looks at the type the body computes in: these read through a
    Cast to float stay DequantizeLinear (int8 in memory)."""
    model = shared_scale_body_model()
    path = str(tmp_path / "shared_scale.onnx")
    onnx.save(model, path)
    sess = passes.InferenceSession(path, mode=mode)
    assert not any("folded to float" in n for n in sess.notes), sess.notes
    assert _snr_db(_reference(model), sess.run(None, _feeds())[0]) >= 60.0  # the same weights, float32 compute
