"""A convention of the twelfth corpus and of much code written from scratch (issue 46, round 19; our own code): the
class builds its rotary tables in ``__init__`` from the head size alone, with a base nothing it takes sets, and
always rotates. No name says RoPE; the base is measured on the class (``plugins/own_rope.py``).

- ``OwnBaseRotary(d_model, n_heads, dropout)``: ``RotaryEmbedding(head_dim)`` with its ``base=10000`` default,
  rotate-half pairs, a fused ``qkv``, SDPA.
- ``OwnBaseCached(dim, heads)``: the same tables, a ``past_kv`` cache returned as ``(out, (k, v))``, the rotation
  offset by the tokens already cached.
- ``OwnBaseInterleaved(embed_dim, num_heads)``: Meta's complex ``freqs_cis`` over interleaved pairs, the base
  ``500000.0`` written into the call (a Llama 3 port).
- ``OwnBaseKeysUnrotated``: ``OwnBaseRotary`` with its keys left unrotated, a bug: it must fail, not pass or be
  refused.
- ``LearnedPositions``: absolute position embeddings added to its input, no rotation: nothing is inferred.
"""

import torch
from torch import nn
from torch.nn import functional as F


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x, offset=0):
        T = x.shape[-2]
        cos, sin = self.cos[offset:offset + T].to(x.dtype), self.sin[offset:offset + T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class OwnBaseRotary(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.0):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.rotary = RotaryEmbedding(d_model // n_heads)
        self.dropout = dropout

    def rotate(self, q, k):
        return self.rotary(q), self.rotary(k)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        q, k = self.rotate(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class OwnBaseKeysUnrotated(OwnBaseRotary):
    def rotate(self, q, k):
        return self.rotary(q), k


class OwnBaseCached(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.rotary = RotaryEmbedding(dim // heads)

    def forward(self, x, past_kv=None):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        start = 0 if past_kv is None else past_kv[0].shape[-2]
        q, k = self.rotary(q, start), self.rotary(k, start)
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=-2), torch.cat([past_kv[1], v], dim=-2)
        S = k.shape[-2]
        keep = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.to_out(y.transpose(1, 2).reshape(B, T, C)), (k, v)


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


class OwnBaseInterleaved(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.wq = nn.Linear(embed_dim, embed_dim, bias=False)
        self.wk = nn.Linear(embed_dim, embed_dim, bias=False)
        self.wv = nn.Linear(embed_dim, embed_dim, bias=False)
        self.wo = nn.Linear(embed_dim, embed_dim, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, 4096, theta=500000.0), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.num_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.num_heads, self.head_dim)
        rot = self.freqs_cis[:T].view(1, T, 1, -1)
        q = torch.view_as_real(torch.view_as_complex(q.float().reshape(B, T, self.num_heads, -1, 2)) * rot).flatten(3)
        k = torch.view_as_real(torch.view_as_complex(k.float().reshape(B, T, self.num_heads, -1, 2)) * rot).flatten(3)
        q, k = q.type_as(v).transpose(1, 2), k.type_as(v).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LearnedPositions(nn.Module):
    def __init__(self, d_model, n_heads, max_len=512):
        super().__init__()
        self.n_heads = n_heads
        self.pos = nn.Embedding(max_len, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        x = x + self.pos(torch.arange(T, device=x.device))
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
