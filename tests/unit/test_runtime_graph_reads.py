"""runtime_feed.graph_reads without the names read (collect_used=False, the verbatim route's
walk): the same readers, outer-scope names and operator counts as the full walk."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from passes.runtime_feed import graph_reads, operator_counts


def _graph():
    """W read by MatMul and Add (inputs 1 and 0), V by a Gemm, U inside an If body only (an
    outer-scope read), Y a graph output."""
    rng = np.random.default_rng(0)
    w, v, u = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    body = helper.make_graph([helper.make_node("Add", ["a", "U"], ["bo"])], "body", [],
                             [helper.make_tensor_value_info("bo", TensorProto.FLOAT, [1, 8])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]),
             helper.make_node("Add", ["W", "a"], ["b"]),
             helper.make_node("Gemm", ["b", "V"], ["Y"]),
             helper.make_node("Relu", ["Y"], ["r"]),
             helper.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body)]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (v, "V"), (u, "U"))]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                                          helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                             [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8]),
                              helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8])], inits)


def test_readers_without_used_names_match_the_full_walk():
    graph = _graph()
    for names in ({"W": 0, "V": 0, "U": 0}, {"W", "V", "U"}, ["W", "V", "U"]):
        full, lean = graph_reads(graph, names), graph_reads(graph, names, collect_used=False)
        assert lean.used is None and {"x", "W", "a", "U", "Y"} <= full.used
        assert lean.readers == full.readers == {"W": [("", "MatMul", 1), ("", "Add", 0)], "V": [("", "Gemm", 1)]}
        assert lean.outer == full.outer and {"U", "a", "Y", "z"} <= lean.outer
        assert lean.op_counts == full.op_counts == operator_counts(graph)
        assert full.op_counts == {"MatMul": 1, "Add": 1, "Gemm": 1, "Relu": 1, "If": 1}
