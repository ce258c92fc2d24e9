"""What a model's weights are and how they are stored: the table behind `surgeon-compress info`.

    desc = describe_model("model.onnx")
    for row in desc.rows: print(row.name, row.dtype, row.shape, row.bytes, row.scheme, row.location)
    desc.by_dtype, desc.by_scheme       # {"int8": {"count": 12, "bytes": 123456}, ...}

A weight is every constant tensor the model carries: initializers and `Constant` nodes, in
subgraphs (`If`/`Loop`/`Scan` bodies) too. Its scheme says how the model uses it:

  float                               a float weight used as it is
  int8/channel(axis=0)/sym            quantized: input 0 of a DequantizeLinear; granularity from
  int4/block(32)/asym                 its scale's shape (tensor, channel(axis) or block(size));
  uint8/tensor/asym                   asym when a non-zero zero point is given
  dq-scale, dq-zero-point             the scale and zero point of such a DequantizeLinear
  palette(16)                         integer indices into a float look-up table via Gather
  palette-table                       that look-up table
  int8/cast-scale                     Cast to float then Mul by a scale (hand-made dequantization)
  int8/cast-scale/block(64)           the same with a scale per block of 64 along one axis, then a
                                      Reshape (the auto mode's blocked levels)
  uint8/MatMulInteger, int8/ConvInteger, ...
                                      weights of operators that compute on integers directly
  integer, bool, other                shapes, axes, masks: not weights in the compression sense
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from ._fileio import load_model
from .errors import InvalidModelError
from .graph import type_name as dtype_name  # numpy-style: float32, float16, bfloat16, int8, int4, ...

FLOAT_TYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE,
}
# element sizes in bits where numpy's itemsize does not say it (packed 4-bit and 2-bit types)
_BITS = {
    onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.BFLOAT16: 16, onnx.TensorProto.STRING: 0,
}
for _name in ("FLOAT4E2M1",):
    if hasattr(onnx.TensorProto, _name):
        _BITS[getattr(onnx.TensorProto, _name)] = 4
for _name in ("INT2", "UINT2"):
    if hasattr(onnx.TensorProto, _name):
        _BITS[getattr(onnx.TensorProto, _name)] = 2

# operators that take integer weights and compute on them without a DequantizeLinear
INTEGER_WEIGHT_OPS = {
    "MatMulInteger": {1, 3}, "ConvInteger": {1, 3}, "QLinearConv": {3, 5}, "QLinearMatMul": {3, 5},
    "DynamicQuantizeLSTM": {1, 2, 9, 10, 11}, "QGemm": {3, 5}, "MatMulIntegerToFloat": {1, 5},
    "DynamicQuantizeMatMul": {1, 4}, "MatMulNBits": {1, 3}, "GatherBlockQuantized": {0, 3},
}


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Payload bytes of a tensor, from its raw data, its external-data length or its dims."""
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        # parsed as every reader of the data parses them (_fileio.ExternalRanges), in the same
        # words: the file is not read here, so a range beyond its end is not looked for
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else None
        except ValueError:
            raise InvalidModelError(f"tensor {tensor.name!r} has a malformed external data offset or length") from None
        if offset < 0 or (length is not None and length < 0):
            raise InvalidModelError(f"tensor {tensor.name!r} declares external data bytes {offset}..{offset + (length or 0)}: "
                                    "a negative offset or length")
        if length is not None:
            return length
    count = int(np.prod(tensor.dims, dtype=np.int64)) if len(tensor.dims) else 1
    bits = _BITS.get(tensor.data_type)
    if bits is None:
        try:
            bits = 8 * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        except (KeyError, TypeError, ValueError):
            bits = 0
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    return (count * bits + 7) // 8


@dataclass
class WeightRow:
    name: str
    dtype: str
    shape: tuple
    bytes: int
    scheme: str
    consumers: list[str]
    location: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "bytes": self.bytes,
            "scheme": self.scheme, "consumers": list(self.consumers), "location": self.location,
        }


@dataclass
class ModelDescription:
    rows: list[WeightRow]
    by_dtype: dict[str, dict[str, int]] = field(default_factory=dict)
    by_scheme: dict[str, dict[str, int]] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=dict)
    ir_version: int = 0
    nodes: int = 0
    external_files: list[str] = field(default_factory=list)  # external-data locations, relative to the model
    # float values kept in node attributes, not tensors (sklearn-onnx's tree ensembles, linear
    # classifiers): op type -> {"nodes", "values"}; the passes leave them as they are
    attribute_floats: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ir_version": self.ir_version,
            "opsets": dict(self.opsets),
            "nodes": self.nodes,
            "external_files": list(self.external_files),
            "attribute_floats": dict(self.attribute_floats),
            "weight_bytes": self.total_bytes,
            "by_dtype": self.by_dtype,
            "by_scheme": self.by_scheme,
            "tensors": [r.to_dict() for r in self.rows],
        }


