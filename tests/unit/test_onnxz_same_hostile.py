"""Hostile uses of format 1.4's codec `same` (FORMAT.md 3.3), crafted by editing a pack's index:
each is refused with a documented error before anything is decoded, or (a chain, a length-equal
tensor of another dtype) restored byte for byte; never a wrong tensor."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import passes
import passes.onnxz
from onnxz_helpers import rewrite_index
from passes.errors import CorruptFileError, LimitExceededError, NewerFormatError

N = 64


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """W1, W2 == W1, W3 == W1 (64 x 64 float32), S (32 x 64, another length): W2 and W3 `same` as W1."""
    folder = tmp_path_factory.mktemp("same_hostile")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, N)).astype(np.float32)
    s = rng.standard_normal((N // 2, N)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W1"), numpy_helper.from_array(w.copy(), "W2"),
             numpy_helper.from_array(w.copy(), "W3"), numpy_helper.from_array(s, "S")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["b"]),
             helper.make_node("MatMul", ["b", "W3"], ["c"]), helper.make_node("Gemm", ["c", "S"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, N])],
                          [helper.make_tensor_value_info("y", 1, [1, N // 2])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, folder / "m.onnx")
    passes.onnxz.pack(folder / "m.onnx", folder / "m.onnxz")
    return folder, (folder / "m.onnxz").read_bytes(), w


def _at(obj, key):
    return next(i for i, t in enumerate(obj["tensors"]) if t["key"] == key)


def _readers(path, out):
    """Every reader of a pack, each a thunk."""
    x = np.ones((1, N), np.float32)
    return {
        "unpack": lambda: passes.onnxz.unpack(path, out, force=True),
        "load": lambda: passes.load(path),
        "get_tensor": lambda: passes.onnxz.open_packed(path).get_tensor("S"),
        "verify": lambda: passes.onnxz.verify(path),
        "metadata": lambda: passes.onnxz.open_packed(path).metadata(),
        "session": lambda: passes.InferenceSession(str(path)).run(None, {"x": x}),
    }


def _skeleton_same(obj):
    obj["files"][0]["skeleton"] = {"codec": "same", "params": {"tensor": 0}}


def _narrow_inner_same(obj):
    obj["tensors"][_at(obj, "S")]["stream"] = {
        "codec": "narrow", "params": {"from": 11, "to": 1, "inner": {"codec": "same", "params": {"tensor": 0}}}}


@pytest.mark.parametrize("mutate", [_skeleton_same, _narrow_inner_same], ids=["skeleton", "narrow_inner"])
def test_same_outside_a_tensors_stream_is_damage_not_a_newer_format(packed, tmp_path, mutate):
    """FORMAT.md 3.3: `same` is only ever a tensor's stream. A 1.4 reader knows the codec, so a
    skeleton or a narrow's inner naming it is a damaged file, not one 'written by a newer version'."""
    folder, data, _ = packed
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(rewrite_index(data, mutate))
    for name, read in _readers(bad, tmp_path / "r.onnx").items():
        with pytest.raises(CorruptFileError, match="same") as info:
            read()
        assert not isinstance(info.value, NewerFormatError), name


def test_a_chain_of_same_means_the_first_tensor(packed, tmp_path):
    """W3 names W2, itself `same` as W1: W3 is W1's payload (FORMAT.md 3.3), byte for byte."""
    folder, data, w = packed
    good = tmp_path / "chain.onnxz"
    good.write_bytes(rewrite_index(data, lambda o: o["tensors"][_at(o, "W3")]["stream"]["params"].update(tensor=_at(o, "W2"))))
    passes.onnxz.unpack(good, tmp_path / "r.onnx")
    assert (tmp_path / "r.onnx").read_bytes() == (folder / "m.onnx").read_bytes()
    with passes.onnxz.open_packed(good) as pm:
        np.testing.assert_array_equal(pm.get_tensor("W3"), w)


@pytest.mark.parametrize("case", ["other_length", "bool_index", "float_index", "huge_index", "declared_length"])
def test_a_lying_same_is_refused_by_every_reader(packed, tmp_path, case):
    folder, data, _ = packed

    def mutate(o):
        if case == "other_length":  # S (8 KiB) same as W1 (16 KiB)
            o["tensors"][_at(o, "S")]["stream"] = {"codec": "same", "params": {"tensor": _at(o, "W1")}}
        elif case == "bool_index":  # True == 1 in Python: not an integer here
            o["tensors"][_at(o, "W3")]["stream"]["params"]["tensor"] = True
        elif case == "float_index":
            o["tensors"][_at(o, "W3")]["stream"]["params"]["tensor"] = 0.0
        elif case == "huge_index":
            o["tensors"][_at(o, "W3")]["stream"]["params"]["tensor"] = 10 ** 30
        else:  # W3's declared length 4 bytes short of W1's
            o["tensors"][_at(o, "W3")]["length"] -= 4

    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(rewrite_index(data, mutate))
    for name, read in _readers(bad, tmp_path / "r.onnx").items():
        with pytest.raises(CorruptFileError):
            read()


def test_a_fan_out_beyond_max_bytes_is_refused_from_the_index(tmp_path):
    """2000 tensors `same` as one 16 KiB payload restore 32 MB from a pack of ~60 KB: max_bytes
    bounds the restored total (the files' declared sizes), before anything is decoded."""
    w = np.random.default_rng(1).standard_normal((N, N)).astype(np.float32)
    inits = [numpy_helper.from_array(w, f"W{i}") for i in range(2000)]
    out = helper.make_node("Sum", [t.name for t in inits], ["y"])
    g = helper.make_graph([out], "g", [], [helper.make_tensor_value_info("y", 1, [N, N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, tmp_path / "m.onnx")
    passes.onnxz.pack(tmp_path / "m.onnx", tmp_path / "m.onnxz")
    size = (tmp_path / "m.onnxz").stat().st_size
    assert size < 200_000
    limit = 8 << 20
    for read in (lambda: passes.onnxz.unpack(tmp_path / "m.onnxz", tmp_path / "r.onnx", max_bytes=limit),
                 lambda: passes.load(tmp_path / "m.onnxz", max_bytes=limit),
                 lambda: passes.onnxz.open_packed(tmp_path / "m.onnxz", max_bytes=limit),
                 lambda: passes.onnxz.verify(tmp_path / "m.onnxz", max_bytes=limit),
                 lambda: passes.InferenceSession(str(tmp_path / "m.onnxz"), max_bytes=limit),
                 lambda: passes.InferenceSession(str(tmp_path / "m.onnxz"), mode="int8", max_bytes=limit)):
        with pytest.raises(LimitExceededError, match="more than 8388608 bytes"):
            read()
    with passes.onnxz.open_packed(tmp_path / "m.onnxz") as pm:
        np.testing.assert_array_equal(pm.get_tensor("W1999"), w)
