/* Float weights quantized to GGUF's blocks of 32 (Q4_0, Q4_1, Q8_0) straight into the layout the block kernels read
 * (infer.kernels.cpu.blocks.pack_blocks'): the bytes of the gguf package's reference quantizers (and of
 * infer.kernels.cpu.blocks.gguf_blocks_of), in float32 arithmetic in their order; only the sign of a Q4_1 block's zero
 * minimum, where the block holds zeros of both signs, may differ (gguf's numpy takes -0.0, llama.cpp's C the first
 * zero), and it changes no value. The build's -std=c11 keeps GCC from contracting a product and a sum into one FMA,
 * which would round once where the reference rounds twice. */
#include "common.h"

/* The IEEE half nearest `value` (ties to even), as torch's and numpy's float16 conversions round: overflow to
 * infinity, subnormal halves below 2^-14. */
static inline uint16_t half_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    const uint32_t magnitude = bits & 0x7fffffff;
    if (magnitude >= 0x7f800000) return sign | 0x7c00 | (magnitude > 0x7f800000 ? 0x200 : 0);  /* inf, NaN */
    if (magnitude >= 0x477ff000) return sign | 0x7c00;  /* 65520 and up round to infinity */
    if (magnitude < 0x38800000) {  /* below 2^-14: adding 0.5 (whose ulp is 2^-24) rounds to the subnormal's step */
        float shifted, low;
        memcpy(&low, &magnitude, sizeof low);
        shifted = low + 0.5f;
        uint32_t rounded;
        memcpy(&rounded, &shifted, sizeof rounded);
        return sign | (uint16_t)(rounded - 0x3f000000);
    }
    uint32_t half = ((magnitude >> 23) - 112) << 10 | (magnitude >> 13 & 0x3ff);
    const uint32_t rest = magnitude & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;  /* a carry into the exponent is right */
    return sign | (uint16_t)half;
}

static inline float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

static inline uint8_t nibble(float value) {  /* truncated and clamped to 0..15, as the reference's casts */
    const float whole = truncf(value);
    return (uint8_t)(whole < 0.0f ? 0.0f : whole > 15.0f ? 15.0f : whole);
}

/* A block's smallest and largest values, and its largest magnitude with the first value of that magnitude. */
static inline void block_extremes(const float *x, float *low, float *high, float *amax, float *largest) {
#if INFER_AVX512
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
    *low = _mm512_reduce_min_ps(_mm512_min_ps(a, b));
    *high = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    *amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
    const __m512 top = _mm512_set1_ps(*amax);
    const __mmask16 in_a = _mm512_cmp_ps_mask(abs_a, top, _CMP_EQ_OQ), in_b = _mm512_cmp_ps_mask(abs_b, top, _CMP_EQ_OQ);
    *largest = x[in_a ? __builtin_ctz(in_a) : in_b ? 16 + __builtin_ctz(in_b) : 0];
#else
    *low = *high = *largest = x[0], *amax = fabsf(x[0]);
    for (int j = 1; j < 32; j++) {
        *low = x[j] < *low ? x[j] : *low;
        *high = x[j] > *high ? x[j] : *high;
        if (fabsf(x[j]) > *amax) *amax = fabsf(x[j]), *largest = x[j];
    }
#endif
}

/* One row's block of 32 as `kind`: its scales (d, and Q4_1's minimum) and its 32 quants in column order (0-15; Q8_0:
 * the int8 value plus 128). */
#if INFER_AVX512
/* 16 values' quants as bytes: trunc(x * id + add) clamped to 0..15 (Q4_0, Q4_1 with x less the minimum). */
static inline void nibbles16(__m512 x, float id, float add, uint8_t *q) {
    const __m512 value = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(id)), _mm512_set1_ps(add));
    __m512 whole = _mm512_roundscale_ps(value, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    whole = _mm512_min_ps(_mm512_max_ps(whole, _mm512_setzero_ps()), _mm512_set1_ps(15.0f));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(whole)));
}

