/* Linear layers over packed fp16, bf16 or int8 weights for a few rows of x (a decode or verification step): each
 * weight streamed from memory once, converted once in registers and used for every row of x.
 *
 * The weights are laid out by `infer.kernels.cpu.pack_weights` in blocks of four output rows, [n_out / 4][k / 8][4][8]:
 * each block is one sequential stream (row-major rows would be four), each 8-weight chunk holding 8 weights of each
 * of the block's 4 rows. Int8 weights come with one float scale per `group` consecutive weights of a row (a multiple
 * of 8 dividing k; k for one scale per row), laid out per block as [k / group][4]: the scales of the block's four
 * rows for each group of columns. */
#include "common.h"

/* Software prefetch of the GEMV's weight stream, ahead of the 64 bytes at `chunk` (into the next block at a block's
 * end, which this thread takes next): into L1 1 KB ahead and into L2 INFER_GEMV_L2_AHEAD (6 KB) ahead. An L1
 * prefetch alone keeps too few lines in flight (the L1's fill buffers are the limit). On 2 cores of an AMX Xeon, the
 * 30 layers and the output head in bf16 (`benchmarks/cpu_kernels.py --only prefetch`): 1 row 24.7-25.1 -> 27.3-28.2
 * GB/s with the L2 prefetch, 4 rows 20.6-21.5 -> 25.1-25.7, 8 rows 17.9-18.3 -> 19.6-20.5; fp16 alike. Against
 * a 2 KB L1-only prefetch, one row went 19.7 -> 24.6-26.9 GB/s, and the AVX2 build there 19.9 -> 23.8. On an AVX2
 * EPYC, the L1 prefetch had beaten the hardware prefetcher alone from 2 rows of x on (5 rows 13.8 vs 16.0 ms for the
 * 30 layers). */
#ifndef INFER_GEMV_L2_AHEAD
#define INFER_GEMV_L2_AHEAD 6144  /* 0: no L2 prefetch (benchmarks/cpu_kernels.py --only prefetch builds it so) */
#endif
static inline __attribute__((always_inline)) void gemv_prefetch(const char *chunk) {
    __builtin_prefetch(chunk + 1024, 0, 3);  /* prefetcht0 on x86 */
#if INFER_GEMV_L2_AHEAD
    __builtin_prefetch(chunk + INFER_GEMV_L2_AHEAD, 0, 2);  /* prefetcht1 */
#endif
}

/* Each block_dot_* below: sums[r][i] = x[r] . (output row i of the block) for `count` (1 to PASS_ROWS, a constant
 * once inlined) rows of x and a block of four output rows laid out [k / 8][4][8] (fp16, bf16, or int8 times
 * `scales`, by `kind`), one sequential stream. */

#if INFER_AVX512
/* Rows 2 * pair and 2 * pair + 1 of a chunk of a packed block: 16 floats, the first row's 8 weights then the
 * second's (one zmm register holds half of a 64-byte chunk). */
static inline __m512 packed_pair16(const void *chunk, int pair, const int kind) {
    if (kind == KIND_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)chunk +
                                                                                          pair * 16))));
    const uint16_t *rows = (const uint16_t *)chunk + pair * 16;
    return kind == KIND_BF16 ? bf16x16_load(rows) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rows));
}

/* A chunk is two registers (rows 0-1, rows 2-3); x's 8 floats are broadcast to both halves. Int8 with one scale per
 * row: the sums scaled at the end; with smaller groups, every converted weight (no registers are left for
 * per-group sums). */
static inline __attribute__((always_inline)) void block_dot_avx512(const float *x, int64_t k, const void *block,
                                                                   const float *scales, int64_t group,
                                                                   float sums[PASS_ROWS][4], const int count,
                                                                   const int kind) {
    const int int8 = kind == KIND_I8;
    const int64_t width = int8 ? 1 : 2;  /* bytes per weight */
    const int per_row = int8 && group == k;
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
}
#endif

#if INFER_AVX2 && INFER_F16C
/* The 8 weights of row i (0 to 3) of a chunk of a packed block, as floats. */
static inline __m256 packed_row8(const void *chunk, int i, const int kind) {
    if (kind == KIND_I8) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)chunk + i * 8));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    const uint16_t *row = (const uint16_t *)chunk + i * 8;
    return kind == KIND_BF16 ? bf16x8_load(row) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row));
}

/* One row of x over int8 weights with groups smaller than a row (decode at batch 1): sums per group, each scaled
 * once (scaling every weight instead measured 5.0 vs 4.6 ms over the 30 layers' projections at groups of 32). */
static inline __attribute__((always_inline)) void block_dot_avx2_groups(const float *x, int64_t k, const void *block,
                                                                        const float *scales, int64_t group,
                                                                        float sums[PASS_ROWS][4], const int kind) {
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
}

/* A register a row of the block, 4 x count accumulators. Int8 with one scale per row: the sums scaled at the end;
 * with smaller groups and more than one row of x, every converted weight. */
