"""mode="int8" on an IR 3 model, where every initializer is listed as a graph input too: a weight
quantized at load must leave the graph's inputs (it was left listed, and onnxruntime then asked
the caller to feed it: "Required inputs (['w']) are missing")."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import passes


def _ir3_model(path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    b = rng.standard_normal((128,)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [256, 128]),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, [128])]
    graph = helper.make_graph(nodes, "ir3", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 3
    onnx.save(model, path)
    return w, b


def test_int8_session_of_ir3_model_needs_only_the_real_inputs(tmp_path):
    src = tmp_path / "ir3.onnx"
    w, b = _ir3_model(src)
    before = src.read_bytes()
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    for path in (src, tmp_path / "ir3.onnxz"):
        if path.suffix == ".onnxz":
            passes.pack(src, path)
        sess = passes.InferenceSession(path, mode="int8")
        assert [i.name for i in sess.get_inputs()] == ["x"]
        (y,) = sess.run(None, {"x": x})
        ref = x @ w + b
        snr = 10 * np.log10(np.sum(ref ** 2) / np.sum((y - ref) ** 2))
        assert snr > 30, snr
        assert any("IR version raised from 3 to 4" in n for n in sess.notes)
        assert np.abs(y - ref).max() > 1e-4  # the weight ran quantized, not as the float original
    assert src.read_bytes() == before
