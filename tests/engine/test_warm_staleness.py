"""``tyingspec.check`` keeps its worker for the next check only while what the worker's code came
from is what is on disk now (issue 50 §1): a sibling module edited under its old mtime, the
target replaced by a copy that keeps an old mtime (``cp -p``), a config file the target reads as
it imports.  Each is checked in both directions (a correct kernel broken, a broken one fixed):
the second check's verdict is the code's as it is now, never the kept worker's."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import tyingspec
from tyingspec._src.engine.warm import WARM

#: The kernel kind's contract, its input path written by ``input_path`` (right or dropped).
TARGET = '''
import numpy as np
{imports}


def kernel(tokens, dx, h, g, vocab_size):
    dE = g.T @ h
    {body}
    return dE
'''
RIGHT = "np.add.at(dE, np.asarray(tokens).reshape(-1), dx.reshape(len(tokens), -1))"
# a different size: Python's own check of its cached bytecode is by mtime and size, so an edit
# that kept both would run the old bytecode in any interpreter, a fresh worker included
WRONG = "pass  # the input path dropped"
HELPER = '''
import numpy as np


def input_path(dE, tokens, dx):
    {body}
'''
CASE = "repeated-tokens"
DIRECTIONS = [("right", "wrong"), ("wrong", "right")]


@pytest.fixture()
def warm() -> Iterator[None]:
    WARM.close()
    yield
    WARM.close()


def _same_times(path: Path, like: os.stat_result) -> None:
    """Give ``path`` the access and modification times of ``like`` (what an editor, ``cp -p``
    or ``rsync -t`` may leave): only the bytes tell the two apart."""
    os.utime(path, ns=(like.st_atime_ns, like.st_mtime_ns))


def _verdicts(tmp_path: Path, module: str, set_up: Callable[[str], None], first: str,
              second: str) -> None:
    """Check ``module:kernel`` with the code ``set_up(first)`` leaves on disk, then, with the
    worker kept, with what ``set_up(second)`` leaves: each verdict is that code's."""
    spec, paths = f"{module}:kernel", [str(tmp_path)]
    for version in (first, second):
        set_up(version)
        report = tyingspec.check(spec, "kernel", case=CASE, paths=paths)
        if version == "right":
            assert report.ok and report.exit_code == 0, (version, report.diagnosis)
        else:
            assert not report.ok and report.exit_code == 1, (version, report.diagnosis)
            assert report.diagnosis_label == "input_path_missing", report.diagnosis
        assert len(WARM) == 1  # the worker kept for the next check (a fresh one if it changed)


@pytest.mark.parametrize("first,second", DIRECTIONS)
def test_a_sibling_helper_edited_under_its_old_mtime_is_the_code_checked_next(
        tmp_path: Path, warm: None, first: str, second: str) -> None:
    (tmp_path / "staleness_sibling.py").write_text(TARGET.format(
        imports="from staleness_helper import input_path", body="input_path(dE, tokens, dx)"))
    helper = tmp_path / "staleness_helper.py"
    before: list[os.stat_result] = []

    def set_up(version: str) -> None:
        helper.write_text(HELPER.format(body=RIGHT if version == "right" else WRONG))
        if before:
            _same_times(helper, before[0])
        before.append(helper.stat())

    _verdicts(tmp_path, "staleness_sibling", set_up, first, second)
    assert before[0].st_mtime_ns == before[1].st_mtime_ns


@pytest.mark.parametrize("first,second", DIRECTIONS)
def test_the_target_replaced_by_a_copy_with_the_old_mtime_is_the_code_checked_next(
        tmp_path: Path, warm: None, first: str, second: str) -> None:
    kept = tmp_path / "versions"
    kept.mkdir()
    for version, body in (("right", RIGHT), ("wrong", WRONG)):
        (kept / f"{version}.py").write_text(TARGET.format(imports="", body=body))
    like = (kept / "right.py").stat()
    _same_times(kept / "wrong.py", like)  # both versions from one checkout, one mtime
    target = tmp_path / "staleness_copied.py"

    def set_up(version: str) -> None:
        shutil.copy2(kept / f"{version}.py", target)  # cp -p

    _verdicts(tmp_path, "staleness_copied", set_up, first, second)
    assert target.stat().st_mtime_ns == like.st_mtime_ns


@pytest.mark.parametrize("first,second", DIRECTIONS)
def test_a_config_file_read_at_import_changed_is_the_code_checked_next(
        tmp_path: Path, warm: None, first: str, second: str) -> None:
    (tmp_path / "staleness_config.py").write_text(TARGET.format(
        imports="import json, os\nCONFIG = json.load(open(os.path.join(os.path.dirname("
                "__file__), 'kernel.json')))",
        body=f"if CONFIG['input_path']:\n        {RIGHT}"))
    config = tmp_path / "kernel.json"
    before: list[os.stat_result] = []

    def set_up(version: str) -> None:
        config.write_text(json.dumps({"input_path": version == "right"}))
        if before:
            _same_times(config, before[0])
        before.append(config.stat())

    _verdicts(tmp_path, "staleness_config", set_up, first, second)


def test_an_unchanged_target_keeps_its_worker_and_a_file_it_writes_does_not_count(
        tmp_path: Path, warm: None) -> None:
    # the worker is reused as long as nothing it read changed: a log the target appends to at
    # every call is what it writes, not what its code came from
    (tmp_path / "staleness_logger.py").write_text(TARGET.format(
        imports="import os\nLOG = os.path.join(os.path.dirname(__file__), 'calls.log')",
        body=f"{RIGHT}\n    open(LOG, 'a').write('called\\n')"))
    spec, paths = "staleness_logger:kernel", [str(tmp_path)]
    pids = []
    for _ in range(2):
        assert tyingspec.check(spec, "kernel", case=CASE, paths=paths).ok
        (target,) = WARM._kept.values()
        assert target.worker is not None and target.worker._proc is not None
        pids.append(target.worker._proc.pid)
        assert set(target.worker.sources) == {str(tmp_path / "staleness_logger.py")}
    assert pids[0] == pids[1]
    assert (tmp_path / "calls.log").read_text().count("called") >= 2


def test_a_large_file_rewritten_under_its_old_mtime_is_a_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a file too large to hash at every check (a checkpoint read at import) is keyed on its
    # inode, size and times: the change time, which no os.utime sets, tells the rewrite
    import time

    import tyingspec._src.engine.isolation as iso

    monkeypatch.setattr(iso, "HASH_BELOW", 16)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"0" * 32)
    before = weights.stat()
    was = iso.digest(str(weights))
    assert was is not None and was.startswith("stat:") and iso.unchanged({str(weights): was})
    time.sleep(0.05)  # past a tick of the kernel's coarse clock, which stamps the change time
    with weights.open("r+b") as f:
        f.write(b"1")
    _same_times(weights, before)
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    assert weights.stat().st_size == before.st_size
    assert not iso.unchanged({str(weights): was})
