"""fold_dequantize folds constant DequantizeLinear nodes inside model-local function bodies
(ModelProto.functions): their inputs are Constant nodes of the body (a function has no
initializers). The folded model passes onnx.checker's full check and strict shape inference, and
onnxruntime gives the same outputs, bit for bit, as on the unfolded model."""
import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

from passes import InvalidModelError, Report, fold_dequantize
from passes.graph import array_to_tensor

K, N = 12, 16  # the function's weight: x[2, K] @ w[K, N] (N > K: a second call reads the first K outputs)
LEVELS = {TP.INT8: (-128, 128, np.int8), TP.UINT8: (0, 256, np.uint8), TP.INT4: (-8, 8, np.int8),
          TP.UINT4: (0, 16, np.uint8), TP.INT16: (-32768, 32768, np.int16), TP.UINT16: (0, 65536, np.uint16)}
SCALES = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}
# form name -> (axis attribute or None, block_size, scale shape) of w[K, N]
FORMS = {"tensor": (None, 0, ()), "axis1": (1, 0, (N,)), "axis0": (0, 0, (K,)),
         "block": (0, 5, (3, N))}  # K = 12: two blocks of 5 and one of 2


def constant(name: str, array: np.ndarray, elem_type: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name + "_const", value=array_to_tensor(array, name, elem_type))


def dq_body(prefix: str, q_type: int, s_type: int, form: str, with_zp: bool, seed: int, dq_domain: str = "") -> list:
    """Constant levels, scale [and zero point] of w[K, N] and the DequantizeLinear of them -> `prefix`w."""
    rng = np.random.default_rng(seed)
    lo, hi, np_type = LEVELS[q_type]
    axis, block, sshape = FORMS[form]
    q = rng.integers(lo, hi, size=(K, N)).astype(np_type)
    # scales over many exponents, so that the rounding to the output type matters
    scale = (rng.uniform(0.5, 1.5, size=sshape) * 2.0 ** rng.integers(-14, -4, size=sshape)).astype(SCALES[s_type])
    nodes = [constant(prefix + "q", q, q_type), constant(prefix + "s", scale, s_type)]
    inputs = [prefix + "q", prefix + "s"]
    if with_zp:
        nodes.append(constant(prefix + "z", rng.integers(lo, hi, size=sshape).astype(np_type), q_type))
        inputs.append(prefix + "z")
    attrs = {}
    if axis is not None:
        attrs["axis"] = axis
    if block:
        attrs["block_size"] = block
    nodes.append(helper.make_node("DequantizeLinear", inputs, [prefix + "w"], name=prefix + "dq", domain=dq_domain,
                                  **attrs))
    return nodes


def vi(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def dense_function(q_type=TP.INT8, s_type=TP.FLOAT, form="axis1", with_zp=False, opset=21, seed=0, dq_domain="",
                   name="Dense") -> onnx.FunctionProto:
    """local:Dense(inp) -> (inp @ DequantizeLinear(constants), the weight itself)."""
    body = dq_body("", q_type, s_type, form, with_zp, seed, dq_domain)
    body.append(helper.make_node("MatMul", ["inp", "w"], ["out"]))
    body.append(helper.make_node("Identity", ["w"], ["weight"]))
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(dq_domain, 1)] if dq_domain else [])
    return helper.make_function("local", name, ["inp"], ["out", "weight"], body, opset_imports=imports)


def model_of(nodes, inputs, outputs, functions, opset: int, ir: int = 10, extra_domains=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("local", 1)]
    imports += [helper.make_opsetid(d, 1) for d in extra_domains]
    m = helper.make_model(g, opset_imports=imports, functions=functions)
    m.ir_version = ir
    return m


