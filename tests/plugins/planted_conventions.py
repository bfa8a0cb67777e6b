"""Attention classes in the conventions that localisation used to misname (issue 47, round 11), one planted bug each.

Each bug is a line marked ``# PLANTED`` in the class (or in the per-head module it builds), and
``tests/test_localize.py`` asserts that ``first divergence:`` names that line:

* keys and values swapped where a fused projection is split (``q, v, k = ...split(...)``), and values taken from
  the key projection on a line of their own: each tensor matches the other's stage;
* the score scale applied after the softmax: the unscaled scores are masked and normalised first;
* a rotary module right for the queries and called with an offset for the keys: its own line is right;
* Llama's complex tables conjugated for the queries only: q and k turn opposite ways;
* per-head ``Head`` modules in an ``nn.ModuleList`` (Karpathy's): each tensor has one head's shape;
* a mask filled with ``-1e9`` (raises in float16) and a softmax without its max subtracted (overflows in float16 at
  extreme scores): float16-only failures.

The correct bases (``FusedManual``, ``OwnRotary``, ``ComplexRope``, ``PerHead``) pass ``attnbench check``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class FusedManual(nn.Module):
    """A fused ``qkv`` projection split into thirds (nanoGPT's ``c_attn``), the attention written out."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.register_buffer("keep", torch.ones(context_length, context_length).tril(), persistent=False)

    def project(self, x):
        q, k, v = self.qkv(x).split(self.d_out, dim=2)
        return q, k, v

    def scale(self, att):
        return att / math.sqrt(self.head_dim)

    def softmax(self, att):
        return F.softmax(att, dim=-1)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        att = self.scale(q @ k.transpose(-2, -1))
        att = att.masked_fill(self.keep[:T, :T] == 0, float("-inf"))
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class KVSwappedAtSplit(FusedManual):
    def project(self, x):
        q, v, k = self.qkv(x).split(self.d_out, dim=2)  # PLANTED
        return q, k, v


class ValuesFromKeyProjection(nn.Module):
    """The book's separate projections, the values taken from the key projection."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, T, _ = x.shape
        queries = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_key(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # PLANTED
        scores = (queries @ keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        context = torch.softmax(scores, dim=-1) @ values
        return self.out_proj(context.transpose(1, 2).reshape(b, T, self.d_out))


class ScaleAfterSoftmax(FusedManual):
    def scale(self, att):
        return att

    def softmax(self, att):
        return F.softmax(att, dim=-1) / math.sqrt(self.head_dim)  # PLANTED


class RotaryTables(nn.Module):
    """Rotate-half RoPE with its own tables; ``offset``: the position of the first token."""

    def __init__(self, dim, max_seq_len, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = torch.outer(torch.arange(max_seq_len + 1, dtype=torch.float64), inv_freq)
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def forward(self, x, offset=0):
        T = x.shape[-2]
        cos = self.cos_cached[offset:offset + T].to(x.dtype)
        sin = self.sin_cached[offset:offset + T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class OwnRotary(nn.Module):
    """A class owning its RoPE module, called once for the queries and once for the keys."""

    def __init__(self, dim, n_heads, max_seq_len, rope_theta=10000.0):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.rotary = RotaryTables(self.head_dim, max_seq_len, base=rope_theta)

    def rotate(self, q, k):
        return self.rotary(q), self.rotary(k)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotate(q, k)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, C))


class RotaryKeysOffset(OwnRotary):
    def rotate(self, q, k):
        q = self.rotary(q)
        k = self.rotary(k, offset=1)  # PLANTED
        return q, k


class ComplexRope(nn.Module):
    """Meta Llama's attention: complex ``freqs_cis`` passed to the forward, interleaved pairs."""

    def __init__(self, dim: int, n_heads: int, max_seq_len: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def rotate(self, xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        xq, xk = self.rotate(xq, xk, freqs_cis)
        xq, keys, values = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=x.device), diagonal=1).type_as(xq)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        output = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(xq), values)
        return self.wo(output.transpose(1, 2).reshape(bsz, seqlen, -1))


class QueriesConjugated(ComplexRope):
    def rotate(self, xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * freqs_cis.conj()).flatten(3)  # PLANTED
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


class Head(nn.Module):
    """One head of Karpathy's ``MultiHeadAttention``: its own key, query and value projections."""

    def __init__(self, n_embd, head_size, block_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def weights(self, wei):
        return F.softmax(wei, dim=-1)

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = self.weights(wei.masked_fill(self.tril[:T, :T] == 0, float("-inf")))
        return wei @ self.value(x)


class HeadSoftmaxOverQueries(Head):
    def weights(self, wei):
        return F.softmax(wei, dim=-2)  # PLANTED


class PerHead(nn.Module):
    """Karpathy's per-head ``nn.ModuleList`` of :class:`Head` modules, concatenated and projected."""

    attnbench_capabilities = {"dropout": False}

    head = Head

    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        head_size = n_embd // n_head
        self.heads = nn.ModuleList([self.head(n_embd, head_size, block_size) for _ in range(n_head)])
        self.proj = nn.Linear(head_size * n_head, n_embd)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class PerHeadSoftmaxOverQueries(PerHead):
    head = HeadSoftmaxOverQueries


class PerHeadNoProjection(PerHead):
    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], dim=-1)  # PLANTED


class MaskFilledWithMinusBillion(FusedManual):
    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        att = self.scale(q @ k.transpose(-2, -1))
        att = att.masked_fill(self.keep[:T, :T] == 0, -1e9)  # PLANTED
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class SoftmaxWithoutMax(FusedManual):
    def softmax(self, att):
        return att.exp() / att.exp().sum(dim=-1, keepdim=True)  # PLANTED
