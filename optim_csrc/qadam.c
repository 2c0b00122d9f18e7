/* Host Adam kernels: Adam(W) over compressed moments (decode, step and re-encode one block at a time,
 * in one pass), and the fused fp32 step (see [Note: the fused fp32 step] below).
 *
 * No Python objects beyond the arguments, no torch: the caller passes raw addresses of the fp32
 * master, of the gradient (fp32, or bf16 words widened in registers) and of the moments' stored
 * bytes, and the element range [lo, hi) of one sub-group to update; optionally where the stepped
 * elements' bf16 compute copies go, written while the block is in cache (one pass over memory where
 * a widening, the step and a conversion made three). The GIL is released while the blocks are
 * stepped, on `threads` threads.
 *
 * Formats (the Python side, infinity/optim/moments.py, documents them and has a torch twin):
 *   bf16: m and v as bfloat16, rounded stochastically with a counter-based hash of
 *         (seed, element index), so a re-run gives the same bits.
 *   int8: per block of `block` elements, one byte per element and one fp32 scale per state.
 *         m: sign bit + a 7-bit float-like magnitude (3 exponent bits, 4 mantissa bits, bias 7,
 *            subnormals), of |m| * 1.9375 / absmax(m).
 *         v: kept as w = sqrt(v): an 8-bit float-like code (4 exponent bits, 4 mantissa bits,
 *            bias 15, subnormals) of w * 1.9375 / max(w); a positive w never rounds to 0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#define MODE_BF16 1
#define MODE_INT8 2
#define MODE_FP32 3     /* fp32 moments, torch's fused arithmetic: see step_fp32 */
#define MAX_BLOCK 2048
#define MAX_THREADS 256
#define CODE_TOP 1.9375f

/* Elements [start, end) of a sub-group whose new bf16 copies go to out (element start at out[0]). */
typedef struct { int64_t start, end; uint16_t *out; } Seg;

typedef struct {
    int mode, decoupled;
    int64_t n, lo, hi, block;
    float *p; const float *g;
    uint8_t *m, *v;       /* codes (int8) or bf16 values */
    float *ms, *vs;       /* int8: per-block scales */
    float lr, b1, b2, eps, wd, gmul, step_size, inv_bc2_sqrt;
    uint32_t seed;
    int64_t first_block, last_block;  /* [first, last) this worker steps */
    /* The gradient as bf16 words (g16, else g). MODE_FP32: the bf16 copy of the new weights (out16, or
     * none), the constants as torch's fused kernel rounds them from double (T). Compressed modes: the
     * bf16 copies of the stepped elements, into nsegs sorted, disjoint segments (segs). */
    const uint16_t *g16;
    uint16_t *out16;
    const Seg *segs;
    int nsegs;
    struct { float b1c, b2, b2c, eps, decay, wd, step_size, bc2_sqrt, scale; int has_scale; } T;
} Job;

