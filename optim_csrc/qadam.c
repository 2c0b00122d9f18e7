/* Host Adam kernels: Adam(W) over compressed moments (decode, step and re-encode one block at a time,
 * in one pass), and the fused fp32 step (see [Note: the fused fp32 step] below).
 *
 * No Python objects beyond the arguments, no torch: the caller passes raw addresses of the fp32
 * master and gradient and of the moments' stored bytes, and the element range [lo, hi) of one
 * sub-group to update. The GIL is released while the blocks are stepped, on `threads` threads.
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

#define MODE_BF16 1
#define MODE_INT8 2
#define MODE_FP32 3     /* fp32 moments, torch's fused arithmetic: see step_fp32 */
#define MAX_BLOCK 2048
#define MAX_THREADS 256
#define CODE_TOP 1.9375f

typedef struct {
    int mode, decoupled;
    int64_t n, lo, hi, block;
    float *p; const float *g;
    uint8_t *m, *v;       /* codes (int8) or bf16 values */
    float *ms, *vs;       /* int8: per-block scales */
    float lr, b1, b2, eps, wd, gmul, step_size, inv_bc2_sqrt;
    uint32_t seed;
    int64_t first_block, last_block;  /* [first, last) this worker steps */
    /* MODE_FP32: the gradient as bf16 words (g16, else g), the bf16 copy of the new weights (out16,
     * or none), the constants as torch's fused kernel rounds them from double (T). */
    const uint16_t *g16;
    uint16_t *out16;
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

static void run(const Job *j) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
        if (j->mode == MODE_FP32) run_fp32_avx512(j); else if (j->mode == MODE_INT8) run_int8_avx512(j);
        else run_bf16_avx512(j);
        return;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        if (j->mode == MODE_FP32) run_fp32_avx2(j); else if (j->mode == MODE_INT8) run_int8_avx2(j);
        else run_bf16_avx2(j);
        return;
    }
#endif
    if (j->mode == MODE_FP32) run_fp32_base(j); else if (j->mode == MODE_INT8) run_int8_base(j);
    else run_bf16_base(j);
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

static PyObject *qadam_step(PyObject *self, PyObject *args) {
    int mode, decoupled, threads;
    long long n, lo, hi, block, step;
    unsigned long long p, g, m, v, ms, vs;
    unsigned int seed;
    double lr, b1, b2, eps, wd, gmul;
    if (!PyArg_ParseTuple(args, "iLLLLKKKKKKLddddddpIi", &mode, &n, &lo, &hi, &block, &p, &g, &m, &v, &ms, &vs,
                          &step, &lr, &b1, &b2, &eps, &wd, &gmul, &decoupled, &seed, &threads))
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
    base.p = (float *)(uintptr_t)p; base.g = (const float *)(uintptr_t)g;
    base.m = (uint8_t *)(uintptr_t)m; base.v = (uint8_t *)(uintptr_t)v;
    base.ms = (float *)(uintptr_t)ms; base.vs = (float *)(uintptr_t)vs;
    /* The bias corrections in double from the double hyper-parameters, then float, as the torch twin does. */
    base.lr = (float)lr; base.b1 = (float)b1; base.b2 = (float)b2; base.eps = (float)eps; base.wd = (float)wd;
    base.gmul = (float)gmul; base.seed = seed;
    base.step_size = (float)(lr / (1.0 - pow(b1, (double)step)));
    base.inv_bc2_sqrt = (float)(1.0 / sqrt(1.0 - pow(b2, (double)step)));
    if (lo == hi) Py_RETURN_NONE;
    run_threaded(&base, threads);
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

static PyMethodDef methods[] = {
    {"step", qadam_step, METH_VARARGS,
     "step(mode, n, lo, hi, block, p, g, m, v, m_scales, v_scales, step, lr, beta1, beta2, eps, weight_decay, "
     "grad_mul, decoupled, seed, threads): Adam over elements [lo, hi) of a sub-group with compressed moments"},
    {"step_fp32", qadam_step_fp32, METH_VARARGS,
     "step_fp32(lo, hi, p, g, g_bf16, m, v, out, step, lr, beta1, beta2, eps, weight_decay, grad_scale, decoupled, "
     "threads): torch's fused Adam(W) over fp32 states, the gradient read as fp32 or bf16 and the bf16 copy written"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qadam", "Host Adam kernels (C).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__qadam(void) { return PyModule_Create(&module); }
