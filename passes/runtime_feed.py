"""How weights reach onnxruntime without a temporary file and with one copy at a time.

A model is split into a *skeleton* (the graph, small tensors inline) and a dict of big weights
(numpy arrays). Each weight reaches onnxruntime in one of three ways:

- **shared** (`SessionOptions.add_initializer`): the weight stays declared in the skeleton as an
  external-data placeholder (name, dtype, shape) and onnxruntime uses our buffer as is, no copy.
  The buffer must outlive the session (the session object keeps it). Graph optimisers that want
  to read or rewrite the tensor's bytes (NCHWc reordering of Conv weights, the transpose
  optimiser, constant folding, float16 -> float32 casts on a CPU) cannot see a shared tensor and
  fail, so only tensors consumed by operators that read weights at kernel creation (MatMul, Gemm,
  Gather, MatMulNBits, ...) are shared.
- **embedded** (`serialise_with_weights`, models under EMBED_MAX_BYTES): a weight onnxruntime must
  own goes inside the model it parses, as raw_data. Measured: handed over as an OrtValue
  (add_external_initializers) it was copied during initialisation while our array lived on, so
  both copies sat beside onnxruntime's reordered one (open_nsfw float pack: 1.31-1.54x the plain
  file's added memory; float16 MiniLM: 1.39x). Embedded, our array is dropped once onnxruntime has
  parsed it (1.00-1.06x). The model is streamed through a pipe (`runtime.parse_pieces`), so
  neither joined bytes nor pybind's std::string copy of them exists.
- **copied** (`SessionOptions.add_external_initializers`): what cannot be embedded (models near
  protobuf's 2 GiB limit, GPU sessions); onnxruntime copies the bytes before optimising.

Placeholders point at ".", a location that is never a data file: onnxruntime never reads it,
because every placeholder is replaced by an OrtValue before anything reads it.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger("passes.runtime")

# Below this many bytes a tensor stays inline in the skeleton: shape-like inputs (Reshape shapes,
# Clip bounds, scales) must be visible to onnxruntime's shape inference, and onnxruntime refuses
# user buffers under 128 bytes anyway.
INLINE_MAX_BYTES = 4096

# onnxruntime checks that an external-data location exists (relative to the working folder for a
# model given as bytes) even when the bytes come from an OrtValue; "." always exists and is never a
# readable data file, so a placeholder cannot be confused with real external data.
PLACEHOLDER_LOCATION = "."

# Operators whose kernels read a weight input once, at kernel creation, and that no optimiser
# rewrites by reading the bytes: their weights can be shared with onnxruntime without a copy.
SHAREABLE_CONSUMERS = {
    ("", "MatMul"): {1},
    ("", "Gemm"): {1},
    ("", "Gather"): {0},
    ("com.microsoft", "MatMulNBits"): {1, 3},
    ("com.microsoft", "GatherBlockQuantized"): {0, 3},
}


def np_dtype_to_onnx(dtype: np.dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def placeholder(name: str, array: np.ndarray) -> TensorProto:
    """An initializer declaration whose bytes live outside the protobuf."""
    t = TensorProto()
    t.name = name
    t.data_type = np_dtype_to_onnx(array.dtype)
    t.dims.extend(array.shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", PLACEHOLDER_LOCATION), ("offset", "0"), ("length", str(array.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


_ONNX_TYPES: dict = {}  # numpy dtype -> TensorProto data type (helper's lookup is slow per call)


def _declares(t: TensorProto, array: np.ndarray) -> bool:
    """Whether placeholder `t` already declares `array`'s dtype and shape (then its length too):
    rebuilding every placeholder on each refresh cost more than the rest of the refresh."""
    dtype = _ONNX_TYPES.get(array.dtype)
    if dtype is None:
        dtype = _ONNX_TYPES[array.dtype] = np_dtype_to_onnx(array.dtype)
    return t.data_type == dtype and tuple(t.dims) == array.shape


def is_placeholder(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == PLACEHOLDER_LOCATION for e in t.external_data
    )


@dataclasses.dataclass
class SplitModel:
    """A skeleton (graph + small tensors) and the big weights, by initializer name."""

    skeleton: onnx.ModelProto
    weights: dict  # name -> np.ndarray
    # a decode still filling some of `weights` (runtime_source.BackgroundDecode), or None
    pending: object = None

    def wait_weights(self) -> None:
        """Return once every weight holds its values (raises a background decode's error)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def _inline(self) -> dict:
        """name -> initializer TensorProto, rebuilt when the initializer list changed (rewrites
        replace the skeleton or edit the list; lookups must not scan it each time)."""
        inits = self.skeleton.graph.initializer
        key = (id(self.skeleton), len(inits))
        cache = getattr(self, "_inline_cache", None)
        if cache is None or cache[0] != key:
            cache = (key, {t.name: t for t in inits})
            self._inline_cache = cache
        return cache[1]

    def array(self, name: str) -> np.ndarray | None:
        """The value of a main-graph initializer (big or inline), or None when `name` is not one."""
        if name in self.weights:
            return self.weights[name]
        t = self._inline().get(name)
        if t is None or is_placeholder(t):
            return None
        return numpy_helper.to_array(t)

    def initializer_names(self) -> set:
        return set(self._inline())

    def set_weight(self, name: str, array: np.ndarray) -> None:
        """Add or replace a main-graph initializer; big arrays are fed, small ones go inline."""
        self.remove_initializer(name)
        inits = self.skeleton.graph.initializer
        if array.nbytes > INLINE_MAX_BYTES:
            self.weights[name] = np.ascontiguousarray(array)
            inits.append(placeholder(name, array))
        else:
            inits.append(numpy_helper.from_array(np.asarray(array), name))
        # keep the name index current instead of rebuilding it (folds add hundreds of tensors)
        cache = getattr(self, "_inline_cache", None)
        if cache is not None and cache[0] == (id(self.skeleton), len(inits) - 1):
            cache[1][name] = inits[-1]
            self._inline_cache = ((id(self.skeleton), len(inits)), cache[1])

    def remove_initializer(self, name: str) -> None:
        self.weights.pop(name, None)
        if name not in self._inline():
            return
        self._inline_cache = None
        inits = self.skeleton.graph.initializer
        for i in range(len(inits) - 1, -1, -1):
            if inits[i].name == name:
                del inits[i]

    def refresh_placeholders(self, used: set | None = None) -> None:
        """Make every placeholder match the array that will be fed (dtype and shape may have
        changed in a rewrite, e.g. a float16 conversion) and drop unused ones. `used`: the names
        the graph reads, when the caller has them (GraphReads.used)."""
        if used is None:
            used = _used_names(self.skeleton.graph)
        inits = self.skeleton.graph.initializer
        for i in range(len(inits) - 1, -1, -1):
            t = inits[i]
            name = t.name
            if name not in used:
                self.weights.pop(name, None)
                del inits[i]
            # (weights already on a device are declared by their maker)
            elif name in self.weights and is_placeholder(t) and not _declares(t, self.weights[name]):
                t.CopyFrom(placeholder(name, self.weights[name]))
        for name in list(self.weights):
            if name not in used:
                del self.weights[name]


# default-domain operators with graph attributes; nodes of other domains may hold graphs too
GRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def subgraphs(node: onnx.NodeProto) -> list:
    """The graphs a node holds in its attributes. Only operators that can hold one are looked into:
    reading every node's attributes cost more than the rest of the walks that need this."""
    if node.op_type not in GRAPH_OPS and node.domain in ("", "ai.onnx"):
        return []
    out = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


class NodeTable:
    """The main graph's nodes read once: `rows`, one (op_type, domain, inputs, outputs) per node in
    graph order (inputs and outputs as lists of names), and `holders`, the indices of the nodes that
    may hold subgraphs (see subgraphs). The fold route's steps (the model's float type, fold_facts,
    constants_to_initializers, the embedding-table check, fold_into's foldable nodes and reader
    counts, graph_reads) each walked the graph through protobuf accessors before onnxruntime could
    start: 6-8 walks over a ResNet-50's 902 nodes at 0.3-1.2 ms each. The table costs one such walk;
    the steps then loop over plain Python lists. A step that removes nodes calls `remove` with their
    indices; one that adds nodes builds a new table (`current` tells a table from a stale one)."""

    __slots__ = ("graph", "rows", "holders")

    def __init__(self, graph):
        self.graph = graph
        self.rows = [(node.op_type, node.domain, node.input[:], node.output[:]) for node in graph.node]
        self._find_holders()

    def _find_holders(self) -> None:
        self.holders = [i for i, (op_type, domain, _, _) in enumerate(self.rows)
                        if op_type in GRAPH_OPS or domain not in ("", "ai.onnx")]

    def current(self) -> bool:
        """Whether the table still lists the graph's nodes (as many rows as nodes: every rewrite
        that adds or removes nodes changes the count or builds a new table)."""
        return len(self.rows) == len(self.graph.node)

    def remove(self, indices: list) -> None:
        """The rows at `indices` (ascending) dropped, as remove_nodes drops those nodes."""
        rows = self.rows
        for i in reversed(indices):
            del rows[i]
        if self.holders:
            self._find_holders()

    def subgraphs(self) -> list:
        """Every graph the main graph's nodes hold (not their nested ones)."""
        nodes = self.graph.node
        return [g for i in self.holders for g in subgraphs(nodes[i])]


def node_table(graph, table: "NodeTable | None" = None) -> NodeTable:
    """`table` when it is the graph's and current, else a new one."""
    if table is not None and table.graph is graph and table.current():
        return table
    return NodeTable(graph)


def _used_names(graph: onnx.GraphProto) -> set:
    """Names read by the graph's nodes (subgraphs included, for outer-scope references) or outputs."""
    used = {o.name for o in graph.output}
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            used.update(node.input)
            if node.op_type in GRAPH_OPS or node.domain not in ("", "ai.onnx"):  # (see subgraphs)
                stack.extend(subgraphs(node))
    return used


def split_model(model: onnx.ModelProto, *, take_ownership: bool = False) -> SplitModel:
    """Move every big main-graph tensor (initializers and Constant-node values) out of the protobuf.

    With `take_ownership` the given model is emptied tensor by tensor as it is read (no moment
    holds two copies of all weights); otherwise it is left untouched.
    """
    if not take_ownership:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    weights = {}
    graph = model.graph
    for t in graph.initializer:
        if t.data_location == TensorProto.EXTERNAL or _payload_bytes(t) <= INLINE_MAX_BYTES:
            continue
        array = numpy_helper.to_array(t)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.ascontiguousarray(array).copy()
        weights[t.name] = array
        t.CopyFrom(placeholder(t.name, array))
    # Constant nodes of the main graph holding big tensors become fed initializers too.
    keep = []
    for node in graph.node:
        value = _big_constant_value(node)
        if value is None:
            keep.append(node)
            continue
        array = np.ascontiguousarray(numpy_helper.to_array(value)).copy()
        weights[node.output[0]] = array
        graph.initializer.append(placeholder(node.output[0], array))
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)
    return SplitModel(model, weights)


