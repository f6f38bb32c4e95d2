/* infer's CPU kernels: the small float32 ops of a step fused into one pass each, linear layers over packed fp16
 * weights for a few rows, a layer's dense parts for a few tokens in two calls, and paged attention that reads K/V
 * straight from the pool through the block tables (no gather).
 *
 * Built once per machine by infer/cpu_kernels.py (gcc -O3 -march=native -fopenmp) and called through ctypes.
 * Every pointer is to float32 / int64 / int32 / fp16 memory owned by torch tensors; the Python side checks shapes,
 * dtypes and contiguity. OpenMP here is torch's own runtime (libgomp is already loaded when this library
 * is), so both share one thread pool.
 */

#define _DEFAULT_SOURCE /* syscall() under -std=c11, for AMX's permission request */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ---- exp ----------------------------------------------------------------------------------------------------- */

#ifdef __AVX2__
/* exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for exp(r), times 2^n (Cephes'
 * coefficients; relative error about 2e-7, like expf). Inputs below -87.3 give 0 (softmax never needs more). */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    x = _mm256_min_ps(x, hi);
    __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef __AVX512F__
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
#endif

/* y[i] = exp(x[i] - shift), returns the sum of y. */
static float exp_shifted_sum(float *x, int64_t n, float shift) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX512F__
    __m512 wide = _mm512_setzero_ps();
    const __m512 wide_shift = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16) {
        const __m512 y = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), wide_shift));
        _mm512_storeu_ps(x + i, y);
        wide = _mm512_add_ps(wide, y);
    }
    total = _mm512_reduce_add_ps(wide);
#endif
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), s = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 y = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(x + i, y);
        acc = _mm256_add_ps(acc, y);
    }
    total += hsum8(acc);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - shift);
        total += x[i];
    }
    return total;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX512F__
    __m512 wide = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) wide = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), wide);
    total = _mm512_reduce_add_ps(wide);
#endif
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total += hsum8(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* ---- linear layers over 16-bit or int8 weights for a few rows ------------------------------------------------- */

/* How a packed weight is stored: IEEE half, bfloat16 (a float's upper half: converting is a shift, exact), or int8
 * with float scales. */
enum { KIND_F16 = 0, KIND_I8 = 1, KIND_BF16 = 2 };

/* Elements of a row-wise op (norm, SiLU, a GEMM input's rounding) from which its rows are split over the threads:
 * a large decode step's 64 x 576 rows were one thread's while the other waited. */
#define PARALLEL_ELEMENTS 16384

/* The float value of an IEEE half (bits h). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  /* zero or subnormal: mantissa * 2^-24 */
        float value = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -value : value;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* A float rounded to the nearest bfloat16 (ties to even; the inputs here are finite). */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __AVX2__
/* 8 bfloat16 values as floats. */
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#ifdef __AVX512F__
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
#endif

/* n floats rounded to bfloat16 (ties to even). */
static void floats_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), bf16x16_from(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* n bfloat16 values as floats (exact). */
static inline __attribute__((always_inline)) void bf16_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, bf16x16_load(src + i));
#endif
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16x8_load(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

/* Weight c (0 to 7) of row i (0 to 3) of a chunk of a packed block, as a float. */
static inline float packed_weight(const void *chunk, int i, int c, const int kind) {
    if (kind == KIND_I8) return (float)((const int8_t *)chunk)[i * 8 + c];
    const uint16_t bits = ((const uint16_t *)chunk)[i * 8 + c];
    return kind == KIND_BF16 ? bf16_to_float(bits) : half_to_float(bits);
}

#if defined(__AVX2__) && defined(__F16C__)
/* The 8 weights of row i (0 to 3) of a chunk of a packed block, as floats. */
static inline __m256 packed_row8(const void *chunk, int i, const int kind) {
    if (kind == KIND_I8) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)chunk + i * 8));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    const uint16_t *row = (const uint16_t *)chunk + i * 8;
    return kind == KIND_BF16 ? bf16x8_load(row) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row));
}
#endif

#ifdef __AVX512F__
/* Rows 2 * pair and 2 * pair + 1 of a chunk of a packed block: 16 floats, the first row's 8 weights then the
 * second's (one zmm register holds half of a 64-byte chunk). */
static inline __m512 packed_pair16(const void *chunk, int pair, const int kind) {
    if (kind == KIND_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)chunk +
                                                                                          pair * 16))));
    const uint16_t *rows = (const uint16_t *)chunk + pair * 16;
    return kind == KIND_BF16 ? bf16x16_load(rows) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rows));
}

/* The sums of the two 8-float halves of v. */
static inline void hsum8_pair(__m512 v, float *low, float *high) {
    *low = hsum8(_mm512_castps512_ps256(v));
    *high = hsum8(high_half(v));
}
#endif

/* Int8 weights come with one float scale per `group` consecutive weights of a row (a multiple of 8 dividing k; k
 * for one scale per row), laid out per block as [k / group][4]: the scales of the block's four rows for each group
 * of columns. */

/* Rows of x one pass of block_dot takes at most: with AVX-512's 32 registers, 8 (16 accumulators, 2 weight vectors,
 * x); with AVX2's 16, 3 (12 accumulators, 4 weight vectors; x is an FMA memory operand). */
#ifdef __AVX512F__
#define PASS_ROWS 8
#else
#define PASS_ROWS 3
#endif

/* Software prefetch of the GEMV's weight stream, ahead of the 64 bytes at `chunk` (into the next block at a block's
 * end, which this thread takes next): into L1 1 KB ahead and into L2 INFER_GEMV_L2_AHEAD (6 KB) ahead. An L1
 * prefetch alone keeps too few lines in flight (the L1's fill buffers are the limit). On 2 cores of an AMX Xeon, the
 * 30 layers and the output head in bf16 (`benchmarks/cpu_kernels.py --only prefetch`): 1 row 24.7-25.1 -> 27.3-28.2
 * GB/s with the L2 prefetch, 4 rows 20.6-21.5 -> 25.1-25.7, 8 rows 17.9-18.3 -> 19.6-20.5; fp16 alike. Against
 * the 2 KB L1-only prefetch before it, one row went 19.7 -> 24.6-26.9 GB/s, and the AVX2 build there 19.9 -> 23.8.
 * Earlier, on an AVX2 EPYC, the L1 prefetch had beaten the hardware prefetcher alone from 2 rows of x on (5 rows
 * 13.8 vs 16.0 ms for the 30 layers). */
#ifndef INFER_GEMV_L2_AHEAD
#define INFER_GEMV_L2_AHEAD 6144  /* 0: no L2 prefetch (benchmarks/cpu_kernels.py --only prefetch builds it so) */
#endif
static inline __attribute__((always_inline)) void gemv_prefetch(const char *chunk) {
    __builtin_prefetch(chunk + 1024, 0, 3);  /* prefetcht0 on x86 */
#if INFER_GEMV_L2_AHEAD
    __builtin_prefetch(chunk + INFER_GEMV_L2_AHEAD, 0, 2);  /* prefetcht1 */
#endif
}

/* sums[r][i] = x[r] . (output row i of the block) for `count` (1 to PASS_ROWS, a constant once inlined) rows of x
 * and a block of four output rows laid out [k / 8][4][8] (fp16, bf16, or int8 times `scales`, by `kind`): one
 * sequential stream, each chunk holding 8 weights of each of the 4 rows, converted once and used for every row of
 * x. */
static inline __attribute__((always_inline)) void block_dot(const float *x, int64_t k, const void *block,
                                                            const float *scales, int64_t group,
                                                            float sums[PASS_ROWS][4], const int count,
                                                            const int kind) {
    const int int8 = kind == KIND_I8;
    const int64_t width = int8 ? 1 : 2;  /* bytes per weight */
    /* int8 with one scale per row: scale the sums at the end; with smaller groups: per group (one row of x) or per
     * converted weight (more rows: no registers left for per-group sums) */
    const int per_row = int8 && group == k;
#if defined(__AVX512F__)
    /* a chunk is two registers (rows 0-1, rows 2-3); x's 8 floats are broadcast to both halves */
    __m512 acc[PASS_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    /* group scales: [s0 x 8, s1 x 8] and [s2 x 8, s3 x 8] from the four scales of a group */
    const __m512i first_pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second_pair = _mm512_add_epi32(first_pair, _mm512_set1_epi32(2));
    __m512 scale01 = _mm512_setzero_ps(), scale23 = scale01;
    const float *group_scales = scales;
    for (int64_t c = 0, left = 0; c < k; c += 8, left -= 8) {
        const char *chunk = (const char *)block + c * 4 * width;
        gemv_prefetch(chunk);
        __m512 w01 = packed_pair16(chunk, 0, kind), w23 = packed_pair16(chunk, 1, kind);
        if (int8 && !per_row) {
            if (left == 0) {
                const __m512 four = _mm512_castps128_ps512(_mm_loadu_ps(group_scales));
                scale01 = _mm512_permutexvar_ps(first_pair, four);
                scale23 = _mm512_permutexvar_ps(second_pair, four);
                group_scales += 4;
                left = group;
            }
            w01 = _mm512_mul_ps(w01, scale01);
            w23 = _mm512_mul_ps(w23, scale23);
        }
        for (int r = 0; r < count; r++) {
            const __m256d eight = _mm256_castps_pd(_mm256_loadu_ps(x + r * k + c));
            const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(eight));
            acc[r][0] = _mm512_fmadd_ps(xv, w01, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w23, acc[r][1]);
        }
    }
    for (int r = 0; r < count; r++) {
        hsum8_pair(acc[r][0], &sums[r][0], &sums[r][1]);
        hsum8_pair(acc[r][1], &sums[r][2], &sums[r][3]);
        if (per_row)
            for (int i = 0; i < 4; i++) sums[r][i] *= scales[i];
    }
#elif defined(__AVX2__) && defined(__F16C__)
    if (int8 && count == 1 && !per_row) {
        /* one row of x, decode at batch 1: sums per group, each scaled once (scaling every weight instead measured
         * 5.0 vs 4.6 ms over the 30 layers' projections at groups of 32) */
        __m256 total[4], part[4];
        for (int i = 0; i < 4; i++) total[i] = _mm256_setzero_ps();
        for (int64_t g = 0, index = 0; g < k; g += group, index++) {
            for (int i = 0; i < 4; i++) part[i] = _mm256_setzero_ps();
            for (int64_t c = g; c < g + group; c += 8) {
                const char *chunk = (const char *)block + c * 4;
                gemv_prefetch(chunk);
                __m256 xv = _mm256_loadu_ps(x + c);
                for (int i = 0; i < 4; i++) part[i] = _mm256_fmadd_ps(xv, packed_row8(chunk, i, kind), part[i]);
            }
            for (int i = 0; i < 4; i++)
                total[i] = _mm256_fmadd_ps(part[i], _mm256_broadcast_ss(scales + index * 4 + i), total[i]);
        }
        for (int i = 0; i < 4; i++) sums[0][i] = hsum8(total[i]);
        return;
    }
    __m256 acc[PASS_ROWS][4];
    for (int r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    const float *group_scales = scales;
    for (int64_t c = 0, left = group; c < k; c += 8, left -= 8) {
        const char *chunk = (const char *)block + c * 4 * width;
        gemv_prefetch(chunk);
        if (left == 0) {
            group_scales += 4;
            left = group;
        }
        __m256 weights[4];
        for (int i = 0; i < 4; i++) {
            weights[i] = packed_row8(chunk, i, kind);
            if (int8 && !per_row) weights[i] = _mm256_mul_ps(weights[i], _mm256_broadcast_ss(group_scales + i));
        }
        for (int r = 0; r < count; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * k + c);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_fmadd_ps(xv, weights[i], acc[r][i]);
        }
    }
    for (int r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) sums[r][i] = hsum8(acc[r][i]) * (per_row ? scales[i] : 1.0f);
#else
    for (int r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) {
            float total = 0.0f;
            for (int64_t c = 0; c < k; c++) {
                float w = packed_weight((const char *)block + (c / 8) * 32 * width, i, c % 8, kind);
                if (int8) w *= scales[(c / group) * 4 + i];
                total += x[r * k + c] * w;
            }
            sums[r][i] = total;
        }
    (void)per_row;
#endif
}

/* How many rows of x the next pass of block_dot takes when `left` are left: PASS_ROWS while that many are left; on
 * AVX2 passes of 3 rows, then 2 (4 = 2 + 2, 5 = 3 + 2, 7 = 3 + 2 + 2), or 1 when only one is left. */
static inline int pass_rows(int64_t left) {
#ifdef __AVX512F__
    return left >= PASS_ROWS ? PASS_ROWS : (int)left;
#else
    return left == 1 ? 1 : (left == 2 || left == 4) ? 2 : 3;
#endif
}

/* y[m, n] = w[n, :] . x[m, :] + bias[n] (no bias when NULL) for `rows` rows of x (k floats each), y [rows, n_out],
 * with w [n_out, k] packed by `infer.cpu_kernels.pack_weights` in blocks of four output rows,
 * [n_out / 4][k / 8][4][8] (n_out % 4 == 0, k % 8 == 0), fp16, bf16, or int8 with `scales` packed by
 * `infer.cpu_kernels.pack_scales` ([n_out / 4][groups][4], groups scales per row). Meant for the few rows of a
 * decode or verification step, which stream every weight from memory once: each block is one sequential stream
 * (row-major rows would be four), reused for up to PASS_ROWS rows of x while in registers and for the next ones
 * while in L1. Split over the threads by blocks. */
static inline __attribute__((always_inline)) void linear_packed(const float *x, int64_t rows, int64_t k,
                                                                const void *w, const float *scales, int64_t groups,
                                                                const float *bias, float *y, int64_t n_out,
                                                                const int kind) {
    const int int8 = kind == KIND_I8;
    const int64_t blocks = n_out / 4, block_bytes = 4 * k * (int8 ? 1 : 2);
    const int64_t group = int8 ? k / groups : k;
#pragma omp parallel for schedule(static) if (rows * n_out * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const void *block = (const char *)w + b * block_bytes;
        const float *own_scales = int8 ? scales + b * 4 * groups : NULL;
        for (int64_t m = 0; m < rows;) {
            const int count = pass_rows(rows - m);
            float sums[PASS_ROWS][4];
            switch (count) {  /* a constant count per copy: its accumulators stay in registers */
/* the kind as a constant too: inside the OpenMP region the compiler no longer sees the constant linear_packed was
 * inlined with, and tested the kind around every chunk's conversion (cache-hot on AVX2, 256 x 1536 fp16: 3 rows
 * of x 23.3 -> 19.4 cycles a chunk, 8 rows 42.3 -> 36.7 once it is hoisted) */
#define BLOCK_DOT_KIND(n, kind_) block_dot(x + m * k, k, block, own_scales, group, sums, n, kind_)
#define BLOCK_DOT_CASE(n) \
                case n: \
                    if (kind == KIND_F16) BLOCK_DOT_KIND(n, KIND_F16); \
                    else if (kind == KIND_BF16) BLOCK_DOT_KIND(n, KIND_BF16); \
                    else BLOCK_DOT_KIND(n, KIND_I8); \
                    break;
                BLOCK_DOT_CASE(1)
                BLOCK_DOT_CASE(2)
                BLOCK_DOT_CASE(3)
#if PASS_ROWS > 3
                BLOCK_DOT_CASE(4)
                BLOCK_DOT_CASE(5)
                BLOCK_DOT_CASE(6)
                BLOCK_DOT_CASE(7)
                BLOCK_DOT_CASE(8)
#endif
#undef BLOCK_DOT_CASE
#undef BLOCK_DOT_KIND
            }
            for (int r = 0; r < count; r++)
                for (int i = 0; i < 4; i++) {
                    const int64_t n = b * 4 + i;
                    y[(m + r) * n_out + n] = sums[r][i] + (bias ? bias[n] : 0.0f);
                }
            m += count;
        }
    }
}

