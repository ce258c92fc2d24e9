"""Per-channel affine nodes after a Conv folded into its weight and bias (passes.affine_fold)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from passes import affine_fold, graph
from passes.errors import InvalidArgumentError

C, K = 6, 3


def _arr(shape, seed, lo=-1.0, hi=1.0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def _const_node(name, arr):
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(arr, name))


def _model(nodes, inits, out_shape, dtype=TensorProto.FLOAT):
    x = helper.make_tensor_value_info("x", dtype, [1, K, 8, 8])
    outs = [helper.make_tensor_value_info("y", dtype, out_shape)]
    g = helper.make_graph(nodes, "g", [x], outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _x(dtype=np.float32):
    return _arr((1, K, 8, 8), 99).astype(dtype)


def _bn_model():
    """Conv without bias -> BatchNormalization (its parameters in Constant nodes, as rapidocr_cls) -> Relu."""
    bn = [_const_node("s", _arr((C,), 1, 0.5, 2.0)), _const_node("o", _arr((C,), 2)),
          _const_node("m", _arr((C,), 3)), _const_node("v", _arr((C,), 4, 0.1, 2.0))]
    nodes = bn + [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
                  helper.make_node("BatchNormalization", ["c", "s", "o", "m", "v"], ["b"], epsilon=1e-3),
                  helper.make_node("Relu", ["b"], ["y"])]
    return _model(nodes, [onnx.numpy_helper.from_array(_arr((C, K, 3, 3), 5), "W")], [1, C, 8, 8])


def _nhwc_model(shape=(1, 1, 1, C), sub_first=False):
    """Conv with bias -> Transpose to NHWC -> Cast -> Add, Sub, Mul, Div, Add by per-channel vectors
    (open_nsfw's decomposed batch normalisation) -> Relu."""
    vec = lambda n, seed, lo=-1.0, hi=1.0: onnx.numpy_helper.from_array(_arr(shape, seed, lo, hi), n)  # noqa: E731
    inits = [onnx.numpy_helper.from_array(_arr((C, K, 3, 3), 5), "W"), onnx.numpy_helper.from_array(_arr((C,), 6), "B"),
             vec("a1", 7), vec("s1", 8), vec("m1", 9, -2.0, -0.5), vec("d1", 10, 0.5, 2.0), vec("a2", 11)]
    sub = helper.make_node("Sub", ["s1", "t2"] if sub_first else ["t2", "s1"], ["t3"])
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Transpose", ["c"], ["t0"], perm=[0, 2, 3, 1]),
             helper.make_node("Cast", ["t0"], ["t1"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["t1", "a1"], ["t2"]), sub,
             helper.make_node("Mul", ["m1", "t3"], ["t4"]),
             helper.make_node("Div", ["t4", "d1"], ["t5"]),
             helper.make_node("Add", ["t5", "a2"], ["t6"]),
             helper.make_node("Relu", ["t6"], ["y"])]
    return _model(nodes, inits, [1, 8, 8, C])


def test_batch_normalization_in_constant_nodes_folds_into_the_conv():
    m = _bn_model()
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 1
    ops = [x.op_type for x in folded.graph.node]
    assert ops == ["Conv", "Relu"]  # the BatchNormalization and its four Constant nodes are gone
    conv = folded.graph.node[0]
    assert len(conv.input) == 3 and conv.input[2] in {t.name for t in folded.graph.initializer}
    onnx.checker.check_model(folded)
    np.testing.assert_allclose(_run(folded, _x())[0], _run(m, _x())[0], rtol=1e-5, atol=1e-5)
    assert len(m.graph.node) == 7  # the input model is unchanged


@pytest.mark.parametrize("sub_first", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, C), (C,), (1, 1, 1, 1)])
def test_nhwc_chain_of_per_channel_constants_folds_and_keeps_transpose_and_cast(shape, sub_first):
    m = _nhwc_model(shape, sub_first)
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 5
    assert [x.op_type for x in folded.graph.node] == ["Conv", "Transpose", "Cast", "Relu"]
    assert {t.name for t in folded.graph.initializer} == {"W", "B"}  # the vectors are read no more
    onnx.checker.check_model(folded)
    np.testing.assert_allclose(_run(folded, _x())[0], _run(m, _x())[0], rtol=1e-5, atol=1e-5)


