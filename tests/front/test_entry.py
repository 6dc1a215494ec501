"""The command's entry point: OpenBLAS's threads set to sleep at once in tyingspec's own process,
and nobody else's environment changed (see ``front.entry``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NAME = "OPENBLAS_THREAD_TIMEOUT"


def _fresh(code: str, env: dict[str, str] | None = None, cwd: Path | None = None,
           argv: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter, where numpy is not loaded yet."""
    base = {k: v for k, v in os.environ.items() if k not in (NAME, "GOTO_THREAD_TIMEOUT")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *(argv or [])],
                          capture_output=True, text=True, env=base | (env or {}), cwd=cwd,
                          timeout=120)


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


# -- the worker started before numpy loads (front.entry.early_target, isolation.launch_early) --

@pytest.mark.parametrize("argv", [
    ["check", "m:f"],
    ["check", "m:f", "--kind", "torch", "--timeout", "5"],
    ["check", "m:f", "--kind=jax", "--timeout=2.5", "--kind", "linear-ce"],
    ["check", "m:f", "--case", "absent-tokens", "--json", "out:1.json", "--seed", "3"],
])
def test_the_early_guess_of_a_check_is_what_its_parser_reads(argv: list[str]) -> None:
    from tyingspec._src.front.cli import _command, build_parser
    from tyingspec._src.front.entry import early_target

    args = build_parser(_command(argv)).parse_args(argv)
    assert early_target(argv) == (args.target, args.kind or "model", args.timeout)


@pytest.mark.parametrize("argv", [
    [], ["check"], ["check", "tied"], ["check", "--kind", "torch", "m:f"], ["check", "m:f", "-h"],
    ["check", "m:f", "--list"], ["check", "m:f", "--timeout", "soon"], ["check", "m:f", "--kind"],
    ["mutants", "m:f"], ["check", "m:f", "--", "x"],
])
def test_the_early_guess_declines_what_it_is_unsure_of(argv: list[str]) -> None:
    from tyingspec._src.front.entry import early_target

    assert early_target(argv) is None


PROBE = """
import os
from tyingspec._src.kinds.probe.builtins import REGISTRY

with open({imports!r}, "a") as fh:  # a line per worker that imported this module: pid, nice
    fh.write(f"{{os.getpid()}} {{os.nice(0)}}\\n")

ok = REGISTRY["tied"].model
"""

#: The command as the console script runs it, in a fresh interpreter (argv after ``-c``).
COMMAND = """
    import sys
    from tyingspec._src.front.entry import main
    sys.exit(main(sys.argv[1:]))
"""


def _probe(tmp_path: Path) -> Path:
    """``early_probe:ok`` (a correct model adapter) in ``tmp_path``; returns the file where each
    worker that imports it writes its pid and niceness."""
    imports = tmp_path / "imports.txt"
    (tmp_path / "early_probe.py").write_text(PROBE.format(imports=str(imports)))
    return imports


def _left_behind(mark: str) -> list[int]:
    """Processes still running with ``mark`` in their environment (a run's worker inherits
    it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if mark.encode() in environ and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("extra", [[], ["--time", "60"]], ids=["guessed", "abbreviated"])
def test_the_command_gives_the_same_verdict_whatever_its_early_guess(
        tmp_path: Path, extra: list[str]) -> None:
    # "--time" is argparse's abbreviation of --timeout, which the guess does not read: its
    # early worker is ended and the check starts one of its own
    imports = _probe(tmp_path)
    mark = f"TYINGSPEC_TEST_{os.getpid()}_{len(extra)}"
    run = _fresh(COMMAND, {mark: "1"}, cwd=tmp_path,
                 argv=["check", "early_probe:ok", "--case", "absent-tokens", *extra])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verdict: correct" in run.stdout
    assert 1 <= len(imports.read_text().splitlines()) <= 2
    assert _left_behind(mark) == []


def test_a_launch_for_the_same_target_takes_the_early_worker_over_and_any_other_ends_it(
        tmp_path: Path) -> None:
    from tyingspec import Case, build
    from tyingspec._src.engine import isolation

    _probe(tmp_path)
    paths = (str(tmp_path),)
    isolation.launch_early("early_probe:ok", "model", paths, 30.0)
    (early, _), = isolation._EARLY.values()
    same = isolation.Worker("early_probe:ok", "model", 30.0, paths)
    same.start()
    try:
        assert same._proc is early and isolation._EARLY == {}
        batch = build(Case("c", V=7, d=3, N=5, tokens=(1, 2, 2, 6, 0), seed=1))
        returned = same.invoke({"E": batch.E, "W": batch.W, "b": batch.b, "tokens": batch.tokens,
                                "targets": batch.targets, "res": batch.res, "s_in": batch.s_in})
        assert returned.dE.shape == (7, 3)
    finally:
        same.stop()
    isolation.launch_early("early_probe:ok", "model", paths, 30.0)
    (early, _), = isolation._EARLY.values()
    other = isolation.Worker("early_probe:ok", "model", 60.0, paths)  # another timeout
    other.start()
    try:
        assert other._proc is not early and isolation._EARLY == {}
        assert not early.is_alive()
        assert early.pid not in isolation._LIVE
    finally:
        other.stop()


def test_a_usage_error_after_an_early_start_leaves_no_worker_behind(tmp_path: Path) -> None:
    _probe(tmp_path)
    mark = f"TYINGSPEC_TEST_{os.getpid()}_usage"
    run = _fresh(COMMAND, {mark: "1"}, cwd=tmp_path,
                 argv=["check", "early_probe:ok", "--case", "no-such-case"])
    assert run.returncode == 2
    assert "no case 'no-such-case'" in run.stderr
    assert _left_behind(mark) == []


def test_the_command_gives_way_to_its_worker_which_keeps_the_users_priority(
        tmp_path: Path) -> None:
    imports = _probe(tmp_path)
    run = _fresh("""
        import os, sys
        from tyingspec._src.front.entry import NICE, main
        before = os.nice(0)
        code = main(sys.argv[1:])
        print("nice", before, os.nice(0), NICE)
        sys.exit(code)
    """, cwd=tmp_path, argv=["check", "early_probe:ok", "--case", "absent-tokens"])
    assert run.returncode == 0, run.stdout + run.stderr
    before, after, step = (int(x) for x in run.stdout.split("nice ")[-1].split())
    assert step > 0
    assert after == min(before + step, 19)  # the command's own process, lowered
    workers = [line.split() for line in imports.read_text().splitlines()]
    assert [int(nice) for _, nice in workers] == [before]  # the worker, started first, as it was
