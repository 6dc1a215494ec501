"""The plugin as a CI gate (issue 19, section 4): a gradient wrong from the first call is a
diagnosis, never a FailedHealthCheck of tyingspec's own filtering; a baseline missing under CI
fails the run instead of being recorded; the summary defines its invariant codes, a failure
prints its case once (not again in Hypothesis' words) and a replay line short enough to paste.

Each run is a pytest session in this process, in a scratch repository holding only an adapter
module, as in tests/front/test_plugin.py."""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from pathlib import Path

import pytest
from conftest import Scratch
from tyingspec.properties import PROPERTIES, for_kind

from tyingspec._src.core.cases import standard_cases
from tyingspec._src.front import baseline as _baseline
from tyingspec._src.front.baseline import apply_check_baseline
from tyingspec._src.front.check import check_target

ADAPTERS = textwrap.dedent('''
    """A user's adapters: tyingspec's correct and broken built-ins, re-exported."""
    from tyingspec import REGISTRY

    correct_kernel = REGISTRY["tied"].kernel
    output_path_only_kernel = REGISTRY["output-path-only"].kernel
    output_path_only_model = REGISTRY["output-path-only"].model
''')

# Derandomized and few examples, as in tests/front/test_plugin.py: a broken adapter fails on
# the first.
FAST = ("--tyingspec-profile=ci", "--tyingspec-max-examples=10")


@pytest.fixture
def repo(scratch: Scratch, monkeypatch: pytest.MonkeyPatch) -> Scratch:
    # Each test says whether it runs under CI; by default it does not (this suite itself runs
    # under CI=true, where a missing baseline now fails the run).
    monkeypatch.delenv("CI", raising=False)
    scratch.makepyfile(adapters=ADAPTERS)
    return scratch


def run(repo: Scratch, *args: str) -> pytest.RunResult:
    return repo.runpytest("-p", "xdist", *args)


def report_of(result: pytest.RunResult, prop: str) -> str:
    """The failure report of ``prop``'s test (pytest's section for it, up to the next one)."""
    out = result.stdout.str()
    start = out.index(f"_ test_{prop} _")
    end = min((i for i in (out.find("\n___", start + 1), out.find("\n---", start + 1),
                           out.find("short test summary", start)) if i != -1), default=len(out))
    return out[start:end]


def replay_command(result: pytest.RunResult) -> str:
    lines = result.stdout.lines
    return lines[lines.index("replay:") + 1].strip()


# --- 1. a gradient wrong from the first call: its diagnosis, not a FailedHealthCheck ---------

def test_a_model_wrong_from_its_first_call_fails_the_tie_property_with_that_diagnosis(
        repo: Scratch) -> None:
    baseline = repo.path / "baseline.json"
    result = run(repo, "--tyingspec-adapter=adapters:output_path_only_model", *FAST,
                 "-k", "sum_of_paths or tie_survives_a_step", f"--tyingspec-baseline={baseline}")
    out = result.stdout.str()
    assert result.ret == 1, out[-3000:]
    assert "FailedHealthCheck" not in out and "filtering out a lot of inputs" not in out
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["FAILED tyingspec::test_tie_survives_a_step - "
                                 "input_path_missing: *"])
    tie = report_of(result, "tie_survives_a_step")
    # the first call's diagnosis, as sum_of_paths gives it, and said to be about the first call
    assert "diagnosis: input_path_missing: input path missing" in tie
    assert "the first call is already wrong, before any step" in tie
    assert "tie_is_a_copy" not in tie
    recorded = json.loads(baseline.read_text())
    assert recorded["verdicts"] == {"sum_of_paths": "failed", "tie_survives_a_step": "failed"}
    # what the baseline blames: the first call's diagnosis, not the tie (nor an error)
    assert recorded["details"]["tie_survives_a_step"] == \
        recorded["details"]["sum_of_paths"] == "input_path_missing"


