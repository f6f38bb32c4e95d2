/* The tile GEMV's float32 product over pack_tiles' layout (gemm_tiles.c's GEMV, and moe.c's experts of a few
 * tokens): the weight stream's prefetch and one block of 32 output columns for a few rows. Include after common.h. */
#ifndef INFER_TILES_H
#define INFER_TILES_H

#include "common.h"

#if INFER_AVX512
/* Software prefetch of the GEMV's weight stream, as gemv.c's: each thread reads its blocks of 32 columns in order,
 * one sequential stream, the two 1 KB halves of a k tile side by side; `line` (the first half's 64 bytes at a pair
 * of k) is asked for 2 KB (the next k tile) ahead into L1 and INFER_GEMV_L2_AHEAD further into L2. */
#ifndef INFER_GEMV_L2_AHEAD
#define INFER_GEMV_L2_AHEAD 6144
#endif
static inline __attribute__((always_inline)) void tiles_stream_prefetch(const char *line) {
    __builtin_prefetch(line + 2048, 0, 3);
    __builtin_prefetch(line + 3072, 0, 3);
#if INFER_GEMV_L2_AHEAD
    __builtin_prefetch(line + 2048 + INFER_GEMV_L2_AHEAD, 0, 2);
    __builtin_prefetch(line + 3072 + INFER_GEMV_L2_AHEAD, 0, 2);
#endif
}

/* acc[r] = rows 0..count-1 of x (float32, k each) times one block of 32 output columns (both 16-column halves):
 * each 64-byte tile row widened to its even and odd k (widen_pairs), two float32 FMAs per row of x with x[2p] and
 * x[2p + 1] broadcast. Every output is a lane of its own: no horizontal sums. */
static inline __attribute__((always_inline)) void gemv_block_fma(const float *x, int64_t k, const uint16_t *wb,
                                                                 __m512 (*acc)[2], const int count) {
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k / 32; t++) {
        const uint16_t *tile = wb + t * 1024;
        for (int p = 0; p < 16; p++) {
            tiles_stream_prefetch((const char *)(tile + p * 32));
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
}
#endif

#endif
