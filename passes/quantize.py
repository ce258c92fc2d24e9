"""The quantize pass: float weights -> n-bit integer tensors + DequantizeLinear.

Weight W (initializer or Constant node, main graph or subgraph) becomes
    W_quantized  int8 / uint8 / int4 / uint4 levels      (initializer, or Constant node)
    W_scale      scales in W's own float dtype            (same place as W)
    W_zero_point only when asymmetric, same layout
    DequantizeLinear(W_quantized, W_scale[, W_zero_point]) -> W
so every consumer still reads W, and `fold_dequantize` restores the original structure.
For initializers the DequantizeLinear nodes go first in their graph (in weight order); for a
Constant node they replace it at the same place.

include / exclude: lists of patterns. A pattern that is the name of an op type (e.g. "MatMul",
"Gather") matches weights consumed by that op; any other pattern is an fnmatch pattern on the
weight's name ("*embeddings*"). `include` selects: among the weights the size and bias rules
would quantize when it names an op type, and whatever their size when a name pattern matches
them (a weight named is quantized even when small, 1-D or a bias); `exclude` removes. Exclude
wins over include.

Axis rules (graph.choose_axis): Conv axis 0, ConvTranspose axis 1, MatMul B the last axis (A:
the second last), Gemm by transA/transB, Gather its own axis (rows), LSTM/GRU/RNN W and R the gate
axis 1; followed through Identity / Cast / Transpose. Other or disagreeing consumers get, with
granularity="channel", the axis whose per-channel scales give the smallest squared error (any
axis is a correct DequantizeLinear; the choice only affects accuracy), and blocks run along the
last axis.

Forms: bits 5..8 are stored in int8 (uint8 when asymmetric) containers, bits 2..4 in int4 / uint4
(opset 21); symmetric levels are -(2**(b-1)-1)..2**(b-1)-1 without a zero point, asymmetric
0..2**b-1 with a zero point. granularity="block" defaults to block_size 128 (32 at <= 4 bits).
Scales are stored in the weight's own float type (float16 needs opset 19, blocks and int4 opset
21; the opset is raised with onnx.version_converter and the result checked), except bfloat16
and float64: onnxruntime has no bfloat16 DequantizeLinear on the CPU and DequantizeLinear has no
float64 output at all, so their scales are float32 (exact for bfloat16; float32 -> float64 is exact)
and DequantizeLinear(...) -> W_dequantized -> Cast(bfloat16 / double) -> W (fold folds the pair).
Blocks run along the dot-product axis; when it is shorter than a block (a Conv with one input
channel) along the longest other non-channel axis holding a block, else one scale per channel.

Left as they are, with the reason in the report: biases, 1-D and small tensors, initializers
listed as graph inputs from IR 4 on (overridable; an IR 3 model lists every initializer as an
input because it must: those entries are removed and the IR raised to 4; a main-graph one that
include= names by name is unlisted too, with a note, and quantized), float tensors read as
exact values (Cast to an integer type, Equal/Less/..., Floor/Round/...: indices and masks), and
(a note counts them) sparse Constants.

Weights in Constant nodes of model-local function bodies (ModelProto.functions) are quantized
inside the body: W becomes Constant levels and scale [and zero point] + DequantizeLinear -> W
there, by the same rules (axis from the body's own consumers). Left float, each a row of the
report with why and a note counting them: all of them when include= is given (its patterns name
the graphs' weights; a body's local names could match one by chance), and those of a body whose
default-domain opset is too old for the form (raising one function's opset would convert its
other nodes too; the model, functions with it, is raised for them as for graph weights, and left
as it is where that raise fails). See _quantize_function_weights.

Rounding: to nearest by default; rounding="rdo" chooses, per row (channel / block), the step
factor that minimises squared error + lambda * (bits the pack's order-0 coder spends on the
levels), optionally also each weight's level by that cost (passes/rounding.py). Only which
integers and scales are stored changes: the graph is the same DequantizeLinear.

Speed and memory: the numeric work per weight runs on a thread pool (numpy releases the GIL;
results are consumed in weight order, so the output bytes do not depend on the thread count), the
clip search is coarse-to-fine on cache-sized chunks (forms._search), the float payloads of the
replaced main-graph initializers are never copied (graph.copy_model), and each result enters the
output graph as soon as it is computed. bench/speed.py and bench/large.py measure it.

Running the result in onnxruntime (1.32, CPU): its graph optimiser fuses DequantizeLinear+MatMul
into MatMulNBits, whose default accuracy level (4) also quantizes the activations to int8 (minilm
cosine 0.99921 -> 0.99889) and is slower than float. Session config
"session.qdq_matmulnbits_accuracy_level" = "0" keeps float compute, or fold the weights at load.
"""
from __future__ import annotations

import collections
import concurrent.futures
import fnmatch
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import dedupe as _dedupe
from . import forms, graph
from . import rounding as _rounding
from ._cpus import usable_cpus
from ._fileio import load_model
from .errors import InvalidArgumentError, UnsupportedFormError
from .report import Report, TensorChange

DEFAULT_MIN_ELEMENTS = 1024

# Float inputs of these ops are quantization parameters or feed kernels that already work on
# integers: they stay exact.
_QUANTIZED_OPS = {
    "DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "ConvInteger", "MatMulInteger",
    "QLinearConv", "QLinearMatMul", "DynamicQuantizeLSTM", "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat", "QAttention", "QGemm", "QLinearAdd", "QLinearMul", "MatMulNBits",
    "QLinearSigmoid", "QLinearLeakyRelu", "QLinearConcat", "QLinearGlobalAveragePool",
    "QLinearAveragePool", "QLinearSoftmax", "QLinearWhere", "QEmbedLayerNormalization",
    "QOrderedMatMul", "GatherBlockQuantized",
}
# (op, input index) that are biases or per-step parameters better left exact
_BIAS_INPUTS = {("LSTM", 3), ("GRU", 3), ("RNN", 3), ("Gemm", 2), ("Conv", 2), ("ConvTranspose", 2)}



def _check_args(bits, granularity, block_size, min_elements):
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise InvalidArgumentError(f"bits must be an integer from 2 to 8, got {bits!r}")
    if granularity not in ("tensor", "channel", "block"):
        raise InvalidArgumentError(f"granularity must be 'tensor', 'channel' or 'block', got {granularity!r}")
    if granularity == "block":
        if block_size is None:
            block_size = 32 if bits <= 4 else 128
        if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 2:
            raise InvalidArgumentError(f"block_size must be an integer >= 2, got {block_size!r}")
    elif block_size is not None:
        raise InvalidArgumentError("block_size is only used with granularity='block'")
    if not isinstance(min_elements, (int, np.integer)) or min_elements < 0:
        raise InvalidArgumentError(f"min_elements must be a non-negative integer, got {min_elements!r}")
    return int(block_size or 0)


def _check_importance(importance) -> dict:
    """{name: float array >= 0, finite} or a clear error."""
    if importance is None:
        return {}
    if not isinstance(importance, dict):
        raise InvalidArgumentError("importance must be a dict {weight name: array}")
    out = {}
    for name, arr in importance.items():
        a = np.asarray(arr, dtype=np.float32)
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            raise InvalidArgumentError(f"importance of {name!r} must be finite and non-negative")
        out[name] = a
    return out


