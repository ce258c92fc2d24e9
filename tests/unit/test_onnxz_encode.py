"""The writer's compiled helpers (passes.onnxz._encode) against their numpy mirrors: the same
blobs, histograms and Huffman costs, so a pack is the same bytes with or without the extension."""

import numpy as np
import pytest

from passes.onnxz import ans, codecs

_enc = pytest.importorskip("passes.onnxz._encode")


def _symbols(rng, kind: str, n: int) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(0, 256, n).astype(np.uint8)
    if kind == "narrow":  # an exponent-like plane: a few bits
        return np.clip(rng.normal(120, 1.5, n), 0, 255).astype(np.uint8)
    if kind == "sparse":  # symbols far apart, some with frequency 1 after normalising
        return (rng.integers(0, 7, n) * 37).astype(np.uint8)
    if kind == "skewed":  # one symbol nearly everywhere
        s = np.full(n, 3, np.uint8)
        s[rng.integers(0, n, max(1, n // 500))] = 200
        return s
    raise ValueError(kind)


KINDS = ("uniform", "narrow", "sparse", "skewed")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 31, 1024, 5000, 70001])
def test_ans_encode_gives_the_numpy_blob(kind, n):
    rng = np.random.default_rng(n)
    sym = _symbols(rng, kind, n)
    for lanes_log2 in (0, 2, 5, 7):
        blob = _enc.ans_encode(sym, lanes_log2)
        assert blob == ans.encode_numpy(sym, lanes_log2), lanes_log2
    assert ans.encode(sym) == ans.encode_numpy(sym, ans.lanes_log2_for(n))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3, 1000, 4096, 40000])
def test_ans_encode_shared_gives_the_numpy_blob(kind, n):
    rng = np.random.default_rng(7 + n)
    sym = _symbols(rng, kind, n)
    counts = np.bincount(sym, minlength=256) + (rng.random(256) < 0.3)  # a table wider than the plane
    if np.count_nonzero(counts) < 2:
        counts[0] += 1
    freq = ans.normalise(counts)
    for lanes_log2 in (0, 2, 3, 7):
        assert _enc.ans_encode_shared(sym, freq, lanes_log2) == ans.encode_shared_numpy(sym, freq, lanes_log2)
    assert ans.encode_shared(sym, freq, 2) == ans.encode_shared_numpy(sym, freq, 2)


def test_ans_encode_shared_refuses_a_symbol_without_frequency():
    freq = np.zeros(256, np.int64)
    freq[1], freq[2] = 4000, 96
    with pytest.raises(ValueError):
        _enc.ans_encode_shared(np.array([1, 2, 3], np.uint8), freq, 0)
    with pytest.raises(ValueError):  # not summing to 4096
        _enc.ans_encode_shared(np.array([1, 2], np.uint8), freq * 2, 0)


@pytest.mark.parametrize("block", [1, 100, 131072, 1 << 30])
def test_hist_counts_each_block(block):
    rng = np.random.default_rng(block)
    data = _symbols(rng, "narrow", 300_007)
    rows = -(-data.size // block)
    if rows > 5000:
        data = data[:5000 * block]
        rows = -(-data.size // block)
    got = codecs.byte_counts(data, block)
    want = [np.bincount(data[i:i + block], minlength=256) for i in range(0, data.size, block)]
    assert np.array_equal(got.reshape(rows, 256), np.stack(want))
    assert np.array_equal(codecs.byte_counts(data), np.bincount(data, minlength=256))


def test_huffman_bits_match_the_heap_construction():
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 1000, 256) * (rng.random(256) < p) for p in (0.01, 0.1, 0.5, 1.0)]
    rows += [np.zeros(256, np.int64), np.eye(256, dtype=np.int64)[5] * 9, rng.integers(0, 3, 256)]
    counts = np.stack(rows).astype(np.int64)
    assert codecs._huffman_bits_rows(counts) == [codecs._huffman_bits(c) for c in counts]
    # the heap construction itself: counts 1, 1, 2 merge to 2 then 4, 6 bits in all; 5, 5: 10
    assert codecs._huffman_bits(np.array([1, 1, 2] + [0] * 253)) == 6
    assert codecs._huffman_bits(np.array([5, 0, 5] + [0] * 253)) == 10


def test_table_size_is_the_written_table_length():
    rng = np.random.default_rng(4)
    for trial in range(300):
        counts = rng.integers(0, [2, 50, 10 ** 6][trial % 3], 256) * (rng.random(256) < rng.random())
        if np.count_nonzero(counts) < 2:
            continue
        freq = ans.normalise(counts)
        assert ans.table_size(freq) == len(ans.write_table(freq))
        assert _enc.write_table(freq) == ans.write_table(freq)


