"""Can this implementation run this cell here? One answer, :class:`Ready` or :class:`Skip`, from one place.

``attnbench run`` (a cell's ``skipped`` row), ``attnbench check`` (a case's ``skip``), ``attnbench profile``
(an error before anything is written), the asv suite (a skipped benchmark) and
:meth:`attnbench.registry.Implementation.build` all ask :func:`resolve`::

    outcome = resolve(registry.get("sdpa_flash"), cell)       # a results Cell (registry.resolve takes names) ...
    outcome = resolve(impl, spec, device="cuda", dtype="float32", mode="forward+backward", batch=2, seq_len=128)
    if isinstance(outcome, Skip):
        print(outcome.reason)                                 # or: raise outcome.exception()
    else:
        outcome.device, outcome.dtype                         # the device string parsed once, the torch dtype

What is asked is a :class:`Request` (device, dtype, mode, sizes, dropout, cache). The answer is the first
reason of :data:`RULES`, a list of functions ``rule(impl, request) -> str | None`` tried in order;
a rule whose input is not known (no mode, no sizes) says nothing. **A new capability is one function
appended to RULES** (the attention variants, ``num_kv_heads``, ``window``, ``causal`` and the decode
mode, are fields of :class:`Request` and :func:`variant_rule`).

On CUDA, implementations that force one ``F.scaled_dot_product_attention`` backend
(:attr:`~attnbench.registry.Implementation.sdpa_backend`) are asked of PyTorch's own capability checks
(``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention`` /
``can_use_cudnn_attention`` with ``SDPAParams``), so ``sdpa_flash`` in float32 or at head_dim 1 is
``skipped`` with PyTorch's reason, not an ``error``. That version-dependent API is wrapped in
:func:`sdpa_capability` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import warnings
from collections.abc import Callable

import torch
from packaging.version import Version

from attnbench.correctness import masks
from attnbench.devices import cuda_available, dtype_name, parse_device, parse_device_type, to_dtype
from attnbench.errors import AttnbenchError, InvalidSpecError, SweepError, UnavailableError
from attnbench.spec import positional_from_text


@dataclasses.dataclass(frozen=True)
class Request:
    """What is asked of an implementation. ``None`` means "not known here": the rules about it are not applied."""

    device: str = "cpu"
    dtype: str | None = None
    mode: str | None = None  # inference | forward | forward+backward | decode
    d_in: int | None = None
    d_out: int | None = None
    num_heads: int | None = None
    batch: int | None = None
    seq_len: int | None = None
    dropout: float = 0.0
    cache: str = "warm"
    num_kv_heads: int | None = None  # None: as many as num_heads (MHA)
    window: int | None = None  # None: full attention
    causal: bool = True
    # Positional fields (issue 26), as in AttnSpec; None / "half": off
    rope_theta: float | None = None
    rope_style: str = "half"
    qk_norm: str | None = None
    scale: float | None = None
    softcap: float | None = None
    rope_head_dim: int | None = None  # issue 46: RoPE over the first rope_head_dim dims of each head; None: all
    masks: tuple[str, ...] = ()  # issue 37: the kinds of attnbench.correctness.masks.KINDS asked for (alibi, prefix, ...)
    lengths: str | None = None  # issue 37: a cell's length distribution ("" = a rectangle); None: not known here
    batch_spec: str | None = None  # issue 48: a mixed serving step (attnbench.runner.mixed); "" / None: not one

    @property
    def train(self) -> bool:
        """Whether the module runs in train mode (dropout applies, autograd records)."""
        return self.mode in ("forward", "forward+backward")

    @functools.cached_property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``: the device string parsed once (an unknown device is a :class:`SweepError`)."""
        return parse_device_type(self.device)

    @functools.cached_property
    def located(self) -> tuple[torch.device | None, str | None]:
        """``(device, None)`` when the device exists here (index resolved), else ``(None, why not)``; parsed once."""
        try:
            return parse_device(self.device), None
        except UnavailableError as exc:
            return None, str(exc)

    @property
    def head_dim(self) -> int | None:
        """``d_out // num_heads`` when both are known and divide."""
        if self.d_out and self.num_heads and self.d_out % self.num_heads == 0:
            return self.d_out // self.num_heads
        return None

    def where(self) -> str:
        """``on cuda (float32)``: how an error message names the place."""
        return f"on {self.device}" + (f" ({self.dtype})" if self.dtype else "")


