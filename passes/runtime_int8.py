"""mode="int8" / "int4" at load: weights stay quantized in memory, in forms onnxruntime runs
without dequantizing whole weights on every run.

Weights written as Cast(levels) -> [Sub] -> Mul(scale) (passes.compress with a target, see
cast_levels; the blocked form Cast -> Mul -> Reshape too, as a blocked DequantizeLinear) are read
as DequantizeLinear first (cast_levels.dequantize_graph, the same values; in If/Loop/Scan bodies
too, where the DequantizeLinear runs in the body): onnxruntime would fold them to float at load. Then per weight (a constant DequantizeLinear, or a
float weight quantized here at load):
- consumed only as MatMul's B or Gemm's B -> com.microsoft MatMulNBits (bits 8 or 4, blocks along
  K; a per-channel or per-tensor scale is repeated over the blocks, so the values are exactly the
  DequantizeLinear's). onnxruntime prepacks it for its integer kernels;
- consumed only as Gather's data (embedding tables, gather axis 0) -> Gather on the integer table,
  then the gathered rows are dequantized (Cast, Sub zero point, Mul scale): only the rows a run
  needs are ever float;
- anything else (Conv, ...) -> the DequantizeLinear stays (int8 in memory, dequantized per run);
  measured on ResNet-50 this beats ConvInteger with dynamically quantized activations, see bench.
  The first convolutions (6% of the Conv weights) are folded to float: see early_conv_weights.
Small DequantizeLinear nodes (biases, norms) are folded to float: they cost nothing.

A float weight of a lossless model is quantized at load (this mode's promise is int8 memory):
per output channel, max-abs scale (no clip search, to keep load fast), symmetric int8; for
"int4", blocks of 32 along K for MatMul/Gemm weights with the clip search of passes.forms (at
4 bits it matters), per channel int8 for the others. The weights that main-graph walk cannot
reach go through the offline pass (passes.quantize_weights, per channel int8 with its clip
search, in both modes): float weights inside If/Loop/Scan bodies (their DequantizeLinear runs in
the branch), main-graph weights read inside a subgraph, bfloat16 weights behind a Cast, and (off
by default, see QUANTIZE_RECURRENT_WEIGHTS) the W / R weights of LSTM, GRU and RNN nodes (see
_quantize_with_pass). Big float weights that stay float are listed in the session's `notes`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper

from .graph import NameAllocator, all_names, node_subgraphs
from .runtime_feed import INLINE_MAX_BYTES, SplitModel, main_graph_uses

MS_DOMAIN = "com.microsoft"
# accuracy_level of MatMulNBits: 4 = int8 activations in the kernel (fastest on CPU), chosen by
# measurement (bench/load.py); 0 = float compute (dequantize inside the kernel)
ACCURACY_LEVEL = 4
BLOCK_8BIT = 32     # scales repeated per block of K for per-channel 8-bit weights (32: measured, see bench)
BLOCK_4BIT = 32     # block size when float weights are quantized to 4 bits at load
MIN_QUANTIZE_ELEMENTS = 4096  # float weights smaller than this stay float
EARLY_CONV_FLOAT_SHARE = 0.06  # share of the Conv weights (float bytes) folded to float, first ones first
# (op, input index) of the recurrent weights W and R
RECURRENT_WEIGHT_INPUTS = {(op, i) for op in ("LSTM", "GRU", "RNN") for i in (1, 2)}
# Quantize them at load (quantize_weights, DequantizeLinear feeding W / R)? Off: onnxruntime's
# CPU LSTM takes a constant float W / R once at load (prepacked), but a DequantizeLinear-fed one
# is dequantized to float on every run and that buffer stays in the arena, so the int8 levels
# cost more memory, not less. Measured on ddddocr 1.6.1's CRNN (2 x 8 MiB LSTM weights, 4
# text-line runs, fresh processes): plain onnxruntime RSS after the runs float +79 MB,
# DequantizeLinear-fed +95 MB (+80 vs +76 without the arena); int8 mode +74 MB with them float,
# +137 MB quantized (+32 MB of it the pass's temporaries kept by malloc at load), peak 166 ->
# 238 MB; output SNR 33-35 dB either way. Worth turning on with a form onnxruntime keeps integer
# (e.g. the LSTM unrolled to MatMulNBits).
QUANTIZE_RECURRENT_WEIGHTS = False


@dataclasses.dataclass
class QWeight:
    """Integer levels with DequantizeLinear's parameters: value = (q - zero_point) * scale."""

    q: np.ndarray               # int8/uint8 (int4/uint4 held as int8/uint8 values)
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int | None            # None: per tensor
    block_size: int             # 0: not blocked
    bits: int                   # 8 or 4
    signed: bool


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def float_weight_bytes(split: SplitModel, dtype=None) -> int:
    """Bytes the weights take once folded to float (dtype, else their own float type)."""
    total = 0
    dq_outputs = {}
    for node in split.skeleton.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in split.weights:
            dq_outputs[node.input[0]] = node
    for name, array in split.weights.items():
        if name in dq_outputs:
            scale = split.array(dq_outputs[name].input[1])
            itemsize = np.dtype(dtype).itemsize if dtype is not None else (scale.dtype.itemsize if scale is not None else 4)
            total += array.size * itemsize
        elif array.dtype.kind == "f":
            total += array.size * (np.dtype(dtype).itemsize if dtype is not None else array.dtype.itemsize)
        else:
            total += array.nbytes
    return total


def _role(uses) -> str | None:
    """"matmul" | "gemm" | "gather" | None (keep DequantizeLinear) for a weight's consumers."""
    if len(uses) != 1 or uses[0][0] is None:
        return None
    node, index = uses[0]
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "MatMul" and index == 1:
        return "matmul"
    if node.op_type == "Gemm" and index == 1 and _attr(node, "alpha", 1.0) == 1.0 and not _attr(node, "transA", 0):
        return "gemm"
    if node.op_type == "Gather" and index == 0 and _attr(node, "axis", 0) == 0:
        return "gather"
    return None


ACCURACY_LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"


def session_config(options) -> int:
    """The MatMulNBits accuracy level of this load, which the int8 forms are written with.

    The caller's `session.qdq_matmulnbits_accuracy_level` when their SessionOptions set it (e.g. 0,
    float compute, for fidelity): it is then left as it is (the private copy carries it over) and
    written on every MatMulNBits made here; otherwise ACCURACY_LEVEL, added to our private copy
    (onnxruntime's own DequantizeLinear+MatMul fusions read the entry). `options`: the load's
    OptionsDraft (the caller's options as its `source`) or a SessionOptions."""
    from .errors import InvalidArgumentError
    from .runtime_options import config_entry

    source = getattr(options, "source", options)
    given = config_entry(source, ACCURACY_LEVEL_KEY) if source is not None else None
    if given is None:
        options.add_session_config_entry(ACCURACY_LEVEL_KEY, str(ACCURACY_LEVEL))
        return ACCURACY_LEVEL
    try:
        level = int(given)
    except ValueError:
        level = -1
    if not 0 <= level <= 4:
        raise InvalidArgumentError(f"sess_options' {ACCURACY_LEVEL_KEY} is {given!r}; MatMulNBits takes 0 (unset: "
                                   f"float), 1 (float32), 2 (float16), 3 (bfloat16) or 4 (int8)")
    return level


