"""The pytest plugin, end to end: scratch repositories holding only an adapter module, run with
``pytest --tyingspec-adapter=...`` (a pytest session in this process, with and without
``-n 2``; the adapters run in tyingspec's worker processes as a user's would)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import Scratch
from hypothesis import Phase
from tyingspec.properties import for_kind

from tyingspec._src.core.cases import standard_cases
from tyingspec._src.front.baseline import apply_check_baseline, load
from tyingspec._src.front.check import check_target
from tyingspec._src.front.suite import profile_settings
from tyingspec._src.kinds.table import KIND_NAMES

ADAPTERS = textwrap.dedent('''
    """A user's adapters: tyingspec's correct and broken built-ins, re-exported."""
    from tyingspec import REGISTRY

    correct_model = REGISTRY["tied"].model
    output_path_only_model = REGISTRY["output-path-only"].model
    correct_kernel = REGISTRY["tied"].kernel
    output_path_only_kernel = REGISTRY["output-path-only"].kernel
    input_path_only_kernel = REGISTRY["input-path-only"].kernel
    duplicates_buffered_kernel = REGISTRY["duplicates-buffered"].kernel
    output_path_overwritten_kernel = REGISTRY["output-path-overwritten"].kernel


    def wrong_shape_model(E, W, b, tokens, targets, *, res, s_in):
        out = dict(correct_model(E, W, b, tokens, targets, res=res, s_in=s_in))
        out["dE"] = out["dE"][:, :-1]
        return out
''')

# Few examples keep the file fast; the derandomized ci profile keeps timings and outcomes the
# same from run to run.  A broken kernel fails on the first examples anyway.
FAST = ("--tyingspec-profile=ci", "--tyingspec-max-examples=10")
# Under xdist every run starts two more interpreters: the default tier keeps the dedicated
# xdist tests (the baseline gate, junitxml and the summary) and the slow tier runs these twins.
XDIST = [pytest.param((), id="in-process"),
         pytest.param(("-n", "2"), id="xdist-n2", marks=pytest.mark.slow)]


@pytest.fixture
def repo(scratch: Scratch) -> Scratch:
    scratch.makepyfile(adapters=ADAPTERS)
    return scratch


@pytest.fixture
def outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that records a missing baseline is a developer's first run, not CI's: under CI
    (which runs this suite with CI=true) a missing baseline fails the run instead, and
    tests/front/test_plugin_gate.py tests that."""
    monkeypatch.delenv("CI", raising=False)


def run(repo: Scratch, *args: str) -> pytest.RunResult:
    # pytest's own main() with the plugin loaded from its entry point, as in a user's run
    return repo.runpytest("-p", "xdist", *args)


def kernel_properties() -> int:
    return len(for_kind("kernel"))


@pytest.mark.parametrize("xdist", XDIST)
def test_a_correct_model_adapter_passes_every_property(repo: Scratch,
                                                       xdist: tuple[str, ...]) -> None:
    result = run(repo, "--tyingspec-adapter=adapters:correct_model", *FAST, *xdist)
    result.assert_outcomes(passed=len(for_kind("model")))
    assert result.ret == 0


@pytest.mark.parametrize("adapter, label, xdist", [
    pytest.param("output_path_only_kernel", "input_path_missing", ("-n", "2"),
                 id="output-path-only-xdist-n2", marks=pytest.mark.slow),
    pytest.param("output_path_only_kernel", "input_path_missing", (),
                 id="output-path-only-in-process"),
    pytest.param("input_path_only_kernel", "output_path_missing", (),
                 id="input-path-only-in-process"),
    pytest.param("duplicates_buffered_kernel", "duplicates_not_accumulated", (),
                 id="duplicates-buffered-in-process"),
    pytest.param("output_path_overwritten_kernel", "output_path_overwritten", (),
                 id="output-path-overwritten-in-process"),
])
def test_each_broken_kernel_fails_with_its_named_verdict(
        repo: Scratch, adapter: str, label: str, xdist: tuple[str, ...]) -> None:
    result = run(repo, f"--tyingspec-adapter=adapters:{adapter}", "--tyingspec-kind=kernel",
                 *FAST, "-k", "sum_of_paths", *xdist)
    assert result.ret == 1
    assert f"diagnosis: {label}" in result.stdout.str()
    result.stdout.fnmatch_lines([f"FAILED tyingspec::test_sum_of_paths - {label}: *"])


