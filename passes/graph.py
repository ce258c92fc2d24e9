"""Finding weights in an ONNX model and the facts the passes need about them.

Weights live in three places: graph initializers, `Constant` nodes, and both of those inside the
subgraphs of `If` / `Loop` / `Scan`. This module walks all of them, resolves which nodes consume a
weight (respecting subgraph scoping), picks the axis that matters for each consumer, sorts graphs
topologically, and raises the default-domain opset.

Why plain protobuf editing and not onnx-graphsurgeon: a `gs.import_onnx` / `gs.export_onnx` round
trip (onnx-graphsurgeon 0.6.1) drops the model's doc_string and metadata_props, drops part of
graph.value_info (355 -> 236 entries on minilm_fp32) and reorders initializers. The passes only
replace a tensor by a few tensors plus one node, which is simpler and exact on the proto itself.
"""
from __future__ import annotations

import ast
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto

from .errors import InvalidModelError, LimitExceededError, UnsupportedFormError

FLOAT_TYPES = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}
# element type -> numpy dtype for raw_data views (int4 types are unpacked separately)
NUMPY_TYPES = {
    **FLOAT_TYPES,
    TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.UINT64: np.dtype(np.uint64),
    TensorProto.BOOL: np.dtype(np.bool_),
}
INT4_TYPES = {TensorProto.INT4: np.dtype(np.int8), TensorProto.UINT4: np.dtype(np.uint8)}


