"""Outputs the pack reader allocates itself (tensors_bytes, get_tensors, restore_file and
read_range without `out`): numpy arrays (huge pages, numpy's own choice) while they add up to
its budget (FRESH_HUGE_BYTES, or this host's: passes/_pages.huge_page_budget), then private
mappings that refuse huge pages (reader._small_pages) — with the
same bytes as the numpy decoder, and as arrays like any other (writable, contiguous, freed with
their last view)."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import passes
from passes.onnxz import codecs, reader
from passes.onnxz.reader import PackedFile, open_packed

MiB = 1 << 20


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(pack path, {name: array}): three trained-looking float32 weights of 4 MiB and a small one."""
    folder = tmp_path_factory.mktemp("fresh")
    rng = np.random.default_rng(8)
    weights = {f"w{i}": (rng.standard_normal((1024, 1024)) * 0.02).astype(np.float32) for i in range(3)}
    weights["b"] = rng.standard_normal(1000).astype(np.float32)
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, n) for n, w in weights.items()]))
    onnx.save_model(m, str(folder / "m.onnx"))
    passes.pack(folder / "m.onnx", folder / "m.onnxz")
    return folder / "m.onnxz", weights


def _vm_flags(array):
    """The VmFlags of the mapping holding `array`'s first byte (/proc/self/smaps), or None."""
    address = array.__array_interface__["data"][0]
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return None


def _numpy_tensors(path, monkeypatch) -> dict:
    """Every tensor through the per-chunk numpy decoder (the C paths switched off)."""
    with monkeypatch.context() as m:
        m.setattr(reader, "_decode_batch_c", None)
        m.setattr(codecs, "_fast", None)
        with open_packed(path, threads=1) as pm:
            return {k: v.copy() for k, v in pm.get_tensors().items()}


@pytest.mark.parametrize("threads", [1, 2])
def test_past_the_budget_outputs_refuse_huge_pages_and_hold_the_same_bytes(packed, monkeypatch, threads):
    path, weights = packed
    want = _numpy_tensors(path, monkeypatch)
    monkeypatch.setattr(reader, "FRESH_HUGE_BYTES", 5 * MiB)  # room for one 4 MiB weight
    with PackedFile(path, threads=threads) as pf:
        entries = sorted((t for t in pf.index.tensors if t.length >= 4 * MiB), key=lambda t: t.key)
        assert len(entries) == 3
        outs = pf.tensors_bytes(entries)
        assert outs[0].base is None  # within the budget: numpy's own array, as before
        if sys.platform.startswith("linux"):
            flags = [_vm_flags(o) for o in outs[1:]]
            if None not in flags:
                assert all("nh" in f and "hg" not in f for f in flags)
        for e, out in zip(entries, outs):
            assert out.dtype == np.uint8 and out.flags.c_contiguous and out.flags.writeable and out.size == e.length
            assert out.tobytes() == weights[e.key].tobytes() == want[e.key].tobytes()
        out = pf.read_range(entries[0].file, entries[0].offset, entries[0].length)  # past it too
        assert out.base is not None and out.tobytes() == weights[entries[0].key].tobytes()
    with open_packed(path, threads=threads) as pm:  # the small tensor and the first big one: numpy's
        got = pm.get_tensors()
    assert set(got) == set(weights)
    for name, array in got.items():
        assert array.dtype == weights[name].dtype and np.array_equal(array, weights[name])
        array[...] = 0  # writable, its own memory
    assert np.array_equal(got["w1"], np.zeros_like(weights["w1"]))


def test_a_whole_file_restored_past_the_budget_is_the_file(packed, monkeypatch, tmp_path):
    path, _ = packed
    monkeypatch.setattr(reader, "FRESH_HUGE_BYTES", 0)
    passes.unpack(path, tmp_path / "back.onnx")
    with PackedFile(path, threads=2) as pf:
        restored = pf.restore_file(0)
        assert restored.base is not None  # a mapping of its own
        assert restored.tobytes() == (tmp_path / "back.onnx").read_bytes()


def test_the_budget_is_per_file_and_small_outputs_never_use_it(packed, monkeypatch):
    path, weights = packed
    monkeypatch.setattr(reader, "FRESH_HUGE_BYTES", 4 * MiB)
    for _ in range(2):  # each open starts with the whole budget
        with PackedFile(path, threads=1) as pf:
            small = pf.tensor_bytes("b")
            assert small.base is None and pf._huge_left == 4 * MiB
            first = pf.tensor_bytes("w0")
            assert first.base is None and pf._huge_left == 0
            second = pf.tensor_bytes("w1")
            assert second.base is not None and second.tobytes() == weights["w1"].tobytes()


def test_without_its_own_budget_the_reader_takes_the_hosts(packed, monkeypatch):
    """FRESH_HUGE_BYTES None (the default): the budget of passes/_pages.huge_page_budget, the
    runtime arena's: a limit on a host whose balloon reports free pages, none (inf) elsewhere."""
    path, weights = packed
    assert reader.FRESH_HUGE_BYTES is None
    monkeypatch.setattr(reader, "huge_page_budget", lambda: 4 * MiB)
    with PackedFile(path, threads=1) as pf:
        outs = [pf.tensor_bytes(k) for k in ("w0", "w1")]
        assert outs[0].base is None and outs[1].base is not None
        assert [o.tobytes() for o in outs] == [weights["w0"].tobytes(), weights["w1"].tobytes()]
    monkeypatch.setattr(reader, "huge_page_budget", lambda: float("inf"))
    with PackedFile(path, threads=1) as pf:
        assert all(pf.tensor_bytes(k).base is None for k in ("w0", "w1", "w2"))
