"""``tyingspec explain [LABEL]``: what a diagnosis label means, where to look in your code,
and a built-in that reaches it with the command that shows it.

:data:`TABLE` is the README's label table ("What to look at in your code"), one row a label of
``core.labels.LABELS`` and the ``n/a`` that is not one: ``tyingspec explain --markdown``
prints the table as the README holds it, and ``tests/front/test_explain.py`` keeps the two in step.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from tyingspec._src.core.labels import LABELS
from tyingspec._src.core.render import terminal_width, wrapped
from tyingspec._src.kinds.table import KINDS, every_builtin

EXIT_OK, EXIT_USAGE = 0, 2

#: label -> (what it means, what to look at in your code): the README's table, cell by cell.
TABLE: dict[str, tuple[str, str]] = {
    "correct": (
        "both paths present and summed",
        "nothing"),
    "no_power": (
        "the example could not have told a dropped path from a correct one (e.g. `E = 0`, V = 1),"
        " so it is not counted as a pass; wrong rows on such an example get `unknown`, never a "
        "path label",
        "nothing, when other cases are correct (the run still exits 0). A run in which no case "
        "had the power exits 77, neither a pass nor a wrong gradient: a model that computes in "
        "bfloat16 throughout cannot be judged, so check a float32 build (`--precision float32`, "
        "or its config's dtype set to float32)"),
    "precision_limited": (
        "within the bound of the next lower precision, beyond the judged one",
        "part of your arithmetic is in float32 (or lower) and the rest not: a float32 result "
        "summed or scaled in float64, or `--precision float64` declared for a float32 result. A "
        "result every value of which is a float32 is judged at float32 by itself (the report says"
        " `judged at float32 (every value it returned is a float32 ...)`); otherwise rerun with "
        "`--precision float32`, or return the dtype you compute in"),
    "forward_mismatch": (
        "the loss differs from the probe model's, so the gradient cannot be judged against it",
        "your forward: it must be the probe model's ([the "
        "contract](docs/derivations.md#the-probe-model-the-contract)), including `res`, `s_in`, "
        "the bias `b` and the mean over positions"),
    "input_path_missing": (
        "exactly the rows of tokens in the batch lack the scatter-add",
        "the lookup's backward: `dE = g.T @ h` only, a detached lookup, a hook that replaces the "
        "gradient instead of adding to it"),
    "output_path_missing": (
        "every row lacks `g.T @ h`",
        "the head's backward: `dE` taken from the embedding's backward only"),
    "output_path_overwritten": (
        "present rows hold the input path only (`=` instead of `+=`)",
        "the scatter: `dE[tokens] = dx` where `+=` is meant overwrites the head's gradient on "
        "those rows (TransformerEngine #3437)"),
    "duplicates_not_accumulated": (
        "only rows of repeated tokens are wrong, and each holds some, not all, of its occurrences"
        " (which survived is named)",
        "the scatter: numpy's buffered `dE[tokens] += dx`, `index_put_(accumulate=False)`, "
        "`index_copy_`; accumulate with `np.add.at`, `index_add_` or "
        "`index_put_(accumulate=True)`"),
    "path_scaled": (
        "one positive factor on one path (or both alike) puts every row within its bound (fitted "
        "and printed: ×0.5 averaged, doubled, ×0.0625, …; a path taken k times is allowed k times"
        " its rounding); a factor that is not a simple number needs three wrong entries or more, "
        "since on fewer any factor fits",
        "the factor printed: the two paths averaged instead of summed (×0.5), a backward hook "
        "registered twice (×2), a logit scale left out of the head's backward, a sum where the "
        "other path takes the mean (×N), `s_in` missing in the backward"),
    "tie_is_a_copy": (
        "right at E; after one SGD step the gradient is that of two tensors each stepped with its"
        " own path",
        "where the head is made: `U = E.copy()`, `nn.Parameter(weight.clone())`; tie by "
        "assignment (`lm_head.weight = wte.weight`) so there is one Parameter"),
    "gradient_not_zeroed": (
        "a call returned the previous call's dE plus its own",
        "a gradient buffer cached and accumulated into, never zeroed; a missing `zero_grad()`"),
    "input_path_wrong": (
        "rows of absent tokens are exact, present rows wrong in some other way (e.g. a masked "
        "padding row)",
        "the lookup's backward: a `padding_idx` left on where the vocabulary has no padding "
        "(`--padding-idx P` declares one), a wrong `dx`"),
    "output_path_wrong": (
        "rows of absent tokens, which carry only the output path, are wrong (e.g. `g.T @ x` "
        "instead of `g.T @ h`), and their errors are not what dx scattered into the wrong rows "
        "would add",
        "the head's gradient: built from the wrong activation, or a wrong `g`"),
    "other_gradient_wrong": (
        "dE is right, but the loss, dW or db is not",
        "the outputs beside `dE`: `db` of a sum next to a mean loss (×N), `dW`"),
    "inputs_mutated": (
        "the gradients are right but the implementation wrote into its inputs",
        "in-place operations on the arrays you are handed (sorting `tokens` in place); work on a "
        "copy"),
    "unknown": (
        "wrong in a way no label's pattern explains (e.g. dx scattered into the targets' rows: "
        "absent and present rows wrong, and the rows cannot tell which path); the wrong rows and "
        "what each path's evidence says are listed. A run is named by its examples' most frequent"
        " informative label, so `unknown` only when none had one",
        "the wrong rows listed: which are tokens of the batch, repeated, absent or targets; "
        "replay the smallest batch"),
    "tie_lost": (
        "one Parameter, but a transformation (a load, a copy, a device move, a resize) leaves two",
        "re-tie after `load_state_dict(assign=True)`, `to_empty()` or a resize (`tie_weights()`, "
        "or `TorchTarget(retie=...)`); the identity check that failed is named"),
    "optimizer_sees_tie_twice": (
        "the tied Parameter is in the optimizer's groups twice, or one step moves it by two "
        "updates",
        "how the optimizer's parameters are collected: both names of the tie listed, or the "
        "weight of both modules"),
    "gradient_assigned": (
        "`.grad =` instead of `+=`: micro-batches do not sum to the gradient of the whole batch",
        "a hook or custom step that assigns `.grad`; accumulate into it"),
    "gradient_disagrees_with_forward": (
        "directional differences of the loss contradict these rows of dE",
        "a custom `autograd.Function`'s backward, a detached read; the rows are named"),
    "padding_row_masked": (
        "`padding_idx` keeps the input path off row P, but the output path must still reach it",
        "the mask: apply it to the lookup's gradient only, not to the head's"),
    "padding_row_unmasked": (
        "the backward added the input path to a `padding_idx` row",
        "the lookup's mask, skipped on one code path (pytorch #26302)"),
    "padding_idx_on_real_token": (
        "the lookup's `padding_idx` skips a token the batch uses as a real token",
        "`padding_idx`: set it to the pad token your config names (`pad_token_id`), or remove it"),
    "loss_misnormalised": (
        "the model's loss is a count multiple of the mean token cross-entropy",
        "the loss's denominator: the number of tokens, not of sequences"),
    "logit_scale_dropped": (
        "the gradients are 1/s times the right ones",
        "the logit scale: applied in the forward, left out of the backward (unsloth-zoo PR #930)"),
    "logit_scale_twice": (
        "the gradients are s times the right ones",
        "the logit scale: applied to the logits' gradient and again after"),
    "softcap_derivative_missing": (
        "the backward skips the softcap's `(1 - tanh^2)` factor",
        "the softcap's backward"),
    "label_smoothing_misweighted": (
        "the target term's `(1 - eps)` weight is missing from the backward",
        "the label-smoothing backward"),
    "z_loss_missing": (
        "the loss includes `lam * lse^2`, the backward does not",
        "the z-loss's `2 lam lse` term in `dl/dlse`"),
    "ignored_counted_in_mean": (
        "the mean's denominator includes tokens whose target is `ignore_index`",
        "the denominator: the sum of the kept tokens' weights, not `target.numel()` (ROCm "
        "TransformerEngine PR #336)"),
    "ignored_not_zeroed": (
        "tokens with target `ignore_index` still send their softmax into dh and dE",
        "the mask: zero the whole row of an ignored token, not only its target term (Liger #968);"
        " an `ignore_index` hard-coded as -100; a low-precision branch that lets ignored tokens "
        "in"),
    "grad_output_broadcast": (
        "with `reduction='none'` every token is scaled by `grad_output[0]`",
        "scale each token by its own `grad_output[i]` (Liger PR #1298)"),
    "dE_wrong_dh_right": (
        "the kernel's dE is wrong while its dh is right",
        "the kernel's `dE` accumulation: a chunk or block lost or overwritten"),
    "dh_wrong_dE_right": (
        "the kernel's dh is wrong while its dE is right",
        "the kernel's `dh`: a chunk never written"),
    "bias_gradient_wrong": (
        "the bias gradient db is wrong while dh and dE are right",
        "`db`: the token weights and the ignored tokens"),
    "not_finite": (
        "the kernel returned inf or NaN where the reference is finite (the outputs and entries "
        "are named)",
        "the softmax: subtract the row maximum before `exp`"),
    "replica_not_synced": (
        "a rank's copy holds only its own stage's path: the first stage the input path, the last "
        "the output path",
        "the embedding group's all-reduce of the copies' `.grad` (Megatron's `_EMBEDDING_GROUP`):"
        " never called, or on the wrong group (piper #13)"),
    "replica_synced_early": (
        "a copy lacks a contribution another rank's copy holds, one computed after the sum was "
        "taken",
        "the order of the all-reduce and the head's deferred weight gradient (Megatron-LM #1012, "
        "#656): sync after the last backward"),
    "replica_partial_shards": (
        "one path of a copy is a single DP replica's unreduced gradient",
        "the DP reduce-scatter running before the PP embedding all-reduce under a distributed "
        "optimizer (Megatron-LM #844): all-reduce the copies first"),
    "replicas_averaged": (
        "every copy holds the tied gradient divided by k",
        "the all-reduce's op: `SUM`, not `AVG`, across the embedding group"),
    "replicas_diverge": (
        "the copies are not equal at start, or not after the optimizer step",
        "the last stage's initialisation (copy the first stage's E to it before training), "
        "per-stage optimizer settings or weight decay"),
    "padded_lanes_in_lse": (
        "the vocabulary lanes past V in the kernel's last block enter every token's logsumexp "
        "(the lanes are named)",
        "the mask of the padded lanes: a `-inf` that a softcap turns into `-softcap`, or lanes "
        "loaded as 0 (Liger up to 0.8.0, Unsloth before PR #10616): mask after the softcap"),
    "option_ignored": (
        "the kernel takes an option, but its loss and gradients are the option-off ones",
        "the option's path: a keyword accepted (`**kwargs`) and never read (Liger 0.2.0's "
        "`label_smoothing`)"),
    "n/a": (
        "not a label: a power or a check that does not apply to this case (`duplicates n/a`: the "
        "batch repeats no token)",
        "nothing; a torch identity check after `assign=True` loading or `to_empty()` is `n/a` "
        "when the model has no `tie_weights()` and no `TorchTarget(retie=...)` is given"),
}

#: A command that shows a label no built-in reaches by itself: (built-in, kind, flags).
_BY_HAND: dict[str, tuple[str, str, str]] = {
    "no_power": ("tied", "model", "--case v-equals-1"),  # V = 1: nothing to tell apart (exit 77)
}


#: A label no built-in reaches by itself and no flag shows: the lines of code that make it.
_SNIPPETS: dict[str, tuple[str, ...]] = {
    "precision_limited": (
        "dE_out = (g.T @ h).astype(np.float32)   # one path in float32 ...",
        "dE = dE_out.astype(np.float64) + dE_in  # ... returned as a float64 result"),
    "forward_mismatch": (
        "loss = ce(logits, targets).sum()  # the probe model takes the mean over positions",),
    "unknown": (
        "np.add.at(dE, targets, dx)  # dx scattered into the targets' rows, not the tokens'",),
    "gradient_disagrees_with_forward": (
        "class Lookup(torch.autograd.Function):  # a custom backward that drops rows",
        "    @staticmethod",
        "    def backward(ctx, g):",
        "        return None, g.new_zeros(ctx.V, g.shape[-1]).index_add_(0, ctx.tokens[1:], "
        "g[1:])"),
    "padding_row_unmasked": (
        "emb = nn.Embedding(V, d, padding_idx=P)  # with a backward of your own that forgets",
        "np.add.at(dE, tokens, dx)                # dx[tokens == P] = 0 before the scatter"),
    "padding_idx_on_real_token": (
        "emb = nn.Embedding(V, d, padding_idx=0)  # token 0 is a real token of the batch",),
    "padded_lanes_in_lse": (
        "x = tl.load(logits + offs, mask=offs < V, other=float('-inf'))",
        "x = softcap * tanh(x / softcap)  # the padded lanes' -inf becomes -softcap: mask after"),
    "option_ignored": (
        "def __init__(self, **kwargs):  # label_smoothing=0.1 accepted ...",
        "    self.reduction = kwargs.get('reduction', 'mean')  # ... and never read"),
    "loss_misnormalised": (
        "loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction='sum') / B",
        "# divided by the B sequences, not the B * T tokens"),
}


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", help="a diagnosis label, e.g. input_path_missing")
    p.add_argument("--markdown", action="store_true",
                   help="print the whole label table as the README holds it")


def markdown() -> str:
    """The README's label table, generated from :data:`TABLE`."""
    lines = ["| label | what it means | what to look at in your code |", "|---|---|---|"]
    lines += [f"| `{name}` | {meaning} | {where} |" for name, (meaning, where) in TABLE.items()]
    return "\n".join(lines)


