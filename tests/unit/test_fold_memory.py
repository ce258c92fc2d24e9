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
