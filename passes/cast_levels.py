"""Quantized weights that onnxruntime runs in float: levels -> Cast -> Mul(scale).

    m = as_cast_mul(quantized, ["W"])   # W's DequantizeLinear written as Cast + Mul
    f = fold_cast_mul(m)                # float weights back, bit-exact (fold_dequantize calls it)
    d = as_dequantize(m)                # DequantizeLinear again, the same values (the int8 runtime
                                        # calls it: onnxruntime would fold Cast+Mul to float)

Why: onnxruntime 1.25.0 and later fuse DequantizeLinear(constant int8/int4 levels; scale per
tensor, per channel along N or per block along K) + MatMul into MatMulNBits with
accuracy_level 4, whose kernel also quantizes the *activations* to int8 in blocks of 32 along K
(1.24.4 ran the DequantizeLinear and a float MatMul). On all-MiniLM-L6-v2 with every MatMul weight
int8 that doubles the output error. A Cast of a constant and a Mul of two constants are folded at
session creation instead (onnxruntime's constant folding skips DequantizeLinear only), so the
MatMul runs on the float weights the levels describe. The file and the pack are as small (the pack
codes the integer levels whatever reads them) and the error is the weights' alone; the cost is at
run time: the weight is held and multiplied as float (the float model's memory and run time).

Graph form (standard ONNX, opset >= 13; int4/uint4 levels need opset 21, as for DequantizeLinear):
    W_quantized   int8 / uint8 / int4 / uint4 levels, W's shape (unchanged)
    W_scale       W's float type; per channel along axis a: shape (C, 1, ..., 1) (rank - a dims)
    W_zero_point  (only when not all zero) the same layout, in W's float type
    Cast(W_quantized -> W's float type) -> W_levels
    Sub(W_levels, W_zero_point) -> W_centred         (only with a zero point)
    Mul(W_levels | W_centred, W_scale) -> W           (consumers untouched)
Values: float(q - zp) * scale rounded once to W's type, what DequantizeLinear computes (the
product of a level and a scale is exact in float32, so float16 rounds once either way).
Blocked DequantizeLinear (block_size) and a scale or zero point read elsewhere are left as they are.

float16 weights: the arithmetic is written in float32, with the stored tensors kept float16:
    Cast(W_quantized -> FLOAT), Cast(W_scale -> FLOAT) [, Cast(W_zero_point -> FLOAT), Sub]
    Mul -> W_product (float32) -> Cast(-> FLOAT16) -> W
Why: onnxruntime's CPU provider has no float16 Mul kernel, and its constant folding only folds
nodes it has a CPU kernel for: a float16 Mul(Cast(levels), scale) stayed in the graph and ran at
every inference (all-MiniLM-L6-v2 in float16: 2.4x the float16 model's run time, and one warning
per weight at each load). Every node of the float32 chain has a CPU kernel, so the chain folds at
load; the values are the same bit for bit (the float32 product is exact, rounded once to float16).
Files written with a float16 Mul (before 1de3b35) are still read: fold_cast_mul folds them to plain
float16 weights (LevelPattern.float16_arithmetic; onnxruntime computes their float16 Sub and Mul in
float32 through Casts it inserts, so its result is the same single rounding, bit for bit) and
as_dequantize turns them back into DequantizeLinear.

Blocked form (as_blocked_cast_mul; the auto mode's blocked levels): one scale per block of B
consecutive weights along an axis a whose length is a multiple of B, and per index of the
other axes; standard ops that onnxruntime folds to a float weight at load (no opset raise):
    W_quantized   int8 levels, W's shape with axis a split into (D / B, B)
    W_scale       W's float type, W's shape with (D / B, 1) in place of axis a
    W_shape       int64, W's shape
    Cast(W_quantized) -> Mul(W_scale) -> Reshape(W_shape) -> W
fold_cast_mul folds it to W bit for bit; dequantize_graph / as_dequantize write it as a blocked
DequantizeLinear (axis a, block_size B, opset 21) for the int8 runtime.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import graph
from ._fileio import load_model
from .report import Report, TensorChange

LEVEL_TYPES = (TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4)
_OUT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)


def _attr(node: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _reads(g: onnx.GraphProto) -> dict[str, int]:
    count: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            count[i] = count.get(i, 0) + 1
    for o in g.output:  # a graph output is a reader too
        count[o.name] = count.get(o.name, 0) + 1
    return count


def as_cast_mul(model, names) -> onnx.ModelProto:
    """A copy of `model` in which the main-graph DequantizeLinear producing each named weight
    (constant levels, scale and zero point read by it alone, not blocked) is written as
    Cast -> [Sub] -> Mul with the same output name. Weights not found so are left as they are."""
    src = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    g = out.graph
    wanted = set(names)
    inits = {t.name: t for t in g.initializer}
    reads = graph.read_counts(out)  # a subgraph reading a scale by name keeps it
    alloc = graph.NameAllocator(graph.all_names(out))
    new_nodes = []
    for node in g.node:
        rewritten = _rewrite(node, wanted, inits, reads, alloc) if node.op_type == "DequantizeLinear" else None
        new_nodes.extend(rewritten or [node])
    del g.node[:]
    g.node.extend(new_nodes)
    return out


def _rewrite(node, wanted, inits, reads, alloc):
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or node.output[0] not in wanted:
        return None
    if len(node.input) < 2 or _attr(node, "block_size", 0):
        return None
    q_t, s_t = inits.get(node.input[0]), inits.get(node.input[1])
    zp_name = node.input[2] if len(node.input) > 2 else ""
    z_t = inits.get(zp_name) if zp_name else None
    if q_t is None or s_t is None or (zp_name and z_t is None):
        return None
    if q_t.data_type not in LEVEL_TYPES or s_t.data_type not in _OUT_TYPES:
        return None
    if reads.get(s_t.name, 0) != 1 or (z_t is not None and reads.get(z_t.name, 0) != 1):
        return None
    rank = len(q_t.dims)
    scale = graph.tensor_to_array(s_t)
    if scale.size == 1 and scale.ndim <= 1:
        bshape = ()  # per tensor: a scalar broadcasts
    elif scale.ndim == 1 and 0 <= _axis(node, rank) < rank and scale.size == q_t.dims[_axis(node, rank)]:
        bshape = (scale.size,) + (1,) * (rank - 1 - _axis(node, rank))
    else:
        return None
    zp = None
    if z_t is not None:
        zp = graph.tensor_to_array(z_t).astype(np.int32)
        if zp.size != scale.size:
            return None
        if not np.any(zp):
            zp = None
    out_name = node.output[0]
    _replace(s_t, scale.reshape(bshape))
    if zp is not None:
        _replace(z_t, zp.astype(graph.NUMPY_TYPES[s_t.data_type]).reshape(bshape), s_t.data_type)
    return _level_chain(q_t.name, s_t.name, z_t.name if zp is not None else None, s_t.data_type, out_name, alloc)


def _level_chain(q_name: str, s_name: str, zp_name: str | None, w_type: int, out_name: str, alloc,
                 mul_name: str | None = None) -> list:
    """Cast(levels) [- zero point] * scale -> out_name, in float32 arithmetic for a float16 weight
    (the module docstring says why). `mul_name`: the product's name when something (a Reshape)
    follows the chain; out_name is then the chain's last output."""
    widen = w_type == TensorProto.FLOAT16
    arith = TensorProto.FLOAT if widen else w_type
    nodes = [helper.make_node("Cast", [q_name], [alloc.take(out_name + "_levels")], name=alloc.take(out_name + "_Cast"),
                              to=arith)]
    if widen:
        nodes.append(helper.make_node("Cast", [s_name], [alloc.take(s_name + "_float")], name=alloc.take(s_name + "_Cast"),
                                      to=TensorProto.FLOAT))
        s_name = nodes[-1].output[0]
    value = nodes[0].output[0]
    if zp_name is not None:
        if widen:
            nodes.append(helper.make_node("Cast", [zp_name], [alloc.take(zp_name + "_float")],
                                          name=alloc.take(zp_name + "_Cast"), to=TensorProto.FLOAT))
            zp_name = nodes[-1].output[0]
        nodes.append(helper.make_node("Sub", [value, zp_name], [alloc.take(out_name + "_centred")],
                                      name=alloc.take(out_name + "_Sub")))
        value = nodes[-1].output[0]
    product = mul_name or (alloc.take(out_name + "_product") if widen else out_name)
    nodes.append(helper.make_node("Mul", [value, s_name], [product], name=alloc.take(out_name + "_Mul")))
    if widen:
        narrow_out = alloc.take(product + "_half") if mul_name else out_name
        nodes.append(helper.make_node("Cast", [product], [narrow_out], name=alloc.take(out_name + "_Cast_half"), to=w_type))
    return nodes