def _patterns(value, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    try:
        items = list(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a pattern or a list of patterns") from None
    if not all(isinstance(p, str) and p for p in items):
        raise InvalidArgumentError(f"{what} must hold non-empty strings")
    return items


@functools.lru_cache(maxsize=1)
def _op_types() -> frozenset[str]:
    return frozenset(s.name for s in onnx.defs.get_all_schemas_with_history())


def _match(w: graph.Weight, patterns: list[str], ops: set[str]) -> str | None:
    """"name" when a name pattern matches `w`, else "op" when an op-type pattern names one of its
    consumers, else None."""
    consumer_ops = {u.node.op_type for u in w.uses}
    by_op = False
    for p in patterns:
        if p in ops or p in _QUANTIZED_OPS:
            by_op = by_op or p in consumer_ops
        elif fnmatch.fnmatchcase(w.name, p):
            return "name"
    return "op" if by_op else None


def _matches(w: graph.Weight, patterns: list[str], ops: set[str]) -> bool:
    return _match(w, patterns, ops) is not None


# the float element types the pass quantizes: graph.FLOAT_TYPES and float64 (its DequantizeLinear
# computes in float32 and a Cast gives the float64 weight, as for bfloat16: _dequantize_nodes)
_QUANTIZABLE_TYPES = {**graph.FLOAT_TYPES, TensorProto.DOUBLE: np.dtype(np.float64)}
# weights given back by DequantizeLinear (float32 scales) -> Cast to their own type
_CAST_AFTER_TYPES = frozenset({TensorProto.BFLOAT16, TensorProto.DOUBLE})


def _unreached_weights(model: onnx.ModelProto, min_elements: int) -> dict[str, int]:
    """Float tensors of >= min_elements that the rewrite does not reach, by where they are: sparse
    Constants. (Function bodies' weights: _quantize_function_weights; float64 ones are quantized
    like the others, _dequantize_nodes.)"""
    def big_sparse_constant(node):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return False
        return any(a.name == "sparse_value" and a.sparse_tensor.values.data_type in _QUANTIZABLE_TYPES
                   and int(np.prod(a.sparse_tensor.dims)) >= max(min_elements, 2) for a in node.attribute)

    sparse = sum(big_sparse_constant(n) for gi in graph.iter_graphs(model) for n in gi.graph.node)
    return {"in sparse Constant nodes": sparse}


def attribute_weights(model: onnx.ModelProto, min_elements: int) -> dict[str, tuple[int, int]]:
    """Float values held in node attributes rather than tensors, by op type: (nodes, values).

    Classic ML exports keep their whole model there (sklearn-onnx's TreeEnsembleClassifier /
    Regressor thresholds and leaf weights, LinearClassifier coefficients, SVM support vectors);
    the passes rewrite tensors only, so these stay as they are, and the report says so instead of
    an unexplained 1.00x. Counted per attribute of >= min_elements floats (a float list or a
    float tensor attribute of a node other than Constant, whose tensor is a weight the passes read).
    """
    found: dict[str, list[int]] = {}
    bodies = [gi.graph.node for gi in graph.iter_graphs(model)] + [fn.node for fn in model.functions]
    for nodes in bodies:
        for node in nodes:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                continue
            n = 0
            for a in node.attribute:
                size = 0
                if a.type == onnx.AttributeProto.FLOATS:
                    size = len(a.floats)
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in graph.FLOAT_TYPES:
                    size = int(np.prod(a.t.dims, dtype=np.int64))
                if size >= max(min_elements, 2):
                    n += size
            if n:
                entry = found.setdefault(node.op_type, [0, 0])
                entry[0] += 1
                entry[1] += n
    return {op: (nodes, values) for op, (nodes, values) in sorted(found.items())}


def _stored_tensors(g: onnx.GraphProto):
    """(name the graph reads it by, tensor) of the initializers and Constant node values of `g`
    (models exported with weights in Constant nodes keep their quantized levels there too)."""
    for t in g.initializer:
        yield t.name, t
    for node in g.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    yield node.output[0], attr.t


def _prequantized_note(model: onnx.ModelProto, min_elements: int) -> str | None:
    """Integer weights an earlier quantizer left for its own ops (ConvInteger, MatMulInteger,
    DynamicQuantizeLSTM, QLinearConv, MatMulNBits, ..., or a Cast to float): they stay as they are, and a model made
    of them (onnxruntime's quantize_dynamic output) comes out at 1.00x; the note says why."""
    ints = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4}
    count = nbytes = 0
    ops: set[str] = set()
    for gi in graph.iter_graphs(model):
        readers: dict[str, set[str]] = {}
        for node in gi.graph.node:
            # integer levels read through a Cast to float (then a Mul by their scale: the form
            # the auto mode writes for MatMul weights, and other exporters') are weights too
            op = node.op_type
            if op == "Cast" and any(a.name == "to" and a.i in graph.FLOAT_TYPES for a in node.attribute):
                op = "Cast to float"
            for name in node.input:
                readers.setdefault(name, set()).add(op)
        for name, t in _stored_tensors(gi.graph):
            if t.data_type in ints and int(np.prod(t.dims, dtype=np.int64)) >= max(min_elements, 2):
                by = readers.get(name, set()) & (_QUANTIZED_OPS | {"Cast to float"})
                if by:
                    count += 1
                    nbytes += graph.tensor_nbytes(t)
                    ops |= by
    if not count:
        return None
    return (f"already quantized: {count} integer weight(s) ({nbytes:,} bytes) read by {', '.join(sorted(ops))} "
            "stay as they are")


def attribute_weights_note(model: onnx.ModelProto, min_elements: int) -> str | None:
    found = attribute_weights(model, min_elements)
    if not found:
        return None
    parts = ", ".join(f"{op} ({nodes} node{'s' if nodes > 1 else ''}, {values:,} values)"
                      for op, (nodes, values) in found.items())
    return f"float values in node attributes stay as they are (the passes rewrite tensors only): {parts}"


# ops whose result changes when a value moves by a rounding step, however small: a float tensor
# they read holds indices, thresholds or counts, not a weight (an exporter's float index table
# Cast to int64 for a Gather, a float mask compared with Equal)
_EXACT_OPS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Floor", "Ceil", "Round", "Sign",
              "Mod", "Range", "IsInf", "IsNaN"}


def _exact_use(w: graph.Weight) -> str | None:
    """The consumer (op name) that reads `w` as exact values, if any: one of _EXACT_OPS, or a Cast
    to a non-float type (integers, bool)."""
    for u in w.uses:
        op = u.node.op_type
        if u.node.domain not in ("", "ai.onnx"):
            continue
        if op in _EXACT_OPS:
            return op
        if op == "Cast":
            to = next((a.i for a in u.node.attribute if a.name == "to"), None)
            if to not in graph.FLOAT_TYPES and to != TensorProto.DOUBLE:
                return f"Cast to {graph.type_name(to) if to is not None else '?'}"
    return None


def _keep_reason(w: graph.Weight, include, exclude, ops, min_elements) -> str | None:
    """Why `w` stays as it is, or None when it is to be quantized."""
    t = w.tensor
    if t.data_type not in _QUANTIZABLE_TYPES:
        return "not float"
    if exclude and _matches(w, exclude, ops):
        return "excluded"
    consumers = {u.node.op_type for u in w.uses}
    quantized_ops = sorted(consumers & _QUANTIZED_OPS)
    if quantized_ops:
        return f"input of {quantized_ops[0]}"
    included = _match(w, include, ops) if include else None
    # a listed main-graph initializer that include= names by name is unlisted (_unlist_included)
    if w.graph_input and not (included == "name" and w.graph_key == 0 and w.node is None):
        return "also a graph input (overridable)"
    exact = _exact_use(w)
    if exact:
        return f"read as exact values ({exact})"
    if not w.uses and not w.graph_output:
        return "unused"
    if include and not included:
        return "not included"
    shape = w.shape
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return "empty"
    # a weight named by the user is quantized whatever its size; an op type ("Conv") names every
    # input of that op, biases and tiny kernels too, which the rules below keep exact as usual
    if included != "name":
        if all((u.node.op_type, u.index) in _BIAS_INPUTS for u in w.uses) and w.uses:
            return "bias"
        if len(shape) < 2 or sum(d > 1 for d in shape) < 2:
            return "1-D" if len(shape) else "scalar"
        if n < min_elements:
            return f"small (<{min_elements} elements)"
    return None


