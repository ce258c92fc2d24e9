/* DequantizeLinear of 8-bit levels into float32 or float16 in one pass (passes.runtime_dequantize).

   Why: a float16 model's quantized weights folded at load took numpy ~4 passes over float32
   temporaries plus its float32 -> float16 cast (~0.2 GB/s); onnxruntime's own constant folding of
   the same nodes costs ~60 ms of CPU per load of MiniLM. Here each value is read once, computed
   as passes.forms.dequantize_linear computes it and written once:

       y = ((float)q - (float)zero_point) * scale        (float32; exact subtraction for 8 bits)
       out = y                                           (float32 output)
       out = float16(y), rounded to nearest even         (float16 output: subnormals, inf kept)

   The subtraction and the product are separate float32 operations (never fused: -ffp-contract=off
   and no a*b+c pattern), so the bits equal numpy's. AVX-512 (F + BW + VL) or else AVX2 + F16C
   (vcvtps2ph rounds to nearest even) where the CPU has them, a portable scalar loop elsewhere;
   chosen at run time.

   Layout (the caller flattens the levels to [pre, d, post] around the quantization axis):
     per tensor  scale[0]
     per axis    scale[j]                              (j: index along the axis, d of them)
     blocked     scale[(i * nb + j / block) * post + k] (nb = ceil(d / block))
   zero_point, when given, has the scale's layout (as float32). The GIL is released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FOLD_X86 1
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ portable scalar path */

/* float32 -> float16 bit pattern, round to nearest even (IEEE 754: subnormal halves, overflow to
   infinity, NaN stays NaN and quiet) */
static inline uint16_t half_bits(float value)
{
    uint32_t x;
    memcpy(&x, &value, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) /* inf, NaN */
        return (uint16_t)(sign | (a == 0x7F800000u ? 0x7C00u : 0x7E00u | ((a >> 13) & 0x3FFu)));
    if (a >= 0x477FF000u) /* from halfway between 65504 and 65536 up: infinity */
        return (uint16_t)(sign | 0x7C00u);
    if (a >= 0x38800000u) { /* a normal half: rebias the exponent (127 -> 15), round 13 bits off */
        uint32_t r = a - 0x38000000u;
        r += 0xFFFu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) /* at most 2^-25 (half the smallest subnormal): zero (a tie goes to even) */
        return (uint16_t)sign;
    /* subnormal half: the value in units of 2^-24 is mantissa * 2^(exponent - 126) */
    uint32_t exponent = a >> 23;
    uint32_t mantissa = (a & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - exponent; /* 14..24 */
    uint32_t h = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u)))
        h += 1u; /* (may carry into the smallest normal: its bits are right too) */
    return (uint16_t)(sign | h);
}

#define LEVEL(q, u8, i) ((u8) ? (float)((const uint8_t *)(q))[i] : (float)((const int8_t *)(q))[i])

/* n values from q with one scale and zero point */
static void run_same_scalar(const void *q, int u8, Py_ssize_t n, float s, float z, void *out, int f16)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        float y = (LEVEL(q, u8, i) - z) * s;
        if (f16)
            ((uint16_t *)out)[i] = half_bits(y);
        else
            ((float *)out)[i] = y;
    }
}

/* n values from q, value i with scale s[i] and zero point z[i] (z may be NULL: 0) */
static void run_each_scalar(const void *q, int u8, Py_ssize_t n, const float *s, const float *z, void *out, int f16)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        float y = (LEVEL(q, u8, i) - (z ? z[i] : 0.0f)) * s[i];
        if (f16)
            ((uint16_t *)out)[i] = half_bits(y);
        else
            ((float *)out)[i] = y;
    }
}

/* ------------------------------------------------------------------ AVX-512 path */

