"""A packed file's big weights decoded on a worker thread while the graph is walked and planned
(runtime_source.read_split(background=True), SplitModel.wait_weights)."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest

import passes
from passes.errors import CorruptFileError
from passes.runtime_source import read_split

from test_runtime import conv_model, damage_biggest_weight, dense_model, feeds_for, run

DECODE_THREAD = "passes-weight-decode"


def _decode_threads() -> list:
    return [t for t in threading.enumerate() if t.name == DECODE_THREAD and t.is_alive()]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("background")
    out = {}
    for name, build in (("dense", dense_model), ("conv", conv_model)):
        m = build()
        q8 = passes.quantize_weights(m, bits=8, min_elements=256)
        onnx.save(m, str(root / f"{name}.onnx"))
        onnx.save(q8, str(root / f"{name}.q8.onnx"))
        out[name] = {"model": m, "folded": passes.fold_dequantize(q8)}
        for key, src in (("floatz", f"{name}.onnx"), ("q8z", f"{name}.q8.onnx")):
            out[name][key] = root / f"{name}.{key}"
            passes.pack(str(root / src), str(out[name][key]))
    return out


@pytest.mark.parametrize("key", ["floatz", "q8z"])
def test_background_decode_gives_the_same_weights(packs, key):
    path = packs["dense"][key]
    want = read_split(path)
    got = read_split(path, background=True)
    assert got.pending is not None  # (the dense model's weights are big enough to be decoded aside)
    got.wait_weights()
    assert got.pending is None and not _decode_threads()
    assert sorted(got.weights) == sorted(want.weights) and want.weights
    for name, array in want.weights.items():
        assert got.weights[name].dtype == array.dtype
        np.testing.assert_array_equal(got.weights[name], array)
    assert got.skeleton.SerializeToString() == want.skeleton.SerializeToString()


@pytest.mark.parametrize("name,key,mode", [("dense", "floatz", "fold"), ("conv", "floatz", "fold"),
                                           ("dense", "q8z", "fold"), ("conv", "q8z", "fold"),
                                           ("dense", "q8z", "int8"), ("dense", "floatz", "fold:float16")])
def test_sessions_from_packs_match_the_sync_path(packs, name, key, mode):
    """Each path that reads the weights (fold, int8, a dtype conversion, or onnxruntime itself)
    sees them decoded: outputs equal to the folded / float model's."""
    mode, _, dtype = mode.partition(":")
    m = packs[name]
    feeds = feeds_for(m["model"])
    session = passes.InferenceSession(m[key], mode=mode, dtype=dtype or None)
    assert not _decode_threads()
    reference = m["folded"] if key == "q8z" else m["model"]
    plain = onnx.load_from_string(reference.SerializeToString())
    if dtype or mode == "int8":  # converted or kept quantized: close, not equal
        from test_runtime import run_plain

        for a, b in zip(run(session, feeds), run_plain(plain, feeds)):
            np.testing.assert_allclose(a[0], b[0], rtol=0.05, atol=0.05)
        return
    from test_runtime import run_plain

    for a, b in zip(run(session, feeds), run_plain(plain, feeds)):
        np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("name,key,mode", [("dense", "floatz", "fold"), ("conv", "floatz", "fold"),
                                           ("dense", "q8z", "fold"), ("dense", "q8z", "int8")])
def test_damaged_weight_decoded_aside_is_refused(packs, tmp_path, name, key, mode):
    """The worker thread's checksum failure reaches the caller as CorruptFileError, whichever
    step waits for the weights (conv float: while its weights stream to onnxruntime); no decode
    thread is left behind."""
    bad = damage_biggest_weight(packs[name][key], tmp_path / f"bad.{key}")
    with pytest.raises(CorruptFileError):
        passes.InferenceSession(bad, mode=mode)
    assert not _decode_threads()
    split = read_split(bad, background=True)
    with pytest.raises(CorruptFileError):
        split.wait_weights()
    split.wait_weights()  # (the error is reported once; waiting again returns)