def prepare_quantized(split: SplitModel, bits: int, options, notes: list | None = None, target=None) -> set:
    """Rewrite `split` for mode int8/int4; returns onnxruntime optimisers to disable. `notes`
    (a list, when given) receives one line per thing the session should say: weights quantized
    by the offline pass here, and float weights that stay float, with why. `target`: the float
    type the model will be converted to after this (precision.convert_split), None: none (or not
    known: then a float16 DequantizeLinear in a body is folded, see fold_float16_subgraph_dequantize)."""
    from .runtime_fold import fold_into

    from .graph import unlist_ir3_initializers

    notes = notes if notes is not None else []
    level = session_config(options)
    # IR 3 lists every initializer as a graph input too; a weight replaced below by a
    # DequantizeLinear output would stay listed, and onnxruntime would then ask the caller for it
    if split.skeleton.ir_version < 4 and unlist_ir3_initializers(split.skeleton):
        notes.append("IR version raised from 3 to 4: initializers are no longer listed as graph inputs "
                     "(a weight quantized here would otherwise be a required input)")
    unlisted = unlist_dequantize_inputs(split.skeleton)
    if unlisted:
        notes.append(f"{len(unlisted)} quantized weight tensor(s) (DequantizeLinear levels / scales / zero points) "
                     f"were also listed as graph inputs: unlisted (constants of this session; rewritten here they "
                     f"would otherwise be required inputs)")
    _dequantize_cast_levels(split, notes)  # Cast+Mul levels (auto mode's form) as DequantizeLinear again
    _quantize_with_pass(split, notes)     # subgraph and bfloat16 weights (may replace split.skeleton)
    _float32_dequantize_before_casts(split)  # float16 levels read through a Cast to float: float32 compute
    _quantize_float_weights(split, bits, notes)  # (may replace split.skeleton: an opset conversion)
    graph = split.skeleton.graph
    uses = main_graph_uses(graph)
    inits = split.initializer_names()
    # activations the model quantizes itself (onnxruntime's static QDQ: QuantizeLinear ->
    # DequantizeLinear before a MatMul): onnxruntime fuses such a MatMul with its weight's
    # DequantizeLinear into its int8 kernels, weights int8 in memory; as MatMulNBits the activation
    # would be quantized a second time (accuracy level 4: a 2-layer QDQ decoder's logits 19.5 dB
    # against the model itself)
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.output}
    left_to_qdq = 0
    replaced = {}
    for node in list(graph.node):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        if not all((not i) or i in inits for i in node.input):
            continue
        qw = _qweight_from_dq(split, node)
        if qw is None or qw.q.nbytes <= INLINE_MAX_BYTES:
            continue
        target_uses = uses.get(node.output[0], [])
        role = _role(target_uses)
        consumer = target_uses[0][0] if target_uses else None
        done = False
        if role in ("matmul", "gemm") and consumer.input and consumer.input[0] in dequantized:
            left_to_qdq += 1
        elif role in ("matmul", "gemm"):
            done = _to_matmulnbits(split, qw, consumer, role, node.output[0], accuracy_level=level)
        elif role == "gather":
            done = _to_gather_rows(split, qw, consumer, node.output[0])
        elif role is None:
            done = _to_tied_forms(split, qw, node.output[0], target_uses, uses, dequantized, accuracy_level=level) \
                or _to_shared_matmulnbits(split, qw, node.output[0], target_uses, dequantized, accuracy_level=level)
        if done:
            replaced[node.output[0]] = node
    if left_to_qdq:
        notes.append(f"{left_to_qdq} MatMul/Gemm weight(s) whose input the model quantizes itself (QDQ) left as "
                     f"DequantizeLinear, for onnxruntime's int8 QDQ kernels (not MatMulNBits, which would quantize "
                     f"that input again)")
    if replaced:
        keep = [n for n in graph.node if not (n.op_type == "DequantizeLinear" and n.output[0] in replaced)]
        del graph.node[:]
        graph.node.extend(keep)
    early = early_conv_weights(split, uses)
    # what stays DequantizeLinear: small tensors are folded, big ones run in onnxruntime; so are
    # the weights of the first convolutions (see early_conv_weights)
    fold_into(split, only=lambda n: n.output[0] in early or (
        split.array(n.input[0]) is not None and split.array(n.input[0]).nbytes <= INLINE_MAX_BYTES * 4))
    fuse_conv_bias_adds(split)
    # a body computing in float16 (a float16 model not converted to float32): its DequantizeLinear
    # nodes are folded (a conversion to float16 folds them in precision.convert_split)
    if target is None or np.dtype(target) == np.float16:
        if TensorProto.FLOAT16 in _subgraph_dequantize_scale_types(split.skeleton):
            fold_float16_subgraph_dequantize(split, notes, reason="float16 model")
    _ensure_ms_opset(split.skeleton)
    split.refresh_placeholders()
    return set()


def _subgraph_dequantize_scale_types(skeleton) -> set:
    """The element types of the scales of the DequantizeLinear nodes inside If/Loop/Scan bodies
    (where a scale is a tensor of the body: initializer or Constant node; 0 for any other), except
    those whose output only a Cast to float32 reads: they compute in float32 whatever their scale
    (what _float32_dequantize_before_casts leaves of that form, e.g. a scale two nodes share)."""
    from .runtime_feed import subgraphs

    found = set()
    stack = [g for node in skeleton.graph.node for g in subgraphs(node)]
    while stack:
        g = stack.pop()
        types = {t.name: t.data_type for t in g.initializer}
        dequantize = []
        for node in g.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value" and node.output:
                        types[node.output[0]] = a.t.data_type
            elif node.op_type == "DequantizeLinear" and len(node.input) > 1:
                dequantize.append(node)
            stack.extend(subgraphs(node))
        uses = main_graph_uses(g) if dequantize else {}
        for node in dequantize:
            readers = uses.get(node.output[0], [])
            if not (readers and all(r is not None and r.op_type == "Cast" and _attr(r, "to", 0) == TensorProto.FLOAT
                                    for r, _ in readers)):
                found.add(types.get(node.input[1], 0))
    return found


def fold_float16_subgraph_dequantize(split: SplitModel, notes: list | None, reason: str) -> int:
    """Fold the constant DequantizeLinear nodes (and the other forms passes.fold folds) inside
    If/Loop/Scan bodies to float, as mode="fold" does; returns how many. For a body that computes in
    float16 (`reason`: why it does, for the note).

    Why: onnxruntime 1.32 at its EXTENDED level fuses a float16 DequantizeLinear + MatMul inside
    a body into MatMulNBits, and that body then yields zeros (float32, or optimisations off:
    right; reproduced with onnxruntime alone); and below opset 19 a float16
    scale is not valid at all, while the float16 converter misplaces the Cast it puts after a
    blocked node in a body. Such weights are float in memory (the body's own tensors: small in
    the models seen, e.g. silero-vad). A DequantizeLinear reading a tensor from outside its body
    (or any input that is not a constant of its body) is not folded; the note counts it."""
    from .fold import FOLDERS
    from .runtime_fold import fold_subgraphs

    if not _subgraph_dequantize_nodes(split.skeleton):
        return 0
    count = fold_subgraphs(split.skeleton.graph, FOLDERS)
    left = len(_subgraph_dequantize_nodes(split.skeleton))
    if notes is not None and count:
        notes.append(f"{count} quantized weight(s) inside If/Loop/Scan bodies folded to float ({reason}): "
                     f"onnxruntime fuses a float16 DequantizeLinear+MatMul in a body into a MatMulNBits that yields "
                     f"zeros (onnxruntime 1.32), and a float16 scale needs opset 19")
    if notes is not None and left:
        notes.append(f"{left} DequantizeLinear node(s) inside If/Loop/Scan bodies read inputs that are not constants "
                     f"of their body and stay (not folded): in float16 onnxruntime may compute them wrongly; check the outputs")
    return count


def _subgraph_dequantize_nodes(skeleton) -> list:
    from .runtime_feed import subgraphs

    found = []
    stack = [g for node in skeleton.graph.node for g in subgraphs(node)]
    while stack:
        g = stack.pop()
        for node in g.node:
            if node.op_type == "DequantizeLinear":
                found.append(node)
            stack.extend(subgraphs(node))
    return found


def unlist_dequantize_inputs(model) -> list:
    """Remove from the main graph's inputs the initializers that main-graph DequantizeLinear nodes
    read (levels, scale, zero point) and that are listed there too (IR >= 4 exports with
    keep_initializers_as_inputs=True, then quantized); returns their names.

    Why: a listed initializer is one the caller may override; the load rewrites or folds these
    nodes, after which the initializer is gone and the listing alone remains: onnxruntime then
    asks every run for it ("Required inputs ([W_quantized, ...]) are missing"). Integer levels
    and their scales are not values a caller feeds. (Float weights listed so stay float and
    listed: see _float_kept_why.)"""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    listed = {v.name for v in graph.input}
    if not listed & inits:
        return []
    read = {i for node in graph.node if node.op_type == "DequantizeLinear" for i in node.input if i}
    names = listed & inits & read
    if not names:
        return []
    for i in reversed([i for i, v in enumerate(graph.input) if v.name in names]):
        del graph.input[i]
    return sorted(names)


# nodes that move or keep values without arithmetic, between a Conv and the per-channel
# arithmetic that follows it
_LAYOUT_OPS = {"Transpose", "Identity", "Cast"}
# per-channel affine steps taken into the Conv: x + c, x - c, x * c (c > 0)
_AFFINE_OPS = {"Add", "Sub", "Mul"}


