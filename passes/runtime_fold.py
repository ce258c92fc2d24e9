"""mode="fold" at load: every DequantizeLinear whose inputs are all constants becomes its float
output tensor, computed once, tensor by tensor, into the array the session will keep.

The arithmetic is `passes.fold`'s registered folders (so a session built here computes exactly
what `fold_dequantize` writes); a local vectorised DequantizeLinear stands in if that module is
missing.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import InvalidArgumentError
from .graph import NameAllocator
from .runtime_arena import Arena, MemoryOwners
from .runtime_dequantize import dequantize as _dequantize, kernel_name, layout as _layout
from .runtime_feed import GRAPH_OPS, NodeTable, SplitModel, main_graph_uses, node_table, subgraphs


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


# the one-pass kernel takes these level / scale types (passes.runtime_dequantize)
_KERNEL_LEVELS = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.UINT8})
_KERNEL_SCALES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16})


def _kernel_dq(node, arrays, types, fallback, later=None, ready=None, arena=None):
    """A constant DequantizeLinear of 8-bit levels with float32/float16 scales through the one-pass
    kernel (runtime_dequantize: the bits of forms.dequantize_linear, which fold_dequantize writes);
    anything else (other types, attributes or layouts, and every malformed node, which `fallback`
    refuses with its message) through `fallback`, the registered folder. With `later` (a list) the
    kernel's work is appended to it as (q, scale, zero point, axis, block, output array) and the
    output returned unfilled (FoldAhead fills it), cut from `arena` when given (a
    runtime_arena.Arena: small outputs share huge pages); `ready(array)` then waits for levels
    still decoding before the fallback reads them."""
    q, scale = arrays[0], arrays[1] if len(arrays) > 1 else None

    def other():
        if ready is not None and q is not None:
            ready(q)
        return fallback(node, arrays, types)

    if q is None or scale is None or types[0] not in _KERNEL_LEVELS or types[1] not in _KERNEL_SCALES:
        return other()
    zp = arrays[2] if len(arrays) > 2 else None
    if zp is not None and types[2] != types[0]:
        return other()
    attrs = {}
    for a in node.attribute:
        if a.name not in ("axis", "block_size", "output_dtype") or a.type != onnx.AttributeProto.INT:
            return other()
        attrs[a.name] = a.i
    if attrs.get("output_dtype", 0) not in (0, types[1]):
        return other()
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    if _layout(q, scale, zp, axis, block) is None:
        return other()
    if later is not None:
        out = arena.empty(q.shape, scale.dtype) if arena is not None else np.empty(q.shape, scale.dtype)
        later.append((q, scale, zp, axis, block, out))
        return out, types[1]
    return _dequantize(q, scale, zp, axis, block), types[1]


def fold_kernel_fast() -> bool:
    """Whether the one-pass kernel runs vectorised here: then a float16 model's weights are folded
    at load rather than left to onnxruntime's constant folding (see InferenceSession._rewrite)."""
    return kernel_name() == "avx512"


