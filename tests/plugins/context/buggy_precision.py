"""Planted bugs that the issue-35 leniencies must not excuse (working precision, a class's own properties).

``Reference`` is correct and computes as the book's chapter-5 classes do: QK-norm (per head, with the spec's epsilon
as ``norm_eps``) normalised in float32 whatever the input, RoPE from tables attnbench supplies, a sliding window it
applies itself, and a KV cache passed in and returned. Each subclass plants one bug behind one of those leniencies.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rotate(x, cos, sin):
    assert x.shape[-1] % 2 == 0, "head dim must be even"
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Reference(nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, norm_eps=1e-6,
                 sliding_window=None):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.head_dim = head_dim or d_in // num_heads
        self.d_out, self.window = num_heads * self.head_dim, sliding_window
        kv = num_kv_groups * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False)
        self.W_key = nn.Linear(d_in, kv, bias=False)
        self.W_value = nn.Linear(d_in, kv, bias=False)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False)
        self.q_norm = RMSNorm(self.head_dim, self.norm_eps(norm_eps)) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, self.norm_eps(norm_eps)) if qk_norm else None

    def norm_eps(self, eps):
        return eps

    def heads(self, t, n):
        b, T, _ = t.shape
        return t.view(b, T, n, self.head_dim).transpose(1, 2)

    def rope(self, q, k, cos, sin, start_pos, cached):
        T = q.shape[2]
        c, s = cos[start_pos:start_pos + T], sin[start_pos:start_pos + T]
        return rotate(q, c, s), rotate(k, c, s)

    def keep(self, T_new, T_total, start_pos, decoding):
        """(T_new, T_total) True = attend: causal, and the last `window` keys when there is a window."""
        i = torch.arange(T_new)[:, None] + start_pos
        j = torch.arange(T_total)[None, :] + (start_pos + T_new - T_total)  # the keys' positions
        ok = j <= i
        return ok & (i - j < self.window) if self.window is not None else ok

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)

    def forward(self, x, cos, sin, start_pos=0, cache=None):
        q = self.heads(self.W_query(x), self.num_heads)
        k = self.heads(self.W_key(x), self.num_kv_groups)
        v = self.heads(self.W_value(x), self.num_kv_groups)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, k, cos, sin, start_pos, cache is not None)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        group = self.num_heads // self.num_kv_groups
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ kk.transpose(2, 3)) / self.head_dim ** 0.5
        keep = self.keep(q.shape[2], kk.shape[2], start_pos, cache is not None)
        w = self.softmax(scores.masked_fill(~keep, float("-inf")))
        b, _, T, _ = q.shape
        return self.out_proj((w @ vv).transpose(1, 2).reshape(b, T, self.d_out)), (k, v)


class SoftmaxInHalf(Reference):
    """Bug: the softmax runs in float16, inside float32 and float64 cases (a downcast below float32 is never excused)."""

    def softmax(self, scores):
        return torch.softmax(scores.half(), dim=-1).to(scores.dtype)


class EpsIgnored(Reference):
    """Bug: takes norm_eps (so it claims the spec's epsilon) but its norms use 1e-2."""

    def norm_eps(self, eps):
        return 1e-2


class KeysRotatedBackwards(Reference):
    """Bug: queries rotated by +theta, keys by -theta (an inconsistent RoPE direction inside one class)."""

    def rope(self, q, k, cos, sin, start_pos, cached):
        T = q.shape[2]
        c, s = cos[start_pos:start_pos + T], sin[start_pos:start_pos + T]
        return rotate(q, c, s), rotate(k, c, -s)


class WindowWiderInDecode(Reference):
    """Bug: a window of N keys in prefill, N + 1 when decoding with a cache."""

    def keep(self, T_new, T_total, start_pos, decoding):
        i = torch.arange(T_new)[:, None] + start_pos
        j = torch.arange(T_total)[None, :] + (start_pos + T_new - T_total)
        width = self.window + 1 if decoding and self.window is not None else self.window
        return (j <= i) & (i - j < width) if width is not None else j <= i


class PartialRotaryMismatch(Reference):
    """Bug: the queries rotate half of each head's dimensions, the keys a quarter."""

    def rope(self, q, k, cos, sin, start_pos, cached):
        T, hd = q.shape[2], q.shape[-1]
        c, s = cos[start_pos:start_pos + T], sin[start_pos:start_pos + T]

        def part(t, n):
            if n < 2 or hd % n:
                return rotate(t, c, s)
            idx = torch.arange(n // 2)
            cols = torch.cat([idx, idx + hd // 2])  # the pairs (j, j + hd/2) for the first n/2 frequencies
            out = t.clone()
            out[..., cols] = rotate(t[..., cols], c[..., cols], s[..., cols])
            return out

        return part(q, hd // 2), part(k, hd // 4)


class CacheOneLate(Reference):
    """Bug (in a class with float32 norms): keys written to the cache are rotated one position late when decoding."""

    def rope(self, q, k, cos, sin, start_pos, cached):
        T = q.shape[2]
        c, s = cos[start_pos:start_pos + T], sin[start_pos:start_pos + T]
        late = start_pos + 1 if cached else start_pos
        return rotate(q, c, s), rotate(k, cos[late:late + T], sin[late:late + T])


class AlwaysNormed(Reference):
    """Correct, OLMo 3 style: QK-norm always on with its own epsilon (5e-6, not an argument), a KV cache."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, sliding_window=None):
        super().__init__(d_in, num_heads, num_kv_groups, head_dim, qk_norm=True, norm_eps=5e-6,
                         sliding_window=sliding_window)


class WindowCountsCurrentApart(Reference):
    """Correct, another convention: ``sliding_window=w`` keeps the current token and the w before it (i - j <= w), in
    prefill and in decode alike; attnbench builds it with w = N - 1 for a spec window of N keys."""

    def keep(self, T_new, T_total, start_pos, decoding):
        i = torch.arange(T_new)[:, None] + start_pos
        j = torch.arange(T_total)[None, :] + (start_pos + T_new - T_total)
        return (j <= i) & (i - j <= self.window) if self.window is not None else j <= i


class WindowApartOnlyInPrefill(WindowCountsCurrentApart):
    """Bug: i - j <= w in prefill, i - j < w when decoding (a convention inconsistent inside one class)."""

    def keep(self, T_new, T_total, start_pos, decoding):
        if not decoding:
            return super().keep(T_new, T_total, start_pos, decoding)
        return Reference.keep(self, T_new, T_total, start_pos, decoding)
