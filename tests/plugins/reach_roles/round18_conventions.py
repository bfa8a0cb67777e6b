"""Conventions of the eleventh corpus's last refused classes (a development set, issue 46, round 18; our own code):

- ``KeywordMaskOuter(dim_q, dim_kv, n_head, attn_module=None, add_bias=True)``: torchmultimodal's VideoGPT-style
  layer. Its ``forward(q, kv=None, return_attn_weights=False, use_cache=False, causal=False, **attn_kwargs)`` names no
  mask; the mask reaches its inner ``KeywordMaskInner`` only through ``**attn_kwargs`` as ``attention_mask``, a float
  keep-mask (1 = attend). ``causal=True`` only switches step-wise caching: it masks nothing.
- ``DataclassOutput(embed_dim, num_heads, causal, num_kv_heads=None)``: rafidka's layer: ``forward(x, attn_mask=None,
  kv_cache=None)`` returns a dataclass ``(output, kv_cache)``, not a tuple; ``attn_mask`` is a ``(B, T)`` padding mask,
  causality the constructor's ``causal``.
- ``UpdateAtPosition(config)`` (in ``round18_position.py``, a module without a config class, as in its repository).
"""

import dataclasses

import torch
from torch import nn


class KeywordMaskInner(nn.Module):
    """Scaled dot-product attention on ``(b, h, t, d)`` with an optional float keep-mask."""

    def forward(self, q, k, v, attention_mask=None, head_mask=None):
        att = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if attention_mask is not None:
            att = att.masked_fill(attention_mask == 0, float("-inf"))
        return att.softmax(dim=-1) @ v


class KeywordMaskOuter(nn.Module):
    def __init__(self, dim_q: int, dim_kv: int, n_head: int, attn_module: nn.Module | None = None,
                 add_bias: bool = True) -> None:
        super().__init__()
        self.n_head, self.d_k = n_head, dim_q // n_head
        self.query = nn.Linear(dim_q, n_head * self.d_k, bias=add_bias)
        self.key = nn.Linear(dim_kv, n_head * self.d_k, bias=add_bias)
        self.value = nn.Linear(dim_kv, n_head * self.d_k, bias=add_bias)
        self.output = nn.Linear(n_head * self.d_k, dim_q, bias=True)
        self.attn = attn_module if attn_module is not None else KeywordMaskInner()

    def _heads(self, t):
        return t.unflatten(-1, (self.n_head, self.d_k)).transpose(1, 2)

    def forward(self, q, kv=None, return_attn_weights=False, use_cache=False, causal=False, **attn_kwargs):
        kv = q if kv is None else kv
        out = self.attn(self._heads(self.query(q)), self._heads(self.key(kv)), self._heads(self.value(kv)),
                        **attn_kwargs)
        return self.output(out.transpose(1, 2).flatten(-2))


@dataclasses.dataclass
class AttentionOutput:
    output: torch.Tensor
    kv_cache: tuple


class DataclassOutput(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, causal: bool, num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.causal = num_heads, embed_dim // num_heads, causal
        self.num_kv_heads = num_kv_heads or num_heads
        self.W_q = nn.Linear(embed_dim, embed_dim)
        self.W_k = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim)
        self.W_v = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim)
        self.W_o = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_mask=None, kv_cache=None) -> AttentionOutput:
        b, t, _ = x.shape
        q = self.W_q(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_k(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.W_v(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)
        rep = self.num_heads // self.num_kv_heads
        keys, values = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ keys.transpose(-2, -1) / self.head_dim ** 0.5
        total = keys.shape[2]
        if self.causal:
            scores = scores.masked_fill(torch.arange(total)[None, :] > torch.arange(total - t, total)[:, None],
                                        float("-inf"))
        if attn_mask is not None:  # (B, T): 0 = padding
            scores = scores.masked_fill(attn_mask[:, None, None, :] == 0, float("-inf"))
        out = (scores.softmax(dim=-1) @ values).transpose(1, 2).reshape(b, t, -1)
        return AttentionOutput(self.W_o(out), (k, v))