class FoldAhead:
    """Constant DequantizeLinear nodes folded on a worker thread as their levels finish decoding
    (the one-pass kernel, GIL released), standing in as the split's `pending` decode: `ready(array)`
    of a folded output waits for its fold (of anything else: the decode's ready), `order` ranks a
    folded output as its levels, `wait` / `abandon` cover both. So onnxruntime parses the model
    while its weights decode and fold, instead of after every weight was decoded and folded.

    Why: folded after the whole decode (the kernel, one thread), a float16 model cost about what
    onnxruntime's constant folding of it costs, but the parse began only after decode and fold
    (CPU to a ready session, minilm_fp16 q8.onnxz, 15 interleaved fresh processes at load 13-14:
    min/median 231/256 ms against 227/264). Folded ahead (13 rounds, load 10-16): minilm_fp16
    q8.onnxz CPU min/median 220/238 ms against 219/230, wall 405/492 against 425/472;
    open_nsfw_fp16 q8.onnxz CPU 203/232 against 209/236, wall 297/432 against 292/435: about
    even on 2 cores, where onnxruntime's spinning intra-op worker shares the second core with
    the decode and this fold while its first thread parses."""

    def __init__(self, decode, jobs: list):
        import threading

        self._decode = decode
        self._jobs = sorted(jobs, key=lambda job: decode.order(job[0]))
        # folded output -> (its event, its levels), found from any view of it (see MemoryOwners)
        self._outputs = MemoryOwners()
        self._events = []
        for q, _, _, _, _, out in self._jobs:
            event = threading.Event()
            self._outputs.add(out, (event, q))
            self._events.append(event)
        self._error = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="passes-weight-fold", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for (q, scale, zp, axis, block, out), event in zip(self._jobs, self._events):
                if self._stop:
                    raise InvalidArgumentError("the weights' fold was abandoned (a failed load)")
                self._decode.ready(q)
                _dequantize(q, scale, zp, axis, block, out=out)
                event.set()
        except BaseException as exc:  # reported by ready() and wait()
            self._error = exc
        finally:
            self._jobs = []  # (the levels are freed as soon as folded)
            for event in self._events:
                event.set()

    def order(self, array) -> int:
        event, levels = self._outputs.find(array, (None, None))
        return self._decode.order(array if event is None else levels)

    def ready(self, array, block: bool = True) -> bool:
        event, _ = self._outputs.find(array, (None, None))
        if event is None:
            return self._decode.ready(array, block)
        if not block and not event.is_set():
            return False
        event.wait()
        if self._error is not None:
            raise self._error
        return True

    def wait(self) -> None:
        self._thread.join()
        self._outputs.clear()  # (the levels are no longer held)
        try:
            self._decode.wait()
        finally:
            if self._error is not None:
                error, self._error = self._error, None
                raise error

    def abandon(self) -> None:
        """On a failed load: the decode stops first (a fold waiting for its levels then returns),
        then the fold."""
        self._stop = True
        self._decode.abandon()
        self._thread.join()


# operators whose presence means activations are quantized: disabling the QDQ fusions would slow
# the run down
_QUANTIZE_OPS = frozenset({("", "QuantizeLinear"), ("", "DynamicQuantizeLinear")})


