"""Error-feedback rounding with second-order information from calibration activations (GPTQ).

For a weight read as y = x @ W (MatMul, Gemm, or Conv through its patches), the output error of
quantizing W is (x @ (W - W_hat)); its expected energy is tr(E^T H E) with H = X^T X over the
calibration inputs X. GPTQ rounds the input rows of W one after the other and spreads each
row's rounding error over the rows not yet rounded, weighted by the inverse Hessian, so that
the output error stays small even though the weight error grows. The scales (and so the graph
form) are those quantize_weights chose; only the integer levels change.

    H = collect_hessians(model, feeds, names)          # name -> (K, K) over the weight's inputs
    q = gptq_levels(W_matrix, H, scale, qmin, qmax)    # W_matrix (K, N), scale (N,)

Options (bench/layer_rd.py measures them on the corpus; packed bits at equal held-out layer SNR):
  damp       diagonal loading of H relative to its mean diagonal. The default 0.01 follows the
             calibration activations so closely that the layer looks 7-9 dB better on them than on
             held-out activations; damp=1.0 keeps most of the gain held out (gap 2.4-3.4 dB).
  order      act-order (activation_order): helps Conv weights, hurt MiniLM's MatMuls held out.
  lam        rate-aware levels inside the loop: measured ~0; scales chosen by rounding="rdo"
             (quantize_weights) are where rate-aware rounding pays, and refine() feeds error at them.
  block_size blocked scales along the inputs (gptq_levels, blocked_levels: MatMul/Gemm along K,
             Conv along its input channels; refine() skips blocked models).

Supported consumers: MatMul (weight as input B, 2-D), Gemm (input B, transB handled; transA=0),
Conv (group 1, 1-D or 2-D kernels; patches by im2col on a sample of output positions), in the main
graph or inside If branches (their activations are brought out as outputs of the If nodes:
with_branch_outputs). Weights read by anything else, by several nodes, or inside a Loop / Scan body,
are left to plain rounding.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from . import graph
from .errors import InvalidArgumentError

MAX_ROWS_PER_FEED = 2048  # activation rows (tokens or conv output positions) sampled per feed
DAMP = 0.01  # relative diagonal damping of H
SHRINK = 0.0  # H's off-diagonal part shrunk by this fraction before the damping (inverse_factor). Measured
# and left at 0: minilm_fp32, every weight int6 per channel error-fed (bench/gptq_model.py --bits 6; Hessians
# on the first half of the corpus feeds; centred output SNR calibration / held-out half): damp 0.3 22.93 /
# 15.10 dB (nearest 18.83 / 12.40), shrink 0.5 21.66 / 13.00, 0.9 20.00 / 13.03; damp 0.1 + shrink 0.5 21.92 /
# 14.65: shrinking towards the diagonal loses the correlations error feedback uses, held out as well.


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _branches(node):
    """The subgraphs of an If node (then_branch, else_branch): those whose values can be brought out
    as outputs of the node (a Loop / Scan body's values differ per iteration: not looked into)."""
    if node.op_type != "If":
        return []
    return [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]


def _defined(g) -> set:
    return {i.name for i in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output if o}


def _reads(model: onnx.ModelProto, want: set) -> dict[str, list]:
    """Weight name -> every (node, input index, graph holding the node, supported) reading it, in the
    main graph and in the subgraphs of its nodes (a subgraph sees the names around it). supported:
    the node is in the main graph or reached through If branches only; a name a subgraph defines
    again is that subgraph's own."""
    uses: dict[str, list] = {}

    def walk(g, visible: set, supported: bool):
        for node in g.node:
            for i, inp in enumerate(node.input):
                if inp in visible:
                    uses.setdefault(inp, []).append((node, i, g, supported))
            for a in node.attribute:
                subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []
                for sub in subs:
                    walk(sub, visible - _defined(sub), supported and node.op_type == "If")

    walk(model.graph, set(want), True)
    return uses


def _consumers(model: onnx.ModelProto, names) -> dict[str, tuple]:
    """consumers(), with the graph holding each node: name -> (node, activation, graph)."""
    out = {}
    for name, us in _reads(model, set(names)).items():
        if len(us) != 1:
            continue
        node, i, g, supported = us[0]
        if not supported:
            continue
        if node.op_type == "MatMul" and i == 1:
            out[name] = (node, node.input[0], g)
        elif node.op_type == "Gemm" and i == 1 and not _attr(node, "transA", 0):
            out[name] = (node, node.input[0], g)
        elif node.op_type == "Conv" and i == 1 and _attr(node, "group", 1) == 1:
            out[name] = (node, node.input[0], g)
    return out


def consumers(model: onnx.ModelProto, names) -> dict[str, tuple[onnx.NodeProto, str]]:
    """Weight name -> (its single supported consuming node, the activation input name). The node may
    sit in the main graph or inside If branches (nested too: the auto mode lifts silero_vad's weights
    out of its If branches to main-graph initializers); collect_hessians brings such a node's input
    out of the branch. A weight with a reader inside a Loop / Scan body is left out."""
    return {n: (node, a) for n, (node, a, _) in _consumers(model, names).items()}


def _im2col(x: np.ndarray, node, kshape, rng) -> np.ndarray:
    """Patches (positions, C*kh*kw) of a 2-D Conv input x (N, C, H, W), in the weight's
    (C, kh, kw) flattening order, on a random sample of output positions."""
    n, c, h, w = x.shape
    kh, kw = kshape
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    strides = list(_attr(node, "strides", [1, 1]))
    dil = list(_attr(node, "dilations", [1, 1]))
    if _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        # SAME_UPPER / SAME_LOWER: total padding so that out = ceil(in / stride)
        pads = []
        for size, k, s, d in ((h, kh, strides[0], dil[0]), (w, kw, strides[1], dil[1])):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            pads.append(total // 2)
        pads = [pads[0], pads[1], pads[0], pads[1]]  # close enough for statistics
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (xp.shape[2] - (kh - 1) * dil[0] - 1) // strides[0] + 1
    ow = (xp.shape[3] - (kw - 1) * dil[1] - 1) // strides[1] + 1
    if oh <= 0 or ow <= 0:
        return np.zeros((0, c * kh * kw), np.float64)
    total = n * oh * ow
    pick = rng.choice(total, size=min(total, MAX_ROWS_PER_FEED), replace=False)
    b, rem = np.divmod(pick, oh * ow)
    oy, ox = np.divmod(rem, ow)
    ky = np.arange(kh) * dil[0]
    kx = np.arange(kw) * dil[1]
    ys = (oy * strides[0])[:, None, None] + ky[None, :, None]  # (P, kh, 1)
    xs = (ox * strides[1])[:, None, None] + kx[None, None, :]  # (P, 1, kw)
    patches = xp[b[:, None, None, None], np.arange(c)[None, :, None, None], ys[:, None], xs[:, None]]
    return patches.reshape(len(pick), c * kh * kw).astype(np.float64)


def _as_conv2d(node) -> onnx.NodeProto:
    """A 1-D Conv node's attributes as those of the 2-D convolution of height 1 it equals."""
    pads = list(_attr(node, "pads", [0, 0]))
    return helper.make_node("Conv", list(node.input), list(node.output),
                            pads=[0, pads[0], 0, pads[1]] if len(pads) == 2 else [0, 0, 0, 0],
                            strides=[1] + list(_attr(node, "strides", [1]))[:1],
                            dilations=[1] + list(_attr(node, "dilations", [1]))[:1],
                            auto_pad=_attr(node, "auto_pad", b"NOTSET"))


def activation_session(model: onnx.ModelProto, activations, dtypes: dict | None = None):
    """A CPU onnxruntime session of `model` with the named inner values added as graph outputs
    (those already outputs stay as they are), and the names of the inputs it takes: feeds may
    carry more (a model whose initializers were listed as inputs at IR 3).
    A value defined inside an If branch (nested ones too) is brought out under its own name as a
    new output of the If node (with_branch_outputs); where the other branch runs, that output is an
    empty tensor. dtypes: value name -> TensorProto element type of such values (float32 if absent)."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    with_branch_outputs(m, activations, dtypes)
    present = {o.name for o in m.graph.output}
    for a in activations:
        if a not in present:
            m.graph.output.append(onnx.ValueInfoProto(name=a))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess, {i.name for i in sess.get_inputs()}


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _rename(g, old: str, new: str) -> None:
    """Every occurrence of value `old` in graph g (node inputs/outputs, graph outputs, value_info)
    and the reads of it in g's subgraphs, as `new`."""
    for n in g.node:
        for i, v in enumerate(n.input):
            if v == old:
                n.input[i] = new
        for i, v in enumerate(n.output):
            if v == old:
                n.output[i] = new
        for a in n.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []
            for sub in subs:
                if old not in _defined(sub):
                    _rename(sub, old, new)
    for vi in list(g.output) + list(g.value_info):
        if vi.name == old:
            vi.name = new


def _all_names(g, acc: set) -> set:
    acc |= _defined(g) | {v for n in g.node for v in n.input}
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                _all_names(sub, acc)
    return acc


def with_branch_outputs(model: onnx.ModelProto, names, dtypes: dict | None = None) -> list[str]:
    """Edits `model` in place so that each named value defined inside an If branch (through If
    branches only, at any depth) is defined in the main graph under the same name: in the branch
    that computes it the value is renamed and becomes a branch output, the other branch outputs an
    empty tensor of its type (dtypes: name -> element type, float32 if absent), and the If node
    gets the name as a new output. What the model computed before is unchanged. Returns the names
    brought out; names defined in the main graph, nowhere or in a Loop / Scan body, or already a
    branch output, are left as they are."""
    dtypes = dtypes or {}
    taken = _all_names(model.graph, set())
    counter = [0]

    def fresh(base: str) -> str:
        while True:
            counter[0] += 1
            cand = f"{base}__branch_out{counter[0]}"
            if cand not in taken:
                taken.add(cand)
                return cand

    def where(g, name):
        """The If node of g and the index of its branch whose subtree defines `name`, else None."""
        for n in g.node:
            for bi, b in enumerate(_branches(n)):
                if name in _defined(b) or where(b, name) is not None:
                    return n, bi
        return None

    def bring_out(g, name) -> bool:
        """Make `name` (defined below g, through If branches) a value of g; True when done."""
        hit = where(g, name)
        if hit is None:
            return False
        node, _ = hit
        branches = _branches(node)
        if len(branches) != 2:
            return False
        outs = []
        for b in branches:
            if name in _defined(b) or where(b, name) is not None:
                if name not in _defined(b) and not bring_out(b, name):
                    return False
                if name in {o.name for o in b.output} or name in {i.name for i in b.input}:
                    return False
                local = fresh(name)
                _rename(b, name, local)
                outs.append((b, local, None))
            else:
                outs.append((b, fresh(name), dtypes.get(name, onnx.TensorProto.FLOAT)))
        for b, local, empty_type in outs:
            if empty_type is not None:
                b.node.append(helper.make_node("Constant", [], [local],
                                               value=helper.make_tensor(local, empty_type, [0], [])))
            b.output.append(helper.make_tensor_value_info(local, dtypes.get(name, onnx.TensorProto.FLOAT), None))
        node.output.append(name)
        return True

    main = _defined(model.graph)
    done = []
    for name in dict.fromkeys(names):
        if name not in main and bring_out(model.graph, name):
            done.append(name)
    return done


def collect_hessians(model: onnx.ModelProto, feeds, names, seed: int = 0, rows: dict | None = None) -> dict[str, np.ndarray]:
    """H = X^T X / rows for every weight with a supported consumer, from onnxruntime runs of the
    model on the feeds with the consumers' activation inputs added as graph outputs.
    rows: a dict, filled with the number of activation rows (tokens, sampled conv output positions)
    each H was summed over: what sample_damp weighs H's reliability by."""
    if not consumers(model, names):
        return {}
    inits = graph.unique_initializers(model)
    # a weight read inside an If branch: its activation is copied there (Identity) and the copy brought
    # out of the branch (activation_session): empty where the branch did not run, and left out of H
    # then, even where the activation itself is a value of the graphs around the branch
    model = _copy(model)
    taken = _all_names(model.graph, set())
    cons = {}
    for name, (node, a, g) in _consumers(model, names).items():
        if g is not model.graph:
            local = f"{a}__read_in_branch"
            k = 0
            while local in taken:
                k += 1
                local = f"{a}__read_in_branch{k}"
            taken.add(local)
            g.node.append(helper.make_node("Identity", [a], [local]))
            a = local
        cons[name] = (node, a)
    dtypes = {a: inits[n].data_type for n, (_, a) in cons.items() if n in inits}
    sess, allowed = activation_session(model, sorted({a for _, a in cons.values()}), dtypes)
    # only the activations: the model's own outputs (a bfloat16 LLM's logits) may be of a type
    # onnxruntime cannot hand to numpy, and nobody here reads them
    out_names = sorted({a for _, a in cons.values()})
    rng = np.random.default_rng(seed)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for feed in feeds:
        res = dict(zip(out_names, sess.run(out_names, {k: v for k, v in feed.items() if k in allowed})))
        for name, (node, a) in cons.items():
            x = np.asarray(res[a])
            if x.size == 0 or name not in inits:
                continue
            dims = tuple(inits[name].dims)
            if node.op_type == "Conv":
                if x.ndim == 3 and len(dims) == 3:  # Conv1d: a 2-D convolution of height 1
                    X = _im2col(x[:, :, None, :].astype(np.float32), _as_conv2d(node), (1, dims[2]), rng)
                elif x.ndim == 4 and len(dims) == 4:
                    X = _im2col(x.astype(np.float32), node, dims[2:], rng)
                else:
                    continue
            else:
                k = dims[1] if (node.op_type == "Gemm" and _attr(node, "transB", 0)) else dims[0]
                if x.shape[-1] != k:
                    continue
                X = x.reshape(-1, k).astype(np.float64)
                if X.shape[0] > MAX_ROWS_PER_FEED:
                    X = X[rng.choice(X.shape[0], MAX_ROWS_PER_FEED, replace=False)]
            if not np.isfinite(X).all():
                continue
            h = X.T @ X
            sums[name] = sums.get(name, 0) + h
            counts[name] = counts.get(name, 0) + X.shape[0]
    if rows is not None:
        rows.update(counts)
    return {n: sums[n] / max(counts[n], 1) for n in sums}


def sample_damp(k: int, rows: int, floor: float = DAMP, per_input: float = 0.5) -> float:
    """Diagonal loading (relative to H's mean diagonal, as inverse_factor takes it) for a Hessian
    of k inputs summed over `rows` activation rows: per_input * k / rows, at least floor.
    Why: error feedback trusts H in every direction, and H from few rows per input has not seen
    every direction the held-out activations take. open_nsfw (first 24 corpus feeds calibrate,
    last 24 held out; int6 per channel, layer output SNR calibration / held-out): the last
    stage's Conv 256x3x3 (2304 inputs, 7x7 positions x 24 photos = 1176 rows) at damp 0.01
    42.5 / 34.5 dB, 0.3 40.3 / 36.4, 1.0 38.8 / 36.4; a stage-2 Conv 64x3x3 (576 inputs,
    >= 18,000 rows) 41.9 / 42.6 at 0.01 and 40.0 / 41.3 at 0.3 (damping it costs held out too).
    Every Conv of open_nsfw error-fed at int6 (bench/gptq_model.py --only open_nsfw --bits 6,
    centred-logit SNR calibration / held-out): damp 0.01 29.00 / 13.30 dB; this rule with
    per_input 0.4: 29.03 / 14.69, 1.0: 29.14 / 16.05, 2.0: 29.08 / 13.55 (the held-out figure is
    one logit difference on each of 24 borderline crops: +-1.5 dB of noise). rows <= 0: floor or
    per_input * k, whichever is larger."""
    if rows <= 0:
        return max(float(floor), float(per_input) * k)
    return max(float(floor), float(per_input) * k / rows)


def as_matrix(w: np.ndarray, node_op: str, trans_b: bool) -> tuple[np.ndarray, callable]:
    """The weight as (K inputs, N outputs) and the function mapping such a matrix back."""
    if node_op == "Conv":
        o = w.shape[0]
        return w.reshape(o, -1).T, (lambda m: m.T.reshape(w.shape))
    if trans_b:
        return w.T, (lambda m: m.T)
    return w, (lambda m: m)


def activation_order(h: np.ndarray) -> np.ndarray:
    """Input order for "act-order" GPTQ: inputs with the largest mean squared activation
    (diagonal of H) are rounded first, while most rows are still free to absorb their error."""
    return np.argsort(-np.diag(h), kind="stable")


def inverse_factor(h: np.ndarray, damp: float = DAMP, order: np.ndarray | None = None,
                   shrink: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(upper Cholesky factor U of the damped H^-1 = U^T U, mask of dead inputs). It depends on H
    (and the input order) only, so the auto mode computes it once per weight for all its
    candidate widths. order: a permutation of the inputs (activation_order), or None; the factor
    and the mask are then in that order. shrink: H's off-diagonal part scaled by (1 - shrink)
    before the damping (None: SHRINK)."""
    k = h.shape[0]
    h = h.astype(np.float64).copy()
    shrink = SHRINK if shrink is None else float(shrink)
    if shrink:
        d = np.diag(h).copy()
        h *= 1.0 - shrink
        h[np.diag_indices(k)] = d
    if order is not None:
        h = h[np.ix_(order, order)]
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    try:
        hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    except np.linalg.LinAlgError:
        h[np.diag_indices(k)] += float(np.mean(np.diag(h)))
        hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    return hinv, dead


def row_scales(scale: np.ndarray, k: int, block_size: int = 0) -> np.ndarray:
    """(K, N) scales, one per weight: scale (N,) per output channel, or (ceil(K / block_size), N)
    blocked along the K inputs as DequantizeLinear lays them out."""
    s = np.asarray(scale, dtype=np.float64)
    if not block_size:
        return np.broadcast_to(s.reshape(-1), (k, s.size))
    return s[np.arange(k) // block_size]


def gptq_levels(w: np.ndarray, h: np.ndarray, scale: np.ndarray, qmin: int, qmax: int,
                block: int = 128, damp: float = DAMP, factor=None, order: np.ndarray | None = None,
                lam: float | None = None, rate_bits: np.ndarray | None = None,
                block_size: int = 0) -> np.ndarray:
    """Integer levels (K, N) for w (K, N) with per-output-column scales (N,) (zero point 0), or
    with block_size, scales (ceil(K / block_size), N) blocked along the inputs; rows rounded in
    order with error feedback through the Cholesky factor of H^-1 (lazy block updates: one
    matrix product per block of rows). factor: inverse_factor(h, damp, order), if known.

    order: the order the input rows are rounded in (activation_order(h): "act-order"); None is
    0..K-1. The scales do not move with it (a blocked scale stays with its inputs).
    lam: rate-aware rounding inside the loop (passes/rounding.py): each level is chosen among
    floor, ceil and 0 of the error-corrected value by (q - y)**2 + lam_i * bits(q) in squared
    steps, with lam_i = lam * U_ii**2 / mean(U_jj**2) (an input whose error costs more output
    error gets a smaller rate weight); rate_bits: code lengths per level qmin..qmax (default:
    the order-0 model of nearest rounding's histogram)."""
    k, n = w.shape
    s_rows = row_scales(scale, k, block_size).copy()
    s_rows[s_rows <= 0] = 1.0
    dead_cols = (np.asarray(scale).reshape(-1, n) <= 0).all(axis=0)
    w = w.astype(np.float64)
    if order is not None:
        w, s_rows = w[order], s_rows[order]
    else:
        w = w.copy()
    hinv, dead = factor if factor is not None else inverse_factor(h, damp, order)
    w[dead, :] = 0.0
    q = np.zeros((k, n), np.int32)
    lam_rows = None
    if lam:
        from . import rounding as _rd

        if rate_bits is None:
            near = np.clip(np.rint(w / s_rows), qmin, qmax)
            rate_bits = _rd.level_bits(_rd.counts_of(near.astype(np.float32), qmin, qmax - qmin + 1))
        rate_bits = np.asarray(rate_bits, dtype=np.float32)
        d2 = np.diag(hinv) ** 2
        lam_rows = (lam * d2 / max(float(np.mean(d2)), 1e-300)).astype(np.float32)
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        wb = w[b0:b1]
        errs = np.zeros_like(wb)
        ub = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            row = wb[i]
            s = s_rows[b0 + i]
            if lam_rows is None:
                qi = np.clip(np.rint(row / s), qmin, qmax)
            else:
                qi = _rd.rdo_levels((row / s).astype(np.float32), qmin, qmax, 0.0, lam_rows[b0 + i], rate_bits)
            q[b0 + i] = qi
            e = (row - qi * s) / ub[i, i]
            wb[i + 1:] -= np.outer(ub[i, i + 1:], e)
            errs[i] = e
        w[b1:] -= hinv[b0:b1, b1:].T @ errs
    if order is not None:
        out = np.empty_like(q)
        out[order] = q
        q = out
    q[:, dead_cols] = 0
    return q


def _dq_node(qmodel: onnx.ModelProto, name: str):
    for node in qmodel.graph.node:
        if node.op_type == "DequantizeLinear" and node.output and node.output[0] == name:
            return node
    return None


def refine(qmodel: onnx.ModelProto, src: onnx.ModelProto, hessians: dict, bits: int, damp: float | dict = DAMP,
           factors: dict | None = None, act_order: bool = False, lam: float | None = None,
           refit_scales: bool = False) -> dict:
    """GPTQ levels for every weight of `qmodel` (made by quantize_weights from `src` at `bits`,
    symmetric, per channel; any rounding: with rounding="rdo" the levels are error-fed at rdo's
    larger steps) that has a Hessian and a per-output-channel scale.
    Returns name -> (levels in W's shape, int32; dequantized float array in W's dtype).
    factors: a dict kept across calls for other widths (inverse factors; keyed by name, and by
    (name, act_order, damp) when those are not the defaults).
    damp: diagonal loading of H relative to its mean diagonal. The default 0.01 fits the
    calibration activations closely; on the corpus, held-out activations are matched better
    with 0.3-1.0 (bench/layer_rd.py). A dict gives each weight its own (name -> damp; DAMP for
    names it lacks): sample_damp, from the rows each H was summed over. act_order: round inputs
    in order of falling activation energy: True for every weight, "conv" for Conv weights only
    (where it measured a gain; it lost on MatMul weights). lam: rate-aware levels inside the loop (gptq_levels).
    refit_scales: also refit each output channel's scale to its error-fed levels (refit_scale)
    and feed the error again at the new scales, kept where the output error through H is lower;
    the values are then name -> (levels, dequantized, scale in the stored scale's type and
    shape), and write_levels takes (levels, scale) to write both."""
    if act_order not in (True, False, "conv"):
        raise InvalidArgumentError(f"act_order must be True, False or 'conv', got {act_order!r}")
    if not hessians:
        return {}
    q_inits = graph.unique_initializers(qmodel)
    s_inits = graph.unique_initializers(src)
    cons = consumers(src, hessians)
    qmax = (1 << (bits - 1)) - 1
    out = {}
    for name, h in hessians.items():
        node = _dq_node(qmodel, name)
        if node is None or len(node.input) < 2 or (len(node.input) > 2 and node.input[2]):
            continue
        if _attr(node, "block_size", 0):
            continue
        scale_t = q_inits.get(node.input[1])
        if scale_t is None or name not in s_inits or name not in cons:
            continue
        w = graph.tensor_to_array(s_inits[name])
        scale = graph.tensor_to_array(scale_t)
        axis = _attr(node, "axis", 1)
        op = cons[name][0].op_type
        trans_b = op == "Gemm" and bool(_attr(cons[name][0], "transB", 0))
        want_axis = 0 if (op == "Conv" or trans_b) else 1
        if scale.ndim != 1 or w.ndim < 2 or axis != want_axis or scale.size != w.shape[axis]:
            continue
        mat, back = as_matrix(w, op, trans_b)
        if h.shape != (mat.shape[0], mat.shape[0]):
            continue
        s32 = scale.astype(np.float32)
        ao = act_order is True or (act_order == "conv" and op == "Conv")
        order = activation_order(h) if ao else None
        d = damp.get(name, DAMP) if isinstance(damp, dict) else damp
        key = name if (not ao and d == DAMP) else (name, ao, float(d))
        factor = None
        if factors is not None:
            if key not in factors:
                factors[key] = inverse_factor(h, d, order)
            factor = factors[key]
        lv = gptq_levels(mat, h, s32.astype(np.float64), -qmax, qmax, damp=d, factor=factor, order=order, lam=lam)
        if refit_scales:
            if factor is None:
                factor = inverse_factor(h, d, order)
            lv, stored = _refit(mat, h, lv, scale, qmax, d, factor, order, lam)
            s32 = stored.astype(np.float32)
        levels = back(lv)
        shape = [1] * w.ndim
        shape[axis] = -1
        deq = (levels.astype(np.float32) * s32.reshape(shape)).astype(w.dtype)
        out[name] = (levels.astype(np.int32), deq, stored) if refit_scales else (levels.astype(np.int32), deq)
    return out


def refit_scale(mat: np.ndarray, h: np.ndarray, levels: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per output column of mat (K, N), the scale that minimises the output error of its levels
    (K, N) for inputs of second moment h: argmin_s (w - s q)^T H (w - s q) = q^T H w / q^T H q.
    Why: the clip search chose each scale for nearest rounding's weight error; error feedback
    then moves the levels, and at the scale that fits the levels it chose the output error is
    lower (open_nsfw, every Conv weight int6 error-fed: centred-logit SNR +1.3 dB on calibration
    and held-out feeds alike, the same levels' entropy). Columns whose levels are all zero, or
    whose least-squares scale is not positive and finite, keep `scale`."""
    q = levels.astype(np.float64)
    hq = h @ q
    num = np.einsum("kn,kn->n", hq, mat)
    den = np.einsum("kn,kn->n", hq, q)
    out = np.asarray(scale, np.float64).reshape(-1).copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        fit = num / den
    ok = (den > 0) & np.isfinite(fit) & (fit > 0)
    out[ok] = fit[ok]
    return out


def _refit(mat, h, lv, scale, qmax, damp, factor, order, lam):
    """(levels, stored scale): one refit of the scales to the error-fed levels (through the damped
    H, as the levels were fitted) in the stored scale's type, then the levels fed again at them;
    kept only where that lowers the output error (per column), else the first levels and scale."""
    mat = mat.astype(np.float64)
    hd = h.astype(np.float64).copy()
    hd[np.diag_indices(len(hd))] += damp * float(np.mean(np.diag(hd)))
    old = np.asarray(scale)
    new = refit_scale(mat, hd, lv, old.astype(np.float64)).astype(old.dtype)
    if not np.all(np.isfinite(new.astype(np.float64))) or np.any(new.astype(np.float64) <= 0):
        bad = ~(np.isfinite(new.astype(np.float64)) & (new.astype(np.float64) > 0))
        new[bad] = old[bad]
    lv2 = gptq_levels(mat, h, new.astype(np.float64), -qmax, qmax, damp=damp, factor=factor, order=order, lam=lam)
    e1 = _column_errors(mat, hd, lv, old.astype(np.float64))
    e2 = _column_errors(mat, hd, lv2, new.astype(np.float64))
    better = e2 < e1
    return np.where(better[None, :], lv2, lv), np.where(better, new, old).astype(old.dtype)


def _column_errors(mat, h, levels, scale) -> np.ndarray:
    """Output error per column: e_n^T H e_n, e = mat - levels * scale."""
    e = mat - levels.astype(np.float64) * scale.reshape(1, -1)
    return np.einsum("kn,kn->n", e, h @ e)


def write_levels(qmodel: onnx.ModelProto, levels_by_name: dict) -> onnx.ModelProto:
    """A copy of a quantize_weights model whose named weights' integer levels are replaced
    (same container type, scales and nodes). Main-graph initializers only. A value may also be
    (levels, scale) (refine with refit_scales): the weight's scale initializer, read by its
    DequantizeLinear alone, then takes that scale (same type and shape)."""
    m = onnx.ModelProto()
    m.CopyFrom(qmodel)
    reads: dict[str, int] = {}
    for node in m.graph.node:
        for i in node.input:
            reads[i] = reads.get(i, 0) + 1
    q_names, s_names = {}, {}
    for name, value in levels_by_name.items():
        node = _dq_node(m, name)
        if node is None:
            continue
        q_names[node.input[0]] = np.asarray(value[0] if isinstance(value, tuple) else value)
        if isinstance(value, tuple):
            if len(node.input) < 2 or reads.get(node.input[1], 0) != 1:
                raise InvalidArgumentError(f"the scale of {name!r} is shared with other nodes: its levels' own scale cannot be written")
            s_names[node.input[1]] = np.asarray(value[1])
    new = []
    for t in m.graph.initializer:
        lv = q_names.get(t.name)
        sc = s_names.get(t.name)
        if lv is not None and tuple(t.dims) == lv.shape:
            new.append(graph.array_to_tensor(lv, t.name, t.data_type))
        elif sc is not None and tuple(t.dims) == sc.shape:
            new.append(graph.array_to_tensor(sc.astype(graph.NUMPY_TYPES[t.data_type]), t.name, t.data_type))
        else:
            new.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(new)
    return m


def input_importance(model: onnx.ModelProto, hessians: dict) -> dict[str, np.ndarray]:
    """Weight name -> the mean squared activation of each weight's input (the diagonal of H),
    shaped to broadcast against the weight as stored: what forms.quantize_linear(importance=...)
    and quantize_weights(importance=...) weigh the squared error of the clip search with."""
    inits = graph.unique_initializers(model)
    cons = consumers(model, hessians)
    out = {}
    for name, h in hessians.items():
        if name not in inits or name not in cons:
            continue
        dims = tuple(inits[name].dims)
        node = cons[name][0]
        d = np.maximum(np.diag(h), 0).astype(np.float32)
        if node.op_type == "Conv" and len(dims) >= 3 and d.size == int(np.prod(dims[1:])):
            out[name] = d.reshape((1,) + dims[1:])
        elif node.op_type == "Gemm" and _attr(node, "transB", 0) and len(dims) == 2 and d.size == dims[1]:
            out[name] = d.reshape(1, -1)
        elif len(dims) == 2 and d.size == dims[0]:
            out[name] = d.reshape(-1, 1)
    return out


def quantize_with_feedback(model, feeds, *, bits: int = 4, rounding: str = "rdo", damp: float = 1.0,
                           conv_damp: float | None = 0.3, act_order="conv", importance: bool = False, report=None,
                           **quantize_options):
    """quantize_weights(model, bits=bits, rounding=rounding, **quantize_options), then error-feedback
    levels (refine) for every weight with a supported consumer, from Hessians of the model run on
    `feeds` (a list of feed dicts or an .npz path). The defaults are the combination that measured
    best on held-out activations of the corpus (bench/layer_rd.py, bench/gptq_model.py): rdo
    steps, damp 1.0 for MatMul/Gemm weights and conv_damp 0.3 for Conv weights (None: damp for
    all; at 0.3 open_nsfw's held-out logits were 1-3 dB cleaner than at 1.0, MiniLM's cosine
    better at 1.0), act-order on Conv weights only. importance=True also weights the clip search by the inputs' activation
    energy (input_importance). Only symmetric per-channel weights are refined; others keep the
    quantize pass's levels. The report's per-tensor SNR is that of the levels before feedback."""
    from ._fileio import load_model
    from .quantize import quantize_weights

    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 8:
        raise InvalidArgumentError(f"bits must be an integer from 2 to 8, got {bits!r}")
    for what, value in (("damp", damp), ("conv_damp", damp if conv_damp is None else conv_damp)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not np.isfinite(value):
            raise InvalidArgumentError(f"{what} must be a finite number > 0, got {value!r}")
    src = load_model(model)
    from .fidelity import feed_list

    feeds = feed_list(feeds, src, " for error feedback")
    hess = collect_hessians(src, feeds, [t.name for t in src.graph.initializer])
    imp = input_importance(src, hess) if importance else None
    q = quantize_weights(src, bits=bits, rounding=rounding, importance=imp, report=report, **quantize_options)
    cons = consumers(src, hess)
    conv = {n: h for n, h in hess.items() if n in cons and cons[n][0].op_type == "Conv"}
    rest = {n: h for n, h in hess.items() if n not in conv}
    conv_d = float(damp if conv_damp is None else conv_damp)
    refined = refine(q, src, rest, int(bits), damp=float(damp), act_order=act_order)
    refined.update(refine(q, src, conv, int(bits), damp=conv_d, act_order=act_order))
    if report is not None:
        report.note(f"error feedback (GPTQ, damp {damp:g}, Conv damp {conv_d:g}, act_order {act_order}) replaced "
                    f"the levels of {len(refined)} weights; their SNR in this report is before it")
    return write_levels(q, {n: lv for n, (lv, _) in refined.items()})


def blocked_matrix_scale(scale: np.ndarray, axis: int) -> np.ndarray:
    """A 2-D weight's blocked scale (forms.block_scale_shape layout) as (blocks, N) along the K
    inputs of its matrix (as_matrix): axis 0 is a MatMul weight (K, N), axis 1 a Gemm transB
    weight (N, K)."""
    if axis == 0:
        return scale.reshape(scale.shape[0], -1)
    return scale.reshape(scale.shape[0], -1).T


def blocked_levels(w: np.ndarray, h: np.ndarray, scale: np.ndarray, axis: int, block: int, bits: int,
                   damp: float = DAMP, factor=None) -> np.ndarray:
    """Error-feedback levels (int32, w's shape) of a weight w with symmetric blocked scales
    (forms.quantize_blocks: blocks of `block` along `axis`, which must be the K inputs); h: the
    (K, K) Hessian of its inputs (collect_hessians).

    A 2-D weight is blocked along 0 (MatMul, (K, N)) or 1 (Gemm transB, (N, K)). A Conv weight
    (O, C, k...) is blocked along its input channels (axis 1): its K inputs are the im2col patch
    entries in (C, k...) order, and a block is `block` consecutive channels at one kernel tap, so
    each input row takes the scale of its (channel block, tap) for each output channel. Measured
    on open_nsfw (every Conv weight error-fed, damp 0.01; order-0 bits/weight with the scales :
    centred-logit SNR on calibration / held-out feeds): per channel int6 5.03 : 28.9/13.3 dB, int7
    5.98 : 39.1/20.4; blocks of 64 int6 5.57 : 30.7/15.6, int7 6.57 : 39.1/20.8; blocks of 32 int6
    5.85 : 34.5/16.0. Per channel is ahead at equal bits on these Conv weights, so the auto mode
    does not offer this form for them (MatMul/Gemm weights: see auto.BLOCKED_BITS)."""
    qmax = (1 << (bits - 1)) - 1
    if w.ndim >= 3:
        if axis % w.ndim != 1:
            raise InvalidArgumentError(f"blocked error feedback of a Conv weight {w.shape} takes blocks along "
                                       f"its input channels (axis 1), got axis {axis}")
        rows = conv_block_scales(np.asarray(scale, np.float64), w.shape, block)
        lv = gptq_levels(w.reshape(w.shape[0], -1).T, h, rows, -qmax, qmax, damp=damp, factor=factor, block_size=1)
        return lv.T.reshape(w.shape)
    if w.ndim != 2 or axis not in (0, 1):
        raise InvalidArgumentError(f"blocked error feedback takes a 2-D weight blocked along 0 or 1, got {w.shape} axis {axis}")
    mat = w if axis == 0 else w.T
    s = blocked_matrix_scale(np.asarray(scale, np.float64), axis)
    lv = gptq_levels(mat, h, s, -qmax, qmax, damp=damp, factor=factor, block_size=block)
    return lv if axis == 0 else lv.T


def conv_block_scales(scale: np.ndarray, shape: tuple, block: int) -> np.ndarray:
    """A Conv weight's blocked scale (forms.block_scale_shape layout along axis 1: (O, C/block, 1,
    k...)) as one scale per (K input, output channel): (C*prod(k), O), the inputs in im2col order."""
    o, c = shape[0], shape[1]
    if c % block or tuple(scale.shape) != (o, c // block, 1) + tuple(shape[2:]):
        raise InvalidArgumentError(f"scale {scale.shape} is not the blocked layout of a Conv weight {tuple(shape)} "
                                   f"in blocks of {block} input channels")
    full = np.broadcast_to(scale, (o, c // block, block) + tuple(shape[2:])).reshape(o, -1)
    return np.ascontiguousarray(full.T)
