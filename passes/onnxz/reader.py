"""Reading `.onnxz`: open_packed (lazy tensors), unpack (files back, byte for byte), load, verify,
and PackedFile, the file layer under them (raw payloads, whole files, ranges).

Every entry point takes the .onnxz path or the packed bytes already in memory. Chunks are the
unit of work: each is read (one pread into a per-thread buffer, or a slice of the caller's
buffer), its XXH3-64 checked, and decoded straight into its place in the destination: `ans`
and `ans_shared` chunks (nearly all the bytes) in batches by one C call each (_planes.ans_decode_batch: read,
checked and decoded with the GIL released; one batch per call at 1 thread, ~1 MiB batches with
a pool), other codecs one by one through codecs.decode_chunk. A call hands all its chunks to
`threads` threads at once (the calling thread included), largest first. Restoring a file runs as a pipeline (threads > 1): while the pool decodes
window k+1, a hashing thread runs the whole-file digest (XXH3-128, or sha256 in 1.0 / 1.1 files or
when asked) over window k and the caller writes it. `unpack` decodes the windows into reused
page-aligned buffers and writes them with O_DIRECT where the filesystem takes it (_WindowWriter:
no copy into the page cache; the restored file is then not cached for a reader that follows).
"""
from __future__ import annotations

import gc
import hashlib
import math
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx
import xxhash

from .._cpus import worker_count
from .._pages import huge_page_budget
from .._fileio import (_remove_quietly, atomic_fd, check_readable, check_writable, load_external_data, named_path,
                       parse_model_bytes, replace_together, same_file)
from ..errors import CorruptFileError, FileAccessError, InvalidArgumentError, InvalidModelError, SurgeonError
from . import codecs
from .protowire import write_varint
from .format import DEFAULT_MAX_OUTPUT_BYTES, check_index_size, HEADER_SIZE, MAGIC, Index, Stream, decode_index, normal_data_name, parse_header, parse_index

_xxh3 = xxhash.xxh3_64_intdigest


def _batch_decoder():
    """The C entry that reads, checks and decodes many `ans` chunks in one call with the GIL
    released (_planes.ans_decode_batch), or None. It hashes with the XXH3-64 of the library
    inside the `xxhash` package (found through ctypes; the same digests as _xxh3, checked here
    on every input-size class of XXH3 before it is trusted); without it, or without the
    extension, chunks go one by one through codecs.decode_chunk."""
    if os.environ.get("ONNXZ_NO_BATCH"):
        return None
    try:
        import ctypes

        from . import _planes
        import xxhash._xxhash as xmod

        lib = ctypes.CDLL(xmod.__file__)
        # the dispatching entry where the library has it: it runs the widest vector code of the
        # CPU (AVX-512 or AVX2); XXH3_64bits is built for the baseline (SSE2). Measured on this
        # host (AMD EPYC with AVX-512, 1 MiB in cache): 32 -> 90 GB/s, same digests
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
        _planes.set_xxh3(ctypes.cast(fn, ctypes.c_void_p).value)
        probe = np.random.default_rng(7).integers(0, 256, 4096, np.uint8).tobytes()
        for n in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 4096):
            if _planes.xxh3(probe[:n]) != _xxh3(probe[:n]):
                return None
        return _planes.ans_decode_batch
    except Exception:  # no extension, no exported symbol: the per-chunk path
        return None


_decode_batch_c = _batch_decoder()


def _chunk_hasher():
    """The XXH3-64 of chunks read one by one (skeletons, codecs other than ans): _planes.xxh3, the
    batch decoder's checked function (the dispatching one: AVX-512 / AVX2), where it was set up;
    else xxhash's own (xxh3_64_intdigest runs the library's baseline build, ~1/3 the speed here)."""
    if _decode_batch_c is None:
        return _xxh3
    from . import _planes

    return _planes.xxh3


_chunk_xxh3 = _chunk_hasher()
# the skeleton's runs of a window copied in one call (an older extension lacks it: numpy slices)
_copy_runs = getattr(codecs._fast, "copy_runs", None) if not os.environ.get("ONNXZ_NO_BATCH") else None
# the pass of _whole_file_tasks over a file's cuts in one C call (an older extension lacks it: Python)
_whole_file_plan = getattr(codecs._fast, "whole_file_plan", None) if not os.environ.get("ONNXZ_NO_BATCH") else None


def _streamed_xxh3_128() -> bool:
    """Whether _planes can hash a restore window chunk by chunk inside ans_decode_batch (see
    _Xxh3_128): the streaming XXH3-128 functions of the library inside the `xxhash` package,
    found through ctypes and checked here against xxhash.xxh3_128 on input fed in pieces of every
    size class of XXH3's streaming loop before they are trusted."""
    if _decode_batch_c is None:
        return False
    try:
        import ctypes

        from . import _planes
        import xxhash._xxhash as xmod

        lib = ctypes.CDLL(xmod.__file__)
        names = ("XXH3_createState", "XXH3_freeState", "XXH3_128bits_reset", "XXH3_128bits_update_dispatch",
                 "XXH3_128bits_digest")
        _planes.set_xxh3_128(*(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names))
        probe = np.random.default_rng(11).integers(0, 256, 5000, np.uint8).tobytes()
        for pieces in ((0,), (1, 3), (240, 241), (1024, 1025, 7), (4096, 904), (5000,)):
            state, pos, want = _planes.xxh3_128_new(), 0, xxhash.xxh3_128()
            for n in pieces:
                _planes.xxh3_128_update(state, probe[pos:pos + n])
                want.update(probe[pos:pos + n])
                pos += n
            if _planes.xxh3_128_hexdigest(state) != want.hexdigest():
                return False
        return True
    except Exception:  # an older extension, no exported symbol: xxhash.xxh3_128 in Python
        return False


_fused_xxh3_128 = _streamed_xxh3_128()


class _Xxh3_128:
    """A streaming XXH3-128 whose state ans_decode_batch can feed (the `hashing` argument), with
    xxhash.xxh3_128's update / hexdigest. Why: at 1 thread the window's digest ran as a second pass
    after the whole 4 MiB window was decoded (~9% of unpack CPU on float models); fed chunk by chunk
    right after each chunk decodes, it reads the bytes from cache."""

    def __init__(self):
        from . import _planes

        self._planes = _planes
        self.state = _planes.xxh3_128_new()

    def update(self, data) -> None:
        self._planes.xxh3_128_update(self.state, data)

    def hexdigest(self) -> str:
        return self._planes.xxh3_128_hexdigest(self.state)


READ_RUN = 256 << 10  # _ans.c's READ_RUN: bytes of back-to-back chunks ans_decode_batch reads in one pread
SPAN_READ = 1 << 20  # the scratch handed to ans_decode_batch: codecs.Scratch holds at least this much
BATCH_BYTES = 1 << 20  # raw bytes per batch of small chunks when several threads share the work
# Fresh outputs a PackedFile allocates itself (tensors_bytes, restore_file and read_range without
# `out`) of at least SMALL_PAGES_FROM bytes come as numpy arrays (numpy asks huge pages for those)
# while they add up to at most the file's budget, then as private mappings that refuse huge pages.
# The budget: FRESH_HUGE_BYTES, or where None this host's (passes/_pages.huge_page_budget, as the
# runtime's decode arena: 256 MiB where a virtio balloon reports free pages, no limit elsewhere).
# Why: on this project's hosts (virtual machines whose kernel hands free blocks of 128 KiB and
# more back to the hypervisor: /sys/module/page_reporting, page_reporting_order 5) a huge page
# comes from such a block and is backed again page by page, while 4 KiB pages come first from the
# small free fragments still backed. Fresh memory written once, load 7: 1 GiB at 275-352 MB/s of
# CPU in huge pages, 789-1747 MB/s in 4 KiB pages (one process alternating); fresh processes:
# 48 MiB 5-8 ms against 28-35 ms, 256 MiB 44 / 65 / 807 ms against 117-160, 1 GiB 2.4-2.8 s
# against 0.5-0.7 s. So a small model keeps its huge pages and gigabytes of tensors do not
# (bench/load.py's ~3 GB model, 2880 MiB of float32 `ans` chunks: the decode itself ~0.8 s of CPU,
# 73% of the fold load's samples the kernel zeroing fresh huge pages). The price: arrays in 4 KiB
# pages are read with more TLB misses; that model's session runs, its weights so, took +11-15% CPU
# per run (min of 24, 1 thread, load 3), for a load 3-4x cheaper
SMALL_PAGES_FROM = 4 << 20
FRESH_HUGE_BYTES = None
WINDOW_BYTES = 4 << 20  # restored bytes per window: decoded, then hashed and written while the next decodes;
# small enough that hashing and writing find it still in cache (measured: 8 -> 4 MiB saves ~8% of unpack CPU)
_BYTES_LIKE = (bytes, bytearray, memoryview)


