/* Linear layers over GGUF's block-quantized weights (Q4_0, Q4_1, Q8_0, MXFP4) kept as blocks: y [rows, n_out] =
 * x [rows, k] . w^T (+ bias), the rows of x quantized per 32 columns to int8 first, integer dot products per block,
 * float32 sums across blocks (llama.cpp's arithmetic).
 *
 * Weight layout (infer.kernels.cpu.blocks.pack_blocks repacks a GGUF tensor's blocks into it at load): the output
 * rows in groups of four (the last group padded with zero rows), each group one sequential stream of records, one
 * record per 32 columns of k:
 *   Q4_0: d[4] (fp16), q[64]                72 bytes    weight = (nibble - 8) * d
 *   Q4_1: d[4], m[4] (fp16), q[64]          80 bytes    weight = nibble * d + m
 *   Q8_0: d[4] (fp16), q[4][32] (uint8)     136 bytes   weight = (q - 128) * d
 *   MXFP4: e[4] (uint8), q[64]              68 bytes    weight = FP4[nibble] * 2^(e - 127)
 * d[i] and m[i] belong to row i of the group, beside the quants they scale. MXFP4 (OCP microscaling, gpt-oss's
 * experts) stores a power of two e (E8M0, biased by 127) and e2m1 codes: FP4 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
 * negatives by the code's top bit. The kernels read a code as the integer 2 FP4 + 12 (0 to 24, unsigned as the Q4
 * quants) with d = 2^(e - 128): weight = (u - 12) * d, exact. (e = 0 and 1 give subnormal scales, of weights below
 * 2^-123.) A Q4 record's 64 bytes hold the group's
 * 4 x 32 nibbles so that one 64-byte load, a mask and a shift give rows 0-1 and rows 2-3 whole: byte j (0-31) holds
 * column j of row 0 in its low nibble and of row 2 in its high one; byte 32 + j, of rows 1 and 3. (GGUF's own Q4
 * block holds columns j and 16 + j of one row in byte j.) Q8_0's int8 quants are stored plus 128, unsigned as the
 * Q4 ones, so VNNI multiplies them as they are.
 *
 * Activations: each row of x, per 32 columns, as llama.cpp's Q8_1 blocks: dx = amax / 127, q = round(x / dx) (to
 * nearest even), s = dx * sum(q). A record's dot product with a block of x is then
 *   d * dx * sum(q_w * q_x) + c * s,   c = -8 d (Q4_0), m (Q4_1), -128 d (Q8_0), -12 d (MXFP4)
 * with unsigned quants times signed activations summed in int32: AVX-512 VNNI's vpdpbusd, AVX-VNNI's on AVX2
 * registers, else vpmaddubsw and vpmaddwd, or plain C. vpmaddubsw's 16-bit pair sums would saturate on Q8_0's
 * unsigned quants (2 x 255 x 127), so without VNNI Q8_0 multiplies its signed quants instead (|q_w| times q_x
 * carrying q_w's sign, as llama.cpp), c = 0. */
#include "common.h"

#define BLOCK 32
/* Rows of x one pass over a group of weights takes: every accumulator in a register (AVX2: one per row of x, its 4
 * weight rows' halves side by side). */
#if INFER_AVX512
#define BLOCK_PASS_ROWS 8
#else
#define BLOCK_PASS_ROWS 4
#endif

/* Whether this build's vector path multiplies Q8_0's quants signed (no VNNI: see the top of the file). */
#if (INFER_AVX512 && defined(__AVX512BW__) && !defined(__AVX512VNNI__)) || \
    (INFER_AVX2 && INFER_F16C && !(INFER_AVX512 && defined(__AVX512BW__)) && !defined(__AVXVNNI__))
#define Q8_SIGNED 1
#else
#define Q8_SIGNED 0
#endif

