"""codecs._narrowed checks and converts a payload block by block (NARROW_BLOCK values at a time):
the same answer and the same narrow bytes as the whole-array round trip, whatever the block, and
no whole-payload temporaries beside the narrow copy."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from passes.onnxz import codecs


def _reference(data: np.ndarray, dtype: int):
    """The whole-array round trips: (to-type, narrow bytes) or None."""
    if dtype == codecs.FLOAT:
        u = data.view(np.uint32)
        if not np.any(u & 0xFFFF):
            return codecs.BFLOAT16, (u >> 16).astype(np.uint16).tobytes()
        with np.errstate(over="ignore"):
            h = u.view(np.float32).astype(np.float16)
        return (codecs.FLOAT16, h.tobytes()) if np.array_equal(h.astype(np.float32).view(np.uint32), u) else None
    u = data.view(np.uint64)
    f = u.view(np.float64).astype(np.float32)
    return (codecs.FLOAT, f.tobytes()) if np.array_equal(f.astype(np.float64).view(np.uint64), u) else None


def _cases():
    rng = np.random.default_rng(3)
    n = 5000
    halves = rng.standard_normal(n).astype(np.float16).astype(np.float32)
    late = halves.copy()
    late[-3] = np.float32(0.1)  # fails only in the last block
    bf = (rng.standard_normal(n).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    bf_late = bf.copy()
    bf_late[-1] = np.float32(0.1)  # not bfloat16 at the end; not float16 either
    big = halves.copy()
    big[-2] = np.float32(70000.0)  # beyond float16: the round trip fails
    doubles = rng.standard_normal(n).astype(np.float32).astype(np.float64)
    doubles_late = doubles.copy()
    doubles_late[-1] = 0.1
    return [("halves", halves, codecs.FLOAT), ("late", late, codecs.FLOAT), ("bf", bf, codecs.FLOAT),
            ("bf_late", bf_late, codecs.FLOAT), ("big", big, codecs.FLOAT),
            ("doubles", doubles, codecs.DOUBLE), ("doubles_late", doubles_late, codecs.DOUBLE)]


@pytest.mark.parametrize("block", [7, 1000, 4999, 5000, 1 << 20])
def test_blocks_give_the_whole_arrays_answer(monkeypatch, block):
    monkeypatch.setattr(codecs, "NARROW_BLOCK", block)
    for name, values, dtype in _cases():
        got = codecs._narrowed(values.view(np.uint8), dtype)
        want = _reference(values.view(np.uint8), dtype)
        assert (got is None) == (want is None), name
        if got is not None:
            assert got[0] == want[0] and got[1].tobytes() == want[1], name


def test_no_whole_payload_temporaries_beside_the_narrow_copy():
    values = np.random.default_rng(4).standard_normal(4 << 20).astype(np.float16).astype(np.float32)  # 16 MB
    data = values.view(np.uint8)
    tracemalloc.start()
    try:
        to, narrow = codecs._narrowed(data, codecs.FLOAT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert to == codecs.FLOAT16 and narrow.nbytes == data.nbytes // 2
    # the float16 copy (0.5x) and one block's temporaries; the whole-array checks took ~2x
    assert peak < data.nbytes // 2 + 12 * codecs.NARROW_BLOCK
