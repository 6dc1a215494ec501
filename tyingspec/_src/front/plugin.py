"""pytest plugin: run tyingspec's property suite against your adapter, in your repository.

::

    pytest --tyingspec-adapter=mypkg.grads:tied_model [--tyingspec-kind=model|kernel]
           [--tyingspec-profile=dev|ci|thorough] [-n auto]
           [--tyingspec-baseline=FILE [--tyingspec-update-baseline]] [--tyingspec-summary=FILE]
           [--tyingspec-html=FILE]

Without ``--tyingspec-adapter`` the plugin does nothing: it is installed into every pytest run
of anyone who installs tyingspec.  This module imports only the standard library and pytest;
numpy, sympy and Hypothesis load when the suite is actually collected.

How the tests appear with no conftest and no test files: the plugin appends the path of
``_src/front/suite.py`` to the run's arguments and, when pytest asks for that file's module,
returns a module collector (node id ``tyingspec``) whose object is built by
``front.suite.build_module`` for this configuration: one real ``@given`` test per property,
in sorted order.  Every process (the controller and each xdist worker) parses the same command
line and builds the same ids in the same order; the adapter travels as its ``module:attr``
string and is resolved in each process.

Progress: the controller writes a line when each property starts and when it ends, with its
verdict and seconds (under ``-n`` the workers' own output is captured, but xdist forwards each
test's start and reports to the controller); ``pytest -q`` leaves them out.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import shlex
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tyingspec._src.core.options import DEFAULT_TIMEOUT, positive_int, positive_seconds
from tyingspec._src.kinds.table import DEFAULT_KIND, KIND_NAMES, kind_spec

SUITE_PATH = Path(__file__).with_name("suite.py").resolve()
SUITE_NODEID = "tyingspec"
TEST_PREFIX = f"{SUITE_NODEID}::test_"
EXIT_ADAPTER = 2
KINDS = KIND_NAMES  # the table's names (it imports no numpy until a kind is used)
PROFILES = ("dev", "ci", "thorough")
PRECISIONS = ("auto", "float64", "float32", "bfloat16", "float16")
#: user_properties keys the workers attach to each property's report (builtin strings only:
#: they cross xdist's process boundary and end up in --junitxml).
PROP_NAME, PROP_INVARIANT, PROP_VERDICT, PROP_DIAGNOSIS, PROP_DETAIL = (
    "tyingspec_property", "tyingspec_invariant", "tyingspec_verdict", "tyingspec_diagnosis",
    "tyingspec_detail")
#: A property's verdict when no example it drew had the power to decide (``front.baseline``'s
#: NO_POWER: the baseline records it as such).
NO_POWER = "no_power"



# --- option values ---------------------------------------------------------------------------

def _adapter(text: str) -> str:
    if ":" in text:
        module, _, attr = text.partition(":")
        dotted = all(p.isidentifier() for p in module.split(".")) and \
            all(p.isidentifier() for p in attr.split("."))  # Unicode names, as Python allows
        if not dotted:
            raise argparse.ArgumentTypeError(
                "expected module:attr with dotted Python names on both sides "
                f"(e.g. mypkg.grads:tied_model), got {text!r}")
    elif not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", text):
        raise argparse.ArgumentTypeError(
            f"expected module:attr (e.g. mypkg.grads:tied_model) or a built-in name "
            f"(e.g. tied), got {text!r}")
    return text


def _choice(name: str, choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"expected {name} {' or '.join(choices)}, got {text!r}")
        return text

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _file(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got an empty string")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file path, got the directory {text!r}")
    return os.path.abspath(text)  # resolved once: an adapter's os.chdir cannot move it


def _replay(text: str) -> str:
    # Cheap syntax check here; the full parse (which needs tyingspec's Case) runs at configure.
    prop, *pairs = text.split() or [""]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prop) or not pairs or \
            not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", p) for p in pairs):
        raise argparse.ArgumentTypeError(
            "expected 'PROPERTY key=value ...' as printed in a failure's replay line "
            f"(e.g. 'sum_of_paths V=2 d=1 N=1 seed=0 ...'), got {text!r}")
    return text


#: The options that take a value.  Each is declared ``action="append"`` so that a value given
#: twice is seen (argparse's ``store`` keeps the last one and drops the first in silence: with
#: ``--tyingspec-adapter=buggy:f --tyingspec-adapter=good:f`` the buggy adapter never ran and the
#: job passed); :func:`_once` refuses two different values as a usage error.
VALUED = ("tyingspec_adapter", "tyingspec_kind", "tyingspec_precision", "tyingspec_timeout",
          "tyingspec_profile", "tyingspec_max_examples", "tyingspec_baseline",
          "tyingspec_summary", "tyingspec_replay", "tyingspec_html")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tyingspec", "tyingspec: tied-embedding gradient properties")
    once = {"action": "append", "default": None}
    group.addoption("--tyingspec-adapter", metavar="MODULE:ATTR", type=_adapter, **once,
                    help="run tyingspec's property suite against this adapter (module:attr, "
                         "or a built-in name); without it the plugin does nothing; one per run")
    group.addoption("--tyingspec-kind", type=_choice("kind", KINDS), **once,
                    help="adapter contract: model (E, W, b, tokens, targets -> loss, dE, dW, "
                         "db) or kernel (tokens, dx, h, g, V -> dE); default model")
    group.addoption("--tyingspec-precision", type=_choice("precision", PRECISIONS), **once,
                    help="precision to build cases in and judge at: auto (default: the least "
                         "precise float the adapter returns), float64, float32, bfloat16, "
                         "float16")
    group.addoption("--tyingspec-timeout", metavar="SECONDS", type=positive_seconds, **once,
                    help="seconds one call of the adapter may take before it fails the "
                         f"property as an adapter error (default {DEFAULT_TIMEOUT:g})")
    group.addoption("--tyingspec-profile", type=_choice("profile", PROFILES), **once,
                    help="Hypothesis settings for the property tests: dev (fast), ci "
                         "(derandomized; the default when $CI is set), thorough (hundreds of "
                         "examples); default dev")
    group.addoption("--tyingspec-max-examples", metavar="N", type=positive_int, **once,
                    help="override the profile's max_examples")
    group.addoption("--tyingspec-baseline", metavar="FILE", type=_file, **once,
                    help="regression gate: record each property's verdict in FILE (if missing; "
                         "under CI, $CI set, a missing FILE fails the run: commit it) and fail "
                         "the run if a property that passed there fails now")
    group.addoption("--tyingspec-update-baseline", action="store_true", default=False,
                    help="write --tyingspec-baseline FILE with this run's verdicts, whether it "
                         "exists or not (also under CI)")
    group.addoption("--tyingspec-summary", metavar="FILE", type=_file, **once,
                    help="append a markdown summary (property | invariant | verdict | "
                         "diagnosis) to FILE, e.g. $GITHUB_STEP_SUMMARY")
    group.addoption("--tyingspec-replay", metavar="CASE", type=_replay, **once,
                    help="run one property on one batch, as printed by a failure's replay line")
    group.addoption("--tyingspec-html", metavar="FILE", type=_file, **once,
                    help="after the properties, run `tyingspec check`'s cases once and draw "
                         "their rows into FILE (HTML, and a PNG beside it with matplotlib); "
                         "--tyingspec-summary links it")


def _once(config: pytest.Config, dest: str) -> Any:
    """The one value of a tyingspec option (None when not given).  Given more than once
    with different values, a usage error naming them: the plugin checks one adapter, at one
    kind, precision and so on, per run, and keeping the last value would drop the others
    without a word.  The same value twice (an ini file's addopts repeated on the command line)
    drops nothing and is accepted."""
    values: list[Any] | None = config.getoption(dest)
    if not values:
        return None
    distinct = list(dict.fromkeys(values))
    if len(distinct) > 1:
        flag = "--" + dest.replace("_", "-")
        also = ("; to check several adapters, run pytest once per adapter"
                if dest == "tyingspec_adapter" else "")
        raise pytest.UsageError(
            f"{flag} given {len(values)} times with different values "
            f"({', '.join(repr(v) for v in distinct)}): a run takes one, and keeping the last "
            f"would drop the others without a word; give it once (the command line, "
            f"PYTEST_ADDOPTS and the ini file's addopts all count){also}")
    return distinct[0]


# --- configuration ---------------------------------------------------------------------------

def _in_ci() -> bool:
    # The same test Hypothesis uses to load its built-in ci profile, so the two agree.
    return "CI" in os.environ or "TF_BUILD" in os.environ


@dataclass(frozen=True)
class Options:
    """The plugin's options for one run: builtin values only (every process parses its own)."""

    adapter: str
    kind: str
    profile: str
    max_examples: int | None
    baseline: str | None
    update_baseline: bool
    summary: str | None
    replay: str | None
    precision: str = "auto"
    timeout: float = DEFAULT_TIMEOUT
    paths: tuple[str, ...] = ()
    html: str | None = None  # --tyingspec-html FILE

    def command(self, *extra: str) -> str:
        """A pytest command line that reruns the property suite with these options."""
        args = ["pytest", f"--tyingspec-adapter={self.adapter}", f"--tyingspec-kind={self.kind}"]
        if self.precision != "auto":
            args.append(f"--tyingspec-precision={self.precision}")
        return shlex.join([*args, *extra])


def _options(config: pytest.Config) -> Options | None:
    value = {dest: _once(config, dest) for dest in VALUED}
    update_baseline = bool(config.getoption("tyingspec_update_baseline"))
    adapter: str | None = value["tyingspec_adapter"]
    if adapter is None:
        stray = [f"--{n.replace('_', '-')}" for n in
                 ("tyingspec_profile", "tyingspec_max_examples", "tyingspec_baseline",
                  "tyingspec_summary", "tyingspec_replay", "tyingspec_html")
                 if value[n] is not None]
        stray += ["--tyingspec-update-baseline"] if update_baseline else []
        if stray:
            raise pytest.UsageError(f"{', '.join(stray)} given without --tyingspec-adapter; "
                                    "name the adapter to check, e.g. "
                                    "--tyingspec-adapter=mypkg.grads:tied_model")
        return None
    if update_baseline and value["tyingspec_baseline"] is None:
        raise pytest.UsageError("--tyingspec-update-baseline needs --tyingspec-baseline=FILE")
    from tyingspec._src.core.files import OutputError, check_distinct

    try:
        check_distinct({"--tyingspec-baseline": value["tyingspec_baseline"],
                         "--tyingspec-summary": value["tyingspec_summary"],
                         "--tyingspec-html": value["tyingspec_html"],
                         "--junitxml": config.getoption("xmlpath", None)})
    except OutputError as exc:
        raise pytest.UsageError(str(exc)) from None
    kind = value["tyingspec_kind"] or DEFAULT_KIND
    precision = value["tyingspec_precision"] or "auto"
    _require_extras(adapter, kind, precision)
    profile = value["tyingspec_profile"] or ("ci" if _in_ci() else "dev")
    timeout = value["tyingspec_timeout"]
    return Options(adapter, kind, profile, value["tyingspec_max_examples"],
                   value["tyingspec_baseline"], update_baseline, value["tyingspec_summary"],
                   value["tyingspec_replay"], precision,
                   DEFAULT_TIMEOUT if timeout is None else timeout, _import_paths(config),
                   value["tyingspec_html"])


def _require_extras(adapter: str, kind: str, precision: str) -> None:
    """A missing extra is a usage error naming its ``pip install`` (pytest's exit status 4),
    raised before any test runs: as test failures (exit 1, "6 failed") it would read as wrong
    gradients."""
    from tyingspec._src.core.extras import MissingExtra, require, require_run
    from tyingspec._src.kinds.table import needs

    try:
        # the kind's own module from its table line, without loading the kind (numpy)
        require_run(kind, precision, flag="--tyingspec-", needs=needs(kind))
        if ":" not in adapter:
            # a built-in can need more than its kind (a linear-ce built-in that is a torch
            # module): the same rule as ``tyingspec check``
            from tyingspec._src.kinds.table import KINDS as TABLE

            spec = TABLE[kind]
            module = None if spec.builtin_needs is None else spec.builtin_needs(adapter)
            if module is not None:
                require(module, f"the built-in {adapter} (a {module} module)")
    except MissingExtra as exc:
        raise pytest.UsageError(f"tyingspec: {exc}") from None


def _import_paths(config: pytest.Config) -> tuple[str, ...]:
    # `pytest` (the console script) does not put the current directory on sys.path the way
    # `python -m pytest` does; an adapter module at the repository root must import either way
    # (in the worker process that imports it).
    return (str(config.invocation_params.dir), str(config.rootpath))


def pytest_configure(config: pytest.Config) -> None:
    opts = _options(config)
    if opts is None:
        return
    replay = None
    if opts.replay is not None:
        from tyingspec._src.front.suite import parse_replay, replay_problem

        try:
            replay = parse_replay(opts.replay)
        except (ValueError, TypeError) as exc:
            raise pytest.UsageError(f"--tyingspec-replay: {exc}") from None
        problem = replay_problem(kind_spec(opts.kind), replay[1])
        if problem is not None:
            raise pytest.UsageError(f"--tyingspec-replay: {problem}")
    if str(SUITE_PATH) not in config.args:
        config.args.append(str(SUITE_PATH))
    config.pluginmanager.register(_Suite(opts, replay), "tyingspec-suite")
    if not hasattr(config, "workerinput"):  # the controller (or the only process)
        config.pluginmanager.register(_Controller(config, opts), "tyingspec-controller")


# --- collection and reports (every process) ---------------------------------------------------

class _SuiteModule(pytest.Module):
    """The shipped suite as a module collector; its object is built, not imported by path."""

    def _getobj(self) -> Any:
        from tyingspec._src.front.suite import build_module

        plugin = self.config.pluginmanager.get_plugin("tyingspec-suite")
        assert isinstance(plugin, _Suite)
        opts = plugin.opts
        return build_module(opts.adapter, kind_spec(opts.kind), opts.profile, opts.max_examples,
                            plugin.replay, opts.precision, opts.timeout, opts.paths)

    def funcnamefilter(self, name: str) -> bool:
        # Our names, whatever the user's python_functions ini says.
        return name.startswith("test_")

    def classnamefilter(self, name: str) -> bool:
        return False


@dataclass(eq=False)  # pluggy keeps plugins in sets: identity hash
class _Suite:
    opts: Options
    replay: tuple[str, Any] | None

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makemodule(self, module_path: Path,
                                    parent: pytest.Collector) -> pytest.Module | None:
        if module_path.resolve() != SUITE_PATH:
            return None
        return _SuiteModule.from_parent(parent, path=module_path, name=SUITE_NODEID,
                                        nodeid=SUITE_NODEID)

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        from tyingspec._src.front.suite import profile_settings

        s = profile_settings(self.opts.profile, self.opts.max_examples)
        return [(f"tyingspec: adapter {self.opts.adapter!r} ({self.opts.kind}), profile "
                f"{self.opts.profile} (max_examples={s.max_examples}, "
                f"derandomize={s.derandomize})")]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item,
                                  call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        ours = isinstance(item.parent, _SuiteModule)
        exc = call.excinfo.value if call.excinfo is not None else None
        said: dict[str, str] = {}
        if ours and (call.when == "call" or exc is not None):
            props = self._properties(item, exc)
            said = dict(props)
            item.user_properties.extend(props)
        if ours:
            # Hypothesis would write a patch adding @example(...) to the failing test's source:
            # here that is tyingspec's installed suite.py, not the user's code.  The replay
            # line below carries the same example.
            item.__dict__.pop("_hypothesis_failing_examples", None)
        report: pytest.TestReport = yield
        verdict = said.get(PROP_VERDICT)
        if exc is not None and call.when == "call" and verdict in (NO_POWER, "passed"):
            # Hypothesis stopped drawing because the examples were discarded (see
            # _gave_up): never a failure, which would read as a wrong gradient.  No example
            # decided: no power, a skip that says so; some decided, and passed: a pass.
            if verdict == NO_POWER:
                path, line, _ = item.location
                report.outcome = "skipped"
                report.longrepr = (path, (line or 0) + 1,
                                   f"tyingspec: no power: {said[PROP_DETAIL]}")
            else:
                report.outcome, report.longrepr = "passed", None
        elif ours and report.failed and exc is not None:
            longrepr = self._longrepr(item, exc)
            if longrepr is not None:
                report.longrepr = longrepr
        return report

    # -- what the report says

    @staticmethod
    def _property(item: pytest.Item) -> str:
        return item.nodeid[len(TEST_PREFIX):]

    def _properties(self, item: pytest.Item, exc: BaseException | None) -> list[tuple[str, str]]:
        from tyingspec._src.core.adapters import AdapterError
        from tyingspec.properties import PROPERTIES, PropertyFailure

        name = self._property(item)
        prop = PROPERTIES.get(name)
        detail = ""
        gave_up = _gave_up(item, name, exc)
        if exc is None:
            verdict, diagnosis = "passed", ""
        elif gave_up is not None:
            decided, discarded = gave_up
            if decided:
                verdict, diagnosis = "passed", ""
                detail = (f"{decided} examples had the power to decide, and passed; Hypothesis "
                          f"stopped drawing after {discarded} were discarded")
            else:
                verdict, diagnosis = NO_POWER, ("no example had the power to decide: a "
                                                "gradient with a path dropped would pass here "
                                                "too")
                detail = (f"all {discarded} examples drawn were discarded, none decided "
                          f"({type(exc).__name__})")
        elif isinstance(exc, PropertyFailure):
            verdict = exc.label
            if exc.diagnosis is not None:
                diagnosis, detail = exc.diagnosis.headline(), exc.diagnosis.detail
            else:
                diagnosis = detail = exc.headline
        elif isinstance(exc, AdapterError):
            verdict, diagnosis = "adapter_error", str(exc)
        elif isinstance(exc, pytest.skip.Exception):
            verdict, diagnosis = "skipped", str(exc)
        elif isinstance(exc, AssertionError):
            verdict, diagnosis = "property_violated", str(exc).split("\n", 1)[0]
        else:
            verdict, diagnosis = "error", f"{type(exc).__name__}: {exc}".split("\n", 1)[0]
        return [(PROP_NAME, name), (PROP_INVARIANT, prop.invariant if prop else ""),
                (PROP_VERDICT, verdict), (PROP_DIAGNOSIS, diagnosis), (PROP_DETAIL, detail)]

    def _replay_line(self, prop: str, case: Any) -> str:
        from tyingspec._src.front.suite import format_replay

        return self.opts.command(f"-k=test_{prop}",
                                 f"--tyingspec-replay={format_replay(prop, case)}")

    def _crash_location(self, item: pytest.Item) -> tuple[str, int]:
        # Point `--tb=line` and editors at the adapter's source when we can find it.
        target = (getattr(item, "funcargs", None) or {}).get("tyingspec_target")
        try:
            fn = inspect.unwrap(target.fn)  # type: ignore[union-attr]
            return inspect.getsourcefile(fn) or "", inspect.getsourcelines(fn)[1]
        except Exception:  # noqa: BLE001  (no target: setup failed; a builtin; a C function)
            path, line, _ = item.location
            return path, (line or 0) + 1

    def _longrepr(self, item: pytest.Item, exc: BaseException) -> Any:
        from tyingspec._src.core.adapters import AdapterError
        from tyingspec._src.front.suite import CASE_ATTR, replay_key
        from tyingspec.properties import PropertyFailure

        prop = self._property(item)
        opts = self.opts
        if isinstance(exc, PropertyFailure):
            from tyingspec._src.core.render import batch_lines, diagnosis_lines

            lines = [(f"tyingspec: property {prop} does not hold for adapter {opts.adapter!r} "
                     f"({opts.kind}): {exc.headline}")]
            diag = exc.diagnosis
            if diag is not None:
                lines += diagnosis_lines(diag, stage=exc.stage, indent="")
                crash = f"{diag.label}: {diag.rows_wrong} of {diag.rows_total} rows wrong"
            else:
                lines.append(f"verdict: {exc.label}")
                crash = f"{exc.label}: {exc.headline}"
            if exc.details:
                lines.append(exc.details)
            case = exc.case
            lines += ["", "failing batch (replayed):" if self.replay is not None else
                      "smallest failing batch (shrunk by Hypothesis):", *batch_lines(case)]
        elif isinstance(exc, AdapterError):
            lines = [(f"tyingspec: adapter error in property {prop}: adapter {opts.adapter!r} "
                     f"({opts.kind}) misbehaved, so no gradient verdict was reached"),
                     str(exc)]
            crash = f"adapter_error: {exc}"
            case = getattr(exc, CASE_ATTR, None)
            if case is not None:
                from tyingspec._src.core.render import batch_lines

                lines += ["", "smallest batch that triggers it (shrunk by Hypothesis):",
                          *batch_lines(case)]
        else:
            return None
        # The case Hypothesis drew is the replay's key (shapes and a seed: the property builds
        # the batch printed above from it); the batch itself if the draw was not recorded.
        drawn = getattr(exc, CASE_ATTR, None)
        key = case if drawn is None else replay_key(kind_spec(opts.kind), drawn, case)
        if key is not None:
            lines += ["", "replay:", f"  {self._replay_line(prop, key)}"]
        notes = [n for n in map(str, getattr(exc, "__notes__", ())) if not _duplicate(item, n)]
        if notes:  # what else Hypothesis has to say (the case and its replay are above)
            lines += ["", "Hypothesis:", *(f"  {line}" for n in notes for line in n.splitlines())]
        if item.config.getoption("tbstyle", "auto") in ("long", "native") or \
                item.config.getoption("fulltrace", False):
            lines += ["", "(traceback follows: --tb=long)", str(item.repr_failure(
                pytest.ExceptionInfo.from_exception(exc)))]
        return _exception_repr(lines, *self._crash_location(item), crash)


def _gave_up(item: pytest.Item, name: str, exc: BaseException | None
             ) -> tuple[int, int] | None:
    """(examples decided, examples discarded) of a property whose Hypothesis run ended for its
    discards: ``FailedHealthCheck`` (filter_too_much: 50 discarded before 10 decided) or
    ``Unsatisfiable`` (none decided at all), with examples discarded (no power, or nothing to
    check: see ``front.suite.EXAMPLES_ATTR``); None for any other outcome."""
    from hypothesis.errors import FailedHealthCheck, Unsatisfiable

    from tyingspec._src.front.suite import EXAMPLES_ATTR

    if not isinstance(exc, (FailedHealthCheck, Unsatisfiable)):
        return None
    module = item.getparent(pytest.Module)
    tally = getattr(getattr(module, "obj", None), EXAMPLES_ATTR, {}).get(name)
    if not tally or not tally["discarded"]:
        return None
    return tally["decided"], tally["discarded"]


def _duplicate(item: pytest.Item, note: str) -> bool:
    """A Hypothesis note the report above already says: its print of this test's call (the
    falsifying example: the case, whose batch and replay line tyingspec printed) or its
    ``@reproduce_failure`` blob (the replay line is the key that survives a Hypothesis
    upgrade).  Printed after tyingspec's report it only pushed the diagnosis out of view."""
    return f"{item.name}(" in note.split("\n", 1)[0] or "@reproduce_failure(" in note


def _exception_repr(lines: list[str], path: str, lineno: int, crash: str) -> Any:
    """A longrepr with our text as the body and a one-line crash message for the short summary
    (``FAILED tyingspec::test_x - <crash>``); xdist serializes it like any exception repr."""
    text = "\n".join(lines) + "\n"
    try:
        from _pytest._code.code import (
            ReprExceptionInfo,
            ReprFileLocation,
            ReprTracebackNative,
        )
    except ImportError:  # pragma: no cover - private pytest API moved: a plain text report
        return text
    return ReprExceptionInfo(reprtraceback=ReprTracebackNative([text]),
                             reprcrash=ReprFileLocation(path, lineno, crash))


# --- the controller: adapter check, verdicts, baseline gate, summary -----------------------------

@dataclass
class _Verdict:
    status: str  # a _baseline verdict: passed | failed | adapter_error | error | skipped
    label: str = ""  # named verdict of the diagnosis, e.g. input_path_missing
    invariant: str = ""
    diagnosis: str = ""  # the diagnosis sentence
    detail: str = ""  # its specifics, e.g. "wrong on exactly the 3 present rows"

    def short(self) -> str:
        if self.status == "passed":
            return self.detail  # a pass on fewer examples than asked says so (see _gave_up)
        if self.label in ("adapter_error", "error", "property_violated", "skipped"):
            return self.diagnosis
        return self.label + (f" ({self.detail})" if self.detail else "")


@dataclass(eq=False)
class _Controller:
    config: pytest.Config
    opts: Options
    verdicts: dict[str, _Verdict] = field(default_factory=dict)
    gate_lines: list[str] = field(default_factory=list)
    regressed: bool = False  # the gate failed the run (the section below gate_title says why)
    gate_title: str = "tyingspec baseline REGRESSION"
    html_lines: list[str] = field(default_factory=list)  # where --tyingspec-html drew the rows

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from tyingspec._src.core.adapters import AdapterError
        from tyingspec._src.engine.observe import load as load_target

        plugin = self.config.pluginmanager.get_plugin("tyingspec-suite")
        replay = None if plugin is None else plugin.replay
        problem = None
        try:
            target = load_target(self.opts.adapter, self.opts.kind, timeout=self.opts.timeout,
                                 paths=self.opts.paths)
            try:
                if replay is not None:  # at the target's own shape (a torch model's V)
                    from tyingspec._src.front.suite import replay_problem_at

                    problem = replay_problem_at(target, replay[1])
            finally:
                target.close()
        except AdapterError as exc:
            from tyingspec._src.core.extras import with_hint

            pytest.exit(f"tyingspec: --tyingspec-adapter={self.opts.adapter} "
                        f"(kind {self.opts.kind}) cannot be used: {with_hint(str(exc))}",
                        returncode=EXIT_ADAPTER)
        if problem is not None:
            raise pytest.UsageError(f"--tyingspec-replay: {problem}")
        if plugin is not None and plugin.replay is not None:
            from tyingspec._src.front.suite import property_names

            known = property_names(kind_spec(self.opts.kind))
            if plugin.replay[0] not in known:
                raise pytest.UsageError(
                    f"--tyingspec-replay: no property {plugin.replay[0]!r} for kind "
                    f"{self.opts.kind}; known: {', '.join(known)}")
        if self.opts.baseline is not None and not self.opts.update_baseline:
            from tyingspec._src.front.baseline import BaselineError, load

            try:  # fail before the run, not after it
                load(self.opts.baseline, "property")
            except BaselineError as exc:
                raise pytest.UsageError(f"--tyingspec-baseline: {exc}") from None

    # -- progress: a line per property as it starts and ends (the controller sees both, also
    # under xdist, whose workers' own output is captured)

    def _say(self, text: str) -> None:
        if self.config.get_verbosity() < 0:  # pytest -q
            return
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None:
            return
        # pytest's progress dots leave the line open: ours starts a line of its own
        tr.ensure_newline()
        tw = getattr(tr, "_tw", None)
        if getattr(tw, "width_of_current_line", 0):
            tw.line()  # type: ignore[union-attr]
        tr.write_line(text)

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]
                                ) -> None:
        if nodeid.startswith(TEST_PREFIX):
            self._say(f"tyingspec: property {nodeid[len(TEST_PREFIX):]} started")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.nodeid.startswith(TEST_PREFIX):
            return
        props = dict(report.user_properties)
        name = report.nodeid[len(TEST_PREFIX):]
        label = str(props.get(PROP_VERDICT, ""))
        status = _status(report, label)
        if status is None:
            return
        if report.when == "call" or report.outcome != "passed":
            said = status.replace("_", " ") + ("" if status == "passed" or label in ("", status)
                                               else f" ({label})")
            self._say(f"tyingspec: property {name} {said} in {report.duration:.1f} s")
        seen = self.verdicts.get(name)
        if seen is not None and seen.status in ("failed", "adapter_error", "error"):
            return  # the first failing phase decides; a later teardown does not hide it
        self.verdicts[name] = _Verdict(status, label, str(props.get(PROP_INVARIANT, "")),
                                       str(props.get(PROP_DIAGNOSIS, "")),
                                       str(props.get(PROP_DETAIL, "")))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        result = yield
        if not self.config.option.collectonly:
            self._finish(session)
        return result

    def _finish(self, session: pytest.Session) -> None:
        from tyingspec._src.front.baseline import (
            Baseline,
            BaselineError,
            gate,
            in_ci,
            summary_markdown,
        )

        if self.opts.baseline is not None:
            if self.opts.replay is not None:
                self.gate_lines = [(f"baseline {self.opts.baseline}: not used by a "
                                   "--tyingspec-replay run (one example is not a verdict)")]
            elif not self.verdicts:
                self.gate_lines = [(f"baseline {self.opts.baseline}: no property ran; "
                                   "left unchanged")]
            else:
                now = Baseline("property", self.opts.adapter, self.opts.kind,
                               {n: v.status for n, v in self.verdicts.items()},
                               {n: v.label for n, v in self.verdicts.items()
                                if v.status != "passed"})
                try:
                    result = gate(self.opts.baseline, now, update=self.opts.update_baseline,
                                  ci=in_ci())
                except (BaselineError, OSError) as exc:
                    self.gate_lines = [f"baseline {self.opts.baseline}: {exc}"]
                    self.regressed = True
                    session.testsfailed += 1
                else:
                    self.gate_lines = result.lines("--tyingspec-update-baseline")
                    if result.failed:
                        # pytest's counters may all say "passed" (an xfail, a deselected
                        # failure, a missing baseline under CI...): the gate alone decides the
                        # exit status here.
                        self.regressed = True
                        if result.action == "missing":
                            self.gate_title = "tyingspec baseline MISSING"
                        session.testsfailed += max(1, len(result.regressions))
        verdict = self._run_verdict()
        if self.opts.html is not None:
            self.html_lines = self._draw(self.opts.html)
        if self.opts.summary is not None:
            rows = [(n, v.invariant, v.status, v.diagnosis or ("" if v.status == "passed"
                                                                else v.label))
                    for n, v in sorted(self.verdicts.items())]
            title = f"tyingspec: `{self.opts.adapter}` ({self.opts.kind}, {self.opts.profile})" \
                + (f": {verdict}" if verdict else "")
            text = summary_markdown(title, rows, self.gate_lines or None)
            if self.html_lines:
                drawn = [line.split(": ", 1)[1] for line in self.html_lines
                         if line.startswith("rows drawn: ")]
                text += "\n" + "\n".join(
                    [f"Rows drawn by `tyingspec check`: [{Path(f).name}]({f})" for f in drawn]
                    + [f"- {line}" for line in self.html_lines
                       if not line.startswith("rows drawn: ")]) + "\n"
            from tyingspec._src.core.files import append_text

            capture = self.config.pluginmanager.get_plugin("capturemanager")
            try:
                # pytest's capture holds stdout (fd 1) until the terminal summary: a summary
                # sent to /dev/stdout goes out with the capture suspended, else it would land
                # in the capture's temporary file
                with capture.global_and_fixture_disabled() if capture is not None else \
                        contextlib.nullcontext():
                    # Append: $GITHUB_STEP_SUMMARY collects every step's summary in one file.
                    append_text(self.opts.summary, text)
            except OSError as exc:
                self.gate_lines.append(f"summary {self.opts.summary} cannot be written: {exc}")

    def _draw(self, path: str) -> list[str]:
        """``tyingspec check``'s cases run once on the adapter (seed 0), their rows drawn into
        ``path`` (see ``front.html``): the lines that say where, or why not."""
        from tyingspec._src.core.options import UsageError
        from tyingspec._src.front.check import check_target
        from tyingspec._src.front.html import write

        try:
            report = check_target(self.opts.adapter, self.opts.kind, 0,
                                  precision=self.opts.precision,  # type: ignore[arg-type]
                                  timeout=self.opts.timeout, paths=self.opts.paths,
                                  keep_rows=True)
            return write(report, path)
        except (UsageError, OSError) as exc:
            return [f"rows not drawn into {path}: {exc}"]

    def _run_verdict(self) -> str:
        """``wrong (label)`` when properties failed on the gradient: the label their examples'
        rows explain, named by the rule ``tyingspec check`` names its run by (so the two front
        ends name one bug alike); ``no_power`` when no property had the power to decide (see
        :meth:`_no_power`); "" otherwise."""
        from tyingspec._src.core.diagnosis import LABELS, run_label

        labels = [v.label for _, v in sorted(self.verdicts.items())
                  if v.status == "failed" and v.label in LABELS]
        if labels:
            return f"wrong ({run_label(labels)})"
        return NO_POWER if self._no_power() else ""

    def _no_power(self) -> bool:
        """Whether no property had the power to decide: some had none, and none passed,
        failed or errored (what ``tyingspec check`` calls a run of no_power cases)."""
        statuses = {v.status for v in self.verdicts.values()}
        return NO_POWER in statuses and statuses <= {NO_POWER, "skipped"}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # A run that would otherwise exit 0 exits as `tyingspec check` does when no case had
        # the power to decide: neither a pass (0) nor a wrong gradient (1).
        if session.exitstatus == 0 and self._no_power() and self.opts.replay is None:
            from tyingspec._src.front.results import EXIT_NO_POWER

            session.exitstatus = EXIT_NO_POWER

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        if not self.verdicts and not self.gate_lines:
            return
        tr.section(f"tyingspec: {self.opts.adapter} ({self.opts.kind}, profile "
                   f"{self.opts.profile})", sep="-", bold=True)
        width = max((len(n) for n in self.verdicts), default=0)
        inv_width = max((len(v.invariant) for v in self.verdicts.values()), default=0) + 2
        for name, v in sorted(self.verdicts.items()):
            tr.line(f"{name:<{width}}  {'[' + v.invariant + ']':<{inv_width}}  {v.status:<13} "
                    f"{v.short()}".rstrip(),
                    red=v.status in ("failed", "adapter_error", "error"),
                    green=v.status == "passed")
        verdict = self._run_verdict()
        if verdict == NO_POWER:
            from tyingspec._src.front.results import no_power_text

            tr.line(f"verdict: {verdict}: {no_power_text('property')}", yellow=True, bold=True)
        elif verdict:
            tr.line(f"verdict: {verdict}", red=True, bold=True)
        from tyingspec._src.front.baseline import legend

        # the codes above, defined: a reader of a CI log has no catalogue at hand
        codes = legend(v.invariant for _, v in sorted(self.verdicts.items()))
        if codes:
            tr.line("invariants:")
            for code, text in codes:
                tr.line(f"  {'[' + code + ']':<{inv_width}}  {text}")
        for line in self.html_lines:
            tr.line(line)
        if self.regressed:
            tr.section(self.gate_title, sep="!", red=True, bold=True)
            for line in self.gate_lines:
                tr.line(line, red=True, bold=True)
        else:
            for line in self.gate_lines:
                tr.line(line)


def _status(report: pytest.TestReport, label: str) -> str | None:
    """A report phase as a baseline verdict (None: this phase says nothing)."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed or (report.failed and label == "passed"):  # xpass (strict or not)
            return "passed"
        if report.skipped and label == NO_POWER:
            return NO_POWER
        if report.skipped:
            return "failed" if xfail else "skipped"  # an xfail hides a failing property
        return {"adapter_error": "adapter_error", "error": "error"}.get(label, "failed")
    if report.skipped and report.when == "setup":
        return "skipped"
    if report.failed:
        return "adapter_error" if label == "adapter_error" else "error"
    return None
