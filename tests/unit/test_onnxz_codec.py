"""The `ans` codec of `.onnxz` 1.1 (FORMAT.md 3.1): the C coder and its numpy mirror give the same
bytes; every decoder (AVX-512, AVX2, scalar, numpy) gives the same tensor or the same verdict on
damaged bytes; the writer picks it where it is not larger; packing is deterministic with and
without the extension."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import passes
from passes import CorruptFileError
from passes.onnxz import ans, codecs

RNG = np.random.default_rng(11)
C = codecs._fast
needs_c = pytest.mark.skipif(C is None, reason="the C extension passes.onnxz._planes is not built")


@contextlib.contextmanager
def without_c():
    """codecs and ans as they run when the extensions were not built."""
    saved = codecs._fast, codecs._enc, ans._enc
    codecs._fast = codecs._enc = ans._enc = None
    try:
        yield
    finally:
        codecs._fast, codecs._enc, ans._enc = saved


@contextlib.contextmanager
def simd(level: int):
    before = C.ans_simd()
    C.ans_simd(level)
    try:
        yield C.ans_simd()
    finally:
        C.ans_simd(before)


def _symbols(kind: str, n: int) -> np.ndarray:
    if kind == "laplace":
        return np.clip(np.round(RNG.laplace(0, 8, n)), -127, 127).astype(np.int8).view(np.uint8)
    if kind == "ternary":
        return RNG.choice(np.array([255, 0, 1], np.uint8), n, p=[0.1, 0.8, 0.1])
    if kind == "uniform":
        return RNG.integers(0, 256, n).astype(np.uint8)
    if kind == "two":  # one dominant symbol: frequencies at the 4095 edge
        out = np.zeros(n, np.uint8)
        out[RNG.integers(0, n, max(1, n // 5000))] = 9
        return out
    return np.full(n, 42, np.uint8)  # constant


KINDS = ("laplace", "ternary", "uniform", "two", "constant")


def _levels():
    return [lv for lv in (0, 1, 2) if C is not None and lv <= C.ans_simd()] if C is not None else []


# ------------------------------------------------------------------ the coder itself

@pytest.mark.skipif(ans._enc is None, reason="the C extension passes.onnxz._encode is not built")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 1000, 4097, 70001, 140000])
def test_c_and_numpy_encoders_write_the_same_blob(kind, n):
    sym = _symbols(kind, n)
    for lanes_log2 in sorted({0, 2, 5, 6, 7, ans.lanes_log2_for(n)}):
        assert ans.encode(sym, lanes_log2) == ans.encode_numpy(sym, lanes_log2), lanes_log2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 65, 4097, 70001, 140000, 270001])
def test_every_decoder_restores_the_plane(kind, n):
    sym = _symbols(kind, n)
    blob = ans.encode(sym)
    if len(blob) >= n:  # the writer stores such a plane raw: only noise or a handful of symbols
        assert kind == "uniform" or n <= 65, (kind, n, len(blob))
        return
    want = sym.tobytes()
    out = np.empty(n, np.uint8)
    if n <= 5000:  # the numpy decoder is slow (~3 MB/s)
        ans.decode_numpy(blob, n, out)
        assert out.tobytes() == want
    for lv in _levels():
        with simd(lv):
            out[:] = 0
            assert C.ans_decode([blob], False, False, out) is None
            assert out.tobytes() == want, lv


def test_frequencies_sum_to_4096_and_keep_every_symbol():
    for kind in KINDS[:4]:
        counts = np.bincount(_symbols(kind, 100000), minlength=256)
        f = ans.normalise(counts)
        assert f.sum() == 4096 and np.all((f > 0) == (counts > 0)) and f.max() <= 4095


def test_ans_codes_close_to_order0():
    sym = _symbols("ternary", 1 << 20)
    p = np.bincount(sym, minlength=256) / sym.size
    h = -(p[p > 0] * np.log2(p[p > 0])).sum() * sym.size / 8
    assert len(ans.encode(sym)) < 1.006 * h  # 0.92 bits/symbol: the 512 bytes of 128 lane states are 0.4%


# ------------------------------------------------------------------ chunks through decode_chunk

def _chunk_cases():
    f32 = (RNG.standard_normal(30000) * np.exp2(RNG.integers(-3, 3, 30000))).astype(np.float32)
    wide = (RNG.standard_normal(3001) * np.exp2(RNG.integers(-30, 30, 3001))).astype(np.float32)  # escapes, odd n
    return {
        "int8": (_symbols("laplace", 20000), 1, codecs.ANS_INT),
        "int16": (RNG.integers(-300, 300, 5000).astype(np.int16).view(np.uint8), 2, codecs.ANS_INT),
        "float32": (f32.view(np.uint8), 4, codecs.ANS_FLOAT),
        "float32-pairs": (f32.view(np.uint8), 4, codecs.ANS_PAIRS),
        "float32-pairs-escapes-odd": (wide.view(np.uint8), 4, codecs.ANS_PAIRS),
        "float16": (RNG.standard_normal(9001).astype(np.float16).view(np.uint8), 2, codecs.ANS_FLOAT),
        "bfloat16-pairs": ((RNG.standard_normal(5001).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
                           2, codecs.ANS_PAIRS),
        "float64": ((RNG.standard_normal(3000) * 1e-3).view(np.uint8), 8, codecs.ANS_FLOAT),
        "float32-constant-plane": ((f32[:5000].view(np.uint32) & 0xFFFFFF00).view(np.uint8), 4, codecs.ANS_FLOAT),
    }


CASES = _chunk_cases()


def _decode(stream, total: int) -> np.ndarray:
    out = np.empty(total, np.uint8)
    pos = 0
    for c in stream.chunks:
        codecs.decode_chunk(stream.codec, stream.params, [memoryview(bytes(p)) for p in c.planes], c.raw_length,
                            out[pos:pos + c.raw_length])
        pos += c.raw_length
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunks_decode_the_same_on_every_path(name):
    data, width, variant = CASES[name]
    stream = codecs._encode_planes(data, "ans", width, 16384, variant)
    assert stream.codec == "ans" and stream.params["width"] == width
    for lv in _levels():
        with simd(lv):
            assert _decode(stream, data.size).tobytes() == data.tobytes(), lv
    with without_c():
        if data.size <= 20000:  # the numpy encoder is slow: same blobs as the C one
            again = codecs._encode_planes(data, "ans", width, 16384, variant)
            assert [[bytes(p) for p in c.planes] for c in again.chunks] == [[bytes(p) for p in c.planes] for c in stream.chunks]
        assert _decode(stream, data.size).tobytes() == data.tobytes()


def _verdict(stream, total):
    try:
        return _decode(stream, total).tobytes()
    except CorruptFileError:
        return "corrupt"


@pytest.mark.parametrize("name, elements", [("int8", 4096), ("float32", 4096), ("float32-pairs-escapes-odd", 4096),
                                            ("float16", 4096), ("int8-128-lanes", 300000), ("float32", 70000)])
def test_damaged_chunks_get_the_same_verdict_everywhere(name, elements):
    """Byte flips and truncations of every plane: never a crash; the C decoders (each SIMD level,
    4 lanes and the SIMD lane counts) and the numpy one agree on the result (CorruptFileError, or
    the same bytes)."""
    if name == "int8-128-lanes":
        data, width, variant = _symbols("laplace", elements), 1, codecs.ANS_INT
    else:
        data, width, variant = CASES[name]
    data = data[: elements * width]
    stream = codecs._encode_planes(data, "ans", width, 1 << 20, variant)
    (chunk,) = stream.chunks
    rng = np.random.default_rng(5)
    mutants = []
    for i, plane in enumerate(chunk.planes):
        b = bytes(plane)
        if not b:
            continue
        for pos in sorted(set(rng.integers(0, len(b), 12).tolist()) | {0, 1, len(b) - 1}):
            for mask in (0x01, 0x80, 0xFF):
                m = bytearray(b)
                m[pos] ^= mask
                mutants.append((i, bytes(m)))
        mutants.append((i, b[:-1]))
        mutants.append((i, b[:-2]))
        mutants.append((i, b + b"\0\0"))
    # flips inside raw planes, the pairs table or escapes give other valid bytes (the chunk's XXH3
    # catches those); flips inside ans blobs must almost always be refused
    n = data.size // width
    blob_planes = {i for i, p in enumerate(chunk.planes) if len(p) < (((n + 1) // 2) if variant == codecs.ANS_PAIRS and i == 1 else n)
                   and not (variant == codecs.ANS_PAIRS and i in (0, 2))}
    assert blob_planes
    corrupt = in_blobs = 0
    for i, m in mutants:
        planes = list(chunk.planes)
        planes[i] = m
        damaged = codecs.EncodedStream(stream.codec, stream.params, [codecs.EncodedChunk(chunk.raw_length, planes)])
        verdicts = set()
        for lv in _levels():
            with simd(lv):
                verdicts.add(_verdict(damaged, data.size))
        with without_c():
            verdicts.add(_verdict(damaged, data.size))
        assert len(verdicts) == 1, (i, "decoders disagree")
        if i in blob_planes:
            in_blobs += 1
            corrupt += verdicts == {"corrupt"}
    assert corrupt > 0.9 * in_blobs


def test_hostile_tables_and_states_are_refused():
    n = 5000
    good = bytearray(ans.encode(_symbols("laplace", n)))
    cases = {
        "unknown lane count": bytes([9]) + bytes(good[1:]),
        "one symbol": bytes([good[0], 0]) + bytes(good[2:]),
        "constant of the wrong size": bytes([0, 5, 5]),
        "truncated to the header": bytes(good[:2]),
        "state below 2^16": bytes(good[:-(len(good) - 40)]) + b"\0" * (len(good) - 40),
        "only two bytes": bytes([3, 1]),
    }
    for what, blob in cases.items():
        for path in (["c"] if C is not None else []) + ["numpy"]:
            out = np.empty(n, np.uint8)
            if path == "c":
                assert C.ans_decode([blob], False, False, out), what
            else:
                with pytest.raises(ans.Damaged):
                    ans.decode_numpy(blob, n, out)


def test_check_params_refuses_bad_ans_params():
    for params in ({"width": 3, "sign": False}, {"width": 1, "sign": True}, {"width": 4, "sign": 1},
                   {"width": 8, "sign": True, "pairs": True}, {"width": 4, "sign": False, "pairs": True},
                   {"width": 4, "sign": True, "pairs": 1}, {"sign": True}):
        with pytest.raises(CorruptFileError):
            codecs.check_params("ans", params)
    codecs.check_params("ans", {"width": 4, "sign": True, "pairs": True})
    with pytest.raises(CorruptFileError):
        codecs.plane_sizes("ans", {"width": 4, "sign": True}, 0)


# ------------------------------------------------------------------ the writer

def test_writer_picks_ans_and_is_not_larger_than_the_zstd_codecs():
    w = (RNG.standard_normal(1 << 17) * 0.05).astype(np.float32).view(np.uint8)
    q = _symbols("laplace", 1 << 18)
    for data, dtype in ((w, TensorProto.FLOAT), (q, TensorProto.INT8)):
        best = codecs.encode_tensor(data, dtype, "raw_data")
        assert best.codec == "ans"
        old = min(codecs._encode_planes(data, c, wd, codecs.CHUNK_BYTES, sp).stored
                  for c, wd, sp in ([("fplanes", 4, 0), ("fpairs", 4, 0)] if dtype == TensorProto.FLOAT else [("bytes", 1, 0)]))
        assert best.stored <= old


def _model():
    rng = np.random.default_rng(3)
    bf16 = helper.make_tensor("bf16", TensorProto.BFLOAT16, [3000],
                              (rng.standard_normal(3000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
    inits = [
        numpy_helper.from_array(rng.standard_normal((40, 100)).astype(np.float32), "f32"),
        numpy_helper.from_array(rng.standard_normal(6000).astype(np.float16), "f16"),
        numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 6, 9000)), -127, 127).astype(np.int8), "i8"),
        numpy_helper.from_array(rng.integers(0, 256, 4000).astype(np.uint8) & 0x77, "packed_int4"),
        numpy_helper.from_array(rng.integers(-2000, 2000, 3000).astype(np.int32), "i32"),
        bf16,
    ]
    return helper.make_model(helper.make_graph([], "g", [], [], inits))


def test_pack_is_the_same_with_and_without_the_extension(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(_model().SerializeToString())
    passes.pack(src, tmp_path / "c.onnxz", threads=1)
    with without_c():
        passes.pack(src, tmp_path / "n.onnxz", threads=2)
        restored = passes.unpack(tmp_path / "c.onnxz", tmp_path / "n.onnx")
        assert restored.read_bytes() == src.read_bytes()
    assert (tmp_path / "c.onnxz").read_bytes() == (tmp_path / "n.onnxz").read_bytes()
    with passes.open_packed(tmp_path / "c.onnxz") as pm:
        meta = pm.metadata()
        assert meta["format_version"] == "1.2"  # 1.2: the files' XXH3-128 digests
        assert sum(t["codec"] == "ans" for t in meta["tensors"]) >= 4
