"""Scales refitted to error-fed levels (gptq.refine(refit_scales=True)): the least-squares scale
per output channel, lower output error than the clip search's scale, written with the levels
(gptq.write_levels with (levels, scale)) so that the graph computes what refine reports."""
import numpy as np
import onnx
import pytest

import modelgen as mg
import passes
from passes import InvalidArgumentError, gptq


def test_refit_scale_is_the_least_squares_scale():
    rng = np.random.default_rng(3)
    k, n = 64, 12
    w = rng.standard_normal((k, n)) * 0.1
    x = mg.correlated_inputs(1000, k, seed=1)
    h = x.T @ x / len(x)
    scale = np.abs(w).max(axis=0) / 7
    q = gptq.gptq_levels(w, h, scale, -7, 7)
    fit = gptq.refit_scale(w, h, q, scale)

    def err(s):
        return np.sum((x @ (w - q * s)) ** 2, axis=0)

    assert np.all(err(fit) <= err(scale) * (1 + 1e-9))
    for f in (0.99, 1.01):  # a minimum: moving the scale either way costs
        assert np.all(err(fit) <= err(fit * f))
    # a column of zero levels keeps its scale
    q[:, 0] = 0
    assert gptq.refit_scale(w, h, q, scale)[0] == scale[0]


@pytest.mark.parametrize("model", ["dense", "conv"])
def test_refit_lowers_the_output_error_and_the_graph_computes_it(model):
    m = mg.dense_model() if model == "dense" else mg.conv_model()
    f = mg.feeds(m, n=4)
    names = [t.name for t in m.graph.initializer if len(t.dims) >= 2]
    hess = gptq.collect_hessians(m, f, names)
    assert hess
    q = passes.quantize_weights(m, bits=4, include=list(hess))
    plain = gptq.refine(q, m, hess, 4)
    refit = gptq.refine(q, m, hess, 4, refit_scales=True)
    assert set(refit) == set(plain)
    out_plain = gptq.write_levels(q, {n: lv for n, (lv, _) in plain.items()})
    out = gptq.write_levels(q, {n: (lv, sc) for n, (lv, _, sc) in refit.items()})
    onnx.checker.check_model(out, full_check=True)
    # what refine reports is what the graph computes, the refitted scale included
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in passes.fold_dequantize(out).graph.initializer}
    for n, (_, deq, sc) in refit.items():
        assert np.array_equal(folded[n], deq)
        stored = next(onnx.numpy_helper.to_array(t) for t in out.graph.initializer if t.name == n + "_scale")
        assert stored.dtype == sc.dtype and np.array_equal(stored, sc)
    # each layer's output error on the calibration activations (through its Hessian) is lower
    w = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer}
    cons = gptq.consumers(m, hess)
    for n, h in hess.items():
        node = cons[n][0]

        def layer_err(deq):
            e, _ = gptq.as_matrix(w[n] - deq.astype(np.float64), node.op_type, bool(gptq._attr(node, "transB", 0)))
            return float(np.einsum("kn,kn->", e, h @ e))
        assert layer_err(refit[n][1]) < layer_err(plain[n][1])
    if model == "dense":  # and so is the model's
        ref = mg.run(m, f)
        err_plain = sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(out_plain, f)))
        err_refit = sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(out, f)))
        assert err_refit < err_plain
    assert [t.name for t in q.graph.initializer] == [t.name for t in out.graph.initializer]  # q untouched, same layout


def test_refit_keeps_the_float16_scale_type():
    m = mg.conv_model("float16")
    f = mg.feeds(m, n=4)
    hess = gptq.collect_hessians(m, f, [t.name for t in m.graph.initializer if len(t.dims) >= 2])
    q = passes.quantize_weights(m, bits=5, include=list(hess))
    refit = gptq.refine(q, m, hess, 5, refit_scales=True)
    assert refit
    for n, (lv, deq, sc) in refit.items():
        assert sc.dtype == np.float16 and deq.dtype == np.float16 and np.all(sc > 0)
    out = gptq.write_levels(q, {n: (lv, sc) for n, (lv, _, sc) in refit.items()})
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in passes.fold_dequantize(out).graph.initializer}
    for n, (_, deq, _) in refit.items():
        assert np.array_equal(folded[n], deq)


def test_a_shared_scale_is_not_overwritten():
    m = mg.dense_model()
    f = mg.feeds(m, n=4)
    hess = gptq.collect_hessians(m, f, ["W2"])
    q = passes.quantize_weights(m, bits=4, include=["W2"])
    lv, _, sc = gptq.refine(q, m, hess, 4, refit_scales=True)["W2"]
    dq = next(n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "W2")
    shared = onnx.ModelProto()
    shared.CopyFrom(q)
    shared.graph.node.append(onnx.helper.make_node("Identity", [dq.input[1]], ["scale_copy"]))
    with pytest.raises(InvalidArgumentError, match="shared"):
        gptq.write_levels(shared, {"W2": (lv, sc)})
