"""_fileio._current_umask reads the process's umask without changing it, and outputs follow it."""
from __future__ import annotations

import os

import pytest

from passes import _fileio


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o027, 0o077, 0o002])
def test_current_umask_is_the_process_umask(mask, tmp_path):
    old = os.umask(mask)
    try:
        assert _fileio._current_umask() == mask
        assert os.umask(mask) == mask  # left as it was
        _fileio.write_bytes_atomic(tmp_path / f"out{mask:o}", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / f"out{mask:o}").stat().st_mode & 0o777 == 0o666 & ~mask
