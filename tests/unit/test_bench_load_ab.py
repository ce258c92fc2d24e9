"""bench/load.py's A/B of runtime constants (BENCH_LOAD_SET, set in the worker before the clock) and
its round-by-round comparison of each passes row with its +ab twin."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import passes.runtime as runtime

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load.py"


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("bench_load_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_reach_module_and_class_constants(load, monkeypatch):
    monkeypatch.setattr(runtime, "PIPE_BYTES", runtime.PIPE_BYTES)
    monkeypatch.setattr(runtime._DrainPacer, "DRAIN_SHARE", runtime._DrainPacer.DRAIN_SHARE)
    load._apply_settings("passes.runtime.PIPE_BYTES=65536; passes.runtime._DrainPacer.DRAIN_SHARE=0.5;")
    assert runtime.PIPE_BYTES == 65536 and runtime._DrainPacer.DRAIN_SHARE == 0.5
    load._apply_settings("")  # (nothing set)


@pytest.mark.parametrize("text", ["passes.runtime.NO_SUCH=1", "PIPE_BYTES=1", "passes.runtime._DrainPacer.NO=1",
                                  "no_such_module.X=1"])
def test_a_setting_naming_nothing_stops_the_worker(load, text):
    with pytest.raises(SystemExit, match="BENCH_LOAD_SET"):
        load._apply_settings(text)


def test_rounds_are_kept_and_paired_with_the_ab_twin(load, monkeypatch, capsys):
    times = iter([0.10, 0.20, 0.12, 0.20, 0.30, 0.20])  # rounds interleaved: a, b, a, b, a, b

    def worker(spec):
        t = next(times)
        return {"ready_s": t, "ready_cpu_s": t / 2, "ready_sleeps": 1, "ready_main_sleeps": 0,
                **{k: 1.0 for k in load.BEST_KEYS if k not in ("ready_s", "ready_cpu_s")}}

    monkeypatch.setattr(load, "run_worker", worker)
    a, b = load.best_of_many([{"n": "a"}, {"n": "b"}], 3)
    assert a["ready_s_rounds"] == [0.10, 0.12, 0.30] and b["ready_s_rounds"] == [0.20, 0.20, 0.20]
    rows = [{"model": "m", "file": "float.onnxz", "mode": "fold", **{k: a[k] for k in ("ready_s_rounds", "ready_cpu_s_rounds")}},
            {"model": "m", "file": "float.onnxz", "mode": "fold+ab", "ab_env": True,
             **{k: b[k] for k in ("ready_s_rounds", "ready_cpu_s_rounds")}}]
    load._print_paired(rows)
    out = capsys.readouterr().out
    assert "ready 0.60 (0.55-1.05)" in out and "[3 rounds]" in out


_NATIVE_PROBE = r"""
import importlib.util, sys, threading, time
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
spec = importlib.util.spec_from_file_location("bench_load_probe", sys.argv[1])
load = importlib.util.module_from_spec(spec); spec.loader.exec_module(load)

def burn():  # a Python thread busy for 0.2 s of its own CPU
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
clock = load.NativeThreadsCpu()
before = clock.seconds()
t = threading.Thread(target=burn); t.start(); t.join()
python_thread = clock.seconds() - before

w = numpy_helper.from_array(np.ones((512, 512), np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 512])], initializer=[w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
options = ort.SessionOptions(); options.intra_op_num_threads = 2
before = clock.seconds()
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
for _ in range(20):
    session.run(None, {"x": np.ones((256, 512), np.float32)})
onnxruntime_threads = clock.seconds() - before
clock.close()
print(python_thread, onnxruntime_threads)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU is read from Linux /proc")
def test_native_thread_cpu_counts_onnxruntime_pools_not_python_threads():
    import subprocess
    import sys

    # (a fresh interpreter: no worker of an earlier test's session spins meanwhile)
    out = subprocess.run([sys.executable, "-c", _NATIVE_PROBE, str(BENCH)], capture_output=True, text=True, check=True)
    python_thread, onnxruntime_threads = map(float, out.stdout.split())
    assert python_thread < 0.05  # (the 0.2 s a Python thread burned is not counted)
    assert onnxruntime_threads > 0  # (the intra-op worker's spin and work are)
