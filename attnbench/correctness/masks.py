"""The mask and score-modifier collection (issue 37): one syntax, the ALiBi slopes, document boundaries, and the one
definition of which query-key pairs a mask keeps.

**Syntax** (``attnbench run --mask``; one mask is parts joined by ``+``, several masks by ``,``):

* ``causal``: each token sees itself and the tokens before it (the default); ``full`` (or ``bidirectional``): every
  token sees every token (``AttnSpec.causal = False``);
* ``window:N``: a sliding window, the token and the previous ``N - 1`` (``AttnSpec.window``);
* ``softcap:C``: ``C * tanh(s / C)`` of the scaled scores (``AttnSpec.softcap``);
* ``prefix:N``: prefix-LM: the first ``N`` tokens see each other both ways, the rest is causal (``AttnSpec.prefix``);
* ``document`` or ``document:D``: ``D`` documents (default 4) packed in one sequence; a token sees only tokens of
  its own document (and, causal, not later ones). The boundaries are drawn from seed 0 over the context length, so
  every implementation, run and machine gets the same documents (:func:`draw_documents`; ``AttnSpec.documents``);
* ``alibi``: a per-head linear bias ``-slope_h * |i - j|`` added to the scores (the ALiBi paper's geometric slopes,
  :func:`alibi_slopes`; ``AttnSpec.alibi``);
* ``sink``: a learned per-head logit in the softmax's denominator (gpt-oss's ``sinks``, shape ``(num_heads,)``):
  ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``; the sink takes probability and gives no value
  (``AttnSpec.sinks``; the canonical weights' ``sinks``).

Everything composes (``alibi+window:64``, ``document:8+sink+softcap:30``) except ``prefix`` with ``full`` (a prefix is
only bidirectional against a causal rest) and ``prefix`` with ``document`` (which document's prefix?). The order in
which the pieces apply, in the reference and every implementation: scores * scale -> softcap -> + ALiBi bias -> the
mask (causal / window / prefix / document) -> softmax with the sink -> weights @ V.

``causal``, ``full``, ``window`` and ``softcap`` are the spec fields that existed before (``--causal``, ``--window``,
``--softcap``): a ``--mask`` part sets them. ``alibi``, ``prefix``, ``document`` and ``sink`` (:data:`KINDS`) are what
an implementation declares it computes (``masks=`` of ``register`` / ``attnbench_capabilities``).
"""

from __future__ import annotations

import math

import torch

from attnbench.errors import InvalidSpecError

KINDS = ("alibi", "prefix", "document", "sink")
"""The mask kinds beyond the spec's causal / window / softcap fields: what ``masks`` capabilities name."""
DEFAULT_DOCUMENTS = 4
DOCUMENT_SEED = 0
SYNTAX = ("causal | full | window:N | softcap:C | prefix:N | document[:D] | alibi | sink, joined by + "
          "(e.g. alibi+window:64)")


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's per-head slopes (Press et al. 2022): for ``n`` a power of two, ``2 ** (-8 (h + 1) / n)`` for
    head ``h = 0 .. n - 1``; otherwise the slopes of the largest power of two ``m < n``, followed by every other slope
    of ``2m`` (the even-indexed ones: ``2 ** (-8 (2k + 1) / 2m)``) until there are ``n``. Head 0 has the steepest."""
    def power_of_two(n: int) -> list[float]:
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_two(num_heads)
    m = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(m) + power_of_two(2 * m)[0::2][: num_heads - m]


def draw_documents(length: int, count: int = DEFAULT_DOCUMENTS, seed: int = DOCUMENT_SEED) -> tuple[int, ...]:
    """The start positions of documents 2 .. ``count`` in a sequence of ``length`` (sorted, distinct, in
    ``1 .. length - 1``), drawn from ``seed``: fewer when the sequence is too short for ``count`` documents."""
    count = max(1, min(count, length))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randperm(length - 1, generator=g)[: count - 1] + 1 if length > 1 else torch.zeros(0, dtype=torch.long)
    return tuple(sorted(int(s) for s in starts))


def document_ids(positions: torch.Tensor, documents: tuple[int, ...] | None) -> torch.Tensor:
    """The document of each position: how many document starts are at or before it (0 without documents)."""
    if not documents:
        return torch.zeros_like(positions)
    starts = torch.tensor(documents, device=positions.device, dtype=positions.dtype)
    return (positions[..., None] >= starts).sum(-1)


def keep(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool = True, window: int | None = None,
         prefix: int | None = None, documents: tuple[int, ...] | None = None) -> torch.Tensor:
    """Whether query at ``q_pos`` may attend to key at ``k_pos`` (broadcast; bool): causal ``k <= q`` (or ``k`` in the
    prefix), a window ``|q - k| < w``, the same document. The one definition of every mask (module docstring)."""
    ok = torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        ok = k_pos <= q_pos
        if prefix is not None:
            ok = ok | (k_pos < prefix)
    if window is not None:
        ok = ok & ((q_pos - k_pos).abs() < window)
    if documents:
        ok = ok & (document_ids(q_pos, documents) == document_ids(k_pos, documents))
    return ok


def spec_keep(spec, T_q: int, T_k: int | None = None, device=None) -> torch.Tensor:
    """``(T_q, T_k)`` bool: :func:`keep` for ``spec``'s mask, queries at the last ``T_q`` of ``T_k`` key positions."""
    T_k = T_q if T_k is None else T_k
    i = torch.arange(T_k - T_q, T_k, device=device)[:, None]
    j = torch.arange(T_k, device=device)[None, :]
    return keep(i, j, causal=spec.causal, window=spec.window, prefix=getattr(spec, "prefix", None),
                documents=getattr(spec, "documents", None))