def _required_opset(dtype: int, bits: int, granularity: str) -> int:
    if granularity == "block" or bits <= 4:
        return 21  # block_size attribute, int4 / uint4
    if dtype == TensorProto.FLOAT16:
        return 19  # float16 scales (bfloat16 and float64 weights get float32 scales and a Cast)
    if granularity == "tensor" and dtype in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return 10  # DequantizeLinear-10 takes a per-tensor scale: no conversion of an opset 10-12 model
    return 13  # axis attribute (per channel); bfloat16's Cast (Cast to double: any opset)


def _best_axis(w32: np.ndarray, levels: forms.Levels) -> int:
    """Axis whose per-channel max-abs scales give the smallest squared error (quick estimate)."""
    best, best_err = 0, math.inf
    for axis in range(w32.ndim):
        if w32.shape[axis] == 1:
            continue
        qz = forms.quantize_linear(w32, levels, axis, 0, search=False)
        deq = forms.dequantize_linear(qz.q, qz.scale, qz.zero_point, axis)
        with np.errstate(over="ignore"):  # weights near float32's max: the error is inf, not a warning
            err = float(np.sum(np.square(deq - w32, dtype=np.float32), dtype=np.float64))
        if err < best_err:
            best, best_err = axis, err
    return best


def _scheme(levels: forms.Levels, bits: int, axis, block_size) -> str:
    kind = levels.storage if bits in (4, 8) else f"{levels.storage}({bits}-bit)"
    if axis is None:
        gran = "tensor"
    elif block_size:
        gran = f"block(axis={axis},size={block_size})"
    else:
        gran = f"channel(axis={axis})"
    return f"{kind}/{gran}/{'sym' if levels.symmetric else 'asym'}"


def _snr_db(w: np.ndarray, deq: np.ndarray) -> float:
    w64 = w.astype(np.float64)
    noise = float(np.sum(np.square(deq.astype(np.float64) - w64)))
    signal = float(np.sum(np.square(w64)))
    if noise == 0:
        return 200.0  # exact (capped so that reports stay plain JSON)
    if signal == 0:
        return -200.0
    return round(10 * math.log10(signal / noise), 3)


