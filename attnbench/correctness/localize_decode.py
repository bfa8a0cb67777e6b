"""Where a decode step first leaves the reference: the step's own intermediates, named by their lines (issue 47).

A bug that shows only while decoding (a cache written with the keys where the values belong, a position offset, a
mask row of the cache) leaves the one-call forward right at every stage, so its replay says nothing. Here the case's
simplest pattern is replayed (the prefill, then one token at a time) with every call recorded, and the first call
whose output differs from the reference's rows is localised against the reference's stages for that call: the
reference of the tokens so far, its query-side stages and its rows cut to the call's tokens, its key and value
stages (what the cache and the new tokens give together) kept whole. The line named is the class's, in the call
where the values first go wrong; the step is said beside it.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from attnbench.correctness.localize_finding import CHAIN, Evidence, Localization, cannot_tell
from attnbench.correctness.localize_record import Recorder, module_tensors
from attnbench.correctness.stages import FUSED, Stage, capture, staged


def decode_finding(impl, case, device: str, seed: int, tol: float, locate) -> Localization | None:
    """The first divergence of the first decode call that fails (``locate(records, stages, returned, made)``), or
    ``None`` when every call matches or the replay cannot run."""
    from attnbench.correctness.cases import SEED
    from attnbench.correctness.decode import DECODE_PREFILL, Decoding, chunk_steps, single_steps
    from attnbench.plugins.exits import plugin_exits

    token = SEED.set(seed)
    try:
        with warnings.catch_warnings(), plugin_exits(impl.name):
            warnings.simplefilter("ignore")
            d = Decoding(impl, case, torch.device(device), DECODE_PREFILL.get(case.shape.id, 5))
            for steps in (single_steps(d.prefill, d.length), chunk_steps(d.prefill, d.length, d.spec.window)):
                found = _first_failing(d, d.opening() + steps, tol, locate)
                if found is not None:
                    return found
    except Exception:  # the replay itself failed: nothing named here
        return None
    finally:
        SEED.reset(token)
    return None


def _first_failing(d, steps, tol: float, locate) -> Localization | None:
    """``steps`` through a fresh module's cache, each call recorded: the first call that fails, localised."""
    from attnbench.correctness.cases import rel_error
    from attnbench.plugins import cache_state

    built, x = d.fresh(), d.sequence(1)
    ref = built.reference(x)
    with cache_state.default_dtype(x.dtype):
        cache_state.reset_cache(built.module)
    for step in steps:
        tokens = x[:, step.start:step.start + step.length].contiguous().to(d.device)
        rec = Recorder([tokens])
        with rec, torch.no_grad(), cache_state.default_dtype(x.dtype):
            out = built.module(tokens, use_cache=True)
        out = out[0] if isinstance(out, tuple) else out
        if rel_error(out.cpu(), ref[:, step.start:step.start + step.length]) <= tol:
            continue
        stages, full = _step_stages(built, x, step.start, step.start + step.length)
        buffers = module_tensors(built.module)
        made = (rec.aux, rec.arg_ids, buffers, built.module, full)  # full: a mask buffer is read against all rows
        found = locate(rec.records, stages, rec.index_of(out), made)
        if found.stage not in QUERY_SIDE and not _cache_read_right(rec.records, stages, tol):
            return cannot_tell(f"decode, {step.label}: the keys or values this call reads from its cache are not the "
                               "reference's (written wrong by an earlier call, or laid out in slots): the line that wrote "
                               "them is not in this call")
        return _at_step(found, step.label)
    return None


QUERY_SIDE = frozenset({"q", "q heads", "normed q", "q * cos", "rotate(q)", "rotated q", "scaled q", "scores",
                        "scaled scores", "capped scores", "masked scores"})
"""Stages whose finding in a decode call does not depend on what the cache holds (the queries, and the scores' mask)."""


def _cache_read_right(records, stages: list[Stage], tol: float) -> bool:
    """Whether some tensor of the call holds the reference's keys and some its values for all the tokens so far."""
    from attnbench.correctness.localize_match import matches

    matched = Evidence(records, stages, tol, *matches(records, stages, tol)).matched
    return (any(n in matched for n in ("k heads", "normed k", "rotated k")) and "v heads" in matched)


def _step_stages(built, x: torch.Tensor, start: int, end: int) -> tuple[list[Stage], torch.Tensor | None]:
    """The reference's stages for the call of tokens ``start .. end - 1`` (those of the tokens so far, cut), and the
    positions its masked scores hide for all of them ``(end, end)`` (None without a mask stage)."""
    from attnbench.correctness.cases import reference
    from attnbench.correctness.localize_match import MASKED

    x64 = x[:, :end].to(torch.float64)
    with torch.no_grad(), capture() as notes:
        reference(x64, built.weights.to(dtype=torch.float64), built.spec)
    stages = staged(notes, built.spec)
    masked = next((s.tensor for s in stages if s.name == "masked scores"), None)
    full = None if masked is None else masked.reshape(-1, *masked.shape[-2:])[0] <= MASKED
    new = [_rows(s, start, end) for s in stages if CHAIN.get(s.name) in ("k", "v") and start > 0 and "t" in s.axes]
    return [*new, *(_cut(s, start, end) for s in stages)], full


def _rows(stage: Stage, start: int, end: int) -> Stage:
    """A key or value stage at this call's tokens only, under a name of its own (no stage of the order): what the
    call computes before appending it to its cache is right, so the line that appends it wrong is where it goes
    wrong (``torch.cat([self.cache_k, values_new])``)."""
    axis = stage.axes.index("t")
    return replace(stage, name=f"{stage.name} (this call's tokens)", tensor=stage.tensor.narrow(axis, start, end - start))


def _cut(stage: Stage, start: int, end: int) -> Stage:
    """``stage`` with its query-side rows cut to ``start .. end - 1`` (the key and value chains kept whole)."""
    keep_whole = CHAIN.get(stage.name) in ("k", "v")
    t = stage.tensor
    for axis, letter in enumerate(stage.axes):
        if letter == "i" or (letter == "t" and not keep_whole) or (stage.name == FUSED and letter == "t"):
            t = t.narrow(axis, start, end - start)
    return replace(stage, tensor=t)


def _at_step(found: Localization, label: str) -> Localization | None:
    """``found`` with the decode step said; ``None`` when it names nothing (then the forward's replay is asked)."""
    if found.stage is None:
        return None
    return replace(found, line=f"{found.line} (decoding: {label})")