@dataclass
class _Tensor:
    name: str
    dtype: int
    dims: tuple
    nbytes: int
    location: str
    scalar_values: np.ndarray | None  # decoded only for tiny tensors (zero points)


def _small_values(tensor: onnx.TensorProto) -> np.ndarray | None:
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor_nbytes(tensor) > 4096:
        return None
    try:
        return onnx.numpy_helper.to_array(tensor)
    except Exception:  # an exotic dtype: the scheme simply says less
        return None


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor a Constant node produces (value_float(s)/value_int(s) made into tensors); None
    where a function's call gives the value (ref_attr_name: nothing stored here)."""
    for attr in node.attribute:
        if attr.ref_attr_name:
            return None
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t
        if attr.name == "value_float":
            return onnx.helper.make_tensor(node.output[0], onnx.TensorProto.FLOAT, [], [attr.f])
        if attr.name == "value_floats":
            return onnx.helper.make_tensor(node.output[0], onnx.TensorProto.FLOAT, [len(attr.floats)], list(attr.floats))
        if attr.name == "value_int":
            return onnx.helper.make_tensor(node.output[0], onnx.TensorProto.INT64, [], [attr.i])
        if attr.name == "value_ints":
            return onnx.helper.make_tensor(node.output[0], onnx.TensorProto.INT64, [len(attr.ints)], list(attr.ints))
    return None


_EXTERNAL_KEY = "\0external files"  # a key no tensor name can take: where _walk collects locations


def _note_external(tensor: onnx.TensorProto, tensors: dict) -> None:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        for entry in tensor.external_data:
            if entry.key == "location":
                tensors.setdefault(_EXTERNAL_KEY, set()).add(entry.value)


def _walk(graph: onnx.GraphProto, where: str, tensors: dict, consumers: dict, nodes: list) -> None:
    """Collect weights (name -> _Tensor) and consumers (name -> [(node, input index)]) of a graph
    and all its subgraphs. `where` is "" for the main graph, else "subgraph NODE/ATTR"."""
    prefix = f"{where}: " if where else ""
    for t in getattr(graph, "initializer", ()):  # (a FunctionProto has nodes only)
        _note_external(t, tensors)
        tensors.setdefault(t.name, _Tensor(t.name, t.data_type, tuple(t.dims), tensor_nbytes(t), prefix + "initializer", _small_values(t)))
    for sp in getattr(graph, "sparse_initializer", ()):  # stored as values + indices: the bytes are those two
        nnz = math.prod(int(d) for d in sp.values.dims)  # Python ints: hostile dims cannot wrap
        total = math.prod(int(d) for d in sp.dims)
        tensors.setdefault(sp.values.name, _Tensor(
            sp.values.name, sp.values.data_type, tuple(sp.dims), tensor_nbytes(sp.values) + tensor_nbytes(sp.indices),
            prefix + f"sparse initializer ({nnz} of {total} values)", None))
    for node in graph.node:
        nodes.append(node)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            t = _constant_tensor(node)
            if t is not None:
                _note_external(t, tensors)
                tensors.setdefault(node.output[0], _Tensor(node.output[0], t.data_type, tuple(t.dims), tensor_nbytes(t),
                                                           prefix + "Constant node", _small_values(t)))
        for index, name in enumerate(node.input):
            if name:
                consumers[name].append((node, index))
        for attr in node.attribute:
            label = f"subgraph {node.name or node.op_type}/{attr.name}"
            if attr.type == onnx.AttributeProto.GRAPH:
                _walk(attr.g, label, tensors, consumers, nodes)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for k, g in enumerate(attr.graphs):
                    _walk(g, f"{label}[{k}]", tensors, consumers, nodes)


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _dequantize_scheme(weight: _Tensor, node: onnx.NodeProto, tensors: dict) -> str:
    scale = tensors.get(node.input[1]) if len(node.input) > 1 else None
    zero = tensors.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    block = int(_attr(node, "block_size", 0) or 0)
    if block > 0:
        granularity = f"block({block})"
    elif scale is None:
        granularity = "dynamic-scale"
    elif not scale.dims or int(np.prod(scale.dims, dtype=np.int64)) <= 1:
        granularity = "tensor"
    else:
        axis = int(_attr(node, "axis", 1))
        if axis < 0 and weight.dims:
            axis += len(weight.dims)
        granularity = f"channel(axis={axis})"
    symmetric = zero is None or (zero.scalar_values is not None and not np.any(zero.scalar_values))
    return f"{dtype_name(weight.dtype)}/{granularity}/{'sym' if symmetric else 'asym'}"


