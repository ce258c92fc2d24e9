"""runtime_verbatim: a packed model that needs no rewrite goes to onnxruntime as its own restored
file, parsed while its weights decode and its graph is walked; when the walk finds a rewrite is
needed after all, that parse is abandoned and the usual route runs."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.errors import CorruptFileError, InvalidModelError
from passes.onnxz import open_packed
from passes.runtime_verbatim import verbatim_kind

from test_runtime import conv_model, damage_biggest_weight, dense_model, feeds_for, run, run_plain

OUR_THREADS = ("passes-weight-decode", "passes-graph-walk", "passes-model-writer")


def _our_threads() -> list:
    return [t.name for t in threading.enumerate() if t.name in OUR_THREADS and t.is_alive()]


def _pack(model, tmp_path, name):
    src, dst = tmp_path / f"{name}.onnx", tmp_path / f"{name}.onnxz"
    onnx.save(model, str(src))
    passes.pack(str(src), str(dst))
    return dst


def _conv_with_dequantized_bias():
    """A float Conv weight (the index looks verbatim) and a small int8 bias behind a
    DequantizeLinear (inline in the graph: only the walk sees something to fold)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 32, 3, 3)) / 17).astype(np.float32)
    q = rng.integers(-100, 100, 64).astype(np.int8)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(q, "Bq"),
             numpy_helper.from_array(np.array(0.01, np.float32), "Bs")]
    nodes = [helper.make_node("DequantizeLinear", ["Bq", "Bs"], ["B"]),
             helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1])]
    return helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 8, 8])], inits),
        opset_imports=[helper.make_opsetid("", 17)])


def test_lossless_conv_pack_is_parsed_as_it_is(tmp_path):
    model = conv_model()
    packed = _pack(model, tmp_path, "conv")
    session = passes.InferenceSession(packed, mode="fold")
    assert session.verbatim and session.fold_route is None and session.mode == "fold"
    assert session.embedded_names == {"W"} and not session.weight_arrays and not session.shared_names
    assert session.op_counts == {"Conv": 1, "Relu": 1} and session.dtype == np.float32
    assert not _our_threads()
    feeds = feeds_for(model)
    for got, want in zip(run(session, feeds), run_plain(model, feeds)):
        np.testing.assert_array_equal(got[0], want[0])


def test_matmul_weights_are_shared_not_parsed(tmp_path):
    """Float32 MatMul/Gemm weights: the usual route shares them with onnxruntime (no copy): not
    guessed verbatim from the index."""
    packed = _pack(dense_model(), tmp_path, "dense")
    with open_packed(packed) as pm:
        assert verbatim_kind(pm.packed_file.index) is None
    session = passes.InferenceSession(packed, mode="fold")
    assert not session.verbatim and session.shared_names


def test_quantized_matmul_pack_is_not_guessed_verbatim(tmp_path):
    q8 = passes.quantize_weights(dense_model(), bits=8, min_elements=256)
    packed = _pack(q8, tmp_path, "dense_q8")
    with open_packed(packed) as pm:
        assert verbatim_kind(pm.packed_file.index) is None
    assert not passes.InferenceSession(packed, mode="fold").verbatim


def test_quantized_conv_pack_is_folded_by_onnxruntime_as_it_is(tmp_path):
    """Quantized float32 Conv weights (fold_route "onnxruntime"): parsed as the file it is, with
    session.disable_quant_qdq=1; outputs bit-identical to the folded model's."""
    model = conv_model()
    q8 = passes.quantize_weights(model, bits=8, min_elements=256)
    packed = _pack(q8, tmp_path, "conv_q8")
    with open_packed(packed) as pm:
        assert verbatim_kind(pm.packed_file.index) == "quantized"
    options = ort.SessionOptions()
    session = passes.InferenceSession(packed, options, mode="fold")
    assert session.verbatim and session.fold_route == "onnxruntime" and session.embedded_names == {"W_quantized"}
    assert session.get_session_options().get_session_config_entry("session.disable_quant_qdq") == "1"
    from passes.runtime_options import config_entry

    assert config_entry(options, "session.disable_quant_qdq") is None  # (a copy was given)
    assert not _our_threads()
    feeds = feeds_for(model)
    for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(q8), feeds)):
        np.testing.assert_array_equal(got[0], want[0])


def test_quantized_float16_pack_keeps_the_usual_route(tmp_path):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(conv_model(), keep_io_types=True)
    q8 = passes.quantize_weights(model, bits=8, min_elements=256)
    packed = _pack(q8, tmp_path, "conv16_q8")
    with open_packed(packed) as pm:
        assert verbatim_kind(pm.packed_file.index) is None
    session = passes.InferenceSession(packed, mode="fold")
    assert not session.verbatim and session.fold_route in ("onnxruntime", "here")  # (see fold_kernel_fast)
    feeds = feeds_for(model)
    for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(q8), feeds)):
        np.testing.assert_array_equal(got[0], want[0])


def test_walk_finding_something_to_fold_abandons_the_parse(tmp_path, capfd):
    model = _conv_with_dequantized_bias()
    packed = _pack(model, tmp_path, "dq_bias")
    with open_packed(packed) as pm:
        assert verbatim_kind(pm.packed_file.index) == "float"
    session = passes.InferenceSession(packed, mode="fold")
    assert not session.verbatim and session.fold_route is not None
    assert not _our_threads()
    assert "error" not in capfd.readouterr().err.lower()  # the abandoned parse fails quietly
    feeds = feeds_for(model)
    for got, want in zip(run(session, feeds), run_plain(passes.fold_dequantize(model), feeds)):
        np.testing.assert_array_equal(got[0], want[0])


