/* Static order-0 rANS for the .onnxz codec `ans` (FORMAT.md section 3.1), part of module _planes.
 *
 * Why: zstd's Huffman (through python-zstandard, one call per plane) decodes at 0.4-0.8 GB/s and
 * loses 1-3% against order-0 entropy on low-entropy bytes and small tensors. rANS with many
 * interleaved states decodes several symbols per cycle (independent lanes: no serial dependency
 * between consecutive symbols) and codes within ~0.1% of order-0.
 *
 * Plane blob (one plane of n symbols; n is known from the chunk):
 *   byte 0 = 0: constant plane, byte 1 = the symbol (blob of exactly 2 bytes)
 *   byte 0 = k in 1..8: 2^(k-1) lanes; then the frequency table; then one u32 state per lane; then
 *   the u16 renormalisation words (little-endian) to the end of the blob.
 * Symbol i belongs to lane i mod lanes; decoding symbol i takes slot = x & 4095 of its lane's
 * state x, x = freq * (x >> 12) + slot - cum, and if x < 2^16 then x = x << 16 | next word. The
 * words are stored in the order the decoder consumes them (symbol order), so a scalar decoder and
 * a SIMD decoder (8/16 lanes per register, refill by compress-expand) read the same bytes; 32, 64
 * and 128 lanes have SIMD paths, fewer (small planes) go through the checked scalar loop. 128 lanes
 * (8 AVX-512 registers in flight) decode int8 ~35% and float32 ~20% faster than 64 (measured;
 * 256 spill registers and are slower).
 * Every lane ends at state 2^16 and every word is consumed: the decoder checks both.
 *
 * All decoders (scalar, AVX2, AVX-512: chosen at run time) give identical output. The encoder is
 * in _encode.c (module passes.onnxz._encode), mirrored bit for bit by the numpy one in ans.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include "_planes.h"

#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define RANS_L (1u << 16)
#define MAX_LANES 128
#define MAX_PLANES 8
#define BLOCK 4096 /* elements per fused decode block: the decoded planes stay in L1 */
#define NT_BYTES (512u << 10) /* chunks from this size are merged with non-temporal stores */
#define READ_RUN ((size_t)256 << 10) /* ans_decode_batch reads chunks stored back to back in one pread, up to this many bytes */

/* ---------------------------------------------------------------- frequency table */

/* Read a frequency table (FORMAT.md 3.1; written by _encode.c): nsym-1; symbols (a list when
 * nsym < 32, else a 32-byte bitmap); the frequencies of all symbols but the last, each as
 * k = floor(log2 f) coded against the previous symbol's k (zigzag of the difference in unary:
 * z zeros then a one; k before the first is 4), then the k bits of f below its top bit.
 * Neighbouring symbols have similar frequencies: ~2 bits per k instead of 4 (the table is most of
 * the overhead on small tensors). NULL or an error message. */
static const char *read_table(const uint8_t *b, size_t len, size_t *at, uint32_t *freq) {
    size_t pos = *at;
    memset(freq, 0, 256 * sizeof(uint32_t));
    if (pos >= len) return "frequency table truncated";
    int nsym = b[pos++] + 1;
    if (nsym < 2) return "frequency table with one symbol";
    uint8_t syms[256];
    if (nsym < 32) {
        if (len - pos < (size_t)nsym) return "frequency table truncated";
        for (int i = 0; i < nsym; i++) {
            syms[i] = b[pos + i];
            if (i && syms[i] <= syms[i - 1]) return "frequency table symbols out of order";
        }
        pos += nsym;
    } else {
        if (len - pos < 32) return "frequency table truncated";
        int c = 0;
        for (int s = 0; s < 256; s++)
            if (b[pos + (s >> 3)] >> (s & 7) & 1) { if (c < nsym) syms[c] = (uint8_t)s; c++; }
        if (c != nsym) return "frequency table bitmap disagrees with its count";
        pos += 32;
    }
    uint32_t acc = 0;
    int bits = 0;
    uint32_t sum = 0;
#define GETBITS(v, nb) do { \
        while (bits < (nb)) { if (pos >= len) return "frequency table truncated"; acc |= (uint32_t)b[pos++] << bits; bits += 8; } \
        (v) = acc & ((1u << (nb)) - 1); acc >>= (nb); bits -= (nb); } while (0)
    int prev = 4;
    for (int i = 0; i < nsym - 1; i++) {
        uint32_t bit, low = 0;
        int z = 0;
        for (;; z++) {
            GETBITS(bit, 1);
            if (bit) break;
            if (z >= 23) return "frequency out of range";
        }
        int k = prev + ((z & 1) ? -(z + 1) / 2 : z / 2);
        if (k < 0 || k > 11) return "frequency out of range";
        prev = k;
        if (k) GETBITS(low, k);
        uint32_t f = (1u << k) | low;
        sum += f;
        if (sum >= PROB_SCALE) return "frequencies exceed the total";
        freq[syms[i]] = f;
    }
#undef GETBITS
    freq[syms[nsym - 1]] = PROB_SCALE - sum;
    *at = pos;
    return NULL;
}

/* ---------------------------------------------------------------- decoder */

typedef struct {
    int constant;
    uint8_t symbol;
    int lanes;
    uint32_t x[MAX_LANES];
    const uint8_t *p, *end; /* renormalisation words */
    const uint32_t *tab; /* slot -> symbol | freq << 8 | (slot - cum) << 20: `own`, or a shared table's (TableCache) */
    uint32_t own[PROB_SCALE];
} Dec;

static int simd_level; /* (defined below, with the decoders' dispatch) */

#if ONNXZ_X86
/* build_table's fill, 16 slots per store (masked for a symbol's last few): the SSE2 loop the
 * compiler makes of the plain one went through its scalar epilogue for most symbols of an int8
 * table (tens of slots each); a small model builds a 4096-slot table for every coded plane
 * (silero_vad_v6.int8: 17 per unpack, ~5% of restoring it). Same table: base < 2^20 (symbol,
 * freq < 2^12 << 8), so adding 16 << 20 steps k by 16 without touching it. */
__attribute__((target("avx512f"))) static void fill_table_avx512(const uint32_t *freq, uint32_t *restrict tab) {
    const __m512i iota = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 20);
    const __m512i step = _mm512_set1_epi32(16 << 20);
    size_t slot = 0;
    for (uint32_t s = 0; s < 256; s++) {
        const uint32_t f = freq[s];
        if (!f) continue;
        __m512i v = _mm512_or_si512(_mm512_set1_epi32((int)(s | f << 8)), iota);
        uint32_t k = 0;
        for (; k + 16 <= f; k += 16) {
            _mm512_storeu_si512((void *)(tab + slot + k), v);
            v = _mm512_add_epi32(v, step);
        }
        if (k < f) _mm512_mask_storeu_epi32((void *)(tab + slot + k), (__mmask16)((1u << (f - k)) - 1), v);
        slot += f;
    }
}
#endif

/* the decode table of a frequency table (read_table's checks) read from b at *at */
static const char *build_table(const uint8_t *b, size_t len, size_t *at, uint32_t *restrict tab) {
    uint32_t freq[256];
    const char *err = read_table(b, len, at, freq);
    if (err) return err;
#if ONNXZ_X86
    if (simd_level == 2) {
        fill_table_avx512(freq, tab);
        return NULL;
    }
#endif
    /* built for every coded plane, even of 1000 symbols: locals and a restrict pointer let the
     * compiler vectorise the fill (through d->tab it reloaded freq[s] at every slot: a store of
     * the same type may alias it) */
    size_t slot = 0; /* size_t indices: no 32-bit wrap for the vectoriser to preserve */
    for (uint32_t s = 0; s < 256; s++) {
        const uint32_t f = freq[s], base = s | f << 8;
        uint32_t *restrict t = tab + slot;
        for (size_t k = 0; k < f; k++) t[k] = base | (uint32_t)k << 20;
        slot += f;
    }
    return NULL;
}

/* the lane states and words of a coded plane (b[0] its lane count, checked), from b + pos */
static const char *dec_states(Dec *d, const uint8_t *b, size_t len, size_t pos) {
    if (len - pos < (size_t)d->lanes * 4) return "ans plane truncated (states)";
    for (int j = 0; j < d->lanes; j++) {
        memcpy(&d->x[j], b + pos, 4);
        pos += 4;
        if (d->x[j] < RANS_L) return "ans state out of range";
    }
    if ((len - pos) & 1) return "ans words of odd length";
    d->p = b + pos;
    d->end = b + len;
    return NULL;
}

static const char *dec_init(Dec *d, const uint8_t *b, size_t len) {
    if (len < 2) return "ans plane truncated";
    if (b[0] == 0) {
        if (len != 2) return "constant ans plane of the wrong size";
        d->constant = 1;
        d->symbol = b[1];
        return NULL;
    }
    if (b[0] > 8) return "ans plane with an unknown lane count";
    d->constant = 0;
    d->lanes = 1 << (b[0] - 1);
    size_t pos = 1;
    const char *err = build_table(b, len, &pos, d->own);
    if (err) return err;
    d->tab = d->own;
    return dec_states(d, b, len, pos);
}

/* An `ans_shared` plane b (its byte 0 the lane count, then states and words: the blob without
 * its table) whose shared table's decode table was built already (TableCache): the checks and
 * the state of dec_init on the spliced blob b[0:1] + table + b[1:], whose table read ends where
 * the table's bytes do (only such tables are cached). b[0] > 0 (constant planes have no table). */
static const char *dec_init_built(Dec *d, const uint8_t *b, size_t len, const uint32_t *tab) {
    if (b[0] > 8) return "ans plane with an unknown lane count";
    d->constant = 0;
    d->lanes = 1 << (b[0] - 1);
    d->tab = tab;
    return dec_states(d, b, len, 1);
}

/* a little-endian u16; one load on little-endian hosts (the compiler did not merge the two byte
 * loads: 2 of the ~26 instructions per symbol of the scalar loops) */
static inline uint32_t rd16(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
#else
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
#endif
}

/* symbols [i0, i0+count) (i0 a multiple of lanes), every word read checked */
static int dec_checked(Dec *d, uint8_t *out, size_t i0, size_t count) {
    size_t mask = (size_t)d->lanes - 1;
    const uint8_t *p = d->p, *end = d->end;
    for (size_t k = 0; k < count; k++) {
        size_t j = (i0 + k) & mask;
        uint32_t x = d->x[j], e = d->tab[x & (PROB_SCALE - 1)];
        out[k] = (uint8_t)e;
        x = ((e >> 8) & 0xFFF) * (x >> PROB_BITS) + (e >> 20);
        if (x < RANS_L) {
            if (end - p < 2) { d->p = p; return -1; }
            x = x << 16 | rd16(p);
            p += 2;
        }
        d->x[j] = x;
    }
    d->p = p;
    return 0;
}

