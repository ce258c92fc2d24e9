"""Blocked levels of Conv weights: blocks of input channels at each kernel tap (forms.quantize_blocks
along axis 1), error-fed through the im2col Hessian (gptq.blocked_levels), written as
Cast+Mul+Reshape (cast_levels.as_blocked_cast_mul): bounded error, bit-exact fold against
onnxruntime, onnx.checker, blocked DequantizeLinear again, lower output error with feedback."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import passes
from passes import InvalidArgumentError, cast_levels, forms
from passes import gptq as gq

from modelgen import initializer_array, onnxruntime_value

NP_TO_ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _blocky_conv(o, c, k, dtype=np.float32, seed=0):
    """Conv weights (o, c, k, k) whose magnitude changes from one block of 16 input channels to the
    next and from tap to tap: one scale per output channel wastes its levels on the quiet ones."""
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.normal(0, 1.2, size=(o, c // 16, 1, k, k)))
    w = rng.standard_normal((o, c // 16, 16, k, k)) * mag
    return (w.reshape(o, c, k, k) / np.sqrt(c * k * k)).astype(dtype)


def _conv_model(w, opset=17, pads=1):
    t = NP_TO_ONNX[w.dtype.type]
    o, c, k = w.shape[0], w.shape[1], w.shape[2]
    node = helper.make_node("Conv", ["x", "W"], ["y"], pads=[pads] * 4)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", t, [2, c, 6, 6])],
                          [helper.make_tensor_value_info("y", t, [2, o, 6 + 2 * pads - k + 1, 6 + 2 * pads - k + 1])],
                          [onnx.numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m




@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_conv_round_trip_within_half_a_step(dtype, bits):
    w = _blocky_conv(8, 32, 3, dtype)
    qz = forms.quantize_blocks(w, bits, 1, 16)
    qmax = 2 ** (bits - 1) - 1
    assert qz.q.shape == w.shape and np.abs(qz.q).max() <= qmax
    assert qz.scale.shape == (8, 2, 1, 3, 3) == forms.block_scale_shape(w.shape, 1, 16)
    deq = forms.dequantize_blocks(qz.q, qz.scale, 1, 16)
    step = np.broadcast_to(qz.scale.astype(np.float64), forms.block_split_shape(w.shape, 1, 16)).reshape(w.shape)
    err = np.abs(deq.astype(np.float64) - w.astype(np.float64))
    inside = np.abs(w.astype(np.float64)) <= qmax * step
    slack = np.abs(deq.astype(np.float64)) * (2.0 ** -10 if dtype == np.float16 else 2.0 ** -23)
    assert np.all(err[inside] <= step[inside] / 2 * (1 + 1e-6) + slack[inside])
    assert np.all(np.abs(qz.q[~inside]) == qmax)


def test_conv_block_scales_follow_the_im2col_order():
    w = _blocky_conv(4, 32, 3)
    qz = forms.quantize_blocks(w, 5, 1, 16)
    rows = gq.conv_block_scales(qz.scale.astype(np.float64), w.shape, 16)
    assert rows.shape == (32 * 9, 4)
    # levels times the row scales, as the im2col matrix (K, O), are the blocked dequantized weight
    mat = qz.q.reshape(4, -1).T.astype(np.float64) * rows
    expect = forms.dequantize_blocks(qz.q, qz.scale, 1, 16).astype(np.float64)
    np.testing.assert_allclose(mat.T.reshape(w.shape), expect, rtol=1e-6)
    with pytest.raises(InvalidArgumentError):
        gq.conv_block_scales(qz.scale.astype(np.float64), w.shape, 8)  # not the layout of blocks of 8


def test_conv_blocked_error_feedback_lowers_the_output_error():
    rng = np.random.default_rng(2)
    w = _blocky_conv(12, 32, 3, seed=1)
    k = 32 * 9
    mix = rng.standard_normal((k, k)) * 0.3 + np.eye(k)
    x = rng.standard_normal((1500, k)) @ mix  # correlated patches
    h = x.T @ x / len(x)
    qz = forms.quantize_blocks(w, 4, 1, 16)
    fed = gq.blocked_levels(w, h, qz.scale, 1, 16, 4, damp=0.01)
    assert fed.shape == w.shape and np.abs(fed).max() <= 7

    def out_err(levels):
        e = forms.dequantize_blocks(levels.astype(np.int8), qz.scale, 1, 16).astype(np.float64) - w
        return float(np.sum((x @ e.reshape(12, -1).T) ** 2))

    assert out_err(fed) < 0.8 * out_err(qz.q)
    with pytest.raises(InvalidArgumentError):
        gq.blocked_levels(w, h, qz.scale, 0, 16, 4)  # Conv weights are blocked along their input channels


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_conv_cast_mul_reshape_folds_bit_exactly_and_runs(dtype):
    w = _blocky_conv(8, 32, 3, dtype)
    m = _conv_model(w)
    qz = forms.quantize_blocks(w, 5, 1, 16)
    b = cast_levels.as_blocked_cast_mul(m, {"W": (qz.q, qz.scale, 1, 16)})
    assert m.graph.initializer[0].name == "W"  # the input is not modified
    onnx.checker.check_model(b, full_check=True)
    chain = ["Cast", "Mul"] if dtype == np.float32 else ["Cast", "Cast", "Mul", "Cast"]  # float16: float32 arithmetic
    assert [n.op_type for n in b.graph.node] == chain + ["Reshape", "Conv"]
    assert len(cast_levels.blocked_patterns(b.graph)) == 1
    expect = forms.dequantize_blocks(qz.q, qz.scale, 1, 16)
    elem = NP_TO_ONNX[dtype]
    assert np.array_equal(onnxruntime_value(b, "W", w.shape, elem).view(np.uint8), expect.view(np.uint8))
    folded = passes.fold_dequantize(b)
    assert [n.op_type for n in folded.graph.node] == ["Conv"]
    assert np.array_equal(initializer_array(folded, "W").view(np.uint8), expect.view(np.uint8))
    x = np.random.default_rng(1).standard_normal((2, 32, 6, 6)).astype(dtype)
    run = lambda model: ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    # float16: onnxruntime's CPU Conv sums in another order where the weight is not a constant (outputs ~4: 1 ulp 4e-3)
    tol = 1e-3 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(run(b).astype(np.float32), run(folded).astype(np.float32), rtol=tol, atol=tol)
    ref = run(m).astype(np.float64)
    err = run(b).astype(np.float64) - ref
    assert 10 * np.log10(np.sum(ref ** 2) / np.sum(err ** 2)) > 20  # 5-bit levels: a faithful convolution


def test_conv_blocked_dequantize_linear_again_same_values():
    w = _blocky_conv(8, 32, 3)
    m = _conv_model(w)
    qz = forms.quantize_blocks(w, 6, 1, 16)
    b = cast_levels.as_blocked_cast_mul(m, {"W": (qz.q, qz.scale, 1, 16)})
    d = cast_levels.as_dequantize(b)
    onnx.checker.check_model(d, full_check=True)
    dq = [n for n in d.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 1 and dq[0].output[0] == "W"
    attrs = {a.name: helper.get_attribute_value(a) for a in dq[0].attribute}
    assert attrs == {"axis": 1, "block_size": 16}
    expect = forms.dequantize_blocks(qz.q, qz.scale, 1, 16)
    assert np.array_equal(initializer_array(passes.fold_dequantize(d), "W"), expect)
    # onnxruntime's blocked DequantizeLinear of the 4-D weight: the same values
    assert np.array_equal(onnxruntime_value(d, "W", w.shape, TensorProto.FLOAT), expect)
