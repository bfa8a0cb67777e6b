"""Constructors that take the kind of layer as a choice (Gemma-style ``Attention(config, attn_type: AttentionType)``,
an enum whose first member is the *sliding* one; and a ``Literal`` of names): attnbench builds the plain member.
Here a sliding layer keeps a fixed window of 4 that no spec asks for, so building it would fail the matrix."""

import enum
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

WINDOW = 4


class AttentionType(enum.Enum):
    LOCAL_SLIDING = 1
    GLOBAL = 2


@dataclass
class LayerConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 128
    attention_bias: bool = False


class TypedAttention(nn.Module):
    def __init__(self, config: LayerConfig, attn_type: AttentionType):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.window = WINDOW if attn_type == AttentionType.LOCAL_SLIDING else None
        width, kv = config.hidden_size, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(width, width, bias=config.attention_bias)
        self.k_proj = nn.Linear(width, kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(width, kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        i = torch.arange(t, device=x.device)
        keep = i[:, None] >= i[None, :]
        if self.window is not None:
            keep &= (i[:, None] - i[None, :]) < self.window
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class NamedKindAttention(TypedAttention):
    def __init__(self, config: LayerConfig, layer_kind: Literal["sliding_attention", "full_attention"]):
        super().__init__(config, AttentionType.LOCAL_SLIDING if layer_kind == "sliding_attention" else AttentionType.GLOBAL)
