"""float64 weights are quantized: DequantizeLinear has no float64 output, so they take
bfloat16's form, levels + float32 scale -> DequantizeLinear -> W_dequantized -> Cast(to=DOUBLE) -> W
(float32 -> float64 is exact). Checked: onnx.checker's full check, onnxruntime runs it, the output
SNR against the float64 model, and fold_dequantize gives back float64 weights equal to what
onnxruntime's DequantizeLinear + Cast compute, bit for bit."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import passes
from tools.surgeon_compress import main

# output SNR floors against the float64 model (measured on this seeded model: int8 per channel 40.4 dB,
# asymmetric 40.6, per tensor 36.8, int4 blocks of 32 17.5; the float32 copy of it: 39.2, 39.4, 36.4, 17.5)
FORMS = {
    "int8_channel": (dict(bits=8, granularity="channel"), 38.0),
    "int8_tensor": (dict(bits=8, granularity="tensor"), 35.0),
    "int8_channel_asym": (dict(bits=8, granularity="channel", symmetric=False), 38.0),
    "int4_block32": (dict(bits=4, granularity="block", block_size=32), 16.0),
}


def _float64_model(opset: int = 13) -> onnx.ModelProto:
    """x[8, 128] (float64) -> MatMul W1[128, 256] + b1 -> Relu -> MatMul W2[256, 64]: a float64
    model (scikit-learn / scientific exports compute in double)."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.normal(0, 0.1, (128, 256)), "W1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (256,)), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (256, 64)), "W2")]
    assert all(t.data_type == TP.DOUBLE for t in inits)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["hr"]), helper.make_node("MatMul", ["hr", "W2"], ["y"])]
    g = helper.make_graph(nodes, "f64", [helper.make_tensor_value_info("x", TP.DOUBLE, [8, 128])],
                          [helper.make_tensor_value_info("y", TP.DOUBLE, [8, 64])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _feeds():
    return {"x": np.random.default_rng(1).normal(size=(8, 128))}


def _run(model: onnx.ModelProto, feeds: dict, names=None, optimize: bool = True) -> list:
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(names, feeds)


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_float64_weights_are_quantized_and_run(form):
    opts, floor = FORMS[form]
    m = _float64_model()
    report = passes.Report()
    q = passes.quantize_weights(m, report=report, **opts)
    onnx.checker.check_model(q, full_check=True)
    assert not any("float64" in n for n in report.notes)  # the old "stay float" note is gone
    dqs = {n.output[0]: n for n in q.graph.node if n.op_type == "DequantizeLinear"}
    casts = {n.output[0]: n for n in q.graph.node if n.op_type == "Cast"}
    inits = {t.name: t for t in q.graph.initializer}
    for w in ("W1", "W2"):
        assert w not in inits
        cast = casts[w]
        assert helper.get_attribute_value(cast.attribute[0]) == TP.DOUBLE
        dq = dqs[cast.input[0]]
        assert inits[dq.input[1]].data_type == TP.FLOAT  # float32 scales
        assert inits[dq.input[0]].data_type in (TP.INT8, TP.UINT8, TP.INT4, TP.UINT4)
    assert inits["b1"].data_type == TP.DOUBLE  # a bias stays as it was
    rows = {r.name: r for r in report.tensors}
    assert rows["W1"].bytes_before == 128 * 256 * 8 and rows["W1"].bytes_after < rows["W1"].bytes_before / 6
    ref = _run(m, _feeds())[0]
    got = _run(q, _feeds())[0]
    assert got.dtype == np.float64
    assert _snr_db(ref, got) > floor


@pytest.mark.parametrize("form", sorted(FORMS))
def test_fold_gives_onnxruntimes_float64_weights_bit_for_bit(form):
    opts, _ = FORMS[form]
    q = passes.quantize_weights(_float64_model(), **opts)
    probe = onnx.ModelProto()
    probe.CopyFrom(q)
    probe.graph.output.extend(helper.make_tensor_value_info(w, TP.DOUBLE, None) for w in ("W1", "W2"))
    ort_w1, ort_w2 = _run(probe, _feeds(), ["W1", "W2"], optimize=False)
    folded = passes.fold_dequantize(q)
    assert not any(n.op_type in ("DequantizeLinear", "Cast") for n in folded.graph.node)
    inits = {t.name: t for t in folded.graph.initializer}
    for name, expected in (("W1", ort_w1), ("W2", ort_w2)):
        assert inits[name].data_type == TP.DOUBLE
        value = numpy_helper.to_array(inits[name])
        assert value.dtype == np.float64 and value.tobytes() == expected.tobytes()
    onnx.checker.check_model(folded, full_check=True)


def test_per_tensor_keeps_an_old_opset():
    """Per tensor, DequantizeLinear-10 (float32 scale) + Cast serve: an opset 11 model is not converted."""
    report = passes.Report()
    q = passes.quantize_weights(_float64_model(opset=11), granularity="tensor", report=report)
    assert q.opset_import[0].version == 11 and not any("opset raised" in n for n in report.notes)
    assert _snr_db(_run(_float64_model(opset=11), _feeds())[0], _run(q, _feeds())[0]) > 35.0


def test_commands_compress_info_fold(tmp_path, capsys):
    src, out, folded = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "f.onnx"
    onnx.save(_float64_model(), str(src))
    assert main(["compress", str(src), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 tensor(s) rewritten" in text and "float64" not in text
    assert out.stat().st_size < src.stat().st_size / 5
    assert main(["info", str(out)]) == 0
    capsys.readouterr()
    assert main(["fold", str(out), "-o", str(folded)]) == 0
    f = onnx.load(str(folded))
    assert {t.name: t.data_type for t in f.graph.initializer if t.name in ("W1", "W2")} == {"W1": TP.DOUBLE,
                                                                                           "W2": TP.DOUBLE}
    ref = _run(_float64_model(), _feeds())[0]
    assert _snr_db(ref, _run(f, _feeds())[0]) > 38.0


def test_constant_nodes_and_function_bodies():
    """A float64 weight in a main-graph Constant node and one in a model-local function body's
    Constant take the same form there; fold_dequantize gives the quantized model's outputs exactly."""
    rng = np.random.default_rng(3)
    body = [helper.make_node("Constant", [], ["Wf"], value=numpy_helper.from_array(rng.normal(0, .1, (64, 96)), "Wf")),
            helper.make_node("MatMul", ["a", "Wf"], ["b"])]
    fn = helper.make_function("local", "Dense", ["a"], ["b"], body, [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Dense", ["x"], ["h"], domain="local"),
             helper.make_node("Constant", [], ["Vc"], value=numpy_helper.from_array(rng.normal(0, .1, (96, 32)), "Vc")),
             helper.make_node("MatMul", ["h", "Vc"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.DOUBLE, [4, 64])],
                          [helper.make_tensor_value_info("y", TP.DOUBLE, [4, 32])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          functions=[fn])
    feeds = {"x": rng.normal(size=(4, 64))}
    report = passes.Report()
    q = passes.quantize_weights(m, report=report)
    onnx.checker.check_model(q, full_check=True)
    assert sorted((r.name, r.scheme) for r in report.tensors) == [("Vc", "int8/channel(axis=1)/sym"),
                                                                    ("Wf", "int8/channel(axis=1)/sym")]
    for nodes_of in (q.graph.node, q.functions[0].node):
        assert [n.attribute[0].i for n in nodes_of if n.op_type == "Cast"] == [TP.DOUBLE]
    ref, got = _run(m, feeds)[0], _run(q, feeds)[0]
    assert _snr_db(ref, got) > 35.0
    folded = passes.fold_dequantize(q)
    assert [n.op_type for n in folded.graph.node] == ["Dense", "Constant", "MatMul"]
    assert [n.op_type for n in folded.functions[0].node] == ["Constant", "MatMul"]
    assert _run(folded, feeds)[0].tobytes() == got.tobytes()
