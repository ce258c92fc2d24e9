"""Static order-0 rANS planes of the `.onnxz` codec `ans` (FORMAT.md section 3.1).

The compiled decoder lives in _ans.c (module _planes): 1-2.5 GB/s per core with AVX2/AVX-512
(chosen at run time; scalar otherwise, same bytes); the encoder in _encode.c (module _encode:
own and shared tables). This module is their numpy mirror, used when the extension was not built: the same blobs bit for bit (the encoder's
frequency normalisation, table layout and lane order are copied exactly), vectorised across the
lanes, one Python step per 32 symbols: slow (~1-3 MB/s) but correct. Tests compare the two.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
MAX_LANES_LOG2 = 7

try:  # the writer's coders in C (same blobs as the numpy ones below)
    from . import _encode as _enc
except ImportError:  # not built: numpy does it
    _enc = None


def lanes_log2_for(n: int) -> int:
    """The writer's lane count: 128 lanes (8 AVX-512 registers in flight: int8 ~35%, float32 ~20%
    faster than 64) once the 512 bytes of final states are noise against the plane, fewer on
    smaller planes (4 bytes of state per lane). 32 lanes from 16K symbols (was 64K): 4 lanes
    decode latency-bound at ~0.45 G symbols/s; measured on fresh packs, decode from memory at
    1 thread 1.01-1.29x faster on piper_joe, silero_vad_v6, open_nsfw and their int8 outputs,
    sizes +0.001..0.008% (silero_vad_v6.int8: +0.084%, 416 bytes). Then 32 lanes
    from 8K symbols and 4 from 256 (was 1 lane below 1024: one serial chain, ~0.15 G symbols/s):
    silero_vad_v6.int8's two 12288-symbol planes and twelve 512-symbol shared-table planes decoded
    at 0.5 / 0.2 GB/s; its ans batch (the C call alone, 300 interleaved rounds) 274 -> 208 us
    CPU (median), +170 bytes (+0.037%)."""
    return 7 if n >= 262144 else 6 if n >= 131072 else 5 if n >= 8192 else 2 if n >= 256 else 0


def normalise(counts: np.ndarray) -> np.ndarray:
    """Symbol counts -> frequencies summing to 4096, each present symbol >= 1 (as _ans.c)."""
    if _enc is not None and counts.shape == (256,):
        out = np.empty(256, np.int64)
        _enc.normalise(np.ascontiguousarray(counts, np.int64), out)
        return out
    return normalise_numpy(counts)


def normalise_numpy(counts: np.ndarray) -> np.ndarray:
    counts = counts.astype(np.uint64)
    total = int(counts.sum())
    f = (counts * np.uint64(PROB_SCALE) + np.uint64(total // 2)) // np.uint64(total)
    f[(counts > 0) & (f == 0)] = 1
    f = f.astype(np.int64)
    diff = PROB_SCALE - int(f.sum())
    if diff > 0:
        f[int(np.argmax(f))] += diff
    while diff < 0:  # take from the currently largest, one at a time
        f[int(np.argmax(f))] -= 1
        diff += 1
    return f


def write_table(freq: np.ndarray) -> bytes:
    syms = np.flatnonzero(freq)
    out = bytearray([len(syms) - 1])
    if len(syms) < 32:
        out += syms.astype(np.uint8).tobytes()
    else:
        present = np.zeros(256, bool)
        present[syms] = True
        out += np.packbits(present, bitorder="little").tobytes()
    acc, bits, prev = 0, 0, 4
    for f in freq[syms[:-1]].tolist():
        k = f.bit_length() - 1
        d = k - prev
        z = 2 * d if d >= 0 else -2 * d - 1
        acc |= 1 << (bits + z)  # z zeros then a one
        bits += z + 1
        acc |= (f & ((1 << k) - 1)) << bits
        bits += k
        prev = k
    return bytes(out) + acc.to_bytes((bits + 7) // 8, "little")


def encode(sym: np.ndarray, lanes_log2: Optional[int] = None) -> bytes:
    """One plane (uint8, n >= 1) as an ans blob."""
    n = sym.size
    if lanes_log2 is None:
        lanes_log2 = lanes_log2_for(n)
    if _enc is not None:
        return _enc.ans_encode(sym, lanes_log2)
    return encode_numpy(sym, lanes_log2)


def encode_numpy(sym: np.ndarray, lanes_log2: int) -> bytes:
    sym = np.ascontiguousarray(sym, np.uint8).ravel()
    counts = np.bincount(sym, minlength=256)
    present = np.flatnonzero(counts)
    if present.size == 1:
        return bytes([0, int(present[0])])
    freq = normalise(counts)
    return bytes([lanes_log2 + 1]) + write_table(freq) + _states_and_words(sym, freq, lanes_log2)


def _states_and_words(sym: np.ndarray, freq: np.ndarray, lanes_log2: int) -> bytes:
    """The rANS part of a blob: final lane states, then the renormalisation words in decode order.
    Vectorised across lanes (one numpy step per group of `lanes` symbols) from 8 lanes; with fewer a
    numpy step costs more than a scalar loop over its symbols (~0.3 us each), which writes the same."""
    if lanes_log2 < 3:
        return _states_and_words_scalar(sym, freq, lanes_log2)
    n = sym.size
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    f64 = freq.astype(np.uint64)
    lanes = 1 << lanes_log2
    x = np.full(lanes, RANS_L, np.uint64)
    pieces = []
    for lo in range(((n - 1) // lanes) * lanes, -1, -lanes):  # last step first, as the encoder runs backwards
        s = sym[lo:lo + lanes]
        a = s.size
        fs = f64[s]
        xs = x[:a]
        emit = xs >= (fs << np.uint64(20))
        if emit.any():
            pieces.append((xs[emit] & np.uint64(0xFFFF)).astype("<u2"))
            xs = np.where(emit, xs >> np.uint64(16), xs)
        x[:a] = ((xs // fs) << np.uint64(PROB_BITS)) + (xs % fs) + cum[s]
    words = np.concatenate(pieces[::-1]).tobytes() if pieces else b""
    return x.astype("<u4").tobytes() + words


def _states_and_words_scalar(sym: np.ndarray, freq: np.ndarray, lanes_log2: int) -> bytes:
    f = freq.tolist()
    c = cum_freq(freq).tolist()
    syms = sym.tolist()
    mask = (1 << lanes_log2) - 1
    x = [RANS_L] * (mask + 1)
    words = []
    emit = words.append
    for i in range(len(syms) - 1, -1, -1):  # backwards: symbol i goes to lane i % lanes
        s = syms[i]
        fs = f[s]
        j = i & mask
        xj = x[j]
        if xj >= fs << 20:
            emit(xj & 0xFFFF)
            xj >>= 16
        q, r = divmod(xj, fs)
        x[j] = (q << PROB_BITS) + r + c[s]
    words.reverse()
    return np.array(x, "<u4").tobytes() + np.array(words, "<u2").tobytes()


def cum_freq(freq: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.int64)


def coded_bits(counts: np.ndarray, freq: np.ndarray) -> float:
    """Bits of the rANS words for symbols with these counts under the table freq (inf when a
    present symbol has no frequency): what a blob's words cost, within a word per lane."""
    if _enc is not None and counts.shape == freq.shape == (256,):
        return _enc.coded_bits(np.ascontiguousarray(counts, np.int64), np.ascontiguousarray(freq, np.int64))
    return coded_bits_numpy(counts, freq)


