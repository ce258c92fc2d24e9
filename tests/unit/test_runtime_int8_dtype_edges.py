"""mode="int8" / "int4" (and the dtype= conversion) on models whose float type or layout the
quantized load-time rewrite used to get wrong:

- a DequantizeLinear left inside an If/Loop/Scan body that computes in float16 (dtype="float16",
  or a float16 model): onnxruntime (1.32, EXTENDED level) fuses it with its MatMul into a
  MatMulNBits whose branch then yields zeros. Such weights are folded to float at load, with a note.
- dtype="float16" on an opset 13-18 model whose DequantizeLinear stays in the main graph: the
  converter made its scale float16, which DequantizeLinear takes from opset 19 only.
- a float64 model: MatMulNBits takes no double; its weights stay float, with a note.
- weights also listed as graph inputs (IR >= 4, torch keep_initializers_as_inputs=True): left
  float (overridable by the caller), with a note; the session needs no weight fed.
- a float64 model: `dtype` says float64, a conversion to float16 / float32 is refused.

Every case is checked against onnxruntime on the float model (output SNR / cosine), in each mode /
dtype pair it concerns.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import InvalidArgumentError

D = 64


def _snr_db(ref, got) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - got) ** 2), 1e-300)))


def _cosine(ref, got) -> float:
    ref, got = np.asarray(ref, np.float64).ravel(), np.asarray(got, np.float64).ravel()
    return float(ref @ got / max(np.linalg.norm(ref) * np.linalg.norm(got), 1e-300))


def _weight(rng, shape, dtype=np.float32):
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)


def _reference(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _save(model, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    onnx.save(model, path)
    return path


# ---------------------------------------------------------------------- control flow

def control_flow_model(kind: str, dtype=np.float32, opset: int = 16) -> onnx.ModelProto:
    """x [4, D] -> a body holding a D x D MatMul weight of its own -> MatMul(Wout). kind: "if" (the
    condition computed from x, so onnxruntime cannot inline a branch), "loop" (3 iterations of
    tanh(h @ W)), "scan" (a recurrence over the rows of x)."""
    rng = np.random.default_rng({"if": 1, "loop": 2, "scan": 3}[kind])
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def vi(name, shape, e=elem):
        return helper.make_tensor_value_info(name, e, shape)

    inits = [numpy_helper.from_array(_weight(rng, (D, D), dtype), "Wout")]
    if kind == "if":
        then_g = helper.make_graph([helper.make_node("MatMul", ["x", "Wa"], ["t"])], "then", [], [vi("t", None)],
                                   [numpy_helper.from_array(_weight(rng, (D, D), dtype), "Wa")])
        else_g = helper.make_graph([helper.make_node("MatMul", ["x", "Wb"], ["e"])], "else", [], [vi("e", None)],
                                   [numpy_helper.from_array(_weight(rng, (D, D), dtype), "Wb")])
        nodes = [helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
                 helper.make_node("Greater", ["sx", "zero"], ["c"]),
                 helper.make_node("If", ["c"], ["b"], then_branch=then_g, else_branch=else_g)]
        inits.append(numpy_helper.from_array(np.array(0, dtype), "zero"))
    elif kind == "loop":
        body = helper.make_graph(
            [helper.make_node("MatMul", ["h", "Wl"], ["hm"]), helper.make_node("Tanh", ["hm"], ["hn"]),
             helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
            [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL), vi("h", None)],
            [vi("cond_out", [], TensorProto.BOOL), vi("hn", None)],
            [numpy_helper.from_array(_weight(rng, (D, D), dtype), "Wl")])
        nodes = [helper.make_node("Loop", ["trip", "", "x"], ["b"], body=body)]
        inits.append(numpy_helper.from_array(np.array(3, np.int64), "trip"))
    else:
        body = helper.make_graph(
            [helper.make_node("MatMul", ["state", "Ws"], ["sm"]), helper.make_node("Add", ["sm", "row"], ["sa"]),
             helper.make_node("Tanh", ["sa"], ["sn"]), helper.make_node("Identity", ["sn"], ["so"])], "body",
            [vi("state", [1, D]), vi("row", [1, D])], [vi("sn", [1, D]), vi("so", [1, D])],
            [numpy_helper.from_array(_weight(rng, (D, D), dtype), "Ws")])
        nodes = [helper.make_node("Unsqueeze", ["x", "axis1"], ["x3"]),
                 helper.make_node("Scan", ["s0", "x3"], ["final", "rows"], body=body, num_scan_inputs=1),
                 helper.make_node("Squeeze", ["rows", "axis1"], ["b"])]
        inits += [numpy_helper.from_array(np.zeros((1, D), dtype), "s0"),
                  numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes.append(helper.make_node("MatMul", ["b", "Wout"], ["y"]))
    graph = helper.make_graph(nodes, kind, [vi("x", [4, D])], [vi("y", [4, D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _x(dtype=np.float32, seed=11):
    return {"x": np.random.default_rng(seed).standard_normal((4, D)).astype(dtype)}


def _control_flow_file(tmp_path, kind, dtype, form):
    """(path, float model): the model as is ("float") or compressed by quantize_weights ("q8", "q4":
    its body weights become DequantizeLinear nodes inside the body)."""
    model = control_flow_model(kind, dtype)
    written = model if form == "float" else passes.quantize_weights(model, bits=int(form[1]), min_elements=16)
    return _save(written, tmp_path, f"{kind}_{np.dtype(dtype).name}_{form}.onnx"), model


# output SNR bounds against onnxruntime on the float model: 8-bit weights ~37-45 dB measured, 4-bit
# ones 13-21 dB (a 3-step Loop compounds the error); a zero output is -0 dB
_MIN_SNR = {("q8", "int8"): 30.0, ("q8", "int4"): 30.0, ("q4", "int8"): 10.0, ("q4", "int4"): 10.0,
            ("float", "int8"): 30.0, ("float", "int4"): 15.0}


@pytest.mark.parametrize("form", ["float", "q8", "q4"])
@pytest.mark.parametrize("kind", ["if", "loop", "scan"])
@pytest.mark.parametrize("model_dtype, dtype", [(np.float32, "float16"), (np.float16, None), (np.float16, "float16")])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_body_weights_computed_in_float16_are_right(tmp_path, form, kind, model_dtype, dtype, mode):
    """A float16 body's DequantizeLinear nodes are folded at load (below opset 19 too), with a
    note; before, `if` / `loop` bodies gave all-zero outputs (onnxruntime's float16 QDQ fusion)
    or the session was refused (a float16 scale below opset 19)."""
    path, model = _control_flow_file(tmp_path, kind, model_dtype, form)
    feeds = _x(model_dtype)
    ref = _reference(model, feeds)
    sess = passes.InferenceSession(path, mode=mode, dtype=dtype)
    got = sess.run(None, feeds)[0]
    assert sess.dtype == np.float16
    assert np.any(got != 0)
    snr = _snr_db(ref, got)
    assert snr >= _MIN_SNR[form, mode], (snr, sess.notes)
    assert _cosine(ref, got) >= 0.99 if form != "q4" else 0.9
    folded = [line for line in sess.notes if "inside If/Loop/Scan bodies folded to float" in line]
    if form != "float" and kind != "loop":  # (the loop's weight is read from the main graph: not in the body)
        assert folded, sess.notes


@pytest.mark.parametrize("kind", ["if", "loop", "scan"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float32_bodies_keep_their_dequantize(tmp_path, kind, mode):
    """Without float16 nothing is folded: the body's weights stay int8 in memory (the note of
    the float16 bodies' fold is absent), outputs as before."""
    path, model = _control_flow_file(tmp_path, kind, np.float32, "q8")
    feeds = _x()
    sess = passes.InferenceSession(path, mode=mode)
    assert _snr_db(_reference(model, feeds), sess.run(None, feeds)[0]) >= 30.0
    assert not any("folded to float" in line for line in sess.notes), sess.notes


@pytest.mark.parametrize("kind", ["if", "scan"])
def test_body_weights_quantized_at_load_beside_fed_weights(tmp_path, kind):
    """The body weights of a float model are quantized at load by quantize_weights also when the
    main graph holds a weight fed to onnxruntime (Wout here): before, the pass was called with
    that weight as an external-data placeholder and refused the model, and the body weights stayed
    float with the refusal as a note."""
    path, model = _control_flow_file(tmp_path, kind, np.float32, "float")
    feeds = _x()
    sess = passes.InferenceSession(path, mode="int8")
    assert any("in subgraphs) quantized at load by quantize_weights" in line for line in sess.notes), sess.notes
    assert not any("refused" in line for line in sess.notes), sess.notes
    assert _snr_db(_reference(model, feeds), sess.run(None, feeds)[0]) >= 30.0


# ---------------------------------------------------------------------- main-graph DequantizeLinear, old opset

def transposed_weight_model(opset: int) -> onnx.ModelProto:
    """x [2, 5, 64] -> MatMul(x, Transpose(Wqkv [192, 64])) -> Relu -> Conv-free projection
    MatMul(W2 [192, 64]): Wqkv's DequantizeLinear stays in int8 mode (read through a Transpose)."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Transpose", ["Wqkv"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Wt"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "attention_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, D])],
                              [numpy_helper.from_array(_weight(rng, (3 * D, D)), "Wqkv"),
                               numpy_helper.from_array(_weight(rng, (3 * D, D)), "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("opset", [13, 17, 21])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_main_graph_dequantize_converted_to_float16(tmp_path, opset, mode):
    """dtype="float16" on a compressed model whose DequantizeLinear stays in the main graph:
    below opset 19 the node is kept float32 (its scale too) with a Cast to float16 after it;
    before, onnxruntime refused the session (a float16 scale needs DequantizeLinear-19)."""
    model = transposed_weight_model(opset)
    quantized = passes.quantize_weights(model, bits=8)
    assert quantized.opset_import[0].version == max(opset, 13)
    path = _save(quantized, tmp_path, f"t{opset}.onnx")
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 5, D)).astype(np.float32)}
    ref = _reference(model, feeds)
    sess = passes.InferenceSession(path, mode=mode, dtype="float16")
    got = sess.run(None, feeds)[0]
    assert sess.dtype == np.float16
    assert _snr_db(ref, got) >= 30.0
    assert _cosine(ref, got) >= 0.999


# ---------------------------------------------------------------------- float64 models

def float64_model() -> onnx.ModelProto:
    """x [3, 96] float64 -> MatMul(W1 [96, 96]) -> Tanh -> MatMul(W2 [96, 48]): float64 throughout."""
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("MatMul", ["t", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "double", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3, 48])],
                              [numpy_helper.from_array(_weight(rng, (96, 96), np.float64), "W1"),
                               numpy_helper.from_array(_weight(rng, (96, 48), np.float64), "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _float64_feeds():
    return {"x": np.random.default_rng(4).standard_normal((3, 96))}


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("mode", ["fold", "int8", "int4", "auto"])
def test_float64_model_runs_in_float64(tmp_path, compressed, mode):
    """int8 / int4 keep main-graph float64 weights float (MatMulNBits takes no double;
    before, the session was refused), with a note; every mode says dtype float64 and gives the float
    model's outputs exactly (nothing is quantized). `compressed`: quantize_weights' output (the default
    compress command), which quantizes float64 weights (DequantizeLinear with a float32
    scale -> Cast(DOUBLE)): every mode still says float64 and runs it, within int8's error."""
    model = float64_model()
    written = passes.quantize_weights(model, bits=8) if compressed else model
    path = _save(written, tmp_path, "double.onnx")
    feeds = _float64_feeds()
    ref = _reference(model, feeds)
    sess = passes.InferenceSession(path, mode=mode)
    got = sess.run(None, feeds)[0]
    assert sess.dtype == np.float64
    assert got.dtype == np.float64
    if compressed:
        assert 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2)) > 35.0
    else:
        np.testing.assert_array_equal(got, ref)
    if mode in ("int8", "int4") and not compressed:
        assert any("stay float: float64" in line for line in sess.notes), sess.notes


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mode", ["fold", "int8"])
def test_float64_model_conversion_refused(tmp_path, dtype, mode):
    """dtype= cannot convert a float64 model (onnxruntime's converter and ours take float32 /
    float16 only): refused naming why; before, the session ran in float64 and said float16."""
    path = _save(float64_model(), tmp_path, "double.onnx")
    with pytest.raises(InvalidArgumentError, match="float64"):
        passes.InferenceSession(path, mode=mode, dtype=dtype)


