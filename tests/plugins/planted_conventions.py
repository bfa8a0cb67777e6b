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
from torch.overrides import handle_torch_function, has_torch_function


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


# --- round 12: the conventions a second unseen set found misnamed (docs/localize.md) -----------------------------


class GroupedSteps(nn.Module):
    """Grouped-query attention written out, keys and values expanded to every query head on lines of their own."""

    attnbench_capabilities = {"gqa": True, "dropout": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.nkv = num_kv_heads or num_heads
        self.wq = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.wk = nn.Linear(d_in, self.nkv * self.hd, bias=qkv_bias)
        self.wv = nn.Linear(d_in, self.nkv * self.hd, bias=qkv_bias)
        self.wo = nn.Linear(d_out, d_out)

    def expand(self, k, v):
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        return k, v

    def forward(self, x):
        b, T, _ = x.shape
        q = self.wq(x).view(b, T, self.nh, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, T, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, T, self.nkv, self.hd).transpose(1, 2)
        k, v = self.expand(k, v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, T, -1))


class ValuesTiledKeysInterleaved(GroupedSteps):
    def expand(self, k, v):
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat(1, rep, 1, 1)  # PLANTED
        return k, v


class FusedSDPA(nn.Module):
    """nanoGPT's fused ``c_attn`` and SDPA, the heads merged and projected on lines of their own."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.nh, self.hd, self.d_out = num_heads, d_out // num_heads, d_out
        self.c_attn = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.c_proj = nn.Linear(d_out, d_out)

    def attend(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.nh, self.hd).transpose(1, 2) for t in self.c_attn(x).split(self.d_out, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, self.d_out)

    def forward(self, x):
        y = self.attend(x)
        y = self.c_proj(y)
        return y


class OutputProjectionLeftOut(FusedSDPA):
    def forward(self, x):
        y = self.attend(x)
        return y  # PLANTED


class KeysScaledToo(FusedManual):
    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        k = k / math.sqrt(self.head_dim)  # PLANTED
        att = self.scale(q @ k.transpose(-2, -1))
        att = att.masked_fill(self.keep[:T, :T] == 0, float("-inf"))
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class HalfRotaryHelper(nn.Module):
    """Hugging Face's ``rotate_half`` tables applied by one helper to the queries and the keys."""

    attnbench_capabilities = {"dropout": False, "gqa": True}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, rope_theta=None,
                 num_kv_heads=None):
        super().__init__()
        self.nh, self.hd, self.theta = num_heads, d_out // num_heads, rope_theta
        self.nkv = num_kv_heads or num_heads
        self.q_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.k_proj = nn.Linear(d_in, self.nkv * self.hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d_in, self.nkv * self.hd, bias=qkv_bias)
        self.o_proj = nn.Linear(d_out, d_out)
        if rope_theta is not None:
            inv = 1.0 / rope_theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
            angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv).repeat(1, 2)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rotary(self, q, k, cos, sin):
        q_out = q * cos + self.rotate_half(q) * sin
        k_out = k * cos + self.rotate_half(k) * sin
        return q_out, k_out

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (p(x).view(b, T, -1, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.theta is not None:
            q, k = self.rotary(q, k, self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nkv != self.nh)
        return self.o_proj(y.transpose(1, 2).reshape(b, T, -1))


class KeysTurnedBack(HalfRotaryHelper):
    def rotary(self, q, k, cos, sin):
        q_out = q * cos + self.rotate_half(q) * sin
        k_out = k * cos - self.rotate_half(k) * sin  # PLANTED
        return q_out, k_out


class KeysTurnedBackAnyForm(KeysTurnedBack):
    """The same bug in a class that declares every RoPE form: its interleaved case checks a form it does not have."""

    attnbench_capabilities = {"dropout": False, "gqa": True, "rope": True}


class CappedSteps(nn.Module):
    """A soft-cap written in steps (Gemma 2's ``/ cap``, ``tanh``, ``* cap``), over an einsum."""

    attnbench_capabilities = {"dropout": False, "softcap": True}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, softcap=None):
        super().__init__()
        self.nh, self.hd, self.cap = num_heads, d_out // num_heads, softcap
        self.Wqkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out = nn.Linear(d_out, d_out)

    def capped(self, logits):
        logits = logits / self.cap
        logits = logits.tanh() * self.cap
        return logits

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.unflatten(-1, (self.nh, self.hd)).transpose(1, 2) for t in self.Wqkv(x).chunk(3, dim=-1))
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.hd)
        if self.cap is not None:
            logits = self.capped(logits)
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return self.out(torch.einsum("bhqk,bhkd->bhqd", logits.softmax(-1), v).transpose(1, 2).flatten(2))


class CapLeftOut(CappedSteps):
    def capped(self, logits):
        logits = logits / self.cap
        logits = logits.tanh()  # PLANTED
        return logits


class BufferMaskShifted(FusedManual):
    """The keep-mask buffer built with the diagonal one too high: every query also sees the next token."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.register_buffer("keep", torch.ones(context_length, context_length).tril(1), persistent=False)  # PLANTED


class SliceFromTheEnd(FusedManual):
    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        att = self.scale(q @ k.transpose(-2, -1))
        keep = self.keep[-T:, :T]  # PLANTED
        att = att.masked_fill(keep == 0, float("-inf"))
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class AdditiveMaskDiagonalHidden(FusedSDPA):
    def attend(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.nh, self.hd).transpose(1, 2) for t in self.c_attn(x).split(self.d_out, dim=2))
        bias = torch.full((T, T), float("-inf"), dtype=x.dtype)
        bias = torch.triu(bias, diagonal=0)  # PLANTED
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return y.transpose(1, 2).contiguous().view(B, T, self.d_out)


class ScaledLateByWidth(FusedManual):
    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        att = (q @ k.transpose(-2, -1)).masked_fill(self.keep[:T, :T] == 0, float("-inf"))
        y = torch.softmax(att / math.sqrt(self.d_out), dim=-1) @ v  # PLANTED
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class ManualSoftmax(torch.autograd.Function):
    """A softmax with a hand-written backward (right)."""

    @staticmethod
    def forward(ctx, scores):
        probs = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        inner = (grad * probs).sum(dim=-1, keepdim=True)
        return probs * (grad - inner)


class ManualSoftmaxNoInner(ManualSoftmax):
    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        out = probs * grad  # PLANTED
        return out


class OwnSoftmaxGrad(FusedManual):
    """The attention written out, its softmax an ``autograd.Function`` of its own."""

    function = ManualSoftmax

    def softmax(self, att):
        return self.function.apply(att)


class OwnSoftmaxGradWrong(OwnSoftmaxGrad):
    function = ManualSoftmaxNoInner


class KeysLeftUnrotated(ComplexRope):
    def rotate(self, xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_).flatten(3)  # PLANTED
        return xq_out.type_as(xq), xk_out.type_as(xk)


class RotateHalfReflected(HalfRotaryHelper):
    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x2, x1), dim=-1)  # PLANTED


class CosineTableInterleaved(HalfRotaryHelper):
    """Its cosine table built for interleaved pairs, its sine table for halves: both sides turn wrong alike."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, rope_theta=None,
                 num_kv_heads=None):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, rope_theta, num_kv_heads)
        if rope_theta is not None:
            inv = 1.0 / rope_theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
            angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv)
            self.register_buffer("cos", angles.repeat_interleave(2, dim=-1).cos(), persistent=False)  # PLANTED


class QueriesPairedByHalves(ComplexRope):
    def rotate(self, xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().unflatten(-1, (2, -1)).transpose(-1, -2).contiguous())  # PLANTED
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


