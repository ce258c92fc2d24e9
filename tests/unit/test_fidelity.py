"""passes.fidelity: feeds, onnxruntime runs, metrics, requirement expressions and the gate."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import fidelity as F
from passes.errors import FidelityError, FileAccessError, InvalidArgumentError, InvalidModelError


def linear_model(weight: np.ndarray, batch="batch") -> onnx.ModelProto:
    """y = x @ W, x [batch, K] float32 -> y [batch, N]."""
    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, n])],
        [numpy_helper.from_array(weight.astype(np.float32), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def weight():
    return np.random.default_rng(1).standard_normal((8, 5)).astype(np.float32)


@pytest.fixture
def model(weight):
    return linear_model(weight)


# ------------------------------------------------------------------------------ load_feeds


def test_load_feeds_indexed_keys_give_one_feed_per_index(tmp_path):
    path = tmp_path / "f.npz"
    a0, a1, a10 = np.zeros((1, 8), np.float32), np.ones((2, 8), np.float32), np.full((3, 8), 2, np.float32)
    np.savez(path, **{"0/x": a0, "1/x": a1, "10/x": a10, "1/y/z": np.arange(3)})
    feeds = F.load_feeds(path)
    assert len(feeds) == 3
    assert [f["x"].shape for f in feeds] == [(1, 8), (2, 8), (3, 8)]  # numeric order, not "10" < "2"
    assert set(feeds[1]) == {"x", "y/z"}  # an input name may contain "/"
    np.testing.assert_array_equal(feeds[2]["x"], a10)


def test_load_feeds_plain_keys_give_one_feed(tmp_path):
    path = tmp_path / "f.npz"
    np.savez(path, x=np.zeros((1, 8), np.float32))
    feeds = F.load_feeds(path)
    assert len(feeds) == 1 and feeds[0]["x"].shape == (1, 8)


def test_load_feeds_checks_names_against_the_model(tmp_path, model):
    path = tmp_path / "f.npz"
    np.savez(path, **{"0/input": np.zeros((1, 8), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"missing input\(s\) 'x'.*unknown input\(s\) 'input'"):
        F.load_feeds(path, model)
    np.savez(path, **{"0/x": np.zeros((1, 8), np.float32)})
    assert len(F.load_feeds(path, model)) == 1


def test_load_feeds_errors(tmp_path):
    with pytest.raises(FileAccessError, match="no such file"):
        F.load_feeds(tmp_path / "absent.npz")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip archive")
    # numpy takes any non-zip file for a pickle and its refusal says to load it unsafely
    from conftest import MODELS

    for wrong in (garbage, MODELS / "rapidocr_cls.onnx"):
        with pytest.raises(InvalidArgumentError, match="does not start with a zip header") as err:
            F.load_feeds(wrong)
        assert "pickle" not in str(err.value)
    truncated = tmp_path / "truncated.npz"
    np.savez(truncated, x=np.zeros(100))
    truncated.write_bytes(truncated.read_bytes()[:60])
    with pytest.raises(InvalidArgumentError, match="not a readable .npz"):
        F.load_feeds(truncated)
    npy = tmp_path / "one.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(InvalidArgumentError, match="not a single .npy"):
        F.load_feeds(npy)
    mixed = tmp_path / "mixed.npz"
    np.savez(mixed, **{"0/x": np.zeros(2), "x": np.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="mix"):
        F.load_feeds(mixed)
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    with pytest.raises(InvalidArgumentError, match="no arrays"):
        F.load_feeds(empty)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InvalidArgumentError):
        F.load_feeds(pickled)  # never unpickled: allow_pickle=False
    with pytest.raises(FileAccessError, match="folder"):
        F.load_feeds(tmp_path)


# ------------------------------------------------------------------------------ synthesize_feeds


def test_synthesize_feeds_follow_input_specs_and_seed():
    graph = helper.make_graph(
        [helper.make_node("Identity", ["ids"], ["o1"]), helper.make_node("Identity", ["attention_mask"], ["o2"]),
         helper.make_node("Identity", ["flag"], ["o3"]), helper.make_node("Identity", ["pix"], ["o4"])],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [3]),
         helper.make_tensor_value_info("pix", TensorProto.FLOAT16, [None, 3, None, 7])],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in ("o1", "o2", "o3", "o4")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = F.synthesize_feeds(m, n=3, seed=5)
    assert len(feeds) == 3
    f = feeds[0]
    assert f["ids"].dtype == np.int64 and f["ids"].shape == (F.DEFAULT_BATCH, F.DEFAULT_DIM)
    assert f["ids"].min() >= 0 and f["ids"].max() < F.INT_TOKEN_RANGE  # valid token ids
    assert f["attention_mask"].shape == f["ids"].shape and np.all(f["attention_mask"] == 1)  # named dims agree
    assert f["flag"].dtype == np.bool_ and f["flag"].shape == (3,)
    assert f["pix"].dtype == np.float16 and f["pix"].shape == (1, 3, F.DEFAULT_DIM, 7)
    again = F.synthesize_feeds(m, n=3, seed=5)
    for a, b in zip(feeds, again):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    other = F.synthesize_feeds(m, n=1, seed=6)
    assert not np.array_equal(other[0]["pix"], feeds[0]["pix"])


def test_synthesize_feeds_size_a_dimension_written_as_a_sum_of_others():
    """A decoder with past (optimum's export): the attention mask spans past + new positions,
    'past_sequence_length + sequence_length', and must be as wide as the keys the graph concatenates.
    A name that is no dimension of its own ('seq-len' beside no 'len') stays a plain name."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"o_{n}"]) for n in ("past", "ids", "attention_mask", "other")],
        "g",
        [helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch_size", 2, "past_sequence_length", 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                       ["batch_size", "past_sequence_length + sequence_length"]),
         helper.make_tensor_value_info("other", TensorProto.FLOAT, ["batch_size", "seq-len"])],
        [helper.make_tensor_value_info(f"o_{n}", TensorProto.UNDEFINED, None)
         for n in ("past", "ids", "attention_mask", "other")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    f = F.synthesize_feeds(m, n=1)[0]
    assert f["past"].shape == (F.DEFAULT_BATCH, 2, F.DEFAULT_DIM, 4) and f["ids"].shape == (F.DEFAULT_BATCH, F.DEFAULT_DIM)
    assert f["attention_mask"].shape == (F.DEFAULT_BATCH, 2 * F.DEFAULT_DIM)
    assert f["other"].shape == (F.DEFAULT_BATCH, F.DEFAULT_DIM)


def test_synthesize_feeds_refuses_string_inputs():
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["o"])], "g",
                              [helper.make_tensor_value_info("s", TensorProto.STRING, [1])],
                              [helper.make_tensor_value_info("o", TensorProto.STRING, [1])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidArgumentError, match="cannot synthesise input 's'"):
        F.synthesize_feeds(m)
    with pytest.raises(InvalidArgumentError):
        F.synthesize_feeds(m, n=0)


