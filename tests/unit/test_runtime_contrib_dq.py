"""Fold sessions take com.microsoft DequantizeLinear weights (onnxruntime's quantizer writes its
Q/DQ in that domain below opset 21, e.g. int4 weights at opset 18) as fold_dequantize does: folded
before onnxruntime sees the model, outputs those of the folded model, from .onnx and .onnxz."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes

CPU = ["CPUExecutionProvider"]


def _contrib_model():
    rng = np.random.default_rng(11)
    levels1 = rng.integers(-127, 128, (256, 128), dtype=np.int8)
    scale1 = (rng.random(128) * 0.01 + 0.001).astype(np.float32)
    zero1 = rng.integers(-3, 4, 128, dtype=np.int8)
    levels2 = rng.integers(0, 256, (128, 64), dtype=np.uint8)
    inits = [numpy_helper.from_array(levels1, "q1"), numpy_helper.from_array(scale1, "s1"),
             numpy_helper.from_array(zero1, "z1"), numpy_helper.from_array(levels2, "q2"),
             numpy_helper.from_array(np.array(0.004, np.float32), "s2"),
             numpy_helper.from_array(np.array(128, np.uint8), "z2")]
    nodes = [helper.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["w1"], axis=1, domain="com.microsoft"),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["w2"], domain="com.microsoft"),
             helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "contrib_dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contrib_dq")
    src = folder / "m.onnx"
    onnx.save(_contrib_model(), str(src))
    packed = folder / "m.onnxz"
    passes.pack(str(src), str(packed), force=True)
    return src, packed


@pytest.mark.parametrize("which", [0, 1], ids=["onnx", "onnxz"])
def test_fold_session_folds_contrib_dequantize_as_fold_does(files, which):
    src = files[0]
    folded = passes.fold_dequantize(str(src))
    assert not [n for n in folded.graph.node if n.op_type == "DequantizeLinear"]
    session = passes.InferenceSession(str(files[which]), providers=CPU, mode="fold")
    assert "DequantizeLinear" not in session.op_counts
    reference = ort.InferenceSession(folded.SerializeToString(), providers=CPU)
    x = {"x": np.random.default_rng(2).standard_normal((2, 256)).astype(np.float32)}
    np.testing.assert_array_equal(session.run(None, x)[0], reference.run(None, x)[0])


@pytest.mark.parametrize("which", [0, 1], ids=["onnx", "onnxz"])
def test_contrib_8bit_weights_take_the_one_pass_kernel(files, which, monkeypatch):
    import passes.runtime_fold as runtime_fold

    calls = []
    kernel = runtime_fold._dequantize

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(runtime_fold, "_dequantize", counting)
    passes.InferenceSession(str(files[which]), providers=CPU, mode="fold")
    assert sorted(calls) == [(128, 64), (256, 128)]