def _payload_bytes(t: TensorProto) -> int:
    if t.HasField("raw_data"):
        return len(t.raw_data)
    return 4 * (len(t.float_data) + len(t.int32_data)) + 8 * (len(t.int64_data) + len(t.double_data))


def _big_constant_value(node: onnx.NodeProto) -> TensorProto | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            if attr.t.data_location != TensorProto.EXTERNAL and _payload_bytes(attr.t) > INLINE_MAX_BYTES:
                return attr.t
    return None


# mode int8 keeps DequantizeLinear nodes that onnxruntime runs on every run (never folds): their
# integer input can be shared too
SHAREABLE_DEQUANTIZE = {("", "DequantizeLinear"): {0}}


def main_graph_readers(graph) -> dict:
    """name -> [(domain, op_type, input index)] over the main graph's nodes."""
    readers: dict = {}
    for node in graph.node:
        for index, inp in enumerate(node.input):
            readers.setdefault(inp, []).append((node.domain or "", node.op_type, index))
    return readers


def main_graph_uses(graph) -> dict:
    """name -> [(node, input index)] over the main graph's nodes. A name read inside a subgraph
    (an outer-scope reference) or listed as a graph output also gets a (None, -1) use: a rewrite
    that moves or removes the name's producer must leave such a name alone."""
    uses: dict = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, i))
        for sub in subgraphs(node):
            for inner in _names_read_in(sub):
                uses.setdefault(inner, []).append((None, -1))
    for o in graph.output:
        uses.setdefault(o.name, []).append((None, -1))
    return uses


