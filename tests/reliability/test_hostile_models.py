"""Hostile ONNX files into the loader: every case is refused with a documented error (or loads
correctly), and no file outside the model's folder is ever opened.

The audit hook in _audit records every `open` the process makes while a case runs; reading
outside the model's folder fails the test even when the loader then raises the right error.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import FileAccessError, InvalidModelError, SurgeonError
from passes._fileio import load_model

from ._audit import outside, recording_opens
from ._models import matmul_model, nested_if_model_bytes

DOCUMENTED = SurgeonError


def _external_model(folder, location, offset=None, length=None, dims=(4,), name="W"):
    t = TensorProto(name=name, data_type=TensorProto.FLOAT)
    t.dims[:] = list(dims)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = t.external_data.add()
            entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Identity", [name], ["Y"])], "g", [],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(dims))], [t])
    path = folder / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


@pytest.fixture
def layout(tmp_path):
    """tmp/secret.bin (outside), tmp/m/ (the model's folder) with a valid data file and a subfolder."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes() * 4)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "ok.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (folder / "sub").mkdir()
    return tmp_path, folder, secret


def _load_refused(path, match=None):
    with recording_opens() as opened:
        with pytest.raises(DOCUMENTED) as info:
            load_model(path)
    assert not outside(opened, path.parent), f"opened outside the model's folder: {outside(opened, path.parent)}"
    if match:
        assert any(m in str(info.value) for m in match.split("|")), str(info.value)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("location", [
    "../secret.bin",
    "sub/../../secret.bin",
    "./../secret.bin",
    "sub/../../m/../secret.bin",
])
def test_external_path_leaving_the_folder(layout, location):
    _, folder, _ = layout
    err = _load_refused(_external_model(folder, location), "leaves the model's folder")
    assert isinstance(err, InvalidModelError)


def test_external_absolute_path(layout):
    _, folder, secret = layout
    for location in (str(secret), "/etc/passwd", "/dev/zero", "//etc/passwd"):
        _load_refused(_external_model(folder, location), "absolute")


def test_external_symlink_to_outside(layout):
    _, folder, secret = layout
    os.symlink(secret, folder / "link.bin")
    os.symlink("/dev/zero", folder / "zero.bin")
    _load_refused(_external_model(folder, "link.bin"), "leaves the model's folder")
    _load_refused(_external_model(folder, "zero.bin"), "leaves the model's folder")


def test_external_symlinked_subfolder_to_outside(layout):
    tmp, folder, _ = layout
    os.symlink(tmp, folder / "up")
    _load_refused(_external_model(folder, "up/secret.bin"), "leaves the model's folder")


def test_external_inside_loads(layout):
    _, folder, _ = layout
    with recording_opens() as opened:
        model = load_model(_external_model(folder, "sub/../ok.bin"))
    assert not outside(opened, folder)
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("offset, length, words", [
    ("0", str(1 << 40), "declares external data bytes"),      # far beyond the file
    (str(1 << 62), "16", "declares external data bytes"),
    ("-4", "4", "declares external data bytes"),
    ("0", "-1", "declares external data bytes"),
    ("abc", "16", "malformed"),
    ("0", "1e3", "malformed"),
    ("0x10", "4", "malformed"),
])
def test_external_ranges_beyond_the_file(layout, offset, length, words):
    _, folder, _ = layout
    _load_refused(_external_model(folder, "ok.bin", offset, length), words)


def test_external_missing_file(layout):
    _, folder, _ = layout
    _load_refused(_external_model(folder, "nope.bin"), "missing")


def test_external_location_with_nul_byte(layout):
    _, folder, _ = layout
    _load_refused(_external_model(folder, "ok.bin\0../../secret.bin"))


@pytest.mark.parametrize("location", [".", "sub"])
def test_external_location_is_a_folder(layout, location):
    _, folder, _ = layout
    _load_refused(_external_model(folder, location, "0", "0"))


def test_external_location_is_a_fifo(layout):
    _, folder, _ = layout
    fifo = folder / "pipe.bin"
    os.mkfifo(fifo)
    outcome = {}

    def attempt():
        try:
            load_model(_external_model(folder, "pipe.bin", "0", "0"))
            outcome["result"] = "loaded"
        except BaseException as exc:  # noqa: BLE001
            outcome["result"] = exc

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(2.0)
    hung = worker.is_alive()
    if hung:  # release the blocked open() so the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(5.0)
    assert not hung, "load_model blocked on a FIFO"
    assert isinstance(outcome["result"], DOCUMENTED)


def test_not_a_model(tmp_path):
    cases = {
        "empty.onnx": b"",
        "text.onnx": b"hello, this is not a model\n" * 10,
        "random.onnx": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "truncated.onnx": matmul_model(32).SerializeToString()[:-100],
        "zip.onnx": b"PK\x03\x04" + bytes(100),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InvalidModelError, match="not an ONNX model"):
            load_model(tmp_path / name)


def test_missing_and_folder_paths(tmp_path):
    with pytest.raises(FileAccessError):
        load_model(tmp_path / "absent.onnx")
    with pytest.raises(FileAccessError):
        load_model(tmp_path)


@pytest.mark.parametrize("depth", [5, 20])
def test_nested_subgraphs_within_limits_load(tmp_path, depth):
    path = tmp_path / "deep.onnx"
    path.write_bytes(nested_if_model_bytes(depth))
    model = load_model(path)
    graph, levels = model.graph, 0
    while graph.node and graph.node[0].op_type == "If":
        graph = next(a.g for a in graph.node[0].attribute if a.name == "then_branch")
        levels += 1
    assert levels == depth


@pytest.mark.parametrize("depth", [40, 1000, 3000])
def test_nested_subgraphs_beyond_parser_depth_refused(tmp_path, depth):
    """Nesting is bounded by protobuf's parse depth: a deeper file is refused, never recursed into."""
    path = tmp_path / "deep.onnx"
    path.write_bytes(nested_if_model_bytes(depth))
    with pytest.raises(InvalidModelError, match="not an ONNX model"):
        load_model(path)


def test_tensor_declaring_more_elements_than_it_holds_loads_without_allocating(tmp_path):
    """load_model itself does not expand tensors; a 2**40-element declaration costs nothing here
    (the passes must refuse it: see test_passes_hostile)."""
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, raw_data=b"\0" * 16)
    t.dims[:] = [1 << 20, 1 << 20]
    graph = helper.make_graph([helper.make_node("Identity", ["W"], ["Y"])], "g", [],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [t])
    path = tmp_path / "liar.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    model = load_model(path)
    assert len(model.graph.initializer[0].raw_data) == 16


