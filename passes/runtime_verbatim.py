"""A packed model that needs no rewrite goes to onnxruntime as its own restored file, parsed
while it decodes and while another thread walks its graph.

Why: a lossless pack of a float model (mode="fold", nothing to fold, almost nothing to share) gives
onnxruntime exactly the original model. Made the usual way, onnxruntime starts parsing only after
the skeleton has been cut, parsed and walked (~10-15 ms of Python on a ResNet-50 pack) and the
model re-serialised, while the weights decode on the other core; onnxruntime then waits for the
last of them. Here onnxruntime parses the restored file (its graph bytes, then each big payload as
its batch decodes, no copy made: `file_pieces`) from the moment the graph bytes are restored, on
the calling thread (parsed on a thread of its own, its buffers came from another malloc arena and
stayed resident: open_nsfw float pack, RSS after the session 81-89 MB vs 71-75), while a helper
thread cuts and walks the graph and decides. The same holds for a float32 quantized model whose
folding the usual route leaves to onnxruntime as it is (fold_route "onnxruntime": Conv weights),
parsed with session.disable_quant_qdq=1. The guess is made from the pack's index (`verbatim_kind`:
the weights' types and shapes; float32 weights mostly not 2-D, i.e. not MatMul weights that the
usual route shares without a copy) and confirmed by the walk (`verbatim_fits` and the fold
checks in runtime.InferenceSession._verbatim_decision); when the walk says otherwise the stream
to onnxruntime is cut (it fails on the truncated model, quietly) and the usual route runs.
"""
from __future__ import annotations

from onnx import TensorProto

from .runtime_feed import INLINE_MAX_BYTES, GraphReads, SplitModel, shareable_names

# the pack's big tensors must all be of these types: floats (a lossless pack: nothing to fold) ...
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})
# ... or floats and 8-bit integers: a float32 quantized model whose constant DequantizeLinear nodes
# onnxruntime folds itself (fold_route "onnxruntime": nearly all its quantized weights Conv weights,
# runtime_fold.little_to_share); then onnxruntime parses it with session.disable_quant_qdq=1, as
# that route sets
QUANTIZED_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8})
# 2-D tensors (MatMul/Gemm/Gather weights: the usual route shares float32 ones without a copy, folds
# quantized float32 ones here, gathers the rows of a float16 embedding table as they are read) at
# most this share of the big tensors' bytes; the walk then requires the same of the weights it finds
# shareable. Sharing a few KiB (a ResNet's 2048x2 classifier) saves nothing worth the usual route's time
SHARED_MAX_SHARE = 0.05


def verbatim_kind(index) -> str | None:
    """"float" or "quantized" when a pack looks like a model that goes to onnxruntime unchanged,
    else None (its index only: no graph read yet). One model file (no external data files); big
    coded tensors (those the runtime decodes aside, runtime_source._big_entries) of float types
    ("float"), or of float and 8-bit integer types with little of the integers in 2-D tensors, in
    a float32 model (its small tensors, the scales, float32: "quantized"); in a float32 model
    little in 2-D float32 tensors."""
    if len(index.files) != 1:
        return None
    total = two_d_float32 = float16 = quantized = two_d_quantized = 0
    scales = {TensorProto.FLOAT: 0, TensorProto.FLOAT16: 0}  # bytes of every float tensor, small ones too
    for t in index.tensors:
        if t.dtype in scales:
            scales[t.dtype] += t.length
        if t.stream is None or t.length <= INLINE_MAX_BYTES:  # (small tensors stay in the graph)
            continue
        total += t.length
        if t.dtype in QUANTIZED_TYPES:
            quantized += t.length
            two_d_quantized += t.length if len(t.shape) == 2 else 0
        elif t.dtype not in FLOAT_TYPES:
            return None
        elif t.dtype == TensorProto.FLOAT16:
            float16 += t.length
        elif t.dtype == TensorProto.FLOAT and len(t.shape) == 2:
            two_d_float32 += t.length
    if total == 0 or two_d_quantized > SHARED_MAX_SHARE * max(quantized, 1):
        return None
    # float16 weights on a CPU are never shared (onnxruntime casts them at optimisation time)
    if not (float16 * 2 > total - quantized or two_d_float32 <= SHARED_MAX_SHARE * total):
        return None
    if quantized and scales[TensorProto.FLOAT16] > scales[TensorProto.FLOAT]:
        # a float16 quantized model stays on the usual route: parsed as it is, open_nsfw_fp16 q8
        # took more CPU to a ready session (fresh processes, 10 interleaved rounds twice, load 9-12:
        # median 578 vs 520 ms, 657 vs 603), unlike its float32 twin (309 vs 366)
        return None
    return "quantized" if quantized else "float"


def verbatim_fits(split: SplitModel, reads: GraphReads, share: bool) -> bool:
    """Whether the usual route would hand onnxruntime the model unchanged, sharing (nearly) nothing:
    the caller has checked the mode (fold), dtype (the model's own), provider (CPU) and that nothing
    is foldable. `share`: whether the usual route would share weights (float32 on a CPU)."""
    if not share:
        return True
    shared = shareable_names(split, None, reads)
    shared_bytes = sum(split.weights[n].nbytes for n in shared)
    total = sum(a.nbytes for a in split.weights.values())
    return shared_bytes <= SHARED_MAX_SHARE * total


def file_pieces(buf, entries, outputs) -> list:
    """The restored model file as buffers in file order: `buf` (the file with the payloads of
    `entries` not restored) between those payloads, each payload being `outputs[(file, offset)]`
    (the array its background decode fills). No byte is copied."""
    pieces, position = [], 0
    for t in sorted(entries, key=lambda t: t.offset):
        if t.offset > position:
            pieces.append(buf[position:t.offset])
        pieces.append(outputs[(t.file, t.offset)])
        position = t.offset + t.length
    if position < len(buf):
        pieces.append(buf[position:])
    return pieces


class ParsedModel:
    """What onnxruntime's parse of the verbatim file gave: its session object (not yet
    initialised) or its error; `take()` returns the first or raises the second."""

    def __init__(self, session=None, error=None):
        self._session, self._error = session, error

    def take(self):
        session, error = self._session, self._error
        self._session = self._error = None
        if error is not None:
            raise error
        return session