def called_twice(fn: onnx.FunctionProto, s_type=TP.FLOAT, opset=21, extra_domains=()) -> onnx.ModelProto:
    """x -> Dense -> Relu -> Dense -> y, and the weight of the first call as an output."""
    nodes = [helper.make_node("Dense", ["x"], ["h", "w1"], domain="local"), helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Slice", ["hr", "zero", "k", "one"], ["hk"]),
             helper.make_node("Dense", ["hk"], ["y", "w2"], domain="local")]
    consts = [constant("zero", np.array([0], np.int64), TP.INT64), constant("k", np.array([K], np.int64), TP.INT64),
              constant("one", np.array([1], np.int64), TP.INT64)]
    return model_of(consts + nodes, [vi("x", s_type, [2, K])], [vi("y", s_type, [2, N]), vi("w1", s_type, [K, N])],
                    [fn], opset, extra_domains=extra_domains)


def feeds_for(model: onnx.ModelProto, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for v in model.graph.input:
        shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
        elem = v.type.tensor_type.elem_type
        out[v.name] = (np.array(True) if elem == TP.BOOL else
                       rng.normal(size=shape).astype(onnx.helper.tensor_dtype_to_np_dtype(elem)))
    return out


def run(model: onnx.ModelProto, feeds: dict, optimized: bool = False) -> list:
    so = ort.SessionOptions()
    if not optimized:  # DequantizeLinear run as it is (no fusion into int8 kernels)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def dequantize_nodes(model: onnx.ModelProto) -> list:
    """(where, node name) of every DequantizeLinear left, graphs and function bodies."""
    found = []

    def walk(nodes, where):
        for n in nodes:
            if n.op_type == "DequantizeLinear":
                found.append((where, n.name))
            for a in n.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(g.node, where + "/" + a.name)

    walk(model.graph.node, "graph")
    for fn in model.functions:
        walk(fn.node, fn.name)
    return found


def assert_valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)


def assert_folds_exactly(model: onnx.ModelProto, **fold_options) -> onnx.ModelProto:
    """fold_dequantize(model): valid, nothing left to dequantize, the input untouched, and
    onnxruntime's outputs those of the unfolded model bit for bit."""
    before = model.SerializeToString()
    folded = fold_dequantize(model, **fold_options)
    assert model.SerializeToString() == before
    assert_valid(folded)
    assert dequantize_nodes(folded) == []
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds), run(folded, feeds)):
        assert want.dtype == got.dtype and want.tobytes() == got.tobytes()
    return folded


# (level type, scale type, form, zero point, opset, DequantizeLinear's domain): every form fold
# supports, each at an opset that defines it
CASES = [
    (TP.UINT8, TP.FLOAT, "tensor", True, 10, ""),  # DequantizeLinear-10: per tensor only
    (TP.INT8, TP.FLOAT, "tensor", False, 11, ""),
    (TP.INT8, TP.FLOAT, "axis1", False, 13, ""),
    (TP.UINT8, TP.FLOAT, "axis0", True, 13, ""),
    (TP.INT8, TP.FLOAT16, "axis1", True, 19, ""),
    (TP.INT8, TP.FLOAT, "block", False, 21, ""),
    (TP.UINT8, TP.FLOAT16, "block", True, 21, ""),
    (TP.INT4, TP.FLOAT, "axis1", False, 21, ""),
    (TP.UINT4, TP.FLOAT, "block", True, 21, ""),
    (TP.INT4, TP.FLOAT16, "tensor", True, 23, ""),
    (TP.INT16, TP.FLOAT, "axis1", True, 21, ""),
    (TP.UINT16, TP.FLOAT, "tensor", True, 24, ""),
    (TP.INT8, TP.FLOAT, "block", True, 25, ""),
    (TP.INT16, TP.FLOAT, "axis1", True, 17, "com.microsoft"),  # onnxruntime's quantizer's int16 below opset 21
]


