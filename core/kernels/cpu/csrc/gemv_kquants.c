/* Linear layers over GGUF's K-quant super-blocks kept as blocks: Q4_K and Q6_K, the two a Q4_K_M file mixes.
 * y [rows, n_out] = x [rows, k] . w^T (+ bias), k % 256 == 0, the rows of x quantized per 32 columns to int8 first
 * (as gemv_blocks.c's: dx = amax / 127, q = round(x / dx)), integer dot products, float32 sums. Per 32 rather than
 * per 256 as llama.cpp's Q8_K: the same instructions in this layout, half the product's error (docs/performance.md).
 *
 * A super-block is 256 consecutive weights of one row:
 *   Q4_K: 8 sub-blocks of 32, weight = d * sc[j] * q - dmin * m[j]; q 4-bit, sc and m 6-bit, d and dmin fp16
 *   Q6_K: 16 sub-blocks of 16, weight = d * sc[i] * (q - 32); q 6-bit, sc int8, d fp16
 *
 * x is multiplied transposed: per 256 columns, chunk t (columns 4t to 4t + 3) of block j (32 columns) sits at byte
 * 32t + 4j. The 64 bytes at 64u then hold, in 32-bit lane 8h + j, columns 32j + 8u + 4h + (0..3): every lane one
 * block of 32 columns (j) throughout, so a register of int32 dot products sums within sub-blocks and one vector of
 * per-lane scales applies them. The weights are stored in the same order, and as many bytes as the file's. Each
 * row's super-blocks in turn, one record each (infer.kernels.cpu.blocks.pack_blocks repacks them at load):
 *   Q4_K, 144 bytes: d, dmin (fp16), scales[12], quants[128]
 *   Q6_K, 210 bytes: d (fp16), sc[16] (int8: sub-blocks 0, 2, ..., 14, then 1, 3, ..., 15), quants[128], high[64]
 * Quant byte 64L + b (L = 0, 1; b < 64) holds in its low nibble the weight beside x's byte 64L + b and in its high
 * nibble the one beside x's byte 64(L + 2) + b: one 64-byte load, a mask and a shift give two steps' weights. Q6_K's
 * byte b of high[] holds, in bits 2u and 2u + 1, the weight's top two bits beside x's byte 64u + b. Q4_K's scales:
 * byte j (0-7) holds the low 4 bits of sc[j] and, above them, of m[j]; byte 8 + q (0-3) holds hi(q) and above it
 * hi(q + 4), hi(j) = sc[j] >> 4 | (m[j] >> 4) << 2.
 *
 * A record's dot product with a super-block of x, lanes l = 8h + j (both block j): Q4_K's is
 *   sum_l d sc[j] dx[j] dot_l - sum_j dmin m[j] dx[j] sum_j(q)
 * and Q6_K's lanes hold sub-block 2j over the first two 64-byte steps and 2j + 1 over the last two:
 *   sum_l d dx[j] (sc[2j] dot_l,first + sc[2j + 1] dot_l,last) - 32 sum_j d dx[j] (sc[2j] s_2j + sc[2j + 1] s_2j+1)
 * where s_i sums x's quants over sub-block i (16 columns: half a block): the quantizer stores dx times those.
 *
 * A mixed weight (KIND_K_MIXED: a fused projection whose parts the file stores as different K types) begins with
 * a 128-byte header of int64: the number of parts, then (kind, rows) for each; the parts' records follow in turn. */
#include "common.h"

#define SUPER 256
/* Rows of x one pass over a weight row takes: every accumulator in a register. */
#if INFER_AVX512
#define KQ_PASS_ROWS 8
#else
#define KQ_PASS_ROWS 4
#endif
/* Rows of x a sweep over the weights takes: their quants (64 x k bytes) stay in L2 (as gemv_blocks.c). */
#define KQ_ROW_TILE 64
#define MIXED_HEADER 128

static inline float record_half(const uint8_t *record, int at) {
    uint16_t bits;
    memcpy(&bits, record + at, 2);
    return half_to_float(bits);
}

