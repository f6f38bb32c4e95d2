/* infer's CPU kernels: the library's interface, every struct and function the Python side binds through ctypes
 * (infer.kernels.cpu.abi mirrors the structs field by field; tests/test_kernel_abi.py holds the two to each other).
 *
 * The small float32 ops of a step fused into one pass each, linear layers over packed fp16 / bf16 / int8 weights
 * for a few rows, a bf16 GEMM on AMX tiles or AVX512-BF16, a layer's dense parts for a few tokens in two calls,
 * whole stacks of layers and an EAGLE head's draft step in one, paged attention that reads K/V straight from the
 * pool through the block tables (no gather), and flash attention for prefill chunks.
 *
 * Built once per machine by infer.kernels.cpu.builder (gcc -O3 -march=native -fopenmp, every .c file of this folder
 * into one library). Every pointer is to float32 / int64 / int32 / fp16 / bf16 memory owned by torch tensors; the
 * Python side checks shapes, dtypes and contiguity. OpenMP here is torch's own runtime (libgomp is already loaded
 * when this library is), so both share one thread pool. */
#ifndef INFER_CPU_KERNELS_H
#define INFER_CPU_KERNELS_H

#include <stdint.h>

/* How a packed weight is stored (the *_kind fields; abi.WEIGHT_KINDS): IEEE half, bfloat16 (a float's upper half:
 * converting is a shift, exact), or int8 with float scales; or GGUF's blocks (abi.BLOCK_KINDS): of 32 (Q4_0, Q4_1,
 * Q8_0, MXFP4), repacked as gemv_blocks.c describes, or K-quant super-blocks of 256 (one kind, or parts of both), as
 * gemv_kquants.c does. */
enum {
    KIND_F16 = 0, KIND_I8 = 1, KIND_BF16 = 2, KIND_Q4_0 = 3, KIND_Q4_1 = 4, KIND_Q8_0 = 5,
    KIND_Q4_K = 6, KIND_Q6_K = 7, KIND_K_MIXED = 8, KIND_MXFP4 = 9
};

/* A gated MLP's activation (infer_layer's `activation`; abi.ACTIVATIONS): SiLU (SwiGLU) or tanh-approximated GELU
 * (GeGLU). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* ---- what this build runs --------------------------------------------------------------------------------------- */

/* The SIMD the kernels were built with: 512 (AVX-512), 256 (AVX2 with F16C and FMA) or 0 (portable C). */
int64_t infer_simd_width(void);

/* The most rows of x one pass of the GEMV takes: beyond them it streams the weights again. */
int64_t infer_pass_rows(void);

/* How this build multiplies `infer_linear_tiles`: 2 on AMX tiles (built with AMX and allowed by the OS), 1 with
 * AVX512-BF16's dot products, 0 in plain C. */
int64_t infer_tile_kind(void);

/* 2 when this build's infer_flash_attention multiplies on AMX tiles (its bf16 mode; float32 FMAs stay AVX-512), 1
 * when on AVX512-BF16's dot products, 0 when it has none (prefill chunks then stay on torch's). */
int64_t infer_flash_kind(void);

/* ---- linear layers (gemv.c, gemm_tiles.c) ----------------------------------------------------------------------- */

/* y[m, n] = w[n, :] . x[m, :] + bias[n] (no bias when NULL) for `rows` rows of x (k floats each), y [rows, n_out],
 * with w [n_out, k] packed by `infer.kernels.cpu.pack_weights` in blocks of four output rows,
 * [n_out / 4][k / 8][4][8] (n_out % 4 == 0, k % 8 == 0): fp16 weights. Meant for the few rows of a decode or
 * verification step, which stream every weight from memory once. */
void infer_linear_f16(const float *x, int64_t rows, int64_t k, const uint16_t *w, const float *bias, float *y,
                      int64_t n_out);

