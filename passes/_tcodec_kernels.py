"""Compiled inner loops of the tensor codec (passes/tensorcodec.py), written for numba.

Why numba: the codec is a context-adaptive rANS coder whose contexts depend on the levels just
decoded, and a rate-distortion optimised quantizer whose decisions depend on the code lengths of
those contexts. Both are sequential per scan unit; numpy cannot vectorise them, and a Python loop
runs at ~1 MB/s. Compiled, the decoder runs at ~300 MB/s per thread and chunks decode in
parallel (`prange`). Decoding prefers the C decoder passes/_tcodec.c (same output, ~2.5x faster per
core: it interleaves chunks); `decode_chunks` here is the fallback when that was not built.

Symbols. A level k is coded as its magnitude m = |k| plus a raw sign bit (m > 0). Magnitudes below
16 are their own token; larger ones are a token for (exponent, top 3 mantissa bits) plus the lower
mantissa bits raw: token = 16 + 8*(e-4) + ((m >> (e-3)) & 7), e = floor(log2 m), e-3 raw bits.

Contexts. Within a scan unit (a convolution kernel, or a row), the context of element j is a
bucket of |k[j-1]| + |k[j-2]| (0 for the unit's first element), times a row class and a position
class chosen by the encoder and sent as side information.
"""
from __future__ import annotations

import numpy as np
import numba as nb

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
N_TOKENS = 232
LITERAL_TOKENS = 16  # magnitudes below this are their own token (see "Symbols" above)


@nb.njit(cache=True, inline="always")
def token_of(m):
    if m < LITERAL_TOKENS:
        return m, 0, 0
    e = 63 - _clz64(m)
    nbits = e - 3
    return LITERAL_TOKENS + 8 * (e - 4) + ((m >> nbits) & 7), m & ((1 << nbits) - 1), nbits


@nb.njit(cache=True, inline="always")
def _clz64(v):
    n = 0
    if v == 0:
        return 64
    while (v & (1 << 63)) == 0:
        v <<= 1
        n += 1
    return n


@nb.njit(cache=True, inline="always")
def token_base(t):
    """Smallest magnitude of token t and its number of raw bits."""
    if t < LITERAL_TOKENS:
        return t, 0
    e = (t - LITERAL_TOKENS) // 8 + 4
    mant = (t - LITERAL_TOKENS) % 8
    nbits = e - 3
    return ((8 + mant) << nbits), nbits


@nb.njit(cache=True, inline="always")
def _ctx(j, p1, p2, lut, lut_max, nb_ctx, cls_base):
    """cls_base = ((row class * n_pos + pos class) * nq + quantizer) * nb_ctx."""
    if j == 0:
        return cls_base
    s = p1 + p2 if j >= 2 else 2 * p1
    if s > lut_max:
        s = lut_max
    return cls_base + lut[s]


# dependent quantization (4-state trellis, as in VVC / NNC): the state after a level is
# TRANS[state, level & 1]; states 0, 1 use quantizer Q0 (even multiples of the step: 2m),
# states 2, 3 use Q1 (odd multiples and zero: 2m - 1).
TRANS = np.array([[0, 2], [2, 0], [1, 3], [3, 1]], np.int64)


@nb.njit(cache=True, inline="always")
def _next_state(s, m):
    # TRANS written out: high bit <- low bit ^ parity, low bit <- high bit
    return (((s & 1) ^ (m & 1)) << 1) | (s >> 1)


@nb.njit(cache=True, inline="always")
def _recon(m, q, tcq, recon):
    """Reconstruction magnitude in steps; recon[q*16 + m] for m < 16 (centroids)."""
    if m < 16:
        return recon[q * 16 + m]
    if tcq:
        return np.float64(2 * m - q)
    return np.float64(m)


@nb.njit(cache=True)
def quantizer_ids(levels, unit_len, chunk_units):
    """Quantizer (0: Q0, 1: Q1) of every element under dependent quantization."""
    q = np.empty(levels.size, np.uint8)
    for ci in range(chunk_units.size - 1):
        st = 0
        for i in range(chunk_units[ci] * unit_len, chunk_units[ci + 1] * unit_len):
            q[i] = st >> 1
            st = _next_state(st, abs(levels[i]))
    return q


