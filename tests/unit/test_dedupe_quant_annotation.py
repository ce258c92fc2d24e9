"""dedupe_initializers leaves alone a tensor a graph's quantization_annotation names (as the
annotated tensor or as one of its quantization parameters): dropped, the annotation would name
a tensor that is gone (onnx.checker does not look at annotations)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import passes

K = 32


@pytest.mark.parametrize("annotated,parameter", [("W2", "s"), ("y", "W2"), ("W1", "s")])
def test_an_annotated_tensor_is_not_merged(annotated, parameter):
    w = np.random.default_rng(0).standard_normal((K, K)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, K])],
                          [helper.make_tensor_value_info("y", 1, [1, K])],
                          [numpy_helper.from_array(w, "W1"), numpy_helper.from_array(w.copy(), "W2"),
                           numpy_helper.from_array(np.array(0.1, np.float32), "s")])
    qa = g.quantization_annotation.add()
    qa.tensor_name = annotated
    e = qa.quant_parameter_tensor_names.add()
    e.key, e.value = "SCALE_TENSOR", parameter
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    out = passes.dedupe_initializers(m, min_bytes=0)
    assert sorted(t.name for t in out.graph.initializer) == ["W1", "W2", "s"]
    onnx.checker.check_model(out, full_check=True)


def test_unannotated_equal_weights_still_merge():
    w = np.random.default_rng(0).standard_normal((K, K)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, K])],
                          [helper.make_tensor_value_info("y", 1, [1, K])],
                          [numpy_helper.from_array(w, "W1"), numpy_helper.from_array(w.copy(), "W2")])
    qa = g.quantization_annotation.add()
    qa.tensor_name = "a"
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    assert [t.name for t in passes.dedupe_initializers(m, min_bytes=0).graph.initializer] == ["W1"]