#ifdef FOLD_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512 static inline __m512 levels16(const void *q, int u8, Py_ssize_t i, __mmask16 m)
{
    __m128i b = _mm_maskz_loadu_epi8(m, (const char *)q + i);
    return _mm512_cvtepi32_ps(u8 ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
}

AVX512 static inline void store16(void *out, int f16, Py_ssize_t i, __mmask16 m, __m512 y)
{
    if (f16)
        _mm256_mask_storeu_epi16((uint16_t *)out + i, m,
                                 _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm512_mask_storeu_ps((float *)out + i, m, y);
}

static inline __mmask16 tail_mask(Py_ssize_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

AVX512 static void run_same_avx512(const void *q, int u8, Py_ssize_t n, float s, float z, void *out, int f16)
{
    __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) { /* two vectors per step: the loads and converts overlap */
        __m512 a = _mm512_mul_ps(_mm512_sub_ps(levels16(q, u8, i, 0xFFFF), vz), vs);
        __m512 b = _mm512_mul_ps(_mm512_sub_ps(levels16(q, u8, i + 16, 0xFFFF), vz), vs);
        store16(out, f16, i, 0xFFFF, a);
        store16(out, f16, i + 16, 0xFFFF, b);
    }
    for (; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        store16(out, f16, i, m, _mm512_mul_ps(_mm512_sub_ps(levels16(q, u8, i, m), vz), vs));
    }
}

AVX512 static void run_each_avx512(const void *q, int u8, Py_ssize_t n, const float *s, const float *z, void *out,
                                   int f16)
{
    for (Py_ssize_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 y = levels16(q, u8, i, m);
        if (z)
            y = _mm512_sub_ps(y, _mm512_maskz_loadu_ps(m, z + i));
        store16(out, f16, i, m, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, s + i)));
    }
}

/* AVX2 + F16C (most x86-64 CPUs without AVX-512): 8 values per step, the tail by the scalar loop
   (whose rounding equals vcvtps2ph's) */
#define AVX2 __attribute__((target("avx2,f16c")))

AVX2 static inline __m256 levels8(const void *q, int u8, Py_ssize_t i)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)((const char *)q + i));
    return _mm256_cvtepi32_ps(u8 ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
}

AVX2 static inline void store8(void *out, int f16, Py_ssize_t i, __m256 y)
{
    if (f16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                         _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm256_storeu_ps((float *)out + i, y);
}

static inline void *out_at(void *out, int f16, Py_ssize_t i)
{
    return f16 ? (void *)((uint16_t *)out + i) : (void *)((float *)out + i);
}

AVX2 static void run_same_avx2(const void *q, int u8, Py_ssize_t n, float s, float z, void *out, int f16)
{
    __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        store8(out, f16, i, _mm256_mul_ps(_mm256_sub_ps(levels8(q, u8, i), vz), vs));
    run_same_scalar((const char *)q + i, u8, n - i, s, z, out_at(out, f16, i), f16);
}

AVX2 static void run_each_avx2(const void *q, int u8, Py_ssize_t n, const float *s, const float *z, void *out,
                               int f16)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 y = levels8(q, u8, i);
        if (z)
            y = _mm256_sub_ps(y, _mm256_loadu_ps(z + i));
        store8(out, f16, i, _mm256_mul_ps(y, _mm256_loadu_ps(s + i)));
    }
    run_each_scalar((const char *)q + i, u8, n - i, s + i, z ? z + i : NULL, out_at(out, f16, i), f16);
}
#endif

/* ------------------------------------------------------------------ dispatch */

typedef void (*run_same_fn)(const void *, int, Py_ssize_t, float, float, void *, int);
typedef void (*run_each_fn)(const void *, int, Py_ssize_t, const float *, const float *, void *, int);

/* the loops: 1 scalar, 2 AVX2 + F16C, 3 AVX-512; `best` the fastest this CPU runs */
enum { LOOP_BEST = 0, LOOP_SCALAR = 1, LOOP_AVX2 = 2, LOOP_AVX512 = 3 };
static const char *loop_names[] = {"best", "scalar", "avx2", "avx512"};
static int loop_present[4] = {1, 1, 0, 0};
static int best = LOOP_SCALAR;

