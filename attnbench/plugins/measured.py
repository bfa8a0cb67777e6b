"""Conventions a user's class computes with, measured on the class itself with weights attnbench chose (issue 36).

Both probes load canonical weights of a known shape into the class built on :data:`PROBE` (24 wide, 4 heads of 6,
no bias, float64) and read its attention probabilities off its output: with ``W_v = W_o = I`` and a token that
attends to two keys, the output is ``p0 * v0 + p1 * v1``. Nothing is compared with the reference.

* **RoPE direction and pairing** (:func:`rope_direction`): the token at position 1 holds ``e_0`` in every head, the
  one at position 0 ``+e_j`` or ``-e_j``, and ``W_q = W_k = I``. Only the partner ``j`` of dimension 0 makes the
  score depend on that sign, through ``sin(1 rad)`` (pair 0 turns by one radian per position at every theta): its
  sign says whether pairs turn by ``+theta`` (the textbook's) or ``-theta`` (nanochat's), and ``j`` says the pairing
  (``head_dim/2``: half, ``1``: interleaved). The two directions are one function up to reflecting q and k, so the
  reference follows the class (``AttnSpec.rope_sign``); a class that turns q and k opposite ways matches neither and
  fails the RoPE cases.
* **A QK-norm without weights** (:func:`fixed_norm`), e.g. ``F.rms_norm(q, (head_dim,))`` followed by a constant
  factor: the output does not change when one head's rows of ``W_q`` (or ``W_k``) are scaled (per head) or all of
  them are (over the whole projection), and the factor and the norm's epsilon are read off the attention to a token
  whose key is zero (score 0) next to the token's own key (score ``tau * |q_hat|^2``). The reference then norms q and
  k with fixed gains ``c = sqrt(tau * sqrt(head_dim))`` (its default score scale): the factor the class multiplies
  by, if it splits it evenly and scales scores by ``1/sqrt(head_dim)``; the output is the same either way.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch

from attnbench.plugins.exits import plugin_exits
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights, gain_shapes, load_weights

PROBE = AttnSpec(d_in=24, d_out=24, context_length=9, dropout=0.0, num_heads=4)
_HD = PROBE.head_dim


@dataclass(frozen=True)
class FixedNorm:
    """A parameterless QK-norm: ``placement`` (``head`` or ``full``), the fixed gain ``gain`` both q and k leave it
    with (the reference's default score scale), its epsilon ``eps``, and the measured score factor ``tau``."""

    placement: str
    gain: float
    eps: float
    tau: float

    def describe(self) -> str:
        where = "per head" if self.placement == "head" else "over the whole projection"
        return (f"qk_norm: {self.placement}, without weights (measured: the output does not change when W_q's or W_k's "
                f"rows are rescaled {where}); scores = {self.tau:.4g} * q_hat.k_hat (= {self.gain:.4g}^2 / "
                f"sqrt(head_dim)): the reference norms q and k with fixed gains {self.gain:.4g} (a constant factor "
                f"after the norm), epsilon {self.eps:.3g} (measured on a small token)")


def _weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> CanonicalWeights:
    eye = torch.eye(PROBE.d_out, dtype=torch.float64)
    return CanonicalWeights(W_q=q, W_k=k, W_v=eye if v is None else v, b_q=None, b_k=None, b_v=None, W_o=eye,
                            b_o=torch.zeros(PROBE.d_out, dtype=torch.float64))


PROBE_CALL_S = 2.0
"""The longest one probe call may take (a forward at a 4-token shape takes milliseconds). A slower call, or a forward
that sleeps or hangs, ends the measured probes of that class ("not measured"): they run where the plug-in is loaded,
often the driver, which no cell timeout guards (a class whose forward sleeps 60 s once held a run for 8 minutes)."""


REPEAT_ALARM_S = 0.25
"""Seconds between the alarms that follow a probe call's (or a cell's, :func:`attnbench.runner.cell.deadline`) first one
until the call ends: a forward may swallow one."""


class ProbeTooSlow(RuntimeError):
    """A probe call took longer than :data:`PROBE_CALL_S` (or an earlier one did): nothing more is measured."""


@contextlib.contextmanager
def _bounded(factory, seconds: float = PROBE_CALL_S):
    """Run one probe call within ``seconds``: a Python-level hang is interrupted by ``SIGALRM`` (main thread only; an
    outer alarm, such as a cell's deadline, is re-armed with what it had left), and a call that returns late marks
    ``factory`` so that no further probe call is made."""
    if getattr(factory, "_probe_too_slow", False):
        raise ProbeTooSlow("an earlier probe call was too slow")
    armed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    def on_alarm(signum, frame):
        raise ProbeTooSlow(f"a probe call ran past {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm) if armed else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if armed else None  # a forward may block SIGALRM and keep it
    # repeating: a forward that swallows the first alarm gets another (it ends the probe, not the process)
    outer, every = signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_ALARM_S) if armed else (0.0, 0.0)
    t0 = time.perf_counter()
    try:
        yield
    except ProbeTooSlow:
        factory._probe_too_slow = True
        raise
    finally:
        spent = time.perf_counter() - t0
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # discards an alarm left pending by a forward that blocked it
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (it would end the process later, under SIG_DFL)
            signal.signal(signal.SIGALRM, old)
            if outer > 0:
                signal.setitimer(signal.ITIMER_REAL, max(outer - spent, 1e-3), every)
        if spent > seconds:
            factory._probe_too_slow = True


class _Probe:
    """The class built on :data:`PROBE` in float64; ``run(w, x)`` loads ``w`` and returns its output."""

    def __init__(self, factory, spec: AttnSpec) -> None:
        self.factory = factory
        self.spec = factory.own_spec(spec) if hasattr(factory, "own_spec") else spec
        with plugin_exits("a probe of its conventions"):
            self.module = factory(spec).double().eval()

    def run(self, w: CanonicalWeights, x: torch.Tensor) -> torch.Tensor:
        ones = {n: torch.ones(shape, dtype=torch.float64) for n, shape in gain_shapes(self.spec).items()}
        load_weights(self.module, replace(w, **ones), self.spec)  # a class that always norms: unit gains
        with _bounded(self.factory), torch.no_grad(), plugin_exits("a probe of its conventions"):  # an exit: a failure
            out = self.module(x)
        out = out[0] if isinstance(out, tuple) else out
        if not isinstance(out, torch.Tensor) or not torch.isfinite(out).all():
            raise ValueError("no finite output")
        return out.double()


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], PROBE.num_heads, _HD)


