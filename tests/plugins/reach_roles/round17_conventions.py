"""Conventions of the eleventh corpus's classes (a development set, issue 46, round 17; our own code):

- ``RopeBaseRequired(n_heads, d_model, rope_base)``: a from-scratch GPT whose constructor requires the RoPE base and
  whose forward ``(x, cache=None)`` returns ``(out, cache)``: it always rotates, so ``rope_base=None`` (a case without
  RoPE) cannot build it; the causal probe builds it with a theta.
- ``OneTokenDecoder(args)``: Meta's reference Llama ``Attention``: ``forward(x, start_pos, freqs_cis)`` writes its
  ``cache_k``/``cache_v`` and masks nothing, written for one token at a time: meant to be causal (it keeps a decoder's
  cache), so it is checked, and fails its causal cases, rather than refused.
- ``DerivedGroups(config)`` (in ``round17_groups.py``, a module without a config class of its own, as in that
  repository): a Qwen3-from-scratch layer reading ``config.n_kv_groups`` and ``config.d_k``, which its own config class
  derives in ``__post_init__``; the config attnbench builds carries heads per kv head under that name.
"""

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F


def _rotate(x, base, start=0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(start, start + x.shape[-2], dtype=torch.float64), inv)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(x.dtype) for f in (torch.cos, torch.sin))
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class RopeBaseRequired(nn.Module):
    def __init__(self, n_heads: int, d_model: int, rope_base: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_base = n_heads, d_model // n_heads, rope_base
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.inv = 1.0 / rope_base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)  # needs the base

    def forward(self, x, cache=None):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv_proj(x).chunk(3, -1))
        q, k = _rotate(q, self.rope_base), _rotate(k, self.rope_base)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1)), cache


@dataclasses.dataclass
class DecoderArgs:
    dim: int = 64
    n_heads: int = 4
    max_batch_size: int = 2
    max_seq_len: int = 32


class OneTokenDecoder(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        shape = (args.max_batch_size, args.max_seq_len, self.n_heads, self.head_dim)
        self.cache_k, self.cache_v = torch.zeros(shape), torch.zeros(shape)

    def forward(self, x, start_pos: int):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos:start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, :start_pos + seqlen].transpose(1, 2)
        values = self.cache_v[:bsz, :start_pos + seqlen].transpose(1, 2)
        scores = xq.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        out = scores.softmax(-1) @ values
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


# --- the tenth corpus, read after its held-out run (round 17) ---------------------------------------------------


class _OwnLinear(nn.Module):
    """A from-scratch ``Linear``: one matrix ``w`` stored (out, in), applied as ``x @ w.T``."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.w = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))

    def forward(self, x):
        return x @ self.w.T


class OwnLinearModules(nn.Module):
    """fangpin's ``MultiHeadAttention(d_model, num_head)``: a fused ``project`` and an ``out_linear``, each a
    from-scratch ``Linear`` holding ``w``: bound by their shapes, as ``nn.Linear`` modules are."""

    def __init__(self, d_model: int, num_head: int, max_seq_len: int = 64):
        super().__init__()
        self.num_head = num_head
        self.project = _OwnLinear(d_model, 3 * d_model)
        self.out_linear = _OwnLinear(d_model, d_model)
        self.register_buffer("causal_mask", torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).triu(1))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.project(x).view(B, T, 3, self.num_head, -1).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(self.causal_mask[:T, :T], float("-inf"))
        return self.out_linear((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


class RawHeadsSquareOut(nn.Module):
    """alan-cooney's ``MultiHeadAttention``: raw ``weight_query`` ``(heads, d_model, d_head)`` applied as ``x @ W`` per
    head, and a raw square ``weight_out`` ``(d_model, d_model)`` applied as ``x @ W`` too: its orientation is read
    from the heads-axis projections', which shapes alone cannot tell at one width."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        d_head = d_model // n_heads
        self.weight_query, self.weight_key, self.weight_value = (
            nn.Parameter(torch.randn(n_heads, d_model, d_head) / math.sqrt(d_model)) for _ in range(3))
        self.weight_out = nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))

    def forward(self, residual):
        B, T, _ = residual.shape
        q, k, v = (torch.einsum("bpd,hde->bhpe", residual, w) for w in (self.weight_query, self.weight_key,
                                                                      self.weight_value))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        merged = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
        return torch.einsum("bpa,ac->bpc", merged, self.weight_out)


