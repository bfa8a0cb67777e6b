"""DeepSeek-style multi-head latent attention (issue 46): the attention of DeepSeek-V2/V3/R1 and Kimi K2.

Written for attnbench after the conventions of DeepSeek-V3's ``inference/model.py``, Hugging Face's
``DeepseekV3Attention`` and torchtitan (parameter names ``wq`` or ``wq_a``/``q_norm``/``wq_b``, ``wkv_a``,
``kv_norm``, ``wkv_b``, ``wo``; each query head ``[nope | rope]``; one rotary key ``k_pe`` per token shared by every
head; RMSNorm on the latents; no biases). The spec's MLA fields say the sizes (:class:`~attnbench.spec.AttnSpec`);
the float64 reference is :mod:`attnbench.correctness.mla_reference`. Two forms:

* ``mla_deepseek`` (naive): keys and values materialised per head from the latent (``wkv_b``); its KV cache holds
  them, ``num_heads * (qk_head_dim + v_head_dim)`` numbers per token.
* ``mla_deepseek_absorbed``: the same full forward, but ``forward(x, use_cache=True)`` caches only the normed latent
  and the rotated ``k_pe`` (``kv_lora_rank + qk_rope_head_dim`` per token) and attends in the latent space: W_UK
  folded into the query (``q_nope_h W_UK_h``), W_UV into the output (``(probs c_kv) W_UV_h^T``), as DeepSeek-V3's
  ``attn_impl="absorb"`` decodes.

Both keep the project's KV-cache protocol (``implementations/kv_cache.py``: ``forward(x, use_cache=True)``,
``reset_cache``, ``rewind_cache``, ``cache_tensors``) in buffers preallocated for ``context_length`` tokens. They
compute MLA only: any other spec is an :class:`~attnbench.errors.UnavailableError` (a skipped case, with the reason).
"""

from __future__ import annotations

import torch
from torch import nn

from attnbench.correctness.rope import inv_freq
from attnbench.errors import InputShapeError, UnavailableError
from attnbench.implementations._common import visible
from attnbench.implementations.kv_cache import HOW
from attnbench.plugins.catalog import register
from attnbench.spec import AttnSpec
from attnbench.weights import Adapter, CanonicalWeights


def _to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    """Canonical MLA weights -> the module's parameters (``wkv_b`` = ``[W_UK_h; W_UV_h]`` stacked per head)."""
    h, r = spec.num_heads, spec.kv_lora_rank
    wkv_b = torch.cat([w.W_k.reshape(h, spec.qk_nope_head_dim, r), w.W_v.reshape(h, spec.v_head_dim, r)], dim=1)
    state = {"wkv_a.weight": w.W_dkv, "kv_norm.weight": w.g_dkv, "wkv_b.weight": wkv_b.reshape(-1, r),
             "wo.weight": w.W_o}
    if spec.q_lora_rank is None:
        state["wq.weight"] = w.W_q
    else:
        state.update({"wq_a.weight": w.W_dq, "q_norm.weight": w.g_dq, "wq_b.weight": w.W_q})
    return state


def _from_state(s, spec: AttnSpec) -> CanonicalWeights:
    """The module's parameters -> canonical MLA weights (``b_o`` zero: ``wo`` has no bias)."""
    h, r, nope = spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim
    wkv_b = s["wkv_b.weight"].reshape(h, nope + spec.v_head_dim, r)  # (heads, nope + v, r)
    W_o = s["wo.weight"]
    return CanonicalWeights(
        W_q=s["wq.weight"] if spec.q_lora_rank is None else s["wq_b.weight"],
        W_k=wkv_b[:, :nope].reshape(-1, r), W_v=wkv_b[:, nope:].reshape(-1, r), b_q=None, b_k=None, b_v=None,
        W_o=W_o, b_o=torch.zeros(W_o.shape[0], dtype=W_o.dtype, device=W_o.device),
        W_dq=s.get("wq_a.weight"), g_dq=s.get("q_norm.weight"), W_dkv=s["wkv_a.weight"], g_dkv=s["kv_norm.weight"])


