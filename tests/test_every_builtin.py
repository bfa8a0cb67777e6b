"""Issue 45: every registered built-in in every mode and variant it declares, through the runner, with no error row.

Nothing here names an implementation. The cells come from the registry: for each built-in, the sweep axes its
:class:`~attnbench.plugins.catalog.Implementation` declares (grouped-query and multi-query heads, sliding windows,
bidirectional attention, a KV cache: decode, paged and contiguous; RoPE styles, QK-norm, score scale, softcap; the
masks it computes; variable-length batches) beside the modes and scopes every layer has, at tiny sizes on the CPU in
float32, under both setup policies. A :class:`~attnbench.runner.sweep.Sweep` makes the cells, so they are the cells
``attnbench run`` would make, and :func:`~attnbench.runner.group.measure_unit` measures each in this process, as every
measuring process does (one timed call; accuracy, peak memory and FLOPs as in a run).

The full product of those axes runs to hundreds of cells per implementation, so the fast set runs an all-pairs
design: a subset in which every pair of values of two axes that some runnable cell has occurs in at least one cell
(every mode with every kv-head count, window, mask, positional setting, scope, ...). Cells the runner will skip are
checked apart (cheaply: they are resolved, never built): each must say why. Implementations that attend with
FlexAttention (its eager CPU path is seconds per cell) and the ``hf:`` built-ins resolved on demand are in the slow
set.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools

import pytest

from attnbench import registry
from attnbench.cli.closing import FAILED
from attnbench.errors import AttnbenchError, SweepError
from attnbench.plugins.catalog import MASK_KINDS
from attnbench.results.schema import Cell
from attnbench.runner import setup
from attnbench.runner.cell import skip_reason
from attnbench.runner.group import measure_unit
from attnbench.runner.setup import POLICIES
from attnbench.runner.sweep import Settings, Sweep
from attnbench.runner.workload import spec_for

TINY = dict(device=("cpu",), dtype=("float32",), batch=(2,), seq_len=(8,), num_heads=(4,), d_model=(16,),
            layers=(1,), vocab=(32,), new_tokens=(2,))
"""The grid: 4 heads of 4 features, 8 tokens (a window of 4 and pages of 4 tokens split them), a GPT of one block."""
SETTINGS = Settings(budget_s=0.0, target_rel_ci=1.0, warmup_calls=1, warmup_s=0.0, min_samples=1, max_samples=1,
                    threads=1, flop_check=False)
"""One warm-up call and one timed call per cell, one thread, no cross-check of the FLOP count by torch's counter (a
third of the time); the rest (accuracy, peak memory, FLOPs, timeouts) as ``attnbench run``."""
MODES = ("inference", "forward", "forward+backward", "train", "generate-cache", "generate-nocache")
"""Every mode but decode (which a KV cache declares); train and generate exist only at block / model scope."""
MASK_EXAMPLES = {"alibi": "alibi", "prefix": "prefix:3", "document": "document:2", "sink": "sink"}
"""A ``--mask`` value of each mask kind an implementation may declare (a new kind needs one here)."""
FACTORS = ("scope", "mode", "num_kv_heads", "window", "causal", "positional", "mask", "page_size", "lengths", "setup")
"""The axes the all-pairs design covers (``setup``: the policy of :mod:`attnbench.runner.setup`, a setting)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One cell and the setup policy it runs under."""

    cell: Cell
    setup: str

    def values(self) -> tuple:
        return tuple((f, self.setup if f == "setup" else getattr(self.cell, f)) for f in FACTORS)

    def pairs(self) -> set:
        return set(itertools.combinations(self.values(), 2))


def positional_values(impl) -> list[str]:
    """The ``positional`` settings ``impl`` declares (:mod:`attnbench.runner.positional`), besides none."""
    values = [f"rope_theta=10000;rope_style={style}" for style in impl.rope]
    values += ["rope_theta=500000;rope_scaling=llama3"] if impl.rope else []
    values += [f"qk_norm={where}" for where in impl.qk_norm]
    values += ["scale=0.3"] if impl.score_scale else []
    values += ["softcap=2"] if impl.softcap else []
    return values


def declared_cells(name: str) -> list[Cell]:
    """The cells of sweeps of every mode, scope and variant ``name`` declares; one sweep per mask and causality, so
    that the pair a sweep refuses (a prefix without causality: a usage error, not a row) drops only its cells."""
    impl = registry.get(name)
    axes = dict(TINY, impl=(name,), scope=("layer", "block", "model"),
                mode=MODES + (("decode",) if impl.kv_cache else ()),
                num_kv_heads=(None, 1, 2) if impl.gqa else (None,),
                window=(None, 4) if impl.sliding_window else (None,),
                positional=("", *positional_values(impl)),
                page_size=(0, 4) if impl.kv_cache else (0,),
                lengths=("", "uniform:2-12") if impl.varlen else ("",))
    cells = []
    for mask, causal in itertools.product(("", *(MASK_EXAMPLES.get(k, k) for k in impl.masks)),
                                          (True, False) if impl.non_causal else (True,)):
        try:
            cells += Sweep(**axes, mask=(mask,), causal=(causal,)).cells()
        except SweepError as exc:
            if "prefix" not in mask or causal:  # only the documented refusal; anything else is the test's to fix
                raise AssertionError(f"{name}: the sweep refuses mask {mask!r}, causal {causal}: {exc}") from exc
    return cells


def all_pairs(cases: list[Case]) -> list[Case]:
    """A subset of ``cases`` in which every pair of factor values that occurs in ``cases`` occurs (greedy: the case
    covering most pairs not yet covered, preferring layer cells, which are cheaper; deterministic)."""
    pairs = [c.pairs() for c in cases]
    todo = set().union(*pairs)
    chosen = []
    while todo:
        i = max(range(len(cases)), key=lambda i: (len(pairs[i] & todo), cases[i].cell.scope == "layer"))
        chosen.append(cases[i])
        todo -= pairs[i]
    return chosen


def design(name: str) -> tuple[list[Case], list[Case]]:
    """``name``'s cases to measure (an all-pairs design of its runnable cells) and to check as skipped (an all-pairs
    design of the cells the runner resolves as impossible here)."""
    runs = {cell: skip_reason(cell) is None for cell in dict.fromkeys(declared_cells(name))}
    cases = {True: [], False: []}
    for cell, policy in itertools.product(runs, POLICIES if has_prepare(name) else POLICIES[:1]):
        cases[runs[cell]].append(Case(cell, policy))
    return all_pairs(cases[True]), (all_pairs(cases[False]) if cases[False] else [])


def has_prepare(name: str) -> bool:
    """Whether ``name``'s module has a setup step (``prepare``), so that the setup policy is a variant of its cells
    (True when it cannot be built at the tiny shape here: then both policies are tried)."""
    try:
        module = registry.get(name).build(spec_for(Cell(name, batch=2, seq_len=8, num_heads=4, d_model=16)))
    except AttnbenchError:
        return True
    return setup.prepare_of(module) is not None


def uses_flex(name: str) -> bool:
    """Whether ``name`` attends with FlexAttention (its registered source says so): seconds per cell eagerly."""
    return "flex_attention" in registry.get(name).source.lower().replace("flexattention", "flex_attention")


def builtins() -> list:
    """Every registered built-in (flex ones marked slow), then the shipped names resolved on demand (``hf:``; slow)."""
    names = [n for n in registry.names() if registry.get(n).origin == "builtin"]
    # hf:*@flex_attention are left out: torch compiles each (100-427 s a name on 2 cores: the slow set's budget), and
    # torch 2.13's CPU inductor fails to build its own sliding-window decode kernel for two of them ("'cur_kvSplitSize0'
    # was not declared": a torch bug, not attnbench's; their rows say so when run)
    on_demand = [n for n in registry.listed() if n not in registry.names() and not n.endswith("@flex_attention")]
    return ([pytest.param(n, marks=[pytest.mark.slow] if uses_flex(n) else []) for n in names]
            + [pytest.param(n, marks=pytest.mark.slow) for n in on_demand])


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """The runner collects garbage after every cell; with torch and what a first cell of each kind imports, a full
    collection takes about half a second. Those are imported here, by a cell of each scope, then frozen (moved out of
    the collector's reach) with what exists now, so that each cell's collection sees only what later cells make."""
    warm = Sweep(impl=("kv_concat",), mode=("forward+backward", "train", "generate-cache", "decode"),
                 scope=("layer", "block", "model"), **TINY)
    run_cases([Case(c, POLICIES[0]) for c in warm.cells()])
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _refrozen():
    """What the tests before this one left behind, frozen too (uncollected garbage stays until the module ends)."""
    gc.freeze()


def run_cases(cases: list[Case]) -> list[dict]:
    """Each case measured as a unit of its own (the path of ``attnbench run --impl NAME``)."""
    return [row for c in cases for row in measure_unit((c.cell,), dataclasses.replace(SETTINGS, setup=c.setup), "t")]


@pytest.mark.parametrize("name", builtins())
def test_every_declared_mode_and_variant_runs_without_an_error_row(name):
    measured, skipped = design(name)
    rows = run_cases(measured)
    failed = [f"{r['cell_id']} (setup {c.setup}): {r['status']}: {r['error']}"
              for c, r in zip(measured, rows, strict=True) if r["status"] in FAILED]
    assert not failed, f"{len(failed)} of {len(rows)} cells of {name} failed:\n" + "\n".join(failed)
    assert {r["status"] for r in rows} <= {"ok", "skipped"}, {r["status"] for r in rows}
    resolved_impossible = run_cases(skipped)
    wrong = [f"{r['cell_id']}: {r['status']}: {r['error']}" for r in resolved_impossible if r["status"] != "skipped"]
    assert not wrong, f"{name}: cells resolved as impossible here, but not skipped rows: {wrong}"
    silent = [r["cell_id"] for r in rows + resolved_impossible if r["status"] != "ok" and not str(r["error"]).strip()]
    assert not silent, f"{name}: rows that do not say why they did not run: {silent}"


def test_the_design_covers_every_declared_pair_and_a_new_implementation():
    """The generator itself: every pair of declared values occurs, and a newly registered implementation is among
    the parameters with its own axes, without editing this file."""
    measured, _ = design("kv_concat")
    covered = set().union(*(c.pairs() for c in measured))
    for mode in ("inference", "forward", "forward+backward", "decode"):
        for kv in (None, 1, 2):
            assert (("mode", mode), ("num_kv_heads", kv)) in covered
        assert (("mode", mode), ("window", 4)) in covered
    assert (("mode", "decode"), ("page_size", 4)) in covered  # a contiguous cache in a paged group
    assert {"layer", "block", "model"} <= {c.cell.scope for c in measured}
    assert len(measured) < 100  # pairs, not the product (hundreds of cells)

    from attnbench.implementations.gqa import SDPAGQA, VARIANTS, _factory

    registry.register("issue45_new_impl", _factory(SDPAGQA), **VARIANTS, masks=("alibi",), source="a test's")
    try:
        assert "issue45_new_impl" in [p.values[0] for p in builtins()]
        cells = [c.cell for c in design("issue45_new_impl")[0]]
        assert {"alibi"} <= {c.mask for c in cells} and {1, 2} <= {c.num_kv_heads for c in cells}
    finally:
        registry.unregister("issue45_new_impl")
    assert set(MASK_EXAMPLES) == set(MASK_KINDS)
