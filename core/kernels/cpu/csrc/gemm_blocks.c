/* The GEMM over GGUF's block weights (Q4_0, Q4_1, Q8_0, laid out as gemv_blocks.c describes; Q4_K, Q6_K and mixed
 * K-quant weights, as gemv_kquants.c describes) for steps of many rows: prefill chunks and large decode batches, where
 * the block GEMV (infer_linear_blocks), which keeps a few rows of x in registers against each group of four weight
 * rows and sums each product across a register, runs out of rows.
 * Two designs, both here so that each CPU class takes the one measured faster (docs/performance.md):
 *
 * - int8 dot products (BLOCK_GEMM_INT8): x quantized per 32 columns to int8 as the GEMV quantizes it (the same
 *   values), laid out so that one register holds LANES rows of x times 4 columns; a weight row's 4 quants are
 *   broadcast against it, so every lane of every dot product is a distinct output (no horizontal sums). Per block
 *   of 32 columns the int32 sums are scaled by d * dx into float32 ones and the offset c * s added, as in the GEMV.
 *   AVX-512 VNNI's vpdpbusd, AVX-VNNI's on AVX2 registers, else vpmaddubsw and vpmaddwd (Q8_0 then multiplies its
 *   signed quants, as the GEMV does); plain C builds run the GEMV itself, the same arithmetic.
 * - AMX bf16 tiles over dequantized panels (BLOCK_GEMM_AMX_BF16): each thread dequantizes a panel of 32 weight rows
 *   (all of k) into bf16 tiles, 16 weight rows each, the rows as AMX's A operand takes them, and multiplies every
 *   row of x (rounded to bf16, laid out as B tiles once per call) over it with TDPBF16PS; results come out per
 *   weight row and are transposed into y. While the tiles multiply one panel, the vector units dequantize the
 *   thread's next one (gemm_amx). The weights are rounded to bf16 (a Q4 weight's 15 significant bits to 8) and so
 *   is x: the precision of a bf16 model, where the int8 design keeps the GEMV's. Weights are dequantized in the
 *   order that costs least, and x's B tiles take its columns in the same order (the sums over k are the same, and
 *   neither side is shuffled per weight): K-quant rows their super-blocks' in their records' order (d sc q - dmin m,
 *   or d sc (q - 32)); Q4 rows each block's even columns, then its odd ones, which a record's nibbles give as
 *   16-bit indices in place.
 *
 * The int8 design reads K-quant weights too: a group's four rows' quants unpacked into the layout of the 32-block
 * kinds (each block of 32 columns in order: a record holds them transposed) with a scale and an offset per block and
 * row, Q4_K's d sc[j] and -dmin m[j] (its blocks are its sub-blocks), Q6_K's d sc of each half of the block (its
 * sub-blocks of 16: the int32 sums scaled per half, the offsets -32 d sc taken over each half's sum of x, sf). The
 * K-quant GEMV unpacks a weight row again for every pass of rows of x; this design unpacks a group once for every
 * tile of a chunk. By default steps of up to KQUANT_GEMV_ROWS rows (common.h) keep the GEMV, and where AMX runs, steps
 * past them take its tiles (at 64 rows AMX's panels took 0.29-0.48x the GEMV's time; docs/performance.md).
 *
 * Rows of x go in chunks that stay in L2 while every panel or group of weights passes over them. */
#include "common.h"

#define BLOCK 32

enum { BLOCK_GEMM_PORTABLE = 0, BLOCK_GEMM_INT8 = 1, BLOCK_GEMM_AMX_BF16 = 2 };

/* Rows from which the default takes AMX's tiles over the int8 dot products where both run. Q8_0's panels (each row
 * widened and converted, dequantize_record) pay back only over more than one tile of 16 rows: at 9-16 rows the int8
 * design took 0.84-1.01x AMX's time on the projections of docs/performance.md. Q4 records, looked up through their
 * nibbles in place, pay back from the first row past the GEMV's pass (8 rows on AVX-512): at 9-16 rows AMX took
 * 0.70-0.97x the int8 design's time there. */
#define AMX_MIN_ROWS 17
#define AMX_MIN_ROWS_Q4 9

/* Bytes of x (in the layout a design reads) one chunk of rows may take: it stays in L2 beside a panel of weights. */
#define CHUNK_BYTES (1 << 20)

/* A record's scales d and offsets c (weight row i's dot product with a block of x is d[i] dx sum(q_w q_x) + c[i] s;
 * gemv_blocks.c's top comment), as floats. `q8_signed`: Q8_0's quants multiplied signed, c = 0. */
static inline void record_scales(const uint8_t *record, int kind, int q8_signed, float d[4], float c[4]) {
    const uint16_t *halves = (const uint16_t *)record;
    for (int i = 0; i < 4; i++) {
        d[i] = kind == KIND_MXFP4 ? mxfp4_scale(record, i) : half_to_float(halves[i]);
        c[i] = kind == KIND_Q4_1 ? half_to_float(halves[4 + i])
               : kind == KIND_Q4_0 ? -8.0f * d[i]
               : kind == KIND_MXFP4 ? -MXFP4_OFFSET * d[i]
               : q8_signed ? 0.0f : -128.0f * d[i];
    }
}

/* A K-quant weight (gemv_kquants.c) as parts of one kind each: KIND_Q4_K or KIND_Q6_K alone, or a KIND_K_MIXED
 * weight's header's parts (at most 7 fit its 128 bytes), each part's rows `ends[p - 1]` to `ends[p]`. */
typedef struct {
    int64_t count, kinds[7], ends[7];
    const uint8_t *data[7];
} kquant_parts;

static inline kquant_parts read_kquant_parts(const uint8_t *w, int64_t kind, int64_t n_out, int64_t k) {
    kquant_parts parts = {.count = 1, .kinds = {kind}, .ends = {n_out}, .data = {w}};
    if (kind != KIND_K_MIXED) return parts;
    const int64_t *header = (const int64_t *)w;
    const uint8_t *data = w + 128;
    parts.count = header[0];
    for (int64_t p = 0, end = 0; p < parts.count; p++) {
        parts.kinds[p] = header[1 + 2 * p];
        parts.ends[p] = end += header[2 + 2 * p];
        parts.data[p] = data;
        data += header[2 + 2 * p] * (k / 256) * kquant_record_bytes(parts.kinds[p]);
    }
    return parts;
}

/* ---- int8 dot products ------------------------------------------------------------------------------------------ */

#if INFER_AVX512 && defined(__AVX512BW__)
#define INT8_SIMD 512
#define LANES 16
#define PASS_TILES 2 /* tiles of LANES rows a pass keeps in registers: 4 x 2 int32 and 4 x 2 float sums */
#elif INFER_AVX2 && INFER_F16C
#define INT8_SIMD 256
#define LANES 8
#define PASS_TILES 1 /* AVX2's 16 registers: 4 int32 and 4 float sums, x, the broadcast and the scales */
#else
#define INT8_SIMD 0
#endif

/* Whether the vector dot products multiply Q8_0's quants signed (no VNNI: vpmaddubsw's 16-bit pair sums would
 * saturate on the unsigned ones; gemv_blocks.c). */
#if (INT8_SIMD == 512 && !defined(__AVX512VNNI__)) || (INT8_SIMD == 256 && !defined(__AVXVNNI__))
#define Q8_SIGNED 1
#else
#define Q8_SIGNED 0
#endif

#if INT8_SIMD
/* x's rows as the int8 kernels read them (int8_tiles, LANES rows a tile): `tiles` tiles, `blocks` blocks of 32. */
typedef struct {
    int8_tiles at;
    int64_t tiles, blocks;
} int8_rows;

/* One row's block of 32 floats quantized as gemv_blocks.c's quantize_activations does (dx = amax / 127, q rounded
 * to nearest even; the same values), q into `out`, returning sum(q); dx into *dx, the sum of its first 16 q into
 * *first. */
static inline int quantize_block(const float *in, int8_t out[BLOCK], float *dx, int *first) {
    int sum = 0;
#if INFER_AVX512
    const __m512 lo = _mm512_loadu_ps(in), hi = _mm512_loadu_ps(in + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 scale = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(qhi));
    *first = _mm512_reduce_add_epi32(qlo);
    sum = *first + _mm512_reduce_add_epi32(qhi);
#else
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(in[j]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < BLOCK; j++) {
        out[j] = (int8_t)nearbyintf(in[j] * inverse);
        sum += out[j];
        if (j == BLOCK / 2 - 1) *first = sum;
    }
#endif
    *dx = amax / 127.0f;
    return sum;
}

