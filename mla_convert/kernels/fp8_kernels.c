/* Block-FP8 -> channel-FP8 / bf16 and bf16 -> channel-FP8 conversion kernels, built on first use by native.py.
 *
 * Every function works on rows [r0, r1), so Python threads can split one tensor (ctypes drops the
 * GIL during the call). The arithmetic is the arithmetic of numerics.py, operation for
 * operation, so results are bit-identical to it (checked when the library is loaded, and in the
 * tests):
 *   dequant = fp32(w) * scale_inv[row / bn][col / bk]        (one IEEE fp32 multiply)
 *   channel scale = max|dequant of row| / fp8_max, 1.0 where that is not > 0
 *   q = e4m3fn(clamp(dequant / channel scale, -fp8_max, fp8_max))   (IEEE divide, round to nearest even)
 *   and, for a target without -0 (zero_sign 0, gaudi2), a zero q written +0 whatever its sign
 * A bf16 source weight takes the place of the dequant: its fp32 widening is exact.
 * Build with -ffp-contract=off and never -ffast-math: each operation must round exactly as torch's.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
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

/* ---- block FP8 -> channel FP8, one row at a time -------------------------------------------------
 * A row's scale and its codes are computed in one visit, while the row is in L1: the scale from
 * each block's largest byte, then the codes. In these row kernels the weight and the outputs point
 * at row r0 (a chunk of rows read into a buffer, written into a staging buffer), and the block
 * scales at the whole grid (row r uses block row r / bn). */

/* The largest magnitude code (byte & 0x7F; 0x7F is NaN) of n bytes. |fp32(w) * s| is monotone in
 * |w| for a fixed s (IEEE rounding is monotone and sign-symmetric), and the low 7 bits of an e4m3fn
 * byte order its magnitude, so a block's largest |dequant| is that of its largest code. */
static inline uint8_t max_code(const uint8_t *p, int64_t n) {
    uint8_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        uint8_t v = p[j] & 0x7Fu;
        m = v > m ? v : m;
    }
    return m;
}

/* numerics.channel_scales for one row: max |dequant| / fp8_max, 1.0 where that is not > 0 (a zero
 * row; NaN, which sticks in the max as in torch's amax). *nan: some block holds a NaN code. */
static inline float row_scale(const uint8_t *row, const float *srow, int64_t k, int64_t bk, float fp8_max, int *nan) {
    const int64_t gk = (k + bk - 1) / bk;
    float amax = 0.0f;
    int any_nan = 0;
    for (int64_t c = 0; c < gk; c++) {
        const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
        const uint8_t m = max_code(row + j0, j1 - j0);
        any_nan |= m == 0x7Fu;
        const float sc = srow[c] < 0.0f ? -srow[c] : srow[c];
        const float v = decode_e4m3fn(m) * sc;
        amax = (v > amax || v != v) ? v : amax;
    }
    *nan = any_nan;
    const float scale = amax / fp8_max;
    return scale > 0.0f ? scale : 1.0f;
}

/* Elements [j0, j1) of a row under block scale sb and row scale rs, element by element. */
static void quantize_span(const uint8_t *row, uint8_t *orow, int64_t j0, int64_t j1, float sb, float rs,
                          float fp8_max, uint32_t zero_sign) {
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

#if defined(__AVX2__)
/* The per-magnitude constants of the code tables below (both instruction sets): m' (-128: code 0),
 * m' + 16 for codes 1..3, b, and b + 8 for codes 1..3. */
static void magnitude_tables(int8_t *mp, int8_t *mpd, int8_t *b, int8_t *bd) {
    static const int8_t sub_a[8] = {0, -9, -8, -8, -7, -7, -7, -7}, sub_b[8] = {0, 0, 0, 4, 0, 2, 4, 6};
    for (int m = 0; m < 128; m++) {
        const int e = m >> 3, f = m & 7;
        const int a = e > 0 ? e - 7 : sub_a[f], bb = e > 0 ? f : sub_b[f]; /* f * 2^-9 = 2^a (1 + b/8) */
        const int zero = m == 0 || m == 0x7F; /* NaN rows never use tables */
        mp[m] = (int8_t)(zero ? -128 : 8 * (a + 7) + bb);
        mpd[m] = (int8_t)(zero ? -128 : mp[m] < 0 ? mp[m] + 16 : mp[m]);
        b[m] = (int8_t)bb;
        bd[m] = (int8_t)(!zero && mp[m] < 0 ? bb + 8 : bb);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define MLA_CODE_TABLES 1
/* Code tables. Within one (row, block) every element has the same block scale sb and row scale rs,
 * so its code depends on its byte alone: a table of 128 codes (by magnitude) and a byte lookup
 * (vpermt2b) per 64 elements replace the decode, multiply, divide and encode of each element.
 *
 * The table costs 8 divisions, not 128. Every magnitude code m is dec(m) = 2^a * (1 + b/8)
 * exactly (a in [-9, 8], b in 0..7; subnormal codes too). While every dequant is an fp32 normal
 * number (|sb| in [2^-117, 2^118)), multiplying by 2^a commutes with rounding:
 *   fl(dec(m) * sb) = 2^a * X_b,  X_b = fl((1 + b/8) * sb)
 *   fl(fl(dec(m) * sb) / rs) = 2^a * Q_b,  Q_b = fl(X_b / rs) = 2^g * mu, mu in [1, 2)
 * (where 2^a * Q_b is no fp32 normal number the quotient is below 2^-118 and its code is 0, as the
 * table's). With n = a + g, the e4m3fn code of that quotient is
 *   n >= -6:         8 (n + 6) + r, r = RNE(8 mu) in [8, 16] (16 carries into the exponent);
 *                    as m' = 8 (a + 7) + b, that is m' + D_b with D_b = 8 g + r - 8 - b
 *   -10 <= n <= -7:  RNE(2^(n + 9) mu) (e4m3's subnormals: multiples of 2^-9), the subnormal
 *                    table's entry 8 (n + 10) + b = m' + G_b with G_b = 8 g + 24
 *   n <= -11:        0
 * (m' + D_b < 8 exactly where the subnormal rule applies, or gives 8 too). The clamp to
 * +-fp8_max is min(code, code of fp8_max): the encoding is monotone and fp8_max is held exactly
 * (tables are used for 0 < fp8_max <= 448). D_b and G_b are saturated to bytes, which changes no
 * code: the codes 1..3 (m' < 0) take D_b - 16 with m' + 16 instead. Signs are the byte's sign xor
 * sb's, and a zero keeps its sign only where zero_sign is 0x80, as in encode_e4m3fn. */
#include <immintrin.h>

typedef struct {
    __m512i mp[2], mpd[2]; /* m' for magnitudes 0..63 and 64..127 (-128: code 0); m' + 16 for codes 1..3 */
    __m512i b[2], bd[2];   /* b, and b + 8 for codes 1..3 (their D_b - 16) */
    __m512i cmax;          /* code of fp8_max, in every byte */
    __m512 mant;           /* 1 + b/8 for b = 0..7, twice */
    __m512i dsub;          /* 8 + b, then 24 + b */
    __m512 smul;           /* 0.5 (x 8), 1 (x 8): the subnormal codes RNE(mu / 2), RNE(mu) */
} code_tables;

static void code_tables_init(code_tables *t, float fp8_max) {
    int8_t mp[128], mpd[128], b[128], bd[128];
    magnitude_tables(mp, mpd, b, bd);
    for (int h = 0; h < 2; h++) {
        t->mp[h] = _mm512_loadu_si512(mp + 64 * h);
        t->mpd[h] = _mm512_loadu_si512(mpd + 64 * h);
        t->b[h] = _mm512_loadu_si512(b + 64 * h);
        t->bd[h] = _mm512_loadu_si512(bd + 64 * h);
    }
    t->cmax = _mm512_set1_epi8((char)encode_e4m3fn(fp8_max, 0));
    const __m256 mant = _mm256_setr_ps(1.0f, 1.125f, 1.25f, 1.375f, 1.5f, 1.625f, 1.75f, 1.875f);
    t->mant = _mm512_insertf32x8(_mm512_castps256_ps512(mant), mant, 1);
    t->dsub = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    t->smul = _mm512_setr_ps(0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 1, 1, 1, 1, 1, 1, 1, 1);
}

/* The codes of magnitudes 0..63 (t0) and 64..127 (t1) for block scale |sb| and row scale rs. The
 * eight quotients are computed twice over (16 lanes), so that one pass gives D_b and D_b - 16. */
typedef struct {
    __m512i t0, t1;
} block_codes;

static inline void code_table(const code_tables *t, float asb, float rs, block_codes *codes) {
    const __m512 x = _mm512_mul_ps(t->mant, _mm512_set1_ps(asb));
    const __m512i bits = _mm512_castps_si512(_mm512_div_ps(x, _mm512_set1_ps(rs)));
    const __m512i g8 = _mm512_sub_epi32(_mm512_slli_epi32(_mm512_srli_epi32(bits, 23), 3), _mm512_set1_epi32(8 * 127));
    const __m512 mu = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF)), _mm512_set1_epi32(0x3F800000)));
    const __m512i base = _mm512_add_epi32(g8, _mm512_cvtps_epi32(_mm512_mul_ps(mu, _mm512_set1_ps(8.0f))));
    const __m512i dv = _mm512_castsi128_si512(_mm512_cvtsepi32_epi8(_mm512_sub_epi32(base, t->dsub)));
    const __m512i gv = _mm512_castsi128_si512(_mm512_cvtsepi32_epi8(_mm512_add_epi32(g8, _mm512_set1_epi32(24))));
    /* the subnormal codes, by 8 (n + 10) + b: RNE(mu / 2), RNE(mu), RNE(2 mu), RNE(4 mu) */
    const __m128i s01 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(mu, t->smul)));
    const __m128i s23 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(mu, _mm512_mul_ps(t->smul, _mm512_set1_ps(4.0f)))));
    const __m512i sv = _mm512_castsi256_si512(_mm256_set_m128i(s23, s01));
    __m512i out[2];
    for (int h = 0; h < 2; h++) {
        const __m512i normal = _mm512_adds_epi8(t->mpd[h], _mm512_permutexvar_epi8(t->bd[h], dv));
        const __m512i idx = _mm512_adds_epi8(t->mp[h], _mm512_permutexvar_epi8(t->b[h], gv));
        const __m512i sub =
            _mm512_maskz_permutexvar_epi8(_mm512_cmpge_epi8_mask(idx, _mm512_setzero_si512()), idx, sv);
        const __mmask64 is_normal = _mm512_cmpge_epi8_mask(normal, _mm512_set1_epi8(8));
        out[h] = _mm512_mask_min_epu8(sub, is_normal, normal, t->cmax);
    }
    codes->t0 = out[0], codes->t1 = out[1];
}

