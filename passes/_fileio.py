"""Reading and writing models and files safely.

Two promises hold for every file surgeon-compress writes: the input is never modified, and an
output appears under its final name only when it is complete (written to a temporary file in
the destination folder, flushed, fsynced, then renamed). An existing output is replaced only when
the caller says `force`.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import queue
import re
import signal
import stat
import threading
from pathlib import Path
from typing import IO, Callable, Iterator, Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from .errors import CorruptFileError, FileAccessError, InvalidModelError

PathLike = Union[str, os.PathLike]

# Protobuf cannot serialise a message of 2 GiB (2**31 - 1 bytes) or more; above this many weight
# bytes a model is written with its tensors in an external data file.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def _describe_os_error(path: PathLike, exc: OSError, action: str) -> str:
    reason = {
        errno.ENOENT: "no such file or folder",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.EROFS: "read-only file system",
        errno.ENOSPC: "no space left on device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EISDIR: "is a folder",
        errno.ENOTDIR: "a part of the path is not a folder",
    }.get(exc.errno, exc.strerror or str(exc))
    return f"cannot {action} {os.fspath(path)}: {reason}"


def named_path(path: PathLike) -> Path:
    """`path` as a Path; FileAccessError for an empty one (Path("") is the current folder, which
    the checks below would report as "'.': is a folder", not what the caller got wrong). A Path
    is returned as it is (never empty; making a copy cost ~3 us, several times per unpack)."""
    if isinstance(path, Path):
        return path
    if os.fspath(path) in ("", b""):
        raise FileAccessError("empty path: name a file")
    return Path(path)


def check_readable(path: PathLike) -> Path:
    """Path of an existing regular file, or FileAccessError saying why not.

    Devices, pipes and sockets are refused: inputs are read more than once (the first bytes
    tell a pack from a model, then the whole file is read), which a pipe cannot give, and a
    device such as /dev/zero never ends."""
    p = named_path(path)
    if not p.exists():
        raise FileAccessError(f"{p}: no such file")
    if p.is_dir():
        raise FileAccessError(f"{p}: is a folder, not a file")
    kind = _special_kind(os.stat(p).st_mode)
    if kind:
        raise FileAccessError(f"{p} is {kind}, not a regular file: inputs are read from files (save it to one first)")
    if not os.access(p, os.R_OK):
        raise FileAccessError(f"{p}: permission denied")
    return p


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether paths `a` and `b` name the same file (a hard link, a symlink or another spelling of
    an existing file too): both existing, their inodes decide; else the spellings once resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return Path(a).resolve() == Path(b).resolve()


def _special_kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def check_writable(path: PathLike, force: bool = False) -> Path:
    """Fail early, before any long work, when `path` cannot be written. One stat of the path (a
    folder, an existing file without `force`, a device, pipe or socket are refused) and one access
    check of its folder: this runs before every output, and pathlib's exists / is_dir / stat made
    it five system calls and ~20 us."""
    p = named_path(path)
    _check_destination(p, force)
    name = os.fspath(p)
    parent = os.path.dirname(name) or "."
    if not os.access(parent, os.W_OK | os.X_OK):
        if not os.path.isdir(parent):
            raise FileAccessError(f"cannot write {p}: folder {parent} does not exist")
        raise FileAccessError(f"cannot write {p}: folder {parent} is not writable")
    return p


def _check_destination(p: Path, force: bool, st=None) -> None:
    """Refuse an output path that is a folder, that exists (unless `force`), or that is not a
    regular file (or a link to one): outputs are written to a temporary file renamed over the
    path, so a device node, pipe or socket there would be replaced by a regular file (run as
    root, `/dev/null` became one). `st`: os.stat(p) made by the caller already (None: made here;
    False: the stat failed)."""
    if st is None:
        try:
            st = os.stat(p)
        except OSError:
            st = False
    if st is False:
        return  # absent, a dangling link, or a folder we cannot look into (its check says so)
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise FileAccessError(f"{p}: is a folder, not a file")
    kind = _special_kind(mode)  # before "exists": --force would not help there
    if kind:
        raise FileAccessError(f"{p} is {kind}, not a regular file: outputs replace the path whole, "
                              "so it is never written there; choose a file path")
    if not force:
        raise FileAccessError(f"{p} exists (use --force / force=True to replace it)")


def _fsync_dir(folder: PathLike) -> None:
    """Make a rename in `folder` durable (the file's own fsync does not cover its new name)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# The file an output replaces is released off the caller's path. Renaming over an existing file
# drops its last link, and the kernel frees its blocks in the rename when nothing else holds it
# open: with ext4's `discard` mount option (our hosts) it also trims them before the rename
# returns, measured 1.5 ms of a ~4.5 ms unpack of silero_vad_v6 (2.3 MB; strace -T) and ~4 ms
# on a fresh 2.3 MB file written in a loop. Holding a descriptor of the old file across the rename
# moves that work to the descriptor's close, which a background thread makes; the new file is
# renamed and the folder fsynced exactly as before (the promises are about the new file; the old
# one's space comes back a few ms later). The work stays in this process: its CPU time counts
# as before, off the caller's wall-clock path. POSIX only (Windows refuses to replace an open file).
# Files of RELEASE_MIN_BYTES or more only: the hold and the hand-over cost ~30-50 us of CPU per
# output, which the freeing of a small file does not pay back. A/B, one process alternating, each
# sample's CPU including its own deferred closes (/tmp/h6/ab_rel2.py, 60 rounds of 5 unpacks, load
# 4): silero_vad_v6 (2.3 MB) CPU x1.04, wall x0.90; silero_vad_v6.int8 (0.72 MB) CPU x1.046, wall
# x0.96; rapidocr_cls.int8 (0.29 MB) CPU x1.048, wall x0.99.
_RELEASE_REPLACED = os.name == "posix"
RELEASE_MIN_BYTES = 1 << 20
_HOLD_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class _Closer:
    """One daemon thread that closes the descriptors it is given, in order."""

    def __init__(self):
        self.fds: queue.SimpleQueue = queue.SimpleQueue()  # descriptors, or flush_released's events
        self.thread = threading.Thread(target=self._run, name="surgeon-release-replaced", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fd = self.fds.get()
            if isinstance(fd, threading.Event):  # flush_released's marker: all before it are closed
                fd.set()
                continue
            with contextlib.suppress(OSError):
                os.close(fd)


_closer = None
_closer_lock = threading.Lock()


def _forget_closer() -> None:  # a forked child has none of its parent's threads
    global _closer, _closer_lock
    _closer, _closer_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_closer)


def _hold_replaced(p: PathLike, st=None) -> int:
    """A read-only descriptor of the regular file of RELEASE_MIN_BYTES or more at `p` that a rename
    is about to replace, or -1 (none there, a link, not a regular file, smaller, not readable: then
    the rename frees it as before). `st`: an os.stat of p made already (False: it failed)."""
    if not _RELEASE_REPLACED or st is False:
        return -1
    if st is None:
        try:
            st = os.stat(p, follow_symlinks=False)
        except OSError:
            return -1
    if not stat.S_ISREG(st.st_mode) or st.st_size < RELEASE_MIN_BYTES:
        return -1
    try:  # (O_NONBLOCK: whatever took the file's place since the stat, the open does not wait)
        return os.open(p, _HOLD_FLAGS)
    except OSError:
        return -1


def _release_later(fd: int) -> None:
    """Close `fd` (from _hold_replaced) on the closer thread; at once where it cannot start."""
    global _closer
    if fd < 0:
        return
    try:
        if _closer is None:
            with _closer_lock:
                if _closer is None:
                    _closer = _Closer()
        _closer.fds.put(fd)
    except RuntimeError:  # no new threads (interpreter shutting down)
        with contextlib.suppress(OSError):
            os.close(fd)


def flush_released(timeout: float = 5.0) -> bool:
    """Wait until every replaced file handed to the closer so far is closed (its space freed);
    False if that took longer than `timeout` seconds. For tests and callers that measure disk use."""
    closer = _closer
    if closer is None:
        return True
    done = threading.Event()
    closer.fds.put(done)
    return done.wait(timeout)


@contextlib.contextmanager
def atomic_output(path: PathLike, force: bool = False) -> Iterator[IO[bytes]]:
    """Open a temporary file beside `path`; on success it is flushed, fsynced and renamed over
    `path` in one step, and the folder is fsynced (the new name is durable too).

    On any exception (or interruption) the temporary file is removed and `path` is untouched.
    Durability costs: on the ext4 of our hosts the two fsyncs and the rename over an existing
    file were ~0.5 ms of CPU per output (of a ~2 ms unpack of a 0.7 MB model), and most of its
    wall time.
    """
    p = named_path(path)
    _check_destination(p, force)  # the folder's checks: creating the temporary file makes them
    folder = os.path.dirname(os.fspath(p)) or "."
    fd, tmp, release = _make_temp_file(p, folder, force)
    try:
        release()
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if not force and os.path.exists(p):  # appeared while we worked (not asked when replacing anyway)
            raise FileAccessError(f"{p} exists (use --force / force=True to replace it)")
        old = _hold_replaced(p) if force else -1
        try:
            os.replace(tmp, p)
            _fsync_dir(folder)
        finally:
            _release_later(old)
    except OSError as exc:
        _remove_quietly(tmp)
        if isinstance(exc, FileAccessError):
            raise
        raise FileAccessError(_describe_os_error(p, exc, "write")) from None
    except BaseException:
        _remove_quietly(tmp)
        raise


# O_EXCL: never an existing file (nor a link planted under the name); O_NOFOLLOW as mkstemp has it
_TEMP_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_BINARY", 0))


def _open_temp(p: Path, folder: PathLike, flags: int = 0) -> tuple[int, str]:
    """A new hidden file `.NAME.<random>.part` in `folder`: (fd, its path). Created with mode 0o666
    for the kernel to apply the umask (and a folder's default ACL) as for any new file, which is
    what the output should get. Why not tempfile.mkstemp: it makes the file 0600, and the fchmod
    back plus reading the umask (from /proc: os.umask would race with other threads) cost
    ~20-40 us per output, ~1-2% of unpacking a small model. `flags`: more open flags (atomic_fd's
    O_DIRECT); a filesystem that refuses them with EINVAL (O_DIRECT on tmpfs) gets the file without."""
    for _ in range(100):
        # a name no other process can guess or repeat (os.urandom: fork-safe, never seeded by anyone)
        tmp = os.path.join(folder, f".{p.name}.{os.urandom(6).hex()}.part")
        try:
            return os.open(tmp, _TEMP_FLAGS | flags, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as exc:
            if not (flags and exc.errno == errno.EINVAL):
                raise
            flags = 0  # (nothing was created: a new name is drawn)
    raise FileExistsError(errno.EEXIST, "no free temporary file name", os.fspath(folder))


def _make_temp_file(p: Path, folder: PathLike, force: bool = True, flags: int = 0) -> tuple[int, str, Callable[[], None]]:
    """_open_temp with SIGINT and SIGTERM held back: returns (fd, name, release).

    The caller calls `release()` as the first statement of the `try` that removes the file on
    failure, so a Ctrl-C that came while the file was being created is raised there (signal
    handlers run when the mask is lifted) and can never leave the file behind. SIGTERM is held
    back too, for processes that handle it in Python (the command turns it into the same
    unwinding as Ctrl-C); under its default disposition it ends the process wherever it lands,
    which may leave the hidden `.NAME.*.part` file (never read; safe to delete). When the file
    cannot be made, check_writable's message says why (the folder is missing, not writable).
    """
    previous = None
    if hasattr(signal, "pthread_sigmask"):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    def release() -> None:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    try:
        fd, tmp = _open_temp(p, folder, flags) if flags else _open_temp(p, folder)
    except OSError as exc:
        release()
        check_writable(p, force)  # a missing or read-only folder: its own message
        raise FileAccessError(_describe_os_error(p, exc, "write")) from None
    except BaseException:
        release()
        raise
    return fd, tmp, release


def _remove_quietly(path: PathLike) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class atomic_fd:
    """atomic_output for a writer of a bare descriptor (unpack's window writer, which writes with
    pwrite): `with atomic_fd(path, force, direct=True) as out:` writes to `out.fd`; the same
    promises and steps (temporary file beside `path`, fsync, rename over it, folder fsync; removed
    on any failure, OSError as FileAccessError), without atomic_output's file object (its fdopen
    made three system calls, fstat, isatty's ioctl and lseek, ~6 us) or generator.
    `direct`: the file opened with O_DIRECT where the filesystem takes it (`out.direct` says
    whether it did; `out.flags` are the descriptor's status flags). `st`: os.stat(path) made by the
    caller already (False: it failed), as _check_destination takes it. `staged`: on success the
    temporary file is fsynced and closed but not renamed: `out.tmp` is the caller's, to hand to
    replace_together with the other files of one output (or to remove)."""

    def __init__(self, path: PathLike, force: bool = False, direct: bool = False, st=None, staged: bool = False):
        self.path = named_path(path)
        self.force = force
        self.staged = staged
        self.want = getattr(os, "O_DIRECT", 0) if direct else 0
        self.st = st
        self.fd = -1
        self.tmp = None
        self.direct = False
        self.flags = 0

    def __enter__(self) -> "atomic_fd":
        p = self.path
        _check_destination(p, self.force, self.st)
        folder = os.path.dirname(os.fspath(p)) or "."
        self.folder = folder
        fd, self.tmp, release = _make_temp_file(p, folder, self.force, self.want)
        try:
            release()
            self.fd = fd
            if self.want:
                import fcntl  # (O_DIRECT is POSIX only, as fcntl)

                self.flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                self.direct = bool(self.flags & self.want)
        except BaseException:
            self._abandon()
            raise
        return self

    def _abandon(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        _remove_quietly(self.tmp)

    def __exit__(self, kind, exc, tb) -> bool:
        p = self.path
        try:
            if kind is not None:
                raise exc
            fd, self.fd = self.fd, -1
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if self.staged:
                return False
            if not self.force and os.path.exists(p):  # appeared while we worked
                raise FileAccessError(f"{p} exists (use --force / force=True to replace it)")
            old = _hold_replaced(p, self.st) if self.force else -1
            try:
                os.replace(self.tmp, p)
                _fsync_dir(self.folder)
            finally:
                _release_later(old)
        except OSError as error:
            self._abandon()
            if isinstance(error, FileAccessError):
                raise
            raise FileAccessError(_describe_os_error(p, error, "write")) from None
        except BaseException:
            self._abandon()
            raise
        return False


def replace_together(moves: list, force: bool = False) -> None:
    """Rename each complete temporary file over its path, [(temporary file, path)] in order (the
    model last): the files of one output (a model and its external data files) replace the old set
    as one change as far as any failure can tell. Each existing path is first hard-linked to a
    hidden `.NAME.<random>.part` beside it (renamed there where the filesystem has no hard links);
    a failure or interruption (an exception: Ctrl-C, SIGTERM, a full disk) during the renames puts
    every old file back and removes the new ones, so the old model and its old data files are
    left as they were, never one beside the other's data. Only a kill that Python cannot see
    (SIGKILL, power loss) during the renames themselves, a few system calls after all the data is
    written and synced, can leave a mixed set, the old files then kept under those hidden names.
    Without `force` an existing path is refused before anything is renamed. The temporary files are
    the caller's to remove on failure (those not renamed); once renamed, this function owns them."""
    for tmp, target in moves:
        if not force and os.path.lexists(target):
            raise FileAccessError(f"{target} exists (use --force / force=True to replace it)")
    done = []  # (path, its old file's hidden name or None, tmp) of each rename made
    folders = []
    target = moves[-1][1] if moves else None
    try:
        for tmp, target in moves:
            target = named_path(target)
            folder = os.path.dirname(os.fspath(target)) or "."
            if folder not in folders:
                folders.append(folder)
            backup = _keep_old(target, folder)
            try:
                os.replace(tmp, target)
            except BaseException:
                if not os.path.lexists(tmp):
                    # renamed after all: an exception (Ctrl-C) raised as the call returned; the
                    # rollback below must put the old file back, not lose it
                    done.append((target, backup, tmp))
                elif backup is not None and not os.path.lexists(target):
                    os.replace(backup, target)  # (the rename-away fallback moved it)
                elif backup is not None:
                    _remove_quietly(backup)
                raise
            done.append((target, backup, tmp))
        for folder in folders:
            _fsync_dir(folder)
    except BaseException as exc:
        for target, backup, tmp in reversed(done):
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, target)
                else:
                    os.unlink(target)
        for folder in folders:
            _fsync_dir(folder)
        if isinstance(exc, OSError) and not isinstance(exc, FileAccessError):
            raise FileAccessError(_describe_os_error(target, exc, "write")) from None
        raise
    for target, backup, _ in done:  # the old files' space comes back off the caller's path
        if backup is not None:
            old = _hold_replaced(backup)
            _remove_quietly(backup)
            _release_later(old)


def _keep_old(target: Path, folder: str) -> str | None:
    """A hidden second name for the file at `target` (None: nothing there), so that it can be put
    back: a hard link (the file stays at `target` too), or where links are refused the file renamed."""
    if not os.path.lexists(target):
        return None
    for _ in range(100):
        backup = os.path.join(folder, f".{target.name}.{os.urandom(6).hex()}.part")
        try:
            os.link(target, backup, follow_symlinks=False)
            return backup
        except FileExistsError:
            continue
        except OSError:
            if os.path.lexists(backup):
                continue
            os.rename(target, backup)
            return backup
    raise FileExistsError(errno.EEXIST, "no free temporary file name", folder)


def write_bytes_atomic(path: PathLike, data: bytes, force: bool = False) -> None:
    with atomic_output(path, force) as f:
        f.write(data)


def _safe_external_path(base_dir: Path, location: str) -> Path:
    """The file an external-data `location` names, refused when it leaves the model's folder."""
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")):
        raise InvalidModelError(f"external data path {location!r} is absolute; only paths inside the model's folder are read")
    if "\0" in location:
        raise InvalidModelError(f"external data path {location!r} holds a NUL byte; refused")
    base = base_dir.resolve()
    target = (base / location).resolve()
    if target != base and base not in target.parents:
        raise InvalidModelError(f"external data path {location!r} leaves the model's folder; refused")
    return target


def external_tensors(model: onnx.ModelProto):
    """Every TensorProto of the model (initializers and attributes, subgraphs too) stored externally."""
    from onnx.external_data_helper import _get_all_tensors  # the helper onnx itself uses

    for tensor in _get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor


_REREAD_ALLOWANCE = 64 << 20  # bytes that may be read twice through overlapping external ranges


class ExternalRanges:
    """The checks of every reader of external tensor data (an .onnx's files, a pack's restored
    ones): each tensor's offset / length parsed (InvalidModelError on junk, not ValueError), its
    range inside its file, and the bytes read in all bounded by what the distinct files hold plus
    a small allowance: many tensors naming the same range would otherwise multiply memory (a 1 GB
    file read a thousand times; a 4 MB pack of 100 tensors naming one 4 MiB range)."""

    def __init__(self):
        self.file_sizes: dict = {}
        self.total = 0

    def check(self, tensor, info: dict, file_key, size: int) -> tuple:
        """(offset, length) of `tensor`'s range in the file `file_key` of `size` bytes."""
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else size - offset
        except ValueError:
            raise InvalidModelError(f"tensor {tensor.name!r} has a malformed external data offset or length") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise InvalidModelError(
                f"tensor {tensor.name!r} declares external data bytes {offset}..{offset + length} "
                f"but {info.get('location')!r} holds {size} bytes"
            )
        self.file_sizes[file_key] = size
        self.total += length
        held = sum(self.file_sizes.values())
        if self.total > held + _REREAD_ALLOWANCE:
            raise InvalidModelError(
                f"external data ranges overlap: tensors read {self.total} bytes from files holding "
                f"{held} (tensor {tensor.name!r})"
            )
        return offset, length


def load_external_data(model: onnx.ModelProto, base_dir: PathLike) -> None:
    """Read external tensor data into `model`, refusing paths outside `base_dir` and out-of-file ranges."""
    base = Path(base_dir)
    ranges = ExternalRanges()
    for tensor in external_tensors(model):
        info = {e.key: e.value for e in tensor.external_data}
        target = _safe_external_path(base, info.get("location", ""))
        try:
            st = target.stat()
        except FileNotFoundError:
            raise InvalidModelError(f"external data file {info.get('location')!r} of tensor {tensor.name!r} is missing") from None
        if not stat.S_ISREG(st.st_mode):  # a folder or a FIFO would fail or block in open()
            raise InvalidModelError(f"external data path {info.get('location')!r} of tensor {tensor.name!r} is not a regular file")
        offset, length = ranges.check(tensor, info, target, st.st_size)
        with open(target, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def parse_model_bytes(data: bytes, name: str = "<bytes>") -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidModelError(f"{name} is not an ONNX model ({exc})") from None
    if not model.HasField("graph") or model.ir_version <= 0:
        raise InvalidModelError(f"{name} is not an ONNX model (no graph or IR version)")
    return model


def load_model(source, load_external: bool = True) -> onnx.ModelProto:
    """A ModelProto from a path (external data read, safely) or a ModelProto (returned as is).

    Passes copy what they are given before changing it, so the caller's model is never modified.
    """
    if isinstance(source, onnx.ModelProto):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidModelError(f"expected an onnx.ModelProto or a path, got {type(source).__name__}")
    p = check_readable(source)
    if looks_packed(p):
        from . import load as load_packed  # packed files decode through the pack stage

        return load_packed(p)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise FileAccessError(_describe_os_error(p, exc, "read")) from None
    try:
        model = parse_model_bytes(data, str(p))
    except InvalidModelError:
        if p.suffix.lower() != ".onnxz":
            raise
        # named as a pack, read as neither: "not an ONNX model" alone sent the user looking at the wrong format
        raise CorruptFileError(f"{p}: not an .onnxz file (it does not start with the .onnxz magic) "
                               "nor an ONNX model") from None
    if load_external:
        load_external_data(model, p.parent)
    return model


def looks_packed(path: PathLike) -> bool:
    """True when the file starts with the .onnxz magic (whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(8).startswith(b"ONNXZ")
    except OSError:
        return False


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of tensor payloads held in the model (initializers, Constant nodes, subgraphs)."""
    from onnx.external_data_helper import _get_all_tensors

    total = 0
    for t in _get_all_tensors(model):
        total += len(t.raw_data) if t.HasField("raw_data") else 0
    return total


def save_model(model: onnx.ModelProto, path: PathLike, force: bool = False, external_data: bool | None = None) -> None:
    """Write `model` atomically; tensors go to `<name>.data` beside it when the model is too big
    for one protobuf (or when `external_data` is True)."""
    save_model_detached(model, {}, path, force, external_data)


def save_model_detached(model: onnx.ModelProto, detached: dict, path: PathLike, force: bool = False,
                        external_data: bool | None = None) -> None:
    """save_model of the model `model` would be with each main-graph initializer named in
    `detached` holding that array's bytes (little-endian, C order) as its raw_data; those
    initializers have no raw_data in `model`. The file is the one save_model would write for the
    whole model: a caller that made the payloads (fold) writes them without protobuf's copy of
    each (Python protobuf cannot take a buffer without copying it)."""
    p = check_writable(path, force)
    payloads = _detached_payloads(model, detached)
    if external_data is None:
        external_data = weight_bytes(model) + sum(len(v) for v in payloads.values()) > EXTERNAL_DATA_THRESHOLD
    if not external_data:
        spliced = _big_initializers(model)
        spliced.update((i, len(v)) for i, v in payloads.items())
        if spliced:
            _save_spliced(model, p, force, spliced, payloads)
            return
        try:
            data = model.SerializeToString()
        except ValueError as exc:  # protobuf size limit
            raise InvalidModelError(f"cannot serialise model: {exc}") from None
        write_bytes_atomic(p, data, force)
        return
    _save_with_external_data(model, p, force, payloads)


def _detached_payloads(model: onnx.ModelProto, detached: dict) -> dict:
    """{index in model.graph.initializer: a flat uint8 view of its payload} for `detached`."""
    if not detached:
        return {}
    out = {}
    for i, t in enumerate(model.graph.initializer):
        if t.name in detached and not t.HasField("raw_data") and t.data_location != onnx.TensorProto.EXTERNAL:
            arr = detached[t.name]
            if not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
                raise ValueError(f"detached payload {t.name!r} is not a C-ordered little-endian array")
            out[i] = arr.reshape(-1).view(np.uint8)
    return out


# Main-graph initializers with at least this many raw_data bytes are written by _save_spliced.
SPLICE_MIN_BYTES = 16 << 20
_TENSOR_RAW_DATA_KEY = 9 << 3 | 2  # TensorProto.raw_data (field 9, length-delimited)


def _big_initializers(model: onnx.ModelProto) -> dict[int, int]:
    """{index in model.graph.initializer: raw_data length} of the payloads of SPLICE_MIN_BYTES or
    more. Those the dims say are that big are read once out of their proto to learn their length
    (protobuf gives no other way); tensors of other types (int4, strings) too."""
    from .graph import NUMPY_TYPES

    big = {}
    if not model.HasField("graph"):
        return big
    for i, t in enumerate(model.graph.initializer):
        if t.HasField("raw_data"):
            dtype = NUMPY_TYPES.get(t.data_type)
            if dtype is not None and all(d >= 0 for d in t.dims):
                # what its dims say decides first, without the copy: a tensor whose raw_data
                # disagrees with them is left to the plain way (the same bytes either way)
                if int(np.prod(t.dims, dtype=np.int64)) * dtype.itemsize < SPLICE_MIN_BYTES:
                    continue
            n = len(t.raw_data)
            if n >= SPLICE_MIN_BYTES:
                big[i] = n
    return big


def _save_spliced(model: onnx.ModelProto, p: Path, force: bool, big: dict[int, int], detached: dict) -> None:
    """Write the bytes model.SerializeToString() would give without building them in one piece.

    SerializeToString of a model of N payload bytes makes N more (twice that for a moment: protobuf
    encodes, then Python gets a copy), on top of the model itself. Here the model is serialised
    without its big initializers' raw_data (graph.copy_model's copy, payloads left out), and the
    file is that serialisation with each payload put back where the encoder puts it: TensorProto
    fields come in field-number order, raw_data (9) after name (8), before double_data (10); the
    graph's and each tensor's length prefixes grow by what is put back. Payloads are read out of
    `model` one at a time (`detached`'s: from their arrays)."""
    from .graph import copy_model
    from .onnxz.protowire import _fields, write_varint

    names = {model.graph.initializer[i].name for i in big if i not in detached}
    # (a name shared with a small initializer leaves that one's payload out of the copy too:
    # such a model is written whole, the plain way)
    skeleton = copy_model(model, names)
    if any(skeleton.graph.initializer[i].HasField("raw_data") != (i not in big)
           for i in range(len(skeleton.graph.initializer))):
        if detached:  # (a name shared with a detached payload: its tensor is written whole)
            skeleton = copy_model(model)
            for i, payload in detached.items():
                skeleton.graph.initializer[i].raw_data = payload.tobytes()
            model, detached = skeleton, {}
        write_bytes_atomic(p, model.SerializeToString(), force)
        return
    buf = skeleton.SerializeToString()
    view = memoryview(buf)
    with atomic_output(p, force) as f:
        pos = 0
        for number, _, vstart, vend in _fields(buf, 0, len(buf)):
            if number != 7:  # ModelProto.graph
                f.write(view[pos:vend])
                pos = vend
                continue
            pieces, grown, index, gpos = [], 0, 0, vstart  # the graph's fields, payloads to put back
            for gnumber, _, tstart, tend in _fields(buf, vstart, vend):
                if gnumber == 5:  # GraphProto.initializer
                    if index in big:
                        n = big[index]
                        cut = tend  # where raw_data goes: before the first field numbered above 9
                        fpos = tstart
                        for tnumber, _, _, fend in _fields(buf, tstart, tend):
                            if tnumber > 9:
                                cut = fpos
                                break
                            fpos = fend
                        inner = write_varint(_TENSOR_RAW_DATA_KEY) + write_varint(n)
                        length = tend - tstart + len(inner) + n
                        head = write_varint(5 << 3 | 2) + write_varint(length)
                        pieces += [head, view[tstart:cut], inner, index, view[cut:tend]]
                        grown += len(head) + length - (tend - gpos)
                    else:
                        pieces.append(view[gpos:tend])
                    index += 1
                else:
                    pieces.append(view[gpos:tend])
                gpos = tend
            f.write(view[pos:vstart - len(write_varint(vend - vstart))])  # the graph's key
            f.write(write_varint(vend - vstart + grown))
            for piece in pieces:
                if isinstance(piece, int):
                    if piece in detached:
                        f.write(detached[piece])
                        continue
                    payload = model.graph.initializer[piece].raw_data
                    f.write(payload)
                    del payload
                else:
                    f.write(piece)
            pos = vend


def _save_with_external_data(model: onnx.ModelProto, p: Path, force: bool, detached: dict | None = None) -> None:
    """Model file plus one data file.

    The data file is named after a digest of its content (`<model name>.<digest>.data`) and is
    renamed into place before the model file: replacing a model never lets the old model file
    read new data (or the reverse), whatever moment a kill lands. The model's rename is the
    commit point; the data file of the model it replaced is removed after it.
    """
    from onnx.external_data_helper import _get_all_tensors

    from .graph import copy_model, unique_initializers

    folder = p.parent if str(p.parent) else Path(".")
    previous_data = _own_data_files(p) if p.exists() else []
    # main-graph payloads are not copied into `out` (a second copy of a multi-GB model): they are
    # written from `model`'s tensors; both walks below visit the same tensors in the same order
    out = copy_model(model, {n for n, t in unique_initializers(model).items() if t.HasField("raw_data")})
    fd, tmp, release = _make_temp_file(p, folder)
    digest = hashlib.blake2b(digest_size=8)
    placed = []
    try:
        release()
        with os.fdopen(fd, "wb") as f:
            offset = 0
            # (_get_all_tensors yields the main graph's initializers first, in order)
            for index, (src, t) in enumerate(zip(_get_all_tensors(model), _get_all_tensors(out))):
                if detached and index in detached:
                    payload = detached[index]
                elif not src.HasField("raw_data"):
                    continue
                else:
                    payload = src.raw_data
                if len(payload) < 1024:
                    if not t.HasField("raw_data"):
                        t.raw_data = bytes(payload)  # left behind by copy_model, stays inline
                    continue
                pad = (-offset) % 4096  # 4 KiB alignment lets readers memory-map tensors
                if pad:
                    f.write(b"\0" * pad)
                    digest.update(b"\0" * pad)
                    offset += pad
                f.write(payload)
                digest.update(payload)
                placed.append((t, offset, len(payload)))
                offset += len(payload)
            f.flush()
            os.fsync(f.fileno())
        data_name = f"{p.name}.{digest.hexdigest()}.data"
        os.replace(tmp, folder / data_name)  # same content under the same name: harmless
        _fsync_dir(folder)
    except OSError as exc:
        _remove_quietly(tmp)
        raise FileAccessError(_describe_os_error(p, exc, "write")) from None
    except BaseException:
        _remove_quietly(tmp)
        raise
    for t, offset, length in placed:
        del t.external_data[:]
        for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        t.data_location = onnx.TensorProto.EXTERNAL
        t.ClearField("raw_data")
    write_bytes_atomic(p, out.SerializeToString(), force)
    for old in previous_data:
        if old.name != data_name:
            _remove_quietly(old)


def _own_data_files(p: Path) -> list[Path]:
    """Data files an existing model at `p` references that this module would have written for it."""
    try:
        old = onnx.load_model(str(p), load_external_data=False)
    except Exception:  # not a model we can read: leave its neighbours alone
        return []
    names = {e.value for t in external_tensors(old) for e in t.external_data if e.key == "location"}
    ours = re.compile(re.escape(p.name) + r"(\.[0-9a-f]{16})?\.data")
    return [p.parent / n for n in sorted(names) if ours.fullmatch(n) and "/" not in n]


def model_files(path: PathLike) -> list[Path]:
    """The model file and the external data files it references (those inside its folder)."""
    p = Path(path)
    files = [p]
    try:
        locations = _external_locations(p)
    except Exception:  # not a model we can read: the file alone
        return files
    seen = set()
    for location in locations:
        if location in seen:
            continue
        seen.add(location)
        try:
            target = _safe_external_path(p.parent, location)
        except InvalidModelError:
            continue
        if target.is_file():
            files.append(target)
    return files


def _external_locations(p: Path) -> list[str]:
    """The external data locations the model file at `p` names, in file order. The file is
    memory-mapped and its wire format walked: onnx.load_model read and parsed all of it, twice a
    single-file model's size in memory (1 GB for `fold`'s 512 MB output, its command's peak)."""
    import mmap

    from .onnxz.protowire import find_tensors

    with open(p, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            refs = find_tensors(m)
            return [r.location for r in refs if r.field == "external" and r.location]


def size_on_disk(path: PathLike) -> int:
    """Bytes of a model file plus the external data files it references."""
    return sum(f.stat().st_size for f in model_files(path) if f.exists())
