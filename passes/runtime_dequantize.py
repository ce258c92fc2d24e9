"""DequantizeLinear of constant 8-bit levels at load, in one pass (the C kernel of passes/_fold.c).

`dequantize(q, scale, zero_point, axis, block_size, out_dtype)` gives the bits of
`passes.forms.dequantize_linear(q, scale, zero_point, axis, block_size)` cast to `out_dtype`
(float32 product of the level difference and the scale, rounded once to nearest even), i.e.
what onnxruntime's DequantizeLinear computes. Why a kernel: numpy makes ~4 passes over float32
temporaries and its float32 -> float16 cast runs at ~0.2 GB/s; a float16 model's MiniLM weights
(22 M values) took ~47 ms that way, onnxruntime's constant folding of the same nodes ~60 ms of
CPU per load. Where the extension is absent, or for forms it does not take (16/32-bit or 4-bit
levels, bfloat16 scales, a float32 result of float16 scales), numpy computes the same bits.
"""
from __future__ import annotations

import numpy as np

from .forms import dequantize_linear

try:  # optional: built from passes/_fold.c where a compiler was found at install
    from . import _fold
except ImportError:  # pragma: no cover - depends on the build
    _fold = None

LEVEL_TYPES = (np.dtype(np.int8), np.dtype(np.uint8))
FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


def kernel_name() -> str | None:
    """"avx512", "avx2" or "scalar" (the loop the C kernel runs on this CPU), None without the extension."""
    return None if _fold is None else _fold.KERNEL


def kernel_loops() -> tuple:
    """The C kernel's loops this CPU runs ("scalar", "avx2", "avx512"; empty without the extension)."""
    return () if _fold is None else tuple(_fold.LOOPS)


def layout(q: np.ndarray, scale: np.ndarray, zero_point, axis: int, block_size: int):
    """(pre, d, post, block) of the kernel's flattened layout, or None where the inputs are not a
    DequantizeLinear form it takes (the numpy path then decides, or refuses)."""
    if q.dtype not in LEVEL_TYPES or scale.dtype not in FLOAT_TYPES:
        return None
    if zero_point is not None and (zero_point.dtype != q.dtype or not (
            zero_point.shape == scale.shape or zero_point.size == scale.size == 1)):
        return None
    if block_size < 0:
        return None
    if block_size == 0 and scale.size == 1 and scale.ndim <= 1:  # per tensor
        return 1, 1, q.size, 0
    if q.ndim == 0 or not -q.ndim <= axis < q.ndim:
        return None
    axis %= q.ndim
    d = q.shape[axis]
    pre = int(np.prod(q.shape[:axis], dtype=np.int64))
    post = int(np.prod(q.shape[axis + 1:], dtype=np.int64))
    if block_size == 0:
        if scale.ndim != 1 or scale.shape[0] != d:
            return None
        return pre, d, post, 0
    want = list(q.shape)
    want[axis] = -(-d // block_size)
    if list(scale.shape) != want:
        return None
    return pre, d, post, block_size


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None, axis: int = 1,
               block_size: int = 0, out_dtype=None, *, loop: str | None = None, out: np.ndarray | None = None
               ) -> np.ndarray:
    """forms.dequantize_linear(q, scale, zero_point, axis, block_size).astype(out_dtype) (default:
    the scale's type), in one pass where the C kernel takes the form. `loop`: one of
    kernel_loops() instead of the fastest (tests). `out`: a C-contiguous array of q's shape and
    out_dtype to write into (returned)."""
    q, scale = np.asarray(q), np.asarray(scale)
    out_dtype = np.dtype(out_dtype or (out.dtype if out is not None else scale.dtype))
    form = layout(q, scale, zero_point, axis, block_size) if _fold is not None else None
    # float16 scales with a float32 result: numpy rounds to float16 first (the node's own output)
    if form is None or out_dtype not in FLOAT_TYPES or (scale.dtype == np.float16 and out_dtype == np.float32):
        result = dequantize_linear(q, scale, zero_point, axis, block_size).astype(out_dtype, copy=False)
        if out is None:
            return result
        out[...] = result
        return out
    pre, d, post, block = form
    # aligned too: a scale viewed in place in a model's raw bytes may sit at any address, and its
    # buffer then reads as standard-size '=f', which the kernel refuses (scales are small: a copy)
    s32 = np.require(scale, np.float32, ["C", "A"]).reshape(-1)
    z32 = None
    if zero_point is not None and np.any(zero_point):
        z32 = np.require(zero_point, np.float32, ["C", "A"]).reshape(-1)
    if out is None:
        out = np.empty(q.shape, out_dtype)
    elif out.shape != q.shape or out.dtype != out_dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {out_dtype} array of shape {q.shape}")
    _fold.dequantize(np.ascontiguousarray(q).reshape(-1), s32, z32, out.reshape(-1), pre, d, post, block,
                     _fold.LOOPS[loop] if loop else 0)
    return out