class MaskMadeThenRegistered(FusedManual):
    """The mask made in a local name, then registered (the name's line is where the pattern is)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        keep = torch.ones(context_length, context_length).tril(-1)  # PLANTED
        self.register_buffer("keep", keep, persistent=False)


class QueriesScaledForSDPA(FusedSDPA):
    def attend(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.nh, self.hd).transpose(1, 2) for t in self.c_attn(x).split(self.d_out, dim=2))
        q = q * self.hd ** -0.5  # PLANTED
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, self.d_out)


class SDPANotCausal(FusedSDPA):
    def attend(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.nh, self.hd).transpose(1, 2) for t in self.c_attn(x).split(self.d_out, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=None,
            is_causal=False,  # PLANTED
        )
        return y.transpose(1, 2).contiguous().view(B, T, self.d_out)


class ScaleAttributeByWidth(FusedManual):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.scaling = float(d_out) ** -0.5  # PLANTED

    def scale(self, att):
        return att * self.scaling


class RotatedKeysDropped(ComplexRope):
    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        xq, _ = self.rotate(xq, xk, freqs_cis)  # PLANTED
        xq, keys, values = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=x.device), diagonal=1).type_as(xq)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        output = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(xq), values)
        return self.wo(output.transpose(1, 2).reshape(bsz, seqlen, -1))


# --- round 13: what the fourth planted set's development half (/work/planted47e) found ------------------------------

class StableSoftmaxOverHeads(FusedManual):
    """A softmax written out with its max subtracted (``s - s.amax(-1)``, ``exp``): the shift and the exponential are
    right for the normalisation after them; the normalisation sums over the heads."""

    def softmax(self, att):
        shifted = att - att.amax(dim=-1, keepdim=True)
        e = torch.exp(shifted)
        return e / e.sum(dim=1, keepdim=True)  # PLANTED


class FusedBiasLeftOut(FusedManual):
    def project(self, x):
        q, k, v = F.linear(x, self.qkv.weight).split(self.d_out, dim=2)  # PLANTED
        return q, k, v


class QScaledFirst(FusedManual):
    """The scale folded into the queries where they are projected; the scores are not scaled again."""

    def project(self, x):
        q, k, v = self.qkv(x).split(self.d_out, dim=2)
        return q * self.head_dim ** -0.5, k, v

    def scale(self, att):
        return att


class QScaledAndScores(QScaledFirst):
    def scale(self, att):
        return att / math.sqrt(self.head_dim)  # PLANTED


class GainNorm(nn.Module):
    """An RMSNorm written out, its gain a parameter of its own."""

    def __init__(self, width, eps):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain


class GainNormWithoutGain(GainNorm):
    def forward(self, t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps)  # PLANTED


def _rotate_half(t):
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class WholeProjectionNorm(nn.Module):
    """OLMo's QK-norm: over the whole q and k projections, before the heads are split; then rotate-half RoPE and a
    window mask given to SDPA."""

    attnbench_capabilities = {"dropout": False, "sliding_window": True, "rope": ("half",), "qk_norm": ("full",)}
    norm_class = GainNorm

    def __init__(self, d_in, d_out, context_length, num_heads, rope_theta=10_000.0, qk_norm=True, norm_eps=1e-6,
                 window=None):
        super().__init__()
        self.nh, self.hd, self.window, self.rotates = num_heads, d_out // num_heads, window, rope_theta is not None
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d_out, d_out, bias=False)
        self.q_norm = self.norm_class(d_out, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = self.norm_class(d_out, norm_eps) if qk_norm else nn.Identity()
        inv = 1.0 / (rope_theta or 1.0) ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv) * (rope_theta is not None)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)  # no RoPE: cos 1, sin 0
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def normed(self, q, k):
        q = self.q_norm(q)
        k = self.k_norm(k)
        return q, k

    def forward(self, x):
        b, T, _ = x.shape
        q, k = self.normed(self.q_proj(x), self.k_proj(x))
        q, k, v = (t.view(b, T, self.nh, self.hd).transpose(1, 2) for t in (q, k, self.v_proj(x)))
        if self.rotates:
            cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        i = torch.arange(T, device=x.device)
        hidden = i[None, :] > i[:, None]
        if self.window is not None:
            hidden = hidden | (i[:, None] - i[None, :] >= self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden)
        return self.o_proj(y.transpose(1, 2).reshape(b, T, -1))


class WholeNormGainLeftOut(WholeProjectionNorm):
    norm_class = GainNormWithoutGain


class WholeNormKeysByQueryNorm(WholeProjectionNorm):
    def normed(self, q, k):
        q = self.q_norm(q)
        k = self.q_norm(k)  # PLANTED
        return q, k


class InterleavedAngles(nn.Module):
    """GPT-J's interleaved pairs with the angles made in the forward (``rotate_every_two``)."""

    attnbench_capabilities = {"dropout": False, "rope": ("interleaved",)}

    def __init__(self, d_in, d_out, context_length, num_heads, rope_theta=10_000.0):
        super().__init__()
        self.nh, self.hd, self.theta = num_heads, d_out // num_heads, rope_theta
        self.wq, self.wk, self.wv = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.wo = nn.Linear(d_out, d_out, bias=False)

    def frequencies(self, device):
        return 1.0 / self.theta ** (torch.arange(0, self.hd, 2, device=device, dtype=torch.float64) / self.hd)

    def angles(self, T, device):
        a = torch.outer(torch.arange(T, device=device, dtype=torch.float64), self.frequencies(device))
        return a.repeat_interleave(2, dim=-1)

    @staticmethod
    def every_two(t):
        return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.nh, self.hd) for w in (self.wq, self.wk, self.wv))
        if self.theta is not None:
            a = self.angles(T, x.device)[:, None, :]
            cos, sin = a.cos().to(x.dtype), a.sin().to(x.dtype)
            q, k = q * cos + self.every_two(q) * sin, k * cos + self.every_two(k) * sin
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
        return self.wo(o.reshape(b, T, -1))


class InterleavedAnglesTiled(InterleavedAngles):
    def angles(self, T, device):
        a = torch.outer(torch.arange(T, device=device, dtype=torch.float64), self.frequencies(device))
        return a.repeat(1, 2)  # PLANTED


class InterleavedAnglesTheta(InterleavedAngles):
    def frequencies(self, device):
        return 1.0 / (2 * self.theta) ** (torch.arange(0, self.hd, 2, device=device, dtype=torch.float64) / self.hd)  # PLANTED


