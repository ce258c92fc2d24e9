"""The codec `transpose` (format 1.3, FORMAT.md 3): a payload's rows x last-dimension matrix stored
column by column, LZ-coded, where that is smaller than every other coding (an STFT basis). Exact
round trips (one and several chunks, raw_data and float_data), its parameters checked, damage refused."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from onnxz_helpers import first_stream, rewrite_index
from passes import CorruptFileError
from passes.onnxz import codecs
from passes.onnxz.reader import PackedFile


def _basis(n=128):
    """An STFT basis as silero-vad stores it: [n + 2, 1, n], cos and sin rows times a Hann window."""
    k = np.arange(n // 2 + 1)[:, None]
    t = np.arange(n)[None, :]
    w = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)
    return np.concatenate([np.cos(2 * np.pi * k * t / n) * w, -np.sin(2 * np.pi * k * t / n) * w]).astype(np.float32)[:, None, :]


def _packed(tmp_path, inits, chunk_bytes=4 << 20, name="m"):
    src = tmp_path / f"{name}.onnx"
    src.write_bytes(helper.make_model(helper.make_graph([], "g", [], [], inits)).SerializeToString())
    dst = tmp_path / f"{name}.onnxz"
    passes.pack(src, dst, chunk_bytes=chunk_bytes, threads=1)
    return src, dst


@pytest.mark.parametrize("chunk_bytes", [4 << 20, 4096, 5000])
def test_basis_is_transposed_and_restored(tmp_path, chunk_bytes):
    b = _basis()
    inits = [numpy_helper.from_array(b, "basis"),
             helper.make_tensor("basis_fd", TensorProto.FLOAT, b.shape, (-b).ravel().tolist())]  # float_data; not b's own values: a payload equal to basis's is stored once (FORMAT.md 3.3)
    src, dst = _packed(tmp_path, inits, chunk_bytes)
    with PackedFile(dst) as pf:
        assert pf.index.version == (1, 3)
        streams = [t.stream for t in pf.index.tensors]
        assert [s.codec for s in streams] == ["transpose", "transpose"]
        # float columns (4, 128) or byte columns (1, 512): the smaller of the two, rows of 512 bytes either way
        raw = np.frombuffer(b.tobytes(), np.uint8)
        tried = {(w, c): codecs._encode_transposed(raw, w, c, chunk_bytes).stored for w, c in ((4, 128), (1, 512))}
        best = min(tried, key=lambda k: (tried[k], k != (4, 128)))  # the first tried wins a tie
        assert (streams[0].params["width"], streams[0].params["cols"]) == best
        for s in streams:
            assert all(c.raw_length % (4 * 128) == 0 for c in s.chunks)
            assert len(s.chunks) == (1 if chunk_bytes > b.nbytes else -(-b.nbytes // (chunk_bytes // 512 * 512)))
        lz = codecs._encode_lz(raw, chunk_bytes).stored
        assert streams[0].stored < lz  # chosen because it is smaller
    assert passes.unpack(dst, tmp_path / "r.onnx").read_bytes() == src.read_bytes()
    with passes.open_packed(dst) as pm:
        assert pm.get_tensor("basis").tobytes() == b.tobytes()
        assert pm.get_tensor("basis_fd").tobytes() == (-b).tobytes()
    assert passes.verify(dst).ok


@pytest.mark.parametrize("width, dtype", [(1, np.int8), (2, np.float16), (8, np.float64)])
def test_untranspose_every_width(width, dtype):
    rng = np.random.default_rng(width)
    a = rng.integers(-100, 100, (37, 11)).astype(dtype)
    plane = np.ascontiguousarray(a.view(codecs._UINT[width]).T).view(np.uint8).ravel()
    out = np.empty(a.nbytes, np.uint8)
    codecs.untranspose(plane, width, 11, out)
    assert out.tobytes() == a.tobytes()


def test_no_transpose_where_it_does_not_pay_or_cannot(tmp_path):
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "noise"),
             numpy_helper.from_array(np.tile(np.arange(300, dtype=np.float32), 8), "flat")]  # 1-D: no columns
    _, dst = _packed(tmp_path, inits)
    with PackedFile(dst) as pf:
        assert "transpose" not in {t.stream.codec for t in pf.index.tensors if t.stream is not None}
    assert codecs.transpose_cols([5], 20) is None and codecs.transpose_cols([1, 7], 28) is None
    assert codecs.transpose_cols([3, 1, 7], 84) == (4, 7) and codecs.transpose_cols([3, 7], 85) is None


@pytest.mark.parametrize("change", [
    lambda s: s["params"].update(cols=3),        # rows no longer whole
    lambda s: s["params"].update(cols=1),
    lambda s: s["params"].update(cols="128"),
    lambda s: s["params"].update(width=3),
    lambda s: s["params"].pop("width"),
    lambda s: s.update(codec="narrow", params={"from": 1, "to": 10, "inner": {"codec": "transpose", "params": s["params"]}}),
])
def test_bad_parameters_are_refused(tmp_path, change):
    _, dst = _packed(tmp_path, [numpy_helper.from_array(_basis(), "basis")])
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(rewrite_index(dst.read_bytes(), lambda o: change(first_stream(o, "transpose")), (1, 3)))
    with pytest.raises(CorruptFileError):
        with passes.open_packed(bad) as pm:
            pm.get_tensor("basis")


def test_other_columns_decode_to_other_bytes_never_silently(tmp_path):
    """A valid-looking cols (another divisor of the row count) decodes, but the restored file fails
    its digest: the whole-file check catches what the per-chunk checksum cannot."""
    src, dst = _packed(tmp_path, [numpy_helper.from_array(_basis(), "basis")])
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(rewrite_index(dst.read_bytes(), lambda o: first_stream(o, "transpose")["params"].update(cols=64), (1, 3)))
    with pytest.raises(CorruptFileError):
        passes.unpack(bad, tmp_path / "r.onnx")


def test_every_byte_flip_detected(tmp_path):
    _, dst = _packed(tmp_path, [numpy_helper.from_array(_basis(32), "basis")])
    data = dst.read_bytes()
    bad = tmp_path / "bad.onnxz"
    for pos in range(len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x41
        bad.write_bytes(damaged)
        with pytest.raises(CorruptFileError):
            passes.unpack(bad, tmp_path / "r.onnx", force=True)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 258])
@pytest.mark.parametrize("cols", [2, 3, 16, 17, 48, 1030])
def test_byte_untranspose_in_c_equals_numpy(rows, cols):
    """Width 1 goes through the extension's untranspose1 (16x16 blocks in registers, the edges by
    bytes): the same bytes as numpy's transpose, whatever the rows and columns left over."""
    if codecs._fast is None or not hasattr(codecs._fast, "untranspose1"):
        pytest.skip("extension without untranspose1")
    plane = np.random.default_rng(rows * 7919 + cols).integers(0, 256, rows * cols, dtype=np.uint8)
    out = np.empty_like(plane)
    codecs._fast.untranspose1(plane, cols, out)
    assert np.array_equal(out.reshape(rows, cols), plane.reshape(cols, rows).T)
    with pytest.raises(ValueError):
        codecs._fast.untranspose1(plane[:-1] if plane.size > 1 else plane, cols, out)