/* Row m of the layout (tile m / LANES, lane m % LANES) from one row of x (k floats). */
static inline void quantize_row(const float *x, int64_t k, int64_t m, const int8_tiles *tiles) {
    const int64_t tile = m / LANES, lane = m % LANES, blocks = k / BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        int8_t values[BLOCK];
        float scale;
        int first;
        const int sum = quantize_block(x + b * BLOCK, values, &scale, &first);
        for (int j = 0; j < BLOCK; j += 4)
            memcpy(tiles->q + ((tile * (k / 4) + b * 8 + j / 4) * LANES + lane) * 4, values + j, 4);
        const int64_t at = (tile * blocks + b) * LANES + lane;
        tiles->dx[at] = scale;
        tiles->s[at] = scale * (float)sum;
        tiles->sf[at] = scale * (float)first;
    }
}

static int8_rows quantize_rows(const float *x, int64_t rows, int64_t k) {
    int8_rows r;
    r.tiles = (rows + LANES - 1) / LANES;
    r.blocks = k / BLOCK;
    r.at = int8_tiles_alloc(r.tiles * LANES, k);
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < rows; m++) quantize_row(x + m * k, k, m, &r.at);
    return r;
}

/* A group's Q4 quants as bytes, [blocks][4 rows][32] (Q8_0's records hold theirs so already); MXFP4's codes as their
 * unsigned quants 2 FP4 + 12 (a byte shuffle over the table). */
static void unpack_group(const uint8_t *group, int64_t blocks, int kind, uint8_t *unpacked) {
    const int64_t size = record_bytes(kind);
#if INT8_SIMD == 512
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)mxfp4_quants()));
#endif
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *quants = group + b * size + quants_at(kind);
        uint8_t *out = unpacked + b * 128;
#if INT8_SIMD == 512
        const __m512i packed = _mm512_loadu_si512(quants), nibble = _mm512_set1_epi8(0x0F);
        __m512i rows01 = _mm512_and_si512(packed, nibble), rows23 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        if (kind == KIND_MXFP4) {
            rows01 = _mm512_shuffle_epi8(table, rows01);
            rows23 = _mm512_shuffle_epi8(table, rows23);
        }
        _mm512_storeu_si512(out, rows01);
        _mm512_storeu_si512(out + 64, rows23);
#else
        for (int j = 0; j < 64; j++) {
            out[j] = quants[j] & 0x0F;
            out[64 + j] = quants[j] >> 4;
            if (kind == KIND_MXFP4) {
                out[j] = mxfp4_quants()[out[j]];
                out[64 + j] = mxfp4_quants()[out[64 + j]];
            }
        }
#endif
    }
}

/* One K-quant record's quants, 256 unsigned bytes, each block j of 32 columns in order at out + 128 j (its row's
 * place in unpack_group's layout). The record holds column 32j + 4t + c beside x's byte 32t + 4j + c
 * (gemv_kquants.c): its quants, read as 8 x 8 words of 4 bytes (t, j), are transposed. */
