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
#define _GNU_SOURCE     /* RTLD_DEFAULT */
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#define MODE_BF16 1
#define MODE_INT8 2
#define MODE_FP32 3     /* fp32 moments, torch's fused arithmetic: see step_fp32 */
#define MODE_COPY 4     /* the memory-bandwidth baselines: see [Note: the STREAM baselines] */
#define MODE_TRIAD 5
#define MAX_BLOCK 2048
#define MAX_THREADS 256
#define CODE_TOP 1.9375f

/* Elements [start, end) of a sub-group whose new copies go to out (bf16) or out32 (fp32), element start at
 * index 0 (one of the two per call, the other NULL). */
typedef struct { int64_t start, end; uint16_t *out; float *out32; } Seg;

typedef struct {
    int mode, decoupled;
    int64_t n, lo, hi, block;
    float *p; const float *g;
    uint8_t *m, *v;       /* codes (int8) or bf16 values */
    float *ms, *vs;       /* int8: per-block scales */
    float lr, b1, b2, eps, wd, gmul, step_size, inv_bc2_sqrt;
    uint32_t seed;
    int64_t first_block, last_block;  /* [first, last) this worker steps */
    /* The gradient as bf16 words (g16, else g). MODE_FP32: the bf16 or fp32 copy of the new weights (out16, out32,
     * none), the constants as torch's fused kernel rounds them from double (T). Compressed modes: the
     * copies of the stepped elements (bf16, or fp32 with segs_fp32), into nsegs sorted, disjoint segments
     * (segs). */
    const uint16_t *g16;
    uint16_t *out16;
    float *out32;
    const Seg *segs;
    int nsegs, segs_fp32;
    int stream;           /* copies stored past the caches (see [Note: copies past the caches]) */
    struct { float b1c, b2, b2c, eps, decay, wd, step_size, bc2_sqrt, scale; int has_scale; } T;
    /* MODE_COPY, MODE_TRIAD: a = b, a = b + s c, over doubles */
    double *sa; const double *sb, *sc; double s;
} Job;

static inline __attribute__((always_inline)) float as_float(int32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline __attribute__((always_inline)) int32_t as_int(float f) { int32_t u; memcpy(&u, &f, 4); return u; }
/* The bf16 word of x: round to nearest even; a NaN becomes 0xFFFF, a NaN, as torch's vector conversion makes it. */
static inline __attribute__((always_inline)) uint32_t bf16_rne(float x) {
    uint32_t u = (uint32_t)as_int(x);
    return (x != x) ? 0xFFFFu : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

static inline __attribute__((always_inline)) uint32_t mix(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return h;
}

/* bf16 with stochastic rounding: add 16 random bits below the kept ones, then truncate. The random bits
 * hash the element index times INDEX_MUL (bf16_span steps that product by INDEX_MUL per element). */
#define INDEX_MUL 0x9E3779B1u
static inline __attribute__((always_inline)) uint32_t bf16_sr(float x, uint32_t seed, uint32_t index_mul) {
    uint32_t r = mix(index_mul ^ seed) & 0xFFFFu;
    return ((uint32_t)as_int(x) + r) >> 16;
}

/* Float-like code of u in [0, CODE_TOP]: `mbits` mantissa bits, exponent bias `bias`, subnormals.
 * int32 throughout: what AVX2 converts and shifts in vectors. */
static inline __attribute__((always_inline)) int32_t encode_mag(float u, int mbits, int bias, int32_t top) {
    float threshold = as_float((127 + 1 - bias) << 23);
    float sub_mul = as_float((127 + bias - 1 + mbits) << 23);
    /* round half up, exactly: x - floor(x) is exact, where x + 0.5f could round up a fraction under 1/2 */
    float x = u * sub_mul;
    int32_t whole = (int32_t)x;
    int32_t sub = whole + (x - (float)whole >= 0.5f);
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

#define CHUNK 1024

/* [Note: copies past the caches]
 * A compute copy the pass writes (into the staging a device or NVMe copy is made from, or the parameters'
 * shards in host memory) is not read again before the pass has gone through the rest of its call, so
 * when the call's arrays are larger than the last-level caches, the copy's lines are gone from them when
 * anything reads it (the DMA of a device copy reads memory anyway). Plain stores to such lines first read
 * them from memory (write-allocate): 2 bytes a parameter more on the bus for a bf16 copy, 4 for an fp32
 * one, on a pass that the bus bounds. Non-temporal stores write whole lines without that read. A call
 * whose arrays fit in the caches keeps plain stores: there the copy would be read from the cache, and
 * non-temporal stores took 1.3-2x the time of the pass at 1M parameters (2-core Zen VM, 32 MiB L3).
 * Which calls stream is set from Python (stream_copies(), infinity/optim/moments.py: twice the last-level
 * caches the process may run on), against an estimate of the call's arrays (its elements times the bytes of
 * their states, gradient and copy). Each worker fences its non-temporal stores (run) before its job counts
 * as done. The copies the hand-written int8 blocks store from registers (update_8, encode_plain_16,
 * encode_any_avx2) stay plain stores: those blocks are bound by the cores, not the bus. */
static long long stream_min_bytes = 64LL << 20;     /* < 0: never */
static long long streamed_calls = 0;                /* calls that streamed, for tests (under the GIL) */

/* Whether a call over `elements`, moving `bytes_per_element` (its states, gradient and copy), with copies
 * to write, stores them past the caches. */
static int stream_call(long long elements, long long bytes_per_element, int has_copies) {
    return has_copies && stream_min_bytes >= 0 && elements * bytes_per_element >= stream_min_bytes;
}

/* memcpy(dst, src, n) with the whole 64-byte lines of dst written by non-temporal stores (SSE2, every
 * x86-64); the partial lines at either end by plain ones. memcpy elsewhere. */
static inline void store_past_cache(void *dst, const void *src, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t lines = n & ~(size_t)63;
    for (size_t i = 0; i < lines; i += 64)
        for (size_t k = 0; k < 64; k += 16)
            _mm_stream_si128((__m128i *)(d + i + k), _mm_loadu_si128((const __m128i *)(s + i + k)));
    memcpy(d + lines, s + lines, n - lines);
#else
    memcpy(dst, src, n);
#endif
}

/* A copy's bytes from src (in cache) into dst: past the caches when the job streams. */
static inline void put_copy(const Job *j, void *dst, const void *src, size_t n) {
    if (j->stream) store_past_cache(dst, src, n);
    else memcpy(dst, src, n);
}

/* [Note: one kernel per instruction set] The loops are compiled three times: for AVX-512 with
 * 512-bit vectors (gcc prefers 256-bit ones unless told), for AVX2, and for any x86-64; the first the
 * CPU supports runs. Whole int8 blocks are stepped by hand-written blocks instead ([Note: the int8
 * block in AVX2], [Note: the int8 block in AVX-512]): on a Zen 4 the compiled AVX-512 loops took 3.9 ns
 * per element (1 thread, in cache), the AVX2 block 1.5, the AVX-512 block 1.28. */
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
 * With 256-bit vectors the int8 step is compute-bound. This block does the portable loops' arithmetic
 * with their bits (no fused multiply-adds; tests/unit/test_compressed_copies.py and test_int8_codes.py
 * compare them) in two loops: (1) decode, the new m and w = sqrt(v), their largest magnitudes; (2) the
 * weights' update and bf16 copies (from the registers), encode, narrow. Full blocks only, whose length
 * is a multiple of 16; the others go to int8_block_avx2.
 *
 * Why two loops split there: on the Zen 3 here the loop is bound by the floating-point scheduler (64
 * entries), not by its arithmetic. An element's chain (decode, square, sqrt, divide, round to bf16) is
 * about 60 cycles long, and operations waiting on it fill the scheduler: with the update and the
 * copies in loop 1 it ran 25 cycles per 8 elements against a throughput bound of 8 (llvm-mca
 * -mcpu=znver3). With the square root and the division in different loops, nothing waiting on the
 * latter but a store and the copy, they take 9.3 and 12 (loop 2 runs 16 elements at a time).
 *
 * The codes are small floats, and F16C converts them in one instruction each way. v's code (4
 * exponent bits, bias 15, 4 mantissa bits, subnormals) is an fp16 value's top 10 bits: code << 6 is
 * the fp16 of its value; m's (3 exponent bits, bias 7) is too once scaled by 2^-8, fp16's subnormals
 * then being the code's. Encoding converts u (times 2^-8 for m) to fp16 rounding toward zero, then
 * rounds half up at the code's last bit: (h + 32) >> 6, the carry running into the exponent. Rounding
 * half up looks at no bit below the half, so truncating those first changes nothing: the codes are
 * encode_mag's, subnormals included (checked once for every float in [0, 2] by a C harness on
 * 2026-11-27; tests/unit/test_int8_codes.py checks every midpoint and its neighbours). Blocks whose scales are plain (nearly all) encode 16 elements at a time with
 * cheaper checks (encode_plain_avx2 says why they give the same codes).
 *
 * Kernel alone, 1 thread, 16Ki elements in cache (ns per element, min of 25 alternated runs): 1.60
 * before this note's changes, 1.24 after. */
#define V8(x) _mm256_set1_ps(x)
/* The bf16 words of x (round to nearest even, a NaN as 0xFFFF: to_bf16's). */
__attribute__((target("avx2,fma"))) static inline __m128i to_bf16_v(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                   _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))),
                                  16);
    r = _mm256_and_si256(_mm256_or_si256(r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))),
                         _mm256_set1_epi32(0xFFFF));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Where the bf16 copies of block [b0, b0 + len) go when one output segment holds it whole; NULL when
 * there are none or write_copies must split it. Advances *cur as write_copies does. */
