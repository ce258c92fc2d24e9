"""passes.dedupe_initializers and quantize_weights / palettize(dedupe=...): byte-identical weights stored once."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import passes
from passes import dedupe as dd
from passes.errors import InvalidArgumentError, InvalidModelError

N = 64  # 64x64 float32: 16 kB, above dedupe's default min_bytes


def _w(seed=0, shape=(N, N)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _model(nodes, inits, inputs=None, outputs=None, opset=17, functions=()):
    inputs = inputs or [helper.make_tensor_value_info("x", TP.FLOAT, [1, N])]
    outputs = outputs or [helper.make_tensor_value_info("y", TP.FLOAT, [1, N])]
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("local", 1)] if functions else [])
    m = helper.make_model(g, opset_imports=opsets, functions=list(functions))
    onnx.checker.check_model(m, full_check=True)
    return m


def _dup_model(b_typed=False, op="MatMul"):
    """y = x @ A @ B with A and B the same values (B in float_data when b_typed); op="Gemm": two
    Gemm(transB=1) nodes instead of MatMul."""
    w = _w()
    b = helper.make_tensor("B", TP.FLOAT, [N, N], w.ravel().tolist()) if b_typed else numpy_helper.from_array(w, "B")
    attrs = {"transB": 1} if op == "Gemm" else {}
    return _model([helper.make_node(op, ["x", "A"], ["h"], **attrs), helper.make_node(op, ["h", "B"], ["y"], **attrs)],
                  [numpy_helper.from_array(w, "A"), b])


def _feed():
    return {"x": np.random.default_rng(7).standard_normal((1, N)).astype(np.float32)}


def _run(model, feed=None, optimize=False):
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feed or _feed())


def _same_outputs(a, b, feed=None):
    for x, y in zip(_run(a, feed), _run(b, feed), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def _names(model):
    return [t.name for t in model.graph.initializer]


@pytest.mark.parametrize("b_typed", [False, True])
def test_identical_initializers_are_stored_once(b_typed):
    m = _dup_model(b_typed)
    before = m.SerializeToString()
    rep = passes.Report()
    out = passes.dedupe_initializers(m, report=rep)
    assert m.SerializeToString() == before  # input untouched
    onnx.checker.check_model(out, full_check=True)
    assert _names(out) == ["A"]
    assert [list(n.input) for n in out.graph.node] == [["x", "A"], ["h", "A"]]
    _same_outputs(m, out)
    assert rep.notes == ["2 identical weights stored once: B -> A (16.4 kB less)"]
    (t,) = rep.tensors
    assert (t.name, t.bytes_before, t.bytes_after, t.scheme) == ("B", N * N * 4, 0, "stored once: same bytes as A")


def test_different_bits_type_or_shape_are_not_merged():
    w = _w()
    flipped = w.copy()
    flipped[3, 5] = -flipped[3, 5] if flipped[3, 5] != 0 else -0.0  # one sign bit
    zero, negzero = np.zeros((N, N), np.float32), np.zeros((N, N), np.float32)
    negzero[0, 0] = -0.0  # equal as numbers, not as bytes
    m = _model([helper.make_node("MatMul", ["x", n], [f"h{i}"]) for i, n in enumerate("ABCD")]
               + [helper.make_node("Sum", ["h0", "h1", "h2", "h3"], ["y"])],
               [numpy_helper.from_array(w, "A"), numpy_helper.from_array(flipped, "B"),
                numpy_helper.from_array(zero, "C"), numpy_helper.from_array(negzero, "D")])
    out = passes.dedupe_initializers(m)
    assert _names(out) == ["A", "B", "C", "D"]
    assert out.SerializeToString() == m.SerializeToString()


def test_small_tensors_are_left_unless_asked():
    w = _w(shape=(4, N))  # 1 kB... 1024 bytes: at the default bound
    small = _model([helper.make_node("Gather", ["A", "i"], ["a"]), helper.make_node("Gather", ["B", "i"], ["b"]),
                    helper.make_node("Add", ["a", "b"], ["y"])],
                   [numpy_helper.from_array(w[:, :8].copy(), "A"), numpy_helper.from_array(w[:, :8].copy(), "B")],
                   inputs=[helper.make_tensor_value_info("i", TP.INT64, [2])],
                   outputs=[helper.make_tensor_value_info("y", TP.FLOAT, [2, 8])])
    assert _names(passes.dedupe_initializers(small)) == ["A", "B"]
    assert _names(passes.dedupe_initializers(small, min_bytes=0)) == ["A"]
    with pytest.raises(InvalidArgumentError, match="min_bytes"):
        passes.dedupe_initializers(small, min_bytes=-1)


def test_constant_nodes_merge_into_an_initializer_and_each_other():
    w = _w()
    const = lambda name: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(w, name))  # noqa: E731
    m = _model([const("C1"), helper.make_node("MatMul", ["x", "C1"], ["h1"]),
                const("C2"), helper.make_node("MatMul", ["h1", "C2"], ["h2"]),
                helper.make_node("MatMul", ["h2", "A"], ["y"])],
               [numpy_helper.from_array(w, "A")])
    rep = passes.Report()
    out = passes.dedupe_initializers(m, report=rep)
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.graph.node] == ["MatMul"] * 3
    assert [n.input[1] for n in out.graph.node] == ["A", "A", "A"]
    assert {t.location for t in rep.tensors} == {"Constant node"}
    _same_outputs(m, out)


def test_only_constant_nodes_merge_first_kept():
    w = _w()
    const = lambda name: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(w, name))  # noqa: E731
    m = _model([const("C1"), helper.make_node("MatMul", ["x", "C1"], ["h1"]),
                const("C2"), helper.make_node("MatMul", ["h1", "C2"], ["y"])], [])
    out = passes.dedupe_initializers(m)
    assert [n.op_type for n in out.graph.node] == ["Constant", "MatMul", "MatMul"]
    assert out.graph.node[2].input[1] == "C1"
    _same_outputs(m, out)


def _branches(node):
    attrs = {a.name: a.g for a in node.attribute}
    return attrs["then_branch"], attrs["else_branch"]


def _if_model(shadow=False, op="MatMul"):
    """y = If(c, then: x @ T, else: x @ E) @ A, T and E identical to A (Constant / initializer of the branch).
    shadow: the else branch also defines its own 'A' (other values) and reads it. op="Gemm": every
    product a Gemm(transB=1)."""
    w = _w()
    attrs = {"transB": 1} if op == "Gemm" else {}

    def mm(a, b, y):
        return helper.make_node(op, [a, b], [y], **attrs)

    out_vi = [helper.make_tensor_value_info("r", TP.FLOAT, [1, N])]
    then_g = helper.make_graph([helper.make_node("Constant", [], ["T"], value=numpy_helper.from_array(w, "T")),
                                mm("x", "T", "r")], "then", [], out_vi)
    else_nodes = [mm("x", "E", "r0")]
    else_inits = [numpy_helper.from_array(w, "E")]
    if shadow:
        else_nodes.append(mm("r0", "A", "r"))
        else_inits.append(numpy_helper.from_array(_w(5), "A"))
    else:
        else_nodes.append(helper.make_node("Identity", ["r0"], ["r"]))
    else_g = helper.make_graph(else_nodes, "else", [], out_vi, else_inits)
    return _model([helper.make_node("If", ["c"], ["h"], then_branch=then_g, else_branch=else_g), mm("h", "A", "y")],
                  [numpy_helper.from_array(w, "A")],
                  inputs=[helper.make_tensor_value_info("x", TP.FLOAT, [1, N]),
                          helper.make_tensor_value_info("c", TP.BOOL, [])])


def test_subgraph_readers_are_repointed_to_the_outer_weight():
    m = _if_model()
    rep = passes.Report()
    out = passes.dedupe_initializers(m, report=rep)
    onnx.checker.check_model(out, full_check=True)
    then_g, else_g = _branches(out.graph.node[0])
    assert [n.op_type for n in then_g.node] == ["MatMul"] and then_g.node[0].input[1] == "A"
    assert not else_g.initializer and else_g.node[0].input[1] == "A"
    assert sorted(t.name for t in rep.tensors) == ["E", "T"]
    assert sorted(t.location for t in rep.tensors) == ["subgraph If/else_branch: initializer",
                                                       "subgraph If/then_branch: Constant node"]
    for c in (True, False):
        feed = {**_feed(), "c": np.array(c)}
        _same_outputs(m, out, feed)


def test_a_shadowed_name_is_never_merged_into():
    """The else branch's own 'A' shadows the outer one: nothing may be repointed to 'A' there."""
    m = _if_model(shadow=True)
    out = passes.dedupe_initializers(m)
    then_g, else_g = _branches(out.graph.node[0])
    assert [t.name for t in else_g.initializer] == ["E", "A"]
    assert then_g.node[0].op_type == "Constant"  # 'A' is defined twice: no merge into it at all
    for c in (True, False):
        _same_outputs(m, out, {**_feed(), "c": np.array(c)})


