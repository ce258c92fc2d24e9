"""A model past protobuf's 2 GiB limit, through the public paths (opt-in: SURGEON_BIG_MODEL=1).

Two float32 Gather tables of 1.125 GiB each in one external data file (2.42 GB; a sparse file, so
~8 MB on disk: a random head, zeros after). Measured on a 2-core, 23 GB host:
pack 15 s / 2.4 GB peak RSS (0.3% of the input), verify 9 s, unpack 2 s, compress int8 48 s / 5.4 GB,
fold back to float with external data 59 s / 5.7 GB, InferenceSession 22 s / 5.1 GB. Off by default:
minutes and ~6 GB of memory, more than the unit suite may take.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import passes
from tools.surgeon_compress import main

pytestmark = pytest.mark.skipif(os.environ.get("SURGEON_BIG_MODEL") != "1",
                                reason="opt-in (SURGEON_BIG_MODEL=1): minutes and ~6 GB of memory")

ROWS, COLS = 288 * 1024, 1024  # 1.125 GiB of float32 per table


def _write_big_model(folder: Path) -> Path:
    tables = []
    with open(folder / "w.bin", "wb") as f:
        for i, name in enumerate(("e1", "e2")):
            offset = f.tell()
            f.write(np.random.default_rng(i).normal(size=(1024, COLS)).astype(np.float32).tobytes())
            f.truncate(offset + ROWS * COLS * 4)
            f.seek(offset + ROWS * COLS * 4)
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[ROWS, COLS], data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "w.bin"), ("offset", str(offset)), ("length", str(ROWS * COLS * 4))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            tables.append(t)
    g = helper.make_graph([helper.make_node("Gather", ["e1", "ids"], ["g1"]), helper.make_node("Gather", ["e2", "ids"], ["g2"]),
                           helper.make_node("Add", ["g1", "g2"], ["y"])], "big",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, COLS])], tables)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    return folder / "model.onnx"


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return _write_big_model(tmp_path_factory.mktemp("big"))


def test_pack_unpack_verify(big, tmp_path):
    packed = tmp_path / "m.onnxz"
    assert main(["pack", str(big), "-o", str(packed)]) == 0
    assert packed.stat().st_size < 20_000_000
    assert main(["verify", str(packed), "--against", str(big)]) == 0
    (tmp_path / "back").mkdir()
    assert main(["unpack", str(packed), "-o", str(tmp_path / "back" / "model.onnx")]) == 0
    for name in ("model.onnx", "w.bin"):
        assert _sha(tmp_path / "back" / name) == _sha(big.parent / name)


def test_compress_fold_and_sessions(big, tmp_path):
    ids = {"ids": np.array([0, 1, 5, 1000])}
    expected = (np.random.default_rng(0).normal(size=(1024, COLS)).astype(np.float32)
                + np.random.default_rng(1).normal(size=(1024, COLS)).astype(np.float32))[ids["ids"]]
    packed, folded = tmp_path / "q.onnxz", tmp_path / "f.onnx"
    assert main(["compress", str(big), "-o", str(packed)]) == 0
    assert main(["fold", str(packed), "-o", str(folded)]) == 0
    assert folded.stat().st_size < 10_000  # the float tables went to an external data file
    for mode in ("fold", "int8"):
        y = passes.InferenceSession(str(packed), mode=mode).run(None, ids)[0]
        assert np.abs(y - expected).max() < 0.05


def test_require_measures_it(big, tmp_path):
    assert main(["compress", str(big), "-o", str(tmp_path / "r.onnxz"), "--require", "snr>=30"]) == 0