@pytest.mark.parametrize("q_type,s_type,form,with_zp,opset,domain", CASES)
def test_a_function_called_twice_folds_bit_exactly(q_type, s_type, form, with_zp, opset, domain):
    fn = dense_function(q_type, s_type, form, with_zp, opset, dq_domain=domain)
    model = called_twice(fn, s_type, opset, extra_domains=(domain,) if domain else ())
    report = Report()
    folded = assert_folds_exactly(model, report=report)
    body = folded.functions[0].node
    assert [n.op_type for n in body] == ["Constant", "MatMul", "Identity"]  # levels, scale, zero point gone
    assert body[0].output[0] == "w" and body[0].attribute[0].t.data_type == s_type
    assert [(t.name, t.location, t.scheme) for t in report.tensors] == [
        ("w", "function local:Dense: Constant node", "folded")]


def test_a_function_calling_another_function():
    """local:Outer's body calls local:Dense and holds a DequantizeLinear of its own; both fold."""
    dense = dense_function(TP.INT8, TP.FLOAT, "axis1", False, 21, seed=1)
    outer_body = dq_body("o", TP.UINT8, TP.FLOAT, "axis0", True, seed=2)
    outer_body += [helper.make_node("Dense", ["inp"], ["h", "unused"], domain="local"),
                   helper.make_node("Gemm", ["h", "ow"], ["out"], transB=1)]  # [2, N] x [K, N]^T -> [2, K]
    outer = helper.make_function("local", "Outer", ["inp"], ["out"], outer_body,
                                 opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("local", 1)])
    nodes = [helper.make_node("Outer", ["x"], ["h"], domain="local"), helper.make_node("Outer", ["h"], ["y"], domain="local")]
    model = model_of(nodes, [vi("x", TP.FLOAT, [2, K])], [vi("y", TP.FLOAT, [2, K])], [dense, outer], 21)
    report = Report()
    assert_folds_exactly(model, report=report)
    assert sorted((t.name, t.location) for t in report.tensors) == [
        ("ow", "function local:Outer: Constant node"), ("w", "function local:Dense: Constant node")]


def test_a_function_used_inside_an_if_subgraph_and_a_dequantize_linear_in_the_body_s_own_if():
    """The main graph calls the function from both branches of an If; the function's body holds
    an If of its own whose branches dequantize constants (the else branch reads levels the body
    defines outside it: a subgraph sees its enclosing scope)."""
    rng = np.random.default_rng(6)
    inner_then = helper.make_graph(dq_body("t", TP.INT8, TP.FLOAT, "axis1", False, seed=5)
                                   + [helper.make_node("Add", ["tw", "w"], ["r"])], "then", [], [vi("r", TP.FLOAT, [K, N])])
    inner_else = helper.make_graph([helper.make_node("DequantizeLinear", ["e_q", "e_s"], ["ew"], name="else_dq", axis=1),
                                    helper.make_node("Sub", ["ew", "w"], ["r"])], "else", [], [vi("r", TP.FLOAT, [K, N])])
    body = dq_body("", TP.INT4, TP.FLOAT, "block", True, seed=4)
    body += [constant("e_q", rng.integers(-128, 128, size=(K, N)).astype(np.int8), TP.INT8),
             constant("e_s", rng.uniform(0.01, 0.02, size=(N,)).astype(np.float32), TP.FLOAT),
             helper.make_node("If", ["flag"], ["mixed"], then_branch=inner_then, else_branch=inner_else),
             helper.make_node("MatMul", ["inp", "w"], ["mm"]),
             helper.make_node("Gemm", ["mm", "mixed"], ["out"], transB=1)]  # [2, N] x [K, N]^T
    fn = helper.make_function("local", "Dense", ["inp", "flag"], ["out"], body,
                              opset_imports=[helper.make_opsetid("", 21)])
    then_g = helper.make_graph([helper.make_node("Dense", ["x", "flag"], ["a"], domain="local")],
                               "then", [], [vi("a", TP.FLOAT, [2, K])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["xn"]),
                                helper.make_node("Dense", ["xn", "flag"], ["b"], domain="local")],
                               "else", [], [vi("b", TP.FLOAT, [2, K])])
    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = model_of(nodes, [vi("x", TP.FLOAT, [2, K]), vi("flag", TP.BOOL, [])], [vi("y", TP.FLOAT, [2, K])], [fn], 21)
    report = Report()
    folded = assert_folds_exactly(model, report=report)  # (flag True)
    feeds = dict(feeds_for(model), flag=np.array(False))
    assert run(model, feeds)[0].tobytes() == run(folded, feeds)[0].tobytes()
    assert sorted((t.name, t.location) for t in report.tensors) == [
        ("ew", "function local:Dense: subgraph If/else_branch: Constant node"),
        ("tw", "function local:Dense: subgraph If/then_branch: Constant node"),
        ("w", "function local:Dense: Constant node")]
    left = {n.output[0] for n in folded.functions[0].node}
    assert "e_q" not in left and "e_s" not in left  # read by the folded else branch alone: gone


