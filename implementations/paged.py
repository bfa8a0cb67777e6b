"""Paged KV caches (issue 37): fixed-size pages in one shared pool, a block table per sequence, pages shuffled.

The cache keeps keys and values in a pool of ``(pages, page_size, num_kv_heads, head_dim)`` (token-major pages, as
vLLM lays them out). Each sequence of the batch owns a list of physical pages, its *block table*: logical page ``j``
(positions ``j * page_size ..``) lives in physical page ``table[j]``. Free pages are handed out from a free list in a
seeded random order, so a sequence's pages are scattered over the pool, never contiguous by construction. The pool
grows on demand (by exactly the pages a call lacks) and keeps its pages across ``reset_cache()``; under a sliding
window the pages that fall wholly out of the last token's window go back to the free list, so a windowed cache holds
``window`` tokens rounded up to pages, not the whole sequence.

The protocol (the KV-cache protocol of ``implementations/kv_cache.py`` plus three things):

* ``set_page_size(n)``: tokens per page (drops the pool; ``attnbench run --page-size`` calls it);
* ``forward(x, use_cache=True, lengths=None)``: ``lengths`` (one int per batch row) lets the rows of one call append
  different numbers of tokens (the first ``lengths[i]`` of row ``i``; the outputs past them are zero), so the
  sequences of a batch hold different lengths and each decodes at its own position;
* ``page_stats()``: pages in use, their slots, the tokens they hold and the block tables.

Two ways to attend through the block tables:

* ``paged_sdpa``: gather the sequence's pages through the block table into ``(b, n_kv, L, hd)``, then
  ``F.scaled_dot_product_attention`` with a mask of the positions each slot holds (padding, causality, the window);
* ``flex_paged``: no gather: FlexAttention over the whole pool, with a block-table-aware ``mask_mod`` (a slot is
  visible when its page belongs to the query's sequence and its logical position is causal and in the window) and a
  ``BlockMask`` whose KV blocks are the pages. Run eagerly, FlexAttention scores every slot of the pool
  for every sequence (compiled, it would visit only the blocks the BlockMask keeps; not tried here). A prefill into an
  empty cache attends over the call's own keys (causal, no pages read), as serving systems run prefills; decode steps and
  chunks appended to a non-empty cache read the pages.

A plan (:meth:`PagedCache.plan_call`: the pages for the new tokens reserved, the gather index and mask, or the block
mask) is built by every cached call; ``plan_call(x, lengths=...)`` builds it apart and ``forward(x, use_cache=True,
planned=plan)`` uses it. It is not the ``prepare``/``prepared=`` setup protocol of :mod:`attnbench.runner.setup`:
planning reserves pages and advances the sequences (it is half of a cached call, not a repeatable setup), and the full
forward (``use_cache=False``: the inference, forward and forward+backward cells) has no setup step, so ``setup_s`` is
NaN on those rows (named ``prepare``, the runner timed it apart as that setup, call after call, until the cache was
full: an error row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from attnbench.errors import InputShapeError, InvalidSpecError
from attnbench.implementations._common import merge_heads
from attnbench.implementations.gqa import _factory
from attnbench.implementations.kv_cache import HOW, CachedAttention
from attnbench.plugins.catalog import register

DEFAULT_PAGE_SIZE = 16


@dataclass
class Plan:
    """What one cached call needs besides the tensors: where its tokens go and what each query may see."""

    lengths: list[int]  # new tokens per row
    starts: list[int]  # each row's first new position
    dest: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (row, token, page, slot) of stored tokens
    q_pos: torch.Tensor  # (b, t) query positions (padding rows: the row's last position)
    attend: object  # the implementation's: (block table, mask) for the gather, a BlockMask for Flex


class PagedCache(CachedAttention):
    """A paged KV cache (module docstring); subclasses say how to attend through it (:meth:`_plan_attend`)."""

    page_size = DEFAULT_PAGE_SIZE
    shuffle_seed = 0

    def set_page_size(self, n: int) -> None:
        """Tokens per page; the pool is dropped (the next call allocates it)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSpecError(f"page size must be an int >= 1, got {n!r}")
        self.page_size = n
        self.pool_k = self.pool_v = None
        self.reset_cache()

    def reset_cache(self) -> None:
        """Forget every sequence; the pool's pages stay allocated, all free again (in a fresh random order)."""
        if not hasattr(self, "pool_k"):
            self.pool_k = self.pool_v = None
            self._gen = torch.Generator().manual_seed(self.shuffle_seed)
        self.tables: list[list[int]] = []  # physical pages of each sequence
        self.first: list[int] = []  # the logical page number of tables[i][0] (pages before it were trimmed)
        self.lens: list[int] = []  # tokens each sequence has seen
        self.free = self._shuffled(range(0 if self.pool_k is None else self.pool_k.shape[0]))
        self.pos = 0

    def cache_tensors(self) -> list[torch.Tensor]:
        """The pool (keys and values): what the cache holds, free pages included."""
        return [t for t in (self.pool_k, self.pool_v) if t is not None]

    def page_stats(self) -> dict:
        """Pages in use, their slots, the tokens they hold, the pool's pages and the block tables."""
        pages = sum(len(t) for t in self.tables)
        held = sum(n - f * self.page_size for n, f in zip(self.lens, self.first, strict=True))
        pool = 0 if self.pool_k is None else self.pool_k.shape[0]
        return dict(pages=pages, slots=pages * self.page_size, tokens=held, pool_pages=pool,
                    block_tables=[list(t) for t in self.tables])

    # -- pages -------------------------------------------------------------------------------------
    def _shuffled(self, ids) -> list[int]:
        ids = list(ids)
        return [ids[i] for i in torch.randperm(len(ids), generator=self._gen).tolist()]

    def _take(self, like: torch.Tensor, n: int) -> list[int]:
        """``n`` free pages (the pool grown by what it lacks, in ``like``'s dtype and device; the new pages shuffled
        into the free list)."""
        short = n - len(self.free)
        if short > 0:
            old = 0 if self.pool_k is None else self.pool_k.shape[0]
            shape = (short, self.page_size, self.num_kv_heads, self.head_dim)
            extra = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.pool_k = extra if self.pool_k is None else torch.cat([self.pool_k, extra])
            self.pool_v = extra.clone() if self.pool_v is None else torch.cat([self.pool_v, extra])
            self.free = self._shuffled(self.free + list(range(old, old + short)))
        return [self.free.pop() for _ in range(n)]

    def _keep_from(self, last: int) -> int:
        """The first position a later token can still see after the token at ``last`` (0 without a window)."""
        return 0 if self.window is None else max(0, last - self.window + 1)

    def _trim(self) -> None:
        """Give back every page wholly before what the sequences' next tokens can see."""
        for i, n in enumerate(self.lens):
            keep = self._keep_from(n - 1) // self.page_size
            while self.first[i] < keep and self.tables[i]:
                self.free.append(self.tables[i].pop(0))
                self.first[i] += 1

    def _start(self, x: torch.Tensor, lengths) -> list[int]:
        b, t, width = x.shape
        if width != self.spec.d_in:
            raise InputShapeError(f"input width is {width} but the layer was built with d_in={self.spec.d_in}")
        if not self.causal:
            raise InvalidSpecError("use_cache=True needs causal attention: build the layer with causal=True")
        lengths = [t] * b if lengths is None else [int(n) for n in lengths]
        if len(lengths) != b or any(n < 0 or n > t for n in lengths):
            raise InputShapeError(f"lengths {lengths} must give 0..{t} new tokens for each of the {b} rows")
        if not self.lens or not any(self.lens):
            if self.pool_k is not None and (self.pool_k.dtype != x.dtype or self.pool_k.device != x.device
                                            or self.pool_k.shape[2] != self.num_kv_heads):
                self.pool_k = self.pool_v = None
            self.tables, self.first, self.lens = [[] for _ in range(b)], [0] * b, [0] * b
            self.free = self._shuffled(range(0 if self.pool_k is None else self.pool_k.shape[0]))
        elif len(self.lens) != b:
            raise InputShapeError(f"the cache holds {len(self.lens)} sequences, the input has {b} rows; call "
                                  "reset_cache() before decoding another batch")
        if max(n + m for n, m in zip(self.lens, lengths, strict=True)) > self.spec.context_length:
            raise InputShapeError(f"the KV cache would hold more than context_length={self.spec.context_length} "
                                  "tokens; call reset_cache() or build the layer with a larger context_length")
        return lengths

    def plan_call(self, x: torch.Tensor, lengths=None) -> Plan:
        """Reserve the pages of ``x``'s new tokens and build what attending needs: the first half of a cached call
        (it changes the cache: the sequences' lengths advance), for ``forward(x, use_cache=True, planned=plan)``."""
        if self.window is not None and x.shape[1] > self.window:
            raise InputShapeError(f"plan_call plans a chunk of at most window={self.window} tokens, got {x.shape[1]}; "
                                  "forward(x, use_cache=True) splits a longer chunk itself")
        lengths = self._start(x, lengths)
        P, rows, toks, pages, slots = self.page_size, [], [], [], []
        for i, n in enumerate(lengths):
            end = self.lens[i] + n  # positions lens[i] .. end - 1 are new
            need = math.ceil(end / P) - self.first[i] - len(self.tables[i])
            if need > 0:
                self.tables[i] += self._take(x, need)
            for j, p in enumerate(range(self.lens[i], end)):  # every new token is stored (a chunk <= the window)
                rows.append(i), toks.append(j), pages.append(self.tables[i][p // P - self.first[i]])
                slots.append(p % P)
        dev = x.device
        dest = tuple(torch.tensor(v, dtype=torch.long, device=dev) for v in (rows, toks, pages, slots))
        starts = list(self.lens)
        ar = torch.arange(x.shape[1], device=dev)
        q_pos = torch.tensor(starts, device=dev)[:, None] + torch.minimum(ar[None, :], (torch.tensor(
            lengths, device=dev)[:, None] - 1).clamp(min=0))
        self.lens = [s + n for s, n in zip(starts, lengths, strict=True)]
        plan = Plan(lengths, starts, dest, q_pos, None)
        plan.attend = self._plan_attend(plan, dev)
        return plan

    def _plan_attend(self, plan: Plan, device: torch.device):
        raise NotImplementedError

    def _block_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b, pages)`` physical pages (padded with the row's first page) and ``(b,)`` first logical pages."""
        width = max(1, max(len(t) for t in self.tables))
        table = [t + [t[0] if t else 0] * (width - len(t)) for t in self.tables]
        return torch.tensor(table, dtype=torch.long, device=device), torch.tensor(self.first, device=device)

    # -- attention ---------------------------------------------------------------------------------
    def forward(self, x, use_cache: bool = False, lengths=None, planned: Plan | None = None):
        """The full forward (``use_cache=False``: the cache is neither read nor changed), or the next tokens through
        the pages (``lengths``: new tokens per row; ``planned``: a :meth:`plan_call` of this ``x``)."""
        if not use_cache:
            return super().forward(x)
        if planned is None and self.window is not None and x.shape[1] > self.window:
            return self._in_windows(x, lengths)
        plan = self.plan_call(x, lengths) if planned is None else planned
        q, k, v = self.project(x)  # (b, nh, t, hd), (b, n_kv, t, hd) x 2
        rows, toks, pages, slots = plan.dest
        self.pool_k[pages, slots] = k[rows, :, toks]  # (n, n_kv, hd) into the pages' slots
        self.pool_v[pages, slots] = v[rows, :, toks]
        context = self._attend_paged(q, k, v, plan)  # (b, nh, t, hd)
        self._trim()
        self.pos = max(self.lens)
        out = self.out_proj(merge_heads(context))  # (b, t, d_out)
        pad = torch.arange(x.shape[1], device=x.device)[None, :] >= torch.tensor(plan.lengths, device=x.device)[:, None]
        return out.masked_fill(pad[..., None], 0) if bool(pad.any()) else out

    def _in_windows(self, x: torch.Tensor, lengths) -> torch.Tensor:
        """A chunk longer than the window, as consecutive chunks of ``window`` tokens (chunked prefill): the pool
        never holds more than the window and one chunk of a sequence."""
        b, t = x.shape[:2]
        w = self.window
        lengths = [t] * b if lengths is None else [int(n) for n in lengths]
        outs = [self.forward(x[:, s:s + w], use_cache=True, lengths=[min(max(n - s, 0), w) for n in lengths])
                for s in range(0, t, w)]
        return torch.cat(outs, dim=1)

    def _attend_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> torch.Tensor:
        """``q`` ``(b, nh, t, hd)`` through the pages (``k``/``v``: the call's own keys and values, already stored)."""
        raise NotImplementedError

    def rewind_cache(self, n: int = 1) -> None:
        """Forget the last ``n`` tokens of every sequence (pages wholly past the end go back to the free list)."""
        for i in range(len(self.lens)):
            new = self.lens[i] - n
            if new < 0 or self._keep_from(new) < self.first[i] * self.page_size:
                raise ValueError(f"cannot rewind {n} tokens: sequence {i}'s earlier pages left the window and were freed")
            self.lens[i] = new
            while self.tables[i] and (self.first[i] + len(self.tables[i]) - 1) * self.page_size >= new:
                self.free.append(self.tables[i].pop())
        self.pos = max(self.lens, default=0)


class PagedSDPA(PagedCache):
    """Gather each sequence's pages through its block table, then SDPA with a position mask."""

    use_sdpa = True  # the full forward (no cache) too

    def _plan_attend(self, plan: Plan, device: torch.device):
        table, first = self._block_table(device)
        P = self.page_size
        key_pos = first[:, None] * P + torch.arange(table.shape[1] * P, device=device)[None, :]  # (b, L)
        lens = torch.tensor(self.lens, device=device)
        ok = (key_pos[:, None, :] <= plan.q_pos[:, :, None]) & (key_pos < lens[:, None])[:, None, :]
        if self.window is not None:
            ok &= plan.q_pos[:, :, None] - key_pos[:, None, :] < self.window
        return table, ok[:, None]  # (b, pages), (b, 1, t, L)

    def _attend_paged(self, q, k, v, plan):
        table, mask = plan.attend
        b, n_kv, hd = table.shape[0], self.num_kv_heads, self.head_dim
        keys = self.pool_k[table].view(b, -1, n_kv, hd).transpose(1, 2)  # (b, n_kv, L, hd): the gather
        values = self.pool_v[table].view(b, -1, n_kv, hd).transpose(1, 2)
        p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=p, enable_gqa=self.group > 1)


class PagedFlex(PagedCache):
    """FlexAttention over the pool with a block-table-aware mask_mod and a BlockMask of pages (no gather)."""

    def _plan_attend(self, plan: Plan, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        P, n_pages = self.page_size, self.pool_k.shape[0]
        owner = torch.full((n_pages,), -1, dtype=torch.long)
        logical = torch.zeros(n_pages, dtype=torch.long)
        for i, table in enumerate(self.tables):  # the inverse block table: physical page -> (sequence, logical page)
            owner[table] = i
            logical[table] = torch.arange(self.first[i], self.first[i] + len(table))
        owner, logical = owner.to(device), logical.to(device)
        lens, q_pos, window = torch.tensor(self.lens, device=device), plan.q_pos, self.window
        t = q_pos.shape[1]
        if not any(plan.starts):  # a prefill into an empty cache: causal over the call's own keys, no pages read
            def own_mask(b, h, q_idx, kv_idx):
                seen = (kv_idx < lens[b]) & (kv_idx <= q_pos[b, q_idx])
                return seen & (q_pos[b, q_idx] - kv_idx < window) if window is not None else seen

            return create_block_mask(own_mask, len(self.lens), None, t, t, device=device, BLOCK_SIZE=128), True

        def paged_mask(b, h, q_idx, kv_idx):
            page = kv_idx // P
            pos = logical[page] * P + kv_idx % P
            seen = (owner[page] == b) & (pos < lens[b]) & (pos <= q_pos[b, q_idx])
            return seen & (q_pos[b, q_idx] - pos < window) if window is not None else seen

        return create_block_mask(paged_mask, len(self.lens), None, t, n_pages * P, device=device,
                                 BLOCK_SIZE=(128, P)), False

    def _attend_paged(self, q, k, v, plan):
        from torch.nn.attention.flex_attention import flex_attention

        block_mask, own = plan.attend
        if own:
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=self.group > 1)
        n, P = self.pool_k.shape[0], self.page_size
        keys = self.pool_k.view(1, n * P, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (1, n_kv, slots, hd)
        values = self.pool_v.view(1, n * P, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=self.group > 1)


def _flex_available(device) -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"FlexAttention not in this torch build ({exc})"
    return None


PAGED = dict(gqa=True, sliding_window=True, non_causal=True, kv_cache=True)
PAGED_HOW = (f"paged KV cache: a pool of shuffled pages and a block table per sequence, set_page_size(n), "
             f"forward(x, use_cache=True, lengths=...), page_stats() (implementations/paged.py); {HOW}")
register("paged_sdpa", _factory(PagedSDPA), **PAGED, min_torch="2.5",
         source=f"gather through the block table, then F.scaled_dot_product_attention with a position mask; {PAGED_HOW}")
register("flex_paged", _factory(PagedFlex), **PAGED, dropout=False, backward=("cuda",), min_torch="2.5",
         probe=_flex_available,
         source=f"flex_attention over the page pool with a block-table-aware mask_mod and a BlockMask of pages; {PAGED_HOW}")