static inline uint16_t *block_out(const Job *j, int64_t b0, int64_t len, int *cur) {
    if (!j->nsegs || j->segs_fp32) return NULL;     /* fp32 copies: block_out32 */
    while (*cur < j->nsegs && j->segs[*cur].end <= b0) (*cur)++;
    if (*cur < j->nsegs && j->segs[*cur].start <= b0 && b0 + len <= j->segs[*cur].end)
        return j->segs[*cur].out + (b0 - j->segs[*cur].start);
    return NULL;
}

/* block_out for fp32 copies (segs_fp32): where the block's fp32 copies go when one segment holds it whole. */
static inline float *block_out32(const Job *j, int64_t b0, int64_t len, int *cur) {
    if (!j->nsegs || !j->segs_fp32) return NULL;
    while (*cur < j->nsegs && j->segs[*cur].end <= b0) (*cur)++;
    if (*cur < j->nsegs && j->segs[*cur].start <= b0 && b0 + len <= j->segs[*cur].end)
        return j->segs[*cur].out32 + (b0 - j->segs[*cur].start);
    return NULL;
}

/* Codes of 8 magnitudes scaled into fp16's range (u >= 0, or its sign bit ignored), as 16-bit words:
 * the fp16 rounded toward zero, then half up at the code's last bit; at most top. */
__attribute__((target("avx2,f16c"))) static inline __m128i encode_f16(__m256 u, __m128i top) {
    __m128i h = _mm_and_si128(_mm256_cvtps_ph(u, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), _mm_set1_epi16(0x7FFF));
    return _mm_min_epu16(_mm_srli_epi16(_mm_add_epi16(h, _mm_set1_epi16(32)), 6), top);
}

/* The weights' update of 8 elements at p from their new m (x) and w, and their bf16 copies (out, or none). */
__attribute__((target("avx2,fma"), always_inline)) static inline void update_8(float *p, __m256 x, __m256 w,
                                                                              uint16_t *out, Hyper h,
                                                                              const int decoupled) {
    __m256 pv = _mm256_loadu_ps(p);
    __m256 pi = decoupled ? _mm256_mul_ps(pv, V8(h.decay)) : pv;
    __m256 pn = _mm256_sub_ps(pi, _mm256_div_ps(_mm256_mul_ps(V8(h.step_size), x),
                                                _mm256_add_ps(_mm256_mul_ps(w, V8(h.inv_bc2_sqrt)), V8(h.eps))));
    _mm256_storeu_ps(p, pn);
    if (out != NULL) _mm_storeu_si128((__m128i *)out, to_bf16_v(pn));
}

/* Loop 2 of a block whose scales are plain (see int8_block_fast_avx2), 16 elements at a time. Where the
 * scales are plain the general loop's checks reduce to cheaper ones, with the same codes:
 * - qm * 2^-8 is exact (am <= 2^118), and |x| qm 2^-8 is |x| (qm 2^-8) but where it is under 2^-126,
 *   which codes 0 either way;
 * - x * qm has x's sign (x and qm finite, qm > 0; am = 0 makes every code 0);
 * - a w > 0 stepped here is at least 2^-74.5 (sqrt of a float), and aw at most 2^64, so w qw is at
 *   least 2^-137.6: raising it to min(w qw 2^126, 2^-18), the smallest code's value, makes the
 *   positive ones code at least 1 and leaves the others. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void encode_plain_avx2(
        const Job *j, Hyper h, int64_t b0, int64_t len, const float *fm, const float *fw, uint16_t *out,
        float qm8, float qw, const int decoupled) {
    uint8_t *restrict mc = j->m + b0, *restrict vc = j->v + b0;
    float *restrict p = j->p + b0;
    const __m256 qm = V8(qm8), qwv = V8(qw), up = V8(0x1p126f), smallest = V8(0x1p-18f);
    const __m256i low15 = _mm256_set1_epi16(0x7FFF), half = _mm256_set1_epi16(32), k7f = _mm256_set1_epi16(0x7F);
    const __m256i top_w = _mm256_set1_epi16(0xFF), bit7 = _mm256_set1_epi16(0x80);
    for (int64_t t = 0; t < len; t += 16) {
        __m128i hm[2], hw[2];
        for (int k = 0; k < 2; k++) {
            __m256 x = _mm256_load_ps(fm + t + 8 * k), w = _mm256_load_ps(fw + t + 8 * k);
            update_8(p + t + 8 * k, x, w, out != NULL ? out + t + 8 * k : NULL, h, decoupled);
            hm[k] = _mm256_cvtps_ph(_mm256_mul_ps(x, qm), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 u = _mm256_mul_ps(w, qwv);
            hw[k] = _mm256_cvtps_ph(_mm256_max_ps(u, _mm256_min_ps(_mm256_mul_ps(u, up), smallest)),
                                    _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        }
        __m256i fm16 = _mm256_set_m128i(hm[1], hm[0]), fw16 = _mm256_set_m128i(hw[1], hw[0]);
        __m256i cm = _mm256_min_epu16(_mm256_srli_epi16(_mm256_add_epi16(_mm256_and_si256(fm16, low15), half), 6), k7f);
        /* the fp16's sign, kept where the code is not 0 (c + 0x7F has bit 7 then) */
        cm = _mm256_or_si256(cm, _mm256_and_si256(_mm256_and_si256(_mm256_srli_epi16(fm16, 8),
                                                                   _mm256_add_epi16(cm, k7f)), bit7));
        __m256i cw = _mm256_min_epu16(_mm256_srli_epi16(_mm256_add_epi16(fw16, half), 6), top_w);
        /* bytes per 128-bit lane: m0-7 v0-7 | m8-15 v8-15 -> m0-15 | v0-15 */
        __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(cm, cw), 0xD8);
        _mm_storeu_si128((__m128i *)(mc + t), _mm256_castsi256_si128(bytes));
        _mm_storeu_si128((__m128i *)(vc + t), _mm256_extracti128_si256(bytes, 1));
    }
}

