"""_planes.whole_file_plan (C) against the Python pass of PackedFile._whole_file_tasks: the same
skeleton runs copied, the same tasks in the same order (chunks of other codecs one by one, then the
ans batch with the same specs and outputs at the same places), and the same file restored."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from onnx import numpy_helper

from onnxz_helpers import pack_and_read_index
from passes.onnxz import codecs, reader

pytestmark = pytest.mark.skipif(reader._whole_file_plan is None or reader._copy_runs is None
                                or reader._decode_batch_c is None, reason="_planes.whole_file_plan not built")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A pack mixing `ans` (int8, float32), `ans_shared` (small tensors) and other codecs (a float32
    tensor of few distinct values, a noise tensor stored by zstd), with skeleton bytes between them."""
    tmp = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((200, 150)).astype(np.float32), "f"),
             numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 6, 70000)), -127, 127).astype(np.int8), "q"),
             numpy_helper.from_array(rng.integers(0, 256, 30000, dtype=np.uint8), "noise"),
             numpy_helper.from_array(np.repeat(np.float32([0.5, -1.0, 2.0]), 4000), "few")]
    for i in range(12):
        inits.append(numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 5, 1500)), -127, 127).astype(np.int8), f"s{i}"))
        inits.append(numpy_helper.from_array((rng.standard_normal(300) * 0.05).astype(np.float32), f"b{i}"))
    src, dst, _, _ = pack_and_read_index(tmp, inits, catalog=True)
    return src, dst


def _plan(pf, monkeypatch, fast):
    monkeypatch.setattr(reader, "_whole_file_plan", fast)
    fe = pf.index.files[0]
    window = np.zeros(fe.size, np.uint8)
    tasks = pf._whole_file_tasks(fe, window, pf.skeleton(0))
    shape = []
    for fn, *args in tasks:
        if fn == pf._decode_batch:
            items = []
            for item in args[0]:
                out = np.frombuffer(item[5], np.uint8)  # (a memoryview in C, a numpy slice in Python)
                items.append(item[:5] + (out.ctypes.data - window.ctypes.data, out.size) + tuple(item[6:]))
            shape.append(("batch", items))
        else:
            stream, chunk, out = args
            shape.append(("chunk", id(stream), id(chunk), out.ctypes.data - window.ctypes.data, out.size))
    return window, tasks, shape


def test_the_c_plan_is_the_python_pass(packed, monkeypatch):
    _, dst = packed
    with reader.PackedFile(dst, threads=1) as pf:
        kinds = {te.stream.codec for te in pf.index.coded.values()}
        assert {"ans", "ans_shared"} <= kinds and kinds - {"ans", "ans_shared"}, kinds
        w_c, tasks_c, shape_c = _plan(pf, monkeypatch, reader._whole_file_plan)
        w_py, tasks_py, shape_py = _plan(pf, monkeypatch, None)
        assert shape_c == shape_py
        assert np.array_equal(w_c, w_py)  # the skeleton runs
        for window, tasks in ((w_c, tasks_c), (w_py, tasks_py)):
            for fn, *args in tasks:
                fn(*args)
        assert np.array_equal(w_c, w_py)


def test_unpack_with_and_without_the_c_plan_restores_the_file(packed, monkeypatch, tmp_path):
    src, dst = packed
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    plan = reader._whole_file_plan
    for fast in (plan, None):
        monkeypatch.setattr(reader, "_whole_file_plan", fast)
        out = reader.unpack(dst, tmp_path / "back.onnx", threads=1, force=True)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == want


def test_a_damaged_plan_input_raises_not_crashes(packed):
    _, dst = packed
    with reader.PackedFile(dst, threads=1) as pf:
        fe = pf.index.files[0]
        window = np.zeros(fe.size, np.uint8)
        with pytest.raises(ValueError):
            reader._whole_file_plan([[0, 1, 0]], pf.index.coded, window, fe.size)  # not a tuple
        with pytest.raises(KeyError):
            reader._whole_file_plan([(0, 1, 10 ** 6)], pf.index.coded, window, fe.size)
        off, ln, ti = fe.cuts[-1]
        with pytest.raises(ValueError):  # a chunk past the window's end
            reader._whole_file_plan([(off, ln, ti)], pf.index.coded, window, off + ln - 1)
    assert codecs._fast is not None
