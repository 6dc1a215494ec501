"""Hypothesis profiles for tyingspec's own suite (`dev` locally, the derandomized `ci` under CI),
and the scratch directories the plugin's end-to-end tests run pytest in."""

import contextlib
import importlib.util
import io
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("ci"), max_examples=30,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _import_zoos() -> None:
    """Import ``zoos/`` (the model zoos the tests share with ``benchmarks/``) as the package
    ``zoos``, without putting the repository's root on ``sys.path``: from there ``import
    tyingspec`` would find the source folder, which lacks the ``tyingspec.properties`` that the
    install maps in."""
    root = Path(__file__).resolve().parents[1] / "zoos"
    spec = importlib.util.spec_from_file_location("zoos", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoos"] = module
    spec.loader.exec_module(module)


_import_zoos()


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny models: intra-op threads only add overhead, and on
    a loaded machine (or under pytest -n) that overhead made one check take seconds instead of
    tens of milliseconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Scratch:
    """A scratch directory holding a user's files, in which ``pytest`` runs as a user runs it,
    but inside this process: a second interpreter per run cost the default tier ~15 s.

    Unlike ``pytester.runpytest_inprocess`` it keeps the modules a run imported (pytester drops
    them, and a later import then loads a second copy: numpy >= 2.3 and Rust extensions refuse
    to load twice).  Only the scratch directory's own modules and ``sys.path`` are undone.
    The run goes without pytest's cache (nothing of it outlives the scratch directory) and
    without its unraisable-exception plugin, whose five ``gc.collect()`` at the end of a
    session cost ~0.8 s over this process's heap (torch, transformers, sympy)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def makepyfile(self, **files: str) -> None:
        for name, text in files.items():
            (self.path / f"{name}.py").write_text(textwrap.dedent(text))

    def makeconftest(self, text: str) -> None:
        self.makepyfile(conftest=text)

    def runpytest(self, *args: str) -> pytest.RunResult:
        out, err = io.StringIO(), io.StringIO()
        path, modules = list(sys.path), set(sys.modules)
        t0 = time.perf_counter()
        try:
            with contextlib.chdir(self.path), contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(err):
                ret = pytest.main(["-p", "no:cacheprovider", "-p", "no:unraisableexception",
                                   *args])
        finally:
            sys.path[:] = path
            for name in set(sys.modules) - modules:
                file = getattr(sys.modules[name], "__file__", None) or ""
                if Path(file).is_relative_to(self.path):
                    del sys.modules[name]
        return pytest.RunResult(ret, out.getvalue().splitlines(), err.getvalue().splitlines(),
                                time.perf_counter() - t0)


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Scratch:
    """An empty :class:`Scratch`; the runs see no PYTEST_ADDOPTS of the outer session."""
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.setenv("PY_COLORS", "0")
    return Scratch(tmp_path)



#: Test modules of what torch runs: the torch, transformers, distributed, checkpoint and
#: linear-ce kinds.  CI runs them (``-m torch``) a second time on the newest torch pip installs
#: (``.ci/run``), because the observer leans on how torch dispatches (``Function.apply`` moved
#: from Python to C between 2.13 and 2.14, and nothing on 2.13 could have seen it).
_TORCH_MODULES = ("torch", "transformers", "distributed", "ckpt", "linear_ce")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = Path(str(item.fspath)).stem
        if any(word in module for word in _TORCH_MODULES) or "torch" in item.name:
            item.add_marker(pytest.mark.torch)
