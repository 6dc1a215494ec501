"""tyingspec as a user installs it: the wheel ``pip wheel`` builds, installed (not editable) in a
fresh venv and run from outside the checkout, runs every kind, writes reports that the schemas
installed with it validate, and runs the property suite as the pytest plugin; and the version
that the wheel, the package, the command and CHANGELOG.md give is one number.

The wheel is built from a copy of the files a clone of this checkout holds (``git ls-files``,
untracked files not ignored included), so no ``build/`` folder left by an earlier build can
slip a file in.  The venv reaches this interpreter's site-packages (numpy, torch, jax, ...:
nothing is downloaded) through a path file, which runs none of the ``.pth`` files there: the
checkout's editable install, a meta-path finder such a file installs, cannot answer an import
of ``tyingspec`` in it.  The test checks that the import fails before the wheel is installed,
and that the modules of each run after it are the venv's.  The helpers here are
tests/test_ci_workflow.py's too, which runs the Action's install step in such a venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

import tyingspec
from tyingspec._src.front.cli import main

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"
README = ROOT / "README.md"
#: the README's plugin quick start, run in a folder holding a copy of examples/numpy_model
PLUGIN_COMMAND = ("pytest examples/numpy_model "
                  "--tyingspec-adapter=examples.numpy_model.grads:tied_backward")


# --- the version: one number -----------------------------------------------------------------

def test_the_version_is_the_packages_and_the_command_prints_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", tyingspec.__version__)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    # one place: the wheel's metadata reads the package's own attribute
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "tyingspec.__version__"}
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"tyingspec {tyingspec.__version__}\n"


def changelog_versions() -> list[str]:
    return re.findall(r"^## (\d+\.\d+\.\d+)\b", CHANGELOG.read_text(encoding="utf-8"), re.M)


def test_the_changelog_starts_with_this_version_and_lists_each_once() -> None:
    versions = changelog_versions()
    assert versions and versions[0] == tyingspec.__version__, versions
    assert len(set(versions)) == len(versions)
    as_tuples = [tuple(map(int, v.split("."))) for v in versions]
    assert as_tuples == sorted(as_tuples, reverse=True), versions


def _install_section() -> str:
    text = README.read_text(encoding="utf-8")
    return text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_install_names_the_wheel_and_the_tag_of_this_version() -> None:
    install = _install_section()
    version = tyingspec.__version__
    assert "YOUR-GIT-HOST" not in README.read_text(encoding="utf-8")
    assert f"dist/tyingspec-{version}-py3-none-any.whl" in install
    assert f"v{version}" in install
    assert "pip wheel --no-deps . -w dist" in install


# --- the wheel, installed in a fresh venv ----------------------------------------------------

def source_copy(dest: Path) -> Path:
    """The files a clone of this checkout holds (and untracked ones not ignored), copied to
    ``dest``: what ``pip wheel .`` reads in a fresh clone, with no build/ of an earlier one."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted in the working tree stays listed until committed
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def fresh_venv(where: Path) -> Path:
    """A venv at ``where`` that imports this interpreter's packages but not tyingspec (see the
    module's docstring); returns its ``bin`` folder."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True)
    bin_ = where / "bin"
    purelib = subprocess.run(
        [str(bin_ / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_tyingspec_test_host.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n", encoding="utf-8")
    return bin_


def venv_env(bin_: Path, **extra: str) -> dict[str, str]:
    """This machine's environment for a command of the venv at ``bin_``: its bin first on PATH;
    no PYTHONPATH (which could reach the checkout), no outer pytest's, CI's or Hypothesis'
    settings."""
    drop = ("PYTEST_", "GITHUB_", "HYPOTHESIS_", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("CI", "TF_BUILD", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{bin_}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str],
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@dataclass(frozen=True)
class Installed:
    wheel: Path
    source: Path  # the copy it was built from
    bin: Path  # the venv's bin
    home: Path  # a folder outside the checkout, where the user's commands run

    @property
    def site(self) -> str:
        return str(self.bin.parent)

    def env(self) -> dict[str, str]:
        return venv_env(self.bin)


def install(tmp: Path) -> Installed:
    """The README's build of the wheel from a copy of the checkout, installed in a fresh venv."""
    source = source_copy(tmp / "src")
    dist = tmp / "dist"
    bin_ = fresh_venv(tmp / "venv")
    home = tmp / "home"
    home.mkdir()
    env = venv_env(bin_)
    # the README's command, as a user runs it in a clone (pip's build isolation, no deps)
    built = run([str(bin_ / "python"), "-m", "pip", "wheel", "--no-deps", ".", "-w", str(dist)],
                source, env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("tyingspec-*.whl")
    before = run([str(bin_ / "python"), "-c", "import tyingspec"], home, env)
    assert before.returncode != 0, "the venv imports tyingspec before the wheel is installed"
    # --no-index: the wheel's requirements must already be met here (nothing downloaded)
    done = run([str(bin_ / "python"), "-m", "pip", "install", "--no-index", str(wheel)],
               home, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Installed(wheel, source, bin_, home)


def _expected_files(source: Path) -> set[str]:
    """What the wheel must hold: every module of ``tyingspec/`` and ``properties/`` (installed as
    tyingspec.properties), the schemas and ``py.typed``."""
    files = {str(p.relative_to(source)) for p in (source / "tyingspec").rglob("*")
             if p.is_file() and (p.suffix in (".py", ".json") or p.name == "py.typed")}
    files |= {"tyingspec/properties/" + str(p.relative_to(source / "properties"))
              for p in (source / "properties").rglob("*.py")}
    return files


def _holds_every_module_the_schemas_and_the_property_suite(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = {n for n in whl.namelist() if not n.startswith("tyingspec-")}  # dist-info
        metadata = next(whl.read(n).decode() for n in whl.namelist()
                        if n.endswith(".dist-info/METADATA"))
    expected = _expected_files(installed.source)
    assert {n for n in expected if n.startswith("tyingspec/schemas/")}, expected
    assert names == expected, (sorted(expected - names), sorted(names - expected))
    assert f"\nVersion: {tyingspec.__version__}\n" in metadata
    assert installed.wheel.name == f"tyingspec-{tyingspec.__version__}-py3-none-any.whl"


#: walks the installed package, imports every module and prints where each came from
IMPORT_ALL = """
import importlib, json, pkgutil, sys, tyingspec
names = sorted(m.name for m in pkgutil.walk_packages(tyingspec.__path__, "tyingspec."))
for name in names:
    if name == "tyingspec.__main__":  # importing it runs the command
        continue
    importlib.import_module(name)
print(json.dumps({"version": tyingspec.__version__,
                  "files": {n: m.__file__ for n, m in sys.modules.items()
                            if n == "tyingspec" or n.startswith("tyingspec.")}}))
"""


def _every_module_imports_from_the_venv_and_reports_the_version(installed: Installed) -> None:
    env = installed.env()
    done = run([str(installed.bin / "python"), "-c", IMPORT_ALL], installed.home, env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["version"] == tyingspec.__version__
    modules = set(found["files"])
    assert "tyingspec.properties" in modules and "tyingspec._src.front.plugin" in modules
    wheel_modules = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                     for n in _expected_files(installed.source) if n.endswith(".py")}
    wheel_modules.discard("tyingspec.__main__")
    assert wheel_modules <= modules, sorted(wheel_modules - modules)
    elsewhere = {n: f for n, f in found["files"].items() if not f.startswith(installed.site)}
    assert not elsewhere, elsewhere
    version = run([str(installed.bin / "tyingspec"), "--version"], installed.home, env)
    assert version.stdout == f"tyingspec {tyingspec.__version__}\n", version
    metadata = run([str(installed.bin / "python"), "-c",
                    "import importlib.metadata as m; print(m.version('tyingspec'))"],
                   installed.home, env)
    assert metadata.stdout.strip() == tyingspec.__version__


def _installed_schema(installed: Installed, name: str) -> dict[str, object]:
    """The schema file the installed package carries, read as the docs say a consumer reads it."""
    done = run([str(installed.bin / "python"), "-c",
                "import sys; from importlib.resources import files; "
                "print(files('tyingspec').joinpath('schemas', sys.argv[1]).read_text())", name],
               installed.home, installed.env())
    assert done.returncode == 0, done.stderr[-2000:]
    schema = json.loads(done.stdout)
    assert isinstance(schema, dict)
    return schema


# (argv after `tyingspec check`, exit status, the label the report gives): one built-in of each
# kind (one case where a kind's cases are slow), and a broken one
CHECKS: list[tuple[list[str], int, str]] = [
    ([], 0, ""),  # the built-in default: the write-up's table (tyingspec.demo/1)
    (["output-path-only"], 1, "input_path_missing"),
    (["tied", "--kind", "kernel"], 0, "correct"),
    (["nanogpt", "--kind", "torch", "--case", "absent-tokens"], 0, "correct"),
    (["ce-numpy", "--kind", "linear-ce"], 0, "correct"),
    (["nnx-tied", "--kind", "jax", "--case", "absent-tokens"], 0, "correct"),
    (["gpt-ddp", "--kind", "distributed", "--case", "absent-tokens"], 0, "correct"),
]


def _every_kind_runs_outside_the_checkout(installed: Installed) -> None:
    env = installed.env()
    schemas = {n: _installed_schema(installed, n) for n in ("check-1.json", "demo-1.json")}
    for i, (argv, code, label) in enumerate(CHECKS):
        out = installed.home / f"report-{i}.json"
        done = run([str(installed.bin / "tyingspec"), "check", *argv, "--json", str(out)],
                   installed.home, env)
        text = done.stdout + done.stderr
        assert done.returncode == code, (argv, text[-3000:])
        assert "Traceback" not in text, (argv, text[-3000:])
        report = json.loads(out.read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator(
            schemas["demo-1.json" if not argv else "check-1.json"]).validate(report)
        if argv:
            assert report["diagnosis"] == label, (argv, report["diagnosis"])
        else:
            assert report["as_expected"] is True


def _the_plugin_runs_the_readmes_numpy_adapter(installed: Installed) -> None:
    assert PLUGIN_COMMAND in README.read_text(encoding="utf-8")
    user = installed.home / "plugin"
    shutil.copytree(ROOT / "examples" / "numpy_model", user / "examples" / "numpy_model",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the venv has no pytest script of its own (pytest is the host's), so its python runs
    # the README's command as `python -m pytest ...`
    argv = [str(installed.bin / "python"), "-m", *PLUGIN_COMMAND.split(), "-p",
            "no:cacheprovider", "--trace-config"]
    done = run(argv, user, installed.env())
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    passed = re.search(r"(\d+) passed", text)
    assert passed and int(passed.group(1)) > 0, text[-3000:]
    assert not re.search(r"\d+ (failed|error)", text), text[-3000:]
    # --trace-config names each plugin's module file: the one registered is the wheel's
    plugin = re.search(r"<module 'tyingspec\._src\.front\.plugin' from '([^']+)'>", text)
    assert plugin and plugin.group(1).startswith(installed.site), text[:3000]


# One test, since each worker of xdist would build and install its own wheel for a fixture
# (half a minute of CPU each): the build, the install, every module, every kind and the plugin.
@pytest.mark.slow
def test_the_wheel_installs_and_runs_every_kind_and_the_plugin_outside_the_checkout(
        tmp_path: Path) -> None:
    installed = install(tmp_path)
    _holds_every_module_the_schemas_and_the_property_suite(installed)
    _every_module_imports_from_the_venv_and_reports_the_version(installed)
    _every_kind_runs_outside_the_checkout(installed)
    _the_plugin_runs_the_readmes_numpy_adapter(installed)