/* Elements [0, n) of a block row through its code table. */
ALWAYS_INLINE void lookup_span(const uint8_t *src, uint8_t *dst, int64_t n, const block_codes *codes,
                               uint8_t sign_xor, const int plus_zero) {
    const __m512i t0 = codes->t0, t1 = codes->t1;
    const __m512i sx = _mm512_set1_epi8((char)sign_xor), top = _mm512_set1_epi8((char)0x80);
    for (int64_t j = 0; j < n; j += 64) {
        const __mmask64 m = n - j >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - j)) - 1);
        const __m512i w = _mm512_maskz_loadu_epi8(m, src + j);
        const __m512i code = _mm512_permutex2var_epi8(t0, w, t1); /* by the low 7 bits of each byte */
        const __m512i sign = _mm512_and_si512(_mm512_xor_si512(w, sx), top);
        const __m512i out = plus_zero ? _mm512_mask_mov_epi8(code, _mm512_test_epi8_mask(code, code),
                                                             _mm512_or_si512(code, sign))
                                      : _mm512_or_si512(code, sign);
        _mm512_mask_storeu_epi8(dst + j, m, out);
    }
}
#elif defined(__AVX2__)
#define MLA_CODE_TABLES 1
/* The same code tables with AVX2: built with 16-entry byte shuffles (every index they take is below
 * 16, or 32 for the subnormal codes: two shuffles), looked up by the low 7 bits of each byte from
 * eight 16-byte pieces chosen by bits 4, 5 and 6 (blends). The same quotients, the same codes. */
typedef struct {
    __m256i mp[4], mpd[4], b[4], bd[4]; /* as above, for magnitudes 32 h .. 32 h + 31 */
    __m256i cmax;
    __m256 mant; /* 1 + b/8 for b = 0..7 */
} code_tables;

typedef struct {
    uint8_t bytes[128];
    __m256i piece[8]; /* bytes 16 i .. 16 i + 15, in both 128-bit lanes */
} block_codes;

static void code_tables_init(code_tables *t, float fp8_max) {
    int8_t mp[128], mpd[128], b[128], bd[128];
    magnitude_tables(mp, mpd, b, bd);
    for (int h = 0; h < 4; h++) {
        t->mp[h] = _mm256_loadu_si256((const __m256i *)(mp + 32 * h));
        t->mpd[h] = _mm256_loadu_si256((const __m256i *)(mpd + 32 * h));
        t->b[h] = _mm256_loadu_si256((const __m256i *)(b + 32 * h));
        t->bd[h] = _mm256_loadu_si256((const __m256i *)(bd + 32 * h));
    }
    t->cmax = _mm256_set1_epi8((char)encode_e4m3fn(fp8_max, 0));
    t->mant = _mm256_setr_ps(1.0f, 1.125f, 1.25f, 1.375f, 1.5f, 1.625f, 1.75f, 1.875f);
}

/* [a0..a7, b0..b7] as bytes (signed saturation), in both 128-bit lanes. */
static inline __m256i bytes16(__m256i a, __m256i b) {
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); /* a0..7 | b0..7 */
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    return _mm256_broadcastsi128_si256(bytes);
}

