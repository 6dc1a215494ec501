"""Hostile and clumsy input: every row is an attack on a CI gate, with the exit status and the
message it must get.  Exit 0 only when every case reached a verdict and each was correct, 1 only
for a wrong gradient, 2 for usage and adapter errors; no result or file is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ADAPTERS = textwrap.dedent('''
    import os, sys, time
    from tyingspec._src.kinds.probe.builtins import REGISTRY
    _good = REGISTRY["tied"].model

    def ok(E, W, b, tokens, targets, *, res, s_in):
        return _good(E, W, b, tokens, targets, res=res, s_in=s_in)

    def system_exit_0(E, W, b, tokens, targets, *, res, s_in):
        raise SystemExit(0)

    def os_exit_0(E, W, b, tokens, targets, *, res, s_in):
        os._exit(0)

    def hangs(E, W, b, tokens, targets, *, res, s_in):
        time.sleep(3600)

    def segfaults(E, W, b, tokens, targets, *, res, s_in):
        import ctypes
        ctypes.string_at(0)

    def closes_stdout(E, W, b, tokens, targets, *, res, s_in):
        sys.stdout.close()
        return ok(E, W, b, tokens, targets, res=res, s_in=s_in)

    def chdirs(E, W, b, tokens, targets, *, res, s_in):
        os.chdir("/")
        return ok(E, W, b, tokens, targets, res=res, s_in=s_in)

    class _NoNumpy:
        def detach(self): return self
        def cpu(self): return self

    def db_without_numpy(E, W, b, tokens, targets, *, res, s_in):
        out = dict(ok(E, W, b, tokens, targets, res=res, s_in=s_in))
        out["db"] = _NoNumpy()
        return out

    def mixed_keys(E, W, b, tokens, targets, *, res, s_in):
        return {"loss": 1.0, 1: 2, "dW": 0}

    class _Exploding(dict):
        def __getitem__(self, key):
            raise RuntimeError("boom")

    def getitem_raises(E, W, b, tokens, targets, *, res, s_in):
        return _Exploding(ok(E, W, b, tokens, targets, res=res, s_in=s_in))

    def noise_on_v1(E, W, b, tokens, targets, *, res, s_in):
        out = dict(ok(E, W, b, tokens, targets, res=res, s_in=s_in))
        if E.shape[0] == 1:
            out["dE"] = out["dE"] + 1e-12
        return out
''')


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    (tmp_path / "adapters.py").write_text(ADAPTERS)
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "raising_getattr.py").write_text(
        "def __getattr__(name):\n    raise RuntimeError('lazy import failed')\n")
    return tmp_path


@pytest.fixture
def outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that records a missing baseline is a developer's first run, not CI's: under CI
    (which runs this suite with CI=true) a missing baseline fails the run instead (see
    tests/front/test_plugin_gate.py).  The subprocesses below inherit this environment."""
    monkeypatch.delenv("CI", raising=False)


#: The console scripts, as a user runs them (``python -m`` would put the current directory
#: first on sys.path for reasons of its own, not tyingspec's).
BIN = Path(sys.executable).parent


def tyingspec(repo: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "tyingspec"), "check", *args], cwd=repo,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ""})


ONE = ["--case", "absent-tokens"]

