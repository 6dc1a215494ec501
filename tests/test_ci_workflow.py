"""The example CI workflow and tyingspec's GitHub Action run as written, the pre-commit hooks
run as pre-commit runs them, and tyingspec's torch extras keep a user's torch.

``examples/ci/tied-gradients.yml`` is the workflow the README tells another repository to
copy; its tyingspec step is the Action (``action.yml``, ``uses: OWNER/tyingspec@vX.Y.Z``).  Its
job is run here step by step, the Action's steps expanded in place as the runner expands a
composite action (its inputs from the step's ``with:`` or their defaults, ``github.action_path``
a copy of this checkout), in a repository that holds nothing but an adapter package, with the
Action's own install step run in a fresh venv (tests/test_wheel.py's): the only steps not run
are the checkout, setup-python and the upload, which need GitHub.

``.pre-commit-hooks.yaml`` holds the hooks and ``examples/ci/pre-commit-config.yaml`` a
configuration using them; pre-commit runs a hook's ``entry`` followed by its ``args`` (and the
changed file names, which these hooks do not take) when a changed file matches ``files``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_wheel import fresh_venv, source_copy, venv_env

import tyingspec

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "examples" / "ci" / "tied-gradients.yml"
ACTION = ROOT / "action.yml"
HOOKS = ROOT / ".pre-commit-hooks.yaml"
PRE_COMMIT_CONFIG = ROOT / "examples" / "ci" / "pre-commit-config.yaml"
BASELINE = ".tyingspec-baseline.json"
ADAPTER = "mypackage.grads:tied_backward"
#: a step that uses tyingspec's Action: any owner (a fork's too), this repository's name
USES = re.compile(r"[A-Za-z0-9_.-]+/tyingspec@(?P<ref>\S+)")
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
#: the keys of a hook in a .pre-commit-hooks.yaml (pre-commit's documentation, "new hooks")
HOOK_KEYS = {"id", "name", "entry", "language", "files", "exclude", "types", "types_or",
             "exclude_types", "always_run", "fail_fast", "verbose", "pass_filenames",
             "require_serial", "description", "language_version",
             "minimum_pre_commit_version", "args", "stages"}

# A correct numpy model adapter, as README's "Check your implementation" section defines one:
# f(E, W, b, tokens, targets, *, res, s_in) -> {loss, dE, dW, db}, the probe model's backward.
GRADS = '''\
import numpy as np


def tied_backward(E, W, b, tokens, targets, *, res, s_in):
    tokens = np.asarray(tokens).reshape(-1)
    targets = np.asarray(targets).reshape(-1)
    n = tokens.size
    x = s_in * E[tokens]
    u = x @ W
    h = res * x + np.tanh(u)
    logits = h @ E.T + (0 if b is None else b)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -logp[np.arange(n), targets].mean()
    g = np.exp(logp)
    g[np.arange(n), targets] -= 1
    g /= n
    dh = g @ E
    du = dh * (1 - np.tanh(u) ** 2)
    dx = res * dh + du @ W.T
    dE = g.T @ h                            # output path
    np.add.at(dE, tokens, s_in * dx)        # input path: repeated tokens add
    return {"loss": loss, "dE": dE, "dW": x.T @ du, "db": None if b is None else g.sum(0)}
'''
INPUT_PATH = "    np.add.at(dE, tokens, s_in * dx)        # input path: repeated tokens add\n"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _workflow() -> dict[Any, Any]:
    doc = _yaml(WORKFLOW)
    assert isinstance(doc, dict)
    return doc


def _action() -> dict[str, Any]:
    doc = _yaml(ACTION)
    assert isinstance(doc, dict)
    return doc


def _triggers(doc: dict[Any, Any]) -> Any:
    # PyYAML reads YAML 1.1, where a bare `on` is the boolean true; GitHub reads it as the key.
    return doc["on"] if "on" in doc else doc.get(True)


def _workflow_steps() -> list[dict[str, Any]]:
    jobs = _workflow()["jobs"]
    assert len(jobs) == 1, f"expected one job, got {sorted(jobs)}"
    steps = next(iter(jobs.values()))["steps"]
    assert isinstance(steps, list)
    return steps


def _action_step() -> dict[str, Any]:
    (step,) = [s for s in _workflow_steps() if USES.fullmatch(str(s.get("uses", "")))]
    return step


def _action_steps(given: dict[str, Any], action_path: Path) -> list[dict[str, Any]]:
    """The Action's steps as the runner runs them for ``with: given``: each ``run`` with its
    ``shell`` and its ``env`` evaluated (an input from ``given``, else its default;
    ``github.action_path``).  An expression this test does not evaluate fails it."""
    inputs = _action()["inputs"]
    assert set(given) <= set(inputs), f"inputs the Action does not take: {set(given) - set(inputs)}"
    required = {k for k, spec in inputs.items() if spec.get("required")}
    assert required <= set(given), f"required inputs not given: {required - set(given)}"
    values = {f"inputs.{k}": str(given.get(k, spec.get("default", "")))
              for k, spec in inputs.items()}
    values["github.action_path"] = str(action_path)

    def evaluate(text: Any) -> str:
        def one(m: re.Match[str]) -> str:
            assert m.group(1) in values, f"an expression the test does not evaluate: {m[0]}"
            return values[m.group(1)]
        return EXPRESSION.sub(one, str(text))

    return [{"name": step["name"], "run": step["run"], "shell": step["shell"],
             "env": {k: evaluate(v) for k, v in step.get("env", {}).items()}}
            for step in _action()["runs"]["steps"]]


def _steps(action_path: Path = ROOT) -> list[dict[str, Any]]:
    """The job's steps, the Action's expanded in place of the step that uses it."""
    steps: list[dict[str, Any]] = []
    for step in _workflow_steps():
        if USES.fullmatch(str(step.get("uses", ""))):
            steps += _action_steps(step.get("with") or {}, action_path)
        else:
            steps.append(step)
    return steps


def _installs(step: dict[str, Any]) -> bool:
    return "pip install" in str(step.get("run", ""))


def _pytest_step() -> dict[str, Any]:
    runs = [s for s in _steps() if "run" in s and "pytest" in s["run"]]
    assert len(runs) == 1, runs
    return runs[0]


def _first_run_commands() -> list[str]:
    """The commands the workflow's header comment gives for the first run (`#   $ cmd`)."""
    return [m.group(1) for line in WORKFLOW.read_text(encoding="utf-8").splitlines()
            if (m := re.match(r"#\s+\$ (.+)$", line))]


