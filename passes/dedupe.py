"""Byte-identical weights stored once (lossless).

    d = dedupe_initializers(model)                     # tied / twice-exported weights stored once
    d = dedupe_initializers(model, min_bytes=0)        # every duplicate, scalars and shapes too

Two constant tensors with the same element type, shape and values (bit for bit: raw_data and
typed fields alike) are one weight stored twice: tied embeddings and lm_head, a weight exported
once per reader, the same Constant in each branch of an If. The pass keeps the first of them and
points every reader of the others at it; the model computes exactly what it computed before.

Which tensors take part, and where their readers may be repointed:

- main-graph initializers, and Constant nodes (value, value_float, value_floats) anywhere;
- If / Loop / Scan bodies: a body's own initializer or Constant merges into an identical tensor
  its scope sees (an outer one, defined before the body's node, or an earlier one of its own), and
  readers in bodies below are repointed to it;
- model-local functions: a body's Constant nodes merge among themselves (a function sees no name
  of the graph that calls it);
- never: a tensor that is also a graph input (the caller may feed another value), a graph output
  (its name is the model's interface), a name defined more than once anywhere (a subgraph that
  shadows an outer name: repointing a read there could reach the wrong tensor), a name the
  model's training_info binds or reads (training updates it by name) or a quantization_annotation
  names, sparse
  initializers, strings, tensors below `min_bytes`.

Large models: the values are compared only among tensors of the same type and shape, by a hash
first and then byte for byte, one tensor at a time (no second copy of the model's weights). A
tensor whose data is in an external file that was not loaded is read from `base_dir` in pieces;
without `base_dir` only tensors naming the same file range merge.

find_duplicates / apply_merges are the two halves, for a pass that builds its own copy of the
model (quantize_weights, palettize): they merge duplicates before choosing forms, so a weight
stored twice is quantized once and stored once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import onnx
from onnx import TensorProto

from . import graph
from ._fileio import _safe_external_path, load_model
from .errors import InvalidArgumentError, InvalidModelError
from .report import Report, TensorChange

DEFAULT_MIN_BYTES = 1024  # smaller tensors (shapes, axes, scalars) save nothing worth a rewired graph
_CHUNK = 16 << 20  # bytes hashed / compared at a time


@dataclass
class Merge:
    """One tensor dropped: its readers read `into`, which holds the same values."""
    name: str
    into: str
    shape: tuple
    dtype: str
    nbytes: int
    location: str  # "initializer", "Constant node", "subgraph ...: ...", "function <name>: Constant node"
    scope: tuple = ()  # () for the main graph and its subgraphs, else the function's (domain, name, overload)


@dataclass
class _Def:
    name: str
    tensor: TensorProto
    location: str
    payload: TensorProto | None = None  # where the values are when `tensor` lacks them
    digest: bytes | None = None


def _values_tensor(d: _Def) -> TensorProto:
    return d.payload if d.payload is not None else d.tensor


def _external_info(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _chunks(d: _Def, base_dir: Path | None) -> Iterator[bytes]:
    """The tensor's values as its raw_data would hold them, _CHUNK bytes at a time."""
    t = _values_tensor(d)
    if t.data_location == TensorProto.EXTERNAL:
        info = _external_info(t)
        target = _safe_external_path(base_dir, info.get("location", ""))
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else target.stat().st_size - offset
        except (ValueError, OSError):
            raise InvalidModelError(f"tensor {t.name!r}: its external data cannot be read "
                                    f"({info.get('location')!r}, offset {info.get('offset')!r}, "
                                    f"length {info.get('length')!r})") from None
        with open(target, "rb") as f:
            f.seek(offset)
            left = length
            while left > 0:
                piece = f.read(min(_CHUNK, left))
                if not piece:
                    raise InvalidModelError(f"tensor {t.name!r}: its external data file {info.get('location')!r} "
                                            "ends before the tensor does")
                left -= len(piece)
                yield piece
        return
    if t.HasField("raw_data"):
        data = memoryview(t.raw_data)
    else:  # typed fields (float_data, int32_data, ...): the raw_data bytes of the same values
        data = memoryview(graph.array_to_tensor(graph.tensor_to_array(t), t.name, t.data_type).raw_data)
    for start in range(0, len(data), _CHUNK):
        yield data[start:start + _CHUNK]


def _readable(d: _Def, base_dir: Path | None) -> bool:
    t = _values_tensor(d)
    if t.data_location == TensorProto.EXTERNAL:
        return base_dir is not None
    return True


