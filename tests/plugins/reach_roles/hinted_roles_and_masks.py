"""Conventions of the seventh corpus's classes, read after its held-out run (issue 46, round 15; our own code):

- ``SplitHeadSizes(emb_dim, emb_kq, emb_v, nheads, kvheads, p_dropout=None, use_bias=False, head_dim=None)``: IBM's
  foundation-model-stack ``MultiHeadAttention``: four ints no name tells, beside an optional ``head_dim`` bound by its
  name; the role assignments are tried best hinted first (``nheads``, ``kvheads``), and three parameters may be the
  head dim.
- ``KeyedConfig(config)``: ParlAI's ``config["embedding_size"]`` and ``config["n_heads"]``: a key no spec field fills
  gets the role its name says (the width).
- ``SizeCheckedMask(hidden_size, num_heads, max_position_embeddings)``: Hugging Face's eager check that the mask is
  ``(bsz, 1, q_len, kv_len)``, an additive one.
- ``CausalNeedsLength(hidden_size, num_heads, causal=False, sequence_length=None)``: MONAI's ``SABlock``: causal by a
  flag that then needs ``sequence_length`` for its mask buffer.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


def _attend(q, k, v, mask=None):
    w = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return (w + mask if mask is not None else w).softmax(dim=-1) @ v


class SplitHeadSizes(nn.Module):
    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads, p_dropout=None, use_bias=False, head_dim=None):
        super().__init__()
        self.nheads, self.kvheads, self.kq, self.v = nheads, kvheads, emb_kq, emb_v
        sizes = (nheads * emb_kq, kvheads * emb_kq, kvheads * emb_v)
        self.query, self.key, self.value = (nn.Linear(emb_dim, n, bias=use_bias) for n in sizes)
        self.dense = nn.Linear(nheads * emb_v, emb_dim, bias=use_bias)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.query(x).view(b, t, self.nheads, self.kq).transpose(1, 2)
        k, v = (p(x).view(b, t, self.kvheads, -1).transpose(1, 2).repeat_interleave(self.nheads // self.kvheads, 1)
                for p in (self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


class KeyedConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim, self.heads = config["embedding_size"], config["n_heads"]
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_lin, self.k_lin, self.v_lin))
        hidden = torch.ones(t, t, dtype=torch.bool).triu(1)
        return self.out_lin(_attend(q, k, v, torch.zeros(t, t, dtype=q.dtype).masked_fill(hidden, float("-inf"))).transpose(1, 2)
                            .reshape(b, t, c))


class SizeCheckedMask(nn.Module):
    def __init__(self, hidden_size, num_heads, max_position_embeddings):
        super().__init__()
        self.heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        b, t, c = hidden_states.shape
        if attention_mask.size() != (b, 1, t, t):
            raise ValueError(f"Attention mask should be of size {(b, 1, t, t)}, but is {attention_mask.size()}")
        q, k, v = (s.view(b, t, self.heads, -1).transpose(1, 2) for s in self.qkv(hidden_states).split(c, dim=-1))
        return self.o_proj(_attend(q, k, v, attention_mask).transpose(1, 2).reshape(b, t, c))


class CausalNeedsLength(nn.Module):
    def __init__(self, hidden_size, num_heads, causal=False, sequence_length=None):
        super().__init__()
        if causal and sequence_length is None:
            raise ValueError("sequence_length is necessary for causal attention.")
        self.heads, self.causal = num_heads, causal
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        if causal:
            hide = torch.ones(sequence_length, sequence_length, dtype=torch.bool).triu(1)
            self.register_buffer("causal_mask", torch.zeros(sequence_length, sequence_length).masked_fill(hide, -torch.inf))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (s.view(b, t, self.heads, -1).transpose(1, 2) for s in self.qkv(x).chunk(3, dim=-1))
        mask = self.causal_mask[:t, :t] if self.causal else None
        return self.out_proj(_attend(q, k, v, mask).transpose(1, 2).reshape(b, t, c))


class BiasNamedMask(nn.Module):
    """THUMT's ``forward(query, bias, memory=None, kv=None)``: the additive causal mask is a required ``bias`` (a name
    no mask list holds: its mask forms are probed like any unknown input's), projections ``q_transform`` ...
    ``o_transform``, the query scaled before the product."""

    def __init__(self, hidden_size, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.q_transform, self.k_transform, self.v_transform, self.o_transform = (
            nn.Linear(hidden_size, hidden_size) for _ in range(4))

    def forward(self, query, bias, memory=None, kv=None):
        b, t, c = query.shape
        q, k, v = (p(query).view(b, t, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_transform, self.k_transform, self.v_transform))
        logits = torch.matmul(q * (c // self.num_heads) ** -0.5, k.transpose(-2, -1)) + bias
        weights = F.dropout(torch.softmax(logits, dim=-1), p=self.dropout, training=self.training)
        return self.o_transform(torch.matmul(weights, v).transpose(1, 2).reshape(b, t, c))
