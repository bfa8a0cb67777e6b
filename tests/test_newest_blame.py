"""tools/newest_blame.py: the one line that says which newer package broke which tests."""

from __future__ import annotations

from tools.newest_blame import failures, moved, pins, summary

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="2" tests="3">
<testcase classname="tests.test_hf" name="test_build[llama]"><failure message="TypeError: missing layer_idx">
Traceback: /venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py:200: in __init__
</failure></testcase>
<testcase classname="tests.test_check" name="test_own"><failure message="AssertionError">tests/test_check.py:10
</failure></testcase>
<testcase classname="tests.test_ok" name="test_fine"/>
</testsuite></testsuites>"""


def test_pins_drop_local_labels_and_normalise_names():
    assert pins("# c\ntorch==2.13.0+cpu\nhuggingface_hub==2.4.0\nJinja2==3.1.6\n") == {
        "torch": "2.13.0", "huggingface_hub": "2.4.0", "jinja2": "3.1.6"}
    assert pins("huggingface-hub==2.4.0") == {"huggingface_hub": "2.4.0"}


def test_one_line_names_the_moved_package_and_the_tests_through_its_files(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    lock = pins("transformers==5.24.0\ntorch==2.13.0\nnumpy==2.4.6\n")
    newest = pins("transformers==5.25.0\ntorch==2.13.0+cpu\nnumpy==2.4.7\n")
    changed = moved(lock, newest)
    assert changed == {"numpy": "2.4.6 -> 2.4.7", "transformers": "5.24.0 -> 5.25.0"}
    line = summary(changed, failures(str(junit)), status=1)
    assert "\n" not in line and line.startswith("newest: RED")
    assert "transformers 5.24.0 -> 5.25.0: 1 failing test(s) (tests/test_hf.py)" in line
    assert "numpy" not in line.split("):", 1)[1]  # moved, but no failing traceback passes through it
    assert "1 failing test(s) through no moved package's files (tests/test_check.py)" in line


def test_green_says_so():
    assert summary({}, [], status=0).startswith("newest: green")
