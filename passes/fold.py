"""The fold pass: materialise constant DequantizeLinear nodes (onnx's and com.microsoft's), palettes
(Cast -> Gather on a table) and levels read through Cast -> Mul as float weights, bit-identical to
what onnxruntime computes for them.

A node folds when every input is a constant (an initializer or a Constant node, visible from
the node's graph). Its output becomes:
  - an initializer of the node's graph, named like the node's output, when its inputs were
    initializers (the layout `quantize_weights` produces for initializers), or
  - a Constant node at the node's place, when any input came from a Constant node.
Constants that only fed folded nodes are removed afterwards.

Model-local function bodies (ModelProto.functions, and subgraphs of their nodes) fold the same
way, each body as a scope of its own: a function has no initializers, so its constants are
Constant nodes of the body and each folded weight becomes a Constant node there (the same value
at every call: a call reaches a body only through its inputs and attributes). A body node with an
attribute the call gives (ref_attr_name), and a Constant whose value the call gives, differ from
call to call: left as they are. (Palettes and Cast -> Mul levels are only ever written in graphs:
their folds look at graphs alone.)

Folders of one node are registered per op type (`register_folder`); the two-node forms
(palettes, Cast -> Mul levels) are folded first by their own modules.

dtype: None keeps the type the node produces (bit-exact). "float16" / "float32" store the folded
tensor in that type; where that differs from the node's output type, the tensor is stored under
a new name and a Cast node back to the node's type produces the original name, so every consumer
still receives the type it was built for and the model stays valid. (onnxruntime folds that Cast
at session creation; the stored file holds the requested dtype.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import forms, graph
from ._fileio import load_model
from .errors import InvalidArgumentError, InvalidModelError
from .report import Report, TensorChange

# A folder gets (node, input arrays, input element types), where arrays[i] is the value of input i
# (None for an empty optional input), and returns (array, ONNX element type of the output) or None
# when it cannot fold this node. It must compute exactly what onnxruntime computes.
Folder = Callable[[onnx.NodeProto, list, list], "tuple[np.ndarray, int] | None"]
FOLDERS: dict[tuple[str, str], Folder] = {}


def register_folder(op_type: str, fn: Folder, domain: str = "") -> None:
    """Register `fn` to fold nodes of `op_type` whose inputs are all constants."""
    FOLDERS[(domain, op_type)] = fn


_LEVEL_TYPES = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16, TensorProto.INT32,
                TensorProto.INT4, TensorProto.UINT4}


def _bad(node: onnx.NodeProto, why: str) -> InvalidModelError:
    return InvalidModelError(f"DequantizeLinear {node.name or node.output[0]!r}: {why}")


def _fold_dequantize_linear(node: onnx.NodeProto, arrays: list, types: list):
    """DequantizeLinear with constant inputs, checked the way onnxruntime checks it: a node it
    would refuse raises InvalidModelError instead of becoming a plausible float weight."""
    if len(arrays) < 2 or arrays[0] is None or arrays[1] is None:
        return None
    q, scale = arrays[0], arrays[1]
    zp = arrays[2] if len(arrays) > 2 and arrays[2] is not None else None
    if types[0] not in _LEVEL_TYPES:
        if types[0] in graph.FLOAT_TYPES or types[0] == TensorProto.DOUBLE:
            raise _bad(node, f"input x is {graph.type_name(types[0])}, not an integer type")
        return None  # float8 and other forms: left to the runtime
    if types[1] not in graph.FLOAT_TYPES:
        raise _bad(node, f"scale is {graph.type_name(types[1])}, not float32/float16/bfloat16")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for name in ("output_dtype", "axis", "block_size"):  # a damaged attribute may hold no int
        if name in attrs and (isinstance(attrs[name], bool) or not isinstance(attrs[name], (int, np.integer))):
            raise _bad(node, f"attribute {name} is not an integer")
    if int(attrs.get("output_dtype", 0) or 0) not in (0, types[1]):
        return None  # opset 23 output_dtype other than the scale's type: left to the runtime
    axis = int(attrs.get("axis", 1))
    block = int(attrs.get("block_size", 0))
    if zp is not None:
        if types[2] != types[0]:
            raise _bad(node, f"zero point is {graph.type_name(types[2])} but x is {graph.type_name(types[0])}")
        if zp.shape != scale.shape and not (zp.size == 1 and scale.size == 1):
            raise _bad(node, f"zero point shape {zp.shape} differs from scale shape {scale.shape}")
    if block < 0:
        raise _bad(node, f"block_size {block} is negative")
    per_tensor = block == 0 and scale.size == 1 and scale.ndim <= 1
    if not per_tensor:
        if not -q.ndim <= axis < q.ndim:
            raise _bad(node, f"axis {axis} out of range for x of shape {q.shape}")
        axis %= q.ndim
        if block == 0:
            if scale.ndim != 1 or scale.shape[0] != q.shape[axis]:
                raise _bad(node, f"scale shape {scale.shape} does not match x {q.shape} along axis {axis}")
        else:
            want = list(q.shape)
            want[axis] = -(-q.shape[axis] // block)
            if list(scale.shape) != want:
                raise _bad(node, f"block scales have shape {scale.shape}, x {q.shape} with block_size {block} "
                                 f"along axis {axis} needs {tuple(want)}")
    result = forms.dequantize_linear(q, scale, zp, axis if not per_tensor else 1, block if not per_tensor else 0)
    return result, types[1]


def _check_opset(node: onnx.NodeProto, opset: int, arrays: list) -> None:
    """Attributes and forms the node's opset does not define (onnxruntime refuses them)."""
    names = {a.name for a in node.attribute}
    if opset and opset < 13 and ("axis" in names or (arrays[1] is not None and arrays[1].size != 1)):
        raise _bad(node, f"per-axis DequantizeLinear needs opset 13, the model imports opset {opset}")
    if opset and opset < 21 and "block_size" in names:
        raise _bad(node, f"block_size needs opset 21, the model imports opset {opset}")