def _names_read_in(g) -> set:
    names = set()
    for node in g.node:
        names.update(node.input)
        for sub in subgraphs(node):
            names |= _names_read_in(sub)
    return names


def consumers_shareable(graph, name: str, extra=None, readers=None) -> bool:
    """True when every reader of `name` in the main graph is a shareable operator input."""
    table = {**SHAREABLE_CONSUMERS, **(extra or {})}
    uses = (readers if readers is not None else main_graph_readers(graph)).get(name, [])
    if not uses or name in {o.name for o in graph.output}:
        return False
    return all(index in table.get((domain, op), ()) for domain, op, index in uses)


@dataclasses.dataclass
class GraphReads:
    """What a graph reads, from one walk (graph_reads)."""

    used: set | None  # every name read: node inputs of the main graph and its subgraphs, graph outputs
    readers: dict  # name -> [(domain, op_type, input index)] over main-graph nodes, for the names asked
    outer: set    # names read inside subgraphs (outer-scope references) or listed as graph outputs
    op_counts: dict  # op_type -> number of main-graph nodes


def graph_reads(graph, names, collect_used: bool = True, table: NodeTable | None = None) -> GraphReads:
    """One walk over the main graph (and the subgraphs' reads) giving what the load's last steps
    each walked the graph for (refresh_placeholders, shareable_names, the operator counts).
    `names`: the names whose main-graph readers are listed (a set or dict). collect_used=False:
    `used` is None (not gathered: adding every node's inputs to it was ~40% of the walk; the
    verbatim route only judges sharing). A node none of whose inputs is in `names` is not looked
    at input by input. `table`: the graph's NodeTable, when the caller has one."""
    table = node_table(graph, table)
    used = {o.name for o in graph.output}
    outer = set(used)
    readers: dict = {}
    counts: dict = {}
    keys = names.keys() if isinstance(names, dict) else names if isinstance(names, (set, frozenset)) else set(names)
    for op_type, domain, inputs, _ in table.rows:
        counts[op_type] = counts.get(op_type, 0) + 1
        if collect_used:
            used.update(inputs)
        if keys.isdisjoint(inputs):  # (in C: most nodes read no weight; no Python loop over their inputs)
            continue
        for index, name in enumerate(inputs):
            if name in names:
                readers.setdefault(name, []).append((domain or "", op_type, index))
    for g in table.subgraphs():
        inner = _used_names(g)
        used |= inner
        outer |= inner
    return GraphReads(used if collect_used else None, readers, outer, counts)