def _scheme(weight: _Tensor, uses: list, tensors: dict, consumers: dict, blocks: dict) -> str:
    dtype = dtype_name(weight.dtype)
    for node, index in uses:
        op = node.op_type
        if op == "DequantizeLinear":
            if index == 0:
                return _dequantize_scheme(weight, node, tensors)
            return "dq-scale" if index == 1 else "dq-zero-point"
        if op in INTEGER_WEIGHT_OPS and index in INTEGER_WEIGHT_OPS[op] and weight.dtype not in FLOAT_TYPES:
            return f"{dtype}/{op}"
        if op == "Gather" and len(node.input) > 1:
            other = tensors.get(node.input[1 - index]) if index in (0, 1) else None
            if other is not None:
                if index == 1 and weight.dtype not in FLOAT_TYPES and other.dtype in FLOAT_TYPES:
                    table = int(other.dims[0]) if other.dims else 1
                    return f"palette({table})"
                if index == 0 and weight.dtype in FLOAT_TYPES and other.dtype not in FLOAT_TYPES and other.nbytes > 64:
                    return "palette-table"
        if op == "Cast" and weight.dtype not in FLOAT_TYPES and weight.dtype != onnx.TensorProto.BOOL:
            to = _attr(node, "to")
            if to in FLOAT_TYPES and any(n.op_type == "Mul" for n, _ in consumers.get(node.output[0], [])):
                block = blocks.get(weight.name)
                return f"{dtype}/cast-scale" + (f"/block({block})" if block else "")
    if weight.dtype in FLOAT_TYPES:
        return "float"
    if weight.dtype == onnx.TensorProto.BOOL:
        return "bool"
    if weight.dtype in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return "other"
    return "integer"


def _blocked_levels(g: onnx.GraphProto) -> dict:
    """levels name -> block size of the auto mode's blocked Cast -> Mul -> Reshape weights
    (cast_levels.blocked_patterns; written in the main graph only)."""
    from .cast_levels import blocked_patterns

    if any(t.data_location == onnx.TensorProto.EXTERNAL and t.data_type == onnx.TensorProto.INT64 for t in g.initializer):
        return {}  # (the patterns read their Reshape's shape values, which are not read here)
    return {q_t.name: block for *_, q_t, _s, _shape, _axis, block in blocked_patterns(g)}


def _rows(tensors: dict, consumers: dict, blocks: dict) -> list[WeightRow]:
    """One WeightRow per tensor of one scope (the main graph with its subgraphs, or a function)."""
    rows = []
    for name, t in tensors.items():
        uses = consumers.get(name, [])
        labels = []
        for node, _ in uses:
            label = f"{node.op_type}({node.name})" if node.name else node.op_type
            if label not in labels:
                labels.append(label)
        rows.append(WeightRow(name=name, dtype=dtype_name(t.dtype), shape=t.dims, bytes=t.nbytes,
                              scheme=_scheme(t, uses, tensors, consumers, blocks), consumers=labels, location=t.location))
    return rows