/* Loop 2 of any other block, 8 elements at a time: encode_mag's arithmetic whatever the scales. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void encode_any_avx2(
        const Job *j, Hyper h, int64_t b0, int64_t len, const float *fm, const float *fw, uint16_t *out,
        float am, float aw, const int decoupled) {
    uint8_t *restrict mc = j->m + b0, *restrict vc = j->v + b0;
    float *restrict p = j->p + b0;
    const __m256 qm = V8(am > 0.0f ? CODE_TOP / am : 0.0f), qw = V8(aw > 0.0f ? CODE_TOP / aw : 0.0f);
    const __m256 down8 = V8(1.0f / 256.0f);
    const __m128i top_m = _mm_set1_epi16(0x7F), top_w = _mm_set1_epi16(0xFF), k7f = _mm_set1_epi16(0x7F);
    const __m128i bit7 = _mm_set1_epi16(0x80), zero = _mm_setzero_si128();
    for (int64_t t = 0; t < len; t += 8) {
        __m256 x = _mm256_load_ps(fm + t), w = _mm256_load_ps(fw + t);
        update_8(p + t, x, w, out != NULL ? out + t : NULL, h, decoupled);
        /* x qm as encode_mag gets it (encode_f16 drops the sign), then scaled exactly (a product under
         * 2^-126 codes 0 either way) */
        __m128i c = encode_f16(_mm256_mul_ps(_mm256_mul_ps(x, qm), down8), top_m);
        /* x's sign bit (x's top 16 bits, narrowed), kept where the code is not 0: c + 0x7F has bit 7 then */
        __m256i xh = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
        __m128i sign = _mm_srli_epi16(_mm_packus_epi32(_mm256_castsi256_si128(xh), _mm256_extracti128_si256(xh, 1)), 8);
        __m128i cmo = _mm_or_si128(c, _mm_and_si128(_mm_and_si128(sign, _mm_add_epi16(c, k7f)), bit7));
        __m128i cw = encode_f16(_mm256_mul_ps(w, qw), top_w);
        /* a positive w never codes 0: code - (-1) there */
        __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_GT_OQ));
        __m128i pos16 = _mm_packs_epi32(_mm256_castsi256_si128(pos), _mm256_extracti128_si256(pos, 1));
        __m128i cvo = _mm_sub_epi16(cw, _mm_and_si128(_mm_cmpeq_epi16(cw, zero), pos16));
        __m128i b = _mm_packus_epi16(cmo, cvo);     /* m0-7 v0-7 */
        _mm_storel_epi64((__m128i *)(mc + t), b);
        _mm_storel_epi64((__m128i *)(vc + t), _mm_unpackhi_epi64(b, b));
    }
}

/* g16 and decoupled are constants where run_int8_fast_avx2 calls it: one loop without branches each. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void int8_block_fast_avx2(
        const Job *j, Hyper h, int64_t k, int *cur, Scratch_avx2 *sc, const int g16, const int decoupled) {
    const int64_t b0 = k * j->block, len = j->block;
    float *restrict fm = sc->fm, *restrict fw = sc->fw;
    const uint8_t *restrict mc = j->m + b0, *restrict vc = j->v + b0;
    const float *restrict p = j->p + b0;
    uint16_t *restrict out = block_out(j, b0, len, cur);
    const float inv_top = 1.0f / CODE_TOP;
    const __m256 dm = V8(j->ms[k] * inv_top), dw = V8(j->vs[k] * inv_top);
    const __m256 b1 = V8(h.b1), b2 = V8(h.b2), c1 = V8(1.0f - h.b1), c2 = V8(1.0f - h.b2), gmul = V8(h.gmul);
    const __m256 wd = V8(h.wd), up8 = V8(256.0f);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    /* m's code sign-extended and shifted: the sign at fp16's bit 15, two copies of it at 14-13 cleared */
    const __m128i m_bits = _mm_set1_epi16((short)0x9FFF);
    __m256i im = _mm256_setzero_si256(), iw = _mm256_setzero_si256();
    /* Loop 1: decode, the new m and w = sqrt(v) into the scratch, their largest magnitudes. */
    for (int64_t t = 0; t < len; t += 8) {
        __m128i hm = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(mc + t))), 6),
                                   m_bits);
        __m128i hw = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(vc + t))), 6);
        __m256 m = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(hm), up8), dm);
        __m256 wo = _mm256_mul_ps(_mm256_cvtph_ps(hw), dw);
        __m256 g;
        if (g16)
            g = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(j->g16 + b0 + t))), 16));
        else
            g = _mm256_loadu_ps(j->g + b0 + t);
        __m256 gi = decoupled ? _mm256_mul_ps(g, gmul)
                              : _mm256_add_ps(_mm256_mul_ps(g, gmul), _mm256_mul_ps(wd, _mm256_loadu_ps(p + t)));
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, m), _mm256_mul_ps(c1, gi));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_mul_ps(wo, wo)), _mm256_mul_ps(_mm256_mul_ps(c2, gi), gi));
        __m256 wi = _mm256_sqrt_ps(vi);
        _mm256_store_ps(fm + t, mi);
        _mm256_store_ps(fw + t, wi);
        im = _mm256_max_epi32(im, _mm256_and_si256(_mm256_castps_si256(mi), abs_mask));
        iw = _mm256_max_epi32(iw, _mm256_and_si256(_mm256_castps_si256(wi), abs_mask));
    }
    int32_t lm[8], lw[8], am_i = 0, aw_i = 0;
    _mm256_storeu_si256((__m256i *)lm, im);
    _mm256_storeu_si256((__m256i *)lw, iw);
    for (int t = 0; t < 8; t++) {
        am_i = lm[t] > am_i ? lm[t] : am_i;
        aw_i = lw[t] > aw_i ? lw[t] : aw_i;
    }
    float am = as_float(am_i), aw = as_float(aw_i);
    /* Loop 2: the weights' update and copies, the codes. Plain scales: finite, am 0 or in [2^-126, 2^118]
     * (a NaN or an infinity anywhere in the block makes its scale one). */
    if (am_i <= 0x7A800000 && (am_i == 0 || am_i >= 0x00800000) && aw_i < 0x7F800000)
        encode_plain_avx2(j, h, b0, len, fm, fw, out, (am > 0.0f ? CODE_TOP / am : 0.0f) * (1.0f / 256.0f),
                          aw > 0.0f ? CODE_TOP / aw : 0.0f, decoupled);
    else
        encode_any_avx2(j, h, b0, len, fm, fw, out, am, aw, decoupled);
    if (j->nsegs && out == NULL) write_copies_avx2(j, b0, b0 + len, cur);
    j->ms[k] = am;
    j->vs[k] = aw;
}