def fuse_conv_bias_adds(split: SplitModel) -> int:
    """For each Conv whose weight is a constant (float, or out of a per-channel or per-tensor
    DequantizeLinear): the per-channel Add / Sub / Mul by constants that follow it (through
    Transpose, Identity and same-type Cast nodes: a bias, a decomposed BatchNormalization) are
    taken into the Conv: the Muls into the DequantizeLinear's scale (the same int8 levels) or the
    float weight's rows, the rest into the Conv's bias; returns how many Convs were changed.

    Why: onnxruntime takes such nodes into a Conv (ConvAddFusion, ConvMulFusion, NCHWc's fused
    sum) only when the Conv's weight is a constant, so in int8 mode each kept DequantizeLinear
    Conv ran them as separate passes over its whole output; and the decomposed batch norms of
    tf2onnx graphs (Sub, Mul, Add after the bias Add) are not fused by onnxruntime even for float
    weights. Measured on open_nsfw (ResNet-50), one thread, summed kernel times: the bias Adds
    alone 1.23x -> 1.14x float's run time; all of it (Add/Sub/Mul 127/62/55 -> 37/9/16, and
    onnxruntime then fuses Conv+Relu) 1.13x -> 0.85x, top-1 1.000. The arithmetic is regrouped (scale * m,
    (b - s) * m + a computed once): last-bit differences, as for onnxruntime's own fusions on
    float weights; fidelity is the int8 model's."""
    graph = split.skeleton.graph
    producers = {o: n for n in graph.node for o in n.output}
    uses = main_graph_uses(graph)
    outputs = {o.name for o in graph.output}
    removed, fused, renames = set(), 0, {}
    for conv in list(graph.node):
        if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.input) < 2:
            continue
        if len(uses.get(conv.input[1], [])) != 1:
            continue
        dq = producers.get(conv.input[1])
        weight = None
        if dq is None:  # a float weight (folded here, or left float): the Muls scale its rows
            weight = split.array(conv.input[1])
            if weight is None or weight.dtype.kind != "f" or weight.ndim < 3:
                continue
            levels, scale = weight, np.ones(1, weight.dtype)
        elif dq.op_type != "DequantizeLinear" or _attr(dq, "block_size", 0):
            continue
        else:
            levels, scale = split.array(dq.input[0]), split.array(dq.input[1])
        if levels is None or scale is None or scale.dtype.kind != "f" or levels.ndim < 3:
            continue
        channels, rank = levels.shape[0], levels.ndim
        per_tensor = scale.size == 1
        if dq is not None and not per_tensor and (scale.shape != (channels,) or _attr(dq, "axis", 1) % rank != 0):
            continue
        bias_name = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
        bias = split.array(bias_name) if bias_name else np.zeros(channels, scale.dtype)
        if bias is None or bias.shape != (channels,):
            continue
        steps = _affine_steps(conv.output[0], uses, outputs, helper.np_dtype_to_tensor_dtype(scale.dtype), rank,
                              channels, scale.dtype, split)
        if not steps:
            continue
        multiply = np.ones(channels, np.float64)
        add = bias.astype(np.float64)
        for _, op, value in steps:
            if op == "Mul":
                multiply *= value
                add *= value
            else:
                add += value if op == "Add" else -value
        base = conv.output[0]
        if weight is not None:
            if not np.all(multiply == 1):
                rows = multiply.astype(weight.dtype).reshape((channels,) + (1,) * (rank - 1))
                split.set_weight(base + "_fused_weight", weight * rows)
                conv.input[1] = base + "_fused_weight"
        elif not np.all(multiply == 1):
            new_scale = (np.broadcast_to(scale.reshape(-1), (channels,)) * multiply).astype(scale.dtype)
            split.set_weight(base + "_fused_scale", new_scale)
            dq.input[1] = base + "_fused_scale"
            if per_tensor:
                _set_axis(dq, 0)
                if len(dq.input) > 2 and dq.input[2]:
                    zp = split.array(dq.input[2])
                    split.set_weight(base + "_fused_zero_point", np.full(channels, zp.reshape(-1)[0], zp.dtype))
                    dq.input[2] = base + "_fused_zero_point"
        split.set_weight(base + "_fused_bias", add.astype(scale.dtype))
        if len(conv.input) > 2:
            conv.input[2] = base + "_fused_bias"
        else:
            conv.input.append(base + "_fused_bias")
        for node, _, _ in steps:
            data = node.input[0] if split.array(node.input[0]) is None else node.input[1]
            renames[node.output[0]] = data
            removed.add(id(node))
        fused += 1
    if removed:
        keep = [n for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(keep)
        _rename_all(graph, renames)
    return fused


def _rename_all(graph, renames: dict) -> None:
    """Every node input named in `renames` (followed through chains of renames) takes the new
    name, in one walk of the graph and its subgraphs (which read outer names too)."""
    def resolve(name):
        while name in renames:
            name = renames[name]
        return name

    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            for i, inp in enumerate(node.input):
                if inp in renames:
                    node.input[i] = resolve(inp)
            stack.extend(node_subgraphs(node))


def _set_axis(node, axis: int) -> None:
    for a in node.attribute:
        if a.name == "axis":
            a.i = axis
            return
    node.attribute.append(helper.make_attribute("axis", axis))


def _affine_steps(name: str, uses: dict, outputs: set, float_type: int, rank: int, channels: int, dtype,
                  split: SplitModel) -> list:
    """[(node, op, per-channel values)] of the Add/Sub/Mul-by-constant nodes reached from `name`
    through single-consumer layout nodes, in order, up to the first other node."""
    axis, steps = 1, []
    for _ in range(16):
        consumers = uses.get(name, [])
        if len(consumers) != 1 or consumers[0][0] is None or name in outputs:
            break
        node = consumers[0][0]
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            break
        if node.op_type in _AFFINE_OPS and len(node.input) == 2:
            first = node.input[0] == name
            other = node.input[1] if first else node.input[0]
            constant = split.array(other)
            if other == name or constant is None or constant.dtype != dtype or constant.ndim > rank:
                break
            if node.op_type == "Sub" and not first:
                break  # c - x flips the sign: not taken
            shape = (1,) * (rank - constant.ndim) + constant.shape
            if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, channels):
                break
            values = np.broadcast_to(constant.reshape(-1).astype(np.float64), (channels,))
            if node.op_type == "Mul" and not (np.all(np.isfinite(values)) and np.all(values > 0)):
                break  # (a DequantizeLinear scale stays positive and finite)
            steps.append((node, node.op_type, values))
        elif node.op_type in _LAYOUT_OPS:
            if node.op_type == "Cast" and _attr(node, "to", 0) != float_type:
                break
            if node.op_type == "Transpose":
                perm = list(_attr(node, "perm", []) or [])
                if sorted(perm) != list(range(rank)):
                    break
                axis = perm.index(axis)
        else:
            break
        name = node.output[0]
    return steps


def early_conv_weights(split: SplitModel, uses: dict) -> set:
    """Output names of the Conv-weight DequantizeLinear nodes folded to float in int8 mode: the first
    convolutions in graph order, up to EARLY_CONV_FLOAT_SHARE of all the Conv weights' float bytes.

    Why: a Conv whose weight comes out of a DequantizeLinear is not a constant to onnxruntime, so
    it runs without the NCHWc layout (weights reordered once at load) that float Convs get. The
    early convolutions of a CNN see the largest feature maps with the smallest weights: most of
    that loss for little memory. Measured on ResNet-50 (open_nsfw), one thread, min of 32 runs
    each, same process: float 19.7 ms; int8 with no Conv folded 22.3 ms (1.13x), 6% folded
    (1.5 MB) 21.3 ms (1.08x) for added memory 24.5 -> 26.3 MB (float session: 70.6 MB); 12%
    folded added 30.4 MB, over the 0.4x budget."""
    candidates = []
    inits = split.initializer_names()
    # ordered by the Conv's place in the graph (DequantizeLinear nodes may all come first)
    position = {id(node): i for i, node in enumerate(split.skeleton.graph.node)}
    for node in split.skeleton.graph.node:
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        if not all((not i) or i in inits for i in node.input):
            continue
        target = uses.get(node.output[0], [])
        if len(target) != 1 or target[0][0] is None or target[0][0].op_type != "Conv" or target[0][1] != 1:
            continue
        q, scale = split.array(node.input[0]), split.array(node.input[1])
        if q is None or scale is None or scale.dtype.kind != "f":
            continue
        candidates.append((position.get(id(target[0][0]), 0), node.output[0], q.size * scale.dtype.itemsize))
    candidates.sort()
    budget = EARLY_CONV_FLOAT_SHARE * sum(cost for _, _, cost in candidates)
    chosen, spent = set(), 0
    for _, name, cost in candidates:
        if spent + cost > budget:
            break
        spent += cost
        chosen.add(name)
    return chosen


# ---------------------------------------------------------------------- Cast+Mul levels

class _SplitValues:
    """cast_levels.dequantize_graph's store for a split model: big values are fed weights."""

    def __init__(self, split: SplitModel):
        self.split = split

    def get(self, name: str) -> np.ndarray:
        return self.split.array(name)

    def put(self, name: str, value: np.ndarray, elem_type: int) -> None:
        from .graph import array_to_tensor

        if elem_type in (TensorProto.INT4, TensorProto.UINT4):  # a 4-bit zero point: small, inline
            self.split.remove_initializer(name)
            self.split.skeleton.graph.initializer.append(array_to_tensor(value, name, elem_type))
        else:
            self.split.set_weight(name, value)


