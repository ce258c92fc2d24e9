"""The `.onnxz` container (FORMAT.md sections 1, 2, 4): header, index, and their validation.

Nothing read from a file is trusted: `parse_index` checks every offset, size and count against the
file and the caller's limits before anything is allocated, and turns the JSON into plain typed
records the reader can use without further checks.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import zstandard as zstd

try:  # parses the index ~2.5x faster than json (0.3-0.5 ms of a small model's unpack); same objects
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional
    _orjson = None

from ..errors import CorruptFileError, LimitExceededError, NewerFormatError
from . import codecs as _codecs
from .codecs import MAX_CHUNK_BYTES, check_params, plane_sizes

MAGIC = b"ONNXZ\r\n\x1a"
VERSION = (1, 4)  # 1.1: codec `ans` (FORMAT.md 3.1); 1.2: `ans_shared` (3.2); 1.3: the catalog (4.1); 1.4: `same` (3.3); older files still read
SAME = "same"  # 1.4: a tensor's stream that is an earlier tensor's stream (byte-identical payloads stored once, FORMAT.md 3.3)
FLAG_CATALOG = 2  # header flag (1.3): the index has a `catalog` (FORMAT.md 4.1); other flags are refused as newer
MAX_SHARED_TABLES = 4096
MAX_TABLE_BYTES = 1 + 32 + 256 * 3  # count, bitmap, 255 frequencies of at most 23 + 11 bits
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sHHIQQQQI8s")  # up to the header CRC
assert _HEADER.size == 60

INDEX_LEVEL = 15
MAX_INDEX_BYTES = 64 << 20  # JSON text (~300k tensors)
INDEX_RATIO = 256  # most JSON text per stored index byte
DEFAULT_MAX_OUTPUT_BYTES = 1 << 40  # restored bytes, all files together; callers may lower it
_PAYLOAD_FIELDS = {"raw_data", "float_data", "double_data", "int32_data", "int64_data", "uint64_data", "external", "proto"}


@dataclass
class Header:
    version: tuple
    index_offset: int
    index_length: int
    index_raw_length: int
    file_length: int
    index_crc: int
    flags: int = 0


def pack_header(index_offset: int, index_length: int, index_raw_length: int, file_length: int, index_crc: int,
                version: tuple = VERSION, flags: int = 0) -> bytes:
    body = _HEADER.pack(MAGIC, version[0], version[1], flags, index_offset, index_length, index_raw_length,
                        file_length, index_crc, b"\0" * 8)
    return body + struct.pack("<I", zlib.crc32(body))


def parse_header(data: bytes, real_size: int) -> Header:
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise CorruptFileError("not an .onnxz file (bad magic)")
    if len(data) < HEADER_SIZE:
        raise CorruptFileError("truncated .onnxz file (header incomplete)")
    magic, major, minor, flags, ioff, ilen, iraw, flen, icrc, _ = _HEADER.unpack(data[:60])
    (hcrc,) = struct.unpack("<I", data[60:64])
    if zlib.crc32(data[:60]) != hcrc:
        # a newer major version may change the header layout; still say so when the version says so
        if major > VERSION[0]:
            raise NewerFormatError(f".onnxz format {major}.{minor} was written by a newer version (this reader: {VERSION[0]}.x)")
        raise CorruptFileError("damaged .onnxz file (header checksum mismatch)")
    if major > VERSION[0] or flags & ~FLAG_CATALOG:
        raise NewerFormatError(f".onnxz format {major}.{minor} (flags {flags}) was written by a newer version (this reader: {VERSION[0]}.{VERSION[1]})")
    if major < 1:
        raise CorruptFileError(f"damaged .onnxz file (format version {major}.{minor})")
    if flen != real_size:
        what = "truncated" if real_size < flen else "damaged"
        raise CorruptFileError(f"{what} .onnxz file: header says {flen} bytes, file has {real_size}")
    if ioff < HEADER_SIZE or ioff + ilen != flen or ilen == 0:
        raise CorruptFileError("damaged .onnxz file (index position)")
    return Header((major, minor), ioff, ilen, iraw, flen, icrc, flags)


def check_index_size(header: Header, max_output_bytes: int) -> None:
    """Refuse, before decompressing it, an index whose declared size is out of proportion: with
    the stored frame (an index of JSON compresses ~10-30x; far more is a decompression bomb), with
    the caller's limit, or with MAX_INDEX_BYTES."""
    limit = min(MAX_INDEX_BYTES, max(1 << 20, INDEX_RATIO * header.index_length), max(1 << 20, max_output_bytes))
    if header.index_raw_length > limit:
        raise LimitExceededError(
            f".onnxz index declares {header.index_raw_length} bytes from {header.index_length} stored, above the limit of {limit}")


