"""The package's imports, read with ``ast``: no import circle inside ``tyingspec``, floors that
run one way (front ends, then the engine, then the kinds, then the core), and no kind's folder
importing another kind's.

An import is every ``import`` / ``from ... import`` the code can execute, at the top of a module
or inside a function (a lazy import still makes the two modules load each other).  Imports under
``if TYPE_CHECKING:`` are left out: they never run, and annotations are where two modules may
name each other's types without loading each other.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tyingspec"

SRC = "tyingspec._src."

#: the floors of ``tyingspec/_src``, bottom up: a module imports only from its own floor or
#: those below it
FLOORS = {"core": 0, "kinds": 1, "engine": 2, "front": 3, "ckpt": 3, "reproduce": 3}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, *, type_level: bool = False
             ) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run (``type_level``: those under ``if TYPE_CHECKING:`` too)."""
    if type_level:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from (n for body in node.orelse for n in _imports_in(body))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and _type_checking(node):
        return
    else:
        for child in ast.iter_child_nodes(node):
            yield from _imports_in(child)


def graph(*, type_level: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports (the package's own ``__init__`` left out: it
    is the public surface, which loads its names lazily); ``type_level``: the imports under
    ``if TYPE_CHECKING:`` too."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(f.read_text(), str(f)), type_level=type_level):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = targets or [base]
            edges[name] |= {t for t in targets if t in mods and t not in (name, "tyingspec")}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circle() -> None:
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_package_has_no_import_circle_even_a_type_level_one() -> None:
    # two modules naming each other's types are one module in two files (issue 54); a
    # Protocol names what one reads of the other's type instead (core.cases, kinds.torch.budget)
    found = circles(graph(type_level=True))
    assert not found, "type-level import circles:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle() -> None:
    # the test above must be able to fail: a lazy import back is a circle too
    edges = graph()
    low, high = SRC + "core.tolerance", SRC + "core.diagnosis"
    edges[low] = edges[low] | {high}
    assert any({low, high} <= set(c) for c in circles(edges))


def test_a_lazy_import_counts_and_a_type_checking_one_does_not() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from ._a import A\n"
                     "def f():\n    from ._b import B\n")
    assert [n.module for n in _imports(tree) if isinstance(n, ast.ImportFrom)] == [
        "typing", "_b"]


def _floor(module: str) -> str | None:
    return module[len(SRC):].split(".")[0] if module.startswith(SRC) else None


def _kind(module: str) -> str | None:
    """The kind folder a module lives in (``probe``, ``torch``, ``linear_ce``), else None."""
    parts = module[len(SRC):].split(".") if module.startswith(SRC) else []
    return parts[1] if len(parts) > 2 and parts[0] == "kinds" else None


def test_every_module_of_the_package_is_on_a_floor() -> None:
    strays = [m for m in graph() if m not in ("tyingspec", "tyingspec.__main__")
              and _floor(m) not in FLOORS and m != SRC.rstrip(".")]
    assert not strays, strays


def test_floors_run_one_way() -> None:
    upward = sorted((m, t) for m, ts in graph().items() for t in ts
                    if _floor(m) in FLOORS and _floor(t) in FLOORS
                    and FLOORS[str(_floor(t))] > FLOORS[str(_floor(m))])
    assert not upward, upward


def test_a_kind_imports_no_other_kinds_folder() -> None:
    crossing = sorted((m, t) for m, ts in graph().items() for t in ts
                      if _kind(m) is not None and _kind(t) is not None and _kind(m) != _kind(t))
    assert not crossing, crossing


def test_a_kind_does_not_import_the_table_of_kinds() -> None:
    # the table imports the kinds (to load one when it is used), never the other way
    back = sorted((m, t) for m, ts in graph().items() for t in ts
                  if _kind(m) is not None and t == SRC + "kinds.table")
    assert not back, back


