/* Byte-plane merges for the .onnxz codecs `planes` and `fplanes` (FORMAT.md section 3): the decode side
 * (the writer's split is _encode.split).
 *
 * Why C: interleaving byte planes is a strided byte copy, which numpy runs at ~1 GB/s on these
 * machines (measured: 0.7-1.0 GB/s for the merge alone), below the unpack speed the pack stage
 * promises. This loop runs at memory speed. passes/onnxz/codecs.py holds the numpy version used
 * when this module was not built; both produce identical bytes (tested).
 *
 * merge(planes, width, sign_move, out) planes: width*n bytes (plane i at i*n); out: n*width bytes
 * Plane i holds byte (width-1-i) of each little-endian element; with sign_move the sign bit of the
 * top byte t and the next byte n are exchanged as t' = (t<<1)|(n>>7), n' = (t&0x80)|(n&0x7F).
 * It releases the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_planes.h"

/* planes back to back (plane i at src + i*n): the pointer-list merge below does the work */
static void merge_impl(const uint8_t *restrict src, Py_ssize_t n, int w, int sign_move, uint8_t *restrict dst) {
    const uint8_t *p[8];
    for (int i = 0; i < w; i++) p[i] = src + (Py_ssize_t)i * n;
    onnxz_merge_ptrs(p, n, w, sign_move, dst);
}

/* merge(planes, width, sign_move, out): interleave planes (back to back in one buffer) into out */
static PyObject *py_merge(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int w, sign_move;
    if (!PyArg_ParseTuple(args, "y*ipw*", &src, &w, &sign_move, &dst)) return NULL;
    PyObject *result = NULL;
    if (w != 2 && w != 4 && w != 8) {
        PyErr_SetString(PyExc_ValueError, "width must be 2, 4 or 8");
    } else if (src.len != dst.len || src.len % w) {
        PyErr_SetString(PyExc_ValueError, "buffers must have the same size, a multiple of width");
    } else {
        Py_ssize_t n = src.len / w;
        Py_BEGIN_ALLOW_THREADS
        merge_impl((const uint8_t *)src.buf, n, w, sign_move, (uint8_t *)dst.buf);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* expand(table, ranks, escapes, out) -> bool: the exponent plane of codec `fpairs` from 4-bit
 * ranks (two per byte, high nibble first): out[k] = table[r] for r < 15, else the next escape.
 * False when the escapes do not match the ranks (a damaged chunk). */
static PyObject *py_expand(PyObject *self, PyObject *args) {
    Py_buffer table, ranks, esc, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &table, &ranks, &esc, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = out.len;
    if (table.len != 15 || ranks.len != (n + 1) / 2) {
        PyErr_SetString(PyExc_ValueError, "expand: table must hold 15 bytes and ranks (n+1)/2");
    } else {
        const uint8_t *tb = (const uint8_t *)table.buf, *rk = (const uint8_t *)ranks.buf, *es = (const uint8_t *)esc.buf;
        uint8_t *o = (uint8_t *)out.buf;
        Py_ssize_t j = 0, ne = esc.len;
        int ok = 1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n; k++) {
            unsigned r = (k & 1) ? (rk[k >> 1] & 15u) : (rk[k >> 1] >> 4);
            if (r < 15) {
                o[k] = tb[r];
            } else if (j < ne) {
                o[k] = es[j++];
            } else {
                ok = 0;
                break;
            }
        }
        Py_END_ALLOW_THREADS
        result = (ok && j == ne) ? Py_True : Py_False;
        Py_INCREF(result);
    }
    PyBuffer_Release(&table);
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&esc);
    PyBuffer_Release(&out);
    return result;
}

/* copy_runs(dst, src, runs): dst[d:d+n] = src[s:s+n] for every (d, s, n) of the list `runs`.
 * Why: restoring a window copies the skeleton's bytes between the cut tensors into it, one slice
 * assignment per gap in numpy (~1 us each: ~45 us of a 0.6 MB model's ~2.5 ms unpack). Every run
 * is checked to lie inside both buffers before anything is copied (ValueError). */
static PyObject *py_copy_runs(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    PyObject *runs;
    if (!PyArg_ParseTuple(args, "w*y*O!", &dst, &src, &PyList_Type, &runs)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = PyList_GET_SIZE(runs);
    Py_ssize_t *at = (Py_ssize_t *)malloc((size_t)(count ? count : 1) * 3 * sizeof(Py_ssize_t));
    if (!at) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t d, s, n;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(runs, k), "nnn", &d, &s, &n)) goto done;
        if (d < 0 || s < 0 || n < 0 || d > dst.len || n > dst.len - d || s > src.len || n > src.len - s) {
            PyErr_SetString(PyExc_ValueError, "copy_runs: a run lies outside its buffers");
            goto done;
        }
        at[3 * k] = d;
        at[3 * k + 1] = s;
        at[3 * k + 2] = n;
    }
    for (Py_ssize_t k = 0; k < count; k++)
        memmove((uint8_t *)dst.buf + at[3 * k], (const uint8_t *)src.buf + at[3 * k + 1], (size_t)at[3 * k + 2]);
    result = Py_None;
    Py_INCREF(result);
done:
    free(at);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* ---------------------------------------------------------------- untranspose of bytes */

#if ONNXZ_X86
/* 16 rows of 16 bytes (row k at src + k*ss) transposed into dst (row k at dst + k*ds): four rounds
 * of byte/word/dword/qword unpacks (SSE2, every x86-64) */
static inline void transpose16(const uint8_t *src, Py_ssize_t ss, uint8_t *dst, Py_ssize_t ds) {
    __m128i a[16], b[16];
    for (int k = 0; k < 16; k++) a[k] = _mm_loadu_si128((const __m128i *)(src + k * ss));
    for (int k = 0; k < 8; k++) {
        b[2 * k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
        b[2 * k + 1] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++)
        for (int h = 0; h < 2; h++) {
            a[4 * k + 2 * h] = _mm_unpacklo_epi16(b[4 * k + h], b[4 * k + h + 2]);
            a[4 * k + 2 * h + 1] = _mm_unpackhi_epi16(b[4 * k + h], b[4 * k + h + 2]);
        }
    for (int k = 0; k < 2; k++)
        for (int h = 0; h < 4; h++) {
            b[8 * k + 2 * h] = _mm_unpacklo_epi32(a[8 * k + h], a[8 * k + h + 4]);
            b[8 * k + 2 * h + 1] = _mm_unpackhi_epi32(a[8 * k + h], a[8 * k + h + 4]);
        }
    for (int h = 0; h < 8; h++) {
        a[2 * h] = _mm_unpacklo_epi64(b[h], b[h + 8]);
        a[2 * h + 1] = _mm_unpackhi_epi64(b[h], b[h + 8]);
    }
    for (int k = 0; k < 16; k++) _mm_storeu_si128((__m128i *)(dst + k * ds), a[k]);
}
#endif

/* untranspose1(plane, cols, out): codec `transpose` with width 1 (FORMAT.md 3): out, r rows of
 * `cols` bytes, from plane, which holds them column by column (byte (i, j) at plane[j*r + i]).
 * Why: numpy's strided byte copy runs at ~0.8 GB/s here (~0.3 ms for silero-vad's 264 KB STFT
 * basis, which byte columns code smaller than float columns and zstd decodes 5x faster); blocks of
 * 16x16 bytes transposed in registers. GIL released. */
static PyObject *py_untranspose1(PyObject *self, PyObject *args) {
    Py_buffer plane, out;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "y*nw*", &plane, &cols, &out)) return NULL;
    PyObject *result = NULL;
    if (cols < 1 || plane.len != out.len || plane.len % cols) {
        PyErr_SetString(PyExc_ValueError, "untranspose1: plane and out of the same size, whole rows of cols bytes");
        goto done;
    }
    Py_ssize_t rows = plane.len / cols;
    const uint8_t *src = (const uint8_t *)plane.buf;
    uint8_t *dst = (uint8_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i0 = 0;
#if ONNXZ_X86
    /* out rows i0..i0+15, columns j0..j0+15 come from plane rows j0..j0+15 (each `rows` long), bytes i0..i0+15 */
    for (; i0 + 16 <= rows; i0 += 16) {
        Py_ssize_t j0 = 0;
        for (; j0 + 16 <= cols; j0 += 16) transpose16(src + j0 * rows + i0, rows, dst + i0 * cols + j0, cols);
        for (Py_ssize_t i = i0; i < i0 + 16; i++)
            for (Py_ssize_t j = j0; j < cols; j++) dst[i * cols + j] = src[j * rows + i];
    }
#endif
    for (Py_ssize_t i = i0; i < rows; i++)
        for (Py_ssize_t j = 0; j < cols; j++) dst[i * cols + j] = src[j * rows + i];
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&plane);
    PyBuffer_Release(&out);
    return result;
}