static inline __attribute__((always_inline)) float as_float(int32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline __attribute__((always_inline)) int32_t as_int(float f) { int32_t u; memcpy(&u, &f, 4); return u; }

static inline __attribute__((always_inline)) uint32_t mix(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return h;
}

/* bf16 with stochastic rounding: add 16 random bits below the kept ones, then truncate. */
static inline __attribute__((always_inline)) uint32_t bf16_sr(float x, uint32_t seed, uint32_t index) {
    uint32_t r = mix((index * 0x9E3779B1u) ^ seed) & 0xFFFFu;
    return ((uint32_t)as_int(x) + r) >> 16;
}

/* Float-like code of u in [0, CODE_TOP]: `mbits` mantissa bits, exponent bias `bias`, subnormals.
 * int32 throughout: what AVX2 converts and shifts in vectors. */
static inline __attribute__((always_inline)) int32_t encode_mag(float u, int mbits, int bias, int32_t top) {
    float threshold = as_float((127 + 1 - bias) << 23);
    float sub_mul = as_float((127 + bias - 1 + mbits) << 23);
    int32_t sub = (int32_t)(u * sub_mul + 0.5f);
    int32_t normal = ((as_int(u) + (1 << (22 - mbits))) >> (23 - mbits)) - ((127 - bias) << mbits);
    int32_t c = u < threshold ? sub : normal;
    return c > top ? top : c;
}

static inline __attribute__((always_inline)) float decode_mag(int32_t c, int mbits, int bias) {
    float sub_mul = as_float((127 + 1 - bias - mbits) << 23);
    float normal = as_float((c + ((127 - bias) << mbits)) << (23 - mbits));
    return c < (1 << mbits) ? (float)c * sub_mul : normal;
}

/* The scalars of one call, copied out of the Job so that stores through the arrays cannot alias them. */
typedef struct { float lr, b1, b2, eps, wd, gmul, step_size, inv_bc2_sqrt, decay; int decoupled; } Hyper;

static inline __attribute__((always_inline)) Hyper hyper_of(const Job *j) {
    Hyper h = {j->lr, j->b1, j->b2, j->eps, j->wd, j->gmul, j->step_size, j->inv_bc2_sqrt,
               1.0f - j->lr * j->wd, j->decoupled};
    return h;
}

/* Adam on elements [0, len) of the given arrays; w receives sqrt of the new v. */
static inline __attribute__((always_inline)) void adam_span(Hyper h, int64_t len, float *restrict p, const float *restrict g, float *restrict m,
                             float *restrict v, float *restrict w) {
    float c1 = 1.0f - h.b1, c2 = 1.0f - h.b2;
    if (h.decoupled) {
        for (int64_t i = 0; i < len; i++) {
            float gi = g[i] * h.gmul, pi = p[i] * h.decay;
            float mi = h.b1 * m[i] + c1 * gi;
            float vi = h.b2 * v[i] + c2 * gi * gi;
            float wi = sqrtf(vi);
            p[i] = pi - h.step_size * mi / (wi * h.inv_bc2_sqrt + h.eps);
            m[i] = mi; v[i] = vi; w[i] = wi;
        }
    } else {
        for (int64_t i = 0; i < len; i++) {
            float pi = p[i], gi = g[i] * h.gmul + h.wd * p[i];
            float mi = h.b1 * m[i] + c1 * gi;
            float vi = h.b2 * v[i] + c2 * gi * gi;
            float wi = sqrtf(vi);
            p[i] = pi - h.step_size * mi / (wi * h.inv_bc2_sqrt + h.eps);
            m[i] = mi; v[i] = vi; w[i] = wi;
        }
    }
}

#define CHUNK 1024

/* [Note: one kernel per instruction set] The loops are compiled three times: for AVX-512 with
 * 512-bit vectors (gcc prefers 256-bit ones unless told; on the Xeon here 512 makes the int8
 * step 1.3x faster), for AVX2, and for any x86-64; the first the CPU supports runs. */
#if defined(__x86_64__) && defined(__GNUC__)
#define KERNEL(name) name##_avx512
#define KERNEL_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")))
#include "kernels.h"
#undef KERNEL
#undef KERNEL_ATTR
#define KERNEL(name) name##_avx2
#define KERNEL_ATTR __attribute__((target("avx2,fma")))
#include "kernels.h"
#undef KERNEL
#undef KERNEL_ATTR
#endif
#define KERNEL(name) name##_base
#define KERNEL_ATTR
#include "kernels.h"
#undef KERNEL
#undef KERNEL_ATTR

#if defined(__x86_64__) && defined(__GNUC__)
/* [Note: the int8 block in AVX2]
 * With 256-bit vectors the int8 step is compute-bound (on the Zen 3 here, taking the division out of
 * it, as an experiment, cut its time by 40%), and gcc's five loops a block (widen the codes, decode,
 * Adam, encode, narrow) each store their result for the next to load: 5-25% of its time. This one does
 * the same arithmetic, operation for operation and in the same order (no fused multiply-adds:
 * the same bits as int8_block_*, tests/unit/test_compressed_copies.py compares them), in two
 * loops over 8 elements at a time: decode + Adam + the block's largest magnitudes, then encode +
 * narrow. Full blocks only, whose length is a multiple of 8; the others go to int8_block_avx2. */
#define V8(x) _mm256_set1_ps(x)
__attribute__((target("avx2,fma"))) static inline __m256 decode_mag_v(__m256i c, int mbits, int bias) {
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_castsi256_ps(_mm256_set1_epi32((127 + 1 - bias - mbits) << 23)));
    __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32((127 - bias) << mbits)),
                                                          23 - mbits));
    __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << mbits), c);
    return _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
}

