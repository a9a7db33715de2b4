/* Block-FP8 -> channel-FP8 / bf16 and bf16 -> channel-FP8 conversion kernels, built on first use by native.py.
 *
 * Every function works on output rows [r0, r1), so Python threads can split one tensor (ctypes
 * drops the GIL during the call). The arithmetic is the arithmetic of numerics.py, operation for
 * operation, so results are bit-identical to it (checked when the library is loaded, and in the
 * tests):
 *   dequant = fp32(w) * scale_inv[row / bn][col / bk]        (one IEEE fp32 multiply)
 *   channel scale = max|dequant of row| / fp8_max, 1.0 where that is not > 0
 *   q = e4m3fn(clamp(dequant / channel scale, -fp8_max, fp8_max))   (IEEE divide, round to nearest even)
 *   and, for a target without -0 (zero_sign 0, gaudi2), a zero q written +0 whatever its sign
 * A bf16 source weight takes the place of the dequant: its fp32 widening is exact.
 * Build with -ffp-contract=off and never -ffast-math: each operation must round exactly as torch's.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

/* e4m3fn -> fp32, exact. Values 8..126 of the low 7 bits are normal (exponent bias 7 vs 127),
 * 1..7 subnormal (m * 2^-9), 0x7F NaN (torch decodes it as 0x7FF00000, sign kept). */
static inline float decode_e4m3fn(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t em = b & 0x7Fu;
    uint32_t normal = (em << 20) + (120u << 23);
    uint32_t subnormal = bits_of((float)em * 0.001953125f);
    uint32_t r = em < 8u ? subnormal : normal;
    r = em == 0x7Fu ? 0x7FF00000u : r;
    return float_of(r | sign);
}

/* fp32 -> e4m3fn, round to nearest even, for |x| <= 448 or NaN (the caller clamps). A zero keeps
 * its sign bit only where zero_sign is 0x80; 0 writes every zero as +0. */
static inline uint8_t encode_e4m3fn(float x, uint32_t zero_sign) {
    uint32_t b = bits_of(x);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    /* Below 2^-6 (e4m3's smallest normal): adding 2^14 makes the FPU round onto the 2^-9 grid. */
    uint32_t subnormal = bits_of(float_of(a) + 16384.0f) - (141u << 23);
    /* Normal: rebias the exponent, round the 23-bit mantissa to 3 bits, ties to even. */
    uint32_t normal = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    uint32_t r = a < (121u << 23) ? subnormal : normal;
    r = a > 0x7F800000u ? 0x7Fu : r;
    sign &= r ? 0x80u : zero_sign;
    return (uint8_t)(r | sign);
}

/* bf16 -> fp32, exact: the bf16 bits are the high half of the fp32 bits. */
static inline float widen_bf16(uint16_t b) { return float_of((uint32_t)b << 16); }

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 as torch's scalar conversion. */
static inline uint16_t encode_bf16(float x) {
    uint32_t u = bits_of(x);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return x != x ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

/* Per-row channel scales. |fp32(w) * s| is monotone in |w| for a fixed s (IEEE rounding is
 * monotone and sign-symmetric), and the low 7 bits of an e4m3fn byte order its magnitude (0x7F,
 * NaN, last), so each block's largest |dequant| is that of its largest byte: one byte max per
 * element, one multiply per block. Scales must be finite (the converter checks them first). */
void mla_row_scales(const uint8_t *restrict w, const float *restrict s, int64_t k, int64_t bn, int64_t bk, float fp8_max,
                    float *restrict scale_out, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * k;
        const float *srow = s + (r / bn) * gk;
        float amax = 0.0f;
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            uint8_t m = 0;
            for (int64_t j = j0; j < j1; j++) {
                uint8_t v = row[j] & 0x7Fu;
                m = v > m ? v : m;
            }
            float sc = srow[c] < 0.0f ? -srow[c] : srow[c];
            float v = decode_e4m3fn(m) * sc;
            amax = (v > amax || v != v) ? v : amax; /* NaN sticks, as in torch's amax */
        }
        float scale = amax / fp8_max;
        scale_out[r] = scale > 0.0f ? scale : 1.0f;
    }
}

#if defined(__AVX2__)
#include <immintrin.h>
/* The same decode / scale / clamp / encode as the scalar loop below, 32 elements at a time with
 * AVX2 (gcc's auto-vectorized version spends most of its time widening and narrowing). */
static inline __m256 decode8_avx2(const uint8_t *p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
    const __m256i subnormal =
        _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0.001953125f)));
    __m256i r = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FF00000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
    return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

