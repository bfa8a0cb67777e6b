"""An encoder's attention (issue 46, round 20), in our own code: every token attends to every token. timm's ViT
``Attention(dim, num_heads, qkv_bias)`` with a fused ``qkv`` and ``forward(x)``; a BERT-style layer with an optional
``(B, T)`` key-padding mask; the same ViT layer with its scale planted wrong (it must fail, and be localised); and a
causal layer whose mask line is gone but whose ``tril`` buffer says it is meant to be causal (it must fail, not pass as
an encoder)."""

import torch
from torch import nn


class EncoderAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def scores(self, q, k):
        return (q @ k.transpose(-2, -1)) * self.scale

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj((self.scores(q, k).softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, C))


class EncoderScaleWrong(EncoderAttention):
    def scores(self, q, k):
        return (q @ k.transpose(-2, -1)) * self.scale ** 2


class PaddingMaskEncoder(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.heads, self.size = num_attention_heads, hidden_size // num_attention_heads
        self.query, self.key, self.value = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        B, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, T, self.heads, self.size).transpose(1, 2)
                   for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / self.size ** 0.5
        if attention_mask is not None:
            scores = scores + (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * -10000.0
        return self.dense((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


class CausalMaskLineGone(EncoderAttention):
    def __init__(self, dim, num_heads=8, qkv_bias=False, context_length=64):
        super().__init__(dim, num_heads, qkv_bias)
        self.register_buffer("bias", torch.tril(torch.ones(context_length, context_length)), persistent=False)
