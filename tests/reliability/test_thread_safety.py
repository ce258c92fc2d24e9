"""Thread safety (issue 6 item 6): concurrent passes.load, open_packed(...).get_tensor on one
shared PackedModel and on one per thread, unpack and verify, from several threads at once (and
with the readers' own decode pools), all give exactly the original results; closing a shared
PackedModel while other threads read gives each of them the right tensor or a documented error.
"""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import passes
from passes import SurgeonError

THREADS = 8
ROUNDS = 12


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture
def packed_files(samples, tmp_path):
    """Three packed samples on disk: name -> (path, sample)."""
    out = {}
    for name in ("all_families", "external_data", "fpairs_forced"):
        p = tmp_path / f"{name}.onnxz"
        p.write_bytes(samples[name].packed)
        out[name] = (p, samples[name])
    return out


def _hammer(worker, n=THREADS):
    """Run worker(i) in n threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        return worker(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


@pytest.mark.parametrize("reader_threads", [1, 3])
def test_shared_packed_model_get_tensor(packed_files, reader_threads):
    path, sample = packed_files["all_families"]
    keys = list(sample.tensors)
    with passes.open_packed(path, threads=reader_threads) as pm:
        def worker(i):
            rng = random.Random(i)
            for _ in range(ROUNDS * len(keys)):
                k = rng.choice(keys)
                assert _same(pm.get_tensor(k), sample.tensors[k]), k
            return True

        assert all(_hammer(worker))


def test_one_packed_model_per_thread_and_load(packed_files):
    files = list(packed_files.values())

    def worker(i):
        path, sample = files[i % len(files)]
        for _ in range(ROUNDS):
            with passes.open_packed(path, threads=2) as pm:
                for k, want in sample.tensors.items():
                    assert _same(pm.get_tensor(k), want), k
            model = passes.load(path, threads=2)
            assert model.graph.name == "sample"
        return True

    assert all(_hammer(worker))


def test_concurrent_load_gives_identical_models(packed_files):
    path, _ = packed_files["fpairs_forced"]
    reference = passes.load(path, threads=1).SerializeToString()
    results = _hammer(lambda i: passes.load(path, threads=1 + i % 3).SerializeToString())
    assert all(r == reference for r in results)


def test_concurrent_unpack_and_verify(packed_files, tmp_path):
    path, sample = packed_files["external_data"]

    def worker(i):
        out = tmp_path / f"out{i}"
        out.mkdir()
        dst = passes.unpack(path, out / "model.onnx", threads=2)
        assert dst.read_bytes() == sample.files[""]
        assert (out / "weights.bin").read_bytes() == sample.files["weights.bin"]
        assert passes.verify(path, against=dst, threads=2).ok
        return True

    assert all(_hammer(worker))


def test_close_while_other_threads_read(packed_files):
    """Each read either returns the exact tensor or raises a SurgeonError (closed file)."""
    path, sample = packed_files["all_families"]
    keys = list(sample.tensors)
    for attempt in range(5):
        pm = passes.open_packed(path, threads=2)
        outcomes = []
        start = threading.Event()

        def reader(i):
            start.wait()
            rng = random.Random(i * 100 + attempt)
            for _ in range(40):
                k = rng.choice(keys)
                try:
                    got = pm.get_tensor(k)
                except SurgeonError:
                    outcomes.append("error")
                    continue
                except Exception as exc:  # noqa: BLE001
                    outcomes.append(f"foreign {type(exc).__name__}: {exc}")
                    continue
                outcomes.append("ok" if _same(got, sample.tensors[k]) else f"WRONG {k}")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        start.set()
        pm.close()
        for t in threads:
            t.join()
        bad = [o for o in outcomes if o not in ("ok", "error")]
        assert not bad, bad[:5]


def test_concurrent_passes_on_shared_model():
    """quantize_weights and fold_dequantize never modify their input: one ModelProto shared by
    8 threads gives 8 identical results and stays unchanged."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 64])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    results = _hammer(lambda i: passes.fold_dequantize(passes.quantize_weights(model)).SerializeToString())
    assert len(set(results)) == 1
    assert model.SerializeToString() == before
