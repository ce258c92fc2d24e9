"""include= / --include naming a weight that is also a graph input (IR >= 4; torch's
keep_initializers_as_inputs=True) quantizes it: its input listing is removed, with a note saying the
model's interface changed (a feed can no longer override it). Only weights named by name; an op-type
pattern or no include= leaves every listing as it is."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import passes
from modelgen import listed_weights_model
from tools.surgeon_compress import main


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


X = {"x": np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)}


def _snr_db(ref, got) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2))


def test_a_named_listed_weight_is_unlisted_and_quantized():
    m = listed_weights_model()
    report = passes.Report()
    q = passes.quantize_weights(m, include=["W1"], report=report)
    onnx.checker.check_model(q, full_check=True)
    assert [v.name for v in q.graph.input] == ["x", "b1", "W2"]  # only W1's listing went
    assert [v.name for v in m.graph.input] == ["x", "W1", "b1", "W2"]  # the input is not modified
    inits = {t.name for t in q.graph.initializer}
    assert "W1" not in inits and "W1_quantized" in inits and "W2" in inits
    dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert [n.output[0] for n in dq] == ["W1"]
    assert ("1 weight(s) named by include were also listed as graph inputs: unlisted (W1), so they are constants of "
            "the compressed model, quantized, and can no longer be overridden by a feed") in report.notes
    # W2 is still listed, float, and named in the kept-as-input note
    assert any(n.startswith("1 float weight(s) (10.0 kB) also listed as graph inputs") and "W2" in n
               for n in report.notes)
    assert _snr_db(_run(m, X), _run(q, X)) > 35.0
    # the weight left listed is still overridable by a feed, as in the input model
    w2 = np.zeros((256, 10), np.float32)
    assert np.array_equal(_run(q, {**X, "W2": w2}), np.zeros((2, 10), np.float32))


@pytest.mark.parametrize("include", [None, ["MatMul"], ["W9"]])
def test_listings_stay_unless_a_weight_is_named(include):
    m = listed_weights_model()
    report = passes.Report()
    q = passes.quantize_weights(m, include=include, report=report)
    assert [v.name for v in q.graph.input] == ["x", "W1", "b1", "W2"]
    assert not any(n.op_type == "DequantizeLinear" for n in q.graph.node)
    assert not any("unlisted" in n for n in report.notes)


def test_exclude_wins_over_include():
    q = passes.quantize_weights(listed_weights_model(), include=["W*"], exclude=["W2"])
    assert [v.name for v in q.graph.input] == ["x", "b1", "W2"]
    assert [n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"] == ["W1"]


def test_pattern_names_several_and_the_command_says_so(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(listed_weights_model(), str(src))
    assert main(["compress", str(src), "-o", str(out), "--include", "W*"]) == 0
    text = capsys.readouterr().out
    assert "2 weight(s) named by include were also listed as graph inputs: unlisted (W1, W2)" in text
    q = onnx.load(str(out))
    assert [v.name for v in q.graph.input] == ["x", "b1"]
    assert sorted(n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear") == ["W1", "W2"]
    assert out.stat().st_size < src.stat().st_size / 2
    assert _snr_db(_run(listed_weights_model(), X), _run(q, X)) > 35.0
