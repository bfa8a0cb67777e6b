"""Head sizes given twice, for the queries and keys and for the values, under names no alias holds.

Reproduces the convention of sgrvinod/a-PyTorch-Tutorial-to-Transformers ``model.py:MultiHeadAttention`` (and of the
``d_k``/``d_v`` pair of "Attention is all you need" ports): ``__init__(d_model, n_heads, d_queries, d_values,
dropout, in_decoder=False)`` where ``d_queries`` is the query/key size per head and ``d_values`` the value size per
head (one head dim in the spec: both get it); queries cast from one input and keys and values from another by one
fused projection; causal only when built ``in_decoder=True``. Our own code (without the tutorial's layer norm and
residual), written for attnbench's tests.
"""
import math

import torch
from torch import nn


class SplitHeadSizesAttention(nn.Module):
    def __init__(self, d_model, n_heads, d_queries, d_values, dropout, in_decoder=False):
        super().__init__()
        self.n_heads, self.d_queries, self.d_values, self.in_decoder = n_heads, d_queries, d_values, in_decoder
        self.cast_queries = nn.Linear(d_model, n_heads * d_queries)
        self.cast_keys_values = nn.Linear(d_model, n_heads * (d_queries + d_values))
        self.cast_output = nn.Linear(n_heads * d_values, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, query_sequences, key_value_sequences):
        return self.attend(query_sequences, key_value_sequences)

    def attend(self, query_sequences, key_value_sequences, key_value_sequence_lengths=None):
        b, tq, _ = query_sequences.shape
        tk = key_value_sequences.shape[1]
        q = self.cast_queries(query_sequences)
        k, v = self.cast_keys_values(key_value_sequences).split(self.n_heads * self.d_queries, dim=-1)
        q = q.view(b, tq, self.n_heads, self.d_queries).transpose(1, 2)
        k = k.view(b, tk, self.n_heads, self.d_queries).transpose(1, 2)
        v = v.view(b, tk, self.n_heads, self.d_values).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_queries)
        if key_value_sequence_lengths is not None:  # the padding after each key sequence's length
            padding = torch.arange(tk, device=q.device)[None, :] >= key_value_sequence_lengths[:, None]  # (b, tk)
            scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        if self.in_decoder:
            hidden = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(tk - tq + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        out = self.drop(scores.softmax(dim=-1)) @ v
        return self.cast_output(out.transpose(1, 2).reshape(b, tq, self.n_heads * self.d_values))


class LengthsAttention(SplitHeadSizesAttention):
    """The tutorial's forward takes each key sequence's length ``(B,)`` and hides the padding after it."""

    def forward(self, query_sequences, key_value_sequences, key_value_sequence_lengths):
        return self.attend(query_sequences, key_value_sequences, key_value_sequence_lengths)
