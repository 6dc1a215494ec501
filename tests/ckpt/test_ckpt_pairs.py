"""tyingspec ckpt: which tensors are tied, read from the classes transformers installs.

Files of tiny random matrices under the names real models give them.  Whisper's, Mamba's and
T5's names once read ``state: tied`` (exit 0) over two different matrices, with or without a
config, and Mamba's and T5's printed "embedding None": no hand list knew them.  A file whose
names cannot be paired is exit 2 "cannot tell which tensors are tied", never ``tied``; a GGUF
file is named as such, not refused as a pickle.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tyingspec._src.ckpt.pairs import FALLBACK, declared_pairs
from tyingspec._src.front.cli import main

V, D = 11, 4

#: family -> (the file's matrix keys, source first; the tied pairs (embedding, head) inspect
#: must report, the embedding/head pair first; the config's model_type)
FAMILIES: dict[str, tuple[tuple[str, ...], list[tuple[str, str]], str]] = {
    "whisper": (("model.decoder.embed_tokens.weight", "proj_out.weight"),
                [("model.decoder.embed_tokens.weight", "proj_out.weight")], "whisper"),
    "mamba": (("backbone.embeddings.weight", "lm_head.weight"),
              [("backbone.embeddings.weight", "lm_head.weight")], "mamba"),
    "t5": (("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "lm_head.weight"),
           [("shared.weight", "lm_head.weight"), ("shared.weight", "encoder.embed_tokens.weight"),
            ("shared.weight", "decoder.embed_tokens.weight")], "t5"),
}
# a tensor beside them that is no part of any tie (a norm, a position table of its own shape)
OTHERS: dict[str, dict[str, tuple[int, ...]]] = {
    "whisper": {"model.decoder.embed_positions.weight": (7, D)},
    "mamba": {"backbone.norm_f.weight": (D,)},
    "t5": {"encoder.final_layer_norm.weight": (D,)}}


def _random(seed: int, shape: tuple[int, ...] = (V, D)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _file(tmp_path: Path, family: str, equal: bool) -> str:
    keys, _, _ = FAMILIES[family]
    first = _random(0)
    tensors = {k: first.clone() if equal else _random(i) for i, k in enumerate(keys)}
    tensors.update({k: _random(100, shape) for k, shape in OTHERS[family].items()})
    path = tmp_path / f"{family}.safetensors"
    save_file(tensors, str(path))
    return str(path)


def _config(tmp_path: Path, **fields: Any) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


def _inspect(capsys: pytest.CaptureFixture[str], tmp_path: Path,
             *argv: str) -> tuple[int, list[dict[str, Any]], str]:
    """``tyingspec ckpt inspect ARGV``: exit status, the report's pairs, the text printed."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    code = main(["ckpt", "inspect", *argv, "--json", str(report)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    pairs = json.loads(report.read_text())["pairs"] if report.exists() else []
    return code, pairs, out + err