@graph.refuses_bad_text
def quantize_weights(model, *, bits: int = 8, granularity: str = "channel", block_size: int | None = None,
                     symmetric: bool = True, min_elements: int = DEFAULT_MIN_ELEMENTS, include=None,
                     exclude=None, rounding: str = "nearest", rd_lambda: float | None = None,
                     rd_max_snr_loss_db: float | None = None, rd_target_snr_db: float | None = None,
                     rd_step_scale: float | None = None, rd_distortion: str | None = None,
                     rd_levels: str | None = None, importance: dict | None = None,
                     scale_mantissa_bits: int | None = None, dedupe: bool = False,
                     report: Report | None = None, progress=None) -> onnx.ModelProto:
    """A new model whose float weights are n-bit integers expanded by DequantizeLinear nodes.

    See the module docstring for naming, include/exclude and axis rules. The input is never
    modified; the same input and options give the same output bytes.

    rounding="rdo" trades rate for distortion with the pack's order-0 entropy coder in mind
    (passes/rounding.py): each row (channel / block) takes the step factor minimising
    error + lambda * bits, the bits counted under the tensor's own level histogram. rd_lambda fixes
    lambda (squared steps per bit; ~0.1 is the high-rate slope); by default each tensor gets the
    largest lambda keeping its SNR within rd_max_snr_loss_db (0.5 dB) of nearest rounding, or at
    least rd_target_snr_db. rd_levels="rdo" also picks each weight's level by the same cost (a dead
    zone; each row's scale then corrected to unit gain): ~0.1% smaller, and it cost open_nsfw ~1 dB
    of output SNR, so it is off by default. rd_step_scale fixes the step factor; rd_distortion
    "absolute" weighs rows by their scale (tensor SNR) instead of each in its own steps
    ("relative"). The report gives per tensor the rounding, lambda, median step factor, SNR and an
    order-0 estimate of its packed bits per weight.

    importance: {weight name: non-negative array broadcastable to the weight's shape}, e.g.
    gptq.input_importance(model, gptq.collect_hessians(model, feeds, names)) (the mean squared
    activation of each weight's input): the clip search of those weights minimises the error
    weighted by it (about the layer's output error) instead of the plain weight error. Only the
    scales change; weights not named are unaffected. Measured in bench/layer_rd.py.

    scale_mantissa_bits: float32 weights' scales rounded to that many mantissa bits before their
    levels are chosen (forms.quantize_linear; 8: bfloat16 values, which the pack stores in two
    bytes instead of four). None keeps full float32 scales.

    dedupe: byte-identical weights that would get the same form (tied embeddings and lm_head, a
    weight exported once per reader; equal Constants of one model-local function body among
    themselves) are merged first (passes.dedupe), so that each is quantized
    once, stored once and dequantized by one node read by all its readers; the report names each
    merge ("2 identical weights stored once: B -> A (1.0 MB less)"). Off by default: the merged
    names are gone from the result, and callers that look weights up by name in it (the auto search
    builds its plans so) merge first (passes.dedupe_initializers) or not at all.

    Returns the new model. Its default-domain opset is raised where the chosen form needs a newer
    DequantizeLinear (per channel 13, float16 scales 19, 4-bit or blocks 21; per tensor float32
    works from 10), converting the model with onnx.version_converter, and its IR version to what
    those need (10 for int4 / blocks); the report notes each raise.

    Raises InvalidModelError for a model that is not valid ONNX (graph.refuse_invalid names the
    problem: the output would not be either), InvalidArgumentError for bad options,
    UnsupportedFormError for a form this model's opset cannot be raised to (no default-domain
    opset, or a conversion that would change the model).
    """
    block = _check_args(bits, granularity, block_size, min_elements)
    if scale_mantissa_bits is not None and (not isinstance(scale_mantissa_bits, (int, np.integer))
                                            or isinstance(scale_mantissa_bits, bool)
                                            or not 1 <= scale_mantissa_bits <= 24):
        raise InvalidArgumentError(f"scale_mantissa_bits must be an integer from 1 to 24, got {scale_mantissa_bits!r}")
    importance = _check_importance(importance)
    rounding_opts = _rounding.options(rounding, rd_lambda, rd_max_snr_loss_db, rd_target_snr_db, rd_step_scale,
                                      rd_distortion, rd_levels)
    include_p = _patterns(include, "include")
    exclude_p = _patterns(exclude, "exclude")
    # a subgraph weight named like an outer tensor would become a node output shadowing it (not SSA)
    source = graph.unshadowed(load_model(model))
    levels = forms.Levels(int(bits), bool(symmetric))
    # op names let include/exclude patterns name op types; onnx's schema list behind them costs
    # ~10 MB of resident memory that stays (an int8 session on a small model pays it at load)
    ops = _op_types() if include_p or exclude_p else frozenset()
    if report is not None:
        report.pass_name = report.pass_name or "quantize_weights"

    # Main-graph initializers about to be replaced are copied without their payload (most of a
    # large model): they are read from `source`, and the output never holds the float bytes.
    planned, _ = graph.find_weights(source)
    unique = graph.unique_initializers(source)
    payloads = {w.name: unique[w.name] for w in planned
                if w.graph_key == 0 and w.node is None and w.name in unique
                and _keep_reason(w, include_p, exclude_p, ops, min_elements) is None}
    out = _standard_copy(source, payloads, report)
    if include_p:
        _unlist_included(out, include_p, exclude_p, ops, min_elements, report)
    if dedupe:
        _store_duplicates_once(out, payloads, include_p, exclude_p, ops, min_elements, report)
    weights, _ = graph.find_weights(out)
    chosen = [w for w in weights if _keep_reason(w, include_p, exclude_p, ops, min_elements) is None]
    out = _with_opset_for(out, chosen, bits, granularity, payloads, report,
                          _function_candidates(out, include_p, exclude_p, ops, min_elements))
    if report is not None:
        _note_weights_left_float(out, min_elements, report)
    if chosen:
        need_ir = 10 if (bits <= 4 or granularity == "block") else 0
        out.ir_version = max(out.ir_version, need_ir,
                             helper.find_min_ir_version_for(list(out.opset_import), True))

    weights, graphs = graph.find_weights(out)
    consumers_of = graph.consumers_index(graphs)
    names = graph.NameAllocator(graph.all_names(out))
    total = len(weights)

    def data_of(w: graph.Weight) -> TensorProto:
        if w.graph_key == 0 and w.node is None and not w.tensor.HasField("raw_data") and w.name in payloads:
            return payloads[w.name]
        return w.tensor

    reasons = [_keep_reason(w, include_p, exclude_p, ops, min_elements) for w in weights]
    if report is not None:
        _note_graph_input_weights(weights, reasons, min_elements, report)
    if include_p and report is not None and all(r in ("not included", "not float") for r in reasons):
        # otherwise the only sign of a mistyped pattern is '0 tensor(s) rewritten'
        report.note(f"include {', '.join(map(repr, include_p))} matched no float weight (by name or by the op type "
                    "reading it): nothing quantized")
    jobs = [_Job(data_of(w), graph.choose_axis(w, consumers_of), granularity, block, levels, rounding_opts,
                 importance.get(w.name), scale_mantissa_bits)
            for w, reason in zip(weights, reasons) if reason is None]
    # a pool's threads keep their malloc arenas (~4-5 MB) for the process's life: not worth it for
    # a few MB of weights, which one thread quantizes in milliseconds
    elements = sum(math.prod(j.tensor.dims) for j in jobs)
    results = _ordered_map(_Job.run, jobs, _threads() if elements >= SMALL_JOB_ELEMENTS else 1)

    # per graph: initializer name -> replacement (array, name, type); Constant output -> nodes
    new_inits: dict[int, dict[str, list[tuple[np.ndarray, str, int]]]] = {}
    new_first_nodes: dict[int, list[onnx.NodeProto]] = {}
    const_nodes: dict[int, dict[str, list[onnx.NodeProto]]] = {}
    storage = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8,
               "int4": TensorProto.INT4, "uint4": TensorProto.UINT4}[levels.storage]
    # main-graph initializers to replace leave the graph now, so that each result goes into it
    # as soon as it is computed and its arrays are freed (no second copy of the output in memory)
    early = {w.name for w, r in zip(weights, reasons) if r is None and w.graph_key == 0 and w.node is None}
    for i in reversed([i for i, t in enumerate(out.graph.initializer) if t.name in early]):
        del out.graph.initializer[i]

    for i, (w, reason) in enumerate(zip(weights, reasons)):
        if reason == "not float":
            if progress:
                progress(i + 1, total)
            continue
        dtype = _QUANTIZABLE_TYPES[w.tensor.data_type]
        nbytes = int(np.prod(w.shape, dtype=np.int64)) * dtype.itemsize
        done = next(results) if reason is None else None
        if reason is None and done is None:
            reason = "non-finite values"
        if reason is not None:
            if reasons[i] is None and w.name in early and w.graph_key == 0 and w.node is None:
                # chosen, then kept after all (non-finite values): its tensor goes back in
                out.graph.initializer.add().CopyFrom(data_of(w))
            elif data_of(w) is not w.tensor:
                w.tensor.CopyFrom(data_of(w))
            if report is not None:
                report.add(TensorChange(w.name, w.shape, graph.type_name(w.tensor.data_type), f"kept: {reason}",
                                        nbytes, nbytes, None, w.location))
            if progress:
                progress(i + 1, total)
            continue

        axis, blk, qz = done
        parts, dq_nodes = _dequantize_nodes(w, qz, axis, blk, storage, names)
        after = sum(graph.array_nbytes(a, t) for a, _, t in parts)
        if w.node is None and w.graph_key == 0 and w.name in early:
            for arr, name, elem_type in parts:
                graph.fill_tensor(out.graph.initializer.add(), arr, name, elem_type)
            new_first_nodes.setdefault(0, []).extend(dq_nodes)
        elif w.node is None:
            new_inits.setdefault(w.graph_key, {})[w.name] = parts
            new_first_nodes.setdefault(w.graph_key, []).extend(dq_nodes)
        else:
            repl = [helper.make_node("Constant", [], [n], name=names.take(n + "_Constant"),
                                     value=graph.array_to_tensor(a, n, t)) for a, n, t in parts]
            const_nodes.setdefault(w.graph_key, {})[w.name] = repl + dq_nodes
        if report is not None:
            report.add(_rounding.QuantizedChange(
                w.name, w.shape, graph.type_name(w.tensor.data_type), _scheme(levels, bits, axis, blk)
                + ("/rdo" if qz.rounding == "rdo" else ""), nbytes, after, qz.snr_db(), w.location, rounding=qz.rounding, packed_bits_per_weight=qz.bits_per_weight,
                rd_lambda=qz.rd_lambda, step_scale=qz.step_scale))
        if progress:
            progress(i + 1, total)

    _splice(graphs, new_inits, new_first_nodes, const_nodes)
    if _quantize_function_weights(out, _FunctionForm(bits, granularity, block, levels, rounding_opts,
                                                     scale_mantissa_bits, storage),
                                  include_p, exclude_p, ops, min_elements, report):
        out.ir_version = max(out.ir_version, 10 if (bits <= 4 or granularity == "block") else 0,
                             helper.find_min_ir_version_for(list(out.opset_import), True))
    graph.drop_stale_training_info(out, "quantized", report)
    return out


def _store_duplicates_once(out: onnx.ModelProto, payloads: dict, include_p, exclude_p, ops, min_elements: int,
                           report: Report | None) -> list:
    """Byte-identical weights that would get the same form (the same reason to stay as they are,
    or quantized along the same axes) merged into one, in place, before any is quantized
    (passes.dedupe): a weight stored twice (tied embeddings and lm_head, a weight exported once per
    reader) is quantized once, stored once and dequantized by one node that all its readers read.
    Weights whose forms would differ (one excluded or not included, read along another axis) stay
    apart. The Constants of one model-local function body merge among themselves the same way
    (a function sees no name of the graph that calls it), their forms as _quantize_function_weights
    would give them. Returns the merges (each reported)."""
    kept_apart: list[str] = []
    weights, graphs = graph.find_weights(out)
    consumers_of = graph.consumers_index(graphs)

    def graph_form(w: graph.Weight):
        reason = _keep_reason(w, include_p, exclude_p, ops, min_elements)
        return reason, graph.choose_axis(w, consumers_of) if reason is None else None

    merges = _dedupe.find_duplicates(out, scope="main", payloads=payloads,
                                     accept=_same_form(weights, graph_form, kept_apart, ""))
    for fn in out.functions:
        def body_form(w: graph.Weight, fn=fn):
            # (a body's weights all stay float under include patterns; one whose body imports too old an
            # opset may still be quantized once the model is raised: equal ones share the dtype that decides it)
            reason = _keep_reason(w, [], exclude_p, ops, min_elements) or ("not included" if include_p else None)
            return reason, graph.choose_axis(w, lambda name, _key: _body_uses(fn, name)) if reason is None else None

        merges += _dedupe.find_duplicates(out, scope=fn,
                                          accept=_same_form(_function_weights(fn, ""), body_form, kept_apart,
                                                            f" in {_function_location(fn)}"))
    if merges:
        _dedupe.apply_merges(out, merges)
        _dedupe.report_merges(merges, report)
    if kept_apart and report is not None:
        apart = sorted(set(kept_apart))
        report.note(f"{len(apart)} weight(s) equal to another kept apart ({', '.join(apart[:5])}"
                    f"{', ...' if len(apart) > 5 else ''}): each is a MatMul weight that onnxruntime runs as "
                    "MatMulNBits only while its levels are read once; a .onnxz stores equal payloads once")
    return merges


