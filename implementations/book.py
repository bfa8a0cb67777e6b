"""The book's chapter-3 classes ("Build a Large Language Model (From Scratch)", sections 3.5-3.6).

``CausalAttention`` (3.5.3) and ``MultiHeadAttention`` (3.6.2) are kept as the book prints them, with
the book's attribute names, so the book's weight layout needs no adapter and the book's golden
values reproduce. ``ChapterMultiHeadAttentionWrapper`` is listing 3.4 exactly (per-head ``d_out``, no
output projection; output width ``num_heads * d_out``): it computes a different function from the
others and exists for the golden values only. The registered ``wrapper`` is listing 3.4 made
comparable: heads of width ``d_out // num_heads`` plus the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from attnbench.implementations._common import AttentionModule, per_head_adapter
from attnbench.plugins.catalog import register

BOOK = "Raschka, Build a Large Language Model (From Scratch), ch. 3"


class CausalAttention(nn.Module):
    """Single-head causal self-attention (book section 3.5.3)."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)  # (b, T, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)  # (b, T, T)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values  # (b, T, d_out)


class ChapterMultiHeadAttentionWrapper(nn.Module):
    """Listing 3.4 exactly: ``num_heads`` full ``CausalAttention`` modules, concatenated, no projection."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)  # (b, T, num_heads * d_out)


class MultiHeadAttentionWrapper(AttentionModule):
    """Listing 3.4's Python loop over per-head CausalAttention modules, with head_dim heads and out_proj."""

    weight_adapter = per_head_adapter("heads.{i}.W_query", "heads.{i}.W_key", "heads.{i}.W_value",
                                      "out_proj.weight", "out_proj.bias")

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, self.head_dim, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        self.check_input(x)
        context = torch.cat([head(x) for head in self.heads], dim=-1)  # (b, T, d_out)
        return self.out_proj(context)


class MultiHeadAttention(AttentionModule):
    """The book's MultiHeadAttention with weight splits (section 3.6.2), verbatim apart from input checks."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        self.check_input(x)
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)  # (b, T, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)  # (b, T, nh, hd)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.transpose(1, 2)  # (b, nh, T, hd)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, nh, T, T)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)  # (b, T, nh, hd)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)  # (b, T, d_out)
        return self.out_proj(context_vec)


register("wrapper", MultiHeadAttentionWrapper, source=f"{BOOK}, listing 3.4 (+ head_dim heads, out_proj)")
register("weight_split", MultiHeadAttention, source=f"{BOOK}, section 3.6.2")
