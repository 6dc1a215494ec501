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


# --- warm workers --------------------------------------------------------------------------------

KERNEL_SOURCE = '''
import numpy as np

def kernel(tokens, dx, h, g, vocab_size):
    dE = g.T @ h
    {input_path}
    return dE
'''
RIGHT = "np.add.at(dE, np.asarray(tokens).reshape(-1), dx.reshape(len(tokens), -1))"


def _write_kernel(path, input_path: str) -> None:  # type: ignore[no-untyped-def]
    import os

    path.write_text(KERNEL_SOURCE.format(input_path=input_path))
    # a later mtime even on a filesystem whose clock ticks in whole seconds
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_a_second_check_reuses_the_worker_until_the_source_changes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tyingspec._src.engine.warm import WARM

    module = tmp_path / "warm_kernel_mod.py"
    _write_kernel(module, RIGHT)
    spec, paths = "warm_kernel_mod:kernel", [str(tmp_path)]
    key = (spec, "kernel", "auto", 120.0, (str(tmp_path),))
    try:
        assert tyingspec.check(spec, "kernel", case="repeated-tokens", paths=paths).ok
        first = WARM._kept[key].worker
        assert first is not None and first._proc is not None
        pid = first._proc.pid
        assert tyingspec.check(spec, "kernel", case="absent-tokens", paths=paths).ok
        again = WARM._kept[key].worker
        assert again is first and again._proc is not None and again._proc.pid == pid
        # the user fixes nothing but breaks the kernel: the next check runs the new code
        _write_kernel(module, "pass  # the input path dropped")
        report = tyingspec.check(spec, "kernel", case="repeated-tokens", paths=paths)
        assert report.diagnosis_label == "input_path_missing", report.diagnosis
        assert WARM._kept[key].worker is not first
    finally:
        WARM.close()
    assert len(WARM) == 0


def test_the_staleness_check_reads_no_user_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the parent compares the digests of the files the worker read with the files as they are:
    # it reads their bytes and never imports them
    import sys

    from tyingspec._src.engine.isolation import digest, unchanged

    loud = tmp_path / "stamp_mod_loud.py"
    loud.write_text("raise SystemExit('imported!')\n")
    sources = {str(loud): digest(str(loud)), str(tmp_path / "gone.json"): "missing"}
    assert unchanged(sources) and "stamp_mod_loud" not in sys.modules
    loud.write_text("raise SystemExit('imported again!')\n")
    assert not unchanged(sources)
    assert digest(str(tmp_path)) is None  # a folder has no bytes to key on
