"""Palettization: k-means tables, graph form that onnxruntime runs, exact fold, errors."""
import numpy as np
import onnx
import pytest

import modelgen as mg
from passes import InvalidArgumentError, Report
from passes.palette import fold_palettes, kmeans_1d, palette_array, palettize


def test_kmeans_beats_uniform_levels_on_laplacian():
    rng = np.random.default_rng(0)
    v = rng.laplace(size=20000)
    c = kmeans_1d(v, 16)
    assert c.size == 16 and np.all(np.diff(c) > 0)
    mid = (c[1:] + c[:-1]) / 2
    err_km = np.mean((v - c[np.searchsorted(mid, v)]) ** 2)
    step = (v.max() - v.min()) / 15
    err_uni = np.mean((v - (np.round((v - v.min()) / step) * step + v.min())) ** 2)
    assert err_km < 0.5 * err_uni


def test_few_distinct_values_are_exact():
    w = np.array([[0.5, -1.0, 0.5], [2.0, -1.0, 0.0]])
    idx, table, groups = palette_array(w, 2, None)
    assert groups == 1 and np.array_equal(table[idx.astype(np.int64)], w)


@pytest.mark.parametrize("bits,group_rows", [(4, None), (3, 4), (8, None), (2, 1)])
def test_graph_runs_error_bound_and_folds_exactly(bits, group_rows):
    m = mg.conv_model()
    report = Report()
    p = palettize(m, bits=bits, group_rows=group_rows, min_elements=100, report=report)
    onnx.checker.check_model(p, full_check=True)
    changed = [t for t in report.tensors if t.scheme.startswith("palette")]
    assert {t.name for t in changed} == {"W", "W2"}
    inits = {t.name: t for t in p.graph.initializer}
    for t in changed:
        w = onnx.numpy_helper.to_array({x.name: x for x in m.graph.initializer}[t.name]).astype(np.float64)
        idx = onnx.numpy_helper.to_array(inits[t.name + "_palette_indices"])
        table = onnx.numpy_helper.to_array(inits[t.name + "_palette"])
        assert idx.dtype == np.uint8 and idx.shape == w.shape
        assert len(np.unique(table[idx])) <= (1 << bits) * (1 if not group_rows else -(-w.shape[0] // group_rows))
        # each value lies no further than half the widest gap of its table from its entry
        w_hat = table[idx.astype(np.int64)].astype(np.float64)
        assert t.snr_db > min(5.5 * bits - 6, 30)
        assert np.max(np.abs(w - w_hat)) <= np.max(np.abs(w)) + 1e-6
    f = mg.feeds(m)
    out_p = mg.run(p, f)
    folded = fold_palettes(p)
    onnx.checker.check_model(folded, full_check=True)
    assert not any(n.op_type == "Gather" for n in folded.graph.node)
    out_f = mg.run(folded, f)
    for a, b in zip(out_p, out_f):
        assert np.array_equal(a, b)  # the folded weights are exactly what onnxruntime gathered
    for a, b in zip(out_p, mg.run(m, f)):
        assert mg.cosine(a, b) > (0.95 if bits >= 3 else 0.7)


def test_float16_and_input_untouched():
    m = mg.dense_model("float16")
    before = m.SerializeToString()
    p = palettize(m, bits=4, min_elements=100)
    assert m.SerializeToString() == before
    onnx.checker.check_model(p, full_check=True)
    tables = [t for t in p.graph.initializer if t.name.endswith("_palette")]
    assert tables and all(t.data_type == onnx.TensorProto.FLOAT16 for t in tables)
    out = mg.run(p, mg.feeds(m))
    assert np.array_equal(out[0], mg.run(fold_palettes(p), mg.feeds(m))[0])


def test_weights_a_palette_would_grow_stay_float():
    """At min_elements=0 a [0, 64] weight crashed the k-means and a [2, 2] one grew from 16 bytes to
    4 indices + a 16-entry table; both stay as they are, the large weight is palettized."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    g = helper.make_graph([helper.make_node("Concat", ["E", "x"], ["c"], axis=0),
                           helper.make_node("MatMul", ["c", "W"], ["h"]),
                           helper.make_node("MatMul", ["h", "T"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
                          [numpy_helper.from_array(np.zeros((0, 64), np.float32), "E"),
                           numpy_helper.from_array(rng.standard_normal((64, 2)).astype(np.float32), "W"),
                           numpy_helper.from_array(rng.standard_normal((2, 2)).astype(np.float32), "T")])
    p = palettize(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), bits=4, min_elements=0)
    onnx.checker.check_model(p, full_check=True)
    names = {t.name for t in p.graph.initializer}
    assert {"E", "T"} <= names and "W" not in names and len(names) == 4  # W's indices and table


@pytest.mark.parametrize("kwargs", [dict(bits=0), dict(bits=9), dict(bits=True), dict(group_rows=0),
                                    dict(bits=8, group_rows=1)])
def test_bad_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        palettize(mg.conv_model(), min_elements=100, **kwargs)


def test_fold_dequantize_folds_palettes_and_dequantize_together():
    import passes

    m = mg.conv_model()
    p = palettize(m, bits=4, min_elements=100, include=["W"])
    q = passes.quantize_weights(p, bits=8, include=["W2"])
    folded = passes.fold_dequantize(q)
    onnx.checker.check_model(folded, full_check=True)
    assert not any(n.op_type in ("Gather", "DequantizeLinear") for n in folded.graph.node)
    f = mg.feeds(m)
    for a, b in zip(mg.run(q, f), mg.run(folded, f)):
        assert np.array_equal(a, b)


def test_constant_node_weights_are_palettized():
    """Exporters such as paddle2onnx keep every weight in a Constant node: those of the main
    graph become initializers and are palettized (a note says so); fold gives the same outputs."""
    import modelgen as mg

    m = mg.conv_model("float32", 13, in_constant=True)
    rep = Report()
    p = palettize(m, bits=4, min_elements=256, report=rep)
    onnx.checker.check_model(p, full_check=True)
    assert {t.name for t in rep.tensors} == {"W", "W2"}
    assert any("Constant node weight(s)" in n for n in rep.notes)
    assert not any(n.op_type == "Constant" and n.output[0] in ("W", "W2") for n in p.graph.node)
    feeds = mg.feeds(m)
    out = mg.run(p, feeds)
    assert all(mg.cosine(a, b) > 0.98 for a, b in zip(mg.run(m, feeds), out))  # 4 bits per tensor
    assert all(np.array_equal(a, b) for a, b in zip(out, mg.run(fold_palettes(p), feeds)))


def test_weights_in_and_under_subgraphs():
    """A main-graph weight read only inside an If branch is palettized (uses are resolved by
    scope), and so are the weights defined inside the If branches and the Loop body (initializer
    or Constant node), each in its own graph; fold_palettes folds them all, bit-exact."""
    import modelgen as mg

    m = mg.subgraph_model("float32", 13)
    rep = Report()
    p = palettize(m, bits=4, min_elements=256, report=rep)
    onnx.checker.check_model(p, full_check=True)
    where = {t.name: t.location for t in rep.tensors}
    assert set(where) == {"W_OUT", "Wt", "We", "Wl"}
    assert where["We"].startswith("subgraph") and where["W_OUT"] == "initializer"
    feeds = mg.feeds(m)
    out = mg.run(p, feeds)
    # three 4-bit per-tensor palettes in a row (and the Loop applies its weight twice): ~0.96-0.98
    assert all(mg.cosine(a, b) > 0.95 for a, b in zip(mg.run(m, feeds), out))
    f = fold_palettes(p)
    onnx.checker.check_model(f, full_check=True)
    assert not any(n.op_type == "Gather" for gi in __import__("passes").graph.iter_graphs(f) for n in gi.graph.node)
    assert all(np.array_equal(a, b) for a, b in zip(out, mg.run(f, feeds)))


def test_unsorted_input_graph_comes_out_sorted():
    """A graph onnxruntime runs but the checker refuses (nodes out of order, as a float16 converter
    leaves some) is palettized into one the checker takes, with a note."""
    m = mg.dense_model("float32")
    m.graph.node.insert(0, m.graph.node.pop())  # the last node (a Gemm) first
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(m, full_check=True)
    report = Report()
    p = palettize(m, bits=4, min_elements=100, report=report)
    onnx.checker.check_model(p, full_check=True)
    assert "nodes sorted topologically" in " ".join(report.notes)


def _blocked_q8():
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    import passes

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((256, 512)).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 512])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    return m, passes.quantize_weights(m, bits=8, granularity="block", block_size=32)


def test_a_quantized_ops_scales_are_not_palettized():
    """A blocked DequantizeLinear's scales are [blocks, N] floats: palettize took them for a weight
    and moved every weight they scale (42.4 -> 25.2 dB, no note). Kept now, with a note."""
    import passes

    _, q = _blocked_q8()
    rep = passes.Report()
    p = passes.palettize(q, bits=4, min_elements=0, report=rep)
    assert rep.tensors == [] and any("read by quantized operators" in n for n in rep.notes)
    assert p.graph.initializer[:] == q.graph.initializer[:]


def test_palette_patterns_take_op_types_as_quantize_does():
    import passes

    m, _ = _blocked_q8()
    by_op = passes.Report()
    passes.palettize(m, bits=4, include="MatMul", report=by_op)
    assert [t.name for t in by_op.tensors] == ["W"]
    excluded = passes.Report()
    passes.palettize(m, bits=4, exclude=["MatMul"], report=excluded)
    assert excluded.tensors == []


def test_fold_palettes_returns_a_copy_with_nothing_to_fold():
    import passes

    m, _ = _blocked_q8()
    out = passes.fold_palettes(m)
    assert out is not m and out.SerializeToString() == m.SerializeToString()