def float64_body_model(weight_in_body: bool) -> onnx.ModelProto:
    """x [3, 96] float64 -> If(c: x @ W, else: zeros): W [96, 48] float64 a Constant node in the
    then-branch (`weight_in_body`) or a main-graph initializer the branch reads (outer scope). The
    model's only weight: nothing else calls the load-time pass."""
    w = numpy_helper.from_array(_weight(np.random.default_rng(12), (96, 48), np.float64), "W")
    then_nodes = [helper.make_node("MatMul", ["x", "W"], ["yt"])]
    if weight_in_body:
        then_nodes.insert(0, helper.make_node("Constant", [], ["W"], value=w))
    out = lambda name: [helper.make_tensor_value_info(name, TensorProto.DOUBLE, [3, 48])]
    branch = helper.make_node("If", ["c"], ["y"], then_branch=helper.make_graph(then_nodes, "then", [], out("yt")),
                              else_branch=helper.make_graph([helper.make_node("Identity", ["zeros"], ["ye"])],
                                                            "else", [], out("ye")))
    inits = [numpy_helper.from_array(np.zeros((3, 48)), "zeros")] + ([] if weight_in_body else [w])
    graph = helper.make_graph([branch], "double_body", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                                        helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 96])],
                              out("y"), inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("weight_in_body", [True, False])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float64_weights_of_subgraphs_are_quantized_at_load(tmp_path, weight_in_body, mode):
    """A float64 weight in a body, or read in one, is quantized at load like a float32 one there
    (quantize_weights' DequantizeLinear -> Cast(DOUBLE), dequantized per run), also when it is the
    model's only weight: before, the pass ran only when some other weight called it."""
    model = float64_body_model(weight_in_body)
    path = _save(model, tmp_path, "double_body.onnx")
    feeds = {"c": np.array(True), **_float64_feeds()}
    ref = _reference(model, feeds)
    sess = passes.InferenceSession(path, mode=mode)
    got = sess.run(None, feeds)[0]
    assert sess.dtype == np.float64 and got.dtype == np.float64
    assert 35.0 < _snr_db(ref, got) < 80.0  # quantized (not float64's exact outputs), within int8's error
    assert any("1 weight(s)" in line and "quantized at load by quantize_weights" in line for line in sess.notes), sess.notes
    assert not any("stay float" in line for line in sess.notes), sess.notes


