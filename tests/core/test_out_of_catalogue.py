"""Outside the catalogue a label is the one its rows explain, or ``unknown``; and the two front
ends, ``tyingspec check`` (seeded cases) and the pytest plugin (Hypothesis-drawn and shrunk
examples), name the same bug with the same label."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings

import tyingspec
from tyingspec._src.core.cases import Case
from tyingspec._src.core.diagnosis import LABELS, run_label
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import first_call, load

HERE = Path(__file__).parents[1]

#: bug -> the label whose pattern explains its rows
HONEST = {
    # dx scattered into the targets' rows: present rows lost their input path, absent rows
    # gained something; neither path alone explains it
    "scatter_into_targets": "unknown",
    # dx without its du @ W.T term: absent rows exact, present rows wrong (not by one factor)
    "dx_missing_du_term": "input_path_wrong",
    # llm.c's dwte[ix] = d after the head's matmul: every present row holds one write of dx
    "llmc_overwrite": "output_path_overwritten",
}


def _check_labels(bug: str) -> tuple[str, list[str]]:
    report = tyingspec.check(f"out_of_catalogue:{bug}", paths=[str(HERE)])
    return report.diagnosis_label, [r.diagnosis.label for r in report.cases
                                    if r.diagnosis is not None and r.status == "wrong"]


def _plugin_labels(bug: str, tmp_path: Path) -> list[str]:
    xml = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    env.pop("CI", None)  # no baseline gate; the derandomized ci profile is asked for below
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
         "-n", "0", "--tyingspec-profile=ci", f"--tyingspec-adapter=out_of_catalogue:{bug}",
         f"--junitxml={xml}", "--rootdir", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    labels = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if case.find("failure") is not None and props.get("tyingspec_verdict") in LABELS:
            labels.append(str(props["tyingspec_verdict"]))
    assert labels, proc.stdout[-3000:]
    # the plugin's summary names the run by the same rule
    assert f"verdict: wrong ({run_label(labels)})" in proc.stdout, proc.stdout[-3000:]
    return labels


@pytest.mark.parametrize("bug", sorted(HONEST))
def test_check_gives_the_label_the_rows_explain(bug: str) -> None:
    label, cases = _check_labels(bug)
    assert label == HONEST[bug], cases
    # no case is labelled with a pattern that does not explain it
    assert "path_scaled" not in cases and "duplicates_not_accumulated" not in cases, cases
    if HONEST[bug] == "unknown":
        assert set(cases) == {"unknown"}, cases


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(HONEST))
def test_check_and_the_plugin_name_the_bug_alike(bug: str, tmp_path: Path) -> None:
    check_label, cases = _check_labels(bug)
    plugin = _plugin_labels(bug, tmp_path)
    assert "path_scaled" not in plugin, plugin
    assert run_label(plugin) == check_label == HONEST[bug], (plugin, cases)


#: what any one example may honestly say of each bug: its label where the rows show it, unknown
#: where they cannot tell (every row present), and input_path_missing where res = 0 makes the
#: forgotten term all of dx
MAY_SAY = {
    "scatter_into_targets": {"unknown", "input_path_wrong"},  # targets all among the tokens
    "dx_missing_du_term": {"input_path_wrong", "input_path_missing", "unknown"},
    # every row present: holding dE_in alone is also "output path missing"
    "llmc_overwrite": {"output_path_overwritten", "output_path_missing", "unknown"},
}


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("bug", sorted(MAY_SAY))
def test_no_drawn_example_gets_a_label_its_rows_do_not_explain(bug: str) -> None:
    target = load(f"out_of_catalogue:{bug}", "model", paths=(str(HERE),))

    @settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @given(cases())
    def example(case: Case) -> None:
        o = first_call(target, case)
        # precision_limited: a float32 case whose error is inside the bfloat16 bound
        if o.diagnosis.wrong and o.diagnosis.label != "precision_limited":
            assert o.diagnosis.label in MAY_SAY[bug], (o.case, o.diagnosis.label,
                                                       o.diagnosis.detail)

    try:
        example()
    finally:
        target.close()
