"""The batch decoder pairs 32-lane one-plane chunks across the whole batch (_ans.c
decode_batch_paired), not only chunks that follow each other: a small model's batch interleaves them
with 4-lane and 1-lane chunks. The same bytes as decoding each chunk alone, from memory and from a
file (a span larger than the scratch: the in-order loop), the same window digest when hashing, and
the same refusal (chunk, code, message) as decoding in turn when any chunk is damaged."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from passes.onnxz import ans, reader

pytestmark = pytest.mark.skipif(reader._decode_batch_c is None, reason="batch decoder not available (extension or xxhash symbol)")

# (symbols, lanes as ans.encode's exponent): 32-lane chunks (5) between 4-lane (2) and 1-lane (0) ones
LAYOUT = [(20000, 5), (12288, 2), (24576, 5), (65536, 5), (512, 0), (40000, 5), (700, 0), (3000, 2), (49536, 5),
          (16411, 5), (512, 0)]


def _chunks(seed: int = 3):
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, lanes) in enumerate(LAYOUT):
        scale = (3, 20, 60)[i % 3] if n > 1000 else 2  # (small planes: coded shorter than raw)
        data = np.clip(np.round(rng.laplace(0, scale, n)), -127, 127).astype(np.int8).view(np.uint8)
        out.append((data, ans.encode(data, lanes)))
    return out


def _batch(blobs, window):
    """The blobs back to back after 64 bytes, and their tasks decoding into consecutive slices of window."""
    data, tasks, pos = bytearray(64), [], 0
    for blob, n in zip(blobs, (n for n, _ in LAYOUT)):
        tasks.append((len(data), len(blob), (len(blob),), xxhash.xxh3_64_intdigest(blob), 0, window[pos:pos + n]))
        data += blob
        pos += n
    return bytes(data), tasks


def _size():
    return sum(n for n, _ in LAYOUT)


def test_lane_counts_are_interleaved():
    assert [blob[0] for _, blob in _chunks()] == [6, 3, 6, 6, 1, 6, 1, 3, 6, 6, 1]


def test_paired_across_the_batch_gives_the_bytes_of_each_chunk_alone(tmp_path):
    chunks = _chunks()
    want = np.concatenate([d for d, _ in chunks])
    window = np.full(_size(), 0xAA, np.uint8)
    data, tasks = _batch([b for _, b in chunks], window)
    assert reader._decode_batch_c(data, None, tasks) is None
    assert np.array_equal(window, want)
    path = tmp_path / "chunks.bin"
    path.write_bytes(data)
    for scratch in (reader.SPAN_READ, reader.READ_RUN):  # the span fits (one pread) / does not (in order)
        window[:] = 0
        with open(path, "rb") as f:
            assert reader._decode_batch_c(f.fileno(), np.empty(scratch, np.uint8), tasks) is None
        assert np.array_equal(window, want), scratch


@pytest.mark.skipif(not reader._fused_xxh3_128, reason="streaming XXH3-128 not available")
def test_the_window_digest_is_that_of_its_bytes():
    chunks = _chunks(4)
    window = np.zeros(_size() + 100, np.uint8)
    window[-100:] = 7  # bytes after the last chunk: the caller hashes them
    data, tasks = _batch([b for _, b in chunks], window)
    h = reader._Xxh3_128()
    cursor = reader._decode_batch_c(data, None, tasks, (h.state, window, 0))
    assert cursor == _size()
    h.update(window[cursor:])
    assert h.hexdigest() == xxhash.xxh3_128(window.tobytes()).hexdigest()


def _first_refusal_one_by_one(data, tasks):
    for i, t in enumerate(tasks):
        got = reader._decode_batch_c(data, None, [t[:5] + (np.empty(t[5].size, np.uint8),)])
        if got is not None:
            return (i,) + tuple(got[1:])
    return None


@pytest.mark.parametrize("how", ["words", "table", "end", "checksum"])
def test_a_damaged_chunk_anywhere_is_refused_as_in_turn(how, tmp_path):
    chunks = _chunks(8)
    for victim in range(len(chunks)):
        blobs = [bytearray(b) for _, b in chunks]
        b = blobs[victim]
        if how == "words":
            b[len(b) // 2] ^= 0x5A
        elif how == "table":
            b[1] ^= 0x21
        elif how == "end":
            del b[-2:]
        window = np.zeros(_size(), np.uint8)
        data, tasks = _batch([bytes(x) for x in blobs], window)
        if how == "checksum":
            tasks[victim] = tasks[victim][:3] + (tasks[victim][3] ^ 1,) + tasks[victim][4:]
        want = _first_refusal_one_by_one(data, tasks)
        got = reader._decode_batch_c(data, None, tasks)
        assert (None if got is None else tuple(got)) == want, (how, victim)
        if how == "checksum":  # the chunks before it are decoded, as in turn
            assert want[:2] == (victim, 0)
            pos = sum(n for n, _ in LAYOUT[:victim])
            assert np.array_equal(window[:pos], np.concatenate([d for d, _ in chunks[:victim]] or [np.zeros(0, np.uint8)]))
        path = tmp_path / "damaged.bin"
        path.write_bytes(data)
        with open(path, "rb") as f:
            got = reader._decode_batch_c(f.fileno(), np.empty(reader.SPAN_READ, np.uint8), tasks)
        assert (None if got is None else tuple(got)) == want, (how, victim, "file")


def test_a_file_in_one_window_restores_as_in_windows(tmp_path, monkeypatch):
    """reader._whole_file_tasks (a file that fits one window, one thread) makes the bytes the
    windowed path (_windows / _fill / _tasks) makes, and is the path taken."""
    import passes

    rng = np.random.default_rng(2)
    import onnx
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(np.clip(np.round(rng.laplace(0, s, n)), -127, 127).astype(np.int8), f"w{i}")
             for i, (n, s) in enumerate([(20000, 3), (12288, 20), (24576, 60), (600, 2), (40000, 20)])]
    inits.append(numpy_helper.from_array(rng.standard_normal(3000).astype(np.float32), "f"))
    graph = helper.make_graph([helper.make_node("Identity", ["f"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3000])], inits)
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), src)
    packed = tmp_path / "m.onnxz"
    passes.pack(src, packed)
    calls = []
    whole = reader.PackedFile._whole_file_tasks
    monkeypatch.setattr(reader.PackedFile, "_whole_file_tasks", lambda *a: calls.append(1) or whole(*a))
    passes.unpack(packed, tmp_path / "one.onnx", threads=1)
    assert calls == [1]
    assert (tmp_path / "one.onnx").read_bytes() == src.read_bytes()
    monkeypatch.setattr(reader, "WINDOW_BYTES", src.stat().st_size // 3)  # three windows: the windowed path
    passes.unpack(packed, tmp_path / "three.onnx", threads=1)
    assert calls == [1]
    assert (tmp_path / "three.onnx").read_bytes() == src.read_bytes()
