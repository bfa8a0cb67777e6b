"""DeepSeek-style MLA bugs that ship (issue 46), planted in the built-in ``mla_deepseek`` layers.

Each is a factory ``make_*(spec)`` (with ``mla = True``, as the built-ins' factories): ``tests/test_mla_deepseek.py``
registers it with the capabilities of the layer it derives from, and asserts which case kind flags it.
"""

import torch

from attnbench.implementations.mla_deepseek import DeepSeekMLA, DeepSeekMLAAbsorbed, _factory


class RopeSliceNotRotated(DeepSeekMLA):
    """The rope slices of the queries and the shared key ``k_pe`` are used as projected: never rotated."""

    def rotate(self, t, start):
        return t


class RopeKeyPerHead(DeepSeekMLA):
    """Each head takes its rotary key from its own up-projected key (the last ``qk_rope_head_dim`` dims of
    ``W_UK_h c_kv``, rotated), as a partial-rotary MHA would, instead of the one ``k_pe`` of ``wkv_a`` that every
    head shares."""

    def latents(self, x, start):
        self.start = start  # the positions expand() rotates at
        return super().latents(x, start)

    def expand(self, c_kv, k_pe):
        k, v = super().expand(c_kv, k_pe)  # (b, L, heads, nope + rope), (b, L, heads, v)
        own = self.rotate(k[..., self.nope - self.rope:self.nope], self.start)  # (b, L, heads, rope): one per head
        return torch.cat([k[..., :self.nope], own], dim=-1), v


class LatentNormSkipped(DeepSeekMLA):
    """The kv latent goes to ``wkv_b`` (and the cache) without its RMSNorm ``kv_norm``."""

    def latents(self, x, start):
        c_kv, k_pe = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        return c_kv, self.rotate(k_pe.unsqueeze(2), start).squeeze(2)


class WukAppliedTwice(DeepSeekMLAAbsorbed):
    """The absorbed decode folds W_UK into the query twice: the folded query goes back through W_UK^T and is folded
    again (``q_nope W_UK W_UK^T W_UK``). The full forward (naive) is right: only cached calls are wrong."""

    def absorb_query(self, q_nope):
        folded = super().absorb_query(q_nope)  # (b, s, heads, kv_lora_rank)
        return super().absorb_query(torch.einsum("bshc,hdc->bshd", folded, self.w_uk()))


make_rope_not_rotated = _factory(RopeSliceNotRotated)
make_rope_key_per_head = _factory(RopeKeyPerHead)
make_latent_norm_skipped = _factory(LatentNormSkipped)
make_wuk_applied_twice = _factory(WukAppliedTwice)