static inline void kquant_quants_in_order(const uint8_t *quants, int kind, uint8_t *out) {
#if INT8_SIMD == 512
    const __m512i first = _mm512_loadu_si512(quants), second = _mm512_loadu_si512(quants + 64);
    const __m512i high = kind == KIND_Q6_K ? _mm512_loadu_si512(quants + 128) : _mm512_setzero_si512();
    __m512i p[4];  /* x's bytes 64u ..: words (t, j), t = 2u, 2u + 1 */
    for (int u = 0; u < 4; u++) p[u] = kquant_step_512(first, second, high, u, kind);
    /* words (j, t) at 4j + t for t < 4 (from p[0], p[1]) or t >= 4 (p[2], p[3]), j 0-3, then 4-7 */
    const __m512i by_block = _mm512_set_epi32(27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0);
    const __m512i by_block_high = _mm512_add_epi32(by_block, _mm512_set1_epi32(4));
    const __m512i early_low = _mm512_permutex2var_epi32(p[0], by_block, p[1]);
    const __m512i early_high = _mm512_permutex2var_epi32(p[0], by_block_high, p[1]);
    const __m512i late_low = _mm512_permutex2var_epi32(p[2], by_block, p[3]);
    const __m512i late_high = _mm512_permutex2var_epi32(p[2], by_block_high, p[3]);
    /* two blocks a register, t 0-7 each */
    const __m512i in_order = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i in_order_next = _mm512_add_epi32(in_order, _mm512_set1_epi32(8));
    const __m512i blocks[4] = {_mm512_permutex2var_epi32(early_low, in_order, late_low),
                               _mm512_permutex2var_epi32(early_low, in_order_next, late_low),
                               _mm512_permutex2var_epi32(early_high, in_order, late_high),
                               _mm512_permutex2var_epi32(early_high, in_order_next, late_high)};
    for (int q = 0; q < 4; q++) {
        _mm256_storeu_si256((__m256i *)(out + 2 * q * 128), _mm512_castsi512_si256(blocks[q]));
        _mm256_storeu_si256((__m256i *)(out + (2 * q + 1) * 128), _mm512_extracti64x4_epi64(blocks[q], 1));
    }
#else
    __m256i r[8];  /* x's bytes 32t ..: words j 0-7 */
    for (int t = 0; t < 8; t++) r[t] = kquant_step_256(quants, t / 2, t % 2, kind);
    __m256i pairs[8], quads[8];  /* the 8 x 8 transpose: words, then pairs of them, then 128-bit halves */
    for (int h = 0; h < 8; h += 4) {
        pairs[h] = _mm256_unpacklo_epi32(r[h], r[h + 1]);
        pairs[h + 1] = _mm256_unpackhi_epi32(r[h], r[h + 1]);
        pairs[h + 2] = _mm256_unpacklo_epi32(r[h + 2], r[h + 3]);
        pairs[h + 3] = _mm256_unpackhi_epi32(r[h + 2], r[h + 3]);
        quads[h] = _mm256_unpacklo_epi64(pairs[h], pairs[h + 2]);      /* j 0 and 4 */
        quads[h + 1] = _mm256_unpackhi_epi64(pairs[h], pairs[h + 2]);  /* j 1 and 5 */
        quads[h + 2] = _mm256_unpacklo_epi64(pairs[h + 1], pairs[h + 3]);
        quads[h + 3] = _mm256_unpackhi_epi64(pairs[h + 1], pairs[h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256((__m256i *)(out + j * 128), _mm256_permute2x128_si256(quads[j], quads[4 + j], 0x20));
        _mm256_storeu_si256((__m256i *)(out + (4 + j) * 128), _mm256_permute2x128_si256(quads[j], quads[4 + j], 0x31));
    }
#endif
}

/* One K-quant record's scales as unpack_kquants gives them: per block j, at scales[8 j] Q4_K's d sc[j] and at
 * scales[8 j + 4] its -dmin m[j]; Q6_K's d sc of the block's first 16 columns and of its last 16. */
static inline void kquant_block_scales(const uint8_t *record, int kind, float *scales) {
    uint16_t halves[2];
    memcpy(halves, record, 4);
    const float d = half_to_float(halves[0]);
    if (kind == KIND_Q4_K) {
        uint64_t sc, m;
        q4k_scales(record + 4, &sc, &m);
        const float dmin = half_to_float(halves[1]);
        for (int j = 0; j < 8; j++) {
            scales[8 * j] = d * (float)((sc >> 8 * j) & 0xFF);
            scales[8 * j + 4] = -dmin * (float)((m >> 8 * j) & 0xFF);
        }
    } else {
        for (int j = 0; j < 8; j++) {
            scales[8 * j] = d * (float)(int8_t)record[2 + j];
            scales[8 * j + 4] = d * (float)(int8_t)record[10 + j];
        }
    }
}

/* A K-quant group's four weight rows (its first `rows` there, the others zero), each its `supers` records in turn,
 * as unpack_group lays out the others' quants ([blocks][4 rows][32]), and 8 scales a block after them, at
 * scratch + 128 blocks (kquant_block_scales, row i's at i and 4 + i). */
static void unpack_kquants(const uint8_t *group, int64_t supers, int64_t rows, int kind, uint8_t *scratch) {
    const int64_t size = kquant_record_bytes(kind);
    float *scales = (float *)(scratch + supers * 8 * 128);
    for (int64_t i = 0; i < 4; i++)
        for (int64_t sb = 0; sb < supers; sb++) {
            const uint8_t *record = group + (i * supers + sb) * size;
            float values[64];
            if (i < rows) {
                kquant_quants_in_order(record + kquant_quants_at(kind), kind, scratch + sb * 8 * 128 + i * 32);
                kquant_block_scales(record, kind, values);
            } else {
                for (int j = 0; j < 8; j++) memset(scratch + (sb * 8 + j) * 128 + i * 32, 0, 32);
                memset(values, 0, sizeof values);
            }
            for (int j = 0; j < 8; j++) {
                scales[(sb * 8 + j) * 8 + i] = values[8 * j];
                scales[(sb * 8 + j) * 8 + 4 + i] = values[8 * j + 4];
            }
        }
}

/* A group's weights as the passes read them, into `scratch` (block_gemm_scratch_bytes(k)): Q8_0's records as they
 * are (nothing to do), the other 32-block kinds' quants (unpack_group), a K-quant group's quants and scales
 * (unpack_kquants; `rows` of its four rows there). */
static inline void unpack_weights(const uint8_t *group, int64_t k, int64_t rows, int kind, uint8_t *scratch) {
    if (kind == KIND_Q4_K || kind == KIND_Q6_K)
        unpack_kquants(group, k / 256, rows, kind, scratch);
    else if (kind != KIND_Q8_0)
        unpack_group(group, k / BLOCK, kind, scratch);
}

/* Weight row i's scale d[i] and offset c[i] for block b of `blocks` (its dot product with that block of x is
 * d[i] dx sum(q_w q_x) + c[i] s; Q6_K's for the block's last 16 columns, the first 16 added apart, group_pass_*). */
static inline void block_scales(const uint8_t *group, const uint8_t *unpacked, int64_t blocks, int64_t b, int kind,
                                float d[4], float c[4]) {
    if (kind == KIND_Q4_K || kind == KIND_Q6_K) {
        const float *scales = (const float *)(unpacked + blocks * 128) + b * 8;
        for (int i = 0; i < 4; i++) {
            d[i] = scales[kind == KIND_Q6_K ? 4 + i : i];
            c[i] = kind == KIND_Q6_K ? -32.0f * d[i] : scales[4 + i];
        }
    } else {
        record_scales(group + b * record_bytes(kind), kind, Q8_SIGNED, d, c);
    }
}
#endif

#if INT8_SIMD
/* store_columns one value at a time: the last group's columns or the last tile's rows. */
static void store_values(const float values[4][LANES], const float *bias, float *y, int64_t m, int64_t rows,
                         int64_t n, int64_t n_out, int64_t stride) {
    for (int64_t lane = 0; lane < LANES && m + lane < rows; lane++)
        for (int64_t i = 0; i < 4 && n + i < n_out; i++)
            y[(m + lane) * stride + n + i] = values[i][lane] + (bias ? bias[n + i] : 0.0f);
}
#endif

#if INT8_SIMD == 512
/* acc + unsigned bytes times signed bytes, summed by fours. */
static inline __m512i dot_512(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

/* sums[i][t] (lanes: the rows of tile t) = weight row i of the group . those rows of x, for `count` tiles (1 to
 * PASS_TILES, a constant once inlined) of x from its first (tile stride q_stride bytes, scales' s_stride floats);
 * `unpacked`: unpack_weights' scratch. Q6_K's two scales a block: the int32 sums of its first 16 columns scaled
 * into the float ones before the last 16's, and its offsets -32 d over each half, c s + (c_first - c) sf. */
static inline __attribute__((always_inline)) void group_pass_512(const uint8_t *group, const uint8_t *unpacked,
                                                                 int64_t blocks, const int8_tiles *x,
                                                                 int64_t q_stride, int64_t s_stride,
                                                                 __m512 sums[4][PASS_TILES], const int count,
                                                                 const int kind) {
    const float *kscales = kind == KIND_Q4_K || kind == KIND_Q6_K ? (const float *)(unpacked + blocks * 128) : NULL;
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < count; t++) sums[i][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wq = kind == KIND_Q8_0 ? group + b * record_bytes(kind) + 8 : unpacked + b * 128;
        __m512i acc[4][PASS_TILES];
        for (int i = 0; i < 4; i++)
            for (int t = 0; t < count; t++) acc[i][t] = _mm512_setzero_si512();
        for (int step = 0; step < 8; step++) {
            __m512i xv[PASS_TILES];
            for (int t = 0; t < count; t++) xv[t] = _mm512_loadu_si512(x->q + t * q_stride + (b * 8 + step) * 64);
            for (int i = 0; i < 4; i++) {
                int32_t word;
                memcpy(&word, wq + i * 32 + step * 4, 4);
                __m512i weights = _mm512_set1_epi32(word);
                if (kind == KIND_Q8_0 && Q8_SIGNED) {  /* |q_w| times x carrying q_w's sign */
                    weights = _mm512_xor_si512(weights, _mm512_set1_epi8((char)0x80));
                    const __mmask64 negative = _mm512_movepi8_mask(weights);
                    weights = _mm512_abs_epi8(weights);
                    for (int t = 0; t < count; t++)
                        acc[i][t] = dot_512(acc[i][t], weights,
                                            _mm512_mask_sub_epi8(xv[t], negative, _mm512_setzero_si512(), xv[t]));
                } else {
                    for (int t = 0; t < count; t++) acc[i][t] = dot_512(acc[i][t], weights, xv[t]);
                }
            }
            if (kind == KIND_Q6_K && step == 3)  /* the first 16 columns done: their scale */
                for (int t = 0; t < count; t++) {
                    const __m512 dxv = _mm512_loadu_ps(x->dx + t * s_stride + b * LANES);
                    for (int i = 0; i < 4; i++) {
                        sums[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][t]),
                                                     _mm512_mul_ps(_mm512_set1_ps(kscales[b * 8 + i]), dxv),
                                                     sums[i][t]);
                        acc[i][t] = _mm512_setzero_si512();
                    }
                }
        }
        float d[4], c[4];
        block_scales(group, unpacked, blocks, b, kind, d, c);
        for (int t = 0; t < count; t++) {
            const __m512 dxv = _mm512_loadu_ps(x->dx + t * s_stride + b * LANES);
            const __m512 sv = _mm512_loadu_ps(x->s + t * s_stride + b * LANES);
            for (int i = 0; i < 4; i++) {
                sums[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][t]), _mm512_mul_ps(_mm512_set1_ps(d[i]), dxv),
                                             sums[i][t]);
                if (kind != KIND_Q8_0 || !Q8_SIGNED) sums[i][t] = _mm512_fmadd_ps(_mm512_set1_ps(c[i]), sv, sums[i][t]);
                if (kind == KIND_Q6_K)
                    sums[i][t] = _mm512_fmadd_ps(_mm512_set1_ps(-32.0f * kscales[b * 8 + i] - c[i]),
                                                 _mm512_loadu_ps(x->sf + t * s_stride + b * LANES), sums[i][t]);
            }
        }
    }
}

/* Four output columns' sums over 16 rows (values[i], [lane]: the row) plus bias into y (rows `stride` wide) at rows
 * m.., columns n..n+3 (of n_out): transposed 4 x 4 within each 128-bit lane, so that each lane holds one row's four
 * columns. */
static inline void store_columns(const float values[4][LANES], const float *bias, float *y, int64_t m, int64_t rows,
                                 int64_t n, int64_t n_out, int64_t stride) {
    if (n + 4 > n_out || m + LANES > rows) {  /* the last group or tile */
        store_values(values, bias, y, m, rows, n, n_out, stride);
        return;
    }
    __m512 sums[4];
    for (int i = 0; i < 4; i++) sums[i] = _mm512_loadu_ps(values[i]);
    const __m512 t0 = _mm512_unpacklo_ps(sums[0], sums[1]), t1 = _mm512_unpackhi_ps(sums[0], sums[1]);
    const __m512 t2 = _mm512_unpacklo_ps(sums[2], sums[3]), t3 = _mm512_unpackhi_ps(sums[2], sums[3]);
    __m512 r[4];
    r[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));  /* rows 0, 4, 8, 12 */
    r[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));  /* rows 1, 5, 9, 13 */
    r[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
    r[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
    const __m512 add = bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(bias + n)) : _mm512_setzero_ps();
    for (int j = 0; j < 4; j++) {
        const __m512 out = _mm512_add_ps(r[j], add);
        _mm_storeu_ps(y + (m + j) * stride + n, _mm512_castps512_ps128(out));
        _mm_storeu_ps(y + (m + 4 + j) * stride + n, _mm512_extractf32x4_ps(out, 1));
        _mm_storeu_ps(y + (m + 8 + j) * stride + n, _mm512_extractf32x4_ps(out, 2));
        _mm_storeu_ps(y + (m + 12 + j) * stride + n, _mm512_extractf32x4_ps(out, 3));
    }
}
#endif

