"""unpack --force over an unpacked model with external data files replaces the whole set as one
change: every file is restored to a temporary file first, then all are renamed, data files first
and the model last (_fileio.replace_together). A failure or Ctrl-C anywhere, in a restore or
between two renames, leaves the old model with its own old data files (it used to leave the old
model beside the new data files renamed already), and no temporary file behind."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import passes
import passes._fileio as fileio
import passes.onnxz
from passes.errors import FileAccessError
from passes.onnxz import reader

N = 4096  # float32 values per tensor: 16 KiB, two O_DIRECT blocks and more


def _model(folder, seed):
    """model.onnx reading A from a.bin and B from sub/b.bin; values drawn from `seed`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sub").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    inits, values = [], {}
    for name, location in (("A", "a.bin"), ("B", "sub/b.bin")):
        values[name] = rng.standard_normal(N).astype(np.float32)
        (folder / location).write_bytes(values[name].tobytes())
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[N], data_location=TensorProto.EXTERNAL)
        for k, v in (("location", location), ("offset", "0"), ("length", str(4 * N))):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
    g = helper.make_graph([helper.make_node("Add", ["A", "B"], ["y"])], f"g{seed}", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save_model(m, folder / "model.onnx")
    return folder / "model.onnx", values


def _digests(folder):
    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(folder) for f in fs}


@pytest.fixture
def setup(tmp_path):
    """(destination folder holding the old model unpacked, the old values, the new pack, the new values)."""
    old_src, old_values = _model(tmp_path / "old", 1)
    new_src, new_values = _model(tmp_path / "new", 2)
    passes.onnxz.pack(old_src, tmp_path / "old.onnxz")
    passes.onnxz.pack(new_src, tmp_path / "new.onnxz")
    out = tmp_path / "out"
    out.mkdir()
    passes.onnxz.unpack(tmp_path / "old.onnxz", out / "model.onnx")
    return out, old_values, tmp_path / "new.onnxz", new_values


def _check(out, values, digests):
    assert _digests(out) == digests  # the same files, byte for byte: no temporary file left either
    model = passes.load(out / "model.onnx")
    got = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, want in values.items():
        np.testing.assert_array_equal(got[name], want)


def _fail_a_rename(monkeypatch, out, fail_at, error, renamed=False):
    """os.replace (as _fileio calls it) raising `error` at the fail_at-th rename of a restored
    temporary file (.part) into `out`; the renames after it (those that put the old files back)
    are not counted and go through. `renamed`: that rename is made before `error` is raised (a
    Ctrl-C delivered while the call was in the kernel is raised as it returns). Returns the
    destinations of the renames counted."""
    real, calls = os.replace, []

    def replace(a, b, *args, **kwargs):
        if os.fspath(a).endswith(".part") and str(out) in os.fspath(b) and len(calls) < fail_at:
            calls.append(b)
            if len(calls) == fail_at:
                if renamed:
                    real(a, b, *args, **kwargs)
                raise error
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(fileio.os, "replace", replace)
    return calls


def test_a_failed_restore_of_the_model_leaves_the_old_set(setup, monkeypatch):
    out, old_values, new_pack, _ = setup
    before = _digests(out)
    real = reader._write_restored

    def fail_at_the_model(pf, fi, f, mode, direct_io=True):
        if fi == 0:  # the data files are restored already
            raise OSError(28, "No space left on device")
        return real(pf, fi, f, mode, direct_io)

    monkeypatch.setattr(reader, "_write_restored", fail_at_the_model)
    with pytest.raises(OSError):
        passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    _check(out, old_values, before)


@pytest.mark.parametrize("fail_at", [1, 2, 3])
@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), KeyboardInterrupt()])
def test_a_failure_between_the_renames_puts_the_old_set_back(setup, monkeypatch, fail_at, error):
    """fail_at: the rename that fails (1: a.bin, 2: sub/b.bin, after a.bin was renamed; 3: the model)."""
    out, old_values, new_pack, _ = setup
    before = _digests(out)
    calls = _fail_a_rename(monkeypatch, out, fail_at, error)
    with pytest.raises((FileAccessError, KeyboardInterrupt)):
        passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    monkeypatch.undo()
    assert len(calls) == fail_at
    _check(out, old_values, before)


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_ctrl_c_raised_as_a_rename_returns_puts_the_whole_old_set_back(setup, monkeypatch, fail_at):
    """The rename took place: its old file must come back too, not be lost beside the old others."""
    out, old_values, new_pack, _ = setup
    before = _digests(out)
    calls = _fail_a_rename(monkeypatch, out, fail_at, KeyboardInterrupt(), renamed=True)
    with pytest.raises(KeyboardInterrupt):
        passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    monkeypatch.undo()
    assert len(calls) == fail_at
    _check(out, old_values, before)


def test_the_new_set_replaces_the_old_one(setup):
    out, _, new_pack, new_values = setup
    passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    fileio.flush_released()
    restored = _digests(out)
    assert sorted(restored) == ["a.bin", "model.onnx", os.path.join("sub", "b.bin")]
    _check(out, new_values, restored)


def test_without_force_nothing_is_replaced(setup):
    out, old_values, new_pack, _ = setup
    before = _digests(out)
    with pytest.raises(FileAccessError, match="exists"):
        passes.onnxz.unpack(new_pack, out / "model.onnx")
    _check(out, old_values, before)


def test_a_data_file_where_none_was_is_removed_on_failure(setup, monkeypatch):
    """An old set without sub/b.bin: the rename that fails after it was made removes it again."""
    out, old_values, new_pack, _ = setup
    os.unlink(out / "sub" / "b.bin")
    before = _digests(out)
    _fail_a_rename(monkeypatch, out, 3, OSError(5, "Input/output error"))
    with pytest.raises(FileAccessError):
        passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    assert _digests(out) == before


def test_without_hard_links_the_old_files_are_renamed_aside_and_put_back(setup, monkeypatch):
    """A filesystem that refuses hard links: each old file is renamed to its hidden name instead."""
    out, old_values, new_pack, new_values = setup
    before = _digests(out)

    def no_links(*args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(fileio.os, "link", no_links)
    real = os.replace
    _fail_a_rename(monkeypatch, out, 3, OSError(5, "Input/output error"))
    with pytest.raises(FileAccessError):
        passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    _check(out, old_values, before)
    monkeypatch.setattr(fileio.os, "replace", real)
    passes.onnxz.unpack(new_pack, out / "model.onnx", force=True)
    _check(out, new_values, _digests(out))
    assert len(_digests(out)) == 3
