/* One pass a pair over CPU tensors: the aggregates `lab.pairing.metrics._table` turns into
 * statistics (see `lab/pairing/cpu_kernel.py`, which builds and calls this).
 *
 * The numbers are those of `metrics._single_core`, the single-pair reference:
 * - values in the compute dtype (fp32; fp64 when either side is fp64), elements not finite on
 *   both sides counted per side and left out of the difference statistics (as zeros);
 * - |b - a| and every product rounded in the compute dtype, then summed in float64;
 * - ULPs counted between both sides rounded to the coarser dtype (fewer mantissa bits), the way
 *   torch's `.to()` rounds: to nearest even, a float64 through float32 first.
 * Each pair is reduced on its own, row by row (_ROW elements a row, summed, then added to the
 * pair's totals), so its numbers do not depend on which other pairs share the call, and the
 * same inputs give the same bits every time (one thread, no reassociation: compiled without
 * -ffast-math and with -ffp-contract=off).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { BF16 = 0, FP16 = 1, FP32 = 2, FP64 = 3 };
enum { ROW = 128, CLASSES = 18, EXP0 = 127 };
/* Output columns a pair: numel, then the sums, then the maxima, in `_COLUMNS` order. */
enum {
    SUM_A = 1, SUM_B, NORM2_A, NORM2_B, SUM_ABS_DIFF, SUM_SQ_DIFF, NOT_BITEXACT, NONFINITE,
    NONFINITE_A, NONFINITE_B,
    MAX_A, MAX_B, MAX_ABS_DIFF, MAX_ULP, MAX_ABS_DIFF_ROUNDED, NEG_MIN_A, NEG_MIN_B,
    OUT_COLUMNS
};

#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float f_from(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint64_t d_bits(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }

INLINE float bf16_value(uint16_t h) { return f_from((uint32_t)h << 16); }

INLINE float fp16_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) {  /* zero or subnormal: mant * 2^-24, exact in float */
        float v = (float)mant * 5.9604644775390625e-08f;
        return f_from(f_bits(v) | sign);
    }
    if (exp == 31) return f_from(sign | 0x7f800000u | (mant << 13));
    return f_from(sign | ((exp + 112) << 23) | (mant << 13));
}

