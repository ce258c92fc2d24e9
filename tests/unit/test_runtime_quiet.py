"""runtime_quiet: onnxruntime's intra-op workers in SCHED_IDLE while a streamed model is parsed,
put back before the session initialises; outputs unchanged; off by SURGEON_IDLE_ORT_WORKERS=0."""
from __future__ import annotations

import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
import passes.runtime as runtime
import passes.runtime_quiet as quiet

CPU = ["CPUExecutionProvider"]

pytestmark = pytest.mark.skipif(not quiet.idle_workers_enabled(),
                                reason="SCHED_IDLE threads cannot be put back here (no CAP_SYS_NICE / RLIMIT_NICE)")


def _policies() -> dict:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quiet")  # (6 MB of weights: more than the 1 MiB pipe holds)
    rng = np.random.default_rng(5)
    # float16 weights: on a CPU they travel inside the model streamed to onnxruntime (never shared),
    # so the stream is what onnxruntime waits on while they decode and fold
    inits = [numpy_helper.from_array((rng.standard_normal((1024, 1024)) / 32).astype(np.float16), f"w{i}")
             for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w1"], ["c"]), helper.make_node("MatMul", ["c", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 1024])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 1024])], inits)
    src = folder / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    q8 = folder / "m.q8.onnx"
    onnx.save(passes.quantize_weights(str(src), bits=8), str(q8))
    folded = folder / "m.q8.folded.onnx"
    onnx.save(passes.fold_dequantize(str(q8)), str(folded))
    out = {"float": src, "folded": folded}
    for key, path in (("floatz", src), ("q8z", q8)):
        out[key] = folder / f"m.{key}.onnxz"
        passes.pack(str(path), str(out[key]), force=True)
    return out


@pytest.fixture
def record(monkeypatch):
    """What each IdleNewThreads caught (tid -> policy right after the catch) and put back."""
    seen = {"caught": {}, "restored": []}
    catch, restore = quiet.IdleNewThreads.catch, quiet.IdleNewThreads.restore

    def recording_catch(self, settled=False):
        catch(self, settled)
        for tid in self._idled:
            if tid not in seen["caught"]:
                seen["caught"][tid] = os.sched_getscheduler(tid)

    def recording_restore(self):
        seen["restored"] += self._idled
        restore(self)

    monkeypatch.setattr(quiet.IdleNewThreads, "catch", recording_catch)
    monkeypatch.setattr(quiet.IdleNewThreads, "restore", recording_restore)
    return seen


@pytest.mark.parametrize("key,reference", [("floatz", "float"), ("q8z", "folded")])
def test_workers_idle_during_the_parse_and_back_before_runs(packs, record, key, reference):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2  # (one intra-op worker)
    session = passes.InferenceSession(str(packs[key]), options, providers=CPU, mode="fold")
    assert record["caught"], "no onnxruntime worker was caught during the parse"
    assert set(record["caught"].values()) == {os.SCHED_IDLE}
    assert set(record["restored"]) >= set(record["caught"])
    assert os.SCHED_IDLE not in _policies().values()
    x = {"x": np.random.default_rng(1).standard_normal((4, 1024)).astype(np.float16)}
    plain = ort.InferenceSession(str(packs[reference]), options, providers=CPU)
    np.testing.assert_array_equal(session.run(None, x)[0], plain.run(None, x)[0])


def test_off_by_environment(packs, record, monkeypatch):
    monkeypatch.setenv("SURGEON_IDLE_ORT_WORKERS", "0")
    assert quiet.idle_new_threads() is None
    passes.InferenceSession(str(packs["floatz"]), providers=CPU, mode="fold")
    assert not record["caught"]


def test_python_threads_and_chosen_policies_are_left_alone():
    idle = quiet.IdleNewThreads()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        idle.catch()
        assert not idle.caught and os.sched_getscheduler(worker.native_id) == os.SCHED_OTHER
    finally:
        stop.set()
        worker.join()
        idle.restore()


def test_a_refused_model_leaves_no_thread_idle(record):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    with pytest.raises(Exception):
        runtime.parse_pieces(options, [b"\x08\x07" + b"\xff" * (3 << 20)], False, quiet=quiet.IdleNewThreads())
    assert os.SCHED_IDLE not in _policies().values()
