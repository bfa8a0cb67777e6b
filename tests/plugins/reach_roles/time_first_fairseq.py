"""Time first: fairseq's ``MultiheadAttention`` convention, ``tgt_len, bsz, embed_dim = query.size()``.

Reproduces the convention of facebookresearch/fairseq ``fairseq/modules/multihead_attention.py:MultiheadAttention`` (and
its copies: ESM, BART and wav2vec ports): ``__init__(embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0,
bias=True, self_attention=False)``; ``forward(query, key, value, key_padding_mask=None, incremental_state=None,
need_weights=True, static_kv=False, attn_mask=None)`` on ``(T, B, C)`` inputs, an additive ``(T, T)`` ``attn_mask``, the
queries scaled where projected, heads as ``(B * H, T, D)`` for ``bmm``; returns ``(out, mean attention weights)``. Our
own code, written for attnbench's tests.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0, bias=True, self_attention=False):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.dropout = dropout
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[dict[str, dict[str, Optional[Tensor]]]] = None, need_weights: bool = True,
                static_kv: bool = False, attn_mask: Optional[Tensor] = None):
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_probs = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len).mean(dim=0) if need_weights else None
        return attn, weights


class FastPathMultiheadAttention(MultiheadAttention):
    """ESM's copy of it (facebookresearch/esm ``esm/multihead_attention.py``): without incremental state its forward
    takes PyTorch's fused path, which asserts ``key`` and ``value`` are given and concatenates the three biases
    (``torch.cat((q_proj.bias, k_proj.bias, v_proj.bias))``), so it raises when built with ``bias=False``."""

    def forward(self, query, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[dict[str, dict[str, Optional[Tensor]]]] = None, need_weights: bool = True,
                static_kv: bool = False, attn_mask: Optional[Tensor] = None):
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim
        if incremental_state is None and not static_kv:
            assert key is not None and value is not None
            return F.multi_head_attention_forward(
                query, key, value, self.embed_dim, self.num_heads, torch.empty([0]),
                torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), None, None, False, self.dropout,
                self.out_proj.weight, self.out_proj.bias, self.training, key_padding_mask, need_weights, attn_mask,
                use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
                v_proj_weight=self.v_proj.weight)
        if incremental_state is not None and "prev_key" in incremental_state:  # a dict of saved keys, by its names
            raise NotImplementedError("this test class keeps no incremental state")
        return super().forward(query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                               attn_mask)
