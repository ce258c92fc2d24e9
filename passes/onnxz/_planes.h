/* Shared between the C files of module passes.onnxz._planes. */
#ifndef ONNXZ_PLANES_H
#define ONNXZ_PLANES_H
#include <Python.h>
#include <stdint.h>

/* x86: AVX2 / AVX-512 paths chosen at run time; elsewhere the portable loops only (same bytes) */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(ONNXZ_PORTABLE)
#define ONNXZ_X86 1
#include <immintrin.h>
#else
#define ONNXZ_X86 0
#endif

/* interleave w planes of n bytes (pointers p[0..w-1], most significant first) into dst */
void onnxz_merge_ptrs(const uint8_t *const *p, Py_ssize_t n, int w, int sign_move, uint8_t *restrict dst);
/* the same; nt: non-temporal stores where the CPU and the alignment allow (large outputs) */
void onnxz_merge_ptrs_nt(const uint8_t *const *p, Py_ssize_t n, int w, int sign_move, uint8_t *restrict dst, int nt);

#if ONNXZ_X86
/* 32 elements of a float chunk into dst (32*w bytes; w 2 or 4): t holds their top bytes (plane 0),
 * p1..p3 point at their bytes in planes 1..w-1 (p2, p3 unused for w 2); sign_move as in the merge.
 * nt: non-temporal stores (dst 32-byte aligned). The body of the AVX2 plane merge, shared with the
 * ans decoder, which merges straight from the registers it decoded plane 0 into. */
#define ONNXZ_STORE32(ptr, v) do { if (nt) _mm256_stream_si256((__m256i *)(ptr), (v)); else _mm256_storeu_si256((__m256i *)(ptr), (v)); } while (0)
__attribute__((target("avx2"))) static inline __attribute__((always_inline))
void onnxz_merge32_avx2(__m256i t, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3, int w, int sign_move,
                        uint8_t *dst, int nt) {
    const __m256i lo7 = _mm256_set1_epi8(0x7F), hi1 = _mm256_set1_epi8((char)0x80);
    __m256i m = _mm256_loadu_si256((const __m256i *)p1);
    __m256i hi = t, nx = m;
    if (sign_move) {
        hi = _mm256_or_si256(_mm256_and_si256(m, hi1), _mm256_and_si256(_mm256_srli_epi16(t, 1), lo7));
        nx = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(t, 7), hi1), _mm256_and_si256(m, lo7));
    }
    if (w == 2) {
        __m256i a = _mm256_unpacklo_epi8(nx, hi), b = _mm256_unpackhi_epi8(nx, hi);
        ONNXZ_STORE32(dst, _mm256_permute2x128_si256(a, b, 0x20));
        ONNXZ_STORE32(dst + 32, _mm256_permute2x128_si256(a, b, 0x31));
        return;
    }
    __m256i c = _mm256_loadu_si256((const __m256i *)p2), d = _mm256_loadu_si256((const __m256i *)p3);
    __m256i la = _mm256_unpacklo_epi8(d, c), ha = _mm256_unpacklo_epi8(nx, hi);
    __m256i lb = _mm256_unpackhi_epi8(d, c), hb = _mm256_unpackhi_epi8(nx, hi);
    __m256i e0 = _mm256_unpacklo_epi16(la, ha), e1 = _mm256_unpackhi_epi16(la, ha);
    __m256i e2 = _mm256_unpacklo_epi16(lb, hb), e3 = _mm256_unpackhi_epi16(lb, hb);
    ONNXZ_STORE32(dst, _mm256_permute2x128_si256(e0, e1, 0x20));
    ONNXZ_STORE32(dst + 32, _mm256_permute2x128_si256(e2, e3, 0x20));
    ONNXZ_STORE32(dst + 64, _mm256_permute2x128_si256(e0, e1, 0x31));
    ONNXZ_STORE32(dst + 96, _mm256_permute2x128_si256(e2, e3, 0x31));
}
#undef ONNXZ_STORE32
#endif

void onnxz_ans_init(void);
int onnxz_ans_simd_level(void); /* 0 scalar, 1 AVX2, 2 AVX-512 */
PyObject *onnxz_py_ans_decode(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_simd(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_avx2_loads(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_decode_batch(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_decode_shared(PyObject *self, PyObject *args);
PyObject *onnxz_py_set_xxh3(PyObject *self, PyObject *args);
PyObject *onnxz_py_xxh3(PyObject *self, PyObject *args);
PyObject *onnxz_py_set_xxh3_128(PyObject *self, PyObject *args);
PyObject *onnxz_py_xxh3_128_new(PyObject *self, PyObject *args);
PyObject *onnxz_py_xxh3_128_update(PyObject *self, PyObject *args);
PyObject *onnxz_py_xxh3_128_hexdigest(PyObject *self, PyObject *args);
#endif
