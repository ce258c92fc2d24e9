"""The auto mode (passes.compress with a target) searches the float weights held in Constant nodes of
model-local function bodies too: the functions holding them are inlined for the search and in the result,
each body tensor one main-graph tensor for all the function's calls (named domain:function/name), so they
are allocated, measured and quantized like graph weights; functions without weights stay functions, and a
model whose functions cannot be inlined soundly keeps them (weights float, a note saying why)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import passes
from passes import auto
from test_function_fold import assert_valid, constant, feeds_for, run, vi
from test_function_quantize import K, N, float_dense, model_calling_twice
from tools.surgeon_compress import main


def float_bytes(model: onnx.ModelProto) -> int:
    """Bytes of float32 values stored anywhere: initializers and Constant nodes of graphs and bodies."""
    total = 0
    graphs = [info.graph for info in passes.graph.iter_graphs(model)]
    nodes = [n for g in graphs for n in g.node] + [n for f in model.functions for n in f.node]
    for t in [t for g in graphs for t in g.initializer] + [n.attribute[0].t for n in nodes
                                                            if n.op_type == "Constant" and n.attribute
                                                            and n.attribute[0].type == onnx.AttributeProto.TENSOR]:
        if t.data_type == TP.FLOAT:
            total += 4 * int(np.prod(t.dims))
    return total


def feeds_of(model, n=8):
    return [feeds_for(model, seed) for seed in range(n)]


def gelu_function() -> onnx.FunctionProto:
    """local:Act(x) = x * Sigmoid(1.702 x): no weight, stays a function."""
    return helper.make_function("local", "Act", ["x"], ["y"], [
        constant("k", np.array(1.702, np.float32), TP.FLOAT), helper.make_node("Mul", ["x", "k"], ["kx"]),
        helper.make_node("Sigmoid", ["kx"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
        opset_imports=[helper.make_opsetid("", 17)])


def nested_model(fn_opset=17) -> onnx.ModelProto:
    """x[4, K] -> Block -> Act -> y: Block calls Dense twice (Dense holds w[K, K] and b[K]); Act holds no weight."""
    rng = np.random.default_rng(5)
    dense = helper.make_function("local", "Dense", ["a"], ["b"], [
        constant("w", (rng.normal(size=(K, K)) / np.sqrt(K)).astype(np.float32), TP.FLOAT),
        constant("bias", (rng.normal(size=(K,)) * 0.1).astype(np.float32), TP.FLOAT),
        helper.make_node("MatMul", ["a", "w"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["b"])],
        opset_imports=[helper.make_opsetid("", fn_opset)])
    block = helper.make_function("local", "Block", ["x"], ["y"], [
        helper.make_node("Dense", ["x"], ["h"], domain="local"), helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Dense", ["t"], ["h2"], domain="local"), helper.make_node("Add", ["x", "h2"], ["y"])],
        opset_imports=[helper.make_opsetid("", fn_opset), helper.make_opsetid("local", 1)])
    g = helper.make_graph([helper.make_node("Block", ["x"], ["b1"], domain="local"),
                           helper.make_node("Act", ["b1"], ["y"], domain="local")],
                          "g", [vi("x", TP.FLOAT, [4, K])], [vi("y", TP.FLOAT, [4, K])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          functions=[dense, block, gelu_function()])
    m.ir_version = 10
    return m


def assert_meets(src, out, feeds, target):
    metric, threshold = target.split(">=")
    assert passes.evaluate(src, out, feeds=feeds).metrics[metric] >= float(threshold) - 1e-9


@pytest.mark.parametrize("in_if", [False, True])
def test_a_function_called_twice_has_its_weight_searched_once(in_if):
    """Dense (w[K, N] in its body) called twice, directly or inside an If branch: the search names the weight
    local:Dense/w, quantizes it (one tensor both calls read), and the result meets the target."""
    model = model_calling_twice(float_dense(seed=4), in_if=in_if)
    feeds = feeds_of(model)
    before = model.SerializeToString()
    out, record = passes.compress(model, target="cosine>=0.999", feeds=feeds)
    assert model.SerializeToString() == before
    assert_valid(out)
    rows = {r["name"]: r for r in record["tensors"]}
    assert rows["local:Dense/w"]["form"] != "float" and rows["local:Dense/w"]["shape"] == [K, N]
    assert not out.functions
    assert record["met_on_feeds"]
    assert_meets(model, out, feeds, "cosine>=0.999")
    # the weight once, not once a call: no float copy of it left, and the file well under the original
    assert float_bytes(out) < K * N * 4 // 2
    assert out.ByteSize() < model.ByteSize() * 0.5
    assert any("inlined (local:Dense)" in n for n in record["notes"])


def test_nested_functions_inlined_and_a_weightless_one_kept():
    """Block calls Dense twice: both are inlined (Block's body would keep Dense's calls), Dense's weight and
    bias each one tensor; Act, without weights, stays a function the result calls."""
    model = nested_model()
    feeds = feeds_of(model)
    out, record = passes.compress(model, target="cosine>=0.999", feeds=feeds)
    assert_valid(out)
    assert [f.name for f in out.functions] == ["Act"] and any(n.op_type == "Act" for n in out.graph.node)
    rows = {r["name"]: r for r in record["tensors"]}
    assert rows["local:Dense/w"]["form"] != "float"
    # the bias is shared too (one 1-D tensor, not one per call)
    names = [t.name for t in out.graph.initializer] + [o for n in out.graph.node for o in n.output]
    assert sum(name.startswith("local:Dense/bias") for name in names) == 1
    assert record["met_on_feeds"]
    assert_meets(model, out, feeds, "cosine>=0.999")
    assert out.ByteSize() < model.ByteSize() * 0.5


def test_a_function_at_an_older_opset_with_the_same_ops_is_inlined():
    """Dense and Block import opset 14, the model 17: MatMul, Add and Tanh are defined alike at both, so
    inlining runs them as the functions did; the weight is searched."""
    model = nested_model(fn_opset=14)
    feeds = feeds_of(model)
    out, record = passes.compress(model, target="cosine>=0.999", feeds=feeds)
    assert_valid(out)
    assert {r["name"]: r["form"] for r in record["tensors"]}["local:Dense/w"] != "float"
    assert_meets(model, out, feeds, "cosine>=0.999")


def test_a_function_whose_ops_changed_between_opsets_is_not_inlined():
    """Dense imports opset 11 and holds a ReduceSum (axes an attribute there, an input from 13): inlined at the
    model's 17 it would mean something else, so the inlining leaves the model as it is with a note saying why
    (onnx's checker refuses such a model too, so passes.compress names it invalid before any search)."""
    rng = np.random.default_rng(2)
    dense = helper.make_function("local", "Dense", ["a"], ["b"], [
        constant("w", (rng.normal(size=(K, N)) / np.sqrt(K)).astype(np.float32), TP.FLOAT),
        helper.make_node("MatMul", ["a", "w"], ["mm"]),
        helper.make_node("ReduceSum", ["mm"], ["b"], axes=[1], keepdims=1)],
        opset_imports=[helper.make_opsetid("", 11)])
    g = helper.make_graph([helper.make_node("Dense", ["x"], ["y"], domain="local")], "g",
                          [vi("x", TP.FLOAT, [4, K])], [vi("y", TP.FLOAT, [4, 1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                              functions=[dense])
    model.ir_version = 10
    notes = []
    assert auto._inline_function_weights(model, notes) is model
    assert "stay float" in notes[0] and "local:Dense imports opset 11" in notes[0]
    with pytest.raises(passes.errors.InvalidModelError, match="not valid ONNX"):
        passes.compress(model, target="snr>=30", feeds=feeds_of(model, 2))


def test_function_weight_names_are_unambiguous():
    """Overloads get their own names, and a name the graph already uses is not taken twice."""
    fn = float_dense()
    assert auto.function_weight_name(fn, "w") == "local:Dense/w"
    fn.overload = "v2"
    assert auto.function_weight_name(fn, "w") == "local:Dense(v2)/w"
    model = model_calling_twice(float_dense(seed=1))
    model.graph.node.append(helper.make_node("Identity", ["w1"], ["local:Dense/w"]))
    model.graph.output.append(vi("local:Dense/w", TP.FLOAT, [K, N]))
    inlined = auto._inline_function_weights(model, [])
    assert_valid(inlined)
    shared = [t.name for t in inlined.graph.initializer]
    assert shared == ["local:Dense/w_1", "local:Dense/b"]
    f = feeds_for(model)
    for want, got in zip(run(model, f), run(inlined, f)):
        assert np.array_equal(want, got)


def test_an_all_float_result_keeps_the_functions():
    """Where no quantized plan meets the target, the model comes back as given: its functions not inlined."""
    model = model_calling_twice(float_dense(seed=4))
    out, record = passes.compress(model, target="snr>=200", feeds=feeds_of(model, 4))
    assert [f.name for f in out.functions] == ["Dense"]
    assert all(r["form"] == "float" for r in record["tensors"])


def test_the_command_with_a_target_quantizes_function_weights(tmp_path, capsys):
    """surgeon-compress compress --target on a model whose weights live in a function: the row names the
    weight, the output is far smaller and meets the target (the command's own --require check)."""
    model = nested_model()
    src, dst, feeds = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "feeds.npz"
    onnx.save(model, str(src))
    np.savez(feeds, **{f"{i}/x": f["x"] for i, f in enumerate(feeds_of(model))})
    rc = main(["compress", str(src), "-o", str(dst), "--target", "cosine>=0.999", "--feeds", str(feeds),
               "--verbose"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "local:Dense/w" in stdout
    assert dst.stat().st_size < src.stat().st_size * 0.5


def test_a_shared_matmul_weight_gets_one_step_forms():
    """Dense's weight, read by the two inlined MatMuls only, gets the one-step forms single-reader MatMul weights
    get (its output columns weigh alike at both); a weight another op reads too (Identity -> an output) does not."""
    model = nested_model()
    probe = auto._inline_function_weights(model, [])
    infos = {"local:Dense/w": None, "local:Dense/bias": None}
    assert auto._shared_matmul_weights(probe, infos) == {"local:Dense/w"}
    both = auto._inline_function_weights(model_calling_twice(float_dense(seed=4)), [])
    assert auto._shared_matmul_weights(both, {"local:Dense/w": None}) == set()
    out, record = passes.compress(model, target="cosine>=0.999", feeds=feeds_of(model))
    assert "one-step" in {r["name"]: r["form"] for r in record["tensors"]}["local:Dense/w"]
    assert record["met_on_feeds"]