DIGESTS = ("fast", "sha256", "none")


def digest_mode(digest="fast", check_sha256=None) -> str:
    """The whole-file digest a restore checks: "fast" (the file's XXH3-128, format 1.2; its sha256
    when it has none, i.e. a 1.0 / 1.1 file), "sha256" (always the sha256: identity with the
    original), "none" (only every chunk's XXH3-64). `check_sha256` is the older keyword (True ->
    "sha256", False -> "none")."""
    if check_sha256 is not None:
        wanted = "sha256" if check_sha256 else "none"
        if digest not in ("fast", wanted):
            raise InvalidArgumentError(f"digest={digest!r} contradicts check_sha256={check_sha256!r}")
        digest = wanted
    if digest not in DIGESTS:
        raise InvalidArgumentError(f"digest must be one of {', '.join(map(repr, DIGESTS))}, got {digest!r}")
    return digest


def _hashers(fe, mode: str, streamed: bool = False) -> list:
    """[(label, hasher, expected hex)] for restoring file entry `fe` under `mode` (digest_mode's,
    or "both": the sha256 and, when stored, the XXH3-128 -- what `verify` checks). `streamed`: the
    XXH3-128 as an _Xxh3_128 (fed inside the batch decoder) where the extension offers it."""
    out = []
    if mode in ("sha256", "both") or (mode == "fast" and fe.xxh3_128 is None):
        out.append(("sha256", hashlib.sha256(), fe.sha256))
    if mode in ("fast", "both") and fe.xxh3_128 is not None:
        out.append(("xxh3_128", _Xxh3_128() if streamed and _fused_xxh3_128 else xxhash.xxh3_128(), fe.xxh3_128))
    return out


_threads = worker_count  # `threads=` checked, or (None) the CPUs this process may use