def _axis(node, rank: int) -> int:
    axis = int(_attr(node, "axis", 1))
    return axis + rank if axis < 0 else axis


def _replace(t: TensorProto, value: np.ndarray, elem_type: int | None = None) -> None:
    name, elem_type = t.name, elem_type or t.data_type
    t.Clear()
    graph.fill_tensor(t, value, name, elem_type)


def as_blocked_cast_mul(model, blocked: dict) -> onnx.ModelProto:
    """A copy of `model` in which each named float main-graph initializer W is replaced by the
    blocked form above. blocked: name -> (levels in W's shape (int8), scale in the layout of
    forms.block_scale_shape in W's float type, axis, block), e.g. from forms.quantize_blocks.
    The new nodes come first in the graph (they read initializers only)."""
    from .errors import InvalidArgumentError
    from .forms import block_scale_shape, block_split_shape

    src = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    alloc = graph.NameAllocator(graph.all_names(out))
    nodes, new_inits, replaced = [], [], set()
    for name in sorted(blocked):
        levels, scale, axis, block = blocked[name]
        t = inits.get(name)
        if t is None or t.data_type not in _OUT_TYPES:
            raise InvalidArgumentError(f"{name!r} is not a float32/float16 main-graph initializer")
        dims = tuple(t.dims)
        axis %= len(dims)
        if tuple(levels.shape) != dims or dims[axis] % block or tuple(scale.shape) != block_scale_shape(dims, axis, block):
            raise InvalidArgumentError(f"blocked levels of {name!r} do not fit its shape {dims} (axis {axis}, block {block})")
        lo, hi = _LEVEL_RANGES[TensorProto.INT8]
        if levels.size and (levels.min() < lo or levels.max() > hi):
            raise InvalidArgumentError(f"levels of {name!r} outside int8")
        q_name, s_name, shape_name = (alloc.take(name + suffix) for suffix in ("_quantized", "_scale", "_shape"))
        new_inits += [graph.array_to_tensor(np.asarray(levels, np.int8).reshape(block_split_shape(dims, axis, block)),
                                            q_name, TensorProto.INT8),
                      graph.array_to_tensor(np.asarray(scale).astype(graph.NUMPY_TYPES[t.data_type]), s_name, t.data_type),
                      graph.array_to_tensor(np.array(dims, np.int64), shape_name, TensorProto.INT64)]
        nodes += _level_chain(q_name, s_name, None, t.data_type, name, alloc, mul_name=alloc.take(name + "_blocks"))
        nodes.append(helper.make_node("Reshape", [nodes[-1].output[0], shape_name], [name], name=alloc.take(name + "_Reshape")))
        replaced.add(name)
    keep = [x for x in g.initializer if x.name not in replaced]
    del g.initializer[:]
    g.initializer.extend(keep + new_inits)
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    return out


