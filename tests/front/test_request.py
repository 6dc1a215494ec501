"""One request, two front ends (issue 54): ``tyingspec check`` and ``tyingspec.check(...)`` build
the same :class:`CheckRequest`, so they reject the same bad input with the same message (the
command line exits 2 with it, the API raises it as a ``ValueError``)."""

from __future__ import annotations

from typing import Any

import pytest
import test_layout

import tyingspec
from tyingspec._src.core.options import UsageError
from tyingspec._src.front.cli import main
from tyingspec._src.front.request import CheckRequest

#: (command line after ``tyingspec check``, the API's arguments, the problem both report)
BAD = [
    (["tied", "--case", "nope"], {"case": "nope"},
     "--case: no case 'nope'; known: absent-tokens, repeated-tokens"),
    (["tied", "--autocast", "bfloat16"], {"autocast": "bfloat16"},
     "--autocast does not apply to --kind model"),
    (["tied", "--device", "cuda"], {"device": "cuda"}, "--device does not apply to --kind model"),
    (["tied", "--shape", "100000000,100000,100"], {"shape": (100000000, 100000, 100)},
     "--shape 100000000,100000,100: "),
    (["tied", "--case", "v-equals-1", "--shape", "8,4,6"],
     {"case": "v-equals-1", "shape": (8, 4, 6)},
     "no case left to run, so there is no verdict: --shape 8,4,6: left out v-equals-1 "
     "(defined by their shape)"),
]


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["check", *argv, "-q"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    prefix = "tyingspec: error: "
    assert err.startswith(prefix), err
    return err[len(prefix):]


@pytest.mark.parametrize(("argv", "kwargs", "problem"), BAD,
                         ids=[" ".join(a) for a, _, _ in BAD])
def test_the_cli_and_the_api_reject_the_same_input_with_the_same_message(
        argv: list[str], kwargs: dict[str, Any], problem: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from_cli = _cli_error(argv, capsys)
    with pytest.raises(ValueError) as raised:
        tyingspec.check("tied", **kwargs)
    assert isinstance(raised.value, UsageError) and isinstance(
        raised.value, tyingspec.TyingspecError)
    assert str(raised.value) == from_cli
    assert from_cli.startswith(problem), from_cli
    assert CheckRequest("tied", **kwargs).problems() == [from_cli]


@pytest.mark.parametrize(("argv", "problem"), [
    (["tied", "--padding-idx", "-1"], "--padding-idx must be a row index >= 0, got -1"),
    (["tied", "--kind", "kernel", "--padding-idx", "1"],
     "--padding-idx applies to --kind model (a kernel target gets the rows it scatters as they "
     "are)"),
    (["tied", "--tokens", "1,2"], "--tokens and --targets go together"),
    (["tied", "--tokens", "1,2", "--targets", "1,2"], "--tokens/--targets need --case"),
    (["tied", "--case", "absent-tokens", "--tokens", "1,99", "--targets", "1,2"],
     "--tokens/--targets: "),
])
def test_the_cli_reports_the_requests_problem_for_its_own_options(
        argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tyingspec._src.front.cli import build_parser

    from_cli = _cli_error(argv, capsys)
    assert from_cli.startswith(problem), from_cli
    request = CheckRequest.from_args(build_parser("check").parse_args(["check", *argv]))
    assert request.problems() == [from_cli]
    with pytest.raises(UsageError, match="^" + problem.replace("(", r"\(").replace(")", r"\)")):
        request.chosen()


def test_independent_problems_are_all_listed() -> None:
    request = CheckRequest("tied", autocast="bfloat16", tokens=(1,), shape=(0, 1, 1))
    assert request.problems() == [
        "--autocast does not apply to --kind model", "--tokens and --targets go together",
        "--shape takes V,d,N, three positive integers; got (0, 1, 1)"]


def test_a_good_request_has_no_problem_and_chooses_its_cases() -> None:
    request = CheckRequest("tied", case="absent-tokens", shape=(64, 8, 16), padding_idx=3)
    assert request.problems() == []
    cases, notes = request.chosen()
    assert [(c.name, c.V, c.d, c.N, c.padding_idx) for c in cases] == [
        ("absent-tokens", 64, 8, 16, 3)] and notes == []
    assert CheckRequest("tied").kind_name == "model"
    assert CheckRequest("m:f", kind="kernel").kind_name == "kernel"


def test_an_unknown_kind_is_a_problem_naming_the_known_ones() -> None:
    (problem,) = CheckRequest("tied", kind="nokind").problems()
    assert problem.startswith("unknown kind 'nokind'; expected one of model, kernel")


# ---- the modules: results apart from the run and the report, no long function ----

FRONT = "tyingspec._src.front."


def test_the_results_import_neither_the_run_nor_the_report() -> None:
    # the results are what the run and the report share (no cycle at all, type-level ones
    # included: tests/test_layout.py); they import neither
    edges = test_layout.graph(type_level=True)
    assert not {FRONT + m for m in ("check", "report", "request", "cli", "api", "baseline",
                                    "html")} & edges[FRONT + "results"]


@pytest.mark.parametrize("module", ["cli", "api", "request", "results", "report"])
def test_no_function_of_the_checks_front_ends_is_over_the_limit(module: str) -> None:
    source = (test_layout.PACKAGE / "_src" / "front" / f"{module}.py").read_text()
    assert not test_layout._long_functions(source, test_layout.DIAGNOSIS_FUNCTION_LINES)