def _dequantize_cast_levels(split: SplitModel, notes: list) -> int:
    """Weights written as Cast(levels) -> [Sub zero point] -> Mul(scale) (what passes.compress
    with a target writes, see cast_levels) become DequantizeLinear again, so they stay integer in
    memory and take the same forms as DequantizeLinear weights below; onnxruntime would fold them
    to float at load. Main graph and If/Loop/Scan bodies alike: in a body the levels stay inline
    and its DequantizeLinear runs in the body, as for the weights _quantize_with_pass quantizes
    there. Returns how many."""
    from .cast_levels import _GraphValues, dequantize_graph, dequantize_opset, level_patterns, patterns_opset
    from .graph import NameAllocator, all_names, default_opset, iter_graphs, read_counts

    graphs = [info.graph for info in iter_graphs(split.skeleton)]
    found = [pattern for g in graphs for pattern in level_patterns(g)]
    if not found:
        return 0
    total = len(found)
    # blocked forms (Cast+Mul+Reshape) need opset 21 (DequantizeLinear's block_size); where the
    # model cannot be raised that far, the others still get theirs (13, or 19 for float16 scales)
    need = max(patterns_opset(g) for g in graphs)
    plain = max(dequantize_opset(p) for p in found)
    opset = next((v for v in (need, plain) if _opset_at_least(split, v)),  # (may replace the skeleton)
                 default_opset(split.skeleton))
    alloc = NameAllocator(all_names(split.skeleton))
    reads = read_counts(split.skeleton)
    done = in_bodies = 0
    # children before parents: rewriting a graph's node list copies its nodes, so a body reached
    # through the parent's old nodes would be edited after the copy was taken
    for info in reversed(iter_graphs(split.skeleton)):
        main = info.parent is None
        values = _SplitValues(split) if main else _GraphValues(info.graph)  # a body's tensors stay inline
        count = len(dequantize_graph(info.graph, values, reads, alloc, opset=opset))
        done += count
        in_bodies += 0 if main else count
    if done:
        where = f", {in_bodies} of them in If/Loop/Scan bodies" if in_bodies else ""
        notes.append(f"{done} weight(s) written as Cast+Mul of integer levels read as DequantizeLinear{where} "
                     f"(kept quantized in memory; onnxruntime would fold them to float)")
    if done < total:
        notes.append(f"{total - done} Cast+Mul level weight(s) stay as they are (scale not per tensor "
                     f"or per axis, zero point not a level, or opset {need} out of reach): onnxruntime folds them to float")
    return done


# ---------------------------------------------------------------------- reading DequantizeLinear

def _qweight_from_dq(split: SplitModel, node) -> QWeight | None:
    q = split.array(node.input[0])
    scale = split.array(node.input[1])
    zp = split.array(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if q is None or scale is None or scale.dtype.kind != "f":
        return None
    if q.dtype.name in ("int4", "uint4"):  # ml_dtypes 4-bit arrays from onnx
        q = q.astype(np.int8 if q.dtype.name == "int4" else np.uint8)
    if q.dtype not in (np.int8, np.uint8):
        return None
    storage = _storage_type(split, node.input[0])
    bits = 4 if storage in (TensorProto.INT4, TensorProto.UINT4) else 8
    axis = None if scale.ndim == 0 or scale.size == 1 and _attr(node, "block_size", 0) == 0 else _attr(node, "axis", 1) % max(q.ndim, 1)
    block = int(_attr(node, "block_size", 0) or 0)
    return QWeight(q, scale, zp, axis, block, bits, q.dtype == np.int8)


def _storage_type(split: SplitModel, name: str) -> int:
    for t in split.skeleton.graph.initializer:
        if t.name == name:
            return t.data_type
    return 0


# ---------------------------------------------------------------------- load-time quantization

def _quantize_float_weights(split: SplitModel, bits: int, notes: list | None = None) -> None:
    """Float weights of MatMul/Gemm/Gather/Conv become DequantizeLinear(int) in the graph; the
    other big float weights stay float, counted in `notes`."""
    from . import forms
    from .quantize import _QUANTIZED_OPS  # (their float inputs are scales: never quantized, nor counted)

    notes = notes if notes is not None else []
    # (main-graph float64 weights and those listed as graph inputs stay float: see _float_kept_why)
    listed = {v.name for v in split.skeleton.graph.input}
    big = [name for name, w in split.weights.items()
           if w.dtype in _LOAD_QUANTIZED_FLOATS and w.size >= MIN_QUANTIZE_ELEMENTS and name not in listed]
    # DequantizeLinear takes float16/bfloat16 scales (the weight's own dtype) from opset 19 only
    narrow = any(split.weights[name].dtype != np.float32 for name in big)
    # 4-bit blocks need opset 21 (block_size, int4): converted like the others (the opset number
    # alone cannot be bumped: ReduceMean & co. changed at 18, and onnxruntime refused such models)
    if bits == 4 and big and not _opset_at_least(split, 21):
        notes.append("int4: the model's opset cannot be raised to 21 (blocked 4-bit DequantizeLinear): "
                     "its float weights are quantized to int8 per channel instead")
        bits = 8
    # (raised even with nothing to quantize: an old-opset model then runs where onnxruntime has no
    # kernel for its own opset, e.g. Gemm-6; tests/unit/test_onnx_backend_models.py)
    if not _opset_at_least(split, 19 if narrow else 13):
        if big:
            notes.append(f"{len(big)} float weight(s) stay float: the model's opset cannot be raised to "
                         f"{19 if narrow else 13} (DequantizeLinear with an axis)")
        return
    graph = split.skeleton.graph
    uses = main_graph_uses(graph)
    # each weight's parts get names the model does not hold yet (a model may have "W_quantized")
    names = NameAllocator(all_names(split.skeleton) | set(split.weights))
    new_nodes = []
    kept = {}  # why -> [float bytes, count] of big float weights left float
    done = _LoadQuantized()
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.output}
    for name in sorted(split.weights):
        w = split.weights[name]
        if w.dtype.kind != "f" or w.size < MIN_QUANTIZE_ELEMENTS:
            continue
        node_uses = uses.get(name, [])
        if not node_uses:
            continue
        why = _float_kept_why(name, w, listed)
        if why:
            kept.setdefault(why, [0, 0])
            kept[why][0] += w.nbytes
            kept[why][1] += 1
            continue
        if any(n is None for n, _ in node_uses):
            why = ("read inside a subgraph or as a graph output" if node_uses else "unused") + _QUANTIZED_HERE
            kept.setdefault(why, [0, 0])
            kept[why][0] += w.nbytes
            kept[why][1] += 1
            continue
        if all(n.op_type in _QUANTIZED_OPS for n, _ in node_uses):
            continue  # a quantized weight's scale or zero point, not a weight of its own
        ops = {(n.op_type, i) for n, i in node_uses}
        # (a projection whose input the model quantizes itself stays as it is: see prepare_quantized)
        projection = _tied_projection(node_uses, uses) if w.ndim == 2 else None
        tied = projection is not None and projection[1].input[0] not in dequantized
        if ops <= {("MatMul", 1)} and w.ndim == 2:
            axis, block = (0, BLOCK_4BIT) if bits == 4 else (1, 0)
        elif ops <= {("Gemm", 1)} and w.ndim == 2:
            trans = all(_attr(n, "transB", 0) for n, _ in node_uses)
            if bits == 4:
                axis, block = (1 if trans else 0), BLOCK_4BIT
            else:
                axis, block = (0 if trans else 1), 0
        elif tied:
            # an embedding table that is also the output projection ([vocabulary, width]): its rows
            # are the Gather's rows and the projection's output channels, so one scale per row
            # serves both integer forms prepare_quantized gives it (_to_tied_forms: Gather of
            # integer rows, MatMulNBits over the rows); int8 in both modes (the Gather form takes
            # no blocks)
            axis, block = 0, 0
        elif ops <= {("Gather", 0)} or ops <= {("Conv", 1)}:
            axis, block = 0, 0
        elif ops <= {("ConvTranspose", 1)}:
            # [C_in, C_out/group, k..]: axis 1 is the output channel within a group, so with
            # group > 1 it mixes the groups (a depthwise one has a single index there: one scale for
            # the whole weight); axis 0 stays inside one group (the rule graph.choose_axis follows)
            grouped = any(int(_attr(n, "group", 1)) > 1 for n, _ in node_uses)
            axis, block = (0 if grouped or w.ndim < 2 else 1), 0
        else:
            if ops <= {("MatMul", 1)}:
                why = (f"a {w.ndim}-D (batched) MatMul B (MatMulNBits takes a 2-D B; as DequantizeLinear it "
                       "would be dequantized on every run)")
            else:
                why = "consumed by " + "/".join(sorted({f"{op}[{i}]" for op, i in ops}))
                if ops <= RECURRENT_WEIGHT_INPUTS and not QUANTIZE_RECURRENT_WEIGHTS:
                    why += (": onnxruntime would dequantize an int8 recurrent weight to float on every run and"
                            " keep that buffer, more memory than the float weight (QUANTIZE_RECURRENT_WEIGHTS)")
                why += _QUANTIZED_HERE
            kept.setdefault(why, [0, 0])
            kept[why][0] += w.nbytes
            kept[why][1] += 1
            continue
        if block and w.shape[axis] < block:
            axis, block = (1 - axis), 0
        qbits = 4 if bits == 4 and block else 8
        quant = forms.quantize_linear(w, forms.Levels(qbits, True), axis, block, search=qbits == 4)
        done.add(w, quant, qbits, tied)
        q_name, s_name = names.take(name + "_quantized"), names.take(name + "_scale")
        split.remove_initializer(name)
        split.set_weight(q_name, quant.q)
        if qbits == 4:
            _mark_int4(split, q_name)
        split.set_weight(s_name, quant.scale)
        attrs = {"axis": axis}
        if block:
            attrs["block_size"] = block
        new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [name], name=names.take(name + "_dequantize"),
                                          **attrs))
    if new_nodes:
        nodes = new_nodes + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
        _ensure_opset(split.skeleton, 21 if any(_attr(n, "block_size", 0) for n in new_nodes) else 13)
    notes.extend(done.lines())
    for why in sorted(kept):
        nbytes, count = kept[why]
        notes.append(f"{count} float weight(s) ({nbytes / 2**20:.2f} MiB) stay float: {why}")