__attribute__((target("avx2,fma"))) static inline __m256i encode_mag_v(__m256 u, int mbits, int bias, int32_t top) {
    __m256 threshold = _mm256_castsi256_ps(_mm256_set1_epi32((127 + 1 - bias) << 23));
    __m256 sub_mul = _mm256_castsi256_ps(_mm256_set1_epi32((127 + bias - 1 + mbits) << 23));
    __m256i sub = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(u, sub_mul), V8(0.5f)));
    __m256i normal = _mm256_sub_epi32(_mm256_srai_epi32(_mm256_add_epi32(_mm256_castps_si256(u),
                                                                          _mm256_set1_epi32(1 << (22 - mbits))),
                                                         23 - mbits),
                                      _mm256_set1_epi32((127 - bias) << mbits));
    __m256i c = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub),
                                                     _mm256_cmp_ps(u, threshold, _CMP_LT_OQ)));
    return _mm256_min_epi32(c, _mm256_set1_epi32(top));
}

/* g16 and decoupled are constants where run_int8_fast_avx2 calls it: one loop without branches each. */
__attribute__((target("avx2,fma"), always_inline)) static inline void int8_block_fast_avx2(
        const Job *j, Hyper h, int64_t k, int *cur, Scratch_avx2 *sc, const int g16, const int decoupled) {
    const int64_t b0 = k * j->block, len = j->block;
    float *restrict fm = sc->fm, *restrict fw = sc->fw;
    uint8_t *restrict mc = j->m + b0, *restrict vc = j->v + b0;
    float *restrict p = j->p + b0;
    const float inv_top = 1.0f / CODE_TOP;
    const __m256 dm = V8(j->ms[k] * inv_top), dw = V8(j->vs[k] * inv_top);
    const __m256 b1 = V8(h.b1), b2 = V8(h.b2), c1 = V8(1.0f - h.b1), c2 = V8(1.0f - h.b2), gmul = V8(h.gmul);
    const __m256 decay = V8(h.decay), wd = V8(h.wd), step_size = V8(h.step_size), inv = V8(h.inv_bc2_sqrt);
    const __m256 eps = V8(h.eps);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), low7 = _mm256_set1_epi32(0x7F);
    __m256i im = _mm256_setzero_si256(), iw = _mm256_setzero_si256();
    for (int64_t t = 0; t < len; t += 8) {
        __m256i cmv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mc + t)));
        __m256i cvv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vc + t)));
        __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_andnot_si256(low7, cmv), 24));
        __m256 m = _mm256_mul_ps(_mm256_or_ps(decode_mag_v(_mm256_and_si256(cmv, low7), 4, 7), sign), dm);
        __m256 wo = _mm256_mul_ps(decode_mag_v(cvv, 4, 15), dw);
        __m256 g;
        if (g16)
            g = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(j->g16 + b0 + t))), 16));
        else
            g = _mm256_loadu_ps(j->g + b0 + t);
        __m256 pv = _mm256_loadu_ps(p + t), gi, pi;
        if (decoupled) {
            gi = _mm256_mul_ps(g, gmul);
            pi = _mm256_mul_ps(pv, decay);
        } else {
            pi = pv;
            gi = _mm256_add_ps(_mm256_mul_ps(g, gmul), _mm256_mul_ps(wd, pv));
        }
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, m), _mm256_mul_ps(c1, gi));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_mul_ps(wo, wo)), _mm256_mul_ps(_mm256_mul_ps(c2, gi), gi));
        __m256 wi = _mm256_sqrt_ps(vi);
        __m256 den = _mm256_add_ps(_mm256_mul_ps(wi, inv), eps);
        _mm256_storeu_ps(p + t, _mm256_sub_ps(pi, _mm256_div_ps(_mm256_mul_ps(step_size, mi), den)));
        _mm256_store_ps(fm + t, mi);
        _mm256_store_ps(fw + t, wi);
        im = _mm256_max_epi32(im, _mm256_and_si256(_mm256_castps_si256(mi), abs_mask));
        iw = _mm256_max_epi32(iw, _mm256_castps_si256(wi));
    }
    if (j->nsegs) write_copies_avx2(j, b0, b0 + len, cur);
    int32_t lm[8], lw[8], am_i = 0, aw_i = 0;
    _mm256_storeu_si256((__m256i *)lm, im);
    _mm256_storeu_si256((__m256i *)lw, iw);
    for (int t = 0; t < 8; t++) {
        am_i = lm[t] > am_i ? lm[t] : am_i;
        aw_i = lw[t] > aw_i ? lw[t] : aw_i;
    }
    float am = as_float(am_i), aw = as_float(aw_i);
    const __m256 qm = V8(am > 0.0f ? CODE_TOP / am : 0.0f), qw = V8(aw > 0.0f ? CODE_TOP / aw : 0.0f);
    const __m256i bit7 = _mm256_set1_epi32(0x80), zero = _mm256_setzero_si256(), low8 = _mm256_set1_epi32(0xFF);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t t = 0; t < len; t += 8) {
        __m256 x = _mm256_load_ps(fm + t), w = _mm256_load_ps(fw + t);
        __m256i c = encode_mag_v(_mm256_mul_ps(_mm256_and_ps(x, _mm256_castsi256_ps(abs_mask)), qm), 4, 7, 0x7F);
        /* masks are all ones: the sign bit is 0x80 & (x < 0 and c != 0); w's code + 1 is code - (-1) */
        __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
        __m256i cmo = _mm256_or_si256(c, _mm256_and_si256(_mm256_andnot_si256(_mm256_cmpeq_epi32(c, zero), neg), bit7));
        __m256i cw = encode_mag_v(_mm256_mul_ps(w, qw), 4, 15, 0xFF);
        __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_GT_OQ));
        __m256i cvo = _mm256_sub_epi32(cw, _mm256_and_si256(_mm256_cmpeq_epi32(cw, zero), pos));
        /* 16-bit per 128-bit lane: [m0-3 v0-3 | m4-7 v4-7]; bytes: dword 0 m, dword 1 v of each lane */
        __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(_mm256_and_si256(cmo, low8), _mm256_and_si256(cvo, low8)),
                                        zero);   /* the low byte, as the (uint8_t) cast keeps it */
        b = _mm256_permutevar8x32_epi32(b, order);     /* m0-3 m4-7 v0-3 v4-7 ... */
        __m128i lo = _mm256_castsi256_si128(b);
        _mm_storel_epi64((__m128i *)(mc + t), lo);
        _mm_storel_epi64((__m128i *)(vc + t), _mm_unpackhi_epi64(lo, lo));
    }
    j->ms[k] = am;
    j->vs[k] = aw;
}