def test_graph_inputs_and_outputs_are_not_merged():
    w = _w()
    m = _model([helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"]),
                helper.make_node("Identity", ["C"], ["c_out"])],
               [numpy_helper.from_array(w, "A"), numpy_helper.from_array(w, "B"), numpy_helper.from_array(w, "C")],
               inputs=[helper.make_tensor_value_info("x", TP.FLOAT, [1, N]),
                       helper.make_tensor_value_info("B", TP.FLOAT, [N, N])],
               outputs=[helper.make_tensor_value_info("y", TP.FLOAT, [1, N]),
                        helper.make_tensor_value_info("A", TP.FLOAT, [N, N]),
                        helper.make_tensor_value_info("c_out", TP.FLOAT, [N, N])])
    out = passes.dedupe_initializers(m)
    # B is overridable (a graph input) and A an output: only C, merged into neither, stays too
    assert _names(out) == ["A", "B", "C"]
    other = _model([helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"])],
                   [numpy_helper.from_array(w, "A"), numpy_helper.from_array(w, "B")],
                   inputs=[helper.make_tensor_value_info("x", TP.FLOAT, [1, N]),
                           helper.make_tensor_value_info("A", TP.FLOAT, [N, N])])
    assert _names(passes.dedupe_initializers(other)) == ["A", "B"]  # the kept one may not be an input either


def test_function_body_constants_merge_among_themselves():
    w = _w()
    fn = helper.make_function("local", "Twice", ["x"], ["y"], [
        helper.make_node("Constant", [], ["K1"], value=numpy_helper.from_array(w, "K1")),
        helper.make_node("MatMul", ["x", "K1"], ["h"]),
        helper.make_node("Constant", [], ["K2"], value=numpy_helper.from_array(w, "K2")),
        helper.make_node("MatMul", ["h", "K2"], ["y"])], [helper.make_opsetid("", 17)])
    m = _model([helper.make_node("Twice", ["x"], ["y"], domain="local")], [], functions=[fn])
    rep = passes.Report()
    out = passes.dedupe_initializers(m, report=rep)
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.functions[0].node] == ["Constant", "MatMul", "MatMul"]
    assert out.functions[0].node[2].input[1] == "K1"
    assert rep.tensors[0].location == "function local.Twice: Constant node"
    _same_outputs(m, out)


