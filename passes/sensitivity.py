"""Per-tensor sensitivity and mixed-precision allocation.

For every weight the quantize pass would touch, and every candidate form (n-bit uniform levels
per channel, or kept float), this module measures
  - rate: the bytes the form costs after packing, estimated as the order-0 entropy of its levels
    plus its scales (the pack stage codes integer levels close to that), and
  - distortion: the output error it causes alone, on the feeds.
Output error is measured directly for one reference form per tensor (its dequantized weight fed
into one onnxruntime session in which the weights are overridable inputs) and carried to the
other forms in proportion to their weight noise energy (output noise from small independent
weight perturbations grows linearly with their energy).

allocate() then picks one form per tensor minimising rate + mu * distortion; the caller searches
mu for the smallest model that meets its fidelity target.
"""
from __future__ import annotations

import glob
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from . import forms, graph
from .errors import InvalidArgumentError
from .report import Report
from .rounding import entropy_bits

FLOAT = 0  # "bits" value meaning: the weight stays float


@dataclass
class TensorOption:
    bits: int  # FLOAT (0) for kept float
    rate_bytes: float  # estimated packed bytes
    noise: float  # weight error energy sum (w - w_hat)^2
    snr_db: float | None
    dequantized: np.ndarray | None = field(default=None, repr=False)
    levels_entropy_bytes: float = 0.0  # part of rate_bytes spent on the levels
    rounding: str = "nearest"  # or "gptq"
    plain_noise: float | None = None  # gptq: the noise energy of nearest rounding at the same width
    # cross-validated error feedback: per fold of the feeds, the weight fitted on the other folds'
    # activations (what a trial feeds for that fold's feeds: never levels fitted on the feed judged)
    cv_dequantized: tuple | None = field(default=None, repr=False)
    # bias correction (passes.bias_correction): what the weight's bias gains with this form, E[x] @ (W - W_hat)
    bias_shift: np.ndarray | None = field(default=None, repr=False)
    # what the trials feed where it is not the built weight (seen_row_surrogate: a table whose rows the
    # calibration mostly never gathers); None: `dequantized`
    trial_dequantized: np.ndarray | None = field(default=None, repr=False)


@dataclass
class TensorInfo:
    name: str
    shape: tuple
    energy: float  # sum w^2
    options: dict[int, TensorOption]
    out_error: dict[int, float] = field(default_factory=dict)  # measured, per bits
    sensitivity: float = 0.0  # output error per unit of weight noise energy (nearest rounding)
    gptq_gain: float = 1.0  # output error of error-feedback rounding / that of nearest, as measured
    bias: str | None = None  # the bias initializer a quantized form's bias_shift is added to
    bias_base: np.ndarray | None = field(default=None, repr=False)  # its float value (in its own dtype)
    # the runtime's extra error once this weight is quantized at any width (onnxruntime runs its
    # DequantizeLinear+MatMul as MatMulNBits with int8 activations): the switch input of the
    # trial model that emulates it (with_act_quant), and the output error it causes alone
    act_switch: str | None = None
    act_error: float = 0.0
    # held-out / calibration error of this weight's error-fed levels (fit_optimism): they are fitted to the
    # calibration activations and measured on them, where they look better than they are on other inputs
    fit_optimism: float = 1.0

    def error(self, bits: int) -> float:
        """The output error expected on held-out inputs (error-fed forms charged their fit_optimism)."""
        if bits == FLOAT:
            return self.out_error.get(FLOAT, 0.0)
        e = self._weight_error(bits)
        if self.options[bits].rounding == "gptq":
            e *= self.fit_optimism
        return e + self.act_error

    def calibration_error(self, bits: int) -> float:
        """The output error on the calibration feeds, as the trials measure it."""
        if bits == FLOAT:
            return self.out_error.get(FLOAT, 0.0)
        return self._weight_error(bits) + self.act_error

    def _weight_error(self, bits: int) -> float:
        if bits in self.out_error:
            return self.out_error[bits]
        opt = self.options[bits]
        if opt.rounding == "gptq" and opt.plain_noise is not None:
            # error feedback shapes its noise away from what the inputs excite: its weight noise is
            # larger but harms less; carried over from the measured gain at the reference width
            return self.sensitivity * opt.plain_noise * self.gptq_gain
        return self.sensitivity * opt.noise


def entropy_bytes(levels: np.ndarray) -> float:
    """Order-0 entropy of integer levels, in bytes."""
    if levels.size == 0:
        return 0.0
    _, counts = np.unique(levels.astype(np.int64).ravel(), return_counts=True)
    return entropy_bits(counts) * levels.size / 8


def float_pack_bytes(arr: np.ndarray) -> float:
    """Packed size of a float tensor kept as it is (the lossless pack reaches ~83% on float32
    weights, ~85% on float16; see ANCHORS.md)."""
    return arr.nbytes * (0.83 if arr.dtype == np.float32 else 0.85)


def dequantized_forms(model: onnx.ModelProto, bits_list, *, granularity="channel", block_size=None,
                      exclude=None, min_elements=1024, progress=None, rounding: str = "nearest",
                      scale_mantissa_bits: int | None = None, scale_mantissa_widths=None,
                      scale_bytes=None) -> tuple[dict[str, TensorInfo], dict[int, onnx.ModelProto]]:
    """Quantize the whole model once per bit width and collect, per weight, each form's rate,
    noise and dequantized array. Returns (infos by weight name, quantized model by bits).
    scale_mantissa_bits: quantize_weights' (float32 weights' scales rounded to that many mantissa
    bits) for the widths in scale_mantissa_widths (None: every width). scale_bytes: what a form's scale
    tensor costs packed (array -> bytes; None: its raw bytes)."""
    from .quantize import quantize_weights

    originals = graph.unique_initializers(model)
    infos: dict[str, TensorInfo] = {}
    models = {}
    for done, bits in enumerate(bits_list):
        rep = Report()
        q = quantize_weights(model, bits=bits, granularity=granularity, block_size=block_size,
                             exclude=exclude, min_elements=min_elements, report=rep, rounding=rounding,
                             scale_mantissa_bits=(scale_mantissa_bits if scale_mantissa_widths is None
                                                  or bits in scale_mantissa_widths else None))
        models[bits] = q
        _collect_forms(q, rep, originals, infos, bits, scale_bytes=scale_bytes)
        if progress:
            progress(done + 1, len(bits_list))
    return infos, models