def _same_form(weights: list[graph.Weight], form_of, kept_apart: list[str], where: str):
    """A find_duplicates veto for one scope whose weights are `weights`: two equal weights merge
    when form_of(weight) -> (reason kept or None, axis or None) gives both the same form, and
    neither is a weight onnxruntime fuses alone (below; its name + `where` goes to kept_apart)."""
    by_name: dict[str, list[graph.Weight]] = {}
    for w in weights:
        by_name.setdefault(w.name, []).append(w)
    forms_of: dict[str, tuple | None] = {}

    def form(name: str) -> tuple | None:
        if name not in forms_of:
            found = by_name.get(name, [])
            if len(found) != 1:  # (repeated names: left as they are)
                forms_of[name] = None
            else:
                reason, axis = form_of(found[0])
                forms_of[name] = (reason,) if axis is None else (None, axis.channel, axis.reduce)
        return forms_of[name]

    def fused_alone(name: str) -> bool:
        # A quantized weight whose one reader is a MatMul's weight input: onnxruntime fuses its
        # DequantizeLinear + MatMul into MatMulNBits (int8 in memory, faster than float) only
        # while the levels have no other reader (function bodies are inlined first). Merged, two
        # such weights would be dequantized at every run instead (a 512x512 MatMul: 0.04 -> 2.2 ms
        # a run), so they stay apart here; a pack stores their equal payloads once anyway
        # (FORMAT.md, codec same).
        w = by_name[name][0]
        return (form(name) or (0,))[0] is None and len(w.uses) == 1 and \
            w.uses[0].node.op_type == "MatMul" and w.uses[0].node.domain in ("", "ai.onnx") and w.uses[0].index == 1

    def accept(dropped: str, kept: str) -> bool:
        if form(dropped) is None or form(dropped) != form(kept):
            return False
        if fused_alone(dropped) or fused_alone(kept):
            kept_apart.append(dropped + where)
            return False
        return True

    return accept


def _function_constants(fn: onnx.FunctionProto):
    """(node, tensor) of the Constant nodes at the top of a function body whose value is stored
    there (not a ref_attr_name: those take the call's attribute, nothing is stored)."""
    for node in fn.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        for a in node.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR and not a.ref_attr_name:
                yield node, a.t


def _function_weights(fn: onnx.FunctionProto, where: str) -> list[graph.Weight]:
    """The float weights of a function body's Constant nodes, with their uses in the body."""
    readers: dict[str, list[graph.Use]] = {}
    for node in fn.node:
        for i, name in enumerate(node.input):
            if name:
                readers.setdefault(name, []).append(graph.Use(node, i, -1))
    outputs = set(fn.output)
    return [graph.Weight(node.output[0], t, -1, f"{where}: Constant node", node=node,
                         uses=readers.get(node.output[0], []), graph_output=node.output[0] in outputs)
            for node, t in _function_constants(fn) if t.data_type in _QUANTIZABLE_TYPES]


def _function_location(fn: onnx.FunctionProto) -> str:
    return f"function {fn.domain}:{fn.name}" + (f" ({fn.overload})" if fn.overload else "")


def _function_opset(fn: onnx.FunctionProto) -> int:
    """The default-domain opset a function body imports (0: none)."""
    return next((int(o.version) for o in fn.opset_import if o.domain in ("", "ai.onnx")), 0)


def _function_candidates(out: onnx.ModelProto, include_p, exclude_p, ops, min_elements) -> list[graph.Weight]:
    """The function-body weights _quantize_function_weights would quantize, opsets aside."""
    if include_p:
        return []
    return [w for fn in out.functions for w in _function_weights(fn, "")
            if _keep_reason(w, [], exclude_p, ops, min_elements) is None]


@dataclass
class _FunctionForm:
    """quantize_weights' options, as the function bodies' weights need them."""
    bits: int
    granularity: str
    block: int
    levels: forms.Levels
    rounding: _rounding.Rounding
    scale_mantissa_bits: int | None
    storage: int


def _quantize_function_weights(out: onnx.ModelProto, form: _FunctionForm, include_p, exclude_p, ops,
                               min_elements: int, report: Report | None) -> int:
    """Quantize, in place, the float weights in Constant nodes of `out`'s model-local function
    bodies: each becomes Constant levels, scale [and zero point] + DequantizeLinear in the body,
    under the weight's own name (the body's other nodes untouched). Returns how many.

    Sound whatever the calls: a stored Constant has the same value at every call (a call's
    attributes reach a body only through ref_attr_name, which such a Constant does not have:
    those are no weights), and the DequantizeLinear reads only the body's own new Constants.
    Left float, each a report row "kept: ...", and one note counting them:
    - every body weight when include patterns are given (they name the graphs' weights: the auto
      mode names those it measured, and a body's local names could match one by chance);
    - a weight whose form needs a newer DequantizeLinear than the body imports (per channel 13,
      float16 scales 19, 4-bit or blocks 21): raising one function's opset would convert its
      other nodes as well (the model, its functions with it, was raised for them before when it
      could be: _with_opset_for).
    The axis follows the body's own consumers, as in a graph. Constants inside subgraphs of body
    nodes stay as they are (a rare layout; fold_dequantize folds them all the same)."""
    done = 0
    kept: dict[str, int] = {}  # reason -> weights left float that a graph would have quantized
    for fn in out.functions:
        where = _function_location(fn)
        opset = _function_opset(fn)
        # a function is a scope of its own: new names need only be unique in its body
        names = graph.NameAllocator(set(fn.input) | set(fn.output) | {n for node in fn.node for n in
                                                                       (*node.input, *node.output, node.name) if n})
        replaced: dict[str, list[onnx.NodeProto]] = {}
        for w in _function_weights(fn, where):
            t = w.tensor
            reason = _keep_reason(w, [], exclude_p, ops, min_elements)
            if reason is not None:  # (what a graph keeps too: a row only from the report's own rules)
                continue
            need = _required_opset(t.data_type, form.bits, form.granularity)
            if include_p:
                reason = "not included (include patterns name the graphs' weights, not function bodies')"
            elif opset < need:
                reason = (f"its function imports opset {opset or 'none'} of the default domain; this form's "
                          f"DequantizeLinear needs {need}")
            result = None
            if reason is None:
                result = _Job(t, graph.choose_axis(w, lambda name, _key: _body_uses(fn, name)), form.granularity,
                              form.block, form.levels, form.rounding, None, form.scale_mantissa_bits).run()
                if result is None:
                    reason = "non-finite values"
            nbytes = graph.tensor_nbytes(t)
            if reason is not None:
                kept[reason] = kept.get(reason, 0) + 1
                if report is not None:
                    report.add(TensorChange(w.name, w.shape, graph.type_name(t.data_type), f"kept: {reason}",
                                            nbytes, nbytes, None, w.location))
                continue
            axis, blk, qz = result
            parts, dq_nodes = _dequantize_nodes(w, qz, axis, blk, form.storage, names)
            consts = [helper.make_node("Constant", [], [n], name=names.take(n + "_Constant"),
                                       value=graph.array_to_tensor(a, n, e)) for a, n, e in parts]
            replaced[w.name] = consts + dq_nodes
            done += 1
            if report is not None:
                report.add(_rounding.QuantizedChange(
                    w.name, w.shape, graph.type_name(t.data_type),
                    _scheme(form.levels, form.bits, axis, blk) + ("/rdo" if qz.rounding == "rdo" else ""), nbytes,
                    sum(graph.array_nbytes(a, e) for a, _, e in parts), qz.snr_db(), w.location,
                    rounding=qz.rounding, packed_bits_per_weight=qz.bits_per_weight, rd_lambda=qz.rd_lambda,
                    step_scale=qz.step_scale))
        if replaced:
            body = _constants_replaced(fn.node, replaced)
            del fn.node[:]
            fn.node.extend(body)
    if kept and report is not None:
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(kept.items()))
        report.note(f"{sum(kept.values())} float weight(s) inside model-local functions stay float ({why})")
    return done


