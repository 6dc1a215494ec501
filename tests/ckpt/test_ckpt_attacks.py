"""tyingspec ckpt under attack: each input or command below once gave a wrong verdict, a
traceback, a destroyed file or a leftover temporary file.  Exit 0 is tied/ok, 1 only "a tie is
wrong", 2 bad input or usage, always one line naming the file or option and never a
traceback."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

from tyingspec._src.ckpt.read import load, same_storage
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.torch.zoo import nanogpt

EMB, HEAD = "transformer.wte.weight", "lm_head.weight"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def _pair(noise: float = 0.01, rows: int = 8, d: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(rows, d, generator=gen)
    return {EMB: e, HEAD: e + noise, "transformer.ln_f.weight": torch.ones(d)}


def _zip_with(name: str, content: bytes | None, tmp: Path) -> str:
    """A torch zip file whose member ``name`` is replaced by ``content`` (None: dropped)."""
    buf = io.BytesIO()
    torch.save(_pair(), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp / f"zip_{len(list(tmp.iterdir()))}.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for member in src.namelist():
            if member.endswith(name):
                if content is not None:
                    z.writestr(member, content)
            else:
                z.writestr(member, src.read(member))
    return str(path)


@pytest.fixture
def f(tmp_path: Path) -> dict[str, str]:
    paths: dict[str, str] = {}

    def put(name: str) -> str:
        paths[name] = str(tmp_path / name)
        return paths[name]

    save_file(_pair(), put("diff.safetensors"))
    torch.save(_pair(), put("diff.pt"))
    save_file({"a": torch.empty(0), "b": torch.empty(0, dtype=torch.float16)},
              put("empty.safetensors"))
    Path(put("cfg.json")).write_text(json.dumps({"tie_word_embeddings": True}))
    np.save(put("tok.npy"), np.random.default_rng(0).integers(0, 61, 161))
    np.save(put("tok_2x1.npy"), np.zeros((2, 1), dtype=np.int64))
    np.save(put("tok_big.npy"), np.array([1, 2, 500, 3]))
    np.save(put("tok_neg.npy"), np.array([1, -2, 3]))
    torch.manual_seed(0)
    model = nanogpt()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd[HEAD] = sd[HEAD] + 0.01
    save_file(sd, put("nano.safetensors"))
    nan = dict(sd)
    nan["transformer.ln_f.weight"] = torch.full_like(sd["transformer.ln_f.weight"], math_nan())
    save_file(nan, put("nano_nan.safetensors"))
    nan_head = _pair(0.0)
    nan_head[HEAD] = nan_head[HEAD].clone()
    nan_head[HEAD][0, 0] = math_nan()
    save_file(nan_head, put("nan_head.safetensors"))
    (tmp_path / "fac.py").write_text(textwrap.dedent("""
        import sys
        import torch
        from tyingspec._src.kinds.torch.zoo import nanogpt
        def boom(): raise ValueError("no weights here")
        def leave(): sys.exit(0)
        def leave3(): sys.exit(3)
        def ok():
            torch.manual_seed(0)
            return nanogpt()
        class Odd(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = nanogpt()
                self.transformer, self.lm_head = self.inner.transformer, self.inner.lm_head
            def forward(self, x):
                return "not logits"
        def odd(): return Odd()
        def crash_forward():
            m = nanogpt()
            m.forward = lambda x: 1 / 0
            return m
    """))
    (tmp_path / "facimport.py").write_text("raise SystemExit(0)\n")
    # corrupt torch files: each a real error of torch's reader or weights-only unpickler
    raw = Path(paths["diff.pt"]).read_bytes()
    Path(put("cut.pt")).write_bytes(raw[: len(raw) // 3])  # inline_container: no directory
    paths["stack.pt"] = _zip_with("data.pkl", b".", tmp_path)  # IndexError: pop from empty
    paths["memo.pt"] = _zip_with("data.pkl", b"\x80\x02h\x05.", tmp_path)  # KeyError: 5
    paths["utf8.pt"] = _zip_with("data.pkl", b"\x80\x02X\x02\x00\x00\x00\xff\xfe.", tmp_path)
    paths["nodata.pt"] = _zip_with("data/0", None, tmp_path)  # inline_container: no record
    selfref: dict[str, object] = {}
    selfref["model"] = selfref
    torch.save(selfref, put("selfref.pt"))
    deep: object = _pair()
    for _ in range(200):
        deep = {"model": deep}
    torch.save(deep, put("deep.pt"))
    torch.save({1: torch.ones(2, 2), EMB: torch.ones(2, 2)}, put("intkey.pt"))
    # corrupt configs and indexes
    Path(put("cfg_utf8.json")).write_bytes(b'{"tie_word_embeddings": "\xff"}')
    Path(put("cfg_deep.json")).write_text("[" * 100000 + "]" * 100000)
    Path(put("cfg_str.json")).write_text(json.dumps({"tie_word_embeddings": "false"}))
    Path(put("cfg_text.json")).write_text(json.dumps({"text_config": [1]}))
    Path(put("idx_utf8.index.json")).write_bytes(b'{"weight_map": {"\xff": "x"}}')
    Path(put("idx_deep.index.json")).write_text('{"a":' * 100000 + "1" + "}" * 100000)
    Path(put("idx_self.index.json")).write_text(json.dumps(
        {"weight_map": {EMB: "idx_self.index.json"}}))
    Path(put("idx_int.index.json")).write_text(json.dumps({"weight_map": {EMB: 5}}))
    Path(put("idx_dev.index.json")).write_text(json.dumps({"weight_map": {EMB: "/dev/zero"}}))
    os.symlink("loop_b.pt", put("loop_a.pt"))
    os.symlink("loop_a.pt", tmp_path / "loop_b.pt")
    return paths


def math_nan() -> float:
    return float("nan")


OUT = "{tmp}/out.safetensors"
# (id, argv with {name} for a fixture file and {tmp} for the directory, exit code, substrings)
ATTACKS: list[tuple[str, list[str], int, list[str]]] = [
    # 1: a key not in the file is a usage error that names the closest keys
    ("head-typo", ["inspect", "{diff.safetensors}", "--head", "lm_head.weigth"], 2,
     ["'lm_head.weigth'", "--head", "did you mean 'lm_head.weight'"]),
    ("embedding-typo", ["inspect", "{diff.safetensors}", "--embedding", "transformer.wte.weigth"],
     2, ["--embedding", "did you mean 'transformer.wte.weight'"]),
    ("head-typo-convert", ["convert", "{diff.safetensors}", OUT, "--to", "tied", "--policy",
                           "input", "--head", "lm_head.weigth"], 2, ["did you mean"]),
    # 2: one key is no pair; empty tensors are no matrices, whatever their dtypes
    ("same-key", ["inspect", "{diff.safetensors}", "--embedding", HEAD, "--head", HEAD], 2,
     ["both name 'lm_head.weight'"]),
    ("same-key-resolved", ["inspect", "{diff.safetensors}", "--embedding", HEAD], 2,
     ["one key 'lm_head.weight'"]),
    ("empty-dtypes", ["inspect", "{empty.safetensors}", "--embedding", "a", "--head", "b"], 2,
     ["empty.safetensors", "'a'", "shape [0]"]),
    # 3: a tolerance that is not a finite number >= 0
    ("tolerance-nan", ["convert", "{diff.safetensors}", OUT, "--to", "tied", "--policy",
                       "refuse", "--tolerance", "nan"], 2, ["--tolerance", "nan"]),
    ("tolerance-inf", ["convert", "{diff.safetensors}", OUT, "--to", "tied", "--policy",
                       "refuse", "--tolerance", "inf"], 2, ["--tolerance", "inf"]),
    ("tolerance-negative", ["convert", "{diff.safetensors}", OUT, "--to", "tied", "--policy",
                            "refuse", "--tolerance", "-1"], 2, ["--tolerance", "-1.0"]),
    ("tolerance-unread", ["convert", "{diff.safetensors}", OUT, "--to", "tied", "--policy",
                          "input", "--tolerance", "0.5"], 2, ["--policy input ignores it"]),
    # a NaN in one matrix only is a difference refuse must refuse (NaN > tol is False)
    ("refuse-nan-gap", ["convert", "{nan_head.safetensors}", OUT, "--to", "tied", "--policy",
                        "refuse", "--tolerance", "1"], 1, ["refusing", "nan"]),
    # 4: a policy chooses the tied matrix: untying takes none
    ("untied-average", ["convert", "{diff.safetensors}", OUT, "--to", "untied", "--policy",
                        "average"], 2, ["--policy average", "--to untied"]),
    ("untied-refuse", ["convert", "{diff.safetensors}", OUT, "--to", "untied", "--policy",
                       "refuse"], 2, ["--policy refuse", "--to untied"]),
    ("untied-tolerance", ["convert", "{diff.safetensors}", OUT, "--to", "untied",
                          "--tolerance", "0"], 2, ["--tolerance", "--to untied"]),
    # 5: the user's factory runs guarded; degenerate tokens and NaN losses are bad input
    ("factory-raises", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                        "input", "--evaluate", "fac:boom", "--tokens", "{tok.npy}"], 2,
     ["--evaluate fac:boom", "ValueError: no weights here"]),
    ("factory-exit-0", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                        "input", "--evaluate", "fac:leave", "--tokens", "{tok.npy}"], 2,
     ["--evaluate fac:leave", "sys.exit(0)"]),
    ("factory-exit-3", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                        "input", "--evaluate", "fac:leave3", "--tokens", "{tok.npy}"], 2,
     ["fac:leave3", "sys.exit(3)"]),
    ("import-exits", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                      "input", "--evaluate", "facimport:f", "--tokens", "{tok.npy}"], 2,
     ["--evaluate facimport:f", "importing it", "sys.exit(0)"]),
    ("forward-raises", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                        "input", "--evaluate", "fac:crash_forward", "--tokens", "{tok.npy}"],
     2, ["fac:crash_forward", "forward", "ZeroDivisionError"]),
    ("forward-not-logits", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                            "input", "--evaluate", "fac:odd", "--tokens", "{tok.npy}"], 2,
     ["fac:odd", "logits of shape", "got str"]),
    ("tokens-2x1", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy", "input",
                    "--evaluate", "fac:ok", "--tokens", "{tok_2x1.npy}"], 2,
     ["tok_2x1.npy", "2 ids per row", "[2, 1]"]),
    ("tokens-out-of-vocab", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                             "input", "--evaluate", "fac:ok", "--tokens", "{tok_big.npy}"], 2,
     ["token id 500", "0..60"]),
    ("tokens-negative", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                         "input", "--evaluate", "fac:ok", "--tokens", "{tok_neg.npy}"], 2,
     ["token id -2"]),
    ("loss-nan", ["convert", "{nano_nan.safetensors}", OUT, "--to", "tied", "--policy",
                  "input", "--evaluate", "fac:ok", "--tokens", "{tok.npy}"], 2,
     ["fac:ok", "original model's loss", "nan"]),
    # 8: an output naming an input
    ("config-out-is-input", ["convert", "{diff.safetensors}", OUT, "--to", "tied", "--policy",
                             "input", "--config", "{cfg.json}", "--config-out",
                             "{diff.safetensors}"], 2, ["--config-out", "same file", "input"]),
    ("config-out-is-tokens", ["convert", "{nano.safetensors}", OUT, "--to", "tied", "--policy",
                              "input", "--config", "{cfg.json}", "--config-out", "{tok.npy}",
                              "--evaluate", "fac:ok", "--tokens", "{tok.npy}"], 2,
     ["--config-out", "--tokens"]),
    ("json-is-config", ["inspect", "{diff.safetensors}", "--config", "{cfg.json}", "--json",
                        "{cfg.json}"], 2, ["--json", "same file as --config"]),
    ("json-is-input", ["inspect", "{diff.safetensors}", "--json", "{diff.safetensors}"], 2,
     ["--json", "same file as the input"]),
    ("config-out-without-config", ["convert", "{diff.safetensors}", OUT, "--to", "tied",
                                   "--policy", "input", "--config-out", "{tmp}/c.json"], 2,
     ["--config-out", "--config"]),
    # 11: truncated, corrupt, non-UTF-8, deeply nested, self-referencing inputs
    ("pt-truncated", ["inspect", "{cut.pt}"], 2, ["cut.pt", "not a readable torch file"]),
    ("pt-pickle-stack", ["inspect", "{stack.pt}"], 2, ["zip_", "IndexError"]),
    ("pt-pickle-memo", ["inspect", "{memo.pt}"], 2, ["zip_", "KeyError"]),
    ("pt-pickle-utf8", ["inspect", "{utf8.pt}"], 2, ["zip_", "UnicodeDecodeError"]),
    ("pt-missing-record", ["inspect", "{nodata.pt}"], 2, ["zip_", "data/0"]),
    ("pt-self-referencing", ["inspect", "{selfref.pt}"], 2, ["selfref.pt", "contains itself"]),
    ("pt-deep-wrappers", ["inspect", "{deep.pt}"], 2, ["deep.pt", "nested deeper"]),
    ("pt-int-key", ["inspect", "{intkey.pt}"], 2, ["intkey.pt", "string keys", "1"]),
    ("config-utf8", ["inspect", "{diff.safetensors}", "--config", "{cfg_utf8.json}"], 2,
     ["cfg_utf8.json", "UTF-8", "offset 25"]),
    ("config-deep", ["inspect", "{diff.safetensors}", "--config", "{cfg_deep.json}"], 2,
     ["cfg_deep.json", "nested deeper"]),
    ("config-string-bool", ["inspect", "{diff.safetensors}", "--config", "{cfg_str.json}"], 2,
     ["cfg_str.json", "true or false", '"false"']),
    ("config-text-list", ["inspect", "{diff.safetensors}", "--config", "{cfg_text.json}"], 2,
     ["cfg_text.json", "text_config"]),
    ("index-utf8", ["inspect", "{idx_utf8.index.json}"], 2, ["idx_utf8.index.json", "UTF-8"]),
    ("index-deep", ["inspect", "{idx_deep.index.json}"], 2, ["idx_deep", "nested deeper"]),
    ("index-self", ["inspect", "{idx_self.index.json}"], 2, ["idx_self.index.json", "itself"]),
    ("index-int-shard", ["inspect", "{idx_int.index.json}"], 2, ["idx_int", "maps to 5"]),
    ("index-device-shard", ["inspect", "{idx_dev.index.json}"], 2,
     ["/dev/zero", "regular file"]),
    ("symlink-loop", ["inspect", "{loop_a.pt}"], 2, ["loop_a.pt", "symbolic links"]),
]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize(("argv", "code", "expected"), [a[1:] for a in ATTACKS],
                         ids=[a[0] for a in ATTACKS])
def test_attack(capsys: pytest.CaptureFixture[str], tmp_path: Path, f: dict[str, str],
                monkeypatch: pytest.MonkeyPatch, argv: list[str], code: int,
                expected: list[str]) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {p: Path(p).read_bytes() for p in f.values() if os.path.isfile(p)}
    names = {"tmp": str(tmp_path), **f}
    args = [re.sub(r"\{([^}]+)\}", lambda m: names[m.group(1)], a) for a in argv]
    got, out, err = _run(capsys, *args)
    assert got == code, (args, out, err)
    line = err.strip()
    assert "\n" not in line, err  # one line for people, never a dump
    # nor a parser's message as a Python list, or torch's advice to file a bug
    assert not re.search(r": \[['\"]", line) and "internal miniz error" not in line, line
    for text in expected:
        assert text in line, (text, line)
    for p, data in before.items():  # no input is ever touched
        assert Path(p).read_bytes() == data, p
    if code:
        assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_same_storage_needs_elements_and_dtype() -> None:
    a, b = torch.empty(0), torch.empty(0, dtype=torch.float16)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # both 0
    assert not same_storage(a, b) and not same_storage(a, torch.empty(0))
    m = torch.ones(3, 2)
    assert same_storage(m, m) and not same_storage(m, m.view(torch.int32))


# --- 6: SIGTERM mid-write -------------------------------------------------------------------

SLOW_WRITE = """
import sys, time
import safetensors.torch as st
real = st.save_file
def slow(tensors, filename, metadata=None):
    real(tensors, filename, metadata=metadata)  # the whole temporary file is on disk now
    print("written", filename, flush=True)
    time.sleep(120)
st.save_file = slow
from tyingspec._src.front.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.moved
def test_sigterm_mid_convert_leaves_no_temporary_file(tmp_path: Path) -> None:
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(_pair(), str(src))
    out.write_bytes(b"previous")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, "ckpt", "convert", str(src),
                             str(out), "--to", "tied", "--policy", "input"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("written"), (line, proc.stderr.read() if proc.stderr else "")
        tmp = Path(line.split()[1])
        assert tmp.exists() and tmp.parent == tmp_path  # the test does catch it mid-write
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err
    assert "SIGTERM" in err and "Traceback" not in err
    assert not tmp.exists() and out.read_bytes() == b"previous"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# --- 7: the output's mode -------------------------------------------------------------------

@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_output_keeps_mode(capsys: pytest.CaptureFixture[str], tmp_path: Path, f: dict[str, str],
                           ext: str) -> None:
    out = tmp_path / f"out{ext}"
    out.write_bytes(b"previous")
    out.chmod(0o644)
    code, _, err = _run(capsys, "convert", f["diff.safetensors"], str(out), "--to", "tied",
                        "--policy", "input")
    assert code == 0, err
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    old = os.umask(0o027)
    try:
        new = tmp_path / f"new{ext}"
        code, _, err = _run(capsys, "convert", f["diff.safetensors"], str(new), "--to",
                            "untied")
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE(new.stat().st_mode) == 0o640  # 0666 under the umask 027


# --- 8: outputs that are inputs by another name ---------------------------------------------

def test_outputs_that_are_inputs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 f: dict[str, str]) -> None:
    os.link(f["diff.safetensors"], tmp_path / "hard.safetensors")
    os.symlink(f["cfg.json"], tmp_path / "cfg_link.json")
    shards = tmp_path / "sharded"
    shards.mkdir()
    sd = _pair()
    save_file({EMB: sd[EMB]}, str(shards / "a.safetensors"))
    save_file({HEAD: sd[HEAD]}, str(shards / "b.safetensors"))
    index = shards / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {EMB: "a.safetensors", HEAD: "b.safetensors"}}))
    before = {p: p.read_bytes() for p in (*shards.iterdir(), Path(f["diff.safetensors"]),
                                          Path(f["cfg.json"]))}
    cases: list[tuple[list[str], str]] = [
        (["inspect", f["diff.safetensors"], "--json", str(tmp_path / "hard.safetensors")],
         "the input"),
        (["inspect", str(index), "--json", str(shards / "b.safetensors")], "shard 2"),
        (["inspect", f["diff.safetensors"], "--config", f["cfg.json"], "--json",
          str(tmp_path / "cfg_link.json")], "--config"),
        (["convert", f["diff.safetensors"], str(tmp_path / "hard.safetensors"), "--to",
          "untied"], "the input"),
        (["convert", str(index), str(shards / "a.safetensors"), "--to", "untied"], "shard 1"),
        (["convert", str(index), str(tmp_path / "o.pt"), "--to", "untied", "--config",
          f["cfg.json"], "--config-out", str(shards / "b.safetensors")], "shard 2"),
        (["convert", f["diff.safetensors"], str(tmp_path / "o.pt"), "--to", "untied",
          "--config", f["cfg.json"], "--config-out", str(tmp_path / "cfg_link.json")],
         "--config"),
    ]
    for argv, name in cases:
        code, _, err = _run(capsys, *argv)
        assert code == 2 and "same file" in err and name in err, (argv, err)
    for p, data in before.items():
        assert p.read_bytes() == data, p
    assert not (tmp_path / "o.pt").exists()


