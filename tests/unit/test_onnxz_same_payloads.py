"""Format 1.4's codec `same` (FORMAT.md 3.3): a cut payload byte for byte the same as an earlier
one (tied weights, copies) is stored once, the later tensor's stream naming the earlier tensor;
restored byte for byte. Packs without such payloads are unchanged (1.2 / 1.3, no `same`); a 1.3
reader refuses the codec as newer; a `same` naming anything but an earlier coded tensor is damage."""
from __future__ import annotations

import os
import struct

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
import passes.onnxz
from onnxz_helpers import first_stream, rewrite_index
from passes.errors import CorruptFileError, NewerFormatError
from passes.onnxz import codecs
from passes.onnxz.reader import PackedFile

N = 128  # a 128 x 128 float32 weight: 64 KiB


def _model(folder, tied: bool, name="m.onnx", external=False):
    """A small bias (left in the skeleton: the catalog's entries come first), then W1 and W2, equal
    when `tied`, each read by a MatMul. `external`: W2 in w2.bin."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((N, N)).astype(np.float32)
    w2 = w1.copy() if tied else rng.standard_normal((N, N)).astype(np.float32)
    inits = [numpy_helper.from_array(np.ones(N, np.float32), "bias"), numpy_helper.from_array(w1, "W1"),
             numpy_helper.from_array(w2, "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["b"]),
             helper.make_node("Add", ["b", "bias"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    if external:
        t = m.graph.initializer[2]
        (folder / "w2.bin").write_bytes(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", "w2.bin"), ("offset", "0"), ("length", str(4 * N * N))):
            e = t.external_data.add()
            e.key, e.value = k, v
    onnx.save_model(m, folder / name)
    return folder / name, w1, w2


def _version(path):
    with open(path, "rb") as f:
        return struct.unpack_from("<8sHH", f.read(12))[1:]


@pytest.mark.parametrize("external", [False, True])
def test_a_payload_stored_twice_is_stored_once_and_restored(tmp_path, external):
    src, w1, w2 = _model(tmp_path, tied=True, external=external)
    other, _, _ = _model(tmp_path, tied=False, name="other.onnx")
    passes.onnxz.pack(src, tmp_path / "m.onnxz")
    passes.onnxz.pack(other, tmp_path / "other.onnxz")
    tied_size, other_size = os.path.getsize(tmp_path / "m.onnxz"), os.path.getsize(tmp_path / "other.onnxz")
    assert tied_size < other_size - 0.8 * 4 * N * N  # one of the two 64 KiB payloads is not stored
    assert _version(tmp_path / "m.onnxz") == (1, 4) and _version(tmp_path / "other.onnxz") != (1, 4)
    with PackedFile(tmp_path / "m.onnxz") as pf:
        assert pf.index.version == (1, 4) and pf.index.raw["format"] == [1, 4]  # (the index object, not a stream's)
        assert pf.index.raw["catalog"]  # the bias's entry: `tensor` names W1's place in the coded list
    out = tmp_path / "out"
    out.mkdir()
    passes.onnxz.unpack(tmp_path / "m.onnxz", out / "m.onnx")
    assert (out / "m.onnx").read_bytes() == src.read_bytes()
    if external:
        assert (out / "w2.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()
    assert passes.onnxz.verify(tmp_path / "m.onnxz", against=src).ok
    with passes.onnxz.open_packed(tmp_path / "m.onnxz") as pm:
        np.testing.assert_array_equal(pm.get_tensor("W2"), w2)
        got = pm.get_tensors()
        np.testing.assert_array_equal(got["W1"], w1)
        np.testing.assert_array_equal(got["W2"], w2)
        rows = {t["key"]: t for t in pm.metadata()["tensors"]}
    assert rows["W2"]["codec"] == "same" and rows["W2"]["stored"] == 0 and rows["W2"]["params"] == {"tensor": "W1"}
    assert rows["W1"]["codec"] != "same" and rows["W1"]["stored"] > 0
    loaded = passes.load(tmp_path / "m.onnxz")
    assert loaded.SerializeToString() == passes.load(src).SerializeToString()
    x = np.random.default_rng(1).standard_normal((1, N)).astype(np.float32)
    want = (x @ w1) @ w2 + 1
    np.testing.assert_allclose(passes.InferenceSession(str(tmp_path / "m.onnxz")).run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_without_equal_payloads_nothing_names_another(tmp_path):
    src, _, _ = _model(tmp_path, tied=False)
    passes.onnxz.pack(src, tmp_path / "m.onnxz")
    with passes.onnxz.open_packed(tmp_path / "m.onnxz") as pm:
        assert "same" not in {t["codec"] for t in pm.metadata()["tensors"]}


def test_a_reader_of_1_3_refuses_the_codec_as_newer():
    """What a 1.3 reader runs on a `same` stream: check_params of a codec it does not know."""
    with pytest.raises(NewerFormatError, match="'same' is unknown to this reader"):
        codecs.check_params("same", {"tensor": 0})


@pytest.mark.parametrize("mutate,match", [
    (lambda s: s["params"].update(tensor=len(s) + 99), "not an earlier coded tensor"),
    (lambda s: s["params"].update(tensor=-1), "not an earlier coded tensor"),
    (lambda s: s["params"].update(tensor="0"), "same stream"),
    (lambda s: s["params"].update(extra=1), "same stream"),
    (lambda s: s.update(chunks=[[64, 4, [4], 0]]), "same stream"),
])
def test_a_bad_same_is_damage(tmp_path, mutate, match):
    src, _, _ = _model(tmp_path, tied=True)
    passes.onnxz.pack(src, tmp_path / "m.onnxz")
    data = (tmp_path / "m.onnxz").read_bytes()
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(rewrite_index(data, lambda obj: mutate(first_stream(obj, "same")), (1, 4)))
    with pytest.raises(CorruptFileError, match=match):
        passes.onnxz.unpack(bad, tmp_path / "r.onnx")


def test_same_naming_itself_or_a_later_tensor_is_damage(tmp_path):
    src, _, _ = _model(tmp_path, tied=True)
    passes.onnxz.pack(src, tmp_path / "m.onnxz")
    data = (tmp_path / "m.onnxz").read_bytes()

    def point_at_itself(obj):
        i = next(i for i, t in enumerate(obj["tensors"]) if t.get("stream") and t["stream"]["codec"] == "same")
        obj["tensors"][i]["stream"]["params"]["tensor"] = i

    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(rewrite_index(data, point_at_itself, (1, 4)))
    with pytest.raises(CorruptFileError, match="not an earlier coded tensor"):
        passes.onnxz.unpack(bad, tmp_path / "r.onnx")