class DeepSeekMLA(nn.Module):
    """DeepSeek-style MLA, naive form: keys and values materialised per head from the normed latent (and cached so)."""

    weight_adapter = Adapter(_to_state, _from_state, held_at_zero=frozenset({"b_o"}))

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, *, kv_lora_rank,
                 qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank=None, rope_theta=10000.0,
                 rope_style="interleaved", rope_scaling=None, rope_sign=1, norm_eps=1e-6, scale=None):
        super().__init__()
        self.spec = AttnSpec(d_in, d_out, context_length, dropout, num_heads, qkv_bias, rope_theta=rope_theta,
                             rope_style=rope_style, rope_scaling=rope_scaling, rope_sign=rope_sign, norm_eps=norm_eps,
                             scale=scale, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                             qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                             v_head_dim=v_head_dim)
        s = self.spec
        self.num_heads, self.nope, self.rope, self.v_dim, self.rank = (num_heads, qk_nope_head_dim, qk_rope_head_dim,
                                                                       v_head_dim, kv_lora_rank)
        if q_lora_rank is None:
            self.wq = nn.Linear(d_in, num_heads * s.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d_in, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, num_heads * s.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d_in, kv_lora_rank + qk_rope_head_dim, bias=False)  # [latent | shared k_pe]
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(num_heads * v_head_dim, d_out, bias=False)
        self.dropout = nn.Dropout(dropout)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64),
                             inv_freq(qk_rope_head_dim, rope_theta, rope_scaling)) * rope_sign  # (ctx, rope / 2)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)  # cast with the module's .to(dtype)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.caches: dict[str, torch.Tensor] = {}
        self.reset_cache()

    # -- projections ---------------------------------------------------------------------------------
    def rotate(self, t: torch.Tensor, start: int) -> torch.Tensor:
        """``t`` ``(b, T, n, rope)`` with each pair turned by its position's angle (positions ``start ..``):
        ``interleaved`` pairs ``(2j, 2j+1)`` as complex numbers (DeepSeek-V3's ``apply_rotary_emb``), ``half`` pairs
        ``(j, j + rope/2)``."""
        T = t.shape[1]
        work = t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32  # complex needs one of these
        cos, sin = self.rope_cos[start:start + T].to(work), self.rope_sin[start:start + T].to(work)
        freqs = torch.complex(cos, sin)[None, :, None, :]  # (1, T, 1, rope / 2): e^(i * position * freq_j)
        if self.spec.rope_style == "interleaved":
            z = torch.view_as_complex(t.to(work).unflatten(-1, (-1, 2)).contiguous())  # (b, T, n, rope / 2)
            return torch.view_as_real(z * freqs).flatten(-2).to(t.dtype)
        a, b = t.to(work).chunk(2, dim=-1)  # (b, T, n, rope / 2) each
        z = torch.complex(a, b) * freqs
        return torch.cat([z.real, z.imag], dim=-1).to(t.dtype)

    def queries(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_nope, q_pe)``: ``(b, T, heads, nope)`` and the rotated ``(b, T, heads, rope)``."""
        q = self.wq(x) if self.spec.q_lora_rank is None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.unflatten(-1, (self.num_heads, self.nope + self.rope))  # (b, T, heads, nope + rope)
        return q[..., :self.nope], self.rotate(q[..., self.nope:], start)

    def latents(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c_kv, k_pe)``: the normed latent ``(b, T, kv_lora_rank)`` and the rotated shared key ``(b, T, rope)``."""
        kv = self.wkv_a(x)  # (b, T, kv_lora_rank + rope)
        c_kv, k_pe = kv.split([self.rank, self.rope], dim=-1)
        return self.kv_norm(c_kv), self.rotate(k_pe.unsqueeze(2), start).squeeze(2)

    def expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``(b, L, heads, nope + rope)`` (``[W_UK_h c_kv | k_pe]``) and values ``(b, L, heads, v)``."""
        kv = self.wkv_b(c_kv).unflatten(-1, (self.num_heads, self.nope + self.v_dim))  # (b, L, heads, nope + v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)  # (b, L, heads, rope): one key for all heads
        return torch.cat([k_nope, k_pe], dim=-1), v

    def softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled, masked, softmaxed and dropped-out scores ``(b, s, heads, L)``; ``mask`` ``(s, L)``, True = attend."""
        scores = scores * self.spec.score_scale
        if mask is not None:
            scores = scores.masked_fill(~mask[None, :, None, :], -torch.inf)
        return self.dropout(torch.softmax(scores, dim=-1))

    def attend_naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """``q`` ``(b, s, heads, qk)`` over ``k`` ``(b, L, heads, qk)``, ``v`` ``(b, L, heads, v)`` -> ``(b, s, d_out)``."""
        probs = self.softmax(torch.einsum("bshd,bthd->bsht", q, k), mask)  # (b, s, heads, L)
        return self.wo(torch.einsum("bsht,bthd->bshd", probs, v).flatten(2))  # (b, s, d_out)

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        if use_cache:
            return self.forward_cached(x)
        self.spec.check_input(x)
        q_nope, q_pe = self.queries(x, 0)
        k, v = self.expand(*self.latents(x, 0))
        T = x.shape[1]
        return self.attend_naive(torch.cat([q_nope, q_pe], dim=-1), k, v, visible(T, T, None, True, x.device))

    # -- the KV-cache protocol -----------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Forget every cached token (the buffers stay allocated; entries past the pointer are never read)."""
        self.pos = 0

    def rewind_cache(self, n: int = 1) -> None:
        """Forget the last ``n`` tokens."""
        self.pos -= n

    def cache_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the cache."""
        return list(self.caches.values())

    def cache_widths(self) -> dict[str, tuple[int, ...]]:
        """Each cache tensor's shape per token: per-head keys and values (naive)."""
        return {"k": (self.num_heads, self.nope + self.rope), "v": (self.num_heads, self.v_dim)}

    def store(self, x: torch.Tensor, **new: torch.Tensor) -> int:
        """Write ``new`` (``(b, t, ...)`` each, named as :meth:`cache_widths`) at the pointer; return the new end."""
        b, t = x.shape[:2]
        if x.shape[-1] != self.spec.d_in:
            raise InputShapeError(f"input width is {x.shape[-1]} but the layer was built with d_in={self.spec.d_in}")
        end = self.pos + t
        if end > self.spec.context_length:
            raise InputShapeError(f"the KV cache would hold {end} tokens, more than context_length="
                                  f"{self.spec.context_length}; call reset_cache() or build a larger context_length")
        first = next(iter(new.values()))
        if not self.caches or any(c.shape[0] != b or c.dtype != first.dtype or c.device != first.device
                                  for c in self.caches.values()):
            self.caches = {n: torch.zeros(b, self.spec.context_length, *shape, dtype=first.dtype, device=first.device)
                           for n, shape in self.cache_widths().items()}
        for name, value in new.items():
            self.caches[name][:, self.pos:end] = value
        return end

    def forward_cached(self, x: torch.Tensor) -> torch.Tensor:
        """The next ``t`` tokens of ``x`` ``(b, t, d_in)``: their keys and values cached, their outputs returned."""
        q_nope, q_pe = self.queries(x, self.pos)
        k, v = self.expand(*self.latents(x, self.pos))
        end = self.store(x, k=k, v=v)
        mask = visible(x.shape[1], end, None, True, x.device)
        out = self.attend_naive(torch.cat([q_nope, q_pe], dim=-1), self.caches["k"][:, :end],
                                self.caches["v"][:, :end], mask)
        self.pos = end
        return out


