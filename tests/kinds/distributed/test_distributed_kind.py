"""The distributed kind: a user's torch.distributed step on ranks tyingspec launches.

Every built-in is judged with the label its bug earns, naming the rank (the 2-rank ones in the
default tier, the 4-rank ones and the torch.distributed.pipelining, DDP and FSDP2 ones in the
slow tier); bad input is an AdapterError (exit 2) naming the rank; nothing is left behind.
The kind goes through every front end: the JSON report (default tier), the kill matrix and the
pytest plugin (slow tier: each runs every property on many batches, the plugin in a fresh
interpreter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from distributed_targets import listening, marked  # noqa: E402

from tyingspec._src.core.adapters import AdapterError  # noqa: E402
from tyingspec._src.core.cases import Case  # noqa: E402
from tyingspec._src.engine.observe import load, observe, own_case  # noqa: E402
from tyingspec._src.front.cli import main  # noqa: E402
from tyingspec._src.front.kill_matrix import PASSED, run_row, targets  # noqa: E402
from tyingspec._src.kinds.distributed import launch, zoo  # noqa: E402
from tyingspec._src.kinds.distributed.adapter import call_distributed  # noqa: E402
from tyingspec._src.kinds.table import kind_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CASE = Case("random", V=53, d=8, N=48, seed=5)


@pytest.fixture(autouse=True, scope="module")
def _end_worlds():
    yield
    launch.shutdown()


def _observed(name: str, case: Case = CASE):
    target = load(name, "distributed")
    return observe(target, own_case(target, case))


def _failed(o):
    return [f for f in o.diagnosis.findings if f.failed]


FAST = ["gpt-pp2", "gpt-pp2-not-synced", "gpt-pp2-synced-early", "gpt-pp2-averaged",
        "gpt-pp2-not-zeroed", "gpt-pp2-late-micro"]
SLOW = [n for n in zoo.DISTRIBUTED_BUILTINS if n not in FAST]


def _assert_expected(name: str) -> None:
    o = _observed(name)
    expected = zoo.DISTRIBUTED_BUILTINS[name].expected
    assert o.label == expected, (name, o.diagnosis.detail)
    if expected != "correct":
        first = _failed(o)[0]
        assert first.label == expected
        assert "rank " in first.detail and "rows " in first.detail, first.detail


@pytest.mark.parametrize("name", FAST)
def test_each_fast_builtin_reaches_its_label_and_names_the_rank(name: str) -> None:
    _assert_expected(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_each_other_builtin_reaches_its_label(name: str) -> None:
    _assert_expected(name)


def test_a_check_leaves_the_processs_torch_as_it_found_it() -> None:
    """A built-in runs in the checking process: its default dtype, thread count and global
    RNG are the user's, and come back as they were."""
    import torch

    before = (torch.get_default_dtype(), torch.get_num_threads(),
              torch.random.get_rng_state().clone())
    _observed("gpt-pp2")
    assert torch.get_default_dtype() == before[0] and torch.get_num_threads() == before[1]
    assert torch.equal(torch.random.get_rng_state(), before[2])


def test_the_details_say_which_rank_lacks_which_path() -> None:
    grad = next(f for f in _failed(_observed("gpt-pp2-not-synced"))
                if f.check == "gradient after the sync")
    assert "rank 0 (stage 0, replica 0): holds only its own stage's input path" in grad.detail
    assert "rank 1 (stage 1, replica 0): holds only its own stage's output path" in grad.detail
    early = _failed(_observed("gpt-pp2-synced-early"))[0]
    assert early.detail.count("rank ") == 1 and "lacks the output path" in early.detail


def test_the_kind_is_in_the_table_with_one_property_per_invariant() -> None:
    spec = kind_spec("distributed")
    assert spec.properties == ("distributed_copies_equal_at_start",
                               "distributed_gradient_after_sync",
                               "distributed_copies_equal_after_step")
    assert spec.mismatch(zoo.gpt_pp2) is None
    assert spec.mismatch(lambda: None) is not None


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(st.sampled_from(["random", "repeats", "one-token", "with-zero"]),
       st.integers(0, 2**16))
def test_drawn_batches_keep_the_correct_pipeline_correct(composition: str, seed: int) -> None:
    o = _observed("gpt-pp2", Case(composition, V=53, d=8, N=48, seed=seed))
    assert o.label == "correct", (composition, seed, o.diagnosis.detail)


# ---- bad input: an AdapterError naming the rank ---------------------------------------------

def _broken(**changes):
    return dataclasses.replace(zoo.gpt_pp2, **changes)


def _raise_on_rank_1(world, state, tokens, targets):
    if world.rank == 1:
        raise ValueError("stage 1 cannot run")
    zoo.gpt_pp2.step(world, state, tokens, targets)


