"""Classifiers whose output 0 is the predicted label (integer or string, one per row) beside their
probabilities: top1 is the fraction of equal labels, cosine and snr read the probabilities.

Before, top1 took the argmax of the label vector (across the batch: a gate passed a model whose
labels agreed on 77% of rows), and string labels, coded as CRC-32 numbers, drowned the
probabilities' noise in snr and cosine."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.fidelity import compute_metrics, run_outputs


def _classifier(strings: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((32, 5)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
             helper.make_node("ArgMax", ["logits"], ["index"], axis=1, keepdims=0)]
    label_type = TensorProto.INT64
    if strings:
        nodes.append(helper.make_node("LabelEncoder", ["index"], ["label"], domain="ai.onnx.ml",
                                      keys_int64s=[0, 1, 2, 3, 4], values_strings=["a", "b", "c", "d", "e"]))
        label_type = TensorProto.STRING
    else:
        nodes.append(helper.make_node("Identity", ["index"], ["label"]))
    g = helper.make_graph(nodes, "clf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                          [helper.make_tensor_value_info("label", label_type, ["n"]),
                           helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["n", 5])], [w])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("ai.onnx.ml", 2)] if strings else [])
    return helper.make_model(g, opset_imports=opsets)


def _feeds(n=8, rows=16):
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal((rows, 32)).astype(np.float32)} for _ in range(n)]


def _snr(a, b):
    return 10 * np.log10(np.sum(a.astype(np.float64) ** 2) / np.sum((a.astype(np.float64) - b) ** 2))


@pytest.mark.parametrize("strings", [False, True])
def test_labels_are_compared_as_labels_and_probabilities_measured(strings):
    m = _classifier(strings)
    q = passes.quantize_weights(m, bits=2, min_elements=16)
    feeds = _feeds()
    ref, got = run_outputs(m, feeds), run_outputs(q, feeds)
    agree = np.mean(np.concatenate([np.asarray(a[0]) == np.asarray(b[0]) for a, b in zip(ref, got)]))
    probs_ref = np.concatenate([a[1] for a in ref])
    probs_got = np.concatenate([b[1] for b in got])
    assert 0.3 < agree < 0.99  # 2 bits moved some labels: the case the gate must see
    result = passes.evaluate(m, q, feeds=feeds)
    assert result.metrics["top1"] == pytest.approx(agree)
    assert result.metrics["snr"] == pytest.approx(_snr(probs_ref, probs_got), abs=1e-6)
    pairs = [(a[1].astype(np.float64).ravel(), b[1].astype(np.float64).ravel()) for a, b in zip(ref, got)]
    cos = [x @ y / np.linalg.norm(x) / np.linalg.norm(y) for x, y in pairs]
    assert result.metrics["cosine"] == pytest.approx(np.mean(cos), abs=1e-9)
    assert result.metrics["maxabs"] > 0.5  # a changed label still shows
    assert any("'label' hold class labels" in n and "cosine reads output 1 ('probs')" in n for n in result.notes)
    with pytest.raises(passes.FidelityError) as caught:
        passes.enforce(result, passes.parse_requirements("top1>=0.99, snr>=-100"))
    # what a CI script reports without parsing the message: the result and each requirement missed
    assert caught.value.result is result
    assert [(str(req), value) for req, value in caught.value.failed] == [("top1>=0.99", pytest.approx(agree))]


def test_a_model_of_labels_only_is_still_measured():
    """With no other output to read, a label vector stays in cosine and snr (else snr would read as
    infinite whatever changed)."""
    m = _classifier(False)
    del m.graph.output[1]
    q = passes.quantize_weights(m, bits=2, min_elements=16)
    feeds = _feeds()
    metrics = compute_metrics(run_outputs(m, feeds), run_outputs(q, feeds))
    assert metrics["top1"] < 0.99 and np.isfinite(metrics["snr"]) and metrics["cosine"] < 1.0


def test_scores_per_class_keep_the_argmax():
    """An integer output with a class axis (a fully quantized classifier's uint8 scores [n, C]) is
    compared by argmax over the classes, as before."""
    a = np.array([[1, 9, 3], [7, 2, 2]], np.uint8)
    b = np.array([[1, 2, 9], [7, 2, 2]], np.uint8)
    assert compute_metrics([[a]], [[b]])["top1"] == 0.5
