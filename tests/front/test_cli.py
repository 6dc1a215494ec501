"""`tyingspec check`: the default table, verdicts and exit codes, JSON, replay, adapter errors."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tyingspec._src.front.cli import main

WRITE_UP_TABLE = """\
| gradient into E | wrong rows | rows still exactly right |
|---|---|---|
| both paths, += | 0 | 64 of 64 |
| output path only | 8 | 56 of 64 (87.5%) |
| input path only | 64 | 0 |"""


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("seed", ["0", "1", "17"])
def test_default_check_prints_the_write_up_table_exactly(capsys: pytest.CaptureFixture[str],
                                                         seed: str) -> None:
    code, out = _run(capsys, "check", "--seed", seed)
    assert code == 0
    assert WRITE_UP_TABLE in out
    assert "duplicates not accumulated" in out and "every built-in diagnosed as expected" in out


def test_output_path_only_exits_1_and_names_exactly_the_batch_rows(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    code, out = _run(capsys, "check", "output-path-only", "--json", str(report))
    assert code == 1
    assert "input path missing" in out
    data = json.loads(report.read_text())
    assert data["schema"] == "tyingspec.check/1" and data["diagnosis"] == "input_path_missing"
    from tyingspec import build, standard_cases

    for case, row in zip(standard_cases(0), data["cases"]):
        if row["status"] == "wrong":
            tokens = sorted(set(build(case).tokens.tolist()))
            assert row["wrong_rows"] == tokens, case.name
            assert row["rows_exact"] == case.V - len(tokens)
            for key in ("seed", "V", "d", "N", "rows_total", "rows_wrong", "max_abs_error",
                        "max_rel_error"):
                assert key in row


def test_duplicates_variant_names_the_repeated_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "check", "duplicates-buffered", "--case", "repeated-tokens")
    assert code == 1
    m = re.search(r"wrong rows are repeated tokens ([^)]*\)(?:, [^)]*\))*)", out)
    assert m and "duplicates not accumulated" in out
    assert "smallest failing batch: tokens=[" in out


@pytest.mark.parametrize("kind", ["model", "kernel"])
def test_correct_builtin_exits_0(capsys: pytest.CaptureFixture[str], kind: str) -> None:
    code, out = _run(capsys, "check", "tied", "--kind", kind)
    assert code == 0, out
    assert "verdict: correct" in out


def test_main_runs_where_stderr_is_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # A notebook, or a test capturing sys.stderr: main() still runs, without its crash handler.
    import faulthandler
    import io

    monkeypatch.setattr(faulthandler, "is_enabled", lambda: False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert main(["check", "tied", "--case", "absent-tokens"]) == 0
    assert "verdict: correct" in sys.stdout.getvalue()


def test_replay_line_reproduces_the_shrunk_failure(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _run(capsys, "check", "duplicates-buffered", "--case", "one-token-repeated")
    replay = re.search(r"replay: (tyingspec check .*)", out)
    assert replay
    argv = replay.group(1).split()[1:]
    code, out2 = _run(capsys, *argv)
    assert code == 1 and "duplicates not accumulated" in out2
    assert re.search(r"N=2 ", out2)


#: adapters that fail in every case (a transposed dE would be a wrong gradient, exit 1, in a
#: case where V == d: a wrong case outranks an adapter error)
BAD_ADAPTERS = {
    "raises": ("def f(E, W, b, tokens, targets, *, res, s_in):\n"
               "    raise RuntimeError('kernel launch failed')\n",
               "RuntimeError: kernel launch failed"),
    "shape": ("import numpy as np\n"
              "def f(E, W, b, tokens, targets, *, res, s_in):\n"
              "    return {'loss': 0.0, 'dE': np.zeros((E.shape[0], E.shape[1] + 1)), "
              "'dW': np.zeros_like(W), 'db': None if b is None else np.zeros_like(b)}\n",
              "wrong shape"),
    "nan": ("import numpy as np\n"
            "def f(E, W, b, tokens, targets, *, res, s_in):\n"
            "    return {'loss': 0.0, 'dE': np.full(E.shape, np.nan), 'dW': np.zeros_like(W), "
            "'db': None if b is None else np.zeros_like(b)}\n", "non-finite"),
}


@pytest.mark.parametrize("which", sorted(BAD_ADAPTERS))
def test_bad_adapters_exit_2_saying_which_and_why(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        which: str) -> None:
    source, words = BAD_ADAPTERS[which]
    mod = f"bad_adapter_{which}"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = _run(capsys, "check", f"{mod}:f")
    assert code == 2
    assert f"adapter '{mod}:f'" in out and words in out
    assert "ADAPTER ERROR" in out
    sys.modules.pop(mod, None)


def test_unimportable_target_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "check", "no_such_pkg_abc.sub:f")
    assert code == 2 and "cannot be imported" in out and "ModuleNotFoundError" in out


@pytest.mark.parametrize("argv", [["check", "tied", "--tokens", "1,2"],
                                  ["check", "tied", "--seed", "-3"],
                                  ["check", "tied", "--case", "nope"],
                                  ["check", "tied", "--kind", "banana"]])
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_module_targets_are_found_from_the_current_directory(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cwd_adapter_mod.py").write_text(
        "from tyingspec._src.kinds.probe.builtins import REGISTRY\nf = REGISTRY['tied'].model\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    code, out = _run(capsys, "check", "cwd_adapter_mod:f")
    assert code == 0, out
    sys.modules.pop("cwd_adapter_mod", None)


@pytest.mark.parametrize("name", ["copy-tie", "grad-not-zeroed"])
def test_bugs_that_only_show_after_a_step_are_caught_on_the_second_call(
        capsys: pytest.CaptureFixture[str], name: str) -> None:
    from tyingspec._src.kinds.probe.mutants import reset_state

    reset_state()
    code, out = _run(capsys, "check", name, "--case", "absent-tokens")
    assert code == 1
    assert "diagnosis (after one SGD step of E with the returned dE)" in out


def test_a_json_report_into_a_fifo_writes_into_it_and_leaves_it_a_fifo(tmp_path: Path) -> None:
    """``--json /dev/null`` (or a pipe): a device or FIFO is written into, never renamed over
    (that once turned /dev/null into a regular file for the whole machine).  A FIFO here, not
    /dev/null itself: a regression must not break the machine it runs on."""
    import os
    import stat
    import threading

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text(encoding="utf-8")))
    reader.start()
    try:
        code = main(["check", "--json", str(fifo)])
    finally:
        if reader.is_alive():  # nothing opened it for writing: let the reader go
            with open(fifo, "w", encoding="utf-8"):
                pass
        reader.join(timeout=30)
    assert code == 0  # the built-in demo: every variant as expected
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    report = json.loads(got[0])
    assert report["exit_code"] == 0 and report["as_expected"] is True
    assert not [p.name for p in tmp_path.iterdir() if p.name != "report.fifo"]  # no temp left


def test_a_check_imports_no_other_subcommands_code() -> None:
    """Each subcommand's arguments come from its own code; a ``check`` configures only its
    own, so it starts its worker without importing the experiments (0.1 s), and every other
    subcommand still parses its arguments and shows in the help."""
    import subprocess

    probe = textwrap.dedent("""
        import sys
        from tyingspec._src.front import cli
        cli.build_parser(cli._command(sys.argv[1:]))
        print(sorted(m for m in sys.modules if m.startswith(("tyingspec._src.reproduce",
                                                             "tyingspec._src.ckpt",
                                                             "tyingspec._src.front.kill"))))
    """)
    ran = subprocess.run([sys.executable, "-c", probe, "check", "tied"], capture_output=True,
                         text=True, check=True)
    assert ran.stdout.strip() == "[]", ran.stdout
    from tyingspec._src.front.cli import _command, build_parser

    assert _command(["check", "tied"]) == "check" and _command(["--help"]) is None
    args = build_parser(_command(["reproduce", "--all"])).parse_args(["reproduce", "--all"])
    assert args.command == "reproduce" and args.all
    help_text = build_parser("check").format_help()
    assert all(name in help_text for name in ("reproduce", "mutants", "ckpt"))


# --- a report written to this process's own stdout or stderr ---------------------------------

def _json_after(text: str) -> dict[str, object]:
    """The JSON document that starts at the first line holding only ``{``."""
    lines = text.splitlines()
    start = lines.index("{")
    loaded: dict[str, object] = json.loads("\n".join(lines[start:]))
    return loaded


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize(("where", "into"), [
    ("/dev/stdout", "file"), ("/dev/stdout", "pipe"), ("/dev/fd/1", "file"),
    ("/dev/stderr", "file"), ("the same file", "file")])
def test_a_report_to_stdout_lands_beside_the_human_report(tmp_path: Path, where: str,
                                                          into: str) -> None:
    """``--json /dev/stdout > log`` once left only the JSON in ``log`` (the path resolved to
    ``log``, and the report replaced it by rename); into a pipe it was not written at all (a
    temporary file under ``/proc/PID/fd/``).  Written through the descriptor, both land, the
    human report first."""
    import subprocess

    log = tmp_path / "log"
    stream = "stderr" if where == "/dev/stderr" else "stdout"
    path = str(log) if where == "the same file" else where
    argv = [sys.executable, "-m", "tyingspec", "check", "tied", "--case", "absent-tokens",
            "--json", path]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with open(log, "w") as fh:
        if into == "file":
            pipes[stream] = fh
        inode = os.fstat(fh.fileno()).st_ino
        ran = subprocess.run(argv, cwd=tmp_path, timeout=300, text=True, **pipes)
    text = log.read_text() if into == "file" else getattr(ran, stream)
    assert ran.returncode == 0, (text, ran.stderr, ran.stdout)
    if stream == "stdout":
        assert text.startswith("tyingspec check tied"), text[:500]
        assert "case absent-tokens" in text.split("\n{\n")[0]
    report = _json_after(text)
    assert report["schema"] == "tyingspec.check/1" and report["verdict"] == "correct"
    # written into the file the shell opened, never a new file renamed over it
    assert log.stat().st_ino == inode
