"""Rate-distortion optimised rounding for the graph forms (DequantizeLinear levels).

The `.onnxz` pack entropy-codes each integer tensor with a static order-0 coder, so a level costs
about -log2 p(level) bits under the tensor's own histogram. Rounding to nearest ignores that; here
each weight takes, among floor(y), ceil(y) and the zero level (y = w / scale + zero_point, the
unrounded level), the one minimising

    J = (q - y)**2 + lam * bits(q)        (distortion in squared steps, rate in bits)

with bits() re-estimated from the resulting histogram a few times. Since bits(0) is the smallest,
this includes a dead zone around zero whose width grows with lam, and it also pulls values towards
the frequent small levels. Only which integers are stored changes: the output is still a plain
DequantizeLinear that onnxruntime runs and `fold_dequantize` folds bit-exactly.

The step is searched with the same cost (`round_rows`): each row (channel, block) multiplies its
error-minimising scale by the factor m from a small grid (0.9 .. 2) that minimises its
D + lam * R with nearest levels, before the levels themselves are chosen; lam is counted in
squared *base* steps, so a larger step pays for its larger error. This per-row choice is where
most of the gain is: with one common factor for the whole tensor, rdo levels did no better than
nearest rounding at a larger step (within about 0.5% of the rate at equal SNR on the corpus
tensors); bench/rounding.py compares against that baseline.

With no lam given (`choose`), the largest lam on a grid whose tensor SNR stays within
`max_snr_loss_db` of nearest rounding (or above `target_snr_db`) is used: the smallest rate within
the stated bound. The search runs on a deterministic sample of whole rows (about 32768 weights);
the caller (forms.quantize_linear) applies the choice to the whole tensor, checks the bound there
and tightens it when the sample was optimistic, and keeps nearest rounding when rdo would not
shrink the tensor.

Distortion counts in each row's own steps by default (every channel / block loses about the same
share of its precision; "relative"), or in weight units ("absolute": the tensor SNR itself).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError
from .report import TensorChange

ROUNDINGS = ("nearest", "rdo")
DISTORTIONS = ("relative", "absolute")
LEVEL_MODES = ("nearest", "rdo")
DEFAULT_MAX_SNR_LOSS_DB = 0.5
# lam grid (squared base steps per bit); 2 ln2 / 12 = 0.116 is the high-rate slope of uniform
# quantization, so the grid spans well below and above it
_LAMBDAS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11, 0.12, 0.13, 0.14, 0.15, 0.17,
            0.19, 0.21, 0.24, 0.28, 0.33, 0.4, 0.5, 0.65, 0.8, 1.0, 1.3, 1.6, 2.0)
# step factors each row chooses from (times its error-minimising scale)
_STEP_SCALES = (0.9, 0.95, 1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.13, 1.16, 1.2, 1.25, 1.3, 1.4, 1.5, 1.65, 1.8, 2.0)
_SAMPLE = 1 << 15  # weights the search looks at
_ITERS = 2  # histogram re-estimations on the sample
_SMOOTH = 0.5  # added to every level count: unused levels get a finite, high cost


@dataclass(frozen=True)
class Rounding:
    """How levels are chosen. mode "nearest" (default) or "rdo"; for "rdo": rd_lambda (fixed, in
    squared quantization steps per bit) or None to pick it per tensor under the SNR bound
    (max_snr_loss_db below nearest rounding, or target_snr_db); step_scale fixes the factor on
    the scales instead of searching it; distortion "relative" counts each row's (channel's,
    block's) error in its own steps, "absolute" in weight units (the tensor SNR)."""

    mode: str = "nearest"
    rd_lambda: float | None = None
    max_snr_loss_db: float = DEFAULT_MAX_SNR_LOSS_DB
    target_snr_db: float | None = None
    step_scale: float | None = None
    distortion: str = "relative"
    levels: str = "nearest"  # per weight: "nearest" at the row's step, or "rdo" (dead zone, frequent levels)

    @property
    def rdo(self) -> bool:
        return self.mode == "rdo"

    def floor_db(self, snr_nearest_db: float) -> float:
        """The lowest tensor SNR allowed (constraint mode)."""
        if self.target_snr_db is not None:
            return self.target_snr_db
        return snr_nearest_db - self.max_snr_loss_db

    def tightened(self, db: float) -> "Rounding":
        """The same bound, `db` stricter (after the full tensor fell short of the sample's estimate)."""
        if self.target_snr_db is not None:
            return dataclasses.replace(self, target_snr_db=self.target_snr_db + db)
        return dataclasses.replace(self, max_snr_loss_db=max(0.0, self.max_snr_loss_db - db))

    def describe(self) -> str:
        if not self.rdo:
            return "nearest"
        if self.rd_lambda is not None:
            how = f"lambda={self.rd_lambda:g}"
        elif self.target_snr_db is not None:
            how = f"snr>={self.target_snr_db:g}dB"
        else:
            how = f"snr loss<={self.max_snr_loss_db:g}dB"
        if self.step_scale is not None:
            how += f",step x{self.step_scale:g}"
        if self.distortion != "relative":
            how += f",{self.distortion}"
        if self.levels != "nearest":
            how += f",levels={self.levels}"
        return f"rdo({how})"


