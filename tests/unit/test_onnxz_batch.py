"""The reader's batch decoder (_planes.ans_decode_batch: many `ans` chunks read, checked with
XXH3-64 and decoded in one C call) against the per-chunk path: same bytes, same refusals."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from onnx import helper, numpy_helper

import passes
from passes import CorruptFileError
from passes.onnxz import reader

pytestmark = pytest.mark.skipif(reader._decode_batch_c is None, reason="batch decoder not available (extension or xxhash symbol)")


def test_c_xxh3_is_the_xxhash_digest_at_every_size_class():
    from passes.onnxz import _planes

    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 300000, np.uint8).tobytes()
    for n in list(range(0, 300)) + [1023, 1024, 1025, 65536, 65537, 299999, 300000]:
        assert _planes.xxh3(data[:n]) == xxhash.xxh3_64_intdigest(data[:n]), n


def _model_file(tmp_path):
    rng = np.random.default_rng(2)
    big = (rng.standard_normal(700000) * np.exp2(rng.integers(-4, 4, 700000))).astype(np.float32)  # 3 chunks
    inits = [numpy_helper.from_array(big, "big"),
             numpy_helper.from_array(rng.standard_normal((64, 50)).astype(np.float32), "small_f32"),
             numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 6, 400000)), -127, 127).astype(np.int8), "i8"),
             numpy_helper.from_array(rng.standard_normal(9000).astype(np.float16), "f16"),
             numpy_helper.from_array(np.zeros(5000, np.float32), "zeros")]
    src = tmp_path / "m.onnx"
    src.write_bytes(helper.make_model(helper.make_graph([], "g", [], [], inits)).SerializeToString())
    dst = tmp_path / "m.onnxz"
    passes.pack(src, dst, threads=1)
    return src, dst


def _all_payloads(source, threads, codec="ans"):
    with reader.PackedFile(source, threads=threads) as pf:
        entries = [t for t in pf.index.tensors if t.stream is not None]
        assert sum(t.stream.codec == codec for t in entries) >= 1
        return [bytes(b) for b in pf.tensors_bytes(entries)], bytes(pf.restore_file(0))


def test_batch_and_per_chunk_paths_give_the_same_bytes(tmp_path, monkeypatch):
    src, packed = _model_file(tmp_path)
    data = packed.read_bytes()
    results = []
    for batch in (True, False):
        monkeypatch.setattr(reader, "_decode_batch_c", reader._batch_decoder() if batch else None)
        for source in (packed, data):
            for threads in (1, 2):
                results.append(_all_payloads(source, threads))
    assert all(r == results[0] for r in results)
    assert results[0][1] == src.read_bytes()


def _verdict(source, threads):
    try:
        return _all_payloads(source, threads)
    except CorruptFileError as exc:
        return type(exc).__name__, str(exc)


def test_damaged_data_gets_the_same_refusal_on_both_paths(tmp_path, monkeypatch):
    _, packed = _model_file(tmp_path)
    data = packed.read_bytes()
    with reader.PackedFile(data) as pf:
        chunks = [c for t in pf.index.tensors if t.stream is not None for c in t.stream.chunks]
    rng = np.random.default_rng(3)
    positions = set()
    for c in chunks:  # the first and last stored byte of each chunk and a few inside
        stored = sum(c.planes)
        positions |= {c.offset, c.offset + stored - 1} | {c.offset + int(k) for k in rng.integers(0, stored, 3)}
    for pos in sorted(positions):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        verdicts = set()
        for batch in (True, False):
            monkeypatch.setattr(reader, "_decode_batch_c", reader._batch_decoder() if batch else None)
            verdicts.add(_verdict(bytes(bad), 2))
        assert len(verdicts) == 1, pos
        (v,) = verdicts
        assert v[0] == "CorruptFileError" and "checksum" in v[1], (pos, v)


def test_batch_call_reports_each_failure(tmp_path):
    from passes.onnxz import _planes

    _, packed = _model_file(tmp_path)
    data = packed.read_bytes()
    with reader.PackedFile(data) as pf:
        stream = next(t.stream for t in pf.index.tensors if t.stream is not None and t.stream.codec == "ans")
        chunk = stream.chunks[0]
        spec = pf._spec(stream, chunk)[:5]  # no shared tables: codec ans
    out = np.empty(chunk.raw_length, np.uint8)
    assert _planes.ans_decode_batch(data, None, [spec + (out,)]) is None
    wrong = spec[:3] + (spec[3] ^ 1,) + spec[4:]
    assert _planes.ans_decode_batch(data, None, [spec + (out,), wrong + (out,)])[:2] == (1, 0)  # checksum
    past = (len(data) - 2,) + spec[1:]
    assert _planes.ans_decode_batch(data, None, [past + (out,)])[:2] == (0, 2)  # runs past the end
    fd = os.open(packed, os.O_RDONLY)
    try:
        scratch = np.empty(spec[1], np.uint8)
        assert _planes.ans_decode_batch(fd, scratch, [spec + (out,)]) is None
        assert _planes.ans_decode_batch(fd, scratch, [past + (out,)])[:2] == (0, 2)
        with pytest.raises(ValueError):
            _planes.ans_decode_batch(fd, scratch[:10], [spec + (out,)])
    finally:
        os.close(fd)
    with pytest.raises(ValueError):  # plane sizes not adding up to the stored size
        _planes.ans_decode_batch(data, None, [(spec[0], spec[1] + 1) + spec[2:] + (out,)])


def test_unpack_without_the_sha256_still_refuses_damaged_chunks(tmp_path):
    src, packed = _model_file(tmp_path)
    out = passes.unpack(packed, tmp_path / "a.onnx", threads=2, check_sha256=False)
    assert out.read_bytes() == src.read_bytes()
    data = bytearray(packed.read_bytes())
    with reader.PackedFile(bytes(data)) as pf:
        c = next(t.stream for t in pf.index.tensors if t.stream is not None).chunks[0]
    data[c.offset + 5] ^= 1
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(bytes(data))
    for threads in (1, 2):
        with pytest.raises(CorruptFileError, match="checksum"):
            passes.unpack(bad, tmp_path / f"b{threads}.onnx", threads=threads, check_sha256=False)
        assert not (tmp_path / f"b{threads}.onnx").exists()


@pytest.mark.parametrize("n, kind", [(256, "narrow"), (256, "mid"), (300, "wide"), (1000, "mid"), (5000, "narrow"), (4096, "constant")])
def test_ans_decode_shared_matches_the_numpy_path(n, kind):
    """`ans_shared` planes (blobs without their table, FORMAT.md 3.2) decoded by the C entry and
    by table re-insertion + the numpy decoder: the same bytes or both refused, also when the
    table makes the whole blob as long as the plane or longer."""
    from passes.onnxz import _planes, ans

    rng = np.random.default_rng(n)
    w = 4
    planes, tables, blobs = [], [], []
    for i in range(w):
        if kind == "constant" and i == 1:
            sym = np.full(n, 7, np.uint8)
        elif kind == "wide":
            sym = rng.integers(0, 256, n).astype(np.uint8)
        elif kind == "mid":  # ~6.5 bits: the short blob fits in n, the blob with its table does not
            sym = np.clip(np.round(rng.laplace(0, 20, n)), -127, 127).astype(np.int8).view(np.uint8)
        else:
            sym = np.clip(np.round(rng.laplace(0, 3, n)), -20, 20).astype(np.int8).view(np.uint8)
        planes.append(sym)
        counts = np.bincount(sym, minlength=256)
        if (counts > 0).sum() < 2:  # a constant plane: byte 0 = 0 and the symbol
            blobs.append(bytes([0, int(sym[0])]))
            tables.append(b"\x00")
            continue
        freq = ans.normalise(counts)
        blobs.append(ans.encode_shared(sym, freq, 2))
        tables.append(ans.write_table(freq))
    expected = np.stack(planes)  # plane i = byte (w-1-i) of each element, no sign move
    want = np.ascontiguousarray(expected[::-1].T).ravel()
    out = np.empty(n * w, np.uint8)
    fed = [b if len(b) < n else planes[i].tobytes() for i, b in enumerate(blobs)]  # a blob >= n is stored raw
    if kind == "mid" and n == 256:
        assert any(len(b) < n <= len(b) + len(t) for b, t in zip(fed, tables))
    assert _planes.ans_decode_shared(fed, tables, False, out) is None
    assert out.tobytes() == want.tobytes()
    rng2 = np.random.default_rng(1)
    for i, b in enumerate(fed):  # damage: both paths agree (refused or the same bytes)
        if len(b) == n or len(b) < 3:
            continue
        for pos in rng2.integers(0, len(b), 6).tolist():
            bad = bytearray(b)
            bad[pos] ^= 0x55
            planes_bad = list(fed)
            planes_bad[i] = bytes(bad)
            c_out = np.zeros(n * w, np.uint8)
            c_err = _planes.ans_decode_shared(planes_bad, tables, False, c_out)
            whole = ans.with_table(bytes(bad), tables[i])
            try:
                ref = np.empty(n, np.uint8)
                ans.decode_numpy(whole, n, ref)
                py_ok = True
            except ans.Damaged:
                py_ok = False
            assert (c_err is None) == py_ok, (i, pos, c_err)
            if py_ok:
                assert c_out.reshape(n, w)[:, w - 1 - i].tobytes() == ref.tobytes()


GOLDEN_SHARED = sorted((Path(__file__).resolve().parents[1] / "golden" / "v1.2").glob("ans-shared-*.onnxz"))


@pytest.mark.skipif(not GOLDEN_SHARED, reason="no v1.2 golden files")
@pytest.mark.parametrize("path", GOLDEN_SHARED, ids=lambda p: p.stem)
def test_ans_shared_chunks_batch_like_one_by_one(path, monkeypatch):
    """`ans_shared` chunks (blobs whose table is shared in the index) go through the batch decoder
    too: the same payloads and file as the per-chunk path (codecs.decode_chunk), and a flipped
    stored byte is refused by both."""
    data = path.read_bytes()
    results = {}
    for batch in (True, False):
        monkeypatch.setattr(reader, "_decode_batch_c", reader._batch_decoder() if batch else None)
        results[batch] = [_all_payloads(data, threads, "ans_shared") for threads in (1, 2)]
    assert results[True] == results[False]
    with reader.PackedFile(data) as pf:
        stream = next(t.stream for t in pf.index.tensors if t.stream is not None and t.stream.codec == "ans_shared")
        assert pf._spec(stream, stream.chunks[0])[5] is not None
        c = stream.chunks[0]
    bad = bytearray(data)
    bad[c.offset + sum(c.planes) - 1] ^= 0x10
    for batch in (True, False):
        monkeypatch.setattr(reader, "_decode_batch_c", reader._batch_decoder() if batch else None)
        with pytest.raises(CorruptFileError, match="checksum"):
            _all_payloads(bytes(bad), 1, "ans_shared")