/* 16 values' Q8_0 quants plus 128: x * id rounded half away from zero. */
static inline void int8s16(__m512 x, float id, uint8_t *q) {
    const __m512 scaled = _mm512_mul_ps(x, _mm512_set1_ps(id)), magnitude = _mm512_abs_ps(scaled);
    const __m512 whole = _mm512_roundscale_ps(magnitude, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 twice = _mm512_mul_ps(_mm512_set1_ps(2.0f), _mm512_sub_ps(magnitude, whole));
    __m512 rounded = _mm512_add_ps(whole, _mm512_roundscale_ps(twice, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    const __mmask16 negative = _mm512_cmp_ps_mask(scaled, _mm512_setzero_ps(), _CMP_LT_OQ);
    rounded = _mm512_mask_sub_ps(rounded, negative, _mm512_setzero_ps(), rounded);
    const __m512i shifted = _mm512_add_epi32(_mm512_cvttps_epi32(rounded), _mm512_set1_epi32(128));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(shifted));
}
#endif

static void quantize_block(const float *x, int64_t kind, uint16_t *d, uint16_t *m, uint8_t *q) {
    float low, high, amax, largest;
    block_extremes(x, &low, &high, &amax, &largest);
    if (kind == KIND_Q4_0) {  /* the value of largest magnitude (the first such) is -8 d */
        const float scale = largest / -8.0f, id = inverse(scale);
        *d = half_of(scale);
#if INFER_AVX512
        nibbles16(_mm512_loadu_ps(x), id, 8.5f, q), nibbles16(_mm512_loadu_ps(x + 16), id, 8.5f, q + 16);
#else
        for (int j = 0; j < 32; j++) q[j] = nibble(x[j] * id + 8.5f);
#endif
    } else if (kind == KIND_Q4_1) {  /* min + d q */
        const float scale = (high - low) / 15.0f, id = inverse(scale);
        *d = half_of(scale), *m = half_of(low);
#if INFER_AVX512
        const __m512 minimum = _mm512_set1_ps(low);
        nibbles16(_mm512_sub_ps(_mm512_loadu_ps(x), minimum), id, 0.5f, q);
        nibbles16(_mm512_sub_ps(_mm512_loadu_ps(x + 16), minimum), id, 0.5f, q + 16);
#else
        for (int j = 0; j < 32; j++) q[j] = nibble((x[j] - low) * id + 0.5f);
#endif
    } else {  /* Q8_0: d = amax / 127, rounded half away from zero */
        const float scale = amax / 127.0f, id = inverse(scale);
        *d = half_of(scale);
#if INFER_AVX512
        int8s16(_mm512_loadu_ps(x), id, q), int8s16(_mm512_loadu_ps(x + 16), id, q + 16);
#else
        for (int j = 0; j < 32; j++) {
            const float scaled = x[j] * id, magnitude = fabsf(scaled), whole = floorf(magnitude);
            const float rounded = whole + floorf(2.0f * (magnitude - whole));
            q[j] = (uint8_t)((int)(scaled < 0.0f ? -rounded : rounded) + 128);
        }
#endif
    }
}

int64_t infer_quantize_blocks(const float *w, int64_t kind, int64_t n_out, int64_t k, uint8_t *out) {
    if (kind != KIND_Q4_0 && kind != KIND_Q4_1 && kind != KIND_Q8_0) return 0;
    const int64_t blocks = k / 32, groups = (n_out + 3) / 4;
    const int64_t record = kind == KIND_Q4_0 ? 72 : kind == KIND_Q4_1 ? 80 : 136, scale_bytes = kind == KIND_Q4_1 ? 16 : 8;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = out + (g * blocks + b) * record;
            uint16_t d[4] = {0}, m[4] = {0};
            uint8_t q[4][32];
            for (int r = 0; r < 4; r++) {
                if (g * 4 + r < n_out)
                    quantize_block(w + (g * 4 + r) * k + b * 32, kind, &d[r], &m[r], q[r]);
                else  /* padding rows: zero blocks */
                    memset(q[r], kind == KIND_Q8_0 ? 128 : 0, 32);
            }
            memcpy(rec, d, 8);
            if (kind == KIND_Q4_1) memcpy(rec + 8, m, 8);
            uint8_t *quants = rec + scale_bytes;
            if (kind == KIND_Q8_0) {
                memcpy(quants, q, 128);
                continue;
            }
            for (int c = 0; c < 32; c++) {  /* rows 0 and 2, then 1 and 3, two nibbles a byte */
                quants[c] = (uint8_t)(q[0][c] | q[2][c] << 4);
                quants[32 + c] = (uint8_t)(q[1][c] | q[3][c] << 4);
            }
        }
    }
    return 1;
}
