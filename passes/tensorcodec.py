"""The tensor codec: one float array to a small self-describing blob and back (lossy).

    blob = encode_array(w, snr_db=30)      # quantize + entropy-code at the coarsest step meeting 30 dB
    blob = encode_array(w, bits=6)         # at most 2**5 - 1 levels each side, MSE-optimal step
    w_hat = decode_array(blob)             # float32 (or the input's float dtype), same shape

How it gets close to the rate-distortion bound:
  - a uniform step, the same for the whole tensor (at a given MSE that is what minimises the rate
    when every element's variance exceeds the distortion), with reconstruction points at the
    centroids of the small magnitudes (|k| < 16), sent as 16 floats;
  - rate-distortion optimised rounding: each element takes the floor or ceiling magnitude (or 0)
    that minimises squared error + lambda * its actual code length in its context (greedy, in scan
    order, with the code lengths re-estimated twice);
  - context modelling: within a scan unit (a convolution kernel, or a row) the context of an
    element is a bucket of the two previous magnitudes; optionally times a class of its row (by
    energy) and a class of its position in the unit (kernel tap, or column by energy), kept only
    when they save >= 1% of the bits over the layouts whose decode table fits 256 KiB (a larger
    table is read from L3 and decodes ~1/3 slower);
  - rANS coding with 12-bit probabilities in chunks of 8-64 K elements, decoded in parallel
    (threads, and several chunks interleaved per thread in the C decoder passes/_tcodec.c: 16 in
    the lanes of one AVX-512 vector or two AVX2 vectors where the CPU has them, else 3).

Blob layout (little endian), version 1:
  b"SCTC" | u8 version | u8 dtype | u8 ndim | u8 flags (bit 0: dependent quantization) |
  u64 shape[ndim] | f64 step | f32 mref | u32 unit_len | u32 units_per_row | u8 nb_ctx |
  u8 row_classes | u8 pos_classes | u8 0 | f32 recon[32] (magnitudes 0..15 of Q0, then Q1) |
  u32 n_chunks | u32 side_len | side (zlib) |
  u64 n_words | words (u16) | u64 n_raw | raw (u32) | u32 crc32 of everything before
side (after zlib.decompress): row_cls u8[rows] if row_classes > 1 | pos_cls u8[unit_len] if pos_classes > 1 |
  per context: u8 n_tokens, u16 freq[n_tokens] | u32 chunk_units[n_chunks + 1] |
  u32 words per chunk[n_chunks] | u32 raw words per chunk[n_chunks]
"""
from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ._cpus import usable_cpus
from .errors import (CorruptFileError, InvalidArgumentError, LimitExceededError, NewerFormatError,
                     UnsupportedFormError)

MAGIC = b"SCTC"
VERSION = 1
_DTYPES = {1: np.float32, 2: np.float16, 3: np.float64}
_DTYPE_CODE = {np.dtype(v): k for k, v in _DTYPES.items()}
_HEAD = struct.Struct("<dfIIBBBB32fII")
CHUNK_ELEMENTS = 1 << 16  # largest chunk (elements); smaller tensors get smaller chunks:
MIN_CHUNK_ELEMENTS = 1 << 14
CHUNKS_WANTED = 32
ROUNDS_WANTED = 2  # rounds of CHUNKS_WANTED chunks, where they keep >= MIN_ROUND_CHUNK_ELEMENTS
MIN_ROUND_CHUNK_ELEMENTS = 1 << 13


