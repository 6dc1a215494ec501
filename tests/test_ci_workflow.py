"""The example CI workflow runs as written, and tyingspec's torch extras keep a user's torch.

``examples/ci/tied-gradients.yml`` is the workflow the README tells another repository to
copy.  Its job is run here, step by step, in a repository that holds nothing but an adapter
package: the only step left out is the install of tyingspec from its git URL (this python
already has it, and the test must not reach the network).
"""

from __future__ import annotations

import os
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

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "examples" / "ci" / "tied-gradients.yml"
BASELINE = ".tyingspec-baseline.json"
ADAPTER = "mypackage.grads:tied_backward"

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


def _workflow() -> dict[Any, Any]:
    doc = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _triggers(doc: dict[Any, Any]) -> Any:
    # PyYAML reads YAML 1.1, where a bare `on` is the boolean true; GitHub reads it as the key.
    return doc["on"] if "on" in doc else doc.get(True)


def _steps() -> list[dict[str, Any]]:
    jobs = _workflow()["jobs"]
    assert len(jobs) == 1, f"expected one job, got {sorted(jobs)}"
    steps = next(iter(jobs.values()))["steps"]
    assert isinstance(steps, list)
    return steps


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
    # The file uploaded is the file the gate reads.
    assert f"--tyingspec-baseline={BASELINE}" in _pytest_step()["run"]


def test_workflow_documents_the_first_run() -> None:
    commands = _first_run_commands()
    record = [c for c in commands if "--tyingspec-update-baseline" in c]
    assert len(record) == 1 and f"--tyingspec-baseline={BASELINE}" in record[0]
    assert f"--tyingspec-adapter={ADAPTER}" in record[0]
    assert any(c.startswith(f"git add {BASELINE}") and "git commit" in c for c in commands)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This machine's environment without the outer pytest's, CI's or a PYTHONPATH: the job
    must make mypackage importable itself, and decide CI itself."""
    drop = ("PYTEST_", "GITHUB_", "HYPOTHESIS_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("CI", "TF_BUILD", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # git commit in the scratch repository: an identity, and none of this machine's git config
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1",
               GIT_AUTHOR_NAME="ci", GIT_AUTHOR_EMAIL="ci@example.invalid",
               GIT_COMMITTER_NAME="ci", GIT_COMMITTER_EMAIL="ci@example.invalid")
    env.update(extra)
    return env


def _bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # What GitHub runs for `shell: bash` (the workflow's default, asserted below).
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _run_job(repo: Path, env: dict[str, str]) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Run every `run:` step in order, as the runner would; returns the steps skipped and the
    pytest step's result.  Steps after a failing one do not run (an `if: always()` step is an
    upload, which has no `run:`)."""
    skipped: list[str] = []
    result: subprocess.CompletedProcess[str] | None = None
    for step in _steps():
        script = step.get("run")
        if script is None:
            continue
        if "git+" in script:  # the install from tyingspec's git URL: installed here already
            skipped.append(script)
            continue
        done = _bash(script, repo, env)
        if "pytest" in script:
            result = done
        if done.returncode != 0:
            break
    assert result is not None, "the job never ran its pytest step"
    return skipped, result


# Three runs of the whole property suite (record, pass, fail): 100-150 s on this 2-core
# machine, so the slow tier runs it.
@pytest.mark.slow
def test_workflow_runs_in_a_repository_holding_only_the_adapter(tmp_path: Path) -> None:
    doc = _workflow()
    assert doc["defaults"]["run"]["shell"] == "bash"  # so _bash runs the steps as GitHub does
    repo = tmp_path / "repo"
    (repo / "mypackage").mkdir(parents=True)
    (repo / "mypackage" / "__init__.py").write_text("", encoding="utf-8")
    (repo / "mypackage" / "grads.py").write_text(GRADS, encoding="utf-8")
    env = _env(tmp_path)
    for cmd in (["git", "init", "-q"], ["git", "add", "mypackage"],
                ["git", "commit", "-q", "-m", "adapter"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)

    # The first run, on the developer's machine (no CI), as the workflow's comment says.
    plugin_src = (ROOT / "tyingspec" / "_src" / "front" / "plugin.py").read_text(encoding="utf-8")
    assert "--tyingspec-update-baseline" in plugin_src
    for command in _first_run_commands():
        done = _bash(command, repo, env)
        assert done.returncode == 0, f"{command}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert subprocess.run(["git", "ls-files", "--error-unmatch", BASELINE], cwd=repo,
                          env=env, capture_output=True).returncode == 0, "baseline not committed"

    summary = tmp_path / "step-summary.md"
    ci_env = _env(tmp_path, CI="true", GITHUB_STEP_SUMMARY=str(summary))
    skipped, job = _run_job(repo, ci_env)
    # The install is the only line not run, and it is one line: nothing else hides in it.
    assert len(skipped) == 1 and len(skipped[0].strip().splitlines()) == 1
    assert shlex.split(skipped[0])[:4] == ["python", "-m", "pip", "install"]
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
    _, job = _run_job(repo, ci_env)
    assert job.returncode != 0, job.stdout[-4000:]
    assert "tyingspec baseline REGRESSION" in job.stdout
    assert "input_path_missing" in summary.read_text(encoding="utf-8")


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