#if INT8_SIMD == 256
static inline __m256i dot_256(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* group_pass_512 on AVX2 registers (8 rows a tile). */
static inline __attribute__((always_inline)) void group_pass_256(const uint8_t *group, const uint8_t *unpacked,
                                                                 int64_t blocks, const int8_tiles *x,
                                                                 int64_t q_stride, int64_t s_stride,
                                                                 __m256 sums[4][PASS_TILES], const int count,
                                                                 const int kind) {
    const float *kscales = kind == KIND_Q4_K || kind == KIND_Q6_K ? (const float *)(unpacked + blocks * 128) : NULL;
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < count; t++) sums[i][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wq = kind == KIND_Q8_0 ? group + b * record_bytes(kind) + 8 : unpacked + b * 128;
        __m256i acc[4][PASS_TILES];
        for (int i = 0; i < 4; i++)
            for (int t = 0; t < count; t++) acc[i][t] = _mm256_setzero_si256();
        for (int step = 0; step < 8; step++) {
            __m256i xv[PASS_TILES];
            for (int t = 0; t < count; t++)
                xv[t] = _mm256_loadu_si256((const __m256i *)(x->q + t * q_stride + (b * 8 + step) * 32));
            for (int i = 0; i < 4; i++) {
                int32_t word;
                memcpy(&word, wq + i * 32 + step * 4, 4);
                __m256i weights = _mm256_set1_epi32(word);
                if (kind == KIND_Q8_0 && Q8_SIGNED) {  /* |q_w| times x carrying q_w's sign */
                    weights = _mm256_xor_si256(weights, _mm256_set1_epi8((char)0x80));
                    for (int t = 0; t < count; t++)
                        acc[i][t] = dot_256(acc[i][t], _mm256_sign_epi8(weights, weights),
                                            _mm256_sign_epi8(xv[t], weights));
                } else {
                    for (int t = 0; t < count; t++) acc[i][t] = dot_256(acc[i][t], weights, xv[t]);
                }
            }
            if (kind == KIND_Q6_K && step == 3)
                for (int t = 0; t < count; t++) {
                    const __m256 dxv = _mm256_loadu_ps(x->dx + t * s_stride + b * LANES);
                    for (int i = 0; i < 4; i++) {
                        sums[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][t]),
                                                     _mm256_mul_ps(_mm256_set1_ps(kscales[b * 8 + i]), dxv),
                                                     sums[i][t]);
                        acc[i][t] = _mm256_setzero_si256();
                    }
                }
        }
        float d[4], c[4];
        block_scales(group, unpacked, blocks, b, kind, d, c);
        for (int t = 0; t < count; t++) {
            const __m256 dxv = _mm256_loadu_ps(x->dx + t * s_stride + b * LANES);
            const __m256 sv = _mm256_loadu_ps(x->s + t * s_stride + b * LANES);
            for (int i = 0; i < 4; i++) {
                sums[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][t]), _mm256_mul_ps(_mm256_set1_ps(d[i]), dxv),
                                             sums[i][t]);
                if (kind != KIND_Q8_0 || !Q8_SIGNED) sums[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(c[i]), sv, sums[i][t]);
                if (kind == KIND_Q6_K)
                    sums[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(-32.0f * kscales[b * 8 + i] - c[i]),
                                                 _mm256_loadu_ps(x->sf + t * s_stride + b * LANES), sums[i][t]);
            }
        }
    }
}

/* store_columns for 8 rows: each 128-bit half of the transposed registers one row's four columns. */
static inline void store_columns(const float values[4][LANES], const float *bias, float *y, int64_t m, int64_t rows,
                                 int64_t n, int64_t n_out, int64_t stride) {
    if (n + 4 > n_out || m + LANES > rows) {  /* the last group or tile */
        store_values(values, bias, y, m, rows, n, n_out, stride);
        return;
    }
    __m256 sums[4];
    for (int i = 0; i < 4; i++) sums[i] = _mm256_loadu_ps(values[i]);
    const __m256 t0 = _mm256_unpacklo_ps(sums[0], sums[1]), t1 = _mm256_unpackhi_ps(sums[0], sums[1]);
    const __m256 t2 = _mm256_unpacklo_ps(sums[2], sums[3]), t3 = _mm256_unpackhi_ps(sums[2], sums[3]);
    __m256 r[4];
    r[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2)));  /* rows 0, 4 */
    r[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2)));  /* rows 1, 5 */
    r[2] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)));
    r[3] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)));
    const __m128 add = bias ? _mm_loadu_ps(bias + n) : _mm_setzero_ps();
    for (int j = 0; j < 4; j++) {
        _mm_storeu_ps(y + (m + j) * stride + n, _mm_add_ps(_mm256_castps256_ps128(r[j]), add));
        _mm_storeu_ps(y + (m + 4 + j) * stride + n, _mm_add_ps(_mm256_extractf128_ps(r[j], 1), add));
    }
}
#endif

#if INT8_SIMD
/* One group's sums over `count` tiles of x from its first (1 to PASS_TILES): values[t][i][lane], weight row i of the
 * group against row `lane` of tile t; a copy of the pass for a full pass of tiles and one for a single tile. */
static inline __attribute__((always_inline)) void group_tiles(const uint8_t *group, const uint8_t *unpacked,
                                                              int64_t k, const int8_tiles *x, int count,
                                                              float values[PASS_TILES][4][LANES], const int kind) {
    const int64_t blocks = k / BLOCK, q_stride = k * LANES, s_stride = blocks * LANES;
#if INT8_SIMD == 512
    __m512 sums[4][PASS_TILES];
    if (count == PASS_TILES)
        group_pass_512(group, unpacked, blocks, x, q_stride, s_stride, sums, PASS_TILES, kind);
    else
        group_pass_512(group, unpacked, blocks, x, q_stride, s_stride, sums, 1, kind);
    for (int t = 0; t < count; t++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(values[t][i], sums[i][t]);
#else
    __m256 sums[4][PASS_TILES];
    group_pass_256(group, unpacked, blocks, x, q_stride, s_stride, sums, PASS_TILES, kind);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(values[0][i], sums[i][0]);
    (void)count;
#endif
}

/* Weight rows [0, n_out) of one kind (a K-quant weight's each its records in turn) into y's columns [0, n_out) (rows
 * of y `stride` wide; bias from its first): every group of four weight rows over every chunk of x's tiles, the
 * groups split across the threads. */
static inline __attribute__((always_inline)) void gemm_int8(const int8_rows *r, int64_t rows, int64_t k,
                                                            const uint8_t *w, const float *bias, float *y,
                                                            int64_t n_out, int64_t stride, const int kind) {
    const int kquant = kind == KIND_Q4_K || kind == KIND_Q6_K;
    const int64_t groups = (n_out + 3) / 4;
    const int64_t group_bytes = kquant ? 4 * (k / 256) * kquant_record_bytes(kind) : r->blocks * record_bytes(kind);
    int64_t chunk = CHUNK_BYTES / (k * LANES);
    chunk = chunk < PASS_TILES ? PASS_TILES : chunk / PASS_TILES * PASS_TILES;
#pragma omp parallel if (r->tiles * n_out * k >= 65536)
    {
        uint8_t *unpacked = kind == KIND_Q8_0 ? NULL : malloc(block_gemm_scratch_bytes(k));
        for (int64_t first = 0; first < r->tiles; first += chunk) {
            const int64_t last = first + chunk < r->tiles ? first + chunk : r->tiles;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *group = w + g * group_bytes;
                unpack_weights(group, k, n_out - 4 * g, kind, unpacked);
                for (int64_t t = first; t < last; t += PASS_TILES) {
                    const int count = last - t < PASS_TILES ? (int)(last - t) : PASS_TILES;
                    const int8_tiles x = int8_tiles_from(&r->at, t * LANES, k);
                    float values[PASS_TILES][4][LANES];
                    group_tiles(group, unpacked, k, &x, count, values, kind);
                    for (int i = 0; i < count; i++)
                        store_columns(values[i], bias, y, (t + i) * LANES, rows, g * 4, n_out, stride);
                }
            }
        }
        free(unpacked);
    }
}

