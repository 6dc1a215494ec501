"""The run's label is a function of its cases, not of the interpreter's hash seed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tyingspec._check import CheckReport


def _report(*labels: str) -> CheckReport:
    report = CheckReport("t", "model", 0)
    report.results = [SimpleNamespace(status="wrong", diagnosis=SimpleNamespace(label=label))
                      for label in labels]  # type: ignore[misc]
    return report


def test_the_most_frequent_case_label_is_the_runs() -> None:
    assert _report("path_scaled", "input_path_missing", "input_path_missing").diagnosis_label \
        == "input_path_missing"


@pytest.mark.parametrize(("labels", "first"), [
    (("duplicates_not_accumulated", "input_path_missing"), "duplicates_not_accumulated"),
    (("input_path_missing", "duplicates_not_accumulated"), "input_path_missing"),
])
def test_a_tie_between_labels_goes_to_the_first_case(labels: tuple[str, ...],
                                                     first: str) -> None:
    assert _report(*labels).diagnosis_label == first


def test_the_label_does_not_change_with_pythonhashseed() -> None:
    code = textwrap.dedent('''
        from types import SimpleNamespace
        from tyingspec._check import CheckReport
        r = CheckReport("t", "model", 0)
        labels = ["output_path_wrong", "path_scaled", "input_path_wrong", "unknown",
                  "duplicates_not_accumulated", "input_path_missing"]
        r.results = [SimpleNamespace(status="wrong", diagnosis=SimpleNamespace(label=x))
                     for x in labels]
        print(r.diagnosis_label)
    ''')
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}
                           ).stdout.strip() for seed in range(6)}
    assert seen == {"output_path_wrong"}
