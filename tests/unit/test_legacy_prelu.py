"""PRelu with a per-channel slope in an opset < 7 model, across an opset raise.

Before opset 7 a slope of C values applies along axis 1 (PyTorch's opset-6 exports: the onnx
package's test_PReLU_*_multiparam models); from opset 7 it broadcasts numpy-style from the last
axis. onnx.version_converter keeps the slope as it is, so raising the opset (quantize_weights at
int8 per channel needs 13) made onnxruntime fail ("4 by 5") or, where the last axis also has C
entries, silently compute another function. graph.raise_opset now feeds such a PRelu its slope
reshaped to (C, 1, ..., 1).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import graph

C = 4


def _model(spatial: int, ir3: bool = True, x_rank: int = 4):
    """x -> PRelu(x, slope[C]) -> y, beside x2 -> MatMul(W) -> z (a weight quantize takes)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 32)).astype(np.float32)
    slope = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    x_shape = [1, C] + [spatial] * (x_rank - 2)
    nodes = [helper.make_node("PRelu", ["x", "s"], ["y"]), helper.make_node("MatMul", ["x2", "w"], ["z"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(slope, "s")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
              helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, 32])]
    if ir3:  # as PyTorch exported: every initializer also a graph input
        inputs += [helper.make_tensor_value_info("w", TensorProto.FLOAT, [32, 32]),
                   helper.make_tensor_value_info("s", TensorProto.FLOAT, [C])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape),
                                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 32])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 6)])
    m.ir_version = 3 if ir3 else 4
    onnx.checker.check_model(m, full_check=True)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "x2": rng.standard_normal((2, 32)).astype(np.float32)}
    want = np.where(feeds["x"] >= 0, feeds["x"], feeds["x"] * slope.reshape([C] + [1] * (x_rank - 2)))
    return m, feeds, want


def _run(m, feeds):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("spatial", [5, C])  # 5: onnxruntime refused; C: the silent wrong result
def test_quantize_keeps_the_per_channel_slope(spatial):
    m, feeds, want = _model(spatial)
    before = m.SerializeToString()
    q = passes.quantize_weights(m, bits=8, min_elements=0)
    assert graph.default_opset(q) >= 13 and any(n.op_type == "DequantizeLinear" for n in q.graph.node)
    onnx.checker.check_model(q, full_check=True)
    y, z = _run(q, feeds)
    np.testing.assert_array_equal(y, want)
    assert m.SerializeToString() == before


@pytest.mark.parametrize("x_rank", [2, 3, 5])
def test_raise_opset_lays_the_slope_out_for_the_input_rank(x_rank):
    m, feeds, want = _model(3, ir3=False, x_rank=x_rank)
    out, _ = graph.raise_opset(m, 13)
    onnx.checker.check_model(out, full_check=True)
    reshapes = [n for n in out.graph.node if n.op_type == "Reshape"]
    assert len(reshapes) == (0 if x_rank <= 2 else 1)  # a 1-D slope already broadcasts along axis 1 of a 2-D input
    np.testing.assert_array_equal(_run(out, feeds)[0], want)


def test_opset_7_is_crossed_too_and_a_one_value_slope_stays_one_value():
    m, feeds, want = _model(3, ir3=False)
    out, _ = graph.raise_opset(m, 7)
    assert [n.op_type for n in out.graph.node].count("Reshape") == 1
    np.testing.assert_array_equal(_run(out, feeds)[0], want)
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array([0.25], np.float32), "s"))
    out, _ = graph.raise_opset(m, 13)
    y = _run(out, feeds)[0]
    np.testing.assert_array_equal(y, np.where(feeds["x"] >= 0, feeds["x"], feeds["x"] * np.float32(0.25)))


def test_unknown_input_rank_is_refused_not_guessed():
    m, _, _ = _model(3, ir3=False)
    m.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(passes.UnsupportedFormError, match="PRelu.*rank of its input is unknown"):
        graph.raise_opset(m, 13)