/* e4m3fn codes in the low byte of each lane. plus_zero (a constant at every call, so the compiler
 * drops what it does not need): a zero lane loses its sign bit, as encode_e4m3fn's zero_sign 0. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
ALWAYS_INLINE __m256i encode8_avx2(__m256 x, const int plus_zero) {
    const __m256i b = _mm256_castps_si256(x);
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
    const __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i subnormal = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f))),
        _mm256_set1_epi32(141 << 23));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((int32_t)(0x7FFFFu - (120u << 23)))), odd), 20);
    __m256i r = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
    if (plus_zero)
        sign = _mm256_andnot_si256(_mm256_cmpeq_epi32(r, _mm256_setzero_si256()), sign);
    return _mm256_or_si256(r, sign);
}

ALWAYS_INLINE __m256i quantize8_avx2(const uint8_t *p, __m256 sb, __m256 rs, __m256 hi, __m256 lo, const int pz) {
    __m256 x = _mm256_div_ps(_mm256_mul_ps(decode8_avx2(p), sb), rs);
    x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ)); /* NaN compares false: stays NaN */
    x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return encode8_avx2(x, pz);
}

/* 32 codes, one per 32-bit lane of q0..q3 in element order, stored as 32 bytes. */
static inline void store32_avx2(uint8_t *dst, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    /* packs work within 128-bit lanes; the permute restores element order */
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(q0, q1), _mm256_packus_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* Elements [0, n - n % 32) of one block row; returns how many it did. Called with a constant pz. */
ALWAYS_INLINE int64_t quantize_span_avx2(const uint8_t *src, uint8_t *dst, int64_t n, float sb, float rs,
                                         float fp8_max, const int pz) {
    const __m256 vsb = _mm256_set1_ps(sb), vrs = _mm256_set1_ps(rs);
    const __m256 hi = _mm256_set1_ps(fp8_max), lo = _mm256_set1_ps(-fp8_max);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        store32_avx2(dst + j, quantize8_avx2(src + j, vsb, vrs, hi, lo, pz),
                     quantize8_avx2(src + j + 8, vsb, vrs, hi, lo, pz),
                     quantize8_avx2(src + j + 16, vsb, vrs, hi, lo, pz),
                     quantize8_avx2(src + j + 24, vsb, vrs, hi, lo, pz));
    return j;
}

/* The bf16 row's version: widen, divide by the row scale, clamp, encode. */
ALWAYS_INLINE __m256i quantize8_bf16_avx2(const uint16_t *p, __m256 rs, __m256 hi, __m256 lo, const int pz) {
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    __m256 x = _mm256_div_ps(_mm256_castsi256_ps(wide), rs);
    x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return encode8_avx2(x, pz);
}

ALWAYS_INLINE int64_t quantize_bf16_span_avx2(const uint16_t *src, uint8_t *dst, int64_t n, float rs, float fp8_max,
                                              const int pz) {
    const __m256 vrs = _mm256_set1_ps(rs), hi = _mm256_set1_ps(fp8_max), lo = _mm256_set1_ps(-fp8_max);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        store32_avx2(dst + j, quantize8_bf16_avx2(src + j, vrs, hi, lo, pz),
                     quantize8_bf16_avx2(src + j + 8, vrs, hi, lo, pz),
                     quantize8_bf16_avx2(src + j + 16, vrs, hi, lo, pz),
                     quantize8_bf16_avx2(src + j + 24, vrs, hi, lo, pz));
    return j;
}
#endif

void mla_quantize_rows(const uint8_t *restrict w, const float *restrict s, const float *restrict scale, int64_t k, int64_t bn, int64_t bk,
                       float fp8_max, uint32_t zero_sign, uint8_t *restrict out, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * k;
        uint8_t *orow = out + r * k;
        const float *srow = s + (r / bn) * gk;
        const float rs = scale[r];
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
            int64_t j = j0;
#if defined(__AVX2__)
            j += zero_sign ? quantize_span_avx2(row + j0, orow + j0, j1 - j0, sb, rs, fp8_max, 0)
                           : quantize_span_avx2(row + j0, orow + j0, j1 - j0, sb, rs, fp8_max, 1);
#endif
            for (; j < j1; j++) {
                float x = decode_e4m3fn(row[j]) * sb;
                x = x / rs;
                x = x < -fp8_max ? -fp8_max : x; /* comparisons leave NaN as it is, like torch's clamp */
                x = x > fp8_max ? fp8_max : x;
                orow[j] = encode_e4m3fn(x, zero_sign);
            }
        }
    }
}

/* Per-row channel scales of a bf16 weight. Its low 15 bits order |x| (Inf above the finite
 * values, NaN above Inf), so the row's largest |x| is the widening of its largest (bits & 0x7FFF):
 * NaN sticks, as in torch's amax. */
