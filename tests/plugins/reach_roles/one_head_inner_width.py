"""lucidrains' g-mlp ``Attention(dim_in, dim_out, dim_inner, causal=False)``: one head (no parameter sets heads),
an inner width ``dim_inner`` that no name says is the output's, and causality by a constructor flag; and GPT-1's
``Attention(nx, n_ctx, cfg, scale=False)``: a config object beside plain arguments, the width under a name no alias
holds, its scores unscaled unless ``scale=True`` (reproduced, not copied)."""

import math

import torch
from torch import nn


class OneHeadInner(nn.Module):
    def __init__(self, dim_in, dim_out, dim_inner, causal=False):
        super().__init__()
        self.scale = dim_inner ** -0.5
        self.causal = causal
        self.to_qkv = nn.Linear(dim_in, dim_inner * 3, bias=False)
        self.to_out = nn.Linear(dim_inner, dim_out)

    def forward(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        if self.causal:
            mask = torch.ones(sim.shape[-2:], device=x.device).triu(1).bool()
            sim = sim.masked_fill(mask[None, ...], -torch.finfo(q.dtype).max)
        return self.to_out(torch.einsum("b i j, b j d -> b i d", sim.softmax(dim=-1), v))


class ConfigBesideWidth(nn.Module):
    def __init__(self, nx, n_ctx, cfg, scale=False):
        super().__init__()
        assert nx % cfg.n_head == 0
        self.register_buffer("b", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.n_head, self.split_size, self.scale = cfg.n_head, nx, scale
        self.c_attn = nn.Linear(nx, nx * 3)
        self.c_proj = nn.Linear(nx, nx)
        self.attn_dropout = nn.Dropout(cfg.attn_pdrop)

    def _attn(self, q, k, v):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        b = self.b[:, :, :w.size(-2), :w.size(-1)]
        w = w * b + -1e9 * (1 - b)
        return torch.matmul(self.attn_dropout(w.softmax(dim=-1)), v)

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x):
        query, key, value = self.c_attn(x).split(self.split_size, dim=2)
        a = self._attn(self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value))
        a = a.permute(0, 2, 1, 3).contiguous()
        return self.c_proj(a.view(*a.size()[:-2], a.size(-2) * a.size(-1)))


class ConfigBesideWidthScaled(ConfigBesideWidth):
    def __init__(self, nx, n_ctx, cfg, scale=True):
        super().__init__(nx, n_ctx, cfg, scale)
