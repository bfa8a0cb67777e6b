"""Variable-length batches (issue 37): one batch of sequences of different lengths, run five ways.

Every class takes the batch as ``forward(x, lengths=..., prepared=None)`` in its layout (``varlen_layout``):
``padded`` ``(batch, longest, d)`` with right padding, or ``packed`` ``(1, tokens, d)``, the sequences one after
another. ``lengths`` is a tuple of ints (``None``: every row of ``x`` is one full sequence). Whatever a class must
build from the lengths before attending (a padding mask, a document mask, a block mask, a nested tensor) is its
``prepare(x, lengths=...)`` (the setup, measured apart: :mod:`attnbench.runner.setup`); ``forward`` uses
``prepared`` when given and prepares itself otherwise.

* ``varlen_padded``: padded to the longest with a key padding mask (and the causal one) through SDPA's explicit
  mask: what most code does (Hugging Face's ``attention_mask``); projections and attention run on the padding too;
* ``varlen_packed``: packed into one sequence with a block-diagonal (causal) document mask through SDPA;
* ``varlen_loop``: per sequence, a loop of SDPA calls on slices of the packed projections (the reference's shape);
* ``varlen_nested``: PyTorch's nested tensors (``torch.jagged`` layout) through ``scaled_dot_product_attention``;
  where PyTorch has no kernel for them (causal, on the CPU of torch 2.13) the cell is ``skipped`` with its reason;
* ``varlen_flex``: FlexAttention with a document ``mask_mod`` over the packed sequence.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch.nn import functional as F

from attnbench.errors import InputShapeError, UnavailableError
from attnbench.implementations._common import AttentionModule, add_book_projections, merge_heads, split_heads
from attnbench.plugins.catalog import register

warnings.filterwarnings("ignore", message=r"flex_attention called without torch.compile")
warnings.filterwarnings("ignore", message=r"The PyTorch API of nested tensors is in prototype stage")


def _lengths(x: torch.Tensor, lengths, layout: str) -> tuple[int, ...]:
    """The sequence lengths of ``x`` (checked against its layout); None: every row of ``x`` is one sequence."""
    if lengths is None:
        return (x.shape[1],) * x.shape[0]
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise InputShapeError(f"lengths must be a non-empty sequence of positive ints, got {lengths}")
    if layout == "packed" and (x.shape[0] != 1 or sum(lengths) != x.shape[1]):
        raise InputShapeError(f"a packed batch is (1, sum(lengths), d); got {tuple(x.shape)} for {sum(lengths)} tokens")
    if layout == "padded" and (x.shape[0] != len(lengths) or max(lengths) > x.shape[1]):
        raise InputShapeError(f"a padded batch is (len(lengths), >= max(lengths), d); got {tuple(x.shape)} for "
                              f"{len(lengths)} sequences of at most {max(lengths)}")
    return lengths


def document_ids(lengths, device: torch.device) -> torch.Tensor:
    """``(tokens,)``: the index of the sequence (document) each packed token belongs to."""
    sizes = torch.as_tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)


class VarlenAttention(AttentionModule):
    """Book projections; a subclass attends over the batch in its ``varlen_layout``."""

    varlen_layout = "packed"

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, causal=causal)
        add_book_projections(self, d_in, d_out, qkv_bias)

    def check_input(self, x: torch.Tensor, lengths=None) -> None:
        """A rectangle (``lengths`` None) is checked as every layer's input; a variable-length batch by its rank, width
        and longest sequence (a packed batch is longer than ``context_length``; its documents are not)."""
        if lengths is None:
            return self.spec.check_input(x)
        if x.dim() != 3 or x.shape[-1] != self.spec.d_in:
            raise InputShapeError(f"input must be (batch, tokens, d_in={self.spec.d_in}); got {tuple(x.shape)}")
        if max(lengths) > self.spec.context_length:
            raise InputShapeError(f"a sequence of {max(lengths)} tokens is longer than context_length="
                                  f"{self.spec.context_length}; build the layer with a larger context_length")

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(b, nh, T, hd)`` queries, keys and values of ``x``."""
        return tuple(split_heads(proj(x), self.num_heads) for proj in (self.W_query, self.W_key, self.W_value))

    def forward(self, x, lengths=None, prepared=None):
        self.check_input(x, lengths)
        flat = lengths is None and self.varlen_layout == "packed" and x.shape[0] > 1
        if flat:  # a rectangle given to a packed layout: each row one sequence
            b, T, _ = x.shape
            x, lengths = x.reshape(1, b * T, -1), (T,) * b
        lengths = _lengths(x, lengths, self.varlen_layout)
        state = self.prepare(x, lengths=lengths) if prepared is None else prepared
        out = self.out_proj(self.attend(x, lengths, state))
        return out.reshape(b, T, -1) if flat else out

    def prepare(self, x, lengths=None):
        return None

    def attend(self, x, lengths, state) -> torch.Tensor:
        raise NotImplementedError