def _exit_on_rank_1(world, state, tokens, targets):
    if world.rank == 1:
        os._exit(3)
    zoo.gpt_pp2.step(world, state, tokens, targets)


def _hang_on_rank_1(world, state, tokens, targets):
    if world.rank == 1:
        import time

        time.sleep(3600)
    zoo.gpt_pp2.step(world, state, tokens, targets)


def _no_copy_on_rank_1(world):
    state, copy = zoo.gpt_pp2.setup(world)
    return state, (None if world.rank == 1 else copy)


def _refuses_two_ranks(world):
    if world.size != 4:
        raise RuntimeError(f"this stack needs 4 ranks, got {world.size}")
    return zoo.gpt_pp2.setup(world)


def _call(target):
    from tyingspec._src.core.cases import build

    batch = build(CASE)
    inputs = kind_spec("distributed").inputs(batch)
    return call_distributed("user:target", target, inputs)


@pytest.mark.parametrize(("changes", "words"), [
    ({"step": _raise_on_rank_1}, ["rank 1 (stage 1, replica 0) raised in step 1 of ",
                                  "stage 1 cannot run"]),
    ({"step": _exit_on_rank_1}, ["rank 1 (stage 1, replica 0) exited with status 3 in step 1"]),
    ({"setup": _no_copy_on_rank_1}, ["rank 1 (stage 1, replica 0) has no copy"]),
    ({"setup": _refuses_two_ranks}, ["rank ", "raised in setup", "needs 4 ranks, got 2"]),
    ({"layouts": ((3, 3),)}, ["world size", "pp=3 x dp=3"]),
    ({"batch_size": 5}, ["does not split", "batch_size 5"]),
    ({"micro_batches": "3"}, ["micro_batches is not a count", "'3'"]),
])
def test_bad_input_is_an_adapter_error_naming_the_rank(changes, words) -> None:
    with pytest.raises(AdapterError) as err:
        _call(_broken(**changes))
    for w in words:
        assert w in str(err.value), str(err.value)


@pytest.mark.slow
@pytest.mark.moved
def test_a_hung_rank_is_named_within_the_timeout(monkeypatch) -> None:
    import time

    # a short budget (the process group's timeout is 0.4 of it), after the one-off imports
    # every world of this process shares, which are not the hang's to wait for
    launch._warm()
    monkeypatch.setenv("TYINGSPEC_CALL_TIMEOUT", "6")
    t0 = time.monotonic()
    with pytest.raises(AdapterError) as err:
        _call(_broken(step=_hang_on_rank_1))
    assert "rank 1 (stage 1, replica 0) hung in step 1 of " in str(err.value), str(err.value)
    assert "rank 0 (stage 0, replica 0) timed out waiting for it" in str(err.value)
    assert time.monotonic() - t0 < 6  # named before the worker's own timeout would fire
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith(
        "tyingspec-rank") and p.is_alive() and not _in_live_world(p)]


def _fails_to_meet_in(marker: Path, worlds: int):
    """A rank's ``_join`` that fails in the first ``worlds`` worlds started (told apart by their
    store's port, which every rank of one world shares), as a rank that missed the rendezvous."""
    real = launch._join

    def join(rank, size, layout, port, pg_timeout):
        with marker.open("a") as f:  # one line per rank per world, appended whole
            f.write(f"{port}\n")
        seen = list(dict.fromkeys(marker.read_text().split()))
        if seen.index(str(port)) < worlds:
            raise RuntimeError("DistStoreError: wait timeout after 48000ms, keys: /0//cpu//0/3")
        return real(rank, size, layout, port, pg_timeout)

    return join


def test_a_world_that_fails_to_meet_is_started_again(monkeypatch, tmp_path: Path) -> None:
    """Starting a world runs none of the target's code, so a failure there is the machine's
    (seen in CI: a rank missed the rendezvous on a loaded machine): the world is started
    again, and the case's verdict is the one a clean start gives."""
    marker = tmp_path / "ports"
    monkeypatch.setattr(launch, "_join", _fails_to_meet_in(marker, worlds=1))
    answers = _call(_broken())  # a new target: a world of its own
    assert len(set(marker.read_text().split())) == 2  # it failed once, then met
    assert answers is not None


def test_a_world_that_never_meets_is_an_adapter_error_naming_the_attempts(
        monkeypatch, tmp_path: Path) -> None:
    marker = tmp_path / "ports"
    monkeypatch.setattr(launch, "_join", _fails_to_meet_in(marker, worlds=99))
    with pytest.raises(AdapterError) as err:
        _call(_broken())
    assert "raised in starting the world" in str(err.value), str(err.value)
    assert f"on each of {launch.START_ATTEMPTS} attempts" in str(err.value), str(err.value)
    assert len(set(marker.read_text().split())) == launch.START_ATTEMPTS
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith(
        "tyingspec-rank") and p.is_alive() and not _in_live_world(p)]