def test_a_failure_prints_the_diagnosis_then_the_smallest_batch_then_a_replay_line_that_works(
        repo: Scratch) -> None:
    first = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel",
                "--tyingspec-kind=kernel", *FAST, "-k", "sum_of_paths")
    assert first.ret == 1
    out = first.stdout.str()
    order = ["tyingspec: property sum_of_paths does not hold",
             "diagnosis: input_path_missing: input path missing",
             "input path missing: rows",
             "rows: ",
             "smallest failing batch (shrunk by Hypothesis):",
             "replay:"]
    positions = [out.find(m) for m in order]
    assert -1 not in positions, dict(zip(order, positions))
    assert positions == sorted(positions)
    # and not Hypothesis' own copy of the case after them ("Falsifying example" up to 6.16x,
    # "Failing test case" after): tests/front/test_plugin_gate.py has the rest of that
    assert not re.search(r"(Falsifying example|Failing test case): test_sum_of_paths\(", out)
    report = out.split("FAILURES")[1].split("short test summary")[0]
    assert "Traceback" not in report and "_suite.py:" not in report
    assert not list(Path(repo.path).glob(".hypothesis/patches/*")), \
        "Hypothesis must not write patches against tyingspec's installed suite"

    lines = first.stdout.lines
    argv = shlex.split(lines[lines.index("replay:") + 1].strip())
    assert argv[0] == "pytest"
    again = run(repo, *argv[1:])
    again.assert_outcomes(failed=1)
    batch = lines[lines.index("smallest failing batch (shrunk by Hypothesis):") + 1]
    assert batch in again.stdout.lines, "the replay runs exactly the shrunk batch"


def test_a_model_adapter_failure_on_a_replayed_batch_names_path_rows_and_verdict(
        repo: Scratch) -> None:
    # A replayed batch skips Hypothesis' search and shrink: V*d = 64 uses the closed-form
    # reference, so this stays fast while exercising the model contract end to end.
    case = "sum_of_paths V=16 d=4 N=6 seed=3 composition=distinct bias=True"
    result = run(repo, "--tyingspec-adapter=adapters:output_path_only_model",
                 f"--tyingspec-replay={case}", "-k", "sum_of_paths")
    assert result.ret == 1
    result.stdout.fnmatch_lines([
        ("tyingspec: property sum_of_paths does not hold for adapter "
        "'adapters:output_path_only_model' (model): *"),
        "diagnosis: input_path_missing: * (wrong on exactly the 6 present rows)",
        "rows: 6 wrong, 10 of 16 (62.5%) exactly right; wrong rows *",
        "  input path missing: rows *",
        "power: input path yes, output path yes, duplicates n/a",
        "judged at float64: worst row *x its rounding bound; max abs error *, max rel error * "
        "under atol *, rtol=* (float64 rounding bound)",
        "",
        "failing batch (replayed):",
        "  V=16 d=4 N=6 *seed=3",
        "  composition=distinct tokens=* targets=*",
        "",
        "replay:",
        ("  pytest --tyingspec-adapter=adapters:output_path_only_model --tyingspec-kind=model "
        "-k=test_sum_of_paths '--tyingspec-replay=sum_of_paths V=16 d=4 N=6 seed=3 *"),
    ])


