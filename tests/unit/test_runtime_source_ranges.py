"""The session's reads of external tensor data (runtime_source: an .onnx's files mapped, a pack's
files decoded) check each range as passes.load does (_fileio.ExternalRanges): many tensors
naming one range, a malformed or negative offset and a range beyond its file are refused with
load's InvalidModelError, before onnxruntime gets a copy of each tensor (a thousand tensors
naming one 4 MiB range loaded, taking 4 GB from an .onnx, 8 GB from its 1 MB pack)."""
from __future__ import annotations

import numpy as np
import pytest

import passes
from onnxz_helpers import external_ranges_packed
from passes.errors import InvalidModelError
from passes.runtime_source import read_split


def test_many_tensors_naming_one_range_are_refused_by_the_session(tmp_path):
    size = 2 << 20
    src, packed = external_ranges_packed(tmp_path, [("0", str(size))] * 40, size)  # 80 MiB named in a 2 MiB file
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match="external data ranges overlap") as load_error:
            passes.load(path)
        with pytest.raises(InvalidModelError, match="external data ranges overlap") as read_error:
            read_split(path)
        assert str(read_error.value) == str(load_error.value)
        with pytest.raises(InvalidModelError, match="external data ranges overlap"):
            passes.InferenceSession(str(path))


def test_a_few_tensors_sharing_a_range_still_run(tmp_path):
    size = 64 << 10
    src, packed = external_ranges_packed(tmp_path, [("0", str(size)), ("0", str(size))], size)
    want = np.arange(size // 4, dtype=np.float32)
    for path in (src, packed):
        split = read_split(path)
        np.testing.assert_array_equal(split.weights["W0"], want)
        np.testing.assert_array_equal(split.weights["W1"], want)
        outs = passes.InferenceSession(str(path)).run(None, {})
        np.testing.assert_array_equal(outs[1], want)


def test_a_range_its_dims_do_not_fit_is_an_invalid_model(tmp_path):
    """Not a bare ValueError from numpy's reshape (the pack's reader words it its own way)."""
    src, packed = external_ranges_packed(tmp_path, [("0", "4096"), ("4096", "4096")], 16384)
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match=r"'W0'.*shape \[4096\]"):
            read_split(path)


@pytest.mark.parametrize("offset,length,match", [
    ("abc", "4096", "'W1' has a malformed external data offset or length"),
    ("0", "x1", "'W1' has a malformed external data offset or length"),
    ("-8", "4096", r"declares external data bytes -8\.\.4088"),
    ("4096", "4096", r"declares external data bytes 4096\.\.8192 but 'w.bin' holds 4096"),
])
def test_a_bad_range_is_refused_by_the_session_as_by_load(tmp_path, monkeypatch, offset, length, match):
    src, packed = external_ranges_packed(tmp_path, [("0", "4096"), (offset, length)], 4096, monkeypatch)
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match=match):
            passes.load(path)
        with pytest.raises(InvalidModelError, match=match):
            read_split(path)
        with pytest.raises(InvalidModelError, match=match):
            passes.InferenceSession(str(path))


def test_a_dotted_location_is_found_in_the_pack(tmp_path):
    """The index names each file by its normal name: "./w.bin" is "w.bin" there (as load reads it)."""
    src, packed = external_ranges_packed(tmp_path, [("0", "4096")], 4096, location="./w.bin")
    out = passes.InferenceSession(str(packed)).run(None, {})[0]
    np.testing.assert_array_equal(out, np.arange(1024, dtype=np.float32))