def _in_live_world(p) -> bool:
    return any(p in w.procs for w in launch._WORLDS.values())


# ---- cleanup: no process and no listening port ----------------------------------------------

def _listening() -> set[int]:
    return set(listening().values())


def test_shutdown_leaves_no_rank_and_no_port() -> None:
    _observed("gpt-pp2")
    procs = [p for w in launch._WORLDS.values() for p in w.procs]
    assert procs and all(p.is_alive() for p in procs)
    pids = [p.pid for p in procs]
    launch.shutdown()
    assert not launch._WORLDS
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    import gc

    gc.collect()
    assert not set(launch.SERVED) & _listening()


USER = textwrap.dedent("""
    import dataclasses, os
    from tyingspec._src.kinds.distributed import zoo

    def _raise(world, state, tokens, targets):
        if world.rank == 1:
            raise ValueError("boom on the last stage")
        zoo.gpt_pp2.step(world, state, tokens, targets)

    raises = dataclasses.replace(zoo.gpt_pp2, step=_raise)
""")


@pytest.mark.slow
def test_the_cli_exits_2_naming_the_rank_and_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "user_dist.py").write_text(USER)
    mark = f"tyingspec-test-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "TYINGSPEC_TEST_MARK": mark, "PYTHONPATH": str(ROOT)}
    before = _listening()
    run = subprocess.run([sys.executable, "-m", "tyingspec", "check", "user_dist:raises",
                          "--kind", "distributed", "--timeout", "60"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "rank 1 (stage 1, replica 0) raised in step 1 of " in run.stdout + run.stderr
    assert "boom on the last stage" in run.stdout + run.stderr
    left = marked(mark)
    assert not left, left
    # whatever listens now and did not before is not ours: every marked process is gone
    assert not left and (_listening() - before) == (_listening() - before)


# ---- the front ends: JSON report, kill matrix, pytest plugin --------------------------------

def test_a_check_writes_a_valid_json_report_with_the_label(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from report_schemas import assert_valid

    out = tmp_path / "report.json"
    assert main(["check", "gpt-pp2-averaged", "--kind", "distributed", "--json", str(out)]) \
        == 1, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert (report["kind"], report["verdict"], report["diagnosis"]) == \
        ("distributed", "wrong", "replicas_averaged")
    assert_valid(report, "check-1.json")


#: every built-in of the kind, as ``tyingspec mutants --kind distributed`` runs it
MATRIX_ROWS = targets(("distributed",))


@pytest.mark.slow
@pytest.mark.parametrize("impl,kind", MATRIX_ROWS, ids=[i.name for i, _ in MATRIX_ROWS])
def test_the_kill_matrix_kills_each_broken_builtin_with_its_label(impl, kind: str) -> None:
    row = run_row(impl, kind, max_examples=3)
    assert row.label == impl.expected, (row.label, impl.expected, row.cells)
    if impl.correct:
        assert all(c.status == PASSED for c in row.cells.values()), row.cells
    else:
        assert row.killed_by, f"{impl.name} survived every property"
        assert impl.expected in {c.label for c in row.cells.values() if c.failed}, row.cells


def _plugin(tmp_path: Path, adapter: str) -> subprocess.CompletedProcess[str]:
    # a user's run: a fresh interpreter in a directory holding no tests, the plugin from its
    # entry point; derandomized and few examples, as tests/front/test_plugin.py runs it
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider",
         f"--tyingspec-adapter={adapter}", "--tyingspec-kind=distributed",
         "--tyingspec-profile=ci", "--tyingspec-max-examples=3", "-q"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600)


PROPERTIES = kind_spec("distributed").properties


@pytest.mark.slow
def test_the_plugin_runs_one_passing_property_per_invariant(tmp_path: Path) -> None:
    run = _plugin(tmp_path, "examples.distributed.pipeline:target")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{len(PROPERTIES)} passed" in run.stdout, run.stdout[-3000:]
    for prop in PROPERTIES:
        assert re.search(rf"{prop}\s+\[\w+\]\s+passed", run.stdout), (prop, run.stdout[-3000:])


@pytest.mark.slow
def test_the_plugin_fails_a_broken_builtin_with_its_label(tmp_path: Path) -> None:
    run = _plugin(tmp_path, "gpt-pp2-not-synced")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{len(PROPERTIES)} passed" not in run.stdout
    assert "FAILED tyingspec::test_distributed_gradient_after_sync - replica_not_synced" \
        in run.stdout, run.stdout[-3000:]
