"""The ``tyingspec`` command line: ``check``, ``mutants``, ``reproduce``, ``ckpt`` and
``explain``."""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tyingspec._src.core.options import (
    DEFAULT_SHRINK_BUDGET,
    DEFAULT_TIMEOUT,
    UsageError,
    int_list,
    positive_seconds,
    seed,
    shape,
    shrink_budget,
    target_paths,
)
from tyingspec._src.kinds.table import DEFAULT_KIND, KIND_NAMES

if TYPE_CHECKING:
    from tyingspec._src.core.cases import Case
    from tyingspec._src.front.results import CheckReport

EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2
#: One call's timeout under --compile: torch.compile's inductor compiles C++ for each graph on
#: its first calls (on a busy 2-core machine a small model's first case took over 120 s).
COMPILE_TIMEOUT = 900.0
#: A run ended by Ctrl-C: the status a shell gives a command that SIGINT ended (128 + 2).
EXIT_INTERRUPTED = 130


def _add_check(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "check", help="verify a target's tied gradient row by row",
        description="Without TARGET: run the built-in implementations and print the write-up's "
                    "table. With TARGET (a built-in name or module:attr): run a seeded set of "
                    "batches and diagnose each. Exit 0 all correct, 1 a gradient is wrong, "
                    "2 usage or adapter error.")
    p.add_argument("target", nargs="?", help="built-in name or module:attr")
    p.add_argument("--kind", choices=KIND_NAMES, default=None,
                   help="adapter contract (default: a built-in's own kind, else model)")
    p.add_argument("--precision", choices=("auto", "float64", "float32", "bfloat16", "float16"),
                   default="auto",
                   help="precision to build the cases in and judge at; auto (default): build "
                        "as each case says and judge at the least precise float returned")
    p.add_argument("--shape", type=shape, metavar="V,d,N",
                   help="run every case at this vocabulary, width and batch length, keeping "
                        "its composition (the cases defined by their shape are left out)")
    p.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                   help="--kind torch: run every pass under torch.autocast in this dtype (the "
                        "gradient is judged at its precision)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None,
                   choices=("inductor", "aot_eager", "eager"), metavar="BACKEND",
                   help="--kind torch: judge the gradient of torch.compile(model) (backend "
                        "inductor unless named: inductor, aot_eager, eager) against its eager "
                        "twin's uses")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="--kind linear-ce: run the kernel on this device (default cpu, where a "
                        "Triton kernel runs under the Triton interpreter); --kind torch: the "
                        "model and its batches; judged on the CPU either way (exit 2 where "
                        "torch sees no such device)")
    p.add_argument("--padding-idx", type=int, default=None, metavar="P",
                   help="a model kind adapter with nn.Embedding(padding_idx=P) semantics: it is "
                        "passed padding_idx=P, and the input path is expected to skip row P "
                        "(the output path still reaches it)")
    p.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="seconds one call of the target may take before it is ended as an "
                        f"adapter error (default {DEFAULT_TIMEOUT:g}, {COMPILE_TIMEOUT:g} "
                        "with --compile, whose first calls compile); the remaining cases "
                        "still run")
    p.add_argument("--shrink-budget", type=shrink_budget, default=DEFAULT_SHRINK_BUDGET,
                   metavar="SECONDS",
                   help="seconds the whole run may spend shrinking failing batches, and "
                        "never more than half of what its cases took (default %(default)g; "
                        "0 turns shrinking off)")
    p.add_argument("--seed", type=seed, default=0, help="base seed (default 0)")
    _add_check_outputs(p)