HALF_STEP = 2 ** 0.5  # the step factor of a half-width form: about half a bit less per weight than its width


def half_width(key) -> tuple[int, float | None]:
    """(container width, step factor or None) of a form key: n for n-bit levels, n - 0.5 for n-bit
    levels at HALF_STEP times the n-bit step (half_step_forms); a blocked key (n + BLOCKED_KEY) is
    n-bit levels at their own steps."""
    if float(key).is_integer() or blocked_width(key) is not None:
        return int(math.floor(key)), None
    return int(math.ceil(key)), HALF_STEP


BLOCKED_KEY = 0.25  # form key n + BLOCKED_KEY: n-bit levels with one scale per block (blocked_forms)


def blocked_width(key) -> int | None:
    """n for a blocked form key n + BLOCKED_KEY, else None."""
    k = float(key)
    return int(math.floor(k)) if k - math.floor(k) == BLOCKED_KEY else None


def blocked_weights(model: onnx.ModelProto, infos: dict[str, TensorInfo], names, block: int) -> dict[str, int]:
    """name -> the axis of its K inputs, for the named 2-D float32/float16 weights read by a single
    MatMul (as B) or Gemm (as B, transA 0) whose K is a multiple of `block` and holds 2 blocks at
    least: the weights the blocked form (cast_levels.as_blocked_cast_mul) and blocked error
    feedback (gptq.blocked_levels) take."""
    from . import gptq as gq

    cons = gq.consumers(model, [n for n in names if n in infos])
    out = {}
    for name, (node, _) in cons.items():
        w = infos[name].options[FLOAT].dequantized
        if node.op_type not in ("MatMul", "Gemm") or w.ndim != 2 or w.dtype not in (np.float32, np.float16):
            continue
        axis = 1 if node.op_type == "Gemm" and gq._attr(node, "transB", 0) else 0
        if w.shape[axis] % block == 0 and w.shape[axis] >= 2 * block:
            out[name] = axis
    return out


def blocked_forms(infos: dict[str, TensorInfo], axes: dict[str, int], hessians: dict, bits_list, block: int, *,
                  damp: float | dict, factors: dict, max_noise_gain: float, scale_bytes) -> dict:
    """Adds to infos, for the weights of `axes` (blocked_weights) with a Hessian, the blocked forms
    n + BLOCKED_KEY for n in bits_list: n-bit levels in blocks of `block` along the K inputs
    (forms.quantize_blocks), error-fed (gptq.blocked_levels, damping `damp`; nearest rounding
    where error feedback's weight noise exceeds max_noise_gain x nearest's; a dict: name -> damp,
    gptq.DAMP for names it lacks). Rate: the levels'
    order-0 entropy plus scale_bytes(scale), the scales' packed bytes. factors: inverse Hessian
    factors shared with gptq.refine (same keys). Returns key -> name -> (levels, scale, axis, block),
    what cast_levels.as_blocked_cast_mul writes."""
    from . import forms
    from . import gptq as gq

    out: dict = {}
    for name, axis in axes.items():
        h = hessians.get(name)
        if h is None:
            continue
        info = infos[name]
        w = info.options[FLOAT].dequantized
        if h.shape != (w.shape[axis],) * 2:
            continue
        d = damp.get(name, gq.DAMP) if isinstance(damp, dict) else damp
        key_f = name if d == gq.DAMP else (name, False, float(d))
        if key_f not in factors:
            factors[key_f] = gq.inverse_factor(h, d)
        w64 = w.astype(np.float64)
        for bits in bits_list:
            qz = forms.quantize_blocks(w, bits, axis, block)
            fed = gq.blocked_levels(w, h, qz.scale, axis, block, bits, damp=d, factor=factors[key_f])
            deq = forms.dequantize_blocks(fed.astype(np.int8), qz.scale, axis, block)
            noise = float(np.sum((w64 - deq.astype(np.float64)) ** 2))
            levels, rounding, plain = fed, "gptq", qz.noise
            if noise > max_noise_gain * qz.noise:
                levels, deq, noise, rounding, plain = qz.q, forms.dequantize_blocks(qz.q, qz.scale, axis, block), qz.noise, "nearest", None
            lev_bytes = entropy_bytes(levels)
            snr = 200.0 if noise == 0 else round(10 * math.log10(info.energy / noise), 3) if info.energy > 0 else -200.0
            key = bits + BLOCKED_KEY
            info.options[key] = TensorOption(key, lev_bytes + scale_bytes(qz.scale), noise, snr, deq, lev_bytes,
                                             rounding, plain)
            out.setdefault(key, {})[name] = (levels.astype(np.int8), qz.scale, axis, block)
    return out


ONE_STEP_SAMPLE = 1 << 20  # weights sampled to find a one-step form's rate (entropy to ~0.01 bit)


