/* AVX-512's vector helpers (16 floats a register): exp, bf16 loads and rounding, stores as float32 or bf16,
 * horizontal sums and maxima, lane masks.
 *
 * INFER_AVX512 is 1 in builds for AVX-512 (F; every such build also has AVX2, whose helpers these use), and
 * INFER_AVX512_BF16 where it has AVX512-BF16's dot products (VDPBF16PS) too, INFER_AVX512_VNNI where it has
 * AVX512-VNNI's integer dot products (VPDPWSSD). The operations test these rather than
 * the compiler's macros. Include after isa_avx2.h. */
#ifndef INFER_ISA_AVX512_H
#define INFER_ISA_AVX512_H

#if defined(__AVX512F__)
#define INFER_AVX512 1
#else
#define INFER_AVX512 0
#endif

#if defined(__AVX512BF16__)
#define INFER_AVX512_BF16 1
#else
#define INFER_AVX512_BF16 0
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define INFER_AVX512_VNNI 1
#else
#define INFER_AVX512_VNNI 0
#endif

#if INFER_AVX512
/* exp8 for 16 floats. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    /* p * 2^n in one instruction (exact, as multiplying by 2^n's bits is), where the integer route takes three */
    return _mm512_maskz_scalef_ps((__mmask16)~tiny, p, n);
}

/* 16 bfloat16 values as floats. */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 floats rounded to bfloat16, as float_to_bf16 rounds. */
static inline __m256i bf16x16_from(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* The upper 8 floats of v (the lower 8 are _mm512_castps512_ps256(v)). */
static inline __m256 high_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* The sums of the two 8-float halves of v. */
static inline void hsum8_pair(__m512 v, float *low, float *high) {
    *low = hsum8(_mm512_castps512_ps256(v));
    *high = hsum8(high_half(v));
}

/* Stores 16 results at element `at` of y, as float32 or rounded to bf16. */
static inline void store16(__m512 out, void *y, int64_t at, int y_bf16) {
    if (y_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), bf16x16_from(out));
    else
        _mm512_storeu_ps((float *)y + at, out);
}

/* A register of 16 bf16 pairs as its even and odd elements, float32 (exact: the even one is its low half shifted
 * up, the odd one its high half masked). */
static inline __attribute__((always_inline)) void widen_pairs(__m512i pairs, __m512 *even, __m512 *odd) {
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* A mask of the first `left` of 16 lanes (none when left <= 0). */
static inline __mmask16 first_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* The sums of four registers' 16 lanes each, as lanes 0-3 (a's, b's, c's, d's): pairs interleaved, then 128-bit
 * lanes folded. Each sum's order depends on its own register only. */
static inline __attribute__((always_inline)) __m128 sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
    return _mm512_castps512_ps128(_mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, 0xB1)));
}

/* The largest of four lanes. */
static inline __attribute__((always_inline)) float max4(__m128 four) {
    const __m128 pairs = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
#endif

#endif