def test_float16_model_folds_in_float16():
    m = _bn_model()
    h = onnx.ModelProto()
    h.CopyFrom(m)
    for t in h.graph.initializer:
        t.CopyFrom(graph.array_to_tensor(graph.tensor_to_array(t).astype(np.float16), t.name, TensorProto.FLOAT16))
    for node in h.graph.node:
        if node.op_type == "Constant":
            t = node.attribute[0].t
            t.CopyFrom(graph.array_to_tensor(graph.tensor_to_array(t).astype(np.float16), t.name, TensorProto.FLOAT16))
    h.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    h.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    folded, n = affine_fold.fold_conv_affine(h)
    assert n == 1
    assert {t.data_type for t in folded.graph.initializer} == {TensorProto.FLOAT16}
    ref, got = _run(h, _x(np.float16))[0].astype(np.float32), _run(folded, _x(np.float16))[0].astype(np.float32)
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2)


def _nothing_folds(m):
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 0 and folded is m


def test_a_chain_value_read_twice_is_not_folded():
    m = _nhwc_model()
    m.graph.node.append(helper.make_node("Neg", ["c"], ["z"]))  # a second reader of the Conv's output
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, 8, 8]))
    _nothing_folds(m)


def test_the_fold_stops_before_a_value_another_node_reads():
    m = _nhwc_model()
    m.graph.node.append(helper.make_node("Neg", ["t3"], ["z"]))  # t3 (after Add, Sub) is read twice
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8, 8, C]))
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 2  # Add and Sub fold; the Sub's output is read on by Mul and Neg
    outs = _run(folded, _x())
    for a, b in zip(outs, _run(m, _x())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_constants_that_vary_along_other_axes_are_not_folded():
    _nothing_folds(_nhwc_model(shape=(1, 8, 1, C)))


def test_an_intermediate_graph_output_is_not_folded_away():
    m = _bn_model()
    m.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, C, 8, 8]))
    _nothing_folds(m)


def test_a_weight_read_by_two_convs_is_not_changed():
    m = _bn_model()
    m.graph.node.append(helper.make_node("Conv", ["x", "W"], ["z"], pads=[1, 1, 1, 1]))
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, 8, 8]))
    _nothing_folds(m)


def test_an_initializer_that_is_also_a_graph_input_is_not_a_constant():
    m = _nhwc_model()
    m.graph.input.append(helper.make_tensor_value_info("a1", TensorProto.FLOAT, [1, 1, 1, C]))
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 0


def test_ops_choose_which_affine_nodes_fold():
    folded, n = affine_fold.fold_conv_affine(_nhwc_model(), ops=("BatchNormalization",))
    assert n == 0
    folded, n = affine_fold.fold_conv_affine(_bn_model(), ops=("BatchNormalization",))
    assert n == 1
    folded, n = affine_fold.fold_conv_affine(_nhwc_model(), ops=("Add",))
    assert n == 1  # the first Add; the chain ends at the Sub
    np.testing.assert_allclose(_run(folded, _x())[0], _run(_nhwc_model(), _x())[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError):
        affine_fold.fold_conv_affine(_bn_model(), ops=("Relu",))


def test_a_graph_output_made_by_the_last_affine_node_keeps_its_producer():
    m = _bn_model()
    relu = m.graph.node[-1]
    m.graph.node.remove(relu)  # the BatchNormalization's output "b" is the graph output
    m.graph.output[0].name = "b"
    _nothing_folds(m)


def test_an_affine_output_read_inside_a_subgraph_keeps_its_producer():
    m = _bn_model()
    cond = helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cond", TensorProto.BOOL, [], [True]))
    branch = lambda n: helper.make_graph(  # noqa: E731
        [helper.make_node("Relu", ["b"], [n])], n, [], [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, C, 8, 8])])
    m.graph.node.extend([cond, helper.make_node("If", ["cond"], ["z"], then_branch=branch("t"), else_branch=branch("e"))])
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, 8, 8]))
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 0
    onnx.checker.check_model(folded)
    ref = _run(m, _x())
    for a, b in zip(_run(folded, _x()), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_auto_mode_folds_batch_normalization_and_meets_its_target():
    import passes

    m = _bn_model()
    feeds = [{"x": _arr((1, K, 8, 8), seed)} for seed in range(20, 26)]
    out, rep = passes.compress(m, target="cosine>=0.999", feeds=feeds)
    assert "BatchNormalization" not in {n.op_type for n in out.graph.node}
    assert any("folded into the Conv" in n for n in rep["notes"])
    assert rep["met_on_feeds"]
    for f in feeds:
        a, b = _run(out, f["x"])[0].ravel(), _run(m, f["x"])[0].ravel()
        assert float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) >= 0.999