/* fp16 weights (see linear_packed). */
void infer_linear_f16(const float *x, int64_t rows, int64_t k, const uint16_t *w, const float *bias, float *y,
                      int64_t n_out) {
    linear_packed(x, rows, k, w, NULL, 0, bias, y, n_out, KIND_F16);
}

/* bfloat16 weights (see linear_packed): the bf16 model's own weights, float32 activations and sums. */
void infer_linear_bf16(const float *x, int64_t rows, int64_t k, const uint16_t *w, const float *bias, float *y,
                       int64_t n_out) {
    linear_packed(x, rows, k, w, NULL, 0, bias, y, n_out, KIND_BF16);
}

/* int8 weights with `groups` float scales per row (see linear_packed): a bit over half of fp16's bytes. */
void infer_linear_i8(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *scales, int64_t groups,
                     const float *bias, float *y, int64_t n_out) {
    linear_packed(x, rows, k, w, scales, groups, bias, y, n_out, KIND_I8);
}

/* ---- bf16 GEMM on AMX tiles or AVX512-BF16 ----------------------------------------------------------------- */

/* y [rows, n_out] = x [rows, k] . w^T (+ bias) with bf16 weights laid out by `infer.cpu_kernels.pack_tiles` for
 * AMX's TDPBF16PS: per block of 32 output columns and per 32 columns of k, two 1 KB B tiles (16 output columns
 * each), row p holding the pairs (w[n][2p], w[n][2p + 1]) of the tile's 16 n: [n_out / 32][k / 32][2][16][16][2]
 * (n_out % 32 == 0, k % 32 == 0). x (float32, or bf16 when `x_bf16`) is rounded to bf16 into a buffer (padded to
 * 32 rows for AMX); products accumulate in float32; y is float32, or bf16 (rounded once) when `y_bf16`. Each thread
 * takes blocks of 32 output columns and runs every block of rows of x over it: a block's weights (32 k bf16s per
 * column) come from memory once and stay in L2 for the next rows. On AMX (when the OS allows it) 2 x 2 tiles of
 * results per pass; else with AVX512-BF16 (VDPBF16PS reads each B tile row as one register: the same layout)
 * DOT_ROWS rows per pass; else the same arithmetic in plain C (the reference the tests hold the other two to).
 * With `fma` (AVX-512 builds) x stays float32 and the products are float32 FMAs over the widened weights instead
 * (block_fma_bf16), for CPUs where those outrun the bf16 dot products. Rows of x go in chunks of
 * TILE_CHUNK_ROWS, which stay in L2 while every block of weights passes over them (a 2048-row prefill over all rows
 * at once read x from L3 on AMX: 1016 vs 596 ms for four 512-token prompts). */
#define TILE_CHUNK_ROWS 256
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* This thread's tile configuration: all eight tiles 16 rows of 64 bytes (what every AMX kernel here uses). */
static void load_full_tiles(void) {
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

/* 1 when this build multiplies on AMX tiles and Linux lets the process use them (asked for once). */
static int amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
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

/* Rows 0..count-1 of one block's sums (its two halves of 16 columns) plus the bias (NULL: none) into y, rows of n_out
 * from element `at`: the tile kernels' last step, where the bias is first read (held through their loops it pushed
 * the weights out of registers). */
static inline __attribute__((always_inline)) void store_block(__m512 (*acc)[2], int count, const float *bias,
                                                              void *y, int64_t at, int64_t n_out, int y_bf16) {
    const __m512 add0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 add1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < count; r++) {
        store16(_mm512_add_ps(acc[r][0], add0), y, at + r * n_out, y_bf16);
        store16(_mm512_add_ps(acc[r][1], add1), y, at + r * n_out + 16, y_bf16);
    }
}
#endif

/* Stores a 16 x 16 float tile of results (`stride` floats apart) at rows m, columns n of y: the rows below
 * `rows`, plus bias, as float32 or bf16. */
static void store_tile(const float *tile, int64_t stride, int64_t m, int64_t rows, int64_t n, const float *bias,
                       void *y, int64_t n_out, int y_bf16) {
#ifdef __AVX512F__
    const __m512 add = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int64_t r = 0; r < 16 && m + r < rows; r++)
        store16(_mm512_add_ps(_mm512_loadu_ps(tile + r * stride), add), y, (m + r) * n_out + n, y_bf16);
#else
    for (int64_t r = 0; r < 16 && m + r < rows; r++) {
        float out[16];
        for (int c = 0; c < 16; c++) out[c] = tile[r * stride + c] + (bias ? bias[n + c] : 0.0f);
        if (y_bf16)
            floats_to_bf16(out, (uint16_t *)y + (m + r) * n_out + n, 16);
        else
            memcpy((float *)y + (m + r) * n_out + n, out, sizeof out);
    }
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Over xb (bf16, `padded` rows): each thread takes blocks of 32 output columns, 2 x 2 tiles of results per pass. */
static void tiles_amx(const uint16_t *xb, int64_t rows, int64_t padded, int64_t k, const uint16_t *w,
                      const float *bias, void *y, int y_bf16, int64_t n_out) {
    const int64_t k_tiles = k / 32, blocks = n_out / 32;
#pragma omp parallel
    {
        load_full_tiles();
        float results[4][16][16];
        for (int64_t chunk = 0; chunk < padded; chunk += TILE_CHUNK_ROWS) {
            const int64_t chunk_end = chunk + TILE_CHUNK_ROWS < padded ? chunk + TILE_CHUNK_ROWS : padded;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const uint16_t *wb = w + b * k_tiles * 1024;
                const int64_t n = b * 32;
                for (int64_t m = chunk; m < chunk_end; m += 32) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    const uint16_t *x0 = xb + m * k, *x1 = x0 + 16 * k;
                    for (int64_t t = 0; t < k_tiles; t++) {
                        _tile_loadd(4, x0 + t * 32, k * 2);
                        _tile_loadd(5, x1 + t * 32, k * 2);
                        _tile_loadd(6, wb + t * 1024, 64);
                        _tile_loadd(7, wb + t * 1024 + 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    const int direct = !bias && !y_bf16;
                    if (direct && m + 32 <= rows) {  /* whole tiles straight into y */
                        float *out = (float *)y + m * n_out + n;
                        _tile_stored(0, out, n_out * 4);
                        _tile_stored(1, out + 16, n_out * 4);
                        _tile_stored(2, out + 16 * n_out, n_out * 4);
                        _tile_stored(3, out + 16 * n_out + 16, n_out * 4);
                        continue;
                    }
                    _tile_stored(0, results[0], 64);
                    _tile_stored(1, results[1], 64);
                    _tile_stored(2, results[2], 64);
                    _tile_stored(3, results[3], 64);
                    for (int q = 0; q < 4; q++)
                        store_tile(&results[q][0][0], 16, m + (q / 2) * 16, rows, n + (q % 2) * 16, bias, y, n_out,
                                   y_bf16);
                }
            }
        }
        _tile_release();
    }
}
#endif

#if defined(__AVX512F__)
/* The share of k-tile t (of k / 32) of a pass's slice of the next block's weights (tiles_avx512's `ahead`,
 * ahead_bytes of it): its lines requested into L2, spread evenly over the pass. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *ahead, int64_t ahead_bytes, int64_t k,
                                                                 int64_t t) {
    const int64_t step = (ahead_bytes / 64 + k / 32 - 1) / (k / 32);
    for (int64_t line = t * step; line < (t + 1) * step && line * 64 < ahead_bytes; line++)
        _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
}
#endif

#if defined(__AVX512BF16__)
/* Rows of x one pass of the AVX512-BF16 kernel takes: 2 accumulators each (the block's two 16-column halves), 24
 * of the 32 registers, plus the two weight vectors; x's pairs are broadcast from memory. */
#define DOT_ROWS 12

/* Rows 0..count-1 of y (rows of n_out from element `at`; float32 or bf16) = rows of xb (bf16, k each) times one
 * block of 32 output columns in pack_tiles' layout (+ bias from column n): per pair p of k, one register of each
 * half's 16 (w[n][2p], w[n][2p + 1]) pairs, the very layout VDPBF16PS reads. The sums stay in registers until
 * stored (store_block). */
static inline __attribute__((always_inline)) void block_dot_bf16(const uint16_t *xb, int64_t k, const uint16_t *wb,
                                                                 const float *bias, void *y, int64_t at,
                                                                 int64_t n_out, int y_bf16, const char *ahead,
                                                                 int64_t ahead_bytes, const int count) {
    __m512 acc[DOT_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k / 32; t++) {
        const uint16_t *tile = wb + t * 1024;
        prefetch_ahead(ahead, ahead_bytes, k, t);
        for (int p = 0; p < 16; p++) {
            _mm_prefetch((const char *)(tile + 1024 + p * 32), _MM_HINT_T0);  /* the next 32 columns of k */
            _mm_prefetch((const char *)(tile + 1536 + p * 32), _MM_HINT_T0);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + p * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + 512 + p * 32);
            for (int r = 0; r < count; r++) {
                int32_t pair;
                memcpy(&pair, xb + r * k + t * 32 + 2 * p, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
    }
    store_block(acc, count, bias, y, at, n_out, y_bf16);
}

/* Up to DOT_ROWS rows of xb over one block (block_dot_bf16 with a constant count per copy, so its sums stay in
 * registers). */
static void pass_dot_bf16(const uint16_t *xb, int64_t k, const uint16_t *wb, const float *bias, void *y, int64_t at,
                          int64_t n_out, int y_bf16, const char *ahead, int64_t ahead_bytes, int count) {
    switch (count) {
#define DOT_CASE(c) case c: block_dot_bf16(xb, k, wb, bias, y, at, n_out, y_bf16, ahead, ahead_bytes, c); break;
        DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6)
        DOT_CASE(7) DOT_CASE(8) DOT_CASE(9) DOT_CASE(10) DOT_CASE(11) DOT_CASE(12)
#undef DOT_CASE
    }
}
#endif

#if defined(__AVX512F__)
/* Rows of x one pass of the FMA kernel takes: 2 accumulators each, 16 of the 32 registers, plus the four widened
 * weight vectors and the broadcasts (12 rows made gcc spill). */
#define FMA_ROWS 8

/* block_dot_bf16's product with float32 FMAs (any AVX-512 build): rows of x (float32, not rounded to bf16) times
 * the block's bf16 weights, widened in registers (widen_pairs). Two FMAs per pair where VDPBF16PS takes one, at the
 * CPU's float32 rate: faster where that rate is more than half the dot products' (an Intel Xeon with AVX512-BF16 and
 * no AMX: 1.6x, level with MKL's float32 GEMM), and float32 products of the exact bf16 weights. */
static inline __attribute__((always_inline)) void block_fma_bf16(const float *x, int64_t k, const uint16_t *wb,
                                                                 const float *bias, void *y, int64_t at,
                                                                 int64_t n_out, int y_bf16, const char *ahead,
                                                                 int64_t ahead_bytes, const int count) {
    __m512 acc[FMA_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k / 32; t++) {
        const uint16_t *tile = wb + t * 1024;
        prefetch_ahead(ahead, ahead_bytes, k, t);
        for (int p = 0; p < 16; p++) {
            _mm_prefetch((const char *)(tile + 1024 + p * 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(tile + 1536 + p * 32), _MM_HINT_T0);
            __m512 even0, odd0, even1, odd1;
            widen_pairs(_mm512_loadu_si512(tile + p * 32), &even0, &odd0);
            widen_pairs(_mm512_loadu_si512(tile + 512 + p * 32), &even1, &odd1);
            for (int r = 0; r < count; r++) {
                const __m512 xe = _mm512_set1_ps(x[r * k + t * 32 + 2 * p]);
                const __m512 xo = _mm512_set1_ps(x[r * k + t * 32 + 2 * p + 1]);
                acc[r][0] = _mm512_fmadd_ps(xo, odd0, _mm512_fmadd_ps(xe, even0, acc[r][0]));
                acc[r][1] = _mm512_fmadd_ps(xo, odd1, _mm512_fmadd_ps(xe, even1, acc[r][1]));
            }
        }
    }
    store_block(acc, count, bias, y, at, n_out, y_bf16);
}

/* Up to FMA_ROWS rows of x over one block (block_fma_bf16, a constant count per copy). */
static void pass_fma_bf16(const float *x, int64_t k, const uint16_t *wb, const float *bias, void *y, int64_t at,
                          int64_t n_out, int y_bf16, const char *ahead, int64_t ahead_bytes, int count) {
    switch (count) {
#define FMA_CASE(c) case c: block_fma_bf16(x, k, wb, bias, y, at, n_out, y_bf16, ahead, ahead_bytes, c); break;
        FMA_CASE(1) FMA_CASE(2) FMA_CASE(3) FMA_CASE(4) FMA_CASE(5) FMA_CASE(6) FMA_CASE(7) FMA_CASE(8)
#undef FMA_CASE
    }
}

/* The product with AVX-512 instead of AMX: VDPBF16PS over xb (bf16 rows; AVX512-BF16 builds), or with `fma` the
 * float32 FMAs over x (float32 rows). Each thread takes blocks of 32 output columns and runs the chunk's rows over
 * each, a pass of rows at a time; the block's weights stay in L2 (L1 for small k) for the next rows. */
static void tiles_avx512(const void *x, int fma, int64_t rows, int64_t k, const uint16_t *w, const float *bias,
                         void *y, int y_bf16, int64_t n_out) {
#if defined(__AVX512BF16__)
    const int64_t pass = fma ? FMA_ROWS : DOT_ROWS;
#else
    const int64_t pass = FMA_ROWS;  /* the FMAs are all this build has */
    (void)fma;
#endif
    const int64_t blocks = n_out / 32;
#pragma omp parallel
    for (int64_t chunk = 0; chunk < rows; chunk += TILE_CHUNK_ROWS) {
        const int64_t chunk_end = chunk + TILE_CHUNK_ROWS < rows ? chunk + TILE_CHUNK_ROWS : rows;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *wb = w + b * (k / 32) * 1024;
            const float *own_bias = bias ? bias + b * 32 : NULL;
            /* the next block's weights (this thread's next, but at the end of its share) come from memory: its
             * passes ask for a slice of them each, into L2, while this block's are read from there */
            const int64_t block_bytes = (k / 32) * 2048, passes = (chunk_end - chunk + pass - 1) / pass;
            const int64_t slice = (block_bytes / passes + 63) / 64 * 64;
            const char *next = b + 1 < blocks ? (const char *)(wb + (k / 32) * 1024) : NULL;
            for (int64_t m = chunk, i = 0; m < chunk_end; m += pass, i++) {
                const int count = (int)(chunk_end - m < pass ? chunk_end - m : pass);
                const int64_t at = m * n_out + b * 32;
                const int64_t from = i * slice, bytes = next && from < block_bytes ?
                                                        (block_bytes - from < slice ? block_bytes - from : slice) : 0;
                const char *ahead = next ? next + from : NULL;
#if defined(__AVX512BF16__)
                if (!fma) {
                    pass_dot_bf16((const uint16_t *)x + m * k, k, wb, own_bias, y, at, n_out, y_bf16, ahead, bytes,
                                  count);
                    continue;
                }
#endif
                pass_fma_bf16((const float *)x + m * k, k, wb, own_bias, y, at, n_out, y_bf16, ahead, bytes, count);
            }
        }
    }
}
#endif

/* The same arithmetic in plain C: the reference the tests hold the other two to. */
static void tiles_portable(const uint16_t *xb, int64_t rows, int64_t k, const uint16_t *w, const float *bias,
                           void *y, int y_bf16, int64_t n_out) {
    const int64_t k_tiles = k / 32, blocks = n_out / 32;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m = 0; m < rows; m += 16) {
            for (int half = 0; half < 2; half++) {
                float tile[16][16] = {{0}};
                const uint16_t *wt = w + b * k_tiles * 1024 + half * 512;
                for (int64_t t = 0; t < k_tiles; t++)
                    for (int r = 0; r < 16 && m + r < rows; r++)
                        for (int p = 0; p < 16; p++) {
                            const float x0 = bf16_to_float(xb[(m + r) * k + t * 32 + 2 * p]);
                            const float x1 = bf16_to_float(xb[(m + r) * k + t * 32 + 2 * p + 1]);
                            for (int c = 0; c < 16; c++) {
                                const uint16_t *pair = wt + t * 1024 + p * 32 + c * 2;
                                tile[r][c] += x0 * bf16_to_float(pair[0]) + x1 * bf16_to_float(pair[1]);
                            }
                        }
                store_tile(&tile[0][0], 16, m, rows, b * 32 + half * 16, bias, y, n_out, y_bf16);
            }
        }
    }
}

