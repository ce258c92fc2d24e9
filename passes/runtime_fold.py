"""mode="fold" at load: every DequantizeLinear whose inputs are all constants becomes its float
output tensor, computed once, tensor by tensor, into the array the session will keep.

The arithmetic is `passes.fold`'s when that module provides it (so a session built here computes
exactly what `fold_dequantize` writes); a local vectorised equivalent stands in otherwise.
"""
from __future__ import annotations

import numpy as np
import onnx

from .errors import UnsupportedFormError
from .runtime_feed import SplitModel


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


def _fold_math():
    """passes.fold's array-level dequantization when it exposes one, else ours."""
    try:
        from . import fold  # noqa: F401  (owned by the quantize engineer)
    except ImportError:
        return dequantize
    for name in ("dequantize_array", "dequantize"):
        fn = getattr(fold, name, None)
        if callable(fn):
            return fn
    return dequantize


def constant_dequantize_nodes(split: SplitModel) -> list:
    """Main-graph DequantizeLinear nodes whose inputs are all initializers."""
    inits = split.initializer_names()
    return [
        n for n in split.skeleton.graph.node
        if n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx", "com.microsoft")
        and all((not i) or i in inits for i in n.input)
    ]


def fold_into(split: SplitModel, progress=None, only=None) -> int:
    """Replace constant DequantizeLinear nodes by float initializers; returns how many were folded.

    `only`: optional predicate on a node, to fold a subset (the int8 mode folds what it does not
    keep quantized)."""
    math = _fold_math()
    nodes = [n for n in constant_dequantize_nodes(split) if only is None or only(n)]
    folded = set()
    consumers = _consumer_counts(split.skeleton.graph)
    for done, node in enumerate(nodes, 1):
        x = split.array(node.input[0])
        scale = split.array(node.input[1])
        zp = split.array(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if x is None or scale is None:
            raise UnsupportedFormError(f"DequantizeLinear {node.name or node.output[0]!r}: inputs are not readable constants")
        out_dtype = _output_dtype(node, scale)
        value = _call_math(math, x, scale, zp, node, out_dtype)
        split.set_weight(node.output[0], value)
        folded.add(id(node))
        # the quantized inputs are dropped as soon as nothing else reads them (bounded memory)
        for name in node.input:
            if name in split.weights and consumers.get(name, 0) <= 1:
                split.weights.pop(name)
            consumers[name] = consumers.get(name, 0) - 1
        if progress:
            progress(done, len(nodes))
    if folded:
        keep = [n for n in split.skeleton.graph.node if id(n) not in folded]
        del split.skeleton.graph.node[:]
        split.skeleton.graph.node.extend(keep)
        split.refresh_placeholders()
    return len(folded)


def _consumer_counts(graph) -> dict:
    counts = {}
    for node in graph.node:
        for name in node.input:
            counts[name] = counts.get(name, 0) + 1
        for attr in node.attribute:  # names a subgraph reads from the outer scope count as uses
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                for inner in _consumer_counts(g):
                    counts[inner] = counts.get(inner, 0) + 1
    for o in graph.output:
        counts[o.name] = counts.get(o.name, 0) + 1
    return counts


def _output_dtype(node, scale):
    out = _attr(node, "output_dtype", 0)
    if out:
        return onnx.helper.tensor_dtype_to_np_dtype(out)
    return scale.dtype


def _call_math(math, x, scale, zp, node, out_dtype):
    axis = _attr(node, "axis", 1)
    block_size = _attr(node, "block_size", 0)
    if math is dequantize:
        return dequantize(x, scale, zp, axis=axis, block_size=block_size, out_dtype=out_dtype)
    try:
        return np.asarray(math(x, scale, zp, axis=axis, block_size=block_size)).astype(out_dtype, copy=False)
    except TypeError:
        return dequantize(x, scale, zp, axis=axis, block_size=block_size, out_dtype=out_dtype)
