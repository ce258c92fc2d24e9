"""`passes.InferenceSession`: an onnxruntime session straight from a compressed `.onnx` or a packed
`.onnxz`, with the precision chosen at load.

    sess = passes.InferenceSession("model.onnxz", mode="fold")          # float weights, fastest
    sess = passes.InferenceSession("model.q.onnx", mode="int8")          # weights stay int8 in memory
    sess = passes.InferenceSession("model.onnxz", mode="auto",
                                   providers=["CUDAExecutionProvider"])  # says what it picked
    sess.run(None, feeds)                                                # an onnxruntime.InferenceSession

No temporary model file is written: the model is split into a small skeleton and numpy arrays
(see `runtime_feed`), each weight is decoded or folded once into the array handed to onnxruntime
(shared as its own buffer where its kernels allow, else inside the model streamed to it through a
pipe, then dropped), and models over 2 GB load like small ones.

Modes
- "fold": every constant DequantizeLinear becomes a float tensor (dtype: the model's own, or
  `dtype`); the run time of the float model. (float16 on a CPU: an embedding table read only by a
  Gather stays 8-bit and its rows are dequantized as gathered, bit-identical; see
  runtime_fold.gather_dequantized_rows.)
- "int8" / "int4": weights stay quantized in memory, in forms onnxruntime executes without
  dequantizing the whole weight on every run (see `runtime_int8`): MatMul/Gemm weights as
  com.microsoft MatMulNBits (8 or 4 bits, block-wise), embedding tables as GatherBlockQuantized,
  other DequantizeLinear nodes kept as they are. A model whose weights are float (lossless file)
  is quantized at load (per-channel int8, or 4-bit blocks of 32 for "int4") — lossy, by request.
- "auto": "fold" on a GPU, and on a CPU when the float weights fit comfortably in the free memory,
  else "int8". The choice is in `session.mode` and `session.mode_reason`, and logged (INFO,
  logger "passes.runtime").
"""
from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import logging
import os
import sys
import termios
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import CorruptFileError, InvalidArgumentError, InvalidModelError, SurgeonError
from .runtime_feed import (EMBED_MAX_BYTES, GraphReads, NodeTable, SplitModel, graph_reads, node_table, operator_counts,
                           serialise_with_weights, shareable_names)
from .runtime_options import OptionsDraft, copy_session_options, custom_op_hint, custom_op_library_paths

log = logging.getLogger("passes.runtime")

MODES = ("fold", "int8", "int4", "auto")
DTYPES = {"float32": np.float32, "float16": np.float16}
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider")

# prepack=None (auto) turns onnxruntime's weight prepacking off when the shared weights exceed this:
# prepacking would hold a second copy of each MatMul weight (measured: 2x the weights), and the
# large layers of such models run memory-bound, where prepacking gains little. Outputs then differ
# from a prepacked session's in the last bits (not our weights: onnxruntime's MatMul without its
# packed layout sums in another order; measured on bench/load.py's generated chain, 4096-wide
# float32 MatMuls fed one row: max |difference| 5.5e-06 at 0.3 GB, 2.3e-05 at 3 GB, and 0 against a
# plain session with session.disable_prepacking=1). prepack=True keeps them bit-equal to a default
# plain session
PREPACK_AUTO_LIMIT = 1 << 30

# what the base class records as the model (it would keep real bytes alive for the session's life)
_MODEL_IN_ATTRIBUTE = b"passes.InferenceSession: model bytes held in _pending_model"

# buffers per writev / vmsplice call (Linux IOV_MAX is 1024)
WRITEV_MAX_BUFFERS = 1024

# size asked for the pipe a model is streamed through: 1 MiB, the most an unprivileged process gets
# by default (/proc/sys/fs/pipe-max-size), instead of 64 KiB. onnxruntime reads its model 8 KiB at a
# time; with 64 KiB the writer and onnxruntime put each other to sleep and woke each other ~700
# times for a 45 MB model (see write_to_pipe for the figures)
PIPE_BYTES = 1 << 20

# mode="auto" on a CPU folds when the float weights take at most this share of the free memory
AUTO_FOLD_MEMORY_SHARE = 0.5


def _normalise_mode(mode) -> str:
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise InvalidArgumentError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode.lower()


def _normalise_dtype(dtype):
    if dtype is None:
        return None
    try:
        key = np.dtype(dtype).name
    except TypeError:
        key = str(dtype)
    if key not in DTYPES:
        raise InvalidArgumentError(f"dtype {dtype!r} is not supported; expected float32 or float16")
    return np.dtype(DTYPES[key])


def _provider_names(providers) -> list:
    return [p[0] if isinstance(p, (tuple, list)) else p for p in providers or []]


def _check_providers(providers, provider_options=None) -> tuple:
    """(providers, provider_options) with the providers this onnxruntime lacks left out, each with a
    warning, as onnxruntime's own InferenceSession does (a [CUDA, CPU] list is the portable way to
    say "the GPU where there is one"); InvalidArgumentError when none of them is available."""
    if providers is None:
        return None, provider_options
    if isinstance(providers, str):
        providers = [providers]
    providers = list(providers)
    if provider_options is not None and len(provider_options) != len(providers):
        raise InvalidArgumentError(f"provider_options must be a list of one dict per provider "
                                   f"({len(providers)}), got {len(provider_options)}")
    available = ort.get_available_providers()
    missing = [name for name in _provider_names(providers) if name not in available]
    if not missing:
        return providers, provider_options
    hint = " (install surgeon-compress[gpu], i.e. onnxruntime-gpu)" if set(missing) & set(GPU_PROVIDERS) else ""
    if len(missing) == len(providers):
        raise InvalidArgumentError(f"execution provider(s) {', '.join(missing)} not available in this onnxruntime{hint}; "
                                   f"available: {', '.join(available)}")
    import warnings

    warnings.warn(f"execution provider(s) {', '.join(missing)} not available in this onnxruntime{hint}: left out "
                  f"(available: {', '.join(available)})", RuntimeWarning, stacklevel=3)
    keep = [i for i, name in enumerate(_provider_names(providers)) if name in available]
    return [providers[i] for i in keep], None if provider_options is None else [provider_options[i] for i in keep]


