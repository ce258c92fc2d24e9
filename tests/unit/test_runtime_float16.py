"""mode="fold" for float16 models on a CPU: weights read by MatMul/Gemm/Conv are folded straight to
float32 behind Cast(-> float16) (runtime_fold.fold_float16_as_float32), with onnxruntime's constant
folding limited so that it leaves those Casts; outputs must equal the folded model's bit for bit."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import forms
from passes.fold import FOLDERS
from passes.runtime_feed import split_model
from passes.runtime_fold import (CAST_FOLD_LIMIT_BYTES, _widen_direct, _widened_value, constant_outputs_fit,
                                 widenable_dequantize)

CPU = ["CPUExecutionProvider"]


def _model(nodes, inputs, outputs, inits, opset=19, value_info=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits, value_info=list(value_info))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _fp16_weight(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float16)


def _outputs(session_or_model, feeds):
    if isinstance(session_or_model, onnx.ModelProto):
        session_or_model = ort.InferenceSession(session_or_model.SerializeToString(), providers=CPU)
    return [session_or_model.run(None, f) for f in feeds]


def _assert_same(got, want):
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("shape, axis", [((384, 1536), 1), ((384, 1536), 0), ((64, 3, 7, 7), 0), ((1000,), 0),
                                         ((50, 60), 1), ((4, 6, 8), 1)])
@pytest.mark.parametrize("zero_point", [False, True])
def test_widened_values_are_the_float16_fold_widened(shape, axis, zero_point):
    """Every layout (the direct loop or the fallback): the bits of passes.forms' float16 fold,
    widened to float32, including zero and negative-zero products."""
    rng = np.random.default_rng(3)
    q = rng.integers(-128, 128, size=shape, dtype=np.int8)
    n = shape[axis]
    scale = (rng.random(n) * 0.05 + 1e-3).astype(np.float16)
    zp = rng.integers(-20, 20, size=n, dtype=np.int8) if zero_point else None
    node = helper.make_node("DequantizeLinear", ["q", "s"] + (["z"] if zero_point else []), ["w"], axis=axis)
    types = [TensorProto.INT8, TensorProto.FLOAT16] + ([TensorProto.INT8] if zero_point else [])
    got = _widened_value(node, [q, scale] + ([zp] if zero_point else []), types, FOLDERS)
    want = forms.dequantize_linear(q, scale, zp, axis).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_widened_values_outside_the_direct_range_use_the_float16_fold():
    """Scales giving subnormal or overflowing float16 products are not widened directly (rounding
    in float32 bits would be wrong there): the float16 fold is widened instead."""
    rng = np.random.default_rng(4)
    q = rng.integers(-128, 128, size=(64, 96), dtype=np.int8)
    scale = np.full(96, 1e-6, np.float16)  # subnormal float16 products
    scale[:8] = 600.0  # 127 * 600 overflows to inf
    assert _widen_direct(q, scale.astype(np.float32), None, 1, 0) is not None  # the loop itself would run
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=1)
    with np.errstate(over="ignore"):
        got = _widened_value(node, [q, scale], [TensorProto.INT8, TensorProto.FLOAT16], FOLDERS)
        want = forms.dequantize_linear(q, scale, None, 1).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) and np.isinf(got).any()


def _matmul_conv_model():
    """MatMul and Gemm (weights shared as float32), Conv (copied), a small MatMul weight (under the
    limit: folded to float16) and a Gather embedding (float16, never widened)."""
    w1, w2 = _fp16_weight((256, 384), 1), _fp16_weight((384, 128), 2)
    wc = _fp16_weight((64, 64, 3, 3), 3)  # 72 KiB in float16: over the limit
    small = _fp16_weight((128, 64), 4)
    emb = _fp16_weight((500, 16), 5)
    inits = [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"),
             numpy_helper.from_array(wc, "WC"), numpy_helper.from_array(small, "WS"),
             numpy_helper.from_array(emb, "E")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Gemm", ["r1", "W2"], ["h2"]), helper.make_node("MatMul", ["h2", "WS"], ["y"]),
             helper.make_node("Conv", ["img", "WC"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Gather", ["E", "ids"], ["e"], axis=0)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 256]),
              helper.make_tensor_value_info("img", TensorProto.FLOAT16, [1, 64, 8, 8]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, [3])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 64]),
               helper.make_tensor_value_info("c", TensorProto.FLOAT16, [1, 64, 8, 8]),
               helper.make_tensor_value_info("e", TensorProto.FLOAT16, [3, 16])]
    return _model(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("packed", [False, True])
def test_float16_fold_on_cpu_widens_and_matches_the_folded_model(tmp_path, packed):
    q8 = passes.quantize_weights(_matmul_conv_model(), bits=8, min_elements=256)
    path = tmp_path / "m.q8.onnx"
    onnx.save(q8, str(path))
    before = path.read_bytes()
    if packed:
        passes.pack(str(path), str(tmp_path / "m.q8.onnxz"), force=True)
        path = tmp_path / "m.q8.onnxz"
    rng = np.random.default_rng(9)
    feeds = [{"x": rng.standard_normal((4, 256)).astype(np.float16),
              "img": rng.standard_normal((1, 64, 8, 8)).astype(np.float16),
              "ids": np.array([0, 7, 499], np.int64)} for _ in range(3)]
    session = passes.InferenceSession(path, mode="fold")
    assert session.fold_route == "here-float32" and session.dtype == np.float16
    widened = {n for n in session.weight_arrays if n.endswith("::float32")} | set(session.embedded_names)
    # W1 (MatMul) and W2 (Gemm B) shared as float32; the Conv weight copied into the model
    assert session.shared_names == {"W1::float32", "W2::float32"}
    assert all(session.weight_arrays[n].dtype == np.float32 for n in session.shared_names)
    assert "WC::float32" in widened and "WC::float32" not in session.shared_names
    assert session.op_counts.get("Cast") == 3 and "DequantizeLinear" not in session.op_counts
    _assert_same(_outputs(session, feeds), _outputs(passes.fold_dequantize(q8), feeds))
    if not packed:
        assert path.read_bytes() == before


def test_widening_skipped_for_other_readers_and_small_weights():
    """A weight also read by an operator with float16 kernels (Gather), or one under the limit,
    stays a float16 fold."""
    w = _fp16_weight((256, 128), 1)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Gather", ["W", "ids"], ["g"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 256]),
                       helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 128]),
                helper.make_tensor_value_info("g", TensorProto.FLOAT16, [2, 128])], [numpy_helper.from_array(w, "W")])
    assert widenable_dequantize(split_model(passes.quantize_weights(m, bits=8, min_elements=256))) == []
    small = _fp16_weight((64, 64), 2)  # 8 KiB in float16: under CAST_FOLD_LIMIT_BYTES
    assert 2 * small.size <= CAST_FOLD_LIMIT_BYTES
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 64])], [numpy_helper.from_array(small, "W")])
    assert widenable_dequantize(split_model(passes.quantize_weights(m, bits=8, min_elements=256))) == []


def test_constant_outputs_fit_evaluates_small_constant_chains():
    """The folding limit is used only when every other constant computation stays under it: shape
    arithmetic evaluated from declared static shapes fits; a constant node on a big weight, a big
    ConstantOfShape or an undeclared shape does not."""
    limit = CAST_FOLD_LIMIT_BYTES
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 64])
    w = numpy_helper.from_array(_fp16_weight((64, 64), 1), "W")
    idx = numpy_helper.from_array(np.array([1], np.int64), "i")
    chain = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "i"], ["d"]),
             helper.make_node("ConstantOfShape", ["d"], ["z"], value=numpy_helper.from_array(np.zeros(1, np.float16))),
             helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "z"], ["y"])]
    assert constant_outputs_fit(split_model(_model(chain, [x], [y], [w, idx])), limit, set())
    dynamic = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 64])  # Shape not constant
    assert constant_outputs_fit(split_model(_model(chain, [dynamic], [y], [w, idx])), limit, set())
    big_w = numpy_helper.from_array(_fp16_weight((64, 1024), 2), "W")  # 128 KiB: fed, not inline
    on_weight = [helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
                 helper.make_node("MatMul", ["x", "wt"], ["y"])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 1024])
    t = helper.make_graph(on_weight, "g", [x], [out], [numpy_helper.from_array(_fp16_weight((1024, 64), 2), "W")])
    m = helper.make_model(t, opset_imports=[helper.make_opsetid("", 19)])
    assert not constant_outputs_fit(split_model(m), limit, set())
    shape = numpy_helper.from_array(np.array([256, 256], np.int64), "shape")  # 128 KiB of float16 zeros
    grow = [helper.make_node("ConstantOfShape", ["shape"], ["z"], value=numpy_helper.from_array(np.zeros(1, np.float16))),
            helper.make_node("Add", ["xx", "z"], ["y"])]
    io = ([helper.make_tensor_value_info("xx", TensorProto.FLOAT16, [256, 256])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [256, 256])])
    assert not constant_outputs_fit(split_model(_model(grow, *io, [shape])), limit, set())
    hidden = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Shape", ["r"], ["sr"]),
              helper.make_node("Gather", ["sr", "i"], ["d"]),
              helper.make_node("ConstantOfShape", ["d"], ["z"], value=numpy_helper.from_array(np.zeros(1, np.float16))),
              helper.make_node("Add", ["x", "z"], ["y"])]
    g = helper.make_graph(hidden, "g", [x], [y], [idx])  # r's shape not declared
    assert not constant_outputs_fit(split_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])),
                                    limit, set())
