"""Plug-ins for variable-length batches (issue 37) with one real bug each; the ``varlen`` cases must flag them.

``PackedBaseline`` and ``PaddedBaseline`` are correct (a packed batch with a block-diagonal causal document mask; a
padded batch with a key padding mask). Each buggy class changes one line of its baseline. Like a user's class they
take the book's constructor plus ``causal`` and declare ``varlen`` through ``attnbench_capabilities``; the layout is
``varlen_layout``; the setup is ``prepare(x, lengths=...)`` and ``forward(x, lengths=..., prepared=None)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class PackedBaseline(nn.Module):
    """Packed into one sequence ``(1, tokens, d)``; SDPA with a block-diagonal (causal) document mask."""

    attnbench_capabilities = {"varlen": True, "non_causal": True, "dropout": False}
    varlen_layout = "packed"

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True):
        super().__init__()
        self.num_heads, self.causal = num_heads, causal
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def split(self, t):
        b, T, d = t.shape
        return t.view(b, T, self.num_heads, d // self.num_heads).transpose(1, 2)

    def prepare(self, x, lengths=None):
        lengths = lengths or (x.shape[1],)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        allowed = doc[:, None] == doc[None, :]
        return allowed.tril() if self.causal else allowed

    def forward(self, x, lengths=None, prepared=None):
        mask = self.prepare(x, lengths) if prepared is None else prepared
        q, k, v = self.split(self.W_query(x)), self.split(self.W_key(x)), self.split(self.W_value(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(x.device))
        b, h, T, hd = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, T, h * hd))


class LeakyDocumentMask(PackedBaseline):
    """BUG: the first token of each document also sees the last token of the previous one (an off-by-one boundary)."""

    def prepare(self, x, lengths=None):
        allowed = super().prepare(x, lengths).clone()
        start = 0
        for n in (lengths or (x.shape[1],))[:-1]:
            start += n
            allowed[start, start - 1] = True
        return allowed


class PaddedBaseline(PackedBaseline):
    """Padded to the longest ``(batch, longest, d)``; SDPA with a key padding mask (and the causal one)."""

    varlen_layout = "padded"

    def prepare(self, x, lengths=None):
        b, T, _ = x.shape
        lengths = torch.tensor(lengths or (T,) * b)
        allowed = self.real_keys(T, lengths)[:, None, :].expand(b, T, T)  # (b, T, T)
        if self.causal:
            allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
        return allowed[:, None]

    def real_keys(self, T, lengths):
        return torch.arange(T)[None, :] < lengths[:, None]  # (b, T): key j is a real token


class PaddingLeaks(PaddedBaseline):
    """BUG: the key padding mask is dropped (every key position counts), so padding rows leak into the output of
    bidirectional attention (causal attention with right padding happens to hide them)."""

    def real_keys(self, T, lengths):
        return torch.ones(len(lengths), T, dtype=torch.bool)
