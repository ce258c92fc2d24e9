"""`fpairs` chunks (_planes.pairs_merge): the top byte of each element from its 4-bit rank (table,
or the next escape for rank 15). The AVX2 expansion (64 elements per step, escapes left to the
scalar loop) gives the same bytes and the same verdict as the scalar loop and a numpy reference,
with escapes anywhere: at step edges, in runs, in an odd tail, too few or too many."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from passes.onnxz import codecs

C = codecs._fast
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "pairs_merge"), reason="needs the C extension")
RNG = np.random.default_rng(23)


@contextlib.contextmanager
def simd(level: int):
    before = C.ans_simd()
    C.ans_simd(level)
    try:
        yield
    finally:
        C.ans_simd(before)


def _reference(table: bytes, ranks: np.ndarray, escapes: bytes, rest: list, n: int):
    """numpy: the restored float32 bytes, or None when the escapes do not match the ranks."""
    r = np.empty(2 * ranks.size, np.uint8)
    r[0::2], r[1::2] = ranks >> 4, ranks & 15
    r = r[:n]
    esc = r == 15
    if int(esc.sum()) != len(escapes):
        return None
    t = np.frombuffer(table + b"\0", np.uint8)[np.minimum(r, 15)].copy()
    t[esc] = np.frombuffer(escapes, np.uint8)
    m = rest[0]
    hi = (m & 0x80) | (t >> 1)
    nx = ((t & 1) << 7) | (m & 0x7F)
    return np.stack([rest[2], rest[1], nx, hi], axis=1).reshape(-1).tobytes()


def _case(n: int, escape_at):
    table = bytes(RNG.integers(0, 256, 15, dtype=np.uint8))
    r = RNG.integers(0, 15, n, dtype=np.uint8)
    r[list(escape_at)] = 15
    padded = np.concatenate([r, np.zeros(n % 2, np.uint8)])
    ranks = (padded[0::2] << 4 | padded[1::2]).astype(np.uint8)
    escapes = bytes(RNG.integers(0, 256, len(set(escape_at)), dtype=np.uint8))
    rest = [RNG.integers(0, 256, n, dtype=np.uint8) for _ in range(3)]
    return table, ranks, escapes, rest


def _run(table, ranks, escapes, rest, n):
    got = []
    for level in (0, 1):
        out = np.zeros(4 * n, np.uint8)
        with simd(level):
            ok = C.pairs_merge(table, ranks.tobytes(), escapes, rest, out)
        got.append(out.tobytes() if ok else None)
    return got


CASES = {
    "no escapes": (4096, []),
    "first and last of a step": (4096, [0, 63, 64, 127]),
    "a run of escapes": (5000, list(range(1000, 1100))),
    "odd n, escape in the tail": (4099, [4098, 4097]),
    "shorter than a step": (63, [5, 62]),
    "one step and a half": (97, [96]),
    "spread": (70001, sorted(set(RNG.integers(0, 70001, 300).tolist()))),
}


@pytest.mark.skipif(C is None or C.ans_simd() < 1, reason="needs AVX2")
@pytest.mark.parametrize("name", list(CASES))
def test_vector_expansion_gives_the_scalar_bytes(name):
    n, at = CASES[name]
    table, ranks, escapes, rest = _case(n, at)
    want = _reference(table, ranks, escapes, rest, n)
    assert want is not None
    assert _run(table, ranks, escapes, rest, n) == [want, want]


@pytest.mark.parametrize("delta", [-1, +1])
def test_escapes_that_do_not_match_the_ranks_are_refused_by_both(delta):
    n, at = 9000, [10, 64, 4000, 8999]
    table, ranks, escapes, rest = _case(n, at)
    escapes = escapes[:-1] if delta < 0 else escapes + b"\x07"
    levels = (0, 1) if C.ans_simd() >= 1 else (0,)
    for level in levels:
        out = np.zeros(4 * n, np.uint8)
        with simd(level):
            assert C.pairs_merge(table, ranks.tobytes(), escapes, rest, out) is False
