/* The bf16 GEMM over weights laid out by pack_tiles (infer_linear_tiles): on AMX tiles, with AVX512-BF16's dot
 * products, with float32 FMAs over the widened weights, or in plain C (the reference the tests hold the others to).
 *
 * x is rounded to bf16 into a buffer (padded to 32 rows for AMX). Each thread takes blocks of 32 output columns (its
 * own share first, in order, then what is left of the others': item_share) and runs every block of rows of x over
 * it: a block's weights (32 k bf16s per column) come from memory once and stay in L2 for the next rows. On AMX (when
 * the OS allows it) 2 x 2 tiles of results per pass; else with AVX512-BF16 (VDPBF16PS reads each B tile row as one
 * register: the same layout) DOT_ROWS rows per pass. With `fma` (AVX-512 builds) x stays float32 and the products
 * are float32 FMAs over the widened weights instead (block_fma_bf16), for CPUs where those outrun the bf16 dot
 * products. Rows of x go in chunks of TILE_CHUNK_ROWS, which stay in L2 while
 * every block of weights passes over them (a 2048-row prefill over all rows at once read x from L3 on AMX: 1016 vs
 * 596 ms for four 512-token prompts). */
#include "common.h"
#include "tiles.h"

#define TILE_CHUNK_ROWS 256

/* Stores a 16 x 16 float tile of results (`stride` floats apart) at rows m, columns n of y: the rows below
 * `rows`, plus bias, as float32 or bf16. */
static void store_tile(const float *tile, int64_t stride, int64_t m, int64_t rows, int64_t n, const float *bias,
                       void *y, int64_t n_out, int y_bf16) {
#if INFER_AVX512
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

/* The share of k-tile t (of k / 32) of a pass's slice of the next block's weights (the tile kernels' `ahead`,
 * ahead_bytes of it): its lines requested into L2, spread evenly over the pass. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *ahead, int64_t ahead_bytes, int64_t k,
                                                                 int64_t t) {
    const int64_t step = (ahead_bytes / 64 + k / 32 - 1) / (k / 32);
    for (int64_t line = t * step; line < (t + 1) * step && line * 64 < ahead_bytes; line++)
        __builtin_prefetch(ahead + line * 64, 0, 2);  /* into L2 (prefetcht1) */
}

/* After a chunk of `chunks` (index c): the team meets before the next chunk (every block of this one run), and where
 * a chunk after that follows, thread 0 lays out `round`, this chunk's shares, again for it, while the others go on
 * to the next chunk's (the other round); they meet at the next chunk's end before it begins. */
static inline void next_round(item_share *round, int threads, int64_t blocks, int64_t c, int64_t chunks) {
    if (c + 1 >= chunks) return;
#pragma omp barrier
    if (c + 2 < chunks && team_member() == 0) shares_split(round, threads, blocks);
}

/* ---- AMX -------------------------------------------------------------------------------------------------------- */

#if INFER_AMX
/* Over xb (bf16, `padded` rows in tiles_of_rows' layout): each thread takes blocks of 32 output columns, 2 x 2 tiles
 * of results per pass. A block's first pass reads its weights from memory and every later pass (32 rows each) from
 * L2, so with more than 32 rows the passes over L2 would leave memory idle: every pass asks for a slice of the next
 * block's weights into L2 (prefetch_ahead, as tiles_avx512), and the block's first pass finds them there too. Over
 * cold weights of Qwen3-0.6B's projections (1 thread) that takes 1.1-1.4x less time at 16-128 rows than leaving the
 * streaming to the hardware's prefetchers, and a 64-sequence decode step of that model 1.23x less (219.6 -> 178.9
 * ms). A thread that takes another's blocks from the back prefetches the block before the one it runs. */
