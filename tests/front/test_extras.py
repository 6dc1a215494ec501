"""A missing extra names the one ``pip install`` that brings what the run needs: the kind's own
modules and, read from the target's source, the modules the target imports.

``--kind torch`` on a transformers model, in an install with neither torch nor transformers,
said ``pip install 'tyingspec[torch]'``; the next run, after that install, failed again on
transformers.  The subprocess tests refuse the packages as tests/front/test_attacks_input.py does (a
``sitecustomize`` on ``PYTHONPATH`` putting a meta-path finder first, in the command and every
worker it starts).
"""

from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import pytest
from test_attacks_input import BLOCKER, run

from tyingspec._src.core.extras import (
    EXTRAS,
    INCLUDES,
    MissingExtra,
    hint_text,
    imports_reached,
    require,
    target_imports,
)

ROOT = Path(__file__).resolve().parents[2]
NO_TORCH = "torch,transformers,safetensors"  # an install of tyingspec alone

# A user's module: make_model builds a transformers model through a helper; make_plain builds
# a torch one and never reaches transformers; the TYPE_CHECKING import never runs.
USER_MODELS = textwrap.dedent('''
    from typing import TYPE_CHECKING

    import torch

    if TYPE_CHECKING:
        import jax

    def _config():
        from transformers import GPT2Config
        return GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)

    def make_model():
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel(_config())

    def make_plain():
        return torch.nn.Linear(2, 2)
''')


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    """A scratch folder holding tests/front/test_attacks_input.py's blocker and USER_MODELS."""
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCKER)
    (tmp_path / "models").mkdir()  # a namespace package: no __init__.py
    (tmp_path / "models" / "hf.py").write_text(USER_MODELS)
    return tmp_path


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize(("argv", "extra"), [
    (["check", "gpt2", "--kind", "torch", "--case", "absent-tokens"], "transformers"),
    (["check", "gpt2", "--case", "absent-tokens"], "transformers"),  # its own kind: torch
    (["check", "models.hf:make_model", "--kind", "torch"], "transformers"),
    (["check", "nanogpt", "--kind", "torch", "--case", "absent-tokens"], "torch"),
    (["check", "models.hf:make_plain", "--kind", "torch"], "torch"),
], ids=["transformers-builtin", "transformers-builtin-own-kind", "transformers-user-model",
        "torch-builtin", "torch-user-model"])
def test_kind_torch_without_torch_names_the_extra_the_target_needs(
        models: Path, argv: list[str], extra: str) -> None:
    out = run(models, argv, NO_TORCH)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    installs = re.findall(r"pip install '[^']+'", text)
    # one install, of the extra that brings everything: [transformers] holds torch
    assert installs == [f"pip install 'tyingspec[{extra}]'"], text[-3000:]
    assert "--kind torch needs torch" in text, text[-3000:]
    assert ("imports transformers" in text) == (extra == "transformers"), text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.moved
def test_with_torch_installed_only_the_missing_transformers_is_named(models: Path) -> None:
    out = run(models, ["check", "models.hf:make_model", "--kind", "torch"], "transformers")
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "pip install 'tyingspec[transformers]'" in text and "tyingspec[torch]" not in text


# --- reading what a target imports -----------------------------------------------------------

def test_the_imports_followed_from_the_target_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "hf.py"
    path.write_text(USER_MODELS)
    # module level (torch, typing), the target's body and the helper it calls (transformers);
    # never an import under TYPE_CHECKING (jax)
    assert imports_reached(str(path), "make_model") == {"typing", "torch", "transformers"}
    assert imports_reached(str(path), "make_plain") == {"typing", "torch"}
    assert imports_reached(str(path), "no_such_name") == {"typing", "torch"}
    assert imports_reached(str(tmp_path / "missing.py"), "f") == frozenset()


def test_module_level_code_and_classes_are_followed(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent('''
        from .sibling import thing  # relative: not a package to install

        def _optimizer(model):
            import ml_dtypes
            return model

        class Model:
            def build(self):
                import transformers

        target = make(_optimizer)  # runs on import, so _optimizer's imports count
    '''))
    assert imports_reached(str(path), "target") == {"ml_dtypes"}
    assert imports_reached(str(path), "Model") == {"ml_dtypes", "transformers"}


def test_a_target_is_found_without_running_its_packages(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "pkg" / "models.py").write_text("import transformers\n")
    (tmp_path / "ns").mkdir()  # a namespace package
    (tmp_path / "ns" / "m.py").write_text("import torch\n")
    paths = (str(tmp_path),)
    assert target_imports("pkg.models:f", paths) == {"transformers"}
    assert target_imports("ns.m:f", paths) == {"torch"}
    assert target_imports("ns:f", paths) == frozenset()  # no file to read
    assert target_imports("pkg.absent:f", paths) == frozenset()


def test_a_builtin_is_read_from_its_factory() -> None:
    pytest.importorskip("torch")
    from tyingspec._src.kinds.table import kind_spec

    builtins = kind_spec("torch").builtins()
    for name in ("gpt2", "gpt2-copy-tie", "gpt2-resize-unties"):
        assert "transformers" in target_imports(name, (), builtins[name].adapter("torch")), name
    for name in ("nanogpt", "nanogpt-copy-tie"):
        assert "transformers" not in target_imports(name, (), builtins[name].adapter("torch"))


# --- the message -------------------------------------------------------------------------------

def test_one_install_names_the_extras_and_drops_those_another_includes() -> None:
    assert hint_text("torch") == "pip install 'tyingspec[torch]'"
    assert hint_text("torch", "transformers") == "pip install 'tyingspec[transformers]'"
    assert hint_text("transformers.models", "safetensors") == \
        "pip install 'tyingspec[transformers]'"
    assert hint_text("torch", "ml_dtypes") == "pip install 'tyingspec[torch,bfloat16]'"
    assert hint_text("torch", "einops") == "pip install 'tyingspec[torch]'; pip install einops"


def test_require_asks_the_targets_imports_only_when_something_is_missing() -> None:
    asked: list[int] = []

    def imports() -> list[str]:
        asked.append(1)
        return ["transformers"]

    require("json", "--kind x", imports)
    assert asked == []  # installed: the target's source is not read
    with pytest.raises(MissingExtra) as missing:
        require("tyingspec_no_such_module", "--kind x", lambda: ["tyingspec_no_such_either"])
    # a module no extra brings is not the target's install to name
    assert "imports" not in str(missing.value)


def test_includes_is_in_step_with_the_extras_of_pyproject() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["optional-dependencies"]
    named = set(EXTRAS.values())
    assert named <= set(extras)
    holds = {(big, small) for big in named for small in named
             if big != small and set(extras[small]) <= set(extras[big])}
    assert holds == {(big, small) for big, smalls in INCLUDES.items() for small in smalls}
