"""The command's entry point: OpenBLAS's threads set to sleep at once in tyingspec's own process,
and nobody else's environment changed (see ``front.entry``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

NAME = "OPENBLAS_THREAD_TIMEOUT"


def _fresh(code: str, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter, where numpy is not loaded yet."""
    base = {k: v for k, v in os.environ.items() if k not in (NAME, "GOTO_THREAD_TIMEOUT")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=base | (env or {}), cwd=cwd, timeout=120)


def test_numpy_loads_with_the_setting_and_the_environment_is_as_it_was() -> None:
    run = _fresh(f"""
        import os, sys
        from tyingspec._src.front.entry import load_numpy
        assert "numpy" not in sys.modules
        print(load_numpy(), "numpy" in sys.modules, os.environ.get({NAME!r}))
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "None"]


def test_a_users_own_setting_is_kept_and_a_loaded_numpy_left_alone() -> None:
    own = _fresh(f"""
        import os
        from tyingspec._src.front.entry import load_numpy
        print(load_numpy(), os.environ.get({NAME!r}))
    """, {NAME: "7"})
    assert own.returncode == 0, own.stderr
    assert own.stdout.split() == ["False", "7"]
    loaded = _fresh("""
        import numpy
        from tyingspec._src.front.entry import load_numpy
        print(load_numpy())
    """)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["False"]


def test_the_worker_running_the_users_code_gets_the_users_environment(tmp_path: Path) -> None:
    # the adapter reports the variable it sees through the one channel a failing call has: its
    # error, which the check prints
    (tmp_path / "envprobe.py").write_text(textwrap.dedent(f"""
        import os

        def f(E, W, b, tokens, targets, *, res, s_in):
            raise RuntimeError("worker sees " + repr(os.environ.get({NAME!r})))
    """))
    run = _fresh("""
        import sys
        from tyingspec._src.front.entry import main
        sys.exit(main(["check", "envprobe:f", "--kind", "model", "--case", "absent-tokens"]))
    """, cwd=tmp_path)
    assert "worker sees None" in run.stdout + run.stderr, run.stdout + run.stderr
    assert run.returncode == 2
