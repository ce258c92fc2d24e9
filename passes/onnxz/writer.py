"""pack(): an ONNX file (and its external data files) -> one `.onnxz` file (FORMAT.md)."""
from __future__ import annotations

import base64
import collections
import hashlib
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx
import xxhash
import zstandard as zstd

from .. import __version__
from .._cpus import worker_count
from .._fileio import _safe_external_path, atomic_output, check_readable, check_writable, parse_model_bytes
from ..errors import FileAccessError, InvalidArgumentError, InvalidModelError
from . import codecs
from .format import FLAG_CATALOG, HEADER_SIZE, MAGIC, SAME, VERSION, encode_catalog, encode_index, normal_data_name, pack_header
from .protowire import LEN, TensorRef, WireError, _skip, find_tensors, read_varint, write_varint

MIN_CUT = 1024  # smaller payloads stay in the skeleton: frame and index overhead would eat the gain
SKELETON_CHUNK = 4 << 20
SKELETON_LEVEL = 17
LOOKAHEAD_BYTES = 256 << 20  # raw bytes encoded ahead of the one being written (bounds memory)
# payloads from this size are encoded on the writing thread with their chunks written to the
# output as they come (_Spill), not held whole: a 2.25 GB table held its encoding (~1x: a raw
# plane is a view of its chunk's split planes) beside its source. Smaller ones stay on the pool,
# encoded in parallel within the look-ahead (a payload this large was encoded alone anyway:
# it does not fit in the look-ahead beside another)
STREAM_MIN_BYTES = LOOKAHEAD_BYTES


@dataclass
class PackStats:
    """What pack() did: sizes, and per codec how many tensors / bytes went where."""

    source: str
    dest: str
    original_bytes: int
    packed_bytes: int
    files: int
    tensors: int
    tensors_coded: int
    seconds: float
    by_codec: Dict[str, Dict[str, int]] = field(default_factory=dict)
    index_bytes: int = 0  # the stored (compressed) index: tensor table, chunk list, checksums

    @property
    def ratio(self) -> float:
        return self.packed_bytes / self.original_bytes if self.original_bytes else 1.0

    @property
    def larger_than_input(self) -> bool:
        return self.packed_bytes > self.original_bytes

    @property
    def note(self) -> Optional[str]:
        """Why the pack came out larger than its input, when it did (else None): on a tiny
        model the container's fixed cost outweighs what coding saves. The pack is written all the
        same: it restores the input byte for byte."""
        if not self.larger_than_input:
            return None
        return (f"the .onnxz is {self.packed_bytes - self.original_bytes} bytes larger than its input: its container "
                f"(the {HEADER_SIZE}-byte header and the {self.index_bytes}-byte index of tensors, chunks and "
                f"checksums) costs more than coding saved on this small model; it still restores the input byte for byte")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["ratio"] = self.ratio
        d["larger_than_input"] = self.larger_than_input
        d["note"] = self.note
        return d


DIGEST_BLOCK = 8 << 20  # bytes per read when an external data file is hashed