@pytest.mark.slow
@pytest.mark.moved
def test_a_torch_model_whose_uses_cannot_be_observed_fails_gradient_by_path_with_its_diagnosis(
        repo: Scratch) -> None:
    # nanogpt-input-path-dropped reads its embedding through .detach(): no use of the tied
    # weight can be observed, so the rows by path never had power and every example was
    # discarded (FailedHealthCheck).  The forward check is what decides such a call.
    args = ("--tyingspec-adapter=nanogpt-input-path-dropped", "--tyingspec-kind=torch",
            "--tyingspec-max-examples=3")
    result = run(repo, *args, "-k", "torch_gradient_by_path")
    out = result.stdout.str()
    assert result.ret == 1, out[-3000:]
    assert "FailedHealthCheck" not in out and "filtering out a lot of inputs" not in out
    result.stdout.fnmatch_lines([
        "diagnosis: input_path_missing: * (gradient against the forward: *",
        "*rows: not compared with a reference: a use of the tied weight cannot be observed*",
        "FAILED tyingspec::test_torch_gradient_by_path - input_path_missing: *"])
    # the model's own rows are not reported as compared ("rows: 0 wrong, 61 of 61 exactly
    # right" beside a forward check that found rows wrong)
    assert re.search(r"rows: \d+ wrong", out) is None
    # the replay names the model's own shape (the one the batch ran at), and replays it
    lines = result.stdout.lines
    batch = lines[lines.index("smallest failing batch (shrunk by Hypothesis):") + 1].strip()
    shape = re.match(r"V=\d+ d=\d+ N=\d+", batch)
    assert shape is not None and f"{shape.group()} seed=" in replay_command(result)
    again = run(repo, *shlex.split(replay_command(result))[1:])
    again.assert_outcomes(failed=1)
    assert f"  {batch}" in again.stdout.lines


# --- 2. a missing baseline under CI ------------------------------------------------------------

@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_missing_baseline_fails_the_run_and_says_to_record_and_commit_it(
        repo: Scratch, monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    baseline, summary = repo.path / "baseline.json", repo.path / "summary.md"
    result = run(repo, "--tyingspec-adapter=adapters:correct_kernel", "--tyingspec-kind=kernel",
                 *FAST, "-k", "sum_of_paths", f"--tyingspec-baseline={baseline}",
                 f"--tyingspec-summary={summary}")
    result.assert_outcomes(passed=1)  # every property holds: only the gate fails the run
    assert result.ret == 1
    assert not baseline.exists(), "under CI a missing baseline is not recorded"
    result.stdout.fnmatch_lines([
        "*tyingspec baseline MISSING*",
        f"baseline {baseline} does not exist: it was not committed*",
        f"record it: run once with --tyingspec-update-baseline * and commit {baseline}"])
    assert f"baseline {baseline} does not exist: it was not committed" in summary.read_text()


def test_under_ci_the_update_flag_records_a_missing_baseline(
        repo: Scratch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    baseline = repo.path / "baseline.json"
    common = ("--tyingspec-adapter=adapters:correct_kernel", "--tyingspec-kind=kernel", *FAST,
              "-k", "sum_of_paths", f"--tyingspec-baseline={baseline}")
    result = run(repo, *common, "--tyingspec-update-baseline")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"baseline {baseline} did not exist: recorded this run's *"])
    assert json.loads(baseline.read_text())["verdicts"] == {"sum_of_paths": "passed"}
    # and from then on CI compares against it
    again = run(repo, *common)
    assert again.ret == 0
    again.stdout.fnmatch_lines([f"baseline {baseline}: no property that passed there fails now"])


