"""The tests the pytest plugin adds to a run: one Hypothesis test per property.

``pytest --tyingspec-adapter=module:attr`` collects these as the module ``tyingspec`` (node ids
``tyingspec::test_<property>``).  :func:`build_module` makes them for one configuration (adapter,
kind, profile, optional replay); the order is the sorted property names, so every xdist worker
collects the same ids in the same order.  Each test is a real ``@given`` function, so Hypothesis'
pytest integration (shrinking, the falsifying example, statistics, the database) applies.

Replay strings (what a failure prints after ``--tyingspec-replay=``) carry the drawn parameters
rather than a ``@reproduce_failure`` blob, which is not stable across Hypothesis versions.  A
drawn case is its shapes and one seed, every array built from the seed, so the parameters that
differ from a case's defaults are the whole key::

    sum_of_paths V=2 d=1 N=1 seed=0 bias=False
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from tyingspec._src.core.options import DEFAULT_TIMEOUT, available_memory

if TYPE_CHECKING:
    from tyingspec._src.core.cases import Case
    from tyingspec._src.core.kind import KindSpec
    from tyingspec._src.engine.observe import Target
    from tyingspec.properties import Property

# numpy, sympy and the properties load inside the functions that need them: the plugin's report
# header calls profile_settings in the xdist controller, which never runs a property.

#: Hypothesis settings each profile changes; everything else comes from the base profile (the
#: user's current default, or Hypothesis' built-in ``ci`` profile for ``ci``).
PROFILES: dict[str, dict[str, Any]] = {
    "dev": {"max_examples": 30},
    "ci": {"max_examples": 60, "derandomize": True},
    "thorough": {"max_examples": 400},
}

#: Attribute on an AdapterError or PropertyFailure naming the case Hypothesis drew for it (read
#: by the plugin's report: the replay line replays that case, the property builds the rest).
CASE_ATTR = "tyingspec_case"
#: Attribute of the built module: per property, how many examples ran to a verdict
#: (``decided``) and how many were discarded as no evidence (``discarded``: no power, or
#: nothing to check).  The plugin reads it when Hypothesis ends a run for its discards: with
#: none decided, the property had no power (never a failure, which means a wrong gradient).
EXAMPLES_ATTR = "tyingspec_examples"


def profile_settings(profile: str, max_examples: int | None = None, *,
                     replay: bool = False) -> settings:
    """Settings for the property tests only; a user's loaded profile stays theirs otherwise."""
    if profile not in PROFILES:
        raise ValueError(f"unknown tyingspec profile {profile!r}; expected one of "
                         + ", ".join(PROFILES))
    base = settings()  # the current default profile: the user's, or Hypothesis' own
    changes = dict(PROFILES[profile])
    if profile == "ci":
        # Hypothesis' own ci profile, extended; keep only the verbosity a user asked for
        # (--hypothesis-verbosity sets it on the default profile).
        base = settings(settings.get_profile("ci"), verbosity=base.verbosity)
    if max_examples is not None:
        changes["max_examples"] = max_examples
    if replay:
        changes["phases"] = (Phase.explicit,)
    else:
        # Without the explain phase: with it (Hypothesis 6.155) the reported example is one of
        # explain's variations, not the shrunk minimum (seen: V=8 d=8 N=20 instead of V=2 d=1
        # N=1 for a dropped input path), which defeats "smallest failing batch".
        changes["phases"] = tuple(p for p in base.phases if p is not Phase.explain)
    # The sympy reference compiles once per shape (0.5-2 s): no deadline, no too_slow check.
    # One failure per property is reported (the shrunk one), so the diagnosis leads the output.
    suppressed = [*base.suppress_health_check]
    if HealthCheck.too_slow not in suppressed:
        suppressed.append(HealthCheck.too_slow)
    return settings(base, deadline=None, report_multiple_bugs=False,
                    suppress_health_check=suppressed, **changes)


def property_names(kind: KindSpec) -> list[str]:
    """The properties that apply to ``kind``, in the order every worker collects them."""
    return sorted(kind.properties)


