"""Greedy rows over an int8 copy of the output head, choosing the token the bf16 head would.

A greedy row that asks for nothing but its token (no logprobs, no logit bias, no grammar, no ``min_tokens`` ban) needs
only the index of its largest logit. A step of a few rows reads the whole head for it: Qwen3-0.6B's 151,936 x 1,024
bf16 head is 311 MB, a quarter of what a decode token reads. ``HeadScreen`` keeps an int8 copy of the head (one
scale per row: 156 MB) and multiplies the rows over it on the GEMV; each approximate logit ``a_j`` lies within
``bounds[j] * |x|_1`` of the bf16 head's, where ``bounds[j]`` is the row's largest quantization error (measured, not
assumed) plus the float32 rounding of both sums. Every token whose upper bound reaches the largest lower bound gets
its exact logit from the bf16 head (``CpuKernels.screen_rows``); no other token can be the maximum, so the row's first
maximum is the full head's, up to the float32 rounding that already separates two orders of summation. A row with
too many candidates (its hidden state near zero, a NaN) is left to the full head. On AVX512-VNNI the copy multiplies
each row of x rounded to int16 (``CpuKernels.screen_gemv``: integer dot products, a third of the instructions), and
each bound grows by the row's rounding step times the token's int8 row's L1 norm (``extra``).
"""

from __future__ import annotations

import torch

from infer.kernels.cpu.packing import pack_scales

# A row's candidates past this share of the vocabulary send it to the full head.
MAX_CANDIDATE_SHARE = 1 / 64


class HeadScreen:
    """An int8 copy of a bf16 output head ``head`` (a ``PackedLinear`` on the CPU kernels, holding its weight in
    ``pack_tiles``' or ``pack_weights``' layout) and the bound of each row's error. ``logits`` gives float32 logits
    whose first maximum per row is the full head's; tokens other than the candidates hold approximate logits."""

    def __init__(self, head, kernels, table: torch.Tensor | None = None):
        """``table``: the same bf16 weight as plain rows ``[vocab, hidden]`` (a tied head's embedding table), where
        the candidates' exact logits read 2 KB a token instead of gathering it from the head's packed layout."""
        self.head = head
        self.kernels = kernels
        self.exact = head.tile_weight if head.tile_weight is not None else head.kernel_weight
        if self.exact is None or self.exact.dtype != torch.bfloat16:
            raise ValueError("a head screen needs a bf16 head packed for the CPU kernels")
        vocab, hidden = head.out_features, head.in_features
        if table is not None:
            if table.dtype != torch.bfloat16 or tuple(table.shape) != (vocab, hidden) or not table.is_contiguous():
                raise ValueError(f"a head screen's table must be the head's bf16 rows {(vocab, hidden)}")
            self.exact = table
        # the copy is quantized from the plain rows: the table where there is one, else the head unpacked once
        weight = table if table is not None else head.bf16_weight()
        # Float32 sums of k products err by at most k * 2^-24 of the sum of their magnitudes: for the int8 sum,
        # 127 * scale * |x|_1, for the exact one at most as much (the bf16 weights are within the int8 error of it);
        # each doubled, (k + 16) for headroom over the sums' last adds; the C side adds 0.1% over all of it.
        rounding = 2 * 2 * (hidden + 16) * 2.0**-24 * 127
        quantized, scales, self.bounds, norms = kernels.screen_quantize(weight.contiguous(), rounding)
        if not torch.isfinite(scales).all():
            raise ValueError("a head screen needs finite head weights")
        self.weight = quantized
        self.scales = pack_scales(scales[:, None].contiguous())
        # On AVX512-VNNI the copy multiplies x rounded to int16 (``CpuKernels.screen_gemv``): each bound grows by the
        # row's rounding step times the L1 norm of the token's int8 row.
        self.extra = norms if kernels.screen_vnni else None
        self.cap = max(16, int(vocab * MAX_CANDIDATE_SHARE))
        # Rows it takes at once: the GEMV's one pass over the copy (more rows would read it again per pass, where the
        # full head's GEMM reads the bf16 head once).
        self.max_rows = kernels.pass_rows
        self.vocab, self.hidden = vocab, hidden
        self.nbytes = self.weight.numel() + (self.scales.numel() + self.bounds.numel()) * 4
        self.nbytes += 0 if self.extra is None else self.extra.numel() * 4
        self.rows_screened = 0
        self.rows_to_full_head = 0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of hidden states ``[rows, hidden]`` whose first maximum per row is the
        full head's: the int8 copy's, the candidates' computed exactly; rows the screen cannot settle take the full
        head."""
        x = hidden.float().contiguous()
        rounded = self.kernels.screen_gemv(x, self.weight, self.scales) if self.extra is not None else None
        if rounded is not None:
            (logits, steps), extra = rounded, self.extra
        else:  # x as it is: the bounds need nothing more
            logits, steps, extra = self.kernels.linear(x, self.weight, self.scales, None), None, None
        counts = self.kernels.screen_rows(x, logits, self.bounds, self.exact, self.cap, extra, steps)
        unsettled = (counts < 0).nonzero().flatten()
        self.rows_screened += x.shape[0] - len(unsettled)
        if len(unsettled):
            self.rows_to_full_head += len(unsettled)
            logits[unsettled] = self.head(x.index_select(0, unsettled)).float()
        return logits
