"""Ways to damage an `.onnxz` file.

Blind mutations (what a bad disk, a truncated download or a bad copy does): byte and bit flips,
truncations, random overwrites, insertions, deletions, splices of two files. Their checksums are
left as they are, so a reader must notice every one of them.

Crafted mutations (what someone writing a hostile file does): change one value of the index
(sizes, offsets, counts, codec parameters, names, shapes), one header field, or swap a plane
for a zstd frame that decodes to something else, then recompute every checksum and length so
that the file passes the integrity checks and reaches the parser's validation logic.
"""
from __future__ import annotations

import json
import random
import struct
import zlib
from typing import Callable, List, Tuple

import zstandard as zstd

HEADER_SIZE = 64
_HEADER = struct.Struct("<8sHHIQQQQI8s")


# ---------------------------------------------------------------------- blind

def flip_byte(data: bytes, i: int, mask: int = 0xFF) -> bytes:
    d = bytearray(data)
    d[i] ^= mask
    return bytes(d)


def truncate(data: bytes, n: int) -> bytes:
    return data[:n]


def overwrite(data: bytes, i: int, chunk: bytes) -> bytes:
    return data[:i] + chunk + data[i + len(chunk):]


def insert(data: bytes, i: int, chunk: bytes) -> bytes:
    return data[:i] + chunk + data[i:]


def delete(data: bytes, i: int, n: int) -> bytes:
    return data[:i] + data[i + n:]


def splice(a: bytes, b: bytes, i: int, j: int) -> bytes:
    """The head of `a` up to i, then the tail of `b` from j."""
    return a[:i] + b[j:]


def random_blind(rng: random.Random, data: bytes, others: List[bytes]) -> Tuple[str, bytes]:
    """One blind mutation chosen at random; (description, bytes)."""
    n = len(data)
    kind = rng.choice(["flip", "bit", "bits", "truncate", "overwrite", "insert", "delete", "splice", "zero_run", "append"])
    if kind == "flip":
        i = rng.randrange(n)
        return f"flip byte {i}", flip_byte(data, i, rng.randrange(1, 256))
    if kind == "bit":
        i = rng.randrange(n)
        return f"flip bit {i}.{(b := rng.randrange(8))}", flip_byte(data, i, 1 << b)
    if kind == "bits":
        d = data
        for _ in range(rng.randint(2, 8)):
            d = flip_byte(d, rng.randrange(n), 1 << rng.randrange(8))
        return "flip several bits", d
    if kind == "truncate":
        i = rng.randrange(n)
        return f"truncate to {i}", truncate(data, i)
    if kind == "overwrite":
        i = rng.randrange(n)
        chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return f"overwrite {len(chunk)} at {i}", overwrite(data, i, chunk)
    if kind == "insert":
        i = rng.randrange(n + 1)
        chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return f"insert {len(chunk)} at {i}", insert(data, i, chunk)
    if kind == "delete":
        i = rng.randrange(n)
        k = rng.randint(1, 64)
        return f"delete {k} at {i}", delete(data, i, k)
    if kind == "splice":
        other = rng.choice(others) if others else data
        i, j = rng.randrange(n), rng.randrange(len(other))
        return f"splice {i}<-{j}", splice(data, other, i, j)
    if kind == "zero_run":
        i = rng.randrange(n)
        k = rng.randint(1, 512)
        return f"zero {k} at {i}", overwrite(data, i, bytes(min(k, n - i)))
    chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return f"append {len(chunk)}", data + chunk


# ---------------------------------------------------------------------- crafted

def read_index(data: bytes) -> Tuple[dict, tuple]:
    """(index JSON object, header fields) of an intact file."""
    fields = _HEADER.unpack(data[:60])
    ioff, ilen = fields[4], fields[5]
    text = zstd.ZstdDecompressor().decompress(data[ioff:ioff + ilen])
    return json.loads(text), fields


def write_with_index(data: bytes, index: dict, *, body: bytes | None = None, header_changes: dict | None = None) -> bytes:
    """The file rebuilt around `index` (and `body`: the bytes between header and index), with
    lengths and CRCs recomputed so that the integrity checks pass."""
    text = json.dumps(index, separators=(",", ":")).encode("utf-8")
    return write_with_index_text(data, text, body=body, header_changes=header_changes)


def write_with_index_text(data: bytes, text: bytes, *, body: bytes | None = None, header_changes: dict | None = None,
                          level: int = 3) -> bytes:
    """As write_with_index, from the index's raw bytes: malformed JSON, or a valid index padded to
    a decompression bomb (`level` 19 shrinks 100 MiB of spaces to a few kB)."""
    fields = list(_HEADER.unpack(data[:60]))
    if body is None:
        body = data[HEADER_SIZE:fields[4]]
    frame = zstd.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress(text)
    ioff = HEADER_SIZE + len(body)
    fields[4], fields[5], fields[6], fields[7], fields[8] = ioff, len(frame), len(text), ioff + len(frame), zlib.crc32(frame)
    names = ["magic", "major", "minor", "flags", "index_offset", "index_length", "index_raw_length", "file_length", "index_crc", "reserved"]
    for k, v in (header_changes or {}).items():
        fields[names.index(k)] = v
    head = _HEADER.pack(*fields)
    return head + struct.pack("<I", zlib.crc32(head)) + body + frame