def test_int8_leaves_a_batched_matmul_weight_dequantized(tmp_path):
    """MatMulNBits takes a 2-D B only: a 3-D (batched) MatMul weight is left to the other int8
    forms (it raised ValueError in _kn_params before)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((3, 64, 48)) / 8).astype(np.float32)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, 48])], [numpy_helper.from_array(w, "W")]),
        opset_imports=[helper.make_opsetid("", 17)])
    q8 = tmp_path / "b.q8.onnx"
    onnx.save(passes.quantize_weights(m, bits=8, min_elements=256), str(q8))
    session = passes.InferenceSession(q8, mode="int8")
    assert "MatMulNBits" not in session.op_counts and session.op_counts.get("MatMul") == 1
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ w, rtol=0.05, atol=0.05)


def _two_conv_model():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w1 = (rng.standard_normal((32, 16, 3, 3)) / 12).astype(np.float32)
    w2 = (rng.standard_normal((24, 32, 3, 3)) / 17).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "W2"], ["y"], pads=[1, 1, 1, 1])]
    return helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 8, 8])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")]),
        opset_imports=[helper.make_opsetid("", 17)])


def test_weights_stream_to_onnxruntime_as_they_decode(tmp_path, monkeypatch):
    """A slow decode, one tensor per batch: the writer hands onnxruntime each embedded weight as
    its batch finishes (it finds a later one not ready yet and waits for it), in decode order;
    the outputs are the float model's."""
    import time

    from passes.onnxz.reader import PackedFile
    from passes.runtime_source import BackgroundDecode

    model = _two_conv_model()
    onnx.save(model, str(tmp_path / "c.onnx"))
    passes.pack(str(tmp_path / "c.onnx"), str(tmp_path / "c.onnxz"))
    monkeypatch.setattr(BackgroundDecode, "BATCH_BYTES", 1)
    original_decode, original_ready = PackedFile.tensors_bytes, BackgroundDecode.ready
    not_ready = []

    def slow(self, entries, outs=None):
        time.sleep(0.05)
        return original_decode(self, entries, outs)

    def ready(self, array, block=True):
        answer = original_ready(self, array, block)
        if not answer:
            not_ready.append(array.nbytes)
        return answer

    monkeypatch.setattr(PackedFile, "tensors_bytes", slow)
    monkeypatch.setattr(BackgroundDecode, "ready", ready)
    session = passes.InferenceSession(tmp_path / "c.onnxz", mode="fold")
    assert session.embedded_names == {"W1", "W2"} and not_ready
    assert not _decode_threads()
    x = np.random.default_rng(0).standard_normal((1, 16, 8, 8)).astype(np.float32)
    plain = onnx.load_from_string(model.SerializeToString())
    from test_runtime import run_plain

    np.testing.assert_array_equal(session.run(None, {"x": x})[0], run_plain(plain, [{"x": x}])[0][0])


@pytest.mark.parametrize("key", ["floatz", "q8z"])
def test_graph_bytes_are_restored_before_the_weights_start_decoding(packs, key, monkeypatch):
    """start_read restores the model file's graph bytes before the big payloads decode aside: the
    restore's tasks share the reader's pool with that decode, and waited behind a whole batch of
    it when the decode went first (runtime_source.PackedRead)."""
    import passes.runtime_source as source
    from passes.runtime_source import start_read

    events = []
    original_restore, original_start = source._restored_model_file, source.BackgroundDecode.__init__

    def restore(*args, **kwargs):
        events.append("restore")
        return original_restore(*args, **kwargs)

    def start(self, *args, **kwargs):
        events.append("decode")
        return original_start(self, *args, **kwargs)

    monkeypatch.setattr(source, "_restored_model_file", restore)
    monkeypatch.setattr(source.BackgroundDecode, "__init__", start)
    reading = start_read(packs["dense"][key], background=True)
    split = reading.finish()
    split.wait_weights()
    assert events == ["restore", "decode"]
    synchronous = read_split(packs["dense"][key])
    assert sorted(split.weights) == sorted(synchronous.weights)
    for name, array in synchronous.weights.items():
        np.testing.assert_array_equal(split.weights[name], array)
    assert not _decode_threads()