def test_workflow_triggers_on_push_and_pull_request() -> None:
    triggers = _triggers(_workflow())
    assert triggers is not None, "the workflow has no `on:`; GitHub would never run it"
    names = set(triggers) if isinstance(triggers, dict | list) else {triggers}
    assert {"push", "pull_request"} <= names


def test_workflow_uses_the_action_at_the_tag_of_this_version() -> None:
    step = _action_step()
    match = USES.fullmatch(step["uses"])
    assert match and match["ref"] == f"v{tyingspec.__version__}", step["uses"]
    assert step["with"]["adapter"] == ADAPTER
    _action_steps(step["with"], ROOT)  # every input it gives is one the Action takes


def test_the_action_is_composite_and_takes_its_inputs_through_env_only() -> None:
    action = _action()
    assert action["runs"]["using"] == "composite"
    assert {"adapter", "kind", "baseline"} <= set(action["inputs"])
    used: set[str] = set()
    for step in action["runs"]["steps"]:
        # the shell _bash runs: GitHub's `bash --noprofile --norc -eo pipefail {0}`
        assert step["shell"] == "bash", step
        # an input spliced into the script's text would run as code: values go through env
        assert not EXPRESSION.search(step["run"]), step["run"]
        for value in step.get("env", {}).values():
            used |= {m.removeprefix("inputs.") for m in EXPRESSION.findall(str(value))}
    assert used - {"github.action_path"} == set(action["inputs"]), "an input no step reads"


def test_the_action_installs_tyingspec_from_its_own_checkout() -> None:
    installs = [s for s in _action_steps({"adapter": ADAPTER}, Path("/action")) if _installs(s)]
    assert len(installs) == 1
    (install,) = installs
    # one line, nothing else hidden in it; a non-editable install of the Action's files
    assert len(install["run"].strip().splitlines()) == 1
    assert shlex.split(install["run"])[:4] == ["python", "-m", "pip", "install"]
    assert "-e" not in shlex.split(install["run"])
    assert "/action" in install["env"].values()


