"""One ans_decode_batch call builds the decode table of each shared table (`ans_shared`, FORMAT.md
3.2) once and decodes every chunk naming it against it (_ans.c TableCache): the same bytes and the
same verdicts as decoding each chunk alone with its table spliced in (ans_decode_shared), also for
damaged tables (reading past their end or stopping short of it), which are not kept."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from passes.onnxz import ans, codecs
from passes.onnxz import reader  # noqa: F401  (sets the XXH3 function the batch decoder checks with)

C = codecs._fast
pytestmark = pytest.mark.skipif(C is None or reader._decode_batch_c is None, reason="needs the C batch decoder")
RNG = np.random.default_rng(41)


def _chunks(count: int, table_freq, width: int):
    """count chunks of `width` planes of int8-like symbols, plane 0 coded against the shared
    frequencies, the others raw; (source bytes, [(offset, plane sizes)], [raw lengths])."""
    src, specs, lengths = bytearray(), [], []
    for k in range(count):
        n = int(RNG.integers(300, 3000))
        sym = np.clip(np.round(RNG.laplace(0, 4, n)), -30, 30).astype(np.int8).view(np.uint8)
        blob = ans.encode_shared(sym, table_freq, int(RNG.integers(0, 3)))
        assert len(blob) < n
        planes = [blob] + [RNG.integers(0, 256, n, dtype=np.uint8).tobytes() for _ in range(width - 1)]
        specs.append((len(src), tuple(len(p) for p in planes)))
        src += b"".join(planes)
        lengths.append(n * width)
    return bytes(src), specs, lengths


def _shared_freq():
    sym = np.clip(np.round(RNG.laplace(0, 4, 50000)), -30, 30).astype(np.int8).view(np.uint8)
    return ans.normalise(np.bincount(sym, minlength=256))


def _one_by_one(src, specs, lengths, width, table):
    got = []
    for (off, sizes), ln in zip(specs, lengths):
        planes, pos = [], off
        for s in sizes:
            planes.append(src[pos:pos + s])
            pos += s
        out = np.zeros(ln, np.uint8)
        err = C.ans_decode_shared(planes, [table] + [None] * (width - 1), False, out)
        got.append((err, out.tobytes() if err is None else None))
    return got


def _batch(src, specs, lengths, width, tables):
    outs = [np.zeros(ln, np.uint8) for ln in lengths]
    tasks = []
    for (off, sizes), out, table in zip(specs, outs, tables):
        stored = sum(sizes)
        tasks.append((off, stored, sizes, xxhash.xxh3_64_intdigest(src[off:off + stored]), 0, out,
                      (table,) + (None,) * (width - 1)))
    return C.ans_decode_batch(src, None, tasks), [o.tobytes() for o in outs]


@pytest.mark.parametrize("width", [1, 4])
def test_chunks_sharing_a_table_decode_as_one_by_one(width):
    freq = _shared_freq()
    table = ans.write_table(freq)
    twin = bytes(bytearray(table))  # equal bytes, another object: kept apart, same result
    src, specs, lengths = _chunks(12, freq, width)
    want = _one_by_one(src, specs, lengths, width, table)
    assert all(err is None for err, _ in want)
    verdict, outs = _batch(src, specs, lengths, width, [table if k % 3 else twin for k in range(len(specs))])
    assert verdict is None
    assert outs == [b for _, b in want]


@pytest.mark.parametrize("damage", ["junk byte after", "last byte cut", "first frequency bits flipped"])
def test_damaged_shared_tables_get_the_one_by_one_verdict(damage):
    freq = _shared_freq()
    table = ans.write_table(freq)
    if damage == "junk byte after":  # the read stops short of the table's end: the states start in it
        table = table + b"\x5a"
    elif damage == "last byte cut":  # the read runs on into the plane's own bytes
        table = table[:-1]
    else:
        table = table[:2] + bytes([table[2] ^ 0xFF]) + table[3:]
    src, specs, lengths = _chunks(6, freq, 4)
    want = _one_by_one(src, specs, lengths, 4, table)
    verdict, outs = _batch(src, specs, lengths, 4, [table] * len(specs))
    failed = [k for k, (err, _) in enumerate(want) if err is not None]
    if not failed:
        assert verdict is None and outs == [b for _, b in want]
    else:
        k = failed[0]
        assert verdict == (k, 1, want[k][0])
        assert outs[:k] == [b for _, b in want[:k]]
