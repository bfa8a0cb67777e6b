"""The mask and score-modifier collection (issue 37) in three forms: eager math, SDPA with an explicit bias, and
FlexAttention with a mask_mod and a score_mod (``compiled:mask_flex`` is its fused kernel).

Every class computes every mask of :mod:`attnbench.correctness.masks` (ALiBi, prefix-LM, documents, attention sinks) and the
spec's variants (GQA/MQA, windows, non-causal, score scale, soft-capping), in the order the module docstring there
gives. What each builds before attending (a bool mask and the ALiBi biases; an additive float bias; a Flex
``BlockMask``) is its **setup step**: ``prepare(x) -> state``, and ``forward(x, prepared=state)`` uses a state built
before (``forward(x)`` builds it itself, once per forward, as a model does).

Sinks: the math and SDPA forms append one more score per query row, the head's sink logit (SDPA: a zero key whose
bias column is the sink, with a zero value), so the softmax's denominator has it and the output has no value for it;
the Flex form rescales Flex's output by ``sigmoid(lse - sink)`` (the same thing from the log-sum-exp Flex returns).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

from attnbench.correctness import masks
from attnbench.errors import InvalidSpecError
from attnbench.implementations._common import AttentionModule, add_book_projections, merge_heads, split_heads
from attnbench.implementations.flex import _flex_available
from attnbench.plugins.catalog import register
from attnbench.spec import AttnSpec

warnings.filterwarnings("ignore", message=r"flex_attention called without torch.compile")

CAPABILITIES = dict(gqa=True, sliding_window=True, non_causal=True, score_scale=True, softcap=True, masks=True)


class MaskedAttention(AttentionModule):
    """Book projections sized for ``num_kv_heads``, every mask of :mod:`attnbench.correctness.masks`; subclasses attend."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True, scale=None, softcap=None, alibi=False, prefix=None, documents=None,
                 sinks=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)
        self.spec = AttnSpec(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal,
                             scale=scale, softcap=softcap, alibi=alibi, prefix=prefix, documents=documents, sinks=sinks)
        add_book_projections(self, d_in, d_out, qkv_bias, kv_dim=self.num_kv_heads * self.head_dim)
        self.dropout_p = dropout
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))

    def prepare(self, x: torch.Tensor, **ctx):
        """What attending ``x`` needs built first (the setup step); the subclass says what."""
        raise NotImplementedError

    def attend(self, q, k, v, prepared) -> torch.Tensor:
        """``q`` ``(b, nh, T, hd)``, ``k``/``v`` ``(b, n_kv, T, hd)`` -> context ``(b, nh, T, hd)``."""
        raise NotImplementedError

    def forward(self, x, prepared=None):
        self.check_input(x)
        if prepared is None:
            prepared = self.prepare(x)
        q = split_heads(self.W_query(x), self.num_heads)  # (b, nh, T, hd)
        k = split_heads(self.W_key(x), self.num_kv_heads)  # (b, n_kv, T, hd)
        v = split_heads(self.W_value(x), self.num_kv_heads)
        return self.out_proj(merge_heads(self.attend(q, k, v, prepared)))  # (b, T, d_out)

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """``(b, n_kv, T, hd)`` -> ``(b, nh, T, hd)``: kv head ``h // group`` for query head ``h``."""
        return t.repeat_interleave(self.group, dim=1) if self.group > 1 else t