static inline void code_table(const code_tables *t, float asb, float rs, block_codes *codes) {
    const __m256 x = _mm256_mul_ps(t->mant, _mm256_set1_ps(asb));
    const __m256i bits = _mm256_castps_si256(_mm256_div_ps(x, _mm256_set1_ps(rs)));
    const __m256i g8 = _mm256_sub_epi32(_mm256_slli_epi32(_mm256_srli_epi32(bits, 23), 3), _mm256_set1_epi32(8 * 127));
    const __m256 mu = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x3F800000)));
    const __m256i base = _mm256_add_epi32(g8, _mm256_cvtps_epi32(_mm256_mul_ps(mu, _mm256_set1_ps(8.0f))));
    const __m256i eight_b = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i dv = bytes16(_mm256_sub_epi32(base, eight_b),
                               _mm256_sub_epi32(base, _mm256_add_epi32(eight_b, _mm256_set1_epi32(16))));
    const __m256i g24 = _mm256_add_epi32(g8, _mm256_set1_epi32(24));
    const __m256i gv = bytes16(g24, g24);
    /* the subnormal codes, by 8 (n + 10) + b: RNE(mu / 2), RNE(mu) (indices 0..15), RNE(2 mu), RNE(4 mu) */
    const __m256i s01 = bytes16(_mm256_cvtps_epi32(_mm256_mul_ps(mu, _mm256_set1_ps(0.5f))), _mm256_cvtps_epi32(mu));
    const __m256i s23 = bytes16(_mm256_cvtps_epi32(_mm256_mul_ps(mu, _mm256_set1_ps(2.0f))),
                                _mm256_cvtps_epi32(_mm256_mul_ps(mu, _mm256_set1_ps(4.0f))));
    for (int h = 0; h < 4; h++) {
        const __m256i normal = _mm256_adds_epi8(t->mpd[h], _mm256_shuffle_epi8(dv, t->bd[h]));
        const __m256i idx = _mm256_adds_epi8(t->mp[h], _mm256_shuffle_epi8(gv, t->b[h]));
        const __m256i i6 = _mm256_and_si256(idx, _mm256_set1_epi8(63)); /* as vpermb: the low 6 bits */
        __m256i sub = _mm256_blendv_epi8(_mm256_shuffle_epi8(s01, i6), _mm256_shuffle_epi8(s23, i6),
                                         _mm256_cmpgt_epi8(i6, _mm256_set1_epi8(15)));
        const __m256i none = _mm256_or_si256(_mm256_cmpgt_epi8(i6, _mm256_set1_epi8(31)),
                                             _mm256_cmpgt_epi8(_mm256_setzero_si256(), idx));
        sub = _mm256_andnot_si256(none, sub);
        const __m256i is_normal = _mm256_cmpgt_epi8(normal, _mm256_set1_epi8(7));
        const __m256i out = _mm256_blendv_epi8(sub, _mm256_min_epu8(normal, t->cmax), is_normal);
        _mm256_storeu_si256((__m256i *)(codes->bytes + 32 * h), out);
    }
    for (int i = 0; i < 8; i++)
        codes->piece[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(codes->bytes + 16 * i)));
}

/* Elements [0, n) of a block row through its code table (the last n % 32 from its bytes). */
ALWAYS_INLINE void lookup_span(const uint8_t *src, uint8_t *dst, int64_t n, const block_codes *codes,
                               uint8_t sign_xor, const int plus_zero) {
    const __m256i sx = _mm256_set1_epi8((char)sign_xor), top = _mm256_set1_epi8((char)0x80);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i *t = codes->piece;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(src + j));
        const __m256i lo = _mm256_and_si256(w, low4);
        /* blendv reads each byte's top bit: bits 4, 5, 6 of every byte moved there (16-bit shifts
         * carry a byte's bits into its neighbour's low bits only) */
        const __m256i b4 = _mm256_slli_epi16(w, 3), b5 = _mm256_slli_epi16(w, 2), b6 = _mm256_slli_epi16(w, 1);
        const __m256i p0 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[0], lo), _mm256_shuffle_epi8(t[1], lo), b4);
        const __m256i p1 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[2], lo), _mm256_shuffle_epi8(t[3], lo), b4);
        const __m256i p2 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[4], lo), _mm256_shuffle_epi8(t[5], lo), b4);
        const __m256i p3 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[6], lo), _mm256_shuffle_epi8(t[7], lo), b4);
        const __m256i code =
            _mm256_blendv_epi8(_mm256_blendv_epi8(p0, p1, b5), _mm256_blendv_epi8(p2, p3, b5), b6);
        const __m256i sign = _mm256_and_si256(_mm256_xor_si256(w, sx), top);
        const __m256i out = plus_zero ? _mm256_or_si256(code, _mm256_andnot_si256(
                                                                  _mm256_cmpeq_epi8(code, _mm256_setzero_si256()), sign))
                                      : _mm256_or_si256(code, sign);
        _mm256_storeu_si256((__m256i *)(dst + j), out);
    }
    for (; j < n; j++) {
        const uint8_t code = codes->bytes[src[j] & 0x7Fu], sign = (uint8_t)((src[j] ^ sign_xor) & 0x80u);
        dst[j] = plus_zero && code == 0 ? code : (uint8_t)(code | sign);
    }
}
#endif

#define TABLE_MIN_SPAN 32 /* below this many elements per block, the table costs more than it saves */

static void mla_channel_fp8_rows(const uint8_t *restrict w, const float *restrict s, int64_t k, int64_t bn, int64_t bk,
                          float fp8_max, uint32_t zero_sign, uint8_t *restrict q, float *restrict scale, int64_t r0,
                          int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
#if MLA_CODE_TABLES
    code_tables tables;
    code_tables_init(&tables, fp8_max);
    const int use_tables = fp8_max > 0.0f && fp8_max <= 448.0f;
#endif
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (r - r0) * k;
        uint8_t *orow = q + (r - r0) * k;
        const float *srow = s + (r / bn) * gk;
        int nan;
        const float rs = row_scale(row, srow, k, bk, fp8_max, &nan);
        scale[r - r0] = rs;
#if MLA_CODE_TABLES
        /* a row with a NaN code, or a scale that is not an fp32 normal number, goes element by element */
        const int row_tables = use_tables && !nan && rs >= 0x1p-126f && rs <= 0x1.fffffep127f;
#endif
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
#if MLA_CODE_TABLES
            const float asb = sb < 0.0f ? -sb : sb;
            if (row_tables && j1 - j0 >= TABLE_MIN_SPAN && asb >= 0x1p-117f && asb < 0x1p118f) {
                block_codes codes;
                code_table(&tables, asb, rs, &codes);
                const uint8_t sx = sb < 0.0f ? 0x80u : 0u;
                if (zero_sign)
                    lookup_span(row + j0, orow + j0, j1 - j0, &codes, sx, 0);
                else
                    lookup_span(row + j0, orow + j0, j1 - j0, &codes, sx, 1);
                continue;
            }
#endif
            quantize_span(row, orow, j0, j1, sb, rs, fp8_max, zero_sign);
        }
    }
}

