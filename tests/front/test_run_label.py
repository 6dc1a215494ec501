"""The run's label is a function of its cases, not of the interpreter's hash seed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tyingspec._src.front.check import CheckReport


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


def test_an_example_that_cannot_tell_does_not_name_the_run() -> None:
    # every row present: the example says unknown; the examples that can tell name the bug
    assert _report("unknown", "unknown", "input_path_wrong").diagnosis_label == \
        "input_path_wrong"
    assert _report("unknown", "unknown").diagnosis_label == "unknown"


def test_a_special_case_counts_as_its_general_label() -> None:
    # dx missing a term: "input path missing" where res = 0, "input path wrong" elsewhere
    assert _report("input_path_missing", "input_path_missing", "input_path_wrong"
                   ).diagnosis_label == "input_path_wrong"
    # ... but alone it keeps its own name
    assert _report("input_path_missing", "path_scaled", "input_path_missing"
                   ).diagnosis_label == "input_path_missing"


def test_the_label_does_not_change_with_pythonhashseed() -> None:
    code = textwrap.dedent('''
        from types import SimpleNamespace
        from tyingspec._src.front.check import CheckReport
        r = CheckReport("t", "model", 0)
        labels = ["unknown", "output_path_wrong", "path_scaled", "gradient_not_zeroed",
                  "tie_is_a_copy", "inputs_mutated"]
        r.results = [SimpleNamespace(status="wrong", diagnosis=SimpleNamespace(label=x))
                     for x in labels]
        print(r.diagnosis_label)
    ''')
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}
                           ).stdout.strip() for seed in range(6)}
    assert seen == {"output_path_wrong"}