/* Full steps of LANES (32 or 64) symbols while at least 2*LANES bytes of words remain (a step
 * reads at most one word per lane); return the steps done. The bodies are inlined with a constant
 * LANES so that the states stay in registers. */
static inline __attribute__((always_inline)) size_t decN_scalar(Dec *d, uint8_t *out, size_t steps, const int LANES) {
    uint32_t X[128];
    memcpy(X, d->x, LANES * sizeof(uint32_t));
    const uint8_t *p = d->p, *end = d->end;
    const uint32_t *tab = d->tab;
    size_t done = 0;
    for (; done < steps && end - p >= 2 * LANES; done++, out += LANES) {
        for (int j = 0; j < LANES; j++) {
            uint32_t x = X[j], e = tab[x & (PROB_SCALE - 1)];
            out[j] = (uint8_t)e;
            x = ((e >> 8) & 0xFFF) * (x >> PROB_BITS) + (e >> 20);
            /* branch-free: refills are unpredictable (written as `need ? y : x` it ran ~20% slower
             * on the real planes of open_nsfw) */
            uint32_t need = x < RANS_L, mask = 0u - need;
            uint32_t y = x << 16 | rd16(p);
            X[j] = x ^ ((x ^ y) & mask); /* one operation fewer than (x & ~mask) | (y & mask) */
            p += need * 2;
        }
    }
    memcpy(d->x, X, LANES * sizeof(uint32_t));
    d->p = p;
    return done;
}

static uint32_t PERM8[256][8]; /* AVX2 refill: lane i takes word number popcount(mask below i) */

#if ONNXZ_X86
/* The 8 table entries of a register of slots, by scalar loads put together with inserts: on AMD
 * Zen 3 the AVX2 gather instruction is slow (8 entries: 0.53 ns against 0.42 for this, in a loop
 * of lookups alone) and the instructions around it wait for it; with this the AVX2 decoder ran
 * 11-15% faster on the real planes of open_nsfw and minilm_fp16 (same bytes). */
__attribute__((target("avx2"))) static inline __attribute__((always_inline)) __m256i lookup8(const int *tab, __m256i ix) {
    __m128i lo = _mm256_castsi256_si128(ix), hi = _mm256_extracti128_si256(ix, 1);
    uint64_t a = (uint64_t)_mm_cvtsi128_si64(lo), b = (uint64_t)_mm_extract_epi64(lo, 1);
    uint64_t c = (uint64_t)_mm_cvtsi128_si64(hi), e = (uint64_t)_mm_extract_epi64(hi, 1);
    __m128i r0 = _mm_cvtsi32_si128(tab[(uint32_t)a]);
    r0 = _mm_insert_epi32(r0, tab[a >> 32], 1);
    r0 = _mm_insert_epi32(r0, tab[(uint32_t)b], 2);
    r0 = _mm_insert_epi32(r0, tab[b >> 32], 3);
    __m128i r1 = _mm_cvtsi32_si128(tab[(uint32_t)c]);
    r1 = _mm_insert_epi32(r1, tab[c >> 32], 1);
    r1 = _mm_insert_epi32(r1, tab[(uint32_t)e], 2);
    r1 = _mm_insert_epi32(r1, tab[e >> 32], 3);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
}

/* Where the AVX2 decoder's symbols go with MERGE = w (2 or 4): merged at once with planes 1..w-1
 * of a float chunk (raw, p[0..w-2] at the first symbol's element) into dst (the first symbol's
 * element), sign moved back; nt as in the merge */
typedef struct {
    const uint8_t *p[3];
    uint8_t *dst;
    int nt;
} MergeSink;

/* LOADS: the table entries by scalar loads (lookup8), else by the gather instruction. A step runs
 * in groups of registers, each group's lookups first (see decN_avx512): all 16 registers of 128
 * lanes with the gather instruction (as before lookup8; groups of 4 measured 3-6% slower there),
 * 4 with scalar loads (their inserts need registers; 16 measured no faster).
 * MERGE 0: the symbols to out; 2 or 4: each group's 32 symbols merged into sink (out unused).
 * The loops over groups and registers are unrolled by hand-given pragmas (UNROLL_STEP): with the
 * group size a runtime-looking expression (G) GCC 12 kept the group loop rolled, so x[] and e[]
 * were indexed through computed offsets (sign extensions, shifts and address arithmetic, ~20
 * instructions per group of 32 symbols) and the 32 symbols of a group were packed in a loop with
 * a bound check. Unrolled, every index is a constant. Measured on the real planes of the corpus
 * (bench of this C call alone, 1 thread, both builds in one process, shuffled per round, 41
 * rounds, load 18-20): int8 planes 5-7% less CPU at the minimum (minilm_int8 14.69 -> 13.86 ms,
 * ddddocr_old 8.82 -> 8.32, minilm_fp16.int8 14.70 -> 13.70; per-round ratio medians 0.93,
 * 0.94, 0.95); the fused float path (MERGE) unchanged (open_nsfw 0.998) */
#define UNROLL_STEP _Pragma("GCC unroll 16")
__attribute__((target("avx2"))) static inline __attribute__((always_inline))
size_t decN_avx2(Dec *d, uint8_t *out, size_t steps, const int LANES, const int LOADS, const int MERGE, const MergeSink *sink) {
    __m256i x[16];
    for (int r = 0; r < LANES / 8; r++) x[r] = _mm256_loadu_si256((const __m256i *)(d->x + 8 * r));
    const uint8_t *p = d->p, *end = d->end;
    const int *tab = (const int *)d->tab;
    const __m256i m12 = _mm256_set1_epi32(PROB_SCALE - 1), m12b = _mm256_set1_epi32(0xFFF),
                  lim = _mm256_set1_epi32(RANS_L - 1), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int G = LOADS ? 4 : LANES / 8;
    size_t done = 0;
    for (; done < steps && end - p >= 2 * LANES; done++, out += LANES) {
        UNROLL_STEP
        for (int g0 = 0; g0 < LANES / 8; g0 += G) {
            __m256i e[16];
            UNROLL_STEP
            for (int r = g0; r < g0 + G; r++) {
                __m256i slot = _mm256_and_si256(x[r], m12);
                e[r] = LOADS ? lookup8(tab, slot) : _mm256_i32gather_epi32(tab, slot, 4);
            }
            UNROLL_STEP
            for (int r = g0; r < g0 + G; r++) {
                __m256i f = _mm256_and_si256(_mm256_srli_epi32(e[r], 8), m12b);
                __m256i v = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x[r], PROB_BITS)), _mm256_srli_epi32(e[r], 20));
                __m256i need = _mm256_cmpeq_epi32(_mm256_min_epu32(v, lim), v);
                int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
                __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
                w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)PERM8[m]));
                x[r] = _mm256_blendv_epi8(v, _mm256_or_si256(_mm256_slli_epi32(v, 16), w), need);
                p += 2 * __builtin_popcount((unsigned)m);
            }
            UNROLL_STEP
            for (int g = g0 / 4; g < (g0 + G) / 4; g++) { /* the group's symbols: 32 bytes per 4 registers */
                const __m256i lo8 = _mm256_set1_epi32(0xFF);
                __m256i a = _mm256_packus_epi32(_mm256_and_si256(e[4 * g], lo8), _mm256_and_si256(e[4 * g + 1], lo8));
                __m256i b = _mm256_packus_epi32(_mm256_and_si256(e[4 * g + 2], lo8), _mm256_and_si256(e[4 * g + 3], lo8));
                __m256i c = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), order);
                if (MERGE) { /* elements k .. k+31 of the block, while the lookups of the next group run */
                    size_t k = done * LANES + 32 * (size_t)g;
                    onnxz_merge32_avx2(c, sink->p[0] + k, MERGE == 4 ? sink->p[1] + k : NULL, MERGE == 4 ? sink->p[2] + k : NULL,
                                       MERGE, 1, sink->dst + k * MERGE, sink->nt);
                } else {
                    _mm256_storeu_si256((__m256i *)(out + 32 * g), c);
                }
            }
        }
    }
    if (MERGE && sink->nt) _mm_sfence();
    for (int r = 0; r < LANES / 8; r++) _mm256_storeu_si256((__m256i *)(d->x + 8 * r), x[r]);
    d->p = p;
    return done;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __attribute__((always_inline))
size_t decN_avx512(Dec *d, uint8_t *out, size_t steps, const int LANES, const int MERGE, const MergeSink *sink) {
    __m512i x[8];
    for (int r = 0; r < LANES / 16; r++) x[r] = _mm512_loadu_si512(d->x + 16 * r);
    const uint8_t *p = d->p, *end = d->end;
    const int *tab = (const int *)d->tab;
    const __m512i m12 = _mm512_set1_epi32(PROB_SCALE - 1), m12b = _mm512_set1_epi32(0xFFF), lim = _mm512_set1_epi32(RANS_L);
    size_t done = 0;
    for (; done < steps && end - p >= 2 * LANES; done++, out += LANES) {
        /* every gather of the step first: they depend only on the states, and a byte store to
         * `out` in between would keep the compiler from hoisting the next ones (char aliasing) */
        __m512i e[8], v[8];
        __mmask16 need[8];
        for (int r = 0; r < LANES / 16; r++) e[r] = _mm512_i32gather_epi32(_mm512_and_si512(x[r], m12), tab, 4);
        for (int r = 0; r < LANES / 16; r++) {
            __m512i f = _mm512_and_si512(_mm512_srli_epi32(e[r], 8), m12b);
            v[r] = _mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srli_epi32(x[r], PROB_BITS)), _mm512_srli_epi32(e[r], 20));
            need[r] = _mm512_cmplt_epu32_mask(v[r], lim);
        }
        for (int r = 0; r < LANES / 16; r++) {
            __m512i w = _mm512_maskz_expand_epi32(need[r], _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)));
            x[r] = _mm512_mask_or_epi32(v[r], need[r], _mm512_slli_epi32(v[r], 16), w);
            p += 2 * __builtin_popcount((unsigned)need[r]);
        }
        if (MERGE) { /* two registers' 32 symbols at a time merged with the raw planes, as decN_avx2 does */
            for (int g = 0; g < LANES / 32; g++) {
                __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(e[2 * g])),
                                                    _mm512_cvtepi32_epi8(e[2 * g + 1]), 1);
                size_t k = done * LANES + 32 * (size_t)g;
                onnxz_merge32_avx2(c, sink->p[0] + k, MERGE == 4 ? sink->p[1] + k : NULL, MERGE == 4 ? sink->p[2] + k : NULL,
                                   MERGE, 1, sink->dst + k * MERGE, sink->nt);
            }
        } else {
            for (int r = 0; r < LANES / 16; r++) _mm_storeu_si128((__m128i *)(out + 16 * r), _mm512_cvtepi32_epi8(e[r]));
        }
    }
    if (MERGE && sink->nt) _mm_sfence();
    for (int r = 0; r < LANES / 16; r++) _mm512_storeu_si512(d->x + 16 * r, x[r]);
    d->p = p;
    return done;
}