def pair_turn(probe: _Probe, a: int, b: int) -> torch.Tensor:
    """Per head: how the log-odds of the key at position 0 differ between ``+e_b`` and ``-e_b`` for a query ``e_a`` at
    position 1, with ``W = I`` (``2 s sin(w)`` when dimensions ``a`` and ``b`` are a pair that turns by ``w`` per
    position; 0 when they are no pair)."""
    eye = torch.eye(PROBE.d_out, dtype=torch.float64)
    w = _weights(eye, eye.clone())
    logs = []
    for sign in (1.0, -1.0):
        x = torch.zeros(1, 2, PROBE.d_in, dtype=torch.float64)
        x[0, 1, a::_HD] = 1.0
        x[0, 0, b::_HD] = sign
        y = _heads(probe.run(w, x)[0, 1])
        logs.append(torch.log(sign * y[:, b] / y[:, a]))
    return logs[0] - logs[1]


def rope_direction(factory) -> tuple[int, int] | None:
    """``(sign, partner)``: 1 when the class turns pairs by +theta, -1 by -theta; ``partner`` the dimension paired
    with dimension 0 (``head_dim/2`` half, 1 interleaved). ``None`` when the probe shows no clean rotation."""
    spec = AttnSpec(**{**PROBE.kwargs(), "rope_theta": 10000.0})
    try:
        probe = _Probe(factory, spec)
        diffs = [pair_turn(probe, 0, j) for j in range(1, _HD)]  # per head
    except Exception:  # does not build or run on the probe: nothing inferred
        return None
    sizes = torch.stack([d.abs().min() for d in diffs])
    best = int(sizes.argmax())
    others = torch.cat([d for i, d in enumerate(diffs) if i != best]).abs().max() if _HD > 2 else torch.tensor(0.0)
    if not (sizes[best] > 1e-3 and others < 1e-6 * sizes[best] and torch.isfinite(diffs[best]).all()):
        return None
    signs = torch.sign(diffs[best])
    if not (signs == signs[0]).all():
        return None
    return int(signs[0]), best + 1