/* ---- bf16 -> channel FP8 (a BF16 source's linears), one row at a time ----------------------------
 * A bf16 row's largest |x| is the widening of its largest (bits & 0x7FFF): the low 15 bits order
 * |x| (Inf above the finite values, NaN above Inf), so NaN sticks, as in torch's amax. */
static void mla_bf16_channel_rows(const uint16_t *restrict w, int64_t k, float fp8_max, uint32_t zero_sign,
                           uint8_t *restrict q, float *restrict scale, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = w + (r - r0) * k;
        uint8_t *orow = q + (r - r0) * k;
        uint16_t m = 0;
        for (int64_t j = 0; j < k; j++) {
            uint16_t v = row[j] & 0x7FFFu;
            m = v > m ? v : m;
        }
        float rs = widen_bf16(m) / fp8_max;
        rs = rs > 0.0f ? rs : 1.0f;
        scale[r - r0] = rs;
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

/* bf16(fp32(w) * s) block-wise, rows [r0, r1). */
static void mla_bf16_rows(const uint8_t *restrict w, const float *restrict s, int64_t k, int64_t bn, int64_t bk,
                   uint16_t *restrict out, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (r - r0) * k;
        uint16_t *orow = out + (r - r0) * k;
        const float *srow = s + (r / bn) * gk;
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
            for (int64_t j = j0; j < j1; j++)
                orow[j] = encode_bf16(decode_e4m3fn(row[j]) * sb);
        }
    }
}

/* ---- the MLA split (mla_runtime.layout.split_kv_b_proj) -------------------------------------------
 * kv_b_proj [N * (P + V), L] -> W_UK_T [N, P, L] and W_UV [N, L, V] in bf16, heads [h0, h1): row
 * h * (P + V) + j is W_UK_T[h, j, :] for j < P, else the column W_UV[h, :, j - P]. Only values
 * move: each one is bf16(fp32(w) * s) of a block-FP8 kv_b_proj (as mla_bf16_rows), or the bf16
 * element itself. W_UV is written in TILE x TILE tiles, so that its transposed writes fill whole
 * cache lines. Pointers are to element 0 of the whole tensors. */
#define TILE 32

/* One row of bf16(fp32(w) * s) (the loop of mla_bf16_rows). */
static void bf16_row(const uint8_t *restrict row, const float *restrict srow, int64_t l, int64_t bk,
                     uint16_t *restrict out) {
    for (int64_t c = 0, j0 = 0; j0 < l; c++, j0 += bk) {
        const int64_t j1 = j0 + bk < l ? j0 + bk : l;
        const float sb = srow[c];
        for (int64_t j = j0; j < j1; j++)
            out[j] = encode_bf16(decode_e4m3fn(row[j]) * sb);
    }
}

/* W_UV[h] from its V rows of kv_b_proj, already bf16 in `rows` (TILE of them, row stride l):
 * out[c * v + j0 + jj] = rows[jj * l + c]. */
static void transpose_tile(const uint16_t *restrict rows, int64_t n, int64_t l, int64_t v, int64_t j0,
                           uint16_t *restrict out) {
    for (int64_t c = 0; c < l; c++)
        for (int64_t jj = 0; jj < n; jj++)
            out[c * v + j0 + jj] = rows[jj * l + c];
}

static void mla_split_fp8_rows(const uint8_t *restrict w, const float *restrict s, int64_t l, int64_t bn, int64_t bk,
                        int64_t p, int64_t v, uint16_t *restrict uk_t, uint16_t *restrict uv, int64_t h0, int64_t h1) {
    const int64_t gk = (l + bk - 1) / bk;
    uint16_t *tile = malloc((size_t)(TILE * l) * sizeof(uint16_t));
    for (int64_t h = h0; h < h1; h++) {
        for (int64_t j = 0; j < p; j++) {
            const int64_t r = h * (p + v) + j;
            bf16_row(w + r * l, s + (r / bn) * gk, l, bk, uk_t + (h * p + j) * l);
        }
        for (int64_t j = 0; !tile && j < v; j++) { /* no memory for a tile: element by element */
            const int64_t r = h * (p + v) + p + j;
            const float *srow = s + (r / bn) * gk;
            for (int64_t c = 0; c < l; c++)
                uv[(h * l + c) * v + j] = encode_bf16(decode_e4m3fn(w[r * l + c]) * srow[c / bk]);
        }
        for (int64_t j0 = 0; tile && j0 < v; j0 += TILE) {
            const int64_t n = v - j0 < TILE ? v - j0 : TILE;
            for (int64_t jj = 0; jj < n; jj++) {
                const int64_t r = h * (p + v) + p + j0 + jj;
                bf16_row(w + r * l, s + (r / bn) * gk, l, bk, tile + jj * l);
            }
            transpose_tile(tile, n, l, v, j0, uv + h * l * v);
        }
    }
    free(tile);
}

static void mla_split_bf16_rows(const uint16_t *restrict w, int64_t l, int64_t p, int64_t v, uint16_t *restrict uk_t,
                         uint16_t *restrict uv, int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; h++) {
        memcpy(uk_t + h * p * l, w + h * (p + v) * l, (size_t)(p * l) * sizeof(uint16_t));
        for (int64_t j0 = 0; j0 < v; j0 += TILE)
            transpose_tile(w + (h * (p + v) + p + j0) * l, v - j0 < TILE ? v - j0 : TILE, l, v, j0, uv + h * l * v);
    }
}

/* ---- the conversion kernels, split over threads here ----------------------------------------------
 * One call converts a range of rows on up to `threads` threads (this one and threads started for
 * the call), and returns when all are done: a Python caller pays one call per chunk, and a Ctrl-C
 * can only be handled once every thread has let go of the buffers. Each range gets at least
 * MIN_ROWS rows. */
#define MAX_THREADS 64
#define MIN_ROWS 16

typedef void (*range_fn)(const void *args, int64_t r0, int64_t r1);
typedef struct {
    range_fn run;
    const void *args;
    int64_t r0, r1;
} range_job;

static void *range_main(void *p) {
    const range_job *job = p;
    job->run(job->args, job->r0, job->r1);
    return NULL;
}

static void in_parallel(range_fn run, const void *args, int64_t r0, int64_t r1, int64_t threads, int64_t min_rows) {
    const int64_t n = r1 - r0;
    int64_t count = threads < n / min_rows ? threads : n / min_rows;
    count = count < 1 ? 1 : count > MAX_THREADS ? MAX_THREADS : count;
    pthread_t tid[MAX_THREADS];
    range_job jobs[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 1; i < count; i++) {
        jobs[i] = (range_job){run, args, r0 + n * i / count, r0 + n * (i + 1) / count};
        started[i] = pthread_create(&tid[i], NULL, range_main, &jobs[i]) == 0;
    }
    run(args, r0, r0 + n / count);
    for (int64_t i = 1; i < count; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else /* no thread to be had: this one does the range */
            run(args, jobs[i].r0, jobs[i].r1);
    }
}