def blocked_patterns(g: onnx.GraphProto):
    """(Reshape node, LevelPattern, levels, scale, shape initializer, axis, block) for each
    blocked form of `g` (as_blocked_cast_mul): a level pattern without zero point whose levels
    have W's shape with one axis split into (blocks, block), whose scale has (blocks, 1) there
    and W's other dims, read by a Reshape alone whose constant shape merges the split back."""
    inits = {t.name: t for t in g.initializer}
    reads = _reads(g)
    readers = _readers(g)
    found = []
    for p in level_patterns(g):
        q_t, s_t = p.levels, p.scale
        if (p.sub is not None or q_t.data_type != TensorProto.INT8 or reads.get(p.output, 0) != 1
                or p.weight_type != s_t.data_type):  # (a blocked DequantizeLinear's scale has the weight's type)
            continue
        users = readers.get(p.output, [])
        if len(users) != 1 or users[0].op_type != "Reshape" or users[0].domain not in ("", "ai.onnx"):
            continue
        reshape = users[0]
        if len(reshape.input) != 2 or reshape.input[0] != p.output or reshape.input[1] not in inits:
            continue
        shape_t = inits[reshape.input[1]]
        if shape_t.data_type != TensorProto.INT64 or _attr(reshape, "allowzero", 0):
            continue
        split = _split_axis(tuple(q_t.dims), tuple(s_t.dims), tuple(int(v) for v in graph.tensor_to_array(shape_t).reshape(-1)))
        if split is not None:
            found.append((reshape, p, q_t, s_t, shape_t) + split)
    return found


