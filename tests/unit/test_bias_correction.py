"""Bias correction: the mean output shift of rounded weights folded into the layers' biases.
The shift is checked against brute force (the float layer run with W - W_hat), the corrected
model's mean output error against the uncorrected one's, and the weights' levels stay the same."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import modelgen as mg
import passes
from passes import bias_correction as bc
from passes import graph


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _positive_feeds(shape, n=6, seed=0):
    """Inputs with a large mean (as after a ReLU): where rounding's mean error shows."""
    rng = np.random.default_rng(seed)
    return [{"x": (rng.random(shape) * 2).astype(np.float32)} for _ in range(n)]


def _check(model):
    onnx.checker.check_model(model, full_check=True)


def _matmul_add_model():
    w = mg.weight((64, 48), seed=1)
    b = mg.weight((48,), seed=2)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["y"])]
    return mg._model(nodes, [_vi("x", [None, 64])], [_vi("y", [None, 48])], [mg.tensor("W", w), mg.tensor("B", b)], 13)


def _mean_error(model, other, feeds):
    a = np.concatenate(mg.run(model, feeds))
    b = np.concatenate(mg.run(other, feeds))
    return float(np.sqrt(np.mean((a - b).mean(axis=0) ** 2))), float(np.sqrt(np.mean((a - b) ** 2)))


def test_matmul_add_mean_error_removed_levels_unchanged():
    m = _matmul_add_model()
    calib, held = _positive_feeds((256, 64), seed=0), _positive_feeds((256, 64), seed=1)
    q = passes.quantize_weights(m, bits=3, min_elements=16)
    rep = passes.Report()
    c = bc.correct_bias(q, m, calib, report=rep)
    _check(c)
    mean_q, rms_q = _mean_error(m, q, held)
    mean_c, rms_c = _mean_error(m, c, held)
    assert mean_q > 0.02 and mean_c < 0.15 * mean_q  # the shift is gone on inputs it was not measured on
    assert rms_c < rms_q
    # the weights' levels and scales are those of the quantized model: only the bias moved
    qi, ci = graph.unique_initializers(q), graph.unique_initializers(c)
    for name in ("W_quantized", "W_scale"):
        assert qi[name].raw_data == ci[name].raw_data
    assert qi["B"].raw_data != ci["B"].raw_data
    # and the model folds bit-exactly to the same float weights as before
    fq, fc = graph.unique_initializers(passes.fold_dequantize(q)), graph.unique_initializers(passes.fold_dequantize(c))
    assert fq["W"].raw_data == fc["W"].raw_data
    assert any("bias correction on 1 of 1" in n for n in rep.notes)


