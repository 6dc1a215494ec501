"""Where one warm `tyingspec.check` case goes at GPT-2 size: the engine's phases, timed.

    python -m benchmarks.bench_warm_phases

Checks ``benchmarks.torch_probe:tied_f32`` once (untimed: the worker loads), then once more with
each phase of the engine wrapped in a timer: building the batch, the reference, the worker's
calls (``Worker.collect``: waiting for the call, the first and the one after the SGD step),
judging, the SGD step.  One run; compare with ``bench_warm``'s one forward+backward.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tyingspec._src.engine.isolation as iso  # noqa: E402
import tyingspec._src.engine.observe as ob  # noqa: E402
from benchmarks.bench_check_timeline import wrapped  # noqa: E402
from tyingspec import check, standard_cases  # noqa: E402
from tyingspec._src.core.cases import at_shape  # noqa: E402
from tyingspec._src.kinds.table import KINDS as KIND_TABLE  # noqa: E402

TARGET = "benchmarks.torch_probe:tied_f32"
SPENT: dict[str, float] = collections.defaultdict(float)


def timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    return wrapped(label, f, lambda s, dt, name: SPENT.__setitem__(name, SPENT[name] + dt))


def main() -> int:
    # the reference is timed where the kind's table builds it (both calls' go through
    # _judged, which a second timer would count again)
    for name, label in (("batch_for", "build batch"), ("judge", "judge"),
                        ("sgd_step", "SGD step")):
        setattr(ob, name, timed(label, getattr(ob, name)))
    table_reference = KIND_TABLE["model"].reference
    for name in ("submit", "collect"):
        setattr(iso.Worker, name, timed(f"worker.{name}", getattr(iso.Worker, name)))
    cases, _ = at_shape(standard_cases(0), 50257, 768, 1024)
    case = replace(next(c for c in cases if c.name == "absent-tokens"), dtype="float32")

    def run() -> bool:
        return check(TARGET, "model", precision="float32", cases=[case], shrink_budget=0,
                     paths=[str(REPO)]).ok

    assert run()
    SPENT.clear()
    object.__setattr__(KIND_TABLE["model"], "reference", timed("reference", table_reference))
    t0 = time.perf_counter()
    assert run()
    print(f"one warm case at V=50257 d=768 N=1024 float32: {time.perf_counter() - t0:.2f} s")
    for k, v in sorted(SPENT.items(), key=lambda x: -x[1]):
        print(f"  {k:<26} {v:6.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