/* float -> bfloat16 bits, to nearest even (NaN to the quiet NaN 0x7fc0). */
INLINE uint16_t bf16_round(float f) {
    uint32_t u = f_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float -> float16 bits, to nearest even; beyond 65520 to Inf; NaN to 0x7e00. */
INLINE uint16_t fp16_round(float f) {
    uint32_t u = f_bits(f), sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | (mag > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (mag < 0x38800000u) {  /* under 2^-14: a subnormal count of 2^-24, rounded to even */
        return (uint16_t)(sign | (uint32_t)nearbyintf(fabsf(f) * 16777216.0f));
    }
    mag += 0xfffu + ((mag >> 13) & 1u);
    return (uint16_t)(sign | ((mag - 0x38000000u) >> 13));
}

INLINE float load_f(const void *p, int64_t i, int code) {
    if (code == BF16) return bf16_value(((const uint16_t *)p)[i]);
    if (code == FP16) return fp16_value(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

INLINE double load_d(const void *p, int64_t i, int code) {
    if (code == FP64) return ((const double *)p)[i];
    return (double)load_f(p, i, code);
}

/* A float rounded to the coarser dtype: its point on the signed line of that dtype's values
 * (-magnitude for negatives, so +0 and -0 meet) and its value back in float. */
INLINE int64_t coarse_line_f(float v, int coarse, float *back) {
    if (coarse == BF16) {
        uint16_t h = bf16_round(v);
        *back = bf16_value(h);
        int64_t mag = h & 0x7fff;
        return (h & 0x8000) ? -mag : mag;
    }
    if (coarse == FP16) {
        uint16_t h = fp16_round(v);
        *back = fp16_value(h);
        int64_t mag = h & 0x7fff;
        return (h & 0x8000) ? -mag : mag;
    }
    *back = v;
    uint32_t u = f_bits(v);
    int64_t mag = u & 0x7fffffffu;
    return (u >> 31) ? -mag : mag;
}

INLINE double max_d(double x, double y) { return y > x ? y : x; }

/* The ULP class of a count: 0 for 0, k for 2^(k-1) <= ulp < 2^k, 17 from 65536 on. `_ulp_rows`
 * reads it off the float32 exponent of the count, which is exact below 2^24; above, both give
 * the last class. */
INLINE int class_of_int(int64_t ulp) {
    if (ulp == 0) return 0;
    int k = 64 - __builtin_clzll((uint64_t)ulp);
    return k < CLASSES - 1 ? k : CLASSES - 1;
}

INLINE int class_of_double(double ulp) { /* an fp64 pair's count, through float32 as torch */
    int e = (int)(f_bits((float)ulp) >> 23);
    if (e < EXP0 - 1) e = EXP0 - 1;
    if (e > EXP0 + CLASSES - 2) e = EXP0 + CLASSES - 2;
    return e - (EXP0 - 1);
}

/* Per-pair totals: the row sums are added to them, the row maxima folded in. */
typedef struct {
    double sum[NONFINITE_B + 1];
    double max[OUT_COLUMNS];
    int64_t classes[4][CLASSES]; /* four copies: successive elements' counts do not chain */
} Acc;

INLINE void acc_init(Acc *acc) {
    memset(acc, 0, sizeof *acc);
    for (int c = MAX_A; c < OUT_COLUMNS; c++) acc->max[c] = -INFINITY;
}

INLINE void acc_finish(const Acc *acc, double *out, int64_t *classes) {
    for (int c = SUM_A; c <= NONFINITE_B; c++) out[c] = acc->sum[c];
    for (int c = MAX_A; c < OUT_COLUMNS; c++) out[c] = acc->max[c];
    for (int k = 0; k < CLASSES; k++)
        classes[k] = acc->classes[0][k] + acc->classes[1][k] + acc->classes[2][k] +
                     acc->classes[3][k];
}

/* Row accumulators, in registers. A masked element (not finite on a side) adds 0 difference,
 * 0 ULPs and a 0 to the side extremes, as the zeros `_stats_from` puts in its place. */
#define ROW_VARS(T)                                                                          \
    double s_a = 0, s_b = 0, n2_a = 0, n2_b = 0, s_d = 0, s_d2 = 0;                          \
    int64_t not_exact = 0, nonfin_a = 0, nonfin_b = 0, nonfin = 0;                           \
    T hi_a = -INFINITY, hi_b = -INFINITY, lo_a = INFINITY, lo_b = INFINITY, hi_d = 0,        \
      hi_r = 0;                                                                              \
    double hi_u = 0;

#define ROW_FOLD(acc)                                                                        \
    do {                                                                                     \
        (acc)->sum[SUM_A] += s_a;                                                            \
        (acc)->sum[SUM_B] += s_b;                                                            \
        (acc)->sum[NORM2_A] += n2_a;                                                         \
        (acc)->sum[NORM2_B] += n2_b;                                                         \
        (acc)->sum[SUM_ABS_DIFF] += s_d;                                                     \
        (acc)->sum[SUM_SQ_DIFF] += s_d2;                                                     \
        (acc)->sum[NOT_BITEXACT] += (double)not_exact;                                       \
        (acc)->sum[NONFINITE] += (double)nonfin;                                             \
        (acc)->sum[NONFINITE_A] += (double)nonfin_a;                                         \
        (acc)->sum[NONFINITE_B] += (double)nonfin_b;                                         \
        if (nonfin) { /* masked elements stand in as zeros */                                \
            hi_a = hi_a > 0 ? hi_a : 0;                                                      \
            hi_b = hi_b > 0 ? hi_b : 0;                                                      \
            lo_a = lo_a < 0 ? lo_a : 0;                                                      \
            lo_b = lo_b < 0 ? lo_b : 0;                                                      \
        }                                                                                    \
        (acc)->max[MAX_A] = max_d((acc)->max[MAX_A], (double)hi_a);                          \
        (acc)->max[MAX_B] = max_d((acc)->max[MAX_B], (double)hi_b);                          \
        (acc)->max[NEG_MIN_A] = max_d((acc)->max[NEG_MIN_A], -(double)lo_a);                 \
        (acc)->max[NEG_MIN_B] = max_d((acc)->max[NEG_MIN_B], -(double)lo_b);                 \
        (acc)->max[MAX_ABS_DIFF] = max_d((acc)->max[MAX_ABS_DIFF], (double)hi_d);            \
        (acc)->max[MAX_ULP] = max_d((acc)->max[MAX_ULP], hi_u);                              \
        (acc)->max[MAX_ABS_DIFF_ROUNDED] = max_d((acc)->max[MAX_ABS_DIFF_ROUNDED], (double)hi_r); \
    } while (0)

/* ---- the float32 path, eight lanes at a time (GCC/Clang vector extensions) ----------------
 * Lane l of a row's accumulators holds elements l, l + 8, ...; each lane adds in order and a
 * row's lanes are summed in lane order, so the result is one fixed order of the same terms. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));
typedef double vd __attribute__((vector_size(64)));
enum { LANES = 8 };
/* ULP thresholds of the histogram bins after the first (`ULP_BIN_EDGES`), and the ULP class
 * each bin's count is reported in (the first class `_CLASS_BIN` maps to that bin). */
static const uint32_t EDGES[8] = {1, 2, 4, 16, 64, 256, 4096, 65536};
static const int EDGE_CLASS[8] = {1, 2, 3, 5, 7, 9, 13, 17};

INLINE vf vsel(vi mask, vf x, vf y) { return (vf)(((vi)x & mask) | ((vi)y & ~mask)); }
INLINE vu usel(vi mask, vu x, vu y) { return (x & (vu)mask) | (y & ~(vu)mask); }
INLINE vf vmax(vf x, vf y) { return vsel(y > x, y, x); }
INLINE vf vmin(vf x, vf y) { return vsel(y < x, y, x); }
INLINE vf vabs(vf x) { return (vf)((vi)x & 0x7fffffff); }

INLINE vf v_bf16_value(vu h) { return (vf)(h << 16); }

INLINE vf v_fp16_value(vu h) {
    vu sign = (h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    vf normal = (vf)(sign | ((exp + 112) << 23) | (mant << 13));
    vf sub = (vf)((vu)(__builtin_convertvector((vi)mant, vf) * 5.9604644775390625e-08f) | sign);
    vf special = (vf)(sign | 0x7f800000u | (mant << 13));
    return vsel((vi)(exp == 0), sub, vsel((vi)(exp == 31), special, normal));
}

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
/* The CPU's own float16 conversions (F16C): exact one way, to nearest even the other, as the
 * portable code below; only faster. */
INLINE vf v_half_value(vh h) { return (vf)_mm256_cvtph_ps((__m128i)h); }
INLINE vh v_half_round(vf v) {
    return (vh)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
INLINE vf v_half_value(vh h) { return v_fp16_value(__builtin_convertvector(h, vu)); }
/* Finite values only (the caller masks the rest). */
INLINE vh v_half_round(vf v) {
    vu u = (vu)v, m = u & 0x7fffffffu, s16 = (u >> 16) & 0x8000u;
    vu normal = ((m + 0xfffu + ((m >> 13) & 1u)) - 0x38000000u) >> 13;
    /* Under 2^-14: adding 0.5 (whose ULP is 2^-24) rounds to a multiple of 2^-24 to even. */
    vu sub = (vu)(vabs(v) + 0.5f) - 0x3f000000u;
    vu mh = usel((vi)(m < 0x38800000u), sub, usel((vi)(m >= 0x477ff000u), (vu){} + 0x7c00u,
                                                         normal));
    return __builtin_convertvector(mh | s16, vh);
}
#endif

INLINE vf v_load(const void *p, int64_t i, int code) {
    if (code == FP32) {
        vf x;
        memcpy(&x, (const float *)p + i, sizeof x);
        return x;
    }
    vh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return code == BF16 ? v_bf16_value(__builtin_convertvector(h, vu)) : v_half_value(h);
}

/* Finite float32 values rounded to the coarser dtype: their magnitude bits and sign there, and
 * the rounded values back in float32 (`coarse_line_f`, eight at a time). */
INLINE void v_coarse(vf v, int coarse, vu *mag, vu *sign, vf *back) {
    vu u = (vu)v;
    if (coarse == FP32) {
        *mag = u & 0x7fffffffu;
        *sign = u >> 31;
        *back = v;
        return;
    }
    vu h;
    if (coarse == BF16) {
        h = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        *back = (vf)(h << 16);
    } else {
        vh h16 = v_half_round(v);
        h = __builtin_convertvector(h16, vu);
        *back = v_half_value(h16);
    }
    *mag = h & 0x7fffu;
    *sign = h >> 15;
}

INLINE double hsum(vd x) {
    double s = 0;
    for (int l = 0; l < LANES; l++) s += x[l];
    return s;
}

INLINE float hmax(vf x) {
    float m = x[0];
    for (int l = 1; l < LANES; l++) m = x[l] > m ? x[l] : m;
    return m;
}

INLINE float hmin(vf x) {
    float m = x[0];
    for (int l = 1; l < LANES; l++) m = x[l] < m ? x[l] : m;
    return m;
}

/* Accumulators of the float32 path: a row's sums and counts, the pair's extremes. */
typedef struct {
    vd s_a, s_b, n2_a, n2_b, s_d, s_d2;
    vi not_exact, nonfin, nonfin_a, nonfin_b;
    vf hi_a, hi_b, lo_a, lo_b, hi_d, hi_r;
    vu hi_u;
    vi ge[8];
} Lanes;

/* Eight elements into the accumulators. `valid` (only for the padded last chunk, `tail`) keeps
 * the padding out of the side extremes; padding is 0 on both sides, which adds nothing else. */
INLINE void chunk(Lanes *x, vf a, vf b, int coarse, int native, int tail, vi valid) {
    vi fin_a = ((vi)a & 0x7f800000) != 0x7f800000;
    vi fin_b = ((vi)b & 0x7f800000) != 0x7f800000;
    vi fin = fin_a & fin_b;
    x->not_exact -= ~((a == b) | ((a != a) & (b != b)));
    x->nonfin -= ~fin;
    x->nonfin_a -= ~fin_a;
    x->nonfin_b -= ~fin_b;
    a = (vf)((vi)a & fin); /* masked elements stand in as zeros */
    b = (vf)((vi)b & fin);
    vf d = vabs(b - a);
    x->s_a += __builtin_convertvector(a, vd);
    x->s_b += __builtin_convertvector(b, vd);
    x->n2_a += __builtin_convertvector(a * a, vd);
    x->n2_b += __builtin_convertvector(b * b, vd);
    x->s_d += __builtin_convertvector(d, vd);
    x->s_d2 += __builtin_convertvector(d * d, vd);
    if (tail) {
        x->hi_a = vmax(x->hi_a, vsel(valid, a, x->hi_a));
        x->hi_b = vmax(x->hi_b, vsel(valid, b, x->hi_b));
        x->lo_a = vmin(x->lo_a, vsel(valid, a, x->lo_a));
        x->lo_b = vmin(x->lo_b, vsel(valid, b, x->lo_b));
    } else {
        x->hi_a = vmax(x->hi_a, a);
        x->hi_b = vmax(x->hi_b, b);
        x->lo_a = vmin(x->lo_a, a);
        x->lo_b = vmin(x->lo_b, b);
    }
    x->hi_d = vmax(x->hi_d, d);
    vu mag_a, mag_b, sg_a, sg_b;
    vf ra, rb;
    if (native && coarse == BF16) { /* both sides bf16 already: their bits, no rounding */
        vu ha = (vu)a >> 16, hb = (vu)b >> 16;
        mag_a = ha & 0x7fffu, mag_b = hb & 0x7fffu, sg_a = ha >> 15, sg_b = hb >> 15;
    } else {
        v_coarse(a, coarse, &mag_a, &sg_a, &ra);
        v_coarse(b, coarse, &mag_b, &sg_b, &rb);
    }
    /* Same sign: the magnitudes' distance; opposite: their sum (< 2^32, exact). */
    vu apart = usel((vi)(mag_a > mag_b), mag_a - mag_b, mag_b - mag_a);
    vu ulp = usel((vi)(sg_a == sg_b), apart, mag_a + mag_b);
    x->hi_u = usel((vi)(ulp > x->hi_u), ulp, x->hi_u);
    if (!native) x->hi_r = vmax(x->hi_r, vabs(rb - ra)); /* native: the difference itself */
    for (int k = 0; k < 8; k++) x->ge[k] -= (vi)(ulp >= EDGES[k]);
}

/* One pair whose compute dtype is float32 (neither side fp64). */
INLINE void pair_f32(const void *pa, const void *pb, int64_t n, int ca, int cb, double *out,
                     int64_t *classes) {
    const int coarse = ca < cb ? ca : cb; /* BF16 < FP16 < FP32: fewer mantissa bits first */
    const int native = ca == cb; /* both sides in the coarser dtype: rounding changes nothing */
    double tot[OUT_COLUMNS] = {0};
    Lanes x = {0};
    x.hi_a = x.hi_b = (vf){} - INFINITY;
    x.lo_a = x.lo_b = (vf){} + INFINITY;
    const vi all = (vi){} - 1;
    int64_t at_least[9] = {0}, rows = 0;
    for (int64_t start = 0; start < n; start += ROW) {
        int64_t end = start + ROW < n ? start + ROW : n;
        x.s_a = x.s_b = x.n2_a = x.n2_b = x.s_d = x.s_d2 = (vd){};
        x.not_exact = x.nonfin = x.nonfin_a = x.nonfin_b = (vi){};
        int64_t i = start;
        for (; i + LANES <= end; i += LANES)
            chunk(&x, v_load(pa, i, ca), v_load(pb, i, cb), coarse, native, 0, all);
        if (i < end) { /* the pair's last elements, padded with zeros */
            float ta[LANES] = {0}, tb[LANES] = {0};
            int32_t tv[LANES] = {0};
            for (int64_t j = i; j < end; j++) {
                ta[j - i] = load_f(pa, j, ca);
                tb[j - i] = load_f(pb, j, cb);
                tv[j - i] = -1;
            }
            vf a, b;
            vi valid;
            memcpy(&a, ta, sizeof a);
            memcpy(&b, tb, sizeof b);
            memcpy(&valid, tv, sizeof valid);
            chunk(&x, a, b, coarse, native, 1, valid);
        }
        tot[SUM_A] += hsum(x.s_a);
        tot[SUM_B] += hsum(x.s_b);
        tot[NORM2_A] += hsum(x.n2_a);
        tot[NORM2_B] += hsum(x.n2_b);
        tot[SUM_ABS_DIFF] += hsum(x.s_d);
        tot[SUM_SQ_DIFF] += hsum(x.s_d2);
        for (int l = 0; l < LANES; l++) {
            tot[NOT_BITEXACT] += x.not_exact[l];
            tot[NONFINITE] += x.nonfin[l];
            tot[NONFINITE_A] += x.nonfin_a[l];
            tot[NONFINITE_B] += x.nonfin_b[l];
        }
        if (++rows == 1 << 16 || start + ROW >= n) { /* int32 lanes: fold long before 2^31 */
            for (int k = 0; k < 8; k++) {
                for (int l = 0; l < LANES; l++) at_least[k] += x.ge[k][l];
                x.ge[k] = (vi){};
            }
            rows = 0;
        }
    }
    for (int c = SUM_A; c <= NONFINITE_B; c++) out[c] = tot[c];
    out[MAX_A] = hmax(x.hi_a);
    out[MAX_B] = hmax(x.hi_b);
    out[NEG_MIN_A] = -(double)hmin(x.lo_a);
    out[NEG_MIN_B] = -(double)hmin(x.lo_b);
    out[MAX_ABS_DIFF] = hmax(x.hi_d);
    out[MAX_ABS_DIFF_ROUNDED] = native ? out[MAX_ABS_DIFF] : hmax(x.hi_r);
    uint32_t top = 0;
    for (int l = 0; l < LANES; l++) top = x.hi_u[l] > top ? x.hi_u[l] : top;
    out[MAX_ULP] = top;
    /* Each bin's count into its first class (`_table` sums classes into bins; class 0 it
     * infers from the finite count). */
    memset(classes, 0, CLASSES * sizeof *classes);
    for (int k = 0; k < 8; k++) classes[EDGE_CLASS[k]] = at_least[k] - at_least[k + 1];
}

/* One pair whose compute dtype is float64 (a side is fp64). */
INLINE void pair_f64(const void *pa, const void *pb, int64_t n, int ca, int cb, double *out,
                     int64_t *classes) {
    const int coarse = ca < cb ? ca : cb;
    Acc acc;
    acc_init(&acc);
    for (int64_t start = 0; start < n; start += ROW) {
        int64_t end = start + ROW < n ? start + ROW : n;
        ROW_VARS(double)
        for (int64_t i = start; i < end; i++) {
            double a = load_d(pa, i, ca), b = load_d(pb, i, cb);
            if (!(isfinite(a) && isfinite(b))) {
                not_exact += !(a == b || (isnan(a) && isnan(b)));
                nonfin += 1;
                nonfin_a += !isfinite(a);
                nonfin_b += !isfinite(b);
                continue;
            }
            not_exact += a != b;
            double d = fabs(b - a);
            s_a += a;
            s_b += b;
            n2_a += a * a;
            n2_b += b * b;
            s_d += d;
            s_d2 += d * d;
            hi_a = a > hi_a ? a : hi_a;
            hi_b = b > hi_b ? b : hi_b;
            lo_a = a < lo_a ? a : lo_a;
            lo_b = b < lo_b ? b : lo_b;
            hi_d = d > hi_d ? d : hi_d;
            double ulp, ra, rb;
            int klass;
            if (coarse == FP64) {
                /* Both fp64: same sign, the magnitudes' difference (exact in int64); opposite
                 * signs, the two magnitudes summed in float64, as `metrics._ulp`. */
                uint64_t ua = d_bits(a), ub = d_bits(b);
                int64_t ma = (int64_t)(ua & 0x7fffffffffffffffull);
                int64_t mb = (int64_t)(ub & 0x7fffffffffffffffull);
                if ((ua >> 63) == (ub >> 63)) ulp = (double)(ma > mb ? ma - mb : mb - ma);
                else ulp = (double)ma + (double)mb;
                klass = class_of_double(ulp);
                ra = a;
                rb = b;
            } else { /* to a 16- or 32-bit dtype: through float32 first, as torch's .to() */
                float fa32, fb32;
                int64_t la = coarse_line_f((float)a, coarse, &fa32);
                int64_t lb = coarse_line_f((float)b, coarse, &fb32);
                int64_t u = la > lb ? la - lb : lb - la;
                ulp = (double)u;
                klass = class_of_int(u);
                ra = fa32;
                rb = fb32;
            }
            hi_u = ulp > hi_u ? ulp : hi_u;
            double r = fabs(rb - ra);
            hi_r = r > hi_r ? r : hi_r;
            acc.classes[i & 3][klass] += 1;
        }
        ROW_FOLD(&acc);
    }
    acc_finish(&acc, out, classes);
}


/* Each dtype pair gets its own loop: the dtype codes are constants in it. */
#define F32(A, B) \
    static void pair_##A##_##B(const void *pa, const void *pb, int64_t n, double *o, int64_t *c) \
    { pair_f32(pa, pb, n, A, B, o, c); }
#define F64(A, B) \
    static void pair_##A##_##B(const void *pa, const void *pb, int64_t n, double *o, int64_t *c) \
    { pair_f64(pa, pb, n, A, B, o, c); }
F32(0, 0) F32(0, 1) F32(0, 2) F64(0, 3)
F32(1, 0) F32(1, 1) F32(1, 2) F64(1, 3)
F32(2, 0) F32(2, 1) F32(2, 2) F64(2, 3)
F64(3, 0) F64(3, 1) F64(3, 2) F64(3, 3)

typedef void (*PairFn)(const void *, const void *, int64_t, double *, int64_t *);
static const PairFn PAIRS[4][4] = {
    {pair_0_0, pair_0_1, pair_0_2, pair_0_3},
    {pair_1_0, pair_1_1, pair_1_2, pair_1_3},
    {pair_2_0, pair_2_1, pair_2_2, pair_2_3},
    {pair_3_0, pair_3_1, pair_3_2, pair_3_3},
};

/* The version `cpu_kernel.py` checks, so a stale build is never called with another layout. */
int64_t lab_stats_layout(void) { return 1000 * OUT_COLUMNS + CLASSES; }

/* Reduce `n_pairs` pairs. Pair p: data at ptr_a[p] / ptr_b[p] (contiguous, numel[p] > 0
 * elements), dtype codes codes[2p] / codes[2p + 1]. Writes out[p * OUT_COLUMNS + ...] (numel,
 * sums, maxima) and classes[p * CLASSES + k]. Returns the index of the first pair with an
 * unknown dtype code, or -1. */
int64_t lab_pair_stats(int64_t n_pairs, const int64_t *ptr_a, const int64_t *ptr_b,
                       const int64_t *numel, const int64_t *codes, double *out,
                       int64_t *classes) {
    for (int64_t p = 0; p < n_pairs; p++) {
        int64_t ca = codes[2 * p], cb = codes[2 * p + 1];
        if (ca < 0 || ca > 3 || cb < 0 || cb > 3) return p;
        double *o = out + p * OUT_COLUMNS;
        memset(o, 0, OUT_COLUMNS * sizeof *o);
        o[0] = (double)numel[p];
        PAIRS[ca][cb]((const void *)(intptr_t)ptr_a[p], (const void *)(intptr_t)ptr_b[p],
                      numel[p], o, classes + p * CLASSES);
    }
    return -1;
}
