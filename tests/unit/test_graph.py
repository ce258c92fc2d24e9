"""passes.graph and passes.forms helpers: tensors, int4 packing, weights, axes, toposort, opset."""
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import modelgen as mg
from passes import forms, graph
from passes.errors import UnsupportedFormError


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_int4_pack_round_trip(signed, n):
    rng = np.random.default_rng(n)
    vals = rng.integers(-8, 8, n).astype(np.int8) if signed else rng.integers(0, 16, n).astype(np.uint8)
    packed = graph.pack_int4(vals)
    assert packed.size == (n + 1) // 2
    assert np.array_equal(graph.unpack_int4(packed, n, signed), vals)
    # ONNX layout: first value in the low nibble, matches onnx's own helper
    t = helper.make_tensor("t", TP.INT4 if signed else TP.UINT4, [n], vals.tolist())
    assert np.array_equal(graph.tensor_to_array(t), vals)


@pytest.mark.parametrize("et,dtype", [(TP.FLOAT, np.float32), (TP.FLOAT16, np.float16),
                                      (TP.BFLOAT16, ml_dtypes.bfloat16), (TP.INT8, np.int8), (TP.UINT8, np.uint8)])
def test_tensor_round_trip_uses_raw_data(et, dtype):
    arr = (np.arange(24).reshape(2, 3, 4) - 12).astype(np.float32).astype(dtype)
    t = graph.array_to_tensor(arr, "a", et)
    assert t.HasField("raw_data") and not t.int32_data and not t.float_data
    back = graph.tensor_to_array(t)
    assert back.dtype == arr.dtype and np.array_equal(back.astype(np.float32), arr.astype(np.float32))


def test_tensor_from_typed_fields():
    t = onnx.TensorProto()
    t.name, t.data_type = "h", TP.FLOAT16
    t.dims.append(3)
    t.int32_data.extend(np.array([1, 2, 3], np.float16).view(np.uint16).tolist())  # bits, one per entry
    assert np.array_equal(graph.tensor_to_array(t), np.array([1, 2, 3], np.float16))


def test_find_weights_locations_and_scoping():
    m = mg.subgraph_model("float32", 13)
    weights, graphs = graph.find_weights(m)
    by = {w.name: w for w in weights}
    assert by["W_OUT"].location == "initializer"
    assert [u.node.op_type for u in by["W_OUT"].uses] == ["MatMul"]  # read inside the then-branch
    assert by["Wt"].location.endswith("Constant node") and by["Wt"].node is not None
    assert len(graphs) == 4  # main, then, else, loop body


def test_choose_axis_through_transpose():
    m = mg.transpose_model("float32", 13)
    weights, graphs = graph.find_weights(m)
    w = [w for w in weights if w.name == "W"][0]
    c = graph.choose_axis(w, graph.consumers_index(graphs))
    # MatMul B = W^T (32, 24): output channels = axis 1 of W^T = axis 0 of W
    assert (c.channel, c.reduce) == (0, 1)


def test_toposort_keeps_sorted_and_fixes_unsorted():
    m = mg.dense_model("float32", 13)
    assert graph.toposort(m) is False
    nodes = list(m.graph.node)
    shuffled = [nodes[i] for i in (4, 0, 3, 1, 2, 5)]
    copies = []
    for n in shuffled:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        copies.append(c)
    del m.graph.node[:]
    m.graph.node.extend(copies)
    unsorted = m.SerializeToString()
    assert graph.toposort(m, dry_run=True) is True and m.SerializeToString() == unsorted  # told, not changed
    assert graph.toposort(m) is True
    onnx.checker.check_model(m, full_check=True)
    assert graph.toposort(m, dry_run=True) is False


def test_name_allocator():
    names = graph.NameAllocator({"a", "a_1"})
    assert names.take("a") == "a_2" and names.take("b") == "b" and names.take("b") == "b_1"


def test_raise_opset_keeps_weights():
    m = mg.conv_model("float32", 11)
    out, how = graph.raise_opset(m, 13)
    assert graph.default_opset(out) == 13 and "11 to 13" in how
    before = {t.name: t.raw_data for t in m.graph.initializer}
    after = {t.name: t.raw_data for t in out.graph.initializer}
    assert before == after


