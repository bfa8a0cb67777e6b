"""gpt-fast's conventions: ``Attention(config: ModelArgs)`` with its own dataclass (``n_local_heads`` = key/value heads,
-1 meaning "as many as n_head"; ``dim``; ``head_dim`` recomputed in ``__post_init__``), one fused ``wqkv`` and ``wo``."""

from dataclasses import dataclass

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
    intermediate_size: int | None = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5
    rope_scaling: dict | None = None

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


class KVCache(nn.Module):
    """gpt-fast's cache convention: preallocated ``(B, H, max_len, D)`` buffers written in place at ``input_pos``;
    ``update`` returns the whole buffers (the model's mask hides the slots not written yet)."""

    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        assert input_pos.shape[0] == k_val.shape[2]
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


def rotate_pairs(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Interleaved pairs rotated by a *real* table ``(T, head_dim // 2, 2)`` of (cos, sin), in float32."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = freqs_cis.view(1, pairs.size(1), 1, pairs.size(3), 2)
    real = pairs[..., 0] * table[..., 0] - pairs[..., 1] * table[..., 1]
    imag = pairs[..., 1] * table[..., 0] + pairs[..., 0] * table[..., 1]
    return torch.stack([real, imag], -1).flatten(3).type_as(x)


class CachedAttention(Attention):
    """gpt-fast's forward: ``forward(x, freqs_cis, mask, input_pos=None)``, the cache installed by the model as
    ``attn.kv_cache`` (``None`` when built) and advanced by ``update(input_pos, k, v)``."""

    def __init__(self, config: ModelArgs):
        super().__init__(config)
        self.kv_cache = None

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Tensor | None = None) -> Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = rotate_pairs(q.view(bsz, seqlen, self.n_head, self.head_dim), freqs_cis).transpose(1, 2)
        k = rotate_pairs(k.view(bsz, seqlen, self.n_local_heads, self.head_dim), freqs_cis).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))