/* How this build multiplies `infer_linear_tiles`: 2 on AMX tiles (built with AMX and allowed by the OS), 1 with
 * AVX512-BF16's dot products, 0 in plain C. */
int64_t infer_tile_kind(void) {
    if (amx_available()) return 2;
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

void infer_linear_tiles(const void *x, int64_t x_bf16, int64_t rows, int64_t k, const uint16_t *w,
                        const float *bias, void *y, int64_t y_bf16, int64_t n_out, int64_t fma) {
#if defined(__AVX512F__)
    if (fma) {  /* float32 rows as they are (bf16 ones widened, exactly) */
        float *widened = x_bf16 ? malloc(sizeof(float) * rows * k) : NULL;
        if (widened) bf16_to_floats((const uint16_t *)x, widened, rows * k);
        tiles_avx512(widened ? widened : x, 1, rows, k, w, bias, y, (int)y_bf16, n_out);
        free(widened);
        return;
    }
#else
    (void)fma;
#endif
    const int64_t kind = infer_tile_kind();
    const int64_t padded = kind == 2 ? (rows + 31) / 32 * 32 : rows;  /* AMX loads whole 16-row tiles of x */
    /* bf16 rows are read in place unless AMX needs them padded */
    uint16_t *copy = x_bf16 && padded == rows ? NULL : malloc(sizeof(uint16_t) * padded * k);
    const uint16_t *xb = copy ? copy : (const uint16_t *)x;
    if (copy) {
        memset(copy + rows * k, 0, sizeof(uint16_t) * (padded - rows) * k);
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_ELEMENTS)
        for (int64_t m = 0; m < rows; m++) {
            if (x_bf16)
                memcpy(copy + m * k, (const uint16_t *)x + m * k, sizeof(uint16_t) * k);
            else
                floats_to_bf16((const float *)x + m * k, copy + m * k, k);
        }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (kind == 2) tiles_amx(xb, rows, padded, k, w, bias, y, (int)y_bf16, n_out);
#endif
#if defined(__AVX512BF16__)
    if (kind == 1) tiles_avx512(xb, 0, rows, k, w, bias, y, (int)y_bf16, n_out);
#endif
    if (kind == 0) tiles_portable(xb, rows, k, w, bias, y, (int)y_bf16, n_out);
    free(copy);
}

/* The most rows of x one pass of the GEMV takes (PASS_ROWS): beyond them it streams the weights again. */
int64_t infer_pass_rows(void) { return PASS_ROWS; }

/* The SIMD the kernels were built with: 512 (AVX-512), 256 (AVX2 with F16C and FMA) or 0 (portable C). */
int64_t infer_simd_width(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__F16C__)
    return 256;
#else
    return 0;
#endif
}

/* Whether layer_linear multiplies `rows` rows on `tiles` with bf16 dot products, which round its input to bf16: then
 * the step rounds it where it makes it (the norm's or the SiLU's store), not in a copy. */
static inline int tiles_take_bf16(const uint16_t *tiles, int64_t tiles_fma, int64_t rows) {
    return tiles && !tiles_fma && rows > PASS_ROWS;
}

/* A projection of a layer, its weights stored as `kind` (`x` float32, or bf16 where tiles_take_bf16). */
static void layer_linear(const void *w, int64_t kind, const float *scales, int64_t groups, const uint16_t *tiles,
                         int64_t tiles_fma, const void *x, int x_bf16, int64_t rows, int64_t k, const float *bias,
                         float *y, int64_t n_out) {
    if (tiles && rows > PASS_ROWS)
        infer_linear_tiles(x, x_bf16, rows, k, tiles, bias, y, 0, n_out, tiles_fma);
    else if (kind == KIND_I8)
        infer_linear_i8(x, rows, k, w, scales, groups, bias, y, n_out);
    else if (kind == KIND_BF16)
        infer_linear_bf16(x, rows, k, w, bias, y, n_out);
    else
        infer_linear_f16(x, rows, k, w, bias, y, n_out);
}

/* ---- RMSNorm ------------------------------------------------------------------------------------------------- */

/* For each of `rows` rows of `dim` floats: if delta, residual += delta (in place); then
 * out = residual * rsqrt(mean(residual^2) + eps) * weight, as floats, or rounded to bfloat16 when `bf16_out`. */
static inline __attribute__((always_inline)) void add_rms_norm(float *residual, const void *delta, int delta_bf16,
                                                               void *out, const float *weight, int64_t rows,
                                                               int64_t dim, float eps, const int bf16_out) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *x = residual + r * dim;
        if (delta && delta_bf16) {  /* a bf16 GEMM's output, widened as it is added */
            const uint16_t *d = (const uint16_t *)delta + r * dim;
            int64_t i = 0;
#ifdef __AVX512F__
            for (; i + 16 <= dim; i += 16)
                _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), bf16x16_load(d + i)));
#endif
            for (; i < dim; i++) x[i] += bf16_to_float(d[i]);
        } else if (delta) {
            const float *d = (const float *)delta + r * dim;
            for (int64_t i = 0; i < dim; i++) x[i] += d[i];
        }
        float scale = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
        if (!bf16_out) {
            float *y = (float *)out + r * dim;
            for (int64_t i = 0; i < dim; i++) y[i] = weight[i] * (x[i] * scale);
            continue;
        }
        uint16_t *y = (uint16_t *)out + r * dim;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 factor = _mm512_set1_ps(scale);
        for (; i + 16 <= dim; i += 16)
            _mm256_storeu_si256((__m256i *)(y + i), bf16x16_from(_mm512_mul_ps(
                _mm512_loadu_ps(weight + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), factor))));
#endif
        for (; i < dim; i++) y[i] = float_to_bf16(weight[i] * (x[i] * scale));
    }
}

void infer_add_rms_norm(float *residual, const float *delta, float *out, const float *weight, int64_t rows,
                        int64_t dim, float eps) {
    add_rms_norm(residual, delta, 0, out, weight, rows, dim, eps, 0);
}

/* infer_add_rms_norm for any of the large steps' dtypes: delta float32 or bfloat16 (`delta_bf16`: a bf16 GEMM's
 * output, added without a float32 copy), the normed rows float32 or rounded to bfloat16 (`out_bf16`: the next
 * GEMM's input). */
void infer_add_rms_norm_mixed(float *residual, const void *delta, int64_t delta_bf16, void *out, int64_t out_bf16,
                              const float *weight, int64_t rows, int64_t dim, float eps) {
    if (out_bf16)
        add_rms_norm(residual, delta, (int)delta_bf16, out, weight, rows, dim, eps, 1);
    else
        add_rms_norm(residual, delta, (int)delta_bf16, out, weight, rows, dim, eps, 0);
}

/* ---- SiLU(gate) * up ----------------------------------------------------------------------------------------- */

/* gate_up: rows x (2 * width), gate first; out: rows x width, as floats or, with `bf16_out`, each value rounded to
 * bfloat16 as it is stored (the next bf16 GEMM's input; the same values as rounding the float result). */
static inline __attribute__((always_inline)) void silu_mul(const float *gate_up, void *out, int64_t rows,
                                                           int64_t width, const int bf16_out) {
#pragma omp parallel for if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *y = (float *)out + r * width;
        uint16_t *yb = (uint16_t *)out + r * width;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= width; i += 16) {
            const __m512 g = _mm512_loadu_ps(gate + i);
            const __m512 one = _mm512_set1_ps(1.0f);
            const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            const __m512 value = _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(up + i));
            if (bf16_out)
                _mm256_storeu_si256((__m256i *)(yb + i), bf16x16_from(value));
            else
                _mm512_storeu_ps(y + i, value);
        }
#endif
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= width; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            const __m256 value = _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i));
            if (bf16_out) {
                float values[8];
                _mm256_storeu_ps(values, value);
                floats_to_bf16(values, yb + i, 8);
            } else {
                _mm256_storeu_ps(y + i, value);
            }
        }
#endif
        for (; i < width; i++) {
            const float value = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            if (bf16_out)
                yb[i] = float_to_bf16(value);
            else
                y[i] = value;
        }
    }
}

void infer_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width) {
    silu_mul(gate_up, out, rows, width, 0);
}

/* infer_silu_mul over bfloat16 rows (a bf16 GEMM's output) into bfloat16 (the next one's input), computed in float. */
void infer_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * width, *up = gate + width;
        uint16_t *y = out + r * width;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= width; i += 16) {
            const __m512 g = bf16x16_load(gate + i);
            const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm256_storeu_si256((__m256i *)(y + i), bf16x16_from(_mm512_mul_ps(_mm512_mul_ps(g, sig),
                                                                                bf16x16_load(up + i))));
        }
#endif
#ifdef __AVX2__
        /* as infer_silu_mul computes it (exp8), so the float32 and the bf16 paths agree before the rounding */
        for (; i + 8 <= width; i += 8) {
            const __m256 one8 = _mm256_set1_ps(1.0f), g = bf16x8_load(gate + i);
            const __m256 sig = _mm256_div_ps(one8, _mm256_add_ps(one8, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            float values[8];
            _mm256_storeu_ps(values, _mm256_mul_ps(_mm256_mul_ps(g, sig), bf16x8_load(up + i)));
            floats_to_bf16(values, y + i, 8);
        }
#endif
        for (; i < width; i++) {
            const float g = bf16_to_float(gate[i]);
            y[i] = float_to_bf16(g / (1.0f + expf(-g)) * bf16_to_float(up[i]));
        }
    }
}

/* ---- RoPE and the KV write ---------------------------------------------------------------------------------- */

/* qkv: tokens x row_stride floats, Q heads then K heads (head_dim each) first. Rotates those num_heads heads of
 * every token in place, HF's half-split layout (pairs i, i + head_dim / 2), with cos / signed-sin tables
 * ([max_positions, head_dim], sin's first half negated): x * cos + swap_halves(x) * sin. */
static inline void rotate_row(float *row, const float *c, const float *s, int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x = row + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * c[i] + b * s[i];
            x[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

void infer_rope(float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                int64_t tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim) {
#pragma omp parallel for if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++)
        rotate_row(qkv + t * row_stride, cos_table + positions[t] * head_dim, sin_table + positions[t] * head_dim,
                   num_heads, head_dim);
}

/* infer_rope over a bf16 GEMM's output: out (tokens x width, float32, contiguous) = qkv (bfloat16, the same shape)
 * widened, the first num_heads heads of each row rotated; one pass, each row rotated while it is in L1. */
void infer_rope_widen(const uint16_t *qkv, float *out, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t tokens, int64_t width, int64_t num_heads, int64_t head_dim) {
#pragma omp parallel for if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++) {
        bf16_to_floats(qkv + t * width, out + t * width, width);
        rotate_row(out + t * width, cos_table + positions[t] * head_dim, sin_table + positions[t] * head_dim,
                   num_heads, head_dim);
    }
}

/* Token t's K (width floats at k + t * k_stride) and V (at v + t * v_stride) into the layer's pool
 * kv (2 x num_slots x width; float32, or bfloat16 rounded to nearest when kv_bf16) at slot slots[t]; negative
 * slots are padding and skipped. */
void infer_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *kv,
                    const int64_t *slots, int64_t tokens, int64_t width, int64_t num_slots, int64_t kv_bf16) {
#pragma omp parallel for if (tokens * width >= PARALLEL_ELEMENTS / 2)
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        if (kv_bf16) {
            floats_to_bf16(k + t * k_stride, (uint16_t *)kv + slots[t] * width, width);
            floats_to_bf16(v + t * v_stride, (uint16_t *)kv + (num_slots + slots[t]) * width, width);
            continue;
        }
        memcpy((float *)kv + slots[t] * width, k + t * k_stride, width * sizeof(float));
        memcpy((float *)kv + (num_slots + slots[t]) * width, v + t * v_stride, width * sizeof(float));
    }
}

/* ---- paged attention ----------------------------------------------------------------------------------------- */

#ifdef __AVX2__
/* The 8 horizontal sums of a0..a7, as one vector [sum(a0), ..., sum(a7)]. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#endif

/* scores[j] = scale * query . keys[j] for j < n; returns their maximum. Eight keys at a time share one
 * horizontal reduction. */
static float score_keys(const float *query, const float *const *keys, int64_t n, int64_t head_dim, float scale,
                        float *scores) {
    float best = -INFINITY;
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX2__)
    if (head_dim % 16 == 0) {  /* 16 floats of a key per load; the 8 sums reduced to 8 floats, then as AVX2 does */
        __m256 top = _mm256_set1_ps(-INFINITY), factor = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8) {
            const float *const *k = keys + j;
            __m512 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < head_dim; c += 16) {
                const __m512 x = _mm512_loadu_ps(query + c);
                for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[i] + c), a[i]);
            }
            __m256 h[8];
            for (int i = 0; i < 8; i++) h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), high_half(a[i]));
            __m256 block = _mm256_mul_ps(sum8x8(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), factor);
            _mm256_storeu_ps(scores + j, block);
            top = _mm256_max_ps(top, block);
        }
        best = hmax8(top);
    }
#endif
#ifdef __AVX2__
    if (head_dim % 8 == 0 && j + 8 <= n) {
        __m256 top = _mm256_set1_ps(-INFINITY), factor = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8) {
            const float *const *k = keys + j;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t c = 0; c < head_dim; c += 8) {
                __m256 x = _mm256_loadu_ps(query + c);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[0] + c), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[1] + c), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[2] + c), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[3] + c), a3);
                a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[4] + c), a4);
                a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[5] + c), a5);
                a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[6] + c), a6);
                a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[7] + c), a7);
            }
            __m256 block = _mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), factor);
            _mm256_storeu_ps(scores + j, block);
            top = _mm256_max_ps(top, block);
        }
        best = fmaxf(best, hmax8(top));
    }
#endif
    for (; j < n; j++) {
        scores[j] = dot(query, keys[j], head_dim) * scale;
        if (scores[j] > best) best = scores[j];
    }
    return best;
}

/* result = (sum_j weights[j] * values[j]) * factor, values[j] = keys[j] + value_offset. */
static void weigh_values(const float *weights, const float *const *keys, ptrdiff_t value_offset, int64_t n,
                         int64_t head_dim, float factor, float *result) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 64 <= head_dim; c += 64) {  /* 64 floats of the result in 4 registers over all the keys */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; j++) {
            const float *v = keys[j] + value_offset + c;
            const __m512 w = _mm512_set1_ps(weights[j]);
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
        }
        const __m512 f = _mm512_set1_ps(factor);
        _mm512_storeu_ps(result + c, _mm512_mul_ps(a0, f));
        _mm512_storeu_ps(result + c + 16, _mm512_mul_ps(a1, f));
        _mm512_storeu_ps(result + c + 32, _mm512_mul_ps(a2, f));
        _mm512_storeu_ps(result + c + 48, _mm512_mul_ps(a3, f));
    }
