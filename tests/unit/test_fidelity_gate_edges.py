"""The fidelity gate and the command on edge cases: feeds that measure nothing, values that miss a
requirement by less than the printed rounding, axes out of range, which model failed."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import fidelity as F
from passes.errors import InvalidArgumentError
from test_fidelity import linear_model
from tools.surgeon_compress import main


@pytest.fixture
def weight():
    return np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)


@pytest.fixture
def model_path(tmp_path, weight):
    path = tmp_path / "lin.onnx"
    onnx.save(linear_model(weight), str(path))
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surgeon-compress: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------ nothing measured


@pytest.fixture
def empty_feeds(tmp_path):
    path = tmp_path / "empty.npz"
    np.savez(path, **{"0/x": np.zeros((0, 64), np.float32)})
    return path


def test_evaluate_refuses_feeds_whose_outputs_hold_no_values(weight):
    """A batch of 0 rows gives empty outputs: cosine 1 and snr inf over nothing, which passed any gate."""
    candidate = linear_model(weight + np.float32(1.0))
    with pytest.raises(InvalidArgumentError, match=r"nothing to measure.*|hold no values") as caught:
        F.evaluate(linear_model(weight), candidate, feeds=[{"x": np.zeros((0, 64), np.float32)}])
    assert "feed 0 input 'x' has shape [0, 64]" in str(caught.value)


def test_require_measurable_refuses_empty_outputs():
    with pytest.raises(InvalidArgumentError, match="hold no values"):
        F.require_measurable([[np.zeros(0, np.float32)]])
    F.require_measurable([[np.zeros(0, np.float32)], [np.ones(2, np.float32)]])  # one feed measured: fine


def test_evaluate_notes_feeds_that_give_only_empty_outputs(weight):
    rng = np.random.default_rng(0)
    feeds = [{"x": np.zeros((0, 64), np.float32)}, {"x": rng.standard_normal((2, 64)).astype(np.float32)}]
    result = F.evaluate(linear_model(weight), linear_model(weight * 1.01), feeds=feeds)
    assert any("1 of 2 feeds give only empty outputs (feed 0)" in n for n in result.notes), result.notes


def test_compress_require_refuses_an_empty_batch(tmp_path, capsys, model_path, empty_feeds):
    out = tmp_path / "o.onnx"
    code, _, err = run(capsys, "compress", model_path, "-o", out, "--bits", "2", "--feeds", empty_feeds,
                       "--require", "cosine>=0.9999")
    assert code == 1
    assert "hold no values" in one_line_error(err)
    assert not out.exists()


def test_eval_refuses_an_empty_batch(tmp_path, capsys, model_path, empty_feeds):
    out = tmp_path / "o.onnx"
    assert main(["compress", str(model_path), "-o", str(out), "--bits", "2"]) == 0
    capsys.readouterr()
    code, _, err = run(capsys, "eval", model_path, out, "--feeds", empty_feeds, "--require", "cosine>=0.9999")
    assert code == 1
    assert "nothing to measure fidelity on" in one_line_error(err)


def test_compress_target_refuses_an_empty_batch(tmp_path, capsys, model_path, empty_feeds):
    out = tmp_path / "o.onnx"
    code, _, err = run(capsys, "compress", model_path, "-o", out, "--feeds", empty_feeds, "--target", "cosine>=0.999")
    assert code == 1
    assert "hold no values" in one_line_error(err)
    assert not out.exists()


# ------------------------------------------------------------------------------ cosine_min per sample


def _batched_feeds():
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal((4, 64)).astype(np.float32)}]


def _one_row_broken(weight):
    """A candidate whose output row 2 (of 4) is far off and the others exact: y = x @ W, then row 2 scaled -1."""
    k, n = weight.shape
    flip = np.ones((4, 1), np.float32)
    flip[2] = -1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y0"]), helper.make_node("Mul", ["y0", "flip"], ["y"])], "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(flip, "flip")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_cosine_min_is_per_sample_where_the_batch_axis_is_named(weight):
    """One feed of 4 rows, one of them reversed: the whole-batch cosine is 0.5, the worst sample's -1."""
    result = F.evaluate(linear_model(weight), _one_row_broken(weight), feeds=_batched_feeds())
    assert result.metrics["cosine_min"] == pytest.approx(-1.0)
    assert 0.3 < result.metrics["cosine"] < 0.7  # (the mean over feeds: one feed, the batch as a whole)
    assert not F.parse_requirement("cosine_min>=0.9").check(result)


