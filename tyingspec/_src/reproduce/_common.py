"""Shared pieces of ``tyingspec reproduce``: results, verdicts, tables, JSON, progress, figures."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

Floats = Sequence[float] | np.ndarray

HOLDS = "holds"
FAILS = "does not hold"
NOT_JUDGED = "-"


@dataclass
class Row:
    """One line of an experiment's table: a claimed figure beside the measured one."""

    quantity: str
    claim: str
    measured: str
    verdict: str
    reason: str = ""
    claim_value: Any = None
    measured_value: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "quantity": self.quantity,
            "claim": self.claim,
            "measured": self.measured,
            "verdict": self.verdict,
            "reason": self.reason,
            "claim_value": jsonable(self.claim_value),
            "measured_value": jsonable(self.measured_value),
        }


@dataclass
class Result:
    """Everything one experiment reports; the JSON file is ``as_dict()`` of this."""

    name: str
    title: str
    claim_source: str
    setup: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0

    def row(self, quantity: str) -> Row:
        for r in self.rows:
            if r.quantity == quantity:
                return r
        raise KeyError(f"{self.name}: no row {quantity!r}; rows: {[r.quantity for r in self.rows]}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "experiment": self.name,
            "title": self.title,
            "claim_source": self.claim_source,
            "setup": jsonable(self.setup),
            "seeds": [int(s) for s in self.seeds],
            "rows": [r.as_dict() for r in self.rows],
            "verdicts": {
                HOLDS: sum(r.verdict == HOLDS for r in self.rows),
                FAILS: sum(r.verdict == FAILS for r in self.rows),
            },
            "notes": list(self.notes),
            "series": jsonable(self.series),
            "elapsed_s": round(float(self.elapsed_s), 3),
        }


def jsonable(obj: Any) -> Any:
    """Builtin types only (numpy scalars and arrays converted); NaN/inf become None."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    return obj


# --- verdicts ------------------------------------------------------------------------------

def judge(ok: bool, why_ok: str, why_not: str) -> tuple[str, str]:
    return (HOLDS, why_ok) if ok else (FAILS, why_not)


def figure_row(
    quantity: str,
    claim: float,
    measured: float,
    *,
    decimals: int,
    unit: str = "",
    why_not: str = "",
    why_ok: str = "",
    spread: str = "",
) -> Row:
    """A claimed number judged at the precision it was stated with (``decimals`` places).

    The claim holds when the measured figure rounds to the claimed one; anything else is
    reported as not holding, with ``why_not`` saying what differs.
    """
    fmt = f"{{:.{decimals}f}}{unit}"
    ok = round(measured, decimals) == round(claim, decimals)
    verdict, reason = judge(ok, why_ok or f"equal at the claim's {decimals}-decimal precision",
                            why_not)
    shown = fmt.format(measured) + (f" ({spread})" if spread else "")
    return Row(quantity, fmt.format(claim), shown, verdict, reason, claim, measured)


def seeded_row(quantity: str, claim: float, values: Floats, *, decimals: int,
               why_not: str = "") -> Row:
    """A claimed figure against a mean over seeds.

    Holds when the claim rounds to the measured mean at the claim's precision, or lies within
    two standard errors of it (the claim is then indistinguishable from this measurement).
    """
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else 0.0
    f = f"{{:.{decimals}f}}"
    rounds = round(mean, decimals) == round(claim, decimals)
    inside = abs(mean - claim) <= 2 * se
    if rounds:
        verdict, reason = HOLDS, f"equal at the claim's {decimals}-decimal precision"
    elif inside:
        verdict, reason = HOLDS, (f"within 2 s.e. of the mean over {v.size} seeds "
                                  f"({f.format(mean - 2 * se)}-{f.format(mean + 2 * se)})")
    else:
        interval = (f"mean +- 2 s.e. = {f.format(mean - 2 * se)}-{f.format(mean + 2 * se)}"
                    if v.size > 1 else "one seed")
        verdict, reason = FAILS, f"{interval}; {why_not}" if why_not else interval
    return Row(quantity, f.format(claim), f.format(mean) + (f" ({spread_text(v, decimals)})"
                                                            if v.size > 1 else ""),
               verdict, reason, claim, [float(x) for x in v])


def direction_row(quantity: str, claim: str, measured: str, ok: bool, why_ok: str,
                  why_not: str, *, claim_value: Any = None, measured_value: Any = None) -> Row:
    verdict, reason = judge(ok, why_ok, why_not)
    return Row(quantity, claim, measured, verdict, reason, claim_value, measured_value)


def spread_text(values: Floats, decimals: int) -> str:
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return ""
    f = f"{{:.{decimals}f}}"
    return f"seeds {f.format(v.min())}-{f.format(v.max())}, sd {f.format(v.std(ddof=1))}"


# --- rendering -----------------------------------------------------------------------------

def _wrap_cell(text: str, width: int) -> list[str]:
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    lines.append(cur)
    return lines


def render(result: Result, *, width: int | None = None) -> str:
    """Setup lines first, then the quantity | claim | measured | verdict table, then notes."""
    if width is None:
        width = min(max(shutil.get_terminal_size((120, 24)).columns, 100), 160)
    out = [f"== {result.name}: {result.title}", f"   claim source: {result.claim_source}"]
    for key, value in result.setup.items():
        out.append(f"   {key}: {value}")
    if result.seeds:
        out.append(f"   seeds: {', '.join(str(s) for s in result.seeds)}")
    headers = ("quantity", "claim", "measured", "verdict")
    cells = [(r.quantity, r.claim, r.measured,
              r.verdict + (f": {r.reason}" if r.reason and r.verdict != NOT_JUDGED else "")
              if r.verdict != NOT_JUDGED else (r.reason or NOT_JUDGED))
             for r in result.rows]
    caps = (34, 16, 26)
    widths = [min(max([len(headers[i])] + [len(c[i]) for c in cells]), caps[i]) for i in range(3)]
    last = max(width - sum(widths) - 9, 30)
    sep = "-+-".join("-" * w for w in widths + [last])
    out.append("")
    out.append(" | ".join(h.ljust(w) for h, w in zip(headers, widths + [last], strict=True)))
    out.append(sep)
    for c in cells:
        wrapped = [_wrap_cell(c[i], w) for i, w in enumerate(widths)] + [_wrap_cell(c[3], last)]
        for k in range(max(len(w) for w in wrapped)):
            line = " | ".join((col[k] if k < len(col) else "").ljust(w)
                              for col, w in zip(wrapped, widths + [last], strict=True))
            out.append(line.rstrip())
    if result.notes:
        out.append("")
        for n in result.notes:
            lines = _wrap_cell(n, width - 5)
            out.append("   * " + lines[0])
            out.extend("     " + line for line in lines[1:])
    out.append(f"   ({result.elapsed_s:.1f} s)")
    return "\n".join(out)


def write_json(result: Result, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.name}.json"
    path.write_text(json.dumps(result.as_dict(), indent=2, allow_nan=False) + "\n")
    return path


# --- progress ------------------------------------------------------------------------------

class Progress:
    """A dependency-free stderr progress bar that appears only once work has run ``delay`` s.

    On a terminal it redraws one line; elsewhere (logs, CI) it prints a line per quarter so the
    log still shows the run advancing without flooding it.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 enabled: bool = True, delay: float = 1.0) -> None:
        self.label = label
        self.total = max(int(total), 1)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.delay = delay
        self.done = 0
        self.start = time.perf_counter()
        self._shown = False
        self._last_draw = 0.0
        self._last_quarter = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if elapsed < self.delay and self.done < self.total:
            return
        if self._tty:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._draw(elapsed)
                self._last_draw = now
        else:
            quarter = 4 * self.done // self.total
            if quarter > self._last_quarter and elapsed >= self.delay:
                self._last_quarter = quarter
                self.stream.write(f"  {self.label}: {self.done}/{self.total} "
                                  f"({elapsed:.1f} s)\n")
                self.stream.flush()
                self._shown = True

    def _draw(self, elapsed: float) -> None:
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self.stream.write(f"\r  {self.label} [{bar:<30}] {self.done}/{self.total} "
                          f"{elapsed:5.1f} s, eta {eta:5.1f} s ")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown and self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ProgressFactory = Callable[[str, int], Progress]


