"""Correct attention layers in today's common styles, most of them without some or all biases.

Written for these tests in the styles of current LLM code (none is copied from it): a nanoGPT-like
``CausalSelfAttention(config)`` whose config says ``bias``; a Llama-like layer reading a config object, with
grouped-query attention through ``expand`` + ``reshape`` and a bias-free ``o_proj``; a Qwen-like layer with
q/k/v biases and no output bias under Hugging Face names; a fused-qkv layer with no bias at all. Each
must pass ``attnbench check`` unchanged (no adapter, no capability declared).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class NanoGPTSelfAttention(nn.Module):
    """nanoGPT-like: fused ``c_attn`` and ``c_proj`` with ``bias=config.bias``; a flash path and a slow path."""

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.flash = config.block_size % 2 == 0  # exercise both paths across the matrix's shapes
        self.register_buffer("causal", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)  # (B, nh, T, hs)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.causal[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, n_kv, T, hd) -> (b, n_kv * n_rep, T, hd): kv head j serves query heads j*n_rep .. (j+1)*n_rep - 1."""
    b, n_kv, T, hd = hidden.shape
    if n_rep == 1:
        return hidden
    return hidden[:, :, None, :, :].expand(b, n_kv, n_rep, T, hd).reshape(b, n_kv * n_rep, T, hd)


class LlamaStyleAttention(nn.Module):
    """Llama-like: ``q_proj``/``k_proj``/``v_proj`` (bias ``config.attention_bias``), a bias-free ``o_proj``, GQA
    through :func:`repeat_kv`, an additive causal mask; returns ``(output, weights)``. (The softmax runs in the
    input's dtype: an upcast to float32, as some codebases do, makes float64 cases fail at ~1e-7 > 1e-9.)"""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (b, nh, T, hd)
        key = repeat_kv(self.k_proj(hidden_states).view(shape).transpose(1, 2), self.num_key_value_groups)
        value = repeat_kv(self.v_proj(hidden_states).view(shape).transpose(1, 2), self.num_key_value_groups)
        if attention_mask is None:
            attention_mask = torch.full((q_len, q_len), float("-inf"), device=hidden_states.device,
                                        dtype=query.dtype).triu(1)  # (T, T): 0 on and below the diagonal
        attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling + attention_mask  # (b, nh, T, T)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value).transpose(1, 2).reshape(bsz, q_len, -1)  # (b, T, nh*hd)
        return self.o_proj(attn_output), attn_weights


class QwenStyleAttention(nn.Module):
    """Hugging Face names with q/k/v biases always on and no output bias (Qwen-like); no bias argument."""

    def __init__(self, hidden_size, num_heads, max_position_embeddings=4096, attention_dropout=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.attention_dropout = attention_dropout
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (b, nh, T, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.attention_dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))  # (b, T, d)


class FusedNoBias(nn.Module):
    """A bias-free fused ``qkv`` and a bias-free ``proj`` (ViT/timm-like names), written out with an explicit mask."""

    def __init__(self, dim, num_heads, max_seq_len=1024, attn_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, nh, N, hd)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, nh, N, N)
        attn = attn.masked_fill(torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        attn = self.attn_drop(attn.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))  # (B, N, C)
