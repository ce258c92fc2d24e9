"""Palettization: a weight becomes an n-bit index tensor plus a look-up table (k-means).

    p = palettize(model, bits=4)                  # one table of 16 values per tensor
    p = palettize(model, bits=4, group_rows=8)    # one table per 8 rows along axis 0
    f = fold_palettes(p)                          # float weights back, bit-exact

Graph form (standard ONNX, any opset >= 13; onnxruntime runs it):
    W_palette_indices  uint8, W's shape; value = group * 2**bits + index
    W_palette          W's float type, (groups * 2**bits,)
    Cast(W_palette_indices -> int32) -> W_palette_idx
    Gather(W_palette, W_palette_idx, axis=0) -> W          (consumers untouched)
The table is learned by Lloyd's k-means on the values (seeded at quantiles and evenly over the
range), per tensor or per group of `group_rows` rows along axis 0 (a Conv's output channels; the
input rows K of a MatMul weight [K, N]); groups * 2**bits must fit in the uint8 indices.
In the pack, indices entropy-code to about their entropy; a palette pays off against uniform
levels when the value distribution is far from uniform at low bit widths.

fold_palettes materialises the pattern (the fold pass of passes.fold works node by node on
constant inputs, so the Cast -> Gather chain is folded here in one step).
"""
from __future__ import annotations

import fnmatch

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import dedupe as _dedupe
from . import graph
from ._fileio import load_model
from .errors import InvalidArgumentError
from .report import Report, TensorChange

SUFFIX_INDICES = "_palette_indices"
SUFFIX_TABLE = "_palette"