/* unsplit(ranks, classes, sub, sizes, out) -> bool: the plane of codec `fpairs` with "split":
 * element k takes the next byte of sub-plane min(rank_k, classes); the sub-planes lie back to
 * back in `sub`, sizes[j] bytes each (int64). False when the sizes do not match the ranks. */
static PyObject *py_unsplit(PyObject *self, PyObject *args) {
    Py_buffer ranks, sub, sizes, out;
    int classes;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*", &ranks, &classes, &sub, &sizes, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = out.len;
    if (classes < 1 || classes > 14 || sizes.len != (Py_ssize_t)sizeof(int64_t) * (classes + 1)
        || ranks.len != (n + 1) / 2 || sub.len != n) {
        PyErr_SetString(PyExc_ValueError, "unsplit: inconsistent buffer sizes");
    } else {
        const int64_t *sz = (const int64_t *)sizes.buf;
        Py_ssize_t pos[16], end[16], start = 0;
        int ok = 1;
        for (int j = 0; j <= classes; j++) {
            if (sz[j] < 0 || sz[j] > n - start) { ok = 0; break; }
            pos[j] = start;
            start += (Py_ssize_t)sz[j];
            end[j] = start;
        }
        if (start != n) ok = 0;
        if (ok) {
            const uint8_t *rk = (const uint8_t *)ranks.buf, *sb = (const uint8_t *)sub.buf;
            uint8_t *o = (uint8_t *)out.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t k = 0; k < n; k++) {
                unsigned r = (k & 1) ? (rk[k >> 1] & 15u) : (rk[k >> 1] >> 4);
                unsigned j = r < (unsigned)classes ? r : (unsigned)classes;
                if (pos[j] >= end[j]) { ok = 0; break; }
                o[k] = sb[pos[j]++];
            }
            Py_END_ALLOW_THREADS
        }
        result = ok ? Py_True : Py_False;
        Py_INCREF(result);
    }
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&sub);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    return result;
}

/* Fused decode of `planes` / `fplanes` / `fpairs` chunks, reading each plane where it lies (a raw
 * plane straight from the file buffer, a decoded one from scratch): one pass writes the output,
 * nothing is gathered into a contiguous planes buffer first.
 * merge_list(planes, sign_move, out): planes is a sequence of w buffers of n bytes each.
 * pairs_merge(table, ranks, escapes, rest, out) -> bool: `fpairs`: the top byte t' of element k
 * from its 4-bit rank (table or the next escape), planes 1..w-1 from the sequence `rest`; False
 * when the escapes do not match the ranks. Both release the GIL. */
#define MAX_W 8

static int get_planes(PyObject *seq, Py_buffer *bufs, int *count, Py_ssize_t n, int lo, int hi) {
    PyObject *fast = PySequence_Fast(seq, "planes must be a sequence of buffers");
    if (!fast) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    if (m < lo || m > hi) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "wrong number of planes");
        return -1;
    }
    *count = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &bufs[i], PyBUF_SIMPLE) < 0) break;
        (*count)++;
        if (bufs[i].len != n) {
            PyErr_SetString(PyExc_ValueError, "planes must all hold n bytes");
            break;
        }
    }
    Py_DECREF(fast);
    if (*count != m || PyErr_Occurred()) {
        for (int i = 0; i < *count; i++) PyBuffer_Release(&bufs[i]);
        *count = 0;
        return -1;
    }
    return 0;
}

/* AVX2 interleave of 2 or 4 planes (the sign moved back when asked): 32 elements per step, the
 * tail left to the portable loop. ~2x the compiler's vectorisation of the loop below, which made
 * the plane merge as costly as the rANS decode of the exponents. Same bytes.
 * nt: non-temporal stores (dst 32-byte aligned): a large output is not read back from cache soon,
 * and streaming it skips the read-for-ownership of every output line (~a third of the traffic) */
#if ONNXZ_X86
__attribute__((target("avx2"))) static Py_ssize_t merge_avx2(const uint8_t *const *p, Py_ssize_t n, int w, int sign_move,
                                                             uint8_t *restrict dst, int nt) {
    Py_ssize_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i t = _mm256_loadu_si256((const __m256i *)(p[0] + k));
        if (w == 2) onnxz_merge32_avx2(t, p[1] + k, NULL, NULL, 2, sign_move, dst + 2 * k, nt);
        else onnxz_merge32_avx2(t, p[1] + k, p[2] + k, p[3] + k, 4, sign_move, dst + 4 * k, nt);
    }
    if (nt) _mm_sfence();
    return k;
}
#endif

void onnxz_merge_ptrs(const uint8_t *const *p, Py_ssize_t n, int w, int sign_move, uint8_t *restrict dst) {
    onnxz_merge_ptrs_nt(p, n, w, sign_move, dst, 0);
}

void onnxz_merge_ptrs_nt(const uint8_t *const *p, Py_ssize_t n, int w, int sign_move, uint8_t *restrict dst, int nt) {
#if ONNXZ_X86
    const uint8_t *q[MAX_W];
    /* the SIMD level of the ans decoder (ans_simd) also picks this loop: tests compare both */
    if (onnxz_ans_simd_level() >= 1 && (w == 2 || w == 4) && n >= 32) {
        Py_ssize_t done = merge_avx2(p, n, w, sign_move, dst, nt && ((uintptr_t)dst & 31) == 0);
        if (done == n) return;
        for (int i = 0; i < w; i++) q[i] = p[i] + done;
        p = q;
        n -= done;
        dst += done * w;
    }
#endif
    if (w == 4) {
        const uint8_t *restrict p0 = p[0], *restrict p1 = p[1], *restrict p2 = p[2], *restrict p3 = p[3];
        for (Py_ssize_t k = 0; k < n; k++) {
            uint32_t t = p0[k], m = p1[k], v;
            if (sign_move)
                v = ((m & 0x80) | (t >> 1)) << 24 | (((t & 1) << 7) | (m & 0x7F)) << 16 | (uint32_t)p2[k] << 8 | p3[k];
            else
                v = t << 24 | m << 16 | (uint32_t)p2[k] << 8 | p3[k];
            memcpy(dst + 4 * k, &v, 4);
        }
        return;
    }
    if (w == 2) {
        const uint8_t *restrict p0 = p[0], *restrict p1 = p[1];
        for (Py_ssize_t k = 0; k < n; k++) {
            uint32_t t = p0[k], m = p1[k];
            uint16_t v = sign_move ? (uint16_t)(((m & 0x80) | (t >> 1)) << 8 | (((t & 1) << 7) | (m & 0x7F)))
                                   : (uint16_t)(t << 8 | m);
            memcpy(dst + 2 * k, &v, 2);
        }
        return;
    }
    for (int i = 0; i < w; i++) {
        const uint8_t *s = p[i];
        uint8_t *d = dst + (w - 1 - i);
        for (Py_ssize_t k = 0; k < n; k++) d[k * w] = s[k];
    }
    if (sign_move) {
        for (Py_ssize_t k = 0; k < n; k++) {
            uint8_t *e = dst + k * w;
            uint8_t t = e[w - 1], m = e[w - 2];
            e[w - 1] = (uint8_t)((m & 0x80) | (t >> 1));
            e[w - 2] = (uint8_t)(((t & 1) << 7) | (m & 0x7F));
        }
    }
}