def fold_facts(split: SplitModel, table: NodeTable | None = None) -> tuple[bool, bool]:
    """(foldable, onnxruntime_folds_all) from one walk of the graph's NodeTable (`table`: the
    caller's, when it has one; the load takes both answers).

    foldable: whether any node (subgraphs included) is one fold_into may replace: a DequantizeLinear,
    an operator with a registered folder, or a Gather with a Cast (palettes).

    onnxruntime_folds_all: whether onnxruntime's own constant folding can do the whole fold (then
    nothing here needs to touch the graph or read a weight): the only foldable nodes are standard
    DequantizeLinear nodes of the main graph (no other registered form, no palette, no subgraph),
    and no activation is quantized (QuantizeLinear: disabling the QDQ fusions would slow the run
    down). Used for float16 weights on a CPU, where plan_fold(share=False) would defer every big
    DequantizeLinear to onnxruntime anyway: folding the small ones here and walking the graph to
    do so cost more than it saved (open_nsfw float16 q8.onnx: 182 ms CPU to a ready session
    against 140 ms for onnxruntime on the same file, 134 ms for the plain float16 model).
    Folding the big ones on a worker thread (passes.forms, bit-exact) while the skeleton is
    prepared and parsed, each float16 weight streamed as soon as folded, was measured slower too
    (2 cores, 9 fresh processes, min, against the plain float16 model): at load 0.9,
    minilm_fp16 q8.onnxz ready wall 1.62x (onnxruntime's fold 1.38x), CPU 1.57x (1.31x);
    open_nsfw_fp16 1.31x (1.25x). onnxruntime's own initialisation of the float16 model keeps
    both cores busy (its CPU is 1.5x its wall), and the fold (~47 ms on MiniLM, as much per value
    as onnxruntime's) plus parsing float16 instead of int8 bytes delays its parse. (Since then, on an
    AVX-512 CPU, the float16 route folds here, each weight as soon as its levels decode: runtime.py.)"""
    folders = _folders()
    table = node_table(split.skeleton.graph, table)
    foldable, folds_all = False, True
    casts, gathers, muls = [], [], []
    for row in table.rows:
        op_type, domain = row[0], row[1]
        if op_type == "DequantizeLinear":
            foldable = True
            folds_all = folds_all and domain in ("", "ai.onnx")
        elif (domain or "", op_type) in folders:
            foldable, folds_all = True, False
        elif (domain or "", op_type) in _QUANTIZE_OPS:
            folds_all = False
        elif op_type == "Cast":
            casts.append(row)
        elif op_type == "Gather":
            gathers.append(row)
        elif op_type == "Mul":
            muls.append(row)
    inner = table.subgraphs()
    if inner:
        folds_all = False
    while inner and not foldable:  # inside subgraphs only whether something is foldable counts
        for node in inner.pop().node:
            if node.op_type == "DequantizeLinear" or (node.domain or "", node.op_type) in folders:
                foldable = True
                break
            inner.extend(subgraphs(node))
    if casts and gathers:  # palettes: Gather(constant table, Cast(constant indices)), see _fold_palettes
        # (indices or table in a small Constant node count too: constants_to_initializers makes them
        # initializers before fold_into looks for palettes)
        inits = split.initializer_names() | {outputs[0] for op_type, _, _, outputs in table.rows
                                              if op_type == "Constant" and outputs}
        cast_of_constant = {outputs[0] for _, _, inputs, outputs in casts if inputs and inputs[0] in inits}
        for _, _, inputs, _ in gathers:
            if len(inputs) == 2 and inputs[1] in cast_of_constant:
                folds_all = False
                foldable = foldable or inputs[0] in inits
    if casts and muls:
        # float16 Cast+Mul levels (_fold_float16_levels); level_patterns walks the graph (0.5 ms on
        # MiniLM, 1.9 on open_nsfw): only where a Mul reads a float16 initializer, as their Mul does
        # (and only where a Cast reads integer levels, as theirs does: open_nsfw_fp16's Mul nodes read
        # float16 initializers too, and level_patterns cost it ~2 ms per load for nothing)
        from .cast_levels import LEVEL_TYPES

        half, levels = set(), set()
        for t in split.skeleton.graph.initializer:
            if t.data_type == onnx.TensorProto.FLOAT16:
                half.add(t.name)
            elif t.data_type in LEVEL_TYPES:
                levels.add(t.name)
        if (levels and any(inputs and inputs[0] in levels for _, _, inputs, _ in casts)
                and any(name in half for _, _, inputs, _ in muls for name in inputs) and float16_level_patterns(split)):
            foldable, folds_all = True, False
    return foldable, folds_all


def float16_level_patterns(split: SplitModel) -> list:
    """The main graph's Cast+Mul level patterns computing in float16 (cast_levels' form of files
    written before 1de3b35): onnxruntime's CPU provider has no float16 Mul kernel, so its constant
    folding leaves them to run at every inference; fold_into folds them (_fold_float16_levels)."""
    from .cast_levels import level_patterns

    return [p for p in level_patterns(split.skeleton.graph) if p.float16_arithmetic]


# mode="fold", float32: when the quantized weights that could be shared (read only by MatMul, Gemm,
# Gather) hold at most this share of the quantized bytes, onnxruntime folds every DequantizeLinear
# itself (see little_to_share)
SHARED_FOLD_MIN_SHARE = 0.05


