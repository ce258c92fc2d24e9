"""passes.decode_array (the lossy tensor codec's blob reader) on damaged and crafted blobs.

Blind damage is caught by the blob's CRC (every flip and truncation tested here). Crafted blobs
(bytes changed, CRC recomputed) reach the parser: they must give a documented error, with sizes
checked before allocating. The long crafted run is `python -m fuzz.tensorcodec_fuzz` (worker
processes: a crash in the compiled loops is counted, not fatal).
"""
from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest

import passes
from passes import CorruptFileError, SurgeonError

pytest.importorskip("numba")


@pytest.fixture(scope="module")
def blob():
    w = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    return bytes(passes.encode_array(w, bits=6)), w.shape


def _fields(b: bytes):
    """Offsets of the variable fields of a version-1 blob (layout in passes/tensorcodec.py)."""
    from passes.tensorcodec import _HEAD

    ndim = b[6]
    pos = 8 + 8 * ndim
    head_at = pos
    vals = _HEAD.unpack_from(b, pos)
    pos += _HEAD.size
    side_len = vals[41]
    pos += side_len
    n_words_at = pos
    return {"shape_at": 8, "ndim": ndim, "head_at": head_at, "n_words_at": n_words_at}


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_every_flip_and_truncation_refused(blob):
    data, shape = blob
    assert passes.decode_array(data).shape == shape
    for i in range(len(data)):
        d = bytearray(data)
        d[i] ^= 0xFF
        with pytest.raises(CorruptFileError):
            passes.decode_array(bytes(d))
    for n in range(len(data)):
        with pytest.raises(CorruptFileError):
            passes.decode_array(data[:n])


def test_newer_blob_version(blob):
    data, _ = blob
    body = bytearray(data[:-4])
    body[4] = 9
    with pytest.raises(passes.NewerFormatError, match="newer"):
        passes.decode_array(_reseal(bytes(body)))


def test_huge_word_count_is_a_documented_error(blob):
    data, _ = blob
    f = _fields(data)
    body = bytearray(data[:-4])
    struct.pack_into("<Q", body, f["n_words_at"], (1 << 64) - 1)
    with pytest.raises(SurgeonError):
        passes.decode_array(_reseal(bytes(body)))


def test_declared_size_checked_before_allocating(blob):
    data, _ = blob
    f = _fields(data)
    body = bytearray(data[:-4])
    # shape (2**33 / 24, 24): same unit layout, ~2**33 elements
    struct.pack_into("<Q", body, f["shape_at"], (1 << 33) // 24)
    tracemalloc.start()
    try:
        with pytest.raises(SurgeonError):
            passes.decode_array(_reseal(bytes(body)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**30:.1f} GiB allocated before refusing"