class MaskMath(MaskedAttention):
    """Eager math: scores, soft-cap, + ALiBi, masked_fill, softmax with the sink column, dropout, @ V."""

    def prepare(self, x, **ctx):
        T = x.shape[1]
        keep = masks.spec_keep(self.spec, T, device=x.device)  # (T, T) True = may attend
        bias = masks.alibi_bias(self.num_heads, T, device=x.device, dtype=x.dtype) if self.spec.alibi else None
        return keep, bias

    def attend(self, q, k, v, prepared):
        keep, bias = prepared
        b, nh, T, _ = q.shape
        scores = q @ self.expand(k).transpose(2, 3) * self.spec.score_scale  # (b, nh, T, T)
        if self.spec.softcap is not None:
            scores = self.spec.softcap * torch.tanh(scores / self.spec.softcap)
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~keep, -torch.inf)
        if self.spec.sinks:
            scores = torch.cat([scores, self.sinks.to(scores.dtype).view(1, nh, 1, 1).expand(b, nh, T, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)[..., :T]
        weights = F.dropout(weights, self.dropout_p, self.training)
        return weights @ self.expand(v)


class MaskSDPA(MaskedAttention):
    """F.scaled_dot_product_attention with one additive float bias (-inf masked, + ALiBi) and a sink key."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.spec.softcap is not None:
            raise InvalidSpecError("scaled_dot_product_attention cannot soft-cap scores: use mask_math or mask_flex")

    def prepare(self, x, **ctx):
        T = x.shape[1]
        keep = masks.spec_keep(self.spec, T, device=x.device)
        bias = torch.zeros(1, T, T, device=x.device, dtype=x.dtype)
        if self.spec.alibi:
            bias = masks.alibi_bias(self.num_heads, T, device=x.device, dtype=x.dtype)  # (nh, T, T)
        return bias.masked_fill(~keep, -torch.inf)

    def attend(self, q, k, v, prepared):
        b, nh, T, hd = q.shape
        k, v, bias = self.expand(k), self.expand(v), prepared
        if self.spec.sinks:  # a zero key whose score is the bias column (the sink), with a zero value
            zero = q.new_zeros(b, nh, 1, hd)
            k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
            sink = self.sinks.to(q.dtype).view(nh, 1, 1).expand(nh, T, 1)
            bias = torch.cat([bias.expand(nh, T, T), sink], dim=-1)
        p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=self.spec.score_scale)


class MaskFlex(MaskedAttention):
    """flex_attention with the mask as a mask_mod (a BlockMask: blocks wholly masked are skipped), soft-cap and
    ALiBi as a score_mod, and the sinks applied to the output from Flex's log-sum-exp."""

    def prepare(self, x, **ctx):
        from torch.nn.attention.flex_attention import create_block_mask

        T, spec = x.shape[1], self.spec
        docs = masks.document_ids(torch.arange(T, device=x.device), spec.documents)

        def mask_mod(b, h, q_idx, kv_idx):
            return masks.keep(q_idx, kv_idx, causal=spec.causal, window=spec.window, prefix=spec.prefix) \
                & (docs[q_idx] == docs[kv_idx])

        return create_block_mask(mask_mod, None, None, T, T, device=x.device)

    def _score_mod(self, device):
        spec = self.spec
        if spec.softcap is None and not spec.alibi:
            return None
        slopes = torch.tensor(masks.alibi_slopes(self.num_heads), device=device)

        def score_mod(score, b, h, q_idx, kv_idx):
            if spec.softcap is not None:
                score = spec.softcap * torch.tanh(score / spec.softcap)
            if spec.alibi:
                score = score - slopes[h] * (q_idx - kv_idx).abs()
            return score

        return score_mod

    def attend(self, q, k, v, prepared):
        from torch.nn.attention.flex_attention import flex_attention

        kw = dict(block_mask=prepared, score_mod=self._score_mod(q.device), scale=self.spec.score_scale,
                  enable_gqa=self.group > 1)
        if not self.spec.sinks:
            return flex_attention(q, k, v, **kw)
        out, lse = _with_lse(flex_attention, q, k, v, kw)  # lse (b, nh, T)
        keep = torch.sigmoid(lse - self.sinks.to(lse.dtype).view(1, -1, 1))  # Z / (Z + exp(sink))
        return out * keep.unsqueeze(-1).to(out.dtype)


def _with_lse(flex_attention, q, k, v, kw):
    """Flex's output and log-sum-exp: ``return_aux=AuxRequest(lse=True)`` where this torch has it, else ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return flex_attention(q, k, v, return_lse=True, **kw)
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    return out, aux.lse


def _factory(cls):
    def factory(spec: AttnSpec) -> nn.Module:
        return cls(spec.d_in, spec.d_out, spec.context_length, spec.dropout, spec.num_heads, spec.qkv_bias,
                   spec.num_kv_heads, spec.window, spec.causal, spec.scale, spec.softcap, spec.alibi, spec.prefix,
                   spec.documents, spec.sinks)

    factory.__name__ = f"{cls.__name__}_factory"
    return factory


register("mask_math", _factory(MaskMath), **CAPABILITIES,
         source="eager math: masked_fill of attnbench.correctness.masks's mask, ALiBi bias, a sink column in the softmax",
         description="eager math with every mask and score modifier (ALiBi, prefix, documents, sinks, softcap)")
register("mask_sdpa", _factory(MaskSDPA), **{**CAPABILITIES, "softcap": False}, min_torch="2.1",
         source="torch.nn.functional.scaled_dot_product_attention(attn_mask=float bias: -inf masked, + ALiBi, sink key)",
         description="SDPA with an explicit additive bias for every mask (no softcap: SDPA never shows the scores)")
register("mask_flex", _factory(MaskFlex), **CAPABILITIES, dropout=False, backward=("cuda",), min_torch="2.5",
         probe=_flex_available,
         source="torch.nn.attention.flex_attention (mask_mod BlockMask, score_mod softcap/ALiBi, sinks from lse)",
         description="FlexAttention: the mask as a BlockMask, softcap and ALiBi as a score_mod, sinks from the lse")
