"""The results table: one tidy row per sweep cell. Every view (console, report, compare, asv, Ray) reads this.

A row never lies: a cell that did not produce a trustworthy timing has a non-``ok`` ``status`` and
its timing columns are NaN, never zero.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, make_dataclass

import numpy as np
import pandas as pd

from attnbench.errors import RowError

STATUSES = ("ok", "oom", "error", "timeout", "invalid", "skipped")
"""``ok`` timed; ``oom`` out of memory; ``error`` the implementation raised (or its worker died);
``timeout`` exceeded ``--cell-timeout``; ``invalid`` wrong shape or non-finite output (not timed);
``skipped`` an impossible combination (d_model % heads, dtype or backend unavailable here)."""

MODES = ("inference", "forward", "forward+backward", "decode", "train", "generate-cache", "generate-nocache")
"""``inference`` under ``torch.inference_mode``; ``forward`` with autograd recording; ``forward+backward``
also runs the backward pass (gradients cleared between iterations); ``decode`` one new token's step
(under ``torch.inference_mode``) against a KV cache that already holds ``seq_len`` tokens. Block and model scope
(issue 27) add ``train`` (forward, backward and an AdamW step) and, at model scope, ``generate-cache`` /
``generate-nocache`` (a prompt of ``seq_len`` tokens, then ``new_tokens`` greedy tokens with / without the KV cache;
``--mode generate`` asks for both)."""

SCOPES = ("layer", "block", "model")
"""``layer`` the attention module alone (the default); ``block`` it inside a pre-LN transformer block; ``model`` inside
a GPT of the book's chapter-4 layout (:mod:`attnbench.models`)."""

ATTENTION_MODE = {"train": "forward+backward", "generate-cache": "decode", "generate-nocache": "inference"}
"""What the attention inside a block or model does in the block-and-model modes (resolve's rules apply to it)."""

CACHE_STATES = ("warm", "cold")
INPUTS = ("normal", "outliers", "large-logits")
"""Issue 38's ``inputs`` axis: the workload's own draw, 0.1% outliers, or extreme-logit weights (:mod:`attnbench.runner.stress`)."""
"""``cold`` flushes the GPU L2 cache before each timed call (outside the timed region); CPU cells are ``warm``."""

AXES = ("impl", "device", "dtype", "batch", "seq_len", "num_heads", "d_model", "mode", "cache", "num_kv_heads", "window",
        "causal", "positional", "scope", "layers", "vocab", "new_tokens", "inputs", "mask", "page_size", "lengths", "batch_spec")
"""The columns that identify a cell; two runs are compared cell by cell on these."""

INT_AXES = ("batch", "seq_len", "num_heads", "d_model")
"""The axes that take positive integers (sweep ranges such as ``128..2048x2`` apply to them)."""

MODEL_AXES = ("layers", "vocab", "new_tokens")
"""The model's shape (issue 27): blocks, vocabulary and new tokens generated; 0 where the scope has none."""

