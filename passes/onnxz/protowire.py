"""Find the tensor payloads of a serialised ONNX model by walking the protobuf wire format.

The pack stage must restore the model file byte for byte, so it never parses and re-serialises
the model: it reads tags and lengths only, descends into the messages that can hold tensors
(graphs, nodes, attributes, functions, training info, sparse tensors) and records, for every
TensorProto, where its payload bytes lie in the file. Everything else is left untouched.

Field numbers are those of onnx.proto (stable across ONNX releases).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

# wire types
VARINT, FIXED64, LEN, SGROUP, EGROUP, FIXED32 = 0, 1, 2, 3, 4, 5

# message kinds -> {field number: (child kind, context label)}
_MODEL, _GRAPH, _NODE, _ATTR, _TENSOR, _SPARSE, _FUNCTION, _TRAINING = range(8)
_CHILDREN = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNCTION},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTR},
    _ATTR: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
    _FUNCTION: {7: _NODE, 11: _ATTR},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
}

# TensorProto payload fields: number -> name (all packed repeated scalars or bytes)
PAYLOAD_FIELDS = {4: "float_data", 5: "int32_data", 7: "int64_data", 9: "raw_data", 10: "double_data", 11: "uint64_data"}
_MAX_DEPTH = 64


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message of the expected shape."""


@dataclass
class TensorRef:
    """One TensorProto found in the file and where its payload lies."""

    name: str
    dtype: int
    shape: List[int]
    field: str  # raw_data | float_data | ... | external
    offset: int  # payload byte range in the model file (field "external": in the data file)
    length: int
    context: str  # e.g. "Constant node output 'x'" used to name unnamed tensors
    location: Optional[str] = None  # external data file, as written in the model
    external: dict = field(default_factory=dict)


def write_varint(v: int) -> bytes:
    """Protobuf base-128 varint of `v` (negative values as their 64-bit two's complement)."""
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if not v:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def read_varint(buf, pos: int, end: int):
    """(value, new position); WireError on a truncated or over-long varint."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _skip(buf, wire: int, pos: int, end: int) -> int:
    if wire == VARINT:
        return read_varint(buf, pos, end)[1]
    if wire == FIXED64:
        pos += 8
    elif wire == FIXED32:
        pos += 4
    elif wire == LEN:
        n, pos = read_varint(buf, pos, end)
        pos += n
    else:
        raise WireError(f"unsupported wire type {wire}")
    if pos > end:
        raise WireError("field runs past the end of its message")
    return pos


def _fields(buf, start: int, end: int):
    """Yield (field number, wire type, value start, value end) of one message's fields."""
    # one-byte keys and lengths (nearly all of them) read inline: the walk of a model with many
    # nodes spent most of its time in read_varint calls
    pos = start
    while pos < end:
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == LEN:
            if pos < end and buf[pos] < 0x80:
                n, vstart = buf[pos], pos + 1
            else:
                n, vstart = read_varint(buf, pos, end)
            vend = vstart + n
            if vend > end:
                raise WireError("length-delimited field runs past the end of its message")
            yield number, wire, vstart, vend
            pos = vend
        else:
            vstart = pos
            pos = _skip(buf, wire, pos, end)
            yield number, wire, vstart, pos


def _text(buf, a: int, b: int) -> str:
    return str(buf[a:b], "utf-8", "replace")


def _tensor(buf, start: int, end: int, context: str, out: List[TensorRef]) -> None:
    name, dtype, dims, location_kind = "", 0, [], 0
    payloads = []
    external = {}
    for number, wire, a, b in _fields(buf, start, end):
        if number == 8 and wire == LEN:
            name = _text(buf, a, b)
        elif number == 2 and wire == VARINT:
            dtype = read_varint(buf, a, b)[0]
        elif number == 1:
            if wire == VARINT:
                dims.append(read_varint(buf, a, b)[0])
            elif wire == LEN:  # packed dims
                p = a
                while p < b:
                    v, p = read_varint(buf, p, b)
                    dims.append(v)
        elif number == 14 and wire == VARINT:
            location_kind = read_varint(buf, a, b)[0]
        elif number == 13 and wire == LEN:  # StringStringEntryProto
            key = value = ""
            for n2, w2, a2, b2 in _fields(buf, a, b):
                if n2 == 1 and w2 == LEN:
                    key = _text(buf, a2, b2)
                elif n2 == 2 and w2 == LEN:
                    value = _text(buf, a2, b2)
            external[key] = value
        elif number in PAYLOAD_FIELDS and wire == LEN and b > a:
            payloads.append((PAYLOAD_FIELDS[number], a, b))
    # dims are int64 in two's complement; negative dims are invalid but must not break the walk
    dims = [d - (1 << 64) if d >= 1 << 63 else d for d in dims]
    if location_kind == 1:  # EXTERNAL
        try:
            offset = int(external.get("offset", "0") or 0)
            length = int(external["length"]) if external.get("length") else -1
        except ValueError:  # reported, not skipped: pack refuses it (it would leave its data file out)
            offset, length = -1, -1
        out.append(TensorRef(name, dtype, dims, "external", offset, length, context, external.get("location"), external))
        return
    for fname, a, b in payloads:
        out.append(TensorRef(name, dtype, dims, fname, a, b - a, context))
    if not payloads:  # strings, empty tensors, unpacked repeated fields: the whole message
        out.append(TensorRef(name, dtype, dims, "proto", start, end - start, context))


def _walk(buf, start: int, end: int, kind: int, context: str, out: List[TensorRef], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise WireError("messages nested too deeply")
    if kind == _TENSOR:
        _tensor(buf, start, end, context, out)
        return
    children = _CHILDREN[kind]
    node_output = node_name = attr_name = op_type = ""
    # one pass over the fields: the children to descend into are kept, and walked after the
    # names (which label the tensors inside) are known, in file order
    found = []
    for number, wire, a, b in _fields(buf, start, end):
        if wire != LEN:
            continue
        child = children.get(number)
        if child is not None:
            found.append((child, a, b))
        elif kind == _NODE:
            if number == 2 and not node_output:
                node_output = _text(buf, a, b)
            elif number == 3:
                node_name = _text(buf, a, b)
            elif number == 4:
                op_type = _text(buf, a, b)
        elif kind == _ATTR and number == 1:
            attr_name = _text(buf, a, b)
    if kind == _NODE:
        # a Constant node's tensor is known by the node's output; other nodes' by node/attribute
        context = node_output if op_type == "Constant" and node_output else "\0" + (node_name or node_output or context)
    elif kind == _ATTR:
        context = context[1:] + "/" + attr_name if context.startswith("\0") else context
    for child, a, b in found:
        _walk(buf, a, b, child, context, out, depth + 1)


def find_tensors(buf) -> List[TensorRef]:
    """Every tensor payload of a serialised ModelProto, in file order. WireError when malformed."""
    out: List[TensorRef] = []
    _walk(memoryview(buf), 0, len(buf), _MODEL, "", out, 0)
    return out
