"""Reading `.onnxz`: open_packed (lazy tensors), unpack (files back, byte for byte), load, verify."""
from __future__ import annotations

import hashlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx
import xxhash

from .._fileio import atomic_output, check_readable, check_writable, load_external_data, parse_model_bytes
from ..errors import CorruptFileError, FileAccessError, InvalidArgumentError, InvalidModelError
from . import codecs
from .protowire import write_varint
from .format import DEFAULT_MAX_OUTPUT_BYTES, check_index_size, HEADER_SIZE, MAGIC, Index, Stream, decode_index, parse_header, parse_index

WINDOW_BYTES = 64 << 20  # restored bytes decoded before they are hashed and written


def _threads(threads) -> int:
    if threads is None:
        return os.cpu_count() or 1
    if not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
    return threads


class PackedFile:
    """An open, validated `.onnxz` file: the index, and its chunks decoded on demand."""

    def __init__(self, path, *, threads=None, max_bytes: Optional[int] = None):
        self.path = check_readable(path)
        self.threads = _threads(threads)
        limit = DEFAULT_MAX_OUTPUT_BYTES if max_bytes is None else max_bytes
        if not isinstance(limit, int) or limit < 0:
            raise InvalidArgumentError("max_bytes must be a non-negative integer")
        try:
            self._f = open(self.path, "rb")
        except OSError as exc:
            raise FileAccessError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(HEADER_SIZE)
            header = parse_header(head, size)
            check_index_size(header, limit)
            self._fd = self._f.fileno()
            self.size = size
            frame = os.pread(self._fd, header.index_length, header.index_offset)
            if len(frame) != header.index_length:
                raise CorruptFileError("truncated .onnxz file (index)")
            self.index: Index = parse_index(decode_index(frame, header), header, limit)
        except BaseException:
            self._f.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=self.threads) if self.threads > 1 else None
        self._lock = threading.Lock()
        self._skeletons: Dict[int, np.ndarray] = {}
        self.closed = False

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._f.close()

    def _check_open(self):
        if self.closed:
            raise InvalidArgumentError("the packed file is closed")

    def _frames(self, chunk) -> List[memoryview]:
        """The chunk's stored planes, read into this thread's input buffer (no mmap: a file
        truncated under us must give an error, not SIGBUS). Measured: mmap would save this copy,
        ~10-15% of float32 decode CPU when the same file is decoded again (open_nsfw 0.82x ->
        0.92x ZipNN), less on a first read (page faults); not worth a crash."""
        n = chunk.stored
        buf = codecs.scratch("input").get(n)
        mv = memoryview(buf)[:n]
        try:
            got = os.preadv(self._fd, [mv], chunk.offset)
        except OSError as exc:
            raise FileAccessError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if got != n:
            raise CorruptFileError(f"truncated .onnxz file: chunk at {chunk.offset} runs past the end")
        if xxhash.xxh3_64_intdigest(mv) != chunk.xxh3:
            raise CorruptFileError(f"damaged .onnxz file: chunk at {chunk.offset} fails its checksum (XXH3-64)")
        frames, pos = [], 0
        for ln in chunk.planes:
            frames.append(mv[pos:pos + ln])
            pos += ln
        return frames

    def _decode_chunk(self, stream: Stream, chunk, out: np.ndarray) -> None:
        codecs.decode_chunk(stream.codec, stream.params, self._frames(chunk), chunk.raw_length, out)

    def _run(self, tasks) -> None:
        """Run (fn, args) tasks, in parallel when threads > 1; the first error is raised."""
        if self._pool is None or len(tasks) <= 1:
            for fn, *args in tasks:
                fn(*args)
            return
        futures = [self._pool.submit(fn, *args) for fn, *args in tasks]
        error = None
        for fut in futures:
            try:
                fut.result()
            except BaseException as exc:  # keep waiting: never leave workers writing into freed buffers
                error = error or exc
        if error is not None:
            raise error

    def stream_tasks(self, stream: Stream, out: np.ndarray):
        tasks, pos = [], 0
        for c in stream.chunks:
            tasks.append((self._decode_chunk, stream, c, out[pos:pos + c.raw_length]))
            pos += c.raw_length
        return tasks

    def decode_stream(self, stream: Stream, out: Optional[np.ndarray] = None) -> np.ndarray:
        if out is None:
            out = np.empty(stream.raw_length, np.uint8)
        self._run(self.stream_tasks(stream, out))
        return out

    def skeleton(self, fi: int) -> np.ndarray:
        with self._lock:
            s = self._skeletons.get(fi)
        if s is None:
            s = self.decode_stream(self.index.files[fi].skeleton)
            with self._lock:
                self._skeletons[fi] = s
        return s

    # ------------------------------------------------------------------ restoring files

    def _pieces(self, fi: int):
        """(file offset, length, source) covering the file in order; source is ('skel', skel offset)
        or ('chunk', stream, chunk)."""
        fe = self.index.files[fi]
        pos = skel = 0
        for off, ln, ti in fe.cuts:
            if off > pos:
                yield pos, off - pos, ("skel", skel)
                skel += off - pos
            stream = self.index.tensors[ti].stream
            p = off
            for c in stream.chunks:
                if c.raw_length:
                    yield p, c.raw_length, ("chunk", stream, c)
                p += c.raw_length
            pos = off + ln
        if fe.size > pos:
            yield pos, fe.size - pos, ("skel", skel)

    def restore_into(self, fi: int, out: np.ndarray) -> None:
        """The whole file `fi`, decoded into `out` (uint8, its size); sha256 checked."""
        skel = self.skeleton(fi)
        tasks = []
        for off, ln, src in self._pieces(fi):
            if src[0] == "skel":
                out[off:off + ln] = skel[src[1]:src[1] + ln]
            else:
                tasks.append((self._decode_chunk, src[1], src[2], out[off:off + ln]))
        self._run(tasks)
        if hashlib.sha256(out).hexdigest() != self.index.files[fi].sha256:
            raise CorruptFileError(f"damaged .onnxz file: {self.index.files[fi].name} does not match its sha256")

    def restore_windows(self, fi: int):
        """Yield the file `fi` in consecutive windows (memory-bounded); sha256 checked at the end
        (before the last window is yielded)."""
        fe = self.index.files[fi]
        skel = self.skeleton(fi)
        sha = hashlib.sha256()
        buf = np.empty(min(max(fe.size, 1), WINDOW_BYTES), np.uint8)
        pending, used = [], 0

        def flush():
            nonlocal pending, used
            window = buf[:used]
            tasks = []
            for woff, ln, src in pending:
                if src[0] == "skel":
                    window[woff:woff + ln] = skel[src[1]:src[1] + ln]
                else:
                    tasks.append((self._decode_chunk, src[1], src[2], window[woff:woff + ln]))
            self._run(tasks)
            sha.update(window)
            pending, used = [], 0
            return window

        for off, ln, src in self._pieces(fi):
            while ln:
                if used == buf.size:
                    yield flush()
                if src[0] == "skel":
                    n = min(ln, buf.size - used)
                    pending.append((used, n, ("skel", src[1])))
                    src = ("skel", src[1] + n)
                else:  # a chunk decodes as a whole
                    n = ln
                    if n > buf.size - used:
                        if used:
                            yield flush()
                        if n > buf.size:
                            buf = np.empty(n, np.uint8)
                    pending.append((used, n, src))
                used += n
                ln -= n
        last = flush()
        if sha.hexdigest() != fe.sha256:
            raise CorruptFileError(f"damaged .onnxz file: {fe.name} does not match its sha256")
        yield last

    def restore_bytes(self, fi: int) -> np.ndarray:
        fe = self.index.files[fi]
        out = np.empty(fe.size, np.uint8)
        self.restore_into(fi, out)
        return out

    def read_range(self, fi: int, offset: int, length: int) -> np.ndarray:
        """Bytes of the restored file `fi` in [offset, offset+length), decoding only what covers them."""
        out = np.empty(length, np.uint8)
        skel = None
        tasks = []
        end = offset + length
        for off, ln, src in self._pieces(fi):
            a, b = max(off, offset), min(off + ln, end)
            if a >= b:
                continue
            if src[0] == "skel":
                if skel is None:
                    skel = self.skeleton(fi)
                s = src[1] + (a - off)
                out[a - offset:b - offset] = skel[s:s + (b - a)]
            elif a == off and b == off + ln:
                tasks.append((self._decode_chunk, src[1], src[2], out[a - offset:b - offset]))
            else:  # partly covered chunk: decode it aside
                tmp = np.empty(ln, np.uint8)
                self._decode_chunk(src[1], src[2], tmp)
                out[a - offset:b - offset] = tmp[a - off:b - off]
        self._run(tasks)
        return out


