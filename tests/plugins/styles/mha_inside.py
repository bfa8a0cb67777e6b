"""Classes built around ``nn.MultiheadAttention``."""

from __future__ import annotations

import torch
from torch import nn


class WrapsTorchMHA(nn.Module):
    """``nn.MultiheadAttention(d_out)`` with a causal mask, followed by its own output projection ``proj``."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.attn = self.make_mha(d_out, num_heads, dropout, qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1))

    def make_mha(self, d_out, num_heads, dropout, qkv_bias):
        return nn.MultiheadAttention(d_out, num_heads, dropout=dropout, bias=qkv_bias, batch_first=True)

    def out(self, context):
        return self.proj(context)

    def forward(self, x):
        T = x.shape[1]
        context, _ = self.attn(x, x, x, attn_mask=self.mask[:T, :T], need_weights=False)  # (b, T, d_out)
        return self.out(context)


class WrapsTorchMHAAddBiasKV(WrapsTorchMHA):
    """Bug: ``add_bias_kv=qkv_bias`` (a learned extra key/value token) where q/k/v biases were meant."""

    def make_mha(self, d_out, num_heads, dropout, qkv_bias):
        return nn.MultiheadAttention(d_out, num_heads, dropout=dropout, bias=qkv_bias, add_bias_kv=qkv_bias,
                                     batch_first=True)


class WrapsTorchMHAUntransposed(WrapsTorchMHA):
    """Bug: the outer projection as ``context @ proj.weight``, untransposed."""

    def out(self, context):
        return context @ self.proj.weight + self.proj.bias


class TorchMHAOnly(nn.Module):
    """Just ``nn.MultiheadAttention(embed_dim, num_heads)`` (its own out_proj) with ``is_causal``."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=True)

    def forward(self, x):
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device, dtype=x.dtype)
        return self.mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