def _body_uses(fn: onnx.FunctionProto, name: str) -> list[graph.Use]:
    return [graph.Use(node, i, -1) for node in fn.node for i, n in enumerate(node.input) if n == name]


def _standard_copy(source: onnx.ModelProto, payloads: dict, report: Report | None) -> onnx.ModelProto:
    """The copy the quantized model is built in (without the payloads of the weights about to be
    replaced), in the form the rewrite needs: sparse initializers dense, IR 3 initializers no longer
    listed as inputs, nodes in topological order; each change noted. Raises InvalidModelError
    when the model is not valid ONNX (graph.refuse_invalid: what onnx.checker refuses)."""
    out = graph.copy_model(source, set(payloads))
    graph.standard_form(out, report, rewritten="quantized")
    # an input the checker refuses would come out refused too (and, with nothing quantized, as it was)
    graph.refuse_invalid(out, payloads)
    return out


def _with_opset_for(out: onnx.ModelProto, chosen: list, bits: int, granularity: str, payloads: dict,
                    report: Report | None, in_functions: list = ()) -> onnx.ModelProto:
    """`out`, converted to the lowest opset whose DequantizeLinear writes the chosen weights' form
    (per-channel: 13, bfloat16 or blocks: 21, ...) when it imports an older one. `in_functions`:
    the function-body weights to quantize; a raise only they ask for that fails leaves the model
    as it is (those weights then stay float, with the reason: _quantize_function_weights)."""
    need = max((_required_opset(w.tensor.data_type, bits, granularity) for w in chosen), default=0)
    for_functions = max((_required_opset(w.tensor.data_type, bits, granularity) for w in in_functions), default=0)
    if for_functions > max(need, graph.default_opset(out)) and graph.default_opset(out):
        try:
            raised, how = graph.raise_opset(out, for_functions, payloads)
        except UnsupportedFormError:
            pass
        else:
            if report is not None:
                report.note(how)
            return raised
    if not chosen or graph.default_opset(out) >= need:
        return out
    if graph.default_opset(out) == 0:
        raise UnsupportedFormError("the model imports no default-domain opset; cannot add DequantizeLinear")
    out, how = graph.raise_opset(out, need, payloads)
    if report is not None:
        report.note(how)
    return out


def _note_weights_left_float(out: onnx.ModelProto, min_elements: int, report: Report) -> None:
    """Notes on float weights the rewrite does not reach (with why), float values held in node
    attributes, and weights another tool already quantized."""
    for what, count in _unreached_weights(out, min_elements).items():
        if count:
            report.note(f"{count} float weight(s) {what} stay float (not quantized)")
    for note in (attribute_weights_note(out, min_elements), _prequantized_note(out, min_elements)):
        if note:
            report.note(note)


