"""Small generated models for the reliability tests (no corpus needed)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def matmul_model(n: int = 64, seed: int = 0, extra_identity: bool = False, opset: int = 17) -> onnx.ModelProto:
    """Y = X @ W (+ an Identity when `extra_identity`, so two models with one W shape differ in graph)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y0" if extra_identity else "Y"])]
    if extra_identity:
        nodes.append(helper.make_node("Identity", ["Y0"], ["Y"]))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def inlined(model_path) -> onnx.ModelProto:
    """The model at `model_path` with its external data read in (through our safe loader)."""
    from passes._fileio import load_model

    return load_model(Path(model_path))


def varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def nested_if_model_bytes(depth: int) -> bytes:
    """An ONNX file whose graph nests `depth` If subgraphs, written on the wire directly (building
    it as protobuf objects would need Python recursion as deep as the nesting)."""
    leaf = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))],
        "leaf", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])],
    )
    out_info = helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])
    inner = leaf.SerializeToString()
    for i in range(depth):
        node = helper.make_node("If", ["cond"], ["c"], else_branch=leaf)
        then_attr = onnx.AttributeProto(name="then_branch", type=onnx.AttributeProto.GRAPH).SerializeToString()
        then_attr += b"\x32" + varint(len(inner)) + inner               # AttributeProto.g (field 6)
        node_bytes = node.SerializeToString() + b"\x2a" + varint(len(then_attr)) + then_attr  # NodeProto.attribute (5)
        graph = onnx.GraphProto(name=f"g{i}")
        graph.output.append(out_info)
        inner = graph.SerializeToString() + b"\x0a" + varint(len(node_bytes)) + node_bytes  # GraphProto.node (1)
    shell = helper.make_model(helper.make_graph([], "main", [], []), opset_imports=[helper.make_opsetid("", 17)])
    shell.ClearField("graph")
    return shell.SerializeToString() + b"\x3a" + varint(len(inner)) + inner  # ModelProto.graph (7)