def test_cosine_min_stays_per_feed_where_the_batch_axis_is_unknown(weight):
    """Output dims unnamed: rows may be time steps, not samples; metric_args batch_axis names the axis."""
    original, candidate = linear_model(weight, batch=None), _one_row_broken(weight)
    candidate.graph.output[0].type.tensor_type.shape.dim[0].Clear()
    whole = F.evaluate(original, candidate, feeds=_batched_feeds())
    assert whole.metrics["cosine_min"] == pytest.approx(whole.metrics["cosine"])
    rows = F.evaluate(original, candidate, feeds=_batched_feeds(), metric_args={"batch_axis": 0})
    assert rows.metrics["cosine_min"] == pytest.approx(-1.0)


def test_batch_axis_out_of_range_names_the_output_and_its_rank(weight):
    with pytest.raises(InvalidArgumentError, match=r"batch_axis=5 is out of range for output 0 \('y'\) of rank 2"):
        F.evaluate(linear_model(weight), linear_model(weight), feeds=_batched_feeds(), metric_args={"batch_axis": 5})


def test_compress_require_cosine_min_per_sample(tmp_path, capsys, weight):
    """The command's gate reads the per-sample cosine_min, and --metric-arg batch_axis is accepted."""
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    feeds = tmp_path / "f.npz"
    onnx.save(linear_model(weight), str(a))
    onnx.save(_one_row_broken(weight), str(b))
    np.savez(feeds, **{"0/x": _batched_feeds()[0]["x"]})
    code, out, err = run(capsys, "eval", a, b, "--feeds", feeds, "--require", "cosine_min>=0.9",
                         "--metric-arg", "batch_axis=0")
    assert code == 3, err


# ------------------------------------------------------------------------------ values near the threshold


@pytest.mark.parametrize("text, value, shown", [
    ("cosine>=0.9999", 0.99989999999, "0.99989999999"),  # at 6 digits: 0.9999, the threshold itself
    ("cosine>=0.9999999", 0.99999989, "0.99999989"),  # at 6 digits: 1
    ("maxabs<=0.01", 0.0100000001, "0.0100000001"),
    ("snr>=30", 29.9999999, "29.9999999"),
    ("cosine>=0.999", 0.99951234567, "0.999512"),  # a clear pass or miss keeps 6 digits
    ("cosine>=0.999", 0.5, "0.5"),
])
def test_a_value_is_shown_with_the_digits_that_show_its_verdict(text, value, shown):
    assert F.parse_requirement(text).shown(value) == shown


def test_the_command_shows_a_narrow_miss_as_a_miss(capsys):
    from passes.errors import FidelityError
    from tools import surgeon_compress as cli

    checks = [{"requirement": "cosine>=0.9999999", "value": 0.99999989, "passed": False}]
    result = F.FidelityResult(metrics={"cosine": 0.99999989, "cosine_min": 0.99999989}, n_feeds=1, synthesized=False)
    cli._print_fidelity(result, checks)
    assert "gate       cosine>=0.9999999: 0.99999989 FAILED" in capsys.readouterr().out
    with pytest.raises(FidelityError, match=r"\(got 0\.99999989\)"):
        cli._raise_if_gate_failed(checks, False)
    req = F.parse_requirement("cosine>=0.9999999")
    with pytest.raises(FidelityError, match=r"cosine 0\.99999989 \(required"):
        F.enforce(result, [req])


def test_the_summary_does_not_round_a_cosine_below_one_up_to_one():
    result = F.FidelityResult(metrics={"cosine": 0.99999989, "cosine_min": 0.9999999996}, n_feeds=1, synthesized=False)
    assert "cosine 0.9999999 (min 0.9999999996)" in result.summary()
    exact = F.FidelityResult(metrics={"cosine": 1.0, "cosine_min": 0.9991234}, n_feeds=1, synthesized=False)
    assert "cosine 1.000000 (min 0.999123)" in exact.summary()


# ------------------------------------------------------------------------------ axes out of range