static inline __attribute__((always_inline)) void block_dot_avx2(const float *x, int64_t k, const void *block,
                                                                 const float *scales, int64_t group,
                                                                 float sums[PASS_ROWS][4], const int count,
                                                                 const int kind) {
    const int int8 = kind == KIND_I8;
    const int64_t width = int8 ? 1 : 2;  /* bytes per weight */
    const int per_row = int8 && group == k;
    if (int8 && count == 1 && !per_row) {
        block_dot_avx2_groups(x, k, block, scales, group, sums, kind);
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
}
#endif

/* Weight c (0 to 7) of row i (0 to 3) of a chunk of a packed block, as a float. */
static inline float packed_weight(const void *chunk, int i, int c, const int kind) {
    if (kind == KIND_I8) return (float)((const int8_t *)chunk)[i * 8 + c];
    const uint16_t bits = ((const uint16_t *)chunk)[i * 8 + c];
    return kind == KIND_BF16 ? bf16_to_float(bits) : half_to_float(bits);
}

/* The same sums in plain C, a weight at a time. */
static inline __attribute__((always_inline)) void block_dot_portable(const float *x, int64_t k, const void *block,
                                                                     const float *scales, int64_t group,
                                                                     float sums[PASS_ROWS][4], const int count,
                                                                     const int kind) {
    const int int8 = kind == KIND_I8;
    const int64_t width = int8 ? 1 : 2;  /* bytes per weight */
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
}

/* The block's sums on the widest SIMD this build has. */
static inline __attribute__((always_inline)) void block_dot(const float *x, int64_t k, const void *block,
                                                            const float *scales, int64_t group,
                                                            float sums[PASS_ROWS][4], const int count,
                                                            const int kind) {
#if INFER_AVX512
    block_dot_avx512(x, k, block, scales, group, sums, count, kind);
#elif INFER_AVX2 && INFER_F16C
    block_dot_avx2(x, k, block, scales, group, sums, count, kind);
#else
    block_dot_portable(x, k, block, scales, group, sums, count, kind);
#endif
}

/* How many rows of x the next pass of block_dot takes when `left` are left: PASS_ROWS while that many are left; on
 * AVX2 passes of 3 rows, then 2 (4 = 2 + 2, 5 = 3 + 2, 7 = 3 + 2 + 2), or 1 when only one is left. */
static inline int pass_rows(int64_t left) {
#if INFER_AVX512
    return left >= PASS_ROWS ? PASS_ROWS : (int)left;
#else
    return left == 1 ? 1 : (left == 2 || left == 4) ? 2 : 3;
#endif
}

/* infer_linear_f16, _bf16 and _i8 (cpu_kernels.h), the weights' storage as `kind`: each block is reused for up to
 * PASS_ROWS rows of x while in registers and for the next ones while in L1. Split over the threads by blocks. */
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

/* block_sums (common.h): one block's sums for any number of rows, in passes of pass_rows. */
void block_sums(const float *x, int64_t rows, int64_t k, const void *block, const float *scales, int64_t group,
                int kind, float *sums) {
    for (int64_t m = 0; m < rows;) {
        const int count = pass_rows(rows - m);
        float pass[PASS_ROWS][4];
        switch (count) {
#define BLOCK_DOT_KIND(n, kind_) block_dot(x + m * k, k, block, scales, group, pass, n, kind_)
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
        memcpy(sums + m * 4, pass, sizeof(float) * 4 * count);
        m += count;
    }
}

void infer_linear_f16(const float *x, int64_t rows, int64_t k, const uint16_t *w, const float *bias, float *y,
                      int64_t n_out) {
    linear_packed(x, rows, k, w, NULL, 0, bias, y, n_out, KIND_F16);
}

void infer_linear_bf16(const float *x, int64_t rows, int64_t k, const uint16_t *w, const float *bias, float *y,
                       int64_t n_out) {
    linear_packed(x, rows, k, w, NULL, 0, bias, y, n_out, KIND_BF16);
}

void infer_linear_i8(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *scales, int64_t groups,
                     const float *bias, float *y, int64_t n_out) {
    linear_packed(x, rows, k, w, scales, groups, bias, y, n_out, KIND_I8);
}

int64_t infer_pass_rows(void) { return PASS_ROWS; }

/* ---- the head screen's GEMV on AVX512-VNNI (infer.model.head_screen.HeadScreen) ----------------------------------
 *
 * The int8 GEMV above widens every weight to float32 and runs an FMA per weight, more instructions a byte than the
 * memory's rate leaves room for (the screen's Qwen3-1.7B head, 311 MB, took 12.8 ms of a 102 ms decode step on 2
 * cores of an AMX Xeon). Here each row of x is rounded to int16 once (its largest magnitude to
 * 32,767) and each 32-byte chunk of four output rows' 8 weights is widened to int16 and multiplied on one VPDPWSSD
 * per row of x: 16 int32 lanes, a 128-bit lane per output row. The sums are exact integers: a lane adds two products
 * of at most 127 x 32,767 a chunk, and the int32 sums go into float32 every SCREEN_FLUSH columns (256 products a
 * lane, below 2^31). steps[r] bounds how far row r's rounded x lies from x in any element (0.51 of its unit: half a
 * unit plus the division's float32 rounding); the screen widens each token's bound by steps[r] times the L1 norm of
 * its int8 row (infer_screen_rows' `extra`). There, 1.10-1.17x less time a call at 1 row and 1.19-1.29x at 4 on
 * Qwen3's and Gemma 3's heads (benchmarks/head_screen.py). */
#if INFER_AVX512_VNNI
#define SCREEN_FLUSH 1024

/* sums[r][i] = xq[r] . (int8 row i of the block) for `count` rows of xq (int16, k each; 1 to PASS_ROWS, a constant
 * once inlined), the int32 sums of each SCREEN_FLUSH columns added in float32. */
static inline __attribute__((always_inline)) void screen_block_vnni(const int16_t *xq, int64_t k, const int8_t *block,
                                                                    float sums[PASS_ROWS][4], const int count) {
    __m512 total[PASS_ROWS];
    for (int r = 0; r < count; r++) total[r] = _mm512_setzero_ps();
    for (int64_t from = 0; from < k; from += SCREEN_FLUSH) {
        const int64_t to = from + SCREEN_FLUSH < k ? from + SCREEN_FLUSH : k;
        __m512i acc[PASS_ROWS];
        for (int r = 0; r < count; r++) acc[r] = _mm512_setzero_si512();
        for (int64_t c = from; c < to; c += 8) {
            const int8_t *chunk = block + c * 4;
            if (c % 16 == 0) gemv_prefetch((const char *)chunk);  /* once a 64-byte line */
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)chunk));
            for (int r = 0; r < count; r++) {
                const __m512i xv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq + r * k + c)));
                acc[r] = _mm512_dpwssd_epi32(acc[r], w, xv);
            }
        }
        for (int r = 0; r < count; r++) total[r] = _mm512_add_ps(total[r], _mm512_cvtepi32_ps(acc[r]));
    }
    for (int r = 0; r < count; r++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, total[r]);
        for (int i = 0; i < 4; i++)
            sums[r][i] = (lanes[4 * i] + lanes[4 * i + 1]) + (lanes[4 * i + 2] + lanes[4 * i + 3]);
    }
}