def little_to_share(split: SplitModel, table: NodeTable | None = None) -> bool:
    """Whether folding here would share almost nothing with onnxruntime: the constant
    DequantizeLinear nodes whose every reader is a shareable operator input (SHAREABLE_CONSUMERS)
    hold at most SHARED_FOLD_MIN_SHARE of the quantized bytes. The other big ones (Conv weights,
    which onnxruntime reorders) are left to onnxruntime's constant folding anyway (plan_fold); then
    folding the few shareable ones here costs more in graph walks than it saves (open_nsfw q8:
    52 Conv weights and one 2048x2 MatMul weight). Call only where onnxruntime_folds_all holds
    (main-graph standard DequantizeLinear nodes, no subgraph). `table`: the graph's NodeTable."""
    from .runtime_feed import SHAREABLE_CONSUMERS

    graph = split.skeleton.graph
    table = node_table(graph, table)
    quantized = {}  # DequantizeLinear output -> bytes of its quantized input
    for op_type, _, inputs, outputs in table.rows:
        if op_type == "DequantizeLinear" and inputs:
            q = split.weights.get(inputs[0])
            quantized[outputs[0]] = q.nbytes if q is not None else 0
    total = sum(quantized.values())
    if not total:
        return True
    unshared = {o.name for o in graph.output if o.name in quantized}
    for op_type, domain, inputs, _ in table.rows:
        if quantized.keys().isdisjoint(inputs):
            continue
        for index, name in enumerate(inputs):
            if name in quantized and index not in SHAREABLE_CONSUMERS.get((domain or "", op_type), ()):
                unshared.add(name)
    shareable = sum(size for name, size in quantized.items() if name not in unshared)
    return shareable <= SHARED_FOLD_MIN_SHARE * total


def gather_dequantized_rows(split: SplitModel, table: NodeTable | None = None) -> list:
    """Embedding tables read only by a Gather (axis 0) through a constant DequantizeLinear are
    dequantized as their rows are gathered, at run time, instead of folded whole at load:
    Gather(DequantizeLinear(q, s, zp), ids) becomes DequantizeLinear(Gather(q, ids), s, zp), the
    gathered rows flattened to 2-D as the table was (then reshaped back) where the scale is per
    column, or per row (then the scales and zero points are gathered with the rows). Each output value is the same product rounded once, by the same DequantizeLinear
    kernel: bit-identical to the folded table's rows. Returns the tables rewritten.

    Used where onnxruntime folds everything (float16 weights on a CPU): its constant folding of a
    float16 DequantizeLinear costs several times its float32 one, and an embedding table is often
    the largest weight (MiniLM: 11.7 M of its 22 M weights). The table stays 8-bit in memory; a
    run dequantizes only the rows it reads. `table`: the graph's NodeTable (a rewrite here adds
    nodes: the caller's table is then no longer current)."""
    graph = split.skeleton.graph
    if not reads_gathered_dequantize(node_table(graph, table)):
        return []  # (most models: the reader map below costs several times this look)
    readers = main_graph_uses(graph)  # subgraph reads and graph outputs count: the table stays then
    outputs = {o.name for o in graph.output}
    inits = split.initializer_names()
    taken = set(inits) | {i.name for i in graph.input} | outputs
    for node in graph.node:
        taken.update(node.output)
    fresh = NameAllocator(taken).take

    rewritten, replaced = [], {}
    for node in graph.node:
        plan = _gather_rows_plan(node, split, readers, outputs, inits)
        if plan is None:
            continue
        gather, q_shape, per = plan
        q, s = node.input[0], node.input[1]
        zp = node.input[2] if len(node.input) > 2 and node.input[2] else None
        out, ids = gather.output[0], gather.input[1]
        rows = fresh(f"{out}_rows")
        new = [helper.make_node("Gather", [q, ids], [rows], name=fresh(f"{out}_gather_rows"))]
        if per == "tensor":
            new.append(helper.make_node("DequantizeLinear", [rows, s] + ([zp] if zp else []), [out],
                                        name=fresh(f"{out}_dequantize")))
        else:  # rows as 2-D, as the table was: a scale per column as it is, a scale per row gathered too
            flat_shape = fresh(f"{out}_rows_2d_shape")
            split.set_weight(flat_shape, np.array([-1, q_shape[1]], np.int64))
            flat = fresh(f"{out}_rows_2d")
            new.append(helper.make_node("Reshape", [rows, flat_shape], [flat], name=fresh(f"{out}_flatten")))
            dq_inputs = [flat, s] + ([zp] if zp else [])
            if per == "row":
                minus_one = fresh(f"{out}_minus_one")
                split.set_weight(minus_one, np.array([-1], np.int64))
                for k, (name, what) in enumerate(((s, "scale"), (zp, "zero_point"))):
                    if not name:
                        continue
                    gathered, flat_1d = fresh(f"{out}_row_{what}"), fresh(f"{out}_row_{what}_1d")
                    new += [helper.make_node("Gather", [name, ids], [gathered], name=fresh(f"{out}_gather_{what}")),
                            helper.make_node("Reshape", [gathered, minus_one], [flat_1d],
                                             name=fresh(f"{out}_flatten_{what}"))]
                    dq_inputs[1 + k] = flat_1d
            flat_out, rows_shape = fresh(f"{out}_2d"), fresh(f"{out}_rows_shape")
            new += [helper.make_node("DequantizeLinear", dq_inputs, [flat_out], axis=0 if per == "row" else 1,
                                     name=fresh(f"{out}_dequantize")),
                    helper.make_node("Shape", [rows], [rows_shape], name=fresh(f"{out}_shape")),
                    helper.make_node("Reshape", [flat_out, rows_shape], [out], name=fresh(f"{out}_unflatten"))]
        replaced[id(gather)] = new
        replaced[id(node)] = []
        rewritten.append(q)
    if rewritten:
        nodes = []
        for n in graph.node:
            nodes.extend(replaced.get(id(n), [n]))
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def reads_gathered_dequantize(table: NodeTable) -> bool:
    """Whether a Gather of the main graph reads a DequantizeLinear output (an embedding table that
    gather_dequantized_rows may rewrite)."""
    dequantized = {outputs[0] for op_type, _, _, outputs in table.rows if op_type == "DequantizeLinear" and outputs}
    return any(op_type == "Gather" and inputs and inputs[0] in dequantized for op_type, _, inputs, _ in table.rows)