#endif
#ifdef __AVX2__
    const __m256 f = _mm256_set1_ps(factor);
    for (; c + 64 <= head_dim; c += 64) {  /* 64 floats of the result stay in registers over all the keys */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t j = 0; j < n; j++) {
            const float *v = keys[j] + value_offset + c;
            __m256 w = _mm256_broadcast_ss(weights + j);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
            a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
            a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
            a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
        }
        float *r = result + c;
        _mm256_storeu_ps(r, _mm256_mul_ps(a0, f));
        _mm256_storeu_ps(r + 8, _mm256_mul_ps(a1, f));
        _mm256_storeu_ps(r + 16, _mm256_mul_ps(a2, f));
        _mm256_storeu_ps(r + 24, _mm256_mul_ps(a3, f));
        _mm256_storeu_ps(r + 32, _mm256_mul_ps(a4, f));
        _mm256_storeu_ps(r + 40, _mm256_mul_ps(a5, f));
        _mm256_storeu_ps(r + 48, _mm256_mul_ps(a6, f));
        _mm256_storeu_ps(r + 56, _mm256_mul_ps(a7, f));
    }
#endif
    if (c < head_dim) {
        for (int64_t i = c; i < head_dim; i++) result[i] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *v = keys[j] + value_offset;
            for (int64_t i = c; i < head_dim; i++) result[i] += weights[j] * v[i];
        }
        for (int64_t i = c; i < head_dim; i++) result[i] *= factor;
    }
}

#ifdef __AVX512F__
/* results[h][c..c+64) = sum_j weights[h][j] * values[j][c..c+64) for `count` (1 to WEIGH_HEADS, a constant once
 * inlined) heads sharing the value rows (values[j] at rows[j] + offset elements: floats, or bf16 widened in
 * registers when `bf16`): each value row is loaded once for all of them, and their 4 x count accumulators are
 * independent chains (one head's four had waited on the FMA latency, 4 cycles a key). The same sums, in the same
 * order, as weigh_values with factor 1. */
#define WEIGH_HEADS 6
static inline __attribute__((always_inline)) void weigh_heads_block(float *const *weights, const void *const *rows,
                                                                    ptrdiff_t offset, int64_t n,
                                                                    float *const *results, const int count,
                                                                    const int bf16) {
    __m512 acc[WEIGH_HEADS][4];
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = bf16 ? bf16x16_load((const uint16_t *)rows[j] + offset + 16 * i)
                        : _mm512_loadu_ps((const float *)rows[j] + offset + 16 * i);
        for (int h = 0; h < count; h++) {
            const __m512 w = _mm512_set1_ps(weights[h][j]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_fmadd_ps(w, v[i], acc[h][i]);
        }
    }
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(results[h] + 16 * i, acc[h][i]);
}

/* weigh_heads_block for `count` heads, the count and the rows' type constants in each copy (the accumulators stay in
 * registers). */
static void weigh_pass(float *const *weights, const void *const *rows, ptrdiff_t offset, int64_t n,
                       float *const *results, int count, int bf16) {
#define WEIGH_CASE(k) \
    case k: \
        if (bf16) weigh_heads_block(weights, rows, offset, n, results, k, 1); \
        else weigh_heads_block(weights, rows, offset, n, results, k, 0); \
        break;
    switch (count) {
        WEIGH_CASE(1)
        WEIGH_CASE(2)
        WEIGH_CASE(3)
        WEIGH_CASE(4)
        WEIGH_CASE(5)
        default:
            if (bf16) weigh_heads_block(weights, rows, offset, n, results, WEIGH_HEADS, 1);
            else weigh_heads_block(weights, rows, offset, n, results, WEIGH_HEADS, 0);
    }
#undef WEIGH_CASE
}
#endif

/* results[h] = sum_j weights[h][j] * values[j] (values[j] at rows[j] + value_offset elements) for `heads` heads over
 * the same n value rows: weigh_values with factor 1 for each, several heads a pass where AVX-512 has the registers.
 * The rows are floats, or, with `bf16` (AVX-512 and a head size of 64 only), a bf16 pool's rows widened in registers
 * once for all the heads of a pass. */
static void weigh_heads(float *const *weights, int64_t heads, const void *const *rows, int bf16,
                        ptrdiff_t value_offset, int64_t n, int64_t head_dim, float *const *results) {
    int64_t h = 0;
    (void)bf16;  /* never set without AVX-512 */
#ifdef __AVX512F__
    if (head_dim % 64 == 0) {
        for (; h < heads; h += WEIGH_HEADS) {
            const int count = heads - h < WEIGH_HEADS ? (int)(heads - h) : WEIGH_HEADS;
            for (int64_t c = 0; c < head_dim; c += 64) {
                float *at[WEIGH_HEADS];
                for (int i = 0; i < count; i++) at[i] = results[h + i] + c;
                weigh_pass(weights + h, rows, value_offset + c, n, at, count, bf16);
            }
        }
    }
#endif
    for (; h < heads; h++)
        weigh_values(weights[h], (const float *const *)rows, value_offset, n, head_dim, 1.0f, results[h]);
}

#ifdef __AVX512F__
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

/* Keys j..j+3's scores `four` into scores (those below n: the last pass repeats a key) and into the running
 * maxima `top`. */
static inline __attribute__((always_inline)) void keep_scores(__m128 four, float *scores, int64_t j, int64_t n,
                                                              __m128 *top) {
    if (j + 4 <= n) {
        _mm_storeu_ps(scores + j, four);
        *top = _mm_max_ps(*top, four);
        return;
    }
    float last[4];
    _mm_storeu_ps(last, four);
    for (int64_t r = 0; r < n - j; r++) {
        scores[j + r] = last[r];
        *top = _mm_max_ps(*top, _mm_set1_ps(last[r]));
    }
}

/* The largest of four lanes. */
static inline __attribute__((always_inline)) float max4(__m128 four) {
    const __m128 pairs = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

/* A bf16 pool's 64-wide rows, straight from the pool: scores[h][j] = scale * queries[h] . keys[j] for `count` (1 to
 * 3, a constant once inlined) query heads and j < n, each key widened once for all of them, four keys a pass;
 * best[h] their maxima. The last pass repeats key n - 1 where fewer than four are left (a key's score never depends
 * on the others of its pass). */
static inline __attribute__((always_inline)) void score_bf16_block(const float *const *queries,
                                                                   const uint16_t *const *keys, int64_t n,
                                                                   float scale, float *const *scores, float *best,
                                                                   const int count) {
    __m512 qv[3][4];
    __m128 top[3];
    for (int h = 0; h < count; h++) {
        for (int i = 0; i < 4; i++) qv[h][i] = _mm512_loadu_ps(queries[h] + 16 * i);
        top[h] = _mm_set1_ps(-INFINITY);
    }
    const __m128 factor = _mm_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 4) {
        __m512 acc[3][4];
        for (int r = 0; r < 4; r++) {
            const uint16_t *key = keys[j + r < n ? j + r : n - 1];
            const __m512 k0 = bf16x16_load(key), k1 = bf16x16_load(key + 16), k2 = bf16x16_load(key + 32),
                         k3 = bf16x16_load(key + 48);
            for (int h = 0; h < count; h++)
                acc[h][r] = _mm512_fmadd_ps(qv[h][3], k3, _mm512_fmadd_ps(qv[h][2], k2, _mm512_fmadd_ps(
                    qv[h][1], k1, _mm512_mul_ps(qv[h][0], k0))));
        }
        for (int h = 0; h < count; h++)
            keep_scores(_mm_mul_ps(sum4x16(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), factor), scores[h], j, n,
                        &top[h]);
    }
    for (int h = 0; h < count; h++) best[h] = max4(top[h]);
}

#endif

/* A buffer of at least `bytes` for this thread, kept from call to call in one of SCRATCH_SLOTS slots (its contents
 * are not). The attention runs per layer, many times a step; a fresh malloc of tens of KB can come back as
 * untouched pages, a fault each. */
#define SCRATCH_SLOTS 9
static void *scratch(int slot, size_t bytes) {
    static __thread void *buffers[SCRATCH_SLOTS];
    static __thread size_t sizes[SCRATCH_SLOTS];
    if (sizes[slot] < bytes) {
        free(buffers[slot]);
        sizes[slot] = (bytes + 63) / 64 * 64;
        buffers[slot] = aligned_alloc(64, sizes[slot]);
    }
    return buffers[slot];
}

/* Every cache line of the K and V rows of tokens start..end-1 (KV heads first_kv_head onwards, kv_heads of them) of
 * the sequence whose block table is `table`, requested into L2 before a work item reads them. A busy engine's
 * sequences hold blocks scattered over the pool (they grow a block at a time, side by side), and the hardware
 * prefetchers, which stop at 4 KB pages, never ramp up over a block's few KB: requested at once, the lines arrive
 * together. On 2 cores of a Zen 4 EPYC, 30 layers of a 3,200-block bf16 pool, blocks scattered at random (builds
 * alternating in one process, two runs): batch 64 at 60 keys 0.67-0.70x the time, batch 48 at 110 keys 0.71-0.73x,
 * batch 16 at 230 keys 0.71-0.72x, batch 4 at 300 keys 0.69-0.70x, batch 1 0.93x; blocks in order 0.87-0.98x. On
 * the block tables of the chat mix's steps (benchmarks' `infer bench --workload chat`): batch 48 at 107 keys 9.0 ->
 * 7.5 ms a step, batch 16 at 230 keys 7.9 -> 6.3. Inlined always: as a function of its own, gcc finds it free of
 * side effects and drops the call. */
static inline __attribute__((always_inline)) void prefetch_chunk(const void *kv, const int32_t *table, int64_t start,
                                                                int64_t end, int64_t first_kv_head, int64_t kv_heads,
                                                                int64_t head_dim, int64_t block_size,
                                                                int64_t slot_width, int64_t pool_slots,
                                                                size_t element) {
    const size_t run = kv_heads * head_dim * element, values = pool_slots * slot_width * element;
    for (int64_t j = start; j < end; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        const char *key = (const char *)kv + (slot * slot_width + first_kv_head * head_dim) * element;
        for (size_t line = 0; line < run; line += 64) {
            __builtin_prefetch(key + line, 0, 2);  /* prefetcht1 on x86 */
            __builtin_prefetch(key + values + line, 0, 2);
        }
    }
}

/* A work item of paged_attention_run: keys start..end-1 (chunk c of its sequence) of KV heads first_kv_head onwards
 * (kv_heads of them) for queries first_query..end_query-1 (a group), or for one leaf whose own K/V sit at token
 * own (-1: none). */
typedef struct {
    int64_t c, first_query, end_query, first_kv_head, kv_heads, own, start, end;
} decode_item;

/* The first of `items` items that member `member` of a team of `team` takes: runs of about equal cost, by the
 * items' cumulative costs cost_before[0..items]. */
static int64_t run_start(const int64_t *cost_before, int64_t items, int64_t member, int64_t team) {
    if (member >= team) return items;
    const int64_t target = cost_before[items] * member / team;
    int64_t low = 0, high = items;  /* the first item whose cost_before reaches the target */
    while (low < high) {
        const int64_t middle = (low + high) / 2;
        if (cost_before[middle] < target) low = middle + 1;
        else high = middle;
    }
    return low;
}

/* Keys per work item of infer_paged_attention. A constant, so that a query's result never depends on the other
 * queries of its step (a verified draft row equals the decode row it replaces, bit for bit). */
#define DECODE_CHUNK 64
/* Consecutive queries of one sequence (a verification's rows, a chunk's) that share a work item's key rows. */
#define DECODE_GROUP 16

#if defined(__AVX512BF16__)
/* score_bf16_block on AVX512-BF16's dot products: the queries rounded to bf16 once (`dots` of
 * infer_paged_attention), each key row's 64 bf16 multiplied as it is in the pool, two VDPBF16PS a query head where
 * the float32 path widens four registers and runs four FMAs. */
static inline __attribute__((always_inline)) void score_dots_block(const float *const *queries,
                                                                   const uint16_t *const *keys, int64_t n,
                                                                   float scale, float *const *scores, float *best,
                                                                   const int count) {
    __m512bh qb[3][2];
    __m128 top[3];
    for (int h = 0; h < count; h++) {
        for (int i = 0; i < 2; i++)
            qb[h][i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(queries[h] + 32 * i + 16),
                                           _mm512_loadu_ps(queries[h] + 32 * i));
        top[h] = _mm_set1_ps(-INFINITY);
    }
    const __m128 factor = _mm_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 4) {
        __m512 acc[3][4];
        for (int r = 0; r < 4; r++) {
            const uint16_t *key = keys[j + r < n ? j + r : n - 1];
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(key), k1 = (__m512bh)_mm512_loadu_si512(key + 32);
            for (int h = 0; h < count; h++)
                acc[h][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qb[h][0], k0), qb[h][1], k1);
        }
        for (int h = 0; h < count; h++)
            keep_scores(_mm_mul_ps(sum4x16(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), factor), scores[h], j, n,
                        &top[h]);
    }
    for (int h = 0; h < count; h++) best[h] = max4(top[h]);
}

/* weigh_heads_block on the dot products, for a bf16 pool's 64-wide value rows: results[h] = sum_j probs[h][j] *
 * values[j] with the probabilities rounded to bf16 (probs: pairs of consecutive keys; past an odd n's last key, a
 * probability 0 beside its row read again). Two value rows' words interleaved (VPUNPCKLWD/HWD) are the pairs VDPBF16PS multiplies with a
 * head's two probabilities broadcast: each sum register then holds 16 of the 64 columns out of order, which one
 * permute a 16 puts back on the store. */
static inline __attribute__((always_inline)) void weigh_dots_block(const uint32_t *const *probs,
                                                                   const void *const *rows, ptrdiff_t offset,
                                                                   int64_t n, float *const *results,
                                                                   const int count) {
    __m512 acc[WEIGH_HEADS][4];
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 2) {
        const uint16_t *first = (const uint16_t *)rows[j] + offset;
        const uint16_t *second = (const uint16_t *)rows[j + 1 < n ? j + 1 : j] + offset;
        const __m512i a0 = _mm512_loadu_si512(first), a1 = _mm512_loadu_si512(first + 32);
        const __m512i b0 = _mm512_loadu_si512(second), b1 = _mm512_loadu_si512(second + 32);
        const __m512bh v[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                               (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int h = 0; h < count; h++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)probs[h][j / 2]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], pair, v[i]);
        }
    }
    /* register 2i + 0 holds columns 32i + {0-3, 8-11, 16-19, 24-27}, 2i + 1 the 4-7s (per 128-bit lane) */
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 2; i++) {
            _mm512_storeu_ps(results[h] + 32 * i, _mm512_permutex2var_ps(acc[h][2 * i], low, acc[h][2 * i + 1]));
            _mm512_storeu_ps(results[h] + 32 * i + 16,
                             _mm512_permutex2var_ps(acc[h][2 * i], high, acc[h][2 * i + 1]));
        }
}

