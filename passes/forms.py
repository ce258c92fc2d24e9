"""Weight forms: linear n-bit quantization per tensor, per channel and per block.

`quantize_linear` turns a float array into integer levels, scales and zero points;
`dequantize_linear` turns them back exactly the way onnxruntime's `DequantizeLinear` does
(`float32(int32(x) - int32(zero_point)) * float32(scale)`, rounded once to the output type), so
the fold pass and the SNR in the report see the values the model will compute.

Layouts follow `DequantizeLinear`: per tensor, scale is a scalar; per channel, scale is 1-D with
one entry per index of `axis`; per block, scale has the weight's shape with dimension `axis`
replaced by ceil(D / block_size).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import rounding as _rd
from .errors import InvalidArgumentError

# clip ratios tried per channel / block: 1.0 (max-abs) down to 0.5 of the range
_CLIP_GRID = np.linspace(1.0, 0.5, 26, dtype=np.float32)
# elements processed at once during the scale search: the chunk and its two scratch buffers stay
# in a core's L2 cache (4 MiB here) across all candidate evaluations
_SEARCH_CHUNK = 1 << 16


@dataclass(frozen=True)
class Levels:
    bits: int
    symmetric: bool

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1) - 1) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    @property
    def storage(self) -> str:
        """numpy-ish name of the container: int4/uint4 up to 4 bits, int8/uint8 above."""
        base = "int" if self.symmetric else "uint"
        return f"{base}4" if self.bits <= 4 else f"{base}8"

    @property
    def np_dtype(self):
        return np.int8 if self.symmetric else np.uint8


@dataclass
class Quantized:
    q: np.ndarray  # int8 / uint8 levels, weight shape
    scale: np.ndarray  # in the weight's float dtype, DequantizeLinear layout
    zero_point: np.ndarray | None  # same layout as scale, uint8 levels; None when symmetric
    axis: int | None  # None: per tensor
    block_size: int  # 0: not blocked
    noise: float | None = None  # sum of squared errors of the dequantized weights
    signal: float | None = None  # sum of squared weights
    bits_per_weight: float | None = None  # order-0 entropy of q: about what the pack spends per weight
    rounding: str = "nearest"  # "nearest", or "rdo" when rate-distortion rounding changed the levels
    rd_lambda: float | None = None  # rdo: lambda used (squared base steps per bit)
    step_scale: float | None = None  # rdo: median over rows of the factor applied to the error-minimising scales

    def snr_db(self) -> float | None:
        """Weight SNR in dB from the sums above (exact: 200, capped so that reports stay plain JSON)."""
        if self.noise is None:
            return None
        if self.noise == 0:
            return 200.0
        if self.signal == 0:
            return -200.0
        if not (np.isfinite(self.noise) and np.isfinite(self.signal)):
            return None
        return round(10 * float(np.log10(self.signal / self.noise)), 3)


def _channels_last(w: np.ndarray, axis: int | None, block_size: int) -> bool:
    return axis is not None and not block_size and w.ndim >= 2 and axis == w.ndim - 1


def _transpose2d(a: np.ndarray, dtype=None) -> np.ndarray:
    """a.T as a new C-contiguous array (cast to `dtype` on the way), copied in blocks of 64 rows:
    numpy's plain strided copy of a large transposed matrix misses the cache on every element
    (int8 4096 x 4096: 0.12 s plain, 0.025 s in blocks)."""
    rows, cols = a.shape
    out = np.empty((cols, rows), dtype=dtype or a.dtype)
    for i in range(0, rows, 64):
        out[:, i:i + 64] = a[i:i + 64].T
    return out


def _groups(w: np.ndarray, axis: int | None, block_size: int) -> tuple[np.ndarray, tuple, int]:
    """w as a 2-D (groups, members) array where each row shares one scale.

    Returns the 2-D array, the scale layout shape, and the padding added to the blocked axis.
    """
    if axis is None:
        return w.reshape(1, -1), (), 0
    if not block_size:
        moved = np.moveaxis(w, axis, 0)
        return moved.reshape(w.shape[axis], -1), (w.shape[axis],), 0
    d = w.shape[axis]
    nb = -(-d // block_size)
    pad = nb * block_size - d
    moved = np.moveaxis(w, axis, -1)  # (..., D)
    if pad:
        widths = [(0, 0)] * (moved.ndim - 1) + [(0, pad)]
        moved = np.pad(moved, widths)  # zeros are exact at every scale
    lead = moved.shape[:-1]
    layout = list(w.shape)
    layout[axis] = nb
    return np.ascontiguousarray(moved).reshape(-1, block_size), (lead, nb, tuple(layout)), pad


def _to_layout(per_group: np.ndarray, w_shape: tuple, axis: int | None, block_size: int, info) -> np.ndarray:
    if axis is None:
        return per_group.reshape(())
    if not block_size:
        return per_group.reshape(info)
    lead, nb, layout = info
    arr = per_group.reshape(*lead, nb)  # blocks last
    return np.moveaxis(arr, -1, axis).reshape(layout)


def _from_groups(q2: np.ndarray, w_shape: tuple, axis: int | None, block_size: int, pad: int) -> np.ndarray:
    if axis is None:
        return q2.reshape(w_shape)
    if not block_size:
        moved_shape = (w_shape[axis],) + tuple(np.delete(np.array(w_shape), axis))
        return np.moveaxis(q2.reshape(moved_shape), 0, axis)
    moved_shape = tuple(np.delete(np.array(w_shape), axis)) + (w_shape[axis] + pad,)
    moved = q2.reshape(moved_shape)
    if pad:
        moved = moved[..., : w_shape[axis]]
    return np.ascontiguousarray(np.moveaxis(moved, -1, axis))


_UINT_OF = {2: np.uint16, 4: np.uint32}


@functools.lru_cache(maxsize=None)
def _limits(dtype: np.dtype) -> tuple[np.ndarray, float]:
    """(smallest subnormal as a `dtype` scalar, largest finite value) of a float dtype."""
    info = ml_dtypes.finfo(dtype)
    return np.array(info.smallest_subnormal, dtype=dtype), float(info.max)


def _stored(scale: np.ndarray, dtype: np.dtype, top: int, mantissa_bits: int | None = None) -> np.ndarray:
    """Scale as the model will store it (weight dtype), back in float32.

    Never zero, and never so large that `top` (the largest level distance) times it overflows
    the dtype: rounding 65504/127 up to a float16 scale would make the top level dequantize to
    inf, so such scales step down by one unit in the last place. mantissa_bits (float32 weights
    only): the scale rounded to that many explicit mantissa bits first (round_scale_mantissa).
    """
    if mantissa_bits is not None and dtype == np.float32:
        scale = round_scale_mantissa(scale, mantissa_bits)
    s = scale.astype(dtype)
    tiny, largest = _limits(dtype)
    s = np.where(s > 0, s, tiny)
    over = s.astype(np.float64) * top > largest
    if over.any():
        bits = s.view(_UINT_OF[s.dtype.itemsize]).copy()
        bits[over] -= 1  # positive finite floats: the next smaller value
        s = bits.view(s.dtype)
    return s.astype(np.float32)


# Coarse-to-fine: every 5th ratio of the grid first, then the 2 neighbours on each side of the
# best coarse ratio (10 error evaluations instead of 26). The squared error is a smooth function of the ratio over a channel of hundreds of values, so
# the fine step lands on the grid's minimum in practice.
_COARSE = np.arange(0, len(_CLIP_GRID), 5)
_FINE = (-2, -1, 1, 2)


class _Rows:
    """One chunk of rows (in cache) with the scratch buffers the error evaluations share."""

    def __init__(self, rows: np.ndarray, levels: Levels, dtype: np.dtype, importance: np.ndarray | None = None,
                 mantissa_bits: int | None = None):
        self.rows, self.levels, self.dtype = rows, levels, dtype
        self.mantissa_bits = mantissa_bits  # scales rounded to this many mantissa bits (float32), or None
        self.importance = importance  # per element weight of the squared error (search only), or None
        self.y = np.empty_like(rows)  # rows / scale (+ zero point): the unrounded levels
        self.q = np.empty_like(rows)
        if levels.symmetric:
            self.span = np.max(np.abs(rows), axis=1)
            self.lo = None
            self.top = levels.qmax
        else:
            self.lo = np.minimum(rows.min(axis=1), 0)
            self.span = np.maximum(rows.max(axis=1), 0) - self.lo
            self.top = levels.qmax - levels.qmin

    def candidate(self, ratio):
        """Scale and zero point (float32 per row) for clip `ratio` (scalar or per row)."""
        lv = self.levels
        if lv.symmetric:
            return _stored(self.span * ratio / lv.qmax, self.dtype, lv.qmax, self.mantissa_bits), None
        # (q - z) * s must stay finite for every level: with a span near twice the dtype's
        # largest value (float16 weights at +-65504) the rounded zero point could put the far
        # end one step past it (-128 * 513.5 = -65728 -> -inf). Capping the step at
        # largest / ceil(top / 2) leaves a zero point range within reach of both ends.
        largest = _limits(self.dtype)[1]
        half = (self.top + 1) // 2
        s = _stored(np.minimum(self.span * ratio / self.top, np.float32(largest / half)), self.dtype, self.top,
                    self.mantissa_bits)
        z = np.clip(np.rint(-self.lo * ratio / s), lv.qmin, lv.qmax)
        reach = np.floor(largest / s.astype(np.float64))
        z = np.clip(z, lv.qmax - reach, lv.qmin + reach).astype(np.float32)
        return s, z

    def levels_of(self, s: np.ndarray, z, inverse: np.ndarray | None = None) -> np.ndarray:
        """Rounded, clipped levels (zero point included) in self.q; self.y keeps them unrounded.

        With `inverse` (1 / s) the division becomes a multiplication: several times faster, and
        the search only needs the error, not levels bit-identical to the final ones.
        """
        if inverse is None:
            np.divide(self.rows, s[:, None], out=self.y)
        else:
            np.multiply(self.rows, inverse[:, None], out=self.y)
        if z is not None:
            self.y += z[:, None]
        # clipping to whole-number bounds before rounding equals clipping after it; float32
        # bounds keep np.clip on its fast float32 loop (Python ints take a slow casting path)
        np.clip(self.y, np.float32(self.levels.qmin), np.float32(self.levels.qmax), out=self.q)
        np.rint(self.q, out=self.q)
        return self.q

    def error(self, s: np.ndarray, z) -> np.ndarray:
        """Per row: squared error of dequantized minus original, float64.

        (q - y) * s is (q - z) * s - w, so the error is summed in level units and scaled once.
        """
        with np.errstate(divide="ignore"):
            inverse = np.float32(1) / s  # inf for an all-zero row's tiny scale: its errors are nan and lose
        q = self.levels_of(s, z, inverse)
        q -= self.y
        if self.importance is None:
            e = np.einsum("ij,ij->i", q, q)
        else:
            e = np.einsum("ij,ij,ij->i", q, q, self.importance)
        s64 = s.astype(np.float64)
        return e.astype(np.float64) * (s64 * s64)


def _search(part: _Rows, search: bool):
    """Per row: the clip ratio minimising squared error; returns (scale f32, zero point f32|None)."""
    g = part.rows.shape[0]
    best_err = np.full(g, np.inf, dtype=np.float64)
    best_k = np.zeros(g, dtype=np.int64)

    def consider(ks: np.ndarray, first: bool, rows: _Rows) -> None:
        nonlocal best_err, best_k
        s, z = part.candidate(_CLIP_GRID[ks])
        err = rows.error(s, z)
        better = (err < best_err) | first  # the first candidate always counts (err may be inf)
        best_err = np.where(better, err, best_err)
        best_k = np.where(better, ks, best_k)
        return err

    if search:
        # (not on a subsample of each row: the clipping error comes from a few outliers that a
        # subsample misses; on minilm's embeddings that chose 0.74 where 1.0 is best)
        # The coarse sweep stops once every row's error has risen twice in a row (past its
        # minimum: int8 channels usually are after 1.0, 0.9, 0.8), saving up to half the work.
        rises = np.zeros(g, dtype=np.int64)
        last = None
        for i, k in enumerate(_COARSE):
            err = consider(np.full(g, k), i == 0, part)
            if last is not None:
                rises = np.where((err > last) | ~np.isfinite(err), rises + 1, 0)
            last = err
            if rises.min() >= 2:
                break
        coarse = best_k.copy()
        for d in _FINE:
            ks = coarse + d
            inside = (ks >= 0) & (ks < len(_CLIP_GRID))
            if inside.any():
                # rows whose neighbour is off the grid repeat their coarse best (never better)
                consider(np.where(inside, ks, coarse), False, part)
    return part.candidate(_CLIP_GRID[best_k])


# columns of each row looked at first by _exact_grid: a trained row fails on them, so the whole
# row is read only for the rows that may lie on a grid
_GRID_PROBE = 8


def _exact_grid(part: _Rows, s: np.ndarray, z):
    """The scale (and zero point) of each row whose values all lie exactly on a grid of equal
    steps that the levels reach: such a row is stored without error, where the clip search's
    max-abs scale would round it (integers in [-126, 126] at int8: step 126/127, ~49 dB). The
    steps tried: 1 (integer-valued rows: counts, indices, integer models stored as float) and the
    smallest non-zero magnitude among the row's first _GRID_PROBE values (a ternary or binary
    net's alpha). Only rows whose first values lie on the step are read whole, so a trained row
    costs a look at those few values. (A dequantized model's rows lie on a grid too, but finding
    its step takes a pass over every row: its levels come back where a row reaches the top
    level, through the search's max-abs candidate.)"""
    rows, lv = part.rows, part.levels
    if not rows.size or rows.shape[1] == 0:
        return s, z
    probe = rows[:, :_GRID_PROBE]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mag = np.abs(probe)
        probe_smallest = np.min(np.where(mag > 0, mag, np.inf), axis=1)
        ratio = probe / probe_smallest[:, None]
        if not (np.all(np.rint(ratio) == ratio, axis=1) | np.all(np.rint(probe) == probe, axis=1)).any():
            return s, z  # (every row of a trained weight leaves here)
        s, z = s.copy(), None if z is None else z.copy()
        for step in (probe_smallest, np.ones_like(probe_smallest)):
            # as the model stores the scale: a step its dtype (or scale mantissa) cannot hold
            # exactly is no grid of the stored scale
            # (an all-zero row keeps the search's tiniest scale: onnxruntime's MatMulNBits, which
            # quantizes the activations, leaves an error in proportion to the scale even of zero
            # levels: 1.2e-4 at scale 1 on values' zero weight, ~1e-34 at the tiniest)
            finite = np.isfinite(step) & np.isfinite(part.span) & (part.span > 0)
            safe = np.where(finite, step, 1)
            usable = finite & (_stored(safe, part.dtype, 1, part.mantissa_bits) == safe)
            usable &= np.all(np.rint(probe / safe[:, None]) * safe[:, None] == probe, axis=1)
            idx = np.flatnonzero(usable)
            if not idx.size:
                continue
            q = np.rint(rows[idx] / safe[idx, None])
            exact = np.all(q * safe[idx, None] == rows[idx], axis=1)
            qlo, qhi = np.min(q, axis=1), np.max(q, axis=1)
            if lv.symmetric:
                fits = exact & (np.maximum(-qlo, qhi) <= lv.qmax)
            else:
                zero = lv.qmin - np.minimum(qlo, 0)  # (0 stays a level, as the search's zero points keep it)
                fits = exact & (zero <= lv.qmax) & (qhi + zero <= lv.qmax)  # (the zero point is a level too)
                z[idx[fits]] = zero[fits]
            s[idx[fits]] = safe[idx[fits]]  # (a row on both grids takes step 1: as exact)
    return s, z


def quantize_linear(w: np.ndarray, levels: Levels, axis: int | None, block_size: int = 0,
                    search: bool = True, rounding: _rd.Rounding | None = None,
                    importance: np.ndarray | None = None, scale_mantissa_bits: int | None = None) -> Quantized:
    """Quantize float weights `w` (float32/float16/bfloat16) with scales in w's dtype.

    axis None: one scale; axis a without block_size: one scale per index of a; with block_size:
    blocks of `block_size` consecutive elements along a. With `search` the clip ratio of each
    scale is chosen from a grid to minimise the squared error (vectorised over all rows).
    rounding: None / Rounding("nearest") rounds to nearest; Rounding("rdo", ...) then trades
    rate for distortion (passes/rounding.py), which may also enlarge every scale by one factor.
    importance: non-negative weights broadcastable to w's shape (e.g. the mean squared input
    activation of each weight's input, gptq.input_importance): the clip search then minimises
    sum importance * error**2 per channel / block -- the output error of a layer whose inputs are
    uncorrelated -- instead of the plain weight error. Only the scales change.
    scale_mantissa_bits (float32 weights; None: full float32): every candidate scale is rounded to
    that many mantissa bits (round_scale_mantissa; 8: a bfloat16 value, which the pack stores in two
    bytes) before its levels are chosen and its error measured, so the search and the levels see
    the scale the model stores. Other weight dtypes ignore it (their scales are already narrow).
    """
    if scale_mantissa_bits is not None and not 1 <= int(scale_mantissa_bits) <= 24:
        raise InvalidArgumentError(f"scale_mantissa_bits must be 1..24, got {scale_mantissa_bits}")
    if w.ndim == 0 and axis is not None:
        raise InvalidArgumentError("a scalar can only be quantized per tensor")
    if axis is not None and not -w.ndim <= axis < w.ndim:
        raise InvalidArgumentError(f"axis {axis} out of range for shape {w.shape}")
    if axis is not None:
        axis %= w.ndim
    dtype = w.dtype
    if _channels_last(w, axis, block_size):  # MatMul weights: one row per column, cast on the way
        rows, info, pad = _transpose2d(w.reshape(-1, w.shape[-1]), np.float32), (w.shape[-1],), 0
    else:
        w32 = w.astype(np.float32, copy=False)  # only read: a float32 input is not copied
        rows, info, pad = _groups(w32, axis, block_size)
    imp_rows = None
    if importance is not None and search:
        imp = np.broadcast_to(np.asarray(importance, dtype=np.float32), w.shape)
        if _channels_last(w, axis, block_size):
            imp_rows = _transpose2d(imp.reshape(-1, w.shape[-1]), np.float32)
        else:
            imp_rows = _groups(np.ascontiguousarray(imp), axis, block_size)[0]
    scales = np.empty(rows.shape[0], dtype=np.float32)
    zps = None if levels.symmetric else np.empty(rows.shape[0], dtype=np.float32)
    q_rows = np.empty(rows.shape, dtype=levels.np_dtype)
    noise = signal = 0.0
    n_levels = levels.qmax - levels.qmin + 1
    counts = np.zeros(n_levels, dtype=np.int64)
    tally = _Tally(levels, info[1] if block_size and pad else 0, pad)
    step = max(1, _SEARCH_CHUNK // max(rows.shape[1], 1))
    for start in range(0, rows.shape[0], step):
        part = _Rows(rows[start:start + step], levels, dtype,
                     None if imp_rows is None else imp_rows[start:start + step], scale_mantissa_bits)
        with np.errstate(over="ignore", invalid="ignore"):  # extreme weights: inf errors just lose
            s, z = _search(part, search)
            s, z = _exact_grid(part, s, z)
            scales[start:start + step] = s
            if z is not None:
                zps[start:start + step] = z
            q = part.levels_of(s, z)
            q_rows[start:start + step] = q  # exact: whole numbers within the levels' range
            counts += tally(q, start)
            noise_rows, signal_rows = _dequantized_error(part, q, s, z, dtype)
        noise += float(np.sum(noise_rows))
        signal += float(np.sum(signal_rows))
    extra = {}
    if rounding is not None and rounding.rdo and rows.size:
        base_scales = scales
        found = _rate_distortion(rows, scales, zps, levels, dtype, rounding, noise, signal, step, tally,
                                 _rd.entropy_bits(counts), scale_mantissa_bits)
        if found is not None:
            q_rows, scales, zps, noise, signal, counts, choice = found
            m = scales.astype(np.float64) / np.maximum(base_scales.astype(np.float64), 1e-45)
            extra = dict(rounding="rdo", rd_lambda=choice.rd_lambda, step_scale=round(float(np.median(m)), 4))
    if _channels_last(w, axis, block_size):
        q = _transpose2d(q_rows).reshape(w.shape)
    else:
        q = _from_groups(q_rows, w.shape, axis, block_size, pad)
    scale = _to_layout(scales, w.shape, axis, block_size, info).astype(dtype)
    zp = None if zps is None else _to_layout(zps, w.shape, axis, block_size, info).astype(np.uint8)
    return Quantized(q, scale, zp, axis, block_size, noise, signal,
                     round(_rd.entropy_bits(counts), 4) if rows.size else None, **extra)


def _snr(noise: float, signal: float) -> float:
    if noise == 0:
        return 200.0
    if not (math.isfinite(noise) and math.isfinite(signal)) or signal <= 0:
        return -200.0
    return 10 * math.log10(signal / noise)


class _Tally:
    """Level counts of a chunk of rows, without the zeros padding the last block of each lane (a
    blocked axis not a multiple of the block size): the pack never sees them."""

    def __init__(self, levels: Levels, blocks_per_lane: int, pad: int):
        self.qmin, self.n_levels = levels.qmin, levels.qmax - levels.qmin + 1
        self.nb, self.pad = blocks_per_lane, pad

    def __call__(self, q: np.ndarray, start: int) -> np.ndarray:
        counts = _rd.counts_of(q, self.qmin, self.n_levels)
        if self.pad:
            first = (-(start + 1)) % self.nb  # first row in this chunk that ends a lane
            counts -= _rd.counts_of(q[first::self.nb, q.shape[1] - self.pad:], self.qmin, self.n_levels)
        return counts


def _rate_distortion(rows, scales, zps, levels: Levels, dtype, opts: "_rd.Rounding", noise: float,
                     signal: float, step: int, tally: _Tally, rate_nearest: float, mantissa_bits: int | None = None):
    """Rate-distortion rounding of the rows (passes/rounding.py), or None when plain nearest
    rounding is what it chooses. The step and lambda come from a sample; when the whole tensor
    then falls short of the SNR bound, the bound is tightened by the shortfall and the choice
    made again (twice at most; then nearest). Under an SNR bound (no fixed lambda), a result
    that would not pack smaller than nearest rounding is dropped too."""
    weights = _rd.row_weights(scales, opts.distortion)
    floor = opts.floor_db(_snr(noise, signal)) if opts.rd_lambda is None else -math.inf
    for _ in range(3):
        choice = _rd.choose(rows, scales, zps, levels.qmin, levels.qmax, opts, weights)
        if choice.is_nearest:
            return None
        found = _round_rd(rows, scales, zps, levels, dtype, choice, weights, step, tally, mantissa_bits)
        got = _snr(found[3], found[4])
        if got >= floor - 0.005:
            if opts.rd_lambda is None and _rd.entropy_bits(found[5]) >= rate_nearest:
                return None
            return found + (choice,)
        # the sample promised a margin the tensor does not have: tighten so that this choice
        # (and any with a margin as thin on the sample) no longer qualifies
        sample_margin = choice.snr_db - opts.floor_db(choice.snr_nearest_db)
        opts = opts.tightened(sample_margin + (floor - got) + 0.02)
    return None


def _round_rd(rows: np.ndarray, scales: np.ndarray, zps, levels: Levels, dtype, choice: "_rd.Choice",
              weights, step: int, tally: _Tally, mantissa_bits: int | None = None):
    """Rate-distortion quantization of all rows at the chosen lambda (passes/rounding.round_rows:
    a step factor per row, then the levels), with the code lengths of the sample's histogram.

    One pass over the tensor, in cache-sized chunks: a second pass with the histogram
    re-estimated on the whole tensor moved rates by under 0.2% either way on the corpus tensors
    and cost 40% more time. Stores the levels, scales and zero points, sums the errors of what
    DequantizeLinear gives back. Returns (levels as rows, scales, zero points, noise, signal,
    level counts).
    """
    top = levels.qmax if levels.symmetric else levels.qmax - levels.qmin
    counts = np.zeros(levels.qmax - levels.qmin + 1, dtype=np.int64)
    q_rows = np.empty(rows.shape, dtype=levels.np_dtype)
    new_scales = np.empty_like(scales)
    new_zps = None if zps is None else np.empty_like(zps)
    noise = signal = 0.0
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        s = scales[start:start + step]
        z = None if zps is None else zps[start:start + step]
        v = None if weights is None else weights[start:start + step]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            given = choice.row_steps is not None
            m, q, y = _rd.round_rows(part, s, z, v, levels.qmin, levels.qmax, choice.rd_lambda, choice.bits,
                                     choice.row_steps[start:start + step] if given else choice.steps,
                                     choice.level_rdo, row_steps=given)
        counts += tally(q, start)
        z_new = None if z is None else _rd.shifted_zero(z, m, levels.qmin, levels.qmax)
        s_new = s * m * (_unit_gain(part, q, z_new, s * m) if choice.level_rdo else 1)
        # a step enlarged near the dtype's limit: the top level must still dequantize finite
        s_new = _stored(np.minimum(s_new, np.float32(_limits(dtype)[1] / top)), dtype, top, mantissa_bits)
        new_scales[start:start + step] = s_new
        if z_new is not None:
            new_zps[start:start + step] = z_new
        q_rows[start:start + step] = q
        with np.errstate(over="ignore", invalid="ignore"):
            noise_rows, signal_rows = _dequantized_error(_ErrorScratch(part, y), q, s_new, z_new, dtype)
        noise += float(np.sum(noise_rows))
        signal += float(np.sum(signal_rows))
    return q_rows, new_scales, new_zps, noise, signal, counts


def _unit_gain(rows: np.ndarray, q: np.ndarray, z, scale: np.ndarray) -> np.ndarray:
    """Per row, the factor on the scale that makes the dequantized row's projection on the original
    exactly 1: <w, w> / <w, (q - z) * s>, with s the scale applied (returned relative to it).

    Rate-aware levels (rd_levels="rdo") lean towards zero and the frequent small levels, so each
    row comes back a little shrunk; one layer's shrink is tiny, but it is coherent and compounds
    through a deep network, where errors uncorrelated with the weights add in power only
    (open_nsfw int8, levels only: output SNR 28.7 -> 27.5 dB for 0.13 dB of weight SNR; this
    correction gets back about half of it).
    """
    d = q if z is None else q - z[:, None]
    ww = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
    wd = np.einsum("ij,ij->i", rows, d, dtype=np.float64) * scale
    ok = (ww > 0) & (wd > 0)
    f = np.where(ok, ww / np.where(ok, wd, 1.0), 1.0)
    return np.clip(f, 0.8, 1.25).astype(np.float32)


@dataclass
class _ErrorScratch:
    """What _dequantized_error reads from a chunk: its rows and a scratch buffer of their shape."""
    rows: np.ndarray
    y: np.ndarray


def _dequantized_error(part: _Rows, q: np.ndarray, s: np.ndarray, z, dtype):
    """Per row: squared error of what DequantizeLinear gives back ((q - z) * s in float32, rounded
    once to the weight dtype) and squared weights, float64; computed while the chunk is in cache."""
    d = part.y
    if z is not None:
        np.subtract(q, z[:, None], out=d)
        np.multiply(d, s[:, None], out=d)
    else:
        np.multiply(q, s[:, None], out=d)
    if dtype != np.float32:
        d[...] = d.astype(dtype)
    d -= part.rows
    noise = np.einsum("ij,ij->i", d, d)
    signal = np.einsum("ij,ij->i", part.rows, part.rows)
    if not (np.all(np.isfinite(noise)) and np.all(np.isfinite(signal))):  # squares past float32
        noise = np.einsum("ij,ij->i", d, d, dtype=np.float64)
        signal = np.einsum("ij,ij->i", part.rows, part.rows, dtype=np.float64)
    return noise, signal


# ---------------------------------------------------------------------------------------------
# dequantization, bit-exact with onnxruntime

_CHUNK = 1 << 16  # elements per step: scratch stays in L2 cache


def _views(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int, block_size: int):
    """Pieces (q_view, scale_view, zp_view, out_slice) that broadcast elementwise.

    Every form becomes a 4-D view (pre, groups, members, post) of q; a block axis whose length is
    not a multiple of block_size gives a second piece for the last, shorter block.
    """
    shape = q.shape
    if block_size == 0 and scale.size == 1:  # per tensor
        return [(q.reshape(1, 1, -1, 1), scale.reshape(1, 1, 1, 1),
                 None if zp is None else zp.reshape(1, 1, 1, 1), (1, 1, q.size, 1), None)]
    axis %= q.ndim
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    post = int(np.prod(shape[axis + 1:], dtype=np.int64))
    d = shape[axis]
    if not block_size:
        s4 = scale.reshape(1, d, 1, 1)
        z4 = None if zp is None else zp.reshape(1, d, 1, 1)
        return [(q.reshape(pre, d, 1, post), s4, z4, (pre, d, 1, post), None)]
    nb = scale.shape[axis]
    full = d // block_size
    s3 = scale.reshape(pre, nb, post)
    z3 = None if zp is None else zp.reshape(pre, nb, post)
    q3 = q.reshape(pre, d, post)
    pieces = []
    if full:
        qv = q3[:, : full * block_size, :].reshape(pre, full, block_size, post)
        pieces.append((qv, s3[:, :full, None, :], None if z3 is None else z3[:, :full, None, :],
                       (pre, full, block_size, post), (0, full * block_size)))
    if d > full * block_size:
        rest = d - full * block_size
        qv = q3[:, full * block_size:, :].reshape(pre, 1, rest, post)
        pieces.append((qv, s3[:, full:full + 1, None, :], None if z3 is None else z3[:, full:full + 1, None, :],
                       (pre, 1, rest, post), (full * block_size, d)))
    return pieces


def dequantize_linear(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None,
                      axis: int = 1, block_size: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """`DequantizeLinear` exactly as onnxruntime computes it; result dtype is scale's dtype.

    Works in cache-sized chunks into a preallocated output (no full-size temporaries).
    """
    out_dtype = scale.dtype
    if out is None:
        out = np.empty(q.shape, dtype=out_dtype)
    if q.size == 0:
        return out
    s32 = scale.astype(np.float32)
    z32 = None
    if zero_point is not None and np.any(zero_point):
        z32 = zero_point.astype(np.float32)
    exact_small = q.dtype.itemsize <= 2  # int8/16 minus zero point is exact in float32
    direct = out_dtype == np.float32
    scratch = None if direct else _Scratch(_CHUNK, _half_bits_exact(q, s32, out_dtype))
    if scratch is not None and scratch.half_bits:
        s32 = s32 * _REBIAS  # exact: a power of two, and the products stay normal float32
    pieces = _views(q, s32, z32, axis, block_size)
    if len(pieces) == 1 and pieces[0][4] is None:
        outs = [out.reshape(pieces[0][3])]
    else:
        d = q.shape[axis % q.ndim]
        pre = int(np.prod(q.shape[: axis % q.ndim], dtype=np.int64))
        o3 = out.reshape(pre, d, -1)
        outs = [o3[:, a:b, :].reshape(shape4) for (_, _, _, shape4, (a, b)) in pieces]
    with np.errstate(over="ignore", invalid="ignore"):  # inf / nan results are what onnxruntime gives too
        for (qv, sv, zv, _, _), ov in zip(pieces, outs):
            _apply(qv, sv, zv, ov, scratch, exact_small)
    return out


def _apply(qv, sv, zv, ov, scratch, exact_small) -> None:
    """ov = (qv - zv) * sv over 4-D views (sv, zv broadcast: each dimension equal or 1), in steps
    of about _CHUNK elements along the outermost axes."""
    for ax in range(4):
        inner = int(np.prod(ov.shape[ax + 1:], dtype=np.int64))
        if inner <= _CHUNK:
            break
    step = max(1, _CHUNK // max(inner, 1))

    def take(v, idx, start):
        if v is None:
            return None
        key = tuple(i if v.shape[k] != 1 else 0 for k, i in enumerate(idx))
        return v[key + ((slice(start, start + step) if v.shape[ax] != 1 else slice(0, 1)),)]

    for idx in np.ndindex(*ov.shape[:ax]):
        for start in range(0, ov.shape[ax], step):
            o = ov[idx + (slice(start, start + step),)]
            _kernel(qv[idx + (slice(start, start + step),)], take(sv, idx, start), take(zv, idx, start),
                    o, scratch, exact_small)


_HALF_MIN_NORMAL = 2.0**-14


def _half_bits_exact(q: np.ndarray, s32: np.ndarray, out_dtype) -> bool:
    """True when every product (q - zp) * scale is 0 or a normal float16 (no subnormal, no
    overflow): then the float32 -> float16 rounding can be done with integer bit operations.

    The product of an 8-bit level difference (|d| <= 255, 8 bits) and a float16 scale (11 bits)
    is exact in float32, so onnxruntime's result is that product rounded once to float16.
    """
    if out_dtype != np.float16 or q.dtype.itemsize != 1 or not np.all(np.isfinite(s32)):
        return False
    mag = np.abs(s32)
    nonzero = mag[mag > 0]
    if nonzero.size == 0:
        return True
    return bool(nonzero.min() >= _HALF_MIN_NORMAL and nonzero.max() * 255 <= 65504)


class _Scratch:
    """float32 product buffer, plus two uint32 buffers when the bit-level float16 path applies."""

    def __init__(self, n: int, half_bits: bool):
        self.f32 = np.empty(n, dtype=np.float32)
        self.half_bits = half_bits
        if half_bits:
            self.t = np.empty(n, dtype=np.uint32)
            self.u16 = np.empty(n, dtype=np.uint16)


_REBIAS = np.float32(2.0**-112)  # float32 exponent bias 127 -> float16 bias 15


def _round_to_half_bits(p: np.ndarray, out_u16: np.ndarray, t: np.ndarray) -> None:
    """float32 values already multiplied by 2**-112 -> float16 bit patterns, round to nearest even.

    Valid when every value is 0 or, before the 2**-112, a normal float16 after rounding (checked
    by _half_bits_exact). The exponent then sits in bits 23..27 with bits 28..30 clear, so the
    float16 pattern is the float32 pattern shifted right by 13 after adding 0xFFF plus the lowest
    kept bit (ties to even); the sign lands on bit 18 and is copied down to bit 15. Zero stays 0.
    Five fewer full passes than numpy's float32 -> float16 cast, which is the slow step here.
    """
    b = p.view(np.uint32)
    np.right_shift(b, 13, out=t)
    np.bitwise_and(t, 1, out=t)
    t += np.uint32(0xFFF)
    b += t
    b >>= 13
    np.right_shift(b, 3, out=t)
    np.bitwise_and(t, 0x8000, out=t)
    b |= t
    np.copyto(out_u16, b, casting="unsafe")  # keeps the low 16 bits


def _kernel(qq, ss, zz, o, scratch, exact_small) -> None:
    if scratch is None:
        tgt = o
    else:
        tgt = scratch.f32[: o.size].reshape(o.shape)
    # cast first, then plain float32 arithmetic: a ufunc that casts while it broadcasts the
    # scale runs buffered and several times slower than these separate contiguous passes
    if exact_small:
        np.copyto(tgt, qq, casting="unsafe")  # int8/int16 levels are exact in float32
        if zz is not None:
            np.subtract(tgt, zz, out=tgt)
    else:  # int32 levels: subtract in 64-bit integers first, as the int32 arithmetic would
        diff = qq.astype(np.int64) - (zz.astype(np.int64) if zz is not None else 0)
        np.copyto(tgt, diff, casting="unsafe")
    np.multiply(tgt, ss, out=tgt)
    if scratch is None:
        return
    if not scratch.half_bits:
        np.copyto(o, tgt, casting="unsafe")
        return
    n = o.size
    if o.flags.c_contiguous:
        _round_to_half_bits(scratch.f32[:n], o.reshape(-1).view(np.uint16), scratch.t[:n])
    else:  # a block piece in the middle of an axis: round into scratch, then copy into place
        bits = scratch.u16[:n]
        _round_to_half_bits(scratch.f32[:n], bits, scratch.t[:n])
        np.copyto(o.view(np.uint16), bits.reshape(o.shape))


# ---------------------------------------------------------------------------------------------
# blocked levels with coarse scales (the auto mode's blocked form, written as Cast+Mul+Reshape)


def round_scale_mantissa(scale: np.ndarray, bits: int = 8) -> np.ndarray:
    """float32 scales rounded (to nearest even) to `bits` mantissa bits (the implicit leading one
    counted: 8 is bfloat16's precision), still float32, never 0.

    Why: a scale per block of 64 weights stored as float32 costs 0.5 bit per weight; a float32
    whose 16 low bits are zero is a bfloat16 value, which the pack stores in two bytes (its
    "narrow" codec), and 2**-9 of relative scale error is far below the levels' own error."""
    if not 1 <= bits <= 24:
        raise InvalidArgumentError(f"mantissa bits must be 1..24, got {bits}")
    drop = 24 - bits
    if drop == 0:
        return np.where(scale > 0, scale, np.float32(2.0 ** -126)).astype(np.float32)
    u = np.ascontiguousarray(scale, dtype=np.float32).view(np.uint32).astype(np.uint64)
    keep = (0xFFFFFFFF >> drop) << drop
    u = (u + ((1 << (drop - 1)) - 1) + ((u >> drop) & 1)) & keep
    out = u.astype(np.uint32).view(np.float32)
    tiny = np.float32(2.0 ** -126)
    return np.where(out > 0, out, tiny).astype(np.float32)


def block_split_shape(shape: tuple, axis: int, block: int) -> tuple:
    """The levels' stored shape: `axis` split into (blocks, block) (the axis must be a multiple)."""
    return tuple(shape[:axis]) + (shape[axis] // block, block) + tuple(shape[axis + 1:])


def block_scale_shape(shape: tuple, axis: int, block: int) -> tuple:
    """The blocked scale's stored shape: (blocks, 1) in place of `axis`, the other dims kept."""
    return tuple(shape[:axis]) + (shape[axis] // block, 1) + tuple(shape[axis + 1:])


def quantize_blocks(w: np.ndarray, bits: int, axis: int, block: int) -> Quantized:
    """Symmetric n-bit levels (int8 container) in blocks of `block` consecutive weights along
    `axis` (a multiple of it), one scale per block and per index of the other axes, in the
    layout of block_scale_shape; float32 weights get scales of 8 mantissa bits
    (round_scale_mantissa), float16 weights float16 scales. The clip ratio of each block is
    searched as for quantize_linear, then the levels are rounded at the stored scale. q has the
    weight's shape; dequantize_blocks gives back what Cast+Mul computes."""
    axis %= w.ndim
    if bits < 2 or bits > 8:
        raise InvalidArgumentError(f"bits must be 2..8, got {bits}")
    if block < 2 or w.shape[axis] % block:
        raise InvalidArgumentError(f"axis {axis} of shape {w.shape} is not a multiple of block {block}")
    if w.dtype not in (np.float32, np.float16):
        raise InvalidArgumentError(f"blocked levels take float32 or float16 weights, got {w.dtype}")
    levels = Levels(bits, True)
    found = quantize_linear(w, levels, axis, block)  # scale: (..., blocks, ...) in DequantizeLinear's layout
    scale = found.scale.astype(np.float32)
    if w.dtype == np.float32:
        scale = round_scale_mantissa(scale)
    scale = scale.astype(w.dtype)
    split = block_split_shape(w.shape, axis, block)
    s_split = scale.reshape(block_scale_shape(w.shape, axis, block))
    q = np.clip(np.rint(w.astype(np.float32).reshape(split) / s_split.astype(np.float32)), levels.qmin, levels.qmax)
    q = q.astype(np.int8).reshape(w.shape)
    deq = dequantize_blocks(q, s_split, axis, block)
    err = deq.astype(np.float64) - w.astype(np.float64)
    return Quantized(q, s_split, None, axis, block, float(np.sum(err * err)), float(np.sum(w.astype(np.float64) ** 2)))


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, axis: int, block: int) -> np.ndarray:
    """Cast(levels) * scale as onnxruntime computes it (float32 product of a small integer and a
    scale, exact; rounded once to the scale's type), in the levels' shape. scale: the layout of
    block_scale_shape."""
    axis %= q.ndim
    split = block_split_shape(q.shape, axis, block)
    with np.errstate(over="ignore"):
        prod = q.reshape(split).astype(np.float32) * scale.astype(np.float32)
    return prod.astype(scale.dtype).reshape(q.shape)


ROW_NORM_EXPONENT = 2.0  # row_norm_steps' exponent (measured best of 0.5-4 on minilm_fp32's word embedding)


def row_norm_steps(table: np.ndarray, exponent: float = ROW_NORM_EXPONENT) -> np.ndarray:
    """Relative steps (float64, one per row, geometric mean 1 over the rows with a nonzero norm) for
    the rows of an embedding table nobody has seen gathered: (row norm / geometric mean)**-exponent,
    so a row of larger norm gets a finer step. All-zero rows get the largest step of the others.

    Why: a trained table's row norm tracks how often the row was trained on, which is how often text
    looks it up: minilm_fp32's never-used [unused] rows (ids 1-998) average a norm of 0.46, ids
    2000-5000 1.27, and the lookups that its held-out sentences make on rows the calibration never
    gathered sit at a median norm of 1.24 against 1.11 over all those rows. With no lookup counts for
    them, the norm is the data-free prior. The word embedding alone quantized (rest float), first
    half of the corpus feeds calibrating (its gathered rows at 1/4 of the step), held-out 1 - cosine
    at equal order-0 entropy: 4.49 bits/weight one step 3.14e-4, exponent 2 2.54e-4, 3 2.70e-4; 3.5
    bits 1.14e-3, exponent 1 1.03e-3, 2 1.00e-3; steps proportional to the norm (-0.5, -1: equal
    relative error per row, the LayerNorm argument) 1.41e-3 / 1.65e-3, worse."""
    t = np.asarray(table)
    if t.ndim < 2:
        raise InvalidArgumentError(f"row_norm_steps takes a table of rows (2-D or more), got shape {t.shape}")
    norms = np.sqrt(np.sum(np.square(t.reshape(t.shape[0], -1).astype(np.float64)), axis=1))
    live = norms > 0
    if not live.any():
        return np.ones(t.shape[0])
    gm = float(np.exp(np.mean(np.log(norms[live]))))
    rel = np.ones(t.shape[0])
    rel[live] = (norms[live] / gm) ** -float(exponent)
    rel[~live] = rel[live].max()
    return rel
