"""Shared fixtures: a CUDA skip, the repo as working directory, plug-ins on sys.path, an isolated registry, one thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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

    registry._load_builtins()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
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


@pytest.fixture(autouse=True)
def _private_machine_lock(tmp_path_factory, monkeypatch):
    """No test takes this user's machine lock (~/.cache/attnbench/locks): each sees a lock folder of its own, so a
    test's runs never wait for a real measurement (nor for each other), and a real measurement never waits for them."""
    monkeypatch.setenv("ATTNBENCH_LOCK_DIR", str(tmp_path_factory.mktemp("locks")))
    monkeypatch.setenv("ATTNBENCH_MACHINE_LOCK_HELD", "")  # restored after the test, even if a test leaks a holder
