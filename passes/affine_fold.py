"""Per-channel affine nodes after a Conv folded into its weight and bias.

A trained network often leaves the inference-time batch normalisation as separate nodes after
each Conv: a BatchNormalization node (rapidocr_cls: 35 of them, their scale/offset/mean/variance
in Constant nodes), or, from converters that work in NHWC, Transpose -> Add(bias) -> Sub(mean) ->
Mul(scale) -> Add(offset) (open_nsfw: 4 vectors per channel, with same-type Casts between). Each
is y = a * conv(x) + c per output channel, so it folds exactly (up to float rounding) into the
Conv: W' = a * W (row by row), b' = c. Why here: those vectors stay float in a compressed model,
where they are a large part of what is left: in rapidocr_cls's auto model the graph skeleton
(mostly these Constant nodes) was 45% of the packed file; in open_nsfw they are 213 KB of float32
(0.9% of the float model, ~5% of its packed auto model). A per-channel quantized W' keeps the
same levels as W (its step per output channel scales with a), so the weight costs what it did.

    folded, n = fold_conv_affine(model)   # n: the nodes removed
    folded, n = fold_conv_affine(model, ops=("BatchNormalization",))   # those alone

Only what is exact is folded: a chain of nodes that each read the previous one's output alone
(no other reader, no graph output, no subgraph reading it; a dropped node's own output is read by
main-graph nodes only, which then read its input), made of Add / Sub / Mul / Div by a
constant that broadcasts along the output channels (all other axes 1), BatchNormalization in
inference form, and the Transpose / Identity / float Cast nodes between them (kept: only the
affine nodes go). The Conv's weight (and bias, if any) must be constants read by it alone.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from . import graph
from .errors import InvalidArgumentError

_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
_PASS_THROUGH = ("Transpose", "Identity", "Cast")
AFFINE_OPS = ("Add", "Sub", "Mul", "Div", "BatchNormalization")


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Constants:
    """Main-graph constants by name: initializers and Constant nodes' tensors."""

    def __init__(self, model: onnx.ModelProto):
        overridable = {i.name for i in model.graph.input}  # (an initializer also a graph input is not constant)
        self.inits = {t.name: t for t in model.graph.initializer if t.name not in overridable}
        self.nodes = {}
        for n in model.graph.node:
            if n.op_type == "Constant" and len(n.output) == 1 and len(n.attribute) == 1 \
                    and n.attribute[0].name == "value" and n.attribute[0].type == onnx.AttributeProto.TENSOR:
                self.nodes[n.output[0]] = n.attribute[0].t

    def _tensor(self, name):
        t = self.inits.get(name, self.nodes.get(name))
        if t is None or t.data_type not in _FLOAT_TYPES or t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        return t

    def get(self, name):
        t = self._tensor(name)
        return None if t is None else graph.tensor_to_array(t).astype(np.float64)

    def shape(self, name):
        """The constant's shape, without converting its values (a Conv weight is converted only
        once an affine chain after it folds)."""
        t = self._tensor(name)
        return None if t is None else tuple(t.dims)


def _channel_vector(k: np.ndarray, rank: int, axis: int, channels: int):
    """k as a (channels,) vector when it broadcasts along `axis` of a rank-`rank` tensor alone, else None."""
    if k.ndim > rank:
        return None
    shape = (1,) * (rank - k.ndim) + k.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, channels):
        return None
    return np.broadcast_to(k.reshape(-1), (channels,)).astype(np.float64)


def _step(node, chain_in, consts, rank, axis, channels, a, c):
    """(a, c) after one affine node reading the chain at input `chain_in`, or None when it does not fold."""
    op = node.op_type
    if op == "BatchNormalization":
        if chain_in != 0 or len(node.input) != 5 or len(node.output) > 1 and any(node.output[1:]) \
                or _attr(node, "training_mode", 0):
            return None
        vs = [consts.get(n) for n in node.input[1:]]
        if any(v is None for v in vs):
            return None
        vs = [_channel_vector(v, 1, 0, channels) for v in vs]
        if any(v is None for v in vs) or axis != 1:
            return None
        scale, offset, mean, var = vs
        g = scale / np.sqrt(var + float(_attr(node, "epsilon", 1e-5)))
        return a * g, (c - mean) * g + offset
    if len(node.input) != 2:
        return None
    k = consts.get(node.input[1 - chain_in])
    if k is None:
        return None
    k = _channel_vector(k, rank, axis, channels)
    if k is None:
        return None
    if op == "Add":
        return a, c + k
    if op == "Mul":
        return a * k, c * k
    if op == "Sub":
        return (a, c - k) if chain_in == 0 else (-a, k - c)
    if op == "Div" and chain_in == 0 and np.all(k != 0):
        return a / k, c / k
    return None


def _affine_chain(conv, model, consts, counts, readers, outputs, ops):
    """(affine nodes to drop, a, c) for the nodes after `conv`, or None when nothing folds."""
    w_shape = consts.shape(conv.input[1])
    if w_shape is None or len(w_shape) < 3:
        return None
    rank, axis, channels = len(w_shape), 1, w_shape[0]
    a, c = np.ones(channels), np.zeros(channels)
    dropped = []
    name = conv.output[0]
    while counts.get(name, 0) == 1 and name not in outputs and len(readers.get(name, [])) == 1:
        node, chain_in = readers[name][0]
        if node.op_type in _PASS_THROUGH:
            if node.op_type == "Transpose":
                perm = list(_attr(node, "perm", list(range(rank))[::-1]))
                if sorted(perm) != list(range(rank)):
                    break
                axis = perm.index(axis)
            elif node.op_type == "Cast" and _attr(node, "to", 0) not in _FLOAT_TYPES:
                break
        elif node.op_type in ops:
            out = node.output[0] if node.output else ""
            # a dropped node's readers read its chain input instead: only main-graph nodes can be rewired
            # (a graph output or a subgraph reading it by name would be left without a producer)
            if not out or out in outputs or counts.get(out, 0) != len(readers.get(out, [])):
                break
            step = _step(node, chain_in, consts, rank, axis, channels, a, c)
            if step is None:
                break
            a, c = step
            dropped.append((node, chain_in))
        else:
            break
        if len(node.output) < 1:
            break
        name = node.output[0]
    return (dropped, a, c) if dropped else None


