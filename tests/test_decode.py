"""The decode property: each decode pattern real decoders use is checked, and a bug in one is named by it."""

from __future__ import annotations

import ast

import pytest

from attnbench.correctness import decode
from attnbench.correctness.decode import CHUNK_SIZES, DECODE_PREFILL, DECODE_SHAPES, PATTERNS, chunk_steps

pytestmark = pytest.mark.usefixtures("single_thread")

PLUGIN = "tests/plugins/buggy_decode.py"
BAD = ("fail", "error")

DECODE_BUGS = {  # class -> (pattern that must flag it first, text of the step it names)
    "MultiTokenMeansPrefill": ("uneven chunks", "appended at position "),
    "RingDropsWrappedTokens": ("uneven chunks", "after the chunk across the window's wrap-around at position "),
    "CachedDropoutInEval": (f"eval mode with dropout={decode.EVAL_DROPOUT}", "prefill of "),
    "RingKeepsFirstBatch": ("another batch size after reset_cache()", "prefill of "),
}


def test_patterns_are_small_named_functions():
    names = [name for name, _ in PATTERNS]
    assert len(set(names)) == len(names) and all(callable(p) for _, p in PATTERNS)
    assert {"uneven chunks", "rewind"} <= set(names)
    assert any("dropout" in n for n in names) and any("batch size after reset_cache" in n for n in names)


def test_chunk_schedules_mix_uneven_chunks_and_cross_the_wrap_around():
    sizes, crossing = set(), []
    for shape in DECODE_SHAPES:
        start = DECODE_PREFILL.get(shape.id, 5)
        for cycle in (CHUNK_SIZES, CHUNK_SIZES[-1:] + CHUNK_SIZES[:-1]):  # the chunk and the eval-mode patterns
            steps = chunk_steps(start, shape.seq_len, shape.spec.window, cycle)
            assert steps[0].start == start >= 1  # appended to a non-empty cache
            assert [s.start for s in steps[1:]] == [s.start + s.length for s in steps[:-1]]  # contiguous
            assert steps[-1].start + steps[-1].length == shape.seq_len
            sizes |= {s.length for s in steps}
            if shape.spec.window:
                w = shape.spec.window
                across = [s for s in steps if s.start // w != (s.start + s.length - 1) // w and "wrap-around (" in s.label]
                assert len(across) == 1 and across[0].length >= 2, steps
                crossing.append(across[0].label)
    assert {1, 2, 3, 4, 5} <= sizes
    assert crossing and all(label.startswith("chunk of ") for label in crossing)


def test_chunk_labels_name_pattern_and_position():
    steps = chunk_steps(5, 15, window=4)
    assert steps[0].label == "decoded token at position 5"
    cross = next(s for s in steps if "wrap-around (" in s.label)
    assert cross.label.startswith(f"chunk of {cross.length} appended at position {cross.start} across the window's")
    after = steps[steps.index(cross) + 1]
    assert after.label.endswith(f"after the chunk across the window's wrap-around at position {cross.start}")


@pytest.mark.parametrize("cls", ["ChapterFourCache", "RingCache"])
def test_correct_caches_pass_every_pattern(repo_cwd, matrix_results, cls):
    df = matrix_results([f"{PLUGIN}:{cls}"], kinds=["decode", "forward"])
    ran = df[(df.kind == "decode") & (df.status != "skip")]
    assert not ran.empty and (ran.status == "pass").all(), ran.message.tolist()
    assert ran.message.str.contains("uneven chunks").all()
    assert (df.status != "fail").all() and (df.status != "error").all()


@pytest.mark.parametrize("cls", list(DECODE_BUGS))
def test_decode_bug_is_named_by_its_pattern(repo_cwd, matrix_results, cls):
    pattern, where = DECODE_BUGS[cls]
    df = matrix_results([f"{PLUGIN}:{cls}"], kinds=["decode", "forward"])
    assert (df[df.kind == "forward"].status == "pass").any() and not df[df.kind == "forward"].status.isin(BAD).any()
    dec = df[(df.kind == "decode") & df.status.isin(BAD)]
    assert not dec.empty, f"{cls} passed every decode case"
    # the patterns before it pass (the first failure is reported), and the message names the pattern and the step
    assert dec.message.str.startswith(f"decode, {pattern}: ").all(), dec.message.tolist()
    assert dec.message.str.contains(where, regex=False).all(), dec.message.tolist()


def test_every_decode_bug_is_tested(repo_cwd):
    tree = ast.parse((repo_cwd / PLUGIN).read_text())
    bugs = {node.name for node in tree.body if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id in ("ChapterFourCache", "RingCache") for b in node.bases)}
    assert bugs == set(DECODE_BUGS)
