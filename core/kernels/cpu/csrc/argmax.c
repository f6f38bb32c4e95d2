/* Greedy decoding's choice: each logits row's first maximum (infer_argmax_rows). A chat step of 64 sequences over
 * Qwen3's 151,936-token vocabulary scans 39 MB of float32 logits: torch's max over the rows' last dimension took 11.2
 * ms on one thread of an AMX Xeon, the vector scan below 1.5 ms. */
#include "common.h"

/* The first index of row's largest value: a NaN (the first one) ranks above every number, as torch's max. */
static int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t i = 0; i < cols; i++)
        if (row[i] != row[i]) return i;
    return -1;
}

static int64_t argmax_plain(const float *row, int64_t cols) {
    int64_t best = 0;
    for (int64_t i = 1; i < cols; i++) {
        if (row[i] != row[i]) return first_nan(row, cols);
        if (row[i] > row[best]) best = i;
    }
    return row[0] != row[0] ? 0 : best;
}

#if INFER_AVX512
/* 16 lanes, each keeping its first maximum (a strictly larger value replaces it) and where it was, over 4
 * independent sets of lanes (64 columns a pass); then the largest of the lanes' maxima and, among the lanes that
 * hold it, the smallest index: the row's first maximum. A NaN anywhere sends the row to first_nan. Columns past
 * the row's end are read as -inf (masked loads) and never replace a lane's value. */
static int64_t argmax_avx512(const float *row, int64_t cols) {
    const __m512 low = _mm512_set1_ps(-INFINITY);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best[4] = {low, low, low, low};
    __m512i where[4], at[4];
    for (int s = 0; s < 4; s++) where[s] = at[s] = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * s));
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 64 <= cols; i += 64) {
        for (int s = 0; s < 4; s++) {
            const __m512 v = _mm512_loadu_ps(row + i + 16 * s);
            const __mmask16 larger = _mm512_cmp_ps_mask(v, best[s], _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best[s] = _mm512_mask_mov_ps(best[s], larger, v);
            where[s] = _mm512_mask_mov_epi32(where[s], larger, at[s]);
            at[s] = _mm512_add_epi32(at[s], _mm512_set1_epi32(64));
        }
    }
    for (; i < cols; i += 16) {  /* the last columns, 16 at a time, into the first set */
        const __mmask16 inside = cols - i >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(low, inside, row + i);
        const __mmask16 larger = _mm512_cmp_ps_mask(v, best[0], _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best[0] = _mm512_mask_mov_ps(best[0], larger, v);
        where[0] = _mm512_mask_mov_epi32(where[0], larger, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i)));
    }
    if (nan) return first_nan(row, cols);
    const __m512 top = _mm512_max_ps(_mm512_max_ps(best[0], best[1]), _mm512_max_ps(best[2], best[3]));
    const float largest = _mm512_reduce_max_ps(top);
    if (largest == -INFINITY) return 0;  /* every column -inf: the first */
    const __m512 target = _mm512_set1_ps(largest);
    __m512i first = _mm512_set1_epi32(INT32_MAX);
    for (int s = 0; s < 4; s++)
        first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(best[s], target, _CMP_EQ_OQ), first, where[s]);
    return _mm512_reduce_min_epi32(first);
}
#endif

void infer_argmax_rows(const float *logits, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= 64 * PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * row_stride;
#if INFER_AVX512
        out[r] = cols < INT32_MAX ? argmax_avx512(row, cols) : argmax_plain(row, cols);
#else
        out[r] = argmax_plain(row, cols);
#endif
    }
}

/* ---- greedy rows over a screened output head (infer.model.head_screen.HeadScreen) -----------------------------------
 *
 * `logits` holds each row's logits as an int8 copy of the head computes them (a_j, within bounds[j] * |x|_1 of the
 * bf16 head's x . w_j, float32 rounding of both sides included). The token a row's greedy choice can be is one whose
 * upper bound a_j + bounds[j] * |x|_1 reaches the largest lower bound a_i - bounds[i] * |x|_1: the first pass finds
 * that lower bound, the second collects those candidates and the third computes their logits exactly from the bf16
 * head (float32 sums), in place. Every other token's approximate logit stays below its upper bound, below the lower
 * bound, below the exact logit of the token that set it: the row's first maximum is then the full head's. A row
 * with more than `cap` candidates (x near zero, a NaN, a head whose int8 copy is far off) is left approximate with
 * counts[r] = -1, for the caller's full head; else counts[r] is its candidates. Where the copy multiplied x rounded
 * (infer_screen_gemv), each bound grows by extra[j] (the L1 norm of the int8 row w_j as the copy holds it) times
 * steps[r] (how far the rounded row lies from x in any element); steps NULL: x as it is. */

/* a_j's own float32 rounding beyond the bound (the final scale's product): 2^-20 of |a_j|. */
#define SCREEN_RELATIVE 9.5367431640625e-07f

static inline float screen_l1(const float *x, int64_t k) {
    double total = 0.0;
    for (int64_t i = 0; i < k; i++) total += fabs((double)x[i]);
    return (float)(total * (1.0 + 1e-6)); /* rounded up past the double sum's and the conversion's error */
}

