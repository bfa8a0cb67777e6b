"""Conventions of the fourteenth corpus (a development set; issue 46, round 19), each reproduced in our own code:

- ``ScoresThenOutput(hidden_size, num_heads, num_kv_heads, head_dim)``: TimesFM's ``forward(hidden_states, mask)``
  with an additive mask, returning ``(scores, output)``: the output second.
- ``PaddingMaskRequired(embed_size, num_heads, context_size, attn_dropout, resid_dropout)``: d3rlpy's required
  ``(B, T)`` padding mask added ``* -10000``, the future hidden by the class's own buffer.
- ``RequiredFlag(config)``: lag-llama's ``forward(x, use_kv_cache: bool)`` with no default, and a config whose
  width is ``n_embd_per_head * n_head``.
- ``LiteralNorm(dim, dim_heads=64, causal=False, qk_norm: Literal[...] = "none")``: stable-audio's string choices
  for its QK-norm, and its heads as ``dim // dim_heads``.
- ``DropoutModuleArgument(input_dim, head_dim, output_dim, head_num, dropout: nn.Module)``: DI-engine's dropout passed
  as a module, its projections inside ``nn.Sequential``.
- ``EmptyQueryScale``: a per-dimension query scale made with ``torch.empty`` and no canonical counterpart: refused
  naming it, not as "not causal" after its garbage values gave no output.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F


class ScoresThenOutput(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = nn.Linear(self.q_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor):
        b, t, _ = hidden_states.shape
        xq, xk, xv = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = xq.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = xk.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = xv.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = F.softmax(q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask, dim=-1)
        output = (scores @ v).transpose(1, 2).reshape(b, t, -1)
        return scores, self.o_proj(output)


class EmptyQueryScale(ScoresThenOutput):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim)
        self.scaling = nn.Parameter(torch.empty((head_dim,)).fill_(float("nan")))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor):
        return super().forward(hidden_states * 1.0, mask + 0.0 * self.scaling.sum())


class PaddingMaskRequired(nn.Module):
    def __init__(self, embed_size: int, num_heads: int, context_size: int, attn_dropout: float, resid_dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_size, 3 * embed_size)
        self.proj = nn.Linear(embed_size, embed_size)
        self.attn_dropout, self.resid_dropout = nn.Dropout(attn_dropout), nn.Dropout(resid_dropout)
        self.register_buffer("causal", torch.tril(torch.ones(context_size, context_size))[None, None])

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert attention_mask.dim() == 2, f"Expects (B, T), but got {attention_mask.shape}"
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1))
        attention = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])
        attention = attention.masked_fill(self.causal[..., :t, :t] == 0, float("-inf"))
        attention = attention + attention_mask.view(b, 1, 1, t) * -10000
        y = self.attn_dropout(F.softmax(attention, dim=-1)) @ v
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


@dataclass
class FlagConfig:
    block_size: int = 2048
    n_head: int = 32
    n_embd_per_head: int = 128
    dropout: float = 0.0


class RequiredFlag(nn.Module):
    def __init__(self, config: FlagConfig):
        super().__init__()
        width = config.n_embd_per_head * config.n_head
        self.n_head, self.dropout = config.n_head, config.dropout
        self.q_proj = nn.Linear(width, width, bias=False)
        self.kv_proj = nn.Linear(width, 2 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.kv_cache = None

    def forward(self, x: torch.Tensor, use_kv_cache: bool) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, -1).transpose(1, 2)
        k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.kv_proj(x).split(c, dim=2))
        if use_kv_cache:
            raise NotImplementedError("decoding with its own cache")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class LiteralNorm(nn.Module):
    def __init__(self, dim, dim_heads=64, causal=False, qk_norm: Literal["l2", "ln", "none"] = "none"):
        super().__init__()
        if qk_norm not in ("l2", "ln", "none"):
            raise ValueError(f'qk_norm must be one of ["l2", "ln", "none"], got {qk_norm}')
        self.num_heads, self.causal, self.qk_norm = dim // dim_heads, causal, qk_norm
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, causal=None):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in self.to_qkv(x).chunk(3, dim=-1))
        if self.qk_norm == "l2":
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal if causal is None else causal)
        return self.to_out(y.transpose(1, 2).reshape(b, t, c))


class DropoutModuleArgument(nn.Module):
    def __init__(self, input_dim: int, head_dim: int, output_dim: int, head_num: int, dropout: nn.Module) -> None:
        super().__init__()
        self.head_num, self.head_dim = head_num, head_dim
        self.dropout = dropout
        self.attention_pre = nn.Sequential(nn.Linear(input_dim, head_dim * head_num * 3))
        self.project = nn.Sequential(nn.Linear(head_dim * head_num, output_dim))

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.head_num, self.head_dim).transpose(1, 2)
                   for z in self.attention_pre(x).chunk(3, dim=-1))
        attention = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            attention = attention.masked_fill(~mask, float("-inf"))
        attention = self.dropout(F.softmax(attention, dim=-1))
        return self.project((attention @ v).transpose(1, 2).reshape(b, t, -1))


@dataclass
class GroupConfig:
    n_head: int = 6
    n_embd: int = 768
    head_dim: int = 128
    group_size: int = 1


class GroupSizeConfig(nn.Module):
    """T6's ``llama-gqa.py``: query heads per kv head read from the config as ``group_size`` (guessed 0 before, a
    ZeroDivisionError in the constructor)."""

    def __init__(self, config: GroupConfig):
        super().__init__()
        self.n_head, self.head_dim, self.group_size = config.n_head, config.head_dim, config.group_size
        self.c_q = nn.Linear(config.n_embd, self.head_dim * self.n_head, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.head_dim * self.n_head // self.group_size, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.head_dim * self.n_head // self.group_size, bias=False)
        self.c_proj = nn.Linear(self.head_dim * self.n_head, config.n_embd, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.c_q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(b, t, self.n_head // self.group_size, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(b, t, self.n_head // self.group_size, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))
