"""Run a model in a float type it was not made in: float32 as float16 (GPUs), float16 as float32
(CPUs without fast float16 kernels).

float32 -> float16 uses onnxruntime's own converter (`onnxruntime.transformers.float16`, shipped
with onnxruntime, so no new dependency), which keeps graph inputs/outputs in float32 when asked
and leaves the operators of its block list (and those without float16 kernels) in float32 with
Casts around them. We add the numerically sensitive reductions to its block list. The converter
works on our skeleton: big weights are placeholders there, it only flips their declared type, and
we convert the arrays ourselves (`to_float16_clamped`: the converter's clamping, same bits, ~70x
faster than its numpy function, which took 1.75 s of the 2.1 s a float16 MiniLM session took).

float16 -> float32 has no maintained converter: every float16 tensor, Cast target, Constant and
declared type becomes float32; inputs/outputs keep float16 (with a Cast at the boundary) unless
`keep_io_types=False`. Exact: every float16 value is a float32 value.

The arrays are cast by onnxruntime's Cast kernel (a one-node session kept per process, writing
into our output array): numpy's float32 <-> float16 casts are scalar loops, measured on 22 M
values 80 ms (32 -> 16) and 52 ms (16 -> 32) against 11 and 13 ms in onnxruntime, bit-identical.
"""
from __future__ import annotations

import math
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import threading

from .errors import UnsupportedFormError
from .graph import default_opset, node_subgraphs
from .runtime_feed import NodeTable, SplitModel, is_placeholder, node_table

# Reductions and normalisations whose float16 results drift (sums over many terms, exp, variance):
# kept in float32 on top of onnxruntime's default block list.
SENSITIVE_OPS = ["ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "Pow", "Exp", "Log",
                 "Softmax", "LogSoftmax", "CumSum", "Erf"]

# (float64 counts too: a float64 model computes in float64, and neither converter takes it)
_FLOATS = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16),
           TensorProto.DOUBLE: np.dtype(np.float64)}

# DequantizeLinear / QuantizeLinear take float16 scales from opset 19 on: below it they are kept
# float32 by the float16 converter (blocked; a Cast to float16 after them)
FLOAT16_SCALE_OPSET = 19


def dominant_float_dtype(split: SplitModel, table: NodeTable | None = None) -> np.dtype:
    """The float type holding most weight bytes (DequantizeLinear scales count for their weight; a
    weight read only through Casts to one float type counts as that type, the one it computes in):
    float32, float16 or float64. `table`: the graph's runtime_feed.NodeTable, when the caller has one."""
    counts = {dtype: 0 for dtype in _FLOATS.values()}
    table = node_table(split.skeleton.graph, table)
    nodes = split.skeleton.graph.node
    read_as = _read_only_as(table, nodes)
    for name, array in split.weights.items():
        if array.dtype in counts:
            dtype = _FLOATS.get(read_as.get(name), array.dtype)
            counts[dtype] += array.size * dtype.itemsize
    scale_names = {inputs[1]: inputs[0] for op_type, _, inputs, _ in table.rows
                   if op_type == "DequantizeLinear" and len(inputs) > 1}
    # small tensors held by Constant nodes (a model whose weights are all Constant nodes, e.g.
    # rapidocr's: its big levels are fed weights, its scales stay Constant nodes), read only
    # where the table has Constant rows
    constants = {}
    for i, (op_type, domain, _, outputs) in enumerate(table.rows):
        if op_type == "Constant" and domain in ("", "ai.onnx") and outputs:
            for a in nodes[i].attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    constants[outputs[0]] = a.t
    dims = {t.name: t.dims for t in split.skeleton.graph.initializer}
    # a tensor read only through Casts to one float type computes in that type: float16 storage
    # read as float32 (what onnxruntime's float16 converter writes around its blocked ops, and
    # some exporters for every weight), and quantize_weights' form of a float64 weight
    # (DequantizeLinear, float32 scale, -> Cast(DOUBLE)): a scale counts in the type its
    # DequantizeLinear's output is read as
    scale_read_as = {inputs[1]: read_as[outputs[0]] for op_type, _, inputs, outputs in table.rows
                     if op_type == "DequantizeLinear" and len(inputs) > 1 and outputs and outputs[0] in read_as}

    def weight_size(name: str) -> int:
        array = split.weights.get(name)
        if array is not None:
            return array.size
        held = constants.get(name)
        shape = held.dims if held is not None else dims.get(name)
        return math.prod(shape) if shape is not None else 1

    for name, t in [(t.name, t) for t in split.skeleton.graph.initializer] + list(constants.items()):
        dtype = _FLOATS.get(t.data_type)
        if dtype is None:
            continue
        if name in scale_names:
            dtype = _FLOATS.get(scale_read_as.get(name), dtype)
            counts[dtype] += weight_size(scale_names[name]) * dtype.itemsize
        elif not is_placeholder(t):
            dtype = _FLOATS.get(read_as.get(name), dtype)
            counts[dtype] += math.prod(t.dims) * dtype.itemsize  # (np.prod per tensor: 10x slower)
    # (ties go to float32, then float16: the order of the checks)
    if counts[np.dtype(np.float64)] > max(counts[np.dtype(np.float32)], counts[np.dtype(np.float16)]):
        return np.dtype(np.float64)
    if counts[np.dtype(np.float16)] > counts[np.dtype(np.float32)]:
        return np.dtype(np.float16)
    return np.dtype(np.float32)


