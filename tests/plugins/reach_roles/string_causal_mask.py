"""Causality by a string: ``mask="causal"``; ``None`` means no mask at all.

Reproduces the convention of facebookresearch/lingua ``lingua/transformer.py:Attention`` (commit 437d680): the
constructor takes five plain required values ``(dim, head_dim, n_heads, n_kv_heads, rope_theta)`` (an explicit head
dim); wq/wk/wv/wo without bias; ``forward(x, freq_cis, tok_idx=None, mask=None, attn_impl="sdpa")`` with ``freq_cis``
rotation matrices ``(T_max, head_dim/2, 2, 2)`` sliced to the first T rows, interleaved pairs; ``mask`` the string
``"causal"`` (causal SDPA), a tensor (SDPA's ``attn_mask``: bool True = attend, or additive) or None (NOT causal);
``tok_idx`` the write positions for a cache the caller installs as ``self.kv_cache`` (used only when that attribute
exists, through ``self.kv_cache.update(k, v, tok_idx)``). Our own code, written for attnbench's tests.
"""
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


def turn_by_matrices(x, freq_cis):
    """x (B, T, H, D); freq_cis (T, D/2, 2, 2) rotation matrices applied to interleaved pairs."""
    b, t, h, d = x.shape
    pairs = x.reshape(b, t, h, d // 2, 1, 2)
    return (pairs * freq_cis[None, :, None]).sum(-1).reshape(b, t, h, d)


class StringMaskAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int, n_heads: int, n_kv_heads: int, rope_theta: float):
        super().__init__()
        self.head_dim, self.n_heads, self.n_kv_heads, self.rope_theta = head_dim, n_heads, n_kv_heads, rope_theta
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, freq_cis, tok_idx: Optional[torch.Tensor] = None,
                mask: Optional[Union[str, torch.Tensor]] = None, attn_impl: str = "sdpa"):
        if attn_impl != "sdpa":
            raise NotImplementedError(attn_impl)
        b, t, _ = x.shape
        q = turn_by_matrices(self.wq(x).view(b, t, self.n_heads, self.head_dim), freq_cis[:t])
        k = turn_by_matrices(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), freq_cis[:t])
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        if hasattr(self, "kv_cache"):
            k, v = self.kv_cache.update(k, v, tok_idx)
        rep = self.n_heads // self.n_kv_heads
        q, k, v = q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2)
        is_causal = isinstance(mask, str) and mask == "causal"
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                           attn_mask=mask if isinstance(mask, torch.Tensor) else None)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))
