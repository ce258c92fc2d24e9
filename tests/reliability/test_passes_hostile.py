"""Odd and hostile models into the passes (issue 6 item 3): quantize_weights and fold_dequantize
either return a model that passes `onnx.checker.check_model(full_check=True)` and computes what
the original computes (within the quantization error; fold: exactly what onnxruntime's
DequantizeLinear gives), or raise a SurgeonError with one clear line. Never a foreign exception,
never a silently wrong weight (an inf where the original was finite, a folded value for a node
onnxruntime refuses).

Regression tests of findings fixed in d9c3ec3: float16 weights near 65504 dequantized to inf;
fold raising bare numpy errors on malformed DequantizeLinear nodes, and folding nodes that
onnxruntime refuses into invented values.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import InvalidModelError, SurgeonError


def _matmul(w: np.ndarray, opset: int = 17, extra_inits=(), name: str = "W") -> onnx.ModelProto:
    wt = numpy_helper.from_array(w, name)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", name], ["Y"])], "g",
        [helper.make_tensor_value_info("X", wt.data_type, [1, w.shape[0]])],
        [helper.make_tensor_value_info("Y", wt.data_type, [1, w.shape[1]])], [wt, *extra_inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _weight_only(w: np.ndarray, opset: int = 17) -> onnx.ModelProto:
    """The weight is the model's output (through Identity): its dequantized value is observable."""
    wt = numpy_helper.from_array(w, "W")
    graph = helper.make_graph([helper.make_node("Identity", ["W"], ["Y"])], "g", [],
                              [helper.make_tensor_value_info("Y", wt.data_type, list(w.shape))], [wt])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model, feeds=None, exact=False):
    """Outputs from onnxruntime; `exact`: graph optimisations off (they fuse DequantizeLinear +
    MatMul into integer kernels whose rounding differs from the float graph)."""
    opts = ort.SessionOptions()
    if exact:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds or {})


def _valid(model):
    onnx.checker.check_model(model, full_check=True)
    return model


def _quantize_or_refuse(model, **kw):
    try:
        return _valid(passes.quantize_weights(model, **kw))
    except SurgeonError as exc:
        assert "\n" not in str(exc)
        return None


W64 = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)


# ---------------------------------------------------------------------- quantize_weights