def test_raise_opset_restores_tensors_as_they_were_serialised():
    """Payloads set aside during the conversion come back without an explicit data_location:
    DEFAULT was written into every restored tensor (2 bytes each, and a tensor that no longer
    serialised as it had: found comparing MatMulNBits inputs byte for byte after --bits 4)."""
    m = mg.conv_model("float32", 11)
    big = [t for t in m.graph.initializer if len(t.raw_data) > 1024]
    assert big
    out, _ = graph.raise_opset(m, 13)
    before = {t.name: t.SerializeToString() for t in m.graph.initializer}
    after = {t.name: t.SerializeToString() for t in out.graph.initializer}
    assert before == after
    assert not any(t.HasField("data_location") for t in out.graph.initializer)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("axis,block", [(None, 0), (0, 0), (1, 0), (1, 16), (0, 7)])
def test_search_beats_max_abs(sym, axis, block):
    rng = np.random.default_rng(0)
    w = rng.standard_t(4, size=(32, 48)).astype(np.float32)  # heavy tails: clipping pays
    levels = forms.Levels(4, sym)
    err = []
    for search in (False, True):
        qz = forms.quantize_linear(w, levels, axis, block, search=search)
        assert qz.q.min() >= levels.qmin and qz.q.max() <= levels.qmax
        deq = forms.dequantize_linear(qz.q, qz.scale, qz.zero_point, 1 if axis is None else axis, block)
        err.append(float(np.sum((deq - w) ** 2)))
    assert err[1] <= err[0]


def _failing_converter(monkeypatch):
    def fail(model, target):
        raise RuntimeError("No Adapter For Cast")

    monkeypatch.setattr(onnx.version_converter, "convert_version", fail)


def test_raise_opset_refuses_when_converter_fails_and_ops_changed(monkeypatch):
    from passes import UnsupportedFormError, quantize_weights

    _failing_converter(monkeypatch)
    with pytest.raises(UnsupportedFormError, match="opset 13.*opset 11.*No Adapter"):
        quantize_weights(mg.conv_model("float32", 11), min_elements=64)  # Cast changed in opset 13


def test_raise_opset_bumps_when_no_op_changed(monkeypatch):
    from passes import Report, quantize_weights

    _failing_converter(monkeypatch)
    w = mg.tensor("W", mg.weight((16, 8, 3, 3)))
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TP.FLOAT, [1, 8, 6, 6])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [1, 16, 4, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    report = Report()
    q = quantize_weights(m, min_elements=64, report=report)
    assert graph.default_opset(q) == 13 and "no op of the model changed" in report.notes[0]
    onnx.checker.check_model(q, full_check=True)


def test_copy_model_leaves_named_payloads_behind():
    m = mg.dense_model("float32", 13)
    before = m.SerializeToString()
    names = {t.name for t in m.graph.initializer[:2]}
    out = graph.copy_model(m, names)
    assert m.SerializeToString() == before  # the source is untouched
    assert graph.copy_model(m).SerializeToString() == before
    for src, dst in zip(m.graph.initializer, out.graph.initializer):
        assert (src.name, list(src.dims), src.data_type) == (dst.name, list(dst.dims), dst.data_type)
        assert dst.HasField("raw_data") == (src.name not in names)
    # everything but those payloads is the same: putting them back gives the original bytes
    for t in out.graph.initializer:
        if t.name in names:
            t.raw_data = next(s.raw_data for s in m.graph.initializer if s.name == t.name)
    assert out.SerializeToString() == before


def test_raise_opset_with_payloads_held_elsewhere():
    m = mg.conv_model("float32", 11)
    held = {t.name: t for t in m.graph.initializer}
    stub = graph.copy_model(m, set(held))
    out, _ = graph.raise_opset(stub, 13, payloads=held)
    assert graph.default_opset(out) == 13
    # the held payloads are not copied back (the caller reads them from `payloads`)
    assert not any(t.HasField("raw_data") for t in out.graph.initializer if t.name in held)
    assert all(t.data_location == TP.DEFAULT and not t.external_data for t in out.graph.initializer)
    for t in out.graph.initializer:
        t.raw_data = held[t.name].raw_data
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in m.graph.node]