typedef struct {
    const uint8_t *w;
    const float *s;
    int64_t k, bn, bk, r0;
    float fp8_max;
    uint32_t zero_sign;
    uint8_t *q;
    float *scale;
} channel_args;

static void channel_range(const void *p, int64_t r0, int64_t r1) {
    const channel_args *a = p;
    const int64_t d = r0 - a->r0;
    mla_channel_fp8_rows(a->w + d * a->k, a->s, a->k, a->bn, a->bk, a->fp8_max, a->zero_sign, a->q + d * a->k,
                         a->scale + d, r0, r1);
}

/* Block FP8 -> channel FP8, rows [r0, r1): w, q and scale point at row r0. */
void mla_channel_fp8(const uint8_t *w, const float *s, int64_t k, int64_t bn, int64_t bk, float fp8_max,
                     uint32_t zero_sign, uint8_t *q, float *scale, int64_t r0, int64_t r1, int64_t threads) {
    const channel_args a = {w, s, k, bn, bk, r0, fp8_max, zero_sign, q, scale};
    in_parallel(channel_range, &a, r0, r1, threads, MIN_ROWS);
}

typedef struct {
    const uint16_t *w;
    int64_t k, r0;
    float fp8_max;
    uint32_t zero_sign;
    uint8_t *q;
    float *scale;
} bf16_channel_args;

static void bf16_channel_range(const void *p, int64_t r0, int64_t r1) {
    const bf16_channel_args *a = p;
    const int64_t d = r0 - a->r0;
    mla_bf16_channel_rows(a->w + d * a->k, a->k, a->fp8_max, a->zero_sign, a->q + d * a->k, a->scale + d, r0, r1);
}

/* bf16 -> channel FP8, rows [r0, r1): w, q and scale point at row r0. */
void mla_bf16_channel(const uint16_t *w, int64_t k, float fp8_max, uint32_t zero_sign, uint8_t *q, float *scale,
                      int64_t r0, int64_t r1, int64_t threads) {
    const bf16_channel_args a = {w, k, r0, fp8_max, zero_sign, q, scale};
    in_parallel(bf16_channel_range, &a, r0, r1, threads, MIN_ROWS);
}

typedef struct {
    const uint8_t *w;
    const float *s;
    int64_t k, bn, bk, r0;
    uint16_t *out;
} bf16_args;

static void bf16_range(const void *p, int64_t r0, int64_t r1) {
    const bf16_args *a = p;
    const int64_t d = r0 - a->r0;
    mla_bf16_rows(a->w + d * a->k, a->s, a->k, a->bn, a->bk, a->out + d * a->k, r0, r1);
}

/* Block FP8 -> bf16, rows [r0, r1): w and out point at row r0. */
void mla_bf16(const uint8_t *w, const float *s, int64_t k, int64_t bn, int64_t bk, uint16_t *out, int64_t r0,
              int64_t r1, int64_t threads) {
    const bf16_args a = {w, s, k, bn, bk, r0, out};
    in_parallel(bf16_range, &a, r0, r1, threads, MIN_ROWS);
}

typedef struct {
    const void *w;
    const float *s; /* NULL: a bf16 kv_b_proj */
    int64_t l, bn, bk, p, v;
    uint16_t *uk_t, *uv;
} split_args;

static void split_range(const void *p, int64_t h0, int64_t h1) {
    const split_args *a = p;
    if (a->s)
        mla_split_fp8_rows(a->w, a->s, a->l, a->bn, a->bk, a->p, a->v, a->uk_t, a->uv, h0, h1);
    else
        mla_split_bf16_rows(a->w, a->l, a->p, a->v, a->uk_t, a->uv, h0, h1);
}

/* The MLA split of heads [0, heads) of a block-FP8 kv_b_proj (s: its scales) or a bf16 one (s NULL). */
void mla_split(const void *w, const float *s, int64_t l, int64_t bn, int64_t bk, int64_t p, int64_t v,
               uint16_t *uk_t, uint16_t *uv, int64_t heads, int64_t threads) {
    const split_args a = {w, s, l, bn, bk, p, v, uk_t, uv};
    in_parallel(split_range, &a, 0, heads, threads, 1);
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
static inline void fp8_bound_rows_scalar(const uint8_t *restrict q, const float *restrict sc, const uint8_t *restrict w,
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


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 32 e4m3fn codes (masked lanes read as 0) -> fp32 / 256, exactly: the code's bits shifted into an
 * fp16 (sign to bit 15, exponent and mantissa to bits 7..13) are the value / 256, subnormals
 * included, and fp16 -> fp32 is exact. 0x7F / 0xFF (NaN) become an fp16 NaN. */
static inline void decode32_avx512(const uint8_t *p, __mmask32 m, __m512 *lo, __m512 *hi) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p));
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
    __m512i h = _mm512_or_si512(_mm512_slli_epi16(em, 7), _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
    h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(em, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7E00));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* The same pass, 16 lanes at a time (the block's tail masked), for rows without NaN or bad
 * elements: the same fp32 operations per element (x = (code / 256 * 256) * s is the one rounding
 * of code * s), so max_abs, max_ratio, amax_x and the count match the scalar pass; the sums differ
 * in their order (and are fused multiply-adds). A row where an element is out of bound (NaN is)
 * is done again by the scalar pass, whose maxima keep NaN and which finds the first bad column. */
static inline void bound16(__m512 wx, __m512 qx, __m512 vsb, __m512 vrs, __m512 vrel, __m512 vfloor, __mmask16 m,
                           __m512 *ldd, __m512 *lxx, __m512 *lyy, __m512 *mabs, __m512 *mratio, __m512 *ax,
                           __mmask16 *bad) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    /* vsb, vrs hold s * 256 (exact, checked finite by the caller): wx * (s * 256) is code * s, rounded once */
    const __m512 x = _mm512_mul_ps(wx, vsb);
    const __m512 f = _mm512_mul_ps(qx, vrs);
    const __m512 d = _mm512_sub_ps(f, x);
    const __m512 adx = _mm512_and_ps(x, abs_mask), ad = _mm512_and_ps(d, abs_mask);
    const __m512 ratio = _mm512_div_ps(ad, _mm512_add_ps(_mm512_mul_ps(adx, vrel), vfloor));
    *ldd = _mm512_mask3_fmadd_ps(d, d, *ldd, m);
    *lxx = _mm512_mask3_fmadd_ps(x, x, *lxx, m);
    *lyy = _mm512_mask3_fmadd_ps(f, f, *lyy, m);
    *mabs = _mm512_mask_max_ps(*mabs, m, *mabs, ad);
    *mratio = _mm512_mask_max_ps(*mratio, m, *mratio, ratio);
    *ax = _mm512_mask_max_ps(*ax, m, *ax, adx);
    *bad |= m & ~_mm512_mask_cmp_ps_mask(m, ratio, _mm512_set1_ps(1.0f), _CMP_LE_OQ);
}

