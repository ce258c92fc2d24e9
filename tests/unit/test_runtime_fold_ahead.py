"""mode="fold", float16 weights on a CPU with the one-pass kernel: a packed model's constant
DequantizeLinear nodes are folded as their levels decode (runtime_fold.FoldAhead), onnxruntime
parsing meanwhile; outputs bit-identical to the folded model's, errors reported, no thread left.
The float32 fold here runs the same kernel."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
import passes.runtime_fold as runtime_fold
from passes.errors import CorruptFileError

CPU = ["CPUExecutionProvider"]


def _float16_mlp(seed=0, layers=4, width=96):
    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) * 0.2).astype(np.float16), f"W{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]), helper.make_node("Relu", [f"h{i}"], [f"r{i}"])]
        prev = f"r{i}"
    graph = helper.make_graph(nodes, "mlp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3, width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, [3, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _packed_q8(tmp_path, model, name="mlp16", **kwargs):
    q8 = passes.quantize_weights(model, bits=8, min_elements=256, **kwargs)
    src, dst = tmp_path / f"{name}.q8.onnx", tmp_path / f"{name}.q8.onnxz"
    onnx.save(q8, str(src))
    passes.pack(str(src), str(dst))
    return q8, dst


def _feeds(width=96):
    return [{"x": np.random.default_rng(i).standard_normal((3, width)).astype(np.float16)} for i in range(3)]


def _folded_outputs(q8, feeds):
    session = ort.InferenceSession(passes.fold_dequantize(q8).SerializeToString(), providers=CPU)
    return [session.run(None, f)[0] for f in feeds]


def _fold_threads():
    return [t for t in threading.enumerate() if t.name == "passes-weight-fold" and t.is_alive()]


@pytest.fixture
def kernel_route(monkeypatch):
    monkeypatch.setattr(runtime_fold, "fold_kernel_fast", lambda: True)
    made = []

    class Recorded(runtime_fold.FoldAhead):
        def __init__(self, decode, jobs):
            made.append(len(jobs))
            super().__init__(decode, jobs)

    monkeypatch.setattr(runtime_fold, "FoldAhead", Recorded)
    return made


@pytest.mark.parametrize("block", [0, 32])
def test_packed_float16_weights_fold_as_they_decode(tmp_path, kernel_route, block):
    model = _float16_mlp()
    kwargs = {"granularity": "block", "block_size": block} if block else {}
    q8, packed = _packed_q8(tmp_path, model, **kwargs)
    feeds = _feeds()
    session = passes.InferenceSession(packed, mode="fold")
    assert session.fold_route == "here" and session.dtype == np.float16
    assert kernel_route and kernel_route[0] == 4  # the four weights folded as they decoded
    assert not session.op_counts.get("DequantizeLinear")
    for f, want in zip(feeds, _folded_outputs(q8, feeds)):
        got = session.run(None, f)[0]
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert not _fold_threads()


def test_a_fold_that_fails_is_reported(tmp_path, kernel_route, monkeypatch):
    _, packed = _packed_q8(tmp_path, _float16_mlp(seed=1))

    def broken(*args, **kwargs):
        raise RuntimeError("fold failed on purpose")

    monkeypatch.setattr(runtime_fold, "_dequantize", broken)
    with pytest.raises(CorruptFileError, match="fold failed on purpose"):
        passes.InferenceSession(packed, mode="fold")
    assert not _fold_threads()


def test_an_unpacked_model_folds_at_once(tmp_path, kernel_route):
    """A plain .onnx has no decode aside: folded on the calling thread, no FoldAhead."""
    q8, _ = _packed_q8(tmp_path, _float16_mlp(seed=2))
    path = tmp_path / "mlp16.q8.onnx"
    session = passes.InferenceSession(path, mode="fold")
    assert session.fold_route == "here" and not kernel_route
    feeds = _feeds()
    for f, want in zip(feeds, _folded_outputs(q8, feeds)):
        np.testing.assert_array_equal(session.run(None, f)[0].view(np.uint16), want.view(np.uint16))


class _SlowDecode:
    """A stand-in for BackgroundDecode: its one array is ready once `release` is set."""

    def __init__(self, levels):
        self.levels, self.release, self.waited = levels, threading.Event(), False

    def order(self, array):
        return 7 if array is self.levels or getattr(array, "base", None) is self.levels else -1

    def ready(self, array, block=True):
        if self.order(array) < 0:
            return True
        if not block and not self.release.is_set():
            return False
        self.release.wait()
        return True

    def wait(self):
        self.waited = True

    def abandon(self):
        self.release.set()


def test_fold_ahead_waits_for_the_levels_and_ranks_outputs_as_them():
    rng = np.random.default_rng(3)
    q = rng.integers(-128, 128, (64, 48), dtype=np.int8)
    scale = (rng.random(48) * 0.01 + 1e-3).astype(np.float16)
    out = np.empty(q.shape, np.float16)
    decode = _SlowDecode(q)
    ahead = runtime_fold.FoldAhead(decode, [(q, scale, None, 1, 0, out)])
    piece = out.reshape(-1).view(np.uint8)  # (what the model stream holds)
    assert ahead.order(piece) == 7 and ahead.order(np.zeros(3)) == -1
    assert not ahead.ready(piece, block=False)
    decode.release.set()
    assert ahead.ready(piece)
    want = passes.forms.dequantize_linear(q, scale, None, 1, 0)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))
    ahead.wait()
    assert decode.waited and not _fold_threads()


def test_fold_ahead_abandoned_before_its_levels_stops():
    q = np.zeros((8, 8), np.int8)
    decode = _SlowDecode(q)
    ahead = runtime_fold.FoldAhead(decode, [(q, np.ones(8, np.float16), None, 1, 0, np.empty((8, 8), np.float16))])
    ahead.abandon()
    assert not _fold_threads()


def test_float32_fold_here_runs_the_kernel(tmp_path, monkeypatch):
    calls = []
    real = runtime_fold._dequantize

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime_fold, "_dequantize", counted)
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 128)) * 0.1).astype(np.float32), "W")]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    q8 = passes.quantize_weights(model, bits=8, min_elements=256)
    path = tmp_path / "mm.q8.onnx"
    onnx.save(q8, str(path))
    session = passes.InferenceSession(path, mode="fold")
    assert session.fold_route == "here" and calls == [(64, 128)]
    x = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    want = ort.InferenceSession(passes.fold_dequantize(q8).SerializeToString(), providers=CPU).run(None, x)[0]
    np.testing.assert_array_equal(session.run(None, x)[0], want)


def test_dequantize_only_skips_walks_not_folds(tmp_path):
    """fold_into(dequantize_only=True), for graphs whose foldable nodes are plain DequantizeLinear
    nodes (fold_facts' onnxruntime_folds_all), leaves the same graph and weights as the full walks,
    and drops each quantized input once its last reader is folded; _consumer_counts(names) counts
    the reads of those names as the full count does."""
    from passes.runtime_source import read_split

    _packed_q8(tmp_path, _float16_mlp(seed=4))
    src = tmp_path / "mlp16.q8.onnx"
    full, fast = read_split(src), read_split(src)
    assert runtime_fold.fold_facts(fast) == (True, True)
    assert runtime_fold.fold_into(full) == runtime_fold.fold_into(fast, dequantize_only=True) == 4
    assert [(n.op_type, list(n.input)) for n in full.skeleton.graph.node] == \
           [(n.op_type, list(n.input)) for n in fast.skeleton.graph.node]
    assert sorted(full.weights) == sorted(fast.weights)
    assert all(a.dtype == np.float16 for a in fast.weights.values())  # (the 8-bit levels dropped)
    for name in full.weights:
        np.testing.assert_array_equal(full.weights[name], fast.weights[name])
    graph = read_split(src).skeleton.graph
    names = {n.input[1] for n in graph.node if n.op_type == "MatMul"} | {"x"}
    every = runtime_fold._consumer_counts(graph)
    assert runtime_fold._consumer_counts(graph, names) == {k: every[k] for k in names if k in every} | \
        {o.name: every[o.name] for o in graph.output}


def test_a_palette_indexed_by_a_constant_node_is_still_folded(monkeypatch):
    """fold_facts counts Constant-node indices as constant (constants_to_initializers makes them
    initializers before fold_into looks for palettes): such a palette is not taken for a graph of
    plain DequantizeLinear nodes, whose palette walk fold_into(dequantize_only=True) skips."""
    from passes.runtime_feed import SplitModel

    monkeypatch.setattr(runtime_fold, "fold_kernel_fast", lambda: True)
    rng = np.random.default_rng(5)
    table = numpy_helper.from_array(rng.standard_normal(16).astype(np.float16), "table")
    indices = numpy_helper.from_array(rng.integers(0, 16, (8, 8)).astype(np.uint8), "idx")
    nodes = [helper.make_node("Constant", [], ["idx"], value=indices),
             helper.make_node("Cast", ["idx"], ["idx64"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "idx64"], ["W"], axis=0),
             helper.make_node("MatMul", ["x", "W"], ["y"])]
    graph = helper.make_graph(nodes, "palette16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 8])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    split = SplitModel(model, {})
    assert runtime_fold.fold_facts(split) == (True, False)
    split = SplitModel(model, {})
    runtime_fold.constants_to_initializers(split)
    assert runtime_fold.fold_into(split, constants=False) == 2  # the Cast and the Gather
    assert [n.op_type for n in split.skeleton.graph.node] == ["MatMul"]
    want = numpy_helper.to_array(table)[numpy_helper.to_array(indices).astype(np.int64)]
    np.testing.assert_array_equal(split.array("W"), want)


def test_one_node_table_through_the_fold_steps_gives_what_the_walks_gave(tmp_path):
    """The fold route's steps read one runtime_feed.NodeTable (see NodeTable), kept current as
    constants_to_initializers and fold_into remove nodes: every answer, the graph and the weights
    are those of the same steps each walking the graph itself; a stale table is never used."""
    from passes.precision import dominant_float_dtype
    from passes.runtime_feed import NodeTable, graph_reads, node_table, operator_counts
    from passes.runtime_source import read_split

    q8, _ = _packed_q8(tmp_path, _float16_mlp(seed=6))
    graph = q8.graph
    shape = numpy_helper.from_array(np.array([3, 96], np.int64), "shape")
    graph.node.insert(0, helper.make_node("Constant", [], ["shape"], value=shape))
    graph.node.append(helper.make_node("Reshape", [graph.output[0].name, "shape"], ["y"]))
    graph.output[0].name = "y"
    onnx.save(q8, str(tmp_path / "with_constant.onnx"))
    walked, tabled = read_split(tmp_path / "with_constant.onnx"), read_split(tmp_path / "with_constant.onnx")
    table = NodeTable(tabled.skeleton.graph)
    assert dominant_float_dtype(walked) == dominant_float_dtype(tabled, table) == np.float16
    assert runtime_fold.fold_facts(walked) == runtime_fold.fold_facts(tabled, table) == (True, True)
    assert runtime_fold.little_to_share(walked) == runtime_fold.little_to_share(tabled, table)
    runtime_fold.constants_to_initializers(walked)
    runtime_fold.constants_to_initializers(tabled, table)
    assert table.current() and "Constant" not in [row[0] for row in table.rows]
    assert runtime_fold.fold_into(walked, constants=False, dequantize_only=True) == \
        runtime_fold.fold_into(tabled, constants=False, dequantize_only=True, table=table) == 4
    assert table.current() and [row[:3] for row in table.rows] == \
        [(n.op_type, n.domain, list(n.input)) for n in tabled.skeleton.graph.node]
    assert walked.skeleton.SerializeToString() == tabled.skeleton.SerializeToString()
    assert sorted(walked.weights) == sorted(tabled.weights)
    a, b = graph_reads(walked.skeleton.graph, walked.weights), graph_reads(tabled.skeleton.graph, tabled.weights,
                                                                          table=table)
    assert (a.used, a.readers, a.outer, a.op_counts) == (b.used, b.readers, b.outer, b.op_counts)
    assert operator_counts(tabled.skeleton.graph, table) == a.op_counts
    # a table no longer listing the graph's nodes is not used: a fresh one is read
    tabled.skeleton.graph.node.add().CopyFrom(helper.make_node("Identity", ["y"], ["z"]))
    assert not table.current() and node_table(tabled.skeleton.graph, table) is not table
    assert operator_counts(tabled.skeleton.graph, table)["Identity"] == 1
