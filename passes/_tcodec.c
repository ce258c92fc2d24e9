/* Decoder of the tensor codec's entropy-coded chunks (passes/tensorcodec.py), in C.
 *
 * Why C: the numba decoder (passes/_tcodec_kernels.py, kept as the fallback) decodes one symbol
 * at a time; each symbol waits for the previous one twice (the rANS state, and the context, which
 * is a bucket of the two previous magnitudes), so a core sits idle on load latency most of the
 * time (~75 M symbols/s). The chunks of a blob are independent (own rANS state, own raw-bit
 * stream, contexts restart with every scan unit, the trellis state with every chunk), so here each
 * thread decodes up to LANES chunks in lockstep, one unit at a time: the dependency chains of the
 * lanes overlap. All units have the same length and position classes, so the lanes share the loop
 * over positions. The rANS renormalisation is branch-free; one packed table entry per
 * (context, slot) gives the token, its frequency and its offset in one load. Where the CPU has
 * AVX-512, each thread decodes 16 chunks at once in the lanes of one vector instead (see "AVX-512"
 * below: ~1.8x the scalar lanes per core), the scalar lanes finishing its last few chunks; where
 * it has AVX2 only, the same 16 chunks in two vectors of 8 (see "AVX2": ~2x the scalar lanes per
 * core on Zen 3).
 *
 * decode(words, woff, raw, roff, chunk_units, out, row_cls, pos_cls, lut, freq, recon,
 *        unit_len, units_per_row, n_pos_cls, nb_ctx, tcq, step, threads, lanes[, simd[, n_ctx]])
 *        -> 0 | -1
 *   simd    0 (default): scalar lanes only; 1..5: the vector lanes (below: AVX-512, else AVX2)
 *           where the CPU has them, while a thread has at least that many chunks; + 16: they read
 *           every token's raw bits the way they read the rare ones their windows do not hold (a
 *           test hook: same values); + 32: the AVX2 lanes also where the CPU has AVX-512 (a test hook: same values)
 *   words   uint16 (any byte alignment), with WORD_PAD elements after the last chunk's (read, never used)
 *   woff, roff, chunk_units  int64[n_chunks + 1]   raw uint32   out float32 (written)
 *   row_cls uint8[rows]   pos_cls int32[unit_len]   lut int32[LUT_SIZE]
 *   freq    uint32[n_ctx * N_TOKENS], every row summing to PROB_SCALE; or, where n_ctx >= 0 is
 *           given, the blob's own records of the n_ctx contexts back to back (u8 n_tokens, then
 *           n_tokens u16 little-endian frequencies), exactly those bytes: decode_array passes them
 *           as they are (building the uint32 rows in numpy cost ~60-100 us a call, ~3% of the decode
 *           of a 0.6 M-weight tensor on 2 threads)
 *   recon   float32[32] reconstruction (times step) of magnitudes < 16, Q0 then Q1
 * The caller (tensorcodec._decode) has validated the layout; the sizes are checked again here, so
 * a wrong call is an error, never an out-of-bounds access. Same output as the numba decoder,
 * bit for bit, and -1 exactly where it fails (damaged entropy-coded data). Releases the GIL.
 * threads > 1: the calling thread and threads - 1 helpers kept between calls (see "helper threads").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Tuning (not the instruction set: any x86-64 runs this): GCC's generic tuning schedules the
 * decode loop ~25% slower than its Skylake tuning on the Xeons we measured (150 -> 195 M symbols/s
 * per core); Haswell and Zen 3 tunings do not help. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("tune=skylake")
#endif

#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define RANS_L (1u << 16)
#define N_TOKENS 232
#define LUT_SIZE 4096
#define MAX_LANES 4

/* A renormalisation word. decode_array reads the words in place in the blob, where they may start
 * at an odd byte offset (the side information before them is zlib data of any length): loads
 * through this type make no alignment assumption (copying the words to an aligned array cost ~1.5
 * ms of a ~50 ms decode on one core before the threads start, on 11.7 M weights at 47 dB). */
typedef uint16_t u16u __attribute__((aligned(1)));

typedef struct {
    uint32_t mbase; /* smallest magnitude of the token */
    uint32_t nb;    /* raw bits of the token, sign included */
} Token;

typedef struct {
    /* shared, read-only */
    const u16u *words;
    const int64_t *woff, *roff, *chunk_units;
    const uint8_t *raw;      /* raw-bit stream as bytes (LSB first), RAW_PAD_BYTES readable after */
    float *out;
    const uint8_t *row_cls;
    const uint64_t *pos_off; /* table offset of position class: pos_cls[j] * nq * nb_ctx * PROB_SCALE */
    uint32_t lut_off[LUT_SIZE]; /* table offset of neighbour bucket: lut[s] * PROB_SCALE */
    const uint32_t *tab;     /* n_ctx * PROB_SCALE packed entries: (freq-1) << 20 | bias << 8 | token */
    uint32_t vbits[512];     /* float bits of the reconstruction of magnitudes < 256: Q0 then Q1 */
    uint32_t trans[8];       /* trellis: state s, parity p -> table offset of the next state's
                              * quantizer | next state; all zero without the trellis */
    Token tok[256];
    int64_t n_chunks, unit_len, upr;
    uint64_t row_mul;        /* table offset of one row class */
    int tcq;
    float step;
    int lanes;
    /* for the AVX-512 lanes (see there) */
    int simd, simd_min;          /* vector lanes used (0, SIMD_AVX512, SIMD_AVX2); fewest chunks they decode (below: the scalar lanes finish) */
    int simd_wide;               /* every token's raw bits read as 8 bytes (to test that rare path) */
    int64_t nb_ctx;
    const int32_t *pos_off32;    /* pos_off, as int32 (the vector path needs all offsets < 2**31) */
    const uint8_t *row_cls_pad;  /* row_cls and 4 readable bytes after (one 32-bit gather each) */
    float recon2[32];            /* value of magnitudes < 16, Q0 then Q1 (0 exactly for magnitude 0) */
    int32_t thr[8];              /* neighbour sums where the bucket steps up, and by how much (<< 12) */
    uint32_t thr_delta[8];
    int n_thr, use_thr;          /* use_thr: the LUT is <= 8 steps up (else it is gathered) */
    /* the decode table, built by all threads (contexts in blocks) before any decodes */
    const uint32_t *freq;        /* the rows (rec == NULL), else: */
    const uint8_t *rec;          /* the records, context c's at rec + rec_off[c] */
    const int64_t *rec_off;
    int64_t n_ctx, next_ctx, ctx_done;
    int bad_table;
    pthread_mutex_t mu;
    pthread_cond_t built;
    /* work distribution and result */
    int64_t next_chunk;
    int failed;
    /* helpers of the pool (below) that joined this job and that are done with it; guarded by its lock */
    int want, joined, left;
} Job;

#define WORD_PAD 264        /* words readable after the last chunk's: > BLOCK + 1 */
#define BLOCK 256           /* symbols per lane between two bounds checks */
#define RAW_PAD_BYTES 1056  /* >= BLOCK * 4 + 8: one symbol takes at most 29 raw bits */

typedef struct {
    uint32_t x;
    const u16u *wp, *wend;
    uint64_t bitpos, rstart, rend; /* raw stream, in bits from the stream's start */
    uint32_t bad;
    int64_t u, uend;   /* next unit, end unit of the chunk */
    int64_t row, col;  /* row of unit u, and u's index within it */
    uint32_t st;       /* trellis state */
} Lane;

/* The float bits of a magnitude m >= 256 (beyond the vbits table) at quantizer q: the one formula
 * every set of lanes uses (scalar, AVX2, AVX-512), so that they stay bit-identical. */
static inline uint32_t big_value_bits(double mult, uint32_t m, uint32_t q, float step) {
    union { float f; uint32_t i; } v;
    v.f = (float)(mult * (double)m - (double)q) * step;
    return v.i;
}

static int lane_start(const Job *jb, Lane *ln, int64_t ci) {
    int64_t w0 = jb->woff[ci], w1 = jb->woff[ci + 1];
    if (w1 - w0 < 2) return -1;
    ln->x = ((uint32_t)jb->words[w0] << 16) | jb->words[w0 + 1];
    ln->wp = jb->words + w0 + 2;
    ln->wend = jb->words + w1;
    ln->bitpos = ln->rstart = (uint64_t)jb->roff[ci] * 32;
    ln->rend = (uint64_t)jb->roff[ci + 1] * 32;
    ln->bad = 0;
    ln->u = jb->chunk_units[ci];
    ln->uend = jb->chunk_units[ci + 1];
    ln->row = ln->u / jb->upr;
    ln->col = ln->u % jb->upr;
    ln->st = 0;
    return 0;
}

static int lane_finish_ok(const Lane *ln) {
    /* the raw words of the chunk are exactly those holding the bits read (as the encoder wrote) */
    return !ln->bad && ln->x == RANS_L && ln->wp == ln->wend
           && (ln->bitpos - ln->rstart + 31) / 32 == (ln->rend - ln->rstart) / 32;
}

/* n_units units of each of the first k lanes, in lockstep. k is a constant at every call site so
 * the compiler unrolls the lane loops; the lane state lives in local arrays (registers or stack
 * slots no store can alias) for the duration of the call. */
