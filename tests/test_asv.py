"""The asv suite (a thin view over the registry), its CI smoke assumptions, and the regression gate."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH_ONE = r"Attention.time_step\('weight_split', 'forward', 64, 256\)"

asv = pytest.importorskip("asv", reason="the asv extra is not installed")


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(REPO))
    try:
        yield importlib.import_module("benchmarks.bench_attention")
    finally:
        sys.path.remove(str(REPO))


def test_config_is_existing_env_forkserver_under_dot_asv():
    from asv.config import Config

    conf = Config.load(str(REPO / "asv.conf.json"))
    assert conf.project == "attnbench" and conf.repo == "." and conf.branches == ["main"]
    assert conf.environment_type == "existing"
    assert conf.launch_method == "forkserver"
    assert conf.benchmark_dir == "benchmarks"
    for key in ("results_dir", "html_dir", "env_dir"):
        assert getattr(conf, key).startswith(".asv/"), key


def test_suite_is_a_thin_view_over_the_registry(suite):
    from attnbench import registry

    impls, modes, seq_lens, widths = suite.Attention.params
    assert set(impls) <= set(registry.names()) and "weight_split" in impls and "sdpa" in impls
    assert not any(name.startswith("compiled:") for name in impls)
    assert modes == ["inference", "forward", "forward+backward"]
    assert suite.Attention.param_names == ("impl", "mode", "seq_len", "d_model")
    assert suite.Attention.track_peak_bytes.unit == "bytes"
    assert suite.Attention.track_gflops.unit == "GFLOP/s"
    assert suite.Compile.track_compile_s.unit == "seconds"
    # asv collects any module-level callable named like a benchmark
    assert not [n for n in vars(suite) if n.startswith(("time_", "track_", "mem_", "peakmem_", "timeraw_"))]


def test_decode_benchmark_tracks_bandwidth(suite, single_thread):
    bench = suite.Decode()
    bench.setup("kv_prealloc", 2, 512)
    gbytes = bench.track_gbytes_per_s("kv_prealloc", 2, 512)
    assert gbytes > 0 and 0 < bench.track_frac_peak_bw("kv_prealloc", 2, 512)
    assert (suite.Decode.track_gbytes_per_s.unit, suite.Decode.track_frac_peak_bw.unit) == ("GB/s", "fraction")
    from attnbench.tools.asv_gate import HIGHER_IS_BETTER

    assert HIGHER_IS_BETTER.search("bench_attention.Decode.track_gbytes_per_s('kv_prealloc', 2, 512)")


def test_rope_benchmark_decodes_a_llama3_style_layer(suite, single_thread):
    bench = suite.Rope()
    bench.setup("rope_sdpa", "decode", 256)
    bench.time_step("rope_sdpa", "decode", 256)
    cell = bench.workload.cell
    assert (cell.num_kv_heads, cell.positional) == (2, "rope_theta=500000;rope_scaling=llama3;qk_norm=head")
    bench.teardown("rope_sdpa", "decode", 256)
    cache = suite.RopeCache()
    cache.setup("rope_sdpa", 256)
    assert cache.track_kv_cache_bytes("rope_sdpa", 256) >= 2 * 2 * 256 * 2 * 64 * 4  # 2·b·T·kv·hd·4 bytes
    assert "rope_math" in suite.Rope.params[0] and not {"rope_sdpa", "rope_math"} & set(suite.Attention.params[0])


def test_suite_runs_one_cell_and_skips_impossible_ones(suite, single_thread):
    bench = suite.Attention()
    bench.setup("weight_split", "forward+backward", 64, 256)
    bench.time_step("weight_split", "forward+backward", 64, 256)
    assert bench.track_peak_bytes("weight_split", "forward+backward", 64, 256) > 0
    assert bench.track_gflops("weight_split", "forward+backward", 64, 256) > 0
    if "flex" in suite.Attention.params[0]:
        with pytest.raises(NotImplementedError):
            suite.Attention().setup("flex", "forward+backward", 64, 256)


def test_suite_measures_under_the_controlled_environment(suite):
    from attnbench.measure import cpu_env

    assert suite.OMP_BINDING == cpu_env.OMP_BINDING  # set before torch loads, so a copy; it must not drift
    env = cpu_env.process_env(cpu_env.CpuEnv("pinned"), base={})
    assert {k: env[k] for k in cpu_env.OMP_BINDING} == cpu_env.OMP_BINDING
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(cpu_env.PINNED_THRESHOLD_BYTES)  # what the gate starts asv with


def test_parse_compare_reads_marks_and_higher_is_better():
    from attnbench.tools.asv_gate import _drop_unmeasured, _worse_rows, parse_compare

    table = textwrap.dedent("""
        Benchmarks that have stayed the same:

        | Change   | Before [aaaa] <a>   | After [bbbb] <b>   | Ratio   | Benchmark (Parameter)     |
        |----------|---------------------|--------------------|---------|---------------------------|
        |          | n/a                 | n/a                | n/a     | b.A.time_step('x', 1)     |
        |          | 1.00±0.01ms         | 1.10±0.01ms        | 1.10    | b.A.time_step('y', 1)     |

        Benchmarks that have improved:

        | Change   | Before [aaaa] <a>   | After [bbbb] <b>   |   Ratio | Benchmark (Parameter)     |
        |----------|---------------------|--------------------|---------|---------------------------|
        | -        | 10                  | 4                  |    0.40 | b.A.track_gflops('y', 1)  |
        | -        | 2.00±0.01ms         | 1.00±0.01ms        |    0.50 | b.A.time_step('z', 1)     |

        Benchmarks that have got worse:

        | Change   | Before [aaaa] <a>   | After [bbbb] <b>   |   Ratio | Benchmark (Parameter)     |
        |----------|---------------------|--------------------|---------|---------------------------|
        | +        | 1.00±0.01ms         | 3.00±0.01ms        |    3.00 | b.A.time_step('w', 1)     |
        | !        | 1.00±0.01ms         | failed             |     n/a | b.A.time_step('v', 1)     |
        | +        | 4                   | 10                 |    2.50 | b.A.track_gflops('w', 1)  |
        """)
    bad = parse_compare(table)  # track_* figures have no samples: reported, never failing the gate
    assert [line.rsplit("|", 2)[-2].strip() for line in bad] == ["b.A.time_step('w', 1)", "b.A.time_step('v', 1)"]
    regressions, reported = _worse_rows(table)
    assert regressions == bad
    assert [line.rsplit("|", 2)[-2].strip() for line in reported] == ["b.A.track_gflops('y', 1)"]
    shown = _drop_unmeasured(table)
    assert "time_step('x', 1)" not in shown and "time_step('y', 1)" in shown


def test_a_timed_slowdown_fails_the_gate_only_if_the_confirmation_finds_it_again():
    from attnbench.tools.asv_gate import GateResult, confirm_regressions, report

    first = [
        "| +        | 1.00±0.01ms         | 3.00±0.01ms        |    3.00 | b.A.time_step('w', 1)     |",
        "| +        | 1.00±0.01ms         | 1.50±0.50ms        |    1.50 | b.A.time_step('u', 1)     |",
        "| !        | 1.00±0.01ms         | failed             |     n/a | b.A.time_step('v', 1)     |",
    ]
    again = textwrap.dedent("""
        Benchmarks that have got worse:

        | Change   | Before [aaaa] <a>   | After [bbbb] <b>   |   Ratio | Benchmark (Parameter)     |
        |----------|---------------------|--------------------|---------|---------------------------|
        | +        | 1.00±0.01ms         | 3.01±0.01ms        |    3.01 | b.A.time_step('w', 1)     |

        Benchmarks that have stayed the same:

        | Change   | Before [aaaa] <a>   | After [bbbb] <b>   |   Ratio | Benchmark (Parameter)     |
        |----------|---------------------|--------------------|---------|---------------------------|
        |          | 1.00±0.01ms         | 1.01±0.01ms        |    1.01 | b.A.time_step('u', 1)     |
        """)
    still, unconfirmed = confirm_regressions(first, again)
    assert still == [first[0], first[2]]  # slower again; newly failing needs no confirmation
    assert unconfirmed == [first[1]]  # a burst of load in the first pass
    lines: list[str] = []
    code = report(GateResult("a" * 40, "b" * 40, "", still, [], [], unconfirmed), 1.2, log=lines.append)
    assert code == 1 and any("not when measured again" in line for line in lines)
    lines.clear()
    assert report(GateResult("a" * 40, "b" * 40, "", [], [], [], unconfirmed), 1.2, log=lines.append) == 0
    assert any("time_step('u', 1)" in line for line in lines) and any("gate: OK" in line for line in lines)


@pytest.mark.slow
def test_asv_run_exits_nonzero_when_a_benchmark_fails(tmp_path):
    """What the CI smoke relies on: `asv run --quick --dry-run` exits 2 when any benchmark (or parameter) fails."""
    conf = {"version": 1, "project": "t", "repo": ".", "branches": ["main"], "environment_type": "existing",
            "benchmark_dir": "benchmarks", "results_dir": ".asv/results", "html_dir": ".asv/html",
            "env_dir": ".asv/env", "launch_method": "forkserver"}
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "bench_x.py").write_text(textwrap.dedent("""
        class X:
            params = [1, 2]

            def time_ok(self, p):
                pass

            def time_broken(self, p):
                if p == 2:
                    raise ValueError("deliberately broken")
        """))
    (tmp_path / "home").mkdir()
    env = {**_clean_env(), "HOME": str(tmp_path / "home")}
    base = [sys.executable, "-m", "asv", "--config", str(tmp_path / "asv.conf.json")]
    subprocess.run([*base, "machine", "--yes"], env=env, check=True, capture_output=True)
    run = [*base, "run", "--python=same", "--quick", "--dry-run"]
    ok = subprocess.run([*run, "--bench", "time_ok"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = subprocess.run(run, env=env, capture_output=True, text=True)
    assert broken.returncode == 2, broken.stdout + broken.stderr
    assert "deliberately broken" in broken.stdout + broken.stderr


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASV_PYTHONPATH")}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=attnbench-test", "-c", "user.email=test@attnbench.invalid",
                           "-c", "commit.gpgsign=false", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def _install_state() -> tuple[str, str]:
    """Where a fresh interpreter imports attnbench from, and pip's record of how it was installed."""
    code = ("import importlib.util, importlib.metadata as m; s = importlib.util.find_spec('attnbench');"
            "print(s.origin); print(m.distribution('attnbench').read_text('direct_url.json'))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=_clean_env(), capture_output=True, text=True,
                         check=True).stdout
    first, _, rest = out.partition("\n")
    return first, rest


