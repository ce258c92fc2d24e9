"""passes.load of a pack checks its external tensors' ranges as the .onnx path does: many
tensors naming one range, a malformed offset / length and a negative offset are refused
with InvalidModelError, not given a copy each, a bare ValueError or an empty tensor."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import passes
import passes.onnxz
from passes.errors import InvalidModelError
from passes.onnxz import writer


def _model(folder, ranges, data_bytes: int):
    """Initializers W0..Wn of float32, each stored externally in w.bin at (offset, length) strings."""
    (folder / "w.bin").write_bytes(np.arange(data_bytes // 4, dtype=np.float32).tobytes())
    inits, nodes, outs = [], [], []
    for i, (offset, length) in enumerate(ranges):
        t = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[data_bytes // 4],
                        data_location=TensorProto.EXTERNAL)
        for k, v in (("location", "w.bin"), ("offset", offset), ("length", length)):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
        nodes.append(helper.make_node("Identity", [f"W{i}"], [f"y{i}"]))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    m = helper.make_model(helper.make_graph(nodes, "g", [], outs, inits), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save_model(m, folder / "model.onnx")
    return folder / "model.onnx"


def _packed(tmp_path, ranges, data_bytes, monkeypatch=None):
    """The model and its pack. pack keeps files byte for byte but refuses a range outside its
    file itself: with `monkeypatch`, its wire walk is told every range is the whole file, so the
    pack holds what another writer could have written (FORMAT.md asks nothing of the ranges)."""
    src = _model(tmp_path, ranges, data_bytes)
    if monkeypatch is not None:
        real = writer.find_tensors

        def whole_files(data):
            refs = real(data)
            for r in refs:
                if r.field == "external":
                    r.offset, r.length = 0, -1
                    r.external = dict(r.external, offset="0", length="")
            return refs

        monkeypatch.setattr(writer, "find_tensors", whole_files)
    passes.onnxz.pack(src, tmp_path / "p.onnxz")
    return src, tmp_path / "p.onnxz"


def test_many_tensors_naming_one_range_are_refused_from_the_pack_as_from_the_onnx(tmp_path):
    size = 2 << 20
    src, packed = _packed(tmp_path, [("0", str(size))] * 40, size)  # 80 MiB read from a 2 MiB file
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match="external data ranges overlap"):
            passes.load(path)


def test_a_few_tensors_sharing_a_range_still_load(tmp_path):
    size = 64 << 10
    src, packed = _packed(tmp_path, [("0", str(size))] * 3, size)
    a, b = passes.load(src), passes.load(packed)
    assert [t.raw_data for t in a.graph.initializer] == [t.raw_data for t in b.graph.initializer]
    assert len(b.graph.initializer[2].raw_data) == size


@pytest.mark.parametrize("offset,length,match", [
    ("abc", "4096", "'W1' has a malformed external data offset or length"),
    ("0", "x1", "'W1' has a malformed external data offset or length"),
    ("-8", "4096", r"declares external data bytes -8\.\.4088"),
    ("4096", "4096", r"declares external data bytes 4096\.\.8192 but 'w.bin' holds 4096"),
])
def test_a_bad_range_is_an_invalid_model_from_the_pack_as_from_the_onnx(tmp_path, monkeypatch, offset, length, match):
    src, packed = _packed(tmp_path, [("0", "4096"), (offset, length)], 4096, monkeypatch)
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match=match):
            passes.load(path)


@pytest.mark.parametrize("offset,length", [("abc", "4096"), ("0", "x1")])
def test_pack_refuses_a_malformed_range(tmp_path, offset, length):
    """It skipped the tensor, and with it the data file only that tensor named: the pack then
    restored the model without its data."""
    src = _model(tmp_path, [(offset, length)], 4096)
    with pytest.raises(InvalidModelError, match="'W0' has a malformed external data offset or length"):
        passes.onnxz.pack(src, tmp_path / "p.onnxz")
    assert not (tmp_path / "p.onnxz").exists()
