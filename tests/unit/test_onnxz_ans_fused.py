"""Float `ans` chunks whose plane 0 alone is coded (nearly all float weights) are decoded and merged
in one pass by the AVX2 or AVX-512 decoder (_ans.c dec_merge_run), the block's remainder the usual
way: the bytes match the scalar decoder and the original, for float16 and float32, every SIMD lane
count, both AVX2 table lookups, the AVX-512 decoder where the CPU has it, sizes with tails, outputs large enough for non-temporal stores (aligned or
not), and damaged blobs get the same verdict."""
from __future__ import annotations

import numpy as np
import pytest

from onnxz_helpers import ans_decoder as decoder
from passes.onnxz import ans, codecs

C = codecs._fast
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "ans_avx2_loads"), reason="needs the C extension")
RNG = np.random.default_rng(31)




def _decoders():
    got = [(0, 0)]
    if C is not None and C.ans_simd() >= 1:
        got += [(1, 0), (1, 1)]
    if C is not None and C.ans_simd() >= 2:
        got += [(2, 0)]
    return got


def _weights(dtype, n: int) -> np.ndarray:
    return (RNG.standard_normal(n) * 0.02).astype(dtype).view(np.uint8)


def _chunk(data: np.ndarray, width: int, lanes_log2: int) -> list:
    planes = codecs.split_planes(data, width, True)
    blob = ans.encode(planes[0], lanes_log2)
    assert len(blob) < planes.shape[1]
    return [blob] + [p.tobytes() for p in planes[1:]]


def _decode_all(planes: list, size: int, offset: int = 0) -> list:
    got = []
    for level, loads in _decoders():
        buf = np.zeros(size + offset, np.uint8)
        out = buf[offset:]
        with decoder(level, loads):
            verdict = C.ans_decode(planes, True, False, out)
        got.append((verdict, out.tobytes() if verdict is None else None))
    return got


@pytest.mark.parametrize("dtype,width", [(np.float16, 2), (np.float32, 4)])
@pytest.mark.parametrize("lanes_log2", [5, 6, 7])
@pytest.mark.parametrize("n", [4096, 4096 * 3 + 200, 70001])
def test_fused_decode_restores_float_chunks(dtype, width, lanes_log2, n):
    data = _weights(dtype, n)
    got = _decode_all(_chunk(data, width, lanes_log2), data.size)
    assert all(g == (None, data.tobytes()) for g in got)


@pytest.mark.parametrize("offset", [0, 1])
def test_fused_decode_with_non_temporal_stores(offset):
    """1 MiB of float32 (the non-temporal store size), into aligned and unaligned outputs."""
    data = _weights(np.float32, 1 << 18)
    got = _decode_all(_chunk(data, 4, 7), data.size, offset)
    assert all(g == (None, data.tobytes()) for g in got)


@pytest.mark.parametrize("width,lanes_log2", [(2, 7), (4, 5)])
def test_fused_decode_agrees_on_damaged_chunks(width, lanes_log2):
    data = _weights(np.float16 if width == 2 else np.float32, 20001)
    planes = _chunk(data, width, lanes_log2)
    for trial in range(30):
        blob = bytearray(planes[0])
        at = int(RNG.integers(1, len(blob)))
        blob[at] ^= 1 << int(RNG.integers(0, 8))
        if trial % 3 == 0:
            blob = blob[:len(blob) - 2 * int(RNG.integers(1, 40))]
        got = _decode_all([bytes(blob)] + planes[1:], data.size)
        assert all(g == got[0] for g in got), (trial, at)
