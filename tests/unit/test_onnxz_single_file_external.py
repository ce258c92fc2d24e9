"""A pack of one file whose model nonetheless names external data (pack keeps every file a model
names, so only another writer makes one): passes.load and the session refuse it, naming the
tensor and the file, instead of returning a model whose tensors were never read (load) or handing
onnxruntime a model that looks for the file beside the process (the session); unpack restores
the model file byte for byte, as it was packed."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
import passes.onnxz
from passes.errors import InvalidModelError
from passes.onnxz import writer
from passes.runtime_source import read_split

N = 1 << 16


def _external(name):
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[N], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(4 * N))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _pack_of_one_file(tmp_path, monkeypatch, where):
    """A model reading tensor E from w.bin (`where`: "initializer" or "constant", a Constant node's
    attribute) beside a big inline weight W, packed as if its external data were not there."""
    (tmp_path / "w.bin").write_bytes(np.full(N, 7, np.float32).tobytes())
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(N).astype(np.float32), "W")
    nodes = [helper.make_node("Add", ["W", "E"], ["y"])]
    inits = [w]
    if where == "initializer":
        inits.append(_external("E"))
    else:
        nodes.insert(0, helper.make_node("Constant", [], ["E"], value=_external("C")))
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save_model(m, tmp_path / "model.onnx")
    real = writer.find_tensors
    monkeypatch.setattr(writer, "find_tensors", lambda data: [r for r in real(data) if r.field != "external"])
    passes.onnxz.pack(tmp_path / "model.onnx", tmp_path / "p.onnxz")
    monkeypatch.undo()
    with passes.onnxz.open_packed(tmp_path / "p.onnxz") as pm:
        assert [f["name"] for f in pm.metadata()["files"]] == ["model.onnx"]
    return tmp_path / "p.onnxz"


@pytest.mark.parametrize("where,name", [("initializer", "E"), ("constant", "C")])
def test_load_and_the_session_refuse_it(tmp_path, monkeypatch, where, name):
    packed = _pack_of_one_file(tmp_path, monkeypatch, where)
    monkeypatch.chdir(tmp_path)  # (a w.bin in the working folder must not be read either)
    match = f"tensor '{name}' references external data 'w.bin' not in the packed file"
    with pytest.raises(InvalidModelError, match=match):
        passes.load(packed)
    with pytest.raises(InvalidModelError, match=match):
        read_split(packed)
    for mode in ("fold", "int8"):
        with pytest.raises(InvalidModelError, match=match):
            passes.InferenceSession(str(packed), mode=mode)


def test_unpack_restores_the_model_as_packed(tmp_path, monkeypatch):
    packed = _pack_of_one_file(tmp_path, monkeypatch, "initializer")
    out = tmp_path / "out"
    out.mkdir()
    passes.onnxz.unpack(packed, out / "model.onnx")
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    assert digest(out / "model.onnx") == digest(tmp_path / "model.onnx")
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]
    with pytest.raises(InvalidModelError, match="external data file 'w.bin' of tensor 'E' is missing"):
        passes.load(out / "model.onnx")