def _readers(g: onnx.GraphProto) -> dict[str, list]:
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return readers


def _split_axis(q_dims: tuple, s_dims: tuple, target: tuple):
    """(axis, block) when q_dims is target with one axis split into (blocks, block) and s_dims is
    q_dims with 1 in place of the block; else None."""
    if len(q_dims) != len(target) + 1 or len(s_dims) != len(q_dims) or any(d <= 0 for d in target):
        return None
    for a in range(len(target)):
        nb, block = q_dims[a], q_dims[a + 1]
        if (q_dims[:a] == target[:a] and q_dims[a + 2:] == target[a + 1:] and nb * block == target[a]
                and s_dims == q_dims[:a + 1] + (1,) + q_dims[a + 2:] and block > 1):
            return a, block
    return None


# --------------------------------------------------------------------------------------------
# the fold


class LevelPattern(NamedTuple):
    """One Mul(Cast(levels) [- zero point], scale) of initializers (as_cast_mul's form)."""
    mul: onnx.NodeProto
    cast: onnx.NodeProto  # Cast(levels -> the Mul's type)
    sub: onnx.NodeProto | None
    levels: TensorProto
    zero_point: TensorProto | None
    scale: TensorProto  # as stored (float16 for the float32-arithmetic form)
    widen: tuple  # the Casts of a float16 scale / zero point to float32 (the float16 form), else ()
    narrow: onnx.NodeProto | None  # Cast(product -> float16) of the float16 form

    @property
    def output(self) -> str:
        """The weight's name: what the chain's last node writes."""
        return (self.narrow or self.mul).output[0]

    @property
    def weight_type(self) -> int:
        if self.narrow is not None:
            return int(_attr(self.narrow, "to", 0))
        return TensorProto.FLOAT if self.widen else self.scale.data_type

    @property
    def float16_arithmetic(self) -> bool:
        """The old float16 form: the Sub and Mul themselves in float16 (files written before the
        float32 arithmetic). onnxruntime's CPU provider has no float16 Mul kernel, so its constant
        folding cannot fold the pattern: it would run at every inference unless folded first."""
        return not self.widen and self.scale.data_type == TensorProto.FLOAT16

    def nodes(self) -> list:
        return [n for n in (self.cast, self.sub, *self.widen, self.mul, self.narrow) if n is not None]


