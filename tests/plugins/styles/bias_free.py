"""Layers without any bias (as in LLaMA-style models): wq, wk, wv, wo with bias=False, no dropout argument."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F


class BiasFree(nn.Module):
    """(dim, n_heads, max_seq_len): four bias-free Linears and SDPA; the constructor takes no bias or dropout."""

    def __init__(self, dim, n_heads, max_seq_len=2048):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def out(self, context):
        return self.wo(context)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, nh, T, hd)
        return self.out(context.transpose(1, 2).reshape(b, T, -1))


class BiasFreeUntransposed(BiasFree):
    """Bug: ``context @ wo.weight`` (untransposed)."""

    def out(self, context):
        return context @ self.wo.weight


class BiasFreeRect(nn.Module):
    """(d_in, d_out, num_heads, context_length, dropout): q/k/v and out projections without biases, widths may differ."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.W_q = nn.Linear(d_in, d_out, bias=False)
        self.W_k = nn.Linear(d_in, d_out, bias=False)
        self.W_v = nn.Linear(d_in, d_out, bias=False)
        self.W_o = nn.Linear(d_out, d_out, bias=False)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (w(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.W_o(context.transpose(1, 2).flatten(2))


class BiasFreeRectUntransposed(BiasFreeRect):
    """Bug: values as ``x @ W_v.weight`` (untransposed: runs only when d_in == d_out, and is wrong there)."""

    def forward(self, x):
        b, T, _ = x.shape
        q, k = (w(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for w in (self.W_q, self.W_k))
        v = (x @ self.W_v.weight).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.W_o(context.transpose(1, 2).flatten(2))
