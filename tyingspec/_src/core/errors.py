"""The root of tyingspec's exceptions: ``except tyingspec.TyingspecError`` catches whatever
tyingspec itself raises, as ``hypothesis.errors.HypothesisException`` does for Hypothesis.

Each exception stays where it is raised (``AdapterError`` in ``core/adapters.py``, ``CkptError``
in ``ckpt/read.py``, ...) and names this class first among its bases, then the builtin it always
had (``class UsageError(TyingspecError, ValueError)``): every ``except ValueError`` or ``except
AssertionError`` catches what it caught before.  It lives in ``core`` (the lowest floor) because
every floor raises one of them.  ``ckpt.convert.Terminated`` is left out on purpose: it is a
``BaseException`` (SIGTERM turned into an exception so that every ``finally`` runs), which no
``except Exception`` (and no ``except TyingspecError``) may swallow.
``tests/core/test_errors.py`` walks the package and fails on an exception class that does not
derive from this one.
"""

from __future__ import annotations

__all__ = ["TyingspecError"]


class TyingspecError(Exception):
    """The base of every exception tyingspec raises (``Terminated``, a ``BaseException``,
    aside)."""