def _source_path(path) -> Path:
    """InferenceSession's `path` as a Path: a str or os.PathLike naming an .onnx / .onnxz file."""
    if isinstance(path, (str, os.PathLike)):
        return Path(path)
    what = type(path).__name__
    if isinstance(path, (bytes, bytearray, memoryview)):
        what += " (a serialized model?)"
    raise InvalidArgumentError(f"passes.InferenceSession takes the path of an .onnx or .onnxz file (str or os.PathLike), "
                               f"got {what}; save a ModelProto first (passes.save_model) or give its bytes to "
                               f"onnxruntime.InferenceSession")


def _start_read(path, threads, max_bytes=None, shared_chunks=True):
    """runtime_source.start_read, its big weights decoded aside (call _wait_weights before reading
    values); then _finish_read."""
    from .runtime_source import start_read

    try:
        return start_read(path, threads=threads, max_bytes=max_bytes, background=True, shared_chunks=shared_chunks)
    except SurgeonError:
        raise
    except Exception as exc:  # a damaged file that got past the structural checks
        raise CorruptFileError(f"{path}: cannot read model ({type(exc).__name__}: {exc})") from None


def _finish_read(reading, path) -> SplitModel:
    """The skeleton and weights of a `.onnx` (external data included) or `.onnxz` file."""
    try:
        return reading.finish()
    except SurgeonError:
        raise
    except Exception as exc:  # a damaged file that got past the structural checks
        raise CorruptFileError(f"{path}: cannot read model ({type(exc).__name__}: {exc})") from None


def _wait_weights(split: SplitModel, path) -> None:
    """Every weight of `split` holds its values (a packed file's background decode joined)."""
    try:
        split.wait_weights()
    except SurgeonError:
        raise
    except Exception as exc:
        raise CorruptFileError(f"{path}: cannot read model ({type(exc).__name__}: {exc})") from None


def model_float_dtype(split: SplitModel, table=None):
    """The float type the model computes in: that of its DequantizeLinear scales and float weights
    (`table`: the graph's runtime_feed.NodeTable, when the caller has one)."""
    from .precision import dominant_float_dtype

    return dominant_float_dtype(split, table)


def _free_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def choose_mode(split: SplitModel, providers, dtype) -> tuple[str, str]:
    """("fold" | "int8", why) for mode="auto"."""
    names = _provider_names(providers)
    if any(n in GPU_PROVIDERS for n in names):
        return "fold", f"{names[0]}: float weights run fastest on a GPU"
    from .runtime_int8 import float_weight_bytes

    need = float_weight_bytes(split, dtype)
    free = _free_memory_bytes()
    if free is None:
        return "fold", "free memory unknown; float weights run fastest"
    if need <= AUTO_FOLD_MEMORY_SHARE * free:
        return "fold", f"CPU: float weights {need / 2**20:.0f} MiB fit in free memory {free / 2**20:.0f} MiB"
    return "int8", f"CPU: float weights {need / 2**20:.0f} MiB exceed half the free memory {free / 2**20:.0f} MiB"


def _streaming_supported() -> bool:
    """Whether a model can be streamed to onnxruntime through a pipe: Linux (/proc/self/fd), and an
    onnxruntime whose model loading releases the GIL (verified from 1.32 on: the writer thread must
    run while onnxruntime reads)."""
    try:
        version = tuple(int(p) for p in ort.__version__.split(".")[:2])
    except ValueError:
        return False
    if not (sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd") and version >= (1, 32)):
        return False
    # a model onnxruntime refuses halfway leaves the writer writing into a closed pipe: harmless
    # while SIGPIPE is ignored (Python's default), fatal where an application restored it
    import signal

    return signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN


def model_pipe() -> tuple[int, int]:
    """(read end, write end) of a pipe for a streamed model, PIPE_BYTES large where allowed."""
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # (not Linux, or over the user's pipe quota: the default size)
        pass
    return read_end, write_end


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _libc_vmsplice():
    """libc's vmsplice (None where absent), resolved with the module: not in a session's clock."""
    try:
        function = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    function.restype = ctypes.c_ssize_t
    return function


_VMSPLICE = _libc_vmsplice()


# vmsplice errors after which the rest goes through writev (nothing was written by the failed call)
_SPLICE_REFUSALS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EFAULT, errno.EPERM, errno.ENOMEM, errno.EOPNOTSUPP})


def pipe_view(piece) -> np.ndarray:
    """A piece of a streamed model (bytes or a contiguous array) as a uint8 array over the same
    memory (no copy)."""
    return np.frombuffer(memoryview(piece).cast("B"), np.uint8)


def _address(view: np.ndarray) -> int:
    """Address of a uint8 array's first byte. ctypes' from_buffer takes ~0.4 us where numpy's
    `.ctypes.data` takes ~3.5 us (a model's hundreds of pieces); read-only memory (bytes, a
    read-only mapping) goes through numpy."""
    if not view.nbytes:
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return view.ctypes.data


def write_to_pipe(fd: int, views: list, splice: bool = True) -> None:
    """Write the uint8 arrays `views` (the list is emptied as they are written) to pipe `fd`.

    By vmsplice where libc has it (`splice`): the pipe takes references to our pages instead of a
    copy of them, and onnxruntime's read from the pipe is the only copy made. The arrays must not
    change until onnxruntime has read them: the pieces of a model are final when handed over
    (decoded weights once `ready`, restored graph bytes, serialised skeletons), and the caller
    holds them until onnxruntime's parse has returned or the pipe is closed. writev where vmsplice
    is absent or refuses the memory. Measured (minilm_fp16 float.onnx, 45 MB in 4 MB pieces,
    onnxruntime's parse from the pipe, CPU of the process, 30 interleaved rounds at load ~20):
    writev into a 64 KiB pipe min/median 46/80 ms, vmsplice into a 1 MiB pipe 40/54 ms.

    The iovec array is built once per call: vmsplice takes at most a pipe's worth (1 MiB) per
    call, and each short call moves the start of the array instead of building it again."""
    function = _VMSPLICE if splice else None
    if function is not None and views:
        _splice_all(fd, views, function)
    while views:
        batch = views[:WRITEV_MAX_BUFFERS]
        _drop_written(views, os.writev(fd, batch))


