"""``tyingspec ckpt convert``: tied <-> untied under a policy, written atomically.

Every write goes to a temporary file beside OUT and is renamed over it, so an interrupted run
leaves no half-written OUT; the input is never overwritten.  SIGTERM removes that temporary
file before the process ends; a failed write (a full disk) leaves the previous OUT whole; OUT
keeps the mode of the file it replaces; a device or pipe (``/dev/stdout``) is written in place,
as a stream, never replaced by a regular file.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import os
import re
import signal
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, cast

from tyingspec._src.ckpt.inspect import inspect, torch_equal
from tyingspec._src.ckpt.read import POLICIES, Checkpoint, CkptError, first_line, same_storage
from tyingspec._src.core.files import (
    absolute,
    atomic_write,
    is_stream,
    open_stream,
)

if TYPE_CHECKING:
    import torch

@dataclass
class Converted:
    """A converted state dict and what it records."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    refused: str | None = None  # the reason ``refuse`` stopped, when it did


def _tie_matrix(e: torch.Tensor, h: torch.Tensor, policy: str, tolerance: float,
                path: str) -> tuple[torch.Tensor, str | None]:
    import torch

    if policy == "output":
        return h, None
    if policy == "average":
        # the mean is taken in float64 and rounded once, so averaging two equal matrices
        # returns them bit for bit
        return ((e.to(torch.float64) + h.to(torch.float64)) / 2).to(e.dtype), None
    if policy == "refuse":
        # a NaN in either matrix makes the gap NaN, and NaN > tolerance is False: bit-equal
        # matrices (NaNs in the same places) have no gap, any other NaN refuses
        gap = 0.0 if torch_equal(e, h) else float(
            (e.to(torch.float64) - h.to(torch.float64)).abs().max())
        if not gap <= tolerance:
            return e, (f"{path}: the embedding and the head differ by max |delta| {gap:.4g} > "
                       f"--tolerance {tolerance:g}; refusing to tie (choose --policy input, "
                       f"output or average)")
    return e, None


