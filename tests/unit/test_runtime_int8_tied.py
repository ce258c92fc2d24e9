"""mode="int8" on a tied embedding table: one weight read by a Gather (the embedding) and by the
output projection (Gemm transB=1, or MatMul through Transpose, possibly behind Identity nodes).
Both readers get integer forms (MatMulNBits over the table's rows, a Gather of integer rows
dequantized as gathered) instead of one DequantizeLinear node onnxruntime ran in float on every
run."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes

V, D = 512, 64


def _table():
    return (np.random.default_rng(1).standard_normal((V, D)) * 0.5).astype(np.float32)


def _model(nodes, outputs, extra=()):
    inits = [numpy_helper.from_array(_table(), "E")] + list(extra)
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 7])],
                              outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _y(shape=(2, 7, V)):
    return helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))


def transpose_matmul():
    return _model([helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Tanh", ["h"], ["ht"]),
                   helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
                   helper.make_node("MatMul", ["ht", "Et"], ["y"])], [_y()])


def identity_transpose_matmul():
    return _model([helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Identity", ["E"], ["E_dec"]),
                   helper.make_node("Transpose", ["E_dec"], ["Et"], perm=[1, 0]),
                   helper.make_node("MatMul", ["h", "Et"], ["y"])], [_y()])


def gemm_trans_b():
    bias = numpy_helper.from_array((np.random.default_rng(2).standard_normal(V) * 0.1).astype(np.float32), "bias")
    return _model([helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Tanh", ["h"], ["ht"]),
                   helper.make_node("Reshape", ["ht", "flat"], ["h2"]),
                   helper.make_node("Gemm", ["h2", "E", "bias"], ["y"], transB=1)], [_y((14, V))],
                  [bias, numpy_helper.from_array(np.array([14, D], np.int64), "flat")])


def _feeds():
    rng = np.random.default_rng(3)
    return [{"ids": rng.integers(0, V, (2, 7)).astype(np.int64)} for _ in range(3)]


def _cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("build", [transpose_matmul, identity_transpose_matmul, gemm_trans_b])
def test_a_tied_table_stays_integer_for_both_readers(tmp_path, build):
    q8 = passes.quantize_weights(build(), bits=8, min_elements=256)
    path = tmp_path / "tied.q8.onnx"
    onnx.save(q8, str(path))
    packed = tmp_path / "tied.q8.onnxz"
    passes.pack(str(path), str(packed))
    folded = passes.InferenceSession(path, mode="fold")
    for source in (path, packed):
        session = passes.InferenceSession(source, mode="int8")
        assert session.op_counts.get("MatMulNBits") == 1
        assert not session.op_counts.get("DequantizeLinear") and not session.op_counts.get("Transpose")
        assert not session.op_counts.get("Identity")
        # no float copy of the table: its levels, once as rows and once in MatMulNBits' layout
        big = [a for a in session.weight_arrays.values() if a.size >= V * D // 2]
        assert big and all(a.dtype in (np.int8, np.uint8) for a in big)
        for feed in _feeds():
            got, want = session.run(None, feed)[0], folded.run(None, feed)[0]
            assert got.shape == want.shape
            assert _cosine(got, want) > 0.9999


def test_the_gathered_rows_are_the_folded_tables_rows(tmp_path):
    """The embedding side alone (the projection's output left out of the comparison): bit-identical
    to the folded table's rows."""
    m = transpose_matmul()
    m.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 7, D]))
    path = tmp_path / "tied.q8.onnx"
    onnx.save(passes.quantize_weights(m, bits=8, min_elements=256), str(path))
    session, folded = passes.InferenceSession(path, mode="int8"), passes.InferenceSession(path, mode="fold")
    assert session.op_counts.get("MatMulNBits") == 1
    for feed in _feeds():
        np.testing.assert_array_equal(session.run(["h"], feed)[0], folded.run(["h"], feed)[0])


def test_not_a_tied_projection_keeps_the_dequantize_node(tmp_path):
    """The table read as MatMul's B without a Transpose ([V, D] as [K, N]: not the projection of a
    tied table), or the transposed table also a graph output: left as it was."""
    w = numpy_helper.from_array((np.random.default_rng(4).standard_normal((2, 7, V)) * 0.1).astype(np.float32), "x")
    plain_b = _model([helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["x", "E"], ["y"])],
                     [_y((2, 7, D)), helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 7, D])], [w])
    exposed = transpose_matmul()
    exposed.graph.output.append(helper.make_tensor_value_info("Et", TensorProto.FLOAT, [D, V]))
    for i, m in enumerate((plain_b, exposed)):
        path = tmp_path / f"m{i}.q8.onnx"
        onnx.save(passes.quantize_weights(m, bits=8, min_elements=256), str(path))
        session = passes.InferenceSession(path, mode="int8")
        assert session.op_counts.get("DequantizeLinear") == 1 and not session.op_counts.get("MatMulNBits")
        folded = passes.InferenceSession(path, mode="fold")
        for feed in _feeds():
            for got, want in zip(session.run(None, feed), folded.run(None, feed)):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
