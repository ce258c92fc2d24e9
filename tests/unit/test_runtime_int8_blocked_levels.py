"""passes.InferenceSession(mode="int8") keeps the auto mode's blocked levels (Cast -> Mul -> Reshape,
cast_levels.as_blocked_cast_mul) integer in memory: read as a blocked DequantizeLinear (opset raised
to 21), then MatMulNBits with blocks of 64 along K; before, onnxruntime folded them to float."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import cast_levels, forms

K, N, BLOCK = 256, 96, 64
MIN_OUTPUT_SNR_DB = 30.0  # MatMulNBits' int8 activations (accuracy level 4) cost a few dB over the weights' error


def _model(trans_b: bool, opset: int):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K)).astype(np.float32)
    node = (helper.make_node("Gemm", ["x", "W"], ["y"], transB=1) if trans_b
            else helper.make_node("MatMul", ["x", "W"], ["y"]))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    qz = forms.quantize_blocks(w, 5, 1 if trans_b else 0, BLOCK)  # blocks along K
    return cast_levels.as_blocked_cast_mul(model, {"W": (qz.q, qz.scale, 1 if trans_b else 0, BLOCK)})


@pytest.fixture(params=[(False, 13), (True, 17)], ids=["matmul-opset13", "gemm-transB-opset17"])
def files(request, tmp_path):
    model = _model(*request.param)
    onnx.checker.check_model(model, full_check=True)
    assert cast_levels.blocked_patterns(model.graph)
    paths = {"cm": tmp_path / "cm.onnx", "dq": tmp_path / "dq.onnx", "float": tmp_path / "float.onnx",
             "packed": tmp_path / "cm.onnxz"}
    onnx.save(model, paths["cm"])
    dq = cast_levels.as_dequantize(model)  # the same levels as a blocked DequantizeLinear
    assert any(n.op_type == "DequantizeLinear" for n in dq.graph.node)
    onnx.save(dq, paths["dq"])
    onnx.save(cast_levels.fold_cast_mul(model), paths["float"])
    passes.pack(paths["cm"], paths["packed"])
    return paths


@pytest.mark.parametrize("source", ["cm", "packed"])
def test_blocked_levels_stay_integer_as_matmulnbits(files, source):
    before = hashlib.sha256(files[source].read_bytes()).hexdigest()
    session = passes.InferenceSession(files[source], mode="int8")
    assert hashlib.sha256(files[source].read_bytes()).hexdigest() == before  # input untouched
    assert session.op_counts.get("MatMulNBits") == 1
    assert not {"Cast", "Mul", "Reshape", "Gemm", "MatMul"} & set(session.op_counts), session.op_counts
    assert all(a.dtype.kind in "iu" or a.size < 1024 for a in session.weight_arrays.values())
    assert any("1 weight(s) written as Cast+Mul" in n for n in session.notes), session.notes
    assert not any("stay as they are" in n for n in session.notes), session.notes

    x = {"x": np.random.default_rng(5).standard_normal((3, K)).astype(np.float32)}
    got = session.run(None, x)[0]
    # the same int8 path as the blocked DequantizeLinear model: the same outputs, bit for bit
    assert got.tobytes() == passes.InferenceSession(files["dq"], mode="int8").run(None, x)[0].tobytes()
    want = ort.InferenceSession(str(files["float"]), providers=["CPUExecutionProvider"]).run(None, x)[0]
    want64 = want.astype(np.float64)
    assert 10 * np.log10(np.sum(want64 ** 2) / np.sum((want64 - got) ** 2)) >= MIN_OUTPUT_SNR_DB