/* The weight stream's software prefetch, as the other GEMVs' (into L1 1 KB ahead, into L2 6 KB ahead), a line at a
 * time over the record's bytes: a record spans 2.25 (Q4_K) or 3.3 (Q6_K) lines, and prefetching one line a record
 * left the others to the hardware's prefetchers (the 28 down projections of Qwen3-0.6B at one row, one thread: 4.6 ms
 * for Q4_K against 3.9 with every line). */
static inline __attribute__((always_inline)) void kquant_prefetch(const uint8_t *record, const int64_t size) {
    for (int64_t line = 0; line < size; line += 64) {
        __builtin_prefetch(record + 1024 + line, 0, 3);
        __builtin_prefetch(record + 6144 + line, 0, 2);
    }
}

/* ---- activations ------------------------------------------------------------------------------------------------ */

/* Row-major x [rows, k] into q [rows, k] (int8, transposed per 256 columns as the top of the file says), dx2 and
 * s [rows, k / 256, 16]: dx2 the 8 blocks' scales twice, s dx times the sum of q over each block's first 16
 * columns (lanes 0-7) and last 16 (lanes 8-15). */
static void quantize_kquant_activations(const float *x, int64_t rows, int64_t k, int8_t *q, float *dx2, float *s) {
    const int64_t supers = rows * (k / SUPER);
#pragma omp parallel for schedule(static) if (rows * k >= 65536)
    for (int64_t b = 0; b < supers; b++) {
        const float *in = x + b * SUPER;
        int8_t *out = q + b * SUPER;
        for (int j = 0; j < 8; j++) {
            const float *block = in + 32 * j;
            int8_t quants[32];
#if INFER_AVX512
            const __m512 lo = _mm512_loadu_ps(block), hi = _mm512_loadu_ps(block + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const __m512 scale = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));  /* rounds to nearest even */
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
            _mm_storeu_si128((__m128i *)quants, _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(quants + 16), _mm512_cvtepi32_epi8(qhi));
            const int first = _mm512_reduce_add_epi32(qlo), last = _mm512_reduce_add_epi32(qhi);
#else
            float amax = 0.0f;
            for (int c = 0; c < 32; c++) amax = fmaxf(amax, fabsf(block[c]));
            const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int first = 0, last = 0;
            for (int c = 0; c < 32; c++) {
                quants[c] = (int8_t)nearbyintf(block[c] * inverse);  /* to nearest even, as the vector conversions */
                if (c < 16)
                    first += quants[c];
                else
                    last += quants[c];
            }
#endif
            for (int t = 0; t < 8; t++) memcpy(out + 32 * t + 4 * j, quants + 4 * t, 4);
            const float dx = amax / 127.0f;
            dx2[b * 16 + j] = dx2[b * 16 + 8 + j] = dx;
            s[b * 16 + j] = dx * (float)first;
            s[b * 16 + 8 + j] = dx * (float)last;
        }
    }
}

/* ---- one weight row against `count` rows of x ------------------------------------------------------------------- */

/* Each row_dot_*: sums[r] = (row r of x) . (the weight row) for `count` rows of x (1 to KQ_PASS_ROWS, a constant once
 * inlined), over `supers` records of `kind` (also a constant). Row r's quants at xq + r * k, its dx2 and s at
 * + r * supers * 16. */