def _read_only_as(table: NodeTable, nodes) -> dict:
    """name -> the element type every main-graph reader of `name` casts it to, for the names that
    only Cast nodes (all to one type) read. One pass over the rows, a second only when the graph has
    Casts (most float models have few or none)."""
    cast_to = {}
    for i, (op_type, domain, inputs, _) in enumerate(table.rows):
        if op_type == "Cast" and domain in ("", "ai.onnx") and inputs:
            to = next((a.i for a in nodes[i].attribute if a.name == "to"), None)
            cast_to[inputs[0]] = to if cast_to.get(inputs[0], to) == to else None
    if not cast_to:
        return {}
    for op_type, domain, inputs, _ in table.rows:
        if op_type != "Cast" or domain not in ("", "ai.onnx"):
            for name in inputs:
                if name in cast_to:
                    cast_to[name] = None
    return {name: to for name, to in cast_to.items() if to is not None}


def convert_split(split: SplitModel, target, *, keep_io_types: bool = True, op_block_list=None,
                  notes: list | None = None) -> None:
    """Convert the split model's float computation to `target` (float16 or float32), in place.
    `notes` (a list, when given) receives a line per thing done beyond the conversion itself.
    InvalidArgumentError for a model that computes in float64: onnxruntime's float16 converter
    and ours (float16 -> float32) convert between float32 and float16 only, and a float64 model
    left as it is would run in float64 while the session said otherwise."""
    target = np.dtype(target)
    if _mostly_float64(split):
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"dtype={target.name}: the model computes in float64 (most of its float weights are "
                                   f"float64), which cannot be converted (float32 <-> float16 only); load it without "
                                   f"dtype= to run it in float64")
    if target == np.float16:
        _refuse_what_the_float16_converter_breaks(split.skeleton, keep_io_types, notes)
        _fold_float16_subgraph_dequantize(split, notes)
        _to_float16(split, keep_io_types, op_block_list)
    elif target == np.float32:
        _to_float32(split, keep_io_types)
    else:
        raise UnsupportedFormError(f"cannot convert a model to {target}")


# ops that make or read optional values: onnxruntime's float16 converter converts the tensors
# around them but not the optional types (not even with the ops in its block list: it then puts
# the Cast of a blocked node in a body where its reader cannot see it)
_OPTIONAL_OPS = frozenset({"Optional", "OptionalGetElement"})


