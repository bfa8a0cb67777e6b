"""Localising a gradient case whose forward matches the reference everywhere (issue 47).

The forward is replayed with gradients on: each recorded intermediate keeps its live tensor, and the reference keeps
its stages' live tensors (:func:`attnbench.correctness.stages.capture` with ``live=True``). The gradient of the same
output gradient the ``backward`` case uses is taken with respect to both, and compared stage by stage **from the
output backwards**, in the layout the forward matched: the first stage whose gradient differs was wrong in the
backward of the step that consumed it, the line that computed the next stage (a hand-written ``autograd.Function``'s
``backward``, a detached or in-place step).
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from dataclasses import replace

import torch

from attnbench.correctness.localize_match import best_fit
from attnbench.correctness.localize_record import _SKIP_DIRS, ProfileHook, Record
from attnbench.correctness.stages import ORDER, Stage


def reference_grads(notes: dict, out: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stage name -> the gradient of ``(out * g).sum()`` with respect to that stage of the reference (``notes``:
    captured live), per-head stages stacked on axis 1 as :func:`~attnbench.correctness.stages.staged` stacks them."""
    names, tensors = [], []
    for name, value in notes.items():
        parts = [value[h] for h in sorted(value)] if isinstance(value, dict) else [value]
        if all(p.requires_grad for p in parts):
            names.append(name)
            tensors += parts
    grads = torch.autograd.grad(out, tensors, g, allow_unused=True, retain_graph=True)
    out_grads, i = {}, 0
    for name in names:
        n = len(notes[name]) if isinstance(notes[name], dict) else 1
        parts = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(tensors[i:i + n], grads[i:i + n], strict=True)]
        out_grads[name] = torch.stack(parts, dim=1) if isinstance(notes[name], dict) else parts[0]
        i += n
    return out_grads


def locate_backward(records: list[Record], stages: list[Stage], ref_grads: dict[str, torch.Tensor],
                    out: torch.Tensor, g: torch.Tensor, tol: float):
    """``(stage, record of the step whose backward is wrong, fit, stage whose gradient still matched, whether that
    record is now the line of a hand-written backward)`` for the last
    recorded tensor equal to a stage whose gradient differs from the reference's while every later one's matches;
    ``None`` when every gradient compared matches. The step named is the first that consumed that tensor."""
    pairs = [(r, s) for r in records if r.live is not None and r.live.requires_grad
             for s in [_stage_of(r, stages, ref_grads, tol)] if s is not None]
    if not pairs:
        return None
    with BackwardLines() as lines:
        grads = torch.autograd.grad(out, [r.live for r, _ in pairs], g, allow_unused=True, retain_graph=True)
    good: dict[int, str] = {}
    for (rec, stage), grad in reversed(list(zip(pairs, grads, strict=True))):
        want = ref_grads[_ref_name(stage.name)]
        want = want.unflatten(-1, (-1, stage.tensor.shape[-1])) if want.dim() == 3 and stage.axes == "bthd" else want
        fit = best_fit(Stage(stage.name, want, stage.axes, stage.merged), torch.zeros_like(rec.live) if grad is None
                       else grad, tol)
        if fit is None:
            continue  # a layout its gradient cannot be compared in (kv heads repeated: their gradients are summed)
        if fit.error <= tol:
            good[rec.index] = stage.name
            continue
        consumers = [r for r in records if rec.index in r.inputs]
        if not good or not consumers:
            return None  # the output's own gradient differs, or nothing consumed it: nothing to localise
        step = _detached(records, rec.index, min((i for i in good if i > rec.index), default=len(records))) or \
            min(consumers, key=lambda r: r.index)
        own = lines.backward_of(step, step.args.index(rec.index) if rec.index in step.args else 0)
        step = step if own is None else replace(step, path=own[0], line=own[1], text=own[2], caller=None)
        return stage.name, step, fit, good[min((i for i in good if i >= step.index), default=max(good))], own is not None
    return None