@nb.njit(cache=True)
def count_tokens(levels, unit_len, units_per_row, row_cls, pos_cls, n_pos_cls, lut, nb_ctx, n_ctx,
                 tcq, chunk_units):
    """Token histogram per context of integer levels (flat, C order)."""
    counts = np.zeros((n_ctx, N_TOKENS), np.int64)
    lut_max = lut.size - 1
    nq = 2 if tcq else 1
    for ci in range(chunk_units.size - 1):
        st = 0
        for u in range(chunk_units[ci], chunk_units[ci + 1]):
            rc = row_cls[u // units_per_row]
            p1 = 0
            p2 = 0
            base = u * unit_len
            for j in range(unit_len):
                q = st >> 1
                c = _ctx(j, p1, p2, lut, lut_max, nb_ctx,
                         ((rc * n_pos_cls + pos_cls[j]) * nq + q) * nb_ctx)
                m = abs(levels[base + j])
                t, _, _ = token_of(m)
                counts[c, t] += 1
                if tcq:
                    st = _next_state(st, m)
                p2 = p1
                p1 = m
    return counts


@nb.njit(cache=True, inline="always")
def _bits(cost_bits, c, m):
    t, _, nbits = token_of(m)
    return cost_bits[c, t] + nbits + (1.0 if m > 0 else 0.0)


@nb.njit(cache=True, inline="always")
def _candidate(cand, lo, max_level):
    """Candidate magnitude `cand` of a weight between grid levels lo and lo + 1: lo, lo + 1, then
    zero (the rate-saving choice); -1 when it is out of range or repeats lo = 0."""
    if cand == 0:
        m = lo
    elif cand == 1:
        m = lo + 1
    else:
        m = 0
    if m > max_level or (cand == 2 and lo == 0):
        return -1
    return m


@nb.njit(cache=True)
def rdo_quantize(x, unit_len, units_per_row, row_cls, pos_cls, n_pos_cls, lut, nb_ctx,
                 cost_bits, recon, lam, max_level):
    """Greedy rate-distortion rounding in scan order: per element, the floor or ceiling
    magnitude (or zero) minimising (|x| - recon(m))^2 + lam * bits(m | context).
    x is w / step. cost_bits[ctx, token] in bits. Returns int32 levels."""
    n = x.size
    out = np.empty(n, np.int32)
    n_units = n // unit_len
    lut_max = lut.size - 1
    for u in range(n_units):
        rc = row_cls[u // units_per_row]
        p1 = 0
        p2 = 0
        base = u * unit_len
        for j in range(unit_len):
            c = _ctx(j, p1, p2, lut, lut_max, nb_ctx, (rc * n_pos_cls + pos_cls[j]) * nb_ctx)
            v = x[base + j]
            a = abs(v)
            lo = np.int64(a)
            if lo > max_level:
                lo = max_level
            best_m = 0
            best = 1e300
            for cand in range(3):
                m = _candidate(cand, lo, max_level)
                if m < 0:
                    continue
                d = a - _recon(m, 0, False, recon)
                cost = d * d + lam * _bits(cost_bits, c, m)
                if cost < best:
                    best = cost
                    best_m = m
            out[base + j] = -best_m if v < 0 else best_m
            p2 = p1
            p1 = best_m
    return out


@nb.njit(cache=True)
def trellis_quantize(x, unit_len, units_per_row, row_cls, pos_cls, n_pos_cls, lut, nb_ctx,
                     cost_bits, recon, lam, max_level, chunk_units):
    """Dependent quantization: Viterbi search over the 4-state trellis of each chunk for the
    levels minimising sum (|x| - recon)^2 + lam * bits, contexts tracked along each survivor.
    x is w / step (the finest grid; Q0 takes even, Q1 odd multiples). Returns int32 levels."""
    n = x.size
    out = np.empty(n, np.int32)
    lut_max = lut.size - 1
    INF = 1e300
    for ci in range(chunk_units.size - 1):
        u0 = chunk_units[ci]
        u1 = chunk_units[ci + 1]
        n_el = (u1 - u0) * unit_len
        bp_state = np.empty((n_el, 4), np.int8)
        bp_level = np.empty((n_el, 4), np.int32)
        cost = np.full(4, INF)
        cost[0] = 0.0
        p1 = np.zeros(4, np.int64)
        p2 = np.zeros(4, np.int64)
        ncost = np.empty(4)
        np1 = np.empty(4, np.int64)
        np2 = np.empty(4, np.int64)
        k = 0
        for u in range(u0, u1):
            rc = row_cls[u // units_per_row]
            base = u * unit_len
            for j in range(unit_len):
                v = x[base + j]
                a = abs(v)
                for s in range(4):
                    ncost[s] = INF
                for s in range(4):
                    if cost[s] >= INF:
                        continue
                    q = s >> 1
                    if j == 0:
                        pp1 = 0
                        pp2 = 0
                    else:
                        pp1 = p1[s]
                        pp2 = p2[s]
                    c = _ctx(j, pp1, pp2, lut, lut_max, nb_ctx,
                             ((rc * n_pos_cls + pos_cls[j]) * 2 + q) * nb_ctx)
                    # nearest two magnitudes on this quantizer's grid, and zero
                    if q == 0:
                        lo = np.int64(a * 0.5)
                    else:
                        lo = np.int64((a + 1.0) * 0.5)
                    for cand in range(3):
                        m = _candidate(cand, lo, max_level)
                        if m < 0:
                            continue
                        d = a - _recon(m, q, True, recon)
                        jc = cost[s] + d * d + lam * _bits(cost_bits, c, m)
                        ns = _next_state(s, m)
                        if jc < ncost[ns]:
                            ncost[ns] = jc
                            bp_state[k, ns] = s
                            bp_level[k, ns] = m
                            np1[ns] = m
                            np2[ns] = pp1
                for s in range(4):
                    cost[s] = ncost[s]
                    p1[s] = np1[s]
                    p2[s] = np2[s]
                k += 1
        # backtrack
        s = 0
        for t in range(1, 4):
            if cost[t] < cost[s]:
                s = t
        base0 = u0 * unit_len
        for i in range(n_el - 1, -1, -1):
            m = bp_level[i, s]
            out[base0 + i] = -m if x[base0 + i] < 0 else m
            s = bp_state[i, s]
    return out


@nb.njit(cache=True)
def _encode_chunk(levels, start_unit, end_unit, unit_len, units_per_row, row_cls, pos_cls,
                  n_pos_cls, lut, nb_ctx, tcq, freq, cum, words, raw, ctxs, toks):
    """rANS-encode units [start_unit, end_unit). Returns (n_words, n_raw_words).
    words: uint16 scratch (filled in reverse, then flipped); raw: uint32 scratch."""
    lut_max = lut.size - 1
    nq = 2 if tcq else 1
    n = (end_unit - start_unit) * unit_len
    # forward pass: contexts, tokens, raw bits (sign, then low mantissa bits)
    acc = np.uint64(0)
    acc_bits = 0
    n_raw = 0
    k = 0
    st = 0
    for u in range(start_unit, end_unit):
        rc = row_cls[u // units_per_row]
        p1 = 0
        p2 = 0
        base = u * unit_len
        for j in range(unit_len):
            ctxs[k] = _ctx(j, p1, p2, lut, lut_max, nb_ctx,
                           ((rc * n_pos_cls + pos_cls[j]) * nq + (st >> 1)) * nb_ctx)
            lv = levels[base + j]
            m = abs(lv)
            t, extra, nbits = token_of(m)
            toks[k] = t
            if m > 0:
                nbits += 1
                extra = (extra << 1) | (1 if lv < 0 else 0)
            if nbits > 0:
                acc |= np.uint64(extra) << np.uint64(acc_bits)
                acc_bits += nbits
                if acc_bits >= 32:
                    raw[n_raw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                    n_raw += 1
                    acc >>= np.uint64(32)
                    acc_bits -= 32
            if tcq:
                st = _next_state(st, m)
            p2 = p1
            p1 = m
            k += 1
    if acc_bits > 0:
        raw[n_raw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        n_raw += 1
    # backward pass: rANS
    x = np.uint64(RANS_L)
    nw = 0
    for i in range(n - 1, -1, -1):
        c = ctxs[i]
        t = toks[i]
        f = np.uint64(freq[c, t])
        x_max = np.uint64(1 << (32 - PROB_BITS)) * f
        if x >= x_max:
            words[nw] = np.uint16(x & np.uint64(0xFFFF))
            nw += 1
            x >>= np.uint64(16)
        x = ((x // f) << np.uint64(PROB_BITS)) + (x % f) + np.uint64(cum[c, t])
    words[nw] = np.uint16(x & np.uint64(0xFFFF))
    words[nw + 1] = np.uint16(x >> np.uint64(16))
    nw += 2
    for i in range(nw // 2):  # flip so the decoder reads forward
        tmp = words[i]
        words[i] = words[nw - 1 - i]
        words[nw - 1 - i] = tmp
    return nw, n_raw


@nb.njit(cache=True)
def encode_chunks(levels, chunk_units, unit_len, units_per_row, row_cls, pos_cls, n_pos_cls,
                  lut, nb_ctx, tcq, freq, cum):
    """Encode every chunk; returns (word stream, word offsets, raw stream, raw offsets)."""
    n_chunks = chunk_units.size - 1
    max_units = 0
    for ci in range(n_chunks):
        max_units = max(max_units, chunk_units[ci + 1] - chunk_units[ci])
    n_max = max_units * unit_len
    scratch_w = np.empty(n_max * 2 + 4, np.uint16)
    scratch_r = np.empty(n_max + 2, np.uint32)
    ctxs = np.empty(n_max, np.int32)
    toks = np.empty(n_max, np.int32)
    words_all = np.empty(levels.size + 4 * n_chunks + 4, np.uint16)
    raw_all = np.empty(levels.size + 2 * n_chunks + 2, np.uint32)
    woff = np.zeros(n_chunks + 1, np.int64)
    roff = np.zeros(n_chunks + 1, np.int64)
    for ci in range(n_chunks):
        nw, nr = _encode_chunk(levels, chunk_units[ci], chunk_units[ci + 1], unit_len,
                               units_per_row, row_cls, pos_cls, n_pos_cls, lut, nb_ctx, tcq,
                               freq, cum, scratch_w, scratch_r, ctxs, toks)
        if woff[ci] + nw > words_all.size:
            grown = np.empty(2 * (woff[ci] + nw), np.uint16)
            grown[:woff[ci]] = words_all[:woff[ci]]
            words_all = grown
        words_all[woff[ci]:woff[ci] + nw] = scratch_w[:nw]
        woff[ci + 1] = woff[ci] + nw
        raw_all[roff[ci]:roff[ci] + nr] = scratch_r[:nr]
        roff[ci + 1] = roff[ci] + nr
    return words_all[:woff[n_chunks]].copy(), woff, raw_all[:roff[n_chunks]].copy(), roff


@nb.njit(cache=True, nogil=True)
def _decode_chunk(words, w0, w1, raw, r0, r1, out, start_unit, end_unit, unit_len,
                  units_per_row, row_cls, pos_cls, n_pos_cls, lut, nb_ctx, tcq, freq, cum,
                  sym_tab, recon, step):
    """Decode one chunk into out (float32, flat). Returns 0 on success, -1 on damaged data.
    recon: float32[32], reconstruction values (already times step) of magnitudes < 16 for Q0
    then Q1."""
    lut_max = lut.size - 1
    nq = 2 if tcq else 1
    mult = 2.0 if tcq else 1.0
    if w1 - w0 < 2:
        return -1
    wp = w0
    x = (np.uint64(words[wp]) << np.uint64(16)) | np.uint64(words[wp + 1])
    wp += 2
    rp = r0
    acc = np.uint64(0)
    acc_bits = 0
    mask = np.uint64(PROB_SCALE - 1)
    st = 0
    for u in range(start_unit, end_unit):
        rc = row_cls[u // units_per_row]
        p1 = 0
        p2 = 0
        base = u * unit_len
        for j in range(unit_len):
            q = st >> 1
            c = _ctx(j, p1, p2, lut, lut_max, nb_ctx,
                     ((rc * n_pos_cls + pos_cls[j]) * nq + q) * nb_ctx)
            slot = x & mask
            t = sym_tab[c, slot]
            x = np.uint64(freq[c, t]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(cum[c, t])
            if x < np.uint64(RANS_L):
                if wp >= w1:
                    return -1
                x = (x << np.uint64(16)) | np.uint64(words[wp])
                wp += 1
            if t == 0:
                out[base + j] = np.float32(0.0)
                m = np.int64(0)
            else:
                if t < 16:
                    m = np.int64(t)
                    nbits = 1
                else:
                    mb, nbits = token_base(t)
                    m = np.int64(mb)
                    nbits += 1
                if acc_bits < nbits:
                    if rp >= r1:
                        return -1
                    acc |= np.uint64(raw[rp]) << np.uint64(acc_bits)
                    rp += 1
                    acc_bits += 32
                bits = acc & np.uint64((1 << nbits) - 1)
                acc >>= np.uint64(nbits)
                acc_bits -= nbits
                m += np.int64(bits >> np.uint64(1))
                if m < 16:
                    v = recon[q * 16 + m]
                else:
                    v = np.float32(mult * m - q) * step
                out[base + j] = -v if (bits & np.uint64(1)) else v
            if tcq:
                st = _next_state(st, m)
            p2 = p1
            p1 = m
    if x != np.uint64(RANS_L) or wp != w1 or rp != r1:
        return -1
    return 0


@nb.njit(cache=True, parallel=True, nogil=True)
def decode_chunks(words, woff, raw, roff, chunk_units, out, unit_len, units_per_row, row_cls,
                  pos_cls, n_pos_cls, lut, nb_ctx, tcq, freq, cum, sym_tab, recon, step):
    n_chunks = chunk_units.size - 1
    status = np.zeros(n_chunks, np.int32)
    for ci in nb.prange(n_chunks):
        status[ci] = _decode_chunk(words, woff[ci], woff[ci + 1], raw, roff[ci], roff[ci + 1],
                                   out, chunk_units[ci], chunk_units[ci + 1], unit_len,
                                   units_per_row, row_cls, pos_cls, n_pos_cls, lut, nb_ctx, tcq,
                                   freq, cum, sym_tab, recon, step)
    return status.min()