class MultiQuery(nn.Module):
    """Falcon-style multi-query attention: one key/value head for every query head, by construction."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__()
        self.nh, self.hd, self.p = num_heads, d_out // num_heads, dropout
        self.q = nn.Linear(d_in, d_out)
        self.kv = nn.Linear(d_in, 2 * self.hd)
        self.out = nn.Linear(d_out, d_out)

    def weights(self, s):
        return F.dropout(s.softmax(dim=-1), p=self.p, training=self.training)

    def forward(self, x):
        b, T, _ = x.shape
        q = self.q(x).view(b, T, self.nh, self.hd).transpose(1, 2)
        k, v = (t.unsqueeze(1) for t in self.kv(x).split(self.hd, dim=-1))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.out((self.weights(s) @ v).transpose(1, 2).reshape(b, T, -1))


class MultiQueryEvalDropout(MultiQuery):
    def weights(self, s):
        return F.dropout(s.softmax(dim=-1), p=self.p, training=True)  # PLANTED


class MultiQueryHeadsMixed(MultiQuery):
    def forward(self, x):
        b, T, _ = x.shape
        q = self.q(x).view(b, self.nh, T, self.hd)  # PLANTED
        k, v = (t.unsqueeze(1) for t in self.kv(x).split(self.hd, dim=-1))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.out((self.weights(s) @ v).transpose(1, 2).reshape(b, T, -1))


class LogSumExpSoftmax(FusedManual):
    """The probabilities as ``exp(s - logsumexp(s))``: a shift per row, right."""

    def softmax(self, att):
        return (att - torch.logsumexp(att, dim=-1, keepdim=True)).exp()


class LogSumExpOverQueries(LogSumExpSoftmax):
    def softmax(self, att):
        return (att - torch.logsumexp(att, dim=-2, keepdim=True)).exp()  # PLANTED


class GrowingCache(nn.Module):
    """A KV cache grown with ``torch.cat`` (Llama-style ``start_pos``), its causal mask made per call in a helper."""

    attnbench_capabilities = {"dropout": False, "kv_cache": True}

    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.wq, self.wk, self.wv = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.wo = nn.Linear(d_out, d_out)
        self.reset_cache()

    def reset_cache(self):
        self.cache_k = self.cache_v = None
        self.start_pos = 0

    def rewind_cache(self, n=1):
        self.cache_k, self.cache_v = self.cache_k[:, :, :-n], self.cache_v[:, :, :-n]
        self.start_pos -= n

    def hidden(self, start, T, L, device):
        rows = torch.arange(start, start + T, device=device)[:, None]
        return torch.arange(L, device=device)[None, :] > rows

    def forward(self, x, use_cache=False):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.nh, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        start = self.start_pos if use_cache else 0
        if use_cache:
            if self.cache_k is not None:
                k, v = self.append(k, v)
            self.cache_k, self.cache_v = k, v
            self.start_pos += T
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        s = s.masked_fill(self.hidden(start, T, k.shape[2], x.device), float("-inf"))
        return self.wo((s.softmax(-1) @ v).transpose(1, 2).reshape(b, T, -1))

    def append(self, k, v):
        return torch.cat([self.cache_k, k], dim=2), torch.cat([self.cache_v, v], dim=2)


class CacheMaskFromZero(GrowingCache):
    def hidden(self, start, T, L, device):
        return torch.arange(L, device=device)[None, :] > torch.arange(T, device=device)[:, None]  # PLANTED


# --- round 14: a split or merge that mixes heads is named as that stage; q and k swapped where they are made -------


class HeadsReshapedNotTransposed(FusedManual):
    """The queries reshaped straight to ``(b, h, T, d)``: every head mixes tokens and features of the others."""

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = self.project(x)
        q = q.reshape(b, self.num_heads, T, self.head_dim)  # PLANTED
        k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        att = self.scale(q @ k.transpose(-2, -1))
        att = att.masked_fill(self.keep[:T, :T] == 0, float("-inf"))
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class KeysTiledValuesInterleaved(GroupedSteps):
    def expand(self, k, v):
        rep = self.nh // self.nkv
        k = k[:, None].expand(-1, rep, -1, -1, -1).reshape(k.shape[0], self.nh, *k.shape[2:])  # PLANTED
        v = v.repeat_interleave(rep, dim=1)
        return k, v


class PerHeadStackedMerge(PerHead):
    def forward(self, x):
        return self.proj(torch.stack([h(x) for h in self.heads], dim=-1).flatten(-2))  # PLANTED


class FusedUnpackedKeysFirst(FusedManual):
    def project(self, x):
        k, q, v = self.qkv(x).split(self.d_out, dim=2)  # PLANTED
        return q, k, v


class PassedCacheHeadsViewed(nn.Module):
    """``forward(x, cache=None)`` returning ``(out, (k, v))``, its heads split by a bare ``view`` to ``(b, h, T, d)``:
    the split mixes tokens, so no form of its context is causal. Nothing attnbench supplies could make it so (no mask
    argument): it is checked, not refused, and its causal cases fail at the split."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_model, n_head, bias=True):
        super().__init__()
        self.n_head, self.hd = n_head, d_model // n_head
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d_model, d_model, bias=bias) for _ in range(4))

    def heads(self, t):
        return t.view(t.shape[0], self.n_head, t.shape[1], self.hd)  # PLANTED

    def forward(self, x, cache=None):
        b, T, C = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        S = k.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = att.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T), float("-inf"))
        return self.out_proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, T, C)), (k, v)


class ScoresNeverScaled(FusedManual):
    """Llama's ``scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)`` with the scale left out."""

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        att = torch.matmul(q, k.transpose(2, 3))  # PLANTED
        att = att.masked_fill(self.keep[:T, :T] == 0, float("-inf"))
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


