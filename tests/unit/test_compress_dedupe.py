"""compress stores byte-identical weights once: the plain command (quantize_weights(dedupe=True)) and the auto
mode (its search merges them before measuring, so each is searched, quantized and stored once)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import passes
from tools.surgeon_compress import main


def tied_model(op="MatMul") -> onnx.ModelProto:
    """y = (x @ A) @ B with B a byte-identical copy of A (a weight exported once per reader);
    op="Gemm": Gemm(transB=1) nodes instead."""
    a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    attrs = {"transB": 1} if op == "Gemm" else {}
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "A"], ["h"], **attrs), helper.make_node(op, ["h", "B"], ["y"], **attrs)], "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 128])],
        [numpy_helper.from_array(a, "A"), numpy_helper.from_array(a.copy(), "B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n=8):
    return [{"x": np.random.default_rng(i).standard_normal((1, 128)).astype(np.float32)} for i in range(n)]


def _big_initializers(model):
    return sorted(t.name for t in model.graph.initializer if np.prod(t.dims) >= 128 * 128)


def test_the_auto_mode_stores_a_weight_stored_twice_once():
    m = tied_model()
    before = m.SerializeToString()
    out, record = passes.compress(m, target="cosine>=0.999", feeds=_feeds())
    assert m.SerializeToString() == before  # the caller's model is not changed
    assert record["met_on_feeds"]
    assert any("2 identical weights stored once: B -> A" in n for n in record["notes"])
    assert len(_big_initializers(out)) == 1
    assert passes.parse_requirement("cosine>=0.999").check(passes.evaluate(m, out, feeds=_feeds()))


def test_the_command_stores_a_weight_stored_twice_once(tmp_path, capsys):
    src, out = tmp_path / "tied.onnx", tmp_path / "q.onnx"
    onnx.save(tied_model("Gemm"), str(src))
    assert main(["compress", str(src), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 identical weights stored once: B -> A" in printed
    assert len(_big_initializers(onnx.load(str(out)))) == 1


def test_the_command_keeps_equal_matmul_weights_apart_and_the_pack_stores_them_once(tmp_path, capsys):
    """Two equal MatMul weights keep a DequantizeLinear each (onnxruntime's MatMulNBits fusion
    needs levels read once); the .onnxz stores the equal levels and scales once."""
    src = tmp_path / "tied.onnx"
    onnx.save(tied_model(), str(src))
    assert main(["compress", str(src), "-o", str(tmp_path / "q.onnx")]) == 0
    assert "1 weight(s) equal to another kept apart (B)" in capsys.readouterr().out
    assert len(_big_initializers(onnx.load(str(tmp_path / "q.onnx")))) == 2
    assert main(["compress", str(src), "-o", str(tmp_path / "q.onnxz")]) == 0
    with passes.open_packed(tmp_path / "q.onnxz") as p:
        codecs = {t["name"]: t["codec"] for t in p.metadata()["tensors"]}
    assert codecs["B_quantized"] == "same", codecs