def test_an_adapter_error_is_reported_as_such_not_as_a_wrong_gradient(
        repo: Scratch) -> None:
    result = run(repo, "--tyingspec-adapter=adapters:wrong_shape_model", *FAST,
                 "-k", "sum_of_paths")
    assert result.ret == 1
    out = result.stdout.str()
    assert "tyingspec: adapter error in property sum_of_paths" in out
    assert "key 'dE': wrong shape" in out
    assert "diagnosis: " not in out
    result.stdout.fnmatch_lines(["FAILED tyingspec::test_sum_of_paths - adapter_error: *"])


@pytest.mark.parametrize("xdist", XDIST)
def test_an_adapter_that_cannot_be_imported_exits_with_status_2_naming_it(
        repo: Scratch, xdist: tuple[str, ...]) -> None:
    result = run(repo, "--tyingspec-adapter=no_such_module:grads", *xdist)
    assert result.ret == 2
    text = result.stdout.str() + result.stderr.str()
    assert "no_such_module:grads" in text
    assert "cannot be imported" in text and "ModuleNotFoundError" in text


def test_a_missing_attribute_exits_with_status_2_naming_it(repo: Scratch) -> None:
    result = run(repo, "--tyingspec-adapter=adapters:not_there")
    assert result.ret == 2
    assert "has no attribute 'not_there'" in result.stdout.str() + result.stderr.str()


@pytest.mark.usefixtures("outside_ci")
@pytest.mark.parametrize("xdist", XDIST)
def test_the_baseline_gate_fails_a_run_in_which_a_previously_passing_property_fails(
        repo: Scratch, xdist: tuple[str, ...]) -> None:
    baseline = repo.path / "tyingspec-baseline.json"
    common = ("--tyingspec-kind=kernel", f"--tyingspec-baseline={baseline}", *FAST)
    first = run(repo, "--tyingspec-adapter=adapters:correct_kernel", *common)
    assert first.ret == 0
    recorded = json.loads(baseline.read_text())
    assert recorded["schema"] == "tyingspec.baseline/1"
    assert set(recorded["verdicts"].values()) == {"passed"}
    assert len(recorded["verdicts"]) == kernel_properties()

    # Only sum_of_paths this time: properties not run are not regressions.
    second = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel", *common,
                 "-k", "sum_of_paths", *xdist)
    assert second.ret == 1
    second.stdout.fnmatch_lines([
        "*tyingspec baseline REGRESSION*",
        "REGRESSION: * passed in baseline * and fail* now:",
        "  sum_of_paths: passed -> failed (input_path_missing)",
    ])
    assert json.loads(baseline.read_text()) == recorded, "only the update flag rewrites it"


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.usefixtures("outside_ci")
def test_the_baseline_gate_fails_under_xdist_even_when_pytest_counts_nothing_as_failed(
        repo: Scratch) -> None:
    baseline = repo.path / "baseline.json"
    common = ("--tyingspec-kind=kernel", f"--tyingspec-baseline={baseline}", *FAST,
              "-k", "sum_of_paths")
    assert run(repo, "--tyingspec-adapter=adapters:correct_kernel", *common).ret == 0
    # A user's conftest marks the suite xfail: pytest then reports "1 xfailed" and exits 0.
    repo.makeconftest("""
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                item.add_marker(pytest.mark.xfail(reason="known broken"))
    """)
    result = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel", *common,
                 "-n", "2")
    result.assert_outcomes(xfailed=1)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*tyingspec baseline REGRESSION*",
                                 "  sum_of_paths: passed -> failed (input_path_missing)"])


@pytest.mark.usefixtures("outside_ci")
def test_the_update_flag_rewrites_the_baseline_and_accepts_the_new_verdicts(
        repo: Scratch) -> None:
    baseline = repo.path / "baseline.json"
    common = ("--tyingspec-kind=kernel", f"--tyingspec-baseline={baseline}", *FAST,
              "-k", "sum_of_paths")
    run(repo, "--tyingspec-adapter=adapters:correct_kernel", *common)
    updated = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel", *common,
                  "--tyingspec-update-baseline")
    assert updated.ret == 1  # the property still fails; the gate itself does not
    assert "REGRESSION" not in updated.stdout.str().replace("accepted", "")
    updated.stdout.fnmatch_lines(["baseline * rewritten with this run's verdicts"])
    assert json.loads(baseline.read_text())["verdicts"] == {"sum_of_paths": "failed"}
    again = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel", *common)
    assert "tyingspec baseline REGRESSION" not in again.stdout.str()