/* A mask of the first `left` of 16 lanes (none when left <= 0). */
static inline __mmask16 first_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* weigh_heads for a bf16 pool's 64-wide rows on the dot products: each head's float probabilities (n <=
 * DECODE_CHUNK of them, zero past its own keys) rounded to bf16 pairs in `pairs` (this thread's, DECODE_CHUNK / 2
 * words a head of a pass, the word past an odd n's last key zero), then weigh_dots_block over WEIGH_HEADS heads at
 * a time. */
static void weigh_dots(float *const *weights, int64_t heads, const void *const *rows, ptrdiff_t offset, int64_t n,
                       uint32_t *pairs, float *const *results) {
    const uint32_t *rounded[WEIGH_HEADS];
    for (int64_t h = 0; h < heads; h += WEIGH_HEADS) {
        const int count = heads - h < WEIGH_HEADS ? (int)(heads - h) : WEIGH_HEADS;
        for (int i = 0; i < count; i++) {
            uint32_t *own = pairs + i * (DECODE_CHUNK / 2);
            const float *w = weights[h + i];
            for (int64_t at = 0; at < n; at += 32) {
                const __m512 low = _mm512_maskz_loadu_ps(first_lanes(n - at), w + at);
                const __m512 high = _mm512_maskz_loadu_ps(first_lanes(n - at - 16), w + at + 16);
                _mm512_storeu_si512(own + at / 2, (__m512i)_mm512_cvtne2ps_pbh(high, low));
            }
            rounded[i] = own;
        }
        switch (count) {
#define DOTS_CASE(k) case k: weigh_dots_block(rounded, rows, offset, n, results + h, k); break;
            DOTS_CASE(1) DOTS_CASE(2) DOTS_CASE(3) DOTS_CASE(4) DOTS_CASE(5)
            default: weigh_dots_block(rounded, rows, offset, n, results + h, WEIGH_HEADS);
#undef DOTS_CASE
        }
    }
}
#endif

#ifdef __AVX512F__
/* score_bf16_block's heads three at a time, or with `dots` (AVX512-BF16 builds) score_dots_block's. */
static void score_heads(const float *const *queries, int64_t heads, const uint16_t *const *keys, int64_t n,
                        float scale, float *const *scores, float *best, int dots) {
    (void)dots;
    for (int64_t h = 0; h < heads; h += 3) {
        const int count = heads - h < 3 ? (int)(heads - h) : 3;
#define SCORE_CASE(block, k) \
    case k: block(queries + h, keys, n, scale, scores + h, best + h, k); break;
#if defined(__AVX512BF16__)
        if (dots) {
            switch (count) { SCORE_CASE(score_dots_block, 1) SCORE_CASE(score_dots_block, 2)
                             default: score_dots_block(queries + h, keys, n, scale, scores + h, best + h, 3); }
            continue;
        }
#endif
        switch (count) { SCORE_CASE(score_bf16_block, 1) SCORE_CASE(score_bf16_block, 2)
                         default: score_bf16_block(queries + h, keys, n, scale, scores + h, best + h, 3); }
#undef SCORE_CASE
    }
}
#endif

/* Query i (of `queries`) is token row r = rows[i] (r = i when rows is NULL; r = row_base + i in a run of
 * paged_attention_run): its heads at q + r * q_stride, its result at out + r * num_heads * head_dim. It attends to the
 * first context_lens[i] tokens of sequence seq_of_query[i], read through that sequence's block table row
 * (block_tables + seq * table_stride) from the layer's pool kv (2 x num_blocks x block_size x num_kv_heads x
 * head_dim; float32, or bfloat16 when kv_bf16). With own_keys (NULL: none) and own_keys[i] >= 0, the last of those
 * tokens, its own position, is read from the sequence's token own_keys[i] instead: a leaf of a draft tree, which
 * stands beside the spine's draft at that position while its K/V were written past the spine.
 *
 * Split decoding: the work items are (group, chunk of DECODE_CHUNK keys, its KV heads or one of them), dynamically
 * over the threads, where a group is up to DECODE_GROUP consecutive queries of one sequence. An item lists its key
 * rows once for the whole group (AVX-512 reads a bf16 pool's 64-wide rows in place and widens them in registers;
 * elsewhere a bf16 pool's rows are widened into a per-thread float buffer), then every query head of the group that
 * sees the chunk scores them, takes their softmax against the chunk's own maximum and weighs the value rows; the
 * chunks' partial results are then merged per query head in chunk order. With `dots` (a bf16 pool of 64-wide heads
 * in an AVX512-BF16 build; ignored elsewhere) the queries and the probabilities are rounded to bf16 and multiplied
 * on VDPBF16PS (score_dots_block, weigh_dots), scores, maxima and sums float32: the flash attention's precision, at
 * half the instructions of widening the K/V for float32 FMAs. Against the kernel before (one item per
 * query and KV head over its whole context, keys copied to floats per query), on 2 cores of an AMX Xeon, bf16 pool:
 * batch 1 at 300 keys 35.5 -> 14.7 us a call, two queries of it 65.3 -> 19.9, batch 64 at ~650 keys 2,568 -> 1,335
 * us (README, session 23). */
static void paged_attention_run(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                                int64_t table_stride, const int64_t *rows, int64_t row_base,
                                const int64_t *seq_of_query, const int64_t *context_lens, const int64_t *own_keys,
                                float *out, int64_t queries, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale,
                                int64_t kv_bf16, int64_t dots) {
    const int64_t per_kv = num_heads / num_kv_heads;
    const int64_t slot_width = num_kv_heads * head_dim;
    const int64_t pool_slots = num_blocks * block_size;
    const int64_t entry = head_dim + 2;  /* a partial result: head_dim sums, the chunk's maximum and its exp sum */
    /* groups, their chunks, and where each query's partials start */
    int64_t *group_first = malloc(sizeof(int64_t) * (queries + 1));
    int64_t *chunk_first = malloc(sizeof(int64_t) * (queries + 1)), *partial_at = malloc(sizeof(int64_t) * queries);
    int64_t groups = 0, chunks = 0, partials = 0, total_keys = 0;
    for (int64_t i = 0; i < queries; i++) {
        if (i == 0 || seq_of_query[i] != seq_of_query[i - 1] || i - group_first[groups - 1] == DECODE_GROUP)
            group_first[groups++] = i;
        partial_at[i] = partials;
        partials += num_heads * ((context_lens[i] + DECODE_CHUNK - 1) / DECODE_CHUNK);
        total_keys += context_lens[i];
    }
    group_first[groups] = queries;
    for (int64_t g = 0; g < groups; g++) {
        int64_t longest = 0;
        for (int64_t i = group_first[g]; i < group_first[g + 1]; i++)
            if (context_lens[i] > longest) longest = context_lens[i];
        chunk_first[g] = chunks;
        chunks += (longest + DECODE_CHUNK - 1) / DECODE_CHUNK;
    }
    chunk_first[groups] = chunks;
    int64_t *group_of_chunk = malloc(sizeof(int64_t) * (chunks > 0 ? chunks : 1));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = chunk_first[g]; c < chunk_first[g + 1]; c++) group_of_chunk[c] = g;
    /* a draft tree's leaves: each takes its group's items for the chunks before its own position's, and an item of
     * its own for that chunk, whose last key is its own (the same keys, in the same order, as a query at that
     * position whose K/V sat there: the same bits) */
    int64_t leaves = 0, *leaf_query = malloc(sizeof(int64_t) * (queries > 0 ? queries : 1));
    for (int64_t i = 0; own_keys && i < queries; i++)
        if (own_keys[i] >= 0) leaf_query[leaves++] = i;
    float *partial = scratch(0, sizeof(float) * (partials > 0 ? partials : 1) * entry);
    const int parallel = total_keys * num_heads >= 2048;
    /* An item takes every KV head of its chunk, whose slots it then reads whole and in order, where there are items
     * enough for the threads; else one KV head (a single sequence's few chunks). Which item computes a query head's
     * chunk never changes what it computes. */
#ifdef _OPENMP
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
#else
    const int64_t threads = 1;
#endif
    const int64_t split = chunks >= 4 * threads ? 1 : num_kv_heads;
#ifdef __AVX512F__
    const int direct = kv_bf16 && head_dim == 64;
#else
    const int direct = 0;
#endif
#if defined(__AVX512BF16__)
    dots = dots && direct;
#else
    dots = 0;  /* the float32 arithmetic is all this build has */
#endif
    /* the items: a group's chunk (its KV heads, or one of them), then the leaves' own chunks. Each thread takes a
     * contiguous run of them of about equal cost and asks for its next item's K/V lines while the current one
     * computes, a KV head's share before each of the current one's KV heads (the blocks of a busy engine's pool
     * are scattered, and a run of requests at once stalls the loads behind it) */
    const int64_t total_items = chunks * split + leaves;
    decode_item *items = malloc(sizeof(decode_item) * (total_items > 0 ? total_items : 1));
    int64_t *cost_before = malloc(sizeof(int64_t) * (total_items + 1));
    cost_before[0] = 0;
    for (int64_t item = 0; item < total_items; item++) {
        decode_item *it = &items[item];
        it->first_kv_head = 0;
        it->kv_heads = num_kv_heads;
        it->own = -1;
        if (item < chunks * split) {
            const int64_t chunk = item / split, g = group_of_chunk[chunk];
            it->c = chunk - chunk_first[g];
            it->first_query = group_first[g];
            it->end_query = group_first[g + 1];
            it->kv_heads = num_kv_heads / split;
            it->first_kv_head = item % split * it->kv_heads;
        } else {  /* a leaf's own chunk, every KV head */
            it->first_query = leaf_query[item - chunks * split];
            it->end_query = it->first_query + 1;
            it->c = (context_lens[it->first_query] - 1) / DECODE_CHUNK;
            it->own = own_keys[it->first_query];
        }
        it->start = it->c * DECODE_CHUNK;
        it->end = it->start;
        for (int64_t i = it->first_query; i < it->end_query; i++)
            if (context_lens[i] > it->end) it->end = context_lens[i];
        if (it->end > it->start + DECODE_CHUNK) it->end = it->start + DECODE_CHUNK;
        cost_before[item + 1] = cost_before[item] +
                                ((it->end - it->start) * (it->end_query - it->first_query) + 8) * it->kv_heads;
    }
    const size_t element = kv_bf16 ? 2 : 4;
#pragma omp parallel if (parallel)
    {
        const float *keys[DECODE_CHUNK];
        const uint16_t *raw[DECODE_CHUNK];  /* the direct path's rows (AVX-512 builds) */
        const int64_t group_heads = DECODE_GROUP * per_kv;
        float *scores = scratch(1, sizeof(float) * group_heads * DECODE_CHUNK);
        float **head_weights = scratch(3, sizeof(float *) * group_heads);
        float **head_results = scratch(4, sizeof(float *) * group_heads);
        const float **head_queries = scratch(5, sizeof(float *) * group_heads);
        int64_t *head_keys = scratch(6, sizeof(int64_t) * group_heads);  /* the keys of the chunk each sees */
        float *head_best = scratch(7, sizeof(float) * group_heads);
        float *converted = scratch(2, sizeof(float) * 2 * DECODE_CHUNK * head_dim);  /* a bf16 pool's keys, values */
#if defined(__AVX512BF16__)
        uint32_t *pairs = scratch(8, sizeof(uint32_t) * WEIGH_HEADS * DECODE_CHUNK / 2);  /* dots' probabilities */
#endif
#ifdef _OPENMP
        const int64_t team = omp_get_num_threads(), member = omp_get_thread_num();
#else
        const int64_t team = 1, member = 0;
#endif
        const int64_t first_item = run_start(cost_before, total_items, member, team);
        const int64_t end_item = run_start(cost_before, total_items, member + 1, team);
        if (first_item < end_item) {
            const decode_item *it = &items[first_item];
            prefetch_chunk(kv, block_tables + seq_of_query[it->first_query] * table_stride, it->start, it->end,
                           it->first_kv_head, it->kv_heads, head_dim, block_size, slot_width, pool_slots, element);
        }
        for (int64_t item = first_item; item < end_item; item++) {
            const decode_item *it = &items[item], *next = item + 1 < end_item ? &items[item + 1] : NULL;
            const int64_t c = it->c, first_query = it->first_query, end_query = it->end_query;
            const int64_t first_kv_head = it->first_kv_head, kv_heads = it->kv_heads, own = it->own;
            const int64_t start = it->start, end = it->end;
            const int32_t *table = block_tables + seq_of_query[first_query] * table_stride;
            for (int64_t kvh = first_kv_head; kvh < first_kv_head + kv_heads; kvh++) {
                if (next) {  /* the next item's KV heads, a share before each of this one's */
                    const int64_t share = kvh - first_kv_head;
                    const int64_t from = share * next->kv_heads / kv_heads;
                    const int64_t to = (share + 1) * next->kv_heads / kv_heads;
                    if (to > from)
                        prefetch_chunk(kv, block_tables + seq_of_query[next->first_query] * table_stride,
                                       next->start, next->end, next->first_kv_head + from, to - from, head_dim,
                                       block_size, slot_width, pool_slots, element);
                }
                /* the chunk's key rows of this KV head: a bf16 pool's 64-wide rows as they are where AVX-512 reads
                 * them so (each widened in registers, once for all the query heads it serves), else as floats (a
                 * bf16 pool's widened into this thread's buffer) */
                ptrdiff_t value_offset = pool_slots * slot_width;
                for (int64_t j = start; j < end;) {
                    const int64_t first = (int64_t)table[j / block_size] * block_size * slot_width + kvh * head_dim;
                    for (int64_t t = j % block_size; t < block_size && j < end; t++, j++) {
                        const int64_t at = first + t * slot_width;
                        if (direct) {
                            raw[j - start] = (const uint16_t *)kv + at;
                        } else if (kv_bf16) {
                            float *key = converted + (j - start) * head_dim;
                            bf16_to_floats((const uint16_t *)kv + at, key, head_dim);
                            bf16_to_floats((const uint16_t *)kv + pool_slots * slot_width + at,
                                           key + DECODE_CHUNK * head_dim, head_dim);
                            keys[j - start] = key;
                        } else {
                            keys[j - start] = (const float *)kv + at;
                        }
                    }
                }
                if (own >= 0) {  /* the leaf's own K/V in place of its position's */
                    const int64_t slot = (int64_t)table[own / block_size] * block_size + own % block_size;
                    const int64_t at = slot * slot_width + kvh * head_dim, j = end - 1 - start;
                    if (direct) {
                        raw[j] = (const uint16_t *)kv + at;
                    } else if (kv_bf16) {
                        bf16_to_floats((const uint16_t *)kv + at, converted + j * head_dim, head_dim);
                        bf16_to_floats((const uint16_t *)kv + pool_slots * slot_width + at,
                                       converted + j * head_dim + DECODE_CHUNK * head_dim, head_dim);
                    } else {
                        keys[j] = (const float *)kv + at;
                    }
                }
                if (kv_bf16 && !direct) value_offset = DECODE_CHUNK * head_dim;
                /* every query head of the group that sees this chunk (a query's heads side by side): its scores
                 * (zero past its own keys, so that all weigh the chunk's value rows together), maximum, exp sum */
                int64_t heads = 0;
                for (int64_t i = first_query; i < end_query; i++) {
                    const int64_t n = (context_lens[i] < end ? context_lens[i] : end) - start;
                    const int leaf_later = own < 0 && own_keys && own_keys[i] >= 0 &&
                                           c >= (context_lens[i] - 1) / DECODE_CHUNK;
                    if (n <= 0 || leaf_later) continue;  /* a leaf's own chunk is its own item */
                    const int64_t row = rows ? rows[i] : row_base + i;
                    const int64_t count = (context_lens[i] + DECODE_CHUNK - 1) / DECODE_CHUNK;
                    for (int64_t h = kvh * per_kv; h < (kvh + 1) * per_kv; h++, heads++) {
                        head_queries[heads] = q + row * q_stride + h * head_dim;
                        head_keys[heads] = n;
                        head_weights[heads] = scores + heads * DECODE_CHUNK;
                        head_results[heads] = partial + (partial_at[i] + h * count + c) * entry;
                    }
                }
                for (int64_t a = 0; a < heads; a += per_kv) {
#ifdef __AVX512F__
                    if (direct) {
                        score_heads(head_queries + a, per_kv, raw, head_keys[a], scale, head_weights + a,
                                    head_best + a, (int)dots);
                        continue;
                    }
#endif
                    for (int64_t b = a; b < a + per_kv; b++)
                        head_best[b] = score_keys(head_queries[b], keys, head_keys[b], head_dim, scale,
                                                  head_weights[b]);
                }
                for (int64_t a = 0; a < heads; a++) {
                    float *own = head_results[a], *weights = head_weights[a];
                    own[head_dim] = head_best[a];
                    own[head_dim + 1] = exp_shifted_sum(weights, head_keys[a], head_best[a]);
                    for (int64_t j = head_keys[a]; j < end - start; j++) weights[j] = 0.0f;
                }
#if defined(__AVX512BF16__)
                if (dots) {
                    weigh_dots(head_weights, heads, (const void *const *)raw, value_offset, end - start, pairs,
                               head_results);
                    continue;
                }
#endif
                weigh_heads(head_weights, heads, direct ? (const void *const *)raw : (const void *const *)keys, direct,
                            value_offset, end - start, head_dim, head_results);
            }
        }
#pragma omp barrier
        /* merge each query head's chunks, in order */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < queries; i++) {
            const int64_t row = rows ? rows[i] : row_base + i;
            const int64_t count = (context_lens[i] + DECODE_CHUNK - 1) / DECODE_CHUNK;
            for (int64_t h = 0; h < num_heads; h++) {
                const float *own = partial + (partial_at[i] + h * count) * entry;
                float *restrict result = out + (row * num_heads + h) * head_dim;
                if (count == 1) {  /* what the general case computes for one chunk: exp(0) = 1, 0 + x = x */
                    const float factor = 1.0f / own[head_dim + 1];
                    for (int64_t d = 0; d < head_dim; d++) result[d] = own[d] * factor;
                    continue;
                }
                float top = -INFINITY, total = 0.0f, scales[count];
                for (int64_t c = 0; c < count; c++) top = fmaxf(top, own[c * entry + head_dim]);
                for (int64_t c = 0; c < count; c++) {
                    scales[c] = expf(own[c * entry + head_dim] - top);
                    total += own[c * entry + head_dim + 1] * scales[c];
                }
                for (int64_t d = 0; d < head_dim; d++) result[d] = 0.0f;
                for (int64_t c = 0; c < count; c++) {
                    const float factor = scales[c] / total;
                    const float *restrict sums = own + c * entry;
                    for (int64_t d = 0; d < head_dim; d++) result[d] += sums[d] * factor;
                }
            }
        }
    }
    free(cost_before);
    free(items);
    free(leaf_query);
    free(group_of_chunk);
    free(partial_at);
    free(chunk_first);
    free(group_first);
}