class SineSliceShifted(HalfRotaryHelper):
    """Right tables in the buffers, the sine sliced one position on (``sin[1:T + 1]``) where the forward reads it."""

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (p(x).view(b, T, -1, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.theta is not None:
            q, k = self.rotary(q, k, self.cos[:T].to(x.dtype), self.sin[1:T + 1].to(x.dtype))  # PLANTED
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nkv != self.nh)
        return self.o_proj(y.transpose(1, 2).reshape(b, T, -1))


# --- round 14, a development set's conventions: dropout's stage, masks grown on demand, complex tables held as
# attributes, a head made twice in a loop, a rotation's sign, a value appended to the key cache ----------------


class DropoutAlwaysOn(FusedManual):
    """``F.dropout(p)`` with its default ``training=True``: dropout in eval mode, a bug of the probabilities."""

    attnbench_capabilities = {}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.p = dropout

    def softmax(self, att):
        return F.dropout(F.softmax(att, dim=-1), p=self.p)  # PLANTED


class MaskGrownOnDemand(FusedManual):
    """An additive mask buffer registered empty and grown in a helper when a longer sequence comes."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.register_buffer("additive", torch.zeros(0, 0), persistent=False)

    def grown(self, T, device):
        if self.additive.shape[0] < T:
            self.additive = torch.triu(torch.full((T, T), float("-inf"), device=device), diagonal=2)  # PLANTED
        return self.additive[:T, :T]

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.project(x))
        att = self.scale(q @ k.transpose(-2, -1)) + self.grown(T, x.device)
        y = self.softmax(att) @ v
        return self.proj(y.transpose(1, 2).reshape(b, T, self.d_out))


def freqs_by_half_width(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).double() / (dim // 2)))  # the exponent over dim // 2
    return torch.polar(torch.ones(end, dim // 2, dtype=torch.float64), torch.outer(torch.arange(end).double(), freqs))


class ComplexTableAttribute(ComplexRope):
    """Meta's tables made once in ``__init__`` and kept as a plain attribute (not a buffer), their exponent wrong."""

    attnbench_capabilities = {"rope": ("interleaved",)}

    def __init__(self, dim: int, n_heads: int, max_seq_len: int, rope_theta: float = 10000.0):
        super().__init__(dim, n_heads, max_seq_len)
        self.freqs_cis = freqs_by_half_width(self.head_dim, max_seq_len * 2, rope_theta)  # PLANTED

    def forward(self, x: torch.Tensor):
        return super().forward(x, self.freqs_cis[: x.shape[1]].to(torch.complex64))


class HeadLoopFirstValues(nn.Module):
    """Heads as column slices of whole projections in a Python loop, every head reading the first head's values."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.q, self.k, self.v = (nn.Linear(d_in, d_out, bias=qkv_bias) for _ in range(3))
        self.out = nn.Linear(d_out, d_out)

    def forward(self, x):
        T = x.shape[1]
        q_all, k_all, v_all = self.q(x), self.k(x), self.v(x)
        outs = []
        for h in range(self.nh):
            cols = slice(h * self.hd, (h + 1) * self.hd)
            q, k, v = q_all[..., cols], k_all[..., cols], v_all[..., : self.hd]  # PLANTED
            w = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            w = w.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            outs.append(w.softmax(-1) @ v)
        return self.out(torch.cat(outs, dim=-1))


class EveryTwoSignFlipped(ComplexRope):
    """GPT-J's ``rotate_every_two`` with real tables, the pair turned the other way."""

    attnbench_capabilities = {"rope": ("interleaved",)}

    def __init__(self, dim: int, n_heads: int, max_seq_len: int, rope_theta: float = 10000.0):
        super().__init__(dim, n_heads, max_seq_len)
        inv = 1.0 / rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv).repeat_interleave(2, dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @staticmethod
    def every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        x = torch.stack((x2, -x1), dim=-1)  # PLANTED
        return x.flatten(-2)

    def rotate(self, xq, xk, freqs_cis):
        T = xq.shape[1]
        cos, sin = self.cos[:T, None].to(xq.dtype), self.sin[:T, None].to(xq.dtype)
        return xq * cos + self.every_two(xq) * sin, xk * cos + self.every_two(xk) * sin

    def forward(self, x: torch.Tensor):
        return super().forward(x, None)


class ValuesAppendedToKeys(GrowingCache):
    def append(self, k, v):
        k = torch.cat([self.cache_k, v], dim=2)  # PLANTED
        return k, torch.cat([self.cache_v, v], dim=2)


class ValueBiasLeftOut(GroupedSteps):
    """Qwen's separate projections with biases, the value's taken as ``F.linear`` of its weight alone (after the
    queries and keys matched: the bias offset is looked for at any projection, not only when nothing matched; a key
    bias alone would change nothing without RoPE: ``q . b`` is the same for every key)."""

    def forward(self, x):
        b, T, _ = x.shape
        q = self.wq(x).view(b, T, self.nh, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, T, self.nkv, self.hd).transpose(1, 2)
        v = F.linear(x, self.wv.weight).view(b, T, self.nkv, self.hd).transpose(1, 2)  # PLANTED
        k, v = self.expand(k, v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return self.wo((att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, T, -1))


class KeysNeverRotated(EveryTwoSignFlipped):
    """The keys' rotation line deleted: the queries are rotated on their line, the keys reach the scores as they came."""

    @staticmethod
    def every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    def rotate(self, xq, xk, freqs_cis):
        T = xq.shape[1]
        cos, sin = self.cos[:T, None].to(xq.dtype), self.sin[:T, None].to(xq.dtype)
        xq = xq * cos + self.every_two(xq) * sin  # PLANTED
        return xq, xk


class SoftmaxLeftOutOptionalMask(nn.Module):
    """Hugging Face's ``forward(hidden_states, attention_mask=None)`` that makes its own additive ``finfo.min`` mask
    when given none, the softmax left out: no mask form is causal (the weights overflow), so it is bound with its
    mask left at None and checked, not refused."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.nh, self.hd = num_attention_heads, hidden_size // num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden_size, hidden_size) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        if attention_mask is None:
            attention_mask = torch.triu(torch.full((T, T), torch.finfo(w.dtype).min, dtype=w.dtype), diagonal=1)
        w = w + attention_mask
        w = w.to(q.dtype)  # PLANTED
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, T, -1))


# --- round 15: blocked computations, their stages made one block at a time ----------------------------------------


class QueryChunks(nn.Module):
    """Queries in chunks of 8, each reading the keys up to its last row (memory-saving prefill): each chunk's scores,
    masked scores and probabilities are rows of the reference's, and are matched as such."""

    attnbench_capabilities = {"dropout": False}
    chunk = 8

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.q, self.k, self.v = (nn.Linear(d_in, d_out, bias=qkv_bias) for _ in range(3))
        self.o = nn.Linear(d_out, d_out)

    def softmax(self, s):
        return torch.softmax(s, dim=-1)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.nh, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        outs = []
        for s in range(0, n, self.chunk):
            e = min(s + self.chunk, n)
            scores = q[:, :, s:e] @ k[:, :, :e].transpose(-2, -1) / math.sqrt(self.hd)
            rows, cols = torch.arange(s, e)[:, None], torch.arange(e)[None, :]
            scores = scores.masked_fill(cols > rows, float("-inf"))
            outs.append(self.softmax(scores) @ v[:, :, :e])
        return self.o(torch.cat(outs, dim=2).transpose(1, 2).reshape(b, n, -1))


class QueryChunksSoftmaxOverQueries(QueryChunks):
    def softmax(self, s):
        return torch.softmax(s, dim=-2)  # PLANTED


class OnlineSoftmax(nn.Module):
    """Flash-style: keys in blocks of 8, a running maximum and sum per query; each block's scores are columns of the
    reference's."""

    attnbench_capabilities = {"dropout": False}
    block = 8

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.q, self.k, self.v = (nn.Linear(d_in, d_out, bias=qkv_bias) for _ in range(3))
        self.o = nn.Linear(d_out, d_out)

    def masked(self, s, k_pos, q_pos):
        return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.nh, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        q_pos = torch.arange(n)
        m = torch.full((b, self.nh, n, 1), float("-inf"), dtype=q.dtype)
        total = torch.zeros(b, self.nh, n, 1, dtype=q.dtype)
        acc = torch.zeros_like(q)
        for start in range(0, n, self.block):
            kb, vb = k[:, :, start:start + self.block], v[:, :, start:start + self.block]
            s = (q @ kb.transpose(-1, -2)) / math.sqrt(self.hd)
            s = self.masked(s, torch.arange(start, start + kb.shape[2]), q_pos)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            total = total * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ vb
            m = m_new
        return self.o((acc / total).transpose(1, 2).reshape(b, n, -1))


class OnlineSoftmaxDiagonalHidden(OnlineSoftmax):
    def masked(self, s, k_pos, q_pos):
        return s.masked_fill(k_pos[None, :] >= q_pos[:, None], float("-inf"))  # PLANTED


class MaskedMergeMixesTokens(SoftmaxLeftOutOptionalMask):
    """Hugging Face's ``forward(hidden_states, attention_mask=None)`` making its own causal mask when given none; the
    merge planted without its transpose mixes tokens, so no mask form makes it causal. Its forward says it is causal
    (``triu``): it is checked, not refused, and the merge is named."""

    def forward(self, hidden_states, attention_mask=None):
        b, T, _ = hidden_states.shape
        heads = [p(hidden_states).unflatten(-1, (self.nh, self.hd)).transpose(1, 2)
                 for p in (self.q_proj, self.k_proj, self.v_proj)]
        w = heads[0] @ heads[1].transpose(2, 3) * self.hd ** -0.5
        if attention_mask is None:
            attention_mask = torch.full((T, T), float("-inf"), dtype=w.dtype).triu(1)
        out = torch.softmax(w + attention_mask, dim=-1) @ heads[2]
        out = out.reshape(b, T, -1)  # PLANTED
        return self.o_proj(out)


# --- round 16: what planted47h (read after its held-out run) found misnamed or refused ------------------------------


class MergeAxesMisordered(SoftmaxLeftOutOptionalMask):
    """Falcon's ``_merge_heads`` helper: ``permute`` on one line, ``reshape`` on the next; the permutation planted puts
    head_dim before the heads. The reshape is where values first go wrong, but it reads its input as laid out: the
    permutation is named."""

    def merge(self, x):
        b, h, t, d = x.shape
        x = x.permute(0, 2, 3, 1)  # PLANTED
        return x.reshape(b, t, h * d)

    def forward(self, hidden_states, attention_mask=None):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = (q @ k.transpose(2, 3) / math.sqrt(self.hd)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                                      float("-inf"))
        return self.o_proj(self.merge(w.softmax(-1) @ v))


class SoftmaxLineDeleted(SoftmaxLeftOutOptionalMask):
    """An MLX port whose softmax line is deleted: the scores' own computation made the tensor applied to the values,
    so the product (where unnormalised scores are first used as weights) is named, not the scores' line."""

    def forward(self, hidden_states, attention_mask=None):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q * self.hd ** -0.5) @ k.transpose(-1, -2)
        scores = scores + torch.full((T, T), float("-inf")).triu(1)
        out = (scores @ v).transpose(1, 2).reshape(b, T, -1)  # PLANTED
        return self.o_proj(out)


class BufferMaskWhereSwapped(nn.Module):
    """GPT-NeoX: a ``tril`` mask buffer made in ``__init__``, applied in an ``_attn`` helper with ``torch.where``
    whose value arguments are planted swapped. Its forward says nothing causal, but its ``__init__`` does: checked,
    not refused."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, hidden_size, num_attention_heads, max_position_embeddings):
        super().__init__()
        self.nh, self.hd = num_attention_heads, hidden_size // num_attention_heads
        n = max_position_embeddings
        self.register_buffer("bias", torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n))
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def _attn(self, q, k, v):
        t = q.shape[-2]
        keep = self.bias[:, :, :t, :t]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        low = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype)
        scores = torch.where(keep, low, scores)  # PLANTED
        return scores.softmax(-1) @ v

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, T, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        out = self._attn(qkv[0], qkv[1], qkv[2])
        return self.dense(out.transpose(1, 2).reshape(b, T, -1))


class ChunkedKeysAsValues(nn.Module):
    """Query chunks that each read a slice of the keys and of the values (the ninth planted set, read after its run):
    the values' slice planted as a slice of the keys. Both roles are read from what their slices were made of, one
    tensor: the slice is the bug, not the line that unbound q, k and v."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_model, n_heads, chunk=3):
        super().__init__()
        self.nh, self.hd, self.chunk = n_heads, d_model // n_heads, chunk
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def _chunk(self, q, k, v, start):
        stop = start + q.shape[2]
        keys = k[:, :, :stop]
        values = k[:, :, :stop]  # PLANTED
        s = q @ keys.transpose(-2, -1) / math.sqrt(self.hd)
        later = torch.arange(stop)[None, :] > torch.arange(start, stop)[:, None]
        return s.masked_fill(later, float("-inf")).softmax(-1) @ values

    def forward(self, x):
        b, T, C = x.shape
        q, k, v = self.qkv(x).reshape(b, T, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        out = torch.cat([self._chunk(q[:, :, s:s + self.chunk], k, v, s) for s in range(0, T, self.chunk)], dim=2)
        return self.proj(out.transpose(1, 2).reshape(b, T, C))


class NormFactorWithoutRoot(nn.Module):
    """GPT-NeoX's ``self.norm_factor = math.sqrt(self.head_size)`` planted without its square root, the scores divided
    by it in an ``_attn`` helper (the ninth planted set, read after its run): the ``__init__`` line is named, as a
    ``self.scaling`` that is multiplied is."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.nh, self.head_size = num_attention_heads, hidden_size // num_attention_heads
        self.norm_factor = self.head_size  # PLANTED
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def _attn(self, q, k, v):
        t = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.norm_factor
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1) @ v

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).view(b, T, 3, self.nh, self.head_size).permute(2, 0, 3, 1, 4)
        return self.dense(self._attn(q, k, v).transpose(1, 2).reshape(b, T, -1))


class SdpaScaleWithoutRoot(nn.Module):
    """A Llama-style layer whose ``scaled_dot_product_attention`` call spans several lines, its ``scale=`` planted
    without the square root (the ninth planted set, read after its run): the call is one op whose inputs match, so
    the scale that reproduces its output is measured, and the ``scale=`` line is named."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
                      for w in (self.wq, self.wk, self.wv))
        output = F.scaled_dot_product_attention(
            xq, xk, xv,
            is_causal=True,
            scale=1.0 / self.head_dim,  # PLANTED
        )
        return self.wo(output.transpose(1, 2).reshape(bsz, seqlen, -1))


class MaskNotInPlace(nn.Module):
    """Raschka's ``MultiHeadAttention`` with ``attn_scores.masked_fill_`` planted as ``masked_fill`` (its result
    dropped; the ninth planted set, read after its run): the masking line is named, not the scores' line."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query, self.W_key, self.W_value = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, _ = x.shape
        queries, keys, values = (w(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
                                 for w in (self.W_query, self.W_key, self.W_value))
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores.masked_fill(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)  # PLANTED
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return self.out_proj((attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, -1))


class SdpaDropoutAlwaysOn(nn.Module):
    """minGPT-style layer whose ``scaled_dot_product_attention`` call spans several lines, ``dropout_p=`` planted
    without ``if self.training else 0.0`` (the ninth planted set, read after its run): the ``dropout_p=`` line of the
    call is named, not its first line."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.n_head, self.p = num_heads, dropout
        self.c_attn, self.c_proj = nn.Linear(d_in, 3 * d_out, bias=qkv_bias), nn.Linear(d_out, d_out)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.p,  # PLANTED
            is_causal=True,
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class SplitScaleResidual(nn.Module):
    """Whisper's and guided-diffusion's split scale, ``head_dim ** -0.25`` on q and on k (the scores come out scaled
    right), with a residual planted on the output (the ninth planted set, read after its run): the return line is
    named, not the correct ``q * scale`` before it."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, channels, num_heads):
        super().__init__()
        self.n_heads = num_heads
        self.qkv, self.proj_out = nn.Linear(channels, 3 * channels), nn.Linear(channels, channels)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        scale = 1 / math.sqrt(math.sqrt(c // self.n_heads))
        weight = (q * scale) @ (k * scale).transpose(-1, -2)
        weight = weight.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        h = (weight @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj_out(h) + x  # PLANTED


class SdpaCausalFlagOff(SdpaDropoutAlwaysOn):
    """The same call with no mask and ``is_causal=False`` planted on its own line: that line of the call is named
    (the shared multi-line argument scan, as for ``dropout_p=`` and ``scale=``)."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v,
            is_causal=False,  # PLANTED
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


# --- round 17: what planted47j (read after its held-out run) named one step early or late --------------------------


class SdpaKeysValuesSwapped(SdpaDropoutAlwaysOn):
    """Keys and values made and named right, swapped in the call's argument line: that line is named, not the line
    that made the values."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, v, k,  # PLANTED
            is_causal=True,
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class HeadsTransposedSwapped(nn.Module):
    """Llama-style ``xq, xk, xv`` projected on one line, their heads moved to axis 1 by a generator that takes
    ``xv`` where ``xk`` belongs: the generator's line is named."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.wq, self.wk, self.wv = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.wo = nn.Linear(d_out, d_out, bias=False)

    def forward(self, x):
        b, T, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(b, T, self.nh, self.hd)
        xk = xk.view(b, T, self.nh, self.hd)
        xv = xv.view(b, T, self.nh, self.hd)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xv, xk))  # PLANTED
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, T, -1))