def _detached(records: list[Record], start: int, stop: int) -> Record | None:
    """The first record after record ``start`` and before record ``stop``, made from it, whose gradient stops there
    (``denom.detach()``: what it was made from takes gradients, it takes none), or ``None``."""
    reached = {start}
    for rec in records[start + 1:stop]:
        if not reached & set(rec.inputs):
            continue
        reached.add(rec.index)
        takes = [records[i].live for i in rec.inputs if records[i].live is not None]
        if rec.live is not None and not rec.live.requires_grad and any(t.requires_grad for t in takes):
            return rec
    return None


class BackwardLines(ProfileHook):
    """While gradients are taken: the line of a hand-written ``autograd.Function.backward`` that made the gradient it
    returned, per Function, so that a step computed in such a Function's ``forward`` is named at its backward's line
    (the forward is right; what the backward returns is not). A profile hook sees each ``backward`` of the user's
    code return; the line is the last assignment of the name it returns (``grad = p * grad_p``), or the ``return``."""

    def __init__(self) -> None:
        self.returned: list[tuple[type, tuple[str, int, str]]] = []

    def _hook(self, frame, event, arg) -> None:
        if event != "return" or frame.f_code.co_name != "backward" or frame.f_code.co_filename.startswith(_SKIP_DIRS):
            return
        cls = getattr(type(frame.f_locals.get("ctx")), "_forward_cls", None)
        if cls is not None:
            path = frame.f_code.co_filename
            lines = _made_lines(frame.f_code, frame.f_lineno)
            self.returned.append((cls, [(path, n, linecache.getline(path, n).strip()) for n in lines]))

    def backward_of(self, rec: Record, position: int = 0) -> tuple[str, int, str] | None:
        """The backward line of the Function whose ``forward`` made ``rec``, when its backward ran, that made the
        gradient it returns for its input at ``position`` (``return dq, dk, dv``: ``dk``'s line for the keys); else
        None."""
        for cls, made in self.returned:
            where = made[position] if position < len(made) else made[0]
            try:
                lines, start = inspect.getsourcelines(cls.forward)
                path = inspect.getsourcefile(cls.forward)
            except (OSError, TypeError):
                continue
            if path == rec.path and start <= rec.line < start + len(lines):
                return where
        return None


def _stage_of(rec: Record, stages: list[Stage], ref_grads: dict, tol: float) -> Stage | None:
    """The first stage ``rec`` equals (in the layouts of :mod:`~attnbench.correctness.localize_match`) whose
    gradient the reference has, or ``None``."""
    for stage in stages:
        if stage.name in ORDER and _ref_name(stage.name) in ref_grads:
            fit = best_fit(stage, rec.value, tol)
            if fit is not None and fit.error <= tol:
                return stage
    return None


def _ref_name(name: str) -> str:
    """The reference note a stage's gradient is read from (the heads stages are the projections, split)."""
    return name.removesuffix(" heads")


def _made_lines(code, returned_at: int) -> list[int]:
    """Per value its ``return`` at line ``returned_at`` returns (each of a tuple), the line of ``code`` (a function)
    that last assigned that name before it, else ``returned_at``."""
    try:
        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return [returned_at]
    ret = next((n for n in ast.walk(tree) if isinstance(n, ast.Return) and n.lineno + start - 1 == returned_at), None)
    values = ret.value.elts if ret is not None and isinstance(ret.value, ast.Tuple) and ret.value.elts else \
        [ret.value] if ret is not None else []
    made = []
    for value in values or [None]:
        assigned = [n.lineno + start - 1 for n in ast.walk(tree) if isinstance(value, ast.Name)
                    and isinstance(n, ast.Assign | ast.AugAssign) and n.lineno + start - 1 < returned_at
                    and any(isinstance(t, ast.Name) and t.id == value.id
                            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        made.append(max(assigned, default=returned_at))
    return made
