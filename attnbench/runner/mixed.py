"""Issue 48: the mixed serving step, a batch of chunked prefills and single-token decodes over caches of different
lengths, and the batch-spec grammar that describes it.

A server's attention step is not a rectangle. It mixes a few prefills (or chunks of one) with many decodes, each
request over its own cache. The grammar is vLLM's (``benchmarks/attention_benchmarks``): a batch spec is terms joined
by ``_`` or ``+``, each term ``[COUNT]q<Q>[kv<KV>]`` (``s`` is accepted for ``kv``, the older spelling):

* ``COUNT``: how many identical requests (default 1);
* ``Q``: the request's new tokens in this step (1: a decode; more: a prefill or a chunk of one);
* ``KV``: the tokens the request attends over after the step, its cache *including* the new tokens (default ``Q``: a
  prefill from an empty cache); ``KV - Q`` tokens are cached before the step;
* a ``k`` after a number multiplies it by 1024.

``2q1k_32q1kv2k`` (or ``2q1k+32q1s2k``): 2 prefills of 1,024 tokens and 32 decodes over 2,048-token caches.

A module runs the step when it has the paged-cache protocol (``set_page_size``, ``forward(x, use_cache=True,
lengths=...)``: ``implementations/paged.py``): one call fills every request's cache with its ``KV - Q`` earlier tokens
(:func:`fill`), then the step is one call with ``lengths = [Q, ...]`` (:func:`step`). FLOPs and bytes count real
tokens only (:func:`mixed_flops`, :func:`mixed_kv_bytes`).

As a sweep axis (``attnbench run --batch-spec``, a sweep file's ``batch_spec``): :func:`parse_batch_specs` and
:func:`mixed_cells`; such a cell's workload, with its prefill and decode parts timed apart, is
:mod:`attnbench.runner.mixed_workload`, and the serving preset (``presets/serving.toml``) holds three specs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from attnbench.errors import SweepError

DEFAULT_PAGE_SIZE = 16
"""Tokens per page of a paged cache in a mixed cell whose sweep gives no ``page_size``."""
FLOPS_COUNT = "real-tokens"
"""The ``flops_count`` of a mixed row: each request's new tokens over the keys they see (no padding, no recompute)."""
_TERM = re.compile(r"^(\d+)?q(\d+)(k?)(?:(?:kv|s)(\d+)(k?))?$")


@dataclass(frozen=True)
class Request:
    """One request of a mixed step: ``q`` new tokens attending over ``kv`` tokens (``kv - q`` of them cached)."""

    q: int
    kv: int

    @property
    def cached(self) -> int:
        """Tokens in the request's cache before the step."""
        return self.kv - self.q

    @property
    def kind(self) -> str:
        """``decode`` (one token), ``prefill`` (from an empty cache) or ``chunk`` (a prefill chunk over a cache)."""
        return "decode" if self.q == 1 and self.cached else "prefill" if not self.cached else "chunk"


def parse_batch_spec(text: str) -> tuple[Request, ...]:
    """The requests of a batch spec (module docstring), in order; a :class:`SweepError` says what is wrong."""
    terms = [t for t in re.split(r"[_+]", str(text).strip().lower()) if t]
    if not terms:
        raise SweepError(f"batch spec {text!r} is empty; e.g. 2q1k_32q1kv2k (2 prefills of 1k, 32 decodes over 2k)")
    out: list[Request] = []
    for term in terms:
        m = _TERM.match(term)
        if not m:
            raise SweepError(f"batch spec term {term!r} of {text!r} is not [COUNT]q<Q>[kv<KV>] (a k after a number "
                             "multiplies it by 1024): e.g. 2q1k, 32q1kv2k, 4q16s512")
        count = int(m.group(1) or 1)
        q = int(m.group(2)) * (1024 if m.group(3) else 1)
        kv = q if m.group(4) is None else int(m.group(4)) * (1024 if m.group(5) else 1)
        if count < 1 or q < 1 or kv < q:
            raise SweepError(f"batch spec term {term!r}: give COUNT >= 1, Q >= 1 and KV >= Q (KV counts the new "
                             "tokens too)")
        out += [Request(q, kv)] * count
    return tuple(out)


