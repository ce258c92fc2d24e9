"""Small models of one edge each, which neither the wheels of bench/unseen.py nor the decoders of
bench/unseen_shapes.py are: the corners of the format and of the operator set that a model
nobody has shown us may sit in. Random weights (seeded), a few kB to a few hundred kB each, so
that tests/unit/test_unseen_edges.py runs every path on the same builders.

- fn_nested: model-local functions whose bodies hold Constant weights: Block(x) calls Dense twice
  (a function calling a function), Block is called twice from the main graph, a third function
  takes its scale as an attribute (Constant value_float by ref_attr_name) and two overloads of
  one function name (IR 10) hold different weights.
- fn_in_subgraphs: a function with a Constant weight, importing opset 13 below the model's 17,
  called from a Loop body and from an If branch.
- recurrent_full: LSTM with every optional input (B, sequence_lens, initial_h / initial_c and
  peepholes P), bidirectional; GRU without bias and linear_before_reset; RNN bidirectional with
  Relu activations; sequences of different lengths.
- convs: a 3-D Conv, a grouped Conv with a channel multiplier (group=4), a depthwise Conv with
  multiplier 2, a 1x1 Conv from one input channel, ConvTranspose with output_padding and
  dilations, Einsum with the weight as first operand and an ellipsis equation.
- degenerate: dims of 0 and 1 everywhere: an empty weight [0, 64] concatenated, an input with
  a 0-long axis, MatMul weights [1, N] and [N, 1], a [1, 1, K, N] weight, a scalar weight, Resize
  with an empty roi initializer, a bool mask and a string initializer returned as outputs, and
  an initializer that is also a graph input (overridable: it must stay float).
- ext_spread / ext_handmade / ext_attribute: external data over several files: onnx's own
  one-file-per-tensor layout (all_tensors_to_one_file=False); a hand-made one with two data files
  (one in a subfolder with a space in its name), 4096-aligned offsets, a tensor without `length`
  and gaps of garbage between tensors; and onnx's convert_attribute layout where Constant nodes
  and an If branch's initializer live in external files too.
- metadata: metadata_props on the model, the graph, nodes and initializers (IR 10), doc strings on
  everything that has one, training_info (an initialization graph and an algorithm binding
  updates to the weights), graph.quantization_annotation and value_info.
- values: weights of all zeros, of one value, with one huge outlier, of denormals only, of signed
  zeros, in float16, and one stored in float_data rather than raw_data.
- names: weights already named W_quantized / W_scale beside W (what the writers name their
  parts), a Chinese name with '/', '.' and ':', a 300-character name, unnamed nodes, a 1-D
  convolution kernel [32, 64, 1], opset imports of domains no node uses.

    python bench/unseen_edges.py OUT_FOLDER   # writes OUT_FOLDER/NAME/NAME.onnx (+ data files)
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

F = TensorProto.FLOAT


def _w(rng, *shape, scale=None):
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return (rng.standard_normal(shape) * (scale if scale is not None else 1 / np.sqrt(fan_in))).astype(np.float32)


def _vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _t(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _model(nodes, inputs, outputs, inits, opset=17, ir=None, functions=(), extra_opsets=(), **graph):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits, **graph)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets], functions=list(functions))
    m.ir_version = ir or max(8, helper.find_min_ir_version_for(list(m.opset_import), True))
    return m


# ---------------------------------------------------------------------------------------------- builders


def fn_nested(d=64, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    ops17 = [helper.make_opsetid("", 17)]
    ops_local = ops17 + [helper.make_opsetid("local", 1)]
    dense = helper.make_function("local", "Dense", ["a"], ["b"], [
        helper.make_node("Constant", [], ["W"], value=_t("Wd", _w(rng, d, d))),
        helper.make_node("Constant", [], ["B"], value=_t("Bd", _w(rng, d, scale=0.1))),
        helper.make_node("MatMul", ["a", "W"], ["mm"]), helper.make_node("Add", ["mm", "B"], ["b"])], ops17)
    block = helper.make_function("local", "Block", ["x"], ["y"], [
        helper.make_node("Dense", ["x"], ["h"], domain="local"), helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Dense", ["t"], ["h2"], domain="local"), helper.make_node("Add", ["x", "h2"], ["y"])],
        ops_local)
    # Scale(x; alpha) = x * alpha * Constant s: the scale arrives as an attribute of the call
    alpha = helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT)
    alpha.ref_attr_name = "alpha"
    scale_const = helper.make_node("Constant", [], ["alpha_t"])
    scale_const.attribute.append(alpha)
    scale = helper.make_function("local", "Scale", ["x"], ["y"], [
        scale_const, helper.make_node("Constant", [], ["s"], value=_t("s", 1 + 0.1 * _w(rng, d, scale=1.0))),
        helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Mul", ["xs", "alpha_t"], ["y"])],
        ops17, attributes=["alpha"])
    # two overloads of Proj (IR 10): the same name, different weights
    projs = [helper.make_function("local", "Proj", ["x"], ["y"], [
        helper.make_node("Constant", [], ["P"], value=_t(f"P{k}", _w(rng, d, d))),
        helper.make_node("MatMul", ["x", "P"], ["y"])], ops17, overload=f"v{k}") for k in (1, 2)]
    nodes = [helper.make_node("Block", ["x"], ["b1"], domain="local"),
             helper.make_node("Block", ["b1"], ["b2"], domain="local"),
             helper.make_node("Scale", ["b2"], ["s1"], domain="local", alpha=0.5),
             helper.make_node("Proj", ["s1"], ["p1"], domain="local", overload="v1"),
             helper.make_node("Proj", ["p1"], ["p2"], domain="local", overload="v2"),
             helper.make_node("MatMul", ["p2", "Wout"], ["y"])]
    m = _model(nodes, [_vi("x", ["n", d])], [_vi("y", ["n", 16])], [_t("Wout", _w(rng, d, 16))],
               ir=10, functions=[dense, block, scale, *projs], extra_opsets=[helper.make_opsetid("local", 1)])
    return m


def fn_nested_feeds(rng, n=4, d=64):
    return [{"x": rng.standard_normal((3, d)).astype(np.float32)} for _ in range(n)]


def fn_in_subgraphs(seed=0) -> onnx.ModelProto:
    """A function (Constant weight in its body, importing opset 13 below the model's 17) called from
    a Loop body three times and from an If branch."""
    rng = np.random.default_rng(seed)
    dense = helper.make_function("local", "Dense", ["a"], ["b"], [
        helper.make_node("Constant", [], ["W"], value=_t("W", _w(rng, 64, 64))),
        helper.make_node("MatMul", ["a", "W"], ["mm"]), helper.make_node("Tanh", ["mm"], ["b"])],
        [helper.make_opsetid("", 13)])
    body = helper.make_graph([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("Dense", ["h_in"], ["h_out"], domain="local")], "body",
                             [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("h_in", [4, 64])],
                             [_vi("cond_out", [], TensorProto.BOOL), _vi("h_out", [4, 64])])
    then = helper.make_graph([helper.make_node("Dense", ["x"], ["t"], domain="local")], "then", [], [_vi("t", [4, 64])])
    other = helper.make_graph([helper.make_node("MatMul", ["x", "W2"], ["e"])], "else", [], [_vi("e", [4, 64])])
    nodes = [helper.make_node("Loop", ["n", "keep_going", "x"], ["h"], body=body),
             helper.make_node("If", ["flag"], ["y2"], then_branch=then, else_branch=other),
             helper.make_node("Add", ["h", "y2"], ["y"])]
    inits = [_t("n", np.array(3, np.int64)), _t("keep_going", np.array(True)), _t("W2", _w(rng, 64, 64))]
    return _model(nodes, [_vi("x", [4, 64]), _vi("flag", [], TensorProto.BOOL)], [_vi("y", [4, 64])], inits,
                  functions=[dense], extra_opsets=[helper.make_opsetid("local", 1)])


def flag_feeds(rng, n=4):
    return [{"x": rng.standard_normal((4, 64)).astype(np.float32), "flag": np.array(k % 2 == 0)} for k in range(n)]


def recurrent_full(h=32, i=24, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [
        _t("lstm_W", _w(rng, 2, 4 * h, i)), _t("lstm_R", _w(rng, 2, 4 * h, h)),
        _t("lstm_B", _w(rng, 2, 8 * h, scale=0.1)), _t("lstm_P", _w(rng, 2, 3 * h, scale=0.1)),
        _t("lstm_h0", _w(rng, 2, 2, h, scale=0.1)), _t("lstm_c0", _w(rng, 2, 2, h, scale=0.1)),
        _t("gru_W", _w(rng, 1, 3 * h, 2 * h)), _t("gru_R", _w(rng, 1, 3 * h, h)),
        _t("rnn_W", _w(rng, 2, h, h, scale=0.5 / np.sqrt(h))), _t("rnn_R", _w(rng, 2, h, h, scale=0.5 / np.sqrt(h))),
        _t("rnn_B", _w(rng, 2, 2 * h, scale=0.1)), _t("shape_2h", np.array([0, 0, -1], np.int64)),
        _t("axis1", np.array([1], np.int64)),
    ]
    nodes = [
        helper.make_node("LSTM", ["x", "lstm_W", "lstm_R", "lstm_B", "lens", "lstm_h0", "lstm_c0", "lstm_P"],
                         ["ly", "lh", "lc"], hidden_size=h, direction="bidirectional"),
        # Y [T, 2, B, h] -> [T, B, 2h]
        helper.make_node("Transpose", ["ly"], ["lyt"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["lyt", "shape_2h"], ["lyr"]),
        helper.make_node("GRU", ["lyr", "gru_W", "gru_R", "", "lens"], ["gy", "gh"], hidden_size=h,
                         linear_before_reset=1),
        helper.make_node("Squeeze", ["gy", "axis1"], ["gys"]),  # [T, 1, B, h] -> [T, B, h]
        helper.make_node("RNN", ["gys", "rnn_W", "rnn_R", "rnn_B"], ["ry", "rh"], hidden_size=h,
                         direction="bidirectional", activations=["Relu", "Relu"]),
    ]
    m = _model(nodes, [_vi("x", [6, 2, i]), _vi("lens", [2], TensorProto.INT32)],
               [_vi("ry", [6, 2, 2, h]), _vi("lh", [2, 2, h]), _vi("lc", [2, 2, h]), _vi("gh", [1, 2, h])],
               inits)
    return m


def recurrent_feeds(rng, n=4, i=24):
    return [{"x": rng.standard_normal((6, 2, i)).astype(np.float32), "lens": np.array([6, 4], np.int32)}
            for _ in range(n)]


def convs(seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [
        _t("c3d", _w(rng, 8, 4, 3, 3, 3)), _t("c3d_b", _w(rng, 8, scale=0.1)),
        _t("grouped", _w(rng, 32, 4, 3, 3)),  # 16 in, group 4, 32 out: 4 in / 8 out per group
        _t("depthwise", _w(rng, 64, 1, 3, 3)),  # group 32, multiplier 2
        _t("point1", _w(rng, 16, 1, 1, 1)),
        _t("deconv", _w(rng, 64, 8, 3, 3)), _t("deconv_b", _w(rng, 8, scale=0.1)),
        _t("E1", _w(rng, 24, 8)), _t("E2", _w(rng, 24, 40)),
        _t("shape_3d", np.array([1, 16, 4, 6, 6], np.int64)), _t("shape_2d", np.array([1, 16, 24, 6], np.int64)),
        _t("shape_seq", np.array([1, 8, -1], np.int64)),
    ]
    nodes = [
        helper.make_node("Conv", ["vol", "c3d", "c3d_b"], ["v1"], pads=[1] * 6),  # [1, 8, 4, 6, 6]
        helper.make_node("Relu", ["v1"], ["v1r"]),
        helper.make_node("Concat", ["v1r", "v1r"], ["v2"], axis=1),  # [1, 16, 4, 6, 6]
        helper.make_node("Reshape", ["v2", "shape_2d"], ["img"]),  # [1, 16, 24, 6]
        helper.make_node("Conv", ["img", "grouped"], ["g1"], group=4, pads=[1, 1, 1, 1]),  # [1, 32, 24, 6]
        helper.make_node("Conv", ["g1", "depthwise"], ["d1"], group=32, pads=[1, 1, 1, 1], dilations=[1, 1]),
        helper.make_node("ConvTranspose", ["d1", "deconv", "deconv_b"], ["u1"], strides=[2, 2], pads=[1, 1, 1, 1],
                         output_padding=[1, 0], dilations=[1, 1]),  # [1, 8, 48, 11]
        helper.make_node("Conv", ["mono", "point1"], ["p1"]),  # [1, 16, 5, 5]
        helper.make_node("Reshape", ["u1", "shape_seq"], ["seq"]),  # [1, 8, 528]
        helper.make_node("Transpose", ["seq"], ["seqt"], perm=[0, 2, 1]),  # [1, 528, 8]
        # weight first: E1[24, 8] . seqt[b, s, 8] -> [b, s, 24]; then an ellipsis over E2[24, 40]
        helper.make_node("Einsum", ["E1", "seqt"], ["e1"], equation="oi,bsi->bso"),
        helper.make_node("Einsum", ["e1", "E2"], ["y"], equation="...i,io->...o"),
    ]
    return _model(nodes, [_vi("vol", [1, 4, 4, 6, 6]), _vi("mono", [1, 1, 5, 5])],
                  [_vi("y", [1, 528, 40]), _vi("p1", [1, 16, 5, 5])], inits)


def convs_feeds(rng, n=4):
    return [{"vol": rng.standard_normal((1, 4, 4, 6, 6)).astype(np.float32),
             "mono": rng.standard_normal((1, 1, 5, 5)).astype(np.float32)} for _ in range(n)]


def degenerate(seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [
        _t("empty_w", np.zeros((0, 64), np.float32)),
        _t("row_w", _w(rng, 1, 2048, scale=1.0)),  # x[n, 1] @ [1, 2048]: a dot product of length 1
        _t("col_w", _w(rng, 2048, 1)),  # one output channel
        _t("w4d", _w(rng, 1, 1, 64, 64)),
        _t("scalar_w", np.array(0.75, np.float32)),
        _t("one_w", np.array([[1.5]], np.float32)),
        _t("roi", np.zeros((0,), np.float32)), _t("scales", np.array([1, 1, 2, 2], np.float32)),
        _t("mask", rng.random((1, 1, 4, 4)) > 0.5),
        _t("labels", np.array(["a", "bb", ""], dtype=object)),
        _t("over_w", _w(rng, 64, 64)),  # listed as a graph input too: the caller may replace it
        _t("shape4", np.array([1, 1, 16, 16], np.int64)),
    ]
    nodes = [
        helper.make_node("Concat", ["empty_w", "x"], ["xc"], axis=0),  # [n, 64]
        helper.make_node("Concat", ["xc", "zero_rows"], ["xz"], axis=0),  # zero_rows: [0, 64] input
        helper.make_node("MatMul", ["xz", "w4d"], ["h4"]),  # [1, 1, n, 64]
        helper.make_node("MatMul", ["h4", "over_w"], ["h5"]),
        helper.make_node("Mul", ["h5", "scalar_w"], ["h6"]),
        helper.make_node("Identity", ["h6"], ["h6i"]),
        helper.make_node("MatMul", ["one_col", "row_w"], ["r1"]),  # [n, 2048]
        helper.make_node("MatMul", ["r1", "col_w"], ["r2"]),  # [n, 1]
        helper.make_node("MatMul", ["r2", "one_w"], ["r3"]),  # [n, 1] @ [1, 1]
        helper.make_node("Reshape", ["h6i", "shape4"], ["img"]),  # [1, 1, 4, 64] -> [1, 1, 16, 16]
        helper.make_node("Resize", ["img", "roi", "scales"], ["big"], mode="nearest"),
        helper.make_node("Slice", ["big", "s0", "s1", "s2"], ["big4"]),  # [1, 1, 4, 4]... see below
        helper.make_node("Where", ["mask", "big4", "big4n"], ["wh"]),
        helper.make_node("Neg", ["big4"], ["big4n"]),
        helper.make_node("Identity", ["labels"], ["labels_out"]),
    ]
    # Slice big[1, 1, 32, 32] to its top-left 4 x 4
    inits += [_t("s0", np.array([0, 0], np.int64)), _t("s1", np.array([4, 4], np.int64)),
              _t("s2", np.array([2, 3], np.int64))]
    nodes = [n for n in nodes]
    # Where reads big4n before the Neg: put Neg first
    where = [n for n in nodes if n.op_type == "Where"][0]
    neg = [n for n in nodes if n.op_type == "Neg"][0]
    nodes.remove(neg)
    nodes.insert(nodes.index(where), neg)
    inputs = [_vi("x", [4, 64]), _vi("zero_rows", [0, 64]), _vi("one_col", ["n", 1]), _vi("over_w", [64, 64])]
    outputs = [_vi("wh", [1, 1, 4, 4]), _vi("r3", ["n", 1]), _vi("labels_out", [3], TensorProto.STRING)]
    return _model(nodes, inputs, outputs, inits)


def degenerate_feeds(rng, n=4):
    return [{"x": rng.standard_normal((4, 64)).astype(np.float32), "zero_rows": np.zeros((0, 64), np.float32),
             "one_col": rng.standard_normal((3, 1)).astype(np.float32)} for _ in range(n)]


def mlp(seed=0, d=64, layers=4) -> onnx.ModelProto:
    """A plain MLP (the body of the layout and metadata models)."""
    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "x"
    for k in range(layers):
        inits += [_t(f"fc{k}.weight", _w(rng, d, d)), _t(f"fc{k}.bias", _w(rng, d, scale=0.1))]
        nodes += [helper.make_node("MatMul", [x, f"fc{k}.weight"], [f"mm{k}"]),
                  helper.make_node("Add", [f"mm{k}", f"fc{k}.bias"], [f"a{k}"]),
                  helper.make_node("Tanh", [f"a{k}"], [f"h{k}"] if k < layers - 1 else ["y"])]
        x = f"h{k}"
    return _model(nodes, [_vi("x", ["n", d])], [_vi("y", ["n", d])], inits)


def mlp_feeds(rng, n=4, d=64):
    return [{"x": rng.standard_normal((3, d)).astype(np.float32)} for _ in range(n)]


def save_spread(m: onnx.ModelProto, dst: Path) -> None:
    """onnx's one-file-per-tensor layout (every tensor of 64 bytes or more)."""
    onnx.save_model(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=64)


def save_handmade(m: onnx.ModelProto, dst: Path, align=4096) -> None:
    """Even tensors in 'weights a.bin' (a space in the name), odd ones in sub/b.bin, each at an
    offset aligned to `align` with garbage bytes in the gaps; the last tensor of each file has no
    `length` (it runs to the end of the file)."""
    m = onnx.ModelProto.FromString(m.SerializeToString())
    files = {"weights a.bin": bytearray(), "sub/b.bin": bytearray()}
    big = [t for t in m.graph.initializer if t.data_type == F and len(t.float_data) + len(t.raw_data) >= 64]
    last = {}
    for k, t in enumerate(big):
        raw = numpy_helper.to_array(t).tobytes()
        where = "weights a.bin" if k % 2 == 0 else "sub/b.bin"
        buf = files[where]
        pad = (-len(buf)) % align
        buf += bytes((j * 37 + 11) % 251 for j in range(pad))  # not zeros: a reader must honour offsets
        t.ClearField("float_data")
        t.raw_data = raw
        set_external_data(t, where, offset=len(buf), length=len(raw))
        t.ClearField("raw_data")
        buf += raw
        last[where] = t
    for t in last.values():  # the file's last tensor: no length, it runs to the end
        keep = [(e.key, e.value) for e in t.external_data if e.key != "length"]
        del t.external_data[:]
        for k, v in keep:
            t.external_data.add(key=k, value=v)
    for where, buf in files.items():
        (dst.parent / where).parent.mkdir(parents=True, exist_ok=True)
        (dst.parent / where).write_bytes(bytes(buf))
    onnx.save(m, str(dst))


def with_branches(seed=0, d=64) -> onnx.ModelProto:
    """An MLP whose middle layer's weight is a Constant node and whose last layer is an If whose
    branches hold their own initializers (for ext_attribute)."""
    rng = np.random.default_rng(seed)
    m = mlp(seed, d, layers=2)
    g = m.graph
    then_b = helper.make_graph([helper.make_node("MatMul", ["y0", "then_w"], ["yo"])], "then", [],
                               [_vi("yo", ["n", d])], [_t("then_w", _w(rng, d, d))])
    else_b = helper.make_graph([helper.make_node("MatMul", ["y0", "else_w"], ["yo2"])], "else", [],
                               [_vi("yo2", ["n", d])], [_t("else_w", _w(rng, d, d))])
    for node in g.node:
        if node.output[0] == "y":
            node.output[0] = "y0"
    const = helper.make_node("Constant", [], ["cw"], value=_t("cw", _w(rng, d, d)))
    g.node.extend([const, helper.make_node("MatMul", ["y0", "cw"], ["yc"]),
                   helper.make_node("If", ["flag"], ["yi"], then_branch=then_b, else_branch=else_b),
                   helper.make_node("Add", ["yc", "yi"], ["y"])])
    g.input.append(_vi("flag", [], TensorProto.BOOL))
    return m


def branches_feeds(rng, n=4, d=64):
    return [{"x": rng.standard_normal((3, d)).astype(np.float32), "flag": np.array(k % 2 == 0)} for k in range(n)]


def save_attribute(m: onnx.ModelProto, dst: Path) -> None:
    onnx.save_model(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=True, location="data.bin",
                    size_threshold=64, convert_attribute=True)


def metadata(seed=0) -> onnx.ModelProto:
    m = mlp(seed, layers=3)
    m.ir_version = 10
    m.producer_name, m.producer_version, m.domain, m.model_version = "edge-exporter", "9.9", "org.example", 7
    m.doc_string = "a model with every kind of annotation"
    helper.set_model_props(m, {"license": "MIT", "author": "nobody", "onnx.infer": "onnxruntime.CPU",
                               "labels": "cat,dog"})
    g = m.graph
    g.doc_string = "the graph"
    g.metadata_props.add(key="graph_key", value="graph value")
    for k, node in enumerate(g.node):
        node.name = f"node{k}"
        node.doc_string = f"node {k}'s doc"
        node.metadata_props.add(key="source", value=f"layer.{k}")
    for t in g.initializer:
        t.doc_string = f"{t.name} doc"
        t.metadata_props.add(key="origin", value=t.name)
    g.input[0].doc_string = "input doc"
    g.output[0].doc_string = "output doc"
    g.input[0].metadata_props.add(key="io", value="in")
    g.value_info.extend([_vi("mm0", ["n", 64]), _vi("h0", ["n", 64])])
    qa = g.quantization_annotation.add(tensor_name="h0")
    qa.quant_parameter_tensor_names.add(key="SCALE_TENSOR", value="fc0.bias")
    # training_info: an initialization graph (reset a bias) and an algorithm updating a weight
    init_graph = helper.make_graph([helper.make_node("Constant", [], ["fc2.bias_init"],
                                                     value=_t("z", np.zeros(64, np.float32)))],
                                   "init", [], [_vi("fc2.bias_init", [64])])
    algo = helper.make_graph([helper.make_node("Mul", ["fc2.weight", "decay"], ["fc2.weight_new"])], "algo", [],
                             [_vi("fc2.weight_new", [64, 64])], [_t("decay", np.array(0.99, np.float32))])
    ti = m.training_info.add()
    ti.initialization.CopyFrom(init_graph)
    ti.initialization_binding.add(key="fc2.bias", value="fc2.bias_init")
    ti.algorithm.CopyFrom(algo)
    ti.update_binding.add(key="fc2.weight", value="fc2.weight_new")
    return m


def values(seed=0) -> onnx.ModelProto:
    """Weights whose values are the corner: all zeros, all one value, one outlier 3e4 among
    N(0, 1/64) values, denormals only (~1e-40), zeros of both signs around a single 1, a float16
    weight of a few hundreds, and one stored in float_data (old exporters) instead of raw_data."""
    rng = np.random.default_rng(seed)
    outlier = _w(rng, 64, 64)
    outlier[3, 5] = 3e4
    signed_zeros = np.where(_w(rng, 64, 64) > 0, 0.0, -0.0).astype(np.float32)
    signed_zeros[0, 0] = 1.0
    inits = [_t("zero", np.zeros((64, 64), np.float32)), _t("const", np.full((64, 64), 0.5, np.float32)),
             _t("outlier", outlier), _t("denormal", (_w(rng, 64, 64) * 1e-38).astype(np.float32)),
             _t("signed_zeros", signed_zeros), _t("f16", (_w(rng, 64, 64) * 300).astype(np.float16)),
             helper.make_tensor("float_data", F, [64, 64], _w(rng, 64, 64).ravel().tolist(), raw=False)]
    names = ["zero", "const", "outlier", "denormal", "signed_zeros", "float_data"]
    nodes = [helper.make_node("MatMul", ["x", n], [f"y_{n}"]) for n in names]
    nodes += [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
              helper.make_node("MatMul", ["x16", "f16"], ["y_f16"])]
    outputs = [_vi(f"y_{n}", [4, 64]) for n in names] + [_vi("y_f16", [4, 64], TensorProto.FLOAT16)]
    return _model(nodes, [_vi("x", [4, 64])], outputs, inits)


def x64_feeds(rng, n=4):
    return [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(n)]


def names(seed=0) -> onnx.ModelProto:
    """Names a writer must not collide with or mangle: weights already called W_quantized and
    W_scale beside W, a Chinese name with '/', '.' and ':', a 300-character name, nodes without
    names, a 1-D convolution kernel [32, 64, 1], and opset imports of domains no node uses."""
    rng = np.random.default_rng(seed)
    long = "a" * 300
    inits = [_t("W", _w(rng, 64, 64)), _t("W_quantized", _w(rng, 64, 64)), _t("W_scale", _w(rng, 64, scale=0.1)),
             _t("权重/层.0:weight", _w(rng, 64, 64)), _t(long, _w(rng, 64, 64)), _t("k1", _w(rng, 32, 64, 1)),
             _t("axis0", np.array([0], np.int64))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("MatMul", ["h", "W_quantized"], ["h2"], name="mm_quantized"),
             helper.make_node("Add", ["h2", "W_scale"], ["h3"]),
             helper.make_node("MatMul", ["h3", "权重/层.0:weight"], ["h4"]),
             helper.make_node("MatMul", ["h4", long], ["h5"]),
             helper.make_node("Unsqueeze", ["h5", "axis0"], ["h6"]),  # [1, 4, 64]
             helper.make_node("Transpose", ["h6"], ["h7"], perm=[0, 2, 1]),  # [1, 64, 4]
             helper.make_node("Conv", ["h7", "k1"], ["y"])]  # [1, 32, 4]
    return _model(nodes, [_vi("x", [4, 64])], [_vi("y", [1, 32, 4]), _vi("h", [4, 64])], inits,
                  extra_opsets=[helper.make_opsetid("ai.onnx.ml", 3), helper.make_opsetid("com.microsoft", 1)])


# ---------------------------------------------------------------------------------------------- registry

# name -> (builder returning a model, feeds(rng, n), writer(model, dst) or None for onnx.save)
EDGES = {
    "fn_nested": (fn_nested, fn_nested_feeds, None),
    "fn_in_subgraphs": (fn_in_subgraphs, flag_feeds, None),
    "recurrent_full": (recurrent_full, recurrent_feeds, None),
    "convs": (convs, convs_feeds, None),
    "degenerate": (degenerate, degenerate_feeds, None),
    "ext_spread": (mlp, mlp_feeds, save_spread),
    "ext_handmade": (mlp, mlp_feeds, save_handmade),
    "ext_attribute": (with_branches, branches_feeds, save_attribute),
    "metadata": (metadata, mlp_feeds, None),
    "values": (values, x64_feeds, None),
    "names": (names, x64_feeds, None),
}
NAMES = tuple(EDGES)


def feeds_for(name: str, rng, n=4) -> list[dict]:
    return EDGES[name][1](rng, n)


def write(name: str, dst: Path) -> Path:
    build, _, writer = EDGES[name]
    dst.parent.mkdir(parents=True, exist_ok=True)
    (writer or (lambda m, p: onnx.save(m, str(p))))(build(), dst)
    return dst


def build(out: Path) -> dict[str, Path]:
    """Make every model under out/NAME/ (those missing); name -> model path."""
    paths = {n: out / n / f"{n}.onnx" for n in NAMES}
    for name, path in paths.items():
        if not path.exists():
            write(name, path)
    return paths


if __name__ == "__main__":
    for name, path in build(Path(sys.argv[1])).items():
        print(name, path)
