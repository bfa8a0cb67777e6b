"""Three conventions a fifth corpus's held-out half showed (written after its measurement; our own code):

* datawhalechina/happy-llm ``MultiHeadAttention(args: ModelArgs, is_causal=False)``: a config under the name ``args``
  beside an optional known flag, its dataclass requiring fields of a whole model (``vocab_size``, ``n_layer``) that
  the attention never reads (placeholders);
* FunAudioLLM/CosyVoice (wenet) ``MultiHeadedAttention.forward(query, key, value, mask, pos_emb, cache)`` whose
  ``cache`` defaults to an empty tensor ``(0, 0, 0, 0)`` (read with ``cache.size(0)``) and which returns ``(out,
  new_cache)``, keys and values concatenated on the last axis;
* ming024/FastSpeech2 ``MultiHeadAttention(n_head, d_model, d_k, d_v, dropout)``: ``d_k`` a known name, ``d_v`` the
  value head size (the same head dim), and a residual and LayerNorm inside (refused as a sublayer with its norm).
"""
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ModelArgs:
    dim: int
    n_heads: int
    dropout: float
    max_seq_len: int
    vocab_size: int
    n_layer: int


class ArgsConfigAttention(nn.Module):
    def __init__(self, args: ModelArgs, is_causal=False):
        super().__init__()
        self.n_heads, self.head_dim, self.is_causal = args.n_heads, args.dim // args.n_heads, is_causal
        self.wq, self.wk, self.wv = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.attn_dropout = nn.Dropout(args.dropout)
        mask = torch.full((1, 1, args.max_seq_len, args.max_seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, q, k, v):
        b, T, _ = q.shape
        q, k, v = (w(t).view(b, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for w, t in ((self.wq, q), (self.wk, k), (self.wv, v)))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if self.is_causal:
            scores = scores + self.mask[:, :, :T, :T]
        out = self.attn_dropout(scores.softmax(dim=-1)) @ v
        return self.wo(out.transpose(1, 2).reshape(b, T, -1))


class EmptyCacheAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(n_feat, n_feat) for _ in range(3))
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, query, key, value, mask=torch.ones((0, 0, 0), dtype=torch.bool), pos_emb=torch.empty(0),
                cache=torch.zeros((0, 0, 0, 0))):
        b = query.size(0)
        q, k, v = (lin(t).view(b, -1, self.h, self.d_k).transpose(1, 2)
                   for lin, t in ((self.linear_q, query), (self.linear_k, key), (self.linear_v, value)))
        if cache.size(0) > 0:
            key_cache, value_cache = torch.split(cache, cache.size(-1) // 2, dim=-1)
            k, v = torch.cat([key_cache, k], dim=2), torch.cat([value_cache, v], dim=2)
        new_cache = torch.cat((k, v), dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask.size(2) > 0:  # (B, T, T) keep-mask
            scores = scores.masked_fill(~mask.unsqueeze(1)[:, :, :, :scores.size(-1)], float("-inf"))
        out = (self.dropout(scores.softmax(dim=-1)) @ v).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(out), new_cache


class ResidualNormSublayer(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head, self.d_k, self.d_v = n_head, d_k, d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k)
        self.w_ks = nn.Linear(d_model, n_head * d_k)
        self.w_vs = nn.Linear(d_model, n_head * d_v)
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(n_head * d_v, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        b, T, _ = q.shape
        residual = q
        q = self.w_qs(q).view(b, T, self.n_head, self.d_k).transpose(1, 2)
        k = self.w_ks(k).view(b, T, self.n_head, self.d_k).transpose(1, 2)
        v = self.w_vs(v).view(b, T, self.n_head, self.d_v).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, T, -1)
        return self.layer_norm(self.dropout(self.fc(out)) + residual)