def _external_range(d: _Def):
    t = _values_tensor(d)
    if t.data_location != TensorProto.EXTERNAL:
        return None
    info = _external_info(t)
    return info.get("location"), info.get("offset", "0") or "0", info.get("length")


def _digest(d: _Def, base_dir: Path | None) -> bytes:
    if d.digest is None:
        h = hashlib.blake2b(digest_size=20)
        size = 0
        for piece in _chunks(d, base_dir):
            h.update(piece)
            size += len(piece)
        d.digest = h.digest() + size.to_bytes(8, "little")
    return d.digest


def _aligned(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The same bytes in pieces of exactly _CHUNK (the last shorter), whatever pieces came in."""
    buf = b""
    for piece in chunks:
        buf = bytes(piece) if not buf else buf + bytes(piece)
        while len(buf) >= _CHUNK:
            yield buf[:_CHUNK]
            buf = buf[_CHUNK:]
    if buf:
        yield buf


def _same_values(a: _Def, b: _Def, base_dir: Path | None) -> bool:
    ra, rb = _external_range(a), _external_range(b)
    if ra is not None and ra == rb and ra[2] is not None:  # the very same bytes of the same file
        return True
    if not (_readable(a, base_dir) and _readable(b, base_dir)):
        return False
    if _digest(a, base_dir) != _digest(b, base_dir):
        return False
    for x, y in zip(_aligned(_chunks(a, base_dir)), _aligned(_chunks(b, base_dir)), strict=True):
        if x != y:
            return False
    return True


def _nbytes(t: TensorProto) -> int | None:
    """Payload bytes of a tensor the pass compares, None for a type it leaves alone (strings, unknown codes)."""
    if t.data_type not in graph.NUMPY_TYPES and t.data_type not in graph.INT4_TYPES:
        return None
    return graph.tensor_nbytes(t)


def _consistent(d: _Def) -> bool:
    """raw_data as long as the dims say (a damaged tensor is left to the checker, never merged)."""
    t = _values_tensor(d)
    if t.data_location == TensorProto.EXTERNAL:
        length = _external_info(t).get("length")
        return length is None or (length.isdigit() and int(length) == graph.tensor_nbytes(t))
    if t.HasField("raw_data"):
        return len(t.raw_data) == graph.tensor_nbytes(t)
    try:
        graph.tensor_to_array(t)
    except InvalidModelError:
        return False
    return True


def _defined_counts(graphs) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in graphs:
        for name in [v.name for v in g.input] + [t.name for t in g.initializer] + \
                [t.values.name for t in g.sparse_initializer] + [o for n in g.node for o in n.output]:
            counts[name] = counts.get(name, 0) + 1
    return counts


def _graphs_below(nodes) -> Iterator[onnx.GraphProto]:
    for node in nodes:
        for sub in graph.node_subgraphs(node):
            yield sub
            yield from _graphs_below(sub.node)


def _is_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1


class _Finder:
    def __init__(self, min_bytes: int, base_dir: Path | None, accept, payloads: dict):
        self.min_bytes, self.base_dir, self.accept, self.payloads = min_bytes, base_dir, accept, payloads
        self.merges: list[Merge] = []
        self.pinned: set[str] = set()  # names a training algorithm updates or reads: left as they are

    def scope(self, counts: dict[str, int], scope: tuple, prefix: str):
        self.counts, self.scope_key, self.prefix = counts, scope, prefix
        self.kept: dict[tuple, list[_Def]] = {}  # (type, dims) -> tensors others may merge into

    def consider(self, d: _Def, visible: set[str], droppable: bool) -> None:
        """`d` merges into an identical kept tensor visible here, or becomes one others may merge into."""
        t = d.tensor
        if self.counts.get(d.name, 0) != 1 or not droppable or d.name in self.pinned:
            return
        nbytes = _nbytes(t)
        if nbytes is None or nbytes < max(self.min_bytes, 1) or not _consistent(d):
            return
        key = (t.data_type, tuple(t.dims))
        for k in self.kept.get(key, []):
            # the caller's veto is asked about equal tensors only (it may report what it kept apart)
            if k.name in visible and _same_values(d, k, self.base_dir) \
                    and (self.accept is None or self.accept(d.name, k.name)):
                self.merges.append(Merge(d.name, k.name, tuple(int(x) for x in t.dims), graph.type_name(t.data_type),
                                         nbytes, self.prefix + d.location, self.scope_key))
                return
        self.kept.setdefault(key, []).append(d)

    def graph(self, g: onnx.GraphProto, location: str, outer: set[str]) -> None:
        prefix = f"{location}: " if location else ""
        visible = set(outer) | {v.name for v in g.input}
        inputs = {v.name for v in g.input}
        outputs = {v.name for v in g.output}
        visible |= {t.name for t in g.initializer}  # an initializer is visible from the graph's start
        for t in g.initializer:
            payload = self.payloads.get(t.name) if not location else None
            self.consider(_Def(t.name, t, prefix + "initializer", payload), visible,
                          t.name not in inputs and t.name not in outputs)
        self.nodes(g.node, location, visible, outputs)

    def nodes(self, nodes, location: str, visible: set[str], outputs: set[str]) -> None:
        prefix = f"{location}: " if location else ""
        visible = set(visible)
        for node in nodes:
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for i, sg in enumerate(subs):
                    suffix = attr.name if len(subs) == 1 else f"{attr.name}[{i}]"
                    self.graph(sg, f"subgraph {node.name or node.op_type}/{suffix}", visible)
            if _is_constant(node):
                found = graph._constant_tensor(node)
                if found is not None:
                    self.consider(_Def(node.output[0], found[0], prefix + "Constant node"), visible,
                                  node.output[0] not in outputs)
            visible.update(node.output)


def _training_names(model: onnx.ModelProto) -> set[str]:
    """Every name model.training_info binds or reads: a training algorithm updates main-graph
    initializers by name (update_binding, initialization_binding) and reads any of them, so such
    a tensor is neither dropped (the algorithm would name a tensor that is gone) nor the one
    others are repointed to (training it would change its twins' readers too)."""
    names: set[str] = set()
    for info in getattr(model, "training_info", ()):  # (a caller may pass a stand-in of one scope)
        for binding in [*info.update_binding, *info.initialization_binding]:
            names.update((binding.key, binding.value))
        for g in (info.algorithm, info.initialization):
            names |= _names_read([g])
    return names


def _annotated_names(graphs) -> set[str]:
    """The tensors the graphs' quantization_annotation entries name (annotated, or a parameter):
    left as they are, or an annotation would name a tensor that is gone."""
    names: set[str] = set()
    for g in graphs:
        for qa in g.quantization_annotation:
            names.add(qa.tensor_name)
            names.update(e.value for e in qa.quant_parameter_tensor_names)
    return names


def _names_read(graphs) -> set[str]:
    names: set[str] = set()
    for g in graphs:
        for node in g.node:
            names.update(node.input)
            names |= _names_read(graph.node_subgraphs(node))
        names.update(o.name for o in g.output)
    return names


def _function_key(fn: onnx.FunctionProto) -> tuple:
    return (fn.domain, fn.name, getattr(fn, "overload", ""))


def find_duplicates(model: onnx.ModelProto, *, min_bytes: int = DEFAULT_MIN_BYTES, base_dir=None,
                    accept: Callable[[str, str], bool] | None = None, payloads: dict | None = None,
                    scope=None) -> list[Merge]:
    """The merges that store each set of identical tensors once (the module docstring says which
    tensors take part), first kept, in walk order. Reads, never changes, `model`.

    accept(dropped, kept): a caller's veto on one merge of two equal tensors (quantize_weights: both weights must get
    the same form). payloads: {main-graph initializer name: TensorProto holding its values} for a
    copy made without them (graph.copy_model's without_payload). scope: None, every scope; "main",
    the main graph and the bodies below it only; one of model.functions, that function only (so
    that a veto knows which scope the names it is asked about belong to)."""
    if not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or min_bytes < 0:
        raise InvalidArgumentError(f"min_bytes must be a non-negative integer, got {min_bytes!r}")
    finder = _Finder(min_bytes, Path(base_dir) if base_dir is not None else None, accept, payloads or {})
    graphs = [model.graph, *_graphs_below(model.graph.node)]
    finder.scope(_defined_counts(graphs), (), "")
    finder.pinned = _training_names(model) | _annotated_names(graphs)
    if isinstance(scope, str) and scope != "main":
        raise InvalidArgumentError(f"scope must be None, 'main' or one of the model's functions, got {scope!r}")
    only = None if scope is None or isinstance(scope, str) else _function_key(scope)
    if scope is None or scope == "main":
        finder.graph(model.graph, "", set())
    for fn in model.functions:
        if scope is not None and _function_key(fn) != only:
            continue
        counts: dict[str, int] = {}
        for name in [*fn.input, *(o for n in fn.node for o in n.output)]:
            counts[name] = counts.get(name, 0) + 1
        for g in _graphs_below(fn.node):
            for name, c in _defined_counts([g]).items():
                counts[name] = counts.get(name, 0) + c
        finder.scope(counts, _function_key(fn), f"function {fn.domain + '.' if fn.domain else ''}{fn.name}: ")
        finder.nodes(fn.node, "", set(fn.input), set(fn.output))
    return finder.merges


def _rewire(nodes, drop: set[str], renames: dict[str, str]) -> None:
    """Remove the Constant nodes defining names in `drop` and repoint reads, here and in bodies below."""
    for i in reversed([i for i, n in enumerate(nodes) if _is_constant(n) and n.output[0] in drop]):
        del nodes[i]
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for sub in graph.node_subgraphs(node):
            _rewire_graph(sub, drop, renames)


def _rewire_graph(g: onnx.GraphProto, drop: set[str], renames: dict[str, str]) -> None:
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name in drop]):
        del g.initializer[i]
    for i in reversed([i for i, v in enumerate(g.value_info) if v.name in drop]):
        del g.value_info[i]
    _rewire(g.node, drop, renames)