_QUANTIZED_HERE = " (quantized at load only for MatMul/Gemm B, Gather data, Conv/ConvTranspose weights)"

# the float weights quantized at load (bfloat16 ones go through _quantize_with_pass)
_LOAD_QUANTIZED_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float16)})
GRAPH_INPUT_WHY = "also a graph input (overridable by the caller)"
FLOAT64_WHY = "float64 (MatMulNBits and the integer kernels compute no float64)"
# the float weights quantize_weights quantizes at load (subgraph weights, main-graph weights read in
# subgraphs): any float type, float64 too (DequantizeLinear with a float32 scale -> Cast(DOUBLE))
_PASS_QUANTIZED_FLOATS = _LOAD_QUANTIZED_FLOATS | {np.dtype(np.float64)}


def _float_kept_why(name: str, w: np.ndarray, listed: set) -> str | None:
    """Why the big float weight `name` stays float whatever reads it, or None.

    - listed as a graph input too (IR >= 4; torch's keep_initializers_as_inputs=True): the caller
      may feed it, so it is the model's input as much as a constant; replaced by a
      DequantizeLinear output it would become a required input (no initializer behind the
      listing), as passes.compress keeps such weights float too;
    - float64 (main graph): the rules here exist for onnxruntime's integer kernels (MatMulNBits,
      Gather of integer rows) and none takes double; DequantizeLinear -> Cast(DOUBLE), the form
      passes.compress writes, would dequantize on every run for no memory the session keeps.
      (Weights in subgraphs, or read there, are quantize_weights' at load, float64 ones too: every
      float weight there is dequantized per run anyway. _quantize_with_pass.)"""
    if name in listed:
        return GRAPH_INPUT_WHY
    if w.dtype == np.float64:
        return FLOAT64_WHY
    return None


class _LoadQuantized:
    """What _quantize_float_weights quantized, for the session's notes: how many weights, bytes
    before -> after (levels, 4-bit ones packed two a byte, plus scales), weight SNR."""

    def __init__(self):
        self.count = self.before = self.after = self.tied = 0
        self.schemes = set()
        self.snrs = []

    def add(self, w: np.ndarray, quant, bits: int, tied: bool) -> None:
        self.count += 1
        self.tied += tied
        self.before += w.nbytes
        self.after += (quant.q.size + 1) // 2 if bits == 4 else quant.q.nbytes
        self.after += quant.scale.nbytes
        self.schemes.add(f"int4 blocks of {quant.block_size}" if bits == 4 else
                         "int8 per channel" if quant.axis is not None else "int8 per tensor")
        snr = quant.snr_db()
        if snr is not None:
            self.snrs.append(snr)

    def lines(self) -> list:
        if not self.count:
            return []
        line = (f"{self.count} float weight(s) quantized at load ({', '.join(sorted(self.schemes))}): "
                f"{self.before / 2**20:.2f} -> {self.after / 2**20:.2f} MiB")
        if self.snrs:
            line += f", weight SNR min {min(self.snrs):.1f} dB, median {float(np.median(self.snrs)):.1f} dB"
        lines = [line]
        if self.tied:
            lines.append(f"{self.tied} of them tied between an embedding Gather and an output projection: int8 per row, "
                         "an integer form for each reader")
        return lines


def _is_bfloat16(array: np.ndarray) -> bool:
    return array.dtype.name == "bfloat16"


def _subgraph_float_weights(skeleton) -> int:
    """How many float tensors of at least MIN_QUANTIZE_ELEMENTS elements the subgraphs hold
    (initializers and Constant nodes): the weights the main-graph walk below never sees."""
    from .graph import FLOAT_TYPES
    from .runtime_feed import subgraphs

    # (float64 too: the pass quantizes it, so a body holding only float64 weights calls the pass)
    def big_float(t) -> bool:
        return ((t.data_type in FLOAT_TYPES or t.data_type == TensorProto.DOUBLE)
                and int(np.prod(t.dims, dtype=np.int64)) >= MIN_QUANTIZE_ELEMENTS)

    count = 0
    stack = [g for node in skeleton.graph.node for g in subgraphs(node)]
    while stack:
        g = stack.pop()
        count += sum(big_float(t) for t in g.initializer)
        for node in g.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                count += sum(big_float(a.t) for a in node.attribute if a.name == "value")
            stack.extend(subgraphs(node))
    return count


