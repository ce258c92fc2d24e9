"""mode="fold" at load: every DequantizeLinear whose inputs are all constants becomes its float
output tensor, computed once, tensor by tensor, into the array the session will keep.

The arithmetic is `passes.fold`'s registered folders (so a session built here computes exactly
what `fold_dequantize` writes); a local vectorised DequantizeLinear stands in if that module is
missing.
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import numpy_helper

from .runtime_feed import SplitModel, subgraphs


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def dequantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, *, axis: int = 1,
               block_size: int = 0, out_dtype=None) -> np.ndarray:
    """ONNX DequantizeLinear on arrays: (x - zero_point) * scale, per tensor, per axis or blocked."""
    out_dtype = np.dtype(out_dtype or scale.dtype)
    scale = np.asarray(scale)
    if scale.ndim > 0 and x.ndim > 0:
        axis = axis % x.ndim
        if block_size and block_size > 0:  # blocked: scale has x's shape with axis divided into blocks
            scale = np.repeat(scale, block_size, axis=axis)
            scale = np.take(scale, np.arange(x.shape[axis]), axis=axis)
            if zero_point is not None and np.asarray(zero_point).ndim > 0:
                zero_point = np.repeat(zero_point, block_size, axis=axis)
                zero_point = np.take(zero_point, np.arange(x.shape[axis]), axis=axis)
        elif scale.ndim == 1:  # per axis: broadcast along `axis`
            shape = [1] * x.ndim
            shape[axis] = scale.shape[0]
            scale = scale.reshape(shape)
            if zero_point is not None and np.asarray(zero_point).ndim == 1:
                zero_point = np.asarray(zero_point).reshape(shape)
    compute = np.float32 if out_dtype != np.float64 else np.float64
    y = x.astype(compute)
    if zero_point is not None:
        zp = np.asarray(zero_point)
        if zp.size and np.any(zp):
            y -= zp.astype(compute)
    y *= scale.astype(compute)
    return y.astype(out_dtype, copy=False)


def _folders() -> dict:
    """passes.fold's registry of constant folders ((domain, op) -> fn), so that a session folds
    exactly what `fold_dequantize` writes (and whatever forms register later, e.g. palettes)."""
    try:
        from .fold import FOLDERS
    except ImportError:
        return {}
    return FOLDERS


def _local_dq(node, arrays, types):
    scale = arrays[1]
    zp = arrays[2] if len(arrays) > 2 else None
    return dequantize(arrays[0], scale, zp, axis=_attr(node, "axis", 1), block_size=_attr(node, "block_size", 0),
                      out_dtype=scale.dtype), types[1]


def has_foldable(split: SplitModel) -> bool:
    """Whether any node of the model (subgraphs included) is one fold_into may replace: a
    DequantizeLinear, an operator with a registered folder, or a Gather with a Cast (palettes)."""
    folders = _folders()
    ops = set()
    stack = [split.skeleton.graph]
    while stack:
        graph = stack.pop()
        for node in graph.node:
            ops.add((node.domain or "", node.op_type))
            stack.extend(subgraphs(node))
    if any(op in folders for op in ops) or any(op_type == "DequantizeLinear" for _, op_type in ops):
        return True
    if ("", "Gather") not in ops:
        return False
    inits = split.initializer_names()  # palettes: Gather(constant table, Cast(constant indices))
    cast_of_constant = {n.output[0] for n in split.skeleton.graph.node
                        if n.op_type == "Cast" and n.input and n.input[0] in inits}
    return any(n.op_type == "Gather" and len(n.input) == 2 and n.input[0] in inits and n.input[1] in cast_of_constant
               for n in split.skeleton.graph.node)


def onnxruntime_folds_all(split: SplitModel) -> bool:
    """Whether onnxruntime's own constant folding can do the whole fold (then nothing here needs to
    touch the graph or read a weight): the only foldable nodes are standard DequantizeLinear nodes
    of the main graph (no other registered form, no palette, no subgraph), and no activation is
    quantized (QuantizeLinear: disabling the QDQ fusions would slow the run down).

    Used for float16 weights on a CPU where fold_float16_as_float32 does not apply (no weight it
    can widen, or a graph whose other constants onnxruntime's folding limit could affect), and
    where plan_fold(share=False) would defer every big
    DequantizeLinear to onnxruntime anyway: folding the small ones here and walking the graph to
    do so cost more than it saved (open_nsfw float16 q8.onnx: 182 ms CPU to a ready session
    against 140 ms for onnxruntime on the same file, 134 ms for the plain float16 model).
    Folding the big ones on a worker thread (passes.forms, bit-exact) while the skeleton is
    prepared and parsed, each float16 weight streamed as soon as folded, was measured slower too
    (session 5; 2 cores, 9 fresh processes, min, against the plain float16 model): at load 0.9,
    minilm_fp16 q8.onnxz ready wall 1.62x (onnxruntime's fold 1.38x), CPU 1.57x (1.31x);
    open_nsfw_fp16 1.31x (1.25x). onnxruntime's own initialisation of the float16 model keeps
    both cores busy (its CPU is 1.5x its wall), and the fold (~47 ms on MiniLM, as much per value
    as onnxruntime's) plus parsing float16 instead of int8 bytes delays its parse."""
    folders = _folders()
    graph = split.skeleton.graph
    inits = split.initializer_names()
    cast_of_constant = set()
    for node in graph.node:
        op = (node.domain or "", node.op_type)
        if op in (("", "QuantizeLinear"), ("", "DynamicQuantizeLinear")) or subgraphs(node):
            return False
        if node.op_type == "DequantizeLinear":
            if node.domain not in ("", "ai.onnx"):
                return False
        elif op in folders:
            return False
        if node.op_type == "Cast" and node.input and node.input[0] in inits:
            cast_of_constant.add(node.output[0])
    # palettes: Gather(constant table, Cast(constant indices)), folded by _fold_palettes
    return not any(n.op_type == "Gather" and len(n.input) == 2 and n.input[1] in cast_of_constant
                   for n in graph.node)


def constant_foldable_nodes(split: SplitModel, folders: dict) -> list:
    """Main-graph nodes with a folder whose inputs are all initializers."""
    inits = split.initializer_names()
    return [
        n for n in split.skeleton.graph.node
        if ((n.domain or "", n.op_type) in folders or (n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx")))
        and n.input and all((not i) or i in inits for i in n.input)
    ]


def fold_into(split: SplitModel, progress=None, only=None, subgraphs=None) -> int:
    """Replace constant DequantizeLinear (and other registered constant-form) nodes by their
    float initializers (subgraphs too unless `only` is given or subgraphs=False); returns how
    many were folded. `only`: optional predicate on a main-graph node."""
    folders = _folders()
    constants_to_initializers(split)
    if subgraphs if subgraphs is not None else only is None:
        fold_subgraphs(split.skeleton.graph, folders)
    types = {t.name: t.data_type for t in split.skeleton.graph.initializer}
    nodes = [n for n in constant_foldable_nodes(split, folders) if only is None or only(n)]
    folded = set()
    consumers = _consumer_counts(split.skeleton.graph)
    for done, node in enumerate(nodes, 1):
        arrays = [split.array(i) if i else None for i in node.input]
        if any(a is None for a, i in zip(arrays, node.input) if i):
            continue
        fn = folders.get((node.domain or "", node.op_type), _local_dq)
        result = fn(node, arrays, [types.get(i, 0) for i in node.input])
        if result is None:
            continue
        value = np.asarray(result[0])
        split.set_weight(node.output[0], value)
        types[node.output[0]] = result[1]
        folded.add(node.output[0])
        # the quantized inputs are dropped as soon as nothing else reads them (bounded memory)
        for name in node.input:
            if name in split.weights and consumers.get(name, 0) <= 1:
                split.weights.pop(name)
            consumers[name] = consumers.get(name, 0) - 1
        if progress:
            progress(done, len(nodes))
    folded |= _fold_palettes(split, consumers, only)
    if folded:
        keep = [n for n in split.skeleton.graph.node if not (n.output and n.output[0] in folded)]
        del split.skeleton.graph.node[:]
        split.skeleton.graph.node.extend(keep)
        split.refresh_placeholders()
    return len(folded)


def _fold_palettes(split: SplitModel, consumers: dict, only) -> set:
    """Palette weights (passes.palette: Cast of constant uint8 indices -> Gather on a constant
    1-D table) become table[indices], exactly what onnxruntime computes; returns the output
    names of the nodes replaced (the Cast and the Gather)."""
    graph = split.skeleton.graph
    inits = split.initializer_names()
    cast_of = {n.output[0]: n for n in graph.node
               if n.op_type == "Cast" and n.domain in ("", "ai.onnx") and n.input and n.input[0] in inits}
    done = set()
    for node in list(graph.node):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        if only is not None and not only(node):
            continue
        cast = cast_of.get(node.input[1])
        if cast is None or node.input[0] not in inits or _attr(node, "axis", 0) != 0:
            continue
        table, idx = split.array(node.input[0]), split.array(cast.input[0])
        if table is None or idx is None or table.ndim != 1 or idx.dtype not in (np.uint8, np.int8):
            continue
        if consumers.get(cast.output[0], 0) != 1:
            continue
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < -table.size or idx.max() >= table.size):
            continue  # onnxruntime refuses such indices: leave the error to it
        split.set_weight(node.output[0], table[idx])
        done |= {node.output[0], cast.output[0]}
    return done


def plan_fold(split: SplitModel, options, share: bool = True) -> set:
    """Which constant DequantizeLinear nodes onnxruntime should fold itself (their output names).

    A weight we fold and share costs one float copy (ours). A weight whose consumers need its
    bytes at optimisation time (Conv: NCHWc reordering, the transpose optimiser) cannot be
    shared: handing it over as a copy would hold our float array, onnxruntime's copy and its
    reordered copy at once. For those, onnxruntime gets the integer levels and folds the
    DequantizeLinear itself during its constant folding (session.disable_quant_qdq=1 makes its
    constant folding include DequantizeLinear), with the same arithmetic (passes.forms is
    bit-exact with onnxruntime's DequantizeLinear). Not done when the graph quantizes activations
    (QuantizeLinear present): disabling QDQ fusions there would slow it down.

    share=False (no weight will be shared: float16 weights on a CPU, which onnxruntime casts to
    float32 at load) defers every big one: onnxruntime parses the integer levels instead of our
    float16 arrays and folds them itself. Measured on float16 MiniLM q8.onnxz: CPU to a ready
    session 0.41 -> 0.33 s, peak 121 -> 108-112 MB, outputs identical.
    """
    from .runtime_feed import consumers_shareable, main_graph_readers

    graph = split.skeleton.graph
    readers = main_graph_readers(graph)
    if any(n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear") for n in graph.node):
        return set()
    folders = _folders()
    deferred = set()
    for node in constant_foldable_nodes(split, folders):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        if split.array(node.input[0]) is None or split.array(node.input[0]).nbytes <= 4096:
            continue
        if not share or not consumers_shareable(graph, node.output[0], readers=readers):
            deferred.add(node.output[0])
    if deferred:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    return deferred


def constants_to_initializers(split: SplitModel) -> None:
    """Main-graph Constant nodes holding a tensor become initializers (small ones stay inline),
    so that a DequantizeLinear reading e.g. a Constant scale is constant-foldable here."""
    graph = split.skeleton.graph
    keep, moved = [], False
    for node in graph.node:
        value = _constant_tensor(node)
        if value is None:
            keep.append(node)
            continue
        split.set_weight(node.output[0], numpy_helper.to_array(value))
        moved = True
    if moved:
        del graph.node[:]
        graph.node.extend(keep)


def _constant_tensor(node):
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR and attr.t.data_location != onnx.TensorProto.EXTERNAL:
        return attr.t
    return None


def fold_subgraphs(graph, folders) -> int:
    """Fold constant nodes inside If/Loop/Scan bodies (their tensors are inline, small), each
    subgraph with the constants of its own scope, as fold_dequantize does."""
    count = 0
    for node in graph.node:
        for g in subgraphs(node):
            count += _fold_one_graph(g, folders)
            count += fold_subgraphs(g, folders)
    return count


def _fold_one_graph(g, folders) -> int:
    consts, types = {}, {}
    for t in g.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            consts[t.name], types[t.name] = numpy_helper.to_array(t), t.data_type
    for node in g.node:
        value = _constant_tensor(node)
        if value is not None:
            consts[node.output[0]], types[node.output[0]] = numpy_helper.to_array(value), value.data_type
    folded = []
    for node in g.node:
        key = (node.domain or "", node.op_type)
        fn = folders.get(key, _local_dq if node.op_type == "DequantizeLinear" and not node.domain else None)
        if fn is None or not node.input or not all((not i) or i in consts for i in node.input):
            continue
        result = fn(node, [consts[i] if i else None for i in node.input], [types.get(i, 0) for i in node.input])
        if result is None:
            continue
        value = np.asarray(result[0])
        name = node.output[0]
        tensor = numpy_helper.from_array(value, name) if value.dtype.name != "bfloat16" else None
        if tensor is None:
            continue
        g.initializer.append(tensor)
        consts[name], types[name] = value, result[1]
        folded.append(node)
    if not folded:
        return 0
    outs = {n.output[0] for n in folded}
    keep = [n for n in g.node if not (n.output and n.output[0] in outs)]
    del g.node[:]
    g.node.extend(keep)
    _drop_unused_locals(g)
    return len(folded)


def _drop_unused_locals(g) -> None:
    used = _names_read(g)
    keep = [n for n in g.node if not (_constant_tensor(n) is not None and n.output[0] not in used)]
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)
    inits = g.initializer
    for i in range(len(inits) - 1, -1, -1):
        if inits[i].name not in used:
            del inits[i]


def _names_read(g) -> set:
    used = {o.name for o in g.output}
    for node in g.node:
        used.update(node.input)
        for sub in subgraphs(node):
            used |= _names_read(sub)
    return used


def _consumer_counts(graph) -> dict:
    counts = {}
    for node in graph.node:
        for name in node.input:
            counts[name] = counts.get(name, 0) + 1
        for g in subgraphs(node):  # names a subgraph reads from the outer scope count as uses
            for inner in _consumer_counts(g):
                counts[inner] = counts.get(inner, 0) + 1
    for o in graph.output:
        counts[o.name] = counts.get(o.name, 0) + 1
    return counts


# ---------------------------------------------------------------------- float16 weights on a CPU

# A float16 model on a CPU: onnxruntime has no float16 kernel for MatMul, Gemm or Conv, so it
# inserts Cast(float16 -> float32) before them and, at load, converts each float16 weight to a
# float32 copy (FuseFp16InitializerToFp32NodeTransformer). Fed DequantizeLinear nodes instead, it
# first folds them into float16 (its constant folding, one scalar conversion per value), then
# converts those: on float16 MiniLM q8.onnxz that fold alone took longer than parsing the whole
# plain float16 model.
#
# Here such a weight is folded once, straight to the float32 values onnxruntime would end with
# (the float16 result widened, exact), and given as Cast(float32 weight -> float16): the graph
# computes exactly what it did. onnxruntime's constant folding is told to leave outputs over
# CAST_FOLD_LIMIT_BYTES alone (session option below), the cast insertion puts
# Cast(float16 -> float32) after ours, and its duplicate-cast removal drops the pair (both are
# float types), so the MatMul/Gemm/Conv reads our float32 weight as it is: no fold, no conversion
# in onnxruntime, and MatMul/Gemm weights can be shared (no copy).

# onnxruntime's constant folding skips any node whose output exceeds this many bytes; only weights
# above it take the float32 route, and the route is taken only when no other constant node of the
# graph may produce more (see constant_outputs_fit)
CAST_FOLD_LIMIT_BYTES = 64 << 10
CF_LIMIT_KEY = "optimization.constant_folding_max_output_size_in_bytes"

# operators whose weight input, on a CPU, runs in float32 between inserted Casts (checked against
# onnxruntime's kernel registry: one that gains a float16 kernel drops out) ...
WIDENED_CONSUMERS = (("", "MatMul"), ("", "Gemm"), ("", "Conv"))
# ... and those of them whose kernels read the weight once, at creation (MatMul B, Gemm B): their
# float32 weight is shared with onnxruntime; Conv weights are reordered from their bytes (copied)
WIDENED_SHAREABLE = {("", "MatMul"): {1}, ("", "Gemm"): {1}}


def constant_folding_limit_supported() -> bool:
    """Whether onnxruntime honours CF_LIMIT_KEY (verified from 1.32 on; an older one would fold the
    Casts, reading shared weights it cannot see: the session would fail once and be rebuilt)."""
    import onnxruntime as ort

    try:
        return tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 32)
    except ValueError:
        return False


@functools.lru_cache(maxsize=None)
def cpu_ops_without_float16(ops: tuple) -> frozenset:
    """Of `ops` ((domain, op_type) pairs), those onnxruntime's CPU provider has no float16 kernel for."""
    from onnxruntime.capi import _pybind_state as C

    wanted = set(ops)
    with_fp16 = set()
    for k in C.get_all_opkernel_def():
        key = (k.domain or "", k.op_name)
        if key in wanted and k.provider == "CPUExecutionProvider":
            if any("tensor(float16)" in types for types in k.type_constraints.values()):
                with_fp16.add(key)
    return frozenset(wanted - with_fp16)


def widenable_dequantize(split: SplitModel) -> list:
    """Constant main-graph DequantizeLinear nodes with float16 output over CAST_FOLD_LIMIT_BYTES,
    read only by operators that run in float32 on a CPU (WIDENED_CONSUMERS), not a graph output.
    Reads no weight value (a pack may still be decoding). Empty where this onnxruntime may not
    honour the folding limit (the route then costs a retry, see constant_folding_limit_supported)."""
    if not constant_folding_limit_supported():
        return []
    graph = split.skeleton.graph
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append((node.domain or "", node.op_type))
    for node in graph.node:  # outer-scope reads by subgraphs are uses too
        for g in subgraphs(node):
            for name in _names_read(g):
                readers.setdefault(name, []).append(("", "<subgraph>"))
    allowed = cpu_ops_without_float16(WIDENED_CONSUMERS)
    outputs = {o.name for o in graph.output}
    types = {t.name: t.data_type for t in graph.initializer}
    found = []
    for node in constant_foldable_nodes(split, _folders()):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        out = node.output[0]
        if types.get(node.input[1]) != onnx.TensorProto.FLOAT16 or out in outputs or _attr(node, "output_dtype", 0):
            continue
        uses = readers.get(out, [])
        q = split.array(node.input[0])
        if uses and all(u in allowed for u in uses) and q is not None and 2 * q.size > CAST_FOLD_LIMIT_BYTES:
            found.append(node)
    return found


# elements per step of the widening loops (the chunk and its scratch stay in the L2 cache)
WIDEN_CHUNK = 1 << 15


def _round_bits_to_float16(bits: np.ndarray, scratch: np.ndarray) -> None:
    """float32 bit patterns rounded in place to the nearest float16 value (ties to even), still
    float32: exact for values that are 0 or within float16's normal range (the caller checks)."""
    lsb = scratch[:bits.size].reshape(bits.shape)
    np.right_shift(bits, 13, out=lsb)
    np.bitwise_and(lsb, 1, out=lsb)
    np.add(lsb, 0x0FFF, out=lsb)
    np.add(bits, lsb, out=bits)
    np.bitwise_and(bits, np.uint32(0xFFFFE000), out=bits)


def _direct_layout(q: np.ndarray, scale: np.ndarray, axis: int, block_size: int):
    """(levels as 2-D, scale broadcast to it) when the scale runs along one of the two dimensions
    of q seen as (rows, columns) — per tensor, per row (axis 0) or per column (the last axis) — else None."""
    if q.ndim == 0 or block_size:
        return None
    if scale.size == 1 and scale.ndim <= 1:
        return q.reshape(-1, q.shape[-1]), scale.reshape(1, 1)
    if scale.ndim != 1:
        return None
    axis %= q.ndim
    if scale.shape[0] != q.shape[axis]:
        return None
    if axis == q.ndim - 1:
        return q.reshape(-1, q.shape[-1]), scale.reshape(1, -1)
    if axis == 0:
        return q.reshape(q.shape[0], -1), scale.reshape(-1, 1)
    return None


def _widen_direct(q, s32, zp, axis: int, block_size: int) -> np.ndarray | None:
    """(q - zp) * scale rounded to float16 precision, as float32, in cache-sized steps: the product
    of an 8-bit level difference and a float16 scale is exact in float32, so this is the float16
    DequantizeLinear result (one rounding, as onnxruntime's) widened. None for other layouts."""
    layout = _direct_layout(q, s32, axis, block_size)
    if layout is None:
        return None
    q2, s2 = layout
    z2 = None
    if zp is not None and np.any(zp):
        z2 = np.asarray(zp, dtype=np.float32).reshape(s2.shape)
    out = np.empty(q.shape, dtype=np.float32)
    o2 = out.reshape(q2.shape)
    rows = max(1, WIDEN_CHUNK // max(q2.shape[1], 1))
    scratch = np.empty(rows * q2.shape[1], dtype=np.uint32)
    per_row = s2.shape[0] != 1
    for start in range(0, q2.shape[0], rows):
        stop = start + rows
        o = o2[start:stop]
        np.copyto(o, q2[start:stop], casting="unsafe")
        if z2 is not None:
            np.subtract(o, z2[start:stop] if per_row else z2, out=o)
        np.multiply(o, s2[start:stop] if per_row else s2, out=o)
        _round_bits_to_float16(o.view(np.uint32), scratch)
    return out


def _widened_value(node, arrays, types, folders) -> np.ndarray | None:
    """The float16 output of a DequantizeLinear as float32 (exact widening): computed directly
    where the levels are 8-bit and every product is 0 or a normal float16 (_widen_direct), else
    the float16 fold (passes.fold's folder) widened."""
    q, scale = arrays[0], arrays[1]
    zp = arrays[2] if len(arrays) > 2 else None
    s32 = scale.astype(np.float32)
    mag = np.abs(s32[s32 != 0])
    if (q.dtype.itemsize == 1 and q.dtype.kind in "iu" and bool(np.all(np.isfinite(s32)))
            and (mag.size == 0 or (mag.min() >= 2.0**-14 and mag.max() * 255 <= 65504))):
        with np.errstate(over="ignore", invalid="ignore"):
            wide = _widen_direct(q, s32, zp, _attr(node, "axis", 1), _attr(node, "block_size", 0))
        if wide is not None:
            return wide
    fn = folders.get((node.domain or "", node.op_type), _local_dq)
    result = fn(node, arrays, types)
    return None if result is None else np.asarray(result[0]).astype(np.float32)


def fold_float16_as_float32(split: SplitModel, nodes: list) -> set:
    """Each of `nodes` (from widenable_dequantize) becomes Cast(float32 weight -> float16) (see
    the comment above CAST_FOLD_LIMIT_BYTES). Returns the float32 weights that can be shared."""
    folders = _folders()
    graph = split.skeleton.graph
    types = {t.name: t.data_type for t in graph.initializer}
    readers = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.domain or "", node.op_type, index))
    consumers = _consumer_counts(graph)
    rewritten, shareable = {}, set()
    for node in nodes:
        arrays = [split.array(i) if i else None for i in node.input]
        wide = _widened_value(node, arrays, [types.get(i, 0) for i in node.input], folders)
        if wide is None:
            continue
        out = node.output[0]
        name = out + "::float32"
        split.set_weight(name, wide)
        rewritten[out] = onnx.helper.make_node("Cast", [name], [out], to=onnx.TensorProto.FLOAT16,
                                               name=(node.name or out) + "::float16")
        if all(index in WIDENED_SHAREABLE.get((d, op), ()) for d, op, index in readers.get(out, [])):
            shareable.add(name)
        for i in node.input:  # the levels go as soon as nothing else reads them
            if i in split.weights and consumers.get(i, 0) <= 1:
                split.weights.pop(i)
            consumers[i] = consumers.get(i, 0) - 1
    if rewritten:
        kept = [rewritten.get(n.output[0], n) if n.output else n for n in graph.node]
        del graph.node[:]
        graph.node.extend(kept)
        split.refresh_placeholders()
    return shareable


def _eval_constant(node, values: list):
    """numpy value of a small constant node onnxruntime's constant folding would compute, or
    None when the operator is not one this knows (the caller then assumes the worst)."""
    op = node.op_type
    a = values[0] if values else None
    if op == "Identity":
        return a
    if op == "Cast":
        return a.astype(onnx.helper.tensor_dtype_to_np_dtype(_attr(node, "to", 1)))
    if op in ("Add", "Sub", "Mul"):
        return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[op](a, values[1])
    if op == "Neg":
        return -a
    if op == "Reshape":
        shape = [int(d) for d in values[1]]
        if not _attr(node, "allowzero", 0):
            shape = [a.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return a.reshape(shape)
    if op == "Concat":
        return np.concatenate(values, axis=_attr(node, "axis", 0))
    if op == "Transpose":
        perm = _attr(node, "perm", None)
        return np.transpose(a, perm if perm else None)
    if op == "Gather":
        return np.take(a, values[1], axis=_attr(node, "axis", 0))
    if op in ("Unsqueeze", "Squeeze"):
        axes = [int(x) for x in values[1]] if len(values) > 1 and values[1] is not None else _attr(node, "axes", None)
        if op == "Squeeze":
            return np.squeeze(a, axis=tuple(axes)) if axes else np.squeeze(a)
        out = a
        for ax in sorted(x % (a.ndim + len(axes)) for x in axes):
            out = np.expand_dims(out, ax)
        return out
    if op == "Slice":
        starts, ends = values[1], values[2]
        axes = values[3] if len(values) > 3 and values[3] is not None else range(len(starts))
        steps = values[4] if len(values) > 4 and values[4] is not None else [1] * len(starts)
        index = [slice(None)] * a.ndim
        for st, en, ax, sp in zip(starts, ends, axes, steps):
            index[int(ax)] = slice(int(st), int(en), int(sp))
        return a[tuple(index)]
    if op == "ConstantOfShape":
        fill = _attr(node, "value", None)
        fill = numpy_helper.to_array(fill) if fill is not None else np.zeros(1, np.float32)
        return np.full([int(d) for d in a], fill.reshape(-1)[0], dtype=fill.dtype)
    return None


def constant_outputs_fit(split: SplitModel, limit: int, ours: set) -> bool:
    """True when onnxruntime's constant folding, limited to `limit` output bytes, folds everything it
    would fold unlimited: every main-graph node other than `ours` (outputs of DequantizeLinear
    folded here) whose inputs are all constant produces at most `limit` bytes. Small constant
    chains (shape arithmetic) are evaluated; a constant node reading a big weight, or one this
    cannot evaluate, answers False."""
    graph = split.skeleton.graph
    declared = {v.name: v for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    big = set(split.weights) | set(ours)
    values = _LazyConstants(split, big)
    for node in graph.node:
        if node.output and node.output[0] in ours:
            continue
        if node.op_type == "Constant" and not subgraphs(node):
            value = _constant_tensor(node)
            if value is None:
                return False  # sparse or attribute forms: not evaluated here
            values[node.output[0]] = numpy_helper.to_array(value)
            continue
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
            info = declared.get(node.input[0])
            dims = _static_dims(info, values.get(node.input[0]))
            if dims is None and node.input[0] not in values and not _has_dynamic_dim(info):
                return False  # shape not declared: onnxruntime's inference may know it static
            if dims is not None:
                values[node.output[0]] = np.asarray(dims, dtype=np.int64)[_attr(node, "start", 0):_attr(node, "end", None)]
            continue
        inputs = [i for i in node.input if i]
        if not inputs or subgraphs(node) or not all(i in values or i in big for i in inputs):
            continue
        if any(i in big for i in inputs):
            return False  # a constant computation on a big weight: its output may exceed the limit
        try:
            result = _eval_constant(node, [values[i] if i else None for i in node.input])
        except Exception:  # malformed or unexpected: assume the worst
            return False
        if result is None or np.asarray(result).nbytes > limit or len(node.output) != 1:
            return False
        values[node.output[0]] = np.asarray(result)
    return True


class _LazyConstants(dict):
    """name -> value of the small constants, the inline initializers read only when asked for
    (most are never needed: converting them all cost more than the rest of the check)."""

    def __init__(self, split: SplitModel, big: set):
        super().__init__()
        self._inline = {name for name in split.initializer_names() if name not in big}
        self._split = split

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self._inline

    def __getitem__(self, name):
        if not dict.__contains__(self, name) and name in self._inline:
            self[name] = self._split.array(name)
        return dict.__getitem__(self, name)

    def get(self, name, default=None):
        return self[name] if name in self else default


def _static_dims(info, value):
    """A tensor's dims when all are known (its value's, else its declared type's), else None."""
    if value is not None:
        return list(value.shape)
    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]
    return dims if all(d is not None for d in dims) else None


def _has_dynamic_dim(info) -> bool:
    """Whether a declared tensor type has a dimension without a value (a symbol or unknown)."""
    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
        return False
    return any(not d.HasField("dim_value") for d in info.type.tensor_type.shape.dim)
