"""The auto mode's trials on models of old opsets. The trial graph emulates onnxruntime's int8
activation blocks with ops of the model's own opset: Max broadcasts only from opset 8, so an
opset 7 model failed inside onnxruntime ('Max ... All inputs must have the same shape', exit 70)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.fidelity import evaluate


def _gemm_matmul_model(opset: int):
    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32) * 0.1, "w1")
    b1 = numpy_helper.from_array(rng.standard_normal((96,)).astype(np.float32) * 0.1, "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((96, 48)).astype(np.float32) * 0.1, "w2")
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    # IR 3: every initializer is listed as a graph input too
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])] + [
        helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in (w1, b1, w2)]
    graph = helper.make_graph(nodes, "old", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 48])], [w1, b1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 3
    return model


@pytest.mark.parametrize("opset", [7, 8])
def test_auto_mode_on_old_opset_meets_its_target(opset):
    model = _gemm_matmul_model(opset)
    rng = np.random.default_rng(8)
    feeds = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(6)]
    out, report = passes.compress(model, target="snr>=25", feeds=feeds)
    assert report["met_on_feeds"]
    assert passes.parse_requirement("snr>=25").check(evaluate(model, out, feeds=feeds))
    assert any(row["form"] != "float" for row in report["tensors"]), "something was quantized"