def pattern_value(p: LevelPattern, read) -> np.ndarray:
    """The weight a level pattern computes (before a blocked form's Reshape), bit for bit what
    onnxruntime computes for it: float(levels - zero point) * scale in float32, rounded once to
    the weight's type. levels - zero point is an integer of at most 9 bits (exact in float32);
    times a float16 scale (11 significant bits) the product is exact in float32, so a float16
    weight rounds once, in the Cast back (new form) or in the float16 Mul that onnxruntime runs
    in float32 behind Casts it inserts (old form); times a float32 scale numpy's float32 product
    rounds as onnxruntime's float32 Mul does. read(tensor) gives an initializer's array (the
    TensorProto's values, or the runtime's weight of that name)."""
    q = read(p.levels).astype(np.float32)
    if p.zero_point is not None:
        q = q - read(p.zero_point).astype(np.float32)
    with np.errstate(over="ignore"):  # (beyond float16's range: inf, as onnxruntime gives)
        return (q * read(p.scale).astype(np.float32)).astype(graph.NUMPY_TYPES[p.weight_type])


def level_patterns(g: onnx.GraphProto) -> list[LevelPattern]:
    """Each Mul(Cast(levels) [- zero point], scale) of initializers in `g` whose intermediate
    values are read by the chain alone: the Mul in the scale's type, or (the float16 form) in
    float32 on Casts of a float16 scale and zero point, then Cast back to float16."""
    inits = {t.name: t for t in g.initializer}
    reads = _reads(g)
    by_out = {n.output[0]: n for n in g.node if n.output}
    readers = _readers(g)

    def operand(name):  # (initializer, the Cast widening it from float16, or None)
        if name in inits:
            return inits[name], None
        node = by_out.get(name)
        if (node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or len(node.input) != 1
                or _attr(node, "to", 0) != TensorProto.FLOAT or reads.get(name, 0) != 1):
            return None, None
        t = inits.get(node.input[0])
        return (t, node) if t is not None and t.data_type == TensorProto.FLOAT16 else (None, None)

    found = []
    for mul in g.node:
        if mul.op_type != "Mul" or len(mul.input) != 2 or mul.domain not in ("", "ai.onnx"):
            continue
        for a, b in (mul.input, tuple(reversed(mul.input))):
            s_t, s_widen = operand(b)
            prev = by_out.get(a)
            if s_t is None or prev is None or s_t.data_type not in _OUT_TYPES or reads.get(a, 0) != 1:
                continue
            arith = TensorProto.FLOAT if s_widen is not None else s_t.data_type
            sub, zp_t, zp_widen = None, None, None
            if prev.op_type == "Sub" and len(prev.input) == 2:
                zp_t, zp_widen = operand(prev.input[1])
                if zp_t is None or (zp_widen is None) != (s_widen is None) or zp_t.data_type != s_t.data_type:
                    continue
                sub = prev
                prev = by_out.get(prev.input[0])
                if prev is None or reads.get(sub.input[0], 0) != 1:
                    continue
            if prev.op_type != "Cast" or len(prev.input) != 1 or prev.input[0] not in inits:
                continue
            q_t = inits[prev.input[0]]
            if q_t.data_type not in LEVEL_TYPES or _attr(prev, "to", 0) != arith:
                continue
            narrow = None
            users = readers.get(mul.output[0], [])
            if (s_widen is not None and len(users) == 1 and reads.get(mul.output[0], 0) == 1
                    and users[0].op_type == "Cast" and users[0].domain in ("", "ai.onnx")
                    and _attr(users[0], "to", 0) == s_t.data_type):
                narrow = users[0]
            widen = tuple(n for n in (s_widen, zp_widen) if n is not None)
            found.append(LevelPattern(mul, prev, sub, q_t, zp_t, s_t, widen, narrow))
            break
    return found


def has_cast_mul(model: onnx.ModelProto) -> bool:
    return any(level_patterns(info.graph) for info in graph.iter_graphs(model))