def apply_merges(model: onnx.ModelProto, merges: list[Merge]) -> None:
    """Drop each merged tensor of `model` and repoint its readers, in place (`model` is the one
    find_duplicates saw, or a copy of it)."""
    by_scope: dict[tuple, dict[str, str]] = {}
    for m in merges:
        by_scope.setdefault(m.scope, {})[m.name] = m.into
    # a chain can only point at a kept tensor (find_duplicates keeps the first of each set)
    main = by_scope.pop((), None)
    if main:
        _rewire_graph(model.graph, set(main), main)
    for fn in model.functions:
        renames = by_scope.get(_function_key(fn))
        if renames:
            _rewire(fn.node, set(renames), renames)
            for i in reversed([i for i, v in enumerate(fn.value_info) if v.name in renames]):
                del fn.value_info[i]


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def merges_note(merges: list[Merge]) -> str:
    """'2 identical weights stored once: B -> A (1.0 MB)'."""
    tensors = len(merges) + len({(m.scope, m.into) for m in merges})
    shown = ", ".join(f"{m.name} -> {m.into}" for m in merges[:6]) + (
        f" and {len(merges) - 6} more" if len(merges) > 6 else "")
    return (f"{tensors} identical weights stored once: {shown} "
            f"({_human(sum(m.nbytes for m in merges))} less)")


