"""A copied torch function's own dispatch, run under the recorder as it runs without it.

Code copied from ``torch.nn.functional`` keeps torch's dispatch at its top (GPT-SoVITS's
``multi_head_attention_forward_patched``)::

    if has_torch_function(tens_ops):
        return handle_torch_function(multi_head_attention_forward, tens_ops, query, ..., cache=cache)

naming torch's function, not the copy. Without a ``TorchFunctionMode`` the test is ``False`` and the copy's body runs;
under the recorder (:class:`~attnbench.correctness.localize_record.Recorder`) it is ``True``, and torch's function is
handed the copy's arguments: it raises (``cache=``) or computes another function, so the replay would not be the case
that failed. :func:`dispatching_copy` finds such a copy from the recorder's ``__torch_function__``, and
:func:`dispatch_off` runs it with its ``has_torch_function`` names answering ``False``, so its body runs, recorded op by
op, as it ran in the case.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager

import torch
from torch.overrides import handle_torch_function

DISPATCH_NAMES = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
"""The names a copy of torch's functional code tests before dispatching (``from torch.nn.functional import *``)."""

_TORCH_DIR = os.path.dirname(torch.__file__)


def dispatching_copy(func) -> types.FunctionType | None:
    """The function outside torch that called ``handle_torch_function`` with another Python function ``func`` (a copy
    of torch's dispatching to torch's original), found among its module's globals; ``None`` for any other call (torch's
    own functions dispatch to themselves). Called from ``__torch_function__``: the frames above it are searched."""
    if not isinstance(func, types.FunctionType):
        return None
    frame = sys._getframe(1)
    for _ in range(4):  # __torch_function__ <- handle_torch_function <- the caller
        if frame is None or frame.f_code is handle_torch_function.__code__:
            break
        frame = frame.f_back
    caller = frame.f_back if frame is not None and frame.f_code is handle_torch_function.__code__ else None
    if caller is None or caller.f_code is func.__code__ or caller.f_code.co_filename.startswith(_TORCH_DIR):
        return None
    if not any(name in caller.f_globals for name in DISPATCH_NAMES):
        return None  # a dispatch test spelled otherwise (torch.overrides.has_torch_function): left as it is
    return next((value for value in caller.f_globals.values()
                 if isinstance(value, types.FunctionType) and value.__code__ is caller.f_code), None)


def _never(*args, **kwargs) -> bool:
    return False


@contextmanager
def dispatch_off(copy: types.FunctionType):
    """``copy``'s ``has_torch_function`` names answer ``False`` while it runs (restored after, whatever happens)."""
    namespace = copy.__globals__
    saved = {name: namespace[name] for name in DISPATCH_NAMES if name in namespace}
    namespace.update(dict.fromkeys(saved, _never))
    try:
        yield
    finally:
        namespace.update(saved)