__attribute__((target("avx2,fma"))) static void run_int8_fast_avx2(const Job *j) {
    Hyper h = hyper_of(j);
    Scratch_avx2 sc __attribute__((aligned(32)));
    int cur = 0;
    for (int64_t k = j->first_block; k < j->last_block; k++) {
        int64_t b0 = k * j->block;
        if (!(j->block % 8 == 0 && b0 >= j->lo && b0 + j->block <= j->hi && b0 + j->block <= j->n))
            int8_block_avx2(j, h, k, &cur, &sc);
        else if (j->g16 != NULL && h.decoupled)
            int8_block_fast_avx2(j, h, k, &cur, &sc, 1, 1);
        else if (j->g16 != NULL)
            int8_block_fast_avx2(j, h, k, &cur, &sc, 1, 0);
        else if (h.decoupled)
            int8_block_fast_avx2(j, h, k, &cur, &sc, 0, 1);
        else
            int8_block_fast_avx2(j, h, k, &cur, &sc, 0, 0);
    }
}
#undef V8
#endif

/* Which compiled variant runs (see [Note: one kernel per instruction set]): the best the CPU
 * supports unless a test chose one with isa(). */
enum { ISA_AUTO, ISA_AVX512, ISA_AVX2, ISA_BASE };
static int isa_choice = ISA_AUTO;

