"""The README's quick start runs as written, and the README's links and label table hold.

Every command in the README's "Quick start" section is read from the README itself and run
from the repository root against its file under ``examples/``; it must exit with the status
its comment gives (``# exit 1: ...``), else 0.  ``tyingspec``, ``pytest`` and ``python`` are
run as ``python -m tyingspec``, ``python -m pytest`` and this interpreter, with the
repository on ``PYTHONPATH`` (what the console scripts of an installed tyingspec do); the
checkpoint commands run in this process, one after the other, in a scratch directory.  The
torch and transformers models' checks and the plugin's run are in the slow tier: each costs
10-45 s on a 2-core machine.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tyingspec._src.core.diagnosis import LABELS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PROGRAMS = {"tyingspec": [sys.executable, "-m", "tyingspec"],
            "pytest": [sys.executable, "-m", "pytest"], "python": [sys.executable]}


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a ``## `` or ``### `` line) up to the next heading of the
    same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    rest = text[start:]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)
            if not _in_code(rest, m.start())]
    return rest[:ends[0]] if ends else rest


def _in_code(text: str, pos: int) -> bool:
    return text[:pos].count("\n```") % 2 == 1


def code_blocks(text: str, lang: str = "") -> list[str]:
    """The fenced blocks whose info string is ``lang`` ("" for a bare fence)."""
    blocks: list[str] = []
    info, lines = None, []  # info: the open fence's info string, None outside a block
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, lines = line[3:].strip(), []
                continue
            if info == lang:
                blocks.append("\n".join(lines) + "\n")
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def quick_start_commands() -> list[tuple[str, int]]:
    """(command, exit status) for each command line of the quick start's shell blocks."""
    commands = []
    for block in code_blocks(section(README.read_text(encoding="utf-8"), "## Quick start")):
        for line in block.splitlines():
            command, _, comment = line.partition("  #")
            if command.split(" ", 1)[0] not in PROGRAMS:
                continue
            code = re.match(r"\s*exit (\d)", comment)
            commands.append((command.strip(), int(code.group(1)) if code else 0))
    return commands


COMMANDS = quick_start_commands()
CKPT = [(c, code) for c, code in COMMANDS if "ckpt" in c]
#: each costs 10-30 s on a 2-core machine: a torch model's whole check (one process, or a world
#: of ranks), a jax model's (its compiles), or the property suite
SLOW = ("--kind torch", "--kind distributed", "--kind jax", "pytest ")


def env() -> dict[str, str]:
    # an outer pytest-xdist run's variables would leak into the nested pytest
    out = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [out.get("PYTHONPATH")])])
    return out


def run(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    program, *args = shlex.split(command)
    return subprocess.run([*PROGRAMS[program], *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=600)


def test_the_quick_start_has_a_command_per_kind_and_each_names_a_file_under_examples() -> None:
    checks = [c for c, _ in COMMANDS if c.startswith("tyingspec check")]
    for kind in ("", "--kind kernel", "--kind torch", "--kind linear-ce", "--kind distributed",
                 "--kind jax"):
        assert any(kind in c for c in checks), kind
    for command, _ in COMMANDS:
        module = re.search(r"(examples(?:\.\w+)+):\w+", command)
        path = re.search(r"examples/[\w/]+\.\w+", command)
        assert module or path or command.startswith("tyingspec ckpt"), command
        if module:
            assert (ROOT / (module.group(1).replace(".", "/") + ".py")).is_file(), command
        if path:
            assert (ROOT / path.group(0)).is_file(), command


@pytest.mark.parametrize("command,code", [
    pytest.param(c, code, marks=[pytest.mark.slow] if any(s in c for s in SLOW) else [])
    for c, code in COMMANDS if (c, code) not in CKPT])
def test_each_quick_start_command_exits_as_the_readme_says(command: str, code: int) -> None:
    done = run(command, ROOT)
    assert done.returncode == code, f"{command}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    if command.startswith("tyingspec check"):
        assert "verdict: correct" in done.stdout, done.stdout[-2000:]


def test_the_checkpoint_quick_start_runs_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from tyingspec._src.front.cli import main

    assert [c.split()[:3] for c, _ in CKPT] == [
        ["python", "examples/ckpt/make_drifted.py", "drifted.safetensors"],
        ["tyingspec", "ckpt", "inspect"], ["tyingspec", "ckpt", "convert"],
        ["tyingspec", "ckpt", "inspect"]]
    # In this process (each command's own interpreter would import torch again, seconds each),
    # in a scratch directory: the files the commands write stay there.
    monkeypatch.chdir(tmp_path)
    states = []
    for command, code in CKPT:
        program, *args = shlex.split(command.replace("examples/", f"{ROOT}/examples/"))
        if program == "python":
            monkeypatch.setattr(sys, "argv", args)
            runpy.run_path(args[0], run_name="__main__")
        else:
            assert main(args) == code, command
        states += re.findall(r"state: (\S+)", capsys.readouterr().out)
    assert states == ["different", "tied"]


def test_the_python_snippet_of_the_quick_start_passes() -> None:
    (snippet,) = code_blocks(section(README.read_text(encoding="utf-8"), "## Quick start"),
                             "python")
    tests = re.findall(r"^def (test_\w+)\(\):", snippet, re.M)
    assert tests
    program = snippet + "".join(f"\n{t}()" for t in tests)
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_readme_starts_with_the_first_paragraph_and_two_set_up_commands() -> None:
    text = README.read_text(encoding="utf-8")
    head = text.split("\n## ", 1)[0]
    blocks = code_blocks(head)
    first = head.index("```")
    assert head.startswith("# tyingspec\n\nRun it before you trust the gradient")
    assert "\n\n" not in head[len("# tyingspec\n\n"):first].strip(), "one paragraph before it"
    assert len(blocks[0].splitlines()) == 2, blocks[0]
    assert blocks[0].splitlines()[0] == "pip install -e . && tyingspec check"


# --- the label table ------------------------------------------------------------------------

def test_the_readme_label_table_names_every_label_once() -> None:
    table = section(README.read_text(encoding="utf-8"), "### What to look at in your code")
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    names = [re.match(r"\| `([^`]+)` \|", row).group(1) for row in rows]  # type: ignore[union-attr]
    assert sorted(names) == sorted([*LABELS, "n/a"]), set(names) ^ {*LABELS, "n/a"}
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 3 and all(cells), row


# --- links and anchors ----------------------------------------------------------------------

DOCS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation
    other than ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text, found, seen = path.read_text(encoding="utf-8"), set(), {}
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        if _in_code(text, m.start()):
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    # inline code blanked (a link inside it is not one); fences are counted on the same text,
    # so a position is never read against the unblanked one
    text = re.sub(r"`[^`\n]*`", "``", path.read_text(encoding="utf-8"))
    out = []
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        if not _in_code(text, m.start()):
            out.append(m.group(1))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    assert doc.is_file()
    bad = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{target}: no {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not bad, "\n".join(bad)


def test_the_readme_links_to_every_doc() -> None:
    targets = {t.partition("#")[0] for t in links(README)}
    for doc in DOCS[1:]:
        assert str(doc.relative_to(ROOT)) in targets, doc.name


def test_the_in_ci_section_shows_the_example_workflow_verbatim() -> None:
    ci = section(README.read_text(encoding="utf-8"), "### In CI")
    assert "examples/ci/tied-gradients.yml" in ci
    workflow = (ROOT / "examples" / "ci" / "tied-gradients.yml").read_text(encoding="utf-8")
    assert code_blocks(ci, "yaml") == [workflow.rstrip("\n") + "\n"]