static void find_loops(void)
{
#ifdef FOLD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        loop_present[LOOP_AVX2] = 1, best = LOOP_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        loop_present[LOOP_AVX512] = 1, best = LOOP_AVX512;
#endif
}

static void loop_functions(int loop, run_same_fn *same, run_each_fn *each)
{
    *same = run_same_scalar, *each = run_each_scalar;
#ifdef FOLD_X86
    if (loop == LOOP_AVX2)
        *same = run_same_avx2, *each = run_each_avx2;
    else if (loop == LOOP_AVX512)
        *same = run_same_avx512, *each = run_each_avx512;
#endif
}

typedef struct {
    const char *q;
    int u8, f16;
    Py_ssize_t pre, d, post, block;
    const float *s, *z;
    Py_ssize_t scales;
    char *out;
} Job;

static void dequantize_job(const Job *job, run_same_fn same, run_each_fn each)
{
    Py_ssize_t pre = job->pre, d = job->d, post = job->post, block = job->block;
    size_t osize = job->f16 ? 2 : 4;
    const float *s = job->s, *z = job->z;
    if (job->scales == 1) { /* per tensor */
        same(job->q, job->u8, pre * d * post, s[0], z ? z[0] : 0.0f, job->out, job->f16);
        return;
    }
    Py_ssize_t nb = block ? (d + block - 1) / block : 0;
    for (Py_ssize_t i = 0; i < pre; i++) {
        Py_ssize_t row = i * d * post;
        if (!block && post == 1) { /* per axis, the last axis: a scale per value of the row */
            each(job->q + row, job->u8, d, s, z, job->out + row * osize, job->f16);
        } else if (!block) { /* per axis: one scale over each run of `post` values */
            for (Py_ssize_t j = 0; j < d; j++)
                same(job->q + row + j * post, job->u8, post, s[j], z ? z[j] : 0.0f,
                     job->out + (row + j * post) * osize, job->f16);
        } else if (post == 1) { /* blocks along the last axis: one scale over each block */
            for (Py_ssize_t b = 0; b < nb; b++) {
                Py_ssize_t start = b * block, n = d - start < block ? d - start : block;
                same(job->q + row + start, job->u8, n, s[i * nb + b], z ? z[i * nb + b] : 0.0f,
                     job->out + (row + start) * osize, job->f16);
            }
        } else { /* blocks along an inner axis: the scales of a block's row vary along `post` */
            for (Py_ssize_t j = 0; j < d; j++) {
                Py_ssize_t at = (i * nb + j / block) * post;
                each(job->q + row + j * post, job->u8, post, s + at, z ? z + at : NULL,
                     job->out + (row + j * post) * osize, job->f16);
            }
        }
    }
}

/* dequantize(levels, scale, zero_point, out, pre, d, post, block, loop=0): see the top.
   levels: C-contiguous int8/uint8 (pre*d*post); scale, zero_point (or None): C-contiguous float32
   in the layout above; out: C-contiguous writable float32 or float16 of pre*d*post values (its
   format given by the buffer: "f" or "e"). loop: 0 the fastest here, 1 scalar, 2 AVX2, 3 AVX-512
   (tests; one this CPU lacks is refused). */