register_folder("DequantizeLinear", _fold_dequantize_linear)
register_folder("DequantizeLinear", _fold_dequantize_linear, domain="ai.onnx")
# onnxruntime's quantizer writes its Q/DQ pairs in its own domain below opset 21 (int4 / int16 weights);
# the contrib op has onnx's semantics (per tensor, or per axis with axis defaulting to 1; no blocks)
register_folder("DequantizeLinear", _fold_dequantize_linear, domain="com.microsoft")

_CACHE_BELOW = 1 << 20  # decoded inputs kept for other nodes up to this size (bytes)

# a weight whose copy in the requested narrower type falls below this SNR stays in its own type:
# rounding normal values costs ~71 dB in float16 (~53 dB in bfloat16); float16 values under its
# normal range (6.1e-5) keep fewer bits each and flush to zero below 6e-8 (a weight of such
# values loses all of them: 0 dB)
NARROWING_MIN_SNR_DB = {TensorProto.FLOAT16: 60.0, TensorProto.BFLOAT16: 40.0}
_DTYPES = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16}


@dataclass
class _Const:
    tensor: TensorProto
    graph_key: int
    node: onnx.NodeProto | None  # the Constant node holding it, else an initializer


_BLOCK = 1 << 20  # elements per step of the whole-weight checks below (4 MiB of float32)


def _blocks(*arrays: np.ndarray):
    """Matching flat slices of equally sized arrays, _BLOCK elements at a time: the checks of a
    weight of gigabytes then make temporaries of a few MiB, not several of its own size."""
    flat = [a.reshape(-1) for a in arrays]
    for start in range(0, flat[0].size, _BLOCK):
        yield [f[start:start + _BLOCK] for f in flat]


def _overflows(value: np.ndarray, narrow: np.dtype) -> bool:
    """Whether `value` in the narrower float type `narrow` has an inf where it is finite."""
    with np.errstate(over="ignore"):
        return any(np.any(np.isinf(v.astype(narrow)) & np.isfinite(v)) for (v,) in _blocks(value))


