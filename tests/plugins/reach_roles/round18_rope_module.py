"""A convention of the twelfth corpus (issue 46, round 18; our own code): gongyisheng's Qwen3 layers take their
rotary embedding as a forward argument, a module their model builds once, ``RoPE(head_dim, base, max_seq_len)``:

- ``RopeArgument(emb_dim, n_heads, n_kv_groups, head_dim)``: ``forward(x, rope: RoPE, position_ids, kv_cache=None,
  attn_mask=None)`` returning ``(out, (k, v))``, per-head RMSNorm on q and k, GQA, an additive mask.
- ``RopeArgumentUnannotated``: the same, ``rope`` not annotated (its MoE variant): the one module class of the file
  whose name its name begins.
"""

import torch
from torch import nn
from torch.nn import functional as F


class RoPE(nn.Module):
    def __init__(self, head_dim, base, max_seq_len):
        super().__init__()
        freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * freqs[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.half = head_dim // 2
        self.register_buffer("cos", torch.cos(angles))
        self.register_buffer("sin", torch.sin(angles))

    def forward(self, x, position_ids):
        cos = self.cos[position_ids][:, None].to(x.dtype)
        sin = self.sin[position_ids][:, None].to(x.dtype)
        return x * cos + torch.cat([-x[..., self.half:], x[..., :self.half]], dim=-1) * sin


class RopeArgument(nn.Module):
    def __init__(self, emb_dim, n_heads, n_kv_groups, head_dim):
        super().__init__()
        self.n_heads, self.n_kv_groups, self.head_dim = n_heads, n_kv_groups, head_dim
        self.q_proj = nn.Linear(emb_dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(emb_dim, n_kv_groups * head_dim, bias=False)
        self.v_proj = nn.Linear(emb_dim, n_kv_groups * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, emb_dim, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, x: torch.Tensor, rope: RoPE, position_ids: torch.Tensor, kv_cache=None, attn_mask=None):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2))
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv_groups, self.head_dim).transpose(1, 2))
        v = self.v_proj(x).view(b, t, self.n_kv_groups, self.head_dim).transpose(1, 2)
        q, k = rope(q, position_ids), rope(k, position_ids)
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)
        new_cache = (k, v)
        rep = self.n_heads // self.n_kv_groups
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-2, -1) / self.head_dim ** 0.5
        if attn_mask is not None:
            scores = scores + attn_mask
        out = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), new_cache


class RopeArgumentUnannotated(RopeArgument):
    def forward(self, x, rope, position_ids, kv_cache=None, attn_mask=None):
        return super().forward(x, rope, position_ids, kv_cache, attn_mask)