def _quantize_with_pass(split: SplitModel, notes: list) -> None:
    """Weights the main-graph quantizer below does not reach, quantized by the offline pass
    (passes.quantize_weights: per output channel int8, its clip search, the SNR it reports):
    - float weights inside subgraphs (If/Loop/Scan bodies; silero-vad holds every weight as a
      Constant node in an If's branches): they get DequantizeLinear nodes in their branch, which
      onnxruntime runs there (int8 in memory, dequantized per run; float64 ones then a Cast(DOUBLE));
    - main-graph float weights read inside a subgraph (outer-scope names; their DequantizeLinear
      goes in the main graph);
    - bfloat16 weights (read through a Cast to float: onnxruntime has no bfloat16 Conv/MatMul on a
      CPU): DequantizeLinear with float32 scales; DequantizeLinear -> Cast(bfloat16) -> Cast(float)
      is then shortened to the DequantizeLinear, so the main-graph rules below (MatMulNBits,
      Gather rows, Conv) apply to it as to any quantized weight; likewise float16 weights read only
      through a Cast to float (float16 storage, float32 compute: _float32_dequantize_before_casts);
    - when QUANTIZE_RECURRENT_WEIGHTS (off: it costs memory, see there), main-graph float weights
      read only as W or R of LSTM / GRU / RNN nodes: DequantizeLinear feeds the node's input (int8
      in memory, dequantized per run; the pass picks the gate axis).
    Everything else is left to _quantize_float_weights. What stays float here is said in `notes`."""
    from . import quantize
    from .errors import SurgeonError
    from .report import Report
    from .runtime_feed import is_placeholder, np_dtype_to_onnx, placeholder, split_model

    bf16 = sorted(n for n, w in split.weights.items() if _is_bfloat16(w) and w.size >= MIN_QUANTIZE_ELEMENTS)
    in_subgraphs = _subgraph_float_weights(split.skeleton)
    # main-graph float weights read inside a subgraph (outer-scope names): the pass puts their
    # DequantizeLinear in the main graph, the subgraph reads its output
    outputs = {o.name for o in split.skeleton.graph.output}
    # (weights listed as graph inputs too stay float, and main-graph float64 ones read in the main
    # graph only: see _float_kept_why; _quantize_float_weights says so)
    listed = {v.name for v in split.skeleton.graph.input}
    bf16 = [n for n in bf16 if n not in listed]
    uses = main_graph_uses(split.skeleton.graph) if split.weights else {}
    # float16 weights read only through a Cast to float (float16 storage, float32 compute): like
    # bfloat16 ones, the pass quantizes them (DequantizeLinear with a float16 scale, before the
    # Cast) and _float32_dequantize_before_casts makes that one float32 DequantizeLinear
    cast_f16 = sorted(n for n, w in split.weights.items()
                      if w.dtype == np.float16 and w.size >= MIN_QUANTIZE_ELEMENTS and n not in listed
                      and n not in outputs and _read_only_as_float(uses.get(n, [])))
    outer = sorted(n for n, w in split.weights.items()
                   if w.dtype in _PASS_QUANTIZED_FLOATS and w.size >= MIN_QUANTIZE_ELEMENTS and n not in outputs
                   and n not in listed and any(node is None for node, _ in uses.get(n, [])))
    recurrent = sorted(n for n, w in split.weights.items()
                       if QUANTIZE_RECURRENT_WEIGHTS and w.dtype in _LOAD_QUANTIZED_FLOATS
                       and w.size >= MIN_QUANTIZE_ELEMENTS and n not in outputs and n not in listed
                       and uses.get(n) and all(node is not None and node.domain in ("", "ai.onnx")
                                               and (node.op_type, i) in RECURRENT_WEIGHT_INPUTS
                                               for node, i in uses[n]))
    if not bf16 and not cast_f16 and not in_subgraphs and not outer and not recurrent:
        return
    what = ", ".join(filter(None, [f"{in_subgraphs} in subgraphs" if in_subgraphs else "",
                                   f"{len(outer)} read in subgraphs" if outer else "",
                                   f"{len(bf16)} bfloat16" if bf16 else "",
                                   f"{len(cast_f16)} float16 read as float" if cast_f16 else "",
                                   f"{len(recurrent)} LSTM/GRU/RNN W/R" if recurrent else ""]))
    # float16 scales (a float16 weight in a subgraph) need opset 19; raised here on the real
    # skeleton (the pass would do it on its copy, where the fed weights are stand-ins)
    narrow = bool(cast_f16) or _subgraph_has_type(split.skeleton, TensorProto.FLOAT16) or any(
        split.weights[n].dtype == np.float16 for n in outer)
    need = 19 if narrow else 13
    if not _opset_at_least(split, need):
        notes.append(f"float weights ({what}) stay float: the model's opset cannot be raised to {need}")
        return
    # the skeleton is edited in place for the call (the pass never modifies its input; a copy
    # would hold every subgraph weight once more) and restored after it
    wanted = set(bf16) | set(cast_f16) | set(outer) | set(recurrent)
    graph = split.skeleton.graph
    stubbed = [i for i, t in enumerate(graph.initializer)
               if t.name not in wanted and t.name in split.weights and is_placeholder(t)]
    # The other fed weights are the main-graph quantizer's (or already integers): for the call they
    # are typed graph inputs of their real type and dims (what graph.payload_free_view makes), so the
    # pass neither reads nor quantizes them, in O(1) each, and its validity check (onnx.checker,
    # strict shape inference) sees a valid model. (Typed uint8 placeholders were used before: the
    # checker refused their external-data location and a MatMul reading uint8, so no subgraph weight
    # of a model with any other fed weight was ever quantized.)
    stub_names = [graph.initializer[i].name for i in stubbed]
    for i in reversed(stubbed):
        del graph.initializer[i]
    listed = {v.name for v in graph.input}
    inputs_before = len(graph.input)
    graph.input.extend(helper.make_tensor_value_info(n, np_dtype_to_onnx(split.weights[n].dtype),
                                                     list(split.weights[n].shape))
                       for n in stub_names if n not in listed)
    added = {v.name for v in graph.input[inputs_before:]}
    inlined = []
    for t in graph.initializer:
        if t.name in wanted and t.name in split.weights and is_placeholder(t):  # the pass reads its values
            t.CopyFrom(onnx.numpy_helper.from_array(split.weights[t.name], t.name))
            inlined.append(t)
    report = Report()
    try:
        out = quantize.quantize_weights(split.skeleton, bits=8, granularity="channel",
                                        min_elements=MIN_QUANTIZE_ELEMENTS, report=report)
    except SurgeonError as exc:
        notes.append(f"float weights ({what}) stay float: quantize_weights refused them ({exc})")
        return
    finally:
        for t in inlined:  # the placeholders again
            t.CopyFrom(placeholder(t.name, split.weights[t.name]))
        del graph.input[inputs_before:]
        graph.initializer.extend(placeholder(n, split.weights[n]) for n in stub_names)
    if added:  # (the stand-in inputs are the pass's graph inputs: the placeholders again)
        for i in reversed([i for i, v in enumerate(out.graph.input) if v.name in added]):
            del out.graph.input[i]
    out.graph.initializer.extend(placeholder(n, split.weights[n]) for n in stub_names)
    _shorten_bfloat16_casts(out.graph)
    fresh = split_model(out, take_ownership=True)  # the new big main-graph levels are fed again
    for name in wanted:
        split.weights.pop(name, None)
    split.weights.update(fresh.weights)
    split.skeleton = fresh.skeleton
    split._inline_cache = None

    done = [r for r in report.tensors if r.snr_db is not None and not r.scheme.startswith("kept")]
    if done:
        snrs = [r.snr_db for r in done]
        notes.append(f"{len(done)} weight(s) ({what}) quantized at load by quantize_weights: int8 per channel, "
                     f"{sum(r.bytes_before for r in done) / 2**20:.2f} -> {sum(r.bytes_after for r in done) / 2**20:.2f} MiB, "
                     f"weight SNR min {min(snrs):.1f} dB, median {float(np.median(snrs)):.1f} dB")
    # (rows are float weights only; these reasons are the size rules every mode applies)
    trivial = ("kept: small", "kept: bias", "kept: 1-D", "kept: scalar", "kept: unused", "kept: empty")
    left = [r for r in report.tensors if r.scheme.startswith("kept") and not r.scheme.startswith(trivial)
            and int(np.prod(r.shape, dtype=np.int64)) >= MIN_QUANTIZE_ELEMENTS]
    for r in left:
        notes.append(f"weight {r.name} {list(r.shape)} ({r.dtype}) stays float: {r.scheme[len('kept: '):]}")
    notes.extend(f"quantize_weights: {n}" for n in report.notes)


def _read_only_as_float(uses: list) -> bool:
    """Whether every reader in `uses` (main_graph_uses' list of a name) is a Cast to float32 in the
    main graph."""
    return bool(uses) and all(node is not None and node.op_type == "Cast" and node.domain in ("", "ai.onnx")
                              and _attr(node, "to", 0) == TensorProto.FLOAT for node, _ in uses)


def _subgraph_has_type(skeleton, data_type: int) -> bool:
    from .runtime_feed import subgraphs

    stack = [g for node in skeleton.graph.node for g in subgraphs(node)]
    while stack:
        g = stack.pop()
        if any(t.data_type == data_type for t in g.initializer):
            return True
        for node in g.node:
            if node.op_type == "Constant" and any(a.name == "value" and a.t.data_type == data_type
                                                  for a in node.attribute):
                return True
            stack.extend(subgraphs(node))
    return False