def fold_cast_mul(model, *, report: Report | None = None) -> onnx.ModelProto:
    """Every Mul(Cast(constant levels) [- constant zero point], constant scale) as a float
    initializer named like the Mul's output, exactly what onnxruntime computes for it."""
    src = load_model(model)
    if not has_cast_mul(src):
        return src
    out = onnx.ModelProto()
    out.CopyFrom(src)
    read_anywhere = graph.read_counts(out)
    for info in reversed(graph.iter_graphs(out)):  # children first
        _fold_graph(info.graph, read_anywhere, report)
    return out


def _fold_graph(g: onnx.GraphProto, read_anywhere: dict[str, int], report) -> None:
    found = level_patterns(g)
    if not found:
        return
    # a blocked form's Reshape is folded with it: the float weight gets the Reshape's name and shape
    reshaped = {p.output: (reshape, shape_t) for reshape, p, _, _, shape_t, _, _ in blocked_patterns(g)}
    drop_nodes, drop_reads, added = set(), {}, []
    for p in found:
        q_t, zp_t, s_t = p.levels, p.zero_point, p.scale
        value = pattern_value(p, graph.tensor_to_array)
        out_name, reshape, shape_t = p.output, None, None
        if p.output in reshaped:
            reshape, shape_t = reshaped[p.output]
            out_name = reshape.output[0]
            value = value.reshape(tuple(int(v) for v in graph.tensor_to_array(shape_t).reshape(-1)))
        added.append(graph.array_to_tensor(value, out_name, p.weight_type))
        drop_nodes |= {n.output[0] for n in p.nodes() + ([reshape] if reshape is not None else [])}
        for t in (q_t, zp_t, s_t, shape_t):
            if t is not None:
                drop_reads[t.name] = drop_reads.get(t.name, 0) + 1
        if report is not None:
            before = sum(graph.tensor_nbytes(t) for t in (q_t, zp_t, s_t) if t is not None)
            report.add(TensorChange(out_name, tuple(value.shape), graph.type_name(q_t.data_type),
                                    "folded levels (Cast+Mul)", before, value.nbytes, None))
    keep = [t for t in g.initializer if t.name not in drop_reads or read_anywhere.get(t.name, 0) > drop_reads[t.name]]
    nodes = [n for n in g.node if not (n.output and n.output[0] in drop_nodes)]
    del g.initializer[:]
    g.initializer.extend(keep + added)
    del g.node[:]
    g.node.extend(nodes)


# --------------------------------------------------------------------------------------------
# the inverse: back to DequantizeLinear


_LEVEL_RANGES = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255),
                 TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)}


class _GraphValues:
    """Initializer values of one graph held in the protobuf (as_dequantize's store; the int8
    runtime passes its own, which reads and writes the weights it feeds)."""

    def __init__(self, g: onnx.GraphProto):
        self.g = g
        self.inits = {t.name: t for t in g.initializer}

    def get(self, name: str) -> np.ndarray:
        return graph.tensor_to_array(self.inits[name])

    def put(self, name: str, value: np.ndarray, elem_type: int) -> None:
        t = self.inits.get(name)
        if t is None:
            t = self.inits[name] = self.g.initializer.add()
        else:
            t.Clear()
        graph.fill_tensor(t, value, name, elem_type)


def dequantize_opset(p: LevelPattern) -> int:
    """The opset the DequantizeLinear of a level pattern needs: 4-bit levels 21, a float16 weight
    (its scale float16) 19, an axis 13."""
    if p.levels.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return 21
    return 19 if p.weight_type == TensorProto.FLOAT16 else 13


def _dequantize_layout(dims, scale: np.ndarray, zp: np.ndarray | None):
    """(axis or None, scale, zero point) in DequantizeLinear's layout (scalars per tensor, 1-D
    along `axis`), or None where the broadcast Mul / Sub is not per tensor or per one axis (or
    would change the weight's shape)."""
    rank = len(dims)
    axes = set()
    for value in (scale, zp):
        if value is None:
            continue
        if value.ndim > rank:
            return None
        full = (1,) * (rank - value.ndim) + tuple(value.shape)
        for i, (d, w) in enumerate(zip(full, dims)):
            if d != 1:
                if d != w:
                    return None
                axes.add(i)
    if len(axes) > 1:
        return None
    axis = axes.pop() if axes else None

    def layout(value):
        if value is None:
            return None
        if axis is None:
            return value.reshape(())
        return np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (dims[axis],)))

    return axis, layout(scale), layout(zp)


