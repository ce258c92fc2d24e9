/* Encode-side helpers of the .onnxz writer (module passes.onnxz._encode), all GIL-free.
 *
 * Why: pack spent most of its time in Python around the coders, not in them: Huffman code costs
 * by heapq (the zstd floors of codecs._block_entropy), np.bincount (which widens every byte to an
 * intp first) and the rANS coder of `ans_shared` blobs as a Python loop (~0.3 us a symbol). Each
 * function here gives exactly what its numpy mirror in codecs.py / ans.py gives (tests compare).
 *
 *   hist(data, block, out)             byte histograms of each `block`-byte slice: out int64 (k, 256)
 *   rank_pairs(plane, t, r, e)         exponent bytes as pairs of 4-bit ranks (codecs.rank_planes)
 *   huffman_bits(counts, out)          bits of an optimal Huffman code per row of counts (k, 256)
 *   ans_encode_shared(sym, freq, lg)   ans blob without its table (FORMAT.md 3.2), table `freq`
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define PROB_BITS 12
#define RANS_L (1u << 16)
#define MAX_LANES 128

/* ---------------------------------------------------------------- histograms */

/* four interleaved sub-histograms: consecutive equal bytes do not serialise on one counter */
static void hist_one(const uint8_t *p, size_t n, int64_t *out) {
    uint32_t h[4][256];
    memset(h, 0, sizeof h);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        h[0][v & 255]++; h[1][(v >> 8) & 255]++; h[2][(v >> 16) & 255]++; h[3][(v >> 24) & 255]++;
        h[0][(v >> 32) & 255]++; h[1][(v >> 40) & 255]++; h[2][(v >> 48) & 255]++; h[3][v >> 56]++;
        if ((i & ((1u << 28) - 8)) == ((1u << 28) - 8)) { /* 2^28 bytes: flush before uint32 wraps */
            for (int s = 0; s < 256; s++) { out[s] += (int64_t)h[0][s] + h[1][s] + h[2][s] + h[3][s]; h[0][s] = h[1][s] = h[2][s] = h[3][s] = 0; }
        }
    }
    for (; i < n; i++) h[0][p[i]]++;
    for (int s = 0; s < 256; s++) out[s] += (int64_t)h[0][s] + h[1][s] + h[2][s] + h[3][s];
}