COLUMNS: dict[str, str] = {
    # identity
    "run_id": "string", "cell_id": "string", "impl": "string", "device": "string", "device_name": "string",
    "dtype": "string", "batch": "int64", "seq_len": "int64", "num_heads": "int64", "d_model": "int64",
    "head_dim": "int64", "mode": "string", "cache": "string", "threads": "int64",
    "num_kv_heads": "int64", "window": "float64", "causal": "bool",  # window NaN = full attention
    # issue 26: the spec's positional fields (RoPE, QK-norm, score scale, softcap) as one text,
    # AttnSpec.positional_text(): "rope_theta=500000;rope_scaling=llama3;qk_norm=head" ("" = none)
    "positional": "string",
    # timing (seconds per call)
    "median_s": "float64", "iqr_s": "float64", "mean_s": "float64", "std_s": "float64", "min_s": "float64",
    "max_s": "float64", "n": "int64", "ci_low_s": "float64", "ci_high_s": "float64", "ci_rel": "float64",
    # the CI above = this run's own CI (ci_within_rel, relative half-width) widened by the between-run term
    "ci_within_rel": "float64", "drift_rel": "float64",
    "calls_per_sample": "int64", "warmup_calls": "int64", "timer": "string", "samples_s": "object",
    # samples_s in groups (one per round and process, sizes in order) and whether they agree
    "sample_groups": "object", "stability": "string",
    # memory (bytes over the pre-cell baseline)
    "peak_bytes": "float64", "peak_reserved_bytes": "float64", "memory_method": "string",
    # KV cache (decode rows): measured from the cache tensors, and 2·b·min(T, window)·num_kv_heads·head_dim·bytes
    "kv_cache_bytes": "float64", "kv_cache_bytes_analytic": "float64",
    # decode bandwidth (decode rows): bytes one step must read (KV cache it attends over + projection weights,
    # measure.flops.decode_bytes), achieved GB/s, the run's measured STREAM-like peak GB/s, and the fraction of it
    "decode_bytes": "float64", "gbytes_per_s": "float64", "peak_gbytes_per_s": "float64", "frac_peak_bw": "float64",
    # work
    "flops": "float64", "flops_counted": "float64", "gflops_per_s": "float64", "peak_gflops_per_s": "float64",
    "frac_peak": "float64",
    # torch.compile
    "compile_s": "float64", "recompiles": "float64",
    # the CPU measuring environment, as found in the measuring process (attnbench.measure.cpu_env)
    "cpu_allocator": "string", "cpu_binding": "string", "cpu_affinity": "string",
    # contention while the cell was timed (attnbench.measure.contention): the share of the machine's CPU time
    # other processes and the hypervisor (steal) took; contended "yes"/"no", or "unknown" where /proc/stat is missing
    "other_cpu_frac": "float64", "steal_frac": "float64", "contended": "string",
    # outcome
    "status": "string", "error": "string", "notes": "string",
    # paired speed-up against the comparison group's baseline (cells that differ only in impl share group_id):
    # baseline time / this time (>1: faster), from per-cycle ratios of interleaved bursts; 1.0 on the baseline's
    # own row; NaN when it could not be paired (notes say why). cycle_s: this member's per-call time in each burst
    # cycle, aligned across the group's members (NaN where it did not run); cycle_groups: sizes of its
    # consecutive groups of cycles (one per round and process), like sample_groups for samples_s
    "group_id": "string", "baseline": "string", "speedup": "float64", "speedup_ci_low": "float64",
    "speedup_ci_high": "float64", "cycle_s": "object", "cycle_groups": "object",
    # issue 30, adjacent pairs (Settings.pairing): per cycle, the baseline's per-call time in the bursts right before
    # and after this member's (geometric mean), aligned with cycle_s; empty on the baseline's row and with cycle pairs
    "pair_base_s": "object",
    # issue 30: the speed-up's between-round SD (log scale) its interval was widened with (pooled over the run's cells,
    # moderated by this cell's own rounds: attnbench.measure.speedup_spread); NaN: not widened (one round, too few cells)
    "speedup_spread_rel": "float64",
    # issue 28: the cell's timeout (NaN: none) and what was predicted before it ran (attnbench.runner.budget):
    # seconds, peak bytes (NaN: not calibrated, far from the memory available) and the bytes available then
    "timeout_s": "float64", "predicted_s": "float64", "predicted_peak_bytes": "float64", "available_bytes": "float64",
    # issue 27, attention in its model: the scope and the model's shape (0 where the scope has none); generation
    # (generate-* rows: prefill = the prompt's forward and the first token, decode = the other new tokens; tokens/s
    # count every batch row; end_to_end = new tokens / the generation's seconds, the book's figure); attention's share
    # of the step's time (forward hooks around the attention modules: median and 10th..90th percentile over steps)
    "scope": "string", "layers": "int64", "vocab": "int64", "new_tokens": "int64",
    "ttft_s": "float64", "prefill_tokens_per_s": "float64", "decode_tokens_per_s": "float64",
    "end_to_end_tokens_per_s": "float64", "attn_share": "float64", "attn_share_low": "float64",
    "attn_share_high": "float64",
    # where and when
    "host": "string", "worker": "string", "started_at": "string", "duration_s": "float64",
    # issue 30: where the run's time went and why sampling stopped (attnbench.runner.phases). cycles: the burst cycles
    # this member ran in (all rounds); stopped_by: per round, target (its figure known within --target-ci) | budget
    # (the ceiling) | ci | max_cycles | max_samples; compile_cache: cold | warm (torch.compile's first call compiled,
    # or only hit the on-disk cache: attnbench.runner.compile_cache); phase_*_s: this member's seconds building (the
    # first call included), warming up, in timed cycles (its share of the group's) and in the memory/FLOP pass
    "cycles": "int64", "stopped_by": "string", "compile_cache": "string", "phase_build_s": "float64",
    "phase_warmup_s": "float64", "phase_timed_s": "float64", "phase_work_s": "float64",
    # issue 38 (attnbench.measure.accuracy): the output's error against the float64 reference (relative max-norm, RMS),
    # the RMS error of the harness's plain math in the same dtype, their ratio; the worst gradient's (forward+backward);
    # error_note: why the error was not measured ("not measured: ..."), or which gradient was worst; the pass's seconds;
    "error_rel": "float64", "error_rms": "float64", "error_base": "float64", "error_ratio": "float64",
    "error_grad_rel": "float64", "error_grad_rms": "float64", "error_grad_base": "float64", "error_grad_ratio": "float64",
    "error_note": "string", "phase_accuracy_s": "float64",
    "error_steps": "int64",  # decode rows: the single-token steps the judged one came after (drift); 0 elsewhere
    "inputs": "string",  # issue 38: normal | outliers | large-logits (attnbench.runner.stress); runs before it: normal
    # --- issue 39 (instruction counts: attnbench.measure.instructions) ---
    # instructions executed per call under callgrind (warm-up excluded, the harness baseline subtracted), the
    # baseline's own per call, calls counted, the count's wall seconds and a counted call's, the vector ISA PyTorch's
    # kernels ran (ATen's capability), callgrind's per-function table (JSON: function -> instructions per call) and
    # the settings the count ran under; NaN / empty in rows that were timed, not counted
    "instructions": "float64", "instructions_baseline": "float64", "instr_calls": "int64", "instr_count_s": "float64",
    "instr_call_s": "float64", "cpu_capability": "string", "instr_functions": "string", "instr_settings": "string",
    # issue 45: the counted loop's repeats in the one process and their spread, (max - min) / median (NaN: not measured)
    "instr_repeats": "int64", "instr_spread": "float64",
    # --- end issue 39 ---
    # --- issue 37 (masks: attnbench.correctness.masks) ---
    # mask: the cell's masks beyond causal/window/softcap ("alibi+prefix:16+document:4+sink"; "" = none);
    # mask_label: the whole mask as one text ("causal+window:64+alibi"); flops_count: which FLOP count "flops" is
    # ("masked": only the query-key pairs the mask keeps; runs before it counted the same way); mask_density: the kept
    # fraction of the T x T pairs
    "mask": "string", "mask_label": "string", "flops_count": "string", "mask_density": "float64",
    # issue 37, paged KV caches (decode rows; implementations/paged.py): page_size, the cell's tokens per page (0: not a
    # paged group); pages in use after the prefill (every sequence's), and the share of their slots left unused (the
    # last pages' tail); NaN on a contiguous cache's row
    "page_size": "int64", "pages": "float64", "page_fragmentation": "float64",
    # --- issue 37: packed variable-length batches and setup cost (attnbench.runner.varlen, attnbench.runner.setup) ---
    # lengths: the cell's length distribution ("" = a rectangular batch of seq_len each; constant | uniform:LO-HI |
    # longtail | bimodal | a file); tokens: the real tokens of the batch (batch x seq_len: equal across distributions);
    # lengths_min/median/max and padding_frac (1 - tokens / (batch x longest)); their flops_count is "real-lengths"
    # (each sequence at its own length); setup_s: median seconds of the implementation's prepare() measured apart
    # (NaN: it has none); setup_policy: per-call (the timed call includes prepare, as a model does once per forward)
    # | once (prepared before timing)
    "lengths": "string", "tokens": "int64", "lengths_min": "int64", "lengths_median": "float64",
    "lengths_max": "int64", "padding_frac": "float64", "setup_s": "float64",
    "setup_policy": "string",
    # --- end issue 37 ---
    # --- issue 49 (roofline: attnbench.measure.roofline) --- min_bytes: the bytes the cell must move at the least (each
    # tensor once; NaN beyond layer scope); intensity = flops / min_bytes; bound: compute | memory, the larger term of
    # attainable_s = max(flops / compute ceiling, min_bytes / bandwidth); headroom = median_s / attainable_s; the
    # machine's cached ceilings (GEMM GFLOP/s in the row's dtype and threads, STREAM GB/s) with their relative
    # uncertainty, and its last-level cache; plausibility: implausible (faster than a ceiling beyond its uncertainty)
    # | plausible | "" (not judged)
    "min_bytes": "float64", "intensity": "float64", "bound": "string", "attainable_s": "float64", "headroom": "float64",
    "ceiling_gflops_per_s": "float64", "ceiling_gflops_rel": "float64", "ceiling_gbytes_per_s": "float64",
    "ceiling_gbytes_rel": "float64", "ceiling_cache_bytes": "float64", "plausibility": "string",
    # --- end issue 49 ---
    # issue 48 (attnbench.runner.properties): bitwise | within k ulps | differs by X, at the row's shape and threads;
    # "" / None: not measured (decode, variable-length, compiled or costly cells)
    "deterministic": "string", "batch_invariant": "string",
    # issue 48, the mixed serving step (attnbench.runner.mixed): batch_spec, the step's requests ("2q1k_32q1kv2k";
    # "" = not a mixed step); tokens = its new tokens; prefill_s / decode_s: the median seconds of the step's prefill
    # part (requests from an empty cache) and decode part (requests over a cache: decodes and chunks), each one call
    # (attnbench.runner.mixed_workload; NaN: the spec has no such part); their flops_count is "real-tokens"
    "batch_spec": "string", "prefill_s": "float64", "decode_s": "float64",
}
"""Column name -> pandas dtype. ``samples_s`` holds the raw per-call samples (list of float seconds);
``sample_groups`` the sizes of its consecutive groups, one per round and measuring process (the CI is
hierarchical over them); ``stability`` is ``unstable`` when the groups disagree or the samples are
bimodal (both modes are in ``notes``), else ``stable``. ``contended`` is a string, not a bool, because it has a
third value: ``unknown`` where the measure is unavailable (no ``/proc/stat``); it is empty for failed cells and
for runs older than the column. A bool would have to say "no" there, and a row never lies."""


