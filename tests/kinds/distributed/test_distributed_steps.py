"""The distributed kind past one step, one group and two micro-batches (issue 50, section 3).

Each case runs several steps on one setup, each judged against its own reference, so a step
that never zeroes its gradients is named ``gradient_not_zeroed``; the default layouts hold one
whose embedding group is not the world (pp=2 x dp=2) and one whose middle stage holds no copy
(pp=3), so a sum over the world group is caught; the micro-batch count is drawn from three
up, so a head wgrad deferred from the third micro-batch on is caught; a rank that fails is
named with its phase (setup, step k of n, the reference), and a Ctrl-C ends the command with
one line and status 130, leaving no process and no port.

The wrong targets are users' code in ``tests/distributed_targets.py``; every world is gloo on
127.0.0.1 at ports the kernel picks, and each test ends the worlds it started.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import distributed_targets as users  # noqa: E402

from tyingspec._src.core.adapters import AdapterError  # noqa: E402
from tyingspec._src.core.cases import Case, build  # noqa: E402
from tyingspec._src.core.tolerance import row_tolerance  # noqa: E402
from tyingspec._src.kinds.distributed import judge, launch, zoo  # noqa: E402
from tyingspec._src.kinds.distributed.adapter import call_distributed  # noqa: E402
from tyingspec._src.kinds.distributed.target import (  # noqa: E402
    DEFAULT_LAYOUTS,
    DEFAULT_MICRO_BATCHES,
)
from tyingspec._src.kinds.table import kind_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PP2 = ((2, 1),)


@pytest.fixture(autouse=True)
def _end_worlds():
    yield
    launch.shutdown()


def _findings(target, seed: int = 5):
    """The three findings of one case of ``target`` (its own batch shape)."""
    N = target.batch_size * target.seq_len
    batch = build(Case("random", V=users.V, d=users.D, N=N, seed=seed))
    return call_distributed("user:target", target, kind_spec("distributed").inputs(batch)
                            ).findings


def _grad_finding(target, seed: int = 5):
    return next(f for f in _findings(target, seed) if f.check == judge.CHECK_GRAD)


# ---- 1. several steps on one setup ------------------------------------------------------------

def test_a_step_that_never_zeroes_its_gradients_is_named_gradient_not_zeroed() -> None:
    grad = _grad_finding(users.target(users.never_zeroed_step, layouts=PP2))
    assert grad.failed and grad.label == "gradient_not_zeroed", grad.detail
    assert "step 2 of" in grad.detail and "rank 0 (stage 0, replica 0)" in grad.detail
    # the sync summed the two copies, each carrying the last step's sum: twice it
    assert "plus 2x its gradient of the step before" in grad.detail, grad.detail


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_the_right_step_passes_every_step_with_an_optimizer_that_keeps_state(seed: int
                                                                             ) -> None:
    """Each later step starts from setup's parameters (momentum SGD's buffers are left): its
    gradient has a reference of its own, so a right step is right at every step."""
    found = _findings(users.target(layouts=PP2), seed)
    assert not [f for f in found if f.failed], [f.detail for f in found]
    grad = next(f for f in found if f.check == judge.CHECK_GRAD)
    steps = int(grad.detail.split(" steps on one setup")[0].rsplit(" ", 1)[1])
    assert 2 <= steps <= 4, grad.detail


def test_the_second_steps_gradient_is_judged_against_its_own_reference() -> None:
    """A sync skipped from the second call on leaves each stage its own path at step 2: the
    label of that step's rows, not a carried gradient's."""
    grad = _grad_finding(users.target(users.second_step_unsynced, layouts=PP2))
    assert grad.failed and grad.label == "replica_not_synced", grad.detail
    assert "step 2 of" in grad.detail


def test_the_step_count_is_drawn_from_the_seed_and_is_at_least_two() -> None:
    from tyingspec._src.kinds.distributed.adapter import STEPS, _draws

    tokens = np.zeros((12, 4), dtype=np.int64)
    drawn = {len(_draws(seed, [(3, 4)], tokens, tokens, 37)[1]) for seed in range(40)}
    assert drawn == set(STEPS) and min(STEPS) >= 2
    again = _draws(11, [(3, 4)], tokens, tokens, 37)
    first = _draws(11, [(3, 4)], tokens, tokens, 37)
    assert again[0] == first[0] and all(
        (a[0] == b[0]).all() for a, b in zip(again[1], first[1]))


def test_a_carried_gradient_is_told_from_a_wrong_one() -> None:
    """The judge alone: G2 + c * previous is ``gradient_not_zeroed``; without a previous step,
    or with a gradient that is no such sum, it is not."""
    rng = np.random.default_rng(0)
    V, d = 11, 3
    parts = [judge.Part(0, 0, path, rng.normal(size=(V, d))) for path in ("input", "output")]
    G = parts[0].value + parts[1].value
    before = rng.normal(size=(V, d))
    tol = row_tolerance(judge.terms(parts, 8), "float64")
    stale = {0: G + before, 1: G + before}
    verdict, _ = judge.gradient_check(stale, parts, tol, 2, 1, {0: before, 1: before})
    assert verdict.label == "gradient_not_zeroed", verdict.detail
    verdict, _ = judge.gradient_check(stale, parts, tol, 2, 1, None)
    assert verdict.label != "gradient_not_zeroed"
    other = {0: G + rng.normal(size=(V, d)), 1: G}
    verdict, _ = judge.gradient_check(other, parts, tol, 2, 1, {0: before, 1: before})
    assert verdict.label not in (None, "gradient_not_zeroed"), verdict.detail


# ---- 2. more than the world group -----------------------------------------------------------

def test_the_default_layouts_hold_a_separate_embedding_group_and_a_middle_stage() -> None:
    assert any(pp >= 2 and dp >= 2 for pp, dp in DEFAULT_LAYOUTS)
    assert any(pp >= 3 for pp, _ in DEFAULT_LAYOUTS)
    assert users.target().layouts == DEFAULT_LAYOUTS


def test_a_right_pipeline_passes_every_default_layout() -> None:
    found = _findings(users.target())
    assert not [f for f in found if f.failed], [f.detail for f in found]
    grad = next(f for f in found if f.check == judge.CHECK_GRAD)
    for pp, dp in DEFAULT_LAYOUTS:
        assert f"pp={pp} x dp={dp}" in grad.detail, grad.detail


def test_a_sum_over_the_world_group_fails_under_the_default_layouts() -> None:
    """Where pp=2 x dp=1 the world is the embedding group and this is right; on pp=2 x dp=2
    the world holds four copies, so each holds twice the tied gradient."""
    assert not _grad_finding(users.target(users.world_group_step, layouts=PP2)).failed
    grad = _grad_finding(users.target(users.world_group_step))
    assert grad.failed and grad.label == "path_scaled", grad.detail
    assert grad.detail.startswith("pp=2 x dp=2") and "times 2" in grad.detail, grad.detail


def _member_setup(world):
    import torch.distributed as dist

    state, copy = users.setup(world)
    state["member"] = dist.get_rank(world.embedding_group) >= 0
    return state, copy


def _middle_checks_step(world, state, tokens, targets):
    if world.stage not in (0, world.pp - 1):
        assert not state["member"] and state["copy"] is None, "a middle stage in the group"
    users.step(world, state, tokens, targets)


def test_a_middle_stage_holds_no_copy_and_is_not_in_the_embedding_group() -> None:
    """On pp=3 the middle stage's collectives on the embedding group are no part of the
    copies' sum (a rank whose assertion fails raises, and the call with it)."""
    target = users.target(_middle_checks_step, setup=_member_setup, layouts=((3, 1),))
    assert not [f for f in _findings(target) if f.failed]


