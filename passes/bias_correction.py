"""Bias correction: the mean output shift that rounding a layer's weights leaves, folded into its bias.

For y = x @ W + b (MatMul followed by Add of a constant, Gemm, Conv through its patches), rounding
W to W_hat shifts the expected output by E[x] @ (W - W_hat): not noise that averages out but a
constant offset per output channel, which the following layers carry on (a ReLU turns it into a
threshold shift). Adding that shift to b removes it at no cost in bytes: b' = b + E[x] @ (W - W_hat),
with E[x] measured on calibration feeds (per input of the weight; for a Conv, the mean of each
kernel tap's input over the output positions, padding included, so borders are exact too).
A Conv or Gemm without a bias gets one; a MatMul is corrected only through an Add of a constant
that is its only reader and broadcasts along the output channels.

    q = passes.quantize_weights(model, bits=5)
    qc = passes.correct_bias(q, model, feeds)       # same weights, corrected biases

The building blocks (bias_targets, input_means, bias_shift, with_bias_inputs, set_biases) serve the
auto mode, which measures every candidate form with its correction (passes/auto.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from . import graph
from .errors import InvalidArgumentError
from .report import Report

_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


@dataclass(frozen=True)
class BiasTarget:
    """Where the output shift of a weight's rounding can be folded.

    op: the consuming node's type ("MatMul", "Gemm", "Conv"); node: its name or first output (to find it
    again); activation: the node's data input; bias: the bias initializer's name, or "" where the node has
    none yet (Conv, Gemm: with_bias_inputs adds one); scale: the factor from x @ dW to the bias (Gemm:
    alpha / beta); trans_b: Gemm's transB."""

    weight: str
    op: str
    node_output: str
    activation: str
    bias: str
    channels: int = 0  # N, the bias length
    elem_type: int = onnx.TensorProto.FLOAT  # the weight's float type (an added bias gets it)
    scale: float = 1.0
    trans_b: bool = False


