"""``tyingspec check --quick``: the cases in order until each path has had one with the power
to see it (or one is wrong), a torch model's cheaper checks only, and the report marked partial
in its text and its JSON.  (Named ``torch`` for the marker: the last tests run nanogpt.)"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from report_schemas import assert_valid

from tyingspec._src.front.check import check_target
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.table import KINDS


def _run(argv: list[str], code: int, tmp_path: Path,
         capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, object]]:
    out = tmp_path / "report.json"
    assert main([*argv, "--json", str(out), "-q"]) == code
    report = json.loads(out.read_text())
    assert_valid(report, "check-1.json")
    return capsys.readouterr().out, report


def test_a_quick_check_says_it_is_partial_in_text_and_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, report = _run(["check", "tied", "--quick"], 0, tmp_path, capsys)
    cases = report["cases"]
    assert isinstance(cases, list) and 0 < len(cases) < 10
    assert report["quick"] == {"cases_run": len(cases), "cases_total": 10, "checks": None}
    assert re.search(rf"^verdict: correct; .*; quick: {len(cases)} of 10 cases; not a full "
                     r"check$", text, re.M), text
    # it stopped at the first case after which every path had been seen with power
    last = cases[-1]
    assert isinstance(last, dict)
    powers = [c["power"] for c in cases]  # type: ignore[index]
    assert all(any(p[path] for p in powers)
               for path in ("input_path", "output_path", "duplicates")), powers
    assert not all(any(p[path] for p in powers[:-1])
                   for path in ("input_path", "output_path", "duplicates")), powers


def test_a_full_check_is_not_marked_quick(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    text, report = _run(["check", "tied"], 0, tmp_path, capsys)
    assert report["quick"] is None and "quick:" not in text and len(report["cases"]) == 10  # type: ignore[arg-type]


def test_a_quick_check_stops_at_the_first_wrong_case(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    text, report = _run(["check", "output-path-only", "--quick"], 1, tmp_path, capsys)
    assert report["quick"] == {"cases_run": 1, "cases_total": 10, "checks": None}
    assert "verdict: wrong (input_path_missing)" in text and "quick: 1 of 10 cases" in text


@pytest.mark.slow  # torch's import and a model's checks: ~15 s on a loaded two-core machine
def test_a_quick_check_of_a_torch_model_runs_one_case_and_the_cheap_checks() -> None:
    t0 = time.process_time()
    quick = check_target("nanogpt", "torch", 0, quick=True)
    cpu = time.process_time() - t0
    assert quick.verdict == "correct" and quick.quick is not None
    assert (quick.quick.run, quick.quick.total) == (1, 4)
    assert quick.quick.checks == KINDS["torch"].quick_checks == (
        "identity", "optimizer", "gradient", "forward")
    findings = {f.check.split()[0] for r in quick.results if r.diagnosis is not None
                for f in r.diagnosis.findings}
    assert "micro-batch" not in " ".join(findings)
    # a few seconds, not the full check's minute (generous: a loaded machine's CPU seconds)
    assert cpu < 30, cpu


@pytest.mark.slow
def test_a_quick_check_of_a_broken_torch_model_still_names_it() -> None:
    report = check_target("nanogpt-input-path-dropped", "torch", 0, quick=True)
    assert report.verdict == "wrong" and report.quick is not None and report.quick.run == 1


def test_a_quick_check_records_no_baseline(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", "tied", "--quick", "--baseline", str(tmp_path / "b.json"),
              "--update-baseline"])
    assert exc.value.code == 2 and "drop --quick" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