class _Source:
    """One file of the model: the model file's bytes (read whole: its wire format is walked), or
    an external data file read where needed (os.pread: a payload per job, the gaps between them,
    blocks for the digests), so that a model's weights are not all in memory at once."""

    def __init__(self, name: str, data: Optional[bytes] = None, path: Optional[Path] = None):
        self.name, self.data, self.path = name, data, path
        self.refs: List[TensorRef] = []
        self.fd = -1
        if data is not None:
            self.size = len(data)
            return
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
            self.stat = os.fstat(self.fd)
        except OSError as exc:
            self.close()
            raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None
        self.size = self.stat.st_size

    def read(self, offset: int, length: int) -> np.ndarray:
        """The bytes [offset, offset + length) as uint8 (a view of the model file's bytes; for a
        data file, fresh memory that asks no huge pages: bytearray, not numpy's 4 MiB+ arrays)."""
        if self.data is not None:
            return np.frombuffer(self.data, dtype=np.uint8, count=length, offset=offset)
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return np.frombuffer(buf, dtype=np.uint8)

    def read_into(self, offset: int, view: memoryview) -> None:
        """A data file's bytes from `offset` into all of `view`."""
        length = len(view)
        done = 0
        while done < length:
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise FileAccessError(f"cannot read {self.path}: {exc.strerror or exc}") from None
            if n <= 0:
                raise FileAccessError(f"{self.path} changed while it was packed (shorter than {offset + length} bytes)")
            done += n

    def check_unchanged(self) -> None:
        """Refuse a data file written to while it was packed: its parts were read at different
        times (the digests in one pass, the payloads job by job)."""
        if self.data is not None:
            return
        try:
            now = os.fstat(self.fd)
        except OSError as exc:
            raise FileAccessError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (self.stat.st_size, self.stat.st_mtime_ns, self.stat.st_ctime_ns):
            raise FileAccessError(f"{self.path} changed while it was packed; pack it again")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def _load_sources(model_or_path):
    """(model file, external data files, label) with every tensor payload located."""
    if isinstance(model_or_path, onnx.ModelProto):
        try:
            data = model_or_path.SerializeToString()
        except ValueError as exc:
            raise InvalidModelError(f"cannot serialise the model ({exc}); save it with external data and pack the path") from None
        base, label, name = None, "<model>", "model.onnx"
    elif isinstance(model_or_path, (str, os.PathLike)):
        p = check_readable(model_or_path)
        data = _read(p)
        if data.startswith(MAGIC):  # (the protobuf parser's words would not say what the file is)
            raise InvalidArgumentError(f"{p} is an .onnxz pack already: pack reads an ONNX model "
                                       "(unpack restores the one it holds)")
        base, label, name = p.parent, str(p), p.name
    else:
        raise InvalidArgumentError(f"expected an onnx.ModelProto or a path, got {type(model_or_path).__name__}")
    try:
        refs = find_tensors(data)
    except WireError as exc:
        if base is not None:
            parse_model_bytes(data, label)  # protobuf's own refusal first, as before
        raise InvalidModelError(f"{label} is not an ONNX model ({exc})") from None
    if base is not None:
        _check_model(data, refs, label)  # refuse what is not an ONNX model
    model = _Source(name, data)
    externals: Dict[str, _Source] = {}
    try:
        _locate_external(base, refs, model, externals)
    except BaseException:
        for src in externals.values():
            src.close()
        raise
    return model, list(externals.values()), label


def _locate_external(base, refs, model: _Source, externals: Dict[str, _Source]) -> None:
    """Each ref to its source: the model file, or the external data file it names (opened)."""
    for ref in refs:
        if ref.field != "external":
            model.refs.append(ref)
            continue
        if base is None:
            raise InvalidModelError("the model references external data files; pack it from its path")
        location = ref.location or ""
        target = _safe_external_path(base, location)
        try:
            name = normal_data_name(location)
        except Exception:
            raise InvalidModelError(f"external data location {location!r} is not a plain relative path; not supported") from None
        # keyed by the normal name: "./w3.bin" and "w3.bin" are one file, stored once
        src = externals.get(name)
        if src is None:
            if not target.is_file():
                raise InvalidModelError(f"external data file {location!r} of tensor {ref.name!r} is missing")
            src = externals[name] = _Source(name, path=target)
        try:
            int(ref.external.get("offset", "0") or 0)
            int(ref.external["length"]) if ref.external.get("length") else 0
        except ValueError:  # (load_model refuses it too; packed, its data file would be left out)
            raise InvalidModelError(f"tensor {ref.name!r} has a malformed external data offset or length") from None
        if ref.length < 0:
            ref.length = src.size - ref.offset
        if ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > src.size:
            raise InvalidModelError(f"tensor {ref.name!r} declares external bytes outside {location!r}")
        src.refs.append(ref)


STRIP_MIN = 4096  # raw_data payloads at least this long are left out of the validation parse


