/* The two block loops, compiled once per instruction set: qadam.c includes this file with
 * KERNEL(name) and KERNEL_ATTR defined (see there). Plain C loops that gcc vectorizes; each but
 * bf16_span (which says why) mixes no byte or 16-bit stores with float arithmetic (those are widened
 * or narrowed in loops of their own), or gcc would vectorize at the narrow width. */
/* bf16 words of p[0, len) into o: round to nearest even; a NaN becomes 0xFFFF, a NaN, as torch's vector
 * conversion makes it. Through an int32 buffer: a loop that mixes float arithmetic with 16-bit
 * stores is vectorized at the narrow width. Past the caches when the job streams. */
KERNEL_ATTR static void KERNEL(to_bf16)(const Job *j, const float *restrict p, uint16_t *restrict o, int64_t len) {
    uint32_t obuf[CHUNK];
    uint16_t o16[CHUNK];
    for (int64_t c0 = 0; c0 < len; c0 += CHUNK) {
        int64_t n = len - c0 < CHUNK ? len - c0 : CHUNK;
        for (int64_t t = 0; t < n; t++) obuf[t] = bf16_rne(p[c0 + t]);
        if (!j->stream) {
            for (int64_t t = 0; t < n; t++) o[c0 + t] = (uint16_t)obuf[t];
            continue;
        }
        for (int64_t t = 0; t < n; t++) o16[t] = (uint16_t)obuf[t];
        store_past_cache(o + c0, o16, (size_t)n * sizeof(uint16_t));
    }
}

/* The copies of the stepped elements [x, y) of the sub-group (p its master) into the job's output
 * segments that hold them (bf16, or the fp32 values with segs_fp32); *cur is the first segment not wholly before x (this worker's
 * calls come in increasing x). */
KERNEL_ATTR static void KERNEL(write_copies)(const Job *j, int64_t x, int64_t y, int *cur) {
    while (*cur < j->nsegs && j->segs[*cur].end <= x) (*cur)++;
    for (int s = *cur; s < j->nsegs && j->segs[s].start < y; s++) {
        int64_t a = j->segs[s].start > x ? j->segs[s].start : x, b = j->segs[s].end < y ? j->segs[s].end : y;
        if (a < b && j->segs_fp32) put_copy(j, j->segs[s].out32 + (a - j->segs[s].start), j->p + a, (size_t)(b - a) * sizeof(float));
        else if (a < b) KERNEL(to_bf16)(j, j->p + a, j->segs[s].out + (a - j->segs[s].start), b - a);
    }
}

/* Adam on a chunk of bf16 moments (the torch twin's arithmetic, infinity/optim/moments.py): each m and v
 * widened as it is loaded, the new ones rounded stochastically (element index base + i) and narrowed as
 * they are stored, in one loop. Here the narrow vectors cost nothing
 * (gcc steps two float vectors per 16-bit one), where staging the chunk through float and int buffers, a
 * loop each, took 1.3x the time in cache and 1.6x on 2 threads over 20M elements (the same bits;
 * AVX-512 on a Zen 4).
 * decoupled is a constant where run_bf16 calls it: one loop without branches each. */
__attribute__((always_inline)) KERNEL_ATTR static inline void KERNEL(bf16_span)(
        Hyper h, int64_t len, uint32_t base, float *restrict p, const float *restrict g, uint16_t *restrict m16,
        uint16_t *restrict v16, uint32_t sm, uint32_t sv, const int decoupled) {
    float c1 = 1.0f - h.b1, c2 = 1.0f - h.b2;
    /* i in 32 bits (len <= CHUNK), and the hashed index (base + i) INDEX_MUL stepped by INDEX_MUL: 32-bit
     * induction variables, where a 64-bit index was stepped in 64-bit lanes, narrowed and multiplied each
     * iteration (0.549 -> 0.471 ns per element, 1 thread, 64Ki elements in cache, AVX-512 on a Zen 4) */
    uint32_t index_mul = base * INDEX_MUL;
    for (uint32_t i = 0; i < (uint32_t)len; i++, index_mul += INDEX_MUL) {
        float mo = as_float((int32_t)((uint32_t)m16[i] << 16)), vo = as_float((int32_t)((uint32_t)v16[i] << 16));
        float pi = decoupled ? p[i] * h.decay : p[i];
        float gi = decoupled ? g[i] * h.gmul : g[i] * h.gmul + h.wd * p[i];
        float mi = h.b1 * mo + c1 * gi;
        float vi = h.b2 * vo + c2 * gi * gi;
        float wi = sqrtf(vi);
        p[i] = pi - h.step_size * mi / (wi * h.inv_bc2_sqrt + h.eps);
        m16[i] = (uint16_t)bf16_sr(mi, sm, index_mul);
        v16[i] = (uint16_t)bf16_sr(vi, sv, index_mul);
    }
}

