"""core.forward_check: the one judgement both the torch and the jax kind give a claimed tied
gradient against the forward, tested on a plain numpy loss (the probe model of
``core.paths``), with no framework in the process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tyingspec._src.core.forward_check import (
    Reference,
    fd_budget,
    grad_rtol,
    judge_against_forward,
)
from tyingspec._src.core.paths import closed_form_paths, loss_only
from tyingspec._src.core.tolerance import UNIT_ROUNDOFF, unit_of

V, D, SEED = 24, 6, 3


class Probe:
    """The probe model's loss along a direction, and its two paths in closed form."""

    def __init__(self, seed: int = 0) -> None:
        r = np.random.default_rng(seed)
        self.E = r.normal(0.0, 1.0, (V, D))
        self.W = r.normal(0.0, 1 / math.sqrt(D), (D, D))
        self.tokens = np.array([3, 5, 3, 0, 7, 3, 5, 9, 1, 3, 2, 2])
        self.targets = r.integers(0, V, self.tokens.size)
        p = closed_form_paths(self.E, self.W, None, self.tokens, self.targets)
        self.d_in = np.asarray(p.dE_in)
        self.d_out = np.asarray(p.dE_out)

    def along(self, rows: np.ndarray, Dir: np.ndarray, t: float) -> float:
        E = self.E.copy()
        E[rows] += t * Dir
        return loss_only(E, E, self.W, None, self.tokens, self.targets)


def judge(p: Probe, own: np.ndarray, **kw: object) -> object:
    options: dict[str, object] = dict(check="gradient against the forward", seed=SEED,
                                      reads=p.tokens, vocab=V, loss_precision="float64",
                                      grad_dtype="float64", e_scale=1.0)
    options.update(kw)
    return judge_against_forward(p.along, own, **options)  # type: ignore[arg-type]


def test_a_correct_gradient_passes_with_power_and_a_missing_input_path_is_named() -> None:
    """The pass has power (the same check fails the gradient without its input path); the
    gradient without it is named from the rows, and, where autograd shows the lookup never
    reaching the table, as the missing path it is."""
    p = Probe()
    ok = judge(p, p.d_in + p.d_out, input_path=p.d_in)
    assert ok.outcome == "passed" and ok.power, ok  # type: ignore[attr-defined]
    wrong = judge(p, p.d_out)
    assert wrong.outcome == "failed", wrong  # type: ignore[attr-defined]
    assert wrong.label == "input_path_wrong", wrong  # type: ignore[attr-defined]
    missing = judge(p, p.d_out, input_reached=False)
    assert missing.label == "input_path_missing", missing  # type: ignore[attr-defined]
    head = judge(p, p.d_in, output_reached=False)
    assert head.label == "output_path_missing", head  # type: ignore[attr-defined]


def test_a_set_no_row_confirms_never_fails_a_model_unless_a_path_is_unreached() -> None:
    """A loss whose evaluation over many rows at once is off (rounding summed over a set at
    a large batch, as Flax's lm1b computing in float32 showed) makes a set disagree and no
    row confirm it: that is no evidence against a correct gradient, so the check passes,
    without power, and says so (the jax kind failed it); only autograd's evidence of a path
    never reaching the table names it."""
    p = Probe()

    def lumpy(rows: np.ndarray, Dir: np.ndarray, t: float) -> float:
        # a term along sets of several rows only: single-row tests agree
        return p.along(rows, Dir, t) + (1e-3 * t if rows.size > 3 else 0.0)

    options = dict(check="c", seed=SEED, reads=p.tokens, vocab=V, loss_precision="float64",
                   grad_dtype="float64", e_scale=1.0)
    own = p.d_in + p.d_out
    found = judge_against_forward(lumpy, own, **options)  # type: ignore[arg-type]
    assert found.outcome == "passed" and not found.power, found
    assert "no single row could be confirmed" in found.detail, found
    unreached = judge_against_forward(lumpy, own, input_reached=False,
                                      **options)  # type: ignore[arg-type]
    assert unreached.outcome == "failed" and unreached.label == "input_path_missing"