def encode_index(obj) -> bytes:
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, sort_keys=False).encode("utf-8")
    # level 15: within ~1% of 19's frame (60 bytes on a 0.2 MB model) at a third of its time,
    # which was ~10% of packing a small model
    frame = zstd.ZstdCompressor(level=INDEX_LEVEL, write_checksum=True, write_content_size=True).compress(text)
    return text, frame


def decode_index(frame: bytes, header: Header) -> dict:
    if zlib.crc32(frame) != header.index_crc:
        raise CorruptFileError("damaged .onnxz file (index checksum mismatch)")
    try:
        if zstd.frame_content_size(frame) != header.index_raw_length:
            raise CorruptFileError("damaged .onnxz file (index size)")
        # this thread's decompressor, kept (making one costs ~13 us: ~1% of a small model's unpack)
        text = _codecs._decompressor().decompress(frame, max_output_size=header.index_raw_length, allow_extra_data=False)
        # orjson reads integers past 64 bits as floats, which parse_index refuses as json's big ints
        obj = _orjson.loads(text) if _orjson is not None else json.loads(text.decode("utf-8"))
    except (zstd.ZstdError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptFileError(f"damaged .onnxz file (index unreadable: {exc})") from None
    if not isinstance(obj, dict):
        raise CorruptFileError("damaged .onnxz file (index is not an object)")
    return obj


# ---------------------------------------------------------------- typed, validated records

@dataclass
class Chunk:
    offset: int
    raw_length: int
    planes: List[int]  # stored length of each plane
    xxh3: int  # XXH3-64 (seed 0) of the chunk's stored bytes
    # `ans` / `ans_shared` chunks: (offset, stored, plane sizes, xxh3, flags) for the reader's batch
    # decoder (_planes.ans_decode_batch), made while the index is parsed (its checks already done)
    spec: Optional[tuple] = None

    @property
    def stored(self) -> int:
        return sum(self.planes)


@dataclass
class Stream:
    codec: str
    params: dict
    chunks: List[Chunk]
    raw_length: int
    tables: Optional[tuple] = None  # ans_shared: each plane's shared table (bytes) or None, for the batch decoder

    @property
    def stored(self) -> int:
        return sum(c.stored for c in self.chunks)


@dataclass
class FileEntry:
    name: str
    size: int
    sha256: str
    skeleton: Stream
    cuts: List[tuple]  # (offset, length, tensor index)
    xxh3_128: Optional[str] = None  # 1.2: the restore digest (FORMAT.md 4); None in 1.0 / 1.1 files


@dataclass
class TensorEntry:
    key: str
    name: str
    dtype: int
    shape: List[int]
    field: str
    file: int
    offset: int
    length: int
    stream: Optional[Stream]


class Index:
    """The parsed, checked index: `version`, `writer`, `files`, `raw` (the JSON object), `coded`
    (the TensorEntry of every coded tensor, by tensor index: what restoring a file reads) and
    `tensors` (every TensorEntry in index order). `tensors` is made on first use from the tensor
    objects parse_index checked: unpacking reads only the coded entries, and making and freeing the
    entries of the few hundred small tensors a small model keeps in its skeleton cost ~0.1 ms
    per open (~3% of its unpack)."""

    def __init__(self, version: tuple, writer: str, files: List[FileEntry], entries: list, coded: Dict[int, TensorEntry], raw: dict,
                 catalog: Optional[tuple] = None):
        self.version, self.writer, self.files, self.raw = version, writer, files, raw
        self.coded = coded
        self._entries = entries  # the index's tensor objects, checked by parse_index
        self._tensors: Optional[List[TensorEntry]] = None
        self._lock = threading.Lock()
        # 1.3 (FORMAT.md 4.1): (offset, stored, raw length, xxh3) of the catalog, whose stored bytes
        # the reader hands over (attach_catalog) once it has checked their XXH3-64; parsed on first use
        self.catalog = catalog
        self._catalog_frame: Optional[bytes] = None

    def attach_catalog(self, frame: bytes) -> None:
        self._catalog_frame = frame

    @property
    def tensors(self) -> List[TensorEntry]:
        entries = self._tensors
        if entries is None:
            with self._lock:  # one list for every thread: the entries' identity is stable
                entries = self._tensors
                if entries is None:
                    if self.catalog is not None:
                        entries = self._catalog_tensors()
                    else:
                        coded = self.coded
                        entries = [coded[i] if i in coded else _entry_of(t) for i, t in enumerate(self._entries)]
                    self._tensors = entries
        return entries

    def _catalog_tensors(self) -> List[TensorEntry]:
        """Every tensor entry from the catalog (1.3, FORMAT.md 4.1), checked here, on first use
        (unpacking never needs it): its size and JSON; an integer names an entry of the index's
        `tensors` (each at most once; those it does not name follow the catalog's, in index
        order); an object is an entry without a stream, checked as parse_index checks a 1.2 entry;
        keys unique across both; every entry inside its file."""
        frame = self._catalog_frame
        if frame is None:
            raise _bad("catalog not read")
        raw = self.catalog[2]
        try:
            if zstd.frame_content_size(frame) != raw:
                raise _bad("catalog size")
            text = _codecs._decompressor().decompress(frame, max_output_size=raw, allow_extra_data=False)
            items = _orjson.loads(text) if _orjson is not None else json.loads(text.decode("utf-8"))
        except (zstd.ZstdError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CorruptFileError(f"damaged .onnxz file (catalog unreadable: {exc})") from None
        if len(text) != raw or type(items) is not list:
            raise _bad("catalog")
        main = self._entries
        seen = bytearray(len(main))
        others = []
        for it in items:
            if type(it) is int:
                if not 0 <= it < len(main) or seen[it]:
                    raise _bad(f"catalog names tensor {it!r}")
                seen[it] = 1
            elif type(it) is dict:
                if it.get("stream") is not None:
                    raise _bad("catalog entry with a stream")
                others.append(it)
            else:
                raise _bad("catalog entry")
        rows = _index_rows(others, len(self.files) - 1)
        if type(rows) is str:
            raise _bad(rows)
        coded = self.coded
        keys = {t["key"] for t in main}  # (unique: parse_index checked the index's entries)
        sizes = [f.size for f in self.files]
        rows_it = iter(rows)
        entries = []
        for it in items:
            if type(it) is int:
                entries.append(coded[it] if it in coded else _entry_of(main[it]))
                continue
            row = next(rows_it)
            if row[0] in keys:
                raise _bad(f"tensor key {row[0]!r} repeated")
            keys.add(row[0])
            if row[6] + row[7] > sizes[row[5]]:
                raise _bad(f"tensor {row[0]!r} lies outside its file")
            entries.append(TensorEntry(*row[:8], None))
        entries += [coded[i] if i in coded else _entry_of(t) for i, t in enumerate(main) if not seen[i]]
        return entries


def _bad(what: str):
    return CorruptFileError(f"damaged .onnxz index ({what})")


_INT_MAX = 1 << 62
_U64_MAX = (1 << 64) - 1


def _int(v, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(f"{what} = {v!r}")
    return v


_SAFE_NAME = re.compile(r"[^\x00-\x1f\x7f\\:]+")


def check_data_name(name) -> str:
    """An external data file name from the file: relative, inside the folder, printable."""
    if not isinstance(name, str) or not name or len(name) > 4096 or not _SAFE_NAME.fullmatch(name):
        raise _bad(f"external file name {name!r}")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise _bad(f"external file name {name!r} leaves the model's folder")
    return name


def normal_data_name(location) -> str:
    """The name the index gives an external data `location` (FORMAT.md 4, FILE): its "." and empty
    path components dropped ("./w3.bin" and "w3.bin" name one file), so that a model whose
    location says "./w3.bin" (valid, and what some exporters write) packs; the result passes
    check_data_name (a ".." or an absolute path is still refused). The model's own bytes keep the
    location as written: only the index's name is normal, and a reader looks a location up by its
    normal name."""
    if not isinstance(location, str) or location.startswith("/"):
        return check_data_name(location)  # refused with the usual message
    return check_data_name("/".join(p for p in location.split("/") if p not in ("", ".")) or location)


class _Extents:
    """Detects chunks that overlap each other or leave the data area."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.spans = []

    def add(self, offset: int, length: int) -> None:
        if offset < self.lo or offset + length > self.hi:
            raise _bad(f"chunk at {offset} (+{length}) outside the data area")
        self.spans.append((offset, length))

    def check(self) -> None:
        self.spans.sort()
        end = self.lo
        for off, ln in self.spans:
            if off < end:
                raise _bad(f"chunks overlap at {off}")
            end = off + ln


def _shared_tables(obj: dict) -> List[str]:
    """The index's `ans_tables` (1.2; FORMAT.md 3.2), checked: base64 strings of table bytes."""
    tables = obj.get("ans_tables", [])
    if not isinstance(tables, list) or len(tables) > MAX_SHARED_TABLES:
        raise _bad("ans_tables")
    for t in tables:
        if not isinstance(t, str) or not 4 <= len(t) <= 4 * MAX_TABLE_BYTES // 3 + 4:
            raise _bad("ans_tables entry")
        try:
            raw = base64.b64decode(t, validate=True)
        except (binascii.Error, ValueError):
            raise _bad("ans_tables entry is not base64") from None
        if len(raw) < 3:
            raise _bad("ans_tables entry too short")
    return tables


def _shared_entry(ids: tuple, tables: List[str]) -> tuple:
    """(the base64 tables, their bytes) named by an `ans_shared` table list (checked: every id
    is -1 or an index into `tables`)."""
    data = [tables[t] if t >= 0 else None for t in ids]
    return data, tuple(None if t is None else _codecs._table_bytes(t) for t in data)


def _resolve_shared(obj, tables: Optional[List[str]], resolved: dict) -> bool:
    """Put the table list of `obj` into `resolved` when obj is an `ans_shared` stream whose list
    is well-formed (codecs.check_params' rule: w ints >= -1, one >= 0), names only tables the index
    holds, and is not there yet; whether it was added. Anything else is left to _stream's checks."""
    if type(obj) is not dict or obj.get("codec") != "ans_shared":
        return False
    params = obj.get("params")
    ids = params.get("tables") if type(params) is dict else None
    if type(ids) is not list or not ids or any(type(t) is not int or t < -1 for t in ids):
        return False
    ids = tuple(ids)
    top = max(ids)
    if top < 0 or top >= len(tables or ()) or ids in resolved:
        return False
    resolved[ids] = _shared_entry(ids, tables)
    return True


def _stream(obj, extents: _Extents, what: str, tables: Optional[List[str]] = None, resolved: Optional[dict] = None) -> Stream:
    """One stream of the index, checked. `resolved`: a dict kept over one index's streams, the
    shared tables of each `ans_shared` table list already looked up (most small tensors name
    the same few lists)."""
    fast = _stream_ans
    if fast is not None:  # the usual ans / ans_shared stream, checked and built in C; None: the work is done here
        stream = fast(obj, extents.lo, extents.hi, extents.spans, resolved, Chunk, Stream, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + (1 << 16))
        if stream is not None:
            return stream
        if resolved is not None and _resolve_shared(obj, tables, resolved):
            # the first stream of its table list: C again now that the list is resolved (the
            # checks here cost ~10 us a stream; ~13 such streams in minilm_int8)
            stream = fast(obj, extents.lo, extents.hi, extents.spans, resolved, Chunk, Stream, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + (1 << 16))
            if stream is not None:
                return stream
    if type(obj) is not dict:
        raise _bad(f"{what}: stream is not an object")
    codec = obj.get("codec")
    params = obj.get("params", {})
    if type(codec) is not str:
        raise _bad(f"{what}: codec")
    if codec == SAME or codec == "narrow" and type(params) is dict and type(params.get("inner")) is dict \
            and params["inner"].get("codec") == SAME:
        # (1.4 knows `same`: only ever a tensor's stream, parsed by _same_stream; never a skeleton
        # or a narrow's inner, FORMAT.md 3.3, so a damaged file rather than a newer one)
        raise _bad(f"{what}: same is only a tensor's stream")
    check_params(codec, params)  # NewerFormatError for unknown codecs
    flags = batch_tables = None
    if codec == "ans_shared":  # the tables it names, resolved for the decoder
        ids = tuple(params["tables"])  # check_params: a non-empty list of ints >= -1
        got = resolved.get(ids) if resolved is not None else None
        if got is None:
            if max(ids) >= len(tables or ()):
                raise _bad(f"{what}: ans_shared names a table the index does not hold")
            got = _shared_entry(ids, tables)
            if resolved is not None:
                resolved[ids] = got
        data, batch_tables = got
        params = dict(params, table_data=list(data))  # a list of its own per stream, as before
        flags = 1 if params["sign"] else 0
        plane_lo = 1
    elif codec == "ans":
        flags = (1 if params["sign"] else 0) | (2 if params.get("pairs") else 0)
        plane_lo = 0
    else:
        inner = params.get("inner") if codec == "narrow" else None
        plane_lo = 0 if isinstance(inner, dict) and inner.get("codec") == "ans" else 1
    # plane_lo: an `ans` escapes plane may be empty (1.1, also inside `narrow`); every other
    # plane holds at least one byte
    chunks_in = obj.get("chunks")
    if type(chunks_in) is not list:
        raise _bad(f"{what}: chunks")
    chunks = []
    total = 0
    plane_hi = MAX_CHUNK_BYTES + (1 << 16)
    # planes per raw length, of the previous chunk's length only (a stream's chunks share one
    # length but the last): plane_sizes runs on each new length (it raises on lengths the codec
    # cannot hold), no dict made per stream (most streams are one chunk)
    last_raw = n_planes = -1
    lo, hi, spans = extents.lo, extents.hi, extents.spans
    for c in chunks_in:
        if type(c) is not list or len(c) != 4 or type(c[2]) is not list:
            raise _bad(f"{what}: chunk entry")
        off, raw, planes, digest = c
        if type(off) is not int or not 0 <= off <= _INT_MAX:
            raise _bad(f"chunk offset = {off!r}")
        if type(digest) is not int or not 0 <= digest <= _U64_MAX:
            raise _bad(f"chunk xxh3 = {digest!r}")
        if type(raw) is not int or not 0 <= raw <= MAX_CHUNK_BYTES:
            raise _bad(f"chunk length = {raw!r}")
        stored = 0
        for p in planes:
            if type(p) is not int or not plane_lo <= p <= plane_hi:
                raise _bad(f"plane length = {p!r}")
            stored += p
        if raw != last_raw:
            n_planes = len(plane_sizes(codec, params, raw))
            last_raw = raw
        if len(planes) != n_planes:
            raise _bad(f"{what}: {codec} chunk with {len(planes)} planes")
        if off < lo or off + stored > hi:  # _Extents.add, inline: the hot loop of opening a file
            raise _bad(f"chunk at {off} (+{stored}) outside the data area")
        spans.append((off, stored))
        kept = list(planes)  # (a copy: the index's own list stays as read)
        chunks.append(Chunk(off, raw, kept, digest, None if flags is None else (off, stored, tuple(kept), digest, flags)))
        total += raw
    return Stream(codec, params, chunks, total, batch_tables)


def _stream_ans_fast():
    """_planes.stream_ans (C: an `ans` / `ans_shared` stream checked and built as _stream does,
    ~4x faster: ~4 us per stream in Python, most of opening a model of a few hundred coded
    tensors), or None where the extension lacks it. Env ONNXZ_NO_STREAM_C=1: _stream alone."""
    fast = _codecs._fast
    if fast is None or not hasattr(fast, "stream_ans") or os.environ.get("ONNXZ_NO_STREAM_C"):
        return None
    return fast.stream_ans


_stream_ans = _stream_ans_fast()
# _planes.record(cls, *values): a record (TensorEntry) built in C, as cls(*values) builds it, without
# the Python __init__ that @dataclass generates (~0.7 us each: ~3% of unpacking a small model)
_record = getattr(_codecs._fast, "record", None) if not os.environ.get("ONNXZ_NO_STREAM_C") else None
_check_cuts = getattr(_codecs._fast, "check_cuts", None) if not os.environ.get("ONNXZ_NO_STREAM_C") else None


def _rows_py(tensors_in: list, last_file: int):
    """The tensor entries of the index checked, as rows of TensorEntry's fields (the stream still
    its JSON object), or the message of the first failure: the Python twin of _planes.index_rows
    (same checks, order and messages; used where the extension was not built)."""
    rows = []
    keys = set()
    # exact types (the JSON decoders make nothing else), _int's checks written out, same messages
    for i, t in enumerate(tensors_in):
        if type(t) is not dict:
            return f"tensor {i}"
        get = t.get
        key, name, shape = get("key"), get("name", ""), get("shape")
        if type(key) is not str or type(name) is not str or type(shape) is not list:
            return f"tensor {i} key/name/shape"
        if key in keys:
            return f"tensor key {key!r} repeated"
        keys.add(key)
        for d in shape:
            if type(d) is not int or not -_INT_MAX <= d <= _INT_MAX:
                return f"dim = {d!r}"
        field = get("field")
        if type(field) is not str or field not in _PAYLOAD_FIELDS:
            return f"tensor {i} field {field!r}"
        length, dtype, file, offset = get("length"), get("dtype"), get("file"), get("offset")
        if type(length) is not int or not 0 <= length <= _INT_MAX:
            return f"tensor length = {length!r}"
        if type(dtype) is not int or not 0 <= dtype <= 1 << 16:
            return f"dtype = {dtype!r}"
        if type(file) is not int or not 0 <= file <= last_file:
            return f"tensor file = {file!r}"
        if type(offset) is not int or not 0 <= offset <= _INT_MAX:
            return f"tensor offset = {offset!r}"
        rows.append((key, name, dtype, list(shape), field, file, offset, length, get("stream")))
    return rows


def _index_rows(tensors_in: list, last_file: int):
    """_planes.index_rows (C: ~5x faster, the hot loop of opening a small model) or _rows_py."""
    fast = _codecs._fast
    if fast is not None and hasattr(fast, "index_rows"):
        return fast.index_rows(tensors_in, last_file, _PAYLOAD_FIELDS)
    return _rows_py(tensors_in, last_file)


def _coded_rows(tensors_in: list, last_file: int):
    """Every tensor entry checked as _index_rows does; returns ([(index, row) of the entries with
    a stream], [largest offset + length of the entries of each file]) or the message of the first
    failure. Rows of the other entries are not made (Index.tensors makes their records when asked):
    opening a small model made and freed a tuple and a shape list for each of its few hundred
    entries (~0.1 ms of a ~2.5 ms unpack). An extension built before coded_only: all rows made."""
    fast = _codecs._fast
    if fast is not None and hasattr(fast, "index_rows"):
        try:
            return fast.index_rows(tensors_in, last_file, _PAYLOAD_FIELDS, True)
        except TypeError:  # an older extension: three arguments
            rows = fast.index_rows(tensors_in, last_file, _PAYLOAD_FIELDS)
    else:
        rows = _rows_py(tensors_in, last_file)
    if type(rows) is str:
        return rows
    ends = [0] * (last_file + 1)
    for row in rows:  # (key, name, dtype, shape, field, file, offset, length, stream)
        if row[6] + row[7] > ends[row[5]]:
            ends[row[5]] = row[6] + row[7]
    return [(i, row) for i, row in enumerate(rows) if row[8] is not None], ends


def _entry_of(t: dict) -> "TensorEntry":
    """The record of a tensor entry without a stream, from its index object (checked already)."""
    return TensorEntry(t["key"], t.get("name", ""), t["dtype"], list(t["shape"]), t["field"], t["file"], t["offset"],
                       t["length"], None)


def parse_index(obj: dict, header: Header, max_output_bytes: int) -> Index:
    fmt = obj.get("format")
    if not (isinstance(fmt, list) and len(fmt) == 2 and all(type(v) is int for v in fmt)):
        raise _bad("format")
    if fmt[0] > VERSION[0]:
        raise NewerFormatError(f".onnxz format {fmt[0]}.{fmt[1]} was written by a newer version")
    files_in, tensors_in = obj.get("files"), obj.get("tensors")
    if not isinstance(files_in, list) or not files_in or not isinstance(tensors_in, list):
        raise _bad("files / tensors")
    extents = _Extents(HEADER_SIZE, header.index_offset)
    tables = _shared_tables(obj)
    last_file = len(files_in) - 1
    scanned = _coded_rows(tensors_in, last_file)
    if type(scanned) is str:
        raise _bad(scanned)
    coded_rows, ends = scanned
    catalog = _catalog_ref(obj, header, extents, max_output_bytes)
    # rows: TensorEntry's fields, the stream still its JSON; entries are made here for the coded
    # tensors only (Index.tensors makes the others when asked)
    coded: Dict[int, TensorEntry] = {}
    resolved = {}
    fast = _stream_ans
    lo, hi, spans = extents.lo, extents.hi, extents.spans
    for ti, row in coded_rows:
        key, length = row[0], row[7]
        entry = row[8]
        if type(entry) is dict and entry.get("codec") == SAME:  # 1.4: an earlier tensor's stream (3.3)
            stream = _same_stream(entry, coded, ti, key)
        else:
            # _stream's C path inline (its frame and the label, made only where Python takes over:
            # ~10% of parsing a small model's index of 45 coded tensors)
            stream = fast(entry, lo, hi, spans, resolved, Chunk, Stream, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + (1 << 16)) \
                if fast is not None else None
            if stream is None:
                stream = _stream(entry, extents, f"tensor {key!r}", tables, resolved)
        if stream.raw_length != length:
            raise _bad(f"tensor {key!r} stream decodes to {stream.raw_length} bytes, payload is {length}")
        coded[ti] = TensorEntry(*row[:8], stream) if _record is None else _record(TensorEntry, *row[:8], stream)
    files = []
    total = 0
    used = set()
    for i, f in enumerate(files_in):
        if not isinstance(f, dict):
            raise _bad(f"file {i}")
        name = f.get("name")
        if i == 0:
            if not isinstance(name, str):
                raise _bad("model file name")
        else:
            check_data_name(name)
            if name in used:
                raise _bad(f"external file {name!r} listed twice")
            used.add(name)
        size = _int(f.get("size"), "file size")
        total += size
        if total > max_output_bytes:
            raise LimitExceededError(f".onnxz file restores to more than {max_output_bytes} bytes (the limit set)")
        sha = f.get("sha256")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise _bad(f"file {i} sha256")
        fast = f.get("xxh3_128")
        if fast is not None and not (isinstance(fast, str) and re.fullmatch(r"[0-9a-f]{32}", fast)):
            raise _bad(f"file {i} xxh3_128")
        skeleton = _stream(f.get("skeleton"), extents, f"file {i} skeleton")
        cuts_in = f.get("cuts")
        if not isinstance(cuts_in, list):
            raise _bad(f"file {i} cuts")
        last_tensor = len(tensors_in) - 1
        # the loop below in C where the extension has it (None: a check failed, the loop says which)
        checked = _check_cuts(cuts_in, coded, i, size, last_tensor) if _check_cuts is not None else None
        cuts, cut_bytes = checked if checked is not None else _checked_cuts(cuts_in, coded, i, size, last_tensor, tensors_in)
        if skeleton.raw_length != size - cut_bytes:
            raise _bad(f"file {i} skeleton length")
        files.append(FileEntry(name, size, sha, skeleton, cuts, fast))
    sizes = [f.size for f in files]
    if any(end > size for end, size in zip(ends, sizes)):
        for t in tensors_in:  # the first entry past its file's end (all checked by _coded_rows)
            if t["offset"] + t["length"] > sizes[t["file"]]:
                raise _bad(f"tensor {t['key']!r} lies outside its file")
    # each cut names a distinct coded tensor (a cut matches its tensor's file and offset, and the
    # cuts of a file are ordered and disjoint), so every coded tensor is placed exactly when there
    # are as many cuts as coded tensors
    if sum(len(f.cuts) for f in files) != len(coded):
        raise _bad("a coded tensor is not placed in any file")
    extents.check()
    writer = obj.get("writer", "")
    return Index(tuple(fmt), writer if isinstance(writer, str) else "", files, tensors_in, coded, obj, catalog)


def _same_stream(obj: dict, coded: dict, ti: int, key: str) -> Stream:
    """The stream {"codec": "same", "params": {"tensor": j}} of tensor `ti` (FORMAT.md 3.3): a
    Stream over the chunks of the earlier coded tensor j (decoded again for this one; its chunks
    lie in the data area once), marked `same_as` = j. Damaged when j is not an earlier coded
    tensor, or the object holds anything else."""
    params = obj.get("params")
    j = params.get("tensor") if type(params) is dict and len(params) == 1 else None
    if set(obj) - {"codec", "params", "chunks"} or obj.get("chunks", []) != [] or type(j) is not int:
        raise _bad(f"tensor {key!r}: same stream")
    original = coded.get(j) if 0 <= j < ti else None
    if original is None:
        raise _bad(f"tensor {key!r}: same names tensor {j}, not an earlier coded tensor")
    base = original.stream
    stream = Stream(base.codec, base.params, base.chunks, base.raw_length, base.tables)
    stream.same_as = getattr(base, "same_as", j)
    return stream


def _checked_cuts(cuts_in: list, coded: dict, i: int, size: int, last_tensor: int, tensors_in: list) -> tuple:
    """(cuts as (offset, length, tensor index) tuples, bytes cut) of file entry i (`size` bytes):
    _int's checks written out, same messages: one cut per coded tensor, in order, inside the
    file, matching its tensor's file, offset and length. (_planes.check_cuts makes the same checks
    in C and leaves every failure to this loop.)"""
    cuts = []
    end = cut_bytes = 0
    for c in cuts_in:
        if not isinstance(c, list) or len(c) != 3:
            raise _bad(f"file {i} cut")
        off, ln, ti = c
        if type(off) is not int or not 0 <= off <= _INT_MAX:
            raise _bad(f"cut offset = {off!r}")
        if type(ln) is not int or not 1 <= ln <= _INT_MAX:
            raise _bad(f"cut length = {ln!r}")
        if type(ti) is not int or not 0 <= ti <= last_tensor:
            raise _bad(f"cut tensor = {ti!r}")
        if off < end or off + ln > size:
            raise _bad(f"file {i} cuts out of order or outside the file")
        te = coded.get(ti)  # None: the tensor has no stream
        if te is None or te.file != i or te.offset != off or te.length != ln:
            raise _bad(f"file {i} cut at {off} does not match tensor {tensors_in[ti]['key']!r}")
        end = off + ln
        cut_bytes += ln
        cuts.append((off, ln, ti))
    return cuts, cut_bytes


def _catalog_ref(obj: dict, header: Header, extents: _Extents, max_output_bytes: int) -> Optional[tuple]:
    """(offset, stored, raw length, xxh3) of the index's `catalog` (1.3, FORMAT.md 4.1), checked
    (inside the data area, its declared size in proportion), or None when the file has none. The
    header flag and the key go together."""
    ref = obj.get("catalog")
    if not header.flags & FLAG_CATALOG:
        if ref is not None:
            raise _bad("catalog without its header flag")
        return None
    if type(ref) is not list or len(ref) != 4 or any(type(v) is not int for v in ref):
        raise _bad("catalog")
    off, stored, raw, digest = ref
    if not 1 <= stored <= MAX_INDEX_BYTES or not 0 <= digest <= _U64_MAX:
        raise _bad(f"catalog {ref!r}")
    limit = min(MAX_INDEX_BYTES, max(1 << 20, INDEX_RATIO * stored), max(1 << 20, max_output_bytes))
    if not 2 <= raw <= limit:
        raise LimitExceededError(f".onnxz catalog declares {raw} bytes from {stored} stored, above the limit of {limit}") \
            if raw > limit else _bad(f"catalog {ref!r}")
    extents.add(off, stored)
    return off, stored, raw, digest


def encode_catalog(items: list) -> tuple:
    """(text, zstd frame) of a catalog (1.3): as the index, content size declared, checksum on."""
    text = json.dumps(items, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return text, zstd.ZstdCompressor(level=INDEX_LEVEL, write_checksum=True, write_content_size=True).compress(text)