/* infer_linear_f16 over bfloat16 weights: the bf16 model's own weights, float32 activations and sums. */
void infer_linear_bf16(const float *x, int64_t rows, int64_t k, const uint16_t *w, const float *bias, float *y,
                       int64_t n_out);

/* infer_linear_f16 over int8 weights with `groups` float scales per row, packed by `infer.kernels.cpu.pack_scales`
 * ([n_out / 4][groups][4]; a group is k / groups consecutive weights of a row, a multiple of 8): a bit over half of
 * fp16's bytes. */
void infer_linear_i8(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *scales, int64_t groups,
                     const float *bias, float *y, int64_t n_out);

/* y [rows, n_out] = x [rows, k] . w^T (+ bias) with bf16 weights laid out by `infer.kernels.cpu.pack_tiles` for
 * AMX's TDPBF16PS: per block of 32 output columns and per 32 columns of k, two 1 KB B tiles (16 output columns
 * each), row p holding the pairs (w[n][2p], w[n][2p + 1]) of the tile's 16 n: [n_out / 32][k / 32][2][16][16][2]
 * (n_out % 32 == 0, k % 32 == 0). x is float32, or bf16 when `x_bf16`, rounded to bf16; products accumulate in
 * float32; y is float32, or bf16 (rounded once) when `y_bf16`. With `fma` (AVX-512 builds) x is not rounded: float32
 * FMAs over the widened weights instead. Up to infer_pass_rows() rows (AVX-512 builds, with `fma` or AVX512-BF16) a
 * GEMV streams each block of weights once for all of them, as infer_linear_bf16 does its layout. */
void infer_linear_tiles(const void *x, int64_t x_bf16, int64_t rows, int64_t k, const uint16_t *w,
                        const float *bias, void *y, int64_t y_bf16, int64_t n_out, int64_t fma);

/* The plain bf16 weight [n_out, k] (as pairs: [n_out][k / 2]) that `pack_tiles` laid out as `tiles`, written into
 * `out`: for a bf16 GEMM library's GEMM over many rows, from the one copy a projection keeps. */
void infer_unpack_tiles(const uint32_t *tiles, int64_t n_out, int64_t k, uint32_t *out);

/* y [rows, n_out] = x [rows, k] . w^T (+ bias) for weights kept as GGUF's blocks of 32 (`kind`: KIND_Q4_0, KIND_Q4_1,
 * KIND_Q8_0 or KIND_MXFP4), repacked by `infer.kernels.cpu.blocks.pack_blocks` into groups of four output rows (any
 * n_out; the last group padded), k % 32 == 0, or as K-quant super-blocks (KIND_Q4_K, KIND_Q6_K, KIND_K_MIXED: a
 * row's records in turn, k % 256 == 0): x quantized per block of 32 to int8, integer dot products, float32 sums. The
 * weights are read from memory once whatever the rows. */
void infer_linear_blocks(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind, const float *bias,
                         float *y, int64_t n_out);

/* The most rows of x one pass of infer_linear_blocks takes over a group of weights while in registers. */
int64_t infer_block_pass_rows(void);

/* infer_linear_blocks' product for steps of many rows (gemm_blocks.c): `design` 2 multiplies on AMX's bf16 tiles over
 * panels of the weights dequantized to bf16 (x rounded to bf16), 1 with int8 dot products over x quantized as the
 * GEMV quantizes it (the GEMV's arithmetic, every output a lane of its own), 0 through infer_linear_blocks itself;
 * -1 (or a design this build or machine lacks) takes 1 for up to 16 rows where it runs, else
 * infer_block_gemm_kind(). K-quant weights (KIND_Q4_K, KIND_Q6_K, KIND_K_MIXED) take 2 alike; their 1 is their GEMV.
 * KIND_MXFP4 weights take 0 whatever the design: infer_linear_blocks. */
void infer_gemm_blocks(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind, const float *bias,
                       float *y, int64_t n_out, int64_t design);