def with_header(data: bytes, **changes) -> bytes:
    """Header fields changed, header CRC recomputed (the rest untouched)."""
    fields = list(_HEADER.unpack(data[:60]))
    names = ["magic", "major", "minor", "flags", "index_offset", "index_length", "index_raw_length", "file_length", "index_crc", "reserved"]
    for k, v in changes.items():
        fields[names.index(k)] = v
    head = _HEADER.pack(*fields)
    return head + struct.pack("<I", zlib.crc32(head)) + data[HEADER_SIZE:]


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON object, leaves and containers."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    target = obj
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return obj


def _delete(obj, path):
    target = obj
    for p in path[:-1]:
        target = target[p]
    del target[path[-1]]


BOUNDARY_INTS = [0, 1, -1, 2, 3, 7, 63, 64, 65, 255, 256, 4095, 4096, 1 << 20, (1 << 26) + 1, 1 << 31, (1 << 32) - 1,
                 1 << 32, 1 << 40, 1 << 62, (1 << 62) + 1, 1 << 63, 1 << 64, -(1 << 62), -(1 << 63)]
ODD_VALUES = [None, True, False, 1.5, float("nan"), "", "x", "../../etc/passwd", "/abs", "a\u0000b", "bytes", "planes",
              "fplanes", "narrow", "zstd9", [], {}, [[]], [1, 2], {"codec": "bytes"}, "\u202e", "0" * 5000]


def mutate_value(rng: random.Random, value):
    if isinstance(value, bool) or value is None:
        return rng.choice(BOUNDARY_INTS + ODD_VALUES)
    if isinstance(value, int):
        choice = rng.random()
        if choice < 0.5:
            return rng.choice(BOUNDARY_INTS)
        if choice < 0.85:
            return value + rng.choice([-65, -64, -8, -4, -2, -1, 1, 2, 4, 8, 64, 65, 4096])
        return rng.choice(ODD_VALUES)
    if isinstance(value, str):
        return rng.choice(ODD_VALUES + [value + "#2", value.upper(), value[:-1], value + "/x", "sub/" + value])
    if isinstance(value, list):
        choice = rng.random()
        if choice < 0.3 and value:
            return value[:-1]
        if choice < 0.5 and value:
            return value + [value[-1]]
        if choice < 0.6 and value:
            return list(reversed(value))
        if choice < 0.7:
            return value * 2
        return rng.choice(ODD_VALUES + [[0] * 70])
    if isinstance(value, dict):
        return rng.choice(ODD_VALUES)
    return rng.choice(BOUNDARY_INTS)


