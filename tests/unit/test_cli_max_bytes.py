"""--max-bytes on every command that reads a model: compress and fold refuse a .onnxz restoring to more than
N bytes before decoding it, as pack / unpack / info / verify / eval do."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tools.surgeon_compress import build_parser, main


@pytest.fixture
def packed(tmp_path):
    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
        [numpy_helper.from_array(w, "W")],
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "m.onnxz"
    assert main(["pack", str(src), "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("command", ["compress", "fold"])
def test_max_bytes_refuses_a_pack_restoring_to_more(command, packed, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    capsys.readouterr()
    code = main([command, str(packed), "-o", str(out), "--max-bytes", "1000"])
    err = capsys.readouterr().err
    assert code == 1
    assert "restores to more than 1000 bytes" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert main([command, str(packed), "-o", str(out), "--max-bytes", "1000000"]) == 0


def test_every_command_reading_a_model_takes_max_bytes():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("compress", "fold", "info", "eval", "unpack", "verify"):
        assert "--max-bytes" in sub.choices[name]._option_string_actions, name
