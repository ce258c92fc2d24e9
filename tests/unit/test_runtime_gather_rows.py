"""mode="fold", float16 on a CPU: an embedding table read by a Gather through a constant
DequantizeLinear is kept 8-bit and its rows are dequantized as gathered
(runtime_fold.gather_dequantized_rows); outputs bit-identical to the folded model's."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes

CPU = ["CPUExecutionProvider"]
ROWS, WIDTH = 300, 96


def _table_model(per: str, zero_point: bool, ids_shape: list, opset: int = 19) -> onnx.ModelProto:
    """ids -> Gather(DequantizeLinear(table)) -> MatMul(float16 weight) -> y, scales spanning
    subnormal, normal and large float16 products (rounding at every edge)."""
    rng = np.random.default_rng(len(per) + zero_point)
    levels = rng.integers(0 if zero_point else -128, 256 if zero_point else 128, (ROWS, WIDTH))
    q = levels.astype(np.uint8 if zero_point else np.int8)
    count = {"tensor": 1, "row": ROWS, "column": WIDTH}[per]
    scale = (rng.random(count) * 10.0 ** rng.integers(-8, 1, count)).astype(np.float16)
    inits = [numpy_helper.from_array(q, "Eq"),
             numpy_helper.from_array(scale.reshape(()) if per == "tensor" else scale, "Es"),
             numpy_helper.from_array((rng.standard_normal((WIDTH, 64)) * 0.1).astype(np.float16), "W")]
    dq_inputs = ["Eq", "Es"]
    if zero_point:
        zp = rng.integers(0, 256, count).astype(np.uint8)
        inits.append(numpy_helper.from_array(zp.reshape(()) if per == "tensor" else zp, "Ez"))
        dq_inputs.append("Ez")
    axis = {"tensor": {}, "row": {"axis": 0}, "column": {"axis": 1}}[per]
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["E"], **axis),
             helper.make_node("Gather", ["E", "ids"], ["e"], axis=0),
             helper.make_node("MatMul", ["e", "W"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ids_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ids_shape + [64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(ids_shape):
    rng = np.random.default_rng(5)
    return [{"ids": rng.integers(-ROWS, ROWS, ids_shape).astype(np.int64)} for _ in range(3)]


def _folded_outputs(model, feeds):
    session = ort.InferenceSession(passes.fold_dequantize(model).SerializeToString(), providers=CPU)
    return [session.run(None, f)[0] for f in feeds]


@pytest.mark.parametrize("route", ["onnxruntime", "here"])
@pytest.mark.parametrize("per", ["tensor", "row", "column"])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("ids_shape", [[2, 7], []])
def test_rows_dequantized_as_gathered_match_the_folded_table(tmp_path, per, zero_point, ids_shape, route,
                                                             monkeypatch):
    """On either fold route of float16 weights on a CPU (the other weights left to onnxruntime, or
    folded here by the one-pass kernel: runtime_fold.fold_kernel_fast forced either way)."""
    import passes.runtime_fold

    monkeypatch.setattr(passes.runtime_fold, "fold_kernel_fast", lambda: route == "here")
    model = _table_model(per, zero_point, ids_shape)
    path = tmp_path / "emb.q8.onnx"
    onnx.save(model, str(path))
    packed = tmp_path / "emb.q8.onnxz"
    passes.pack(str(path), str(packed))
    feeds = _feeds(ids_shape)
    want = _folded_outputs(model, feeds)
    for source in (path, packed):
        session = passes.InferenceSession(source, mode="fold")
        assert session.fold_route == route and session.dtype == np.float16
        assert any("Eq: 8-bit embedding table kept" in line for line in session.notes)
        for f, expected in zip(feeds, want):
            got = session.run(None, f)[0]
            assert got.dtype == np.float16 and got.shape == expected.shape
            np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_table_read_elsewhere_or_gathered_on_another_axis_is_left_as_it_is():
    from passes.runtime_feed import split_model
    from passes.runtime_fold import gather_dequantized_rows

    model = _table_model("row", False, [2, 7])
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    shared.graph.node.append(helper.make_node("Identity", ["E"], ["E_copy"]))  # a second reader
    shared.graph.output.append(helper.make_tensor_value_info("E_copy", TensorProto.FLOAT16, [ROWS, WIDTH]))
    assert gather_dequantized_rows(split_model(shared)) == []
    in_branch = onnx.ModelProto()  # the table also read by name inside an If branch
    in_branch.CopyFrom(model)
    branch = helper.make_graph([helper.make_node("Identity", ["E"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT16, [ROWS, WIDTH])])
    in_branch.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    in_branch.graph.node.append(helper.make_node("If", ["c"], ["E_if"], then_branch=branch, else_branch=branch))
    in_branch.graph.output.append(helper.make_tensor_value_info("E_if", TensorProto.FLOAT16, [ROWS, WIDTH]))
    onnx.checker.check_model(in_branch, full_check=True)
    assert gather_dequantized_rows(split_model(in_branch)) == []
    other_axis = onnx.ModelProto()
    other_axis.CopyFrom(model)
    other_axis.graph.node[1].attribute[0].i = 1
    assert gather_dequantized_rows(split_model(other_axis)) == []
    split = split_model(model)
    assert gather_dequantized_rows(split) == ["Eq"]
    assert [n.op_type for n in split.skeleton.graph.node].count("DequantizeLinear") == 1
    assert not any(n.op_type == "DequantizeLinear" and n.input[0] == "Eq" for n in split.skeleton.graph.node)


def test_input_file_unchanged(tmp_path):
    model = _table_model("row", True, [2, 7])
    path = tmp_path / "emb.q8.onnx"
    onnx.save(model, str(path))
    before = path.read_bytes()
    passes.InferenceSession(path, mode="fold").run(None, _feeds([2, 7])[0])
    assert path.read_bytes() == before


def test_two_tables_among_many_nodes_each_node_kept_once():
    """Two tables (as MiniLM's word and position embeddings) among many other nodes: each table's
    DequantizeLinear and Gather are replaced, every other node is kept once and in order (the
    rewrite names nodes by object: those objects must live until the graph is rebuilt)."""
    from passes.runtime_feed import serialise_with_weights, split_model
    from passes.runtime_fold import gather_dequantized_rows

    rng = np.random.default_rng(9)
    inits, nodes = [], []
    for t in ("A", "B"):
        inits += [numpy_helper.from_array(rng.integers(-128, 128, (ROWS, WIDTH)).astype(np.int8), f"{t}q"),
                  numpy_helper.from_array(np.array(0.01, np.float16), f"{t}s")]
        nodes += [helper.make_node("DequantizeLinear", [f"{t}q", f"{t}s"], [f"{t}"]),
                  helper.make_node("Gather", [t, "ids"], [f"{t}_rows"], axis=0)]
    prev = "A_rows"
    for i in range(60):  # (node objects made and dropped between and after the tables)
        nodes.append(helper.make_node("Add", [prev, "B_rows"], [f"sum{i}"], name=f"add{i}"))
        prev = f"sum{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, [2, 3, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    split = split_model(model)
    assert sorted(gather_dequantized_rows(split)) == ["Aq", "Bq"]
    names = [n.name for n in split.skeleton.graph.node if n.op_type == "Add"]
    assert names == [f"add{i}" for i in range(60)]
    assert [n.op_type for n in split.skeleton.graph.node[:4]] == ["Gather", "DequantizeLinear"] * 2
    split.refresh_placeholders()
    pieces = serialise_with_weights(split.skeleton, split.weights, list(split.weights))
    session = ort.InferenceSession(b"".join(bytes(memoryview(p).cast("B")) for p in pieces), providers=CPU)
    assert session.run(None, _feeds([2, 3])[0])[0].shape == (2, 3, WIDTH)  # (a valid graph; the values:
    # the tests above, on graphs whose float16 arithmetic onnxruntime does alike folded or not)