void mla_fp8_bound_rows(const uint8_t *restrict q, const float *restrict sc, const uint8_t *restrict w,
                        const float *restrict s, int64_t k, int64_t bn, int64_t bk, float rel, float half_step,
                        double *restrict dd, double *restrict xx, double *restrict yy, float *restrict max_abs,
                        float *restrict max_ratio, int64_t *restrict n_bad, int64_t *restrict first_bad,
                        float *restrict amax_x, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    const __m512 vrel = _mm512_set1_ps(rel);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *qrow = q + r * k, *wrow = w + r * k;
        const float *srow = s + (r / bn) * gk;
        const float rs = sc[r], floor_err = rs * half_step;
        const __m512 vrs = _mm512_set1_ps(rs * 256.0f), vfloor = _mm512_set1_ps(floor_err);
        __m512 mabs = _mm512_setzero_ps(), mratio = _mm512_setzero_ps(), ax = _mm512_setzero_ps();
        __m512d sdd = _mm512_setzero_pd(), sxx = _mm512_setzero_pd(), syy = _mm512_setzero_pd();
        __mmask16 nb = (rs < 0.0f ? -rs : rs) <= 0x1p100f ? 0 : 1; /* else (huge, Inf, NaN): the scalar pass */
        for (int64_t c = 0; c < gk; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const __m512 vsb = _mm512_set1_ps(srow[c] * 256.0f);
            nb |= (srow[c] < 0.0f ? -srow[c] : srow[c]) <= 0x1p100f ? 0 : 1;
            __m512 ldd = _mm512_setzero_ps(), lxx = _mm512_setzero_ps(), lyy = _mm512_setzero_ps();
            for (int64_t j = j0; j < j1; j += 32) {
                const int64_t left = j1 - j;
                const __mmask32 m = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << left) - 1u);
                __m512 w0, w1, q0, q1;
                decode32_avx512(wrow + j, m, &w0, &w1);
                decode32_avx512(qrow + j, m, &q0, &q1);
                bound16(w0, q0, vsb, vrs, vrel, vfloor, (__mmask16)m, &ldd, &lxx, &lyy, &mabs, &mratio, &ax, &nb);
                if (left > 16)
                    bound16(w1, q1, vsb, vrs, vrel, vfloor, (__mmask16)(m >> 16), &ldd, &lxx, &lyy, &mabs, &mratio,
                            &ax, &nb);
            }
            sdd = _mm512_add_pd(sdd, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(ldd)),
                                                   _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ldd), 1)))));
            sxx = _mm512_add_pd(sxx, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(lxx)),
                                                   _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lxx), 1)))));
            syy = _mm512_add_pd(syy, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(lyy)),
                                                   _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lyy), 1)))));
        }
        if (nb) { /* out of bound or NaN: the scalar pass, exactly (NaN kept in the maxima, the first bad column) */
            fp8_bound_rows_scalar(q, sc, w, s, k, bn, bk, rel, half_step, dd, xx, yy, max_abs, max_ratio, n_bad,
                                  first_bad, amax_x, r, r + 1);
            continue;
        }
        dd[r] = _mm512_reduce_add_pd(sdd), xx[r] = _mm512_reduce_add_pd(sxx), yy[r] = _mm512_reduce_add_pd(syy);
        max_abs[r] = _mm512_reduce_max_ps(mabs), max_ratio[r] = _mm512_reduce_max_ps(mratio);
        amax_x[r] = _mm512_reduce_max_ps(ax), n_bad[r] = 0, first_bad[r] = -1;
    }
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* The AVX2 version of the vector pass above (8 lanes, no masks): the same decode through fp16 and
 * the same fp32 operations per element; a block's last (j1 - j0) % 8 columns go through bound_step. */
static inline void decode16_avx2(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i em = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(em, 7), _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7F)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

static inline __m256 decode8_f16c(const uint8_t *p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i em = _mm_and_si128(b, _mm_set1_epi16(0x7F));
    __m128i h = _mm_or_si128(_mm_slli_epi16(em, 7), _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(em, _mm_set1_epi16(0x7F)));
    return _mm256_cvtph_ps(h);
}

typedef struct {
    __m256 dd, xx, yy, mabs, mratio, ax;
    int bad;
} bound8_acc;

static inline void bound8(__m256 wx, __m256 qx, __m256 vsb, __m256 vrs, __m256 vrel, __m256 vfloor, bound8_acc *a) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 x = _mm256_mul_ps(wx, vsb), f = _mm256_mul_ps(qx, vrs);
    const __m256 d = _mm256_sub_ps(f, x);
    const __m256 adx = _mm256_and_ps(x, abs_mask), ad = _mm256_and_ps(d, abs_mask);
    const __m256 ratio = _mm256_div_ps(ad, _mm256_add_ps(_mm256_mul_ps(adx, vrel), vfloor));
    a->dd = _mm256_fmadd_ps(d, d, a->dd);
    a->xx = _mm256_fmadd_ps(x, x, a->xx);
    a->yy = _mm256_fmadd_ps(f, f, a->yy);
    a->mabs = _mm256_max_ps(a->mabs, ad);
    a->mratio = _mm256_max_ps(a->mratio, ratio);
    a->ax = _mm256_max_ps(a->ax, adx);
    a->bad |= _mm256_movemask_ps(_mm256_cmp_ps(ratio, _mm256_set1_ps(1.0f), _CMP_LE_OQ)) != 0xFF;
}