__attribute__((target("avx2,fma,f16c"))) static void run_int8_fast_avx2(const Job *j) {
    Hyper h = hyper_of(j);
    Scratch_avx2 sc __attribute__((aligned(32)));
    int cur = 0;
    for (int64_t k = j->first_block; k < j->last_block; k++) {
        int64_t b0 = k * j->block;
        if (!(j->block % 16 == 0 && b0 >= j->lo && b0 + j->block <= j->hi && b0 + j->block <= j->n))
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

/* [Note: the int8 block in AVX-512]
 * The AVX2 block's arithmetic, 16 elements to a vector: the same operations on the same values (no fused
 * multiply-adds), so the same bits (tests/unit/test_compressed_copies.py compares every variant with the
 * portable C). Loop 1 decodes 16 codes at a time (F16C on a 512-bit register); loop 2 narrows the codes
 * with vpmovwb (each at most 0xFF) instead of packing pairs. Blocks whose scales are not plain take the
 * AVX2 block's loop 2 (encode_any_avx2) on the same scratch.
 *
 * Loop 1 of block k runs in the same loop as loop 2 of block k - 2 (a run of full blocks, three scratches
 * taking turns): a block's maxima and scales are ready a block before its loop 2 needs them, where each
 * block's loop 2 waited for its own reductions and scalar divisions, and the loop's other arithmetic
 * overlaps the square roots and divisions. Nothing changes but the order: loop 1 of block k reads block
 * k's codes, old scales and weights only, which loop 2 of blocks before it does not write. The scratch
 * rows are staggered modulo 4096 bytes (Scratch512). Three operations go, with the same bits: m's code
 * is decoded with one multiplication by 256 dm instead of two (the products are the same real number
 * rounded once: 256 x and 256 dm are exact; a block whose 256 dm would overflow keeps the two), the
 * gradient is not multiplied by a grad_mul of 1 (g * 1 is g; the first operation that uses either
 * quiets a signalling NaN alike), and a positive w's code is raised to 1 by a compare and a masked move
 * (encode_plain_16 says why that is encode_plain_avx2's).
 * On a Zen 4 (AMD EPYC, family 25 model 17; 512-bit operations take one scheduler entry each, issued in
 * two halves), 1 thread, 64Ki elements in cache, min of 36 alternated runs of a C harness, ns per
 * element, before and after: blocks of 64 0.749 and 0.633, of 256 0.565 and 0.526, of 2048 0.515 and
 * 0.495. The same loop with the scratches 8 KiB apart (every load 4K-aliasing the store before it) and
 * loop 2 one block behind instead of two measured no faster than before. */
#define V16(x) _mm512_set1_ps(x)
#define AVX512_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* The pipeline's three scratches, each m's and w's: six rows whose starts differ by 256 bytes modulo
 * 4096, so that loop 1 storing into one and loop 2 loading from another at the same element never look
 * alike to the store-to-load forwarding check (4K aliasing: the rows 8 KiB apart made every such load
 * wait on the store). */
#define SCRATCH_ROW (MAX_BLOCK + 64)
typedef struct { float row[6][SCRATCH_ROW]; } Scratch512;

/* The bf16 words of 16 floats (round to nearest even, a NaN as 0xFFFF: to_bf16's). */
AVX512_ATTR static inline __m256i to_bf16_v16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
                                  16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
}

/* The arrays of the block at b0, in locals: the compiler reloads nothing from the Job that the code stores
 * (bytes) might alias. */
typedef struct { float *p; const float *g; const uint16_t *g16; uint8_t *mc, *vc; } BlockPtrs;

static inline BlockPtrs block_ptrs(const Job *j, int64_t b0) {
    BlockPtrs b = {j->p + b0, j->g16 != NULL ? NULL : j->g + b0, j->g16 != NULL ? j->g16 + b0 : NULL, j->m + b0,
                   j->v + b0};
    return b;
}

/* Loop 1 on 16 elements at t of block b (dm = m's scale / CODE_TOP, dm8 = 256 dm where fold, dw = w's
 * scale / CODE_TOP): decode, the new m and w = sqrt(v) into fm, fw, their magnitudes' maxima into *im, *iw.
 * fold is the same for a whole block (the loop is unswitched on it). */
__attribute__((always_inline)) AVX512_ATTR static inline void decode_step_16(
        Hyper h, BlockPtrs b, int64_t t, int fold, __m512 dm8, __m512 dm, __m512 dw, float *fm, float *fw, __m512i *im,
        __m512i *iw, const int g16, const int decoupled, const int unit_gmul) {
    const __m256i m_bits = _mm256_set1_epi16((short)0x9FFF);   /* see int8_block_fast_avx2 */
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m256i hm = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b.mc + t))), 6),
                                  m_bits);
    __m256i hw = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b.vc + t))), 6);
    __m512 m = fold ? _mm512_mul_ps(_mm512_cvtph_ps(hm), dm8) : _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(hm), V16(256.0f)), dm);
    __m512 wo = _mm512_mul_ps(_mm512_cvtph_ps(hw), dw);
    __m512 g;
    if (g16)
        g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b.g16 + t))), 16));
    else
        g = _mm512_loadu_ps(b.g + t);
    __m512 gs = unit_gmul ? g : _mm512_mul_ps(g, V16(h.gmul));
    __m512 gi = decoupled ? gs : _mm512_add_ps(gs, _mm512_mul_ps(V16(h.wd), _mm512_loadu_ps(b.p + t)));
    __m512 mi = _mm512_add_ps(_mm512_mul_ps(V16(h.b1), m), _mm512_mul_ps(V16(1.0f - h.b1), gi));
    __m512 vi = _mm512_add_ps(_mm512_mul_ps(V16(h.b2), _mm512_mul_ps(wo, wo)),
                              _mm512_mul_ps(_mm512_mul_ps(V16(1.0f - h.b2), gi), gi));
    __m512 wi = _mm512_sqrt_ps(vi);
    _mm512_store_ps(fm + t, mi);
    _mm512_store_ps(fw + t, wi);
    *im = _mm512_max_epi32(*im, _mm512_and_si512(_mm512_castps_si512(mi), abs_mask));
    *iw = _mm512_max_epi32(*iw, _mm512_and_si512(_mm512_castps_si512(wi), abs_mask));
}

/* Loop 2 of a block with plain scales (encode_plain_avx2's arithmetic and checks) on 16 elements at t of
 * block b: the weights' update and bf16 copies (out, or none), the codes. qm8 = qm / 256. */
