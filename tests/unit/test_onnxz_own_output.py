"""unpack never writes over the pack it reads (nor a data file over the model it restores), and
pack says when a tiny model's pack came out larger than the model."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import passes
from passes import CorruptFileError, FileAccessError


def _model_with_data(folder, location):
    """m.onnx whose one weight lives in the external data file `location`, packed, the pack then
    named p.onnxz; returns (pack, the data file's bytes)."""
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.arange(5000, dtype=np.float32), "w")]))
    onnx.save_model(m, str(folder / "m.onnx"), save_as_external_data=True, location=location, size_threshold=0)
    data = (folder / location).read_bytes()
    passes.pack(folder / "m.onnx", folder / "packing.onnxz")
    os.replace(folder / "packing.onnxz", folder / "p.onnxz")
    return folder / "p.onnxz", data


@pytest.mark.parametrize("force", [False, True])
def test_unpack_onto_the_pack_itself_is_refused(tmp_path, force):
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.ones(3000, np.float32), "w")]))
    onnx.save_model(m, str(tmp_path / "m.onnx"))
    packed = tmp_path / "m.onnxz"
    passes.pack(tmp_path / "m.onnx", packed)
    before = packed.read_bytes()
    for dst in (packed, tmp_path / "." / "m.onnxz"):
        with pytest.raises(FileAccessError, match="is the input file .*the input is never modified"):
            passes.unpack(packed, dst, force=force)
    os.link(packed, tmp_path / "hard.onnxz")  # another name of the same file
    with pytest.raises(FileAccessError, match="is the input file"):
        passes.unpack(packed, tmp_path / "hard.onnxz", force=True)
    assert packed.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.onnxz", "m.onnx", "m.onnxz"]


def test_external_data_landing_on_the_pack_is_refused(tmp_path):
    """A data file named like the pack (weights.onnxz) restored beside it would replace it: the
    same refusal as the command's, not a damaged-index error (the index is fine)."""
    packed, data = _model_with_data(tmp_path, "p.onnxz")  # the data file's name is the pack's
    before = packed.read_bytes()
    for force in (False, True):
        with pytest.raises(FileAccessError, match=r"p\.onnxz \(external data of the packed model\): it is the input file") as info:
            passes.unpack(packed, tmp_path / "out.onnx", force=force)
        assert not isinstance(info.value, CorruptFileError)
    assert packed.read_bytes() == before
    assert not (tmp_path / "out.onnx").exists()
    # elsewhere it restores
    (tmp_path / "o").mkdir()
    passes.unpack(packed, tmp_path / "o" / "m.onnx")
    assert (tmp_path / "o" / "p.onnxz").read_bytes() == data


def test_external_data_landing_on_the_model_destination_is_refused(tmp_path):
    packed, _ = _model_with_data(tmp_path, "w.bin")
    (tmp_path / "o").mkdir()
    with pytest.raises(FileAccessError, match="it is the model's destination"):
        passes.unpack(packed, tmp_path / "o" / "w.bin")
    assert list((tmp_path / "o").iterdir()) == []


def test_pack_larger_than_a_tiny_input_says_why(tmp_path):
    m = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.ones(4, np.float32), "w")]))
    src = tmp_path / "tiny.onnx"
    onnx.save_model(m, str(src))
    stats = passes.pack(src, tmp_path / "tiny.onnxz")
    assert stats.packed_bytes == (tmp_path / "tiny.onnxz").stat().st_size > stats.original_bytes == src.stat().st_size
    assert stats.larger_than_input and 0 < stats.index_bytes < stats.packed_bytes
    note = stats.note
    assert f"{stats.packed_bytes - stats.original_bytes} bytes larger than its input" in note
    assert f"{stats.index_bytes}-byte index" in note and "64-byte header" in note and "checksums" in note
    d = stats.to_dict()
    assert d["larger_than_input"] is True and d["note"] == note and d["index_bytes"] == stats.index_bytes
    # written all the same, and restored byte for byte
    assert passes.unpack(tmp_path / "tiny.onnxz", tmp_path / "back.onnx").read_bytes() == src.read_bytes()


def test_pack_smaller_than_its_input_has_no_note(tmp_path):
    w = np.round(np.random.default_rng(3).standard_normal(20000) * 8).astype(np.float32)
    src = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w")])), str(src))
    stats = passes.pack(src, tmp_path / "m.onnxz")
    assert stats.packed_bytes < stats.original_bytes
    assert not stats.larger_than_input and stats.note is None and stats.to_dict()["note"] is None