def _strip_message(buf, start: int, end: int, cuts, ci: int):
    """(parts, length, next cut) of the message buf[start:end] with the LEN values cuts[ci:] that
    lie in it emptied and the lengths of the messages around them rewritten. Only the fields up to
    the last cut are read: the rest is copied as it is."""
    parts, size = [], 0
    pos = copy_from = start
    while ci < len(cuts) and cuts[ci][0] < end:
        key_start = pos
        key, pos = read_varint(buf, pos, end)
        if key & 7 != LEN:
            pos = _skip(buf, key & 7, pos, end)
            continue
        key_end = pos
        n, vstart = read_varint(buf, pos, end)
        vend = vstart + n
        if vend > end:
            raise WireError("length-delimited field runs past the end of its message")
        if vend <= cuts[ci][0]:
            pos = vend
            continue
        if cuts[ci][0] < vstart or cuts[ci][1] > vend:
            raise WireError("payload not inside a field")  # not where the walk found it: parse it all
        parts.append(buf[copy_from:key_start])
        parts.append(buf[key_start:key_end])
        if (vstart, vend) == cuts[ci]:
            parts.append(b"\0")
            size += key_start - copy_from + key_end - key_start + 1
            ci += 1
        else:
            sub, sub_size, ci = _strip_message(buf, vstart, vend, cuts, ci)
            head = write_varint(sub_size)
            parts.append(head)
            parts.extend(sub)
            size += key_start - copy_from + key_end - key_start + len(head) + sub_size
        pos = copy_from = vend
    parts.append(buf[copy_from:end])
    return parts, size + end - copy_from, ci


def _check_model(data, refs: List[TensorRef], label: str) -> None:
    """Refuse what is not an ONNX model, as parse_model_bytes(data) would, without protobuf copying
    every weight: the copy parsed has its large raw_data payloads emptied (protobuf checks nothing
    inside a bytes field, so the copy parses exactly when the file does). Any refusal is then
    confirmed by parsing the whole file, so the error is the one parse_model_bytes gives."""
    cuts = sorted((r.offset, r.offset + r.length) for r in refs if r.field == "raw_data" and r.length >= STRIP_MIN)
    if not cuts:
        parse_model_bytes(memoryview(data), label)
        return
    try:
        parts, _, ci = _strip_message(memoryview(data), 0, len(data), cuts, 0)
        if ci != len(cuts):
            raise WireError("payloads left over")
    except WireError:
        parse_model_bytes(memoryview(data), label)
        return
    try:
        parse_model_bytes(b"".join(parts), label)
    except InvalidModelError:
        parse_model_bytes(memoryview(data), label)


def _keys(refs: List[TensorRef]) -> List[str]:
    keys, seen = [], {}
    for i, r in enumerate(refs):
        base = r.name or r.context.lstrip("\0") or f"tensor{i}"
        n = seen.get(base, 0) + 1
        seen[base] = n
        keys.append(base if n == 1 else f"{base}#{n}")
    return keys


def _plan_cuts(src: _Source, min_cut: int):
    """Non-overlapping payload ranges to cut, sorted; refs not cut stay in the skeleton."""
    cuts = []
    end = 0
    for ref in sorted(src.refs, key=lambda r: (r.offset, -r.length)):
        if ref.length >= min_cut and ref.offset >= end:
            cuts.append(ref)
            end = ref.offset + ref.length
    return cuts


def _skeleton(src: _Source, cuts: List[TensorRef]) -> bytes:
    """The file's bytes outside its cut payloads, joined."""
    parts, pos = [], 0
    for r in cuts:
        parts.append(src.read(pos, r.offset - pos))
        pos = r.offset + r.length
    parts.append(src.read(pos, src.size - pos))
    return b"".join(parts)


_skeleton_zstd = threading.local()


def _compress_skeleton(part: np.ndarray) -> bytes:
    """One skeleton chunk as a zstd frame (level 17: measured on the corpus, half the time of
    level 19 for 0.1-0.7% more skeleton bytes, which are ~1% of a file), or raw if not smaller."""
    c = getattr(_skeleton_zstd, "c", None)
    if c is None:
        c = _skeleton_zstd.c = zstd.ZstdCompressor(level=SKELETON_LEVEL, write_checksum=False, write_content_size=True)
    frame = c.compress(part)
    return frame if len(frame) < part.size else part