def alibi_bias(num_heads: int, T_q: int, T_k: int | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """``(num_heads, T_q, T_k)``: ``-slope_h * |i - j|`` (queries at the last ``T_q`` of the ``T_k`` positions)."""
    T_k = T_q if T_k is None else T_k
    i = torch.arange(T_k - T_q, T_k, device=device)[:, None]
    j = torch.arange(T_k, device=device)[None, :]
    slopes = torch.tensor(alibi_slopes(num_heads), device=device, dtype=torch.float64)
    return (-slopes[:, None, None] * (i - j).abs()).to(dtype)


def parse(text: str, context_length: int | None = None) -> dict:
    """The spec fields of one mask text (module docstring): ``"alibi+window:64"`` -> ``{"alibi": True, "window": 64}``.
    ``document[:D]`` gives ``documents_count``; :func:`spec_fields` turns it into boundaries for a length."""
    out: dict = {}
    for raw in filter(None, (p.strip().lower() for p in str(text or "").split("+"))):
        name, _, value = raw.partition(":")
        if name in out or (name in ("causal", "full", "bidirectional") and "causal" in out):
            raise InvalidSpecError(f"mask {text!r} gives {name} twice")
        if name in ("causal", "full", "bidirectional", "alibi", "sink") and value:
            raise InvalidSpecError(f"mask part {raw!r} takes no value; the syntax is {SYNTAX}")
        if name in ("causal", "full", "bidirectional"):
            out["causal"] = name == "causal"
        elif name in ("alibi", "sink"):
            out["alibi" if name == "alibi" else "sinks"] = True
        elif name in ("window", "prefix", "document"):
            if name == "document" and not value:
                value = str(DEFAULT_DOCUMENTS)
            if not value.isdigit() or int(value) < 1:
                raise InvalidSpecError(f"mask part {raw!r}: {name} needs an integer >= 1 ({name}:N)")
            out["documents_count" if name == "document" else name] = int(value)
        elif name == "softcap":
            try:
                out["softcap"] = float(value)
            except ValueError:
                raise InvalidSpecError(f"mask part {raw!r}: softcap needs a number (softcap:30)") from None
        else:
            raise InvalidSpecError(f"unknown mask part {raw!r}; the syntax is {SYNTAX}")
    if "prefix" in out and out.get("causal") is False:
        raise InvalidSpecError(f"mask {text!r}: a prefix is bidirectional against a causal rest; drop full or prefix")
    if "prefix" in out and "documents_count" in out:
        raise InvalidSpecError(f"mask {text!r}: prefix and document do not compose (which document's prefix?)")
    return out


def spec_fields(text: str, length: int) -> dict:
    """:func:`parse` with ``document:D`` as boundaries drawn for a sequence of ``length`` (:func:`draw_documents`)."""
    out = parse(text)
    count = out.pop("documents_count", None)
    if count is not None:
        out["documents"] = draw_documents(length, count)
    return out


def extra_text(fields: dict) -> str:
    """The canonical text of the :data:`KINDS` among ``fields`` (``alibi+prefix:16+document:4+sink``; ``""``: none) —
    what a cell's ``mask`` axis holds (causal, window and softcap live in their own axes)."""
    parts = ["alibi"] * bool(fields.get("alibi"))
    if fields.get("prefix") is not None:
        parts.append(f"prefix:{fields['prefix']}")
    if fields.get("documents_count") is not None:
        parts.append(f"document:{fields['documents_count']}")
    elif fields.get("documents"):
        parts.append(f"document:{len(fields['documents']) + 1}")
    parts += ["sink"] * bool(fields.get("sinks"))
    return "+".join(parts)


def label(causal: bool = True, window: int | None = None, softcap: float | None = None, extra: str = "") -> str:
    """The whole mask as one text (``causal+window:64+alibi``): what a figure or a table names a row's mask by."""
    parts = ["causal" if causal else "full"] + ([f"window:{window}"] if window is not None else [])
    parts += [f"softcap:{softcap:g}"] if softcap is not None else []
    return "+".join(parts + ([extra] if extra else []))


def kinds_of(spec) -> tuple[str, ...]:
    """The :data:`KINDS` ``spec`` (an AttnSpec, or anything with its field names; absent ones: off) uses."""
    found = {"alibi": bool(getattr(spec, "alibi", False)), "prefix": getattr(spec, "prefix", None) is not None,
             "document": bool(getattr(spec, "documents", None)), "sink": bool(getattr(spec, "sinks", False))}
    return tuple(k for k in KINDS if found[k])


def check_fields(spec) -> None:
    """Raise :class:`InvalidSpecError` for mask fields of ``spec`` that make no sense (called by ``AttnSpec``)."""
    prefix, documents = spec.prefix, spec.documents
    if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 1):
        raise InvalidSpecError(f"prefix={prefix!r} must be an int >= 1 (the bidirectional prefix's length) or None")
    if prefix is not None and not spec.causal:
        raise InvalidSpecError("prefix needs causal=True: a prefix is bidirectional against a causal rest")
    if documents is not None:
        if not isinstance(documents, tuple) or not all(isinstance(d, int) and d >= 1 for d in documents) \
                or list(documents) != sorted(set(documents)):
            raise InvalidSpecError(f"documents={documents!r} must be a tuple of increasing start positions >= 1 "
                                   "(the starts of documents 2, 3, ...)")
        if prefix is not None:
            raise InvalidSpecError("prefix and documents do not compose (which document's prefix?)")
    for name in ("alibi", "sinks"):
        if not isinstance(getattr(spec, name), bool):
            raise InvalidSpecError(f"{name} must be True or False, got {getattr(spec, name)!r}")