KERNEL_ATTR static void KERNEL(run_bf16)(const Job *j) {
    Hyper h = hyper_of(j);
    uint16_t *restrict m16 = (uint16_t *)j->m, *restrict v16 = (uint16_t *)j->v;
    int64_t a = j->first_block * j->block, b = j->last_block * j->block;
    if (a < j->lo) a = j->lo;
    if (b > j->hi) b = j->hi;
    uint32_t sm = j->seed, sv = j->seed ^ 0x5BD1E995u;
    float fg[CHUNK];
    int cur = 0;
    for (int64_t c0 = a; c0 < b; c0 += CHUNK) {
        int64_t len = b - c0 < CHUNK ? b - c0 : CHUNK;
        const float *g = j->g + c0;
        if (j->g16 != NULL) {
            for (int64_t t = 0; t < len; t++) fg[t] = as_float((int32_t)((uint32_t)j->g16[c0 + t] << 16));
            g = fg;
        }
        if (h.decoupled) KERNEL(bf16_span)(h, len, (uint32_t)c0, j->p + c0, g, m16 + c0, v16 + c0, sm, sv, 1);
        else KERNEL(bf16_span)(h, len, (uint32_t)c0, j->p + c0, g, m16 + c0, v16 + c0, sm, sv, 0);
        if (j->nsegs) KERNEL(write_copies)(j, c0, c0 + len, &cur);
    }
}

/* Scratch of one int8 block: its decoded moments, widened gradient and codes. */
typedef struct { float fm[MAX_BLOCK], fw[MAX_BLOCK], fg[MAX_BLOCK]; int32_t cm[MAX_BLOCK], cv[MAX_BLOCK]; } KERNEL(Scratch);

/* Adam on elements [u0, u1) of an int8 block (fm, fw its decoded m and w = sqrt(v), replaced by the new
 * ones); the largest magnitudes into *im, *iw. decoupled is a constant where int8_block calls it: one
 * loop without branches each. */
__attribute__((always_inline)) KERNEL_ATTR static inline void KERNEL(int8_adam)(
        Hyper h, int64_t u0, int64_t u1, float *restrict p, const float *restrict g, float *restrict fm,
        float *restrict fw, int32_t *im_out, int32_t *iw_out, const int decoupled) {
    float c1 = 1.0f - h.b1, c2 = 1.0f - h.b2;
    int32_t im = *im_out, iw = *iw_out;
    for (int64_t t = u0; t < u1; t++) {
        float pi = decoupled ? p[t] * h.decay : p[t];
        float gi = decoupled ? g[t] * h.gmul : g[t] * h.gmul + h.wd * p[t], wo = fw[t];
        float mi = h.b1 * fm[t] + c1 * gi;
        float vi = h.b2 * (wo * wo) + c2 * gi * gi;
        float wi = sqrtf(vi);
        p[t] = pi - h.step_size * mi / (wi * h.inv_bc2_sqrt + h.eps);
        fm[t] = mi; fw[t] = wi;
        int32_t a = as_int(mi) & 0x7FFFFFFF, b = as_int(wi) & 0x7FFFFFFF;
        im = a > im ? a : im;
        iw = b > iw ? b : iw;
    }
    *im_out = im;
    *iw_out = iw;
}

