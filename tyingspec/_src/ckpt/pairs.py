"""The tied pairs transformers declares, read from its installed model classes.

Every ``PreTrainedModel`` subclass names the parameters it ties in the class attribute
``_tied_weights_keys``: in transformers 5 a dict ``{tied key: source key}`` (Whisper's
``{"proj_out.weight": "model.decoder.embed_tokens.weight"}``, Mamba's ``{"lm_head.weight":
"backbone.embeddings.weight"}``, T5's three keys tied to ``shared.weight``); the class's
``config_class.model_type`` says which model it is.  A hand list of head and embedding names
misses most of them (a file with Whisper's or T5's names read ``state: tied`` over two
different matrices), so the pairs are read from the classes themselves:

- with a config naming its ``model_type``, from that model's classes (its ``architectures``
  first when they declare anything);
- without one, from the classes of every installed modeling module whose source names at
  least two of the file's keys (the modules are chosen by their text, so that a file with
  GPT-2's names imports GPT-2's module and not all five hundred; the pairs are then read
  from the imported classes, whatever their text says).

Without transformers (or where it cannot be imported) a small fallback list stands in; the
report says which was read.  Keys written as regular expressions (whole sub-models tied by
prefix) are left out: they tie no single embedding matrix.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["FALLBACK", "Declared", "declared_pairs", "from_classes"]


@dataclass(frozen=True)
class Declared:
    """The ties one model class declares: each ``(tied, source)``, ``tied`` loaded from (one
    tensor with) ``source``."""

    owner: str  # the class, e.g. "WhisperForConditionalGeneration"
    ties: tuple[tuple[str, str], ...]


#: (tied, source, class) when transformers is not installed: the families whose names no
#: embedding/head list holds (each read ``tied`` over two different matrices before)
FALLBACK: tuple[tuple[str, str, str], ...] = (
    ("proj_out.weight", "model.decoder.embed_tokens.weight", "WhisperForConditionalGeneration"),
    ("lm_head.weight", "backbone.embeddings.weight", "MambaForCausalLM"),
    ("lm_head.weight", "shared.weight", "T5ForConditionalGeneration"),
    ("encoder.embed_tokens.weight", "shared.weight", "T5ForConditionalGeneration"),
    ("decoder.embed_tokens.weight", "shared.weight", "T5ForConditionalGeneration"),
    ("lm_head.weight", "model.shared.weight", "BartForConditionalGeneration"),
)

_REGEX = re.compile(r"[\\^$*+?()\[\]{}|]")


def _literal(key: Any) -> str | None:
    """A declared key as a state-dict key; None for a regular expression (a prefix tie)."""
    if not isinstance(key, str):
        return None
    key = key.removeprefix("^").removesuffix("$")
    return None if not key or _REGEX.search(key) else key


def from_classes(classes: Iterable[type]) -> list[Declared]:
    """The ties each of ``classes`` declares in ``_tied_weights_keys`` (a class declaring
    none is left out)."""
    found: list[Declared] = []
    for cls in classes:
        keys = getattr(cls, "_tied_weights_keys", None)
        if not isinstance(keys, dict):  # transformers 4's list names no source: left out
            continue
        ties = tuple(dict.fromkeys(
            (t, s) for t, s in ((_literal(k), _literal(v)) for k, v in keys.items())
            if t is not None and s is not None and t != s))
        if ties and all(d.owner != cls.__name__ for d in found):
            found.append(Declared(cls.__name__, ties))
    return found


def _fallback() -> list[Declared]:
    owners = list(dict.fromkeys(c for _, _, c in FALLBACK))
    return [Declared(c, tuple((t, s) for t, s, o in FALLBACK if o == c)) for c in owners]


@lru_cache(maxsize=1)
def _sources() -> tuple[tuple[str, str], ...]:
    """(module name, source text) of every installed modeling module that declares ties."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found: list[tuple[str, str]] = []
    for folder in sorted(os.listdir(root)):
        path = os.path.join(root, folder)
        if not os.path.isdir(path):
            continue
        for name in sorted(os.listdir(path)):
            if not (name.startswith("modeling_") and name.endswith(".py")):
                continue
            try:
                with open(os.path.join(path, name), encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError):
                continue
            if "_tied_weights_keys" in text:
                found.append((f"transformers.models.{folder}.{name[:-3]}", text))
    return tuple(found)


def _model_classes(module_name: str) -> list[type]:
    """The ``PreTrainedModel`` subclasses ``module_name`` defines ([] when it cannot be
    imported: a model whose own optional dependency is missing declares nothing here)."""
    try:
        from transformers import PreTrainedModel

        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001  (an installed modeling module can fail in any way)
        return []
    return [v for v in vars(module).values() if isinstance(v, type)
            and issubclass(v, PreTrainedModel) and v.__module__ == module.__name__]


def _model_type(cls: type) -> str | None:
    return getattr(getattr(cls, "config_class", None), "model_type", None)


def _of_model_type(model_type: str, architectures: Collection[str]) -> list[type]:
    """The classes of ``model_type``: its ``architectures`` first, then the rest."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = f"transformers.models.{model_type_to_module_name(model_type)}"
    classes = [cls for module, _ in _sources() if module.startswith(folder + ".")
               for cls in _model_classes(module) if _model_type(cls) == model_type]
    return sorted(classes, key=lambda cls: cls.__name__ not in architectures)


def _naming(keys: Collection[str]) -> list[type]:
    """The classes of every modeling module whose source quotes at least two of ``keys``."""
    quoted = [(f'"{k}"', f"'{k}'") for k in keys]
    return [cls for module, text in _sources()
            if sum(1 for q in quoted if q[0] in text or q[1] in text) >= 2
            for cls in _model_classes(module)]


def declared_pairs(keys: Collection[str], config: dict[str, Any] | None = None
                   ) -> tuple[list[Declared], str, bool]:
    """The classes whose ties may hold between ``keys`` (a file's matrix keys, wrapper
    prefixes removed), where they were read from ("transformers 5.25.0", or the fallback
    list), and whether they are the config's model type's own: the classes of the config's
    model type when it names one transformers knows, else every class whose module names two
    of the keys."""
    try:
        import transformers
    except Exception:  # noqa: BLE001  (not installed, or broken: the fallback list stands in)
        return _fallback(), "tyingspec's fallback list (transformers is not installed)", False
    where = f"transformers {getattr(transformers, '__version__', '?')}"
    text = config.get("text_config") if config is not None else None
    model_type = None
    for place in (config, text):
        if isinstance(place, dict) and isinstance(place.get("model_type"), str):
            model_type = place["model_type"]
            break
    architectures = config.get("architectures") if config is not None else None
    if not isinstance(architectures, list):
        architectures = []
    if model_type is not None:
        try:
            found = from_classes(_of_model_type(model_type, [str(a) for a in architectures]))
        except Exception:  # noqa: BLE001  (a model type this transformers does not know)
            found = []
        if found:
            return found, where, True
    return from_classes(_naming(keys)), where, False