@dataclass(frozen=True)
class Cell:
    """One point of a sweep."""

    impl: str
    device: str = "cpu"
    dtype: str = "float32"
    batch: int = 1
    seq_len: int = 128
    num_heads: int = 4
    d_model: int = 256
    mode: str = "forward"
    cache: str = "warm"
    num_kv_heads: int | None = None  # None (or num_heads): multi-head attention
    window: int | None = None  # None: full attention
    causal: bool = True
    positional: str = ""  # RoPE / QK-norm / scale / softcap (AttnSpec.positional_text); "" = none
    scope: str = "layer"  # layer | block | model (issue 27)
    layers: int = 0  # model scope: blocks (0 elsewhere)
    vocab: int = 0  # model scope: vocabulary size (0 elsewhere)
    new_tokens: int = 0  # generate modes: tokens generated after the prompt of seq_len (0 elsewhere)
    inputs: str = "normal"  # issue 38: normal | outliers | large-logits (attnbench.runner.stress)
    mask: str = ""  # issue 37: alibi / prefix:N / document:D / sink (attnbench.correctness.masks.extra_text); "" = none
    page_size: int = 0  # issue 37: decode through a paged KV cache of pages of this many tokens (0: not paged)
    lengths: str = ""  # issue 37: a length distribution (attnbench.runner.varlen); "" = every sequence seq_len
    batch_spec: str = ""  # issue 48: a mixed serving step (attnbench.runner.mixed); "" = not one

    def __post_init__(self) -> None:  # one spelling per cell: MHA is num_kv_heads None, full attention window None
        if self.num_kv_heads is not None and self.num_kv_heads == self.num_heads:
            object.__setattr__(self, "num_kv_heads", None)
        if self.window is not None and self.window != self.window:  # NaN read back from a row
            object.__setattr__(self, "window", None)
        for name in ("num_kv_heads", "window"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        object.__setattr__(self, "causal", bool(self.causal))
        if self.positional is None or self.positional != self.positional:  # None / NaN read back from a row
            object.__setattr__(self, "positional", "")
        object.__setattr__(self, "scope", str(self.scope or "layer"))
        object.__setattr__(self, "inputs", str(self.inputs or "normal") if self.inputs == self.inputs else "normal")
        for name in (*MODEL_AXES, "page_size"):
            object.__setattr__(self, name, int(getattr(self, name) or 0))
        if self.mask is None or self.mask != self.mask:  # None / NaN read back from a row
            object.__setattr__(self, "mask", "")
        object.__setattr__(self, "lengths", str(self.lengths) if self.lengths and self.lengths == self.lengths else "")
        object.__setattr__(self, "batch_spec", str(self.batch_spec) if self.batch_spec and self.batch_spec == self.batch_spec
                           else "")

    @property
    def attention_mode(self) -> str:
        """What the attention inside does: the cell's mode, or for a block or model mode :data:`ATTENTION_MODE`'s."""
        return ATTENTION_MODE.get(self.mode, self.mode)

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values (``num_heads`` for multi-head attention)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        """``d_model // num_heads`` (0 when not divisible; such a cell is skipped)."""
        return self.d_model // self.num_heads if self.num_heads and self.d_model % self.num_heads == 0 else 0

    @property
    def cell_id(self) -> str:
        """A readable key that identifies the cell across runs (for ``--resume`` and ``compare``)."""
        return f"{self.impl}|{self.group_id}"

    @property
    def group_id(self) -> str:
        """The :attr:`cell_id` without the implementation: the key of the cell's comparison group (the cells
        that differ only in ``impl``, timed together in alternation and paired for speed-ups)."""
        variant = ((f"|kv{self.num_kv_heads}" if self.num_kv_heads is not None else "")
                   + (f"|w{self.window}" if self.window is not None else "") + ("" if self.causal else "|noncausal")
                   + (f"|{self.positional}" if self.positional else ""))
        if self.scope != "layer":  # layer cells keep the keys they had before scopes existed
            variant += f"|{self.scope}" + (f"|L{self.layers}|V{self.vocab}" if self.scope == "model" else "")
            variant += f"|M{self.new_tokens}" if self.new_tokens else ""
        variant += f"|inputs={self.inputs}" if self.inputs != "normal" else ""  # normal cells keep their keys
        variant += f"|mask={self.mask}" if self.mask else ""  # issue 37; cells without one keep their keys
        variant += f"|page{self.page_size}" if self.page_size else ""  # issue 37: the paged groups
        variant += f"|lengths={self.lengths}" if self.lengths else ""  # issue 37: rectangular cells keep their keys
        variant += f"|spec={self.batch_spec}" if self.batch_spec else ""  # issue 48: the mixed serving step
        return (f"{self.device}|{self.dtype}|b{self.batch}|T{self.seq_len}|h{self.num_heads}"
                f"|d{self.d_model}|{self.mode}|{self.cache}{variant}")

    def as_dict(self) -> dict:
        """The axis values by column name."""
        return asdict(self)


SCHEMA_VERSION = 11  # 3: issue 30 (cycles, stopped_by, compile_cache, phase_*_s); 4: issue 27 (scope, model shape,
# generation, attention share), issue 26 (positional), issue 28 (timeout_s, predicted_*, available_bytes);
# 5: issue 30 (pair_base_s: adjacent pairs; speedup_spread_rel: the speed-ups' between-round term);
# 6: issue 38 (error_*: accuracy against the float64 reference; phase_accuracy_s; inputs) and issue 39 (instructions,
#    instructions_baseline, instr_*, cpu_capability: instruction counts);
# 7: issue 37 (mask, mask_label, flops_count, mask_density; page_size, pages, page_fragmentation; lengths, tokens,
#    lengths_*, padding_frac, setup_s, setup_policy); 8: issue 45 (instr_repeats, instr_spread: an instruction count's noise)
# 9: issue 49 (min_bytes, intensity, bound, attainable_s, headroom, ceiling_*, plausibility: the roofline)
# 10: issue 48 (deterministic, batch_invariant); 11: issue 48 (batch_spec, prefill_s, decode_s: the mixed step)
"""Version of the row format, recorded in every run's ``meta.json`` (``schema_version``; runs before it have none
and read as version 1). Raise it when a column is added, and teach :func:`fill_added_columns` its default."""

_MISSING = {"float64": float("nan"), "int64": 0, "string": None, "bool": True, "object": None}


def _type_error(name: str, kind: str, value) -> str | None:
    """Why ``value`` cannot be stored in the column ``name`` of pandas dtype ``kind``, or None when it can."""
    if value is None:
        return None
    if kind == "float64":
        ok = isinstance(value, float | int | np.floating | np.integer) and not isinstance(value, bool | np.bool_)
    elif kind == "int64":
        ok = (isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)) or (
            isinstance(value, float | np.floating) and float(value).is_integer())
    elif kind == "string":
        ok = isinstance(value, str) or value is pd.NA or (isinstance(value, float) and value != value)
    elif kind == "bool":
        ok = isinstance(value, bool | np.bool_)
    else:  # object: a list of numbers
        ok = isinstance(value, list | tuple | np.ndarray)
    return None if ok else f"column {name!r} holds {kind} values, got {type(value).__name__} {value!r:.80}"