def describe_model(model) -> ModelDescription:
    """Every weight of `model` (ModelProto, .onnx or .onnxz path; a .onnx's external data is not
    read) with its scheme. Returns a ModelDescription: `rows` (a WeightRow per tensor: name, dtype,
    shape, bytes, scheme such as 'int8/channel(axis=0)/DequantizeLinear' or 'float', consumers,
    location: initializer, Constant node, subgraph or function body), `by_dtype` and `by_scheme`
    ({key: {"count", "bytes"}}), `opsets`, `ir_version`, `nodes`, `external_files`,
    `attribute_floats` (float values held in node attributes), `total_bytes`. Raises what
    passes.load_model raises (FileAccessError, InvalidModelError, CorruptFileError)."""
    if isinstance(model, (str, os.PathLike)) and not str(model).endswith(".onnxz"):
        model = load_model(model, load_external=False)
    else:
        model = load_model(model)
    tensors: dict[str, _Tensor] = {}
    consumers: dict[str, list] = defaultdict(list)
    nodes: list = []
    _walk(model.graph, "", tensors, consumers, nodes)
    external = tensors.pop(_EXTERNAL_KEY, set())
    rows = _rows(tensors, consumers, _blocked_levels(model.graph))
    # model-local functions' bodies (their Constant nodes: weights a function-per-module export
    # keeps there) are scopes of their own: the same name in two functions is two tensors
    for fn in model.functions:
        where = f"function {fn.domain}:{fn.name}" + (f" ({fn.overload})" if fn.overload else "")
        fn_tensors: dict[str, _Tensor] = {}
        fn_consumers: dict[str, list] = defaultdict(list)
        _walk(fn, where, fn_tensors, fn_consumers, [])
        external |= fn_tensors.pop(_EXTERNAL_KEY, set())
        rows += _rows(fn_tensors, fn_consumers, {})
    external = sorted(external)
    by_dtype: dict[str, dict[str, int]] = {}
    by_scheme: dict[str, dict[str, int]] = {}
    for r in rows:
        for table, key in ((by_dtype, r.dtype), (by_scheme, r.scheme)):
            entry = table.setdefault(key, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += r.bytes
    sort = lambda table: dict(sorted(table.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])))
    return ModelDescription(
        rows=rows, by_dtype=sort(by_dtype), by_scheme=sort(by_scheme),
        opsets={(o.domain or "ai.onnx"): int(o.version) for o in model.opset_import},
        ir_version=int(model.ir_version), nodes=len(nodes), external_files=external,
        attribute_floats=_attribute_floats(model),
    )


def _attribute_floats(model: onnx.ModelProto) -> dict[str, dict[str, int]]:
    from .quantize import DEFAULT_MIN_ELEMENTS, attribute_weights

    return {op: {"nodes": n, "values": v} for op, (n, v) in attribute_weights(model, DEFAULT_MIN_ELEMENTS).items()}


# operators whose outputs are random draws: two runs on the same inputs differ
RANDOM_OPS = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli")


def random_nodes(model) -> dict[str, int]:
    """Nodes whose outputs differ between two runs on the same inputs, by label -> count: the
    RANDOM_OPS, and Dropout in training mode (its training_mode input a constant True, or a graph
    input the caller may set; before opset 7 its is_test attribute 0). A training-mode export
    (PyTorch's model.train()) has them: no fidelity measure can hold on such outputs, and the
    reports say why instead of only failing (the auto mode found no plan meeting any target)."""
    model = load_model(model)
    from .graph import iter_graphs, tensor_to_array

    constants: dict[str, Any] = {}
    inputs: set[str] = set()
    for info in iter_graphs(model):
        g = info.graph
        inputs.update(v.name for v in g.input)
        for t in g.initializer:
            if t.data_type == onnx.TensorProto.BOOL:
                constants[t.name] = t
        for node in g.node:
            if node.op_type == "Constant" and node.output:
                for a in node.attribute:
                    if a.name == "value" and a.t.data_type == onnx.TensorProto.BOOL:
                        constants[node.output[0]] = a.t
    inputs -= set(constants)
    found: dict[str, int] = defaultdict(int)
    for info in iter_graphs(model):
        for node in info.graph.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in RANDOM_OPS:
                found[node.op_type] += 1
            elif node.op_type == "Dropout":
                mode = node.input[2] if len(node.input) > 2 else ""
                if mode in constants:
                    try:
                        training = bool(np.asarray(tensor_to_array(constants[mode])).any())
                    except Exception:  # noqa: BLE001 - an unreadable flag: say it may be random
                        training = True
                    if training:
                        found["Dropout (training_mode true)"] += 1
                elif mode in inputs:
                    found[f"Dropout (training_mode from input {mode!r})"] += 1
                elif _attr(node, "is_test", 1) == 0:
                    found["Dropout (is_test 0)"] += 1
    return dict(found)


def random_nodes_note(model) -> str | None:
    """A report note naming the random nodes of `model`, None when it has none."""
    found = random_nodes(model)
    if not found:
        return None
    parts = ", ".join(f"{n} {label}" for label, n in sorted(found.items()))
    return (f"the model draws random values ({parts}): two runs of it on the same inputs differ, so no fidelity "
            "figure holds; export it in inference mode (PyTorch: model.eval()) to measure it")