def _conv_model(group=1, pads=(1, 1, 1, 1), strides=(1, 1), with_bias=False, follow=None, c_in=8, c_out=8):
    w = mg.weight((c_out, c_in // group, 3, 3), seed=3)
    inits = [mg.tensor("W", w)]
    inputs = ["x", "W"]
    if with_bias:
        inits.append(mg.tensor("CB", mg.weight((c_out,), seed=4)))
        inputs.append("CB")
    conv_out = "y" if follow is None else "c"
    nodes = [helper.make_node("Conv", inputs, [conv_out], group=group, pads=list(pads), strides=list(strides))]
    if follow == "bn":
        rng = np.random.default_rng(5)
        vals = {"g": rng.random(c_out) + 0.5, "beta": rng.standard_normal(c_out), "mean": rng.standard_normal(c_out),
                "var": rng.random(c_out) + 0.5}
        for k, v in vals.items():  # as Constant nodes (as exporters write them)
            nodes.insert(0, helper.make_node("Constant", [], [k], value=onnx.numpy_helper.from_array(v.astype(np.float32), k)))
        nodes.append(helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["y"]))
    elif follow == "add":
        inits.append(mg.tensor("AB", mg.weight((1, c_out, 1, 1), seed=6)))
        nodes.append(helper.make_node("Add", ["c", "AB"], ["y"]))
    return mg._model(nodes, [_vi("x", [None, c_in, 10, 9])], [_vi("y", [None, c_out, None, None])], inits, 13)


@pytest.mark.parametrize("group,pads,strides", [(1, (1, 1, 1, 1), (1, 1)), (1, (0, 2, 1, 0), (2, 1)), (4, (1, 1, 1, 1), (2, 2)),
                                                (8, (1, 0, 1, 0), (1, 1))])
def test_conv_shift_equals_the_mean_output_of_the_weight_error(group, pads, strides):
    """bias_shift (tap means, padding and groups included) against the float Conv run with W - W_hat."""
    m = _conv_model(group, pads, strides)
    feeds = _positive_feeds((2, 8, 10, 9), n=3)
    t = bc.bias_targets(m, ["W"])["W"]
    assert t.op == "Conv" and t.bias == "" and t.channels == 8
    mean = bc.input_means(m, feeds, {"W": t})["W"]
    w = graph.tensor_to_array(graph.unique_initializers(m)["W"])
    w_hat = np.round(w * 3) / 3
    shift = bc.bias_shift(t, mean, w, w_hat)
    err = onnx.ModelProto()
    err.CopyFrom(m)
    del err.graph.initializer[:]
    err.graph.initializer.append(mg.tensor("W", (w - w_hat).astype(np.float32)))
    out = np.concatenate(mg.run(err, feeds))
    np.testing.assert_allclose(shift, out.mean(axis=(0, 2, 3)), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("follow", [None, "bn", "add", "bias"])
def test_conv_corrected_through_its_bias_bn_or_add(follow):
    m = _conv_model(with_bias=follow == "bias", follow=None if follow == "bias" else follow)
    calib, held = _positive_feeds((2, 8, 10, 9), seed=0), _positive_feeds((2, 8, 10, 9), seed=1)
    q = passes.quantize_weights(m, bits=3, min_elements=16)
    c = bc.correct_bias(q, m, calib)
    _check(c)
    a = np.concatenate(mg.run(m, held))
    e_q = (np.concatenate(mg.run(q, held)) - a).mean(axis=(0, 2, 3))
    e_c = (np.concatenate(mg.run(c, held)) - a).mean(axis=(0, 2, 3))
    assert np.sqrt(np.mean(e_c ** 2)) < 0.2 * np.sqrt(np.mean(e_q ** 2))
    conv = next(n for n in c.graph.node if n.op_type == "Conv")
    # a bias is added only where no bias, BatchNormalization or Add could take the shift
    assert (len(conv.input) == 3) == (follow in (None, "bias"))
    if follow == "bn":  # the BN's mean became an initializer and moved; its other Constants stay
        assert "mean" in graph.unique_initializers(c)
        assert sum(n.op_type == "Constant" for n in c.graph.node) == 3


def test_gemm_trans_b_alpha_beta():
    w = mg.weight((24, 40), seed=7)  # transB: (N, K)
    nodes = [helper.make_node("Gemm", ["x", "W", "C"], ["y"], transB=1, alpha=0.5, beta=2.0)]
    m = mg._model(nodes, [_vi("x", [None, 40])], [_vi("y", [None, 24])],
                  [mg.tensor("W", w), mg.tensor("C", mg.weight((24,), seed=8))], 13)
    calib, held = _positive_feeds((256, 40), seed=0), _positive_feeds((256, 40), seed=1)
    q = passes.quantize_weights(m, bits=3, min_elements=16)
    c = bc.correct_bias(q, m, calib)
    _check(c)
    assert _mean_error(m, c, held)[0] < 0.15 * _mean_error(m, q, held)[0]


def test_no_target_when_the_bias_is_shared_or_the_matmul_has_no_add():
    w = mg.weight((16, 16), seed=1)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["a"]),
             helper.make_node("Add", ["a", "B"], ["y"]), helper.make_node("MatMul", ["y", "W2"], ["z"])]
    m = mg._model(nodes, [_vi("x", [None, 16])], [_vi("z", [None, 16])],
                  [mg.tensor("W", w), mg.tensor("B", mg.weight((16,), seed=2)), mg.tensor("W2", w)], 13)
    assert bc.bias_targets(m, ["W", "W2"]) == {}


def test_added_bias_dropped_when_zero_and_set_biases_keeps_input():
    m = _conv_model()
    t = bc.bias_targets(m, ["W"])
    m2, t2 = bc.with_bias_inputs(m, t)
    assert t2["W"].bias == "W_bias" and len(next(n for n in m2.graph.node if n.op_type == "Conv").input) == 3
    _check(m2)
    back = bc.set_biases(m2, {}, drop={"W_bias"})
    _check(back)
    assert "W_bias" not in graph.unique_initializers(back)
    assert len(next(n for n in back.graph.node if n.op_type == "Conv").input) == 2


def test_needs_feeds():
    m = _matmul_add_model()
    q = passes.quantize_weights(m, bits=4, min_elements=16)
    with pytest.raises(passes.InvalidArgumentError, match="feeds"):
        bc.correct_bias(q, m, [])


def test_weights_and_bias_in_constant_nodes():
    """Exporters (paddle: rapidocr_cls) keep weights and biases in Constant nodes: the quantized
    weight's DequantizeLinear reads Constant levels, the bias Constant becomes an initializer."""
    m = mg.conv_model(in_constant=True)
    calib, held = _positive_feeds((1, 8, 10, 10), seed=0), _positive_feeds((1, 8, 10, 10), seed=1)
    q = passes.quantize_weights(m, bits=3, min_elements=16)
    rep = passes.Report()
    c = bc.correct_bias(q, m, calib, report=rep)
    _check(c)
    assert any("bias correction on 1 of" in n for n in rep.notes)  # W (Conv); W2 feeds a ConvTranspose
    assert "B" in graph.unique_initializers(c)
    a = mg.run(passes.fold_dequantize(m), held)[0].astype(np.float64)  # (ConvTranspose spreads the shift)
    e_q = (mg.run(q, held)[0] - a).mean()
    e_c = (mg.run(c, held)[0] - a).mean()
    assert abs(e_c) < abs(e_q)