def _note_graph_input_weights(weights: list, reasons: list, min_elements: int, report: Report) -> None:
    """A note on the weights kept because they are also graph inputs (IR >= 4: the caller may feed
    another value, so they are no constants; torch's keep_initializers_as_inputs=True and many older
    exports list every weight so): without it a model made only of such weights came out at 100% of
    its size with no word why."""
    listed = [w for w, r in zip(weights, reasons) if r == "also a graph input (overridable)"
              and len(w.shape) >= 2 and math.prod(w.shape) >= max(min_elements, 2)]
    if listed:
        nbytes = sum(graph.tensor_nbytes(w.tensor) for w in listed)
        names = ", ".join(w.name for w in listed[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
        report.note(f"{len(listed)} float weight(s) ({nbytes / 1024:.1f} kB) also listed as graph inputs (overridable "
                    f"by the caller) stay float: {names}; a model whose caller never feeds them can list them no "
                    "more (they are then constants, and quantized): include= / --include naming them does that")


def _unlist_included(out: onnx.ModelProto, include_p, exclude_p, ops, min_elements: int,
                     report: Report | None) -> list[str]:
    """Main-graph initializers also listed as graph inputs (IR >= 4) that include= names by name
    leave the graph's inputs, in place, so that they can be quantized: the user asked
    for them, and a weight given by a DequantizeLinear can be no input. The model's interface
    changes (a caller can no longer feed another value), which the note says. Only those named:
    an op-type pattern ("MatMul") or no include= leaves every listing as it is. Returns the names."""
    weights, _ = graph.find_weights(out)
    named = [w.name for w in weights if w.graph_input and w.graph_key == 0 and w.node is None
             and _keep_reason(w, include_p, exclude_p, ops, min_elements) is None]
    gone = graph.unlist_initializers(out, named)
    if gone and report is not None:
        shown = ", ".join(gone[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
        report.note(f"{len(gone)} weight(s) named by include were also listed as graph inputs: unlisted ({shown}), "
                    "so they are constants of the compressed model, quantized, and can no longer be overridden by "
                    "a feed")
    return gone


def _dequantize_nodes(w: graph.Weight, qz, axis, blk, storage: int, names: graph.NameAllocator):
    """The stored tensors [(array, name, element type)] of one quantized weight (levels, scale and,
    when asymmetric, zero point) and the nodes that give the weight back under its own name: its
    DequantizeLinear, and for bfloat16 and float64 a Cast after it."""
    q_name = names.take(w.name + "_quantized")
    s_name = names.take(w.name + "_scale")
    z_name = names.take(w.name + "_zero_point") if qz.zero_point is not None else None
    parts = [(qz.q, q_name, storage), (qz.scale, s_name, w.tensor.data_type)]
    if z_name:
        parts.append((qz.zero_point, z_name, storage))
    attrs = {}
    if axis is not None:
        attrs["axis"] = int(axis)
    if blk:
        attrs["block_size"] = int(blk)
    dq_out, tail = w.name, []
    if w.tensor.data_type in _CAST_AFTER_TYPES:
        # onnxruntime (1.2x) has no bfloat16 DequantizeLinear on the CPU, and DequantizeLinear has
        # no float64 output: the scale is stored as float32 (exact: forms chose it in float32) and a
        # Cast gives the weight its own type (float32 -> float64 exact, -> bfloat16 nearest even)
        parts[1] = (qz.scale.astype(np.float32), s_name, TensorProto.FLOAT)
        dq_out = names.take(w.name + "_dequantized")
        tail = [helper.make_node("Cast", [dq_out], [w.name], name=names.take(w.name + "_Cast"),
                                 to=w.tensor.data_type)]
    dq = helper.make_node("DequantizeLinear", [p[1] for p in parts], [dq_out],
                          name=names.take(w.name + "_DequantizeLinear"), **attrs)
    return parts, [dq, *tail]


def _constants_replaced(nodes, replaced: dict) -> list:
    """Copies of `nodes` with each Constant node whose output is a key of `replaced` swapped for
    that key's nodes (its levels, scale and DequantizeLinear), in place of the Constant."""
    out = []
    for node in nodes:
        if node.op_type == "Constant" and node.output and node.output[0] in replaced:
            out.extend(replaced[node.output[0]])
        else:
            c = onnx.NodeProto()
            c.CopyFrom(node)
            out.append(c)
    return out


def _splice(graphs: list, new_inits: dict, new_first_nodes: dict, const_nodes: dict) -> None:
    """Put the quantized tensors and their nodes into each graph (subgraphs of If/Loop/Scan too):
    replaced initializers out and their stored tensors in, the DequantizeLinear nodes first, each
    rewritten Constant node replaced by its Constant tensors and DequantizeLinear."""
    # children before parents: rewriting a parent copies its nodes, subgraphs included
    for info in reversed(graphs):
        k = info.key
        if k not in new_inits and k not in const_nodes and k not in new_first_nodes:
            continue
        g = info.graph
        if k in new_inits:
            repl = new_inits[k]
            # in place: kept tensors are not copied again (they can be most of a large model)
            for i in reversed([i for i, t in enumerate(g.initializer) if t.name in repl]):
                del g.initializer[i]
            for parts in repl.values():
                while parts:  # each array is released once it is in the graph
                    arr, name, elem_type = parts.pop(0)
                    graph.fill_tensor(g.initializer.add(), arr, name, elem_type)
        nodes = list(new_first_nodes.get(k, [])) + _constants_replaced(g.node, const_nodes.get(k, {}))
        del g.node[:]
        g.node.extend(nodes)


@dataclass
class _Job:
    """One weight to quantize; `run` reads its payload and does the numeric work (thread-safe)."""
    tensor: TensorProto
    choice: graph.AxisChoice
    granularity: str
    block: int
    levels: forms.Levels
    rounding: _rounding.Rounding = _rounding.Rounding()
    importance: np.ndarray | None = None
    scale_mantissa_bits: int | None = None

    def run(self):
        """(axis, block size, forms.Quantized), or None when the weight holds inf or nan."""
        arr = graph.tensor_to_array(self.tensor)
        if not np.isfinite(arr).all():
            return None
        # a vector (one axis holds every value: a weight named by include= that the rules would keep
        # as 1-D) has no channels: per channel it would take one scale per value and outgrow the
        # float tensor (65536 -> 81920 bytes); it is quantized per tensor
        vector = self.granularity == "channel" and arr.size > 0 and max(arr.shape) == arr.size
        if self.granularity == "tensor" or arr.ndim == 0 or vector:
            axis, blk = None, 0
        elif self.granularity == "channel":
            axis = self.choice.channel
            if axis is None:
                axis = _best_axis(arr.astype(np.float32), self.levels)
            blk = 0
        else:
            axis, blk = self._block_axis(arr)
        imp = self.importance
        if imp is not None:
            try:
                imp = np.broadcast_to(imp, arr.shape)
            except ValueError:
                raise InvalidArgumentError(f"importance of {self.tensor.name}: shape {np.shape(self.importance)} "
                                           f"does not broadcast to the weight's {arr.shape}") from None
        return axis, blk, forms.quantize_linear(arr, self.levels, axis, blk, rounding=self.rounding, importance=imp,
                                                scale_mantissa_bits=self.scale_mantissa_bits)


    def _block_axis(self, arr: np.ndarray) -> tuple[int, int]:
        """(axis, block size) for granularity="block".

        Blocks run along the dot-product axis. When that axis is shorter than a block (a Conv
        with one input channel, such as an STFT kernel [257, 1, 512], or a depthwise kernel),
        blocks along it would hold a handful of weights each, one scale per few weights, and
        the "compressed" tensor would outgrow the float one. Then blocks run along the longest
        other axis that holds a whole block and is not the channel axis (a Conv's kernel taps
        are summed over too), else one scale per channel.
        """
        reduce = self.choice.reduce if self.choice.reduce is not None else arr.ndim - 1
        if arr.shape[reduce] >= self.block:
            return reduce, self.block
        others = [a for a in range(arr.ndim) if a not in (reduce, self.choice.channel) and arr.shape[a] >= self.block]
        if others:
            return max(others, key=lambda a: (arr.shape[a], -a)), self.block
        if arr.shape[reduce] >= _MIN_SHORT_BLOCK:
            return reduce, self.block  # a short block (the whole axis) is still worth its scale
        channel = self.choice.channel
        if channel is None:
            channel = _best_axis(arr.astype(np.float32), self.levels)
        return channel, 0


# shortest dot-product axis still blocked when no axis holds a whole block: below it a float32
# scale per block costs as much as the 4-bit weights it serves
_MIN_SHORT_BLOCK = 8


SMALL_JOB_ELEMENTS = 1 << 21  # below this many weight values in all, quantize on the calling thread


def _threads() -> int:
    """Worker threads for the numeric work (numpy releases the GIL); results never depend on it."""
    return min(usable_cpus(), 8)


def _ordered_map(fn, items: list, threads: int):
    """fn over items in order, `threads` at a time, at most threads + 1 results held ahead
    (each result can be hundreds of MB on a large model)."""
    if threads <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        pending = collections.deque()
        ahead = iter(items)
        try:
            for item in itertools.islice(ahead, threads + 1):
                pending.append(pool.submit(fn, item))
            while pending:
                result = pending.popleft().result()
                for item in itertools.islice(ahead, 1):
                    pending.append(pool.submit(fn, item))
                yield result
        finally:
            for f in pending:
                f.cancel()


_FLOAT16_MAX = 65504.0


def float16_valued(model: onnx.ModelProto, names) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` whose named float32 tensors hold the nearest float16 values (still float32
    tensors: the graph and every consumer are unchanged), and the names changed. A name is an
    initializer's, in the main graph or any subgraph, or the output of a Constant node holding a
    tensor (`value`), wherever that node is.

    Why: the auto mode keeps a weight float when even its 8-bit levels cost too much fidelity, and a
    float32 weight packs at ~25-27 bits per value (its mantissa bytes are noise). A float32 tensor
    whose values are all float16 values is stored by the pack in two bytes a value (its narrow
    codec; zstd in the skeleton for the small ones), at a relative error of at most 2**-11 per value
    (~70 dB of weight SNR, 20 dB above int8 levels). Skipped, and left as they are: names that are
    none of those, tensors stored outside the model (external data), and tensors with a value
    float16 cannot hold (non-finite, or beyond +-65504).
    The input model is not modified."""
    wanted = set(names)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    changed = []
    for name, t in _float_tensors(out):
        if name not in wanted or t.data_type != TensorProto.FLOAT or t.data_location == TensorProto.EXTERNAL:
            continue
        arr = graph.tensor_to_array(t)
        if arr.size == 0 or not np.all(np.isfinite(arr)) or float(np.max(np.abs(arr))) > _FLOAT16_MAX:
            continue
        _replace_values(t, arr.astype(np.float16).astype(np.float32))
        changed.append(name)
    return out, changed


def _replace_values(t: TensorProto, values: np.ndarray) -> None:
    """`t` (float32, in the model) holding `values` instead, with its name, dims (a Constant's
    scalar keeps its empty ones) and doc string."""
    narrow = TensorProto()
    graph.fill_tensor(narrow, values, t.name, TensorProto.FLOAT)
    narrow.dims[:] = t.dims
    narrow.doc_string = t.doc_string
    t.CopyFrom(narrow)


def _float_tensors(model: onnx.ModelProto):
    """(name, TensorProto) of every initializer and every Constant node's `value` tensor (named by
    the node's output), in the main graph and every subgraph, parents first."""
    for info in graph.iter_graphs(model):
        for t in info.graph.initializer:
            yield t.name, t
        for node in info.graph.node:
            if node.op_type == "Constant" and node.output and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                        yield node.output[0], attr.t


SCALE_BITS = 11  # round_scales' default: float16's precision (with float32's exponent range)


def round_scales(model: onnx.ModelProto, bits: int = SCALE_BITS) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` whose float32 quantization scales (DequantizeLinear's input 1; the scale a
    Mul applies to a Cast of integer levels, cast_levels' forms) hold `bits` significant bits
    (forms.round_scale_mantissa, to nearest even), and the names changed. The levels are left as
    they are: each dequantized weight moves by at most 2**-bits of itself (2**-11 relative at 11
    bits: ~77 dB of weight SNR, ~30 dB below int8 levels' own error), so an error-fed form's levels
    need no refit.

    Why: per-channel float32 scales pack at ~25-29 bits each (their low mantissa bytes are noise):
    rapidocr_cls's auto model spends 8.2% of its pack on 3050 of them, silero_vad_v6 2.9%. With 11
    bits their low 13 bits are zero and they pack at ~15 bits. Done once on the finished model
    rather than inside the search, whose path any perturbation of the forms moves.

    Left as they are: tensors any other op reads (or a graph output), non-float32 ones, external
    data, and tensors with a value that is not finite and positive. The input is not modified."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 24:
        raise InvalidArgumentError(f"bits must be an integer from 1 to 24, got {bits!r}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    integer_tensors = {name for name, t in _float_tensors(out) if t.data_type in _INTEGER_TYPES}
    readers: dict[str, list] = collections.defaultdict(list)
    producers: dict[str, onnx.NodeProto] = {}
    outputs = set()
    for info in graph.iter_graphs(out):
        outputs.update(o.name for o in info.graph.output)
        for node in info.graph.node:
            for i, name in enumerate(node.input):
                if name:
                    readers[name].append((node, i))
            for o in node.output:
                producers[o] = node

    def levels(name: str) -> bool:  # name is (a Sub / Reshape of) a Cast of integer levels
        node = producers.get(name)
        for _ in range(8):
            if node is None or node.op_type not in ("Cast", "Sub", "Reshape") or not node.input:
                return False
            if node.op_type == "Cast":
                return node.input[0] in integer_tensors
            node = producers.get(node.input[0])
        return False

    def scale_only(name: str) -> bool:
        uses = readers.get(name)
        if not uses or name in outputs:
            return False
        for node, i in uses:
            if node.op_type == "DequantizeLinear" and i == 1:
                continue
            if node.op_type == "Mul" and len(node.input) == 2 and levels(node.input[1 - i]):
                continue
            return False
        return True

    changed = []
    for name, t in _float_tensors(out):
        if t.data_type != TensorProto.FLOAT or t.data_location == TensorProto.EXTERNAL or not scale_only(name):
            continue
        arr = graph.tensor_to_array(t)
        if arr.size == 0 or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
            continue
        rounded = forms.round_scale_mantissa(arr, int(bits))
        if np.array_equal(rounded, arr) or not np.all(np.isfinite(rounded)):
            continue
        _replace_values(t, rounded)
        changed.append(name)
    return out, changed


# ops whose float inputs are plain arithmetic operands: a value off by float16 rounding (2**-11
# relative) moves the output by as little. Ops that read a float as a size, an index, a threshold
# or a comparison (Resize scales, Range, Clip bounds, Where conditions, ...) are left out.
_ARITHMETIC_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Conv", "ConvTranspose", "Gemm", "MatMul", "PRelu",
                             "BatchNormalization", "LayerNormalization", "InstanceNormalization",
                             "GroupNormalization", "SkipLayerNormalization", "LSTM", "GRU", "RNN"})
_FLOAT16_MIN_NORMAL = 2.0 ** -14
_INTEGER_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4,
                            TensorProto.INT16, TensorProto.UINT16, TensorProto.INT32})


def float_parameters(model: onnx.ModelProto, exclude=()) -> list[str]:
    """Names of the float32 tensors (initializers, Constant nodes' values; main graph and
    subgraphs) that only arithmetic reads (biases, the per-channel Sub / Mul / Add vectors of an
    unfolded normalisation, LayerNorm scales and shifts, recurrent layers' biases), the candidates
    for float16_valued besides the weights a plan keeps float. A read through ops that only move
    values (Reshape, Unsqueeze, Slice, Transpose, ... of the data input; Concat) counts as the reads
    of what they give.

    Left out: `exclude` (the searched weights), whatever a quantized weight's form reads
    (DequantizeLinear's inputs; the scale a Mul applies to a Cast of levels, cast_levels' forms:
    rounding those would move every level's value, not one parameter), tensors any other op or a
    graph output (of any graph) reads, tensors whose largest value is below float16's smallest
    normal (2**-14; there float16 keeps fewer bits), and divisors with a nonzero value below it (a
    divisor's values count each relative to itself). Elsewhere a value in float16's subnormal range
    is off by at most 2**-25, below 2**-11 of the tensor's largest value.
    Why: open_nsfw keeps its batch normalisations as Sub/Mul/Add by 49,000 float32 values after
    its Convs (3% of the auto model's pack at ~26 bits a value); as float16 values they pack in two
    bytes each. rapidocr_cls's per-channel vectors sit in Constant nodes behind a Reshape (1012
    values), silero_vad_v6's Conv biases in Constant nodes of its If branches and its LSTM biases
    (Slice -> Concat -> Unsqueeze -> LSTM's B)."""
    skip = set(exclude)
    graphs = graph.iter_graphs(model)
    integer_tensors = {name for name, t in _float_tensors(model) if t.data_type in _INTEGER_TYPES}
    readers: dict[str, list] = collections.defaultdict(list)
    cast_outputs = set()
    for info in graphs:
        skip.update(o.name for o in info.graph.output)
        for node in info.graph.node:
            for i, name in enumerate(node.input):
                if name:
                    readers[name].append((node, i))
            if node.op_type == "Cast" and node.output and node.input and node.input[0] in integer_tensors:
                cast_outputs.add(node.output[0])

    def arithmetic_reads(name: str, depth: int = 0):
        """The (node, input index) of the arithmetic ops that read `name`, through value-moving ops;
        None if anything else reads it (or nothing does)."""
        uses = readers.get(name)
        if not uses or name in skip and depth or depth > 8:
            return None
        found = []
        for node, i in uses:
            if node.op_type in graph.VALUE_MOVING_OPS and i == 0 or node.op_type == "Concat":
                below = [arithmetic_reads(o, depth + 1) for o in node.output if o]
                if not below or any(b is None for b in below):
                    return None
                found.extend(r for b in below for r in b)
                continue
            if node.op_type not in _ARITHMETIC_OPS:
                return None
            if node.op_type == "Mul" and any(x in cast_outputs for j, x in enumerate(node.input) if j != i):
                return None  # a cast_levels scale: levels x scale
            found.append((node, i))
        return found

    out = []
    for name, t in _float_tensors(model):
        if name in skip or t.data_type != TensorProto.FLOAT or t.data_location == TensorProto.EXTERNAL:
            continue
        reads = arithmetic_reads(name)
        if reads is None:
            continue
        arr = np.abs(graph.tensor_to_array(t))
        if arr.size == 0 or float(arr.max()) < _FLOAT16_MIN_NORMAL:
            continue  # all of it in float16's subnormal range (or empty)
        divisor = any(node.op_type == "Div" and i == 1 for node, i in reads)
        if divisor and float(arr[arr != 0].min(initial=np.inf)) < _FLOAT16_MIN_NORMAL:
            continue  # a divisor's every value counts relative to itself
        out.append(name)
    return out
