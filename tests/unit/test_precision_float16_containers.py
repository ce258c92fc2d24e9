"""dtype="float16" on models with optional or sequence values. onnxruntime's float16
converter converts the tensors read from an optional value but not the optional type, and with
keep_io_types it keeps tensor inputs float32 but not sequence inputs. Where the converted model
cannot work the session is refused before the conversion with an UnsupportedFormError naming the
value and saying to load without dtype= (before: onnxruntime refused the converted model and the
InvalidModelError said the model was invalid; a sequence input failed at every run).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import UnsupportedFormError

D = 64
FLOAT_TENSOR = helper.make_tensor_type_proto(TensorProto.FLOAT, None)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _weights(*names):
    rng = np.random.default_rng(1)
    return [numpy_helper.from_array((rng.standard_normal((D, D)) / 8).astype(np.float32), n) for n in names]


def _save(nodes, inputs, outputs, inits, tmp_path, name) -> str:
    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    path = str(tmp_path / f"{name}.onnx")
    onnx.save(model, path)
    return path


def optional_input_model(tmp_path) -> str:
    """A small model with an optional(tensor(float)) input added inside an If branch when present."""
    then_g = helper.make_graph([helper.make_node("OptionalGetElement", ["bias"], ["b"]),
                                helper.make_node("Add", ["p", "b"], ["t"])], "then", [], [_vi("t", None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["p"], ["e"])], "else", [], [_vi("e", None)])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p"]), helper.make_node("OptionalHasElement", ["bias"], ["has"]),
             helper.make_node("If", ["has"], ["y"], then_branch=then_g, else_branch=else_g)]
    bias = helper.make_value_info("bias", helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [D])))
    return _save(nodes, [_vi("x", ["n", D]), bias], [_vi("y", ["n", D])], _weights("W"), tmp_path, "optional_input")


def optional_inside_model(tmp_path) -> str:
    """An Optional node made and read in the graph (no optional input or output)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p"]), helper.make_node("Optional", ["p"], ["o"]),
             helper.make_node("OptionalGetElement", ["o"], ["g"]), helper.make_node("Relu", ["g"], ["y"])]
    return _save(nodes, [_vi("x", ["n", D])], [_vi("y", ["n", D])], _weights("W"), tmp_path, "optional_inside")


def sequence_input_model(tmp_path) -> str:
    nodes = [helper.make_node("ConcatFromSequence", ["parts"], ["c"], axis=0), helper.make_node("MatMul", ["c", "W"], ["y"])]
    parts = helper.make_value_info("parts", helper.make_sequence_type_proto(FLOAT_TENSOR))
    return _save(nodes, [parts], [_vi("y", ["n", D])], _weights("W"), tmp_path, "sequence_input")


def sequence_output_model(tmp_path) -> str:
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["p1"]), helper.make_node("MatMul", ["x", "W2"], ["p2"]),
             helper.make_node("SequenceConstruct", ["p1", "p2"], ["both"]), helper.make_node("Add", ["p1", "p2"], ["y"])]
    both = helper.make_value_info("both", helper.make_sequence_type_proto(FLOAT_TENSOR))
    return _save(nodes, [_vi("x", ["n", D])], [_vi("y", ["n", D]), both], _weights("W1", "W2"), tmp_path, "sequence_output")


def _x():
    return np.random.default_rng(2).standard_normal((3, D)).astype(np.float32)


@pytest.mark.parametrize("mode", ["fold", "int8"])
@pytest.mark.parametrize("build, named", [(optional_input_model, "input 'bias' (optional(tensor(float)))"),
                                          (optional_inside_model, "an Optional node")])
def test_optional_values_refused_naming_the_conversion(tmp_path, build, named, mode):
    path = build(tmp_path)
    with pytest.raises(UnsupportedFormError) as caught:
        passes.InferenceSession(path, mode=mode, dtype="float16")
    message = str(caught.value)
    assert message.startswith("dtype=float16: onnxruntime's float16 converter cannot convert this model")
    assert named in message and "dtype=None" in message
    # without dtype= the model runs (the refusal is the conversion's, not the model's)
    sess = passes.InferenceSession(path, mode=mode)
    feeds = {"x": _x(), "bias": np.ones(D, np.float32)} if build is optional_input_model else {"x": _x()}
    assert sess.run(None, feeds)[0].dtype == np.float32


@pytest.mark.parametrize("mode", ["fold", "int8"])
def test_sequence_input_refused_with_keep_io_types(tmp_path, mode):
    path = sequence_input_model(tmp_path)
    with pytest.raises(UnsupportedFormError, match=r"input 'parts' \(sequence\(tensor\(float\)\)\).*keep_io_types=False"):
        passes.InferenceSession(path, mode=mode, dtype="float16")
    sess = passes.InferenceSession(path, mode=mode, dtype="float16", keep_io_types=False)
    parts = [_x()[:2].astype(np.float16), _x()[2:].astype(np.float16)]
    got = sess.run(None, {"parts": parts})[0]
    assert got.dtype == np.float16 and got.shape == (3, D)


@pytest.mark.parametrize("mode", ["fold", "int8"])
def test_sequence_output_converts_with_a_note(tmp_path, mode):
    path = sequence_output_model(tmp_path)
    reference = passes.InferenceSession(path).run(None, {"x": _x()})
    sess = passes.InferenceSession(path, mode=mode, dtype="float16")
    y, both = sess.run(None, {"x": _x()})
    assert y.dtype == np.float32 and [t.dtype for t in both] == [np.float16, np.float16]
    assert any("sequence output(s) 'both' hold float16 tensors" in n for n in sess.notes), sess.notes
    assert np.abs(y - reference[0]).max() < 0.1 * np.abs(reference[0]).max()
