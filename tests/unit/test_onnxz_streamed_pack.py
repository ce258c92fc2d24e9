"""pack() writes a large payload's chunks to the output as they are encoded (writer._Spill)
instead of holding its whole encoding: the same file byte for byte, whichever candidate
encoding wins (the first, written straight out, or a later LZ try held in memory), and the
encoding of a large payload is no longer in memory beside its source."""
from __future__ import annotations

import hashlib
import os
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes.onnxz import codecs, writer


def _model(path, arrays, external: bool):
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in arrays]
    outs = [helper.make_tensor_value_info(f"{name}_out", TensorProto.UNDEFINED, None) for name in arrays]
    g = helper.make_graph(nodes, "g", [], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    if external:
        onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="w.data", size_threshold=0)
    else:
        onnx.save_model(m, path)
    return path


def _arrays():
    rng = np.random.default_rng(5)
    rows = np.linspace(-1, 1, 96, dtype=np.float32)
    return {
        "noise": (rng.standard_normal((300, 700)) * 0.05).astype(np.float32),  # ans, written out
        # float32 holding float16 values: `narrow`, its inner chunks' raw lengths rescaled
        "halves": rng.standard_normal((200, 300)).astype(np.float16).astype(np.float32),
        # rows repeating: the LZ tries run and a later candidate (held in a list) wins
        "repeats": np.tile(rows, (700, 1)),
        "int8": rng.integers(-8, 8, (500, 333)).astype(np.int8),
        "int64": np.arange(40000, dtype=np.int64) % 97,
        "small": rng.standard_normal(600).astype(np.float32),  # shared tables where they pay
        "small2": rng.standard_normal(700).astype(np.float32),
    }


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("external", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 65536])
def test_payloads_written_as_they_are_encoded_give_the_same_file(tmp_path, monkeypatch, external, chunk_bytes):
    src = _model(str(tmp_path / "m.onnx"), _arrays(), external)
    shas = []
    for i, limit in enumerate((1 << 62, 1024, 1)):
        monkeypatch.setattr(writer, "STREAM_MIN_BYTES", limit)
        out = tmp_path / f"p{i}.onnxz"
        passes.onnxz.pack(src, out, threads=2, chunk_bytes=chunk_bytes)
        shas.append(_sha(out))
    assert shas[1] == shas[0] and shas[2] == shas[0]
    restored = tmp_path / "u"
    restored.mkdir()
    passes.onnxz.unpack(tmp_path / "p2.onnxz", restored / "m.onnx")
    assert _sha(restored / "m.onnx") == _sha(src)
    if external:
        assert _sha(restored / "w.data") == _sha(tmp_path / "w.data")


def test_every_kind_of_winner_goes_through_the_spill(tmp_path, monkeypatch):
    """The cases the test above relies on: the written-out first candidate wins (noise), a
    later candidate held in memory wins (repeats: the first one encoded is `ans`), and a
    narrow encoding is spilled."""
    src = _model(str(tmp_path / "m.onnx"), _arrays(), False)
    monkeypatch.setattr(writer, "STREAM_MIN_BYTES", 1024)
    finished = []
    real_finish = writer._Spill.finish

    def finish(self, winner):
        finished.append(("first" if winner is self.first else "later", type(winner).__name__))
        return real_finish(self, winner)

    monkeypatch.setattr(writer._Spill, "finish", finish)
    passes.onnxz.pack(src, tmp_path / "p.onnxz", threads=1)
    assert ("first", "_Region") in finished and ("later", "list") in finished
    with passes.onnxz.PackedFile(tmp_path / "p.onnxz") as pf:
        codecs_used = {t.name: t.stream.codec for t in pf.index.tensors if t.stream is not None}
    assert codecs_used["halves"] == "narrow" and codecs_used["repeats"] != "ans"


def test_a_large_payloads_encoding_is_not_held_beside_its_source(tmp_path, monkeypatch):
    """Traced peak of pack() over a model of one 24 MB float32 payload: the old way held the
    whole encoding (~1x: raw planes are views of their chunk's split planes) beside the source."""
    rng = np.random.default_rng(1)
    payload = (rng.standard_normal((6000, 1000)) * 0.05).astype(np.float32)
    src = _model(str(tmp_path / "m.onnx"), {"w": payload}, True)
    peaks = {}
    for label, limit in (("held", 1 << 62), ("streamed", 1 << 20)):
        monkeypatch.setattr(writer, "STREAM_MIN_BYTES", limit)
        tracemalloc.start()
        try:
            passes.onnxz.pack(src, tmp_path / f"{label}.onnxz", threads=2)
            peaks[label] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert _sha(tmp_path / "held.onnxz") == _sha(tmp_path / "streamed.onnxz")
    size = payload.nbytes
    assert peaks["held"] > 1.7 * size  # the payload and its encoding
    # the payload, the digests' read block and a few chunks
    assert peaks["streamed"] < size + writer.DIGEST_BLOCK + (6 << 20)


def test_an_external_data_file_is_read_payload_by_payload(tmp_path, monkeypatch):
    """Its payloads are read as their jobs come (within the look-ahead), not the file whole."""
    rng = np.random.default_rng(2)
    arrays = {f"w{i}": (rng.standard_normal((1000, 1000)) * 0.05).astype(np.float32) for i in range(12)}
    src = _model(str(tmp_path / "m.onnx"), arrays, True)
    data_bytes = (tmp_path / "w.data").stat().st_size
    monkeypatch.setattr(writer, "LOOKAHEAD_BYTES", 4 << 20)
    tracemalloc.start()
    try:
        passes.onnxz.pack(src, tmp_path / "p.onnxz", threads=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.6 * data_bytes
    (tmp_path / "u").mkdir()
    passes.onnxz.unpack(tmp_path / "p.onnxz", tmp_path / "u" / "m.onnx")
    assert _sha(tmp_path / "u" / "w.data") == _sha(tmp_path / "w.data")


@pytest.mark.parametrize("how", ["appended", "truncated"])
def test_a_data_file_changed_while_packed_is_refused(tmp_path, monkeypatch, how):
    src = _model(str(tmp_path / "m.onnx"), _arrays(), True)
    data = tmp_path / "w.data"
    real = codecs.encode_tensor
    changed = []

    def encode_tensor(*args, **kwargs):
        if not changed:
            changed.append(True)
            if how == "appended":
                with open(data, "ab") as f:
                    f.write(b"\0" * 16)
            else:
                os.truncate(data, 1000)
        return real(*args, **kwargs)

    monkeypatch.setattr(codecs, "encode_tensor", encode_tensor)
    with pytest.raises(passes.errors.FileAccessError, match="changed while it was packed"):
        passes.onnxz.pack(src, tmp_path / "p.onnxz", threads=1)
    assert not (tmp_path / "p.onnxz").exists()