def _readers(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name:
                readers.setdefault(name, []).append((node, i))
    # a name read inside a subgraph (an outer-scope reference) has readers we do not follow
    for node in model.graph.node:
        for sub in graph.node_subgraphs(node):
            stack = [sub]
            while stack:
                g = stack.pop()
                for n in g.node:
                    for name in n.input:
                        if name in readers:
                            readers[name].append((None, -1))
                    stack.extend(graph.node_subgraphs(n))
    return readers


def _constant_tensors(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Output name -> tensor of the main graph's Constant nodes holding a float tensor ("value")."""
    out = {}
    for node in model.graph.node:
        if (node.op_type == "Constant" and len(node.output) == 1 and len(node.attribute) == 1
                and node.attribute[0].name == "value" and node.attribute[0].t.data_type in _FLOAT_TYPES):
            out[node.output[0]] = node.attribute[0].t
    return out


def bias_targets(model: onnx.ModelProto, names) -> dict[str, BiasTarget]:
    """Weight name -> BiasTarget for every named main-graph float initializer read by exactly one
    node as its weight:
      - MatMul input B (2-D) whose output only feeds an Add of a constant shaped (N,) (or 1s then N);
      - Gemm input B (transA 0, beta != 0), C absent or a constant shaped (N,) / (1, N);
      - Conv input W: its bias B; without one, the BatchNormalization that alone reads its output
        (its input mean moves the other way: scale -1), or an Add of a constant shaped (C, 1, ..)
        / (1, C, 1, ..); else a bias to add (with_bias_inputs).
    A constant is an initializer or a Constant node's output (with_bias_inputs makes it an
    initializer). One read by more than this layer is left alone (correcting it would move the others)."""
    inits = graph.unique_initializers(model)
    consts = _constant_tensors(model) if model.ir_version >= 4 else {}  # IR 3: initializers are inputs too
    readers = _readers(model)
    graph_outputs = {o.name for o in model.graph.output}
    out = {}

    def own(bname, shapes):
        bt = inits.get(bname, consts.get(bname))
        return (bt is not None and bt.data_type in _FLOAT_TYPES and len(readers.get(bname, [])) == 1
                and tuple(bt.dims) in shapes)

    def only_reader(y):
        ys = readers.get(y, [])
        if y in graph_outputs or len(ys) != 1 or ys[0][0] is None:
            return None, -1
        return ys[0]

    for name in names:
        t = inits.get(name)
        uses = readers.get(name, [])
        if t is None or t.data_type not in _FLOAT_TYPES or len(uses) != 1 or uses[0][0] is None:
            continue
        node, idx = uses[0]
        dims = tuple(t.dims)
        if idx != 1 or not node.output:
            continue
        make = lambda bname, n, scale=1.0, trans_b=False: BiasTarget(  # noqa: E731
            name, node.op_type, node.output[0], node.input[0], bname, n, t.data_type, scale, trans_b)
        if node.op_type == "Conv" and len(dims) in (3, 4):
            c = dims[0]
            bname = node.input[2] if len(node.input) > 2 else ""
            if bname:
                if own(bname, {(c,)}):
                    out[name] = make(bname, c)
                continue
            nxt, j = only_reader(node.output[0])
            ones = (1,) * (len(dims) - 2)
            if (nxt is not None and nxt.op_type == "BatchNormalization" and j == 0 and len(nxt.input) == 5
                    and len([o for o in nxt.output if o]) == 1 and not _attr(nxt, "training_mode", 0)
                    and own(nxt.input[3], {(c,)})):
                out[name] = make(nxt.input[3], c, -1.0)  # BN(x + d; mean) = BN(x; mean - d)
            elif nxt is not None and nxt.op_type == "Add" and own(nxt.input[1 - j], {(c,) + ones, (1, c) + ones}):
                out[name] = make(nxt.input[1 - j], c)
            else:
                out[name] = make("", c)
        elif node.op_type == "Gemm" and len(dims) == 2 and not _attr(node, "transA", 0):
            trans_b = bool(_attr(node, "transB", 0))
            n_out = dims[0] if trans_b else dims[1]
            alpha, beta = float(_attr(node, "alpha", 1.0)), float(_attr(node, "beta", 1.0))
            bname = node.input[2] if len(node.input) > 2 else ""
            if beta == 0 or (bname and not own(bname, {(n_out,), (1, n_out)})):
                continue
            # without C, with_bias_inputs adds one, which beta then multiplies too
            out[name] = make(bname, n_out, alpha / beta, trans_b)
        elif node.op_type == "MatMul" and len(dims) == 2:
            nxt, j = only_reader(node.output[0])
            if nxt is None or nxt.op_type != "Add":
                continue
            bname = nxt.input[1 - j]
            bt = inits.get(bname, consts.get(bname))
            if bt is None or not own(bname, {tuple(bt.dims)}):
                continue
            bdims = tuple(bt.dims)
            if not bdims or bdims[-1] != dims[1] or any(d != 1 for d in bdims[:-1]):
                continue
            out[name] = make(bname, dims[1])
    return out


def _node_of(model: onnx.ModelProto, target: BiasTarget):
    for node in model.graph.node:
        if node.op_type == target.op and node.output and node.output[0] == target.node_output:
            return node
    return None


def _conv_tap_means(x: np.ndarray, node, kshape) -> np.ndarray:
    """(C, *kshape) mean over batch and output positions of the input each kernel tap reads (the
    zero padding included), for a Conv of 1 or 2 spatial dims."""
    spatial = x.ndim - 2
    if spatial == 1:
        x = x[:, :, None, :]
        kshape = (1,) + tuple(kshape)
    pads = list(_attr(node, "pads", [0] * (2 * spatial)))
    strides = list(_attr(node, "strides", [1] * spatial))
    dil = list(_attr(node, "dilations", [1] * spatial))
    if spatial == 1:
        pads = [0, pads[0], 0, pads[1]] if len(pads) == 2 else [0, 0, 0, 0]
        strides, dil = [1] + strides[:1], [1] + dil[:1]
    h, w = x.shape[2:]
    kh, kw = kshape
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0, 0, 0, 0]
        for ax, (size, k, s, d) in enumerate(((h, kh, strides[0], dil[0]), (w, kw, strides[1], dil[1]))):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            pads[ax], pads[ax + 2] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        pads = [0, 0, 0, 0]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (xp.shape[2] - (kh - 1) * dil[0] - 1) // strides[0] + 1
    ow = (xp.shape[3] - (kw - 1) * dil[1] - 1) // strides[1] + 1
    out = np.zeros((x.shape[1], kh, kw))
    if oh <= 0 or ow <= 0:
        return out.reshape((x.shape[1],) + tuple(kshape[-spatial:]))
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * dil[0], kx * dil[1]
            sl = xp[:, :, y0: y0 + (oh - 1) * strides[0] + 1: strides[0], x0: x0 + (ow - 1) * strides[1] + 1: strides[1]]
            out[:, ky, kx] = sl.mean(axis=(0, 2, 3))
    return out.reshape((x.shape[1],) + tuple(kshape[-spatial:]))


def input_means(model: onnx.ModelProto, feeds, targets: dict[str, BiasTarget], shapes: dict | None = None) -> dict[str, np.ndarray]:
    """Weight name -> mean of what the weight multiplies, over the feeds (float64): (K,) for
    MatMul/Gemm (mean over all rows of x), (C_in, *kernel) for Conv (mean input of each tap).
    Weights whose activations are not finite on the feeds are left out. shapes: weight name ->
    its shape, where the weights are not (all) initializers of `model` (Constant nodes)."""
    from .gptq import activation_session

    feeds = list(feeds)
    if not targets:
        return {}
    inits = graph.unique_initializers(model)
    acts = sorted({t.activation for t in targets.values()})
    sess, allowed = activation_session(model, acts)
    sums: dict[str, np.ndarray] = {}
    count: dict[str, int] = {}
    for feed in feeds:
        res = dict(zip(acts, sess.run(acts, {k: v for k, v in feed.items() if k in allowed})))
        for name, t in targets.items():
            x = np.asarray(res[t.activation])
            dims = tuple(shapes[name]) if shapes is not None else tuple(inits[name].dims)
            if t.op == "Conv":
                if x.ndim != len(dims) or x.ndim not in (3, 4):
                    continue
                mean = _conv_tap_means(x, _node_of(model, t), dims[2:])
            else:
                k = dims[1] if t.trans_b else dims[0]
                if x.ndim < 1 or x.shape[-1] != k:
                    continue
                mean = x.reshape(-1, k).astype(np.float64).mean(axis=0)
            if not np.isfinite(mean).all():
                continue
            sums[name] = sums.get(name, 0) + mean
            count[name] = count.get(name, 0) + 1
    n_feeds = len(feeds)
    # a weight must be measured on every feed (a feed whose activation was not finite would bias the mean)
    return {n: sums[n] / count[n] for n in sums if count[n] == n_feeds}


def bias_shift(target: BiasTarget, mean: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> np.ndarray:
    """What the target's bias must gain to cancel the expected output shift that replacing w by
    w_hat causes, E[x] @ (w - w_hat), times target.scale (Gemm's alpha / beta; -1 for a
    BatchNormalization's mean). (N,) float64."""
    dw = w.astype(np.float64) - w_hat.astype(np.float64)
    if target.op == "Conv":
        o = dw.shape[0]
        c_in = mean.shape[0]
        cg = dw.shape[1]
        groups = c_in // cg
        if groups * cg != c_in or o % groups:
            raise InvalidArgumentError(f"{target.weight}: Conv input channels {c_in} do not match the weight {dw.shape}")
        m = mean.reshape(groups, cg, -1)  # (g, Cg, taps)
        d = dw.reshape(groups, o // groups, cg, -1)  # (g, O/g, Cg, taps)
        return target.scale * np.einsum("gct,goct->go", m, d).reshape(o)
    if target.trans_b:
        dw = dw.T
    return target.scale * (mean.astype(np.float64) @ dw)


def _bias_name(model: onnx.ModelProto, weight: str) -> str:
    taken = graph.all_names(model)
    base = weight + "_bias"
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def with_bias_inputs(model: onnx.ModelProto, targets: dict[str, BiasTarget]) -> tuple[onnx.ModelProto, dict[str, BiasTarget]]:
    """(model, targets) where every Conv / Gemm target without a bias has a zero one (an initializer
    of the weight's dtype named after it) and every bias held by a Constant node is an initializer,
    so that the bias can be fed or rewritten. Unchanged (the same objects) when there is nothing to do."""
    missing = [t for t in targets.values() if not t.bias]
    consts = _constant_tensors(model)
    lift = {t.bias for t in targets.values() if t.bias in consts}
    if not missing and not lift:
        return model, dict(targets)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    out = dict(targets)
    if lift:  # Constant nodes holding biases become initializers (same name, same values): feedable, rewritable
        keep = []
        for node in m.graph.node:
            if node.op_type == "Constant" and node.output and node.output[0] in lift:
                m.graph.initializer.append(graph.array_to_tensor(
                    graph.tensor_to_array(node.attribute[0].t), node.output[0], node.attribute[0].t.data_type))
            else:
                keep.append(node)
        del m.graph.node[:]
        m.graph.node.extend(keep)
    for t in missing:
        node = _node_of(m, t)
        bname = _bias_name(m, t.weight)
        dtype = graph.NUMPY_TYPES[t.elem_type]
        m.graph.initializer.append(graph.array_to_tensor(np.zeros(t.channels, dtype), bname, t.elem_type))
        while len(node.input) < 2:
            node.input.append("")
        if len(node.input) == 2:
            node.input.append(bname)
        else:
            node.input[2] = bname
        out[t.weight] = dataclasses.replace(t, bias=bname)
    return m, out


def set_biases(model: onnx.ModelProto, values: dict[str, np.ndarray], drop=()) -> onnx.ModelProto:
    """A copy of `model` whose named bias initializers hold `values` (cast to their type, shape
    kept), and whose biases named in `drop` (ones with_bias_inputs added that stayed zero) are
    removed with the node input that read them."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    drop = set(drop) - set(values)
    new = []
    for t in m.graph.initializer:
        if t.name in drop:
            continue
        if t.name in values:
            arr = np.asarray(values[t.name], np.float64).reshape(tuple(t.dims))
            t = graph.array_to_tensor(arr.astype(graph.NUMPY_TYPES[t.data_type]), t.name, t.data_type)
        new.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(new)
    if drop:
        for node in m.graph.node:
            if node.op_type in ("Conv", "Gemm") and len(node.input) == 3 and node.input[2] in drop:
                del node.input[2]
    return m


def _float_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Name -> array of the main graph's float initializers and float Constant nodes."""
    out = {n: graph.tensor_to_array(t) for n, t in graph.unique_initializers(model).items() if t.data_type in _FLOAT_TYPES}
    for n, t in _constant_tensors(model).items():
        out.setdefault(n, graph.tensor_to_array(t))
    return out


def _folded_weights(quantized: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Name -> dequantized array of every main-graph weight the DequantizeLinear forms hold (an
    initializer or a Constant node once folded)."""
    from .fold import fold_dequantize

    folded = _float_weights(fold_dequantize(quantized))
    dq_out = {n.output[0] for n in quantized.graph.node if n.op_type == "DequantizeLinear" and n.output}
    return {n: folded[n] for n in dq_out if n in folded}


def correct_bias(quantized, original, feeds, *, report: Report | None = None) -> onnx.ModelProto:
    """`quantized` (weights as DequantizeLinear forms, as quantize_weights / quantize_with_feedback
    write them, same weight names as `original`; palettized weights (Gather forms) are not seen) with every correctable layer's bias shifted by
    E[x] @ (W - W_hat), E[x] measured by running `original` on `feeds` (feed dicts or an .npz path).
    Conv and Gemm layers without a bias get one. Weights kept float, or not correctable, are left."""
    from ._fileio import load_model

    q = load_model(quantized)
    src = load_model(original)
    from .fidelity import feed_list

    feeds = feed_list(feeds, src, " to measure the layers' mean inputs")
    w_hat = _folded_weights(q)
    originals = _float_weights(src)
    names = [n for n in w_hat if n in originals and originals[n].shape == w_hat[n].shape]
    # the activations are the float model's (same node and value names: quantizing rewrote the
    # weights only); the consumers are found in the quantized model, whose weight is a
    # DequantizeLinear output there with the same name
    q_targets = _dq_targets(q, {n: originals[n] for n in names})
    means = input_means(src, feeds, q_targets, shapes={n: originals[n].shape for n in q_targets})
    q_targets = {n: t for n, t in q_targets.items() if n in means}
    q2, q_targets = with_bias_inputs(q, q_targets)
    q_inits = graph.unique_initializers(q2)
    values = {}
    for n, t in sorted(q_targets.items()):
        shift = bias_shift(t, means[n], originals[n], w_hat[n])
        base = graph.tensor_to_array(q_inits[t.bias]).astype(np.float64)
        values[t.bias] = base + shift.reshape(base.shape)
        if report is not None:
            report.note(f"{n}: bias {t.bias} shifted by up to {float(np.max(np.abs(shift))):.3g}")
    if report is not None:
        report.pass_name = report.pass_name or "correct_bias"
        report.note(f"bias correction on {len(values)} of {len(names)} quantized weights"
                    + ("" if names else " (no DequantizeLinear weight found: palettized weights are not corrected)"))
    return set_biases(q2, values)


def _dq_targets(q: onnx.ModelProto, weights: dict[str, np.ndarray]) -> dict[str, BiasTarget]:
    """bias_targets for weights that are DequantizeLinear outputs (not initializers) in `q`: the
    same rules, on stand-in initializers with the weights' (float) shapes and types."""
    fake = onnx.ModelProto()
    fake.CopyFrom(q)
    dq = {n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear" and n.output and n.output[0] in weights}
    for name in sorted(dq):
        arr = weights[name]
        fake.graph.initializer.append(onnx.TensorProto(
            name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), dims=list(arr.shape)))
    return bias_targets(fake, sorted(dq))
