"""Runs of one-plane 32-lane `ans` chunks decoded two at a time by the batch decoder (_ans.c
decode_run: two chunks' states stepped together, a finished chunk's slot taking the next one):
the same bytes as decoding them one by one and as the numpy decoder, whatever their sizes, and the
same refusal (the same chunk, code and message) when one of them is damaged."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from passes.onnxz import ans, reader

pytestmark = pytest.mark.skipif(reader._decode_batch_c is None, reason="batch decoder not available (extension or xxhash symbol)")

# symbols per chunk: equal and unequal, not multiples of 32, a run longer than the pairs it makes
SIZES = [20000, 65536, 16411, 70001, 16384, 40000, 40000, 5000, 50000]


def _chunks(seed: int = 5):
    """(payload, 32-lane blob) per size; high- and low-entropy payloads mixed (refills vary)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(SIZES):
        scale = (3, 20, 60)[i % 3]
        data = np.clip(np.round(rng.laplace(0, scale, n)), -127, 127).astype(np.int8).view(np.uint8)
        out.append((data, ans.encode(data, 5)))
    return out


def _batch(blobs, outs):
    """The packed bytes of the blobs back to back (after 64 bytes of padding) and their tasks."""
    data = bytearray(64)
    tasks = []
    for blob, out in zip(blobs, outs):
        tasks.append((len(data), len(blob), (len(blob),), xxhash.xxh3_64_intdigest(blob), 0, out))
        data += blob
    return bytes(data), tasks


def _decode(source, tasks, fd_scratch=None):
    if fd_scratch is not None:
        return reader._decode_batch_c(source, fd_scratch, tasks)
    return reader._decode_batch_c(source, None, tasks)


def test_runs_give_the_bytes_of_chunks_decoded_one_by_one(tmp_path):
    chunks = _chunks()
    assert all(blob[0] == 6 for _, blob in chunks)  # 32 lanes: what decode_run takes
    outs = [np.full(d.size, 0xAA, np.uint8) for d, _ in chunks]
    data, tasks = _batch([b for _, b in chunks], outs)
    assert _decode(data, tasks) is None
    for (d, _), o in zip(chunks, outs):
        assert np.array_equal(o, d)
    one = [np.empty(d.size, np.uint8) for d, _ in chunks]
    for t, o in zip(tasks, one):
        assert _decode(data, [t[:5] + (o,)]) is None  # alone: no run
    for (d, blob), o in zip(chunks, one):
        assert np.array_equal(o, d)
        ref = np.empty(d.size, np.uint8)
        ans.decode_numpy(blob, d.size, ref)
        assert np.array_equal(ref, d)
    # from a file: the chunks are read in one pread and decoded from the scratch buffer
    path = tmp_path / "chunks.bin"
    path.write_bytes(data)
    outs = [np.zeros(d.size, np.uint8) for d, _ in chunks]
    tasks = [t[:5] + (o,) for t, o in zip(tasks, outs)]
    with open(path, "rb") as f:
        assert _decode(f.fileno(), tasks, np.empty(reader.READ_RUN, np.uint8)) is None
    for (d, _), o in zip(chunks, outs):
        assert np.array_equal(o, d)


def _first_refusal_one_by_one(data, tasks):
    for i, t in enumerate(tasks):
        got = _decode(data, [t[:5] + (np.empty(t[5].size, np.uint8),)])
        if got is not None:
            return (i,) + tuple(got[1:])
    return None


@pytest.mark.parametrize("where", ["words", "early words", "table", "end"])
def test_a_damaged_chunk_in_a_run_is_refused_as_one_by_one(where):
    chunks = _chunks(7)
    rng = np.random.default_rng(11)
    for victim in range(len(chunks)):
        blobs = [bytearray(b) for _, b in chunks]
        b = blobs[victim]
        if where == "words":  # a word in the middle: wrong symbols, the end check fails
            k = len(b) // 2
            b[k] ^= 0x5A
        elif where == "early words":  # near the states: the lanes go wrong from the first steps
            b[len(b) // 5] ^= 0xFF
        elif where == "table":  # byte 1 onwards: the frequency table
            b[1] ^= int(rng.integers(1, 255))
        else:  # the words cut short by two bytes (a word fewer)
            del b[-2:]
        outs = [np.empty(d.size, np.uint8) for d, _ in chunks]
        data, tasks = _batch([bytes(x) for x in blobs], outs)
        want = _first_refusal_one_by_one(data, tasks)
        got = _decode(data, tasks)
        assert (None if got is None else tuple(got)) == want, (where, victim)


def test_two_damaged_chunks_report_the_earlier():
    chunks = _chunks(9)
    for first, second in [(0, 1), (1, 2), (2, 5), (3, 4), (6, 8)]:
        blobs = [bytearray(b) for _, b in chunks]
        for v in (first, second):
            blobs[v][len(blobs[v]) // 2] ^= 0x33
        outs = [np.empty(d.size, np.uint8) for d, _ in chunks]
        data, tasks = _batch([bytes(x) for x in blobs], outs)
        want = _first_refusal_one_by_one(data, tasks)
        assert want is not None and want[0] == first
        got = _decode(data, tasks)
        assert tuple(got) == want


def test_a_checksum_failure_ends_the_run_before_it():
    chunks = _chunks(13)
    outs = [np.empty(d.size, np.uint8) for d, _ in chunks]
    data, tasks = _batch([b for _, b in chunks], outs)
    tasks[4] = tasks[4][:3] + (tasks[4][3] ^ 1,) + tasks[4][4:]
    got = _decode(data, tasks)
    assert tuple(got[:2]) == (4, 0)
    for (d, _), o in list(zip(chunks, outs))[:4]:
        assert np.array_equal(o, d)