def _narrowing_snr_db(value: np.ndarray, narrow: np.dtype) -> float:
    """SNR of a weight's copy in a narrower float type against the weight (inf when exact or all zero)."""
    # float32 products are precise enough for a threshold in dB, and spare a float64 copy of each
    # weight (only values float16 holds without overflow get here, so their squares stay finite);
    # the squares of ~1e-40 values are 0 in float32, so both sides are scaled first by the power of
    # two that brings the peak to [0.5, 1) (exact: the ratio is unchanged). Block by block (the
    # narrow copy too), the blocks' sums added in float64.
    # infinities and NaNs (a -inf attention mask) narrow to themselves: they count as neither
    # signal nor noise (inf - inf would make the SNR NaN, which passed every threshold)
    peak = 0.0
    for (v,) in _blocks(value):
        finite = np.abs(v[np.isfinite(v)])
        peak = max(peak, float(np.max(finite, initial=0.0)))
    if peak == 0.0:
        return math.inf
    shift = -math.frexp(peak)[1]
    signal = noise = 0.0
    for (v,) in _blocks(value):
        exact = np.ldexp(v.astype(np.float32, copy=False), shift)
        with np.errstate(invalid="ignore"):
            error = np.ldexp(v.astype(narrow).astype(np.float32), shift) - exact
        if not np.all(np.isfinite(exact)):
            kept = np.isfinite(exact)
            exact, error = np.where(kept, exact, 0.0), np.where(kept, error, 0.0)
        signal += float(np.dot(exact, exact))
        noise += float(np.dot(error, error))
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def _narrowed(value: np.ndarray, narrow: np.dtype) -> np.ndarray:
    """`value` as the narrower float type `narrow`, written over the front of value's own buffer
    when value owns it (the fold's fresh result): a float32 weight and its float16 copy were both
    whole in memory (1.5x the weight); now the copy takes no memory of its own. `value` must not be
    used afterwards. Block i's narrow values land on bytes that blocks before i held (all read by
    then); block 0's are computed whole before they are written."""
    if not (value.flags.owndata and value.flags.c_contiguous and value.flags.writeable
            and value.base is None and np.dtype(narrow).itemsize < value.itemsize):
        return value.astype(narrow)
    flat = value.reshape(-1)
    out = flat.view(np.uint8)[: flat.size * np.dtype(narrow).itemsize].view(narrow)
    for start in range(0, flat.size, _BLOCK):
        block = flat[start:start + _BLOCK].astype(narrow)
        out[start:start + block.size] = block
    return out.reshape(value.shape)


def _little_endian(arr: np.ndarray, elem_type: int) -> np.ndarray:
    """A float weight as its raw_data lays it out (C order, little-endian): `arr` itself when it is."""
    return np.ascontiguousarray(arr, dtype=graph.NUMPY_TYPES[elem_type].newbyteorder("<"))


def _location(info: graph.GraphInfo, constant_node: bool) -> str:
    where = "Constant node" if constant_node else "initializer"
    return f"{info.location}: {where}" if info.location else where


@graph.refuses_bad_text
def fold_dequantize(model, *, dtype: str | None = None, report: Report | None = None,
                    progress=None) -> onnx.ModelProto:
    """A new model in which every constant weight form is a float weight; `model` is never modified.

    model: an onnx.ModelProto, or the path of an .onnx (external data read) or a packed .onnxz.
    dtype: None keeps each weight's own float type (the folded values are bit-identical to what
      onnxruntime computes for the nodes); "float32", "float16" or "bfloat16" stores the folded
      weights in that type behind a Cast back to the type the graph expects. A weight the narrower
      type cannot hold (values beyond its range, or too small: see NARROWING_MIN_SNR_DB) keeps its
      own type, with a note.
    report: a passes.Report to fill: one row per folded weight (its location says where: a graph,
      a subgraph, or "function <domain>:<name>" for a function body), and notes on what else
      changed (nodes sorted, sparse initializers made dense, weights kept).
    progress: called as progress(done, total) while the nodes fold (graphs, then function bodies).

    With nothing to fold the model comes back as a copy, sorted or made dense only where the
    checker needs it (the report says so).
    Raises InvalidArgumentError (bad dtype), InvalidModelError (a model that cannot be read or a
    weight node that is damaged), CorruptFileError (a damaged .onnxz).
    """
    return _fold_dequantize(model, dtype, report, progress, None)


