"""info / describe_model of a model whose external data offset or length is malformed or negative:
InvalidModelError in the words every reader of the data uses (_fileio.ExternalRanges), one line
and the usual error exit in the command, not an internal error (int() of 'x1' raised ValueError)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from passes.errors import InvalidModelError
from passes.inspect import describe_model
from tools.surgeon_compress import main


def _model(folder, offset, length):
    (folder / "w.bin").write_bytes(np.arange(1024, dtype=np.float32).tobytes())
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[1024], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "w.bin"), ("offset", offset), ("length", length)):
        if v is not None:
            e = t.external_data.add()
            e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [t])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save_model(m, folder / "model.onnx")
    return folder / "model.onnx"


BAD = [
    ("abc", "4096", "tensor 'W' has a malformed external data offset or length"),
    ("0", "x1", "tensor 'W' has a malformed external data offset or length"),
    ("abc", None, "tensor 'W' has a malformed external data offset or length"),
    ("-8", "4096", r"tensor 'W' declares external data bytes -8\.\.4088: a negative offset or length"),
    ("0", "-5", r"tensor 'W' declares external data bytes 0\.\.-5: a negative offset or length"),
]


@pytest.mark.parametrize("offset,length,match", BAD)
def test_describe_model_refuses_a_malformed_range(tmp_path, offset, length, match):
    with pytest.raises(InvalidModelError, match=match):
        describe_model(_model(tmp_path, offset, length))


@pytest.mark.parametrize("offset,length,match", BAD)
def test_info_gives_one_line_and_the_error_exit(tmp_path, capsys, offset, length, match):
    code = main(["info", str(_model(tmp_path, offset, length))])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("surgeon-compress: error: tensor 'W'")


def test_info_of_a_well_formed_range_reports_its_length(tmp_path):
    desc = describe_model(_model(tmp_path, "0", "4096"))
    assert [r.bytes for r in desc.rows] == [4096] and desc.external_files == ["w.bin"]
    desc = describe_model(_model(tmp_path, None, None))  # no length: from its dims
    assert [r.bytes for r in desc.rows] == [4096]