/* Two 32-lane planes decoded in one loop: 4 registers of independent states in flight instead of
 * 2. One 32-lane plane's step is latency-bound (gather, multiply, refill, next gather: the states
 * of two registers cannot hide it); two planes' steps interleaved fill the wait with the other's
 * work, as 64 lanes do, without the writer spending 128 more bytes of states per plane. Same
 * arithmetic as decN_avx512 per plane; full steps of both while each has 64 bytes of words left
 * (a step reads at most one word per lane). Returns the steps done (the same for both). */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static size_t dec32x2_avx512(Dec *da, uint8_t *oa, Dec *db, uint8_t *ob, size_t steps) {
    __m512i x[4];
    x[0] = _mm512_loadu_si512(da->x);
    x[1] = _mm512_loadu_si512(da->x + 16);
    x[2] = _mm512_loadu_si512(db->x);
    x[3] = _mm512_loadu_si512(db->x + 16);
    const uint8_t *p = da->p, *pe = da->end, *q = db->p, *qe = db->end;
    const int *ta = (const int *)da->tab, *tb = (const int *)db->tab;
    const __m512i m12 = _mm512_set1_epi32(PROB_SCALE - 1), m12b = _mm512_set1_epi32(0xFFF), lim = _mm512_set1_epi32(RANS_L);
    size_t done = 0;
    for (; done < steps && pe - p >= 64 && qe - q >= 64; done++, oa += 32, ob += 32) {
        __m512i e[4], v[4];
        __mmask16 need[4];
        e[0] = _mm512_i32gather_epi32(_mm512_and_si512(x[0], m12), ta, 4);
        e[2] = _mm512_i32gather_epi32(_mm512_and_si512(x[2], m12), tb, 4);
        e[1] = _mm512_i32gather_epi32(_mm512_and_si512(x[1], m12), ta, 4);
        e[3] = _mm512_i32gather_epi32(_mm512_and_si512(x[3], m12), tb, 4);
        for (int r = 0; r < 4; r++) {
            __m512i f = _mm512_and_si512(_mm512_srli_epi32(e[r], 8), m12b);
            v[r] = _mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srli_epi32(x[r], PROB_BITS)), _mm512_srli_epi32(e[r], 20));
            need[r] = _mm512_cmplt_epu32_mask(v[r], lim);
        }
        for (int r = 0; r < 2; r++) {
            __m512i w = _mm512_maskz_expand_epi32(need[r], _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)));
            x[r] = _mm512_mask_or_epi32(v[r], need[r], _mm512_slli_epi32(v[r], 16), w);
            p += 2 * __builtin_popcount((unsigned)need[r]);
            __m512i u = _mm512_maskz_expand_epi32(need[r + 2], _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)q)));
            x[r + 2] = _mm512_mask_or_epi32(v[r + 2], need[r + 2], _mm512_slli_epi32(v[r + 2], 16), u);
            q += 2 * __builtin_popcount((unsigned)need[r + 2]);
        }
        _mm_storeu_si128((__m128i *)oa, _mm512_cvtepi32_epi8(e[0]));
        _mm_storeu_si128((__m128i *)(oa + 16), _mm512_cvtepi32_epi8(e[1]));
        _mm_storeu_si128((__m128i *)ob, _mm512_cvtepi32_epi8(e[2]));
        _mm_storeu_si128((__m128i *)(ob + 16), _mm512_cvtepi32_epi8(e[3]));
    }
    _mm512_storeu_si512(da->x, x[0]);
    _mm512_storeu_si512(da->x + 16, x[1]);
    _mm512_storeu_si512(db->x, x[2]);
    _mm512_storeu_si512(db->x + 16, x[3]);
    da->p = p;
    db->p = q;
    return done;
}
#endif /* ONNXZ_X86 */

/* any lane count (small planes): full steps branch-free while words suffice */
static size_t decL_scalar(Dec *d, uint8_t *out, size_t steps) { return decN_scalar(d, out, steps, d->lanes); }
/* the writer's lane counts for planes under 64 KiB (1 and 4): a constant LANES lets the compiler
 * keep the states in registers */
static size_t dec1_scalar(Dec *d, uint8_t *out, size_t steps) { return decN_scalar(d, out, steps, 1); }
static size_t dec4_scalar(Dec *d, uint8_t *out, size_t steps) { return decN_scalar(d, out, steps, 4); }
static size_t dec32_scalar(Dec *d, uint8_t *out, size_t steps) { return decN_scalar(d, out, steps, 32); }
static size_t dec64_scalar(Dec *d, uint8_t *out, size_t steps) { return decN_scalar(d, out, steps, 64); }
static size_t dec128_scalar(Dec *d, uint8_t *out, size_t steps) { return decN_scalar(d, out, steps, 128); }
#if ONNXZ_X86
__attribute__((target("avx2"))) static size_t dec32_avx2(Dec *d, uint8_t *out, size_t steps) { return decN_avx2(d, out, steps, 32, 0, 0, NULL); }
__attribute__((target("avx2"))) static size_t dec64_avx2(Dec *d, uint8_t *out, size_t steps) { return decN_avx2(d, out, steps, 64, 0, 0, NULL); }
__attribute__((target("avx2"))) static size_t dec128_avx2(Dec *d, uint8_t *out, size_t steps) { return decN_avx2(d, out, steps, 128, 0, 0, NULL); }
__attribute__((target("avx2"))) static size_t dec32_avx2l(Dec *d, uint8_t *out, size_t steps) { return decN_avx2(d, out, steps, 32, 1, 0, NULL); }
__attribute__((target("avx2"))) static size_t dec64_avx2l(Dec *d, uint8_t *out, size_t steps) { return decN_avx2(d, out, steps, 64, 1, 0, NULL); }
__attribute__((target("avx2"))) static size_t dec128_avx2l(Dec *d, uint8_t *out, size_t steps) { return decN_avx2(d, out, steps, 128, 1, 0, NULL); }
/* the fused decode + merge of float chunks (dec_merge_run): lanes x lookup kind x width */
#define DEC_MERGE(L, LOADS, W) \
    __attribute__((target("avx2"))) static size_t dec##L##_m##W##_##LOADS(Dec *d, size_t steps, const MergeSink *s) { \
        return decN_avx2(d, NULL, steps, L, LOADS, W, s); \
    }
DEC_MERGE(32, 0, 2) DEC_MERGE(64, 0, 2) DEC_MERGE(128, 0, 2) DEC_MERGE(32, 1, 2) DEC_MERGE(64, 1, 2) DEC_MERGE(128, 1, 2)
DEC_MERGE(32, 0, 4) DEC_MERGE(64, 0, 4) DEC_MERGE(128, 0, 4) DEC_MERGE(32, 1, 4) DEC_MERGE(64, 1, 4) DEC_MERGE(128, 1, 4)
#undef DEC_MERGE
/* the same fused path with the AVX-512 decoder (Zen 4 and later: its gathers beat lookup8 there) */
#define DEC_MERGE512(L, W) \
    __attribute__((target("avx512f,avx512bw,avx512vl"))) static size_t dec##L##_m##W##_512(Dec *d, size_t steps, const MergeSink *s) { \
        return decN_avx512(d, NULL, steps, L, W, s); \
    }
DEC_MERGE512(32, 2) DEC_MERGE512(64, 2) DEC_MERGE512(128, 2) DEC_MERGE512(32, 4) DEC_MERGE512(64, 4) DEC_MERGE512(128, 4)
#undef DEC_MERGE512
__attribute__((target("avx512f,avx512bw,avx512vl"))) static size_t dec32_avx512(Dec *d, uint8_t *out, size_t steps) { return decN_avx512(d, out, steps, 32, 0, NULL); }
__attribute__((target("avx512f,avx512bw,avx512vl"))) static size_t dec64_avx512(Dec *d, uint8_t *out, size_t steps) { return decN_avx512(d, out, steps, 64, 0, NULL); }
__attribute__((target("avx512f,avx512bw,avx512vl"))) static size_t dec128_avx512(Dec *d, uint8_t *out, size_t steps) { return decN_avx512(d, out, steps, 128, 0, NULL); }
#define DECODE(L) (simd_level == 2 ? dec##L##_avx512(d, out, steps)                                             \
                   : simd_level == 1 ? (avx2_loads ? dec##L##_avx2l(d, out, steps) : dec##L##_avx2(d, out, steps)) \
                                     : dec##L##_scalar(d, out, steps))
#else
#define DECODE(L) dec##L##_scalar(d, out, steps)
#endif

static int simd_level = 0, simd_max = 0; /* 0 scalar, 1 AVX2, 2 AVX-512; ONNXZ_ANS_SIMD lowers it */
/* the AVX2 decoder's table lookups: 1 scalar loads (lookup8), 0 the gather instruction. Scalar
 * loads on AMD, where they were measured faster (Zen 3); the gather instruction elsewhere (not
 * measured on Intel here, whose cores since Skylake run it in a few cycles) */
static int avx2_loads = 0;

void onnxz_ans_init(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        for (int i = 0; i < 8; i++) PERM8[m][i] = (m >> i & 1) ? (uint32_t)k++ : 0;
    }
    int level = 0;
#if ONNXZ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) level = 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) level = 2;
#endif
    simd_max = level;
#if ONNXZ_X86
    avx2_loads = __builtin_cpu_is("amd");
#endif
    const char *env = getenv("ONNXZ_ANS_SIMD");
    if (env && env[0] >= '0' && env[0] <= '2' && env[0] - '0' < level) level = env[0] - '0';
    simd_level = level;
}

int onnxz_ans_simd_level(void) { return simd_level; }
void onnxz_ans_set_simd_level(int level) { if (level >= 0) simd_level = level < simd_max ? level : simd_max; }

