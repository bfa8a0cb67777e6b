"""Reproduces the input convention of facebookresearch/segment-anything's image-encoder ``Attention`` (no code copied;
written for attnbench's tests): a correct multi-head attention over the pixels of an image, which its forward takes as
``(B, H, W, C)`` (channels last) and unpacks as ``B, H, W, _ = x.shape``; and the channels-first ``(B, C, H, W)`` form
of convolutional backbones. Neither takes a token sequence ``(B, T, C)``: a sequence raises while it is unpacked.
"""

from __future__ import annotations

import torch
from torch import nn


def attend(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head attention over the tokens of ``qkv`` ``(b, n, 3c)``: ``(b, n, c)``."""
    b, n, _ = qkv.shape
    q, k, v = qkv.view(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)  # (b, heads, n, hd)
    out = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, n, -1)


class ChannelsLastImageAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, use_rel_pos: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        return self.proj(attend(self.qkv(x).view(B, H * W, 3 * C), self.num_heads).view(B, H, W, C))


class ChannelsFirstImageAttention(ChannelsLastImageAttention):
    def __init__(self, channels: int, heads: int = 4):
        super().__init__(channels, heads, qkv_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (b, hw, c)
        return self.proj(attend(self.qkv(tokens), self.num_heads)).transpose(1, 2).reshape(b, c, h, w)
