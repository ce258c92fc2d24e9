"""save_model's spliced writing of big payloads (H7 F13): the file holds exactly the bytes
model.SerializeToString() gives, without building them in one piece; fold's output is unchanged."""
import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import _fileio


def _model(sizes, *, extras=True):
    rng = np.random.default_rng(0)
    inits, nodes, outputs = [], [], []
    for i, n in enumerate(sizes):
        t = numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"w{i}")
        if extras and i % 2:
            t.doc_string = "a doc string (field 12, after raw_data)"
            e = t.metadata_props.add()
            e.key, e.value = "k", "v"
        inits.append(t)
        nodes.append(helper.make_node("Identity", [f"w{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [n]))
    g = helper.make_graph(nodes, "g", [], outputs, inits, doc_string="graph doc")
    if extras:
        g.value_info.append(helper.make_tensor_value_info("y0", TensorProto.FLOAT, [sizes[0]]))
        m = g.metadata_props.add()
        m.key, m.value = "after", "initializers"
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")
    if extras:
        onnx.helper.set_model_props(model, {"a": "b"})
    return model


@pytest.mark.parametrize("extras", [False, True])
def test_spliced_save_writes_serialize_to_string_bytes(tmp_path, monkeypatch, extras):
    monkeypatch.setattr(_fileio, "SPLICE_MIN_BYTES", 4096)
    # small and big payloads mixed; lengths whose varints take 2, 3 and 4 bytes
    model = _model([10, 2000, 300_000, 7, 40_000, 5_000_000 // 4], extras=extras)
    assert _fileio._big_initializers(model)  # the spliced path is taken
    path = tmp_path / "m.onnx"
    passes.save_model(model, path)
    assert path.read_bytes() == model.SerializeToString()


def test_spliced_save_without_graph_fields_after_initializers(tmp_path, monkeypatch):
    monkeypatch.setattr(_fileio, "SPLICE_MIN_BYTES", 1)
    model = _model([1, 1000], extras=False)
    path = tmp_path / "m.onnx"
    passes.save_model(model, path)
    assert path.read_bytes() == model.SerializeToString()
    assert onnx.load(str(path)) == model or onnx.load(str(path)).SerializeToString() == model.SerializeToString()


def test_fold_of_a_big_table_writes_what_serialize_to_string_gives(tmp_path):
    # a 16 MiB+ int8 Gather table: the fold's own path (arrays freed before the payload goes into the
    # proto) and the spliced save; the file equals SerializeToString of fold_dequantize's model
    rng = np.random.default_rng(1)
    rows, cols = 40_000, 128
    table = rng.standard_normal((rows, cols)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"])], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, cols])],
                          [numpy_helper.from_array(table, "table")])
    src = tmp_path / "f.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    q = passes.quantize_weights(str(src))
    for dtype in (None, "float16"):
        folded = passes.fold_dequantize(q, dtype=dtype)
        out = tmp_path / f"out_{dtype}.onnx"
        passes.save_model(folded, out)
        data = out.read_bytes()
        assert hashlib.sha256(data).digest() == hashlib.sha256(folded.SerializeToString()).digest()
        assert len(data) > (16 << 20 if dtype is None else 8 << 20)
        w = numpy_helper.to_array(onnx.load(str(out)).graph.initializer[0])
        assert w.shape == (rows, cols)


def test_model_files_walks_the_wire_without_loading_the_model(tmp_path, monkeypatch):
    # size_on_disk (every command's "file a -> b" line) parsed the whole output with onnx.load_model:
    # 1 GB more for fold's 512 MB file, the command's peak; the wire walk reads only locations
    model = _model([10, 5000, 3000])
    single, split = tmp_path / "single.onnx", tmp_path / "split.onnx"
    passes.save_model(model, single)
    passes.save_model(model, split, external_data=True)

    def refused(*a, **k):
        raise AssertionError("model_files loaded the model")

    monkeypatch.setattr(onnx, "load_model", refused)
    monkeypatch.setattr(onnx, "load", refused)
    assert _fileio.model_files(single) == [single]
    files = _fileio.model_files(split)
    assert files[0] == split and len(files) == 2 and files[1].name.endswith(".data") and files[1].is_file()
    assert _fileio.size_on_disk(split) == split.stat().st_size + files[1].stat().st_size
    empty, junk = tmp_path / "empty.onnx", tmp_path / "junk.onnx"
    empty.write_bytes(b"")
    junk.write_bytes(b"\xff" * 64)
    assert _fileio.model_files(empty) == [empty] and _fileio.model_files(junk) == [junk]


def test_model_files_finds_external_data_of_subgraph_constants(tmp_path):
    # a Constant node inside an If branch with its data outside the model file
    data = tmp_path / "c.bin"
    data.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    t = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[4])
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "c.bin"), ("offset", "0"), ("length", "16")):
        e = t.external_data.add()
        e.key, e.value = k, v
    branch = helper.make_graph([helper.make_node("Constant", [], ["y"], value=t)], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    g = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)], "g",
                          [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(g).SerializeToString())
    assert _fileio.model_files(path) == [path, data]
