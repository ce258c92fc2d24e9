"""quantize_weights quantizes the float weights in Constant nodes of model-local function bodies
inside the body (Constant levels, scale [and zero point] + DequantizeLinear under the weight's
name), or keeps them float with the reason (include= given, the function's opset too old for the
form); the result runs in onnxruntime close to the original, fold_dequantize gives the weights back
as onnxruntime dequantizes them, bit for bit, and the auto mode and the command take such models."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import passes
from passes.graph import array_to_tensor
from test_function_fold import assert_valid, constant, dequantize_nodes, feeds_for, run, vi
from tools.surgeon_compress import main

K, N = 64, 96


def float_dense(s_type=TP.FLOAT, opset=17, fn_opset=None, seed=0, name="Dense", extra=()) -> onnx.FunctionProto:
    """local:<name>(inp) -> (inp @ Constant w[K, N] + Constant b[N], w): the weight as a second output."""
    rng = np.random.default_rng(seed)
    np_type = onnx.helper.tensor_dtype_to_np_dtype(s_type)
    body = [constant("w", (rng.normal(size=(K, N)) / np.sqrt(K)).astype(np_type), s_type),
            constant("b", (rng.normal(size=(N,)) * 0.1).astype(np_type), s_type),
            *extra,
            helper.make_node("MatMul", ["inp", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["out"]),
            helper.make_node("Identity", ["w"], ["weight"])]
    return helper.make_function("local", name, ["inp"], ["out", "weight"], body,
                                opset_imports=[helper.make_opsetid("", fn_opset or opset)])


def model_calling_twice(fn: onnx.FunctionProto, s_type=TP.FLOAT, opset=17, in_if: bool = False) -> onnx.ModelProto:
    """x[4, K] -> Dense -> Relu -> (first K features) -> Dense -> y[4, N]; the first call's weight
    an output too. in_if: both calls inside the then branch of an If (the else branch Neg(x) first)."""
    calls = [helper.make_node(fn.name, ["x"], ["h", "w1"], domain="local"), helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Slice", ["hr", "zero", "k", "one"], ["hk"]),
             helper.make_node(fn.name, ["hk"], ["y", "w2"], domain="local")]
    consts = [constant("zero", np.array([0], np.int64), TP.INT64), constant("k", np.array([K], np.int64), TP.INT64),
              constant("one", np.array([1], np.int64), TP.INT64)]
    outputs = [vi("y", s_type, [4, N]), vi("w1", s_type, [K, N])]
    inputs = [vi("x", s_type, [4, K])]
    nodes = consts + calls
    if in_if:
        then_g = helper.make_graph(calls, "then", [], outputs)
        else_calls = [helper.make_node("Neg", ["x"], ["xn"])] + [
            helper.make_node(n.op_type, [("xn" if i == "x" else i) + ("" if i == "x" or n.op_type == fn.name else "")
                                         for i in n.input], [o + "_e" for o in n.output], domain=n.domain)
            for n in calls]
        for n in else_calls[1:]:
            n.input[:] = [i if i in ("xn", "zero", "k", "one") else i + "_e" for i in n.input]
        else_g = helper.make_graph(else_calls, "else", [], [vi("y_e", s_type, [4, N]), vi("w1_e", s_type, [K, N])])
        nodes = consts + [helper.make_node("If", ["flag"], ["y", "w1"], then_branch=then_g, else_branch=else_g)]
        inputs.append(vi("flag", TP.BOOL, []))
    g = helper.make_graph(nodes, "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("local", 1)],
                          functions=[fn])
    m.ir_version = 10
    return m


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2)))


def body_ops(model: onnx.ModelProto, i: int = 0) -> list:
    return [n.op_type for n in model.functions[i].node]


# (quantize options, float type, least output SNR dB, least cosine)
FORMS = [
    (dict(), TP.FLOAT, 38, 0.9999),
    (dict(symmetric=False), TP.FLOAT, 38, 0.9999),
    (dict(bits=4), TP.FLOAT, 14, 0.98),
    (dict(bits=4, granularity="block", block_size=32), TP.FLOAT, 17, 0.99),
    (dict(granularity="tensor"), TP.FLOAT, 33, 0.9997),
    (dict(), TP.FLOAT16, 38, 0.9999),
]


@pytest.mark.parametrize("options,s_type,min_snr,min_cosine", FORMS)
@pytest.mark.parametrize("in_if", [False, True])
def test_function_weights_are_quantized_inside_the_body(options, s_type, min_snr, min_cosine, in_if):
    model = model_calling_twice(float_dense(s_type), s_type, in_if=in_if)
    before = model.SerializeToString()
    report = passes.Report()
    q = passes.quantize_weights(model, min_elements=0, report=report, **options)
    assert model.SerializeToString() == before
    assert_valid(q)
    body = q.functions[0].node
    dq = [n for n in body if n.op_type == "DequantizeLinear"]
    assert [n.output[0] for n in dq] == ["w"]  # the 1-D bias b stays float
    levels = {n.output[0]: n.attribute[0].t for n in body if n.op_type == "Constant"}
    assert levels[dq[0].input[0]].data_type == (TP.INT4 if options.get("bits") == 4 else
                                                TP.UINT8 if options.get("symmetric") is False else TP.INT8)
    assert levels["b"].data_type == s_type
    row = next(t for t in report.tensors if t.name == "w")
    assert row.location == "function local:Dense: Constant node" and not row.scheme.startswith("kept")
    assert not any("stay float" in n for n in report.notes)
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds, optimized=True), run(q, feeds, optimized=True)):
        assert snr_db(want, got) >= min_snr and cosine(want, got) >= min_cosine, (snr_db(want, got), cosine(want, got))
    # fold gives back the float weight as onnxruntime dequantizes it (unfused), bit for bit
    folded = passes.fold_dequantize(q)
    assert_valid(folded)
    assert dequantize_nodes(folded) == []
    for want, got in zip(run(q, feeds), run(folded, feeds)):
        assert want.tobytes() == got.tobytes()


def test_a_function_calling_another_and_an_overload_quantize_each_body():
    inner = float_dense(seed=1, name="Inner")
    outer_body = [constant("v", (np.random.default_rng(2).normal(size=(N, K)) / np.sqrt(N)).astype(np.float32), TP.FLOAT),
                  helper.make_node("Inner", ["inp"], ["h", "unused"], domain="local"),
                  helper.make_node("MatMul", ["h", "v"], ["out"])]
    outer = helper.make_function("local", "Outer", ["inp"], ["out"], outer_body,
                                 opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    g = helper.make_graph([helper.make_node("Outer", ["x"], ["h"], domain="local"),
                           helper.make_node("Outer", ["h"], ["y"], domain="local")],
                          "g", [vi("x", TP.FLOAT, [4, K])], [vi("y", TP.FLOAT, [4, K])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                              functions=[inner, outer])
    report = passes.Report()
    q = passes.quantize_weights(model, min_elements=0, report=report)
    assert_valid(q)
    assert sorted((t.name, t.location) for t in report.tensors if not t.scheme.startswith("kept")) == [
        ("v", "function local:Outer: Constant node"), ("w", "function local:Inner: Constant node")]
    feeds = feeds_for(model)
    assert snr_db(run(model, feeds)[0], run(q, feeds)[0]) > 35
    folded = passes.fold_dequantize(q)
    assert run(q, feeds)[0].tobytes() == run(folded, feeds)[0].tobytes()


def test_include_patterns_keep_the_bodies_float_with_the_reason():
    model = model_calling_twice(float_dense())
    report = passes.Report()
    q = passes.quantize_weights(model, min_elements=0, include=["w*"], report=report)
    assert q.functions[0].SerializeToString() == model.functions[0].SerializeToString()
    row = next(t for t in report.tensors if t.location.startswith("function"))
    assert row.name == "w" and row.scheme.startswith("kept: not included (include patterns name the graphs'")
    assert any(n.startswith("1 float weight(s) inside model-local functions stay float (1 not included")
               for n in report.notes)


def test_exclude_patterns_apply_to_body_weights():
    model = model_calling_twice(float_dense())
    q = passes.quantize_weights(model, min_elements=0, exclude=["w"])
    assert q.functions[0].SerializeToString() == model.functions[0].SerializeToString()


def _plain_function_model(opset: int, fn_opset: int, extra_body=(), attributes=()) -> onnx.ModelProto:
    """x[4, K] -> local:Dense (Constant w[K, N], MatMul) -> y: ops whose schema is the same at both
    opsets (the checker refuses a function importing another opset otherwise)."""
    w = (np.random.default_rng(5).normal(size=(K, N)) / np.sqrt(K)).astype(np.float32)
    body = [constant("w", w, TP.FLOAT), *extra_body, helper.make_node("MatMul", ["inp", "w"], ["out"])]
    fn = helper.make_function("local", "Dense", ["inp"], ["out"], body, opset_imports=[helper.make_opsetid("", fn_opset)],
                              attributes=list(attributes))
    call = helper.make_node("Dense", ["x"], ["y"], domain="local")
    if attributes:
        call.attribute.append(helper.make_attribute("axes", [1]))
    g = helper.make_graph([call], "g", [vi("x", TP.FLOAT, [4, K])], [vi("y", TP.FLOAT, [4, N])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("local", 1)],
                              functions=[fn])
    model.ir_version = 8
    return model


def test_a_function_whose_opset_is_too_old_for_the_form_keeps_its_weight_float():
    """A per-tensor DequantizeLinear needs opset 10: the model imports 10, its function 9 (valid:
    Constant and MatMul did not change between them; raising one function's opset would convert
    its other nodes too): the weight stays float, with the reason."""
    model = _plain_function_model(10, 9)
    assert_valid(model)
    report = passes.Report()
    q = passes.quantize_weights(model, granularity="tensor", min_elements=0, report=report)
    assert_valid(q)
    assert q.functions[0].SerializeToString() == model.functions[0].SerializeToString()
    row = next(t for t in report.tensors if t.name == "w")
    assert row.scheme == ("kept: its function imports opset 9 of the default domain; this form's DequantizeLinear "
                          "needs 10")
    assert any("inside model-local functions stay float (1 its function imports opset 9" in n for n in report.notes)
    feeds = feeds_for(model)
    assert run(q, feeds)[0].tobytes() == run(model, feeds)[0].tobytes()


def test_a_raise_only_function_weights_ask_for_that_fails_leaves_the_model_as_it_was():
    """Per channel needs opset 13; the model (11) holds no graph weight, and its function's
    ReduceSum takes its axes from the call (axes became an input at 13: the converter cannot raise
    it): no error, the model keeps its opset and the weight stays float, with the reason."""
    reduce = helper.make_node("ReduceSum", ["w"], ["w_sum"], keepdims=1)
    reduce.attribute.append(onnx.AttributeProto(name="axes", ref_attr_name="axes", type=onnx.AttributeProto.INTS))
    model = _plain_function_model(11, 11, extra_body=[reduce], attributes=["axes"])
    assert_valid(model)
    report = passes.Report()
    q = passes.quantize_weights(model, min_elements=0, report=report)
    assert_valid(q)
    assert [o.version for o in q.opset_import if o.domain == ""] == [11]
    assert q.functions[0].SerializeToString() == model.functions[0].SerializeToString()
    assert next(t for t in report.tensors if t.name == "w").scheme.startswith("kept: its function imports opset 11")


def test_the_model_is_raised_for_function_weights_with_its_functions():
    """4-bit levels need opset 21: the model (opset 17) is raised, its functions with it, for a
    weight that only a function body holds."""
    model = model_calling_twice(float_dense())
    report = passes.Report()
    q = passes.quantize_weights(model, bits=4, min_elements=0, report=report)
    assert_valid(q)
    assert [o.version for o in q.opset_import if o.domain == ""] == [21]
    assert [o.version for o in q.functions[0].opset_import if o.domain == ""] == [21]
    assert "DequantizeLinear" in body_ops(q) and q.ir_version >= 10
    assert any("opset raised from 17 to 21" in n for n in report.notes)


def test_a_constant_whose_value_the_call_gives_is_no_weight():
    by_call = helper.make_node("Constant", [], ["t"], name="by_call")
    by_call.attribute.append(onnx.AttributeProto(name="value", ref_attr_name="table", type=onnx.AttributeProto.TENSOR))
    fn = float_dense(extra=(by_call,))
    fn.node[-1].CopyFrom(helper.make_node("Add", ["w", "t"], ["weight"]))
    fn.attribute.append("table")
    model = model_calling_twice(fn)
    table = np.random.default_rng(3).normal(size=(K, N)).astype(np.float32)
    for node in model.graph.node:
        if node.op_type == "Dense":
            node.attribute.append(helper.make_attribute("table", array_to_tensor(table, "table", TP.FLOAT)))
    assert_valid(model)
    q = passes.quantize_weights(model, min_elements=0)
    assert_valid(q)
    assert any(n.output[0] == "t" and n.attribute[0].ref_attr_name == "table" for n in q.functions[0].node)
    feeds = feeds_for(model)
    assert snr_db(run(model, feeds)[1], run(q, feeds)[1]) > 35


def test_compress_and_the_command_on_a_model_with_function_weights(tmp_path, capsys):
    """passes.compress (which names the weights it measured: function bodies stay float, with the
    reason) meets its target; the command quantizes the body's weight and its output folds."""
    model = model_calling_twice(float_dense(seed=4))
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    feeds = [feeds_for(model, seed) for seed in range(4)]
    out, record = passes.compress(str(src), target="snr>=30", feeds=feeds)
    assert_valid(out)
    assert record["met_on_feeds"] and passes.evaluate(str(src), out, feeds=feeds).metrics["snr"] >= 30 - 1e-9

    dst = tmp_path / "q.onnx"
    rc = main(["compress", str(src), "-o", str(dst), "--min-elements", "0"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "stay float" not in stdout
    q = onnx.load(str(dst))
    assert_valid(q)
    assert "DequantizeLinear" in body_ops(q)
    for f in feeds:
        want, got = run(model, f, optimized=True), run(q, f, optimized=True)
        assert snr_db(want[0], got[0]) > 35 and cosine(want[0], got[0]) > 0.9999
    folded = tmp_path / "f.onnx"
    assert main(["fold", str(dst), "-o", str(folded)]) == 0, capsys.readouterr().err
    f = onnx.load(str(folded))
    assert_valid(f)
    assert dequantize_nodes(f) == []
    assert run(q, feeds[0])[0].tobytes() == run(f, feeds[0])[0].tobytes()