def _add_check_outputs(p: argparse.ArgumentParser) -> None:
    """``tyingspec check``'s replay, listing, gating and output options."""
    p.add_argument("--json", metavar="PATH", help="write a tyingspec.check/1 JSON report")
    p.add_argument("--case", metavar="NAME", help="run only this case (replay)")
    p.add_argument("--tokens", type=int_list, help="replay: explicit tokens, e.g. 3,3")
    p.add_argument("--targets", type=int_list, help="replay: explicit targets, same length")
    p.add_argument("--list", action="store_true", help="list built-in targets and cases")
    p.add_argument("--baseline", metavar="FILE",
                   help="CI gate: fail on any case that passed in FILE and fails now "
                        "(FILE is created when missing)")
    p.add_argument("--update-baseline", action="store_true",
                   help="rewrite --baseline FILE with this run's verdicts")
    p.add_argument("--quick", action="store_true",
                   help="an editor loop's check: the cases in order until each path (input, "
                        "output, repeated tokens) has had one with the power to see it, and "
                        "for --kind torch the identity, optimizer, by-path and forward checks "
                        "only; the report says 'quick: N of M cases; not a full check'")
    p.add_argument("--html", metavar="PATH",
                   help="draw each case's rows (absent / present / repeated, error over the "
                        "bound, each path) into a self-contained HTML file, and a PNG beside "
                        "it when matplotlib is installed")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (by default a run that lasts more than a couple "
                        "of seconds shows its case, phase and seconds there)")


def _configure_reproduce(p: argparse.ArgumentParser) -> None:
    from tyingspec._src.reproduce import configure_parser

    configure_parser(p)


def _configure_mutants(p: argparse.ArgumentParser) -> None:
    from tyingspec._src.front.kill_matrix import configure_parser

    configure_parser(p)


def _configure_ckpt(p: argparse.ArgumentParser) -> None:
    from tyingspec._src.ckpt.command import configure_parser

    configure_parser(p)


def _configure_explain(p: argparse.ArgumentParser) -> None:
    from tyingspec._src.front.explain import configure_parser

    configure_parser(p)