__attribute__((always_inline)) AVX512_ATTR static inline void encode_plain_16(
        Hyper h, BlockPtrs b, int64_t t, const float *fm, const float *fw, uint16_t *out, float *out32, __m512 qm8,
        __m512 qw,
        const int decoupled) {
    const __m256i low15 = _mm256_set1_epi16(0x7FFF), half = _mm256_set1_epi16(32), k7f = _mm256_set1_epi16(0x7F);
    const __m256i top_w = _mm256_set1_epi16(0xFF), bit7 = _mm256_set1_epi16(0x80);
    __m512 x = _mm512_load_ps(fm + t), w = _mm512_load_ps(fw + t);
    __m512 pv = _mm512_loadu_ps(b.p + t);
    __m512 pi = decoupled ? _mm512_mul_ps(pv, V16(h.decay)) : pv;
    __m512 pn = _mm512_sub_ps(pi, _mm512_div_ps(_mm512_mul_ps(V16(h.step_size), x),
                                                _mm512_add_ps(_mm512_mul_ps(w, V16(h.inv_bc2_sqrt)), V16(h.eps))));
    _mm512_storeu_ps(b.p + t, pn);
    if (out != NULL) _mm256_storeu_si256((__m256i *)(out + t), to_bf16_v16(pn));
    if (out32 != NULL) _mm512_storeu_ps(out32 + t, pn);
    __m256i fm16 = _mm512_cvtps_ph(_mm512_mul_ps(x, qm8), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256i fw16 = _mm512_cvtps_ph(_mm512_mul_ps(w, qw), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256i cm = _mm256_min_epu16(_mm256_srli_epi16(_mm256_add_epi16(_mm256_and_si256(fm16, low15), half), 6), k7f);
    cm = _mm256_or_si256(cm, _mm256_and_si256(_mm256_and_si256(_mm256_srli_epi16(fm16, 8),
                                                               _mm256_add_epi16(cm, k7f)), bit7));
    __m256i cw = _mm256_min_epu16(_mm256_srli_epi16(_mm256_add_epi16(fw16, half), 6), top_w);
    /* a positive w never codes 0: 1 there. encode_plain_avx2 raises w qw to the smallest code's value
     * instead, which codes 1 exactly where this code is 0 and w > 0 (u > 0 exactly when w > 0: w qw is at
     * least 2^-137.6, see there), and changes no other code; a compare and a masked move where that took
     * three floating-point operations. */
    __mmask16 raise = _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ) &
                      _mm256_cmpeq_epi16_mask(cw, _mm256_setzero_si256());
    cw = _mm256_mask_mov_epi16(cw, raise, _mm256_set1_epi16(1));
    _mm_storeu_si128((__m128i *)(b.mc + t), _mm256_cvtepi16_epi8(cm));
    _mm_storeu_si128((__m128i *)(b.vc + t), _mm256_cvtepi16_epi8(cw));
}

/* A block's maxima as loop 1 leaves them, and whether they are plain scales (see int8_block_fast_avx2):
 * finite, am 0 or in [2^-126, 2^118] (a NaN or an infinity anywhere in the block makes its scale one). */
typedef struct { int32_t am_i, aw_i; } Maxima;

static inline int plain_scales(Maxima a) {
    return a.am_i <= 0x7A800000 && (a.am_i == 0 || a.am_i >= 0x00800000) && a.aw_i < 0x7F800000;
}

/* Loop 1 of block k into fm, fw (with loop 2 of another block when the caller fuses them): its maxima. */
#define DECODE_LOOP(k, fm, fw, body_extra)                                                                      \
    do {                                                                                                        \
        const float inv_top_ = 1.0f / CODE_TOP;                                                                 \
        const float dm_ = j->ms[k] * inv_top_;                                                                  \
        const int fold_ = !(isfinite(dm_) && !isfinite(dm_ * 256.0f));                                         \
        const __m512 dm8_ = V16(dm_ * 256.0f), dmv_ = V16(dm_), dw_ = V16(j->vs[k] * inv_top_);               \
        const BlockPtrs db_ = block_ptrs(j, (k) * len);                                                         \
        __m512i im_ = _mm512_setzero_si512(), iw_ = _mm512_setzero_si512();                                     \
        for (int64_t t = 0; t < len; t += 16) {                                                                 \
            decode_step_16(h, db_, t, fold_, dm8_, dmv_, dw_, fm, fw, &im_, &iw_, g16, decoupled, unit_gmul);    \
            body_extra;                                                                                         \
        }                                                                                                       \
        decoded.am_i = _mm512_reduce_max_epi32(im_);   /* >= 0: from 0 */                                       \
        decoded.aw_i = _mm512_reduce_max_epi32(iw_);                                                            \
    } while (0)

/* Blocks [k0, k1), each full and fast (see run_int8_fast_avx512), pipelined as [Note: the int8 block in
 * AVX-512] says: loop 1 of block k in the same loop as loop 2 of block k - 2 (three scratches), so that a
 * block's maxima and scales are ready a block before loop 2 needs them. g16, decoupled and unit_gmul are
 * constants where run_int8_fast_avx512 calls it: one loop without branches each. */
__attribute__((always_inline)) AVX512_ATTR static inline void int8_run_avx512(
        const Job *j, Hyper h, int64_t k0, int64_t k1, int *cur, Scratch512 *sc, const int g16, const int decoupled,
        const int unit_gmul) {
    const int64_t len = j->block;
    Maxima found[3] = {{0, 0}, {0, 0}, {0, 0}};
    for (int64_t k = k0; k < k1 + 2; k++) {
        const int64_t e = k - 2;       /* the block loop 2 finishes in this round, if any */
        const int decode = k < k1, encode = e >= k0;
        float *nfm = sc->row[2 * (k % 3)], *nfw = sc->row[2 * (k % 3) + 1];
        Maxima decoded = {0, 0};
        if (!encode) {
            DECODE_LOOP(k, nfm, nfw, (void)0);
            found[k % 3] = decoded;
            continue;
        }
        const Maxima a = found[e % 3];
        const float *fm = sc->row[2 * (e % 3)], *fw = sc->row[2 * (e % 3) + 1];
        const float am = as_float(a.am_i), aw = as_float(a.aw_i);
        const BlockPtrs eb = block_ptrs(j, e * len);
        uint16_t *out = block_out(j, e * len, len, cur);
        float *out32 = block_out32(j, e * len, len, cur);
        const int plain = plain_scales(a);
        if (plain) {
            const __m512 qm8 = V16((am > 0.0f ? CODE_TOP / am : 0.0f) * (1.0f / 256.0f));
            const __m512 qw = V16(aw > 0.0f ? CODE_TOP / aw : 0.0f);
            if (decode) {
                DECODE_LOOP(k, nfm, nfw, encode_plain_16(h, eb, t, fm, fw, out, out32, qm8, qw, decoupled));
                found[k % 3] = decoded;
            } else {
                for (int64_t t = 0; t < len; t += 16)
                    encode_plain_16(h, eb, t, fm, fw, out, out32, qm8, qw, decoupled);
            }
        } else {
            encode_any_avx2(j, h, e * len, len, fm, fw, out, am, aw, decoupled);
            if (decode) {
                DECODE_LOOP(k, nfm, nfw, (void)0);
                found[k % 3] = decoded;
            }
        }
        /* copies not written from the registers: split blocks, and fp32 ones of a block encode_any_avx2 took */
        if (j->nsegs && out == NULL && (out32 == NULL || !plain)) write_copies_avx512(j, e * len, e * len + len, cur);
        j->ms[e] = am;
        j->vs[e] = aw;
    }
}
#undef DECODE_LOOP

/* Whether block k takes the fast blocks: whole inside [lo, hi), its length a multiple of 16. */
static inline int fast_block(const Job *j, int64_t k) {
    int64_t b0 = k * j->block;
    return j->block % 16 == 0 && b0 >= j->lo && b0 + j->block <= j->hi && b0 + j->block <= j->n;
}

AVX512_ATTR static void run_int8_fast_avx512(const Job *j) {
    Hyper h = hyper_of(j);
    Scratch512 sc __attribute__((aligned(64)));
    Scratch_avx512 portable __attribute__((aligned(64)));
    const int g16 = j->g16 != NULL, unit = h.gmul == 1.0f;
    int cur = 0;
    for (int64_t k = j->first_block; k < j->last_block;) {
        if (!fast_block(j, k)) {
            int8_block_avx512(j, h, k, &cur, &portable);
            k++;
            continue;
        }
        int64_t k1 = k + 1;
        while (k1 < j->last_block && fast_block(j, k1)) k1++;
        /* one loop without branches per variant */
        if (g16 && h.decoupled && unit) int8_run_avx512(j, h, k, k1, &cur, &sc, 1, 1, 1);
        else if (g16 && h.decoupled) int8_run_avx512(j, h, k, k1, &cur, &sc, 1, 1, 0);
        else if (g16 && unit) int8_run_avx512(j, h, k, k1, &cur, &sc, 1, 0, 1);
        else if (g16) int8_run_avx512(j, h, k, k1, &cur, &sc, 1, 0, 0);
        else if (h.decoupled && unit) int8_run_avx512(j, h, k, k1, &cur, &sc, 0, 1, 1);
        else if (h.decoupled) int8_run_avx512(j, h, k, k1, &cur, &sc, 0, 1, 0);
        else if (unit) int8_run_avx512(j, h, k, k1, &cur, &sc, 0, 0, 1);
        else int8_run_avx512(j, h, k, k1, &cur, &sc, 0, 0, 0);
        k = k1;
    }
}
#undef V16
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
    if (isa == ISA_AVX2)   /* F16C: the int8 block (every AVX2 CPU has it) */
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    return isa == ISA_BASE;
}

static int isa_in_use(void) {
    if (isa_choice != ISA_AUTO) return isa_choice;
    return isa_supported(ISA_AVX512) ? ISA_AVX512 : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_BASE;
}

/* [Note: the STREAM baselines]
 * copy a = b and triad a = b + s c over doubles, STREAM's own loops, split over threads as a step is
 * (run_threaded: the same team, the same thread count), so that benchmarks/adam.py can put each
 * kernel's bytes per second over the memory bandwidth measured with the kernels' threads. torch's
 * fp32 triad (torch.add(b, c, alpha=s, out=a)), the benchmark's basis before, came out well under
 * STREAM's figure on the 2-core VMs (docs/benchmarks/host-adam.md), so the Adam rows read up to twice
 * "the bandwidth". Plain stores, as STREAM compiled with gcc
 * -O3: each also reads its line first (write-allocate), which STREAM's count (16 B an element for copy,
 * 24 for triad) leaves out. */
static void run_stream(const Job *j) {
    int64_t a = j->first_block * j->block, b = j->last_block * j->block;
    if (a < j->lo) a = j->lo;
    if (b > j->hi) b = j->hi;
    double *restrict x = j->sa;
    const double *restrict y = j->sb, *restrict z = j->sc;
    const double s = j->s;
    if (j->mode == MODE_COPY)
        for (int64_t i = a; i < b; i++) x[i] = y[i];
    else
        for (int64_t i = a; i < b; i++) x[i] = y[i] + s * z[i];
}