# --- 9: streams -----------------------------------------------------------------------------

def _read_fifo(path: Path, into: list[bytes]) -> threading.Thread:
    def reader() -> None:
        with open(path, "rb") as fh:
            into.append(fh.read())
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    return thread


def test_json_to_a_pipe_is_a_stream(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    f: dict[str, str]) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    got: list[bytes] = []
    thread = _read_fifo(fifo, got)
    code, _, err = _run(capsys, "inspect", f["diff.safetensors"], "--json", str(fifo))
    thread.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the pipe, not a regular file
    assert json.loads(got[0])["pairs"][0]["state"] == "different"


@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_out_to_a_pipe_is_a_stream(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   f: dict[str, str], ext: str) -> None:
    fifo = tmp_path / f"out{ext}"
    os.mkfifo(fifo)
    got: list[bytes] = []
    thread = _read_fifo(fifo, got)
    code, _, err = _run(capsys, "convert", f["diff.safetensors"], str(fifo), "--to", "tied",
                        "--policy", "output")
    thread.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    copy = tmp_path / f"copy{ext}"
    copy.write_bytes(got[0])
    assert torch.equal(load(str(copy)).tensors[EMB], _pair()[HEAD])


@pytest.mark.slow
@pytest.mark.moved
def test_json_to_dev_stdout(tmp_path: Path, f: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "tyingspec", "ckpt", "inspect",
                           f["diff.safetensors"], "--json", "/dev/stdout"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"schema": "tyingspec.ckpt/1"' in proc.stdout
    assert os.path.islink("/dev/stdout")


@pytest.mark.slow
@pytest.mark.moved
def test_json_to_dev_stdout_redirected_to_a_file_keeps_the_report(
        tmp_path: Path, f: dict[str, str]) -> None:
    # `--json /dev/stdout > log`: /dev/stdout resolves to log itself, which the report once
    # replaced by rename (the printed report lost, log a new file)
    log = tmp_path / "log"
    with open(log, "w") as fh:
        inode = os.fstat(fh.fileno()).st_ino
        proc = subprocess.run([sys.executable, "-m", "tyingspec", "ckpt", "inspect",
                               f["diff.safetensors"], "--json", "/dev/stdout"],
                              stdout=fh, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = log.read_text()
    printed, _, report = text.partition("\n{\n")
    assert "state: different" in printed
    assert json.loads("{\n" + report)["pairs"][0]["state"] == "different"
    assert log.stat().st_ino == inode


# --- 10: a full disk ------------------------------------------------------------------------

def _full_device(tmp_path: Path) -> Path:
    """A device that answers every write with ENOSPC, as /dev/full does.  As root it is a node
    of its own in tmp_path, so that a regression replacing a device with a regular file (as
    the code once did) destroys only that node, never the machine's /dev/full; without root,
    a symlink to /dev/full, which nobody but root can replace."""
    node = tmp_path / "full"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        node.symlink_to("/dev/full")
    return node


def test_json_to_a_full_device(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                               f: dict[str, str]) -> None:
    full = _full_device(tmp_path)
    code, _, err = _run(capsys, "inspect", f["diff.safetensors"], "--json", str(full))
    assert code == 2 and f"--json {full}" in err and "No space left on device" in err, err
    assert err.strip().count("\n") == 0
    assert stat.S_ISCHR(os.stat(full).st_mode)


@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_out_to_a_full_device(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              f: dict[str, str], ext: str) -> None:
    out = tmp_path / f"full{ext}"
    out.symlink_to(_full_device(tmp_path))
    code, _, err = _run(capsys, "convert", f["diff.safetensors"], str(out), "--to", "untied")
    assert code == 2 and "No space left on device" in err and f"full{ext}" in err, err
    assert stat.S_ISCHR(os.stat(out).st_mode)


def _enospc_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)


def _enospc_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(obj: object, fh: io.BufferedWriter) -> None:
        fh.write(b"half")
        raise OSError(28, os.strerror(28))
    monkeypatch.setattr(torch, "save", full)


@pytest.mark.parametrize(("ext", "patch"), [(".safetensors", _enospc_safetensors),
                                            (".pt", _enospc_torch)])
def test_full_disk_keeps_the_old_output(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        f: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                        ext: str,
                                        patch: Callable[[pytest.MonkeyPatch], None]) -> None:
    out = tmp_path / f"out{ext}"
    out.write_bytes(b"previous")
    patch(monkeypatch)
    code, _, err = _run(capsys, "convert", f["diff.safetensors"], str(out), "--to", "tied",
                        "--policy", "input")
    assert code == 2 and "No space left on device" in err and f"out{ext}" in err, err
    assert "unchanged" in err and err.strip().count("\n") == 0
    assert out.read_bytes() == b"previous"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


FILE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is EFBIG, not a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from tyingspec._src.front.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_real_write_failure(tmp_path: Path, ext: str) -> None:
    # a real failed write (RLIMIT_FSIZE), as a full disk fails it, in each writer
    src, out = tmp_path / "in.safetensors", tmp_path / f"out{ext}"
    save_file(_pair(rows=64, d=32), str(src))
    out.write_bytes(b"previous")
    proc = subprocess.run([sys.executable, "-c", FILE_LIMIT, "ckpt", "convert", str(src),
                           str(out), "--to", "untied"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "File too large" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert out.read_bytes() == b"previous"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# --- 12: one verdict whatever the format; GGUF names; no absolute path ----------------------

def _lone_head(tmp_path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nanogpt()
    save_model(model, str(tmp_path / "tied.safetensors"))  # keeps one key of the tie
    return load_file(str(tmp_path / "tied.safetensors"))


@pytest.mark.parametrize("case", ["lone-head", "lone-embedding", "equal", "different"])
def test_same_tensors_same_verdict(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   case: str) -> None:
    if case == "lone-head":
        sd = _lone_head(tmp_path)
    elif case == "lone-embedding":
        sd = {k: v for k, v in _pair().items() if k != HEAD}
    else:
        sd = _pair(0.0 if case == "equal" else 0.01)
    save_file(sd, str(tmp_path / "x.safetensors"))
    torch.save(sd, tmp_path / "x.pt")
    verdicts = []
    for name in ("x.safetensors", "x.pt"):
        js = tmp_path / f"{name}.json"
        code, _, err = _run(capsys, "inspect", str(tmp_path / name), "--json", str(js))
        pair = json.loads(js.read_text())["pairs"][0]
        verdicts.append((code, pair["state"], pair["embedding"], pair["head"]))
    assert verdicts[0] == verdicts[1]
    assert verdicts[0][0] == 0


def test_gguf_names(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    e = _pair()[EMB]
    save_file({"token_embd.weight": e, "output.weight": e + 1, "output_norm.weight":
               torch.ones(4)}, str(tmp_path / "g.safetensors"))
    save_file({"token_embd.weight": e, "output_norm.weight": torch.ones(4)},
              str(tmp_path / "g_tied.safetensors"))
    js = tmp_path / "r.json"
    code, _, err = _run(capsys, "inspect", str(tmp_path / "g.safetensors"), "--json", str(js))
    pair = json.loads(js.read_text())["pairs"][0]
    assert (code, pair["embedding"], pair["head"], pair["state"]) == (
        0, "token_embd.weight", "output.weight", "different"), err
    code, _, err = _run(capsys, "inspect", str(tmp_path / "g_tied.safetensors"), "--json",
                        str(js))
    pair = json.loads(js.read_text())["pairs"][0]
    assert (code, pair["embedding"], pair["head"], pair["state"]) == (
        0, "token_embd.weight", "output.weight", "tied"), err


def test_lone_key_torch_and_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the lone key of a save_model file, re-saved with torch: convertible to untied without
    # flags, and a config saying untied still reports the lost key (exit 1)
    sd = _lone_head(tmp_path)
    torch.save(sd, tmp_path / "lone.pt")
    out = tmp_path / "untied.safetensors"
    code, _, err = _run(capsys, "convert", str(tmp_path / "lone.pt"), str(out), "--to", "untied")
    assert code == 0, err
    got = load_file(str(out))
    assert torch.equal(got[EMB], sd[HEAD]) and torch.equal(got[HEAD], sd[HEAD])
    (tmp_path / "untied.json").write_text(json.dumps({"tie_word_embeddings": False}))
    for name in ("lone.pt", "tied.safetensors"):
        code, out_text, _ = _run(capsys, "inspect", str(tmp_path / name), "--config",
                                 str(tmp_path / "untied.json"))
        assert code == 1 and "embedding-missing" in out_text, name
