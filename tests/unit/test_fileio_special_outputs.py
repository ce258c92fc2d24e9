"""Outputs are renamed over their path whole: an existing device node, pipe or socket there is
refused by every writer of the library (save_model, pack, unpack), even with force=True, and is
left as it was."""
from __future__ import annotations

import os
import socket
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import FileAccessError


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(params=["fifo", "socket"])
def special(request, tmp_path):
    path = tmp_path / f"out.{request.param}"
    if request.param == "fifo":
        os.mkfifo(path)
        yield path, "a pipe"
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        yield path, "a socket"
        s.close()


def _unchanged(path, kind):
    mode = os.lstat(path).st_mode
    assert (stat.S_ISFIFO(mode) if kind == "a pipe" else stat.S_ISSOCK(mode))


def test_save_model_refuses_special_file(special):
    path, kind = special
    with pytest.raises(FileAccessError, match=f"is {kind}, not a regular file"):
        passes.save_model(_model(), path, force=True)
    _unchanged(path, kind)


def test_pack_and_unpack_refuse_special_file(special, tmp_path):
    path, kind = special
    src = tmp_path / "m.onnx"
    onnx.save(_model(), src)
    with pytest.raises(FileAccessError, match=f"is {kind}, not a regular file"):
        passes.pack(src, path, force=True)
    _unchanged(path, kind)
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed)
    with pytest.raises(FileAccessError, match=f"is {kind}, not a regular file"):
        passes.unpack(packed, path, force=True)
    _unchanged(path, kind)


def test_link_to_regular_file_is_replaced(tmp_path):
    target = tmp_path / "real.onnx"
    target.write_bytes(b"old")
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    passes.save_model(_model(), link, force=True)
    assert onnx.load(link).graph.node[0].op_type == "MatMul"


# Inputs: a device, pipe or socket is refused before it is read (`info /dev/zero` read until the
# memory ran out; `cat m.onnx | info /dev/stdin` lost the 8 bytes looked at for the pack magic
# and said "not an ONNX model").

def test_special_inputs_are_refused_before_reading(special, tmp_path):
    path, kind = special
    for read in (passes.load_model, passes.describe_model, lambda p: passes.load_feeds(p)):
        with pytest.raises(FileAccessError, match=f"is {kind}, not a regular file"):
            read(path)
    assert stat.S_ISFIFO(os.stat(path).st_mode) or stat.S_ISSOCK(os.stat(path).st_mode)


def test_endless_device_input_is_one_line_error(capsys):
    from tools.surgeon_compress import main

    for argv in (["info", "/dev/zero"], ["eval", "/dev/zero", "/dev/zero"], ["unpack", "/dev/zero", "-o", "/dev/null"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert err == "surgeon-compress: error: /dev/zero is a character device, not a regular file: " \
                      "inputs are read from files (save it to one first)", err
