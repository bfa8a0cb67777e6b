"""Built from nested config objects; a REQUIRED mask parameter with a plural name, typed Optional, that must be None
on the SDPA path (causal there by a flag of the inner attention).

Reproduces the convention of pytorch/torchtitan ``torchtitan/models/common/attention.py:GQAttention`` (commit
b5bcd76): the constructor takes one ``Config`` holding sub-configs (the q/k/v projection, the output projection, the
rotary embedding and the inner attention, each with its own fields); ``forward(x, attention_masks, positions=None)``
where ``attention_masks`` (a BlockMask for flex attention, varlen metadata, or None) has no default and the SDPA
inner attention refuses anything but None (its ``is_causal=True`` sets causality); ``positions`` optional per-token
positions for the rotary table the module owns (half-split pairs). Our own code, written for attnbench's tests.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ProjConfig:
    in_features: int = 512
    out_features: int = 512
    bias: bool = False

    def build(self):
        return nn.Linear(self.in_features, self.out_features, bias=self.bias)


@dataclass
class RotaryConfig:
    head_dim: int = 64
    max_seq_len: int = 1024
    theta: float = 10000.0


@dataclass
class InnerConfig:
    is_causal: bool = True


@dataclass
class NestedAttentionConfig:
    n_heads: int = 8
    n_kv_heads: int = 8
    dim: int = 512
    head_dim: int = 64
    wq: ProjConfig = field(default_factory=lambda: ProjConfig(512, 512))
    wk: ProjConfig = field(default_factory=lambda: ProjConfig(512, 512))
    wv: ProjConfig = field(default_factory=lambda: ProjConfig(512, 512))
    wo: ProjConfig = field(default_factory=lambda: ProjConfig(512, 512))
    rope: RotaryConfig = field(default_factory=RotaryConfig)
    inner_attention: InnerConfig = field(default_factory=InnerConfig)


class OwnRotary(nn.Module):
    def __init__(self, cfg: RotaryConfig):
        super().__init__()
        inv = 1.0 / (cfg.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, q, k, positions=None):
        t = q.shape[1]
        idx = torch.arange(t, device=q.device) if positions is None else positions.reshape(-1)[-t:]
        cos, sin = self.cos[idx][None, :, None].to(q.dtype), self.sin[idx][None, :, None].to(q.dtype)

        def turn(x):
            a, b = x.chunk(2, dim=-1)
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        return turn(q), turn(k)


class NestedConfigAttention(nn.Module):
    def __init__(self, config: NestedAttentionConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq, self.wk, self.wv, self.wo = (c.build() for c in (config.wq, config.wk, config.wv, config.wo))
        self.rope = OwnRotary(config.rope)
        self.is_causal = config.inner_attention.is_causal

    def forward(self, x: torch.Tensor, attention_masks: Optional[object], positions: Optional[torch.Tensor] = None):
        if attention_masks is not None:
            raise ValueError("the SDPA inner attention takes no attention_masks; causality is its is_causal flag")
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = self.rope(q, k, positions)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=self.is_causal, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))