def check_row(row: dict) -> dict:
    """``row`` if every key is a column of :data:`COLUMNS` and every value fits its column's type; else a
    :class:`~attnbench.errors.RowError` naming the key (a misspelt key would otherwise be dropped silently when
    the table is built, and its value lost)."""
    unknown = [k for k in row if k not in COLUMNS]
    if unknown:
        hints = {k: difflib.get_close_matches(k, COLUMNS, n=1) for k in unknown}
        said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise RowError(f"unknown result column {said}: every key of a row must be one of "
                       "attnbench.results.schema.COLUMNS (add a new column there)")
    for name, value in row.items():
        problem = _type_error(name, COLUMNS[name], value)
        if problem:
            raise RowError(f"bad result row: {problem}")
    return row


Row = make_dataclass("Row", [(name, object, field(default_factory=lambda kind=kind: _MISSING[kind]))
                             for name, kind in COLUMNS.items()])
Row.__doc__ = """One results row: a field per column of :data:`COLUMNS` (pandas dtype there), missing values as
NaN (numbers), None (text, samples) or 0 (counts). Rows travel as dicts (:meth:`Row.as_dict`); building a Row
from a dict (``Row.of(d)``) checks it with :func:`check_row`."""
Row.of = classmethod(lambda cls, d: cls(**check_row(dict(d))))
Row.as_dict = lambda self: asdict(self)