def test_an_unreadable_baseline_is_a_usage_error_before_anything_runs(
        repo: Scratch) -> None:
    (repo.path / "baseline.json").write_text("{not json")
    result = run(repo, "--tyingspec-adapter=adapters:correct_kernel", "--tyingspec-kind=kernel",
                 "--tyingspec-baseline=baseline.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"baseline {repo.path / 'baseline.json'}: cannot be read as JSON" in result.stderr.str()


def test_junitxml_and_the_markdown_summary_work_under_xdist(repo: Scratch) -> None:
    xml, summary = repo.path / "junit.xml", repo.path / "summary.md"
    result = run(repo, "--tyingspec-adapter=adapters:output_path_only_kernel",
                 "--tyingspec-kind=kernel", *FAST, "-n", "2", f"--junitxml={xml}",
                 f"--tyingspec-summary={summary}")
    assert result.ret == 1
    cases = ET.parse(xml).getroot().iter("testcase")
    verdicts = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
                for c in cases}
    assert len(verdicts) == kernel_properties()
    assert verdicts["test_sum_of_paths"]["tyingspec_verdict"] == "input_path_missing"
    assert verdicts["test_sum_of_paths"]["tyingspec_invariant"] == "SUM"

    text = summary.read_text()
    assert "| property | invariant | verdict | diagnosis |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == kernel_properties()
    assert any(r.startswith("| `sum_of_paths` | SUM | ❌ failed | input path missing")
               for r in rows)


def test_the_suite_collects_one_test_per_property_in_sorted_order(
        repo: Scratch) -> None:
    # Sorted, static ids are what lets every xdist worker collect the same list (xdist aborts
    # the run otherwise, so each -n 2 run above checks it too).
    result = run(repo, "--tyingspec-adapter=adapters:correct_model", "--collect-only", "-q")
    assert result.ret == 0
    ids = [line for line in result.stdout.lines if line.startswith("tyingspec::")]
    assert ids == [f"tyingspec::test_{n}" for n in sorted(p.name for p in for_kind("model"))]


def test_the_plugin_does_nothing_without_an_adapter(scratch: Scratch) -> None:
    scratch.makepyfile(test_user="def test_user_code():\n    assert 1 + 1 == 2\n")
    # runpytest runs in this process, where an earlier test on the same xdist worker may
    # already have imported tyingspec; pytest then warns that it cannot rewrite the module
    # (a user's fresh process never sees that). The warning is pytest's, not the plugin's.
    result = run(scratch, "-v", "-W", "ignore::pytest.PytestAssertRewriteWarning")
    result.assert_outcomes(passed=1)
    assert "tyingspec" not in result.stdout.str().replace("tyingspec-", "")