def fold_file(model, output, *, dtype: str | None = None, force: bool = False, report: Report | None = None,
              progress=None) -> onnx.ModelProto:
    """save_model(fold_dequantize(model, ...), output, force): the same file, with at most about
    one copy of each big folded weight in memory (fold_dequantize's model holds its payloads in
    protobuf, which copies each one in; the weights of 16 MiB or more are written here from their
    arrays instead). Returns the model written with those initializers' raw_data left out (their
    bytes are in the file only): for looking at its graph, not for saving or running.
    Raises what fold_dequantize and save_model raise."""
    from ._fileio import SPLICE_MIN_BYTES, check_writable, save_model_detached

    check_writable(output, force)
    detached: dict[str, np.ndarray] = {}
    out = _fold_dequantize(model, dtype, report, progress, (detached, SPLICE_MIN_BYTES))
    save_model_detached(out, detached, output, force)
    return out


def _fold_dequantize(model, dtype, report, progress, detach) -> onnx.ModelProto:
    """fold_dequantize; `detach`: None, or ({}, min bytes) to fill with the main-graph folded
    weights of min bytes or more, by name, left without raw_data in the model (fold_file)."""
    if dtype is not None and dtype not in _DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {', '.join(_DTYPES)} or None, got {dtype!r}")
    source = load_model(model)
    if report is not None:
        report.pass_name = report.pass_name or "fold_dequantize"
    # palettes (passes.palette: uint8 indices -> Cast -> Gather on a table) are a two-node chain
    # that the node-by-node walk below cannot fold; they are folded first, exactly
    from .palette import fold_palettes, has_palettes

    if has_palettes(source):
        source = fold_palettes(source, report=report)
    # so are levels read through Cast -> Mul (passes.cast_levels: the auto mode's form of MatMul
    # weights that onnxruntime would otherwise run as MatMulNBits with int8 activations)
    from .cast_levels import fold_cast_mul, has_cast_mul

    if has_cast_mul(source):
        source = fold_cast_mul(source, report=report)
    # The level tensors of main-graph DequantizeLinear nodes (most of a compressed model) are
    # copied without payload: they are read from `source`, and put back if they stay.
    unique = graph.unique_initializers(source)
    payloads = {n.input[0]: unique[n.input[0]] for n in source.graph.node
                if (n.domain, n.op_type) in FOLDERS and n.input and n.input[0] in unique}
    out = graph.copy_model(source, set(payloads))
    graph.standard_form(out, report, ir3=False)  # (fold writes float weights: IR 3's listed inputs may stay)
    graph.refuse_invalid(out, payloads)  # an input the checker refuses would come out refused too
    weights, graphs = graph.find_weights(out)
    bodies = _function_bodies(out)
    total = sum(_count_foldable(g) for g in graphs) + sum(_count_foldable(g) for _, _, g in bodies)
    ticks = _Ticks(progress, total)
    folding = _Folding(dtype, report, ticks)
    folding.detach = detach
    folding.fold_graphs(graphs, weights, graph.NameAllocator(graph.all_names(out)), graph.default_opset(out), payloads)
    folding.detach = None  # (function bodies' weights are Constant nodes: never detached)
    _fold_bodies(bodies, folding, graph.default_opset(out))
    _put_back(out, payloads)
    folding.notes()
    return out


def fold_function_bodies(model: onnx.ModelProto, *, report: Report | None = None) -> int:
    """Fold, in place, the constant DequantizeLinear nodes (every registered form) of `model`'s
    model-local function bodies, subgraphs of their nodes included, exactly as fold_dequantize
    does; returns how many folded. For a caller that holds a model it may change (the runtime's
    fold at load); fold_dequantize does this on its copy. Raises InvalidModelError for a damaged
    weight node (naming it)."""
    folding = _Folding(None, report, lambda: None)
    return _fold_bodies(_function_bodies(model), folding, graph.default_opset(model))


def _fold_bodies(bodies: list, folding: "_Folding", model_opset: int) -> int:
    """Fold each of _function_bodies' bodies as a graph of its own (a function is a scope of its
    own; its constants are Constant nodes of the body, a function having no initializers) and put
    the folded nodes back into its function. Returns how many nodes folded."""
    before = folding.folded
    for fn, opset, body in bodies:
        body_weights, body_graphs = graph.find_weights(body)
        where = _function_location(fn)
        for info in body_graphs:
            info.location = f"{where}: {info.location}" if info.location else where
        # (the opset checks of a body that imports no default-domain opset: the model's)
        if folding.fold_graphs(body_graphs, body_weights, graph.NameAllocator(graph.all_names(body)),
                               opset or model_opset, {}):
            _put_body_back(fn, body.graph)
    return folding.folded - before


