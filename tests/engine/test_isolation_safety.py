"""The worker's user code can forge anything the worker sends: the parent runs none of it (it
decodes plain data, it never unpickles), and no process the run started outlives the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tyingspec import KINDS, AdapterError, Case, build, load
from tyingspec._src.core.adapters import Returned, call_model
from tyingspec._src.core.findings import Finding, passed

BIN = Path(sys.executable).parent

ATTACKERS = '''
import gc, os, pickle, sys, time
from multiprocessing.connection import Connection

from tyingspec import AdapterError
from tyingspec._src.kinds.probe.builtins import REGISTRY

_good = REGISTRY["tied"].model
MARKER = {marker!r}


class Touch:
    """Unpickled, it runs a shell command: in the worker that is the user's own business."""

    def __reduce__(self):
        return (os.system, ("touch " + MARKER,))


class ExitZero:
    """Unpickled in the parent, it would end `tyingspec check` with status 0: a pass."""

    def __reduce__(self):
        return (os._exit, (0,))


PAYLOADS = {{"touch": Touch, "exit": ExitZero}}


def _pipe():
    """The worker's end of the pipe to the parent, as any code in the worker can find it."""
    return next(o for o in gc.get_objects()
                if isinstance(o, Connection) and not o.closed and o.writable)


def ok(E, W, b, tokens, targets, *, res, s_in):
    return _good(E, W, b, tokens, targets, res=res, s_in=s_in)


class _Raising(dict):
    def __getitem__(self, key):
        # tyingspec passes on an AdapterError raised as it reads a result: this one carries
        # an object in a field meant for text
        raise AdapterError("attackers", "raised", got=PAYLOADS[self.payload]())


def _raises(payload):
    def f(E, W, b, tokens, targets, *, res, s_in):
        out = _Raising(ok(E, W, b, tokens, targets, res=res, s_in=s_in))
        out.payload = payload
        return out
    return f


def _writes(payload):
    def f(E, W, b, tokens, targets, *, res, s_in):
        # a frame of the worker's own, ahead of the real answer
        _pipe().send(("ok", PAYLOADS[payload](), set()))
        return ok(E, W, b, tokens, targets, res=res, s_in=s_in)
    return f


raises_touch, raises_exit = _raises("touch"), _raises("exit")
writes_touch, writes_exit = _writes("touch"), _writes("exit")


def patches_returned(E, W, b, tokens, targets, *, res, s_in):
    # tyingspec's own result type, made to pickle as a command
    from tyingspec._src.core.adapters import Returned
    Returned.__reduce__ = lambda self: (os.system, ("touch " + MARKER,))
    return ok(E, W, b, tokens, targets, res=res, s_in=s_in)


def writes_once(E, W, b, tokens, targets, *, res, s_in):
    # the first call (of the first worker) attacks; the next worker answers as it should
    flag = MARKER + ".attacked"
    if not os.path.exists(flag):
        open(flag, "w").close()
        _pipe().send(("ok", Touch(), set()))
        time.sleep(3600)
    return ok(E, W, b, tokens, targets, res=res, s_in=s_in)
