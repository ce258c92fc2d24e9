"""Fidelity of models onnxruntime has no kernels for (opset 6 and older): measured raised to
opset 13, only once the raised model is checked against onnx's reference evaluator of the
original (tools/legacy_opset.py). Where the check fails, nothing is measured raised: onnxruntime's
own refusal stands."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tools import legacy_opset
from tools.surgeon_compress import main


def opset6_gemm_model() -> onnx.ModelProto:
    """x [2, 48] -> Gemm(W [32, 48], b [32], transB, broadcast) -> Relu -> y, IR 3 / opset 6 as
    PyTorch 0.3 wrote it (initializers also listed as graph inputs)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(32, 48)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.normal(size=(32,)).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1, broadcast=1),
         helper.make_node("Relu", ["h"], ["y"])], "legacy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 48]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [32, 48]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    model.ir_version = 3
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def legacy(tmp_path):
    path = tmp_path / "legacy.onnx"
    onnx.save(opset6_gemm_model(), str(path))
    feeds = tmp_path / "feeds.npz"
    rng = np.random.default_rng(1)
    np.savez(feeds, **{f"{i}/x": rng.normal(size=(2, 48)).astype(np.float32) for i in range(3)})
    return path, feeds


def test_onnxruntime_cannot_run_the_original(legacy):
    """The premise: without the raise there is nothing to compare with."""
    assert "NOT_IMPLEMENTED" in legacy_opset.onnxruntime_refusal(onnx.load(str(legacy[0])))


def test_require_is_measured_on_the_raised_original_and_says_so(legacy, tmp_path, capsys):
    path, feeds = legacy
    plain, gated = tmp_path / "plain.onnx", tmp_path / "gated.onnx"
    assert main(["compress", str(path), "-o", str(plain)]) == 0
    capsys.readouterr()
    assert main(["compress", str(path), "-o", str(gated), "--feeds", str(feeds), "--require", "snr>=30", "--json"]) == 0, \
        capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["gate"]["passed"] and report["fidelity"]["metrics"]["snr"] >= 30
    [note] = [n for n in report["fidelity"]["notes"] if "measured at opset 13" in n]
    assert "opset 6" in note and "reference evaluator" in note and "Gemm(6)" in note
    assert gated.read_bytes() == plain.read_bytes()  # measuring changes what is measured, not what is written


def test_target_searches_the_raised_original(legacy, tmp_path, capsys):
    from onnx.reference import ReferenceEvaluator
    import onnxruntime as ort

    path, feeds = legacy
    out = tmp_path / "t.onnx"
    assert main(["compress", str(path), "-o", str(out), "--feeds", str(feeds), "--target", "snr>=30",
                 "--min-elements", "0"]) == 0, capsys.readouterr().err
    assert "the written model is built from that one" in capsys.readouterr().out
    original = ReferenceEvaluator(onnx.load(str(path)))
    session = ort.InferenceSession(str(out))
    signal = noise = 0.0
    for x in np.load(feeds).values():
        ref, got = original.run(None, {"x": x})[0].astype(np.float64), session.run(None, {"x": x})[0]
        signal, noise = signal + float(np.sum(ref ** 2)), noise + float(np.sum((ref - got) ** 2))
    assert 10 * np.log10(signal / noise) >= 30 - 0.01


def test_eval_raises_both_old_models(legacy, capsys):
    path, _ = legacy
    assert main(["eval", str(path), str(path), "--json"]) == 0, capsys.readouterr().err
    fidelity = json.loads(capsys.readouterr().out)["fidelity"]
    assert [n.split(" at opset")[0] for n in fidelity["notes"] if "measured at opset 13" in n] == \
        ["onnxruntime cannot run the original", "onnxruntime cannot run the candidate"]
    assert fidelity["metrics"]["snr"] == "inf"  # JSON writes non-finite numbers as strings


def test_a_raise_that_changes_the_function_is_not_measured(legacy, tmp_path, capsys, monkeypatch):
    """A converter error would sit in both the reference and the candidate and cancel out: the
    reference evaluator's check catches it, and onnxruntime's refusal stands (exit 1, no file)."""
    from passes import graph

    real = graph.raise_opset

    def wrong_raise(model, target, payloads=None):
        raised, how = real(model, target, payloads)
        for t in raised.graph.initializer:
            if t.name == "b":
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + np.float32(0.01), "b"))
        return raised, how

    monkeypatch.setattr(graph, "raise_opset", wrong_raise)
    path, feeds = legacy
    out = tmp_path / "g.onnx"
    assert main(["compress", str(path), "-o", str(out), "--feeds", str(feeds), "--require", "snr>=30"]) == 1
    captured = capsys.readouterr()
    assert "onnxruntime cannot load" in captured.err and "Gemm(6)" in captured.err
    assert "measured at opset" not in captured.out and not out.exists()


def test_a_runnable_model_is_returned_untouched_without_a_session(monkeypatch):
    model = opset6_gemm_model()
    model.opset_import[0].version = 7

    def no_session(_model):
        raise AssertionError("a model at opset >= 7 must not cost a session")

    monkeypatch.setattr(legacy_opset, "onnxruntime_refusal", no_session)
    assert legacy_opset.measurable(model, None) == (model, None)


def test_other_refusals_are_left_to_onnxruntime(monkeypatch):
    """Only missing kernels (NOT_IMPLEMENTED) are what a raise can cure."""
    model = opset6_gemm_model()
    monkeypatch.setattr(legacy_opset, "onnxruntime_refusal", lambda _m: "[ONNXRuntimeError] : 10 : INVALID_GRAPH : x")
    assert legacy_opset.measurable(model, None) == (model, None)


@pytest.mark.parametrize("expected, got, db", [
    ([np.ones(4)], [np.ones(4)], float("inf")),
    ([np.ones(4)], [np.ones(4) * 1.001], pytest.approx(60, abs=0.1)),
    ([np.ones(4)], [np.ones(5)], -float("inf")),
    ([np.array([1, 2])], [np.array([1, 3])], -float("inf")),
    ([np.array([np.nan, 1.0])], [np.array([np.nan, 1.0])], float("inf")),
    ([np.array([np.nan, 1.0])], [np.array([0.0, 1.0])], -float("inf")),
])
def test_agreement(expected, got, db):
    assert legacy_opset._agreement_db(expected, got) == db
