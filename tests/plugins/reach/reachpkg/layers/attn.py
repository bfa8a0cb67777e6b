"""nanochat's constructor, config and weight conventions: ``CausalSelfAttention(config, layer_idx)`` next to a
``GPTConfig`` dataclass (``n_head``, ``n_kv_head``, ``n_embd``, ``sequence_len``), ``c_q``/``c_k``/``c_v``/``c_proj``
projections; imported as ``reachpkg.layers.attn`` (absolute, relative and in-function imports)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from reachpkg.common import COMPUTE_DTYPE

from .helpers import Linear


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.n_embd = config.n_head, config.n_kv_head, config.n_embd
        self.head_dim = self.n_embd // self.n_head
        assert self.n_embd % self.n_head == 0 and self.n_head % self.n_kv_head == 0
        self.c_q = Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = Linear(self.n_embd, self.n_embd, bias=False)

    def forward(self, x):
        from reachpkg.common import rms  # imported when it runs: the package root must stay importable

        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        assert rms is not None and COMPUTE_DTYPE is torch.float32
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_embd))