static inline __m256d widen_sum(__m256 v) {
    return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double hsum_pd(__m256d v) {
    double t[4];
    _mm256_storeu_pd(t, v);
    return (t[0] + t[1]) + (t[2] + t[3]);
}

static inline float hmax_ps(__m256 v) {
    float t[8], m = 0.0f;
    _mm256_storeu_ps(t, v);
    for (int l = 0; l < 8; l++)
        m = t[l] > m ? t[l] : m;
    return m;
}

void mla_fp8_bound_rows(const uint8_t *restrict q, const float *restrict sc, const uint8_t *restrict w,
                        const float *restrict s, int64_t k, int64_t bn, int64_t bk, float rel, float half_step,
                        double *restrict dd, double *restrict xx, double *restrict yy, float *restrict max_abs,
                        float *restrict max_ratio, int64_t *restrict n_bad, int64_t *restrict first_bad,
                        float *restrict amax_x, int64_t r0, int64_t r1) {
    const int64_t gk = (k + bk - 1) / bk;
    const __m256 vrel = _mm256_set1_ps(rel);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *qrow = q + r * k, *wrow = w + r * k;
        const float *srow = s + (r / bn) * gk;
        const float rs = sc[r], floor_err = rs * half_step;
        const __m256 vrs = _mm256_set1_ps(rs * 256.0f), vfloor = _mm256_set1_ps(floor_err);
        bound8_acc a = {.mabs = _mm256_setzero_ps(), .mratio = _mm256_setzero_ps(), .ax = _mm256_setzero_ps()};
        __m256d sdd = _mm256_setzero_pd(), sxx = _mm256_setzero_pd(), syy = _mm256_setzero_pd();
        /* the tails' lanes (bound_step's accumulators), folded in at the end */
        float tdd[LANES] = {0}, txx[LANES] = {0}, tyy[LANES] = {0}, tabs[LANES] = {0}, tratio[LANES] = {0},
              tax[LANES] = {0};
        int32_t tbad[LANES] = {0};
        a.bad = (rs < 0.0f ? -rs : rs) <= 0x1p100f ? 0 : 1; /* else (huge, Inf, NaN): the scalar pass */
        for (int64_t c = 0; c < gk && !a.bad; c++) {
            const int64_t j0 = c * bk, j1 = j0 + bk < k ? j0 + bk : k;
            const float sb = srow[c];
            const __m256 vsb = _mm256_set1_ps(sb * 256.0f);
            a.bad |= (sb < 0.0f ? -sb : sb) <= 0x1p100f ? 0 : 1;
            a.dd = a.xx = a.yy = _mm256_setzero_ps();
            int64_t j = j0;
            for (; j + 16 <= j1; j += 16) {
                __m256 w0, w1, q0, q1;
                decode16_avx2(wrow + j, &w0, &w1);
                decode16_avx2(qrow + j, &q0, &q1);
                bound8(w0, q0, vsb, vrs, vrel, vfloor, &a);
                bound8(w1, q1, vsb, vrs, vrel, vfloor, &a);
            }
            if (j + 8 <= j1) {
                bound8(decode8_f16c(wrow + j), decode8_f16c(qrow + j), vsb, vrs, vrel, vfloor, &a);
                j += 8;
            }
            for (int l = 0; j < j1; j++, l++)
                bound_step(decode_e4m3fn(wrow[j]) * sb, decode_e4m3fn(qrow[j]) * rs, rel, floor_err, &tdd[l],
                           &txx[l], &tyy[l], &tabs[l], &tratio[l], &tax[l], &tbad[l]);
            sdd = _mm256_add_pd(sdd, widen_sum(a.dd));
            sxx = _mm256_add_pd(sxx, widen_sum(a.xx));
            syy = _mm256_add_pd(syy, widen_sum(a.yy));
        }
        for (int l = 0; l < LANES; l++)
            a.bad |= tbad[l] != 0;
        if (a.bad) { /* out of bound or NaN: the scalar pass, exactly (NaN kept in the maxima, the first bad column) */
            fp8_bound_rows_scalar(q, sc, w, s, k, bn, bk, rel, half_step, dd, xx, yy, max_abs, max_ratio, n_bad,
                                  first_bad, amax_x, r, r + 1);
            continue;
        }
        double tsum[3] = {0.0, 0.0, 0.0};
        float mabs = hmax_ps(a.mabs), mratio = hmax_ps(a.mratio), ax = hmax_ps(a.ax);
        for (int l = 0; l < LANES; l++) {
            tsum[0] += tdd[l], tsum[1] += txx[l], tsum[2] += tyy[l];
            mabs = tabs[l] > mabs ? tabs[l] : mabs;
            mratio = tratio[l] > mratio ? tratio[l] : mratio;
            ax = tax[l] > ax ? tax[l] : ax;
        }
        dd[r] = hsum_pd(sdd) + tsum[0], xx[r] = hsum_pd(sxx) + tsum[1], yy[r] = hsum_pd(syy) + tsum[2];
        max_abs[r] = mabs, max_ratio[r] = mratio, amax_x[r] = ax, n_bad[r] = 0, first_bad[r] = -1;
    }
}
#else
void mla_fp8_bound_rows(const uint8_t *restrict q, const float *restrict sc, const uint8_t *restrict w,
                        const float *restrict s, int64_t k, int64_t bn, int64_t bk, float rel, float half_step,
                        double *restrict dd, double *restrict xx, double *restrict yy, float *restrict max_abs,
                        float *restrict max_ratio, int64_t *restrict n_bad, int64_t *restrict first_bad,
                        float *restrict amax_x, int64_t r0, int64_t r1) {
    fp8_bound_rows_scalar(q, sc, w, s, k, bn, bk, rel, half_step, dd, xx, yy, max_abs, max_ratio, n_bad, first_bad,
                          amax_x, r0, r1);
}
#endif

/* ---- verify on raw buffers (no torch): first difference, scale limit, MLA artifacts ---------- */

/* The first byte offset where a and b differ, -1 where the n bytes are equal (a copied tensor). */
int64_t mla_first_difference(const uint8_t *a, const uint8_t *b, int64_t n) {
    const int64_t step = 1 << 20;
    for (int64_t i = 0; i < n; i += step) {
        const int64_t m = n - i < step ? n - i : step;
        if (memcmp(a + i, b + i, (size_t)m))
            for (int64_t j = i; j < i + m; j++)
                if (a[j] != b[j])
                    return j;
    }
    return -1;
}

/* verify's scale limit for rows [0, n): how many rows have amax > 0 and not sc <= (amax + eps) /
 * fp8_max * (1 + rel), each operation in fp32 as in torch. *near counts the rows within 2^-12
 * relative of their limit, where torch may round its scalar division differently: the caller
 * then decides in torch. */
int64_t mla_scale_over_limit(const float *sc, const float *amax, int64_t n, float eps, float fp8_max, float rel,
                             int64_t *near) {
    int64_t over = 0, close = 0;
    for (int64_t r = 0; r < n; r++) {
        const float limit = (amax[r] + eps) / fp8_max * (1.0f + rel);
        over += amax[r] > 0.0f && !(sc[r] <= limit);
        const float gap = sc[r] - limit;
        close += amax[r] > 0.0f && (gap < 0.0f ? -gap : gap) <= limit * 0x1p-12f;
    }
    *near = close;
    return over;
}

/* The MLA artifacts of heads [h0, h1) against a channel-FP8 kv_b_proj (codes q [N(P+V), L], row
 * scales sc): how many elements of W_UK_T [N, P, L] (uk) and W_UV [N, L, V] (uv), bf16, are out
 * of the artifact bound |a - fl(q s)| <= |a| * rel + s * half_step (as verify/bounds.py, fp32). */
int64_t mla_artifact_bound(const uint8_t *q, const float *sc, const uint16_t *uk, const uint16_t *uv, int64_t l,
                           int64_t p, int64_t v, float rel, float half_step, int64_t h0, int64_t h1) {
    int64_t bad = 0;
    for (int64_t h = h0; h < h1; h++) {
        for (int64_t i = 0; i < p + v; i++) {
            const int64_t row = h * (p + v) + i;
            const uint8_t *qrow = q + row * l;
            const float s = sc[row], floor_err = s * half_step;
            for (int64_t j = 0; j < l; j++) {
                const float a = widen_bf16(i < p ? uk[(h * p + i) * l + j] : uv[(h * l + j) * v + (i - p)]);
                const float d = a - decode_e4m3fn(qrow[j]) * s;
                const float ad = d < 0.0f ? -d : d, aa = a < 0.0f ? -a : a;
                bad += !(ad <= aa * rel + floor_err);
            }
        }
    }
    return bad;
}