/* x . w_j in float32 over the bf16 head: plain rows ([n][k], a tied head's embedding table; layout 2), pack_tiles'
 * layout ([n / 32][k / 32][2][16][16][2]; layout 0) or pack_weights' ([n / 4][k / 8][4][8]; layout 1). */
static float screen_exact(const float *x, int64_t k, const uint16_t *w, int64_t layout, int64_t j) {
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (layout == 2) {
        const uint16_t *wj = w + j * k;
        int64_t i = 0;
#if INFER_AVX512
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (; i + 32 <= k; i += 32)
            for (int s = 0; s < 2; s++)
                acc[s] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16 * s), bf16x16_load(wj + i + 16 * s), acc[s]);
        sums[0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
#endif
        for (; i < k; i++) sums[i & 3] += x[i] * bf16_to_float(wj[i]);
    } else if (layout == 0) {
        const uint16_t *base = w + (j / 32) * (k / 32) * 1024 + ((j % 32) / 16) * 512 + (j % 16) * 2;
        for (int64_t t = 0; t < k / 32; t++)
            for (int p = 0; p < 16; p++) {
                const uint16_t *pair = base + t * 1024 + p * 32;
                const float *xs = x + t * 32 + 2 * p;
                sums[p & 1] += xs[0] * bf16_to_float(pair[0]);
                sums[2 + (p & 1)] += xs[1] * bf16_to_float(pair[1]);
            }
    } else {
        const uint16_t *base = w + (j / 4) * 4 * k + (j % 4) * 8;
        for (int64_t c = 0; c < k / 8; c++)
            for (int e = 0; e < 8; e++) sums[e & 3] += x[c * 8 + e] * bf16_to_float(base[c * 32 + e]);
    }
    return (sums[0] + sums[1]) + (sums[2] + sums[3]);
}

/* The row's largest lower bound a_j - bounds[j] * l1 - extra[j] * step - |a_j| * SCREEN_RELATIVE (-inf where none
 * is a number). */
static float screen_floor(const float *row, const float *bounds, const float *extra, float step, int64_t n,
                          float l1) {
    float floor = -INFINITY;
    int64_t j = 0;
#if INFER_AVX512
    const __m512 scale = _mm512_set1_ps(l1), relative = _mm512_set1_ps(SCREEN_RELATIVE), unit = _mm512_set1_ps(step);
    __m512 best[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
    for (; j + 32 <= n; j += 32)
        for (int s = 0; s < 2; s++) {
            const __m512 a = _mm512_loadu_ps(row + j + 16 * s);
            const __m512 own = _mm512_fmadd_ps(_mm512_loadu_ps(extra + j + 16 * s), unit,
                                               _mm512_mul_ps(_mm512_loadu_ps(bounds + j + 16 * s), scale));
            const __m512 lower = _mm512_fnmadd_ps(_mm512_abs_ps(a), relative, _mm512_sub_ps(a, own));
            best[s] = _mm512_max_ps(lower, best[s]);  /* a NaN lower keeps best */
        }
    floor = _mm512_reduce_max_ps(_mm512_max_ps(best[0], best[1]));
#endif
    for (; j < n; j++) {
        const float lower = row[j] - (bounds[j] * l1 + extra[j] * step) - fabsf(row[j]) * SCREEN_RELATIVE;
        floor = lower > floor ? lower : floor;
    }
    return floor;
}

/* The tokens whose upper bound reaches `floor`, into `out` (room for cap + 16); their count, or -1 past `cap`. */
static int64_t screen_candidates(const float *row, const float *bounds, const float *extra, float step, int64_t n,
                                 float l1, float floor, int64_t cap, int32_t *out) {
    int64_t count = 0, j = 0;
#if INFER_AVX512
    const __m512 scale = _mm512_set1_ps(l1), relative = _mm512_set1_ps(SCREEN_RELATIVE), unit = _mm512_set1_ps(step);
    const __m512 target = _mm512_set1_ps(floor);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= n; j += 16) {
        const __m512 a = _mm512_loadu_ps(row + j);
        const __m512 own = _mm512_fmadd_ps(_mm512_loadu_ps(extra + j), unit,
                                           _mm512_mul_ps(_mm512_loadu_ps(bounds + j), scale));
        const __m512 upper = _mm512_fmadd_ps(_mm512_abs_ps(a), relative, _mm512_add_ps(a, own));
        const __mmask16 reach = _mm512_cmp_ps_mask(upper, target, _CMP_GE_OQ);
        if (reach) {
            _mm512_mask_compressstoreu_epi32(out + count, reach,
                                             _mm512_add_epi32(lanes, _mm512_set1_epi32((int32_t)j)));
            count += __builtin_popcount(reach);
            if (count > cap) return -1;
        }
    }
#endif
    for (; j < n; j++)
        if (row[j] + (bounds[j] * l1 + extra[j] * step) + fabsf(row[j]) * SCREEN_RELATIVE >= floor) {
            out[count++] = (int32_t)j;
            if (count > cap) return -1;
        }
    return count;
}

