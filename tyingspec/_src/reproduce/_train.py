"""Training the probe model on small synthetic tasks with the library's own forward/backward.

Gradients come from the built-in implementations (``tied``, ``output-path-only``) and from
``untied_forward_backward``; this module only adds tasks, initialisation, an Adam optimiser and
exact (not sampled) evaluation against each task's true next-token distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tyingspec._src.kinds.probe.builtins import REGISTRY
from tyingspec._src.kinds.probe.implementations import untied_forward_backward
from tyingspec._src.reproduce._common import Progress, silent_progress

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]

#: Model kinds a run can train, and how their gradient is computed.
KINDS = ("tied", "output-path-only", "untied")


@dataclass(frozen=True)
class Task:
    """A next-token task given by its true conditional distribution ``P[i, j] = p(j | i)``."""

    name: str
    P: F64  # [V, V], rows sum to 1
    description: str

    @property
    def V(self) -> int:
        return int(self.P.shape[0])

    @property
    def entropy(self) -> float:
        """Mean over (uniformly drawn) inputs of H(next | input): the best achievable loss."""
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(self.P > 0, -self.P * np.log(self.P), 0.0)
        return float(terms.sum(axis=1).mean())

    def sample(self, rng: np.random.Generator, n: int) -> tuple[I64, I64]:
        """``n`` (token, next token) pairs, inputs uniform over the vocabulary."""
        tokens = rng.integers(0, self.V, size=n)
        cdf = np.cumsum(self.P[tokens], axis=1)
        u = rng.random(n)[:, None]
        targets = np.minimum((u > cdf).sum(axis=1), self.V - 1)
        return tokens.astype(np.int64), targets.astype(np.int64)


def markov_task(rng: np.random.Generator, V: int, successors: int) -> Task:
    """Each token has ``successors`` distinct next tokens, equally likely (a fixed random table)."""
    P = np.zeros((V, V))
    for i in range(V):
        P[i, rng.choice(V, size=successors, replace=False)] = 1.0 / successors
    return Task(f"markov-{successors}", P,
                f"next-token task from a fixed random table: each of V={V} tokens has "
                f"{successors} equally likely successors (entropy ln {successors})")


def derangement(rng: np.random.Generator, V: int) -> I64:
    """A uniformly drawn permutation with no fixed point (rejection sampling)."""
    while True:
        perm = rng.permutation(V)
        if not np.any(perm == np.arange(V)):
            return perm.astype(np.int64)


def successor_task(rng: np.random.Generator, V: int) -> tuple[Task, I64]:
    perm = derangement(rng, V)
    P = np.zeros((V, V))
    P[np.arange(V), perm] = 1.0
    return Task("successor", P, f"successor task t -> perm[t], perm a random derangement of "
                                f"V={V} tokens (no token is its own successor)"), perm


def cluster_task(V: int, groups: int, *, aligned: bool) -> Task:
    """Inputs fall in ``groups`` contiguous blocks; the next token is uniform in one output group.

    Input ``i`` belongs to block ``i // (V/groups)``.  In the aligned task output token ``j``
    belongs to the same partition (``j // (V/groups)``): a token predicts the tokens it is
    grouped with, so its meaning as input and as output agree.  In the misaligned task the
    output partition is ``j % groups``: as an output a token belongs with tokens unrelated to
    its input group.  Both tasks have the same entropy ln(V/groups), and they are the same task
    up to relabelling the outputs, so an untied model finds them equally hard.
    """
    if V % groups:
        raise ValueError(f"V={V} is not a multiple of groups={groups}")
    size = V // groups
    j = np.arange(V)
    out_group = j // size if aligned else j % groups
    P = np.zeros((V, V))
    for i in range(V):
        P[i, out_group == i // size] = 1.0 / size
    kind = "aligned" if aligned else "misaligned"
    rule = f"j//{size}" if aligned else f"j%{groups}"
    return Task(kind, P, f"{kind}: input i in block i//{size}; next token uniform over the "
                         f"{size} outputs j with {rule} = i//{size} (entropy ln {size})")


# --- model ---------------------------------------------------------------------------------

@dataclass
class Model:
    """Parameters of the probe model; ``U`` is None when tied (logits read E itself)."""

    E: F64
    W: F64
    U: F64 | None = None
    res: float = 1.0
    s_in: float = 1.0

    @property
    def out(self) -> F64:
        return self.E if self.U is None else self.U

    def n_params(self) -> int:
        return int(self.E.size + self.W.size + (0 if self.U is None else self.U.size))

    def logits(self, tokens: I64) -> F64:
        x = self.s_in * self.E[tokens]
        h = self.res * x + np.tanh(x @ self.W)
        z: F64 = h @ self.out.T
        return z

    def copy(self) -> Model:
        return Model(self.E.copy(), self.W.copy(), None if self.U is None else self.U.copy(),
                     self.res, self.s_in)


def init_model(rng: np.random.Generator, V: int, d: int, *, untied: bool, sigma: float,
               res: float = 1.0, s_in: float = 1.0) -> Model:
    """E (and U) ~ N(0, sigma^2); W ~ N(0, 1/d) so u = x @ W keeps the scale of x."""
    E = rng.normal(0.0, sigma, size=(V, d))
    W = rng.normal(0.0, 1.0 / np.sqrt(d), size=(d, d))
    U = rng.normal(0.0, sigma, size=(V, d)) if untied else None
    return Model(E, W, U, res, s_in)


def log_softmax(z: F64) -> F64:
    m = z.max(axis=1, keepdims=True)
    out: F64 = z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    return out


def expected_loss(model: Model, task: Task) -> float:
    """Exact cross-entropy against the task's true distribution, inputs uniform (no sampling)."""
    lp = log_softmax(model.logits(np.arange(task.V)))
    return float(-(task.P * lp).sum(axis=1).mean())


def current_token_rank(model: Model, V: int) -> F64:
    """Rank (1 = top logit) of the just-read token among all V logits, for every token."""
    tokens = np.arange(V)
    z = model.logits(tokens)
    own = z[tokens, tokens][:, None]
    # Ties count half so an all-equal row gives chance rank (V + 1) / 2.
    rank: F64 = 1.0 + (z > own).sum(axis=1) + 0.5 * ((z == own).sum(axis=1) - 1)
    return rank


def gradients(kind: str, model: Model, tokens: I64, targets: I64) -> tuple[float, dict[str, F64]]:
    if kind == "untied":
        assert model.U is not None
        out = untied_forward_backward(model.E, model.U, model.W, None, tokens, targets,
                                      res=model.res, s_in=model.s_in)
        return float(out["loss"]), {"E": out["dE"], "U": out["dU"], "W": out["dW"]}
    impl = REGISTRY[kind].model
    assert impl is not None and model.U is None
    res: Mapping[str, Any] = impl(model.E, model.W, None, tokens, targets, res=model.res,
                                  s_in=model.s_in)
    return float(res["loss"]), {"E": np.asarray(res["dE"]), "W": np.asarray(res["dW"])}


@dataclass
class Adam:
    """Plain Adam (Kingma & Ba) with bias correction, one state per named parameter."""

    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    t: int = 0
    m: dict[str, F64] = field(default_factory=dict)
    v: dict[str, F64] = field(default_factory=dict)

    def step(self, params: dict[str, F64], grads: dict[str, F64]) -> None:
        self.t += 1
        c1 = 1.0 - self.beta1 ** self.t
        c2 = 1.0 - self.beta2 ** self.t
        for name, g in grads.items():
            m = self.m.setdefault(name, np.zeros_like(g))
            v = self.v.setdefault(name, np.zeros_like(g))
            m *= self.beta1
            m += (1.0 - self.beta1) * g
            v *= self.beta2
            v += (1.0 - self.beta2) * g * g
            params[name] -= self.lr * (m / c1) / (np.sqrt(v / c2) + self.eps)

    def describe(self) -> str:
        return f"Adam(lr={self.lr:g}, betas=({self.beta1:g}, {self.beta2:g}), eps={self.eps:g})"


@dataclass(frozen=True)
class Recipe:
    """One training setup shared by the experiments, stated in their output."""

    steps: int = 600
    batch: int = 256
    lr: float = 1e-2

    def describe(self) -> str:
        return (f"Adam(lr={self.lr:g}, betas=(0.9, 0.999)), {self.steps} steps, batch "
                f"{self.batch} (token, next token) pairs drawn afresh each step, float64")


def train(
    kind: str,
    model: Model,
    task: Task,
    recipe: Recipe,
    rng: np.random.Generator,
    *,
    every: int = 1,
    probe: Callable[[Model], dict[str, float]] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place; record the exact expected loss every ``every`` steps."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {KINDS}")
    opt = Adam(lr=recipe.lr)
    params = {"E": model.E, "W": model.W} | ({} if model.U is None else {"U": model.U})
    bar = progress if progress is not None else silent_progress(kind, recipe.steps)
    steps: list[int] = []
    eval_loss: list[float] = []
    batch_loss: list[float] = []
    probes: dict[str, list[float]] = {}

    def record(step: int) -> None:
        steps.append(step)
        eval_loss.append(expected_loss(model, task))
        for key, val in (probe(model) if probe else {}).items():
            probes.setdefault(key, []).append(float(val))

    record(0)
    for step in range(1, recipe.steps + 1):
        tokens, targets = task.sample(rng, recipe.batch)
        loss, grads = gradients(kind, model, tokens, targets)
        batch_loss.append(loss)
        opt.step(params, grads)
        if step % every == 0 or step == recipe.steps:
            record(step)
        bar.advance()
    return {"steps": steps, "eval_loss": eval_loss, "batch_loss": batch_loss, "probes": probes}
