"""Attention classes with one planted bug each, at one stage of the computation, for localisation (issue 47).

``Plain`` is a correct causal multi-head attention with one line per stage; each class below it changes one line,
marked ``# PLANTED``, and ``tests/test_localize.py`` asserts that ``first divergence:`` names that line. The forms
real code takes have bases of their own: a fused qkv projection (``Fused``), grouped-query attention (``Grouped``),
RoPE with rotate-half or interleaved pairs and QK-norm (``Rotary``, ``RotaryPairs``), the mask passed in by the
caller (``MaskIn``). Like a user's class, they keep the book's constructor and attribute names (or the names the
binding knows), so canonical weights load without an adapter.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Plain(nn.Module):
    """Correct causal multi-head attention: project, split heads, scores, scale, mask, softmax, mix, merge, project."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("future", torch.ones(context_length, context_length, dtype=torch.bool).triu(1),
                             persistent=False)

    def split(self, t):
        b, T, _ = t.shape
        return t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)

    def project(self, x):
        return self.W_query(x), self.W_key(x), self.W_value(x)

    def scores(self, q, k):
        return q @ k.transpose(-2, -1)

    def scale(self, scores):
        return scores / math.sqrt(self.head_dim)

    def mask(self, scores):
        T = scores.shape[-1]
        return scores.masked_fill(self.future[:T, :T], float("-inf"))

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)

    def mix(self, probs, v):
        return probs @ v

    def merge(self, context):
        b, _, T, _ = context.shape
        return context.transpose(1, 2).reshape(b, T, self.d_out)

    def out(self, merged):
        return self.out_proj(merged)

    def forward(self, x):
        q, k, v = self.project(x)
        q, k, v = self.split(q), self.split(k), self.split(v)
        probs = self.softmax(self.mask(self.scale(self.scores(q, k))))
        return self.out(self.merge(self.mix(probs, v)))


class QProjection(Plain):
    def project(self, x):
        q = self.W_query(x) + 0.5  # PLANTED
        return q, self.W_key(x), self.W_value(x)


class KProjection(Plain):
    def project(self, x):
        k = self.W_key(x) * 1.5  # PLANTED
        return self.W_query(x), k, self.W_value(x)


class VProjection(Plain):
    def project(self, x):
        v = self.W_value(x).flip(-1)  # PLANTED
        return self.W_query(x), self.W_key(x), v


class HeadSplit(Plain):
    def split(self, t):
        b, T, _ = t.shape
        return t.view(b, self.num_heads, T, self.head_dim)  # PLANTED


class RawScores(Plain):
    def scores(self, q, k):
        return q @ q.transpose(-2, -1)  # PLANTED


class ScaledScores(Plain):
    def scale(self, scores):
        return scores / math.sqrt(self.d_out)  # PLANTED


class MaskedScores(Plain):
    def mask(self, scores):
        T = scores.shape[-1]
        return scores.masked_fill(self.future[:T, :T].T, float("-inf"))  # PLANTED


class Probabilities(Plain):
    def softmax(self, scores):
        return torch.softmax(scores, dim=-2)  # PLANTED


class ProbsTimesV(Plain):
    def mix(self, probs, v):
        return probs @ v.flip(2)  # PLANTED


class MergedHeads(Plain):
    def merge(self, context):
        b, _, T, _ = context.shape
        return context.reshape(b, T, self.d_out)  # PLANTED


class OutputProjection(Plain):
    def out(self, merged):
        return self.out_proj(merged) * 2  # PLANTED


class DetachedProbabilities(Plain):
    """Right forward, wrong gradients: no gradient flows back through the softmax."""

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1).detach()  # PLANTED


class ScaleFoldedIntoQ(Plain):
    """The scale folded into q (a correct form), with 1/sqrt(d_out) for 1/sqrt(head_dim)."""

    def project(self, x):
        q = self.W_query(x) * self.d_out ** -0.5  # PLANTED
        return q, self.W_key(x), self.W_value(x)

    def scale(self, scores):
        return scores