/* symbols [i0, i0+count) of the plane into out; i0 a multiple of the lane count */
static int dec_run(Dec *d, uint8_t *out, size_t i0, size_t count) {
    if (d->constant) {
        memset(out, d->symbol, count);
        return 0;
    }
    size_t done = 0;
    if (d->lanes == 32) {
        size_t steps = count / 32;
        done = DECODE(32);
        done *= 32;
    } else if (d->lanes == 64) {
        size_t steps = count / 64;
        done = DECODE(64);
        done *= 64;
    } else if (d->lanes == 128) {
        size_t steps = count / 128;
        done = DECODE(128);
        done *= 128;
    } else if (d->lanes == 4) {
        done = dec4_scalar(d, out, count / 4) * 4;
    } else if (d->lanes == 1) {
        done = dec1_scalar(d, out, count);
    } else {
        done = decL_scalar(d, out, count / (size_t)d->lanes) * (size_t)d->lanes;
    }
    return dec_checked(d, out + done, i0 + done, count - done);
}

/* Float chunks (`ans` with the sign move, w 2 or 4) whose plane 0 is coded and planes 1..w-1 raw:
 * symbols [i0, i0+count) of plane 0 (i0 a multiple of the lane count) decoded and merged at once,
 * group by group of 32, with the raw planes (rest[j] at element i0) into out (element i0's bytes):
 * the merge's loads and stores then run beside the decoder's arithmetic instead of in a memory-bound
 * pass of their own. Returns the symbols done (a multiple of the lane count; the caller decodes and
 * merges the rest as before): 0 where no SIMD decoder is in use or the lane count has no SIMD path.
 * With AVX-512 (level 2) the AVX-512 decoder feeds the same AVX2 merge, two registers of 16
 * symbols at a time: before, level 2 decoded plane 0 into a block and merged it in a second pass
 * (the fused path ran at level 1 only). Measured on this host (AMD EPYC with AVX-512, the C call
 * alone, bench/ans_decode_ab.py, 21 rounds, load 9): new/old CPU per round, median, open_nsfw
 * 0.782, open_nsfw_fp16 0.792, minilm_fp32 0.811; the level-1 fused path there measured 4-6%
 * faster than level 2 unfused. */