def _as_buffer(data) -> Optional[memoryview]:
    """A flat read-only byte view of a bytes-like object (bytes, bytearray, memoryview, mmap, a
    contiguous numpy array), or None when `data` is not one (then it is a path)."""
    if isinstance(data, (str, os.PathLike)):
        return None
    try:
        mv = memoryview(data)
    except TypeError:
        return None
    if not mv.c_contiguous:
        raise InvalidArgumentError("the packed data must be one contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


_gc_lock = threading.Lock()
_gc_holders = 0  # calls inside _gc_held now, over all threads
_gc_was_enabled = False  # the collector's state when the first of them came in


@contextmanager
def _gc_held():
    """The cyclic garbage collector held off (restored after): opening and restoring make
    thousands of small acyclic objects (index records, window and task tuples), enough to start
    a collection or two per call (~0.1-0.3 ms: 3-5% of unpacking a small model). Counted over
    threads: the state is read when the first holder comes in and put back when the last leaves
    (a per-call isenabled()/disable() pair raced with another thread's enable() and could leave
    the collector off for good)."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def _open_input(source) -> tuple:
    """(path, descriptor opened for reading, its size, (st_dev, st_ino)) of the packed file `source`:
    one open and one fstat, where check_readable asks the path four times (exists, is_dir, stat,
    access: ~20 us, ~1% of unpacking a small model, on these hosts). The open is non-blocking, so
    that a FIFO is never waited on; anything but a regular file, and any failure to open, gets
    check_readable's verdict and message. A bare descriptor (every read is a pread): a file object
    cost three more system calls (fstat, isatty's ioctl, lseek) and a 4 KiB buffered read of the
    64-byte header."""
    path = named_path(source)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        check_readable(path)  # says why (no such file, a folder, a socket, permission denied)
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            check_readable(path)  # a folder, device or pipe: its own message
            raise FileAccessError(f"{path} is not a regular file")
        if hasattr(os, "O_NONBLOCK"):  # (no effect on a regular file's reads; cleared all the same)
            os.set_blocking(fd, True)
        return path, fd, st.st_size, (st.st_dev, st.st_ino)
    except BaseException:
        os.close(fd)
        raise


def _naming(exc: SurgeonError, path) -> SurgeonError:
    """`exc` (same class) with the file's path in front of its message, unless it names it already:
    with two inputs (eval, verify --against) or in a CI log, 'truncated .onnxz file' alone does not
    say which file."""
    text = str(exc)
    if str(path) in text:
        return exc
    return type(exc)(f"{path}: {text}")


def _read_index(frame, header, limit: int) -> Index:
    with _gc_held():
        return parse_index(decode_index(frame, header), header, limit)


class _Group:
    """Tasks run by a few workers pulling from one shared list (one pool submission per worker,
    not per chunk). wait() returns once every worker has stopped, then raises the first error:
    no worker is ever left writing into a buffer the caller has moved on from."""

    def __init__(self, tasks):
        self._next = iter(tasks).__next__  # list iterators hand out items atomically under the GIL
        self.error: Optional[BaseException] = None
        self.futures = []

    def work(self) -> None:
        take = self._next
        while self.error is None:
            try:
                fn, *args = take()
            except StopIteration:
                return
            try:
                fn(*args)
            except BaseException as exc:  # stop the others early; reported by wait()
                if self.error is None:
                    self.error = exc
                return

    def wait(self) -> None:
        for fut in self.futures:
            fut.result()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class PackedFile:
    """An open, validated `.onnxz` file: the index, and its chunks decoded on demand.

    `source` is a path, or the packed bytes already in memory (bytes, bytearray, memoryview,
    mmap, a contiguous uint8 numpy array): chunks are then decoded straight from that buffer,
    without a copy (the buffer must not change while the PackedFile is open). A file is read
    with one pread per chunk into a per-thread buffer (never mmap: a file truncated under us must
    raise an error, not SIGBUS).

    Public API (all decode in parallel on `threads` threads, every chunk's XXH3-64 checked
    before it is decoded, sizes checked against the index and `max_bytes` on opening):

    - `index` (format.Index: `files`, `tensors`), `tensor(key)` -> its TensorEntry;
    - `tensor_bytes(entry_or_key, out=None)` -> the payload bytes of one tensor (uint8), decoded
      into `out` when given (a writable uint8 array of `entry.length` bytes);
    - `tensors_bytes(entries, outs=None)` -> list of payloads, all chunks scheduled together;
    - `restore_file(fi, out=None, *, skip=())` -> the whole file `fi` (0: the model, then its
      external data files) as uint8; `skip`: tensor entries whose payload is not decoded (`out`
      keeps what it held there; the whole-file digest is then not checked);
    - `restore_windows(fi, digest="fast")` -> the file in consecutive windows (memory-bounded), its
      whole-file digest checked (XXH3-128; sha256 when the file has none or digest="sha256");
      with threads > 1 the next window decodes and this one is hashed while the caller writes it;
    - `read_range(fi, offset, length)` -> bytes of the restored file in that range;
    - `skeleton(fi)` -> the decoded skeleton stream of file `fi`;
    - `close()`, context manager.
    """

    def __init__(self, source, *, threads=None, max_bytes: Optional[int] = None):
        self.threads = _threads(threads)
        limit = DEFAULT_MAX_OUTPUT_BYTES if max_bytes is None else max_bytes
        if not isinstance(limit, int) or limit < 0:
            raise InvalidArgumentError("max_bytes must be a non-negative integer")
        self.closed = True
        self._buf = _as_buffer(source)
        self._fd = None  # the packed file's descriptor (None: the bytes are in memory)
        self._identity = None  # (st_dev, st_ino) of the packed file read
        if self._buf is not None:
            self.path = None
            self.size = self._buf.nbytes
            header = parse_header(bytes(self._buf[:HEADER_SIZE]), self.size)
            check_index_size(header, limit)
            frame = self._buf[header.index_offset:header.index_offset + header.index_length]
            self.index: Index = _read_index(frame, header, limit)
            if self.index.catalog is not None:
                off, stored = self.index.catalog[:2]
                self._attach_catalog(bytes(self._buf[off:off + stored]))
        else:
            if not isinstance(source, (str, os.PathLike)):
                raise InvalidArgumentError(f"expected a path or the packed bytes, got {type(source).__name__}")
            self.path, self._fd, size, self._identity = _open_input(source)
            try:
                header = parse_header(os.pread(self._fd, HEADER_SIZE, 0), size)
                check_index_size(header, limit)
                self.size = size
                frame = os.pread(self._fd, header.index_length, header.index_offset)
                if len(frame) != header.index_length:
                    raise CorruptFileError("truncated .onnxz file (index)")
                self.index = _read_index(frame, header, limit)
                if self.index.catalog is not None:
                    off, stored = self.index.catalog[:2]
                    self._attach_catalog(os.pread(self._fd, stored, off))
            except BaseException as exc:
                os.close(self._fd)
                self._fd = None
                if isinstance(exc, SurgeonError):
                    raise _naming(exc, self.path) from None
                raise
        # `threads` workers: a synchronous run uses threads-1 of them plus the calling thread; a
        # pipelined restore decodes on all of them while a hashing thread (_hasher) and the caller
        # hash and write the window before
        self._pool = ThreadPoolExecutor(max_workers=self.threads) if self.threads > 1 else None
        self._lock = threading.Lock()
        # bytes of fresh outputs still given huge pages (_fresh)
        self._huge_left = huge_page_budget() if FRESH_HUGE_BYTES is None else FRESH_HUGE_BYTES
        self._hash_pool: Optional[ThreadPoolExecutor] = None
        self._skeletons: Dict[int, np.ndarray] = {}
        self.closed = False

    def _is_input(self, path, st=None) -> bool:
        """Whether `path` names the packed file this reads (a hard link, a symlink or another
        spelling of it too), by the inode of the open file: one stat, where same_file's samefile
        made two (and resolved both paths when `path` did not exist yet). A path that cannot be
        looked at is not it. `st`: its os.stat made already (False: it failed)."""
        if self._identity is None:
            return False
        if st is None:
            try:
                st = os.stat(path)
            except OSError:
                return False
        return st is not False and (st.st_dev, st.st_ino) == self._identity

    def _attach_catalog(self, data: bytes) -> None:
        """The catalog's stored bytes (1.3), checked now (every stored byte is checked by an unpack,
        which never parses the catalog) and parsed when the entries are first asked for."""
        if len(data) != self.index.catalog[1]:
            raise CorruptFileError("truncated .onnxz file (catalog)")
        if _chunk_xxh3(data) != self.index.catalog[3]:
            raise CorruptFileError("damaged .onnxz file: the catalog fails its checksum (XXH3-64)")
        self.index.attach_catalog(data)

    def _serial(self) -> None:
        """Decode on the calling thread only from now on (before any work: the pool has started
        no thread yet). Measured on models of 0.3-2.3 MB restored: 2 threads cost 0.6-1.2 ms more
        CPU than 1 (thread start-up, hand-offs) for the same wall time."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.threads = 1

    @cached_property
    def _by_key(self) -> Dict[str, object]:
        """Tensor entries by key, made on first use: unpack never looks a tensor up by key, and
        the dict cost ~10 us per open of a model of a few hundred tensors (0.5% of its unpack)."""
        return {t.key: t for t in self.index.tensors}

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else "<packed bytes in memory>"

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._buf = None
        self._skeletons.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self.closed:
            raise InvalidArgumentError("the packed file is closed")

    def _stored(self, chunk):
        """The chunk's stored bytes, checksum verified: a slice of the in-memory buffer, or read
        with one pread into this thread's reusable input buffer."""
        offset = chunk.offset
        n = sum(chunk.planes)
        if self._buf is not None:
            mv = self._buf[offset:offset + n]  # the index vouched: inside the data area
        else:
            mv = memoryview(codecs.scratch("input").get(n))
            try:
                got = os.preadv(self._fd, (mv,), offset)
            except OSError as exc:
                raise FileAccessError(f"cannot read {self.path}: {exc.strerror or exc}") from None
            if got != n:
                raise CorruptFileError(f"{self.path}: truncated .onnxz file: chunk at {offset} runs past the end")
        if _chunk_xxh3(mv) != chunk.xxh3:
            raise CorruptFileError(f"damaged .onnxz file: chunk at {offset} fails its checksum (XXH3-64)")
        return mv

    def _frames(self, chunk) -> List[memoryview]:
        mv = self._stored(chunk)
        planes = chunk.planes
        if len(planes) == 1:
            return [mv]
        frames, pos = [], 0
        for ln in planes:
            end = pos + ln
            frames.append(mv[pos:end])
            pos = end
        return frames

    def _decode_chunk(self, stream: Stream, chunk, out: np.ndarray) -> None:
        codecs.decode_chunk(stream.codec, stream.params, self._frames(chunk), chunk.raw_length, out)

    def _start(self, tasks, workers: int) -> _Group:
        """Tasks handed to `workers` pool threads (at most the pool's size)."""
        group = _Group(tasks)
        for _ in range(min(workers, len(tasks), self.threads)):
            group.futures.append(self._pool.submit(group.work))
        return group

    def _run(self, tasks) -> None:
        """Run (fn, *args) tasks on the calling thread and threads-1 pool workers, which pull
        them in order from one shared list; the first error is raised once all have stopped."""
        if self._pool is None or len(tasks) <= 1:
            for fn, *args in tasks:
                fn(*args)
            return
        group = self._start(tasks, self.threads - 1)
        try:
            group.work()
        finally:
            group.wait()

    @staticmethod
    def _spec(stream: Stream, chunk):
        """(offset, stored, plane sizes, xxh3, flags, shared tables or None) of an `ans` or
        `ans_shared` chunk for the batch decoder (made by format._stream, whose checks it
        passed), or None (other codecs)."""
        spec = chunk.spec
        return None if spec is None else spec + (stream.tables,)

    def _decode_batch(self, specs, hashing=None):
        """Many ans chunks read, checked and decoded in one C call (GIL released). `hashing`:
        (an _Xxh3_128's state, the window the chunks decode into, cursor): the window is hashed up
        to the end of each chunk as it decodes; returns the new cursor (else None)."""
        # `hashing` passed only when given: an extension built before it takes three arguments
        # (a tree updated without rebuilding then still unpacks, hashing windows in Python)
        extra = () if hashing is None else (hashing,)
        if self._buf is not None:
            failed = _decode_batch_c(self._buf, None, specs, *extra)
        else:
            # room for READ_RUN: the C side reads chunks stored back to back in one pread; and for
            # SPAN_READ: a batch whose chunks lie within it is read in one pread and its 32-lane
            # chunks decoded two at a time across it (the scratch is that large anyway)
            failed = _decode_batch_c(self._fd, codecs.scratch("input").get(max(SPAN_READ, max(s[1] for s in specs))), specs, *extra)
        if failed is None or type(failed) is int:
            return failed
        i, code, message = failed
        offset = specs[i][0]
        if code == 0:
            raise CorruptFileError(f"damaged .onnxz file: chunk at {offset} fails its checksum (XXH3-64)")
        if code == 1:
            raise CorruptFileError(f"damaged chunk: {message}")
        if code == 2:  # (from memory: the buffer is shorter than the index says)
            where = f"{self.path}: " if self.path is not None else ""
            raise CorruptFileError(f"{where}truncated .onnxz file: chunk at {offset} runs past the end")
        if code == 3:
            raise FileAccessError(f"cannot read {self.path}: {message}")
        raise CorruptFileError(f"damaged index: ans chunk at {offset} has planes that do not fit its codec")

    def _tasks(self, jobs, cached: bool = False) -> list:
        """Tasks (fn, *args) for chunk jobs (stream, chunk, out slice). With a pool, largest
        first (the last task to start is a small one: the threads finish together) and small
        `ans` chunks grouped into batches of ~BATCH_BYTES; on one thread, every `ans` chunk in
        one batch (`ans_shared` chunks, the codec for small tensors sharing a table, too). Other
        codecs: one task per chunk. `cached`: the output is read again right away
        (a restore window, hashed and written): large chunks then skip the non-temporal stores
        that keep a decoded tensor from evicting the cache."""
        parallel = self._pool is not None
        batching = _decode_batch_c is not None and codecs._fast is not None  # tests switch the C paths off there
        if parallel:
            jobs = sorted(jobs, key=lambda j: -j[1].raw_length)
        tasks, batch, size = [], [], 0
        for stream, chunk, out in jobs:
            spec = chunk.spec if batching else None
            if spec is None:
                tasks.append((self._decode_chunk, stream, chunk, out))
                continue
            offset, stored, planes, digest, flags = spec
            tables = stream.tables
            if tables is None:
                batch.append((offset, stored, planes, digest, flags | 4 if cached else flags, out))
            else:
                batch.append((offset, stored, planes, digest, flags | 4 if cached else flags, out, tables))
            size += chunk.raw_length
            if parallel and size >= BATCH_BYTES:
                tasks.append((self._decode_batch, batch))
                batch, size = [], 0
        if batch:
            tasks.append((self._decode_batch, batch))
        return tasks

    @staticmethod
    def _stream_jobs(stream: Stream, out: np.ndarray):
        jobs, pos = [], 0
        for c in stream.chunks:
            jobs.append((stream, c, out[pos:pos + c.raw_length]))
            pos += c.raw_length
        return jobs

    def stream_tasks(self, stream: Stream, out: np.ndarray):
        return self._tasks(self._stream_jobs(stream, out))

    def decode_stream(self, stream: Stream, out: Optional[np.ndarray] = None) -> np.ndarray:
        if out is None:
            out = np.empty(stream.raw_length, np.uint8)
        self._run(self.stream_tasks(stream, out))
        return out

    def skeleton(self, fi: int) -> np.ndarray:
        self._check_open()
        with self._lock:
            s = self._skeletons.get(fi)
        if s is None:
            s = self.decode_stream(self.index.files[fi].skeleton)
            with self._lock:
                self._skeletons[fi] = s
        return s

    # ------------------------------------------------------------------ tensors

    def tensor(self, key: str):
        """The index entry (format.TensorEntry) of the tensor `key`; KeyError if there is none."""
        return self._by_key[key]

    def _entry(self, entry):
        return self._by_key[entry] if isinstance(entry, str) else entry

    def _fresh(self, length: int) -> np.ndarray:
        """A fresh uint8 array of `length` bytes for an output the caller did not give: huge pages
        within the file's budget, 4 KiB pages past it (see FRESH_HUGE_BYTES)."""
        if length < SMALL_PAGES_FROM:
            return np.empty(length, np.uint8)
        with self._lock:
            huge = length <= self._huge_left
            self._huge_left = self._huge_left - length if huge else 0
        return np.empty(length, np.uint8) if huge else _small_pages(length)

    def _out(self, out, length: int, what: str) -> np.ndarray:
        if out is None:
            return self._fresh(length)
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1 or out.size != length \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError(f"out for {what} must be a writable contiguous uint8 array of {length} bytes")
        return out

    def tensors_bytes(self, entries, outs=None) -> List[np.ndarray]:
        """The payload bytes of several tensors (entries or keys), decoded together: every chunk
        of every coded tensor goes to the thread pool at once (largest first); payloads the
        writer left in the skeleton are copied from it."""
        self._check_open()
        entries = [self._entry(e) for e in entries]
        outs = [None] * len(entries) if outs is None else list(outs)
        if len(outs) != len(entries):
            raise InvalidArgumentError("tensors_bytes: one out per entry, or none")
        result, jobs = [], []
        for e, out in zip(entries, outs):
            out = self._out(out, e.length, f"tensor {e.key!r}")
            result.append(out)
            if e.stream is not None:
                jobs.extend(self._stream_jobs(e.stream, out))
            else:
                self._read_range_into(e.file, e.offset, out)
        self._run(self._tasks(jobs))
        return result

    def tensor_bytes(self, entry, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The payload bytes of one tensor (a TensorEntry or its key) as uint8, into `out` if given."""
        return self.tensors_bytes([entry], None if out is None else [out])[0]

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
            stream = self.index.coded[ti].stream
            p = off
            for c in stream.chunks:
                if c.raw_length:
                    yield p, c.raw_length, ("chunk", stream, c)
                p += c.raw_length
            pos = off + ln
        if fe.size > pos:
            yield pos, fe.size - pos, ("skel", skel)

    def _windows(self, fi: int, window: int):
        """The file's pieces grouped into consecutive windows of about `window` bytes (a chunk is
        never split): yields (start, length, [(offset in window, length, source), ...]), source
        as in _pieces. _pieces written out here (one generator fewer, no tuple per piece to
        re-read): this runs once per chunk of every restore."""
        fe = self.index.files[fi]
        coded = self.index.coded  # (not index.tensors: that would make every entry)
        start = used = pos = skel = 0
        items = []
        append = items.append
        for off, ln, ti in fe.cuts + [(fe.size, 0, -1)]:  # the sentinel: the skeleton after the last cut
            n = off - pos
            while n:  # skeleton bytes [pos, off), split at window ends
                if used >= window:
                    yield start, used, items
                    start, used, items = start + used, 0, []
                    append = items.append
                k = min(n, window - used)
                append((used, k, ("skel", skel)))
                skel += k
                used += k
                n -= k
            if ti < 0:
                break
            stream = coded[ti].stream
            for c in stream.chunks:
                r = c.raw_length
                if r:
                    if used and used + r > window:
                        yield start, used, items
                        start, used, items = start + used, 0, []
                        append = items.append
                    append((used, r, ("chunk", stream, c)))
                    used += r
            pos = off + ln
        if used or not start:
            yield start, used, items

    def _fill(self, window: np.ndarray, items, skel) -> list:
        """Copy the skeleton parts of a window now (in one C call where the extension has
        copy_runs); return the decode tasks of its chunks."""
        jobs, runs = [], []
        for woff, ln, src in items:
            if src[0] == "skel":
                runs.append((woff, src[1], ln))
            else:
                jobs.append((src[1], src[2], window[woff:woff + ln]))
        if _copy_runs is not None and codecs._fast is not None:  # (tests switch the C paths off there)
            _copy_runs(window, skel, runs)
        else:
            for woff, at, ln in runs:
                window[woff:woff + ln] = skel[at:at + ln]
        return self._tasks(jobs, cached=True)

    def _restore(self, fi: int, target, digest: str = "fast"):
        """Decode file `fi` window by window and yield each window. With a pool, three things
        overlap: window k+1 decodes on the pool, window k is hashed (its digest, in order) on a
        hashing thread, and the caller consumes (writes) window k. `target(start, length, k)`
        gives the array window k decodes into (it may reuse window k-2's array: both decoding
        into it and hashing it are finished by then). The whole-file digest(s) of `digest` (see
        _hashers) are checked before the last window is yielded."""
        fe = self.index.files[fi]
        skel = self.skeleton(fi)
        parallel = self._pool is not None
        hashers = _hashers(fe, digest, streamed=not parallel)
        check = bool(hashers)
        # one thread and only the XXH3-128 to check: each window hashed as its chunks decode
        streamed = hashers[0][1] if len(hashers) == 1 and isinstance(hashers[0][1], _Xxh3_128) else None

        if streamed is not None and fe.size <= WINDOW_BYTES and _copy_runs is not None and codecs._fast is not None \
                and _decode_batch_c is not None:
            # the whole file in one window, on this thread, hashed as it decodes: in one pass over
            # its cuts, without _windows / _fill / _tasks
            arr = target(0, fe.size, 0)
            self._run_hashed(self._whole_file_tasks(fe, arr, skel), arr, streamed)
            if streamed.hexdigest() != hashers[0][2]:
                raise CorruptFileError(f"damaged .onnxz file: {fe.name} does not match its {hashers[0][0]}")
            yield arr
            return

        def update(arr):  # hashlib and xxhash both release the GIL on large buffers
            for _, h, _ in hashers:
                h.update(arr)
        windows = self._windows(fi, WINDOW_BYTES)
        pending = None  # (window array, group) decoding on the pool
        hashing = None  # the digest update of the previous window, on the hashing thread

        def start(k, spec):
            s, n, items = spec
            arr = target(s, n, k)
            tasks = self._fill(arr, items, skel)
            if streamed is not None:
                self._run_hashed(tasks, arr, streamed)
                return arr, None
            if not parallel:
                self._run(tasks)
                return arr, None
            return arr, self._start(tasks, self.threads)

        try:
            k = 0
            spec = next(windows)
            pending = start(k, spec)
            for spec in windows:
                arr, group = pending
                pending = None
                if group is not None:
                    group.wait()
                if hashing is not None:  # window k-1's array is about to be reused
                    hashing, h = None, hashing
                    h.result()
                k += 1
                pending = start(k, spec)  # decodes while this window is hashed and consumed
                if not check or streamed is not None:
                    pass
                elif parallel:
                    hashing = self._hasher().submit(update, arr)
                else:
                    update(arr)
                yield arr
            arr, group = pending
            pending = None
            if group is not None:
                group.wait()
            if hashing is not None:
                hashing, h = None, hashing
                h.result()
            if check and streamed is None:
                update(arr)
            for label, h, want in hashers:
                if h.hexdigest() != want:
                    raise CorruptFileError(f"damaged .onnxz file: {fe.name} does not match its {label}")
            yield arr
        finally:  # abandoned or failed: let the workers finish with the arrays before they go
            for waiter in ((pending[1].wait if pending is not None and pending[1] is not None else None),
                           (hashing.result if hashing is not None else None)):
                if waiter is not None:
                    try:
                        waiter()
                    except BaseException:
                        pass

    def _whole_file_tasks(self, fe, window: np.ndarray, skel: np.ndarray) -> list:
        """What _windows, _fill and _tasks(cached=True) make of a file that fits one window, on one
        thread, in one pass over its cuts (the same runs of skeleton bytes, copied now; the same
        tasks in the same order: chunks of other codecs one by one, then every `ans` chunk in one
        batch). Why: for a small model those three passes over its pieces were ~40% of the
        Python lines an unpack runs (~800 of ~3200 for silero_vad_v6.int8). Needs the C paths
        (_copy_runs, the batch decoder). The pass itself in C where the extension has it
        (_planes.whole_file_plan: the same items; the batch's outs memoryviews of the window)."""
        if _whole_file_plan is not None:
            runs, others, batch = _whole_file_plan(fe.cuts, self.index.coded, window, fe.size)
            _copy_runs(window, skel, runs)
            tasks = [(self._decode_chunk, stream, c, window[at:at + r]) for stream, c, at, r in others]
            if batch:
                tasks.append((self._decode_batch, batch))
            return tasks
        coded = self.index.coded
        runs, tasks, batch = [], [], []
        pos = skel_at = 0
        for off, ln, ti in fe.cuts:
            if off > pos:
                runs.append((pos, skel_at, off - pos))
                skel_at += off - pos
            stream = coded[ti].stream
            tables = stream.tables
            at = off
            for c in stream.chunks:
                r = c.raw_length
                if r:
                    spec = c.spec
                    if spec is None:
                        tasks.append((self._decode_chunk, stream, c, window[at:at + r]))
                    elif tables is None:
                        batch.append((spec[0], spec[1], spec[2], spec[3], spec[4] | 4, window[at:at + r]))
                    else:
                        batch.append((spec[0], spec[1], spec[2], spec[3], spec[4] | 4, window[at:at + r], tables))
                    at += r
            pos = off + ln
        if fe.size > pos:
            runs.append((pos, skel_at, fe.size - pos))
        _copy_runs(window, skel, runs)
        if batch:
            tasks.append((self._decode_batch, batch))
        return tasks

    def _run_hashed(self, tasks, window: np.ndarray, h: "_Xxh3_128") -> None:
        """Run a window's tasks on this thread and feed the whole window to `h`, in order: the
        batch of ans chunks (the last task: _tasks puts it after the chunks of other codecs, and
        _fill has copied the skeleton parts already) hashes the window up to the end of each chunk
        as it decodes; what follows its last chunk is hashed here."""
        cursor = 0
        last = len(tasks) - 1
        for i, (fn, *args) in enumerate(tasks):
            if i == last and fn == self._decode_batch:
                cursor = fn(*args, hashing=(h.state, window, 0))
            else:
                fn(*args)
        h.update(window[cursor:])

    def _hasher(self) -> ThreadPoolExecutor:
        """One thread for digest updates: in order, beside the decoding (hashlib and xxhash release the GIL)."""
        with self._lock:
            if self._hash_pool is None:
                self._hash_pool = ThreadPoolExecutor(max_workers=1)
            return self._hash_pool

    def restore_windows(self, fi: int, *, digest: str = "fast", check_sha256: Optional[bool] = None):
        """Yield the file `fi` in consecutive windows (memory-bounded: two windows of about
        WINDOW_BYTES); the whole-file digest is checked before the last window is yielded:
        digest="fast" (default) the file's XXH3-128 (its sha256 in 1.0 / 1.1 files), "sha256",
        or "none" (every chunk's XXH3-64 still is checked); check_sha256=True/False is the older
        spelling of "sha256"/"none". A window's array is reused once the next one is asked for:
        consume (write) it first."""
        self._check_open()
        mode = digest if digest == "both" else digest_mode(digest, check_sha256)
        buffers = [np.empty(0, np.uint8), np.empty(0, np.uint8)]

        def target(s, n, k):
            if buffers[k % 2].size < n:
                buffers[k % 2] = np.empty(max(n, min(self.index.files[fi].size, WINDOW_BYTES)), np.uint8)
            return buffers[k % 2][:n]

        yield from self._restore(fi, target, mode)

    def restore_file(self, fi: int, out: Optional[np.ndarray] = None, *, skip=(), digest: str = "fast") -> np.ndarray:
        """The whole file `fi` (0: the model) as uint8, decoded into `out` when given (a writable
        uint8 array of the file's size); its whole-file digest checked (`digest` as in
        restore_windows). Tensors in `skip` (entries or keys) are not decoded: `out` keeps what
        it held in their payload ranges, and no whole-file digest can be checked (every chunk's
        own checksum still is)."""
        self._check_open()
        mode = digest_mode(digest)
        fe = self.index.files[fi]
        out = self._out(out, fe.size, f"file {fe.name!r}")
        skipped = {id(self._entry(e).stream) for e in skip if self._entry(e).stream is not None}
        if skipped:
            skel = self.skeleton(fi)
            items = [(off, ln, src) for off, ln, src in self._pieces(fi) if src[0] == "skel" or id(src[1]) not in skipped]
            self._run(self._fill(out, items, skel))
            return out
        for _ in self._restore(fi, lambda s, n, k: out[s:s + n], mode):
            pass
        return out

    def _read_range_into(self, fi: int, offset: int, out: np.ndarray) -> None:
        length = out.size
        skel = None
        jobs = []
        end = offset + length
        for off, ln, src in self._pieces(fi):
            a, b = max(off, offset), min(off + ln, end)
            if a >= b:
                if off >= end:
                    break
                continue
            if src[0] == "skel":
                if skel is None:
                    skel = self.skeleton(fi)
                s = src[1] + (a - off)
                out[a - offset:b - offset] = skel[s:s + (b - a)]
            elif a == off and b == off + ln:
                jobs.append((src[1], src[2], out[a - offset:b - offset]))
            else:  # partly covered chunk: decode it aside
                tmp = np.empty(ln, np.uint8)
                self._decode_chunk(src[1], src[2], tmp)
                out[a - offset:b - offset] = tmp[a - off:b - off]
        self._run(self._tasks(jobs))

    def read_range(self, fi: int, offset: int, length: int) -> np.ndarray:
        """Bytes of the restored file `fi` in [offset, offset+length), decoding only what covers them."""
        self._check_open()
        fe = self.index.files[fi]
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= fe.size):
            raise InvalidArgumentError(f"range {offset}+{length} lies outside {fe.name!r} ({fe.size} bytes)")
        out = self._fresh(length)
        self._read_range_into(fi, offset, out)
        return out


def _small_pages(length: int) -> np.ndarray:
    """`length` bytes of private anonymous memory that refuses huge pages (MADV_NOHUGEPAGE), pages
    untouched until written, returned to the system with the array (see FRESH_HUGE_BYTES); an
    np.empty where such a mapping cannot be made."""
    import mmap

    try:
        area = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError):
        return np.empty(length, np.uint8)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            area.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(area, np.uint8)


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
    """Lazy access to the tensors of a `.onnxz` file (a path, or the packed bytes in memory);
    get_tensor decodes only that tensor's chunks. A read-only mapping from tensor key to array:
    `keys()`, `len()`, `in`, iteration and `packed[key]` (= get_tensor) work as on a dict, and a key
    the pack does not hold raises KeyError, as a dict does. `packed_file` is the PackedFile
    underneath (raw payload bytes, whole files, ranges). Use it as a context manager, or close()."""

    def __init__(self, source, *, threads=None, max_bytes=None):
        self._pf = PackedFile(source, threads=threads, max_bytes=max_bytes)

    @property
    def packed_file(self) -> PackedFile:
        return self._pf

    def keys(self) -> List[str]:
        """The tensor keys in pack order: each tensor's name (an unnamed one's Constant-node output
        or node/attribute path), with "#2", "#3" appended to repeated names (FORMAT.md, 4)."""
        return [t.key for t in self._pf.index.tensors]

    def __iter__(self):
        return iter(self.keys())

    def __getitem__(self, key: str) -> np.ndarray:
        return self.get_tensor(key)

    def __contains__(self, key) -> bool:
        return key in self._pf._by_key

    def __len__(self) -> int:
        return len(self._pf._by_key)

    def get_tensor(self, key: str, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The tensor `key` as a numpy array. With `out` (a C-contiguous writable array of the
        tensor's dtype and shape, e.g. one reused from call to call: fresh memory is page-fault
        bound) a plain payload is decoded straight into it, others are copied into it; after an
        error its contents are undefined. KeyError when the pack holds no tensor `key`."""
        self._pf._check_open()
        entry = self._pf._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        if out is None:
            return _to_array(entry, self._pf.tensor_bytes(entry))
        np_type = _PLAIN.get(entry.dtype)
        if not isinstance(out, np.ndarray) or np_type is None or out.dtype != np_type \
                or list(out.shape) != list(entry.shape) or not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError(f"out for tensor {key!r} must be a writable C-contiguous {entry.dtype} array of shape {entry.shape}")
        if entry.field in ("raw_data", "external") and out.nbytes == entry.length:
            self._pf.tensor_bytes(entry, out.reshape(-1).view(np.uint8))
            _to_array(entry, out.reshape(-1).view(np.uint8))  # the same checks as without out
        else:
            out[...] = _to_array(entry, self._pf.tensor_bytes(entry))
        return out

    def get_tensors(self, keys=None) -> Dict[str, np.ndarray]:
        """Several tensors (all by default) decoded together, every chunk on the thread pool at once."""
        self._pf._check_open()
        keys = self.keys() if keys is None else list(keys)
        missing = [k for k in keys if k not in self._pf._by_key]
        if missing:
            raise KeyError(missing[0])
        entries = [self._pf._by_key[k] for k in keys]
        return {e.key: _to_array(e, b) for e, b in zip(entries, self._pf.tensors_bytes(entries))}

    def metadata(self) -> dict:
        """What the pack's index says, without decoding: format version, writer, sizes, each
        file's size and digests, and per tensor its key, name, dtype, shape, codec and chunks."""
        idx = self._pf.index
        tensors = []
        coded = {ti: t.key for ti, t in idx.coded.items()}
        for t in idx.tensors:
            s = t.stream
            same = getattr(s, "same_as", None)
            if same is not None:  # (1.4: stored once, under the earlier tensor named)
                s = None
            tensors.append({
                "key": t.key, "name": t.name, "dtype": onnx.TensorProto.DataType.Name(t.dtype) if t.dtype in onnx.TensorProto.DataType.values() else t.dtype,
                "shape": t.shape, "field": t.field, "file": idx.files[t.file].name, "bytes": t.length,
                "stored": 0 if same is not None else s.stored if s else None,
                "codec": "same" if same is not None else s.codec if s else "skeleton",
                "params": {"tensor": coded.get(same)} if same is not None else s.params if s else {},
                "chunks": len(s.chunks) if s else 0,
            })
        return {
            "format_version": "%d.%d" % idx.version, "writer": idx.writer, "path": self._pf.label,
            "packed_bytes": self._pf.size,
            "original_bytes": sum(f.size for f in idx.files),
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256, "xxh3_128": f.xxh3_128,
                       "skeleton_stored": f.skeleton.stored,
                       "cuts": len(f.cuts)} for f in idx.files],
            "tensors": tensors,
        }

    def close(self) -> None:
        """Release the file (or the memory) underneath; later calls raise InvalidArgumentError."""
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