# ---------------------------------------------------------------------- weights listed as graph inputs

def listed_weights_model() -> onnx.ModelProto:
    """torch's keep_initializers_as_inputs=True export of Linear(64, 256)-ReLU-Linear(256, 10), IR 7:
    every initializer is also a graph input (the caller may override it)."""
    rng = np.random.default_rng(6)
    inits = {"0.weight": _weight(rng, (64, 256)), "0.bias": _weight(rng, (256,)) * 0.1,
             "2.weight": _weight(rng, (256, 10)), "2.bias": _weight(rng, (10,)) * 0.1}
    nodes = [helper.make_node("Gemm", ["x", "0.weight", "0.bias"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "2.weight", "2.bias"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])] + [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in inits.items()]
    graph = helper.make_graph(nodes, "kiai", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])],
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("dtype", [None, "float16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weights_listed_as_inputs_stay_float(tmp_path, mode, dtype):
    """A float weight also listed as a graph input stays float and overridable, with a note;
    before, it became a DequantizeLinear output and its listing a required input (run() failed)."""
    model = listed_weights_model()
    path = _save(model, tmp_path, "kiai.onnx")
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)}
    ref = _reference(model, feeds)
    sess = passes.InferenceSession(path, mode=mode, dtype=dtype)
    assert [i.name for i in sess.get_inputs()] == ["x"]
    assert "0.weight" in {i.name for i in sess.get_overridable_initializers()}
    got = sess.run(None, feeds)[0]
    assert _snr_db(ref, got) >= (100.0 if dtype is None else 40.0)
    assert any("stay float: also a graph input (overridable by the caller)" in line for line in sess.notes), sess.notes
    # the caller's override is used
    feeds2 = dict(feeds, **{"0.weight": np.zeros((64, 256), np.float32)})
    bias = np.maximum(numpy_helper.to_array(model.graph.initializer[1]), 0)
    expected = bias @ numpy_helper.to_array(model.graph.initializer[2]) + numpy_helper.to_array(model.graph.initializer[3])
    np.testing.assert_allclose(sess.run(None, feeds2)[0], np.broadcast_to(expected, (2, 10)),
                               rtol=1e-2 if dtype else 1e-5, atol=1e-3 if dtype else 1e-6)