def _make_test(prop: Property, chosen: settings, replay: Case | None,
               tally: dict[str, int]) -> Callable[..., None]:
    from hypothesis.errors import UnsatisfiedAssumption

    # lazy: numpy (cases, adapters, observe) and the properties, not in the xdist controller
    from tyingspec._src.core.adapters import AdapterError
    from tyingspec.properties import PropertyFailure, label_locked

    check = label_locked(prop.check)

    def test_property(tyingspec_target: Target, case: Case) -> None:
        try:
            check(tyingspec_target, case)
        except UnsatisfiedAssumption:
            tally["discarded"] += 1
            raise
        except (AdapterError, PropertyFailure) as exc:
            setattr(exc, CASE_ATTR, case)
            raise
        tally["decided"] += 1

    test_property.__name__ = test_property.__qualname__ = f"test_{prop.name}"
    test_property.__doc__ = f"[{prop.invariant}] {prop.doc}"
    # Every generated test has the same source, which is what Hypothesis hashes for its
    # database key; add the property name so examples saved for one never replay into another.
    test_property._hypothesis_internal_add_digest = prop.name.encode()  # type: ignore[attr-defined]
    fn: Callable[..., None] = test_property
    if replay is not None:
        fn = example(case=replay)(fn)
    return chosen(given(case=prop.strategy())(fn))


def build_module(spec: str, kind: KindSpec, profile: str, max_examples: int | None = None,
                 replay: tuple[str, Case] | None = None, precision: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT, paths: tuple[str, ...] = (),
                 ) -> types.ModuleType:
    """A module object holding the session fixture ``tyingspec_target`` and one test per
    property (only the replayed one with ``replay``)."""
    # lazy: numpy (cases, adapters, observe) and the properties, not in the xdist controller
    from tyingspec._src.engine.observe import load
    from tyingspec.properties import PROPERTIES

    module = types.ModuleType("tyingspec._src.front.suite", __doc__)
    module.__file__ = __file__

    @pytest.fixture(scope="session", name="tyingspec_target")
    def tyingspec_target() -> Iterator[Target]:
        # Resolved lazily in each process (xdist workers included): only the spec string
        # crosses process boundaries.  An AdapterError here errors every property's setup.
        # A module:attr adapter runs in its own worker process (one per xdist worker): its
        # crash, exit or hang fails the property that called it, not the pytest run.
        target = load(spec, kind, precision, timeout=timeout, paths=paths)  # type: ignore[arg-type]
        yield target
        target.close()

    module.tyingspec_target = tyingspec_target  # type: ignore[attr-defined]
    chosen = profile_settings(profile, max_examples, replay=replay is not None)
    if kind.own_shape:
        # a model's batch shape is its own (torch): shrinking cannot make the batch smaller,
        # only re-run the model on other tokens
        from hypothesis import Phase

        chosen = settings(chosen, phases=[p for p in chosen.phases if p is not Phase.shrink])
    names = [replay[0]] if replay is not None else property_names(kind)
    examples: dict[str, dict[str, int]] = {}
    setattr(module, EXAMPLES_ATTR, examples)
    for name in names:
        tally = examples[name] = {"decided": 0, "discarded": 0}
        test = _make_test(PROPERTIES[name], chosen, replay[1] if replay is not None else None,
                          tally)
        setattr(module, f"test_{name}", test)
    return module


# --- replay strings ---------------------------------------------------------------------------

def _format_value(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return repr(value)  # round-trips exactly
    return str(value)


#: Fields every replay string names (parse_replay needs them), default or not.
REPLAY_REQUIRED = ("V", "d", "N", "seed")


def format_replay(prop: str, case: Case) -> str:
    """``PROPERTY key=value ...``: V, d, N, seed and every other field of ``case`` (its name
    aside) that differs from its default; :func:`parse_replay` fills the defaults back in."""
    # lazy: numpy (cases, adapters, observe) and the properties, not in the xdist controller
    from tyingspec._src.core.cases import Case

    parts = [prop] + [f"{f.name}={_format_value(getattr(case, f.name))}"
                      for f in dataclasses.fields(Case) if f.name != "name" and
                      (f.name in REPLAY_REQUIRED or getattr(case, f.name) != f.default)]
    return " ".join(parts)


def replay_key(kind: KindSpec, drawn: Case, ran: Case | None) -> Case:
    """The case a replay line names: the one Hypothesis drew (its batch is built from it, as
    the run built it).  A model with its own shape (torch) runs every draw at its own V, d and
    N (engine.observe.own_case), so those are printed rather than the drawn ones, which
    never ran; the replay is the same."""
    if ran is None or drawn.tokens is not None or not kind.own_shape:
        return drawn
    return dataclasses.replace(drawn, V=ran.V, d=ran.d, N=ran.N)


def _parse_value(key: str, annotation: str, text: str) -> object:
    optional = "None" in annotation
    if optional and text == "None":
        return None
    if "tuple" in annotation:
        try:
            return tuple(int(v) for v in text.split(",") if v != "")
        except ValueError:
            raise ValueError(f"{key}: expected comma-separated integers, got {text!r}") from None
    if annotation.startswith("bool"):
        if text not in ("True", "False", "1", "0"):
            raise ValueError(f"{key}: expected True or False, got {text!r}")
        return text in ("True", "1")
    for typ in (int, float):
        if annotation.startswith(typ.__name__):
            try:
                return typ(text)
            except ValueError:
                raise ValueError(f"{key}: expected {typ.__name__}, got {text!r}") from None
    return text


def parse_replay(text: str) -> tuple[str, Case]:
    """Inverse of :func:`format_replay`; raises ValueError naming the bad part."""
    # lazy: numpy (cases, adapters, observe) and the properties, not in the xdist controller
    from tyingspec._src.core.cases import Case

    prop, *pairs = text.split()
    fields = {f.name: str(f.type) for f in dataclasses.fields(Case) if f.name != "name"}
    values: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"expected key=value with key one of {', '.join(fields)}; "
                             f"got {pair!r}")
        values[key] = _parse_value(key, fields[key], raw)
    missing = [k for k in REPLAY_REQUIRED if k not in values]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (a replay needs at least V, d, N, seed)")
    return prop, Case(name="replay", **values)  # type: ignore[arg-type]