def _float_container(type_proto) -> str | None:
    """"optional(tensor(float))", "sequence(tensor(float))", ... for an optional / sequence / map
    type that holds float32 tensors somewhere inside; None for a tensor or anything else."""
    def inner(t):
        kind = t.WhichOneof("value")
        if kind == "tensor_type":
            return "tensor(float)" if t.tensor_type.elem_type == TensorProto.FLOAT else None
        if kind in ("sequence_type", "optional_type"):
            held = inner(getattr(t, kind).elem_type)
            return f"{kind[:-len('_type')]}({held})" if held else None
        if kind == "map_type":
            held = inner(t.map_type.value_type)
            return f"map({held})" if held else None
        return None

    return inner(type_proto) if type_proto.WhichOneof("value") != "tensor_type" else None


def _refuse_what_the_float16_converter_breaks(model, keep_io_types: bool, notes: list | None) -> None:
    """UnsupportedFormError before a float16 conversion onnxruntime's converter gets wrong, naming
    what and saying to load the model without dtype= (before, onnxruntime refused the
    converted model and the error blamed the model itself):
    - optional values holding float (a graph input or output, or made / read by Optional /
      OptionalGetElement anywhere): the converter makes the tensors read from them float16 and
      leaves the optional types float32, which onnxruntime refuses;
    - with keep_io_types, a sequence input holding float: the converter makes it a float16 sequence
      (only tensor inputs keep their type), and the caller's float32 sequences fail at every run.
    A sequence output holding float comes out as float16 tensors: said in `notes`."""
    graph = model.graph
    interface = [("input", v) for v in graph.input] + [("output", v) for v in graph.output]
    kinds = [(side, v.name, _float_container(v.type)) for side, v in interface]
    optional = [f"{side} '{name}' ({kind})" for side, name, kind in kinds if kind and "optional" in kind]
    if not optional:
        op = next((n.op_type for g in _graphs(graph) for n in g.node
                   if n.op_type in _OPTIONAL_OPS and n.domain in ("", "ai.onnx")), None)
        optional = [f"an {op} node"] if op else []
    if optional:
        raise UnsupportedFormError(
            f"dtype=float16: onnxruntime's float16 converter cannot convert this model: it has optional values "
            f"({optional[0]}), whose tensors it converts but not their optional types (onnxruntime then refuses "
            f"the model); load it without dtype= (dtype=None) to run it as it is")
    sequences_in = [f"'{name}' ({kind})" for side, name, kind in kinds if kind and side == "input"]
    if keep_io_types and sequences_in:
        raise UnsupportedFormError(
            f"dtype=float16: onnxruntime's float16 converter cannot keep the input {sequences_in[0]} float32 "
            f"(keep_io_types keeps tensor inputs only): it would take float16 sequences; load it without dtype= "
            f"(dtype=None), or with keep_io_types=False to feed float16")
    sequences_out = [f"'{name}'" for side, name, kind in kinds if kind and side == "output"]
    if keep_io_types and sequences_out and notes is not None:
        notes.append(f"dtype=float16: the sequence output(s) {', '.join(sequences_out)} hold float16 tensors "
                     f"(onnxruntime's converter keeps only tensor outputs float32)")