@pytest.mark.parametrize("dtype", [None, "float16"])
@pytest.mark.parametrize("mode", ["fold", "int8", "int4"])
def test_quantized_tensors_listed_as_inputs_are_unlisted(tmp_path, mode, dtype):
    """A compressed model whose levels and scales are listed as graph inputs (IR >= 4): unlisted
    at load, with a note (rewritten or folded, they would be required inputs)."""
    model = listed_weights_model()
    for i in reversed(range(1, len(model.graph.input))):  # compress the float model, then list every initializer
        del model.graph.input[i]
    quantized = passes.quantize_weights(model, bits=8)
    for t in quantized.graph.initializer:
        if t.name not in {v.name for v in quantized.graph.input}:
            quantized.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    path = _save(quantized, tmp_path, "kiai_q8.onnx")
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)}
    sess = passes.InferenceSession(path, mode=mode, dtype=dtype)
    assert [i.name for i in sess.get_inputs()] == ["x"]
    assert any("listed as graph inputs: unlisted" in line for line in sess.notes), sess.notes
    assert _snr_db(_reference(model, feeds), sess.run(None, feeds)[0]) >= 30.0


# ---------------------------------------------------------------------- models made by onnxruntime's float16 converter

def constant_weight_model() -> onnx.ModelProto:
    """x [4, D] -> MatMul(W1) -> Relu -> MatMul(W2): float32, its weights Constant nodes (as in
    rapidocr's models), then converted to float16 by onnxruntime's converter (keep_io_types: its
    Casts are named graph_input_cast0 / graph_output_cast0, their values graph_input_cast_0 ...)."""
    from onnxruntime.transformers import float16 as ort_float16

    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Constant", [], ["W1"], value=numpy_helper.from_array(_weight(rng, (D, 2 * D)), "W1")),
             helper.make_node("Constant", [], ["W2"], value=numpy_helper.from_array(_weight(rng, (2 * D, D)), "W2")),
             helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "constants", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, D])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    converted = ort_float16.convert_float_to_float16(model, keep_io_types=True)
    assert "graph_input_cast0" in {n.name for n in converted.graph.node}
    # (the converter appends its input Casts after the nodes that read them: sorted as a saved file is)
    order = sorted(converted.graph.node, key=lambda n: (0 if n.name.startswith("graph_input_cast") else
                                                       2 if n.name.startswith("graph_output_cast") else 1))
    order = [onnx.NodeProto.FromString(n.SerializeToString()) for n in order]
    del converted.graph.node[:]
    converted.graph.node.extend(order)
    onnx.checker.check_model(converted, full_check=True)
    return converted