'''


@pytest.fixture()
def attackers(tmp_path: Path) -> Path:
    (tmp_path / "attackers.py").write_text(ATTACKERS.format(marker=str(tmp_path / "MARKER")))
    return tmp_path


def tyingspec(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "tyingspec"), "check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ""})


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr,words", [
    ("raises_touch", ["attackers.Touch", "cannot send"]),
    ("raises_exit", ["attackers.ExitZero", "cannot send"]),
    ("writes_touch", ["refused", "a pickle"]),
    ("writes_exit", ["refused", "a pickle"]),
])
def test_an_object_the_worker_sends_to_run_code_in_the_parent_is_an_adapter_error(
        attackers: Path, attr: str, words: list[str]) -> None:
    out = tyingspec(attackers, f"attackers:{attr}", "--kind", "model", "--case", "absent-tokens")
    text = out.stdout + out.stderr
    assert not (attackers / "MARKER").exists(), "the parent ran the worker's command"
    assert out.returncode == 2, text[-3000:]
    assert "adapter error" in text, text[-3000:]
    for w in words:
        assert w in text, (w, text[-3000:])
    assert "Traceback" not in text, text[-3000:]


def test_a_result_type_whose_pickling_the_worker_patched_still_crosses_as_plain_data(
        attackers: Path) -> None:
    out = tyingspec(attackers, "attackers:patches_returned", "--kind", "model",
                    "--case", "absent-tokens")
    text = out.stdout + out.stderr
    assert not (attackers / "MARKER").exists(), "the parent ran the worker's command"
    assert out.returncode == 0, text[-3000:]
    assert "verdict: correct" in text, text[-3000:]


def test_after_a_refused_frame_a_fresh_worker_answers_and_its_result_is_right(
        attackers: Path) -> None:
    from tyingspec._src.engine.observe import call

    batch = build(Case("big", V=1024, d=256, N=16, seed=3))  # dE through shared memory
    here = call_model("attackers:ok", lambda *a, **k: _tied(*a, **k),
                      KINDS["model"].inputs(batch))
    target = load("attackers:writes_once", "model", paths=(str(attackers),))
    try:
        with pytest.raises(AdapterError, match="refused.*a pickle") as info:
            call(target, batch)
        assert "the worker was killed" in str(info.value)
        again = call(target, batch)  # a fresh worker, the real answer
        assert again.dE.tobytes() == here.dE.tobytes()
        assert again.dW is not None and here.dW is not None
        assert again.dW.tobytes() == here.dW.tobytes()
    finally:
        target.close()
    assert not (attackers / "MARKER").exists()


def _tied(*args: Any, **kwargs: Any) -> Any:
    from tyingspec._src.kinds.probe.builtins import REGISTRY

    return REGISTRY["tied"].model(*args, **kwargs)


# ---- the decoder, on frames no worker of tyingspec's would send -----------------------------

def _frame(tree: Any, body: bytes = b"") -> bytes:
    from tyingspec._src.engine.isolation import _HEAD, _MAGIC

    head = json.dumps(tree).encode()
    return _MAGIC + _HEAD.pack(len(head)) + head + body


def _array(dtype: str, shape: list[int], at: int = 0) -> dict[str, Any]:
    return {"$": "array", "dtype": dtype, "shape": shape, "at": at}


def _nested(depth: int) -> Any:
    return [] if depth == 0 else [_nested(depth - 1)]


F8 = np.dtype("<f8").str


@pytest.mark.parametrize("frame,words", [
    (lambda: b"\x80\x05N.", ["a pickle"]),
    (lambda: b"not a message", ["not a tyingspec message"]),
    (lambda: _frame({"$": "posix.system", "args": ["true"]}), ["tagged 'posix.system'"]),
    (lambda: _frame(_array("|O8", [1]), b"\0" * 8), ["dtype '|O8'"]),
    (lambda: _frame(_array("O", [1]), b"\0" * 8), ["dtype 'O'"]),
    (lambda: _frame(_array("[('a', 'O')]", [1]), b"\0" * 8), ["dtype"]),
    (lambda: _frame(_array(F8, [4]), b"\0" * 8), ["32 bytes", "8"]),
    (lambda: _frame(_array(F8, [-1]), b"\0" * 8), ["shape"]),
    (lambda: _frame({"$": "tuple", "items": [], "extra": 1}), ["keys"]),
    (lambda: _frame({"$": "Finding", "fields": {
        "check": "c", "invariant": "i", "outcome": "passed", "detail": "", "label": None,
        "evaluations": 0, "line": "shadows the method"}}), ["Finding", "line"]),
    (lambda: _frame({"$": "Finding", "fields": {
        "check": "c", "invariant": "i", "outcome": "won", "detail": "", "label": None,
        "evaluations": 0}}), ["Finding", "outcome"]),
    (lambda: _frame({"$": "AdapterError", "fields": {
        "adapter": "a", "problem": {"$": "tuple", "items": []}, "key": None, "expected": None,
        "got": None}}), ["AdapterError", "problem"]),
    (lambda: _frame(_nested(80)), ["deep"]),
], ids=["pickle", "garbage", "unknown-tag", "object-dtype", "object-char", "structured",
        "short-data", "negative-shape", "extra-key", "extra-field", "bad-outcome",
        "error-field-not-text", "too-deep"])
def test_the_parent_decodes_only_plain_data_and_says_what_it_refused(
        frame: Callable[[], bytes], words: list[str]) -> None:
    from tyingspec._src.engine.isolation import _decode, _Refused

    with pytest.raises(_Refused) as info:
        _decode(frame())
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_every_value_a_worker_legitimately_sends_comes_back_equal_and_of_its_type() -> None:
    from tyingspec._src.core.tolerance import numpy_dtype
    from tyingspec._src.engine.isolation import _decode, _encode, _Shared

    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    finding = passed("check", "invariant", "detail", 3)
    returned = Returned(
        dE=rng.standard_normal((5, 3)).astype(np.float32), mutated=("E", "tokens"),
        precision="float32", loss=float("nan"), dW=np.asfortranarray(rng.standard_normal((3, 3))),
        db=rng.standard_normal(5).astype(bf16),
        evidence={"tie": {"vocab": 5, "padding_idx": None, "how": "é"}, "tokens": np.arange(4),
                  "ok": True, "n": np.int64(7), "x": np.float64(0.5), "empty": np.zeros((0, 3)),
                  "keys": ["dh"], "pair": (1, 2.5), 3: frozenset({"a"}), "f16": np.float16(1)},
        findings=(finding, Finding("c", "i", "failed", "d", "input_path_missing", 2)))
    message = (("ok", returned, {"psm_1"}), ("ok", Returned(_Shared("n", (5, 3), "<f8"), (),
                                                            "float64"), set()),
               ("error", AdapterError("a", "p", key="k", expected="e", got=None)),
               ("loaded", None, ["kernel"], {"/src/helper.py": "0f1e"}))
    back = _decode(_encode(message))
    assert _same(back, message)


@pytest.mark.parametrize("chunk", [1 << 30, 4096 + 3])
@pytest.mark.parametrize("form", ["float32", "float64 transposed", "bfloat16", ">f4"])
def test_a_result_written_through_the_block_descriptor_comes_back_bit_for_bit(
        form: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker fills a fresh result block with os.pwrite, in pieces of at most
    # _PWRITE_BYTES (here also an odd size, so pieces end mid-element and mid-page); the
    # parent takes the block over as the array, as it takes every result.
    import tyingspec._src.engine.isolation as iso
    from tyingspec._src.core.tolerance import numpy_dtype

    monkeypatch.setattr(iso, "_PWRITE_BYTES", chunk)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((700, 401))
    if form == "float32":
        a = a.astype(np.float32)
    elif form == "float64 transposed":
        a = a.T  # not C-contiguous: written in C order all the same
    elif form == "bfloat16":
        a = a.astype(numpy_dtype("bfloat16"))
    else:
        a = a.astype(">f4")
    before = a.copy()
    block = iso._create(a.nbytes, f"tyingspec_test_{os.getpid()}_{chunk}", populate=False)
    try:
        shared = iso._write_result(a, block)
    finally:
        block.close()
    back = iso._take(shared, lambda mapping: None)  # unlinks the block's name
    assert back.dtype == a.dtype and back.shape == a.shape
    assert back.tobytes() == np.ascontiguousarray(a).tobytes()
    assert a.tobytes() == before.tobytes()  # the array written is left as it was


def test_a_large_input_crosses_bit_for_bit_into_new_blocks_and_a_reused_one() -> None:
    # A call's large input goes into a new block (through its descriptor, as results do, when
    # it is laid out in C order; else populated and copied) or into the pool's block of its
    # size; the worker reads each block as the array, and the parent compares the block with
    # the input after the call.
    import tyingspec._src.engine.isolation as iso

    worker = iso.Worker("budget:none", "model")  # only its pool: nothing is started
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1000, 600)).astype(np.float32),  # 2.4 MB: shared, new
              rng.standard_normal((1000, 1200)).astype(np.float32)[:, ::2],  # same size: reused
              rng.standard_normal((900, 1200)).astype(np.float32)[:, ::2]]  # strided, new
    names = []
    try:
        for a in inputs:
            before = a.copy()
            message, written = worker._written({"E": a, "s_in": 1.0})
            names.append(written["E"].name)
            assert message["s_in"] == 1.0 and set(written) == {"E"}
            shared = message["E"]
            assert isinstance(shared, iso._Shared)
            assert (shared.shape, iso._dtype_of(shared.dtype)) == (a.shape, a.dtype)
            assert iso._in_block(a, written["E"]).tobytes() == a.tobytes()
            assert iso._written_over({"E": a}, written) == set()
            assert a.tobytes() == before.tobytes()
            assert worker._pool == [written["E"]]  # one block, the last call's
        assert names[1] == names[0] != names[2]  # reused at the same size only
    finally:
        iso._release(worker._pool, unlink=True)


def _same(a: Any, b: Any) -> bool:
    from dataclasses import fields, is_dataclass

    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() \
            and a.flags.writeable
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, AdapterError):
        return str(a) == str(b)
    if is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    return bool(a == b)


def test_the_worker_refuses_to_send_an_object_it_cannot_encode() -> None:
    from tyingspec._src.engine.isolation import _encode, _Unsendable

    class Evil:
        pass

    for value in (Evil(), np.array([Evil()], dtype=object), np.zeros(1, "U3"),
                  np.zeros(1, [("a", "f8")]), AdapterError("a", "p", got=Evil())):  # type: ignore[arg-type]
        with pytest.raises(_Unsendable):
            _encode(("ok", value, set()))


# ---- no process of the run outlives it --------------------------------------------------

FORKERS = '''
import os, time
from tyingspec._src.kinds.probe.builtins import REGISTRY