static PyObject *py_hist(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "y*nw*", &src, &block, &out)) return NULL;
    Py_ssize_t n = src.len, k = block > 0 ? (n + block - 1) / block : 0;
    if (block <= 0 || out.len != (k ? k : 1) * 256 * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "hist: out must hold ceil(len/block) (at least 1) rows of 256 int64");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    memset(out.buf, 0, (size_t)out.len);
    for (Py_ssize_t b = 0; b < k; b++) {
        Py_ssize_t lo = b * block, len = n - lo < block ? n - lo : block;
        hist_one((const uint8_t *)src.buf + lo, (size_t)len, (int64_t *)out.buf + b * 256);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- byte planes */

/* FORMAT.md 3's byte planes (plane i = byte w-1-i of each little-endian element; sign_move: the
 * float sign moved from plane 0 to the top of plane 1) into dst, plane after plane: one pass
 * reading each element once, ~5x a split that reads the source once per plane. Counting
 * the bytes in the same pass measured slower than this plus hist() per plane (1.7 against 2.5 GB/s:
 * the increments, not the memory, bound it). */
static inline __attribute__((always_inline)) void split_w(const uint8_t *restrict src, Py_ssize_t n, const int w,
                                                          int sign_move, uint8_t *restrict dst) {
    for (Py_ssize_t e = 0; e < n; e++) {
        const uint8_t *p = src + e * w;
        uint8_t v[8];
        for (int i = 0; i < w; i++) v[i] = p[w - 1 - i];
        if (sign_move) {
            uint8_t t = v[0], m = v[1];
            v[0] = (uint8_t)((t << 1) | (m >> 7));
            v[1] = (uint8_t)((t & 0x80) | (m & 0x7F));
        }
        for (int i = 0; i < w; i++) dst[(Py_ssize_t)i * n + e] = v[i];
    }
}

/* split(data, width, sign_move, out): the planes of data into out (same size) */
static PyObject *py_split(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    int w, sign_move;
    if (!PyArg_ParseTuple(args, "y*ipw*", &src, &w, &sign_move, &out)) return NULL;
    const char *bad = NULL;
    if (w != 2 && w != 4 && w != 8) bad = "split: width must be 2, 4 or 8";
    else if (src.len % w || out.len != src.len) bad = "split: out must have the size of data, a multiple of width";
    if (bad) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Py_ssize_t n = src.len / w;
    const uint8_t *s = (const uint8_t *)src.buf;
    uint8_t *d = (uint8_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (w) {
    case 2: split_w(s, n, 2, sign_move, d); break;
    case 4: split_w(s, n, 4, sign_move, d); break;
    default: split_w(s, n, 8, sign_move, d); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- exponent ranks */

/* rank_pairs(plane, table, ranks, escapes) -> number of escapes: codecs.rank_planes in one pass
 * after the histogram (numpy's argsort, lookup, mask and pairing cost ~5x this). table (15 bytes):
 * the 15 most frequent bytes, most frequent first, ties by the smaller byte (a stable argsort of
 * -counts); each byte -> its rank in the table or 15; ranks ((n+1)/2 bytes): rank of 2i in the high
 * nibble, of 2i+1 (0 past the end) in the low one; escapes (n bytes): the bytes ranked 15, in order. */
#define PAIR_TABLE 15
static PyObject *py_rank_pairs(PyObject *self, PyObject *args) {
    Py_buffer src, tb, rb, eb;
    if (!PyArg_ParseTuple(args, "y*w*w*w*", &src, &tb, &rb, &eb)) return NULL;
    Py_ssize_t n = src.len, k = 0;
    if (tb.len != PAIR_TABLE || rb.len != (n + 1) / 2 || eb.len < n) {
        PyBuffer_Release(&src); PyBuffer_Release(&tb); PyBuffer_Release(&rb); PyBuffer_Release(&eb);
        PyErr_SetString(PyExc_ValueError, "rank_pairs: table 15 bytes, ranks (n+1)//2, escapes n");
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)src.buf;
    uint8_t *table = (uint8_t *)tb.buf, *ranks = (uint8_t *)rb.buf, *esc = (uint8_t *)eb.buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t counts[256];
    memset(counts, 0, sizeof counts);
    hist_one(p, (size_t)n, counts);
    uint8_t lut[256], taken[256];
    memset(lut, PAIR_TABLE, sizeof lut);
    memset(taken, 0, sizeof taken);
    for (int r = 0; r < PAIR_TABLE; r++) { /* selection: first of the largest counts left */
        int best = -1;
        for (int s = 0; s < 256; s++)
            if (!taken[s] && (best < 0 || counts[s] > counts[best])) best = s;
        taken[best] = 1;
        table[r] = (uint8_t)best;
        lut[best] = (uint8_t)r;
    }
    Py_ssize_t i = 0;
    for (; i + 1 < n; i += 2) {
        uint8_t a = lut[p[i]], b = lut[p[i + 1]];
        ranks[i >> 1] = (uint8_t)((a << 4) | b);
        esc[k] = p[i]; k += a == PAIR_TABLE;
        esc[k] = p[i + 1]; k += b == PAIR_TABLE;
    }
    if (i < n) {
        uint8_t a = lut[p[i]];
        ranks[i >> 1] = (uint8_t)(a << 4);
        esc[k] = p[i]; k += a == PAIR_TABLE;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&tb); PyBuffer_Release(&rb); PyBuffer_Release(&eb);
    return PyLong_FromSsize_t(k);
}

/* ---------------------------------------------------------------- Huffman cost */

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* sum of the merged weights of Huffman's construction = bits of the optimal code (the total is
 * the same whatever order equal weights merge in); two queues over the sorted leaves */
static int64_t huffman_bits_row(const int64_t *counts) {
    uint64_t leaf[256], node[256];
    int m = 0;
    for (int s = 0; s < 256; s++) if (counts[s] > 0) leaf[m++] = (uint64_t)counts[s];
    if (m < 2) return 0;
    qsort(leaf, (size_t)m, sizeof leaf[0], cmp_u64);
    int li = 0, ni = 0, nn = 0;
    uint64_t total = 0;
    for (int merges = 0; merges < m - 1; merges++) {
        uint64_t pick[2];
        for (int t = 0; t < 2; t++) {
            if (li < m && (ni >= nn || leaf[li] <= node[ni])) pick[t] = leaf[li++];
            else pick[t] = node[ni++];
        }
        node[nn++] = pick[0] + pick[1];
        total += pick[0] + pick[1];
    }
    return (int64_t)total;
}

static PyObject *py_huffman_bits(PyObject *self, PyObject *args) {
    Py_buffer counts, out;
    if (!PyArg_ParseTuple(args, "y*w*", &counts, &out)) return NULL;
    Py_ssize_t k = counts.len / (256 * (Py_ssize_t)sizeof(int64_t));
    if (counts.len != k * 256 * (Py_ssize_t)sizeof(int64_t) || out.len != k * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&counts);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "huffman_bits: counts int64 (k, 256), out int64 (k,)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < k; r++)
        ((int64_t *)out.buf)[r] = huffman_bits_row((const int64_t *)counts.buf + r * 256);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- rANS with a given table */

/* the final lane states, then the words in decode order (the blob after byte 0 and any table):
 * the coding of _ans.c's onnxz_ans_encode (and ans.py's _states_and_words) under the table freq.
 * Returns the size, or 0 when a symbol has no frequency.
 * Per symbol: x' = (v / f) * 4096 + v % f + cum = v + q * (4096 - f) + cum with q = v / f taken as
 * the high half of v * m, m = floor(2^64 / f) + 1 (m * f - 2^64 lies in 1..f, so the quotient is
 * exact for every v < 2^32); f = 1: m = 2^64 - 1 gives q = v - 1, and cum + 4095 makes up for it.
 * One table entry per symbol, rows of `lanes` symbols walked backwards lane by lane, and the
 * renormalisation branch-free (whether a word goes out is data-dependent: unpredictable). */
typedef struct { uint64_t m, lim; uint32_t cmpl, bias; } EncSym;

/* bytes of the buffer encode_into writes a blob of n symbols into, after `head` bytes */
#define ENC_CAP(head, n) ((head) + 4 * MAX_LANES + 2 * (size_t)(n) + 2)

static size_t encode_into(const uint8_t *src, size_t n, const uint32_t *freq, int lanes_log2,
                          uint8_t *blob, size_t head) {
    EncSym tab[256];
    uint32_t c = 0;
    for (int s = 0; s < 256; s++) {
        uint32_t f = freq[s];
        tab[s].lim = (uint64_t)f << 20;
        tab[s].cmpl = (1u << PROB_BITS) - f;
        tab[s].bias = c;
        if (f == 1) { tab[s].m = ~(uint64_t)0; tab[s].bias = c + (1u << PROB_BITS) - 1; }
        /* floor(2^64 / f) + 1: (2^64 - 1) / f gives floor(2^64 / f) unless f is a power of two */
        else if (f) tab[s].m = (f & (f - 1)) ? UINT64_MAX / f + 1 : ((uint64_t)1 << (64 - __builtin_ctz(f))) + 1;
        else tab[s].m = 0;
        c += f;
    }
    int lanes = 1 << lanes_log2;
    /* the words go backwards from the end of blob (ENC_CAP: room for 2 bytes a symbol), then move
     * down behind the states: no scratch buffer, no copy into a new bytes object */
    size_t cap = ENC_CAP(head, n), wp = cap;
    uint32_t x[MAX_LANES];
    for (int j = 0; j < lanes; j++) x[j] = RANS_L;
    uint32_t missing = 0;
#define STEP(j, sym) do { \
        const EncSym *e = &tab[sym]; \
        uint32_t v = x[j]; \
        uint32_t emit = (uint64_t)v >= e->lim; \
        missing |= e->lim == 0; \
        uint16_t w16 = (uint16_t)v; \
        memcpy(blob + wp - 2, &w16, 2); \
        wp -= emit << 1; \
        v >>= emit << 4; \
        uint32_t q = (uint32_t)(((unsigned __int128)v * e->m) >> 64); \
        x[j] = v + q * e->cmpl + e->bias; \
    } while (0)
    size_t full = n & ~(size_t)(lanes - 1);
    for (size_t i = n; i > full;) { i--; STEP((int)(i - full), src[i]); }
    for (size_t row = full; row > 0;) {
        row -= (size_t)lanes;
        const uint8_t *p = src + row;
        for (int j = lanes - 1; j >= 0; j--) STEP(j, p[j]);
    }
#undef STEP
    if (missing) return 0;
    size_t pos = head;
    memmove(blob + pos + 4 * (size_t)lanes, blob + wp, cap - wp);
    for (int j = 0; j < lanes; j++) { memcpy(blob + pos, &x[j], 4); pos += 4; }
    return pos + (cap - wp);
}

/* counts -> frequencies summing to 4096, each present symbol >= 1: _ans.c's normalise (static
 * there; the blobs must be identical, tests compare with _planes.ans_encode) */
static void normalise(const int64_t *counts, uint64_t total, uint32_t *freq) {
    int64_t sum = 0;
    for (int s = 0; s < 256; s++) {
        freq[s] = 0;
        if (counts[s]) {
            uint64_t f = ((uint64_t)counts[s] * (1u << PROB_BITS) + total / 2) / total;
            freq[s] = f ? (uint32_t)f : 1;
            sum += freq[s];
        }
    }
    int64_t diff = (int64_t)(1u << PROB_BITS) - sum;
    int best = 0;
    for (int s = 1; s < 256; s++) if (freq[s] > freq[best]) best = s;
    if (diff > 0) freq[best] += (uint32_t)diff;
    while (diff < 0) {
        best = 0;
        for (int s = 1; s < 256; s++) if (freq[s] > freq[best]) best = s;
        freq[best]--;
        diff++;
    }
}

/* _ans.c's write_table (FORMAT.md 3.1): symbols, then each frequency's exponent against the
 * previous one (zigzag, unary) and its low bits */
static size_t write_table(const uint32_t *freq, uint8_t *dst) {
    int nsym = 0;
    uint8_t syms[256];
    for (int s = 0; s < 256; s++) if (freq[s]) syms[nsym++] = (uint8_t)s;
    size_t pos = 0;
    dst[pos++] = (uint8_t)(nsym - 1);
    if (nsym < 32) {
        memcpy(dst + pos, syms, (size_t)nsym);
        pos += (size_t)nsym;
    } else {
        memset(dst + pos, 0, 32);
        for (int i = 0; i < nsym; i++) dst[pos + (syms[i] >> 3)] |= (uint8_t)(1u << (syms[i] & 7));
        pos += 32;
    }
    uint64_t acc = 0;
    int bits = 0, prev = 4;
#define PUT(v, nb) do { acc |= (uint64_t)(v) << bits; bits += (nb); \
        while (bits >= 8) { dst[pos++] = (uint8_t)acc; acc >>= 8; bits -= 8; } } while (0)
    for (int i = 0; i < nsym - 1; i++) {
        uint32_t f = freq[syms[i]];
        int k = 31 - __builtin_clz(f), d = k - prev;
        int z = d >= 0 ? 2 * d : -2 * d - 1;
        for (; z >= 8; z -= 8) PUT(0, 8);
        PUT(1u << z, z + 1);
        if (k) PUT(f & ((1u << k) - 1), k);
        prev = k;
    }
#undef PUT
    if (bits) dst[pos++] = (uint8_t)acc;
    return pos;
}

/* ans_encode(sym, lanes_log2) -> bytes: a whole blob with its own table, the bytes of
 * _planes.ans_encode (a constant plane: 0, symbol) */
static PyObject *py_ans_encode(PyObject *self, PyObject *args) {
    Py_buffer src, cb = {0};
    int lanes_log2;
    /* counts (optional, int64 256): the plane's histogram when the caller has it (the writer
     * counted it to decide raw or coded); it must be the histogram of sym (they sum to n) */
    if (!PyArg_ParseTuple(args, "y*i|y*", &src, &lanes_log2, &cb)) return NULL;
    int64_t counts[256] = {0};
    const char *bad = NULL;
    if (lanes_log2 < 0 || lanes_log2 > 7 || src.len < 1) bad = "ans_encode: lanes_log2 in 0..7 and at least one symbol";
    else if (cb.buf) {
        if (cb.len != 256 * (Py_ssize_t)sizeof(int64_t)) bad = "ans_encode: counts must be 256 int64";
        else {
            int64_t sum = 0;
            memcpy(counts, cb.buf, sizeof counts);
            /* each count in [0, n]: their sum cannot wrap, nor counts * 4096 overflow in normalise */
            for (int s = 0; s < 256; s++) {
                if (counts[s] < 0 || counts[s] > src.len) bad = "ans_encode: a count outside [0, number of symbols]";
                else sum += counts[s];
            }
            if (!bad && sum != src.len) bad = "ans_encode: counts do not sum to the number of symbols";
        }
    }
    int have_counts = cb.buf != NULL;
    if (cb.buf) PyBuffer_Release(&cb);
    if (bad) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    size_t n = (size_t)src.len;
    uint32_t freq[256];
    uint8_t head[2048]; /* byte 0 and the table (at most ~600 bytes) */
    size_t hl;
    int nsym = 0, only = 0, mismatch = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!have_counts) hist_one((const uint8_t *)src.buf, n, counts);
    for (int s = 0; s < 256; s++) if (counts[s]) { nsym++; only = s; }
    if (nsym == 1 && have_counts) { /* the constant blob never reads sym: check it is constant */
        const uint8_t *p = (const uint8_t *)src.buf;
        for (size_t i = 0; i < n; i++) if (p[i] != (uint8_t)only) { mismatch = 1; break; }
    }
    if (mismatch) {
        hl = 0;
    } else if (nsym == 1) {
        head[0] = 0;
        head[1] = (uint8_t)only;
        hl = 2;
    } else {
        normalise(counts, n, freq);
        head[0] = (uint8_t)(lanes_log2 + 1);
        hl = 1 + write_table(freq, head + 1);
    }
    Py_END_ALLOW_THREADS
    if (mismatch) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "ans_encode: counts are not the histogram of sym");
        return NULL;
    }
    if (nsym == 1) {
        PyBuffer_Release(&src);
        return PyBytes_FromStringAndSize((const char *)head, 2);
    }
    PyObject *r = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)ENC_CAP(hl, n));
    if (!r) { PyBuffer_Release(&src); return NULL; }
    uint8_t *blob = (uint8_t *)PyBytes_AS_STRING(r);
    memcpy(blob, head, hl);
    size_t len;
    Py_BEGIN_ALLOW_THREADS
    len = encode_into((const uint8_t *)src.buf, n, freq, lanes_log2, blob, hl);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (!len) { /* only with given counts: a symbol of sym they do not count */
        Py_DECREF(r);
        PyErr_SetString(PyExc_ValueError, "ans_encode: counts are not the histogram of sym");
        return NULL;
    }
    if (_PyBytes_Resize(&r, (Py_ssize_t)len) < 0) return NULL;
    return r;
}