# (id, argv, exit status, words the output must contain)
ATTACKS = [
    ("system-exit-0", ["adapters:system_exit_0", *ONE], 2, ["SystemExit"]),
    ("os-exit-0", ["adapters:os_exit_0", *ONE], 2, ["exited with status 0"]),
    ("segfault", ["adapters:segfaults", *ONE], 2, ["SIGSEGV"]),
    ("hang", ["adapters:hangs", *ONE, "--timeout", "2"], 2, ["timed out after 2 s"]),
    ("exit-at-import", ["exits_at_import:f"], 2, ["import raised", "SystemExit"]),
    ("getattr-raises", ["raising_getattr:f"], 2, ["raised", "lazy import failed"]),
    ("closes-stdout", ["adapters:closes_stdout", *ONE], 0, ["verdict: correct"]),
    ("db-without-numpy", ["adapters:db_without_numpy", *ONE], 2,
     ["'db'", "cannot be converted"]),
    ("mixed-keys", ["adapters:mixed_keys", *ONE], 2, ["missing key", "'dE'"]),
    ("getitem-raises", ["adapters:getitem_raises", *ONE], 2, ["cannot be read", "boom"]),
    ("noise-without-power", ["adapters:noise_on_v1", "--case", "v-equals-1"], 1,
     ["diagnosis: unknown"]),
    ("list-with-target", ["tied", "--list"], 2, ["--list", "takes no TARGET"]),
    ("baseline-without-target", ["--baseline", "b.json"], 2, ["name the target"]),
    ("update-baseline-alone", ["tied", "--update-baseline"], 2, ["needs --baseline"]),
    ("empty-baseline", ["tied", "--baseline", ""], 2, ["empty string"]),
    ("empty-json", ["tied", "--json", ""], 2, ["empty string"]),
    ("json-into-missing-dir", ["tied", "--json", "no/such/dir/r.json"], 2, ["does not exist"]),
    ("json-is-a-dir", ["tied", "--json", "."], 2, ["directory"]),
    ("json-is-the-baseline", ["tied", "--json", "x.json", "--baseline", "x.json"], 2,
     ["same file"]),
]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("argv,code,words", [a[1:] for a in ATTACKS],
                         ids=[a[0] for a in ATTACKS])
def test_the_cli_gives_each_attack_its_exit_status_and_message(
        repo: Path, argv: list[str], code: int, words: list[str]) -> None:
    out = tyingspec(repo, *argv)
    text = out.stdout + out.stderr
    assert out.returncode == code, text[-3000:]
    for w in words:
        assert w in text, (w, text[-3000:])
    assert "Traceback" not in text, text[-3000:]


def test_a_builtin_target_never_imports_from_the_current_directory(repo: Path) -> None:
    (repo / "tempfile.py").write_text("raise SystemExit('local tempfile.py was imported')\n")
    out = tyingspec(repo, "tied", *ONE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: correct" in out.stdout


@pytest.mark.slow
@pytest.mark.moved
def test_a_crashing_case_does_not_stop_the_others(repo: Path) -> None:
    out = tyingspec(repo, "adapters:os_exit_0")
    assert out.returncode == 2
    assert out.stdout.count("ADAPTER ERROR") == 10, out.stdout  # every case ran, each reported


@pytest.mark.usefixtures("outside_ci")
def test_relative_outputs_are_resolved_before_the_adapter_changes_directory(repo: Path) -> None:
    out = tyingspec(repo, "adapters:chdirs", *ONE, "--json", "r.json", "--baseline", "b.json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((repo / "r.json").read_text())
    assert report["exit_code"] == 0 and report["baseline"]["exit_code"] == 0
    assert (repo / "b.json").exists()


@pytest.mark.usefixtures("outside_ci")
def test_json_carries_the_real_exit_code_and_the_baseline_result(repo: Path) -> None:
    assert tyingspec(repo, "tied", *ONE, "--baseline", "b.json").returncode == 0
    out = tyingspec(repo, "output-path-only", *ONE, "--baseline", "b.json", "--json", "r.json",
                    "--shrink-budget", "0")
    assert out.returncode == 1
    report = json.loads((repo / "r.json").read_text())
    assert report["exit_code"] == 1
    assert any("REGRESSION" in line for line in report["baseline"]["lines"])


@pytest.mark.usefixtures("outside_ci")
def test_a_baseline_through_a_symlink_keeps_the_link_and_the_mode(repo: Path) -> None:
    real = repo / "real.json"
    assert tyingspec(repo, "tied", *ONE, "--baseline", str(real)).returncode == 0
    real.chmod(0o640)
    (repo / "link.json").symlink_to(real)
    out = tyingspec(repo, "tied", *ONE, "--baseline", "link.json", "--update-baseline")
    assert out.returncode == 0, out.stdout
    assert (repo / "link.json").is_symlink()
    assert oct(real.stat().st_mode & 0o777) == oct(0o640)


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("details", ["[1, 2]", '"text"', "3", "[" * 100000 + "]" * 100000],
                         ids=["list", "string", "int", "nested-100000-deep"])
def test_a_malformed_baseline_is_a_usage_error_not_a_traceback(repo: Path, details: str) -> None:
    (repo / "b.json").write_text(
        '{"schema": "tyingspec.baseline/1", "unit": "case", "verdicts": {}, "details": '
        + details + "}")
    out = tyingspec(repo, "tied", *ONE, "--baseline", "b.json")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "baseline" in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_a_first_baseline_run_whose_target_cannot_load_records_nothing(repo: Path) -> None:
    out = tyingspec(repo, "exits_at_import:f", "--baseline", "b.json")
    assert out.returncode == 2
    assert "not recorded" in out.stdout and not (repo / "b.json").exists()


def test_seeds_keep_all_their_bits(repo: Path) -> None:
    from tyingspec._src.core.cases import case_seed

    assert case_seed(2**70, "absent-tokens") != case_seed(0, "absent-tokens")
    assert case_seed(2**70, "absent-tokens") != case_seed(2**70 + 1, "absent-tokens")


def run_plugin(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "pytest"), "-p", "no:cacheprovider",
                           "--tyingspec-max-examples=3", "-k", "sum_of_paths", *args],
                          cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})