def test_byte_columns_are_taken_where_smaller_and_read_without_the_extension(tmp_path, monkeypatch):
    """A basis of 258 rows (silero-vad's shape): byte columns (width 1, 4 x the last dimension) code
    smaller than float columns there; the file restores exactly through the C untranspose and through
    numpy's (the extension's paths switched off), and says format 1.3 (width 1 was legal in 1.3).
    (LZ is forced here: the writer's LZ probe passes this synthetic basis by, silero-vad's own it takes.)"""
    b = _basis(256)
    assert b.shape == (258, 1, 256)
    raw = np.frombuffer(b.tobytes(), np.uint8)
    by_floats = codecs._encode_transposed(raw, 4, 256, 4 << 20).stored
    by_bytes = codecs._encode_transposed(raw, 1, 1024, 4 << 20).stored
    assert by_bytes < by_floats < codecs._encode_lz(raw, 4 << 20).stored
    monkeypatch.setattr(codecs, "_lz_promising", lambda *a, **k: True)
    src, dst = _packed(tmp_path, [numpy_helper.from_array(b, "basis")])
    with PackedFile(dst) as pf:
        assert pf.index.version == (1, 3)
        s = pf.index.tensors[0].stream
        assert (s.codec, s.params) == ("transpose", {"width": 1, "cols": 1024})
        assert s.stored == by_bytes
    assert passes.unpack(dst, tmp_path / "c.onnx").read_bytes() == src.read_bytes()
    monkeypatch.setattr(codecs, "_fast", None)
    with passes.open_packed(dst) as pm:
        assert pm.get_tensor("basis").tobytes() == b.tobytes()