static inline __attribute__((always_inline)) void
decode_lanes(const Job *jb, Lane *ln, const int k, int64_t n_units) {
    const int64_t unit_len = jb->unit_len, upr = jb->upr;
    const uint64_t row_mul = jb->row_mul;
    const uint64_t *restrict pos_off = jb->pos_off;
    const uint32_t *restrict lut_off = jb->lut_off;
    const uint32_t *restrict tab = jb->tab;
    const Token *restrict tok = jb->tok;
    const uint32_t *restrict vbits = jb->vbits;
    const uint32_t *restrict trans = jb->trans;
    const uint8_t *restrict row_cls = jb->row_cls;
    const uint8_t *restrict raw = jb->raw;
    float *restrict out = jb->out;
    const float step = jb->step;
    const double mult = jb->tcq ? 2.0 : 1.0;
    uint32_t x[MAX_LANES], bad[MAX_LANES], st[MAX_LANES]; /* st: trellis state | its table offset */
    const u16u *wp[MAX_LANES], *wend[MAX_LANES];
    uint64_t bitpos[MAX_LANES], rend[MAX_LANES], rbase[MAX_LANES], p1[MAX_LANES], p2[MAX_LANES];
    int64_t u[MAX_LANES], row[MAX_LANES], col[MAX_LANES];
    float *o[MAX_LANES];
    for (int l = 0; l < k; l++) {
        x[l] = ln[l].x; bad[l] = ln[l].bad; st[l] = ln[l].st;
        wp[l] = ln[l].wp; wend[l] = ln[l].wend; bitpos[l] = ln[l].bitpos; rend[l] = ln[l].rend;
        u[l] = ln[l].u; row[l] = ln[l].row; col[l] = ln[l].col;
    }
/* One symbol of lane l at table offset C (context without the quantizer): its magnitude into M,
 * its value into o[l][J]. Branch-free but for magnitudes >= 256; a lane may read past its chunk
 * (into the next one or the padding) for up to BLOCK symbols, caught by the check after a block. */
#define DECODE_ONE(l, C, J, M) do {                                                          \
        uint32_t e_ = tab[(C) + (st[l] & ~3u) + (x[l] & (PROB_SCALE - 1))];                  \
        uint32_t xx_ = ((e_ >> 20) + 1) * (x[l] >> PROB_BITS) + ((e_ >> 8) & 0xFFF);          \
        uint32_t need_ = xx_ < RANS_L;                                                       \
        uint32_t w_ = *wp[l];                                                                \
        x[l] = need_ ? (xx_ << 16) | w_ : xx_;                                               \
        wp[l] += need_;                                                                      \
        uint64_t r_;                                                                         \
        memcpy(&r_, raw + (bitpos[l] >> 3), 8);                                              \
        r_ >>= bitpos[l] & 7;                                                                \
        const Token tk_ = tok[e_ & 0xFF];                                                    \
        uint32_t bits_ = (uint32_t)(r_ & ((1ull << tk_.nb) - 1));                            \
        bitpos[l] += tk_.nb;                                                                 \
        uint32_t m_ = tk_.mbase + (bits_ >> 1);                                              \
        uint32_t q_ = (st[l] >> 1) & 1;                                                      \
        uint32_t vb_;                                                                        \
        if (__builtin_expect(m_ < 256, 1)) {                                                 \
            vb_ = vbits[q_ * 256 + m_];                                                      \
        } else {                                                                             \
            vb_ = big_value_bits(mult, m_, q_, step);                                        \
        }                                                                                    \
        union { uint32_t i; float f; } v_;                                                   \
        v_.i = vb_ ^ (bits_ << 31);                                                          \
        o[l][J] = v_.f;                                                                      \
        st[l] = trans[2 * (st[l] & 3) + (m_ & 1)];                                           \
        M = m_;                                                                              \
    } while (0)
/* after a block: a lane that read past its chunk is damaged; pull it back inside */
#define CHECK_LANES() do {                                                                   \
        for (int l = 0; l < k; l++) {                                                        \
            if (wp[l] > wend[l]) { bad[l] = 1; wp[l] = wend[l]; }                            \
            if (bitpos[l] > rend[l]) { bad[l] = 1; bitpos[l] = rend[l]; }                    \
        }                                                                                    \
    } while (0)
    for (int64_t it = 0; it < n_units; it++) {
        for (int l = 0; l < k; l++) {
            rbase[l] = row_cls[row[l]] * row_mul;
            o[l] = out + u[l] * unit_len;
        }
        /* position 0: context bucket 0; position 1 sees twice the first magnitude */
        for (int l = 0; l < k; l++) {
            uint32_t m0;
            DECODE_ONE(l, rbase[l] + pos_off[0], 0, m0);
            p1[l] = p2[l] = m0;
        }
        for (int64_t j0 = 1; j0 < unit_len; j0 += BLOCK) {
            int64_t j1 = j0 + BLOCK < unit_len ? j0 + BLOCK : unit_len;
            for (int64_t j = j0; j < j1; j++) {
                for (int l = 0; l < k; l++) {
                    uint64_t s = p1[l] + p2[l];
                    s = s < LUT_SIZE - 1 ? s : LUT_SIZE - 1;
                    uint32_t m1;
                    DECODE_ONE(l, rbase[l] + pos_off[j] + lut_off[s], j, m1);
                    p2[l] = p1[l];
                    p1[l] = m1;
                }
            }
            CHECK_LANES();
        }
        CHECK_LANES(); /* (units of one element) */
        for (int l = 0; l < k; l++) {
            u[l]++;
            if (++col[l] == upr) {
                col[l] = 0;
                row[l]++;
            }
        }
    }
#undef DECODE_ONE
#undef CHECK_LANES
    for (int l = 0; l < k; l++) {
        ln[l].x = x[l]; ln[l].bad = bad[l]; ln[l].st = st[l];
        ln[l].wp = wp[l]; ln[l].bitpos = bitpos[l];
        ln[l].u = u[l]; ln[l].row = row[l]; ln[l].col = col[l];
    }
}

static int64_t take_chunk(Job *jb) {
    return __atomic_fetch_add(&jb->next_chunk, 1, __ATOMIC_RELAXED);
}

/* The scalar lanes: k lanes already started (k may be 0), refilled from the queue until it is
 * empty; returns 1 when a chunk failed. */
static int run_scalar(Job *jb, Lane *ln, int k) {
    int failed = 0;
    for (;;) {
        /* fill empty lanes with the next chunks */
        while (k < jb->lanes) {
            int64_t ci = take_chunk(jb);
            if (ci >= jb->n_chunks) break;
            if (lane_start(jb, &ln[k], ci) != 0) {
                failed = 1;
                continue;
            }
            k++;
        }
        if (k == 0 || failed || __atomic_load_n(&jb->failed, __ATOMIC_RELAXED)) break;
        int64_t n = ln[0].uend - ln[0].u;
        for (int l = 1; l < k; l++)
            if (ln[l].uend - ln[l].u < n) n = ln[l].uend - ln[l].u;
        switch (k) {
            case 4: decode_lanes(jb, ln, 4, n); break;
            case 3: decode_lanes(jb, ln, 3, n); break;
            case 2: decode_lanes(jb, ln, 2, n); break;
            default: decode_lanes(jb, ln, 1, n); break;
        }
        /* retire finished lanes (keeping the others in order) */
        int kk = 0;
        for (int l = 0; l < k; l++) {
            if (ln[l].u == ln[l].uend) {
                if (!lane_finish_ok(&ln[l])) failed = 1;
            } else {
                if (ln[l].bad) failed = 1;
                ln[kk++] = ln[l];
            }
        }
        k = kk;
    }
    return failed;
}

/* ---- AVX-512: 16 chunks per thread in the lanes of one vector ------------------------------
 * Why: the scalar lanes above wait on two loads per symbol (table entry, then the next context);
 * three interleaved chunks hide only part of that latency and run out of registers. Here one
 * vector lane per chunk decodes 16 chunks at once: the table entries are gathered, the
 * renormalisation words and the raw bits come from windows of each lane's next 64 bits of either
 * stream, read every WIN4 steps (a gather costs per element, ~16 cycles for 16 here: gathering a
 * word and 4 raw bytes per lane every step, as this did before 2026-12-02, took ~15% of the
 * decode on Zen 5); the token's magnitude base and raw-bit count are computed, not
 * looked up; the neighbour bucket is a sum of compares with the LUT's steps (when it has <= 8);
 * values below 256 are computed (centroids by a permute, others (mult*m - q) * step exactly as
 * the table holds them); the rare magnitudes >= 256 are fixed up one by one. Same output and the
 * same refusals as the scalar lanes (the tests and the fuzz compare them); the scalar lanes finish
 * the last few chunks of a thread, and run alone on CPUs without AVX-512 and on tensors whose
 * offsets do not fit 31 bits. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(TC_NO_SIMD) /* (-DTC_NO_SIMD: the portable build) */
#define TC_SIMD 1
#include <immintrin.h>
#define SL 16
#define MAX_THR 8
#define WIN4 4 /* steps between two reads of the AVX-512 lanes' windows */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define SIMD_AVX512 1 /* Job.simd: which vector lanes */
#define SIMD_AVX2 2

typedef struct {
    int32_t x[SL], wp[SL], wend[SL], rel[SL], rlen[SL], rbyte[SL], st[SL], bad[SL], row[SL],
        col[SL], rowbase[SL];
} __attribute__((aligned(64))) SLanes;

typedef struct {
    SLanes v;
    int64_t u[SL], uend[SL], ci[SL];
    int64_t ob[SL]; /* output index of the lane's next value not yet written */
    int active[SL];
} SState;

static int slane_start(const Job *jb, SState *S, int l, int64_t ci) {
    int64_t w0 = jb->woff[ci], w1 = jb->woff[ci + 1];
    if (w1 - w0 < 2) return -1;
    S->v.x[l] = (int32_t)(((uint32_t)jb->words[w0] << 16) | jb->words[w0 + 1]);
    S->v.wp[l] = (int32_t)(w0 + 2);
    S->v.wend[l] = (int32_t)w1;
    S->v.rel[l] = 0;
    S->v.rlen[l] = (int32_t)((jb->roff[ci + 1] - jb->roff[ci]) * 32);
    S->v.rbyte[l] = (int32_t)(jb->roff[ci] * 4);
    S->v.st[l] = 0;
    S->v.bad[l] = 0;
    S->u[l] = jb->chunk_units[ci];
    S->uend[l] = jb->chunk_units[ci + 1];
    S->ci[l] = ci;
    S->ob[l] = S->u[l] * jb->unit_len;
    S->v.row[l] = (int32_t)(S->u[l] / jb->upr);
    S->v.col[l] = (int32_t)(S->u[l] % jb->upr);
    S->v.rowbase[l] = (int32_t)(jb->row_cls[S->v.row[l]] * jb->row_mul);
    S->active[l] = 1;
    return 0;
}

/* lane l of the vectors as a scalar lane (to finish its chunk there, or to check its end) */
static void slane_to_lane(const Job *jb, const SState *S, int l, Lane *ln) {
    int64_t ci = S->ci[l];
    ln->x = (uint32_t)S->v.x[l];
    ln->wp = jb->words + S->v.wp[l];
    ln->wend = jb->words + jb->woff[ci + 1];
    ln->rstart = (uint64_t)jb->roff[ci] * 32;
    ln->rend = (uint64_t)jb->roff[ci + 1] * 32;
    ln->bitpos = ln->rstart + (uint32_t)S->v.rel[l];
    ln->bad = (uint32_t)S->v.bad[l];
    ln->u = S->u[l];
    ln->uend = S->uend[l];
    ln->row = S->v.row[l];
    ln->col = S->v.col[l];
    uint32_t s = (uint32_t)S->v.st[l];
    ln->st = ((uint32_t)((s >> 1) * jb->nb_ctx) << PROB_BITS) | s;
}

/* lanes k of r: the 32 raw bits at (byte rb, shift sh) read as 8 bytes (tokens of more raw bits
 * than the lane's window still holds) */