def kmeans_1d(values: np.ndarray, k: int, iters: int = 20) -> np.ndarray:
    """Sorted centroids (k or fewer distinct) of 1-D values minimising squared error (Lloyd);
    vectorised: assignments by searchsorted on the midpoints of the sorted centroids."""
    v = np.sort(values.astype(np.float64).ravel())
    if v.size == 0:
        return np.zeros(1)
    uniq = np.unique(v)
    if uniq.size <= k:
        return uniq
    csum = np.concatenate([[0.0], np.cumsum(v)])
    # two seedings, the smaller squared error kept: quantiles only (the dense centre), and half at
    # quantiles, half evenly over [min, max] (the tails). Quantile seeds alone left the few large
    # weights of a heavy-tailed tensor to share one centroid far from them, a local minimum Lloyd
    # does not leave: 8-bit tables reached 17-33 dB of weight SNR on real models (silero VAD,
    # PP-LCNet, YOLOv8, magika), below int8's uniform levels; with range seeds 34-48 dB, and
    # 4-bit tables gain 0.5-6 dB. But beside one far outlier most range seeds start in its empty
    # gap: a 16-entry table lost 1.6-2.7 dB against quantile seeds alone, hence both.
    n_q = k - k // 2
    mixed = np.concatenate([np.quantile(v, (np.arange(n_q) + 0.5) / n_q), np.linspace(v[0], v[-1], k // 2)])
    runs = [_lloyd(v, csum, seeds, iters) for seeds in (np.quantile(v, (np.arange(k) + 0.5) / k), mixed)]
    return min(runs, key=lambda c: _squared_error(v, c))


def _lloyd(v: np.ndarray, csum: np.ndarray, c: np.ndarray, iters: int) -> np.ndarray:
    """Lloyd's iterations on sorted v (csum: its prefix sums) from seeds c. A centroid left with
    no value (a seed in a gap) is moved to the values the others serve worst: Lloyd alone never
    moves it, and the table entry would be wasted (a Gaussian at 256 entries used 237)."""
    for _ in range(iters):
        c = np.unique(c)
        edges = np.searchsorted(v, (c[1:] + c[:-1]) / 2)
        lo = np.concatenate([[0], edges])
        hi = np.concatenate([edges, [v.size]])
        n = hi - lo
        ok = n > 0
        new = c.copy()
        new[ok] = (csum[hi[ok]] - csum[lo[ok]]) / n[ok]
        empty = int(np.count_nonzero(~ok))
        if empty:
            err = (v - np.repeat(new[ok], n[ok])) ** 2
            new[~ok] = v[np.argpartition(err, -empty)[-empty:]]
        if np.array_equal(new, c):
            break
        c = new
    return np.unique(c)


def _squared_error(v: np.ndarray, c: np.ndarray) -> float:
    idx = np.searchsorted((c[1:] + c[:-1]) / 2, v)
    return float(np.sum((v - c[idx]) ** 2))


def _palette_nbytes(t: onnx.TensorProto, bits: int, group_rows: int | None) -> int:
    """Bytes of a palettized float tensor: its uint8 indices and its tables (one per group of rows);
    a tiny weight (a [1, 1] one: 4 bytes -> 65) would grow."""
    n = int(np.prod(t.dims))
    rows = int(t.dims[0])
    n_groups = -(-rows // int(group_rows)) if group_rows else 1
    if n_groups << int(bits) > 256:  # refused as palette_array does, whatever the size
        raise InvalidArgumentError(f"palette: {n_groups} groups x {1 << int(bits)} entries do not fit uint8 indices; "
                                   "use larger group_rows or fewer bits")
    return n + n_groups * (1 << int(bits)) * np.dtype(graph.NUMPY_TYPES[t.data_type]).itemsize


def palette_array(w: np.ndarray, bits: int, group_rows: int | None):
    """(indices uint8 with group offsets, flat table float64, number of groups)."""
    k = 1 << bits
    rows = w.reshape(w.shape[0], -1) if w.ndim > 1 else w.reshape(1, -1)
    gr = rows.shape[0] if not group_rows else int(group_rows)
    n_groups = -(-rows.shape[0] // gr)
    if n_groups * k > 256:
        raise InvalidArgumentError(f"palette: {n_groups} groups x {k} entries do not fit uint8 indices; "
                                   "use larger group_rows or fewer bits")
    table = np.zeros(n_groups * k)
    idx = np.empty(rows.shape, np.uint8)
    for g in range(n_groups):  # one k-means per group (a handful), vectorised inside
        part = rows[g * gr:(g + 1) * gr]
        c = kmeans_1d(part, k)
        table[g * k:g * k + c.size] = c
        table[g * k + c.size:(g + 1) * k] = c[-1]
        mid = (c[1:] + c[:-1]) / 2
        idx[g * gr:(g + 1) * gr] = (np.searchsorted(mid, part) + g * k).astype(np.uint8)
    return idx.reshape(w.shape), table, n_groups


def palettize(model, *, bits: int = 4, group_rows: int | None = None, min_elements: int = 1024,
              include=None, exclude=None, dedupe: bool = True, report: Report | None = None) -> onnx.ModelProto:
    """A new model whose float weights (>= 2-D, >= min_elements, not biases nor tensors read as
    exact values), initializers and Constant nodes of the main graph and of If/Loop/Scan bodies,
    are palettized in their own graph (see the module docstring), bits 1..8 per index. Tensors a
    quantized op reads (DequantizeLinear scales, MatMulNBits, QLinear*) stay as they are (a note).
    include/exclude: patterns as quantize_weights takes them (an op type's name selects the
    tensors that op reads, any other pattern matches names with fnmatch). group_rows: one table per
    that many rows along axis 0. Weights inside model-local functions stay float (a note).
    dedupe: byte-identical weights palettize treats alike get one table and one index tensor
    (passes.dedupe; the report names each merge).
    Returns the new model. Raises InvalidModelError for a model that is not valid ONNX
    (graph.refuse_invalid names the problem), InvalidArgumentError for bad options (also when
    groups x 2**bits do not fit the uint8 indices)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise InvalidArgumentError(f"palette bits must be an integer from 1 to 8, got {bits!r}")
    if group_rows is not None and (isinstance(group_rows, bool) or not isinstance(group_rows, (int, np.integer))
                                   or group_rows < 1):
        raise InvalidArgumentError(f"group_rows must be a positive integer, got {group_rows!r}")
    inc = [include] if isinstance(include, str) else list(include or [])
    exc = [exclude] if isinstance(exclude, str) else list(exclude or [])
    src = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    graph.unshadow_initializers(out)  # a subgraph table named like an outer tensor would break SSA
    if report is not None:
        report.pass_name = report.pass_name or "palettize"
    # as quantize_weights does (an IR 3 model lists every initializer as a graph input because it
    # must, not to make it overridable; left listed, none of them would be palettized, without a word)
    graph.standard_form(out, report, rewritten="palettized")
    graph.refuse_invalid(out)  # an input the checker refuses: the output would be refused too
    if dedupe:
        _store_duplicates_once(out, inc, exc, report)
    # children before parents: rewriting a graph's node list copies the subgraphs inside it
    infos = graph.iter_graphs(out)
    hoisted = sum(_hoist_constants(info.graph, min_elements) for info in reversed(infos))
    if hoisted and report is not None:
        report.note(f"{hoisted} Constant node weight(s) became initializers of their graph to be palettized")
    nested = _function_weights(out, min_elements)
    if nested and report is not None:
        report.note(f"{nested} float weight(s) inside model-local functions stay float")
    from .quantize import attribute_weights_note

    attrs = attribute_weights_note(out, min_elements) if report is not None else None
    if attrs:
        report.note(attrs)
    # uses resolved by scope (a main-graph weight may be read only inside an If branch: silero
    # VAD's are), read as plain facts now: the graphs are rewritten below
    from .quantize import _exact_use

    infos = graph.iter_graphs(out)
    weights = [w for w in graph.find_weights(out)[0] if w.node is None]
    consumers = {(w.graph_key, w.name): [(u.node.op_type, u.index) for u in w.uses] for w in weights}
    exact = {(w.graph_key, w.name) for w in weights if _exact_use(w)}  # indices, masks: no weights
    if report is not None:
        listed = sum(1 for info in infos for t in info.graph.initializer
                     if t.name in {i.name for i in info.graph.input} and t.data_type in graph.FLOAT_TYPES
                     and len(t.dims) >= 2 and int(np.prod(t.dims)) >= min_elements)
        if listed:
            report.note(f"{listed} float weight(s) also listed as graph inputs (overridable by the caller) stay float")
    names = graph.NameAllocator(graph.all_names(out))
    from .quantize import _op_types

    ops = _op_types() if inc or exc else frozenset()  # (op names let patterns name op types)
    quantized_inputs = 0
    for info in reversed(infos):
        quantized_inputs += _palettize_graph(info, consumers, exact, names, bits, group_rows, min_elements, inc, exc,
                                             report, ops)
    if quantized_inputs and report is not None:
        report.note(f"{quantized_inputs} float tensor(s) read by quantized operators (DequantizeLinear scales, "
                    "MatMulNBits, QLinear*: parameters, not weights) stay as they are")
    if out.ir_version < 4 and any(t.name not in {i.name for i in gi.graph.input}
                                  for gi in graph.iter_graphs(out) for t in gi.graph.initializer):
        # IR 3 wants every initializer listed as a graph input (its checker refuses the tables,
        # indices and hoisted Constants otherwise); IR 4 does not, and keeps the listed ones as they were
        if report is not None:
            report.note(f"IR version raised from {out.ir_version} to 4: the new initializers are not graph inputs")
        out.ir_version = 4
    graph.drop_stale_training_info(out, "palettized", report)
    return out


def _store_duplicates_once(out: onnx.ModelProto, inc: list, exc: list, report: Report | None) -> list:
    """Byte-identical weights that palettize would treat alike (the same include / exclude match,
    bias, exact-value and quantized-op readers) merged into one, in place (passes.dedupe): a weight
    stored twice gets one table and one index tensor. Returns the merges (each reported)."""
    from .quantize import _QUANTIZED_OPS, _exact_use, _op_types

    ops = _op_types() if inc or exc else frozenset()
    weights, _ = graph.find_weights(out)
    by_name: dict[str, list[graph.Weight]] = {}
    for w in weights:
        by_name.setdefault(w.name, []).append(w)

    def treated(name: str):
        found = by_name.get(name, [])
        if len(found) != 1:
            return None
        w = found[0]
        uses = [(u.node.op_type, u.index) for u in w.uses]
        return (bool(uses), bool(uses) and all(i == 2 and op in ("Conv", "Gemm", "ConvTranspose") for op, i in uses),
                bool(_exact_use(w)), any(op in _QUANTIZED_OPS for op, _ in uses),
                _named(name, uses, inc, ops) if inc else None, _named(name, uses, exc, ops))

    def accept(dropped: str, kept: str) -> bool:
        return treated(dropped) is not None and treated(dropped) == treated(kept)

    merges = _dedupe.find_duplicates(out, accept=accept)
    if merges:
        _dedupe.apply_merges(out, merges)
        _dedupe.report_merges(merges, report)
    return merges


def _palettize_graph(info: graph.GraphInfo, consumers, exact, names, bits, group_rows, min_elements, inc, exc,
                     report, ops=frozenset()) -> int:
    """Palettize the chosen initializers of one graph in place (its nodes go first); returns how
    many it kept because a quantized op reads them."""
    from .quantize import _QUANTIZED_OPS

    g = info.graph
    graph_inputs = {i.name for i in g.input}
    new_nodes, keep_inits = [], []
    quantized_inputs = 0
    for t in g.initializer:
        uses = consumers.get((info.key, t.name), [])
        n = int(np.prod(t.dims)) if t.dims else 1
        bias = uses and all(i == 2 and op in ("Conv", "Gemm", "ConvTranspose") for op, i in uses)
        chosen = (t.data_type in graph.FLOAT_TYPES and len(t.dims) >= 2 and n >= max(min_elements, 1) and uses
                  and not bias and t.name not in graph_inputs and (info.key, t.name) not in exact
                  and (not inc or _named(t.name, uses, inc, ops))
                  and not _named(t.name, uses, exc, ops))
        # a quantized op's float inputs are its parameters (a blocked DequantizeLinear's [blocks, N]
        # scales, MatMulNBits' scales): a palette of them moved every weight they scale (a
        # 4-bit palette of blocked scales took a model from 42.4 to 25.2 dB), as quantize keeps them
        if chosen and any(op in _QUANTIZED_OPS for op, _ in uses):
            quantized_inputs += 1
            chosen = False
        if not chosen or _palette_nbytes(t, bits, group_rows) >= graph.tensor_nbytes(t):
            keep_inits.append(t)
            continue
        w = graph.tensor_to_array(t)
        if not np.isfinite(w).all():
            keep_inits.append(t)
            continue
        idx, table, n_groups = palette_array(w.astype(np.float64), int(bits), group_rows)
        table_typed = table.astype(w.dtype)
        i_name = names.take(t.name + SUFFIX_INDICES)
        t_name = names.take(t.name + SUFFIX_TABLE)
        c_name = names.take(t.name + "_palette_idx")
        keep_inits.append(graph.array_to_tensor(idx, i_name, TensorProto.UINT8))
        keep_inits.append(graph.array_to_tensor(table_typed, t_name, t.data_type))
        new_nodes.append(helper.make_node("Cast", [i_name], [c_name], name=names.take(t.name + "_palette_Cast"),
                                          to=TensorProto.INT32))
        new_nodes.append(helper.make_node("Gather", [t_name, c_name], [t.name], axis=0,
                                          name=names.take(t.name + "_palette_Gather")))
        if report is not None:
            w_hat = table_typed[idx.astype(np.int64)]
            err = float(np.sum((w.astype(np.float64) - w_hat.astype(np.float64)) ** 2))
            sig = float(np.sum(w.astype(np.float64) ** 2))
            snr = 200.0 if err == 0 else (round(10 * np.log10(sig / err), 3) if sig > 0 else -200.0)
            report.add(TensorChange(t.name, tuple(w.shape), graph.type_name(t.data_type),
                                    f"palette{bits}" + (f"/group{group_rows}" if group_rows else "/tensor"),
                                    w.nbytes, idx.nbytes + table_typed.nbytes, snr,
                                    info.location + (": " if info.location else "") + "initializer"))
    if not new_nodes:
        return quantized_inputs
    del g.initializer[:]
    g.initializer.extend(keep_inits)
    old = list(g.node)
    del g.node[:]
    g.node.extend(new_nodes + old)
    return quantized_inputs


def _named(name: str, uses, patterns: list[str], ops) -> bool:
    """Whether a pattern names the tensor (fnmatch on its name) or, being an op type's name
    ("MatMul"), an op reading it: quantize_weights' include / exclude rule."""
    from .quantize import _QUANTIZED_OPS

    readers = {op for op, _ in uses}
    return any(p in readers if (p in ops or p in _QUANTIZED_OPS) else fnmatch.fnmatchcase(name, p)
               for p in patterns)


def _dense_float_constant(node: onnx.NodeProto, min_elements: int) -> onnx.TensorProto | None:
    """The `value` tensor of a Constant node when it is a float weight palettize would consider."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    a = node.attribute[0]
    if a.name != "value" or a.t.data_type not in graph.FLOAT_TYPES or len(a.t.dims) < 2:
        return None
    return a.t if int(np.prod(a.t.dims)) >= min_elements else None


def _hoist_constants(g: onnx.GraphProto, min_elements: int) -> int:
    """Move the large float Constant-node weights of graph `g` (the main graph or a subgraph)
    into initializers named like the node's output (the same values, visible to the same nodes:
    initializers are in scope everywhere in the graph). Exporters such as paddle2onnx keep every weight in a Constant."""
    taken = {t.name for t in g.initializer} | {i.name for i in g.input}
    keep, moved = [], []
    for node in g.node:
        t = _dense_float_constant(node, min_elements)
        if t is None or not node.output or node.output[0] in taken:
            keep.append(node)
            continue
        init = onnx.TensorProto()
        init.CopyFrom(t)
        init.name = node.output[0]
        moved.append(init)
    if moved:
        del g.node[:]
        g.node.extend(keep)
        g.initializer.extend(moved)
    return len(moved)


def _function_weights(model: onnx.ModelProto, min_elements: int) -> int:
    """Float Constant-node weights inside model-local function bodies (palettize leaves them)."""
    return sum(_dense_float_constant(node, min_elements) is not None for fn in model.functions for node in fn.node)


def has_palettes(model: onnx.ModelProto) -> bool:
    """Whether any graph holds a Gather whose indices come from a Cast (cheap check)."""
    for info in graph.iter_graphs(model):
        nodes = info.graph.node
        casts = {n.output[0] for n in nodes if n.op_type == "Cast" and n.output}
        if any(n.op_type == "Gather" and len(n.input) == 2 and n.input[1] in casts for n in nodes):
            return True
    return False


def fold_palettes(model, *, report: Report | None = None) -> onnx.ModelProto:
    """Materialise every palette pattern (Cast of constant uint8 indices -> Gather on a constant
    table, both initializers of the Gather's graph) as a float initializer of that graph named
    like the Gather's output; the values are exactly table[indices], what onnxruntime computes.
    Returns a new model (a copy also when there is nothing to fold, never the caller's object)."""
    src = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)  # also with nothing to fold: the result is the caller's to change (onnx's external-data save does)
    if not has_palettes(src):
        return out
    # a table or index tensor still read elsewhere (any graph, or as a graph output) stays
    read_anywhere = graph.read_counts(out)
    for info in reversed(graph.iter_graphs(out)):  # children first: rewriting a graph copies its subgraphs
        _fold_graph_palettes(info, read_anywhere, report)
    return out


def _fold_graph_palettes(info: graph.GraphInfo, read_anywhere: dict[str, int], report) -> None:
    g = info.graph
    inits = {t.name: t for t in g.initializer}
    cast_of = {n.output[0]: n for n in g.node if n.op_type == "Cast" and n.input and n.input[0] in inits}
    drop_nodes, drop_inits, added = set(), {}, []
    for node in g.node:
        if node.op_type != "Gather" or len(node.input) != 2:
            continue
        table_name, idx_name = node.input
        cast = cast_of.get(idx_name)
        if table_name not in inits or cast is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        table_t, idx_t = inits[table_name], inits[cast.input[0]]
        if axis != 0 or len(table_t.dims) != 1 or idx_t.data_type not in (TensorProto.UINT8, TensorProto.INT8):
            continue
        table = graph.tensor_to_array(table_t)
        idx = graph.tensor_to_array(idx_t).astype(np.int64)
        if idx.size and (idx.min() < -table.size or idx.max() >= table.size):
            continue  # onnxruntime would refuse; leave it to fail there
        value = table[idx]
        added.append(graph.array_to_tensor(value, node.output[0], table_t.data_type))
        drop_nodes |= {node.output[0], cast.output[0]}  # by output name: wrapper ids are not stable
        for name in (table_name, cast.input[0]):
            drop_inits[name] = drop_inits.get(name, 0) + 1  # reads this fold removes
        if report is not None:
            report.add(TensorChange(node.output[0], tuple(value.shape), graph.type_name(table_t.data_type),
                                    "folded palette", graph.tensor_nbytes(idx_t) + graph.tensor_nbytes(table_t),
                                    value.nbytes, None))
    if not added:
        return
    keep = [t for t in g.initializer if t.name not in drop_inits or read_anywhere.get(t.name, 0) > drop_inits[t.name]]
    nodes = [n for n in g.node if not (n.output and n.output[0] in drop_nodes)]
    del g.initializer[:]
    g.initializer.extend(keep + added)
    del g.node[:]
    g.node.extend(nodes)