def _shorten_bfloat16_casts(graph) -> int:
    """DequantizeLinear (float32) -> Cast(bfloat16) -> Cast(T) becomes DequantizeLinear -> T
    (T float32: the Casts go; another T: one Cast from float32) where the bfloat16 value has no
    other reader. The weight is then consumed straight from its DequantizeLinear (what the
    main-graph rules look for) and is not rounded to bfloat16 on the way (a smaller error, no
    larger). Returns how many chains were shortened."""
    producers = {o: n for n in graph.node for o in n.output}
    uses = main_graph_uses(graph)
    outputs = {o.name for o in graph.output}
    removed, count = set(), 0
    for outer in graph.node:
        if outer.op_type != "Cast" or outer.domain not in ("", "ai.onnx"):
            continue
        inner = producers.get(outer.input[0])
        if inner is None or inner.op_type != "Cast" or _attr(inner, "to", 0) != TensorProto.BFLOAT16:
            continue
        dq = producers.get(inner.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or id(inner) in removed:
            continue
        if len(uses.get(inner.output[0], [])) != 1 or inner.output[0] in outputs:
            continue
        if len(uses.get(dq.output[0], [])) != 1 or dq.output[0] in outputs:
            continue
        removed.add(id(inner))
        if _attr(outer, "to", 0) == TensorProto.FLOAT:
            dq.output[0] = outer.output[0]
            removed.add(id(outer))
        else:
            outer.input[0] = dq.output[0]
        count += 1
    if removed:
        keep = [n for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(keep)
    return count


def _float32_dequantize_before_casts(split: SplitModel) -> int:
    """DequantizeLinear (float16 scale) -> Cast(to=FLOAT) becomes one DequantizeLinear with the
    scale stored as float32 (exact: float16 values are float32 values), in the main graph and in
    If/Loop/Scan bodies, where the float16 value has no other reader and the scale no other reader.

    Why: a float16-stored weight read through a Cast to float ("float16 storage, float32 compute":
    onnxruntime's float16 converter writes it around its blocked ops, some exporters for every
    weight) then computes in float32, as the model does: the main-graph rules see a DequantizeLinear
    feeding its MatMul / Gemm / Gather / Conv (MatMulNBits, integer rows), and a body's weight is not
    taken for a float16 body's (fold_float16_subgraph_dequantize's guard looks at scale types). The
    weight is not rounded to float16 on the way: an error no larger. Returns how many."""
    from .runtime_feed import subgraphs

    count = 0
    main = split.skeleton.graph
    stack = [main]
    while stack:
        g = stack.pop()
        uses = main_graph_uses(g)  # (any graph: reads inside its nodes' bodies count as (None, -1))
        body_inits = {t.name: t for t in g.initializer} if g is not main else {}
        constants = {n.output[0]: n for n in g.node
                     if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output}
        removed = set()
        for dq in g.node:
            if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or len(dq.input) < 2:
                continue
            readers = uses.get(dq.output[0], [])
            if len(readers) != 1 or readers[0][0] is None:
                continue
            cast = readers[0][0]
            if cast.op_type != "Cast" or cast.domain not in ("", "ai.onnx") or _attr(cast, "to", 0) != TensorProto.FLOAT:
                continue
            scale_name = dq.input[1]
            if len(uses.get(scale_name, [])) != 1:
                continue
            if not _scale_to_float32(split, g is main, scale_name, body_inits, constants):
                continue
            dq.output[0] = cast.output[0]
            removed.add(id(cast))
            count += 1
        if removed:
            keep = [n for n in g.node if id(n) not in removed]
            del g.node[:]
            g.node.extend(keep)
        # (after the rebuild: extend copies the nodes, and their bodies with them)
        for node in g.node:
            stack.extend(subgraphs(node))
    return count


def _scale_to_float32(split: SplitModel, in_main: bool, name: str, body_inits: dict, constants: dict) -> bool:
    """Store the float16 scale `name` as float32 where it is held (a main-graph initializer, a body
    initializer or a Constant node of the same graph); False (nothing changed) when it is not float16
    or held elsewhere (an outer scope's tensor, a graph input)."""
    from onnx import numpy_helper

    if in_main:
        value = split.array(name)
        if value is None or value.dtype != np.float16:
            return False
        split.set_weight(name, value.astype(np.float32))
        return True
    if name in body_inits:
        t = body_inits[name]
        if t.data_type != TensorProto.FLOAT16:
            return False
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), name))
        return True
    node = constants.get(name)
    if node is None:
        return False
    for a in node.attribute:
        if a.name == "value" and a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT16:
            a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
            return True
    return False


def _mark_int4(split: SplitModel, name: str) -> None:
    """A 4-bit level array held as int8 values: remembered so MatMulNBits packs 4 bits."""
    split.int4_names = getattr(split, "int4_names", set()) | {name}


def _opset_at_least(split: SplitModel, version: int) -> bool:
    """Raise the skeleton's default opset to `version` with onnx's converter (DequantizeLinear with
    an axis needs 13; Squeeze/Split/Reduce* and others changed there, so the number alone cannot be
    bumped); False, and the weights stay float, where the converter refuses the model."""
    from .errors import UnsupportedFormError
    from .graph import default_opset, raise_opset

    if default_opset(split.skeleton) >= version:
        return True
    try:
        split.skeleton, _ = raise_opset(split.skeleton, version)
    except UnsupportedFormError:
        return False
    return True


def _ensure_opset(model, version: int) -> None:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            if op.version < version:
                op.version = version
            return
    model.opset_import.append(helper.make_opsetid("", version))


def _ensure_ms_opset(model) -> None:
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


# ---------------------------------------------------------------------- MatMulNBits

