"""mode="fold" of float16 weights on a CPU: the big DequantizeLinear nodes folded on a worker
thread (runtime_fold.fold_in_background / BackgroundFold) while the skeleton is prepared and
parsed; outputs bit-identical to the folded model's (fold_dequantize), whatever the form."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import CorruptFileError
from passes.runtime_feed import split_model
from passes.runtime_fold import BackgroundFold, FoldJob, fold_in_background

from test_runtime import damage_biggest_weight, run, run_plain

FOLD_THREAD = "passes-weight-fold"


def _fold_threads() -> list:
    return [t for t in threading.enumerate() if t.name == FOLD_THREAD and t.is_alive()]


def _levels(shape, seed, dtype=np.int8):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape, dtype=dtype)


def forms_model():
    """float16 MatMul / Gather weights in every DequantizeLinear form the fold meets: per-axis on
    either axis, per tensor with a uint8 zero point, 32-blocks with int8 zero points, levels
    shared by two nodes, an embedding table, one weight too small to be fed (left to
    onnxruntime), and extreme scales (subnormal and overflowing products)."""
    f16 = np.float16
    inits = [
        numpy_helper.from_array(_levels((64, 96), 1), "Aq"),
        numpy_helper.from_array(np.random.default_rng(2).uniform(1e-3, 2e-2, 96).astype(f16), "As"),
        numpy_helper.from_array(_levels((96, 80), 3), "Bq"),
        numpy_helper.from_array(np.geomspace(1e-7, 600.0, 96).astype(f16), "Bs"),  # along axis 0
        numpy_helper.from_array(_levels((80, 64), 4, np.uint8), "Cq"),
        numpy_helper.from_array(np.array(0.0125, f16), "Cs"),
        numpy_helper.from_array(np.array(131, np.uint8), "Cz"),
        numpy_helper.from_array(_levels((64, 128), 5), "Dq"),
        numpy_helper.from_array(np.random.default_rng(6).uniform(1e-3, 1e-2, (2, 128)).astype(f16), "Ds"),
        numpy_helper.from_array(_levels((2, 128), 7), "Dz"),
        numpy_helper.from_array(_levels((300, 64), 8), "Eq"),
        numpy_helper.from_array(np.random.default_rng(9).uniform(1e-3, 3e-2, 300).astype(f16), "Es"),
        numpy_helper.from_array(_levels((64,), 10), "Sq"),
        numpy_helper.from_array(np.array(0.01, f16), "Ss"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["Aq", "As"], ["A"], axis=1),
        helper.make_node("DequantizeLinear", ["Bq", "Bs"], ["B"], axis=0),
        helper.make_node("DequantizeLinear", ["Cq", "Cs", "Cz"], ["C"]),
        helper.make_node("DequantizeLinear", ["Dq", "Ds", "Dz"], ["D"], axis=0, block_size=32),
        helper.make_node("DequantizeLinear", ["Dq", "Ds", "Dz"], ["D2"], axis=0, block_size=32),
        helper.make_node("DequantizeLinear", ["Eq", "Es"], ["E"], axis=0),
        helper.make_node("DequantizeLinear", ["Sq", "Ss"], ["S"]),
        helper.make_node("Gather", ["E", "ids"], ["e"], axis=0),
        helper.make_node("MatMul", ["e", "A"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["t1"]),
        helper.make_node("MatMul", ["t1", "B"], ["h2"]),
        helper.make_node("Tanh", ["h2"], ["t2"]),
        helper.make_node("MatMul", ["t2", "C"], ["h3"]),
        helper.make_node("MatMul", ["h3", "D"], ["h4"]),
        helper.make_node("Transpose", ["D2"], ["D2t"]),
        helper.make_node("MatMul", ["h4", "D2t"], ["h5"]),
        helper.make_node("Add", ["h5", "S"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 5, 64])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(m, full_check=True)
    return m


FEEDS = [{"ids": np.random.default_rng(i).integers(0, 300, (2, 5), dtype=np.int64)} for i in range(3)]


@pytest.fixture(autouse=True)
def a_spare_core(monkeypatch):
    """The fold aside runs where a core is free; the machine running the tests may be busy."""
    import passes.runtime_fold as runtime_fold

    monkeypatch.setattr(runtime_fold, "spare_core", lambda: True)


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    root = tmp_path_factory.mktemp("fold_background")
    m = forms_model()
    onnx.save(m, str(root / "m.onnx"))
    passes.pack(str(root / "m.onnx"), str(root / "m.onnxz"))
    return {"model": m, "onnx": root / "m.onnx", "onnxz": root / "m.onnxz",
            "want": run_plain(passes.fold_dequantize(m), FEEDS)}


@pytest.mark.parametrize("source", ["onnx", "onnxz"])
def test_outputs_equal_the_folded_models(forms, source):
    session = passes.InferenceSession(forms[source], mode="fold")
    assert session.dtype == np.float16 and session.fold_route == "aside"
    # the big ones folded here; only the 64-element one (inline, too small to feed) is left
    assert session.op_counts.get("DequantizeLinear") == 1
    for got, want in zip(run(session, FEEDS), forms["want"]):
        assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
    assert not _fold_threads()


def test_plan_reads_no_values_and_keeps_unusual_forms():
    """fold_in_background decides from shapes and types only; a node whose form it does not
    handle (output_dtype, a scale that does not match) stays for onnxruntime."""
    m = forms_model()
    for node in m.graph.node:
        if node.output[0] == "A":
            node.attribute.append(helper.make_attribute("output_dtype", TensorProto.FLOAT16))
        if node.output[0] == "B":
            node.attribute[0].i = 1  # scales of 96 along an axis of 80: onnxruntime reports it
    split = split_model(m)
    left = fold_in_background(split)
    split.wait_weights()
    kept = sorted(n.output[0] for n in split.skeleton.graph.node if n.op_type == "DequantizeLinear")
    assert kept == ["A", "B", "S"] and left == 3
    assert {"C", "D", "D2", "E"} <= set(split.weights)
    split.refresh_placeholders()  # (as the runtime does next: levels nothing reads are dropped)
    assert "Dq" not in split.weights and "Aq" in split.weights


def test_fold_waits_for_its_levels_and_streams_in_order():
    """A job runs once its inputs are ready (the inner decode's ready()), fold outputs rank after
    the decoded arrays, and ready(block=False) says whether a fold output holds its values."""
    gate = threading.Event()
    x = _levels((64, 64), 1)

    class Inner:
        def ready(self, array, block=True):
            if array is x:
                if not block and not gate.is_set():
                    return False
                gate.wait()
            return True

        def order(self, array):
            return 7

        def wait(self):
            pass

        def abandon(self):
            pass

    out = np.empty(x.shape, np.float16)
    scale = np.full(64, 0.01, np.float16)
    fold = BackgroundFold([FoldJob("W", out, x, scale, None, 1, 0)], Inner())
    other = np.zeros(4)
    assert fold.order(other) == 7 and fold.order(out) > 7
    assert not fold.ready(out.reshape(-1).view(np.uint8), block=False)  # (a view of it: the writer's piece)
    assert fold.ready(other, block=False)
    gate.set()
    assert fold.ready(out)
    fold.wait()
    want = passes.forms.dequantize_linear(x, scale, None, axis=1)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


def test_a_failed_job_is_reported_and_the_rest_skipped():
    class Inner:
        def ready(self, array, block=True):
            raise CorruptFileError("damaged .onnxz file: chunk checksum")

        def order(self, array):
            return -1

        def wait(self):
            raise CorruptFileError("damaged .onnxz file: chunk checksum")

        def abandon(self):
            pass

    jobs = [FoldJob(f"W{i}", np.empty((64, 64), np.float16), _levels((64, 64), i), np.float16(0.5).reshape(()),
                    None, 1, 0) for i in range(3)]
    fold = BackgroundFold(jobs, Inner())
    with pytest.raises(CorruptFileError):
        fold.ready(jobs[2].out)
    with pytest.raises(CorruptFileError):
        fold.wait()
    assert not _fold_threads()


def test_abandon_stops_after_the_job_in_progress():
    started, release = threading.Event(), threading.Event()

    class Inner:
        def ready(self, array, block=True):
            started.set()
            release.wait()
            return True

        def order(self, array):
            return -1

        def wait(self):
            pass

        def abandon(self):
            release.set()

    done = []
    jobs = [FoldJob(f"W{i}", np.empty((64, 64), np.float16), _levels((64, 64), i), np.float16(0.5).reshape(()),
                    None, 1, 0) for i in range(4)]
    fold = BackgroundFold(jobs, Inner())
    started.wait()
    fold.abandon()
    done = [j for j in jobs if j.x is None]  # (a finished job lets go of its levels)
    assert len(done) <= 1 and not _fold_threads()


def test_damaged_pack_is_refused_and_no_thread_left(forms, tmp_path):
    bad = damage_biggest_weight(forms["onnxz"], tmp_path / "bad.onnxz")
    with pytest.raises(CorruptFileError):
        passes.InferenceSession(bad, mode="fold")
    assert not _fold_threads()


@pytest.mark.parametrize("cores,load", [(1, 0.0), (2, 1.5), (4, 3.2)])
def test_without_a_spare_core_onnxruntime_folds(forms, monkeypatch, cores, load):
    """One core, or every core busy (load average): nothing would overlap, so the model goes to
    onnxruntime as it is and its constant folding does every DequantizeLinear (the cheaper fold
    in CPU); outputs equal the folded model's all the same."""
    import passes.runtime_fold as runtime_fold

    monkeypatch.undo()  # (the autouse spare core)
    monkeypatch.setattr(runtime_fold, "usable_cores", lambda: cores)
    monkeypatch.setattr(runtime_fold.os, "getloadavg", lambda: (load, load, load))
    assert not runtime_fold.spare_core()
    session = passes.InferenceSession(forms["onnxz"], mode="fold")
    assert session.op_counts.get("DequantizeLinear") == 7 and session.fold_route == "onnxruntime"
    for got, want in zip(run(session, FEEDS), forms["want"]):
        assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16))


def test_a_spare_core_is_an_idle_one(monkeypatch):
    import passes.runtime_fold as runtime_fold

    monkeypatch.undo()
    monkeypatch.setattr(runtime_fold, "usable_cores", lambda: 2)
    monkeypatch.setattr(runtime_fold.os, "getloadavg", lambda: (0.7, 2.0, 2.0))
    assert runtime_fold.spare_core()
