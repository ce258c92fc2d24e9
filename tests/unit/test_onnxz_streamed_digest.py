"""The file's XXH3-128 fed chunk by chunk inside the batch decoder (reader._Xxh3_128,
_planes.ans_decode_batch's `hashing` argument): the same digest as xxhash.xxh3_128 over the whole
file, and the same verdicts on damage, as the window-by-window hash it replaces at 1 thread."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import xxhash
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import CorruptFileError
from passes.onnxz import reader
from passes.onnxz.reader import PackedFile

pytestmark = pytest.mark.skipif(not reader._fused_xxh3_128, reason="_planes built without the streamed XXH3-128")

RNG = np.random.default_rng(5)


def test_state_matches_xxhash_for_any_split():
    data = RNG.integers(0, 256, 300_000, np.uint8).tobytes()
    for cuts in ([], [1], [7, 240, 241], [64, 1024, 1025, 4096, 65536], list(range(0, 300_000, 9_999))):
        h, pos = reader._Xxh3_128(), 0
        for end in cuts + [len(data)]:
            h.update(data[pos:end])
            pos = end
        assert h.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert reader._Xxh3_128().hexdigest() == xxhash.xxh3_128(b"").hexdigest()


@pytest.fixture(scope="module")
def multi_window(tmp_path_factory):
    """A model of ~9 MB (three restore windows) whose skeleton parts (names, a float16 Constant, an
    int64 shape) sit between its coded tensors, packed in small chunks."""
    d = tmp_path_factory.mktemp("streamed")
    inits = []
    for i in range(6):
        w = (RNG.standard_normal(350_000) * 0.05).astype(np.float32)
        q = np.clip(np.round(RNG.standard_normal(50_000) * 12), -127, 127).astype(np.int8)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(q, f"q{i}"),
                  numpy_helper.from_array(np.arange(i + 3, dtype=np.int64), f"shape{i}")]
    const = numpy_helper.from_array(RNG.standard_normal(900).astype(np.float16))
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=const)], "g", [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT16, [900])], inits))
    src = d / "m.onnx"
    src.write_bytes(m.SerializeToString())
    packed = d / "m.onnxz"
    passes.pack(src, packed, threads=1, chunk_bytes=256 << 10)
    assert src.stat().st_size > 2 * reader.WINDOW_BYTES
    return src, packed


def _spy_streamed(monkeypatch):
    calls = []
    run = PackedFile._run_hashed

    def spy(self, tasks, window, h):
        calls.append(sum(1 for fn, *_ in tasks if fn == self._decode_batch))
        return run(self, tasks, window, h)

    monkeypatch.setattr(PackedFile, "_run_hashed", spy)
    return calls


def test_restore_at_one_thread_streams_the_digest(tmp_path, multi_window, monkeypatch):
    src, packed = multi_window
    calls = _spy_streamed(monkeypatch)
    out = passes.unpack(packed, tmp_path / "r.onnx", threads=1)
    assert out.read_bytes() == src.read_bytes()
    assert len(calls) >= 3 and sum(calls) >= 3  # every window, its ans chunks batched and hashed
    model = passes.load(packed, threads=1)
    assert model.SerializeToString() == onnx.load_from_string(src.read_bytes()).SerializeToString()


def test_threads_and_sha256_keep_the_window_hash(tmp_path, multi_window, monkeypatch):
    """With a pool the digest runs on the hashing thread; sha256 and verify ("both") hash windows."""
    src, packed = multi_window
    calls = _spy_streamed(monkeypatch)
    assert passes.unpack(packed, tmp_path / "a.onnx", threads=2).read_bytes() == src.read_bytes()
    assert passes.unpack(packed, tmp_path / "b.onnx", threads=1, digest="sha256").read_bytes() == src.read_bytes()
    assert passes.verify(packed, src, threads=1).ok
    assert calls == []


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_damage_anywhere_in_a_window_fails_the_streamed_digest(tmp_path, multi_window, monkeypatch, where):
    """A byte changed after the window is filled (skeleton parts, before, between or after the
    chunks the batch decodes) fails the XXH3-128 as it did when the window was hashed whole."""
    _, packed = multi_window
    fill = PackedFile._fill

    def bad_fill(self, window, items, skel):
        tasks = fill(self, window, items, skel)
        skel_parts = [(off, ln) for off, ln, s in items if s[0] == "skel"]
        off, ln = skel_parts[{"first": 0, "middle": len(skel_parts) // 2, "last": -1}[where]]
        window[off + ln // 2] ^= 0x10
        return tasks

    monkeypatch.setattr(PackedFile, "_fill", bad_fill)
    calls = _spy_streamed(monkeypatch)
    with pytest.raises(CorruptFileError, match="does not match its xxh3_128"):
        passes.unpack(packed, tmp_path / "r.onnx", threads=1)
    assert calls and not (tmp_path / "r.onnx").exists()


def test_batch_hashing_cursor(multi_window):
    """ans_decode_batch with `hashing` returns the end of its last chunk in the window and has fed
    the window up to there; without it, None as before."""
    _, packed = multi_window
    with PackedFile(packed, threads=1) as pf:
        fe = pf.index.files[0]
        window = np.zeros(fe.size, np.uint8)
        start, n, items = next(pf._windows(0, reader.WINDOW_BYTES))
        tasks = pf._fill(window[:n], items, pf.skeleton(0))
        fn, specs = tasks[-1]
        assert fn == pf._decode_batch
        end = max(s[5].ctypes.data + s[5].size for s in specs) - window.ctypes.data
        h = reader._Xxh3_128()
        for f, *args in tasks[:-1]:
            f(*args)
        assert pf._decode_batch(specs, hashing=(h.state, window[:n], 0)) == end
        assert h.hexdigest() == xxhash.xxh3_128(window[:end]).hexdigest()
        assert pf._decode_batch(specs) is None


def test_an_extension_built_before_hashing_still_unpacks(tmp_path, multi_window, monkeypatch):
    """A tree updated without rebuilding _planes: ans_decode_batch takes three arguments and there
    is no streamed state; restoring hashes windows in Python as before (no TypeError)."""
    src, packed = multi_window
    batch = reader._decode_batch_c
    monkeypatch.setattr(reader, "_decode_batch_c", lambda source, scratch, tasks: batch(source, scratch, tasks))
    monkeypatch.setattr(reader, "_fused_xxh3_128", False)
    for threads in (1, 2):
        assert passes.unpack(packed, tmp_path / f"r{threads}.onnx", threads=threads).read_bytes() == src.read_bytes()
    assert passes.verify(packed, src).ok