def _to_float16(split: SplitModel, keep_io_types: bool, op_block_list) -> None:
    from onnxruntime.transformers import float16 as ort_float16

    blocked = list(ort_float16.DEFAULT_OP_BLOCK_LIST) + SENSITIVE_OPS if op_block_list is None else list(op_block_list)
    if op_block_list is None and default_opset(split.skeleton) < FLOAT16_SCALE_OPSET:
        # a float16 scale is invalid there (onnxruntime refuses the session): these nodes stay
        # float32, their scales too, and the converter casts their outputs to float16 (the
        # DequantizeLinear nodes left in int8 mode: Conv weights, weights read through a Transpose)
        blocked += ["DequantizeLinear", "QuantizeLinear"]
    _rename_converter_names(split.skeleton)
    before = {t.name: t.data_type for t in split.skeleton.graph.initializer if is_placeholder(t)}
    # The converter reads an initializer's values only to learn its shape (for the value_info of a
    # blocked node's input); a placeholder has no values there, so shapes come from dims instead.
    original = ort_float16.make_value_info_from_tensor
    ort_float16.make_value_info_from_tensor = _value_info_from_dims
    try:
        converted = ort_float16.convert_float_to_float16(
            split.skeleton, keep_io_types=keep_io_types, disable_shape_infer=False, op_block_list=blocked
        )
    finally:
        ort_float16.make_value_info_from_tensor = original
    split.skeleton = converted
    for t in converted.graph.initializer:
        if t.name in before and before[t.name] == TensorProto.FLOAT and t.data_type == TensorProto.FLOAT16:
            split.weights[t.name] = to_float16_clamped(split.weights[t.name])


# the names onnxruntime's converter gives the Casts it puts at the graph's inputs / outputs (node
# "graph_input_cast0", its output "graph_input_cast_0", ...): taken already in a model the
# converter made (its keep_io_types Casts), they would be given twice
_CONVERTER_NAME = re.compile(r"graph_(input|output)_cast_?\d+")


def _rename_converter_names(model) -> int:
    """Rename the nodes and (inner) values of `model` whose names the float16 converter is about to
    give its own Casts (see _CONVERTER_NAME), in every graph; returns how many names changed.
    Without this a model converted by onnxruntime's converter before (rapidocr's float16 models)
    came out with two nodes named graph_input_cast0, which onnxruntime refuses."""
    from .graph import NameAllocator, all_names

    main = model.graph
    interface = {v.name for v in main.input} | {v.name for v in main.output}
    taken = [n for n in set(_all_node_and_value_names(main)) if _CONVERTER_NAME.fullmatch(n) and n not in interface]
    if not taken:
        return 0
    names = NameAllocator(all_names(model))
    renamed = {n: names.take(n + "_renamed") for n in sorted(taken)}
    for g in _graphs(main):
        for node in g.node:
            if node.name in renamed:
                node.name = renamed[node.name]
            for i, name in enumerate(node.input):
                if name in renamed:
                    node.input[i] = renamed[name]
            for i, name in enumerate(node.output):
                if name in renamed:
                    node.output[i] = renamed[name]
        for field in (g.initializer, g.value_info) if g is main else (g.initializer, g.value_info, g.input, g.output):
            for item in field:
                if item.name in renamed:
                    item.name = renamed[item.name]
    return len(renamed)


def _all_node_and_value_names(graph):
    for g in _graphs(graph):
        for node in g.node:
            yield node.name
            yield from node.output
        for field in (g.initializer, g.value_info, g.input):
            for item in field:
                yield item.name


def _mostly_float64(split: SplitModel) -> bool:
    """Whether float64 tensors hold most of the fed weights' bytes (integer levels counted for the
    float type they stand for: not float64, which DequantizeLinear has no output of). One pass over
    the weights: dominant_float_dtype's walk of the graph is not needed for this."""
    double = other = 0
    for array in split.weights.values():
        if array.dtype == np.float64:
            double += array.nbytes
        else:
            other += array.nbytes
    for t in split.skeleton.graph.initializer:  # (small ones inline in the skeleton)
        if is_placeholder(t):
            continue
        nbytes = math.prod(t.dims)
        if t.data_type == TensorProto.DOUBLE:
            double += 8 * nbytes
        else:
            other += nbytes
    return double > other


