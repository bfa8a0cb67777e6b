"""The results table: one tidy row per sweep cell. Every view (console, report, compare, asv, Ray) reads this.

A row never lies: a cell that did not produce a trustworthy timing has a non-``ok`` ``status`` and
its timing columns are NaN, never zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

STATUSES = ("ok", "oom", "error", "timeout", "invalid", "skipped")
"""``ok`` timed; ``oom`` out of memory; ``error`` the implementation raised (or its worker died);
``timeout`` exceeded ``--cell-timeout``; ``invalid`` wrong shape or non-finite output (not timed);
``skipped`` an impossible combination (d_model % heads, dtype or backend unavailable here)."""

MODES = ("inference", "forward", "forward+backward", "decode")
"""``inference`` under ``torch.inference_mode``; ``forward`` with autograd recording; ``forward+backward``
also runs the backward pass (gradients cleared between iterations); ``decode`` one new token's step
(under ``torch.inference_mode``) against a KV cache that already holds ``seq_len`` tokens."""

CACHE_STATES = ("warm", "cold")
"""``cold`` flushes the GPU L2 cache before each timed call (outside the timed region); CPU cells are ``warm``."""

AXES = ("impl", "device", "dtype", "batch", "seq_len", "num_heads", "d_model", "mode", "cache", "num_kv_heads", "window",
        "causal")
"""The columns that identify a cell; two runs are compared cell by cell on these."""

INT_AXES = ("batch", "seq_len", "num_heads", "d_model")
"""The axes that take positive integers (sweep ranges such as ``128..2048x2`` apply to them)."""

COLUMNS: dict[str, str] = {
    # identity
    "run_id": "string", "cell_id": "string", "impl": "string", "device": "string", "device_name": "string",
    "dtype": "string", "batch": "int64", "seq_len": "int64", "num_heads": "int64", "d_model": "int64",
    "head_dim": "int64", "mode": "string", "cache": "string", "threads": "int64",
    "num_kv_heads": "int64", "window": "float64", "causal": "bool",  # window NaN = full attention
    # timing (seconds per call)
    "median_s": "float64", "iqr_s": "float64", "mean_s": "float64", "std_s": "float64", "min_s": "float64",
    "max_s": "float64", "n": "int64", "ci_low_s": "float64", "ci_high_s": "float64", "ci_rel": "float64",
    # the CI above = this run's own CI (ci_within_rel, relative half-width) widened by the between-run term
    "ci_within_rel": "float64", "drift_rel": "float64",
    "calls_per_sample": "int64", "warmup_calls": "int64", "timer": "string", "samples_s": "object",
    # samples_s in groups (one per round and process, sizes in order) and whether they agree
    "sample_groups": "object", "stability": "string",
    # paired speed-up within the comparison group (cells that differ only in impl, timed interleaved):
    # group_id = cell_id without the impl part; speedup = baseline time / this time (>1 faster), 1.0 on the
    # baseline row, NaN when it could not be paired (notes say why), with its paired 95% CI
    "group_id": "string", "baseline": "string", "speedup": "float64", "speedup_ci_low": "float64",
    "speedup_ci_high": "float64",
    # per-cycle per-call times aligned across the group's members, and the cycle-group sizes per round/process
    "cycle_s": "object", "cycle_groups": "object",
    # memory (bytes over the pre-cell baseline)
    "peak_bytes": "float64", "peak_reserved_bytes": "float64", "memory_method": "string",
    # KV cache (decode rows): measured from the cache tensors, and 2·b·min(T, window)·num_kv_heads·head_dim·bytes
    "kv_cache_bytes": "float64", "kv_cache_bytes_analytic": "float64",
    # work
    "flops": "float64", "flops_counted": "float64", "gflops_per_s": "float64", "peak_gflops_per_s": "float64",
    "frac_peak": "float64",
    # torch.compile
    "compile_s": "float64", "recompiles": "float64",
    # the CPU measuring environment, as found in the measuring process (attnbench.measure.cpu_env)
    "cpu_allocator": "string", "cpu_binding": "string", "cpu_affinity": "string",
    # outcome
    "status": "string", "error": "string", "notes": "string",
    # where and when
    "host": "string", "worker": "string", "started_at": "string", "duration_s": "float64",
}
"""Column name -> pandas dtype. ``samples_s`` holds the raw per-call samples (list of float seconds);
``sample_groups`` the sizes of its consecutive groups, one per round and measuring process (the CI is
hierarchical over them); ``stability`` is ``unstable`` when the groups disagree or the samples are
bimodal (both modes are in ``notes``), else ``stable``."""


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
        variant = ((f"|kv{self.num_kv_heads}" if self.num_kv_heads is not None else "")
                   + (f"|w{self.window}" if self.window is not None else "") + ("" if self.causal else "|noncausal"))
        return (f"{self.impl}|{self.device}|{self.dtype}|b{self.batch}|T{self.seq_len}|h{self.num_heads}"
                f"|d{self.d_model}|{self.mode}|{self.cache}{variant}")

    def as_dict(self) -> dict:
        """The axis values by column name."""
        return asdict(self)


def empty_row(cell: Cell, run_id: str = "") -> dict:
    """A row for ``cell`` with every column present and measurement columns NaN/empty."""
    row: dict = {}
    for name, kind in COLUMNS.items():
        row[name] = float("nan") if kind == "float64" else (None if kind in ("string", "object") else 0)
    row.update(cell.as_dict())
    row.update(num_kv_heads=cell.kv_heads, window=float("nan") if cell.window is None else cell.window)
    from attnbench.plugins.loading import split_display_name

    row["impl"] = split_display_name(cell.impl)[0] or cell.impl  # NAME=target: tables and figures show NAME
    row.update(run_id=run_id, cell_id=cell.cell_id, head_dim=cell.head_dim, n=0, calls_per_sample=0,
               warmup_calls=0, threads=0, status="error", error="", notes="")
    return row


ADDED_COLUMNS = ("num_kv_heads", "window", "causal", "kv_cache_bytes", "kv_cache_bytes_analytic", "group_id", "baseline",
                 "speedup", "speedup_ci_low", "speedup_ci_high", "cycle_s", "cycle_groups")
"""Columns newer than the first results format: filled by :func:`fill_added_columns` in older tables."""


def fill_added_columns(df):
    """``df`` (a results DataFrame) with the columns older runs lack filled in: MHA, full, causal attention."""
    if "num_kv_heads" not in df.columns and "num_heads" in df.columns:
        df["num_kv_heads"] = df["num_heads"]
    if "window" not in df.columns:
        df["window"] = float("nan")
    if "causal" not in df.columns:
        df["causal"] = True
    for name in ("kv_cache_bytes", "kv_cache_bytes_analytic", "ci_within_rel", "drift_rel", "speedup", "speedup_ci_low",
                 "speedup_ci_high"):
        if name not in df.columns:
            df[name] = float("nan")
    for name in ("group_id", "baseline", "cycle_s", "cycle_groups"):  # runs before paired speed-ups: none
        if name not in df.columns:
            df[name] = None
    return df


def normalise_row(row: dict) -> dict:
    """``row`` with every missing float measurement as NaN (JSON has no NaN: a worker's row writes None).

    The one place a row read back from outside the process (a worker's JSON) gets its missing values
    back, so merging rounds and statistics never meet None.
    """
    return {k: (float("nan") if v is None and COLUMNS.get(k) == "float64" else v) for k, v in row.items()}