static PyObject *py_dequantize(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *oq, *os, *oz, *oo;
    Py_ssize_t pre, d, post, block;
    int loop = LOOP_BEST;
    if (!PyArg_ParseTuple(args, "OOOOnnnn|i", &oq, &os, &oz, &oo, &pre, &d, &post, &block, &loop))
        return NULL;
    if (loop < 0 || loop > LOOP_AVX512 || !loop_present[loop]) {
        PyErr_Format(PyExc_ValueError, "loop %d is not available on this CPU", loop);
        return NULL;
    }
    if (loop == LOOP_BEST)
        loop = best;
    if (pre < 0 || d < 0 || post < 0 || block < 0) {
        PyErr_SetString(PyExc_ValueError, "negative dimension or block");
        return NULL;
    }
    Py_buffer bq = {0}, bs = {0}, bz = {0}, bo = {0};
    PyObject *result = NULL;
    int have_z = oz != Py_None;
    if (PyObject_GetBuffer(oq, &bq, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (PyObject_GetBuffer(os, &bs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (have_z && PyObject_GetBuffer(oz, &bz, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (PyObject_GetBuffer(oo, &bo, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        goto done;
    const char *qf = bq.format ? bq.format : "B", *of = bo.format ? bo.format : "B";
    int u8;
    if (strcmp(qf, "b") == 0)
        u8 = 0;
    else if (strcmp(qf, "B") == 0)
        u8 = 1;
    else {
        PyErr_Format(PyExc_TypeError, "levels must be int8 or uint8, got format %s", qf);
        goto done;
    }
    int f16;
    if (strcmp(of, "e") == 0 && bo.itemsize == 2)
        f16 = 1;
    else if (strcmp(of, "f") == 0 && bo.itemsize == 4)
        f16 = 0;
    else {
        PyErr_Format(PyExc_TypeError, "out must be float32 or float16, got format %s", of);
        goto done;
    }
    if (!bs.format || strcmp(bs.format, "f") != 0 || (have_z && (!bz.format || strcmp(bz.format, "f") != 0))) {
        PyErr_SetString(PyExc_TypeError, "scale and zero point must be float32");
        goto done;
    }
    Py_ssize_t count = pre * d * post; /* (each factor fits the levels' buffer below) */
    if ((pre && d && (count / pre / d != post)) || bq.len != count || bo.len != count * bo.itemsize) {
        PyErr_SetString(PyExc_ValueError, "levels and out must hold pre * d * post values");
        goto done;
    }
    Py_ssize_t scales = bs.len / 4;
    Py_ssize_t nb = block ? (d + block - 1) / block : 0;
    Py_ssize_t want = scales == 1 ? 1 : block ? pre * nb * post : d;
    if (count && (scales != want || (have_z && bz.len != bs.len))) {
        PyErr_Format(PyExc_ValueError, "scale has %zd values, the layout needs %zd (zero point: the same)", scales,
                     want);
        goto done;
    }
    Job job = {bq.buf, u8, f16, pre, d, post, block, bs.buf, have_z ? bz.buf : NULL, scales, bo.buf};
    if (count) {
        run_same_fn same;
        run_each_fn each;
        loop_functions(loop, &same, &each);
        Py_BEGIN_ALLOW_THREADS
        dequantize_job(&job, same, each);
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (bq.obj)
        PyBuffer_Release(&bq);
    if (bs.obj)
        PyBuffer_Release(&bs);
    if (bz.obj)
        PyBuffer_Release(&bz);
    if (bo.obj)
        PyBuffer_Release(&bo);
    return result;
}

static PyMethodDef methods[] = {
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(levels, scale, zero_point, out, pre, d, post, block, loop=0): DequantizeLinear of "
     "8-bit levels into float32/float16 `out` (see passes/_fold.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fold", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fold(void)
{
    find_loops();
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    /* KERNEL: the loop used by default; LOOPS: name -> number of each loop this CPU runs */
    PyObject *loops = PyDict_New();
    int failed = !loops || PyModule_AddStringConstant(m, "KERNEL", loop_names[best]) < 0;
    for (int k = LOOP_SCALAR; !failed && k <= LOOP_AVX512; k++) {
        if (!loop_present[k])
            continue;
        PyObject *number = PyLong_FromLong(k);
        failed = !number || PyDict_SetItemString(loops, loop_names[k], number) < 0;
        Py_XDECREF(number);
    }
    if (failed || PyModule_AddObject(m, "LOOPS", loops) < 0) {
        Py_XDECREF(loops);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