def _chunk_elements(n: int) -> int:
    """Elements per chunk (independently decodable: own rANS state, raw bits, trellis start).
    At least CHUNKS_WANTED chunks where that keeps them >= MIN_CHUNK_ELEMENTS, so that the
    decoder's threads x lanes (passes/_tcodec.c) have work to share also on mid-size tensors;
    each chunk costs ~15 bytes (measured: 16K-element chunks instead of 64K add 0.1-0.2% to the
    blob at 2.5 bits per weight). From 512 K elements on, ROUNDS_WANTED x CHUNKS_WANTED chunks
    (>= 8 K elements): each of the C decoder's 2 threads takes 16 chunks at a time (its lanes), so
    with 32 chunks a thread that starts late or shares its core (a 2-core machine with other work)
    holds half the tensor to the end while the other idles; with two rounds the thread on time takes
    the second round of the late one's half (Conv_5831 of open_nsfw, 0.6 M weights, ~1.2 ms a thread:
    32 -> 64 chunks; +285-350 bytes a tensor, +0.06-0.17% at 2.4-8.1 bits per weight)."""
    per_round = n // (CHUNKS_WANTED * ROUNDS_WANTED)
    if per_round >= MIN_ROUND_CHUNK_ELEMENTS:
        return int(min(CHUNK_ELEMENTS, per_round))
    return int(min(CHUNK_ELEMENTS, max(MIN_CHUNK_ELEMENTS, n // CHUNKS_WANTED)))
LUT_MAX = 4095
N_TOKENS = 232  # = _tcodec_kernels.N_TOKENS (magnitude tokens)
PROB_SCALE = 1 << 12  # = _tcodec_kernels.PROB_SCALE
MAX_ELEMENTS = 1 << 40


def _kernels():
    try:
        from . import _tcodec_kernels as k
    except ImportError as exc:  # numba missing
        raise UnsupportedFormError(f"the tensor codec needs numba ({exc}); pip install numba") from None
    return k


# --------------------------------------------------------------------------------------------
# layout: how the tensor is scanned and which context classes it uses

@dataclass
class _Layout:
    unit_len: int
    units_per_row: int
    nb_ctx: int
    row_cls: np.ndarray  # uint8 per row
    n_row_cls: int
    pos_cls: np.ndarray  # uint8 per position in a unit
    n_pos_cls: int
    mref: float
    tcq: bool = False

    @property
    def n_ctx(self) -> int:
        return self.n_row_cls * self.n_pos_cls * self.nb_ctx * (2 if self.tcq else 1)

    def kargs(self):
        """The layout arguments of the compiled kernels, in their order."""
        return (self.unit_len, self.units_per_row, self.row_cls, self.pos_cls.astype(np.int32),
                self.n_pos_cls, self.lut(), self.nb_ctx)

    def chunk_units(self, n: int) -> np.ndarray:
        n_units = n // self.unit_len
        per = max(1, _chunk_elements(n) // self.unit_len)
        if n_units == 0:
            return np.zeros(1, np.int64)
        batches = -(-n_units // (per * CHUNKS_WANTED))
        if batches > 1:
            # more than CHUNKS_WANTED chunks: a multiple of it (smaller chunks), so that the decoder's
            # threads x 16 lanes end together. (word_embeddings, 2 threads: 180 chunks were 6 rounds
            # of 16 lanes on one thread, 5 and 4 chunks on the other; 192 smaller ones are 6 and 6.)
            per = -(-n_units // (batches * CHUNKS_WANTED))
        return np.unique(np.append(np.arange(0, n_units, per), n_units)).astype(np.int64)

    def lut(self) -> np.ndarray:
        return _neighbour_lut_uncached(self.mref, self.nb_ctx)


def _neighbour_lut(mref: float, nb_ctx: int) -> np.ndarray:
    """Context bucket (1..nb_ctx-1) of the sum of the two previous magnitudes; log-spaced around
    the tensor's mean magnitude so the same buckets work at every rate."""
    return _neighbour_lut_cached(np.float32(mref).tobytes(), int(nb_ctx))


@functools.lru_cache(maxsize=64)
def _neighbour_lut_cached(mref_bits: bytes, nb_ctx: int) -> np.ndarray:
    """(by the float32 bits of mref, shared: callers only read it; a decode of a blob seen before
    skips ~20 us of logarithms)"""
    return _neighbour_lut_uncached(np.frombuffer(mref_bits, np.float32)[0], nb_ctx)


def _neighbour_lut_uncached(mref, nb_ctx: int) -> np.ndarray:
    s = np.arange(LUT_MAX + 1, dtype=np.float64)
    if nb_ctx <= 1:
        return np.zeros(LUT_MAX + 1, np.int32)
    b = np.floor(2.0 * np.log2(1.0 + s / max(np.float32(mref), 1e-6))).astype(np.int64)
    return (1 + np.minimum(b, nb_ctx - 2)).astype(np.int32)


def _scan_shape(shape: tuple) -> tuple[int, int]:
    """(unit_len, units_per_row): kernels of a conv weight (O, I, kh, kw) are units, a row is one
    output channel; a matrix's rows are units; a vector is one unit."""
    if len(shape) >= 3:
        unit = int(np.prod(shape[2:]))
        if unit > 1:
            return unit, int(shape[1])
        return int(np.prod(shape[1:])), 1
    if len(shape) == 2:
        return int(shape[1]), 1
    return max(int(np.prod(shape)), 1), 1


def _classes(energy: np.ndarray, n: int) -> np.ndarray:
    """Quantile classes (0..n-1) of per-row/per-position energy."""
    if n <= 1 or energy.size == 0:
        return np.zeros(energy.size, np.uint8)
    edges = np.quantile(energy, np.linspace(0, 1, n + 1)[1:-1])
    return np.searchsorted(edges, energy, side="right").astype(np.uint8)


def _layout(w2: np.ndarray, shape: tuple, nb_ctx: int, n_row: int, n_pos: int, mref: float,
            tcq: bool = False) -> _Layout:
    unit_len, upr = _scan_shape(shape)
    n_units = w2.size // unit_len
    rows = n_units // upr
    sq = (w2.reshape(rows, upr, unit_len).astype(np.float64)) ** 2
    row_cls = _classes(sq.mean(axis=(1, 2)), n_row) if n_row > 1 else np.zeros(rows, np.uint8)
    if n_pos > 1 and unit_len > 1:
        if unit_len <= 16 and n_pos >= unit_len:  # kernel taps: one class each
            pos_cls = np.arange(unit_len, dtype=np.uint8)
            n_pos = unit_len
        else:
            pos_cls = _classes(sq.mean(axis=(0, 1)), n_pos)
    else:
        pos_cls = np.zeros(unit_len, np.uint8)
        n_pos = 1
    n_row = int(row_cls.max()) + 1 if n_row > 1 else 1
    return _Layout(unit_len, upr, nb_ctx, row_cls, max(n_row, 1), pos_cls, n_pos, mref, tcq)


# --------------------------------------------------------------------------------------------
# model tables

def _normalise(counts: np.ndarray, k) -> np.ndarray:
    """Counts per context -> frequencies summing to 2**PROB_BITS, every used token >= 1."""
    scale = k.PROB_SCALE
    counts = counts.astype(np.int64)
    tot = counts.sum(axis=1, keepdims=True)
    freq = np.where(tot > 0, (counts * scale) // np.maximum(tot, 1), 0)
    freq[(counts > 0) & (freq == 0)] = 1
    empty = tot[:, 0] == 0
    freq[empty, 0] = scale  # unused context: any valid table
    diff = scale - freq.sum(axis=1)
    top = np.argmax(freq, axis=1)
    freq[np.arange(freq.shape[0]), top] += diff
    if (freq < 0).any():  # pathological: many tokens forced to 1; flatten instead
        raise UnsupportedFormError("tensor codec: too many distinct magnitudes for one context")
    return freq.astype(np.uint32)


def _tables(freq: np.ndarray):
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    sym = np.empty((freq.shape[0], int(freq[0].sum())), np.uint8)
    toks = np.arange(freq.shape[1])
    for c in range(freq.shape[0]):  # one per context (tens), not per element
        sym[c] = np.repeat(toks, freq[c]).astype(np.uint8)
    return cum.astype(np.uint32), sym


def _cost_bits(counts: np.ndarray) -> np.ndarray:
    c = counts.astype(np.float64) + 0.25
    return -np.log2(c / c.sum(axis=1, keepdims=True))


def _freq_side(freq: np.ndarray) -> bytes:
    parts = []
    for f in freq:
        nz = np.flatnonzero(f)
        n = int(nz[-1]) + 1 if nz.size else 0
        parts.append(bytes([n]) + f[:n].astype("<u2").tobytes())
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# quantization

def _grid(tcq: bool) -> np.ndarray:
    """Default reconstruction (in steps) of magnitudes 0..15 for Q0 then Q1."""
    m = np.arange(16, dtype=np.float64)
    if not tcq:
        return np.concatenate([m, m])
    return np.concatenate([2 * m, np.maximum(2 * m - 1, 0)])


def _reconstruct(levels: np.ndarray, recon_rel: np.ndarray, step: float, q, tcq: bool) -> np.ndarray:
    m = np.abs(levels)
    qi = np.zeros(m.shape, np.int64) if q is None else q.astype(np.int64)
    big = (2.0 * m - qi) if tcq else m.astype(np.float64)
    v = np.where(m < 16, recon_rel[qi * 16 + np.minimum(m, 15)], big)
    return np.where(levels < 0, -v, v) * step


def _centroids(x: np.ndarray, levels: np.ndarray, q, tcq: bool) -> np.ndarray:
    """Mean |x| (in steps) of the elements at each (quantizer, magnitude < 16); the decoder's
    reconstruction points. Rounded to float32 as stored."""
    m = np.abs(levels)
    qi = np.zeros(m.shape, np.int64) if q is None else q.astype(np.int64)
    small = m < 16
    key = qi[small] * 16 + m[small]
    sums = np.bincount(key, weights=np.abs(x[small]), minlength=32)[:32]
    cnt = np.bincount(key, minlength=32)[:32]
    rec = _grid(tcq)
    ok = cnt > 0
    rec[ok] = sums[ok] / cnt[ok]
    rec[0] = rec[16] = 0.0
    return rec


def _quantize(k, x: np.ndarray, lay: _Layout, lam: float, max_level: int, iters: int = 2):
    """x = w / step (flat float64). Returns (levels int32, quantizer ids or None, recon_rel,
    counts)."""
    args = lay.kargs()
    chunks = lay.chunk_units(x.size)
    if lay.tcq:
        recon = _grid(True)
        zero_bits = np.zeros((lay.n_ctx, k.N_TOKENS))
        levels = k.trellis_quantize(x, *args, zero_bits, recon, 0.0, max_level, chunks)
    else:
        levels = np.clip(np.rint(x), -max_level, max_level).astype(np.int32)
    q = k.quantizer_ids(levels, lay.unit_len, chunks) if lay.tcq else None
    recon = _centroids(x, levels, q, lay.tcq)
    counts = k.count_tokens(levels, *args, lay.n_ctx, lay.tcq, chunks)
    if lam > 0:
        for _ in range(iters):
            bits = _cost_bits(counts)
            if lay.tcq:
                levels = k.trellis_quantize(x, *args, bits, recon, lam, max_level, chunks)
                q = k.quantizer_ids(levels, lay.unit_len, chunks)
            else:
                levels = k.rdo_quantize(x, *args, bits, recon, lam, max_level)
            recon = _centroids(x, levels, q, lay.tcq)
            counts = k.count_tokens(levels, *args, lay.n_ctx, lay.tcq, chunks)
    return levels, q, recon, counts


def _snr(w: np.ndarray, w_hat: np.ndarray) -> float:
    num = float(np.dot(w, w))
    err = float(np.dot(w - w_hat, w - w_hat))
    if err == 0:
        return float("inf")
    if num == 0:
        return float("-inf")
    return 10.0 * np.log10(num / err)


def _est_bits(counts: np.ndarray, k) -> float:
    """Ideal code length of the tokens under the normalised tables + raw bits are added by caller."""
    freq = _normalise(counts, k).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lb = np.where(counts > 0, -np.log2(freq / k.PROB_SCALE), 0.0)
    return float((counts * lb).sum())


def _raw_bits(counts: np.ndarray) -> float:
    t = np.arange(counts.shape[1])
    e = np.where(t < 16, 0, (t - 16) // 8 + 4)
    nbits = np.where(t < 16, 0, e - 3) + (t > 0)
    return float((counts.sum(axis=0) * nbits).sum())


# --------------------------------------------------------------------------------------------
# public API

def encode_array(array, *, snr_db: float | None = None, bits: int | None = None, form: str = "tcq",
                 lam: float | None = None, contexts: str = "auto") -> bytes:
    """Quantize and entropy-code one float array. Exactly one of snr_db (the coarsest step whose
    reconstruction SNR is >= snr_db) or bits (magnitudes up to 2**(bits-1) - 1 steps, step chosen
    for least squared error) may be given; neither means bits=8.

    form: "tcq" (dependent quantization: 4-state trellis, default), "rdo" (scalar
    rate-distortion optimised rounding) or "nearest" (round to nearest).
    contexts: "auto" (the encoder tries a few context layouts and keeps the smallest), "none"
    (one table) or "neighbours" (previous-two-magnitude contexts only).
    lam: Lagrange multiplier of rate against squared error in steps^2 (default per form)."""
    k = _kernels()
    a = np.asarray(array)
    if a.dtype not in _DTYPE_CODE:
        raise InvalidArgumentError(f"encode_array: float16/32/64 arrays only, got {a.dtype}")
    if a.ndim > 8:
        raise InvalidArgumentError(f"encode_array: at most 8 dimensions, got {a.ndim}")
    if form not in FORMS:
        raise InvalidArgumentError(f"encode_array: unknown form {form!r} ({', '.join(FORMS)})")
    if contexts not in ("auto", "none", "neighbours"):
        raise InvalidArgumentError(f"encode_array: unknown contexts {contexts!r} (auto, none, neighbours)")
    if snr_db is not None and bits is not None:
        raise InvalidArgumentError("encode_array: give snr_db or bits, not both")
    if snr_db is not None and not (isinstance(snr_db, (int, float, np.number)) and np.isfinite(snr_db)
                                   and 0 < snr_db <= 150):
        raise InvalidArgumentError(f"encode_array: snr_db must be in (0, 150], got {snr_db!r}")
    if bits is None and snr_db is None:
        bits = 8
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, np.integer))
                             or not 2 <= bits <= 16):
        raise InvalidArgumentError(f"encode_array: bits must be an integer in 2..16, got {bits!r}")
    if lam is not None and not (np.isfinite(lam) and 0 <= lam <= 10):
        raise InvalidArgumentError(f"encode_array: lam must be in [0, 10], got {lam!r}")
    w = a.astype(np.float64).ravel()
    if w.size and not np.isfinite(w).all():
        raise InvalidArgumentError("encode_array: the array holds NaN or infinity")
    if w.size > MAX_ELEMENTS:
        raise InvalidArgumentError("encode_array: array too large")
    tcq = form == "tcq"
    if lam is None:
        lam = {"tcq": 0.12, "rdo": 0.12, "nearest": 0.0}[form]
    if form == "nearest":
        lam = 0.0
    shape = tuple(int(d) for d in a.shape)
    if w.size == 0 or not np.abs(w).max() > 0:
        lay = _layout(w.astype(np.float32), shape, 1, 1, 1, 1.0) if w.size else None
        return _write(a.dtype, shape, 1.0, lay, np.zeros(w.size, np.int32), _grid(False), k)

    # with dependent quantization a magnitude m spans about 2m steps
    max_level = (1 << (bits - 1)) - 1 if bits is not None else (1 << 28)
    grid_max = 2 * max_level if tcq else max_level

    def run(step, lay):
        levels, q, recon, counts = _quantize(k, w / step, lay, lam, max_level)
        return levels, recon, counts, _snr(w, _reconstruct(levels, recon, step, q, lay.tcq))

    if snr_db is not None:
        step0 = _step_for_snr_plain(w, snr_db)
    else:
        step0 = _step_for_bits(w, grid_max)
    # the neighbour buckets are relative to the mean magnitude at about the final step
    mref = float(np.mean(np.abs(np.rint(w / step0)))) / (2 if tcq else 1) or 1.0
    configs = [(1, 1, 1)]
    if contexts in ("auto", "neighbours"):
        configs.append((8, 1, 1))
    if contexts == "auto":
        configs += [(8, 4, 1), (8, 1, 4), (8, 4, 4)]
    w32 = w.astype(np.float32)
    sub = _subsample(w32, shape)
    w_sel, shape_sel = sub if sub is not None else (w32, shape)
    w_sel64 = w_sel.astype(np.float64).ravel()
    estimates = []
    for cfg in configs:  # (on evenly spaced rows of a large tensor)
        lay_sel = _layout(w_sel, shape_sel, *cfg, mref, tcq)
        lv, q, rc, counts = _quantize(k, w_sel64 / step0, lay_sel, lam, max_level)
        s = _snr(w_sel64, _reconstruct(lv, rc, step0, q, tcq))
        lay = _layout(w32, shape, *cfg, mref, tcq)
        est = _est_bits(counts, k) + _raw_bits(counts) + 8 * len(zlib.compress(_freq_side(_normalise(counts, k)), 9))
        if lay.n_row_cls > 1:
            est += 8 * len(zlib.compress(lay.row_cls.tobytes(), 9))
        if snr_db is not None and np.isfinite(s):  # compare at equal distortion (6.02 dB/bit)
            est += (snr_db - s) / 6.02 * w_sel.size
        estimates.append((est, lay))
    lay = _cheapest_to_decode(estimates)
    if snr_db is not None:
        if sub is not None:
            # large tensor: search the step on evenly spaced rows, then refine on everything
            ws, sshape = sub
            slay = _layout(ws, sshape, lay.nb_ctx, lay.n_row_cls, lay.n_pos_cls, mref, tcq)
            wsub = ws.astype(np.float64).ravel()

            def run_sub(st):
                lv, q, rc, _ = _quantize(k, wsub / st, slay, lam, max_level)
                return _snr(wsub, _reconstruct(lv, rc, st, q, tcq))

            step_s = _bisect_step(run_sub, snr_db, step0)
            step = _bisect_step(lambda st: run(st, lay)[3], snr_db, step_s, spread=1.03, iters=4)
        else:
            step = _bisect_step(lambda st: run(st, lay)[3], snr_db, step0)
    else:
        step = _best_step_for_bits(lambda st: run(st, lay)[3], step0)
    levels, recon, _, _ = run(step, lay)
    return _write(a.dtype, shape, step, lay, levels, recon, k)


FORMS = ("tcq", "rdo", "nearest")

# The decoder looks up one 4-byte entry per (context, 12-bit slot): 16 KiB per context, read at
# random. A table beyond ~half a 512 KiB L2 (Zen 3's) is read from L3 and the decode slows by a
# third: onnx::Conv_5831 at 23 dB, one thread, CPU ms (bench/tcodec_decode.py's blob, AVX2 lanes):
# 64 contexts (1 MiB) 3.62, 16 contexts (256 KiB) 2.37, for 0.24% more bits. So a layout with a
# larger table is kept only when it saves at least LARGE_TABLE_GAIN of the estimated bits.
DECODE_TABLE_BUDGET = 1 << 18  # bytes
LARGE_TABLE_GAIN = 0.01


def _decode_table_bytes(lay: _Layout) -> int:
    return lay.n_ctx * PROB_SCALE * 4


def _cheapest_to_decode(estimates: list) -> _Layout:
    """The layout of least estimated bits among those whose decode table fits
    DECODE_TABLE_BUDGET, unless a larger one saves at least LARGE_TABLE_GAIN more.
    estimates: (estimated bits, layout), the one-table layout first (always within budget)."""
    best = min(estimates, key=lambda e: e[0])
    small = min((e for e in estimates if _decode_table_bytes(e[1]) <= DECODE_TABLE_BUDGET),
                key=lambda e: e[0], default=best)
    return best[1] if best[0] < small[0] * (1.0 - LARGE_TABLE_GAIN) else small[1]


def _step_for_snr_plain(w: np.ndarray, snr_db: float) -> float:
    """Step of nearest rounding for snr_db, from the high-rate formula D = step^2/12, refined."""
    p = float(np.dot(w, w)) / w.size
    step = np.sqrt(12 * p / 10 ** (snr_db / 10))
    return float(step)


def _step_for_bits(w: np.ndarray, max_level: int) -> float:
    peak = float(np.abs(w).max())
    best = (np.inf, peak / max_level)
    for r in np.geomspace(0.03, 1.0, 25):  # clipping ratio search, least squared error
        st = r * peak / max_level
        e = float(np.sum((np.clip(np.rint(w / st), -max_level, max_level) * st - w) ** 2))
        if e < best[0]:
            best = (e, st)
    return best[1]


SUBSAMPLE_ELEMENTS = 1 << 21


def _subsample(w32: np.ndarray, shape: tuple):
    """Evenly spaced rows (output channels) of a large tensor, about SUBSAMPLE_ELEMENTS in all,
    or None when the tensor is small or has a single row."""
    if w32.size <= 2 * SUBSAMPLE_ELEMENTS or len(shape) < 2 or shape[0] < 8:
        return None
    rows = w32.reshape(shape[0], -1)
    every = int(np.ceil(w32.size / SUBSAMPLE_ELEMENTS))
    picked = rows[::every]
    return picked.ravel(), (picked.shape[0],) + tuple(shape[1:])


def _bisect_step(snr_of, target: float, step0: float, spread: float = 2.0, iters: int = 14) -> float:
    """Largest step whose SNR >= target (SNR falls as the step grows), searched from
    [step0 / spread, step0 * spread] (widened when the answer lies outside)."""
    lo, hi = step0 / spread, step0 * spread
    while snr_of(lo) < target:
        lo, hi = lo / spread, lo
        if lo < step0 * 1e-6:
            raise UnsupportedFormError(f"encode_array: cannot reach {target} dB")
    for _ in range(40):
        s_hi = snr_of(hi)
        if s_hi < target:
            break
        lo, hi = hi, hi * spread
    for _ in range(iters):
        mid = np.sqrt(lo * hi)
        if snr_of(mid) >= target:
            lo = mid
        else:
            hi = mid
    return float(lo)


def _best_step_for_bits(snr_of, step0: float) -> float:
    best = (-np.inf, step0)
    for r in (0.9, 0.95, 1.0, 1.05, 1.1):
        s = snr_of(step0 * r)
        if s > best[0]:
            best = (s, step0 * r)
    return best[1]


def _write(dtype, shape, step, lay, levels, recon_rel, k) -> bytes:
    n = int(np.prod(shape)) if shape else 1
    if n == 0 or lay is None:
        lay = _Layout(1, 1, 1, np.zeros(0, np.uint8), 1, np.zeros(1, np.uint8), 1, 1.0)
        levels = np.zeros(0, np.int32)
    head = bytearray(MAGIC)
    head += struct.pack("<BBBB", VERSION, _DTYPE_CODE[np.dtype(dtype)], len(shape), int(lay.tcq))
    head += struct.pack(f"<{len(shape)}Q", *shape)
    recon_abs = (np.asarray(recon_rel, np.float64) * step).astype(np.float32)
    chunk_units = lay.chunk_units(levels.size)
    n_chunks = chunk_units.size - 1
    args = lay.kargs()
    counts = (k.count_tokens(levels, *args, lay.n_ctx, lay.tcq, chunk_units) if n_chunks
              else np.zeros((lay.n_ctx, k.N_TOKENS), np.int64))
    freq = _normalise(counts, k)
    cum, _ = _tables(freq)
    words, woff, raw, roff = k.encode_chunks(levels, chunk_units, *args, lay.tcq, freq, cum)
    side = bytearray()
    if lay.n_row_cls > 1:
        side += lay.row_cls.astype(np.uint8).tobytes()
    if lay.n_pos_cls > 1:
        side += lay.pos_cls.astype(np.uint8).tobytes()
    side += _freq_side(freq)
    side += chunk_units.astype("<u4").tobytes()
    side += np.diff(woff).astype("<u4").tobytes() + np.diff(roff).astype("<u4").tobytes()
    side_z = zlib.compress(bytes(side), 9)
    head += _HEAD.pack(float(step), float(lay.mref), lay.unit_len, lay.units_per_row, lay.nb_ctx,
                       lay.n_row_cls, lay.n_pos_cls, 0, *recon_abs.tolist(), n_chunks, len(side_z))
    out = bytes(head) + side_z
    out += struct.pack("<Q", words.size) + words.astype("<u2").tobytes()
    out += struct.pack("<Q", raw.size) + raw.astype("<u4").tobytes()
    return out + struct.pack("<I", zlib.crc32(out))


def _fast_decoder():
    """The C decoder (passes/_tcodec.c), or None when the extension was not built."""
    try:
        from . import _tcodec
    except ImportError:
        return None
    return _tcodec


_FAST = _fast_decoder()
_WORD_PAD = _FAST.WORD_PAD if _FAST is not None else 0
_RAW_PAD_WORDS = -(-_FAST.RAW_PAD_BYTES // 4) if _FAST is not None else 0
LANES = 3  # chunks each C decoder thread interleaves (measured: 1: 84, 2: 146, 3: 167, 4: 152 M symbols/s)
# the C decoder's vector lanes (16 chunks per thread: one AVX-512 vector, else two AVX2 vectors, where
# the CPU has them) decode while a thread has at least SIMD chunks (1..5) left; the scalar lanes
# finish the rest (0: scalar lanes only; + 32: the AVX2 lanes also on AVX-512 CPUs, for tests).
# Measured with AVX-512: 5 scalar-lane chunks ~ 5 vector-lane chunks in time (the vector step costs
# the same at any number of active lanes); AVX2 on Zen 3 (one vector for <= 8 chunks), 1 thread, AVX2 vs
# scalar lanes: 3 chunks 0.65 vs 0.49 ms, 4-6 chunks about equal, 8 chunks 0.99 vs 1.44 ms.
SIMD = 5


def _default_threads() -> int:
    return usable_cpus()


def _crc32(view) -> int:
    """zlib.crc32, by the C decoder's carry-less-multiply CRC where built (~4x zlib's here: the
    check runs on one core before the threads start)."""
    fast = getattr(_FAST, "crc32", None) if _FAST is not None else None
    return fast(view) if fast is not None else zlib.crc32(view)


def decode_array(blob, *, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Decode a blob of encode_array. out: optional preallocated float32 array (C-contiguous,
    right size) to decode into (avoids page faults of fresh memory); threads: decoder threads
    (default: the CPUs this process may use)."""
    k = None if _FAST is not None else _kernels()
    mv = memoryview(blob).cast("B") if not isinstance(blob, (bytes, bytearray)) else blob
    b = bytes(mv)
    if len(b) < 8 + 4 or b[:4] != MAGIC:
        raise CorruptFileError("decode_array: not a tensor-codec blob (bad magic or too short)")
    if b[4] > VERSION:
        raise NewerFormatError(f"decode_array: blob version {b[4]} is newer than this reader ({VERSION})")
    if _crc32(memoryview(b)[:-4]) != struct.unpack("<I", b[-4:])[0]:  # (a view: no copy)
        raise CorruptFileError("decode_array: checksum mismatch (the blob is damaged)")
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32
                            or not out.flags.c_contiguous):
        raise InvalidArgumentError("decode_array: out must be a C-contiguous float32 array")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, (int, np.integer))
                                or threads < 1):
        raise InvalidArgumentError(f"decode_array: threads must be a positive integer, got {threads!r}")
    try:
        return _decode(b, k, out, threads)
    except InvalidArgumentError:
        raise
    except MemoryError:  # a declared shape this process cannot hold: refused, like any bad size
        raise LimitExceededError("decode_array: the declared tensor does not fit in memory") from None
    except (struct.error, ValueError, IndexError, zlib.error) as exc:
        raise CorruptFileError(f"decode_array: malformed blob ({exc})") from None


def _decode(b: bytes, k, out, threads):
    version, dcode, ndim, flags = struct.unpack_from("<BBBB", b, 4)
    tcq = bool(flags & 1)
    if dcode not in _DTYPES or ndim > 8 or flags > 1:
        raise CorruptFileError("decode_array: bad dtype or rank")
    pos = 8
    shape = struct.unpack_from(f"<{ndim}Q", b, pos)
    pos += 8 * ndim
    n = math.prod(shape)  # (exact: a crafted shape cannot wrap around)
    if n > MAX_ELEMENTS:
        raise CorruptFileError("decode_array: declared size too large")
    vals = _HEAD.unpack_from(b, pos)
    pos += _HEAD.size
    step, mref, unit_len, upr, nb_ctx, n_row, n_pos, _ = vals[:8]
    recon = np.asarray(vals[8:40], np.float32)
    n_chunks, side_len = vals[40:42]
    side = zlib.decompress(b[pos:pos + side_len])
    pos += side_len
    (n_words,) = struct.unpack_from("<Q", b, pos)
    pos += 8
    if n_words > (len(b) - pos) // 2:  # checked before numpy sees a count it cannot represent
        raise CorruptFileError("decode_array: declared word count beyond the blob")
    # padded: the C decoder reads a little past a chunk's streams before it checks the bounds (the
    # values read there are never used). The raw section follows the words: where it is long enough
    # to be the padding, the words are read in place (copying them cost ~3% of a 47 MB decode), also
    # at an odd offset (the zlib side information before them has any length) by the C decoder, which
    # assumes no alignment; the numba one gets them aligned
    if (_FAST is not None or pos % 2 == 0) and len(b) - (pos + 2 * n_words) >= 2 * _WORD_PAD:
        words = np.frombuffer(b, "<u2", n_words + _WORD_PAD, pos)
    else:
        words = np.empty(n_words + _WORD_PAD, np.uint16)
        words[:n_words] = np.frombuffer(b, "<u2", n_words, pos)
        words[n_words:] = 0
    pos += 2 * n_words
    (n_raw,) = struct.unpack_from("<Q", b, pos)
    pos += 8
    if n_raw > (len(b) - pos) // 4:
        raise CorruptFileError("decode_array: declared raw count beyond the blob")
    raw = np.empty(n_raw + _RAW_PAD_WORDS, np.uint32)
    raw[:n_raw] = np.frombuffer(b, "<u4", n_raw, pos)
    raw[n_raw:] = 0
    pos += 4 * n_raw
    if pos != len(b) - 4:
        raise CorruptFileError("decode_array: trailing or missing bytes")
    dtype = _DTYPES[dcode]
    if n == 0:
        return np.zeros(shape, dtype)
    if unit_len < 1 or upr < 1 or n % unit_len or (n // unit_len) % upr or nb_ctx < 1:
        raise CorruptFileError("decode_array: inconsistent layout")
    n_units = n // unit_len
    rows = n_units // upr
    sp = 0
    if n_row > 1:
        row_cls = np.frombuffer(side, np.uint8, rows, sp).copy()
        sp += rows
    else:
        row_cls = None  # all rows in class 0; allocated once the chunk table vouches for `rows`
    if n_pos > 1:
        pos_cls = np.frombuffer(side, np.uint8, unit_len, sp).astype(np.int32)
        sp += unit_len
    else:
        pos_cls = None  # like row_cls: allocated once the chunk table vouches for the layout
    if (row_cls is not None and row_cls.size and row_cls.max() >= n_row
            or pos_cls is not None and pos_cls.max() >= n_pos):
        raise CorruptFileError("decode_array: class out of range")
    n_ctx = n_row * n_pos * nb_ctx * (2 if tcq else 1)
    # the chunk table closes the side information: chunk_units[n_chunks + 1], then words and raw
    # words per chunk[n_chunks] (one read for the three); the context records fill the bytes between
    tables_end = len(side) - 4 * (3 * n_chunks + 1)
    if tables_end < sp:
        raise CorruptFileError("decode_array: bad side information length")
    if _FAST is not None:
        freq = memoryview(side)[sp:tables_end]  # the records as they are: the C decoder reads and checks them
    else:
        freq = _frequency_rows(side, sp, tables_end, n_ctx)
    chunk_table = np.frombuffer(side, "<u4", 3 * n_chunks + 1, tables_end).astype(np.int64)
    chunk_units = chunk_table[:n_chunks + 1]
    wcnt, rcnt = chunk_table[n_chunks + 1:2 * n_chunks + 1], chunk_table[2 * n_chunks + 1:]
    if (chunk_units[0] != 0 or chunk_units[-1] != n_units or (np.diff(chunk_units) <= 0).any()
            or wcnt.sum() != n_words or rcnt.sum() != n_raw):
        raise CorruptFileError("decode_array: bad chunk table")
    if row_cls is None:
        row_cls = np.zeros(rows, np.uint8)
    if pos_cls is None:
        pos_cls = np.zeros(unit_len, np.int32)
    woff = np.zeros(n_chunks + 1, np.int64)
    np.cumsum(wcnt, out=woff[1:])
    roff = np.zeros(n_chunks + 1, np.int64)
    np.cumsum(rcnt, out=roff[1:])
    lut = _neighbour_lut(mref, nb_ctx)
    if out is None or dtype != np.float32:
        res = np.empty(n, np.float32)
    else:
        if out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous:
            raise InvalidArgumentError("decode_array: out must be a C-contiguous float32 array of the right size")
        res = out.reshape(-1)
    n_threads = _default_threads() if threads is None else int(threads)
    if _FAST is not None:
        with np.errstate(over="ignore"):  # a crafted step beyond float32 decodes to inf, as in numba
            step32 = float(np.float32(step))
        status = _FAST.decode(words, woff, raw, roff, chunk_units, res, row_cls, pos_cls,
                              lut, freq, recon, unit_len, upr, n_pos, nb_ctx, tcq, step32, n_threads, LANES, SIMD,
                              n_ctx)
    else:
        status = _decode_numba(k, words, woff, raw, roff, chunk_units, res, unit_len, upr, row_cls,
                               pos_cls, n_pos, lut, nb_ctx, tcq, freq, recon, step, n_threads)
    if status != 0:
        raise CorruptFileError("decode_array: damaged entropy-coded data")
    res = res.reshape(shape)
    if dtype != np.float32:
        with np.errstate(over="ignore"):  # crafted values beyond float16 become inf
            return res.astype(dtype)
    return res if out is None else out


def _frequency_rows(side: bytes, sp: int, end: int, n_ctx: int) -> np.ndarray:
    """The frequencies of the numba decoder, uint32[n_ctx, N_TOKENS], from the context records
    side[sp:end] (per context: u8 n_tokens, u16 freq[n_tokens]; they must fill those bytes)."""
    # the records split in Python (cheap), the values joined and placed in one go
    counts, values = [], []
    for _ in range(n_ctx):
        nt = side[sp]  # (IndexError past the end: malformed)
        if nt > N_TOKENS:
            raise CorruptFileError("decode_array: bad table")
        counts.append(nt)
        values.append(side[sp + 1:sp + 1 + 2 * nt])
        sp += 1 + 2 * nt
    if sp != end:
        raise CorruptFileError("decode_array: bad side information length")
    freq = np.zeros((n_ctx, N_TOKENS), np.uint32)
    total = sum(counts)
    if total:
        nts = np.asarray(counts, np.int64)
        first = np.cumsum(nts) - nts  # index of each context's first token among all tokens
        # flat index in freq of every token: its index among all, moved to its context's row
        at = np.arange(total) + np.repeat(np.arange(n_ctx) * N_TOKENS - first, nts)
        freq.reshape(-1)[at] = np.frombuffer(b"".join(values), "<u2")
    if (freq.sum(axis=1) != PROB_SCALE).any():
        raise CorruptFileError("decode_array: bad probability table")
    return freq


def _decode_numba(k, words, woff, raw, roff, chunk_units, res, unit_len, upr, row_cls, pos_cls, n_pos,
                  lut, nb_ctx, tcq, freq, recon, step, threads):
    """The fallback when the C decoder was not built (same output, ~3x slower)."""
    import numba

    cum, sym = _tables(freq)
    with np.errstate(over="ignore"):
        step32 = np.float32(step)
    old = numba.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        return k.decode_chunks(words, woff, raw, roff, chunk_units, res, unit_len, upr, row_cls, pos_cls,
                               n_pos, lut, nb_ctx, tcq, freq, cum, sym, recon, step32)
    finally:
        numba.set_num_threads(old)
