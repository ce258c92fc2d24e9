"""Measuring models onnxruntime has no kernels for: opset-6 (and older) exports.

onnxruntime's CPU kernels start at opset 7 for many ops (Gemm, AveragePool, BatchNormalization,
PRelu, Add with the old `broadcast` attribute, ...): it refuses an opset-6 model with
NOT_IMPLEMENTED. The command's compress already raises such a model's opset (graph.raise_opset,
onnx.version_converter) to write DequantizeLinear, so the candidate runs while the original does
not, and `--require` / `--target` / `eval` had nothing to compare it with.

Measuring the raised original instead is honest only if the raise keeps the function: a
converter error would sit in both the reference and the candidate and cancel out of the
comparison (d45f4bf found one: PRelu's slope across opset 7). So the raised model is used only
after it is checked against the original itself, run by onnx's reference evaluator (which
implements the old opsets), on the first feed; the report says the comparison ran at the raised
opset and what the check measured. A raise that fails the check, or that the reference evaluator
cannot check, leaves the model as it was: onnxruntime's own refusal is then what the user reads.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import onnx

# onnxruntime implements few ops below this opset; models at or above it are never touched here
OLDEST_RUNNABLE_OPSET = 7
# the opset the original is raised to for measuring: the one quantize_weights writes per-channel
# DequantizeLinear at, so that a candidate it raised and the reference are the same conversion
MEASURE_OPSET = 13
# the raised model must reproduce the reference evaluator's outputs of the original this closely
# (worst output; float32 kernels of two implementations agree to ~1e-7 relative: > 120 dB)
CHECK_MIN_SNR_DB = 80.0


def _session(model: onnx.ModelProto, optimize: bool = True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # its warnings about IR 3's listed initializers are not the user's business here
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def onnxruntime_refusal(model: onnx.ModelProto) -> str | None:
    """onnxruntime's reason for refusing to create a CPU session on `model`, None if it does not."""
    try:
        _session(model, optimize=False)  # only asking whether it loads
    except Exception as exc:  # noqa: BLE001 - onnxruntime's exception types are not one class
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def _agreement_db(expected: Sequence, got: Sequence) -> float:
    """Worst-output SNR (dB) of `got` against `expected`: inf when equal; -inf when an output's
    shape, dtype kind or a non-float value differs."""
    worst = math.inf
    for e, g in zip(expected, got, strict=True):
        e, g = np.asarray(e), np.asarray(g)
        if e.shape != g.shape:
            return -math.inf
        if e.dtype.kind not in "fc" or g.dtype.kind not in "fc":
            if not np.array_equal(e, g):
                return -math.inf
            continue
        e64, g64 = e.astype(np.float64), g.astype(np.float64)
        same_odd = (np.isnan(e64) & np.isnan(g64)) | (np.isinf(e64) & (e64 == g64))
        if np.any((~np.isfinite(e64) | ~np.isfinite(g64)) & ~same_odd):
            return -math.inf
        finite = np.isfinite(e64)
        noise = float(np.sum((e64[finite] - g64[finite]) ** 2))
        if noise:
            signal = float(np.sum(e64[finite] ** 2))
            worst = min(worst, 10 * math.log10(signal / noise) if signal else -math.inf)
    return worst


def measurable(model: onnx.ModelProto, feeds: Sequence[dict] | None, what: str = "the original"
               ) -> tuple[onnx.ModelProto, str | None]:
    """(`model`, None) when onnxruntime can run it (or it is not an old-opset model); else the model
    raised to MEASURE_OPSET and a note for the report, when that one runs in onnxruntime and
    reproduces onnx.reference's outputs of `model` on the first feed (`feeds`, or one synthesised
    feed when None) within CHECK_MIN_SNR_DB. Anything short of that returns (`model`, None)."""
    from passes import graph
    from passes.errors import SurgeonError
    from passes.fidelity import synthesize_feeds

    old = graph.default_opset(model)
    if not 0 < old < OLDEST_RUNNABLE_OPSET:
        return model, None
    refusal = onnxruntime_refusal(model)
    if refusal is None or "NOT_IMPLEMENTED" not in refusal:
        return model, None
    source = model
    if model.ir_version < 4:  # as quantize_weights does first: IR 3's listed initializers stay weights, not inputs
        from passes.graph import unlist_ir3_initializers

        source = graph.copy_model(model)
        unlist_ir3_initializers(source)
    try:
        raised, _how = graph.raise_opset(source, MEASURE_OPSET)
    except SurgeonError:
        return model, None
    if onnxruntime_refusal(raised) is not None:
        return model, None
    try:
        feed = dict(feeds[0]) if feeds else synthesize_feeds(model, n=1)[0]
        from onnx.reference import ReferenceEvaluator

        expected = ReferenceEvaluator(model).run(None, feed)
        got = _session(raised).run(None, feed)
    except Exception:  # noqa: BLE001 - the check could not run: the model is not measured raised
        return model, None
    agreement = _agreement_db(expected, got)
    if agreement < CHECK_MIN_SNR_DB:
        return model, None
    shown = "bit-equal" if math.isinf(agreement) else f"worst output {agreement:.0f} dB"
    return raised, (f"onnxruntime cannot run {what} at opset {old} ({_short(refusal)}): it was measured at opset "
                    f"{MEASURE_OPSET} (graph.raise_opset), checked against onnx's reference evaluator of the opset-{old} "
                    f"model on one feed ({shown})")


def _short(reason: str, limit: int = 120) -> str:
    """onnxruntime's message without its '[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED :' prefix."""
    text = reason.split("NOT_IMPLEMENTED :", 1)[-1].strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."