# ---------------------------------------------------------------------- tensors

_FIELD_NUMBER = {"raw_data": 9, "float_data": 4, "int32_data": 5, "int64_data": 7, "double_data": 10, "uint64_data": 11}
_PLAIN = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
          10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64, 14: np.complex64, 15: np.complex128}


def _parse_tensor(entry, data: bytes) -> np.ndarray:
    t = onnx.TensorProto()
    try:
        t.ParseFromString(data)
    except Exception as exc:
        raise CorruptFileError(f"damaged .onnxz file: tensor {entry.key!r} does not parse ({exc})") from None
    if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
        # the pack holds external payloads itself; a reference here would make onnx read a file
        raise CorruptFileError(f"damaged .onnxz file: tensor {entry.key!r} refers to external data")
    try:
        return onnx.numpy_helper.to_array(t)
    except Exception as exc:  # the payload does not fit its declared type/shape
        raise InvalidModelError(f"tensor {entry.key!r}: payload does not match dtype {entry.dtype} / shape {entry.shape} ({exc})") from None


def _to_array(entry, payload: np.ndarray) -> np.ndarray:
    if entry.field == "proto":
        return _parse_tensor(entry, payload.tobytes())
    field = "raw_data" if entry.field == "external" else entry.field
    if any(d < 0 for d in entry.shape):
        raise InvalidModelError(f"tensor {entry.key!r} has a negative dimension {entry.shape}")
    np_type = _PLAIN.get(entry.dtype)
    count = math.prod(entry.shape)  # Python ints: no overflow
    if np_type is not None and field in ("raw_data", "float_data", "double_data"):
        if field == "float_data" and entry.dtype != 1 or field == "double_data" and entry.dtype != 11:
            np_type = None
        elif count * np.dtype(np_type).itemsize == payload.size:
            return payload.view(np_type).reshape(entry.shape)
    # other types and layouts: let onnx interpret a TensorProto holding just this payload
    proto = bytearray()
    for d in entry.shape:
        proto += b"\x08" + write_varint(d)
    proto += b"\x10" + write_varint(entry.dtype)
    proto += write_varint(_FIELD_NUMBER[field] << 3 | 2) + write_varint(payload.size) + payload.tobytes()
    return _parse_tensor(entry, bytes(proto))