def operator_counts(graph, table: NodeTable | None = None) -> dict:
    """op_type -> number of main-graph nodes (GraphReads.op_counts without graph_reads' walk over
    every input)."""
    counts: dict = {}
    if table is not None and table.graph is graph and table.current():
        for row in table.rows:
            op_type = row[0]
            counts[op_type] = counts.get(op_type, 0) + 1
        return counts
    for node in graph.node:
        op_type = node.op_type
        counts[op_type] = counts.get(op_type, 0) + 1
    return counts


def shareable_names(split: SplitModel, extra=None, reads: GraphReads | None = None) -> set:
    """Fed weights that every consumer reads only at kernel creation (safe to share, no copy).
    `reads`: graph_reads of the graph as it is, when the caller has it."""
    table = {**SHAREABLE_CONSUMERS, **(extra or {})}
    if reads is None:
        reads = graph_reads(split.skeleton.graph, split.weights)
    consumers = {name: uses for name, uses in reads.readers.items() if name in split.weights}
    # names read inside subgraphs (outer-scope references) or returned as outputs stay copied
    outputs = reads.outer
    shared = set()
    for name, uses in consumers.items():
        if name in outputs:
            continue
        if all(index in table.get((domain, op), ()) for domain, op, index in uses):
            shared.add(name)
    return shared


# A model given as bytes goes through protobuf: below this size the weights onnxruntime copies
# anyway can travel inside those bytes (see serialise_with_weights); above it (protobuf's 2 GiB
# message limit, with room for the graph) they go as OrtValues
EMBED_MAX_BYTES = (1 << 31) - (64 << 20)


def serialise_with_weights(skeleton: onnx.ModelProto, arrays: dict, names) -> list:
    """The skeleton's bytes with the weights `names` inside, as raw_data initializers: a list of
    buffers (views of the arrays, no copy) whose concatenation is the model.

    Why: onnxruntime copies a weight given with add_external_initializers into its graph while our
    array is still alive, and it keeps its copy for its optimisers (Conv reordering, float16 casts):
    both copies coexist during optimisation. Given inside the model bytes, the weight's only copy
    during optimisation is the one onnxruntime parsed; ours is dropped before that (the caller drops
    `arrays[name]` once these bytes exist). The weights are appended as a second `graph` field
    holding only initializers: protobuf merges repeated occurrences of a message field, so
    onnxruntime sees one graph. The placeholders of `names` are removed from `skeleton`.
    """
    from .onnxz.protowire import write_varint

    names = [n for n in names if n in arrays]
    wanted = set(names)
    inits = skeleton.graph.initializer
    for i in range(len(inits) - 1, -1, -1):
        if inits[i].name in wanted:
            del inits[i]
    pieces = []
    graph_length = 0
    for name in names:
        array = np.ascontiguousarray(arrays[name])
        meta = TensorProto()
        meta.name = name
        meta.data_type = np_dtype_to_onnx(array.dtype)
        meta.dims.extend(array.shape)
        head = meta.SerializeToString() + write_varint(9 << 3 | 2) + write_varint(array.nbytes)
        entry = write_varint(5 << 3 | 2) + write_varint(len(head) + array.nbytes) + head
        pieces += [entry, array.reshape(-1).view(np.uint8)]
        graph_length += len(entry) + array.nbytes
    graph_field = write_varint(7 << 3 | 2) + write_varint(graph_length)
    return [skeleton.SerializeToString(), graph_field] + pieces