/* The weight stream's software prefetch, as the float GEMV's (gemv.c): into L1 1 KB ahead, into L2 6 KB ahead. */
static inline __attribute__((always_inline)) void blocks_prefetch(const uint8_t *record) {
    __builtin_prefetch(record + 1024, 0, 3);
    __builtin_prefetch(record + 6144, 0, 2);
}

/* ---- activations ------------------------------------------------------------------------------------------------ */

/* Row-major x [rows, k] into q [rows, k] (int8), dx and s [rows, k / 32] (see the top of the file). */
static void quantize_activations(const float *x, int64_t rows, int64_t k, int8_t *q, float *dx, float *s) {
    const int64_t blocks = rows * (k / BLOCK);
    for (int64_t b = 0; b < blocks; b++) {
        const float *in = x + b * BLOCK;
        int8_t *out = q + b * BLOCK;
#if INFER_AVX512
        const __m512 lo = _mm512_loadu_ps(in), hi = _mm512_loadu_ps(in + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 scale = _mm512_set1_ps(inverse);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));  /* rounds to nearest even */
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(qhi));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(in[j]));
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            out[j] = (int8_t)nearbyintf(in[j] * inverse);  /* to nearest even, as the vector conversions */
            sum += out[j];
        }
#endif
        dx[b] = amax / 127.0f;
        s[b] = dx[b] * (float)sum;
    }
}

/* ---- one group of four weight rows against `count` rows of x ---------------------------------------------------- */

/* Each group_dot_*: sums[r][i] = (row r of x) . (weight row i of the group) for `count` rows of x (1 to
 * BLOCK_PASS_ROWS, a constant once inlined), over `blocks` records of kind `kind` (also a constant). The activations
 * of row r: q at xq + r * k, its scales at dx + r * blocks, s likewise. */

/* A record's correction per weight row (c in the top comment), as 4 floats from its scales `d`. */
#if INFER_AVX2 && INFER_F16C
static inline __m128 record_offsets(const uint8_t *record, __m128 d, const int kind) {
    if (kind == KIND_Q4_1) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(record + 8)));
    if (kind == KIND_Q4_0) return _mm_mul_ps(d, _mm_set1_ps(-8.0f));
    if (kind == KIND_MXFP4) return _mm_mul_ps(d, _mm_set1_ps(-MXFP4_OFFSET));
    return Q8_SIGNED ? _mm_setzero_ps() : _mm_mul_ps(d, _mm_set1_ps(-128.0f));
}

/* A record's four scales d: fp16, or MXFP4's 2^(e - 128), made as the float bits e << 23 (2^(e - 127); e = 0 as the
 * subnormal 2^-127's bits) halved. */
static inline __m128 record_scales(const uint8_t *record, const int kind) {
    if (kind != KIND_MXFP4) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)record));
    int32_t exponents;
    memcpy(&exponents, record, sizeof exponents);
    const __m128i bits = _mm_slli_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(exponents)), 23);
    return _mm_mul_ps(_mm_castsi128_ps(_mm_max_epi32(bits, _mm_set1_epi32(0x00400000))), _mm_set1_ps(0.5f));
}
#endif

#if INFER_AVX512 && defined(__AVX512BW__)
/* Unsigned bytes times signed bytes, summed by fours into 16 int32 lanes. */
static inline __m512i dot_u8s8_512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* A zmm register a pair of weight rows (row 0 and 1, row 2 and 3; 32 bytes each), its two halves' int32 sums
 * converted and scaled per block into 2 float accumulators a row of x. */