/* The design infer_gemm_blocks takes by default here past 16 rows: 2 where AMX runs, else 1 where the build has
 * AVX2 or AVX-512, else 0. */
int64_t infer_block_gemm_kind(void);

/* 1 when infer_gemm_blocks can run `design` in this build on this machine. */
int64_t infer_block_gemm_runs(int64_t design);

/* infer_gemm_blocks over bf16 rows x, writing bf16 rows y (float32 sums rounded once), `design` as there: the AMX
 * design reads and writes them as they are; the others run on x widened to float32. */
void infer_gemm_blocks_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t kind,
                            const float *bias, uint16_t *y, int64_t n_out, int64_t design);

/* A block weight (any kind infer_gemm_blocks takes but KIND_MXFP4) as plain bf16 rows `out` [n_out, k], the values the
 * AMX design multiplies, for a bf16 GEMM library's GEMM over many rows: 1, or 0 (nothing written) in a build without
 * AMX and AVX512-BF16, or for KIND_MXFP4. */
int64_t infer_dequantize_blocks_bf16(const uint8_t *w, int64_t kind, int64_t n_out, int64_t k, uint16_t *out);

/* Float32 weights w [n_out, k] (k % 32 == 0) quantized as GGUF's KIND_Q4_0, KIND_Q4_1 or KIND_Q8_0 blocks into out,
 * in pack_blocks' layout ([ceil(n_out / 4), k / 32, record bytes]; the last group's missing rows zero blocks): the
 * reference quantizers' bytes. 0 for another kind (out untouched). */
int64_t infer_quantize_blocks(const float *w, int64_t kind, int64_t n_out, int64_t k, uint8_t *out);

/* ---- a mixture of experts (moe.c) ------------------------------------------------------------------------------- */

/* An expert's activation of its gate g and up u (abi.EXPERT_ACTIVATIONS): SwiGLU, silu(g) * u; or gpt-oss's clamped
 * SwiGLU, g clamped to at most `limit`, u to [-limit, limit], then (u + 1) * g * sigmoid(alpha * g). */
enum { ACTIVATION_SILU = 0, ACTIVATION_CLAMPED_SWIGLU = 1 };

/* out[tokens[p]] += weights[p] * down(act(gate(x[tokens[p]]), up(x[tokens[p]]))) for a step's (token, expert)
 * pairs grouped by expert: the e-th of `experts` active experts is expert_ids[e] and takes pairs starts[e] to
 * starts[e + 1] - 1 (starts [experts + 1]). gate_up[i] and down[i] are the addresses of expert i's weights packed as
 * infer_linear_f16 takes them, stored as `kind` (KIND_F16, KIND_BF16 or KIND_I8 with the addresses of their packed
 * scales, `groups` a row, in *_scales; else those are NULL): gate_up [2 * width, hidden], gate's rows first, and
 * down [hidden, width]; gate_up_bias[i] [2 * width] (gate's first) and down_bias[i] [hidden] the addresses of their
 * float32 biases (the tables NULL: none). `activation` and limit, alpha as above. x [.., hidden] and out [.., hidden]
 * float32; out is added to. Each expert's weights are read once for all its tokens (passes of infer_pass_rows
 * rows): meant for a few tokens an expert. */
void infer_moe_experts(const float *x, int64_t hidden, int64_t width, int64_t experts, const int64_t *expert_ids,
                       const int64_t *starts, const int64_t *tokens, const float *weights, const int64_t *gate_up,
                       const int64_t *gate_up_scales, int64_t gate_up_groups, const int64_t *down,
                       const int64_t *down_scales, int64_t down_groups, int64_t kind, const int64_t *gate_up_bias,
                       const int64_t *down_bias, int64_t activation, float limit, float alpha, float *out);

