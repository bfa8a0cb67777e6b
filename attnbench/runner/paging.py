"""Issue 37: a decode cell's page size given to a paged KV cache, and the paged columns of its row.

A paged cache (``implementations/paged.py``) has ``set_page_size(n)`` and ``page_stats()``. In a cell with a page size
(``attnbench run --page-size``) it is built with pages of that many tokens; a contiguous cache in the same cell is the
baseline at the same shape (the page size names the comparison group; the cache has no pages). A paged cache in a
cell without a page size cannot run: the row is ``skipped`` and says so.
"""

from __future__ import annotations

from torch import nn

from attnbench.errors import UnavailableError
from attnbench.results.schema import Cell


def _paged(module: nn.Module):
    base = getattr(module, "_orig_mod", module)
    return base if callable(getattr(base, "set_page_size", None)) else None


def configure(module: nn.Module, cell: Cell) -> str:
    """Set ``cell``'s page size on a paged ``module`` (the note its row says); a paged cache without a page size raises
    :class:`~attnbench.errors.UnavailableError` (a ``skipped`` row)."""
    paged = _paged(module)
    if paged is None:
        return f"contiguous KV cache: page size {cell.page_size} names the comparison group only" if cell.page_size else ""
    if not cell.page_size:
        raise UnavailableError(f"{cell.impl} is a paged KV cache: give its page size (attnbench run --page-size 16,64; "
                               "docs/paged.md)")
    paged.set_page_size(cell.page_size)
    return f"paged KV cache of {cell.page_size}-token pages, shuffled in one pool (a block table per sequence)"


def columns(module: nn.Module) -> dict:
    """``pages`` (in use by every sequence after the prefill) and ``page_fragmentation`` (their unused slots / their
    slots) of a paged ``module``; none for a contiguous one."""
    paged = _paged(module)
    stats = getattr(paged, "page_stats", None) if paged is not None else None
    if not callable(stats):
        return {}
    s = stats()
    slots = s.get("slots") or 0
    return {"pages": float(s["pages"]),
            "page_fragmentation": (slots - s["tokens"]) / slots if slots else float("nan")}