def open_packed(source, *, threads=None, max_bytes=None) -> PackedModel:
    """Lazy tensor access to a `.onnxz`: `source` is its path or its bytes already in memory
    (bytes, bytearray, memoryview, mmap, uint8 numpy array; not copied, must stay unchanged)."""
    return PackedModel(source, threads=threads, max_bytes=max_bytes)


# ---------------------------------------------------------------------- files

def _default_dst(src: Path) -> Path:
    if src.suffix == ".onnxz":
        return src.with_suffix(".onnx")
    return src.with_name(src.name + ".onnx")


def unpack(src, dst=None, *, threads=None, force: bool = False, max_bytes=None, digest: str = "fast",
           check_sha256: Optional[bool] = None, direct_io: bool = True) -> Path:
    """Restore the .onnx (and its external data files beside it) byte for byte; returns the .onnx
    path. `src` is the .onnxz path, or its bytes in memory (then `dst` is required). Each file is
    decoded in windows: with threads > 1 the next window decodes while this one is hashed and
    written; written atomically (temporary file, fsync, rename), with O_DIRECT where the filesystem
    takes it: no copy into the page cache (measured: 6-13 ms less CPU on 24-45 MB models), but the
    restored file is then not cached, so reading it right after costs the disk (measured: +5-7 ms
    CPU, +19-42 ms wall on the same models). direct_io=False (or env ONNXZ_NO_DIRECT=1) writes
    through the page cache: for a file loaded right after. Every restored file's whole-file
    digest is checked: digest="fast" (default) its XXH3-128 (recorded since format 1.2; ~15 GB/s) or, in a
    1.0 / 1.1 file that has none, its sha256 (~1-2 GB/s: 30-50% of unpack's CPU on float models);
    "sha256" always the sha256; "none" skips the whole-file digest (every stored chunk's XXH3-64
    is still checked, so damaged data is still refused; a reader bug would go unnoticed).
    check_sha256=True/False is the older spelling of "sha256"/"none"."""
    mode = digest_mode(digest, check_sha256)
    in_memory = _as_buffer(src) is not None
    if in_memory:
        if dst is None:
            raise InvalidArgumentError("unpack from bytes in memory needs a destination path")
    else:
        src = named_path(src)
    dst = _default_dst(src) if dst is None else named_path(dst)
    # dst's checks come once the pack is open: whether it is the pack itself (force=True would
    # rename the model over it) from the open file's inode, then atomic_fd's before anything
    # is decoded (and _unpack_files' before the data files of a pack that has some)
    with _gc_held():
        _unpack_files(src, dst, threads, max_bytes, mode, direct_io, force, in_memory)
    return dst


