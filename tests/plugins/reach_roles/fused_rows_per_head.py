"""Fused q/k/v projections whose rows are held per head (issue 46, round 15; our own code):

- ``NeoXStyleAttention(hidden_size, num_attention_heads, max_position_embeddings)``: GPT-NeoX's and Bloom's
  ``query_key_value`` viewed ``(B, T, heads, 3 * head_dim)``, each head's slice split into its q, k and v.
- ``GroupedFusedAttention(dim, n_heads, n_kv_heads)``: Megatron's and InternLM2's grouped-query form, the rows of each
  kv head's group (its query heads, then its key, then its value) side by side: ``(B, T, kv_heads, rep + 2, head_dim)``.

Both are correct causal attention; a checkpoint of either keeps its rows so, and attnbench must load them so.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class NeoXStyleAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, max_position_embeddings):
        super().__init__()
        self.heads, self.head_size = num_attention_heads, hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        mask = torch.tril(torch.ones(max_position_embeddings, max_position_embeddings, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, max_position_embeddings, max_position_embeddings), persistent=False)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, t, self.heads, 3 * self.head_size).permute(0, 2, 1, 3)
        q, k, v = qkv[..., :self.head_size], qkv[..., self.head_size:2 * self.head_size], qkv[..., 2 * self.head_size:]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size)
        scores = scores.masked_fill(~self.bias[:, :, :t, :t], torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, t, -1))


class GroupedFusedAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.rep = n_heads // n_kv_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.wqkv(x).view(b, t, self.n_kv, self.rep + 2, self.hd)
        q = qkv[:, :, :, :self.rep].reshape(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = qkv[:, :, :, -2].transpose(1, 2).repeat_interleave(self.rep, dim=1)
        v = qkv[:, :, :, -1].transpose(1, 2).repeat_interleave(self.rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))
