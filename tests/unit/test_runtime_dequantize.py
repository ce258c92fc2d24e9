"""passes.runtime_dequantize: the one-pass C DequantizeLinear kernel (passes/_fold.c) gives the bits
of passes.forms.dequantize_linear followed by the cast to the output type, on every layout it
takes, with each of its loops this CPU runs (scalar, AVX2, AVX-512); the numpy path (no
extension) gives the same."""
from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

from passes import runtime_dequantize as rd
from passes.forms import dequantize_linear

needs_kernel = pytest.mark.skipif(rd._fold is None, reason="passes._fold not built")
LOOPS = list(rd.kernel_loops()) or ["scalar"]  # (without the extension: the tests skip)


def reference(q, scale, zp, axis, block, out_dtype):
    with np.errstate(over="ignore"):  # (infinities are part of what is compared)
        return dequantize_linear(q, scale, zp, axis, block).astype(out_dtype)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def scales_for(rng, shape, dtype, spread):
    """Scales over `spread` (decades of 2): from float16 subnormal products to overflowing ones."""
    exponents = rng.uniform(-spread, spread, size=shape)
    signs = np.where(rng.random(shape) < 0.1, -1.0, 1.0)
    with np.errstate(over="ignore"):
        return (signs * np.exp2(exponents)).astype(dtype)


LAYOUTS = [  # (q shape, axis, block): per tensor (block 0, scale of one value) is added below
    ((7, 33), 1, 0), ((7, 33), 0, 0), ((5, 4, 3, 3), 0, 0), ((5, 4, 3, 3), 1, 0), ((5, 4, 3, 3), -1, 0),
    ((6, 40), 1, 16), ((40, 6), 0, 16), ((3, 37, 5), 1, 8), ((2, 3, 70), -1, 32), ((4, 50), 1, 64),
]


def cases():
    for (shape, axis, block), level, sdtype, odtype, zp in itertools.product(
            LAYOUTS + [((9, 17), 1, None)], (np.int8, np.uint8), (np.float32, np.float16), (np.float32, np.float16),
            ("none", "zeros", "random")):
        if sdtype == np.float16 and odtype == np.float32:
            continue  # (numpy's own path: the node's float16 output, then widened; tested apart)
        yield shape, axis, block, level, sdtype, odtype, zp