def _unpack_files(src, dst: Path, threads, max_bytes, mode: str, direct_io: bool, force: bool, in_memory: bool) -> None:
    """unpack's work, in its own frame so that the index and every record of it are freed when it
    returns, while unpack still holds the collector off: left alive past that point, the ~10
    allocations per index entry started a collection of them right after (one per unpack,
    measured: ~5% of a small model's unpack CPU, and now and then a full one)."""
    with PackedFile(src, threads=threads, max_bytes=max_bytes) as pf:
        try:  # one stat of dst for both checks (the input's identity, atomic_fd's): ~4 us each here
            st = os.stat(dst)
        except OSError:
            st = False
        if not in_memory and pf._is_input(dst, st):
            raise FileAccessError(f"cannot write {dst}: it is the input file {src}; the input is never modified: "
                                  "choose another destination")
        files = pf.index.files
        if sum(f.size for f in files) <= WINDOW_BYTES:
            pf._serial()  # one window: nothing to overlap, and threads cost more than they share
        if len(files) > 1:  # (a single file: atomic_fd checks dst first; made twice, it was ~35 us of a ~2 ms unpack)
            check_writable(dst, force)
        targets = [dst]
        if len(files) > 1:
            folder = dst.parent if str(dst.parent) else Path(".")
            targets += [folder / f.name for f in files[1:]]
            for t in targets[1:]:
                _prepare_data_path(folder, t, None if in_memory else src, dst, force)
        if len(files) == 1:
            with atomic_fd(dst, force, _direct_wanted(files[0].size, direct_io), st) as out:
                _write_restored(pf, 0, out, mode, direct_io)
            return
        # every file is restored to a temporary file beside its path first, then all are renamed
        # together, data files first and the model last (replace_together): a failure or Ctrl-C
        # at any point leaves the model that was there with its own data files, never beside
        # new ones (files renamed one by one as each was restored did)
        staged, done = [], False
        try:
            for fi in list(range(1, len(files))) + [0]:
                with atomic_fd(targets[fi], force, _direct_wanted(files[fi].size, direct_io), staged=True) as out:
                    _write_restored(pf, fi, out, mode, direct_io)
                staged.append((out.tmp, targets[fi]))
            replace_together(staged, force)
            done = True
        finally:
            if not done:  # (those renamed and put back are gone from their temporary names)
                for tmp, _ in staged:
                    _remove_quietly(tmp)


