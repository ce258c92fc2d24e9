"""Outputs get the permissions any new file gets: 0o666 less the process's umask (the temporary
file is created with that mode and renamed; nothing reads or changes the umask)."""
from __future__ import annotations

import os

import pytest

from passes import _fileio


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o027, 0o077, 0o002])
def test_outputs_follow_the_umask(mask, tmp_path):
    old = os.umask(mask)
    try:
        _fileio.write_bytes_atomic(tmp_path / f"out{mask:o}", b"x")
        assert os.umask(mask) == mask  # left as it was
    finally:
        os.umask(old)
    assert (tmp_path / f"out{mask:o}").stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == [f"out{mask:o}"]  # no temporary file left
