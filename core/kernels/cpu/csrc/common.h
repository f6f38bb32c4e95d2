/* What every kernel file shares: the C library, the library's interface (cpu_kernels.h), the vector helpers of
 * the instruction sets this build targets (isa_*.h), half and bf16 conversions, the dot product, exp over a row,
 * and when row-wise work is split over the threads. Each .c file includes this first.
 *
 * Nothing here is part of the library's interface: the few functions one file defines for the others are hidden
 * (INFER_HIDDEN), the helpers static inline, so that the hot loops of every file that uses them inline them. */
#ifndef INFER_COMMON_H
#define INFER_COMMON_H

#define _DEFAULT_SOURCE /* syscall() under -std=c11, for AMX's permission request */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* A function one file defines for the others: kept out of the library's exported symbols. */
#define INFER_HIDDEN __attribute__((visibility("hidden")))

#include "cpu_kernels.h"
#include "isa_avx2.h"
#include "isa_avx512.h"
#include "isa_amx.h"

/* Elements of a row-wise op (norm, SiLU, a GEMM input's rounding) from which its rows are split over the threads:
 * a large decode step's 64 x 576 rows were one thread's while the other waited. */
#define PARALLEL_ELEMENTS 16384

/* Rows of x one pass of the GEMV (gemv.c) takes at most: with AVX-512's 32 registers, 8 (16 accumulators, 2 weight
 * vectors, x); with AVX2's 16, 3 (12 accumulators, 4 weight vectors; x is an FMA memory operand). A fused layer
 * (fused.c) sends steps of more rows to the tile GEMM where it has the weights so. */
#if INFER_AVX512
#define PASS_ROWS 8
#else
#define PASS_ROWS 3
#endif

/* ---- a loop's items shared among the threads -------------------------------------------------------------------- */

/* The calling thread's place in its OpenMP team (0 of 1 outside one, or in a build without OpenMP). */
static inline int team_member(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Threads in the calling thread's OpenMP team (1 outside one, or in a build without OpenMP). */
static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Threads a parallel region may get: the number of shares to lay out before it. */
static inline int team_size_max(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* One thread's share of a loop's items, [front, back) in one word (front in the high half), on a line of its own.
 * Its thread takes items from the front, in order, so a kernel that prefetches the item after the one it runs
 * prefetches the right one; a thread whose own share is done takes from the back of the others'. A static split
 * waits for the slowest thread, and cores do not all run alike: on a shared machine one core's tile products can
 * run at half another's at the same moment (docs/performance.md); the faster core then takes the slower one's last
 * items. Items are taken one at a time with a compare-and-swap, against microseconds of work each. The shares are
 * laid out before the parallel region, one per thread it may get (team_size_max), so that no thread waits for the
 * others to start: a share whose thread the region did not get is taken by the others. */
typedef struct __attribute__((aligned(64))) {
    uint64_t range;
} item_share;

/* Sets share `s` to the items [front, back). */
static inline void share_set(item_share *shares, int s, int64_t front, int64_t back) {
    shares[s].range = (uint64_t)front << 32 | (uint64_t)back;
}

/* `items` items split into `threads` contiguous shares in thread order (share_set for each). */
static inline void shares_split(item_share *shares, int threads, int64_t items) {
    for (int s = 0; s < threads; s++) share_set(shares, s, items * s / threads, items * (s + 1) / threads);
}

/* Thread `me`'s next item of `threads` shares: the front of its own, else the back of the next share with items
 * left; -1 when every item is taken. *owner: the share it came from (`me` unless taken from another's). */
static inline int64_t share_next(item_share *shares, int threads, int me, int *owner) {
    for (int i = 0; i < threads; i++) {
        const int s = (me + i) % threads;
        uint64_t range = __atomic_load_n(&shares[s].range, __ATOMIC_RELAXED);
        for (;;) {
            const uint64_t front = range >> 32, back = range & 0xffffffffu;
            if (front >= back) break;
            const uint64_t taken = i == 0 ? (front + 1) << 32 | back : front << 32 | (back - 1);
            if (__atomic_compare_exchange_n(&shares[s].range, &range, taken, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *owner = s;
                return (int64_t)(i == 0 ? front : back - 1);
            }
        }
    }
    return -1;
}

/* ---- half and bf16 ---------------------------------------------------------------------------------------------- */

/* The float value of an IEEE half (bits h). */
static inline float half_to_float(uint16_t h) {
#if INFER_F16C
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

/* n floats rounded to bfloat16 (ties to even). */
static inline void floats_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if INFER_AVX512
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), bf16x16_from(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* n bfloat16 values as floats (exact). */
static inline __attribute__((always_inline)) void bf16_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if INFER_AVX512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, bf16x16_load(src + i));
#endif
#if INFER_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16x8_load(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

/* ---- reductions ------------------------------------------------------------------------------------------------- */

/* The dot product of n floats: AVX-512's 16 lanes, then AVX2's 8, then one at a time, each part summed apart. */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if INFER_AVX512
    __m512 wide = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) wide = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), wide);
    total = _mm512_reduce_add_ps(wide);
