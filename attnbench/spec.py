"""The one constructor every implementation shares: the book's ``MultiHeadAttention`` arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnbench.correctness import masks
from attnbench.errors import InputShapeError, InvalidSpecError

ROPE_STYLES = ("half", "interleaved")
"""RoPE conventions: ``half`` rotates ``x[:hd/2]`` with ``x[hd/2:]`` (Llama/HF/NeoX ``rotate_half``);
``interleaved`` rotates adjacent pairs ``(x[2i], x[2i+1])`` (GPT-J, the original Meta code)."""
QK_NORMS = ("head", "full")
"""QK-norm placements: ``head`` = RMSNorm over ``head_dim`` per head (Qwen3, Gemma 3); ``full`` = over the whole
q (``d_out``) and k (``kv_dim``) projection (OLMo)."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (HF ``rope_type="llama3"``): wavelengths longer than
    ``original_context_length / low_freq_factor`` are divided by ``factor``, shorter than
    ``original_context_length / high_freq_factor`` kept, those between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192

    def __post_init__(self) -> None:
        if not self.factor > 0 or not self.original_context_length > 0:
            raise InvalidSpecError(f"rope_scaling needs factor > 0 and original_context_length > 0, got {self}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise InvalidSpecError(f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                   f"{self.low_freq_factor} and {self.high_freq_factor}")


_TEXT_FIELDS = {"rope_theta": float, "rope_style": str, "rope_scaling": str, "qk_norm": str, "norm_eps": float,
                "scale": float, "softcap": float, "rope_sign": int, "rope_head_dim": int}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""DeepSeek-style multi-head latent attention (issue 46): set with ``kv_lora_rank``, off (all ``None``) otherwise."""


def _number(v: float) -> str:
    short = f"{v:.15g}"
    return short if float(short) == v else repr(v)


def positional_from_text(text: str | None) -> dict:
    """The positional keyword arguments of a sweep's ``positional`` text (:meth:`AttnSpec.positional_text`):
    ``"rope_theta=500000;rope_scaling=llama3;qk_norm=head"`` -> ``{"rope_theta": 500000.0, ...}``; ``""``: none."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in str(text or "").split(";"))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _TEXT_FIELDS:
            raise InvalidSpecError(f"positional setting {item!r} is not KEY=VALUE with KEY one of "
                                   f"{', '.join(_TEXT_FIELDS)} (e.g. rope_theta=500000;rope_scaling=llama3)")
        try:
            out[key] = _TEXT_FIELDS[key](value.strip())
        except ValueError:
            raise InvalidSpecError(f"positional setting {item!r}: {value.strip()!r} is not a number") from None
    if "rope_scaling" in out:
        if out["rope_scaling"] != "llama3":
            raise InvalidSpecError(f"rope_scaling={out['rope_scaling']!r}: the one scaling is llama3 "
                                   "(factor 8, low_freq_factor 1, high_freq_factor 4, original context 8192)")
        out["rope_scaling"] = RopeScaling()
    return out


@dataclass(frozen=True)
class AttnSpec:
    """Sizes of one multi-head attention layer, as the book's constructor takes them.

    ``forward(x)`` of every implementation maps ``(b, T, d_in)`` to ``(b, T, d_out)`` causally for
    every ``T <= context_length``; each of ``num_heads`` heads has width ``head_dim = d_out // num_heads``.

    Variants (the defaults are the book's causal multi-head attention):

    * ``num_kv_heads``: heads of keys and values (``None`` = ``num_heads``: MHA; 1: MQA; a divisor of
      ``num_heads``: GQA). Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``, so
      consecutive query heads share a kv head (``repeat_interleave``, not ``repeat``);
    * ``window``: ``None`` for full attention; ``w`` lets each token attend to itself and the previous
      ``w - 1`` tokens (a sliding window);
    * ``causal``: ``False`` for bidirectional (encoder) attention, where every token sees every token
      (of its window, when there is one: ``|i - j| < w``).

    Positional fields (issue 26; every default means "off"), applied in this order by the reference:
    projection -> ``qk_norm`` (RMSNorm with eps ``norm_eps`` and its own gains for q and k) -> RoPE of base
    ``rope_theta`` in ``rope_style`` at absolute positions (with ``rope_scaling``) -> scores * ``score_scale``
    (``scale``, or ``head_dim ** -0.5``) -> ``softcap * tanh(s / softcap)`` -> mask -> softmax.

    Masks and score modifiers (issue 37, :mod:`attnbench.correctness.masks`; every default means "off"): ``alibi``
    adds ``-slope_h * |i - j|`` after the soft-cap; ``prefix`` lets the first ``prefix`` tokens see each other both
    ways (causal only); ``documents`` (start positions of documents 2, 3, ...) keeps each token inside its document;
    ``sinks`` puts a learned per-head logit (the canonical weights' ``sinks``) in each softmax's denominator.

    Partial rotary (issue 46): ``rope_head_dim`` rotates only the FIRST ``rope_head_dim`` dimensions of each query and
    key head, the rest pass unrotated (GPT-NeoX, Phi, GPT-J's ``rotary_dim``, Hugging Face's ``partial_rotary_factor``);
    frequencies ``theta ** (-2j / rope_head_dim)``, pairs inside the rotated slice as ``rope_style`` says (``half``:
    ``j`` with ``j + rope_head_dim/2``; ``interleaved``: ``2j`` with ``2j + 1``). ``None``: the whole head.

    DeepSeek-style MLA (issue 46; DeepSeek-V2/V3, Kimi K2; on when ``kv_lora_rank`` is set, :data:`MLA_FIELDS`):
    the query is ``W_q x`` (``q_lora_rank=None``: full rank) or ``W_q RMSNorm(W_dq x)`` through a ``q_lora_rank``
    latent; each query head is ``[nope | rope]`` of ``qk_nope_head_dim + qk_rope_head_dim``. ``W_dkv x`` gives the kv
    latent (``kv_lora_rank``, then RMSNorm) and ONE rotary key ``k_pe`` of ``qk_rope_head_dim`` per token, shared by
    every head. Head ``h``'s key is ``[W_UK_h c_kv | k_pe]`` and its value ``W_UV_h c_kv`` (``v_head_dim`` wide); the
    rope slices of q and ``k_pe`` are rotated (``rope_theta``, ``rope_style``: DeepSeek's own code pairs
    ``interleaved``), scores scaled by ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` (or ``scale``), and the
    heads' values (``num_heads * v_head_dim``) projected to ``d_out``. The latent norms use ``norm_eps``.
    """

    d_in: int
    d_out: int
    context_length: int
    dropout: float = 0.0
    num_heads: int = 1
    qkv_bias: bool = False
    num_kv_heads: int | None = None
    window: int | None = None
    causal: bool = True
    rope_theta: float | None = None  # None: no rotary position embeddings
    rope_style: str = "half"  # ROPE_STYLES
    rope_scaling: RopeScaling | None = None  # Llama-3 frequency scaling (needs rope_theta)
    qk_norm: str | None = None  # QK_NORMS, or None
    norm_eps: float = 1e-6
    scale: float | None = None  # score scale; None = head_dim ** -0.5
    softcap: float | None = None  # tanh soft-capping of the scores; None = off
    # Masks and score modifiers (issue 37, attnbench.correctness.masks): ALiBi biases, a bidirectional prefix of this many tokens,
    # document starts (block-diagonal attention), a learned per-head sink logit (canonical weights' ``sinks``)
    alibi: bool = False
    prefix: int | None = None
    documents: tuple[int, ...] | None = None
    sinks: bool = False
    # RoPE's direction: 1 turns pair j by +position * freq_j (the textbook's, Meta's, HF's); -1 by -position * freq_j
    # (nanochat's). The two are one function up to reflecting q and k; a class's own direction is measured (issue 36).
    rope_sign: int = 1
    # Issue 46: partial rotary (rotate the first rope_head_dim dims of each head; None = all), and DeepSeek-style MLA
    # (kv_lora_rank None = off; see the class docstring and attnbench.correctness.mla_reference)
    rope_head_dim: int | None = None
    q_lora_rank: int | None = None  # None: a full-rank query projection
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("d_in", "d_out", "context_length", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidSpecError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise InvalidSpecError(f"{name} must be positive, got {value}; pass a size >= 1")
        if self.d_out % self.num_heads:
            divisors = [h for h in range(1, self.d_out + 1) if self.d_out % h == 0]
            close = sorted(divisors, key=lambda h: abs(h - self.num_heads))[:3]
            raise InvalidSpecError(
                f"d_out={self.d_out} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads from {sorted(close)} or a d_out that is a multiple of {self.num_heads}"
            )
        if not 0.0 <= float(self.dropout) < 1.0:
            raise InvalidSpecError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.num_kv_heads is not None:
            kv = self.num_kv_heads
            if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.num_heads % kv:
                divisors = [h for h in range(1, self.num_heads + 1) if self.num_heads % h == 0]
                raise InvalidSpecError(f"num_kv_heads={kv!r} does not divide num_heads={self.num_heads}; "
                                       f"choose num_kv_heads from {divisors}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1):
            raise InvalidSpecError(f"window={self.window!r} must be an int >= 1 (1 = each token sees only itself), "
                                   "or None for full attention")
        if not isinstance(self.causal, bool):
            raise InvalidSpecError(f"causal must be True or False, got {self.causal!r}")
        self._check_positional()
        self._check_mla()
        masks.check_fields(self)

    def _check_positional(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise InvalidSpecError(f"{name} must be a positive number or None (off), got {value!r}")

        for name in ("rope_theta", "scale", "softcap", "norm_eps"):
            positive(name)
        if self.rope_style not in ROPE_STYLES:
            raise InvalidSpecError(f"rope_style={self.rope_style!r}; use one of {', '.join(ROPE_STYLES)}")
        if self.rope_head_dim is not None:
            self._check_rope_head_dim()
        elif self.rope_theta is not None and not self.is_mla and self.head_dim % 2:
            raise InvalidSpecError(f"RoPE rotates pairs of dimensions: head_dim={self.head_dim} must be even "
                                   "(choose d_out and num_heads so d_out // num_heads is even, or rope_theta=None)")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                raise InvalidSpecError(f"rope_scaling must be an attnbench.spec.RopeScaling, got {self.rope_scaling!r}")
            if self.rope_theta is None:
                raise InvalidSpecError("rope_scaling needs rope_theta (scaling changes RoPE's frequencies)")
        if self.rope_sign not in (1, -1) or isinstance(self.rope_sign, bool):
            raise InvalidSpecError(f"rope_sign={self.rope_sign!r}; use 1 (pairs turn by +theta) or -1 (by -theta)")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise InvalidSpecError(f"qk_norm={self.qk_norm!r}; use one of {', '.join(QK_NORMS)} or None")

    def _check_rope_head_dim(self) -> None:
        r = self.rope_head_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 2 or r % 2 or r > self.head_dim:
            raise InvalidSpecError(f"rope_head_dim={r!r} must be an even int from 2 to head_dim={self.head_dim} (the "
                                   "first rope_head_dim dims of each head are rotated), or None to rotate the whole head")
        if self.rope_theta is None:
            raise InvalidSpecError(f"rope_head_dim={r} needs rope_theta (it says how much of each head RoPE rotates)")
        if self.is_mla:
            raise InvalidSpecError("MLA rotates the last qk_rope_head_dim dims of each query head and its shared key: "
                                   "leave rope_head_dim None")

    def _check_mla(self) -> None:
        set_ = [n for n in MLA_FIELDS if getattr(self, n) is not None]
        for name in set_:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidSpecError(f"{name} must be a positive int or None, got {value!r}")
        if not self.is_mla:
            if set_:
                raise InvalidSpecError(f"{', '.join(set_)} {'is a' if len(set_) == 1 else 'are'} DeepSeek MLA field"
                                       f"{'s' * (len(set_) > 1)}: set kv_lora_rank too (the kv latent's width, 512 in "
                                       f"DeepSeek-V3), or leave {'it' if len(set_) == 1 else 'them'} None")
            return
        lacking = [n for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if getattr(self, n) is None]
        if lacking:
            raise InvalidSpecError(f"DeepSeek MLA (kv_lora_rank={self.kv_lora_rank}) needs {', '.join(lacking)} "
                                   "(DeepSeek-V3: qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)")
        if self.qk_rope_head_dim % 2:
            raise InvalidSpecError(f"RoPE rotates pairs: qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.rope_theta is None:
            raise InvalidSpecError("DeepSeek MLA rotates its qk_rope_head_dim slice: set rope_theta (DeepSeek-V3: 10000)")
        fixes = [(self.kv_heads != self.num_heads, "leave num_kv_heads None (each head's keys and values come from the "
                                                   "one shared latent)"),
                 (self.qk_norm is not None, "leave qk_norm None (MLA normalises its latents, not q and k)"),
                 (self.qkv_bias, "set qkv_bias=False (DeepSeek's MLA projections have no bias)")]
        for wrong, fix in fixes:
            if wrong:
                raise InvalidSpecError(f"DeepSeek MLA (kv_lora_rank={self.kv_lora_rank}): {fix}")

    @property
    def is_mla(self) -> bool:
        """Whether this is DeepSeek-style multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: ``qk_nope_head_dim + qk_rope_head_dim`` under MLA, else ``head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """How many dimensions of each head RoPE rotates: ``qk_rope_head_dim`` (MLA: the last ones), else
        ``rope_head_dim`` (the first ones), else ``head_dim``."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return self.head_dim if self.rope_head_dim is None else self.rope_head_dim

    def mla_kwargs(self) -> dict:
        """The DeepSeek MLA fields that are set (:data:`MLA_FIELDS`; empty when not MLA)."""
        return {n: getattr(self, n) for n in MLA_FIELDS if getattr(self, n) is not None}

    @property
    def head_dim(self) -> int:
        """Width of one head: ``d_out // num_heads``."""
        return self.d_out // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: ``num_kv_heads``, or ``num_heads`` when it is ``None``."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        """Rows of the canonical ``W_k`` and ``W_v``: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def is_variant(self) -> bool:
        """Whether this is anything but the book's causal multi-head attention (GQA/MQA, a window, non-causal)."""
        return (self.kv_heads != self.num_heads or self.window is not None or not self.causal
                or bool(self.mask_kinds) or self.is_mla)

    @property
    def mask_kinds(self) -> tuple[str, ...]:
        """The masks beyond causal / window / softcap it uses (``alibi``, ``prefix``, ``document``, ``sink``)."""
        return masks.kinds_of(self)

    @property
    def score_scale(self) -> float:
        """What scores are multiplied by: ``scale``, or ``qk_head_dim ** -0.5`` (``head_dim ** -0.5`` but under MLA)
        when it is ``None``."""
        return self.qk_head_dim ** -0.5 if self.scale is None else float(self.scale)

    @property
    def is_positional(self) -> bool:
        """Whether any positional field (RoPE, QK-norm, score scale, soft-capping) is set."""
        return bool(self.positional_kwargs())

    def positional_kwargs(self) -> dict:
        """The positional fields (issue 26) that differ from their defaults (``rope_style`` and ``norm_eps``
        only when RoPE resp. QK-norm is on)."""
        out: dict = {}
        if self.rope_theta is not None:
            out.update(rope_theta=self.rope_theta, rope_style=self.rope_style)
            if self.rope_scaling is not None:
                out["rope_scaling"] = self.rope_scaling
            if self.rope_sign != 1:
                out["rope_sign"] = self.rope_sign
            if self.rope_head_dim is not None:
                out["rope_head_dim"] = self.rope_head_dim
        if self.qk_norm is not None:
            out.update(qk_norm=self.qk_norm, norm_eps=self.norm_eps)
        if self.scale is not None:
            out["scale"] = self.scale
        if self.softcap is not None:
            out["softcap"] = self.softcap
        return out

    def positional_text(self) -> str:
        """The positional fields as one sweep value (``""`` when none is set; :func:`positional_from_text` reads it).
        A scaling other than the default Llama-3 one has no text: build such a spec in Python."""
        kw = self.positional_kwargs()
        if "rope_scaling" in kw:
            if kw["rope_scaling"] != RopeScaling():
                raise InvalidSpecError(f"{kw['rope_scaling']} is not the default llama3 scaling a sweep can name")
            kw["rope_scaling"] = "llama3"
        if kw.get("rope_style") == "half":
            del kw["rope_style"]
        if kw.get("norm_eps") == 1e-6:
            del kw["norm_eps"]
        return ";".join(f"{k}={_number(v) if isinstance(v, float) else v}" for k, v in kw.items())

    def variant_kwargs(self) -> dict:
        """The variant fields that differ from the book's defaults (what a variant-aware constructor takes)."""
        out: dict = {}
        if self.kv_heads != self.num_heads:
            out["num_kv_heads"] = self.kv_heads
        if self.window is not None:
            out["window"] = self.window
        if not self.causal:
            out["causal"] = False
        for name, off in (("alibi", False), ("prefix", None), ("documents", None), ("sinks", False)):
            if getattr(self, name) != off:
                out[name] = getattr(self, name)
        return out

    def kwargs(self) -> dict:
        """The constructor's keyword arguments, in the book's order, plus the variant fields that differ
        from the defaults, plus the positional and MLA fields that differ (so ``AttnSpec(**spec.kwargs()) == spec``)."""
        book = {k: getattr(self, k) for k in ("d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias")}
        out = {**book, **self.variant_kwargs(), **self.positional_kwargs(), **self.mla_kwargs()}
        if self.norm_eps != 1e-6:
            out["norm_eps"] = self.norm_eps
        if self.rope_style != "half":
            out["rope_style"] = self.rope_style
        return out

    def check_input(self, x: torch.Tensor) -> None:
        """Raise :class:`InputShapeError` unless ``x`` is ``(b, T, d_in)`` with ``1 <= T <= context_length``."""
        if x.dim() != 3:
            raise InputShapeError(
                f"input must have shape (batch, seq_len, d_in={self.d_in}); got rank {x.dim()} "
                f"shape {tuple(x.shape)}. Add a batch dimension with x.unsqueeze(0)"
            )
        _, seq_len, width = x.shape
        if width != self.d_in:
            raise InputShapeError(f"input width is {width} but the layer was built with d_in={self.d_in}")
        if not 1 <= seq_len <= self.context_length:
            raise InputShapeError(
                f"sequence length {seq_len} is outside 1..context_length={self.context_length}; "
                "build the layer with a larger context_length or shorten the input"
            )