def inputs(rng, shape, axis, block, level, sdtype, zp_kind, spread=20):
    info = np.iinfo(level)
    q = rng.integers(info.min, info.max + 1, size=shape, dtype=level)
    if block is None:  # per tensor
        s_shape, axis, block = (), 1, 0
    else:
        a = axis % len(shape)
        s_shape = list(shape)
        s_shape[a] = -(-shape[a] // block) if block else shape[a]
        s_shape = tuple(s_shape) if block else (shape[a],)
    scale = scales_for(rng, s_shape, sdtype, spread)
    zp = None
    if zp_kind == "zeros":
        zp = np.zeros(s_shape, level)
    elif zp_kind == "random":
        zp = rng.integers(info.min, info.max + 1, size=s_shape, dtype=level)
    return q, scale, zp, axis, block


@needs_kernel
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("shape,axis,block,level,sdtype,odtype,zp", list(cases()))
def test_kernel_bits_equal_forms(shape, axis, block, level, sdtype, odtype, zp, loop):
    rng = np.random.default_rng(zlib.crc32(repr((shape, axis, block, zp, np.dtype(level).name)).encode()))
    q, scale, z, axis, block = inputs(rng, shape, axis, block, level, sdtype, zp)
    want = reference(q, scale, z, axis, block, odtype)
    got = rd.dequantize(q, scale, z, axis, block, odtype, loop=loop)
    assert same_bits(got, want)


@needs_kernel
@pytest.mark.parametrize("loop", LOOPS)
def test_float16_edges_subnormal_overflow_and_ties(loop):
    """Products in every float16 range: subnormal, the smallest normal, ties at each rounding
    boundary, 65504 and just past it (infinity), negative zero."""
    levels = np.arange(-128, 128, dtype=np.int8)
    tiny = [2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-14 * (1 - 2.0**-11), 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
            65504.0 / 127, 65520.0 / 127, 65536.0 / 127, 65504.0 / 128, -2.0**-20, 0.0, -0.0, 1e-30, 1e30]
    scale = np.array(tiny * 3, np.float32)
    q = np.tile(levels, (scale.size, 1))
    for zp in (None, np.full(scale.shape, 3, np.int8)):
        want = reference(q, scale, zp, 0, 0, np.float16)
        got = rd.dequantize(q, scale, zp, 0, 0, np.float16, loop=loop)
        assert same_bits(got, want)
        assert np.isinf(want.astype(np.float32)).any() and (want.view(np.uint16) == 0x8000).any()
        assert ((want.view(np.uint16) & 0x7C00) == 0).any()  # subnormal halves present


@needs_kernel
def test_random_bits_many_sizes_both_loops_agree():
    """Lengths around the vector widths (tails), scales of random bits (no NaN): every loop == numpy."""
    rng = np.random.default_rng(7)
    for n in (1, 15, 16, 17, 31, 32, 33, 63, 100, 1000, 4099):
        q = rng.integers(-128, 128, n, dtype=np.int8)
        bits = rng.integers(0, 2**32, 1, dtype=np.uint64).astype(np.uint32)
        bits &= ~np.uint32(0x40000000) if rng.random() < 0.5 else np.uint32(0xFFFFFFFF)
        scale = bits.view(np.float32)
        if not np.isfinite(scale).all():
            scale = np.array([1e-3], np.float32)
        for out in (np.float16, np.float32):
            want = reference(q, scale, None, 1, 0, out)
            assert same_bits(rd.dequantize(q, scale, None, 1, 0, out), want)
            for loop in LOOPS:
                assert same_bits(rd.dequantize(q, scale, None, 1, 0, out, loop=loop), want)


def test_numpy_path_when_the_extension_is_absent(monkeypatch):
    rng = np.random.default_rng(3)
    q, scale, zp, axis, block = inputs(rng, (6, 40), 1, 16, np.uint8, np.float16, "random")
    want = reference(q, scale, zp, axis, block, np.float16)
    monkeypatch.setattr(rd, "_fold", None)
    assert rd.kernel_name() is None
    assert same_bits(rd.dequantize(q, scale, zp, axis, block), want)


def test_forms_the_kernel_does_not_take_go_to_numpy():
    """int16 levels, float16 scales widened to float32, a mismatched layout: numpy's bits (and
    its own handling of what it is given)."""
    rng = np.random.default_rng(5)
    q16 = rng.integers(-3000, 3000, (4, 8), dtype=np.int16)
    s = np.full(8, 0.01, np.float32)
    assert same_bits(rd.dequantize(q16, s, None, 1, 0), reference(q16, s, None, 1, 0, np.float32))
    q = rng.integers(-128, 128, (4, 8), dtype=np.int8)
    s16 = np.full(8, 0.01, np.float16)
    assert same_bits(rd.dequantize(q, s16, None, 1, 0, np.float32), reference(q, s16, None, 1, 0, np.float32))
    assert rd.layout(q, np.ones(5, np.float32), None, 1, 0) is None  # 5 scales for an axis of 8
    assert rd.layout(q, np.ones((4, 3), np.float32), None, 1, 3) == (4, 8, 1, 3)  # blocks of 3: 3 per row
    assert rd.layout(q, np.ones(8, np.float32), np.zeros(8, np.uint8), 1, 0) is None  # zero point of another type


def test_inputs_unchanged_and_non_contiguous_levels():
    rng = np.random.default_rng(11)
    base = rng.integers(-128, 128, (16, 40), dtype=np.int8)
    q = base[:, ::2]  # a strided view
    scale = scales_for(rng, (20,), np.float32, 8)
    before = (base.copy(), scale.copy())
    got = rd.dequantize(q, scale, None, 1, 0, np.float16)
    assert same_bits(got, reference(np.ascontiguousarray(q), scale, None, 1, 0, np.float16))
    assert np.array_equal(base, before[0]) and np.array_equal(scale, before[1])


@needs_kernel
def test_kernel_refuses_bad_buffers():
    q = np.zeros(8, np.int8)
    with pytest.raises(ValueError):
        rd._fold.dequantize(q, np.ones(3, np.float32), None, np.empty(8, np.float32), 1, 8, 1, 0)
    with pytest.raises(ValueError):
        rd._fold.dequantize(q, np.ones(1, np.float32), None, np.empty(7, np.float32), 1, 8, 1, 0)
    with pytest.raises(TypeError):
        rd._fold.dequantize(q.astype(np.int16), np.ones(1, np.float32), None, np.empty(8, np.float32), 1, 8, 1, 0)
    with pytest.raises(TypeError):
        rd._fold.dequantize(q, np.ones(1, np.float32), None, np.empty(8, np.float64), 1, 8, 1, 0)
    with pytest.raises(ValueError):
        rd._fold.dequantize(q, np.ones(1, np.float32), None, np.empty(8, np.float32), -1, 8, 1, 0)
    with pytest.raises(ValueError):  # (no such loop)
        rd._fold.dequantize(q, np.ones(1, np.float32), None, np.empty(8, np.float32), 1, 8, 1, 0, 9)


@needs_kernel
def test_loops_listed_and_the_default_the_fastest():
    loops = rd.kernel_loops()
    assert "scalar" in loops and rd.kernel_name() in loops
    order = ["scalar", "avx2", "avx512"]
    assert rd.kernel_name() == max(loops, key=order.index)


def _unaligned(a: np.ndarray) -> np.ndarray:
    """`a`'s values viewed at an odd address, as a scale read in place from a model's raw bytes."""
    raw = b"\0" + a.tobytes()
    view = np.frombuffer(raw, a.dtype, count=a.size, offset=1).reshape(a.shape)
    assert not view.flags.aligned
    return view


@pytest.mark.parametrize("odtype", [np.float32, np.float16])
def test_unaligned_scale_and_zero_point(odtype):
    # found by bench/load.py: a per-channel int8 MiniLM .onnx folded in mode="fold" raised TypeError
    # ('scale and zero point must be float32') because its scales were unaligned views
    rng = np.random.default_rng(11)
    q = rng.integers(-128, 128, size=(64, 48), dtype=np.int8)
    scale = (rng.random(64, dtype=np.float32) + 0.5) * 1e-2
    for zp in (None, rng.integers(-3, 4, size=64).astype(np.int8)):
        assert rd.layout(q, scale, zp, 0, 0) is not None  # the kernel's form, not numpy's
        want = dequantize_linear(q, scale, zp, 0, 0).astype(odtype)
        got = rd.dequantize(q, _unaligned(scale), zp, axis=0, out_dtype=odtype)
        assert got.dtype == odtype and got.tobytes() == want.tobytes()
