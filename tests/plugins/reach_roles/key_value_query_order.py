"""TencentPretrain's convention: ``forward(key, value, query, mask)`` (the query last, so ``x`` goes to the key), an
additive float mask that is required, the three projections a ``ModuleList``, GQA by its own constructor names
(``heads_num``, ``attention_head_size``, ``local_kv_heads_num``), and a ``(output, None)`` return (reproduced, not
copied)."""

import math

import torch
from torch import nn


class KeyValueQuery(nn.Module):
    def __init__(self, hidden_size, heads_num, attention_head_size, local_kv_heads_num, dropout, has_bias=True):
        super().__init__()
        self.heads_num, self.per_head_size = heads_num, attention_head_size
        self.kv_heads = local_kv_heads_num
        inner = heads_num * attention_head_size
        self.linear_layers = nn.ModuleList([nn.Linear(hidden_size, inner, bias=has_bias)] + [
            nn.Linear(hidden_size, local_kv_heads_num * attention_head_size, bias=has_bias) for _ in range(2)])
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(inner, hidden_size, bias=has_bias)

    def forward(self, key, value, query, mask):
        b, T, _ = query.size()
        query, key, value = (layer(t) for layer, t in zip(self.linear_layers, (query, key, value), strict=True))
        query = query.view(b, T, self.heads_num, self.per_head_size).transpose(1, 2)
        key, value = (t.view(b, T, self.kv_heads, self.per_head_size).transpose(1, 2) for t in (key, value))
        group = self.heads_num // self.kv_heads
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(float(self.per_head_size))
        scores = scores + mask.type_as(scores)
        probs = self.dropout(torch.softmax(scores.float(), dim=-1).to(query.dtype))
        out = torch.matmul(probs, value).transpose(1, 2).contiguous().view(b, T, -1)
        return self.final_linear(out), None
