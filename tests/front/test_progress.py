"""A running check says what it is doing: on a terminal one status line redrawn in place (case,
phase, seconds), piped one line per case start and end, with ``--quiet`` nothing; the pytest
plugin a line per property as it starts and ends, with and without ``-n 2``."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Scratch

from tyingspec._src.front import progress as progress_module
from tyingspec._src.front.check import check_target
from tyingspec._src.front.cli import main
from tyingspec._src.front.progress import Progress

#: A correct model adapter that takes its time: each call sleeps, so one case lasts past the
#: seconds after which a run shows its progress.
SLOW = textwrap.dedent("""
    import time
    from tyingspec import REGISTRY

    _tied = REGISTRY["tied"].model

    def f(E, W, b, tokens, targets, *, res, s_in):
        time.sleep(1.3)
        return _tied(E, W, b, tokens, targets, res=res, s_in=s_in)
""")


def _read_all(fd: int, proc: subprocess.Popen[bytes]) -> bytes:
    """Everything written to the pty's other end until the process ends."""
    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the other end closed: Linux says EIO
                break
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    return data


def test_a_run_on_a_terminal_shows_one_status_line_redrawn_in_place(tmp_path: Path) -> None:
    (tmp_path / "slowmod.py").write_text(SLOW)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tyingspec", "check", "slowmod:f",
                             "--case", "absent-tokens"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)
    try:
        err = _read_all(master, proc).decode()
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert proc.wait(timeout=120) == 0, (out, err)
    finally:
        os.close(master)
    # redrawn in place: carriage returns, never a new line, and cleared at the end
    draws = [d for d in err.split("\r") if d.strip()]
    assert "\n" not in err and len(draws) >= 2, repr(err)
    assert err.rstrip(" ").endswith("\r") and not err.split("\r")[-1].strip()
    for d in draws:
        m = re.fullmatch(r"tyingspec: case absent-tokens \(1 of 1\): (.+) \((\d+\.\d) s\) *", d)
        assert m, repr(d)
        assert m.group(1) in ("calling", "reference", "judging", "second call"), d
    # the phase moves on with the engine, and the seconds with the clock
    seconds = [float(re.search(r"\((\d+\.\d) s\)", d).group(1)) for d in draws]  # type: ignore
    assert seconds[-1] > seconds[0]
    # the report on stdout is untouched by it
    assert "\r" not in out and "verdict: correct" in out