/* Row x (k floats) rounded to int16 in units of its largest magnitude / 32,767 into xq; returns the unit (0 for a
 * zero row, NaN for a row holding a NaN or an infinity). */
static float screen_round_row(const float *x, int64_t k, int16_t *xq) {
    float largest = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float magnitude = fabsf(x[i]);
        if (!(magnitude <= 3.4028234663852886e38f)) {
            memset(xq, 0, sizeof(int16_t) * k);
            return NAN;
        }
        largest = magnitude > largest ? magnitude : largest;
    }
    if (largest == 0.0f) {
        memset(xq, 0, sizeof(int16_t) * k);
        return 0.0f;
    }
    const float unit = largest / 32767.0f;
    for (int64_t i = 0; i < k; i++) {
        const float q = nearbyintf(x[i] / unit);
        xq[i] = (int16_t)(q > 32767.0f ? 32767.0f : q < -32767.0f ? -32767.0f : q);
    }
    return unit;
}
#endif

int64_t infer_screen_vnni(void) { return INFER_AVX512_VNNI; }

int64_t infer_screen_gemv(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *scales, float *y,
                          int64_t n_out, float *steps) {
#if INFER_AVX512_VNNI
    int16_t *xq = malloc(sizeof(int16_t) * rows * k);
    float *units = malloc(sizeof(float) * rows);
    if (!xq || !units) {
        free(xq);
        free(units);
        return 0;
    }
    for (int64_t r = 0; r < rows; r++) {
        units[r] = screen_round_row(x + r * k, k, xq + r * k);
        steps[r] = 0.51f * units[r];
    }
    const int64_t blocks = n_out / 4;
#pragma omp parallel for schedule(static) if (rows * n_out * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *block = w + b * 4 * k;
        for (int64_t m = 0; m < rows;) {
            const int count = pass_rows(rows - m);
            float sums[PASS_ROWS][4];
            switch (count) {  /* a constant count per copy: its accumulators stay in registers */
#define SCREEN_CASE(n) case n: screen_block_vnni(xq + m * k, k, block, sums, n); break;
                SCREEN_CASE(1) SCREEN_CASE(2) SCREEN_CASE(3) SCREEN_CASE(4)
                SCREEN_CASE(5) SCREEN_CASE(6) SCREEN_CASE(7) SCREEN_CASE(8)
#undef SCREEN_CASE
            }
            for (int r = 0; r < count; r++)
                for (int i = 0; i < 4; i++)
                    y[(m + r) * n_out + b * 4 + i] = sums[r][i] * units[m + r] * scales[b * 4 + i];
            m += count;
        }
    }
    free(xq);
    free(units);
    return 1;
#else
    (void)x, (void)rows, (void)k, (void)w, (void)scales, (void)y, (void)n_out, (void)steps;
    return 0;
#endif
}
