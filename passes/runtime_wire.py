"""A model's skeleton straight from its serialised bytes, without parsing (or touching) the weights.

`strip_main_graph_payloads(buf)` walks the protobuf wire format of a ModelProto and copies it,
leaving out the payload of every big tensor of the main graph (initializers and Constant-node
values), fixing the enclosing lengths. Only tags and lengths are read, so a memory-mapped file or a
buffer whose payload pages were never written stays unread: a 3 GB `.onnx` costs the size of its
graph, and each weight can then be viewed in place (`np.frombuffer` on the mapping) or decoded on
its own. Subgraph tensors stay inline (they are small in practice and onnxruntime cannot take them
as OrtValues).

Field numbers are onnx.proto's (stable across releases): ModelProto.graph = 7; GraphProto.node = 1,
initializer = 5; NodeProto.op_type = 4, attribute = 5, output = 2; AttributeProto.name = 1, t = 5;
TensorProto dims = 1, data_type = 2, name = 8, raw_data = 9, float_data = 4, double_data = 10,
data_location = 14.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from onnx import TensorProto, helper

from .onnxz.protowire import WireError, read_varint, write_varint

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5

# payload fields whose bytes are the little-endian values themselves (viewable in place)
_VIEWABLE = {9: "raw_data", 4: "float_data", 10: "double_data"}


@dataclasses.dataclass
class StrippedTensor:
    name: str          # initializer name, or the Constant node's output
    dtype: int         # TensorProto data type
    shape: list
    field: str         # raw_data | float_data | double_data
    offset: int        # payload bytes [offset, offset + length) in the buffer
    length: int
    constant_node: bool

    def view(self, buf) -> np.ndarray:
        """The tensor's values as an array over `buf` (no copy; read-only for a read-only buffer)."""
        np_type = helper.tensor_dtype_to_np_dtype(self.dtype)
        count = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        return np.frombuffer(buf, dtype=np_type, count=count, offset=self.offset).reshape(self.shape)


def _fields(buf, start: int, end: int):
    """(number, wire, field start, value start, value end) of one message's fields."""
    pos = start
    while pos < end:
        fstart = pos
        key = buf[pos]  # (one-byte keys and lengths, the common case, read inline: a graph has
        if key < 0x80:  # thousands of fields and a call per varint was most of this walk)
            pos += 1
        else:
            key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == LEN:
            if pos < end and buf[pos] < 0x80:
                n, vstart = buf[pos], pos + 1
            else:
                n, vstart = read_varint(buf, pos, end)
            vend = vstart + n
        elif wire == VARINT:
            vstart = pos
            vend = read_varint(buf, pos, end)[1]
        elif wire == FIXED64:
            vstart, vend = pos, pos + 8
        elif wire == FIXED32:
            vstart, vend = pos, pos + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        if vend > end or number == 0:
            raise WireError("malformed protobuf field")
        yield number, wire, fstart, vstart, vend
        pos = vend


def _tensor_info(buf, start, end, fields=None):
    """(name, dtype, dims, payload field, a, b, external) of a TensorProto (`fields`: its
    _fields, when the caller has listed them)."""
    name, dtype, dims, payload, external = "", 0, [], None, False
    for number, wire, _, a, b in fields if fields is not None else _fields(buf, start, end):
        if number == 8 and wire == LEN:
            name = bytes(buf[a:b]).decode("utf-8", "replace")
        elif number == 2 and wire == VARINT:
            dtype = read_varint(buf, a, b)[0]
        elif number == 1 and wire == VARINT:
            dims.append(read_varint(buf, a, b)[0])
        elif number == 1 and wire == LEN:
            p = a
            while p < b:
                v, p = read_varint(buf, p, b)
                dims.append(v)
        elif number == 14 and wire == VARINT:
            external = read_varint(buf, a, b)[0] == 1
        elif number in _VIEWABLE and wire == LEN and b > a:
            payload = (_VIEWABLE[number], a, b)
    return name, dtype, dims, payload, external


_ITEMSIZE: dict = {}  # TensorProto data type -> numpy item size (None: no numpy type)


def _itemsize(dtype) -> int | None:
    size = _ITEMSIZE.get(dtype, 0)
    if size == 0:
        try:
            size = np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize
        except (KeyError, TypeError, ValueError):
            size = None
        _ITEMSIZE[dtype] = size
    return size


def _strippable(dtype, dims, payload, external, min_bytes) -> bool:
    if external or payload is None or any(d >= 1 << 63 for d in dims):
        return False
    field, a, b = payload
    if b - a <= min_bytes:
        return False
    if field == "float_data" and dtype != TensorProto.FLOAT or field == "double_data" and dtype != TensorProto.DOUBLE:
        return False
    if dtype in (TensorProto.STRING, TensorProto.UNDEFINED):
        return False
    itemsize = _itemsize(dtype)
    if itemsize is None:
        return False
    # (math.prod of Python ints: numpy's prod per tensor cost more than the rest of this check;
    # dims are below 2**63, the product is exact)
    if dtype in (TensorProto.INT4, TensorProto.UINT4) or itemsize * math.prod(dims) != b - a:
        return False  # packed sub-byte types and odd layouts decode through onnx instead
    return True