@pytest.mark.slow
def test_gate_fails_a_slowdown_and_passes_an_unchanged_commit(tmp_path):
    """A: the project; B: weight_split sleeps 5 ms per forward (≥4x slower); C: A plus a comment.

    The gate runs only weight_split forward at T=64 (one asv benchmark) so it stays around a minute a side.
    """
    from attnbench.tools.asv_gate import main

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of attnbench")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    repo = tmp_path / "repo"
    for name in filter(None, files):
        top = REPO / Path(name).parts[0]
        if top.name.startswith(".venv") or (top / "pyvenv.cfg").exists():
            continue  # an un-ignored virtualenv inside the checkout (e.g. CI's .venv-ci)
        src = REPO / name
        if src.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "A")
    book = repo / "implementations" / "book.py"
    original = book.read_text()
    anchor = "class MultiHeadAttention(AttentionModule):"
    head, tail = original.split(anchor, 1)
    slowed = tail.replace("        self.check_input(x)\n",
                          "        self.check_input(x)\n        __import__('time').sleep(0.005)  # deliberate regression\n", 1)
    assert slowed != tail
    book.write_text(head + anchor + slowed)
    _git(repo, "commit", "-qam", "B: slow weight_split")
    book.write_text(original + "# a comment: same behaviour as A\n")
    _git(repo, "commit", "-qam", "C: comment only")

    before = _install_state()
    common = ["--repo", str(repo), "--factor", "2.0", "--bench", BENCH_ONE]
    assert main(["HEAD~2", "HEAD~1", *common]) == 1  # A -> B: regression
    assert main(["HEAD~2", "HEAD", *common]) == 0  # A -> C: unchanged
    assert _install_state() == before  # the environment's install is untouched
    assert _git(repo, "status", "--porcelain") == ""
    assert _git(repo, "worktree", "list").count("\n") == 0


def test_varlen_benchmark_times_one_longtail_batch_and_its_setup(suite, single_thread):
    """Issue 37: the variable-length batch, padded vs packed vs per sequence; the setup alone tracked apart."""
    assert not {"varlen_padded", "varlen_packed"} & set(suite.Attention.params[0])  # not in the rectangular grid
    bench = suite.Varlen()
    bench.setup("varlen_packed", "longtail")
    try:
        bench.time_step("varlen_packed", "longtail")
        assert bench.track_setup_s("varlen_packed", "longtail") > 0 and suite.Varlen.track_setup_s.unit == "seconds"
    finally:
        bench.teardown("varlen_packed", "longtail")