class PackedModel:
    """Lazy access to the tensors of a `.onnxz` file; get_tensor decodes only that tensor's chunks."""

    def __init__(self, path, *, threads=None, max_bytes=None):
        self._pf = PackedFile(path, threads=threads, max_bytes=max_bytes)
        self._by_key = {t.key: t for t in self._pf.index.tensors}

    def keys(self) -> List[str]:
        return [t.key for t in self._pf.index.tensors]

    def __contains__(self, key) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def get_tensor(self, key: str) -> np.ndarray:
        self._pf._check_open()
        entry = self._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        if entry.stream is not None:
            payload = self._pf.decode_stream(entry.stream)
        else:
            payload = self._pf.read_range(entry.file, entry.offset, entry.length)
        return _to_array(entry, payload)

    def metadata(self) -> dict:
        idx = self._pf.index
        tensors = []
        for t in idx.tensors:
            s = t.stream
            tensors.append({
                "key": t.key, "name": t.name, "dtype": onnx.TensorProto.DataType.Name(t.dtype) if t.dtype in onnx.TensorProto.DataType.values() else t.dtype,
                "shape": t.shape, "field": t.field, "file": idx.files[t.file].name, "bytes": t.length,
                "stored": s.stored if s else None, "codec": s.codec if s else "skeleton",
                "params": s.params if s else {}, "chunks": len(s.chunks) if s else 0,
            })
        return {
            "format_version": "%d.%d" % idx.version, "writer": idx.writer, "path": str(self._pf.path),
            "packed_bytes": self._pf.size,
            "original_bytes": sum(f.size for f in idx.files),
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256, "skeleton_stored": f.skeleton.stored,
                       "cuts": len(f.cuts)} for f in idx.files],
            "tensors": tensors,
        }

    def close(self) -> None:
        self._pf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def open_packed(path, *, threads=None, max_bytes=None) -> PackedModel:
    return PackedModel(path, threads=threads, max_bytes=max_bytes)


# ---------------------------------------------------------------------- files

def _default_dst(src: Path) -> Path:
    if src.suffix == ".onnxz":
        return src.with_suffix(".onnx")
    return src.with_name(src.name + ".onnx")


def unpack(src, dst=None, *, threads=None, force: bool = False, max_bytes=None) -> Path:
    """Restore the .onnx (and its external data files beside it) byte for byte; returns the .onnx path."""
    src = Path(src)
    dst = _default_dst(src) if dst is None else Path(dst)
    check_writable(dst, force)
    with PackedFile(src, threads=threads, max_bytes=max_bytes) as pf:
        files = pf.index.files
        folder = dst.parent if str(dst.parent) else Path(".")
        targets = [dst] + [folder / f.name for f in files[1:]]
        for t in targets[1:]:
            _prepare_data_path(folder, t, src, dst, force)
        # data files first: the model file never appears pointing at missing data
        for fi in list(range(1, len(files))) + [0]:
            with atomic_output(targets[fi], force) as f:
                for window in pf.restore_windows(fi):
                    f.write(window)
    return dst