class CacheUpdateLayerFirst(nn.Module):
    """A from-scratch ``forward(x, cache=None, layer_idx=0)`` calling ``cache.update(layer_idx, k, v)``: the layer
    index first, where Hugging Face's ``DynamicCache`` takes it last."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.nh = n_heads
        self.q_proj, self.kv_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model)
        self.o_proj = nn.Linear(d_model, d_model)

    def heads(self, x):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.nh, -1).transpose(1, 2)
        return (q, *(t.view(B, T, self.nh, -1).transpose(1, 2) for t in self.kv_proj(x).split(C, dim=2)))

    def attend(self, q, k, v):
        B, _, T, _ = q.shape
        hidden = torch.ones(T, k.shape[2], dtype=torch.bool).triu(k.shape[2] - T + 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, cache=None, layer_idx: int = 0):
        q, k, v = self.heads(x)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)
        return self.attend(q, k, v)


class CacheUpdateAtPosition(CacheUpdateLayerFirst):
    """elvin-mark's ``forward(x, start_pos=0, kv_cache=None)`` calling ``kv_cache.update(start_pos, k, v)``: the int
    first is a write position."""

    def forward(self, x, start_pos: int = 0, kv_cache=None):
        q, k, v = self.heads(x)
        if kv_cache is not None:
            k, v = kv_cache.update(start_pos, k, v)
        return self.attend(q, k, v)


class WideFrequencyTables(nn.Module):
    """ashworks' llama3 ``forward(x, freqs_cos, freqs_sin)``: llama2.c's names, but each table ``(T, head_dim)``,
    every frequency repeated for the two features of its pair (``repeat_interleave(2)``), interleaved pairs."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.nh = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    @staticmethod
    def rotate(x, cos, sin):
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos[: x.shape[1]].unsqueeze(1) + turned * sin[: x.shape[1]].unsqueeze(1)

    def forward(self, x, freqs_cos, freqs_sin):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.nh, -1) for w in (self.wq, self.wk, self.wv))
        q, k = self.rotate(q, freqs_cos, freqs_sin), self.rotate(k, freqs_cos, freqs_sin)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class BlockWithRate(nn.Module):
    """T2M-GPT's ``Block(embed_dim=512, block_size=16, n_head=8, drop_out_rate=0.1, fc_rate=4)``: norms, attention and
    an MLP ``fc_rate`` times as wide; a role that sets ``fc_rate`` to 0 hides the MLP and is no fit, so the class is
    refused as a whole block."""

    def __init__(self, embed_dim=512, block_size=16, n_head=8, drop_out_rate=0.1, fc_rate=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, n_head, dropout=drop_out_rate, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, fc_rate * embed_dim), nn.GELU(),
                                 nn.Linear(fc_rate * embed_dim, embed_dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class WindowOnGpu(nn.Module):
    """Anomaly-Transformer's ``AnomalyAttention(win_size, mask_flag=True, ...)``: its one required int is solved by
    roles, and every assignment reaches ``.cuda()`` in the constructor: CUDA is the first cause, not the book's
    positional order."""

    def __init__(self, win_size, mask_flag=True, scale=None, attention_dropout=0.0):
        super().__init__()
        self.distances = torch.zeros((win_size, win_size)).cuda()

    def forward(self, queries, keys, values, attn_mask):
        return queries


class FutureMaskMergeScrambled(nn.Module):
    """jsbaan's ``forward(x, encoder_hidden_states=None, src_padding_mask=None, future_mask=None)``: its decoder mask
    is the caller's ``future_mask``, which says it is meant to be causal; its merge (``reshape`` without the transpose
    back) mixes tokens, so it is checked and fails rather than being refused."""

    def __init__(self, hidden_dim: int, num_heads: int):
        super().__init__()
        self.nh = num_heads
        self.qkv_proj, self.o_proj = nn.Linear(hidden_dim, 3 * hidden_dim), nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x, encoder_hidden_states=None, src_padding_mask=None, future_mask=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.nh, -1).transpose(1, 2) for t in self.qkv_proj(x).split(C, dim=2))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if future_mask is not None:
            s = s.masked_fill(future_mask == 0, float("-inf"))
        return self.o_proj((s.softmax(-1) @ v).reshape(B, T, C))