def _gather_rows_plan(node, split: SplitModel, readers: dict, outputs: set, inits: set):
    """(gather node, table shape, "tensor" | "column" | "row") when `node` is a constant
    DequantizeLinear of a 2-D 8-bit table whose only reader is input 0 of a Gather on axis 0;
    else None."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    out = node.output[0]
    uses = readers.get(out, [])
    if out in outputs or len(uses) != 1:
        return None
    gather, index = uses[0]
    if gather is None or gather.op_type != "Gather" or gather.domain not in ("", "ai.onnx") or index != 0 or _attr(gather, "axis", 0) != 0:
        return None
    if _attr(node, "block_size", 0) or _attr(node, "output_dtype", 0):
        return None
    names = [n for n in node.input if n]
    if any(n not in inits for n in names):
        return None
    q, s = split.array(node.input[0]), split.array(node.input[1])
    if q is None or s is None or q.ndim != 2 or q.size == 0 or q.dtype not in (np.int8, np.uint8):
        return None
    zp = split.array(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if zp is not None and zp.shape != s.shape:
        return None
    if s.size == 1 and s.ndim <= 1:
        return gather, q.shape, "tensor"
    axis = _attr(node, "axis", 1)
    if s.ndim != 1 or not -2 <= axis < 2:
        return None
    axis %= 2
    if s.shape[0] != q.shape[axis]:
        return None
    return gather, q.shape, "row" if axis == 0 else "column"


def constant_foldable_nodes(split: SplitModel, folders: dict, table: NodeTable | None = None) -> list:
    """Main-graph nodes with a folder whose inputs are all initializers (`table`: the graph's
    NodeTable)."""
    inits = split.initializer_names()
    nodes = split.skeleton.graph.node
    return [
        nodes[k] for k, (op_type, domain, inputs, _) in enumerate(node_table(split.skeleton.graph, table).rows)
        if ((domain or "", op_type) in folders or (op_type == "DequantizeLinear" and domain in ("", "ai.onnx")))
        and inputs and all((not name) or name in inits for name in inputs)
    ]


def fold_into(split: SplitModel, progress=None, only=None, subgraphs=None, ahead: bool = False,
              constants: bool = True, refresh: bool = True, dequantize_only: bool = False,
              table: NodeTable | None = None) -> int:
    """Replace constant DequantizeLinear (and other registered constant-form) nodes by their
    float initializers (subgraphs too unless `only` is given or subgraphs=False); returns how
    many were folded. `only`: optional predicate on a main-graph node. `ahead` (only where
    onnxruntime_folds_all holds: nothing else here reads a weight's values): the nodes the kernel
    takes whose levels are still decoding (split.pending) are folded as they decode, by a
    FoldAhead that becomes split.pending; the others are folded now. constants=False: the caller
    has run constants_to_initializers already; refresh=False: the caller refreshes the
    placeholders itself afterwards (each is a walk over every node, on the main thread before
    onnxruntime can start). dequantize_only: the caller knows (fold_facts' onnxruntime_folds_all)
    that the main graph's foldable nodes are standard DequantizeLinear nodes and that no node holds
    a subgraph: the subgraph and palette walks, which would find nothing, are skipped, and readers
    are counted only for the names the folded nodes read (three walks over every node fewer, on the
    main thread before onnxruntime can start). `table`: the graph's NodeTable, kept current here
    (the folded nodes' rows are removed with them)."""
    decode = split.pending if ahead else None
    jobs = []
    # the outputs folded ahead are filled on the fold thread: small ones cut from shared arrays,
    # whose first touch maps huge pages (see runtime_arena)
    arena = Arena() if decode is not None else None
    folders = _folders()
    table = node_table(split.skeleton.graph, table)
    if constants:
        constants_to_initializers(split, table)
    if (subgraphs if subgraphs is not None else only is None) and not dequantize_only:
        fold_subgraphs(split.skeleton.graph, folders)
    types = {t.name: t.data_type for t in split.skeleton.graph.initializer}
    nodes = [n for n in constant_foldable_nodes(split, folders, table) if only is None or only(n)]
    folded = set()
    consumers = _consumer_counts(split.skeleton.graph, {i for n in nodes for i in n.input} if dequantize_only else None,
                                 table)
    for done, node in enumerate(nodes, 1):
        arrays = [split.array(i) if i else None for i in node.input]
        if any(a is None for a, i in zip(arrays, node.input) if i):
            continue
        fn = folders.get((node.domain or "", node.op_type), _local_dq)
        # (com.microsoft's DequantizeLinear, onnxruntime's quantizer's below opset 21, means what
        # onnx's does and has no block_size: its 8-bit weights take the kernel too)
        if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx", "com.microsoft"):
            if decode is not None and decode.order(arrays[0]) >= 0:
                for a in arrays[1:]:  # (scales and zero points: small, decoded first if coded at all)
                    if a is not None:
                        decode.ready(a)
                result = _kernel_dq(node, arrays, [types.get(i, 0) for i in node.input], fn, later=jobs,
                                    ready=decode.ready, arena=arena)
            else:
                result = _kernel_dq(node, arrays, [types.get(i, 0) for i in node.input], fn)
        else:
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
    if jobs:
        split.pending = FoldAhead(decode, jobs)
    if not dequantize_only:
        folded |= _fold_palettes(split, consumers, only)
        folded |= _fold_float16_levels(split, consumers, only)
    if folded:
        graph = split.skeleton.graph
        gone = [i for i, row in enumerate(table.rows) if row[3] and row[3][0] in folded]
        remove_nodes(graph, gone)
        table.remove(gone)
        if refresh:
            split.refresh_placeholders()
    return len(folded)


def remove_nodes(graph, indices: list) -> None:
    """Delete the nodes at `indices` (ascending) from `graph`, in place: clearing the list and
    extending it with the kept ones copied every node twice (0.42 ms against 0.11 for
    open_nsfw's 41 Constant nodes out of 902)."""
    nodes = graph.node
    for i in reversed(indices):
        del nodes[i]


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


def _fold_float16_levels(split: SplitModel, consumers: dict, only) -> set:
    """Level patterns whose Sub and Mul are float16 (float16_level_patterns) become their float16
    weight, bit for bit what fold_dequantize writes and what onnxruntime computes for the pattern
    (cast_levels.pattern_value); returns the output names of the nodes replaced. A blocked form's
    Reshape stays (onnxruntime folds a Reshape of a constant)."""
    from .cast_levels import pattern_value

    done = set()
    for p in float16_level_patterns(split):
        if only is not None and not only(p.mul):
            continue
        value = pattern_value(p, lambda t: split.array(t.name))
        tensors = [t for t in (p.levels, p.zero_point, p.scale) if t is not None]
        split.set_weight(p.output, value)
        done |= {n.output[0] for n in p.nodes()}
        # the levels are dropped as soon as nothing else reads them (bounded memory)
        for t in tensors:
            if t.name in split.weights and consumers.get(t.name, 0) <= 1:
                split.weights.pop(t.name)
            consumers[t.name] = consumers.get(t.name, 0) - 1
    return done


def plan_fold(split: SplitModel, options, share: bool = True, table: NodeTable | None = None) -> set:
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
    table = node_table(graph, table)
    if any(row[0] in ("QuantizeLinear", "DynamicQuantizeLinear") for row in table.rows):
        return set()
    readers = main_graph_readers(graph)
    folders = _folders()
    deferred = set()
    for node in constant_foldable_nodes(split, folders, table):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        if split.array(node.input[0]) is None or split.array(node.input[0]).nbytes <= 4096:
            continue
        if not share or not consumers_shareable(graph, node.output[0], readers=readers):
            deferred.add(node.output[0])
    if deferred:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    return deferred


def constants_to_initializers(split: SplitModel, table: NodeTable | None = None) -> None:
    """Main-graph Constant nodes holding a tensor become initializers (small ones stay inline),
    so that a DequantizeLinear reading e.g. a Constant scale is constant-foldable here. `table`:
    the graph's NodeTable, kept current (the moved nodes' rows are removed with them)."""
    graph = split.skeleton.graph
    table = node_table(graph, table)
    nodes = graph.node
    moved = []
    for i, row in enumerate(table.rows):
        if row[0] != "Constant":
            continue
        node = nodes[i]
        value = _constant_tensor(node)
        if value is not None:
            split.set_weight(node.output[0], numpy_helper.to_array(value))
            moved.append(i)
    if moved:
        remove_nodes(graph, moved)
        table.remove(moved)


def dequantize_reads_constant(table: NodeTable) -> bool:
    """Whether a main-graph DequantizeLinear reads a Constant node's output (a scale or zero point
    written as a Constant: constants_to_initializers must run before the fold can read it)."""
    constants = {outputs[0] for op_type, _, _, outputs in table.rows if op_type == "Constant" and outputs}
    return bool(constants) and any(op_type == "DequantizeLinear" and not constants.isdisjoint(inputs)
                                   for op_type, _, inputs, _ in table.rows)


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
        if node.op_type not in GRAPH_OPS and node.domain in ("", "ai.onnx"):
            continue  # (no graph: the test subgraphs() starts with, without a call per node)
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


def _consumer_counts(graph, names=None, table: NodeTable | None = None) -> dict:
    """name -> how many times it is read (node inputs, subgraphs' outer-scope reads, graph outputs);
    `names` (a set): only the reads of those by nodes counted (a node reading none of them is
    skipped in C), and every read by subgraphs and outputs. `table`: the graph's NodeTable."""
    table = node_table(graph, table)
    counts = {}
    for row in table.rows:
        inputs = row[2]
        if names is not None and names.isdisjoint(inputs):
            continue
        for name in inputs:
            if names is None or name in names:
                counts[name] = counts.get(name, 0) + 1
    for g in table.subgraphs():  # names a subgraph reads from the outer scope count as uses
        for inner in _consumer_counts(g):
            counts[inner] = counts.get(inner, 0) + 1
    for o in graph.output:
        counts[o.name] = counts.get(o.name, 0) + 1
    return counts
