"""The pack's shortcuts decide exactly as the full work they skip (same stored bytes)."""

import numpy as np

from passes.onnxz import codecs


def test_narrowed_refuses_a_tensor_whose_first_values_alone_narrow():
    # a word embedding whose first rows are zeros: the first 1024 values are float16- and
    # bfloat16-exact, the rest is not; the spread sample must refuse it, as the full check does
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 64)).astype(np.float32)
    w[:20] = 0
    assert codecs._narrowed(w.view(np.uint8).ravel(), codecs.FLOAT) is None
    d = rng.standard_normal(5000)
    d[:1500] = 0.5
    assert codecs._narrowed(d.view(np.uint8).ravel(), codecs.DOUBLE) is None


def test_narrowed_still_narrows_exact_tensors():
    rng = np.random.default_rng(1)
    h = rng.standard_normal(10000).astype(np.float16)
    to, narrow = codecs._narrowed(h.astype(np.float32).view(np.uint8), codecs.FLOAT)
    assert to == codecs.FLOAT16 and np.array_equal(narrow.view(np.float16), h)
    b = (rng.standard_normal(10000).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    to, narrow = codecs._narrowed(b.view(np.uint8), codecs.FLOAT)
    assert to == codecs.BFLOAT16 and np.array_equal(narrow.view(np.uint16), (b.view(np.uint32) >> 16).astype(np.uint16))
    f = rng.standard_normal(7000).astype(np.float32)
    to, narrow = codecs._narrowed(f.astype(np.float64).view(np.uint8), codecs.DOUBLE)
    assert to == codecs.FLOAT and np.array_equal(narrow.view(np.float32), f)


def _stream_bytes(stream):
    return stream.codec, stream.params, [(c.raw_length, [bytes(p) for p in c.planes]) for c in stream.chunks]


def test_zstd_specs_encode_the_same_with_the_choice_memo():
    """_encode_planes takes the planes and histograms the floors left in the memo: the same bytes
    as an encode from scratch, for every zstd spec, one chunk or several."""
    rng = np.random.default_rng(3)
    f32 = rng.normal(0, 0.05, 40_000).astype(np.float32).view(np.uint8)
    f16 = rng.normal(0, 0.5, 50_000).astype(np.float16).view(np.uint8)
    low = (rng.integers(0, 5, 90_000) * 3).astype(np.uint8)
    i32 = rng.integers(-300, 300, 20_000).astype(np.int32).view(np.uint8)
    cases = [(f32, ("fpairs", 4, 0)), (f32, ("fplanes", 4, 0)), (f16, ("fpairs", 2, 0)), (f16, ("fplanes", 2, 0)),
             (low, ("bpairs", 1, 0)), (low, ("bytes", 1, 0)), (i32, ("planes", 4, 0)), (f32, ("fpairs", 4, codecs.SPLIT))]
    for data, spec in cases:
        for chunk in (1 << 20, 32 << 10):
            memo = codecs._Memo()
            for huffman in (False, True):
                codecs._zstd_floor(data, *spec, chunk, huffman=huffman, memo=memo)
            with_memo = codecs._encode_planes(data, spec[0], spec[1], chunk, spec[2], memo)
            fresh = codecs._encode_planes(data, spec[0], spec[1], chunk, spec[2])
            assert _stream_bytes(with_memo) == _stream_bytes(fresh), (spec, chunk)


def test_a_rank_table_never_compresses():
    """fpairs/bpairs store their 15-byte rank table raw without trying zstd: 15 distinct bytes
    have no match and no Huffman gain, so compress_plane would have kept them raw anyway."""
    rng = np.random.default_rng(4)
    for i in range(300):
        table = rng.permutation(256)[:15].astype(np.uint8)
        if i % 2:
            table = np.sort(table)
        for kind in ("entropy", "fast"):
            assert codecs.compress_plane(table, kind, True) is table
    data = rng.normal(0, 0.1, 3000).astype(np.float32).view(np.uint8)
    for spec in (("fpairs", 4), ("bpairs", 1)):
        chunk = codecs._encode_planes(data, spec[0], spec[1], 1 << 20).chunks[0]
        table = codecs.rank_planes(codecs.split_planes(data, 4, True)[0] if spec[0] == "fpairs" else data)[0]
        assert bytes(chunk.planes[0]) == table.tobytes()


def test_shared_tables_reuse_the_ans_planes_of_the_choice(monkeypatch):
    """encode_tensor hands _encode_shared the planes its `ans` spec stored: the same stream as
    coding them again."""
    rng = np.random.default_rng(5)
    payloads = [(rng.normal(0, 0.05, n).astype(np.float32).view(np.uint8), codecs.FLOAT, "raw_data") for n in (300, 900, 2000, 5000)]
    payloads += [(np.clip(rng.normal(0, 9, n), -127, 127).astype(np.int8).view(np.uint8), codecs.INT8, "raw_data") for n in (1500, 4000, 9000)]
    shared = codecs.SharedTables.build(payloads)
    assert shared
    reused = [_stream_bytes(codecs.encode_tensor(d, t, f, shared=shared)) for d, t, f in payloads]
    original = codecs._encode_shared
    monkeypatch.setattr(codecs, "_encode_shared", lambda *a: original(*a[:5]))
    again = [_stream_bytes(codecs.encode_tensor(d, t, f, shared=shared)) for d, t, f in payloads]
    assert reused == again
    assert any(s[0] == "ans_shared" for s in reused)


def test_the_narrow_precheck_keeps_every_float16_value():
    """_narrowed refuses a float32 tensor at once when one of its first values has any of the 13
    low mantissa bits set: no float16 value (all 65,536 bit patterns, NaNs and subnormals
    included) has them set as a float32, so no tensor that narrows is refused by it."""
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    with np.errstate(invalid="ignore"):
        u = h.astype(np.float32).view(np.uint32)
    assert not np.any(u & 0x1FFF)
    finite = h[np.isfinite(h)]
    to, narrow = codecs._narrowed(finite.astype(np.float32).view(np.uint8), codecs.FLOAT)
    assert to == codecs.FLOAT16 and np.array_equal(narrow.view(np.uint16), finite.view(np.uint16))


def _hopeless_probing_each_floor(data, spec, chunk_bytes, to_beat):
    """_hopeless as it was: the repetition probes run within each floor's pass."""
    memo = codecs._Memo()
    for huffman in (False, True):
        floor = codecs._zstd_floor(data, *spec, chunk_bytes, huffman=huffman, memo=memo)
        if floor is None:
            return False
        if floor >= to_beat:
            return True
    return False


def test_hopeless_probes_only_where_a_floor_decides():
    """Probing only when a floor reaches the size to beat gives the answers of probing always,
    on noise, narrow exponents, repetitive planes (matches pay) and every spec, for sizes to
    beat on both sides of the floors."""
    rng = np.random.default_rng(9)
    f32 = rng.normal(0, 0.05, 40_000).astype(np.float32)
    rep = np.tile(rng.normal(0, 0.05, 500).astype(np.float32), 80)  # matches pay
    i8 = np.clip(rng.normal(0, 12, 120_000), -127, 127).astype(np.int8)
    cases = [(f32.view(np.uint8), s) for s in (("fplanes", 4, 0), ("fpairs", 4, 0), ("bytes", 1, 0))]
    cases += [(rep.view(np.uint8), s) for s in (("fplanes", 4, 0), ("fpairs", 4, 0), ("bytes", 1, 0))]
    cases += [(i8.view(np.uint8), ("bytes", 1, 0)), (i8.view(np.uint8), ("bpairs", 1, 0))]
    answers = set()
    for data, spec in cases:
        memo = codecs._Memo()
        entropy = codecs._zstd_floor(data, *spec, 1 << 20, huffman=False, memo=memo, probe=False)
        huffman = codecs._zstd_floor(data, *spec, 1 << 20, huffman=True, memo=memo, probe=False)
        for to_beat in (0.5 * entropy, entropy - 1, entropy, (entropy + huffman) / 2, huffman, huffman + 1, data.size):
            got = codecs._hopeless(data, spec, 1 << 20, to_beat)
            assert got == _hopeless_probing_each_floor(data, spec, 1 << 20, to_beat), (spec, to_beat)
            answers.add(got)
    assert answers == {True, False}