static void gemm_blocks_int8(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind,
                             const float *bias, float *y, int64_t n_out) {
    int8_rows r = quantize_rows(x, rows, k);
    if (kind == KIND_Q4_K || kind == KIND_Q6_K || kind == KIND_K_MIXED) {  /* each part of one kind in turn */
        const kquant_parts parts = read_kquant_parts(w, kind, n_out, k);
        for (int64_t p = 0; p < parts.count; p++) {
            const int64_t first = p ? parts.ends[p - 1] : 0, part_rows = parts.ends[p] - first;
            const float *part_bias = bias ? bias + first : NULL;
            if (parts.kinds[p] == KIND_Q4_K)
                gemm_int8(&r, rows, k, parts.data[p], part_bias, y + first, part_rows, n_out, KIND_Q4_K);
            else
                gemm_int8(&r, rows, k, parts.data[p], part_bias, y + first, part_rows, n_out, KIND_Q6_K);
        }
    } else if (kind == KIND_Q4_0) {  /* the kind a constant in each copy */
        gemm_int8(&r, rows, k, w, bias, y, n_out, n_out, KIND_Q4_0);
    } else if (kind == KIND_Q4_1) {
        gemm_int8(&r, rows, k, w, bias, y, n_out, n_out, KIND_Q4_1);
    } else if (kind == KIND_MXFP4) {
        gemm_int8(&r, rows, k, w, bias, y, n_out, n_out, KIND_MXFP4);
    } else {
        gemm_int8(&r, rows, k, w, bias, y, n_out, n_out, KIND_Q8_0);
    }
    free(r.at.q);
}
#endif

/* ---- for kernels that split a weight's groups over their threads themselves (moe.c) ----------------------------- */

int64_t block_gemm_tile_rows(int64_t kind) {
#if INT8_SIMD
    return kind == KIND_K_MIXED ? 0 : LANES;
#else
    (void)kind;
    return 0;
#endif
}

#if INT8_SIMD
void block_gemm_quantize_row(const float *x, int64_t k, int64_t row, const int8_tiles *tiles) {
    quantize_row(x, k, row, tiles);
}

/* The kind a constant in each copy, as gemm_blocks_int8. */
static inline __attribute__((always_inline)) void group_sums_int8(const uint8_t *group, int64_t k,
                                                                  const int8_tiles *tiles, int64_t rows,
                                                                  uint8_t *scratch, float *out, const int kind) {
    unpack_weights(group, k, 4, kind, scratch);
    for (int64_t t = 0; t * LANES < rows; t += PASS_TILES) {
        const int64_t left = (rows - t * LANES + LANES - 1) / LANES;
        const int count = left < PASS_TILES ? (int)left : PASS_TILES;
        const int8_tiles x = int8_tiles_from(tiles, t * LANES, k);
        float values[PASS_TILES][4][LANES];
        group_tiles(group, scratch, k, &x, count, values, kind);
        for (int j = 0; j < count; j++)
            for (int64_t lane = 0, row = (t + j) * LANES; lane < LANES && row < rows; lane++, row++)
                for (int i = 0; i < 4; i++) out[row * 4 + i] = values[j][i][lane];
    }
}

void block_gemm_group_sums(const uint8_t *group, int64_t k, const int8_tiles *tiles, int64_t rows, int64_t kind,
                           uint8_t *scratch, float *sums) {
    if (kind == KIND_Q4_0)
        group_sums_int8(group, k, tiles, rows, scratch, sums, KIND_Q4_0);
    else if (kind == KIND_Q4_1)
        group_sums_int8(group, k, tiles, rows, scratch, sums, KIND_Q4_1);
    else if (kind == KIND_MXFP4)
        group_sums_int8(group, k, tiles, rows, scratch, sums, KIND_MXFP4);
    else if (kind == KIND_Q4_K)
        group_sums_int8(group, k, tiles, rows, scratch, sums, KIND_Q4_K);
    else if (kind == KIND_Q6_K)
        group_sums_int8(group, k, tiles, rows, scratch, sums, KIND_Q6_K);
    else
        group_sums_int8(group, k, tiles, rows, scratch, sums, KIND_Q8_0);
}
#else
void block_gemm_quantize_row(const float *x, int64_t k, int64_t row, const int8_tiles *tiles) {
    (void)x, (void)k, (void)row, (void)tiles;
}

void block_gemm_group_sums(const uint8_t *group, int64_t k, const int8_tiles *tiles, int64_t rows, int64_t kind,
                           uint8_t *scratch, float *sums) {
    (void)group, (void)k, (void)tiles, (void)rows, (void)kind, (void)scratch, (void)sums;
}
#endif

/* ---- AMX bf16 tiles over dequantized panels --------------------------------------------------------------------- */

#if INFER_AMX && INFER_AVX512_BF16
/* 16 registers of 16 int32 each transposed: r[j][i] becomes r[i][j]. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + q]: within each 128-bit lane L, column 4L + q of rows i..i+3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int q = 0; q < 4; q++) {
        const __m512i even_low = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88);
        const __m512i odd_low = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xDD);
        const __m512i even_high = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88);
        const __m512i odd_high = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xDD);
        r[q] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
        r[8 + q] = _mm512_shuffle_i32x4(even_low, even_high, 0xDD);
        r[4 + q] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xDD);
    }
}

/* Orders of k within a block of 32 (Q4: ORDER_NIBBLES) or of 256 (K-quants: ORDER_SUPER) in which a dequantized panel
 * holds its weights, and x's B tiles their columns to meet them. */
enum { ORDER_COLUMNS = 0, ORDER_SUPER = 1, ORDER_NIBBLES = 2 };

/* Positions 32 kt .. 32 kt + 31 of bf16 row `x + row` in `order` (rows_as_b_tiles): ORDER_SUPER's are 8 runs of 4
 * columns 32 apart (one 64-bit gather), ORDER_NIBBLES' one permutation of the block's columns. */
static inline __m512i bf16_block_of_b(const void *x, int64_t row, int64_t kt, int order) {
    const uint16_t *in = (const uint16_t *)x + row;
    if (order == ORDER_SUPER) {
        const __m512i runs = _mm512_set_epi64(448, 384, 320, 256, 192, 128, 64, 0);  /* bytes of columns 32j */
        return _mm512_i64gather_epi64(runs, (const void *)(in + (kt / 8) * 256 + 4 * (kt % 8)), 1);
    }
    const __m512i columns = _mm512_loadu_si512(in + kt * 32);
    if (order == ORDER_COLUMNS) return columns;
    const __m512i evens_then_odds = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28,
                                                     26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutexvar_epi16(evens_then_odds, columns);
}

/* x rounded to bf16 as B tiles, [tiles of 16 rows][k / 32][16 pairs p][16 rows][2] (row p of a tile: every row's
 * positions 2p and 2p + 1), rows past the last zero: each 16 x 32 block of x a 16 x 16 transpose of pairs. Position
 * p of a block holds column p (ORDER_COLUMNS); with ORDER_SUPER, each 256 columns in the order a K-quant record stores
 * its weights (gemv_kquants.c's top comment: position 32t + 4j + c holds column 32j + 4t + c); with ORDER_NIBBLES,
 * each 32 columns' even ones, then their odd ones (position p < 16 holds column 2p, p >= 16 column 2p - 31), the
 * order dequantize_record looks a Q4 record's nibbles up in. `x` float32, or (x_bf16) bf16 rows taken as they are. */
