"""mode="int8" on a model that quantizes its activations itself (onnxruntime's static QDQ:
QuantizeLinear -> DequantizeLinear before a MatMul): such a MatMul keeps its weight's
DequantizeLinear for onnxruntime's int8 QDQ kernels instead of becoming MatMulNBits, which would
quantize the activation a second time (a QDQ decoder's logits came out at 19.5 dB)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import passes


def _qdq_model():
    rng = np.random.default_rng(5)
    w1 = rng.integers(-127, 128, (256, 384), dtype=np.int8)
    w2 = (rng.standard_normal((384, 128)) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "W1q"), numpy_helper.from_array(np.full(384, 0.01, np.float32), "W1s"),
             numpy_helper.from_array(np.zeros(384, np.int8), "W1z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "xs"), numpy_helper.from_array(np.array(0, np.int8), "xz"),
             numpy_helper.from_array(w2, "W2")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["W1q", "W1s", "W1z"], ["W1"], axis=1),
             helper.make_node("MatMul", ["xd", "W1"], ["h"]),       # QDQ activation: left to onnxruntime
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]        # float activation: MatMulNBits
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 128])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_matmul_whose_input_the_model_quantizes_keeps_its_dequantize_node(tmp_path):
    m = _qdq_model()
    path = tmp_path / "qdq.onnx"
    onnx.save(m, str(path))
    session = passes.InferenceSession(path, mode="int8")
    assert session.op_counts.get("MatMulNBits") == 1  # W2 (float, quantized at load; its input is not QDQ)
    assert session.op_counts.get("DequantizeLinear") == 2  # the activation's and W1's
    assert any("quantizes itself (QDQ)" in line for line in session.notes)
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 256)).astype(np.float32)} for i in range(3)]
    # the QDQ MatMul alone against onnxruntime on the model itself: the same int8 kernel
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("h", TensorProto.FLOAT, [4, 384]))
    del m.graph.node[4:]
    onnx.save(m, str(tmp_path / "qdq_h.onnx"))
    ours = passes.InferenceSession(tmp_path / "qdq_h.onnx", mode="int8")
    theirs = ort.InferenceSession(str(tmp_path / "qdq_h.onnx"), providers=["CPUExecutionProvider"])
    assert not ours.op_counts.get("MatMulNBits")
    for feed in feeds:
        np.testing.assert_array_equal(ours.run(None, feed)[0], theirs.run(None, feed)[0])
        assert session.run(None, feed)[0].shape == (4, 128)