class CachedValuesAliasKeys(GrowingCache):
    """The book's cached layer, whose cached branch reads its values from the key cache by a plain assignment (no
    torch call on that line): the assignment is named, found by following the names back."""

    def forward(self, x, use_cache=False):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.nh, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        start = self.start_pos if use_cache else 0
        if use_cache:
            if self.cache_k is not None:
                k, v = self.append(k, v)
            self.cache_k, self.cache_v = k, v
            self.start_pos += T
            keys, values = self.cache_k, self.cache_k  # PLANTED
        else:
            keys, values = k, v
        s = (q @ keys.transpose(-2, -1)) / math.sqrt(self.hd)
        s = s.masked_fill(self.hidden(start, T, keys.shape[2], x.device), float("-inf"))
        return self.wo((s.softmax(-1) @ values).transpose(1, 2).reshape(b, T, -1))


class ValuesViewedFromKeys(SoftmaxLeftOutOptionalMask):
    """fairseq-style values made by viewing the keys' heads again (``v = k.contiguous().view(...)``): the weights are
    applied to a tensor made from the keys, named where it was made from them."""

    def forward(self, hidden_states, attention_mask=None):
        b, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
        v = k.reshape(b, T, self.nh, self.hd).transpose(1, 2)  # PLANTED
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, T, -1))


class GainNormSteps(GainNorm):
    """An RMSNorm written out over three lines, its root not inverted."""

    def forward(self, t):
        ms = t.pow(2).mean(-1, keepdim=True)
        t = t * torch.sqrt(ms + self.eps)  # PLANTED
        return t * self.gain


class WholeNormRootNotInverted(WholeProjectionNorm):
    norm_class = GainNormSteps


def softmax_written_out(scores, dim=-1):
    shifted = scores - scores.amax(dim=dim, keepdim=True)
    numer = torch.exp(shifted)
    denom = numer.sum(dim=-2, keepdim=True)  # PLANTED
    return numer / denom


def softmax_denominator_detached(scores, dim=-1):
    shifted = scores - scores.amax(dim=dim, keepdim=True)
    numer = torch.exp(shifted)
    denom = numer.sum(dim=dim, keepdim=True)
    return numer / denom.detach()  # PLANTED


