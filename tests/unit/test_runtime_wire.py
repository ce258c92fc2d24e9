"""runtime_wire.strip_main_graph_payloads: the skeleton is the model minus the big main-graph
payloads, byte for byte what protobuf would write, and each stripped payload views its tensor."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from passes.runtime_wire import strip_main_graph_payloads


def _model():
    rng = np.random.default_rng(0)
    big = rng.standard_normal((64, 64)).astype(np.float32)          # 16 KB: stripped
    small = rng.standard_normal((8, 64)).astype(np.float32)         # 2 KB: stays
    const_big = rng.standard_normal((64, 32)).astype(np.float32)    # Constant node value: stripped
    const_small = np.arange(4, dtype=np.int64)                      # Constant node value: stays
    body_w = rng.standard_normal((64, 64)).astype(np.float32)       # subgraph tensor: stays inline
    body = helper.make_graph([helper.make_node("MatMul", ["a", "BW"], ["bo"])], "body", [],
                             [helper.make_tensor_value_info("bo", TensorProto.FLOAT, [1, 64])],
                             [numpy_helper.from_array(body_w, "BW")])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]),
             helper.make_node("Constant", [], ["C"], value=numpy_helper.from_array(const_big, "C")),
             helper.make_node("Constant", [], ["S"], value=numpy_helper.from_array(const_small, "S")),
             helper.make_node("MatMul", ["a", "C"], ["y"]),
             helper.make_node("If", ["cond"], ["z"], then_branch=body, else_branch=body)]
    inits = [numpy_helper.from_array(big, "W"), numpy_helper.from_array(small, "SM")]
    inits += [numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), f"tiny{i}") for i in range(50)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), {"W": big, "C": const_big}


def test_skeleton_is_the_model_without_the_big_payloads():
    model, big = _model()
    buf = model.SerializeToString()
    skeleton_bytes, stripped = strip_main_graph_payloads(buf, 4096)
    assert sorted(s.name for s in stripped) == ["C", "W"]
    for s in stripped:
        np.testing.assert_array_equal(s.view(buf), big[s.name])
        assert s.constant_node == (s.name == "C")
    # what protobuf writes once the same payloads are cleared
    want = onnx.ModelProto()
    want.CopyFrom(model)
    for t in want.graph.initializer:
        if t.name == "W":
            t.ClearField("raw_data")
    want.graph.node[1].attribute[0].t.ClearField("raw_data")
    assert skeleton_bytes == want.SerializeToString()


def test_nothing_to_strip_leaves_the_bytes_as_they_are():
    model, _ = _model()
    buf = model.SerializeToString()
    skeleton_bytes, stripped = strip_main_graph_payloads(buf, 1 << 20)
    assert stripped == [] and skeleton_bytes == buf


def test_payload_between_other_fields_is_cut_out_alone():
    """A payload with fields on both sides (float_data lies between data_type and name; a
    doc_string follows raw_data): the fields around it are kept as protobuf writes them."""
    rng = np.random.default_rng(1)
    values = rng.standard_normal((32, 64)).astype(np.float32)
    packed = helper.make_tensor("P", TensorProto.FLOAT, values.shape, values.ravel().tolist())  # float_data
    raw = numpy_helper.from_array(values, "R")
    raw.doc_string = "after the payload"
    graph = helper.make_graph([helper.make_node("Add", ["P", "R"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(values.shape))], [packed, raw])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    buf = model.SerializeToString()
    skeleton_bytes, stripped = strip_main_graph_payloads(buf, 4096)
    assert [(s.name, s.field) for s in stripped] == [("P", "float_data"), ("R", "raw_data")]
    for s in stripped:
        np.testing.assert_array_equal(s.view(buf), values)
    want = onnx.ModelProto()
    want.CopyFrom(model)
    want.graph.initializer[0].ClearField("float_data")
    want.graph.initializer[1].ClearField("raw_data")
    assert skeleton_bytes == want.SerializeToString()
    assert onnx.load_from_string(skeleton_bytes).graph.initializer[1].doc_string == "after the payload"