@dataclasses.dataclass(frozen=True)
class Ready:
    """The implementation can run: the device (parsed once, index resolved) and dtype to build it with."""

    device: torch.device
    dtype: torch.dtype | None
    reason = None  # so that ``resolve(...).reason`` is None exactly when it can run


@dataclasses.dataclass(frozen=True)
class Skip:
    """It cannot run here, and why. ``error`` is the exception a caller that must fail raises."""

    reason: str
    impl: str = ""
    where: str = ""
    error: type[AttnbenchError] = UnavailableError

    def exception(self) -> AttnbenchError:
        """The one-line user error for this skip (``<impl> cannot run on <device> (<dtype>): <reason>``)."""
        return self.error(f"{self.impl} cannot run {self.where}: {self.reason}")


Rule = Callable[..., str | None]
"""``rule(impl: Implementation, request: Request) -> reason | None``."""


# ---------------------------------------------------------------- the rules, in order


def sizes_rule(impl, req: Request) -> str | None:
    """The width must split into whole heads."""
    if req.d_out and req.num_heads and req.d_out % req.num_heads:
        return f"d_model={req.d_out} is not divisible by num_heads={req.num_heads}"
    return None


def torch_version_rule(impl, req: Request) -> str | None:
    """The implementation's ``min_torch`` (release numbers only: a ``2.6.0a0+git`` build counts as 2.6.0)."""
    if Version(torch.__version__).release < Version(impl.min_torch).release:
        return f"needs torch >= {impl.min_torch} (installed {torch.__version__})"
    return None


def device_type_rule(impl, req: Request) -> str | None:
    """The device types the implementation declares."""
    if req.device_type not in impl.devices:
        if impl.devices == ("cuda",) and not cuda_available():
            return "needs CUDA"
        return f"runs only on {', '.join(impl.devices)}"
    return None


def device_present_rule(impl, req: Request) -> str | None:
    """The device exists on this machine (CUDA built and visible, the index in range)."""
    return req.located[1]


def dtype_rule(impl, req: Request) -> str | None:
    """The dtypes the implementation declares."""
    if req.dtype is not None and req.dtype not in impl.dtypes:
        return f"does not support {req.dtype} (supports {', '.join(impl.dtypes)})"
    return None


def same_width_rule(impl, req: Request) -> str | None:
    """Implementations built on ``nn.MultiheadAttention`` need ``d_in == d_out``."""
    if impl.same_width_only and req.d_in is not None and req.d_out is not None and req.d_in != req.d_out:
        return f"needs d_in == d_out, got d_in={req.d_in}, d_out={req.d_out}"
    return None


def backward_rule(impl, req: Request) -> str | None:
    """``forward`` records autograd and ``forward+backward`` runs it: kernels without backward refuse both."""
    if req.train and not impl.supports_backward(req.device_type):
        return f"declares no backward on {req.device_type} (needed for {req.mode})"
    return None


def dropout_rule(impl, req: Request) -> str | None:
    """Dropout in train mode needs an implementation that applies it."""
    if req.dropout > 0 and req.train and not impl.supports_dropout(req.device_type):
        return f"declares no dropout on {req.device_type}"
    return None


def cache_rule(impl, req: Request) -> str | None:
    """The cold cache is an L2 flush between calls, which exists on CUDA only."""
    if req.cache == "cold" and req.device_type != "cuda":
        return "cold cache (L2 flush) exists only for CUDA cells"
    return None


def probe_rule(impl, req: Request) -> str | None:
    """The implementation's own probe (a backend compiled into this torch build, a plug-in that failed to load)."""
    return impl.probe(req.located[0]) if impl.probe is not None else None


def sdpa_rule(impl, req: Request) -> str | None:
    """On CUDA, a forced SDPA backend must pass PyTorch's own capability check for this cell's tensors."""
    if not impl.sdpa_backend or req.device_type != "cuda" or req.dtype is None or req.head_dim is None:
        return None
    return sdpa_capability(impl.sdpa_backend, req.located[0], req.dtype, req.batch or 1, req.num_heads,
                           req.seq_len or 16, req.head_dim, requires_grad=req.train,
                           dropout_p=req.dropout if req.train else 0.0)


def kv_heads_rule(impl, req: Request) -> str | None:
    """Query heads are shared by the kv heads in equal groups."""
    if req.num_kv_heads and req.num_heads and req.num_heads % req.num_kv_heads:
        return f"num_kv_heads={req.num_kv_heads} does not divide num_heads={req.num_heads}"
    return None