def replay_problem(kind: KindSpec, case: Case) -> str | None:
    """Why a parsed replay cannot be run on ``kind`` as given (a usage error, before any test
    runs); None when it can.  Without this a typo in an option is dropped silently and the
    broken kernel passes, and a token beyond V is a traceback inside the adapter.  A torch
    model's vocabulary is known only once it is loaded: its token ids are checked then
    (:func:`replay_problem_at`)."""
    # lazy: numpy (cases, adapters, observe) and the properties, not in the xdist controller
    from tyingspec._src.core.cases import (
        COMPOSITIONS,
        SHAPED_COMPOSITIONS,
        batch_problem,
        memory_problem,
    )
    small = [f"{k}={getattr(case, k)}" for k in ("V", "d", "N") if getattr(case, k) < 1]
    if small:
        return f"{', '.join(small)}: V, d and N must be >= 1"
    if case.seed < 0:
        return f"seed={case.seed}: a seed is >= 0"
    if case.composition not in COMPOSITIONS + SHAPED_COMPOSITIONS:
        return (f"composition={case.composition}: expected one of "
                + ", ".join(COMPOSITIONS + SHAPED_COMPOSITIONS))
    if case.dtype not in ("float64", "float32", "bfloat16", "float16"):
        return f"dtype={case.dtype}: expected float64, float32, bfloat16 or float16"
    if case.padding_idx is not None and not 0 <= case.padding_idx < case.V:
        return f"padding_idx={case.padding_idx}: no such row (expected 0 <= padding_idx < V)"
    if case.ce and kind.options_problem is None:
        return f"ce={case.ce}: linear-ce options apply to --tyingspec-kind=linear-ce only"
    if case.ce and kind.options_problem is not None:
        problem = kind.options_problem(case.ce)
        if problem is not None:
            return problem
    own = kind.own_shape
    ignore = kind.ignore_index(case.ce)
    # an own-shape kind's V is the model's, not yet known: no id beyond it is refused here
    problem = batch_problem(case.tokens, case.targets, None if own else case.V,
                            ignore_index=ignore)
    if problem is not None:
        return f"tokens/targets: {problem}"
    if not own:
        return memory_problem(case.V, case.d, case.N, available_memory())
    return None


def replay_problem_at(target: Target, case: Case) -> str | None:
    """What :func:`replay_problem` can only check with the target loaded: the token ids at
    its own shape (a torch model's V), and that a linear-ce kernel declares each option the
    replay sets (a property would otherwise drop it from the case, silently)."""
    # lazy: numpy (cases, adapters, observe) and the properties, not in the xdist controller
    from tyingspec._src.core.cases import batch_problem
    from tyingspec._src.engine.observe import own_case, runnable

    why = runnable(target, case)
    if why is not None:
        return f"the replayed case {why}"
    if case.tokens is None:
        return None
    at = own_case(target, case)
    problem = batch_problem(at.tokens, at.targets, at.V)
    return None if problem is None else f"tokens/targets: {problem} (the model's vocabulary)"