def test_every_kind_is_a_folder_with_a_spec_and_one_table_line() -> None:
    # a kind is its folder and its line: the line names the folder's spec.py, the record there
    # is that kind's, and every kind folder is in the table (no folder left unwired)
    from tyingspec._src.core.kind import KindSpec
    from tyingspec._src.kinds.table import _LINES, KINDS

    folders = {p.name for p in (PACKAGE / "_src" / "kinds").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    named = set()
    for kind, line in _LINES.items():
        module, _, attr = line.split()[0].partition(":")
        parts = module.split(".")
        assert parts[:3] == ["tyingspec", "_src", "kinds"] and parts[4:] == ["spec"], line
        named.add(parts[3])
        assert isinstance(KINDS[kind], KindSpec) and KINDS[kind].name == kind
    assert named == folders, (named, folders)


def test_the_table_loads_a_kind_only_when_it_is_used() -> None:
    import subprocess
    import sys

    code = ("import sys; from tyingspec._src.kinds.table import KINDS; KINDS['kernel']; "
            "print(sorted(m for m in sys.modules if m.startswith('tyingspec._src.kinds.') "
            "and m.count('.') > 3))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    loaded = {m.split(".")[3] for m in eval(out)}  # noqa: S307 (our own printed list)
    assert loaded == {"probe"}, out


# ---- no hub: the worker's isolation is a package of parts, the diagnosis a list of rules ----

ISOLATION = PACKAGE / "_src" / "engine" / "isolation"
#: The longest a part of the isolation package may be: one sitting's reading (the worker's
#: handle, the largest part, is 389 lines; the one module they came from was 1588).
ISOLATION_PART_LINES = 400
#: The longest a function of ``core/diagnosis.py`` may be: ``diagnose`` was 214 lines, its
#: label assigned in three successive blocks; it is now evidence, then an ordered tuple of rules.
DIAGNOSIS_FUNCTION_LINES = 60


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function (methods and nested ones too) over ``limit`` lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno
            and n.end_lineno - n.lineno + 1 > limit]


def test_isolation_is_a_package_of_parts_each_short_with_a_docstring_that_says_why() -> None:
    assert not (ISOLATION.parent / "isolation.py").exists()
    parts = sorted(ISOLATION.glob("*.py"))
    assert {p.stem for p in parts} >= {"__init__", "wire", "blocks", "sources", "processes",
                                        "serving", "launch", "handle"}, parts
    long = {p.name: n for p in parts if (n := len(p.read_text().splitlines()))
            > ISOLATION_PART_LINES}
    assert not long, f"parts over {ISOLATION_PART_LINES} lines: {long}"
    bare = [p.name for p in parts if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, bare


def test_no_function_of_the_diagnosis_is_over_the_limit() -> None:
    source = (PACKAGE / "_src" / "core" / "diagnosis.py").read_text()
    long = _long_functions(source, DIAGNOSIS_FUNCTION_LINES)
    assert not long, long


def test_the_function_length_rule_finds_a_long_function() -> None:
    # the test above must be able to fail: a method and a nested function count too
    body = "\n".join(f"        x{i} = {i}" for i in range(DIAGNOSIS_FUNCTION_LINES))
    source = f"class A:\n    def m(self):\n{body}\n\ndef short():\n    pass\n"
    assert _long_functions(source, DIAGNOSIS_FUNCTION_LINES) == [
        ("m", DIAGNOSIS_FUNCTION_LINES + 1)]


def test_the_diagnosis_names_rows_by_an_ordered_tuple_of_rules_ending_in_a_catch_all() -> None:
    from tyingspec._src.core import diagnosis

    rules = diagnosis._RULES
    assert isinstance(rules, tuple) and len(rules) == len(set(rules)) >= 5
    # the first rule that gives a verdict names the rows: the last one always gives one
    assert rules[-1] is diagnosis._unexplained


def test_isolation_re_exports_its_parts_names_and_a_name_set_on_it_reaches_each_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import tyingspec._src.engine.isolation as iso
    from tyingspec._src.engine.isolation import blocks, handle, serving, sources, wire

    assert iso.Worker is handle.Worker and iso._encode is wire._encode
    assert iso._write_result is blocks._write_result is serving._write_result
    # as when it was one module: a test (or a benchmark's timing wrapper) that sets a name on
    # the package changes what every part that uses it reads
    monkeypatch.setattr(iso, "RESULTS_KEPT", 0)
    monkeypatch.setattr(iso, "HASH_BELOW", 16)
    monkeypatch.setattr(iso, "_write_result", len)
    assert handle.RESULTS_KEPT == 0 and sources.HASH_BELOW == 16
    assert blocks._write_result is len and serving._write_result is len
    assert handle._write_result is len
    monkeypatch.undo()
    assert handle.RESULTS_KEPT == 1 << 30 and serving._write_result is not len


#: a path of the repository's own tests or zoos, as docs, comments and CI scripts name them
_NAMED_PATH = re.compile(r"\b((?:tests|zoos)/[A-Za-z0-9_/]+\.py)\b")


def _named_paths() -> list[tuple[str, str]]:
    root = PACKAGE.parent
    out = []
    for pattern in ("*.md", "docs/*.md", "pyproject.toml", ".ci/*", "**/*.py"):
        for f in sorted(root.glob(pattern)):
            if any(part.startswith(".") and part != ".ci" for part in f.relative_to(root).parts) \
                    or not f.is_file() or f.name == "speed-journal.md":
                continue
            for m in _NAMED_PATH.finditer(f.read_text(errors="replace")):
                if not m.group(1).startswith("tests/models/"):  # transformers' own tests
                    out.append((str(f.relative_to(root)), m.group(1)))
    return out


def test_every_test_file_named_in_the_repository_exists() -> None:
    """The tests mirror the source's folders (``tests/core/``, ``tests/kinds/torch/``, ...): a
    doc, comment or CI script that names a test by a path it no longer has sends a reader to
    nothing.  (The dated speed journal keeps the paths of its day.)"""
    named = _named_paths()
    assert len(named) > 50  # the docs do name tests: a pattern matching nothing proves nothing
    missing = sorted({f"{where}: {path}" for where, path in named
                      if not (PACKAGE.parent / path).exists()})
    assert not missing, "\n".join(missing)


# ---- a kind is an object: nothing outside kinds/ names one ----------------------------------

#: Where no kind may be named: the floors a new kind must not touch, and the shared properties.
#: Left out: ``kinds/`` itself; ``tyingspec/__init__.py`` (the public surface re-exports
#: ``TorchTarget``, ``JaxTarget``, ... from their folders); ``reproduce/`` (the write-up's
#: experiments, on the probe model by design); and the properties of one kind (``_torch``,
#: ``_jax``, ``_distributed``, ``_linear_ce``, ``_signatures`` of the probe kinds), which the
#: kind's ``KindSpec.properties`` names.
NAMELESS = ("core", "engine", "front", "ckpt")
KIND_PROPERTIES = ("_torch", "_jax", "_distributed", "_linear_ce", "_signatures")


def _nameless_files(package: Path) -> list[Path]:
    """The modules under ``package`` (a copy of ``tyingspec/``) that may name no kind."""
    files = [f for floor in NAMELESS for f in sorted((package / "_src" / floor).rglob("*.py"))]
    properties = package.parent / "properties"
    return files + [f for f in sorted(properties.glob("*.py")) if f.stem not in KIND_PROPERTIES]


def kind_names_outside_kinds(package: Path) -> list[str]:
    """Every comparison with a kind's name (``kind == "linear-ce"``, ``kind in ("model",
    "kernel")``) and every import of a kind's folder (``kinds.linear_ce.zoo``) in the
    modules that may name no kind, as ``path:line: what``."""
    from tyingspec._src.kinds.table import KIND_NAMES

    folders = sorted(p.name for p in (package / "_src" / "kinds").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    folder_import = re.compile(r"(^|\.)kinds\.(" + "|".join(folders) + r")(\.|$)")
    names = set(KIND_NAMES)

    def literals(node: ast.expr) -> list[str]:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]

    found = []
    for f in _nameless_files(package):
        where = f.relative_to(package.parent)
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                hit = [n for side in (node.left, *node.comparators) for n in literals(side)]
                if hit:
                    found.append(f"{where}:{node.lineno}: compares with {', '.join(hit)}")
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if any(folder_import.search(m) for m in modules):
                    found.append(f"{where}:{node.lineno}: imports from {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno}: imports {a.name}" for a in node.names
                          if folder_import.search(a.name)]
    return found


def test_nothing_outside_kinds_names_a_kind() -> None:
    # a new kind is its folder and its table line: every decision about a kind (what it needs
    # installed, its padding row, its ignored target, its memory...) is a field of its spec
    found = kind_names_outside_kinds(PACKAGE)
    assert not found, "\n".join(found)


def test_the_kind_name_rule_finds_a_comparison_and_an_import(tmp_path: Path) -> None:
    # the test above must be able to fail: a copy of the package with one of each added
    kinds = tmp_path / "tyingspec" / "_src" / "kinds"
    (kinds / "linear_ce").mkdir(parents=True)
    (kinds / "linear_ce" / "__init__.py").write_text("")
    front = tmp_path / "tyingspec" / "_src" / "front"
    front.mkdir()
    (front / "x.py").write_text(
        "from tyingspec._src.kinds.linear_ce.zoo import LINEAR_CE_BUILTINS\n"
        "import tyingspec._src.kinds.linear_ce.kind\n"
        "def f(kind, spec):\n"
        "    a = kind == 'linear-ce'\n"
        "    b = spec.name in ('model', 'kernel')\n"
        "    return a, b, kind == 'tokens'\n")
    (tmp_path / "properties").mkdir()
    (tmp_path / "properties" / "_relabel.py").write_text("ok = 'kernel' != 'kernel'\n")
    found = kind_names_outside_kinds(tmp_path / "tyingspec")
    assert [h.split(": ", 1)[0] for h in found] == [
        "tyingspec/_src/front/x.py:1", "tyingspec/_src/front/x.py:2",
        "tyingspec/_src/front/x.py:4", "tyingspec/_src/front/x.py:5",
        "properties/_relabel.py:1"], found
    assert "compares with model, kernel" in found[3], found


def framework_rounding_under_kinds(package: Path) -> list[str]:
    """Every ``finfo`` and ``eps / 2`` in a kind's folder, as ``path:line``: a kind counts its
    local bounds in ``core.tolerance``'s units (``unit_of``, ``epsilon_of``), one rule for
    every kind, not in its framework's own."""
    rule = re.compile(r"\bfinfo\b|\beps\s*/\s*2\b")
    return [f"{f.relative_to(package.parent)}:{n}"
            for f in sorted((package / "_src" / "kinds").rglob("*.py"))
            for n, line in enumerate(f.read_text().splitlines(), 1) if rule.search(line)]


def test_no_kind_reads_its_frameworks_rounding() -> None:
    found = framework_rounding_under_kinds(PACKAGE)
    assert not found, found


def test_the_rounding_rule_finds_finfo_and_half_an_eps(tmp_path: Path) -> None:
    folder = tmp_path / "tyingspec" / "_src" / "kinds" / "torch"
    folder.mkdir(parents=True)
    (folder / "step.py").write_text("u = torch.finfo(x).eps\nok = 1\nv = eps / 2\n")
    assert framework_rounding_under_kinds(tmp_path / "tyingspec") == [
        "tyingspec/_src/kinds/torch/step.py:1", "tyingspec/_src/kinds/torch/step.py:3"]


# ---- the table is read where a kind's name comes in, and the spec is passed down -------------

#: Modules that look a kind up by its name (``kind_spec(name)``, ``KINDS[name]``): the entry
#: points, where the name comes in, and turn it into the ``KindSpec`` every layer below is
#: handed.  The three entry points (the CLI, the API and its ``tyingspec.build``, the pytest
#: plugin); the request the CLI and the API share (``front/request.py``: its ``--kind``
#: becomes the spec there); the commands that run every kind or the default one by name
#: (``tyingspec mutants``, ``tyingspec demo``); and the worker process, whose kind crossed the
#: process boundary as its name.
TABLE_READERS = ("_src/front/cli.py", "_src/front/api.py", "_src/front/batches.py",
                 "_src/front/plugin.py", "_src/front/request.py", "_src/front/kill_matrix.py",
                 "_src/front/demo.py", "_src/engine/isolation/serving.py")
#: Public functions that still take a kind's name (``tyingspec.load``, ``tyingspec.
#: check_target``, ``tyingspec.properties.for_kind``): each converts it at that boundary.
PUBLIC_BY_NAME = {"_src/engine/observe.py": ("load",), "_src/front/check.py": ("check_target",),
                  "properties/_core.py": ("for_kind",)}


def table_lookups_outside_entry_points(package: Path) -> list[str]:
    """Every ``kind_spec(...)`` call and ``KINDS[...]`` subscript outside ``kinds/``, the
    :data:`TABLE_READERS` and the :data:`PUBLIC_BY_NAME` functions, as ``path:line``."""
    files = [f for f in sorted((package / "_src").rglob("*.py"))
             if "kinds" not in f.relative_to(package / "_src").parts[:1]]
    files += sorted((package.parent / "properties").glob("*.py"))
    found = []
    for f in files:
        rel = f.relative_to(package).as_posix() if f.is_relative_to(package) else \
            f.relative_to(package.parent).as_posix()
        if rel in TABLE_READERS:
            continue
        allowed = PUBLIC_BY_NAME.get(rel, ())
        tree = ast.parse(f.read_text(), str(f))
        spared = {id(n) for fn in ast.walk(tree)
                  if isinstance(fn, ast.FunctionDef) and fn.name in allowed
                  for n in ast.walk(fn)}
        for node in ast.walk(tree):
            lookup = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id == "kind_spec") or (
                isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "KINDS")
            if lookup and id(node) not in spared:
                found.append(f"{rel}:{node.lineno}")  # type: ignore[attr-defined]
    return found


def test_the_table_is_read_at_the_entry_points_only() -> None:
    # below an entry point a kind is its KindSpec, handed down: a layer that looks a name up
    # again is one more place a kind is a string
    found = table_lookups_outside_entry_points(PACKAGE)
    assert not found, "\n".join(found)


def test_the_table_rule_finds_a_lookup_but_not_at_a_public_boundary(tmp_path: Path) -> None:
    package = tmp_path / "tyingspec"
    for folder in ("front", "engine", "kinds"):
        (package / "_src" / folder).mkdir(parents=True)
    (package / "_src" / "kinds" / "table.py").write_text("x = KINDS['model']\n")
    (package / "_src" / "front" / "suite.py").write_text(
        "def f(kind):\n    return kind_spec(kind).own_shape\n")
    (package / "_src" / "front" / "cli.py").write_text("spec = kind_spec(name)\n")
    (package / "_src" / "engine" / "observe.py").write_text(
        "def load(kind):\n    return kind_spec(kind)\n"
        "def other(kind):\n    return KINDS[kind]\n")
    (tmp_path / "properties").mkdir()
    (tmp_path / "properties" / "_core.py").write_text("def g(k):\n    return KINDS[k]\n")
    assert table_lookups_outside_entry_points(package) == [
        "_src/engine/observe.py:4", "_src/front/suite.py:2", "properties/_core.py:2"]


# ---- imports at the top: laziness only where it protects start-up --------------------------

#: Modules whose function-level imports of tyingspec's own modules need no ``# lazy:`` note:
#: the entry points, whose laziness is the start-up of the ``tyingspec`` command
#: (``front.entry``, ``front.cli``), of every pytest run (``front.plugin``: pytest loads it for
#: every run) and of ``import tyingspec`` (the two packages' ``__init__``); the kind table,
#: which loads a kind when it is used; and the worker process's start, which imports as little
#: as it can before the user's code (``engine.worker``, ``engine.isolation``).
LAZY_MODULES = ("tyingspec/__init__.py", "properties/__init__.py",
                "tyingspec/_src/front/entry.py", "tyingspec/_src/front/cli.py",
                "tyingspec/_src/front/plugin.py", "tyingspec/_src/kinds/table.py",
                "tyingspec/_src/engine/worker.py", "tyingspec/_src/engine/isolation/")
#: Files whose imports are left as they are for now (none).
LAZY_NOT_YET: tuple[str, ...] = ()


def _own(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in ("tyingspec", "properties") for a in node.names)
    return bool(node.level) or (node.module or "").split(".")[0] in ("tyingspec", "properties")


def _lazy_comment_above(lines: list[str], lineno: int) -> bool:
    """Whether the comment lines right above line ``lineno`` (1-based) start with ``# lazy:``."""
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        if lines[i].strip().startswith("# lazy:"):
            return True
        i -= 1
    return False


def unmarked_lazy_imports(root: Path) -> list[str]:
    """Every import of a tyingspec (or properties) module inside a function, outside
    :data:`LAZY_MODULES`, with no ``# lazy: <why>`` on its line or in the comment right above
    (which covers the imports right below it too), as ``path:line``.  An import inside a
    function runs at every call and hides what a module needs; it stays only where loading
    later is the point (start-up, a heavy dependency)."""
    files = [f for f in sorted((root / "tyingspec").rglob("*.py"))
             if "properties" not in f.relative_to(root).parts]
    files += sorted((root / "properties").glob("*.py"))
    found = []
    for f in files:
        where = f.relative_to(root).as_posix()
        if where.startswith(LAZY_MODULES + LAZY_NOT_YET):
            continue
        text = f.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text, str(f))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            marked_ends = set()
            for node in sorted((n for stmt in fn.body for n in _imports_in(stmt)),
                               key=lambda n: n.lineno):
                if "# lazy:" in lines[node.lineno - 1] or _lazy_comment_above(lines, node.lineno) \
                        or node.lineno - 1 in marked_ends:
                    marked_ends.add(node.end_lineno)
                elif _own(node):
                    found.append((where, node.lineno))
    return [f"{where}:{line}" for where, line in sorted(set(found))]


