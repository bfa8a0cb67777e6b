"""``attnbench report``: one self-contained HTML page (plus PNG/SVG figures and CSV/Markdown tables) for a run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd

from attnbench.errors import ResultsError
from attnbench.models import views as model_views
from attnbench.report import accuracy as accuracy_view
from attnbench.report import analysis as an
from attnbench.report import costmodel as costmodel_view
from attnbench.report import figures as figs
from attnbench.report import mask_gallery, model_figures, variants
from attnbench.report import paged as paged_view
from attnbench.report import properties as properties_view
from attnbench.report import roofline as roofline_view
from attnbench.report.forked import Forked
from attnbench.results import setup_view
from attnbench.results.quality import flag_counts
from attnbench.results.store import load_run
from attnbench.results.text import fmt_lead
from attnbench.runner import phases

TEMPLATES = Path(__file__).resolve().parent / "templates"

ENV_KEYS = (
    ("run_id", "run id"), ("timestamp", "started"), ("command", "command line"), ("git_commit", "git commit"),
    ("attnbench_version", "attnbench"), ("torch_version", "torch"), ("python_version", "Python"),
    ("cuda_version", "CUDA (torch build)"), ("cuda_driver", "CUDA driver"), ("platform", "platform"),
    ("hostname", "host"), ("cpu_model", "CPU"), ("cpu_count", "CPU cores"), ("torch_threads", "torch threads"),
    ("gpus", "GPUs"), ("peak_gflops", "measured peak GFLOP/s"),
)


def jinja_env() -> jinja2.Environment:
    """The template environment: autoescaping on for everything (results text is untrusted)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env


# ---------------------------------------------------------------- tables


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (``DataFrame.to_markdown``; ``|`` and newlines in cells escaped, NaN empty)."""

    def cell(v) -> str:
        s = "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)
        return s.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", "<br>")

    text = pd.DataFrame([[cell(v) for v in row] for row in df.itertuples(index=False)],
                        columns=[cell(c) for c in df.columns])
    return text.to_markdown(index=False, tablefmt="github", disable_numparse=True) + "\n"


class Tables:
    """Collects the report's tables, writes each as CSV and Markdown, and hands them to the template."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir / "tables"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: list[str] = []

    def add(self, name: str, display: pd.DataFrame, raw: pd.DataFrame | None = None, classes: list[str] | None = None,
            long_columns: tuple[str, ...] = ()) -> dict:
        """Write ``tables/<name>.csv`` (``raw``, else ``display``) and ``.md`` (``display``); return it for HTML."""
        (raw if raw is not None else display).to_csv(self.dir / f"{name}.csv", index=False)
        (self.dir / f"{name}.md").write_text(markdown_table(display), encoding="utf-8")
        self.files += [f"tables/{name}.csv", f"tables/{name}.md"]
        rows = [["" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v) for v in r]
                for r in display.itertuples(index=False)]
        return {"name": name, "columns": [str(c) for c in display.columns], "rows": rows,
                "classes": classes or [""] * len(rows), "long": [str(c) in long_columns for c in display.columns],
                "csv": f"tables/{name}.csv", "md": f"tables/{name}.md"}


def _fmt_df(df: pd.DataFrame, formats: dict) -> pd.DataFrame:
    out = df.copy()
    for col, f in formats.items():
        if col in out:
            out[col] = [f(v) for v in out[col]]
    return out


# ---------------------------------------------------------------- environment