static uint16_t *rows_as_b_tiles(const void *x, int x_bf16, int64_t rows, int64_t k, int64_t tiles, int order) {
    uint16_t *xb = malloc(sizeof(uint16_t) * tiles * 16 * k);
    const int64_t k_tiles = k / 32;
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_ELEMENTS)
    for (int64_t job = 0; job < tiles * k_tiles; job++) {
        const int64_t tile = job / k_tiles, kt = job % k_tiles;
        __m512i r[16];
        for (int i = 0; i < 16; i++) {
            const int64_t m = tile * 16 + i;
            if (m >= rows) {
                r[i] = _mm512_setzero_si512();
                continue;
            }
            if (x_bf16) {
                r[i] = bf16_block_of_b(x, m * k, kt, order);
                continue;
            }
            if (order == ORDER_SUPER) {  /* positions 32t .. 32t + 31 of super-block kt / 8, t = kt % 8 */
                const __m512i columns = _mm512_set_epi32(99, 98, 97, 96, 67, 66, 65, 64, 35, 34, 33, 32, 3, 2, 1, 0);
                const float *in = (const float *)x + m * k + (kt / 8) * 256 + 4 * (kt % 8);
                r[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_i32gather_ps(columns, in + 128, 4),
                                                    _mm512_i32gather_ps(columns, in, 4));
                continue;
            }
            const float *in = (const float *)x + m * k + kt * 32;
            const __m512 low = _mm512_loadu_ps(in), high = _mm512_loadu_ps(in + 16);
            if (order == ORDER_NIBBLES) {
                const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
                r[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(low, odd, high),
                                                    _mm512_permutex2var_ps(low, even, high));
                continue;
            }
            r[i] = (__m512i)_mm512_cvtne2ps_pbh(high, low);
        }
        transpose16(r);
        uint16_t *out = xb + job * 512;
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + p * 32, r[p]);
    }
    return xb;
}

/* One record's four weight rows (32 columns each) as bf16, into rows `out`, `out + stride`, ...: Q8_0's in the order
 * of their columns, Q4's in ORDER_NIBBLES (rows_as_b_tiles). */
static inline __attribute__((always_inline)) void dequantize_record(const uint8_t *record, uint16_t *out,
                                                                    int64_t stride, const int kind) {
    const uint8_t *quants = record + quants_at(kind);
    if (kind == KIND_Q8_0) {  /* (u - 128) d as u d + c, exact in float32 */
        float d[4], c[4];
        record_scales(record, kind, 0, d, c);
        for (int i = 0; i < 4; i++) {
            const __m512 scale = _mm512_set1_ps(d[i]), offset = _mm512_set1_ps(c[i]);
            const __m512 lo = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(quants + 32 * i)))), scale,
                offset);
            const __m512 hi = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(quants + 32 * i + 16)))),
                scale, offset);
            _mm512_storeu_si512(out + i * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        return;
    }
    /* Q4: per pair of rows, both rows' 16 possible weights (nibble * d + c) as one table of 32 bf16s, looked up by
     * the nibbles read in place as 16-bit indices: word w of the quants holds (bits 0-3, 4-7, 8-11, 12-15) row
     * 0's column 2w, row 2's 2w, row 0's 2w + 1, row 2's 2w + 1 (words 16-31: rows 1 and 3), so masking a shift of
     * them looks up the even columns of two rows, or the odd ones, in one permutation (row 1's and 3's indices
     * raised by 16 to their half of the table). Each lookup's halves are a row's even or odd columns. */
    float dc[8];  /* d[0..3], c[0..3] */
    if (kind == KIND_Q4_1) {
        _mm256_storeu_ps(dc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)record)));
    } else {
        const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)record));
        _mm_storeu_ps(dc, d);
        _mm_storeu_ps(dc + 4, _mm_mul_ps(d, _mm_set1_ps(-8.0f)));
    }
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i tables[2];
    for (int pair = 0; pair < 2; pair++) {  /* rows 2 pair and 2 pair + 1 */
        const __m512 first = _mm512_fmadd_ps(iota, _mm512_set1_ps(dc[2 * pair]), _mm512_set1_ps(dc[4 + 2 * pair]));
        const __m512 second =
            _mm512_fmadd_ps(iota, _mm512_set1_ps(dc[2 * pair + 1]), _mm512_set1_ps(dc[5 + 2 * pair]));
        tables[pair] = (__m512i)_mm512_cvtne2ps_pbh(second, first);
    }
    const __m512i packed = _mm512_loadu_si512(quants), nibble = _mm512_set1_epi16(0x000F);
    const __m512i upper = _mm512_maskz_set1_epi16(0xFFFF0000u, 16);
    const int shifts[4] = {0, 8, 4, 12};  /* rows 0, 1 even and odd columns; rows 2, 3 even and odd */
    for (int j = 0; j < 4; j++) {
        const __m512i indices =
            _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, shifts[j]), nibble, upper, 0xEA); /* a & b | c */
        const __m512i looked = _mm512_permutexvar_epi16(indices, tables[j / 2]);
        uint16_t *row = out + (j / 2) * 2 * stride + (j % 2) * 16;  /* even columns at 0..15, odd at 16..31 */
        _mm256_storeu_si256((__m256i *)row, _mm512_castsi512_si256(looked));
        _mm256_storeu_si256((__m256i *)(row + stride), _mm512_extracti64x4_epi64(looked, 1));
    }
}

/* One super-block of a K-quant row as bf16 in its record's order (position p at out[(p / 32) * stride + p % 32]:
 * 32 positions a tile row, a row of each of 8 k-tiles). Per 64-byte step u of the record, 32-bit lane l of the
 * quants belongs to block j = l % 8 (gemv_kquants.c): its 16-byte quarters take blocks 0-3 and 4-7 in turn. */
