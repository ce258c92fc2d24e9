"""Files written before 1de3b35 hold float16 weights as Cast(levels -> FLOAT16) [- zero point] *
scale with the Sub and Mul in float16, which onnxruntime's CPU provider cannot constant-fold (no
float16 Mul kernel). fold_dequantize (and the fold command) fold them to plain float16 weights
holding, bit for bit, what onnxruntime computes for the pattern itself."""
import itertools
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import passes
from passes.cast_levels import level_patterns
from passes.graph import array_to_tensor, tensor_to_array
from tools.surgeon_compress import main

LEVELS = {TP.INT8: (-128, 128, np.int8), TP.UINT8: (0, 256, np.uint8), TP.INT4: (-8, 8, np.int8),
          TP.UINT4: (0, 16, np.uint8)}
# scale exponents: products below float16's normal range (subnormal and flushed to 0), normal
# ones, and ones past 65504 (inf)
EXPONENTS = {"subnormal": (-26, -12), "normal": (-14, 2), "overflowing": (4, 12)}
SHAPE = (40, 24)


def _old_float16_form(q_type, per_channel: bool, with_zp: bool, exponents, seed=0, block: int = 0):
    """W[40, 24] = Cast(levels -> FLOAT16) [- zero point] * scale, all float16, W a graph output.
    block: the blocked form instead (levels [40 / block, block, 24] -> Mul -> Reshape to W)."""
    rng = np.random.default_rng(seed)
    lo, hi, np_type = LEVELS[q_type]
    if block:
        q_shape, s_shape = (SHAPE[0] // block, block, SHAPE[1]), (SHAPE[0] // block, 1, SHAPE[1])
    else:
        q_shape, s_shape = SHAPE, ((SHAPE[1],) if per_channel else ())
    q = rng.integers(lo, hi, size=q_shape).astype(np_type)
    scale = (rng.uniform(0.5, 1.5, size=s_shape) * 2.0 ** rng.integers(*exponents, size=s_shape)).astype(np.float16)
    inits = [array_to_tensor(q, "W_quantized", q_type), array_to_tensor(scale, "W_scale", TP.FLOAT16)]
    nodes = [helper.make_node("Cast", ["W_quantized"], ["W_levels"], to=TP.FLOAT16)]
    value = "W_levels"
    if with_zp:
        inits.append(array_to_tensor(rng.integers(lo, hi, size=s_shape).astype(np.float16), "W_zero_point", TP.FLOAT16))
        nodes.append(helper.make_node("Sub", ["W_levels", "W_zero_point"], ["W_centred"]))
        value = "W_centred"
    nodes.append(helper.make_node("Mul", [value, "W_scale"], ["W_blocks" if block else "W"]))
    if block:
        inits.append(array_to_tensor(np.array(SHAPE, np.int64), "W_shape", TP.INT64))
        nodes.append(helper.make_node("Reshape", ["W_blocks", "W_shape"], ["W"]))
    g = helper.make_graph(nodes, "old", [], [helper.make_tensor_value_info("W", TP.FLOAT16, SHAPE)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _onnxruntime(model, optimized: bool):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, {})


def _folded_weight(model) -> np.ndarray:
    folded = passes.fold_dequantize(model)
    onnx.checker.check_model(folded, full_check=True)
    assert list(folded.graph.node) == [] and [t.name for t in folded.graph.initializer] == ["W"]
    return tensor_to_array(folded.graph.initializer[0])


@pytest.mark.parametrize("q_type,per_channel,with_zp,exponents", list(itertools.product(
    list(LEVELS), [False, True], [False, True], list(EXPONENTS))))
def test_old_float16_form_folds_to_what_onnxruntime_computes(q_type, per_channel, with_zp, exponents):
    model = _old_float16_form(q_type, per_channel, with_zp, EXPONENTS[exponents])
    (p,) = level_patterns(model.graph)
    assert p.float16_arithmetic and p.weight_type == TP.FLOAT16
    got = _folded_weight(model)
    assert got.dtype == np.float16
    for optimized in (False, True):
        want = _onnxruntime(model, optimized)[0]
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("exponents", list(EXPONENTS))
def test_old_blocked_float16_form_folds_to_what_onnxruntime_computes(exponents):
    model = _old_float16_form(TP.INT8, False, False, EXPONENTS[exponents], seed=1, block=8)
    got = _folded_weight(model)
    assert got.shape == SHAPE and got.tobytes() == _onnxruntime(model, False)[0].tobytes()


def test_the_new_form_is_no_float16_arithmetic():
    model = passes.quantize_weights(_float16_matmul(), min_elements=16)
    from passes.cast_levels import as_cast_mul

    (p,) = level_patterns(as_cast_mul(model, ["W"]).graph)
    assert not p.float16_arithmetic and p.weight_type == TP.FLOAT16


def _float16_matmul(seed=2):
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(64, 48)) / 8).astype(np.float16)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TP.FLOAT16, [2, 64])],
                          [helper.make_tensor_value_info("y", TP.FLOAT16, [2, 48])], [array_to_tensor(w, "W", TP.FLOAT16)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def test_an_old_pattern_in_an_if_branch_folds():
    old = _old_float16_form(TP.INT8, True, True, EXPONENTS["normal"], seed=3)
    branch = helper.make_graph(list(old.graph.node), "then", [], list(old.graph.output), list(old.graph.initializer))
    other = helper.make_graph([helper.make_node("Constant", [], ["Z"], value=array_to_tensor(
        np.zeros(SHAPE, np.float16), "Z", TP.FLOAT16))], "else", [], [helper.make_tensor_value_info("Z", TP.FLOAT16, SHAPE)])
    g = helper.make_graph([helper.make_node("If", ["flag"], ["W"], then_branch=branch, else_branch=other)], "g",
                          [helper.make_tensor_value_info("flag", TP.BOOL, [])],
                          [helper.make_tensor_value_info("W", TP.FLOAT16, SHAPE)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    folded = passes.fold_dequantize(model)
    onnx.checker.check_model(folded, full_check=True)
    then = next(a.g for a in folded.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == [] and [t.name for t in then.initializer] == ["W"]
    feeds = {"flag": np.array(True)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert tensor_to_array(then.initializer[0]).tobytes() == session.run(None, feeds)[0].tobytes()


def test_the_fold_command_writes_an_old_file_s_weights_as_plain_float16(tmp_path, capsys):
    """The old file leaves float16 Mul nodes in onnxruntime's optimised graph (run at every
    inference); the folded file, none, and the same outputs."""
    from passes.cast_levels import as_cast_mul

    q = passes.quantize_weights(_float16_matmul(), min_elements=16)
    new = as_cast_mul(q, ["W"])
    old = onnx.ModelProto()
    old.CopyFrom(new)
    # the same weight in the old layout: levels Cast to FLOAT16, the float16 scale read directly
    scale_name = next(n.input[0] for n in new.graph.node if n.op_type == "Cast" and n.input[0].endswith("_scale"))
    levels = next(n for n in new.graph.node if n.op_type == "Cast" and not n.input[0].endswith("_scale"))
    del old.graph.node[:]
    old.graph.node.extend([helper.make_node("Cast", [levels.input[0]], ["W_levels"], to=TP.FLOAT16),
                           helper.make_node("Mul", ["W_levels", scale_name], ["W"])]
                          + [n for n in new.graph.node if n.op_type == "MatMul"])
    src, dst = tmp_path / "old.onnx", tmp_path / "folded.onnx"
    onnx.save(old, str(src))
    assert "Mul" in _optimized(old, tmp_path)
    assert main(["fold", str(src), "-o", str(dst)]) == 0, capsys.readouterr().err
    folded = onnx.load(str(dst))
    onnx.checker.check_model(folded, full_check=True)
    assert [n.op_type for n in folded.graph.node] == ["MatMul"]
    assert {t.name: t.data_type for t in folded.graph.initializer} == {"W": TP.FLOAT16}
    assert "Mul" not in _optimized(folded, tmp_path)
    x = {"x": np.random.default_rng(4).normal(size=(2, 64)).astype(np.float16)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]  # noqa: E731
    assert run(folded).tobytes() == run(passes.fold_dequantize(new)).tobytes()
    # (onnxruntime runs the old file's float16 Mul and the MatMul after it in float32, Casts inserted
    # around each, and drops the Cast pair between them: its MatMul reads the product unrounded, so
    # the old file's outputs are not those of any float16 weight; the weight itself, as a graph
    # output, is the folded one bit for bit: the tests above)
    np.testing.assert_allclose(run(folded).astype(np.float32), run(old).astype(np.float32), rtol=0, atol=4e-3)


def _optimized(model, tmp_path) -> list:
    """The op types of onnxruntime's optimised graph of `model` (what runs at each inference)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = os.path.join(tmp_path, "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