static size_t dec_merge_run(Dec *d, size_t count, const uint8_t *const *rest, int w, uint8_t *out, int nt) {
#if ONNXZ_X86
    if (simd_level < 1 || d->constant || (w != 2 && w != 4)) return 0;
    MergeSink sink = {{rest[0], w == 4 ? rest[1] : NULL, w == 4 ? rest[2] : NULL}, out, nt && ((uintptr_t)out & 31) == 0};
    size_t steps = count / (size_t)d->lanes;
#define RUN(L) (simd_level == 2 ? (w == 2 ? dec##L##_m2_512(d, steps, &sink) : dec##L##_m4_512(d, steps, &sink)) \
                : w == 2 ? (avx2_loads ? dec##L##_m2_1(d, steps, &sink) : dec##L##_m2_0(d, steps, &sink)) \
                         : (avx2_loads ? dec##L##_m4_1(d, steps, &sink) : dec##L##_m4_0(d, steps, &sink)))
    if (d->lanes == 32) return RUN(32) * 32;
    if (d->lanes == 64) return RUN(64) * 64;
    if (d->lanes == 128) return RUN(128) * 128;
#undef RUN
#endif
    (void)d; (void)count; (void)rest; (void)w; (void)out; (void)nt;
    return 0;
}

static int dec_finished(const Dec *d) {
    if (d->constant) return 1;
    if (d->p != d->end) return 0;
    for (int j = 0; j < d->lanes; j++) if (d->x[j] != RANS_L) return 0;
    return 1;
}

/* Whether an `ans` chunk can go through decode_run: one coded plane (a blob of b[0] = 6: 32
 * lanes) shorter than its n symbols, no sign move or pairs, and the AVX-512 decoder in use. */
static int pairable(const uint8_t *plane, size_t len, size_t n) {
#if ONNXZ_X86
    return simd_level == 2 && n >= 32 && len >= 2 && len < n && plane[0] == 6;
#else
    (void)plane; (void)len; (void)n;
    return 0;
#endif
}

/* Whether pairable() can hold for any chunk (the AVX-512 decoder in use). */
static int pairable_level(void) {
#if ONNXZ_X86
    return simd_level == 2;
#else
    return 0;
#endif
}

/* A chunk of a run decoded two at a time (decode_run): its decoder, output and progress. */
typedef struct {
    Dec *d;
    uint8_t *out;
    size_t n, pos; /* symbols, and those decoded */
    Py_ssize_t task; /* its index in the batch; -1: the slot is free */
} Slot;

/* Finish slot s alone (its last full steps and the checked tail: dec_run) and check its end. */
static const char *finish_slot(Slot *s) {
    const char *err = NULL;
    if (dec_run(s->d, s->out + s->pos, s->pos, s->n - s->pos)) err = "ans words run out";
    else if (!dec_finished(s->d)) err = "ans plane does not end where it should (final states or words)";
    s->task = -1;
    return err;
}

/* Chunks k0..k1-1 of a batch (each pairable: planes[k], lens[k] its plane, outs[k] / ns[k] its
 * output; their checksums passed) decoded two at a time: two slots step together through
 * dec32x2_avx512, and a slot whose chunk ends (or whose words run low) is finished alone and takes
 * the next chunk, so that nearly every step has the other's work beside it, whatever the sizes.
 * The bytes are those of decoding the chunks in turn. 0, or 1 with *failed / *msg the first chunk
 * in batch order that is damaged, as decoding them in turn reports it (a chunk found damaged while
 * an earlier one is in the other slot: that one is finished first, and reported if it fails). */
static int decode_run(const uint8_t *const *planes, const size_t *lens, uint8_t *const *outs, const size_t *ns,
                      Py_ssize_t k0, Py_ssize_t k1, Dec *da, Dec *db, Py_ssize_t *failed, const char **msg) {
    Slot slot[2] = {{da, NULL, 0, 0, -1}, {db, NULL, 0, 0, -1}};
    Py_ssize_t next = k0;
    const char *err = NULL;
    Py_ssize_t bad = -1;
    for (;;) {
        /* fill the free slots, in order */
        for (int i = 0; i < 2 && !err; i++) {
            if (slot[i].task >= 0 || next >= k1) continue;
            Slot *s = &slot[i];
            s->task = next;
            s->out = outs[next];
            s->n = ns[next];
            s->pos = 0;
            err = dec_init(s->d, planes[next], lens[next]);
            if (!err && (s->d->constant || s->d->lanes != 32)) err = "ans plane with an unknown lane count"; /* (pairable: never) */
            if (err) bad = next;
            next++;
        }
        if (err) break;
        Slot *a = &slot[0], *b = &slot[1];
        if (a->task < 0 && b->task < 0) return 0;
        if (a->task < 0 || b->task < 0) { /* the last chunk: alone */
            Slot *s = a->task >= 0 ? a : b;
            bad = s->task;
            err = finish_slot(s);
            if (err) break;
            continue;
        }
        size_t ra = (a->n - a->pos) / 32, rb = (b->n - b->pos) / 32;
        size_t done = dec32x2_avx512(a->d, a->out + a->pos, b->d, b->out + b->pos, ra < rb ? ra : rb) * 32;
        a->pos += done;
        b->pos += done;
        /* retire what cannot take another paired step (its last step done, or words low), lower task first */
        Slot *order[2] = {a->task < b->task ? a : b, a->task < b->task ? b : a};
        for (int i = 0; i < 2 && !err; i++) {
            Slot *s = order[i];
            if (s->n - s->pos >= 32 && s->d->end - s->d->p >= 64) continue;
            bad = s->task;
            err = finish_slot(s);
        }
        if (err) break;
    }
    /* chunk `bad` is damaged; one earlier still in a slot comes first */
    for (int i = 0; i < 2; i++) {
        Slot *s = &slot[i];
        if (s->task >= 0 && s->task < bad) {
            Py_ssize_t t = s->task;
            const char *e = finish_slot(s);
            if (e) { bad = t; err = e; }
        }
    }
    *failed = bad;
    *msg = err;
    return 1;
}

/* One chunk of codec `ans`: w planes of n symbols (plane i raw when its length is n, else an ans
 * blob) merged into out (n*w bytes) in one pass, block by block. NULL or an error message. */
static const char *ans_decode_planes(const uint8_t *const *planes, const size_t *lens, const int *raw,
                                     const uint32_t *const *built, int w, int sign_move, size_t n, uint8_t *out, int nt);

const char *onnxz_ans_decode(const uint8_t *const *planes, const size_t *lens, int w, int sign_move, size_t n, uint8_t *out, int nt) {
    return ans_decode_planes(planes, lens, NULL, NULL, w, sign_move, n, out, nt);
}

/* raw: which planes are stored raw (NULL: those of n bytes; any other must then be shorter);
 * built: per plane, the decode table of its shared table when built already (planes[i] is then
 * the blob without the table: dec_init_built), or NULL (the whole blob: dec_init); built NULL: none */
static const char *ans_decode_planes(const uint8_t *const *planes, const size_t *lens, const int *raw,
                                     const uint32_t *const *built, int w, int sign_move, size_t n, uint8_t *out, int nt) {
    Dec *decs[MAX_PLANES] = {0};
    uint8_t *tmp = NULL;
    const char *err = NULL;
    int coded = 0;
    for (int i = 0; i < w && !err; i++) {
        if (raw ? raw[i] : lens[i] == n) continue;
        if (!raw && lens[i] > n) { err = "ans plane larger than its raw size"; break; }
        decs[i] = (Dec *)malloc(sizeof(Dec));
        if (!decs[i]) { err = "out of memory"; break; }
        err = built && built[i] ? dec_init_built(decs[i], planes[i], lens[i], built[i]) : dec_init(decs[i], planes[i], lens[i]);
        coded++;
    }
    if (!err && w == 1) {
        if (decs[0] && dec_run(decs[0], out, 0, n)) err = "ans words run out";
        else if (!decs[0]) memcpy(out, planes[0], n);
    } else if (!err) {
        if (coded) tmp = (uint8_t *)malloc((size_t)coded * BLOCK);
        if (coded && !tmp) err = "out of memory";
        /* a float chunk with only plane 0 coded (nearly every float chunk): decode and merge fused */
        int fuse = sign_move && coded == 1 && decs[0] != NULL;
        int nt_out = nt && n * w >= NT_BYTES;
        for (size_t lo = 0; lo < n && !err; lo += BLOCK) {
            size_t m = n - lo < BLOCK ? n - lo : BLOCK, at = lo; /* elements [at, at+m) left in this block */
            if (fuse) {
                const uint8_t *rest[MAX_PLANES - 1];
                for (int i = 1; i < w; i++) rest[i - 1] = planes[i] + lo;
                size_t done = dec_merge_run(decs[0], m, rest, w, out + lo * w, nt_out);
                at += done;
                m -= done;
                if (!m) continue;
            }
            const uint8_t *ptr[MAX_PLANES];
            int c = 0;
            for (int i = 0; i < w; i++) {
                if (!decs[i]) { ptr[i] = planes[i] + at; continue; }
                uint8_t *t = tmp + (size_t)c++ * BLOCK;
                if (dec_run(decs[i], t, at, m)) { err = "ans words run out"; break; }
                ptr[i] = t;
            }
            if (!err) onnxz_merge_ptrs_nt(ptr, (Py_ssize_t)m, w, sign_move, out + at * w, nt_out);
        }
    }
    for (int i = 0; i < w && !err; i++)
        if (decs[i] && !dec_finished(decs[i])) err = "ans plane does not end where it should (final states or words)";
    for (int i = 0; i < w; i++) free(decs[i]);
    free(tmp);
    return err;
}

/* `ans` with pairs (8-bit exponents of float32 / bfloat16): the top byte t' of element k comes from
 * its 4-bit rank (two per byte of the ranks plane, high nibble first): table[rank] for rank < 15,
 * else the next byte of escapes. The ranks plane (ceil(n/2) symbols) is raw or an ans blob, as are
 * the planes 1..w-1 in `rest`. Half the symbols to decode of a plain exponent plane, and the order-0
 * model of a pair catches the correlation of neighbouring exponents. NULL or an error message. */
const char *onnxz_ans_decode_pairs(const uint8_t *table, const uint8_t *ranks, size_t rlen, const uint8_t *esc, size_t ne,
                                   const uint8_t *const *rest, const size_t *rest_lens, int w, size_t n, uint8_t *out, int nt) {
    size_t nr = (n + 1) / 2;
    Dec *decs[MAX_PLANES] = {0}; /* 0: ranks, i: plane i */
    uint8_t *tmp = NULL;
    const char *err = NULL;
    if (w != 2 && w != 4) return "ans pairs of a width other than 2 or 4";
    if (rlen > nr) return "ans ranks plane larger than its raw size";
    if (rlen != nr) {
        if (!(decs[0] = (Dec *)malloc(sizeof(Dec)))) return "out of memory";
        err = dec_init(decs[0], ranks, rlen);
    }
    for (int i = 1; i < w && !err; i++) {
        if (rest_lens[i - 1] == n) continue;
        if (rest_lens[i - 1] > n) { err = "ans plane larger than its raw size"; break; }
        if (!(decs[i] = (Dec *)malloc(sizeof(Dec)))) { err = "out of memory"; break; }
        err = dec_init(decs[i], rest[i - 1], rest_lens[i - 1]);
    }
    uint32_t tab[16], lut[256];
    for (int i = 0; i < 15; i++) tab[i] = table[i];
    tab[15] = 0;
    for (unsigned b = 0; b < 256; b++)
        lut[b] = ((b >> 4) == 15 || (b & 15) == 15) ? 1u << 16 : tab[b >> 4] | tab[b & 15] << 8;
    /* scratch: ranks block, t' block (+2: an odd tail writes one pad byte), one block per coded plane */
    if (!err && !(tmp = (uint8_t *)malloc(BLOCK / 2 + BLOCK + 2 + (size_t)MAX_PLANES * BLOCK))) err = "out of memory";
    size_t jj = 0;
    for (size_t lo = 0; lo < n && !err; lo += BLOCK) {
        size_t m = n - lo < BLOCK ? n - lo : BLOCK, rb = (m + 1) / 2;
        const uint8_t *rk = ranks + lo / 2;
        if (decs[0]) {
            if (dec_run(decs[0], tmp, lo / 2, rb)) { err = "ans words run out"; break; }
            rk = tmp;
        }
        uint8_t *tb = tmp + BLOCK / 2;
        for (size_t k = 0; k < m; k += 2) {
            unsigned b = rk[k >> 1];
            uint32_t v = lut[b];
            if (v >> 16) { /* an escape in this pair */
                unsigned r0 = b >> 4, r1 = b & 15u;
                uint32_t t0, t1 = 0;
                if (r0 < 15) t0 = tab[r0]; else if (jj < ne) t0 = esc[jj++]; else { err = "exponent escapes run out"; break; }
                if (k + 1 < m) { /* else: odd n, the pad nibble is ignored */
                    if (r1 < 15) t1 = tab[r1]; else if (jj < ne) t1 = esc[jj++]; else { err = "exponent escapes run out"; break; }
                }
                v = t0 | t1 << 8;
            }
            tb[k] = (uint8_t)v;
            tb[k + 1] = (uint8_t)(v >> 8);
        }
        if (err) break;
        const uint8_t *ptr[MAX_PLANES];
        ptr[0] = tb;
        for (int i = 1; i < w; i++) {
            if (!decs[i]) { ptr[i] = rest[i - 1] + lo; continue; }
            uint8_t *t = tmp + BLOCK / 2 + BLOCK + 2 + (size_t)i * BLOCK;
            if (dec_run(decs[i], t, lo, m)) { err = "ans words run out"; break; }
            ptr[i] = t;
        }
        if (!err) onnxz_merge_ptrs_nt(ptr, (Py_ssize_t)m, w, 1, out + lo * w, nt && n * w >= NT_BYTES);
    }
    if (!err && jj != ne) err = "exponent escapes left over";
    for (int i = 0; i < w && !err; i++)
        if (decs[i] && !dec_finished(decs[i])) err = "ans plane does not end where it should (final states or words)";
    for (int i = 0; i < w; i++) free(decs[i]);
    free(tmp);
    return err;
}

/* ---------------------------------------------------------------- Python wrappers */

/* One ans chunk given as np_ plane buffers (with pairs: table, ranks, escapes, planes 1..w-1) into
 * out (outlen bytes). NULL or what is damaged; *bad_args set (and NULL returned) when the planes do
 * not fit the call at all (the single-chunk wrapper raises ValueError then). */
static const char *decode_chunk(const uint8_t *const *ptr, const size_t *lens, int np_, int sign_move, int pairs,
                                uint8_t *out, size_t outlen, int nt, int *bad_args) {
    int w = pairs ? np_ - 2 : np_;
    *bad_args = 0;
    if (!(w == 1 || w == 2 || w == 4 || w == 8) || outlen % (size_t)w || (w == 1 && sign_move)
        || (pairs && (!sign_move || (w != 2 && w != 4)))) {
        *bad_args = 1;
        return NULL;
    }
    size_t n = outlen / (size_t)w;
    if (n == 0) return "empty ans chunk";
    if (pairs && lens[0] != 15) return "exponent table of the wrong size";
    if (pairs && lens[2] > n) return "more exponent escapes than elements";
    return pairs ? onnxz_ans_decode_pairs(ptr[0], ptr[1], lens[1], ptr[2], lens[2], ptr + 3, lens + 3, w, n, out, nt)
                 : onnxz_ans_decode(ptr, lens, w, sign_move, n, out, nt);
}

/* ans_decode(planes, sign_move, pairs, out) -> None, or a str saying what is damaged.
 * planes: w buffers (plane i raw when it holds n bytes); with pairs: table, ranks, escapes, then
 * planes 1..w-1. */
PyObject *onnxz_py_ans_decode(PyObject *self, PyObject *args) {
    PyObject *seq;
    int sign_move, pairs;
    Py_buffer out, bufs[MAX_PLANES + 2];
    if (!PyArg_ParseTuple(args, "Oppw*", &seq, &sign_move, &pairs, &out)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "planes must be a sequence of buffers");
    if (!fast) { PyBuffer_Release(&out); return NULL; }
    Py_ssize_t np_ = PySequence_Fast_GET_SIZE(fast);
    if (np_ < 1 || np_ > MAX_PLANES + 2) {
        Py_DECREF(fast);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "ans_decode: 1, 2, 4 or 8 planes (pairs: 2 or 4, with the sign move), out a multiple of their number");
        return NULL;
    }
    int got = 0;
    for (; got < np_; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &bufs[got], PyBUF_SIMPLE) < 0) break;
    Py_DECREF(fast);
    PyObject *result = NULL;
    if (got == np_) {
        const uint8_t *ptr[MAX_PLANES + 2];
        size_t lens[MAX_PLANES + 2];
        for (int i = 0; i < np_; i++) { ptr[i] = (const uint8_t *)bufs[i].buf; lens[i] = (size_t)bufs[i].len; }
        const char *err;
        int bad_args;
        Py_BEGIN_ALLOW_THREADS
        err = decode_chunk(ptr, lens, (int)np_, sign_move, pairs, (uint8_t *)out.buf, (size_t)out.len, 1, &bad_args);
        Py_END_ALLOW_THREADS
        if (bad_args) PyErr_SetString(PyExc_ValueError, "ans_decode: 1, 2, 4 or 8 planes (pairs: 2 or 4, with the sign move), out a multiple of their number");
        else if (err) result = PyUnicode_FromString(err);
        else { result = Py_None; Py_INCREF(result); }
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyBuffer_Release(&out);
    return result;
}

/* Decode tables of the shared tables met in one ans_decode_batch call, by the address and size
 * of the table's bytes (the reader hands one bytes object per shared table, so small tensors naming
 * the same table list find it built): read_table + the 4096-slot fill once per table instead of per
 * chunk (42 chunks of rapidocr_cls.int8 naming 2 table lists, ~11 us each). Only a table whose
 * read ends exactly at the end of its bytes is kept (a well-formed one): any other is decoded from
 * the spliced blob as before, so a damaged table gets the same verdict either way. */
#define CACHED_TABLES 16
typedef struct {
    const uint8_t *bytes;
    size_t len;
    uint32_t *tab; /* NULL: not kept (the spliced blob decides) */
} CachedTable;
typedef struct {
    int count;
    CachedTable t[CACHED_TABLES];
} TableCache;

/* the decode table of shared table (tb, tl), built on first use; NULL: not cacheable, or no room */
static const uint32_t *cached_table(TableCache *c, const uint8_t *tb, size_t tl) {
    if (!c) return NULL;
    for (int i = 0; i < c->count; i++)
        if (c->t[i].bytes == tb && c->t[i].len == tl) return c->t[i].tab;
    if (c->count == CACHED_TABLES) return NULL;
    CachedTable *e = &c->t[c->count++];
    e->bytes = tb;
    e->len = tl;
    e->tab = (uint32_t *)malloc(PROB_SCALE * sizeof(uint32_t));
    size_t pos = 0;
    if (e->tab && (build_table(tb, tl, &pos, e->tab) || pos != tl)) {
        free(e->tab);
        e->tab = NULL;
    }
    return e->tab;
}

static void free_tables(TableCache *c) {
    for (int i = 0; i < c->count; i++) free(c->t[i].tab);
    c->count = 0;
}

/* Codec `ans_shared` (FORMAT.md 3.2): w planes of n = outlen/w bytes; plane i is raw when it
 * holds n bytes, else an ans blob, which for tabs[i] not NULL lacks its frequency table: the blob
 * decoded is planes[i][0:1] + tabs[i] + planes[i][1:] (however long that makes it; the plane
 * itself must still be shorter than n; a constant plane, byte 0 = 0, has no table). Same checks
 * and merge as `ans`. cache: decode tables kept over a batch (or NULL). NULL or what is damaged;
 * *bad_args as decode_chunk. GIL not needed. */
static const char *decode_shared(const uint8_t *const *planes, const size_t *plens, int w, int sign_move,
                                 const uint8_t *const *tabs, const size_t *tlens, uint8_t *out, size_t outlen, int nt,
                                 TableCache *cache, int *bad_args) {
    *bad_args = !(w == 1 || w == 2 || w == 4 || w == 8) || outlen % (size_t)w || (w == 1 && sign_move);
    if (*bad_args) return NULL;
    size_t n = outlen / (size_t)w;
    const uint8_t *ptr[MAX_PLANES];
    size_t lens[MAX_PLANES];
    int raw[MAX_PLANES];
    const uint32_t *built[MAX_PLANES] = {0};
    uint8_t *whole[MAX_PLANES] = {0};
    const char *err = NULL;
    if (n == 0) err = "empty ans chunk";
    for (int i = 0; i < w && !err; i++) {
        ptr[i] = planes[i];
        lens[i] = plens[i];
        raw[i] = lens[i] == n;
        if (raw[i]) continue;
        if (lens[i] > n) { err = "ans plane larger than its raw size"; break; }
        if (!tabs[i] || (lens[i] >= 1 && ptr[i][0] == 0)) continue; /* own table, or a constant plane (none) */
        if (lens[i] < 1) { err = "ans plane truncated"; break; }
        if ((built[i] = cached_table(cache, tabs[i], tlens[i]))) continue; /* decoded without the splice */
        if (!(whole[i] = (uint8_t *)malloc(lens[i] + tlens[i]))) { err = "out of memory"; break; }
        whole[i][0] = ptr[i][0];
        memcpy(whole[i] + 1, tabs[i], tlens[i]);
        memcpy(whole[i] + 1 + tlens[i], ptr[i] + 1, lens[i] - 1);
        ptr[i] = whole[i];
        lens[i] += tlens[i];
    }
    if (!err) err = ans_decode_planes(ptr, lens, raw, built, w, sign_move, n, out, nt);
    for (int i = 0; i < w; i++) free(whole[i]);
    return err;
}

/* ans_decode_shared(planes, tables, sign_move, out) -> None, or a str saying what is damaged:
 * one `ans_shared` chunk (decode_shared above); tables: one item per plane, bytes or None. */
PyObject *onnxz_py_ans_decode_shared(PyObject *self, PyObject *args) {
    PyObject *seq, *tseq;
    int sign_move;
    Py_buffer out, bufs[MAX_PLANES], tabs[MAX_PLANES];
    if (!PyArg_ParseTuple(args, "OOpw*", &seq, &tseq, &sign_move, &out)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "planes must be a sequence of buffers");
    PyObject *tfast = fast ? PySequence_Fast(tseq, "tables must be a sequence") : NULL;
    if (!tfast) { Py_XDECREF(fast); PyBuffer_Release(&out); return NULL; }
    Py_ssize_t w = PySequence_Fast_GET_SIZE(fast);
    if (!(w == 1 || w == 2 || w == 4 || w == 8) || PySequence_Fast_GET_SIZE(tfast) != w || out.len % w || (w == 1 && sign_move)) {
        Py_DECREF(fast);
        Py_DECREF(tfast);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "ans_decode_shared: 1, 2, 4 or 8 planes, as many tables (or None), out a multiple of their number");
        return NULL;
    }
    int got = 0, gott = 0, has[MAX_PLANES] = {0};
    for (; got < w; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &bufs[got], PyBUF_SIMPLE) < 0) break;
    for (; got == w && gott < w; gott++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tfast, gott);
        if (t == Py_None) continue;
        if (PyObject_GetBuffer(t, &tabs[gott], PyBUF_SIMPLE) < 0) break;
        has[gott] = 1;
    }
    Py_DECREF(fast);
    Py_DECREF(tfast);
    PyObject *result = NULL;
    if (got == w && gott == w) {
        const uint8_t *ptr[MAX_PLANES], *tp[MAX_PLANES];
        size_t lens[MAX_PLANES], tl[MAX_PLANES];
        for (int i = 0; i < w; i++) {
            ptr[i] = (const uint8_t *)bufs[i].buf;
            lens[i] = (size_t)bufs[i].len;
            tp[i] = has[i] ? (const uint8_t *)tabs[i].buf : NULL;
            tl[i] = has[i] ? (size_t)tabs[i].len : 0;
        }
        const char *err;
        int bad_args;
        Py_BEGIN_ALLOW_THREADS
        err = decode_shared(ptr, lens, (int)w, sign_move, tp, tl, (uint8_t *)out.buf, (size_t)out.len, 1, NULL, &bad_args);
        Py_END_ALLOW_THREADS
        if (err) result = PyUnicode_FromString(err);
        else { result = Py_None; Py_INCREF(result); }
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    for (int i = 0; i < gott && i < w; i++) if (has[i]) PyBuffer_Release(&tabs[i]);
    PyBuffer_Release(&out);
    return result;
}

