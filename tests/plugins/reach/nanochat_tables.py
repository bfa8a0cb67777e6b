"""nanochat's forward conventions, without its QK-norm and its rotation by -theta: ``forward(x, ve, cos_sin,
window_size)`` with value embeddings ``ve`` (None when the model has none for this layer), rotary tables passed as
one ``cos_sin`` tuple of ``(1, T, 1, head_dim/2)`` tensors (each frequency once), q/k in ``(B, T, H, D)``, and a
flash-attention style ``(left, right)`` window (-1 = unlimited)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    assert x.ndim == 4
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], 3)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head, self.n_kv_head, self.n_embd = config.n_head, config.n_kv_head, config.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.c_q = nn.Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, bias=False)

    def forward(self, x, ve, cos_sin, window_size):
        assert ve is None
        B, T, _ = x.shape
        cos, sin = cos_sin
        q = rotate(self.c_q(x).view(B, T, self.n_head, self.head_dim), cos, sin).transpose(1, 2)
        k = rotate(self.c_k(x).view(B, T, self.n_kv_head, self.head_dim), cos, sin).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        i = torch.arange(T)
        keep = i[None, :] <= i[:, None]
        if window_size[0] >= 0:
            keep = keep & (i[:, None] - i[None, :] <= window_size[0])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_embd))
