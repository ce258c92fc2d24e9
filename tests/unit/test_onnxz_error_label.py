"""Errors met while opening an .onnxz path name the file (two inputs, e.g. eval or verify
--against, or a CI log: 'truncated .onnxz file' alone does not say which); from bytes in memory
there is no name to give. Same classes as before."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import passes
from passes import CorruptFileError, LimitExceededError


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("label")
    w = (np.random.default_rng(2).standard_normal(20000) * 0.1).astype(np.float32)
    onnx.save_model(helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(w, "w")])), str(d / "m.onnx"))
    passes.pack(d / "m.onnx", d / "m.onnxz")
    return d / "m.onnxz"


def test_truncated_and_foreign_files_are_named(tmp_path, packed):
    data = packed.read_bytes()
    cases = {"half.onnxz": (data[:len(data) // 2], "truncated .onnxz file"),
             "foreign.onnxz": (b"not a pack at all" * 10, "not an .onnxz file"),
             "index.onnxz": (data[:-5] + bytes(5), "index")}
    for name, (content, what) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        readers = [passes.verify, passes.open_packed, lambda p: passes.unpack(p, tmp_path / "o.onnx")]
        if name != "foreign.onnxz":  # (load reads a file without the magic as an .onnx)
            readers.append(passes.load)
        for read in readers:
            with pytest.raises(CorruptFileError, match=what) as info:
                read(path)
            assert str(info.value).startswith(f"{path}: ") and str(info.value).count(str(path)) == 1
        with pytest.raises(CorruptFileError, match=what) as info:  # from memory: no name
            passes.open_packed(content)
        assert not str(info.value).startswith(str(tmp_path))


def test_limit_error_names_the_file_and_keeps_its_class(packed):
    with pytest.raises(LimitExceededError, match="restores to more than") as info:
        passes.open_packed(packed, max_bytes=100)
    assert str(info.value).startswith(f"{packed}: ")
