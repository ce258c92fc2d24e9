"""Models with a STRING graph input (text front ends: ai.onnx.ml CategoryMapper, tokenizer
lookups) measured on feeds that hold their strings.

numpy writes a string array into an .npz as a fixed-width unicode ('U') or bytes ('S') array,
which np.load reads back without pickles and onnxruntime takes for a STRING input as it is.
Every place that reads feeds (`--feeds` of compress --require / --target and of eval; the
Python API's feeds=) must measure such a model, not refuse it: there is no other way to give
the fidelity gate or the search this model's inputs (strings cannot be synthesised).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import InvalidArgumentError
from passes.fidelity import load_feeds
from tools.surgeon_compress import main

WORDS = ["cat", "dog", "bird", "fish", "cow", "ant", "bee", "fox"]


def string_input_model() -> onnx.ModelProto:
    """words (STRING [N]) -> CategoryMapper -> Gather rows of an embedding table -> + x -> MatMul."""
    rng = np.random.default_rng(0)
    mapper = helper.make_node("CategoryMapper", ["words"], ["ids"], domain="ai.onnx.ml", cats_strings=WORDS,
                              cats_int64s=list(range(len(WORDS))), default_int64=0)
    graph = helper.make_graph(
        [mapper, helper.make_node("Gather", ["table", "ids"], ["rows"]),
         helper.make_node("Add", ["rows", "x"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"])],
        "string_input",
        [helper.make_tensor_value_info("words", TensorProto.STRING, ["N"]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])],
        [numpy_helper.from_array(rng.normal(size=(len(WORDS), 64)).astype(np.float32), "table"),
         numpy_helper.from_array(rng.normal(size=(64, 32)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    onnx.checker.check_model(model, full_check=True)
    return model


def string_feeds(n=4, kind="U") -> dict:
    """`n` feeds as .npz keys; 'zebra' is outside the mapper's words (its default row)."""
    rng = np.random.default_rng(1)
    vocabulary = np.array(WORDS + ["zebra"], dtype=kind)
    arrays = {}
    for i in range(n):
        arrays[f"{i}/words"] = vocabulary[rng.integers(0, len(vocabulary), 16)]
        arrays[f"{i}/x"] = rng.normal(size=(16, 64)).astype(np.float32)
    return arrays


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("strings")
    model = d / "words.onnx"
    onnx.save(string_input_model(), str(model))
    feeds = d / "feeds.npz"
    np.savez(feeds, **string_feeds())
    return model, feeds


def snr_on(original, candidate, feeds_path) -> float:
    """Worst-feed-pooled SNR (dB) of output y, computed here with onnxruntime, not by the tool."""
    a, b = ort.InferenceSession(str(original)), ort.InferenceSession(str(candidate))
    ref, err = 0.0, 0.0
    for feed in load_feeds(feeds_path):
        ya, yb = a.run(None, feed)[0], b.run(None, feed)[0]
        ref += float(np.sum(ya.astype(np.float64) ** 2))
        err += float(np.sum((ya.astype(np.float64) - yb) ** 2))
    return 10 * np.log10(ref / err)


@pytest.mark.parametrize("kind", ["U", "S"])
def test_load_feeds_keeps_string_arrays_for_a_string_input(tmp_path, files, kind):
    model, _ = files
    path = tmp_path / "f.npz"
    np.savez(path, **string_feeds(2, kind))
    feeds = load_feeds(path, model)
    assert len(feeds) == 2 and feeds[0]["words"].dtype.kind == kind
    assert list(feeds[0]["words"]) == list(string_feeds(2, kind)["0/words"])
    ort.InferenceSession(str(model)).run(None, feeds[0])  # onnxruntime takes them as they are


def test_compress_require_measures_a_string_input_model(tmp_path, files, capsys):
    model, feeds = files
    out = tmp_path / "q.onnx"
    assert main(["compress", str(model), "-o", str(out), "--feeds", str(feeds), "--require", "snr>=30"]) == 0, \
        capsys.readouterr().err
    stdout = capsys.readouterr().out
    assert "gate       snr>=30" in stdout and "ok" in stdout
    assert snr_on(model, out, feeds) >= 30


def test_compress_target_searches_a_string_input_model(tmp_path, files, capsys):
    model, feeds = files
    out = tmp_path / "t.onnx"
    assert main(["compress", str(model), "-o", str(out), "--feeds", str(feeds), "--target", "snr>=30"]) == 0, \
        capsys.readouterr().err
    assert out.stat().st_size < model.stat().st_size
    assert snr_on(model, out, feeds) >= 30


def test_eval_compares_on_string_feeds(tmp_path, files, capsys):
    model, feeds = files
    out = tmp_path / "q.onnx"
    assert main(["compress", str(model), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(model), str(out), "--feeds", str(feeds), "--json"]) == 0, capsys.readouterr().err
    assert '"snr"' in capsys.readouterr().out


def test_python_api_takes_object_arrays_of_str(files):
    model, feeds = files
    feed_list = [{"words": f["words"].astype(object), "x": f["x"]} for f in load_feeds(feeds)]
    candidate, report = passes.compress(str(model), target="snr>=30", feeds=feed_list)
    assert report["met_on_feeds"] and report["fidelity"]["snr"] >= 30


def test_a_string_array_for_a_float_input_is_refused_by_name(tmp_path, files):
    model, _ = files
    arrays = string_feeds(1)
    arrays["0/x"] = np.array([["1.0"] * 64] * 16)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(InvalidArgumentError, match=r"'x'.*(string|<U).*FLOAT|'x'.*FLOAT.*(string|<U)"):
        load_feeds(path, model)


def test_no_feeds_for_a_string_input_says_to_pass_feeds(tmp_path, files, capsys):
    model, _ = files
    out = tmp_path / "t.onnx"
    assert main(["compress", str(model), "-o", str(out), "--target", "snr>=30"]) == 1
    err = capsys.readouterr().err
    assert "'words'" in err and "STRING" in err and "--feeds" in err
    assert not out.exists()