def canonical(text) -> str:
    """One spelling of a batch spec (checked): lower case, terms joined by ``_``, ``kv`` for ``s``; ``""`` for none."""
    value = "" if text is None or str(text).strip().lower() in ("", "none") else str(text).strip().lower()
    if not value:
        return ""
    parse_batch_spec(value)
    return "_".join(t.replace("s", "kv") for t in re.split(r"[_+]", value) if t)


def parse_batch_specs(value) -> tuple[str, ...]:
    """The ``batch_spec`` axis of a sweep (``attnbench run --batch-spec``, a sweep file's ``batch_spec``): a TOML
    list or comma-separated text of batch specs, each in its :func:`canonical` spelling (``""``: not a mixed step)."""
    items = list(value) if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(dict.fromkeys(canonical(v) for v in items)) or ("",)


def mixed_cells(cell, batch_specs, page_sizes=(0,)):
    """The cells of ``cell`` for each batch spec: a spec's cell has ``batch`` = its requests, ``seq_len`` = its longest
    cache, mode ``inference`` (the step runs without autograd) and the sweep's page size (16 when none is given:
    the page size a paged cache runs the step with; it names the comparison group for the others). ``""`` keeps
    ``cell`` as it is."""
    from dataclasses import replace

    pages = [p for p in page_sizes if p] or [DEFAULT_PAGE_SIZE]
    for spec in batch_specs:
        if not spec:
            yield cell
            continue
        requests = parse_batch_spec(spec)
        for page in pages:
            yield replace(cell, batch=len(requests), seq_len=max(r.kv for r in requests), mode="inference",
                          lengths="", page_size=page, batch_spec=spec)


def describe(requests: tuple[Request, ...]) -> str:
    """``2 prefill of 1024; 32 decode over 2048``: the step in words, grouped as written."""
    groups: dict[tuple[str, int, int], int] = {}
    for r in requests:
        key = (r.kind, r.q, r.kv)
        groups[key] = groups.get(key, 0) + 1
    words = {"prefill": "prefill of {q}", "decode": "decode over {kv}", "chunk": "chunk of {q} over {kv}"}
    return "; ".join(f"{n} {words[k].format(q=q, kv=kv)}" for (k, q, kv), n in groups.items())


def _pairs(r: Request, window: int | None) -> int:
    """Query-key pairs of request ``r``'s new tokens: token ``i`` sees ``kv - q + i + 1`` keys, at most ``window``."""
    if window is None:
        return r.q * r.cached + r.q * (r.q + 1) // 2
    seen = [min(r.cached + i + 1, window) for i in range(min(r.q, max(window - r.cached, 0)))]  # below the window
    return sum(seen) + (r.q - len(seen)) * window


def mixed_flops(requests: tuple[Request, ...], d_model: int, num_kv_heads_ratio: float = 1.0,
                window: int | None = None) -> float:
    """FLOPs of one step over real tokens: the q, k, v and output projections of every new token (``k`` and ``v``
    scaled by ``num_kv_heads / num_heads``) and, per new token, ``q.k`` and ``p.v`` over the keys it sees (causal:
    token ``i`` of a request sees ``kv - q + i + 1``, at most ``window``)."""
    tokens = sum(r.q for r in requests)
    proj = 2 * tokens * d_model * d_model * (2 + 2 * num_kv_heads_ratio)
    pairs = sum(_pairs(r, window) for r in requests)
    return float(proj + 4 * d_model * pairs)


def mixed_kv_bytes(requests: tuple[Request, ...], kv_width: int, element_bytes: int) -> float:
    """Bytes of keys and values the step must read: each request's ``kv`` tokens once, ``2 x kv_width`` each."""
    return float(sum(r.kv for r in requests) * 2 * kv_width * element_bytes)


def min_bytes(batch_spec: str, d_model: int, kv_width: int, element_bytes: int) -> float:
    """The bytes a mixed step must move at the least (the roofline's ``min_bytes``): the new tokens' input and
    output, the projection weights once, and every request's keys and values once (:func:`mixed_kv_bytes`)."""
    requests = parse_batch_spec(batch_spec)
    tokens = sum(r.q for r in requests)
    weights = 2 * d_model * d_model + 2 * kv_width * d_model + d_model
    return float((2 * tokens * d_model + weights) * element_bytes) + mixed_kv_bytes(requests, kv_width, element_bytes)


