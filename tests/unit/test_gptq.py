"""GPTQ-style error-feedback rounding: lower output error than nearest rounding at the same
scales, correct patches for Conv, Hessians from onnxruntime runs, levels written into the graph."""
import numpy as np
import onnx
import pytest

import modelgen as mg
import passes
from passes import gptq


def _correlated_inputs(n, k, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    return rng.standard_normal((n, k)) @ mix


def test_error_feedback_beats_nearest_on_the_output():
    rng = np.random.default_rng(1)
    k, n = 96, 40
    w = rng.standard_normal((k, n)) * 0.1
    x = _correlated_inputs(2000, k)
    h = x.T @ x / len(x)
    qmax = 7  # 4 bits
    scale = np.abs(w).max(axis=0) / qmax
    q_near = np.clip(np.rint(w / scale), -qmax, qmax)
    q_gptq = gptq.gptq_levels(w, h, scale, -qmax, qmax)
    assert q_gptq.dtype == np.int32 and q_gptq.min() >= -qmax and q_gptq.max() <= qmax
    err_near = np.sum((x @ (w - q_near * scale)) ** 2)
    err_gptq = np.sum((x @ (w - q_gptq * scale)) ** 2)
    assert err_gptq < 0.8 * err_near


def test_im2col_matches_convolution():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    node = onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 0, 1, 2], strides=[2, 1])
    patches = gptq._im2col(x, node, (3, 3), np.random.default_rng(0))
    model = mg._model([node], [onnx.helper.make_tensor_value_info("x", 1, list(x.shape))],
                      [onnx.helper.make_tensor_value_info("y", 1, [2, 5, 5, 8])], [mg.tensor("w", w)], 13)
    y = mg.run(model, [{"x": x}])[0]  # (2, 5, oh, ow)
    got = patches @ w.reshape(5, -1).T  # one row per sampled position
    ref = y.transpose(0, 2, 3, 1).reshape(-1, 5)
    # every patch row is one of the output positions
    d = np.abs(got[:, None, :] - ref[None, :, :]).max(axis=2).min(axis=1)
    assert patches.shape[1] == 27 and np.all(d < 1e-4)


def test_hessians_from_runs_and_levels_in_graph():
    m = mg.dense_model()
    f = mg.feeds(m, n=4)
    names = ["W1", "W2", "W3"]
    hess = gptq.collect_hessians(m, f, names)
    assert set(hess) == {"W2", "W3"}  # W1 is read by two nodes: left to plain rounding
    assert hess["W2"].shape == (48, 48) and hess["W3"].shape == (32, 32)
    q = passes.quantize_weights(m, bits=4, include=["W2", "W3"])
    refined = gptq.refine(q, m, hess, 4)
    assert set(refined) == {"W2", "W3"}
    out = gptq.write_levels(q, {n: lv for n, (lv, _) in refined.items()})
    onnx.checker.check_model(out, full_check=True)
    ref = mg.run(m, f)
    err_plain = sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(q, f)))
    err_gptq = sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(out, f)))
    assert err_gptq < err_plain
    # the dequantized arrays refine() reports are what the graph computes
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in passes.fold_dequantize(out).graph.initializer}
    for n, (_, deq) in refined.items():
        assert np.array_equal(folded[n], deq)


def test_compress_uses_error_feedback_for_conv():
    m = mg.conv_model()
    f = mg.feeds(m, n=4)
    _, rep = passes.compress(m, target="cosine>=0.99", feeds=f, bits=[3, 4, 5, 6])
    assert rep["met_on_feeds"]
    assert any(r["form"].endswith("/gptq") for r in rep["tensors"])
