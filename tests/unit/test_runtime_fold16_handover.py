"""SURGEON_FOLD16_HANDOVER=1 (runtime.FOLD16_HANDOVER_ENV): a float16 model folded here on a CPU
hands its folded weights to onnxruntime as OrtValues over our arrays, not inside the streamed
model bytes; onnxruntime parses the skeleton while the weights still decode and fold, and reads
them only in initialize_session. Outputs bit-identical to the folded model's, errors reported, no
thread left; without the variable the weights travel inside the model bytes as before."""
from __future__ import annotations

import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
import passes.runtime as runtime
import passes.runtime_fold as runtime_fold
from passes.errors import CorruptFileError

CPU = ["CPUExecutionProvider"]


def _float16_mlp(seed=0, layers=4, width=96):
    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) * 0.2).astype(np.float16), f"W{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]), helper.make_node("Relu", [f"h{i}"], [f"r{i}"])]
        prev = f"r{i}"
    graph = helper.make_graph(nodes, "mlp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3, width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, [3, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _q8_files(tmp_path, seed=0):
    q8 = passes.quantize_weights(_float16_mlp(seed), bits=8, min_elements=256)
    src, dst = tmp_path / "mlp16.q8.onnx", tmp_path / "mlp16.q8.onnxz"
    onnx.save(q8, str(src))
    passes.pack(str(src), str(dst))
    return q8, src, dst


def _feeds(width=96):
    return [{"x": np.random.default_rng(i).standard_normal((3, width)).astype(np.float16)} for i in range(3)]


def _assert_folded_outputs(session, q8):
    reference = ort.InferenceSession(passes.fold_dequantize(q8).SerializeToString(), providers=CPU)
    for f in _feeds():
        got, want = session.run(None, f)[0], reference.run(None, f)[0]
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def _fold_threads():
    return [t for t in threading.enumerate() if t.name == "passes-weight-fold" and t.is_alive()]


@pytest.fixture
def handover(monkeypatch):
    """The fold16 route (the one-pass kernel taken as vectorised, whatever this CPU has) with the
    switch on; records the FoldAhead objects made."""
    monkeypatch.setenv(runtime.FOLD16_HANDOVER_ENV, "1")
    monkeypatch.setattr(runtime_fold, "fold_kernel_fast", lambda: True)
    made = []

    class Recorded(runtime_fold.FoldAhead):
        def __init__(self, decode, jobs):
            made.append(len(jobs))
            super().__init__(decode, jobs)

    monkeypatch.setattr(runtime_fold, "FoldAhead", Recorded)
    return made


@pytest.mark.parametrize("packed", [True, False])
def test_folded_weights_are_handed_over_not_embedded(tmp_path, handover, packed):
    q8, src, dst = _q8_files(tmp_path)
    session = passes.InferenceSession(dst if packed else src, mode="fold")
    assert session.fold_route == "here" and session.dtype == np.float16
    assert handover == ([4] if packed else [])  # (a pack's four weights folded as they decoded)
    assert not session.embedded_names  # none inside the model bytes
    assert not session.weight_arrays  # ours dropped once onnxruntime is initialised
    assert not session.op_counts.get("DequantizeLinear")
    _assert_folded_outputs(session, q8)
    assert not _fold_threads()


def test_weights_folded_after_the_parse_are_the_ones_run(tmp_path, handover, monkeypatch):
    """The fold is held back until onnxruntime has parsed the skeleton: its session still runs
    with the folded values (onnxruntime reads handed-over values in initialize_session only)."""
    q8, _, dst = _q8_files(tmp_path, seed=1)
    parsed = threading.Event()
    original_fold = runtime_fold._dequantize

    def late_fold(*args, **kwargs):
        assert parsed.wait(timeout=10)  # (never set: the weights were waited for before the parse)
        return original_fold(*args, **kwargs)

    from onnxruntime.capi import _pybind_state as C

    original_parse = C.InferenceSession

    def parse_then_signal(*args):
        session = original_parse(*args)
        parsed.set()
        return session

    monkeypatch.setattr(runtime_fold, "_dequantize", late_fold)
    monkeypatch.setattr(C, "InferenceSession", parse_then_signal)
    start = time.perf_counter()
    session = passes.InferenceSession(dst, mode="fold")
    assert time.perf_counter() - start < 10 and parsed.is_set()
    assert handover == [4] and not session.embedded_names
    monkeypatch.setattr(C, "InferenceSession", original_parse)
    _assert_folded_outputs(session, q8)


def test_a_fold_that_fails_is_reported(tmp_path, handover, monkeypatch):
    _, _, dst = _q8_files(tmp_path, seed=2)

    def broken(*args, **kwargs):
        raise RuntimeError("fold failed on purpose")

    monkeypatch.setattr(runtime_fold, "_dequantize", broken)
    with pytest.raises(CorruptFileError, match="fold failed on purpose"):
        passes.InferenceSession(dst, mode="fold")
    assert not _fold_threads()


def test_without_the_switch_the_weights_travel_inside_the_model(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.FOLD16_HANDOVER_ENV, raising=False)
    monkeypatch.setattr(runtime_fold, "fold_kernel_fast", lambda: True)
    q8, _, dst = _q8_files(tmp_path, seed=3)
    session = passes.InferenceSession(dst, mode="fold")
    assert session.fold_route == "here" and len(session.embedded_names) == 4
    _assert_folded_outputs(session, q8)