def ctc_model(weight) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])], "ctc",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 20, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 20, 10])],
        [numpy_helper.from_array(weight, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("args, message", [
    ({"time_axis": 1, "class_axis": 99}, "class_axis=99 is out of range for output 0 ('logits') of rank 3 (axes -3..2)"),
    ({"time_axis": -4, "class_axis": 2}, "time_axis=-4 is out of range for output 0 ('logits') of rank 3"),
])
def test_ctc_axes_outside_the_output_are_refused(args, message):
    """class_axis=99 wrapped to 99 % 3 = 0 (the batch axis) and was measured without a word."""
    w = np.random.default_rng(2).standard_normal((16, 10)).astype(np.float32)
    feeds = [{"x": np.random.default_rng(3).standard_normal((1, 20, 16)).astype(np.float32)}]
    with pytest.raises(InvalidArgumentError) as caught:
        F.evaluate(ctc_model(w), ctc_model(w * 1.01), feeds=feeds, metric="ctc", metric_args=args)
    assert message in str(caught.value)
    ok = F.evaluate(ctc_model(w), ctc_model(w), feeds=feeds, metric="ctc", metric_args={"time_axis": -2, "class_axis": -1})
    assert ok.metrics["ctc"] == 1.0


def test_ctc_strings_refuses_an_axis_outside_the_rank():
    with pytest.raises(InvalidArgumentError, match=r"class_axis=3 is out of range for output 0 of rank 3"):
        F.ctc_strings(np.zeros((1, 4, 5)), time_axis=1, class_axis=3)


def test_the_command_names_the_output_for_an_axis_out_of_range(tmp_path, capsys):
    w = np.random.default_rng(2).standard_normal((16, 10)).astype(np.float32)
    a, b, feeds = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "f.npz"
    onnx.save(ctc_model(w), str(a))
    onnx.save(ctc_model(w * 1.01), str(b))
    np.savez(feeds, **{"0/x": np.ones((1, 20, 16), np.float32)})
    code, _, err = run(capsys, "eval", a, b, "--feeds", feeds, "--metric", "ctc", "--metric-arg", "time_axis=1",
                       "--metric-arg", "class_axis=99")
    assert code == 1
    assert "class_axis=99 is out of range for output 0 ('logits') of rank 3" in one_line_error(err)


# ------------------------------------------------------------------------------ which model failed


def _reshape_fails(weight) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y0"]), helper.make_node("Reshape", ["y0", "s"], ["y"])], "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.array([7, 5], np.int64), "s")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("failing", ["original", "candidate"])
def test_eval_names_the_model_that_fails_to_run_and_its_file(tmp_path, capsys, weight, model_path, failing):
    bad = tmp_path / "fails.onnx"
    onnx.save(_reshape_fails(weight), str(bad))
    feeds = tmp_path / "f.npz"
    np.savez(feeds, **{"0/x": np.ones((1, 64), np.float32)})
    pair = (bad, model_path) if failing == "original" else (model_path, bad)
    code, _, err = run(capsys, "eval", *pair, "--feeds", feeds)
    assert code == 1
    assert f"{failing} model ({bad}): onnxruntime failed on feed 0" in one_line_error(err)


def test_eval_says_the_shapes_where_the_two_models_outputs_differ(tmp_path, capsys, weight, model_path):
    other = tmp_path / "narrow.onnx"
    onnx.save(linear_model(weight[:, :31]), str(other))
    feeds = tmp_path / "f.npz"
    np.savez(feeds, **{"0/x": np.ones((2, 64), np.float32), "1/x": np.ones((1, 64), np.float32)})
    code, out, err = run(capsys, "eval", model_path, other, "--feeds", feeds)
    assert code == 0, err
    assert ("output 0 ('y') has shape [2, 32] in the original and [2, 31] in the candidate on feed 0 "
            "(shapes differ on 2 of 2 feeds)") in out


# ------------------------------------------------------------------------------ names from the file, printed


def test_verify_prints_a_stored_name_with_its_escapes_visible(tmp_path, capsys, model_path):
    """The pack records the model's file name; a crafted one holding terminal escape sequences reached
    the terminal as it was (verify's checks name the restored files)."""
    crafted = tmp_path / "x\x1b[31mred\x07.onnx"
    crafted.write_bytes(model_path.read_bytes())
    pack = tmp_path / "p.onnxz"
    assert main(["pack", str(crafted), "-o", str(pack)]) == 0
    capsys.readouterr()
    code, out, err = run(capsys, "verify", pack)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "x\\x1b[31mred\\x07.onnx" in out
    code, out, err = run(capsys, "info", pack)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
