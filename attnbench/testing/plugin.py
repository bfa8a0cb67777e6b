"""The attnbench pytest plug-in (entry point ``pytest11: attnbench``): the correctness matrix as pytest items.

``--attnbench IMPL`` (repeatable) adds IMPL's matrix to the session; a ``test_*`` attribute made by
:func:`attnbench.testing.matrix` in a test file does the same. Each case is one item named
``kind[dtype-shape-bBxT-variant]``; a failed case fails with the line ``attnbench check`` prints (and under it, as
``check`` prints them, its first divergence and the command that reruns it), a case the
implementation cannot run is skipped with the capability's reason, and a setup error (import, constructor,
weight mapping) is one erroring item ``setup`` with the one-line message. attnbench and torch are imported
only when a matrix is collected, so the plug-in costs nothing in other test sessions.
"""

from __future__ import annotations

import pytest

from attnbench.testing import Matrix


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnbench", "attnbench correctness matrix")
    group.addoption("--attnbench", action="append", default=[], metavar="IMPL",
                    help="add IMPL's correctness matrix (NAME, file.py:Class, package.module:Class); repeatable")
    group.addoption("--attnbench-device", default="cpu", metavar="DEVICE", help="device for --attnbench (default cpu)")
    group.addoption("--attnbench-kind", action="append", default=None, metavar="KIND",
                    help="only these case kinds for --attnbench (forward, backward, causality, ...); repeatable")


def variant(spec) -> str:
    """``mha``/``gqa2``/``mqa``, then ``-win4`` and ``-noncausal`` where they apply."""
    kv = spec.num_kv_heads or spec.num_heads
    text = "mha" if kv == spec.num_heads else "mqa" if kv == 1 else f"gqa{spec.num_heads // kv}"
    return text + (f"-win{spec.window}" if spec.window else "") + ("" if spec.causal else "-noncausal")


def case_id(case) -> str:
    """A case's item name: kind, then dtype, shape id, batch x T and variant, e.g. ``forward[float32-gqa-b2xT9-gqa2]``."""
    shape = case.shape
    return f"{case.kind}[{case.dtype}-{shape.id}-b{shape.batch}xT{shape.seq_len}-{variant(shape.spec)}]"


class MatrixCollector(pytest.Collector):
    """One implementation's matrix: a ``setup`` error item when it does not import, construct or map its
    weights, else one :class:`CaseItem` per case of :func:`attnbench.correctness.matrix.cases`."""

    def __init__(self, *, matrix: Matrix, **kwargs) -> None:
        super().__init__(**kwargs)
        self.matrix = matrix

    def collect(self):
        from attnbench.correctness.matrix import cases
        from attnbench.correctness.setup import available, prepared
        from attnbench.devices import parse_device

        m = self.matrix
        try:
            selected = cases(m.kinds)  # an unknown kind is a SweepError naming the kinds
            device = str(parse_device(m.device))
            impl = available(m.impl, device)
            prepared(impl, device)
        except Exception as exc:  # AttnbenchError as check prints it; anything else names its type
            from attnbench.errors import AttnbenchError

            message = f"error: {exc}" if isinstance(exc, AttnbenchError) else f"error: {type(exc).__name__}: {exc}"
            return [SetupError.from_parent(self, name="setup", nodeid=self._child_id("setup"), message=message.splitlines()[0])]
        return [CaseItem.from_parent(self, name=case_id(case), nodeid=self._child_id(case_id(case)), impl=impl, case=case,
                                     device=device, seed=m.seed) for case in selected]

    def _child_id(self, name: str) -> str:
        """The child's id as a string, so it parses back (``--lf``, xdist) into the id the item has: a child name
        ``kind[params]`` built with ``NodeId.child`` would keep the brackets in its name, the string splits them off."""
        return f"{self.nodeid}::{name}"

    def reportinfo(self):
        return self.path, 0, self.name


class SetupError(pytest.Item):
    """Errors in setup with the one-line message (the cases of an implementation that cannot be set up never run)."""

    def __init__(self, *, message: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.message = message

    def setup(self) -> None:
        pytest.fail(self.message, pytrace=False)

    def runtest(self) -> None:  # never reached: setup fails
        pytest.fail(self.message, pytrace=False)

    def reportinfo(self):
        return self.path, 0, f"{self.parent.name}::setup"


_LOCALIZED: set[tuple] = set()
"""(implementation, kind, device, seed) already localised in this process: once per failing kind."""


class CaseItem(pytest.Item):
    """One case: passes, fails with ``attnbench check``'s line for it, or skips with the capability's reason."""

    def __init__(self, *, impl, case, device: str, seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.impl, self.case, self.device, self.seed = impl, case, device, seed

    def runtest(self) -> None:
        import torch

        from attnbench.correctness.matrix import case_line, run_case

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as run_matrix: the check's tensors are tiny
        try:
            result = run_case(self.impl, self.case, self.device, self.seed)
        finally:
            torch.set_num_threads(threads)
        self.user_properties.append(("attnbench_status", result.status))
        if result.status == "skip":
            raise pytest.skip.Exception(result.message, _use_item_location=True)  # where a skip mark would point
        if result.status != "pass":
            pytest.fail("\n    ".join([case_line(result), *self._where(result)]), pytrace=False)

    def _where(self, result) -> list[str]:
        """Under a failed case: where the class first leaves the reference (issue 47; the first failed case of each
        implementation and kind in this process: a passing session costs nothing), and the ``attnbench check`` command
        that reruns the case alone."""
        from attnbench.correctness.localize import localize_case, repro_command

        lines = []
        key = (self.impl.name, self.case.kind, self.device, self.seed)
        if result.status == "fail" and key not in _LOCALIZED:
            _LOCALIZED.add(key)
            lines.append(localize_case(self.impl, self.case, self.device, self.seed, result.tolerance).line)
        return lines + [f"rerun: {repro_command(self.impl.name, self.case, self.seed, self.device)}"]

    def reportinfo(self):
        return self.path, 0, f"{self.parent.name}::{self.name}"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """``test_mine = attnbench.testing.matrix(...)`` in a test module: its matrix, under that name."""
    if isinstance(obj, Matrix) and collector.funcnamefilter(name):
        return MatrixCollector.from_parent(collector, name=name, matrix=obj)
    return None


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, --lf and xdist see the items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """``--attnbench IMPL``: each IMPL's matrix, after the test files' items."""
    device, kinds = config.getoption("attnbench_device"), config.getoption("attnbench_kind")
    for impl in config.getoption("attnbench"):
        name = f"attnbench[{impl}]"
        collector = MatrixCollector.from_parent(session, name=name, nodeid=name,
                                                matrix=Matrix(impl, device, tuple(kinds) if kinds else None))
        items.extend(session.genitems(collector))
