"""External data locations written with "." components ("./w3.bin"): valid relative paths, which
the index names by their normal form (FORMAT.md 4, FILE) so that pack takes them and unpack
restores every file byte for byte."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import InvalidModelError
from passes.onnxz.format import normal_data_name
from passes.onnxz.reader import PackedFile


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _external(name: str, location: str, offset: int, values: np.ndarray) -> TensorProto:
    t = numpy_helper.from_array(values, name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(values.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _model_with_locations(folder, locations):
    """A model whose tensors i lie in one file `w3.bin` at 4096 * i, tensor i naming it locations[i]."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(1000).astype(np.float32) for _ in locations]
    blob = bytearray(4096 * len(arrays))
    inits = []
    for i, (loc, a) in enumerate(zip(locations, arrays)):
        blob[4096 * i:4096 * i + a.nbytes] = a.tobytes()
        inits.append(_external(f"w{i}", loc, 4096 * i, a))
    (folder / "w3.bin").write_bytes(bytes(blob))
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000])
    nodes = [helper.make_node("Identity", ["w0"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "g", [], [out], inits))
    (folder / "m.onnx").write_bytes(m.SerializeToString())
    return folder / "m.onnx", arrays


@pytest.mark.parametrize("name, normal", [("./w3.bin", "w3.bin"), ("w3.bin", "w3.bin"), ("a/./b.bin", "a/b.bin"),
                                          ("a//b.bin", "a/b.bin"), ("./a/b.bin", "a/b.bin")])
def test_normal_data_name(name, normal):
    assert normal_data_name(name) == normal


@pytest.mark.parametrize("name", ["../w.bin", "/abs/w.bin", ".", "./", "a/../../w.bin", "", "a\\b.bin"])
def test_normal_data_name_refuses_what_leaves_the_folder(name):
    with pytest.raises(Exception):
        normal_data_name(name)


def test_dot_slash_location_packs_and_restores_byte_for_byte(tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    # the same file named two ways by two tensors: one file in the pack
    src, arrays = _model_with_locations(src_dir, ["./w3.bin", "w3.bin"])
    packed = tmp_path / "m.onnxz"
    stats = passes.pack(src, packed)
    assert stats.files == 2
    with PackedFile(packed) as pf:
        assert [f.name for f in pf.index.files[1:]] == ["w3.bin"]
    with passes.open_packed(packed) as pm:
        for i, a in enumerate(arrays):
            assert pm.get_tensor(f"w{i}").tobytes() == a.tobytes()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    passes.unpack(packed, out_dir / "m.onnx")
    assert _sha(out_dir / "m.onnx") == _sha(src)
    assert _sha(out_dir / "w3.bin") == _sha(src_dir / "w3.bin")
    assert passes.verify(packed, against=src).ok


def test_location_outside_the_folder_still_refused(tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src, _ = _model_with_locations(src_dir, ["./../src/w3.bin"])
    with pytest.raises(InvalidModelError):
        passes.pack(src, tmp_path / "x.onnxz")
    assert not (tmp_path / "x.onnxz").exists()


def test_load_finds_dot_slash_location(tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src, _ = _model_with_locations(src_dir, ["./w3.bin"])
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed)
    assert passes.load(packed).SerializeToString() == onnx.load(src).SerializeToString()