def test_external_data(tmp_path):
    m = _dup_model()
    path = tmp_path / "m.onnx"
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    # from the path: data loaded once, merged
    assert _names(passes.dedupe_initializers(str(path))) == ["A"]
    # a model loaded without its data: compared from the files in pieces with base_dir, left alone without
    bare = onnx.load(path, load_external_data=False)
    assert _names(passes.dedupe_initializers(bare)) == ["A", "B"]
    out = passes.dedupe_initializers(bare, base_dir=tmp_path)
    assert _names(out) == ["A"] and out.graph.initializer[0].data_location == TP.EXTERNAL
    (tmp_path / "out.onnx").write_bytes(out.SerializeToString())  # beside m.data, which it still names
    _same_outputs(str(path), str(tmp_path / "out.onnx"))


def test_external_against_in_memory_in_small_pieces(tmp_path, monkeypatch):
    """One copy external, one inline; pieces smaller than the tensor and not aligned to it."""
    monkeypatch.setattr(dd, "_CHUNK", 1000)
    w = _w()
    (tmp_path / "b.data").write_bytes(b"\0" * 3 + w.tobytes())
    b = onnx.TensorProto(name="B", data_type=TP.FLOAT, dims=[N, N], data_location=TP.EXTERNAL)
    for k, v in (("location", "b.data"), ("offset", "3"), ("length", str(w.nbytes))):
        e = b.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TP.FLOAT, [1, N])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [1, N])], [numpy_helper.from_array(w, "A"), b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert _names(passes.dedupe_initializers(m, base_dir=tmp_path)) == ["A"]
    (tmp_path / "b.data").write_bytes(b"\0" * 3 + w.tobytes()[:-1] + b"\1")  # last byte differs
    assert _names(passes.dedupe_initializers(m, base_dir=tmp_path)) == ["A", "B"]


def test_invalid_model_is_refused():
    m = _dup_model()
    m.graph.node[1].input[1] = "missing"
    with pytest.raises(InvalidModelError):
        passes.dedupe_initializers(m)


# ---- compress paths


def test_quantize_stores_a_duplicated_weight_once_and_fold_still_works():
    m = _dup_model(op="Gemm")
    rep = passes.Report()
    q = passes.quantize_weights(m, dedupe=True, report=rep)
    onnx.checker.check_model(q, full_check=True)
    plain = passes.quantize_weights(m)
    assert _names(plain) == ["A_quantized", "A_scale", "B_quantized", "B_scale"]  # the default is unchanged
    assert _names(q) == ["A_quantized", "A_scale"]
    assert len(q.SerializeToString()) < 0.55 * len(plain.SerializeToString())
    assert [n.op_type for n in q.graph.node] == ["DequantizeLinear", "Gemm", "Gemm"]
    assert "2 identical weights stored once: B -> A (16.4 kB less)" in rep.notes
    assert [(t.name, t.bytes_after) for t in rep.tensors if t.name == "B"] == [("B", 0)]
    _same_outputs(q, plain)  # the same levels for both readers
    f = passes.fold_dequantize(q)
    onnx.checker.check_model(f, full_check=True)
    assert _names(f) == ["A"]
    _same_outputs(f, passes.fold_dequantize(plain))


@pytest.mark.parametrize("options", [dict(bits=4, granularity="block", block_size=32), dict(bits=4)])
def test_quantize_int4_and_blocked_store_once(options):
    m = _dup_model(op="Gemm")
    q = passes.quantize_weights(m, dedupe=True, **options)
    onnx.checker.check_model(q, full_check=True)
    assert {"A_quantized", "A_scale"} <= set(_names(q)) and not {"B", "B_quantized"} & set(_names(q))
    _same_outputs(q, passes.quantize_weights(m, **options))


@pytest.mark.parametrize("options", [dict(), dict(bits=4, granularity="block", block_size=32)])
def test_quantize_keeps_apart_matmul_weights_onnxruntime_fuses(options):
    """Each of two equal MatMul weights is read by its own DequantizeLinear + MatMul, which
    onnxruntime fuses into MatMulNBits only while the levels have one reader: merged, both would
    be dequantized at every run. They stay apart, with a note (a pack stores them once)."""
    m = _dup_model()
    rep = passes.Report()
    q = passes.quantize_weights(m, dedupe=True, report=rep, **options)
    assert q.SerializeToString() == passes.quantize_weights(m, **options).SerializeToString()
    assert any(n.startswith("1 weight(s) equal to another kept apart (B)") for n in rep.notes), rep.notes
    # merged into one DequantizeLinear, onnxruntime would run float MatMul nodes instead
    fused = [n.op_type for n in _optimized(q).graph.node]
    assert fused.count("MatMulNBits") == 2, fused


def _optimized(model):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = f"{tmp}/opt.onnx"
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(f"{tmp}/opt.onnx")


def test_quantize_keeps_apart_duplicates_that_would_get_different_forms():
    m = _dup_model(op="Gemm")
    assert _names(passes.quantize_weights(m, dedupe=True, exclude=["B"])) == ["B", "A_quantized", "A_scale"]
    # read along other axes: MatMul's B (channels on axis 1) and Gemm(transB=1) (channels on axis 0)
    w = _w()
    g = _model([helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("Gemm", ["h", "B"], ["y"], transB=1)],
               [numpy_helper.from_array(w, "A"), numpy_helper.from_array(w, "B")])
    assert len(_names(passes.quantize_weights(g, dedupe=True))) == 4


def test_quantize_without_duplicates_is_unchanged():
    w2 = _w(3)
    other = _model([helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"])],
                   [numpy_helper.from_array(_w(), "A"), numpy_helper.from_array(w2, "B")])
    assert (passes.quantize_weights(other, dedupe=True).SerializeToString()
            == passes.quantize_weights(other).SerializeToString())


def test_quantize_merges_subgraph_duplicates():
    m = _if_model(op="Gemm")
    q = passes.quantize_weights(m, dedupe=True)
    onnx.checker.check_model(q, full_check=True)
    then_g, else_g = _branches(next(n for n in q.graph.node if n.op_type == "If"))
    assert not else_g.initializer and all(n.op_type != "Constant" for n in then_g.node)
    plain = passes.quantize_weights(m)
    for c in (True, False):
        _same_outputs(q, plain, {**_feed(), "c": np.array(c)})


def test_palettize_stores_once():
    m = _dup_model()
    rep = passes.Report()
    p = passes.palettize(m, report=rep)
    onnx.checker.check_model(p, full_check=True)
    assert len([t for t in p.graph.initializer]) == 2  # one index tensor, one table
    assert "2 identical weights stored once: B -> A (16.4 kB less)" in rep.notes
    _same_outputs(p, passes.palettize(m, dedupe=False))



def test_quantize_tied_embedding_and_lm_head_store_once():
    """Gather(E, ids) and MatMul(h, Transpose(E2)), E2 == E: both want per-row steps, so they merge."""
    v, h = 256, N
    e = _w(shape=(v, h))
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Transpose", ["E2"], ["Et"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Et"], ["y"])]
    m = _model(nodes, [numpy_helper.from_array(e, "E"), numpy_helper.from_array(e, "E2")],
               inputs=[helper.make_tensor_value_info("ids", TP.INT64, [1, 8])],
               outputs=[helper.make_tensor_value_info("y", TP.FLOAT, [1, 8, v])])
    rep = passes.Report()
    q = passes.quantize_weights(m, dedupe=True, report=rep)
    onnx.checker.check_model(q, full_check=True)
    assert _names(q) == ["E_quantized", "E_scale"]
    assert [t.scheme for t in rep.tensors] == ["stored once: same bytes as E", "int8/channel(axis=0)/sym"]
    feed = {"ids": np.array([[0, 5, 9, 255, 17, 3, 3, 100]], np.int64)}
    _same_outputs(q, passes.quantize_weights(m), feed)


