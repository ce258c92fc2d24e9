"""_fileio.atomic_fd: atomic_output's promises for a writer of a bare descriptor (unpack's window
writer): the output appears whole under its name or not at all, the temporary file never stays
behind, an existing file is replaced only with force, OSError comes out as FileAccessError, and
O_DIRECT is asked for at the create where wanted and left out where the filesystem refuses it."""
from __future__ import annotations

import errno
import os

import pytest

from passes import FileAccessError
from passes import _fileio
from passes._fileio import atomic_fd


def _write(out, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.pwrite(out.fd, view, len(data) - view.nbytes):]


def test_the_output_appears_whole_and_alone(tmp_path):
    final = tmp_path / "out.bin"
    with atomic_fd(final) as out:
        _write(out, b"abc" * 1000)
        assert not final.exists()
        assert [p.name for p in tmp_path.iterdir()][0].endswith(".part")
    assert final.read_bytes() == b"abc" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_an_existing_file_is_replaced_only_with_force(tmp_path):
    final = tmp_path / "out.bin"
    final.write_bytes(b"previous")
    with pytest.raises(FileAccessError, match="exists"):
        with atomic_fd(final) as out:
            _write(out, b"new")
    assert final.read_bytes() == b"previous"
    with atomic_fd(final, force=True) as out:
        _write(out, b"new")
    assert final.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_failure_inside_leaves_nothing_and_is_named(tmp_path):
    final = tmp_path / "out.bin"
    final.write_bytes(b"previous")
    with pytest.raises(FileAccessError, match="no space left on device"):
        with atomic_fd(final, force=True) as out:
            _write(out, b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(KeyError):
        with atomic_fd(final, force=True) as out:
            raise KeyError("not an OS error: passed on as it is")
    assert final.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_failed_fsync_or_rename_leaves_the_destination(tmp_path, monkeypatch):
    final = tmp_path / "out.bin"
    final.write_bytes(b"previous")

    def fail(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    for stage in ("fsync", "replace"):
        monkeypatch.setattr(_fileio.os, stage, fail)
        with pytest.raises(FileAccessError, match="cannot write"):
            with atomic_fd(final, force=True) as out:
                _write(out, b"new")
        monkeypatch.undo()
        assert final.read_bytes() == b"previous"
        assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_folder_or_a_missing_folder_is_refused_before_anything(tmp_path):
    with pytest.raises(FileAccessError, match="is a folder"):
        with atomic_fd(tmp_path, force=True):
            pass
    with pytest.raises(FileAccessError, match="does not exist"):
        with atomic_fd(tmp_path / "no" / "out.bin"):
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_is_asked_at_the_create_and_dropped_where_refused(tmp_path, monkeypatch):
    import fcntl

    final = tmp_path / "out.bin"
    with atomic_fd(final, direct=True) as out:
        flags = fcntl.fcntl(out.fd, fcntl.F_GETFL)
        assert out.direct == bool(flags & os.O_DIRECT) and out.flags == flags
        os.pwrite(out.fd, b"x" * 8192 if not out.direct else _aligned(8192), 0)
    assert final.stat().st_size == 8192
    real_open = os.open

    def no_direct(path, flags, *a):  # what tmpfs answers
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *a)

    monkeypatch.setattr(_fileio.os, "open", no_direct)
    with atomic_fd(final, force=True, direct=True) as out:
        assert not out.direct
        _write(out, b"plain")
    monkeypatch.undo()
    assert final.read_bytes() == b"plain"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def _aligned(n: int):
    import mmap

    m = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT wants
    m.write(b"x" * n)
    return memoryview(m)