static PyObject *py_ans_encode_shared(PyObject *self, PyObject *args) {
    Py_buffer src, fb;
    int lanes_log2;
    if (!PyArg_ParseTuple(args, "y*y*i", &src, &fb, &lanes_log2)) return NULL;
    const char *bad = NULL;
    uint32_t freq[256];
    if (lanes_log2 < 0 || lanes_log2 > 7 || src.len < 1) bad = "ans_encode_shared: lanes_log2 in 0..7 and at least one symbol";
    else if (fb.len != 256 * (Py_ssize_t)sizeof(int64_t)) bad = "ans_encode_shared: freq must be 256 int64";
    else {
        int64_t sum = 0;
        for (int s = 0; s < 256; s++) {
            int64_t f = ((const int64_t *)fb.buf)[s];
            if (f < 0 || f > (1 << PROB_BITS)) { bad = "ans_encode_shared: frequency out of range"; break; }
            freq[s] = (uint32_t)f;
            sum += f;
        }
        if (!bad && sum != (1 << PROB_BITS)) bad = "ans_encode_shared: frequencies must sum to 4096";
    }
    if (bad) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&fb);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    size_t n = (size_t)src.len;
    PyObject *r = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)ENC_CAP(1, n));
    if (!r) { PyBuffer_Release(&src); PyBuffer_Release(&fb); return NULL; }
    uint8_t *blob = (uint8_t *)PyBytes_AS_STRING(r);
    blob[0] = (uint8_t)(lanes_log2 + 1);
    size_t len;
    Py_BEGIN_ALLOW_THREADS
    len = encode_into((const uint8_t *)src.buf, n, freq, lanes_log2, blob, 1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&fb);
    if (!len) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_ValueError, "ans_encode_shared: a symbol of the plane has no frequency in the table");
        return NULL;
    }
    if (_PyBytes_Resize(&r, (Py_ssize_t)len) < 0) return NULL;
    return r;
}

