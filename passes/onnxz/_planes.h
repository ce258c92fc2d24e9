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

void onnxz_ans_init(void);
int onnxz_ans_simd_level(void); /* 0 scalar, 1 AVX2, 2 AVX-512 */
PyObject *onnxz_py_ans_decode(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_simd(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_avx2_loads(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_decode_batch(PyObject *self, PyObject *args);
PyObject *onnxz_py_ans_decode_shared(PyObject *self, PyObject *args);
PyObject *onnxz_py_set_xxh3(PyObject *self, PyObject *args);
PyObject *onnxz_py_xxh3(PyObject *self, PyObject *args);
#endif
