"""Exceptions a user can cause.

Every error a user can trigger (bad sizes, an unknown implementation name, a plug-in that does not
load, a device that is not here, a corrupt results file) is an :class:`AttnbenchError` subclass whose
message names the problem and what to do. The CLI prints these as one line without a traceback;
anything else is a programming error and is allowed to raise loudly.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence


class AttnbenchError(Exception):
    """Base class of every error a user can cause.

    A long refusal can say what it found in parts: ``details`` (a few short lines: what was tried, what was seen) and
    ``fix`` (what to do), keyword-only and optional. ``str(exc)`` stays the whole message on one line (``headline;
    detail; ...; fix``), so code that reads the message still works; the CLI prints the headline after ``error:`` and
    each part on an indented line of its own (:func:`refusal_lines`).
    """

    def __init__(self, *args, details: Sequence[str] = (), fix: str = "", **kwargs) -> None:
        self.headline = str(args[0]) if args else ""
        self.details, self.fix = tuple(str(d) for d in details if str(d).strip()), str(fix).strip()
        if args and (self.details or self.fix):
            args = ("; ".join([self.headline, *self.details, *([self.fix] if self.fix else [])]), *args[1:])
        super().__init__(*args, **kwargs)


class CellTimeout(Exception):
    """Raised inside a cell that ran past ``cell_timeout_s`` (:func:`attnbench.runner.cell.deadline`).

    Deliberately not an :class:`AttnbenchError`: code that turns a user's error into a refusal (a plug-in's constructor
    that fails becomes a :class:`PluginLoadError`) must let a timeout through, so that the cell's row says ``timeout``."""


class InvalidSpecError(AttnbenchError, ValueError):
    """An :class:`~attnbench.spec.AttnSpec` (or a sweep axis) has impossible sizes."""


class InputShapeError(AttnbenchError, ValueError):
    """An input tensor does not fit the module's spec (rank, width, length)."""


class UnknownImplementationError(AttnbenchError, KeyError):
    """No implementation is registered under that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PluginLoadError(AttnbenchError, ImportError):
    """A plug-in (entry point, ``file.py:Class`` or ``module:Class``) does not load or build."""


class UnavailableError(AttnbenchError, RuntimeError):
    """An implementation, dtype or device cannot run on this machine."""


class SweepError(AttnbenchError, ValueError):
    """A sweep definition (flags, TOML file, preset) is malformed."""


class ResultsError(AttnbenchError, OSError):
    """A results folder is missing, corrupt, or belongs to another run."""


class RowError(ResultsError, ValueError):
    """A results row has a key that is not a column, or a value of the wrong type for its column."""


class OlderResultsWarning(UserWarning):
    """A run written by an older attnbench was read: the columns it lacked were filled in (the message names them)."""


# --- how a refusal is printed ------------------------------------------------------------------------

HEADLINE_WIDTH = 160
"""A refusal's headline (``error: ...``, the first true cause) is kept to about this many characters."""
LINE_WIDTH = 140
"""No line under the headline is longer than this."""
MAX_LINES = 6
"""At most this many lines under the headline (what was tried, what was seen, the fix, where to read more)."""
_FIX = re.compile(r"^(if [^,]{1,80}, )?(give|install|pip|point|run|rename|use|check|pass|add|set|call|try|remove|declare|"
                  r"make|define|write|move|update|pin|upgrade|build|choose|leave|drop|wait|free|lower|raise|name|"
                  r"complete|keep|put|reinstall|delete)\b", re.I)
_DOCS = re.compile(r"^(see )?docs/\S+\.md\b")
_ROOM = HEADLINE_WIDTH - len("error: ")