def _drop_written(views: list, written: int) -> None:
    """Drop the first `written` bytes of `views` (a signal may cut a write short)."""
    done = 0
    while done < len(views) and written >= views[done].nbytes:
        written -= views[done].nbytes
        done += 1
    del views[:done]
    if written and views:
        views[0] = views[0][written:]


# vmsplice flag: return EAGAIN instead of waiting for room in a full pipe
SPLICE_F_NONBLOCK = 2


def _splice_all(fd: int, views: list, function) -> None:
    """write_to_pipe by vmsplice; on a refusal, returns with `views` holding what is left (for writev).

    Not blocking in vmsplice: a writer blocked on a full pipe is woken by every read that frees
    room, and onnxruntime reads 8 KiB at a time, so the writer woke, spliced two pages and slept
    again ~1750 times per 24 MB model (strace: 8739 vmsplice calls in 5 loads of open_nsfw
    float.onnxz, each a return to Python and the GIL); not blocking, it raced the reader the same way,
    splicing the page or two each read had freed. Here a full pipe (a short write, or EAGAIN) makes
    the writer sleep until about an eighth of it has been read (_DrainPacer), then refill that in
    one call."""
    count = len(views)
    iov = (_Iovec * count)()
    for i, v in enumerate(views):
        iov[i].base, iov[i].length = _address(v), v.nbytes
    size = ctypes.sizeof(_Iovec)
    start = ctypes.addressof(iov)
    pacer = _DrainPacer(fd)
    first = 0  # iov[first] is the first vector not yet written in full (its base moved past what was)
    while first < count:
        end = first + min(count - first, WRITEV_MAX_BUFFERS)
        written = function(fd, start + first * size, end - first, SPLICE_F_NONBLOCK)
        if written < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code == errno.EAGAIN:
                pacer.wait()
                continue
            if code in _SPLICE_REFUSALS:
                break
            raise OSError(code, os.strerror(code))
        while written and first < count:
            if written >= iov[first].length:
                written -= iov[first].length
                first += 1
            else:
                iov[first].base += written
                iov[first].length -= written
                written = 0
        while first < count and not iov[first].length:  # (empty views: nothing to write)
            first += 1
        if first < end:  # a short write: the pipe is full (or nearly: the reader took a page meanwhile)
            pacer.wait()
    # what is left for writev: the views not written in full, the first one cut where it stopped
    if first < count:
        cut = views[first].nbytes - iov[first].length
        rest = views[first + 1:]
        views[:] = [views[first][cut:]] + rest
    else:
        views.clear()