def strip_main_graph_payloads(buf, min_bytes: int) -> tuple[bytes, list]:
    """(skeleton bytes, [StrippedTensor]) for a serialised ModelProto in `buf`."""
    mv = memoryview(buf)
    stripped: list = []
    out = bytearray()
    for number, wire, fstart, a, b in _fields(mv, 0, len(mv)):
        if number == 7 and wire == LEN:
            graph = _strip_graph(mv, a, b, min_bytes, stripped)
            out += write_varint(7 << 3 | LEN) + write_varint(len(graph)) + graph
        else:
            out += mv[fstart:b]
    return bytes(out), stripped


def _strip_graph(mv, start, end, min_bytes, stripped) -> bytes:
    out = bytearray()
    kept = start  # fields from here up to the current one are copied unchanged, in one slice
    for number, wire, fstart, a, b in _fields(mv, start, end):
        if b - a <= min_bytes:  # (a message this small holds no payload worth stripping)
            continue
        if number == 5 and wire == LEN:  # initializer
            new, tag = _strip_tensor(mv, a, b, min_bytes, stripped, None), 5
        elif number == 1 and wire == LEN and _may_be_constant(mv, a, b):  # only a Constant's value is stripped
            new, tag = _strip_constant_node(mv, a, b, min_bytes, stripped), 1
        else:
            continue
        if new is not None:
            out += mv[kept:fstart]
            out += write_varint(tag << 3 | LEN) + write_varint(len(new)) + new
            kept = b
    out += mv[kept:end]
    return bytes(out)


def _strip_tensor(mv, start, end, min_bytes, stripped, constant_output) -> bytes | None:
    fields = list(_fields(mv, start, end))  # (walked once: read, then copied without the payload)
    name, dtype, dims, payload, external = _tensor_info(mv, start, end, fields)
    if not _strippable(dtype, dims, payload, external, min_bytes):
        return None
    field, pa, pb = payload
    stripped.append(StrippedTensor(constant_output or name, dtype, dims, field, pa, pb - pa, constant_output is not None))
    out = bytearray()
    kept = start  # the fields around the payload, each side in one slice
    for _, _, fstart, a, b in fields:
        if a == pa and b == pb:
            out += mv[kept:fstart]
            kept = b
    out += mv[kept:end]
    return bytes(out)


# serialisers write a node's fields in field order (input, output, name, op_type, attribute, ...):
# "Constant" (op_type) lies within the first bytes of a Constant node, before its value
_OP_TYPE_WINDOW = 4096


def _may_be_constant(mv, start, end) -> bool:
    """A cheap filter before walking a node's fields: False only when the node cannot be a
    Constant written in field order (a node written otherwise keeps its value inline: correct,
    only not stripped)."""
    return b"Constant" in bytes(mv[start:min(end, start + _OP_TYPE_WINDOW)])


def _strip_constant_node(mv, start, end, min_bytes, stripped) -> bytes | None:
    op_type, output, domain = "", None, ""
    for number, wire, _, a, b in _fields(mv, start, end):
        if number == 4 and wire == LEN:
            op_type = bytes(mv[a:b]).decode("utf-8", "replace")
        elif number == 2 and wire == LEN and output is None:
            output = bytes(mv[a:b]).decode("utf-8", "replace")
        elif number == 7 and wire == LEN:
            domain = bytes(mv[a:b]).decode("utf-8", "replace")
    if op_type != "Constant" or domain not in ("", "ai.onnx") or not output:
        return None
    return _rewrite_field(mv, _fields(mv, start, end), 5,
                          lambda a, b: _strip_value_attribute(mv, a, b, min_bytes, stripped, output))


def _strip_value_attribute(mv, start, end, min_bytes, stripped, output) -> bytes | None:
    fields = list(_fields(mv, start, end))
    name = next((bytes(mv[a:b]).decode() for n, w, _, a, b in fields if n == 1 and w == LEN), "")
    if name != "value":
        return None
    return _rewrite_field(mv, fields, 5, lambda a, b: _strip_tensor(mv, a, b, min_bytes, stripped, output))


def _rewrite_field(mv, fields, field_number: int, rewrite) -> bytes | None:
    """The message re-assembled with each length-delimited `field_number` replaced by
    `rewrite(a, b)` where that returns bytes; None when nothing was replaced."""
    out = bytearray()
    changed = False
    for number, wire, fstart, a, b in fields:
        if number == field_number and wire == LEN:
            new = rewrite(a, b)
            if new is not None:
                out += write_varint(field_number << 3 | LEN) + write_varint(len(new)) + new
                changed = True
                continue
        out += mv[fstart:b]
    return bytes(out) if changed else None