def test_workflow_uploads_the_report_and_the_baseline_always() -> None:
    uploads = [s for s in _steps() if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert len(uploads) == 1
    step = uploads[0]
    # A failing gate is exactly when the report and the baseline it compared with are wanted.
    assert step.get("if") == "always()"
    paths = str(step["with"]["path"]).split()
    assert "tyingspec.xml" in paths and BASELINE in paths
    # upload-artifact v4.4+ drops dot files unless told otherwise, and the baseline is one.
    assert step["with"].get("include-hidden-files") is True
    # The files uploaded are the files the gate reads and pytest writes.
    env = _pytest_step()["env"]
    assert env["TYINGSPEC_BASELINE"] == BASELINE and env["TYINGSPEC_JUNIT"] == "tyingspec.xml"
    assert '"--tyingspec-baseline=$TYINGSPEC_BASELINE"' in _pytest_step()["run"]


def test_workflow_documents_the_first_run() -> None:
    commands = _first_run_commands()
    record = [c for c in commands if "--tyingspec-update-baseline" in c]
    assert len(record) == 1 and f"--tyingspec-baseline={BASELINE}" in record[0]
    assert f"--tyingspec-adapter={ADAPTER}" in record[0]
    assert any(c.startswith(f"git add {BASELINE}") and "git commit" in c for c in commands)


def _env(bin_: Path, **extra: str) -> dict[str, str]:
    """The venv's environment (tests/test_wheel.py's venv_env: no PYTHONPATH, CI or outer
    pytest settings; the job must make mypackage importable itself, and decide CI itself), with
    a git identity and none of this machine's git config for the scratch repository."""
    return venv_env(bin_, GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1",
                    GIT_AUTHOR_NAME="ci", GIT_AUTHOR_EMAIL="ci@example.invalid",
                    GIT_COMMITTER_NAME="ci", GIT_COMMITTER_EMAIL="ci@example.invalid", **extra)


def _bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # What GitHub runs for `shell: bash` (the workflow's default and each Action step's).
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _run_job(repo: Path, env: dict[str, str], action_path: Path, *,
             install: bool) -> subprocess.CompletedProcess[str]:
    """Run every `run:` step in order, as the runner would, each with its own env; returns the
    pytest step's result.  Steps after a failing one do not run (an `if: always()` step is an
    upload, which has no `run:`).  ``install=False`` leaves out the Action's install step, for
    a job run again in the venv it installed into."""
    result: subprocess.CompletedProcess[str] | None = None
    for step in _steps(action_path):
        script = step.get("run")
        if script is None or (_installs(step) and not install):
            continue
        done = _bash(script, repo, {**env, **step.get("env", {})})
        if "pytest" in script:
            result = done
        if done.returncode != 0:
            assert result is not None, f"{step['name']}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
            break
    assert result is not None, "the job never ran its pytest step"
    return result


@pytest.mark.slow
@pytest.mark.moved
def test_the_actions_suite_step_collects_the_suite_alone_from_the_path_given(
        tmp_path: Path) -> None:
    """The Action's pytest step with `path`, no baseline and `pytest-args` given (collection
    only, so that it stays fast), in a repository whose own tests fail and whose ini file
    pytest would refuse: neither is read, and the adapter is imported from `path`."""
    (tmp_path / "src" / "mypackage").mkdir(parents=True)
    (tmp_path / "src" / "mypackage" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "src" / "mypackage" / "grads.py").write_text(GRADS, encoding="utf-8")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_user.py").write_text("def test_user():\n    assert False\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    given = {"adapter": ADAPTER, "path": "src", "baseline": "", "workers": "0",
             "pytest-args": "--collect-only -q"}
    (step,) = [s for s in _action_steps(given, ROOT) if "pytest" in s["run"]]
    env = _env(Path(sys.executable).parent)  # this python: tyingspec is installed here
    done = _bash(step["run"], tmp_path, {**env, **step["env"]})
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    collected = re.findall(r"^tyingspec::(test_\w+)$", done.stdout, re.M)
    assert "test_sum_of_paths" in collected, text[-3000:]
    assert "test_user" not in text and "no-such-option" not in text
    # and with the adapter's folder not given, it is not found at the repository root
    (step,) = [s for s in _action_steps({**given, "path": "."}, ROOT) if "pytest" in s["run"]]
    done = _bash(step["run"], tmp_path, {**env, **step["env"]})
    assert done.returncode != 0 and "No module named 'mypackage'" in done.stdout + done.stderr


# Three runs of the whole property suite (record, pass, fail) and an install: 100-150 s on this
# 2-core machine, so the slow tier runs it.
@pytest.mark.slow
def test_workflow_runs_in_a_repository_holding_only_the_adapter(tmp_path: Path) -> None:
    assert _workflow()["defaults"]["run"]["shell"] == "bash"  # so _bash runs as GitHub does
    repo = tmp_path / "repo"
    (repo / "mypackage").mkdir(parents=True)
    (repo / "mypackage" / "__init__.py").write_text("", encoding="utf-8")
    (repo / "mypackage" / "grads.py").write_text(GRADS, encoding="utf-8")
    bin_ = fresh_venv(tmp_path / "venv")
    action_path = source_copy(tmp_path / "action")  # the Action's checkout at its tag
    env = _env(bin_)
    for cmd in (["git", "init", "-q"], ["git", "add", "mypackage"],
                ["git", "commit", "-q", "-m", "adapter"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)

    # The Action's install step, into the venv: the tyingspec every later step runs is it.
    (install,) = [s for s in _steps(action_path) if _installs(s)]
    done = _bash(install["run"], repo, {**env, **install["env"]})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    where = subprocess.run(["python", "-c", "import tyingspec; print(tyingspec.__file__)"],
                           cwd=repo, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(tmp_path / "venv")), where

    # The first run, on the developer's machine (no CI), as the workflow's comment says.
    plugin_src = (ROOT / "tyingspec" / "_src" / "front" / "plugin.py").read_text(encoding="utf-8")
    assert "--tyingspec-update-baseline" in plugin_src
    for command in _first_run_commands():
        done = _bash(command, repo, env)
        assert done.returncode == 0, f"{command}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert subprocess.run(["git", "ls-files", "--error-unmatch", BASELINE], cwd=repo,
                          env=env, capture_output=True).returncode == 0, "baseline not committed"

    summary = tmp_path / "step-summary.md"
    ci_env = _env(bin_, CI="true", GITHUB_STEP_SUMMARY=str(summary))
    job = _run_job(repo, ci_env, action_path, install=False)
    assert job.returncode == 0, f"{job.stdout[-4000:]}\n{job.stderr[-2000:]}"
    assert "profile ci" in job.stdout  # CI=true chose the derandomized profile
    text = summary.read_text(encoding="utf-8")
    assert f"`{ADAPTER}`" in text and "| `sum_of_paths` |" in text and "❌" not in text
    cases = ET.parse(repo / "tyingspec.xml").getroot().iter("testcase")
    names = [c.get("name", "") for c in cases]
    assert "test_sum_of_paths" in names
    assert (repo / BASELINE).is_file()

    # Drop the input path: the same job must fail, through the property and through the gate.
    broken = GRADS.replace(INPUT_PATH, "")
    assert broken != GRADS
    (repo / "mypackage" / "grads.py").write_text(broken, encoding="utf-8")
    job = _run_job(repo, ci_env, action_path, install=False)
    assert job.returncode != 0, job.stdout[-4000:]
    assert "tyingspec baseline REGRESSION" in job.stdout
    assert "input_path_missing" in summary.read_text(encoding="utf-8")


# --- pre-commit --------------------------------------------------------------------------------

def _hooks() -> dict[str, dict[str, Any]]:
    hooks = _yaml(HOOKS)
    assert isinstance(hooks, list) and hooks
    by_id = {h["id"]: h for h in hooks}
    assert len(by_id) == len(hooks), "two hooks share an id"
    return by_id


def test_the_hooks_are_pre_commit_hooks_running_tyingspec_check() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["scripts"]
    for hook_id, hook in _hooks().items():
        assert {"id", "name", "entry", "language"} <= set(hook) <= HOOK_KEYS, hook_id
        assert hook["language"] in ("python", "system"), hook_id
        assert shlex.split(hook["entry"])[:2] == ["tyingspec", "check"], hook_id
        assert "tyingspec" in scripts  # the console script a python hook's install provides
        # `tyingspec check` takes one target: a file name after it would be a second one
        assert hook["pass_filenames"] is False, hook_id


def _config_hooks() -> list[dict[str, Any]]:
    config = _yaml(PRE_COMMIT_CONFIG)
    (repo,) = config["repos"]
    assert repo["repo"].rstrip("/").endswith("/tyingspec")
    assert repo["rev"] == f"v{tyingspec.__version__}"
    hooks = repo["hooks"]
    assert isinstance(hooks, list) and hooks
    return hooks


def _hook_command(hook: dict[str, Any]) -> list[str]:
    """What pre-commit runs for ``hook`` (a configuration's entry): the manifest's entry, then
    the configuration's args (no file names: pass_filenames is false); `tyingspec` run as this
    python's module, the console script a python hook's environment has."""
    entry = shlex.split(_hooks()[hook["id"]]["entry"])
    assert entry[0] == "tyingspec"
    return [sys.executable, "-m", "tyingspec", *entry[1:], *map(str, hook.get("args", []))]


@pytest.mark.slow
@pytest.mark.moved
def test_the_example_pre_commit_config_runs_its_hook_as_pre_commit_does(tmp_path: Path) -> None:
    (hook,) = _config_hooks()
    assert hook["id"] in _hooks()
    files = re.compile(hook["files"])  # pre-commit: re.search on each changed path
    assert files.search("mypackage/grads.py") and not files.search("mypackage/other.py")
    (tmp_path / "mypackage").mkdir()
    (tmp_path / "mypackage" / "__init__.py").write_text("", encoding="utf-8")
    grads = tmp_path / "mypackage" / "grads.py"
    env = venv_env(Path(sys.executable).parent)
    for source, code in ((GRADS, 0), (GRADS.replace(INPUT_PATH, ""), 1)):
        grads.write_text(source, encoding="utf-8")
        done = subprocess.run(_hook_command(hook), cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == code, done.stdout[-3000:] + done.stderr[-2000:]
    assert "input_path_missing" in done.stdout


def _torch_requirements(extra: str) -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    reqs: list[str] = pyproject["project"]["optional-dependencies"][extra]
    return [r for r in reqs if re.match(r"torch\b(?![-_])", r)]


def _torch_requirements_of_core() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return [r for r in pyproject["project"]["dependencies"] if re.match(r"torch\b(?![-_])", r)]


def test_torch_extras_ask_for_a_range_so_a_users_torch_is_kept() -> None:
    for extra in ("torch", "transformers"):
        (req,) = _torch_requirements(extra)
        assert "==" not in req and "===" not in req, f"[{extra}] pins {req!r}"
        assert ">=" in req, f"[{extra}] {req!r}: expected a lower bound such as torch>=2.1"


def _constraints() -> dict[str, str]:
    lines = (ROOT / ".ci" / "constraints.txt").read_text(encoding="utf-8").splitlines()
    pins = [ln.split("#")[0].strip() for ln in lines]
    return dict(p.split("==", 1) for p in pins if p)


def test_ci_constraints_pin_the_tested_cpu_torch() -> None:
    # 2.13.0 is the CPU wheel this machine has; any other release pulls a CUDA build.
    assert _constraints().get("torch") == "2.13.0"


def test_ci_run_installs_torch_only_under_the_constraints() -> None:
    installs = [ln for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
                if ln.startswith("pip install")]
    assert installs, ".ci/run installs nothing"
    assert not _torch_requirements_of_core(), "the core dependencies name torch"
    for line in installs:
        words = shlex.split(line.split("&&")[0])
        extras = [w for w in words if w.startswith(".[")]
        pulls_torch = any(_torch_requirements(e) for x in extras
                          for e in x[2:-1].split(","))
        if pulls_torch:
            assert "-c" in words and words[words.index("-c") + 1] == ".ci/constraints.txt", line
    dev = [ln for ln in installs if "'.[dev]'" in ln]
    assert len(dev) == 1 and " -c .ci/constraints.txt" in dev[0]


def test_ci_runs_the_readmes_two_commands_as_written() -> None:
    # the README's two set-up commands are the first two lines .ci/run runs (each followed by
    # `|| exit 1`, since `set -e` does not stop inside an `a && b` list)
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```\n", 2)[1]
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2, block
    run = [line.removesuffix(" || exit 1") for line in (ROOT / ".ci" / "run").read_text()
           .splitlines() if line.startswith("pip install")]
    assert run == commands