def _encode_skeleton(data: bytes) -> codecs.EncodedStream:
    arr = np.frombuffer(data, dtype=np.uint8)
    stream = codecs.EncodedStream("bytes")
    for start in range(0, arr.size, SKELETON_CHUNK):
        part = arr[start:start + SKELETON_CHUNK]
        stream.chunks.append(codecs.EncodedChunk(part.size, [_compress_skeleton(part)]))
    if not stream.chunks:
        stream.chunks = []
    return stream


def _digests(src: _Source) -> tuple:
    """(sha256, xxh3_128) hex of a source file: the sha256 is its identity (sha256sum of the
    original), the XXH3-128 the fast digest restores check (FORMAT.md 4). A data file is read in
    blocks."""
    if src.data is not None:
        return hashlib.sha256(src.data).hexdigest(), xxhash.xxh3_128(src.data).hexdigest()
    sha, xxh = hashlib.sha256(), xxhash.xxh3_128()
    buf = memoryview(bytearray(min(DIGEST_BLOCK, src.size)))
    for start in range(0, src.size, DIGEST_BLOCK):
        block = buf[:min(DIGEST_BLOCK, src.size - start)]
        src.read_into(start, block)
        sha.update(block)
        xxh.update(block)
    return sha.hexdigest(), xxh.hexdigest()


def _chunk_digest(planes) -> int:
    """XXH3-64 of a chunk's stored planes back to back (FORMAT.md 2)."""
    digest = xxhash.xxh3_64()
    for p in planes:
        digest.update(p)
    return digest.intdigest()


def _in_order(pool: ThreadPoolExecutor, fn, jobs):
    """Yield (job, fn(job)) in the order of `jobs`, computed on the pool. Jobs are submitted ahead
    while the raw bytes submitted beyond the oldest unwritten job stay under a budget, so encoded
    planes never pile up while one big tensor is still being encoded (and the other threads keep
    encoding the tensors after it meanwhile). On an error the jobs not started are cancelled and
    the running ones waited for."""
    budget = max(LOOKAHEAD_BYTES, 0)
    pending = collections.deque()
    in_flight = 0
    it = iter(jobs)
    nxt = next(it, None)
    try:
        while nxt is not None or pending:
            while nxt is not None and (not pending or in_flight + nxt[2] <= budget):
                pending.append((nxt, pool.submit(fn, nxt)))
                in_flight += nxt[2]
                nxt = next(it, None)
            job, fut = pending.popleft()
            result = fut.result()
            in_flight -= job[2]
            yield job, result
    finally:
        for _, fut in pending:
            fut.cancel()
        for _, fut in pending:
            if not fut.cancelled():
                try:
                    fut.result()
                except BaseException:
                    pass


class _Written:
    """One chunk written to the output: where, its raw length, its planes' lengths, their XXH3-64."""

    __slots__ = ("pos", "raw_length", "lengths", "digest")

    def __init__(self, pos: int, raw_length: int, lengths: List[int], digest: int):
        self.pos, self.raw_length, self.lengths, self.digest = pos, raw_length, lengths, digest


class _Region:
    """The chunks of a large payload's first candidate encoding (codecs.encode_tensor's `chunks`
    container), written to the output as they are appended: only their records stay."""

    def __init__(self, f, start: int):
        self.f, self.start, self.top = f, start, start
        self.records: List[_Written] = []

    def append(self, chunk) -> None:
        lengths = [len(p) for p in chunk.planes]
        self.records.append(_Written(self.top, chunk.raw_length, lengths, _chunk_digest(chunk.planes)))
        self.f.seek(self.top)  # (a winner held in memory is written from `start` again, over the first)
        for p in chunk.planes:
            self.f.write(p)
        self.top += sum(lengths)

    @property
    def stored(self) -> int:
        return self.top - self.start

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


class _Spill:
    """The `chunks` factory for one large payload written at `start` of the output: its first
    candidate encoding (the codec chosen on samples; for most payloads the only one encoded in
    full) goes straight to the file; later candidates (the LZ tries, on payloads a probe found
    repetitive) are held in lists as before and, when one wins, written over it. finish() cuts
    the file after the winner and gives its chunk records."""

    def __init__(self, f, start: int):
        self.f, self.start = f, start
        self.first: Optional[_Region] = None

    def __call__(self):
        if self.first is None:
            self.first = _Region(self.f, self.start)
            return self.first
        return []

    def finish(self, winner) -> List[_Written]:
        if winner is not self.first:
            region = _Region(self.f, self.start)
            for chunk in winner:
                region.append(chunk)
            winner = region
        self.f.seek(winner.top)
        self.f.truncate()
        return winner.records