def display_name(impl: str) -> str:
    """The name rows show in ``impl`` for an implementation as given to ``--impl`` (``NAME`` of ``NAME=target``)."""
    from attnbench.plugins.loading import split_display_name

    return split_display_name(impl)[0] or impl


def mask_label(cell: Cell) -> str:
    """The cell's whole mask as one text, ``causal+window:64+softcap:30+alibi`` (:func:`attnbench.correctness.masks.label`)."""
    from attnbench.correctness.masks import label

    softcap = next((float(p.split("=", 1)[1]) for p in str(cell.positional or "").split(";")
                    if p.startswith("softcap=")), None)
    return label(cell.causal, cell.window, softcap, cell.mask)


def empty_row(cell: Cell, run_id: str = "") -> dict:
    """A row for ``cell`` with every column present and measurement columns NaN/empty (status ``error`` until the
    cell says otherwise)."""
    row = Row(**cell.as_dict()).as_dict()
    row.update(num_kv_heads=cell.kv_heads, window=float("nan") if cell.window is None else cell.window)
    row["impl"] = display_name(cell.impl)  # NAME=target: tables and figures show NAME
    row["mask_label"] = mask_label(cell)  # issue 37: the whole mask as one text
    row.update(run_id=run_id, cell_id=cell.cell_id, group_id=cell.group_id, head_dim=cell.head_dim, n=0, calls_per_sample=0,
               warmup_calls=0, threads=0, status="error", error="", notes="")
    return row


