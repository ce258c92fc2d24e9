"""Fixtures of the reliability tests: the packed samples of fuzz/samples.py (built once per
session through the real writer) and a fast scratch folder (/dev/shm when there is one:
the corruption sweeps write thousands of small files)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def samples():
    from fuzz.samples import build_all

    return {s.name: s for s in build_all()}


@pytest.fixture
def fast_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="surgeon-rel-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def oracle_for(samples, fast_dir):
    from fuzz.oracle import Oracle

    made = {}

    def get(name):
        if name not in made:
            made[name] = Oracle(samples[name], fast_dir / name)
        return made[name]

    return get
