"""The pipe a model is streamed to onnxruntime through (runtime.model_pipe, runtime.write_to_pipe):
every byte arrives in order, by vmsplice or writev, partial writes and refusals included."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import sys
import threading
import time

import numpy as np
import pytest

import passes.runtime as runtime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipes with vmsplice: Linux")


def mixed_pieces():
    """Bytes, arrays of several dtypes, slices that start and end inside pages, one big array."""
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, 3 * (1 << 20) + 17, dtype=np.uint8)
    halves = rng.standard_normal(5000).astype(np.float16)
    return [b"\x08\x07graph bytes", big[5:-3], halves, np.arange(7, dtype=np.int64), b"tail", big[:4095]]


def read_all(fd, out):
    with os.fdopen(fd, "rb") as f:
        out.append(f.read())


def streamed(pieces, **kwargs) -> bytes:
    """What a reader gets from the pipe when `pieces` are written with write_to_pipe."""
    read_end, write_end = runtime.model_pipe()
    got = []
    reader = threading.Thread(target=read_all, args=(read_end, got))
    reader.start()
    try:
        runtime.write_to_pipe(write_end, [runtime.pipe_view(p) for p in pieces], **kwargs)
    finally:
        os.close(write_end)
        reader.join()
    return got[0]


def joined(pieces) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in pieces)


@pytest.mark.parametrize("splice", [True, False])
def test_every_byte_arrives_in_order(splice):
    pieces = mixed_pieces()
    assert streamed(pieces, splice=splice) == joined(pieces)


def test_more_pieces_than_one_call_takes():
    """Over WRITEV_MAX_BUFFERS (IOV_MAX) pieces: several calls, nothing lost."""
    pieces = [bytes([i % 256]) * (1 + i % 37) for i in range(3 * runtime.WRITEV_MAX_BUFFERS + 5)]
    assert streamed(pieces) == joined(pieces)


def test_the_views_list_is_emptied_and_the_pieces_untouched():
    pieces = mixed_pieces()
    before = joined(pieces)
    views = [runtime.pipe_view(p) for p in pieces]
    read_end, write_end = runtime.model_pipe()
    got = []
    reader = threading.Thread(target=read_all, args=(read_end, got))
    reader.start()
    runtime.write_to_pipe(write_end, views)
    os.close(write_end)
    reader.join()
    assert views == [] and joined(pieces) == before == got[0]


def test_pipe_view_shares_memory():
    array = np.arange(10, dtype=np.float32)
    view = runtime.pipe_view(array)
    assert view.dtype == np.uint8 and view.nbytes == array.nbytes and np.shares_memory(view, array)


def fake_splice(behaviour):
    """A stand-in for libc's vmsplice: `behaviour(total bytes asked)` returns how many bytes of the
    iovecs to write (then written with os.write), or -ERRNO to fail with that errno."""
    calls = []

    def function(fd, iov, count, flags):
        vectors = ctypes.cast(iov, ctypes.POINTER(runtime._Iovec))
        asked = sum(vectors[i].length for i in range(count))
        calls.append(asked)
        n = behaviour(asked)
        if n < 0:
            ctypes.set_errno(-n)
            return -1
        data = []
        for i in range(count):  # the first n bytes of the vectors
            take = min(n - sum(map(len, data)), vectors[i].length)
            data.append(ctypes.string_at(vectors[i].base, take))
        return os.write(fd, b"".join(data))

    return function, calls


def test_short_splices_are_resumed(monkeypatch):
    """vmsplice may take part of what it is given (a full pipe, a signal): the rest follows."""
    function, calls = fake_splice(lambda asked: min(asked, 100_003))
    monkeypatch.setattr(runtime, "_VMSPLICE", function)
    pieces = mixed_pieces()[:4]
    assert streamed(pieces) == joined(pieces)
    assert len(calls) > 10


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EFAULT])
def test_a_refused_splice_falls_back_to_writev(monkeypatch, code):
    function, calls = fake_splice(lambda asked: -code)
    monkeypatch.setattr(runtime, "_VMSPLICE", function)
    pieces = mixed_pieces()
    assert streamed(pieces) == joined(pieces)
    assert len(calls) == 1  # refused once, then writev for everything


def test_an_interrupted_splice_is_retried(monkeypatch):
    answers = iter([-errno.EINTR])
    function, calls = fake_splice(lambda asked: next(answers, asked))
    monkeypatch.setattr(runtime, "_VMSPLICE", function)
    pieces = mixed_pieces()[:3]
    assert streamed(pieces) == joined(pieces)
    assert calls[0] == calls[1]  # the same bytes asked again


def test_a_closed_reader_raises_broken_pipe():
    """onnxruntime stopped reading (a model it refused): the writer gets an OSError and stops."""
    read_end, write_end = runtime.model_pipe()
    os.close(read_end)
    try:
        with pytest.raises(OSError) as raised:
            runtime.write_to_pipe(write_end, [runtime.pipe_view(b"x" * 100)])
        assert raised.value.errno == errno.EPIPE
    finally:
        os.close(write_end)


def test_model_pipe_is_large_where_allowed():
    try:
        allowed = int(open("/proc/sys/fs/pipe-max-size").read())
    except OSError:
        pytest.skip("no /proc/sys/fs/pipe-max-size")
    read_end, write_end = runtime.model_pipe()
    try:
        size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert size == runtime.PIPE_BYTES or (allowed < runtime.PIPE_BYTES and size < runtime.PIPE_BYTES)


def test_a_refusal_after_short_splices_sends_the_rest_by_writev(monkeypatch):
    """vmsplice takes a part, then refuses: writev continues from the exact byte it stopped at,
    inside a piece included."""
    answers = iter([70_001, 5, -errno.EINVAL])
    function, calls = fake_splice(lambda asked: next(answers, asked))
    monkeypatch.setattr(runtime, "_VMSPLICE", function)
    pieces = mixed_pieces()
    assert streamed(pieces) == joined(pieces)
    assert len(calls) == 3


def test_empty_pieces_are_skipped():
    pieces = [b"", b"head", np.zeros(0, np.uint8), np.arange(5, dtype=np.uint8), b""]
    assert streamed(pieces) == joined(pieces)


def test_a_full_pipe_is_refilled_after_the_reader_took_some(monkeypatch):
    """EAGAIN (a full pipe): the writer waits for the reader and goes on where it stopped."""
    answers = iter([40_000, -errno.EAGAIN, -errno.EAGAIN, 3, -errno.EAGAIN])
    function, calls = fake_splice(lambda asked: next(answers, asked))
    monkeypatch.setattr(runtime, "_VMSPLICE", function)
    pieces = mixed_pieces()
    assert streamed(pieces) == joined(pieces)
    assert len(calls) >= 6


def test_a_slow_reader_gets_every_byte_in_order():
    """The writer paces itself on what the reader takes (8 KiB reads, as onnxruntime's, with
    pauses): nothing lost, nothing repeated."""
    pieces = mixed_pieces()
    read_end, write_end = runtime.model_pipe()
    got = []

    def slow_reader():
        with os.fdopen(read_end, "rb", buffering=0) as f:
            while True:
                block = f.read(8192)
                if not block:
                    break
                got.append(block)
                if len(got) % 64 == 0:
                    time.sleep(0.003)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    try:
        runtime.write_to_pipe(write_end, [runtime.pipe_view(p) for p in pieces])
    finally:
        os.close(write_end)
        reader.join()
    assert b"".join(got) == joined(pieces)


def test_the_pacer_refills_after_an_eighth_at_the_pace_it_saw(monkeypatch):
    """A full pipe: the writer sleeps for the reader to take DRAIN_SHARE (1/8) of what is queued at
    the rate it last saw (half let the pipe run dry: onnxruntime then blocked on it), within the
    pacer's bounds; an emptied pipe is refilled at once."""
    queued = iter([1 << 20, (1 << 20) - 200_000, 1 << 20, 1 << 20, 0, 10, 10])
    sleeps = []
    monkeypatch.setattr(runtime, "_queued_bytes", lambda fd: next(queued))
    monkeypatch.setattr(runtime.time, "sleep", sleeps.append)
    clock = iter([0.0, 1e-3, 5.0, 5.0, 6.0, 6.0])  # (the first sleep "took" 1 ms, the others nothing)
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: next(clock))
    pacer = runtime._DrainPacer(-1)
    assert runtime._DrainPacer.DRAIN_SHARE == 1 / 8
    pacer.wait()
    assert sleeps == [pytest.approx((1 << 20) / 8 / runtime._DrainPacer.FIRST_RATE)]
    assert pacer.rate == pytest.approx(200_000 / 1e-3)  # (what the reader took meanwhile)
    pacer.wait()
    assert sleeps[1] == pytest.approx(max((1 << 20) / 8 / 2e8, runtime._DrainPacer.SHORTEST))
    pacer.wait()  # (emptied meanwhile: no sleep)
    assert len(sleeps) == 2
    pacer.rate = 1.0  # (a stalled reader: looked at again after LONGEST)
    pacer.wait()
    assert sleeps[2] == runtime._DrainPacer.LONGEST