void mla_bf16_row_scales(const uint16_t *restrict w, int64_t k, float fp8_max, float *restrict scale_out, int64_t r0,
                         int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = w + r * k;
        uint16_t m = 0;
        for (int64_t j = 0; j < k; j++) {
            uint16_t v = row[j] & 0x7FFFu;
            m = v > m ? v : m;
        }
        float scale = widen_bf16(m) / fp8_max;
        scale_out[r] = scale > 0.0f ? scale : 1.0f;
    }
}

void mla_bf16_quantize_rows(const uint16_t *restrict w, const float *restrict scale, int64_t k, float fp8_max,
                            uint32_t zero_sign, uint8_t *restrict out, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = w + r * k;
        uint8_t *orow = out + r * k;
        const float rs = scale[r];
        int64_t j = 0;
#if defined(__AVX2__)
        j += zero_sign ? quantize_bf16_span_avx2(row, orow, k, rs, fp8_max, 0)
                       : quantize_bf16_span_avx2(row, orow, k, rs, fp8_max, 1);
#endif
        for (; j < k; j++) {
            float x = widen_bf16(row[j]) / rs;
            x = x < -fp8_max ? -fp8_max : x;
            x = x > fp8_max ? fp8_max : x;
            orow[j] = encode_e4m3fn(x, zero_sign);
        }
    }
}

void mla_bf16_rows(const uint8_t *restrict w, const float *restrict s, int64_t k, int64_t bn, int64_t bk,
                   uint16_t *restrict out, int64_t r0,
                   int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * k;
        uint16_t *orow = out + r * k;
        const float *srow = s + (r / bn) * gk;
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
            for (int64_t j = j0; j < j1; j++)
                orow[j] = encode_bf16(decode_e4m3fn(row[j]) * sb);
        }
    }
}

/* fp32(w) * s block-wise, rows [r0, r1): the exact dequant of numerics.dequantize_block_fp8. */
void mla_dequant_rows(const uint8_t *restrict w, const float *restrict s, int64_t k, int64_t bn, int64_t bk,
                      float *restrict out, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * k;
        float *orow = out + r * k;
        const float *srow = s + (r / bn) * gk;
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
            for (int64_t j = j0; j < j1; j++)
                orow[j] = decode_e4m3fn(row[j]) * sb;
        }
    }
}

/* fp32(w) of elements [i0, i1): torch's w.float(), which is scalar (slow) on CPUs without AVX-512. */
void mla_decode_e4m3fn(const uint8_t *restrict w, float *restrict out, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        out[i] = decode_e4m3fn(w[i]);
}

/* Per row of an e4m3fn matrix, the largest magnitude code (byte & 0x7F; 0x7F is NaN): verify's
 * range, NaN and row-max checks all read off it, without decoding a single element. */
void mla_row_max_code(const uint8_t *restrict w, int64_t k, uint8_t *restrict out, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * k;
        uint8_t m = 0;
        for (int64_t j = 0; j < k; j++) {
            uint8_t v = row[j] & 0x7Fu;
            m = v > m ? v : m;
        }
        out[r] = m;
    }
}

/* How many elements x have (x & mask) == value: Inf or NaN (every exponent bit set) with mask =
 * value = 0x7F80 (bf16), 0x7C00 (f16) or 0x7F800000 (f32); one e4m3fn code (verify: -0, 0x80, in a
 * gaudi2 output) with mask 0xFF. Counted in 32-bit lanes per 64K-element stretch so the loop
 * vectorizes. */
#define COUNT_MATCHING(name, type)                                                          \
    int64_t name(const type *restrict x, int64_t n, type mask, type value) {               \
        int64_t found = 0;                                                                  \
        for (int64_t i0 = 0; i0 < n; i0 += 65536) {                                         \
            int64_t i1 = i0 + 65536 < n ? i0 + 65536 : n;                                   \
            uint32_t c = 0;                                                                 \
            for (int64_t i = i0; i < i1; i++) c += (uint32_t)((x[i] & mask) == value);     \
            found += c;                                                                     \
        }                                                                                   \
        return found;                                                                       \
    }
COUNT_MATCHING(mla_count_matching8, uint8_t)
COUNT_MATCHING(mla_count_matching16, uint16_t)
COUNT_MATCHING(mla_count_matching32, uint32_t)

