"""passes.InferenceSession's entry arguments:
- a ModelProto or bytes as `path` raise InvalidArgumentError naming what it takes;
- a provider this onnxruntime lacks is left out with a warning (onnxruntime does the same),
  refused only when no listed provider is available;
- custom_op_libraries= registers custom-op libraries on the private options copy, and a load
  that fails for an unknown custom op says so."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import InvalidArgumentError, InvalidModelError


def _matmul_model():
    w = (np.random.default_rng(0).standard_normal((64, 64)) * 0.1).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64])],
                              [numpy_helper.from_array(w, "W")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("given", ["model", "bytes", "int"])
def test_a_model_instead_of_a_path_is_refused_naming_what_it_takes(given):
    m = passes.quantize_weights(_matmul_model(), min_elements=16)
    value = {"model": m, "bytes": m.SerializeToString(), "int": 3}[given]
    with pytest.raises(InvalidArgumentError, match=r"takes the path of an \.onnx or \.onnxz file") as info:
        passes.InferenceSession(value, mode="fold")
    assert ("save a ModelProto first" in str(info.value)) and ("serialized model" in str(info.value)) == (given == "bytes")


@pytest.mark.parametrize("mode", ["fold", "int8", "auto"])
def test_an_unavailable_provider_is_left_out_with_a_warning(tmp_path, mode):
    missing = "NoSuchExecutionProvider"
    assert missing not in ort.get_available_providers()
    path = tmp_path / "q.onnx"
    passes.save_model(passes.quantize_weights(_matmul_model(), min_elements=16), path)
    with pytest.warns(RuntimeWarning, match=f"{missing} not available in this onnxruntime: left out"):
        session = passes.InferenceSession(path, providers=[missing, "CPUExecutionProvider"],
                                          provider_options=[{}, {}], mode=mode)
    assert session.get_providers() == ["CPUExecutionProvider"]
    x = {"x": np.ones((2, 64), np.float32)}
    plain = passes.InferenceSession(path, providers=["CPUExecutionProvider"], mode=mode)
    assert np.array_equal(session.run(None, x)[0], plain.run(None, x)[0])
    with pytest.raises(InvalidArgumentError, match=f"{missing} not available"):
        passes.InferenceSession(path, providers=[missing], mode=mode)
    with pytest.raises(InvalidArgumentError, match="one dict per provider"):
        passes.InferenceSession(path, providers=["CPUExecutionProvider"], provider_options=[{}, {}], mode=mode)


def _custom_op_model():
    w = (np.random.default_rng(1).standard_normal((128, 128)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
             helper.make_node("StringUpper", ["s"], ["su"], domain="ai.onnx.contrib")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 128]),
                                           helper.make_tensor_value_info("s", TensorProto.STRING, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 128]),
                               helper.make_tensor_value_info("su", TensorProto.STRING, [1])],
                              [numpy_helper.from_array(w, "W")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)])
    m.ir_version = 8
    return m


def test_a_missing_custom_op_library_is_named_in_the_error(tmp_path):
    path = tmp_path / "q.onnx"
    passes.save_model(passes.quantize_weights(_custom_op_model(), min_elements=16), path)
    with pytest.raises(InvalidModelError, match=r"custom op StringUpper of domain 'ai.onnx.contrib'.*custom_op_libraries="):
        passes.InferenceSession(path, mode="int8")


@pytest.mark.parametrize("source", ["onnx", "onnxz"])
@pytest.mark.parametrize("mode", ["fold", "int8", "auto"])
def test_custom_op_libraries_reach_the_session(tmp_path, source, mode):
    extensions = pytest.importorskip("onnxruntime_extensions")
    library = extensions.get_library_path()
    path = tmp_path / "q.onnx"
    passes.save_model(passes.quantize_weights(_custom_op_model(), min_elements=16), path)
    if source == "onnxz":
        passes.pack(path, tmp_path / "q.onnxz")
        path = tmp_path / "q.onnxz"
    caller = ort.SessionOptions()
    caller.register_custom_ops_library(library)
    feed = {"x": np.ones((2, 128), np.float32), "s": np.array(["abc"])}
    for options in (caller, None):
        session = passes.InferenceSession(path, options, mode=mode, custom_op_libraries=[library])
        assert session.run(None, feed)[1].tolist() == ["ABC"]