static inline __attribute__((always_inline)) void group_dot_avx512(const uint8_t *group, int64_t blocks,
                                                                   const int8_t *xq, const float *dx, const float *s,
                                                                   int64_t k, float sums[BLOCK_PASS_ROWS][4],
                                                                   const int count, const int kind) {
    const int64_t size = record_bytes(kind);
    const __m512i first_pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second_pair = _mm512_add_epi32(first_pair, _mm512_set1_epi32(2));
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i mxfp4_table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)mxfp4_quants()));
    __m512 acc[BLOCK_PASS_ROWS][2];
    __m128 offsets[BLOCK_PASS_ROWS];
    for (int r = 0; r < count; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        offsets[r] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = group + b * size, *quants = record + quants_at(kind);
        blocks_prefetch(record);
        const __m128 d = record_scales(record, kind);
        const __m128 c = record_offsets(record, d, kind);
        const __m512 d01 = _mm512_permutexvar_ps(first_pair, _mm512_castps128_ps512(d));
        const __m512 d23 = _mm512_permutexvar_ps(second_pair, _mm512_castps128_ps512(d));
        __m512i w01, w23;
        __mmask64 negative01 = 0, negative23 = 0;
        if (kind == KIND_Q8_0) {
            w01 = _mm512_loadu_si512(quants);
            w23 = _mm512_loadu_si512(quants + 64);
            if (Q8_SIGNED) {  /* back to signed, then |q_w| and its signs */
                w01 = _mm512_xor_si512(w01, _mm512_set1_epi8((char)0x80));
                w23 = _mm512_xor_si512(w23, _mm512_set1_epi8((char)0x80));
                negative01 = _mm512_movepi8_mask(w01);
                negative23 = _mm512_movepi8_mask(w23);
                w01 = _mm512_abs_epi8(w01);
                w23 = _mm512_abs_epi8(w23);
            }
        } else {
            const __m512i packed = _mm512_loadu_si512(quants);
            w01 = _mm512_and_si512(packed, nibble);
            w23 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            if (kind == KIND_MXFP4) {  /* codes to quants, a table lookup per byte */
                w01 = _mm512_shuffle_epi8(mxfp4_table, w01);
                w23 = _mm512_shuffle_epi8(mxfp4_table, w23);
            }
        }
        for (int r = 0; r < count; r++) {
            const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + r * k + b * BLOCK)));
            __m512i x01 = x, x23 = x;
            if (kind == KIND_Q8_0 && Q8_SIGNED) {  /* the weights' signs onto x */
                x01 = _mm512_mask_sub_epi8(x, negative01, _mm512_setzero_si512(), x);
                x23 = _mm512_mask_sub_epi8(x, negative23, _mm512_setzero_si512(), x);
            }
            const __m512 scale = _mm512_set1_ps(dx[r * blocks + b]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8_512(w01, x01)), _mm512_mul_ps(d01, scale),
                                        acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8_512(w23, x23)), _mm512_mul_ps(d23, scale),
                                        acc[r][1]);
            if (kind != KIND_Q8_0 || !Q8_SIGNED)
                offsets[r] = _mm_fmadd_ps(c, _mm_set1_ps(s[r * blocks + b]), offsets[r]);
        }
    }
    for (int r = 0; r < count; r++) {
        float offset[4];
        _mm_storeu_ps(offset, offsets[r]);
        hsum8_pair(acc[r][0], &sums[r][0], &sums[r][1]);
        hsum8_pair(acc[r][1], &sums[r][2], &sums[r][3]);
        for (int i = 0; i < 4; i++) sums[r][i] += offset[i];
    }
}
#endif

