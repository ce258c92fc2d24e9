"""passes.InferenceSession(mode="int8") keeps weights written as Cast+Mul of their levels (the
auto mode's form, passes.cast_levels) integer in memory: they are read as DequantizeLinear again
and take the same forms (MatMulNBits here), with the same outputs as the DequantizeLinear model."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.cast_levels import as_cast_mul, has_cast_mul


def _matmul_model():
    """x[3,256] -> MatMul(W1[256,128]) -> Gemm(W2[96,128], transB=1) -> y: big enough for MatMulNBits."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.normal(0, 0.05, (256, 128)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(0, 0.05, (96, 128)).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Gemm", ["h", "W2"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 96])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _weights_quantized(session):
    return all(a.dtype.kind in "iu" or a.size < 1024 for a in session.weight_arrays.values())


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True)])
def test_cast_mul_weights_stay_quantized_in_int8_mode(tmp_path, bits, symmetric):
    q = passes.quantize_weights(_matmul_model(), bits=bits, symmetric=symmetric, granularity="channel", min_elements=256)
    c = as_cast_mul(q, ["W1", "W2"])
    assert has_cast_mul(c) and not any(n.op_type == "DequantizeLinear" for n in c.graph.node)
    dq_path, cm_path = tmp_path / "dq.onnx", tmp_path / "cm.onnx"
    onnx.save(q, str(dq_path))
    onnx.save(c, str(cm_path))
    x = {"x": np.random.default_rng(1).normal(size=(3, 256)).astype(np.float32)}

    dq = passes.InferenceSession(str(dq_path), mode="int8")
    cm = passes.InferenceSession(str(cm_path), mode="int8")
    assert cm.op_counts.get("MatMulNBits") == dq.op_counts.get("MatMulNBits") == 2
    assert "Cast" not in cm.op_counts and "Mul" not in cm.op_counts
    assert _weights_quantized(cm) and _weights_quantized(dq)
    assert any("Cast+Mul" in line and "DequantizeLinear" in line for line in cm.notes)
    # the same int8 path: the same outputs, bit for bit
    assert cm.run(None, x)[0].tobytes() == dq.run(None, x)[0].tobytes()

    # mode="fold" stays as it was: the weights are float (onnxruntime folds Cast+Mul)
    folded = passes.InferenceSession(str(cm_path), mode="fold")
    assert "MatMulNBits" not in folded.op_counts
    want = passes.InferenceSession(str(dq_path), mode="fold").run(None, x)[0]
    assert np.allclose(folded.run(None, x)[0], want, rtol=1e-5, atol=1e-6)


def test_a_packed_cast_mul_model_stays_quantized_in_int8_mode(tmp_path):
    q = passes.quantize_weights(_matmul_model(), bits=8, granularity="channel", min_elements=256)
    onnx.save(as_cast_mul(q, ["W1", "W2"]), str(tmp_path / "cm.onnx"))
    passes.pack(str(tmp_path / "cm.onnx"), str(tmp_path / "cm.onnxz"))
    session = passes.InferenceSession(str(tmp_path / "cm.onnxz"), mode="int8")
    assert session.op_counts.get("MatMulNBits") == 2 and _weights_quantized(session)