def _int8_basis():
    return np.clip(np.round(_basis(256) * 127), -127, 127).astype(np.int8)


def test_columns_are_probed_where_rows_look_hopeless_to_lz(monkeypatch):
    """An int8 STFT basis (silero-vad's quantized one is [258, 1, 256]): by rows the LZ probe gives
    up (an entropy coding is kept), by columns it repeats: the columns are probed and `transpose`
    taken, as it saves more than TRANSPOSE_OVER_ENTROPY of the entropy coding."""
    q = _int8_basis()
    raw = np.frombuffer(q.tobytes(), np.uint8)
    assert not codecs._lz_promising(raw, codecs.encode_tensor(raw, TensorProto.INT8, "raw_data").stored / raw.size)
    monkeypatch.setattr(codecs, "_write_transpose", False)
    entropy = codecs.encode_tensor(raw, TensorProto.INT8, "raw_data", shape=list(q.shape))
    monkeypatch.setattr(codecs, "_write_transpose", True)
    got = codecs.encode_tensor(raw, TensorProto.INT8, "raw_data", shape=list(q.shape))
    assert entropy.codec != "transpose"
    assert (got.codec, got.params) == ("transpose", {"width": 1, "cols": 256})
    assert got.stored < codecs.TRANSPOSE_OVER_ENTROPY * entropy.stored
    out = np.empty_like(raw)
    codecs.decode_chunk(got.codec, got.params, [memoryview(p) for p in got.chunks[0].planes], raw.size, out)
    assert np.array_equal(out, raw)


def test_columns_replace_an_entropy_coding_only_past_the_bar(monkeypatch):
    """TRANSPOSE_OVER_ENTROPY is the share of the entropy coding `transpose` must come under (zstd's LZ
    decodes slower than ans / Huffman): at 0 never taken over it, at 1 wherever smaller."""
    q = _int8_basis()
    raw = np.frombuffer(q.tobytes(), np.uint8)
    monkeypatch.setattr(codecs, "TRANSPOSE_OVER_ENTROPY", 0.0)
    assert codecs.encode_tensor(raw, TensorProto.INT8, "raw_data", shape=list(q.shape)).codec != "transpose"
    monkeypatch.setattr(codecs, "TRANSPOSE_OVER_ENTROPY", 1.0)
    assert codecs.encode_tensor(raw, TensorProto.INT8, "raw_data", shape=list(q.shape)).codec == "transpose"
    monkeypatch.setattr(codecs, "TRANSPOSE_PROBE_BYTES", raw.size - 1)  # too large to probe: rows' verdict stands
    assert codecs.encode_tensor(raw, TensorProto.INT8, "raw_data", shape=list(q.shape)).codec != "transpose"


def test_an_int8_basis_packs_by_columns_and_restores(tmp_path):
    q = _int8_basis()
    src, dst = _packed(tmp_path, [numpy_helper.from_array(q, "basis_q")])
    with PackedFile(dst) as pf:
        assert pf.index.tensors[0].stream.codec == "transpose"
    assert passes.unpack(dst, tmp_path / "r.onnx").read_bytes() == src.read_bytes()
