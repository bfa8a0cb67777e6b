"""gpt-fast's conventions: ``Attention(config: ModelArgs)`` with its own dataclass (``n_local_heads`` = key/value heads,
-1 meaning "as many as n_head"; ``dim``; ``head_dim`` recomputed in ``__post_init__``), one fused ``wqkv`` and ``wo``."""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = None

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.dim
        self.head_dim = self.dim // self.n_head


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        assert config.dim % config.n_head == 0
        total = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.n_head, self.head_dim, self.n_local_heads, self.dim = (config.n_head, config.head_dim,
                                                                    config.n_local_heads, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class FrozenAttention(Attention):
    """The same layer with its weights frozen (``requires_grad=False``): they are still its weights."""

    def __init__(self, config: ModelArgs):
        super().__init__(config)
        for p in self.parameters():
            p.requires_grad_(False)


assert torch.is_tensor(torch.zeros(1))