AVX512 __attribute__((noinline, cold)) static __m512i raw_wide(const uint8_t *raw, __m512i r, __m512i rb,
                                                               __m512i sh, __mmask16 k) {
    __m512i lo = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), (__mmask8)k, _mm512_castsi512_si256(rb), raw, 1);
    __m512i hi = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), (__mmask8)(k >> 8),
                                             _mm512_extracti64x4_epi64(rb, 1), raw, 1);
    lo = _mm512_srlv_epi64(lo, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(sh)));
    hi = _mm512_srlv_epi64(hi, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sh, 1)));
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(lo)), _mm512_cvtepi64_epi32(hi), 1);
    return _mm512_mask_mov_epi32(r, k, w);
}

/* magnitudes >= 256 (rare): the value as the scalar lanes compute it, over the one scattered */
AVX512 __attribute__((noinline, cold)) static void fix_big(const Job *jb, __mmask16 k, __m512i m,
                                                           __m512i q, __m512i bits, int32_t *row) {
    uint32_t am[SL], aq[SL], ab[SL];
    _mm512_storeu_si512(am, m); _mm512_storeu_si512(aq, q);
    _mm512_storeu_si512(ab, bits);
    const double mult = jb->tcq ? 2.0 : 1.0;
    for (int l = 0; l < SL; l++) {
        if (!((k >> l) & 1)) continue;
        uint32_t v = big_value_bits(mult, am[l], aq[l], jb->step) ^ (ab[l] << 31);
        memcpy(&row[l], &v, 4);
    }
}

/* 16 steps of 16 lanes (buf row t: step t of every lane) to each lane's next 16 outputs */
AVX512 static inline void flush16(SState *S, float *out, const int32_t *buf, __mmask16 kact) {
    __m512i r[SL], t[SL];
    for (int i = 0; i < SL; i++) r[i] = _mm512_load_si512(buf + SL * i);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++) {
            t[8 * h + c] = _mm512_shuffle_i32x4(r[8 * h + c], r[8 * h + 4 + c], 0x88);
            t[8 * h + 4 + c] = _mm512_shuffle_i32x4(r[8 * h + c], r[8 * h + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    }
    for (int l = 0; l < SL; l++) {
        if (!((kact >> l) & 1)) continue;
        _mm512_storeu_si512(out + S->ob[l], r[l]);
        S->ob[l] += SL;
    }
}

AVX512 static void decode_simd(const Job *jb, SState *S, int64_t n_units, __mmask16 kact) {
    const int64_t unit_len = jb->unit_len;
    const int32_t upr = (int32_t)jb->upr;
    const int32_t *restrict pos32 = jb->pos_off32;
    const int32_t *restrict tab = (const int32_t *)jb->tab;
    const int32_t *restrict lutv = (const int32_t *)jb->lut_off;
    const u16u *words = jb->words;
    const uint8_t *raw = jb->raw;
    float *out = jb->out;
    const __m512i one = _mm512_set1_epi32(1), m4095 = _mm512_set1_epi32(PROB_SCALE - 1),
                  m16 = _mm512_set1_epi32(0xFFFF), m12 = _mm512_set1_epi32(0xFFF),
                  mff = _mm512_set1_epi32(0xFF), c16 = _mm512_set1_epi32(16),
                  c8 = _mm512_set1_epi32(8), c7 = _mm512_set1_epi32(7), c2 = _mm512_set1_epi32(2),
                  c255 = _mm512_set1_epi32(255), c256 = _mm512_set1_epi32(256),
                  rl = _mm512_set1_epi32(RANS_L), zero = _mm512_setzero_si512();
    const __m512i qoff = _mm512_set1_epi32((int32_t)(jb->nb_ctx << PROB_BITS));
    const __m512i multv = _mm512_set1_epi32(jb->tcq ? 2 : 1);
    const __m512i tcqmask = _mm512_set1_epi32(jb->tcq ? -1 : 0);
    const __m512i lut0 = _mm512_set1_epi32((int32_t)jb->lut_off[0]);
    const __m512 stepv = _mm512_set1_ps(jb->step);
    const __m512 rec0 = _mm512_loadu_ps(jb->recon2), rec1 = _mm512_loadu_ps(jb->recon2 + 16);
    const int n_thr = jb->n_thr, use_thr = jb->use_thr;
    int32_t buf[SL * SL] __attribute__((aligned(64)));
    __m512i thr[MAX_THR], dlt[MAX_THR];
    for (int i = 0; i < MAX_THR; i++) {
        thr[i] = _mm512_set1_epi32(i < n_thr ? jb->thr[i] : (int32_t)PROB_SCALE);
        dlt[i] = _mm512_set1_epi32(i < n_thr ? (int32_t)jb->thr_delta[i] : 0);
    }
    __m512i x = _mm512_load_si512(S->v.x), wp = _mm512_load_si512(S->v.wp),
            wend = _mm512_load_si512(S->v.wend), rel = _mm512_load_si512(S->v.rel),
            rlen = _mm512_load_si512(S->v.rlen), rbyte = _mm512_load_si512(S->v.rbyte),
            st = _mm512_load_si512(S->v.st),
            row = _mm512_load_si512(S->v.row), col = _mm512_load_si512(S->v.col),
            rowbase = _mm512_load_si512(S->v.rowbase);
    __mmask16 bad = _mm512_test_epi32_mask(_mm512_load_si512(S->v.bad), _mm512_load_si512(S->v.bad));
    __m512i stoff = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(st, c2), qoff);
    __m512i p1 = zero, p2 = zero;
    int cnt = 0; /* steps in buf */
    /* each lane's next 4 renormalisation words (wlo: the next two, whi: the two after) and its next
     * raw bits (rlo: the next 32, rhi: the 32 after; avail of them valid), read every WIN4 steps
     * (a lane takes at most one word a step) or sooner where a lane's raw bits ran out */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, one);
    const __m512i c32 = _mm512_set1_epi32(32), c64 = _mm512_set1_epi32(64);
    const __mmask16 kwide = jb->simd_wide ? kact : 0; /* (the test hook: every token read the rare way) */
    __m512i wlo = zero, whi = zero, rlo = zero, rhi = zero, avail = zero;
    int phase = 0, force = 0;

/* one symbol of every lane at context offset CTX (without the quantizer's); its value into the
 * next row of buf (written out 16 steps at a time, transposed: no scatter);
 * its magnitude (saturated at 4095) into MS */
#define SSTEP(CTX, MS) do {                                                                     \
        if (phase == 0) SREFILL();                                                                 \
        __m512i idx_ = _mm512_add_epi32(_mm512_add_epi32(CTX, stoff), _mm512_and_si512(x, m4095)); \
        __m512i e_ = _mm512_i32gather_epi32(idx_, tab, 4);                                         \
        __m512i fr_ = _mm512_add_epi32(_mm512_srli_epi32(e_, 20), one);                            \
        __m512i bi_ = _mm512_and_si512(_mm512_srli_epi32(e_, 8), m12);                             \
        __m512i xx_ = _mm512_add_epi32(_mm512_mullo_epi32(fr_, _mm512_srli_epi32(x, PROB_BITS)), bi_); \
        __mmask16 need_ = _mm512_mask_cmplt_epu32_mask(kact, xx_, rl);                             \
        x = _mm512_mask_mov_epi32(xx_, need_, _mm512_or_si512(_mm512_slli_epi32(xx_, 16),          \
                                                              _mm512_and_si512(wlo, m16)));        \
        wlo = _mm512_mask_or_epi32(wlo, need_, _mm512_srli_epi32(wlo, 16), _mm512_slli_epi32(whi, 16)); \
        whi = _mm512_mask_srli_epi32(whi, need_, whi, 16);                                         \
        wp = _mm512_mask_add_epi32(wp, need_, wp, one);                                            \
        /* token -> raw bits and smallest magnitude: t < 16: (t > 0, t); else                      \
         * q = (t - 16) >> 3: (q + 2, (8 + (t - 16) % 8) << (q + 1)) */                            \
        __m512i t_ = _mm512_and_si512(e_, mff);                                                    \
        __mmask16 sm_ = _mm512_cmplt_epu32_mask(t_, c16);                                          \
        __m512i tb_ = _mm512_sub_epi32(t_, c16);                                                   \
        __m512i tq_ = _mm512_srai_epi32(tb_, 3);                                                   \
        __m512i nb_ = _mm512_mask_mov_epi32(_mm512_add_epi32(tq_, c2), sm_, _mm512_min_epu32(t_, one)); \
        __m512i mb_ = _mm512_mask_mov_epi32(                                                       \
            _mm512_sllv_epi32(_mm512_add_epi32(_mm512_and_si512(tb_, c7), c8), _mm512_add_epi32(tq_, one)), \
            sm_, t_);                                                                              \
        /* raw bits: from the window; where it holds fewer than the token's, read at the lane's   \
         * bit position (8 bytes), and all windows are read again at the next step */              \
        __m512i r_ = rlo;                                                                          \
        __mmask16 wide_ = _mm512_mask_cmpgt_epi32_mask(kact, nb_, avail) | kwide;                  \
        if (__builtin_expect(wide_ != 0, 0)) {                                                     \
            r_ = raw_wide(raw, r_, _mm512_add_epi32(rbyte, _mm512_srli_epi32(rel, 3)),             \
                          _mm512_and_si512(rel, c7), wide_);                                       \
            force = 1;                                                                             \
        }                                                                                          \
        __m512i bits_ = _mm512_and_si512(r_, _mm512_sub_epi32(_mm512_sllv_epi32(one, nb_), one));  \
        rel = _mm512_mask_add_epi32(rel, kact, rel, nb_);                                          \
        rlo = _mm512_or_si512(_mm512_srlv_epi32(rlo, nb_), _mm512_sllv_epi32(rhi, _mm512_sub_epi32(c32, nb_))); \
        rhi = _mm512_srlv_epi32(rhi, nb_);                                                         \
        avail = _mm512_sub_epi32(avail, nb_);                                                      \
        __m512i m_ = _mm512_add_epi32(mb_, _mm512_srli_epi32(bits_, 1));                           \
        __m512i q_ = _mm512_srli_epi32(st, 1);                                                     \
        /* value: centroid below 16, (mult * m - q) * step below 256 (as the table holds them) */   \
        __m512i mi_ = _mm512_min_epu32(m_, c255);                                                  \
        __m512 vc_ = _mm512_permutex2var_ps(rec0, _mm512_add_epi32(_mm512_slli_epi32(q_, 4), mi_), rec1); \
        __m512 vf_ = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_mullo_epi32(multv, mi_), q_)), stepv); \
        __m512i v_ = _mm512_castps_si512(_mm512_mask_mov_ps(vf_, _mm512_cmplt_epu32_mask(m_, c16), vc_)); \
        v_ = _mm512_xor_si512(v_, _mm512_slli_epi32(bits_, 31));                                   \
        _mm512_store_si512(buf + SL * cnt, v_);                                                    \
        __mmask16 big_ = _mm512_mask_cmpge_epu32_mask(kact, m_, c256);                             \
        if (__builtin_expect(big_ != 0, 0)) fix_big(jb, big_, m_, q_, bits_, buf + SL * cnt);      \
        if (++cnt == SL) {                                                                         \
            flush16(S, out, buf, kact);                                                            \
            cnt = 0;                                                                               \
        }                                                                                          \
        /* trellis: next state ((s & 1) ^ parity) << 1 | s >> 1 (always 0 without it) */            \
        st = _mm512_and_si512(tcqmask, _mm512_or_si512(                                            \
            _mm512_slli_epi32(_mm512_and_si512(_mm512_xor_si512(st, m_), one), 1), q_));           \
        stoff = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(st, c2), qoff);                      \
        MS = _mm512_min_epu32(m_, m4095);                                                          \
        phase = force ? 0 : (phase + 1) & (WIN4 - 1);                                              \
        force = 0;                                                                                 \
    } while (0)
