"""Conventions of the eleventh corpus's classes (a development set, issue 46, round 17; our own code):

- ``RopeBaseRequired(n_heads, d_model, rope_base)``: a from-scratch GPT whose constructor requires the RoPE base and
  whose forward ``(x, cache=None)`` returns ``(out, cache)``: it always rotates, so ``rope_base=None`` (a case without
  RoPE) cannot build it; the causal probe builds it with a theta.
- ``OneTokenDecoder(args)``: Meta's reference Llama ``Attention``: ``forward(x, start_pos, freqs_cis)`` writes its
  ``cache_k``/``cache_v`` and masks nothing, written for one token at a time: meant to be causal (it keeps a decoder's
  cache), so it is checked, and fails its causal cases, rather than refused.
- ``DerivedGroups(config)`` (in ``round17_groups.py``, a module without a config class of its own, as in that
  repository): a Qwen3-from-scratch layer reading ``config.n_kv_groups`` and ``config.d_k``, which its own config class
  derives in ``__post_init__``; the config attnbench builds carries heads per kv head under that name.
"""

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F


def _rotate(x, base, start=0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(start, start + x.shape[-2], dtype=torch.float64), inv)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(x.dtype) for f in (torch.cos, torch.sin))
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class RopeBaseRequired(nn.Module):
    def __init__(self, n_heads: int, d_model: int, rope_base: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_base = n_heads, d_model // n_heads, rope_base
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.inv = 1.0 / rope_base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)  # needs the base

    def forward(self, x, cache=None):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv_proj(x).chunk(3, -1))
        q, k = _rotate(q, self.rope_base), _rotate(k, self.rope_base)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1)), cache


@dataclasses.dataclass
class DecoderArgs:
    dim: int = 64
    n_heads: int = 4
    max_batch_size: int = 2
    max_seq_len: int = 32


class OneTokenDecoder(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        shape = (args.max_batch_size, args.max_seq_len, self.n_heads, self.head_dim)
        self.cache_k, self.cache_v = torch.zeros(shape), torch.zeros(shape)

    def forward(self, x, start_pos: int):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos:start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, :start_pos + seqlen].transpose(1, 2)
        values = self.cache_v[:bsz, :start_pos + seqlen].transpose(1, 2)
        scores = xq.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        out = scores.softmax(-1) @ values
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