/* Block k of an int8 job: decode, Adam on its elements in [lo, hi), the copies, re-encode. */
KERNEL_ATTR static void KERNEL(int8_block)(const Job *j, Hyper h, int64_t k, int *cur, KERNEL(Scratch) *sc) {
    float *restrict fm = sc->fm, *restrict fw = sc->fw, *restrict fg = sc->fg;
    int32_t *restrict cm = sc->cm, *restrict cv = sc->cv;
    const float inv_top = 1.0f / CODE_TOP;
    int64_t b0 = k * j->block, b1 = b0 + j->block;
    if (b1 > j->n) b1 = j->n;
    int64_t len = b1 - b0;
    uint8_t *restrict mc = j->m + b0;
    uint8_t *restrict vc = j->v + b0;
    float dm = j->ms[k] * inv_top, dw = j->vs[k] * inv_top;
    for (int64_t t = 0; t < len; t++) {     /* widened first, as the codes are narrowed last */
        cm[t] = mc[t];
        cv[t] = vc[t];
    }
    for (int64_t t = 0; t < len; t++) {
        int32_t c = cm[t];
        /* the sign bit goes straight to the float's: no negation, no select */
        fm[t] = as_float(as_int(decode_mag(c & 0x7F, 4, 7)) | (c & 0x80) << 24) * dm;
        fw[t] = decode_mag(cv[t], 4, 15) * dw;
    }
    int64_t u0 = j->lo > b0 ? j->lo - b0 : 0, u1 = j->hi < b1 ? j->hi - b0 : len;
    float *restrict p = j->p + b0;
    if (j->g16 != NULL)     /* bf16 words, widened exactly */
        for (int64_t t = u0; t < u1; t++) fg[t] = as_float((int32_t)((uint32_t)j->g16[b0 + t] << 16));
    const float *restrict g = j->g16 != NULL ? fg : j->g + b0;
    /* Adam on the block's elements in [lo, hi), v from w = sqrt(v) as stored; the new largest
     * magnitudes as integers on the way (non-negative floats order like their bit patterns, and an
     * integer max reduction vectorizes without -ffast-math; a NaN of either sign is the largest, as
     * torch's amax in the twin makes it). */
    int32_t im = 0, iw = 0;
    if (h.decoupled) KERNEL(int8_adam)(h, u0, u1, p, g, fm, fw, &im, &iw, 1);
    else KERNEL(int8_adam)(h, u0, u1, p, g, fm, fw, &im, &iw, 0);
    if (j->nsegs) KERNEL(write_copies)(j, b0 + u0, b0 + u1, cur);
    if (u0 > 0 || u1 < len) {   /* a block partly outside [lo, hi): its other elements count too */
        for (int64_t t = 0; t < len; t++) {
            int32_t a = as_int(fm[t]) & 0x7FFFFFFF, b = as_int(fw[t]) & 0x7FFFFFFF;
            im = a > im ? a : im;
            iw = b > iw ? b : iw;
        }
    }
    float am = as_float(im), aw = as_float(iw);
    float qm = am > 0.0f ? CODE_TOP / am : 0.0f, qw = aw > 0.0f ? CODE_TOP / aw : 0.0f;
    /* Codes as int32 first, then narrowed in a loop of their own: a loop that mixes float
     * arithmetic with byte stores is vectorized at the byte width (4 floats a vector). */
    for (int64_t t = 0; t < len; t++) {
        float x = fm[t];
        int32_t c = encode_mag(fabsf(x * qm), 4, 7, 0x7F);     /* |.| after: 0 * inf is a NaN with its sign set */
        /* x's sign bit; one zero: a -0 code would not re-encode alike */
        cm[t] = c | ((int32_t)((uint32_t)as_int(x) >> 31) & (c != 0)) << 7;
        int32_t cw = encode_mag(fabsf(fw[t] * qw), 4, 15, 0xFF);   /* |.|: a NaN of either sign codes top */
        cv[t] = cw + ((cw == 0) & (fw[t] > 0.0f));   /* a positive w never becomes 0 */
    }
    for (int64_t t = 0; t < len; t++) {
        mc[t] = (uint8_t)cm[t];
        vc[t] = (uint8_t)cv[t];
    }
    j->ms[k] = am;
    j->vs[k] = aw;
}

/* (AVX2 runs run_int8_fast_avx2 instead, see [Note: the int8 block in AVX2] in qadam.c.) */
KERNEL_ATTR __attribute__((unused)) static void KERNEL(run_int8)(const Job *j) {
    Hyper h = hyper_of(j);
    KERNEL(Scratch) sc;
    int cur = 0;
    for (int64_t k = j->first_block; k < j->last_block; k++) KERNEL(int8_block)(j, h, k, &cur, &sc);
}


/* MODE_FP32 (see [Note: the fused fp32 step] in qadam.c): elements [lo, hi) in chunks that stay in
 * the L1/L2: the gradient widened (and unscaled) into a float chunk when it is bf16 or scaled, the
 * step, the copy narrowed. Each variant of the arithmetic is a loop of its own, without branches, so
 * that gcc vectorizes it. */