#if INFER_AVX512 && defined(__AVX512BW__)
/* acc + unsigned bytes u times signed bytes at x, summed by fours into 16 int32 lanes. */
static inline __m512i dot_u8s8_acc512(__m512i acc, __m512i u, const int8_t *x) {
    const __m512i signed_bytes = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, signed_bytes);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, signed_bytes), _mm512_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void row_dot_avx512(const uint8_t *row, int64_t supers,
                                                                 const int8_t *xq, const float *dx2, const float *s,
                                                                 int64_t k, float sums[KQ_PASS_ROWS],
                                                                 const int count, const int kind) {
    const int64_t size = kquant_record_bytes(kind);
    __m512 acc[KQ_PASS_ROWS];
    for (int r = 0; r < count; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < supers; b++) {
        const uint8_t *record = row + b * size, *quants = record + kquant_quants_at(kind);
        kquant_prefetch(record, size);
        /* per lane: the weights' scale over the first two steps and the last two, and what s is multiplied by */
        __m512 scale_first, scale_last, offset;
        if (kind == KIND_Q4_K) {
            uint64_t sc, m;
            q4k_scales(record + 4, &sc, &m);
            const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)m, (long long)sc)));
            uint32_t d_dmin;
            memcpy(&d_dmin, record, 4);
            const __m512 d = _mm512_permutexvar_ps(  /* d in lanes 0-7, dmin in 8-15 */
                _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                _mm512_cvtph_ps(_mm256_set1_epi32((int)d_dmin)));
            const __m512 scaled = _mm512_mul_ps(values, d);  /* d sc[0..7], dmin m[0..7] */
            scale_first = scale_last = _mm512_shuffle_f32x4(scaled, scaled, 0x44);
            offset = _mm512_shuffle_f32x4(scaled, scaled, 0xEE);
        } else {
            const __m512 scaled = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(record + 2)))),
                _mm512_set1_ps(record_half(record, 0)));  /* d sc[0, 2, ..., 14], d sc[1, 3, ..., 15] */
            scale_first = _mm512_shuffle_f32x4(scaled, scaled, 0x44);
            scale_last = _mm512_shuffle_f32x4(scaled, scaled, 0xEE);
            offset = _mm512_mul_ps(scaled, _mm512_set1_ps(32.0f));
        }
        const __m512i first = _mm512_loadu_si512(quants), second = _mm512_loadu_si512(quants + 64);
        const __m512i high = kind == KIND_Q6_K ? _mm512_loadu_si512(quants + 128) : _mm512_setzero_si512();
        __m512i dots[KQ_PASS_ROWS];
        for (int r = 0; r < count; r++) dots[r] = _mm512_setzero_si512();
        for (int u = 0; u < 4; u++) {
            const __m512i w = kquant_step_512(first, second, high, u, kind);
            for (int r = 0; r < count; r++) dots[r] = dot_u8s8_acc512(dots[r], w, xq + r * k + b * SUPER + 64 * u);
            if (kind == KIND_Q6_K && u == 1)  /* sub-blocks 2j done: scaled into the sums, 2j + 1 next */
                for (int r = 0; r < count; r++) {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]),
                                             _mm512_mul_ps(scale_first, _mm512_loadu_ps(dx2 + (r * supers + b) * 16)),
                                             acc[r]);
                    dots[r] = _mm512_setzero_si512();
                }
        }
        for (int r = 0; r < count; r++) {
            const float *at = dx2 + (r * supers + b) * 16;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(scale_last, _mm512_loadu_ps(at)),
                                     acc[r]);
            acc[r] = _mm512_fnmadd_ps(offset, _mm512_loadu_ps(s + (r * supers + b) * 16), acc[r]);
        }
    }
    for (int r = 0; r < count; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if INFER_AVX2
/* The int32 sums, by fours, of unsigned bytes times signed ones over two pairs (8 bytes a lane). Without VNNI the
 * 16-bit pair sums add before widening: 2 x 2 x 63 x 127 (Q6_K's largest) stays below 32768. */
static inline __m256i dot_pairs_256(__m256i u0, const int8_t *x0, __m256i u1, const int8_t *x1) {
    const __m256i s0 = _mm256_loadu_si256((const __m256i *)x0), s1 = _mm256_loadu_si256((const __m256i *)x1);
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
#endif
}

/* A ymm register the 8 lanes of one h (the top of the file), 8 float accumulators a row of x. */
static inline __attribute__((always_inline)) void row_dot_avx2(const uint8_t *row, int64_t supers, const int8_t *xq,
                                                               const float *dx2, const float *s, int64_t k,
                                                               float sums[KQ_PASS_ROWS], const int count,
                                                               const int kind) {
    const int64_t size = kquant_record_bytes(kind);
    __m256 acc[KQ_PASS_ROWS];
    for (int r = 0; r < count; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < supers; b++) {
        const uint8_t *record = row + b * size, *quants = record + kquant_quants_at(kind);
        kquant_prefetch(record, size);
        __m256 scale_first, scale_last, offset_first, offset_last;
        if (kind == KIND_Q4_K) {
            uint64_t sc, m;
            q4k_scales(record + 4, &sc, &m);
            scale_first = scale_last = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))),
                _mm256_set1_ps(record_half(record, 0)));
            offset_first = offset_last = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m))),
                _mm256_set1_ps(record_half(record, 2)));
        } else {
            const __m256 d = _mm256_set1_ps(record_half(record, 0));
            const __m128i sc = _mm_loadu_si128((const __m128i *)(record + 2));
            scale_first = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
            scale_last = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
            offset_first = _mm256_mul_ps(scale_first, _mm256_set1_ps(32.0f));
            offset_last = _mm256_mul_ps(scale_last, _mm256_set1_ps(32.0f));
        }
        __m256i dots[KQ_PASS_ROWS];
        for (int r = 0; r < count; r++) dots[r] = _mm256_setzero_si256();
        for (int u = 0; u < 4; u++) {
            const __m256i w[2] = {kquant_step_256(quants, u, 0, kind), kquant_step_256(quants, u, 1, kind)};
            for (int r = 0; r < count; r++) {
                const int8_t *x = xq + r * k + b * SUPER + 64 * u;
                dots[r] = _mm256_add_epi32(dots[r], dot_pairs_256(w[0], x, w[1], x + 32));
            }
            if (kind == KIND_Q6_K && u == 1)  /* sub-blocks 2j done: scaled into the sums, 2j + 1 next */
                for (int r = 0; r < count; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]),
                                             _mm256_mul_ps(scale_first, _mm256_loadu_ps(dx2 + (r * supers + b) * 16)),
                                             acc[r]);
                    dots[r] = _mm256_setzero_si256();
                }
        }
        for (int r = 0; r < count; r++) {
            const float *at = dx2 + (r * supers + b) * 16, *sum_at = s + (r * supers + b) * 16;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(scale_last, _mm256_loadu_ps(at)),
                                     acc[r]);
            acc[r] = _mm256_fnmadd_ps(offset_first, _mm256_loadu_ps(sum_at), acc[r]);
            acc[r] = _mm256_fnmadd_ps(offset_last, _mm256_loadu_ps(sum_at + 8), acc[r]);
        }
    }
    for (int r = 0; r < count; r++) sums[r] = hsum8(acc[r]);
}
#endif

