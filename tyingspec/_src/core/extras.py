"""Optional dependencies ("extras"): each missing one is a usage error naming what to install.

tyingspec's core needs numpy, sympy and Hypothesis only.  torch (and safetensors), transformers,
ml_dtypes and matplotlib come with extras; a command that needs a missing one must say
``pip install 'tyingspec[torch]'`` and exit 2, not print a traceback and exit 1 (which means a
wrong gradient).  Two ways in: :func:`require` before the work starts, where a command knows
what it needs (``--kind torch``, ``--precision bfloat16``); and :func:`missing_extra` at the CLI
boundary, for an import deeper down (a built-in that imports transformers when it is built).

A requirement found before the work starts can name the target's own imports as well
(:func:`target_imports`, read from its source with ``ast``, nothing of it run): ``--kind torch``
on a transformers model in an install with neither says ``pip install 'tyingspec[transformers]'``
(which brings torch too) at once, not ``[torch]`` and then, on the next run, ``[transformers]``.
Standard library only.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

from tyingspec._src.core.options import UsageError

__all__ = ["EXTRAS", "INCLUDES", "PRECISION_MODULES", "MissingExtra",
           "hint_text", "imports_reached", "missing_extra", "require", "require_run",
           "target_imports", "with_hint"]

#: top-level module -> the extra that installs it (see pyproject.toml's optional-dependencies)
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "safetensors": "torch",
    "transformers": "transformers",
    "ml_dtypes": "bfloat16",
    "matplotlib": "plot",
    "jax": "jax",
}

#: extra -> the extras whose requirements it holds as well (pyproject.toml: ``[transformers]``
#: installs torch and safetensors), so an install naming both names the larger alone
INCLUDES: dict[str, frozenset[str]] = {"transformers": frozenset({"torch"})}

#: the module a precision needs beyond numpy
PRECISION_MODULES: dict[str, str] = {"bfloat16": "ml_dtypes"}


class MissingExtra(UsageError):
    """An optional dependency is not installed; the message says which extra brings it.
    ``also``: the target's own imports that are missing too (``importer`` names the target),
    brought by the same ``pip install``."""

    def __init__(self, module: str, needed_for: str = "", also: Sequence[str] = (),
                 importer: str = "the target") -> None:
        self.module = module
        self.extra = EXTRAS.get(module.split(".")[0])
        what = f"{needed_for} needs {module}, which is not installed" if needed_for else \
            f"{module} is not installed"
        if also:
            what += f", and {importer} imports {', '.join(also)}, not installed either"
        super().__init__(f"{what}: {hint_text(module, *also)}")


def hint_text(*modules: str) -> str:
    """What to run to get ``modules``: one ``pip install`` of the extras that bring them (an
    extra that another one named includes left out), and each module no extra brings by its
    own name."""
    tops = list(dict.fromkeys(m.split(".")[0] for m in modules))
    extras = {EXTRAS[t] for t in tops if t in EXTRAS}
    extras -= {inner for extra in extras for inner in INCLUDES.get(extra, ())}
    named = [e for e in dict.fromkeys(EXTRAS.values()) if e in extras]  # pyproject's order
    hints = [f"pip install 'tyingspec[{','.join(named)}]'"] if named else []
    hints += [f"pip install {t}" for t in tops if t not in EXTRAS]
    return "; ".join(hints)


def installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (torch takes a second)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked import, or a parent that is not a package
        return False


def require(module: str, needed_for: str = "",
            imports: Callable[[], Iterable[str]] | None = None,
            importer: str = "the target") -> None:
    """Raise :class:`MissingExtra` unless ``module`` is installed.  ``imports``: what the target
    imports (asked only when ``module`` is missing); those of them an extra brings and that are
    missing too are named in the same message and the same ``pip install``."""
    if installed(module):
        return
    top = module.split(".")[0]
    also = [] if imports is None else sorted(
        {m for m in imports() if m in EXTRAS and m != top and not installed(m)})
    raise MissingExtra(module, needed_for, also, importer)


def require_run(kind: str, precision: str, flag: str = "--",
                imports: Callable[[], Iterable[str]] | None = None,
                importer: str = "the target", *, needs: str | None = None) -> None:
    """Raise :class:`MissingExtra` unless what every run of ``kind`` at ``precision`` needs is
    installed: ``needs``, the module the kind's own code imports whatever the target (its
    table line's, ``kinds.table.needs``), and the precision's (``imports`` and ``importer`` as
    for :func:`require`).  The message names the option as given to the front end: ``flag`` is
    ``--`` for the command line, ``--tyingspec-`` for the pytest plugin."""
    for option, value, module in (("kind", kind, needs),
                                  ("precision", precision, PRECISION_MODULES.get(precision))):
        if module is not None:
            require(module, f"{flag}{option}={value}", imports, importer)


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


# --- what a target imports, read from its source ---------------------------------------------

def target_imports(target: str, paths: Sequence[str], builtin: object = None) -> frozenset[str]:
    """The top-level modules ``target`` imports as far as its source shows
    (:func:`imports_reached`): a ``module:attr`` found on ``paths`` (then ``sys.path``) without
    importing it or its packages, or ``builtin``, a built-in's function (its module's file and
    its name).  Empty where no source is found: this is for naming what to install, never for
    deciding whether a run may start."""
    if ":" in target:
        module, _, attr = target.partition(":")
        path = _module_file(module, paths)
    else:  # a function or class: an instance (a TorchTarget) names no source of its own
        attr = getattr(builtin, "__name__", None) or ""
        source = sys.modules.get(getattr(builtin, "__module__", None) or "") if attr else None
        path = getattr(source, "__file__", None)
    return imports_reached(path, attr) if path else frozenset()


def _module_file(module: str, paths: Sequence[str]) -> str | None:
    """The source file of ``module`` as the worker's import will find it (``paths`` first, then
    ``sys.path``; a regular package or a module in the first folder that has one, else the
    namespace package of every folder that has the name), looked up on disk: no package's
    ``__init__`` runs."""
    where = [*paths, *sys.path]
    for part in module.split("."):
        found, portions = _find(part, where)
        if found is None and not portions:
            return None
        where = portions
    return found


def _find(name: str, where: Sequence[str]) -> tuple[str | None, list[str]]:
    """``name`` in the folders ``where``: its source file (a module's, or a package's
    ``__init__.py``) and the folders to look in for its submodules."""
    portions: list[str] = []
    for folder in where:
        base = os.path.join(folder or os.curdir, name)
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(init):
            return init, [base]
        if os.path.isfile(base + ".py"):
            return base + ".py", []
        if os.path.isdir(base):
            portions.append(base)
    return None, portions


def imports_reached(path: str, attr: str) -> frozenset[str]:
    """The top-level names of the modules the file at ``path`` imports when it is imported and
    ``attr`` is used: its module-level imports (a class's body runs on import, its methods do
    not) and those of each function or class that this code or ``attr`` names, followed
    through the file (imports under ``if TYPE_CHECKING:`` and relative ones left out).  Read
    with ``ast``; nothing runs.  It errs towards more: an import in a branch not taken, or in a
    method of a class named, is counted."""
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    defs: dict[str, ast.AST] = {n.name: n for n in tree.body if isinstance(n, _DEFS)}
    # (node, whether its functions' bodies run): the module's statements run on import
    todo: list[tuple[ast.AST, bool]] = [(n, False) for n in tree.body
                                        if not isinstance(n, _FUNCTIONS)]
    if attr in defs:
        todo.append((defs[attr], True))
    seen = {attr}
    found: set[str] = set()
    while todo:
        for node in _executable(*todo.pop()):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Name) and node.id in defs and node.id not in seen:
                seen.add(node.id)
                todo.append((defs[node.id], True))
    return frozenset(found)


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _executable(node: ast.AST, calls: bool) -> Iterator[ast.AST]:
    """``node`` and every node under it, but for the bodies of ``if TYPE_CHECKING:`` and,
    unless ``calls``, of the functions defined in it (``node`` itself is walked whole)."""
    yield node
    if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
        children: Iterable[ast.AST] = node.orelse
    else:
        children = ast.iter_child_nodes(node)
    for child in children:
        if calls or not isinstance(child, _FUNCTIONS):
            yield from _executable(child, calls)