static int isa_supported(int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return isa == ISA_BASE;
}

static int isa_in_use(void) {
    if (isa_choice != ISA_AUTO) return isa_choice;
    return isa_supported(ISA_AVX512) ? ISA_AVX512 : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_BASE;
}

static void run(const Job *j) {
    switch (isa_in_use()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case ISA_AVX512:
        if (j->mode == MODE_FP32) run_fp32_avx512(j); else if (j->mode == MODE_INT8) run_int8_avx512(j);
        else run_bf16_avx512(j);
        return;
    case ISA_AVX2:
        if (j->mode == MODE_FP32) run_fp32_avx2(j); else if (j->mode == MODE_INT8) run_int8_fast_avx2(j);
        else run_bf16_avx2(j);
        return;
#endif
    default:
        if (j->mode == MODE_FP32) run_fp32_base(j); else if (j->mode == MODE_INT8) run_int8_base(j);
        else run_bf16_base(j);
    }
}

static void *worker(void *arg) {
    run((const Job *)arg);
    return NULL;
}

/* Steps base's [lo, hi) in blocks of base->block elements on up to `threads` threads, the GIL released. */
static void run_threaded(const Job *base, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t first = base->lo / base->block, last = (base->hi + base->block - 1) / base->block, nblocks = last - first;
    /* At least 64 blocks of work per thread, or the thread costs more than it saves. */
    int64_t most = nblocks / 64 > 0 ? nblocks / 64 : 1;
    if (threads > most) threads = (int)most;
    Job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started = 0, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        jobs[t] = *base;
        jobs[t].first_block = first + nblocks * t / threads;
        jobs[t].last_block = first + nblocks * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, worker, &jobs[t]) != 0) { failed = 1; break; }
        started = t;
    }
    worker(&jobs[0]);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    if (failed)  /* the blocks of threads that did not start, on this one */
        for (int t = started + 1; t < threads; t++) worker(&jobs[t]);
    Py_END_ALLOW_THREADS
}

/* outs: a sequence of (start, end, address) with lo <= start < end <= hi, sorted and disjoint, into
 * a new array of *count segments (NULL with *count 0 for none; NULL with an exception set on error). */
static Seg *parse_segments(PyObject *outs, long long lo, long long hi, int *count) {
    *count = 0;
    if (outs == NULL || outs == Py_None) return NULL;
    PyObject *seq = PySequence_Fast(outs, "qadam.step: outs must be a sequence of (start, end, address)");
    if (seq == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k == 0 || k > 1 << 20) {
        if (k != 0) PyErr_Format(PyExc_ValueError, "qadam.step: %zd output segments (at most %d)", k, 1 << 20);
        Py_DECREF(seq);
        return NULL;
    }
    Seg *segs = PyMem_Malloc(sizeof(Seg) * (size_t)k);
    if (segs == NULL) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    long long prev = lo;
    for (Py_ssize_t i = 0; i < k; i++) {
        long long a, b;
        unsigned long long addr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LLK;qadam.step: an output segment is "
                              "(start, end, address)", &a, &b, &addr)) goto fail;
        if (a < prev || a >= b || b > hi || addr == 0) {
            PyErr_Format(PyExc_ValueError, "qadam.step: output segment %zd [%lld, %lld) is empty, unsorted, "
                         "overlaps another or leaves [%lld, %lld), or its address is 0", i, a, b, lo, hi);
            goto fail;
        }
        segs[i].start = a; segs[i].end = b; segs[i].out = (uint16_t *)(uintptr_t)addr;
        prev = b;
    }
    Py_DECREF(seq);
    *count = (int)k;
    return segs;
fail:
    Py_DECREF(seq);
    PyMem_Free(segs);
    return NULL;
}