def coded_bits_numpy(counts: np.ndarray, freq: np.ndarray) -> float:
    present = counts > 0
    if np.any(freq[present] == 0):
        return float("inf")
    c = counts[present].astype(np.float64)
    return float((c * (PROB_BITS - np.log2(freq[present].astype(np.float64)))).sum())


def encode_shared(sym: np.ndarray, freq: np.ndarray, lanes_log2: int) -> bytes:
    """One plane as an ans blob *without* its frequency table (FORMAT.md 3.2: the table is shared,
    stored once in the index): byte 0 (lanes), the initial states, the words. The coding is that
    of encode_numpy with the given table (every symbol of sym must have a frequency)."""
    sym = np.ascontiguousarray(sym, np.uint8).ravel()
    if _enc is not None:
        return _enc.ans_encode_shared(sym, np.ascontiguousarray(freq, np.int64), lanes_log2)
    return encode_shared_numpy(sym, freq, lanes_log2)


def encode_shared_numpy(sym: np.ndarray, freq: np.ndarray, lanes_log2: int) -> bytes:
    """encode_shared without the extension (tests compare the two)."""
    sym = np.ascontiguousarray(sym, np.uint8).ravel()
    return bytes([lanes_log2 + 1]) + _states_and_words(sym, freq, lanes_log2)


def table_size(freq: np.ndarray) -> int:
    """len(write_table(freq)) without writing it (the writer's size estimates ask for it often):
    the symbol list or bitmap, then per frequency but the last z + 1 + k bits (see write_table)."""
    if _enc is not None and freq.shape == (256,):
        return _enc.table_size(np.ascontiguousarray(freq, np.int64))
    syms = np.flatnonzero(freq)
    f = freq[syms[:-1]]
    k = np.zeros(f.size, np.int64)
    if f.size:
        k = np.frexp(f.astype(np.float64))[1].astype(np.int64) - 1  # floor(log2 f), exact for ints < 2^53
    prev = np.concatenate([[4], k[:-1]]) if k.size else k
    d = k - prev
    z = np.where(d >= 0, 2 * d, -2 * d - 1)
    bits = int((z + 1 + k).sum())
    return 1 + (syms.size if syms.size < 32 else 32) + (bits + 7) // 8