/* infer_moe_experts over bf16 weights laid out by pack_tiles (gate_up[i] [2 * width, hidden], down[i] [hidden, width];
 * hidden and width multiples of 32), for any number of tokens an expert: an expert of at least `tile_rows` tokens
 * multiplies on AMX tiles (its rows and its activations rounded to bf16) where AMX runs, others with float32 FMAs over
 * the widened weights (x not rounded). Every output column summed by one thread, experts in the order given. */
void infer_moe_experts_tiles(const float *x, int64_t hidden, int64_t width, int64_t experts,
                             const int64_t *expert_ids, const int64_t *starts, const int64_t *tokens,
                             const float *weights, const int64_t *gate_up, const int64_t *down,
                             const int64_t *gate_up_bias, const int64_t *down_bias, int64_t activation, float limit,
                             float alpha, int64_t tile_rows, float *out);

/* infer_moe_experts over weights kept as GGUF's blocks (KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, KIND_MXFP4, KIND_Q4_K or
 * KIND_Q6_K: every expert's gate_up of gate_up_kind, its down of down_kind; infer_linear_blocks' layout; hidden and
 * width multiples of 32, of 256 where the kind reading them is a K-quant): each pair's row of x and of the activations
 * quantized per 32 columns as infer_linear_blocks quantizes them, integer dot products per block, each expert's
 * groups of weights read once for all its tokens (passes of infer_block_pass_rows rows): meant for a few tokens an
 * expert. Every output column summed by one thread, experts in the order given. */
void infer_moe_experts_blocks(const float *x, int64_t hidden, int64_t width, int64_t experts,
                              const int64_t *expert_ids, const int64_t *starts, const int64_t *tokens,
                              const float *weights, const int64_t *gate_up, int64_t gate_up_kind,
                              const int64_t *down, int64_t down_kind, const int64_t *gate_up_bias,
                              const int64_t *down_bias, int64_t activation, float limit, float alpha, float *out);

/* ---- row-wise ops (rowwise.c) ----------------------------------------------------------------------------------- */

/* For each of `rows` rows of `dim` floats: if delta (NULL: none), residual += delta (in place); then
 * out = residual * rsqrt(mean(residual^2) + eps) * weight. */
void infer_add_rms_norm(float *residual, const float *delta, float *out, const float *weight, int64_t rows,
                        int64_t dim, float eps);

/* infer_add_rms_norm for any of the large steps' dtypes: delta float32 or bfloat16 (`delta_bf16`: a bf16 GEMM's
 * output, added without a float32 copy), the normed rows float32 or rounded to bfloat16 (`out_bf16`: the next
 * GEMM's input). */
void infer_add_rms_norm_mixed(float *residual, const void *delta, int64_t delta_bf16, void *out, int64_t out_bf16,
                              const float *weight, int64_t rows, int64_t dim, float eps);

/* gate_up: rows x (2 * width), gate first; out: rows x width = silu(gate) * up. */
void infer_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width);

/* infer_silu_mul with GELU's tanh form for SiLU: gelu_tanh(gate) * up (GeGLU's activation). */
void infer_gelu_tanh_mul(const float *gate_up, float *out, int64_t rows, int64_t width);

/* infer_silu_mul over bfloat16 rows (a bf16 GEMM's output) into bfloat16 (the next one's input), computed in
 * float. */
void infer_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width);

/* infer_gelu_tanh_mul over bfloat16 rows into bfloat16, computed in float. */
void infer_gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width);

/* qkv: tokens x row_stride floats, Q heads then K heads (head_dim each) first. Rotates those num_heads heads of
 * every token in place at positions[t], HF's half-split layout over each head's first rotary_dim values (pairs i,
 * i + rotary_dim / 2; the rest pass: partial rotary), with cos / signed-sin tables ([max_positions, rotary_dim],
 * sin's first half negated): x * cos + swap_halves(x) * sin. */
void infer_rope(float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                int64_t tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim, int64_t rotary_dim);

/* infer_rope over a bf16 GEMM's output: out (tokens x width, float32, contiguous) = qkv (bfloat16, the same shape)
 * widened, the first num_heads heads of each row rotated. */
