"""save_model's spliced writing of big payloads: the file holds exactly the bytes
model.SerializeToString() gives, without building them in one piece; fold's output is unchanged."""
import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.fold import fold_file
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


def _quantized_tables(tmp_path, shapes):
    rng = np.random.default_rng(2)
    nodes, inits, outs, feeds = [], [], [], []
    for i, (rows, cols) in enumerate(shapes):
        inits.append(numpy_helper.from_array(rng.standard_normal((rows, cols)).astype(np.float32), f"t{i}"))
        nodes.append(helper.make_node("Gather", [f"t{i}", f"ids{i}"], [f"y{i}"]))
        feeds.append(helper.make_tensor_value_info(f"ids{i}", TensorProto.INT64, [3]))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [3, cols]))
    src = tmp_path / "src.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", feeds, outs, inits),
                                opset_imports=[helper.make_opsetid("", 17)]), str(src))
    q = tmp_path / "q.onnx"
    passes.save_model(passes.quantize_weights(str(src)), q)
    return q


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_fold_file_writes_what_fold_then_save_writes(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(_fileio, "SPLICE_MIN_BYTES", 20_000)  # two of the three tables kept out of protobuf
    q = _quantized_tables(tmp_path, [(300, 64), (10, 16), (200, 128)])
    want, got = tmp_path / "want.onnx", tmp_path / "got.onnx"
    r1, r2 = passes.Report(), passes.Report()
    passes.save_model(passes.fold_dequantize(str(q), dtype=dtype, report=r1), want)
    written = fold_file(str(q), got, dtype=dtype, report=r2)
    assert got.read_bytes() == want.read_bytes()
    assert r1.to_dict() == r2.to_dict()
    assert sum(not t.HasField("raw_data") for t in written.graph.initializer) == 2  # the big ones' bytes: file only


def test_fold_file_with_external_data_writes_what_fold_then_save_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(_fileio, "SPLICE_MIN_BYTES", 20_000)
    monkeypatch.setattr(_fileio, "EXTERNAL_DATA_THRESHOLD", 50_000)
    q = _quantized_tables(tmp_path, [(300, 64), (10, 16), (200, 128)])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want, got = tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx"
    passes.save_model(passes.fold_dequantize(str(q)), want)
    fold_file(str(q), got)
    assert got.read_bytes() == want.read_bytes()  # (the data file's name is its digest: equal content)
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == sorted(f.name for f in (tmp_path / "b").iterdir())
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()


def test_fold_file_refuses_an_existing_output_before_folding(tmp_path):
    q = _quantized_tables(tmp_path, [(10, 16)])
    out = tmp_path / "out.onnx"
    out.write_bytes(b"keep")
    with pytest.raises(passes.FileAccessError):
        fold_file(str(q), out)
    assert out.read_bytes() == b"keep"


@pytest.mark.parametrize("narrow", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 999, 1000, 1001, 4321])
def test_narrowed_in_place_equals_astype(monkeypatch, narrow, n):
    from passes import fold
    from passes.graph import NUMPY_TYPES

    monkeypatch.setattr(fold, "_BLOCK", 1000)
    dt = NUMPY_TYPES[getattr(TensorProto, narrow.upper())]
    value = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32) * 50
    want = value.astype(dt)
    got = fold._narrowed(value.copy(), dt)
    assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    view = value[:, :2]  # not its own buffer: a copy, the input left as it is
    kept = view.copy()
    assert fold._narrowed(view, dt).tobytes() == kept.astype(dt).tobytes()
    assert np.array_equal(view, kept)


def test_fold_in_blocks_writes_the_same_files(tmp_path, monkeypatch):
    # the blocked checks and the in-place narrowing over many blocks: the same bytes and report as one block
    from passes import fold

    q = _quantized_tables(tmp_path, [(300, 64), (10, 16), (200, 128)])
    outs = {}
    for block in (1 << 20, 777):
        monkeypatch.setattr(fold, "_BLOCK", block)
        for dtype in ("float16", "bfloat16"):
            r = passes.Report()
            path = tmp_path / f"{block}_{dtype}.onnx"
            fold_file(str(q), path, dtype=dtype, report=r)
            outs.setdefault(dtype, []).append((path.read_bytes(), r.to_dict()))
    for dtype, (a, b) in outs.items():
        assert a == b, dtype


def test_save_of_a_tensor_whose_raw_data_disagrees_with_its_dims(tmp_path, monkeypatch):
    # dims say 2 floats, raw_data holds 40,000 bytes (a damaged model save_model is still asked to write):
    # written the plain way, and a big int4 tensor (no numpy type: its length read) spliced
    monkeypatch.setattr(_fileio, "SPLICE_MIN_BYTES", 4096)
    model = _model([10, 3000], extras=False)
    model.graph.initializer[0].raw_data = b"\1" * 40_000
    model.graph.initializer[0].ClearField("dims")
    model.graph.initializer[0].dims.extend([2])
    t4 = model.graph.initializer.add()
    t4.name, t4.data_type = "w4", TensorProto.INT4
    t4.dims.extend([20_000])
    t4.raw_data = b"\x21" * 10_000
    assert set(_fileio._big_initializers(model)) == {1, 2}
    path = tmp_path / "m.onnx"
    passes.save_model(model, path)
    assert path.read_bytes() == model.SerializeToString()