/* Partial results (floats) infer_paged_attention holds at once: queries go through in runs whose partials fit, so a
 * long prefill chunk over a long context (a float32 step's every query) never holds one for every (query, head,
 * chunk) together. A query's result is its own, so the runs change nothing. */
#define DECODE_PARTIALS (4 << 20)

void infer_paged_attention(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *rows, const int64_t *seq_of_query,
                           const int64_t *context_lens, const int64_t *own_keys, float *out, int64_t queries,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t num_blocks, int64_t max_context, float scale, int64_t kv_bf16, int64_t dots) {
    (void)max_context;
    const int64_t entry = head_dim + 2;
    for (int64_t first = 0, last = 0; first < queries; first = last) {
        for (int64_t held = 0; last < queries; last++) {
            const int64_t need = num_heads * ((context_lens[last] + DECODE_CHUNK - 1) / DECODE_CHUNK) * entry;
            if (last > first && held + need > DECODE_PARTIALS) break;
            held += need;
        }
        paged_attention_run(q, q_stride, kv, block_tables, table_stride, rows ? rows + first : NULL, first,
                            seq_of_query + first, context_lens + first, own_keys ? own_keys + first : NULL, out,
                            last - first, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, kv_bf16,
                            dots);
    }
}

/* ---- prefill attention: flash attention on AVX512-BF16's dot products ---------------------------------------- */

/* 2 when this build's infer_flash_attention multiplies on AMX tiles (its bf16 mode; float32 FMAs stay AVX-512), 1
 * when on AVX512-BF16's dot products, 0 when it has none (prefill chunks then stay on torch's). */
int64_t infer_flash_kind(void) {
#if defined(__AVX512BF16__)
    return amx_available() ? 2 : 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
#define FLASH_TOKENS 16  /* query tokens per work item: times the query heads of one KV head, its rows */
#define FLASH_KEYS 32    /* keys per step of the online softmax: two registers of scores per row */
#define SCORE_ROWS 12    /* rows per pass of Q K^T: 2 accumulators each */
#define WEIGH_ROWS 6     /* rows per pass of P V: 4 accumulators each (64 columns of the result) */

/* A row's 32 scores (two registers) into the scores buffer. */
static inline __attribute__((always_inline)) void store_scores(const __m512 *acc, float *scores) {
    _mm512_storeu_ps(scores, acc[0]);
    _mm512_storeu_ps(scores + 16, acc[1]);
}

/* acc[r] = 64 columns (from c) of row r's running result times rescale[r], for rows 0..count-1: where a tile of P V
 * starts, the earlier tiles' sum scaled to the new row maximum. */
static inline __attribute__((always_inline)) void load_rescaled(__m512 (*acc)[4], int count, const float *acc_rows,
                                                                int64_t head_dim, int64_t c, const float *rescale) {
    for (int r = 0; r < count; r++) {
        const __m512 factor = _mm512_set1_ps(rescale[r]);
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc_rows + r * head_dim + c + 16 * i),
                                                              factor);
    }
}

/* load_rescaled's counterpart: the rows' 64 columns (from c) back into their running results. */
static inline __attribute__((always_inline)) void store_result(__m512 (*acc)[4], int count, float *acc_rows,
                                                               int64_t head_dim, int64_t c) {
    for (int r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc_rows + r * head_dim + c + 16 * i, acc[r][i]);
}

/* scores[r][0..31] = q_r . key_j for rows 0..count-1 of qb (bf16, head_dim each) and the 32 keys of one packed
 * tile (two halves of 16 keys; per pair p of head_dim, one register of the 16 keys' (k[2p], k[2p + 1]) pairs). */
static inline __attribute__((always_inline)) void flash_scores(const uint16_t *qb, int64_t head_dim,
                                                               const uint16_t *keys, float *scores, const int count) {
    __m512 acc[SCORE_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < head_dim / 2; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + p * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + head_dim * 16 + p * 32);
        for (int r = 0; r < count; r++) {
            int32_t pair;
            memcpy(&pair, qb + r * head_dim + 2 * p, sizeof pair);
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
        }
    }
    for (int r = 0; r < count; r++) store_scores(acc[r], scores + r * FLASH_KEYS);
}

/* acc_r[c..c+63] = acc_r[c..c+63] * rescale[r] + sum_j p_rj v_j[c..c+63] for rows 0..count-1: probs (bf16, 32 a
 * row) times one packed tile of values (per key pair, head_dim columns of (v[2j][d], v[2j + 1][d]) pairs). */
static inline __attribute__((always_inline)) void flash_weigh(const uint16_t *probs, const uint16_t *values,
                                                              int64_t head_dim, int64_t c, const float *rescale,
                                                              float *acc_rows, const int count) {
    __m512 acc[WEIGH_ROWS][4];
    load_rescaled(acc, count, acc_rows, head_dim, c, rescale);
    for (int j = 0; j < FLASH_KEYS / 2; j++) {
        const uint16_t *pairs = values + j * 2 * head_dim + 2 * c;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(pairs), v1 = (__m512bh)_mm512_loadu_si512(pairs + 32);
        const __m512bh v2 = (__m512bh)_mm512_loadu_si512(pairs + 64), v3 = (__m512bh)_mm512_loadu_si512(pairs + 96);
        for (int r = 0; r < count; r++) {
            int32_t pair;
            memcpy(&pair, probs + r * FLASH_KEYS + 2 * j, sizeof pair);
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pv, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pv, v1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pv, v2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pv, v3);
        }
    }
    store_result(acc, count, acc_rows, head_dim, c);
}

#define SCORE_FMA_ROWS 8  /* flash_scores_fma: 16 accumulators, 4 widened key vectors (more rows spill) */
#define WEIGH_FMA_ROWS 4  /* flash_weigh_fma: 16 accumulators, 8 widened value vectors */

/* flash_scores with float32 FMAs over the widened keys: rows of qf float32 (not rounded). */
static inline __attribute__((always_inline)) void flash_scores_fma(const float *qf, int64_t head_dim,
                                                                   const uint16_t *keys, float *scores,
                                                                   const int count) {
    __m512 acc[SCORE_FMA_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < head_dim / 2; p++) {
        __m512 even0, odd0, even1, odd1;
        widen_pairs(_mm512_loadu_si512(keys + p * 32), &even0, &odd0);
        widen_pairs(_mm512_loadu_si512(keys + head_dim * 16 + p * 32), &even1, &odd1);
        for (int r = 0; r < count; r++) {
            const __m512 qe = _mm512_set1_ps(qf[r * head_dim + 2 * p]);
            const __m512 qo = _mm512_set1_ps(qf[r * head_dim + 2 * p + 1]);
            acc[r][0] = _mm512_fmadd_ps(qo, odd0, _mm512_fmadd_ps(qe, even0, acc[r][0]));
            acc[r][1] = _mm512_fmadd_ps(qo, odd1, _mm512_fmadd_ps(qe, even1, acc[r][1]));
        }
    }
    for (int r = 0; r < count; r++) store_scores(acc[r], scores + r * FLASH_KEYS);
}

/* flash_weigh with float32 FMAs: probs float32 (32 a row, not rounded) times the widened values. */
static inline __attribute__((always_inline)) void flash_weigh_fma(const float *probs, const uint16_t *values,
                                                                  int64_t head_dim, int64_t c, const float *rescale,
                                                                  float *acc_rows, const int count) {
    __m512 acc[WEIGH_FMA_ROWS][4];
    load_rescaled(acc, count, acc_rows, head_dim, c, rescale);
    for (int j = 0; j < FLASH_KEYS / 2; j++) {
        const uint16_t *pairs = values + j * 2 * head_dim + 2 * c;
        __m512 even[4], odd[4];  /* keys 2j and 2j + 1, 16 columns each */
        for (int i = 0; i < 4; i++) widen_pairs(_mm512_loadu_si512(pairs + 32 * i), &even[i], &odd[i]);
        for (int r = 0; r < count; r++) {
            const __m512 pe = _mm512_set1_ps(probs[r * FLASH_KEYS + 2 * j]);
            const __m512 po = _mm512_set1_ps(probs[r * FLASH_KEYS + 2 * j + 1]);
            for (int i = 0; i < 4; i++)
                acc[r][i] = _mm512_fmadd_ps(po, odd[i], _mm512_fmadd_ps(pe, even[i], acc[r][i]));
        }
    }
    store_result(acc, count, acc_rows, head_dim, c);
}

/* Scores of `rows` rows against one tile of 32 keys, a pass of rows at a time (a constant count per copy, so the
 * sums stay in registers): float32 FMAs over qf's rows, or the dot products over qb's. */
static void flash_score_rows(int fma, const uint16_t *qb, const float *qf, int64_t head_dim, const uint16_t *keys,
                             float *scores, int64_t rows) {
    for (int64_t r = 0; r < rows && fma;) {
        const int n = rows - r < SCORE_FMA_ROWS ? (int)(rows - r) : SCORE_FMA_ROWS;
        switch (n) {
#define SCORE_CASE(c) case c: flash_scores_fma(qf + r * head_dim, head_dim, keys, scores + r * FLASH_KEYS, c); break;
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4) SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7)
            SCORE_CASE(8)
#undef SCORE_CASE
        }
        r += n;
    }
    for (int64_t r = 0; r < rows && !fma;) {
        const int n = rows - r < SCORE_ROWS ? (int)(rows - r) : SCORE_ROWS;
        switch (n) {
#define SCORE_CASE(c) case c: flash_scores(qb + r * head_dim, head_dim, keys, scores + r * FLASH_KEYS, c); break;
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4) SCORE_CASE(5) SCORE_CASE(6)
            SCORE_CASE(7) SCORE_CASE(8) SCORE_CASE(9) SCORE_CASE(10) SCORE_CASE(11) SCORE_CASE(12)
#undef SCORE_CASE
        }
        r += n;
    }
}

/* The running results of `rows` rows rescaled and plus their probabilities times one tile of values, 64 columns
 * and a pass of rows at a time: float32 FMAs over the float32 probabilities, or the dot products over the bf16
 * ones. */
static void flash_weigh_rows(int fma, const uint16_t *probs, const float *probs_f, const uint16_t *values,
                             int64_t head_dim, const float *rescale, float *acc, int64_t rows) {
    for (int64_t c = 0; c < head_dim; c += 64) {
        for (int64_t r = 0; r < rows && fma;) {
            const int n = rows - r < WEIGH_FMA_ROWS ? (int)(rows - r) : WEIGH_FMA_ROWS;
            switch (n) {
#define WEIGH_CASE(k) case k: flash_weigh_fma(probs_f + r * FLASH_KEYS, values, head_dim, c, rescale + r, \
                                              acc + r * head_dim, k); break;
                WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4)
#undef WEIGH_CASE
            }
            r += n;
        }
        for (int64_t r = 0; r < rows && !fma;) {
            const int n = rows - r < WEIGH_ROWS ? (int)(rows - r) : WEIGH_ROWS;
            switch (n) {
#define WEIGH_CASE(k) case k: flash_weigh(probs + r * FLASH_KEYS, values, head_dim, c, rescale + r, \
                                          acc + r * head_dim, k); break;
                WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4) WEIGH_CASE(5) WEIGH_CASE(6)
#undef WEIGH_CASE
            }
            r += n;
        }
    }
}

/* Work item `item` of infer_flash_attention (items_at: the chunks' first items): its chunk, which of `heads` heads
 * (the query heads on AMX, the KV heads on the dot products), its first query token in the chunk and how many (the
 * chunk's last tiles of tokens, which see the most keys, first), the first token's position, and the chunk's keys
 * rounded up to whole tiles. */
typedef struct {
    int64_t chunk, head, first, tokens, offset, keys;
} flash_item;