#: the built-ins built as pipelines (DDP and FSDP2 are data-parallel only: pp=1)
PIPELINES = [n for n in zoo.DISTRIBUTED_BUILTINS if "ddp" not in n and "fsdp" not in n]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("name", PIPELINES)
def test_each_pipeline_builtin_keeps_its_label_on_the_default_layouts(name: str) -> None:
    """The zoo's pipelines run on any number of stages: on pp=2, pp=2 x dp=2 and pp=3 each
    still reaches the label it is listed with (a bug that needs dp=2 on the second)."""
    entry = zoo.DISTRIBUTED_BUILTINS[name]
    target = dataclasses.replace(getattr(zoo, entry.attr), layouts=DEFAULT_LAYOUTS)
    from tyingspec._src.kinds.distributed import models

    N = target.batch_size * target.seq_len
    batch = build(Case("random", V=models.V, d=models.D, N=N, seed=5))
    found = call_distributed(name, target, kind_spec("distributed").inputs(batch)).findings
    failed = [f for f in found if f.failed]
    assert (failed[0].label if failed else "correct") == entry.expected, \
        [f.detail for f in failed]


# ---- 3. three or more micro-batches ---------------------------------------------------------

def test_a_head_wgrad_deferred_from_the_third_micro_batch_on_is_caught() -> None:
    assert min(DEFAULT_MICRO_BATCHES) >= 3
    grad = _grad_finding(users.target(users.late_head_step, layouts=PP2))
    assert grad.failed and grad.label == "replica_synced_early", grad.detail
    assert "micro-batch 2" in grad.detail, grad.detail
    # with two micro-batches the same code is right: why the count is drawn from three up
    two = users.target(users.late_head_step, layouts=PP2, micro_batches=2, batch_size=4)
    assert not _grad_finding(two).failed


