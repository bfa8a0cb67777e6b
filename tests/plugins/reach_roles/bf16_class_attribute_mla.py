"""DeepSeek-style multi-head latent attention whose linear layers are built in bfloat16 by a class attribute, with
caches held in buffers and written at an int ``start_pos``.

Reproduces the convention of deepseek-ai/DeepSeek-V3 ``inference/model.py:MLA`` (commit 9b4e978): the constructor
takes its own ``ModelArgs`` dataclass (``dim``, ``n_heads``, ``q_lora_rank`` (0 = a full ``wq``), ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``max_batch_size``, ``max_seq_len``, ``rope_theta``); its
``Linear`` takes its dtype from the class attribute ``Linear.dtype = torch.bfloat16`` (float32 input against bfloat16
weights fails until the module is cast); a module-level ``attn_impl`` selects the naive form (per-head keys and values
cached) or the absorbed form (the normed latent and the shared rope key cached, ``W_UK`` folded into the query,
``W_UV`` applied after the mix); ``forward(x, start_pos: int, freqs_cis, mask)`` with ``freqs_cis`` complex
``(T, qk_rope_head_dim/2)`` for positions ``start_pos..``, interleaved pairs on the rope slice only, one rope key
shared by all heads, an RMSNorm on the kv latent, ``mask`` additive ``(T, T_total)`` or None for a single token;
softmax in float32 (float64 input is kept in float64 here, so that the class can be checked at 1e-9). Our own code,
written for attnbench's tests.
"""
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

attn_impl: Literal["naive", "absorb"] = "absorb"


@dataclass
class ModelArgs:
    max_batch_size: int = 4
    max_seq_len: int = 1024
    dim: int = 512
    n_heads: int = 8
    q_lora_rank: int = 0
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_theta: float = 10000.0


class Linear(nn.Module):
    dtype = torch.bfloat16

    def __init__(self, in_features: int, out_features: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype or Linear.dtype))
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


def turn_pairs(x, freqs_cis):
    """x (B, T, H, R): interleaved pairs turned by the complex table (T, R/2), in float32 at least."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = torch.view_as_complex(x.to(work).reshape(*x.shape[:-1], -1, 2).contiguous())
    z = z * freqs_cis.to(z.dtype).view(1, x.size(1), 1, -1)
    return torch.view_as_real(z).flatten(3).to(x.dtype)


class LatentAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_dim = self.nope + self.rope
        if self.q_lora_rank == 0:
            self.wq = Linear(args.dim, self.n_heads * self.qk_dim)
        else:
            self.wq_a = Linear(args.dim, self.q_lora_rank)
            self.q_norm = RMSNorm(self.q_lora_rank)
            self.wq_b = Linear(self.q_lora_rank, self.n_heads * self.qk_dim)
        self.wkv_a = Linear(args.dim, self.kv_lora_rank + self.rope)
        self.kv_norm = RMSNorm(self.kv_lora_rank)
        self.wkv_b = Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim))
        self.wo = Linear(self.n_heads * self.v_dim, args.dim)
        self.softmax_scale = self.qk_dim ** -0.5
        b, t = args.max_batch_size, args.max_seq_len
        if attn_impl == "naive":
            self.register_buffer("k_cache", torch.zeros(b, t, self.n_heads, self.qk_dim), persistent=False)
            self.register_buffer("v_cache", torch.zeros(b, t, self.n_heads, self.v_dim), persistent=False)
        else:
            self.register_buffer("kv_cache", torch.zeros(b, t, self.kv_lora_rank), persistent=False)
            self.register_buffer("pe_cache", torch.zeros(b, t, self.rope), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]):
        b, t, _ = x.shape
        end = start_pos + t
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(b, t, self.n_heads, self.qk_dim).split([self.nope, self.rope], dim=-1)
        q_pe = turn_pairs(q_pe, freqs_cis)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = turn_pairs(k_pe.unsqueeze(2), freqs_cis)  # one rope key for every head
        if attn_impl == "naive":
            kv = self.wkv_b(self.kv_norm(latent)).view(b, t, self.n_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            self.k_cache[:b, start_pos:end] = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
            self.v_cache[:b, start_pos:end] = v
            scores = torch.einsum("bshd,bthd->bsht", torch.cat([q_nope, q_pe], -1), self.k_cache[:b, :end])
        else:
            w = self.wkv_b.weight.view(self.n_heads, -1, self.kv_lora_rank)
            q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w[:, :self.nope])
            self.kv_cache[:b, start_pos:end] = self.kv_norm(latent)
            self.pe_cache[:b, start_pos:end] = k_pe.squeeze(2)
            scores = (torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:b, :end])
                      + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:b, :end]))
        scores = scores * self.softmax_scale
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        probs = scores.softmax(dim=-1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32).type_as(x)
        if attn_impl == "naive":
            out = torch.einsum("bsht,bthd->bshd", probs, self.v_cache[:b, :end])
        else:
            out = torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:b, :end])
            out = torch.einsum("bshc,hdc->bshd", out, w[:, -self.v_dim:])
        return self.wo(out.flatten(2))
