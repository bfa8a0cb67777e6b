"""EAGLE's ``modeling_mixtral_kv.MixtralAttention`` convention (issue 46, round 20), reproduced in our own code: a
4.x-era Hugging Face copy whose rotary tables are built for the ``kv_seq_len`` it sees (past + new tokens) and indexed
by ``position_ids``, with a base it cannot build without (``base ** ...`` of ``None``), an additive
``(B, 1, T, T_total)`` mask, and a ``(key, value)`` tuple cache passed in and returned."""

import math

import torch
from torch import nn


class KvSeqLenTables(nn.Module):
    def __init__(self, hidden_size, num_heads, rope_theta=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden_size, hidden_size, bias=False)
                                                              for _ in range(4))
        self.register_buffer("inv_freq", 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() /
                                                              self.head_dim)), persistent=False)

    def tables(self, seq_len, dtype):
        freqs = torch.outer(torch.arange(seq_len, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        q, k, v = (p(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        kv_seq_len = q_len + (past_key_value[0].shape[-2] if past_key_value is not None else 0)
        cos, sin = self.tables(kv_seq_len, q.dtype)
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        half = self.head_dim // 2
        q, k = (t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin for t in (q, k))
        if past_key_value is not None:
            k, v = torch.cat([past_key_value[0], k], dim=2), torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k, v) if use_cache else None
        weights = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            weights = weights + attention_mask
        out = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1)), None, past_key_value
