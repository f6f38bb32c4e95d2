/* Token bitmasks of structured output (infer.guide's layout) applied to the logits in place. */
#include "common.h"

/* Whole words of allowed tokens are skipped and whole forbidden words filled, so a mask costs what it forbids. */
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