def _payload(sources, ref_file, all_refs, i) -> np.ndarray:
    r = all_refs[i]
    return sources[ref_file[i]].read(r.offset, r.length)


def _same_payloads(sources, ref_file, all_refs, cut: List[int]) -> Dict[int, int]:
    """{tensor i: the earlier tensor j whose payload is byte for byte i's} among the cut tensors
    `cut` (indexes into all_refs, in file order): each such payload is stored once (FORMAT.md 3.3).
    Only payloads whose length another cut payload has are read and hashed (XXH3-128), and equal
    digests are confirmed byte for byte. A model without such payloads packs as before."""
    by_length: Dict[int, List[int]] = {}
    for i in cut:
        by_length.setdefault(all_refs[i].length, []).append(i)
    same: Dict[int, int] = {}
    for group in by_length.values():
        if len(group) < 2:
            continue
        first: Dict[bytes, List[int]] = {}
        for i in sorted(group):  # (the original is the earliest entry of the index)
            data = _payload(sources, ref_file, all_refs, i)
            digest = xxhash.xxh3_128(data).digest()
            for j in first.get(digest, ()):
                if np.array_equal(_payload(sources, ref_file, all_refs, j), data):
                    same[i] = j
                    break
            else:
                first.setdefault(digest, []).append(i)
    return same


def _used_tables(tensor_streams: Dict[int, dict], shared) -> List[str]:
    """The shared tables the streams use, in order of first use (base64), with the streams'
    table numbers rewritten to their place in that list."""
    order: Dict[int, int] = {}
    for i in sorted(tensor_streams):
        entry = tensor_streams[i]
        if entry["codec"] != "ans_shared":
            continue
        ids = entry["params"]["tables"]
        for t in ids:
            if t >= 0 and t not in order:
                order[t] = len(order)
        entry["params"] = dict(entry["params"], tables=[order[t] if t >= 0 else -1 for t in ids])
    return [base64.b64encode(shared.tables[t]).decode("ascii") for t in order]


