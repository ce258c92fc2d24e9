"""Models whose graph outputs are of a type onnxruntime does not hand to numpy as values.

onnxruntime's Python binding raises "No corresponding Numpy type" for bfloat16, float8 (but
e4m3fn), int4/uint4 outputs, and returns float8e4m3fn outputs as uint8 bit patterns. A bfloat16
LLM's logits, a float8 exporter's outputs: the fidelity gate must measure their values
(graph.numpy_readable_outputs casts them in the measuring copy), not refuse them, and not
compare float8 codes as numbers (-0.001 and +0.001 are 128 apart as codes).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes import graph
from tools.surgeon_compress import main

def matmul_then_cast(elem) -> onnx.ModelProto:
    """x [8, 64] -> MatMul W [64, 32] -> Cast to `elem` -> y."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.normal(size=(64, 32)) * 0.1).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Cast", ["m"], ["y"], to=elem)],
                          "cast_out", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                          [helper.make_tensor_value_info("y", elem, [8, 32])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.fixture(params=[TensorProto.FLOAT8E4M3FN, TensorProto.BFLOAT16, TensorProto.FLOAT8E5M2],
                ids=["float8e4m3fn", "bfloat16", "float8e5m2"])
def case(request, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(matmul_then_cast(request.param), str(path))
    rng = np.random.default_rng(1)
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, **{f"{i}/x": rng.normal(size=(8, 64)).astype(np.float32) for i in range(4)})
    return path, feeds


def value_snr(original, candidate, feeds) -> float:
    """SNR (dB) of y's values (cast to float32 by graph.numpy_readable_outputs), over every feed."""
    a, b = (ort.InferenceSession(graph.numpy_readable_outputs(onnx.load(str(p))).SerializeToString())
            for p in (original, candidate))
    signal = noise = 0.0
    for x in np.load(feeds).values():
        ya, yb = a.run(None, {"x": x})[0].astype(np.float64), b.run(None, {"x": x})[0]
        signal, noise = signal + float(np.sum(ya ** 2)), noise + float(np.sum((ya - yb) ** 2))
    return 10 * np.log10(signal / noise)


def test_require_measures_the_values_of_the_outputs(case, tmp_path, capsys):
    path, feeds = case
    out = tmp_path / "q.onnx"
    rc = main(["compress", str(path), "-o", str(out), "--feeds", str(feeds), "--require", "snr>=20", "--json"])
    assert rc == 0, capsys.readouterr().err
    metrics = json.loads(capsys.readouterr().out)["fidelity"]["metrics"]
    assert abs(metrics["snr"] - value_snr(path, out, feeds)) < 0.01
    assert metrics["maxabs"] < 1.0  # values of ~N(0, 0.8); codes differ by up to 128


def test_target_searches_such_a_model(case, tmp_path, capsys):
    path, feeds = case
    out = tmp_path / "t.onnx"
    assert main(["compress", str(path), "-o", str(out), "--feeds", str(feeds), "--target", "snr>=25"]) == 0, \
        capsys.readouterr().err
    assert value_snr(path, out, feeds) >= 25 - 0.01