KEPT_ON_FAILURE = frozenset({
    "run_id", "cell_id", "group_id", "impl", "device", "device_name", "dtype", "batch", "seq_len", "num_heads",
    "d_model", "head_dim", "mode", "cache", "threads", "num_kv_heads", "window", "causal", "positional", "baseline",
    "status", "error", "notes", "host", "worker", "started_at", "duration_s", "cpu_allocator", "cpu_binding",
    "cpu_affinity", "scope", "layers", "vocab", "new_tokens", "inputs", "mask", "mask_label", "page_size",
    "lengths", "tokens", "lengths_min", "lengths_median", "lengths_max", "padding_frac", "setup_policy",  # issue 37
    "batch_spec",  # issue 48
    "phase_build_s", "phase_warmup_s", "phase_timed_s", "phase_work_s",  # issue 30: the run's time, spent either way
    "phase_accuracy_s",  # issue 38: the accuracy pass's time, spent either way
    "timeout_s", "predicted_s", "predicted_peak_bytes", "available_bytes"})  # issue 28: why it was skipped or timed out
"""What a row that is not ``ok`` keeps: what the cell is, what happened, and where and when it ran. Every other
column (any measurement, including columns added later) goes back to missing: a failed cell never reports one."""


def clear_measurements(row: dict) -> dict:
    """``row`` (not ``ok``), in place, with every column outside :data:`KEPT_ON_FAILURE` missing (NaN, 0, no samples)."""
    for name, kind in COLUMNS.items():
        if name not in KEPT_ON_FAILURE:
            row[name] = [] if kind == "object" else _MISSING[kind]
    return row