def variant_skip_reason(impl, spec, mode: str = "inference") -> str | None:
    """Why ``impl`` cannot compute ``spec``'s variant in ``mode``, or ``None`` when it can.

    The one rule for attention variants, the positional fields and decoding, from the capabilities the
    implementation declares (``gqa``, ``sliding_window``, ``non_causal``, ``kv_cache``; ``rope``, ``qk_norm``,
    ``score_scale``, ``softcap``); used by ``attnbench run``, ``attnbench check``, ``attnbench profile`` and the
    asv suite. ``spec`` is an ``AttnSpec`` or anything with its attribute names (absent positional ones: off).
    """
    missing = positional_missing(impl, spec)
    if spec.kv_heads != spec.num_heads and not impl.gqa:
        missing.append(f"grouped/multi-query attention (num_kv_heads={spec.kv_heads} < num_heads={spec.num_heads})")
    if spec.window is not None and not impl.sliding_window:
        missing.append(f"sliding windows (window={spec.window})")
    if not spec.causal and not impl.non_causal:
        missing.append("non-causal attention")
    lacking = [k for k in getattr(spec, "mask_kinds", ()) if k not in getattr(impl, "masks", ())]
    if lacking:
        missing.append(f"the {'+'.join(lacking)} mask{'s' * (len(lacking) > 1)} (attnbench.correctness.masks; declare masks=)")
    if mode == "decode":
        if not impl.kv_cache:
            missing.append("a KV cache (decode mode)")
        elif not spec.causal:
            return "decode needs causal attention: a token being generated cannot see later tokens"
    return f"does not support {' or '.join(missing)}" if missing else None


def positional_missing(impl, spec) -> list[str]:
    """The positional fields of ``spec`` (RoPE and its style, QK-norm and its placement, scale, cap) ``impl`` lacks."""
    missing = []
    theta, style = getattr(spec, "rope_theta", None), getattr(spec, "rope_style", "half")
    if theta is not None and style not in getattr(impl, "rope", ()):
        missing.append(f"rotary position embeddings in the {style!r} style (rope_theta={theta:g})")
    norm = getattr(spec, "qk_norm", None)
    if norm is not None and norm not in getattr(impl, "qk_norm", ()):
        missing.append(f"QK-norm over {'each head' if norm == 'head' else 'the whole projection'} (qk_norm={norm!r})")
    if getattr(spec, "scale", None) is not None and not getattr(impl, "score_scale", False):
        missing.append(f"a score scale other than head_dim ** -0.5 (scale={spec.scale:g})")
    partial = getattr(spec, "rope_head_dim", None)
    if theta is not None and partial is not None and not getattr(impl, "rope_partial", False):
        missing.append(f"rotary embeddings over part of each head (rope_head_dim={partial})")
    if getattr(spec, "softcap", None) is not None and not getattr(impl, "softcap", False):
        missing.append(f"soft-capping of the scores (softcap={spec.softcap:g})")
    return missing


def variant_rule(impl, req: Request) -> str | None:
    """GQA/MQA, sliding windows, non-causal attention and decode (a KV cache): what the implementation declares
    (:func:`variant_skip_reason`)."""
    heads = req.num_heads or 1
    asked = types.SimpleNamespace(num_heads=heads, kv_heads=req.num_kv_heads or heads, window=req.window,
                                  causal=req.causal, rope_theta=req.rope_theta, rope_style=req.rope_style,
                                  qk_norm=req.qk_norm, scale=req.scale, softcap=req.softcap, mask_kinds=req.masks,
                                  rope_head_dim=req.rope_head_dim)
    return variant_skip_reason(impl, asked, req.mode or "inference")


def varlen_rule(impl, req: Request) -> str | None:
    """Issue 37: a cell with ``lengths`` (a variable-length batch) needs an implementation that declares ``varlen``,
    and a ``varlen`` implementation takes only such cells (``lengths`` unknown: not applied)."""
    if req.lengths is None:
        return None
    takes = bool(getattr(impl, "varlen", False))
    if req.lengths and not takes:
        return (f"does not support variable-length batches (lengths={req.lengths}); the varlen implementations do "
                "(varlen_padded, varlen_packed, varlen_loop, ...: docs/varlen.md)")
    if not req.lengths and takes and not req.batch_spec:  # issue 48: a varlen class runs the mixed step too
        return ("a variable-length implementation: it runs cells with --lengths (constant, uniform:LO-HI, longtail, "
                "bimodal or a file; docs/varlen.md)")
    return None