def test_queued_bytes_reads_the_pipe_from_its_write_end():
    read_end, write_end = runtime.model_pipe()
    try:
        assert runtime._queued_bytes(write_end) == 0
        os.write(write_end, b"x" * 1000)
        assert runtime._queued_bytes(write_end) == 1000
    finally:
        os.close(read_end)
        os.close(write_end)


def _small_model_bytes() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _halves(data: bytes) -> list:
    """The model as [bytes, uint8 array, bytes]: the array stands for a weight still decoding."""
    third = len(data) // 3
    return [data[:third], np.frombuffer(data[third:2 * third], np.uint8).copy(), data[2 * third:]]


@pytest.mark.skipif(not runtime._streaming_supported(), reason="models streamed through a pipe")
def test_idle_runs_once_on_the_writer_while_a_piece_is_not_ready():
    """parse_pieces(idle=): called once, by the thread that feeds onnxruntime, when it first waits
    for a piece; onnxruntime has the bytes before that piece by then; the session parses."""
    import onnxruntime as ort

    pieces = _halves(_small_model_bytes())
    held = pieces[1]
    release, calls, written = threading.Event(), [], []
    original = runtime.write_to_pipe

    def counting_write(fd, views, splice=True):
        written.append(sum(v.nbytes for v in views))
        return original(fd, views, splice)

    def ready(piece, block=True):
        if piece is held and not release.is_set():
            if not block:
                return False
            release.wait(5)
        return True

    def idle():
        calls.append((threading.current_thread().name, sum(written)))
        release.set()

    runtime.write_to_pipe = counting_write
    try:
        session = runtime.parse_pieces(ort.SessionOptions(), pieces, False, ready=ready, idle=idle)
    finally:
        runtime.write_to_pipe = original
    assert calls == [("passes-model-writer", len(_halves(_small_model_bytes())[0]))]
    assert session is not None and not pieces


@pytest.mark.skipif(not runtime._streaming_supported(), reason="models streamed through a pipe")
def test_idle_runs_when_nothing_waits_and_when_onnxruntime_refuses():
    """Every piece ready: idle runs once, after the last write; a model onnxruntime refuses (cut
    short): idle still runs once before parse_pieces raises."""
    import onnxruntime as ort

    calls = []
    data = _small_model_bytes()
    runtime.parse_pieces(ort.SessionOptions(), _halves(data), False, ready=lambda p, block=True: True,
                         idle=lambda: calls.append("ready"))
    with pytest.raises(Exception):
        runtime.parse_pieces(ort.SessionOptions(), [data[: len(data) // 2]], False,
                             idle=lambda: calls.append("refused"))
    assert calls == ["ready", "refused"]
