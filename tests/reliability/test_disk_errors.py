"""Disk full and read-only destinations give a clear FileAccessError, leave nothing under the
final name, no temporary file, and an existing output (replaced with force) intact.

Real file systems when the tests may mount them (root: a 64 KiB tmpfs, and a read-only one);
the same failures simulated by making the system calls fail everywhere else.
"""
from __future__ import annotations

import errno
import os
import subprocess
import uuid

import pytest

import passes._fileio as fileio
from passes import FileAccessError
from passes._fileio import save_model, write_bytes_atomic

from ._killharness import FileProxy
from ._models import matmul_model

BIG = os.urandom(256 * 1024)  # four times the tiny file system


def _mount_tmpfs(path, options):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, f"surgeon-test-{uuid.uuid4().hex[:8]}", str(path)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return path


@pytest.fixture
def tiny_fs(tmp_path):
    path = _mount_tmpfs(tmp_path / "tiny", "size=64k")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def readonly_fs(tmp_path):
    path = _mount_tmpfs(tmp_path / "ro", "size=64k")
    (path / "existing.onnx").write_bytes(b"old")
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_real_tmpfs(tiny_fs):
    final = tiny_fs / "out.bin"
    with pytest.raises(FileAccessError, match="no space left on device") as info:
        write_bytes_atomic(final, BIG)
    assert str(final) in str(info.value)
    assert list(tiny_fs.iterdir()) == []


def test_disk_full_real_tmpfs_keeps_previous_output(tiny_fs):
    final = tiny_fs / "out.onnx"
    final.write_bytes(b"previous")
    model = matmul_model(256)  # 256 KiB of weights
    with pytest.raises(FileAccessError, match="no space left on device"):
        save_model(model, final, force=True)
    assert final.read_bytes() == b"previous"
    assert [p.name for p in tiny_fs.iterdir()] == ["out.onnx"]


def test_disk_full_external_data_real_tmpfs(tiny_fs):
    with pytest.raises(FileAccessError, match="no space left on device"):
        save_model(matmul_model(256), tiny_fs / "m.onnx", external_data=True)
    assert list(tiny_fs.iterdir()) == []


def test_readonly_destination_real_mount(readonly_fs):
    for name, force in (("new.onnx", False), ("existing.onnx", True)):
        with pytest.raises(FileAccessError, match="not writable|read-only"):
            save_model(matmul_model(8), readonly_fs / name, force=force)
    assert sorted(p.name for p in readonly_fs.iterdir()) == ["existing.onnx"]
    assert (readonly_fs / "existing.onnx").read_bytes() == b"old"


class _FailingFile(FileProxy):
    """A file whose write/flush fails with `err` after `budget` bytes, like a full disk."""

    def __init__(self, f, err, budget):
        self._f, self._err, self._budget = f, err, budget

    def write(self, data):
        if len(data) > self._budget:
            raise OSError(self._err, os.strerror(self._err))
        self._budget -= len(data)
        return self._f.write(data)


@pytest.mark.parametrize("err, words", [
    (errno.ENOSPC, "no space left on device"),
    (errno.EDQUOT, "disk quota exceeded"),
    (errno.EIO, "error"),
])
@pytest.mark.parametrize("stage", ["write", "fsync", "replace"])
def test_simulated_write_failures(tmp_path, monkeypatch, err, words, stage):
    final = tmp_path / "out.bin"
    final.write_bytes(b"previous")
    real_fdopen = os.fdopen

    def fail(*a, **k):
        raise OSError(err, os.strerror(err))

    if stage == "write":
        monkeypatch.setattr(fileio.os, "fdopen", lambda *a, **k: _FailingFile(real_fdopen(*a, **k), err, 1000))
    elif stage == "fsync":
        monkeypatch.setattr(fileio.os, "fsync", fail)
    else:
        monkeypatch.setattr(fileio.os, "replace", fail)
    with pytest.raises(FileAccessError) as info:
        write_bytes_atomic(final, BIG, force=True)
    assert words in str(info.value).lower()
    assert isinstance(info.value, OSError)
    monkeypatch.undo()
    assert final.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_simulated_readonly_folder(tmp_path, monkeypatch):
    """Non-root runs: os.access says the folder is not writable (root would bypass a chmod)."""
    real_access = os.access
    monkeypatch.setattr(fileio.os, "access", lambda p, mode: False if mode & os.W_OK else real_access(p, mode))
    with pytest.raises(FileAccessError, match="not writable"):
        save_model(matmul_model(8), tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []


def test_simulated_erofs_at_mkstemp(tmp_path, monkeypatch):
    def erofs(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(fileio, "_open_temp", erofs)
    with pytest.raises(FileAccessError, match="read-only file system"):
        write_bytes_atomic(tmp_path / "out.bin", b"x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["pack", "unpack", "compress"])
def test_command_on_a_full_disk(tiny_fs, samples, tmp_path, command, capsys):
    """The command on a full disk: exit 1, one line naming the problem, nothing left behind."""
    from tools.surgeon_compress import main

    src = tmp_path / "model.onnx"
    src.write_bytes(matmul_model(256).SerializeToString())  # 256 KiB of weights
    packed = tmp_path / "model.onnxz"
    from passes import pack

    pack(src, packed)
    argv = {"pack": ["pack", str(src), "-o", str(tiny_fs / "out.onnxz")],
            "unpack": ["unpack", str(packed), "-o", str(tiny_fs / "out.onnx")],
            "compress": ["compress", str(src), "-o", str(tiny_fs / "out.onnx"), "--bits", "8"]}[command]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, (code, err)
    assert "no space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert list(tiny_fs.iterdir()) == []