def _queued_bytes(fd: int) -> int:
    """Bytes waiting in pipe `fd` (either end), or -1 where the pipe does not say."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except OSError:
        return -1
    return count[0]


class _DrainPacer:
    """Sleeps for the reader of a full pipe to take about DRAIN_SHARE of what it holds, at the pace
    it was last seen reading: one refill per such share instead of a wake-up per read."""

    FIRST_RATE = 1e9      # bytes/s assumed before the first measurement (onnxruntime parses ~1-2 GB/s)
    SHORTEST = 50e-6      # s: below this a sleep costs more than it saves
    LONGEST = 2e-3        # s: a reader stalled longer is looked at again after this
    # share of the queued bytes the reader is left to take before the refill. Half let the pipe run
    # dry: a sleep overshoots (wake-up latency, the GIL) and onnxruntime, reading a ready model at
    # ~4 GB/s, then blocked on the empty pipe and waited for the writer. Measured (one process,
    # parse_pieces of the whole model in 4 MiB pieces, 15 rounds alternating 1/2, 1/4, 1/8, load
    # ~2): wall median, calling thread's sleeps: minilm_fp16 24.2 / 14.4 / 14.7 ms (26 / 4 / 5),
    # open_nsfw_fp16 15.1 / 14.1 / 10.7 (12 / 6 / 4), open_nsfw 21.8 / 16.4 / 10.0 (24 / 7 / 5);
    # onnxruntime's parse of the file itself: ~9.5 ms for minilm_fp16
    DRAIN_SHARE = 1 / 8

    def __init__(self, fd: int):
        self.fd = fd
        self.rate = self.FIRST_RATE

    def wait(self) -> None:
        queued = _queued_bytes(self.fd)
        if queued == 0:  # (the reader emptied it since the call): refill at once
            return
        if queued < 0:  # (the pipe does not say): a short pause, then try again
            time.sleep(self.SHORTEST)
            return
        delay = min(max(queued * self.DRAIN_SHARE / self.rate, self.SHORTEST), self.LONGEST)
        before = time.perf_counter()
        time.sleep(delay)
        elapsed = time.perf_counter() - before
        left = _queued_bytes(self.fd)
        if 0 <= left < queued and elapsed > 0:
            self.rate = (queued - left) / elapsed


def parse_pieces(options, pieces: list, read_config: bool, ready=None, stop=None, idle=None):
    """onnxruntime's session object for the model made of `pieces` (buffers, concatenated), which
    the list gives up (it is emptied). `ready(piece, block=True) -> bool`, when given, is asked
    before each numpy piece is used (a weight still being decoded): onnxruntime parses what
    precedes it meanwhile. `stop` (a threading.Event), once set, ends the stream where it is:
    onnxruntime then fails on the truncated model (a parse no longer wanted). `idle`, when given,
    is called once by the thread that feeds onnxruntime, the first time it waits for a piece
    (else once all is written): work done while the next weight decodes (the graph walk of
    InferenceSession._parse_while_walking), not before onnxruntime starts.

    Given as bytes, a model is held three times while onnxruntime parses it (our bytes, the
    std::string pybind makes of them, the parsed protobuf). Streamed through a pipe that
    onnxruntime reads as a file (/proc/self/fd/N: no file is written anywhere), only the parsed
    protobuf is made; the pieces are views of arrays we already hold. Elsewhere: joined bytes.
    """
    from onnxruntime.capi import _pybind_state as C

    left = [idle]

    def run_idle():
        task, left[0] = left[0], None
        if task is not None:
            task()

    if not _streaming_supported():
        run_idle()
        if ready is not None:
            for p in pieces:
                if isinstance(p, np.ndarray):
                    ready(p)
        data = b"".join(pieces)
        pieces.clear()
        return C.InferenceSession(options, data, False, read_config)
    read_end, write_end = model_pipe()

    def write_all():
        go.wait()  # (not before the calling thread is in onnxruntime: see below)
        try:
            views = []
            for p in pieces:
                if stop is not None and stop.is_set():
                    return
                if ready is not None and isinstance(p, np.ndarray) and not ready(p, block=False):
                    write_to_pipe(write_end, views)  # onnxruntime parses what it has while this piece decodes
                    run_idle()
                    ready(p)
                    if stop is not None and stop.is_set():
                        return
                view = pipe_view(p)
                if view.nbytes:
                    views.append(view)
            write_to_pipe(write_end, views)
        except OSError:  # onnxruntime stopped reading (a model it refused): nothing more to do
            pass
        except Exception:  # a weight failed to decode: the truncated model is refused, the caller
            pass           # then reports the decode error
        finally:
            os.close(write_end)
            run_idle()

    # (onnxruntime's intra-op workers spin from the moment the session constructor starts its pool,
    # through this parse: on 2 cores they share the second core with our decode and fold threads.
    # Its switches do not fit: allow_spinning=0 holds for the session's life and slows runs (open_nsfw,
    # 139 -> 191 ms summed per-feed minimum), force_spinning_stop acts only after a Run().
    # Putting the workers in SCHED_IDLE for the parse was tried and measured (five quiet-host
    # bench/load.py fold runs, on / off): no ready-time difference separable from run-to-run noise.)
    # the writer waits for `go`, set just before onnxruntime is called: a thread that starts with
    # Python work holds the GIL until the switch interval (5 ms) takes it back, and the calling
    # thread, which only has to reach onnxruntime (which releases it), would wait that long
    go = threading.Event()
    writer = threading.Thread(target=write_all, name="passes-model-writer", daemon=True)
    writer.start()
    try:
        go.set()
        return C.InferenceSession(options, f"/proc/self/fd/{read_end}", True, read_config)
    finally:
        go.set()
        os.close(read_end)  # a writer still blocked gets EPIPE and ends
        # (onnxruntime reads to the end or closes its descriptor: the writer is done at once; the
        # bound only keeps a pathological reader from hanging the caller, the thread is a daemon)
        writer.join(timeout=60)
        pieces.clear()


class InferenceSession(ort.InferenceSession):
    """An onnxruntime.InferenceSession built from a compressed `.onnx` or a packed `.onnxz`.

    `path`: the file (str or os.PathLike; a ModelProto or bytes raise InvalidArgumentError: save the
    model first). `sess_options` and `providers` (and `provider_options`) are used as onnxruntime uses
    them (a listed provider this onnxruntime lacks is left out with a RuntimeWarning, as onnxruntime
    does; InvalidArgumentError when none is available); the
    caller's SessionOptions is never modified (copied where the load adds to it; a custom-op library
    registered on it cannot be read back, so the copy lacks it: name such libraries in
    `custom_op_libraries`, paths such as onnxruntime_extensions.get_library_path(), registered on the
    copy). `threads` sets intra-op threads (and the
    threads decoding a packed file). Attributes: `mode` (the mode used, "auto" resolved),
    `mode_reason`, `dtype` (numpy dtype of the float weights), `weight_arrays` (name -> array
    the session keeps: the shared weights, onnxruntime's own buffers), `shared_names`,
    `op_counts` (main-graph operators handed to onnxruntime, e.g. MatMulNBits in int8 mode),
    `prepack` (whether onnxruntime prepacks the weights: `prepack=None` turns it off when the
    shared weights exceed PREPACK_AUTO_LIMIT, which moves outputs in the last bits against a
    prepacked session: see there), `skeleton_bytes` (size of the weight-free protobuf given to onnxruntime),
    `notes` (list of lines: in int8/int4 mode, which weights were quantized how and which big
    float weights stay float, with why; in fold mode, the embedding tables kept 8-bit; also
    logged at INFO on "passes.runtime"), `fold_route`
    (mode="fold": "here" — folded by us before onnxruntime saw the model, "here+onnxruntime",
    "onnxruntime" — left to its constant folding: float16 weights on a CPU where the one-pass
    kernel of passes/_fold.c is not vectorised, float32 weights nearly all Conv weights; None otherwise),
    `verbatim` (True: a packed file onnxruntime parsed as the file it is, while its weights
    decoded and its graph was walked — a lossless pack with nothing to fold or share; see
    runtime_verbatim).
    `max_bytes` caps the restored size of a packed file (LimitExceededError above it, checked
    before anything is decoded; None: the pack reader's default), for files from untrusted sources.
    """

    def __init__(self, path, sess_options=None, providers=None, *, mode="fold", dtype=None, threads=None,
                 provider_options=None, keep_io_types=True, gpu_fold="host", prepack=None, progress=None,
                 max_bytes=None, custom_op_libraries=None):
        source = _source_path(path)
        mode = _normalise_mode(mode)
        target = _normalise_dtype(dtype)
        providers, provider_options = _check_providers(providers, provider_options)
        libraries = custom_op_library_paths(custom_op_libraries)
        if threads is not None and (not isinstance(threads, int) or threads < 0):
            raise InvalidArgumentError(f"threads must be a non-negative integer, got {threads!r}")
        if gpu_fold not in ("host", "device"):
            raise InvalidArgumentError(f"gpu_fold must be 'host' or 'device', got {gpu_fold!r}")
        self.source = source
        self.on_gpu = any(n in GPU_PROVIDERS for n in _provider_names(providers))
        if prepack not in (None, True, False):
            raise InvalidArgumentError(f"prepack must be None, True or False, got {prepack!r}")
        self._settings = dict(mode=mode, target=target, threads=threads, providers=providers,
                              provider_options=provider_options, keep_io_types=keep_io_types,
                              gpu_fold=gpu_fold, prepack=prepack, progress=progress, max_bytes=max_bytes,
                              custom_op_libraries=libraries)
        # the model bytes travel in an attribute (popped when onnxruntime has parsed them), not as
        # an argument: a frame holding them would keep them alive during optimisation
        options, disabled, self._pending_model = self._prepare(sess_options)
        if self.shared_names and sess_options is None:
            # a failure here is retried without sharing: keep onnxruntime's error log of it quiet
            # (only when the caller expressed no logging preference). 4 (fatal): onnxruntime
            # still prints errors at 3, and the retry's own options log as the caller's would
            options.log_severity_level = 4
        try:
            super().__init__(_MODEL_IN_ATTRIBUTE, options, providers=providers, provider_options=provider_options,
                             disabled_optimizers=disabled or None, enable_fallback=0)
        except SurgeonError:
            raise
        except Exception as exc:
            if not self.shared_names:
                raise InvalidModelError(f"{self.source}: onnxruntime cannot create a session: {str(exc).splitlines()[0]}"
                                        f"{custom_op_hint(str(exc), libraries)}") from None
            # most likely an optimiser wanted the bytes of a shared weight (onnxruntime cannot read
            # those): start again with every weight handed over as a copy
            log.info("passes.InferenceSession: retrying with copied weights (%s)", str(exc).splitlines()[0][:200])
            options, disabled, self._pending_model = self._prepare(sess_options, share=False)
            try:
                super().__init__(_MODEL_IN_ATTRIBUTE, options, providers=providers, provider_options=provider_options,
                                 disabled_optimizers=disabled or None, enable_fallback=0)
            except Exception as exc2:
                raise InvalidModelError(f"{self.source}: onnxruntime cannot create a session: {str(exc2).splitlines()[0]}"
                                        f"{custom_op_hint(str(exc2), libraries)}") from None

    def _prepare(self, sess_options, share=True):
        """Read, rewrite for the mode and dtype; returns (options, disabled optimisers, skeleton bytes).

        A packed file's big weights decode on a worker thread meanwhile (C, the GIL released):
        whatever reads their values first waits for them (`_wait_weights`); a lossless model
        folded as it is reads none, and waits only when onnxruntime is about to read them."""
        s = self._settings
        # shared chunks only where every decoded weight lives as long as the others (fold)
        reading = _start_read(self.source, s["threads"], s["max_bytes"], shared_chunks=s["mode"] == "fold")
        kind = options = None
        try:
            if share and self._may_speculate():
                kind = reading.verbatim_kind()
            if kind is not None:
                options = self._speculation_options(sess_options, kind)
                pieces = reading.verbatim_pieces()
        except BaseException:
            reading.abandon()
            raise
        if kind is not None:
            split, resolved, kept = self._parse_while_walking(reading, pieces, options, kind)
        else:
            split, resolved, kept = _finish_read(reading, self.source), None, None
        self._split = split
        try:
            if kept is not None:
                return self._verbatim_route(split, resolved, options, *kept)
            return self._rewrite(split, sess_options, share, resolved)
        except BaseException:
            pending, split.pending = split.pending, None
            if pending is not None:  # the decode thread must not outlive a failed load: it stops
                pending.abandon()    # after its current batch (see BackgroundDecode.abandon)
            raise

    def _session_options(self, sess_options):
        """A copy of the caller's SessionOptions with this session's own settings."""
        s = self._settings
        options = copy_session_options(sess_options, s["custom_op_libraries"])
        if s["threads"]:
            options.intra_op_num_threads = s["threads"]
        return options

    def _may_speculate(self) -> bool:
        """Whether onnxruntime may start parsing a packed file as it is (see runtime_verbatim): not
        where the settings rule that out (a mode that rewrites every model, a dtype conversion, a
        GPU, no streaming to onnxruntime)."""
        s = self._settings
        return s["mode"] in ("fold", "auto") and s["target"] is None and not self.on_gpu and _streaming_supported()

    def _speculation_options(self, sess_options, kind):
        """The SessionOptions onnxruntime parses a packed file as it is with (`kind`:
        runtime_verbatim.verbatim_kind): those the usual route would make for it."""
        s = self._settings
        if kind == "float" and (sess_options is None or isinstance(sess_options, ort.SessionOptions)) \
                and not s["threads"] and s["prepack"] is not False and not s["custom_op_libraries"]:
            # nothing of ours to add: onnxruntime gets the caller's options as they are, as it would
            # from its own class (it copies them; copying them here costs ~5 ms: copy_session_options)
            return sess_options if sess_options is not None else ort.SessionOptions()
        options = self._session_options(sess_options)
        if s["prepack"] is False:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if kind == "quantized":  # (fold_route "onnxruntime", see _rewrite)
            options.add_session_config_entry("session.disable_quant_qdq", "1")
        return options

    def _parse_while_walking(self, reading, pieces, options, kind):
        """onnxruntime parses the packed file as it is (`pieces`, fed as they decode) on this
        thread, while a helper thread finishes the read and decides whether that parse is the one
        to keep (runtime_verbatim); when not, the stream is cut and onnxruntime stops. Returns
        (split, resolved mode, (ParsedModel, GraphReads, kind) when the parse is kept, else None)."""
        from .runtime_verbatim import ParsedModel

        stop = threading.Event()
        found = {}
        claim, walked = threading.Lock(), threading.Event()

        def walk():
            if not claim.acquire(blocking=False):  # (run once: by the writer, else below)
                return
            try:
                found["split"] = split = _finish_read(reading, self.source)
                found["resolved"], found["reads"] = self._verbatim_decision(split, kind)
                if found["reads"] is not None:  # (here, not on the calling thread after its parse: ~0.5 ms)
                    found["skeleton_bytes"] = split.skeleton.ByteSize()
            except BaseException as exc:  # raised on the calling thread
                found["error"] = exc
            if found.get("reads") is None:
                stop.set()
            walked.set()

        # the walk runs on the thread that feeds onnxruntime, while the first weight it waits for
        # decodes (parse_pieces' idle): onnxruntime starts parsing at once, instead of after a
        # walker thread's start and its hold of the GIL (minilm_fp16 float pack: the parse began
        # ~14 ms into the load, 3 ms after the file was restored)
        read_config = os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"  # (as onnxruntime's own class reads it)
        try:
            parsed = ParsedModel(session=parse_pieces(options, pieces, read_config, ready=reading.ready, stop=stop,
                                                      idle=walk))
        except Exception as exc:  # (a weight that failed to decode, or a model onnxruntime refuses)
            parsed = ParsedModel(error=exc)
        except BaseException as exc:  # (Ctrl-C): nothing may outlive the load
            found.setdefault("error", exc)
        stop.set()
        walk()  # (when the writer never ran it)
        walked.wait()
        if "error" in found:
            split = found.get("split")
            if split is not None and split.pending is not None:
                split.pending.abandon()
            raise found["error"]
        reads = found["reads"]
        self.skeleton_bytes = found.get("skeleton_bytes")
        return found["split"], found["resolved"], (parsed, reads, kind) if reads is not None else None

    def _resolve_mode(self, split, table=None):
        """(mode, the model's float dtype): mode="auto" resolved (and logged). `table`: the graph's
        NodeTable."""
        s = self._settings
        mode = s["mode"]
        own_dtype = model_float_dtype(split, table)
        self.mode_reason = f"requested mode={mode}"
        if mode == "auto":
            mode, self.mode_reason = choose_mode(split, s["providers"], s["target"])
            log.info("passes.InferenceSession(%s): mode=auto picked %s (%s)", self.source.name, mode, self.mode_reason)
        self.mode = mode
        return mode, own_dtype

    def _verbatim_decision(self, split, kind):
        """((mode, float dtype), the graph's GraphReads when onnxruntime gets the model as the file
        it is, else None): mode fold in the model's own dtype, (nearly) nothing to share, and
        nothing to fold (`kind` "float") or every fold left to onnxruntime as the usual route
        would leave it ("quantized": fold_route "onnxruntime" without a rewrite). See runtime_verbatim."""
        from .runtime_fold import fold_facts, little_to_share, reads_gathered_dequantize
        from .runtime_verbatim import verbatim_fits

        # every step below reads the graph from one table; _rewrite takes it over when this route is
        # not kept (the graph is unchanged until then)
        table = self._walk_table = NodeTable(split.skeleton.graph)
        resolved = self._resolve_mode(split, table)
        mode, own_dtype = resolved
        target = self._settings["target"]
        if mode != "fold" or (target is not None and target != own_dtype):
            return resolved, None
        if any(n.op_type == "DequantizeLinear" for f in split.skeleton.functions for n in f.node):
            return resolved, None  # (function bodies to fold first: see _rewrite)
        float16 = own_dtype == np.float16  # (on a CPU: never shared, see _rewrite)
        foldable, onnxruntime_folds_all = fold_facts(split, table)
        if kind == "float" and foldable:
            return resolved, None
        if kind == "quantized" and not (foldable and onnxruntime_folds_all and (
                not reads_gathered_dequantize(table) if float16 else little_to_share(split, table))):
            return resolved, None
        if float16:  # nothing to share: only the operator counts are kept (a walk that reads no inputs)
            return resolved, GraphReads(set(), {}, set(), operator_counts(split.skeleton.graph, table))
        reads = graph_reads(split.skeleton.graph, split.weights, collect_used=False, table=table)
        return resolved, reads if verbatim_fits(split, reads, share=True) else None

    def _verbatim_route(self, split, resolved, options, parsed, reads, kind):
        """(options, disabled optimisers, the ParsedModel) for a model onnxruntime has parsed as
        the file it is (see _verbatim_decision)."""
        self.verbatim = True
        self.__dict__.pop("_walk_table", None)  # (the walk's NodeTable: not needed past the load)
        self.fold_route = "onnxruntime" if kind == "quantized" else None
        self.notes = []
        self.dtype = np.dtype(resolved[1])
        self.op_counts = reads.op_counts
        if self.__dict__.get("skeleton_bytes") is None:  # (measured by the walk, see _parse_while_walking)
            self.skeleton_bytes = split.skeleton.ByteSize()
        self.embedded_names = set(split.weights)  # every big weight travelled inside the model
        self.weight_arrays, self.shared_names, self._device_values = {}, set(), {}
        self.prepack = self._settings["prepack"] is not False
        split.weights.clear()  # (onnxruntime has read the decoded payloads: nothing else uses them)
        return options, set(), parsed

    def _rewrite(self, split, sess_options, share, resolved=None):
        s = self._settings
        target = s["target"]
        # the graph's nodes read once (see NodeTable), kept current by the fold steps below
        table = node_table(split.skeleton.graph, self.__dict__.pop("_walk_table", None))
        mode, own_dtype = resolved if resolved is not None else self._resolve_mode(split, table)
        self.verbatim = False
        # how mode="fold" folded the DequantizeLinear nodes: "here" (this thread, before
        # onnxruntime; "here+onnxruntime" when the weights onnxruntime cannot share were left to
        # its constant folding), "onnxruntime" (its constant folding: float16 weights on a CPU
        # without the vectorised one-pass kernel, float32 Conv weights),
        # or None (nothing to fold, another mode)
        self.fold_route = None
        # what the load said beyond the mode (int8/int4: weights quantized by the offline pass,
        # float weights left float and why); also logged (INFO, logger "passes.runtime")
        self.notes = []
        # (copied from the caller's only where this load adds to them: see OptionsDraft.build below)
        options = OptionsDraft(sess_options, s["threads"], s["custom_op_libraries"])
        disabled = set()
        device_values = {}
        if mode == "fold":
            if split.skeleton.functions:
                # constant DequantizeLinear nodes inside model-local function bodies (quantize_weights
                # writes them there): folded as fold_dequantize folds them, so that the session runs
                # what fold_dequantize writes (left to onnxruntime, its inlined copies are not folded
                # alike on every route: bench/unseen_edges fn_in_subgraphs, 0.019 max abs apart).
                # The bodies hold their Constant values: nothing to wait for
                from .fold import fold_function_bodies

                fold_function_bodies(split.skeleton)
            from .runtime_int8 import unlist_dequantize_inputs

            # (a quantized IR >= 4 export listing its initializers as inputs: folded, they would be required)
            unlisted = unlist_dequantize_inputs(split.skeleton)
            if unlisted:
                self.notes.append(f"{len(unlisted)} quantized weight tensor(s) (DequantizeLinear levels / scales / zero "
                                  f"points) were also listed as graph inputs: unlisted (constants of this session)")
            if self.on_gpu and s["gpu_fold"] == "device" and (target is None or target == own_dtype):
                from .runtime_gpu import fold_on_device

                _wait_weights(split, self.source)
                device_values = fold_on_device(split, s["providers"], s["provider_options"])
                table = None  # (the folded nodes are gone)
            from .runtime_fold import (constants_to_initializers, dequantize_reads_constant, fold_facts, fold_into,
                                       fold_kernel_fast, gather_dequantized_rows, little_to_share, plan_fold)

            converting = target is not None and target != own_dtype  # the converter must see float weights
            # float16 weights on a CPU are never shared (see below): onnxruntime folds them all
            share_planned = not (own_dtype == np.float16 and not self.on_gpu)
            foldable, onnxruntime_folds_all = fold_facts(split, table)
            # float16 weights on a CPU, where the one-pass kernel runs vectorised: folded here (see
            # runtime_dequantize), the embedding tables kept 8-bit as below; onnxruntime gets float16
            # weights and no DequantizeLinear to fold
            fold16_here = foldable and not (share_planned or converting or self.on_gpu) and fold_kernel_fast()
            if not foldable:  # (a lossless float model has nothing to fold: skip the walks)
                pass
            elif not (converting or self.on_gpu or fold16_here) and onnxruntime_folds_all and (
                    not share_planned or little_to_share(split, table)):
                # ... the small ones too (float16 on a CPU without the vectorised kernel; float32
                # whose foldable weights are nearly
                # all Conv weights, which onnxruntime folds anyway: open_nsfw q8.onnxz, 9 fresh
                # processes interleaved at load 7-9, CPU to a ready session median 386 -> 348 ms,
                # plain float .onnx 303; onnxruntime alone on the q8 .onnx 288): the
                # model goes to onnxruntime as it is, its weights streamed
                # as they decode (session.disable_quant_qdq=1 makes its constant folding fold every
                # constant DequantizeLinear, with the arithmetic fold_dequantize copies bit for bit).
                # Folding them on a worker thread instead (float16 streamed as each is folded)
                # was measured slower with numpy, quiet machine or loaded: see runtime_fold.fold_facts
                options.add_session_config_entry("session.disable_quant_qdq", "1")
                self.fold_route = "onnxruntime"
                if not share_planned:
                    table = self._keep_tables_8bit(split, gather_dequantized_rows, table)
            else:
                # folded as the weights decode (FoldAhead) where nothing but DequantizeLinear nodes of
                # the main graph is folded: nothing else here reads a weight's values
                ahead = fold16_here and onnxruntime_folds_all and split.pending is not None
                if not ahead:
                    _wait_weights(split, self.source)
                # Constant nodes become initializers so that the fold can read them; where the only
                # foldable nodes are main-graph DequantizeLinear nodes and none reads a Constant,
                # they stay nodes (onnxruntime makes them initializers as it loads the graph, as it
                # does for the plain file): open_nsfw_fp16's 41 cost ~1 ms before onnxruntime starts
                if not (fold16_here and onnxruntime_folds_all) or dequantize_reads_constant(table):
                    constants_to_initializers(split, table)
                if fold16_here:
                    if onnxruntime_folds_all:  # (the plain graphs the rewrite below was made for)
                        table = self._keep_tables_8bit(split, gather_dequantized_rows, table)
                    deferred = set()
                else:
                    deferred = plan_fold(split, options, share=share_planned, table=table) \
                        if not (self.on_gpu or converting) else set()
                # (constants moved above; the placeholders are refreshed below, after graph_reads)
                fold_into(split, progress=s["progress"], only=lambda n: n.output[0] not in deferred, subgraphs=True,
                          ahead=ahead, constants=False, refresh=converting, dequantize_only=onnxruntime_folds_all,
                          table=table)
                self.fold_route = "here" if not deferred else "here+onnxruntime"
        else:
            from .runtime_int8 import prepare_quantized

            _wait_weights(split, self.source)
            table = None  # (the quantized rewrite adds and replaces nodes)
            disabled |= prepare_quantized(split, bits=4 if mode == "int4" else 8, options=options, notes=self.notes,
                                          target=target if target is not None and target != own_dtype else None)
            for line in self.notes:
                log.info("passes.InferenceSession(%s): mode=%s: %s", self.source.name, mode, line)
        self.dtype = np.dtype(target or own_dtype)
        if target is not None and target != own_dtype:
            from .precision import convert_split

            _wait_weights(split, self.source)
            table = None  # (the conversion adds Cast nodes)
            convert_split(split, target, keep_io_types=s["keep_io_types"], notes=self.notes)
        reads = graph_reads(split.skeleton.graph, split.weights, table=table)
        split.refresh_placeholders(reads.used)
        self.weight_arrays = split.weights
        extra = None
        if mode != "fold":
            from .runtime_feed import SHAREABLE_DEQUANTIZE as extra
        # float16 weights on a CPU: onnxruntime casts them to float32 at optimisation time, which
        # needs their bytes: sharing would only fail and be retried
        if self.dtype == np.float16 and not self.on_gpu and mode == "fold":
            share = False
        self.shared_names = shareable_names(split, extra, reads) if share and not self.on_gpu else set()
        self.shared_names |= set(device_values)
        self._device_values = device_values
        shared_bytes = sum(self.weight_arrays[n].nbytes for n in self.shared_names if n in self.weight_arrays)
        self.prepack = s["prepack"] if s["prepack"] is not None else shared_bytes < PREPACK_AUTO_LIMIT
        if not self.prepack:
            # prepacking copies every MatMul weight into onnxruntime's own layout; a shared weight
            # cannot be freed after that, so a big model would be held twice
            options.add_session_config_entry("session.disable_prepacking", "1")
        self.op_counts = reads.op_counts
        copied = [n for n in sorted(self.weight_arrays) if n not in self.shared_names and n not in device_values]
        copied_bytes = sum(self.weight_arrays[n].nbytes for n in copied)
        self.skeleton_bytes = split.skeleton.ByteSize()
        self.embedded_names = set()
        if copied and not self.on_gpu and self.skeleton_bytes + copied_bytes + 64 * len(copied) <= EMBED_MAX_BYTES:
            # the weights onnxruntime copies travel inside the model bytes: its parsed copy is the
            # only one during optimisation (see serialise_with_weights). Measured and not kept: the
            # folded float16 weights handed over instead as OrtValues, which onnxruntime reads only
            # in initialize_session, so that it parses a small skeleton while they fold (quiet host,
            # bench/load.py --ab-env, 11 rounds: open_nsfw_fp16 / minilm_fp16 packs ready 1.24-1.38x
            # of the plain file against 1.19-1.35x embedded, both signs; added memory +12-37%, our
            # arrays beside onnxruntime's copies)
            if split.pending is not None:  # in the order they finish decoding (see parse_pieces)
                copied.sort(key=lambda n: split.pending.order(self.weight_arrays[n]))
            model_bytes = serialise_with_weights(split.skeleton, self.weight_arrays, copied)
            self.skeleton_bytes = len(model_bytes[0])  # (the skeleton's own bytes come first)
            self.embedded_names = set(copied)
            for name in copied:  # (the pieces hold views of them until onnxruntime has parsed them)
                del self.weight_arrays[name]
        else:
            model_bytes = split.skeleton.SerializeToString()
        # a private copy where initializers will be attached to the options (shared or device
        # weights, weights handed over as OrtValues: _create_inference_session)
        attached = self.shared_names or device_values or any(n not in self.shared_names for n in self.weight_arrays)
        return options.build(private=bool(attached)), disabled, model_bytes

    def _keep_tables_8bit(self, split, gather_dequantized_rows, table):
        """float16 on a CPU: embedding tables are not folded whole: their rows are dequantized as
        gathered (minilm_fp16 q8.onnxz, 3 interleaved A/Bs at load 6-8: CPU to a ready session 2-15%
        lower at the min, -5%..+9% at the median; peak RSS 182 -> 171 MB). Returns the graph's
        NodeTable: `table` when nothing was rewritten, else a new one (the rewrite replaces nodes)."""
        rewritten = gather_dequantized_rows(split, table)
        for name in rewritten:
            self.notes.append(f"{name}: 8-bit embedding table kept, rows dequantized as gathered "
                              f"(bit-identical to the folded table)")
            log.info("passes.InferenceSession(%s): mode=fold: %s", self.source.name, self.notes[-1])
        return NodeTable(split.skeleton.graph) if rewritten else table

    # onnxruntime's loader, with the weights attached to our private options: shared ones kept
    # alive with the session, copied ones dropped as soon as onnxruntime holds its copy
    def _create_inference_session(self, providers, provider_options, disabled_optimizers=None):
        from onnxruntime.capi import _pybind_state as C
        from onnxruntime.capi.onnxruntime_inference_collection import check_and_normalize_provider_args

        from .runtime_verbatim import ParsedModel

        split, self._split = self.__dict__.get("_split"), None
        options = self._sess_options
        copied = {n: a for n, a in self.weight_arrays.items() if n not in self.shared_names and n not in self._device_values}
        model = self.__dict__.pop("_pending_model", None)
        # a packed file's weights may still be decoding: the model's embedded weights are streamed
        # to onnxruntime as each is decoded (parse_pieces waits for each), the shared ones are read
        # by onnxruntime only in initialize_session (after the full wait below); weights handed
        # over with add_external_initializers are waited for first
        pending = split.pending if split is not None else None
        ready = pending.ready if pending is not None and isinstance(model, list) and not copied else None
        speculated = isinstance(model, ParsedModel)  # (parsed as the file it is, see _parse_while_walking)
        if ready is None and split is not None and not speculated:
            _wait_weights(split, self.source)
        keep_values = []
        for name in sorted(self.shared_names):
            if name in self._device_values:
                value = self._device_values[name]
            else:
                value = ort.OrtValue.ortvalue_from_numpy(self.weight_arrays[name])
            options.add_initializer(name, value)
            keep_values.append(value)
        if copied:
            names = list(copied)
            options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(copied[n]) for n in names])
        providers, provider_options = check_and_normalize_provider_args(
            providers, provider_options, C.get_available_providers()
        )
        try:
            if speculated:
                sess = model.take()
            elif isinstance(model, list):
                sess = parse_pieces(options, model, self._read_config_from_model, ready=ready)
            else:
                sess = C.InferenceSession(options, model if model is not None else self._model_bytes, False,
                                          self._read_config_from_model)
        except Exception:
            if split is not None:  # a weight that failed to decode is why the stream was refused
                _wait_weights(split, self.source)
            raise
        del model  # onnxruntime holds the parsed model: the bytes must not outlive this point
        if split is not None:  # every weight decoded before onnxruntime initialises
            _wait_weights(split, self.source)
        self._kept_values = keep_values  # shared OrtValues must outlive the session
        sess.initialize_session(providers, provider_options, set(disabled_optimizers or ()))
        # onnxruntime holds its own copies of the external initializers once initialised (it still
        # reads our buffers during initialisation): drop ours
        for name in copied:
            self.weight_arrays.pop(name, None)
        del copied
        self._bind_session(sess)
        # the options we made hold OrtValues of released arrays: they are never used again
        self._sess_options_initial = None

