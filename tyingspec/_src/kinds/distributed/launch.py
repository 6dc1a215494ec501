"""Launching the ranks: one world per layout, kept alive across the cases of a run.

A world is ``pp * dp`` rank processes forked from the process that runs the check (the worker,
for a ``module:attr`` target), so a rank starts in milliseconds with torch and the target
already imported (a fresh interpreter spends 2-4 s importing torch, per rank, on a busy 2-core
machine).  They meet through a ``TCPStore`` this process serves on 127.0.0.1 at a port the
kernel picks (bound to port 0: no guessed port, no race), join a gloo process group and build
the groups a :class:`~kinds.distributed.target.World` names.  Each case is one message per rank
(seed, micro-batch count, one batch per step): the rank runs ``setup`` once, then every step on
that one setup, and answers with its copy's value at start and its gradient after the sync and
value after the step, step by step.  Between two steps the rank puts every parameter and buffer
it can reach from ``state`` back to its value after ``setup`` (not the gradients, not the
optimizer's state): each step's gradient then has a single-process reference of its own (the
reference's E on that step's batch), whatever the optimizer did, and a gradient that was never
zeroed carries the step before it.  A rank says which phase it is in (setup, step k of n) as it
enters it, so a rank that raises or hangs is named with the phase.

Nothing outlives a run: a rank is a daemon process (multiprocessing ends it at exit), asks the
kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and in the worker is in the
worker's process group (killed with it).  A rank ignores SIGINT: a Ctrl-C reaches every process
of the terminal's foreground group, and the process that forked the ranks ends them itself.  A
world whose case failed in any way (a rank raised, exited or hung) is killed at once and the
next case starts a fresh one; :func:`shutdown` ends every world (it runs at exit).

Which rank is to blame is decided here.  The process group's timeout is shorter than the
call's: a rank waiting in a collective for a hung peer raises a timeout of its own, which is
only a symptom; the rank that never answered is the one named.  The call's budget is
``--timeout`` (``TYINGSPEC_CALL_TIMEOUT``, set by the worker) or ``DEFAULT_TIMEOUT``.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import functools
import multiprocessing
import os
import signal
import time
import traceback
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.options import DEFAULT_TIMEOUT
from tyingspec._src.kinds.distributed.target import DistributedTarget, Layout, World, place

#: What a rank says of a collective it waited in for a peer that raised, exited or hung: a
#: symptom, never the cause named (matched in the error text, gloo's wording).
_WAITING = ("Timed out", "timed out", "Connection closed by peer", "Connection reset",
            "connection reset", "Broken pipe", "closed by peer", "ECONNRESET", "EPIPE",
            "Socket closed", "Connection refused")


def call_budget() -> float:
    """Seconds one call may take: the worker's ``--timeout``, else the default."""
    try:
        return float(os.environ.get("TYINGSPEC_CALL_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


# ---- inside a rank ---------------------------------------------------------------------------

def _store(port: int, size: int, *, master: bool, timeout: float) -> Any:
    """The world's ``TCPStore`` on 127.0.0.1: served here (``master``, at ``port`` 0: the
    kernel picks a free one) or joined by a rank."""
    import torch.distributed as dist

    wait_for = datetime.timedelta(seconds=timeout)
    # torch documents torch.distributed.TCPStore, but its __init__ imports the name without
    # re-exporting it (no ``as``), so strict mypy finds no such attribute
    store_type = dist.TCPStore  # type: ignore[attr-defined]
    if master:
        return store_type("127.0.0.1", port, size + 1, is_master=True, wait_for_workers=False,
                          timeout=wait_for)
    return store_type("127.0.0.1", port, size + 1, is_master=False, timeout=wait_for)


def _die_with_parent() -> None:
    """SIGKILL this rank when the process that forked it dies (Linux; elsewhere the daemon
    flag and the worker's process group do it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _full(t: Any) -> np.ndarray | None:
    """A copy's value or gradient as a float64 array (a DTensor gathered: every rank of an
    FSDP2 world holds one, so all of them take part)."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    import torch

    return np.asarray(t.detach().to(torch.float64).cpu().numpy(), dtype=np.float64).copy()


def _rank_main(conn: Connection, target: DistributedTarget, rank: int, size: int,
               layout: Layout, port: int, pg_timeout: float) -> None:
    _die_with_parent()
    # the coordinator ends the ranks; a Ctrl-C of the terminal (built-ins run in the command's
    # own process, whose foreground group the ranks share) must not make each one print
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        world = _join(rank, size, layout, port, pg_timeout)
    except BaseException as exc:  # noqa: BLE001  (reported, then this rank ends)
        conn.send(("error", ("starting the world", _text(exc))))
        return
    conn.send(("ok", None))
    phase = ["setup"]

    def enter(name: str) -> None:
        phase[0] = name
        conn.send(("at", name))

    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            break
        seed, micro, batches = message
        phase[0] = "setup"
        try:
            conn.send(("ok", _one_case(target, world, seed, micro, batches, enter)))
        except BaseException as exc:  # noqa: BLE001  (SystemExit included: reported)
            conn.send(("error", (phase[0], _text(exc))))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (ending anyway)
        pass


def _join(rank: int, size: int, layout: Layout, port: int, pg_timeout: float) -> World:
    """Join the process group at the store on ``port`` and build the groups a World names (no
    code of the target's runs here)."""
    import torch.distributed as dist

    pp, dp = layout
    wait_for = datetime.timedelta(seconds=pg_timeout)
    store = _store(port, size, master=False, timeout=pg_timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=wait_for)
    world = World(rank, size, pp, dp)

    def groups(every: list[tuple[int, ...]], mine: int) -> tuple[Any, tuple[int, ...]]:
        # every rank creates every group, in the same order (torch's rule for new_group);
        # this rank keeps the ``mine``-th (its stage's or its replica's)
        made = [dist.new_group(list(ranks), timeout=wait_for) for ranks in every]
        return made[mine], every[mine]

    world.dp_group, world.dp_ranks = groups(
        [tuple(s * dp + r for r in range(dp)) for s in range(pp)], world.stage)
    world.pp_group, world.pp_ranks = groups(
        [tuple(s * dp + r for s in range(pp)) for r in range(dp)], world.replica)
    world.embedding_group, world.embedding_ranks = groups(
        [tuple(sorted({r, (pp - 1) * dp + r})) for r in range(dp)], world.replica)
    return world


def _one_case(target: DistributedTarget, world: World, seed: int, micro: int,
              batches: list[tuple[np.ndarray, np.ndarray]], enter: Callable[[str], None]
              ) -> dict[str, Any]:
    """``setup`` once, then one step per batch on it; the copy's value at start and, step by
    step, its gradient after the sync and its value after the step."""
    import torch

    torch.set_default_dtype(torch.float64)
    world.micro_batch_count = micro
    torch.manual_seed(seed)
    enter("setup")
    state, copy = target.setup(world)
    start = _full(copy)
    held = _held(state, copy)
    at_start = [t.detach().clone() for t in held]
    grads: list[np.ndarray | None] = []
    afters: list[np.ndarray | None] = []
    has_grad: list[bool] = []
    for i, (tokens, targets) in enumerate(batches):
        enter(f"step {i + 1} of {len(batches)}")
        if i:
            with torch.no_grad():  # the next step starts where setup left the parameters
                for t, value in zip(held, at_start):
                    t.copy_(value)
        torch.manual_seed(seed + 1 + i)  # as the reference seeds this step (dropout)
        target.step(world, state, torch.from_numpy(tokens.copy()),
                    torch.from_numpy(targets.copy()))
        grads.append(None if copy is None else _full(copy.grad))
        afters.append(_full(copy))
        has_grad.append(copy is not None and copy.grad is not None)
    return {"start": start, "grads": grads, "afters": afters, "has_copy": copy is not None,
            "has_grad": has_grad,
            "dtype": None if copy is None else str(copy.dtype).removeprefix("torch.")}


def _held(state: Any, copy: Any) -> list[Any]:
    """Every parameter and buffer reachable from ``state`` (through containers, attributes,
    modules and optimizers) and the copy: what a step changes that the next step's forward
    reads.  Gradients are not among them, and an optimizer's own state is left alone."""
    import torch

    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > 8 or id(obj) in seen or obj is None:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                found.setdefault(id(t), t)
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for t in group["params"]:
                    found.setdefault(id(t), t)
        elif isinstance(obj, torch.Tensor):
            if obj.is_leaf and obj.requires_grad:
                found.setdefault(id(obj), obj)
        elif isinstance(obj, Mapping):
            for v in list(obj.values()):
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in list(obj):
                visit(v, depth + 1)
        elif not isinstance(obj, (type, types.ModuleType, types.FunctionType, str, bytes,
                                  int, float, bool)) and hasattr(obj, "__dict__"):
            for v in list(vars(obj).values()):
                visit(v, depth + 1)

    visit(state, 0)
    visit(copy, 0)
    return list(found.values())


def _text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


# ---- the coordinator -------------------------------------------------------------------------

@dataclass
class _World:
    """A live world: its ranks, their connections and the store they meet at."""

    layout: Layout
    target: DistributedTarget  # held, so that its id (in the key) is never reused meanwhile
    procs: list[BaseProcess]
    conns: list[Connection]
    store: Any
    port: int
    ports: list[int] = field(default_factory=list)

    def kill(self, *, polite: bool = False) -> None:
        """End the ranks: asked to finish (``polite``, at shutdown), else killed at once (a
        failed world: a rank may be stuck where it reads no message)."""
        for conn in self.conns if polite else ():
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (2.0 if polite else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        for p in self.procs:
            p.close()
        self.procs, self.conns = [], []
        self.store = None  # the store's server closes its port when the last reference goes


#: live worlds by (target, layout, process-group timeout): a new budget (another ``--timeout``)
#: needs a world whose collectives time out within it.  The micro-batch count is the case's,
#: sent with it.
_WORLDS: dict[tuple[int, Layout, float], _World] = {}
#: every store port this process has served (tests check none is left listening)
SERVED: list[int] = []


def shutdown() -> None:
    """End every world this process started (at exit too)."""
    while _WORLDS:
        _, w = _WORLDS.popitem()
        w.kill(polite=True)


atexit.register(shutdown)


@functools.cache
def _warm() -> None:
    """Import, once and before any fork, what torch imports lazily on a step's first use: the
    first optimizer built imports ``torch._dynamo`` (3-4 s), which every rank of every world
    would otherwise import again on its own."""
    import torch._dynamo  # noqa: F401

    # lazy: imported once, before the first fork, not whenever the launcher loads
    import tyingspec._src.kinds.distributed.models  # noqa: F401  (the built-ins' code)


#: how many times a world is started before its failure is reported: starting one runs no
#: code of the target's (a process group joined, groups built), so a failure there is the
#: machine's, not the gradient's: on CI's loaded 2-core machine a rank of a pp=2 x dp=2 world
#: once missed the rendezvous for the whole 48 s (why is not known; ranks are forked beside
#: the threads of the other worlds' stores, one suspect)
START_ATTEMPTS = 3


def _start(target: DistributedTarget, layout: Layout, spec: str, deadline: float,
           pg_timeout: float) -> _World:
    """A world of ``layout``, started again (up to :data:`START_ATTEMPTS` times, within the
    call's deadline) when one fails to meet."""
    _warm()
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_once(target, layout, spec, deadline, pg_timeout)
        except AdapterError as exc:
            if attempt == START_ATTEMPTS or deadline - time.monotonic() < 1.0:
                tries = "once" if attempt == 1 else f"on each of {attempt} attempts"
                raise AdapterError(exc.adapter, f"{exc.problem}, {tries}", key=exc.key,
                                   expected=exc.expected, got=exc.got) from exc
    raise AssertionError("unreachable")  # the loop returns or raises


def _start_once(target: DistributedTarget, layout: Layout, spec: str, deadline: float,
                pg_timeout: float) -> _World:
    pp, dp = layout
    size = pp * dp
    store = _store(0, size, master=True, timeout=pg_timeout)
    port = int(store.port)
    SERVED.append(port)
    ctx = multiprocessing.get_context("fork")
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    world = _World(layout, target, procs, conns, store, port)
    try:
        for rank in range(size):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_rank_main, name=f"tyingspec-rank-{rank}",
                            args=(there, target, rank, size, layout, port, pg_timeout),
                            daemon=True)
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        _gather(world, spec, deadline, "starting the world")
    except BaseException:
        world.kill()
        raise
    return world


def run_case(target: DistributedTarget, spec: str, layout: Layout, micro: int, seed: int,
             batches: list[tuple[np.ndarray, np.ndarray]], deadline: float
             ) -> list[dict[str, Any]]:
    """One case on ``layout``'s world (started if need be): ``setup``, then one step per
    batch of ``batches`` with ``micro`` micro-batches each; every rank's answer, by rank.
    AdapterError naming the rank and the phase when one raised, exited or hung (the world is
    then ended)."""
    pg_timeout = max(1.0, 0.4 * call_budget())
    key = (id(target), (layout[0], layout[1]), pg_timeout)
    world = _WORLDS.get(key)
    if world is not None and not all(p.is_alive() for p in world.procs):
        _WORLDS.pop(key).kill()
        world = None
    if world is None:
        world = _start(target, layout, spec, deadline, pg_timeout)
        _WORLDS[key] = world
    for conn in world.conns:
        conn.send((seed, micro, batches))
    try:
        return _gather(world, spec, deadline, "setup")
    except BaseException:
        _WORLDS.pop(key, None)
        world.kill()
        raise


def _gather(world: _World, spec: str, deadline: float, first: str) -> list[dict[str, Any]]:
    """Every rank's answer; the rank to blame, and the phase it was in, when there is none.
    ``first`` is the phase a rank is in until it says otherwise."""
    pp, dp = world.layout
    answers: dict[int, Any] = {}
    waiting: dict[int, tuple[str, str]] = {}  # ranks that failed in a collective, for a peer
    phase = dict.fromkeys(range(len(world.procs)), first)
    by_conn = {id(c): i for i, c in enumerate(world.conns)}
    by_sentinel = {p.sentinel: i for i, p in enumerate(world.procs)}
    pending = set(range(len(world.procs)))
    where = f"layout pp={pp} x dp={dp}"

    def read(i: int) -> bool:
        """Take rank ``i``'s message (False: there is none, its pipe is closed)."""
        try:
            status, payload = world.conns[i].recv()
        except (EOFError, OSError):
            return False
        if status == "at":
            phase[i] = payload
        elif status != "error":
            answers[i] = payload
            pending.discard(i)
        elif any(w in payload[1] for w in _WAITING):
            waiting[i] = payload
        else:
            raise AdapterError(spec, f"{place(i, dp)} raised in {payload[0]} ({where})",
                               got=payload[1])
        return True

    while pending - set(waiting):
        left = deadline - time.monotonic()
        if left <= 0:
            silent = sorted(pending - set(waiting))
            also = f"; {', '.join(place(r, dp) for r in sorted(waiting))} timed out waiting " \
                   "for it in a collective" if waiting else ""
            raise AdapterError(spec, ", ".join(f"{place(r, dp)} hung in {phase[r]}"
                                               for r in silent) + f" ({where})",
                               expected="every rank's answer within --timeout",
                               got=f"no answer{also}; the world was killed")
        live = [world.conns[i] for i in pending - set(waiting)] + \
            [world.procs[i].sentinel for i in pending - set(waiting)]
        for ready in wait(live, timeout=min(left, 0.5)):
            if not isinstance(ready, int):
                read(by_conn[id(ready)])  # a closed pipe: its sentinel says how it ended
                continue
            i = by_sentinel[ready]
            # its last messages may have come before it ended: read them first
            while i in pending and world.conns[i].poll(0) and read(i):
                pass
            if i in pending and i not in waiting:
                world.procs[i].join(1.0)  # reaped, so that its status can be read
                raise AdapterError(spec, f"{place(i, dp)} {_ended(world.procs[i].exitcode)} "
                                   f"in {phase[i]} ({where})",
                                   expected="an answer from every rank",
                                   got="no answer (the process ended); the world was killed")
    if waiting:  # every rank left failed in a collective: the first says what happened
        i = min(waiting)
        raise AdapterError(spec, f"{place(i, dp)} failed in a collective in {waiting[i][0]} "
                           f"({where})", got=waiting[i][1])
    return [answers[i] for i in range(len(world.procs))]


def _ended(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