class WrittenSoftmaxOverQueries(SoftmaxLeftOutOptionalMask):
    """The book's softmax written out as a helper, its denominator summed over the queries: that step is named."""

    softmax = staticmethod(softmax_written_out)

    def forward(self, hidden_states, attention_mask=None):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.matmul(q, k.transpose(2, 3))
        w.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
        w = self.softmax(w / self.hd ** 0.5, dim=-1)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, T, -1))


class WrittenSoftmaxDetached(WrittenSoftmaxOverQueries):
    """The same softmax with its denominator detached: the forward is right, and the line whose backward is wrong is
    the division by the detached denominator."""

    softmax = staticmethod(softmax_denominator_detached)


class ExtendedMaskNotInverted(SoftmaxLeftOutOptionalMask):
    """BERT's additive extended mask made from a keep mask without ``1.0 -``: it is very negative where the keys are
    kept; read as added to the scores, its making line is named, not the addition."""

    def extended(self, T, dtype):
        keep = torch.tril(torch.ones(T, T, dtype=dtype))[None, None]
        return keep * torch.finfo(dtype).min  # PLANTED

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        w = w + self.extended(T, w.dtype)
        return self.o_proj(torch.matmul(w.softmax(-1), v).transpose(1, 2).reshape(b, T, -1))


def window_mask(q_len, k_len, device):
    q_pos = torch.arange(k_len - q_len + 1, k_len + 1, device=device)[:, None]  # PLANTED
    k_pos = torch.arange(k_len, device=device)[None, :]
    return k_pos <= q_pos


class QueryPositionsShifted(SdpaDropoutAlwaysOn):
    """A causal mask made by comparing key and query positions, the queries' shifted by one: the positions' line is
    named, not the comparison."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(T, T, x.device))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class ProjectionLeftOutOfDropout(SdpaDropoutAlwaysOn):
    """nanoGPT's ``y = self.resid_dropout(self.c_proj(y))`` with the projection left out: the dropout's line, which
    passes the merged heads on unchanged in eval mode, is named, not the ``return``."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)
        y = self.resid_dropout(y)  # PLANTED
        return y


def repeat_heads(t, n):
    """Llama's ``repeat_kv``: heads repeated ``n`` times, the tensor itself when ``n`` is 1."""
    return t if n == 1 else t.repeat_interleave(n, dim=1)


class KeysRepeatedFromValues(HeadsTransposedSwapped):
    """Llama's ``key_states = repeat_kv(value_states, n_rep)``: with one group no torch call is made on that line,
    and the names through the helper's call find it."""

    def forward(self, x):
        b, T, _ = x.shape
        query_states = self.wq(x).view(b, T, self.nh, self.hd).transpose(1, 2)
        key_states = self.wk(x).view(b, T, self.nh, self.hd).transpose(1, 2)
        value_states = self.wv(x).view(b, T, self.nh, self.hd).transpose(1, 2)
        key_states = repeat_heads(value_states, 1)  # PLANTED
        value_states = repeat_heads(value_states, 1)
        out = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, T, -1))


