"""Multi-head attention plug-ins with one real bug each, for testing that the correctness matrix catches them.

``Baseline`` is a correct causal multi-head attention, written in small steps (project, split heads,
score, scale, mask, softmax, dropout, mix values, merge heads, project out). Every other class
overrides exactly one step with a bug of a kind that has shipped in public attention benchmarks. All
of them keep the book's constructor and attribute names (``W_query``, ``W_key``, ``W_value``,
``out_proj``), so canonical weights load without an adapter, and none declares capabilities: like a
user's class, each claims backward and dropout everywhere.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Baseline(nn.Module):
    """Correct reference for the buggy variants below (each overrides one step)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_in, self.d_out, self.num_heads, self.head_dim = d_in, d_out, num_heads, d_out // num_heads
        self.p = dropout
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("future", torch.ones(context_length, context_length, dtype=torch.bool).triu(1),
                             persistent=False)  # True above the diagonal: masked_fill's meaning

    # -- the steps ---------------------------------------------------------------------------------
    def project(self, x, layer: nn.Linear):
        return layer(x)  # (b, T, d_out)

    def split(self, t):
        b, T, _ = t.shape
        return t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)

    def scale(self, scores):
        return scores / math.sqrt(self.head_dim)

    def mask(self, scores):
        T = scores.shape[-1]
        return scores.masked_fill(self.future[:T, :T], float("-inf"))

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)

    def drop(self, weights):
        return self.dropout(weights)

    def attend(self, q, k, v):
        weights = self.drop(self.softmax(self.mask(self.scale(q @ k.transpose(-2, -1)))))  # (b, nh, T, T)
        return weights @ v  # (b, nh, T, hd)

    def merge(self, context):
        b, _, T, _ = context.shape
        return context.transpose(1, 2).contiguous().view(b, T, self.d_out)  # (b, T, d_out)

    def finish(self, out):
        return out

    def forward(self, x):
        q = self.split(self.project(x, self.W_query))
        k = self.split(self.project(x, self.W_key))
        v = self.split(self.project(x, self.W_value))
        return self.finish(self.out_proj(self.merge(self.attend(q, k, v))))


class InvertedMaskSDPA(Baseline):
    """Bug: passes the triu mask (True = masked, masked_fill's meaning) to SDPA, where True means "may attend"."""

    def attend(self, q, k, v):
        T = q.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.future[:T, :T],
                                              dropout_p=self.p if self.training else 0.0)


class NoMask(Baseline):
    """Bug: forgets the causal mask (every token attends to the future)."""

    def mask(self, scores):
        return scores


class ScaleByDout(Baseline):
    """Bug: scales scores by sqrt(d_out) instead of sqrt(head_dim) (right only with one head)."""

    def scale(self, scores):
        return scores / math.sqrt(self.d_out)


class NoScale(Baseline):
    """Bug: no 1/sqrt(head_dim) scaling at all (right only when head_dim == 1)."""

    def scale(self, scores):
        return scores


class HeadsMixedByView(Baseline):
    """Bug: splits heads with view(b, nh, T, hd) directly, mixing tokens and heads (right only with one head)."""

    def split(self, t):
        b, T, _ = t.shape
        return t.view(b, self.num_heads, T, self.head_dim)


class WeightOrientation(Baseline):
    """Bug: einsum with the nn.Linear weight un-transposed: x @ W instead of x @ W.T (only runs when d_in == d_out)."""

    def project(self, x, layer: nn.Linear):
        out = torch.einsum("bti,io->bto", x, layer.weight)
        return out if layer.bias is None else out + layer.bias


class _SoftmaxDropsTerm(torch.autograd.Function):
    """Softmax with a right forward and a backward that drops the ``- y * sum(g * y)`` term."""

    @staticmethod
    def forward(ctx, scores):
        y = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return y * grad  # should be y * (grad - (grad * y).sum(-1, keepdim=True))


class WrongSoftmaxGrad(Baseline):
    """Bug: a custom autograd softmax whose backward is wrong; every forward is right."""

    def softmax(self, scores):
        return _SoftmaxDropsTerm.apply(scores)


class DropoutIgnored(Baseline):
    """Bug: builds nn.Dropout but never applies it, while claiming attention dropout."""

    def drop(self, weights):
        return weights


class DropoutInEval(Baseline):
    """Bug: F.dropout(training=True) keeps dropping attention weights in eval mode."""

    def drop(self, weights):
        return F.dropout(weights, self.p, training=True)


class NonFiniteMask(Baseline):
    """Bug: additive mask built as triu(ones) * -inf, which is 0 * -inf = nan below the diagonal."""

    def mask(self, scores):
        T = scores.shape[-1]
        additive = torch.triu(torch.ones(T, T, dtype=scores.dtype, device=scores.device), diagonal=1) * float("-inf")
        return scores + additive


class SqueezedBatch(Baseline):
    """Bug: squeeze(0) drops the batch dimension of a single example: (1, T, d_out) comes back as (T, d_out)."""

    def finish(self, out):
        return out.squeeze(0)