def test_attribute_parameterised_nodes_are_left_alone():
    """A DequantizeLinear whose axis the call gives (axis=@ax), and one reading a Constant whose
    value the call gives (value=@levels), differ from call to call: they stay; the plain one folds."""
    rng = np.random.default_rng(7)
    q = rng.integers(-128, 128, size=(K, N)).astype(np.int8)
    by_call_axis = helper.make_node("DequantizeLinear", ["q", "s"], ["w_axis"], name="by_call_axis")
    by_call_axis.attribute.append(onnx.AttributeProto(name="axis", ref_attr_name="ax", type=onnx.AttributeProto.INT))
    levels_of_call = helper.make_node("Constant", [], ["q_call"], name="levels_of_call")
    levels_of_call.attribute.append(onnx.AttributeProto(name="value", ref_attr_name="levels",
                                                        type=onnx.AttributeProto.TENSOR))
    body = [constant("q", q, TP.INT8), constant("s", rng.uniform(0.01, 0.02, size=(N,)).astype(np.float32), TP.FLOAT),
            constant("s0", np.array(0.015, np.float32), TP.FLOAT),
            by_call_axis, levels_of_call,
            helper.make_node("DequantizeLinear", ["q_call", "s0"], ["w_call"], name="levels_from_the_call"),
            helper.make_node("DequantizeLinear", ["q", "s"], ["w_plain"], name="plain", axis=1),
            helper.make_node("Sum", ["w_axis", "w_call", "w_plain"], ["w"]),
            helper.make_node("MatMul", ["inp", "w"], ["out"])]
    fn = helper.make_function("local", "Dense", ["inp"], ["out"], body, opset_imports=[helper.make_opsetid("", 21)],
                              attributes=["ax", "levels"])
    call_levels = rng.integers(-128, 128, size=(K, N)).astype(np.int8)
    call = helper.make_node("Dense", ["x"], ["y"], domain="local", ax=1,
                            levels=array_to_tensor(call_levels, "levels", TP.INT8))
    model = model_of([call], [vi("x", TP.FLOAT, [2, K])], [vi("y", TP.FLOAT, [2, N])], [fn], 21)
    folded = fold_dequantize(model)
    assert_valid(folded)
    assert dequantize_nodes(folded) == [("Dense", "by_call_axis"), ("Dense", "levels_from_the_call")]
    left = folded.functions[0].node
    assert any(n.output[0] == "q_call" and n.attribute[0].ref_attr_name == "levels" for n in left)
    assert any(n.output[0] == "q" for n in left)  # still read by the node the call parameterises
    feeds = feeds_for(model)
    assert run(model, feeds)[0].tobytes() == run(folded, feeds)[0].tobytes()