class PaddedAttention(VarlenAttention):
    """Padded to the longest; SDPA with an explicit key padding mask (and the causal one)."""

    varlen_layout = "padded"

    def prepare(self, x, lengths=None):
        """``(b, 1, T, T)`` bool, True = may attend: key ``j`` is a real token of its sequence (and ``j <= i``)."""
        b, T, _ = x.shape
        lengths = _lengths(x, lengths, self.varlen_layout)
        keys = torch.arange(T, device=x.device)
        mask = keys[None, None, :] < torch.as_tensor(lengths, device=x.device)[:, None, None]  # (b, 1, T)
        if self.causal:
            mask = mask & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        return mask.expand(b, T, T)[:, None]

    def attend(self, x, lengths, state):
        q, k, v = self.heads(x)
        return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=state))


class PackedAttention(VarlenAttention):
    """Packed into one sequence; SDPA with a block-diagonal (causal) document mask."""

    def prepare(self, x, lengths=None):
        """``(tokens, tokens)`` bool, True = may attend: the same document (and ``j <= i``)."""
        doc = document_ids(_lengths(x, lengths, self.varlen_layout), x.device)
        mask = doc[:, None] == doc[None, :]
        return mask.tril() if self.causal else mask

    def attend(self, x, lengths, state):
        q, k, v = self.heads(x)
        return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=state))


class LoopAttention(VarlenAttention):
    """Per sequence: the packed projections sliced, one SDPA call per sequence (no setup: nothing to build)."""

    prepare = None  # no prepare(): setup_s is NaN

    def forward(self, x, lengths=None, prepared=None):
        self.check_input(x, lengths)
        if lengths is None and x.shape[0] > 1:
            b, T, _ = x.shape
            return self.forward(x.reshape(1, b * T, -1), (T,) * b).reshape(b, T, -1)
        lengths = _lengths(x, lengths, "packed")
        q, k, v = self.heads(x)
        outs, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=self.causal))
            start += n
        return self.out_proj(merge_heads(torch.cat(outs, dim=2)))


class _Said(logging.Handler):
    """Collects what PyTorch's nested-tensor SDPA logs about why each kernel refused."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        text = record.getMessage().strip()
        if text and not text.endswith("not used because:"):
            self.lines.append(text)


class NestedAttention(VarlenAttention):
    """Nested tensors (jagged layout): projections and ``F.scaled_dot_product_attention`` on the ragged batch."""

    def prepare(self, x, lengths=None):
        """The packed tokens as a ``torch.jagged`` nested tensor ``(batch, j, d)`` (a view: offsets built here)."""
        lengths = _lengths(x, lengths, self.varlen_layout)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=x.device)
        offsets[1:] = torch.as_tensor(lengths, device=x.device).cumsum(0)
        return torch.nested.nested_tensor_from_jagged(x[0], offsets)

    def attend(self, x, lengths, nt):
        q, k, v = (proj(nt).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                   for proj in (self.W_query, self.W_key, self.W_value))  # (b, nh, j, hd)
        said, logger = _Said(), logging.getLogger("torch.nested._internal.sdpa")
        logger.addHandler(said)
        propagate, logger.propagate = logger.propagate, False  # said in the row's reason, not on stderr
        try:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        except RuntimeError as exc:
            reasons = "; ".join(dict.fromkeys(said.lines))
            raise UnavailableError(f"PyTorch's nested-tensor SDPA on {x.device.type}: {str(exc).splitlines()[0]}"
                                   + (f" ({reasons})" if reasons else "")) from exc
        finally:
            logger.removeHandler(said)
            logger.propagate = propagate
        return context.transpose(1, 2).flatten(-2).values().unsqueeze(0)  # (1, tokens, d_out)


class FlexVarlenAttention(VarlenAttention):
    """FlexAttention over the packed sequence with a document ``mask_mod`` (a BlockMask built per batch)."""

    def prepare(self, x, lengths=None):
        """The BlockMask of the document (causal) mask over ``tokens x tokens``."""
        from torch.nn.attention.flex_attention import create_block_mask

        doc = document_ids(_lengths(x, lengths, self.varlen_layout), x.device)
        causal = self.causal

        def document(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        n = doc.shape[0]
        return create_block_mask(document, None, None, n, n, device=x.device)

    def attend(self, x, lengths, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.heads(x)
        return merge_heads(flex_attention(q, k, v, block_mask=block_mask))


def _flex_available(device: torch.device) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:
        return f"FlexAttention not in this torch build ({exc})"
    return None


_COMMON = dict(varlen=True, non_causal=True, dropout=False)
API = "torch.nn.functional.scaled_dot_product_attention"
register("varlen_padded", PaddedAttention, source=f"{API} (padded to the longest, attn_mask = key padding & causal)",
         **_COMMON)
register("varlen_packed", PackedAttention, source=f"{API} (packed, attn_mask = block-diagonal causal document mask)",
         **_COMMON)
register("varlen_loop", LoopAttention, source=f"{API} (is_causal) once per sequence, on slices of the packed batch",
         **_COMMON)
register("varlen_nested", NestedAttention, source=f"{API} on torch.nested jagged tensors (nested_tensor_from_jagged)",
         min_torch="2.4", **_COMMON)
register("varlen_flex", FlexVarlenAttention, source="torch.nn.attention.flex_attention (document mask_mod)",
         backward=("cuda",), min_torch="2.5", probe=_flex_available, **_COMMON)