/* The unsigned quant a record stores beside x's byte p (0-255) of its super-block. */
static inline int kquant_at(const uint8_t *quants, int p, const int kind) {
    const int u = p / 64, b = p % 64;
    const int low = (quants[64 * (u & 1) + b] >> (u < 2 ? 0 : 4)) & 0x0F;
    return kind == KIND_Q6_K ? low | ((quants[128 + b] >> (2 * u)) & 3) << 4 : low;
}

/* The same sums in plain C, lane by lane as the vector paths. */
static inline __attribute__((always_inline)) void row_dot_portable(const uint8_t *row, int64_t supers,
                                                                   const int8_t *xq, const float *dx2,
                                                                   const float *s, int64_t k,
                                                                   float sums[KQ_PASS_ROWS], const int count,
                                                                   const int kind) {
    const int64_t size = kquant_record_bytes(kind);
    for (int r = 0; r < count; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < supers; b++) {
            const uint8_t *record = row + b * size, *quants = record + kquant_quants_at(kind);
            const int8_t *x = xq + r * k + b * SUPER;
            const float *dx = dx2 + (r * supers + b) * 16, *sum = s + (r * supers + b) * 16;
            uint8_t sc[8], m[8];
            if (kind == KIND_Q4_K) {
                uint64_t sc_bytes, m_bytes;
                q4k_scales(record + 4, &sc_bytes, &m_bytes);
                memcpy(sc, &sc_bytes, 8);
                memcpy(m, &m_bytes, 8);
            }
            const float d = record_half(record, 0), dmin = kind == KIND_Q4_K ? record_half(record, 2) : 0.0f;
            for (int lane = 0; lane < 16; lane++) {
                const int j = lane % 8;
                int32_t first = 0, last = 0;
                for (int u = 0; u < 4; u++)
                    for (int c = 0; c < 4; c++) {
                        const int p = 64 * u + 4 * lane + c, product = kquant_at(quants, p, kind) * x[p];
                        if (u < 2)
                            first += product;
                        else
                            last += product;
                    }
                if (kind == KIND_Q4_K) {
                    total += (float)(first + last) * (d * (float)sc[j] * dx[lane]);
                    total -= dmin * (float)m[j] * sum[lane];
                } else {
                    const float sc_first = (float)(int8_t)record[2 + j], sc_last = (float)(int8_t)record[10 + j];
                    total += ((float)first * (d * sc_first) + (float)last * (d * sc_last)) * dx[lane];
                    total -= 32.0f * d * (lane < 8 ? sc_first : sc_last) * sum[lane];
                }
            }
        }
        sums[r] = total;
    }
}