void infer_rope_widen(const uint16_t *qkv, float *out, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t tokens, int64_t width, int64_t num_heads, int64_t head_dim,
                      int64_t rotary_dim);

/* infer_rope with each of the num_heads heads RMSNormed over head_dim before its rotation, in the same pass: the
 * first q_heads by q_norm, the rest by k_norm ([head_dim] float32 each), eps as the layer norms' (Qwen3's and Gemma
 * 3's per-head q/k norms). `from` NULL: qkv rotated in place; else each row of `from` (bfloat16, a bf16 GEMM's
 * output, tokens x row_stride) widened into qkv first. */
void infer_rope_norms(const uint16_t *from, float *qkv, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t tokens, int64_t row_stride, int64_t q_heads, int64_t num_heads,
                      int64_t head_dim, const float *q_norm, const float *k_norm, float eps);

/* Token t's K (width floats at k + t * k_stride) and V (at v + t * v_stride) into the layer's pool
 * kv (2 x num_slots x width; float32, or bfloat16 rounded to nearest when kv_bf16) at slot slots[t]; negative
 * slots are padding and skipped. */
void infer_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *kv,
                    const int64_t *slots, int64_t tokens, int64_t width, int64_t num_slots, int64_t kv_bf16);

/* ---- attention (paged_attention*.c, flash_attention*.c) --------------------------------------------------------- */

/* Query i (of `queries`) is token row r = rows[i] (r = i when rows is NULL): its heads at q + r * q_stride, its
 * result at out + r * num_heads * head_dim. It attends to the first context_lens[i] tokens of sequence
 * seq_of_query[i], read through that sequence's block table row (block_tables + seq * table_stride) from the
 * layer's pool kv (2 x num_blocks x block_size x num_kv_heads x head_dim; float32, or bfloat16 when kv_bf16). With
 * own_keys (NULL: none) and own_keys[i] >= 0, the last of those tokens, its own position, is read from the
 * sequence's token own_keys[i] instead: a leaf of a draft tree, which stands beside the spine's draft at that
 * position while its K/V were written past the spine. With `dots` (a bf16 pool of heads 64, 128 or 256 wide in an
 * AVX512-BF16 build; ignored elsewhere) the queries and the probabilities are rounded to bf16 and multiplied on
 * VDPBF16PS, scores, maxima and sums float32 (the flash attention's precision). With a sliding `window` (> 0; 0: none)
 * each query sees only the last `window` of its context's tokens, and blocks wholly before them are not read. With
 * `sinks` (NULL: none; else num_heads floats, -INFINITY for a head without one) head h's sink logit joins its softmax's
 * denominator: its probability mass is taken from every key alike, and it adds no value (gpt-oss's attention sinks).
 * max_context is not read. */
void infer_paged_attention(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *rows, const int64_t *seq_of_query,
                           const int64_t *context_lens, const int64_t *own_keys, float *out, int64_t queries,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t num_blocks, int64_t max_context, float scale, int64_t kv_bf16, int64_t dots,
                           int64_t window, const float *sinks);

/* Causal attention for `count` prefill chunks: chunk i is token rows starts[i] .. starts[i] + query_lens[i] - 1 of
 * q [T, num_heads, head_dim] (float32, rows q_stride apart), positions contexts[i] - query_lens[i] onwards of the
 * sequence whose block table row is tables[i]; each row attends to its own position and every one before, read
 * from the layer's pool kv (float32, or bfloat16 when kv_bf16) into out [T, num_heads, head_dim] (float32). The
 * precision of torch's bf16 flash attention: Q, K, V and the probabilities rounded to bf16, the scores, the softmax
 * and the sums float32; with `fma`, float32 FMAs over the widened K/V instead, Q and the probabilities kept float32.
 * With a sliding `window` (> 0; 0: none) a row sees only its own position and the window - 1 before it, and keys
 * before the window of a chunk's first row are not read. `sinks`: as infer_paged_attention's. head_dim must be a
 * multiple of 64 (the bf16 products on AMX tiles at 64, 128 and 256), and the build must have it
 * (infer_flash_kind() > 0; else this aborts). */