#endif
#if INFER_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total += hsum8(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* What divides a softmax row's weighted sums into its attention output when a sink logit joins the denominator
 * (attention sinks): the sums and their exponentials' `total` are taken against the row's maximum `best`, so it is
 * 1 / (total + exp(sink - best)), computed against the larger of `best` and `sink` so that no exponential
 * overflows. A sink of -INFINITY adds nothing: 1 / total. */
static inline float sink_inverse(float total, float best, float sink) {
    if (!(sink > best)) return 1.0f / (total + expf(sink - best));
    const float shrink = expf(best - sink);
    return shrink / (total * shrink + 1.0f);
}

/* y[i] = exp(x[i] - shift) in place, returns the sum of y (a softmax's numerators and denominator). */
static inline float exp_shifted_sum(float *x, int64_t n, float shift) {
    int64_t i = 0;
    float total = 0.0f;
#if INFER_AVX512
    __m512 wide = _mm512_setzero_ps();
    const __m512 wide_shift = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16) {
        const __m512 y = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), wide_shift));
        _mm512_storeu_ps(x + i, y);
        wide = _mm512_add_ps(wide, y);
    }
    total = _mm512_reduce_add_ps(wide);
#endif
#if INFER_AVX2
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

/* ---- shared between operations ---------------------------------------------------------------------------------- */

/* infer_silu_mul (activation ACT_SILU) or infer_gelu_tanh_mul (ACT_GELU_TANH) into float32 rows or, with
 * `bf16_out`, bf16 ones (rowwise.c): a fused layer's activation, the next bf16 GEMM's input where that rounds it
 * anyway. */
INFER_HIDDEN void gated_mul_rows(const float *gate_up, void *out, int64_t rows, int64_t width, int64_t activation,
                                 int bf16_out);

/* The GEMV's sums for one block of four output rows of a packed weight (gemv.c's layout, stored as `kind`; int8 with
 * the block's `scales`, a scale per `group` weights of a row) and `rows` rows of x (k floats each): sums [rows][4].
 * Single-threaded: for kernels that split a step's blocks over the threads themselves (moe.c). */
INFER_HIDDEN void block_sums(const float *x, int64_t rows, int64_t k, const void *block, const float *scales,
                             int64_t group, int kind, float *sums);

/* GGUF's blocks of 32 as the block kernels hold them (gemv_blocks.c's top comment), for the GEMV and the block GEMM
 * alike: a record's bytes (four weight rows' 32 columns), where its quants start (after d[4] and m[4], or e[4]), an
 * MXFP4 code's unsigned quant 2 FP4 + 12 (a table for byte shuffles), and MXFP4's scale 2^(e - 128) of row i. */
static inline int64_t record_bytes(int kind) {
    return kind == KIND_Q8_0 ? 136 : kind == KIND_Q4_1 ? 80 : kind == KIND_MXFP4 ? 68 : 72;
}

static inline int64_t quants_at(int kind) { return kind == KIND_Q4_1 ? 16 : kind == KIND_MXFP4 ? 4 : 8; }