/* verify --source for a channel-FP8 weight (q, per-row scale sc) against its block-FP8 source
 * (w, s), rows [r0, r1), in one pass: x = fp32(w) * s (exact source dequant), f = fp32(q) * sc,
 * d = f - x, allowed = |x| * rel + sc * half_step, all in fp32 as verify/bounds.py does in torch.
 * Per row: sums of d^2, x^2, f^2 (8 float lanes per block, then double), max |d|, max |d| / allowed,
 * how many elements are out of bound (not |d| / allowed <= 1, so NaN counts) and the first one's
 * column (-1: none), and max |x|. NaN sticks in every max. */
#define LANES 8
static inline float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

/* One element into lane accumulators (separate lanes, so the compiler needs no reassociation). */
static inline void bound_step(float x, float f, float rel, float floor_err, float *dd, float *xx, float *yy,
                              float *mabs, float *mratio, float *ax, int32_t *bad) {
    float d = f - x;
    float adx = x < 0.0f ? -x : x, ad = d < 0.0f ? -d : d;
    float ratio = ad / (adx * rel + floor_err);
    *dd += d * d;
    *xx += x * x;
    *yy += f * f;
    *mabs = nan_max(*mabs, ad);
    *mratio = nan_max(*mratio, ratio);
    *ax = nan_max(*ax, adx);
    *bad += !(ratio <= 1.0f);
}

/* A block's row segment decoded first (plain loops the compiler vectorizes), then the lane loop. */
#define SEGMENT 256
void mla_fp8_bound_rows(const uint8_t *restrict q, const float *restrict sc, const uint8_t *restrict w,
                        const float *restrict s, int64_t k, int64_t bn, int64_t bk, float rel, float half_step,
                        double *restrict dd, double *restrict xx, double *restrict yy, float *restrict max_abs,
                        float *restrict max_ratio, int64_t *restrict n_bad, int64_t *restrict first_bad,
                        float *restrict amax_x, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *qrow = q + r * k, *wrow = w + r * k;
        const float *srow = s + (r / bn) * gk;
        const float rs = sc[r], floor_err = rs * half_step;
        double sdd = 0.0, sxx = 0.0, syy = 0.0;
        float mabs = 0.0f, mratio = 0.0f, ax = 0.0f;
        int64_t nb = 0, fb = -1;
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
            float ldd[LANES] = {0}, lxx[LANES] = {0}, lyy[LANES] = {0};
            float labs[LANES] = {0}, lratio[LANES] = {0}, lax[LANES] = {0};
            int32_t lbad[LANES] = {0};
            float xs[SEGMENT], fs[SEGMENT];
            int64_t j = j0;
            for (; j + LANES <= j1; j += SEGMENT) { /* whole lanes, a segment at a time */
                const int64_t m = (j1 - j < SEGMENT ? j1 - j : SEGMENT) / LANES * LANES;
                for (int64_t i = 0; i < m; i++)
                    xs[i] = decode_e4m3fn(wrow[j + i]) * sb;
                for (int64_t i = 0; i < m; i++)
                    fs[i] = decode_e4m3fn(qrow[j + i]) * rs;
                for (int64_t i = 0; i < m; i += LANES)
                    for (int l = 0; l < LANES; l++)
                        bound_step(xs[i + l], fs[i + l], rel, floor_err, &ldd[l], &lxx[l], &lyy[l], &labs[l],
                                   &lratio[l], &lax[l], &lbad[l]);
                if (m < SEGMENT) {
                    j += m;
                    break;
                }
            }
            for (int l = 0; j < j1; j++, l++) /* the block's tail, into the first lanes */
                bound_step(decode_e4m3fn(wrow[j]) * sb, decode_e4m3fn(qrow[j]) * rs, rel, floor_err, &ldd[l], &lxx[l],
                           &lyy[l], &labs[l], &lratio[l], &lax[l], &lbad[l]);
            for (int l = 0; l < LANES; l++) {
                sdd += ldd[l];
                sxx += lxx[l];
                syy += lyy[l];
                mabs = nan_max(mabs, labs[l]);
                mratio = nan_max(mratio, lratio[l]);
                ax = nan_max(ax, lax[l]);
                nb += lbad[l];
            }
        }
        if (nb) { /* rare: find the first bad column with a plain second pass */
            for (int64_t j = 0; j < k && fb < 0; j++) {
                float x = decode_e4m3fn(wrow[j]) * srow[j / bk];
                float d = decode_e4m3fn(qrow[j]) * rs - x;
                float adx = x < 0.0f ? -x : x, ad = d < 0.0f ? -d : d;
                if (!(ad / (adx * rel + floor_err) <= 1.0f))
                    fb = j;
            }
        }
        dd[r] = sdd, xx[r] = sxx, yy[r] = syy;
        max_abs[r] = mabs, max_ratio[r] = mratio, n_bad[r] = nb, first_bad[r] = fb, amax_x[r] = ax;
    }
}