def test_duplicate_external_references_read_each_once(layout):
    """Two tensors naming the same external range: both get the bytes, nothing else is read."""
    _, folder, _ = layout
    tensors = []
    for name in ("A", "A"):  # duplicate names too
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
        t.dims[:] = [4]
        for key, value in (("location", "ok.bin"), ("offset", "0"), ("length", "16")):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        tensors.append(t)
    graph = helper.make_graph([helper.make_node("Identity", ["A"], ["Y"])], "g", [],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])], tensors)
    path = folder / "dup.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    with recording_opens() as opened:
        model = load_model(path)
    assert not outside(opened, folder)
    for t in model.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), np.arange(4, dtype=np.float32))


def test_external_data_in_subgraph_constant_is_checked_too(layout):
    """A Constant inside an If branch pointing outside the folder is refused like an initializer."""
    _, folder, _ = layout
    t = TensorProto(name="c", data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    t.dims[:] = [4]
    entry = t.external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    branch = helper.make_graph([helper.make_node("Constant", [], ["y"], value=t)], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["Y"], then_branch=branch, else_branch=branch)], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])])
    path = folder / "sub.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    _load_refused(path, "leaves the model's folder")


@pytest.mark.parametrize("location", ["../secret.bin", "SECRET_ABS", "link.bin", "up/secret.bin", "ok.bin\0x", ".", "sub"])
def test_inference_session_refuses_external_data_outside(layout, location):
    """passes.InferenceSession maps external data itself (runtime_source): the same refusals."""
    tmp, folder, secret = layout
    os.symlink(secret, folder / "link.bin")
    os.symlink(tmp, folder / "up")
    loc = str(secret) if location == "SECRET_ABS" else location
    path = _external_model(folder, loc, "0", "16")
    passes.InferenceSession  # noqa: B018 - import it (and onnxruntime, which reads /usr/lib/os-release) first
    with recording_opens() as opened:
        with pytest.raises(InvalidModelError):
            passes.InferenceSession(path)
    assert not outside(opened, folder), outside(opened, folder)
