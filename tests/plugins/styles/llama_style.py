"""A Hugging-Face/Llama-style attention: one config object (``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``attention_bias``, ``attention_dropout``), ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
and ``(output, attention_weights)`` returned. No KV cache of its own (Hugging Face keeps it outside)."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F


class LlamaStyleAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=True)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)  # (b, nh, T, hd)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        dropout = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (b, nh, T, hd)
        out = out.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(out), None
