"""The AVX2 `ans` decoder looks its frequency table up two ways (_ans.c: the gather instruction, or
scalar loads, chosen by CPU vendor): both, and the scalar decoder, give the same plane from the
same blob, and the same verdict on a damaged one, at every lane count with a SIMD path."""
from __future__ import annotations

import numpy as np
import pytest

from onnxz_helpers import ans_decoder as decoder
from passes.onnxz import ans, codecs

C = codecs._fast
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "ans_avx2_loads") or C.ans_simd() < 1,
                                reason="needs the C extension on a CPU with AVX2")
RNG = np.random.default_rng(5)




DECODERS = [(0, 0), (1, 0), (1, 1)]  # scalar; AVX2 with the gather instruction; AVX2 with scalar loads


def _decode_all(blob: bytes, n: int) -> list:
    """(verdict, bytes) of every decoder; verdict None or the damage message."""
    got = []
    for level, loads in DECODERS:
        out = np.zeros(n, np.uint8)
        with decoder(level, loads):
            verdict = C.ans_decode([blob], False, False, out)
        got.append((verdict, out.tobytes() if verdict is None else None))
    return got


def _plane(kind: str, n: int) -> np.ndarray:
    if kind == "exponents":  # a float32 weight's sign-moved top byte: a few dozen symbols
        w = (RNG.standard_normal(n) * 0.05).astype(np.float32).view(np.uint32)
        return ((w >> 23) & 0xFF).astype(np.uint8)
    if kind == "skewed":  # one symbol at the 4095 edge, refills rare
        out = np.zeros(n, np.uint8)
        out[RNG.integers(0, n, max(1, n // 3000))] = 200
        return out
    return np.clip(np.round(RNG.laplace(128, 12, n)), 0, 255).astype(np.uint8)  # wide: refills often


@pytest.mark.parametrize("lanes_log2", [5, 6, 7])
@pytest.mark.parametrize("kind", ["exponents", "skewed", "wide"])
@pytest.mark.parametrize("n", [8192, 70001])
def test_lookup_kinds_decode_the_same_plane(lanes_log2, kind, n):
    sym = _plane(kind, n)
    blob = ans.encode(sym, lanes_log2)
    assert len(blob) < n  # a coded plane (the writer stores larger ones raw)
    got = _decode_all(blob, n)
    assert got[0] == (None, sym.tobytes())
    assert got[1] == got[0] and got[2] == got[0]


@pytest.mark.parametrize("lanes_log2", [5, 7])
def test_lookup_kinds_agree_on_damaged_blobs(lanes_log2):
    n = 50001
    blob = bytearray(ans.encode(_plane("wide", n), lanes_log2))
    for trial in range(40):
        bad = bytearray(blob)
        at = int(RNG.integers(1, len(bad)))
        bad[at] ^= 1 << int(RNG.integers(0, 8))
        if trial % 4 == 0:
            bad = bad[:len(bad) - 2 * int(RNG.integers(1, 50))]  # words cut short
        got = _decode_all(bytes(bad), n)
        assert got[1] == got[0] and got[2] == got[0], (trial, at)