static void tiles_amx(const uint16_t *xb, int64_t rows, int64_t padded, int64_t k, const uint16_t *w,
                      const float *bias, void *y, int y_bf16, int64_t n_out) {
    const int64_t k_tiles = k / 32, blocks = n_out / 32, block_bytes = k_tiles * 2048;
    const int threads = team_size_max();
    item_share shares[2 * threads];  /* even chunks' and odd chunks' */
    shares_split(shares, threads, blocks);
    shares_split(shares + threads, threads, blocks);
#pragma omp parallel
    {
        const int me = team_member();
        load_full_tiles();
        float results[4][16][16];
        for (int64_t chunk = 0, c = 0; chunk < padded; chunk += TILE_CHUNK_ROWS, c++) {
            const int64_t chunk_end = chunk + TILE_CHUNK_ROWS < padded ? chunk + TILE_CHUNK_ROWS : padded;
            const int64_t passes = (chunk_end - chunk) / 32, slice = (block_bytes / passes + 63) / 64 * 64;
            item_share *round = shares + c % 2 * threads;
            int owner;
            for (int64_t b; (b = share_next(round, threads, me, &owner)) >= 0;) {
                const uint16_t *wb = w + b * k_tiles * 1024;
                /* the block this thread likely takes next, whose weights its passes ask for */
                const int64_t n = b * 32, after = owner != me ? b - 1 : b + 1;
                const char *next = after >= 0 && after < blocks ? (const char *)(w + after * k_tiles * 1024) : NULL;
                for (int64_t m = chunk, i = 0; m < chunk_end; m += 32, i++) {
                    const int64_t from = i * slice;
                    const int64_t bytes = next && from < block_bytes ?
                                          (block_bytes - from < slice ? block_bytes - from : slice) : 0;
                    const char *ahead = next ? next + from : NULL;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    const uint16_t *x0 = xb + m * k, *x1 = x0 + 16 * k;  /* tiles_of_rows' layout */
                    for (int64_t t = 0; t < k_tiles; t++) {
                        prefetch_ahead(ahead, bytes, k, t);
                        _tile_loadd(4, x0 + t * 512, 64);
                        _tile_loadd(5, x1 + t * 512, 64);
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
            next_round(round, threads, blocks, c, (padded + TILE_CHUNK_ROWS - 1) / TILE_CHUNK_ROWS);
        }
        _tile_release();
    }
}
#endif

/* ---- AVX-512: AVX512-BF16's dot products, or float32 FMAs ------------------------------------------------------- */

#if INFER_AVX512
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

#if INFER_AVX512_BF16
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

#if INFER_AVX512
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
#if INFER_AVX512_BF16
    const int64_t pass = fma ? FMA_ROWS : DOT_ROWS;
#else
    const int64_t pass = FMA_ROWS;  /* the FMAs are all this build has */
    (void)fma;
#endif
    const int64_t blocks = n_out / 32;
    const int threads = team_size_max();
    item_share shares[2 * threads];  /* even chunks' and odd chunks' */
    shares_split(shares, threads, blocks);
    shares_split(shares + threads, threads, blocks);
#pragma omp parallel
    for (int64_t chunk = 0, c = 0; chunk < rows; chunk += TILE_CHUNK_ROWS, c++) {
        const int64_t chunk_end = chunk + TILE_CHUNK_ROWS < rows ? chunk + TILE_CHUNK_ROWS : rows;
        const int me = team_member();
        item_share *round = shares + c % 2 * threads;
        int owner;
        for (int64_t b; (b = share_next(round, threads, me, &owner)) >= 0;) {
            const uint16_t *wb = w + b * (k / 32) * 1024;
            const float *own_bias = bias ? bias + b * 32 : NULL;
            /* the block this thread likely takes next comes from memory: this block's passes ask for a slice of its
             * weights each, into L2, while this block's are read from there */
            const int64_t block_bytes = (k / 32) * 2048, passes = (chunk_end - chunk + pass - 1) / pass;
            const int64_t slice = (block_bytes / passes + 63) / 64 * 64, after = owner != me ? b - 1 : b + 1;
            const char *next = after >= 0 && after < blocks ? (const char *)(w + after * (k / 32) * 1024) : NULL;
            for (int64_t m = chunk, i = 0; m < chunk_end; m += pass, i++) {
                const int count = (int)(chunk_end - m < pass ? chunk_end - m : pass);
                const int64_t at = m * n_out + b * 32;
                const int64_t from = i * slice, bytes = next && from < block_bytes ?
                                                        (block_bytes - from < slice ? block_bytes - from : slice) : 0;
                const char *ahead = next ? next + from : NULL;
#if INFER_AVX512_BF16
                if (!fma) {
                    pass_dot_bf16((const uint16_t *)x + m * k, k, wb, own_bias, y, at, n_out, y_bf16, ahead, bytes,
                                  count);
                    continue;
                }
#endif
                pass_fma_bf16((const float *)x + m * k, k, wb, own_bias, y, at, n_out, y_bf16, ahead, bytes, count);
            }
        }
        next_round(round, threads, blocks, c, (rows + TILE_CHUNK_ROWS - 1) / TILE_CHUNK_ROWS);
    }
}
#endif

/* ---- plain C ---------------------------------------------------------------------------------------------------- */

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

/* ---- a few rows: the GEMV over the same layout ------------------------------------------------------------------ */

#if INFER_AVX512_BF16
/* gemv_block_fma's sums with VDPBF16PS: x rounded to bf16 (xb), each pair of x broadcast against a 64-byte tile row
 * of 16 columns' pairs, one instruction per row of x and half. */
static inline __attribute__((always_inline)) void gemv_block_dot(const uint16_t *xb, int64_t k, const uint16_t *wb,
                                                                 __m512 (*acc)[2], const int count) {
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k / 32; t++) {
        const uint16_t *tile = wb + t * 1024;
        for (int p = 0; p < 16; p++) {
            tiles_stream_prefetch((const char *)(tile + p * 32));
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
}
#endif

#if INFER_AVX512
/* Up to PASS_ROWS rows over pack_tiles' layout, each block of 32 output columns streamed from memory once for all
 * of them (gemv.c's GEMV over this layout): float32 x with float32 FMAs (`fma`), else x rounded to bf16 (xb) on
 * VDPBF16PS. OpenMP over the blocks, as the GEMV. */
static void tiles_gemv(const float *x, const uint16_t *xb, int fma, int64_t rows, int64_t k, const uint16_t *w,
                       const float *bias, void *y, int y_bf16, int64_t n_out) {
    const int64_t blocks = n_out / 32;
    (void)xb;
#pragma omp parallel for schedule(static) if (rows * n_out * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *wb = w + b * (k / 32) * 1024;
        const float *own_bias = bias ? bias + b * 32 : NULL;
        __m512 acc[PASS_ROWS][2];
        switch (rows) {  /* a constant count per copy: its accumulators stay in registers */
#if INFER_AVX512_BF16
#define GEMV_CASE(c) \
            case c: \
                if (fma) gemv_block_fma(x, k, wb, acc, c); \
                else gemv_block_dot(xb, k, wb, acc, c); \
                break;
#else
#define GEMV_CASE(c) case c: gemv_block_fma(x, k, wb, acc, c); break;
#endif
            GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
#undef GEMV_CASE
        }
        store_block(acc, (int)rows, own_bias, y, b * 32, n_out, y_bf16);
    }
}
#endif

/* ---- the entry -------------------------------------------------------------------------------------------------- */

int64_t infer_tile_kind(void) {
    if (amx_available()) return 2;
#if INFER_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

/* x's rows as the bf16 products read them: NULL where bf16 rows can be read in place, else a buffer (free it) of x
 * rounded to bf16. */
static uint16_t *rows_as_bf16(const void *x, int64_t x_bf16, int64_t rows, int64_t k) {
    uint16_t *copy = x_bf16 ? NULL : malloc(sizeof(uint16_t) * rows * k);
    if (!copy) return NULL;
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < rows; m++) floats_to_bf16((const float *)x + m * k, copy + m * k, k);
    return copy;
}

#if INFER_AMX
/* x's rows (float32 or bf16) as AMX loads them: bf16, `padded` rows (the padding zero) in blocks of 16 rows, each
 * block's k tiles one after the other, each tile 16 rows of 32 values: 1 KB, loaded from 16 consecutive lines. Rows
 * read in place lie a power of two apart for most projections (2,048 bytes at k = 1,024), so one tile's rows share
 * few of L1's sets; Qwen3-0.6B's projections over cold weights take 1.00-1.10x less time this way at 32-256 rows
 * (1.22x for gate_up at 256), 1 thread. NULL when out of memory. */
static uint16_t *tiles_of_rows(const void *x, int64_t x_bf16, int64_t rows, int64_t padded, int64_t k) {
    uint16_t *tiles = malloc(sizeof(uint16_t) * padded * k);
    if (!tiles) return NULL;
    const int64_t k_tiles = k / 32;
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < padded; m++) {
        uint16_t *row = tiles + (m / 16) * 16 * k + (m % 16) * 32;
        for (int64_t t = 0; t < k_tiles; t++) {
            uint16_t *to = row + t * 512;
            if (m >= rows)
                memset(to, 0, 64);
            else if (x_bf16)
                memcpy(to, (const uint16_t *)x + m * k + t * 32, 64);
            else
                floats_to_bf16((const float *)x + m * k + t * 32, to, 32);
        }
    }
    return tiles;
}
#endif

void infer_linear_tiles(const void *x, int64_t x_bf16, int64_t rows, int64_t k, const uint16_t *w,
                        const float *bias, void *y, int64_t y_bf16, int64_t n_out, int64_t fma) {
#if INFER_AVX512
    if (rows <= PASS_ROWS && (fma || INFER_AVX512_BF16)) {  /* the GEMV: x as its arithmetic takes it, then once */
        const int convert = !x_bf16 == !fma;  /* bf16 rows for the FMAs or float32 ones for the dot products */
        void *copy = convert ? malloc((fma ? sizeof(float) : sizeof(uint16_t)) * rows * k) : NULL;
        if (copy && fma) bf16_to_floats((const uint16_t *)x, copy, rows * k);
        if (copy && !fma) floats_to_bf16((const float *)x, copy, rows * k);
        if (!convert || copy) {
            tiles_gemv(fma && copy ? copy : x, !fma && copy ? copy : x, (int)fma, rows, k, w, bias, y, (int)y_bf16,
                       n_out);
            free(copy);
            return;
        }
    }
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
#if INFER_AMX
    if (kind == 2) {
        const int64_t padded = (rows + 31) / 32 * 32;  /* 2 x 2 tiles of results: 32 rows a pass */
        uint16_t *tiles = tiles_of_rows(x, x_bf16, rows, padded, k);
        if (tiles) {
            tiles_amx(tiles, rows, padded, k, w, bias, y, (int)y_bf16, n_out);
            free(tiles);
            return;
        }
    }
#endif
    uint16_t *copy = rows_as_bf16(x, x_bf16, rows, k);
    const uint16_t *xb = copy ? copy : (const uint16_t *)x;
#if INFER_AVX512_BF16
    if (kind == 1)
        tiles_avx512(xb, 0, rows, k, w, bias, y, (int)y_bf16, n_out);
    else
#endif
        tiles_portable(xb, rows, k, w, bias, y, (int)y_bf16, n_out);  /* and AMX's when out of memory above */
    free(copy);
}

void infer_unpack_tiles(const uint32_t *tiles, int64_t n_out, int64_t k, uint32_t *out) {
    /* Each block of 32 output rows is a 16 x 16 transpose of bf16 pairs per tile (see pack_tiles): read a tile's
     * rows in order, write 64 bytes into each of its 16 output rows. */
    const int64_t pairs = k / 2, blocks = n_out / 32, spans = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; block++)
        for (int64_t span = 0; span < spans; span++)
            for (int64_t half = 0; half < 2; half++) {
                const uint32_t *tile = tiles + ((block * spans + span) * 2 + half) * 256;
                uint32_t *rows = out + (block * 32 + half * 16) * pairs + span * 16;
                for (int64_t column = 0; column < 16; column++)
                    for (int64_t pair = 0; pair < 16; pair++) rows[column * pairs + pair] = tile[pair * 16 + column];
            }
}