#if INFER_AVX2 && INFER_F16C
/* Unsigned bytes times signed bytes, summed by fours into 8 int32 lanes. */
static inline __m256i dot_u8s8_256(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* A ymm register a weight row; each block's four rows' int32 sums folded by pairwise adds into one register
 * [row 0-3 of the low 128 bits, row 0-3 of the high], scaled and summed into one float accumulator a row of x. */
static inline __attribute__((always_inline)) void group_dot_avx2(const uint8_t *group, int64_t blocks,
                                                                 const int8_t *xq, const float *dx, const float *s,
                                                                 int64_t k, float sums[BLOCK_PASS_ROWS][4],
                                                                 const int count, const int kind) {
    const int64_t size = record_bytes(kind);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i mxfp4_table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mxfp4_quants()));
    __m256 acc[BLOCK_PASS_ROWS];
    __m128 offsets[BLOCK_PASS_ROWS];
    for (int r = 0; r < count; r++) {
        acc[r] = _mm256_setzero_ps();
        offsets[r] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *record = group + b * size, *quants = record + quants_at(kind);
        blocks_prefetch(record);
        const __m128 d = record_scales(record, kind);
        const __m128 c = record_offsets(record, d, kind);
        const __m256 d8 = _mm256_set_m128(d, d);
        __m256i w[4];
        if (kind == KIND_Q8_0) {
            for (int i = 0; i < 4; i++) {
                w[i] = _mm256_loadu_si256((const __m256i *)(quants + 32 * i));
                if (Q8_SIGNED) w[i] = _mm256_xor_si256(w[i], _mm256_set1_epi8((char)0x80));  /* back to signed */
            }
        } else {
            const __m256i rows02 = _mm256_loadu_si256((const __m256i *)quants);
            const __m256i rows13 = _mm256_loadu_si256((const __m256i *)(quants + 32));
            w[0] = _mm256_and_si256(rows02, nibble);
            w[1] = _mm256_and_si256(rows13, nibble);
            w[2] = _mm256_and_si256(_mm256_srli_epi16(rows02, 4), nibble);
            w[3] = _mm256_and_si256(_mm256_srli_epi16(rows13, 4), nibble);
            if (kind == KIND_MXFP4)  /* codes to quants, a table lookup per byte */
                for (int i = 0; i < 4; i++) w[i] = _mm256_shuffle_epi8(mxfp4_table, w[i]);
        }
        for (int r = 0; r < count; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * BLOCK));
            __m256i dots[4];
            for (int i = 0; i < 4; i++)
                dots[i] = kind == KIND_Q8_0 && Q8_SIGNED
                              ? dot_u8s8_256(_mm256_sign_epi8(w[i], w[i]), _mm256_sign_epi8(x, w[i]))
                              : dot_u8s8_256(w[i], x);
            const __m256i folded = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]),
                                                     _mm256_hadd_epi32(dots[2], dots[3]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), _mm256_mul_ps(d8, _mm256_set1_ps(dx[r * blocks + b])),
                                     acc[r]);
            if (kind != KIND_Q8_0 || !Q8_SIGNED)
                offsets[r] = _mm_fmadd_ps(c, _mm_set1_ps(s[r * blocks + b]), offsets[r]);
        }
    }
    for (int r = 0; r < count; r++) {
        const __m128 total = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)),
                                        offsets[r]);
        _mm_storeu_ps(sums[r], total);
    }
}
#endif

/* Weight row i's quant at column j of a record, the unsigned integer it stores. */
static inline int record_quant(const uint8_t *quants, int i, int j, const int kind) {
    if (kind == KIND_Q8_0) return quants[i * 32 + j];
    const uint8_t byte = quants[(i & 1) * 32 + j];
    const int code = i < 2 ? byte & 0x0F : byte >> 4;
    return kind == KIND_MXFP4 ? mxfp4_quants()[code] : code;
}

/* The same sums in plain C. */
static inline __attribute__((always_inline)) void group_dot_portable(const uint8_t *group, int64_t blocks,
                                                                     const int8_t *xq, const float *dx,
                                                                     const float *s, int64_t k,
                                                                     float sums[BLOCK_PASS_ROWS][4], const int count,
                                                                     const int kind) {
    const int64_t size = record_bytes(kind);
    for (int r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) {
            float total = 0.0f, offset = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *record = group + b * size, *quants = record + quants_at(kind);
                const float d =
                    kind == KIND_MXFP4 ? mxfp4_scale(record, i) : half_to_float(((const uint16_t *)record)[i]);
                int32_t dot = 0;
                for (int j = 0; j < BLOCK; j++) dot += record_quant(quants, i, j, kind) * xq[r * k + b * BLOCK + j];
                total += (float)dot * (d * dx[r * blocks + b]);
                const float c = kind == KIND_Q4_1    ? half_to_float(((const uint16_t *)record)[4 + i])
                                : kind == KIND_Q4_0  ? -8.0f * d
                                : kind == KIND_MXFP4 ? -MXFP4_OFFSET * d
                                                     : -128.0f * d;
                offset += c * s[r * blocks + b];
            }
            sums[r][i] = total + offset;
        }
}