static inline __attribute__((always_inline)) void row_dot(const uint8_t *row, int64_t supers, const int8_t *xq,
                                                          const float *dx2, const float *s, int64_t k,
                                                          float sums[KQ_PASS_ROWS], const int count, const int kind) {
#if INFER_AVX512 && defined(__AVX512BW__)
    row_dot_avx512(row, supers, xq, dx2, s, k, sums, count, kind);
#elif INFER_AVX2
    row_dot_avx2(row, supers, xq, dx2, s, k, sums, count, kind);
#else
    row_dot_portable(row, supers, xq, dx2, s, k, sums, count, kind);
#endif
}

/* row_dot for `count` rows (1 to KQ_PASS_ROWS) known only at run time: a copy per count, so that each keeps its
 * accumulators in registers. */
static inline __attribute__((always_inline)) void kquant_pass(const uint8_t *row, int64_t supers, const int8_t *xq,
                                                              const float *dx2, const float *s, int64_t k,
                                                              float sums[KQ_PASS_ROWS], const int count,
                                                              const int kind) {
    switch (count) {
#define ROW_DOT_CASE(c) \
        case c: row_dot(row, supers, xq, dx2, s, k, sums, c, kind); break;
        ROW_DOT_CASE(1)
        ROW_DOT_CASE(2)
        ROW_DOT_CASE(3)
        ROW_DOT_CASE(4)
#if KQ_PASS_ROWS > 4
        ROW_DOT_CASE(5)
        ROW_DOT_CASE(6)
        ROW_DOT_CASE(7)
        ROW_DOT_CASE(8)
#endif
#undef ROW_DOT_CASE
    }
}

/* ---- the linear layer ------------------------------------------------------------------------------------------- */

/* Weight rows [0, n_rows) of one kind into y's columns column0 + n (rows of y n_out wide): blocks of KQ_ROW_BLOCK
 * rows split across the threads; each block against every row of x in the tile in passes of KQ_PASS_ROWS, a pass
 * over all the block's rows at a time: the pass's activations stay in L1 while the rows go by, and the block's rows
 * (in L2) are read from memory once whatever the passes. (A pass of 8 rows of x of 3072 columns holds 36 KB; each
 * weight row taking every pass in turn had them stream from L2: 8 x (1024 x 3072) at 64 rows, one thread, 46.8 ms
 * against 19.2 in blocks of 16, 6.6 against 4.9 at 16 rows.) */
#define KQ_ROW_BLOCK 16

static inline __attribute__((always_inline)) void linear_kquant_rows(const int8_t *xq, const float *dx2,
                                                                     const float *s, int64_t rows, int64_t k,
                                                                     const uint8_t *w, int64_t n_rows,
                                                                     const float *bias, float *y, int64_t column0,
                                                                     int64_t n_out, const int kind) {
    const int64_t supers = k / SUPER, row_bytes = supers * kquant_record_bytes(kind);
    for (int64_t first = 0; first < rows; first += KQ_ROW_TILE) {
        const int64_t last = first + KQ_ROW_TILE < rows ? first + KQ_ROW_TILE : rows;
#pragma omp parallel for schedule(static) if ((last - first) * n_rows * k >= 65536)
        for (int64_t block = 0; block < n_rows; block += KQ_ROW_BLOCK) {
            const int64_t block_end = block + KQ_ROW_BLOCK < n_rows ? block + KQ_ROW_BLOCK : n_rows;
            for (int64_t m = first; m < last;) {
                const int64_t left = last - m;
                const int count = left >= KQ_PASS_ROWS ? KQ_PASS_ROWS : (int)left;
                const int8_t *x_at = xq + m * k;
                const float *dx_at = dx2 + m * supers * 16, *s_at = s + m * supers * 16;
                for (int64_t n = block; n < block_end; n++) {
                    float sums[KQ_PASS_ROWS];
                    kquant_pass(w + n * row_bytes, supers, x_at, dx_at, s_at, k, sums, count, kind);
                    const float add = bias ? bias[column0 + n] : 0.0f;
                    for (int r = 0; r < count; r++) y[(m + r) * n_out + column0 + n] = sums[r] + add;
                }
                m += count;
            }
        }
    }
}