static flash_item flash_item_at(int64_t item, const int64_t *items_at, const int64_t *query_lens,
                                const int64_t *contexts, int64_t heads) {
    flash_item it = {0};
    while (items_at[it.chunk + 1] <= item) it.chunk++;
    const int64_t local = item - items_at[it.chunk], length = query_lens[it.chunk];
    const int64_t tiles = (length + FLASH_TOKENS - 1) / FLASH_TOKENS;
    it.head = local % heads;
    it.first = (tiles - 1 - local / heads) * FLASH_TOKENS;
    it.tokens = length - it.first < FLASH_TOKENS ? length - it.first : FLASH_TOKENS;
    it.offset = contexts[it.chunk] - length + it.first;
    it.keys = (contexts[it.chunk] + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS;
    return it;
}

/* Key j of one sequence's context (head kvh) into the packed K and V of its tile: keys in two halves of 16 as
 * flash_scores reads them, values in key pairs as flash_weigh reads them. `key`/`value` NULL: zeros (padding). */
static void flash_pack_key(const void *key, const void *value, int kv_bf16, int64_t j, int64_t head_dim,
                           uint16_t *packed_keys, uint16_t *packed_values) {
    uint16_t *kt = packed_keys + (j / FLASH_KEYS) * FLASH_KEYS * head_dim + ((j % FLASH_KEYS) / 16) * 16 * head_dim;
    uint16_t *vt = packed_values + (j / 2) * 2 * head_dim;
    const int lane = (int)(j % 16), odd = (int)(j % 2);
    for (int64_t d = 0; d < head_dim; d++) {
        uint16_t k = 0, v = 0;
        if (key) {
            k = kv_bf16 ? ((const uint16_t *)key)[d] : float_to_bf16(((const float *)key)[d]);
            v = kv_bf16 ? ((const uint16_t *)value)[d] : float_to_bf16(((const float *)value)[d]);
        }
        kt[(d / 2) * 32 + lane * 2 + (d % 2)] = k;
        vt[d * 2 + odd] = v;
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define FLASH_AMX 1
/* ---- the same on AMX tiles, transposed: 16 query tokens of one head are the 16 lanes of every register ---------
 * S^T = K Q^T (keys as A rows, Q^T as the B tile), so each register of scores is one key for the 16 tokens and the
 * softmax's maxima, sums and rescaling are lane-wise (no reductions across a register); O^T += V^T P^T, the
 * results' 64 dims x 16 tokens held in four tiles through the whole item. A lane's maximum moves only when a tile's
 * exceeds it by more than FLASH_SLACK (then the held results are rescaled once), so the probabilities stay below
 * e^FLASH_SLACK before the final division: the same sums as rescaling at every tile, far fewer rescalings. */
#define FLASH_SLACK 8.0f

/* Key j into the AMX layouts: keys as rows of head_dim bf16, values transposed per tile of 32 keys (head_dim rows
 * of 32 keys, the A operand of V^T P^T). `key`/`value` NULL: zeros (padding past the context). */
static void flash_pack_key_amx(const void *key, const void *value, int kv_bf16, int64_t j, int64_t head_dim,
                               uint16_t *packed_keys, uint16_t *packed_values) {
    uint16_t *kt = packed_keys + j * head_dim;
    uint16_t *vt = packed_values + (j / FLASH_KEYS) * FLASH_KEYS * head_dim + j % FLASH_KEYS;
    if (key && kv_bf16) {  /* a bf16 pool's row as it is */
        memcpy(kt, key, sizeof(uint16_t) * head_dim);
        for (int64_t d = 0; d < head_dim; d++) vt[d * FLASH_KEYS] = ((const uint16_t *)value)[d];
        return;
    }
    for (int64_t d = 0; d < head_dim; d++) {
        kt[d] = key ? float_to_bf16(((const float *)key)[d]) : 0;
        vt[d * FLASH_KEYS] = key ? float_to_bf16(((const float *)value)[d]) : 0;
    }
}

/* Tiles 0 and 1 = S^T of 32 keys (rows of 64 bf16, from `keys`) and the 16 tokens of q_t (Q^T, 32 dim pairs). */
static inline __attribute__((always_inline)) void flash_scores_amx(const uint32_t (*q_t)[16], const uint16_t *keys) {
    _tile_zero(0);
    _tile_zero(1);
    for (int d = 0; d < 64; d += 32) {
        _tile_loadd(4, q_t[d / 2], 64);
        _tile_loadd(5, keys + d, 128);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(5, keys + 16 * 64 + d, 128);
        _tile_dpbf16ps(1, 5, 4);
    }
}

/* One work item: `tokens` (<= 16) query rows of one head, q_stride floats apart, positions offset onwards, against
 * the keys and values packed by flash_pack_key_amx, into out (rows out_stride floats apart). head_dim is 64 (four
 * result tiles); the caller has loaded the tile configuration (every tile 16 rows of 64 bytes). */
static void flash_item_amx(const float *q, int64_t q_stride, int64_t tokens, int64_t offset, const uint16_t *keys,
                           const uint16_t *values, float scale, float *out, int64_t out_stride) {
    enum { HEAD_DIM = 64 };
    uint32_t q_rows[16][HEAD_DIM / 2];           /* Q in bf16, a token per row (its dim pairs as 32-bit words) */
    uint32_t q_t[HEAD_DIM / 2][16];              /* Q^T as B tiles: per dim pair, the 16 tokens' pairs */
    float scores[FLASH_KEYS][16];                /* S^T: a key per row, a token per lane */
    uint16_t probs[FLASH_KEYS / 2][16][2];       /* P^T as a B tile: per key pair, the 16 tokens' pairs */
    float results[HEAD_DIM][16];
    for (int64_t t = 0; t < 16; t++) {           /* lanes past `tokens`: zero queries, results never read */
        for (int d = 0; d < HEAD_DIM; d += 32) {
            const __m512 low = t < tokens ? _mm512_loadu_ps(q + t * q_stride + d) : _mm512_setzero_ps();
            const __m512 high = t < tokens ? _mm512_loadu_ps(q + t * q_stride + d + 16) : _mm512_setzero_ps();
            _mm512_storeu_si512(&q_rows[t][d / 2], (__m512i)_mm512_cvtne2ps_pbh(high, low));
        }
    }
    const __m512i token_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                   1, 0), _mm512_set1_epi32(HEAD_DIM / 2));
    for (int p = 0; p < HEAD_DIM / 2; p++)
        _mm512_storeu_si512(q_t[p], _mm512_i32gather_epi32(token_rows, &q_rows[0][p], 4));
    const __m512 factor = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 held = minus_inf, total = _mm512_setzero_ps();  /* per token: the maximum its sums are scaled to */
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(6);
    _tile_zero(7);
    const int64_t last = offset + tokens - 1;
    flash_scores_amx(q_t, keys);
    for (int64_t k0 = 0; k0 <= last; k0 += FLASH_KEYS) {
        _tile_stored(0, &scores[0][0], 64);
        _tile_stored(1, &scores[16][0], 64);
        /* the next tile's scores on the tile unit while this tile's softmax runs on the vector units */
        if (k0 + FLASH_KEYS <= last) flash_scores_amx(q_t, keys + (k0 + FLASH_KEYS) * HEAD_DIM);
        /* the scores scaled, in place: key k0 + j is seen by the tokens at or after its position (masked to -inf
         * for the others); unrolled, so that the four chains of maxima and the sums below stay in registers */
        __m512 tops[4] = {minus_inf, minus_inf, minus_inf, minus_inf};
#pragma GCC unroll 32
        for (int j = 0; j < FLASH_KEYS; j++) {
            const int64_t ahead = k0 + j - offset;
            const __mmask16 seen = ahead <= 0 ? 0xFFFF : ahead >= 16 ? 0 : (__mmask16)(0xFFFFu << ahead);
            const __m512 scaled = _mm512_mask_mul_ps(minus_inf, seen, _mm512_loadu_ps(scores[j]), factor);
            _mm512_storeu_ps(scores[j], scaled);
            tops[j % 4] = _mm512_max_ps(tops[j % 4], scaled);
        }
        const __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
        const __mmask16 moved = _mm512_cmp_ps_mask(top, _mm512_add_ps(held, _mm512_set1_ps(FLASH_SLACK)),
                                                   _CMP_GT_OQ);
        if (moved) {  /* those tokens' sums rescaled to their new maxima (none held yet on the first tile) */
            const __m512 target = _mm512_mask_mov_ps(held, moved, top);
            const __m512 rescale = exp16(_mm512_sub_ps(held, target));
            total = _mm512_mul_ps(total, rescale);
            if (k0 > 0) {
                _tile_stored(2, &results[0][0], 64);
                _tile_stored(3, &results[16][0], 64);
                _tile_stored(6, &results[32][0], 64);
                _tile_stored(7, &results[48][0], 64);
                for (int d = 0; d < HEAD_DIM; d++)
                    _mm512_storeu_ps(results[d], _mm512_mul_ps(_mm512_loadu_ps(results[d]), rescale));
                _tile_loadd(2, &results[0][0], 64);
                _tile_loadd(3, &results[16][0], 64);
                _tile_loadd(6, &results[32][0], 64);
                _tile_loadd(7, &results[48][0], 64);
            }
            held = target;
        }
        __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
        for (int j = 0; j < FLASH_KEYS; j += 2) {
            const __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores[j]), held));
            const __m512 p1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores[j + 1]), held));
            sums[j / 2 % 4] = _mm512_add_ps(sums[j / 2 % 4], _mm512_add_ps(p0, p1));
            const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            _mm512_storeu_si512(&probs[j / 2][0][0], pair);
        }
        total = _mm512_add_ps(total, _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3])));
        _tile_loadd(4, &probs[0][0][0], 64);
        const uint16_t *v = values + k0 * HEAD_DIM;  /* V^T of this tile: a dim per row, 32 keys */
        _tile_loadd(5, v, FLASH_KEYS * 2);
        _tile_dpbf16ps(2, 5, 4);
        _tile_loadd(5, v + 16 * FLASH_KEYS, FLASH_KEYS * 2);
        _tile_dpbf16ps(3, 5, 4);
        _tile_loadd(5, v + 32 * FLASH_KEYS, FLASH_KEYS * 2);
        _tile_dpbf16ps(6, 5, 4);
        _tile_loadd(5, v + 48 * FLASH_KEYS, FLASH_KEYS * 2);
        _tile_dpbf16ps(7, 5, 4);
    }
    _tile_stored(2, &results[0][0], 64);
    _tile_stored(3, &results[16][0], 64);
    _tile_stored(6, &results[32][0], 64);
    _tile_stored(7, &results[48][0], 64);
    float inverse[16];
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    const __m512i dim_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1,
                                                                 0), _mm512_set1_epi32(16));
    for (int64_t t = 0; t < tokens; t++) {  /* O^T back to a row per token, divided by the token's sum */
        const __m512 factor_t = _mm512_set1_ps(inverse[t]);
        for (int d = 0; d < HEAD_DIM; d += 16)
            _mm512_storeu_ps(out + t * out_stride + d,
                             _mm512_mul_ps(_mm512_i32gather_ps(dim_rows, &results[d][t], 4), factor_t));
    }
}
#endif

/* Causal attention for `count` prefill chunks: chunk i is token rows starts[i] .. starts[i] + query_lens[i] - 1 of
 * q [T, num_heads, head_dim] (float32, rows q_stride apart), positions contexts[i] - query_lens[i] onwards of the
 * sequence whose block table row is tables[i]; each row attends to its own position and every one before, read
 * from the layer's pool kv (float32, or bfloat16 when kv_bf16) into out [T, num_heads, head_dim] (float32). The
 * precision of torch's bf16 flash attention: Q, K, V and the probabilities rounded to bf16, the scores, the softmax
 * and the sums float32. Each chunk's K/V of each KV head are packed once (two tiles of keys per 32 as
 * flash_scores reads them, values in key pairs), then work items of FLASH_TOKENS query tokens times the query heads
 * of one KV head run an online softmax over tiles of 32 keys, the last tiles of each chunk (the most keys) first.
 * With `fma` the products are float32 FMAs over the widened K/V instead, Q and the probabilities kept float32 (for
 * CPUs whose float32 rate beats their bf16 dot products, as the tile GEMM's fma). head_dim must be a multiple of 64.
 * Without fma, at head_dim 64 on a build and OS with AMX, the products run on AMX tiles instead (flash_item_amx:
 * K packed as rows, V transposed per tile, a work item per 16 query tokens of one head). */
void infer_flash_attention(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *starts, const int64_t *query_lens,
                           const int64_t *contexts, const int64_t *tables, int64_t count, float *out,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t num_blocks, float scale, int64_t kv_bf16, int64_t fma) {
#if defined(__AVX512BF16__)
    const int64_t per_kv = num_heads / num_kv_heads, slot_width = num_kv_heads * head_dim;
    /* bf16 products on AMX tiles where the build and Linux allow (head_dim 64): a work item per query head */
    const int amx = !fma && head_dim == 64 && amx_available();
    const int64_t item_heads = amx ? num_heads : num_kv_heads;
    const int64_t pool_values = num_blocks * block_size * slot_width;
    const size_t element = kv_bf16 ? 2 : 4;
    int64_t *packed_at = malloc(sizeof(int64_t) * (count + 1)), *items_at = malloc(sizeof(int64_t) * (count + 1));
    packed_at[0] = items_at[0] = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t keys = (contexts[i] + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS;
        packed_at[i + 1] = packed_at[i] + keys * num_kv_heads * head_dim;
        items_at[i + 1] = items_at[i] + (query_lens[i] + FLASH_TOKENS - 1) / FLASH_TOKENS * item_heads;
    }
    uint16_t *packed_keys = malloc(sizeof(uint16_t) * packed_at[count]);
    uint16_t *packed_values = malloc(sizeof(uint16_t) * packed_at[count]);
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = 0; i < count; i++) {
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                const int64_t keys = (contexts[i] + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS;
                const int64_t at = packed_at[i] + kvh * keys * head_dim;
                const int32_t *table = block_tables + tables[i] * table_stride;
                for (int64_t j = 0; j < keys; j++) {
                    const char *key = NULL, *value = NULL;
                    if (j < contexts[i]) {
                        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
                        key = (const char *)kv + (slot * slot_width + kvh * head_dim) * element;
                        value = key + pool_values * element;
                    }
#ifdef FLASH_AMX
                    if (amx) {
                        flash_pack_key_amx(key, value, (int)kv_bf16, j, head_dim, packed_keys + at,
                                           packed_values + at);
                        continue;
                    }
#endif
                    flash_pack_key(key, value, (int)kv_bf16, j, head_dim, packed_keys + at, packed_values + at);
                }
            }
        }  /* the loop's barrier: every tile is packed before any is read */
#ifdef FLASH_AMX
        if (amx) {
            load_full_tiles();
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items_at[count]; item++) {
                const flash_item it = flash_item_at(item, items_at, query_lens, contexts, num_heads);
                const int64_t at = packed_at[it.chunk] + it.head / per_kv * it.keys * head_dim;
                const int64_t row = starts[it.chunk] + it.first;
                flash_item_amx(q + row * q_stride + it.head * head_dim, q_stride, it.tokens, it.offset,
                               packed_keys + at, packed_values + at, scale,
                               out + (row * num_heads + it.head) * head_dim, num_heads * head_dim);
            }
            _tile_release();
        } else