@pytest.mark.parametrize("options", [dict(), dict(bits=4)])
def test_ir3_listed_weights_and_opset_raise(options):
    """IR 3 lists every initializer as an input (because it must, not to make it overridable): the
    passes unlist them first, so they merge; an opset-9 model raised for DequantizeLinear still merges."""
    w = _w()
    g = helper.make_graph([helper.make_node("Gemm", ["x", "A", "C"], ["h"], transB=1),
                           helper.make_node("Gemm", ["h", "B", "C"], ["y"], transB=1)],
                          "g", [helper.make_tensor_value_info(n, TP.FLOAT, {"x": [1, N], "C": [N]}.get(n, [N, N])) for n in "xABC"],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [1, N])],
                          [numpy_helper.from_array(w, "A"), numpy_helper.from_array(w, "B"),
                           numpy_helper.from_array(np.zeros(N, np.float32), "C")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 3
    onnx.checker.check_model(m, full_check=True)
    d = passes.dedupe_initializers(m)
    assert _names(d) == ["A", "C"] and d.ir_version == 4
    _same_outputs(m, d)
    q = passes.quantize_weights(m, dedupe=True, **options)
    onnx.checker.check_model(q, full_check=True)
    assert {"A_quantized", "A_scale"} <= set(_names(q)) and not {"B", "B_quantized"} & set(_names(q))
    _same_outputs(q, passes.quantize_weights(m, **options))


def _function_model(op="Gemm"):
    """y = Twice(x): a model-local function whose body holds two Constants of the same values,
    K1 and K2, each read by its own `op` (Gemm: transB=1, both per-row steps)."""
    w = _w()
    attrs = {"transB": 1} if op == "Gemm" else {}
    fn = helper.make_function("local", "Twice", ["x"], ["y"], [
        helper.make_node("Constant", [], ["K1"], value=numpy_helper.from_array(w, "K1")),
        helper.make_node(op, ["x", "K1"], ["h"], **attrs),
        helper.make_node("Constant", [], ["K2"], value=numpy_helper.from_array(w, "K2")),
        helper.make_node(op, ["h", "K2"], ["y"], **attrs)], [helper.make_opsetid("", 17)])
    return _model([helper.make_node("Twice", ["x"], ["y"], domain="local")], [], functions=[fn])


def _body_constants(model):
    return [n.output[0] for n in model.functions[0].node if n.op_type == "Constant"]


def test_quantize_stores_equal_function_body_constants_once():
    m = _function_model()
    rep = passes.Report()
    q = passes.quantize_weights(m, dedupe=True, report=rep)
    onnx.checker.check_model(q, full_check=True)
    plain = passes.quantize_weights(m)
    assert _body_constants(plain) == ["K1_quantized", "K1_scale", "K2_quantized", "K2_scale"]
    assert _body_constants(q) == ["K1_quantized", "K1_scale"]
    assert [n.op_type for n in q.functions[0].node] == ["Constant", "Constant", "DequantizeLinear", "Gemm", "Gemm"]
    assert [n.input[1] for n in q.functions[0].node if n.op_type == "Gemm"] == ["K1", "K1"]
    assert "2 identical weights stored once: K2 -> K1 (16.4 kB less)" in rep.notes
    assert [(t.name, t.bytes_after, t.location) for t in rep.tensors if t.name == "K2"] == [
        ("K2", 0, "function local.Twice: Constant node")]
    assert len(q.SerializeToString()) < 0.55 * len(plain.SerializeToString())
    _same_outputs(q, plain)  # the same levels for both readers
    f = passes.fold_dequantize(q)
    onnx.checker.check_model(f, full_check=True)
    _same_outputs(f, passes.fold_dequantize(plain))


def test_quantize_keeps_equal_function_body_constants_apart_where_forms_differ():
    """One of them excluded by name: it stays float, the other is quantized; they are not merged."""
    m = _function_model()
    q = passes.quantize_weights(m, dedupe=True, exclude=["K2"])
    onnx.checker.check_model(q, full_check=True)
    assert _body_constants(q) == ["K1_quantized", "K1_scale", "K2"]
    assert q.SerializeToString() == passes.quantize_weights(m, exclude=["K2"]).SerializeToString()


def test_quantize_keeps_apart_function_body_matmul_weights_onnxruntime_fuses():
    """As in a graph: two equal Constants each a MatMul's only weight input stay apart, with the note."""
    m = _function_model(op="MatMul")
    rep = passes.Report()
    q = passes.quantize_weights(m, dedupe=True, report=rep)
    onnx.checker.check_model(q, full_check=True)
    assert q.SerializeToString() == passes.quantize_weights(m).SerializeToString()
    assert _body_constants(q) == ["K1_quantized", "K1_scale", "K2_quantized", "K2_scale"]
    assert any(n.startswith("1 weight(s) equal to another kept apart (K2 in function local:Twice)")
               for n in rep.notes), rep.notes
    fused = [n.op_type for n in _optimized(q).graph.node]
    assert fused.count("MatMulNBits") == 2, fused


def test_quantize_merges_function_body_constants_named_like_graph_weights():
    """The body's names are its own: a main-graph weight also named K2 (read by a MatMul alone,
    so kept apart were its name looked up there) does not decide the body's merge."""
    fn = _function_model().functions[0]
    m = _model([helper.make_node("Twice", ["x"], ["h"], domain="local"), helper.make_node("MatMul", ["h", "K2"], ["y"])],
               [numpy_helper.from_array(_w(5), "K2")], functions=[fn])
    q = passes.quantize_weights(m, dedupe=True)
    onnx.checker.check_model(q, full_check=True)
    assert _body_constants(q) == ["K1_quantized", "K1_scale"]
    assert _names(q) == ["K2_quantized", "K2_scale"]
    _same_outputs(q, passes.quantize_weights(m))
