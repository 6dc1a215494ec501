"""Diagnosis: compare an implementation's dE with the two-path reference and say what is wrong.

The reference is split into ``dE_in`` (input path, sparse) and ``dE_out`` (output path, dense),
so a wrong matrix can be explained as a combination of them: a path missing, a path scaled, the
input path overwriting the output path, or repeated tokens losing occurrences.  The checker also
asks whether its own example *could* have told those apart from a correct gradient ("power").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from tyingspec._src.core import threads
from tyingspec._src.core.findings import Finding, rows_unobserved
from tyingspec._src.core.labels import (
    LABELS as LABELS,  # re-exported: tyingspec.LABELS and the tests read it here
)
from tyingspec._src.core.labels import Label as Label
from tyingspec._src.core.paths import Array, Paths, Sketch
from tyingspec._src.core.tolerance import (
    Precision,
    Tolerance,
    amplification,
    precision_of,
    row_tolerance,
)

#: Labels that say less than a catalogue or path label: a run that also reached one of those is
#: named by it (an example with every row present cannot say which path is wrong), and the
#: properties' shrinking moves on from them to the first that names the bug (label_locked).
UNINFORMATIVE = ("unknown", "no_power")

#: A label that is a special case of another: where a run's examples reached both, the general
#: one names the run (dx missing a term is "input path missing" on an example with res = 0).
_SPECIAL_OF: dict[str, str] = {"input_path_missing": "input_path_wrong",
                               "duplicates_not_accumulated": "input_path_wrong",
                               "output_path_missing": "output_path_wrong"}


def run_label(labels: Sequence[str]) -> str:
    """The label of a run (``tyingspec check``'s cases, the plugin's properties) from the labels
    of its wrong examples, so that both front ends name one bug alike: the most frequent
    informative label, a special case counted as its general label when both were seen, and a
    tie going to the label seen first (never to a set's order, which follows PYTHONHASHSEED)."""
    pool = [x for x in labels if x not in UNINFORMATIVE] or list(labels)
    if not pool:
        return "unknown"
    seen = set(pool)
    pool = [_SPECIAL_OF[x] if _SPECIAL_OF.get(x) in seen else x for x in pool]
    return max(pool, key=pool.count)


@dataclass(frozen=True)
class ArrayCheck:
    """numpy.testing-style comparison result for one returned array."""

    name: str
    ok: bool
    mismatched: int
    size: int
    max_abs_error: float
    max_rel_error: float
    tolerance: Tolerance

    def describe(self) -> str:
        if self.ok:
            return f"{self.name}: ok ({self.tolerance.describe()})"
        share = 100.0 * self.mismatched / max(self.size, 1)
        return (f"{self.name}: {self.mismatched} of {self.size} entries differ ({share:.1f}%); "
                f"max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g} "
                f"under {self.tolerance.describe()}")


def _errors(actual: Array, expected: Array) -> tuple[float, float]:
    diff = np.abs(actual - expected)
    if diff.size == 0:
        return 0.0, 0.0
    nz = np.abs(expected) > 0
    rel = float(np.max(diff[nz] / np.abs(expected[nz]))) if nz.any() else 0.0
    return float(diff.max()), rel


def compare(name: str, actual: Any, expected: Any, tol: Tolerance) -> ArrayCheck:
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    ok = tol.close(a, e)
    mx_abs, mx_rel = _errors(a, e)
    return ArrayCheck(name, bool(ok.all()), int((~ok).sum()), int(ok.size), mx_abs, mx_rel, tol)


@dataclass(frozen=True)
class Power:
    """Whether this example would have caught each kind of bug (False = vacuous for it)."""

    input_path: bool
    output_path: bool
    duplicates: bool | None  # None: the batch has no repeated token

    def as_dict(self) -> dict[str, bool | None]:
        return {"input_path": self.input_path, "output_path": self.output_path,
                "duplicates": self.duplicates}


@dataclass(frozen=True)
class Diagnosis:
    """What is wrong with an implementation's dE on one batch, and where."""

    label: Label
    detail: str
    rows_total: int
    rows_wrong: int
    wrong_rows: list[int]
    present_rows: list[int]
    repeated_rows: dict[int, int]  # row -> multiplicity, for tokens seen more than once
    row_causes: dict[str, list[int]]
    max_abs_error: float
    max_rel_error: float
    tolerance: Tolerance
    power: Power
    scales: tuple[float, float] | None = None  # fitted (input, output) factors
    others: list[ArrayCheck] = field(default_factory=list)
    margin: float = 0.0  # worst row's error / its bound (<= 1: within)
    findings: tuple[Finding, ...] = ()  # named checks beyond rows (the torch kind's)
    rows_label: Label | None = None  # the rows' own label when a finding decided ``label``
    rows_projected: int = 0  # rows judged through projections (see core.paths.Sketch)

    @property
    def precision(self) -> str:
        return self.tolerance.dtype

    @property
    def rows_compared(self) -> bool:
        """False where the rows are the target's own gradient, not compared with a reference
        (a use of the tie could not be observed: see ``core.findings.BY_PATH``)."""
        return not rows_unobserved(self.findings)

    @property
    def rows_exact(self) -> int:
        return self.rows_total - self.rows_wrong

    @property
    def ok(self) -> bool:
        return self.label == "correct"

    @property
    def wrong(self) -> bool:
        return self.label not in ("correct", "no_power")

    def headline(self) -> str:
        return LABELS[self.label] + (f" ({self.detail})" if self.detail else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "detail": self.detail,
            "rows_total": self.rows_total,
            "rows_wrong": self.rows_wrong,
            "rows_exact": self.rows_exact,
            "wrong_rows": list(self.wrong_rows),
            "present_rows": list(self.present_rows),
            "repeated_rows": {str(k): v for k, v in self.repeated_rows.items()},
            "row_causes": {k: list(v) for k, v in self.row_causes.items()},
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "precision": self.precision,
            "margin": self.margin,
            "rows_projected": self.rows_projected,
            "rows_compared": self.rows_compared,
            "rtol": self.tolerance.rtol,
            "power": self.power.as_dict(),
            "scales": None if self.scales is None else list(self.scales),
            "others": [{"name": c.name, "ok": c.ok, "max_abs_error": c.max_abs_error,
                        "max_rel_error": c.max_rel_error} for c in self.others],
            **({"checks": [f.to_json() for f in self.findings]} if self.findings else {}),
        }


@dataclass(frozen=True)
class _Scan:
    row_ratio: np.ndarray  # [V] each row's worst |error| / allowance
    margin: float
    max_abs: float
    max_rel: float
    output_power: bool  # some |dE_out| entry exceeds its allowance (dropping it would show)


#: Rows per block of the scan: a few MB per temporary, so a check at V = 50257 does not
#: allocate (and page in) a dozen 300 MB float64 matrices.
_BLOCK = 512


def _scan(actual: np.ndarray, d_in: np.ndarray, d_out: np.ndarray, tol: Tolerance) -> _Scan:
    """The verdict's numbers in one blocked pass over the rows: in float32 when every array is
    float32 (its own rounding, ~u|e|, is far inside a bound of 2u(k a + max a) with k > 1),
    else in float64."""
    V = actual.shape[0]
    row_ratio = np.zeros(V)
    mx_abs = mx_rel = 0.0
    out_power = False
    low = tol.dtype != "float64" and all(x.dtype == np.float32 for x in (actual, d_in, d_out))
    ct: np.dtype[Any] = np.dtype(np.float32 if low else np.float64)
    tiny = np.finfo(ct).tiny
    atol_all = np.asarray(tol.atol, dtype=ct)
    for s in range(0, V, _BLOCK):
        e = min(V, s + _BLOCK)
        a = actual[s:e].astype(ct, copy=False)
        do = d_out[s:e].astype(ct, copy=False)
        ref = d_in[s:e].astype(ct, copy=False) + do
        abs_ref = np.abs(ref)
        atol = atol_all[s:e] if atol_all.ndim else atol_all
        allow = np.maximum(atol + ct.type(tol.rtol) * abs_ref, tiny)
        diff = np.abs(a - ref)
        row_ratio[s:e] = (diff / allow).max(axis=1, initial=0.0)
        mx_abs = max(mx_abs, float(diff.max(initial=0.0)))
        nz = abs_ref > 0
        if nz.any():
            with np.errstate(over="ignore"):  # a subnormal reference: the ratio is inf, as it is
                mx_rel = max(mx_rel, float((diff[nz] / abs_ref[nz]).max()))
        out_power = out_power or bool((np.abs(do) > allow).any())
    return _Scan(row_ratio, float(row_ratio.max(initial=0.0)), mx_abs, mx_rel, out_power)


def _rows_close(tol: Tolerance, actual: Array, expected: Array) -> np.ndarray:
    rows: np.ndarray = np.asarray(tol.close(actual, expected).all(axis=1))
    return rows


def _row_atol(tol: Tolerance, V: int) -> np.ndarray:
    """The absolute part of each row's bound, as a [V] float64 array."""
    return np.broadcast_to(np.asarray(tol.atol, dtype=np.float64).reshape(-1), (V,))


class _Dense:
    """Every row of dE compared entry by entry; whole float64 matrices only once something is
    wrong and must be explained (a correct gradient is judged by the block scan alone)."""

    def __init__(self, raw: np.ndarray, paths: Paths, tol: Tolerance) -> None:
        self.raw, self.tol = raw, tol
        self.din, self.dout = np.asarray(paths.dE_in), np.asarray(paths.dE_out)
        self.scan = _scan(raw, self.din, self.dout, tol)
        self.projected = 0

    def rows(self, which: str, rows: np.ndarray) -> Array:
        """Rows of ``actual``, ``in`` or ``out`` in float64."""
        a = {"actual": self.raw, "in": self.din, "out": self.dout}[which]
        out: Array = np.asarray(a[rows], dtype=np.float64)
        return out

    @cached_property
    def _whole(self) -> tuple[Array, Array, Array]:
        return (self.raw.astype(np.float64), self.din.astype(np.float64),
                self.dout.astype(np.float64))

    def lin_ok(self, x: float, y: float) -> np.ndarray:
        """Per row: is it within its bound of ``x dE_in + y dE_out``?  A path taken ``k``
        times carries ``k`` times its rounding (see ``core.tolerance.amplification``)."""
        actual, d_in, d_out = self._whole
        return _rows_close(self.tol.amplified(amplification(x, y)), actual,
                           x * d_in + y * d_out)

    def columns(self) -> tuple[Array, Array, Array]:
        """``actual``, ``dE_in`` and ``dE_out`` as flat float64 vectors (for the fits)."""
        actual, d_in, d_out = self._whole
        return actual.reshape(-1), d_in.reshape(-1), d_out.reshape(-1)


#: Rows of dE projected at a time: 128 rows of a GPT-2-size d are 0.8 MB in float64, so each
#: block is converted and multiplied while it sits in a core's L2 cache (timed by hand at
#: GPT-2 size on the 2-core Xeon VM of 2026-12-04: blocks of 4096 rows, through memory, 0.10 s
#: a call on one core; blocks of 128, 0.05 s on one core and 0.03 s on two).
_PROJECT_ROWS = 128


def _projected(rows: np.ndarray, sketch: Sketch) -> Array:
    """``rows @ Z`` in float64: the sampled columns read out as they are (exact), the
    Gaussian directions summed in float64, a cache-sized block of rows at a time, blocks split
    over the cores (each row's sums the same on any number of cores)."""
    n = sketch.columns.shape[0]
    V = rows.shape[0]
    out = np.empty((V, sketch.Z.shape[1]))
    gaussian = np.ascontiguousarray(sketch.Z[:, n:])

    def block(b: slice) -> None:
        out[b, :n] = rows[b, sketch.columns]
        np.matmul(np.asarray(rows[b], np.float64), gaussian, out=out[b, n:])

    threads.on_row_blocks(block, V, _PROJECT_ROWS)
    return out


class _Sketched:
    """The rows of ``sketch.exact`` entry by entry, every other row (which carries the output
    path alone) through the sketch's projections (see ``core.paths.Sketch``)."""

    def __init__(self, raw: np.ndarray, paths: Paths, sketch: Sketch, tol: Tolerance) -> None:
        V = raw.shape[0]
        self.tol = tol
        self.exact = sketch.exact
        self.a_e = np.asarray(raw[self.exact], dtype=np.float64)
        self.i_e = paths.in_rows(self.exact)
        self.o_e = paths.out_rows(self.exact)
        atol = _row_atol(tol, V)
        self.atol_e = atol[self.exact][:, None]
        mask = np.ones(V, dtype=bool)
        mask[self.exact] = False
        self.sk = np.flatnonzero(mask)
        self.projected = int(self.sk.shape[0])
        self.p_a = _projected(raw, sketch)[self.sk]
        self.p_o, self.mag = sketch.out[self.sk], sketch.mag[self.sk]
        self.atol_s = atol[self.sk][:, None] * np.abs(sketch.Z).sum(axis=0)[None, :]
        self.scan = self._scan(V)

    # Both parts are compared a block of rows at a time: whole-part temporaries are 12 MB
    # each at GPT-2 size, and every fresh one costs its page faults again.

    def _allow_e(self, expected: Array, rows: slice, k: float = 1.0) -> Array:
        out: Array = np.maximum(k * self.atol_e[rows] + self.tol.rtol * np.abs(expected),
                                np.finfo(np.float64).tiny)
        return out

    def _allow_s(self, y: float, rows: slice, k: float = 1.0) -> Array:
        out: Array = np.maximum(k * self.atol_s[rows] + self.tol.rtol * abs(y) * self.mag[rows],
                                np.finfo(np.float64).tiny)
        return out

    def _blocks(self, part: np.ndarray) -> list[slice]:
        # a few MB per temporary: 512 exact rows of d entries, 8 x 512 projected ones
        n = _BLOCK if part is self.exact else 8 * _BLOCK
        return [slice(s, s + n) for s in range(0, part.shape[0], n)]

    def _scan(self, V: int) -> _Scan:
        row_ratio = np.zeros(V)
        mx_abs = mx_rel = 0.0
        out_power = False
        for b in self._blocks(self.exact):
            ref = self.i_e[b] + self.o_e[b]
            diff = np.abs(self.a_e[b] - ref)
            allow = self._allow_e(ref, b)
            row_ratio[self.exact[b]] = (diff / allow).max(axis=1, initial=0.0)
            nz = np.abs(ref) > 0
            if nz.any():
                mx_rel = max(mx_rel, float((diff[nz] / np.abs(ref[nz])).max()))
            mx_abs = max(mx_abs, float(diff.max(initial=0.0)))
            out_power = out_power or bool((np.abs(self.o_e[b]) > allow).any())
        for b in self._blocks(self.sk):
            allow_s = self._allow_s(1.0, b)
            row_ratio[self.sk[b]] = (np.abs(self.p_a[b] - self.p_o[b]) / allow_s).max(
                axis=1, initial=0.0)
            out_power = out_power or bool((np.abs(self.p_o[b]) > allow_s).any())
        return _Scan(row_ratio, float(row_ratio.max(initial=0.0)), mx_abs, mx_rel, out_power)

    def rows(self, which: str, rows: np.ndarray) -> Array:
        """Rows of ``actual``, ``in`` or ``out`` in float64 (rows compared entry by entry)."""
        at = np.searchsorted(self.exact, rows)
        assert np.array_equal(self.exact[at], rows), "rows outside the exact rows"
        return {"actual": self.a_e, "in": self.i_e, "out": self.o_e}[which][at]

    def lin_ok(self, x: float, y: float) -> np.ndarray:
        """Per row: is it within its bound of ``x dE_in + y dE_out``?  (dE_in is zero on the
        projected rows: they are the tokens absent from the batch.)"""
        ok = np.zeros(self.exact.shape[0] + self.sk.shape[0], dtype=bool)
        k = amplification(x, y)
        for b in self._blocks(self.exact):
            cand = x * self.i_e[b] + y * self.o_e[b]
            ok[self.exact[b]] = (np.abs(self.a_e[b] - cand)
                                 <= self._allow_e(cand, b, k)).all(axis=1)
        for b in self._blocks(self.sk):
            ok[self.sk[b]] = (np.abs(self.p_a[b] - y * self.p_o[b])
                              <= self._allow_s(y, b, k)).all(axis=1)
        return ok

    def columns(self) -> tuple[Array, Array, Array]:
        """The exact rows entry by entry, then the projected rows (where dE_in is zero)."""
        return (np.concatenate([self.a_e.reshape(-1), self.p_a.reshape(-1)]),
                np.concatenate([self.i_e.reshape(-1), np.zeros(self.p_o.size)]),
                np.concatenate([self.o_e.reshape(-1), self.p_o.reshape(-1)]))


def _simple(x: float, n: int) -> bool:
    """Whether ``x`` is a number a stray factor is made of: an integer or the reciprocal of one
    up to 64, or the batch's N or 1/N (a sum where a mean was meant)."""
    return any(math.isclose(x, v, rel_tol=1e-9) or math.isclose(x, 1 / v, rel_tol=1e-9)
               for v in (*range(2, 65), max(n, 2)))  # (a batch without tokens: no N to add)


def _one_factor(view: _Dense | _Sketched, *, simple: Collection[str] = (),
                n: int = 0) -> tuple[float, float] | None:
    """The stray factor of ``path_scaled``: one positive number that puts every row within its
    bound of ``a dE_in + dE_out`` (the input path scaled), ``dE_in + c dE_out`` (the output
    path) or ``k (dE_in + dE_out)`` (both alike, e.g. averaged).  Two free factors fit far too
    much (on a small batch any wrong row is some mix of the two paths), and a negative or zero
    one is not a scale but another bug; so a fit of that kind is no explanation, and None.
    ``simple`` names the fits (``in``, ``out``, ``both``) whose factor counts only when it is a
    simple number (see :func:`_simple`; ``n`` the batch's N): where the example holds one
    datum for that fit any factor fits, and only a simple one is more than a coincidence."""
    actual, d_in, d_out = view.columns()

    def along(direction: Array, rest: Array) -> float:
        norm = float(direction @ direction)
        return float(direction @ (actual - rest)) / norm if norm > 0 else math.nan

    both = d_in + d_out
    candidates = (("in", along(d_in, d_out)), ("out", along(d_out, d_in)),
                  ("both", along(both, np.zeros_like(both))))
    for which, k in candidates:
        # Least squares leaves a factor ~1e-15 off, which a float64 row bound can notice:
        # a stray factor is a simple number (x16, x0.5, xN), so try it rounded first.
        for f in (float(f"{k:.6g}"), k) if math.isfinite(k) else ():
            if f <= 0 or abs(f - 1) < 1e-12 or (which in simple and not _simple(f, n)):
                continue
            x, y = {"in": (f, 1.0), "out": (1.0, f), "both": (f, f)}[which]
            if bool(view.lin_ok(x, y).all()):
                return x, y
    return None


def _output_path_data(distinct: int, V: int, d: int) -> int:
    """How many independent numbers a wrong output path can move: a head gradient built from
    the wrong activations (``g.T @ tanh(u)`` for ``g.T @ h``) is ``g.T @ X`` for some X, a
    space of dimension rank(g) d.  Positions of one token share h (a probe model's h is a
    function of its token), so they act as one, and each position's g sums to zero over the
    vocabulary: rank(g) <= min(distinct tokens, V - 1).  (A model whose h depends on context
    has up to N such positions; counting distinct tokens errs toward naming no scale.)  Below
    2, every wrong head gradient is the right one times a factor (V = 3, d = 1, N = 1: three
    wrong rows, one datum), and a factor fitted there says nothing about a scale."""
    return min(distinct, V - 1) * d


#: Occurrences of one token beyond which the subsets of them are not enumerated (2^12 sums).
_SUBSET_LIMIT = 12


def _holds_some_occurrences(paths: Paths, row: int, actual: Array, out: Array,
                            tol: Tolerance) -> int | None:
    """How many of ``row``'s occurrences its dE holds (with its output path), when one of them
    (at any count) or some proper, non-empty subset of them (up to ``_SUBSET_LIMIT``) explains
    it within the bound; else None.  A racy or partial scatter loses some occurrences; only such
    a row is a duplicates bug (one that lost all of them is a masked row)."""
    where = np.flatnonzero(paths.tokens == row)
    c = where.shape[0]
    if c < 2:
        return None
    # one occurrence, at any count: index_copy_ / index_put_(accumulate=False) keep one of them
    one = paths.per_position[where].astype(np.float64) + out
    if tol.close(np.broadcast_to(actual, one.shape), one).all(axis=1).any():
        return 1
    if c > _SUBSET_LIMIT:
        return None
    pick = _subsets(c, proper=True)
    sums = pick.astype(np.float64) @ paths.per_position[where].astype(np.float64) + out
    fit = tol.close(np.broadcast_to(actual, sums.shape), sums).all(axis=1)
    return int(pick[np.flatnonzero(fit)[0]].sum()) if fit.any() else None


def _subsets(n: int, *, proper: bool) -> np.ndarray:
    """Every non-empty subset of ``n`` items as a 0/1 row (the whole set too unless ``proper``)."""
    return (np.arange(1, 2 ** n - (1 if proper else 0))[:, None] >> np.arange(n)[None, :]) & 1


def _wrong_entries(view: _Dense | _Sketched, wrong_rows: list[int], tol: Tolerance) -> int:
    """How many entries of the wrong rows are outside their bound (three at least when a row
    is not compared entry by entry: a projected row is only ever wrong at large d)."""
    rows = np.asarray(wrong_rows, dtype=np.int64)
    if isinstance(view, _Sketched) and not np.isin(rows, view.exact).all():
        return max(3, len(wrong_rows))
    expected = view.rows("in", rows) + view.rows("out", rows)
    return int((~tol.rows(rows).close(view.rows("actual", rows), expected)).sum())


def _overwritten_rows(view: _Dense | _Sketched, paths: Paths, present: np.ndarray,
                      tol: Tolerance) -> list[int] | None:
    """When every present row holds its input path alone, or (a repeated token) exactly one
    of its occurrences alone: the repeated rows that hold one occurrence.  Else None."""
    actual = view.rows("actual", present)
    whole = tol.rows(present).close(actual, view.rows("in", present)).all(axis=1)
    single: list[int] = []
    for i in np.flatnonzero(~whole):
        r = int(present[i])
        occ = paths.per_position[paths.tokens == r].astype(np.float64)
        if occ.shape[0] < 2 or not tol.rows(np.array([r])).close(
                np.broadcast_to(actual[i], occ.shape), occ).all(axis=1).any():
            return None
        single.append(r)
    return single


def misrouted_input_fits(paths: Paths, rows: np.ndarray, residuals: Array,
                         tol: Tolerance) -> bool:
    """Whether each of the absent ``rows``' ``residuals`` (dE minus the reference) could be dx
    of some positions scattered into that row instead of into its token's: a subset sum of the
    positions' input-path contributions, within the row's bound.  Beyond ``_SUBSET_LIMIT``
    positions the subsets are not enumerated: any residual is taken to fit."""
    n = paths.tokens.shape[0]
    if n > _SUBSET_LIMIT:
        return True
    pick = _subsets(n, proper=False)
    sums = pick.astype(np.float64) @ paths.per_position.astype(np.float64)
    return all(bool(tol.rows(rows[i:i + 1]).close(np.broadcast_to(r, sums.shape), sums)
                    .all(axis=1).any())
               for i, r in enumerate(np.asarray(residuals, np.float64)))


def _occurrence_variants(paths: Paths, rows: np.ndarray) -> dict[str, Array]:
    """On ``rows`` (repeated tokens): the input path built from one occurrence per token, the
    shapes duplicate bugs take (buffered ``a[idx] += v`` keeps the last, others the first)."""
    t = paths.tokens
    uniq, first = np.unique(t, return_index=True)
    last = t.shape[0] - 1 - np.unique(t[::-1], return_index=True)[1]
    where = np.searchsorted(uniq, rows)
    return {
        "first occurrence only": paths.per_position[first[where]].astype(np.float64),
        "last occurrence only": paths.per_position[last[where]].astype(np.float64),
    }


def _describe_scales(a: float, c: float) -> str:
    def name(x: float) -> str:
        for v, word in ((2.0, "doubled"), (0.5, "halved")):
            if abs(x - v) < 1e-6:
                return word
        return f"x{x:.6g}"

    if abs(a - 0.5) < 1e-6 and abs(c - 0.5) < 1e-6:
        return "both paths x0.5: averaged instead of summed"
    parts = []
    if abs(a - 1) > 1e-9:
        parts.append(f"input path {name(a)}")
    if abs(c - 1) > 1e-9:
        parts.append(f"output path {name(c)}")
    return ", ".join(parts)


@dataclass(frozen=True, eq=False)
class _Evidence:
    """What one example shows, gathered once before any label is chosen: the rows against
    the reference (``view``, ``row_ok``), the batch (present and repeated rows, the
    occurrence variants), the example's power and each wrong row's cause.  The rules
    (:data:`_RULES`) read it; the costlier explanations (a fitted scale, occurrences kept, an
    overwritten output path) are worked out once, when a rule first asks."""

    paths: Paths
    tol: Tolerance
    view: _Dense | _Sketched
    row_ok: np.ndarray
    wrong_rows: list[int]
    uniq: np.ndarray  # the present rows, sorted
    rep: np.ndarray  # the repeated rows, sorted
    repeated: dict[int, int]  # row -> multiplicity, for tokens seen more than once
    variants: dict[str, Array]  # on ``rep``: the input path from one occurrence per token
    power: Power
    only_out: np.ndarray  # rows holding the output path alone (only asked when wrong)
    only_in: np.ndarray  # rows holding the input path alone (only asked when wrong)
    V: int
    d: int

    @cached_property
    def causes(self) -> dict[str, list[int]]:
        """Which explanation fits each wrong row (see :func:`_row_causes`)."""
        return _row_causes(self)

    @cached_property
    def present(self) -> np.ndarray:
        present = np.zeros(self.V, dtype=bool)
        present[self.uniq] = True
        return present

    def on_rows(self, rows: np.ndarray, cand_rows: Array) -> np.ndarray:
        return _rows_close(self.tol.rows(rows), self.view.rows("actual", rows), cand_rows)

    def outside_ok(self, rows: np.ndarray) -> bool:
        """Whether every row but ``rows`` is right.  Candidate explanations differ from the
        reference only on some rows (absent rows get no input path, so dropping it cannot show
        there): they are compared on those rows, ``row_ok`` reused elsewhere.  At V = 50257
        this keeps the diagnosis a few passes over dE, not dozens."""
        outside = self.row_ok.copy()
        outside[rows] = True
        return bool(outside.all())

    def whole_on(self, rows: np.ndarray, cand_rows: Array) -> bool:
        return self.outside_ok(rows) and bool(self.on_rows(rows, cand_rows).all())

    @cached_property
    def only_repeated(self) -> bool:
        return bool(self.repeated) and set(self.wrong_rows) <= set(self.repeated)

    @cached_property
    def kept(self) -> list[str]:
        """The occurrence variants that explain every wrong row (one occurrence kept)."""
        out_rep = self.view.rows("out", self.rep)
        return [k for k, v in self.variants.items() if self.whole_on(self.rep, v + out_rep)]

    @cached_property
    def scaled(self) -> tuple[float, float] | None:
        """The stray factor that explains every wrong row, if one does (see _one_factor).
        One wrong entry fits any factor, and two can be one datum: each position's logit
        gradient sums to zero over the vocabulary, so dx moved from one row to another (V = 2,
        d = 1) is exactly the output path scaled.  Below three wrong entries only a simple
        factor (x2, x1/16, xN) is evidence of a scale; and a wrong head gradient is one datum
        however many entries it moves when the output path has one degree of freedom (see
        _output_path_data: d = 1 and one distinct token)."""
        simple: tuple[str, ...] = ()
        if _wrong_entries(self.view, self.wrong_rows, self.tol) < 3:
            simple = ("in", "out", "both")
        elif _output_path_data(len(self.uniq), self.V, self.d) < 2:
            simple = ("out",)
        return _one_factor(self.view, simple=simple, n=int(self.paths.tokens.shape[0]))

    @cached_property
    def pad_unexplained(self) -> bool:
        """Whether the declared padding row, repeated, is a wrong row nothing explains: the
        reference leaves its occurrences out by declaration (a scatter that keeps one
        occurrence, index_copy_, skips the padding mask too): named in the detail."""
        pad = self.paths.padding_idx
        return pad is not None and pad in self.causes.get("unexplained", []) and \
            pad in self.repeated

    @cached_property
    def partial(self) -> bool:
        """Whether each wrong row holds some of its occurrences (see the per-row causes), the
        padding row aside (see :attr:`pad_unexplained`).  A repeated row that lost every
        occurrence, beside rows that lost some, lost them to the same scatter."""
        causes, pad = self.causes, self.paths.padding_idx
        return self.only_repeated and any(c.startswith("duplicates:") for c in causes) and all(
            c.startswith("duplicates:") or c == "input path missing" or (
                c == "unexplained" and self.pad_unexplained and causes[c] == [pad])
            for c in causes)

    @cached_property
    def overwritten(self) -> list[int] | None:
        """See :func:`_overwritten_rows`; None unless every absent row is right."""
        if not self.outside_ok(self.uniq):
            return None
        return _overwritten_rows(self.view, self.paths, self.uniq, self.tol)


@dataclass(frozen=True)
class _Verdict:
    """A rule's verdict: the label, its detail, the fitted scales and, when the rule explains
    the wrong rows its own way, the per-row causes in place of the gathered ones."""

    label: Label
    detail: str
    scales: tuple[float, float] | None = None
    causes: dict[str, list[int]] | None = None


def _evidence(raw: np.ndarray, paths: Paths, tol: Tolerance) -> _Evidence:
    """Everything the rules read, gathered once from ``raw`` (the dE) and the reference."""
    uniq, counts = np.unique(paths.tokens, return_counts=True)
    repeated = {int(u): int(c) for u, c in zip(uniq, counts) if c > 1}
    view: _Dense | _Sketched = _Dense(raw, paths, tol) if paths.sketch is None else \
        _Sketched(raw, paths, paths.sketch, tol)
    row_ok = view.scan.row_ratio <= 1.0
    wrong_rows = [int(r) for r in np.flatnonzero(~row_ok)]
    rep = np.array(sorted(repeated), dtype=np.int64)
    variants = _occurrence_variants(paths, rep) if repeated else {}
    nothing = np.zeros(raw.shape[0], dtype=bool)
    only_out = view.lin_ok(0.0, 1.0) if wrong_rows else nothing
    only_in = view.lin_ok(1.0, 0.0) if wrong_rows else nothing
    return _Evidence(paths=paths, tol=tol, view=view, row_ok=row_ok, wrong_rows=wrong_rows,
                     uniq=uniq, rep=rep, repeated=repeated, variants=variants,
                     power=_power(view, tol, uniq, rep, variants), only_out=only_out,
                     only_in=only_in, V=int(raw.shape[0]), d=int(raw.shape[1]))


def _power(view: _Dense | _Sketched, tol: Tolerance, pres: np.ndarray, rep: np.ndarray,
           variants: dict[str, Array]) -> Power:
    """Whether dropping a path (or an occurrence of a repeated token) would show here."""
    dup_power = None
    if rep.size:
        out_rep = view.rows("out", rep)
        ref_rep = view.rows("in", rep) + out_rep
        dup_power = any(not _rows_close(tol.rows(rep), v + out_rep, ref_rep).all()
                        for v in variants.values())
    out_pres = view.rows("out", pres)
    return Power(
        input_path=not _rows_close(tol.rows(pres), out_pres,
                                   view.rows("in", pres) + out_pres).all(),
        output_path=view.scan.output_power,
        duplicates=dup_power,
    )


def _row_causes(ev: _Evidence) -> dict[str, list[int]]:
    """Per-row causes: which explanation fits each wrong row."""
    causes: dict[str, list[int]] = {}
    rep_pos = {int(r): i for i, r in enumerate(ev.rep)}
    for r in ev.wrong_rows:
        cause = "unexplained"
        if ev.only_out[r]:
            cause = "input path missing"
        elif ev.only_in[r]:
            cause = "output path missing"
        elif r in rep_pos:
            row = np.array([r])
            out_r = ev.view.rows("out", row)
            cause = next((f"duplicates: {k}" for k, v in ev.variants.items()
                          if ev.on_rows(row, v[rep_pos[r]][None, :] + out_r).all()), cause)
            if cause == "unexplained":  # e.g. a racy scatter: some, not all, occurrences
                k = _holds_some_occurrences(ev.paths, r, ev.view.rows("actual", row)[0],
                                            out_r[0], ev.tol.rows(row))
                cause = cause if k is None else \
                    f"duplicates: {k} of {ev.repeated[r]} occurrences"
        causes.setdefault(cause, []).append(r)
    return causes


# ---- the rules, in order of precedence: the first whose verdict is not None names the rows --

def _unattributable(ev: _Evidence) -> _Verdict | None:
    # Neither path is visible on this example, so no pattern of rows can say which one is
    # wrong: never give a path label here (the rows are still wrong).
    if ev.wrong_rows and not ev.power.input_path and not ev.power.output_path:
        return _Verdict("unknown", "this example cannot attribute wrong rows to a path "
                        "(neither path exceeds the rounding bound); see the wrong rows")
    return None


def _no_wrong_row(ev: _Evidence) -> _Verdict | None:
    if ev.wrong_rows:
        return None
    if ev.power.input_path and ev.power.output_path:
        return _Verdict("correct", "")
    missing = [p for p, ok in (("input", ev.power.input_path),
                               ("output", ev.power.output_path)) if not ok]
    return _Verdict("no_power", f"dropping the {' or the '.join(missing)} path would pass here "
                    "too; not counted as evidence")


def _input_path_missing(ev: _Evidence) -> _Verdict | None:
    if ev.outside_ok(ev.uniq) and bool(ev.only_out[ev.uniq].all()):
        return _Verdict("input_path_missing",
                        f"wrong on exactly the {_n(len(ev.uniq), 'present row')}")
    return None


def _output_path_missing(ev: _Evidence) -> _Verdict | None:
    if bool(ev.only_in.all()):
        return _Verdict("output_path_missing", f"all {ev.V} rows wrong")
    return None


def _present_rows_input_only(ev: _Evidence) -> _Verdict | None:
    if ev.outside_ok(ev.uniq) and bool(ev.only_in[ev.uniq].all()):
        return _Verdict("output_path_overwritten",
                        f"{_n(len(ev.uniq), 'present row')} hold dE_in only")
    return None


def _duplicates_detail(ev: _Evidence) -> str:
    # Identical occurrences (same token, same target) fit both: say only what is known.
    kept = ev.kept
    which = "one occurrence only" if len(kept) > 1 else (kept[0] if kept else "")
    detail = (f"{which}; " if which else "") + "wrong rows are repeated tokens " + \
        ", ".join(f"{r} (x{ev.repeated[r]})" for r in ev.wrong_rows)
    if ev.pad_unexplained:
        detail += f"; the padding row {ev.paths.padding_idx} got input path too (its mask " \
            "skipped)"
    return detail


def _one_occurrence_kept(ev: _Evidence) -> _Verdict | None:
    if ev.only_repeated and ev.kept:
        return _Verdict("duplicates_not_accumulated", _duplicates_detail(ev))
    return None


def _path_scaled(ev: _Evidence) -> _Verdict | None:
    if ev.scaled is None:
        return None
    a, c = ev.scaled
    detail = _describe_scales(a, c)
    # Every wrong row is explained by the fitted factor: attribute them to it.
    return _Verdict("path_scaled", detail, (a, c),
                    {detail: [r for rows in ev.causes.values() for r in rows]})


def _some_occurrences_kept(ev: _Evidence) -> _Verdict | None:
    # e.g. a racy scatter: each wrong row holds some, not all, of its occurrences
    if ev.partial:
        return _Verdict("duplicates_not_accumulated", _duplicates_detail(ev))
    return None


def _overwritten_by_input(ev: _Evidence) -> _Verdict | None:
    # llm.c's `dwte[ix] = d`, written position by position after the head's matmul: the
    # output path and all but one occurrence of a repeated token are overwritten
    single = ev.overwritten
    if single is None:
        return None
    causes = {"input path only (output path overwritten)":
              [r for r in ev.wrong_rows if r not in single],
              "a single occurrence only (output path overwritten)": list(single)}
    return _Verdict("output_path_overwritten",
                    f"{_n(len(ev.uniq), 'present row')} hold the input path only; repeated "
                    f"tokens {single} hold a single occurrence (each write replaced the row)",
                    causes={k: v for k, v in causes.items() if v})


def _row_pattern(ev: _Evidence) -> _Verdict | None:
    """Absent rows carry the output path alone, so the row pattern says which path is wrong;
    present rows holding exactly the output path lost their input path (a masked row)."""
    masked = set(ev.causes) == {"input path missing"}
    if not (ev.power.input_path or ev.power.output_path) or \
            not (masked or not ev.present.all()):
        return None
    present = ev.present
    absent_wrong = [r for r in ev.wrong_rows if not present[r]]
    present_wrong = [r for r in ev.wrong_rows if present[r]]
    n_absent, n_present = int((~present).sum()), _n(len(ev.uniq), "present row")
    if _misrouted_or_output(ev, absent_wrong, present_wrong):
        # The output path may be wrong, or the input path went into the wrong rows (e.g. the
        # targets'), taking from the present rows what the absent ones gained.  The rows
        # cannot tell which, so the label stays unknown.
        return _Verdict("unknown", f"{len(absent_wrong)} of {_n(n_absent, 'absent row')} wrong "
                        f"(they carry the output path alone) and {len(present_wrong)} of "
                        f"{n_present}: a wrong output path, or dx scattered into the wrong "
                        "rows?")
    if absent_wrong:
        return _Verdict("output_path_wrong",
                        f"{len(absent_wrong)} of {_n(n_absent, 'absent row')} wrong")
    detail = (f"all {_n(n_absent, 'absent row')} exact; " if n_absent else "") + \
        f"{len(ev.wrong_rows)} of {n_present} wrong"
    if masked:
        detail += f"; rows {ev.wrong_rows} hold the output path only (input path masked)"
    return _Verdict("input_path_wrong", detail)


def _misrouted_or_output(ev: _Evidence, absent_wrong: list[int],
                         present_wrong: list[int]) -> bool:
    """Absent rows wrong and present rows wrong, no more absent ones than the batch has
    positions, and each holds what some positions' dx would add (see
    :func:`misrouted_input_fits`)."""
    if not (absent_wrong and present_wrong and
            len(absent_wrong) <= ev.paths.tokens.shape[0]):
        return False
    rows = np.asarray(absent_wrong, dtype=np.int64)
    return isinstance(ev.view, _Sketched) or misrouted_input_fits(
        ev.paths, rows, ev.view.rows("actual", rows) - ev.view.rows("out", rows), ev.tol)


def _unexplained(ev: _Evidence) -> _Verdict:
    """The last rule: wrong rows that no rule explains."""
    n_present = len([r for r in ev.wrong_rows if ev.present[r]])
    return _Verdict("unknown", f"{len(ev.wrong_rows)} wrong rows, {n_present} of them present "
                    "in the batch" + ("; every row is present, so the rows cannot say which "
                                      "path is wrong" if ev.present.all() else ""))


#: The rules that name the rows, in order of precedence: the first verdict wins, so the order
#: decides between explanations that both fit.  No power to attribute a wrong row, then no
#: wrong row; the whole-matrix patterns (a path missing, present rows holding the input path
#: alone); the explanations of every wrong row (one occurrence kept, a stray factor, some
#: occurrences kept, the output path overwritten position by position); the pattern of
#: absent and present rows; and last, wrong rows no rule explains.
_RULES: tuple[Callable[[_Evidence], _Verdict | None], ...] = (
    _unattributable, _no_wrong_row, _input_path_missing, _output_path_missing,
    _present_rows_input_only, _one_occurrence_kept, _path_scaled, _some_occurrences_kept,
    _overwritten_by_input, _row_pattern, _unexplained,
)


def _beyond_rows(verdict: _Verdict, others: list[ArrayCheck],
                 mutated: tuple[str, ...]) -> _Verdict:
    """Right rows (correct, or no power) still make a wrong verdict when another output is
    wrong, or, after that, when the implementation wrote into its inputs."""
    if verdict.label not in ("correct", "no_power"):
        return verdict
    if any(not o.ok for o in others):
        return _Verdict("other_gradient_wrong",
                        "; ".join(o.describe() for o in others if not o.ok))
    if mutated:
        return _Verdict("inputs_mutated", "wrote into " + ", ".join(mutated))
    return verdict


def diagnose(
    dE: Any,
    paths: Paths,
    *,
    dtype: object = None,
    others: list[ArrayCheck] | None = None,
    mutated: tuple[str, ...] = (),
) -> Diagnosis:
    """Compare ``dE`` with the reference ``paths`` row by row and name what is wrong: the
    evidence is gathered once (:func:`_evidence`), then the first of :data:`_RULES` that
    gives a verdict names the rows.

    ``dtype`` is the precision the implementation is judged at (it sets each row's rounding
    bound, see :mod:`core.tolerance`); it defaults to the dtype of ``dE``.  ``others``
    are checks of the other outputs and ``mutated`` the names of inputs the implementation
    wrote into; either turns a right dE into a wrong verdict.
    """
    raw = np.asarray(dE)
    precision: Precision = precision_of(dtype if dtype is not None else raw.dtype)
    tol = row_tolerance(paths.bound_terms, precision)
    ev = _evidence(raw, paths, tol)
    verdict = next(v for v in (rule(ev) for rule in _RULES) if v is not None)
    others = list(others or [])
    verdict = _beyond_rows(verdict, others, mutated)
    scan = ev.view.scan
    return Diagnosis(
        label=verdict.label, detail=verdict.detail, rows_total=ev.V,
        rows_wrong=len(ev.wrong_rows), wrong_rows=ev.wrong_rows,
        present_rows=[int(u) for u in ev.uniq], repeated_rows=ev.repeated,
        row_causes=ev.causes if verdict.causes is None else verdict.causes,
        max_abs_error=scan.max_abs, max_rel_error=scan.max_rel, tolerance=tol,
        power=ev.power, scales=verdict.scales, others=others, margin=scan.margin,
        rows_projected=ev.view.projected,
    )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def forward_pattern(wrong: Sequence[int], tokens: np.ndarray, V: int, *,
                    padding_idx: int | None = None, input_reached: bool = True,
                    partial: bool = False, output_reached: bool = True) -> tuple[Label, str]:
    """Name rows found wrong by the forward alone (``core.localize``: no reference, the
    torch and jax kinds' gradient against the forward) from where they sit in the batch: the
    catalogue's patterns (the rows of repeated tokens, every present row, the padding row),
    and the detail that says why.  ``input_reached``: whether autograd shows the lookup
    reaching E at all, ``output_reached`` the same of the head.  ``partial``: the search
    stopped at its budget, so ``wrong`` is what
    it confirmed first and other rows are undecided; a pattern that needs every wrong row
    ("exactly ...") is then not named."""
    counts = np.bincount(tokens, minlength=V)
    present = {int(v) for v in np.flatnonzero(counts)}
    repeated = {int(v) for v in np.flatnonzero(counts > 1)}
    rows = set(wrong)
    if not rows:
        # no row confirmed: no pattern of rows to name (the empty set is a subset of every
        # catalogue pattern, and matches none)
        return "gradient_disagrees_with_forward", ""
    if padding_idx is not None and rows == {padding_idx} and not partial:
        return "padding_row_masked", (f": row {padding_idx} is padding_idx, whose output "
                                      "path is masked too")
    if not output_reached and input_reached:
        # autograd shows no output path (a head over a detached weight): every row lacks it
        return "output_path_missing", (": and the head never reaches E through autograd")
    if rows <= present and not input_reached:
        # autograd itself shows no input path (the rows found are those a dropped input path
        # makes wrong; at low precision the smallest may stay within the forward's tolerance)
        return "input_path_missing", (": present rows only, and the lookup never reaches E "
                                      "through autograd")
    if partial:
        # the rows the search confirmed before its budget ran out are only the order it went
        # in (depth first, the lower rows first): no pattern of "exactly" these rows (a
        # missing input path is named above from autograd's evidence, not from the rows)
        return "gradient_disagrees_with_forward", ""
    if repeated and rows <= repeated:
        return "duplicates_not_accumulated", ": exactly rows of tokens seen more than once"
    if rows == present:
        return "input_path_wrong", ": exactly the rows of tokens in the batch"
    if rows < present:
        # rows of tokens read once among them (so not a repeat's), every absent row right: the
        # input path is wrong where it was confirmed; the other present rows may be within the
        # forward's tolerance (a small error on a row read few times)
        return "input_path_wrong", (f": rows of tokens in the batch only ({len(rows)} of "
                                    f"{len(present)} present rows confirmed, a token read "
                                    "once among them), every absent row right")
    return "gradient_disagrees_with_forward", ""
