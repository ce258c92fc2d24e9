"""dedupe_initializers on a model with training_info (ONNX TrainingInfoProto): an initializer the
training algorithm updates (update_binding / initialization_binding) or reads by name is neither
dropped nor the tensor others are repointed to: merged, the algorithm would name a tensor that is
gone, or training one weight would change its twin's readers too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import passes

K = 32


def _model(binding: str, read_in_algorithm: bool = True):
    """y = x @ W1 @ W2 with W2 == W1; the training algorithm updates (or only reads) W1 or W2."""
    w = np.random.default_rng(0).standard_normal((K, K)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, K])],
                          [helper.make_tensor_value_info("y", 1, [1, K])],
                          [numpy_helper.from_array(w, "W1"), numpy_helper.from_array(w.copy(), "W2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    ti = m.training_info.add()
    read = binding if read_in_algorithm else "lr"
    ti.algorithm.CopyFrom(helper.make_graph(
        [helper.make_node("Mul", [read, "lr"], ["new"])], "alg", [],
        [helper.make_tensor_value_info("new", 1, None)], [numpy_helper.from_array(np.array(0.5, np.float32), "lr")]))
    b = ti.update_binding.add()
    b.key, b.value = binding, "new"
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("binding", ["W1", "W2"])
@pytest.mark.parametrize("read_in_algorithm", [True, False])
def test_a_trained_weight_is_not_merged(binding, read_in_algorithm):
    m = _model(binding, read_in_algorithm)
    out = passes.dedupe_initializers(m, min_bytes=0)
    assert sorted(t.name for t in out.graph.initializer) == ["W1", "W2"]
    assert [n.input[1] for n in out.graph.node] == ["W1", "W2"]
    assert out.training_info[0].update_binding[0].key == binding
    onnx.checker.check_model(out, full_check=True)


def test_a_weight_the_algorithm_reads_is_not_merged():
    """W2 read by the algorithm (not updated: the binding updates lr's product into W1)."""
    m = _model("W1")
    m.training_info[0].algorithm.node[0].input[1] = "W2"  # new = W1 * W2
    out = passes.dedupe_initializers(m, min_bytes=0)
    assert sorted(t.name for t in out.graph.initializer) == ["W1", "W2"]


def test_weights_training_does_not_touch_still_merge():
    m = _model("W1")
    extra = numpy_helper.from_array(np.full((K, K), 3, np.float32), "C1")
    m.graph.initializer.extend([extra, numpy_helper.from_array(np.full((K, K), 3, np.float32), "C2")])
    m.graph.node.extend([helper.make_node("Add", ["C1", "C2"], ["s"])])
    m.graph.output.extend([helper.make_tensor_value_info("s", 1, [K, K])])
    out = passes.dedupe_initializers(m, min_bytes=0)
    assert sorted(t.name for t in out.graph.initializer) == ["C1", "W1", "W2"]