def _payloads():
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.02, 600_000).astype(np.float32)  # above 2x SAMPLE_BYTES: the sampled path
    yield codecs.FLOAT, "raw_data", w.view(np.uint8)
    yield codecs.FLOAT, "raw_data", w[:20_000].view(np.uint8)  # floors on the whole payload
    yield codecs.FLOAT16, "raw_data", w[:70_000].astype(np.float16).view(np.uint8)
    q = np.clip(np.round(rng.laplace(0, 6, 400_000)), -127, 127).astype(np.int8)
    yield codecs.INT8, "raw_data", q.view(np.uint8)
    yield codecs.INT32, "raw_data", rng.integers(-5, 5, 3000).astype(np.int32).view(np.uint8)


def _stream_bytes(stream):
    return stream.codec, stream.params, [(c.raw_length, [bytes(p) for p in c.planes]) for c in stream.chunks]


def test_encode_tensor_same_bytes_without_the_extension(monkeypatch):
    """The pack stage with _encode and with numpy only (histograms, Huffman costs, coders)."""
    with_c = [_stream_bytes(codecs.encode_tensor(d, t, f)) for t, f, d in _payloads()]
    monkeypatch.setattr(codecs, "_enc", None)
    monkeypatch.setattr(ans, "_enc", None)
    without = [_stream_bytes(codecs.encode_tensor(d, t, f)) for t, f, d in _payloads()]
    assert with_c == without


def test_raw_shortcut_decides_as_the_trial_encode(monkeypatch):
    """A plane its histogram calls raw is one whose blob would not have saved ANS_MIN_GAIN."""
    rng = np.random.default_rng(6)
    w = rng.normal(0, 0.02, 300_000).astype(np.float32)
    for p in codecs.split_planes(w.view(np.uint8), 4, True):
        shortcut = codecs._ans_blob_or_raw(p)
        blob = ans.encode(p)
        trial = blob if len(blob) < p.size * (1 - codecs.ANS_MIN_GAIN) else p
        assert bytes(shortcut) == bytes(trial)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_split_gives_the_planes_of_the_other_splits(width):
    rng = np.random.default_rng(width)
    for n in (0, 1, 5, 1000, 65537):
        data = rng.integers(0, 256, n * width).astype(np.uint8)
        for sign in (False, True):
            got = np.empty((width, n), np.uint8)
            _enc.split(data, width, sign, got)
            want = np.empty((width, n), np.uint8)
            x = data.reshape(-1, width)
            want = np.stack([x[:, width - 1 - i] for i in range(width)]) if n else want
            if sign and n:
                t, m = want[0].copy(), want[1].copy()
                want[0] = (t << 1) | (m >> 7)
                want[1] = (t & 0x80) | (m & 0x7F)
            assert np.array_equal(got, want)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 4097, 70001])
@pytest.mark.parametrize("kind", KINDS)
def test_rank_pairs_gives_the_numpy_ranks(monkeypatch, kind, n):
    """codecs.rank_planes in C (table, ranks, escapes) equals its numpy version, ties included."""
    t = _symbols(np.random.default_rng(n), kind, n) if n else np.empty(0, np.uint8)
    with_c = codecs.rank_planes(t)
    monkeypatch.setattr(codecs, "_enc", None)
    numpy_ = codecs.rank_planes(t)
    for a, b in zip(with_c, numpy_):
        assert a.dtype == b.dtype == np.uint8 and np.array_equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_ans_encode_with_known_counts_gives_the_same_blob(kind):
    sym = _symbols(np.random.default_rng(7), kind, 20000)
    counts = np.bincount(sym, minlength=256).astype(np.int64)
    for lanes_log2 in (0, 2, 7):
        assert _enc.ans_encode(sym, lanes_log2, counts) == _enc.ans_encode(sym, lanes_log2)


def test_ans_encode_refuses_counts_that_are_not_the_histogram():
    sym = np.arange(1000, dtype=np.int64).astype(np.uint8)
    counts = np.bincount(sym, minlength=256).astype(np.int64)
    moved = counts.copy()
    moved[0] += moved[5]
    moved[5] = 0  # same total, a present symbol without frequency: no blob, an error
    for bad in (moved, counts[:255], counts * 2, -counts):
        with pytest.raises(ValueError):
            _enc.ans_encode(sym, 2, bad)