def test_tyingspec_imports_its_own_modules_at_the_top() -> None:
    found = unmarked_lazy_imports(PACKAGE.parent)
    assert not found, "import these at the module's top, or say why not (# lazy: ...):\n" + \
        "\n".join(found)


def test_the_import_rule_finds_an_unmarked_lazy_import(tmp_path: Path) -> None:
    # the test above must be able to fail: an unmarked one is found, a marked one and one in an
    # entry point are not
    front = tmp_path / "tyingspec" / "_src" / "front"
    front.mkdir(parents=True)
    (tmp_path / "properties").mkdir()
    (front / "x.py").write_text(
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    from tyingspec._src.core import labels\n"
        "    # lazy: a reason\n"
        "    # on two lines\n"
        "    from tyingspec._src.core import files\n"
        "    from . import y  # lazy: another\n"
        "    from . import w\n"
        "\n"
        "    from . import v\n"
        "    def g():\n"
        "        from .y import z\n")
    (front / "cli.py").write_text("def main():\n    from tyingspec._src.front import x\n")
    (tmp_path / "properties" / "_p.py").write_text("def f():\n    import tyingspec\n")
    assert unmarked_lazy_imports(tmp_path) == [
        "properties/_p.py:2", "tyingspec/_src/front/x.py:4", "tyingspec/_src/front/x.py:11",
        "tyingspec/_src/front/x.py:13"]