def _env_value(value) -> str:
    if value is None or value == "" or value == []:
        return "–"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {f'{v:,.1f}' if isinstance(v, float) else v}" for k, v in value.items()) or "–"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def environment_rows(meta: dict, df: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, value) pairs of the run's environment: the known keys first, then anything else in meta."""
    rows = [(label, _env_value(meta.get(key))) for key, label in ENV_KEYS if key in meta]
    known = {k for k, _ in ENV_KEYS} | {"format", "drift"}
    drift = meta.get("drift")
    if isinstance(drift, dict) and drift:  # attnbench.measure.drift: what every CI of the run includes
        rows.append(("between-run term in CIs (1 SD)", "; ".join(
            f"{t}: ±{100 * float(d.get('rel', 0)):.1f}% ({d.get('source', '?')})" for t, d in drift.items()
            if isinstance(d, dict))))
    for key, value in meta.items():
        if key not in known:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            rows.append((key, text if len(text) <= 600 else text[:600] + " …"))
    if "threads" in df.columns and len(df):
        threads = sorted({int(t) for t in pd.to_numeric(df["threads"], errors="coerce").dropna() if t > 0})
        if threads:
            rows.append(("threads per cell", ", ".join(map(str, threads))))
    if "device_name" in df.columns and len(df):
        names = sorted({str(n) for n in df["device_name"].dropna() if str(n)})
        if names:
            rows.append(("device names", ", ".join(names)))
    if not rows:
        rows.append(("metadata", "no meta.json next to the results file, so the environment is unknown"))
    return rows


# ---------------------------------------------------------------- the report