INFER_HIDDEN void linear_kquants(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind,
                                 const float *bias, float *y, int64_t n_out) {
    const int64_t supers = rows * (k / SUPER);
    int8_t *xq = aligned_alloc(64, (rows * k + 63) / 64 * 64);
    float *dx2 = aligned_alloc(64, supers * 16 * sizeof(float)), *s = aligned_alloc(64, supers * 16 * sizeof(float));
    quantize_kquant_activations(x, rows, k, xq, dx2, s);
    /* one part of n_out rows, or a mixed weight's parts in turn; the kind a constant in each copy */
    const int64_t *header = (const int64_t *)w;
    const int64_t parts = kind == KIND_K_MIXED ? header[0] : 1;
    const uint8_t *data = kind == KIND_K_MIXED ? w + MIXED_HEADER : w;
    for (int64_t part = 0, column0 = 0; part < parts; part++) {
        const int64_t part_kind = kind == KIND_K_MIXED ? header[1 + 2 * part] : kind;
        const int64_t part_rows = kind == KIND_K_MIXED ? header[2 + 2 * part] : n_out;
        if (part_kind == KIND_Q4_K)
            linear_kquant_rows(xq, dx2, s, rows, k, data, part_rows, bias, y, column0, n_out, KIND_Q4_K);
        else
            linear_kquant_rows(xq, dx2, s, rows, k, data, part_rows, bias, y, column0, n_out, KIND_Q6_K);
        data += part_rows * (k / SUPER) * kquant_record_bytes(part_kind);
        column0 += part_rows;
    }
    free(s);
    free(dx2);
    free(xq);
}

/* ---- for kernels that split a weight's rows over their threads themselves (moe.c) ----------------------------- */

int64_t kquant_group_bytes(int64_t k, int64_t kind) { return 4 * (k / SUPER) * kquant_record_bytes(kind); }

void kquant_quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *q, float *dx2, float *s) {
    quantize_kquant_activations(x, rows, k, q, dx2, s);
}

/* The kind as a constant in each copy, as linear_kquants: the four weight rows of `group` in turn against every
 * pass of rows of x. */
static void kquant_group_rows(const uint8_t *group, int64_t k, const int8_t *xq, const float *dx2, const float *s,
                              int64_t rows, float *sums, const int kind) {
    const int64_t supers = k / SUPER, row_bytes = supers * kquant_record_bytes(kind);
    for (int64_t m = 0; m < rows; m += KQ_PASS_ROWS) {
        const int count = rows - m >= KQ_PASS_ROWS ? KQ_PASS_ROWS : (int)(rows - m);
        for (int i = 0; i < 4; i++) {
            float row_sums[KQ_PASS_ROWS];
            kquant_pass(group + i * row_bytes, supers, xq + m * k, dx2 + m * supers * 16, s + m * supers * 16, k,
                        row_sums, count, kind);
            for (int r = 0; r < count; r++) sums[(m + r) * 4 + i] = row_sums[r];
        }
    }
}

void kquant_group_sums(const uint8_t *group, int64_t k, const int8_t *xq, const float *dx2, const float *s,
                       int64_t rows, int64_t kind, float *sums) {
    if (kind == KIND_Q4_K)
        kquant_group_rows(group, k, xq, dx2, s, rows, sums, KIND_Q4_K);
    else
        kquant_group_rows(group, k, xq, dx2, s, rows, sums, KIND_Q6_K);
}