@pytest.mark.parametrize("dtype", [None, "float16", "float32"])
@pytest.mark.parametrize("mode", ["fold", "int8"])
def test_converted_float16_model_with_constant_weights(tmp_path, mode, dtype):
    """The README example on rapidocr_cls_fp16: a quantized float16 model whose
    scales are Constant nodes is a float16 model (dtype said float32: the scales were counted only
    as initializers), and converting a model onnxruntime's converter made does not give two nodes
    one name (graph_input_cast0: onnxruntime refused the session)."""
    model = constant_weight_model()
    quantized = passes.quantize_weights(model, bits=8, min_elements=16)
    assert any(n.op_type == "DequantizeLinear" for n in quantized.graph.node)
    path = _save(quantized, tmp_path, "constants_q8.onnx")
    feeds = _x(np.float32)
    ref = _reference(model, feeds)
    sess = passes.InferenceSession(path, mode=mode, dtype=dtype)
    assert sess.dtype == np.dtype(dtype or np.float16)
    got = sess.run(None, feeds)[0]
    assert _snr_db(ref, got) >= 30.0
    assert _cosine(ref, got) >= 0.999


@pytest.mark.parametrize("mode", ["fold", "int8"])
def test_float32_model_holding_converter_names_converts(tmp_path, mode):
    """B2 on a float32 model whose nodes / values already carry the converter's Cast names: they
    are renamed before the conversion to float16, outputs as the float model's."""
    rng = np.random.default_rng(12)
    nodes = [helper.make_node("Relu", ["x"], ["graph_input_cast_0"], name="graph_input_cast0"),
             helper.make_node("MatMul", ["graph_input_cast_0", "W"], ["graph_output_cast_0"], name="graph_output_cast0"),
             helper.make_node("Tanh", ["graph_output_cast_0"], ["y"])]
    graph = helper.make_graph(nodes, "names", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, D])],
                              [numpy_helper.from_array(_weight(rng, (D, D)), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path = _save(passes.quantize_weights(model, bits=8, min_elements=16), tmp_path, "names_q8.onnx")
    feeds = _x(np.float32)
    sess = passes.InferenceSession(path, mode=mode, dtype="float16")
    got = sess.run(None, feeds)[0]
    assert _snr_db(_reference(model, feeds), got) >= 30.0