def test_a_narrower_dtype_in_a_function_body():
    """dtype="float16" stores the body's folded weight as a float16 Constant behind a Cast back."""
    fn = dense_function(TP.INT8, TP.FLOAT, "axis1", False, 21, seed=8)
    model = called_twice(fn)
    folded = fold_dequantize(model, dtype="float16")
    assert_valid(folded)
    body = folded.functions[0].node
    assert [n.op_type for n in body] == ["Constant", "Cast", "MatMul", "Identity"]
    assert body[0].attribute[0].t.data_type == TP.FLOAT16 and body[1].output[0] == "w"
    feeds = feeds_for(model)
    exact = fold_dequantize(model)
    want = run(exact, feeds)[1].astype(np.float16).astype(np.float32)  # the weight, through float16
    assert run(folded, feeds)[1].tobytes() == want.tobytes()


def test_a_damaged_dequantize_linear_in_a_body_is_refused_naming_it():
    fn = dense_function(TP.INT8, TP.FLOAT, "axis1", False, 21, seed=9)
    for n in fn.node:
        if n.op_type == "DequantizeLinear":
            n.attribute[0].i = 0  # axis 0: K = 12 values, the scale holds N = 16
    with pytest.raises(InvalidModelError, match="DequantizeLinear 'dq': scale shape"):
        fold_dequantize(called_twice(fn))


def test_functions_without_a_dequantize_linear_come_back_as_they_were():
    fn = dense_function(TP.INT8, TP.FLOAT, "axis1", False, 21, seed=10)
    folded_fn = fold_dequantize(called_twice(fn)).functions[0]
    again = fold_dequantize(model_of([helper.make_node("Dense", ["x"], ["y", "w"], domain="local")],
                                     [vi("x", TP.FLOAT, [2, K])], [vi("y", TP.FLOAT, [2, N])], [folded_fn], 21))
    assert again.functions[0].SerializeToString() == folded_fn.SerializeToString()


def test_progress_counts_the_function_bodies():
    fn = dense_function(TP.INT8, TP.FLOAT, "axis1", False, 21, seed=11)
    seen = []
    fold_dequantize(called_twice(fn), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]


@pytest.mark.parametrize("q_type,form", list(itertools.product([TP.INT8, TP.UINT4], ["axis1", "block"])))
def test_onnxruntime_optimised_outputs_stay_close(q_type, form):
    """With onnxruntime's optimisations on (it may fuse the unfolded DequantizeLinear + MatMul into
    kernels of its own) the folded model stays within float rounding of the unfolded one."""
    model = called_twice(dense_function(q_type, TP.FLOAT, form, True, 21, seed=12))
    folded = fold_dequantize(model)
    feeds = feeds_for(model)
    for want, got in zip(run(model, feeds, optimized=True), run(folded, feeds, optimized=True)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fold_function_bodies_folds_in_place_and_counts():
    """The in-place entry (for a caller that owns its model, such as the runtime's fold at load)
    gives the function bodies fold_dequantize writes."""
    from passes.fold import fold_function_bodies

    model = called_twice(dense_function(TP.UINT4, TP.FLOAT16, "block", True, 21, seed=13), TP.FLOAT16)
    want = fold_dequantize(model).functions[0].SerializeToString()
    report = Report()
    assert fold_function_bodies(model, report=report) == 1
    assert model.functions[0].SerializeToString() == want
    assert [t.location for t in report.tensors] == ["function local:Dense: Constant node"]
    assert fold_function_bodies(model) == 0


def test_the_body_s_value_info_keeps_what_is_still_defined():
    """value_info of a body (onnx >= 1.16): entries of the folded-away constants go, those of the
    function's inputs and of the values still computed stay."""
    fn = dense_function(TP.INT8, TP.FLOAT, "axis1", False, 21, seed=14)
    fn.value_info.extend([vi("inp", TP.FLOAT, [2, K]), vi("q", TP.INT8, [K, N]), vi("w", TP.FLOAT, [K, N]),
                          vi("out", TP.FLOAT, [2, N])])
    folded = assert_folds_exactly(called_twice(fn))
    assert [v.name for v in folded.functions[0].value_info] == ["inp", "w", "out"]
