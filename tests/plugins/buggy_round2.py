"""Round-2 buggy plug-ins: bugs that pass plain forward/backward checks on small shapes.

``Baseline`` is a correct causal multi-head attention written in small steps (project, split heads,
scores, mask, softmax, dropout, mix values, merge heads, project out). Every other class overrides
one or two steps with a bug of a kind that real attention code ships with: a softmax without max
subtraction, a mask tiled or sized for a fixed block, a tiled loop that drops the last partial tile,
dropout without rescaling, ``view()`` on the input, writes into the input or the weights, caches keyed
on the first shape or tensor, accumulation in the input dtype. All keep the book's constructor and
attribute names, so canonical weights load without an adapter, and none declares capabilities.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Baseline(nn.Module):
    """Correct reference for the variants below (each overrides a step)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_in, self.d_out, self.num_heads, self.head_dim = d_in, d_out, num_heads, d_out // num_heads
        self.p = dropout
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("future", torch.ones(context_length, context_length, dtype=torch.bool).triu(1),
                             persistent=False)  # True above the diagonal: masked_fill's meaning

    def project(self, x):
        return self.W_query(x), self.W_key(x), self.W_value(x)  # each (b, T, d_out)

    def split(self, t):
        b, T, _ = t.shape
        return t.reshape(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)

    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (b, nh, T, T)

    def mask(self, scores):
        T = scores.shape[-1]
        return scores.masked_fill(self.future[:T, :T], float("-inf"))

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)

    def drop(self, weights):
        return F.dropout(weights, self.p, training=self.training)

    def attend(self, q, k, v):
        return self.drop(self.softmax(self.mask(self.scores(q, k)))) @ v  # (b, nh, T, hd)

    def merge(self, context):
        b, _, T, _ = context.shape
        return context.transpose(1, 2).reshape(b, T, self.d_out)  # (b, T, d_out)

    def output(self, context, x):
        return self.out_proj(context)

    def forward(self, x):
        q, k, v = (self.split(t) for t in self.project(x))
        return self.output(self.merge(self.attend(q, k, v)), x)


# --- extreme logits -------------------------------------------------------------------------------

class NaiveSoftmax(Baseline):
    """Bug: softmax written as exp / sum without subtracting the row max (overflows for large scores)."""

    def softmax(self, scores):
        e = scores.exp()  # exp(-inf) = 0 handles the mask
        return e / e.sum(dim=-1, keepdim=True)


class OnlineSoftmaxZeroMax(Baseline):
    """Bug: a key-tiled online softmax whose running max starts at 0, not -inf (rows of very negative scores underflow)."""

    block = 16

    def attend(self, q, k, v):
        T = q.shape[-2]
        m = torch.zeros(*q.shape[:-1], 1, dtype=q.dtype, device=q.device)  # should be -inf
        denom = torch.zeros_like(m)
        acc = torch.zeros_like(q)
        scores = self.mask(self.scores(q, k))  # (b, nh, T, T)
        for start in range(0, T, self.block):
            s = scores[..., start:start + self.block]  # (b, nh, T, blk)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            e = torch.exp(s - m_new)
            acc = acc * torch.exp(m - m_new) + self.drop(e) @ v[..., start:start + self.block, :]
            denom = denom * torch.exp(m - m_new) + e.sum(-1, keepdim=True)
            m = m_new
        return acc / denom


# --- long and awkward lengths ---------------------------------------------------------------------

