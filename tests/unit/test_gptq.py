"""GPTQ-style error-feedback rounding: lower output error than nearest rounding at the same
scales, correct patches for Conv, Hessians from onnxruntime runs, levels written into the graph."""
import numpy as np
import onnx
import pytest

import modelgen as mg
import passes
from passes import gptq


def test_error_feedback_beats_nearest_on_the_output():
    rng = np.random.default_rng(1)
    k, n = 96, 40
    w = rng.standard_normal((k, n)) * 0.1
    x = mg.correlated_inputs(2000, k)
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


def _layer_case(seed=1, k=96, n=40, rows=2000):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)) * 0.1
    x = mg.correlated_inputs(rows, k, seed) * rng.uniform(0.2, 3.0, size=k)  # uneven input energies
    return w, x, x.T @ x / len(x)


def _out_err(x, w, q, s):
    return float(np.sum((x @ (w - q * s)) ** 2))


def test_act_order_keeps_levels_valid_and_beats_nearest():
    w, x, h = _layer_case()
    qmax = 7
    scale = np.abs(w).max(axis=0) / qmax
    order = gptq.activation_order(h)
    assert sorted(order.tolist()) == list(range(len(h)))
    assert np.all(np.diff(np.diag(h)[order]) <= 0)
    q = gptq.gptq_levels(w, h, scale, -qmax, qmax, order=order)
    assert q.dtype == np.int32 and q.min() >= -qmax and q.max() <= qmax
    q_near = np.clip(np.rint(w / scale), -qmax, qmax)
    assert _out_err(x, w, q, scale) < 0.8 * _out_err(x, w, q_near, scale)
    # the factor computed for that order gives the same levels
    f = gptq.inverse_factor(h, order=order)
    assert np.array_equal(gptq.gptq_levels(w, h, scale, -qmax, qmax, order=order, factor=f), q)


def test_strong_damping_tends_to_nearest_rounding():
    w, _, h = _layer_case()
    qmax = 7
    scale = np.abs(w).max(axis=0) / qmax
    q_near = np.clip(np.rint(w / scale), -qmax, qmax)
    changed = [np.mean(gptq.gptq_levels(w, h, scale, -qmax, qmax, damp=d) != q_near) for d in (0.01, 1.0, 1e4)]
    assert changed[0] > changed[1] > changed[2] and changed[2] < 0.01


def test_blocked_scales_follow_their_inputs():
    w, x, h = _layer_case(k=100)
    qmax = 7
    bs = 32
    nb = -(-100 // bs)
    scale = np.stack([np.abs(w[i * bs:(i + 1) * bs]).max(axis=0) / qmax for i in range(nb)])  # (nb, N)
    rows = gptq.row_scales(scale, 100, bs)
    assert rows.shape == (100, 40) and np.array_equal(rows[99], scale[3]) and np.array_equal(rows[31], scale[0])
    q = gptq.gptq_levels(w, h, scale, -qmax, qmax, block_size=bs, order=gptq.activation_order(h))
    assert q.min() >= -qmax and q.max() <= qmax
    q_near = np.clip(np.rint(w / rows), -qmax, qmax)
    assert _out_err(x, w, q, rows) < 0.8 * _out_err(x, w, q_near, rows)


def test_rate_aware_levels_inside_the_loop_cost_fewer_bits():
    from passes import rounding as rd

    w, x, h = _layer_case(k=128, n=64)
    qmax = 7
    scale = np.abs(w).max(axis=0) / qmax
    plain = gptq.gptq_levels(w, h, scale, -qmax, qmax)
    rated = gptq.gptq_levels(w, h, scale, -qmax, qmax, lam=0.3)
    ent = lambda q: rd.entropy_bits(np.bincount((q + qmax).ravel(), minlength=2 * qmax + 1))  # noqa: E731
    assert ent(rated) < ent(plain)
    assert rated.min() >= -qmax and rated.max() <= qmax
    q_near = np.clip(np.rint(w / scale), -qmax, qmax)
    assert _out_err(x, w, rated, scale) < _out_err(x, w, q_near, scale)


def test_refine_options_write_a_model_that_runs_and_folds_bit_exactly():
    m = mg.dense_model()
    f = mg.feeds(m, n=4)
    hess = gptq.collect_hessians(m, f, ["W2", "W3"])
    imp = gptq.input_importance(m, hess)
    assert imp["W2"].shape == (48, 1) and np.all(imp["W2"] >= 0)
    q = passes.quantize_weights(m, bits=4, include=["W2", "W3"], rounding="rdo", importance=imp)
    factors = {}
    refined = gptq.refine(q, m, hess, 4, damp=0.3, act_order=True, factors=factors)
    assert set(refined) == {"W2", "W3"} and ("W2", True, 0.3) in factors
    out = gptq.write_levels(q, {n: lv for n, (lv, _) in refined.items()})
    onnx.checker.check_model(out, full_check=True)
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in passes.fold_dequantize(out).graph.initializer}
    for n, (_, deq) in refined.items():
        assert np.array_equal(folded[n], deq)
    ref = mg.run(m, f)
    got = mg.run(out, f)
    assert all(mg.cosine(a, b) > 0.99 for a, b in zip(ref, got))


