"""The pytest plug-in (attnbench.testing): the correctness matrix as pytest items, run through pytester.

Each test runs a pytest session inside this one and compares what it reports with what ``attnbench check``
computes (:func:`attnbench.correctness.matrix.run_matrix`, :func:`~attnbench.correctness.matrix.case_line`).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from attnbench.correctness.matrix import case_line, cases, run_matrix
from attnbench.testing.plugin import case_id

PLUGINS = Path(__file__).resolve().parent / "plugins"

pytest_plugins = ["pytester"]

KINDS = ("causality", "forward")


@pytest.fixture
def plugin_path():
    """An absolute ``tests/plugins/NAME`` (the inner sessions run in pytester's own folder)."""
    return lambda name: str(PLUGINS / name)


def outcomes(rec) -> dict[str, tuple[str, str]]:
    """nodeid -> (outcome, message) of each item: the call report, or the setup report when setup did not pass."""
    out = {}
    for rep in rec.getreports("pytest_runtest_logreport"):
        if rep.when == "call" or (rep.when == "setup" and not rep.passed):
            message = (rep.longrepr[2].removeprefix("Skipped: ") if rep.skipped else "" if rep.passed
                       else str(rep.longrepr).split("\n    ", 1)[0])  # check's line; under it, issue 47's lines
            out[rep.nodeid] = ("error" if rep.when == "setup" and rep.failed else rep.outcome, message)
    return out


def expected(impl: str, kinds=None) -> dict[str, tuple[str, str]]:
    """What ``attnbench check`` finds, keyed by the plug-in's item names."""
    df = run_matrix([impl], kinds=kinds)
    names = [case_id(c) for c in cases(kinds)]
    verdict = {"pass": "passed", "skip": "skipped", "fail": "failed", "error": "failed"}
    return {f"attnbench[{impl}]::{n}": (verdict[r.status], "" if r.status == "pass" else r.message if r.status == "skip"
                                        else case_line(r)) for n, r in zip(names, df.itertuples(), strict=True)}


def test_planted_bug_fails_the_cases_check_fails_with_its_messages(pytester, plugin_path, single_thread):
    impl = plugin_path("buggy.py") + ":NoMask"
    rec = pytester.inline_run("-p", "no:cacheprovider", "--attnbench", impl, *(f"--attnbench-kind={k}" for k in KINDS))
    got = outcomes(rec)
    assert got == expected(impl, KINDS)
    assert any(o == "failed" for o, _ in got.values()) and any(o == "passed" for o, _ in got.values())
    assert f"attnbench[{impl}]::causality[float64-props-b3xT11-mha]" in got
    skips = [m for o, m in got.values() if o == "skipped"]
    assert skips and all("does not support" in m for m in skips)  # the capability's reason


def test_setup_error_is_one_error_item_with_the_check_line(pytester, plugin_path):
    from attnbench.correctness.setup import available, prepared

    impl = plugin_path("bad.py") + ":RaisesInInit"
    with pytest.raises(Exception) as exc:
        prepared(available(impl, "cpu"), "cpu")
    rec = pytester.inline_run("-p", "no:cacheprovider", "--attnbench", impl)
    assert outcomes(rec) == {f"attnbench[{impl}]::setup": ("error", f"error: {exc.value}".splitlines()[0])}


def test_helper_in_a_test_file_with_k_x_and_junitxml(pytester, plugin_path, single_thread):
    good, bad = plugin_path("buggy.py") + ":Baseline", plugin_path("buggy.py") + ":NoMask"
    pytester.makepyfile(test_mine=f"""
        import attnbench.testing

        test_good = attnbench.testing.matrix({good!r}, kinds=["causality", "batch_independence"])
        test_bad = attnbench.testing.matrix({bad!r}, kinds=["causality", "batch_independence"])
    """)
    rec = pytester.inline_run("-p", "no:cacheprovider", "-k", "causality", "--junitxml=out.xml")
    got = outcomes(rec)
    assert got == {
        "test_mine.py::test_good::causality[float64-props-b3xT11-mha]": ("passed", ""),
        "test_mine.py::test_bad::causality[float64-props-b3xT11-mha]": ("failed", case_line(
            next(run_matrix([bad], kinds=["causality"]).itertuples()))),
    }
    cases_xml = ET.parse(pytester.path / "out.xml").getroot().iter("testcase")
    assert sorted(c.get("name") for c in cases_xml) == ["causality[float64-props-b3xT11-mha]"] * 2
    rec = pytester.inline_run("-p", "no:cacheprovider", "-x")  # stops at test_bad's first failure
    assert [o for o, _ in outcomes(rec).values()] == ["passed", "passed", "failed"]


def test_builtin_implementations_through_the_plugin(pytester, single_thread):
    rec = pytester.inline_run("-p", "no:cacheprovider", "--attnbench", "sdpa", "--attnbench", "weight_split",
                              "--attnbench-kind", "causality", "--attnbench-kind", "golden")
    got = outcomes(rec)
    assert got == {**expected("sdpa", ["causality", "golden"]), **expected("weight_split", ["causality", "golden"])}
    assert got["attnbench[weight_split]::golden[float32-book_hd1-b2xT6-mha]"][0] == "passed"


def junit_outcomes(path: Path) -> dict[str, str]:
    """testcase name -> passed/failed/skipped/error from a ``--junitxml`` file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "skipped", "error")]
        out[case.get("name")] = {"failure": "failed", "skipped": "skipped", "error": "error"}.get(kinds[0] if kinds else "", "passed")
    return out


@pytest.mark.slow
def test_full_matrix_matches_check_in_process_with_xdist_and_last_failed(pytester, plugin_path, single_thread):
    """N items as `attnbench check` runs, the same failures and messages; `-n 2` and `--lf` agree."""
    impl = plugin_path("buggy.py") + ":NoMask"
    want = expected(impl)
    got = outcomes(pytester.inline_run("--attnbench", impl))
    assert len(got) == len(cases()) and got == want
    failed = {k.split("::")[-1] for k, (o, _) in want.items() if o == "failed"}
    result = pytester.runpytest_subprocess("-n", "2", "--attnbench", impl, "--junitxml=x.xml")
    assert junit_outcomes(pytester.path / "x.xml") == {k.split("::")[-1]: o for k, (o, _) in want.items()}
    for name in list(failed)[:3]:  # the message, as check prints it, in the parallel run's output
        assert want[f"attnbench[{impl}]::{name}"][1] in result.stdout.str()
    # --lf reruns only the recorded failures (two kinds here, to keep it short: causality failed, golden skipped)
    rerun = pytester.inline_run("--lf", "--attnbench", impl, "--attnbench-kind", "causality", "--attnbench-kind", "golden")
    assert list(outcomes(rerun)) == [f"attnbench[{impl}]::causality[float64-props-b3xT11-mha]"]
    assert len(rerun.getcalls("pytest_deselected")[0].items) == 1


def test_unknown_kind_is_the_setup_error(pytester):
    rec = pytester.inline_run("-p", "no:cacheprovider", "--attnbench", "sdpa", "--attnbench-kind", "nope")
    [(nodeid, (outcome, message))] = outcomes(rec).items()
    assert nodeid == "attnbench[sdpa]::setup" and outcome == "error"
    assert message.startswith("error: unknown check kind(s) ['nope']; use forward, backward")