def _kn_params(qw: QWeight, transposed: bool):
    """Levels as [N, K] and scale / zero point as [N, blocks] with the block size along K; None
    where MatMulNBits cannot take the weight (its B is 2-D: a batched weight stays DequantizeLinear)."""
    if qw.q.ndim != 2:
        return None
    q = qw.q.T if not transposed else qw.q  # MatMul weight is [K, N]; Gemm transB weight is [N, K]
    n, k = q.shape
    k_axis = 1 if transposed else 0          # the axis of K in the stored weight
    if qw.block_size:
        if qw.axis != k_axis:
            return None
        block = qw.block_size
        if block < 16 or block & (block - 1):
            return None
        scale = qw.scale if transposed else qw.scale.T
        zp = None if qw.zero_point is None else (qw.zero_point if transposed else qw.zero_point.T)
    else:
        if qw.axis is not None and qw.axis == k_axis:
            return None  # one scale per K row: not expressible with blocks along K
        block = BLOCK_8BIT if qw.bits == 8 else BLOCK_4BIT
        block = max(16, min(block, 1 << max(4, int(np.ceil(np.log2(max(k, 1)))))))
        blocks = -(-k // block)
        per_n = np.broadcast_to(np.asarray(qw.scale).reshape(-1), (n,)) if qw.axis is not None else np.full(n, qw.scale.reshape(-1)[0])
        scale = np.repeat(per_n.reshape(n, 1), blocks, axis=1)
        zp = None
        if qw.zero_point is not None:
            zpn = np.asarray(qw.zero_point).reshape(-1)
            zpn = np.broadcast_to(zpn, (n,)) if zpn.size == n else np.full(n, zpn[0])
            zp = np.repeat(zpn.reshape(n, 1), blocks, axis=1)
    return q, scale, zp, block, n, k


def _to_matmulnbits(split: SplitModel, qw: QWeight, consumer, role: str, weight_name: str,
                    transposed: bool | None = None, accuracy_level: int = ACCURACY_LEVEL,
                    reader: int = 0) -> bool:
    """`consumer` (a MatMul or Gemm reading the weight as B) as MatMulNBits; `transposed`: the
    stored weight is [N, K] (Gemm transB=1, or a MatMul reading it through a Transpose); None:
    from the consumer's transB. `accuracy_level`: MatMulNBits' attribute (see session_config).
    `reader`: the how-manyth reader of a weight several read (_to_shared_matmulnbits): from the
    second on, the node reads the packed levels the first one stored."""
    if transposed is None:
        transposed = role == "gemm" and bool(_attr(consumer, "transB", 0))
    bits = 4 if qw.bits == 4 or weight_name + "_quantized" in getattr(split, "int4_names", set()) else 8
    params = _kn_params(qw, transposed)
    if params is None:
        return False
    q, scale, zp, block, n, k = params
    blocks = scale.shape[1]
    offset = 1 << (bits - 1)
    # unsigned levels: MatMulNBits dequantizes (u - zp_u) * scale; u = q + offset for signed q
    if zp is None:
        zp_u = None  # MatMulNBits' default zero point is 2^(bits-1): exact for symmetric levels
        if not qw.signed:
            return False  # unsigned levels without zero point: (u - 0); not the default
    else:
        zp_u = zp.astype(np.int16) + (offset if qw.signed else 0)
        if np.all(zp_u == offset):
            zp_u = None
    base = weight_name + "_nbits"
    node_name = base if reader == 0 else f"{base}_{reader}"
    if reader:
        packed = None  # stored by reader 0
    else:
        packed = _packed_levels(q, qw.signed, zp_u, bits, offset, n, k, blocks, block)
        split.set_weight(base + "_B", np.ascontiguousarray(packed))
        split.set_weight(base + "_scales", np.ascontiguousarray(scale.astype(split_float_dtype(qw)).reshape(-1)))
    inputs = [consumer.input[0], base + "_B", base + "_scales"]
    if zp_u is not None:
        if not reader:
            if bits == 8:
                zp_packed = zp_u.astype(np.uint8).reshape(-1)
            else:
                zb = zp_u.astype(np.uint8)
                if zb.shape[1] % 2:
                    zb = np.concatenate([zb, np.full((n, 1), offset, np.uint8)], axis=1)
                zp_packed = ((zb[:, 0::2] & 0x0F) | ((zb[:, 1::2] & 0x0F) << 4)).astype(np.uint8).reshape(-1)
            split.set_weight(base + "_zero_points", zp_packed)
        inputs.append(base + "_zero_points")
    graph = split.skeleton.graph
    outputs = list(consumer.output)
    nodes = []
    if role == "gemm" and len(consumer.input) > 2 and consumer.input[2]:
        mm_out = outputs[0] + "_matmul"
        nodes.append(helper.make_node("MatMulNBits", inputs, [mm_out], domain=MS_DOMAIN, name=node_name,
                                      K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level))
        bias = consumer.input[2]
        beta = _attr(consumer, "beta", 1.0)
        if beta != 1.0:
            beta_name = node_name + "_beta"
            split.set_weight(beta_name, np.asarray(beta, dtype=split_float_dtype(qw)))
            nodes.append(helper.make_node("Mul", [bias, beta_name], [bias + "_scaled_" + node_name]))
            bias = bias + "_scaled_" + node_name
        nodes.append(helper.make_node("Add", [mm_out, bias], outputs, name=node_name + "_bias"))
    else:
        nodes.append(helper.make_node("MatMulNBits", inputs, outputs, domain=MS_DOMAIN, name=node_name,
                                      K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level))
    _replace_node(graph, consumer, nodes)
    return True


def _packed_levels(q, signed: bool, zp_u, bits: int, offset: int, n: int, k: int, blocks: int, block: int):
    """The levels in MatMulNBits' layout: unsigned, [N, blocks, block bytes] (8 bits) or two
    levels a byte (4 bits), K padded to whole blocks with the zero point."""
    padded = np.empty((n, blocks * block), np.uint8)
    if q.dtype.itemsize == 1:
        # u written straight from the levels' bytes (q + offset lies in 0..255: the uint8 sum
        # wraps to exactly that), not through int16 and uint8 copies of the whole weight (3 bytes
        # a weight more at the load's peak: 35 MB for a 30522x384 table)
        np.add(q.view(np.uint8), np.uint8(offset if signed else 0), out=padded[:, :k])
    else:
        padded[:, :k] = (q.astype(np.int16) + (offset if signed else 0)).astype(np.uint8)
    if blocks * block > k:
        pad_values = np.repeat(zp_u[:, -1:], blocks * block - k, axis=1) if zp_u is not None else offset
        padded[:, k:] = pad_values
    if bits == 8:
        packed = padded.reshape(n, blocks, block)
    else:
        pairs = padded.reshape(n, blocks, block // 2, 2)
        packed = (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)
        packed = packed.astype(np.uint8)
    return packed


def split_float_dtype(qw: QWeight):
    return qw.scale.dtype


def _replace_node(graph, old, new_nodes) -> None:
    for i, node in enumerate(graph.node):
        if node is old or node == old:
            del graph.node[i]
            for j, n in enumerate(new_nodes):
                graph.node.insert(i + j, n)
            return


# ---------------------------------------------------------------------- tied embedding tables

def _tied_projection(uses: list, all_uses: dict):
    """For a table read by exactly one Gather (embedding) and one output projection, (gather,
    projection consumer, its role, the Identity/Transpose nodes between table and projection);
    else None. The projection: Gemm(h, E, transB=1), or MatMul(h, Transpose(E)) (perm [1, 0]),
    either possibly through Identity nodes (PyTorch's export of a tied parameter). Every name in
    between must have that one reader (no graph output, no subgraph reference)."""
    if len(uses) != 2 or any(node is None for node, _ in uses):
        return None
    gathers = [(n, i) for n, i in uses if _role([(n, i)]) == "gather"]
    if len(gathers) != 1:
        return None
    gather = gathers[0][0]
    node, index = next((n, i) for n, i in uses if n is not gather)
    between, transposed = [], False
    while node.domain in ("", "ai.onnx") and node.op_type in ("Identity", "Transpose") and index == 0:
        if node.op_type == "Transpose":
            perm = list(_attr(node, "perm", [1, 0]))
            if transposed or perm != [1, 0]:
                return None
            transposed = True
        between.append(node)
        readers = all_uses.get(node.output[0], [])
        if len(readers) != 1 or readers[0][0] is None:
            return None
        node, index = readers[0]
    role = _role([(node, index)])
    if role == "matmul" and transposed:
        return gather, node, role, between
    if role == "gemm" and not transposed and _attr(node, "transB", 0):
        return gather, node, role, between
    return None


def _to_tied_forms(split: SplitModel, qw: QWeight, weight_name: str, uses: list, all_uses: dict,
                   dequantized: frozenset = frozenset(), accuracy_level: int = ACCURACY_LEVEL) -> bool:
    """A tied table (see _tied_projection) quantized for both readers: the projection as
    MatMulNBits over the table's rows ([N = vocabulary, K = width], the layout it has), the
    embedding as a Gather of the integer rows dequantized as gathered. Returns whether the
    DequantizeLinear node is no longer read (both rewritten); where only the projection could be,
    the Gather keeps reading it. Before this the table stayed one DequantizeLinear node for both:
    onnxruntime dequantized the whole table in float on every run."""
    if qw.q.ndim != 2:
        return False
    found = _tied_projection(uses, all_uses)
    if found is None:
        return False
    gather, consumer, role, between = found
    if consumer.input[0] in dequantized:  # (an activation the model quantizes itself: see prepare_quantized)
        return False
    if not _to_matmulnbits(split, qw, consumer, role, weight_name, transposed=True, accuracy_level=accuracy_level):
        return False
    for node in between:  # (their only reader is now MatMulNBits, which reads the levels)
        _replace_node(split.skeleton.graph, node, [])
    return _to_gather_rows(split, qw, gather, weight_name)


# ---------------------------------------------------------------------- a weight several MatMuls read

def _to_shared_matmulnbits(split: SplitModel, qw: QWeight, weight_name: str, uses: list,
                           dequantized: frozenset = frozenset(), accuracy_level: int = ACCURACY_LEVEL) -> bool:
    """A weight read as B by several MatMul/Gemm nodes alike (a layer shared across a model's
    blocks, weights stored once by dedupe): each reader a MatMulNBits over the one packed copy of
    the levels. onnxruntime's own DequantizeLinear + MatMul fusion takes a weight with one reader
    only, so the weight was dequantized in float at every run (x @ A @ A, 512x512: 2.8 ms a run
    against 0.02 ms for two weights). All readers must take the same layout; else nothing changes."""
    if len(uses) < 2 or any(node is None for node, _ in uses):
        return False
    roles = [_role([use]) for use in uses]
    if any(r not in ("matmul", "gemm") for r in roles):
        return False
    layouts = {r == "gemm" and bool(_attr(node, "transB", 0)) for r, (node, _) in zip(roles, uses)}
    if len(layouts) != 1 or any(node.input[0] in dequantized for node, _ in uses):
        return False
    consumers = [node for node, _ in uses]
    if len({id(n) for n in consumers}) != len(consumers):  # (a node reading the weight twice)
        return False
    for reader, (consumer, role) in enumerate(zip(consumers, roles)):
        if not _to_matmulnbits(split, qw, consumer, role, weight_name, accuracy_level=accuracy_level, reader=reader):
            if reader:  # (cannot happen: the same weight and layout took the first)
                raise AssertionError("a shared weight's MatMulNBits form failed after the first reader")
            return False
    return True


# ---------------------------------------------------------------------- Gather on integer tables

def _to_gather_rows(split: SplitModel, qw: QWeight, gather, weight_name: str) -> bool:
    """Gather(levels) then dequantize the gathered rows only."""
    if qw.block_size or qw.q.ndim < 1:
        return False
    last = qw.q.ndim - 1
    if qw.axis not in (None, 0, last):
        return False
    float_type = helper.np_dtype_to_tensor_dtype(qw.scale.dtype)
    base = weight_name + "_rows"
    q_name = base + "_levels"
    split.set_weight(q_name, np.ascontiguousarray(qw.q))
    idx = gather.input[1]
    nodes = [helper.make_node("Gather", [q_name, idx], [base + "_q"], axis=0, name=base + "_gather"),
             helper.make_node("Cast", [base + "_q"], [base + "_f"], to=float_type, name=base + "_cast")]
    value = base + "_f"
    if qw.axis == 0 and qw.q.ndim > 1:  # one scale per row: gather the scales with the rows
        scale_name = base + "_scale"
        split.set_weight(scale_name, np.ascontiguousarray(qw.scale.reshape((-1,) + (1,) * (qw.q.ndim - 1))))
        nodes.append(helper.make_node("Gather", [scale_name, idx], [base + "_s"], axis=0, name=base + "_gather_scale"))
        scale_value = base + "_s"
        if qw.zero_point is not None and np.any(qw.zero_point):
            zp_name = base + "_zero_point"
            split.set_weight(zp_name, qw.zero_point.astype(qw.scale.dtype).reshape((-1,) + (1,) * (qw.q.ndim - 1)))
            nodes.append(helper.make_node("Gather", [zp_name, idx], [base + "_z"], axis=0, name=base + "_gather_zp"))
            nodes.append(helper.make_node("Sub", [value, base + "_z"], [base + "_c"], name=base + "_sub"))
            value = base + "_c"
    else:  # per tensor, or one scale per column: broadcasts over the gathered rows
        scale_value = base + "_scale"
        split.set_weight(scale_value, np.asarray(qw.scale))
        if qw.zero_point is not None and np.any(qw.zero_point):
            zp_name = base + "_zero_point"
            split.set_weight(zp_name, np.asarray(qw.zero_point).astype(qw.scale.dtype))
            nodes.append(helper.make_node("Sub", [value, zp_name], [base + "_c"], name=base + "_sub"))
            value = base + "_c"
    nodes.append(helper.make_node("Mul", [value, scale_value], list(gather.output), name=base + "_scale_mul"))
    _replace_node(split.skeleton.graph, gather, nodes)
    return True