def refusal_lines(exc: BaseException) -> list[str]:
    """How the CLI prints a refusal: ``error: HEADLINE``, then at most :data:`MAX_LINES` indented lines.

    A short one-line message prints as it is. An error built with ``details``/``fix`` prints its parts; a long
    message without them is cut at its own seams (``; `` and sentences into parts, a last part that says what to do
    as the fix, a docs reference last), and a headline still too long loses its parenthesised remarks and long
    argument lists to the lines below, or is cut after its last fitting ``: ``, or wraps."""
    details, fix = list(getattr(exc, "details", ())), getattr(exc, "fix", "")  # a subclass may skip our __init__
    if details or fix:
        head = getattr(exc, "headline", "") or str(exc)
    else:
        first, *others = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
        if not others and len(first) <= _ROOM:
            return [f"error: {first}"]
        head, details, fix = _seams(first)
        details += others
    head, details = _bare_type(head, details)
    head, pulled = _short_head(head)
    if not fix and pulled and _FIX.match(pulled[-1]):  # "(pip install x, or ...)" moved out of the headline
        fix = pulled.pop()
    parts = [*pulled, *details]
    refs = [ref.removeprefix("see ") for ref in parts if _DOCS.match(ref)]
    details = [_wrap(d) for d in parts if not _DOCS.match(d)]
    fix_lines = _wrap(f"fix: {fix[:1].lower() + fix[1:] if fix[1:2].islower() else fix}") if fix else []
    return [f"error: {head}", *_fit(details, fix_lines, [_wrap(f"see {ref}") for ref in refs])]


_BARE = re.compile(r"\b[A-Z]\w*(Error|Exception|Exit|Interrupt)\)?:?\s*$")


def _bare_type(head: str, details: list[str]) -> tuple[str, list[str]]:
    """A headline that ends in an exception's type with no message (``... raised AssertionError:``, its words on the
    next line) says no cause: the first line under it joins it."""
    if not details or not _BARE.search(head):
        return head, details
    return f"{head.rstrip().rstrip(':')}: {details[0]}", details[1:]


def _seams(text: str) -> tuple[str, list[str], str]:
    """``text`` cut at its top-level ``; `` and sentence ends: the headline, the details (a docs reference in
    brackets, pulled out of any clause, goes last) and a last clause that says what to do (the fix)."""
    clauses = [c for part in _split_top(text, "; ") for c in _sentences(part)]
    refs = []
    for i, clause in enumerate(clauses):
        for start, end in reversed(_remarks(clause, 0)):
            inner = clause[start + 2:end - 1]
            if _DOCS.match(inner):
                refs.append(inner)
                clause = clauses[i] = (clause[:start] + clause[end:]).strip()
    head, rest = clauses[0], [c for c in clauses[1:] if c]
    fix = rest.pop() if rest and _FIX.match(rest[-1]) else ""
    return head, rest + refs, fix


def _sentences(text: str) -> list[str]:
    """``text`` split after each top-level ``. `` that a capital letter follows."""
    cuts = [i for i in _top_positions(text, ". ") if text[i + 2:i + 3].isupper()]
    starts, ends = [0, *(c + 2 for c in cuts)], [*(c + 1 for c in cuts), len(text)]
    return [text[s:e].strip() for s, e in zip(starts, ends, strict=True)]


def _short_head(head: str) -> tuple[str, list[str]]:
    """``head`` brought under :data:`HEADLINE_WIDTH` and the parts moved out of it: its longest parenthesised
    remarks and long argument lists (``Block(…)``) first; else it is cut after its last fitting top-level ``: ``;
    else it wraps onto the next line."""
    if len(head) <= _ROOM:
        return head, []
    short, remarks = _without_remarks(head)
    if len(short) <= _ROOM:
        return short, remarks
    cuts = [i for i in _top_positions(head, ": ") if i >= 20]
    for n, cut in reversed(list(enumerate(cuts))):
        left, left_remarks = _without_remarks(head[:cut + 1])
        if len(left) <= _ROOM and _BARE.search(left):  # "... failed: ValueError:" says no cause
            if n + 1 == len(cuts):  # nothing after the exception's words to cut at: the headline wraps below
                break
            cut = cuts[n + 1]  # longer, with the exception's words (mutable default ... is not allowed)
            left, left_remarks = _without_remarks(head[:cut + 1])
            return left, [head[cut + 2:], *left_remarks]
        if len(left) <= _ROOM:
            return left, [head[cut + 2:], *left_remarks]
    cut = head.rfind(" ", 20, _ROOM)
    cut = cut if cut > 0 else _ROOM
    return head[:cut], [head[cut:].strip()]


