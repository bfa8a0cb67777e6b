"""A paged KV cache with one planted bug (issue 37): its block table is read one page late.

``BlockTableOnePageLate`` is ``paged_sdpa`` (``implementations/paged.py``) except that logical page ``j`` of a sequence
is read from entry ``j + 1`` of its block table (the last page from the row's padding). A sequence of one page never
shows it, so the plain decode cases (sequences shorter than the default page of 16 tokens) pass; the paged-decode
case (pages of 3 and 4 tokens, several per sequence, shuffled in the pool) flags it.
"""

from __future__ import annotations

import torch

from attnbench.implementations.paged import PagedSDPA


class BlockTableOnePageLate(PagedSDPA):
    """``paged_sdpa`` reading each sequence's block table one page late."""

    attnbench_capabilities = {"kv_cache": True, "gqa": True, "sliding_window": True, "non_causal": True}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)

    def _block_table(self, device):
        table, first = super()._block_table(device)
        return torch.cat([table[:, 1:], table[:, :1]], dim=1), first  # entry j + 1 read for logical page j