def failed_row(cell: Cell, run_id: str, status: str, error: str, **where) -> dict:
    """The row of a cell that did not produce a timing: ``status`` (not ``ok``) and ``error``, every measurement
    column missing, plus where it ran (``host``, ``worker``, ``cpu_*``, ``started_at``, ``duration_s``, ...).
    The one builder of such rows for every executor (a worker that died, a timeout, a Ray failure)."""
    if status not in STATUSES or status == "ok":
        raise ValueError(f"failed_row needs a failure status, got {status!r}")
    row = empty_row(cell, run_id)
    row.update(check_row(where), status=status, error=error)
    return row


REQUIRED_COLUMNS = ("cell_id", "impl", "device", "dtype", "batch", "seq_len", "num_heads", "d_model", "mode", "status",
                    "median_s")
"""What every results table of any version has; any other column an older table lacks is filled in."""


def fill_added_columns(df):
    """``df`` (a results DataFrame) with the columns an older run lacks filled in, in place: MHA (``num_kv_heads``
    = ``num_heads``), full causal attention, and every other missing column at its missing value (NaN, None,
    0). ``df.attrs["filled_columns"]`` names what was filled (empty for a current table)."""
    filled = [name for name in COLUMNS if name not in df.columns and name not in REQUIRED_COLUMNS]
    for name in filled:
        kind = COLUMNS[name]
        if name == "num_kv_heads" and "num_heads" in df.columns:
            df[name] = df["num_heads"]
        elif name == "group_id" and "cell_id" in df.columns:  # runs before comparison groups: the same key
            df[name] = df["cell_id"].map(lambda c: str(c).split("|", 1)[-1])
        elif name == "scope":  # runs before scopes measured the attention layer alone
            df[name] = "layer"
        elif name == "inputs":  # runs before issue 38 drew normal inputs only
            df[name] = "normal"
        elif name == "mask":  # runs before issue 37 had no masks beyond causal / window / softcap
            df[name] = ""
        elif name == "flops_count" and "flops" in df.columns:  # they counted the pairs the mask keeps too
            df[name] = "masked"
        elif name in ("lengths", "setup_policy", "batch_spec"):  # runs before issue 37 / 48: rectangles, no prepare()
            df[name] = ""
        elif kind == "object":
            df[name] = pd.Series([[] for _ in range(len(df))], index=df.index, dtype=object)
        else:
            df[name] = _MISSING[kind]
    df.attrs["filled_columns"] = filled
    return df


def normalise_row(row: dict) -> dict:
    """``row`` with every missing float measurement as NaN (JSON has no NaN: a worker's row writes None).

    The one place a row read back from outside the process (a worker's JSON) gets its missing values
    back, so merging rounds and statistics never meet None.
    """
    return {k: (float("nan") if v is None and COLUMNS.get(k) == "float64" else v) for k, v in row.items()}