def mixed_rule(impl, req: Request) -> str | None:
    """Issue 48: a mixed serving step (``batch_spec``) needs a paged KV cache (or a class that declares
    ``attnbench_mixed_step``: found when it is built) or a variable-length class (:mod:`attnbench.runner.mixed`)."""
    if not req.batch_spec or getattr(impl, "varlen", False) or getattr(impl, "kv_cache", False):
        return None
    return (f"runs no mixed serving step (batch_spec={req.batch_spec}): that needs a paged KV cache (paged_sdpa, "
            "flex_paged) or variable-length input (varlen_padded, varlen_packed, ...); docs/properties.md")


RULES: list[Rule] = [sizes_rule, kv_heads_rule, torch_version_rule, device_type_rule, device_present_rule, dtype_rule,
                     same_width_rule, backward_rule, dropout_rule, cache_rule, variant_rule, varlen_rule, mixed_rule, probe_rule,
                     sdpa_rule]
"""Tried in order; the first reason wins. Append a function to add a capability."""

_ERRORS = {sizes_rule: InvalidSpecError, kv_heads_rule: InvalidSpecError}
"""The user error of a rule whose skip is a bad request rather than an unavailable implementation."""


# ---------------------------------------------------------------- resolve


POSITIONAL_FIELDS = ("rope_theta", "rope_style", "qk_norm", "scale", "softcap", "rope_head_dim")
"""The positional fields a :class:`Request` carries from a spec or a cell (issue 26)."""


def _mask_kinds(text: str) -> tuple[str, ...]:
    """The :data:`attnbench.correctness.masks.KINDS` a cell's ``mask`` text asks for."""
    fields = masks.parse(text if text == text else "")  # NaN read back from a row: none
    fields["documents"] = (1,) if fields.pop("documents_count", None) else None
    return masks.kinds_of(types.SimpleNamespace(**fields))


def _positional_fields(text: str) -> dict:
    """The :data:`POSITIONAL_FIELDS` of a cell's ``positional`` text (:func:`attnbench.spec.positional_from_text`)."""
    return {k: v for k, v in positional_from_text(text).items() if k in POSITIONAL_FIELDS}


def request_for(target=None, **given) -> Request:
    """A :class:`Request` from a results ``Cell``, an ``AttnSpec``, a ``Request`` or nothing, plus keyword fields.

    A cell is ``d_in = d_out = d_model``; a spec brings its widths, heads and dropout. Keywords override.
    Unknown devices, dtypes and modes are user errors (:class:`~attnbench.errors.SweepError`), not skips.
    """
    fields: dict = {}
    if isinstance(target, Request):
        fields = dataclasses.asdict(target)
    elif target is not None and hasattr(target, "d_model"):  # attnbench.results.schema.Cell
        # a block or model mode asks of the attention inside what it does there (train: forward+backward, ...)
        fields = dict(device=target.device, dtype=target.dtype, mode=getattr(target, "attention_mode", target.mode),
                      d_in=target.d_model,
                      d_out=target.d_model, num_heads=target.num_heads, batch=target.batch, seq_len=target.seq_len,
                      cache=target.cache, num_kv_heads=target.num_kv_heads, window=target.window, causal=target.causal,
                      masks=_mask_kinds(getattr(target, "mask", "")), lengths=getattr(target, "lengths", ""),
                      batch_spec=getattr(target, "batch_spec", "") or None,
                      **_positional_fields(getattr(target, "positional", "")))
    elif target is not None:  # attnbench.spec.AttnSpec
        fields = dict(d_in=target.d_in, d_out=target.d_out, num_heads=target.num_heads, dropout=float(target.dropout),
                      num_kv_heads=target.num_kv_heads, window=target.window, causal=target.causal,
                      masks=masks.kinds_of(target), **{k: getattr(target, k) for k in POSITIONAL_FIELDS})
    fields.update({k: v for k, v in given.items() if v is not None})
    if "device" in fields:
        fields["device"] = str(fields["device"]).strip().lower()
    if fields.get("dtype") is not None:
        fields["dtype"] = dtype_name(fields["dtype"])
    if fields.get("mode") is not None:
        from attnbench.results.schema import MODES

        if fields["mode"] not in MODES:
            raise SweepError(f"unknown mode {fields['mode']!r}; use one of {', '.join(MODES)}")
    req = Request(**fields)
    req.device_type  # noqa: B018  (an unknown device is a user error here, before any rule)
    return req