static void run_kernel(const Job *j) {
    if (j->mode == MODE_COPY || j->mode == MODE_TRIAD) {
        run_stream(j);
        return;
    }
    switch (isa_in_use()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case ISA_AVX512:
        if (j->mode == MODE_FP32) run_fp32_avx512(j); else if (j->mode == MODE_INT8) run_int8_fast_avx512(j);
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

/* One worker's job; its non-temporal stores, if any, fenced before it counts as done (the caller reads
 * or hands the copies to a DMA after the join). */
static void run(const Job *j) {
    run_kernel(j);
#if defined(__x86_64__) && defined(__GNUC__)
    if (j->stream) _mm_sfence();
#endif
}

/* [Note: the kernels' worker threads]
 * A call steps its range on up to `threads` threads, and starting threads per call cost more than the
 * work at the sizes the engine passes (a sub-group's piece of a few million elements is ~0.1 ms on 16
 * cores; 15 pthread_create/join pairs are several times that, ~47 us each on a 2-core Zen 4, and a
 * fresh thread runs cold). Nor may the kernel's threads compete with torch's: after each parallel
 * torch operation its OpenMP workers spin for a while (libgomp's GOMP_SPINCOUNT), and the update
 * pass interleaves torch operations (copies, tails) with these calls, so threads of our own ran
 * beside spinning ones (the one-pass bf16 step: 0.087 s per 100M against 0.068 for torch's kernel
 * with two conversions on 2 cores; 0.077 against 0.108 with OMP_WAIT_POLICY=passive, which slows
 * torch instead). So a call runs on the calling thread's OpenMP team, torch's own runtime found with
 * dlsym (GOMP_parallel: libgomp's entry point, which LLVM's and Intel's runtimes export too): the
 * threads torch's last operation left spinning take the jobs at once, and nothing else competes.
 * Without such a runtime in the process, and in a forked child (an OpenMP runtime is not fork-safe
 * once its threads exist: a child's first parallel region hung here), threads of the call's own
 * serve, started and joined per call: slower, but only that rare process pays it.
 * `workers(name)` picks one for tests. */
typedef void (*OmpParallel)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*OmpInt)(void);
static OmpParallel omp_parallel;   /* all three NULL: no runtime in the process */
static OmpInt omp_thread_num, omp_num_threads;
static int use_omp = -1;           /* -1: not looked up yet; 0: threads of the call's own; 1: OpenMP */
static pthread_once_t omp_once = PTHREAD_ONCE_INIT;

/* Looked up at the first call, not at import: torch (and its runtime) may load after this module. */
static void omp_lookup(void) {
    omp_parallel = (OmpParallel)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    omp_thread_num = (OmpInt)dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    omp_num_threads = (OmpInt)dlsym(RTLD_DEFAULT, "omp_get_num_threads");
    if (omp_parallel == NULL || omp_thread_num == NULL || omp_num_threads == NULL) omp_parallel = NULL;
    if (use_omp < 0) use_omp = omp_parallel != NULL;    /* a forked child has set 0 already */
}

static int omp_ready(void) {
    pthread_once(&omp_once, omp_lookup);
    return use_omp;
}

typedef struct { const Job *jobs; int count; } OmpWork;

/* Each member of the team takes jobs member, member + team size, ...: all run even with a smaller team. */
static void omp_body(void *arg) {
    const OmpWork *w = arg;
    int size = omp_num_threads();
    for (int t = omp_thread_num(); t < w->count; t += size > 0 ? size : 1) run(&w->jobs[t]);
}

static void *thread_body(void *arg) {
    run((const Job *)arg);
    return NULL;
}

static void after_fork_in_child(void) { use_omp = 0; }

/* Steps base's [lo, hi) in blocks of base->block elements on up to `threads` threads, the GIL released. */
static void run_threaded(const Job *base, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t first = base->lo / base->block, last = (base->hi + base->block - 1) / base->block, nblocks = last - first;
    /* At least 64 blocks of work per thread, or the thread costs more than it saves. */
    int64_t most = nblocks / 64 > 0 ? nblocks / 64 : 1;
    if (threads > most) threads = (int)most;
    Job jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        jobs[t] = *base;
        jobs[t].first_block = first + nblocks * t / threads;
        jobs[t].last_block = first + nblocks * (t + 1) / threads;
    }
    Py_BEGIN_ALLOW_THREADS
    if (threads == 1) {
        run(&jobs[0]);
    } else if (omp_ready()) {
        OmpWork work = {jobs, threads};
        omp_parallel(omp_body, &work, (unsigned)threads, 0);
    } else {
        pthread_t helper[MAX_THREADS];
        int started = 0;   /* helpers 1..started run jobs 1..started */
        while (started + 1 < threads && pthread_create(&helper[started + 1], NULL, thread_body,
                                                       (void *)&jobs[started + 1]) == 0)
            started++;
        run(&jobs[0]);
        for (int t = started + 1; t < threads; t++) run(&jobs[t]);  /* the jobs of threads that did not start */
        for (int t = 1; t <= started; t++) pthread_join(helper[t], NULL);
    }
    Py_END_ALLOW_THREADS
}

/* [Note: raw addresses]
 * The entry points take raw addresses (tensors' data_ptr()) and no owner, so a slip in a caller (0
 * for a tensor without memory, -1, a freed pointer) would crash the process in the middle of a
 * step. Before any work, each span a call touches is checked: it must not start in the null page,
 * must end below the top of the user address space, and its first and last pages must be mapped
 * (mincore, two system calls; the copies' segments, which may be many, get the first two checks
 * only). Alignment is not asked: the int8 scales follow the codes at any byte. Memory that is mapped but belongs to something else cannot be
 * told from here: the Python callers pass data_ptr() and numel() of the same tensors. */
#define NULL_PAGE 4096ULL
#define USER_TOP (1ULL << 57)   /* no Linux user address reaches it (x86-64's five-level paging tops out there) */

static int page_mapped(unsigned long long addr) {
    static long page_size;
    if (page_size == 0) page_size = sysconf(_SC_PAGESIZE);
    unsigned char resident;
    return mincore((void *)(uintptr_t)(addr & ~(unsigned long long)(page_size - 1)), 1, &resident) == 0 ||
           errno != ENOMEM;
}

/* 0 when elements [first, end) of `itemsize` bytes from addr may be touched, else -1 with a ValueError
 * naming the entry point and the argument ([Note: raw addresses]). */
static int check_span(const char *fn, const char *name, unsigned long long addr, long long first, long long end,
                      unsigned itemsize, int probe) {
    if (end <= first) return 0;
    const char *why = NULL;
    if (addr < NULL_PAGE)
        why = "is in the null page (a tensor without memory?)";
    else if (first < 0 || addr >= USER_TOP || (unsigned long long)end > (USER_TOP - addr) / itemsize)
        why = "runs past the user address space";
    else if (probe && (!page_mapped(addr + (unsigned long long)first * itemsize) ||
                       !page_mapped(addr + (unsigned long long)end * itemsize - 1)))
        why = "is not mapped memory (a freed tensor?)";
    if (why == NULL) return 0;
    char message[256];
    snprintf(message, sizeof(message), "%s: %s = %#llx (elements [%lld, %lld) of %u bytes) %s", fn, name, addr,
             first, end, itemsize, why);
    PyErr_SetString(PyExc_ValueError, message);
    return -1;
}

/* outs: a sequence of (start, end, address) with lo <= start < end <= hi, sorted and disjoint, into
 * a new array of *count segments (NULL with *count 0 for none; NULL with an exception set on error). */