/* the windows, at the lanes' positions */
#define SREFILL() do {                                                                             \
        __m512i g0_ = _mm512_mask_i32gather_epi64(zero, (__mmask8)kact, _mm512_castsi512_si256(wp), words, 2); \
        __m512i g1_ = _mm512_mask_i32gather_epi64(zero, (__mmask8)(kact >> 8), _mm512_extracti64x4_epi64(wp, 1), words, 2); \
        wlo = _mm512_permutex2var_epi32(g0_, even, g1_);                                           \
        whi = _mm512_permutex2var_epi32(g0_, odd, g1_);                                            \
        __m512i rb_ = _mm512_add_epi32(rbyte, _mm512_srli_epi32(rel, 3));                          \
        __m512i sh_ = _mm512_and_si512(rel, c7);                                                   \
        __m512i h0_ = _mm512_mask_i32gather_epi64(zero, (__mmask8)kact, _mm512_castsi512_si256(rb_), raw, 1); \
        __m512i h1_ = _mm512_mask_i32gather_epi64(zero, (__mmask8)(kact >> 8), _mm512_extracti64x4_epi64(rb_, 1), raw, 1); \
        h0_ = _mm512_srlv_epi64(h0_, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(sh_)));         \
        h1_ = _mm512_srlv_epi64(h1_, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sh_, 1)));   \
        rlo = _mm512_permutex2var_epi32(h0_, even, h1_);                                           \
        rhi = _mm512_permutex2var_epi32(h0_, odd, h1_);                                            \
        avail = _mm512_sub_epi32(c64, sh_);                                                        \
    } while (0)
#define SCHECK() do {                                                                              \
        __mmask16 kw_ = _mm512_cmpgt_epi32_mask(wp, wend);                                         \
        bad |= kw_;                                                                                \
        wp = _mm512_mask_mov_epi32(wp, kw_, wend);                                                 \
        __mmask16 kr_ = _mm512_cmpgt_epu32_mask(rel, rlen);                                        \
        bad |= kr_;                                                                                \
        rel = _mm512_mask_mov_epi32(rel, kr_, rlen);                                               \
        if (kw_ | kr_) phase = 0; /* (the windows, read again) */                                \
    } while (0)
    for (int64_t it = 0; it < n_units; it++) {
        __m512i ms;
        __m512i c0 = _mm512_add_epi32(rowbase, _mm512_set1_epi32(pos32[0]));
        SSTEP(c0, ms);
        p1 = p2 = ms;
        for (int64_t j0 = 1; j0 < unit_len; j0 += BLOCK) {
            int64_t j1 = j0 + BLOCK < unit_len ? j0 + BLOCK : unit_len;
            for (int64_t j = j0; j < j1; j++) {
                __m512i s = _mm512_min_epu32(_mm512_add_epi32(p1, p2), m4095);
                __m512i lo;
                if (use_thr) {
                    lo = lut0;
                    for (int i = 0; i < MAX_THR; i++)
                        lo = _mm512_mask_add_epi32(lo, _mm512_cmpge_epu32_mask(s, thr[i]), lo, dlt[i]);
                } else {
                    lo = _mm512_i32gather_epi32(s, lutv, 4);
                }
                __m512i c = _mm512_add_epi32(_mm512_add_epi32(rowbase, _mm512_set1_epi32(pos32[j])), lo);
                __m512i m1;
                SSTEP(c, m1);
                p2 = p1;
                p1 = m1;
            }
            SCHECK();
        }
        SCHECK(); /* (units of one element) */
        col = _mm512_add_epi32(col, one);
        __mmask16 kr = _mm512_mask_cmpeq_epi32_mask(kact, col, _mm512_set1_epi32(upr));
        if (kr) {
            col = _mm512_mask_mov_epi32(col, kr, zero);
            row = _mm512_mask_add_epi32(row, kr, row, one);
            __m512i rc = _mm512_and_si512(_mm512_mask_i32gather_epi32(zero, kr, row, jb->row_cls_pad, 1), mff);
            rowbase = _mm512_mask_mullo_epi32(rowbase, kr, rc, _mm512_set1_epi32((int32_t)jb->row_mul));
        }
    }
#undef SSTEP
#undef SREFILL
#undef SCHECK
    (void)rl;
    for (int l = 0; l < SL; l++) { /* the steps left in buf */
        if (!((kact >> l) & 1)) continue;
        for (int t = 0; t < cnt; t++) memcpy(&out[S->ob[l] + t], &buf[SL * t + l], 4); /* the bits */
        S->ob[l] += cnt;
    }
    _mm512_store_si512(S->v.x, x); _mm512_store_si512(S->v.wp, wp); _mm512_store_si512(S->v.rel, rel);
    _mm512_store_si512(S->v.st, st);
    _mm512_store_si512(S->v.row, row); _mm512_store_si512(S->v.col, col);
    _mm512_store_si512(S->v.rowbase, rowbase);
    _mm512_store_si512(S->v.bad, _mm512_maskz_mov_epi32(bad, one));
}

/* ---- AVX2: the same 16 lanes as two vectors of 8 ------------------------------------------------
 * Why: CPUs with AVX2 but no AVX-512 (AMD Zen 2/3, older Intel) ran the scalar lanes only. Same
 * lanes, state and hand-over as the AVX-512 path (SState, slane_start, run_simd), the same
 * bitstream and output; the differences are those of the instruction set: no mask registers
 * (lane masks are vectors of 0 / -1), no unsigned compares (every compared quantity is < 2**31
 * but the rANS state, tested by its high half instead), no 32-entry permute (the centroids are
 * four 8-entry permutes and two blends), and the neighbour bucket is the number of the LUT's steps
 * the sum has passed, turned into its table offset by one 8-entry permute (the LUT has <= 7
 * steps; else it is gathered). The two vectors' dependency chains (table entry -> magnitude ->
 * next context -> table entry) are independent, so the core overlaps them. Gathers: the table
 * entry, the renormalisation word and the raw bits, 8 lanes each (slow on Zen 3, ~10 ns each, but
 * scalar loads into vectors measured slower still, as did keeping two words per lane to gather
 * them less often; a 1-byte token table (4x smaller: L2-resident) with a second gather for the
 * token's frequency was no faster). Lanes are filled from the first: with <= 8 chunks left (they
 * have the same length but the last) one vector runs. */
#define AVX2F __attribute__((target("avx2")))
#define HL 8 /* lanes per vector */
/* steps per gather of the renormalisation words and the raw bits: a lane takes at most one word a
 * step, and its 32-bit gather holds two; the raw-bit window holds >= 25 bits at its first step, the
 * rare tokens reaching past it are read again (avx2_raw_wide) */
#define WIN_STEPS 2

#define G32(base, idx, scale) _mm256_i32gather_epi32((const int *)(base), idx, scale)

/* lanes (bitmask) of r: the 32 raw bits at bit rel of the lane's stream (from byte rbyte) read as 8
 * bytes (the token's raw bits reach past the window) */
AVX2F __attribute__((noinline, cold)) static __m256i avx2_raw_wide(const uint8_t *raw, __m256i r, __m256i rbyte,
                                                                 __m256i rel, int lanes) {
    int32_t ar[HL], ab[HL], as[HL];
    _mm256_storeu_si256((__m256i *)ar, r); _mm256_storeu_si256((__m256i *)ab, rbyte);
    _mm256_storeu_si256((__m256i *)as, rel);
    for (int l = 0; l < HL; l++) {
        if (!((lanes >> l) & 1)) continue;
        uint64_t w;
        memcpy(&w, raw + (uint32_t)ab[l] + ((uint32_t)as[l] >> 3), 8);
        ar[l] = (int32_t)(uint32_t)(w >> (as[l] & 7));
    }
    return _mm256_loadu_si256((const __m256i *)ar);
}

/* lanes (bitmask) with magnitudes >= 256 (rare): the value as the scalar lanes compute it */
AVX2F __attribute__((noinline, cold)) static void avx2_fix_big(const Job *jb, int lanes, __m256i m, __m256i q,
                                                             __m256i bits, int32_t *row) {
    uint32_t am[HL], aq[HL], ab[HL];
    _mm256_storeu_si256((__m256i *)am, m); _mm256_storeu_si256((__m256i *)aq, q);
    _mm256_storeu_si256((__m256i *)ab, bits);
    const double mult = jb->tcq ? 2.0 : 1.0;
    for (int l = 0; l < HL; l++) {
        if (!((lanes >> l) & 1)) continue;
        uint32_t v = big_value_bits(mult, am[l], aq[l], jb->step) ^ (ab[l] << 31);
        memcpy(&row[l], &v, 4);
    }
}

/* 8 steps of the 8 lanes of vector h (buf row t: step t of all 16 lanes) to each lane's next 8
 * outputs: an 8x8 transpose */
AVX2F static inline void avx2_flush8(SState *S, float *out, const int32_t *buf, int h, int act) {
    __m256i r[HL], t[HL];
    for (int i = 0; i < HL; i++) r[i] = _mm256_load_si256((const __m256i *)(buf + SL * i + HL * h));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        r[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x20);
        t[4 + c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x31);
    }
    for (int l = 0; l < HL; l++) {
        if (!((act >> l) & 1)) continue;
        _mm256_storeu_si256((__m256i *)(out + S->ob[HL * h + l]), t[l]);
        S->ob[HL * h + l] += HL;
    }
}