def check_policy(to: str, policy: str | None, tolerance: float | None) -> None:
    """Refuse a --policy or --tolerance that means nothing for ``to``, and a tolerance that is
    not a finite number >= 0 (NaN compares false with every gap: "refuse" would tie anything)."""
    if to not in ("tied", "untied"):
        raise CkptError(f"--to: expected tied or untied, got {to!r}")
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise CkptError(f"--tolerance: expected a finite number >= 0 (the largest |delta| "
                        f"--policy refuse accepts), got {tolerance!r}")
    if to == "untied":
        # untying copies the one matrix into both keys (or keeps the two it finds): there is
        # no matrix to choose
        if policy is not None:
            raise CkptError(f"--policy {policy}: a policy chooses the tied matrix; --to untied "
                            f"gives the head a copy of the embedding and takes no --policy")
        if tolerance is not None:
            raise CkptError("--tolerance: only --policy refuse reads it; --to untied takes no "
                            "--tolerance")
        return
    if policy is None:
        raise CkptError("--to tied needs --policy input|output|average|refuse")
    if policy not in POLICIES:
        raise CkptError(f"--policy: expected one of {', '.join(POLICIES)}, got {policy!r}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise CkptError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    return digest.hexdigest()


def convert(ckpt: Checkpoint, to: str, policy: str | None, tolerance: float | None = None,
            config: dict[str, Any] | None = None, embedding: str | None = None,
            head: str | None = None) -> Converted:
    """Convert ``ckpt`` to ``to`` ("tied" or "untied") under ``policy``; every tensor other
    than the head and embedding is the same object as in ``ckpt`` (copied bit for bit).
    ``tolerance`` (default 0: bit-equal) is read by ``refuse`` only."""
    check_policy(to, policy, tolerance)
    report = inspect(ckpt, config, embedding, head)
    pair = report["pairs"][0]
    emb, hd, state = pair["embedding"], pair["head"], pair["state"]
    if "dimension_mismatch" in pair:
        raise CkptError(f"{ckpt.path}: shape mismatch: embedding {emb!r} has shape "
                        f"{pair['embedding_shape']}, head {hd!r} has shape {pair['head_shape']}"
                        f" ({pair['dimension_mismatch']})")
    if state.endswith("-missing"):
        raise CkptError(f"{ckpt.path}: missing key {(hd if state == 'head-missing' else emb)!r}"
                        f": the {state.removesuffix('-missing')} is not in the file, so there "
                        f"is nothing to {'tie' if to == 'tied' else 'untie'}")
    if emb is None or hd is None:
        raise CkptError(f"{ckpt.path}: the tied tensor is stored under {hd or emb!r} and the "
                        f"other key is unknown: give --embedding KEY --head KEY")
    e = ckpt.tensors.get(emb)
    h = ckpt.tensors.get(hd)
    if e is None or h is None:
        source = e if e is not None else h
        assert source is not None
        e = h = source
    if e.dtype != h.dtype:
        raise CkptError(f"{ckpt.path}: dtype mismatch: embedding {emb!r} is "
                        f"{pair['embedding_dtype']}, head {hd!r} is {pair['head_dtype']}")
    out: dict[str, torch.Tensor] = {}
    # the source's own record of this pair's tie (save_model's) no longer holds once rewritten
    meta = {k: v for k, v in ckpt.metadata.items()
            if not k.startswith("tyingspec.") and k not in (emb, hd)}
    # the source by name and content, never by an absolute path of the user's machine (that
    # would ship with the checkpoint)
    meta.update({"tyingspec.to": to, "tyingspec.source": os.path.basename(ckpt.path),
                 "tyingspec.source_sha256": _sha256(ckpt.path)})
    if policy is not None:
        meta["tyingspec.policy"] = policy
    refused = None
    if to == "tied":
        assert policy is not None
        matrix, refused = _tie_matrix(e, h, policy, 0.0 if tolerance is None else tolerance,
                                      ckpt.path)
        meta["tyingspec.tied"] = f"{emb}={hd}"
        for key, t in ckpt.tensors.items():
            if key == emb:
                out[emb] = matrix
                out[hd] = matrix
            elif key != hd:
                out[key] = t
        if emb not in ckpt.tensors:
            out[emb] = out[hd] = matrix
    else:
        for key, t in ckpt.tensors.items():
            if key in (emb, hd):
                continue
            out[key] = t
        # the head gets storage of its own; the embedding keeps the bits it had
        out[emb] = e
        out[hd] = h.clone() if same_storage(e, h) else h
    return Converted(out, meta, refused)


def _mode_for(target: str) -> int:
    """The mode OUT gets: the existing file's, else what the umask gives a new file (mkstemp
    alone would leave every OUT at 0600)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_reason(exc: Exception) -> str:
    """Why a write failed, in one line: the OS error behind it when there is one (safetensors
    reports ENOSPC as ``SafetensorError: ... I/O error: No space left on device (os error
    28)``)."""
    cause: BaseException | None = exc
    while cause is not None:
        # torch.save's zip writer, failing in its __exit__, raises a RuntimeError ("unexpected
        # pos") while handling the OSError of the write: the OSError is the reason
        if isinstance(cause, OSError):
            return cause.strerror or str(cause)
        cause = cause.__cause__ or cause.__context__
    found = re.search(r"os error (\d+)", str(exc))
    return os.strerror(int(found.group(1))) if found else first_line(exc)


class _WriteAll:
    """The ``write`` torch.save calls: every byte reaches the file descriptor, or the OS error
    that stopped it is raised."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]
        return len(data)

    def flush(self) -> None:
        pass


def _serialise(converted: Converted, fmt: str, tie: tuple[str, str] | None,
               fh: IO[bytes] | None, path: str | None) -> None:
    """Write ``converted`` to the open binary file ``fh``, or (safetensors, which writes by
    name) to ``path``."""
    if fmt == "safetensors":
        from safetensors.torch import save, save_file

        tensors = dict(converted.tensors)
        if tie is not None:
            tensors.pop(tie[1], None)  # safetensors holds one key of a tie, as save_model
        seen: set[tuple[int, int]] = set()  # (storage, offset) of each tensor written
        for key, t in tensors.items():
            # safetensors refuses tensors that share memory; a copy keeps the bits
            span = (int(t.untyped_storage().data_ptr()), int(t.storage_offset()))
            if span in seen or not t.is_contiguous():
                tensors[key] = t.contiguous().clone()
            seen.add(span)
        if path is not None:
            save_file(tensors, path, metadata=converted.metadata)
        else:
            assert fh is not None
            fh.write(save(tensors, metadata=converted.metadata))
    else:
        import torch

        sd: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(
            converted.tensors)
        # load_state_dict reads only "version" from this; the tyingspec keys ride along
        setattr(sd, "_metadata", collections.OrderedDict(  # noqa: B010
            {"": dict(converted.metadata)}))
        # through a writer that writes every byte or raises, so a full disk is an OSError
        # naming ENOSPC: given a path, or a file whose write() returns short, torch reports
        # only "[enforce fail at inline_container.cc] unexpected pos 1280 vs 1232"
        assert fh is not None
        torch.save(sd, cast("IO[bytes]", _WriteAll(fh.fileno())))


def write(converted: Converted, path: str, fmt: str, tie: tuple[str, str] | None) -> None:
    """Write OUT atomically (a temporary file beside it, renamed over it) keeping its mode, or
    as a stream when OUT is a device or pipe.  A failed write is a :class:`CkptError`, and
    leaves the previous OUT whole and no temporary file."""
    target = absolute(path)
    if is_stream(path):  # as given: /dev/stdout resolves to /proc/PID/fd/pipe:[N]
        try:
            with open_stream(path, binary=True) as fh:
                _serialise(converted, fmt, tie, fh, None)
        except Exception as exc:
            raise CkptError(f"OUT {path}: cannot be written ({_write_reason(exc)})") from exc
        return
    mode = _mode_for(target)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                                   dir=os.path.dirname(target))
        with os.fdopen(fd, "wb") as fh:
            if fmt == "safetensors":
                _serialise(converted, fmt, tie, None, tmp)
            else:
                _serialise(converted, fmt, tie, fh, None)
                fh.flush()
        with open(tmp, "rb") as check:
            os.fsync(check.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except Exception as exc:
        before = "the previous file is unchanged" if os.path.exists(target) else "nothing " \
            "was written"
        raise CkptError(f"OUT {path}: cannot be written ({_write_reason(exc)}); {before}"
                        ) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def write_text(option: str, path: str, text: str) -> None:
    """A JSON report or config: in place when ``path`` is a stream, else atomically."""
    stream = is_stream(path)
    try:
        atomic_write(path, text)  # in place for a stream
    except OSError as exc:
        raise CkptError(f"{option} {path}: cannot be written ({exc.strerror or exc})"
                        + ("" if stream else "; the previous file, if any, is unchanged")
                        ) from exc


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised where the program was, so every ``finally`` (the
    removal of a temporary file) runs before the process ends."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`Terminated` while the command runs.  Only a
    signal still at its default (which would end the process with OUT's temporary file left
    behind) is taken over, and only in the main thread, where Python runs handlers."""
    import threading

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for taken, old in previous.items():
            signal.signal(taken, old)
