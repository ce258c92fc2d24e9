"""Feeds whose dtype differs from the model input's (numpy's float64, a tokenizer's int32 ids) are
cast as evaluate casts them, by every pass that runs the model on feeds: the auto mode, error
feedback and bias correction raised onnxruntime's own InvalidArgument (the command: exit 70)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.fidelity import conform_feeds

RNG = np.random.default_rng(7)


def _dense_model():
    w = numpy_helper.from_array(RNG.standard_normal((64, 48)).astype(np.float32), "W")
    b = numpy_helper.from_array(RNG.standard_normal(48).astype(np.float32), "B")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["y"])], "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 48])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _embedding_model():
    table = numpy_helper.from_array(RNG.standard_normal((300, 64)).astype(np.float32), "E")
    g = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["y"])], "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", "t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "t", 64])], [table])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _float64_feeds(n=4):
    return [{"x": RNG.standard_normal((3, 64))} for _ in range(n)]  # float64: numpy's default


def test_conform_feeds_casts_within_a_kind_and_names_what_cannot_be_cast():
    model = _embedding_model()
    out = conform_feeds(model, [{"ids": np.array([[1, 2]], np.int32)}])
    assert out[0]["ids"].dtype == np.int64 and out[0]["ids"].tolist() == [[1, 2]]
    with pytest.raises(passes.InvalidArgumentError, match=r"feed 0 input 'ids' is float64 but the model expects int64"):
        conform_feeds(model, [{"ids": np.array([[1.0]])}])
    with pytest.raises(passes.InvalidArgumentError, match="feed 1 input 'ids' is uint64"):
        conform_feeds(model, [{"ids": np.array([[1]], np.int64)}, {"ids": np.array([[2 ** 63]], np.uint64)}])


def test_the_auto_mode_takes_float64_feeds(tmp_path):
    src = tmp_path / "dense.onnx"
    onnx.save(_dense_model(), str(src))
    feeds = _float64_feeds()
    model, report = passes.compress(str(src), target="cosine>=0.999", feeds=feeds)
    result = passes.evaluate(str(src), model, feeds=feeds)
    assert result.metrics["cosine"] >= 0.999
    assert report is not None


def test_the_auto_mode_takes_int32_ids_from_an_npz(tmp_path):
    src, npz = tmp_path / "embed.onnx", tmp_path / "ids.npz"
    onnx.save(_embedding_model(), str(src))
    np.savez(npz, **{f"{i}/ids": RNG.integers(0, 300, (2, 9)).astype(np.int32) for i in range(4)})
    model, _ = passes.compress(str(src), target="cosine>=0.999", feeds=str(npz))
    assert passes.evaluate(str(src), model, feeds=str(npz)).metrics["cosine"] >= 0.999


def test_error_feedback_and_bias_correction_take_float64_feeds(tmp_path):
    src = tmp_path / "dense.onnx"
    onnx.save(_dense_model(), str(src))
    feeds = _float64_feeds()
    fed = passes.quantize_with_feedback(str(src), feeds=feeds, bits=4)
    corrected = passes.correct_bias(passes.quantize_weights(str(src), bits=4), str(src), feeds)
    for model in (fed, corrected):
        assert passes.evaluate(str(src), model, feeds=feeds).metrics["cosine"] > 0.98


def test_the_command_target_takes_float64_feeds(tmp_path, capsys):
    from tools.surgeon_compress import main

    src, npz, out = tmp_path / "dense.onnx", tmp_path / "f64.npz", tmp_path / "q.onnx"
    onnx.save(_dense_model(), str(src))
    np.savez(npz, **{f"{i}/x": f["x"] for i, f in enumerate(_float64_feeds())})
    assert main(["compress", str(src), "-o", str(out), "--feeds", str(npz), "--target", "cosine>=0.999"]) == 0
    assert "internal error" not in capsys.readouterr().err
    onnx.checker.check_model(str(out), full_check=True)