@pytest.fixture
def shown_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress from the first second on (a built-in's case takes milliseconds)."""
    monkeypatch.setattr(progress_module, "DELAY", 0.0)


def test_a_piped_run_says_when_each_case_starts_and_ends(
        capsys: pytest.CaptureFixture[str], shown_at_once: None) -> None:
    assert main(["check", "tied"]) == 0
    captured = capsys.readouterr()
    heads = re.findall(r"^case (\S+) \(.*\): (ok|NO POWER)$", captured.out, re.M)
    assert len(heads) == 10
    cases = [name for name, _ in heads]
    status = {name: {"ok": "correct", "NO POWER": "no power"}[head] for name, head in heads}
    loading, *lines = captured.err.splitlines()  # the target's load, then each case
    assert loading == "tyingspec: loading tied: started", loading
    assert len(lines) == 2 * len(cases), lines
    for i, name in enumerate(cases):
        started, ended = lines[2 * i], lines[2 * i + 1]
        assert started.startswith(f"tyingspec: case {name} ({i + 1} of 10): started"), started
        assert re.fullmatch(rf"tyingspec: case {re.escape(name)} \({i + 1} of 10\): "
                            rf"{status[name]} in \d+\.\d s", ended), ended
    assert "\r" not in captured.err


def test_a_wrong_case_ends_as_wrong(capsys: pytest.CaptureFixture[str],
                                    shown_at_once: None) -> None:
    assert main(["check", "output-path-only", "--case", "absent-tokens"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"tyingspec: case absent-tokens \(1 of 1\): wrong in \d+\.\d s", err[-1])


@pytest.mark.parametrize("flag", ["--quiet", "-q"])
def test_quiet_shows_no_progress(capsys: pytest.CaptureFixture[str], shown_at_once: None,
                                 flag: str) -> None:
    assert main(["check", "tied", flag]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "verdict: correct" in captured.out


def test_a_short_run_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # the default: nothing until the run has lasted a couple of seconds
    assert main(["check", "tied", "--case", "absent-tokens"]) == 0
    assert capsys.readouterr().err == ""


def _drawn(target: str) -> str:
    """What a check of ``target`` draws on a terminal's status line, from its first second."""
    stream = io.StringIO()
    shown = Progress(stream, tty=True, delay=0.0, tick=60.0)
    try:
        check_target(target, "model", 0, progress=shown)
    finally:
        shown.close()
    return stream.getvalue()


def test_the_phases_come_from_the_engine() -> None:
    draws = [d.strip() for d in _drawn("tied").split("\r") if d.strip()]
    phases = {m.group(1) for d in draws
              if (m := re.fullmatch(r"tyingspec: case \S+ \(\d+ of 10\): (.+) \(\d+\.\d s\)",
                                    d))}
    assert phases >= {"calling", "reference", "judging", "second call"}, draws
    assert any(d.startswith("tyingspec: loading tied") for d in draws)


def test_a_wrong_case_shows_its_shrinking() -> None:
    assert ": shrinking (" in _drawn("output-path-only")


def test_the_status_line_is_redrawn_as_time_passes() -> None:
    stream = io.StringIO()
    now = [0.0]
    shown = Progress(stream, tty=True, delay=2.0, tick=0.01, clock=lambda: now[0])
    try:
        shown.case_started("absent-tokens", 1, 3)
        shown.phase("calling")
        time.sleep(0.05)
        assert stream.getvalue() == ""  # not yet two seconds
        now[0] = 2.5
        deadline = time.monotonic() + 5
        while "(2.5 s)" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "\rtyingspec: case absent-tokens (1 of 3): calling (2.5 s)" in stream.getvalue()
        shown.case_ended("correct", 2.5)
        assert stream.getvalue().endswith("\r")  # cleared before the case's report
    finally:
        shown.close()


# --- the pytest plugin ----------------------------------------------------------------------

FAST = ("--tyingspec-profile=ci", "--tyingspec-max-examples=5", "-k",
        "sum_of_paths or inputs_untouched")


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["in-process", "xdist-n2"])
def test_the_plugin_says_when_each_property_starts_and_ends(
        scratch: Scratch, xdist: tuple[str, ...]) -> None:
    result = scratch.runpytest("-p", "xdist", "--tyingspec-adapter=tied", *FAST, *xdist)
    assert result.ret == 0, "\n".join(result.outlines)
    text = "\n".join(result.outlines)
    for prop in ("inputs_untouched", "sum_of_paths"):
        started = text.index(f"tyingspec: property {prop} started")
        ended = re.search(rf"^tyingspec: property {prop} passed in \d+\.\d s$", text, re.M)
        assert ended and ended.start() > started, text


def test_the_plugin_names_a_failing_propertys_label(scratch: Scratch) -> None:
    result = scratch.runpytest("-p", "xdist", "--tyingspec-adapter=output-path-only",
                               "--tyingspec-profile=ci", "--tyingspec-max-examples=5",
                               "-k", "sum_of_paths")
    assert result.ret == 1
    assert re.search(r"^tyingspec: property sum_of_paths failed \(input_path_missing\) in "
                     r"\d+\.\d s$", "\n".join(result.outlines), re.M)


def test_the_plugin_is_quiet_under_pytest_q(scratch: Scratch) -> None:
    result = scratch.runpytest("-p", "xdist", "--tyingspec-adapter=tied", *FAST, "-q")
    assert result.ret == 0
    assert not [line for line in result.outlines if line.startswith("tyingspec: property")]
