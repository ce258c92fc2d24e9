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
 * (context, slot) gives the token, its frequency and its offset in one load.
 *
 * decode(words, woff, raw, roff, chunk_units, out, row_cls, pos_cls, lut, freq, recon,
 *        unit_len, units_per_row, n_pos_cls, nb_ctx, tcq, step, threads, lanes) -> 0 | -1
 *   words   uint16, with at least one element after the last chunk's words (read, never used)
 *   woff, roff, chunk_units  int64[n_chunks + 1]   raw uint32   out float32 (written)
 *   row_cls uint8[rows]   pos_cls int32[unit_len]   lut int32[LUT_SIZE]
 *   freq    uint32[n_ctx * N_TOKENS], every row summing to PROB_SCALE
 *   recon   float32[32] reconstruction (times step) of magnitudes < 16, Q0 then Q1
 * The caller (tensorcodec._decode) has validated the layout; the sizes are checked again here, so
 * a wrong call is an error, never an out-of-bounds access. Same output as the numba decoder,
 * bit for bit, and -1 exactly where it fails (damaged entropy-coded data). Releases the GIL.
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

typedef struct {
    uint32_t mbase; /* smallest magnitude of the token */
    uint32_t nb;    /* raw bits of the token, sign included */
} Token;

typedef struct {
    /* shared, read-only */
    const uint16_t *words;
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
    /* work distribution and result */
    int64_t next_chunk;
    int failed;
} Job;

#define WORD_PAD 264        /* words readable after the last chunk's: > BLOCK + 1 */
#define BLOCK 256           /* symbols per lane between two bounds checks */
#define RAW_PAD_BYTES 1056  /* >= BLOCK * 4 + 8: one symbol takes at most 29 raw bits */

typedef struct {
    uint32_t x;
    const uint16_t *wp, *wend;
    uint64_t bitpos, rstart, rend; /* raw stream, in bits from the stream's start */
    uint32_t bad;
    int64_t u, uend;   /* next unit, end unit of the chunk */
    int64_t row, col;  /* row of unit u, and u's index within it */
    uint32_t st;       /* trellis state */
} Lane;

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
    const uint16_t *wp[MAX_LANES], *wend[MAX_LANES];
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
            union { float f; uint32_t i; } big_;                                             \
            big_.f = (float)(mult * (double)m_ - (double)q_) * step;                         \
            vb_ = big_.i;                                                                    \
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

static void *worker(void *arg) {
    Job *jb = (Job *)arg;
    Lane ln[MAX_LANES];
    int k = 0, failed = 0;
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
    if (failed) __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
    return NULL;
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

static int build_table(uint32_t *tab, const uint32_t *freq, int64_t n_ctx) {
    for (int64_t c = 0; c < n_ctx; c++) {
        uint32_t *row = tab + (c << PROB_BITS);
        uint32_t slot = 0;
        for (uint32_t t = 0; t < N_TOKENS; t++) {
            uint32_t f = freq[c * N_TOKENS + t];
            if (f == 0) continue;
            if (f > PROB_SCALE - slot) return -1;
            uint32_t hi = ((f - 1) << 20) | t;
            for (uint32_t i = 0; i < f; i++) row[slot + i] = hi | (i << 8);
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
    int tcq, threads, lanes;
    double step;
    PyObject *result = NULL;
    uint64_t *pos_off = NULL;
    uint32_t *tab = NULL;
    Job *jb = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*y*y*y*y*y*LLLLpdii", &b_words, &b_woff, &b_raw, &b_roff,
                          &b_cu, &b_out, &b_row, &b_pos, &b_lut, &b_freq, &b_recon, &unit_len,
                          &upr, &n_pos, &nb_ctx, &tcq, &step, &threads, &lanes))
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
    NEED(b_freq.len == n_ctx * N_TOKENS * 4 && n_ctx >= n_row * n_pos * nq * nb_ctx, "bad frequency table");
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
    int bad_table;
    Py_BEGIN_ALLOW_THREADS
    bad_table = build_table(tab, b_freq.buf, n_ctx);
    if (!bad_table) {
        int nt = threads < 1 ? 1 : threads > 64 ? 64 : threads;
        if (nt > n_chunks) nt = (int)n_chunks;
        pthread_t th[64];
        int started = 0;
        for (int i = 1; i < nt; i++) {
            if (pthread_create(&th[started], NULL, worker, jb) != 0) break;
            started++;
        }
        worker(jb);
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    }
    Py_END_ALLOW_THREADS
    NEED(!bad_table, "bad frequency table");
    result = PyLong_FromLong(jb->failed ? -1 : 0);
done:
    free(pos_off);
    free(tab);
    free(jb);
    PyBuffer_Release(&b_words); PyBuffer_Release(&b_woff); PyBuffer_Release(&b_raw);
    PyBuffer_Release(&b_roff); PyBuffer_Release(&b_cu); PyBuffer_Release(&b_out);
    PyBuffer_Release(&b_row); PyBuffer_Release(&b_pos); PyBuffer_Release(&b_lut);
    PyBuffer_Release(&b_freq); PyBuffer_Release(&b_recon);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "Decode the chunks of a tensor-codec blob (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tcodec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tcodec(void) {
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "_tcodec: little-endian hosts only");
        return NULL;
    }
    PyObject *mod = PyModule_Create(&module);
    if (mod && (PyModule_AddIntConstant(mod, "WORD_PAD", WORD_PAD) < 0
                || PyModule_AddIntConstant(mod, "RAW_PAD_BYTES", RAW_PAD_BYTES) < 0)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