class TiledMask64(Baseline):
    """Bug: the causal mask is built for one 64x64 tile and tiled over T x T (right only for T <= 64)."""

    def mask(self, scores):
        T = scores.shape[-1]
        tile = torch.ones(64, 64, dtype=torch.bool, device=scores.device).triu(1)
        n = -(-T // 64)
        return scores.masked_fill(tile.repeat(n, n)[:T, :T], float("-inf"))


class FixedMask128(Baseline):
    """Bug: the mask buffer is sized by a hard-coded block_size of 128, not by context_length."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.register_buffer("bias", torch.tril(torch.ones(128, 128)).view(1, 1, 128, 128), persistent=False)

    def mask(self, scores):
        T = scores.shape[-1]
        return scores.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))


class DropsLastTile(Baseline):
    """Bug: query tiles of 64 rows; T // 64 tiles drop a partial last tile (short inputs get one whole tile)."""

    block = 64

    def attend(self, q, k, v):
        T = q.shape[-2]
        out = torch.zeros_like(q)
        n_tiles = max(1, T // self.block)
        size = T if T < self.block else self.block
        scores = self.mask(self.scores(q, k))  # (b, nh, T, T)
        for i in range(n_tiles):
            rows = slice(i * size, (i + 1) * size)
            out[..., rows, :] = self.drop(self.softmax(scores[..., rows, :])) @ v
        return out


# --- dropout semantics ----------------------------------------------------------------------------

class DropoutNoRescale(Baseline):
    """Bug: hand-written dropout zeroes weights with probability p but never rescales the kept ones by 1/(1-p)."""

    def drop(self, weights):
        if not self.training or self.p == 0:
            return weights
        keep = torch.rand_like(weights) >= self.p
        return weights * keep


class DropoutOnScores(Baseline):
    """Bug: dropout applied to the raw scores before the mask and softmax, not to the attention weights."""

    def attend(self, q, k, v):
        s = F.dropout(self.scores(q, k), self.p, training=self.training)
        return self.softmax(self.mask(s)) @ v


# --- strided inputs -------------------------------------------------------------------------------

class ViewOnInput(Baseline):
    """Bug: flattens the input with view() for one 2-D GEMM per projection: fails on non-contiguous x."""

    def project(self, x):
        b, T, d = x.shape
        flat = x.view(b * T, d)
        return tuple(layer(flat).view(b, T, self.d_out) for layer in (self.W_query, self.W_key, self.W_value))


class AssumesContiguous(Baseline):
    """Bug: reads x through as_strided with contiguous strides ("zero-copy" reinterpretation of its storage)."""

    def project(self, x):
        b, T, d = x.shape
        flat = x.as_strided((b * T, d), (d, 1), x.storage_offset())
        return tuple(layer(flat).reshape(b, T, self.d_out) for layer in (self.W_query, self.W_key, self.W_value))


class _OutProjection(torch.autograd.Function):
    """y = x @ W.T + b with a hand-written backward that flattens grad_output with view()."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.view(-1, grad.shape[-1])  # (b*T, d_out): fails for a non-contiguous grad_output
        return grad @ weight, g2.t() @ x.reshape(-1, x.shape[-1]), g2.sum(0)


class ViewOnGradient(Baseline):
    """Bug: a custom autograd output projection whose backward calls view() on the incoming gradient."""

    def output(self, context, x):
        return _OutProjection.apply(context, self.out_proj.weight, self.out_proj.bias)


# --- side effects ---------------------------------------------------------------------------------

class WritesIntoInput(Baseline):
    """Bug: the inference fast path writes the output projection into x's buffer to save an allocation."""

    def output(self, context, x):
        if torch.is_grad_enabled() or x.shape[-1] != self.d_out or not x.is_contiguous():
            return self.out_proj(context)
        b, T, _ = context.shape
        torch.addmm(self.out_proj.bias, context.reshape(b * T, -1), self.out_proj.weight.t(), out=x.view(b * T, -1))
        return x


class FoldsScaleIntoWeights(Baseline):
    """Bug: for inference, folds 1/sqrt(head_dim) into W_query's weights in place (once) instead of scaling scores."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.folded = False

    def scores(self, q, k):
        if not torch.is_grad_enabled() and not self.folded:
            q = q / math.sqrt(self.head_dim)  # this call's queries were projected before the fold
            self.W_query.weight.mul_(1 / math.sqrt(self.head_dim))
            if self.W_query.bias is not None:
                self.W_query.bias.mul_(1 / math.sqrt(self.head_dim))
            self.folded = True
            return q @ k.transpose(-2, -1)
        if self.folded:
            return q @ k.transpose(-2, -1)
        return super().scores(q, k)


# --- state across calls ---------------------------------------------------------------------------

class FirstShapeMaskCache(Baseline):
    """Bug: the additive mask is built on the first call and reused for every later call, whatever its length."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.additive = None

    def mask(self, scores):
        if self.additive is None:
            T = scores.shape[-1]
            self.additive = torch.zeros(T, T, dtype=scores.dtype, device=scores.device).masked_fill(
                self.future[:T, :T], float("-inf"))
        return scores + self.additive


class StaleProjectionCache(Baseline):
    """Bug: caches the K/V projections keyed on (data_ptr, shape) of the input: a reused buffer gets stale keys."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.kv_cache = {}

    def project(self, x):
        key = (x.data_ptr(), tuple(x.shape))
        if torch.is_grad_enabled() or key not in self.kv_cache:
            self.kv_cache[key] = (self.W_key(x), self.W_value(x))
        k, v = self.kv_cache[key]
        return self.W_query(x), k, v


# --- low precision --------------------------------------------------------------------------------

class InputDtypeAccumulator(Baseline):
    """Bug: a streaming (one key at a time) online softmax whose running sums stay in the input dtype."""

    def attend(self, q, k, v):
        T = q.shape[-2]
        m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)  # (b, nh, T, 1)
        denom = torch.zeros_like(m)
        acc = torch.zeros_like(q)  # (b, nh, T, hd), in q's dtype: float16 sums lose the small terms
        rows = torch.arange(T, device=q.device)[:, None]
        for j in range(T):
            s = (q @ k[..., j:j + 1, :].transpose(-2, -1)) / math.sqrt(self.head_dim)  # (b, nh, T, 1)
            s = s.masked_fill(rows < j, float("-inf"))
            m_new = torch.maximum(m, s)
            alpha = torch.exp(m - m_new).nan_to_num(0.0)
            e = torch.exp(s - m_new).nan_to_num(0.0)
            acc = acc * alpha + self.drop(e) * v[..., j:j + 1, :]
            denom = denom * alpha + e
            m = m_new
        return acc / denom


class WeightedSumLoop(Baseline):
    """Bug: mixes the values in a loop over keys (to skip the T x T @ v matmul) with the running sum in the input dtype."""

    def attend(self, q, k, v):
        weights = self.drop(self.softmax(self.mask(self.scores(q, k))))  # (b, nh, T, T)
        acc = torch.zeros_like(q)  # (b, nh, T, hd) in q's dtype
        for j in range(q.shape[-2]):
            acc = acc + weights[..., j:j + 1] * v[..., j:j + 1, :]
        return acc