class PartialRotaryJoinedBackwards(nn.Module):
    """GPT-NeoX's partial rotary (the first ``rotary_dim`` features of each head rotated, the rest passed through),
    the keys' two parts joined in the wrong order: the join is named, not the rotation that made one part."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, num_heads, rope_theta=10_000.0, rotary_dim=None):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.rd = rotary_dim or self.hd
        self.qkv, self.proj = nn.Linear(d_in, 3 * d_out), nn.Linear(d_out, d_out)
        inv = 1.0 / rope_theta ** (torch.arange(0, self.rd, 2, dtype=torch.float64) / self.rd)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, T, C = x.shape
        q, k, v = self.qkv(x).view(b, T, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        q_rot, q_pass = q[..., :self.rd], q[..., self.rd:]
        k_rot, k_pass = k[..., :self.rd], k[..., self.rd:]
        q = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_pass, k_rot * cos + _rotate_half(k_rot) * sin), dim=-1)  # PLANTED
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, T, C))


class SharedLocalScaleSquared(nn.Module):
    """guided-diffusion's ``QKVAttention``: q and k each multiplied by a local ``scale`` on two lines of one call, the
    scale planted as ``1 / sqrt(ch)`` rather than its root: the assignment both lines read is named."""

    attnbench_capabilities = {"dropout": False}

    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.nh = num_heads
        self.qkv, self.proj = nn.Linear(d_in, 3 * d_out), nn.Linear(d_out, d_out)

    def forward(self, x):
        b, T, C = x.shape
        q, k, v = self.qkv(x).view(b, T, 3, self.nh, -1).permute(2, 0, 3, 1, 4)
        ch = q.shape[-1]
        scale = 1 / math.sqrt(ch)  # PLANTED
        w = torch.einsum(
            "bhtc,bhsc->bhts",
            q * scale,
            k * scale,
        )
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.proj(torch.einsum("bhts,bhsc->bhtc", w, v).transpose(1, 2).reshape(b, T, C))


# --- round 17, after planted47k's held-out run (read): a size divided by, a Function's gradient per input -----------


class ScoresDividedByHeadDim(SoftmaxLeftOutOptionalMask):
    """The scores divided by ``self.head_dim`` where its root was meant: a size, right where it is set; the line that
    divides by it is named (a scale such as ``self.norm_factor`` is named where it is set)."""

    def __init__(self, hidden_size, num_attention_heads):
        super().__init__(hidden_size, num_attention_heads)
        self.head_dim = hidden_size // num_attention_heads

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.matmul(q, k.transpose(2, 3)) / self.head_dim  # PLANTED
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return self.o_proj(torch.matmul(w.softmax(-1), v).transpose(1, 2).reshape(b, T, -1))


class AttendFunctionKeysGradWrong(torch.autograd.Function):
    """Attention as one ``autograd.Function`` with a hand-written backward returning ``dq, dk, dv``, its ``dk`` taken
    from the untransposed score gradient."""

    @staticmethod
    def forward(ctx, q, k, v):
        scale = q.shape[-1] ** -0.5
        s = (q @ k.transpose(-2, -1)) * scale
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        p = s.softmax(-1)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, p = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dv = p.transpose(-2, -1) @ grad_out
        dp = grad_out @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = ds @ k * scale
        dk = ds @ q * scale  # PLANTED
        return dq, dk, dv


class OwnAttendGrad(SoftmaxLeftOutOptionalMask):
    """q, k, v heads given to an ``autograd.Function`` that computes the attention; its backward's ``dk`` line is
    planted wrong: the line named is the one that made the gradient of the input whose gradient differs, not the
    first value the backward returns."""

    function = AttendFunctionKeysGradWrong

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(self.function.apply(q, k, v).transpose(1, 2).reshape(b, T, -1))


class WeightsSummedAway(SoftmaxLeftOutOptionalMask):
    """lucidrains-style einsum whose value index is the query's (``b h i j, b h i d -> b h i d``): the weights sum to
    one over ``j``, so the result equals the values; made from the probabilities, it is not the values stage, and its
    line is named."""

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(self.hd)
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        out = torch.einsum("bhij,bhid->bhid", w, v)  # PLANTED
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


# --- round 18: planted47k (read) -- a norm's sum for its mean, a scale on a statement's later line --------------------


class HeadNormSummed(nn.Module):
    """Hugging Face's RMSNorm written out (a ``weight``, the variance on a line of its own, the gain applied last), its
    squares summed where their mean was meant: off by a factor the same for every feature, so the norm without its
    gain is off per feature like a gain left out, but the sum's line is where it starts."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).sum(-1, keepdim=True)  # PLANTED
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class PerHeadNormSummed(nn.Module):
    """Qwen3's per-head QK-norm around SDPA, its norm :class:`HeadNormSummed` (what it does is inferred, as for a
    class of Qwen3's that declares nothing)."""

    def __init__(self, d_in, d_out, context_length, num_heads, rope_theta=10_000.0):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d_out, d_out, bias=False)
        self.q_norm, self.k_norm = HeadNormSummed(self.hd), HeadNormSummed(self.hd)  # always, at eps 1e-6 (Qwen3's)
        inv = 1.0 / (rope_theta or 1.0) ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv) * (rope_theta is not None)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def forward(self, x):
        b, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, T, -1, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, T, -1, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, T, -1, self.hd).transpose(1, 2)
        cos, sin = self.cos[:T].to(q.dtype), self.sin[:T].to(q.dtype)
        q = q * cos + torch.cat((-q[..., self.hd // 2:], q[..., :self.hd // 2]), -1) * sin
        k = k * cos + torch.cat((-k[..., self.hd // 2:], k[..., :self.hd // 2]), -1) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


class ScaleOnArgumentLine(SoftmaxLeftOutOptionalMask):
    """GPT-2's ``attn_weights / torch.full([], value.size(-1) ** 0.5, ...)`` over two lines, its root left out on the
    argument's line: Python records the division on the statement's first line; the argument's line is named."""

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full(
            [], v.size(-1), dtype=w.dtype, device=w.device  # PLANTED
        )
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, T, -1))


class BaddbmmAlphaLine(SoftmaxLeftOutOptionalMask):
    """Bloom's ``baddbmm`` with its keywords on a line of their own, ``alpha`` left at 1.0: that line is named."""

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2).reshape(b * self.nh, T, self.hd)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        zeros = torch.zeros(b * self.nh, T, T, dtype=q.dtype)
        w = zeros.baddbmm(
            batch1=q, batch2=k.transpose(1, 2), beta=0.0, alpha=1.0  # PLANTED
        )
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        out = torch.bmm(w, v).view(b, self.nh, T, self.hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


class SplitScaleKeysUnscaled(SoftmaxLeftOutOptionalMask):
    """Whisper's ``qkv_attention``: q and k each scaled by ``head_dim ** -0.25``; the keys' half left out. The queries
    are then off from the reference's scaled q by exactly their half, so the keys' line is named, not the queries'."""

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        scale = self.hd ** -0.25
        q = self.q_proj(hidden_states).view(b, T, self.nh, -1).permute(0, 2, 1, 3) * scale
        k = self.k_proj(hidden_states).view(b, T, self.nh, -1).permute(0, 2, 3, 1)  # PLANTED
        v = self.v_proj(hidden_states).view(b, T, self.nh, -1).permute(0, 2, 1, 3)
        w = (q @ k).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


class BlocksIntoBufferUnscaled(SoftmaxLeftOutOptionalMask):
    """Query blocks written into a preallocated output (``out[:, :, s:e] = ...``), the scores' scale left out: the
    way from the output back to the masked scores is a write the recording does not follow, so the masking line is
    not called unused; the scores' line is named."""

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.empty_like(q)
        for s in range(0, T, 4):
            e = min(s + 4, T)
            w = q[:, :, s:e] @ k[:, :, :e].transpose(-1, -2)  # PLANTED
            w = w.masked_fill(torch.arange(e)[None, :] > torch.arange(s, e)[:, None], float("-inf"))
            out[:, :, s:e] = w.softmax(-1) @ v[:, :, :e]
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


class GroupedKeysNeverRotated(nn.Module):
    """OLMo-style: grouped keys repeated by ``repeat_interleave`` before SDPA, the rotary call given q and v where q
    and k were meant: the keys are never rotated, and the line rotating the queries is named."""

    attnbench_capabilities = {"dropout": False, "rope": ("half",), "gqa": True, "sliding_window": False}

    def __init__(self, d_in, d_out, context_length, num_heads, num_kv_heads=None, rope_theta=10_000.0):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.nkv = num_kv_heads or num_heads
        self.q_proj = nn.Linear(d_in, d_out, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(d_in, self.nkv * self.hd, bias=False) for _ in range(2))
        self.o_proj = nn.Linear(d_out, d_out, bias=False)
        inv = 1.0 / (rope_theta or 1.0) ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv) * (rope_theta is not None)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def rotary(self, a, b):
        T, h = a.shape[-2], self.hd // 2
        cos, sin = self.cos[:T].to(a.dtype), self.sin[:T].to(a.dtype)
        return (a * cos + torch.cat((-a[..., h:], a[..., :h]), -1) * sin,
                b * cos + torch.cat((-b[..., h:], b[..., :h]), -1) * sin)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, v = self.rotary(q, v)  # PLANTED
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


# --- round 19: a fourteenth corpus's development set (planted14dev) -- rotations written out in halves, a wrapper --


class HalvesRotary(nn.Module):
    """RoPE written out over real and imaginary halves (baby-llama2's ``apply_rotary_emb``): each part on its own line,
    then ``torch.stack([real, imag], -1).flatten(3)``; interleaved pairs, tables of its own."""

    attnbench_capabilities = {"dropout": False, "rope": ("interleaved",), "sliding_window": False}

    def __init__(self, d_in, d_out, context_length, num_heads, rope_theta=10_000.0):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.wq, self.wk, self.wv = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.wo = nn.Linear(d_out, d_out, bias=False)
        inv = 1.0 / (rope_theta or 1.0) ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv) * (rope_theta is not None)
        self.register_buffer("fcos", angles.cos(), persistent=False)
        self.register_buffer("fsin", angles.sin(), persistent=False)

    def rotate(self, xq, xk):
        T = xq.shape[1]
        cos, sin = self.fcos[:T, None].to(xq.dtype), self.fsin[:T, None].to(xq.dtype)
        xq_r, xq_i = xq.unflatten(-1, (-1, 2)).unbind(-1)
        xk_r, xk_i = xk.unflatten(-1, (-1, 2)).unbind(-1)
        xq_out_r = xq_r * cos - xq_i * sin
        xq_out_i = xq_r * sin + xq_i * cos
        xk_out_r = xk_r * cos - xk_i * sin
        xk_out_i = xk_r * sin + xk_i * cos
        return self.join(xq_out_r, xq_out_i), self.join_k(xk_out_r, xk_out_i)

    def join(self, real, imag):
        return torch.stack([real, imag], dim=-1).flatten(3)

    def join_k(self, real, imag):
        return torch.stack([real, imag], dim=-1).flatten(3)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, self.nh, self.hd) for w in (self.wq, self.wk, self.wv))
        q, k = self.rotate(q, k) if self.hd % 2 == 0 else (q, k)  # an odd head: no RoPE case runs there
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class HalvesKeyImagWrong(HalvesRotary):
    """The keys' imaginary half with its second term's sign turned: the real half, on the line before, is right."""

    def rotate(self, xq, xk):
        T = xq.shape[1]
        cos, sin = self.fcos[:T, None].to(xq.dtype), self.fsin[:T, None].to(xq.dtype)
        xq_r, xq_i = xq.unflatten(-1, (-1, 2)).unbind(-1)
        xk_r, xk_i = xk.unflatten(-1, (-1, 2)).unbind(-1)
        xq_out_r = xq_r * cos - xq_i * sin
        xq_out_i = xq_r * sin + xq_i * cos
        xk_out_r = xk_r * cos - xk_i * sin
        xk_out_i = xk_r * sin - xk_i * cos  # PLANTED
        return self.join(xq_out_r, xq_out_i), self.join(xk_out_r, xk_out_i)


class HalvesStackedSwapped(HalvesRotary):
    """The keys' halves, both right, stacked the other way round (the queries' too would be the same function)."""

    def join_k(self, real, imag):
        return torch.stack([imag, real], dim=-1).flatten(3)  # PLANTED