static Seg *parse_segments(PyObject *outs, long long lo, long long hi, int fp32, int *count) {
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
        if (check_span("qadam.step", "an output segment's address", addr, 0, b - a, fp32 ? 4 : 2, 0) < 0) goto fail;
        segs[i].start = a; segs[i].end = b;
        segs[i].out = fp32 ? NULL : (uint16_t *)(uintptr_t)addr;
        segs[i].out32 = fp32 ? (float *)(uintptr_t)addr : NULL;
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
    int mode, decoupled, threads, g_bf16 = 0, outs_fp32 = 0;
    long long n, lo, hi, block, step;
    unsigned long long p, g, m, v, ms, vs;
    unsigned int seed;
    double lr, b1, b2, eps, wd, gmul;
    PyObject *outs = NULL;
    if (!PyArg_ParseTuple(args, "iLLLLKKKKKKLddddddpIi|pOp", &mode, &n, &lo, &hi, &block, &p, &g, &m, &v, &ms, &vs,
                          &step, &lr, &b1, &b2, &eps, &wd, &gmul, &decoupled, &seed, &threads, &g_bf16, &outs,
                          &outs_fp32))
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
    /* [Note: raw addresses]. The moments are touched a whole block at a time, an int8 block's scales
     * one per block; bf16 moments have no scales (m_scales and v_scales are 0). */
    const char *fn = "qadam.step";
    long long first = lo / block, last = (hi + block - 1) / block, moments_end = last * block < n ? last * block : n;
    unsigned code = mode == MODE_INT8 ? 1 : 2;
    if (check_span(fn, "p", p, lo, hi, 4, 1) < 0 || check_span(fn, "g", g, lo, hi, g_bf16 ? 2 : 4, 1) < 0 ||
        check_span(fn, "m", m, first * block, moments_end, code, 1) < 0 ||
        check_span(fn, "v", v, first * block, moments_end, code, 1) < 0)
        return NULL;
    if (mode == MODE_INT8 && (check_span(fn, "m_scales", ms, first, last, 4, 1) < 0 ||
                              check_span(fn, "v_scales", vs, first, last, 4, 1) < 0))
        return NULL;
    Seg *segs = parse_segments(outs, lo, hi, outs_fp32, &base.nsegs);
    base.segs_fp32 = outs_fp32;
    if (segs == NULL && PyErr_Occurred()) return NULL;
    base.segs = segs;
    /* p and the moments (bf16: 2 + 2 bytes; int8: 1 + 1), the gradient, the copy */
    base.stream = stream_call(hi - lo, 4 + (mode == MODE_INT8 ? 2 : 4) + (g_bf16 ? 2 : 4) + (outs_fp32 ? 4 : 2),
                              base.nsegs > 0);
    streamed_calls += base.stream;
    run_threaded(&base, threads);
    PyMem_Free(segs);
    Py_RETURN_NONE;
}

/* step_fp32(lo, hi, p, g, g_bf16, m, v, out, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
 *           decoupled, threads, out_fp32=False)
 *
 * [Note: the fused fp32 step]
 * Adam(W) over elements [lo, hi) of fp32 master weights p and fp32 moments m, v, in one pass that
 * also reads the gradient in the compute dtype (bf16 words when g_bf16: the compact gradient of
 * infinity/optim/compact_grads.py, widened exactly in registers) and writes the new weights' bf16
 * copy (out, round to nearest even, as torch's .to(torch.bfloat16); 0 for none). torch's fused
 * kernel takes one dtype, so without this the update made three passes over memory: widen the
 * gradient into an fp32 buffer, step, narrow the weights into the compute copy (46 bytes a
 * parameter moved against 28). With out_fp32 the copy is the new weights themselves, in fp32 (fp32
 * compute with the parameters in host memory: written into their shards while in cache, where a
 * copy afterwards read and wrote them again).
 * The arithmetic is torch's CPU _fused_adam(w)_ kernel's, operation for operation and with its
 * constants rounded from double the same way, so the results are its bit for bit
 * (tests/unit/test_fused_fp32_step.py checks that against the torch installed): the gradient
 * divided by grad_scale (when > 0); AdamW's decay as p * (1 - lr wd), Adam's as fma(p, wd, g); m
 * by lerp towards g, fma((1 - b1), g - m, m); v as fma((1 - b2) g, g, v b2); p - (lr / bc1) m /
 * (sqrt(v) / sqrt(bc2) + eps). The gradient is not written back (torch stores the unscaled one). */
static PyObject *qadam_step_fp32(PyObject *self, PyObject *args) {
    long long lo, hi, step;
    unsigned long long p, g, m, v, out;
    int g_bf16, decoupled, threads, out_fp32 = 0;
    double lr, b1, b2, eps, wd, grad_scale;
    if (!PyArg_ParseTuple(args, "LLKKpKKKLddddddpi|p", &lo, &hi, &p, &g, &g_bf16, &m, &v, &out, &step, &lr, &b1,
                          &b2, &eps, &wd, &grad_scale, &decoupled, &threads, &out_fp32))
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
    if (out_fp32) base.out32 = (float *)(uintptr_t)out; else base.out16 = (uint16_t *)(uintptr_t)out;
    base.stream = stream_call(hi - lo, 12 + (g_bf16 ? 2 : 4) + (out_fp32 ? 4 : 2), out != 0);
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
    const char *fn = "qadam.step_fp32";   /* [Note: raw addresses]; out 0 is "no copy" */
    if (check_span(fn, "p", p, lo, hi, 4, 1) < 0 || check_span(fn, "g", g, lo, hi, g_bf16 ? 2 : 4, 1) < 0 ||
        check_span(fn, "m", m, lo, hi, 4, 1) < 0 || check_span(fn, "v", v, lo, hi, 4, 1) < 0 ||
        (out != 0 && check_span(fn, "out", out, lo, hi, out_fp32 ? 4 : 2, 1) < 0))
        return NULL;
    streamed_calls += base.stream;
    run_threaded(&base, threads);
    Py_RETURN_NONE;
}

/* 1 when [a, a + nbytes) and [b, b + nbytes) share a byte. */
static int overlap(unsigned long long a, unsigned long long b, unsigned long long nbytes) {
    return a < b + nbytes && b < a + nbytes;
}

/* copy(n, a, b, threads), triad(n, a, b, c, s, threads): [Note: the STREAM baselines]. a, b, c: the
 * addresses of n doubles each; a may overlap neither (the loops are restrict). */
static PyObject *stream(int mode, long long n, unsigned long long a, unsigned long long b, unsigned long long c,
                        double s, int threads) {
    const char *fn = mode == MODE_COPY ? "qadam.copy" : "qadam.triad";
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "%s: n=%lld must be >= 0", fn, n);
        return NULL;
    }
    if (n == 0) Py_RETURN_NONE;
    if (check_span(fn, "a", a, 0, n, 8, 1) < 0 || check_span(fn, "b", b, 0, n, 8, 1) < 0 ||
        (mode == MODE_TRIAD && check_span(fn, "c", c, 0, n, 8, 1) < 0))   /* [Note: raw addresses] */
        return NULL;
    unsigned long long nbytes = (unsigned long long)n * 8;
    if (overlap(a, b, nbytes) || (mode == MODE_TRIAD && overlap(a, c, nbytes))) {
        char message[160];
        snprintf(message, sizeof(message), "%s: a = %#llx overlaps %s (%lld doubles each); pass separate arrays",
                 fn, a, overlap(a, b, nbytes) ? "b" : "c", n);
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    }
    Job base = {0};
    base.mode = mode; base.n = n; base.lo = 0; base.hi = n; base.block = CHUNK;
    base.sa = (double *)(uintptr_t)a; base.sb = (const double *)(uintptr_t)b;
    base.sc = (const double *)(uintptr_t)c; base.s = s;
    run_threaded(&base, threads);
    Py_RETURN_NONE;
}

static PyObject *qadam_copy(PyObject *self, PyObject *args) {
    long long n;
    unsigned long long a, b;
    int threads;
    if (!PyArg_ParseTuple(args, "LKKi", &n, &a, &b, &threads)) return NULL;
    return stream(MODE_COPY, n, a, b, 0, 0.0, threads);
}