def test_conv1d_hessian_and_levels():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((6, 4, 3)) * 0.3).astype(np.float32)
    node = onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 2], strides=[2], dilations=[2])
    x_info = onnx.helper.make_tensor_value_info("x", 1, [1, 4, 20])
    y_info = onnx.helper.make_tensor_value_info("y", 1, [1, 6, 10])
    model = mg._model([node], [x_info], [y_info], [mg.tensor("w", w)], 13)
    feeds = [{"x": rng.standard_normal((1, 4, 20)).astype(np.float32)} for _ in range(3)]
    hess = gptq.collect_hessians(model, feeds, ["w"])
    assert hess["w"].shape == (12, 12)
    # H is the mean outer product of the patches the convolution multiplies with w: check it
    # through y = patches @ w: mean ||y||^2 per position = sum_o w_o^T H w_o
    ys = [mg.run(model, [f])[0] for f in feeds]
    energy = np.mean([np.mean(np.sum(y[0] ** 2, axis=0)) for y in ys])
    mat = w.reshape(6, -1).T.astype(np.float64)
    assert np.isclose(np.einsum("kn,kn->", mat, hess["w"] @ mat), energy, rtol=1e-4)
    q = passes.quantize_weights(model, bits=4, include=["w"])
    refined = gptq.refine(q, model, hess, 4, damp=0.3)
    assert refined["w"][0].shape == (6, 4, 3)


def test_quantize_with_feedback_recipe():
    m = mg.dense_model()
    f = mg.feeds(m, n=60)  # 4 rows each: 30 feeds = 120 activation rows for 48 inputs
    cal, held = f[:30], f[30:]
    rep = passes.Report()
    out = gptq.quantize_with_feedback(m, cal, bits=4, report=rep)
    onnx.checker.check_model(out, full_check=True)
    assert any("error feedback" in n for n in rep.notes)
    plain = passes.quantize_weights(m, bits=4, rounding="rdo")
    # same graph form and scales as the quantize pass made; only levels differ
    scales = lambda mm: {t.name: onnx.numpy_helper.to_array(t) for t in mm.graph.initializer if t.name.endswith("_scale")}  # noqa: E731
    assert all(np.array_equal(a, scales(plain)[k]) for k, a in scales(out).items())
    ref = mg.run(m, held)
    err = lambda mm: sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(mm, held, matmulnbits_accuracy=0)))  # noqa: E731
    assert err(out) < err(plain)
    folded = passes.fold_dequantize(out)
    # (MatMulNBits at accuracy level 0: float compute, as the folded model does)
    for a, b in zip(mg.run(out, held, matmulnbits_accuracy=0), mg.run(folded, held)):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(passes.InvalidArgumentError, match="feeds"):
        gptq.quantize_with_feedback(m, [], bits=4)
    with pytest.raises(passes.InvalidArgumentError, match="act_order"):
        gptq.quantize_with_feedback(m, f[:1], bits=4, act_order="yes")
    with pytest.raises(passes.InvalidArgumentError, match="damp"):
        gptq.quantize_with_feedback(m, f[:1], bits=4, damp=0)


def test_quantize_with_feedback_conv_damp():
    m = mg.conv_model()
    f = mg.feeds(m, n=4)
    rep = passes.Report()
    out = gptq.quantize_with_feedback(m, f, bits=4, conv_damp=0.3, report=rep)
    onnx.checker.check_model(out, full_check=True)
    note = next(n for n in rep.notes if "error feedback" in n)
    assert "Conv damp 0.3" in note and "of 0 weights" not in note
    plain = passes.quantize_weights(m, bits=4, rounding="rdo")
    lv = lambda mm: {t.name: onnx.numpy_helper.to_array(t) for t in mm.graph.initializer if t.name.endswith("_quantized")}  # noqa: E731
    assert any(not np.array_equal(a, lv(plain)[k]) for k, a in lv(out).items())
    for a, b in zip(mg.run(m, f), mg.run(passes.fold_dequantize(out), f)):
        assert mg.cosine(a, b) > 0.95