HERE = {here!r}


def _fork():
    pid = os.fork()
    if pid == 0:  # the target's child: sleeps on, whatever becomes of the worker
        try:
            time.sleep(3600)
        finally:
            os._exit(0)
    with open(os.path.join(HERE, "children"), "a") as f:
        f.write(f"{{pid}}\\n")
    with open(os.path.join(HERE, "workers"), "a") as f:
        f.write(f"{{os.getpid()}}\\n")


def forks(E, W, b, tokens, targets, *, res, s_in):
    _fork()
    return REGISTRY["tied"].model(E, W, b, tokens, targets, res=res, s_in=s_in)


def forks_and_hangs(E, W, b, tokens, targets, *, res, s_in):
    _fork()
    time.sleep(3600)
'''


@pytest.fixture()
def forkers(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "forkers.py").write_text(FORKERS.format(here=str(tmp_path)))
    yield tmp_path
    for pid in _pids(tmp_path, "children") + _pids(tmp_path, "workers"):  # a failed test's
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _pids(where: Path, name: str) -> list[int]:
    path = where / name
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process still running (a zombie runs nothing: it waits to be
    reaped by a parent that may be gone, and a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _within(seconds: float, done: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _shm_names(pid: int) -> set[str]:
    """The shared-memory blocks process ``pid`` has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split("/dev/shm/")[1].split()[0] for line in maps.splitlines()
            if "/dev/shm/" in line}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_tyingspec_ends_its_worker_and_what_the_target_forked(
        forkers: Path, sig: signal.Signals) -> None:
    # a batch large enough for its E to cross through shared memory; the output goes to a
    # file (a process that outlived tyingspec would hold a pipe open)
    log = (forkers / "output").open("wb")
    proc = subprocess.Popen(
        [str(BIN / "tyingspec"), "check", "forkers:forks_and_hangs", "--kind", "model",
         "--case", "absent-tokens", "--shape", "1024,256,16", "--timeout", "600"],
        cwd=forkers, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": ""},
        # a Ctrl-C's default action, whatever this test's process does with SIGINT (a
        # SIGINT ignored here would be ignored by tyingspec too, and the test would hang)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _within(60, lambda: bool(_pids(forkers, "workers"))), "the target never ran"
        (worker,), (child,) = _pids(forkers, "workers"), _pids(forkers, "children")
        blocks = _shm_names(proc.pid) | _shm_names(worker)
        assert blocks, "E did not cross through shared memory"
        assert _running(worker) and _running(child)
        proc.send_signal(sig)
        # a bound on liveness, not a speed target: on a loaded two-core machine (the suite
        # beside a CI run) ending the worker and the target's child took over 10 s
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        log.close()
    output = (forkers / "output").read_text(errors="replace")
    assert proc.returncode != 0, output[-3000:]
    assert _within(5, lambda: not _running(worker)), "the worker outlived tyingspec"
    assert _within(5, lambda: not _running(child)), "the target's child outlived tyingspec"
    assert not [n for n in blocks if Path("/dev/shm", n).exists()], blocks


def test_a_child_the_target_forked_is_gone_after_a_normal_run(forkers: Path) -> None:
    out = tyingspec(forkers, "forkers:forks", "--kind", "model", "--case", "absent-tokens")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    children = _pids(forkers, "children")
    assert children
    assert _within(5, lambda: not any(map(_running, children))), \
        "a child the target forked outlived the run"


def test_a_child_the_target_forked_is_gone_once_its_worker_is_stopped(forkers: Path) -> None:
    from tyingspec._src.engine.observe import call

    target = load("forkers:forks", "model", paths=(str(forkers),))
    try:
        call(target, build(Case("a", V=8, d=2, N=4, seed=0)))
        (child,) = _pids(forkers, "children")
        assert _running(child)
        assert target.worker is not None
        target.worker.stop()
        assert _within(5, lambda: not _running(child)), "the target's child outlived its worker"
    finally:
        target.close()


# A target that starts a child holding its stdout and leaves it running, three ways: a plain
# Popen (in the worker's process group), one in a session of its own (out of the group), and a
# daemon's double fork (out of the group, its parent gone at once).
STRAYS = '''
import os, subprocess, sys, time
from tyingspec._src.kinds.probe.builtins import REGISTRY

