"""Constructors that take the book's arguments in another order, or under other common names.

Each correct class here is followed by a variant with one bug; every variant multiplies by an
``nn.Linear`` weight without transposing it (``x @ W`` where ``W`` is stored (out, in)).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class NotebookOrder(nn.Module):
    """(d_in, d_out, num_heads, context_length, dropout, qkv_bias): the order of many public notebooks."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.num_heads, self.head_dim, self.d_out = num_heads, d_out // num_heads, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def project(self, layer: nn.Linear, x):
        return layer(x)

    def forward(self, x):
        b, T, _ = x.shape
        q = self.project(self.W_query, x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)
        k = self.project(self.W_key, x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.project(self.W_value, x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(2, 3)  # (b, nh, T, T)
        scores.masked_fill_(self.mask.bool()[:T, :T], -torch.inf)
        weights = self.dropout(torch.softmax(scores / math.sqrt(self.head_dim), dim=-1))
        context = (weights @ v).transpose(1, 2).contiguous().view(b, T, self.d_out)  # (b, T, d_out)
        return self.out_proj(context)


class NotebookOrderUntransposed(NotebookOrder):
    """Bug: projects with ``x @ layer.weight`` (the stored (out, in) matrix, untransposed)."""

    def project(self, layer: nn.Linear, x):
        out = x @ layer.weight
        return out if layer.bias is None else out + layer.bias


class KeywordsAnyOrder(nn.Module):
    """Keyword-only arguments with model-zoo names: (*, n_heads, d_model, max_seq_len, p, use_bias)."""

    def __init__(self, *, n_heads, d_model, max_seq_len=1024, p=0.0, use_bias=True):
        super().__init__()
        self.n_heads, self.p = n_heads, p
        self.q_proj = nn.Linear(d_model, d_model, bias=use_bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=use_bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=use_bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=use_bias)

    def heads(self, t):
        return t.unflatten(-1, (self.n_heads, -1)).transpose(1, 2)  # (b, nh, T, hd)

    def output(self, context):
        return self.o_proj(context)

    def forward(self, x):
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.output(context.transpose(1, 2).flatten(2))  # (b, T, d_model)


class KeywordsAnyOrderUntransposed(KeywordsAnyOrder):
    """Bug: the output projection multiplies by o_proj.weight untransposed (square, so it runs)."""

    def output(self, context):
        out = context @ self.o_proj.weight
        return out if self.o_proj.bias is None else out + self.o_proj.bias


class HuggingFaceNames(nn.Module):
    """Hugging Face argument names: (hidden_size, num_attention_heads, attention_dropout, max_position_embeddings)."""

    def __init__(self, hidden_size, num_attention_heads, attention_dropout=0.0, max_position_embeddings=2048,
                 attention_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_attention_heads, hidden_size // num_attention_heads
        self.attention_dropout = attention_dropout
        self.query = nn.Linear(hidden_size, hidden_size, bias=attention_bias)
        self.key = nn.Linear(hidden_size, hidden_size, bias=attention_bias)
        self.value = nn.Linear(hidden_size, hidden_size, bias=attention_bias)
        self.dense = nn.Linear(hidden_size, hidden_size)
        causal = torch.tril(torch.ones(max_position_embeddings, max_position_embeddings, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x):
        b, T, _ = x.shape
        shape = (b, T, self.num_heads, self.head_dim)
        q = self.query(x).view(shape).permute(0, 2, 1, 3)  # (b, nh, T, hd)
        k = self.key(x).view(shape).permute(0, 2, 3, 1)  # (b, nh, hd, T)
        v = self.value(x).view(shape).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k) * self.head_dim ** -0.5  # (b, nh, T, T)
        scores = torch.where(self.causal[:T, :T], scores, torch.finfo(scores.dtype).min)
        probs = F.dropout(scores.softmax(-1), self.attention_dropout, self.training)
        return self.dense(torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, T, -1))


def make_attention(spec):
    """A factory: ``--impl argument_order.py:make_attention`` builds whatever it likes from the spec."""
    return NotebookOrder(spec.d_in, spec.d_out, spec.num_heads, spec.context_length, spec.dropout, spec.qkv_bias)


class ReturnsOutputAndWeights(NotebookOrder):
    """Returns ``(output, None)`` as Hugging Face attention modules do; attnbench reads the first element."""

    def forward(self, x):
        return super().forward(x), None