def _levels_zero_point(zp: np.ndarray, level_type: int) -> np.ndarray | None:
    """The float zero point as the levels' integer type, or None unless every value converts exactly."""
    lo, hi = _LEVEL_RANGES[level_type]
    wide = zp.astype(np.float64)
    if not np.all(np.isfinite(wide)) or np.any(wide != np.round(wide)) or np.any(wide < lo) or np.any(wide > hi):
        return None
    return wide.astype(np.int8 if lo < 0 else np.uint8)


def dequantize_graph(g: onnx.GraphProto, values, reads: dict[str, int], alloc, names=None,
                     opset: int = 10 ** 9) -> list[str]:
    """Each Cast+Mul level pattern of `g` (those whose output is in `names`, when given) written
    as DequantizeLinear(levels, scale, zero point) with the Mul's output name; `values` reads and
    writes initializer values (get(name), put(name, array, elem_type)); `reads` counts every
    reader of a name in the whole model; a pattern needing an opset above `opset` is left as it
    is. A blocked form (as_blocked_cast_mul) becomes a blocked DequantizeLinear named like its
    Reshape's output (opset BLOCKED_OPSET). Returns the rewritten weights' names."""
    wanted = None if names is None else set(names)
    by_mul, done, unread = {}, [], set()
    blocked = {b[1].output: b for b in blocked_patterns(g)}
    for p in level_patterns(g):
        q_t, zp_t, s_t, out_name = p.levels, p.zero_point, p.scale, p.output
        chain = {n.output[0] for n in p.nodes()}
        if out_name in blocked:
            reshape, _, _, _, shape_t, axis, block = blocked[out_name]
            w_name = reshape.output[0]
            if (wanted is not None and w_name not in wanted) or BLOCKED_OPSET > opset:
                continue
            dq = _blocked_dequantize(values, reads, alloc, q_t, s_t, shape_t, w_name, axis, block)
            by_mul[w_name] = (dq, chain)
            if reads.get(shape_t.name, 0) == 1:
                unread.add(shape_t.name)
            done.append(w_name)
            continue
        if (wanted is not None and out_name not in wanted) or dequantize_opset(p) > opset:
            continue
        zp = None if zp_t is None else values.get(zp_t.name)
        layout = _dequantize_layout(tuple(q_t.dims), values.get(s_t.name), zp)
        if layout is None:
            continue
        axis, scale, zp = layout
        if zp is not None:
            zp = _levels_zero_point(zp, q_t.data_type)
            if zp is None:
                continue
        # a scale or zero point read elsewhere too keeps its own layout there: a new tensor here
        s_name = s_t.name if reads.get(s_t.name, 0) == 1 else alloc.take(out_name + "_scale")
        # DequantizeLinear's scale has the weight's type: a float16 form's float16 scale as stored,
        # one widened to a float32 weight exactly so
        values.put(s_name, scale.astype(graph.NUMPY_TYPES[p.weight_type]), p.weight_type)
        inputs = [q_t.name, s_name]
        if zp is not None:
            z_name = zp_t.name if reads.get(zp_t.name, 0) == 1 else alloc.take(out_name + "_zero_point")
            values.put(z_name, zp, q_t.data_type)
            inputs.append(z_name)
        dq = helper.make_node("DequantizeLinear", inputs, [out_name], name=alloc.take(out_name + "_DequantizeLinear"))
        if axis is not None:
            dq.attribute.append(helper.make_attribute("axis", axis))
        # nodes keyed by their output (protobuf hands out new wrapper objects on each walk)
        by_mul[out_name] = (dq, chain - {out_name})
        done.append(out_name)
    if by_mul:
        dropped = set().union(*(ids for _, ids in by_mul.values()))
        nodes = [by_mul[n.output[0]][0] if n.output and n.output[0] in by_mul else n
                 for n in g.node if not (n.output and n.output[0] in dropped)]
        del g.node[:]
        g.node.extend(nodes)
    if unread:  # the blocked forms' shapes, read by their Reshape alone
        keep = [t for t in g.initializer if t.name not in unread]
        del g.initializer[:]
        g.initializer.extend(keep)
    return done