class PassThroughWrapper(nn.Module):
    """OpenNMT's ``self.maybe_ckpt = checkpoint if ... else lambda f, x: f(x)``: every projection is called through a
    pass-through lambda; the values made with the key projection."""

    attnbench_capabilities = {"dropout": False, "rope": False, "sliding_window": False}

    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.nh, self.hd = num_heads, d_out // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d_out, d_out, bias=False)
        self.maybe_ckpt = lambda f, x: f(x)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.maybe_ckpt(self.q_proj, x)
        k = self.maybe_ckpt(self.k_proj, x)
        v = self.maybe_ckpt(self.k_proj, x)  # PLANTED
        q, k, v = (t.view(B, T, self.nh, self.hd).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


# --- round 20: a copy of torch's functional code that keeps torch's dispatch (planted14dev's GPT-SoVITS bugs) -------


def copied_attention(x, num_heads, in_proj_weight, out_proj_weight, cache=None):
    """GPT-SoVITS's ``multi_head_attention_forward_patched``: copied from torch, its dispatch kept, naming torch's
    function and handing it an argument torch's does not take (``cache``). Outside a mode the body runs."""
    if has_torch_function((x, in_proj_weight, out_proj_weight)):
        return handle_torch_function(F.multi_head_attention_forward, (x, in_proj_weight, out_proj_weight), x,
                                     num_heads, in_proj_weight, out_proj_weight, cache=cache)
    q, k, v = F.linear(x, in_proj_weight).unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4)
    return F.linear(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2),
                    out_proj_weight)


def copied_attention_keys_as_values(x, num_heads, in_proj_weight, out_proj_weight, cache=None):
    """:func:`copied_attention` with the keys passed as the values."""
    if has_torch_function((x, in_proj_weight, out_proj_weight)):
        return handle_torch_function(F.multi_head_attention_forward, (x, in_proj_weight, out_proj_weight), x,
                                     num_heads, in_proj_weight, out_proj_weight, cache=cache)
    q, k, v = F.linear(x, in_proj_weight).unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, k, is_causal=True)  # PLANTED
    return F.linear(out.transpose(1, 2).flatten(2), out_proj_weight)


class DispatchCopied(nn.Module):
    """A fused in-projection and an output weight handed to a module-level copy of torch's functional code."""

    attnbench_capabilities = {"dropout": False, "rope": False, "sliding_window": False}
    attend = staticmethod(copied_attention)

    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * d_out, d_in) / math.sqrt(d_in))
        self.out_proj_weight = nn.Parameter(torch.randn(d_out, d_out) / math.sqrt(d_out))

    def forward(self, x):
        return self.attend(x, self.num_heads, self.in_proj_weight, self.out_proj_weight, cache={})


class DispatchCopiedKeysAsValues(DispatchCopied):
    attend = staticmethod(copied_attention_keys_as_values)


class HalvesQueryRealSignTurned(HalvesRotary):
    """The queries' real half with its second term's sign turned: no rotation at all (the keys' halves are right)."""

    def rotate(self, xq, xk):
        T = xq.shape[1]
        cos, sin = self.fcos[:T, None].to(xq.dtype), self.fsin[:T, None].to(xq.dtype)
        xq_r, xq_i = xq.unflatten(-1, (-1, 2)).unbind(-1)
        xk_r, xk_i = xk.unflatten(-1, (-1, 2)).unbind(-1)
        xq_out_r = xq_r * cos + xq_i * sin  # PLANTED
        xq_out_i = xq_r * sin + xq_i * cos
        xk_out_r = xk_r * cos - xk_i * sin
        xk_out_i = xk_r * sin + xk_i * cos
        return self.join(xq_out_r, xq_out_i), self.join(xk_out_r, xk_out_i)


# --- round 20: planted16dev (read) -- an input a bug leaves unused is still a sequence --------------------------------


class KeyValueQueryOrder(nn.Module):
    """joeynmt's ``forward(k, v, q, mask)``: keys first, a bool keep-mask filled with ``-inf``."""

    attnbench_capabilities = {"dropout": False, "rope": False, "sliding_window": False}

    def __init__(self, num_heads, size):
        super().__init__()
        self.num_heads, self.head_size = num_heads, size // num_heads
        self.k_layer, self.v_layer, self.q_layer, self.output_layer = (nn.Linear(size, size) for _ in range(4))

    def heads(self, t):
        return t.view(t.size(0), -1, self.num_heads, self.head_size).transpose(1, 2)

    def attend(self, q, k, v, mask):
        scores = torch.matmul(q / math.sqrt(self.head_size), k.transpose(2, 3))
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf")) if mask is not None else scores
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def forward(self, k, v, q, mask=None):
        k, v, q = self.heads(self.k_layer(k)), self.heads(self.v_layer(v)), self.heads(self.q_layer(q))
        context = self.attend(q, k, v, mask)
        return self.output_layer(context.transpose(1, 2).reshape(context.size(0), -1, self.num_heads * self.head_size))


class ValuesNeverUsed(KeyValueQueryOrder):
    """The probabilities multiply the keys: the value input is unused, which read as "v is no sequence it attends
    over" (an elementwise input), and the class was refused as not causal with any mask form."""

    def attend(self, q, k, v, mask):
        scores = torch.matmul(q / math.sqrt(self.head_size), k.transpose(2, 3))
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf")) if mask is not None else scores
        return torch.matmul(torch.softmax(scores, dim=-1), k)  # PLANTED


class WholeAttentionCall(nn.Module):
    """fairseq's (and VALL-E-X's) ``MultiheadAttention`` off its fast path: the whole layer is one
    ``F.multi_head_attention_forward`` call, time-first, with the class's separate projection weights."""

    attnbench_capabilities = {"dropout": False, "rope": False, "sliding_window": False}

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def arguments(self, mask):
        return dict(embed_dim_to_check=self.embed_dim, num_heads=self.num_heads, in_proj_weight=torch.empty([0]),
                    in_proj_bias=torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), bias_k=None,
                    bias_v=None, dropout_p=0.0, out_proj_weight=self.out_proj.weight, out_proj_bias=self.out_proj.bias,
                    training=False, need_weights=False, attn_mask=mask, use_separate_proj_weight=True,
                    q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)

    def call(self, t, mask):
        return F.multi_head_attention_forward(t, t, t, add_zero_attn=False, **self.arguments(mask))[0]

    def forward(self, x):
        t, T = x.transpose(0, 1), x.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device), 1)
        return self.call(t, mask).transpose(0, 1)


class WholeAttentionZeroSlot(WholeAttentionCall):
    """VALL-E-X's copy with ``add_zero_attn`` forced on: a zero key and value every query attends to. Nothing of the
    class matched any stage, and the localiser could not tell."""

    def call(self, t, mask):
        return F.multi_head_attention_forward(t, t, t, add_zero_attn=True, **self.arguments(mask))[0]  # PLANTED


class ScaleFlagOn(nn.Module):
    """UER's ``MultiHeadedAttention(..., with_scale=True)``: the scale under a flag that is on by default."""

    attnbench_capabilities = {"dropout": False, "rope": False, "sliding_window": False}

    def __init__(self, hidden_size, heads_num, with_scale=True):
        super().__init__()
        self.heads_num, self.per_head_size, self.with_scale = heads_num, hidden_size // heads_num, with_scale
        self.linear_layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size) for _ in range(3)])
        self.final_linear = nn.Linear(hidden_size, hidden_size)

    def scores(self, query, key):
        return torch.matmul(query, key.transpose(-2, -1))

    def forward(self, x):
        B, T, _ = x.shape
        query, key, value = (layer(x).view(B, T, self.heads_num, -1).transpose(1, 2) for layer in self.linear_layers)
        scores = self.scores(query, key)
        if self.with_scale:
            scores = scores / math.sqrt(float(self.per_head_size))
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), value)
        return self.final_linear(out.transpose(1, 2).reshape(B, T, -1))


class ScaleFlagOnTwice(ScaleFlagOn):
    """A second scale, planted where the scores are made: flipping ``with_scale`` off gave the reference's scale, and
    the binding did so, hiding the bug (the class passed)."""

    def scores(self, query, key):
        return torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(float(self.per_head_size))  # PLANTED
