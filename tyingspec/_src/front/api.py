"""One call in your own test: ``tyingspec.check(...)`` returns the report, ``assert_correct``
raises with the diagnosis.

They run exactly what ``tyingspec check`` runs (the kind's own cases, a ``module:attr`` target
in its worker process, looked up from the current directory first), without the command line.
The worker stays loaded for the next check of the same target in this process (until its
source changes; see :mod:`engine.warm`), so a test file that checks one target several times
pays its import once:

    report = tyingspec.check("mypkg.grads:fn", kind="linear-ce")
    assert report.ok, report.diagnosis
    tyingspec.assert_correct("mypkg.model:make_model", kind="torch")
"""

from __future__ import annotations

from collections.abc import Sequence

from tyingspec._src.core.cases import Case
from tyingspec._src.core.options import DEFAULT_SHRINK_BUDGET, DEFAULT_TIMEOUT, target_paths
from tyingspec._src.engine.observe import PrecisionChoice
from tyingspec._src.engine.warm import WARM
from tyingspec._src.front.check import check_target
from tyingspec._src.front.request import CheckRequest
from tyingspec._src.front.results import CheckReport

__all__ = ["assert_correct", "check"]


def check(target: str, kind: str | None = None, *, seed: int = 0,
          precision: PrecisionChoice = "auto", cases: Sequence[Case] | None = None,
          case: str | None = None, timeout: float = DEFAULT_TIMEOUT,
          shrink_budget: float = DEFAULT_SHRINK_BUDGET,
          paths: Sequence[str] | None = None, shape: tuple[int, int, int] | None = None,
          autocast: str | None = None, compile: str | bool | None = None,
          device: str | None = None) -> CheckReport:
    """Check ``target`` (a built-in name or ``module:attr``) as ``tyingspec check`` does and
    return the :class:`~tyingspec.CheckReport`: ``.ok``, ``.diagnosis``, ``.cases``,
    ``.raise_for_failure()``.

    ``kind`` defaults to a built-in's own kind, else ``"model"``; ``cases`` to the kind's own
    seeded cases (``case`` picks one of them by name); ``paths`` (default: the current
    directory) go first on the worker's ``sys.path``.  ``shape=(V, d, N)``, ``autocast=`` and
    ``compile=`` are ``--shape``, ``--autocast`` and ``--compile`` (``compile=True``: torch's
    default backend); ``device="cuda"`` is ``--device cuda`` (``--kind linear-ce`` and
    ``--kind torch``).  Bad input raises ``ValueError`` (a ``UsageError``, which is also a
    :class:`~tyingspec.TyingspecError`) with the message the command line exits 2 with; an
    adapter that cannot be loaded or called is in the report (``verdict == "adapter_error"``),
    never an exception from here."""
    request = CheckRequest(target, kind, seed, precision,
                           cases=None if cases is None else tuple(cases), case=case,
                           shape=shape, autocast=autocast, device=device,
                           compile="inductor" if compile is True else compile or None)
    # the command line's problems, raised: UsageError is a ValueError (and a TyingspecError)
    chosen, _ = request.chosen()
    return check_target(target, request.kind_name, seed, chosen, precision=precision,
                        shrink_budget=shrink_budget, timeout=timeout,
                        paths=tuple(paths) if paths is not None else target_paths(),
                        warm=WARM)


def assert_correct(target: str, kind: str | None = None, **options: object) -> CheckReport:
    """:func:`check`, then raise :class:`~tyingspec.CheckFailed` (an ``AssertionError``)
    whose message is the rendered diagnosis unless every case was correct; its subclass
    :class:`~tyingspec.NoPower` when no case had the power to decide."""
    report = check(target, kind, **options)  # type: ignore[arg-type]
    report.raise_for_failure()
    return report