HERE = {here!r}


def _note(pid):
    with open(os.path.join(HERE, "children"), "a") as f:
        f.write(f"{{pid}}\\n")


def _daemon():
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:  # the daemon: stdout still the check's
            _note(os.getpid())
            time.sleep(60)
        os._exit(0)
    os.waitpid(pid, 0)


START = {{
    "popen": lambda: _note(subprocess.Popen(["sleep", "60"]).pid),
    "session": lambda: _note(subprocess.Popen(["sleep", "60"], start_new_session=True).pid),
    "daemon": _daemon,
}}


def _leaves(how):
    def adapter(E, W, b, tokens, targets, *, res, s_in):
        START[how]()
        return REGISTRY["tied"].model(E, W, b, tokens, targets, res=res, s_in=s_in)
    return adapter


popen, session, daemon = _leaves("popen"), _leaves("session"), _leaves("daemon")
'''
HOW = ["popen", "session", "daemon"]


@pytest.fixture()
def strays(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "strays.py").write_text(STRAYS.format(here=str(tmp_path)))
    yield tmp_path
    for pid in _pids(tmp_path, "children"):  # a failed test's
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("how", HOW)
def test_a_check_piped_to_cat_ends_with_its_run_and_the_child_the_target_left(
        strays: Path, how: str) -> None:
    # the child holds the pipe's write end: `| cat` ends when it does, 60 s later, unless the
    # run ends it (a session of its own or a double fork leaves the worker's process group)
    t0 = time.monotonic()
    out = subprocess.run(
        f"{BIN / 'tyingspec'} check strays:{how} --kind model --case absent-tokens | cat",
        shell=True, cwd=strays, capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    assert out.returncode == 0 and "verdict: correct" in out.stdout, \
        (out.stdout + out.stderr)[-3000:]
    children = _pids(strays, "children")
    assert children, "the target started no child"
    assert took < 20, f"the pipe stayed open {took:.1f} s"
    assert _within(5, lambda: not any(map(_running, children))), \
        "a child the target left outlived the run"


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("how", HOW)
def test_the_api_ends_the_child_a_target_left_and_keeps_a_worker_that_left_none(
        strays: Path, how: str) -> None:
    import tyingspec
    from tyingspec._src.engine.warm import WARM

    WARM.close()
    try:
        report = tyingspec.check(f"strays:{how}", "model", case="absent-tokens",
                                 paths=[str(strays)])
        assert report.ok, report.diagnosis
        children = _pids(strays, "children")
        assert children, "the target started no child"
        assert _within(5, lambda: not any(map(_running, children))), \
            "a child the target left outlived tyingspec.check"
        assert len(WARM) == 0  # its worker went with it: the next check loads afresh
        # a target that leaves nothing running keeps its worker for the next check
        (strays / "quiet.py").write_text(
            "from tyingspec._src.kinds.probe.builtins import REGISTRY\n"
            "quiet = REGISTRY['tied'].model\n")
        workers = []
        for _ in range(2):
            assert tyingspec.check("quiet:quiet", "model", case="absent-tokens",
                                   paths=[str(strays)]).ok
            (kept,) = WARM._kept.values()
            assert kept.worker is not None and kept.worker._proc is not None
            workers.append(kept.worker._proc.pid)
        assert workers[0] == workers[1]
    finally:
        WARM.close()