def test_raise_opset_checks_the_result_without_payloads(monkeypatch):
    """The conversion is judged on typed graph inputs in place of large initializers: a
    converter result that breaks a node is refused, the weights never go through the checker."""
    m = mg.conv_model("float32", 11)
    real = onnx.version_converter.convert_version

    def broken(model, target):
        out = real(model, target)
        out.graph.node[0].input[0] = "nobody_makes_this"
        return out

    monkeypatch.setattr(onnx.version_converter, "convert_version", broken)
    with pytest.raises(UnsupportedFormError, match="invalid model"):
        graph.raise_opset(m, 13)


def test_unique_initializers_drops_repeated_names():
    m = mg.dense_model("float32", 13)
    dup = m.graph.initializer.add()
    dup.CopyFrom(m.graph.initializer[0])
    found = graph.unique_initializers(m)
    assert m.graph.initializer[0].name not in found
    assert set(found) == {t.name for t in m.graph.initializer[1:-1]}


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_coarse_to_fine_search_close_to_full_grid(sym, bits):
    """The 10-evaluation search matches the best error over all 26 ratios: within 0.1% in total,
    and per row within 0.1% at 8 bits, 3% at 4 bits (where the error curve is bumpier)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_t(5, size=(64, 300)) * rng.uniform(0.01, 1, (64, 1))).astype(np.float32)
    levels = forms.Levels(bits, sym)
    qz = forms.quantize_linear(w, levels, 0)
    deq = forms.dequantize_linear(qz.q, qz.scale, qz.zero_point, 0)
    got = np.sum((deq - w).astype(np.float64) ** 2, axis=1)
    part = forms._Rows(w, levels, np.dtype(np.float32))
    full = np.min([part.error(*part.candidate(np.float32(c))) for c in forms._CLIP_GRID], axis=0)
    assert np.sum(got) <= np.sum(full) * 1.001
    assert np.all(got <= full * (1.001 if bits == 8 else 1.03) + 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantized_snr_matches_dequantized_values(dtype):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((40, 70)) * 0.1).astype(dtype)
    qz = forms.quantize_linear(w, forms.Levels(8, True), 1)
    deq = forms.dequantize_linear(qz.q, qz.scale, None, 1).astype(np.float64)
    w64 = w.astype(np.float64)
    expect = 10 * np.log10(np.sum(w64 ** 2) / np.sum((deq - w64) ** 2))
    assert qz.snr_db() == pytest.approx(expect, abs=2e-3)


@pytest.mark.parametrize("shape", [(1, 1), (63, 5), (64, 64), (130, 7), (5, 200)])
@pytest.mark.parametrize("dtype", [np.int8, np.float16])
def test_blocked_transpose(shape, dtype):
    a = np.arange(np.prod(shape)).reshape(shape).astype(dtype)
    t = forms._transpose2d(a)
    assert t.flags.c_contiguous and np.array_equal(t, a.T)
    assert np.array_equal(forms._transpose2d(a, np.float32), a.T.astype(np.float32))


@pytest.mark.parametrize("shape", [(50, 70), (3, 40, 30)])
def test_channels_last_layout(shape):
    """Per-channel on the last axis (MatMul weights) takes the blocked-transpose path: levels come
    back C-contiguous in the weight's layout, one scale per last-axis index."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 1, shape[-1])).astype(np.float16)
    qz = forms.quantize_linear(w, forms.Levels(8, True), -1)
    assert qz.q.shape == w.shape and qz.q.flags.c_contiguous and qz.scale.shape == (shape[-1],)
    deq = forms.dequantize_linear(qz.q, qz.scale, None, len(shape) - 1).astype(np.float64)
    w64 = w.astype(np.float64)
    lead = tuple(range(len(shape) - 1))
    col_snr = 10 * np.log10(np.sum(w64 ** 2, axis=lead) / np.sum((deq - w64) ** 2, axis=lead))
    assert col_snr.min() > 35  # every column kept its own scale (a mixed-up layout gives noise)
    assert qz.snr_db() > 35