def fixed_norm(factory) -> FixedNorm | None:
    """The class's QK-norm without weights (placement, factor, epsilon), or ``None`` when its output moves with the
    scale of ``W_q``/``W_k`` (no such norm) or the measurements disagree."""
    g = torch.Generator().manual_seed(36)
    try:
        probe = _Probe(factory, PROBE)
        placement = _invariance(probe, g)
        if placement is None:
            return None
        a = torch.randn(PROBE.d_out, PROBE.d_in, generator=g, dtype=torch.float64) / math.sqrt(PROBE.d_in)
        x1 = torch.randn(PROBE.d_in, generator=g, dtype=torch.float64) * 100  # large: an epsilon does not show
        tau, dots, _ = _tau(probe, a, x1, placement)
        if tau is None or tau <= 0:
            return None
        q = a @ x1
        m = q.pow(2).mean().expand(PROBE.num_heads) if placement == "full" else _heads(q).pow(2).mean(-1)
        scale = math.sqrt(1e-5 / float(m.min()))  # the token's q at mean square ~1e-5: an epsilon >= 1e-12 shows
        _, _, logit = _tau(probe, a, x1 * scale, placement, keep=dots)
    except Exception:  # does not build or run on the probe: nothing inferred
        return None
    if logit is None:
        return None
    ratio = logit / (tau * dots)  # m' / (m' + eps) per head, m' the small token's mean square
    eps = float((m * scale**2 * (1 / ratio - 1)).clamp(min=0.0).mean())
    eps = float(f"{max(eps, 1e-12):.3g}")
    return FixedNorm(placement, math.sqrt(tau * math.sqrt(_HD)), eps, tau)


def _invariance(probe: _Probe, g: torch.Generator) -> str | None:
    """``head`` when scaling one head's rows of W_q and another's of W_k leaves the output unchanged, ``full`` when
    only scaling all of them does; ``None`` otherwise, or when the output ignores W_q altogether."""
    x = torch.randn(1, 5, PROBE.d_in, generator=g, dtype=torch.float64)
    q, k, v = (torch.randn(PROBE.d_out, PROBE.d_in, generator=g, dtype=torch.float64) * 10 for _ in range(3))
    base = probe.run(_weights(q, k, v), x)
    size = base.abs().max()

    def moved(q2, k2) -> float:
        return float((probe.run(_weights(q2, k2, v), x) - base).abs().max() / size)

    other = torch.randn(PROBE.d_out, PROBE.d_in, generator=g, dtype=torch.float64) * 10
    if moved(other, k) < 1e-3:
        return None  # its output does not depend on W_q: no QK-norm to measure
    per_head = torch.ones(PROBE.d_out, 1, dtype=torch.float64)
    per_head[:_HD] = 4.0
    if moved(q * per_head, k * per_head.roll(_HD, 0).clamp(max=3.0)) < 1e-7:
        return "head"
    return "full" if moved(q * 4.0, k * 3.0) < 1e-7 else None


def _tau(probe: _Probe, a: torch.Tensor, x1: torch.Tensor, placement: str,
         keep: torch.Tensor | None = None) -> tuple[float | None, torch.Tensor, torch.Tensor | None]:
    """The score factor: a zero token (key 0, score 0) then ``x1`` (``q = k = a @ x1``); per head the logit of the
    attention to itself over ``q_hat . k_hat`` (``keep``: the normalised dots of a larger copy of the token).
    Returns ``(tau, dots, logits)``; ``tau`` None when the heads disagree, logits None when the output is no mix of
    the two values."""
    x = torch.zeros(1, 2, PROBE.d_in, dtype=torch.float64)
    x[0, 1] = x1
    y = _heads(probe.run(_weights(a, a.clone()), x)[0, 1])
    v = _heads(x1)
    p = (y * v).sum(-1) / (v * v).sum(-1)
    if not ((y - p[:, None] * v).abs().max() <= 1e-6 * y.abs().max() and ((p > 0) & (p < 1)).all()):
        return None, torch.empty(0), None
    logit = torch.log(p / (1 - p))
    q = a @ x1
    m = q.pow(2).mean() if placement == "full" else _heads(q).pow(2).mean(-1)
    dots = _heads(q).pow(2).sum(-1) / m if keep is None else keep
    tau = float((logit * dots).sum() / (dots * dots).sum())
    if keep is None and (logit - tau * dots).abs().max() > 1e-6 * logit.abs().max():
        return None, dots, logit
    return tau, dots, logit