def report_merges(merges: list[Merge], report: Report | None, *, note: bool = True) -> None:
    """A TensorChange per dropped tensor (its bytes -> 0) and, when `note`, the note."""
    if report is None or not merges:
        return
    for m in merges:
        report.add(TensorChange(m.name, m.shape, m.dtype, f"stored once: same bytes as {m.into}",
                                m.nbytes, 0, None, m.location))
    if note:
        report.note(merges_note(merges))


@graph.refuses_bad_text
def dedupe_initializers(model, *, min_bytes: int = DEFAULT_MIN_BYTES, base_dir=None,
                        report: Report | None = None) -> onnx.ModelProto:
    """A new model in which each set of byte-identical weights (same element type, shape and bytes)
    is stored once: the first kept, the readers of the others repointed to it. Lossless: the
    outputs are bit-identical. The module docstring says which tensors take part (graph inputs and
    outputs never do).

    model: an onnx.ModelProto or a path (external data read). min_bytes: smaller tensors are left
    as they are (default DEFAULT_MIN_BYTES; 0 takes every one). base_dir: the folder of external
    data files a ModelProto loaded without them names (then read in pieces, not loaded).
    report: receives a TensorChange per dropped tensor and a note naming the merges.

    Raises InvalidModelError for a model onnx.checker refuses, InvalidArgumentError for a bad min_bytes."""
    src = load_model(model)
    if report is not None:
        report.pass_name = report.pass_name or "dedupe_initializers"
    # a model read from a path is this call's own: changed in place, without a second copy of its weights
    out = src if src is not model else graph.copy_model(src)
    # what every pass leaves (nodes sorted, IR 3 initializers no longer listed as inputs: they would
    # count as overridable, and nothing would merge), each change noted
    graph.standard_form(out, report, rewritten="merged")
    # an input the checker refuses would come out refused too (data not loaded: its tensors are
    # checked by type and dims, as large ones are; the checker would look for the files from here)
    graph.refuse_invalid(out, {t.name: t for t in out.graph.initializer if t.data_location == TensorProto.EXTERNAL})
    merges = find_duplicates(out, min_bytes=min_bytes, base_dir=base_dir)
    apply_merges(out, merges)
    report_merges(merges, report)
    return out


__all__ = ["dedupe_initializers", "find_duplicates", "apply_merges", "Merge", "DEFAULT_MIN_BYTES"]