def test_read_counts_sees_subgraphs_and_graph_outputs():
    # W is read by the main graph's Add, by the If branch's Identity, and is a graph output too
    then_g = helper.make_graph([helper.make_node("Identity", ["W"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TP.FLOAT, [2])])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TP.FLOAT, [2])])
    nodes = [helper.make_node("Add", ["x", "W"], ["y"]),
             helper.make_node("If", ["c"], ["z"], then_branch=then_g, else_branch=else_g)]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2]), helper.make_tensor_value_info("c", TP.BOOL, [])],
        [helper.make_tensor_value_info(n, TP.FLOAT, [2]) for n in ("y", "z", "W")],
        [helper.make_tensor("W", TP.FLOAT, [2], [1.0, 2.0])])
    counts = graph.read_counts(helper.make_model(g))
    assert counts["W"] == 3
    assert counts["x"] == 2  # Add and the else branch
    assert counts["c"] == 1 and counts["y"] == 1 and counts["z"] == 1
    assert "t" in counts and "e" in counts  # the branches' own outputs


# outputs onnxruntime cannot hand to numpy as values

_OUT_TYPES = [(TP.BFLOAT16, ml_dtypes.bfloat16, 13), (TP.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 19),
              (TP.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz, 19), (TP.FLOAT8E5M2, ml_dtypes.float8_e5m2, 19),
              (TP.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz, 19), (TP.INT4, ml_dtypes.int4, 21),
              (TP.UINT4, ml_dtypes.uint4, 21)]


def _cast_outputs_model(elem, opset):
    """x (float32 [6]) -> Cast to `elem` -> output y, and x -> Relu -> output r (float32)."""
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=elem), helper.make_node("Relu", ["x"], ["r"])],
                          "g", [helper.make_tensor_value_info("x", TP.FLOAT, [6])],
                          [helper.make_tensor_value_info("y", elem, [6]), helper.make_tensor_value_info("r", TP.FLOAT, [6])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("elem,dtype,opset", _OUT_TYPES, ids=[TP.DataType.Name(t[0]) for t in _OUT_TYPES])
def test_numpy_readable_outputs_give_values(elem, dtype, opset):
    """onnxruntime refuses these outputs to numpy (or, for float8e4m3fn, returns the bit patterns
    as uint8); the view casts each to a type holding its values, in place, other outputs as they were."""
    import onnxruntime as ort

    model = _cast_outputs_model(elem, opset)
    before = model.SerializeToString()
    integer = elem in (TP.INT4, TP.UINT4)
    x = np.array([0, 1, 2, 3, 5, 7] if integer else [-2.5, -0.001, 0.001, 0.5, 3.0, 7.0], np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # a caller holding only the session tells the same outputs by onnxruntime's type names
    assert [graph.numpy_unreadable_output_type(o.type) for o in session.get_outputs()] == [True, False]
    try:
        raw = session.run(None, {"x": x})[0]
        assert raw.dtype == np.uint8  # float8e4m3fn: codes, -0.001 and 0.001 128 apart
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own
        assert "No corresponding Numpy type" in str(exc)
    view = graph.numpy_readable_outputs(model)
    onnx.checker.check_model(view, full_check=True)
    assert model.SerializeToString() == before
    y, r = ort.InferenceSession(view.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert y.dtype == ({TP.INT4: np.int8, TP.UINT4: np.uint8}.get(elem, np.float32))
    assert np.array_equal(y, x.astype(dtype).astype(y.dtype))  # the values, exactly
    assert np.array_equal(r, np.maximum(x, 0))
    assert [o.name for o in view.graph.output] == [f"y_as_{graph.type_name(graph._OUTPUT_CASTS[elem])}", "r"]


@pytest.mark.parametrize("ort_type", ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bool)",
                                      "tensor(string)", "tensor(int8)", "tensor(uint64)", "seq(tensor(float))",
                                      "map(int64,tensor(float))"])
def test_types_numpy_reads_as_values_need_no_cast(ort_type):
    assert not graph.numpy_unreadable_output_type(ort_type)


def test_numpy_readable_outputs_leave_plain_models_alone():
    model = _cast_outputs_model(TP.FLOAT16, 13)
    assert graph.numpy_readable_outputs(model) is model


def test_numpy_readable_outputs_names_stay_unique():
    model = _cast_outputs_model(TP.BFLOAT16, 13)
    model.graph.node.append(helper.make_node("Identity", ["r"], ["y_as_float32"]))
    model.graph.output.append(helper.make_tensor_value_info("y_as_float32", TP.FLOAT, [6]))
    view = graph.numpy_readable_outputs(model)
    onnx.checker.check_model(view, full_check=True)
    assert [o.name for o in view.graph.output] == ["y_as_float32_1", "r", "y_as_float32"]


# subgraph initializers named like outer tensors


def _shadowing_model():
    """Main graph W [8, 4] read by MatMul and ReduceSum; an If whose branches hold their own
    initializer named W (other values) and read it; the else branch also reads the outer Wsum, and
    holds a Loop-free nested If whose own W is read there."""
    rng = np.random.default_rng(3)
    w = lambda k: (rng.normal(size=(8, 4)) * k).astype(np.float32)  # noqa: E731
    vi = helper.make_tensor_value_info
    nested = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["n"])], "nested", [], [vi("n", TP.FLOAT, [2, 4])],
                               [graph.array_to_tensor(w(5), "W", TP.FLOAT)])
    then_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [], [vi("t", TP.FLOAT, [2, 4])],
                               [graph.array_to_tensor(w(3), "W", TP.FLOAT)])
    else_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["e"]), helper.make_node("Add", ["e", "Wsum"], ["e2"]),
                                helper.make_node("If", ["cond"], ["e3"], then_branch=nested, else_branch=nested),
                                helper.make_node("Add", ["e2", "e3"], ["e4"])],
                               "else", [], [vi("e4", TP.FLOAT, [2, 4])], [graph.array_to_tensor(w(-2), "W", TP.FLOAT)])
    g = helper.make_graph(
        [helper.make_node("ReduceSum", ["W", "ax"], ["Wsum"], keepdims=1),
         helper.make_node("If", ["cond"], ["z"], then_branch=then_g, else_branch=else_g),
         helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["z", "m"], ["y"])],
        "shadow", [vi("x", TP.FLOAT, [2, 8]), vi("cond", TP.BOOL, [])], [vi("y", TP.FLOAT, [2, 4])],
        [graph.array_to_tensor(w(1), "W", TP.FLOAT), graph.array_to_tensor(np.array([0], np.int64), "ax", TP.INT64)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def test_unshadow_initializers_keeps_the_function_and_makes_names_unique():
    import onnxruntime as ort

    model = _shadowing_model()
    fixed = graph.copy_model(model)
    assert graph.unshadow_initializers(fixed) == 4  # then's W, else's W, the nested If's two branches' W
    onnx.checker.check_model(fixed, full_check=True)
    inits = [t.name for info in graph.iter_graphs(fixed) for t in info.graph.initializer]
    assert inits.count("W") == 1 and len([n for n in inits if n.startswith("W")]) == len(inits) - 1
    x = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    a, b = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (model, fixed))
    for cond in (True, False):
        feed = {"x": x, "cond": np.array(cond)}
        assert np.array_equal(a.run(None, feed)[0], b.run(None, feed)[0])
    assert graph.unshadow_initializers(fixed) == 0
    assert graph.shadowed_initializers(model) == ["W"] * 4 and graph.shadowed_initializers(fixed) == []
    assert graph.unshadowed(fixed) is fixed
    copy = graph.unshadowed(model)
    assert copy is not model and copy.SerializeToString() == fixed.SerializeToString()
    assert graph.shadowed_initializers(model) == ["W"] * 4  # the input is not modified


