"""FlexAttention with a causal block mask (``torch.nn.attention.flex_attention``).

Run eagerly, FlexAttention materialises the score matrix (PyTorch warns about it; the warning is
silenced here because the benchmark measures exactly that). ``compiled:flex`` gives the fused kernel.
FlexAttention has no attention dropout, so this implementation declares ``dropout=False``; its
backward has no CPU kernel (torch 2.13), so backward is declared for CUDA only.
"""

from __future__ import annotations

import warnings

import torch

from attnbench.implementations._common import AttentionModule, add_book_projections, merge_heads, split_heads
from attnbench.plugins.catalog import register

warnings.filterwarnings("ignore", message=r"flex_attention called without torch.compile")


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex_available(device: torch.device) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:
        return f"FlexAttention not in this torch build ({exc})"
    return None


class FlexAttention(AttentionModule):
    """Book projections + flex_attention with a causal BlockMask (cached per length and device)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        add_book_projections(self, d_in, d_out, qkv_bias)
        self._block_masks: dict = {}

    def _block_mask(self, T: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (T, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(_causal, None, None, T, T, device=device)
        return self._block_masks[key]

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        self.check_input(x)
        q = split_heads(self.W_query(x), self.num_heads)  # (b, nh, T, hd)
        k = split_heads(self.W_key(x), self.num_heads)
        v = split_heads(self.W_value(x), self.num_heads)
        context = flex_attention(q, k, v, block_mask=self._block_mask(x.shape[1], x.device))  # (b, nh, T, hd)
        return self.out_proj(merge_heads(context))


register("flex", FlexAttention, source="torch.nn.attention.flex_attention (causal create_block_mask)",
         dropout=False, backward=("cuda",), min_torch="2.5", probe=_flex_available)
