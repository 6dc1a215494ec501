"""What a running check is doing, shown while it runs: the case, the phase, the seconds.

A torch case can take most of a minute and a check at production size several; the report
prints a case only when it ends, so a check that looks hung and one that is judging cannot be
told apart.  Once a run has lasted :data:`DELAY` seconds (a quick check says nothing):

* on a terminal (stderr a TTY), one status line on stderr, redrawn in place every
  :data:`TICK` seconds and at each phase: ``case repeated-tokens (2 of 4): judging (3.1 s)``;
  it is cleared before each case's report is printed, so it never mixes with the report;
* elsewhere (a pipe, a CI log), one line on stderr when a case starts and one when it ends,
  with its seconds, so a log shows which case a killed job was in.

The phases are the engine's (``calling``, ``reference``, ``judging``, ``second call``: see
``engine.observe.phases_to``) and the check's own (``loading``, ``shrinking``); a torch or
JAX model's own checks run inside its call and show as ``calling``.  ``--quiet`` shows none.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TextIO

#: Seconds a run lasts before anything is shown: a check of a few milliseconds a case stays as
#: it was, a report and nothing else.
DELAY = 2.0
#: Seconds between redraws of the terminal's status line (its elapsed time moves on).
TICK = 0.5


class Progress:
    """A run's progress on ``stream`` (stderr): a status line when ``tty`` (default: whether
    ``stream`` is a terminal), else a line per case start and end.  Call :meth:`close` at the
    end (it clears the status line)."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None, delay: float | None = None,
                 tick: float = TICK, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.tty = _isatty(stream) if tty is None else tty
        self.delay = DELAY if delay is None else delay
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._what = ""  # the current activity ("case repeated-tokens (2 of 4)"), "" between
        self._since = self._start  # when it began
        self._phase = ""
        self._announced = False  # a line saying the current activity started was written
        self._drawn = 0  # characters of the status line on the screen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, args=(tick,), daemon=True,
                                        name="tyingspec-progress")
        self._thread.start()

    # -- what the check says

    def loading(self, target: str) -> None:
        """The target is being loaded (a worker importing torch takes seconds)."""
        self._begin(f"loading {target}", "")

    def case_started(self, name: str, index: int, total: int) -> None:
        self._begin(f"case {name} ({index} of {total})", "")

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase = name
            self._show()

    def case_ended(self, status: str, seconds: float) -> None:
        with self._lock:
            if self._what and self._shown():
                if self.tty:
                    self._erase()
                else:
                    self._announce()
                    self._write(f"tyingspec: {self._what}: {status.replace('_', ' ')} in "
                                f"{seconds:.1f} s\n")
            self._what, self._phase = "", ""

    def close(self) -> None:
        """Stop redrawing and clear the status line."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._erase()
            self._what = ""

    # -- drawing

    def _begin(self, what: str, phase: str) -> None:
        with self._lock:
            self._what, self._phase = what, phase
            self._since, self._announced = self._clock(), False
            self._show()

    def _shown(self) -> bool:
        return self._clock() - self._start >= self.delay

    def _show(self) -> None:
        if not self._what or not self._shown():
            return
        if self.tty:
            self._draw()
        else:
            self._announce()

    def _announce(self) -> None:
        if self._announced:
            return
        self._announced = True
        late = self._clock() - self._since
        ago = f" ({late:.1f} s ago)" if late >= 0.05 else ""
        self._write(f"tyingspec: {self._what}: started{ago}\n")

    def _draw(self) -> None:
        text = f"tyingspec: {self._what}" + (f": {self._phase}" if self._phase else "") + \
            f" ({self._clock() - self._since:.1f} s)"
        text = text[:max(20, _columns(self.stream) - 1)]  # one line, or \r cannot redraw it
        self._write("\r" + text.ljust(self._drawn))  # the spaces clear a longer line's end
        self._drawn = len(text)

    def _erase(self) -> None:
        if self._drawn:
            self._write("\r" + " " * self._drawn + "\r")
            self._drawn = 0

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed stderr: the check goes on without its progress

    def _tick(self, tick: float) -> None:
        while not self._stop.wait(tick):
            with self._lock:
                self._show()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 100
    return columns or 100  # a terminal that has not said its size (a bare pty) says 0
