"""Format stability (issue 6 item 7): every golden `.onnxz` file under tests/golden/ — every
format version and codec — decodes, in every CI run, to exactly what its MANIFEST.json says (the
hashes were computed from the arrays before packing, not by the reader); the files that claim a
newer version are refused with "written by a newer version".

A failure here means the reader stopped reading files already written. Do not regenerate the
golden files to make it pass (tests/golden/make_golden.py says when to run it).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import passes
from passes import NewerFormatError

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
VERSIONS = sorted(p for p in GOLDEN.iterdir() if p.is_dir() and (p / "MANIFEST.json").is_file())


def _entries():
    for folder in VERSIONS:
        manifest = json.loads((folder / "MANIFEST.json").read_text())
        for name, entry in sorted(manifest["files"].items()):
            yield pytest.param(folder, name, entry, id=f"{folder.name}/{name}")


def _newer():
    for folder in VERSIONS:
        manifest = json.loads((folder / "MANIFEST.json").read_text())
        for name in sorted(manifest.get("newer", {})):
            yield pytest.param(folder / name, id=f"{folder.name}/{name}")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_golden_files_exist_for_every_codec_family():
    assert VERSIONS, "no golden folder"
    used = set()
    for folder in VERSIONS:
        for entry in json.loads((folder / "MANIFEST.json").read_text())["files"].values():
            used |= set(entry["codecs"])
    assert {"bytes", "bpairs", "planes", "fplanes", "fpairs", "narrow", "skeleton"} <= used, used


@pytest.mark.parametrize("folder, name, entry", list(_entries()))
@pytest.mark.parametrize("threads", [1, 2])
def test_golden_tensors(folder, name, entry, threads):
    with passes.open_packed(folder / name, threads=threads) as pm:
        assert sorted(pm.keys()) == sorted(entry["tensors"])
        for key, want in entry["tensors"].items():
            arr = pm.get_tensor(key)
            assert (str(arr.dtype), list(arr.shape), _sha(arr.tobytes())) == (want["dtype"], want["shape"], want["sha256"]), key


@pytest.mark.parametrize("folder, name, entry", list(_entries()))
def test_golden_unpack_restores_every_file(folder, name, entry, tmp_path):
    out = passes.unpack(folder / name, tmp_path / entry["model_file"], threads=1)
    restored = {p.name: _sha(p.read_bytes()) for p in tmp_path.iterdir()}
    assert restored == entry["restored_files"]
    model = passes.load(folder / name, threads=1)
    assert _sha(model.SerializeToString()) == _sha(passes.load(out).SerializeToString())
    assert passes.verify(folder / name, against=out).ok


@pytest.mark.parametrize("path", list(_newer()))
def test_newer_versions_are_refused_clearly(path, tmp_path):
    for fn in (lambda: passes.open_packed(path), lambda: passes.load(path),
               lambda: passes.unpack(path, tmp_path / "x.onnx"), lambda: passes.verify(path)):
        with pytest.raises(NewerFormatError, match="written by a newer version"):
            fn()
    assert not (tmp_path / "x.onnx").exists()