void infer_screen_rows(const float *x, int64_t rows, int64_t k, float *logits, int64_t n, int64_t logits_stride,
                       const float *bounds, const float *extra, const float *steps, const uint16_t *weight,
                       int64_t layout, int64_t cap, int64_t *counts) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        float *row = logits + r * logits_stride;
        const float l1 = screen_l1(xr, k), step = steps ? steps[r] : 0.0f;
        /* without steps, extra[j] * 0 adds nothing: bounds stands in for the array */
        const float *own_extra = steps ? extra : bounds;
        const float floor = step == step ? screen_floor(row, bounds, own_extra, step, n, l1) : -INFINITY;
        int32_t *found = malloc((size_t)(cap + 16) * sizeof(int32_t));
        const int64_t count = found != NULL && l1 == l1 && floor > -INFINITY
                                  ? screen_candidates(row, bounds, own_extra, step, n, l1, floor, cap, found)
                                  : -1;
        for (int64_t c = 0; c < count; c++) row[found[c]] = screen_exact(xr, k, weight, layout, found[c]);
        counts[r] = count;
        free(found);
    }
}

/* The screen's int8 copy of a bf16 head w [n][k] (row-major): each row's scale (its largest magnitude / 127), its
 * weights rounded to int8 in pack_weights' layout ([n / 4][k / 8][4][8]), its bound: the largest difference
 * between a weight and its int8 value times the scale, plus `rounding` scales (the float32 sums' rounding), times
 * 1.001, and its norm: the L1 norm of its int8 values times the scale, rounded up by 1e-5 (infer_screen_rows'
 * `extra`). The differences are computed in float32: each within 2^-24 of 127 scales of the exact one, far inside the
 * 0.1%. A row holding a NaN or an infinity gets a NaN scale and bound. Rows in parallel. */
void infer_screen_quantize(const uint16_t *w, int64_t n, int64_t k, float rounding, int8_t *q, float *scales,
                           float *bounds, float *norms) {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *row = w + j * k;
        int8_t *block = q + (j / 4) * 4 * k + (j % 4) * 8;
        float largest = 0.0f, error = 0.0f, size = 0.0f;  /* size: the sum of |q| (whole numbers, exact) */
        int finite = 1;
        int64_t i = 0;
#if INFER_AVX512
        __m512 top = _mm512_setzero_ps();
        __mmask16 odd = 0;
        for (; i + 16 <= k; i += 16) {
            const __m512 value = bf16x16_load(row + i);
            odd |= _mm512_fpclass_ps_mask(value, 0x99);  /* NaN or infinity */
            top = _mm512_max_ps(top, _mm512_abs_ps(value));
        }
        largest = _mm512_reduce_max_ps(top);
        finite = odd == 0;
#endif
        for (; i < k; i++) {
            const float magnitude = fabsf(bf16_to_float(row[i]));
            finite &= isfinite(magnitude);
            largest = magnitude > largest ? magnitude : largest;
        }
        if (!finite) {  /* the caller refuses such a head */
            scales[j] = bounds[j] = norms[j] = NAN;
            continue;
        }
        float scale = largest / 127.0f;
        if (!(scale >= 1.17549435e-38f)) scale = 1.17549435e-38f; /* an all-zero row (FLT_MIN, as torch's tiny) */
        i = 0;
#if INFER_AVX512
        const __m512 divisor = _mm512_set1_ps(scale), bound = _mm512_set1_ps(127.0f);
        __m512 worst = _mm512_setzero_ps(), sizes = _mm512_setzero_ps();
        for (; i + 8 <= k; i += 8) {  /* one 8-weight chunk of pack_weights' layout, in the low half */
            const __m512 value = _mm512_castps256_ps512(bf16x8_load(row + i));
            __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(value, divisor), _MM_FROUND_TO_NEAREST_INT);
            rounded = _mm512_max_ps(_mm512_min_ps(rounded, bound), _mm512_sub_ps(_mm512_setzero_ps(), bound));
            _mm_storel_epi64((__m128i *)(block + (i / 8) * 32), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded)));
            const __m512 off = _mm512_abs_ps(_mm512_fnmadd_ps(divisor, rounded, value));
            worst = _mm512_mask_max_ps(worst, 0x00FF, worst, off);
            sizes = _mm512_mask_add_ps(sizes, 0x00FF, sizes, _mm512_abs_ps(rounded));
        }
        error = _mm512_reduce_max_ps(worst);
        size = _mm512_reduce_add_ps(sizes);
#endif
        for (; i < k; i++) {
            const float value = bf16_to_float(row[i]);
            float rounded = nearbyintf(value / scale);
            rounded = rounded > 127.0f ? 127.0f : rounded < -127.0f ? -127.0f : rounded;
            block[(i / 8) * 32 + i % 8] = (int8_t)rounded;
            const float off = fabsf(value - scale * rounded);
            error = off > error ? off : error;
            size += fabsf(rounded);
        }
        scales[j] = scale;
        bounds[j] = (float)(((double)error + rounding * (double)scale) * 1.001);
        norms[j] = (float)((double)size * (double)scale * (1.0 + 1e-5));
    }
}
