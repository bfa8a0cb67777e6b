"""Reproduces microsoft/LoRA's ``examples/NLG/src/model.py:Attention(nx, n_ctx, config, scale=False)``: GPT-2's
attention whose constructor also reads LoRA fields of its config (``config.lora_attn_alpha``), which no spec field
fills: guessed 0 (off), after which the width ``nx`` no name tells is solved by a probe. Our own code."""

import math

import torch
from torch import nn


class LoraFieldAttention(nn.Module):
    def __init__(self, nx, n_ctx, config, scale=False):
        super().__init__()
        assert nx % config.n_head == 0
        self.n_head, self.scale = config.n_head, scale
        self.alpha = config.lora_attn_alpha  # a LoRA setting: no spec field fills it
        self.c_attn = nn.Linear(nx, 3 * nx)
        self.c_proj = nn.Linear(nx, nx)
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        w = q @ k.transpose(-2, -1) / (math.sqrt(v.size(-1)) if self.scale else 1.0)
        w = w.masked_fill(self.bias[:T, :T] == 0, float("-inf"))
        return self.c_proj((w.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))