def resolve(impl, target=None, **given) -> Ready | Skip:
    """Whether ``impl`` (an :class:`~attnbench.registry.Implementation`; a name: :func:`attnbench.registry.resolve`)
    can run ``target`` here.

    ``target`` is a results ``Cell``, an ``AttnSpec`` (with ``device``, ``dtype``, ``mode``, ``batch``,
    ``seq_len`` as keywords) or a :class:`Request`. Returns :class:`Ready` with the parsed device and
    dtype, or :class:`Skip` with the first reason of :data:`RULES`. Unknown names, devices, dtypes and
    modes raise their :class:`~attnbench.errors.AttnbenchError` instead.
    """
    if isinstance(impl, str):  # the registry looks names up; this module never imports it (no cycle)
        raise TypeError(f"attnbench.resolve.resolve takes an Implementation, not the name {impl!r}; "
                        f"use attnbench.registry.resolve({impl!r}, ...) (or attnbench.get(name))")
    req = request_for(target, **given)
    for rule in RULES:
        reason = rule(impl, req)
        if reason:
            return Skip(reason, impl=impl.name, where=req.where(), error=_ERRORS.get(rule, UnavailableError))
    return Ready(req.located[0], to_dtype(req.dtype) if req.dtype else None)


def ready_for(impl, cell, ready: Ready | None = None) -> Ready:
    """``ready`` when the caller has it, else :func:`resolve` of ``cell`` here, a :class:`Skip` raised as its
    exception: the first step of building any cell's workload (layer, variable-length, block or model)."""
    if ready is not None:
        return ready
    outcome = resolve(impl, cell)
    if isinstance(outcome, Skip):
        raise outcome.exception()
    return outcome


# ---------------------------------------------------------------- PyTorch's SDPA capability checks

_SDPA_CHECKS = {"flash": "can_use_flash_attention", "efficient": "can_use_efficient_attention",
                "cudnn": "can_use_cudnn_attention"}
_NATIVE_WARNING = re.compile(r"^\[W[^\]]*\]\s*(?:Warning:\s*)?(.*?)(?:\s*\(function \S+\))?\s*$")


def _sdpa_params(q: torch.Tensor, dropout_p: float):
    """``SDPAParams(q, k, v, mask, dropout, is_causal[, enable_gqa])`` in the installed torch's signature, or None."""
    params = getattr(torch.backends.cuda, "SDPAParams", None)
    if params is None:
        return None
    for args in ((q, q, q, None, dropout_p, True, False), (q, q, q, None, dropout_p, True)):  # torch >= 2.5, older
        try:
            return params(*args)
        except TypeError:
            continue
    return None


@functools.lru_cache(maxsize=256)
def sdpa_capability(backend: str, device: torch.device, dtype: str, batch: int, num_heads: int, seq_len: int,
                    head_dim: int, requires_grad: bool = False, dropout_p: float = 0.0) -> str | None:
    """Why PyTorch's ``backend`` SDPA kernel cannot run causal attention on these tensors, or None.

    Asks ``torch.backends.cuda.can_use_<backend>_attention(SDPAParams(...), debug=True)`` with tensors of
    the cell's shape (expanded from one row: no memory) laid out as the implementations make them,
    ``(batch, heads, T, head_dim)`` with the last dimension contiguous. PyTorch states its reasons as
    warnings, either Python warnings or native lines on stderr; both are collected. When this torch has
    no such check (or no ``SDPAParams``), the answer is None: the implementation's probe and the run decide.
    """
    check = getattr(torch.backends.cuda, _SDPA_CHECKS.get(backend, ""), None)
    if check is None:
        return None
    base = torch.empty(1, 1, 1, head_dim, device=device, dtype=to_dtype(dtype), requires_grad=requires_grad)
    q = base.expand(batch, seq_len, num_heads, head_dim).transpose(1, 2)  # (b, nh, T, hd), as split_heads makes it
    params = _sdpa_params(q, dropout_p)
    if params is None:
        return None
    from attnbench.measure.memory import native_stderr

    with warnings.catch_warnings(record=True) as caught, native_stderr(capture=True) as native:
        warnings.simplefilter("always")
        ok = bool(check(params, debug=True))
    if ok:
        return None
    said = [str(w.message).strip() for w in caught]
    for line in native.text().splitlines():
        m = _NATIVE_WARNING.match(line.strip())
        if m and m.group(1):
            said.append(m.group(1))
    said = list(dict.fromkeys(s for s in said if s))
    detail = "; ".join(said) if said else f"{_SDPA_CHECKS[backend]} is False for {dtype}, head_dim {head_dim}"
    return f"PyTorch's {backend} SDPA kernel cannot run this cell: {detail}"
