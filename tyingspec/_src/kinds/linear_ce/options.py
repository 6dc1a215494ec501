"""A linear-ce case's options (its ``ce`` string, ``Case.ce``) checked as a replay or a
pytest case gives them: the keys tyingspec knows and the values each takes, and the target id
an ignored token carries.  The table entry (:mod:`kinds.linear_ce.spec`) hands these to the
front ends as ``KindSpec.options_problem`` and ``KindSpec.ignored_target``, so no front end
names the kind.
"""

from __future__ import annotations

from tyingspec._src.kinds.linear_ce.draws import IGNORE_INDEX, OPTION_NAMES

#: Keys of a linear-ce case's ``ce`` string that say how its batch is drawn (the kernel's
#: options are ``kinds.linear_ce.draws.OPTION_NAMES``), and the values each takes: a
#: number, or one of the words listed.
CE_BATCH_KEYS: dict[str, tuple[str, ...]] = {"ignored": (), "logits": (), "target": ("same",)}
#: The kernel options whose value is a word, not a number.
CE_WORDS: dict[str, tuple[str, ...]] = {"reduction": ("mean", "sum", "none"),
                                        "ce_weight": ("drawn",)}


def ce_problem(text: str) -> str | None:
    """Why a linear-ce ``ce`` string (a replay's ``ce=...``) is not one tyingspec can run: a
    part that is not ``key=value``, a key it does not know (``logit_scal=0.0625``, which would
    otherwise be dropped silently and the case run without the option), a key given twice,
    or a value of the wrong sort; None when it is usable."""
    known = [*OPTION_NAMES, *CE_BATCH_KEYS]
    seen: set[str] = set()
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            return f"ce: expected key=value parts separated by commas, got {part!r}"
        if key not in known:
            return f"ce: unknown option {key!r}; known: {', '.join(known)}"
        if key in seen:
            return f"ce: {key} given twice"
        seen.add(key)
        words = CE_WORDS.get(key, CE_BATCH_KEYS.get(key, ()))
        if key == "ignore_index":  # a class id, -100, or "vocab" (drawn from the vocabulary)
            if value != "vocab" and not value.lstrip("-").isdigit():
                return f"ce: ignore_index expects an integer or vocab, got {value!r}"
        elif words:
            if value not in words:
                return f"ce: {key} expects {' or '.join(words)}, got {value!r}"
        else:
            try:
                number = float(value)
            except ValueError:
                return f"ce: {key} expects a number, got {value!r}"
            if number != number or number in (float("inf"), float("-inf")):
                return f"ce: {key} expects a finite number, got {value!r}"
    return None


def ce_ignore_index(text: str) -> int:
    """The target id a ``ce`` string's batch may hold for an ignored token: its
    ``ignore_index`` when that is an integer, else -100 (Liger's and torch's default)."""
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key == "ignore_index" and value.lstrip("-").isdigit():
            return int(value)
    return IGNORE_INDEX