/* ---------------------------------------------------------------- many chunks in one call
 *
 * Why: one Python call per chunk cost ~0.8 ms of open_nsfw's ~8.5 ms decode (146 chunks, most of
 * them small), and the XXH3-64 of each chunk's stored bytes ran in Python holding the GIL (a second
 * decoding thread waited on it). Here a whole batch is read (pread, for a file), checked and decoded
 * with the GIL released, each chunk hashed right before it is decoded (its bytes then come from
 * cache). The hash is the XXH3_64bits of the xxhash library the Python package `xxhash` is built
 * on, resolved by the reader at run time (set_xxh3) and checked there against xxhash's own digest:
 * the same function, no second implementation to keep in step. */
typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3_64 = NULL;

PyObject *onnxz_py_set_xxh3(PyObject *self, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
    xxh3_64 = (xxh3_fn)(uintptr_t)addr;
    Py_RETURN_NONE;
}

/* xxh3(data) -> int: the digest through the function set by set_xxh3 (the reader's self-check) */
PyObject *onnxz_py_xxh3(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    if (!xxh3_64) { PyBuffer_Release(&b); PyErr_SetString(PyExc_RuntimeError, "xxh3: set_xxh3 was not called"); return NULL; }
    uint64_t h = xxh3_64(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* ---------------------------------------------------------------- the file's XXH3-128, streamed
 *
 * Why: the whole-file XXH3-128 (format 1.2) ran in Python over each 4 MiB restore window after the
 * window was decoded (~9% of unpack CPU on open_nsfw at 1 thread): a second pass over a window
 * that had left the core's caches. ans_decode_batch can instead feed the hash each chunk right
 * after decoding it (chunks are ~0.1-1 MiB: still in L2). The state and its functions are those of
 * the xxhash library inside the Python package `xxhash` (XXH3_createState, XXH3_128bits_reset,
 * XXH3_128bits_update_dispatch, XXH3_128bits_digest, XXH3_freeState), resolved by the reader at run
 * time (set_xxh3_128) and checked there against xxhash.xxh3_128 on streamed input before use. */
typedef struct { uint64_t low64, high64; } xxh128_value; /* XXH128_hash_t of xxHash 0.8 */
static void *(*xxh128_create)(void) = NULL;
static int (*xxh128_free)(void *) = NULL;
static int (*xxh128_reset)(void *) = NULL;
static int (*xxh128_update)(void *, const void *, size_t) = NULL;
static xxh128_value (*xxh128_digest)(const void *) = NULL;
static const char XXH128_CAPSULE[] = "onnxz.xxh3_128_state";

PyObject *onnxz_py_set_xxh3_128(PyObject *self, PyObject *args) {
    unsigned long long create, free_, reset, update, digest;
    if (!PyArg_ParseTuple(args, "KKKKK", &create, &free_, &reset, &update, &digest)) return NULL;
    if (!create || !free_ || !reset || !update || !digest) {
        PyErr_SetString(PyExc_ValueError, "set_xxh3_128: null function address");
        return NULL;
    }
    xxh128_create = (void *(*)(void))(uintptr_t)create;
    xxh128_free = (int (*)(void *))(uintptr_t)free_;
    xxh128_reset = (int (*)(void *))(uintptr_t)reset;
    xxh128_update = (int (*)(void *, const void *, size_t))(uintptr_t)update;
    xxh128_digest = (xxh128_value (*)(const void *))(uintptr_t)digest;
    Py_RETURN_NONE;
}

static void xxh128_capsule_free(PyObject *capsule) {
    void *state = PyCapsule_GetPointer(capsule, XXH128_CAPSULE);
    if (state && xxh128_free) xxh128_free(state);
}

static void *xxh128_state(PyObject *capsule) {
    if (!xxh128_update) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3_128: set_xxh3_128 was not called");
        return NULL;
    }
    return PyCapsule_GetPointer(capsule, XXH128_CAPSULE);
}

/* xxh3_128_new() -> a fresh streaming state (seed 0) */
PyObject *onnxz_py_xxh3_128_new(PyObject *self, PyObject *args) {
    if (!xxh128_create) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3_128_new: set_xxh3_128 was not called");
        return NULL;
    }
    void *state = xxh128_create();
    if (!state) return PyErr_NoMemory();
    if (xxh128_reset(state) != 0) {
        xxh128_free(state);
        PyErr_SetString(PyExc_RuntimeError, "xxh3_128_new: reset failed");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(state, XXH128_CAPSULE, xxh128_capsule_free);
    if (!capsule) xxh128_free(state);
    return capsule;
}

/* xxh3_128_update(state, data): feed bytes (GIL released) */
PyObject *onnxz_py_xxh3_128_update(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Oy*", &capsule, &b)) return NULL;
    void *state = xxh128_state(capsule);
    if (!state) { PyBuffer_Release(&b); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    xxh128_update(state, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* xxh3_128_hexdigest(state) -> str: 32 hex digits, high 64 bits first (xxhash.xxh3_128().hexdigest()) */
PyObject *onnxz_py_xxh3_128_hexdigest(PyObject *self, PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) return NULL;
    void *state = xxh128_state(capsule);
    if (!state) return NULL;
    xxh128_value v = xxh128_digest(state);
    char text[33];
    snprintf(text, sizeof text, "%016llx%016llx", (unsigned long long)v.high64, (unsigned long long)v.low64);
    return PyUnicode_FromStringAndSize(text, 32);
}

typedef struct {
    Py_ssize_t offset, stored;
    size_t lens[MAX_PLANES + 2];
    int np_, flags, shared; /* shared: codec ans_shared, tabs[i] where has_tab[i] */
    uint64_t digest;
    Py_buffer out, tabs[MAX_PLANES];
    int has_tab[MAX_PLANES];
} BatchTask;

enum { FAIL_NONE = -1, FAIL_CHECKSUM = 0, FAIL_DAMAGED = 1, FAIL_TRUNCATED = 2, FAIL_OS = 3, FAIL_ARGS = 4 };

static int parse_task(PyObject *item, BatchTask *t) {
    PyObject *planes, *out, *tables = Py_None;
    if (!PyArg_ParseTuple(item, "nnOKiO|O", &t->offset, &t->stored, &planes, &t->digest, &t->flags, &out, &tables)) return -1;
    if (!PyTuple_Check(planes) || PyTuple_GET_SIZE(planes) < 1 || PyTuple_GET_SIZE(planes) > MAX_PLANES + 2) {
        PyErr_SetString(PyExc_ValueError, "ans_decode_batch: planes must be a tuple of 1 to 10 sizes");
        return -1;
    }
    t->np_ = (int)PyTuple_GET_SIZE(planes);
    size_t sum = 0;
    for (int i = 0; i < t->np_; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(planes, i));
        if (v < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ans_decode_batch: negative plane size");
            return -1;
        }
        t->lens[i] = (size_t)v;
        sum += (size_t)v;
    }
    if (t->offset < 0 || t->stored < 0 || sum != (size_t)t->stored) {
        PyErr_SetString(PyExc_ValueError, "ans_decode_batch: plane sizes must add up to the stored size");
        return -1;
    }
    if (tables != Py_None) { /* ans_shared: one table (bytes) or None per plane */
        if (!PyTuple_Check(tables) || PyTuple_GET_SIZE(tables) != t->np_ || t->np_ > MAX_PLANES) {
            PyErr_SetString(PyExc_ValueError, "ans_decode_batch: tables must be a tuple with one item per plane");
            return -1;
        }
        t->shared = 1;
        for (int i = 0; i < t->np_; i++) {
            PyObject *tb = PyTuple_GET_ITEM(tables, i);
            if (tb == Py_None) continue;
            if (PyObject_GetBuffer(tb, &t->tabs[i], PyBUF_SIMPLE) < 0) return -1;
            t->has_tab[i] = 1;
        }
    }
    return PyObject_GetBuffer(out, &t->out, PyBUF_WRITABLE);
}

/* a chunk of one plane, no sign move or pairs, own table: what decode_run takes (with pairable) */
static int simple_task(const BatchTask *t) { return !t->shared && t->np_ == 1 && !(t->flags & 3); }

#define RUN_MAX 64 /* chunks per decode_run call (a run longer than this goes on in the next one) */

static void release_task(BatchTask *t) {
    for (int i = 0; i < MAX_PLANES; i++) if (t->has_tab[i]) PyBuffer_Release(&t->tabs[i]);
    if (t->out.obj) PyBuffer_Release(&t->out);
}

/* The restore window hashed from `cursor` up to the end of `out` when out lies in it (its bytes
 * and all before them final); returns the new cursor. */
static Py_ssize_t hash_through(void *state, const Py_buffer *window, Py_ssize_t cursor, const Py_buffer *out) {
    uintptr_t w0 = (uintptr_t)window->buf, o0 = (uintptr_t)out->buf;
    if (o0 >= w0 && o0 - w0 + (uintptr_t)out->len <= (uintptr_t)window->len) {
        Py_ssize_t end = (Py_ssize_t)(o0 - w0) + out->len;
        if (end > cursor) {
            xxh128_update(state, (const uint8_t *)window->buf + cursor, (size_t)(end - cursor));
            cursor = end;
        }
    }
    return cursor;
}

/* One task's decode outside decode_run (what the in-order loop of ans_decode_batch does with it):
 * NULL, or what is damaged; *bad_args as decode_chunk. */
static const char *decode_task(const BatchTask *t, const uint8_t *base, TableCache *tables, int *bad_args) {
    const uint8_t *ptr[MAX_PLANES + 2];
    size_t pos = 0;
    for (int i = 0; i < t->np_; i++) { ptr[i] = base + pos; pos += t->lens[i]; }
    if (t->shared) {
        const uint8_t *tp[MAX_PLANES];
        size_t tl[MAX_PLANES];
        for (int i = 0; i < t->np_; i++) {
            tp[i] = t->has_tab[i] ? (const uint8_t *)t->tabs[i].buf : NULL;
            tl[i] = t->has_tab[i] ? (size_t)t->tabs[i].len : 0;
        }
        return decode_shared(ptr, t->lens, t->np_, t->flags & 1, tp, tl, (uint8_t *)t->out.buf, (size_t)t->out.len,
                             !(t->flags & 4), tables, bad_args);
    }
    return decode_chunk(ptr, t->lens, t->np_, t->flags & 1, (t->flags >> 1) & 1, (uint8_t *)t->out.buf,
                        (size_t)t->out.len, !(t->flags & 4), bad_args);
}

/* The whole batch at once, its 32-lane one-plane chunks paired across it: the in-order loop below
 * pairs only chunks that follow each other in the batch, and a small model's tensors interleave
 * them with `ans_shared` and 4-lane chunks (silero_vad_v6.int8: 11 pairable chunks in 6 runs, 60%
 * of their symbols stepped alone). Every chunk's bytes are read first (a file: one pread of the
 * span of the batch, when the scratch holds it) and checked; the others decode in batch order, then
 * the pairable ones as one run (decode_run), then the window is hashed through the last chunk (all
 * its bytes final by then). Same output bytes. Returns 1 when the batch is done; 0 when it is not
 * taken (the span does not fit, too few pairable chunks) or anything failed: the in-order loop then
 * runs the whole batch again from its first chunk, so that what is reported (and hashed) is what
 * decoding in turn reports. GIL not needed. */
static int decode_batch_paired(BatchTask *ts, Py_ssize_t count, int fd, const Py_buffer *src, const Py_buffer *scratch,
                               TableCache *tables, void *hash_state, const Py_buffer *window, Py_ssize_t *cursor) {
    if (!pairable_level() || count < 3) return 0;
    Py_ssize_t simple = 0;
    for (Py_ssize_t k = 0; k < count; k++) simple += simple_task(&ts[k]);
    if (simple < 2) return 0;
    const uint8_t *at = NULL; /* chunk k's bytes at at + ts[k].offset */
    if (fd >= 0) {
        Py_ssize_t lo = ts[0].offset, hi = ts[0].offset + ts[0].stored;
        for (Py_ssize_t k = 1; k < count; k++) {
            if (ts[k].offset < lo) lo = ts[k].offset;
            if (ts[k].offset + ts[k].stored > hi) hi = ts[k].offset + ts[k].stored;
        }
        if (hi - lo > scratch->len) return 0;
        size_t want = (size_t)(hi - lo), got = 0;
        while (got < want) {
            ssize_t r = pread(fd, (uint8_t *)scratch->buf + got, want - got, (off_t)(lo + (Py_ssize_t)got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) return 0; /* (the in-order loop reads again and says what failed) */
            got += (size_t)r;
        }
        at = (const uint8_t *)scratch->buf - lo;
    } else {
        for (Py_ssize_t k = 0; k < count; k++)
            if (ts[k].offset > src->len || ts[k].stored > src->len - ts[k].offset) return 0;
        at = (const uint8_t *)src->buf;
    }
    for (Py_ssize_t k = 0; k < count; k++)
        if (xxh3_64(at + ts[k].offset, (size_t)ts[k].stored) != ts[k].digest) return 0;
    const uint8_t **planes = (const uint8_t **)malloc((size_t)count * sizeof(*planes));
    size_t *lens = (size_t *)malloc((size_t)count * sizeof(size_t)), *ns = (size_t *)malloc((size_t)count * sizeof(size_t));
    uint8_t **outs = (uint8_t **)malloc((size_t)count * sizeof(*outs));
    Dec *da = (Dec *)malloc(sizeof(Dec)), *db = (Dec *)malloc(sizeof(Dec));
    int ok = planes && lens && ns && outs && da && db;
    Py_ssize_t run = 0;
    for (Py_ssize_t k = 0; k < count && ok; k++) {
        const BatchTask *t = &ts[k];
        const uint8_t *base = at + t->offset;
        if (simple_task(t) && pairable(base, t->lens[0], (size_t)t->out.len)) {
            planes[run] = base;
            lens[run] = t->lens[0];
            outs[run] = (uint8_t *)t->out.buf;
            ns[run] = (size_t)t->out.len;
            run++;
            continue;
        }
        int bad_args;
        if (decode_task(t, base, tables, &bad_args) || bad_args) ok = 0;
    }
    if (ok && run) {
        Py_ssize_t bad = -1;
        const char *msg = NULL;
        if (decode_run(planes, lens, outs, ns, 0, run, da, db, &bad, &msg)) ok = 0;
    }
    free(planes); free(lens); free(ns); free(outs); free(da); free(db);
    if (!ok) return 0;
    if (hash_state)
        for (Py_ssize_t k = 0; k < count; k++) *cursor = hash_through(hash_state, window, *cursor, &ts[k].out);
    return 1;
}

/* ans_decode_batch(source, scratch, tasks) -> None or (i, code, message)
 * source: the packed bytes (a buffer) or a file descriptor (int); scratch: a writable buffer at least
 * as large as the largest stored chunk (used for a file only); tasks: tuples (offset, stored,
 * plane sizes, xxh3 digest, flags (1: sign move, 2: pairs, 4: keep the output in cache: no
 * non-temporal stores, for output read again soon, e.g. a restore window hashed and written), out
 * [, tables: for an `ans_shared` chunk, one shared table (bytes) or None per plane]). Stops at the first failure: code 0
 * checksum, 1 damaged (message), 2 truncated file, 3 OS error (errno), 4 bad planes for the codec.
 * hashing (optional): (XXH3-128 state from xxh3_128_new, the restore window, cursor); the tasks' outs
 * then lie in the window in increasing order, every byte of it before each out already final;
 * window[cursor:end of each out] is fed to the state right after that chunk decodes, and success
 * returns the new cursor (int) instead of None. */
PyObject *onnxz_py_ans_decode_batch(PyObject *self, PyObject *args) {
    PyObject *source, *scratch_obj, *tasks, *hashing = Py_None;
    if (!PyArg_ParseTuple(args, "OOO!|O", &source, &scratch_obj, &PyList_Type, &tasks, &hashing)) return NULL;
    if (!xxh3_64) { PyErr_SetString(PyExc_RuntimeError, "ans_decode_batch: set_xxh3 was not called"); return NULL; }
    /* hashing: (XXH3-128 state, window, cursor): window[cursor:] is fed to the state up to the end
     * of each decoded chunk that lies in the window (the caller's bytes before it are final) */
    PyObject *hash_capsule = NULL;
    void *hash_state = NULL;
    Py_buffer window = {0};
    Py_ssize_t cursor = 0;
    if (hashing != Py_None) {
        if (!PyArg_ParseTuple(hashing, "Ow*n", &hash_capsule, &window, &cursor)) return NULL;
        hash_state = xxh128_state(hash_capsule);
        if (!hash_state || cursor < 0 || cursor > window.len) {
            if (hash_state) PyErr_SetString(PyExc_ValueError, "ans_decode_batch: hashing cursor outside the window");
            PyBuffer_Release(&window);
            return NULL;
        }
    }
    int fd = -1;
    Py_buffer src = {0}, scratch = {0};
    if (PyLong_Check(source)) {
        fd = (int)PyLong_AsLong(source);
        if (fd < 0) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad file descriptor"); return NULL; }
        if (PyObject_GetBuffer(scratch_obj, &scratch, PyBUF_WRITABLE) < 0) return NULL;
    } else if (PyObject_GetBuffer(source, &src, PyBUF_SIMPLE) < 0) {
        if (hash_state) PyBuffer_Release(&window);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(tasks), parsed = 0;
    BatchTask *ts = (BatchTask *)calloc(count ? (size_t)count : 1, sizeof(BatchTask));
    PyObject *result = NULL;
    if (!ts) { PyErr_NoMemory(); goto done; }
    for (; parsed < count; parsed++) {
        if (parse_task(PyList_GET_ITEM(tasks, parsed), &ts[parsed]) < 0) goto done;
        if (fd >= 0 && ts[parsed].stored > scratch.len) {
            parsed++;
            PyErr_SetString(PyExc_ValueError, "ans_decode_batch: scratch smaller than a chunk");
            goto done;
        }
    }
    Py_ssize_t failed = -1;
    int code = FAIL_NONE, err_no = 0;
    const char *msg = NULL;
    TableCache tables = {0};
    /* file bytes [held_lo, held_hi) are in scratch: read for an earlier task of a run */
    Py_ssize_t held_lo = 0, held_hi = 0;
    /* a run for decode_run: its chunks' planes, sizes, outputs; the two decoders (made on first use) */
    const uint8_t *run_planes[RUN_MAX];
    size_t run_lens[RUN_MAX], run_ns[RUN_MAX];
    uint8_t *run_outs[RUN_MAX];
    Dec *run_decs[2] = {NULL, NULL};
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t first = decode_batch_paired(ts, count, fd, &src, &scratch, &tables, hash_state, &window, &cursor) ? count : 0;
    for (Py_ssize_t k = first; k < count; k++) {
        BatchTask *t = &ts[k];
        const uint8_t *base;
        if (fd >= 0) {
            if (t->offset < held_lo || t->offset + t->stored > held_hi) {
                /* one pread for this chunk and the ones stored right after it that come next in
                 * the batch (small tensors lie back to back: one system call instead of dozens,
                 * ~1-2 us each), up to READ_RUN bytes and the scratch's size */
                size_t want = (size_t)t->stored;
                for (Py_ssize_t j = k + 1; j < count; j++) {
                    const BatchTask *u = &ts[j];
                    if (u->offset != t->offset + (Py_ssize_t)want || want + (size_t)u->stored > READ_RUN ||
                        want + (size_t)u->stored > (size_t)scratch.len)
                        break;
                    want += (size_t)u->stored;
                }
                size_t got = 0;
                while (got < want) {
                    ssize_t r = pread(fd, (uint8_t *)scratch.buf + got, want - got, (off_t)(t->offset + (Py_ssize_t)got));
                    if (r < 0) {
                        if (errno == EINTR) continue;
                        /* an error past this chunk's bytes is the later chunk's: it reads again */
                        if (got < (size_t)t->stored) { err_no = errno; code = FAIL_OS; }
                        break;
                    }
                    if (r == 0) break; /* end of file: the chunks it cut short are truncated */
                    got += (size_t)r;
                }
                held_lo = t->offset;
                held_hi = t->offset + (Py_ssize_t)got;
                if (code == FAIL_NONE && got < (size_t)t->stored) code = FAIL_TRUNCATED;
            }
            base = (const uint8_t *)scratch.buf + (t->offset - held_lo);
        } else {
            if (t->offset > src.len || t->stored > src.len - t->offset) code = FAIL_TRUNCATED;
            base = (const uint8_t *)src.buf + (src.len ? t->offset : 0);
        }
        if (code == FAIL_NONE && xxh3_64(base, (size_t)t->stored) != t->digest) code = FAIL_CHECKSUM;
        if (code == FAIL_NONE && simple_task(t) && pairable(base, t->lens[0], (size_t)t->out.len)) {
            /* a run of chunks of one 32-lane plane each whose bytes are at hand and pass their
             * checksums: decoded two at a time (decode_run); else this one goes alone */
            Py_ssize_t end = k + 1;
            run_planes[0] = base;
            while (end < count && end - k < RUN_MAX) {
                BatchTask *u = &ts[end];
                const uint8_t *at = NULL;
                if (!simple_task(u)) break;
                if (fd >= 0) {
                    if (u->offset >= held_lo && u->offset + u->stored <= held_hi) at = (const uint8_t *)scratch.buf + (u->offset - held_lo);
                } else if (u->offset <= src.len && u->stored <= src.len - u->offset) {
                    at = (const uint8_t *)src.buf + u->offset;
                }
                if (!at || !pairable(at, u->lens[0], (size_t)u->out.len) || xxh3_64(at, (size_t)u->stored) != u->digest) break;
                run_planes[end - k] = at;
                end++;
            }
            if (end - k >= 2) {
                if (!run_decs[0]) run_decs[0] = (Dec *)malloc(sizeof(Dec));
                if (!run_decs[1]) run_decs[1] = (Dec *)malloc(sizeof(Dec));
            }
            if (end - k >= 2 && run_decs[0] && run_decs[1]) {
                for (Py_ssize_t j = k; j < end; j++) {
                    run_lens[j - k] = ts[j].lens[0];
                    run_outs[j - k] = (uint8_t *)ts[j].out.buf;
                    run_ns[j - k] = (size_t)ts[j].out.len;
                }
                Py_ssize_t bad = -1;
                if (decode_run(run_planes, run_lens, run_outs, run_ns, 0, end - k, run_decs[0], run_decs[1], &bad, &msg)) {
                    code = FAIL_DAMAGED;
                    failed = k + bad;
                    break;
                }
                if (hash_state)
                    for (Py_ssize_t j = k; j < end; j++) cursor = hash_through(hash_state, &window, cursor, &ts[j].out);
                k = end - 1;
                continue;
            }
        }
        if (code == FAIL_NONE) {
            int bad_args;
            msg = decode_task(t, base, &tables, &bad_args);
            if (bad_args) code = FAIL_ARGS;
            else if (msg) code = FAIL_DAMAGED;
        }
        if (code != FAIL_NONE) { failed = k; break; }
        if (hash_state) cursor = hash_through(hash_state, &window, cursor, &t->out); /* (still in cache) */
    }
    free_tables(&tables);
    free(run_decs[0]);
    free(run_decs[1]);
    Py_END_ALLOW_THREADS
    if (code == FAIL_NONE) {
        if (hash_state) result = PyLong_FromSsize_t(cursor);
        else {
            result = Py_None;
            Py_INCREF(result);
        }
    } else {
        const char *text = code == FAIL_DAMAGED ? msg : code == FAIL_OS ? strerror(err_no) : "";
        result = Py_BuildValue("(nis)", failed, code, text);
    }
done:
    for (Py_ssize_t k = 0; k < parsed; k++) release_task(&ts[k]);
    if (parsed < count && ts) release_task(&ts[parsed]); /* a task that failed to parse half-way */
    free(ts);
    if (fd < 0) PyBuffer_Release(&src);
    else PyBuffer_Release(&scratch);
    if (hash_state) PyBuffer_Release(&window);
    return result;
}

/* ans_avx2_loads([flag]) -> how the AVX2 decoder looks its table up (1 scalar loads, 0 the gather
 * instruction); a flag given selects it (tests compare both on the same bytes) */
PyObject *onnxz_py_ans_avx2_loads(PyObject *self, PyObject *args) {
    int flag = -1;
    if (!PyArg_ParseTuple(args, "|i", &flag)) return NULL;
    if (flag >= 0) avx2_loads = flag != 0;
    return PyLong_FromLong(avx2_loads);
}

/* ans_simd([level]) -> the decoder in use (0 scalar, 1 AVX2, 2 AVX-512); a level given selects it,
 * capped by what the CPU supports (tests compare the decoders on the same bytes) */
PyObject *onnxz_py_ans_simd(PyObject *self, PyObject *args) {
    int level = -1;
    if (!PyArg_ParseTuple(args, "|i", &level)) return NULL;
    if (level >= 0) onnxz_ans_set_simd_level(level);
    return PyLong_FromLong(onnxz_ans_simd_level());
}
