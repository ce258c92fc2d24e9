"""Interrupt a writer at a chosen point and look at what it left behind.

The writer runs in a forked child (the parent's imports are reused, so each run costs
milliseconds, not a Python start). Inside the child the system calls the atomic writer relies
on (`_fileio._open_temp`, `os.fdopen(...).write`, `os.fsync`, `os.replace`) are wrapped so that
before and after each one the child reports a numbered checkpoint on a pipe and waits for the
parent's go. The parent lets the child run to checkpoint `k`, then sends the signal instead of
the go: the kill lands exactly between two system calls, every point of the write reachable.

Writes are split into `WRITE_PIECES` pieces so that kills also land in the middle of the data.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

WRITE_PIECES = 12
CHILD_TIMEOUT_S = 20.0


@dataclass
class RunResult:
    checkpoints: list[str]   # names of the checkpoints the child reached, in order
    exit_status: int         # os.waitpid status
    killed_at: int | None    # index of the checkpoint where the signal was sent (None: ran to the end)

    @property
    def signalled(self) -> int | None:
        return os.WTERMSIG(self.exit_status) if os.WIFSIGNALED(self.exit_status) else None

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.exit_status) if os.WIFEXITED(self.exit_status) else None


class FileProxy:
    """A file object standing in for `self._f`: everything not overridden goes to the real file."""

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


class _PieceWriter(FileProxy):
    """A file object whose write() is cut into pieces with a checkpoint after each."""

    def __init__(self, f, checkpoint):
        self._f = f
        self._checkpoint = checkpoint

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        step = max(1, -(-len(data) // WRITE_PIECES))
        for start in range(0, len(data), step):
            self._f.write(data[start:start + step])
            self._f.flush()  # the piece really reaches the file before the kill
            self._checkpoint("write")
        return len(data)


def _install_checkpoints(report_fd: int, go_fd: int) -> None:
    def checkpoint(name: str) -> None:
        os.write(report_fd, (name + "\n").encode())
        if not os.read(go_fd, 1):  # parent closed the pipe: stop here
            os._exit(99)

    def wrap(module, attr, name):
        original = getattr(module, attr)

        def wrapped(*args, **kwargs):
            checkpoint("before " + name)
            result = original(*args, **kwargs)
            checkpoint("after " + name)
            return result

        setattr(module, attr, wrapped)

    from passes import _fileio

    # the temporary file's creation (_fileio._open_temp; tempfile.mkstemp where something still calls it)
    wrap(_fileio, "_open_temp", "mkstemp")
    wrap(tempfile, "mkstemp", "mkstemp")
    wrap(os, "fsync", "fsync")
    wrap(os, "replace", "replace")
    original_fdopen = os.fdopen
    os.fdopen = lambda *a, **k: _PieceWriter(original_fdopen(*a, **k), checkpoint)


def _go(go_w: int) -> None:
    try:
        os.write(go_w, b"g")
    except BrokenPipeError:  # the child is already gone
        pass


def run_writer(write, kill_at: int | None, sig: int = signal.SIGKILL) -> RunResult:
    """Fork, run `write()` in the child with checkpoints, send `sig` at checkpoint `kill_at`."""
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(report_r)
            os.close(go_w)
            # The dispositions a plain `python` process has, whatever the test runner set.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _install_checkpoints(report_w, go_r)
            result = write()
            code = result if isinstance(result, int) else 0
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - the child reports through its exit code only
            code = 1
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(go_r)
    reached: list[str] = []
    killed_at = None
    buffer = b""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        with os.fdopen(report_r, "rb", buffering=0) as reports:
            while True:
                ready, _, _ = select.select([reports], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    os.kill(pid, signal.SIGKILL)
                    raise TimeoutError("writer child stopped answering")
                chunk = reports.read(4096)
                if not chunk:
                    break  # child exited
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    reached.append(line.decode())
                    if kill_at is not None and len(reached) - 1 == kill_at and killed_at is None:
                        killed_at = kill_at
                        os.kill(pid, sig)
                        if sig in (signal.SIGINT, signal.SIGTERM):
                            # let the child run on so its handlers (cleanup) execute
                            _go(go_w)
                    else:
                        _go(go_w)
    finally:
        os.close(go_w)
        _, status = os.waitpid(pid, 0)
    return RunResult(reached, status, killed_at)