def _number(value, what: str, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise InvalidArgumentError(f"{what} must be a finite number {'>' if positive else '>='} 0, got {value!r}")
    return v


def options(rounding="nearest", rd_lambda=None, rd_max_snr_loss_db=None, rd_target_snr_db=None,
            rd_step_scale=None, rd_distortion=None, rd_levels=None) -> Rounding:
    """Checked Rounding from the keyword arguments of quantize_weights (clear errors on bad ones)."""
    if isinstance(rounding, Rounding):
        return rounding
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise InvalidArgumentError(f"rounding must be 'nearest' or 'rdo', got {rounding!r}")
    given = [n for n, v in (("rd_lambda", rd_lambda), ("rd_max_snr_loss_db", rd_max_snr_loss_db),
                            ("rd_target_snr_db", rd_target_snr_db)) if v is not None]
    if rounding == "nearest":
        extra = given + [n for n, v in (("rd_step_scale", rd_step_scale), ("rd_distortion", rd_distortion),
                                        ("rd_levels", rd_levels)) if v is not None]
        if extra:
            raise InvalidArgumentError(f"{extra[0]} is only used with rounding='rdo'")
        return Rounding()
    if len(given) > 1:
        raise InvalidArgumentError(f"give at most one of rd_lambda, rd_max_snr_loss_db, rd_target_snr_db (got {', '.join(given)})")
    step = None
    if rd_step_scale is not None:
        step = _number(rd_step_scale, "rd_step_scale", positive=True)
        if not 0.25 <= step <= 16:
            raise InvalidArgumentError(f"rd_step_scale must be between 0.25 and 16, got {rd_step_scale!r}")
    lam = None if rd_lambda is None else _number(rd_lambda, "rd_lambda", positive=False)
    loss = DEFAULT_MAX_SNR_LOSS_DB if rd_max_snr_loss_db is None else _number(rd_max_snr_loss_db, "rd_max_snr_loss_db", positive=False)
    target = None
    if rd_target_snr_db is not None:
        if isinstance(rd_target_snr_db, bool) or not isinstance(rd_target_snr_db, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(rd_target_snr_db)):
            raise InvalidArgumentError(f"rd_target_snr_db must be a finite number (dB), got {rd_target_snr_db!r}")
        target = float(rd_target_snr_db)
    distortion = "relative" if rd_distortion is None else rd_distortion
    if distortion not in DISTORTIONS:
        raise InvalidArgumentError(f"rd_distortion must be 'relative' or 'absolute', got {rd_distortion!r}")
    level_mode = "nearest" if rd_levels is None else rd_levels
    if level_mode not in LEVEL_MODES:
        raise InvalidArgumentError(f"rd_levels must be 'nearest' or 'rdo', got {rd_levels!r}")
    return Rounding("rdo", lam, loss, target, step, distortion, level_mode)


# ---------------------------------------------------------------------------------------------
# the rounding itself

def level_bits(counts: np.ndarray) -> np.ndarray:
    """Code length in bits of each level under an order-0 model of these counts (smoothed)."""
    c = counts.astype(np.float64) + _SMOOTH
    return (-np.log2(c / c.sum())).astype(np.float32)


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram: what a static entropy coder (rANS, or
    Huffman within a few %) spends per weight, tables aside."""
    n = counts.sum()
    if n == 0:
        return 0.0
    p = counts[counts > 0].astype(np.float64) / n
    return float(-(p * np.log2(p)).sum())


def rdo_levels(y: np.ndarray, qmin: int, qmax: int, zero, lam, bits: np.ndarray, origin=None) -> np.ndarray:
    """Per element of `y` (unrounded levels, zero point included), the level among floor(y),
    floor(y) + 1 (both clipped to [qmin, qmax]) and `zero` (scalar or broadcastable array) that
    minimises (q - y)**2 + lam * bits[q - origin]; lam and origin scalars or broadcastable (per
    row); origin defaults to qmin (see rate_origin). float32 result, whole numbers."""
    lo32, hi32 = np.float32(qmin), np.float32(qmax)
    org = lo32 if origin is None else np.asarray(origin, dtype=np.float32)
    a = np.floor(y)
    np.clip(a, lo32, hi32, out=a)
    b = np.minimum(a + np.float32(1), hi32)
    lam32 = np.asarray(lam, dtype=np.float32)
    ja = np.subtract(a, y)
    ja *= ja
    ja += lam32 * bits[(a - org).astype(np.intp)]
    jb = np.subtract(b, y)
    jb *= jb
    jb += lam32 * bits[(b - org).astype(np.intp)]
    q = np.where(jb < ja, b, a)
    np.minimum(ja, jb, out=ja)
    z = np.broadcast_to(np.asarray(zero, dtype=np.float32), y.shape)
    jz = np.subtract(z, y)
    jz *= jz
    jz += lam32 * bits[(z - org).astype(np.intp)]
    np.copyto(q, z, where=jz < ja)
    return q


def counts_of(q: np.ndarray, origin, size: int) -> np.ndarray:
    """Histogram of q - origin over `size` bins (origin a scalar or broadcastable per row)."""
    return np.bincount((q - np.asarray(origin, dtype=np.float32)).ravel().astype(np.intp), minlength=size)[:size]


def rate_table_size(qmin: int, qmax: int, asymmetric: bool) -> int:
    """Bins of the rate model: the levels when symmetric; the level minus its row's zero point
    when asymmetric (a larger step moves the zero point, and the shape of the distribution around
    it is what the step does not change), -(n-1)..n-1."""
    n = qmax - qmin + 1
    return 2 * n - 1 if asymmetric else n


def rate_origin(zps, qmin: int, qmax: int):
    """The level that falls in bin 0 of the rate model: qmin, or per row zero point - (n - 1)."""
    if zps is None:
        return np.float32(qmin)
    return (zps - np.float32(qmax - qmin)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# per-row steps and rounding for one lam

def row_weights(scales: np.ndarray, distortion: str) -> np.ndarray | None:
    """Per row, what one squared step of its error counts for: None (1 each) when relative; the
    squared scale over the mean squared scale when absolute (weight units, i.e. the tensor SNR)."""
    if distortion == "relative":
        return None
    s2 = scales.astype(np.float64) ** 2
    ref = float(s2.mean())
    return (s2 / ref).astype(np.float32) if ref > 0 else None


def shifted_zero(zps: np.ndarray, m, qmin: int, qmax: int) -> np.ndarray:
    """Zero points for scales times m: the real-valued offset z / m, rounded and kept in range."""
    return np.clip(np.rint(zps / np.asarray(m, dtype=np.float32)), qmin, qmax).astype(np.float32)


def _capped(lam, weights: np.ndarray) -> np.ndarray:
    """lam / weight per row, capped: an all-zero row's weight is ~0 (its levels are 0 anyway)."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.minimum(np.float32(lam) / weights, np.float32(1e6)).astype(np.float32)


def round_rows(rows: np.ndarray, scales: np.ndarray, zps: np.ndarray | None, weights: np.ndarray | None,
               qmin: int, qmax: int, lam: float, bits: np.ndarray, steps,
               level_rdo: bool = False, row_steps: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass of rate-distortion quantization over a chunk of rows (float32, (g, n)).

    Each row first takes the step factor m from `steps` minimising its
        sum (q - y)**2 * m**2 * weight + lam * sum bits[q]      (q nearest at that step)
    -- the scale search with the rate in it (with `row_steps`, `steps` already holds each row's
    factor) -- then each weight its nearest level at that step,
    or with `level_rdo` the level minimising the same cost (rdo_levels). Returns (m per row
    float32, levels float32, unrounded levels float32).
    """
    steps = np.asarray(steps, dtype=np.float32)
    lo32, hi32 = np.float32(qmin), np.float32(qmax)
    u = rows / scales[:, None]
    if steps.ndim == 1 and len(steps) == rows.shape[0] and row_steps:
        m = steps  # chosen beforehand, one per row
    elif len(steps) == 1:
        m = np.full(rows.shape[0], steps[0], dtype=np.float32)
    else:
        lam_r = np.float32(lam) if weights is None else _capped(np.float32(lam), weights)
        best = np.full(rows.shape[0], np.inf, dtype=np.float64)
        m = np.ones(rows.shape[0], dtype=np.float32)
        y = np.empty_like(u)
        for g in steps:
            np.multiply(u, np.float32(1) / g, out=y)
            origin = lo32
            if zps is not None:
                zg = shifted_zero(zps, g, qmin, qmax)
                y += zg[:, None]
                origin = rate_origin(zg, qmin, qmax)[:, None]
            q = np.clip(np.rint(y), lo32, hi32)
            rate = bits[(q - origin).astype(np.intp)].sum(axis=1, dtype=np.float64)
            q -= y
            dist = np.einsum("ij,ij->i", q, q).astype(np.float64) * float(g) ** 2
            j = dist + lam_r * rate
            better = j < best
            best = np.where(better, j, best)
            m = np.where(better, g, m)
    z = None if zps is None else shifted_zero(zps, m, qmin, qmax)
    y = u / m[:, None]
    if z is not None:
        y += z[:, None]
    if not level_rdo:
        return m, np.clip(np.rint(y), lo32, hi32), y
    lam_q = lam / (m * m) if weights is None else _capped(lam / (m * m), weights)
    origin = None if z is None else rate_origin(z, qmin, qmax)[:, None]
    q = rdo_levels(y, qmin, qmax, 0.0 if z is None else z[:, None], lam_q[:, None], bits, origin)
    return m, q, y


# ---------------------------------------------------------------------------------------------
# choosing lam on a sample

@dataclass
class Choice:
    """What `choose` picked for one tensor (estimates on its sample)."""

    rd_lambda: float  # in squared base steps per bit; 0: plain nearest rounding
    bits: np.ndarray  # per-level code lengths to start the full-tensor rounding from
    steps: tuple  # step factors the rows choose from
    snr_nearest_db: float = math.nan
    snr_db: float = math.nan
    rate_nearest: float = math.nan  # order-0 bits per weight
    rate: float = math.nan
    level_rdo: bool = False  # levels chosen by rdo_levels (else nearest at each row's step)
    row_steps: np.ndarray | None = None  # each row's factor, when the sample held every row

    @property
    def is_nearest(self) -> bool:
        return self.rd_lambda == 0 and self.steps == (1.0,)


class _Sample:
    """Whole rows taken at a regular stride (each row's step is chosen on all its weights), or,
    for rows longer than the sample, a strided part of every other row."""

    def __init__(self, rows, scales, zps, weights, qmin: int, qmax: int, level_rdo: bool):
        g, n = rows.shape
        if n <= _SAMPLE // 2:
            r = np.arange(0, g, max(1, (g * n) // _SAMPLE))
            self.rows = rows[r]
        else:
            r = np.arange(0, g, max(1, g // 2))
            self.rows = np.ascontiguousarray(rows[r, :: -(-n // (_SAMPLE // 2))])  # no copy of whole rows
        self.all_rows = len(r) == g and n > _SAMPLE // 2
        self.s = scales[r]
        self.z = None if zps is None else zps[r]
        self.v = None if weights is None else weights[r]
        self.signal = float(np.einsum("ij,ij->", self.rows, self.rows, dtype=np.float64))
        self.qmin, self.qmax, self.level_rdo = qmin, qmax, level_rdo
        self.n_bins = rate_table_size(qmin, qmax, zps is not None)
        q = np.clip(np.rint(self.rows / self.s[:, None] + (0 if self.z is None else self.z[:, None])), qmin, qmax)
        self.nearest = self._measure(0.0, (1.0,), np.ones(len(r), np.float32), q, None)
        self._seen: dict = {}

    def _measure(self, lam, steps, m, q, z) -> Choice:
        counts = self._counts(q, z)
        s = (self.s * m).astype(np.float64)[:, None]
        zz = 0 if self.z is None else (self.z if z is None else z)[:, None]
        err = (q - zz) * s - self.rows
        noise = float(np.einsum("ij,ij->", err, err, dtype=np.float64))
        snr = 200.0 if noise == 0 else 10 * math.log10(self.signal / noise) if self.signal > 0 else -200.0
        return Choice(lam, level_bits(counts), tuple(steps), snr_db=snr, rate=entropy_bits(counts),
                      level_rdo=self.level_rdo)

    def _counts(self, q, z) -> np.ndarray:
        """Rate-model histogram of levels q whose rows have zero points z (None: the original)."""
        if self.z is None:
            return counts_of(q, self.qmin, self.n_bins)
        return counts_of(q, rate_origin(self.z if z is None else z, self.qmin, self.qmax)[:, None], self.n_bins)

    def evaluate(self, lam: float, steps) -> Choice:
        key = (lam, tuple(steps))
        if key not in self._seen:
            bits = self.nearest.bits
            for _ in range(_ITERS):
                m, q, _ = round_rows(self.rows, self.s, self.z, self.v, self.qmin, self.qmax, lam, bits, steps,
                                     self.level_rdo)
                z = None if self.z is None else shifted_zero(self.z, m, self.qmin, self.qmax)
                bits = level_bits(self._counts(q, z))
            z = None if self.z is None else shifted_zero(self.z, m, self.qmin, self.qmax)
            c = self._measure(lam, steps, m, q, z)
            if self.all_rows and len(steps) > 1:
                # long rows, all in the sample: their factors are chosen already (a large
                # per-tensor row would otherwise be searched again over the whole grid)
                c.row_steps = m
            self._seen[key] = c
        return self._seen[key]


def choose(rows: np.ndarray, scales: np.ndarray, zps: np.ndarray | None, qmin: int, qmax: int,
           opts: Rounding, weights: np.ndarray | None = None) -> Choice:
    """lam (and the step factors offered to the rows) for one tensor: rows (groups, members)
    float32 with their error-minimising scales (float32 per row), zero points (float32 per row,
    or None) and row_weights()."""
    sample = _Sample(rows, scales, zps, weights, qmin, qmax, opts.levels == "rdo")
    nearest = sample.nearest
    steps = _STEP_SCALES if opts.step_scale is None else (opts.step_scale,)

    def done(c: Choice) -> Choice:
        c.snr_nearest_db, c.rate_nearest = nearest.snr_db, nearest.rate
        return c

    if sample.signal == 0 or nearest.snr_db >= 200:
        return done(nearest)
    if opts.rd_lambda is not None:
        if opts.rd_lambda == 0 and opts.step_scale is None:
            return done(nearest)
        return done(sample.evaluate(opts.rd_lambda, steps))
    floor_db = opts.floor_db(nearest.snr_db)
    lams = (0.0,) + _LAMBDAS
    # largest feasible lam (SNR falls as lam grows): bisection over the grid
    lo, hi = 0, len(lams)
    if opts.step_scale is not None and sample.evaluate(0.0, steps).snr_db < floor_db:
        return done(sample.evaluate(0.0, steps))  # a fixed step that cannot meet the bound
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sample.evaluate(lams[mid], steps).snr_db >= floor_db:
            lo = mid
        else:
            hi = mid
    picked = sample.evaluate(lams[lo], steps)
    if opts.step_scale is None and (lo == 0 or picked.rate >= nearest.rate):
        return done(nearest)  # the point is a smaller file
    return done(picked)


# ---------------------------------------------------------------------------------------------
# what the report says per tensor

@dataclass
class QuantizedChange(TensorChange):
    """A quantized weight in the report: TensorChange plus the rounding used and the order-0
    estimate of its integers' packed size (bits per weight; the pack's coder spends about that)."""

    rounding: str = "nearest"
    packed_bits_per_weight: float | None = None
    rd_lambda: float | None = None
    step_scale: float | None = None
