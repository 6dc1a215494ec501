"""Optional dependencies ("extras"): each missing one is a usage error naming what to install.

tyingspec's core needs numpy, sympy and Hypothesis only.  torch (and safetensors), transformers,
ml_dtypes and matplotlib come with extras; a command that needs a missing one must say
``pip install 'tyingspec[torch]'`` and exit 2, not print a traceback and exit 1 (which means a
wrong gradient).  Two ways in: :func:`require` before the work starts, where a command knows
what it needs (``--kind torch``, ``--precision bfloat16``); and :func:`missing_extra` at the CLI
boundary, for an import deeper down (a built-in that imports transformers when it is built).
Standard library only.
"""

from __future__ import annotations

import importlib.util
import re

from tyingspec._src.core.options import UsageError

__all__ = ["EXTRAS", "KIND_MODULES", "PRECISION_MODULES", "MissingExtra", "hint_text",
           "missing_extra", "require", "require_run", "with_hint"]

#: top-level module -> the extra that installs it (see pyproject.toml's optional-dependencies)
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "safetensors": "torch",
    "transformers": "transformers",
    "ml_dtypes": "bfloat16",
    "matplotlib": "plot",
    "jax": "jax",
}

#: the module a kind's own code imports whatever the target: no run of the kind starts without it
KIND_MODULES: dict[str, str] = {"torch": "torch", "distributed": "torch", "jax": "jax"}
#: the module a precision needs beyond numpy
PRECISION_MODULES: dict[str, str] = {"bfloat16": "ml_dtypes"}


class MissingExtra(UsageError):
    """An optional dependency is not installed; the message says which extra brings it."""

    def __init__(self, module: str, needed_for: str = "") -> None:
        self.module = module
        self.extra = EXTRAS.get(module.split(".")[0])
        what = f"{needed_for} needs {module}, which is not installed" if needed_for else \
            f"{module} is not installed"
        super().__init__(f"{what}: {hint_text(module)}")


def hint_text(module: str) -> str:
    """What to run to get ``module``: the extra's ``pip install``, else the module's own."""
    extra = EXTRAS.get(module.split(".")[0])
    return f"pip install 'tyingspec[{extra}]'" if extra else f"pip install {module.split('.')[0]}"


def installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (torch takes a second)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked import, or a parent that is not a package
        return False


def require(module: str, needed_for: str = "") -> None:
    """Raise :class:`MissingExtra` unless ``module`` is installed."""
    if not installed(module):
        raise MissingExtra(module, needed_for)


def require_run(kind: str, precision: str, flag: str = "--") -> None:
    """Raise :class:`MissingExtra` unless what every run of ``kind`` at ``precision`` needs is
    installed.  The message names the option as given to the front end: ``flag`` is ``--`` for
    the command line, ``--tyingspec-`` for the pytest plugin."""
    for option, value, module in (("kind", kind, KIND_MODULES.get(kind)),
                                  ("precision", precision, PRECISION_MODULES.get(precision))):
        if module is not None:
            require(module, f"{flag}{option}={value}")


def missing_extra(exc: BaseException) -> MissingExtra | None:
    """The usage error a ``ModuleNotFoundError`` for an extra's module stands for; None for
    any other module (a real bug, or the user's own dependency)."""
    name = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or not name:
        return None
    top = name.split(".")[0]
    if top not in EXTRAS:
        return None
    return MissingExtra(top)


_NO_MODULE = re.compile(r"No module named '([A-Za-z_][\w.]*)'")


def with_hint(message: str) -> str:
    """``message`` (an adapter error's text) with the install hint added when it reports an
    extra's module as missing: a user's module that imports torch, a built-in that imports
    transformers, failed in the worker that ran them."""
    found = _NO_MODULE.search(message)
    if found is None or found.group(1).split(".")[0] not in EXTRAS:
        return message
    hint = hint_text(found.group(1))
    return message if hint in message else f"{message} ({hint})"