/* ---------------------------------------------------------------- size estimates
 * The writer estimates blob sizes from histograms many times per payload (ans.py's normalise,
 * coded_bits, table_size: numpy calls of a few us each, ~100 ms of a 24 MB pack). */

static int get_256(Py_buffer *b, const char *what) {
    if (b->len != 256 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s must be 256 int64", what);
        return 0;
    }
    return 1;
}

/* normalise(counts, out): ans.normalise into out (int64[256]); counts must hold a symbol */
static PyObject *py_normalise(PyObject *self, PyObject *args) {
    Py_buffer cb, ob;
    if (!PyArg_ParseTuple(args, "y*w*", &cb, &ob)) return NULL;
    PyObject *r = NULL;
    if (get_256(&cb, "counts") && get_256(&ob, "out")) {
        const int64_t *c = (const int64_t *)cb.buf;
        uint64_t total = 0;
        int neg = 0;
        for (int s = 0; s < 256; s++) { if (c[s] < 0) neg = 1; total += (uint64_t)c[s]; }
        if (neg || !total) PyErr_SetString(PyExc_ValueError, "normalise: counts must be >= 0 with a symbol");
        else {
            uint32_t f[256];
            normalise(c, total, f);
            for (int s = 0; s < 256; s++) ((int64_t *)ob.buf)[s] = f[s];
            r = Py_None;
            Py_INCREF(r);
        }
    }
    PyBuffer_Release(&cb);
    PyBuffer_Release(&ob);
    return r;
}

