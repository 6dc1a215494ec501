"""The diagnosis catalogue: every label a verdict can carry, and the sentence a person reads.

Its own module, below both the diagnosis (which picks a label for rows) and the findings (named
checks that carry a label of their own), so that neither imports the other for it.
"""

from __future__ import annotations

from typing import Literal

Label = Literal["correct", "no_power", "forward_mismatch", "precision_limited",
                "input_path_missing", "output_path_missing", "output_path_overwritten",
                "duplicates_not_accumulated", "path_scaled", "tie_is_a_copy",
                "gradient_not_zeroed", "input_path_wrong", "output_path_wrong",
                "other_gradient_wrong", "inputs_mutated", "tie_lost", "optimizer_sees_tie_twice",
                "gradient_assigned", "gradient_disagrees_with_forward", "padding_row_masked",
                "padding_row_unmasked", "padding_idx_on_real_token", "loss_misnormalised",
                "logit_scale_dropped", "logit_scale_twice", "softcap_derivative_missing",
                "label_smoothing_misweighted", "z_loss_missing", "ignored_counted_in_mean",
                "ignored_not_zeroed", "grad_output_broadcast", "dE_wrong_dh_right",
                "dh_wrong_dE_right", "bias_gradient_wrong", "not_finite",
                "padded_lanes_in_lse", "option_ignored",
                "replica_not_synced", "replica_synced_early", "replica_partial_shards",
                "replicas_averaged", "replicas_diverge", "unknown"]

#: The named verdicts, in the order they are tried, with the sentence a person reads.
LABELS: dict[Label, str] = {
    "correct": "correct: both paths present and summed",
    "no_power": "no power: this example could not tell a dropped path from a correct gradient",
    "forward_mismatch": "forward mismatch: your loss differs from the probe model's; the "
                        "gradient cannot be judged against this reference",
    "precision_limited": "precision limited: every row is within the rounding bound of a lower "
                         "precision but beyond the bound of the precision it was judged at",
    "input_path_missing": "input path missing: rows of tokens in the batch lack the scatter-add "
                          "of dx; every other row is exactly right",
    "output_path_missing": "output path missing: every row lacks g.T @ h",
    "output_path_overwritten": "output path overwritten on present rows (`=` instead of `+=`): "
                               "rows of tokens in the batch hold the input path only",
    "duplicates_not_accumulated": "duplicates not accumulated: rows of repeated tokens got fewer "
                                  "than all of their occurrences",
    "path_scaled": "path scaled: a path enters with a stray factor",
    "tie_is_a_copy": "the tie is a copy: the two uses are two tensors that started equal, "
                     "each trained by its own path's gradient only",
    "gradient_not_zeroed": "gradient not zeroed: the second call returned the previous call's "
                           "gradient plus its own",
    "input_path_wrong": "input path wrong: rows of tokens absent from the batch are exactly "
                        "right, rows of tokens in the batch are wrong",
    "output_path_wrong": "output path wrong: rows of tokens absent from the batch, which carry "
                         "only the output path, are wrong (not by a constant factor)",
    "other_gradient_wrong": "dE is right but another output (loss, dW or db) is wrong",
    "inputs_mutated": "the gradients are right but the implementation wrote into its inputs",
    "tie_lost": "tie lost: the tied weights are one Parameter, but a transformation a model "
                "goes through (a load, a copy, a device move, a resize) leaves two",
    "optimizer_sees_tie_twice": "the optimizer sees the tie twice: the tied Parameter is in "
                                "its parameter groups twice, or one step moves it by two updates",
    "gradient_assigned": "gradient assigned, not accumulated (`.grad =` instead of `+=`): "
                         "micro-batches do not sum to the gradient of the whole batch",
    "gradient_disagrees_with_forward": "the backward disagrees with the forward: directional "
                                       "differences of the loss contradict these rows of dE",
    "padding_row_masked": "padding row masked on both paths: padding_idx keeps the input path "
                          "off row p, but the output path must still reach it",
    "padding_row_unmasked": "padding row unmasked: padding_idx declares row p free of the "
                            "input path, but the backward added it (the mask skipped on one "
                            "code path, pytorch #26302)",
    "padding_idx_on_real_token": "padding_idx on a real token: the lookup's padding_idx skips "
                                 "the input path of a token the batch uses as a real token, "
                                 "and nothing declares it padding, so that token's embedding "
                                 "never learns from its reads",
    "loss_misnormalised": "loss mis-normalised: the model's own loss is a count multiple of "
                          "the mean token cross-entropy (a sum divided by the number of "
                          "sequences, not of tokens), and its gradient is scaled with it",
    "logit_scale_dropped": "logit scale dropped from the backward: the gradients are 1/s times "
                           "the right ones (a 0.0625 scale: 16x too large)",
    "logit_scale_twice": "logit scale applied twice in the backward: the gradients are s times "
                         "the right ones",
    "softcap_derivative_missing": "softcap derivative missing: the backward skips the "
                                  "(1 - tanh^2) factor of the logit softcap",
    "label_smoothing_misweighted": "label smoothing mis-weighted: the target term's (1 - eps) "
                                   "weight is missing from the backward",
    "z_loss_missing": "z-loss missing from the gradient: the loss includes lam * lse^2, the "
                      "backward does not",
    "ignored_counted_in_mean": "ignored tokens counted in the mean: the denominator includes "
                               "tokens whose target is ignore_index",
    "ignored_not_zeroed": "ignored tokens' gradients not zeroed: tokens with target "
                          "ignore_index still send their softmax into dh and dE",
    "grad_output_broadcast": "grad_output broadcast from its first element: with "
                             "reduction='none' every token is scaled by grad_output[0]",
    "dE_wrong_dh_right": "the kernel's dE is wrong while its dh is right",
    "dh_wrong_dE_right": "the kernel's dh is wrong while its dE is right",
    "bias_gradient_wrong": "the bias gradient db is wrong while dh and dE are right",
    "not_finite": "not finite: the kernel returned inf or NaN where the reference is finite "
                  "(the report names the outputs and entries)",
    "padded_lanes_in_lse": "padded vocabulary lanes in the logsumexp: lanes past V in the "
                           "kernel's last block (masked with -inf, then softcapped to "
                           "-softcap, or loaded as 0) enter every token's logsumexp",
    "option_ignored": "option accepted and ignored: the kernel takes the option, but its loss "
                      "and gradients are the option-off ones",
    "replica_not_synced": "copies not synced: a rank's copy of the tied matrix holds only its "
                          "own stage's path (the first stage the input path, the last the "
                          "output path); the embedding group's all-reduce never summed them",
    "replica_synced_early": "copies synced too early: a copy lacks a contribution that another "
                            "rank's copy holds, computed after the sum was taken (a deferred "
                            "wgrad added after the all-reduce, Megatron-LM #1012)",
    "replica_partial_shards": "partial shards summed: one path of a copy is a single DP "
                              "replica's unreduced gradient; the DP reduce-scatter ran before "
                              "the embedding all-reduce, which added partial results "
                              "(Megatron-LM #844)",
    "replicas_averaged": "copies averaged, not summed: every copy holds the tied gradient "
                         "divided by k",
    "replicas_diverge": "copies diverge: the copies of the tied matrix are not equal at start, "
                        "or the optimizer steps them differently",
    "unknown": "wrong, unexplained by the catalogue: see the wrong rows",
}