class DeepSeekMLAAbsorbed(DeepSeekMLA):
    """DeepSeek-style MLA, absorbed decode: caches the normed latent and k_pe; W_UK folded into q, W_UV into the output."""

    def cache_widths(self) -> dict[str, tuple[int, ...]]:
        """The latent and the shared rotary key: ``kv_lora_rank + qk_rope_head_dim`` numbers per token."""
        return {"kv": (self.rank,), "pe": (self.rope,)}

    def w_uk(self) -> torch.Tensor:
        """W_UK per head ``(heads, nope, kv_lora_rank)``: the key rows of ``wkv_b``."""
        return self.wkv_b.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)[:, :self.nope]

    def w_uv(self) -> torch.Tensor:
        """W_UV per head ``(heads, v_head_dim, kv_lora_rank)``: the value rows of ``wkv_b``."""
        return self.wkv_b.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)[:, self.nope:]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope`` ``(b, s, heads, nope)`` -> ``q_nope_h W_UK_h`` ``(b, s, heads, kv_lora_rank)``: scores against
        the cached latent equal those against the keys ``W_UK_h c_kv``."""
        return torch.einsum("bshd,hdc->bshc", q_nope, self.w_uk())

    def forward_cached(self, x: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe = self.queries(x, self.pos)  # (b, s, heads, nope), (b, s, heads, rope)
        c_kv, k_pe = self.latents(x, self.pos)  # (b, s, r), (b, s, rope)
        end = self.store(x, kv=c_kv, pe=k_pe)
        kv, pe = self.caches["kv"][:, :end], self.caches["pe"][:, :end]  # (b, L, r), (b, L, rope)
        scores = (torch.einsum("bshc,btc->bsht", self.absorb_query(q_nope), kv)
                  + torch.einsum("bshr,btr->bsht", q_pe, pe))  # (b, s, heads, L)
        probs = self.softmax(scores, visible(x.shape[1], end, None, True, x.device))
        context = torch.einsum("bsht,btc->bshc", probs, kv)  # (b, s, heads, r): attention over the latent
        out = torch.einsum("bshc,hdc->bshd", context, self.w_uv())  # (b, s, heads, v): W_UV folded into the output
        self.pos = end
        return self.wo(out.flatten(2))  # (b, s, d_out)


NOT_MLA = ("computes DeepSeek-style MLA only: give the spec kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
           "v_head_dim and rope_theta (the MLA shapes of `attnbench check`)")


def _factory(cls):
    def factory(spec: AttnSpec) -> nn.Module:
        if not spec.is_mla:
            raise UnavailableError(NOT_MLA)
        return cls(**spec.kwargs())

    factory.__name__ = f"{cls.__name__}_factory"
    factory.__doc__ = cls.__doc__
    factory.mla = True  # it computes DeepSeek-style MLA (attnbench.correctness.cases.mla_skip_reason)
    return factory


FAMILY = dict(kv_cache=True, rope=True, score_scale=True)
CONVENTIONS = "DeepSeek-V3 inference/model.py, HF DeepseekV3Attention and torchtitan conventions, written anew"
register("mla_deepseek", _factory(DeepSeekMLA), **FAMILY,
         source=f"DeepSeek-style MLA, naive (per-head keys and values from the latent, cached so); {CONVENTIONS}; {HOW}")
register("mla_deepseek_absorbed", _factory(DeepSeekMLAAbsorbed), **FAMILY,
         source=f"DeepSeek-style MLA, absorbed decode (cache: normed latent + k_pe; W_UK into q, W_UV into the output); "
                f"{CONVENTIONS}; {HOW}")