/* coded_bits(counts, freq) -> float: sum of counts * (12 - log2 freq), inf when a present symbol
 * has no frequency (ans.coded_bits) */
static PyObject *py_coded_bits(PyObject *self, PyObject *args) {
    Py_buffer cb, fb;
    if (!PyArg_ParseTuple(args, "y*y*", &cb, &fb)) return NULL;
    PyObject *r = NULL;
    if (get_256(&cb, "counts") && get_256(&fb, "freq")) {
        const int64_t *c = (const int64_t *)cb.buf, *f = (const int64_t *)fb.buf;
        double bits = 0.0;
        int missing = 0;
        for (int s = 0; s < 256; s++) {
            if (c[s] <= 0) continue;
            if (f[s] <= 0) { missing = 1; break; }
            bits += (double)c[s] * (PROB_BITS - log2((double)f[s]));
        }
        r = PyFloat_FromDouble(missing ? Py_HUGE_VAL : bits);
    }
    PyBuffer_Release(&cb);
    PyBuffer_Release(&fb);
    return r;
}

/* table_size(freq) -> int: len(write_table(freq)) */
/* the table of freq (int64 256) written into tmp: its length, or -1 with an error set */
static Py_ssize_t table_from(PyObject *args, const char *who, uint8_t *tmp) {
    Py_buffer fb;
    if (!PyArg_ParseTuple(args, "y*", &fb)) return -1;
    Py_ssize_t r = -1;
    if (get_256(&fb, "freq")) {
        const int64_t *f64 = (const int64_t *)fb.buf;
        uint32_t f[256];
        int bad = 0;
        for (int s = 0; s < 256; s++) { if (f64[s] < 0 || f64[s] > (1 << PROB_BITS)) bad = 1; f[s] = (uint32_t)f64[s]; }
        if (bad) PyErr_Format(PyExc_ValueError, "%s: frequency out of range", who);
        else r = (Py_ssize_t)write_table(f, tmp);
    }
    PyBuffer_Release(&fb);
    return r;
}

