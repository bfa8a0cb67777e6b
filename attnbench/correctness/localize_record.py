"""Recording a class's intermediates with the line of its own file that made each one (issue 47).

:class:`Recorder` is a :class:`~torch.overrides.TorchFunctionMode`: it sees every Python-level torch call (functions,
tensor methods and operators, ``nn.Linear``'s ``F.linear``) while a class's forward runs. A call's floating-point
result is recorded when it depends on the forward's input (its arguments descend from the tensors the recorder was
told about: weights, masks and tables alone do not count) and when a frame of the caller's code made it: the first
frame outward that is not in torch, not in attnbench and not one already on the stack when recording began. Each
:class:`Record` keeps a copy of the value, the call's name, the file, line and text of that frame, and which earlier
records fed it. A call of the class's code that raises is kept too (:class:`Failure`: the float16 overflow of a
``masked_fill(-1e9)``), and :meth:`Recorder.index_of` says which record the forward returned.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import linecache
import os
import re
import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from attnbench.correctness.localize_dispatch import dispatch_off, dispatching_copy

_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["attnbench"]))
"""Frames in these folders are the machinery, never the class's line (the class's own file is anywhere else)."""


@functools.lru_cache(maxsize=4)
def _library_dirs(imported: int) -> tuple[str, ...]:
    """The folders of the imported packages that an installed distribution provides (einops, xformers, ...), for
    ``imported`` modules loaded (a new import reads them again)."""
    dirs = []
    for top in importlib.metadata.packages_distributions():
        module = sys.modules.get(top)
        path = getattr(module, "__file__", None)
        if path and os.path.basename(path) == "__init__.py":
            dirs.append(os.path.dirname(path) + os.sep)
    return tuple(dirs)


def library(path: str, forward_path: str) -> bool:
    """Whether ``path`` is in an installed package's folder that the class's forward (``forward_path``) is not in:
    a library the class calls, whose line is never the class's."""
    return any(path.startswith(d) and not forward_path.startswith(d) for d in _library_dirs(len(sys.modules)))


def module_tensors(module) -> dict[int, str]:
    """id -> name of every tensor ``module`` holds that is not a parameter: its buffers and the plain tensor attributes
    of it and its submodules (``self.freqs_cis = precompute_freqs_cis(...)`` in ``__init__``, not registered)."""
    held = {id(b): n for n, b in module.named_buffers()}
    for prefix, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and id(value) not in held:
                held[id(value)] = f"{prefix}.{attr}" if prefix else attr
    return held


def held_tensor(module, name: str):
    """The tensor :func:`module_tensors` calls ``name`` (a buffer, or a plain attribute of a submodule)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


@dataclass
class Record:
    """One recorded intermediate: ``index`` in call order, the torch call ``op``, its value (a detached copy), where
    in the class's code it was made, and the indices of the records it was computed from (``inputs``)."""

    index: int
    op: str
    value: torch.Tensor
    path: str
    line: int
    text: str
    inputs: tuple[int, ...] = ()
    live: torch.Tensor | None = field(default=None, repr=False)  # the tensor itself, for gradients
    caller: tuple[str, int, str, str] | None = None  # a helper's line: (path, line, text) of its call, its name
    direct: bool = True  # every input it was computed from is a recorded tensor itself (no unrecorded step between)
    args: tuple[int | None, ...] = ()  # per input on the forward's values, in call order: its record (None: unrecorded)
    func: tuple[str, int] | None = None  # (path, first line) of the function whose line made it

    @property
    def called_at(self) -> str | None:
        """``file.py:42`` of the call of the helper (a function or another module's forward) that made it, if any."""
        return None if self.caller is None else f"{_shown(self.caller[0])}:{self.caller[1]}"

    @property
    def where(self) -> str:
        """``file.py:42`` (the path as given when it is relative to the working folder)."""
        return f"{_shown(self.path)}:{self.line}"


@dataclass
class Aux:
    """A tensor the class's code made in its forward from no input (a mask, a table slice): its call, value and line,
    and the ids of the tensors it was made from (``parents``: earlier :class:`Aux` or module buffers)."""

    op: str
    value: torch.Tensor
    path: str
    line: int
    text: str
    parents: tuple[int, ...]

    @property
    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line}"