def _count_foldable(info_or_model) -> int:
    infos = graph.iter_graphs(info_or_model) if isinstance(info_or_model, onnx.ModelProto) else [info_or_model]
    return sum((node.domain, node.op_type) in FOLDERS for info in infos for node in info.graph.node)


class _Ticks:
    """progress(done, total) over the foldable nodes of the graphs and then the function bodies."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total)


def _function_location(fn: onnx.FunctionProto) -> str:
    return f"function {fn.domain}:{fn.name}" + (f" ({fn.overload})" if fn.overload else "")


def _function_bodies(model: onnx.ModelProto) -> list:
    """(function, its default-domain opset (0 when it imports none), its body as the graph of a
    model of its own) for each model-local function with a node to fold (in it or in a subgraph
    of one of its nodes). The body graph's inputs and outputs are the function's, untyped: what
    find_weights needs to scope names and to see which values the function returns."""
    bodies = []
    for fn in model.functions:
        wrapper = onnx.ModelProto()
        body = wrapper.graph
        body.name = fn.name
        body.node.extend(fn.node)
        if not _count_foldable(wrapper):
            continue
        body.input.extend(onnx.ValueInfoProto(name=name) for name in fn.input)
        body.output.extend(onnx.ValueInfoProto(name=name) for name in fn.output)
        opset = next((int(o.version) for o in fn.opset_import if o.domain in ("", "ai.onnx")), 0)
        bodies.append((fn, opset, wrapper))
    return bodies


def _put_body_back(fn: onnx.FunctionProto, body: onnx.GraphProto) -> None:
    """The folded body's nodes into `fn`, and its value_info without the names no longer defined
    (the constants folded away)."""
    del fn.node[:]
    fn.node.extend(body.node)
    produced = set(fn.input) | {name for node in fn.node for name in node.output}
    for i in reversed([i for i, v in enumerate(fn.value_info) if v.name not in produced]):
        del fn.value_info[i]


class _Folding:
    """The node-by-node fold of a list of graphs (a model's, or a function body's), with what the
    report's notes need gathered across all of them."""

    def __init__(self, dtype: str | None, report: Report | None, tick):
        self.dtype, self.report, self.tick = dtype, report, tick
        self.overflowed: list[str] = []  # weights kept in their own type: out of the requested dtype's range
        self.underflowed: list[str] = []  # ... or too small for it to hold them (see NARROWING_MIN_SNR_DB)
        self.cast_back = False  # a folded weight stored in the requested dtype behind a Cast
        self.folded = 0  # nodes folded
        self.detach = None  # fold_file's (payloads by name, min bytes): main-graph weights kept out of protobuf

    def notes(self) -> None:
        report, dtype = self.report, self.dtype
        if report is None:
            return
        if self.overflowed:
            report.note(f"{len(self.overflowed)} weight(s) kept in their own type, values beyond {dtype}'s range: "
                        + ", ".join(self.overflowed[:5]) + (" ..." if len(self.overflowed) > 5 else ""))
        if self.underflowed:
            report.note(f"{len(self.underflowed)} weight(s) kept in their own type, values too small for {dtype} to "
                        f"hold (below {NARROWING_MIN_SNR_DB[_DTYPES[dtype]]:g} dB in it): "
                        + ", ".join(self.underflowed[:5]) + (" ..." if len(self.underflowed) > 5 else ""))
        if self.cast_back:
            report.note(f"folded weights stored as {dtype}; Cast nodes restore the types the graph expects")

    def fold_graphs(self, graphs: list, weights: list, names: graph.NameAllocator, opset: int,
                    payloads: dict) -> bool:
        """Fold every foldable node of `graphs` (find_weights' walk of one model or body, `weights`
        its constants) in place; `payloads`: main-graph initializers copied without their payload.
        Returns whether anything folded."""
        dtype, report = self.dtype, self.report
        foldable = []  # (graph key, node)
        for info in graphs:
            for node in info.graph.node:
                if (node.domain, node.op_type) in FOLDERS:
                    foldable.append((info.key, node))

        # constants visible by scope: resolve through the weight uses computed by find_weights
        const_of_use: dict[tuple[int, str], _Const] = {}
        for w in weights:
            for u in w.uses:
                const_of_use[(id(u.node), u.index)] = _Const(w.tensor, w.graph_key, w.node)

        casts_after = _sole_float_casts(graphs)
        replaced: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> nodes in its place
        added_inits: dict[int, list[str]] = {}  # graph key -> folded initializers appended
        consumed: list[_Const] = []
        decoded: dict[int, np.ndarray] = {}
        for key, node in foldable:
            consts = [const_of_use.get((id(node), i)) if name else None for i, name in enumerate(node.input)]
            # (a function body's node whose attribute the call gives, ref_attr_name, differs from call
            # to call: left as it is)
            if (not node.input or any(c is None for c, name in zip(consts, node.input) if name)
                    or any(a.ref_attr_name for a in node.attribute)):
                self.tick()
                continue
            arrays, types = [], []
            for c in consts:
                if c is None:
                    arrays.append(None)
                    types.append(0)
                    continue
                value = decoded.get(id(c.tensor))
                if value is None:
                    held = c.graph_key == 0 and c.node is None and c.tensor.name in payloads
                    value = graph.tensor_to_array(payloads[c.tensor.name] if held else c.tensor)
                    if value.nbytes <= _CACHE_BELOW:  # scales, zero points: shared, small
                        decoded[id(c.tensor)] = value
                arrays.append(value)
                types.append(c.tensor.data_type)
            if node.op_type == "DequantizeLinear":
                _check_opset(node, opset, arrays)
            result = FOLDERS[(node.domain, node.op_type)](node, arrays, types)
            arrays = None  # (the level tensor's copy out of its proto: not needed past the fold)
            if result is None:
                self.tick()
                continue
            value, elem_type = result
            result = None
            if not node.output or not node.output[0]:  # a damaged node: nothing to name the weight
                raise InvalidModelError(f"{node.op_type} node {node.name!r} has no output")
            out_name = node.output[0]
            cast = casts_after.get(out_name) if node.op_type == "DequantizeLinear" else None
            if cast is not None:
                # DequantizeLinear -> Cast (quantize_weights' layout for bfloat16 weights): the weight
                # is the Cast's output; numpy/ml_dtypes round to nearest even, as onnxruntime's Cast
                to = next(a.i for a in cast.attribute if a.name == "to")
                value, elem_type, out_name = value.astype(graph.NUMPY_TYPES[to]), to, cast.output[0]
                replaced[id(cast)] = []
            store_type = _DTYPES[dtype] if dtype else elem_type
            if store_type != elem_type:
                narrow = graph.NUMPY_TYPES[store_type]
                if _overflows(value, narrow):
                    # values beyond the requested type's range (float16 tops at 65504) would become
                    # inf: this weight stays in its own type
                    self.overflowed.append(out_name)
                    store_type = elem_type
                elif _narrowing_snr_db(value, narrow) < NARROWING_MIN_SNR_DB.get(store_type, -math.inf):
                    self.underflowed.append(out_name)
                    store_type = elem_type
                else:
                    stored = _narrowed(value, narrow)
            if store_type != elem_type:
                stored_name = names.take(f"{out_name}_{graph.type_name(store_type)}")
            else:
                stored, stored_name = value, out_name
            from_constant_node = any(c is not None and c.node is not None for c in consts)
            shape, stored_nbytes = tuple(value.shape), stored.nbytes
            new_nodes = []
            if from_constant_node:
                tensor = graph.array_to_tensor(stored, stored_name, store_type)
                new_nodes.append(helper.make_node("Constant", [], [stored_name], name=names.take(stored_name + "_Constant"),
                                                  value=tensor))
            else:
                # written straight into the graph now, and the arrays freed before protobuf copies
                # the payload in (it cannot take a buffer without copying it): at most two copies
                # of one weight live at once, where the array, its bytes and the proto's made three
                # (holding every folded array until the end doubled peak memory before that)
                value = None
                tensor = graphs[key].graph.initializer.add()
                tensor.name, tensor.data_type = stored_name, store_type
                tensor.dims.extend(shape)
                if self.detach is not None and key == 0 and stored_nbytes >= self.detach[1]:
                    # fold_file writes it from the array: the only copy
                    self.detach[0][stored_name] = _little_endian(stored, store_type)
                else:
                    payload = _little_endian(stored, store_type).tobytes()
                    stored = None
                    tensor.raw_data = payload
                    payload = None
                stored = None
                added_inits.setdefault(key, []).append(stored_name)
            if store_type != elem_type:
                new_nodes.append(helper.make_node("Cast", [stored_name], [out_name], name=names.take(out_name + "_Cast"),
                                                  to=elem_type))
            replaced[id(node)] = new_nodes
            self.folded += 1
            consumed.extend(c for c in consts if c is not None)
            if report is not None:
                before = sum(graph.tensor_nbytes(c.tensor) for c in consts if c is not None)
                report.add(TensorChange(out_name, shape, graph.type_name(consts[0].tensor.data_type),
                                        "folded" if store_type == elem_type else f"folded to {graph.type_name(store_type)}",
                                        before, stored_nbytes, None,
                                        _location(graphs[key], from_constant_node)))
            self.tick()

        if not replaced:
            return False
        if dtype is not None and any(len(v) > 1 or (v and v[-1].op_type == "Cast") for v in replaced.values()):
            self.cast_back = True

        # which constants are still read after folding (anywhere, any scope: conservative)
        still_read: set[str] = set()
        for info in graphs:
            for node in info.graph.node:
                if id(node) in replaced:
                    continue
                still_read.update(node.input)
            still_read.update(v.name for v in info.graph.output)
        for nodes in replaced.values():
            for n in nodes:
                still_read.update(n.input)
        dead_inits: dict[int, set[str]] = {}
        dead_nodes: set[int] = set()
        for c in consumed:
            if c.tensor.name and c.node is None and c.tensor.name not in still_read:
                dead_inits.setdefault(c.graph_key, set()).add(c.tensor.name)
            if c.node is not None and c.node.output[0] not in still_read:
                dead_nodes.add(id(c.node))

        for info in reversed(graphs):  # children first: rewriting a parent copies its subgraphs
            k = info.key
            g = info.graph
            touched = any(id(n) in replaced or id(n) in dead_nodes for n in g.node)
            if k in dead_inits or k in added_inits:
                dead = dead_inits.get(k, set())
                # in place: deleting entries copies no payload of the kept tensors; only the graph's
                # own initializers, not the folded ones appended after them
                own = len(g.initializer) - len(added_inits.get(k, []))
                for i in reversed([i for i, t in enumerate(g.initializer) if i < own and t.name in dead]):
                    del g.initializer[i]
                if dead:
                    for i in reversed([i for i, v in enumerate(g.value_info) if v.name in dead]):
                        del g.value_info[i]
            if touched:
                nodes = []
                for node in g.node:
                    if id(node) in dead_nodes:
                        continue
                    if id(node) in replaced:
                        nodes.extend(replaced[id(node)])
                        continue
                    c = onnx.NodeProto()
                    c.CopyFrom(node)
                    nodes.append(c)
                del g.node[:]
                g.node.extend(nodes)
        return True


