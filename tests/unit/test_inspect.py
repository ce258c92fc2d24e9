"""passes.inspect.describe_model: every weight, its dtype, bytes, scheme and location."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.inspect import describe_model, tensor_nbytes


def _model(nodes, inits, inputs=("x",), opset=21):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _rows(model):
    return {r.name: r for r in describe_model(model).rows}


def test_dequantize_schemes():
    rng = np.random.default_rng(0)
    q8 = numpy_helper.from_array(rng.integers(-127, 128, (16, 32)).astype(np.int8), "w8_quantized")
    s8 = numpy_helper.from_array(np.full(16, 0.01, np.float32), "w8_scale")
    u8 = numpy_helper.from_array(rng.integers(0, 256, (32, 8)).astype(np.uint8), "wu_quantized")
    su = numpy_helper.from_array(np.array(0.02, np.float32), "wu_scale")
    zu = numpy_helper.from_array(np.array(128, np.uint8), "wu_zero_point")
    q4 = helper.make_tensor("w4_quantized", TensorProto.INT4, [8, 64], rng.integers(-8, 8, 512).tolist())
    s4 = numpy_helper.from_array(np.full((8, 2), 0.1, np.float16), "w4_scale")
    z4 = helper.make_tensor("w4_zero_point", TensorProto.INT4, [8, 2], [0] * 16)
    nodes = [
        helper.make_node("DequantizeLinear", ["w8_quantized", "w8_scale"], ["w8"], axis=0),
        helper.make_node("DequantizeLinear", ["wu_quantized", "wu_scale", "wu_zero_point"], ["wu"]),
        helper.make_node("DequantizeLinear", ["w4_quantized", "w4_scale", "w4_zero_point"], ["w4"], axis=1, block_size=32),
        helper.make_node("MatMul", ["x", "w8"], ["y"]),
    ]
    rows = _rows(_model(nodes, [q8, s8, u8, su, zu, q4, s4, z4]))
    assert rows["w8_quantized"].scheme == "int8/channel(axis=0)/sym"
    assert rows["w8_quantized"].bytes == 16 * 32 and rows["w8_quantized"].dtype == "int8"
    assert rows["w8_quantized"].consumers == ["DequantizeLinear"]
    assert rows["w8_scale"].scheme == "dq-scale" and rows["w8_scale"].dtype == "float32"
    assert rows["wu_quantized"].scheme == "uint8/tensor/asym"
    assert rows["wu_zero_point"].scheme == "dq-zero-point"
    assert rows["w4_quantized"].scheme == "int4/block(32)/sym"  # an all-zero zero point is symmetric
    assert rows["w4_quantized"].bytes == 8 * 64 // 2  # packed two per byte
    assert rows["w4_quantized"].shape == (8, 64)
    assert rows["w4_scale"].dtype == "float16"


def test_palette_integer_ops_cast_scale_and_float():
    rng = np.random.default_rng(1)
    table = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "table")
    idx = numpy_helper.from_array(rng.integers(0, 16, (32, 32)).astype(np.uint8), "idx")
    wmm = numpy_helper.from_array(rng.integers(0, 256, (32, 4)).astype(np.uint8), "wmm")
    wc = numpy_helper.from_array(rng.integers(-127, 128, (4, 4)).astype(np.int8), "wc")
    sc = numpy_helper.from_array(np.full(4, 0.1, np.float32), "sc")
    wf = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "wf")
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    nodes = [
        helper.make_node("Gather", ["table", "idx"], ["w_pal"]),
        helper.make_node("MatMulInteger", ["xq", "wmm"], ["mm"]),
        helper.make_node("Cast", ["wc"], ["wc_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["wc_f", "sc"], ["wc_deq"]),
        helper.make_node("MatMul", ["x", "wf"], ["y0"]),
        helper.make_node("Reshape", ["y0", "shape"], ["y"]),
    ]
    rows = _rows(_model(nodes, [table, idx, wmm, wc, sc, wf, shape], inputs=("x", "xq")))
    assert rows["idx"].scheme == "palette(16)"
    assert rows["table"].scheme == "palette-table"
    assert rows["wmm"].scheme == "uint8/MatMulInteger"
    assert rows["wc"].scheme == "int8/cast-scale"
    assert rows["wf"].scheme == "float"
    assert rows["shape"].scheme == "integer"


def test_constant_nodes_and_subgraphs_with_locations_and_totals():
    w = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float16)
    then_graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w_then"], value=numpy_helper.from_array(w, "w_then")),
         helper.make_node("MatMul", ["x", "w_then"], ["out_then"])],
        "then", [], [helper.make_tensor_value_info("out_then", TensorProto.FLOAT16, None)])
    else_graph = helper.make_graph(
        [helper.make_node("Constant", [], ["k"], value_floats=[1.0, 2.0, 3.0]),
         helper.make_node("Identity", ["x"], ["out_else"])],
        "else", [], [helper.make_tensor_value_info("out_else", TensorProto.FLOAT16, None)])
    nodes = [
        helper.make_node("Constant", [], ["top"], value=numpy_helper.from_array(w, "top")),
        helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_graph, else_branch=else_graph),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, None),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    desc = describe_model(model)
    rows = {r.name: r for r in desc.rows}
    assert rows["top"].location == "Constant node"
    assert rows["w_then"].location == "subgraph branch/then_branch: Constant node"
    assert rows["w_then"].consumers == ["MatMul"]
    assert rows["k"].location == "subgraph branch/else_branch: Constant node" and rows["k"].bytes == 12
    assert desc.by_dtype["float16"] == {"count": 2, "bytes": 2 * 128}
    assert desc.by_dtype["float32"] == {"count": 1, "bytes": 12}
    assert desc.by_scheme["float"]["count"] == 3
    assert desc.total_bytes == 2 * 128 + 12
    d = desc.to_dict()
    assert d["weight_bytes"] == desc.total_bytes and len(d["tensors"]) == 3 and d["opsets"] == {"ai.onnx": 17}


def test_external_data_is_not_read(tmp_path):
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [w], opset=17)
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=0)
    (tmp_path / "m.onnx.data").unlink()  # describe_model must not need it: sizes come from the metadata
    desc = describe_model(str(tmp_path / "m.onnx"))
    rows = {r.name: r for r in desc.rows}
    assert rows["w"].bytes == 64 * 64 * 4 and rows["w"].scheme == "float"
    assert desc.external_files == ["m.onnx.data"]


def test_tensor_nbytes_from_typed_fields():
    t = helper.make_tensor("t", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])  # float_data, not raw
    assert tensor_nbytes(t) == 12
    assert tensor_nbytes(helper.make_tensor("u", TensorProto.UINT4, [5], [1, 2, 3, 4, 5])) == 3


def test_describe_quantized_sample_model(sample_model):
    q = passes.quantize_weights(str(sample_model))
    desc = describe_model(q)
    quantized = [r for r in desc.rows if r.scheme.startswith("int8/")]
    assert quantized, "the quantize pass produced no int8 weights"
    assert all(r.dtype == "int8" and r.scheme == "int8/channel(axis=0)/sym" for r in quantized)  # Conv: output channels
    assert all(r.name.endswith("_quantized") for r in quantized)
    scales = [r for r in desc.rows if r.scheme == "dq-scale"]
    assert len(scales) == len(quantized)
    assert desc.by_dtype["int8"]["bytes"] == sum(r.bytes for r in quantized)
    assert describe_model(str(sample_model)).by_dtype["float32"]["count"] == 285


def test_sparse_initializer_count_does_not_wrap_on_hostile_dims():
    """describe_model reads an untrusted file: 2**32 x 2**32 dims wrapped to 0 values in int64."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import passes

    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.asarray([1.0], np.float32), "W"),
                                   numpy_helper.from_array(np.asarray([[1, 1]], np.int64), "W_idx"), [2**32, 2**32])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], sparse_initializer=[sp])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    (row,) = passes.describe_model(m).rows
    assert row.location == f"sparse initializer (1 of {2**64} values)"


def test_blocked_cast_scale_names_its_block():
    """The auto mode's blocked levels (Cast -> Mul by one scale per 64 inputs -> Reshape) are told
    apart from a per-channel Cast -> Mul (test above) by their block size."""
    from passes import cast_levels, forms

    w = np.random.default_rng(2).standard_normal((128, 8)).astype(np.float32)
    wi = numpy_helper.from_array(w, "W")
    model = _model([helper.make_node("MatMul", ["x", "W"], ["y"])], [wi])
    qz = forms.quantize_blocks(w, 5, 0, 64)
    rows = _rows(cast_levels.as_blocked_cast_mul(model, {"W": (qz.q, qz.scale, 0, 64)}))
    assert rows["W_quantized"].scheme == "int8/cast-scale/block(64)"
    assert rows["W_quantized"].shape == (2, 64, 8)