def inputs(requests: tuple[Request, ...], d_model: int, seed: int = 0) -> torch.Tensor:
    """``(requests, longest kv, d_model)`` float64: request ``i``'s tokens ``0 .. kv - 1`` in row ``i``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(requests), max(r.kv for r in requests), d_model, generator=g, dtype=torch.float64)


def fill(module, requests: tuple[Request, ...], x: torch.Tensor) -> None:
    """``reset_cache()``, then one cached call that appends each request's ``kv - q`` earlier tokens (none for a
    prefill): every cache at its length before the step."""
    base = getattr(module, "_orig_mod", module)
    base.reset_cache()
    width = max(r.cached for r in requests)
    if width:
        module(x[:, :width].contiguous(), use_cache=True, lengths=[r.cached for r in requests])


def step(module, requests: tuple[Request, ...], x: torch.Tensor) -> torch.Tensor:
    """The mixed step: one cached call, row ``i`` appending request ``i``'s ``q`` new tokens. ``(b, longest q, d)``;
    row ``i``'s first ``q`` outputs are its tokens ``kv - q .. kv - 1``."""
    width = max(r.q for r in requests)
    part = torch.stack([torch.nn.functional.pad(x[i, r.cached:r.kv], (0, 0, 0, width - r.q))
                        for i, r in enumerate(requests)])  # (b, width, d)
    return module(part, use_cache=True, lengths=[r.q for r in requests])


def runs_mixed(module) -> bool:
    """Whether ``module`` can run a mixed step (the paged-cache protocol, or ``attnbench_mixed_step = True``)."""
    base = getattr(module, "_orig_mod", module)
    return callable(getattr(base, "set_page_size", None)) or bool(getattr(base, "attnbench_mixed_step", False))


def time_step(impl_name: str, batch_spec: str, d_model: int = 64, num_heads: int = 4, num_kv_heads: int | None = None,
              dtype: str = "float32", device: str = "cpu", page_size: int = 16, repeats: int = 10,
              seed: int = 0) -> dict:
    """Time one mixed step of ``impl_name`` (a paged cache): each repeat fills the caches (untimed), then times the
    step. The median seconds and what it did: ``tokens`` (new), ``flops`` and ``kv_bytes`` over real tokens only,
    ``gflops_per_s``. An implementation that runs no mixed step raises :class:`~attnbench.errors.UnavailableError`."""
    import time

    from attnbench import registry
    from attnbench.devices import DTYPES, synchronize
    from attnbench.errors import UnavailableError
    from attnbench.spec import AttnSpec
    from attnbench.weights import random_weights

    requests = parse_batch_spec(batch_spec)
    spec = AttnSpec(d_model, d_model, max(r.kv for r in requests), 0.0, num_heads, num_kv_heads=num_kv_heads)
    module = registry.get(impl_name).build(spec, device, dtype, weights=random_weights(spec, seed=seed)).eval()
    if not runs_mixed(module):
        raise UnavailableError(f"{impl_name} runs no mixed step (no paged cache: docs/paged.md)")
    getattr(module, "_orig_mod", module).set_page_size(page_size)
    x = inputs(requests, d_model, seed).to(device=device, dtype=DTYPES[dtype])
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first is a warm-up
            fill(module, requests, x)
            synchronize(torch.device(device))
            start = time.perf_counter()
            step(module, requests, x)
            synchronize(torch.device(device))
            times.append(time.perf_counter() - start)
    median = sorted(times[1:])[len(times[1:]) // 2]
    flops = mixed_flops(requests, d_model, spec.kv_heads / num_heads)
    return {"impl": impl_name, "batch_spec": batch_spec, "step": describe(requests), "requests": len(requests),
            "tokens": sum(r.q for r in requests), "median_s": median, "flops": flops, "gflops_per_s": flops / median / 1e9,
            "kv_bytes": mixed_kv_bytes(requests, spec.kv_heads * spec.head_dim, x.element_size()), "repeats": repeats}