# --- the three families that read "tied" -------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_different_matrices_under_known_names_are_not_tied(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, family: str) -> None:
    path = _file(tmp_path, family, equal=False)
    _, expected, model_type = FAMILIES[family]
    # no config: two different matrices, each pair reported, the file consistent as untied
    code, pairs, text = _inspect(capsys, tmp_path, path)
    assert code == 0, text
    assert [(p["embedding"], p["head"]) for p in pairs] == expected, text
    assert {p["state"] for p in pairs} == {"different"}, text
    assert "None" not in text and "state: tied" not in text
    # a config that ties them (transformers' default) disagrees with the file: exit 1
    code, pairs, text = _inspect(capsys, tmp_path, path, "--config",
                                 _config(tmp_path, model_type=model_type))
    assert code == 1, text
    assert [(p["embedding"], p["head"]) for p in pairs] == expected, text
    assert all(p["state"] == "different" and p["config_agrees"] is False for p in pairs)
    assert "DISAGREES" in text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_equal_matrices_under_known_names_agree_with_a_tying_config(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, family: str) -> None:
    path = _file(tmp_path, family, equal=True)
    _, expected, model_type = FAMILIES[family]
    code, pairs, text = _inspect(capsys, tmp_path, path, "--config",
                                 _config(tmp_path, model_type=model_type,
                                         tie_word_embeddings=True))
    assert code == 0, text
    assert [(p["embedding"], p["head"], p["state"]) for p in pairs] == \
        [(e, h, "equal") for e, h in expected], text
    assert all(p["config_agrees"] is True for p in pairs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_tensor_under_every_name_is_tied(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path, family: str) -> None:
    # a torch file saved from a tied model: every name is one storage
    keys, expected, _ = FAMILIES[family]
    shared = _random(0)
    path = tmp_path / f"{family}.pt"
    torch.save({k: shared for k in keys}, path)
    code, pairs, text = _inspect(capsys, tmp_path, str(path))
    assert code == 0, text
    assert [(p["embedding"], p["head"], p["state"]) for p in pairs] == \
        [(e, h, "tied") for e, h in expected], text


def test_a_tied_save_under_the_configs_model_type_names_the_dropped_key(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # save_pretrained keeps the source of a tie: Whisper's head is proj_out, not lm_head
    path = tmp_path / "tied.safetensors"
    save_file({"model.decoder.embed_tokens.weight": _random(0)}, str(path))
    code, pairs, text = _inspect(capsys, tmp_path, str(path), "--config",
                                 _config(tmp_path, model_type="whisper"))
    assert code == 0, text
    assert [(p["embedding"], p["head"], p["state"]) for p in pairs] == [
        ("model.decoder.embed_tokens.weight", "proj_out.weight", "tied")], text


# --- names that cannot be paired -----------------------------------------------------------------

@pytest.mark.parametrize("keys", [("foo.weight", "bar.weight"),
                                  ("lm_head.weight", "my_table.weight"),
                                  ("transformer.wte.weight", "my_projection.weight")],
                         ids=["no-known-name", "head-and-a-lookalike", "embedding-and-a-lookalike"])
def test_names_that_cannot_be_paired_exit_2(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path, keys: tuple[str, str]) -> None:
    path = tmp_path / "m.safetensors"
    save_file({keys[0]: _random(0), keys[1]: _random(1)}, str(path))
    for extra in ([], ["--config", _config(tmp_path, tie_word_embeddings=True)]):
        code, pairs, text = _inspect(capsys, tmp_path, str(path), *extra)
        assert code == 2, text
        assert "cannot tell which tensors are tied" in text
        assert pairs == [] and "state: tied" not in text


def test_given_keys_still_pair_names_no_model_knows(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"foo.weight": _random(0), "bar.weight": _random(1)}, str(path))
    code, pairs, text = _inspect(capsys, tmp_path, str(path), "--embedding", "foo.weight",
                                 "--head", "bar.weight")
    assert code == 0 and pairs[0]["state"] == "different", text


# --- what is read: the installed classes ------------------------------------------------------

def test_the_pairs_are_read_from_the_installed_classes(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tie that only the installed class says exists: the class's ``_tied_weights_keys``
    changed in memory pairs names no source file, fallback list or name list holds."""
    import transformers

    cls = transformers.WhisperForConditionalGeneration
    path = tmp_path / "m.safetensors"
    save_file({"my_table.weight": _random(0), "my_head.weight": _random(1)}, str(path))
    config = _config(tmp_path, model_type="whisper")
    code, _, text = _inspect(capsys, tmp_path, str(path), "--config", config)
    assert code == 2 and "cannot tell which tensors are tied" in text
    monkeypatch.setattr(cls, "_tied_weights_keys", {"my_head.weight": "my_table.weight"})
    code, pairs, text = _inspect(capsys, tmp_path, str(path), "--config", config)
    assert code == 1, text
    assert [(p["embedding"], p["head"], p["state"]) for p in pairs] == [
        ("my_table.weight", "my_head.weight", "different")]
    assert f"declared by WhisperForConditionalGeneration in transformers " \
           f"{transformers.__version__}" in text


@pytest.mark.parametrize(("cls_name", "model_type"), [
    ("WhisperForConditionalGeneration", "whisper"), ("MambaForCausalLM", "mamba"),
    ("T5ForConditionalGeneration", "t5"), ("ElectraForMaskedLM", "electra"),
    ("RwkvForCausalLM", "rwkv")])
def test_every_tie_a_class_declares_is_known(cls_name: str, model_type: str) -> None:
    import transformers

    declared = getattr(transformers, cls_name)._tied_weights_keys
    classes, where, own = declared_pairs(set(declared) | set(declared.values()),
                                         {"model_type": model_type})
    assert own and where == f"transformers {transformers.__version__}"
    assert declared and set(declared.items()) == {c.owner: set(c.ties)
                                                  for c in classes}[cls_name]
    # without a config, from the modules that name the keys: the same ties
    classes, _, own = declared_pairs(set(declared) | set(declared.values()))
    assert not own
    assert set(declared.items()) <= {t for c in classes for t in c.ties}


def test_a_family_outside_any_list_is_paired_without_a_config(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # RWKV ties head.weight to rwkv.embeddings.weight: in no name list and no fallback
    assert not {("head.weight", "rwkv.embeddings.weight")} & {(t, s) for t, s, _ in FALLBACK}
    path = tmp_path / "rwkv.safetensors"
    save_file({"rwkv.embeddings.weight": _random(0), "head.weight": _random(1)}, str(path))
    code, pairs, text = _inspect(capsys, tmp_path, str(path))
    assert code == 0, text
    assert [(p["embedding"], p["head"], p["state"]) for p in pairs] == [
        ("rwkv.embeddings.weight", "head.weight", "different")], text
    assert "RwkvForCausalLM" in text


def test_without_transformers_the_fallback_list_stands_in(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    path = _file(tmp_path, "whisper", equal=False)
    code, pairs, text = _inspect(capsys, tmp_path, path)
    assert code == 0 and pairs[0]["state"] == "different", text
    assert "fallback list (transformers is not installed)" in text
    # a family outside the fallback: names that cannot be paired, not a tie
    rwkv = tmp_path / "rwkv.safetensors"
    save_file({"rwkv.embeddings.weight": _random(0), "head.weight": _random(1)}, str(rwkv))
    code, _, text = _inspect(capsys, tmp_path, str(rwkv))
    assert code == 2 and "cannot tell which tensors are tied" in text


# --- GGUF ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.gguf", "model.bin"])
def test_a_gguf_file_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              name: str) -> None:
    path = tmp_path / name
    # GGUF's header: magic, version 3, tensor count, metadata count
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    code, _, text = _inspect(capsys, tmp_path, str(path))
    assert code == 2
    assert "GGUF" in text and "llama.cpp" in text
    assert "pickle" not in text and "weights_only" not in text