def pack(model_or_path, dst, *, threads: Optional[int] = None, force: bool = False, progress=None,
         chunk_bytes: int = codecs.CHUNK_BYTES, effort: str = "default") -> PackStats:
    """Write `model_or_path` (a ModelProto or an .onnx path, with its external data) to `dst` (.onnxz).

    Unpacking restores the model file and its external data files byte for byte.
    effort="max" also tries codec layouts (fpairs "split") that shave up to ~0.1% off float32
    weights and decode them slower (open_nsfw: 0.04% smaller, its restore ~1.2x the CPU time);
    "default" keeps decode fast.
    threads: the worker threads (None: the CPUs this process may use; 0 is refused, as by unpack).
    Returns the PackStats of what was written (sizes, tensors coded, seconds). Raises
    InvalidArgumentError (bad arguments, dst naming the source), FileAccessError (dst exists
    without force, an unwritable destination), InvalidModelError (a source that is not an ONNX model).
    """
    t0 = time.perf_counter()
    dst = check_writable(dst, force)  # before Path(): Path('') would name the current folder
    if isinstance(model_or_path, (str, os.PathLike)) and Path(model_or_path).resolve() == dst.resolve():
        raise InvalidArgumentError("the packed file would replace its own source; choose another output name")
    if not (isinstance(chunk_bytes, int) and 64 <= chunk_bytes <= 4 << 20):
        raise InvalidArgumentError("chunk_bytes must be between 64 and 4 MiB")
    if effort not in codecs.EFFORTS:
        raise InvalidArgumentError(f"effort must be one of {codecs.EFFORTS}, got {effort!r}")
    model, externals, label = _load_sources(model_or_path)
    sources = [model] + externals
    try:
        threads = worker_count(threads)  # the rule unpack follows too (0 is refused by both)

        # one job per cut tensor and per skeleton, encoded on the pool (zstd and the C shuffles release
        # the GIL) and written in this fixed order: the bytes do not depend on the thread count
        all_refs: List[TensorRef] = []
        ref_file: List[int] = []
        for fi, src in enumerate(sources):
            all_refs.extend(src.refs)
            ref_file.extend([fi] * len(src.refs))
        keys = _keys(all_refs)
        ref_index = {id(r): i for i, r in enumerate(all_refs)}
        plans = [_plan_cuts(src, MIN_CUT if fi == 0 else 1) for fi, src in enumerate(sources)]
        # a cut payload byte for byte the same as an earlier one is stored once (1.4, FORMAT.md 3.3)
        same = _same_payloads(sources, ref_file, all_refs, [ref_index[id(r)] for cuts in plans for r in cuts])
        jobs = []  # (kind, index, raw bytes) in the order chunks are written
        for fi, cuts in enumerate(plans):
            for r in cuts:
                if ref_index[id(r)] not in same:
                    jobs.append(("tensor", ref_index[id(r)], r.length))
            jobs.append(("skeleton", fi, sources[fi].size - sum(r.length for r in cuts)))
        total = sum(s.size for s in sources)
        done = 0
        shared = codecs.SharedTables()

        def encode_payload(i, **extra):
            r = all_refs[i]
            data = _payload(sources, ref_file, all_refs, i)
            # effort and shared passed only when needed: test tools patch encode_tensor without them
            if effort != "default":
                extra["effort"] = effort
            if shared:
                extra["shared"] = shared
            if codecs.transpose_cols(r.shape, r.length) is not None:
                extra["shape"] = r.shape
            return codecs.encode_tensor(data, r.dtype, r.field, chunk_bytes=chunk_bytes, **extra)

        def encode(job):
            """(stream, XXH3-64 of each chunk's stored planes): the digests on the pool too, not on
            the thread that writes (at 2 threads that thread was the bottleneck of large packs).
            None for a large payload: the writing thread encodes it at its turn (_Spill)."""
            kind, i, raw = job
            if kind == "skeleton":
                enc = _encode_skeleton(_skeleton(sources[i], plans[i]))
            elif raw >= STREAM_MIN_BYTES:
                return None
            else:
                enc = encode_payload(i)
            return enc, [_chunk_digest(c.planes) for c in enc.chunks]

        tensor_streams: Dict[int, dict] = {}
        skeletons: Dict[int, dict] = {}
        by_codec: Dict[str, Dict[str, int]] = {}
        with atomic_output(dst, force) as f, ThreadPoolExecutor(max_workers=threads) as pool:
            # the sources' sha256 (sequential, ~1.5 GB/s; XXH3-128 ~15 GB/s) runs beside the encoding
            # (and beside the shared tables), not after it
            shas = [pool.submit(_digests, src) for src in sources]
            # the tables the small payloads share (1.2), from all of them before any is encoded
            if codecs._write_ans:
                shared = codecs.SharedTables.build(
                    (_payload(sources, ref_file, all_refs, i), all_refs[i].dtype, all_refs[i].field)
                    for kind, i, _ in jobs if kind == "tensor" and all_refs[i].length <= codecs.SHARED_MAX_BYTES)
            f.write(b"\0" * HEADER_SIZE)
            pos = HEADER_SIZE
            for job, result in _in_order(pool, encode, jobs):
                chunks = []
                if result is None:  # a large payload, encoded here with its chunks written as they come
                    spill = _Spill(f, pos)
                    enc = encode_payload(job[1], chunks=spill)
                    for rec in spill.finish(enc.chunks):
                        chunks.append([rec.pos, rec.raw_length, rec.lengths, rec.digest])
                    pos = f.tell()
                    digests = None
                else:
                    enc, digests = result
                    for c, digest in zip(enc.chunks, digests):
                        chunks.append([pos, c.raw_length, [len(p) for p in c.planes], digest])
                        for p in c.planes:
                            f.write(p)
                            pos += len(p)
                entry = {"codec": enc.codec, "params": enc.params, "chunks": chunks}
                kind, i, raw = job
                if kind == "skeleton":
                    skeletons[i] = entry
                else:
                    tensor_streams[i] = entry
                    b = by_codec.setdefault(enc.codec, {"tensors": 0, "raw_bytes": 0, "stored_bytes": 0})
                    b["tensors"] += 1
                    b["raw_bytes"] += raw
                    b["stored_bytes"] += enc.stored
                del enc, digests, result  # the stored planes are written: free them before the next result
                done += raw
                if progress is not None:
                    progress(done, total)
            for i, j in same.items():
                tensor_streams[i] = {"codec": SAME, "params": {"tensor": j}}
                b = by_codec.setdefault(SAME, {"tensors": 0, "raw_bytes": 0, "stored_bytes": 0})
                b["tensors"] += 1
                b["raw_bytes"] += all_refs[i].length
                done += all_refs[i].length
            if same and progress is not None:
                progress(done, total)
            for done_sha in shas:
                done_sha.result()
            for src in sources:  # (before the index: a refusal leaves no output)
                src.check_unchanged()
            files = []
            for fi, src in enumerate(sources):
                files.append({
                    "name": src.name,
                    "size": src.size,
                    "sha256": shas[fi].result()[0],
                    "xxh3_128": shas[fi].result()[1],
                    "skeleton": skeletons[fi],
                    "cuts": [[r.offset, r.length, ref_index[id(r)]] for r in plans[fi]],
                })
            tensors = []
            for i, r in enumerate(all_refs):
                tensors.append({
                    "key": keys[i], "name": r.name, "dtype": r.dtype, "shape": r.shape, "field": r.field,
                    "file": ref_file[i], "offset": r.offset, "length": r.length,
                    "stream": tensor_streams.get(i),
                })
            tables = _used_tables(tensor_streams, shared)
            # 1.2: every file carries `xxh3_128` (and `ans_tables` where a shared table is used); a 1.1
            # reader still reads those without `ans_shared` (it checks only the major version)
            # 1.3: the codec `transpose`, or a catalog (header flag); else a file a 1.2 reader reads
            version = (1, 3) if any(s["codec"] == "transpose" for s in tensor_streams.values()) else (1, 2)
            if same:  # 1.4: a reader of 1.3 or before refuses the codec `same` as newer
                version = (1, 4)
            flags = 0
            catalog = None
            if len(tensor_streams) < len(tensors) and not os.environ.get("ONNXZ_NO_CATALOG"):
                # 1.3 (FORMAT.md 4.1): the entries of the tensors left in the skeleton go to the
                # catalog, which an unpack never parses (the index of a small model is mostly such
                # entries: parsing and freeing them was ~0.3-0.4 ms of a 2-3 ms unpack)
                version, flags = max(version, (1, 3)), FLAG_CATALOG
                at = {}
                for i in range(len(tensors)):
                    if i in tensor_streams:
                        at[i] = len(at)
                items = [at[i] if i in at else {k: v for k, v in t.items() if k != "stream"} for i, t in enumerate(tensors)]
                tensors = [t for i, t in enumerate(tensors) if i in at]
                for fe in files:
                    fe["cuts"] = [[off, ln, at[ti]] for off, ln, ti in fe["cuts"]]
                for i, j in same.items():  # (the tensor named: its place in the list the index keeps)
                    tensor_streams[i]["params"]["tensor"] = at[j]
                cat_text, cat_frame = encode_catalog(items)
                f.write(cat_frame)
                catalog = [pos, len(cat_frame), len(cat_text), _chunk_digest([cat_frame])]
                pos += len(cat_frame)
            index = {"format": list(version), "writer": f"surgeon-compress {__version__}", "files": files, "tensors": tensors}
            if catalog is not None:
                index["catalog"] = catalog
            if tables:
                index["ans_tables"] = tables
            text, frame = encode_index(index)
            f.write(frame)
            file_length = pos + len(frame)
            f.seek(0)
            f.write(pack_header(pos, len(frame), len(text), file_length, zlib.crc32(frame), version, flags))
            f.seek(file_length)
        return PackStats(label, str(dst), total, file_length, len(sources), len(all_refs), len(tensor_streams),
                         time.perf_counter() - t0, by_codec, len(frame) + (catalog[1] if catalog else 0))
    finally:
        for src in sources:
            src.close()