static PyObject *py_merge_list(PyObject *self, PyObject *args) {
    PyObject *seq;
    int sign_move, count = 0;
    Py_buffer out, bufs[MAX_W];
    if (!PyArg_ParseTuple(args, "Opw*", &seq, &sign_move, &out)) return NULL;
    Py_ssize_t m = PySequence_Size(seq);
    if (m != 2 && m != 4 && m != 8) {
        PyBuffer_Release(&out);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "merge_list: 2, 4 or 8 planes");
        return NULL;
    }
    int w = (int)m;
    if (out.len % w || get_planes(seq, bufs, &count, out.len / w, w, w) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "merge_list: out is not a multiple of width");
        PyBuffer_Release(&out);
        return NULL;
    }
    const uint8_t *p[MAX_W];
    for (int i = 0; i < w; i++) p[i] = (const uint8_t *)bufs[i].buf;
    Py_BEGIN_ALLOW_THREADS
    onnxz_merge_ptrs(p, out.len / w, w, sign_move, (uint8_t *)out.buf);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < count; i++) PyBuffer_Release(&bufs[i]);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* t' of element k (rank nibble r): the table, or the next escape; -1 when the escapes run out */
#define TOP(r, t) do { if ((r) < 15) (t) = tab[(r)]; else if (jj < ne) (t) = es[jj++]; else return 0; } while (0)
#define HI16(t, m) ((((m) & 0x80) | ((t) >> 1)) << 8 | ((((t) & 1) << 7) | ((m) & 0x7F)))

/* t' of elements lo .. hi-1 into tbuf (lo even; hi = n may be odd): two at a time through a
 * 256-entry table of rank-byte pairs; a byte holding an escape (rank 15) goes the slow way. */
#if ONNXZ_X86
/* AVX2: 64 elements (32 rank bytes) per step through a 16-entry shuffle table, while no rank in
 * them is an escape; returns the first element not done (lo + a multiple of 64). Same bytes as the
 * scalar loop, which takes over at the first step holding an escape. */
__attribute__((target("avx2"))) static Py_ssize_t expand_avx2(const uint32_t *tab, const uint8_t *rk, Py_ssize_t lo,
                                                              Py_ssize_t hi, uint8_t *tbuf) {
    uint8_t t16[16];
    for (int i = 0; i < 16; i++) t16[i] = (uint8_t)tab[i];
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t16));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    Py_ssize_t k = lo;
    for (; k + 64 <= hi; k += 64) {
        __m256i r = _mm256_loadu_si256((const __m256i *)(rk + (k >> 1)));
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(r, 4), low4), l = _mm256_and_si256(r, low4);
        __m256i esc = _mm256_or_si256(_mm256_cmpeq_epi8(h, low4), _mm256_cmpeq_epi8(l, low4));
        if (!_mm256_testz_si256(esc, esc)) break;
        __m256i th = _mm256_shuffle_epi8(table, h), tl = _mm256_shuffle_epi8(table, l);
        __m256i a = _mm256_unpacklo_epi8(th, tl), b = _mm256_unpackhi_epi8(th, tl); /* element 2j: high nibble */
        _mm256_storeu_si256((__m256i *)(tbuf + (k - lo)), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)(tbuf + (k - lo) + 32), _mm256_permute2x128_si256(a, b, 0x31));
    }
    return k;
}
#endif

static int expand_block(const uint32_t *restrict lut, const uint32_t *restrict tab, const uint8_t *restrict rk,
                        const uint8_t *restrict es, Py_ssize_t ne, Py_ssize_t *restrict jj,
                        Py_ssize_t lo, Py_ssize_t hi, uint8_t *restrict tbuf) {
    Py_ssize_t k0 = lo;
#if ONNXZ_X86
    while (onnxz_ans_simd_level() >= 1 && hi - k0 >= 64) {  /* vector runs, one escape step at a time between them */
        Py_ssize_t k = expand_avx2(tab, rk, k0, hi, tbuf + (k0 - lo));
        if (k + 64 > hi) { k0 = k; break; }
        for (Py_ssize_t e = k; e < k + 64; e += 2) { /* the step with an escape: the scalar loop's body */
            unsigned b = rk[e >> 1], r0 = b >> 4, r1 = b & 15u;
            uint32_t t0, t1;
            if (r0 < 15) t0 = tab[r0]; else if (*jj < ne) t0 = es[(*jj)++]; else return 0;
            if (r1 < 15) t1 = tab[r1]; else if (*jj < ne) t1 = es[(*jj)++]; else return 0;
            tbuf[e - lo] = (uint8_t)t0;
            tbuf[e - lo + 1] = (uint8_t)t1;
        }
        k0 = k + 64;
    }
#endif
    for (Py_ssize_t k = k0; k < hi; k += 2) {
        unsigned b = rk[k >> 1];
        uint32_t v = lut[b];
        if (v >> 16) {  /* an escape in this pair */
            unsigned r0 = b >> 4, r1 = b & 15u;
            uint32_t t0, t1;
            if (r0 < 15) t0 = tab[r0]; else if (*jj < ne) t0 = es[(*jj)++]; else return 0;
            if (k + 1 < hi) {
                if (r1 < 15) t1 = tab[r1]; else if (*jj < ne) t1 = es[(*jj)++]; else return 0;
            } else {
                t1 = 0;  /* odd n: the pad nibble is ignored */
            }
            v = t0 | t1 << 8;
        }
        tbuf[k - lo] = (uint8_t)v;
        tbuf[k - lo + 1] = (uint8_t)(v >> 8);
    }
    return 1;
}

#define BLOCK 4096

static int pairs4(const uint8_t *tb, const uint8_t *restrict rk, const uint8_t *restrict es, Py_ssize_t ne, Py_ssize_t *j,
                  const uint8_t *restrict p1, const uint8_t *restrict p2, const uint8_t *restrict p3, Py_ssize_t n,
                  uint8_t *restrict dst) {
    uint32_t tab[16], lut[256];
    uint8_t tbuf[BLOCK + 2];
    for (int i = 0; i < 15; i++) tab[i] = tb[i];
    tab[15] = 0;
    for (unsigned b = 0; b < 256; b++)
        lut[b] = ((b >> 4) == 15 || (b & 15) == 15) ? 1u << 16 : tab[b >> 4] | tab[b & 15] << 8;
    Py_ssize_t jj = 0;
    for (Py_ssize_t lo = 0; lo < n; lo += BLOCK) {
        Py_ssize_t hi = lo + BLOCK < n ? lo + BLOCK : n;
        if (!expand_block(lut, tab, rk, es, ne, &jj, lo, hi, tbuf)) return 0;
        /* an odd tail: the pad nibble's slot of tbuf is written (never an escape) but not used.
         * The merge with the sign moved back is HI16 with planes 2 and 3 below it: the plane
         * merge's AVX2 loop (the compiler's vectorisation of the loop here is SSE2 only:
         * measured below) */
        const uint8_t *ptr[4] = {tbuf, p1 + lo, p2 + lo, p3 + lo};
        onnxz_merge_ptrs(ptr, hi - lo, 4, 1, dst + 4 * lo);
    }
    *j = jj;
    return 1;
}

static int pairs2(const uint8_t *tb, const uint8_t *restrict rk, const uint8_t *restrict es, Py_ssize_t ne, Py_ssize_t *j,
                  const uint8_t *restrict p1, Py_ssize_t n, uint8_t *restrict dst) {
    uint32_t tab[16];
    for (int i = 0; i < 15; i++) tab[i] = tb[i];
    tab[15] = 0;
    Py_ssize_t jj = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned r = (k & 1) ? (rk[k >> 1] & 15u) : (rk[k >> 1] >> 4);
        uint32_t t, m = p1[k];
        TOP(r, t);
        uint16_t v = (uint16_t)HI16(t, m);
        memcpy(dst + 2 * k, &v, 2);
    }
    *j = jj;
    return 1;
}

