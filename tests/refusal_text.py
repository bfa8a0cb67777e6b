"""What every refusal looks like on stderr (issue 45): one ``error:`` headline, then a few short indented lines.

Shared by the tests that read refusals (kept apart from any test module, which may import others).
"""

from __future__ import annotations

from attnbench.errors import HEADLINE_WIDTH, LINE_WIDTH, MAX_LINES


def refusal_lines_of(err: str) -> list[str]:
    """The lines of a refusal on stderr, asserted readable: one ``error:`` headline of at most
    :data:`HEADLINE_WIDTH` characters, then at most :data:`MAX_LINES` indented lines of at most :data:`LINE_WIDTH`."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert len(lines[0]) <= HEADLINE_WIDTH and len(lines) <= 1 + MAX_LINES, err
    assert all(line.startswith("  ") and len(line) <= LINE_WIDTH for line in lines[1:]), err
    return lines


def refusal_text(err: str) -> str:
    """A readable refusal on stderr (:func:`refusal_lines_of`) as one line: its lines stripped, joined by spaces,
    for tests that look for words anywhere in it."""
    return " ".join(line.strip() for line in refusal_lines_of(err))