static inline __attribute__((always_inline)) void group_dot(const uint8_t *group, int64_t blocks, const int8_t *xq,
                                                            const float *dx, const float *s, int64_t k,
                                                            float sums[BLOCK_PASS_ROWS][4], const int count,
                                                            const int kind) {
#if INFER_AVX512 && defined(__AVX512BW__)
    group_dot_avx512(group, blocks, xq, dx, s, k, sums, count, kind);
#elif INFER_AVX2 && INFER_F16C
    group_dot_avx2(group, blocks, xq, dx, s, k, sums, count, kind);
#else
    group_dot_portable(group, blocks, xq, dx, s, k, sums, count, kind);
#endif
}

/* group_dot for `count` rows (1 to BLOCK_PASS_ROWS) known only at run time: a copy per count, so that each keeps its
 * accumulators in registers. */
static inline __attribute__((always_inline)) void group_pass(const uint8_t *group, int64_t blocks, const int8_t *xq,
                                                             const float *dx, const float *s, int64_t k,
                                                             float sums[BLOCK_PASS_ROWS][4], const int count,
                                                             const int kind) {
    switch (count) {
#define GROUP_DOT_CASE(n) \
        case n: group_dot(group, blocks, xq, dx, s, k, sums, n, kind); break;
        GROUP_DOT_CASE(1)
        GROUP_DOT_CASE(2)
        GROUP_DOT_CASE(3)
        GROUP_DOT_CASE(4)
#if BLOCK_PASS_ROWS > 4
        GROUP_DOT_CASE(5)
        GROUP_DOT_CASE(6)
        GROUP_DOT_CASE(7)
        GROUP_DOT_CASE(8)
#endif
#undef GROUP_DOT_CASE
    }
}

/* ---- the linear layer ------------------------------------------------------------------------------------------- */

/* Rows of x one sweep over the weights takes: their int8 copy (at most 64 x k bytes) stays in L2 while every group
 * passes over it. A sweep over all rows at once had each group stream them from farther (512 rows of the 135M
 * model's four projections: 51.5 ms a layer, against fbgemm's fp16 GEMM's 31.3). */
#define ROW_TILE 64

/* Over the groups, split across the threads; for each, every row of x in the tile in passes of BLOCK_PASS_ROWS
 * while the group's records are in L1 (so a decode step's few rows read the weights from memory once). */
static inline __attribute__((always_inline)) void linear_blocks(const int8_t *xq, const float *dx, const float *s,
                                                                int64_t rows, int64_t k, const uint8_t *w,
                                                                const float *bias, float *y, int64_t n_out,
                                                                const int kind) {
    const int64_t blocks = k / BLOCK, groups = (n_out + 3) / 4, group_bytes = blocks * record_bytes(kind);
    for (int64_t first = 0; first < rows; first += ROW_TILE) {
        const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;
#pragma omp parallel for schedule(static) if ((last - first) * n_out * k >= 65536)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *group = w + g * group_bytes;
            for (int64_t m = first; m < last;) {
                const int64_t left = last - m;
                const int count = left >= BLOCK_PASS_ROWS ? BLOCK_PASS_ROWS : (int)left;
                float sums[BLOCK_PASS_ROWS][4];
                group_pass(group, blocks, xq + m * k, dx + m * blocks, s + m * blocks, k, sums, count, kind);
                for (int r = 0; r < count; r++)
                    for (int i = 0; i < 4 && g * 4 + i < n_out; i++) {
                        const int64_t n = g * 4 + i;
                        y[(m + r) * n_out + n] = sums[r][i] + (bias ? bias[n] : 0.0f);
                    }
                m += count;
            }
        }
    }
}