static PyObject *py_pairs_merge(PyObject *self, PyObject *args) {
    Py_buffer table, ranks, esc, out, bufs[MAX_W];
    PyObject *seq;
    int count = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*Ow*", &table, &ranks, &esc, &seq, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = PySequence_Size(seq);
    int w = (int)m + 1;
    if (m < 0) {
        /* error set */
    } else if ((w != 2 && w != 4) || out.len % w || table.len != 15 || ranks.len != (out.len / w + 1) / 2) {
        PyErr_SetString(PyExc_ValueError, "pairs_merge: inconsistent buffer sizes");
    } else if (get_planes(seq, bufs, &count, out.len / w, w - 1, w - 1) == 0) {
        Py_ssize_t n = out.len / w, j = 0, ne = esc.len;
        const uint8_t *tb = (const uint8_t *)table.buf, *rk = (const uint8_t *)ranks.buf, *es = (const uint8_t *)esc.buf;
        const uint8_t *p1 = (const uint8_t *)bufs[0].buf;
        const uint8_t *p2 = w == 4 ? (const uint8_t *)bufs[1].buf : NULL;
        const uint8_t *p3 = w == 4 ? (const uint8_t *)bufs[2].buf : NULL;
        int ok;
        Py_BEGIN_ALLOW_THREADS
        ok = w == 4 ? pairs4(tb, rk, es, ne, &j, p1, p2, p3, n, (uint8_t *)out.buf)
                    : pairs2(tb, rk, es, ne, &j, p1, n, (uint8_t *)out.buf);
        Py_END_ALLOW_THREADS
        for (int i = 0; i < count; i++) PyBuffer_Release(&bufs[i]);
        result = (ok && j == ne) ? Py_True : Py_False;
        Py_INCREF(result);
    }
    PyBuffer_Release(&table);
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&esc);
    PyBuffer_Release(&out);
    return result;
}

/* ---------------------------------------------------------------- index rows
 *
 * Why C: opening a file checks every tensor entry of its index (format.parse_index); in Python
 * that loop cost ~1.3 us per entry, 0.3-0.6 ms of a small model's ~2 ms unpack (300+ entries).
 * index_rows(tensors, last_file, fields[, coded_only]) -> list or str: for every entry of the index's `tensors`
 * list, in order, the checks parse_index made in Python (same order within an entry, same
 * messages; the stream is left to format._stream) and its row
 * (key, name, dtype, shape (a copy), field, file, offset, length, stream or None), the order of
 * format.TensorEntry's fields; or the message of the first failure (format._bad's "what"). */
static PyObject *K_KEY, *K_NAME, *K_SHAPE, *K_FIELD, *K_STREAM, *K_LENGTH, *K_DTYPE, *K_FILE, *K_OFFSET, *EMPTY;

#define INDEX_INT_MAX ((long long)1 << 62)

/* v an exact int in [lo, hi] (bool is not one) */
static int int_in(PyObject *v, long long lo, long long hi) {
    if (!v || !PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return 0;
    if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return lo <= x && x <= hi;
}

static PyObject *index_rows(PyObject *self, PyObject *args) {
    PyObject *tensors, *fields;
    Py_ssize_t last_file;
    int coded_only = 0;
    if (!PyArg_ParseTuple(args, "O!nO|p", &PyList_Type, &tensors, &last_file, &fields, &coded_only)) return NULL;
    if (!PyAnySet_Check(fields)) { PyErr_SetString(PyExc_TypeError, "index_rows: fields must be a set"); return NULL; }
    if (coded_only && last_file < 0) { PyErr_SetString(PyExc_ValueError, "index_rows: last_file must be >= 0"); return NULL; }
    Py_ssize_t count = PyList_GET_SIZE(tensors);
    /* coded_only: rows only of the entries with a stream, as (index, row) pairs, and per file the
     * largest offset + length of its entries (every entry checked all the same): unpacking reads
     * only the coded entries, and the tuples of a few hundred small tensors cost ~0.1 ms to make
     * and free (format.parse_index) */
    PyObject *rows = PyList_New(coded_only ? 0 : count), *keys = PySet_New(NULL), *msg = NULL;
    long long *ends = coded_only ? (long long *)calloc((size_t)last_file + 1, sizeof(long long)) : NULL;
    if (!rows || !keys || (coded_only && !ends)) {
        if (coded_only && !ends) PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PyList_GET_ITEM(tensors, i);
        if (!PyDict_CheckExact(t)) { msg = PyUnicode_FromFormat("tensor %zd", i); goto done; }
        /* borrowed references: the dict outlives this call (the caller holds the index) */
        PyObject *key = PyDict_GetItemWithError(t, K_KEY);
        PyObject *name = key || !PyErr_Occurred() ? PyDict_GetItemWithError(t, K_NAME) : NULL;
        if (PyErr_Occurred()) goto fail;
        if (!name) name = EMPTY;
        PyObject *shape = PyDict_GetItemWithError(t, K_SHAPE);
        if (!shape && PyErr_Occurred()) goto fail;
        if (!key || !PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(name) || !shape || !PyList_CheckExact(shape)) {
            msg = PyUnicode_FromFormat("tensor %zd key/name/shape", i);
            goto done;
        }
        int seen = PySet_Contains(keys, key);
        if (seen < 0) goto fail;
        if (seen) { msg = PyUnicode_FromFormat("tensor key %R repeated", key); goto done; }
        if (PySet_Add(keys, key) < 0) goto fail;
        Py_ssize_t nd = PyList_GET_SIZE(shape);
        for (Py_ssize_t k = 0; k < nd; k++) {
            PyObject *d = PyList_GET_ITEM(shape, k);
            if (!int_in(d, -INDEX_INT_MAX, INDEX_INT_MAX)) { msg = PyUnicode_FromFormat("dim = %R", d); goto done; }
        }
        PyObject *field = PyDict_GetItemWithError(t, K_FIELD);
        if (!field && PyErr_Occurred()) goto fail;
        int known = field && PyUnicode_CheckExact(field) ? PySet_Contains(fields, field) : 0;
        if (known < 0) goto fail;
        if (!known) { msg = PyUnicode_FromFormat("tensor %zd field %R", i, field ? field : Py_None); goto done; }
        PyObject *stream = PyDict_GetItemWithError(t, K_STREAM);
        PyObject *length = stream || !PyErr_Occurred() ? PyDict_GetItemWithError(t, K_LENGTH) : NULL;
        PyObject *dtype = length || !PyErr_Occurred() ? PyDict_GetItemWithError(t, K_DTYPE) : NULL;
        PyObject *file = dtype || !PyErr_Occurred() ? PyDict_GetItemWithError(t, K_FILE) : NULL;
        PyObject *offset = file || !PyErr_Occurred() ? PyDict_GetItemWithError(t, K_OFFSET) : NULL;
        if (PyErr_Occurred()) goto fail;
        if (!stream) stream = Py_None;
        if (!int_in(length, 0, INDEX_INT_MAX)) { msg = PyUnicode_FromFormat("tensor length = %R", length ? length : Py_None); goto done; }
        if (!int_in(dtype, 0, 1 << 16)) { msg = PyUnicode_FromFormat("dtype = %R", dtype ? dtype : Py_None); goto done; }
        if (!int_in(file, 0, last_file)) { msg = PyUnicode_FromFormat("tensor file = %R", file ? file : Py_None); goto done; }
        if (!int_in(offset, 0, INDEX_INT_MAX)) { msg = PyUnicode_FromFormat("tensor offset = %R", offset ? offset : Py_None); goto done; }
        if (coded_only) { /* (the checks above bound both by 2^62: no overflow) */
            long long end = PyLong_AsLongLong(offset) + PyLong_AsLongLong(length), *e = &ends[PyLong_AsSsize_t(file)];
            if (end > *e) *e = end;
            if (stream == Py_None) continue;
        }
        PyObject *dims = PyList_GetSlice(shape, 0, nd);
        if (!dims) goto fail;
        PyObject *row = PyTuple_Pack(9, key, name, dtype, dims, field, file, offset, length, stream);
        Py_DECREF(dims);
        if (!row) goto fail;
        if (!coded_only) {
            PyList_SET_ITEM(rows, i, row);
            continue;
        }
        PyObject *pair = PyTuple_New(2), *at = pair ? PyLong_FromSsize_t(i) : NULL;
        if (!at) {
            Py_XDECREF(pair);
            Py_DECREF(row);
            goto fail;
        }
        PyTuple_SET_ITEM(pair, 0, at);
        PyTuple_SET_ITEM(pair, 1, row);
        int bad = PyList_Append(rows, pair) < 0;
        Py_DECREF(pair);
        if (bad) goto fail;
    }
    Py_DECREF(keys);
    if (!coded_only) return rows;
    PyObject *end_list = PyList_New(last_file + 1), *out = NULL;
    for (Py_ssize_t f = 0; end_list && f <= last_file; f++) {
        PyObject *v = PyLong_FromLongLong(ends[f]);
        if (!v) Py_CLEAR(end_list);
        else PyList_SET_ITEM(end_list, f, v);
    }
    if (end_list) out = PyTuple_Pack(2, rows, end_list);
    Py_XDECREF(end_list);
    Py_DECREF(rows);
    free(ends);
    return out;
done:
    Py_XDECREF(rows);
    Py_XDECREF(keys);
    free(ends);
    return msg; /* NULL (with the error set) when the message could not be made */
fail:
    Py_XDECREF(rows);
    Py_XDECREF(keys);
    free(ends);
    return NULL;
}



/* ---------------------------------------------------------------- records
 *
 * An instance of one of format's record dataclasses (Chunk, Stream, TensorEntry) with its fields
 * set, without calling the class: the __init__ that @dataclass generates is Python (~1 us for a
 * record of 5-9 fields from C, ~0.5 us of it the frame and the argument binding); opening a small
 * model made ~70 records (silero_vad_v6.int8), ~4% of unpacking it. Taken only for a class that
 * this builds the same instance for: object's __new__ and __setattr__, no __post_init__, and
 * __match_args__ (the fields of the generated __init__, in order) and __dataclass_fields__ (all
 * its fields: none left to a default factory) as long as the values; any other class is called
 * as before. */
static PyObject *K_MATCH_ARGS, *K_POST_INIT, *K_DC_FIELDS, *EMPTY_ARGS;

static PyObject *make_record(PyObject *cls, PyObject *const *vals, Py_ssize_t n) {
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (PyType_Check(cls) && tp->tp_new == PyBaseObject_Type.tp_new && tp->tp_setattro == PyObject_GenericSetAttr) {
        /* (looked up in the class and its bases without raising: a miss is no exception made) */
        PyObject *names = _PyType_Lookup(tp, K_MATCH_ARGS), *fields = _PyType_Lookup(tp, K_DC_FIELDS); /* borrowed */
        if (names && PyTuple_CheckExact(names) && PyTuple_GET_SIZE(names) == n && fields && PyDict_CheckExact(fields) &&
            PyDict_GET_SIZE(fields) == n && !_PyType_Lookup(tp, K_POST_INIT)) {
            Py_INCREF(names);
            PyObject *o = tp->tp_new(tp, EMPTY_ARGS, NULL);
            for (Py_ssize_t i = 0; o && i < n; i++)
                if (PyObject_GenericSetAttr(o, PyTuple_GET_ITEM(names, i), vals[i]) < 0) Py_CLEAR(o);
            Py_DECREF(names);
            return o;
        }
    }
    return PyObject_Vectorcall(cls, vals, (size_t)n, NULL);
}

/* record(cls, *values) -> cls(*values), built by make_record where it may be */
static PyObject *py_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "record(cls, *values): the class is missing");
        return NULL;
    }
    return make_record(args[0], args + 1, nargs - 1);
}