class Fused(nn.Module):
    """A fused ``qkv`` projection split by a view (nanoGPT's ``c_attn``), SDPA for the rest."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)

    def split(self, qkv, b, T):
        return qkv.view(b, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = self.split(self.qkv(x), b, T)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, T, -1))


class FusedSplitPerHead(Fused):
    """The fused output read as ``(heads, 3, head_dim)`` (the per-head interleaved layout) though it is ``(3, heads,
    head_dim)``."""

    def split(self, qkv, b, T):
        return qkv.view(b, T, self.num_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)  # PLANTED


class Grouped(nn.Module):
    """Grouped-query attention: kv heads repeated to every query head (repeat_interleave), masked_fill, softmax."""

    attnbench_capabilities = {"gqa": True, "sliding_window": False, "non_causal": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def heads(self, t, n):
        b, T, _ = t.shape
        return t.view(b, T, n, self.head_dim).transpose(1, 2)

    def expand(self, t):
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def forward(self, x):
        b, T, _ = x.shape
        q = self.heads(self.W_query(x), self.num_heads)
        k = self.expand(self.heads(self.W_key(x), self.num_kv_heads))
        v = self.expand(self.heads(self.W_value(x), self.num_kv_heads))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        context = torch.softmax(scores, dim=-1) @ v
        return self.out_proj(context.transpose(1, 2).reshape(b, T, -1))


class GroupedFirstHeadOnly(Grouped):
    def expand(self, t):
        return t[:, :1].expand(-1, self.num_heads, -1, -1)  # PLANTED


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


class Rotary(nn.Module):
    """Llama-style: QK-norm per head (``q_norm``/``k_norm``), RoPE with rotate-half tables, GQA, SDPA."""

    attnbench_capabilities = {"gqa": True, "sliding_window": False, "non_causal": False, "rope": ("half",),
                              "qk_norm": ("head",)}
    pairs = "half"

    def __init__(self, d_in, d_out, context_length, num_heads, num_kv_heads=None, rope_theta=10_000.0, qk_norm=True,
                 norm_eps=1e-6):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.q_proj = nn.Linear(d_in, d_out, bias=False)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d_out, d_out, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        freq = 1.0 / rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.arange(context_length, dtype=torch.float64)[:, None] * freq[None, :]
        angles = torch.cat([angles, angles], -1) if self.pairs == "half" else angles.repeat_interleave(2, -1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def heads(self, t, n):
        b, T, _ = t.shape
        return t.view(b, T, n, self.head_dim).transpose(1, 2)

    def norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)

    def rotate(self, q, k, cos, sin):
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k

    def forward(self, x):
        b, T, _ = x.shape
        q, k = self.heads(self.q_proj(x), self.num_heads), self.heads(self.k_proj(x), self.num_kv_heads)
        v = self.heads(self.v_proj(x), self.num_kv_heads)
        q, k = self.norm(q, k)
        q, k = self.rotate(q, k, self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


class NormedK(Rotary):
    def norm(self, q, k):
        k = self.q_norm(k)  # PLANTED
        return self.q_norm(q), k


class RotatedQ(Rotary):
    def rotate(self, q, k, cos, sin):
        q = q * sin + rotate_half(q) * cos  # PLANTED
        k = k * cos + rotate_half(k) * sin
        return q, k


class RotaryPairs(Rotary):
    """RoPE with interleaved pairs (GPT-J, Meta): dims 2j and 2j+1 turn together."""

    attnbench_capabilities = {**Rotary.attnbench_capabilities, "rope": ("interleaved",)}
    pairs = "interleaved"

    def rotate(self, q, k, cos, sin):
        q = q * cos + rotate_pairs(q) * sin
        k = k * cos + rotate_pairs(k) * sin
        return q, k


class RotatedKPairs(RotaryPairs):
    def rotate(self, q, k, cos, sin):
        q = q * cos + rotate_pairs(q) * sin
        k = k * cos + rotate_pairs(k) * cos  # PLANTED
        return q, k


class MaskIn(nn.Module):
    """The mask passed in by the caller (``forward(x, mask)``, True = hidden, the book's chapter-5 form)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def probs(self, scores, mask):
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)

    def forward(self, x, mask):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for w in (self.W_query, self.W_key, self.W_value))
        probs = self.probs(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), mask)
        return self.out_proj((probs @ v).transpose(1, 2).reshape(b, T, self.d_out))


class HalfSoftmax(MaskIn):
    def probs(self, scores, mask):
        return torch.softmax(scores.masked_fill(mask, float("-inf")).half(), dim=-1).to(scores.dtype)  # PLANTED
