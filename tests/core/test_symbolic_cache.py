"""The sympy reference's derived sources are saved on disk (``core.symbolic.cache_dir``): a
second process loads them instead of deriving again (4.5 CPU-s per process, most of the plugin
quick start's CPU), gets the same numbers, and a damaged or missing file is derived afresh."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tyingspec._src.core import symbolic


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty cache directory, and no function compiled in this process yet."""
    monkeypatch.setenv(symbolic.CACHE_ENV, str(tmp_path / "cache"))
    symbolic.compiled.cache_clear()
    yield tmp_path / "cache"
    symbolic.compiled.cache_clear()


def _args(V: int, d: int, bias: bool) -> list[object]:
    rng = np.random.default_rng(V * 10 + d)
    E, W, b = rng.normal(size=V * d), rng.normal(size=d * d), rng.normal(size=V)
    onehot = list(np.eye(V)[[0, V - 1, 0]].T)
    return [list(E), list(E), list(W), list(b) if bias else [], onehot, onehot[::-1], 1.0, 0.5]


def _values(fn: object, V: int, d: int, bias: bool) -> list[float]:
    return [float(np.sum(v)) for v in fn(*_args(V, d, bias))]  # type: ignore[operator]


def test_a_derived_source_is_saved_and_loaded_in_place_of_deriving(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = symbolic.compiled(2, 2, True)
    saved = list(fresh.iterdir())
    assert [p.name.split("-", 1)[1] for p in saved] == ["2x2-bias.py"]
    symbolic.compiled.cache_clear()  # as a new process

    def no_deriving(*_: object) -> None:
        raise AssertionError("derived again")

    monkeypatch.setattr(symbolic, "derived", no_deriving)
    loaded = symbolic.compiled(2, 2, True)
    assert loaded is not first
    assert _values(loaded, 2, 2, True) == _values(first, 2, 2, True)


def test_a_damaged_file_is_derived_afresh(fresh: Path) -> None:
    symbolic.compiled(3, 1, False)
    (saved,) = fresh.iterdir()
    saved.write_text("def _lambdifygenerated(:\n")
    symbolic.compiled.cache_clear()
    fn = symbolic.compiled(3, 1, False)
    assert _values(fn, 3, 1, False) == _values(symbolic.derived(3, 1, False), 3, 1, False)
    assert "def _lambdifygenerated(" in saved.read_text() and "(:" not in saved.read_text()


def test_an_empty_variable_saves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(symbolic.CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    symbolic.compiled.cache_clear()
    try:
        assert symbolic.cache_dir() is None
        symbolic.compiled(1, 1, False)
        assert list(tmp_path.iterdir()) == []
    finally:
        symbolic.compiled.cache_clear()


def test_the_files_name_changes_with_what_derives_them() -> None:
    # a saved source is used only by the module text and sympy version that derived it
    import hashlib

    import sympy

    h = hashlib.sha256(Path(symbolic.__file__).read_bytes())
    h.update(sympy.__version__.encode())
    assert symbolic._digest() == h.hexdigest()[:16]


def test_a_process_that_loads_saved_sources_does_not_import_sympy(fresh: Path) -> None:
    # issue 53: sympy's import (a quarter of a CPU-second) is paid only to derive
    import os
    import subprocess
    import sys

    for V, d, bias in ((2, 2, True), (3, 1, False)):
        symbolic.compiled(V, d, bias)  # saved here, as by a first run
    code = ("import sys\nfrom tyingspec._src.core import symbolic\n"
            "fns = [symbolic.compiled(2, 2, True), symbolic.compiled(3, 1, False)]\n"
            "print('sympy' in sys.modules)\n")
    root = str(Path(symbolic.__file__).resolve().parents[3])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, symbolic.CACHE_ENV: str(fresh),
                              "PYTHONPATH": root}, check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("V,d,bias", [(1, 1, False), (2, 2, True), (4, 3, True)])
def test_a_saved_source_without_sympy_gives_the_derived_numbers(
        fresh: Path, V: int, d: int, bias: bool) -> None:
    derived = symbolic.compiled(V, d, bias)
    (saved,) = fresh.glob(f"*-{V}x{d}{'-bias' if bias else ''}.py")
    code = compile(saved.read_text(), str(saved), "exec")
    namespace = symbolic._saved_namespace(code)
    assert "tanh" in namespace and namespace["tanh"] is np.tanh  # numpy's, not sympy's table
    exec(code, namespace)
    assert _values(namespace["_lambdifygenerated"], V, d, bias) == _values(derived, V, d, bias)