/* the lanes of vectors h0 .. h0 + nh - 1 (nh: 1 or 2, a constant at each call site) */
/* (the loops over the vectors are unrolled: their state stays in registers, and their steps
 * interleave) */
AVX2F static inline __attribute__((always_inline)) void
avx2_lanes(const Job *jb, SState *S, int64_t n_units, int kact, const int h0, const int nh, const int full) {
    const int64_t unit_len = jb->unit_len;
    const int32_t *restrict pos32 = jb->pos_off32;
    const int32_t *restrict tab = (const int32_t *)jb->tab;
    const int32_t *restrict lutv = (const int32_t *)jb->lut_off;
    const u16u *words = jb->words;
    const uint8_t *raw = jb->raw;
    float *out = jb->out;
    const __m256i one = _mm256_set1_epi32(1), m4095 = _mm256_set1_epi32(PROB_SCALE - 1),
                  m16 = _mm256_set1_epi32(0xFFFF), m12 = _mm256_set1_epi32(0xFFF),
                  mff = _mm256_set1_epi32(0xFF), c15 = _mm256_set1_epi32(15), c16 = _mm256_set1_epi32(16),
                  c8 = _mm256_set1_epi32(8), c7 = _mm256_set1_epi32(7), c2 = _mm256_set1_epi32(2),
                  c255 = _mm256_set1_epi32(255), zero = _mm256_setzero_si256();
    const __m256i qoff = _mm256_set1_epi32((int32_t)(jb->nb_ctx << PROB_BITS));
    const __m256i c32 = _mm256_set1_epi32(jb->simd_wide ? 0 : 32); /* (0: the test hook, see py_decode) */
    const __m256i multv = _mm256_set1_epi32(jb->tcq ? 2 : 1);
    const __m256i tcqmask = _mm256_set1_epi32(jb->tcq ? -1 : 0);
    const __m256 stepv = _mm256_set1_ps(jb->step);
    const __m256 rec[4] = {_mm256_loadu_ps(jb->recon2), _mm256_loadu_ps(jb->recon2 + 8),
                           _mm256_loadu_ps(jb->recon2 + 16), _mm256_loadu_ps(jb->recon2 + 24)};
    const int use_thr = jb->use_thr && jb->n_thr < HL;
    /* neighbour bucket by steps passed: offset of c steps at index (-c) & 7 (vpermd reads 3 bits) */
    int32_t boff[HL];
    __m256i thrm1[HL - 1];
    {
        int32_t acc = (int32_t)jb->lut_off[0];
        for (int c = 0; c < HL; c++) {
            if (c > 0 && c <= jb->n_thr) acc += (int32_t)jb->thr_delta[c - 1];
            boff[(HL - c) & (HL - 1)] = acc;
        }
        for (int i = 0; i < HL - 1; i++) thrm1[i] = _mm256_set1_epi32(i < jb->n_thr ? jb->thr[i] - 1 : (int32_t)PROB_SCALE);
    }
    const __m256i boffv = _mm256_loadu_si256((const __m256i *)boff);
    int32_t buf[HL * SL] __attribute__((aligned(32)));
    __m256i x[2], wp[2], wend[2], rel[2], rlen[2], rbyte[2], st[2], col[2], rowbase[2], bad[2], act[2],
        wwin[2], wbase[2], rwin[2], rbase[2], stoff[2], p1[2], p2[2];
    int actb[2];
    _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {
#define LD(F) _mm256_load_si256((const __m256i *)(S->v.F + HL * h))
        x[h] = LD(x); wp[h] = LD(wp); wend[h] = LD(wend); rel[h] = LD(rel); rlen[h] = LD(rlen);
        rbyte[h] = LD(rbyte); st[h] = LD(st); col[h] = LD(col); rowbase[h] = LD(rowbase);
        bad[h] = _mm256_cmpgt_epi32(LD(bad), zero);
#undef LD
        actb[h] = (kact >> (HL * h)) & 0xFF;
        int32_t a[HL];
        for (int l = 0; l < HL; l++) a[l] = (actb[h] >> l) & 1 ? -1 : 0;
        act[h] = _mm256_loadu_si256((const __m256i *)a);
        /* the word a renormalisation would take next, loaded ahead (off the state's dependency chain) */
        stoff[h] = _mm256_and_si256(_mm256_sub_epi32(zero, _mm256_srli_epi32(st[h], 1)), qoff);
        p1[h] = p2[h] = zero;
    }
    /* the lanes' masks; all ones when every lane of the vectors decodes (the compiler drops them) */
#define ACT(h) (full ? _mm256_set1_epi32(-1) : act[h])
    int cnt = 0; /* steps in buf */
    int phase = 0; /* steps since the windows were gathered */

/* the table entry of every lane of vector h at context offset CTX + LO (without the quantizer's;
 * LO, the neighbour bucket's, comes last: the other terms are known earlier) */
#define ENTRY(h, CTX, LO) G32(tab, _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(CTX, stoff[h]),     \
                                                                     _mm256_and_si256(x[h], m4095)), LO), 4)
/* one symbol of every lane of vector h, of table entries E; its value into row cnt of buf; its
 * magnitude (saturated at 4095) into MS. (The entries of all vectors are gathered first: the
 * step waits on them, and the vectors' waits overlap only when their gathers are issued together.) */
#define ASTEP(h, E, MS) do {                                                                         \
        if (phase == 0) { /* the windows, every WIN_STEPS steps */                                     \
            wwin[h] = G32(words, wp[h], 2);                                                            \
            wbase[h] = wp[h];                                                                          \
            rwin[h] = G32(raw, _mm256_add_epi32(rbyte[h], _mm256_srli_epi32(rel[h], 3)), 1);           \
            rbase[h] = _mm256_andnot_si256(c7, rel[h]);                                                \
        }                                                                                              \
        __m256i e_ = E;                                                                                \
        __m256i fr_ = _mm256_add_epi32(_mm256_srli_epi32(e_, 20), one);                                \
        __m256i bi_ = _mm256_and_si256(_mm256_srli_epi32(e_, 8), m12);                                 \
        __m256i xx_ = _mm256_add_epi32(_mm256_mullo_epi32(fr_, _mm256_srli_epi32(x[h], PROB_BITS)), bi_); \
        __m256i need_ = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_srli_epi32(xx_, 16), zero), ACT(h)); \
        __m256i w_ = _mm256_and_si256(_mm256_srlv_epi32(wwin[h],                                       \
                                      _mm256_slli_epi32(_mm256_sub_epi32(wp[h], wbase[h]), 4)), m16);  \
        x[h] = _mm256_blendv_epi8(xx_, _mm256_or_si256(_mm256_slli_epi32(xx_, 16), w_), need_);        \
        wp[h] = _mm256_sub_epi32(wp[h], need_);                                                        \
        /* raw bits: from the window (>= 25 bits at its first step; checked below) */                 \
        __m256i off_ = _mm256_sub_epi32(rel[h], rbase[h]);                                             \
        __m256i r_ = _mm256_srlv_epi32(rwin[h], off_);                                                 \
        /* token -> raw bits and smallest magnitude: t < 16: (t > 0, t); else                          \
         * q = (t - 16) >> 3: (q + 2, (8 + (t - 16) % 8) << (q + 1)) */                                \
        __m256i t_ = _mm256_and_si256(e_, mff);                                                        \
        __m256i sm_ = _mm256_cmpgt_epi32(c16, t_);                                                     \
        __m256i tb_ = _mm256_sub_epi32(t_, c16);                                                       \
        __m256i tq_ = _mm256_srai_epi32(tb_, 3);                                                       \
        __m256i nb_ = _mm256_blendv_epi8(_mm256_add_epi32(tq_, c2), _mm256_min_epu32(t_, one), sm_);   \
        __m256i mb_ = _mm256_blendv_epi8(                                                              \
            _mm256_sllv_epi32(_mm256_add_epi32(_mm256_and_si256(tb_, c7), c8), _mm256_add_epi32(tq_, one)), \
            t_, sm_);                                                                                  \
        int wide_ = _mm256_movemask_ps(_mm256_castsi256_ps(                                            \
            _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_add_epi32(off_, nb_), c32), ACT(h))));          \
        if (__builtin_expect(wide_ != 0, 0)) r_ = avx2_raw_wide(raw, r_, rbyte[h], rel[h], wide_);     \
        __m256i bits_ = _mm256_and_si256(r_, _mm256_sub_epi32(_mm256_sllv_epi32(one, nb_), one));      \
        rel[h] = _mm256_add_epi32(rel[h], _mm256_and_si256(nb_, ACT(h)));                              \
        __m256i m_ = _mm256_add_epi32(mb_, _mm256_srli_epi32(bits_, 1));                               \
        __m256i q_ = _mm256_srli_epi32(st[h], 1);                                                      \
        /* value: centroid below 16, (mult * m - q) * step below 256 (as the table holds them) */      \
        __m256i mi_ = _mm256_min_epu32(m_, c255);                                                      \
        __m256i ci_ = _mm256_add_epi32(_mm256_slli_epi32(q_, 4), _mm256_min_epu32(m_, c15));           \
        __m256 ca_ = _mm256_blendv_ps(_mm256_permutevar8x32_ps(rec[0], ci_),                           \
                                      _mm256_permutevar8x32_ps(rec[1], ci_),                           \
                                      _mm256_castsi256_ps(_mm256_slli_epi32(ci_, 28)));                \
        __m256 cb_ = _mm256_blendv_ps(_mm256_permutevar8x32_ps(rec[2], ci_),                           \
                                      _mm256_permutevar8x32_ps(rec[3], ci_),                           \
                                      _mm256_castsi256_ps(_mm256_slli_epi32(ci_, 28)));                \
        __m256 vc_ = _mm256_blendv_ps(ca_, cb_, _mm256_castsi256_ps(_mm256_slli_epi32(ci_, 27)));      \
        __m256 vf_ = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_mullo_epi32(multv, mi_), q_)), stepv); \
        __m256i v_ = _mm256_castps_si256(_mm256_blendv_ps(vf_, vc_, _mm256_castsi256_ps(sm_)));       \
        v_ = _mm256_xor_si256(v_, _mm256_slli_epi32(bits_, 31));                                       \
        _mm256_store_si256((__m256i *)(buf + SL * cnt + HL * h), v_);                                  \
        int big_ = _mm256_movemask_ps(_mm256_castsi256_ps(                                             \
            _mm256_and_si256(_mm256_cmpgt_epi32(m_, c255), ACT(h))));                                  \
        if (__builtin_expect(big_ != 0, 0)) avx2_fix_big(jb, big_, m_, q_, bits_, buf + SL * cnt + HL * h); \
        /* trellis: next state ((s & 1) ^ parity) << 1 | s >> 1 (always 0 without it) */                \
        st[h] = _mm256_and_si256(tcqmask, _mm256_or_si256(                                             \
            _mm256_slli_epi32(_mm256_and_si256(_mm256_xor_si256(st[h], m_), one), 1), q_));            \
        stoff[h] = _mm256_and_si256(_mm256_sub_epi32(zero, _mm256_srli_epi32(st[h], 1)), qoff);        \
        MS = _mm256_min_epu32(m_, m4095);                                                              \
    } while (0)
