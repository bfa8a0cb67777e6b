"""RoPE / QK-norm / score-scale bugs that ship (issue 26), planted in the built-in rope_math layer.

Each is a factory ``make_*(spec)``: ``tests/test_rope_bugs.py`` registers it with rope_math's capabilities.
Every one computes plain attention correctly (the old cases pass) and is caught only by the positional cases.
"""

from dataclasses import replace

from attnbench.implementations._common import split_heads
from attnbench.implementations.rope import RopeMath


class OffsetIgnoredWhenDecoding(RopeMath):
    """Every call rotates its tokens as if they started at position 0 (the cache's offset is never passed on)."""

    def project(self, x, start_pos=0):
        return super().project(x, 0)


class QueriesNotRotated(RopeMath):
    """Only the keys are rotated."""

    def project(self, x, start_pos=0):
        q, k = split_heads(self.W_query(x), self.num_heads), split_heads(self.W_key(x), self.num_kv_heads)
        if self.spec.rope_theta is not None:
            k = self.rotate(k, start_pos)
        return q, k, split_heads(self.W_value(x), self.num_kv_heads)


class SignFlipped(RopeMath):
    """``rotate_half`` written as ``cat(x2, -x1)``: every pair turns the wrong way."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.spec.rope_theta is not None:
            self.rope_sin.neg_()


class NormAfterRope(RopeMath):
    """QK-norm applied to the rotated queries and keys (per head)."""

    def project(self, x, start_pos=0):
        q, k = split_heads(self.W_query(x), self.num_heads), split_heads(self.W_key(x), self.num_kv_heads)
        if self.spec.rope_theta is not None:
            q, k = self.rotate(q, start_pos), self.rotate(k, start_pos)
        if self.spec.qk_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, split_heads(self.W_value(x), self.num_kv_heads)


class KNormReusesQGain(RopeMath):
    """``k_norm`` built and loaded, but the keys normalised with ``q_norm`` (a copy-paste slip)."""

    def project(self, x, start_pos=0):
        q, k = split_heads(self.W_query(x), self.num_heads), split_heads(self.W_key(x), self.num_kv_heads)
        if self.spec.qk_norm is not None:
            q, k = self.q_norm(q), self.q_norm(k)
        if self.spec.rope_theta is not None:
            q, k = self.rotate(q, start_pos), self.rotate(k, start_pos)
        return q, k, split_heads(self.W_value(x), self.num_kv_heads)


class ScaleIgnored(RopeMath):
    """Takes ``scale`` but divides the scores by ``sqrt(head_dim)`` anyway."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spec = replace(self.spec, scale=None)


class SoftcapNotRescaled(RopeMath):
    """Gemma 2's soft-cap written ``tanh(scores / cap)``, without the ``cap *`` that gives the scores back their range:
    invisible at a cap of 1 (the matrix's soft-cap case used 1.0 until a planted set found it blind)."""

    def _attend(self, q, k, v, mask):
        import torch

        if self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        scores = (q @ k.transpose(2, 3)) * self.spec.score_scale
        if self.spec.softcap is not None:
            scores = torch.tanh(scores / self.spec.softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, -torch.inf)
        return torch.softmax(scores, dim=-1) @ v


class CacheRotatedAgain(RopeMath):
    """Stores rotated keys, then rotates the cached ones again at their positions whenever it reads them."""

    def _update(self, k, v):
        keys, values, key_pos = super()._update(k, v)
        if self.spec.rope_theta is not None and self.pos:
            keys = keys.clone()
            keys[:, :, :self.pos] = self.rotate(keys[:, :, :self.pos], 0)
        return keys, values, key_pos


def _make(cls):
    def make(spec):
        return cls(**spec.kwargs())

    make.__doc__ = cls.__doc__
    return make


make_offset_ignored = _make(OffsetIgnoredWhenDecoding)
make_queries_not_rotated = _make(QueriesNotRotated)
make_sign_flipped = _make(SignFlipped)
make_norm_after_rope = _make(NormAfterRope)
make_k_norm_reuses_q_gain = _make(KNormReusesQGain)
make_scale_ignored = _make(ScaleIgnored)
make_cache_rotated_again = _make(CacheRotatedAgain)
make_softcap_not_rescaled = _make(SoftcapNotRescaled)