def one_step_levels(w: np.ndarray, step: float, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(int8 levels, per-channel scales along `axis` in w's dtype) of w quantized with one step for
    every channel, widened only where a channel's largest value would not fit int8 at it:
    scale_c = max(step, max|w_c| / 127). The scales are a plain per-channel DequantizeLinear's."""
    scale = np.maximum(float(step), _channel_absmax(w, axis) / 127.0).astype(w.dtype)
    s = scale.astype(np.float64).reshape(_channel_shape(w, axis))
    levels = np.clip(np.rint(w.astype(np.float64) / s), -127, 127).astype(np.int8)
    return levels, scale


def _channel_absmax(w: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(w, axis, 0)
    return np.abs(moved.reshape(moved.shape[0], -1).astype(np.float64)).max(axis=1)


def _channel_shape(w: np.ndarray, axis: int) -> list[int]:
    shape = [1] * w.ndim
    shape[axis] = -1
    return shape


def _one_step_for_rate(w: np.ndarray, axis: int, bits: float, rng) -> float:
    """The step at which one_step_levels' levels of w have about `bits` of order-0 entropy per
    weight (bisection in log space, on a sample of the weights)."""
    moved = np.moveaxis(w, axis, 0)
    flat = moved.reshape(moved.shape[0], -1).astype(np.float64)
    floor = np.abs(flat).max(axis=1) / 127.0
    idx = rng.choice(flat.size, size=min(flat.size, ONE_STEP_SAMPLE), replace=False)
    vals, floors = flat.reshape(-1)[idx], floor[idx // flat.shape[1]]

    def rate(step):
        q = np.clip(np.rint(vals / np.maximum(step, floors)), -127, 127).astype(np.int64) + 127
        return entropy_bits(np.bincount(q, minlength=255))

    lo, hi = float(np.abs(flat).max()) / 1e6, float(np.abs(flat).max())  # rate(lo) high, rate(hi) ~0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if rate(mid) > bits:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return hi


def one_step_forms(infos: dict[str, TensorInfo], axes: dict[str, int], *, scale_bytes,
                   row_counts: dict | None = None) -> dict:
    """Replaces, for the weights of `axes` (name -> channel axis), every quantized form with one of
    about the same rate whose channels share one step (one_step_levels) instead of a step per
    channel from the channel's largest value. Why: with entropy-coded levels the rate follows the
    step, and a per-channel largest value gives the channels holding an outlier a coarser step than
    the rest; where the channels weigh alike in the output (a word embedding's rows all feed one
    LayerNorm; a MatMul's output columns), one step is the smaller output error at equal rate.
    minilm_fp32, held-out 1 - cosine at equal order-0 entropy, per-channel steps -> one step: the
    word embedding alone at 3.81 bits/weight 4.50e-3 -> 1.21e-3 (per-row RMS-proportional steps
    1.45e-3); the 36 MatMul weights alone, nearest rounding, 5.10 bits/weight 1.54e-2 -> 5.95e-3.
    Keys (and so the order of the forms by rate) stay those of the per-channel forms; the rate is
    the levels' order-0 entropy plus scale_bytes(scales). Returns name -> key -> (levels, scales).

    row_counts: table name -> how often the calibration feeds gather each row (gathered_row_counts).
    Such a table's forms give the gathered rows a step SEEN_ROW_STEP times finer (seen_row_levels),
    and the trials see its error as unseen data would (seen_row_surrogate): why there. minilm_fp32
    (auto mode, calibrated on the first half of the corpus feeds, held-out half): cosine>=0.999
    18.87% -> 18.04% packed, at quantize_dynamic's fidelity 12.68% -> 11.49%."""
    rng = np.random.default_rng(0)
    out: dict = {}
    for name, axis in axes.items():
        info = infos.get(name)
        if info is None or info.energy <= 0:
            continue
        w = info.options[FLOAT].dequantized
        if w.ndim < 2 or w.dtype not in (np.float32, np.float16) or not 0 <= axis < w.ndim:
            continue
        w64 = w.astype(np.float64)
        seen = _seen_rows(row_counts, name, w, axis)
        rates = {key: 8 * opt.levels_entropy_bytes / w.size for key, opt in info.options.items()
                 if key != FLOAT and opt.levels_entropy_bytes > 0}
        for key, bits in rates.items():
            step = _one_step_for_rate(w, axis, bits, rng)
            if seen is None:
                levels, scale = one_step_levels(w, step, axis)
            else:
                levels, scale = seen_row_levels(w, step, seen)
            deq = (levels.astype(w.dtype) * scale.reshape(_channel_shape(w, axis))).astype(w.dtype)
            noise = float(np.sum((w64 - deq.astype(np.float64)) ** 2))
            lev_bytes = entropy_bytes(levels)
            snr = 200.0 if noise == 0 else round(10 * math.log10(info.energy / noise), 3)
            trial, charged = None, noise
            if seen is not None:
                trial, charged = seen_row_surrogate(w, step, np.asarray(row_counts[name]) == 1, deq)
            info.options[key] = TensorOption(key, lev_bytes + scale_bytes(scale), charged, snr, deq, lev_bytes,
                                             trial_dequantized=trial)
            out.setdefault(name, {})[key] = (levels, scale)
    return out


SEEN_ROW_STEP = 0.25  # the step of the table rows the calibration feeds gather, relative to the other rows'
# the rows no calibration lookup reached: step x (row norm / geometric mean)**-2 (forms.row_norm_steps;
# None: one step for all). Why: a trained row's norm tracks how often it was trained on, which is how
# often text looks it up. minilm_fp32 through the auto search (bench/auto_split.py, on the fit-optimism
# search): first split 18.07% -> 17.73%, second 17.56% -> 17.37%, held out met (cosine 0.99949 / 0.99938)
SEEN_ROW_NORM_EXPONENT = 2.0
PAD_ROW_SEEN = True  # row 0 (what zero-padded batches gather: BERT's [PAD]) takes the seen rows' step too. Why:
# batch-1 calibration feeds never gather it, and 37% of the lookups of minilm's held-out half (padded batches) do:
# at the int3 rate the word embedding's error on the held-out lookups (padding included) 14.2 -> 19.7 dB


def _seen_rows(row_counts, name: str, w: np.ndarray, axis: int):
    """The rows (bool per row) the calibration gathers of table `name`, or None where it has no
    usable counts (none given, not rows on axis 0, wrong length, nothing gathered) or as many
    lookups as the table has rows (a position or token-type table: the calibration covers the rows
    in use, and a row it misses, a position past its longest input, is not rarer for that)."""
    counts = (row_counts or {}).get(name)
    if counts is None or axis != 0 or np.shape(counts) != (w.shape[0],) or not 0 < np.sum(counts) < w.shape[0]:
        return None
    seen = np.asarray(counts) > 0
    if PAD_ROW_SEEN:
        seen[0] = True
    return seen


def seen_row_levels(w: np.ndarray, step: float, seen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """one_step_levels of a table (rows on axis 0) whose `seen` rows take SEEN_ROW_STEP x step (each
    row's step still widened where its largest value would not fit int8). Why: a word embedding's
    lookups follow Zipf's law, so the few hundred rows a calibration set gathers are much of what
    unseen text gathers too (minilm: 351 of 30522 rows, 66% of the held-out half's real tokens); a
    finer step there costs 2 bits a weight on ~1% of the rows and takes most of the table's error."""
    unseen = float(step) * forms.row_norm_steps(w, SEEN_ROW_NORM_EXPONENT) if SEEN_ROW_NORM_EXPONENT else float(step)
    steps = np.where(seen, SEEN_ROW_STEP * float(step), unseen)
    scale = np.maximum(steps, _channel_absmax(w, 0) / 127.0).astype(w.dtype)
    s = scale.astype(np.float64).reshape(_channel_shape(w, 0))
    levels = np.clip(np.rint(w.astype(np.float64) / s), -127, 127).astype(np.int8)
    return levels, scale


def seen_row_surrogate(w: np.ndarray, step: float, once: np.ndarray, deq: np.ndarray):
    """(table the trials feed, noise energy charged) for a seen_row_levels form (`deq`: the built
    table). The trials run the calibration feeds, which gather only the seen rows: fed the built
    table they would measure the fine rows' error alone, and the search would coarsen the other
    rows unchecked (99% of minilm's word embedding, a third of unseen text's lookups). So the
    trials see the table as a lookup of unseen data does, by leaving each lookup out: the rows the
    calibration gathers `once` (True per row) take the error they would have unseen (the coarse
    step), the others their own. The share of such lookups is the Good-Turing estimate of unseen
    data's lookups on rows the calibration never gathered (N1 / N of the calibration lookups), and they are rare words, as
    those lookups are. Why not every seen row with the average error (sqrt(p) x coarse + sqrt(1 - p) x
    fine, 925dd08): the model's output errs more for a rare token's error than for a frequent one's
    ([CLS], [SEP], punctuation). minilm_fp32's word embedding alone, one step, 1 - cosine on the
    calibration half (built table / average surrogate / leave-one-out) and on the held-out half
    (built table, all / unpadded feeds): at 2.57 bits/weight 4.4e-4 / 2.22e-3 / 3.86e-3, held out
    4.09e-3 / 4.18e-3; at 4.45 bits 4.0e-5 / 1.80e-4 / 2.99e-4, held out 3.06e-4 / 3.05e-4. The
    noise charged is that table's, so every width of the table is charged alike."""
    # the once-gathered rows take the step they would have had unseen (their row-norm step)
    coarse_levels, coarse_scale = seen_row_levels(w, step, np.zeros(w.shape[0], bool))
    coarse = (coarse_levels.astype(w.dtype) * coarse_scale[:, None]).astype(w.dtype)
    trial = np.where(np.asarray(once)[:, None], coarse, deq).astype(w.dtype)
    return trial, float(np.sum((w.astype(np.float64) - trial.astype(np.float64)) ** 2))


def gathered_row_counts(model: onnx.ModelProto, feeds, tables) -> dict[str, np.ndarray]:
    """table name -> how many times the feeds gather each of its rows (main-graph Gather along axis
    0; the indices read from the feeds where they are a graph input, else from one run of the model
    that also outputs them). Tables also read along another axis, or whose indices cannot be had,
    are left out."""
    wanted = set(tables)
    index_of: dict[str, list[str]] = {}
    other_axis = set()
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in wanted:
            continue
        if next((a.i for a in node.attribute if a.name == "axis"), 0) != 0:
            other_axis.add(node.input[0])
        index_of.setdefault(node.input[0], []).append(node.input[1])
    index_of = {t: ix for t, ix in index_of.items() if t not in other_axis}
    inputs = {i.name for i in model.graph.input}
    computed = sorted({x for ix in index_of.values() for x in ix if x not in inputs})
    runs = [{} for _ in feeds]
    if computed:
        try:
            runs = _run_for(model, computed, feeds)
        except Exception:  # onnxruntime cannot output them: those tables get no row counts (plain forms)
            index_of = {t: ix for t, ix in index_of.items() if all(x in inputs for x in ix)}
    rows = {t.name: int(t.dims[0]) for t in model.graph.initializer if t.name in index_of and t.dims}
    out = {}
    for table, ixs in index_of.items():
        n = rows.get(table, 0)
        if n <= 0:
            continue
        counts = np.zeros(n, np.int64)
        for f, r in zip(feeds, runs):
            for x in ixs:
                idx = f.get(x) if x in inputs else r.get(x)
                if idx is not None:
                    counts += _row_histogram(idx, n)
        out[table] = counts
    return out


def _row_histogram(idx, n: int) -> np.ndarray:
    """Counts per row of Gather indices (negative ones count from the end, as Gather reads them)."""
    idx = np.asarray(idx).astype(np.int64).ravel()
    idx = np.where(idx < 0, idx + n, idx)
    return np.bincount(idx[(idx >= 0) & (idx < n)], minlength=n)[:n]


def _run_for(model: onnx.ModelProto, names, feeds) -> list[dict]:
    """Per feed, {name: value} of the named intermediate tensors (one onnxruntime session of a copy
    of the model that also outputs them: gptq.activation_session)."""
    from .gptq import activation_session

    sess, allowed = activation_session(model, names)
    return [dict(zip(names, sess.run(list(names), {k: v for k, v in f.items() if k in allowed}))) for f in feeds]


def channel_axes(qmodel: onnx.ModelProto, names) -> dict[str, int]:
    """name -> the channel axis of its per-channel DequantizeLinear in a quantize_weights model
    (main graph; per-tensor, blocked or absent weights left out)."""
    inits = graph.unique_initializers(qmodel)
    want = set(names)
    out = {}
    for node in qmodel.graph.node:
        if node.op_type != "DequantizeLinear" or not node.output or node.output[0] not in want:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        scale = inits.get(node.input[1]) if len(node.input) > 1 else None
        if attrs.get("block_size", 0) or scale is None or len(scale.dims) != 1:
            continue
        out[node.output[0]] = attrs.get("axis", 1)
    return out


def write_one_step_levels(qmodel: onnx.ModelProto, levels_by_name: dict) -> onnx.ModelProto:
    """A copy of a quantize_weights model (the named weights at int8 per channel) whose named
    weights' levels and scales are replaced by one_step_forms' (levels, scales)."""
    from . import gptq as gq

    m = onnx.ModelProto()
    m.CopyFrom(qmodel)
    replace = {}
    for name, (levels, scale) in levels_by_name.items():
        node = gq._dq_node(m, name)
        if node is None or len(node.input) < 2:
            raise InvalidArgumentError(f"{name!r} is not a quantized weight of this model")
        replace[node.input[0]] = levels
        replace[node.input[1]] = scale
    new = []
    for t in m.graph.initializer:
        arr = replace.get(t.name)
        if arr is not None:
            if int(np.prod(t.dims)) != arr.size or t.data_type not in (onnx.TensorProto.INT8, onnx.TensorProto.FLOAT,
                                                                       onnx.TensorProto.FLOAT16):
                raise InvalidArgumentError(f"{t.name!r}: an int8 per-channel form does not fit it ({list(t.dims)})")
            new.append(graph.array_to_tensor(arr.reshape(tuple(t.dims)), t.name, t.data_type))
        else:
            new.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(new)
    return m


def half_step_quantize(model: onnx.ModelProto, key, names, *, min_elements=1024, report=None) -> onnx.ModelProto:
    """The named weights of `model` quantized per channel in the half-width form `key` (n - 0.5):
    n-bit levels at HALF_STEP times the step of n bits, rounded to nearest (rdo with lambda 0 and the
    step fixed: the step factor alone)."""
    from .quantize import quantize_weights

    bits, step = half_width(key)
    return quantize_weights(model, bits=bits, min_elements=min_elements, include=[pattern_for(n) for n in names],
                            rounding="rdo", rd_lambda=0.0, rd_step_scale=step, report=report)


def half_step_forms(model: onnx.ModelProto, infos: dict[str, TensorInfo], bits_list, names, *,
                    min_elements=1024) -> dict[float, onnx.ModelProto]:
    """Adds to infos, for the named weights, the forms between the widths of bits_list: key n - 0.5
    for every n of bits_list above the smallest (half_step_quantize). Returns the models by key.
    Why: with entropy-coded levels the rate follows the step, not the container, and one width
    apart is ~0.95 bits per weight; on a table that is half the model (a word embedding) the
    allocation then lands far from its budget."""
    originals = graph.unique_initializers(model)
    models = {}
    names = [n for n in names if n in infos]
    if not names:
        return models
    for bits in sorted(bits_list)[1:]:
        key = bits - 0.5
        rep = Report()
        q = half_step_quantize(model, key, names, min_elements=min_elements, report=rep)
        models[key] = q
        _collect_forms(q, rep, originals, infos, key, only=set(names))
    return models


def _collect_forms(q: onnx.ModelProto, rep: Report, originals: dict, infos: dict[str, TensorInfo], key,
                   only=None, scale_bytes=None) -> None:
    """infos[name].options[key] for every weight quantize_weights changed in q (report rep);
    scale_bytes: array -> packed bytes of a scale tensor (None: its raw bytes)."""
    from .fold import fold_dequantize

    folded = graph.unique_initializers(fold_dequantize(q))
    q_inits = graph.unique_initializers(q)
    for change in rep.tensors:
        if change.scheme.startswith("kept") or change.location != "initializer":
            continue
        name = change.name
        if only is not None and name not in only:
            continue
        w = graph.tensor_to_array(originals[name]).astype(np.float64)
        w_hat = graph.tensor_to_array(folded[name])
        levels_t = q_inits.get(name + "_quantized")
        scale_t = q_inits.get(name + "_scale")
        if levels_t is None or scale_t is None:
            continue
        levels = graph.tensor_to_array(levels_t)
        lev_bytes = entropy_bytes(levels)
        rate = lev_bytes + (graph.tensor_nbytes(scale_t) if scale_bytes is None
                            else scale_bytes(graph.tensor_to_array(scale_t)))
        noise = float(np.sum((w - w_hat.astype(np.float64)) ** 2))
        info = infos.get(name)
        if info is None:
            arr = graph.tensor_to_array(originals[name])
            info = infos[name] = TensorInfo(name, tuple(w.shape), float(np.sum(w * w)), {})
            info.options[FLOAT] = TensorOption(FLOAT, float_pack_bytes(arr), 0.0, None, arr)
        info.options[key] = TensorOption(key, rate, noise, change.snr_db, w_hat, lev_bytes)


def overridable(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of `model` in which the named initializers are also graph inputs, so that a
    session can be fed other values for them (no re-creation per trial)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if m.ir_version < 4:
        # IR 3 lists every initializer as a graph input, yet onnxruntime refuses a feed for one
        # ("Invalid input name"); from IR 4 an initializer that is also an input is overridable
        m.ir_version = 4
    present = {i.name for i in m.graph.input}
    inits = {t.name: t for t in m.graph.initializer}
    for name in names:
        if name in present or name not in inits:
            continue
        t = inits[name]
        m.graph.input.append(helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    return m


class TrialRunner:
    """One onnxruntime session of the original model with its weights overridable; runs the
    feeds with some weights replaced and returns the outputs."""

    def __init__(self, model: onnx.ModelProto, names, feeds):
        import onnxruntime as ort

        self.names = list(names)
        # (outputs onnxruntime cannot hand to numpy as values end in an exact Cast: graph.numpy_readable_outputs)
        m = graph.numpy_readable_outputs(overridable(model, self.names))
        so = ort.SessionOptions()
        so.log_severity_level = 4
        # the weights change between runs: nothing may be folded into constants
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        self.session = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        allowed = {i.name for i in self.session.get_inputs()}
        self.feeds = [{k: v for k, v in f.items() if k in allowed} for f in feeds]

    def run(self, replaced: dict[str, np.ndarray], per_fold: list[dict] | None = None) -> list[list[np.ndarray]]:
        """per_fold: one more replacement dict per fold; feed i (of the feeds given, in order)
        belongs to fold i % len(per_fold) (interleaved folds, as auto.py splits them)."""
        replaced = ort_feeds(replaced)
        if not per_fold:
            return [self.session.run(None, {**f, **replaced}) for f in self.feeds]
        per_fold = [ort_feeds(p) for p in per_fold]
        k = len(per_fold)
        return [self.session.run(None, {**f, **replaced, **per_fold[i % k]}) for i, f in enumerate(self.feeds)]


# numpy dtypes (ml_dtypes) that onnxruntime's Python binding cannot take as feeds ("Numpy_type 256
# can't be converted to MLDataType"): passed as OrtValues of the onnx type over the same bytes
_ORT_VIEW_TYPES = {"bfloat16": (np.uint16, onnx.TensorProto.BFLOAT16),
                   "float8_e4m3fn": (np.uint8, onnx.TensorProto.FLOAT8E4M3FN),
                   "float8_e4m3fnuz": (np.uint8, onnx.TensorProto.FLOAT8E4M3FNUZ),
                   "float8_e5m2": (np.uint8, onnx.TensorProto.FLOAT8E5M2),
                   "float8_e5m2fnuz": (np.uint8, onnx.TensorProto.FLOAT8E5M2FNUZ)}


def ort_feeds(feeds: dict) -> dict:
    """`feeds` with arrays of the dtypes above as OrtValues (each keeps its array alive: the
    OrtValue does not copy)."""
    out = dict(feeds)
    for name, arr in feeds.items():
        view = _ORT_VIEW_TYPES.get(getattr(getattr(arr, "dtype", None), "name", None))
        if view is not None:
            import onnxruntime as ort

            raw = np.ascontiguousarray(arr).view(view[0])
            out[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, view[1])
            out[name]._surgeon_keepalive = raw
    return out


def replacements(infos: dict[str, "TensorInfo"], choice: dict[str, int], n_folds: int = 1, act: bool = True):
    """(replaced, per_fold) for TrialRunner.run of a plan (weight -> width): cross-validated
    options feed each fold the weight fitted without it. act: a quantized weight also turns its
    runtime activation quantization on (with_act_quant), as the built model will run it."""
    repl, per_fold = {}, [{} for _ in range(n_folds)]
    for n, b in choice.items():
        if b == FLOAT:
            continue
        opt = infos[n].options[b]
        dtype = infos[n].options[FLOAT].dequantized.dtype
        if act and infos[n].act_switch is not None:
            repl[infos[n].act_switch] = np.ones((), dtype)
        extra = bias_feed(infos[n], opt.bias_shift)
        if extra:
            repl.update(extra)
        if opt.cv_dequantized is not None and len(opt.cv_dequantized) == n_folds:
            for f in range(n_folds):
                per_fold[f][n] = opt.cv_dequantized[f].astype(dtype)
        else:
            trial = opt.dequantized if opt.trial_dequantized is None else opt.trial_dequantized
            repl[n] = trial.astype(dtype)
    return repl, (per_fold if any(per_fold) else None)


def bias_feed(info: "TensorInfo", shift) -> dict:
    """{bias name: corrected bias} for a form with a bias shift ({} without one)."""
    if shift is None or info.bias is None or info.bias_base is None:
        return {}
    base = info.bias_base
    return {info.bias: (base.astype(np.float64) + np.asarray(shift, np.float64).reshape(base.shape)).astype(base.dtype)}


def relative_error(ref, cand) -> float:
    """Mean over feeds of ||y - y_hat||^2 / ||y||^2 over the float outputs."""
    vals = []
    for r, c in zip(ref, cand):
        num = den = 0.0
        for a, b in zip(r, c):
            a = np.asarray(a)
            if a.dtype.kind != "f":
                continue
            a64 = a.astype(np.float64)
            num += float(np.sum((a64 - np.asarray(b, np.float64)) ** 2))
            den += float(np.sum(a64 * a64))
        vals.append(num / den if den > 0 else num)
    return float(np.mean(vals)) if vals else 0.0


def measure(infos: dict[str, TensorInfo], runner: TrialRunner, ref, ref_bits: int, progress=None,
            transform=None, plain: dict | None = None, n_folds: int = 1, plain_shift: dict | None = None) -> None:
    """Output error of each tensor alone at `ref_bits`; sets out_error and sensitivity.
    transform: maps a run's outputs to those in which the error is measured (auto.proxy_outputs).
    plain: name -> nearest-rounding dequantized weight at ref_bits, for tensors whose ref_bits
    option is error-feedback rounded: both are measured, the sensitivity comes from the nearest
    one (whose noise is unshaped, like the other widths' without error feedback) and gptq_gain
    from their ratio. n_folds: cross-validated options (cv_dequantized) are measured out of fold.
    plain_shift: name -> the bias shift of the plain form (with bias correction it is measured with it).
    """
    transform = transform or (lambda outs: outs)
    ref = transform(ref)
    plain = plain or {}
    plain_shift = plain_shift or {}
    names = [n for n in runner.names if n in infos and ref_bits in infos[n].options]

    def error_of(name, arr):
        dtype = infos[name].options[FLOAT].dequantized.dtype
        extra = bias_feed(infos[name], plain_shift.get(name))
        return relative_error(ref, transform(runner.run({name: arr.astype(dtype), **extra})))

    for i, name in enumerate(names):
        info = infos[name]
        opt = info.options[ref_bits]
        e = relative_error(ref, transform(runner.run(*replacements(infos, {name: ref_bits}, n_folds, act=False))))
        info.out_error[ref_bits] = e
        info.out_error[FLOAT] = 0.0
        if opt.rounding == "gptq" and name in plain and opt.plain_noise:
            e_plain = error_of(name, plain[name])
            info.sensitivity = e_plain / opt.plain_noise
            info.gptq_gain = e / e_plain if e_plain > 0 else 1.0
        else:
            info.sensitivity = e / opt.noise if opt.noise > 0 else 0.0
        if progress:
            progress(i + 1, len(names))
    for name in names:
        info = infos[name]
        if info.act_switch is not None and info.act_switch in runner.names:
            # the weight kept float with only its activation quantization on: the part of the
            # built model's error that no width of this weight removes
            dtype = info.options[FLOAT].dequantized.dtype
            info.act_error = relative_error(ref, transform(runner.run({info.act_switch: np.ones((), dtype)})))


FIT_OPTIMISM_MAX = 1e6  # fit_optimism's ceiling (finite: the search sums and subtracts errors)


def fit_optimism(deltas, hessians) -> float:
    """How much worse error-fed levels do on inputs they were not fitted to, from two halves of the
    calibration feeds: deltas[i] = W - (levels fitted with hessians[i]), weights as (K inputs, N outputs)
    matrices, hessians[i] = X_i^T X_i / rows of half i. The layer error tr(D^T H D) of each half's levels
    on the other half, over that on its own half; at least 1.
    Why: error feedback cancels rounding errors along the directions the calibration activations take,
    the trials then measure it on the same activations, and the search took that for the held-out
    error. silero_vad_v6 calibrated on the even feeds (12): its int4-6 error-fed Convs measured 2.0-2.6x
    more output error on the odd feeds than on the even ones (nearest rounding of the same weights 1.0-1.7x),
    and the auto model missed cosine>=0.999 held out (0.99864, calibration 0.99949). This ratio for
    those Convs is 1.9-2.1 (the layer error's held-out / calibration ratio over nearest rounding's:
    1.6-1.9); for the Convs whose error-fed levels held (1.0-1.2 at layer level) it is 1.1-1.3.
    Levels fitted on half the rows overfit more than levels fitted on all of them: an upper estimate.
    A delta that does not depend on the data (nearest rounding) gives exactly 1."""
    (d0, d1), (h0, h1) = deltas, hessians
    d0, d1 = np.asarray(d0, np.float64), np.asarray(d1, np.float64)

    def layer_error(d, h):
        return float(np.sum(d * (np.asarray(h, np.float64) @ d)))

    inside = layer_error(d0, h0) + layer_error(d1, h1)
    across = layer_error(d0, h1) + layer_error(d1, h0)
    if not math.isfinite(across) or not math.isfinite(inside) or across <= 0:
        return 1.0
    if inside <= across / FIT_OPTIMISM_MAX:  # (levels that cancel their error on their own rows exactly)
        return FIT_OPTIMISM_MAX
    return max(1.0, across / inside)


HALF_TO_FULL_EXCESS = 0.5  # full_fit_optimism: the share of the halves' excess (factor - 1) the full fit shows


def full_fit_optimism(half_factor: float) -> float:
    """The held-out / calibration error of levels fitted on all the calibration feeds, from fit_optimism's
    factor for levels fitted on half of them: 1 + HALF_TO_FULL_EXCESS x (half_factor - 1).
    Why: the excess is the share of the rounding error the fit cancels only along the directions the
    fitting rows span, ~inputs / rows, and the full fit has twice the rows of either half. Measured per
    error-fed weight (int4; levels fitted on the calibration half, their layer error on the held-out
    half's Hessian over the calibration one, over the same ratio of a data-independent error, trace(H)):
    silero_vad_v6's 3 Convs on four splits (first / second / even / odd), halves 1.94-2.58, this 1.47-1.79,
    held out 1.36-1.89 (median 1.58; 4 of 12 above this, by up to 1.28x: encoder.0 on the even split);
    open_nsfw first split, its 57 Convs + 1 MatMul: the last stage's (1176 rows for 256-2304 inputs)
    halves 2.9-31.8, this 2.0-16.4, held out 1.55-7.7, every one below; the 4704-row stage's halves
    1.2-2.5, held out 0.96-1.35. Levels fitted on 3/4 and measured on the other 1/4 (4 fits, not 2)
    followed the same 1/rows law (silero 1.58-1.82, open_nsfw's last stage 2.2-15.8) and told nothing
    more. At the output it is not enough everywhere: used for every target, silero_vad_v6 calibrated on
    the even feeds missed cosine>=0.999 held out again (0.99864, its error 2.6x the calibration's) and
    grew on the other splits (14.60 / 14.26 / 15.13% -> 15.32 / 15.43 / 15.69%); the auto mode takes it
    for top-1 targets only (auto.TOP1_FULL_FIT_OPTIMISM)."""
    return 1.0 + HALF_TO_FULL_EXCESS * max(0.0, half_factor - 1.0)


def optimism_of_plan(infos: dict[str, TensorInfo], plan: dict[str, int]) -> float:
    """Held-out / calibration output error the plan is expected to show: the weights' predicted
    errors with their fit_optimism over the same without (the weights' errors add up; measured on
    silero_vad_v6: the sum of each weight's error alone 4.8e-4 of 1 - cosine, the plan's 5.1e-4)."""
    held = calib = 0.0
    for n, b in plan.items():
        if b == FLOAT or n not in infos:
            continue
        held += infos[n].error(b)
        calib += infos[n].calibration_error(b)
    return held / calib if calib > 0 and held > calib else 1.0


def allocate(infos: dict[str, TensorInfo], mu: float) -> dict[str, int]:
    """Per tensor, the form minimising rate_bytes + mu * predicted output error."""
    plan = {}
    for name, info in infos.items():
        best = None
        for bits, opt in info.options.items():
            cost = opt.rate_bytes + mu * info.error(bits)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, bits)
        plan[name] = best[1]
    return plan


def plan_rate(infos: dict[str, TensorInfo], plan: dict[str, int]) -> float:
    return sum(infos[n].options[b].rate_bytes for n, b in plan.items())


def pattern_for(name: str) -> str:
    """An include/exclude pattern of quantize_weights matching exactly this weight name."""
    if not name:
        raise InvalidArgumentError("empty weight name")
    return glob.escape(name)


# --------------------------------------------------------------------------------------------
# the runtime's activation quantization
#
# onnxruntime (1.25.0 and later, CPU) fuses DequantizeLinear(int8/int4 weight) + MatMul into MatMulNBits, whose
# default accuracy level 4 quantizes the activations to int8 per block of `block_size` along K
# (scale = block max |a| / 127). The trial session feeds float weights and never sees that error:
# on minilm_fp32 a built plan measured 4.6 dB below its trial (fold: 41.9 dB, as built: 37.9 dB),
# and the search answered by keeping weights float (41.8% packed). The trial model emulates it per
# weight instead, behind a switch the trial turns on for the weights a plan quantizes.

MLAS_INT8_ACCURACY = 4  # MatMulNBits accuracy_level whose compute quantizes the activations to int8


def fused_matmul_blocks(quantized_models, names) -> dict[str, int]:
    """weight name -> activation block size, for the named weights whose DequantizeLinear+MatMul
    onnxruntime's default optimiser turns into MatMulNBits with int8 activations in any of the
    given quantized models (as found in the graph it optimises; nothing on a runtime that fuses
    nothing)."""
    import os
    import tempfile

    import onnxruntime as ort

    wanted = set(names)
    blocks: dict[str, int] = {}
    for qm in quantized_models:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "optimized.onnx")
            so = ort.SessionOptions()
            so.log_severity_level = 4
            so.optimized_model_filepath = path
            try:
                ort.InferenceSession(qm.SerializeToString(), so, providers=["CPUExecutionProvider"])
                optimized = onnx.load(path, load_external_data=False)
            except Exception:  # a model the runtime refuses fuses nothing we could emulate
                continue
        for node in optimized.graph.node:
            if node.op_type != "MatMulNBits" or len(node.input) < 2:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("accuracy_level", 0) != MLAS_INT8_ACCURACY or not attrs.get("block_size"):
                continue
            base = node.input[1]
            for suffix in ("_T", "_quantized"):
                if base.endswith(suffix) and base not in wanted:
                    base = base[: -len(suffix)]
            if base in wanted:
                blocks[base] = int(attrs["block_size"])
    return blocks


def with_act_quant(model: onnx.ModelProto, blocks: dict[str, int]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """(copy of `model` in which the activation input of each MatMul (or Gemm, which the runtime
    makes a MatMul) reading a weight of `blocks` passes through an emulation of the runtime's int8
    block quantization, weight -> its switch).

    A' = A + s * (dequant(quant(A)) - A), with s a scalar initializer (0: A unchanged, the outputs
    are the model's; a trial feeds 1 for the weights its plan quantizes). Only 2-D float weights
    are emulated; a last partial block along K is quantized as its own block (zero padded)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    inits = graph.unique_initializers(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    taken = {t.name for t in m.graph.initializer} | {o for n in m.graph.node for o in n.output} | {
        i.name for i in m.graph.input}
    switches: dict[str, str] = {}
    new_nodes, new_inits = [], []
    fresh = graph.NameAllocator(taken).take
    for node in m.graph.node:
        k = _contraction_length(node, inits, blocks)
        if k is None:
            new_nodes.append(node)
            continue
        wname = node.input[1]
        block = blocks[wname]
        dtype = np.float32 if inits[wname].data_type == 1 else np.float16
        p = fresh(f"{wname}__actq")
        a = node.input[0]
        switch = fresh(f"{wname}__actq_on")
        new_inits.append(onnx.numpy_helper.from_array(np.zeros((), dtype), switch))
        nodes, deq = _block_quant_nodes(a, k, block, dtype, opset, lambda key: fresh(f"{p}_{key}"), new_inits)
        out = {key: fresh(f"{p}_{key}") for key in ("diff", "gated", "a")}
        new_nodes += nodes + [
            helper.make_node("Sub", [deq, a], [out["diff"]]),
            helper.make_node("Mul", [out["diff"], switch], [out["gated"]]),
            helper.make_node("Add", [a, out["gated"]], [out["a"]]),
        ]
        mm = onnx.NodeProto()
        mm.CopyFrom(node)
        mm.input[0] = out["a"]
        new_nodes.append(mm)
        switches[wname] = switch
    if not switches:
        return model, {}
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    m.graph.initializer.extend(new_inits)
    return m, switches


def _contraction_length(node, inits, blocks) -> int | None:
    """K of a MatMul / Gemm (without transA) reading a weight of `blocks` as its B, when the
    emulation applies (2-D float32/float16 weight); else None."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in blocks:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm" and attrs.get("transA", 0):
        return None
    t = inits.get(node.input[1])
    if t is None or len(t.dims) != 2 or t.data_type not in (1, 10):
        return None
    return int(t.dims[1] if attrs.get("transB", 0) else t.dims[0])


def _block_quant_nodes(a: str, k: int, block: int, dtype, opset: int, fresh, new_inits: list):
    """(nodes, output name): `a` ([..., k]) quantized to int8 per block of `block` along its last
    axis (scale = block max |a| / 127, symmetric) and dequantized, in `a`'s shape. fresh(key)
    gives an unused name; constants are appended to new_inits."""
    pad = -k % block
    names = {key: fresh(key) for key in ("shp", "flat", "padded", "blk", "abs", "amax", "scale", "safe", "div", "q",
                                         "deq", "rows", "cut", "back")}

    def const(key, value):
        name = fresh(key)
        new_inits.append(onnx.numpy_helper.from_array(value, name))
        return name

    nodes = [helper.make_node("Shape", [a], [names["shp"]]),
             helper.make_node("Reshape", [a, const("flat_shape", np.array([-1, k], np.int64))], [names["flat"]])]
    padded = names["flat"]
    if pad:
        padded = names["padded"]
        if opset >= 11:
            nodes.append(helper.make_node("Pad", [names["flat"], const("pads", np.array([0, 0, 0, pad], np.int64))],
                                          [padded]))
        else:
            nodes.append(helper.make_node("Pad", [names["flat"]], [padded], pads=[0, 0, 0, pad]))
    nodes += [helper.make_node("Reshape", [padded, const("blk_shape", np.array([-1, (k + pad) // block, block], np.int64))],
                               [names["blk"]]),
              helper.make_node("Abs", [names["blk"]], [names["abs"]])]
    if opset >= 18:
        nodes.append(helper.make_node("ReduceMax", [names["abs"], const("axes", np.array([-1], np.int64))],
                                      [names["amax"]], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMax", [names["abs"]], [names["amax"]], axes=[-1], keepdims=1))
    nodes.append(helper.make_node("Mul", [names["amax"], const("inv127", np.array(1 / 127, dtype))], [names["scale"]]))
    if opset >= 8:
        nodes.append(helper.make_node("Max", [names["scale"], const("tiny", np.array(np.finfo(dtype).tiny, dtype))],
                                      [names["safe"]]))
    else:  # Max broadcasts from opset 8 on; Clip-6's min attribute is the same floor
        nodes.append(helper.make_node("Clip", [names["scale"]], [names["safe"]], min=float(np.finfo(dtype).tiny)))
    nodes.append(helper.make_node("Div", [names["blk"], names["safe"]], [names["div"]]))
    if opset >= 11:
        nodes.append(helper.make_node("Round", [names["div"]], [names["q"]]))
    else:  # Round is opset 11: half up instead of half to even (ties only)
        shifted = fresh("shifted")
        nodes += [helper.make_node("Add", [names["div"], const("half", np.array(0.5, dtype))], [shifted]),
                  helper.make_node("Floor", [shifted], [names["q"]])]
    nodes.append(helper.make_node("Mul", [names["q"], names["safe"]], [names["deq"]]))
    rows = names["deq"]
    if pad:
        nodes.append(helper.make_node("Reshape", [names["deq"], const("rows_shape", np.array([-1, k + pad], np.int64))],
                                      [names["rows"]]))
        if opset >= 10:
            nodes.append(helper.make_node("Slice", [names["rows"], const("starts", np.array([0], np.int64)),
                                                    const("ends", np.array([k], np.int64)),
                                                    const("slice_axes", np.array([1], np.int64))], [names["cut"]]))
        else:
            nodes.append(helper.make_node("Slice", [names["rows"]], [names["cut"]], starts=[0], ends=[k], axes=[1]))
        rows = names["cut"]
    nodes.append(helper.make_node("Reshape", [rows, names["shp"]], [names["back"]]))
    return nodes, names["back"]
