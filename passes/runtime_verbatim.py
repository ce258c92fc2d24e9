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
thread cuts and walks the graph and decides. The guess is made from the pack's index
(`wants_verbatim`: no quantized weights; float32 weights mostly not 2-D, i.e. not MatMul weights
that the usual route shares without a copy) and confirmed by the walk (`verbatim_fits`); when the
walk says otherwise the stream to onnxruntime is cut (it fails on the truncated model, quietly) and
the usual route runs.
"""
from __future__ import annotations

from onnx import TensorProto

from .runtime_feed import INLINE_MAX_BYTES, GraphReads, SplitModel, shareable_names

# the pack's big tensors must all be of these types (no quantized weights: nothing to fold) ...
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})
# ... and, in a float32 model, 2-D float32 tensors (MatMul/Gemm/Gather weights, shared without a copy
# by the usual route) at most this share of their bytes; the walk then requires the same of the
# weights it finds shareable. Sharing a few KiB (a ResNet's 2048x2 classifier) saves nothing worth
# the usual route's time
SHARED_MAX_SHARE = 0.05


def wants_verbatim(index) -> bool:
    """Whether a pack looks like a model that goes to onnxruntime unchanged (its index only: no
    graph read yet). One model file (no external data files), big coded tensors (those the runtime
    decodes aside, runtime_source._big_entries) of float types only, and
    in a float32 model little in 2-D float32 tensors."""
    if len(index.files) != 1:
        return False
    total = two_d_float32 = float16 = 0
    for t in index.tensors:
        if t.stream is None or t.length <= INLINE_MAX_BYTES:  # (small tensors stay in the graph)
            continue
        if t.dtype not in FLOAT_TYPES:
            return False
        total += t.length
        if t.dtype == TensorProto.FLOAT16:
            float16 += t.length
        elif t.dtype == TensorProto.FLOAT and len(t.shape) == 2:
            two_d_float32 += t.length
    if total == 0:
        return False
    # float16 weights on a CPU are never shared (onnxruntime casts them at optimisation time)
    return float16 * 2 > total or two_d_float32 <= SHARED_MAX_SHARE * total


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
