"""argparse ``type=`` callables shared by the CLI, ``tyingspec mutants`` and the pytest plugin.

Standard library only: the plugin imports this at pytest start-up.
"""

from __future__ import annotations

import argparse

#: Seconds one call of user code may take before it is ended as an adapter error.
DEFAULT_TIMEOUT = 120.0
#: Seconds a failing case may spend shrinking its batch (each try is one more check).
DEFAULT_SHRINK_BUDGET = 5.0


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