ALIGN = 4096  # what O_DIRECT asks of a write's memory, file offset and length on the filesystems we meet
HUGE_PAGE = 2 << 20  # x86-64 transparent huge pages (a multiple of ALIGN: the window stays O_DIRECT-aligned)


class _Buffers:
    """Page-aligned window buffers kept between restores (fresh memory is page-fault bound:
    ~1 ms per 4 MiB window on these machines, a tenth of a small model's unpack), at most
    `keep` of them (8+ MiB held after an unpack); a restore takes two and gives them back."""

    def __init__(self, keep: int = 2, private_from: int = HUGE_PAGE):
        self._free: List[np.ndarray] = []
        self._keep = keep
        self._lock = threading.Lock()
        self._private_from = private_from

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.size >= n:
                    return self._free.pop(i)
        import mmap

        size = -(-n // ALIGN) * ALIGN  # anonymous maps are page-aligned
        head = 0
        if n >= self._private_from:
            # buffers that can hold a huge page (whole windows, and files of 2-4 MiB): private,
            # so that they can take huge pages (Python's default, MAP_SHARED, is shmem, which gets
            # none where shmem_enabled is "never", as on our hosts). Measured on 22.9 MB: -20% CPU
            # (min), -5% (median). Files of 2-4 MiB (one window) took shared buffers until session
            # 19: silero_vad_v6 (2.3 MB) then pinned ~570 small pages per O_DIRECT write (~90 us
            # of kernel CPU); private, its first 2 MiB are one huge page: unpack CPU per round
            # new/old 0.94 / 0.91 at 1 thread, 0.95 / 0.92 at 2 (one process alternating the two
            # pools, 60-100 rounds of 5, load 2-3), its first unpack in a fresh process ~5.0 ->
            # ~3.3 ms (12 processes each). Buffers under 2 MiB stay shared: private measured no
            # better there (silero_vad_v6.int8, rapidocr_cls.int8: +14-17% min, +1-2% median, at
            # load 12-17; mapped up to one whole huge page: 0.97-1.0, within the spread)
            # The window starts on a huge-page boundary (HUGE_PAGE more mapped, never touched):
            # from a page-aligned start only the huge pages wholly inside the map are huge, about
            # one of a 4 MiB window's two. Measured (6 windows of a 22.9 MB file written with
            # O_DIRECT, 14 rounds): the kernel's pinning of the pages 0.82 -> 0.45 ms CPU (min),
            # 1.20 -> 0.71 (median); filling the windows 2.19 -> 1.78 ms (min), 2.36 -> 2.15 (median)
            head = HUGE_PAGE
            m = mmap.mmap(-1, size + head, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            m = mmap.mmap(-1, size)
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE") and n >= 2 << 20:
            try:
                m.madvise(mmap.MADV_HUGEPAGE)  # fewer faults and TLB misses on windows of MiBs
            except OSError:
                pass
        buf = np.frombuffer(m, np.uint8)
        if head:
            start = -buf.ctypes.data % head
            buf = buf[start:start + size]  # (the view keeps the map alive)
        return buf

    def give(self, b: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(b)


_buffers = _Buffers()


class _WindowWriter:
    """Writes the windows of one restored file to `f` (the temporary file of atomic_fd) with
    O_DIRECT where the filesystem takes it: the kernel reads the window buffer itself instead of
    copying it into the page cache first (measured, 24 MB: 2 ms CPU against 7-10 ms for write()
    + fsync, and less wall time), so the final fsync has only the tail and the metadata left.

    O_DIRECT wants each write's memory, file offset and length in whole blocks: window k is
    decoded into a page-aligned buffer at offset (its file offset mod ALIGN), the file bytes
    of the last partial block before it (`carry`, < ALIGN) are copied in front of it, and the
    window's own partial last block is carried to the next. The file's last partial block is
    written through the page cache (O_DIRECT cleared). Where O_DIRECT is refused (tmpfs, some
    network filesystems) or a direct write fails, plain writes of the same bytes take over."""

    def __init__(self, f, size: int, direct_io: bool = True):
        """`f`: the output, an _fileio.atomic_fd (a descriptor opened with O_DIRECT already where
        _direct_wanted said so and the filesystem took it) or a file object (O_DIRECT set here)."""
        self.size = size
        self.slots = [None, None]  # (buffer, pad, the window's view) of the windows in flight, by window number
        self.taken: List[np.ndarray] = []
        self.written = 0  # file bytes handed to the kernel
        self.carry = b""
        self.k = 0
        self.flags = None  # the descriptor's flags without O_DIRECT while O_DIRECT is on, else None
        self.f = None
        if isinstance(f, atomic_fd):
            self.fd = f.fd
            if f.direct:
                self.flags = f.flags & ~getattr(os, "O_DIRECT", 0)
            return
        self.f, self.fd = f, f.fileno()
        if _direct_wanted(size, direct_io):
            try:
                import fcntl  # POSIX only, like O_DIRECT

                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                self.flags = flags
            except OSError:
                pass

    def target(self, start: int, n: int, k: int) -> np.ndarray:
        pad = start % ALIGN
        buf = self.slots[k % 2][0] if self.slots[k % 2] else None
        if buf is None or buf.size < pad + n:  # (a smaller one stays in `taken`, given back at the end)
            buf = _buffers.take(max(pad + n, min(self.size, WINDOW_BYTES) + ALIGN))
            self.taken.append(buf)
        view = buf[pad:pad + n]
        self.slots[k % 2] = (buf, pad, view)
        return view

    def write(self, window: np.ndarray) -> None:
        buf, pad, view = self.slots[self.k % 2]
        self.k += 1
        if self.flags is None:  # plain writes (O_DIRECT refused, or given up)
            if self.carry:
                self._pwrite(memoryview(self.carry), self.written - len(self.carry))
                self.carry = b""
            self._pwrite(memoryview(window), self.written)
            self.written += window.size
            return
        if len(self.carry) != pad or window is not view:
            raise AssertionError("window order broken")  # never: _restore yields the windows it asked targets for
        end = pad + window.size
        buf[:pad] = np.frombuffer(self.carry, np.uint8)
        whole = end - end % ALIGN
        if whole:
            try:
                self._pwrite(memoryview(buf)[:whole], self.written - pad)
            except OSError:  # e.g. EINVAL: this filesystem wants another alignment; plain writes
                self._plain()
                self._pwrite(memoryview(buf)[:whole], self.written - pad)
        self.carry = bytes(buf[whole:end])
        self.written += window.size

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while data.nbytes:
            got = os.pwrite(self.fd, data, offset)
            data, offset = data[got:], offset + got

    def _plain(self) -> None:
        if self.flags is not None:
            import fcntl

            fcntl.fcntl(self.fd, fcntl.F_SETFL, self.flags)
            self.flags = None

    def finish(self) -> None:
        self._plain()
        if self.carry:
            self._pwrite(memoryview(self.carry), self.written - len(self.carry))
            self.carry = b""
        if self.f is not None:
            os.lseek(self.fd, self.written, os.SEEK_SET)  # where the file object believes it is
        self.release()

    def release(self) -> None:
        for b in self.taken:
            _buffers.give(b)
        self.taken = []
        self.slots = [None, None]


def _direct_wanted(size: int, direct_io: bool = True) -> bool:
    """Whether a restored file of `size` bytes is written with O_DIRECT (where the filesystem
    takes it): asked for, available, not switched off (env ONNXZ_NO_DIRECT), and two blocks or more."""
    return bool(direct_io and getattr(os, "O_DIRECT", 0) and size >= 2 * ALIGN and not os.environ.get("ONNXZ_NO_DIRECT"))


def _write_restored(pf: "PackedFile", fi: int, f, mode: str, direct_io: bool = True) -> None:
    """File `fi` of `pf` restored into `f` (an _fileio.atomic_fd or an open file), window by window
    (see _WindowWriter)."""
    pf._check_open()
    writer = _WindowWriter(f, pf.index.files[fi].size, direct_io)
    windows = pf._restore(fi, writer.target, mode)
    try:
        for window in windows:
            writer.write(window)
        writer.finish()
    finally:
        windows.close()  # its workers are done with the buffers before they go back to the pool
        writer.release()


def _prepare_data_path(folder: Path, target: Path, src: Optional[Path], dst: Path, force: bool) -> None:
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
    if src is not None and same_file(src, target):
        raise FileAccessError(f"cannot write {target} (external data of the packed model): it is the input file {src}; "
                              "the input is never modified: choose another destination")
    if same_file(dst, target):
        raise FileAccessError(f"cannot write {target} (external data of the packed model): it is the model's destination; "
                              "choose another destination")
    check_writable(target, force)


def _is_packed(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError as exc:
        raise FileAccessError(f"cannot read {path}: {exc.strerror or exc}") from None


def load(path, *, threads=None, max_bytes=None, digest: str = "fast") -> onnx.ModelProto:
    """The ModelProto of an .onnxz (restored in memory, no temporary files) or of an .onnx path;
    `path` may also be the packed bytes in memory. `digest`: the whole-file check of each
    restored file, as in unpack ("fast" by default)."""
    mode = digest_mode(digest)
    if _as_buffer(path) is not None:
        p = path
    else:
        p = check_readable(path)
    if isinstance(p, Path) and not _is_packed(p):
        data = p.read_bytes()
        model = parse_model_bytes(data, str(p))
        load_external_data(model, p.parent)
        return model
    with PackedFile(p, threads=threads, max_bytes=max_bytes) as pf:
        data = pf.restore_file(0, digest=mode)
        model = parse_model_bytes(memoryview(data), pf.label)  # protobuf parses a buffer: no copy of the file
        del data
        from .._fileio import ExternalRanges, external_tensors

        # a pack of one file whose model names external data anyway (another writer's: pack keeps
        # every file a model names) is refused below, not returned with its tensors unread. A
        # tensor names a file only through an external_data entry keyed "location", which lies
        # in the skeleton (the bytes outside the payloads cut): without it there, onnx's walk over
        # every attribute (piper_joe: 6-13 ms of a ~80 ms load) is skipped (the search: ~0.1 ms)
        names_files = len(pf.index.files) > 1 or b"location" in pf.skeleton(0).tobytes()
        external = list(external_tensors(model)) if names_files else []
        if external:
            restored = {pf.index.files[fi].name: pf.restore_file(fi, digest=mode) for fi in range(1, len(pf.index.files))}
            # the .onnx path's checks (_fileio.load_external_data): a range outside its file, a
            # malformed offset or length, and many tensors naming one range (each given its own
            # copy: a 4 MB pack of 100 tensors naming one 4 MiB range took 476 MB) are refused
            ranges = ExternalRanges()
            for t in external:
                info = {e.key: e.value for e in t.external_data}
                # the index names each file by its normal name (FORMAT.md 4): "./w3.bin" is "w3.bin"
                try:
                    blob = restored.get(normal_data_name(info.get("location", "")))
                except CorruptFileError:  # ".." or absolute: no file of the pack has that name
                    blob = None
                if blob is None:
                    raise InvalidModelError(f"tensor {t.name!r} references external data {info.get('location')!r} not in the packed file")
                off, ln = ranges.check(t, info, id(blob), blob.size)
                t.raw_data = blob[off:off + ln].tobytes()
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
        return model


@dataclass
class VerifyResult:
    """What verify found; true exactly when `ok` (so `if passes.verify(...)` and `assert
    passes.verify(...)` mean what they read as: a result object would otherwise always be true)."""
    path: str
    ok: bool
    checks: List[dict] = field(default_factory=list)  # {"check", "ok", "detail"}
    original_bytes: int = 0
    packed_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.ok)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def verify(path, against=None, *, threads=None, max_bytes=None) -> VerifyResult:
    """Decode everything and check every checksum, the sha256 of each restored file and (files of
    format 1.2 or later) its XXH3-128 too (CorruptFileError on damage). With `against` (the original .onnx), also compare the restored
    bytes with it and its external data files: a difference makes the result not ok."""
    with PackedFile(path, threads=threads, max_bytes=max_bytes) as pf:
        files = pf.index.files
        result = VerifyResult(pf.label, True, [], sum(f.size for f in files), pf.size)
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
                for window in pf.restore_windows(fi, digest="both"):
                    if handle is not None and same:
                        if handle.read(window.size) != window.tobytes():
                            same = False
                if handle is not None and same and handle.read(1):
                    same = False
            finally:
                if handle is not None:
                    handle.close()
            result.checks.append({"check": f"sha256 {fe.name}", "ok": True, "detail": f"{fe.size} bytes"})
            if fe.xxh3_128 is not None:
                result.checks.append({"check": f"xxh3_128 {fe.name}", "ok": True, "detail": f"{fe.size} bytes"})
            if handle is not None:
                result.checks.append({"check": f"compare {fe.name}", "ok": same, "detail": f"identical to {originals[fi]}" if same else
                                      f"the restored {fe.name} ({fe.size} bytes) differs from {originals[fi]}"})
                result.ok = result.ok and same
        return result