void infer_linear_blocks(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind, const float *bias,
                         float *y, int64_t n_out) {
    if (kind == KIND_Q4_K || kind == KIND_Q6_K || kind == KIND_K_MIXED) {  /* super-blocks of 256 */
        linear_kquants(x, rows, k, w, kind, bias, y, n_out);
        return;
    }
    const int64_t blocks = rows * (k / BLOCK);
    int8_t *xq = malloc(rows * k);
    float *dx = malloc(sizeof(float) * blocks), *s = malloc(sizeof(float) * blocks);
    quantize_activations(x, rows, k, xq, dx, s);
    /* the kind as a constant in each copy: tested around every record otherwise */
    if (kind == KIND_Q4_0)
        linear_blocks(xq, dx, s, rows, k, w, bias, y, n_out, KIND_Q4_0);
    else if (kind == KIND_Q4_1)
        linear_blocks(xq, dx, s, rows, k, w, bias, y, n_out, KIND_Q4_1);
    else if (kind == KIND_MXFP4)
        linear_blocks(xq, dx, s, rows, k, w, bias, y, n_out, KIND_MXFP4);
    else
        linear_blocks(xq, dx, s, rows, k, w, bias, y, n_out, KIND_Q8_0);
    free(s);
    free(dx);
    free(xq);
}

int64_t infer_block_pass_rows(void) { return BLOCK_PASS_ROWS; }

/* ---- for kernels that split a weight's groups over their threads themselves (moe.c) ----------------------------- */

static inline int super_blocks(int64_t kind) { return kind == KIND_Q4_K || kind == KIND_Q6_K; }

int64_t block_group_bytes(int64_t k, int64_t kind) {
    return super_blocks(kind) ? kquant_group_bytes(k, kind) : k / BLOCK * record_bytes((int)kind);
}

int64_t block_row_scales(int64_t k, int64_t kind) { return super_blocks(kind) ? k / 16 : k / BLOCK; }

void block_quantize_rows(const float *x, int64_t rows, int64_t k, int64_t kind, int8_t *q, float *dx, float *s) {
    if (super_blocks(kind))
        kquant_quantize_rows(x, rows, k, q, dx, s);
    else
        quantize_activations(x, rows, k, q, dx, s);
}

/* The kind as a constant in each copy, as infer_linear_blocks. */
static void group_rows(const uint8_t *group, int64_t k, const int8_t *xq, const float *dx, const float *s,
                       int64_t rows, float *sums, const int kind) {
    const int64_t blocks = k / BLOCK;
    for (int64_t m = 0; m < rows; m += BLOCK_PASS_ROWS) {
        const int count = rows - m >= BLOCK_PASS_ROWS ? BLOCK_PASS_ROWS : (int)(rows - m);
        group_pass(group, blocks, xq + m * k, dx + m * blocks, s + m * blocks, k, (float (*)[4])(sums + m * 4),
                   count, kind);
    }
}

void block_group_sums(const uint8_t *group, int64_t k, const int8_t *xq, const float *dx, const float *s,
                      int64_t rows, int64_t kind, float *sums) {
    if (super_blocks(kind))
        kquant_group_sums(group, k, xq, dx, s, rows, kind, sums);
    else if (kind == KIND_Q4_0)
        group_rows(group, k, xq, dx, s, rows, sums, KIND_Q4_0);
    else if (kind == KIND_Q4_1)
        group_rows(group, k, xq, dx, s, rows, sums, KIND_Q4_1);
    else if (kind == KIND_MXFP4)
        group_rows(group, k, xq, dx, s, rows, sums, KIND_MXFP4);
    else
        group_rows(group, k, xq, dx, s, rows, sums, KIND_Q8_0);
}