/* ---------------------------------------------------------------- ans streams of the index
 *
 * stream_ans(obj, lo, hi, spans, resolved, chunk_cls, stream_cls, max_chunk, plane_hi) -> Stream or
 * None: format._stream for a well-formed `ans` or `ans_shared` stream (the codecs of nearly every
 * coded tensor), or `bytes` / `transpose` (every skeleton, and a few tensors of a small model:
 * ~15 lines of Python per chunk before), its checks made here, the same records built (Chunk and
 * Stream with the fields _stream gives them; make_record). Why: _stream cost ~4 us per stream in Python, ~0.65 ms of opening a
 * model of 160 coded tensors. None (nothing changed: `spans` is extended only on success) for any
 * other codec, any entry that fails a check, or shared tables not resolved yet: _stream then does
 * the work in Python and raises its own errors, so verdicts and messages are those of one code. */
static PyObject *K_CODEC, *K_PARAMS, *K_CHUNKS, *K_WIDTH, *K_SIGN, *K_PAIRS, *K_TABLES, *K_TABLE_DATA, *S_ANS, *S_ANS_SHARED;
static PyObject *K_COLS, *S_BYTES, *S_TRANSPOSE;

/* v an exact int in [lo, hi] into *out (0: not one) */
static int int_val(PyObject *v, long long lo, long long hi, long long *out) {
    if (!v || !PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    *out = x;
    return lo <= x && x <= hi;
}

/* codecs.check_params of `ans` / `ans_shared` passed: 1, else 0 (or -1 with an error set); *w, *flags */
static int ans_params_ok(PyObject *params, int shared, long long *w, int *flags) {
    PyObject *width = PyDict_GetItemWithError(params, K_WIDTH);
    PyObject *sign = width ? PyDict_GetItemWithError(params, K_SIGN) : NULL;
    PyObject *pairs = sign ? PyDict_GetItemWithError(params, K_PAIRS) : NULL;
    if (PyErr_Occurred()) return -1;
    if (!int_val(width, 1, 8, w) || (*w != 1 && *w != 2 && *w != 4 && *w != 8)) return 0;
    if (!sign || !PyBool_Check(sign) || (sign == Py_True && *w == 1)) return 0;
    int pr = 0;
    if (pairs) { /* absent: False */
        if (!PyBool_Check(pairs)) return 0;
        pr = pairs == Py_True;
    }
    if (shared && pr) return 0;
    if (pr && (sign != Py_True || (*w != 2 && *w != 4))) return 0;
    *flags = (sign == Py_True ? 1 : 0) | (pr ? 2 : 0);
    return 1;
}

static PyObject *stream_ans(PyObject *self, PyObject *args) {
    PyObject *obj, *spans, *resolved, *chunk_cls, *stream_cls;
    long long lo, hi, max_chunk, plane_hi;
    if (!PyArg_ParseTuple(args, "OLLO!OOOLL", &obj, &lo, &hi, &PyList_Type, &spans, &resolved, &chunk_cls, &stream_cls,
                          &max_chunk, &plane_hi))
        return NULL;
    if (!PyDict_CheckExact(obj)) Py_RETURN_NONE;
    PyObject *codec = PyDict_GetItemWithError(obj, K_CODEC); /* borrowed: the index holds them */
    PyObject *params = codec ? PyDict_GetItemWithError(obj, K_PARAMS) : NULL;
    PyObject *chunks_in = params ? PyDict_GetItemWithError(obj, K_CHUNKS) : NULL;
    if (PyErr_Occurred()) return NULL;
    if (!codec || !PyUnicode_CheckExact(codec) || !params || !PyDict_CheckExact(params) || !chunks_in || !PyList_CheckExact(chunks_in))
        Py_RETURN_NONE;
    int shared = PyUnicode_Compare(codec, S_ANS_SHARED) == 0;
    /* plain: `bytes` or `transpose` (a small model's skeleton and a few tensors): one plane per
     * chunk, no batch spec; raw a multiple of `step` (transpose: whole rows, at least one) */
    int plain = 0;
    long long w = 1, step = 1;
    int flags = 0;
    if (!shared && PyUnicode_Compare(codec, S_ANS) != 0) {
        if (PyErr_Occurred()) return NULL;
        if (PyUnicode_Compare(codec, S_BYTES) == 0) {
            plain = 1;
        } else if (PyUnicode_Compare(codec, S_TRANSPOSE) == 0) { /* codecs.check_params of transpose */
            PyObject *width = PyDict_GetItemWithError(params, K_WIDTH);
            PyObject *cols = width ? PyDict_GetItemWithError(params, K_COLS) : NULL;
            if (PyErr_Occurred()) return NULL;
            long long tw, tc;
            if (!int_val(width, 1, 8, &tw) || (tw != 1 && tw != 2 && tw != 4 && tw != 8) || !int_val(cols, 2, max_chunk, &tc))
                Py_RETURN_NONE;
            plain = 2;
            step = tw * tc;
        } else {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
    }
    if (!plain) {
        int ok = ans_params_ok(params, shared, &w, &flags);
        if (ok <= 0) {
            if (ok < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *batch_tables = Py_None, *kept_params = params, *got = NULL;
    long long plane_lo = plain ? 1 : 0;
    if (shared) { /* the table list, resolved by _stream for an earlier stream of this index */
        plane_lo = 1;
        PyObject *tables = PyDict_GetItemWithError(params, K_TABLES);
        if (!tables) { if (PyErr_Occurred()) return NULL; Py_RETURN_NONE; }
        if (!PyList_CheckExact(tables) || PyList_GET_SIZE(tables) != w || !PyDict_CheckExact(resolved)) Py_RETURN_NONE;
        long long top = -1, t;
        for (Py_ssize_t i = 0; i < w; i++) {
            if (!int_val(PyList_GET_ITEM(tables, i), -1, LLONG_MAX, &t)) Py_RETURN_NONE;
            if (t > top) top = t;
        }
        if (top < 0) Py_RETURN_NONE;
        PyObject *ids = PyList_AsTuple(tables);
        if (!ids) return NULL;
        got = PyDict_GetItemWithError(resolved, ids);
        Py_DECREF(ids);
        if (!got) { if (PyErr_Occurred()) return NULL; Py_RETURN_NONE; }
        if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 2 || !PyList_CheckExact(PyTuple_GET_ITEM(got, 0))) Py_RETURN_NONE;
        batch_tables = PyTuple_GET_ITEM(got, 1);
    }
    /* codecs.plane_sizes: pairs add table, ranks, escapes; bytes and transpose have one plane */
    Py_ssize_t n_planes = plain ? 1 : flags & 2 ? w + 2 : w;
    Py_ssize_t count = PyList_GET_SIZE(chunks_in);
    PyObject *chunks = PyList_New(0), *new_spans = PyList_New(0), *result = NULL, *flag_obj = PyLong_FromLong(flags);
    if (!chunks || !new_spans || !flag_obj) goto done;
    long long total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *c = PyList_GET_ITEM(chunks_in, k);
        if (!PyList_CheckExact(c) || PyList_GET_SIZE(c) != 4 || !PyList_CheckExact(PyList_GET_ITEM(c, 2))) goto fallback;
        PyObject *off_o = PyList_GET_ITEM(c, 0), *raw_o = PyList_GET_ITEM(c, 1), *planes = PyList_GET_ITEM(c, 2),
                 *digest_o = PyList_GET_ITEM(c, 3);
        long long off, raw;
        if (!int_val(off_o, 0, INDEX_INT_MAX, &off)) goto fallback;
        if (!PyLong_CheckExact(digest_o)) goto fallback;
        unsigned long long digest = PyLong_AsUnsignedLongLong(digest_o); /* negative or above 2^64-1: an error */
        if (digest == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); goto fallback; }
        if (!int_val(raw_o, 0, max_chunk, &raw)) goto fallback;
        Py_ssize_t np_ = PyList_GET_SIZE(planes);
        long long stored = 0, p;
        for (Py_ssize_t i = 0; i < np_; i++) {
            if (!int_val(PyList_GET_ITEM(planes, i), plane_lo, plane_hi, &p)) goto fallback;
            stored += p;
        }
        if (plain == 1 ? 0 : plain == 2 ? raw % step || !raw : raw % w || !raw) goto fallback; /* (bytes: any raw) */
        if (np_ != n_planes) goto fallback;
        if (off < lo || off + stored > hi) goto fallback;
        PyObject *kept = PyList_GetSlice(planes, 0, np_);
        PyObject *kept_t = kept ? PyList_AsTuple(kept) : NULL;
        PyObject *stored_o = kept_t ? PyLong_FromLongLong(stored) : NULL;
        PyObject *spec = !stored_o ? NULL : plain ? (Py_INCREF(Py_None), Py_None) : PyTuple_Pack(5, off_o, stored_o, kept_t, digest_o, flag_obj);
        PyObject *span = spec ? PyTuple_Pack(2, off_o, stored_o) : NULL;
        PyObject *chunk = NULL;
        if (span) {
            PyObject *cargs[5] = {off_o, raw_o, kept, digest_o, spec};
            chunk = make_record(chunk_cls, cargs, 5);
        }
        int bad = !chunk || PyList_Append(chunks, chunk) < 0 || PyList_Append(new_spans, span) < 0;
        Py_XDECREF(kept);
        Py_XDECREF(kept_t);
        Py_XDECREF(stored_o);
        Py_XDECREF(spec);
        Py_XDECREF(span);
        Py_XDECREF(chunk);
        if (bad) goto done;
        total += raw;
    }
    if (shared) { /* dict(params, table_data=list(data)): a list of its own per stream, as _stream */
        kept_params = PyDict_Copy(params);
        PyObject *data = kept_params ? PyList_GetSlice(PyTuple_GET_ITEM(got, 0), 0, PY_SSIZE_T_MAX) : NULL;
        int bad = !data || PyDict_SetItem(kept_params, K_TABLE_DATA, data) < 0;
        Py_XDECREF(data);
        if (bad) {
            Py_XDECREF(kept_params);
            goto done;
        }
    } else {
        Py_INCREF(kept_params);
    }
    PyObject *total_o = PyLong_FromLongLong(total);
    if (total_o) {
        PyObject *sargs[5] = {codec, kept_params, chunks, total_o, batch_tables};
        result = make_record(stream_cls, sargs, 5);
        Py_DECREF(total_o);
    }
    Py_DECREF(kept_params);
    if (result) {
        Py_ssize_t n = PyList_GET_SIZE(spans);
        if (PyList_SetSlice(spans, n, n, new_spans) < 0) Py_CLEAR(result);
    }
    goto done;
fallback:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(chunks);
    Py_XDECREF(new_spans);
    Py_XDECREF(flag_obj);
    return result;
}

/* check_cuts(cuts, coded, file, size, last_tensor) -> (cuts as tuples, bytes cut) or None: the cut
 * list of file entry `file` (`size` bytes) checked as format.parse_index's loop checks it (each
 * [offset, length, tensor] exact ints in range, in order, inside the file, naming a coded tensor of
 * `coded` (dict: tensor index -> TensorEntry) of this file at that offset and length). None for any
 * failure: the Python loop then runs and raises its own error (one place for the verdicts and
 * messages). Why: ~15 lines of Python per cut, ~4% of opening a small model. */
static PyObject *K_FILE_ATTR, *K_OFFSET_ATTR, *K_LENGTH_ATTR;

static PyObject *check_cuts(PyObject *self, PyObject *args) {
    PyObject *cuts_in, *coded;
    long long file_no, size, last_tensor;
    if (!PyArg_ParseTuple(args, "O!O!LLL", &PyList_Type, &cuts_in, &PyDict_Type, &coded, &file_no, &size, &last_tensor))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(cuts_in);
    PyObject *cuts = PyList_New(count);
    if (!cuts) return NULL;
    long long end = 0, cut_bytes = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *c = PyList_GET_ITEM(cuts_in, k);
        if (!PyList_CheckExact(c) || PyList_GET_SIZE(c) != 3) goto fallback;
        PyObject *off_o = PyList_GET_ITEM(c, 0), *ln_o = PyList_GET_ITEM(c, 1), *ti_o = PyList_GET_ITEM(c, 2);
        long long off, ln, ti, v;
        if (!int_val(off_o, 0, INDEX_INT_MAX, &off) || !int_val(ln_o, 1, INDEX_INT_MAX, &ln) ||
            !int_val(ti_o, 0, last_tensor, &ti))
            goto fallback;
        if (off < end || off + ln > size) goto fallback;
        PyObject *te = PyDict_GetItemWithError(coded, ti_o); /* borrowed */
        if (!te) {
            if (PyErr_Occurred()) goto error;
            goto fallback;
        }
        PyObject *const names[3] = {K_FILE_ATTR, K_OFFSET_ATTR, K_LENGTH_ATTR};
        const long long want[3] = {file_no, off, ln};
        for (int j = 0; j < 3; j++) { /* te.file == file, te.offset == off, te.length == ln */
            PyObject *a = PyObject_GetAttr(te, names[j]);
            if (!a) goto error;
            int same = int_val(a, LLONG_MIN, LLONG_MAX, &v) && v == want[j];
            Py_DECREF(a);
            if (!same) goto fallback;
        }
        end = off + ln;
        cut_bytes += ln;
        PyObject *t = PyTuple_Pack(3, off_o, ln_o, ti_o);
        if (!t) goto error;
        PyList_SET_ITEM(cuts, k, t);
    }
    PyObject *total = PyLong_FromLongLong(cut_bytes);
    PyObject *result = total ? PyTuple_Pack(2, cuts, total) : NULL;
    Py_XDECREF(total);
    Py_DECREF(cuts);
    return result;
fallback:
    Py_DECREF(cuts);
    Py_RETURN_NONE;
error:
    Py_DECREF(cuts);
    return NULL;
}


/* whole_file_plan(cuts, coded, window, size) -> (runs, others, batch): what reader.PackedFile.
 * _whole_file_tasks makes of a file restored in one window, in one pass over its cuts (a list of
 * (offset, length, tensor index)), the same items in the same order: `runs` (window offset,
 * skeleton offset, length) of the skeleton bytes between the cuts; `others` (stream, chunk, window
 * offset, length) of the chunks without a batch spec (codecs other than ans); `batch` the
 * ans_decode_batch tasks of the others (spec with flag 4, out, [tables]), each out a memoryview
 * of its bytes of `window`. `coded`: tensor index -> TensorEntry. Why: ~17 lines of Python per
 * chunk, ~400 of the ~1900 lines an unpack of a small model ran (silero_vad_v6.int8). */
static PyObject *K_STREAM_ATTR, *K_TABLES_ATTR, *K_CHUNKS_ATTR, *K_RAW_LENGTH_ATTR, *K_SPEC_ATTR;

static PyObject *whole_file_plan(PyObject *self, PyObject *args) {
    PyObject *cuts, *coded, *window;
    long long size;
    if (!PyArg_ParseTuple(args, "O!O!OL", &PyList_Type, &cuts, &PyDict_Type, &coded, &window, &size)) return NULL;
    PyObject *mv = PyMemoryView_FromObject(window);
    if (!mv) return NULL;
    PyObject *runs = PyList_New(0), *others = PyList_New(0), *batch = PyList_New(0), *result = NULL, *four = PyLong_FromLong(4);
    PyObject *stream = NULL, *tables = NULL, *chunks = NULL;
    if (!runs || !others || !batch || !four) goto done;
    long long pos = 0, skel_at = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(cuts); k++) {
        PyObject *cut = PyList_GET_ITEM(cuts, k);
        long long off, ln;
        if (!PyTuple_CheckExact(cut) || PyTuple_GET_SIZE(cut) != 3 || !int_val(PyTuple_GET_ITEM(cut, 0), 0, LLONG_MAX, &off) ||
            !int_val(PyTuple_GET_ITEM(cut, 1), 0, LLONG_MAX, &ln)) {
            PyErr_SetString(PyExc_ValueError, "whole_file_plan: cuts must be (offset, length, tensor index) tuples");
            goto done;
        }
        if (off > pos) {
            PyObject *run = Py_BuildValue("(LLL)", pos, skel_at, off - pos);
            int bad = !run || PyList_Append(runs, run) < 0;
            Py_XDECREF(run);
            if (bad) goto done;
            skel_at += off - pos;
        }
        PyObject *te = PyDict_GetItemWithError(coded, PyTuple_GET_ITEM(cut, 2)); /* borrowed */
        if (!te) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(cut, 2));
            goto done;
        }
        if (!(stream = PyObject_GetAttr(te, K_STREAM_ATTR)) || !(tables = PyObject_GetAttr(stream, K_TABLES_ATTR)) ||
            !(chunks = PyObject_GetAttr(stream, K_CHUNKS_ATTR)))
            goto done;
        if (!PyList_CheckExact(chunks)) {
            PyErr_SetString(PyExc_TypeError, "whole_file_plan: a stream's chunks must be a list");
            goto done;
        }
        long long at = off;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(chunks); j++) {
            PyObject *c = PyList_GET_ITEM(chunks, j);
            PyObject *raw_o = PyObject_GetAttr(c, K_RAW_LENGTH_ATTR);
            long long r;
            int ok = raw_o && int_val(raw_o, 0, LLONG_MAX, &r);
            Py_XDECREF(raw_o);
            if (!ok) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "whole_file_plan: bad chunk raw_length");
                goto done;
            }
            if (!r) continue;
            if (at < 0 || at + r > size) {
                PyErr_SetString(PyExc_ValueError, "whole_file_plan: a chunk lies outside the file");
                goto done;
            }
            PyObject *spec = PyObject_GetAttr(c, K_SPEC_ATTR);
            if (!spec) goto done;
            PyObject *item = NULL;
            const int other = spec == Py_None;
            if (other) {
                item = Py_BuildValue("(OOLL)", stream, c, at, r);
            } else if (PyTuple_CheckExact(spec) && PyTuple_GET_SIZE(spec) == 5) {
                PyObject *flags = PyNumber_Or(PyTuple_GET_ITEM(spec, 4), four);
                PyObject *out = flags ? PySequence_GetSlice(mv, (Py_ssize_t)at, (Py_ssize_t)(at + r)) : NULL;
                if (out)
                    item = tables == Py_None
                        ? PyTuple_Pack(6, PyTuple_GET_ITEM(spec, 0), PyTuple_GET_ITEM(spec, 1), PyTuple_GET_ITEM(spec, 2), PyTuple_GET_ITEM(spec, 3), flags, out)
                        : PyTuple_Pack(7, PyTuple_GET_ITEM(spec, 0), PyTuple_GET_ITEM(spec, 1), PyTuple_GET_ITEM(spec, 2), PyTuple_GET_ITEM(spec, 3), flags, out, tables);
                Py_XDECREF(flags);
                Py_XDECREF(out);
            } else {
                PyErr_SetString(PyExc_ValueError, "whole_file_plan: a chunk's spec must be None or a 5-tuple");
            }
            Py_DECREF(spec);
            int bad = !item || PyList_Append(other ? others : batch, item) < 0;
            Py_XDECREF(item);
            if (bad) goto done;
            at += r;
        }
        Py_CLEAR(stream);
        Py_CLEAR(tables);
        Py_CLEAR(chunks);
        pos = off + ln;
    }
    if (size > pos) {
        PyObject *run = Py_BuildValue("(LLL)", pos, skel_at, size - pos);
        int bad = !run || PyList_Append(runs, run) < 0;
        Py_XDECREF(run);
        if (bad) goto done;
    }
    result = PyTuple_Pack(3, runs, others, batch);