@pytest.mark.parametrize("opset", [7, 9, 10, 12])
@pytest.mark.parametrize("form", [dict(bits=8), dict(bits=4), dict(bits=8, granularity="block", block_size=32)])
def test_opsets_too_old_are_raised_correctly_or_refused(opset, form):
    """DequantizeLinear needs opset 10 (axis 13, int4 and blocks 21): the pass raises the opset
    with the version converter, or refuses. The raised model must compute what the original
    computes with the dequantized weight in place of W (Unsqueeze and ReduceSum change form at 13)."""
    def model_with(w):
        nodes = [helper.make_node("MatMul", ["X", "W"], ["Y0"]),
                 helper.make_node("Unsqueeze", ["Y0"], ["Y1"], axes=[0]),  # attribute form until opset 12
                 helper.make_node("ReduceSum", ["Y1"], ["Y"], axes=[2], keepdims=1)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1, 1])],
                                  [numpy_helper.from_array(w, "W")])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 7
        return _valid(m)

    q = _quantize_or_refuse(model_with(W64), **form)
    if q is None:
        return
    folded = passes.fold_dequantize(q)
    w_deq = next(numpy_helper.to_array(t) for t in folded.graph.initializer if t.name == "W")
    # a quantization of W, not something else
    assert np.corrcoef(w_deq.ravel(), W64.ravel())[0, 1] > (0.95 if form["bits"] == 4 else 0.999)
    x = {"X": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    want = _run(model_with(w_deq), x, exact=True)[0]  # the original graph, its own opset, W dequantized
    assert np.allclose(_run(q, x, exact=True)[0], want, rtol=1e-5, atol=1e-5)


def test_already_quantized_model_is_left_as_is():
    q = passes.quantize_weights(_matmul(W64))
    again = passes.quantize_weights(q)
    assert again.SerializeToString() == q.SerializeToString()
    assert sum(n.op_type == "DequantizeLinear" for n in again.graph.node) == 1


def test_weights_already_behind_foreign_dequantize_are_not_requantized():
    """A QDQ model made elsewhere (int8 + DequantizeLinear written by hand)."""
    wq = np.random.default_rng(2).integers(-127, 128, (64, 64)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["Wq", "s"], ["W"], axis=1),
             helper.make_node("MatMul", ["X", "W"], ["Y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(wq, "Wq"), numpy_helper.from_array(np.full(64, 0.02, np.float32), "s")])
    model = _valid(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    q = _valid(passes.quantize_weights(model, min_elements=0))
    assert [n.op_type for n in q.graph.node] == ["DequantizeLinear", "MatMul"]
    assert {i.name: i.SerializeToString() for i in q.graph.initializer} == {i.name: i.SerializeToString() for i in model.graph.initializer}


def test_non_float_and_empty_initializers_untouched():
    extra = [numpy_helper.from_array(np.arange(4096, dtype=np.int64), "i64"),
             numpy_helper.from_array(np.ones(4096, dtype=bool), "flags"),
             numpy_helper.from_array(np.zeros((0, 4096), np.float32), "empty")]
    model = _matmul(W64, extra_inits=extra)
    q = _valid(passes.quantize_weights(model, include=["i64", "flags", "empty"]))
    by_name = {i.name: i for i in q.graph.initializer}
    for t in extra:
        assert by_name[t.name].SerializeToString() == t.SerializeToString()


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_weights_are_kept_or_refused(value):
    w = W64.copy()
    w[3, 5] = value
    q = _quantize_or_refuse(_weight_only(w), include=["W"])
    if q is None:
        return
    got = _run(q)[0]
    finite = np.isfinite(w)
    assert np.array_equal(np.isfinite(got), finite)
    assert np.allclose(got[finite], w[finite], atol=0.1)


@pytest.mark.parametrize("w", [
    np.zeros((64, 64), np.float32),
    np.full((64, 64), np.finfo(np.float32).max, np.float32),
    np.full((64, 64), np.finfo(np.float32).tiny / 8, np.float32),   # denormals
    np.concatenate([np.full((1, 64), 3e38, np.float32), W64[1:]]),
    np.full((64, 64), -1.5, np.float64),
], ids=["zeros", "float32-max", "denormal", "one-huge-row", "float64-constant"])
def test_extreme_float_values_stay_finite(w):
    q = _quantize_or_refuse(_weight_only(w), include=["W"])
    if q is None:
        return
    got = _run(q)[0]
    assert np.all(np.isfinite(got)), "dequantized weight holds inf/nan where the original was finite"
    w64, got64 = w.astype(np.float64), got.astype(np.float64)
    assert np.abs(got64 - w64).max() <= 0.02 * np.abs(w64).max()


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_float16_near_max_stays_finite(granularity):
    w = np.full((64, 64), 65504, np.float16)
    w[::2] = -60000
    q = _quantize_or_refuse(_weight_only(w), include=["W"], granularity=granularity)
    if q is None:
        return
    got = _run(q)[0]
    assert np.all(np.isfinite(got))


def _refused_or_untouched(fn, model):
    """fold_dequantize on a model without DequantizeLinear has nothing to do: it may return the
    model unchanged instead of judging it."""
    try:
        out = fn(model)
    except InvalidModelError:
        return
    assert out.SerializeToString() == model.SerializeToString()


def test_declared_size_beyond_the_data_is_refused():
    liar = TensorProto(name="W", data_type=TensorProto.FLOAT, raw_data=b"\0" * 16)
    liar.dims[:] = [1 << 20, 1 << 20]
    model = _matmul(W64)
    model.graph.initializer[0].CopyFrom(liar)
    with pytest.raises(InvalidModelError, match="W"):
        passes.quantize_weights(model, include=["W"])
    _refused_or_untouched(passes.fold_dequantize, model)


def test_declared_size_beyond_the_data_behind_dequantize_is_refused_by_fold():
    model = _dq(np.zeros(4, np.int8), np.array(0.5, np.float32))
    liar = model.graph.initializer[0]
    liar.dims[:] = [1 << 20, 1 << 20]
    with pytest.raises(InvalidModelError):
        passes.fold_dequantize(model)


def test_cycle_is_refused():
    model = _matmul(W64)
    model.graph.node.append(helper.make_node("Add", ["Z", "Y"], ["Z"]))
    with pytest.raises(InvalidModelError):
        passes.quantize_weights(model)
    _refused_or_untouched(passes.fold_dequantize, model)


def test_duplicate_initializer_names_refused_or_valid():
    model = _matmul(W64)
    model.graph.initializer.append(numpy_helper.from_array(W64 * 2, "W"))
    _quantize_or_refuse(model)


def test_weights_in_deeply_nested_subgraphs():
    """20 levels of If, a weight at every level: each is quantized, no recursion trouble."""
    rng = np.random.default_rng(3)

    def level(depth):
        w = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), f"W{depth}")
        const = helper.make_node("Constant", [], [f"c{depth}"], value=w)
        out = helper.make_tensor_value_info(f"o{depth}", TensorProto.FLOAT, [1, 32])
        if depth == 0:
            nodes = [const, helper.make_node("MatMul", ["X", f"c{depth}"], [f"o{depth}"])]
        else:
            inner = level(depth - 1)  # (else: a plain constant; two copies of `inner` would double per level)
            other = helper.make_graph(
                [helper.make_node("Constant", [], [f"e{depth}"], value=numpy_helper.from_array(np.ones((1, 32), np.float32), f"E{depth}"))],
                f"else{depth}", [], [helper.make_tensor_value_info(f"e{depth}", TensorProto.FLOAT, [1, 32])])
            nodes = [const, helper.make_node("If", ["cond"], [f"i{depth}"], then_branch=inner, else_branch=other),
                     helper.make_node("MatMul", [f"i{depth}", f"c{depth}"], [f"o{depth}"])]
        return helper.make_graph(nodes, f"g{depth}", [], [out])

    body = level(20)
    graph = helper.make_graph(list(body.node), "main",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 32]),
                               helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("o20", TensorProto.FLOAT, [1, 32])])
    model = _valid(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    q = _valid(passes.quantize_weights(model, min_elements=0))
    assert _count_ops(q, "DequantizeLinear") >= 21  # every level's weight (the all-ones else-constants may stay)
    f = _valid(passes.fold_dequantize(q))
    assert _count_ops(f, "DequantizeLinear") == 0
    feeds = {"X": rng.standard_normal((1, 32)).astype(np.float32), "cond": np.array(True)}
    got_q, got_f = _run(q, feeds, exact=True)[0], _run(f, feeds, exact=True)[0]
    # (not bit-equal: onnxruntime pre-packs a constant MatMul operand, another summation order)
    assert np.allclose(got_q, got_f, rtol=1e-4, atol=0)
    assert np.isfinite(got_q).all()


def _count_ops(model, op):
    from passes.graph import iter_graphs

    return sum(n.op_type == op for info in iter_graphs(model) for n in info.graph.node)


def test_external_data_leaving_the_folder_is_refused_by_the_passes(tmp_path):
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    t.dims[:] = [64, 64]
    for key, value in (("location", "../outside.bin"), ("offset", "0"), ("length", str(64 * 64 * 4))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    (tmp_path / "outside.bin").write_bytes(W64.tobytes())
    folder = tmp_path / "m"
    folder.mkdir()
    model = _matmul(W64)
    model.graph.initializer[0].CopyFrom(t)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    for fn in (passes.quantize_weights, passes.fold_dequantize):
        with pytest.raises(InvalidModelError, match="leaves the model's folder"):
            fn(path)


# ---------------------------------------------------------------------- fold_dequantize

def _dq(q, scale, zp=None, opset=21, **attrs):
    inits = [numpy_helper.from_array(q, "Wq"), numpy_helper.from_array(scale, "Ws")]
    inputs = ["Wq", "Ws"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Wz"))
        inputs.append("Wz")
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", inputs, ["W"], **attrs), helper.make_node("Identity", ["W"], ["Y"])],
        "g", [], [helper.make_tensor_value_info("Y", inits[1].data_type, list(q.shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


Q = np.arange(-64, 64, dtype=np.int8).reshape(8, 16)

VALID_DQ = {
    "per-tensor": _dq(Q, np.array(0.1, np.float32)),
    "per-channel": _dq(Q, np.full(16, 0.1, np.float32), axis=1),
    "negative-axis": _dq(Q, np.full(16, 0.1, np.float32), axis=-1),
    "block-uneven": _dq(Q, np.full((8, 3), 0.1, np.float32), axis=1, block_size=6),
    "nan-scale": _dq(Q, np.array(np.nan, np.float32)),
    "empty": _dq(np.zeros((0, 16), np.int8), np.full(16, 0.1, np.float32), axis=1),
    "int32-extremes": _dq(np.array([2**31 - 1, -2**31], np.int32), np.array(1.0, np.float32)),
    "uint8-zero-point-255": _dq(np.array([0, 255], np.uint8), np.array(0.5, np.float32), zp=np.array(255, np.uint8)),
    "float16-overflowing-product": _dq(np.array([127, -128], np.int8), np.array(600.0, np.float16)),
    "opset10-per-tensor": _dq(Q, np.array(0.1, np.float32), opset=10),
}

INVALID_DQ = {  # onnxruntime refuses each of these nodes
    "scale-wrong-length": _dq(Q, np.full(5, 0.1, np.float32), axis=1),
    "block-scale-wrong-shape": _dq(Q, np.full((8, 3), 0.1, np.float32), axis=1, block_size=4),
    "block-size-0": _dq(Q, np.full((8, 4), 0.1, np.float32), axis=1, block_size=0),
    "axis-out-of-range": _dq(Q, np.full(16, 0.1, np.float32), axis=7),
    "zero-point-type-differs": _dq(Q, np.array(0.1, np.float32), zp=np.array(3, np.uint8)),
    "zero-point-wrong-length": _dq(Q, np.full(16, 0.1, np.float32), zp=np.zeros(3, np.int8), axis=1),
    "float-input": _dq(Q.astype(np.float32), np.array(0.1, np.float32)),
    "opset10-axis": _dq(Q, np.full(16, 0.1, np.float32), opset=10, axis=1),
}


@pytest.mark.parametrize("name", sorted(VALID_DQ))
def test_fold_matches_onnxruntime_exactly_on_odd_valid_nodes(name):
    model = VALID_DQ[name]
    want = _run(model)[0]
    folded = _valid(passes.fold_dequantize(model))
    assert not any(n.op_type == "DequantizeLinear" for n in folded.graph.node)
    got = _run(folded)[0]
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def _fold_outcome(model):
    try:
        folded = passes.fold_dequantize(model)
    except SurgeonError:
        return "refused"
    except Exception as exc:  # noqa: BLE001
        return f"foreign {type(exc).__name__}: {exc}"
    return "kept" if any(n.op_type == "DequantizeLinear" for n in folded.graph.node) else "folded"


@pytest.mark.parametrize("name", ["scale-wrong-length", "block-scale-wrong-shape", "block-size-0"])
def test_fold_malformed_nodes_no_foreign_exception(name):
    assert not _fold_outcome(INVALID_DQ[name]).startswith("foreign")


@pytest.mark.parametrize("name", ["axis-out-of-range", "zero-point-type-differs", "zero-point-wrong-length",
                                  "float-input", "opset10-axis"])
def test_fold_does_not_invent_values_for_nodes_onnxruntime_refuses(name):
    with pytest.raises(Exception):
        _run(INVALID_DQ[name])
    assert _fold_outcome(INVALID_DQ[name]) in ("refused", "kept")


@pytest.mark.parametrize("data_type", [29, 14, 0, 8])
def test_fold_refuses_quantized_tensor_with_wrong_data_type(data_type):
    q = passes.quantize_weights(_matmul(W64))
    init = next(t for t in q.graph.initializer if t.name == "W_quantized")
    init.data_type = data_type
    # refused up front (graph.refuse_invalid), naming the tensor or the node that cannot read it
    with pytest.raises(SurgeonError, match="W_quantized.*(does not define|cannot read its data)|W_DequantizeLinear.*unsupported type"):
        passes.fold_dequantize(q)


def _with_invalid_utf8_doc_string(model):
    """The model re-read from bytes whose doc_string is not UTF-8 (protobuf parses it; reading
    the field raises). A damaged or hostile file can hold such bytes in any string field."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.doc_string = "ZZZZ"
    out = onnx.ModelProto()
    out.ParseFromString(m.SerializeToString().replace(b"ZZZZ", b"\x97ZZZ"))
    return out


@pytest.mark.parametrize("which", ["quantize", "fold"])
def test_string_field_not_utf8(which):
    """Found by the long hypothesis run on mutated .onnx bytes; fixed in graph.copy_model."""
    if which == "quantize":
        model = _with_invalid_utf8_doc_string(_matmul(W64))
        fn = passes.quantize_weights
    else:
        model = _with_invalid_utf8_doc_string(passes.quantize_weights(_matmul(W64)))
        fn = passes.fold_dequantize
    with pytest.raises(InvalidModelError, match="not UTF-8"):
        fn(model)


@pytest.mark.parametrize("attr_type", [onnx.AttributeProto.UNDEFINED, onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING])
def test_fold_refuses_dequantize_attribute_of_the_wrong_type(attr_type):
    """A damaged axis attribute (no int in it): found by the long hypothesis run on mutated .onnx
    (bare TypeError from int(None) in fold._dequantize); fixed in passes/fold.py."""
    q = passes.quantize_weights(_matmul(W64))
    node = next(n for n in q.graph.node if n.op_type == "DequantizeLinear")
    node.attribute.add().CopyFrom(onnx.AttributeProto(name="axis", type=attr_type))
    with pytest.raises(InvalidModelError):
        passes.fold_dequantize(q)


def test_fold_with_non_utf8_node_output_name():
    """Found by the long hypothesis run (a DequantizeLinear output name damaged into invalid
    UTF-8 raised UnicodeDecodeError inside fold); a pass that reads such text refuses the model
    (fold reads every DequantizeLinear's names), one that never reads it (quantize: nothing
    left to quantize here) may return the model, but neither raises anything else."""
    q = passes.quantize_weights(_matmul(W64))
    node = next(n for n in q.graph.node if n.op_type == "DequantizeLinear")
    node.output[0] = "QQQQ"
    for n in q.graph.node:
        for i, name in enumerate(n.input):
            if name == "W":
                n.input[i] = "QQQQ"
    data = q.SerializeToString().replace(b"QQQQ", b"\x80QQQ")
    damaged = onnx.ModelProto()
    damaged.ParseFromString(data)
    with pytest.raises(InvalidModelError, match="not UTF-8"):
        passes.fold_dequantize(damaged)
    try:
        passes.quantize_weights(damaged)
    except SurgeonError:
        pass


@pytest.mark.parametrize("bits, extra", [(4, -1), (4, 8)])
def test_fold_refuses_int4_payload_of_the_wrong_size(bits, extra):
    """Found by the long hypothesis run (an int4 weight whose dims no longer match its packed
    bytes raised a bare ValueError from reshape); graph.tensor_to_array checks the size first."""
    q = passes.quantize_weights(_matmul(W64), bits=bits, granularity="block", block_size=32)
    t = next(t for t in q.graph.initializer if t.name == "W_quantized")
    t.raw_data = t.raw_data[:extra] if extra < 0 else t.raw_data + b"\0" * extra
    with pytest.raises(InvalidModelError):
        passes.fold_dequantize(q)


def test_fold_refuses_dequantize_without_output():
    """Found by the long hypothesis run (IndexError on node.output[0]); fixed in passes/fold.py."""
    q = passes.quantize_weights(_matmul(W64))
    node = next(n for n in q.graph.node if n.op_type == "DequantizeLinear")
    del node.output[:]
    with pytest.raises(InvalidModelError):
        passes.fold_dequantize(q)
