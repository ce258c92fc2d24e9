"""The C decoder's AVX2 lanes (passes/_tcodec.c, two vectors of 8 chunks per thread): bit for bit
the scalar lanes' output and refusals, on blobs of every rate and form, odd sizes and tails, long
units, magnitudes >= 256 (computed values) and the 8-byte raw reads (> 25 raw bits). The knob
simd + 32 forces them also where the CPU has AVX-512; where the CPU has no AVX2 these tests compare
the scalar lanes with themselves (and say so by skipping the lane check)."""
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("numba")

from passes import CorruptFileError, decode_array, encode_array  # noqa: E402

AVX2 = 32   # simd + 32: the AVX2 lanes even where AVX-512 is there
WIDE = 16   # simd + 16: every token's raw bits read the way the rare > 25-bit ones are


def _tc():
    import passes.tensorcodec as tc

    if tc._FAST is None:
        pytest.skip("the C decoder passes._tcodec was not built")
    return tc


def _weights(shape, seed):
    rng = np.random.default_rng(seed)
    w = rng.laplace(size=shape) * rng.uniform(0.2, 2.0, size=(shape[0],) + (1,) * (len(shape) - 1))
    return (0.05 * w).astype(np.float32)


def _decode(tc, blob, simd, threads):
    saved = tc.SIMD
    tc.SIMD = simd
    try:
        return decode_array(blob, threads=threads)
    finally:
        tc.SIMD = saved


def _same_as_scalar(tc, blob):
    ref = _decode(tc, blob, 0, 1).view(np.uint32)
    for threads in (1, 2, 3):
        for simd in (AVX2 + 1, AVX2 + 5, AVX2 + 1 + WIDE, 1):
            got = _decode(tc, blob, simd, threads).view(np.uint32)
            assert np.array_equal(got, ref), (threads, simd)


def test_the_knob_selects_the_avx2_lanes():
    tc = _tc()
    assert tc._FAST.vector_lanes(0) == "scalar"
    kind = tc._FAST.vector_lanes(AVX2 + 1)
    assert kind in ("avx2", "scalar")
    if kind == "scalar":
        pytest.skip("this CPU has no AVX2: the other tests compare the scalar lanes with themselves")
    assert tc._FAST.vector_lanes(1) in ("avx512", "avx2")


@pytest.mark.parametrize("snr", [3.0, 12.0, 23.0, 35.0, 47.0, 70.0])
@pytest.mark.parametrize("form", ["tcq", "rdo", "nearest"])
def test_avx2_lanes_equal_scalar_lanes_at_every_rate(snr, form):
    tc = _tc()
    w = _weights((40, 24, 3, 3), seed=int(snr))  # conv kernels: units of 9, position classes
    _same_as_scalar(tc, encode_array(w, snr_db=snr, form=form))


@pytest.mark.parametrize("bits", [2, 3, 5, 8, 12, 16])
def test_avx2_lanes_equal_scalar_lanes_at_every_bit_width(bits):
    tc = _tc()
    w = _weights((70, 130), seed=bits)
    for form in ("tcq", "nearest"):
        _same_as_scalar(tc, encode_array(w, bits=bits, form=form))


@pytest.mark.parametrize("shape", [(1,), (7,), (5, 1), (3, 5, 3, 3), (17, 33), (300, 257), (105, 700),
                                   (2, 3000), (4, 70001), (1, 3, 5, 5)])
def test_avx2_lanes_equal_scalar_lanes_on_odd_sizes(shape):
    """Tails of fewer than 8 steps in the output buffer, chunks of unequal length (the scalar lanes
    finish them), units longer than a bounds-check block, one-element units, rows of one unit."""
    tc = _tc()
    w = _weights(shape, seed=sum(shape))
    for kwargs in (dict(snr_db=25), dict(bits=10, form="rdo")):
        _same_as_scalar(tc, encode_array(w, **kwargs))


def test_avx2_lanes_equal_scalar_lanes_on_huge_magnitudes():
    """Heavy tails at 110 and 125 dB: magnitudes up to ~2**25.6 (tokens of up to 24 raw bits), many
    >= 256 (values computed one by one). (Tokens of > 25 raw bits need magnitudes >= 2**28, which
    float32 weights do not reach: the simd + 16 hook reads every token the way they are read.)"""
    tc = _tc()
    rng = np.random.default_rng(3)
    w = (rng.standard_cauchy((64, 200)) * 0.01).astype(np.float32)
    for snr in (110.0, 125.0):
        blob = encode_array(w, snr_db=snr, form="nearest")
        _same_as_scalar(tc, blob)
        out = _decode(tc, blob, AVX2 + 1, 2)
        assert 10 * np.log10((w.astype(np.float64) ** 2).sum() / ((out - w).astype(np.float64) ** 2).sum()) >= snr


def test_avx2_lanes_refuse_what_the_scalar_lanes_refuse():
    """Damaged entropy-coded data under a valid CRC: the same refusals, else the same values."""
    tc = _tc()
    blob = encode_array(_weights((160, 300), seed=11), snr_db=30)
    rng = np.random.default_rng(4)
    refused = 0
    for i in range(120):
        body = bytearray(blob[:-4])
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(len(body) // 3, len(body)))
            body[pos] ^= 1 << int(rng.integers(0, 8))
        bad = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
        outcomes = []
        for simd, threads in ((0, 1), (AVX2 + 1, 1), (AVX2 + 1, 2), (AVX2 + 5, 3)):
            try:
                outcomes.append(_decode(tc, bad, simd, threads).view(np.uint32))
            except CorruptFileError:
                outcomes.append(None)
        if outcomes[0] is None:
            assert all(o is None for o in outcomes), i
            refused += 1
        else:
            assert all(o is not None and np.array_equal(o, outcomes[0]) for o in outcomes), i
    assert refused > 80
