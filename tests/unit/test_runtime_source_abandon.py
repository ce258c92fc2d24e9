"""runtime_source.PackedRead(background=True): a load that fails while the big weights decode
aside stops that decode at the next batch instead of decoding the whole model first."""
from __future__ import annotations

import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import runtime_source
from passes.errors import CorruptFileError
from passes.onnxz.reader import PackedFile

DECODE_THREAD = "passes-weight-decode"


def _many_weights_model(n=8, size=64):
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(n):
        w = rng.standard_normal((size, size)).astype(np.float32)  # 16 KiB: decoded aside
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, size])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def slow_pack(tmp_path, monkeypatch):
    """A pack of 8 weights decoded aside one per batch, each batch slowed down: (path, batch sizes
    decoded so far, an event set when the first batch starts)."""
    src, packed = tmp_path / "m.onnx", tmp_path / "m.onnxz"
    onnx.save(_many_weights_model(), str(src))
    passes.pack(str(src), str(packed))
    monkeypatch.setattr(runtime_source.BackgroundDecode, "BATCH_BYTES", 1)  # one tensor a batch
    decoded, first = [], threading.Event()
    original = PackedFile.tensors_bytes

    def slow_tensors_bytes(self, entries, outs=None):
        if threading.current_thread().name == DECODE_THREAD:
            decoded.append(len(entries))
            first.set()
            time.sleep(0.05)
        return original(self, entries, outs)

    monkeypatch.setattr(PackedFile, "tensors_bytes", slow_tensors_bytes)
    return packed, decoded, first


def test_failed_load_stops_the_background_decode(slow_pack, monkeypatch):
    packed, decoded, first = slow_pack

    def failing_skeleton(pf, name, big, *restored):
        first.wait(5)  # the decode has started
        raise CorruptFileError("damaged .onnxz file: its model does not parse (test)")

    monkeypatch.setattr(runtime_source, "_packed_skeleton", failing_skeleton)
    with pytest.raises(CorruptFileError, match="does not parse"):
        runtime_source.read_split(packed, background=True)
    assert not [t for t in threading.enumerate() if t.name == DECODE_THREAD and t.is_alive()]
    assert 1 <= len(decoded) < 8  # the batch in progress finished, the rest were skipped


def test_failed_session_load_stops_the_background_decode(slow_pack, monkeypatch):
    from passes import runtime_fold
    from passes.errors import InvalidModelError

    packed, decoded, first = slow_pack

    def failing_walk(split, table=None):
        first.wait(5)
        raise InvalidModelError("test: the rewrite failed")

    monkeypatch.setattr(runtime_fold, "fold_facts", failing_walk)
    with pytest.raises(InvalidModelError, match="rewrite failed"):
        passes.InferenceSession(packed)
    assert not [t for t in threading.enumerate() if t.name == DECODE_THREAD and t.is_alive()]
    assert 1 <= len(decoded) < 8