def test_a_shadowing_weight_turned_into_a_node_output_is_valid_once_unshadowed():
    """What a quantizing pass does to a weight (initializer -> DequantizeLinear output of the same
    name) is refused by the checker in a branch whose initializer shadows an outer name, and
    accepted once the initializers are unshadowed."""
    def dequantize_in_place(m):
        for info in graph.iter_graphs(m)[1:]:
            g = info.graph
            for t in list(g.initializer):
                q = graph.array_to_tensor(np.ones(t.dims, np.int8), t.name + "_q", TP.INT8)
                s = graph.array_to_tensor(np.array(0.5, np.float32), t.name + "_s", TP.FLOAT)
                g.initializer.remove(t)
                g.initializer.extend([q, s])
                g.node.insert(0, helper.make_node("DequantizeLinear", [q.name, s.name], [t.name]))
        return m

    with pytest.raises(onnx.checker.ValidationError, match="single static assignment"):
        onnx.checker.check_model(dequantize_in_place(_shadowing_model()), full_check=True)
    fixed = _shadowing_model()
    graph.unshadow_initializers(fixed)
    onnx.checker.check_model(dequantize_in_place(fixed), full_check=True)


@pytest.mark.parametrize("param, sizes, names, size", [
    # optimum's decoder-with-past mask / present axis; torch.export's symbols
    ("past_sequence_length + sequence_length", {"past_sequence_length": 3, "sequence_length": 5},
     {"past_sequence_length", "sequence_length"}, 8),
    ("s0 + s1", {"s0": 4, "s1": 2}, {"s0", "s1"}, 6),
    ("2*s0", {"s0": 4}, {"s0"}, 8),
    ("past_sequence_length + 1", {"past_sequence_length": 7}, {"past_sequence_length"}, 8),
    ("s0 // 2", {"s0": 9}, {"s0"}, 4),
    # a name the sizes lack, a result below 1, a division by zero: no size
    ("a + b", {"a": 1}, {"a", "b"}, None),
    ("seq-len", {"seq": 1, "len": 3}, {"seq", "len"}, None),
    ("s0 // s1", {"s0": 4, "s1": 0}, {"s0", "s1"}, None),
])
def test_dim_expressions_are_sized_from_their_names(param, sizes, names, size):
    assert graph.dim_expression_names(param) == names
    assert graph.evaluate_dim_expression(param, sizes) == size


