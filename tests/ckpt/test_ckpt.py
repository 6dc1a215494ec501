"""tyingspec ckpt: inspect findings for each tie state, every conversion policy, bit-for-bit
copies, a round trip, the evaluation table, and exit 2 (never a traceback) on bad input."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model

from tyingspec._src.ckpt.read import load
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.torch.zoo import gpt2, nanogpt

EMB, HEAD = "transformer.wte.weight", "lm_head.weight"
FACTORY = "tyingspec._src.kinds.torch.zoo:nanogpt"


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    return abs(a - b) <= atol + rtol * abs(b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return nanogpt()


def _untied(noise: float) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    sd[HEAD] = sd[HEAD] + noise * torch.randn(sd[HEAD].shape, generator=gen)
    return sd


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _report(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, Any]:
    js = str(tmp_path / "report.json")
    code, _, _ = _run(capsys, "inspect", *argv, "--json", js)
    return code, json.loads(Path(js).read_text())["pairs"][0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    paths = {name: str(tmp_path / name) for name in (
        "tied.pt", "tied.safetensors", "equal.safetensors", "diff.safetensors", "nohead.pt",
        "narrow.safetensors", "bias.safetensors", "config_tied.json", "config_untied.json",
        "tok.npy")}
    model = _model()
    torch.save(model.state_dict(), paths["tied.pt"])
    save_model(model, paths["tied.safetensors"])
    save_file(_untied(0.0), paths["equal.safetensors"])
    save_file(_untied(0.01), paths["diff.safetensors"])
    sd = _untied(0.0)
    del sd[HEAD]
    torch.save(sd, paths["nohead.pt"])
    narrow = _untied(0.0)
    narrow[HEAD] = torch.zeros(61, 8)
    save_file(narrow, paths["narrow.safetensors"])
    biased = _untied(0.01)
    biased["lm_head.bias"] = torch.zeros(61)
    save_file(biased, paths["bias.safetensors"])
    Path(paths["config_tied.json"]).write_text(json.dumps({"tie_word_embeddings": True}))
    Path(paths["config_untied.json"]).write_text(json.dumps({"tie_word_embeddings": False}))
    np.save(paths["tok.npy"], np.random.default_rng(0).integers(0, 61, 161))
    return paths


@pytest.mark.slow
@pytest.mark.moved
def test_inspect_states(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                        files: dict[str, str]) -> None:
    code, p = _report(capsys, tmp_path, files["tied.pt"])
    assert (code, p["state"], p["tying_saves"]) == (0, "tied", None)
    # save_model kept the head's key: found, and the embedding named after the model's root
    code, p = _report(capsys, tmp_path, files["tied.safetensors"])
    assert (code, p["state"], p["embedding"], p["embedding_shape"]) == (0, "tied", EMB, None)
    assert any("key order" in n for n in p["notes"])
    code, p = _report(capsys, tmp_path, files["equal.safetensors"])
    assert (code, p["state"]) == (0, "equal")
    assert p["tying_saves"] == {"parameters": 61 * 16, "bytes": 61 * 16 * 4}
    code, p = _report(capsys, tmp_path, files["diff.safetensors"])
    assert (code, p["state"]) == (0, "different")
    e, h = _untied(0.0)[EMB].double(), _untied(0.01)[HEAD].double()
    d = p["difference"]
    assert _close(d["max_abs_diff"], float((e - h).abs().max()), atol=1e-9, rtol=1e-6)
    assert _close(d["rel_frobenius"], float((e - h).norm() / e.norm()), atol=1e-9, rtol=1e-6)
    cos = torch.nn.functional.cosine_similarity(e, h, dim=1)
    assert _close(d["row_cosine"]["min"], float(cos.min()), atol=1e-9, rtol=1e-6)
    assert 0.0 < d["row_cosine"]["min"] <= d["row_cosine"]["median"] < 1.0
    # a lone key reads as transformers reads it (tie_word_embeddings defaults to true), in a
    # torch file as in safetensors; the config tells a tie from a lost head
    code, p = _report(capsys, tmp_path, files["nohead.pt"])
    assert (code, p["state"]) == (0, "tied")
    assert any("no --config" in n for n in p["notes"])
    code, p = _report(capsys, tmp_path, files["nohead.pt"], "--config",
                      files["config_untied.json"])
    assert (code, p["state"]) == (1, "head-missing")
    code, p = _report(capsys, tmp_path, files["narrow.safetensors"])
    assert "projection, not a tie" in p["dimension_mismatch"] and p["tying_saves"] is None
    code, p = _report(capsys, tmp_path, files["bias.safetensors"])
    assert p["output_bias"] == {"key": "lm_head.bias", "shape": [61]}


def test_inspect_config_agreement(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  files: dict[str, str]) -> None:
    code, p = _report(capsys, tmp_path, files["diff.safetensors"], "--config",
                      files["config_tied.json"])
    assert (code, p["config_agrees"]) == (1, False)
    code, p = _report(capsys, tmp_path, files["diff.safetensors"], "--config",
                      files["config_untied.json"])
    assert (code, p["config_agrees"]) == (0, True)
    # a lone key under a config that says untied is a lost head, not a tie
    code, p = _report(capsys, tmp_path, files["tied.safetensors"], "--config",
                      files["config_untied.json"])
    assert (code, p["state"]) == (1, "embedding-missing")
    code, p = _report(capsys, tmp_path, files["tied.pt"], "--config", files["config_tied.json"])
    assert (code, p["config_agrees"]) == (0, True)


def test_transformers_sharded_and_single(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tied = gpt2()
    tied.save_pretrained(tmp_path / "tied")  # type: ignore[operator]
    # shard it as transformers does for large models: two files and an index naming them
    single = tmp_path / "tied" / "model.safetensors"
    whole = load_file(str(single))
    keys = sorted(whole)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: whole[k] for k in part}, str(tmp_path / "tied" / name), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    single.unlink()
    index = tmp_path / "tied" / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, p = _report(capsys, tmp_path, str(index), "--config",
                      str(tmp_path / "tied" / "config.json"))
    assert (code, p["state"], p["config_agrees"]) == (0, "tied", True)
    assert load(str(index)).tensors.keys() == {
        k for k in tied.state_dict() if k != HEAD}  # type: ignore[operator]
    config = GPT2Config(vocab_size=61, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "untied")
    code, p = _report(capsys, tmp_path, str(tmp_path / "untied" / "model.safetensors"),
                      "--config", str(tmp_path / "untied" / "config.json"))
    assert (code, p["state"], p["config_agrees"]) == (0, "different", True)
    # convert the sharded tied checkpoint to an untied single file
    out = str(tmp_path / "untied.safetensors")
    code, _, _ = _run(capsys, "convert", str(index), out, "--to", "untied")
    assert code == 0
    got = load_file(out)
    assert _same_bits(got[HEAD], got[EMB]) and got[HEAD].data_ptr() != got[EMB].data_ptr()


@pytest.mark.parametrize("policy", ["input", "output", "average"])
@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_convert_to_tied_policies(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  files: dict[str, str], policy: str, ext: str) -> None:
    out = str(tmp_path / f"out{ext}")
    code, _, _ = _run(capsys, "convert", files["bias.safetensors"], out, "--to", "tied",
                      "--policy", policy)
    assert code == 0
    src = load_file(files["bias.safetensors"])
    e, h = src[EMB], src[HEAD]
    got = load(out)
    matrix = got.tensors[EMB]
    if ext == ".safetensors":
        assert HEAD not in got.tensors
        with safe_open(out, framework="pt") as fh:
            meta = fh.metadata()
    else:
        assert got.tensors[HEAD].data_ptr() == matrix.data_ptr()
        meta = got.metadata
    assert meta["tyingspec.policy"] == policy and meta["tyingspec.tied"] == f"{EMB}={HEAD}"
    # the source by name and content: no absolute path of this machine ships with OUT
    assert meta["tyingspec.source"] == "bias.safetensors"
    assert meta["tyingspec.source_sha256"] == hashlib.sha256(
        Path(files["bias.safetensors"]).read_bytes()).hexdigest()
    assert not any(str(tmp_path) in v for v in meta.values())
    if policy == "input":
        assert _same_bits(matrix, e)
    elif policy == "output":
        assert _same_bits(matrix, h)
    else:
        torch.testing.assert_close(matrix, (e + h) / 2, atol=1e-7, rtol=1e-6)
    for key, t in src.items():  # every other tensor, the output bias too, bit for bit
        if key not in (EMB, HEAD):
            assert _same_bits(got.tensors[key], t), key
    report = main(["ckpt", "inspect", out])
    assert report == 0 and "state: tied" in capsys.readouterr().out


def test_refuse(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                files: dict[str, str]) -> None:
    out = tmp_path / "out.safetensors"
    code, _, err = _run(capsys, "convert", files["diff.safetensors"], str(out), "--to", "tied",
                        "--policy", "refuse")
    assert code == 1 and "refusing" in err and not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    code, _, _ = _run(capsys, "convert", files["diff.safetensors"], str(out), "--to", "tied",
                      "--policy", "refuse", "--tolerance", "1.0")
    assert code == 0 and _same_bits(load_file(str(out))[EMB],
                                    load_file(files["diff.safetensors"])[EMB])
    code, _, _ = _run(capsys, "convert", files["equal.safetensors"], str(out), "--to", "tied",
                      "--policy", "refuse")
    assert code == 0
    # NaNs in the same places of both matrices are no difference (a NaN elsewhere is: see
    # test_ckpt_attacks' refuse-nan-gap)
    sd = _untied(0.0)
    sd[EMB][1, 1] = sd[HEAD][1, 1] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"))
    code, _, err = _run(capsys, "convert", str(tmp_path / "nan.safetensors"), str(out), "--to",
                        "tied", "--policy", "refuse")
    assert code == 0, err


def test_round_trip_and_config(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                               files: dict[str, str]) -> None:
    tied, back = str(tmp_path / "tied.pt"), str(tmp_path / "back.safetensors")
    cfg_out = tmp_path / "cfg" / "config.json"
    cfg_out.parent.mkdir()
    code, _, _ = _run(capsys, "convert", files["diff.safetensors"], tied, "--to", "tied",
                      "--policy", "input", "--config", files["config_untied.json"],
                      "--config-out", str(cfg_out))
    assert code == 0 and json.loads(cfg_out.read_text())["tie_word_embeddings"] is True
    code, _, _ = _run(capsys, "convert", tied, back, "--to", "untied")
    assert code == 0
    src, got = load_file(files["diff.safetensors"]), load_file(back)
    assert got.keys() == src.keys()
    assert _same_bits(got[EMB], src[EMB]) and _same_bits(got[HEAD], src[EMB])
    for key in src.keys() - {EMB, HEAD}:
        assert _same_bits(got[key], src[key]), key
    code, p = _report(capsys, tmp_path, back)
    assert p["state"] == "equal"


@pytest.mark.slow
@pytest.mark.moved
def test_evaluate_table(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                        files: dict[str, str]) -> None:
    def table(name: str) -> dict[str, str]:
        code, out, _ = _run(capsys, "convert", files[name], str(tmp_path / "o.safetensors"),
                            "--to", "tied", "--policy", "input", "--evaluate", FACTORY,
                            "--tokens", files["tok.npy"])
        assert code == 0
        return {r.split()[0]: r.split()[1] for r in out.splitlines()[1:6]}

    rows = table("equal.safetensors")
    original = float(rows["original"])
    for policy in ("input", "output", "average", "refuse"):
        assert _close(float(rows[policy]), original, atol=0.0, rtol=0.0), policy
    rows = table("diff.safetensors")
    original = float(rows["original"])
    assert rows["refuse"] == "refused"
    for policy in ("input", "output", "average"):
        assert not _close(float(rows[policy]), original, atol=1e-5, rtol=0.0), policy
    # the original is the untied model: its loss is neither tied model's
    model = _model()
    sd = load_file(files["diff.safetensors"])
    model.load_state_dict(sd)  # one Parameter: the head (loaded last) wins
    assert _close(float(rows["output"]), _nll(model, files["tok.npy"]), atol=5e-6, rtol=0.0)


def _nll(model: torch.nn.Module, tokens: str) -> float:
    ids = torch.from_numpy(np.load(tokens)).long().unfold(0, 9, 8)
    model = model.double().eval()
    with torch.no_grad():
        logits, _ = model(ids[:, :-1])
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 61),
                                                   ids[:, 1:].reshape(-1)))


def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                           files: dict[str, str]) -> None:
    raw = Path(files["diff.safetensors"]).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[: len(raw) // 2])
    raw_pt = Path(files["tied.pt"]).read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw_pt[: len(raw_pt) // 2])
    (tmp_path / "junk.bin").write_bytes(b"\x00garbage" * 10)
    for name, header in (("utf8", b'{"a\xff": 1}'), ("deep", b'{"a":' * 50000 + b"1"
                                                       + b"}" * 50000)):
        (tmp_path / f"{name}.safetensors").write_bytes(len(header).to_bytes(8, "little")
                                                       + header)
    torch.save({"weights": _untied(0.0), "x": Path("p")}, tmp_path / "pickle.pt")
    cases: list[tuple[list[str], str]] = [
        (["inspect", str(tmp_path / "cut.safetensors")], "cut.safetensors"),
        (["inspect", str(tmp_path / "utf8.safetensors")], "invalid UTF-8"),
        (["inspect", str(tmp_path / "deep.safetensors")], "recursion limit"),
        (["inspect", str(tmp_path / "cut.pt")], "cut.pt"),
        (["inspect", str(tmp_path / "junk.bin")], "junk.bin"),
        (["inspect", str(tmp_path / "pickle.pt")], "weights_only=True"),
        # the reason, not torch's advice to load the untrusted file with weights_only=False
        (["inspect", str(tmp_path / "pickle.pt")], "Unsupported global: GLOBAL pathlib."),
        (["inspect", str(tmp_path / "absent.pt")], "no such file"),
        (["inspect", files["diff.safetensors"], "--embedding", "nope.weight"], "'nope.weight'"),
        (["convert", files["narrow.safetensors"], str(tmp_path / "o.pt"), "--to", "tied",
          "--policy", "input"], "[61, 8]"),
        (["convert", files["nohead.pt"], str(tmp_path / "o.pt"), "--to", "tied",
          "--policy", "input", "--config", files["config_untied.json"]], "'lm_head.weight'"),
        (["convert", files["diff.safetensors"], files["diff.safetensors"], "--to", "tied",
          "--policy", "input"], "same file"),
        (["convert", files["diff.safetensors"], str(tmp_path / "no" / "o.pt"), "--to", "tied",
          "--policy", "input"], "does not exist"),
        (["convert", files["diff.safetensors"], str(tmp_path), "--to", "tied", "--policy",
          "input"], "directory"),
        (["convert", files["diff.safetensors"], str(tmp_path / "o.txt"), "--to", "tied",
          "--policy", "input"], ".safetensors"),
        (["convert", files["diff.safetensors"], str(tmp_path / "o.pt"), "--to", "tied"],
         "--policy"),
    ]
    for argv, expected in cases:
        code, _, err = _run(capsys, *argv)
        assert code == 2 and expected in err, (argv, err)
        assert "set to `False`" not in err and "\x1b[" not in err, err
    assert Path(files["diff.safetensors"]).read_bytes() == raw
    assert not (tmp_path / "o.pt").exists()


def test_interrupted_write_leaves_out_whole(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            files: dict[str, str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous")

    def crash(*args: Any, **kwargs: Any) -> None:
        Path(args[1]).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    try:  # the command ends a Ctrl-C with one line and the shell's status 130
        code = main(["ckpt", "convert", files["diff.safetensors"], str(out), "--to", "tied",
                     "--policy", "input"])
    except KeyboardInterrupt:  # (or lets it through, as it did before it said so)
        code = 130
    assert code == 130
    assert out.read_bytes() == b"previous"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
