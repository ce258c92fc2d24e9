"""passes._fileio: atomic writes, safe model loading, external data."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes import FileAccessError, InvalidModelError
from passes._fileio import atomic_output, load_model, save_model, write_bytes_atomic


def _model(n=64):
    w = numpy_helper.from_array(np.arange(n * n, dtype=np.float32).reshape(n, n), "W")
    node = helper.make_node("MatMul", ["X", "W"], ["Y"])
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_atomic_write_refuses_existing_without_force(tmp_path):
    p = tmp_path / "out.bin"
    write_bytes_atomic(p, b"one")
    with pytest.raises(FileAccessError, match="exists"):
        write_bytes_atomic(p, b"two")
    assert p.read_bytes() == b"one"
    write_bytes_atomic(p, b"two", force=True)
    assert p.read_bytes() == b"two"


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    p = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_output(p) as f:
            f.write(b"partial")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileAccessError, match="does not exist"):
        write_bytes_atomic(tmp_path / "nope" / "out.bin", b"x")


def test_load_model_errors(tmp_path):
    with pytest.raises(FileAccessError, match="no such file"):
        load_model(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf \xff\xff\xff")
    with pytest.raises(InvalidModelError, match="not an ONNX model"):
        load_model(junk)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(InvalidModelError, match="not an ONNX model"):
        load_model(empty)


def test_external_data_round_trip(tmp_path):
    model = _model()
    p = tmp_path / "m.onnx"
    save_model(model, p, external_data=True)
    assert len(list(tmp_path.glob("m.onnx.*.data"))) == 1
    assert os.path.getsize(p) < 4096  # weights went to the data file
    onnx.checker.check_model(str(p), full_check=True)
    back = load_model(p)
    np.testing.assert_array_equal(
        numpy_helper.to_array(back.graph.initializer[0]), numpy_helper.to_array(model.graph.initializer[0])
    )
    # the caller's model was not changed by saving
    assert model.graph.initializer[0].data_location == TensorProto.DEFAULT


def test_external_data_outside_folder_refused(tmp_path):
    model = _model()
    t = model.graph.initializer[0]
    raw = t.raw_data
    (tmp_path / "secret.bin").write_bytes(raw)
    sub = tmp_path / "sub"
    sub.mkdir()
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", str(len(raw)))):
        e = t.external_data.add()
        e.key, e.value = k, v
    (sub / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(InvalidModelError, match="leaves the model's folder"):
        load_model(sub / "m.onnx")
    t.external_data[0].value = str(tmp_path / "secret.bin")
    (sub / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(InvalidModelError, match="absolute"):
        load_model(sub / "m.onnx")


def test_external_data_range_beyond_file(tmp_path):
    model = _model()
    p = tmp_path / "m.onnx"
    save_model(model, p, external_data=True)
    (data,) = tmp_path.glob("m.onnx.*.data")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(InvalidModelError, match="declares external data bytes"):
        load_model(p)


def test_external_data_ranges_read_many_times_refused(tmp_path, monkeypatch):
    """Tensors naming the same range over and over would multiply memory: refused, not read."""
    import passes._fileio as fileio

    monkeypatch.setattr(fileio, "_REREAD_ALLOWANCE", 1000)  # the real allowance is 64 MiB
    model = _model()
    p = tmp_path / "m.onnx"
    save_model(model, p, external_data=True)
    saved = onnx.load(str(p), load_external_data=False)
    copies = [onnx.TensorProto() for _ in range(3)]
    for i, c in enumerate(copies):
        c.CopyFrom(saved.graph.initializer[0])
        c.name = f"W{i}"
    saved.graph.initializer.extend(copies)
    p.write_bytes(saved.SerializeToString())
    with pytest.raises(InvalidModelError, match="external data ranges overlap"):
        load_model(p)


def test_outputs_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "out.bin", b"x")
        save_model(_model(), tmp_path / "m.onnx", external_data=True)
    finally:
        os.umask(old)
    for f in tmp_path.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o644, f


def test_same_file_by_inode_or_resolved_spelling(tmp_path):
    from passes._fileio import same_file

    a = tmp_path / "a.onnx"
    a.write_bytes(b"x")
    os.link(a, tmp_path / "hard.onnx")
    (tmp_path / "soft.onnx").symlink_to(a)
    assert same_file(a, tmp_path / "hard.onnx") and same_file(a, tmp_path / "soft.onnx")
    assert same_file(a, tmp_path / "sub" / ".." / "a.onnx")
    assert same_file(tmp_path / "new.onnx", tmp_path / "." / "new.onnx")  # not there yet: by spelling
    (tmp_path / "b.onnx").write_bytes(b"x")
    assert not same_file(a, tmp_path / "b.onnx") and not same_file(a, tmp_path / "new.onnx")


@pytest.mark.parametrize("empty", ["", b""])
def test_empty_path_is_named_as_such(tmp_path, empty, monkeypatch):
    """Path("") is the current folder: an empty path was reported as "'.': is a folder"."""
    import passes
    from passes._fileio import check_readable, check_writable

    monkeypatch.chdir(tmp_path)
    calls = [lambda: check_readable(empty), lambda: check_writable(empty, force=True)]
    if isinstance(empty, str):  # (the API's path arguments; bytes are refused as models before any path check)
        calls += [lambda: load_model(empty), lambda: save_model(_model(), empty, force=True), lambda: passes.load_feeds(empty)]
    for call in calls:
        with pytest.raises(FileAccessError, match="empty path"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_pack_and_unpack_name_an_empty_path(tmp_path, monkeypatch):
    import passes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.onnx").write_bytes(_model().SerializeToString())
    passes.pack(tmp_path / "m.onnx", tmp_path / "m.onnxz")
    for src, dst in (("", tmp_path / "r.onnx"), (tmp_path / "m.onnxz", ""), ((tmp_path / "m.onnxz").read_bytes(), "")):
        with pytest.raises(FileAccessError, match="empty path"):
            passes.unpack(src, dst)
    with pytest.raises(FileAccessError, match="empty path"):
        passes.pack(tmp_path / "m.onnx", "", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnxz"]