@dataclass
class Failure:
    """A torch call of the class's code that raised: the call's name, where (as :class:`Record`), the exception, and
    how many records came before it."""

    op: str
    path: str
    line: int
    text: str
    caller: tuple[str, int, str, str] | None
    error: Exception
    after: int

    @property
    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line}"

    @property
    def called_at(self) -> str | None:
        return None if self.caller is None else f"{_shown(self.caller[0])}:{self.caller[1]}"


def _shown(path: str) -> str:
    """``path`` relative to the working folder when it is under it, else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


class Recorder(TorchFunctionMode):
    """Records what a forward computes from ``sources`` (its inputs): ``with Recorder([x]) as rec: module(x)``, then
    ``rec.records``. ``keep_live`` also keeps each result itself (for gradients of the intermediates)."""

    def __init__(self, sources, keep_live: bool = False) -> None:
        super().__init__()
        self.records: list[Record] = []
        self._from: dict[int, tuple[int, ...]] = {id(t): () for t in sources}  # tainted tensor -> nearest records
        self._alive: list = list(sources)  # keeps every tainted tensor alive, so its id is never reused
        self._outer: set[int] = set()
        self._index: dict[int, int] = {}  # recorded tensor -> its record's index
        self.keep_live = keep_live
        self.failure: Failure | None = None
        self.aux: dict[int, Aux] = {}  # id of a tensor made from no input by the class's code -> how (masks)
        self.arg_ids: dict[int, tuple[int, ...]] = {}  # record index -> ids of its tensor arguments not from the input

    def __enter__(self):
        frame = sys._getframe(1)
        while frame is not None:
            self._outer.add(id(frame))
            frame = frame.f_back
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = dispatching_copy(func)
        if copy is not None:  # a copy of torch's code dispatching to torch's original: its own body runs, recorded
            with dispatch_off(copy), self._pushed():
                return copy(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        ins = [t for t in flat_in if isinstance(t, torch.Tensor) and id(t) in self._from]
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            self._failed(func, exc, ins)
            raise
        if not ins:
            self._aux(func, flat_in, out)
            return out
        plain = tuple(id(t) for t in flat_in if isinstance(t, torch.Tensor) and id(t) not in self._from)
        feeds = tuple(sorted({i for t in ins for i in self._from[id(t)]}))
        order = tuple(self._index.get(id(t)) for t in ins)
        where = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            self._from[id(t)] = feeds
            self._index.pop(id(t), None)  # an in-place call's result: the record it was is not what it holds now
            if t.is_floating_point() and t.numel() > 1:
                where = where or self._where()
                if where is not None:
                    if plain:
                        self.arg_ids[len(self.records)] = plain
                    self._from[id(t)] = (len(self.records),)
                    self._index[id(t)] = len(self.records)
                    self.records.append(Record(len(self.records), _name(func), t.detach().clone(), *where[:3], feeds,
                                               t if self.keep_live else None, where[3], None not in order, order,
                                               where[4]))
            self._alive.append(t)
        return out

    @contextlib.contextmanager
    def _pushed(self):
        """This mode active again inside its own ``__torch_function__`` (which runs with it popped)."""
        torch.overrides._push_mode(self)
        try:
            yield
        finally:
            torch.overrides._pop_mode()

    def _aux(self, func, flat_in: list, out) -> None:
        """Keep a tensor the class's code made from no input (:class:`Aux`), small ones only (masks, not weights)."""
        if not isinstance(out, torch.Tensor) or out.numel() > 1 << 16:
            return
        where = self._where()
        if where is None:
            return
        parents = tuple(id(t) for t in flat_in if isinstance(t, torch.Tensor) and t is not out)
        if any(t is out for t in flat_in):  # in place, or a no-op .to(): what made it is already kept
            return
        self.aux[id(out)] = Aux(_name(func), out.detach().clone(), *where[:3], parents)
        self._alive.append(out)

    def _failed(self, func, exc: Exception, ins: list) -> None:
        """Keep the first call of the class's code on the forward's values that raised."""
        where = self._where() if ins and self.failure is None else None
        if where is not None:
            self.failure = Failure(_name(func), *where[:3], where[3], exc, len(self.records))

    def index_of(self, t) -> int | None:
        """The index of the record that is ``t`` (the tensor a forward returned), or ``None``."""
        return self._index.get(id(t)) if isinstance(t, torch.Tensor) else None

    def _where(self) -> tuple[str, int, str, tuple | None, tuple[str, int]] | None:
        """``(path, line, text, caller, function)`` of the innermost frame of the class's code, or ``None`` (the
        machinery's own call); ``caller``: ``(path, line, text, name)`` of the next frame of the class's code outward
        (the call of the helper the line is in), or ``None`` when the line is in the forward attnbench called;
        ``function``: the path and first line of the innermost frame's function."""
        found = []
        frame = sys._getframe(2)
        while frame is not None and id(frame) not in self._outer:
            code = frame.f_code
            if not code.co_filename.startswith(_SKIP_DIRS) and not code.co_filename.startswith("<"):
                found.append((code.co_filename, frame.f_lineno, "", code.co_name, code.co_firstlineno))
            frame = frame.f_back
        if found:  # a library's frames (einops' rearrange) stand for the class's line that called it
            own = [f for f in found if not library(f[0], found[-1][0])]
            own = [f for f in own if not _passes_through(f)] or own  # OpenNMT's `lambda f, x: f(x)`: its caller's line
            own = [f for i, f in enumerate(own) if i == 0 or _function(f) != _function(own[i - 1])]  # a copy's dispatch
            found = [(p, n, linecache.getline(p, n).strip(), *rest) for p, n, _, *rest in (own or found)[:2]]
        if not found:
            return None
        caller = (*found[1][:3], found[0][3]) if len(found) > 1 else None
        return (*found[0][:3], caller, (found[0][0], found[0][4]))


