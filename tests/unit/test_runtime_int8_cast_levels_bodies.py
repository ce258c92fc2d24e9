"""passes.InferenceSession(mode="int8") reads Cast(levels) -> [Sub] -> Mul(scale) weights inside
If / Loop bodies as DequantizeLinear too (in their body, levels inline), as it does for the main
graph: left as they were, onnxruntime folded them to float at load. Same outputs as the model
with DequantizeLinear written in the bodies (cast_levels.as_dequantize)."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.cast_levels import as_dequantize, has_cast_mul
from passes.runtime_int8 import prepare_quantized
from passes.runtime_source import read_split

K = N = 64
MIN_OUTPUT_SNR_DB = 30.0  # as test_runtime_int8_subgraph: int8 activations cost a few dB over the weights' error


def _levels(seed: int, zero_point: bool):
    """Int8 levels [K, N] with one scale per output column (and a zero point per column)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-100, 100, (K, N)).astype(np.int8)
    scale = rng.uniform(0.002, 0.004, N).astype(np.float32)
    zp = rng.integers(-3, 4, N).astype(np.float32) if zero_point else None
    return q, scale, zp


def _cast_mul(prefix: str, seed: int, zero_point: bool):
    """(nodes, initializers) computing `prefix` = (float(levels) [- zp]) * scale, as cast_levels writes it."""
    q, scale, zp = _levels(seed, zero_point)
    inits = [numpy_helper.from_array(q, prefix + "_quantized"), numpy_helper.from_array(scale, prefix + "_scale")]
    nodes = [helper.make_node("Cast", [prefix + "_quantized"], [prefix + "_levels"], to=TensorProto.FLOAT)]
    levels = prefix + "_levels"
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, prefix + "_zero_point"))
        nodes.append(helper.make_node("Sub", [levels, prefix + "_zero_point"], [prefix + "_centred"]))
        levels = prefix + "_centred"
    nodes.append(helper.make_node("Mul", [levels, prefix + "_scale"], [prefix]))
    return nodes, inits


def if_model():
    """y = If(c, then: x @ Wt, else: x @ We), each weight a Cast+Mul of the branch's own initializers."""
    branches = {}
    for name, weight, out, seed, zp in (("then", "Wt", "yt", 1, False), ("else", "We", "ye", 2, True)):
        nodes, inits = _cast_mul(weight, seed, zp)
        branches[name] = helper.make_graph(nodes + [helper.make_node("MatMul", ["x", weight], [out])], name, [],
                                           [helper.make_tensor_value_info(out, TensorProto.FLOAT, [4, N])], inits)
    node = helper.make_node("If", ["c"], ["y"], then_branch=branches["then"], else_branch=branches["else"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, N])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def loop_model():
    """h = x; 3 times: h = Tanh(h @ Wl) with Wl a Cast+Mul of the body's initializers."""
    nodes, inits = _cast_mul("Wl", 3, False)
    body = helper.make_graph(
        nodes + [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                 helper.make_node("MatMul", ["h_in", "Wl"], ["hm"]), helper.make_node("Tanh", ["hm"], ["h_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [4, K])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [4, N])], inits)
    node = helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, N])],
                              [numpy_helper.from_array(np.array(3, np.int64), "trips")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(name):
    x = np.random.default_rng(5).standard_normal((4, K)).astype(np.float32)
    return [{"c": np.array(flag), "x": x} for flag in (True, False)] if name == "if" else [{"x": x}]


def _bodies(graph):
    return [g for node in graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for g in [a.g]]


@pytest.fixture(scope="module", params=["if", "loop"])
def files(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bodies")
    model = {"if": if_model, "loop": loop_model}[request.param]()
    onnx.checker.check_model(model, full_check=True)
    assert has_cast_mul(model)
    paths = {"name": request.param, "cm": folder / "cm.onnx", "dq": folder / "dq.onnx", "packed": folder / "cm.onnxz"}
    onnx.save(model, paths["cm"])
    onnx.save(as_dequantize(model), paths["dq"])
    passes.pack(paths["cm"], paths["packed"])
    return paths


def test_body_cast_mul_becomes_dequantize_linear_in_its_body(files):
    split = read_split(files["cm"])
    split.wait_weights()
    notes = []
    prepare_quantized(split, bits=8, options=ort.SessionOptions(), notes=notes)
    bodies = _bodies(split.skeleton.graph)
    assert bodies
    for body in bodies:
        ops = [n.op_type for n in body.node]
        assert ops.count("DequantizeLinear") == 1 and "Cast" not in ops and "Mul" not in ops and "Sub" not in ops, ops
        levels = {t.name: t.data_type for t in body.initializer}
        dq = next(n for n in body.node if n.op_type == "DequantizeLinear")
        assert levels[dq.input[0]] == TensorProto.INT8  # integer in memory, in the body
    count = len(bodies)
    assert any(f"{count} weight(s) written as Cast+Mul" in n and f"{count} of them in If/Loop/Scan bodies" in n
               for n in notes), notes


@pytest.mark.parametrize("source", ["cm", "packed"])
def test_int8_session_runs_body_levels_as_the_dequantize_model(files, source):
    before = hashlib.sha256(files[source].read_bytes()).hexdigest()
    session = passes.InferenceSession(files[source], mode="int8")
    assert hashlib.sha256(files[source].read_bytes()).hexdigest() == before  # input untouched
    want = passes.InferenceSession(files["dq"], mode="int8")
    reference = ort.InferenceSession(str(files["cm"]), providers=["CPUExecutionProvider"])
    for feed in _feeds(files["name"]):
        got = session.run(None, feed)[0]
        assert got.tobytes() == want.run(None, feed)[0].tobytes()
        # onnxruntime fuses the body's DequantizeLinear + MatMul to MatMulNBits, int8 activations
        # included (as in the main graph in this mode): close to the float model, not equal
        ref = reference.run(None, feed)[0].astype(np.float64)
        assert 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2)) >= MIN_OUTPUT_SNR_DB
