"""Shrinking is a budget for the run, not per case: a broken target at a large shape is not
dearer than a correct one by a shrinking step per case (issue 23 §2).

The target here is a kernel that takes a fixed time per call and counts its calls by shape, so
what is asserted is how many full-size evaluations a run makes, not how long it takes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tyingspec._src.core.cases import Case, at_shape, standard_cases
from tyingspec._src.front.check import PROXY_SHAPE, ShrinkBudget, check_target, proxy_of

KERNELS = textwrap.dedent('''
    import json, os, time
    import numpy as np

    LOG = os.environ["SHRINK_LOG"]

    def _log(V, N):
        with open(LOG, "a") as f:
            f.write(json.dumps([V, N]) + "\\n")

    def _out(tokens, h, g):
        return g.T @ h

    def dropped(tokens, dx, h, g, vocab_size):
        """the input path dropped; a call at V=256 takes 0.3 s (a production shape's cost)"""
        _log(vocab_size, len(tokens))
        if vocab_size > 64:
            time.sleep(0.3)
        return _out(tokens, h, g)

    def correct(tokens, dx, h, g, vocab_size):
        _log(vocab_size, len(tokens))
        if vocab_size > 64:
            time.sleep(0.3)
        dE = _out(tokens, h, g)
        np.add.at(dE, np.asarray(tokens).reshape(-1), dx.reshape(len(tokens), -1))
        return dE
''')


@pytest.fixture()
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "slow_kernels.py").write_text(KERNELS)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("SHRINK_LOG", str(log))
    return log


def _calls(log: Path) -> list[tuple[int, int]]:
    if not log.exists():
        return []
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


def _big_cases() -> list[Case]:
    # two cases at V=256 with the same bug pattern: the second must not be shrunk again
    kept, _ = at_shape(standard_cases(0)[:2], 256, 16, 48)
    return kept


def _run(spec: str, log: Path, budget: float = 5.0):  # type: ignore[no-untyped-def]
    report = check_target(spec, "kernel", 0, _big_cases(), shrink_budget=budget,
                          paths=(str(log.parent),))
    return report, _calls(log)


def test_a_broken_kernel_makes_no_more_full_size_calls_than_a_correct_one(kernels: Path
                                                                          ) -> None:
    good, good_calls = _run("slow_kernels:correct", kernels)
    assert good.verdict == "correct"
    kernels.unlink()
    bad, bad_calls = _run("slow_kernels:dropped", kernels)
    assert bad.verdict == "wrong"
    full = [c for c in bad_calls if c[0] == 256]
    # (a wrong first call skips the second one, so the broken run may make fewer)
    assert 0 < len(full) <= len([c for c in good_calls if c[0] == 256]), (full, good_calls)
    # the shrinking happened, on the small proxy
    first, second = bad.results
    assert first.shrunk is not None and (first.shrunk.V, first.shrunk.d) == PROXY_SHAPE[:2]
    assert first.shrunk.N < PROXY_SHAPE[2]
    assert "proxy" in first.shrink_note and "full-size batch was not shrunk" in \
        first.shrink_note
    assert first.diagnosis is not None and first.diagnosis.label == "input_path_missing"
    assert second.shrunk is None and f"case {first.case.name}" in second.shrink_note


def test_the_proxys_replay_reproduces_its_label(kernels: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from tyingspec._src.front.cli import main

    bad, _ = _run("slow_kernels:dropped", kernels)
    replay = bad.results[0].replay
    assert "--shape 64,8," in replay and "--tokens" in replay, replay
    args = replay.split()[1:]  # drop the program name
    out = kernels.parent / "replay.json"
    monkeypatch.chdir(kernels.parent)  # a module:attr target is imported from the cwd
    code = main([*args, "--json", str(out), "--shrink-budget", "0"])
    assert code == 1
    assert json.loads(out.read_text())["cases"][0]["label"] == "input_path_missing"


def test_shrinking_off_tries_no_proxy(kernels: Path) -> None:
    bad, calls = _run("slow_kernels:dropped", kernels, budget=0.0)
    assert bad.verdict == "wrong" and all(r.shrunk is None for r in bad.results)
    assert all(v == 256 for v, _ in calls), calls


def test_the_run_budget_is_shared_and_bounded_by_the_cases_own_cost() -> None:
    b = ShrinkBudget(5.0)
    assert b.left() == pytest.approx(1.0)  # the floor: nothing evaluated yet
    b.evaluated = 30.0
    assert b.left() == pytest.approx(5.0)  # the user's budget caps it
    b.spent = 4.0
    assert b.left() == pytest.approx(1.0)
    b.seconds, b.spent, b.evaluated = 100.0, 0.0, 10.0
    assert b.left() == pytest.approx(5.0)  # half the evaluations' time


def test_a_case_already_small_has_no_proxy() -> None:
    small = standard_cases(0)[0]
    assert proxy_of(small) is None
    big = _big_cases()[0]
    p = proxy_of(big)
    assert p is not None and (p.V, p.d, p.N) == PROXY_SHAPE and p.seed == big.seed