def _run_folder(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


def _pick_profiles(tables: list[dict], limit: int = 6) -> list[dict]:
    """The op tables to show: per configuration without T, the one with the largest T; at most ``limit``."""
    best: dict[str, tuple[int, dict]] = {}
    for p in tables:
        m = re.search(r"(^|\|)T(\d+)(\||$)", p["configuration"])
        t = int(m.group(2)) if m else 0
        rest = re.sub(r"(^|\|)T\d+(?=\||$)", r"\1T*", p["configuration"])
        if rest not in best or t > best[rest][0]:
            best[rest] = (t, p)
    return [p for _, p in best.values()][:limit]


DEFAULT_BASELINE = "weight_split"
"""The report's baseline for a run without paired speed-ups (and no ``baseline`` asked for)."""
ENV_DPI = "ATTNBENCH_REPORT_DPI"
ENV_FORMATS = "ATTNBENCH_REPORT_FORMATS"


RUN_FORMATS = "png"
"""The figure files of the report ``attnbench run`` writes when it ends (unless ``ATTNBENCH_REPORT_FORMATS`` says
otherwise): PNG only. The page embeds the PNGs either way; SVG copies would cost the run a fifth of its report's
time (a second or two on 2 cores), and ``attnbench report RUN`` writes them."""


def run_report_formats() -> str:
    """The formats of the report at the end of ``attnbench run``: ``$ATTNBENCH_REPORT_FORMATS``, else :data:`RUN_FORMATS`."""
    return os.environ.get(ENV_FORMATS) or RUN_FORMATS


def render_settings(dpi: int | None = None, formats: str | tuple[str, ...] | None = None) -> figs.Render:
    """The figures' :class:`~attnbench.report.figures.Render`: the arguments, else the environment variables
    ``ATTNBENCH_REPORT_DPI`` and ``ATTNBENCH_REPORT_FORMATS`` (``png`` or ``png,svg``), else 150 dpi, PNG and SVG."""
    dpi = dpi if dpi is not None else os.environ.get(ENV_DPI) or figs.PNG_DPI
    formats = formats if formats is not None else os.environ.get(ENV_FORMATS) or ("png", "svg")
    names = tuple(f.strip().lower() for f in (formats.split(",") if isinstance(formats, str) else formats) if f.strip())
    try:
        dpi = int(dpi)
    except ValueError:
        raise ResultsError(f"report dpi must be a whole number, got {dpi!r} (check ${ENV_DPI})") from None
    if dpi < 10 or set(names) - {"png", "svg"} or "png" not in names:
        raise ResultsError(f"report figures need dpi >= 10 and formats png or png,svg; got dpi {dpi}, formats "
                           f"{','.join(names) or 'none'} (check ${ENV_DPI} and ${ENV_FORMATS})")
    return figs.Render(dpi=dpi, svg="svg" in names)


def build_report(results_path: str | Path, out_dir: str | Path | None = None, baseline: str | None = None,
                 top_ops: int = 15, dpi: int | None = None, formats: str | tuple[str, ...] | None = None) -> Path:
    """Write the report of one run and return the path of its ``report.html``.

    ``results_path`` is a run folder or its ``results.parquet``. ``out_dir`` defaults to
    ``reports/<run-id>/`` under the working directory. The page is self-contained (figures embedded
    as PNG data URIs, styles inline, no scripts, no network); figures are also written as PNG and SVG
    under ``figures/`` and tables as CSV and Markdown under ``tables/``. ``baseline``: the implementation
    speed-ups are relative to; by default the run's own (its paired speed-ups), else ``weight_split``.
    ``dpi`` and ``formats`` (``"png"`` or ``"png,svg"``): see :func:`render_settings`.
    """
    with figs.rendering(render_settings(dpi, formats)):
        return _build_report(results_path, out_dir, baseline, top_ops)


def _build_report(results_path: str | Path, out_dir: str | Path | None, baseline: str | None, top_ops: int) -> Path:
    path = Path(results_path)
    raw, meta = load_run(path)
    run_id = str(meta.get("run_id") or (path.name if path.is_dir() else path.parent.name) or "run")
    out = _report_folder(out_dir, run_id)
    fig_dir = out / "figures"
    df = an.prepare(raw)
    df.attrs = {}  # pandas deep-copies attrs into every frame derived from this one (thousands here); none is read
    ok = an.ok_rows(df)
    styles = figs.impl_styles(df["impl"].tolist())
    run_baseline = an.paired_baseline(df)
    chosen, baseline_note = an.choose_baseline(df, baseline or run_baseline or DEFAULT_BASELINE)
    tables = Tables(out)
    sp = an.speedups(df, chosen)
    method = an.speedup_method(sp[sp["impl"] != chosen]) if len(sp) else "medians"
    # CHILD_FIGURES are drawn in a forked process on an idle core while this one draws the rest and makes the tables
    # (attnbench.report.forked; the same files either way)
    child = Forked(lambda: dict(zip(CHILD_FIGURES, (
        figs.speedup(df, sp, chosen, styles, fig_dir), figs.memory(df, styles, fig_dir),
        roofline_view.figures(df, styles, fig_dir), accuracy_view.figures(df, styles, fig_dir)), strict=True)))
    figure_sections, bar_table = _figures(df, ok, chosen, styles, fig_dir)
    t: dict = {}
    fastest = _overview_tables(df, tables, t)
    speedup_text = _speedup_tables(df, sp, chosen, _speedup_note(chosen, run_baseline, method), tables, t)
    noisy = _detail_tables(df, meta, bar_table, tables, t)
    acc_disp, acc_raw, acc_classes = accuracy_view.table(df)  # issue 38: errors and their ratios to the plain math's
    if len(acc_disp):
        t["accuracy"] = tables.add("accuracy", acc_disp, acc_raw, classes=acc_classes, long_columns=("note",))
    profile, profile_note = _profile_tables(path, top_ops, tables)
    drawn = child.result()
    figure_sections = [(k, title, drawn[k] if fl is None else fl) for k, title, fl in figure_sections
                       if fl is not None or drawn[k] or k not in OPTIONAL_CHILD_FIGURES]
    figure_files = [f"figures/{f.name}.{ext}" for _, _, fl in figure_sections for f in fl if not f.skipped
                    for ext in figs.current_render().formats]
    page = jinja_env().get_template("report.html.j2").render(
        run_id=run_id, meta=meta, summary=_summary(df, ok, len(noisy)), baseline=chosen, requested_baseline=baseline,
        baseline_note=baseline_note, headline=_headline(fastest), figure_sections=figure_sections, tables=t,
        **speedup_text, speedup_method=method, variant_sentences=variants.sentences(df), noisy_limit=an.NOISY_CI_REL,
        profile=profile, profile_note=profile_note, environment=environment_rows(meta, df),
        styles=styles, files=figure_files + tables.files, source=str(path), svg=figs.current_render().svg,
        stop_text=phases.stop_text(ok.to_dict("records")),
        accuracy_above=accuracy_view.above_sentences(acc_raw), accuracy_limit=accuracy_view.RATIO_LIMIT,
        implausible=roofline_view.implausible_sentences(df),
    )
    html_path = out / "report.html"
    html_path.write_text(page, encoding="utf-8")
    return html_path


def _report_folder(out_dir: str | Path | None, run_id: str) -> Path:
    """The report's folder (``reports/<run-id>`` by default), made."""
    out = Path(out_dir) if out_dir is not None else Path("reports") / _slug(run_id)
    if out.exists() and not out.is_dir():
        raise ResultsError(f"report output {out} exists and is not a folder; pass another -o")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _speedup_note(chosen: str | None, run_baseline: str | None, method: str) -> str | None:
    """Why the speed-ups are ratios of medians, when they are not this run's paired ones."""
    if chosen is None or method == "paired":
        return None
    return (f"The speed-ups against {chosen} are ratios of medians (no CI): "
            + (f"this run's paired speed-ups are against {run_baseline}; `attnbench report --baseline "
               f"{run_baseline}` shows them." if run_baseline and run_baseline != chosen else
               "this run predates paired speed-ups (implementations timed in alternation), so drift "
               "between the implementations' timing blocks is in them."))


CHILD_FIGURES = ("speedup", "memory", "roofline", "accuracy")
"""The figure sections the forked child draws (:class:`~attnbench.report.forked.Forked`) while this process draws
the others and makes the tables: about half of the drawing each on 2 cores."""
OPTIONAL_CHILD_FIGURES = ("roofline", "accuracy")
"""The child's sections left out of the page when they have no figure (no row with an intensity or an accuracy)."""


def _figures(df, ok, chosen, styles, fig_dir: Path) -> tuple[list, pd.DataFrame]:
    """The figure sections drawn in this process (:data:`CHILD_FIGURES`: None, the forked child's) and the
    side-by-side bars' table."""
    bar_fig, bar_table = figs.bars(df, chosen, styles, fig_dir)
    latency_figs = figs.latency(df, styles, fig_dir)
    throughput_figs = figs.throughput(df, styles, fig_dir)
    compile_figs = figs.compile_times(df, styles, fig_dir)
    figure_sections = [
        ("latency", "Latency vs sequence length", latency_figs),
        ("speedup", f"Speed-up relative to {chosen or 'a baseline'}", None),  # the child's, below
        ("memory", "Peak memory", None),
        ("throughput", "Throughput (GFLOP/s and fraction of peak)", throughput_figs),
        ("compile", "torch.compile: compile time vs steady state", compile_figs),
        ("bars", "Side by side at one configuration", [bar_fig]),
    ]
    if (ok["mode"] == "decode").any():  # attention variants and KV-cache decoding
        figure_sections += [("decode", "KV-cache decoding: latency vs cache length", variants.decode_latency(df, styles, fig_dir)),
                            ("kv-cache", "KV-cache bytes vs context length", variants.kv_cache_bytes(df, styles, fig_dir))]
    figure_sections += [("roofline", "Roofline: bound and headroom", None),  # issue 49; the child's, dropped if none
                        ("accuracy", "Accuracy vs latency", None)]  # issue 38: accuracy against latency, per dtype
    gallery = mask_gallery.gallery(df, fig_dir)  # issue 37: each mask drawn beside its timings
    if gallery:
        figure_sections.append(("mask-gallery", "Mask gallery", gallery))
    model_figs = model_figures.model_figures(df, styles, fig_dir)  # issue 27: block and model rows
    if model_figs:
        figure_sections.append(("in-the-model", "In the model", model_figs))
    return figure_sections, bar_table


def _overview_tables(df, tables: Tables, t: dict) -> pd.DataFrame:
    """The scope speed-ups, the status counts and the fastest implementations (returned: the headline's source)."""
    amdahl = model_views.scope_speedups(df)
    if len(amdahl):
        t["scopes"] = tables.add("scope_speedups", amdahl)
    t["status"] = tables.add("status_counts", an.status_counts(df))
    fastest = an.fastest(df)
    t["fastest"] = tables.add("fastest", fastest, classes=["noisy" if "noisy" in n else "" for n in fastest["note"]])
    return fastest


def _speedup_tables(df, sp, chosen, speedup_note: str | None, tables: Tables, t: dict) -> dict:
    """The speed-up and crossover tables; the template's speed-up and crossover sentences and notes."""
    if len(sp):
        sp_raw = sp[sp["impl"] != chosen].drop(columns=["group"])
        sp_disp = pd.DataFrame({
            "configuration": sp_raw["configuration"], "impl": sp_raw["impl"], "seq_len": sp_raw["seq_len"],
            "median": [an.fmt_time(v) for v in sp_raw["median_s"]],
            "baseline median": [an.fmt_time(v) for v in sp_raw["baseline_median_s"]],
            "speed-up (95% CI)": [an.fmt_speedup(r.speedup, r.speedup_ci_low, r.speedup_ci_high, r.unstable)
                                  for r in sp_raw.itertuples()],
            "paired": ["yes" if p else "no (ratio of medians)" for p in sp_raw["paired"]]})
        t["speedup"] = tables.add("speedup", sp_disp, sp_raw,
                                  classes=["noisy" if u else "" for u in sp_raw["unstable"]])
    speedup_sentences = an.speedup_sentences(sp, chosen)
    missing = an.unpaired(df, chosen)
    if missing:
        speedup_note = " ".join(filter(None, [speedup_note, (
            f"{len(missing)} cell(s) have no paired speed-up and are left out: " + "; ".join(missing[:8])
            + (" …" if len(missing) > 8 else ""))]))
    cross, cross_notes = an.crossovers(df, chosen, sp)
    cross_t = [("" if v is None or v != v else int(v)) for v in cross["crossover_T"]]
    t["crossovers"] = tables.add("crossovers", cross[["configuration", "a", "b", "kind", "crossover_T", "n_T"]]
                                 .assign(crossover_T=cross_t), cross.drop(columns="short"))
    sentences: dict[str, list[str]] = {}
    for r in cross[cross["vs_baseline"]].itertuples():
        sentences.setdefault(r.configuration, []).append(r.short)
    other_cross = cross[~cross["vs_baseline"] & cross["kind"].isin(["crossover", "mixed"])]["sentence"].tolist()
    return dict(sentences=sentences, cross_notes=cross_notes, speedup_sentences=speedup_sentences,
                speedup_note=speedup_note, other_cross=other_cross)


def _detail_tables(df, meta: dict, bar_table: pd.DataFrame, tables: Tables, t: dict) -> pd.DataFrame:
    """Scaling, noisy cells, failures, compile, bars, KV cache per token and where the time went (returned: the
    noisy cells)."""
    fmt_k = dict.fromkeys(("k_all", "r2", "k_tail"), an.fmt_num)
    for name, table in (("scaling_latency", an.scaling(df, "median_s")), ("scaling_memory", an.scaling(df, "peak_bytes"))):
        t[name] = tables.add(name, _fmt_df(table, fmt_k), table, long_columns=("note",))
    noisy = an.noisy(df)
    t["noisy"] = tables.add("noisy", noisy)
    fails = an.failures(df)
    t["failures"] = tables.add("failures", fails, classes=[f"st-{s}" for s in fails["status"]], long_columns=("error",))
    comp = an.compile_table(df)
    if len(comp):
        comp_disp = _fmt_df(comp, {"compile_s": an.fmt_time, "median_s": an.fmt_time, "eager_median_s": an.fmt_time,
                                   "speedup_vs_eager": lambda v: an.fmt_num(v) + "×" if np.isfinite(v) else "–",
                                   "break_even_calls": lambda v: ("never (not faster than eager)" if v == float("inf")
                                                                  else "–" if not np.isfinite(v) else f"{int(v):,}")})
        t["compile"] = tables.add("compile", comp_disp, comp)
    if len(bar_table):
        t["bars"] = tables.add("bars", bar_table)
    head_disp, head_raw = roofline_view.headroom_table(df)  # issue 49: the cells furthest from their roofline
    if len(head_disp):
        t["headroom"] = tables.add("headroom", head_disp, head_raw, classes=["regression" if f else "" for f in head_disp["flag"]])
    cost_disp, cost_raw, off_disp, off_raw = costmodel_view.tables(df)  # issue 49: the cost model's held-out error
    if len(cost_disp):
        t["costmodel"] = tables.add("costmodel", cost_disp, cost_raw, long_columns=("note",))
        t["mispredicted"] = tables.add("mispredicted", off_disp, off_raw)
    varlen_rows = setup_view.report_table(df)  # issue 37: variable-length batches and setup cost
    if len(varlen_rows):
        t["varlen"] = tables.add("varlen_setup", varlen_rows)
    props, props_raw, props_classes = properties_view.table(df)  # issue 48: implementation x property, coloured
    if len(props):
        t["properties"] = dict(tables.add("properties", props, props_raw), cells=properties_view.cells(props, props_classes))
    mixed, mixed_raw = properties_view.mixed_table(df)  # issue 48: the mixed serving step and its parts
    if len(mixed):
        t["mixed"] = tables.add("mixed_step", mixed, mixed_raw)
    per_token = variants.cache_per_token(df)
    if len(per_token):
        t["cache_per_token"] = tables.add("cache_per_token", variants.cache_per_token_display(per_token), per_token)
    paged = paged_view.table(df)  # issue 37: paged against contiguous KV caches, per page size
    if len(paged):
        t["paged"] = tables.add("paged", paged_view.display(paged), paged)
    time_df, sampling_df = phases.report_frames(meta, df)  # issue 30: where the run's time went
    t["phases"] = tables.add("phases", time_df)
    t["sampling"] = tables.add("sampling", sampling_df)
    return noisy


def _profile_tables(path: Path, top_ops: int, tables: Tables) -> tuple[list, str | None]:
    """The profiler's operator tables shown (the largest T of each configuration) and a note on what is missing."""
    ops_file = _run_folder(path) / "profile" / "ops.parquet"
    if not ops_file.is_file():
        return [], ("No operator profile in this run folder, so there is no per-operator breakdown: "
                    "`attnbench run --profile` adds profile/ops.parquet (`attnbench profile` writes "
                    "TensorBoard traces only).")
    profile, profile_note = [], None
    try:
        ops = pd.read_parquet(ops_file)
        every = an.profile_tables(ops, top=top_ops)
        for i, p in enumerate(every):
            p["table"] = tables.add(f"profile_ops_{i + 1}", p["table"])
        profile = _pick_profiles(every)
        if not every:
            profile_note = f"{ops_file} has no operator rows."
        elif len(profile) < len(every):
            profile_note = (f"Shown: {len(profile)} of {len(every)} profiled configurations (the largest T of "
                            "each); every table is in tables/profile_ops_*.csv.")
    except Exception as exc:  # a broken side file must not sink the whole report
        profile_note = f"{ops_file} could not be read ({type(exc).__name__}: {exc}); operator tables omitted."
    return profile, profile_note


def _summary(df, ok, n_noisy: int) -> dict:
    """The page's summary counts (cells, statuses, flags, implementations, the T range)."""
    distinct_t = sorted(ok["seq_len"].unique().tolist())
    return {
        "cells": len(df), "ok": len(ok), "skipped": int((df["status"] == "skipped").sum()),
        "failed": int((~df["status"].isin(["ok", "skipped"])).sum()), **{f"n_{k}": v for k, v in flag_counts(df).items()},
        "over_peak": int((pd.to_numeric(ok["frac_peak"], errors="coerce") > 1).sum()) if "frac_peak" in ok else 0,
        "impls": an.impl_order(df), "ok_impls": an.impl_order(ok), "configurations": len(an.groups(df)),
        "t_range": an.t_range(distinct_t) if distinct_t else "no successful T", "n_t": len(distinct_t),
        "noisy": n_noisy, "statuses": df["status"].value_counts().to_dict(),
    }


def _headline(fastest: pd.DataFrame) -> list[str]:
    """One sentence per configuration: the fastest implementation at its largest T, and by how much."""
    headline = []
    if len(fastest):
        last = fastest.sort_values("seq_len").groupby("configuration", sort=False).tail(1)
        for r in last.itertuples():
            headline.append(f"At T={r.seq_len} on {r.configuration}, {r.fastest} is fastest ({r.median})"
                            + (f", {fmt_lead(r.runner_up_slower_x, r.runner_up)}" if r.runner_up != "–" else "")
                            + (f" — {r.note}" if r.note else "") + ".")
    return headline