done:
    Py_XDECREF(stream);
    Py_XDECREF(tables);
    Py_XDECREF(chunks);
    Py_XDECREF(runs);
    Py_XDECREF(others);
    Py_XDECREF(batch);
    Py_XDECREF(four);
    Py_DECREF(mv);
    return result;
}

static int index_init(void) {
    const char *names[] = {"key", "name", "shape", "field", "stream", "length", "dtype", "file", "offset", "",
                           "codec", "params", "chunks", "width", "sign", "pairs", "tables", "table_data", "ans", "ans_shared"};
    PyObject **slots[] = {&K_KEY, &K_NAME, &K_SHAPE, &K_FIELD, &K_STREAM, &K_LENGTH, &K_DTYPE, &K_FILE, &K_OFFSET, &EMPTY,
                          &K_CODEC, &K_PARAMS, &K_CHUNKS, &K_WIDTH, &K_SIGN, &K_PAIRS, &K_TABLES, &K_TABLE_DATA, &S_ANS, &S_ANS_SHARED};
    for (int i = 0; i < 20; i++)
        if (!(*slots[i] = PyUnicode_InternFromString(names[i]))) return -1;
    if (!(K_STREAM_ATTR = PyUnicode_InternFromString("stream")) || !(K_TABLES_ATTR = PyUnicode_InternFromString("tables")) ||
        !(K_CHUNKS_ATTR = PyUnicode_InternFromString("chunks")) || !(K_RAW_LENGTH_ATTR = PyUnicode_InternFromString("raw_length")) ||
        !(K_SPEC_ATTR = PyUnicode_InternFromString("spec")))
        return -1;
    if (!(K_COLS = PyUnicode_InternFromString("cols")) || !(S_BYTES = PyUnicode_InternFromString("bytes")) ||
        !(S_TRANSPOSE = PyUnicode_InternFromString("transpose")))
        return -1;
    if (!(K_FILE_ATTR = PyUnicode_InternFromString("file")) || !(K_OFFSET_ATTR = PyUnicode_InternFromString("offset")) ||
        !(K_LENGTH_ATTR = PyUnicode_InternFromString("length")))
        return -1;
    if (!(K_MATCH_ARGS = PyUnicode_InternFromString("__match_args__")) || !(K_POST_INIT = PyUnicode_InternFromString("__post_init__")) ||
        !(K_DC_FIELDS = PyUnicode_InternFromString("__dataclass_fields__")) ||
        !(EMPTY_ARGS = PyTuple_New(0)))
        return -1;
    return 0;
}