def test_tyingspec_options_without_an_adapter_are_a_usage_error(
        scratch: Scratch) -> None:
    result = run(scratch, "--tyingspec-baseline=b.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--tyingspec-baseline given without --tyingspec-adapter" in result.stderr.str()


@pytest.mark.parametrize("option, message", [
    # every kind of the table, in its order
    ("--tyingspec-kind=both", f"expected kind {' or '.join(KIND_NAMES)}, got 'both'"),
    ("--tyingspec-profile=fast", "expected profile dev or ci or thorough, got 'fast'"),
    ("--tyingspec-max-examples=0", "expected a positive integer, got 0"),
    ("--tyingspec-adapter=my module:f", "expected module:attr with dotted Python names"),
    ("--tyingspec-replay=sum_of_paths", "expected 'PROPERTY key=value ...'"),
])
def test_bad_option_values_are_rejected_naming_the_option(scratch: Scratch,
                                                          option: str, message: str) -> None:
    result = run(scratch, "--tyingspec-adapter=tied", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    name = option.split("=")[0]
    assert f"argument {name}: {message}" in result.stderr.str()


def test_profiles_map_to_hypothesis_settings() -> None:
    dev, ci, thorough = (profile_settings(p) for p in ("dev", "ci", "thorough"))
    assert (dev.max_examples, ci.max_examples, thorough.max_examples) == (30, 60, 400)
    assert ci.derandomize and ci.database is None and ci.print_blob
    assert all(s.deadline is None and not s.report_multiple_bugs for s in (dev, ci, thorough))
    assert profile_settings("dev", 7).max_examples == 7
    assert profile_settings("dev", replay=True).phases == (Phase.explicit,)


def test_the_ci_profile_applies_when_ci_is_set(repo: Scratch,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = run(repo, "--tyingspec-adapter=adapters:correct_model", "--collect-only")
    result.stdout.fnmatch_lines([("tyingspec: adapter 'adapters:correct_model' (model), "
                                  "profile ci (max_examples=60, derandomize=True)")])


def test_the_plugin_module_imports_without_numpy_sympy_or_hypothesis() -> None:
    code = ("import sys, tyingspec._src.front.plugin; "
            "print(sorted(m for m in ('numpy', 'sympy', 'hypothesis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# --- the CLI side of the gate: tyingspec check TARGET --baseline FILE -------------------------

@pytest.mark.usefixtures("outside_ci")
def test_check_baseline_records_then_flags_a_case_that_passed_and_now_fails(
        tmp_path: Path) -> None:
    path = str(tmp_path / "check-baseline.json")
    cases = standard_cases(0)
    code, lines = apply_check_baseline(check_target("tied", "model", 0, cases), path, False)
    assert code == 0 and "did not exist: recorded" in lines[0]
    recorded = load(path, "case")
    assert recorded is not None and recorded.verdicts["absent-tokens"] == "passed"

    broken = check_target("output-path-only", "model", 0, cases)
    code, lines = apply_check_baseline(broken, path, False)
    assert code == 1
    assert re.match(r"REGRESSION: \d+ cases passed in baseline .* and fail now:", lines[0])
    assert "  absent-tokens: passed -> failed (input_path_missing)" in lines

    code, lines = apply_check_baseline(broken, path, True)
    assert code == broken.exit_code and "rewritten" in lines[0]
    code, lines = apply_check_baseline(broken, path, False)
    assert code == broken.exit_code and not any("REGRESSION" in line for line in lines)


@pytest.mark.usefixtures("outside_ci")
def test_check_baseline_counts_an_unloadable_target_as_a_regression_and_never_records_it(
        tmp_path: Path) -> None:
    path = str(tmp_path / "b.json")
    cases = standard_cases(0)
    apply_check_baseline(check_target("tied", "model", 0, cases), path, False)
    missing = check_target("no_such_module:f", "model", 0, cases)
    code, lines = apply_check_baseline(missing, path, False)
    assert code == 2 and lines[0].startswith("REGRESSION")
    code, lines = apply_check_baseline(missing, path, True)
    assert code == 2 and "not updated" in lines[0]


def test_check_refuses_a_baseline_recorded_by_the_plugin(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"schema": "tyingspec.baseline/1", "unit": "property",
                                "target": "x:y", "kind": "model", "verdicts": {}}))
    code, lines = apply_check_baseline(check_target("tied", "model", 0, standard_cases(0)),
                                       str(path), False)
    assert code == 2 and "recorded by the pytest plugin" in lines[0]


# --- an option given twice; a missing extra; a summary to stdout -------------------------------

@pytest.mark.parametrize("twice", [
    ("--tyingspec-adapter=adapters:output_path_only_model",
     "--tyingspec-adapter=adapters:correct_model"),
    ("--tyingspec-adapter=adapters:correct_kernel", "--tyingspec-kind=kernel",
     "--tyingspec-kind=model"),
    ("--tyingspec-adapter=adapters:correct_model", "--tyingspec-max-examples=3",
     "--tyingspec-max-examples=300")],
    ids=["adapter", "kind", "max-examples"])
def test_an_option_given_twice_with_different_values_is_a_usage_error(
        repo: Scratch, twice: tuple[str, ...]) -> None:
    """With the buggy adapter first and a correct one second, pytest kept the last value: the
    buggy adapter never ran and the job passed ("9 passed", exit 0)."""
    result = run(repo, *twice)
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text[-3000:]
    flag, first = twice[-2].split("=", 1)
    second = twice[-1].split("=", 1)[1]
    assert f"{flag} given 2 times with different values" in text
    assert repr(first) in text or first in text
    assert second in text
    assert "passed" not in text


def test_an_option_given_twice_with_one_value_runs(repo: Scratch) -> None:
    # an ini file's addopts repeated on the command line drops nothing
    result = run(repo, "--tyingspec-adapter=adapters:correct_model",
                 "--tyingspec-adapter=adapters:correct_model", "--collect-only", "-q")
    assert result.ret == 0
    assert f"{len(for_kind('model'))} tests collected" in result.stdout.str()


BLOCKED = textwrap.dedent('''
    """This environment has none of the modules in BLOCK_MODULES: an install without an
    extra (loaded before the plugin reads its options)."""
    import os
    import sys

    for _name in os.environ["BLOCK_MODULES"].split(","):
        sys.modules[_name] = None
''')


@pytest.mark.parametrize(("args", "block", "extra"), [
    (("--tyingspec-adapter=nanogpt", "--tyingspec-kind=torch"), "torch", "torch"),
    (("--tyingspec-adapter=gpt-ddp", "--tyingspec-kind=distributed"), "torch", "torch"),
    (("--tyingspec-adapter=nnx-tied", "--tyingspec-kind=jax"), "jax", "jax"),
    (("--tyingspec-adapter=tied", "--tyingspec-precision=bfloat16"), "ml_dtypes", "bfloat16"),
    (("--tyingspec-adapter=ce-torch", "--tyingspec-kind=linear-ce"), "torch", "torch")],
    ids=["torch-kind", "distributed-kind", "jax-kind", "bfloat16", "linear-ce-torch-builtin"])
def test_a_missing_extra_is_a_usage_error_not_a_failed_test(
        tmp_path: Path, args: tuple[str, ...], block: str, extra: str) -> None:
    """Without torch, ``--tyingspec-kind=torch`` failed every property ("6 failed", exit 1,
    which says a gradient is wrong)."""
    (tmp_path / "conftest.py").write_text(BLOCKED)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**env, "BLOCK_MODULES": block})
    text = ran.stdout + ran.stderr
    assert ran.returncode == pytest.ExitCode.USAGE_ERROR, text[-3000:]
    assert f"pip install 'tyingspec[{extra}]'" in text
    assert "failed" not in text and "Traceback" not in text


def test_a_summary_to_stdout_lands_beside_the_terminal_report(tmp_path: Path) -> None:
    """``--tyingspec-summary=/dev/stdout > log``: opened anew in append mode, the summary
    went to the end of ``log`` while pytest's own offset stayed behind it, and the terminal
    report then wrote over it; under pytest's capture it went into the capture's file."""
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    with open(log, "w") as fh:
        ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                              "--tyingspec-adapter=tied", *FAST, "--tyingspec-summary=/dev/stdout"],
                             cwd=tmp_path, stdout=fh, stderr=subprocess.PIPE, text=True,
                             timeout=300, env=env)
    text = log.read_text()
    assert ran.returncode == 0, text[-3000:] + ran.stderr
    assert "| `sum_of_paths` | SUM | ✅ passed |" in text  # the summary
    assert re.search(r"^sum_of_paths +\[SUM\] +passed", text, re.M)  # the terminal report
    assert re.search(r"\d+ passed in ", text)