/* after the steps of all vectors: a full buf goes out */
#define AFLUSH() do {                                                                                  \
        if (++phase == WIN_STEPS) phase = 0;                                                           \
        if (++cnt == HL) {                                                                             \
            _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) avx2_flush8(S, out, buf, h, actb[h]);                   \
            cnt = 0;                                                                                   \
        }                                                                                              \
    } while (0)
#define ACHECK() do {                                                                                  \
        _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {                                                           \
            __m256i kw_ = _mm256_cmpgt_epi32(wp[h], wend[h]);                                          \
            __m256i kr_ = _mm256_cmpgt_epi32(rel[h], rlen[h]);                                         \
            bad[h] = _mm256_or_si256(bad[h], _mm256_or_si256(kw_, kr_));                               \
            wp[h] = _mm256_blendv_epi8(wp[h], wend[h], kw_);                                           \
            rel[h] = _mm256_blendv_epi8(rel[h], rlen[h], kr_);                                         \
            if (!_mm256_testz_si256(_mm256_or_si256(kw_, kr_), _mm256_or_si256(kw_, kr_))) phase = 0;  \
        }                                                                                              \
    } while (0)
    for (int64_t it = 0; it < n_units; it++) {
        const __m256i pos0 = _mm256_set1_epi32(pos32[0]);
        __m256i e[2];
        _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) e[h] = ENTRY(h, rowbase[h], pos0);
        _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {
            __m256i ms;
            ASTEP(h, e[h], ms);
            p1[h] = p2[h] = ms;
        }
        AFLUSH();
        for (int64_t j0 = 1; j0 < unit_len; j0 += BLOCK) {
            int64_t j1 = j0 + BLOCK < unit_len ? j0 + BLOCK : unit_len;
            for (int64_t j = j0; j < j1; j++) {
                const __m256i posj = _mm256_set1_epi32(pos32[j]);
                _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {
                    __m256i s = _mm256_min_epi32(_mm256_add_epi32(p1[h], p2[h]), m4095);
                    __m256i lo;
                    if (use_thr) {
                        __m256i c01 = _mm256_add_epi32(_mm256_cmpgt_epi32(s, thrm1[0]), _mm256_cmpgt_epi32(s, thrm1[1]));
                        __m256i c23 = _mm256_add_epi32(_mm256_cmpgt_epi32(s, thrm1[2]), _mm256_cmpgt_epi32(s, thrm1[3]));
                        __m256i c45 = _mm256_add_epi32(_mm256_cmpgt_epi32(s, thrm1[4]), _mm256_cmpgt_epi32(s, thrm1[5]));
                        __m256i c6 = _mm256_cmpgt_epi32(s, thrm1[6]);
                        __m256i negc = _mm256_add_epi32(_mm256_add_epi32(c01, c23), _mm256_add_epi32(c45, c6));
                        lo = _mm256_permutevar8x32_epi32(boffv, negc);
                    } else {
                        lo = G32(lutv, s, 4);
                    }
                    e[h] = ENTRY(h, _mm256_add_epi32(rowbase[h], posj), lo);
                }
                _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {
                    __m256i m1;
                    ASTEP(h, e[h], m1);
                    p2[h] = p1[h];
                    p1[h] = m1;
                }
                AFLUSH();
            }
            if (j1 < unit_len) ACHECK();
        }
        ACHECK(); /* once per unit (and per BLOCK symbols within long ones) */
        _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {
            col[h] = _mm256_add_epi32(col[h], one);
            __m256i kr = _mm256_and_si256(_mm256_cmpeq_epi32(col[h], _mm256_set1_epi32((int32_t)jb->upr)), act[h]);
            if (!_mm256_testz_si256(kr, kr)) { /* next row (rare: the scalar way) */
                int32_t c[HL], rb[HL];
                _mm256_storeu_si256((__m256i *)c, col[h]);
                _mm256_storeu_si256((__m256i *)rb, rowbase[h]);
                int km = _mm256_movemask_ps(_mm256_castsi256_ps(kr));
                for (int l = 0; l < HL; l++) {
                    if (!((km >> l) & 1)) continue;
                    c[l] = 0;
                    int32_t r = ++S->v.row[HL * h + l];
                    rb[l] = (int32_t)(jb->row_cls_pad[r] * jb->row_mul);
                }
                col[h] = _mm256_loadu_si256((const __m256i *)c);
                rowbase[h] = _mm256_loadu_si256((const __m256i *)rb);
            }
        }
    }
#undef ASTEP
#undef ACT
#undef ENTRY
#undef AFLUSH
#undef ACHECK
    _Pragma("GCC unroll 2") for (int h = h0; h < h0 + nh; h++) {
        for (int l = 0; l < HL; l++) { /* the steps left in buf */
            if (!((actb[h] >> l) & 1)) continue;
            for (int t = 0; t < cnt; t++) memcpy(&out[S->ob[HL * h + l] + t], &buf[SL * t + HL * h + l], 4);
            S->ob[HL * h + l] += cnt;
        }
#define ST(F, V) _mm256_store_si256((__m256i *)(S->v.F + HL * h), V)
        ST(x, x[h]); ST(wp, wp[h]); ST(rel, rel[h]); ST(st, st[h]); ST(col, col[h]);
        ST(rowbase, rowbase[h]); ST(bad, _mm256_and_si256(bad[h], one));
#undef ST
    }
}

AVX2F static void decode_avx2(const Job *jb, SState *S, int64_t n_units, int kact) {
    if (kact == 0xFFFF) avx2_lanes(jb, S, n_units, kact, 0, 2, 1);
    else if (!(kact & 0xFF00)) avx2_lanes(jb, S, n_units, kact, 0, 1, 0);
    else if (!(kact & 0xFF)) avx2_lanes(jb, S, n_units, kact, 1, 1, 0);
    else avx2_lanes(jb, S, n_units, kact, 0, 2, 0);
}

static int run_simd(Job *jb, Lane *ln) {
    SState S;
    memset(&S, 0, sizeof S);
    int failed = 0;
    for (;;) {
        for (int l = 0; l < SL && !failed; l++) {
            if (S.active[l]) continue;
            int64_t ci = take_chunk(jb);
            if (ci < jb->n_chunks && slane_start(jb, &S, l, ci) != 0) failed = 1;
        }
        if (failed || __atomic_load_n(&jb->failed, __ATOMIC_RELAXED)) break;
        int n_act = 0;
        __mmask16 kact = 0;
        int64_t n = INT64_MAX;
        for (int l = 0; l < SL; l++) {
            if (!S.active[l]) continue;
            n_act++;
            kact |= (__mmask16)(1u << l);
            if (S.uend[l] - S.u[l] < n) n = S.uend[l] - S.u[l];
        }
        if (n_act == 0) break;
        if (n_act < jb->simd_min) { /* the queue is empty: the scalar lanes finish these */
            int k = 0;
            for (int l = 0; l < SL; l++)
                if (S.active[l]) slane_to_lane(jb, &S, l, &ln[k++]);
            return run_scalar(jb, ln, k);
        }
        if (jb->simd == SIMD_AVX2) decode_avx2(jb, &S, n, kact);
        else decode_simd(jb, &S, n, kact);
        for (int l = 0; l < SL; l++) {
            if (!S.active[l]) continue;
            S.u[l] += n;
            if (S.u[l] == S.uend[l]) {
                Lane t;
                slane_to_lane(jb, &S, l, &t);
                if (!lane_finish_ok(&t)) failed = 1;
                S.active[l] = 0;
            } else if (S.v.bad[l]) {
                failed = 1;
            }
        }
    }
    return failed;
}

/* the vector lanes this CPU runs: SIMD_AVX512, SIMD_AVX2 (also where AVX-512 is there but
 * prefer_avx2: the tests' knob), or 0 */
static int simd_supported(int prefer_avx2) {
    __builtin_cpu_init();
    if (!prefer_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return SIMD_AVX512;
    return __builtin_cpu_supports("avx2") ? SIMD_AVX2 : 0;
}
#endif

static int build_table(const Job *jb, int64_t c0, int64_t n_ctx);

#define CTX_BLOCK 8
/* this thread's share of the decode table (1 MiB for 64 contexts: ~5% of a small tensor's decode
 * when one thread built it before the others started), then wait until all of it is built */
static int build_share(Job *jb) {
    for (;;) {
        int64_t c0 = __atomic_fetch_add(&jb->next_ctx, CTX_BLOCK, __ATOMIC_RELAXED);
        if (c0 >= jb->n_ctx) break;
        int64_t n = jb->n_ctx - c0 < CTX_BLOCK ? jb->n_ctx - c0 : CTX_BLOCK;
        int bad = build_table(jb, c0, n);
        pthread_mutex_lock(&jb->mu);
        if (bad) jb->bad_table = 1;
        jb->ctx_done += n;
        if (jb->ctx_done == jb->n_ctx) pthread_cond_broadcast(&jb->built);
        pthread_mutex_unlock(&jb->mu);
    }
    pthread_mutex_lock(&jb->mu);
    while (jb->ctx_done < jb->n_ctx) pthread_cond_wait(&jb->built, &jb->mu);
    int bad = jb->bad_table;
    pthread_mutex_unlock(&jb->mu);
    return bad;
}

static void *worker(void *arg) {
    Job *jb = (Job *)arg;
    Lane ln[MAX_LANES];
    int failed;
    if (build_share(jb)) return NULL;
#ifdef TC_SIMD
    if (jb->simd) failed = run_simd(jb, ln);
    else
#endif
    failed = run_scalar(jb, ln, 0);
    if (failed) __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* ---- the helper threads, kept between calls ---------------------------------------------------
 * Why: a call used to start its helpers (pthread_create, ~35 us of the calling thread) and join
 * them at the end, also a helper that had not run yet: on a busy machine a new thread may wait
 * for a core for milliseconds, after the calling thread has decoded every chunk alone, and the
 * call waited for it to start and find nothing to do (Conv_5831 at 47 dB, 2 threads, load ~9:
 * the calling thread done at 1.6-1.8 ms, its helper started at 3.6-9.4 ms). Here the helpers
 * wait in a pool; a call posts its job, and closes it when its own thread has run out of chunks:
 * it waits only for the helpers that joined before that (they hold chunks), never for one that
 * had not started. One job at a time: a call that finds the pool taken (a decode in another
 * Python thread) starts its own helpers as before. After fork() the child has no helpers: its
 * pool starts empty (pool_after_fork). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    Job *job;          /* the job helpers may join now, or NULL */
    uint64_t gen;      /* bumped with every job posted */
    int n_helpers;     /* helper threads started */
    int taken;         /* a call owns the pool */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0};

static void *worker(void *arg);

static void *pool_helper(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.job == NULL || pool.gen == seen) pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.gen;
        Job *jb = pool.job;
        if (jb->joined >= jb->want) continue;
        jb->joined++;
        pthread_mutex_unlock(&pool.mu);
        worker(jb);
        pthread_mutex_lock(&pool.mu);
        if (++jb->left == jb->joined) pthread_cond_broadcast(&pool.done);
    }
    return NULL;
}