@pytest.mark.parametrize("param", ["batch_size", "N", "", "1+1", "a / b", "a ** 2", "f(a)", "-a",
                                   "a + True", "a + 1.5", "x if y else z", "a.b + c", "__import__('os')"])
def test_other_dim_params_are_no_expressions(param):
    assert graph.dim_expression_names(param) is None
    assert graph.evaluate_dim_expression(param, {"a": 2, "b": 1, "N": 3, "batch_size": 1}) is None


def test_the_payload_free_view_types_large_weights_as_inputs_once():
    """refuse_invalid and the feed synthesis' shape inference read a view whose large weights are
    typed inputs: an IR 3 model already lists them as inputs, and a second entry of the same name
    made inference refuse the view (the feeds then fell back to 1 for sequence_lens)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from passes import graph

    big = numpy_helper.from_array(np.ones((64, 32), np.float32), "W")
    small = numpy_helper.from_array(np.ones((2,), np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])]
    for listed in (False, True):
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])]
        if listed:
            inputs += [helper.make_tensor_value_info("W", TensorProto.FLOAT, [64, 32]),
                       helper.make_tensor_value_info("shape", TensorProto.INT64, [2])]
        g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [big, small])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=3 if listed else 8)
        view = graph.payload_free_view(m)
        assert [i.name for i in view.graph.input].count("W") == 1
        assert [t.name for t in view.graph.initializer] == ["shape"]  # small ones keep their values
        onnx.shape_inference.infer_shapes(view, strict_mode=True)
        assert m.graph.initializer[0].raw_data  # the model itself untouched


@pytest.mark.parametrize("group, shape, axis", [(1, (16, 8, 3, 3), 1), (4, (64, 16, 3, 3), 0), (128, (128, 1, 4, 4), 0)])
def test_a_grouped_conv_transpose_weight_is_scaled_along_its_input_channels(group, shape, axis):
    """ConvTranspose's weight is [C_in, C_out/group, k..]: with group > 1 axis 1 mixes the groups, and
    a depthwise one (C_out/group = 1) got one scale for all channels (per tensor in effect): axis 0.
    (A depthwise [128, 1, 4, 4] with a per-channel spread, int8: 34.1 -> 46.1 dB.)"""
    rng = np.random.default_rng(0)
    spread = np.exp(rng.uniform(-4, 2, size=(shape[0], 1, 1, 1))).astype(np.float32)
    w = (rng.standard_normal(shape).astype(np.float32) * spread)
    c_out = shape[1] * group
    node = helper.make_node("ConvTranspose", ["x", "W"], ["y"], group=group, strides=[2, 2])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, [1, shape[0], 8, 8])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [1, c_out, None, None])],
                          [onnx.numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    weights, graphs = graph.find_weights(m)
    assert graph.choose_axis(weights[0], graph.consumers_index(graphs)).channel == axis
    from passes import Report, quantize_weights

    rep = Report()
    quantize_weights(m, min_elements=0, report=rep)
    assert rep.tensors[0].scheme == f"int8/channel(axis={axis})/sym"