def _fold_float16_subgraph_dequantize(split: SplitModel, notes: list | None) -> int:
    """Constant DequantizeLinear nodes inside If/Loop/Scan bodies folded to float before the model
    is converted to float16 (see runtime_int8.fold_float16_subgraph_dequantize: onnxruntime's
    fusion of a float16 one gives zeros there, and below opset 19 its scale could not be float16;
    the converter misplaces the Cast of a blocked node in a body). Returns how many."""
    from .runtime_int8 import fold_float16_subgraph_dequantize

    return fold_float16_subgraph_dequantize(split, notes, reason="dtype=float16")


# what onnxruntime's converter (convert_np_to_float16) maps values to: nonzero magnitudes below
# TINY become +-TINY (float16's smallest subnormal after rounding), finite ones above BIG +-BIG;
# zeros, infinities and NaN are kept
FLOAT16_TINY = np.float32(5.96e-08)
FLOAT16_BIG = np.float32(65504.0)

# below this many values numpy's cast is as quick as a session call
_ORT_CAST_MIN_VALUES = 1 << 16
_cast_sessions: dict = {}
_cast_lock = threading.Lock()


def _cast_session(source: np.dtype, target: np.dtype):
    """A one-node onnxruntime session casting a 1-D tensor from `source` to `target` (cached)."""
    key = (source.str, target.str)
    with _cast_lock:
        sess = _cast_sessions.get(key)
        if sess is None:
            import onnxruntime as ort

            src, dst = helper.np_dtype_to_tensor_dtype(source), helper.np_dtype_to_tensor_dtype(target)
            graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=dst)], "cast",
                                      [helper.make_tensor_value_info("x", src, ["n"])],
                                      [helper.make_tensor_value_info("y", dst, ["n"])])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            _cast_sessions[key] = sess
    return sess


def cast_array(array: np.ndarray, dtype) -> np.ndarray:
    """`array.astype(dtype)` for float32 <-> float16 (same bits), by onnxruntime's Cast kernel for
    big arrays (see the module docstring); a new C-contiguous array."""
    dtype = np.dtype(dtype)
    array = np.ascontiguousarray(array)
    if array.size < _ORT_CAST_MIN_VALUES or array.dtype == dtype:
        with np.errstate(over="ignore", invalid="ignore"):  # (overflow to inf is the cast's answer)
            return array.astype(dtype)
    out = np.empty(array.shape, dtype)
    try:
        sess = _cast_session(array.dtype, dtype)
        binding = sess.io_binding()
        binding.bind_cpu_input("x", array.reshape(-1))
        binding.bind_output("y", "cpu", 0, dtype, [array.size], out.ctypes.data)
        sess.run_with_iobinding(binding)
    except Exception:  # an onnxruntime without this Cast kernel: numpy's (slower) cast
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(out, array, casting="unsafe")
    return out