/* post jb for n_help helpers; 0 where the pool is taken (the caller starts its own threads) */
static int pool_post(Job *jb, int n_help) {
    pthread_mutex_lock(&pool.mu);
    if (pool.taken) {
        pthread_mutex_unlock(&pool.mu);
        return 0;
    }
    pool.taken = 1;
    while (pool.n_helpers < n_help) {
        pthread_t t;
        if (pthread_create(&t, NULL, pool_helper, NULL) != 0) break;
        pthread_detach(t);
        pool.n_helpers++;
    }
    jb->want = n_help;
    jb->joined = jb->left = 0;
    pool.job = jb;
    pool.gen++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    return 1;
}

/* no helper joins jb from now on; wait for those that did */
static void pool_close(Job *jb) {
    pthread_mutex_lock(&pool.mu);
    pool.job = NULL;
    while (jb->left < jb->joined) pthread_cond_wait(&pool.done, &pool.mu);
    pool.taken = 0;
    pthread_mutex_unlock(&pool.mu);
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.job = NULL;
    pool.n_helpers = 0;
    pool.taken = 0;
}

static void token_tables(Job *jb) {
    memset(jb->tok, 0, sizeof jb->tok); /* tokens >= N_TOKENS never occur: the tables have none */
    for (int t = 0; t < N_TOKENS; t++) {
        if (t < 16) {
            jb->tok[t].mbase = (uint32_t)t;
            jb->tok[t].nb = t > 0;
        } else {
            int e = (t - 16) / 8 + 4, mant = (t - 16) % 8, nb = e - 3;
            jb->tok[t].mbase = (uint32_t)(8 + mant) << nb;
            jb->tok[t].nb = (uint32_t)(nb + 1);
        }
    }
}

/* the table entries of one token: its f slots (a loop the compiler vectorises; written entry by
 * entry through row[slot + i], which it did not, the 64 K entries of a 16-context table took a
 * median 33 us of thread CPU a call, now 16 us: ~3% of a 0.6 M-weight tensor's decode) */
static void fill_slots(uint32_t *restrict dst, uint32_t hi, uint32_t f) {
    for (size_t i = 0; i < f; i++) dst[i] = hi | (uint32_t)(i << 8);
}

/* the decode table rows of contexts c0 .. c0 + n_ctx - 1, from the uint32 rows or the records */
static int build_table(const Job *jb, int64_t c0, int64_t n_ctx) {
    for (int64_t c = c0; c < c0 + n_ctx; c++) {
        uint32_t *row = (uint32_t *)jb->tab + (c << PROB_BITS);
        uint32_t slot = 0;
        const uint8_t *rec = jb->rec ? jb->rec + jb->rec_off[c] : NULL;
        const uint32_t n_tok = rec ? rec[0] : N_TOKENS; /* (<= N_TOKENS: checked in py_decode) */
        for (uint32_t t = 0; t < n_tok; t++) {
            uint32_t f = rec ? (uint32_t)rec[1 + 2 * t] | (uint32_t)rec[2 + 2 * t] << 8 : jb->freq[c * N_TOKENS + t];
            if (f == 0) continue;
            if (f > PROB_SCALE - slot) return -1;
            uint32_t hi = ((f - 1) << 20) | t;
            fill_slots(row + slot, hi, f);
            slot += f;
        }
        if (slot != PROB_SCALE) return -1;
    }
    return 0;
}

#define NEED(cond, msg) do { if (!(cond)) { PyErr_SetString(PyExc_ValueError, "_tcodec.decode: " msg); goto done; } } while (0)

static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer b_words = {0}, b_woff = {0}, b_raw = {0}, b_roff = {0}, b_cu = {0}, b_out = {0},
              b_row = {0}, b_pos = {0}, b_lut = {0}, b_freq = {0}, b_recon = {0};
    long long unit_len, upr, n_pos, nb_ctx;
    int tcq, threads, lanes, simd = 0;
    long long n_rec_ctx = -1;
    double step;
    PyObject *result = NULL;
    uint64_t *pos_off = NULL;
    int32_t *pos_off32 = NULL;
    uint8_t *row_pad = NULL;
    uint32_t *tab = NULL;
    int64_t *rec_off = NULL;
    Job *jb = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*y*y*y*y*y*LLLLpdii|iL", &b_words, &b_woff, &b_raw, &b_roff,
                          &b_cu, &b_out, &b_row, &b_pos, &b_lut, &b_freq, &b_recon, &unit_len,
                          &upr, &n_pos, &nb_ctx, &tcq, &step, &threads, &lanes, &simd, &n_rec_ctx))
        return NULL;
    int64_t n_chunks = (int64_t)(b_cu.len / 8) - 1;
    int64_t nq = tcq ? 2 : 1;
    NEED(unit_len >= 1 && upr >= 1 && n_pos >= 1 && nb_ctx >= 1 && n_pos <= 256 && nb_ctx <= 256,
         "bad layout");
    NEED(n_chunks >= 0 && b_woff.len == (n_chunks + 1) * 8 && b_roff.len == (n_chunks + 1) * 8,
         "bad offsets");
    NEED(b_pos.len == unit_len * 4 && b_lut.len == LUT_SIZE * 4 && b_recon.len == 32 * 4, "bad tables");
    int64_t rows = (int64_t)b_row.len;
    int64_t n_row = 1;
    for (int64_t i = 0; i < rows; i++)
        if (((const uint8_t *)b_row.buf)[i] + 1 > n_row) n_row = ((const uint8_t *)b_row.buf)[i] + 1;
    int64_t n_ctx = (int64_t)(b_freq.len / 4 / N_TOKENS);
    if (n_rec_ctx >= 0) { /* the records: where each context's is, and that they fill the bytes */
        NEED(n_rec_ctx <= (long long)b_freq.len, "bad frequency table"); /* a record takes >= 1 byte */
        n_ctx = n_rec_ctx;
        rec_off = malloc(sizeof(int64_t) * (size_t)(n_ctx + 1));
        if (!rec_off) {
            PyErr_NoMemory();
            goto done;
        }
        const uint8_t *rec = b_freq.buf;
        int64_t at = 0;
        for (int64_t c = 0; c < n_ctx; c++) {
            NEED(at < (int64_t)b_freq.len && rec[at] <= N_TOKENS, "bad frequency table");
            rec_off[c] = at;
            at += 1 + 2 * (int64_t)rec[at];
        }
        NEED(at == (int64_t)b_freq.len, "bad frequency table");
    } else {
        NEED(b_freq.len == n_ctx * N_TOKENS * 4, "bad frequency table");
    }
    NEED(n_ctx >= n_row * n_pos * nq * nb_ctx, "bad frequency table");
    const int64_t *cu = (const int64_t *)b_cu.buf, *woff = (const int64_t *)b_woff.buf,
                  *roff = (const int64_t *)b_roff.buf;
    int64_t n_words = (int64_t)(b_words.len / 2);
    if (n_chunks > 0) {
        NEED(cu[0] == 0 && woff[0] == 0 && roff[0] == 0, "bad offsets");
        for (int64_t i = 0; i < n_chunks; i++)
            NEED(cu[i + 1] > cu[i] && woff[i + 1] >= woff[i] && roff[i + 1] >= roff[i], "bad offsets");
        NEED(woff[n_chunks] + WORD_PAD <= n_words && roff[n_chunks] * 4 + RAW_PAD_BYTES <= (int64_t)b_raw.len,
             "streams shorter than their offsets and padding");
        NEED(cu[n_chunks] <= rows * upr && cu[n_chunks] <= (int64_t)(b_out.len / 4) / unit_len,
             "units beyond the output");
    }
    const int32_t *pos = (const int32_t *)b_pos.buf, *lut = (const int32_t *)b_lut.buf;
    for (int64_t j = 0; j < unit_len; j++) NEED(pos[j] >= 0 && pos[j] < n_pos, "bad position class");
    for (int i = 0; i < LUT_SIZE; i++) NEED(lut[i] >= 0 && lut[i] < nb_ctx, "bad context buckets");
    if (n_chunks == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    pos_off = malloc(sizeof(uint64_t) * unit_len);
    tab = malloc(sizeof(uint32_t) * (size_t)n_ctx * PROB_SCALE);
    jb = calloc(1, sizeof(Job));
    if (!pos_off || !tab || !jb) {
        PyErr_NoMemory();
        goto done;
    }
    for (int64_t j = 0; j < unit_len; j++) pos_off[j] = (uint64_t)(pos[j] * nq * nb_ctx) << PROB_BITS;
    for (int i = 0; i < LUT_SIZE; i++) jb->lut_off[i] = (uint32_t)lut[i] << PROB_BITS;
    jb->words = b_words.buf;
    jb->woff = woff;
    jb->roff = roff;
    jb->chunk_units = cu;
    jb->raw = b_raw.buf;
    jb->out = b_out.buf;
    jb->row_cls = b_row.buf;
    jb->pos_off = pos_off;
    jb->tab = tab;
    jb->n_chunks = n_chunks;
    jb->unit_len = unit_len;
    jb->upr = upr;
    jb->row_mul = (uint64_t)(n_pos * nq * nb_ctx) << PROB_BITS;
    jb->tcq = tcq;
    jb->step = (float)step;
    jb->lanes = lanes < 1 ? 1 : lanes > MAX_LANES ? MAX_LANES : lanes;
    const float *recon = b_recon.buf;
    /* values as the numba decoder computes them: centroids below 16, (mult * m - q) * step above */
    for (int q = 0; q < 2; q++) {
        for (int m = 0; m < 256; m++) {
            float v = m == 0 ? 0.0f /* exactly zero, whatever the blob says */
                    : m < 16 ? recon[q * 16 + m] : (float)((tcq ? 2.0 : 1.0) * m - q) * jb->step;
            memcpy(&jb->vbits[q * 256 + m], &v, 4);
        }
    }
    for (int st = 0; st < 4; st++) {
        for (int par = 0; par < 2; par++) {
            uint32_t ns = tcq ? (uint32_t)((((st & 1) ^ par) << 1) | (st >> 1)) : 0;
            jb->trans[2 * st + par] = ((uint32_t)((ns >> 1) * nb_ctx) << PROB_BITS) | ns;
        }
    }
    token_tables(jb);
    jb->nb_ctx = nb_ctx;
    jb->simd = 0;
#ifdef TC_SIMD
    /* the vector lanes index everything with int32 (and the chunks' raw bits with uint32) */
    int level = simd > 0 ? simd_supported((simd & 32) != 0) : 0;
    if (level && (uint64_t)n_ctx * PROB_SCALE < (1ull << 31)
        && (uint64_t)n_words < (1ull << 30) && (uint64_t)b_raw.len < (1ull << 31)
        && (uint64_t)(b_out.len / 4) < (1ull << 31) - (uint64_t)unit_len && rows + 64 < (1ll << 31)) {
        jb->simd = level;
        for (int64_t i = 0; i < n_chunks; i++)
            if ((roff[i + 1] - roff[i]) >= (1ll << 25)) jb->simd = 0;
    }
    if (jb->simd) {
        jb->simd_wide = (simd & 16) != 0;
        simd &= 15;
        jb->simd_min = simd < 1 ? 1 : simd > MAX_LANES + 1 ? MAX_LANES + 1 : simd; /* the scalar lanes take the rest */
        pos_off32 = malloc(sizeof(int32_t) * unit_len);
        row_pad = calloc((size_t)rows + 64, 1);
        if (!pos_off32 || !row_pad) {
            PyErr_NoMemory();
            goto done;
        }
        for (int64_t j = 0; j < unit_len; j++) pos_off32[j] = (int32_t)pos_off[j];
        if (rows) memcpy(row_pad, b_row.buf, (size_t)rows);
        jb->pos_off32 = pos_off32;
        jb->row_cls_pad = row_pad;
        for (int q = 0; q < 2; q++)
            for (int m = 0; m < 16; m++) memcpy(&jb->recon2[q * 16 + m], &jb->vbits[q * 256 + m], 4);
        /* the LUT as steps up (it rises with the sum; else, or with > 8 steps, it is gathered) */
        jb->use_thr = 1;
        jb->n_thr = 0;
        for (int i = 1; i < LUT_SIZE && jb->use_thr; i++) {
            if (lut[i] == lut[i - 1]) continue;
            if (lut[i] < lut[i - 1] || jb->n_thr == MAX_THR) {
                jb->use_thr = 0;
                break;
            }
            jb->thr[jb->n_thr] = i;
            jb->thr_delta[jb->n_thr++] = (uint32_t)(lut[i] - lut[i - 1]) << PROB_BITS;
        }
    }
#endif
    jb->freq = b_freq.buf;
    jb->rec = rec_off ? b_freq.buf : NULL;
    jb->rec_off = rec_off;
    jb->n_ctx = n_ctx;
    pthread_mutex_init(&jb->mu, NULL);
    pthread_cond_init(&jb->built, NULL);
    Py_BEGIN_ALLOW_THREADS
    int nt = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    if (nt > n_chunks) nt = (int)n_chunks;
    pthread_t th[64];
    int started = 0, pooled = nt > 1 && pool_post(jb, nt - 1);
    for (int i = 1; i < nt && !pooled; i++) {
        if (pthread_create(&th[started], NULL, worker, jb) != 0) break;
        started++;
    }
    worker(jb);
    if (pooled) pool_close(jb);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&jb->mu);
    pthread_cond_destroy(&jb->built);
    NEED(!jb->bad_table, "bad frequency table");
    result = PyLong_FromLong(jb->failed ? -1 : 0);