static inline const uint8_t *mxfp4_quants(void) {
    static const uint8_t quants[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
    return quants;
}

#define MXFP4_OFFSET 12.0f

static inline float mxfp4_scale(const uint8_t *record, int i) { return ldexpf(1.0f, (int)record[i] - 128); }

/* The block GEMVs' parts (gemv_blocks.c, gemv_kquants.c), for kernels that split a weight's groups of four output
 * rows over their threads themselves (moe.c), over Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights: a group's bytes over k
 * inputs; the scales (and as many sums) a row of x takes for a kind (k / 32, or k / 16 for the K-quants' layout);
 * rows of x quantized as that kind's GEMV quantizes them (q [rows, k], dx and s [rows, block_row_scales]); and one
 * group's sums [rows][4] over `rows` such rows, in passes of the GEMV's rows, single-threaded. */
INFER_HIDDEN int64_t block_group_bytes(int64_t k, int64_t kind);
INFER_HIDDEN int64_t block_row_scales(int64_t k, int64_t kind);
INFER_HIDDEN void block_quantize_rows(const float *x, int64_t rows, int64_t k, int64_t kind, int8_t *q, float *dx,
                                      float *s);
INFER_HIDDEN void block_group_sums(const uint8_t *group, int64_t k, const int8_t *xq, const float *dx,
                                   const float *s, int64_t rows, int64_t kind, float *sums);

/* Rows of x in the block GEMM's int8 layout (gemm_blocks.c): q [tiles][k / 4][LANES][4] (LANES the tile's rows),
 * and per row and block of 32 columns dx, s = dx sum(q) and sf = dx sum(q over its first 16 columns)
 * [tiles][k / 32][LANES]; rows past the last zero. */
typedef struct {
    int8_t *q;
    float *dx, *s, *sf;
} int8_tiles;

/* The layout for `rows` rows (whole tiles) of k columns, zeroed, in one allocation from q (free q alone). */
static inline int8_tiles int8_tiles_alloc(int64_t rows, int64_t k) {
    const int64_t scales = rows * (k / 32);
    int8_tiles tiles;
    tiles.q = calloc(rows * k + sizeof(float) * 3 * scales + 64, 1);
    tiles.dx = (float *)(tiles.q + (rows * k + 63) / 64 * 64);
    tiles.s = tiles.dx + scales;
    tiles.sf = tiles.s + scales;
    return tiles;
}

/* The same layout from row `row` (a tile's first) of `tiles` on, rows of k columns. */
static inline int8_tiles int8_tiles_from(const int8_tiles *tiles, int64_t row, int64_t k) {
    return (int8_tiles){tiles->q + row * k, tiles->dx + row * (k / 32), tiles->s + row * (k / 32),
                        tiles->sf + row * (k / 32)};
}

/* The block GEMM's int8 design (gemm_blocks.c) for the same kernels: the rows of x a tile of its layout holds for a
 * kind (0: the design does not take it: a mixed K-quant weight, or any kind in plain C); row `row` of that layout
 * quantized from one row of x as the GEMV quantizes it (the same values); and one group's sums [rows][4] over the
 * `rows` rows from the layout's first tile, `scratch` block_gemm_scratch_bytes(k) bytes (a group's quants unpacked,
 * 4 k bytes, then a K-quant group's scales, 8 floats a block of 32). Single-threaded. */
INFER_HIDDEN int64_t block_gemm_tile_rows(int64_t kind);
static inline int64_t block_gemm_scratch_bytes(int64_t k) { return 5 * k; }
INFER_HIDDEN void block_gemm_quantize_row(const float *x, int64_t k, int64_t row, const int8_tiles *tiles);
INFER_HIDDEN void block_gemm_group_sums(const uint8_t *group, int64_t k, const int8_tiles *tiles, int64_t rows,
                                        int64_t kind, uint8_t *scratch, float *sums);

/* Rows of x up to which K-quant weights keep their GEMV (gemv_kquants.c) rather than the block GEMM's int8 design:
 * there the design's tiles are part empty and its unpacking of each group is shared by few rows. Qwen3-0.6B's
 * projections, one thread (docs/performance.md): on AVX-512 at 12 rows it took 1.12-1.22x the GEMV's time, at 16
 * 0.84-0.99x; on AVX2 (tiles of 8 rows) at 9 rows 1.2-1.4x, at 12 0.97-1.09x, at 16 0.71-0.85x. */
#if INFER_AVX512
#define KQUANT_GEMV_ROWS 16
#else
#define KQUANT_GEMV_ROWS 12
#endif

/* GGUF's K-quant super-blocks of 256 weights as the kernels hold them (gemv_kquants.c's top comment): a record's bytes
 * (one weight row's 256 columns) and where its quants start (after d, dmin and the scales; after d and sc). */
static inline int64_t kquant_record_bytes(int64_t kind) { return kind == KIND_Q6_K ? 210 : 144; }

static inline int64_t kquant_quants_at(int64_t kind) { return kind == KIND_Q6_K ? 18 : 16; }

/* A Q4_K record's 12 bytes of scales as sc[0..7] and m[0..7], a byte each (gemv_kquants.c's top comment): for the
 * K-quant GEMV and the block GEMM's dequantized panels. */
static inline void q4k_scales(const uint8_t *packed, uint64_t *sc, uint64_t *m) {
    const uint64_t nibbles = 0x0F0F0F0F0F0F0F0FULL;
    uint64_t low;
    uint32_t high32;
    memcpy(&low, packed, 8);
    memcpy(&high32, packed + 8, 4);
    const uint64_t high = ((uint64_t)high32 | ((uint64_t)(high32 >> 4) << 32)) & nibbles;  /* byte j: hi(j) */
    *sc = (low & nibbles) | ((high & 0x0303030303030303ULL) << 4);
    *m = ((low >> 4) & nibbles) | ((high & 0x0C0C0C0C0C0C0C0CULL) << 2);
}

/* The unsigned quants of a K-quant record's 64-byte step u (0-3: the weights beside x's bytes 64u .. 64u + 63,
 * gemv_kquants.c's top comment), from its quants' two 64-byte halves and, for Q6_K, its 64 bytes of high bits (the
 * top two bits of each to bits 4-5). */
#if INFER_AVX512 && defined(__AVX512BW__)
static inline __attribute__((always_inline)) __m512i kquant_step_512(__m512i first, __m512i second, __m512i high,
                                                                     int u, int kind) {
    const __m512i packed = u & 1 ? second : first;
    __m512i w = _mm512_and_si512(u < 2 ? packed : _mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
    if (kind == KIND_Q6_K) {
        const __m512i shifted = u == 0   ? _mm512_slli_epi16(high, 4)
                                : u == 1 ? _mm512_slli_epi16(high, 2)
                                : u == 2 ? high
                                         : _mm512_srli_epi16(high, 2);
        w = _mm512_ternarylogic_epi32(w, shifted, _mm512_set1_epi8(0x30), 0xF8);  /* w | (shifted & 0x30) */
    }
    return w;
}
#endif

#if INFER_AVX2
/* The same on AVX2 registers: half h (0, 1) of step u, the weights beside x's bytes 64u + 32h .. 64u + 32h + 31, read
 * from the record's quants. */
static inline __attribute__((always_inline)) __m256i kquant_step_256(const uint8_t *quants, int u, int h, int kind) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(quants + 64 * (u & 1) + 32 * h));
    __m256i w = _mm256_and_si256(u < 2 ? packed : _mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
    if (kind == KIND_Q6_K) {
        const __m256i high = _mm256_loadu_si256((const __m256i *)(quants + 128 + 32 * h));
        const __m256i shifted = u == 0   ? _mm256_slli_epi16(high, 4)
                                : u == 1 ? _mm256_slli_epi16(high, 2)
                                : u == 2 ? high
                                         : _mm256_srli_epi16(high, 2);
        w = _mm256_or_si256(w, _mm256_and_si256(shifted, _mm256_set1_epi8(0x30)));
    }
    return w;
}
#endif

/* infer_linear_blocks for the K-quant kinds (KIND_Q4_K, KIND_Q6_K, KIND_K_MIXED; gemv_kquants.c). */
INFER_HIDDEN void linear_kquants(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind,
                                 const float *bias, float *y, int64_t n_out);
/* The parts above for Q4_K and Q6_K (gemv_kquants.c): dx2 and s [rows, k / 16]. */
INFER_HIDDEN int64_t kquant_group_bytes(int64_t k, int64_t kind);
INFER_HIDDEN void kquant_quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *q, float *dx2, float *s);
INFER_HIDDEN void kquant_group_sums(const uint8_t *group, int64_t k, const int8_t *xq, const float *dx2,
                                    const float *s, int64_t rows, int64_t kind, float *sums);

/* A fused layer's RoPE (rowwise.c): infer_rope over the first num_heads heads of each row, rotating each head's
 * first rotary_dim values by tables of rotary_dim columns (partial rotary where it is less than head_dim); with
 * q_norm and k_norm (both [head_dim], float32; NULL: none) each head RMSNormed over head_dim before its rotation,
 * the first q_heads by q_norm, the rest by k_norm, eps as the layer norms' (Qwen3's and Gemma 3's q/k norms). */
INFER_HIDDEN void rope_layer_heads(float *qkv, const int64_t *positions, const float *cos_table,
                                   const float *sin_table, int64_t tokens, int64_t row_stride, int64_t q_heads,
                                   int64_t num_heads, int64_t head_dim, int64_t rotary_dim, const float *q_norm,
                                   const float *k_norm, float eps);

#endif