PLUGIN_ATTACKS = [
    ("system-exit-0", ["--tyingspec-adapter=adapters:system_exit_0"], "SystemExit"),
    ("os-exit-0", ["--tyingspec-adapter=adapters:os_exit_0"], "exited with status 0"),
    ("segfault", ["--tyingspec-adapter=adapters:segfaults"], "SIGSEGV"),
    ("hang", ["--tyingspec-adapter=adapters:hangs", "--tyingspec-timeout=2"],
     "timed out after 2 s"),
]


@pytest.mark.usefixtures("outside_ci")
@pytest.mark.slow  # 8 pytest sessions: the CI slow tier runs them
@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["in-process", "xdist-n2"])
@pytest.mark.parametrize("argv,words", [a[1:] for a in PLUGIN_ATTACKS],
                         ids=[a[0] for a in PLUGIN_ATTACKS])
def test_the_plugin_fails_each_attack_as_an_adapter_error(
        repo: Path, argv: list[str], words: str, xdist: list[str]) -> None:
    out = run_plugin(repo, *argv, *xdist, "--tyingspec-baseline=b.json")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert words in text and "adapter_error" in text, text[-3000:]


def test_the_plugin_refuses_a_summary_that_is_the_baseline(repo: Path) -> None:
    out = run_plugin(repo, "--tyingspec-adapter=adapters:ok", "--tyingspec-baseline=x.json",
                     "--tyingspec-summary=x.json")
    assert out.returncode == 4, out.stdout + out.stderr  # pytest's usage error
    assert "same file" in out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.moved
def test_the_plugin_accepts_a_non_ascii_target(repo: Path) -> None:
    (repo / "pädagogik.py").write_text(ADAPTERS)
    out = run_plugin(repo, "--tyingspec-adapter=pädagogik:ok")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_a_failed_report_write_keeps_the_previous_report_and_exits_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from tyingspec._src.core import files as _files
    from tyingspec._src.front.cli import main

    report = tmp_path / "r.json"
    assert main(["check", "tied", *ONE, "--json", str(report)]) == 0
    before = report.read_text()

    def full_disk(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files.os, "replace", full_disk)
    assert main(["check", "tied", *ONE, "--json", str(report)]) == 2
    err = capsys.readouterr().err
    assert "was not written" in err and "No space left" in err
    assert report.read_text() == before  # whole and valid, not half a file
    json.loads(before)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left behind


def test_two_first_runs_cannot_both_record_a_baseline(tmp_path: Path) -> None:
    from tyingspec._src.front.baseline import Baseline, gate

    path = str(tmp_path / "b.json")
    first = Baseline("case", "t", "model", {"a": "passed"})
    second = Baseline("case", "t", "model", {"a": "failed"})
    from tyingspec._src.core import files as _files

    assert _files.create_exclusive(path, "{}") is True
    assert _files.create_exclusive(path, "{}") is False  # the loser sees the winner's file
    Path(path).unlink()
    assert gate(path, first, update=False).action == "recorded"
    result = gate(path, second, update=False)
    assert result.action == "compared" and result.failed  # compared, never re-recorded


def test_a_reader_that_goes_away_never_turns_a_run_into_a_pass(repo: Path) -> None:
    # `tyingspec check ... | head -1`: the pipe closes after the first line, while the worker
    # process still starts (so the cases are printed into a closed pipe)
    proc = subprocess.Popen([str(BIN / "tyingspec"), "check", "adapters:ok"], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert b"Traceback" not in err
