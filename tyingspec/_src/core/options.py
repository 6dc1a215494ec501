"""argparse ``type=`` callables shared by the CLI, ``tyingspec mutants`` and the pytest plugin.

Standard library only: the plugin imports this at pytest start-up.
"""

from __future__ import annotations

import argparse
import os

from tyingspec._src.core.errors import TyingspecError

#: Seconds one call of user code may take before it is ended as an adapter error.
DEFAULT_TIMEOUT = 120.0
#: Seconds a run may spend shrinking its failing batches (each try is one more check).
DEFAULT_SHRINK_BUDGET = 5.0


def target_paths() -> tuple[str, ...]:
    """Where a ``module:attr`` target is looked up unless the caller says otherwise (first on
    its worker's ``sys.path``): the current directory, as ``python -m`` and uvicorn do.  The
    command's early worker is taken over only when its paths are these (see ``front.entry``)."""
    return (os.getcwd(),)


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None


def seed(text: str) -> int:
    """A seed: an integer >= 0."""
    v = _integer(text, "seed")
    if v < 0:
        raise argparse.ArgumentTypeError(f"seed must be >= 0, got {v}")
    return v


def positive_int(text: str) -> int:
    """A count: an integer >= 1."""
    v = _integer(text, "the value")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, e.g. ``3,3,7``."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 3,3,7; got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def shape(text: str) -> tuple[int, int, int]:
    """``V,d,N``: vocabulary size, width and batch length, each >= 1."""
    values = int_list(text)
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected V,d,N as three positive integers (e.g. 50257,768,1024), got {text!r}")
    return values[0], values[1], values[2]


def shrink_budget(text: str) -> float:
    """Seconds, a number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {v}")
    return v


def positive_seconds(text: str) -> float:
    """Seconds, a finite number > 0."""
    v = shrink_budget(text)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a number of seconds > 0, got 0")
    return v


class UsageError(TyingspecError, ValueError):
    """A command asked for something that cannot be run as given (exit status 2, one line).

    Raised below the command line (a check that would run no case, a replay's batch outside the
    vocabulary, a missing extra); the CLI prints the message and exits 2, the pytest plugin
    turns it into ``pytest.UsageError``.  Never a gradient verdict.
    """


#: Where the available memory is read from (Linux); elsewhere see :func:`available_memory`.
MEMINFO = "/proc/meminfo"


def available_memory(meminfo: str = MEMINFO) -> int | None:
    """Bytes this machine can give a new allocation without swapping: ``MemAvailable`` from
    ``meminfo``, else the free physical pages ``sysconf`` reports, else None (unknown: nothing
    is refused on a guess)."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    value, _, unit = rest.strip().partition(" ")
                    return int(value) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    import os

    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def byte_text(n: float) -> str:
    """``n`` bytes for a person: ``3.4 GiB``, ``5.6 PiB``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{int(n)} B" if i == 0 else f"{n:.3g} {units[i]}"
