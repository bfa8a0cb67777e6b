"""``attnbench run``: the main job. Flags, a TOML sweep file or a preset in; results, summary and report out."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
import time
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from attnbench.cli.app import _split, cli, console, err_console
from attnbench.cli.closing import FAILED, first_failed
from attnbench.cli.grouped import grouped
from attnbench.results import accuracy as accuracy_view
from attnbench.results import setup_view
from attnbench.results.quality import NOISY_CI_REL, flag_counts
from attnbench.results.schema import STATUSES
from attnbench.results.text import fmt_bytes, fmt_speedup, fmt_time, short_names
from attnbench.runner import interrupts

SHARED = {"device": "", "dtype": "", "mode": "", "b": "b=", "T": "T=", "h": "h=", "d": "d="}
"""Columns said once in the title when every row has the same value (so that the table fits 80-100 columns)."""
KEEP_WHOLE = ("impl", "median", "±CI", "flag")
"""Columns never cut: a name or an interval cut to ``s…`` says nothing (the others wrap when the terminal is narrow)."""


def summary_table(df, title: str, failing: dict | None = None, width: int | None = None) -> Table:
    """Ok cells with median ± CI, memory and throughput; then one line per failed status. Columns whose value is the
    same on every row are said once in the title, so that the table fits a terminal of 80-100 columns. A plug-in
    given as ``PATH:Class`` is shown by its shortest distinct tail (:func:`short_names`; ``failing`` keeps full names)."""
    df, failing = _shortened(df, failing or {})
    # kv heads, window and causality only when the run has variants; the KV cache only for decode runs
    positional = df["positional"].fillna("").astype(str) if "positional" in df else pd.Series("", index=df.index)
    variants = bool(((df.num_kv_heads != df.num_heads) | df.window.notna() | ~df.causal.astype(bool)
                     | (positional != "") | (df.get("mask", pd.Series("", index=df.index)).fillna("") != "")).any())
    decode = bool((df["mode"] == "decode").any())
    stressed = "inputs" in df and bool((df["inputs"].fillna("normal") != "normal").any())  # issue 38
    paged = "page_size" in df and bool((pd.to_numeric(df["page_size"], errors="coerce").fillna(0) > 0).any())
    varlen, setup = setup_view.has_lengths(df), setup_view.has_setup(df)  # issue 37
    cols = ["impl", "device", "dtype"] + (["inputs"] if stressed else []) + ["mode", "b", "T", "h", "d"] \
        + (["kv", "window"] if variants else []) + (["page"] if paged else []) + (["lengths"] if varlen else [])
    # paired speed-ups (comparison groups timed interleaved) when the run has them
    paired = "speedup" in df and bool(np.isfinite(pd.to_numeric(df["speedup"], errors="coerce")).any())
    bases = sorted({str(b) for b in df["baseline"].dropna() if str(b)}) if paired and "baseline" in df else []
    sp_col = f"speed-up vs {bases[0]} (95% CI)" if len(bases) == 1 else "speed-up (95% CI)"
    errors = accuracy_view.error_columns(df)  # issue 38: the error against the float64 reference and its ratio
    cols += ["median", "±CI"] + (setup_view.SETUP_COLUMNS if setup else []) + ([sp_col] if paired else []) + errors \
        + ["peak mem"] \
        + (["KV cache", "GB/s", "% BW"] if decode else [])
    scoped, gen_cols = _model_columns(df)
    cols[cols.index("mode") + 1:cols.index("mode") + 1] = ["scope"] if scoped else []
    cols += gen_cols + ["GFLOP/s", "% peak", "flag"]
    ok = df[df.status == "ok"].sort_values(["mode", "dtype", "device", "batch", "seq_len"] + (["lengths"] if varlen else [])
                                           + ["median_s"])
    shape = dict(positional=positional, variants=variants, decode=decode, stressed=stressed, paired=paired, paged=paged,
                 varlen=varlen, setup=setup,
                 named_bases=len(bases) > 1, errors=errors, scoped=scoped, gen_cols=gen_cols, failing=failing or {})
    rows = [dict(zip(cols, _row_values(r, shape), strict=True)) for r in ok.itertuples()]
    shared = [c for c in SHARED if rows and len({row[c] for row in rows}) == 1]
    if shared:
        title += "  (" + " ".join(SHARED[c] + rows[0][c] for c in shared) + ")"
    shown = [c for c in cols if c not in shared and not (c == "flag" and rows and not any(row["flag"] for row in rows))]
    table, left_out = _table(title, shown, rows, sp_col), []
    for col in [c for c in FIT_DROP_ORDER + errors if c in shown] if width else []:
        if _fits(table, width):
            break
        left_out.append(col)
        table = _table(title, [c for c in shown if c not in left_out], rows, sp_col)
    if left_out:
        table.caption = f"left out to fit {width} columns: {', '.join(left_out)} (a wider terminal or the report shows them)"
    return table


FIT_DROP_ORDER = ["% peak", "GFLOP/s", "% BW", "GB/s", "attn share (p10–p90)", "peak mem", "KV cache", "attn alone",
                  "attn + setup"]
"""What a narrow terminal loses first (the run's error columns after these); never the name, the time, its interval,
the speed-up or the flag."""


def _fits(table: Table, width: int) -> bool:
    """Whether ``table`` prints at ``width`` with no cell cut to ``…`` and no column squeezed to nothing."""
    probe = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    probe.print(table)
    text = probe.export_text()
    return "…" not in text and "┳┳" not in text and "┳━━┳" not in text


def _table(title: str, shown: list[str], rows: list[dict], sp_col: str) -> Table:
    table = Table(title=title)
    for col in shown:
        table.add_column(col, justify="right" if col not in ("impl", "device", "dtype", "inputs", "mode", "flag")
                         else "left", no_wrap=col in KEEP_WHOLE)
    for row in rows:
        table.add_row(*(row[c] for c in shown))
    return table


def _shortened(df, failing: dict) -> tuple[pd.DataFrame, dict]:
    """``df`` and ``failing`` with plug-in file names shortened for the console (the results keep the full names).
    ``failing`` is keyed as ``--impl`` named them: ``NAME=path.py:Class`` rows are called ``NAME``, so it is too."""
    failing = {_row_name(k): v for k, v in failing.items()}
    names = short_names(list(df["impl"].astype(str)) + [str(b) for b in df.get("baseline", pd.Series()).dropna()])
    if all(k == v for k, v in names.items()):
        return df, failing
    df = df.copy()
    df["impl"] = df["impl"].astype(str).map(names)
    if "baseline" in df:
        df["baseline"] = df["baseline"].map(lambda b: names.get(str(b), b) if isinstance(b, str) else b)
    return df, {names.get(k, k): v for k, v in failing.items()}


def _row_name(name: str) -> str:
    """The ``impl`` a row of ``--impl name`` carries: the short name of ``NAME=path.py:Class``, else ``name``."""
    from attnbench.plugins import split_display_name

    display, target = split_display_name(name)
    return display if display is not None else target


def _row_values(r, shape: dict) -> list[str]:
    """One ok row's cells in :func:`summary_table`'s column order (``shape``: which optional columns it has)."""
    half = (r.ci_high_s - r.ci_low_s) / 2
    positional = shape["positional"][r.Index]
    window = ("full" if r.window != r.window else str(int(r.window))) + ("" if r.causal else " non-causal")
    window += f" {positional}" if positional else ""  # RoPE / QK-norm / scale / softcap
    window += f" {r.mask}" if isinstance(getattr(r, "mask", ""), str) and r.mask else ""  # issue 37
    kv = [fmt_bytes(r.kv_cache_bytes), f"{r.gbytes_per_s:.1f}", _pct_of_peak(r.frac_peak_bw)] if shape["decode"] else []
    if shape["decode"] and r.mode != "decode":
        kv = ["-", "-", "-"]
    return [r.impl, r.device, r.dtype, *([r.inputs] if shape["stressed"] else []), r.mode,
            *([_scope_text(r)] if shape["scoped"] else []), str(r.batch), str(r.seq_len), str(r.num_heads),
            str(r.d_model), *([str(r.num_kv_heads), window] if shape["variants"] else []),
            *([str(int(r.page_size)) if r.page_size else "-"] if shape["paged"] else []),
            *([setup_view.lengths_text(r)] if shape["varlen"] else []), fmt_time(r.median_s),
            f"{100 * half / r.median_s:.1f}%", *(setup_view.setup_cells(r) if shape["setup"] else []),
            *([_speedup_text(r, shape["named_bases"])] if shape["paired"] else []),
            *([accuracy_view.error_text(r)] if shape["errors"] else []), fmt_bytes(r.peak_bytes), *kv,
            *_model_cells(r, shape["gen_cols"]), f"{r.gflops_per_s:.1f}", _pct_of_peak(r.frac_peak),
            ", ".join(filter(None, ["fails check" if r.impl in shape["failing"] else "", _flags(r)]))]


GENERATION_COLUMNS = ["TTFT", "prefill tok/s", "decode tok/s", "end-to-end tok/s", "KV cache (all layers)"]


def _model_columns(df) -> tuple[bool, list[str]]:
    """Whether the run has block or model rows (a scope column), and the columns of generation and attention's share
    (issue 27)."""
    scopes = df["scope"] if "scope" in df else pd.Series(["layer"] * len(df))
    scoped = bool((scopes.fillna("layer") != "layer").any())
    generating = bool(df["mode"].astype(str).str.startswith("generate").any())
    shared = "attn_share" in df and bool(np.isfinite(pd.to_numeric(df["attn_share"], errors="coerce")).any())
    return scoped, (GENERATION_COLUMNS if generating else []) + (["attn share (p10–p90)"] if shared else [])


def _scope_text(r) -> str:
    scope = str(getattr(r, "scope", "layer") or "layer")
    return f"model L{r.layers} V{r.vocab}" + (f" +{r.new_tokens}" if r.new_tokens else "") if scope == "model" else scope


def _model_cells(r, cols: list[str]) -> list[str]:
    """A row's generation and attention-share cells ("-" where the row has none)."""
    def rate(v):
        return "-" if v is None or v != v else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"

    out = []
    if "TTFT" in cols:
        gen = str(r.mode).startswith("generate")
        out += [fmt_time(r.ttft_s) if gen else "-", rate(r.prefill_tokens_per_s), rate(r.decode_tokens_per_s),
                rate(r.end_to_end_tokens_per_s), fmt_bytes(r.kv_cache_bytes) if r.mode == "generate-cache" else "-"]
    if cols and cols[-1].startswith("attn share"):
        share = getattr(r, "attn_share", float("nan"))
        out.append("-" if share != share else
                   f"{100 * share:.0f}% ({100 * r.attn_share_low:.0f}–{100 * r.attn_share_high:.0f}%)")
    return out


def _print_model_views(df) -> None:
    """Issue 27: the layer-vs-block-vs-model speed-ups and the KV cache's end-to-end factor, when the run has them."""
    from attnbench.models.views import cache_factors, scope_sentences

    for line in scope_sentences(df):
        console.print(f"  speed-up by scope: {line}", markup=False)
    for _, r in cache_factors(df).iterrows():
        console.print(f"  KV cache: {r['impl']} generates {r['factor']:.2f}x the tokens/s with the cache "
                      f"({r['generate-nocache']:.1f} -> {r['generate-cache']:.1f} tokens/s end to end, "
                      f"prompt {r['seq_len']}, {r['new_tokens']} new tokens)", markup=False)



def _pct_of_peak(frac: float) -> str:
    """A fraction of peak as a percentage; above 100% marked ``*`` (explained under the table)."""
    return f"{100 * frac:.0f}%" + ("*" if frac > 1 else "")


def _print_over_peak(df) -> None:
    """Say why a fraction of peak reads above 100%: the peak was measured too low (a busy moment)."""
    over = df[(df.status == "ok") & (pd.to_numeric(df.frac_peak, errors="coerce") > 1)]
    if len(over):
        console.print(f"note: * {len(over)} cell(s) ran faster than the peak GEMM measured in this run (the best of "
                      "several tries, measured again when exceeded): the machine was busy while the peak was "
                      "measured, so their % peak overstates the truth", markup=False)
    over_bw = df[(df.status == "ok") & (pd.to_numeric(df.frac_peak_bw, errors="coerce") > 1)]
    if len(over_bw):
        console.print(f"note: * {len(over_bw)} decode cell(s) read faster than the peak bandwidth measured in this "
                      "run (the best of several tries): the KV cache fit in a cache, or the peak met a busy moment; "
                      "their % BW overstates the share of memory bandwidth", markup=False)
    from attnbench.measure.roofline import implausible_rows, implausible_text

    for _, r in implausible_rows(df).iterrows():  # issue 49: faster than a measured ceiling beyond its uncertainty
        console.print(f"warning: implausible row {implausible_text(r)}", markup=False, soft_wrap=True)


def _flags(r) -> str:
    """The flag column: ``unstable`` (two modes), ``contended`` (others took the CPUs while it was timed),
    ``implausible`` (faster than a measured ceiling: :mod:`attnbench.measure.roofline`)."""
    flags = ["unstable"] if str(getattr(r, "stability", "")) == "unstable" else []
    flags += ["contended"] if str(getattr(r, "contended", "")) == "yes" else []
    flags += ["implausible"] if str(getattr(r, "plausibility", "")) == "implausible" else []  # issue 49
    return ", ".join(flags)


def _speedup_text(r, name_baseline: bool) -> str:
    """A row's paired speed-up for the console: ``baseline`` on the baseline's row, the CI, unstable said;
    ``name_baseline``: the run has several baselines, so each speed-up names its own."""
    baseline = getattr(r, "baseline", None)
    baseline = "" if baseline is None or (not isinstance(baseline, str) and pd.isna(baseline)) else str(baseline)
    if baseline == r.impl:
        return "baseline"
    text = fmt_speedup(r.speedup, r.speedup_ci_low, r.speedup_ci_high, str(getattr(r, "stability", "")) == "unstable")
    if text == "–":
        return "– (not paired: see notes)" if baseline else text
    return f"{text} vs {baseline}" if name_baseline and baseline else text


PRESETS = tuple(sorted(p.name[:-len(".toml")] for p in resources.files("attnbench.runner.presets").iterdir()
                       if p.name.endswith(".toml")))
"""The sweeps shipped with attnbench (``--preset``), read from the package so that the help cannot go stale."""

RUN_SECTIONS = (
    ("What to run", ("preset", "impls", "device", "dtype", "mode")),
    ("The grid", ("batch", "seq_len", "num_heads", "d_model", "num_kv_heads", "window", "causal", "scope", "layers",
                  "vocab", "new_tokens", "cache", "rope_theta", "rope_style", "rope_scaling", "qk_norm", "norm_eps",
                  "score_scale", "softcap", "mask", "inputs", "page_size", "lengths", "batch_spec")),
    ("Measurement", ("budget_s", "target_rel_ci", "rounds", "threads", "processes", "baseline", "drift",
                     "cpu_allocator", "no_cpu_bind", "cuda_graph", "accuracy", "setup", "metric", "cpu_capability",
                     "profile")),
    ("Output", ("out", "resume", "report_dir", "no_report", "csv", "quiet", "as_json")),
    ("Execution", ("executor", "ray_address", "isolate", "cell_timeout", "no_memory_guard", "no_wait",
                   "allow_concurrent", "predict")),
)
"""``attnbench run --help``'s sections, common options first in each."""


@cli.command("run", cls=grouped(RUN_SECTIONS))
@click.argument("sweep_file", required=False, type=click.Path(dir_okay=False))
@click.option("--preset", help=f"A sweep shipped with attnbench: {', '.join(PRESETS)}.")
@click.option("--impl", "impls", multiple=True, help="Implementations, comma-separated (also compiled:NAME, file.py:Class).")
@click.option("--device", help="cpu, cuda, cuda:N (comma-separated).")
@click.option("--dtype", help="float32, bfloat16, float16, float64 (comma-separated).")
@click.option("--batch", help="Batch sizes: 1,8 or 1..16x2.")
@click.option("--seq", "seq_len", help="Sequence lengths: 128,256 or 128..2048x2 or 64..512+64.")
@click.option("--heads", "num_heads", help="Numbers of heads.")
@click.option("--d-model", "d_model", help="Model widths (d_in = d_out).")
@click.option("--mode", help="inference, forward, forward+backward, decode; with --scope block/model also train; with "
              "--scope model generate (= generate-cache,generate-nocache) (comma-separated).")
@click.option("--kv-heads", "num_kv_heads", help="Key/value heads: 1 (MQA), a divisor of --heads (GQA), mha (= heads).")
@click.option("--window", help="Sliding windows: none (full attention) or w >= 1 (the token and the previous w-1), e.g. none,64.")
@click.option("--causal/--no-causal", "causal", default=None, help="Causal (default) or bidirectional attention.")
@click.option("--mask", help="Masks and score modifiers (comma-separated; parts joined by +): causal, full, window:N, "
              "softcap:C, prefix:N, document[:D], alibi, sink, e.g. causal,alibi+window:64,document:8+sink "
              "(docs/masks.md).")
@click.option("--rope-theta", "rope_theta", type=float, help="Rotary position embeddings of this base (e.g. 500000); "
              "only implementations declaring rope run (the rope family).")
@click.option("--rope-style", "rope_style", type=click.Choice(["half", "interleaved"]), help="RoPE pairs: half (Llama/HF, "
              "default) or interleaved (GPT-J).")
@click.option("--rope-scaling", "rope_scaling", type=click.Choice(["llama3"]), help="Llama-3 frequency scaling "
              "(factor 8, low/high frequency factors 1/4, original context 8192).")
@click.option("--qk-norm", "qk_norm", type=click.Choice(["head", "full"]), help="RMSNorm of queries and keys per head "
              "(Qwen3, Gemma 3) or over the whole projection (OLMo), before RoPE.")
@click.option("--norm-eps", "norm_eps", type=float, help="The QK-norm's epsilon (default 1e-6).")
@click.option("--score-scale", "score_scale", type=float, help="Score scale (default head_dim ** -0.5).")
@click.option("--softcap", type=float, help="tanh soft-capping of the scores: cap * tanh(s / cap).")
@click.option("--cache", help="warm, cold (cold flushes the GPU L2 before each call; CUDA only).")
@click.option("--scope", help="layer (the attention alone, default), block (inside a transformer block), model (inside "
              "a GPT); comma-separated. Docs: In the model.")
@click.option("--layers", help="Model scope: blocks of the GPT (e.g. 2 or 2,12).")
@click.option("--vocab", help="Model scope: vocabulary size (the book's GPT-2: 50257).")
@click.option("--new-tokens", "new_tokens", help="--mode generate: tokens generated greedily after the --seq prompt.")
@click.option("--out", default="results", show_default=True, type=click.Path(file_okay=False), help="Results folder.")
@click.option("--resume", type=click.Path(file_okay=False), help="Continue the run in this folder, skipping finished cells.")
@click.option("--budget", "budget_s", type=float,
              help="Sampling seconds per cell (after warm-up). Default: 1 (a sweep file's or preset's value wins).")
@click.option("--target-ci", "target_rel_ci", type=float,
              help="Stop sampling when the median's CI half-width is below this fraction (in a comparison group: a "
              "member's paired speed-up's, the baseline's median). Default: 0.02 (a sweep file's or preset's value wins).")
@click.option("--threads", type=int, help="torch.set_num_threads for CPU cells (recorded per row); default with the "
              "controlled environment: every usable core but one.")
@click.option("--rounds", type=int,
              help="Measure every cell this many times, shuffled each round, pooling the samples. Default: 1 (a sweep "
              "file's or preset's value wins).")
@click.option("--processes", type=int, help="Measuring worker processes (fresh, interleaved); every cell is measured "
                                            "--rounds times in each. Default 1.")
@click.option("--cpu-allocator", "cpu_allocator", help="Memory allocator of the measuring processes: pinned (default: "
              "glibc's mmap/trim thresholds fixed), system (glibc as is), jemalloc, tcmalloc (preloaded).")
@click.option("--no-cpu-bind", "no_cpu_bind", is_flag=True, default=None,
              help="Do not bind OpenMP threads to cores (OMP_PROC_BIND/OMP_PLACES/OMP_WAIT_POLICY) in measuring processes.")
@click.option("--drift", "drift", metavar="auto|FRACTION",
              help="Between-run term added to every CI (log-scale SD; 0.02 = 2%, 0 = off). Default auto: this "
              "machine's calibration (python -m attnbench.tools.reproducibility --calibrate), else the CPU default.")
@click.option("--baseline", help="Implementation the paired speed-ups are relative to (each comparison group's "
              "baseline). Default: sdpa when it is in the sweep, else the first implementation.")
@click.option("--cell-timeout", "cell_timeout", metavar="SECONDS|auto|none",
              help="Seconds after which a cell is recorded as timeout. Default auto: from the cell's predicted cost "
              "(at least 120 s; 600 s for compiled:), recorded per row; none: no timeout.")
@click.option("--no-memory-guard", "no_memory_guard", is_flag=True, default=None,
              help="Run cells predicted to need more memory than is available (default: such a cell is skipped).")
@click.option("--isolate", is_flag=True, default=None, help="Run each cell in a fresh subprocess (survives crashes).")
@click.option("--cuda-graph", is_flag=True, default=None, help="Replay inference cells from a CUDA graph.")
@click.option("--no-wait", "no_wait", is_flag=True, help="Exit (status 2) instead of waiting when another measurement "
              "holds this machine's measurement lock.")
@click.option("--allow-concurrent", "allow_concurrent", is_flag=True, help="Measure without the machine's measurement "
              "lock, alongside whatever else measures (both runs' timings suffer).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where cells run: this machine, or a Ray cluster.")
@click.option("--ray-address", help="Address of an existing Ray cluster (default: start a local one).")
@click.option("--profile", is_flag=True, help="After timing, profile each ok cell with torch.profiler.")
@click.option("--csv", is_flag=True, help="Also write results.csv (without raw samples).")
@click.option("--no-report", is_flag=True, help="Do not write the HTML report at the end.")
@click.option("--report-dir", type=click.Path(file_okay=False), help="Where the report goes (default: <run folder>/report "
              "with --out, else reports/<run-id>).")
@click.option("--inputs", help="Stress inputs (comma-separated): normal (default), outliers (0.1% of the input's entries "
              "x10, FlashAttention-3's protocol), large-logits (scores up to the correctness matrix's extreme logits); "
              "docs/accuracy.md.")
@click.option("--page-size", "page_size", help="Decode through paged KV caches (paged_sdpa, flex_paged) of pages of "
              "this many tokens, e.g. 16,64,256 (contiguous caches run in each page size's group as the baseline); "
              "docs/paged.md.")
@click.option("--accuracy", type=click.Choice(["on", "off"]), default=None, help="Each ok row's error against the "
              "float64 reference, beside its time (default on; off skips that pass: docs/accuracy.md).")
# --- issue 37: variable-length batches and setup cost (docs/varlen.md) ---
@click.option("--lengths", help="Variable-length batches (comma-separated): constant, uniform:LO-HI, longtail, bimodal "
              "or a file of lengths; --batch sequences whose lengths sum to batch x --seq (--seq is the mean). Only "
              "varlen implementations run them (varlen_padded, varlen_packed, ...). Default none: rectangles.")
@click.option("--setup", type=click.Choice(["per-call", "once"]), default=None, help="Whether the timed call includes "
              "the implementation's prepare() (its padding/block mask, nested tensor): per-call (default, as a model "
              "does once per forward) or once (prepared before timing: attention alone). setup_s is measured apart.")
# --- end issue 37 ---
@click.option("--batch-spec", "batch_spec", help="Mixed serving steps (comma-separated batch specs): "
              "2q1k_32q1kv2k is 2 prefills of 1k tokens and 32 decodes over 2k-token caches in one step. Paged caches "
              "(paged_sdpa, flex_paged) and varlen classes run them (prefill_s, decode_s: the two parts); the others "
              "get skipped rows. --batch and --seq are the spec's; docs/properties.md.")
# --- issue 39: --metric instructions (attnbench.cli.instructions) ---
@click.option("--metric", type=click.Choice(["time", "instructions"]), default="time", show_default=True,
              help="time: time each cell; instructions: count its instructions per call under valgrind (CPU cells).")
@click.option("--cpu-capability", "cpu_capability", type=click.Choice(["avx2", "avx512", "sve256", "default"]),
              default="avx2", show_default=True, help="--metric instructions: the one vector ISA PyTorch's CPU kernels "
              "may use (valgrind has no AVX-512); docs/instructions.md.")
# --- end issue 39 ---
@click.option("--predict", is_flag=True, help="Print each cell's and the run's predicted time, from earlier runs on "
              "this machine under --out, and exit without measuring (docs/costmodel.md).")  # issue 49
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary table.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout (implies --quiet).")
def run_cmd(sweep_file, **flags) -> None:
    """Run a benchmark sweep. With no arguments: every available implementation on a small CPU grid.

    \b
    attnbench run
    attnbench run --impl sdpa,weight_split --batch 1,8 --seq 128..2048x2 --heads 12 --d-model 768 \\
                  --dtype float32 --device cpu --mode forward,forward+backward --out results/
    attnbench run sweeps/gpt2-small.toml
    attnbench run --preset long-context
    attnbench run --kv-heads 1,2,4 --heads 4 --window none,64 --mode decode,inference --seq 128,512
    attnbench run --preset llama3
    attnbench run --impl rope_sdpa,rope_math --rope-theta 500000 --rope-scaling llama3 --qk-norm head --kv-heads 2
    attnbench run --resume results/<run-id>
    """
    o = SimpleNamespace(sweep_file=sweep_file, **flags)  # the flags, by their parameter names
    o.quiet = o.quiet or o.as_json
    settings = _settings(o)
    axes = _axes(o, flags)
    if o.predict or o.metric == "instructions":  # issue 49: estimated, nothing measured; issue 39: counted under valgrind
        return (_predict if o.predict else _run_counted)(o, settings, axes)  # (attnbench.cli.instructions), not timed
    ahead = contextlib.ExitStack()  # the first measuring worker imports torch while this process does (issue 30)
    if not o.resume and o.executor == "local":
        ahead.enter_context(_prestarted(settings, o.device))
    from attnbench.runner.engine import argv_for_meta, make_sweep, run  # after: the worker imports alongside

    if o.resume:
        if sweep_file or o.preset or any(v is not None for v in axes.values()):
            raise click.UsageError("--resume continues a run with its recorded sweep; give no other sweep options")
        sweep = None
    else:
        sweep = make_sweep(preset=o.preset, file=sweep_file, settings=settings, executor=o.executor, **axes)  # checks --baseline
    failing = _probe_and_say(sweep)
    progress_bar, on_progress = _progress(o.quiet, lambda: _units_per_cell(sweep, o.resume, settings))
    try:
        df = run(sweep, out=o.out, resume=o.resume, executor=o.executor, ray_address=o.ray_address, argv=argv_for_meta(),
                 csv=o.csv, profile=o.profile, progress=on_progress, settings=settings if o.resume else None,
                 no_wait=o.no_wait, allow_concurrent=o.allow_concurrent)
    finally:
        if progress_bar:
            progress_bar.stop()
        ahead.close()
    run_dir = Path(df.attrs["run_dir"])
    if failing:  # said on the run too: meta.json, and the flag column of the summary table
        _record_probe(run_dir, failing)
    report_path = None
    _record_phases(run_dir, df, startup_s=_startup_s(df))  # before the report, so that its table has it
    t_report = time.perf_counter()
    if not o.no_report and len(df):
        report_path = _write_report(run_dir, o.report_dir or _default_report_dir(run_dir, o.resume), o.quiet)
    time_line = _record_phases(run_dir, df, report_s=time.perf_counter() - t_report)
    if o.as_json:
        click.echo(json.dumps({"run_id": df.attrs["run_id"], "run_dir": str(run_dir), "cells": len(df),
                               "status": _status_counts(df), "results": str(run_dir / "results.parquet"),
                               "report": str(report_path) if report_path else None,
                               "interrupted": df.attrs["interrupted"], "contended": _contended(df),
                               "time": time_line}))
    elif not o.quiet:
        print_summary(df, run_dir, report_path, time_line, failing)
    _exit_for(df, run_dir)


def _predict(o: SimpleNamespace, settings: dict, axes: dict) -> None:
    """``--predict``: the sweep's cells and wall time estimated from earlier runs under ``--out``
    (:mod:`attnbench.measure.predict`); nothing measured (a line says so when there is no earlier run)."""
    import dataclasses

    from attnbench.measure.predict import estimate, lines
    from attnbench.runner.engine import make_sweep

    if o.resume:
        raise click.UsageError("--predict estimates a new sweep; give no --resume")
    sweep = make_sweep(preset=o.preset, file=o.sweep_file, settings=settings, executor=o.executor, **axes)
    est = estimate(sweep.cells(), dataclasses.asdict(sweep.settings), o.out, report=not o.no_report)
    if o.as_json:
        click.echo(json.dumps({"predicted_s": None, "reason": est} if isinstance(est, str) else
                              {"predicted_s": est.total_s, "cells": len(est.cells), "fixed_s": est.fixed_s,
                               "runs": est.runs, "notes": est.notes}))
    elif isinstance(est, str):
        console.print(f"--predict: {est}", markup=False, soft_wrap=True)
    else:
        for line in lines(est, per_cell=not o.quiet):
            console.print(line, markup=False, soft_wrap=True)


def _run_counted(o: SimpleNamespace, settings: dict, axes: dict):
    """``--metric instructions``: the sweep's cells counted under valgrind (:func:`attnbench.cli.instructions.run_counted`)."""
    from attnbench.cli.instructions import run_counted

    timeout = settings.get("cell_timeout_s")
    return run_counted(preset=o.preset, sweep_file=o.sweep_file, settings=settings, axes=axes, out=o.out, quiet=o.quiet,
                       as_json=o.as_json, resume=o.resume, executor=o.executor, capability=o.cpu_capability,
                       timeout_s=timeout if isinstance(timeout, int | float) else None)


def _settings(o: SimpleNamespace) -> dict:
    """The measurement settings the flags give (only those given), after checking the flags' values."""
    if o.no_wait and o.allow_concurrent:
        raise click.UsageError("--no-wait and --allow-concurrent contradict each other; give one")
    timeout = _timeout(o.cell_timeout)
    settings = {k: v for k, v in dict(budget_s=o.budget_s, target_rel_ci=o.target_rel_ci, threads=o.threads,
                                       rounds=o.rounds, processes=o.processes, cpu_allocator=o.cpu_allocator,
                                       drift=_drift(o.drift), cpu_bind=False if o.no_cpu_bind else None,
                                       cell_timeout_s=timeout, memory_guard=False if o.no_memory_guard else None,
                                       isolate=o.isolate, cuda_graph=o.cuda_graph, baseline=o.baseline).items()
                if v is not None and v is not _UNSET}
    if timeout is None:
        settings["cell_timeout_s"] = None  # --cell-timeout none: no timeout (None is otherwise "not given")
    if o.accuracy is not None:  # issue 38: --accuracy on|off
        settings["accuracy"] = o.accuracy
    if o.setup is not None:  # issue 37: --setup per-call|once
        settings["setup"] = o.setup
    if o.impls and not _split(o.impls):
        raise click.BadParameter("is empty; name implementations (attnbench list), or leave --impl out to run every "
                                 "available one", param_hint="--impl")
    if o.threads is not None and o.threads < 1:
        raise click.BadParameter("must be >= 1", param_hint="--threads")
    if o.budget_s is not None and o.budget_s <= 0:
        raise click.BadParameter("must be > 0", param_hint="--budget")
    return settings


def _axes(o: SimpleNamespace, flags: dict) -> dict:
    """The sweep's axes the flags give (None: not given); the positional ones (RoPE, QK-norm, ...) as one value."""
    from attnbench.runner.positional import compose

    return dict(impl=",".join(_split(o.impls)) or None, device=o.device, dtype=o.dtype, batch=o.batch,
                seq_len=o.seq_len, num_heads=o.num_heads, d_model=o.d_model, mode=o.mode, cache=o.cache,
                num_kv_heads=o.num_kv_heads, window=o.window, causal=None if o.causal is None else (o.causal,),
                positional=compose(flags), scope=o.scope, layers=o.layers, vocab=o.vocab, new_tokens=o.new_tokens,
                inputs=o.inputs, mask=o.mask, page_size=o.page_size, lengths=o.lengths,
                batch_spec=o.batch_spec)


def _units_per_cell(sweep, resume: str | None, settings: dict) -> int:
    """How many times each cell is measured (rounds x processes): the engine's progress counts those, the bar cells."""
    if sweep is None:  # --resume: the recorded sweep's, with the settings given now
        from attnbench.results.store import read_meta
        from attnbench.runner.session import sweep_from_meta

        recorded = sweep_from_meta(read_meta(resume)).settings
        rounds, processes = settings.get("rounds", recorded.rounds), settings.get("processes", recorded.processes)
    else:
        rounds, processes = sweep.settings.rounds, sweep.settings.processes
    return max(1, rounds * processes)


def _progress(quiet: bool, units_per_cell=lambda: 1):
    """The progress bar (None when quiet) and the engine's ``progress(i, total, cell, row)`` callback that drives it
    (:class:`attnbench.cli.progress.RunProgress`: it counts cells, ``units_per_cell()`` of the engine's units each,
    and its ETA comes from the plan's predictions)."""
    if quiet:
        return None, None
    from attnbench.cli.progress import RunProgress

    on_progress = RunProgress(err_console, units_per_cell)
    return on_progress.bar, on_progress


def _status_counts(df) -> dict[str, int]:
    return {s: int((df.status == s).sum()) for s in STATUSES if (df.status == s).any()}


def print_summary(df, run_dir: Path, report_path: Path | None, time_line: str, failing: dict | None = None) -> None:
    """The console's account of a finished run: the table, failures, where the files are, and the notes."""
    console.print(summary_table(df, f"attnbench run {df.attrs['run_id']}", failing, width=console.width))
    for full, short in short_names(df["impl"].astype(str)).items():
        if full != short:
            console.print(f"{short} = {full}", markup=False, soft_wrap=True)
    for name, why in (failing or {}).items():
        console.print(f"warning: {name} {why}: its rows are flagged `fails check`", markup=False)
    _print_model_views(df)
    bad = df[df.status != "ok"]
    skipped = bad[bad.status == "skipped"]
    if len(skipped) > 20:  # e.g. a variant sweep: most implementations support only some combinations
        bad = bad[bad.status != "skipped"]
    for r in bad.itertuples():
        console.print(f"  {r.status:8} {r.cell_id}: {r.error}", markup=False)
    if len(skipped) > 20:
        console.print(f"  {len(skipped)} cells skipped (combinations not supported here); every reason is in the "
                      "results' error column and the report", markup=False)
    console.print(f"{len(df)} cells: " + ", ".join(f"{n} {s}" for s, n in _status_counts(df).items()))
    console.print(f"results: {run_dir / 'results.parquet'}", markup=False)
    if report_path:
        console.print(f"report:  {report_path}", markup=False)
    _warn_if_busy(run_dir)
    noisy = flag_counts(df)["noisy"]  # the report's count too (attnbench.results.quality)
    if noisy:
        console.print(f"note: {noisy} cell(s) are noisy: a within-run CI wider than ±{100 * NOISY_CI_REL:.0f}% of "
                      "the median (noisy machine?)")
    _print_over_peak(df)
    note = setup_view.setup_note(df)  # issue 37
    if note:
        console.print(note, markup=False)
    for line in accuracy_view.limit_lines(df):  # issue 38: rows less accurate than their precision has to be
        console.print(line, markup=False)
    _print_drift(run_dir)
    _print_unstable(df)
    _print_contention(df, run_dir)
    if time_line:
        console.print(time_line, markup=False)


def _exit_for(df, run_dir: Path) -> None:
    """Exit as the run ended: interrupted (130, 143, ...; how to resume said), some cell failed (1), else return."""
    if df.attrs["interrupted"]:
        signum = df.attrs.get("interrupted_by") or signal.SIGINT
        how = "interrupted" if signum == signal.SIGINT else f"terminated by {interrupts.name(signum)}"
        err_console.print(f"{how}: {len(df)} finished cell(s) kept in {run_dir}; continue with "
                          f"`attnbench run --resume {run_dir}`", markup=False)
        sys.exit(interrupts.exit_code(signum))
    failure = failure_line(df)
    if failure:
        err_console.print(f"error: {failure}", markup=False)
        sys.exit(1)


"""Statuses that fail a run (exit 1); ``skipped`` cells are combinations declared impossible here, not failures."""


PROBE_SHAPES = 8
"""How many of the correctness matrix's shapes the probe before timing tries (float64, forward)."""
PROBE_TIMEOUT_S = 20.0


def _record_probe(run_dir: Path, failing: dict[str, str]) -> None:
    from attnbench.results.store import write_meta_keys

    write_meta_keys(run_dir, failed_correctness_probe=failing)


def _probe_and_say(sweep) -> dict[str, str]:
    """:func:`probe_plugins` for the sweep's implementations (none when resuming), each failure said before timing."""
    if sweep is None:
        return {}
    failing = probe_isolated(sweep.impl) if sweep.settings.isolate else probe_plugins(sweep.impl)
    for name, why in failing.items():
        err_console.print(f"warning: {name} {why}; its times below are those of a wrong answer "
                          f"(`attnbench check --impl {name}` shows every case)", markup=False)
    return failing


def probe_isolated(names) -> dict[str, str]:
    """:func:`probe_plugins` in a throwaway process, for ``--isolate``: a plug-in that crashes its process (a native
    segfault) or hangs there is said and left to the run, whose cells record their own outcome, instead of ending it."""
    import subprocess

    from attnbench.plugins.exits import describe_exit

    code = ("import json, sys; from attnbench.cli.run import probe_plugins; "
            "print('\\n' + json.dumps(probe_plugins(sys.argv[1:])))")
    names = list(dict.fromkeys(names))
    limit = 120 + PROBE_TIMEOUT_S * PROBE_SHAPES * len(names)
    try:
        proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        err_console.print(f"warning: the correctness probe before timing ran past {limit:g} s in its own process; "
                          "not probed (each cell records its own outcome)", markup=False)
        return {}
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    how = ("was " if proc.returncode < 0 else "") + describe_exit(proc.returncode)  # killed by SIGSEGV / exited with ...
    if proc.returncode > 0:
        how += f": {(proc.stderr.strip().splitlines() or [''])[-1]}"
    err_console.print(f"warning: the correctness probe before timing {how} in its own process (--isolate); not "
                      "probed (each cell records its own outcome)", markup=False)
    return {}


def probe_plugins(names) -> dict[str, str]:
    """A quick correctness probe before timing (issue 40): the float64 forward cases of the matrix's first
    :data:`PROBE_SHAPES` shapes, for the sweep's plug-ins (the built-ins are checked by the project's own tests).
    Name -> why it fails; a plug-in that errors or hangs here is left to the run, which records that on its rows."""
    from dataclasses import replace

    from attnbench import registry
    from attnbench.correctness import watchdog
    from attnbench.correctness.matrix import cases, run_case

    plugins = [(n, registry.get(n)) for n in dict.fromkeys(names)]
    plugins = [(n, impl) for n, impl in plugins if impl.origin != "builtin"]
    if not plugins:
        return {}
    probes = [c for c in cases(["forward"]) if c.dtype == "float64"][:PROBE_SHAPES]
    failing = {}
    for name, impl in plugins:
        eager = replace(impl, transform=None)  # compiled:plug.py:Class is probed uncompiled: the same math, no compile
        for case in probes:
            try:
                with watchdog.case_deadline(PROBE_TIMEOUT_S, f"probe {case.shape.id}"):
                    result = run_case(eager, case)
            except watchdog.CaseTimeout:
                break
            if result.status == "error":
                break
            if result.status == "fail":
                failing[name] = (f"fails the correctness probe before timing (forward, shape {case.shape.id}: "
                                 f"{result.message or 'wrong output'})")
                break
    return failing


def failure_line(df) -> str | None:
    """Why the run exits 1: no cell measured (total failure), or some cells failed (partial); None: exit 0."""
    if not len(df):
        return None
    counts = df.status.value_counts()
    failed = {s: int(counts[s]) for s in FAILED if s in counts}
    first = first_failed(df, FAILED)
    reason = f"; first: {first.cell_id}: {first.status}: {first.error}" if first is not None else ""
    said = ", ".join(f"{n} {s}" for s, n in counts.items())
    if not int(counts.get("ok", 0)):
        return f"no cell was measured ({said}){reason}"
    if failed:
        return (f"{sum(failed.values())} of {len(df)} cells failed ({', '.join(f'{n} {s}' for s, n in failed.items())}); "
                f"their rows and reasons are in the results{reason}")
    return None


def _prestarted(settings: dict, device: str | None):
    """:func:`attnbench.runner.executors.local.prestarted` for the measurement settings given as flags."""
    from attnbench.runner.executors.local import prestarted
    from attnbench.runner.sweep import Settings

    devices = [d.strip() for d in (device or "cpu").split(",") if d.strip()]
    return prestarted(Settings(**settings), devices)


def _startup_s(df, argv: list[str] | None = None) -> float:
    """Seconds this command spent before its run session (imports, the sweep, the probe): the time since the command
    began (:data:`attnbench.cli.clock.STARTED`, its entry point's first import) less the session's wall time. Not
    the process's age (``/proc/self/stat``): a shell that runs ``pip install ... && attnbench run`` execs the
    command in the process it forked before pip ran. 0 when this process is not the command (a test calling the
    CLI in-process)."""
    from attnbench.cli.clock import STARTED
    from attnbench.runner.executors.ahead import own_command

    session = df.attrs.get("session_wall_s")
    if not own_command(sys.argv if argv is None else argv) or session is None:
        return 0.0
    return max(time.perf_counter() - STARTED - session, 0.0)


def _record_phases(run_dir: Path, df, startup_s: float = 0.0, report_s: float = 0.0) -> str:
    """Add this command's start-up (before the session) or the report to ``meta.json``'s ``phases``
    (:mod:`attnbench.runner.phases`); the console's line about where the time went (and how sampling stopped)."""
    from attnbench.results.store import read_meta, write_meta_keys
    from attnbench.runner import phases

    meta = read_meta(run_dir)
    if not meta.get("phases"):
        return ""
    recorded = phases.with_cli(meta["phases"], startup_s, report_s)
    write_meta_keys(run_dir, phases=recorded)
    stops = phases.stop_text(df.to_dict("records"))
    return phases.line(recorded) + (f"\n{stops}" if stops else "")


_UNSET = object()


def _timeout(value: str | None):
    """``--cell-timeout``: unset (the sweep's, default auto), seconds > 0, auto or none (None); 0 is a usage error."""
    from attnbench.runner.budget import parse_timeout

    return _UNSET if value is None else parse_timeout(value)  # a SweepError: one line, exit 2


def _drift(value: str | None) -> float | None:
    """``--drift``: None for auto, else a fraction (``0.02`` or ``2%``); nonsense is a usage error (exit 2)."""
    if value is None or value.strip().lower() == "auto":
        return None
    text = value.strip()
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither auto nor a fraction like 0.02 or 2%", param_hint="--drift") from None
    if not 0 <= number < 1:
        raise click.BadParameter(f"must be a fraction in [0, 1) (0.02 or 2%), got {value!r}", param_hint="--drift")
    return number


def _print_drift(run_dir: Path) -> None:
    """One line per device type: the between-run term in the CIs and where it came from."""
    from attnbench.results.store import read_meta

    for device_type, d in (read_meta(run_dir).get("drift") or {}).items():
        console.print(f"CIs on {device_type} include a between-run term of ±{100 * d['rel']:.1f}% (1 SD): {d['source']}",
                      markup=False)
        if d.get("warning"):
            console.print(f"warning: {device_type}: {d['warning']}", markup=False)


def _print_unstable(df) -> None:
    """One line per cell flagged unstable (two modes), with the modes from its notes."""
    if "stability" not in df:
        return
    unstable = df[(df.status == "ok") & (df.stability.astype(str) == "unstable")]
    for r in unstable.itertuples():
        modes = next((n for n in str(r.notes).split("; ") if n.startswith("unstable:")), "unstable")
        console.print(f"  {r.cell_id}: {modes}", markup=False)
    if len(unstable):
        console.print(f"note: {len(unstable)} cell(s) are unstable (two modes); their medians depend on the run. "
                      "Causes: the allocator (`--cpu-allocator`) or, when many cells are and the between-run term "
                      "above was scaled up, other load on the machine. See \"How trustworthy are the numbers?\" in "
                      "the docs (docs/studies/trustworthiness.md)", markup=False)


def _contended(df) -> int:
    from attnbench.measure.contention import contended_mask

    return int(contended_mask(df).sum())


def _print_contention(df, run_dir: Path) -> None:
    """How much of the run was contended, and how long it waited for another measurement."""
    from attnbench.measure.contention import summary
    from attnbench.results.store import read_meta

    line = summary(df)
    if line:
        console.print(f"note: {line}", markup=False)
    waited = read_meta(run_dir).get("machine_lock") or []
    if waited and waited[-1].get("waited_s"):
        console.print(f"note: this run waited {waited[-1]['waited_s']:.1f} s for another measurement on this machine "
                      f"({'; '.join(waited[-1].get('waited_for') or [])})", markup=False)


def _warn_if_busy(run_dir: Path) -> None:
    """Say so when other work kept the cores busy as the run started: timings are then inflated and noisy."""
    from attnbench.results.store import read_meta

    busy = read_meta(run_dir).get("cpu_busy_before_run")
    if busy is not None and busy > 0.25:
        console.print(f"warning: other processes kept the CPUs {100 * busy:.0f}% busy just before the run started; "
                      "they compete for the cores, so timings are inflated and noisy", markup=False)


def _default_report_dir(run_dir: Path, resume: str | None) -> str | None:
    """Where the report goes without --report-dir: beside the results (``<run folder>/report``) when --out was given
    (or the resumed run has its report there), else ``reports/<run-id>`` (None: :func:`build_report`'s default)."""
    given = click.get_current_context().get_parameter_source("out") != click.core.ParameterSource.DEFAULT
    if (given and not resume) or (resume and (run_dir / "report").is_dir()):
        return str(run_dir / "report")
    return None


def _write_report(run_dir: Path, report_dir: str | None, quiet: bool) -> Path | None:
    try:
        from attnbench.report import build_report
        from attnbench.report.page import run_report_formats
    except ImportError:
        return None
    try:  # PNG figures only, unless $ATTNBENCH_REPORT_FORMATS asks for SVG (`attnbench report` writes both)
        return build_report(run_dir, out_dir=report_dir, formats=run_report_formats())
    except Exception as exc:  # the results are safe on disk; say why the report is missing
        err_console.print(f"warning: the report could not be written ({type(exc).__name__}: {exc}); "
                          f"run `attnbench report {run_dir}` to retry", markup=False)
        return None