static PyObject *qadam_step(PyObject *self, PyObject *args) {
    int mode, decoupled, threads, g_bf16 = 0;
    long long n, lo, hi, block, step;
    unsigned long long p, g, m, v, ms, vs;
    unsigned int seed;
    double lr, b1, b2, eps, wd, gmul;
    PyObject *outs = NULL;
    if (!PyArg_ParseTuple(args, "iLLLLKKKKKKLddddddpIi|pO", &mode, &n, &lo, &hi, &block, &p, &g, &m, &v, &ms, &vs,
                          &step, &lr, &b1, &b2, &eps, &wd, &gmul, &decoupled, &seed, &threads, &g_bf16, &outs))
        return NULL;
    if (mode != MODE_BF16 && mode != MODE_INT8) {
        PyErr_Format(PyExc_ValueError, "qadam.step: mode %d is not 1 (bf16) or 2 (int8)", mode);
        return NULL;
    }
    if (block < 1 || block > MAX_BLOCK || n < 0 || lo < 0 || hi > n || lo > hi || step < 1) {
        PyErr_Format(PyExc_ValueError, "qadam.step: bad range or block (n=%lld lo=%lld hi=%lld block=%lld "
                     "step=%lld; block must be 1..%d)", n, lo, hi, block, step, MAX_BLOCK);
        return NULL;
    }
    Job base = {0};
    base.mode = mode; base.decoupled = decoupled; base.n = n; base.lo = lo; base.hi = hi; base.block = block;
    base.p = (float *)(uintptr_t)p;
    if (g_bf16) base.g16 = (const uint16_t *)(uintptr_t)g; else base.g = (const float *)(uintptr_t)g;
    base.m = (uint8_t *)(uintptr_t)m; base.v = (uint8_t *)(uintptr_t)v;
    base.ms = (float *)(uintptr_t)ms; base.vs = (float *)(uintptr_t)vs;
    /* The bias corrections in double from the double hyper-parameters, then float, as the torch twin does. */
    base.lr = (float)lr; base.b1 = (float)b1; base.b2 = (float)b2; base.eps = (float)eps; base.wd = (float)wd;
    base.gmul = (float)gmul; base.seed = seed;
    base.step_size = (float)(lr / (1.0 - pow(b1, (double)step)));
    base.inv_bc2_sqrt = (float)(1.0 / sqrt(1.0 - pow(b2, (double)step)));
    if (lo == hi) Py_RETURN_NONE;
    Seg *segs = parse_segments(outs, lo, hi, &base.nsegs);
    if (segs == NULL && PyErr_Occurred()) return NULL;
    base.segs = segs;
    run_threaded(&base, threads);
    PyMem_Free(segs);
    Py_RETURN_NONE;
}

/* step_fp32(lo, hi, p, g, g_bf16, m, v, out, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
 *           decoupled, threads)
 *
 * [Note: the fused fp32 step]
 * Adam(W) over elements [lo, hi) of fp32 master weights p and fp32 moments m, v, in one pass that
 * also reads the gradient in the compute dtype (bf16 words when g_bf16: the compact gradient of
 * infinity/optim/compact_grads.py, widened exactly in registers) and writes the new weights' bf16
 * copy (out, round to nearest even, as torch's .to(torch.bfloat16); 0 for none). torch's fused
 * kernel takes one dtype, so without this the update made three passes over memory: widen the
 * gradient into an fp32 buffer, step, narrow the weights into the compute copy (46 bytes a
 * parameter moved against 28).
 * The arithmetic is torch's CPU _fused_adam(w)_ kernel's, operation for operation and with its
 * constants rounded from double the same way, so the results are its bit for bit
 * (tests/unit/test_fused_fp32_step.py checks that against the torch installed): the gradient
 * divided by grad_scale (when > 0); AdamW's decay as p * (1 - lr wd), Adam's as fma(p, wd, g); m
 * by lerp towards g, fma((1 - b1), g - m, m); v as fma((1 - b2) g, g, v b2); p - (lr / bc1) m /
 * (sqrt(v) / sqrt(bc2) + eps). The gradient is not written back (torch stores the unscaled one). */