def test_each_layout_draws_a_count_its_share_splits_into() -> None:
    from tyingspec._src.kinds.distributed.adapter import _layouts, _micro_counts

    t = users.target()
    planned = _layouts("user:target", t, _micro_counts("user:target", t))
    assert dict(planned) == {(2, 1): (3, 4), (2, 2): (3,), (3, 1): (3, 4)}
    with pytest.raises(AdapterError, match="micro_batches is not a count"):
        _micro_counts("user:target", users.target(micro_batches=(3, 0)))
    with pytest.raises(AdapterError, match="does not split"):
        _layouts("user:target", users.target(batch_size=10), (3, 4))


def test_the_subset_fit_does_not_enumerate_subsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 replicas x 4 micro-batches x 2 paths: 16 components.  A copy that lacks the output
    path of three micro-batches of both replicas is found by one least-squares fit, not by
    trying the subsets of 16 from the largest down (tens of thousands of comparisons)."""
    rng = np.random.default_rng(1)
    V, d = 13, 3
    parts = [judge.Part(r, m, path, rng.normal(size=(V, d)))
             for r in range(2) for m in range(4) for path in ("input", "output")]
    tol = row_tolerance(judge.terms(parts, 16), "float64")
    G = np.sum([p.value for p in parts], axis=0)
    late = np.sum([p.value for p in parts if p.path == "output" and p.micro >= 1], axis=0)
    grads = {0: G - late, 1: G - late, 2: G, 3: G}
    calls = [0]
    close = judge._close

    def counted(*args, **kwargs):
        calls[0] += 1
        return close(*args, **kwargs)

    monkeypatch.setattr(judge, "_close", counted)
    verdict, first = judge.gradient_check(grads, parts, tol, 2, 2)
    assert verdict.label == "replica_synced_early" and first == 0, verdict.detail
    assert "output path of replica 1 micro-batch 3" in verdict.detail, verdict.detail
    assert calls[0] < 200, calls[0]


# ---- 4. the phase of a failure; Ctrl-C ------------------------------------------------------

@pytest.mark.parametrize(("changes", "words"), [
    ({"setup": users.setup_raises},
     ["rank 1 (stage 1, replica 0) raised in setup", "no such stage in this build"]),
    ({"step": users.step_raises_on_rank_0},
     ["rank 0 (stage 0, replica 0) raised in step 1 of ", "no batch today"]),
    ({"reference": users.BrokenForward},
     ["the reference model raised in its forward", "the reference cannot run this batch"]),
])
def test_a_failure_names_its_phase(changes, words) -> None:
    with pytest.raises(AdapterError) as err:
        _findings(users.target(layouts=PP2, **changes))
    assert "while running the step" not in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_the_ranks_ignore_sigint() -> None:
    """A Ctrl-C reaches the terminal's whole foreground group, where a built-in's ranks are:
    the process that forked them ends them, none prints a traceback of its own."""
    _findings(users.target(layouts=PP2))
    pids = [p.pid for w in launch._WORLDS.values() for p in w.procs]
    assert pids
    for pid in pids:
        ignored = next(int(line.split()[1], 16) for line in
                       Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("SigIgn:"))
        assert ignored & (1 << (signal.SIGINT - 1)), pid


def test_ctrl_c_ends_the_command_with_one_line_and_status_130(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tyingspec._src.front import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    try:
        code = cli.main(["check", "gpt-pp2", "--kind", "distributed"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt left main() (a traceback, Python's own status)")
    assert code == 130
    err = capsys.readouterr().err
    assert err == "tyingspec: interrupted\n", err


def _sockets(pid: int) -> set[str]:
    """The inodes of ``pid``'s sockets."""
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


@pytest.mark.slow
def test_sigint_while_a_rank_hangs_prints_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    mark = f"tyingspec-sigint-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "TYINGSPEC_TEST_MARK": mark,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tyingspec", "check", "distributed_targets:hangs", "--kind",
         "distributed", "--timeout", "300"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        # a Ctrl-C's default action, whatever this test process does with SIGINT
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        ours: set[int] = set()
        ports: set[int] = set()
        while time.monotonic() < deadline:  # the command, its worker and two ranks
            ours = set(users.marked(mark))
            listening = users.listening()
            ports = {listening[s] for pid in ours for s in _sockets(pid) if s in listening}
            if len(ours) >= 4 and ports:
                break
            time.sleep(0.2)
        assert len(ours) >= 4 and ports, (ours, ports)
        time.sleep(1.0)  # the ranks are in the step now, rank 1 asleep in it
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-2000:])
    # one line for the interrupt; before it only the progress lines a run longer than a couple
    # of seconds writes (the case that started): no traceback, nothing from a rank
    lines = err.splitlines()
    assert lines[-1:] == ["tyingspec: interrupted"], err
    assert all(line.startswith(("tyingspec: case ", "tyingspec: loading "))
               for line in lines[:-1]), err
    assert "Traceback" not in out + err
    time.sleep(0.5)
    assert not users.marked(mark)
    assert not ports & set(users.listening().values()), ports

