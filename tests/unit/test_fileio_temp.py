"""How atomic_output makes its temporary file (_fileio._open_temp: one exclusive create beside the
output, not tempfile.mkstemp + fchmod) and checks the destination (_check_destination: one stat):
the same verdicts and messages as check_writable's, nothing left behind on any refusal."""
from __future__ import annotations

import errno
import os
import re
import stat

import pytest

from passes import FileAccessError, _fileio
from passes._fileio import atomic_output, check_writable, write_bytes_atomic


def test_the_temporary_file_is_hidden_beside_the_output_and_renamed(tmp_path):
    final = tmp_path / "out.bin"
    with atomic_output(final) as f:
        names = [p.name for p in tmp_path.iterdir()]
        assert len(names) == 1 and re.fullmatch(r"\.out\.bin\.[0-9a-f]{12}\.part", names[0]), names
        assert os.path.samestat(os.stat(tmp_path / names[0]), os.fstat(f.fileno()))
        f.write(b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    assert final.read_bytes() == b"data"


def test_a_taken_temporary_name_is_never_opened_and_another_is_drawn(tmp_path, monkeypatch):
    """O_EXCL: a file (or a link planted by someone else) under the drawn name is left alone."""
    draws = iter([b"\x01" * 6, b"\x01" * 6, b"\x02" * 6])
    monkeypatch.setattr(_fileio.os, "urandom", lambda n: next(draws))
    planted = tmp_path / ".out.bin.010101010101.part"
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, planted)
    write_bytes_atomic(tmp_path / "out.bin", b"new")
    assert (tmp_path / "out.bin").read_bytes() == b"new"
    assert target.read_bytes() == b"keep" and planted.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.bin.010101010101.part", "elsewhere", "out.bin"]


def test_no_free_name_is_an_error_not_a_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(_fileio.os, "urandom", lambda n: b"\x07" * n)
    (tmp_path / ".out.bin.070707070707.part").write_bytes(b"")
    with pytest.raises(FileAccessError, match="cannot write .*out.bin"):
        write_bytes_atomic(tmp_path / "out.bin", b"x")
    assert [p.name for p in tmp_path.iterdir()] == [".out.bin.070707070707.part"]


@pytest.mark.parametrize("code, message", [(errno.EROFS, "read-only file system"), (errno.ENOSPC, "no space left"),
                                           (errno.EACCES, "permission denied")])
def test_a_failed_create_names_the_reason(tmp_path, monkeypatch, code, message):
    def refuse(p, folder):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(_fileio, "_open_temp", refuse)
    with pytest.raises(FileAccessError, match=message):
        write_bytes_atomic(tmp_path / "out.bin", b"x")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_gets_check_writables_message(tmp_path):
    for call in (lambda p: write_bytes_atomic(p, b"x"), check_writable):
        with pytest.raises(FileAccessError, match=r"folder .*nope does not exist"):
            call(tmp_path / "nope" / "out.bin")
    assert list(tmp_path.iterdir()) == []


def test_a_file_where_the_folder_should_be_is_refused(tmp_path):
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(FileAccessError, match="plain"):
        write_bytes_atomic(tmp_path / "plain" / "out.bin", b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["plain"]


@pytest.mark.parametrize("force", [False, True])
def test_destination_verdicts(tmp_path, force):
    folder = tmp_path / "d"
    folder.mkdir()
    with pytest.raises(FileAccessError, match="is a folder, not a file"):
        write_bytes_atomic(folder, b"x", force=force)
    link_to_folder = tmp_path / "l"
    os.symlink(folder, link_to_folder)
    with pytest.raises(FileAccessError, match="is a folder, not a file"):
        write_bytes_atomic(link_to_folder, b"x", force=force)
    existing = tmp_path / "e.bin"
    existing.write_bytes(b"old")
    if force:
        write_bytes_atomic(existing, b"new", force=True)
        assert existing.read_bytes() == b"new"
    else:
        with pytest.raises(FileAccessError, match=r"exists \(use --force"):
            write_bytes_atomic(existing, b"new")
        assert existing.read_bytes() == b"old"
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "gone", dangling)
    write_bytes_atomic(dangling, b"x", force=force)  # a dangling link is no file: replaced by the output
    assert not dangling.is_symlink() and dangling.read_bytes() == b"x"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_destination_is_refused_even_with_force(tmp_path):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    with pytest.raises(FileAccessError, match="is a pipe, not a regular file"):
        write_bytes_atomic(fifo, b"x", force=True)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["p"]