PASS_THROUGH = re.compile(r"lambda\s+(\w+)\s*,\s*\*?(\w+)\s*:\s*\1\(\s*\*?\2\s*\)")
"""A lambda that only calls its first argument with its second (``lambda f, x: f(x)``, a checkpointing switch left
off): the torch call it makes is its caller's line."""


def _function(frame_info: tuple) -> tuple:
    """The function a frame runs: its file, name and first line (a function re-entered through its own dispatch,
    :mod:`~attnbench.correctness.localize_dispatch`, is one call, not a helper called by itself)."""
    return frame_info[0], frame_info[3], frame_info[4]


def _passes_through(frame_info: tuple) -> bool:
    path, line, _, name, _ = frame_info
    return name == "<lambda>" and bool(PASS_THROUGH.search(linecache.getline(path, line)))


class ProfileHook:
    """A ``sys.setprofile`` hook (:meth:`_hook`) set only inside ``with``, the one before it restored after."""

    _old = None

    def __enter__(self):
        self._old = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._old)

    def _hook(self, frame, event, arg) -> None:
        raise NotImplementedError


class ReturnLines(ProfileHook):
    """Where the class's own functions returned tensors: ``with ReturnLines() as r: out = module(x)``, then
    ``r.line_of(out)``, the ``(path, line, text)`` of the last (outermost: the forward's own) ``return`` of the
    class's code that returned ``out`` (alone or in a tuple), which is the place of a step left out at the end
    (``return y``, the output projection gone). A profile hook, set only while the replayed forward runs."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, str, int]] = []

    def _hook(self, frame, event, arg) -> None:
        if event != "return" or arg is None:
            return
        path = frame.f_code.co_filename
        if path.startswith(_SKIP_DIRS) or path.startswith("<"):
            return
        for t in (arg if isinstance(arg, tuple) else (arg,)):
            if isinstance(t, torch.Tensor):
                self.seen.append((t, path, frame.f_lineno))

    def line_of(self, out) -> tuple[str, int, str] | None:
        out = out[0] if isinstance(out, tuple) and out else out
        for t, path, line in reversed(self.seen):  # the outermost: the forward's own return
            if t is out:
                return path, line, linecache.getline(path, line).strip()
        return None


def _name(func) -> str:
    """A torch call's short name: ``linear``, ``matmul``, ``Tensor.transpose``."""
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__objclass__", None)
    return f"Tensor.{name}" if owner is torch.Tensor or owner is torch._C.TensorBase else name


def argument_line(path: str, first: int, pattern: re.Pattern, span: int = 20) -> tuple[int, str] | None:
    """``(line, text)`` of the argument ``pattern`` finds (``scale=``, ``dropout_p=``, ``is_causal``) in the call that
    starts at line ``first`` (its lines, at most ``span``, up to where its parentheses close); None when it passes
    none."""
    depth = 0
    for n in range(first, first + span):
        text = linecache.getline(path, n)
        if not text:
            return None
        if n > first and pattern.search(text) or n == first and pattern.search(text.split("(", 1)[-1]):
            return n, text.strip()
        depth += text.count("(") - text.count(")")
        if depth <= 0:
            return None
    return None
