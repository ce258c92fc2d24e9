"""passes.InferenceSession at load, mode="int8" / "int4" (and the options it builds):
- the caller's session.qdq_matmulnbits_accuracy_level is honoured (config entry and the
  MatMulNBits attribute), not overwritten with 4;
- a float model's tied embedding / output projection table is quantized at load (per row) and
  gets an integer form for each reader, as from a quantized file;
- the notes say what load-time quantization did; a batched MatMul weight is described as
  such; a quantized weight's float scale is not a "float weight left float";
- a grouped (depthwise) ConvTranspose weight is quantized along axis 0, not axis 1 (which mixes
  the groups: one scale for a depthwise weight);
- custom_op_libraries= registers on a copy of the caller's options, and a load that fails for an
  unknown custom op names the keyword."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import runtime_int8
from passes.errors import InvalidArgumentError
from passes.runtime_options import OptionsDraft

ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _save(tmp_path, m, name="m.onnx"):
    path = tmp_path / name
    onnx.save(m, str(path))
    return path


def _snr_db(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - got) ** 2), 1e-300))


def _float_reference(m, feed):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _matmul_model(k=256, n=256):
    w = (np.random.default_rng(0).standard_normal((k, n)) * 0.05).astype(np.float32)
    return _model([helper.make_node("MatMul", ["x", "W"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])], {"W": w})


# ---------------------------------------------------------------------- accuracy level

def test_the_callers_accuracy_level_is_used_not_overwritten(tmp_path, monkeypatch, capfd):
    path = _save(tmp_path, _matmul_model())
    feed = {"x": np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)}
    default = passes.InferenceSession(path, mode="int8").run(None, feed)[0]
    caller = ort.SessionOptions()
    caller.add_session_config_entry(ACCURACY_KEY, "0")
    capfd.readouterr()
    session = passes.InferenceSession(path, caller, mode="int8")
    got = session.run(None, feed)[0]
    assert "already exists" not in capfd.readouterr().err  # (onnxruntime's warning on an overwritten entry)
    assert session.get_session_options().get_session_config_entry(ACCURACY_KEY) == "0"
    assert caller.get_session_config_entry(ACCURACY_KEY) == "0"
    # the same outputs as a load whose MatMulNBits nodes are written with level 0 throughout
    monkeypatch.setattr(runtime_int8, "ACCURACY_LEVEL", 0)
    level0 = passes.InferenceSession(path, mode="int8").run(None, feed)[0]
    assert np.array_equal(got, level0)
    assert not np.array_equal(got, default)  # (level 4: int8 activations)
    reference = _float_reference(_matmul_model(), feed)
    assert _snr_db(reference, got) > _snr_db(reference, default)


def test_session_config_adds_the_default_only_when_the_caller_set_nothing():
    draft = OptionsDraft(None)
    assert runtime_int8.session_config(draft) == runtime_int8.ACCURACY_LEVEL
    assert draft.entries == {ACCURACY_KEY: str(runtime_int8.ACCURACY_LEVEL)}
    caller = ort.SessionOptions()
    caller.add_session_config_entry(ACCURACY_KEY, "1")
    draft = OptionsDraft(caller)
    assert runtime_int8.session_config(draft) == 1
    assert draft.entries == {}  # (the caller's value reaches the private copy as it is)
    caller.add_session_config_entry(ACCURACY_KEY, "fast")
    with pytest.raises(InvalidArgumentError, match="qdq_matmulnbits_accuracy_level"):
        runtime_int8.session_config(OptionsDraft(caller))


# ---------------------------------------------------------------------- tied tables

def _tied_models(vocabulary=3000, width=128):
    table = (np.random.default_rng(2).standard_normal((vocabulary, width)) * 0.1).astype(np.float32)
    through_transpose = _model(
        [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
         helper.make_node("MatMul", ["e", "Et"], ["logits"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocabulary])], {"E": table})
    gemm = _model(
        [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Gemm", ["e", "E"], ["logits"], transB=1)],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", vocabulary])], {"E": table})
    return {"transpose+matmul": (through_transpose, {"ids": np.array([[5, 17, 2999, 0]], np.int64)}),
            "gemm transB": (gemm, {"ids": np.array([5, 17, 2999, 0], np.int64)})}


@pytest.mark.parametrize("form", ["transpose+matmul", "gemm transB"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_float_tied_table_gets_an_integer_form_for_each_reader(tmp_path, form, mode):
    m, feed = _tied_models()[form]
    float_path = _save(tmp_path, m)
    quantized_path = _save(tmp_path, passes.quantize_weights(m), "q.onnx")
    session = passes.InferenceSession(float_path, mode=mode)
    assert session.op_counts.get("MatMulNBits") == 1
    assert session.op_counts.get("Gather") == 2  # (integer rows and their per-row scales)
    assert "MatMul" not in session.op_counts and "Gemm" not in session.op_counts
    assert "Transpose" not in session.op_counts
    assert not [n for n in session.notes if "stay float" in n], session.notes
    assert any("tied between an embedding Gather and an output projection" in n for n in session.notes), session.notes
    got = session.run(None, feed)[0]
    reference = _float_reference(m, feed)
    assert _snr_db(reference, got) >= 35
    # as from the file quantize_weights writes (per row int8 as well: one form, the same op counts)
    from_file = passes.InferenceSession(quantized_path, mode=mode)
    assert from_file.op_counts == session.op_counts
    assert abs(_snr_db(reference, from_file.run(None, feed)[0]) - _snr_db(reference, got)) < 3


# ---------------------------------------------------------------------- notes

def test_the_notes_say_what_was_quantized_at_load(tmp_path):
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((256, 128)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((128, 64)) * 0.1).astype(np.float32)
    m = _model([helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64])], {"W1": w1, "W2": w2})
    path = _save(tmp_path, m)
    for mode, scheme in (("int8", "int8 per channel"), ("int4", "int4 blocks of 32")):
        notes = passes.InferenceSession(path, mode=mode).notes
        line = next((n for n in notes if "quantized at load" in n), None)
        assert line is not None, notes
        assert line.startswith(f"2 float weight(s) quantized at load ({scheme}): 0.16 -> ")
        assert " MiB, weight SNR min " in line and "median" in line
        after = float(line.split("-> ")[1].split(" MiB")[0])
        assert after < (0.06 if mode == "int8" else 0.03)


def test_a_batched_matmul_weight_is_described_as_one(tmp_path):
    w = (np.random.default_rng(4).standard_normal((4, 64, 32)) * 0.1).astype(np.float32)
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2, 64])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2, 32])], {"W": w})
    notes = passes.InferenceSession(_save(tmp_path, m), mode="int8").notes
    assert len(notes) == 1, notes
    assert "stay float: a 3-D (batched) MatMul B (MatMulNBits takes a 2-D B" in notes[0]
    assert "consumed by" not in notes[0] and "quantized at load only for" not in notes[0]


def test_a_quantized_weights_float_scale_is_not_a_float_weight_left_float(tmp_path):
    # a blocked DequantizeLinear whose scale (8 x 1024 = 8192 values) is above the size rule
    rng = np.random.default_rng(5)
    k, n, block = 256, 1024, 32
    levels = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scale = (rng.uniform(0.5, 1.5, (k // block, n)) * 0.001).astype(np.float32)
    m = _model([helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"], axis=0, block_size=block),
                helper.make_node("MatMul", ["x", "W"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])], {"Wq": levels, "Ws": scale}, opset=21)
    session = passes.InferenceSession(_save(tmp_path, m), mode="int8")
    assert session.op_counts.get("MatMulNBits") == 1
    assert not [line for line in session.notes if "float" in line], session.notes


# ---------------------------------------------------------------------- grouped ConvTranspose

def _depthwise_conv_transpose(channels=128, kernel=8):
    rng = np.random.default_rng(6)
    spread = np.exp(rng.uniform(-4, 2, channels)).astype(np.float32).reshape(channels, 1, 1, 1)
    w = (rng.standard_normal((channels, 1, kernel, kernel)).astype(np.float32) * spread)
    return _model([helper.make_node("ConvTranspose", ["x", "W"], ["y"], group=channels, strides=[2, 2])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 5, 5])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 16, 16])], {"W": w})


def test_a_grouped_conv_transpose_is_quantized_per_input_channel():
    from passes.runtime_feed import split_model

    split = split_model(_depthwise_conv_transpose())
    runtime_int8._quantize_float_weights(split, 8)
    dq = next(n for n in split.skeleton.graph.node if n.op_type == "DequantizeLinear")
    assert runtime_int8._attr(dq, "axis", 1) == 0
    assert split.array(dq.input[1]).shape == (128,)  # one scale per channel (axis 1: a single one)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_depthwise_conv_transpose_keeps_its_channels_apart(tmp_path, mode):
    m = _depthwise_conv_transpose()
    feed = {"x": np.random.default_rng(7).standard_normal((1, 128, 5, 5)).astype(np.float32)}
    session = passes.InferenceSession(_save(tmp_path, m), mode=mode)
    got = session.run(None, feed)[0]
    reference = _float_reference(m, feed)
    assert not np.array_equal(got, reference)  # (quantized: small enough to be folded back to float at load)
    # per channel: ~46 dB (one scale for all 128 channels, as axis 1 gave: ~34 dB)
    assert _snr_db(reference, got) >= 42


# ---------------------------------------------------------------------- custom-op libraries (the options part)

def test_custom_op_libraries_are_registered_on_a_copy_never_on_the_callers(tmp_path):
    from passes import runtime_options

    caller = ort.SessionOptions()
    caller.add_session_config_entry("session.intra_op.allow_spinning", "0")
    assert OptionsDraft(caller).build() is caller  # (nothing added: the caller's own, as before)
    not_a_library = tmp_path / "not_a_library.so"
    not_a_library.write_bytes(b"x")
    draft = OptionsDraft(caller, custom_op_libraries=[not_a_library])
    assert draft.libraries == (str(not_a_library),)
    # a library to register is something the load adds: a copy, on which onnxruntime's refusal of
    # the file is an InvalidArgumentError naming it
    with pytest.raises(InvalidArgumentError, match="custom_op_libraries: onnxruntime cannot register .*not_a_library"):
        draft.build()
    with pytest.raises(InvalidArgumentError, match="is not a file"):
        OptionsDraft(caller, custom_op_libraries=tmp_path / "missing.so")
    with pytest.raises(InvalidArgumentError, match="a list of paths"):
        runtime_options.custom_op_library_paths([3])
    assert runtime_options.custom_op_library_paths(None) == ()


def test_an_unknown_custom_op_is_explained_with_the_keyword():
    from passes.runtime_options import custom_op_hint

    error = ("[ONNXRuntimeError] : 1 : FAIL : Load model from /proc/self/fd/6 failed:Fatal error: "
             "ai.onnx.contrib:StringUpper(-1) is not a registered function/op")
    hint = custom_op_hint(error)
    assert "custom op StringUpper of domain 'ai.onnx.contrib'" in hint and "custom_op_libraries=" in hint
    assert "do not provide it" in custom_op_hint(error, ("/x/lib.so",))
    assert custom_op_hint("Fatal error: com.microsoft:Foo(1) is not a registered function/op") == ""
    assert custom_op_hint("some other failure") == ""


def test_a_tied_table_whose_projection_input_is_quantized_by_the_model_stays_float(tmp_path):
    # (the projection stays a MatMul for onnxruntime's QDQ kernels, see prepare_quantized: the
    # table quantized at load would then be dequantized whole on every run)
    table = (np.random.default_rng(8).standard_normal((3000, 128)) * 0.1).astype(np.float32)
    m = _model([helper.make_node("Gather", ["E", "ids"], ["e"]),
                helper.make_node("QuantizeLinear", ["e", "s", "z"], ["eq"]),
                helper.make_node("DequantizeLinear", ["eq", "s", "z"], ["ed"]),
                helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
                helper.make_node("MatMul", ["ed", "Et"], ["logits"])],
               [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
               [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 3000])],
               {"E": table, "s": np.array(0.01, np.float32), "z": np.array(0, np.int8)})
    session = passes.InferenceSession(_save(tmp_path, m), mode="int8")
    assert session.op_counts.get("DequantizeLinear") == 1  # the activation's own; none for the table
    assert any("stay float" in n for n in session.notes), session.notes
