"""Correct attention that is *not* batch-invariant or *not* deterministic, only in the last bits (issue 48).

Each class computes causal multi-head attention right to float32 rounding (every correctness case passes); what
differs is the order in which the output projection adds the heads' contributions, as a kernel whose split of a
reduction depends on the batch size (split-K chosen by shape) or on the call (atomics finishing in any order) does:

* ``BatchVariant``: the heads are added in an order that depends on the batch size;
* ``Nondeterministic``: the heads are added in an order that changes from call to call;
* ``DeclaresInvariant``: ``BatchVariant`` that declares ``batch_invariant`` and ``deterministic`` (a false claim:
  its ``batch_invariant`` case fails);
* ``PerSequenceLoop``: each sequence computed alone in a loop, in a fixed order: bitwise batch-invariant and
  deterministic, and it says so.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F


class _HeadSum(nn.Module):
    """The book's projections; the output projection adds the heads in the order :meth:`order` gives."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.d_out, self.head_dim = num_heads, d_out, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def order(self, batch: int) -> list[int]:
        """The order the heads' contributions are added in."""
        return list(range(self.num_heads))

    def forward(self, x):
        b, T, _ = x.shape

        def heads(t):
            return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (b, nh, T, hd)

        context = F.scaled_dot_product_attention(heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x)),
                                                 is_causal=True)  # (b, nh, T, hd)
        w = self.out_proj.weight.unflatten(1, (self.num_heads, self.head_dim))  # (d_out, nh, hd)
        out = self.out_proj.bias.expand(b, T, self.d_out)
        for h in self.order(b):
            out = out + context[:, h] @ w[:, h].T  # (b, T, d_out): the sum's order decides the last bits
        return out


class BatchVariant(_HeadSum):
    """Heads added last to first in a batch of more than one sequence."""

    def order(self, batch: int) -> list[int]:
        return list(range(self.num_heads))[:: -1 if batch > 1 else 1]


class Nondeterministic(_HeadSum):
    """Heads added in a rotated order that advances with every call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._calls = itertools.count()

    def order(self, batch: int) -> list[int]:
        k = next(self._calls) % self.num_heads
        return list(range(k, self.num_heads)) + list(range(k))


class DeclaresInvariant(BatchVariant):
    """``BatchVariant`` claiming properties it does not have."""

    attnbench_properties = ("batch_invariant", "deterministic")


class PerSequenceLoop(_HeadSum):
    """Each sequence alone, one after another (the heads in a fixed order)."""

    attnbench_properties = ("batch_invariant", "deterministic")

    def forward(self, x):
        return torch.cat([super(PerSequenceLoop, self).forward(x[i:i + 1]) for i in range(x.shape[0])])