def _pairing_free(plan) -> bool:
    """Tables with each frequency once (``freqs_cis``, ``freqs_cos``/``freqs_sin``, nanochat's half-width
    ``cos_sin``): the class, not the table, decides which dimensions pair."""
    return any(plan.per_frequency(n) for n in plan.tables) or plan.table_dims == "seq_half"


NORM_WORDS = ("norm", "rsqrt")
"""Words whose absence from a class's module spares it the QK-norm probe (see :func:`may_norm`)."""


def source_mentions(obj, words: tuple[str, ...]) -> bool:
    """Whether the source of ``obj``'s module mentions one of ``words`` (lower case), or cannot be read."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    try:
        text = inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        text = None
    return text is None or any(w in text.lower() for w in words)


def may_norm(obj) -> bool:
    """Whether ``obj``'s module could hold a QK-norm without weights: its source mentions a norm (``rms_norm``,
    ``F.normalize``, ``RMSNorm``, ``rsqrt``...), or cannot be read. The probe calls the class's forward where the
    plug-in is loaded, often the driver of a run, which ``--isolate`` does not protect: a class that crashes its
    process (a native extension's segfault) would end the run there instead of becoming rows with that error, so
    the forward is called there only when the source gives a reason to."""
    return source_mentions(obj, NORM_WORDS)


def apply_measured(factory, caps: dict, declared: dict, obj=None) -> list[str]:
    """Measure the RoPE direction of a class that rotates and the QK-norm without weights of one that has no norm
    module (and whose source mentions one: :func:`may_norm`); record them on ``factory`` (``own``/``requires``) and
    ``caps``; the ``check -v`` lines."""
    lines = []
    if caps.get("rope") and "rope" not in declared and "rope_theta" not in factory.own:  # own_rope measured it
        found = rope_direction(factory)
        if found is None:
            lines.append("rope direction: not measured (the probe showed no clean rotation of a pair): +theta assumed")
        else:
            sign, partner = found
            pairs = {_HD // 2: "half (j, j + head_dim/2)", 1: "interleaved (2j, 2j + 1)"}.get(
                partner, f"dimension 0 with {partner}")
            if sign < 0:
                factory.own["rope_sign"] = -1
            style = {_HD // 2: "half", 1: "interleaved"}.get(partner)
            plan = getattr(factory, "context", None)
            owned = plan is None or not getattr(plan, "tables", None)  # it builds its own tables (GPT-J's sincos)
            if style and (owned or _pairing_free(plan)) and caps["rope"] != (style,):
                why = "it builds its own tables" if owned else "its tables carry each frequency once"
                lines.append(f"rope: {style}, not {caps['rope'][0]} as its names suggest (measured below; {why}, so the "
                             "class decides the pairs)")
                caps["rope"] = (style,)  # the class pairs, as measured
                factory.own["rope_style"] = style  # the style of the RoPE it always applies (layout.own_spec)
            lines.append(f"rope direction: {'+' if sign > 0 else '-'}theta, pairs {pairs} (measured: the token at "
                         "position 1 scores a key at position 0 by sin(+1 rad) or sin(-1 rad))"
                         + ("; the reference turns its pairs by -theta too (rope_sign=-1: the same function up to "
                            "reflecting q and k)" if sign < 0 else ""))
    if not caps.get("qk_norm") and "qk_norm" not in declared and (obj is None or may_norm(obj)):
        norm = fixed_norm(factory)
        if norm is not None:
            caps["qk_norm"] = (norm.placement,)
            factory.requires = (*factory.requires, "qk_norm")
            factory.own.update(norm_eps=norm.eps, fixed_gain=norm.gain)
            factory._layouts.clear()  # discovered before the gains were known
            lines.append(norm.describe())
    if getattr(factory, "_probe_too_slow", False):
        lines.append(f"measured probes stopped: a forward at the probe's tiny shape ran past {PROBE_CALL_S:g} s, so its "
                     "RoPE direction and any QK-norm without weights were not measured (+theta, no such norm assumed)")
    return lines