#: The subcommands other than ``check``: (name, help, description, what adds its arguments).
_COMMANDS: tuple[tuple[str, str, str | None, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("reproduce", "re-derive the weight-tying write-up's experiments", None,
     _configure_reproduce),
    ("mutants", "kill matrix: every property against every seeded bug",
     "Run the property suite against the mutant zoo and the correct styles; exit 0 when "
     "every mutant is killed and every correct style passes.", _configure_mutants),
    ("ckpt", "inspect a checkpoint's tie; convert tied <-> untied",
     "inspect FILE: how the embedding and head are stored; convert IN OUT --to tied|untied "
     "--policy ...: rewrite it.", _configure_ckpt),
    ("explain", "what a diagnosis label means, where to look, and a built-in that shows it",
     "explain LABEL: the label's row of the README's table and a built-in that reaches it; "
     "explain: every label.", _configure_explain),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command``, one whose other subcommands are named (for the
    help) but get no arguments.  Adding a subcommand's arguments imports its code: the
    experiments' alone cost 0.1 s, which a ``tyingspec check`` would pay before it starts
    its worker."""
    parser = argparse.ArgumentParser(
        prog="tyingspec", description="Verify tied-embedding gradients: which path, which rows.")
    from tyingspec import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command")
    _add_check(sub)
    for name, help_, description, configure in _COMMANDS:
        p = sub.add_parser(name, help=help_, description=description)
        if command in (None, name):
            configure(p)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word: the top level has no option that takes
    a value), or None when it names none of them (then every one is configured)."""
    first = next(iter(argv), None)
    return first if first in {"check", *(c[0] for c in _COMMANDS)} else None


def _list() -> int:
    from tyingspec._src.core.cases import standard_cases
    from tyingspec._src.kinds.table import KINDS, every_builtin

    print("built-in targets (name [kinds] what it breaks -> the label a check reaches):")
    for impl in every_builtin().values():
        kinds = "/".join(k for k in KINDS if impl.adapter(k) is not None)
        breaks = f"breaks {impl.breaks} -> {impl.expected}" if impl.breaks else "correct"
        print(f"  {impl.name:<24} [{kinds}] {breaks}: {impl.description.splitlines()[0]}")
    for spec in KINDS.values():
        if spec.cases is standard_cases and spec.name != DEFAULT_KIND:
            continue  # the same cases as the model kind's
        label = "" if spec.name == DEFAULT_KIND else f" --kind {spec.name}"
        print(f"cases run by `tyingspec check TARGET{label}`:")
        for c in spec.cases(0):
            print(f"  {c.name:<20} {c.describe()}")
    return EXIT_OK


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``tyingspec check``: its options checked (a problem is exit 2 with the usage), then
    the demo table without a TARGET, else the target's check, printed as it runs."""
    if args.list:
        return _list_only(args, parser)
    _check_outputs(args, parser)
    if args.target is None:
        return _demo(args, parser)
    from tyingspec._src.front.request import CheckRequest

    request = CheckRequest.from_args(args)
    args.kind = request.kind_name
    request.require_extras()
    problems = request.problems()
    if problems:
        parser.error("; ".join(problems))
    cases, notes = request.chosen()
    report = _run_check(args, cases, notes)
    return _write_outputs(args, report)


def _list_only(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Every flag that would do nothing here is a usage error, not a silent exit 0.
    given = [f for f, v in (("TARGET", args.target), ("--baseline", args.baseline),
                            ("--json", args.json), ("--case", args.case),
                            ("--html", args.html)) if v is not None]
    if given:
        parser.error(f"--list prints the built-ins and cases and runs nothing; it takes no "
                     f"{', '.join(given)}")
    return _list()


def _check_outputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The baseline and output options: consistent, usable, resolved once."""
    from tyingspec._src.core.files import OutputError, check_distinct, usable_output

    if args.update_baseline and args.baseline is None:
        parser.error("--update-baseline needs --baseline FILE")
    if args.update_baseline and args.quick:
        # a baseline recorded from the cases a quick check ran would call the rest MISSING
        parser.error("--update-baseline records a full check's verdicts; drop --quick")
    if args.baseline is not None and args.target is None:
        parser.error("--baseline gates a TARGET's cases; name the target to check")
    try:
        # resolved once, now: an adapter that changes directory cannot move them
        if args.json is not None:
            args.json = usable_output("--json", args.json)
        if args.baseline is not None:
            args.baseline = usable_output("--baseline", args.baseline)
        if args.html is not None:
            args.html = usable_output("--html", args.html)
        check_distinct({"--baseline": args.baseline, "--json": args.json, "--html": args.html})
    except OutputError as exc:
        parser.error(str(exc))


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``tyingspec check`` without a TARGET: the write-up's table, computed."""
    if args.case or args.tokens or args.targets:
        parser.error("--case/--tokens/--targets need a TARGET")
    if args.quick or args.html:
        parser.error("--quick and --html check a TARGET; name the target to check")
    from tyingspec._src.front.demo import render_demo, run_demo

    demo = run_demo(args.seed)
    print(render_demo(demo))
    code = EXIT_OK if demo.as_expected else EXIT_WRONG
    if args.json:
        return _write_report(args.json, {
            "schema": "tyingspec.demo/1", "seed": args.seed, "exit_code": code,
            "as_expected": demo.as_expected,
            "results": {n: r.as_dict() for n, r in demo.results.items()}}, code)
    return code


def _run_check(args: argparse.Namespace, cases: list[Case], notes: list[str]) -> CheckReport:
    """Run the check, printing each case as soon as it is known (a job killed for time still
    shows what finished) and the verdict last."""
    from tyingspec._src.core.render import terminal_width
    from tyingspec._src.front.check import check_target
    from tyingspec._src.front.progress import Progress
    from tyingspec._src.front.report import render_case, render_head, render_verdict

    # Checks that do not depend on the batch are listed with the first case only.
    seen: list[object] = []

    def report_first(r: object) -> object:
        if not seen:
            seen.append(r)
        return seen[0]

    print(render_head(args.target, args.kind, args.seed, args.precision, notes), flush=True)
    width = terminal_width()
    progress = None if args.quiet else Progress(sys.stderr)
    try:
        # Like `python -m` and uvicorn: a `module:attr` target is looked up from the current
        # directory, in the worker process that imports it (tyingspec's own imports never are).
        report = check_target(args.target, args.kind, args.seed, cases,
                              precision=args.precision, shrink_budget=args.shrink_budget,
                              timeout=COMPILE_TIMEOUT if args.compile and
                              args.timeout == DEFAULT_TIMEOUT else args.timeout,
                              paths=target_paths(), progress=progress, quick=args.quick,
                              keep_rows=args.html is not None,
                              on_result=lambda r: print("\n".join(render_case(
                                  r, structural=r is report_first(r), width=width)),
                                  flush=True))
    finally:
        if progress is not None:
            progress.close()
    if report.notes:  # what the target itself decided (a torch model's shape)
        print("\n".join(report.notes), flush=True)
    report.notes = notes + report.notes
    if report.load_error:
        print(f"error: {report.load_error}")
    print(render_verdict(report), flush=True)
    return report


def _write_outputs(args: argparse.Namespace, report: CheckReport) -> int:
    """The picture, the baseline and the JSON report a check was asked for; the exit status
    (the baseline's when there is one; 2 when an output could not be written)."""
    code = report.exit_code
    if args.html:
        from tyingspec._src.front.html import write as write_html

        try:
            print("\n".join(write_html(report, args.html)), flush=True)
        except OSError as exc:
            print(f"tyingspec: the picture {args.html} was not written ({type(exc).__name__}: "
                  f"{exc}); the results above stand", file=sys.stderr)
            code = max(code, EXIT_USAGE)
    baseline: dict[str, object] | None = None
    if args.baseline:
        from tyingspec._src.front.baseline import apply_check_baseline

        code, lines = apply_check_baseline(report, args.baseline, args.update_baseline)
        print("\n".join(lines))
        baseline = {"path": args.baseline, "exit_code": code, "lines": lines}
    if args.json:
        from tyingspec._src.front.report import as_json

        payload = as_json(report)
        payload["exit_code"] = code  # the status this command really exits with
        payload["baseline"] = baseline
        return _write_report(args.json, payload, code)
    return code


def _write_report(path: str, payload: dict[str, object], code: int) -> int:
    """Write the JSON report; a failure says so and exits 2 (the printed results stand)."""
    from tyingspec._src.front.report import write_json

    try:
        write_json(path, payload)
    except OSError as exc:
        print(f"tyingspec: the JSON report {path} was not written ({type(exc).__name__}: "
              f"{exc}); the results above stand", file=sys.stderr)
        return max(code, EXIT_USAGE)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tyingspec`` console script."""
    import faulthandler

    if not faulthandler.is_enabled():  # a crash in tyingspec itself still prints where it was
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, io.UnsupportedOperation):
            pass  # main() called with a stderr that is no file (a notebook, a captured test)
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = build_parser(_command(argv))
        args = parser.parse_args(argv)
        return _run(args, parser)
    except KeyboardInterrupt:
        # Ctrl-C: one line, not a traceback through whatever was waiting (a worker, a hung
        # rank); the workers and ranks are ended at exit, as after any run
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop writing.  The run did not finish, so the exit
        # status must not say it passed.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_USAGE
    except UsageError as exc:  # found below the parser: a check with no case, a missing extra
        _error(f"error: {exc}")
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        from tyingspec._src.core.extras import missing_extra

        usage = missing_extra(exc)
        if usage is None:
            return _internal_error(exc)
        _error(f"error: {usage}")
        return EXIT_USAGE
    except MemoryError as exc:
        _error(f"error: out of memory ({type(exc).__name__}: {exc}); give a smaller --shape "
               "or run on a machine with more memory")
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001  (exit 1 is a wrong gradient, never a crash)
        return _internal_error(exc)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "check":
        return _check(args, parser)
    if args.command == "mutants":
        from tyingspec._src.front.kill_matrix import run as run_mutants

        return run_mutants(args)
    if args.command == "ckpt":
        from tyingspec._src.ckpt.command import run as run_ckpt

        return run_ckpt(args)
    if args.command == "reproduce":
        from tyingspec._src.reproduce import run

        return run(args)
    if args.command == "explain":
        from tyingspec._src.front.explain import run as explain

        return explain(args)
    parser.print_help()
    return EXIT_USAGE


def _error(text: str) -> None:
    try:
        sys.stdout.flush()  # the results printed so far come first
    except (OSError, ValueError):
        pass  # a closed or broken stdout: the message still goes to stderr
    print(f"tyingspec: {text}", file=sys.stderr, flush=True)


def _internal_error(exc: BaseException) -> int:
    """A bug in tyingspec (not in the target: those are adapter errors): exit 2 with the
    message first and the traceback after it.  Never exit 1, which only a wrong gradient
    gives."""
    import traceback

    _error(f"internal error, please report it with the traceback below: "
           f"{type(exc).__name__}: {exc}")
    traceback.print_exception(exc, file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
