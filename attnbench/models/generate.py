"""Greedy generation with and without the KV cache, the timing of its phases, and the equality of two generations.

A generation is a prompt of ``P`` tokens and ``M`` new tokens chosen greedily (argmax of the last position's logits),
as the book's ``generate_text_simple`` does. With the cache (the decode protocol: ``forward(x, use_cache=True)`` and a
reset method, :mod:`attnbench.implementations.kv_cache`) the prompt is one prefill call and every further token one
call with a single token; without it every new token is a forward over the whole sequence so far.

The phases (:class:`Phases`): *prefill* (time to first token: the prompt's forward and the first argmax) and *decode*
(the other ``M - 1`` tokens). Tokens per second count every batch row; the end-to-end figure is new tokens over the
generation's seconds, the figure the book prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from attnbench.devices import synchronize


@dataclass
class Generation:
    """What a generation produced: the new tokens ``(b, M)`` and each step's last-position logits ``(b, vocab)``."""

    tokens: torch.Tensor
    logits: list[torch.Tensor] = field(default_factory=list)
    ttft_s: float = float("nan")  # the prompt's forward and the first token
    total_s: float = float("nan")


def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, use_cache: bool, *, keep_logits: bool = False,
             device: torch.device | None = None) -> Generation:
    """Greedy generation of ``new_tokens`` after ``prompt`` ``(b, P)`` by ``model`` (a :class:`~attnbench.models.zoo.GPT`),
    with the KV cache or without it; timed (synchronised on ``device``) from the first call to the last token."""
    device = device or prompt.device
    logits_kept: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        if use_cache:
            model.reset_cache()
        t0 = time.perf_counter()
        seq = prompt
        logits = model(prompt, use_cache=True) if use_cache else model(prompt)
        for step in range(new_tokens):
            last = logits[:, -1]
            nxt = last.argmax(dim=-1, keepdim=True)  # (b, 1)
            out.append(nxt)
            if keep_logits:
                logits_kept.append(last.detach().to(torch.float64).cpu())
            if step == 0:
                synchronize(device)
                ttft = time.perf_counter() - t0
            if step == new_tokens - 1:
                break
            if use_cache:
                logits = model(nxt, use_cache=True)
            else:
                seq = torch.cat([seq, nxt], dim=1)
                logits = model(seq)
        synchronize(device)
        total = time.perf_counter() - t0
    return Generation(torch.cat(out, dim=1), logits_kept, ttft, total)


@dataclass
class Phases:
    """The prefill and total seconds of each generation timed, and the rates derived from their medians."""

    batch: int
    prompt: int
    new_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)

    def add(self, g: Generation) -> None:
        self.ttft_s.append(g.ttft_s)
        self.total_s.append(g.total_s)

    def columns(self, median_s: float) -> dict[str, float]:
        """``ttft_s`` and tokens/s from a generation's median time ``median_s`` (the timer's) split by the median
        prefill fraction of the generations recorded here."""
        if not self.total_s:
            return {}
        frac = float(torch.tensor([a / b for a, b in zip(self.ttft_s, self.total_s, strict=True)]).median())
        ttft = median_s * frac
        decode = median_s - ttft
        b, m = self.batch, self.new_tokens
        return {"ttft_s": ttft, "prefill_tokens_per_s": b * self.prompt / ttft,
                "decode_tokens_per_s": b * (m - 1) / decode if m > 1 and decode > 0 else float("nan"),
                "end_to_end_tokens_per_s": b * m / median_s}


@dataclass(frozen=True)
class Divergence:
    """Where two generations part: the first step (1-based new token) and batch row whose tokens differ."""

    step: int
    row: int
    token_a: int
    token_b: int
    position: int  # the token's position in the sequence (prompt length + step - 1)

    def text(self, a: str, b: str) -> str:
        return (f"first differing token at step {self.step} of the generation (position {self.position}, batch row "
                f"{self.row}): {a} generated {self.token_a}, {b} generated {self.token_b}")


def first_divergence(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> Divergence | None:
    """The first step at which the new tokens ``a`` and ``b`` ``(batch, M)`` differ, or ``None`` when they agree."""
    differ = (a.cpu() != b.cpu())
    if not bool(differ.any()):
        return None
    step = int(differ.any(dim=0).nonzero()[0])
    row = int(differ[:, step].nonzero()[0])
    return Divergence(step + 1, row, int(a[row, step]), int(b[row, step]), prompt_len + step)


def first_logit_gap(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> tuple[int, float] | None:
    """The first step (1-based) whose last-position logits differ by more than ``tol`` (relative max-norm) and the
    error there, or ``None``."""
    for step, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
        if not err <= tol:
            return step, err
    return None


RATE_COLUMNS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "end_to_end_tokens_per_s")


def rescaled_rates(row: dict, median_s: float) -> dict[str, float]:
    """A generation row's phase columns for another median time ``median_s`` (rounds pooled): each phase keeps its
    share of the generation; empty for rows without them."""
    old = row.get("median_s")
    ttft = row.get("ttft_s")
    if ttft is None or ttft != ttft or not old or old != old:
        return {}
    k = median_s / old
    out = {"ttft_s": ttft * k}
    for col in RATE_COLUMNS[1:]:
        value = row.get(col)
        out[col] = value / k if value is not None else float("nan")
    return out
