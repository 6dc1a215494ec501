"""A user's own script that calls tyingspec needs no ``if __name__ == "__main__":`` guard: the
worker that imports and calls the target starts as a module of its own and never imports the
script (a ``spawn`` worker re-ran it, which failed the check or ran it recursively)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: The README's numpy model adapter (examples/numpy_model/grads.py), copied beside the target
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "numpy_model" / "grads.py"

#: A correct model adapter (the example's), which notes the pid of each process that calls it.
ADAPTER = '''
import os

from example_grads import tied_backward as _example

CALLS = {calls!r}


def tied_backward(E, W, b, tokens, targets, *, res, s_in):
    with open(CALLS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return _example(E, W, b, tokens, targets, res=res, s_in=s_in)
'''

#: The first lines of every script: no ``__main__`` guard, and a note of each run of its body.
PROLOGUE = '''
import os
import sys

import tyingspec

with open({runs!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
'''

CHECK = PROLOGUE + '''
report = tyingspec.check("mygrads:tied_backward", paths=[{here!r}], case="absent-tokens")
print("verdict:", report.verdict)
sys.exit(0 if report.ok else 1)
'''

PROPERTY = PROLOGUE + '''
from hypothesis import HealthCheck, given, settings
from tyingspec.properties import PROPERTIES

prop = PROPERTIES["sum_of_paths"]
target = tyingspec.load("mygrads:tied_backward", "model", paths=({here!r},))
assert target.worker is not None, "a module:attr target runs in a worker"
try:
    given(prop.strategy())(settings(max_examples=5, database=None, deadline=None,
                                    suppress_health_check=list(HealthCheck))(
        lambda case: prop.check(target, case)))()
finally:
    target.close()
print("property: passed")
'''

#: The adapter found only through the script's own sys.path (no ``paths``), its data file only
#: through the script's working directory: the worker is handed both.
SYS_PATH = PROLOGUE + '''
sys.path.insert(0, {lib!r})
report = tyingspec.check("hidden:tied_backward", paths=[], case="absent-tokens")
print("verdict:", report.verdict)
sys.exit(0 if report.ok else 1)
'''


def _write(where: Path, name: str, text: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / name
    path.write_text(text)
    return path


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH emptied: the adapter is found through the paths the script gives, not the
    # environment (the worker would inherit that whatever its start)
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ""})


def _write_adapter(where: Path, name: str, text: str) -> None:
    _write(where, "example_grads.py", EXAMPLE.read_text())
    _write(where, name, text)


@pytest.fixture()
def adapter(tmp_path: Path) -> Path:
    _write_adapter(tmp_path, "mygrads.py", ADAPTER.format(calls=str(tmp_path / "calls")))
    return tmp_path


def _ran_once(where: Path, out: subprocess.CompletedProcess[str], expect: str) -> None:
    """The script exited 0 with ``expect`` in its output, its body ran exactly once, and the
    adapter was called, in a process other than the script's."""
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert expect in out.stdout, text[-4000:]
    assert "bootstrapping phase" not in text, text[-4000:]
    runs = _lines(where / "runs")
    assert len(runs) == 1, f"the script's body ran {len(runs)} times:\n{text[-4000:]}"
    calls = set(_lines(where / "calls"))
    assert calls, "the adapter was never called"
    assert runs[0] not in calls, "the adapter ran in the script's own process, not a worker"


def test_a_script_without_a_main_guard_checks_a_target(adapter: Path) -> None:
    script = _write(adapter, "check_mine.py",
                    CHECK.format(runs=str(adapter / "runs"), here=str(adapter)))
    _ran_once(adapter, _run(adapter, str(script)), "verdict: correct")


def test_a_module_run_with_dash_m_without_a_main_guard_checks_a_target(adapter: Path) -> None:
    _write(adapter / "pkg", "__init__.py", "")
    _write(adapter / "pkg", "script.py",
           CHECK.format(runs=str(adapter / "runs"), here=str(adapter)))
    _ran_once(adapter, _run(adapter, "-m", "pkg.script"), "verdict: correct")


def test_a_script_without_a_main_guard_runs_a_property_on_a_target(adapter: Path) -> None:
    script = _write(adapter, "prop_mine.py",
                    PROPERTY.format(runs=str(adapter / "runs"), here=str(adapter)))
    _ran_once(adapter, _run(adapter, str(script)), "property: passed")


def test_the_worker_gets_the_scripts_sys_path_and_working_directory(tmp_path: Path) -> None:
    lib, work = tmp_path / "lib", tmp_path / "work"
    _write(work, "data.txt", "absent-tokens\n")
    # the adapter reads a file relative to the working directory at import
    _write_adapter(lib, "hidden.py", "CASE = open('data.txt').read().strip()\n" +
                   ADAPTER.format(calls=str(tmp_path / "calls")))
    script = _write(tmp_path, "check_hidden.py",
                    SYS_PATH.format(runs=str(tmp_path / "runs"), lib=str(lib)))
    _ran_once(tmp_path, _run(work, str(script)), "verdict: correct")


WHERE = '''
import numpy as np
from tyingspec._src.core.process_state import in_worker


def f(E, W, b, tokens, targets, *, res, s_in):
    with open({out!r}, "a") as fh:
        fh.write(f"{{in_worker()}}\\n")
    return {{"loss": 0.0, "dE": np.zeros_like(E), "dW": np.zeros_like(W),
             "db": None if b is None else np.zeros_like(b)}}
'''


def test_a_worker_knows_it_is_one_and_the_users_process_does_not(tmp_path: Path) -> None:
    """``core.process_state.in_worker``: what lets a kind set a process-wide option (the jax
    kind's XLA flags) in a worker only; a check run in the user's own process must see False."""
    from tyingspec._src.core.cases import standard_cases
    from tyingspec._src.core.process_state import in_worker
    from tyingspec._src.engine.observe import load, observe

    out = tmp_path / "where.txt"
    (tmp_path / "where_target.py").write_text(WHERE.format(out=str(out)))
    case = standard_cases(0)[0]
    for isolate in (True, False):
        sys.path.insert(0, str(tmp_path))
        try:
            target = load("where_target:f", "model", isolate=isolate,
                          paths=(str(tmp_path),))
            observe(target, case)
        finally:
            sys.path.remove(str(tmp_path))
            sys.modules.pop("where_target", None)
    assert out.read_text().split() == ["True", "False"]
    assert not in_worker()