def examples(label: str) -> list[tuple[str, str, str]]:
    """The built-ins that reach ``label``, each as (name, kind, flags): one per kind, in the
    table's order of kinds (the model kind first: its checks take milliseconds)."""
    found: dict[str, tuple[str, str, str]] = {}
    for impl in every_builtin().values():
        if impl.expected != label:
            continue
        kind = next((k for k in KINDS if impl.adapter(k) is not None), None)
        if kind is not None and kind not in found:
            found[kind] = (impl.name, kind, "")
    if label in _BY_HAND:
        found.setdefault(_BY_HAND[label][1], _BY_HAND[label])
    return sorted(found.values(), key=lambda e: list(KINDS).index(e[1]))


def command(name: str, kind: str, flags: str) -> str:
    return f"tyingspec check {name} --kind {kind}" + (f" {flags}" if flags else "")


#: Each label's sentence (``core.labels.LABELS``), by name.
SENTENCES: dict[str, str] = {str(k): v for k, v in LABELS.items()}


def explain(label: str, width: int | None = None) -> list[str]:
    """What ``explain LABEL`` prints (``label`` a row of :data:`TABLE`): its sentence, its
    row of the table, and the commands that show it (left whole, to be copied); wrapped to
    ``width`` (None: lines left whole)."""
    meaning, where = TABLE[label]
    text = [f"{label}: {SENTENCES.get(label, 'not a label')}",
            f"  what it means: {meaning}", f"  what to look at in your code: {where}"]
    shown = examples(label) if label in SENTENCES else []
    if shown:
        text.append("  to see it:")
        code = [command(*e) for e in shown]
    elif label in _SNIPPETS:
        text.append("  no built-in reaches it by itself; a minimal example:")
        code = list(_SNIPPETS[label])
    else:
        code = []
    return wrapped(text, width) + [f"    {line}" for line in code]


def listing(width: int | None = None) -> list[str]:
    """What ``explain`` with no label prints: every label and its sentence, in two columns
    wrapped to ``width`` (default: the terminal's, else 100)."""
    width = (terminal_width() or 100) if width is None else width
    pad = max(map(len, TABLE)) + 2
    lines = ["labels (tyingspec explain LABEL for one):"]
    for name in [*SENTENCES, *(n for n in TABLE if n not in SENTENCES)]:
        lines += textwrap.wrap(SENTENCES.get(name, TABLE.get(name, ("", ""))[0]), width=width,
                               initial_indent=f"  {name:<{pad}}",
                               subsequent_indent=" " * (pad + 2), break_on_hyphens=False)
    return lines


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        if args.label is not None:
            print("tyingspec: error: --markdown prints the whole table; it takes no LABEL",
                  file=sys.stderr)
            return EXIT_USAGE
        print(markdown())
        return EXIT_OK
    if args.label is None:
        print("\n".join(listing()))
        return EXIT_OK
    if args.label not in TABLE:
        known = ", ".join(TABLE)
        print(f"tyingspec: error: no label {args.label!r}; known: {known}", file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(explain(args.label, terminal_width())))
    return EXIT_OK