void infer_flash_attention(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *starts, const int64_t *query_lens,
                           const int64_t *contexts, const int64_t *tables, int64_t count, float *out,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t num_blocks, float scale, int64_t kv_bf16, int64_t fma, int64_t window,
                           const float *sinks);

/* ---- a few tokens through layers, attention included (fused.c) -------------------------------------------------- */

/* One layer's projections packed by pack_weights (fp16, bf16, or int8 with scales from pack_scales; see
 * infer_linear_f16 and infer_linear_i8) with their optional float32 biases, its two RMSNorm weights and its
 * shapes (abi.LayerStruct). */
typedef struct {
    const void *qkv, *o, *gate_up, *down;  /* stored as their *_kind says; NULL for bf16 ones with tiles */
    const float *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *input_norm, *post_norm;
    float eps;
    int64_t hidden, qkv_width, q_width, intermediate, rotated_heads, head_dim;
    int64_t qkv_groups, o_groups, gate_up_groups, down_groups;  /* int8: scales per row */
    int64_t qkv_kind, o_kind, gate_up_kind, down_kind;  /* KIND_F16, KIND_I8 or KIND_BF16 */
    /* bf16 only, optional (NULL: none): the weights laid out by pack_tiles, which then take every step (the tile
     * GEMM on AMX or AVX512-BF16; its GEMV for steps of up to one GEMV pass) */
    const uint16_t *qkv_tiles, *o_tiles, *gate_up_tiles, *down_tiles;
    int64_t tiles_fma;  /* the tiles multiply float32 rows with FMAs (infer_linear_tiles' fma) */
    /* Qwen3's and Gemma 3's per-head RMSNorm weights [head_dim], for every Q head and every K head; both or neither
     * (NULL: the Llama layer, none) */
    const float *q_norm, *k_norm;
    /* Gemma 3's output norms (NULL: none): RMSNorm weights [hidden] applied to the output projection's result and
     * to the MLP's before each joins the residual stream */
    const float *attn_out_norm, *mlp_out_norm;
    /* the layer's own RoPE tables [positions, rotary_dim] (Gemma 3's global layers; NULL: the step's) */
    const float *cos_table, *sin_table;
    int64_t rotary_dim;  /* each head rotates its first rotary_dim values, the rest pass (Phi-4-mini's 3/4) */
    int64_t activation;  /* ACT_SILU or ACT_GELU_TANH */
} infer_layer;

/* One step's attention as infer_paged_attention runs it (see there), with the slots its tokens' K/V go to
 * (abi.AttentionStepStruct). */
typedef struct {
    const int32_t *block_tables;
    int64_t table_stride;
    const int64_t *slots, *rows, *seq_of_query, *context_lens;
    int64_t queries, max_context, num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    float scale;
    int64_t kv_bf16;  /* the pool holds bfloat16 */
    const int64_t *own_keys;  /* NULL, or a draft tree's leaves' own K/V (infer_paged_attention's own_keys) */
    int64_t dots;  /* a bf16 pool's queries on AVX512-BF16's dot products (infer_paged_attention's dots) */
    const int64_t *windows;  /* NULL, or each pool layer's sliding window (infer_paged_attention's; 0: none) */
    const float *sinks;  /* NULL, or each pool layer's num_heads sink logits (infer_paged_attention's; -INFINITY:
                          * none), layer after layer */
} infer_attention_step;

/* An EAGLE draft head (plugins/drafters/eagle): RMSNorm weights, its fc [hidden, 2 * hidden] and its
 * draft-vocabulary output [vocab, hidden], packed as their *_kind says (int8: *_groups scales a row;
 * abi.DraftHeadStruct). */
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

