"""The ``tyingspec ckpt`` command: its options, and the exit code of each subcommand.

Exit codes: 0 tied or consistent, 1 only a tie that is wrong (two different matrices under a
config that ties them, a lost key the config needs, ``--policy refuse`` refusing; for inspect,
in any of the file's tied pairs), 2 bad input or usage (names that cannot be paired and a
GGUF file among them), one line naming the file or option, what was expected and what was
found.  An output that names an input, by any path or hard link, is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import TYPE_CHECKING

from tyingspec._src.ckpt.convert import (
    Terminated,
    check_policy,
    convert,
    signals_raise,
    write,
    write_text,
)
from tyingspec._src.ckpt.evaluate import evaluate, read_tokens
from tyingspec._src.ckpt.inspect import inspect, render
from tyingspec._src.ckpt.read import (
    POLICIES,
    SAFETENSORS_EXT,
    TORCH_EXT,
    Checkpoint,
    CkptError,
    load,
    read_config,
    same_file,
)
from tyingspec._src.core.files import (
    OutputError,
    check_distinct,
    usable_output,
)

if TYPE_CHECKING:
    pass

EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2

def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add ``inspect`` and ``convert`` to the ``ckpt`` subparser."""
    sub = p.add_subparsers(dest="ckpt_command")
    i = sub.add_parser("inspect", help="report the tie between embedding and head in FILE",
                       description="Exit 0 the file is consistent, 1 the head or embedding is "
                                   "missing or the config disagrees with the file, 2 bad input.")
    i.add_argument("file", metavar="FILE",
                   help=".safetensors, torch file (.pt/.bin) or a sharded index .json")
    i.add_argument("--config", metavar="config.json")
    i.add_argument("--embedding", metavar="KEY")
    i.add_argument("--head", metavar="KEY")
    i.add_argument("--json", metavar="PATH", help="write the report as JSON")
    c = sub.add_parser("convert", help="write a tied or untied copy of IN to OUT",
                       description="Exit 0 written, 1 --policy refuse stopped, 2 bad input.")
    c.add_argument("input", metavar="IN")
    c.add_argument("output", metavar="OUT", help="format from its extension: .safetensors or "
                                                 ".pt/.pth/.bin")
    c.add_argument("--to", choices=("tied", "untied"), required=True)
    c.add_argument("--policy", choices=POLICIES,
                   help="the tied matrix: the embedding (input), the head (output), their mean "
                        "(average), or refuse when they differ by more than --tolerance")
    c.add_argument("--tolerance", type=float, default=None, metavar="T",
                   help="max |delta| refuse accepts (default 0: bit-equal)")
    c.add_argument("--config", metavar="config.json",
                   help="its tie_word_embeddings is set in --config-out")
    c.add_argument("--config-out", metavar="PATH",
                   help="where the updated config goes (default: config.json beside OUT)")
    c.add_argument("--embedding", metavar="KEY")
    c.add_argument("--head", metavar="KEY")
    c.add_argument("--evaluate", metavar="TARGET",
                   help="module:attr, a zero-argument factory of the nn.Module: report each "
                        "policy's loss on --tokens next to the original's")
    c.add_argument("--tokens", metavar="FILE", help=".npy or text file of token ids")


def _out_format(path: str) -> str:
    if path.endswith(SAFETENSORS_EXT):
        return "safetensors"
    if path.endswith(TORCH_EXT):
        return "torch"
    raise CkptError(f"OUT {path!r}: expected a .safetensors, .pt, .pth, .bin or .ckpt file")


