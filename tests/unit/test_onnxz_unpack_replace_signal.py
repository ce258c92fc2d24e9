"""unpack --force replacing a model and its data files as one set (_fileio.replace_together):
a Ctrl-C delivered while a rename is in the kernel is raised by Python right after os.replace
returns, the rename done. The old set must still come back whole (the old file of that rename
too), never the new file beside the old others."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import passes
import passes._fileio as fileio
import passes.onnxz

N = 4096


def _model(folder, seed):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    inits = []
    for name, location in (("A", "a.bin"), ("B", "b.bin")):
        (folder / location).write_bytes(rng.standard_normal(N).astype(np.float32).tobytes())
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[N], data_location=TensorProto.EXTERNAL)
        for k, v in (("location", location), ("offset", "0"), ("length", str(4 * N))):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
    g = helper.make_graph([helper.make_node("Add", ["A", "B"], ["y"])], f"g{seed}", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save_model(m, folder / "model.onnx")
    return folder / "model.onnx"


def _digests(folder):
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}


@pytest.mark.parametrize("at", [1, 2, 3])
def test_ctrl_c_right_after_a_rename_puts_the_whole_old_set_back(tmp_path, monkeypatch, at):
    passes.onnxz.pack(_model(tmp_path / "old", 1), tmp_path / "old.onnxz")
    passes.onnxz.pack(_model(tmp_path / "new", 2), tmp_path / "new.onnxz")
    out = tmp_path / "out"
    out.mkdir()
    passes.onnxz.unpack(tmp_path / "old.onnxz", out / "model.onnx")
    before = _digests(out)
    real, calls = os.replace, []

    def replace(a, b, *args, **kwargs):
        real(a, b, *args, **kwargs)
        if os.fspath(a).endswith(".part") and str(out) in os.fspath(b) and len(calls) < at:
            calls.append(b)
            if len(calls) == at:
                raise KeyboardInterrupt  # (the signal's handler runs as the call returns)

    monkeypatch.setattr(fileio.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        passes.onnxz.unpack(tmp_path / "new.onnxz", out / "model.onnx", force=True)
    monkeypatch.undo()
    assert _digests(out) == before