static inline __attribute__((always_inline)) void dequantize_super(const uint8_t *record, uint16_t *out,
                                                                   int64_t stride, int64_t kind) {
    const __m512i lanes_low = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i lanes_high = _mm512_add_epi32(lanes_low, _mm512_set1_epi32(4));
    uint16_t halves[2];
    memcpy(halves, record, 4);
    __m512 scaled;  /* per sub-block: Q4_K d sc[0..7], dmin m[0..7]; Q6_K d sc[0, 2, .., 14], d sc[1, 3, .., 15] */
    if (kind == KIND_Q4_K) {
        uint64_t sc, m;
        q4k_scales(record + 4, &sc, &m);
        const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)m, (long long)sc)));
        scaled = _mm512_mul_ps(values, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_to_float(halves[0])),
                                                            _mm512_set1_ps(half_to_float(halves[1]))));
    } else {
        scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(record + 2)))),
                               _mm512_set1_ps(half_to_float(halves[0])));
    }
    const uint8_t *quants = record + kquant_quants_at(kind);
    const __m512i first = _mm512_loadu_si512(quants), second = _mm512_loadu_si512(quants + 64);
    const __m512i high = kind == KIND_Q6_K ? _mm512_loadu_si512(quants + 128) : _mm512_setzero_si512();
    for (int u = 0; u < 4; u++) {
        const __m512i w = kquant_step_512(first, second, high, u, kind);
        __m512 scale[2], offset[2];  /* weight = q scale - offset, quarters 0, 2 and 1, 3 */
        if (kind == KIND_Q6_K) {  /* sub-blocks 2j (u < 2) or 2j + 1 */
            const __m512i base = _mm512_set1_epi32(u < 2 ? 0 : 8);
            scale[0] = _mm512_permutexvar_ps(_mm512_add_epi32(lanes_low, base), scaled);
            scale[1] = _mm512_permutexvar_ps(_mm512_add_epi32(lanes_high, base), scaled);
            offset[0] = _mm512_mul_ps(scale[0], _mm512_set1_ps(32.0f));
            offset[1] = _mm512_mul_ps(scale[1], _mm512_set1_ps(32.0f));
        } else {
            scale[0] = _mm512_permutexvar_ps(lanes_low, scaled);
            scale[1] = _mm512_permutexvar_ps(lanes_high, scaled);
            offset[0] = _mm512_permutexvar_ps(_mm512_add_epi32(lanes_low, _mm512_set1_epi32(8)), scaled);
            offset[1] = _mm512_permutexvar_ps(_mm512_add_epi32(lanes_high, _mm512_set1_epi32(8)), scaled);
        }
        const __m128i quarters[4] = {_mm512_castsi512_si128(w), _mm512_extracti32x4_epi32(w, 1),
                                     _mm512_extracti32x4_epi32(w, 2), _mm512_extracti32x4_epi32(w, 3)};
        for (int half = 0; half < 2; half++) {  /* positions 64u + 32 half .. + 31: one tile row */
            const __m512 lo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(quarters[2 * half])), scale[0],
                                              offset[0]);
            const __m512 hi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(quarters[2 * half + 1])),
                                              scale[1], offset[1]);
            _mm512_storeu_si512(out + (2 * u + half) * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* Unit u of the dequantization of weight rows n0..n0+31 into AMX A tiles, [k / 32][2 tiles][16 rows][32 bf16]
 * (panel_units of them, in any order): for the 32-blocks one record, group u / (k / 32) at k-tile u % (k / 32); for
 * K-quants one super-block, row u / (k / 256)'s super-block u % (k / 256), in its records' order (x's B tiles take the
 * same). Units in turn read the panel's bytes in the order they lie in memory; rows past the weight's are zero. Units
 * are small, so that the tile loop over one panel can run the next panel's in its gaps (gemm_amx). */
static inline __attribute__((always_inline)) void dequantize_unit(const uint8_t *w, const kquant_parts *parts,
                                                                  int64_t n0, int64_t n_out, int64_t k, int64_t u,
                                                                  uint16_t *panel, const int kind) {
    if (kind == KIND_K_MIXED) {
        const int64_t r = u / (k / 256), b = u % (k / 256), n = n0 + r;
        uint16_t *rows = panel + b * 8 * 1024 + (r / 16) * 512 + (r % 16) * 32;
        if (n >= n_out) {
            for (int64_t t = 0; t < 8; t++) memset(rows + t * 1024, 0, 32 * sizeof(uint16_t));
            return;
        }
        int64_t p = 0;
        while (n >= parts->ends[p]) p++;
        const int64_t part = parts->kinds[p], size = kquant_record_bytes(part), first = p ? parts->ends[p - 1] : 0;
        const uint8_t *record = parts->data[p] + ((n - first) * (k / 256) + b) * size;
        if (part == KIND_Q4_K)
            dequantize_super(record, rows, 1024, KIND_Q4_K);
        else
            dequantize_super(record, rows, 1024, KIND_Q6_K);
        return;
    }
    const int64_t gl = u / (k / 32), kt = u % (k / 32), g = n0 / 4 + gl;
    uint16_t *rows = panel + kt * 1024 + (gl / 4) * 512 + (gl % 4) * 4 * 32;  /* tile gl / 4, its rows 4 (gl % 4) .. */
    if (g >= (n_out + 3) / 4) {
        memset(rows, 0, 4 * 32 * sizeof(uint16_t));
        return;
    }
    const uint8_t *record = w + (g * (k / BLOCK) + kt) * record_bytes(kind);
    __builtin_prefetch(record + 4 * 136);  /* the stream a few records on */
    dequantize_record(record, rows, 32, kind);
}

static inline int64_t panel_units(int64_t k, int kind) { return kind == KIND_K_MIXED ? 32 * (k / 256) : 8 * (k / 32); }

/* A 16 x 16 tile of results (rows: weight rows n.., columns: rows m.. of x) transposed into y plus bias: float32, or
 * (y_bf16) rounded to bf16. */
static inline void store_transposed(const float tile[16][16], const float *bias, void *y, int y_bf16, int64_t m,
                                    int64_t rows, int64_t n, int64_t n_out) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(tile[i]);
    transpose16(r);
    const __mmask16 columns = first_lanes(n_out - n);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(columns, bias + n) : _mm512_setzero_ps();
    for (int j = 0; j < 16 && m + j < rows; j++) {
        const __m512 sums = _mm512_add_ps(_mm512_castsi512_ps(r[j]), add);
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (m + j) * n_out + n, columns, (__m256i)_mm512_cvtneps_pbh(sums));
        else
            _mm512_mask_storeu_ps((float *)y + (m + j) * n_out + n, columns, sums);
    }
}

/* Item `item` of share `owner` (of `threads` shares of the panels, each share's panels over every chunk of x's tiles,
 * chunk by chunk): its panel's first output row *n and its chunk's first tile *first. */
static inline void panel_item(int64_t item, int owner, int threads, int64_t panels, int64_t chunks, int64_t chunk,
                              int64_t *n, int64_t *first) {
    const int64_t first_panel = panels * owner / threads, count = panels * (owner + 1) / threads - first_panel;
    *n = (first_panel + (item - first_panel * chunks) % count) * 32;
    *first = (item - first_panel * chunks) / count * chunk;
}

/* `kind` a constant per copy: a block kind, or KIND_K_MIXED for any K-quant weight (its `parts`).
 * The items, a panel over a chunk of x's tiles, are shared as a contiguous share of the panels per thread (each
 * chunk of x's tiles in turn, each of the share's panels over it: item_share over the items in that order), taken
 * from the front by their thread and from the back by a thread whose own are done. The tile loop waits on AMX's
 * multiplier and on loading x's tiles from L2 while the vector units idle, so a thread takes its next item before it
 * runs the current one and dequantizes that item's panel into a second buffer in the gaps, a few units per k-tile
 * spread evenly over the panel's passes: only a thread's first panel is dequantized alone. */
