"""Where randomness enters a forward that should have none: dropout applied in eval mode (issue 47).

An ``eval_deterministic`` case builds the class with dropout and calls it twice in eval mode; the two outputs differ.
The replay of the other cases builds it without dropout, so every stage matches and says nothing. Here the class is
built as the case built it (with the case's dropout, in eval mode) and its forward is recorded twice on the same
input: the first recorded tensor that differs between the two calls, while every tensor it was computed from is the
same, is where the randomness enters (``F.dropout(p, training=True)``, a ``Dropout`` module called with
``training`` forced on), named at its line.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import torch

from attnbench.correctness.localize_finding import Localization, named
from attnbench.correctness.localize_record import Recorder, argument_line

DROPOUT_ARG = re.compile(r"\b(dropout_p|dropout|p)\s*=")
"""A call's dropout argument (``scaled_dot_product_attention(..., dropout_p=self.attn_pdrop)``, ``F.dropout(p=)``)."""


def random_in_eval(impl, case, device: str = "cpu", seed: int = 0) -> Localization | None:
    """The line where two eval-mode calls of ``case``'s class (built with the case's dropout) first differ, or
    ``None`` when they do not (or the class cannot be replayed so)."""
    from attnbench.correctness.basic import DROPOUT, build_for
    from attnbench.correctness.cases import SEED, inputs
    from attnbench.correctness.matrix import multi_query_case
    from attnbench.devices import DTYPES
    from attnbench.plugins.exits import plugin_exits

    case = multi_query_case(impl, case)  # as the case ran it
    token = SEED.set(seed)
    try:
        with warnings.catch_warnings(), plugin_exits(impl.name):
            warnings.simplefilter("ignore")
            built = build_for(impl, case, torch.device(device), dropout=DROPOUT)
            built.module.eval()
            x = inputs(case.shape).to(device=device, dtype=DTYPES[case.dtype])
            runs = []
            for _ in range(2):
                rec = Recorder([x])
                with rec, torch.no_grad():
                    built.module(x)
                runs.append(rec.records)
    except Exception:  # not replayable so: nothing named
        return None
    finally:
        SEED.reset(token)
    return _first_difference(*runs)


def _first_difference(a: list, b: list) -> Localization | None:
    """The first record of ``a`` that differs from its counterpart in ``b`` while its inputs do not."""
    if len(a) != len(b):
        return None
    same: set[int] = set()
    for ra, rb in zip(a, b, strict=True):
        if (ra.op, ra.line, ra.path) != (rb.op, rb.line, rb.path) or ra.value.shape != rb.value.shape:
            return None  # another path the second time: nothing lines up
        if torch.equal(ra.value, rb.value):
            same.add(ra.index)
            continue
        if set(ra.inputs) <= same:
            v = ra.value
            stage = "probabilities" if v.dim() == 4 and v.shape[-1] == v.shape[-2] else "output"
            found = argument_line(ra.path, ra.line, DROPOUT_ARG)  # a call over several lines: its dropout_p= line
            at = replace(ra, line=found[0], text=found[1]) if found and found[0] != ra.line else ra
            return named(stage, at, "differs between two calls on the same input in eval mode (built with "
                                              "dropout): randomness, such as dropout, applied here in eval mode", {})
        return None
    return None