def _sole_float_casts(graphs: list[graph.GraphInfo]) -> dict[str, onnx.NodeProto]:
    """Cast nodes to a float type whose input nothing else reads (no other node in any graph,
    no graph output), by input name: the second half of a DequantizeLinear -> Cast pair (the form
    quantize_weights gives bfloat16 and float64 weights: DequantizeLinear has no float64 output)."""
    reads: dict[str, int] = {}
    for info in graphs:
        for node in info.graph.node:
            for name in node.input:
                reads[name] = reads.get(name, 0) + 1
        for v in info.graph.output:
            reads[v.name] = reads.get(v.name, 0) + 1
    out = {}
    for info in graphs:
        for node in info.graph.node:
            if (node.op_type == "Cast" and node.domain in ("", "ai.onnx") and len(node.input) == 1
                    and reads.get(node.input[0]) == 1 and node.output and node.output[0]):
                to = next((a.i for a in node.attribute if a.name == "to"), None)
                if to in graph.FLOAT_TYPES or to == TensorProto.DOUBLE:
                    out[node.input[0]] = node
    return out


def _put_back(out: onnx.ModelProto, payloads: dict[str, TensorProto]) -> None:
    """Payloads left behind by the copy, for the initializers that are still there (not folded,
    or still read by another node)."""
    if payloads:
        for t in out.graph.initializer:
            if t.name in payloads:
                t.CopyFrom(payloads[t.name])