def to_float16_clamped(array: np.ndarray) -> np.ndarray:
    """float32 -> float16 exactly as onnxruntime's converter (convert_np_to_float16) does it:
    tiny nonzero values to +-FLOAT16_TINY, finite values beyond float16 to +-FLOAT16_BIG, the rest
    rounded to nearest. The plain cast is right everywhere except where it gives 0 for a nonzero
    value or infinity for a finite one: those are found and fixed in cache-sized steps."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    out = cast_array(array, np.float16)
    if array.size == 0:
        return out
    # (NaN makes this true too: max/min propagate it; NaN itself is kept by the step below)
    overflow = not (array.max() <= FLOAT16_BIG and array.min() >= -FLOAT16_BIG)
    _fix_half_cast(array.reshape(-1), out.reshape(-1), overflow)
    return out


# values per step of the checks: scratch arrays reused while in cache (whole-array temporaries
# cost more in page faults than the comparisons themselves)
_CHECK_STEP = 1 << 18
_HALF_INF_SHIFTED = np.uint16(0x7C00 << 1 & 0xFFFF)  # +-inf with the sign shifted out


def _fix_half_cast(values: np.ndarray, half: np.ndarray, overflow: bool) -> None:
    """Fix, in place, the float16 `half` cast from `values` where the converter clamps instead:
    +-0 from a nonzero value (-> +-TINY) and, when `overflow`, +-inf from a finite one (-> +-BIG)."""
    bits = half.view(np.uint16)
    step = min(_CHECK_STEP, values.size)
    zero_in, zero_out, shifted = np.empty(step, bool), np.empty(step, bool), np.empty(step, np.uint16)
    for start in range(0, values.size, step):
        stop = min(start + step, values.size)
        n = stop - start
        x = values[start:stop]
        np.left_shift(bits[start:stop], 1, out=shifted[:n])
        np.equal(shifted[:n], 0, out=zero_out[:n])
        np.equal(x, 0, out=zero_in[:n])
        if np.count_nonzero(zero_out[:n]) != np.count_nonzero(zero_in[:n]):
            idx = np.flatnonzero(zero_out[:n] & ~zero_in[:n])
            half[start + idx] = np.copysign(FLOAT16_TINY, x[idx]).astype(np.float16)
        if overflow:
            idx = np.flatnonzero(shifted[:n] == _HALF_INF_SHIFTED)
            idx = idx[np.isfinite(x[idx])]
            if idx.size:
                half[start + idx] = np.copysign(FLOAT16_BIG, x[idx]).astype(np.float16)


def _value_info_from_dims(tensor):
    return helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))


def _to_float32(split: SplitModel, keep_io_types: bool) -> None:
    model = split.skeleton
    graph = model.graph
    for name, array in list(split.weights.items()):
        if array.dtype == np.float16:
            split.weights[name] = cast_array(array, np.float32)
    for g in _graphs(graph):
        for t in g.initializer:
            if t.data_type == TensorProto.FLOAT16 and not is_placeholder(t):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
            elif is_placeholder(t) and t.data_type == TensorProto.FLOAT16:
                t.data_type = TensorProto.FLOAT
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT16:
                    attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
                elif attr.name in ("to", "dtype", "output_dtype") and attr.type == onnx.AttributeProto.INT \
                        and attr.i == TensorProto.FLOAT16:
                    attr.i = TensorProto.FLOAT
        for vi in list(g.value_info):
            _retype(vi)
        if g is not graph:
            for vi in list(g.input) + list(g.output):
                _retype(vi)
    # graph boundary: inner values are float32 now; keep float16 inputs/outputs behind Casts
    boundary_nodes_in, boundary_nodes_out = [], []
    for vi in graph.input:
        if vi.type.tensor_type.elem_type != TensorProto.FLOAT16:
            continue
        if keep_io_types:
            inner = vi.name + "__as_float32"
            _rename_uses(graph, vi.name, inner)
            boundary_nodes_in.append(helper.make_node("Cast", [vi.name], [inner], to=TensorProto.FLOAT,
                                                      name=inner + "_cast"))
        else:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for vi in graph.output:
        if vi.type.tensor_type.elem_type != TensorProto.FLOAT16:
            continue
        if keep_io_types:
            inner = vi.name + "__as_float32"
            _rename_producers(graph, vi.name, inner)
            boundary_nodes_out.append(helper.make_node("Cast", [inner], [vi.name], to=TensorProto.FLOAT16,
                                                       name=inner + "_cast"))
        else:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    if boundary_nodes_in or boundary_nodes_out:
        nodes = boundary_nodes_in + list(graph.node) + boundary_nodes_out
        del graph.node[:]
        graph.node.extend(nodes)


def _retype(vi) -> None:
    if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT


def _graphs(graph):
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            stack.extend(node_subgraphs(node))


def _rename_uses(graph, old: str, new: str) -> None:
    for g in _graphs(graph):
        for node in g.node:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new


def _rename_producers(graph, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
    _rename_uses(graph, old, new)
    for o in graph.output:
        if o.name == old:
            pass  # the graph output keeps its name; the final Cast produces it
