"""What FORMAT.md states about two corners of the bit stream, checked against the writer: the k
low bits of a frequency (3.1) come least significant first, and the escapes and split class
planes of bpairs / fpairs (2) are always one zstd frame, never raw, even empty or longer than
their bytes."""
from __future__ import annotations

import numpy as np
import zstandard as zstd

from passes.onnxz import ans, codecs

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _spec_frequencies(table: bytes) -> list:
    """The frequencies of a FORMAT.md 3.1 table, read as the text says (symbol list form only)."""
    count = table[0] + 1
    assert count < 32
    pos = 1 + count
    bits = [(table[pos + i // 8] >> (i % 8)) & 1 for i in range(8 * (len(table) - pos))]  # LSB first
    at, prev, freqs = 0, 4, []
    for _ in range(count - 1):
        z = 0
        while bits[at] == 0:
            z, at = z + 1, at + 1
        at += 1
        d = z // 2 if z % 2 == 0 else -(z + 1) // 2
        k = prev + d
        low = sum(bits[at + j] << j for j in range(k))  # the first bit read is bit 0 of f
        at += k
        freqs.append((1 << k) | low)
        prev = k
    return freqs + [4096 - sum(freqs)]


def test_frequency_low_bits_are_least_significant_first():
    freq = np.zeros(256, np.int64)
    # k = 3..11 with low bits that read differently backwards (0b0110 -> 0b0110 is a palindrome: avoided)
    chosen = {1: 0b1001, 7: 0b1_0011, 9: 0b101_0001, 40: 0b1000_0001_011, 41: 0b100_0000_0111}
    for s, f in chosen.items():
        freq[s] = f
    freq[200] = 4096 - sum(chosen.values())
    assert freq[200] > 0
    table = ans.write_table(freq)
    assert _spec_frequencies(table) == [int(freq[s]) for s in sorted(list(chosen) + [200])]


def _frames(stream):
    return [bytes(p) for c in stream.chunks for p in c.planes]


def test_escapes_are_always_a_zstd_frame():
    rng = np.random.default_rng(0)
    few = rng.choice(np.arange(15, dtype=np.uint8), 4096)  # 15 distinct bytes: all in the table, no escape
    some = few.copy()
    some[[5, 900]] = [250, 251]  # two rare bytes, two escapes: raw, 2 bytes; a frame is longer
    for data in (few, some):
        stream = codecs._encode_planes(data, "bpairs", 1, codecs.CHUNK_BYTES)
        escapes = stream.chunks[0].planes[2]
        assert bytes(escapes[:4]) == ZSTD_MAGIC
        assert zstd.get_frame_parameters(bytes(escapes)).content_size == int((data >= 15).sum())
        out = np.empty(data.size, np.uint8)
        codecs.decode_chunk("bpairs", {}, [memoryview(p) for p in _frames(stream)], data.size, out)
        np.testing.assert_array_equal(out, data)


def test_fpairs_escapes_and_split_class_planes_are_zstd_frames():
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(2048) * np.exp2(rng.integers(-40, 40, 2048))).astype(np.float32)
    data = values.view(np.uint8)
    for split in (0, 2):
        stream = codecs._encode_planes(data, "fpairs", 4, codecs.CHUNK_BYTES, split=split)
        planes = stream.chunks[0].planes
        sized_by_ranks = [planes[2]] + (list(planes[3:3 + split + 1]) if split else [])
        for p in sized_by_ranks:
            assert bytes(p[:4]) == ZSTD_MAGIC
        out = np.empty(data.size, np.uint8)
        codecs.decode_chunk("fpairs", stream.params, [memoryview(bytes(p)) for p in planes], data.size, out)
        np.testing.assert_array_equal(out, data)