def _refuse_same(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """An output naming an input (by path, symlink or hard link) would destroy what is being
    read: a usage error, checked before anything is written."""
    for out_name, out in outputs.items():
        for in_name, src in inputs.items():
            if out and src and same_file(out, src):
                raise CkptError(f"{out_name} {out!r} is the same file as {in_name} {src!r}: "
                                f"tyingspec never overwrites what it reads; give "
                                f"{out_name.split(' (')[0]} another file")


def _inputs(args: argparse.Namespace, ckpt: Checkpoint | None) -> dict[str, str | None]:
    named: dict[str, str | None] = {"the input": getattr(args, "file", None) or getattr(
        args, "input", None), "--config": args.config, "--tokens": getattr(args, "tokens", None)}
    for i, shard in enumerate(ckpt.files if ckpt is not None else []):
        named[f"shard {i + 1} of the input"] = shard
    return named


def _run_inspect(args: argparse.Namespace) -> int:
    if args.json:
        usable_output("--json", args.json)
        _refuse_same({"--json": args.json}, _inputs(args, None))
    config = read_config(args.config) if args.config else None
    ckpt = load(args.file)
    if args.json:
        _refuse_same({"--json": args.json}, _inputs(args, ckpt))
    report = inspect(ckpt, config, args.embedding, args.head)
    print(render(report))
    if args.json:
        write_text("--json", args.json, json.dumps(report, indent=2) + "\n")
    # every tied pair counts (T5's three keys tied to shared.weight): one wrong is exit 1
    bad = any(pair["state"].endswith("-missing") or pair["config_agrees"] is False
              for pair in report["pairs"])
    return EXIT_WRONG if bad else EXIT_OK


def _run_convert(args: argparse.Namespace) -> int:
    out = usable_output("OUT", args.output)
    fmt = _out_format(args.output)  # by the name given: a symlink's target may have none
    ckpt_in = args.input
    if args.evaluate is not None and args.tokens is None or \
            args.tokens is not None and args.evaluate is None:
        raise CkptError("--evaluate TARGET and --tokens FILE go together")
    check_policy(args.to, args.policy, args.tolerance)
    if args.tolerance is not None and args.policy != "refuse" and args.evaluate is None:
        raise CkptError(f"--tolerance: only --policy refuse (or --evaluate, which reports "
                        f"refuse) reads it; --policy {args.policy} ignores it")
    config_out = None
    if args.config is not None:
        config_out = usable_output("--config-out", args.config_out or os.path.join(
            os.path.dirname(out), "config.json"))
        check_distinct({"OUT": out, "--config-out": config_out})
    elif args.config_out is not None:
        raise CkptError("--config-out: it writes the updated --config; give --config too")
    outputs = {"OUT": args.output, "--config-out" if args.config_out else
               "--config-out (default: config.json beside OUT)": args.config_out or config_out}
    _refuse_same(outputs, _inputs(args, None))
    config = read_config(args.config) if args.config else None
    ckpt = load(ckpt_in)
    _refuse_same(outputs, _inputs(args, ckpt))
    if args.evaluate is not None:
        rows = evaluate(ckpt, args.evaluate, read_tokens(args.tokens), args.tolerance, config,
                        args.embedding, args.head)
        original = rows[0][1]
        assert original is not None
        print(f"{'model':<10} {'loss':>12} {'vs original':>14}")
        for name, loss in rows:
            if loss is None:
                print(f"{name:<10} {'refused':>12}")
            else:
                print(f"{name:<10} {loss:>12.6f} {loss - original:>+14.3e}")
    converted = convert(ckpt, args.to, args.policy, args.tolerance, config, args.embedding,
                        args.head)
    if converted.refused:
        print(f"tyingspec ckpt: {converted.refused}; {args.output} not written", file=sys.stderr)
        return EXIT_WRONG
    tie = None
    if args.to == "tied":
        emb, hd = converted.metadata["tyingspec.tied"].split("=", 1)
        tie = (emb, hd)
    write(converted, args.output, fmt, tie)
    if config is not None and config_out is not None:
        config = dict(config)
        config["tie_word_embeddings"] = args.to == "tied"
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"],
                                     "tie_word_embeddings": args.to == "tied"}
        write_text("--config-out", config_out, json.dumps(config, indent=2) + "\n")
    stored = len(converted.tensors) - (1 if tie is not None and fmt == "safetensors" else 0)
    how = f"tied, policy {args.policy}" if args.to == "tied" else "untied"
    print(f"wrote {args.output} ({how}, {stored} tensors)"
          + (f"; config {config_out}" if config_out else ""))
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Dispatch ``tyingspec ckpt inspect|convert``; bad input is a message and exit 2.  SIGTERM
    or SIGHUP while it runs removes the temporary file of a write in progress, then ends the
    process by that signal."""
    try:
        with signals_raise():
            if args.ckpt_command == "inspect":
                return _run_inspect(args)
            if args.ckpt_command == "convert":
                return _run_convert(args)
    except (CkptError, OutputError) as exc:
        print(f"tyingspec ckpt: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated as stop:
        # the finally clauses have run (no temporary file is left): now end as the signal
        # would have, so a supervisor sees what happened
        name = signal.Signals(stop.signum).name
        print(f"tyingspec ckpt: stopped by {name}; nothing half-written is left", file=sys.stderr)
        sys.stderr.flush()
        signal.signal(stop.signum, signal.SIG_DFL)
        os.kill(os.getpid(), stop.signum)
        return 128 + stop.signum
    print("tyingspec ckpt: expected a subcommand, inspect or convert", file=sys.stderr)
    return EXIT_USAGE
