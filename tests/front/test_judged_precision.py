"""The precision a call is judged at is the one it computed in (issue 50 §5).

A correct implementation that computes in float32 and returns float64 was judged at float64,
beyond whose bound its rounding lies: ``precision_limited``, exit 1, which is to mean a wrong
gradient and nothing else.  Every value it returns lies exactly on the float32 grid, so it was
computed (or rounded) there: it is judged at float32 and the report says why.  One rule in the
engine (``engine.observe.judged_precision``), for every kind; ``--precision`` still decides
when given."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tyingspec._src.core.tolerance import GRID_EVIDENCE_BITS, computed_in, numpy_dtype
from tyingspec._src.front.api import check
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.probe.builtins import REGISTRY
from tyingspec._src.kinds.table import KINDS

ADAPTERS = textwrap.dedent('''
    """Correct implementations that compute in one precision and return another."""
    import numpy as np
    from tyingspec import REGISTRY

    _model = REGISTRY["tied"].model
    _kernel = REGISTRY["tied"].kernel
    _broken = REGISTRY["output-path-only"].model


    def _as(out, dtype):
        return {k: None if v is None else np.asarray(v, dtype) for k, v in out.items()}


    def _in(args, dtype):
        return [np.asarray(a, dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f"
                else a for a in args]


    def model_f32(E, W, b, tokens, targets, *, res, s_in):
        """The probe model in float32, its results returned as float64."""
        out = _model(*_in([E, W, b, tokens, targets], np.float32), res=res, s_in=s_in)
        return _as(dict(out), np.float64)


    def broken_f32(E, W, b, tokens, targets, *, res, s_in):
        """The input path dropped, in float32, returned as float64: still wrong."""
        out = _broken(*_in([E, W, b, tokens, targets], np.float32), res=res, s_in=s_in)
        return _as(dict(out), np.float64)


    def kernel_f32(tokens, dx, h, g, vocab_size):
        dx, h, g = _in([dx, h, g], np.float32)
        return np.asarray(_kernel(tokens, dx, h, g, vocab_size), np.float64)


    def linear_ce_f32(h, E, targets, *, ignore_index=-100, reduction="mean"):
        """A fused linear cross-entropy computing in float32 (as a Triton kernel's
        accumulators do), returning float64."""
        h32, E32 = np.asarray(h, np.float32), np.asarray(E, np.float32)
        y = np.asarray(targets).reshape(-1)
        keep = y != ignore_index
        y = np.where(keep, y, 0)
        rows = np.arange(len(y))
        z = h32 @ E32.T
        z = z - z.max(axis=1, keepdims=True)
        se = np.exp(z).sum(axis=1)
        per_token = np.log(se) - z[rows, y]
        scale = np.float32(1.0 if reduction == "sum" else
                           (1.0 / keep.sum() if keep.any() else 0.0))
        g = np.exp(z) / se[:, None]
        g[rows, y] -= 1
        g *= np.where(keep, scale, np.float32(0)).astype(np.float32)[:, None]
        loss = float(np.where(keep, per_token, 0).sum() * scale)
        return {"loss": loss, "dh": (g @ E32).astype(np.float64),
                "dE": (g.T @ h32).astype(np.float64), "db": None}
''')


@pytest.fixture
def adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "mixed_precision.py").write_text(ADAPTERS)
    monkeypatch.chdir(tmp_path)
    return "mixed_precision"


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("target, kind", [("model_f32", "model"), ("kernel_f32", "kernel"),
                                          ("linear_ce_f32", "linear-ce")])
def test_a_float32_result_returned_as_float64_is_judged_at_float32_and_passes(
        adapters: str, target: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{adapters}:{target}", "--kind", kind]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "precision_limited" not in out
    assert "judged at float32 (every value it returned is a float32, though its dtype is " \
           "float64)" in out, out
    report = check(f"{adapters}:{target}", kind)
    judged = {r.precision for r in report.results if r.diagnosis is not None}
    assert report.ok and "float32" in judged, report.diagnosis


def test_a_wrong_float32_result_returned_as_float64_is_still_wrong(
        adapters: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{adapters}:broken_f32"]) == 1
    out = capsys.readouterr().out
    assert "input_path_missing" in out and "judged at float32: every value it returned" in out


def test_precision_still_overrides_what_the_values_say(
        adapters: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--precision float64`` judges at float64 whatever the grid: the float32 result is
    beyond that bound and within float32's, which is what ``precision_limited`` names."""
    assert main(["check", f"{adapters}:model_f32", "--precision", "float64",
                 "--case", "absent-tokens"]) == 1
    out = capsys.readouterr().out
    assert "precision_limited" in out and "every value it returned" not in out


def test_a_float64_implementation_stays_judged_at_float64() -> None:
    report = check("tied", "model")
    assert {r.precision for r in report.results} == {"float64"}
    assert not any(r.precision_note for r in report.results)


@pytest.mark.parametrize("grid", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_values_on_a_coarser_grid_name_it_and_values_off_it_do_not(grid: str,
                                                                   dtype: str) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(5000)
    on = values.astype(numpy_dtype(grid)).astype(dtype)  # type: ignore[arg-type]
    if np.dtype(dtype).itemsize * 8 <= {"float32": 32, "float16": 16, "bfloat16": 16}[grid]:
        assert computed_in(on) is None  # not coarser than its own dtype
        return
    assert computed_in(on) == grid
    off = on.copy()
    off[4999] = np.nextafter(off[4999], np.inf)  # one value off the grid, past the sample
    assert computed_in(off) != grid


def test_too_few_nonzero_values_are_no_evidence() -> None:
    """A handful of values can all sit on a coarse grid by chance; zeros sit on every grid."""
    few = np.zeros(100)
    few[:1] = 0.5  # 29 bits of evidence from float64 to float32, 45 to bfloat16
    assert 45 < GRID_EVIDENCE_BITS and computed_in(few) is None
    few[:2] = 0.5  # 90 bits: enough for bfloat16, the coarsest grid they lie on
    assert computed_in(few) == "bfloat16"
    assert computed_in(np.zeros(10)) is None


def test_the_rule_is_the_engines_for_every_front_end() -> None:
    """The properties judge through the same rule: a float32 result dressed as float64 passes
    ``sum_of_paths`` at float32 (it was precision_limited at float64)."""
    from tyingspec.properties import PROPERTIES

    from tyingspec._src.core.cases import standard_cases
    from tyingspec._src.engine.observe import Target, observe

    tied = REGISTRY["tied"].model
    assert tied is not None

    def f32(E: np.ndarray, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray,
            targets: np.ndarray, *, res: float, s_in: float) -> dict[str, Any]:
        out = tied(E.astype(np.float32), W.astype(np.float32),
                   None if b is None else b.astype(np.float32), tokens, targets,
                   res=res, s_in=s_in)
        return {k: None if v is None else np.asarray(v, np.float64) for k, v in out.items()}

    target = Target("f32", KINDS["model"], f32)
    case = next(c for c in standard_cases(0) if c.name == "repeated-tokens")
    o = observe(target, case)
    assert (o.precision, o.label) == ("float32", "correct"), o.diagnosis.detail
    assert o.precision_note.startswith("every value it returned is a float32")
    PROPERTIES["sum_of_paths"].check(target, case)