#endif
        {
            const int64_t max_rows = FLASH_TOKENS * per_kv;
            /* Q's rows and the probabilities: float32 (the probabilities in place of the scores) with fma, else bf16 */
            uint16_t *qb = fma ? NULL : malloc(sizeof(uint16_t) * max_rows * head_dim);
            float *qf = fma ? malloc(sizeof(float) * max_rows * head_dim) : NULL;
            uint16_t *probs = fma ? NULL : malloc(sizeof(uint16_t) * max_rows * FLASH_KEYS);
            float *scores = malloc(sizeof(float) * max_rows * FLASH_KEYS);
            float *acc = malloc(sizeof(float) * max_rows * head_dim);
            float *best = malloc(sizeof(float) * max_rows), *total = malloc(sizeof(float) * max_rows);
            float *rescale = malloc(sizeof(float) * max_rows), *top = malloc(sizeof(float) * max_rows);
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items_at[count]; item++) {
                const flash_item it = flash_item_at(item, items_at, query_lens, contexts, num_kv_heads);
                const int64_t i = it.chunk, kvh = it.head, first = it.first, tokens = it.tokens, keys = it.keys;
                const int64_t rows = tokens * per_kv, offset = it.offset;  /* offset: row 0's position */
                const uint16_t *own_keys = packed_keys + packed_at[i] + kvh * keys * head_dim;
                const uint16_t *own_values = packed_values + packed_at[i] + kvh * keys * head_dim;
                /* row r: token first + r / per_kv, head kvh * per_kv + r % per_kv */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t token = starts[i] + first + r / per_kv, head = kvh * per_kv + r % per_kv;
                    if (fma)
                        memcpy(qf + r * head_dim, q + token * q_stride + head * head_dim, sizeof(float) * head_dim);
                    else
                        floats_to_bf16(q + token * q_stride + head * head_dim, qb + r * head_dim, head_dim);
                    best[r] = -INFINITY;
                    total[r] = 0.0f;
                }
                memset(acc, 0, sizeof(float) * rows * head_dim);
                const int64_t last = offset + tokens - 1;  /* the last row's position: keys beyond it are never seen */
                for (int64_t k0 = 0; k0 <= last; k0 += FLASH_KEYS) {
                    const uint16_t *key_tile = own_keys + k0 * head_dim, *value_tile = own_values + k0 * head_dim;
                    flash_score_rows((int)fma, qb, qf, head_dim, key_tile, scores, rows);
                    const __m512 factor = _mm512_set1_ps(scale), none = _mm512_set1_ps(-INFINITY);
                    /* the online softmax, keys past the row's position masked: each row's scaled scores and new
                     * maximum, then every row's rescale 16 rows a vector (a scalar expf a row had been a sixth of
                     * the softmax), then the probabilities and their sums */
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t seen = offset + r / per_kv - k0 + 1;
                        const __mmask16 m0 = first_lanes(seen), m1 = first_lanes(seen - 16);
                        const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(scores + r * FLASH_KEYS), factor);
                        const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(scores + r * FLASH_KEYS + 16), factor);
                        _mm512_storeu_ps(scores + r * FLASH_KEYS, s0);
                        _mm512_storeu_ps(scores + r * FLASH_KEYS + 16, s1);
                        top[r] = fmaxf(best[r], _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(none, m0, s0),
                                                                                    _mm512_mask_mov_ps(none, m1, s1))));
                    }
                    for (int64_t r = 0; r < rows; r += 16) {  /* 0 on the first tile (best -inf) */
                        const __mmask16 m = first_lanes(rows - r);
                        _mm512_mask_storeu_ps(rescale + r, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, best + r),
                                                                                  _mm512_maskz_loadu_ps(m, top + r))));
                    }
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t seen = offset + r / per_kv - k0 + 1;
                        const __mmask16 m0 = first_lanes(seen), m1 = first_lanes(seen - 16);
                        const __m512 shift = _mm512_set1_ps(top[r]);
                        const __m512 p0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(
                            _mm512_loadu_ps(scores + r * FLASH_KEYS), shift)));
                        const __m512 p1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(
                            _mm512_loadu_ps(scores + r * FLASH_KEYS + 16), shift)));
                        total[r] = total[r] * rescale[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                        best[r] = top[r];
                        if (fma) {  /* the probabilities replace the row's scores, float32 */
                            _mm512_storeu_ps(scores + r * FLASH_KEYS, p0);
                            _mm512_storeu_ps(scores + r * FLASH_KEYS + 16, p1);
                        } else {
                            _mm256_storeu_si256((__m256i *)(probs + r * FLASH_KEYS), bf16x16_from(p0));
                            _mm256_storeu_si256((__m256i *)(probs + r * FLASH_KEYS + 16), bf16x16_from(p1));
                        }
                    }
                    flash_weigh_rows((int)fma, probs, scores, value_tile, head_dim, rescale, acc, rows);
                }
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t token = starts[i] + first + r / per_kv, head = kvh * per_kv + r % per_kv;
                    const float inverse = 1.0f / total[r];
                    float *result = out + (token * num_heads + head) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) result[d] = acc[r * head_dim + d] * inverse;
                }
            }
            free(top);
            free(rescale);
            free(total);
            free(best);
            free(acc);
            free(scores);
            free(probs);
            free(qf);
            free(qb);
        }
    }
    free(packed_values);
    free(packed_keys);
    free(items_at);
    free(packed_at);
#else
    (void)q; (void)q_stride; (void)kv; (void)block_tables; (void)table_stride; (void)starts; (void)query_lens;
    (void)contexts; (void)tables; (void)count; (void)out; (void)num_heads; (void)num_kv_heads; (void)head_dim;
    (void)block_size; (void)num_blocks; (void)scale; (void)kv_bf16; (void)fma;
    abort();  /* the Python side asks infer_flash_kind first */
#endif
}

/* ---- a few tokens through a layer's dense parts -------------------------------------------------------------- */

/* One layer's projections packed by pack_weights (fp16, bf16, or int8 with scales from pack_scales; see
 * linear_packed) with their optional float32 biases, its two RMSNorm weights and its shapes. */
typedef struct {
    const void *qkv, *o, *gate_up, *down;  /* stored as their *_kind says */
    const float *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *input_norm, *post_norm;
    float eps;
    int64_t hidden, qkv_width, q_width, intermediate, rotated_heads, head_dim;
    int64_t qkv_groups, o_groups, gate_up_groups, down_groups;  /* int8: scales per row */
    int64_t qkv_kind, o_kind, gate_up_kind, down_kind;  /* KIND_F16, KIND_I8 or KIND_BF16 */
    /* bf16 only, optional (NULL: none): the same weights laid out by pack_tiles for the tile GEMM (AMX or
     * AVX512-BF16), which takes steps of more rows than one pass of the GEMV */
    const uint16_t *qkv_tiles, *o_tiles, *gate_up_tiles, *down_tiles;
    int64_t tiles_fma;  /* the tiles multiply float32 rows with FMAs (infer_linear_tiles' fma) */
} infer_layer;

/* The layer's first half up to attention for `tokens` tokens: residual += delta (none for the first layer),
 * RMSNorm, the QKV projection into qkv [tokens, qkv_width], RoPE on its Q and K heads at `positions`. */
void infer_layer_attention_input(const infer_layer *layer, int64_t tokens, float *residual, const float *delta,
                                 const int64_t *positions, const float *cos_table, const float *sin_table,
                                 float *qkv) {
    const int bf16 = tiles_take_bf16(layer->qkv_tiles, layer->tiles_fma, tokens);
    void *normed = malloc((bf16 ? sizeof(uint16_t) : sizeof(float)) * tokens * layer->hidden);
    infer_add_rms_norm_mixed(residual, delta, 0, normed, bf16, layer->input_norm, tokens, layer->hidden, layer->eps);
    layer_linear(layer->qkv, layer->qkv_kind, layer->qkv_scales, layer->qkv_groups, layer->qkv_tiles,
                 layer->tiles_fma, normed, bf16, tokens, layer->hidden, layer->qkv_bias, qkv, layer->qkv_width);
    infer_rope(qkv, positions, cos_table, sin_table, tokens, layer->qkv_width, layer->rotated_heads,
               layer->head_dim);
    free(normed);
}

/* The layer's second half from attention's output [tokens, q_width]: the output projection, residual += it,
 * RMSNorm, gate/up projection, SiLU-and-multiply, down projection into delta [tokens, hidden] (the next norm adds
 * it). */
void infer_layer_feed_forward(const infer_layer *layer, int64_t tokens, const float *attended, float *residual,
                              float *delta) {
    const int64_t hidden = layer->hidden, intermediate = layer->intermediate;
    const int normed_bf16 = tiles_take_bf16(layer->gate_up_tiles, layer->tiles_fma, tokens);
    const int activated_bf16 = tiles_take_bf16(layer->down_tiles, layer->tiles_fma, tokens);
    float *projected = malloc(sizeof(float) * tokens * hidden);
    void *normed = malloc((normed_bf16 ? sizeof(uint16_t) : sizeof(float)) * tokens * hidden);
    float *gate_up = malloc(sizeof(float) * tokens * 2 * intermediate);
    void *activated = malloc((activated_bf16 ? sizeof(uint16_t) : sizeof(float)) * tokens * intermediate);
    layer_linear(layer->o, layer->o_kind, layer->o_scales, layer->o_groups, layer->o_tiles, layer->tiles_fma,
                 attended, 0, tokens, layer->q_width, layer->o_bias, projected, hidden);
    infer_add_rms_norm_mixed(residual, projected, 0, normed, normed_bf16, layer->post_norm, tokens, hidden,
                             layer->eps);
    layer_linear(layer->gate_up, layer->gate_up_kind, layer->gate_up_scales, layer->gate_up_groups,
                 layer->gate_up_tiles, layer->tiles_fma, normed, normed_bf16, tokens, hidden, layer->gate_up_bias,
                 gate_up, 2 * intermediate);
    if (activated_bf16)
        silu_mul(gate_up, activated, tokens, intermediate, 1);
    else
        silu_mul(gate_up, activated, tokens, intermediate, 0);
    layer_linear(layer->down, layer->down_kind, layer->down_scales, layer->down_groups, layer->down_tiles,
                 layer->tiles_fma, activated, activated_bf16, tokens, intermediate, layer->down_bias, delta, hidden);
    free(activated);
    free(gate_up);
    free(normed);
    free(projected);
}

/* ---- a few tokens through a stack of layers, attention included ---------------------------------------------- */

/* One step's attention as infer_paged_attention runs it (see there), with the slots its tokens' K/V go to. */
typedef struct {
    const int32_t *block_tables;
    int64_t table_stride;
    const int64_t *slots, *rows, *seq_of_query, *context_lens;
    int64_t queries, max_context, num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    float scale;
    int64_t kv_bf16;  /* the pool holds bfloat16 */
    const int64_t *own_keys;  /* NULL, or a draft tree's leaves' own K/V (infer_paged_attention's own_keys) */
    int64_t dots;  /* a bf16 pool's queries on AVX512-BF16's dot products (infer_paged_attention's dots) */
} infer_attention_step;

/* `count` layers over `tokens` tokens in one call, what infer_layer_attention_input, infer_write_kv,
 * infer_paged_attention and infer_layer_feed_forward do one by one from Python: layer l reads and writes the pool
 * at kv + kv_layers[l] * kv_layer_stride (elements of the pool's dtype). `residual` [tokens, hidden] holds the
 * embeddings on entry (the first layer adds nothing) and the residual stream on return; `delta` [tokens, hidden]
 * receives the last layer's output (the final norm adds the two). All layers share the hidden size and the
 * attention shapes. */
void infer_layers_few(const infer_layer *layers, const int64_t *kv_layers, int64_t count, int64_t tokens,
                      float *residual, float *delta, const int64_t *positions, const float *cos_table,
                      const float *sin_table, void *kv, int64_t kv_layer_stride, const infer_attention_step *step) {
    if (count == 0) return;
    const int64_t qkv_width = layers[0].qkv_width, q_width = layers[0].q_width;
    const int64_t kv_width = step->num_kv_heads * step->head_dim;
    const int64_t num_slots = step->num_blocks * step->block_size;
    float *qkv = malloc(sizeof(float) * tokens * qkv_width), *attended = calloc(tokens * q_width, sizeof(float));
    for (int64_t l = 0; l < count; l++) {
        void *pool = (char *)kv + kv_layers[l] * kv_layer_stride * (step->kv_bf16 ? 2 : 4);
        infer_layer_attention_input(&layers[l], tokens, residual, l ? delta : NULL, positions, cos_table, sin_table,
                                    qkv);
        infer_write_kv(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, pool, step->slots, tokens,
                       kv_width, num_slots, step->kv_bf16);
        infer_paged_attention(qkv, qkv_width, pool, step->block_tables, step->table_stride, step->rows,
                              step->seq_of_query, step->context_lens, step->own_keys, attended, step->queries,
                              step->num_heads, step->num_kv_heads, step->head_dim, step->block_size,
                              step->num_blocks, step->max_context, step->scale, step->kv_bf16, step->dots);
        infer_layer_feed_forward(&layers[l], tokens, attended, residual, delta);
    }
    free(attended);
    free(qkv);
}

/* ---- token bitmasks (structured output) ---------------------------------------------------------------------- */

/* Bitmask row i (words int32 per row; token t allowed when bit t % 32 of word t / 32 is set) masks logits row
 * rows[i] (vocab floats, row_stride apart): forbidden tokens become -inf. Whole words of allowed tokens are skipped
 * and whole forbidden words filled, so a mask costs what it forbids. */
void infer_apply_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                         const int64_t *rows, int64_t num_rows, int64_t vocab) {
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * row_stride;
        const uint32_t *mask = (const uint32_t *)bitmask + i * words;
        for (int64_t w = 0; w < words && w * 32 < vocab; w++) {
            uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            if (bits == 0) {
                for (int64_t t = base; t < end; t++) row[t] = -INFINITY;
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
    }
}

/* ---- a draft head's step (EAGLE) ----------------------------------------------------------------------------- */

/* An EAGLE draft head (plugins/drafters/eagle): RMSNorm weights, its fc [hidden, 2 * hidden] and its
 * draft-vocabulary output [vocab, hidden], packed as their *_kind says (int8: *_groups scales a row). */
typedef struct {
    const float *embed_norm, *feature_norm, *norm;
    float eps;
    const void *fc;
    const float *fc_scales, *fc_bias;
    int64_t fc_groups, fc_kind;
    const void *out;
    const float *out_scales;
    int64_t out_groups, out_kind, vocab, hidden;
} infer_draft_head;

/* One draft step of the head over `tokens` pairs (token embedding, the target feature before it), what the drafter
 * did in about twenty calls from Python: x = fc([norm_e(embeds), norm_f(features)]), the head's layer over x
 * (infer_layers_few, one layer: its K/V into the head's pool `kv`), then for each of `seqs` sequences the row
 * last_rows[s] only: predicted[s] = norm(x + layer's output), its draft logits, and guesses[s * width ..] their
 * `width` largest (in descending order, the first of equal ones first) with their softmax probabilities in
 * confidence[s * width ..]. */
void infer_draft_head_step(const infer_draft_head *head, const infer_layer *layer, int64_t tokens,
                           const float *embeds, const float *features, const int64_t *positions,
                           const float *cos_table, const float *sin_table, void *kv,
                           const infer_attention_step *step, const int64_t *last_rows, int64_t seqs,
                           float *predicted, int64_t width, int64_t *guesses, float *confidence) {
    const int64_t hidden = head->hidden, vocab = head->vocab;
    float *pairs = malloc(sizeof(float) * tokens * 2 * hidden);
    float *x = malloc(sizeof(float) * tokens * hidden), *delta = malloc(sizeof(float) * tokens * hidden);
    float *logits = malloc(sizeof(float) * seqs * vocab);
    for (int64_t t = 0; t < tokens; t++) {  /* norms of unchanged rows: no residual is added */
        add_rms_norm((float *)embeds + t * hidden, NULL, 0, pairs + t * 2 * hidden, head->embed_norm, 1, hidden,
                     head->eps, 0);
        add_rms_norm((float *)features + t * hidden, NULL, 0, pairs + t * 2 * hidden + hidden, head->feature_norm, 1,
                     hidden, head->eps, 0);
    }
    layer_linear(head->fc, head->fc_kind, head->fc_scales, head->fc_groups, NULL, 0, pairs, 0, tokens, 2 * hidden,
                 head->fc_bias, x, hidden);
    const int64_t own_layer = 0;
    infer_layers_few(layer, &own_layer, 1, tokens, x, delta, positions, cos_table, sin_table, kv, 0, step);
    for (int64_t s = 0; s < seqs; s++)
        add_rms_norm(x + last_rows[s] * hidden, delta + last_rows[s] * hidden, 0, predicted + s * hidden,
                     head->norm, 1, hidden, head->eps, 0);
    layer_linear(head->out, head->out_kind, head->out_scales, head->out_groups, NULL, 0, predicted, 0, seqs, hidden,
                 NULL, logits, vocab);
    for (int64_t s = 0; s < seqs; s++) {
        float *row = logits + s * vocab, *top = confidence + s * width;
        int64_t *choice = guesses + s * width;
        for (int64_t w = 0; w < width; w++) {
            top[w] = -INFINITY;
            choice[w] = 0;
        }
        for (int64_t v = 0; v < vocab; v++) {  /* insertion into the `width` largest so far */
            if (!(row[v] > top[width - 1])) continue;
            int64_t at = width - 1;
            for (; at > 0 && row[v] > top[at - 1]; at--) {
                top[at] = top[at - 1];
                choice[at] = choice[at - 1];
            }
            top[at] = row[v];
            choice[at] = v;
        }
        const float best = top[0], total = exp_shifted_sum(row, vocab, best);
        for (int64_t w = 0; w < width; w++) top[w] = expf(top[w] - best) / total;
    }
    free(logits);
    free(delta);
    free(x);
    free(pairs);
}