def random_crafted(rng: random.Random, data: bytes) -> Tuple[str, bytes]:
    """One crafted mutation of an intact file; (description, bytes with checksums recomputed)."""
    index, fields = read_index(data)
    kinds, weights = ["index", "index2", "delete_key", "header", "frame_swap", "frame_bomb", "dup_tensor"], [40, 15, 10, 10, 10, 10, 5]
    if any(_is_same(t) for t in index.get("tensors", [])):
        # (format 1.4 files only: the specs of older samples draw as before)
        kinds, weights = kinds + ["same"], weights + [30]
    kind = rng.choices(kinds, weights=weights)[0]
    if kind == "same":
        desc = _retarget_same(rng, index)
        return desc, write_with_index(data, index)
    if kind in ("index", "index2"):
        desc = []
        for _ in range(1 if kind == "index" else rng.randint(2, 4)):
            paths = list(_paths(index))
            path, value = rng.choice(paths[1:])
            new = mutate_value(rng, value)
            index = _set(index, path, new)
            desc.append(f"{'/'.join(map(str, path))}={_short(new)}")
        return "index " + ", ".join(desc), write_with_index(data, index)
    if kind == "delete_key":
        paths = [p for p, _ in _paths(index) if p and isinstance(p[-1], str)]
        path = rng.choice(paths)
        _delete(index, path)
        return f"index delete {'/'.join(map(str, path))}", write_with_index(data, index)
    if kind == "header":
        name, value = rng.choice([
            ("major", rng.choice([0, 2, 65535])), ("minor", rng.choice([1, 65535])), ("flags", rng.choice([1, 1 << 31])),
            ("index_raw_length", rng.choice([0, 1, fields[6] - 1, fields[6] + 1, 1 << 40])),
            ("index_offset", rng.choice([0, 63, 64, fields[4] + 1])), ("reserved", b"\x01" * 8),
        ])
        return f"header {name}={_short(value)}", with_header(data, **{name: value})
    chunks = [(p, v) for p, v in _paths(index) if len(p) >= 2 and p[-2] == "chunks" and isinstance(v, list) and len(v) == 3]
    if not chunks:
        return "no chunk to swap", data
    path, (offset, raw, planes) = rng.choice(chunks)
    body = bytearray(data[HEADER_SIZE:fields[4]])
    start = offset - HEADER_SIZE
    frames, pos = [], start
    for ln in planes:
        frames.append(bytes(body[pos:pos + ln]))
        pos += ln
    k = rng.randrange(len(frames))
    plane_raw = len(zstd.ZstdDecompressor().decompress(frames[k]))
    if kind == "frame_swap":  # same size, other content, valid checksum
        replacement = zstd.ZstdCompressor(level=1, write_checksum=True).compress(bytes(rng.randrange(256) for _ in range(plane_raw)))
        desc = "plane replaced by another valid frame"
    elif kind == "frame_bomb":  # declares far more than the chunk needs
        big = rng.choice([plane_raw + 1, plane_raw * 2, 1 << 26, (1 << 26) + 1])
        replacement = zstd.ZstdCompressor(level=1, write_checksum=True).compress(bytes(big))
        desc = f"plane replaced by a frame of {big} bytes"
    else:  # dup_tensor: the same chunk referenced twice
        tensors = index.get("tensors", [])
        if not tensors:
            return "no tensor", data
        t = rng.choice(tensors)
        tensors.append(dict(t, key=t.get("key", "") + "#dup"))
        return "tensor listed twice", write_with_index(data, index)
    frames[k] = replacement
    new_body = bytes(body[:start]) + b"".join(frames) + bytes(body[pos:])
    delta = len(replacement) - planes[k]
    # shift every chunk stored after this one, and the plane length
    for p, v in _paths(index):
        if len(p) >= 2 and p[-2] == "chunks" and isinstance(v, list) and len(v) == 3 and v[0] > offset:
            v[0] += delta
    planes[k] = len(replacement)
    _set(index, path, [offset, raw, planes])
    return desc, write_with_index(data, index, body=new_body)


def _is_same(t) -> bool:
    return isinstance(t, dict) and isinstance(t.get("stream"), dict) and t["stream"].get("codec") == "same"


def _retarget_same(rng: random.Random, index: dict) -> str:
    """One hostile edit of the codec `same` (FORMAT.md 3.3), in place: a `same` naming itself, a
    later tensor, one out of range, one of another length, a non-integer; a coded stream turned
    into `same`; `same` as a skeleton or inside `narrow`; `same` with chunks of its own."""
    tensors = index["tensors"]
    at = [i for i, t in enumerate(tensors) if _is_same(t)]
    i = rng.choice(at)
    stream = tensors[i]["stream"]
    choice = rng.choice(["self", "later", "range", "other_length", "odd", "make_same", "skeleton", "narrow",
                         "chunks", "chain"])
    if choice == "self":
        stream["params"]["tensor"] = i
    elif choice == "later":
        stream["params"]["tensor"] = rng.choice([j for j in range(i + 1, len(tensors) + 1)] or [i + 1])
    elif choice == "range":
        stream["params"]["tensor"] = rng.choice([-1, len(tensors), 1 << 31, 1 << 63, -(1 << 63)])
    elif choice == "other_length":
        others = [j for j, t in enumerate(tensors) if j < i and t.get("length") != tensors[i].get("length")]
        stream["params"]["tensor"] = rng.choice(others) if others else 0
    elif choice == "odd":
        stream["params"]["tensor"] = rng.choice(ODD_VALUES + [True, False, 0.0, "0", [0]])
    elif choice == "make_same":  # a coded tensor (maybe the one others name) turned into `same`
        coded = [j for j, t in enumerate(tensors) if isinstance(t.get("stream"), dict) and not _is_same(t)]
        j = rng.choice(coded) if coded else i
        tensors[j]["stream"] = {"codec": "same", "params": {"tensor": rng.choice([0, max(j - 1, 0), j])}}
        i = j
    elif choice == "skeleton":
        index["files"][rng.randrange(len(index["files"]))]["skeleton"] = {"codec": "same", "params": {"tensor": 0}}
    elif choice == "narrow":
        tensors[i]["stream"] = {"codec": "narrow", "params": {"from": 11, "to": 1, "inner": dict(stream)}}
    elif choice == "chunks":
        stream["chunks"] = [[64, tensors[i].get("length", 4), [4], 0]]
    else:  # chain: name another `same` (legal when it is earlier: FORMAT.md 3.3)
        stream["params"]["tensor"] = rng.choice(at)
    return f"same {choice} at tensor {i}"


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


MUTATORS: dict[str, Callable] = {"blind": random_blind, "crafted": random_crafted}