done:
    free(pos_off);
    free(pos_off32);
    free(row_pad);
    free(tab);
    free(rec_off);
    free(jb);
    PyBuffer_Release(&b_words); PyBuffer_Release(&b_woff); PyBuffer_Release(&b_raw);
    PyBuffer_Release(&b_roff); PyBuffer_Release(&b_cu); PyBuffer_Release(&b_out);
    PyBuffer_Release(&b_row); PyBuffer_Release(&b_pos); PyBuffer_Release(&b_lut);
    PyBuffer_Release(&b_freq); PyBuffer_Release(&b_recon);
    return result;
}

/* ---- CRC-32 of a blob (zlib's: reflected 0xEDB88320, inverted in and out), carry-less multiply ----
 * Why: decode_array checks the blob's CRC before it parses anything, alone on one core; zlib.crc32
 * runs at ~2-5 GB/s here (~5-10% of a 2-thread decode of a large tensor). Folding 16-byte blocks
 * with PCLMULQDQ runs at memory speed. A block is the polynomial whose first bit is the highest
 * term; moving the 128 bits X = H x^64 + L forward by D bits is H (x^(64+D) mod P) + L (x^D mod P),
 * two 64x32-bit carry-less products (in the reflected registers each product comes out one bit
 * short: the constants are x^(63+D) and x^(D-1) mod P, bit-reversed into 64 bits). The last 128
 * bits and the tail (< 16 bytes) go through a byte table. The constants are computed at import
 * (from the polynomial, not typed in); the tests compare with zlib.crc32. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(TC_NO_SIMD)
#define TC_CLMUL 1
#define CLMUL __attribute__((target("pclmul,sse4.1")))

static uint32_t crc_byte_tab[256];
static uint64_t crc_k1h, crc_k1l, crc_k4h, crc_k4l; /* fold by 16 and by 64 bytes */

static uint32_t xpow_mod(uint64_t n) { /* x^n mod P, normal order (bit d = x^d) */
    uint32_t r = 1; /* x^0 */
    for (uint64_t i = 0; i < n; i++) r = (r & 0x80000000u) ? (r << 1) ^ 0x04C11DB7u : r << 1;
    return r;
}

static uint64_t rev64_of(uint32_t k) { /* x^d (bit d) -> bit 63 - d */
    uint64_t r = 0;
    for (int d = 0; d < 32; d++)
        if ((k >> d) & 1) r |= 1ull << (63 - d);
    return r;
}

static void clmul_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_byte_tab[n] = c;
    }
    crc_k1h = rev64_of(xpow_mod(63 + 128));
    crc_k1l = rev64_of(xpow_mod(128 - 1));
    crc_k4h = rev64_of(xpow_mod(63 + 512));
    crc_k4l = rev64_of(xpow_mod(512 - 1));
}

static uint32_t crc_bytes(uint32_t crc, const uint8_t *p, size_t n) { /* no inversions */
    for (; n; n--) crc = crc_byte_tab[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

CLMUL static inline __m128i fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

CLMUL static uint32_t crc32_clmul(const uint8_t *p, size_t len) {
    if (len < 64) return ~crc_bytes(0xFFFFFFFFu, p, len);
    const __m128i k4 = _mm_set_epi64x((long long)crc_k4l, (long long)crc_k4h);
    const __m128i k1 = _mm_set_epi64x((long long)crc_k1l, (long long)crc_k1h);
    __m128i x0 = _mm_loadu_si128((const __m128i *)p), x1 = _mm_loadu_si128((const __m128i *)(p + 16)),
            x2 = _mm_loadu_si128((const __m128i *)(p + 32)), x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)0xFFFFFFFF)); /* the initial inversion */
    p += 64;
    len -= 64;
    for (; len >= 64; p += 64, len -= 64) {
        x0 = _mm_xor_si128(fold(x0, k4), _mm_loadu_si128((const __m128i *)p));
        x1 = _mm_xor_si128(fold(x1, k4), _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = _mm_xor_si128(fold(x2, k4), _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = _mm_xor_si128(fold(x3, k4), _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    __m128i x = _mm_xor_si128(fold(x0, k1), x1);
    x = _mm_xor_si128(fold(x, k1), x2);
    x = _mm_xor_si128(fold(x, k1), x3);
    for (; len >= 16; p += 16, len -= 16) x = _mm_xor_si128(fold(x, k1), _mm_loadu_si128((const __m128i *)p));
    uint8_t last[16];
    _mm_storeu_si128((__m128i *)last, x);
    return ~crc_bytes(crc_bytes(0, last, 16), p, len);
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer b = {0};
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32_clmul((const uint8_t *)b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(crc);
}
#endif

/* which lanes decode(..., simd) runs on this CPU (for tests and benchmarks) */
static PyObject *py_vector_lanes(PyObject *self, PyObject *args) {
    int simd = 0;
    if (!PyArg_ParseTuple(args, "|i", &simd)) return NULL;
    int level = 0;
#ifdef TC_SIMD
    level = simd > 0 ? simd_supported((simd & 32) != 0) : 0;
#endif
    return PyUnicode_FromString(level == 1 ? "avx512" : level == 2 ? "avx2" : "scalar");
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "Decode the chunks of a tensor-codec blob (see the module comment)."},
    {"vector_lanes", py_vector_lanes, METH_VARARGS,
     "vector_lanes(simd) -> 'avx512' | 'avx2' | 'scalar': the lanes decode(..., simd) runs on this CPU."},
#ifdef TC_CLMUL
    {"crc32", py_crc32, METH_VARARGS, "crc32(buffer) -> zlib.crc32(buffer) (absent where the CPU lacks PCLMULQDQ)."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tcodec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tcodec(void) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "_tcodec: little-endian hosts only");
        return NULL;
    }
#ifdef TC_CLMUL
    __builtin_cpu_init();
    int has_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    if (has_clmul) clmul_init();
#endif
    static int forked_ok = 0;
    if (!forked_ok && pthread_atfork(NULL, NULL, pool_after_fork) == 0) forked_ok = 1;
    PyObject *mod = PyModule_Create(&module);
#ifdef TC_CLMUL
    if (mod && !has_clmul && PyObject_DelAttrString(mod, "crc32") < 0) {
        Py_DECREF(mod);
        return NULL;
    }
#endif
    if (mod && (PyModule_AddIntConstant(mod, "WORD_PAD", WORD_PAD) < 0
                || PyModule_AddIntConstant(mod, "RAW_PAD_BYTES", RAW_PAD_BYTES) < 0)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