# ------------------------------------------------------------------------------ run_outputs


def test_run_outputs_from_proto_and_path_agree(tmp_path, model, weight):
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    from_proto = F.run_outputs(model, [{"x": x}])
    from_path = F.run_outputs(str(path), [{"x": x}])
    np.testing.assert_allclose(from_proto[0][0], x @ weight, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(from_proto[0][0], from_path[0][0])


def test_run_outputs_conforms_or_refuses_dtypes(model):
    x64 = np.ones((1, 8), np.float64)  # np.savez of a Python float array: float64
    out = F.run_outputs(model, [{"x": x64}])
    assert out[0][0].shape == (1, 5)
    with pytest.raises(InvalidArgumentError, match="is int64 but the model expects float32"):
        F.run_outputs(model, [{"x": np.ones((1, 8), np.int64)}])
    with pytest.raises(InvalidArgumentError, match="dimension"):
        F.run_outputs(model, [{"x": np.ones(8, np.float32)}])
    with pytest.raises(InvalidArgumentError, match=r"has shape \[1, 7\] but the model expects .*\(dimension 1: 7, not 8\)"):
        F.run_outputs(model, [{"x": np.ones((1, 7), np.float32)}])  # named before onnxruntime runs it
    with pytest.raises(InvalidArgumentError, match="missing input"):
        F.run_outputs(model, [{}])
    with pytest.raises(InvalidArgumentError, match="unknown input"):
        F.run_outputs(model, [{"x": np.ones((1, 8), np.float32), "extra": np.ones(1)}])


def test_run_outputs_wraps_onnxruntime_failures(model, tmp_path):
    free_k = onnx.ModelProto()
    free_k.CopyFrom(model)
    free_k.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "k"  # the input allows any K, W does not
    with pytest.raises(InvalidModelError, match="onnxruntime failed on feed 0"):
        F.run_outputs(free_k, [{"x": np.ones((1, 7), np.float32)}])  # K=7 does not match W
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(InvalidModelError, match="onnxruntime cannot load"):
        F.run_outputs(broken, [{"x": np.ones((1, 8), np.float32)}])


def test_run_outputs_of_a_model_too_big_for_one_protobuf(model, weight, monkeypatch):
    """Above the protobuf limit the model reaches onnxruntime through a file with external data."""
    monkeypatch.setattr(F, "INLINE_MODEL_LIMIT", 0)
    x = np.ones((1, 8), np.float32)
    out = F.run_outputs(model, [{"x": x}])
    np.testing.assert_allclose(out[0][0], x @ weight, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    monkeypatch.setattr(F, "FILE_SESSION_BYTES", 0)  # (a big model: the same way, the same outputs)
    assert np.array_equal(F.run_outputs(model, [{"x": x}])[0][0], out[0][0])


def test_provider_names():
    assert F.resolve_providers(None) == ["CPUExecutionProvider"]
    assert F.resolve_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(InvalidArgumentError, match="unknown provider"):
        F.resolve_providers("tpu")


# ------------------------------------------------------------------------------ metrics


def test_cosine_per_feed_values():
    ref = [[np.array([1.0, 0.0])], [np.array([1.0, 1.0])], [np.zeros(2)], [np.ones(3)]]
    cand = [[np.array([0.0, 1.0])], [np.array([2.0, 2.0])], [np.zeros(2)], [np.ones(2)]]
    np.testing.assert_allclose(F.cosine_per_feed(ref, cand), [0.0, 1.0, 1.0, 0.0])  # shape change: 0


def test_metrics_of_float64_outputs_past_the_square_range():
    """cosine and SNR are scale-free: outputs near 1e228 (the onnx backend tests' float64 Add) gave
    NaN for equal runs (the squares overflowed) and failed a cosine>=0.999 gate on a bit-equal candidate."""
    a = np.array([1e228, 2e228, -3e227])
    same = F.compute_metrics([[a]], [[a.copy()]])
    assert same["cosine"] == 1.0 and same["snr"] == math.inf and same["snr_min"] == math.inf
    close = F.compute_metrics([[a]], [[a * (1 + 1e-7)]])
    assert close["snr"] == pytest.approx(140.0, abs=1e-6) and close["snr_min"] == pytest.approx(140.0, abs=1e-6)
    assert close["cosine"] == pytest.approx(1.0)
    # the same outputs at ordinary scale give the same figures (the units cancel)
    small = F.compute_metrics([[a * 1e-228]], [[a * 1e-228 * (1 + 1e-7)]])
    assert small["snr"] == pytest.approx(close["snr"], abs=1e-6)


def test_pooled_snr_weighs_outputs_by_their_own_scale():
    """Pooled SNR sums every output's energies in one unit; the worst output is each one's own."""
    ref = [[np.array([1.0, 2.0]), np.array([100.0, 0.0])], [[3.0], [1.0]]]
    cand = [[np.array([1.1, 2.0]), np.array([100.0, 1.0])], [[3.0], [1.5]]]
    ref = [[np.asarray(o) for o in r] for r in ref]
    cand = [[np.asarray(o) for o in c] for c in cand]
    signal = 1 + 4 + 9 + 1e4 + 1
    noise = 0.01 + 1 + 0.25
    assert F.output_snr_db(ref, cand) == pytest.approx(10 * math.log10(signal / noise))
    assert F.worst_output_snr_db(ref, cand) == pytest.approx(
        min(10 * math.log10(14 / 0.01), 10 * math.log10(1e4 + 1) - 10 * math.log10(1.25)))
    huge = [[o * 1e200 for o in r] for r in ref]
    huge_c = [[o * 1e200 for o in c] for c in cand]
    assert F.output_snr_db(huge, huge_c) == pytest.approx(F.output_snr_db(ref, cand))


def test_top1_agreement_counts_positions_and_shape_changes():
    a = np.array([[[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]])  # 3 positions
    b = np.array([[[0.7, 0.3], [0.9, 0.1], [0.6, 0.4]]])  # position 1 flips
    assert F.top1_agreement([[a]], [[b]]) == pytest.approx(2 / 3)
    assert F.top1_agreement([[a], [a]], [[a], [a[:, :2]]]) == pytest.approx(3 / 6)
    assert F.top1_agreement([[np.float32(1.0)]], [[np.float32(1.0)]]) is None


def test_ctc_strings_greedy_collapse():
    classes = np.array([0, 3, 3, 0, 3, 5, 5, 0, 0, 2])  # blank 0: "3 3 5 2"
    y = np.eye(6)[classes]  # [T, C]
    y = y[:, None, :]  # [T, 1, C] as ddddocr: time axis 0, class axis 2
    assert F.ctc_strings(y, time_axis=0, class_axis=2, blank=0) == [(3, 3, 5, 2)]
    assert F.ctc_strings(y, time_axis=0, class_axis=2, blank=3) == [(0, 0, 5, 0, 2)]
    batch = np.stack([np.eye(6)[classes], np.eye(6)[classes[::-1]]])  # [B, T, C]
    assert F.ctc_strings(batch, time_axis=1, class_axis=2) == [(3, 3, 5, 2), (2, 5, 3, 3)]
    with pytest.raises(InvalidArgumentError):
        F.ctc_strings(y, time_axis=2, class_axis=2)


def test_ctc_agreement_per_row():
    classes = np.array([1, 1, 0, 2])
    good = np.eye(3)[classes][None]  # [1, T, C]
    other = np.eye(3)[np.array([1, 0, 1, 2])][None]  # "1 1 2" vs "1 2"
    assert F.ctc_agreement([[good]], [[good]], time_axis=1, class_axis=2) == 1.0
    assert F.ctc_agreement([[good], [good]], [[good], [other]], time_axis=1, class_axis=2) == 0.5


def test_maxabs_and_snr():
    ref = [[np.array([1.0, 2.0]), np.array([3.0])]]
    cand = [[np.array([1.0, 2.5]), np.array([2.9])]]
    assert F.max_abs_difference(ref, cand) == pytest.approx(0.5)
    expected = 10 * math.log10((1 + 4 + 9) / (0.25 + 0.01))
    assert F.output_snr_db(ref, cand) == pytest.approx(expected)
    assert F.output_snr_db(ref, ref) == math.inf
    assert F.max_abs_difference(ref, [[np.array([1.0]), np.array([3.0])]]) == math.inf
    # a NaN the reference does not have is the worst SNR (it was NaN, which no gate could read)
    assert F.output_snr_db(ref, [[np.array([np.nan, 2.0]), np.array([3.0])]]) == -math.inf


def test_worst_output_snr_is_each_outputs_own():
    # output 0 large and nearly exact, output 1 small and 10% off: pooled, output 0 hides output 1
    ref = [[np.array([100.0, -100.0]), np.array([1.0])], [np.array([50.0, 0.0]), np.array([-1.0])]]
    cand = [[np.array([100.1, -100.0]), np.array([1.1])], [np.array([50.0, 0.0]), np.array([-0.9])]]
    pooled = 10 * math.log10((100**2 * 2 + 50**2 + 2) / (0.01 + 0.02))
    assert F.output_snr_db(ref, cand) == pytest.approx(pooled)
    assert F.worst_output_snr_db(ref, cand) == pytest.approx(10 * math.log10(2 / 0.02))  # output 1: 20 dB
    m = F.compute_metrics(ref, cand)
    assert m["snr_min"] == pytest.approx(20.0) and m["snr"] > 50
    assert not F.parse_requirement("snr_min>=25").check(F.FidelityResult(metrics=m, n_feeds=2, synthesized=False))
    assert F.parse_requirement("snr>=25").check(F.FidelityResult(metrics=m, n_feeds=2, synthesized=False))
    assert F.worst_output_snr_db(ref, ref) == math.inf
    # an output the reference leaves all zero and the candidate does not: no ratio can be met
    assert F.worst_output_snr_db([[np.array([1.0]), np.zeros(2)]], [[np.array([1.0]), np.array([0.0, 1e-6])]]) == -math.inf
    # what breaks the pooled figure breaks the worst one too
    assert F.worst_output_snr_db(ref, [[np.array([1.0]), np.array([1.0])], cand[1]]) == -math.inf


def test_compute_metrics_needs_axes_for_ctc():
    out = [[np.ones((2, 1, 3))]]
    with pytest.raises(InvalidArgumentError, match="time_axis"):
        F.compute_metrics(out, out, metric="ctc")
    m = F.compute_metrics(out, out, metric="ctc", metric_args={"time_axis": 0, "class_axis": 2, "blank": 0})
    assert m["ctc"] == 1.0 and m["cosine"] == pytest.approx(1.0) and m["maxabs"] == 0.0


# ------------------------------------------------------------------------------ evaluate


def test_evaluate_identical_and_perturbed(model, weight, tmp_path):
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32)} for i in range(3)]
    same = F.evaluate(model, model, feeds=feeds, metric="top1")
    assert same.n_feeds == 3 and not same.synthesized
    assert same.metrics["cosine"] == pytest.approx(1.0) and same.metrics["top1"] == 1.0
    assert same.metrics["maxabs"] == 0.0 and same.metrics["snr"] == math.inf
    assert same.to_dict()["metrics"]["snr"] == "inf"  # JSON has no Infinity

    noisy = linear_model(weight + 0.05 * np.random.default_rng(9).standard_normal(weight.shape).astype(np.float32))
    path = tmp_path / "noisy.onnx"
    path.write_bytes(noisy.SerializeToString())
    result = F.evaluate(model, str(path), feeds=feeds)
    assert 0.9 < result.metrics["cosine"] < 1.0
    assert result.metrics["cosine_min"] <= result.metrics["cosine"]
    assert 0 < result.metrics["maxabs"] < 1
    assert 10 < result.metrics["snr"] < 60
    assert "3 feeds" in result.summary()