def _prepare_data_path(folder: Path, target: Path, src: Path, dst: Path, force: bool) -> None:
    """Make the folders of an external data file inside `folder`, refusing any path that would
    leave it (through a symlink too) or collide with the packed file or the model."""
    from .._fileio import _describe_os_error

    base = folder.resolve()
    try:
        parent = target.parent
        if parent != folder:
            rel = parent.relative_to(folder)
            cur = folder
            for part in rel.parts:  # one level at a time: never through a symlink
                cur = cur / part
                if cur.is_symlink():
                    raise FileAccessError(f"cannot write {target}: {cur} is a symbolic link")
                if cur.exists() and not cur.is_dir():
                    raise FileAccessError(f"cannot write {target}: {cur} is not a folder")
                if not cur.exists():
                    cur.mkdir()
        resolved = target.resolve()
    except OSError as exc:
        if isinstance(exc, FileAccessError):
            raise
        raise FileAccessError(_describe_os_error(target, exc, "write")) from None
    if base not in resolved.parents:
        raise FileAccessError(f"cannot write {target}: it lies outside {folder}")
    if resolved in (src.resolve(), dst.resolve()):
        raise CorruptFileError(f"damaged .onnxz index (external file {target.name} collides with {resolved.name})")
    check_writable(target, force)


PackedFile.__enter__ = lambda self: self
PackedFile.__exit__ = lambda self, *exc: self.close()


def _is_packed(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def load(path, *, threads=None, max_bytes=None) -> onnx.ModelProto:
    """The ModelProto of an .onnxz (restored in memory, no temporary files) or of an .onnx path."""
    p = check_readable(path)
    if not _is_packed(p):
        data = p.read_bytes()
        model = parse_model_bytes(data, str(p))
        load_external_data(model, p.parent)
        return model
    with PackedFile(p, threads=threads, max_bytes=max_bytes) as pf:
        data = pf.restore_bytes(0)
        model = parse_model_bytes(data.tobytes(), str(p))
        if len(pf.index.files) > 1:
            restored = {pf.index.files[fi].name: pf.restore_bytes(fi) for fi in range(1, len(pf.index.files))}
            from .._fileio import external_tensors

            for t in external_tensors(model):
                info = {e.key: e.value for e in t.external_data}
                blob = restored.get(info.get("location", ""))
                if blob is None:
                    raise InvalidModelError(f"tensor {t.name!r} references external data {info.get('location')!r} not in the packed file")
                off = int(info.get("offset", 0) or 0)
                ln = int(info["length"]) if info.get("length") else blob.size - off
                t.raw_data = blob[off:off + ln].tobytes()
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
        return model


@dataclass
class VerifyResult:
    path: str
    ok: bool
    checks: List[dict] = field(default_factory=list)  # {"check", "ok", "detail"}
    original_bytes: int = 0
    packed_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def verify(path, against=None, *, threads=None, max_bytes=None) -> VerifyResult:
    """Decode everything and check every checksum and the sha256 of each restored file
    (CorruptFileError on damage). With `against` (the original .onnx), also compare the restored
    bytes with it and its external data files: a difference makes the result not ok."""
    with PackedFile(path, threads=threads, max_bytes=max_bytes) as pf:
        files = pf.index.files
        result = VerifyResult(str(path), True, [], sum(f.size for f in files), pf.size)
        result.checks.append({"check": "header and index", "ok": True, "detail": f"format {pf.index.version[0]}.{pf.index.version[1]}, {len(pf.index.tensors)} tensors"})
        originals = None
        if against is not None:
            a = check_readable(against)
            originals = [a] + [a.parent / f.name for f in files[1:]]
        for fi, fe in enumerate(files):
            handle = None
            if originals is not None:
                try:
                    handle = open(originals[fi], "rb")
                except OSError as exc:
                    result.ok = False
                    result.checks.append({"check": f"compare {fe.name}", "ok": False, "detail": f"cannot read {originals[fi]}: {exc.strerror or exc}"})
            same = handle is not None
            try:
                for window in pf.restore_windows(fi):
                    if handle is not None and same:
                        if handle.read(window.size) != window.tobytes():
                            same = False
                if handle is not None and same and handle.read(1):
                    same = False
            finally:
                if handle is not None:
                    handle.close()
            result.checks.append({"check": f"sha256 {fe.name}", "ok": True, "detail": f"{fe.size} bytes"})
            if handle is not None:
                result.checks.append({"check": f"compare {fe.name}", "ok": same, "detail": "identical" if same else f"differs from {originals[fi]}"})
                result.ok = result.ok and same
        return result
