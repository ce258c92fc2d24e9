"""Error feedback (GPTQ) for weights read inside If branches: the branch's activations are brought
out of the If node (gptq.with_branch_outputs) so that the Hessian is collected as for a main-graph
weight; the model's own outputs are unchanged by that; untaken branches and Loop bodies give none."""
import numpy as np
import onnx
from onnx import TensorProto, helper

import modelgen as mg
import passes
from passes import gptq

K, N = 64, 24


def _branch_model():
    """x (B, K) -> If(c): then: If(c2): then Relu(x @ A) @ W_then / else x @ W_else2; else x @ W_else.
    W_then's activation (Relu output) is defined two If levels down; the weights are main-graph
    initializers (as the auto mode lifts them)."""
    rng = np.random.default_rng(3)
    w = {n: (rng.standard_normal((K, N)) * 0.1).astype(np.float32) for n in ("W_then", "W_else", "W_else2")}
    a = (np.eye(K) + rng.standard_normal((K, K)) * 0.3 / np.sqrt(K)).astype(np.float32)
    out_vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, N])  # noqa: E731
    inner_then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "A"], ["xa"]), helper.make_node("Relu", ["xa"], ["act"]),
         helper.make_node("MatMul", ["act", "W_then"], ["y_then"])], "inner_then", [], [out_vi("y_then")])
    inner_else = helper.make_graph([helper.make_node("MatMul", ["x", "W_else2"], ["y_else2"])], "inner_else", [],
                                   [out_vi("y_else2")])
    outer_then = helper.make_graph(
        [helper.make_node("If", ["c2"], ["y_inner"], then_branch=inner_then, else_branch=inner_else)],
        "outer_then", [], [out_vi("y_inner")])
    outer_else = helper.make_graph([helper.make_node("MatMul", ["x", "W_else"], ["y_outer_else"])], "outer_else", [],
                                   [out_vi("y_outer_else")])
    g = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=outer_then, else_branch=outer_else)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("c2", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [mg.tensor("A", a)] + [mg.tensor(n, v) for n, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _feeds(n, seed, c=True, c2=True):
    return [{"x": mg.correlated_inputs(32, K, seed=seed + i).astype(np.float32),
             "c": np.array(c), "c2": np.array(c2)} for i in range(n)]


def test_consumers_inside_if_branches():
    m = _branch_model()
    cons = gptq.consumers(m, ["W_then", "W_else", "W_else2", "A"])
    assert {n: (node.op_type, act) for n, (node, act) in cons.items()} == {
        "W_then": ("MatMul", "act"), "W_else": ("MatMul", "x"), "W_else2": ("MatMul", "x"), "A": ("MatMul", "x")}


def test_branch_outputs_leave_the_model_outputs_unchanged():
    m = _branch_model()
    copy = onnx.ModelProto()
    copy.CopyFrom(m)
    done = gptq.with_branch_outputs(copy, ["act", "x", "nowhere"])
    assert done == ["act"]  # x is a main-graph value, "nowhere" does not exist
    assert "act" in [o for n in copy.graph.node for o in n.output]
    copy.graph.output.append(onnx.ValueInfoProto(name="act"))
    for c, c2 in ((True, True), (True, False), (False, True)):
        f = _feeds(1, 0, c, c2)
        ref = mg.run(m, f)[0]
        import onnxruntime as ort
        sess = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
        y, act = sess.run(["y", "act"], f[0])
        np.testing.assert_array_equal(y, ref)
        if c and c2:  # the branch that computes it ran
            # onnxruntime's MatMul sums in another order than numpy's (on this session's host ~13% of the
            # values differ in the last bit or two, up to 1e-6): the branch's value, not a bit-exact product
            np.testing.assert_allclose(act, np.maximum(f[0]["x"] @ mg.initializer_array(m, "A"), 0),
                                       rtol=1e-5, atol=1e-6)
        else:
            assert act.size == 0
    assert m.graph.node[0].output == ["y"]  # the input model is not modified


def test_hessians_of_branch_weights_and_untaken_branches():
    m = _branch_model()
    rows = {}
    hess = gptq.collect_hessians(m, _feeds(3, 0), ["W_then", "W_else", "W_else2", "A"], rows=rows)
    # W_else / W_else2 sit in branches no feed takes: no Hessian, though W_else's activation is the
    # main graph's input x
    assert set(hess) == {"W_then", "A"}
    assert rows["W_then"] == 96 and hess["W_then"].shape == (K, K)
    f = _feeds(3, 0)[0]
    act = np.maximum(f["x"].astype(np.float64) @ mg.initializer_array(m, "A"), 0)
    h0 = gptq.collect_hessians(m, [f], ["W_then"])["W_then"]
    np.testing.assert_allclose(h0, act.T @ act / len(act), rtol=1e-4, atol=1e-6)


def test_error_feedback_inside_an_if_branch_beats_nearest_rounding():
    m = _branch_model()
    calib, held = _feeds(8, 0), _feeds(8, 100)
    hess = gptq.collect_hessians(m, calib, ["W_then"])
    q = passes.quantize_weights(m, bits=4, include=["W_then"])
    refined = gptq.refine(q, m, hess, 4, damp=0.1)
    assert set(refined) == {"W_then"}
    out = gptq.write_levels(q, {n: lv for n, (lv, _) in refined.items()})
    onnx.checker.check_model(out, full_check=True)
    for fs in (calib, held):
        ref = mg.run(m, fs)
        err_plain = sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(q, fs)))
        err_gptq = sum(np.sum((a - b) ** 2) for a, b in zip(ref, mg.run(out, fs)))
        assert err_gptq < 0.8 * err_plain, (err_gptq, err_plain)
    # the written model folds bit-exactly to the dequantized weight refine() reports
    folded = passes.fold_dequantize(out)
    np.testing.assert_array_equal(mg.initializer_array(folded, "W_then"), refined["W_then"][1])


def test_a_weight_read_in_a_loop_body_is_left_to_plain_rounding():
    w = mg.weight((K, N), seed=1)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y_it"]), helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y_it", TensorProto.FLOAT, None)])
    g = helper.make_graph(
        [helper.make_node("Loop", ["n", "c"], ["ys"], body=body)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K]),
         helper.make_tensor_value_info("n", TensorProto.INT64, []),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("ys", TensorProto.FLOAT, None)], [mg.tensor("W", w)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    assert gptq.consumers(m, ["W"]) == {}


def test_a_branch_taken_on_some_feeds_counts_those_feeds_only():
    m = _branch_model()
    feeds = _feeds(2, 0) + _feeds(3, 10, c=False)  # 2 feeds take the then branch, 3 the else branch
    rows = {}
    hess = gptq.collect_hessians(m, feeds, ["W_then", "W_else", "W_else2"], rows=rows)
    assert set(hess) == {"W_then", "W_else"} and rows == {"W_then": 64, "W_else": 96}
    x = np.concatenate([f["x"] for f in feeds[2:]]).astype(np.float64)
    np.testing.assert_allclose(hess["W_else"], x.T @ x / len(x), rtol=1e-4, atol=1e-6)
