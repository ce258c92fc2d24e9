"""Fidelity metrics on outputs holding NaN or infinity, as unseen models make them (a masked
logit at -inf, a log of zero, a broken candidate that outputs NaN): a NaN or infinity the
candidate shares with the original is a match; one on either side alone is the worst value of
each metric, never a pass (a NaN output used to read as maxabs 0 and pass 'maxabs<=...')."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.fidelity import compute_metrics, parse_requirement


def _runs(*outputs):
    return [[np.asarray(o, np.float32)] for o in outputs]


REF = [[0.5, -1.0, 2.0, 0.25], [1.0, 3.0, -2.0, 0.5]]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_candidate_value_is_the_worst_of_every_metric(bad):
    cand = np.array(REF, np.float32)
    cand[1, 2] = bad
    m = compute_metrics(_runs(REF), _runs(cand))
    assert m["maxabs"] == math.inf and m["snr"] == -math.inf and m["cosine_min"] == 0.0, m
    for gate in ("maxabs<=0.1", "snr>=20", "cosine>=0.5"):
        assert not parse_requirement(gate).check(passes.FidelityResult(metrics=m, n_feeds=1, synthesized=False))


def test_non_finite_values_shared_with_the_reference_are_matches():
    ref = np.array(REF, np.float32)
    ref[0, 1] = -np.inf  # a masked logit
    ref[1, 3] = np.nan
    cand = ref.copy()
    cand[0, 0] += 0.01
    m = compute_metrics(_runs(ref), _runs(cand))
    assert m["maxabs"] == pytest.approx(0.01, abs=1e-6)
    assert math.isfinite(m["snr"]) and m["snr"] > 30
    assert 0.999 < m["cosine"] <= 1.0
    same = compute_metrics(_runs(ref), _runs(ref))
    assert same["maxabs"] == 0.0 and same["snr"] == math.inf and same["cosine"] == 1.0


def test_a_non_finite_reference_value_the_candidate_lacks_breaks_the_match():
    ref = np.array(REF, np.float32)
    ref[0, 1] = -np.inf
    m = compute_metrics(_runs(ref), _runs(REF))
    assert m["maxabs"] == math.inf and m["snr"] == -math.inf


def _matmul(w):
    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 32])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 16])],
                          [numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_evaluate_a_candidate_with_a_broken_weight(bad):
    # before: NaN gave maxabs 0 (gate passed), inf raised ValueError (math domain error, exit 70)
    w = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    broken = w.copy()
    broken[3, 5] = bad
    r = passes.evaluate(_matmul(w), _matmul(broken))
    assert r.metrics["maxabs"] == math.inf and r.metrics["snr"] == -math.inf
    same = passes.evaluate(_matmul(broken), _matmul(broken))
    assert same.metrics["maxabs"] == 0.0 and same.metrics["snr"] == math.inf
    assert any("NaN or infinite" in n for n in same.notes), same.notes


def _bert_embeddings():
    """A BERT-style embedding: word and token-type tables (2 rows) gathered and added, then a
    dense layer, with BERT's three integer inputs named as tokenizers name them."""
    rng = np.random.default_rng(0)
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
            for n in ("input_ids", "attention_mask", "token_type_ids")]
    inits = [numpy_helper.from_array(rng.standard_normal((1000, 32)).astype(np.float32), "word"),
             numpy_helper.from_array(rng.standard_normal((2, 32)).astype(np.float32), "token_type"),
             numpy_helper.from_array((rng.standard_normal((32, 16)) / 6).astype(np.float32), "dense")]
    nodes = [helper.make_node("Gather", ["word", "input_ids"], ["w"]),
             helper.make_node("Gather", ["token_type", "token_type_ids"], ["t"]),
             helper.make_node("Add", ["w", "t"], ["e"]),
             helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["m", "axis"], ["m3"]),
             helper.make_node("Mul", ["e", "m3"], ["em"]),
             helper.make_node("MatMul", ["em", "dense"], ["y"])]
    inits.append(numpy_helper.from_array(np.array([2], np.int64), "axis"))
    g = helper.make_graph(nodes, "bert", ints, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_bert_runs_on_synthesised_feeds():
    # token ids in [0, 100) were out of range for the 2-row token-type table at every size
    m = _bert_embeddings()
    feeds = passes.synthesize_feeds(m, n=2)
    assert int(feeds[0]["token_type_ids"].max()) <= 1
    r = passes.evaluate(m, passes.quantize_weights(m))
    assert r.synthesized and r.metrics["cosine"] > 0.99


def test_index_bounds_follow_casts_and_reshapes_and_compressed_tables():
    m = _bert_embeddings()
    g = m.graph
    # token_type_ids reaches its table through Cast + Reshape; the word table is read compressed
    g.node[1].input[1] = "tt_shaped"
    g.node.insert(1, helper.make_node("Reshape", ["tt32", "tt_shape"], ["tt_shaped"]))
    g.node.insert(1, helper.make_node("Cast", ["token_type_ids"], ["tt32"], to=TensorProto.INT32))
    g.initializer.append(numpy_helper.from_array(np.array([1, -1], np.int64), "tt_shape"))
    q = passes.quantize_weights(m)
    assert passes.fidelity.gather_index_bounds(m) == {"input_ids": 1000, "token_type_ids": 2}
    assert passes.fidelity.gather_index_bounds(q)["token_type_ids"] == 2
    assert passes.fidelity.gather_index_bounds(q)["input_ids"] == 1000
    feeds = passes.synthesize_feeds(q, n=3)
    assert all(int(f["token_type_ids"].max()) <= 1 for f in feeds)
    assert max(int(f["input_ids"].max()) for f in feeds) > 1  # ids keep their [0, 100) range


def test_runnable_feeds_stops_growing_when_the_size_is_not_what_fails(monkeypatch):
    # a model that fails the same way at every size: trying 16000-wide inputs on a transformer
    # took 21 GB to learn nothing
    tried = []

    class Refusing:
        def get_inputs(self):
            return []

        def run(self, outputs, feed):
            tried.append({k: v.shape for k, v in feed.items()})
            raise RuntimeError("indices element out of data bounds, idx=7 must be within [-2,1]")

    monkeypatch.setattr(passes.fidelity, "_session", lambda *a, **k: Refusing())
    monkeypatch.setattr(passes.fidelity, "_conform", lambda feed, session, i: feed)
    m = _bert_embeddings()
    feeds = passes.runnable_feeds(m, n=1)
    assert len(tried) == 2  # 64, then 256 with the same message: stop
    assert feeds[0]["input_ids"].shape == (1, 64)
