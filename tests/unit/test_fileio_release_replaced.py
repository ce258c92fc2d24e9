"""An output that replaces an existing file (force) releases the old file off the caller's path
(_fileio._hold_replaced / _release_later): the new file is in place, durable and whole exactly as
before, and the old file's last descriptor is closed by the closer thread soon after. Files under
RELEASE_MIN_BYTES are freed by the rename as before."""
import os

import pytest

from passes import _fileio

posix_only = pytest.mark.skipif(os.name != "posix" or not os.path.isdir("/proc/self/fd"), reason="POSIX, /proc")


def _deleted_files_held(folder) -> list:
    """The descriptors of this process on files of `folder` that were unlinked."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)) and target.endswith("(deleted)"):
            held.append(target)
    return held


@posix_only
@pytest.mark.parametrize("writer", ["atomic_output", "atomic_fd"])
def test_replaced_file_is_released_after_the_rename(tmp_path, writer):
    dst = tmp_path / "out.bin"
    dst.write_bytes(b"old" * (_fileio.RELEASE_MIN_BYTES // 3 + 1))
    old_inode = os.stat(dst).st_ino
    held = _fileio._hold_replaced(dst)
    assert held >= 0  # a regular file of RELEASE_MIN_BYTES or more is held across the rename
    os.close(held)
    if writer == "atomic_output":
        with _fileio.atomic_output(dst, force=True) as f:
            f.write(b"new" * 5000)
    else:
        with _fileio.atomic_fd(dst, force=True, st=os.stat(dst)) as out:
            os.write(out.fd, b"new" * 5000)
    assert dst.read_bytes() == b"new" * 5000
    assert os.stat(dst).st_ino != old_inode
    assert _fileio.flush_released()
    assert _deleted_files_held(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]  # no temporary file left


@posix_only
def test_nothing_is_held_without_force_or_without_an_old_file(tmp_path):
    dst = tmp_path / "fresh.bin"
    with _fileio.atomic_output(dst) as f:
        f.write(b"x" * _fileio.RELEASE_MIN_BYTES)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * (_fileio.RELEASE_MIN_BYTES - 1))
    assert _fileio._hold_replaced(small) == -1  # freed by the rename: not worth the hand-over
    assert _fileio._hold_replaced(tmp_path / "missing.bin") == -1
    assert _fileio._hold_replaced(tmp_path / "missing.bin", False) == -1
    assert _fileio._hold_replaced(tmp_path) == -1  # a folder is not a file the rename frees
    link = tmp_path / "link.bin"
    link.symlink_to(dst)
    assert _fileio._hold_replaced(link) == -1  # O_NOFOLLOW: the rename replaces the link, never its target
    fd = _fileio._hold_replaced(dst)
    assert fd >= 0
    _fileio._release_later(fd)
    assert _fileio.flush_released()
    with pytest.raises(OSError):
        os.fstat(fd)


@posix_only
def test_a_link_destination_is_replaced_and_its_target_kept(tmp_path):
    target = tmp_path / "target.bin"
    target.write_bytes(b"target")
    link = tmp_path / "out.bin"
    link.symlink_to(target)
    _fileio.write_bytes_atomic(link, b"new", force=True)
    assert not link.is_symlink() and link.read_bytes() == b"new"
    assert target.read_bytes() == b"target"


@posix_only
def test_a_failed_write_leaves_the_old_file_and_holds_nothing(tmp_path):
    dst = tmp_path / "out.bin"
    old = b"old" * (_fileio.RELEASE_MIN_BYTES // 3 + 1)
    dst.write_bytes(old)
    with pytest.raises(RuntimeError):
        with _fileio.atomic_output(dst, force=True) as f:
            f.write(b"partial")
            raise RuntimeError("interrupted")
    assert dst.read_bytes() == old
    assert _fileio.flush_released()
    assert _deleted_files_held(tmp_path) == []


@posix_only
def test_switched_off_the_rename_frees_the_file_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(_fileio, "_RELEASE_REPLACED", False)
    dst = tmp_path / "out.bin"
    dst.write_bytes(b"old" * (_fileio.RELEASE_MIN_BYTES // 3 + 1))
    assert _fileio._hold_replaced(dst) == -1
    _fileio.write_bytes_atomic(dst, b"new", force=True)
    assert dst.read_bytes() == b"new"