static PyObject *py_table_size(PyObject *self, PyObject *args) {
    uint8_t tmp[2048]; /* a table is at most ~600 bytes (frequencies sum to 4096) */
    Py_ssize_t n = table_from(args, "table_size", tmp);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

/* write_table(freq) -> bytes: ans.write_table in C (the Python one costs ~4 ms a table) */
static PyObject *py_write_table(PyObject *self, PyObject *args) {
    uint8_t tmp[2048];
    Py_ssize_t n = table_from(args, "write_table", tmp);
    return n < 0 ? NULL : PyBytes_FromStringAndSize((const char *)tmp, n);
}

static PyMethodDef methods[] = {
    {"split", py_split, METH_VARARGS, "split(data, width, sign_move, out): byte planes of data into out (FORMAT.md 3)"},
    {"rank_pairs", py_rank_pairs, METH_VARARGS, "rank_pairs(plane, table, ranks, escapes) -> int: codecs.rank_planes into the buffers, number of escapes"},
    {"hist", py_hist, METH_VARARGS, "hist(data, block, out): byte histograms of each block-byte slice into out (int64, rows of 256)"},
    {"huffman_bits", py_huffman_bits, METH_VARARGS, "huffman_bits(counts, out): bits of an optimal Huffman code per row of counts (int64 (k, 256)) into out (int64 (k,))"},
    {"normalise", py_normalise, METH_VARARGS, "normalise(counts, out): symbol counts -> frequencies summing to 4096 (ans.normalise)"},
    {"coded_bits", py_coded_bits, METH_VARARGS, "coded_bits(counts, freq) -> float: rANS word bits of these counts under freq (ans.coded_bits)"},
    {"write_table", py_write_table, METH_VARARGS, "write_table(freq) -> bytes: the frequency table (ans.write_table)"},
    {"table_size", py_table_size, METH_VARARGS, "table_size(freq) -> int: bytes of the frequency table (len(ans.write_table(freq)))"},
    {"ans_encode", py_ans_encode, METH_VARARGS, "ans_encode(sym, lanes_log2[, counts]) -> bytes: one plane as an ans blob with its own table (FORMAT.md 3.1); counts: its byte histogram (int64 256) when known"},
    {"ans_encode_shared", py_ans_encode_shared, METH_VARARGS, "ans_encode_shared(sym, freq, lanes_log2) -> bytes: an ans blob without its table (FORMAT.md 3.2)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_encode", "Encode-side helpers of the .onnxz writer (GIL released).", -1, methods};

PyMODINIT_FUNC PyInit__encode(void) { return PyModule_Create(&module); }
