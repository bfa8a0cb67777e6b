"""A cache the caller preallocates and passes in, written at a tensor of write positions; an additive mask over the
whole cache.

Reproduces the convention of google/gemma_pytorch ``gemma/model.py:GemmaAttention`` (commit 014acb7): the constructor
takes ``(config, attn_type)`` with an Enum attention type; weights are frozen, uninitialised parameters
(``torch.empty``, ``requires_grad=False``) of a fused ``qkv_proj`` and an ``o_proj`` without bias; ``forward(
hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask=None)``: ``freqs_cis`` complex
``(T, head_dim/2)`` for the step's positions, rotating half-split pairs; ``kv_write_indices`` a LongTensor ``(T,)``;
``kv_cache`` a REQUIRED pair of ``(B, T_max, H_kv, D)`` tensors written in place with ``index_copy_``; ``mask`` a
REQUIRED additive float ``(B, 1, T, T_max)`` covering every slot of the cache (unwritten slots hidden); scores in
float32 for the softmax. Our own code, written for attnbench's tests.
"""
import dataclasses
import enum
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass
class SlotConfig:
    hidden_size: int = 512
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    max_position_embeddings: int = 1024
    sliding_window_size: Optional[int] = None


class FrozenLinear(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


def rotate_halves(x, freqs_cis):
    """x (B, T, H, D); pairs (i, i + D/2) turned by the complex table (T, D/2)."""
    first, second = x.float().chunk(2, dim=-1)  # worked in float32 whatever the input, as the original does
    z = torch.complex(first, second) * freqs_cis[None, :, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


class SlotCacheAttention(nn.Module):
    def __init__(self, config: SlotConfig, attn_type: AttentionType):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.attn_type = attn_type
        self.window = config.sliding_window_size
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.sizes = [q, kv, kv]
        self.qkv_proj = FrozenLinear(config.hidden_size, q + 2 * kv)
        self.o_proj = FrozenLinear(q, config.hidden_size)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask=None):
        b, t, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        q = rotate_halves(q.view(b, t, self.heads, self.head_dim), freqs_cis)
        k = rotate_halves(k.view(b, t, self.kv_heads, self.head_dim), freqs_cis)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, kv_write_indices, k)
        v_cache.index_copy_(1, kv_write_indices, v)
        rep = self.heads // self.kv_heads
        keys = k_cache.repeat_interleave(rep, dim=2).transpose(1, 2)
        values = v_cache.repeat_interleave(rep, dim=2).transpose(1, 2)
        if self.attn_type == AttentionType.LOCAL_SLIDING and self.window is not None and local_mask is not None:
            mask = local_mask
        scores = (q.transpose(1, 2) * self.head_dim ** -0.5) @ keys.transpose(2, 3) + mask
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        return self.o_proj((probs @ values).transpose(1, 2).reshape(b, t, -1))