static PyMethodDef methods[] = {
    {"merge", py_merge, METH_VARARGS, "merge(planes, width, sign_move, out): interleave planes into out"},
    {"unsplit", py_unsplit, METH_VARARGS, "unsplit(ranks, classes, sub, sizes, out) -> bool: plane from class sub-planes"},
    {"merge_list", py_merge_list, METH_VARARGS, "merge_list(planes, sign_move, out): interleave separate planes into out"},
    {"pairs_merge", py_pairs_merge, METH_VARARGS, "pairs_merge(table, ranks, escapes, rest, out) -> bool: fpairs chunk into out"},
    {"ans_decode", onnxz_py_ans_decode, METH_VARARGS, "ans_decode(planes, sign_move, pairs, out) -> None or str: an ans chunk into out; a str names the damage"},
    {"ans_decode_batch", onnxz_py_ans_decode_batch, METH_VARARGS, "ans_decode_batch(source, scratch, tasks[, hashing]) -> None (or the hashing cursor) or (i, code, message): many ans chunks read, checked (XXH3-64) and decoded, GIL released"},
    {"ans_decode_shared", onnxz_py_ans_decode_shared, METH_VARARGS, "ans_decode_shared(planes, tables, sign_move, out) -> None or str: an ans_shared chunk (blobs without their shared tables) into out"},
    {"set_xxh3", onnxz_py_set_xxh3, METH_VARARGS, "set_xxh3(address): the XXH3_64bits function ans_decode_batch checks chunks with"},
    {"xxh3", onnxz_py_xxh3, METH_VARARGS, "xxh3(data) -> int: XXH3-64 through the function set by set_xxh3"},
    {"set_xxh3_128", onnxz_py_set_xxh3_128, METH_VARARGS, "set_xxh3_128(create, free, reset, update, digest): xxhash's streaming XXH3-128 functions (addresses)"},
    {"xxh3_128_new", onnxz_py_xxh3_128_new, METH_NOARGS, "xxh3_128_new() -> state: a fresh streaming XXH3-128 (seed 0)"},
    {"xxh3_128_update", onnxz_py_xxh3_128_update, METH_VARARGS, "xxh3_128_update(state, data): feed bytes (GIL released)"},
    {"xxh3_128_hexdigest", onnxz_py_xxh3_128_hexdigest, METH_VARARGS, "xxh3_128_hexdigest(state) -> str: as xxhash.xxh3_128().hexdigest()"},
    {"ans_avx2_loads", onnxz_py_ans_avx2_loads, METH_VARARGS, "ans_avx2_loads([flag]) -> int: the AVX2 ans decoder's table lookups (1 scalar loads, 0 the gather instruction)"},
    {"ans_simd", onnxz_py_ans_simd, METH_VARARGS, "ans_simd([level]) -> int: the ans decoder in use (0 scalar, 1 AVX2, 2 AVX-512)"},
    {"index_rows", index_rows, METH_VARARGS, "index_rows(tensors, last_file, fields[, coded_only]) -> list of rows (coded_only: ([(index, row) of entries with a stream], [largest offset+length per file])) or str: the tensor entries of an .onnxz index checked (format.parse_index)"},
    {"stream_ans", stream_ans, METH_VARARGS, "stream_ans(obj, lo, hi, spans, resolved, chunk_cls, stream_cls, max_chunk, plane_hi) -> Stream or None: an ans / ans_shared stream of an .onnxz index checked and built as format._stream does; None: let _stream do it"},
    {"record", (PyCFunction)(void (*)(void))py_record, METH_FASTCALL, "record(cls, *values) -> cls(*values): one of format's record dataclasses, its fields set without running the generated __init__ (any other class: called)"},
    {"check_cuts", check_cuts, METH_VARARGS, "check_cuts(cuts, coded, file, size, last_tensor) -> (cuts as tuples, bytes cut) or None: a file entry's cuts checked as format.parse_index does; None: let it do them"},
    {"whole_file_plan", whole_file_plan, METH_VARARGS, "whole_file_plan(cuts, coded, window, size) -> (runs, others, batch): reader._whole_file_tasks's pass over a file's cuts (skeleton runs, chunks of other codecs, ans_decode_batch tasks with outs in window)"},
    {"copy_runs", py_copy_runs, METH_VARARGS, "copy_runs(dst, src, runs): dst[d:d+n] = src[s:s+n] for each (d, s, n) in runs (all checked first)"},
    {"expand", py_expand, METH_VARARGS, "expand(table, ranks, escapes, out) -> bool: exponents from 4-bit ranks"},
    {"untranspose1", py_untranspose1, METH_VARARGS, "untranspose1(plane, cols, out): codec transpose of width 1: out's rows of cols bytes from plane, which holds them column by column (GIL released)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", "Byte-plane split/merge (GIL released).", -1, methods};

PyMODINIT_FUNC PyInit__planes(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) { /* the fast paths assume little-endian words */
        PyErr_SetString(PyExc_ImportError, "_planes: big-endian host, using the numpy version");
        return NULL;
    }
    onnxz_ans_init();
    if (index_init() < 0) return NULL;
    return PyModule_Create(&module);
}