static inline __attribute__((always_inline)) void gemm_amx(const uint16_t *xb, int64_t rows, int64_t tiles,
                                                           int64_t k, const uint8_t *w, const kquant_parts *parts,
                                                           const float *bias, void *y, int y_bf16, int64_t n_out,
                                                           const int kind) {
    const int64_t k_tiles = k / 32, panels = (n_out + 31) / 32, units = panel_units(k, kind);
    int64_t chunk = CHUNK_BYTES / (16 * k * 2);  /* tiles of x */
    chunk = chunk < 2 ? 2 : chunk / 2 * 2;
    const int64_t chunks = (tiles + chunk - 1) / chunk;
    const int threads = team_size_max();
    item_share shares[threads];
    /* share s: panels [panels * s / threads, panels * (s + 1) / threads) over every chunk, its items numbered from
     * its first panel times chunks, chunk by chunk (panel_item) */
    for (int s = 0; s < threads; s++)
        share_set(shares, s, panels * s / threads * chunks, panels * (s + 1) / threads * chunks);
#pragma omp parallel
    {
        const int me = team_member();
        int owner;
        int64_t item = share_next(shares, threads, me, &owner), n, first;
        if (item >= 0) {
            load_full_tiles();
            uint16_t *buffers = malloc(sizeof(uint16_t) * 2 * 32 * k), *panel = buffers, *next = buffers + 32 * k;
            float results[4][16][16];
            panel_item(item, owner, threads, panels, chunks, chunk, &n, &first);
            for (int64_t u = 0; u < units; u++) dequantize_unit(w, parts, n, n_out, k, u, panel, kind);
            while (item >= 0) {
                const int64_t last = first + chunk < tiles ? first + chunk : tiles;
                const int64_t after = share_next(shares, threads, me, &owner);  /* the next item, taken now */
                int64_t n_next = n, first_next = 0;
                if (after >= 0) panel_item(after, owner, threads, panels, chunks, chunk, &n_next, &first_next);
                /* the next item's panel, unless there is none or it is this one (a share of one panel) */
                const int64_t todo = n_next != n ? units : 0;
                const int64_t steps = (last - first + 1) / 2 * k_tiles;
                int64_t done = 0, owed = 0;  /* units dequantized; todo per step, counted against steps */
                for (int64_t t = first; t < last; t += 2) {
                    const int pair = t + 1 < last;
                    const uint16_t *b0 = xb + t * k_tiles * 512, *b1 = b0 + k_tiles * 512;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kt = 0; kt < k_tiles; kt++) {
                        _tile_loadd(4, panel + kt * 1024, 64);
                        _tile_loadd(5, panel + kt * 1024 + 512, 64);
                        _tile_loadd(6, b0 + kt * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(2, 5, 6);
                        if (pair) {
                            _tile_loadd(7, b1 + kt * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                        for (owed += todo; owed >= steps; owed -= steps)
                            dequantize_unit(w, parts, n_next, n_out, k, done++, next, kind);
                    }
                    _tile_stored(0, results[0], 64);
                    _tile_stored(2, results[2], 64);
                    store_transposed(results[0], bias, y, y_bf16, t * 16, rows, n, n_out);
                    if (n + 16 < n_out) store_transposed(results[2], bias, y, y_bf16, t * 16, rows, n + 16, n_out);
                    if (pair) {
                        _tile_stored(1, results[1], 64);
                        _tile_stored(3, results[3], 64);
                        store_transposed(results[1], bias, y, y_bf16, (t + 1) * 16, rows, n, n_out);
                        if (n + 16 < n_out) store_transposed(results[3], bias, y, y_bf16, (t + 1) * 16, rows, n + 16, n_out);
                    }
                }
                for (; done < todo; done++) dequantize_unit(w, parts, n_next, n_out, k, done, next, kind);
                if (todo) {
                    uint16_t *swap = panel;
                    panel = next;
                    next = swap;
                }
                item = after, n = n_next, first = first_next;
            }
            free(buffers);
            _tile_release();
        }
    }
}

/* `bf16`: x and y bf16 rows, else float32. */
static void gemm_blocks_amx(const void *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind,
                            const float *bias, void *y, int64_t n_out, int bf16) {
    const int64_t tiles = (rows + 15) / 16;
    const int kquant = kind == KIND_Q4_K || kind == KIND_Q6_K || kind == KIND_K_MIXED;
    uint16_t *xb = rows_as_b_tiles(x, bf16, rows, k, tiles,
                                   kquant ? ORDER_SUPER : kind == KIND_Q8_0 ? ORDER_COLUMNS : ORDER_NIBBLES);
    if (kquant) {
        const kquant_parts parts = read_kquant_parts(w, kind, n_out, k);
        gemm_amx(xb, rows, tiles, k, w, &parts, bias, y, bf16, n_out, KIND_K_MIXED);
    } else if (kind == KIND_Q4_0)
        gemm_amx(xb, rows, tiles, k, w, NULL, bias, y, bf16, n_out, KIND_Q4_0);
    else if (kind == KIND_Q4_1)
        gemm_amx(xb, rows, tiles, k, w, NULL, bias, y, bf16, n_out, KIND_Q4_1);
    else
        gemm_amx(xb, rows, tiles, k, w, NULL, bias, y, bf16, n_out, KIND_Q8_0);
    free(xb);
}

/* The whole weight as plain bf16 rows [n_out, k] in the order of their columns, for a GEMM library's bf16 GEMM over
 * many rows of x: each thread dequantizes a panel of 32 rows into tiles as gemm_amx does (the same bf16 values), then
 * writes each row's tile rows back in column order. Q8_0 panels are already in it; a Q4 tile row holds a block's even
 * columns, then its odd ones (one permutation each); a K-quant one, position 32t + 4j + c of its super-block at its
 * k-tile t, column 32j + 4t + c (runs of 4 columns moved as 8 bytes). */
static void dequantize_dense(const uint8_t *w, int64_t kind, int64_t n_out, int64_t k, uint16_t *out) {
    const int kquant = kind == KIND_Q4_K || kind == KIND_Q6_K || kind == KIND_K_MIXED;
    const kquant_parts parts = kquant ? read_kquant_parts(w, kind, n_out, k) : (kquant_parts){0};
    const int64_t panels = (n_out + 31) / 32, k_tiles = k / 32;
    const int64_t units = panel_units(k, kquant ? KIND_K_MIXED : (int)kind);
    /* position c of a Q4 tile row's columns: c / 2 among the even ones, 16 + c / 2 among the odd */
    const __m512i nibble_columns = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                    7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#pragma omp parallel
    {
        uint16_t *panel = malloc(sizeof(uint16_t) * 32 * k);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            for (int64_t u = 0; u < units; u++) {
                if (kquant)
                    dequantize_unit(w, &parts, p * 32, n_out, k, u, panel, KIND_K_MIXED);
                else if (kind == KIND_Q4_0)
                    dequantize_unit(w, NULL, p * 32, n_out, k, u, panel, KIND_Q4_0);
                else if (kind == KIND_Q4_1)
                    dequantize_unit(w, NULL, p * 32, n_out, k, u, panel, KIND_Q4_1);
                else
                    dequantize_unit(w, NULL, p * 32, n_out, k, u, panel, KIND_Q8_0);
            }
            for (int64_t r = 0; r < 32 && p * 32 + r < n_out; r++) {
                uint16_t *row = out + (p * 32 + r) * k;
                for (int64_t kt = 0; kt < k_tiles; kt++) {
                    const uint16_t *tile_row = panel + kt * 1024 + (r / 16) * 512 + (r % 16) * 32;
                    if (kquant) {
                        uint16_t *super = row + (kt / 8) * 256 + 4 * (kt % 8);
                        for (int j = 0; j < 8; j++) memcpy(super + 32 * j, tile_row + 4 * j, 8);
                    } else {
                        const __m512i values = _mm512_loadu_si512(tile_row);
                        _mm512_storeu_si512(row + kt * 32, kind == KIND_Q8_0
                                                               ? values
                                                               : _mm512_permutexvar_epi16(nibble_columns, values));
                    }
                }
            }
        }
        free(panel);
    }
}
#endif

/* ---- the entry -------------------------------------------------------------------------------------------------- */

/* Which designs this build and machine run. */
static int has_design(int64_t design) {
    if (design == BLOCK_GEMM_AMX_BF16) {
#if INFER_AMX && INFER_AVX512_BF16
        return amx_available();
#else
        return 0;
#endif
    }
    if (design == BLOCK_GEMM_INT8) return INT8_SIMD != 0;
    return design == BLOCK_GEMM_PORTABLE;
}

int64_t infer_block_gemm_kind(void) {
    if (has_design(BLOCK_GEMM_AMX_BF16)) return BLOCK_GEMM_AMX_BF16;
    return has_design(BLOCK_GEMM_INT8) ? BLOCK_GEMM_INT8 : BLOCK_GEMM_PORTABLE;
}

int64_t infer_block_gemm_runs(int64_t design) { return has_design(design); }

/* The design infer_gemm_blocks takes for `design` (-1: the default for `rows` and `kind`). */
static int64_t chosen_design(int64_t rows, int64_t kind, int64_t design) {
    const int kquant = kind == KIND_Q4_K || kind == KIND_Q6_K || kind == KIND_K_MIXED;
    if ((design < 0 || !has_design(design)) && kquant && rows <= KQUANT_GEMV_ROWS) return BLOCK_GEMM_PORTABLE;
    if (design < 0 || !has_design(design))
        design = rows < (kind == KIND_Q4_0 || kind == KIND_Q4_1 ? AMX_MIN_ROWS_Q4 : AMX_MIN_ROWS) &&
                         has_design(BLOCK_GEMM_INT8)
                     ? BLOCK_GEMM_INT8
                     : infer_block_gemm_kind();
    if (kind == KIND_MXFP4)  /* not among the AMX design's kinds */
        return has_design(BLOCK_GEMM_INT8) ? BLOCK_GEMM_INT8 : BLOCK_GEMM_PORTABLE;
    return design;
}

void infer_gemm_blocks(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind, const float *bias,
                       float *y, int64_t n_out, int64_t design) {
    design = chosen_design(rows, kind, design);
#if INFER_AMX && INFER_AVX512_BF16
    if (design == BLOCK_GEMM_AMX_BF16) {
        gemm_blocks_amx(x, rows, k, w, kind, bias, y, n_out, 0);
        return;
    }
#endif
#if INT8_SIMD
    if (design == BLOCK_GEMM_INT8) {
        gemm_blocks_int8(x, rows, k, w, kind, bias, y, n_out);
        return;
    }
#endif
    infer_linear_blocks(x, rows, k, w, kind, bias, y, n_out);  /* plain C, K-quants' few rows: the GEMV */
}

int64_t infer_dequantize_blocks_bf16(const uint8_t *w, int64_t kind, int64_t n_out, int64_t k, uint16_t *out) {
#if INFER_AMX && INFER_AVX512_BF16
    if (kind == KIND_MXFP4) return 0;  /* not among the AMX design's kinds */
    dequantize_dense(w, kind, n_out, k, out);
    return 1;
#else
    (void)w, (void)kind, (void)n_out, (void)k, (void)out;
    return 0;
#endif
}

void infer_gemm_blocks_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind,
                            const float *bias, uint16_t *y, int64_t n_out, int64_t design) {
    design = chosen_design(rows, kind, design);
#if INFER_AMX && INFER_AVX512_BF16
    if (design == BLOCK_GEMM_AMX_BF16) {
        gemm_blocks_amx(x, rows, k, w, kind, bias, y, n_out, 1);
        return;
    }
#endif
    float *wide = malloc(sizeof(float) * rows * (k + n_out)), *sums = wide + rows * k;
    bf16_to_floats(x, wide, rows * k);
    infer_gemm_blocks(wide, rows, k, w, kind, bias, sums, n_out, design);
    floats_to_bf16(sums, y, rows * n_out);
    free(wide);
}