def _without_remarks(text: str) -> tuple[str, list[str]]:
    """``text`` without its longest `` (...)`` remarks and with long argument lists shortened to ``(…)``, until it
    fits the headline; the remarks taken out, in order."""
    taken = []
    while len(text) > _ROOM and _remarks(text):
        start, end = max(_remarks(text), key=lambda span: span[1] - span[0])
        taken.append((start, text[start + 2:end - 1]))
        text = (text[:start] + text[end:]).strip()
    for start, end in reversed(_remarks(text, 24, call=True)):  # Block(width, n_heads, vocab_file, ...) -> Block(…)
        if len(text) > _ROOM:
            text = f"{text[:start]}(…){text[end:]}"
    return text, [remark for _, remark in sorted(taken)]


def _depths(text: str) -> list[int]:
    """The bracket depth before each character of ``text`` (never below 0: prose has stray brackets)."""
    depth, out = 0, []
    for ch in text:
        out.append(depth)
        depth = depth + 1 if ch in "([{" else max(0, depth - 1) if ch in ")]}" else depth
    return out


def _top_positions(text: str, sep: str) -> list[int]:
    """Where ``sep`` occurs in ``text`` outside brackets."""
    depths = _depths(text)
    return [m.start() for m in re.finditer(re.escape(sep), text) if depths[m.start()] == 0]


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets."""
    cuts = _top_positions(text, sep)
    starts, ends = [0, *(c + len(sep) for c in cuts)], [*cuts, len(text)]
    return [text[s:e].strip() for s, e in zip(starts, ends, strict=True)]


def _remarks(text: str, shortest: int = 24, call: bool = False) -> list[tuple[int, int]]:
    """Spans of the top-level brackets of ``text`` at least ``shortest`` characters long: remarks `` (...)`` (the
    span includes the space before), or with ``call`` the argument lists of calls (``Attention(d_in, ...)``)."""
    spans, depths = [], _depths(text)
    for i, ch in enumerate(text):
        before = text[i - 1:i]
        if ch != "(" or depths[i] != 0 or (not before.isidentifier() if call else before != " "):
            continue
        end = next((j + 1 for j in range(i + 1, len(text)) if text[j] == ")" and depths[j] == 1), None)
        if end is not None and end - i >= shortest:
            spans.append((i, end) if call else (i - 1, end))
    return spans


def _wrap(item: str) -> list[str]:
    """One part of a refusal as indented lines of at most :data:`LINE_WIDTH` characters."""
    return textwrap.wrap(item, width=LINE_WIDTH, initial_indent="  ", subsequent_indent="    ",
                         break_on_hyphens=False) or ["  "]


def _cut(lines: list[str], n: int) -> list[str]:
    """The first ``n`` of ``lines``, the last one ending in `` …`` when some were cut."""
    if len(lines) <= n:
        return lines
    return [*lines[:n - 1], lines[n - 1][:LINE_WIDTH - 2].rstrip() + " …"]


def _fit(details: list[list[str]], fix: list[str], refs: list[list[str]]) -> list[str]:
    """At most :data:`MAX_LINES` lines: the details, the fix and the docs references; long details are cut to a
    line first, then the later details make way for ``… and N more``, and last the fix is cut."""
    def count() -> int:
        return sum(map(len, details)) + len(fix) + sum(map(len, refs))

    while count() > MAX_LINES and any(len(d) > 1 for d in details):
        longest = max(range(len(details)), key=lambda i: len(details[i]))
        details[longest] = _cut(details[longest], len(details[longest]) - 1)
    if count() > MAX_LINES and len(details) > 1:
        keep = max(1, MAX_LINES - len(fix) - sum(map(len, refs)) - 1)
        details = [*details[:keep], [f"  … and {len(details) - keep} more"]]
    fix = _cut(fix, max(1, MAX_LINES - sum(map(len, details)) - sum(map(len, refs))))
    return [line for part in [*details, fix, *refs] for line in part]