def test_a_gradient_computed_in_float32_is_judged_at_float32_whatever_it_is_held_in() -> None:
    """A float32 computation handed back as float64 (every value on the float32 grid) is
    judged at float32's roundoff (core.tolerance.computed_in), never failed at float64's."""
    p = Probe()
    own32 = (p.d_in + p.d_out).astype(np.float32).astype(np.float64)
    assert grad_rtol(own32, "float64") == 16 * UNIT_ROUNDOFF["float32"]
    assert grad_rtol(p.d_in + p.d_out, "float64") == 2.0**-40
    # a correct float32 gradient, against a float64 loss: within float32's rounding
    found = judge(p, own32)
    assert found.outcome == "passed", found  # type: ignore[attr-defined]


def test_a_row_within_the_frameworks_own_rounding_is_not_condemned() -> None:
    """``same_rounding``: a row that disagrees with the forward no more than the framework's
    own gradient of the same forward in the same dtype does is excused, and said so."""
    p = Probe()
    own = p.d_in + p.d_out
    off = own.copy()
    off[4] *= 1 + 1e-4  # a row the forward check confirms
    assert judge(p, off).label == "gradient_disagrees_with_forward"  # type: ignore[attr-defined]
    excused = judge(p, off, same_rounding=Reference(own, np.full(V, 1e-3), "bfloat16"))
    assert excused.outcome == "passed" and "[4]" in excused.detail  # type: ignore[attr-defined]
    tight = judge(p, off, same_rounding=Reference(own, np.full(V, 1e-6), "bfloat16"))
    assert tight.outcome == "failed"  # type: ignore[attr-defined]


def test_a_16_bit_gradient_has_the_absent_rows_tested_alone() -> None:
    """In 16 bits the batch's rows dominate a set's tolerance: a head halved on the rows
    that hold the output path alone hides under them, and is found by testing those rows on
    their own (where the kind can tell their rounding from an error: ``same_rounding``)."""
    r = np.random.default_rng(0)
    E0 = r.normal(0.0, 1.0, (V, D))
    reads = np.arange(8)
    w = np.where(np.arange(V) < 8, 1000.0, 1.0)[:, None]  # the batch's rows: large terms

    def along(rows: np.ndarray, Dir: np.ndarray, t: float) -> float:
        E = E0.copy()
        E[rows] += t * Dir
        return float(0.5 * (w * E * E).sum())

    own = w * E0
    halved = own.copy()
    halved[8:] *= 0.5
    options = dict(check="c", seed=SEED, reads=reads, vocab=V, loss_precision="float64",
                   grad_dtype="bfloat16", e_scale=1.0)
    hidden = judge_against_forward(along, halved, **options)  # type: ignore[arg-type]
    assert hidden.outcome == "passed", hidden  # under the batch's rows: not seen
    excuse = Reference(own, np.full(V, 2.0**-8), "bfloat16")
    found = judge_against_forward(along, halved, same_rounding=excuse,
                                  **options)  # type: ignore[arg-type]
    assert found.outcome == "failed", found
    rows = {int(x) for x in found.detail.split("]")[0].split("[")[1].split(", ")}
    assert rows and rows <= set(range(8, V)), found.detail
    assert judge_against_forward(along, own, same_rounding=excuse,
                                 **options).outcome == "passed"  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype,unit", [("float32", 2.0**-24), ("bfloat16", 2.0**-8),
                                        (np.float16, 2.0**-11), (None, 2.0**-53)])
def test_units_come_from_core_tolerance_for_any_dtype_spelling(dtype: object,
                                                               unit: float) -> None:
    assert unit_of(dtype) == unit
    assert fd_budget(V) == int(200 + 60 * math.log2(V))