def test_the_auto_mode_keeps_batch_normalization_where_the_fold_changes_the_outputs(monkeypatch):
    # (a fold whose float outputs move more than AFFINE_FOLD_MIN_SNR_DB from the model's would go
    # uncharged by the search, which measures against the folded model: here any change is too much)
    import passes
    from passes import auto

    monkeypatch.setattr(auto, "AFFINE_FOLD_MIN_SNR_DB", float("inf"))
    m = _bn_model()
    feeds = [{"x": _arr((1, K, 8, 8), seed)} for seed in range(20, 26)]
    out, rep = passes.compress(m, target="cosine>=0.999", feeds=feeds)
    assert "BatchNormalization" in {n.op_type for n in out.graph.node}
    assert any("not folded" in n and "dB" in n for n in rep["notes"])
    assert rep["met_on_feeds"]


def test_an_all_float_plan_returns_the_model_unfolded():
    # nothing quantized (the only weight is below min_elements): the model comes back as given, its
    # outputs bit for bit, not the folded form (which differs by float rounding)
    import passes

    m = _bn_model()
    feeds = [{"x": _arr((1, K, 8, 8), seed)} for seed in range(20, 26)]
    out, rep = passes.compress(m, target="cosine>=0.999", feeds=feeds, min_elements=10**6)
    assert "BatchNormalization" in {n.op_type for n in out.graph.node}
    for f in feeds:
        for a, b in zip(_run(out, f["x"]), _run(m, f["x"])):
            np.testing.assert_array_equal(a, b)


def _ir3(model, opset=9):
    """The model as IR 3 writes it: every initializer also listed as a graph input."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in m.graph.initializer)
    del m.opset_import[:]
    m.opset_import.append(helper.make_opsetid("", opset))
    m.ir_version = 3
    return m


def test_an_ir3_model_folds_with_its_initializers_unlisted():
    """IR 3 lists every initializer as an input (classic model-zoo CNNs, PyTorch <= 1.0): they are the
    model's constants there, not overridable inputs (before, BatchNormalization was kept)."""
    inits = [onnx.numpy_helper.from_array(_arr((C, K, 3, 3), 5), "W")] + [
        onnx.numpy_helper.from_array(_arr((C,), seed, lo, hi), n)
        for n, seed, lo, hi in (("s", 1, 0.5, 2.0), ("o", 2, -1.0, 1.0), ("m", 3, -1.0, 1.0), ("v", 4, 0.1, 2.0))]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "o", "m", "v"], ["b"], epsilon=1e-3),
             helper.make_node("Relu", ["b"], ["y"])]
    m = _ir3(_model(nodes, inits, [1, C, 8, 8]))
    onnx.checker.check_model(m, full_check=True)
    before = m.SerializeToString()
    folded, n = affine_fold.fold_conv_affine(m)
    assert n == 1 and [x.op_type for x in folded.graph.node] == ["Conv", "Relu"]
    assert folded.ir_version == 4 and [i.name for i in folded.graph.input] == ["x"]
    onnx.checker.check_model(folded, full_check=True)
    np.testing.assert_allclose(_run(folded, _x())[0], _run(m, _x())[0], rtol=1e-4, atol=1e-5)
    assert m.SerializeToString() == before  # the input model is not changed
    # nothing to fold: the IR 3 model itself comes back
    plain = _ir3(_model([helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1])], inits[:1], [1, C, 8, 8]))
    assert affine_fold.fold_conv_affine(plain) == (plain, 0)
