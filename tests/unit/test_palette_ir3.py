"""palettize on an IR 3 model whose weights are Constant nodes: the new initializers (tables,
indices) are not graph inputs, which IR 3 requires; the model is raised to IR 4 and checks."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.report import Report


def _ir3_constant_weight_model():
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(w, "W")),
             helper.make_node("MatMul", ["x", "W"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 3
    onnx.checker.check_model(m, full_check=True)
    return m, w


def test_palettize_ir3_constant_weights_checks_and_runs():
    m, w = _ir3_constant_weight_model()
    rep = Report()
    p = passes.palettize(m, bits=4, min_elements=256, report=rep)
    assert any(t.name.startswith("W_palette") for t in p.graph.initializer)  # it was palettized
    assert p.ir_version == 4 and any("IR version raised" in n for n in rep.notes)
    onnx.checker.check_model(p, full_check=True)
    folded = passes.fold_palettes(p)
    onnx.checker.check_model(folded, full_check=True)
    x = np.ones((1, 64), np.float32)
    a = ort.InferenceSession(p.SerializeToString()).run(None, {"x": x})[0]
    b = ort.InferenceSession(folded.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)
    assert m.ir_version == 3  # the input model is not changed


def _ir3_listed_initializer_model(ir=3):
    """PyTorch's opset-6 exports: the weight an initializer and, as IR 3 requires, a graph input."""
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                           helper.make_tensor_value_info("W", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = ir
    onnx.checker.check_model(m, full_check=True)
    return m


def test_palettize_ir3_initializers_listed_as_inputs_are_palettized():
    # was: nothing palettized and no note (the listed initializers were taken as overridable)
    # while quantize_weights un-lists them; the onnx package's opset-6 backend-test models
    m = _ir3_listed_initializer_model()
    rep = Report()
    p = passes.palettize(m, bits=4, min_elements=256, report=rep)
    assert [t.name for t in rep.tensors] == ["W"]
    assert p.ir_version == 4 and [i.name for i in p.graph.input] == ["x"]
    assert any("no longer listed as graph inputs" in n for n in rep.notes)
    onnx.checker.check_model(p, full_check=True)
    x = np.ones((1, 64), np.float32)
    a = ort.InferenceSession(p.SerializeToString()).run(None, {"x": x})[0]
    b = ort.InferenceSession(passes.fold_palettes(p).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)
    assert m.ir_version == 3 and len(m.graph.input) == 2


def test_palettize_ir4_overridable_weight_stays_float_with_a_note():
    m = _ir3_listed_initializer_model(ir=4)
    rep = Report()
    p = passes.palettize(m, bits=4, min_elements=256, report=rep)
    assert not rep.tensors and p.graph.initializer[0].name == "W"
    assert any("also listed as graph inputs" in n for n in rep.notes)