def test_evaluate_synthesises_feeds_and_says_so(model):
    result = F.evaluate(model, model)
    assert result.synthesized and result.n_feeds == 4
    assert result.notes and "synthesised" in result.notes[0]
    assert "synthesised" in result.summary()


def test_evaluate_with_feeds_file_checks_names(model, tmp_path):
    path = tmp_path / "f.npz"
    np.savez(path, **{"0/wrong": np.zeros((1, 8), np.float32)})
    with pytest.raises(InvalidArgumentError, match="does not match the model"):
        F.evaluate(model, model, feeds=str(path))
    # run_outputs checks against the session's inputs, with the same message
    with pytest.raises(InvalidArgumentError, match=r"^feed 0 does not match the model: missing input\(s\) 'x'; "
                                                   r"unknown input\(s\) 'wrong' \(model inputs: 'x'\)$"):
        F.run_outputs(model, [{"wrong": np.zeros((1, 8), np.float32)}])
    with pytest.raises(InvalidArgumentError, match="unknown metric"):
        F.evaluate(model, model, metric="accuracy")


def test_evaluate_reports_progress(model):
    calls = []
    F.evaluate(model, model, feeds=[{"x": np.ones((1, 8), np.float32)}] * 2, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_evaluate_float16_sample_against_float32(sample_model, sample_model_fp16, sample_feeds):
    result = F.evaluate(str(sample_model), str(sample_model_fp16), feeds=str(sample_feeds), metric="top1")
    assert result.n_feeds == 8 and not result.synthesized
    assert result.metrics["top1"] == 1.0
    assert 0.9999 < result.metrics["cosine_min"] <= 1.0 + 1e-12
    assert 0 < result.metrics["maxabs"] < 0.01  # float16 compute: close, not identical


# ------------------------------------------------------------------------------ requirements


@pytest.mark.parametrize("text, metric, op, threshold", [
    ("cosine>=0.999", "cosine", ">=", 0.999),
    (" top1 >= 0.99 ", "top1", ">=", 0.99),
    ("maxabs<=1e-3", "maxabs", "<=", 0.001),
    ("snr>=30", "snr", ">=", 30.0),
    ("snr>-5", "snr", ">", -5.0),
    ("cosine_min>=0.99", "cosine_min", ">=", 0.99),
    ("ctc>=0.98", "ctc", ">=", 0.98),
    ("COSINE>=0.5", "cosine", ">=", 0.5),
])
def test_parse_requirement_accepts(text, metric, op, threshold):
    req = F.parse_requirement(text)
    assert (req.metric, req.op, req.threshold) == (metric, op, pytest.approx(threshold))


@pytest.mark.parametrize("text, message", [
    ("cosine", "expected METRIC>=NUMBER"),
    ("cosine=0.9", "expected METRIC>=NUMBER"),
    ("cosine==0.9", "expected METRIC>=NUMBER"),
    ("cosine>=", "expected METRIC>=NUMBER"),
    ("accuracy>=0.9", "unknown metric 'accuracy'"),
    ("cosine>=abc", "is not a number"),
    ("cosine>=inf", "finite"),
    ("cosine<=0.9", "backwards"),
    ("maxabs>=0.1", "backwards"),
    ("top1>=1.5", r"lies in \[0, 1\]"),
    ("maxabs<=-1", "lies in"),
    ("cosine>=0.9 top1>=0.9", "expected METRIC>=NUMBER"),
    ("top1>1", "can never hold: top1 is at most 1; use top1>=1"),  # strict at the range's end
    ("cosine>1.0", "can never hold"),
    ("maxabs<0", "can never hold: maxabs is at least 0"),
])
def test_parse_requirement_rejects(text, message):
    with pytest.raises(InvalidArgumentError, match=message):
        F.parse_requirement(text)


def test_parse_requirements_splits_commas_and_lists():
    reqs = F.parse_requirements("cosine>=0.999, top1>=0.99")
    assert [str(r) for r in reqs] == ["cosine>=0.999", "top1>=0.99"]
    assert [str(r) for r in F.parse_requirements(["snr>=30", "maxabs<=0.1,top1>=0.5"])] == ["snr>=30", "maxabs<=0.1", "top1>=0.5"]
    for empty in (" , ", "", [], ["snr>=30", " "]):
        with pytest.raises(InvalidArgumentError, match="empty requirement"):
            F.parse_requirements(empty)
    assert passes.parse_requirement("top1>=0.9") == F.Requirement("top1", ">=", 0.9)


@pytest.mark.parametrize("text", ["top1>=0.9,", ",top1>=0.9", "top1>=0.9,,snr>=20", ["snr>=20", "top1>=0.9, "]])
def test_parse_requirements_refuses_a_stray_comma(text):
    # skipped before, so a requirement lost from the expression went unnoticed
    with pytest.raises(InvalidArgumentError, match="stray comma"):
        F.parse_requirements(text)


def test_requirement_check_and_enforce():
    result = F.FidelityResult(metrics={"cosine": 0.9985, "cosine_min": 0.99, "top1": 1.0, "maxabs": 0.02,
                                       "snr": math.nan}, n_feeds=3, synthesized=False)
    assert F.parse_requirement("top1>=0.99").check(result)
    assert not F.parse_requirement("cosine>=0.999").check(result)
    assert F.parse_requirement("maxabs<=0.05").check(result)
    assert not F.parse_requirement("maxabs<0.02").check(result)
    assert not F.parse_requirement("snr>=-100").check(result)  # NaN never passes
    F.enforce(result, F.parse_requirements("top1>=0.99,maxabs<=0.05"))
    with pytest.raises(FidelityError, match=r"cosine 0.9985 \(required >=0.999\)") as err:
        F.enforce(result, F.parse_requirements("top1>=0.99,cosine>=0.999"))
    assert "top1" not in str(err.value)
    with pytest.raises(InvalidArgumentError, match="not computed"):
        F.parse_requirement("ctc>=0.9").check(result)


# ------------------------------------------------------------------------------ against the corpus's own check.py


def _corpus_check_module(corpus):
    import importlib.util

    spec = importlib.util.spec_from_file_location("corpus_check", corpus.path / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_agree_with_corpus_check_py(corpus):
    """Our ctc and top1 give the corpus reference's numbers on real outputs (ddddocr's CTC head,
    rapidocr's classifier against its float16 conversion)."""
    check = _corpus_check_module(corpus)
    name = "ddddocr_old"
    _, args = corpus.metric(name)
    feeds = F.load_feeds(corpus.feeds(name))[:6]
    outs = F.run_outputs(str(corpus.model(name)), feeds)
    for out in outs:
        y = out[0]
        assert F.ctc_strings(y, args["time_axis"], args["class_axis"], args["blank"]) == \
            check.ctc_strings(y, args["time_axis"], args["class_axis"], args["blank"])
    assert F.ctc_agreement(outs, outs, args["time_axis"], args["class_axis"], args["blank"]) == 1.0

    from conftest import MODELS

    feeds = F.load_feeds(corpus.feeds("rapidocr_cls"))
    ref = F.run_outputs(str(corpus.model("rapidocr_cls")), feeds)
    cand = F.run_outputs(str(MODELS / "rapidocr_cls_fp16.onnx"), feeds)
    text, _ = check.score({"metric": "top1"}, ref, cand)
    ours = F.compute_metrics(ref, cand)
    assert text.startswith(f"agreement {ours['top1']:.4f}")
    text, _ = check.score({"metric": "cosine"}, ref, cand)
    assert text == f"mean {ours['cosine']:.6f} min {ours['cosine_min']:.6f}"


def test_evaluate_run_as_fold_measures_the_folded_weights():
    from tests.unit import modelgen as mg

    model = mg.dense_model("float32", 13)
    q = passes.quantize_weights(model, bits=4, granularity="tensor", min_elements=16)
    feeds = mg.feeds(model)
    as_file = F.evaluate(model, q, feeds=feeds, metric="cosine")
    folded = F.evaluate(model, q, feeds=feeds, metric="cosine", run_as="fold")
    direct = F.evaluate(model, passes.fold_dequantize(q), feeds=feeds, metric="cosine")
    assert folded.metrics["cosine"] == pytest.approx(direct.metrics["cosine"], abs=1e-12)
    assert any("folded" in n for n in folded.notes) and not any("folded" in n for n in as_file.notes)
    with pytest.raises(InvalidArgumentError, match="run_as"):
        F.evaluate(model, q, feeds=feeds, run_as="gpu")


def test_a_model_past_one_protobuf_goes_through_external_data():
    """protobuf's ByteSize raises EncodeError past 2 GiB (upb): such a model is not one protobuf, so the
    session is built from a file with external data (a 2.42 GB model's --require failed to load)."""
    from google.protobuf.message import EncodeError

    class Huge:
        def ByteSize(self):
            raise EncodeError("Failed to serialize proto")

    class Small:
        def ByteSize(self):
            return 1000

    class Big:
        def ByteSize(self):
            return F.FILE_SESSION_BYTES

    assert F._goes_as_bytes(Huge()) is False
    assert F._goes_as_bytes(Small()) is True
    assert F._goes_as_bytes(Big()) is False  # (from FILE_SESSION_BYTES on: through a file too)


# ------------------------------------------------------------------------------ nothing to measure

def test_evaluate_refuses_outputs_that_are_all_non_finite(model, weight):
    """A NaN feed makes every reference value NaN: cosine/snr/maxabs would be computed over
    nothing and read perfect, and a gate would pass an unmeasured model."""
    candidate = linear_model(weight + np.float32(0.5))  # clearly different: the gate must not call it equal
    nan_feed = [{"x": np.full((2, 8), np.nan, np.float32)}]
    with pytest.raises(InvalidArgumentError, match="NaN or infinite.*nothing to measure"):
        F.evaluate(model, candidate, feeds=nan_feed)
    inf_feed = [{"x": np.full((2, 8), np.inf, np.float32)}]
    with pytest.raises(InvalidArgumentError, match="nothing to measure"):
        F.evaluate(model, candidate, feeds=inf_feed)


def test_evaluate_measures_the_finite_part_and_says_so(model, weight):
    """One NaN feed among finite ones is measured on the rest (noted), not refused."""
    candidate = linear_model(weight + np.float32(0.5))
    rng = np.random.default_rng(3)
    feeds = [{"x": np.full((2, 8), np.nan, np.float32)}, {"x": rng.standard_normal((2, 8)).astype(np.float32)}]
    result = F.evaluate(model, candidate, feeds=feeds)
    assert result.metrics["snr"] < 40  # the finite feed's real difference, not inf
    assert any("NaN or infinite" in note for note in result.notes)


def test_require_measurable_counts_integer_outputs_as_measured():
    nan = [[np.full(3, np.nan, np.float32)]]
    with pytest.raises(InvalidArgumentError, match="synthesised inputs"):
        F.require_measurable(nan, synthesized=True)
    F.require_measurable([[np.full(3, np.nan, np.float32), np.arange(3)]])  # an integer output is measured
    with pytest.raises(InvalidArgumentError, match="hold no values"):  # nothing at all: nothing measured
        F.require_measurable([[np.zeros(0, np.float32)]])


def test_auto_target_refuses_feeds_with_nothing_to_measure(model):
    nan_feed = [{"x": np.full((2, 8), np.nan, np.float32)}]
    with pytest.raises(InvalidArgumentError, match="nothing to measure"):
        passes.compress(model, target="cosine>=0.999", feeds=nan_feed)


def _typed_input_model(elem_type) -> onnx.ModelProto:
    """y = float(x) @ W with x of `elem_type`: a valid model onnxruntime runs, fed from C."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["xf", "W"], ["y"])],
        "typed",
        [helper.make_tensor_value_info("x", elem_type, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("elem_type", [TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN])
def test_inputs_python_cannot_feed_get_one_clear_error(elem_type):
    """onnxruntime's Python API takes no numpy array of these types: synthesised or given feeds, the
    error names the input and its type as an argument problem (the model itself is valid)."""
    import ml_dtypes

    model = _typed_input_model(elem_type)
    onnx.checker.check_model(model, full_check=True)
    with pytest.raises(InvalidArgumentError, match=r"input 'x' is (BFLOAT16|FLOAT8E4M3FN): onnxruntime's Python API"):
        F.synthesize_feeds(model)
    dtype = ml_dtypes.bfloat16 if elem_type == TensorProto.BFLOAT16 else ml_dtypes.float8_e4m3fn
    feeds = [{"x": np.ones((1, 4), dtype)}]
    with pytest.raises(InvalidArgumentError, match="input 'x' is"):
        F.feed_list(feeds, model, "")
    with pytest.raises(InvalidArgumentError, match="input 'x' is"):
        F.run_outputs(model, feeds)
    with pytest.raises(InvalidArgumentError, match="input 'x' is"):
        passes.compress(model, target="snr>=20", feeds=feeds)


def test_an_output_beside_output0_that_moved_is_named():
    """top1/cosine read output 0 only: another output far below it is named in a note, with the way
    to hold it; outputs that moved alike give no note."""
    rng = np.random.default_rng(0)
    w0, w1 = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 4)).astype(np.float32)

    def two_outputs(a, b):
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "A"], ["scores"]), helper.make_node("MatMul", ["x", "B"], ["boxes"])],
            "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
            [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 4]),
             helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [2, 4])],
            [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    feeds = [{"x": rng.standard_normal((2, 8)).astype(np.float32)} for _ in range(3)]
    src = two_outputs(w0, w1)
    moved = F.evaluate(src, two_outputs(w0 * 1.0001, w1 + 0.3 * rng.standard_normal(w1.shape).astype(np.float32)),
                       feeds=feeds)
    assert any("'boxes'" in n and "snr_min>=" in n for n in moved.notes), moved.notes
    alike = F.evaluate(src, two_outputs(w0 * 1.001, w1 * 1.001), feeds=feeds)
    assert not any("output 0 only" in n for n in alike.notes)
    assert not any("pooled" in n for n in alike.notes)
    # snr pools every output: 'scores' 100x smaller than 'boxes' sits ~20 dB below the pooled
    # figure, which 'boxes' sets (no output is far below output 0 here: only the pooled note)
    small = two_outputs(w0 * 0.01, w1)
    noisy = (w0 + 0.1 * rng.standard_normal(w0.shape).astype(np.float32)) * 0.01
    pooled = F.evaluate(small, two_outputs(noisy, w1 * 1.01), feeds=feeds)
    assert pooled.metrics["snr"] - pooled.metrics["snr_min"] > 10
    assert any("'scores'" in n and "below the pooled snr" in n for n in pooled.notes), pooled.notes
    assert not any("output 0 only" in n for n in pooled.notes)


# ------------------------------------------------------------------------------ index-like inputs


def _recurrent(op: str, layout: int = 0, x_dims=("T", "B", 8), lens_name="seq", computed_x=False) -> onnx.ModelProto:
    """One RNN / GRU / LSTM whose sequence_lens is a graph input (int32, through a Cast from int64
    when named 'ids'), X either the graph input or a Transpose of it (computed: only shape
    inference knows its seq_length)."""
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    h, i = 4, 8
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1, gates * h, i)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((1, gates * h, h)).astype(np.float32), "R")]
    nodes, x = [], "x"
    if computed_x:  # x arrives [B, T, 8] and is transposed to the layout the op reads
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2] if layout == 0 else [0, 1, 2]))
        x = "xt"
    lens_type = TensorProto.INT64 if lens_name == "ids" else TensorProto.INT32
    lens = lens_name
    if lens_type == TensorProto.INT64:
        nodes.append(helper.make_node("Cast", [lens_name], ["lens32"], to=TensorProto.INT32))
        lens = "lens32"
    nodes.append(helper.make_node(op, [x, "W", "R", "", lens], ["y"], hidden_size=h, layout=layout))
    batch_axis = 1 if layout == 0 and not computed_x else 0
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_dims)),
              helper.make_tensor_value_info(lens_name, lens_type, [x_dims[batch_axis]])]
    g = helper.make_graph(nodes, "rec", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("case", ["fixed", "dynamic", "layout1", "computed", "cast"])
def test_synthesised_sequence_lens_are_within_the_sequence(op, case):
    """sequence_lens got token ids in [0, 100) (or 64 for a name with 'length'): onnxruntime
    refused the run ('Invalid sequence length') and no such model could be measured without feeds."""
    model, length = {
        "fixed": (lambda: _recurrent(op, x_dims=(5, 3, 8)), 5),
        "dynamic": (lambda: _recurrent(op, lens_name="sequence_length"), F.DEFAULT_DIM),
        "layout1": (lambda: _recurrent(op, layout=1, x_dims=(3, 7, 8)), 7),
        "computed": (lambda: _recurrent(op, x_dims=(3, 6, 8), computed_x=True), 6),
        "cast": (lambda: _recurrent(op, x_dims=(9, 2, 8), lens_name="ids"), 9),
    }[case]
    model = model()
    feeds = F.synthesize_feeds(model, n=3)
    lens_name = model.graph.input[1].name
    values = np.concatenate([f[lens_name].ravel() for f in feeds])
    assert values.min() >= 1 and values.max() <= length
    if case != "layout1":  # (onnxruntime's CPU kernels refuse layout=1 outright)
        assert len(F.run_outputs(model, feeds)) == 3  # onnxruntime runs every feed


def test_gather_bounds_follow_a_cast_table_and_a_branch():
    """Token ids index a float16 table cast to float32 (a keep_io_types converter's form), and a
    second table only inside an If branch: both tables' rows bound the synthesised ids."""
    rng = np.random.default_rng(0)
    table16 = numpy_helper.from_array(rng.standard_normal((30, 4)).astype(np.float16), "table16")
    small = numpy_helper.from_array(rng.standard_normal((7, 4)).astype(np.float32), "small")
    branch = helper.make_graph([helper.make_node("Gather", ["small", "ids"], ["b_out"])], "then", [],
                               [helper.make_tensor_value_info("b_out", TensorProto.FLOAT, None)], [small])
    other = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["o_out"])], "else", [],
                              [helper.make_tensor_value_info("o_out", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Cast", ["table16"], ["table"], to=TensorProto.FLOAT),
             helper.make_node("Gather", ["table", "ids"], ["emb"]),
             helper.make_node("If", ["flag"], ["picked"], then_branch=branch, else_branch=other),
             helper.make_node("Add", ["emb", "picked"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5]),
                                       helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table16])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert F.gather_index_bounds(model) == {"ids": 7}
    feeds = F.synthesize_feeds(model, n=4)
    assert max(int(f["ids"].max()) for f in feeds) < 7
    F.run_outputs(model, feeds)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_a_recurrent_input_is_synthesised_with_time_steps(op):
    """X [?, ?, 8] of a recurrent op (layout 0: time first): the first dynamic axis is its sequence,
    not a batch; it got 1 step (a one-step sequence measures little of a recurrence). Now `dim`
    steps of batch 1, and sequence_lens within them."""
    model = _recurrent(op, x_dims=(None, None, 8))
    feeds = F.runnable_feeds(model, n=2)
    assert feeds[0]["x"].shape == (F.DEFAULT_DIM, 1, 8)
    assert all(1 <= int(f["seq"].max()) <= F.DEFAULT_DIM and f["seq"].shape == (1,) for f in feeds)
    assert len(F.run_outputs(model, feeds)) == 2