static PyObject *qadam_triad(PyObject *self, PyObject *args) {
    long long n;
    unsigned long long a, b, c;
    double s;
    int threads;
    if (!PyArg_ParseTuple(args, "LKKKdi", &n, &a, &b, &c, &s, &threads)) return NULL;
    return stream(MODE_TRIAD, n, a, b, c, s, threads);
}

static const char *const isa_names[] = {"auto", "avx512", "avx2", "base"};

/* split_bf16(n, master, copy, remainder, index, cap) -> count
 *
 * The split master's one pass (infinity/optim/split_master.py, [Note: split master]): for each of the n
 * fp32 masters, its bf16 rounding (round to nearest even, a NaN as 0xFFFF, as the kernels' copies) into
 * copy and its low 16 bits into remainder; the elements that (copy << 16) + remainder (the remainder
 * sign-extended, wrapping) does not restore (ties rounded down, most NaNs) are the exceptions: their
 * indices, ascending, go to index while fewer than cap, and their count is returned (more than cap:
 * call again with room for all). Blocks of 64 are converted without branches and rescanned only
 * when one of them does not restore. */
#define SPLIT_BLOCK 64
static PyObject *qadam_split_bf16(PyObject *self, PyObject *args) {
    long long n, cap;
    unsigned long long pm, pc, pr, pi;
    if (!PyArg_ParseTuple(args, "LKKKKL", &n, &pm, &pc, &pr, &pi, &cap)) return NULL;
    if (n < 0 || cap < 0) {
        PyErr_Format(PyExc_ValueError, "qadam.split_bf16: n=%lld and cap=%lld must be >= 0", n, cap);
        return NULL;
    }
    const char *fn = "qadam.split_bf16";   /* [Note: raw addresses] */
    if (check_span(fn, "master", pm, 0, n, 4, 1) < 0 || check_span(fn, "copy", pc, 0, n, 2, 1) < 0 ||
        check_span(fn, "remainder", pr, 0, n, 2, 1) < 0 || check_span(fn, "index", pi, 0, cap, 8, 1) < 0)
        return NULL;
    const uint32_t *restrict master = (const uint32_t *)(uintptr_t)pm;
    uint16_t *restrict copy = (uint16_t *)(uintptr_t)pc;
    int16_t *restrict rem = (int16_t *)(uintptr_t)pr;
    int64_t *restrict index = (int64_t *)(uintptr_t)pi;
    long long count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (long long b0 = 0; b0 < n; b0 += SPLIT_BLOCK) {
        long long len = n - b0 < SPLIT_BLOCK ? n - b0 : SPLIT_BLOCK;
        uint32_t bad = 0;
        for (long long i = 0; i < len; i++) {
            uint32_t u = master[b0 + i];
            uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            uint32_t h = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : rounded;
            int16_t r = (int16_t)(uint16_t)u;
            copy[b0 + i] = (uint16_t)h;
            rem[b0 + i] = r;
            bad |= ((h << 16) + (uint32_t)(int32_t)r) ^ u;
        }
        if (bad == 0) continue;
        for (long long i = 0; i < len; i++) {
            uint32_t u = master[b0 + i];
            if (((uint32_t)copy[b0 + i] << 16) + (uint32_t)(int32_t)rem[b0 + i] != u) {
                if (count < cap) index[count] = b0 + i;
                count++;
            }
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(count);
}

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

/* stream_copies(nbytes=None): the least bytes a call moves for its copies to be stored past the caches
 * (see [Note: copies past the caches]; < 0: never); with nbytes, set it. */
static PyObject *qadam_stream_copies(PyObject *self, PyObject *args) {
    PyObject *arg = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &arg)) return NULL;
    if (arg != Py_None) {
        long long nbytes = PyLong_AsLongLong(arg);
        if (nbytes == -1 && PyErr_Occurred()) return NULL;
        stream_min_bytes = nbytes;
    }
    return PyLong_FromLongLong(stream_min_bytes);
}

/* streamed_calls() -> count: the calls of step and step_fp32 so far that stored their copies past the
 * caches (tests). */
static PyObject *qadam_streamed_calls(PyObject *self, PyObject *args) {
    return PyLong_FromLongLong(streamed_calls);
}

/* workers(name=None): what runs a call's threads ("openmp": the calling thread's OpenMP team; "threads":
 * threads the call starts and joins); with a name, use that from now on ("openmp" only where a runtime
 * was found). For tests. */
static PyObject *qadam_workers(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    omp_ready();
    if (name != NULL) {
        if (strcmp(name, "threads") == 0) {
            use_omp = 0;
        } else if (strcmp(name, "openmp") == 0 && omp_parallel != NULL) {
            use_omp = 1;
        } else {
            PyErr_Format(PyExc_ValueError, "qadam.workers: %s is %s (openmp or threads)", name,
                         strcmp(name, "openmp") == 0 ? "not in this process (no OpenMP runtime found)" : "unknown");
            return NULL;
        }
    }
    return PyUnicode_FromString(use_omp ? "openmp" : "threads");
}

static PyMethodDef methods[] = {
    {"isa", qadam_isa, METH_VARARGS,
     "isa(name=None): the compiled variant in use; with a name (auto, avx512, avx2, base), choose it (tests)"},
    {"workers", qadam_workers, METH_VARARGS,
     "workers(name=None): what runs a call's threads (openmp: the calling thread's OpenMP team; threads: "
     "threads the call starts and joins); with a name, use it (tests)"},
    {"stream_copies", qadam_stream_copies, METH_VARARGS,
     "stream_copies(nbytes=None): the least bytes a call moves (states, gradient, copy) for its copies to be "
     "written by non-temporal stores; with nbytes (< 0: never), set it"},
    {"streamed_calls", qadam_streamed_calls, METH_NOARGS,
     "streamed_calls() -> count: the calls so far that stored their copies past the caches (tests)"},
    {"step", qadam_step, METH_VARARGS,
     "step(mode, n, lo, hi, block, p, g, m, v, m_scales, v_scales, step, lr, beta1, beta2, eps, weight_decay, "
     "grad_mul, decoupled, seed, threads, g_bf16=False, outs=None, outs_fp32=False): Adam over elements [lo, hi) "
     "of a sub-group with compressed moments, the gradient fp32 or bf16 words, the new weights' copies (bf16, or "
     "fp32 with outs_fp32) written into outs' (start, end, address) segments"},
    {"step_fp32", qadam_step_fp32, METH_VARARGS,
     "step_fp32(lo, hi, p, g, g_bf16, m, v, out, step, lr, beta1, beta2, eps, weight_decay, grad_scale, decoupled, "
     "threads, out_fp32=False): torch's fused Adam(W) over fp32 states, the gradient read as fp32 or bf16 and the "
     "copy written (bf16, or fp32 with out_fp32)"},
    {"split_bf16", qadam_split_bf16, METH_VARARGS,
     "split_bf16(n, master, copy, remainder, index, cap) -> count: the split master's bf16 copies, int16 "
     "remainders and exception indices (at most cap written) in one pass"},
    {"copy", qadam_copy, METH_VARARGS,
     "copy(n, a, b, threads): STREAM's copy a = b over n doubles, on the kernels' threads (benchmarks)"},
    {"triad", qadam_triad, METH_VARARGS,
     "triad(n, a, b, c, s, threads): STREAM's triad a = b + s * c over n doubles, on the kernels' threads "
     "(benchmarks)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qadam", "Host Adam kernels (C).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__qadam(void) {
    if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "_qadam: pthread_atfork failed");
        return NULL;
    }
    PyObject *mod = PyModule_Create(&module);
    /* 1: step() takes g_bf16 and outs (an older build refuses them); 2: and outs_fp32. */
    if (mod != NULL && PyModule_AddIntConstant(mod, "STEP_COPIES", 2) < 0) { Py_DECREF(mod); return NULL; }
    /* 1: step_fp32() takes out_fp32 (the copy in fp32). */
    if (mod != NULL && PyModule_AddIntConstant(mod, "STEP_FP32_COPIES", 1) < 0) { Py_DECREF(mod); return NULL; }
    return mod;
}