/* verify's functional MLA check (verify/bounds.py: naive_mla_decode against absorbed_mla_decode),
 * in fp32 with its own summation order. The decode inputs come from mla_normal_fill (seeded), so
 * the tests can run the torch reference on the very same ones. */
#include <math.h>

/* n standard normal floats from a splitmix64 stream (Box-Muller), advancing *state. */
void mla_normal_fill(uint64_t *state, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 2) {
        double u[2];
        for (int j = 0; j < 2; j++) {
            uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            z ^= z >> 31;
            u[j] = ((double)(z >> 11) + 0.5) * 0x1p-53; /* in (0, 1) */
        }
        const double rad = sqrt(-2.0 * log(u[0])), ang = 6.283185307179586 * u[1];
        out[i] = (float)(rad * cos(ang));
        if (i + 1 < n)
            out[i + 1] = (float)(rad * sin(ang));
    }
}

#define DOT_LANES 16
static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[DOT_LANES] = {0};
    int64_t i = 0;
    for (; i + DOT_LANES <= n; i += DOT_LANES)
        for (int j = 0; j < DOT_LANES; j++)
            acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < DOT_LANES; j++)
        s += acc[j];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static void softmax_row(float *x, int64_t n, float temperature) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        x[i] /= temperature;
        m = x[i] > m ? x[i] : m;
    }
    for (int64_t i = 0; i < n; i++)
        sum += (x[i] = expf(x[i] - m));
    for (int64_t i = 0; i < n; i++)
        x[i] /= sum;
}

/* Relative Frobenius error of the absorbed decode (uk: W_UK_T [N, P, L], uv: W_UV [N, L, V], bf16)
 * against the naive one (kvb: fp32 kv_b_proj [N(P+V), L]) for queries q_nope [B, N, P], q_pe
 * [B, N, R] and a cache latent [T, L], k_pe [T, R]. -1: out of memory. */
double mla_functional_error(const float *kvb, const uint16_t *uk, const uint16_t *uv, int64_t n, int64_t p,
                            int64_t v, int64_t l, int64_t r, int64_t b, int64_t t, const float *q_nope,
                            const float *q_pe, const float *latent, const float *k_pe) {
    const int64_t pv = p + v;
    float *kv = malloc(sizeof(float) * (size_t)(n * t * pv));          /* [N, T, P+V] */
    float *logits = malloc(sizeof(float) * (size_t)(n * b * t));       /* [N, B, T] naive */
    float *logits2 = malloc(sizeof(float) * (size_t)(n * b * t));      /* [N, B, T] absorbed */
    float *ql = malloc(sizeof(float) * (size_t)(b * l));                /* one head's [B, L] */
    float *row = malloc(sizeof(float) * (size_t)(l > v ? l : v));
    double err = -1.0;
    if (!kv || !logits || !logits2 || !ql || !row)
        goto done;
    for (int64_t h = 0; h < n; h++) /* naive: up-project the cache */
        for (int64_t j = 0; j < pv; j++)
            for (int64_t s = 0; s < t; s++)
                kv[(h * t + s) * pv + j] = dot_f32(latent + s * l, kvb + (h * pv + j) * l, l);
    for (int64_t h = 0; h < n; h++)
        for (int64_t q = 0; q < b; q++) {
            const float *qn = q_nope + (q * n + h) * p, *qr = q_pe + (q * n + h) * r;
            for (int64_t s = 0; s < t; s++)
                logits[(h * b + q) * t + s] = dot_f32(qn, kv + (h * t + s) * pv, p) + dot_f32(qr, k_pe + s * r, r);
            /* absorbed: q_nope @ W_UK_T, then against the latent cache */
            for (int64_t j = 0; j < l; j++)
                ql[q * l + j] = 0.0f;
            for (int64_t i = 0; i < p; i++)
                for (int64_t j = 0; j < l; j++)
                    ql[q * l + j] += qn[i] * widen_bf16(uk[(h * p + i) * l + j]);
            for (int64_t s = 0; s < t; s++)
                logits2[(h * b + q) * t + s] = dot_f32(ql + q * l, latent + s * l, l) + dot_f32(qr, k_pe + s * r, r);
        }
    double mean = 0.0, var = 0.0;
    const int64_t m = n * b * t;
    for (int64_t i = 0; i < m; i++)
        mean += logits[i];
    mean /= (double)m;
    for (int64_t i = 0; i < m; i++)
        var += (logits[i] - mean) * (logits[i] - mean);
    const float spread = m > 1 ? (float)sqrt(var / (double)(m - 1)) : 0.0f;
    const float temperature = spread > 0.0f ? spread : 1.0f;
    double dd = 0.0, rr = 0.0;
    for (int64_t h = 0; h < n; h++)
        for (int64_t q = 0; q < b; q++) {
            float *a1 = logits + (h * b + q) * t, *a2 = logits2 + (h * b + q) * t;
            softmax_row(a1, t, temperature);
            softmax_row(a2, t, temperature);
            float *x = ql + q * l; /* attn2 @ latent: [L] */
            for (int64_t j = 0; j < l; j++)
                x[j] = 0.0f;
            for (int64_t s = 0; s < t; s++)
                for (int64_t j = 0; j < l; j++)
                    x[j] += a2[s] * latent[s * l + j];
            for (int64_t k = 0; k < v; k++)
                row[k] = 0.0f;
            for (int64_t j = 0; j < l; j++)
                for (int64_t k = 0; k < v; k++)
                    row[k] += x[j] * widen_bf16(uv[(h * l + j) * v + k]);
            for (int64_t k = 0; k < v; k++) {
                float ref = 0.0f;
                for (int64_t s = 0; s < t; s++)
                    ref += a1[s] * kv[(h * t + s) * pv + p + k];
                dd += ((double)row[k] - ref) * ((double)row[k] - ref);
                rr += (double)ref * ref;
            }
        }
    err = rr > 0.0 ? sqrt(dd / rr) : (dd == 0.0 ? 0.0 : INFINITY);
done:
    free(kv), free(logits), free(logits2), free(ql), free(row);
    return err;
}

/* The totals of mla_fp8_bound_rows' n rows, for verify's stats: out = {sum dd, sum xx, sum yy,
 * max max_abs, max max_ratio (NaN sticks), sum n_bad}. */
void mla_bound_totals(const double *dd, const double *xx, const double *yy, const float *max_abs,
                      const float *max_ratio, const int64_t *n_bad, int64_t n, double *out) {
    double sdd = 0.0, sxx = 0.0, syy = 0.0;
    float ma = 0.0f, mr = 0.0f;
    int64_t bad = 0;
    for (int64_t r = 0; r < n; r++) {
        sdd += dd[r], sxx += xx[r], syy += yy[r], bad += n_bad[r];
        ma = nan_max(ma, max_abs[r]), mr = nan_max(mr, max_ratio[r]);
    }
    out[0] = sdd, out[1] = sxx, out[2] = syy, out[3] = ma, out[4] = mr, out[5] = (double)bad;
}
