"""Shared fixtures: a CUDA skip, the repo as working directory, plug-ins on sys.path, an isolated registry, one thread."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The CLI's console follows COLUMNS when its output is not a terminal (issue 45); pytest-xdist's workers inherit
# COLUMNS=80 from the terminal machinery, which would wrap every table and path the tests read. Tests that are about
# COLUMNS set it themselves (tests/test_newcomer.py runs a subprocess with it).
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

REPO = Path(__file__).resolve().parent.parent
PLUGINS = REPO / "tests" / "plugins"


@pytest.fixture
def cuda_device() -> str:
    """``"cuda"``, or skip the test (with the reason) when no CUDA device is usable here."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    return "cuda"


@pytest.fixture
def repo_cwd(monkeypatch) -> Path:
    """Run from the repository root, so plug-in names read as a user types them: ``tests/plugins/buggy.py:Class``."""
    monkeypatch.chdir(REPO)
    return REPO


@pytest.fixture
def plugins_on_path(monkeypatch):
    """``tests/plugins`` on ``sys.path`` so ``buggy:Class`` / ``good:Class`` import as ``package.module:Class``."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    yield PLUGINS
    imported = [n for n, m in sys.modules.items() if not n.startswith("attnbench_plugin_")
                and Path(getattr(m, "__file__", None) or "/").parent == PLUGINS]
    for name in imported:
        del sys.modules[name]


@pytest.fixture
def isolated_registry(monkeypatch):
    """The registry with built-ins loaded; what the test registers or reads from entry points is forgotten after."""
    from attnbench import registry
    from attnbench.plugins import catalog

    registry._load_builtins()
    monkeypatch.setattr(catalog, "_REGISTRY", dict(catalog._REGISTRY))
    monkeypatch.setattr(registry, "_RESOLVED", {})
    monkeypatch.setitem(registry._LOADED, "entry_points", False)
    return registry


@pytest.fixture
def single_thread():
    """One intra-op CPU thread while the test runs: the correctness matrix's tensors are tiny, and on a loaded
    machine two spinning OpenMP threads make it an order of magnitude slower, not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def synthetic_bursts(monkeypatch):
    """Interleaved bursts that report what each member returns (a per-call time) instead of timing it: steady,
    drifting or noisy members exactly as a test writes them (real 1-ms bursts of a no-op can be 20x apart on a
    loaded machine)."""
    from attnbench.measure import interleave

    monkeypatch.setattr(interleave, "_burst_cpu", lambda fn, blocks, block_calls, between=None: [fn() for _ in range(blocks)])


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """No test leaks a changed torch thread count into the next (rows record the threads they ran with)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _shared_measuring_workers():
    """Runs in the test session share their measuring worker processes (attnbench.runner.executors.local.WorkerPool):
    each run would otherwise start its own and import torch again (seconds each). Tests about isolation use
    ``isolate`` (never shared) or start ``WorkerProcess`` themselves."""
    from attnbench.runner.executors.local import shared_workers

    with shared_workers():
        yield


@pytest.fixture(autouse=True)
def _private_drift_calibration(tmp_path_factory, monkeypatch):
    """No test reads or writes this machine's drift calibration (~/.cache/attnbench/drift.json): each sees an
    empty file of its own, so runs use the documented default (attnbench.measure.drift)."""
    monkeypatch.setenv("ATTNBENCH_DRIFT_FILE", str(tmp_path_factory.mktemp("drift") / "drift.json"))


MOCK_CEILING = {"gflops_per_s": 1e6, "gflops_rel": 0.02, "gbytes_per_s": 1e6, "gbytes_rel": 0.02,
                "cache_bytes": 32 * 2**20, "date": "mock", "conditions": {"mock": True}}
"""The roofline ceilings every test's rows see (issue 49): far above any CPU, so no real row reads implausible."""


@pytest.fixture(scope="session", autouse=True)
def _mock_roofline_ceilings(tmp_path_factory):
    """No test reads, writes or measures this machine's roofline ceilings (~/.cache/attnbench/ceilings.json): the
    session's file holds :data:`MOCK_CEILING` for every dtype and thread count here (measuring processes inherit it)."""
    import json
    import os

    from attnbench.measure import roofline

    path = tmp_path_factory.mktemp("ceilings") / "ceilings.json"
    keys = [roofline.machine_key("cpu", d, t) for d in roofline.DTYPES for t in range(1, max(8, os.cpu_count() or 1) + 1)]
    path.write_text(json.dumps(dict.fromkeys(keys, MOCK_CEILING)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(roofline.ENV_FILE, str(path))
        yield path


@pytest.fixture(autouse=True)
def _private_machine_lock(tmp_path_factory, monkeypatch):
    """No test takes this user's machine lock (~/.cache/attnbench/locks): each sees a lock folder of its own, so a
    test's runs never wait for a real measurement (nor for each other), and a real measurement never waits for them."""
    monkeypatch.setenv("ATTNBENCH_LOCK_DIR", str(tmp_path_factory.mktemp("locks")))
    monkeypatch.setenv("ATTNBENCH_MACHINE_LOCK_HELD", "")  # restored after the test, even if a test leaks a holder


@pytest.fixture(scope="session")
def matrix_results():
    """``run_matrix`` with the session's results kept per (implementation, kind, seed, device): a test that needs
    cases another test already ran reads them, and only the kinds it asks for run or are returned.

    Call it as ``matrix_results(impls, kinds=None, seed=0, device="cpu")``. Names are resolved by the registry as
    usual, so use it only for names every test sees alike (built-ins and ``tests/plugins/...`` files from the
    repository root, with ``repo_cwd``), never for names a test registers itself."""
    import pandas as pd

    from attnbench.correctness.matrix import cases, run_matrix

    store: dict[tuple[str, str, int, str], pd.DataFrame] = {}
    order = {(c.kind, "book" if c.kind == "golden" else c.shape.id, c.dtype): i for i, c in enumerate(cases())}

    def run(impls, kinds=None, seed: int = 0, device: str = "cpu") -> pd.DataFrame:
        wanted = list(kinds) if kinds is not None else list(dict.fromkeys(c.kind for c in cases()))
        frames = []
        for impl in impls:
            missing = [k for k in wanted if (impl, k, seed, device) not in store]
            if missing:
                df = run_matrix([impl], device=device, kinds=missing, seed=seed)
                for kind in missing:
                    store[(impl, kind, seed, device)] = df[df.kind == kind]
            part = pd.concat([store[(impl, k, seed, device)] for k in wanted], ignore_index=True)
            rank = [order.get((r.kind, r.shape, r.dtype), len(order)) for r in part.itertuples()]
            frames.append(part.assign(_rank=rank).sort_values("_rank", kind="stable").drop(columns="_rank"))
        return pd.concat(frames, ignore_index=True).copy()

    return run