BLOCKED_OPSET = 21  # DequantizeLinear's block_size attribute


def patterns_opset(g: onnx.GraphProto) -> int:
    """The opset dequantize_graph needs to rewrite every level pattern of `g` (blocked forms:
    BLOCKED_OPSET); 0 when there is none."""
    need = max((dequantize_opset(p) for p in level_patterns(g)), default=0)
    return max(need, BLOCKED_OPSET) if blocked_patterns(g) else need


def _blocked_dequantize(values, reads, alloc, q_t, s_t, shape_t, w_name: str, axis: int, block: int):
    """A blocked form's DequantizeLinear (levels and scale re-laid in its layout: the same values)."""
    dims = tuple(int(v) for v in values.get(shape_t.name).reshape(-1))
    levels = values.get(q_t.name).reshape(dims)
    scale = values.get(s_t.name)
    scale = scale.reshape(scale.shape[:axis + 1] + scale.shape[axis + 2:])
    # a tensor read elsewhere too keeps its own layout there: a new one here
    q_name = q_t.name if reads.get(q_t.name, 0) == 1 else alloc.take(w_name + "_quantized")
    s_name = s_t.name if reads.get(s_t.name, 0) == 1 else alloc.take(w_name + "_scale")
    values.put(q_name, levels, q_t.data_type)
    values.put(s_name, scale, s_t.data_type)
    return helper.make_node("DequantizeLinear", [q_name, s_name], [w_name], name=alloc.take(w_name + "_DequantizeLinear"),
                            axis=axis, block_size=block)


def as_dequantize(model, names=None) -> onnx.ModelProto:
    """A copy of `model` in which each Cast -> [Sub] -> Mul level pattern (every one, or those
    producing the named weights; subgraphs too) is a DequantizeLinear again: the same levels, the
    scale as a scalar or 1-D along `axis`, the zero point (where the pattern has one) in the
    levels' type; the same values bit for bit (the inverse of as_cast_mul). A pattern whose
    scale or zero point is not per tensor or per one axis, whose zero point is not exactly a
    level, or that needs an opset the model cannot be raised to (int4 21, float16 scale 19) is
    left as it is.

    Why: onnxruntime folds Cast+Mul of constants to a float weight at load; the int8 runtime
    (passes.InferenceSession mode="int8") keeps DequantizeLinear weights integer in memory."""
    from .errors import UnsupportedFormError

    src = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    wanted = None if names is None else set(names)
    need = max((dequantize_opset(p) for info in graph.iter_graphs(out)
                for p in level_patterns(info.graph) if wanted is None or p.output in wanted),
               default=0)
    if any(wanted is None or b[0].output[0] in wanted for info in graph.iter_graphs(out) for b in blocked_patterns(info.graph)):
        need = max(need, BLOCKED_OPSET)
    if not need:
        return out
    opset = graph.default_opset(out)
    if need > opset:
        try:
            out, _ = graph.raise_opset(out, need)
            opset = need
        except UnsupportedFormError:
            pass  # the patterns that need more stay Cast+Mul
    reads = graph.read_counts(out)
    alloc = graph.NameAllocator(graph.all_names(out))
    for info in graph.iter_graphs(out):
        dequantize_graph(info.graph, _GraphValues(info.graph), reads, alloc, wanted, opset)
    return out
