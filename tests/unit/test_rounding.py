"""Rate-distortion rounding (passes/rounding.py) in the graph forms: fewer packed bits within the
stated SNR bound, exact bookkeeping, standard ONNX that onnxruntime runs and fold restores."""
import numpy as np
import onnx
import pytest

import modelgen as mg
from passes import InvalidArgumentError, Report, fold_dequantize, forms, quantize_weights
from passes import rounding as rd
from passes.graph import tensor_to_array
from passes.onnxz import codecs


def _laplace(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.laplace(size=shape) * rng.uniform(0.3, 2.0, size=(shape[0],) + (1,) * (len(shape) - 1))
    return (0.02 * w).astype(np.float32)


def _snr(w, d):
    w = w.astype(np.float64)
    return 10 * np.log10((w * w).sum() / ((d.astype(np.float64) - w) ** 2).sum())


def _entropy(q, levels):
    counts = np.bincount((q.astype(np.int64) - levels.qmin).ravel(), minlength=levels.qmax - levels.qmin + 1)
    return rd.entropy_bits(counts)


def _packed_bits(q):
    data = np.ascontiguousarray(q).view(np.uint8).ravel()
    return codecs.encode_tensor(data, onnx.TensorProto.INT8, "raw_data").stored * 8 / q.size


@pytest.mark.parametrize("bad", [
    dict(rounding="round"), dict(rounding=None), dict(rd_lambda=0.1), dict(rd_step_scale=1.1),
    dict(rounding="rdo", rd_lambda=-0.1), dict(rounding="rdo", rd_lambda=float("nan")),
    dict(rounding="rdo", rd_lambda="0.1"), dict(rounding="rdo", rd_max_snr_loss_db=-1),
    dict(rounding="rdo", rd_target_snr_db=float("inf")), dict(rounding="rdo", rd_step_scale=100),
    dict(rounding="rdo", rd_lambda=0.1, rd_max_snr_loss_db=1), dict(rounding="rdo", rd_distortion="l1"),
    dict(rounding="rdo", rd_levels="floor"), dict(rd_levels="rdo"),
])
def test_bad_options(bad):
    with pytest.raises(InvalidArgumentError):
        rd.options(**bad)


def test_rdo_levels_chooses_by_cost():
    y = np.array([-3.4, -0.6, 0.4, 0.55, 1.45, 2.5, 9.0], np.float32)
    flat = np.zeros(15, np.float32)  # qmin -7: every level costs the same
    assert np.array_equal(rd.rdo_levels(y, -7, 7, 0.0, 1.0, flat), [-3, -1, 0, 1, 1, 2, 7])
    cheap_zero = np.full(15, 6.0, np.float32)
    cheap_zero[7] = 0.0
    # lam 0.1: 0.6 bits of rate per unit step difference -> values up to 0.5 + 0.3 go to zero
    assert np.array_equal(rd.rdo_levels(y, -7, 7, 0.0, 0.1, cheap_zero), [-3, 0, 0, 0, 1, 2, 7])
    # huge lam: everything that can reach zero (floor, ceil or zero candidate) goes there
    assert np.array_equal(rd.rdo_levels(y, -7, 7, 0.0, 100.0, cheap_zero), np.zeros(7))


@pytest.mark.parametrize("bits", [8, 6, 5, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran", [(0, 0), (1, 32), (None, 0)])
def test_fewer_bits_within_bound(bits, symmetric, gran):
    axis, block = gran
    w = _laplace((96, 200))
    lv = forms.Levels(bits, symmetric)
    near = forms.quantize_linear(w, lv, axis, block)
    got = forms.quantize_linear(w, lv, axis, block, rounding=rd.options("rdo"))
    # bookkeeping is exact: rate is the entropy of the stored levels, SNR that of DequantizeLinear
    deq = forms.dequantize_linear(got.q, got.scale, got.zero_point, axis if axis is not None else 1, block)
    assert got.snr_db() == pytest.approx(_snr(w, deq), abs=2e-3)
    assert got.bits_per_weight == pytest.approx(_entropy(got.q, lv), abs=1e-3)
    assert near.bits_per_weight == pytest.approx(_entropy(near.q, lv), abs=1e-3)
    assert got.q.min() >= lv.qmin and got.q.max() <= lv.qmax and got.q.dtype == lv.np_dtype
    assert got.scale.shape == near.scale.shape and got.scale.dtype == w.dtype
    if not symmetric:
        assert got.zero_point.dtype == np.uint8 and got.zero_point.max() <= lv.qmax
    assert got.snr_db() >= near.snr_db() - rd.DEFAULT_MAX_SNR_LOSS_DB - 0.01
    assert got.rounding == "rdo", "Laplacian weights always leave room for a smaller rate"
    assert got.bits_per_weight < near.bits_per_weight - 0.02


def test_padded_blocks_not_counted():
    w = _laplace((16, 3, 5, 5))  # axis 1 of length 3 in blocks of 32: 29 padded zeros per block
    lv = forms.Levels(4, True)
    for rounding in (None, rd.options("rdo", rd_lambda=0.1)):
        qz = forms.quantize_linear(w, lv, 1, 32, rounding=rounding)
        assert qz.bits_per_weight == pytest.approx(_entropy(qz.q, lv), abs=1e-3)


def test_dead_zone_and_lambda_order():
    w = _laplace((128, 256), seed=3)
    lv = forms.Levels(6, True)
    near = forms.quantize_linear(w, lv, 0)
    rates, zeros = [], []
    for lam in (0.05, 0.2, 0.8):
        qz = forms.quantize_linear(w, lv, 0, rounding=rd.options("rdo", rd_lambda=lam, rd_step_scale=1.0,
                                                                   rd_levels="rdo"))
        rates.append(qz.bits_per_weight)
        zeros.append(np.mean(qz.q == 0))
        # fixed step: the levels moved, the scales only by the gain correction (a few %)
        assert np.allclose(qz.scale, near.scale, rtol=0.05)
        # never further than the neighbouring levels or zero
        y = np.clip(w / near.scale[:, None], lv.qmin, lv.qmax)
        assert np.all((np.abs(qz.q - y) < 1) | (qz.q == 0))
    assert near.bits_per_weight > rates[0] > rates[1] > rates[2]
    assert np.mean(near.q == 0) < zeros[0] < zeros[1] < zeros[2]


def test_target_snr_and_packed_size():
    w = _laplace((256, 256), seed=5)
    lv = forms.Levels(8, True)
    near = forms.quantize_linear(w, lv, 0)
    got = forms.quantize_linear(w, lv, 0, rounding=rd.options("rdo", rd_target_snr_db=near.snr_db() - 2))
    assert near.snr_db() - 2 <= got.snr_db() < near.snr_db() - 0.5
    assert _packed_bits(got.q) < _packed_bits(near.q) - 0.2  # the pack's own coder agrees
    unreachable = forms.quantize_linear(w, lv, 0, rounding=rd.options("rdo", rd_target_snr_db=near.snr_db() + 5))
    assert unreachable.rounding == "nearest" and np.array_equal(unreachable.q, near.q)


def test_zero_and_constant_rows():
    w = _laplace((64, 128))
    w[3] = 0
    w[7] = 0.5
    lv = forms.Levels(5, True)
    for opts in (rd.options("rdo"), rd.options("rdo", rd_lambda=0.3), rd.options("rdo", rd_distortion="absolute")):
        qz = forms.quantize_linear(w, lv, 0, rounding=opts)
        deq = forms.dequantize_linear(qz.q, qz.scale, None, 0)
        assert np.all(deq[3] == 0) and np.all(np.isfinite(deq))
        assert np.allclose(deq[7], 0.5, rtol=0.05)
    zeros = forms.quantize_linear(np.zeros((8, 64), np.float32), lv, 0, rounding=rd.options("rdo"))
    assert np.all(zeros.q == 0) and zeros.rounding == "nearest"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kw", [dict(), dict(bits=4, granularity="block", block_size=16),
                                dict(bits=6, symmetric=False), dict(rd_lambda=0.2), dict(rd_levels="rdo")])
def test_models_run_and_fold(dtype, kw):
    kw = dict(kw)
    extra = {k: kw.pop(k) for k in list(kw) if k.startswith("rd_")}
    for builder in ("conv", "dense"):
        m = mg.BUILDERS[builder](dtype, 13)
        before = m.SerializeToString()
        report = Report()
        q = quantize_weights(m, min_elements=64, rounding="rdo", report=report, **kw, **extra)
        assert m.SerializeToString() == before
        onnx.checker.check_model(q, full_check=True)
        near = quantize_weights(m, min_elements=64, **kw)
        assert [(n.op_type, list(n.input), list(n.output)) for n in q.graph.node] == \
               [(n.op_type, list(n.input), list(n.output)) for n in near.graph.node]
        changed = [t for t in report.tensors if isinstance(t, rd.QuantizedChange)]
        assert changed and all(0 < t.packed_bits_per_weight <= kw.get("bits", 8) for t in changed)
        assert all(t.scheme.endswith("/rdo") == (t.rounding == "rdo") for t in changed)
        assert any(t.rounding == "rdo" for t in changed)
        d = report.to_dict()["tensors"]
        assert {"rounding", "packed_bits_per_weight", "rd_lambda", "step_scale"} <= set(d[0])
        # fold restores exactly what DequantizeLinear computes from the stored integers
        folded = {t.name: tensor_to_array(t) for t in fold_dequantize(q).graph.initializer}
        inits = {t.name: tensor_to_array(t) for t in q.graph.initializer}
        for n in q.graph.node:
            if n.op_type != "DequantizeLinear":
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            zp = inits[n.input[2]] if len(n.input) > 2 else None
            ref = forms.dequantize_linear(inits[n.input[0]], inits[n.input[1]], zp, attrs.get("axis", 1),
                                          attrs.get("block_size", 0))
            assert folded[n.output[0]].tobytes() == ref.tobytes()
        feeds = mg.feeds(m)
        for a, b in zip(mg.run(m, feeds), mg.run(q, feeds, matmulnbits_accuracy=0)):
            assert mg.cosine(a, b) > {8: 0.999, 6: 0.997, 4: 0.95}[kw.get("bits", 8)]
        assert quantize_weights(m, min_elements=64, rounding="rdo", **kw, **extra).SerializeToString() == \
               q.SerializeToString()


def test_nearest_is_the_default_and_unchanged():
    m = mg.conv_model("float32", 13)
    a = quantize_weights(m, min_elements=64)
    b = quantize_weights(m, min_elements=64, rounding="nearest")
    assert a.SerializeToString() == b.SerializeToString()


def test_float16_scales_stay_finite_with_larger_steps():
    """Step factors above 1 on weights near the float16 limit: the stored scale times the top level
    must stay finite (forms._stored steps such scales down)."""
    w = (_laplace((32, 256)) * 3e4).astype(np.float16)
    w[0, 0] = np.float16(65504)
    lv = forms.Levels(8, True)
    qz = forms.quantize_linear(w, lv, 0, rounding=rd.options("rdo", rd_lambda=2.0))
    assert qz.scale.dtype == np.float16 and np.all(np.isfinite(qz.scale))
    deq = forms.dequantize_linear(qz.q, qz.scale, None, 0)
    assert np.all(np.isfinite(deq))
    assert qz.snr_db() == pytest.approx(_snr(w.astype(np.float32), deq.astype(np.float32)), abs=2e-3)


def test_rdo_levels_keep_unit_gain():
    """With rate-aware levels, each row's scale is corrected so that its dequantized row projects
    on the original with gain 1 (a shrink would compound through a deep network)."""
    w = _laplace((64, 300), seed=7)
    lv = forms.Levels(6, True)
    for levels in ("nearest", "rdo"):
        qz = forms.quantize_linear(w, lv, 0, rounding=rd.options("rdo", rd_lambda=0.3, rd_levels=levels))
        deq = forms.dequantize_linear(qz.q, qz.scale, None, 0).astype(np.float64)
        gain = (deq * w).sum(axis=1) / (w.astype(np.float64) ** 2).sum(axis=1)
        if levels == "rdo":
            assert np.allclose(gain, 1.0, atol=2e-6)
        else:  # nearest levels at a larger step: no systematic shrink to correct
            assert abs(gain.mean() - 1) < 5e-3