/* The layer's first half up to attention for `tokens` tokens: residual += delta (none for the first layer),
 * RMSNorm, the QKV projection into qkv [tokens, qkv_width], each Q and K head's RMSNorm where the layer has q_norm
 * and k_norm (over head_dim, eps the layer's), RoPE on its Q and K heads at `positions` (by the layer's own tables
 * where it has them, else cos_table and sin_table, the step's). */
void infer_layer_attention_input(const infer_layer *layer, int64_t tokens, float *residual, const float *delta,
                                 const int64_t *positions, const float *cos_table, const float *sin_table,
                                 float *qkv);

/* The layer's second half from attention's output [tokens, q_width]: the output projection (RMSNormed by
 * attn_out_norm where the layer has it), residual += it, RMSNorm, gate/up projection, the gated activation, down
 * projection (RMSNormed by mlp_out_norm where the layer has it) into delta [tokens, hidden] (the next norm adds
 * it). */
void infer_layer_feed_forward(const infer_layer *layer, int64_t tokens, const float *attended, float *residual,
                              float *delta);

/* `count` layers over `tokens` tokens in one call, what infer_layer_attention_input, infer_write_kv,
 * infer_paged_attention and infer_layer_feed_forward do one by one from Python: layer l reads and writes the pool
 * at kv + kv_layers[l] * kv_layer_stride (elements of the pool's dtype). `residual` [tokens, hidden] holds the
 * embeddings on entry (the first layer adds nothing) and the residual stream on return; `delta` [tokens, hidden]
 * receives the last layer's output (the final norm adds the two). All layers share the hidden size and the
 * attention shapes; layer l attends with the sliding window step->windows[kv_layers[l]] where step->windows is set. */
void infer_layers_few(const infer_layer *layers, const int64_t *kv_layers, int64_t count, int64_t tokens,
                      float *residual, float *delta, const int64_t *positions, const float *cos_table,
                      const float *sin_table, void *kv, int64_t kv_layer_stride, const infer_attention_step *step);

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
                           float *predicted, int64_t width, int64_t *guesses, float *confidence);

/* ---- token bitmasks, structured output (bitmask.c) -------------------------------------------------------------- */

/* Bitmask row i (words int32 per row; token t allowed when bit t % 32 of word t / 32 is set) masks logits row
 * rows[i] (vocab floats, row_stride apart): forbidden tokens become -inf. */
void infer_apply_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                         const int64_t *rows, int64_t num_rows, int64_t vocab);

/* ---- greedy choice (argmax.c) ----------------------------------------------------------------------------------- */

/* out[r] = the index of the first maximum of logits row r (cols >= 1 floats, rows row_stride apart); a row with a
 * NaN gives its first NaN. */
void infer_argmax_rows(const float *logits, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out);
/* Greedy rows over an int8 copy of the output head: the candidates' logits computed exactly from the bf16 head in
 * place (argmax.c). */
void infer_screen_rows(const float *x, int64_t rows, int64_t k, float *logits, int64_t n, int64_t logits_stride,
                       const float *bounds, const float *extra, const float *steps, const uint16_t *weight,
                       int64_t layout, int64_t cap, int64_t *counts);
/* The screen's int8 copy times x rounded to int16 on AVX512-VNNI (gemv.c): y [rows][n_out] and each row's rounding
 * step; returns 0 (nothing written) in builds without AVX512-VNNI or out of memory. */
int64_t infer_screen_gemv(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *scales, float *y,
                          int64_t n_out, float *steps);
/* Whether infer_screen_gemv runs in this build (1: AVX512-VNNI). */
int64_t infer_screen_vnni(void);
/* The screen's int8 copy of a bf16 head [n][k]: int8 weights in pack_weights' layout, a scale, a bound and the int8
 * row's L1 norm per row. */
void infer_screen_quantize(const uint16_t *w, int64_t n, int64_t k, float rounding, int8_t *q, float *scales,
                           float *bounds, float *norms);

#endif