KERNEL_ATTR static void KERNEL(fp32_span)(const Job *j, int64_t len, float *restrict p, const float *restrict g,
                                          float *restrict m, float *restrict v) {
    const float b1c = j->T.b1c, b2 = j->T.b2, b2c = j->T.b2c, eps = j->T.eps, decay = j->T.decay, wd = j->T.wd;
    const float step_size = j->T.step_size, bc2_sqrt = j->T.bc2_sqrt;
    /* torch's lerp(m, g, w): fma(w, g - m, m) when |w| < 0.5, else fma(w - 1, g - m, g) */
    if (fabsf(b1c) >= 0.5f) {
        const float coeff = b1c - 1.0f;
        for (int64_t t = 0; t < len; t++) {
            float gi = g[t], pi = p[t];
            if (j->wd != 0.0f) {
                if (j->decoupled) pi = pi * decay;
                else gi = fmaf(pi, wd, gi);
            }
            float mi = fmaf(coeff, gi - m[t], gi);
            float vi = fmaf(b2c * gi, gi, v[t] * b2);
            m[t] = mi;
            v[t] = vi;
            p[t] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        }
        return;
    }
    if (j->decoupled || j->wd == 0.0f) {
        /* AdamW, or no decay at all (then decay is exactly 1 and p * 1 is p) */
        const float d = j->decoupled ? decay : 1.0f;
        for (int64_t t = 0; t < len; t++) {
            float gi = g[t], pi = p[t] * d, mo = m[t];
            float mi = fmaf(b1c, gi - mo, mo);
            float vi = fmaf(b2c * gi, gi, v[t] * b2);
            m[t] = mi;
            v[t] = vi;
            p[t] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        }
    } else {
        for (int64_t t = 0; t < len; t++) {
            float pi = p[t], gi = fmaf(pi, wd, g[t]), mo = m[t];
            float mi = fmaf(b1c, gi - mo, mo);
            float vi = fmaf(b2c * gi, gi, v[t] * b2);
            m[t] = mi;
            v[t] = vi;
            p[t] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        }
    }
}

/* The common case of a bf16 compute dtype, fused: AdamW (or no decay) with lerp's small-weight form, the
 * gradient as bf16 words and no scale, the copy as bf16: the gradient widened as it is loaded and the new
 * weights narrowed as they are stored, in the step's loop, where staging each chunk through a float
 * buffer and an int buffer took two more loops over it. The same operations on the same values as
 * fp32_span and to_bf16, so the same bits. */
KERNEL_ATTR static void KERNEL(fp32_span_bf16)(const Job *j, int64_t len, float *restrict p,
                                               const uint16_t *restrict g16, float *restrict m, float *restrict v,
                                               uint16_t *restrict o) {
    const float b1c = j->T.b1c, b2 = j->T.b2, b2c = j->T.b2c, eps = j->T.eps;
    const float step_size = j->T.step_size, bc2_sqrt = j->T.bc2_sqrt;
    const float d = j->decoupled ? j->T.decay : 1.0f;
    for (int64_t t = 0; t < len; t++) {
        float gi = as_float((int32_t)((uint32_t)g16[t] << 16)), pi = p[t] * d, mo = m[t];
        float mi = fmaf(b1c, gi - mo, mo);
        float vi = fmaf(b2c * gi, gi, v[t] * b2);
        m[t] = mi;
        v[t] = vi;
        float pn = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        p[t] = pn;
        o[t] = (uint16_t)bf16_rne(pn);
    }
}

KERNEL_ATTR static void KERNEL(run_fp32)(const Job *j) {
    int64_t a = j->first_block * j->block, b = j->last_block * j->block;
    if (a < j->lo) a = j->lo;
    if (b > j->hi) b = j->hi;
    const float scale = j->T.scale;
    /* fp32_span's second loop, with its inputs and outputs in bf16 */
    const int fused = j->g16 != NULL && j->out16 != NULL && !j->T.has_scale && fabsf(j->T.b1c) < 0.5f &&
                      (j->decoupled || j->wd == 0.0f);
    float gbuf[CHUNK];
    uint16_t o16[CHUNK];    /* a streaming job's copy, in cache before it goes out */
    for (int64_t c0 = a; c0 < b; c0 += CHUNK) {
        int64_t len = b - c0 < CHUNK ? b - c0 : CHUNK;
        float *restrict p = j->p + c0;
        if (fused) {
            uint16_t *o = j->stream ? o16 : j->out16 + c0;
            KERNEL(fp32_span_bf16)(j, len, p, j->g16 + c0, (float *)j->m + c0, (float *)j->v + c0, o);
            if (j->stream) store_past_cache(j->out16 + c0, o16, (size_t)len * sizeof(uint16_t));
            continue;
        }
        const float *g = j->g + c0;
        if (j->g16 != NULL) {
            const uint16_t *restrict g16 = j->g16 + c0;
            for (int64_t t = 0; t < len; t++) gbuf[t] = as_float((int32_t)((uint32_t)g16[t] << 16));
            if (j->T.has_scale)
                for (int64_t t = 0; t < len; t++) gbuf[t] = gbuf[t] / scale;
            g = gbuf;
        } else if (j->T.has_scale) {
            for (int64_t t = 0; t < len; t++) gbuf[t] = g[t] / scale;
            g = gbuf;
        }
        KERNEL(fp32_span)(j, len, p, g, (float *)j->m + c0, (float *)j->v + c0);
        if (j->out16 != NULL) KERNEL(to_bf16)(j, p, j->out16 + c0, len);
        if (j->out32 != NULL) put_copy(j, j->out32 + c0, p, (size_t)len * sizeof(float));   /* p still in cache */
    }
}