def fold_conv_affine(model: onnx.ModelProto, ops=AFFINE_OPS) -> tuple[onnx.ModelProto, int]:
    """(model with the per-channel affine nodes after its Convs folded into them, nodes removed).
    ops: the affine node types folded (a subset of AFFINE_OPS); a chain ends at any other.
    The input model is not changed; without anything to fold it is returned as is.
    An IR 3 model (every initializer also listed as a graph input, as IR 3 requires) is folded as
    IR 4 with those inputs unlisted (graph.unlist_ir3_initializers, as quantize_weights does):
    at IR >= 4 a listed initializer is an overridable input, not a constant, and is left alone."""
    unknown = set(ops) - set(AFFINE_OPS)
    if unknown:
        raise InvalidArgumentError(f"fold_conv_affine: ops must be among {', '.join(AFFINE_OPS)}, got {sorted(unknown)}")
    if model.ir_version < 4 and {i.name for i in model.graph.input} & {t.name for t in model.graph.initializer}:
        from .graph import unlist_ir3_initializers

        ir4 = onnx.ModelProto()
        ir4.CopyFrom(model)
        unlist_ir3_initializers(ir4)
        folded, n = fold_conv_affine(ir4, ops)
        return (folded, n) if n else (model, 0)
    consts = _Constants(model)
    counts = graph.read_counts(model)
    outputs = {o.name for o in model.graph.output}
    readers = {}
    for node in model.graph.node:
        for i, n in enumerate(node.input):
            if n:
                readers.setdefault(n, []).append((node, i))
    folds = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Conv" or len(node.input) < 2 or counts.get(node.input[1], 0) != 1:
            continue
        if len(node.input) > 2 and node.input[2] and (consts.shape(node.input[2]) is None
                                                       or counts.get(node.input[2], 0) != 1):
            continue
        chain = _affine_chain(node, model, consts, counts, readers, outputs, tuple(ops))
        if chain is not None:
            folds.append((index, chain))
    if not folds:
        return model, 0
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return _apply(m, folds, consts), sum(len(ch[0]) for _, ch in folds)


def _apply(m, folds, consts):
    names = graph.all_names(m)
    rename, new_values = {}, {}
    for index, (dropped, a, c) in folds:
        conv = mconv = m.graph.node[index]  # (m is a copy of the model the indexes are of)
        w_name = conv.input[1]
        w_t = consts.inits.get(w_name, consts.nodes.get(w_name))
        w = consts.get(w_name)
        new_values[w_name] = (w * a.reshape((-1,) + (1,) * (w.ndim - 1)), w_t.data_type)
        b = consts.get(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
        bias = c + (a * b if b is not None else 0.0)
        if b is not None:
            b_name = conv.input[2]
        else:
            b_name = _unique(names, w_name + "_bias")
            while len(mconv.input) < 3:
                mconv.input.append("")
            mconv.input[2] = b_name
        new_values[b_name] = (bias, w_t.data_type)
        for node, chain_in in dropped:
            rename[node.output[0]] = node.input[chain_in]
    dropped_outputs = set(rename)
    keep = [n for n in m.graph.node if not any(o in dropped_outputs for o in n.output)]
    for n in keep:
        for i, name in enumerate(n.input):
            while name in rename:
                name = rename[name]
            n.input[i] = name
    del m.graph.node[:]
    m.graph.node.extend(keep)
    _write_constants(m, new_values)
    _drop_unread_constants(m)
    # shapes and types of the removed nodes' outputs are stale names now
    vi = [v for v in m.graph.value_info if v.name not in dropped_outputs]
    del m.graph.value_info[:]
    m.graph.value_info.extend(vi)
    return m


def _unique(names, base):
    name, k = base, 1
    while name in names:
        name, k = f"{base}_{k}", k + 1
    names.add(name)
    return name


def _write_constants(m, values):
    """Each named constant (initializer, Constant node, or new initializer) set to its value."""
    const_nodes = {n.output[0]: n for n in m.graph.node if n.op_type == "Constant" and len(n.output) == 1}
    inits = {t.name: t for t in m.graph.initializer}
    for name, (value, elem) in values.items():
        arr = value.astype(graph.NUMPY_TYPES[elem])
        t = graph.array_to_tensor(arr, name, elem)
        if name in inits:
            inits[name].CopyFrom(t)
        elif name in const_nodes:
            const_nodes[name].attribute[0].t.CopyFrom(t)
        else:
            m.graph.initializer.append(t)


def _drop_unread_constants(m):
    counts = graph.read_counts(m)
    keep_nodes = [n for n in m.graph.node
                  if not (n.op_type == "Constant" and len(n.output) == 1 and counts.get(n.output[0], 0) == 0)]
    if len(keep_nodes) != len(m.graph.node):
        del m.graph.node[:]
        m.graph.node.extend(keep_nodes)
    graph_inputs = {i.name for i in m.graph.input}
    keep_inits = [t for t in m.graph.initializer if counts.get(t.name, 0) or t.name in graph_inputs]
    if len(keep_inits) != len(m.graph.initializer):
        del m.graph.initializer[:]
        m.graph.initializer.extend(keep_inits)
