"""``tyingspec.check`` and ``tyingspec.assert_correct``: one line in anyone's test."""

from __future__ import annotations

import pytest

import tyingspec
from tyingspec._src.kinds.table import kind_spec


def test_check_returns_a_report_that_is_ok_for_a_correct_implementation() -> None:
    report = tyingspec.check("tied")
    assert report.ok and report.exit_code == 0
    assert [r.case.name for r in report.cases] == [c.name for c in kind_spec("model").cases(0)]
    assert report.diagnosis.startswith("tied (--kind model): correct")
    report.raise_for_failure()  # nothing to raise


def test_a_broken_implementation_fails_with_its_diagnosis_first() -> None:
    report = tyingspec.check("duplicates-last-only", case="repeated-tokens")
    assert not report.ok and report.diagnosis_label == "duplicates_not_accumulated"
    with pytest.raises(tyingspec.CheckFailed) as caught:
        report.raise_for_failure()
    message = str(caught.value)
    assert message.splitlines()[0] == ("duplicates-last-only (--kind model): wrong "
                                       "(duplicates_not_accumulated)")
    assert caught.value.report is report
    assert isinstance(caught.value, AssertionError)  # pytest reports it as a failed assert


def test_assert_correct_raises_an_assertion_error_naming_the_label() -> None:
    with pytest.raises(AssertionError, match="duplicates_not_accumulated"):
        tyingspec.assert_correct("duplicates-last-only", case="repeated-tokens")
    assert tyingspec.assert_correct("tied", case="repeated-tokens").ok


def test_a_kind_runs_its_own_cases_by_default() -> None:
    # check_target(spec, "linear-ce", 0, standard_cases(0)) ran the probe model's cases on a
    # kernel and passed a broken one; the kind's own cases are the default everywhere
    own = {c.name for c in kind_spec("linear-ce").cases(0)}
    assert not own & {c.name for c in kind_spec("model").cases(0)}
    report = tyingspec.check_target("ce-scale-dropped", "linear-ce", 0)
    assert report.cases and {r.case.name for r in report.cases} <= own
    assert report.exit_code == 1 and report.diagnosis_label == "logit_scale_dropped"


def test_bad_input_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="no case 'nope'"):
        tyingspec.check("tied", case="nope")
    with pytest.raises(ValueError, match="unknown kind 'nokind'"):
        tyingspec.check("tied", kind="nokind")