def with_table(blob, table: bytes) -> bytes:
    """A blob written by encode_shared made whole again: its table put back after byte 0 (a
    constant plane, byte 0 = 0, has none)."""
    b = bytes(blob)
    if not b or b[0] == 0:
        return b
    return b[:1] + table + b[1:]


class Damaged(Exception):
    """A blob that cannot be what the encoder wrote (the caller raises CorruptFileError)."""


def _read_table(b: bytes, pos: int):
    if pos >= len(b):
        raise Damaged("frequency table truncated")
    nsym = b[pos] + 1
    pos += 1
    if nsym < 2:
        raise Damaged("frequency table with one symbol")
    if nsym < 32:
        if len(b) - pos < nsym:
            raise Damaged("frequency table truncated")
        syms = np.frombuffer(b, np.uint8, nsym, pos).astype(np.int64)
        if np.any(np.diff(syms) <= 0):
            raise Damaged("frequency table symbols out of order")
        pos += nsym
    else:
        if len(b) - pos < 32:
            raise Damaged("frequency table truncated")
        syms = np.flatnonzero(np.unpackbits(np.frombuffer(b, np.uint8, 32, pos), bitorder="little"))
        if syms.size != nsym:
            raise Damaged("frequency table bitmap disagrees with its count")
        pos += 32
    freq = np.zeros(256, np.int64)
    acc, bits, total, prev = 0, 0, 0, 4
    for s in syms[:-1].tolist():
        z = 0
        while True:
            if not bits:
                if pos >= len(b):
                    raise Damaged("frequency table truncated")
                acc, bits, pos = b[pos], 8, pos + 1
            bit = acc & 1
            acc, bits = acc >> 1, bits - 1
            if bit:
                break
            if z >= 23:
                raise Damaged("frequency out of range")
            z += 1
        k = prev + (-(z + 1) // 2 if z & 1 else z // 2)
        if not 0 <= k <= 11:
            raise Damaged("frequency out of range")
        prev = k
        while bits < k:
            if pos >= len(b):
                raise Damaged("frequency table truncated")
            acc |= b[pos] << bits
            pos, bits = pos + 1, bits + 8
        f = (1 << k) | (acc & ((1 << k) - 1))
        acc, bits = acc >> k, bits - k
        total += f
        if total >= PROB_SCALE:
            raise Damaged("frequencies exceed the total")
        freq[s] = f
    freq[syms[-1]] = PROB_SCALE - total
    return freq, pos


def decode_numpy(blob, n: int, out: np.ndarray) -> None:
    """One ans blob of n >= 1 symbols into out (uint8, n); Damaged when it cannot be right."""
    b = bytes(blob)
    if len(b) < 2:
        raise Damaged("ans plane truncated")
    if b[0] == 0:
        if len(b) != 2:
            raise Damaged("constant ans plane of the wrong size")
        out[:n] = b[1]
        return
    if b[0] > MAX_LANES_LOG2 + 1:
        raise Damaged("ans plane with an unknown lane count")
    lanes = 1 << (b[0] - 1)
    freq, pos = _read_table(b, 1)
    if len(b) - pos < 4 * lanes:
        raise Damaged("ans plane truncated (states)")
    x = np.frombuffer(b, "<u4", lanes, pos).astype(np.uint64)
    pos += 4 * lanes
    if np.any(x < RANS_L):
        raise Damaged("ans state out of range")
    if (len(b) - pos) % 2:
        raise Damaged("ans words of odd length")
    words = np.frombuffer(b, "<u2", offset=pos).astype(np.uint64)
    slot_sym = np.repeat(np.arange(256, dtype=np.uint8), freq)
    slot_freq = np.repeat(freq, freq).astype(np.uint64)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    slot_bias = (np.arange(PROB_SCALE) - np.repeat(cum, freq)).astype(np.uint64)
    wp = 0
    mask, lim = np.uint64(PROB_SCALE - 1), np.uint64(RANS_L)
    for lo in range(0, n, lanes):
        a = min(lanes, n - lo)
        xs = x[:a]
        slot = xs & mask
        out[lo:lo + a] = slot_sym[slot]
        xs = slot_freq[slot] * (xs >> np.uint64(PROB_BITS)) + slot_bias[slot]
        need = xs < lim
        c = int(np.count_nonzero(need))
        if c:
            if wp + c > words.size:
                raise Damaged("ans words run out")
            xs[need] = (xs[need] << np.uint64(16)) | words[wp:wp + c]
            wp += c
        x[:a] = xs
    if wp != words.size or np.any(x != RANS_L):
        raise Damaged("ans plane does not end where it should (final states or words)")
