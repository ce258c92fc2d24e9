"""mode="int8" on a weight several MatMul/Gemm nodes read as B (a layer shared across blocks, or
equal weights stored once by dedupe_initializers): each reader becomes a MatMulNBits over one
packed copy of the levels, instead of one DequantizeLinear that onnxruntime ran in float at every
run (its own DequantizeLinear + MatMul fusion takes single-reader weights only)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes

N = 256


def _shared(op="MatMul", readers=2, bias=False):
    w = (np.random.default_rng(0).standard_normal((N, N)) * 0.05).astype(np.float32)
    attrs = {"transB": 1} if op == "Gemm" else {}
    nodes, x = [], "x"
    for i in range(readers):
        ins = [x, "W"] + (["b"] if bias else [])
        nodes.append(helper.make_node(op, ins, [f"h{i}"], **attrs))
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [f"t{i}"]))
        x = f"t{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    inits = [numpy_helper.from_array(w, "W")]
    if bias:
        inits.append(numpy_helper.from_array((np.arange(N) * 0.001).astype(np.float32), "b"))
    g = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _feed():
    return {"x": np.random.default_rng(1).standard_normal((3, N)).astype(np.float32)}


@pytest.mark.parametrize("op, readers, bias, bits", [("MatMul", 2, False, 8), ("MatMul", 3, False, 4),
                                                      ("Gemm", 2, True, 8)])
def test_each_reader_of_a_shared_weight_runs_matmulnbits_over_one_copy(tmp_path, op, readers, bias, bits):
    q = passes.quantize_weights(_shared(op, readers, bias), bits=bits, **({"granularity": "block", "block_size": 32}
                                                                          if bits == 4 else {}))
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 1  # one weight, several readers
    path = tmp_path / "shared.onnx"
    onnx.save(q, str(path))
    s = passes.InferenceSession(path, mode="int8")
    assert s.op_counts.get("MatMulNBits") == readers and not s.op_counts.get("DequantizeLinear")
    packed = [a for a in s.weight_arrays.values() if a.size >= N * N // (2 if bits == 4 else 1)]
    assert len(packed) == 1 and packed[0].dtype == np.uint8  # the levels once, in MatMulNBits' layout
    folded = passes.InferenceSession(path, mode="fold").run(None, _feed())[0]
    got = s.run(None, _feed())[0]
    cos = float(np.sum(got * folded) / np.linalg.norm(got) / np.linalg.norm(folded))
    assert cos > 0.999, cos


def test_readers_in_different_layouts_keep_the_dequantize(tmp_path):
    """MatMul reads W as [K, N], Gemm(transB=1) as [N, K]: one packed copy cannot serve both."""
    w = (np.random.default_rng(0).standard_normal((N, N)) * 0.05).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Gemm", ["h", "W"], ["y"], transB=1)],
                          "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])], [numpy_helper.from_array(w, "W")])
    q = tmp_path / "mixed.onnx"
    onnx.save(passes.quantize_weights(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])), str(q))
    s = passes.InferenceSession(q, mode="int8")
    assert not s.op_counts.get("MatMulNBits")
    np.testing.assert_allclose(s.run(None, _feed())[0], passes.InferenceSession(q, mode="fold").run(None, _feed())[0],
                               rtol=1e-4, atol=1e-4)
