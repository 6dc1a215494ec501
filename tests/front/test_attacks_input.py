"""Clumsy input, continued: each row is something a user can type that once ran nothing and said
"correct", printed a traceback, or exited 1 (which only a wrong gradient may give).  Every row
gives the exit status and the words the message must hold; 0 only when every case reached a
verdict, 1 only for a wrong gradient, 2 for usage errors (``pytest``'s own 4 for the plugin).

A missing extra is simulated by a ``sitecustomize`` on ``PYTHONPATH`` that puts a meta-path
finder first, refusing the named top-level modules (``BLOCK_MODULES``) in the command and in
every worker process it starts, as an environment without the package would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tyingspec

ROOT = Path(tyingspec.__file__).resolve().parents[1]

BLOCKER = textwrap.dedent('''
    import os, sys
    _BLOCK = set(filter(None, os.environ.get("BLOCK_MODULES", "").split(",")))

    class _Blocker:
        """Refuses the blocked packages, as if they were not installed."""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _BLOCK:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Blocker())
''')

ADAPTERS = textwrap.dedent('''
    def ce_always_raises(h, E, targets, b=None, *, grad_output=None):
        """A broken linear-ce kernel declaring no option: it must never pass by running
        nothing."""
        raise RuntimeError("broken kernel")
''')

TORCH_MODEL = textwrap.dedent('''
    import torch

    def make_model():
        return torch.nn.Linear(2, 2)
''')


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCKER)
    (tmp_path / "adapters.py").write_text(ADAPTERS)
    (tmp_path / "torch_model.py").write_text(TORCH_MODEL)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "m.safetensors").write_text("")
    return tmp_path


def run(repo: Path, argv: list[str], block: str = "", *, module: str = "tyingspec._src.front.cli",
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV`` in ``repo``, the packages in ``block`` (comma-separated)
    missing."""
    env = {**os.environ, "BLOCK_MODULES": block,
           "PYTHONPATH": os.pathsep.join([str(repo / "block"), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=repo, capture_output=True,
                          text=True, timeout=timeout, env=env)


ONE_CE = ["--case", "ce-logit-scale"]
TORCH_TOKENS = ",".join(map(str, range(1, 17)))

# (id, argv, packages missing, exit status, words the output must hold)
ATTACKS: list[tuple[str, list[str], str, int, list[str]]] = [
    # -- zero cases is no verdict (it said "verdict: correct" and exited 0)
    ("torch-case-left-out-by-the-model-shape",
     ["check", "nanogpt", "--kind", "torch", "--case", "v-equals-1"], "", 2,
     ["no case 'v-equals-1'", "known: absent-tokens"]),
    ("linear-ce-case-needing-an-undeclared-option",
     ["check", "adapters:ce_always_raises", "--kind", "linear-ce", *ONE_CE], "", 2,
     ["no case left to run", "left out ce-logit-scale", "logit_scale"]),
    ("padding-idx-beyond-every-case",
     ["check", "output-path-only", "--padding-idx", "40"], "", 2,
     ["no case left to run", "--padding-idx 40", "no such row"]),
    ("padding-idx-a-million", ["check", "tied", "--padding-idx", "1000000"], "", 2,
     ["no case left to run", "no such row"]),
    ("padding-idx-beyond-the-chosen-case",
     ["check", "tied", "--case", "v-equals-1", "--padding-idx", "3"], "", 2,
     ["no case left to run", "left out v-equals-1", "no such row"]),
    ("mutants-selecting-nothing", ["mutants", "--only", "tied", "--kind", "torch"], "", 2,
     ["nothing to run", "tied comes in --kind model or kernel"]),
    # -- outputs checked before the work (it printed the matrix, then a traceback)
    ("mutants-json-into-a-missing-folder",
     ["mutants", "--only", "tied", "--kind", "model", "--json", "no/such/m.json"], "", 2,
     ["--json", "'no/such'", "does not exist"]),
    ("reproduce-out-is-a-file", ["reproduce", "parameter-savings", "--out", "a_file"], "", 2,
     ["--out 'a_file'", "is a file"]),
    ("reproduce-out-under-a-file",
     ["reproduce", "parameter-savings", "--out", "a_file/figures"], "", 2,
     ["--out 'a_file/figures'", "is a file"]),
    # -- a shape beyond the machine (it tried to allocate 5.6 TiB, a traceback, exit 1)
    ("shape-of-a-billion-rows", ["check", "tied", "--shape", "1000000000,768,1024"], "", 2,
     ["--shape 1000000000,768,1024", "needs about", "TiB", "available"]),
    ("shape-not-the-torch-models", ["check", "nanogpt", "--shape", "100,8,16"], "", 2,
     ["--shape does not fit the model", "V=61 d=16 (the model's)", "got V=100 d=8 N=16"]),
    # -- ids the model has no row for (an IndexError inside torch, exit 1)
    ("torch-token-beyond-the-vocabulary",
     ["check", "nanogpt", "--case", "absent-tokens", "--tokens", TORCH_TOKENS[:-2] + "3000",
      "--targets", TORCH_TOKENS], "", 2,
     ["case absent-tokens", "token ids must be in [0, 61)", "tokens [3000]"]),
    ("torch-target-minus-100",
     ["check", "nanogpt", "--case", "absent-tokens", "--tokens", TORCH_TOKENS,
      f"--targets={TORCH_TOKENS[:-2]}-100"], "", 2,
     ["token ids must be in [0, 61)", "targets [-100]"]),
    # -- every missing extra names its pip install (a traceback, exit 1)
    ("no-torch-builtin", ["check", "nanogpt", "--case", "absent-tokens"], "torch", 2,
     ["--kind torch needs torch", "pip install 'tyingspec[torch]'"]),
    ("no-torch-user-model", ["check", "torch_model:make_model", "--kind", "torch"], "torch", 2,
     ["pip install 'tyingspec[torch]'"]),
    ("no-torch-linear-ce-torch-module", ["check", "ce-torch", "--case", "ce-plain"], "torch", 2,
     ["ce-torch", "pip install 'tyingspec[torch]'"]),
    ("no-transformers", ["check", "gpt2", "--case", "absent-tokens"], "transformers", 2,
     ["transformers", "pip install 'tyingspec[transformers]'"]),
    ("no-ml-dtypes", ["check", "tied", "--precision", "bfloat16", "--case", "absent-tokens"],
     "ml_dtypes", 2, ["--precision bfloat16 needs ml_dtypes", "pip install 'tyingspec[bfloat16]'"]),
    ("no-torch-mutants", ["mutants", "--kind", "torch"], "torch", 2,
     ["pip install 'tyingspec[torch]'"]),
    ("no-torch-mutants-of-every-kind", ["mutants"], "torch", 2,
     ["pip install 'tyingspec[torch]'", "--kind model and --kind kernel run without it"]),
    ("no-safetensors-ckpt", ["ckpt", "inspect", "m.safetensors"], "safetensors", 2,
     ["safetensors", "pip install 'tyingspec[torch]'"]),
]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("argv,block,code,words", [a[1:] for a in ATTACKS],
                         ids=[a[0] for a in ATTACKS])
def test_each_input_gets_its_exit_status_and_message(
        repo: Path, argv: list[str], block: str, code: int, words: list[str]) -> None:
    out = run(repo, argv, block)
    text = out.stdout + out.stderr
    assert out.returncode == code, text[-3000:]
    for w in words:
        assert w in text, (w, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    assert "verdict: correct" not in text and "OK: every mutant" not in text, text[-3000:]


def test_a_check_that_runs_no_case_writes_no_report_and_no_baseline(repo: Path) -> None:
    # it wrote {"verdict": "correct", "exit_code": 0, "cases": []}, and recorded a baseline
    out = run(repo, ["check", "nanogpt", "--kind", "torch", "--case", "v-equals-1",
                     "--json", "r.json", "--baseline", "b.json"])
    assert out.returncode == 2, out.stdout + out.stderr
    assert not (repo / "r.json").exists() and not (repo / "b.json").exists()


def test_outputs_are_refused_before_the_work(repo: Path) -> None:
    # the whole kill matrix ran and printed OK before the --json write failed
    out = run(repo, ["mutants", "--only", "tied", "--kind", "model", "--json", "no/m.json"])
    assert out.returncode == 2
    assert "mutation score" not in out.stdout and "mutants: 1/1" not in out.stderr
    out = run(repo, ["reproduce", "parameter-savings", "--out", "a_file"])
    assert out.returncode == 2 and "claim" not in out.stdout


def test_a_missing_reproduce_folder_is_still_made(repo: Path) -> None:
    # --out names a directory: a new one (and its parents) is made, as before
    out = run(repo, ["reproduce", "parameter-savings", "--out", "new/figures"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert (repo / "new" / "figures" / "parameter-savings.json").exists()


def test_a_padding_idx_beyond_some_cases_still_runs_the_others(repo: Path) -> None:
    # not a usage error: the cases with that row run (here each an adapter error: the
    # built-in takes no padding_idx), the others are named as left out
    out = run(repo, ["check", "tied", "--padding-idx", "20", "--json", "r.json"])
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--padding-idx 20: left out one-token-repeated" in out.stdout
    names = [c["name"] for c in json.loads((repo / "r.json").read_text())["cases"]]
    assert names == ["absent-tokens", "repeated-tokens"]


# --- the pytest plugin's replay -----------------------------------------------------------

def run_plugin(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(repo, ["-p", "no:cacheprovider", *args], module="pytest")


REPLAY = "--tyingspec-replay="
PLUGIN_ATTACKS: list[tuple[str, list[str], list[str]]] = [
    # a typo dropped the option: the broken kernel passed
    ("option-typo", ["--tyingspec-adapter=ce-scale-dropped", "--tyingspec-kind=linear-ce",
                     REPLAY + "ce_kernel_outputs V=37 d=6 N=4 seed=1 ce=logit_scal=0.0625"],
     ["unknown option 'logit_scal'", "logit_scale"]),
    ("option-word-typo", ["--tyingspec-adapter=ce-numpy", "--tyingspec-kind=linear-ce",
                          REPLAY + "ce_kernel_outputs V=37 d=6 N=4 seed=1 ce=target=sam"],
     ["target expects same", "'sam'"]),
    # an option the kernel does not declare was dropped from the case, silently
    ("option-the-kernel-does-not-declare",
     ["--tyingspec-adapter=adapters:ce_always_raises", "--tyingspec-kind=linear-ce",
      REPLAY + "ce_kernel_outputs V=37 d=6 N=4 seed=1 bias=False ce=logit_scale=0.0625"],
     ["does not declare", "logit_scale"]),
    # an IndexError in the adapter, reported as an adapter error: a failed test, exit 1
    ("token-beyond-v", ["--tyingspec-adapter=tied",
                        REPLAY + "sum_of_paths V=4 d=2 N=2 seed=1 tokens=1,9 targets=0,1"],
     ["token ids must be in [0, 4)", "tokens [9]"]),
    ("tokens-without-targets", ["--tyingspec-adapter=tied",
                                REPLAY + "sum_of_paths V=4 d=2 N=2 seed=1 tokens=1,2"],
     ["tokens and targets go together"]),
    ("torch-token-beyond-the-model",
     ["--tyingspec-adapter=nanogpt", "--tyingspec-kind=torch",
      REPLAY + f"torch_gradient_by_path V=61 d=16 N=16 seed=1 tokens={TORCH_TOKENS[:-2]}99 "
               f"targets={TORCH_TOKENS}"],
     ["token ids must be in [0, 61)", "the model's vocabulary"]),
    ("torch-target-minus-100",
     ["--tyingspec-adapter=nanogpt", "--tyingspec-kind=torch",
      REPLAY + f"torch_gradient_by_path V=61 d=16 N=16 seed=1 tokens={TORCH_TOKENS} "
               f"targets={TORCH_TOKENS[:-2]}-100"],
     ["token ids must be >= 0", "-100"]),
    ("vocabulary-beyond-the-machine",
     ["--tyingspec-adapter=tied", REPLAY + "sum_of_paths V=1000000000 d=768 N=4 seed=1"],
     ["needs about", "available"]),
]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("argv,words", [a[1:] for a in PLUGIN_ATTACKS],
                         ids=[a[0] for a in PLUGIN_ATTACKS])
def test_each_replay_is_a_usage_error(repo: Path, argv: list[str], words: list[str]) -> None:
    out = run_plugin(repo, *argv)
    text = out.stdout + out.stderr
    assert out.returncode == 4, text[-3000:]  # pytest's usage error
    for w in words:
        assert w in text, (w, text[-3000:])
    assert "Traceback" not in text and "passed" not in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.moved
def test_a_replay_as_printed_still_runs(repo: Path) -> None:
    # the validation refuses what cannot run, not what a failure prints
    out = run_plugin(repo, "--tyingspec-adapter=ce-scale-dropped", "--tyingspec-kind=linear-ce",
                     REPLAY + "ce_kernel_outputs V=37 d=6 N=4 seed=1 ce=logit_scale=0.0625")
    assert out.returncode == 1, out.stdout[-3000:]
    assert "logit_scale_dropped" in out.stdout


# --- in-process: the CLI boundary ---------------------------------------------------------

def test_a_blocked_torch_module_is_a_usage_error_in_process(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tyingspec._src.front.cli import main

    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["check", "nanogpt", "--kind", "torch"]) == 2
    assert "pip install 'tyingspec[torch]'" in capsys.readouterr().err


def test_a_module_not_found_below_is_mapped_to_its_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tyingspec._src.front import check as _check
    from tyingspec._src.front.cli import main

    def needs_matplotlib(*args: object, **kwargs: object) -> object:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(_check, "load", needs_matplotlib)
    assert main(["check", "tied", "--case", "absent-tokens"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed: pip install 'tyingspec[plot]'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyError("k"),
                                 ModuleNotFoundError("No module named 'tyingspec_x'",
                                                     name="tyingspec_x")],
                         ids=["runtime-error", "key-error", "an-unknown-missing-module"])
def test_an_internal_error_exits_2_with_the_message_then_the_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        exc: Exception) -> None:
    # it was exit 1, which says "a gradient is wrong"
    from tyingspec._src.front import check as _check
    from tyingspec._src.front.cli import main

    def bug(*args: object, **kwargs: object) -> object:
        raise exc

    monkeypatch.setattr(_check, "run_case", bug)
    assert main(["check", "tied", "--case", "absent-tokens"]) == 2
    err = capsys.readouterr().err
    head, _, rest = err.partition("Traceback (most recent call last):")
    assert "tyingspec: internal error, please report it" in head, err
    assert type(exc).__name__ in head and type(exc).__name__ in rest, err


def test_out_of_memory_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tyingspec._src.front import check as _check
    from tyingspec._src.front.cli import main

    def huge(*args: object, **kwargs: object) -> object:
        raise MemoryError("Unable to allocate 5.59 TiB")

    monkeypatch.setattr(_check, "run_case", huge)
    assert main(["check", "tied", "--case", "absent-tokens"]) == 2
    err = capsys.readouterr().err
    assert "out of memory" in err and "5.59 TiB" in err and "Traceback" not in err


# --- the helpers ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("MemTotal:       32000000 kB\nMemAvailable:   24157296 kB\n", 24157296 * 1024),
    ("MemAvailable: 1000 B\n", 1000),
])
def test_available_memory_reads_meminfo(tmp_path: Path, text: str, expected: int) -> None:
    from tyingspec._src.core.options import available_memory

    (tmp_path / "meminfo").write_text(text)
    assert available_memory(str(tmp_path / "meminfo")) == expected


def test_available_memory_falls_back_without_meminfo(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tyingspec._src.core import options as _options

    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 10,
                                                     "SC_PAGE_SIZE": 4096}[name])
    assert _options.available_memory(str(tmp_path / "none")) == 40960

    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", unknown)
    assert _options.available_memory(str(tmp_path / "none")) is None  # nothing refused


def test_an_unknown_memory_refuses_nothing_and_gpt2_size_fits_here() -> None:
    from tyingspec._src.core.cases import memory_problem, model_bytes

    assert memory_problem(10**9, 768, 1024, None) is None
    assert memory_problem(50257, 768, 1024, 8 << 30) is None  # about 3 GiB
    assert 2 << 30 < model_bytes(50257, 768, 1024) < 4 << 30


def test_every_kernel_option_is_a_known_replay_key() -> None:
    from tyingspec._src.kinds.linear_ce.kind import OPTION_NAMES
    from tyingspec._src.kinds.linear_ce.options import ce_problem

    words = {"reduction": "sum", "ce_weight": "drawn", "ignore_index": "-100"}
    for name in OPTION_NAMES:
        assert ce_problem(f"{name}={words.get(name, '0.5')}") is None, name


@pytest.mark.slow
@pytest.mark.moved
def test_shape_sets_a_torch_models_batch_times_sequence(repo: Path) -> None:
    # --shape was ignored by the torch kind: a lookup right only for the first 16 positions
    # passed even with --shape 48,16,256.  N is the model's batch x sequence now.
    out = run(repo, ["check", "nanogpt", "--kind", "torch", "--shape", "61,16,12",
                     "--case", "repeated-tokens"])
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    # two sequences of six positions: the model's batch is its own, the length the user's
    assert "V=61 d=16 N=12" in text and "B=2,T=6" in text, text[-3000:]
