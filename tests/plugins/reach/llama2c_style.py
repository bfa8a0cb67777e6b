"""llama2.c's attention conventions, written for attnbench's tests: ``Attention(args: ModelArgs)`` with ``dim``,
``n_heads``, ``n_kv_heads``, ``max_seq_len``; ``wq``/``wk``/``wv``/``wo``; ``forward(x, freqs_cos, freqs_sin)`` with
real per-frequency tables ``(T, head_dim/2)`` applied to interleaved pairs ``(2j, 2j + 1)``; causal by itself.
``HalfPairs`` applies the same tables to the pairs ``(j, j + head_dim/2)``: the pairing is the class's, measured."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class ModelArgs:
    dim: int = 288
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int | None = None
    max_seq_len: int = 256


def pairs_interleaved(x, cos, sin):
    a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(3).type_as(x)


def pairs_half(x, cos, sin):
    a, b = x.chunk(2, -1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class Attention(nn.Module):
    turn = staticmethod(pairs_interleaved)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cos, freqs_sin):
        B, T, _ = x.shape
        q = self.turn(self.wq(x).view(B, T, self.n_heads, self.head_dim), freqs_cos, freqs_sin)
        k = self.turn(self.wk(x).view(B, T, self.n_kv_heads, self.head_dim), freqs_cos, freqs_sin)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class HalfPairs(Attention):
    turn = staticmethod(pairs_half)