def type_name(elem_type: int) -> str:
    """numpy-style name of an ONNX element type: float32, float16, bfloat16, int8, int4, ..."""
    special = {TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64"}
    return special.get(elem_type) or TensorProto.DataType.Name(elem_type).lower()


# ---------------------------------------------------------------------------------------------
# tensors <-> arrays


def tensor_to_array(t: TensorProto) -> np.ndarray:
    """The values of a TensorProto as a numpy array (read-only view of raw_data when possible)."""
    if t.data_location == TensorProto.EXTERNAL:
        raise InvalidModelError(f"tensor {t.name!r} has its data in an external file that was not loaded")
    shape = tuple(t.dims)
    if t.data_type in INT4_TYPES:
        n = int(np.prod(shape, dtype=np.int64))
        if t.HasField("raw_data"):
            packed = np.frombuffer(t.raw_data, dtype=np.uint8)
        else:  # int4 in int32_data: one packed byte per int32 entry
            packed = np.asarray(t.int32_data, dtype=np.int32).astype(np.uint8)
        if packed.size != (n + 1) // 2:  # a damaged file: sizes checked before unpacking
            raise InvalidModelError(f"tensor {t.name!r}: {packed.size} bytes of 4-bit values, dims say {shape}")
        return unpack_int4(packed, n, signed=t.data_type == TensorProto.INT4).reshape(shape)
    dtype = NUMPY_TYPES.get(t.data_type)
    if dtype is not None and t.HasField("raw_data"):
        arr = np.frombuffer(t.raw_data, dtype=dtype.newbyteorder("<"))
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise InvalidModelError(f"tensor {t.name!r}: raw_data holds {arr.size} values, dims say {shape}")
        return arr.reshape(shape)
    if t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        bits = np.asarray(t.int32_data, dtype=np.int32).astype(np.uint16)
        if bits.size != int(np.prod(shape, dtype=np.int64)):
            raise InvalidModelError(f"tensor {t.name!r}: int32_data holds {bits.size} values, dims say {shape}")
        return bits.view(NUMPY_TYPES[t.data_type]).reshape(shape)
    try:
        return onnx.numpy_helper.to_array(t)
    except Exception as exc:  # noqa: BLE001 - unknown type codes, sizes that disagree, bad strings
        raise InvalidModelError(
            f"tensor {t.name!r}: cannot read its data as {type_name(t.data_type) if t.data_type in TensorProto.DataType.values() else t.data_type} ({type(exc).__name__})"
        ) from None


def array_to_tensor(arr: np.ndarray, name: str, elem_type: int) -> TensorProto:
    """A TensorProto holding `arr` as `elem_type`, always in raw_data (int4 packed two per byte)."""
    return fill_tensor(TensorProto(), arr, name, elem_type)


def tensor_nbytes(t: TensorProto) -> int:
    """Payload bytes of a tensor without copying raw_data out of the proto."""
    n = int(np.prod(t.dims, dtype=np.int64))
    if t.data_type in INT4_TYPES:
        return (n + 1) // 2
    dtype = NUMPY_TYPES.get(t.data_type)
    return n * dtype.itemsize if dtype is not None else t.ByteSize()


def array_nbytes(arr: np.ndarray, elem_type: int) -> int:
    """Payload bytes `fill_tensor` will store for `arr` as `elem_type`."""
    if elem_type in INT4_TYPES:
        return (arr.size + 1) // 2
    return arr.size * NUMPY_TYPES[elem_type].itemsize


def fill_tensor(t: TensorProto, arr: np.ndarray, name: str, elem_type: int) -> TensorProto:
    """Fill an empty TensorProto (e.g. `graph.initializer.add()`) with `arr` as raw_data."""
    t.name = name
    t.data_type = elem_type
    t.dims.extend(int(d) for d in arr.shape)
    if elem_type in INT4_TYPES:
        t.raw_data = pack_int4(arr).tobytes()
    else:
        t.raw_data = np.ascontiguousarray(arr, dtype=NUMPY_TYPES[elem_type].newbyteorder("<")).tobytes()
    return t


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte, first value in the low nibble (the ONNX layout)."""
    flat = values.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: np.ndarray, n: int, signed: bool) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.int8 if signed else np.uint8)
    if signed:
        p = packed.view(np.int8)
        out[0::2] = np.left_shift(p, 4) >> 4  # arithmetic shift sign-extends the low nibble
        out[1::2] = p >> 4
    else:
        out[0::2] = packed & 0x0F
        out[1::2] = packed >> 4
    return out[:n]


# ---------------------------------------------------------------------------------------------
# copies that leave payloads behind


def _copy_field(dst, fd, value) -> None:
    if fd.is_repeated:
        target = getattr(dst, fd.name)
        if fd.type == fd.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif fd.type == fd.TYPE_MESSAGE:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


def unique_initializers(model: onnx.ModelProto) -> dict[str, TensorProto]:
    """Main-graph initializers by name, leaving out names that occur more than once."""
    seen: dict[str, TensorProto] = {}
    repeated: set[str] = set()
    for t in model.graph.initializer:
        if t.name in seen:
            repeated.add(t.name)
        seen[t.name] = t
    return {k: v for k, v in seen.items() if k not in repeated}


def refuses_bad_text(fn):
    """Decorator of the passes: a text field of the model that is not UTF-8 (protobuf parses it;
    reading or copying it raises) is an InvalidModelError, wherever the pass meets it."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UnicodeError as exc:
            raise InvalidModelError(f"the model holds a text field that is not UTF-8 ({exc})") from None

    return wrapper


def copy_model(model: onnx.ModelProto, without_payload=()) -> onnx.ModelProto:
    """A copy of `model` in which the main-graph initializers named in `without_payload` keep
    everything but their raw_data.

    A pass that replaces most weights of a multi-GB model would otherwise copy every payload
    (ModelProto.CopyFrom) only to delete it again: the copy costs time and doubles peak memory.
    """
    try:
        return _copy_model(model, without_payload)
    except UnicodeDecodeError as exc:  # protobuf parses such strings; reading one raises
        raise InvalidModelError(f"the model holds a text field that is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _copy_model(model: onnx.ModelProto, without_payload) -> onnx.ModelProto:
    out = onnx.ModelProto()
    if not without_payload:
        out.CopyFrom(model)
        return out
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(out, fd, value)
    if not model.HasField("graph"):
        return out
    out.graph.SetInParent()
    for fd, value in model.graph.ListFields():
        if fd.name != "initializer":
            _copy_field(out.graph, fd, value)
    for t in model.graph.initializer:
        c = out.graph.initializer.add()
        if t.name in without_payload:
            # field by field: ListFields() would read (copy) raw_data out of the tensor
            for fd in t.DESCRIPTOR.fields:
                if fd.name == "raw_data":
                    continue
                value = getattr(t, fd.name)
                if (len(value) if fd.is_repeated else t.HasField(fd.name)):
                    _copy_field(c, fd, value)
        else:
            c.CopyFrom(t)
    return out


# a sparse tensor stored dense is refused above this many bytes: its dims are the file's word (a
# few bytes of indices can declare terabytes: np.zeros then fails, or within the overcommit limit
# fill_tensor touches every page), and a dense initializer past protobuf's 2 GiB could not be
# written back inline anyway
SPARSE_DENSE_MAX_BYTES = 1 << 31


def sparse_to_array(sparse: onnx.SparseTensorProto) -> np.ndarray:
    """The dense values of a SparseTensorProto: zeros except at its indices (flat [NNZ] positions
    or [NNZ, rank] coordinates, as the ONNX spec allows both). InvalidModelError for dims or
    indices that do not describe a tensor, LimitExceededError above SPARSE_DENSE_MAX_BYTES dense."""
    name = sparse.values.name
    dims = tuple(int(d) for d in sparse.dims)
    if any(d < 0 for d in dims):
        raise InvalidModelError(f"sparse tensor {name!r}: negative dimension in {dims}")
    values = tensor_to_array(sparse.values).reshape(-1)
    size = math.prod(dims)  # (Python integers: numpy's int64 product wraps for hostile dims)
    if size * values.dtype.itemsize > SPARSE_DENSE_MAX_BYTES or any(d > SPARSE_DENSE_MAX_BYTES for d in dims):
        raise LimitExceededError(f"sparse tensor {name!r}: dims {dims} take {size * values.dtype.itemsize:,} bytes "
                                 f"dense, more than {SPARSE_DENSE_MAX_BYTES:,}")
    indices = tensor_to_array(sparse.indices) if sparse.HasField("indices") else np.zeros((0,), np.int64)
    if indices.dtype.kind not in "iu":
        raise InvalidModelError(f"sparse tensor {name!r}: indices of type {indices.dtype} (integers expected)")
    indices = indices.astype(np.int64, copy=False)
    if indices.ndim == 2 and indices.shape == (values.size, len(dims)):
        if values.size and ((indices < 0).any() or (indices >= np.asarray(dims)).any()):
            raise InvalidModelError(f"sparse tensor {name!r}: an index lies outside dims {dims}")
        flat = np.ravel_multi_index(tuple(indices.T), dims) if values.size else indices.reshape(-1)
    elif indices.ndim == 1 and indices.size == values.size:
        if values.size and (indices.min() < 0 or indices.max() >= size):
            raise InvalidModelError(f"sparse tensor {sparse.values.name!r}: an index lies outside dims {dims}")
        flat = indices
    else:
        raise InvalidModelError(f"sparse tensor {sparse.values.name!r}: indices of shape {indices.shape} "
                                f"do not match {values.size} values of a {len(dims)}-D tensor")
    dense = np.zeros(size, dtype=values.dtype)
    dense[flat] = values
    return dense.reshape(dims)


def unlist_ir3_initializers(model: onnx.ModelProto) -> bool:
    """IR 3 made every initializer a graph input as well; IR 4 made that mean "overridable by the
    caller", which a weight being replaced by DequantizeLinear cannot be. The inputs that only
    list an initializer of an IR 3 model leave the graph's inputs (in place), the IR becomes 4.
    True when any was removed."""
    inits = {t.name for t in model.graph.initializer}
    keep = [v for v in model.graph.input if v.name not in inits]
    removed = len(keep) != len(model.graph.input)
    if removed:
        del model.graph.input[:]
        model.graph.input.extend(keep)
        model.ir_version = 4
    return removed


def unlist_initializers(model: onnx.ModelProto, names) -> list[str]:
    """The main graph's inputs that only list one of the initializers `names` leave the graph's
    inputs (in place): from IR 4 such a listing makes the weight overridable by a feed, and a weight
    replaced by a DequantizeLinear output can be no input. Returns the names unlisted, in input order."""
    wanted = set(names) & {t.name for t in model.graph.initializer}
    gone = [v.name for v in model.graph.input if v.name in wanted]
    if gone:
        keep = [v for v in model.graph.input if v.name not in wanted]
        del model.graph.input[:]
        model.graph.input.extend(keep)
    return gone


def standard_form(model: onnx.ModelProto, report=None, *, rewritten: str | None = None, ir3: bool = True) -> None:
    """Put a pass's own copy of a model in the form its rewrite and onnx.checker need, in place, with
    a note on `report` for each change: sparse initializers stored dense, (ir3) IR 3 initializers no
    longer listed as graph inputs, nodes in topological order. `rewritten`: what the pass does to
    dense weights ("quantized", "palettized"), said in the note on sparse ones."""
    ir = model.ir_version
    densified = densify_sparse_initializers(model)
    if densified and report is not None:
        why = f", and only dense weights are {rewritten}" if rewritten else ""
        report.note(f"{densified} sparse initializer(s) stored dense (the same values; onnx.checker refuses standard "
                    f"ops fed by a sparse tensor{why})")
    if ir3 and ir < 4 and unlist_ir3_initializers(model) and report is not None:
        report.note(f"IR version raised from {ir} to 4: initializers are no longer listed as graph inputs (IR 3 "
                    "required it; from IR 4 it would make them overridable and keep them float)")
    # onnxruntime runs graphs whose nodes are out of order (a float16 converter appends its input
    # Casts after their readers); the checker does not, and every pass leaves a model it takes
    if toposort(model) and report is not None:
        report.note("nodes sorted topologically (the input graph was not)")
    added = import_used_custom_domains(model)
    if added and report is not None:
        report.note(f"opset import added for domain(s) {', '.join(repr(d) for d in added)} (version 1): nodes use "
                    "them without one (onnxruntime assumes version 1; onnx.checker requires the import)")
    completed = complete_output_declarations(model)
    if completed and report is not None:
        shown = ", ".join(repr(n) for n in completed[:3]) + (f" and {len(completed) - 3} more" if len(completed) > 3 else "")
        report.note(f"{len(completed)} graph output declaration(s) completed from shape inference ({shown}: a type or "
                    "shape missing, or a shape the graph does not produce; onnx.checker requires them right)")


# main-graph initializers above this many payload bytes are checked as typed graph inputs (their
# length checked here): the checker would otherwise serialize a copy of every weight. Tensors
# read as shapes, axes or indices are far smaller, so shape inference still sees their values.
_CHECK_STUB_BYTES = 4096


def refuse_invalid(model: onnx.ModelProto, payloads: dict[str, TensorProto] | None = None) -> None:
    """Raise InvalidModelError naming the problem when `model` -- a pass's own copy of its input,
    already in standard_form (the repairs a pass makes: nodes sorted, sparse initializers dense, IR 3
    initializers unlisted) -- fails onnx.checker (its structure), strict type and shape inference
    through its nodes, or imports a default-domain opset newer than onnx defines (onnxruntime
    refuses it; the checker does not say). Declarations onnxruntime reads as hints (graph outputs
    without a type or shape, value_info) are not judged: see below.

    Why up front: a pass writes what it is given plus its rewrite, so an input the checker refuses
    (a node reading an undefined name, two nodes writing one name, a graph output nothing writes, a
    weight whose raw_data is shorter than its dims) came out as an output that fails it too, and
    with nothing quantized it was written without a word. The user's problem is the input's.
    `payloads`: the original tensors of main-graph initializers the copy holds without their
    raw_data (quantize_weights copies the weights it replaces that way).

    The view checked costs no copy of the large weights (typed graph inputs in their place, their
    lengths checked here), so models of any size are checked in about the time of their graph."""
    payloads = payloads or {}
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > newest:
            raise InvalidModelError(f"the model imports opset {imp.version} of the default domain; the newest "
                                    f"there is (onnx {onnx.__version__}) is {newest}")
    defined = set(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}
    stubs = set()
    for t in model.graph.initializer:
        original = payloads.get(t.name, t)
        if t.data_type not in defined:  # (the checker says "Invalid tensor data type 29." without the name)
            raise InvalidModelError(f"the model is not valid ONNX: initializer {t.name!r} has data type "
                                    f"{t.data_type}, which ONNX does not define")
        if t.name in payloads or t.ByteSize() > _CHECK_STUB_BYTES:  # (ByteSize: no copy of the payload)
            _check_raw_length(original)
            stubs.add(t.name)
    view = payload_free_view(model, stubs)
    # (a custom domain used without an import runs in onnxruntime: not judged, whether or not the
    # caller went through standard_form, which adds it; the auto mode checks its input directly)
    import_used_custom_domains(view)
    # two checks, so that the declarations onnxruntime reads as hints only do not refuse a model it
    # runs (and the passes always took): a graph output declared without a type or shape (common in
    # hand-built and exported models alike) and declared shapes that inference contradicts
    # (standard_form has completed those it could: complete_output_declarations). First
    # the structure (names defined once and before use, outputs produced, opsets, attributes,
    # tensors) with such outputs given a placeholder type; then types and shapes through the nodes
    # by strict inference, with the graphs' value_info and output declarations left out.
    # (subgraph outputs keep their declarations for the second: an If's inference compares its
    # branches' declared output types)
    structure = copy_model(view)
    for info in iter_graphs(structure):
        for v in itertools.chain(info.graph.input, info.graph.output):
            if not v.type.HasField("tensor_type") and not v.type.ListFields():
                v.type.tensor_type.elem_type = TensorProto.FLOAT
            if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape"):
                v.type.tensor_type.shape.SetInParent()
    for info in iter_graphs(view):
        del info.graph.value_info[:]
    for v in view.graph.output:
        v.ClearField("type")
    try:
        onnx.checker.check_model(structure, full_check=False)
        onnx.shape_inference.infer_shapes(view, check_type=True, strict_mode=True)
    except ValueError as exc:
        if "2GB" in str(exc) or "2 GB" in str(exc):  # large Constant nodes: the pass's own checks only
            return
        raise InvalidModelError(f"the model is not valid ONNX: {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the checker raises several C++-bound types
        raise InvalidModelError(f"the model is not valid ONNX: {_first_line(exc)}") from None


def payload_free_view(model: onnx.ModelProto, stubs: set[str] | None = None) -> onnx.ModelProto:
    """A copy of `model` for onnx.checker and shape inference without the large weights: the
    main-graph initializers named in `stubs` (default: those above _CHECK_STUB_BYTES) become typed
    graph inputs of their type and dims (an IR 3 model's listed ones just lose the initializer).
    Both read only their dims; copying their payloads would cost a copy of the model."""
    if stubs is None:
        stubs = {t.name for t in model.graph.initializer if t.ByteSize() > _CHECK_STUB_BYTES}
    view = copy_model(model, stubs)
    g = view.graph
    listed = {v.name for v in g.input}
    typed = [t for t in g.initializer if t.name in stubs]
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name in stubs]):
        del g.initializer[i]
    for t in typed:
        if t.name not in listed:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return view


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _check_raw_length(t: TensorProto) -> None:
    """A raw_data payload must hold exactly what its dims and type say (the checker's own test,
    for the tensors refuse_invalid keeps out of its view)."""
    if t.data_location == TensorProto.EXTERNAL or not t.HasField("raw_data"):
        return
    if t.data_type not in NUMPY_TYPES and t.data_type not in INT4_TYPES:
        return
    want = tensor_nbytes(t)
    if len(t.raw_data) != want:
        raise InvalidModelError(f"the model is not valid ONNX: initializer {t.name!r} holds {len(t.raw_data):,} "
                                f"bytes of raw_data; its dims {list(t.dims)} and type {type_name(t.data_type)} "
                                f"need {want:,}")


def drop_stale_training_info(model: onnx.ModelProto, rewritten: str, report=None) -> int:
    """Drop, in place, each ModelProto.training_info entry whose initialization_binding or
    update_binding names a tensor that is no longer a main-graph initializer (the pass turned it
    into levels + DequantizeLinear, a palette, ...), with a note on `report`; returns how many.

    Why dropped and not kept: a binding assigns a training step's float result to an initializer,
    and the checker does not look. Left as it was, the entry pointed at a node output (the
    DequantizeLinear's): a trainer following it writes a float tensor over nothing, or over the
    int8 levels. Keeping the bound weights float instead would keep the recipe runnable but, as
    a training algorithm updates every weight, leave the model uncompressed without a word.
    A compressed model is for inference (onnxruntime ignores training_info); training goes on
    from the float original, and exclude= keeps named weights float where a user wants both.
    Entries whose bindings all still name initializers stay as they were."""
    if not model.training_info:
        return 0
    initializers = {t.name for t in model.graph.initializer}
    kept, dropped = [], []
    for ti in model.training_info:
        stale = sorted({b.key for b in itertools.chain(ti.initialization_binding, ti.update_binding)}
                       - initializers)
        (dropped if stale else kept).append((ti, stale))
    if not dropped:
        return 0
    stale_names = sorted({name for _, stale in dropped for name in stale})
    del model.training_info[:]
    model.training_info.extend(ti for ti, _ in kept)
    if report is not None:
        shown = ", ".join(repr(n) for n in stale_names[:3]) + (f" and {len(stale_names) - 3} more"
                                                                 if len(stale_names) > 3 else "")
        report.note(f"{len(dropped)} training_info entr{'y' if len(dropped) == 1 else 'ies'} dropped: "
                    f"{'its' if len(dropped) == 1 else 'their'} bindings name {shown}, {rewritten} (no longer a "
                    "float initializer a training step can assign); exclude them to keep it")
    return len(dropped)


# domains whose version a model must state (onnxruntime refuses or guesses otherwise): never added
_STANDARD_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training"}


def import_used_custom_domains(model: onnx.ModelProto) -> list[str]:
    """Add, in place, an opset import (version 1) for each non-standard domain that graph nodes use
    and the model does not import (com.microsoft's contrib ops, a custom-op library's domain);
    returns the domains added.

    Why: onnxruntime runs such a model (contrib and custom ops are registered at version 1), so
    exporters that forget the import go unnoticed; onnx.checker refuses it ("No opset import for
    domain"), so refuse_invalid would refuse a model that runs, and a pass copying it would write
    one the checker refuses. A standard domain missing its import is not guessed at."""
    imported = {o.domain for o in model.opset_import}
    used = []
    for info in iter_graphs(model):
        for node in info.graph.node:
            d = node.domain
            if d not in imported and d not in _STANDARD_DOMAINS and d not in used:
                used.append(d)
    for d in used:
        model.opset_import.add(domain=d, version=1)
    return used


def complete_output_declarations(model: onnx.ModelProto) -> list[str]:
    """Main-graph outputs declared without a tensor type or shape, or with a shape the graph does
    not produce, take what shape inference derives (in place; dims it cannot size left open);
    returns their names. Outputs inference knows nothing of stay as they were.

    Why: onnxruntime reads these declarations as hints and runs such models, so hand-built and
    exported ones have them (an output 'y' of type float with no shape), but onnx.checker requires a
    type and a shape on each graph output and refuses a shape inference contradicts: a pass that
    copied them wrote a model the checker refuses. refuse_invalid does not judge them; this
    repairs them, as standard_form sorts nodes."""
    def needs(o) -> bool:
        tt = o.type.tensor_type if o.type.HasField("tensor_type") else None
        if tt is None:
            return not o.type.ListFields()  # (sequence, map, optional types: left to their owner)
        return True  # (a declared shape, even a scalar's, may be one the graph does not produce)
    if not any(needs(o) for o in model.graph.output):
        return []
    probe = payload_free_view(model)
    for o in probe.graph.output:
        o.ClearField("type")
    del probe.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    except Exception:  # noqa: BLE001 - nothing to learn from a model inference refuses
        return []
    found = {o.name: o.type.tensor_type for o in inferred.graph.output
             if o.type.HasField("tensor_type") and o.type.tensor_type.elem_type}
    fixed = []
    for o in model.graph.output:
        derived = found.get(o.name)
        if derived is None or not needs(o):
            continue
        tt = o.type.tensor_type
        changed = False
        if tt.elem_type == 0:
            tt.elem_type = derived.elem_type
            changed = True
        if derived.HasField("shape"):
            declared = tt.shape.dim if tt.HasField("shape") else None
            clash = declared is not None and (len(declared) != len(derived.shape.dim) or any(
                a.HasField("dim_value") and b.HasField("dim_value") and a.dim_value != b.dim_value
                for a, b in zip(declared, derived.shape.dim)))
            if declared is None or clash:
                tt.shape.ClearField("dim")
                tt.shape.SetInParent()
                for b in derived.shape.dim:
                    d = tt.shape.dim.add()
                    if b.HasField("dim_value"):
                        d.dim_value = b.dim_value
                changed = True
        if changed:
            fixed.append(o.name)
    if fixed:
        keep = [v for v in model.graph.value_info if v.name not in fixed]
        del model.graph.value_info[:]
        model.graph.value_info.extend(keep)
    return fixed


def densify_sparse_initializers(model: onnx.ModelProto) -> int:
    """Turn every graph's sparse_initializer into a dense initializer of the same name, in place;
    returns how many. The values are the same, but the standard ops read them as plain tensors:
    onnxruntime densifies them as it loads, and onnx.checker's full check refuses a Conv or MatMul
    fed by one ("unsupported type: sparse_tensor(float)"), so a pass output holding one could never
    be checked, nor its weights quantized."""
    count = 0
    for info in iter_graphs(model):
        g = info.graph
        for sparse in g.sparse_initializer:
            dense = sparse_to_array(sparse)
            fill_tensor(g.initializer.add(), dense, sparse.values.name, sparse.values.data_type)
            count += 1
        del g.sparse_initializer[:]
    return count


# ---------------------------------------------------------------------------------------------
# walking graphs


@dataclass
class GraphInfo:
    graph: onnx.GraphProto
    key: int  # index in walk order; 0 is the main graph
    location: str  # "" for the main graph, else "subgraph <node>/<attr>"
    parent: int | None


def iter_graphs(model: onnx.ModelProto) -> list[GraphInfo]:
    """The main graph and every subgraph below it, parents before children, in a fixed order."""
    out: list[GraphInfo] = []

    def walk(g: onnx.GraphProto, location: str, parent: int | None) -> None:
        info = GraphInfo(g, len(out), location, parent)
        out.append(info)
        for node in g.node:
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for i, sg in enumerate(subs):
                    suffix = attr.name if len(subs) == 1 else f"{attr.name}[{i}]"
                    walk(sg, f"subgraph {node.name or node.op_type}/{suffix}", info.key)

    walk(model.graph, "", None)
    return out


def node_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def read_counts(model: onnx.ModelProto) -> dict[str, int]:
    """How often each name is read anywhere in the model: node inputs and graph outputs (a graph
    output is a reader too) of the main graph and every subgraph. A pass that folds a constant
    away keeps it while another reader is left."""
    counts: dict[str, int] = {}
    for info in iter_graphs(model):
        for node in info.graph.node:
            for name in node.input:
                counts[name] = counts.get(name, 0) + 1
        for out in info.graph.output:
            counts[out.name] = counts.get(out.name, 0) + 1
    return counts


def all_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor and node name used anywhere, to keep new names unique."""
    names: set[str] = set()
    for info in iter_graphs(model):
        g = info.graph
        names.update(v.name for v in itertools.chain(g.input, g.output, g.value_info))
        names.update(t.name for t in g.initializer)
        names.update(t.values.name for t in g.sparse_initializer)
        for node in g.node:
            names.update(node.output)
            names.update(node.input)
            if node.name:
                names.add(node.name)
    return names


def _defined_names(g: onnx.GraphProto) -> set[str]:
    """Names a graph defines: its inputs, initializers (dense and sparse) and node outputs."""
    names = {v.name for v in g.input} | {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
    names.update(o for node in g.node for o in node.output)
    return names


def _shadowing_initializers(model: onnx.ModelProto):
    """Per graph, top-down: (graph, its initializers whose names an enclosing graph defines). A
    caller may rename them (and their reads) before taking the next item: the names the graphs
    below see are read after that."""
    def walk(g: onnx.GraphProto, outer: set[str]):
        yield g, [t for t in itertools.chain(g.initializer, (s.values for s in g.sparse_initializer))
                  if t.name in outer]
        visible = outer | _defined_names(g)
        for node in g.node:
            for sub in node_subgraphs(node):
                yield from walk(sub, visible)

    return walk(model.graph, set())


def unshadow_initializers(model: onnx.ModelProto) -> int:
    """Give every subgraph initializer whose name an enclosing graph also defines (an If / Loop /
    Scan body's own weight named like an outer tensor: allowed for initializers, and onnx.checker
    and onnxruntime accept it) a new unique name, renaming its reads in that subgraph and in the
    subgraphs below it that do not define the name again. In place; returns how many were renamed.

    Why: a pass that turns such an initializer into a node output (DequantizeLinear -> W) writes a
    subgraph node output that shadows an outer name, which ONNX forbids (SSA: the checker and
    onnxruntime refuse the model: "'W' has been used as output names multiple times")."""
    allocate = NameAllocator(all_names(model))
    renamed = 0
    for g, shadowing in _shadowing_initializers(model):
        if not shadowing:
            continue
        renames: dict[str, str] = {}  # old name -> new name
        for tensor in shadowing:
            new_name = allocate.take(tensor.name)
            renames[tensor.name] = new_name
            tensor.name = new_name
        _rename_reads(g, renames)
        renamed += len(renames)
    return renamed


def shadowed_initializers(model: onnx.ModelProto) -> list[str]:
    """Names of subgraph initializers that an enclosing graph also defines (see unshadow_initializers)."""
    return [t.name for _, shadowing in _shadowing_initializers(model) for t in shadowing]


def unshadowed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` itself when no subgraph initializer shadows an outer name, else a copy with those
    renamed (unshadow_initializers): what a pass that rewrites weights into node outputs starts from."""
    if not shadowed_initializers(model):
        return model
    out = copy_model(model)
    unshadow_initializers(out)
    return out


def _rename_reads(g: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Reads of the names in `renames` (old -> new) in `g` (node inputs, graph outputs,
    value_info) and in its subgraphs, except below a subgraph that defines the name itself."""
    for node in g.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for sub in node_subgraphs(node):
            inner = {old: new for old, new in renames.items() if old not in _defined_names(sub)}
            if inner:
                _rename_reads(sub, inner)
    for v in itertools.chain(g.output, g.value_info):
        if v.name in renames:
            v.name = renames[v.name]


class NameAllocator:
    """Hands out names not yet used in the model: the wished name, else name_1, name_2, ..."""

    def __init__(self, used: set[str]):
        self.used = set(used)

    def take(self, wish: str) -> str:
        name, i = wish, 0
        while name in self.used:
            i += 1
            name = f"{wish}_{i}"
        self.used.add(name)
        return name


# ---------------------------------------------------------------------------------------------
# weights and their consumers


@dataclass
class Use:
    node: onnx.NodeProto
    index: int  # input index of the weight in `node`
    graph_key: int


@dataclass
class Weight:
    name: str
    tensor: TensorProto
    graph_key: int  # graph that defines the weight
    location: str  # "initializer", "Constant node", or "subgraph ...: initializer|Constant node"
    node: onnx.NodeProto | None = None  # the Constant node, when the weight lives in one
    attr: str = "value"  # Constant attribute holding it: value, value_float, value_floats
    uses: list[Use] = field(default_factory=list)
    graph_output: bool = False  # the name is also an output of its graph
    graph_input: bool = False  # the name is also a graph input (an overridable initializer)

    @property
    def shape(self) -> tuple:
        return tuple(int(d) for d in self.tensor.dims)


def _constant_tensor(node: onnx.NodeProto) -> tuple[TensorProto, str] | None:
    for attr in node.attribute:
        if attr.ref_attr_name:  # (a function body's Constant whose value the call gives: nothing stored)
            return None
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t, "value"
        if attr.name == "value_float":
            t = onnx.helper.make_tensor(node.output[0], TensorProto.FLOAT, [], [attr.f])
            return t, "value_float"
        if attr.name == "value_floats":
            t = onnx.helper.make_tensor(node.output[0], TensorProto.FLOAT, [len(attr.floats)], list(attr.floats))
            return t, "value_floats"
    return None


def find_weights(model: onnx.ModelProto) -> tuple[list[Weight], list[GraphInfo]]:
    """Every constant tensor (initializers and Constant nodes, all graphs) with its consumers,
    and the graphs in the order of `iter_graphs` (parents before children).

    Names are resolved with ONNX scoping: a subgraph sees the names of the graphs enclosing it
    (defined before its node) unless it defines the same name itself.
    """
    graphs: list[GraphInfo] = []
    weights: list[Weight] = []
    by_scope: dict[tuple[int, str], Weight] = {}

    def walk(g: onnx.GraphProto, location: str, parent: int | None, scope: dict[str, int]) -> None:
        info = GraphInfo(g, len(graphs), location, parent)
        graphs.append(info)
        prefix = f"{location}: " if location else ""
        local = dict(scope)
        for v in g.input:
            local[v.name] = info.key
        inputs = {v.name for v in g.input}
        outputs = {v.name for v in g.output}
        for t in g.initializer:
            local[t.name] = info.key
            w = Weight(t.name, t, info.key, prefix + "initializer", graph_input=t.name in inputs)
            weights.append(w)
            by_scope[(info.key, t.name)] = w
        for node in g.node:
            for i, name in enumerate(node.input):
                owner = local.get(name)
                if name and owner is not None and (owner, name) in by_scope:
                    by_scope[(owner, name)].uses.append(Use(node, i, info.key))
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for i, sg in enumerate(subs):
                    suffix = attr.name if len(subs) == 1 else f"{attr.name}[{i}]"
                    walk(sg, f"subgraph {node.name or node.op_type}/{suffix}", info.key, local)
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
                found = _constant_tensor(node)
                if found is not None:
                    t, attr_name = found
                    w = Weight(node.output[0], t, info.key, prefix + "Constant node", node=node, attr=attr_name)
                    weights.append(w)
                    by_scope[(info.key, node.output[0])] = w
            for name in node.output:
                local[name] = info.key
        for name in outputs:
            owner = local.get(name)
            if owner is not None and (owner, name) in by_scope:
                by_scope[(owner, name)].graph_output = True

    walk(model.graph, "", None, {})
    return weights, graphs


def consumers_index(weights_graphs: list[GraphInfo]):
    """A function (name, graph_key) -> Uses of a node output, for following Identity/Transpose."""
    uses: dict[tuple[int, str], list[Use]] = {}
    for info in weights_graphs:
        for node in info.graph.node:
            for i, name in enumerate(node.input):
                if name:
                    uses.setdefault((info.key, name), []).append(Use(node, i, info.key))

    def consumers_of(name: str, graph_key: int) -> list[Use]:
        # intermediate tensors of pass-through ops are read in the same graph in practice
        return uses.get((graph_key, name), [])

    return consumers_of


# Ops that only move, select or repeat a tensor's values (their data input is input 0), so a value
# read through them is read by whatever reads their output; Concat does so for every input (the
# callers take it apart). Used to follow a parameter (quantize.float_parameters) or an index input
# (fidelity.gather_index_bounds) to the op that really reads it.
VALUE_MOVING_OPS = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Slice",
                              "Split", "Expand", "Tile"})


# ---------------------------------------------------------------------------------------------
# which axis matters for a consumer

# Ops that only move or retype a tensor: the weight's axes reach the next consumer unchanged.
_PASS_THROUGH = {"Identity", "Cast", "CastLike"}
# (op, input index) -> which axis of that input holds output channels / the reduction
_RECURRENT = {"LSTM", "GRU", "RNN"}


@dataclass
class AxisChoice:
    channel: int | None  # axis whose slices get their own scale (output channels / rows)
    reduce: int | None  # axis along which blocks run (the dot-product axis), when known
    why: str  # consumer description for the report


# onnxruntime's contrib ops (graphs its transformer optimiser wrote) that read weights like a
# standard op: their weight axes follow that op's rules
_CONTRIB = {("com.microsoft", "FusedConv"): "Conv", ("com.microsoft", "FusedGemm"): "Gemm",
            ("com.microsoft", "FusedMatMul"): "FusedMatMul", ("com.microsoft", "Attention"): "Attention"}


def _einsum_axes(equation: str, index: int, ndim: int) -> AxisChoice | None:
    """Axes of operand `index` of an explicit Einsum ("bij,jk->bik"): the one letter summed away
    is the dot-product axis, the last letter kept in the output the channel. None when the
    equation is implicit, has an ellipsis, or sums over no or several letters of the operand."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    inputs, output = eq.split("->")
    operands = inputs.split(",")
    if index >= len(operands) or len(operands[index]) != ndim or len(set(operands[index])) != ndim:
        return None
    letters = operands[index]
    summed = [i for i, c in enumerate(letters) if c not in output]
    kept = [i for i, c in enumerate(letters) if c in output]
    if len(summed) != 1 or not kept:
        return None
    return AxisChoice(kept[-1], summed[0], "Einsum")


def _axis_for_use(op: str, index: int, node: onnx.NodeProto, ndim: int) -> AxisChoice | None:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if op == "FusedMatMul" and ndim >= 2 and index in (0, 1):
        # MatMul(transA? A^T : A, transB? B^T : B) * alpha: a transposed operand swaps its last two axes
        flip = attrs.get("transB" if index == 1 else "transA", 0)
        last, second = ndim - 1, ndim - 2
        if index == 1:
            return AxisChoice(second, last, "FusedMatMul(transB=1)") if flip else AxisChoice(last, second, "FusedMatMul")
        return AxisChoice(last, second, "FusedMatMul(A, transA=1)") if flip else AxisChoice(second, last, "FusedMatMul(A)")
    if op == "Einsum" and ndim >= 2:
        return _einsum_axes(str(attrs.get("equation", b"").decode() if isinstance(attrs.get("equation"), bytes)
                                else attrs.get("equation", "")), index, ndim)
    if op == "Attention" and index == 1 and ndim == 2:
        return AxisChoice(1, 0, "Attention")  # input [.., hidden] @ weights [hidden, 3 * hidden]
    if op == "Conv" and index == 1:
        return AxisChoice(0, 1 if ndim > 1 else None, "Conv")
    if op == "ConvTranspose" and index == 1:
        if ndim > 1 and int(attrs.get("group", 1)) > 1:
            # [C_in, C_out/group, k..]: output channel g*(C_out/group)+j reads rows of group g only, so
            # axis 1 mixes the groups (and is 1 long when depthwise: one scale); axis 0 stays in a group
            return AxisChoice(0, None, "ConvTranspose(group>1)")
        return AxisChoice(1 if ndim > 1 else 0, 0, "ConvTranspose")
    if op == "MatMul" and ndim >= 2:
        if index == 1:
            return AxisChoice(ndim - 1, ndim - 2, "MatMul")
        return AxisChoice(ndim - 2, ndim - 1, "MatMul(A)")
    if op == "Gemm" and ndim == 2:
        if index == 1:
            return (AxisChoice(0, 1, "Gemm(transB=1)") if attrs.get("transB", 0)
                    else AxisChoice(1, 0, "Gemm(transB=0)"))
        if index == 0:
            return (AxisChoice(1, 0, "Gemm(A, transA=1)") if attrs.get("transA", 0)
                    else AxisChoice(0, 1, "Gemm(A)"))
    if op == "Gather" and index == 0:
        axis = int(attrs.get("axis", 0)) % max(ndim, 1)
        other = None if ndim < 2 else (ndim - 1 if axis != ndim - 1 else 0)
        return AxisChoice(axis, other, "Gather")
    if op in _RECURRENT and index in (1, 2) and ndim == 3:
        return AxisChoice(1, 2, op)  # [directions, gates*hidden, input]: gate rows
    return None


def choose_axis(weight: Weight, consumers_of) -> AxisChoice:
    """The axis each consumer wants; when consumers disagree or are unknown, channel=None.

    `consumers_of(name, graph_key)` lists Uses of an intermediate tensor, so that a weight reaching
    its consumer through Identity / Cast / Transpose still gets the consumer's axis.
    """
    ndim = len(weight.shape)
    choices: list[AxisChoice | None] = []

    def follow(uses: list[Use], perm: list[int], depth: int) -> None:
        for use in uses:
            op = (use.node.op_type if use.node.domain in ("", "ai.onnx")
                  else _CONTRIB.get((use.node.domain, use.node.op_type)))
            if op in _PASS_THROUGH and use.index == 0 and depth < 4:
                follow(consumers_of(use.node.output[0], use.graph_key), perm, depth + 1)
                continue
            if op == "Transpose" and depth < 4:
                p = None
                for a in use.node.attribute:
                    if a.name == "perm":
                        p = list(a.ints)
                p = p if p is not None else list(range(ndim))[::-1]
                if len(p) == ndim:
                    # axis j of the output is axis p[j] of the input
                    follow(consumers_of(use.node.output[0], use.graph_key), [perm[k] for k in p], depth + 1)
                    continue
            c = _axis_for_use(op, use.index, use.node, ndim) if op else None
            if c is None:
                choices.append(None)
            else:
                choices.append(AxisChoice(
                    perm[c.channel] if c.channel is not None else None,
                    perm[c.reduce] if c.reduce is not None else None, c.why))

    follow(weight.uses, list(range(ndim)), 0)
    known = [c for c in choices if c is not None]
    if not known or len(known) != len(choices):
        return AxisChoice(None, None, "other consumers" if choices else "no consumer")
    first = known[0]
    if all(c.channel == first.channel and c.reduce == first.reduce for c in known):
        return first
    return AxisChoice(None, None, "consumers disagree")


# ---------------------------------------------------------------------------------------------
# outputs onnxruntime cannot hand to numpy

# Output element types onnxruntime's Python binding does not return as their values: bfloat16,
# float8 (except e4m3fn), 4-bit and 2-bit types raise "No corresponding Numpy type", and
# float8e4m3fn comes back as uint8 holding the bit patterns (comparing those as numbers measures
# codes, not values: -0.001 and +0.001 differ by 128). Each is cast to a type that holds its values
# exactly, which Cast supports from the opset that introduced the type.
_OUTPUT_CASTS = {
    TensorProto.BFLOAT16: TensorProto.FLOAT,
    TensorProto.FLOAT8E4M3FN: TensorProto.FLOAT,
    TensorProto.FLOAT8E4M3FNUZ: TensorProto.FLOAT,
    TensorProto.FLOAT8E5M2: TensorProto.FLOAT,
    TensorProto.FLOAT8E5M2FNUZ: TensorProto.FLOAT,
    TensorProto.FLOAT4E2M1: TensorProto.FLOAT,
    TensorProto.INT4: TensorProto.INT8,
    TensorProto.UINT4: TensorProto.UINT8,
    **{getattr(TensorProto, n): TensorProto.FLOAT for n in ("FLOAT8E8M0",) if hasattr(TensorProto, n)},
    **{getattr(TensorProto, n): t for n, t in (("INT2", TensorProto.INT8), ("UINT2", TensorProto.UINT8))
       if hasattr(TensorProto, n)},
}


# the same types as onnxruntime names them in NodeArg.type ('tensor(bfloat16)', ...): a caller
# holding a session (not the model) asks numpy_unreadable_output_type, so that this table stays
# the one place that knows which outputs need a Cast
_OUTPUT_CAST_ORT_TYPES = frozenset(f"tensor({TensorProto.DataType.Name(t).lower()})" for t in _OUTPUT_CASTS)


def numpy_unreadable_output_type(ort_type: str) -> bool:
    """Whether onnxruntime hands an output of this NodeArg type ('tensor(float8e4m3fn)', ...) to
    numpy as something other than its values: the types numpy_readable_outputs casts."""
    return ort_type in _OUTPUT_CAST_ORT_TYPES


def numpy_readable_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` itself when onnxruntime hands every graph output to numpy as its values; else a
    copy whose outputs of the other types (_OUTPUT_CASTS) end in a Cast to a type that holds their
    values exactly (float32, int8, uint8), in the same output positions, so that a comparison of
    outputs measures values. The cast output is named after the original (NAME_as_float32, ...);
    the caller's model is not modified."""
    casts = [(i, o) for i, o in enumerate(model.graph.output)
             if o.type.HasField("tensor_type") and o.type.tensor_type.elem_type in _OUTPUT_CASTS]
    if not casts:
        return model
    out = copy_model(model)
    names = NameAllocator(all_names(out))
    for i, _ in casts:
        entry = out.graph.output[i]
        to = _OUTPUT_CASTS[entry.type.tensor_type.elem_type]
        cast_name = names.take(f"{entry.name}_as_{type_name(to)}")
        out.graph.node.append(onnx.helper.make_node("Cast", [entry.name], [cast_name], to=to,
                                                    name=names.take(f"{entry.name}_cast_for_numpy")))
        entry.name = cast_name
        entry.type.tensor_type.elem_type = to
    return out


# ---------------------------------------------------------------------------------------------
# symbolic dimensions


_DIM_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
            ast.FloorDiv: lambda a, b: a // b if b else None}


def dim_expression_names(param: str) -> frozenset[str] | None:
    """The dimension names a symbolic dimension is computed from, when it is written as integer
    arithmetic over other dimensions: optimum's 'past_sequence_length + sequence_length' (the
    attention mask and present key/values of a decoder with past), torch.export's 's0 + s1' or
    '2*s0'. None for a plain name ('batch_size') or anything else. 'seq-len' reads as seq minus
    len: a caller treats a dimension as an expression only where every name in it is also a
    dimension of its own, and a result below 1 is no size (evaluate_dim_expression)."""
    try:
        tree = ast.parse(param.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.BinOp):
        return None
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, int) or isinstance(node.value, bool):
                return None
        elif not isinstance(node, (ast.BinOp, ast.Load)) and type(node) not in _DIM_OPS:
            return None
        elif isinstance(node, ast.BinOp) and type(node.op) not in _DIM_OPS:
            return None
    return frozenset(names) if names else None


def evaluate_dim_expression(param: str, sizes: dict[str, int]) -> int | None:
    """The size of a symbolic dimension written as arithmetic over others (dim_expression_names)
    given the sizes of those others; None when it is no such expression, names a dimension
    `sizes` lacks, or comes out below 1 (no axis has that size)."""
    if dim_expression_names(param) is None:
        return None

    def value(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return sizes.get(node.id)
        left, right = value(node.left), value(node.right)
        if left is None or right is None:
            return None
        return _DIM_OPS[type(node.op)](left, right)

    result = value(ast.parse(param.strip(), mode="eval").body)
    return int(result) if result is not None and result >= 1 else None


# ---------------------------------------------------------------------------------------------
# graph order


def toposort(model: onnx.ModelProto, *, dry_run: bool = False) -> bool:
    """Sort the nodes of every graph topologically, keeping the given order where it is valid.

    Returns True when some graph was reordered. A subgraph's reads from enclosing scopes count as
    inputs of the node that owns the subgraph. dry_run: only say whether a graph would be reordered,
    leaving the model as it is (a caller that must not modify its input copies it only then).
    """
    changed = False

    def outer_reads(g: onnx.GraphProto) -> set[str]:
        defined = {v.name for v in g.input} | {t.name for t in g.initializer}
        reads: set[str] = set()
        for node in g.node:
            for sg in node_subgraphs(node):
                reads |= outer_reads(sg) - defined
            reads.update(n for n in node.input if n and n not in defined)
            defined.update(node.output)
        return reads

    def sort(g: onnx.GraphProto, outer: set[str]) -> None:
        nonlocal changed
        available = set(outer) | {v.name for v in g.input} | {t.name for t in g.initializer} | {""}
        nodes = list(g.node)
        needs = []
        for node in nodes:
            req = set(node.input)
            for sg in node_subgraphs(node):
                req |= outer_reads(sg)
            needs.append(req)
        producers: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for o in node.output:
                producers.setdefault(o, i)
        order: list[int] = []
        done = [False] * len(nodes)
        # repeated stable passes: cheap when already sorted (one pass), correct otherwise
        pending = list(range(len(nodes)))
        while pending:
            rest = []
            for i in pending:
                if all(n in available or n not in producers for n in needs[i]):
                    order.append(i)
                    done[i] = True
                    available.update(nodes[i].output)
                else:
                    rest.append(i)
            if len(rest) == len(pending):
                raise InvalidModelError(f"graph {g.name!r} has a cycle or reads a tensor nobody produces")
            pending = rest
        if order != list(range(len(nodes))):
            changed = True
            if dry_run:
                return
            reordered = [nodes[i] for i in order]
            copies = [onnx.NodeProto() for _ in reordered]
            for c, n in zip(copies, reordered):
                c.CopyFrom(n)
            del g.node[:]
            g.node.extend(copies)
        scope = set(outer) | {v.name for v in g.input} | {t.name for t in g.initializer}
        for node in g.node:
            for sg in node_subgraphs(node):
                if not (dry_run and changed):
                    sort(sg, scope)
            scope.update(node.output)

    sort(model.graph, set())
    return changed


# ---------------------------------------------------------------------------------------------
# opset


def default_opset(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return int(op.version)
    return 0


def _ops_used(model: onnx.ModelProto) -> set[str]:
    ops = set()
    for info in iter_graphs(model):
        for node in info.graph.node:
            if node.domain in ("", "ai.onnx"):
                ops.add(node.op_type)
    return ops


def _unchanged_between(model: onnx.ModelProto, old: int, new: int) -> bool:
    """True when no default-domain op of the model got a new version in (old, new]."""
    for op in _ops_used(model):
        try:
            since = onnx.defs.get_schema(op, new, "").since_version
        except onnx.defs.SchemaError:
            return False
        if since > old:
            return False
    return True


_STASH = "surgeon-stash"


def raise_opset(model: onnx.ModelProto, target: int, payloads: dict[str, TensorProto] | None = None
                ) -> tuple[onnx.ModelProto, str]:
    """`model` with its default-domain opset raised to `target` (a new model) and how it was done.

    onnx.version_converter adapts the nodes; it runs on a skeleton whose large tensor payloads are
    stashed (it serialises the model, which would fail over 2 GB and costs memory), and its result
    is checked (on a view without payloads, see _typed_inputs_view). `payloads` holds the data of
    main-graph initializers that `model` has without raw_data (see copy_model): they stay without
    raw_data in the result too (the caller reads them from `payloads`). When the converter fails, the opset number is bumped only if no op used by the
    model changed between the two versions; otherwise UnsupportedFormError says why.
    """
    from onnx.external_data_helper import _get_all_tensors

    old = default_opset(model)
    # main-graph payloads are never copied into the skeleton: they are read back from their
    # tensors (or from `payloads`, for initializers a caller copied without payload) afterwards
    payloads = payloads or {}
    main = [payloads.get(name, t) for name, t in unique_initializers(model).items()
            if name in payloads or (t.HasField("raw_data") and tensor_nbytes(t) > 1024)]
    skeleton = copy_model(model, {t.name for t in main})
    index = {t.name: i for i, t in enumerate(main)}
    for t in skeleton.graph.initializer:
        if t.name in index:
            t.data_location = TensorProto.EXTERNAL
            e = t.external_data.add()
            e.key, e.value = "location", f"{_STASH}-main-{index[t.name]}"
    stash: list[bytes] = []
    for t in _get_all_tensors(skeleton):
        if t.HasField("raw_data") and len(t.raw_data) > 1024:
            stash.append(t.raw_data)
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            e = t.external_data.add()
            e.key, e.value = "location", f"{_STASH}-{len(stash) - 1}"
    stubs = set(index)
    before = _typed_inputs_view(skeleton, stubs, stash)
    prelu_ranks = _legacy_prelu_slopes(before, old, target)
    sparse = _stub_sparse_constants(skeleton)
    how = f"opset raised from {old} to {target} (onnx.version_converter)"
    try:
        converted = onnx.version_converter.convert_version(skeleton, target)
        _restore_sparse_constants(converted, sparse)
        _keep_functions(model, converted, target)
    except Exception as exc:  # the converter raises plain RuntimeError/ValueError with C++ text
        if not _unchanged_between(model, old, target):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsupportedFormError(
                f"the chosen weight form needs opset {target} but the model uses opset {old} and "
                f"onnx.version_converter cannot convert it ({first})"
            ) from None
        converted = skeleton
        _restore_sparse_constants(converted, sparse)
        for op in converted.opset_import:
            if op.domain in ("", "ai.onnx"):
                op.version = target
        how = f"opset raised from {old} to {target} (no op of the model changed between those versions)"
    _reshape_legacy_prelu_slopes(converted, prelu_ranks)
    how += _keep_annotations(model, converted, target)
    need_ir = onnx.helper.find_min_ir_version_for(list(converted.opset_import), True)
    if converted.ir_version < need_ir:
        converted.ir_version = need_ir
    try:
        _verify_conversion(before, _typed_inputs_view(converted, stubs, stash), old, target)
    except UnsupportedFormError:
        stale = _restate_stale_output_shapes(converted, _typed_inputs_view(converted, stubs, stash))
        if not stale:
            raise
        _verify_conversion(before, _typed_inputs_view(converted, stubs, stash), old, target)
        how += (f"; the declared shape of output(s) {', '.join(stale)} was wrong (the graph computes "
                "another rank or size; onnxruntime warns about it too) and is now the inferred one")
    for t in _get_all_tensors(converted):
        if t.data_location == TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in t.external_data}.get("location", "")
            if loc.startswith(_STASH + "-main-"):
                if t.name not in payloads:  # the caller reads those from `payloads` itself
                    t.raw_data = main[int(loc.rsplit("-", 1)[1])].raw_data
                del t.external_data[:]
                t.ClearField("data_location")  # unset, as it was: not an explicit DEFAULT
            elif loc.startswith(_STASH + "-"):
                t.raw_data = stash[int(loc.rsplit("-", 1)[1])]
                del t.external_data[:]
                t.ClearField("data_location")  # unset, as it was: not an explicit DEFAULT
    return converted, how


def _legacy_prelu_slopes(view: onnx.ModelProto, old: int, target: int) -> dict[str, int]:
    """PRelu output name -> rank of its input X, for the PRelu nodes whose slope must be reshaped
    when the opset crosses 7 (`view`: the model before conversion, payloads aside).

    Before opset 7 a PRelu slope of C values applies per channel (axis 1: what PyTorch exported
    at opset 6 and computed); from opset 7 the slope broadcasts numpy-style, from the last axis.
    onnx.version_converter keeps the slope as it is, so an X of rank >= 3 made onnxruntime fail
    (4 by 5) or, where the last axis also has C entries, compute a wrong result silently. A 1-D
    slope with an X of rank <= 2 already broadcasts along axis 1. Raises UnsupportedFormError where
    the ranks cannot be known (the result would be a guess)."""
    if not old < 7 <= target:
        return {}
    prelus = [n for info in iter_graphs(view) for n in info.graph.node
              if n.op_type == "PRelu" and n.domain in ("", "ai.onnx") and len(n.input) >= 2]
    if not prelus:
        return {}
    try:
        inferred = onnx.shape_inference.infer_shapes(view)
    except Exception:  # noqa: BLE001 - inference is a help here: the declared shapes remain
        inferred = view
    ranks: dict[str, int] = {}
    for info in iter_graphs(inferred):
        g = info.graph
        for v in list(g.input) + list(g.value_info) + list(g.output):
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
                ranks[v.name] = len(v.type.tensor_type.shape.dim)
        for t in g.initializer:
            ranks[t.name] = len(t.dims)
        for n in g.node:
            c = _constant_tensor(n)
            if c is not None:
                ranks[n.output[0]] = len(c[0].dims)
    out = {}
    for n in prelus:
        x_rank, s_rank = ranks.get(n.input[0]), ranks.get(n.input[1])
        if s_rank is not None and s_rank != 1:
            continue  # laid out for numpy broadcasting already
        if x_rank is not None and x_rank <= 2:
            continue
        if x_rank is None or s_rank is None:
            raise UnsupportedFormError(
                f"PRelu {n.name or n.output[0]!r}: raising the opset from {old} to {target} changes how its slope "
                "broadcasts (per channel before opset 7, from the last axis after), and the rank of its "
                f"{'input' if x_rank is None else 'slope'} is unknown, so the slope cannot be laid out for it")
        out[n.output[0]] = x_rank
    return out


def _reshape_legacy_prelu_slopes(model: onnx.ModelProto, ranks: dict[str, int]) -> None:
    """Feed each PRelu named in `ranks` (see _legacy_prelu_slopes) its slope reshaped to
    (C, 1, ..., 1) by a Reshape node inserted before it (in place): the per-channel PRelu of opset
    < 7 in the numpy broadcasting of opset >= 7. A one-value slope stays one value."""
    if not ranks:
        return
    names = NameAllocator(all_names(model))
    for info in reversed(iter_graphs(model)):  # children first: rewriting a node list copies its subgraphs
        g = info.graph
        nodes = []
        for n in g.node:
            if n.op_type == "PRelu" and n.domain in ("", "ai.onnx") and n.output and n.output[0] in ranks:
                rank = ranks[n.output[0]]
                shape = names.take(f"{n.input[1]}_per_channel_shape")
                slope = names.take(f"{n.input[1]}_per_channel")
                g.initializer.append(onnx.numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), np.int64), shape))
                nodes.append(onnx.helper.make_node("Reshape", [n.input[1], shape], [slope],
                                                   name=names.take(f"{n.name or n.output[0]}_slope_Reshape")))
                n.input[1] = slope
            nodes.append(n)
        if len(nodes) != len(g.node):
            del g.node[:]
            g.node.extend(nodes)


def _stub_sparse_constants(skeleton: onnx.ModelProto) -> dict[tuple[int, str], onnx.AttributeProto]:
    """Swap each `Constant(sparse_value=...)` of `skeleton` for a dense stub of its type and
    shape (in place) and return the originals by (graph index, output name): onnx.version_converter
    refuses any model holding a sparse tensor ("Sparse tensors not supported"), though a Constant
    is the same op at every opset it adapts."""
    originals = {}
    for info in iter_graphs(skeleton):
        for node in info.graph.node:
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
                continue
            for i, attr in enumerate(node.attribute):
                if attr.name == "sparse_value":
                    originals[(info.key, node.output[0])] = onnx.AttributeProto.FromString(attr.SerializeToString())
                    stub = TensorProto(name=attr.sparse_tensor.values.name, data_type=attr.sparse_tensor.values.data_type,
                                       dims=list(attr.sparse_tensor.dims), data_location=TensorProto.EXTERNAL)
                    e = stub.external_data.add()
                    e.key, e.value = "location", f"{_STASH}-sparse"
                    del node.attribute[i]
                    node.attribute.append(onnx.helper.make_attribute("value", stub))
                    break
    return originals


def _restore_sparse_constants(model: onnx.ModelProto, originals: dict) -> None:
    """Put back the sparse attributes `_stub_sparse_constants` took out (the converter keeps the
    graphs, their order and the Constant nodes' outputs)."""
    if not originals:
        return
    for info in iter_graphs(model):
        for node in info.graph.node:
            attr = originals.get((info.key, node.output[0] if node.output else ""))
            if attr is not None and node.op_type == "Constant":
                del node.attribute[:]
                node.attribute.append(attr)


def _keep_functions(model: onnx.ModelProto, converted: onnx.ModelProto, target: int) -> None:
    """onnx.version_converter drops the model-local functions (onnx 1.17-1.19), and onnxruntime
    and the checker want a function to import the model's opset: each function body goes through
    the converter on its own (as the graph of a model of its own) and comes back."""
    if not model.functions or converted.functions:
        return
    for fn in model.functions:
        new = converted.functions.add()
        new.CopyFrom(fn)
        old = next((int(o.version) for o in fn.opset_import if o.domain in ("", "ai.onnx")), None)
        if old is None or old == target:
            continue
        body = onnx.helper.make_graph(list(fn.node), fn.name, [onnx.ValueInfoProto(name=i) for i in fn.input],
                                      [onnx.ValueInfoProto(name=o) for o in fn.output])
        wrapper = onnx.helper.make_model(body, opset_imports=list(fn.opset_import))
        wrapper.ir_version = model.ir_version
        try:
            body = onnx.version_converter.convert_version(wrapper, target).graph
        except Exception as exc:  # noqa: BLE001 - the converter raises plain C++-bound errors
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UnsupportedFormError(f"model-local function {fn.domain}:{fn.name} cannot be converted from opset "
                                       f"{old} to {target} ({first})") from None
        _restore_attribute_references(fn, body.node)
        del new.node[:]
        new.node.extend(body.node)
        for o in new.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = target


def _keep_annotations(model: onnx.ModelProto, converted: onnx.ModelProto, target: int) -> str:
    """Put back (in place on `converted`) what onnx.version_converter drops though it is no part of
    any op (onnx 1.23): each graph's metadata_props and quantization_annotation, the
    metadata_props of nodes (matched by their outputs), of initializers (with their doc strings)
    and of inputs / outputs / value_info (by name), and the model's training_info, whose graphs go
    through the converter as a model of their own (they use the model's opsets). Returns a note
    for raise_opset's `how` when training_info cannot be converted and is dropped."""
    originals = {info.location: info.graph for info in iter_graphs(model)}
    for info in iter_graphs(converted):
        old = originals.get(info.location)
        if old is None:
            continue
        g = info.graph
        if old.metadata_props and not g.metadata_props:
            g.metadata_props.extend(old.metadata_props)
        if old.quantization_annotation and not g.quantization_annotation:
            g.quantization_annotation.extend(old.quantization_annotation)
        node_props = {tuple(n.output): n.metadata_props for n in old.node if n.metadata_props}
        for n in g.node:
            props = node_props.get(tuple(n.output))
            if props and not n.metadata_props:
                n.metadata_props.extend(props)
        inits = {t.name: t for t in old.initializer if t.doc_string or t.metadata_props}
        for t in g.initializer:
            was = inits.get(t.name)
            if was is not None:
                t.doc_string = t.doc_string or was.doc_string
                if not t.metadata_props:
                    t.metadata_props.extend(was.metadata_props)
        infos = {v.name: v for v in (*old.input, *old.output, *old.value_info) if v.metadata_props or v.doc_string}
        for v in (*g.input, *g.output, *g.value_info):
            was = infos.get(v.name)
            if was is not None:
                v.doc_string = v.doc_string or was.doc_string
                if not v.metadata_props:
                    v.metadata_props.extend(was.metadata_props)
    if not model.training_info or converted.training_info:
        return ""
    kept = []
    try:
        for ti in model.training_info:
            new = onnx.TrainingInfoProto()
            new.CopyFrom(ti)
            for field_name in ("initialization", "algorithm"):
                if new.HasField(field_name):
                    _convert_graph_nodes(getattr(new, field_name), model, target)
            kept.append(new)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain C++-bound errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"; training_info dropped (its graphs cannot be converted: {first})"
    converted.training_info.extend(kept)
    return ""


def _convert_graph_nodes(g: onnx.GraphProto, model: onnx.ModelProto, target: int) -> None:
    """`g`'s nodes through onnx.version_converter to `target` (in place), `g` read as the graph of
    a model of its own with `model`'s opsets: the names it reads from the main graph (a training
    algorithm reads the weights it updates) become untyped inputs of that model for the converter."""
    body = onnx.GraphProto()
    body.CopyFrom(g)
    defined = {v.name for v in body.input} | {t.name for t in body.initializer} | {o for n in body.node for o in n.output}
    outer = dict.fromkeys(i for n in body.node for i in n.input if i and i not in defined)
    body.input.extend(onnx.ValueInfoProto(name=name) for name in outer)
    wrapper = onnx.helper.make_model(body, opset_imports=list(model.opset_import))
    wrapper.ir_version = model.ir_version
    converted = onnx.version_converter.convert_version(wrapper, target).graph
    del g.node[:]
    g.node.extend(converted.node)


def _restore_attribute_references(fn: onnx.FunctionProto, converted_nodes) -> None:
    """Put back the attributes of `fn`'s body that refer to the call's attributes (ref_attr_name:
    Constant(value_float=@alpha) takes the value each call gives). The converter sees the body as
    a graph of its own and writes such an attribute as a plain one of value 0 (onnx 1.23: every
    call's scale became 0, the model's output all zeros). Nodes are matched by their outputs, which
    the converter keeps; an attribute the converter moved into an input (axes at opset 13 / 18)
    cannot take a call's value any more: UnsupportedFormError names it."""
    references = {tuple(n.output): [a for a in n.attribute if a.ref_attr_name] for n in fn.node}
    references = {k: v for k, v in references.items() if v}
    if not references:
        return
    for node in converted_nodes:
        for ref in references.get(tuple(node.output), ()):
            kept = [a for a in node.attribute if a.name != ref.name]
            if len(kept) == len(node.attribute):
                raise UnsupportedFormError(
                    f"model-local function {fn.domain}:{fn.name} cannot be converted to a newer opset: its "
                    f"{node.op_type} node's attribute '{ref.name}' takes the call's '{ref.ref_attr_name}', and "
                    "the newer opset has no such attribute")
            del node.attribute[:]
            node.attribute.extend(kept)
            node.attribute.append(onnx.AttributeProto.FromString(ref.SerializeToString()))


def _typed_inputs_view(skeleton: onnx.ModelProto, stubs: set[str], stash: list[bytes]) -> onnx.ModelProto:
    """What the checker needs to judge a conversion, without the large payloads: a copy of
    `skeleton` whose stubbed main-graph initializers are typed graph inputs of the same type and
    shape (the converter adapts nodes, never payloads) and whose other stashed tensors are back.

    Checking this costs no copy of the weights, so models of any size (also over 2 GB) are checked.
    """
    from onnx.external_data_helper import _get_all_tensors

    view = payload_free_view(skeleton, stubs)
    for t in _get_all_tensors(view):
        if t.data_location == TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in t.external_data}.get("location", "")
            if loc.startswith(_STASH + "-") and not loc.startswith(_STASH + "-main-"):
                t.raw_data = stash[int(loc.rsplit("-", 1)[1])]
                del t.external_data[:]
                t.ClearField("data_location")  # unset, as it was: not an explicit DEFAULT
    return view


def _restate_stale_output_shapes(converted: onnx.ModelProto, view: onnx.ModelProto) -> list[str]:
    """Graph outputs whose declared shape contradicts what shape inference derives (in place on
    `converted`; `view` is its checkable view); returns their names.

    An exporter can declare an output shape the graph does not produce (ddddocr's CRNN says
    [1, seqlen], its Reshape makes [T, 1, classes]). At its own opset nothing infers the Reshape's
    target, so onnx.checker passes; the converter to opset 14+ infers it, and every check of the
    raised model failed ("Inferred shape and existing shape differ in rank"). Such an output takes
    the inferred rank, with the sizes inference knows (the others left open), and the value_info
    the converter stored for it is dropped."""
    probe = copy_model(view)
    for o in probe.graph.output:
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    del probe.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    except Exception:  # noqa: BLE001 - nothing to learn from a model inference refuses
        return []
    found = {o.name: o.type.tensor_type.shape for o in inferred.graph.output
             if o.type.HasField("tensor_type") and o.type.tensor_type.HasField("shape")}
    stale = []
    for o in converted.graph.output:
        tt = o.type.tensor_type if o.type.HasField("tensor_type") else None
        if tt is None or not tt.HasField("shape") or o.name not in found:
            continue
        declared, derived = tt.shape.dim, found[o.name].dim
        clash = len(declared) != len(derived) or any(
            a.HasField("dim_value") and b.HasField("dim_value") and a.dim_value != b.dim_value
            for a, b in zip(declared, derived))
        if not clash:
            continue
        stale.append(o.name)
        tt.shape.ClearField("dim")
        for b in derived:
            d = tt.shape.dim.add()
            if b.HasField("dim_value"):
                d.dim_value = b.dim_value
    if stale:
        keep = [v for v in converted.graph.value_info if v.name not in stale]
        del converted.graph.value_info[:]
        converted.graph.value_info.extend(keep)
    return stale


def _verify_conversion(original: onnx.ModelProto, converted: onnx.ModelProto, old: int, target: int) -> None:
    """The converted model must pass the checker whenever the original does (both as
    _typed_inputs_view gives them)."""
    try:
        onnx.checker.check_model(converted, full_check=True)
    except Exception as exc:  # noqa: BLE001 - the checker raises several C++-bound types
        try:
            onnx.checker.check_model(original, full_check=True)
        except Exception:  # noqa: BLE001 - the original fails too: nothing was made worse
            return
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UnsupportedFormError(
            f"raising the opset from {old} to {target} (needed by the chosen weight form) gives an "
            f"invalid model: {first}"
        ) from None