def test_auto_mode_choosing_int8_abandons_the_parse(tmp_path, monkeypatch):
    import passes.runtime as runtime

    packed = _pack(conv_model(), tmp_path, "conv")
    monkeypatch.setattr(runtime, "_free_memory_bytes", lambda: 1024)
    session = passes.InferenceSession(packed, mode="auto")
    assert session.mode == "int8" and not session.verbatim
    assert not _our_threads()


@pytest.mark.parametrize("settings", [{"mode": "int8"}, {"dtype": "float16"}])
def test_settings_that_rewrite_every_model_do_not_speculate(tmp_path, monkeypatch, settings):
    started = []
    original = passes.InferenceSession._parse_while_walking

    def counting(self, *args, **kwargs):
        started.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(passes.InferenceSession, "_parse_while_walking", counting)
    packed = _pack(conv_model(), tmp_path, "conv")
    session = passes.InferenceSession(packed, **settings)
    assert not session.verbatim and not started


def test_damaged_weight_is_reported_and_nothing_left_running(tmp_path):
    packed = _pack(conv_model(), tmp_path, "conv")
    damaged = tmp_path / "damaged.onnxz"
    damage_biggest_weight(packed, damaged)
    with pytest.raises(CorruptFileError):
        passes.InferenceSession(damaged, mode="fold")
    assert not _our_threads()


def test_model_onnxruntime_refuses_is_an_invalid_model(tmp_path):
    model = conv_model()
    model.graph.node[1].op_type = "NoSuchOperator"
    packed = _pack(model, tmp_path, "refused")
    with pytest.raises(InvalidModelError, match="cannot create a session"):
        passes.InferenceSession(packed, mode="fold")
    assert not _our_threads()


def test_session_settings_reach_the_speculated_session(tmp_path):
    packed = _pack(conv_model(), tmp_path, "conv")
    options = ort.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    session = passes.InferenceSession(packed, options, mode="fold", threads=1, prepack=False)
    assert session.verbatim and session.prepack is False
    got = session.get_session_options()
    assert got.intra_op_num_threads == 1
    assert got.get_session_config_entry("session.disable_prepacking") == "1"
    assert got.get_session_config_entry("session.set_denormal_as_zero") == "1"
    assert options.intra_op_num_threads != 1  # the caller's options untouched
    from passes.runtime_options import config_entry

    assert config_entry(options, "session.disable_prepacking") is None


def test_float16_pack_is_parsed_as_it_is(tmp_path):
    """Float16 weights on a CPU are never shared: a float16 model with MatMul weights goes verbatim."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(dense_model(), keep_io_types=True)
    packed = _pack(model, tmp_path, "dense16")
    session = passes.InferenceSession(packed, mode="fold")
    assert session.verbatim and session.dtype == np.float16
    # (counted without graph_reads: nothing is shared, so no weight's readers are listed)
    counts = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    assert session.op_counts == counts and "Cast" in counts
    feeds = feeds_for(model)
    for got, want in zip(run(session, feeds), run_plain(model, feeds)):
        np.testing.assert_array_equal(got[0], want[0])


def test_callers_options_go_to_onnxruntime_untouched(tmp_path):
    """With nothing of the load's own to add (no threads=, no prepack=False), onnxruntime gets the
    caller's options as they are (it copies them), as from its own InferenceSession."""
    from passes.runtime_options import KNOWN_CONFIG_KEYS, config_entry

    packed = _pack(conv_model(), tmp_path, "conv")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    session = passes.InferenceSession(packed, options, mode="fold")
    assert session.verbatim
    assert session.get_session_options().intra_op_num_threads == 1
    assert options.intra_op_num_threads == 1
    assert {k for k in KNOWN_CONFIG_KEYS if config_entry(options, k) is not None} == {"session.set_denormal_as_zero"}


def test_the_walk_runs_on_the_writer_after_onnxruntime_has_bytes(tmp_path, monkeypatch):
    """The graph walk that confirms the verbatim route runs on the thread feeding onnxruntime
    (no walker thread of its own), after the first bytes were handed to onnxruntime."""
    from passes import runtime

    if not runtime._streaming_supported():
        pytest.skip("models streamed through a pipe")
    model = conv_model()
    packed = _pack(model, tmp_path, "conv")
    written, seen = [], []
    original_write, original_decision = runtime.write_to_pipe, runtime.InferenceSession._verbatim_decision

    def write(fd, views, splice=True):
        written.append(sum(v.nbytes for v in views))
        return original_write(fd, views, splice)

    def decision(self, split, kind):
        seen.append((threading.current_thread().name, sum(written)))
        return original_decision(self, split, kind)

    monkeypatch.setattr(runtime, "write_to_pipe", write)
    monkeypatch.setattr(runtime.InferenceSession, "_verbatim_decision", decision)
    session = passes.InferenceSession(packed, mode="fold")
    assert session.verbatim and len(seen) == 1
    assert seen[0][0] == "passes-model-writer" and seen[0][1] > 0
    assert not _our_threads()
    feeds = feeds_for(model)
    for got, want in zip(run(session, feeds), run_plain(model, feeds)):
        np.testing.assert_array_equal(got[0], want[0])