static PyObject *qadam_step_fp32(PyObject *self, PyObject *args) {
    long long lo, hi, step;
    unsigned long long p, g, m, v, out;
    int g_bf16, decoupled, threads;
    double lr, b1, b2, eps, wd, grad_scale;
    if (!PyArg_ParseTuple(args, "LLKKpKKKLddddddpi", &lo, &hi, &p, &g, &g_bf16, &m, &v, &out, &step, &lr, &b1,
                          &b2, &eps, &wd, &grad_scale, &decoupled, &threads))
        return NULL;
    if (lo < 0 || lo > hi || step < 1) {
        PyErr_Format(PyExc_ValueError, "qadam.step_fp32: bad range or step (lo=%lld hi=%lld step=%lld)", lo, hi, step);
        return NULL;
    }
    Job base = {0};
    base.mode = MODE_FP32; base.decoupled = decoupled; base.n = hi; base.lo = lo; base.hi = hi; base.block = CHUNK;
    base.p = (float *)(uintptr_t)p;
    if (g_bf16) base.g16 = (const uint16_t *)(uintptr_t)g; else base.g = (const float *)(uintptr_t)g;
    base.m = (uint8_t *)(uintptr_t)m; base.v = (uint8_t *)(uintptr_t)v;
    base.out16 = (uint16_t *)(uintptr_t)out;
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    base.T.b1c = (float)(1.0 - b1);
    base.T.b2 = (float)b2;
    base.T.b2c = (float)(1.0 - b2);
    base.T.eps = (float)eps;
    base.T.decay = (float)(1.0 - lr * wd);
    base.T.wd = (float)wd;
    base.T.step_size = (float)(lr / bc1);
    base.T.bc2_sqrt = (float)sqrt(bc2);
    base.T.scale = (float)grad_scale;
    base.T.has_scale = grad_scale > 0.0;
    base.lr = (float)lr;
    base.wd = (float)wd;
    if (lo == hi) Py_RETURN_NONE;
    run_threaded(&base, threads);
    Py_RETURN_NONE;
}

static const char *const isa_names[] = {"auto", "avx512", "avx2", "base"};

/* isa(name=None): the variant in use ("avx512", "avx2" or "base"); with a name, use that one from now
 * on ("auto": the best the CPU supports). For tests that compare the variants' bits. */
static PyObject *qadam_isa(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name != NULL) {
        int chosen = -1;
        for (int i = 0; i < 4; i++)
            if (strcmp(name, isa_names[i]) == 0) chosen = i;
        if (chosen < 0 || (chosen != ISA_AUTO && !isa_supported(chosen))) {
            PyErr_Format(PyExc_ValueError, "qadam.isa: %s is %s (auto, avx512, avx2 or base, as the CPU supports)",
                         name, chosen < 0 ? "no instruction set here" : "not supported by this CPU");
            return NULL;
        }
        isa_choice = chosen;
    }
    return PyUnicode_FromString(isa_names[isa_in_use()]);
}

static PyMethodDef methods[] = {
    {"isa", qadam_isa, METH_VARARGS,
     "isa(name=None): the compiled variant in use; with a name (auto, avx512, avx2, base), choose it (tests)"},
    {"step", qadam_step, METH_VARARGS,
     "step(mode, n, lo, hi, block, p, g, m, v, m_scales, v_scales, step, lr, beta1, beta2, eps, weight_decay, "
     "grad_mul, decoupled, seed, threads, g_bf16=False, outs=None): Adam over elements [lo, hi) of a sub-group "
     "with compressed moments, the gradient fp32 or bf16 words, the new weights' bf16 copies written into outs' "
     "(start, end, address) segments"},
    {"step_fp32", qadam_step_fp32, METH_VARARGS,
     "step_fp32(lo, hi, p, g, g_bf16, m, v, out, step, lr, beta1, beta2, eps, weight_decay, grad_scale, decoupled, "
     "threads): torch's fused Adam(W) over fp32 states, the gradient read as fp32 or bf16 and the bf16 copy written"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qadam", "Host Adam kernels (C).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__qadam(void) {
    PyObject *mod = PyModule_Create(&module);
    /* 1: step() takes g_bf16 and outs (an older build refuses them). */
    if (mod != NULL && PyModule_AddIntConstant(mod, "STEP_COPIES", 1) < 0) { Py_DECREF(mod); return NULL; }
    return mod;
}
