"""How a packed file is opened (reader._open_input: one non-blocking open and one fstat instead of
check_readable's four path look-ups) and where unpack checks its destination (once, by
atomic_output, for a pack of one file; before the data files for a pack with external data): the
same verdicts and messages as before, a FIFO never waited on, nothing written on a refusal."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import CorruptFileError, FileAccessError
from passes.onnxz.reader import PackedFile


def _packed(tmp_path):
    w = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    g = helper.make_graph([], "g", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [5000])],
                          [numpy_helper.from_array(w, "w")])
    src = tmp_path / "m.onnx"
    src.write_bytes(helper.make_model(g).SerializeToString())
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed)
    return src, packed


def test_a_regular_packed_file_opens_and_reads(tmp_path):
    src, packed = _packed(tmp_path)
    with PackedFile(packed, threads=1) as pf:
        assert pf.size == packed.stat().st_size
        assert os.get_blocking(pf._fd)  # the non-blocking open is undone for the reads
        assert pf.restore_file(0).tobytes() == src.read_bytes()


@pytest.mark.parametrize("what, expected", [("missing", "no such file"), ("folder", "is a folder")])
def test_not_a_file_is_refused_with_check_readables_message(tmp_path, what, expected):
    path = tmp_path / "x.onnxz"
    if what == "folder":
        path.mkdir()
    with pytest.raises(FileAccessError, match=expected):
        PackedFile(path)


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_a_device_is_refused():
    with pytest.raises(FileAccessError, match="character device"):
        PackedFile("/dev/null")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "p.onnxz"
    os.mkfifo(fifo)
    got = []

    def open_it():
        try:
            PackedFile(fifo)
        except FileAccessError as exc:
            got.append(str(exc))

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "opening a FIFO waited for a writer"
    assert got and "pipe" in got[0]


def test_unpack_onto_an_existing_file_without_force_writes_nothing(tmp_path):
    _src, packed = _packed(tmp_path)
    existing = tmp_path / "out.onnx"
    existing.write_bytes(b"keep")
    with pytest.raises(FileAccessError, match="exists"):
        passes.unpack(packed, existing)
    assert existing.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnxz", "out.onnx"]  # no temporary left


def test_unpack_a_damaged_pack_onto_an_existing_file_leaves_it(tmp_path):
    """The destination is now checked once the pack is open: a damaged pack is named as such, and the
    existing file stays as it was either way."""
    existing = tmp_path / "out.onnx"
    existing.write_bytes(b"keep")
    junk = tmp_path / "junk.onnxz"
    junk.write_bytes(b"not a pack" * 20)
    with pytest.raises((CorruptFileError, FileAccessError)):
        passes.unpack(junk, existing)
    assert existing.read_bytes() == b"keep"


def test_external_data_pack_checks_the_model_path_before_writing_data_files(tmp_path):
    """A pack with external data files: the model's destination is refused before any data file is
    written (the data files go first, so that the model never points at missing data)."""
    w = np.random.default_rng(6).standard_normal(4096).astype(np.float32)
    t = numpy_helper.from_array(w, "w")
    g = helper.make_graph([], "g", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [4096])], [t])
    model = helper.make_model(g)
    folder = tmp_path / "src"
    folder.mkdir()
    import onnx

    onnx.save_model(model, folder / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    packed = tmp_path / "m.onnxz"
    passes.pack(folder / "m.onnx", packed)
    with PackedFile(packed) as pf:
        assert len(pf.index.files) == 2
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.onnx").write_bytes(b"keep")
    with pytest.raises(FileAccessError, match="exists"):
        passes.unpack(packed, out / "m.onnx")
    assert sorted(p.name for p in out.iterdir()) == ["m.onnx"]
    assert (out / "m.onnx").read_bytes() == b"keep"
    passes.unpack(packed, out / "m.onnx", force=True)
    assert (out / "m.data").read_bytes() == (folder / "m.data").read_bytes()


def test_unpack_knows_its_input_under_any_name(tmp_path):
    """unpack refuses to write over the pack it reads, told by the open file's inode: the path
    itself, another spelling, a hard link, a symlink; a new name or another file is written."""
    src, packed = _packed(tmp_path)
    before = packed.read_bytes()
    os.link(packed, tmp_path / "hard.onnxz")
    os.symlink(packed, tmp_path / "soft.onnxz")
    for dst in (packed, tmp_path / "." / "m.onnxz", tmp_path / "hard.onnxz", tmp_path / "soft.onnxz"):
        for force in (False, True):
            with pytest.raises(FileAccessError, match="is the input file"):
                passes.unpack(packed, dst, force=force)
    assert packed.read_bytes() == before
    other = tmp_path / "other.onnx"
    other.write_bytes(b"old")
    passes.unpack(packed, other, force=True)
    assert other.read_bytes() == src.read_bytes()
    passes.unpack(packed, tmp_path / "new.onnx")
    assert (tmp_path / "new.onnx").read_bytes() == src.read_bytes()
    with PackedFile(packed) as pf:
        assert pf._is_input(tmp_path / "hard.onnxz") and not pf._is_input(tmp_path / "missing")
    with PackedFile(before) as pf:  # from memory: no file to be
        assert not pf._is_input(packed)
