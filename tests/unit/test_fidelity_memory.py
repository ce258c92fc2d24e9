"""evaluate / runnable_feeds given a model's path read its structure without the external data and let
onnxruntime load the file itself (it memory-maps external data), and the compress command's --require check
runs the original from its file after letting its loaded copy go (before, a 2.25 GB table peaked at 6.35 GB,
the original's serialised copy and onnxruntime's copy of it beside the loaded model)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import passes
import passes._fileio
from passes import fidelity as F
from tools.surgeon_compress import main

ROWS, DIM = 3000, 32


def table_model(tmp_path, name="model.onnx"):
    """ids [b, s] -> ReduceMean(Gather(table [ROWS, DIM])) with the table in an external data file."""
    table = (np.random.default_rng(0).standard_normal((ROWS, DIM)) * 0.05).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]),
         helper.make_node("ReduceMean", ["e"], ["y"], axes=[1], keepdims=0)], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", DIM])],
        [onnx.numpy_helper.from_array(table, "table")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    path = tmp_path / name
    onnx.save_model(m, str(path), save_as_external_data=True, location=name + ".data", size_threshold=0)
    return path, m


def feeds(n=3):
    rng = np.random.default_rng(1)
    return [{"ids": rng.integers(0, ROWS, (2, 5)).astype(np.int64)} for _ in range(n)]


@pytest.fixture
def no_external_loads(monkeypatch):
    """Fails a test that reads external data into protobuf; the loads it allows come after `allow()`."""
    real = passes._fileio.load_external_data
    state = {"allowed": False}

    def guarded(model, base_dir):
        if not state["allowed"]:
            raise AssertionError("external data read into protobuf")
        return real(model, base_dir)

    monkeypatch.setattr(passes._fileio, "load_external_data", guarded)
    return state


def test_evaluate_of_a_path_runs_the_file_without_loading_its_external_data(tmp_path, no_external_loads):
    path, _ = table_model(tmp_path)
    no_external_loads["allowed"] = True
    loaded = passes.load_model(path)
    candidate = passes.quantize_weights(loaded, bits=8)
    no_external_loads["allowed"] = False
    from_path = F.evaluate(str(path), candidate, feeds=feeds())
    from_proto = F.evaluate(loaded, candidate, feeds=feeds())
    assert from_path.metrics == from_proto.metrics
    assert 0.999 < from_path.metrics["cosine"] < 1.0
    structure = F.model_structure(str(path))
    assert structure.graph.initializer[0].data_location == TensorProto.EXTERNAL


def test_runnable_feeds_of_a_path_without_loading_its_external_data(tmp_path, no_external_loads):
    path, model = table_model(tmp_path)
    got = F.runnable_feeds(str(path), n=2)
    no_external_loads["allowed"] = True
    want = F.runnable_feeds(passes.load_model(path), n=2)
    assert [sorted(f) for f in got] == [sorted(f) for f in want]
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(got, want) for k in a)
    # evaluate without feeds synthesises them the same way from the path
    no_external_loads["allowed"] = False
    res = F.evaluate(str(path), str(path))
    assert res.synthesized and res.metrics["cosine"] == pytest.approx(1.0)


def test_a_packed_original_is_decoded_once_for_its_structure_and_run(tmp_path):
    path, model = table_model(tmp_path)
    packed = tmp_path / "m.onnxz"
    assert main(["pack", str(path), "-o", str(packed)]) == 0
    assert not F.runs_from_file(str(packed)) and F.runs_from_file(str(path))
    res = F.evaluate(str(packed), str(path), feeds=feeds())
    assert res.metrics["cosine"] == pytest.approx(1.0)


@pytest.mark.parametrize("pack_input", [False, True])
def test_compress_require_checks_the_original_from_its_file(tmp_path, monkeypatch, capsys, pack_input):
    """The command's check gets the input's path (a plain file) or the loaded model (a pack), and its
    figures are those of evaluate on the loaded model."""
    path, _ = table_model(tmp_path)
    src = path
    if pack_input:
        src = tmp_path / "in.onnxz"
        assert main(["pack", str(path), "-o", str(src)]) == 0
        capsys.readouterr()
    np.savez(tmp_path / "feeds.npz", **{f"{i}/ids": f["ids"] for i, f in enumerate(feeds())})
    seen = []
    real = F.evaluate

    def recording(original, candidate, **kw):
        seen.append(original)
        return real(original, candidate, **kw)

    monkeypatch.setattr(F, "evaluate", recording)
    out = tmp_path / "q.onnx"
    rc = main(["compress", str(src), "-o", str(out), "--feeds", str(tmp_path / "feeds.npz"),
               "--require", "cosine>=0.99", "--json"])
    assert rc == 0, capsys.readouterr().err
    assert len(seen) == 1
    assert isinstance(seen[0], onnx.ModelProto) if pack_input else seen[0] == str(src)
    report = json.loads(capsys.readouterr().out)
    want = real(passes.load_model(path), passes.load_model(out), feeds=feeds()).metrics
    assert report["fidelity"]["metrics"]["cosine"] == pytest.approx(want["cosine"])
    assert report["gate"]["passed"]


@pytest.mark.parametrize("location, message", [("../secret.bin", "leaves the model's folder"),
                                               ("missing.bin", "missing"), ("short.bin", "holds 8 bytes")])
def test_a_path_whose_external_data_load_model_refuses_is_refused_alike(tmp_path, location, message):
    """model_structure checks the external locations as load_model does before reading (the data itself is
    onnxruntime's to read): a location outside the model's folder, a missing file, a range past its end."""
    (tmp_path / "secret.bin").write_bytes(np.ones(16, np.float32).tobytes())
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "short.bin").write_bytes(b"12345678")
    t = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4, 4], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", location), ("offset", "0"), ("length", "64")):
        e = t.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [t])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    (sub / "m.onnx").write_bytes(m.SerializeToString())
    with pytest.raises(passes.errors.InvalidModelError, match=message):
        F.evaluate(str(sub / "m.onnx"), str(sub / "m.onnx"), feeds=[{"x": np.ones((1, 4), np.float32)}])


def test_many_tensors_naming_one_range_are_refused_as_load_model_refuses_them(tmp_path):
    """ExternalRanges' bound (the bytes named by all tensors at most the files' bytes + 64 MiB): 100 tensors
    naming one 1 MiB range are refused by the path's structure check as by load_model."""
    n = 1 << 18  # float32 values: 1 MiB
    with open(tmp_path / "w.bin", "wb") as f:
        f.truncate(4 * n)  # (sparse)
    inits = []
    for i in range(100):
        t = onnx.TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[n], data_location=TensorProto.EXTERNAL)
        for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(4 * n))):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
    g = helper.make_graph([helper.make_node("Sum", ["x"] + [t.name for t in inits], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], inits)
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    with pytest.raises(passes.errors.InvalidModelError, match="overlap"):
        passes.load_model(path)
    with pytest.raises(passes.errors.InvalidModelError, match="overlap"):
        F.model_structure(str(path))