def silent_progress(label: str, total: int) -> Progress:
    return Progress(label, total, enabled=False)


def stderr_progress(label: str, total: int) -> Progress:
    return Progress(label, total)


# --- BLAS threads --------------------------------------------------------------------------

_BLAS_PREFIXES = ("scipy_openblas_", "openblas_")
_BLAS_SUFFIXES = ("64_", "")


def _openblas_handles() -> list[tuple[Any, Any]]:
    """(set, get) thread-count functions of every OpenBLAS loaded into this process."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower()
                     and line.split()[-1].startswith("/")}
    except OSError:  # not Linux: leave BLAS threading alone
        return []
    handles = []
    for p in sorted(paths):
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        for pre in _BLAS_PREFIXES:
            for suf in _BLAS_SUFFIXES:
                setter = getattr(lib, f"{pre}set_num_threads{suf}", None)
                getter = getattr(lib, f"{pre}get_num_threads{suf}", None)
                if setter is not None and getter is not None:
                    handles.append((setter, getter))
                    break
            else:
                continue
            break
    return handles


class single_threaded_blas:
    """Run OpenBLAS on one thread inside the block, restoring the old count afterwards.

    The experiments multiply matrices of a few thousand entries; a threaded BLAS on a small,
    busy machine spends far more time handing such products between threads than computing
    them (measured here: 200 training steps at d = 64 took 12.8 s threaded, 0.22 s not).
    """

    def __enter__(self) -> single_threaded_blas:
        self._saved: list[tuple[Any, int]] = []
        for setter, getter in _openblas_handles():
            self._saved.append((setter, int(getter())))
            setter(1)
        return self

    def __exit__(self, *exc: object) -> None:
        for setter, n in self._saved:
            setter(n)


# --- figures -------------------------------------------------------------------------------

_MPL_WARNED = False


def pyplot() -> Any | None:
    """matplotlib.pyplot with a file-only backend, or None (with one message) if not installed."""
    global _MPL_WARNED
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _MPL_WARNED:
            sys.stderr.write("tyingspec reproduce: matplotlib is not installed, so no figures are "
                             "drawn (JSON is still written); install it with "
                             "`pip install 'tyingspec[plot]'`\n")
            _MPL_WARNED = True
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def fmt_int(n: int) -> str:
    return f"{int(n):,}"