@pytest.mark.parametrize("ci", [None, ""], ids=["unset", "empty"])
def test_outside_ci_a_missing_baseline_is_recorded(
        repo: Scratch, monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    baseline = repo.path / "baseline.json"
    result = run(repo, "--tyingspec-adapter=adapters:correct_kernel", "--tyingspec-kind=kernel",
                 *FAST, "-k", "sum_of_paths", f"--tyingspec-baseline={baseline}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert json.loads(baseline.read_text())["verdicts"] == {"sum_of_paths": "passed"}


def test_the_cli_gate_under_ci_refuses_a_missing_baseline_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.json"
    report = check_target("tied", "model", 0, [standard_cases(0)[0]])
    monkeypatch.setenv("CI", "true")
    code, lines = apply_check_baseline(report, str(path), False)
    assert code == 2 and not path.exists()
    assert lines[0].startswith(f"baseline {path} does not exist: it was not committed")
    assert any("--update-baseline" in line and "commit" in line for line in lines)
    code, lines = apply_check_baseline(report, str(path), True)
    assert code == 0 and path.exists() and "did not exist: recorded" in lines[0]
    monkeypatch.delenv("CI")
    other = tmp_path / "outside.json"
    assert apply_check_baseline(report, str(other), False)[0] == 0 and other.exists()


# --- 3. output: codes defined, the case printed once, a short replay ---------------------------

def test_every_invariant_code_a_property_carries_is_defined() -> None:
    missing = {p.invariant for p in PROPERTIES.values()} - set(_baseline.INVARIANTS)
    assert not missing, f"no legend entry for {sorted(missing)}"


def test_the_summaries_define_each_invariant_code_they_use(repo: Scratch) -> None:
    summary = repo.path / "summary.md"
    result = run(repo, "--tyingspec-adapter=adapters:correct_kernel", "--tyingspec-kind=kernel",
                 "--tyingspec-profile=ci", "--tyingspec-max-examples=3",
                 f"--tyingspec-summary={summary}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    codes = {p.invariant for p in for_kind("kernel")}
    assert len(codes) > 1
    lines = result.stdout.lines
    assert "invariants:" in lines
    for code in codes:  # under the table, one line each
        assert any(re.fullmatch(rf"  \[{code}\] +{re.escape(_baseline.INVARIANTS[code])}", line)
                   for line in lines[lines.index("invariants:"):]), code
    text = summary.read_text()
    table_codes = set(re.findall(r"^\| `\w+` \| (\w+) \|", text, re.MULTILINE))
    assert table_codes == codes
    for code in codes:
        assert f"- **{code}**: {_baseline.INVARIANTS[code]}" in text


def test_a_failure_prints_its_case_once_and_its_diagnosis_first(repo: Scratch) -> None:
    result = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel",
                 "--tyingspec-kind=kernel", *FAST, "-k", "sum_of_paths")
    assert result.ret == 1
    report = report_of(result, "sum_of_paths")
    body = report.split("\n", 1)[1]
    assert body.startswith("tyingspec: property sum_of_paths does not hold"), body[:300]
    # Hypothesis' copy of the case (its print of the test's call, the Case repr) and its
    # @reproduce_failure blob: the batch and the replay line above say the same
    for duplicate in ("Falsifying", "Failing test case", "test_sum_of_paths(", "Case(",
                      "@reproduce_failure", "Hypothesis:"):
        assert duplicate not in report, (duplicate, report)
    assert report.count("tokens=[") == 1


def test_the_replay_line_is_one_short_command_that_replays_the_batch(repo: Scratch) -> None:
    first = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel",
                "--tyingspec-kind=kernel", *FAST, "-k", "sum_of_paths")
    command = replay_command(first)
    argv = shlex.split(command)
    assert argv[0] == "pytest" and "\n" not in command
    key = next(a for a in argv if a.startswith("--tyingspec-replay="))
    # the drawn shapes and seed, nothing at its default, no arrays: the seed builds them (it
    # was every field of the case, tokens and targets spelled out: 300 characters and more)
    assert key.startswith("--tyingspec-replay=sum_of_paths V=") and len(key) <= 80, key
    for long in ("tokens=", "targets=", "=None", "dtype=float64", "composition=random"):
        assert long not in key, (long, key)
    again = run(repo, *argv[1:])
    again.assert_outcomes(failed=1)
    lines = first.stdout.lines
    header = lines.index("smallest failing batch (shrunk by Hypothesis):")
    assert lines[header + 1] in again.stdout.lines and lines[header + 2] in again.stdout.lines
    assert replay_command(again) == command
