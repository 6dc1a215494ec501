"""Seeded batches: a case is its shape, composition and seed; values are built from the seed.

Values are never drawn element by element: a case carries V, d, N, settings and one integer
seed, and ``build`` makes every array from ``np.random.default_rng(seed)``, so a printed case
replays exactly.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from tyingspec._src.core import memory
from tyingspec._src.core.options import byte_text
from tyingspec._src.core.paths import (
    Array,
    IntArray,
    LowRank,
    Paths,
    closed_form_paths,
    draw_directions,
    input_path,
    kernel_terms,
    two_paths,
)
from tyingspec._src.core.threads import on_cores, on_row_blocks
from tyingspec._src.core.tolerance import numpy_dtype

#: How the tokens of a batch are composed.  ``random``: uniform; ``distinct``: no repeats;
#: ``repeats``: ``distinct`` tokens, each present, some repeated; ``one-token``: one token N times;
#: ``with-zero``: uniform with token 0 present; ``multiplicity``: ``distinct`` tokens each seen
#: exactly ``multiplicity`` times, plus N % multiplicity singletons; ``sparse``: like ``repeats``
#: (``distinct`` tokens, all present) but without a forced repeat, for batches that leave most of
#: the vocabulary absent; ``crowded``: uniform, meant for N > V; ``no-zero``: uniform over 1..V-1.
COMPOSITIONS = ("random", "distinct", "repeats", "one-token", "with-zero", "multiplicity",
                "sparse", "crowded", "no-zero")
#: Compositions a kind gives a case at its own shape, never drawn by the strategies (see
#: ``kinds.torch.setting.at_model_shape``); a replay line may name them.  ``mixed``:
#: ``distinct`` tokens all present, a quarter of them exactly once, the others the rest.
SHAPED_COMPOSITIONS = ("mixed",)


@dataclass(frozen=True)
class Case:
    """One batch: shapes, settings, how tokens are composed, and the seed for every value."""

    name: str
    V: int
    d: int
    N: int
    seed: int
    composition: str = "random"
    res: float = 1.0
    s_in: float = 1.0
    bias: bool = True
    distinct: int | None = None  # for "repeats": how many distinct tokens
    dtype: str = "float64"
    tokens: tuple[int, ...] | None = None  # explicit batch (a replayed, shrunk one)
    targets: tuple[int, ...] | None = None
    multiplicity: int | None = None  # for "multiplicity": copies of each repeated token
    # E is drawn as N(0, 1) * e_scale (from DRAW_SPLIT_ABOVE entries up, uniform with that
    # spread); 0 makes every path vanish (vacuous)
    e_scale: float = 1.0
    # False for a target that brings its own model (torch): only the tokens and targets are
    # the case's; the probe model's res, s_in, bias and E do not apply
    probe: bool = True
    # nn.Embedding(padding_idx=p) semantics: the input path never reaches row p (the output
    # path still does); None: no padding row
    padding_idx: int | None = None
    # a linear-ce case's options, "key=value,..." (see kinds.linear_ce.draws): the kernel's
    # options plus how the batch exposes them (ignored=fraction, logits=magnitude), drawn by
    # the kind's ``KindSpec.draws`` (core never reads them)
    ce: str = ""
    # the user's --shape: a target with a shape of its own (a torch model) keeps this N (its
    # batch x sequence) and must have this V and d
    given_shape: bool = False
    # a target-built model's training configuration for this case, "key=value,..." (the torch
    # kind's sequences, padding, loss path, micro-batches, steps, autocast, compile: see
    # kinds.torch.setting); only the kind that reads it gives it meaning
    setting: str = ""

    def describe(self) -> str:
        if not self.probe:
            text = f"V={self.V} d={self.d} N={self.N} seed={self.seed}"
            return text + (f" {self.setting}" if self.setting else "")
        text = self._describe()
        if self.padding_idx is not None:
            text += f" padding_idx={self.padding_idx}"
        return text + (f" {self.ce}" if self.ce else "")

    def _describe(self) -> str:
        b = "with b" if self.bias else "no b"
        scale = "" if self.e_scale == 1.0 else f" e_scale={self.e_scale:g}"
        rank = e_rank(self)
        low = "" if rank is None else f" E of rank {rank} + one entry a row"
        return (f"V={self.V} d={self.d} N={self.N} res={self.res:g} s_in={self.s_in:g} {b} "
                f"{self.dtype}{scale}{low} seed={self.seed}")

    def with_setting(self, key: str, value: str) -> Case:
        """This case with ``key=value`` in its setting (a command-line flag such as
        ``--autocast``, set for every case of a kind that takes it)."""
        parts = [p for p in self.setting.split(",") if p and p.partition("=")[0] != key]
        return replace(self, setting=",".join([*parts, f"{key}={value}"]))

    def setting_value(self, key: str) -> str | None:
        """The value ``key`` has in this case's setting, or None."""
        return next((p.partition("=")[2] for p in self.setting.split(",")
                     if p.partition("=")[0] == key), None)

    def with_batch(self, tokens: IntArray, targets: IntArray) -> Case:
        return replace(self, N=int(tokens.shape[0]), tokens=tuple(int(t) for t in tokens),
                       targets=tuple(int(t) for t in targets))


@dataclass(frozen=True)
class Batch:
    E: Array
    W: Array
    b: Array | None
    tokens: IntArray
    targets: IntArray
    res: float
    s_in: float
    padding_idx: int | None = None
    ce: str = ""  # a linear-ce case's options (see Case.ce)
    setting: str = ""  # a target-built model's configuration (see Case.setting)
    ce_weight: Array | None = None  # drawn class weights, when the case asks for them
    grad_output: Array | None = None  # drawn [N] upstream gradient for reduction="none"
    # the kind's inputs, kept when E was let go (see :func:`released`); None: built from E
    inputs: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    # E's integer factors, when it was drawn through them (see :func:`e_rank`)
    low_rank: LowRank | None = field(default=None, compare=False, repr=False)

    def e_factors(self) -> LowRank | None:
        """The factors of this batch's E, if it was drawn low-rank and is still that array (a
        stepped, released or replaced E is not)."""
        f = self.low_rank
        return f if f is not None and f.factors(self.E) else None


def _tokens(case: Case, rng: np.random.Generator) -> IntArray:
    V, N = case.V, case.N
    if case.composition == "distinct":
        if N > V:
            raise ValueError(f"case {case.name!r}: {N} distinct tokens need V >= N, got V={V}")
        return rng.choice(V, size=N, replace=False)
    if case.composition == "one-token":
        return np.full(N, rng.integers(V))
    if case.composition == "repeats":
        k = min(case.distinct or max(1, N // 2), V, N)
        pool = rng.choice(V, size=k, replace=False)
        # Every pool token appears (exactly k distinct), the rest repeat them.
        t = np.concatenate([pool, rng.choice(pool, size=N - k)])
        if N > 1 and k == N:  # no room for a repeat otherwise
            t[-1] = t[0]
        return rng.permutation(t)
    if case.composition == "multiplicity":
        m = max(2, case.multiplicity or 2)
        k, r = N // m, N % m
        if k + r > V:
            raise ValueError(f"case {case.name!r}: {k} tokens x{m} plus {r} singletons need "
                             f"V >= {k + r}, got V={V}")
        pool = rng.choice(V, size=k + r, replace=False)
        return rng.permutation(np.concatenate([np.repeat(pool[:k], m), pool[k:]]))
    if case.composition == "sparse":
        k = min(case.distinct or max(1, V // 8), V, N)
        pool = rng.choice(V, size=k, replace=False)
        return rng.permutation(np.concatenate([pool, rng.choice(pool, size=N - k)]))
    if case.composition == "mixed":
        # ``distinct`` tokens, all present: a quarter of them exactly once, the others the rest
        k = min(case.distinct or max(1, V // 2), V, N)
        pool = rng.choice(V, size=k, replace=False)
        more = pool[k // 4:]
        return rng.permutation(np.concatenate([pool, rng.choice(more, size=N - k)]))
    if case.composition == "no-zero":
        if V < 2:
            raise ValueError(f"case {case.name!r}: tokens without 0 need V >= 2, got V={V}")
        return rng.integers(1, V, size=N)
    t = rng.integers(V, size=N)
    if case.composition == "with-zero":
        t[rng.integers(N)] = 0
    return t


#: An E of at least this many entries is drawn in blocks of rows, each from its own child of
#: the case's generator (``Generator.spawn``), on every core (``core.threads.on_cores``), and
#: uniform, not normal, with the same spread (see :func:`_drawn_in_blocks`).  numpy's draws run
#: without the GIL, and at GPT-2 size a normal one on one thread took 0.33-0.40 s, a large part
#: of a warm case.  The blocks are fixed by the shape alone (:data:`DRAW_BLOCK` entries), so the
#: values do not depend on the machine; below this size E is drawn as it always was, so every
#: small case replays the batch its seed printed before.
DRAW_SPLIT_ABOVE = 1 << 22
#: Entries per block of :func:`_drawn_in_blocks` (16 MB in float32): few enough blocks that
#: spawning costs nothing, enough that two cores share them evenly.
DRAW_BLOCK = 1 << 22
#: The rank of E's low-rank part at production shapes.  A probe case in float32 or float64 with
#: at least ``LOW_RANK_ABOVE`` entries of E and at least ``LOW_RANK_FROM`` rows and columns
#: draws E as ``scale * (A @ B + S)``: ``A [V, r]`` and ``B [r, d]`` of integers, and ``S``
#: one integer a row, at column ``v % d`` (see :func:`_drawn_low_rank`), so E is of full rank
#: while the reference computes its two V d N products, the logits ``h @ E.T`` and
#: ``dh = g @ E``, through the factors (``core.paths.LowRank``), about (r + 1) / d of the
#: multiply-adds (1/23 at GPT-2's width, 1/124 at Llama-3's; S costs N V, not N V d).  The
#: implementation gets E as a plain [V, d] matrix and does all of its own work.
#:
#: Why S: ``A @ B`` alone (E of rank 32, until issue 50) left every direction outside B's 32
#: unreached, and what such an E cannot tell apart it passes.  A head that truncates E to rank
#: 64 (SVD-softmax style) computed exact logits from it; an adapter that took E's rank knew it
#: was being checked; a kernel that sketched ``h`` at rank 64 lost only the tanh's curvature,
#: about 1e-4 of h, since ``x = E[tokens]`` spanned 32 directions (a few rows at a few times
#: their float32 bound).  With S every row reaches a direction of its own: E's rank is
#: ``min(V, d)``, and the rows a batch reads span 32 + (the distinct ``t % d`` of its tokens)
#: directions (about 600 of GPT-2's 768 for 1024 uniform tokens), ``h`` as many: no rank-k
#: shortcut below that is exact on it (``tests/core/test_full_rank_E.py``).
E_RANK = 32
#: The share of E's variance S carries (the rest is the low-rank part's): enough that what a
#: shortcut leaves out of S's directions is far beyond any rounding bound (a quarter of a
#: row's spread), while the low-rank part keeps most of the logits' size.
SPIKE_SHARE = 0.25
#: Entries of E from which it is drawn through its factors (with ``LOW_RANK_FROM``).
LOW_RANK_ABOVE = DRAW_SPLIT_ABOVE
#: Rows and columns from which E is drawn through its factors: the factored products then cost
#: at most an eighth of the dense ones (in float32; a quarter counting float64's speed).
LOW_RANK_FROM = 8 * E_RANK
#: Largest magnitude of a factor's entry: every partial sum of ``A @ B`` is at most
#: ``E_RANK * 255**2`` (about 2**21) in magnitude, an integer float32 holds exactly, so E is
#: the same matrix however a product sums it.
_FACTOR_MAX = 255
#: What an entry of ``A @ B + S`` may reach: float32 holds every integer up to 2**24.
_EXACT_MAX = 2**24 - 1


def _drawn_in_blocks(rng: np.random.Generator, shape: tuple[int, int], dt: np.dtype[Any],
                     scale: float) -> Array:
    """``U(-sqrt(3), sqrt(3)) * scale`` of ``shape`` in ``dt``, block by block (see
    ``DRAW_SPLIT_ABOVE``): the spread of ``N(0, 1) * scale``, which is all a check asks of E
    (every logit and gradient entry is a sum over d or N products of it, whatever their law),
    at a fifth of the cost: a uniform float32 draw took 0.09 s at GPT-2 size on one thread, a
    normal one 0.40 s (the 2-core Xeon VM of 2026-12-04).  A dtype without a draw of its own
    (bfloat16, float16) is drawn in float32 a block at a time and cast: never a float64
    [V, d] beside it (4.2 GB at Llama-3's head)."""
    V, d = shape
    rows = max(1, DRAW_BLOCK // max(d, 1))
    blocks = [slice(s, min(s + rows, V)) for s in range(0, V, rows)]
    out = memory.empty(shape, dt)
    own = dt if dt in (np.float32, np.float64) else np.dtype(np.float32)
    half, width = own.type(0.5), own.type(2 * math.sqrt(3) * scale)

    def fill(child: np.random.Generator, b: slice) -> None:
        block = out[b] if own == dt else np.empty((b.stop - b.start, d), dtype=own)
        child.random(dtype=own, out=block)  # [0, 1)
        block -= half  # exact: a float of [0, 1) minus one half
        block *= width
        if own != dt:
            out[b] = block.astype(dt)

    on_cores(lambda piece: fill(*piece), list(zip(rng.spawn(len(blocks)), blocks)))
    return out


def e_rank(case: Case) -> int | None:
    """The rank of the low-rank part of the E a case draws (``E_RANK`` at production shapes,
    where E is that part plus one entry a row, of full rank: see :func:`_drawn_low_rank`),
    None for a dense E.  It depends on the shape, dtype and scale alone, never on N, so a
    shrunk case keeps its E."""
    dt = numpy_dtype(case.dtype)  # type: ignore[arg-type]
    if (case.probe and dt in (np.float32, np.float64) and case.V * case.d >= LOW_RANK_ABOVE
            and min(case.V, case.d) >= LOW_RANK_FROM
            and math.isfinite(case.e_scale) and case.e_scale > 0):
        return E_RANK
    return None


def _drawn_low_rank(rng: np.random.Generator, shape: tuple[int, int], dt: np.dtype[Any],
                    scale: float, rank: int) -> tuple[Array, LowRank]:
    """E of ``shape`` in ``dt``, ``s * (A @ B + S)`` with ``A [V, rank]`` and ``B [rank, d]``
    uniform integers, ``S`` one uniform integer a row (at column ``v % d``) and ``s`` a power of
    two, so that E's spread is ``scale`` (as a dense draw's), within a percent: B's entries in
    [-255, 255], A's range, S's range and ``s`` chosen for it, S carrying ``SPIKE_SHARE`` of
    the variance.  Every entry of ``A @ B + S`` is an integer below 2**24, exact in float32, so
    E is the same on any BLAS and any number of cores.  Each part is drawn from its own child
    of the case's generator, so W, b, the tokens and the targets are the ones a dense E's case
    draws (and A and B the ones a rank-32 E of an earlier version drew)."""
    V, d = shape
    a_gen, b_gen, s_gen = rng.spawn(3)
    b = _FACTOR_MAX

    def spread(m: int) -> float:  # the standard deviation of a uniform integer in [-m, m]
        return math.sqrt(m * (m + 1) / 3)

    def fit(target: float) -> int:  # the m whose spread(m) is closest to target
        return round((math.sqrt(1 + 12 * target ** 2) - 1) / 2)

    low = scale * math.sqrt(1 - SPIKE_SHARE)  # the low-rank part's spread
    want = low / (math.sqrt(rank) * spread(b))  # s times A's spread
    s = 2.0 ** math.ceil(math.log2(want / spread(b)))  # so that A's spread is at most B's
    a = max(1, min(b, fit(want / s)))
    # S's entries, one a row, spread over d entries: their spread is sqrt(share d) scale
    k = max(1, min(_EXACT_MAX - rank * a * b, fit(scale * math.sqrt(SPIKE_SHARE * d) / s)))
    A = a_gen.integers(-a, a + 1, size=(V, rank)).astype(np.float64)
    B = b_gen.integers(-b, b + 1, size=(rank, d)).astype(np.float64)
    spikes = s_gen.integers(-k, k + 1, size=V).astype(np.float64)
    E = memory.empty((V, d), dt)
    np.matmul(A.astype(dt), B.astype(dt), out=E)
    rows = np.arange(V)
    E[rows, rows % d] += spikes.astype(dt)  # exact: integers below 2**24
    E *= dt.type(s)
    return E, LowRank(A, B, s, weakref.ref(E), spikes)


class KindLike(Protocol):
    """What the cases read of a kind: ``core.kind.KindSpec`` has it (named here, not imported:
    that module imports this one)."""

    @property
    def name(self) -> str: ...
    @property
    def draws(self) -> Callable[[Batch, Case], Batch] | None: ...
    @property
    def e_scale_at(self) -> Callable[[Case, int], float | None] | None: ...
    @property
    def length_cases(self) -> tuple[str, ...]: ...
    @property
    def peak_bytes(self) -> Callable[[int, int, int, str], int]: ...


def build(case: Case, kind: KindLike | None = None) -> Batch:
    """Every array of a case, from its seed (weights at a scale where both paths matter), with
    what ``kind`` draws from the case's options (``KindSpec.draws``: a linear-ce case's ignored
    targets, class weights, upstream gradient).  A case with options needs the kind that
    draws them (``tyingspec.build`` finds it): without, its batch would silently lack them."""
    draws = None if kind is None else kind.draws
    if case.ce and draws is None:
        raise ValueError(f"case {case.name!r} has kind options ({case.ce}): build it with "
                         "the kind that draws them (tyingspec.build(case) finds it)")
    rng = np.random.default_rng(case.seed)
    dt = numpy_dtype(case.dtype)  # type: ignore[arg-type]
    rank, low_rank = e_rank(case), None
    if rank is not None:
        E, low_rank = _drawn_low_rank(rng, (case.V, case.d), dt, case.e_scale, rank)
    elif case.V * case.d >= DRAW_SPLIT_ABOVE:
        E = _drawn_in_blocks(rng, (case.V, case.d), dt, case.e_scale)
    elif dt == np.float32:
        # drawn in float32 directly: at V*d = 38M this is a second, not a tenth of one
        E = rng.standard_normal(dtype=np.float32, out=memory.empty((case.V, case.d), np.float32))
        E *= np.float32(case.e_scale)
    else:
        E = (rng.normal(size=(case.V, case.d)) * case.e_scale).astype(dt)
    W = (rng.normal(size=(case.d, case.d)) / np.sqrt(case.d)).astype(dt)
    b = rng.normal(size=case.V).astype(dt) if case.bias else None
    if case.tokens is not None and case.targets is not None:
        tokens = np.asarray(case.tokens, dtype=np.int64)
        targets = np.asarray(case.targets, dtype=np.int64)
    else:
        tokens = _tokens(case, rng).astype(np.int64)
        targets = rng.integers(case.V, size=case.N).astype(np.int64)
    batch = Batch(E, W, b, tokens, targets, case.res, case.s_in, case.padding_idx,
                  low_rank=low_rank, setting=case.setting)
    return batch if draws is None else draws(batch, case)


#: A batch whose E is at least this many bytes lets it go once a kind's inputs no longer need
#: it (see :func:`released`); below it E is cheap and kept (properties rebuild inputs from it).
RELEASE_ABOVE = 64 << 20


def released(batch: Batch, inputs: Mapping[str, Any]) -> Batch:
    """``batch`` without its E, carrying ``inputs`` instead: for a kind whose inputs were made
    from E and do not hold it (a kernel's are a probe forward over E, and the kernel never
    reads E).  At Llama-3's head E is 2.1 GB in float32, as large as the dE the kernel returns;
    kept, it is the largest array a check holds that the implementation's own backward does
    not.  Its place is taken by a read-only [V, d] array of NaN that owns no memory (one
    entry, strides 0): whatever reads it by mistake computes NaN, never a plausible value.
    Below ``RELEASE_ABOVE`` bytes the batch is returned as it is."""
    E = batch.E
    if E.nbytes < RELEASE_ABOVE:
        return batch
    nan = np.full((), np.nan, dtype=E.dtype)
    gone = np.lib.stride_tricks.as_strided(nan, shape=E.shape, strides=(0,) * E.ndim,
                                           writeable=False)
    return replace(batch, E=gone, inputs=dict(inputs))


def case_seed(base: int, name: str) -> int:
    """A stable per-case seed from the run's seed and the case name (same on every machine)."""
    value = base * 1_000_003 + zlib.crc32(name.encode())
    # Below 2**32 the historical 32-bit seeds (every printed replay stays valid); above it every
    # bit of the user's seed is kept (2**70 must not replay the batches of seed 0).
    return value % (2**32) if base < 2**32 else value


def standard_cases(seed: int) -> list[Case]:
    """The seeded set ``tyingspec check TARGET`` runs: each covers one way bugs hide."""
    specs = [
        ("absent-tokens", dict(V=32, d=8, N=6, composition="distinct")),
        ("repeated-tokens", dict(V=32, d=8, N=12, composition="repeats", distinct=4)),
        ("one-token-repeated", dict(V=16, d=4, N=8, composition="one-token")),
        ("n-greater-than-v", dict(V=5, d=3, N=20)),
        ("v-equals-1", dict(V=1, d=3, N=4)),
        ("v-equals-d", dict(V=6, d=6, N=8, composition="repeats", distinct=3)),
        ("token-zero", dict(V=16, d=4, N=6, composition="with-zero")),
        ("res-zero", dict(V=16, d=4, N=8, composition="repeats", distinct=5, res=0.0)),
        ("s-in-not-1", dict(V=16, d=4, N=8, composition="repeats", distinct=5, res=0.7,
                            s_in=2.5)),
        ("no-bias", dict(V=16, d=4, N=8, composition="repeats", distinct=5, bias=False)),
    ]
    return [Case(name=name, seed=case_seed(seed, name), **kw) for name, kw in specs]  # type: ignore[arg-type]


#: E's scale in ``--shape`` cases: GPT-2's initialisation.  The small cases draw E ~ N(0, 1),
#: which at d = 768 puts logits in the hundreds: a softmax no trained or fresh model has, whose
#: subnormal gradients slow the reference tenfold and whose rounding hides real bugs.
SHAPE_E_SCALE = 0.02

#: Standard cases whose point is their shape: ``--shape`` leaves them out.
SHAPE_CASES = ("n-greater-than-v", "v-equals-1", "v-equals-d")

#: Standard cases whose point is a setting of the probe model: a target with its own model
#: (torch) leaves them out too.
PROBE_CASES = ("res-zero", "s-in-not-1", "no-bias")

def at_model_setting(case: Case, V: int, d: int, N: int, setting: str) -> Case:
    """``case`` on a framework model (torch, jax) of vocabulary ``V`` and width ``d``, at a
    batch of ``N`` tokens drawn in ``setting`` (its text, printed with the case): float64, E of
    unit scale, its composition one the batch can hold.  A batch larger than the vocabulary
    cannot be of distinct tokens: half the vocabulary then, the other half absent, so that the
    rows of repeated tokens and those of every present token are told apart."""
    composition, distinct = case.composition, case.distinct
    if composition == "distinct" and N > V:
        composition, distinct = "mixed", max(1, V // 2)
    if distinct is not None:
        distinct = min(distinct, V, N)
    return replace(case, V=V, d=d, N=N, probe=False, e_scale=1.0, dtype="float64",
                   composition=composition, distinct=distinct, setting=setting)


def at_shape(cases: list[Case], V: int, d: int, N: int, kind: KindLike | None = None
             ) -> tuple[list[Case], list[str]]:
    """The cases of ``kind`` (default: a model's) at a user's shape, each keeping its
    composition (and its N, for the kind's ``length_cases``; E at the scale the kind's
    ``e_scale_at`` keeps, else :data:`SHAPE_E_SCALE`); the names left out (those defined by
    their shape, and those whose composition the shape cannot hold)."""
    kept: list[Case] = []
    left_out: list[str] = []
    lengths = () if kind is None else kind.length_cases
    for c in cases:
        if c.ce and (kind is None or kind.draws is None):  # its E's scale is the kind's
            raise ValueError(f"case {c.name!r} has kind options ({c.ce}): put it at a shape "
                             "with the kind that draws them")
        if c.name in SHAPE_CASES or (c.composition == "distinct" and N > V):
            left_out.append(c.name)
            continue
        n = c.N if c.name in lengths else N
        scale = None if kind is None or kind.e_scale_at is None else kind.e_scale_at(c, d)
        kept.append(replace(c, V=V, d=d, N=n, tokens=None, targets=None,
                            e_scale=scale or SHAPE_E_SCALE, given_shape=True))
    return kept, left_out


#: Bytes per entry of the arrays a case is built in, by precision (``auto`` builds float64).
ENTRY_BYTES = {"auto": 8, "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def model_bytes(V: int, d: int, N: int, precision: str = "float64") -> int:
    """About how many bytes a model check at ``V, d, N`` holds at its peak (the default of
    ``KindSpec.peak_bytes``; the kernel and linear-ce kinds have their own, beside their
    specs).  RSS from ``/usr/bin/time -v``, numpy 2, CPU: the float64 fit this estimate started
    from, seven [V, d] arrays (the E it builds, E after the SGD step, the reference's two
    paths, the returned dE and their differences), two and a half [N, V], one [N, d], in 8-byte
    entries whatever the precision (a float32 model check was not measured at these sizes),
    the interpreter left out: 187 MiB at 8192,256,512, 311 MiB at 16384,256,256, 473 MiB at
    16384,512,64 and 643 MiB at 1024,64,32768, each within 4% of this.

    It is checked before any array is made, so ``--shape 1000000000,768,1024`` is refused at
    once instead of failing (or swapping) on its first allocation."""
    return 8 * (7 * V * d + 5 * N * V // 2 + N * d)


#: The interpreter, numpy, and a check's small arrays (sketch projections, h, dx, bounds).
OVERHEAD = 128 << 20


def memory_problem(V: int, d: int, N: int, available: int | None, precision: str = "float64",
                   kind: KindLike | None = None) -> str | None:
    """Why a case of ``kind`` (default: a model) at ``V, d, N`` in ``precision`` cannot run
    here (it needs more memory than ``available`` bytes, by the kind's ``peak_bytes``); None
    when it fits or the available memory is unknown."""

    need = (model_bytes if kind is None else kind.peak_bytes)(V, d, N, precision)
    if available is None or need <= available:
        return None
    built = "float64" if precision == "auto" else precision
    what = "model" if kind is None else kind.name
    return (f"V={V} d={d} N={N} in {built} needs about {byte_text(need)} of memory for a "
            f"{what} check and this machine has {byte_text(available)} available")


def batch_problem(tokens: tuple[int, ...] | None, targets: tuple[int, ...] | None,
                  V: int | None, *, ignore_index: int | None = None) -> str | None:
    """Why an explicit batch (``--tokens/--targets``, a replay's) cannot be run on a vocabulary
    of ``V`` rows: tokens and targets apart, of different lengths, empty, or outside
    ``[0, V)`` (a target may be ``ignore_index`` where the kind has one; ``V=None``: not yet
    known, only negative ids are refused); None when it can.  Checked before the batch
    reaches user code, where an index out of range is a traceback (torch) or, worse, wraps
    around (numpy's ``E[-100]``)."""
    if (tokens is None) != (targets is None):
        return "tokens and targets go together: give both or neither"
    if tokens is None or targets is None:
        return None
    if not tokens:
        return "the batch is empty: give at least one token and target"
    if len(tokens) != len(targets):
        return f"{len(tokens)} tokens but {len(targets)} targets; they must match"
    top = V if V is not None else max(*tokens, *targets) + 1
    bad_tokens = sorted({t for t in tokens if not 0 <= t < top})
    bad_targets = sorted({t for t in targets if not 0 <= t < top and t != ignore_index})
    if not bad_tokens and not bad_targets:
        return None
    parts = ([f"tokens {bad_tokens}"] if bad_tokens else []) + \
        ([f"targets {bad_targets}"] if bad_targets else [])
    ignored = "" if ignore_index is None else f" (a target may also be {ignore_index}, ignored)"
    where = "must be >= 0" if V is None else f"must be in [0, {V}) for V={V}"
    return f"token ids {where}{ignored}; got {' and '.join(parts)}"


def closed_form(batch: Batch, dtype: str = "float64") -> Paths:
    """The closed-form reference paths of a batch, computed in ``dtype`` (float64 unless the
    engine says a float32 reference is enough; see :func:`working_dtype`)."""
    def cast(a: Array) -> Array:
        out: Array = a.astype(dtype, copy=False)
        return out

    return closed_form_paths(cast(batch.E), cast(batch.W),
                             None if batch.b is None else cast(batch.b),
                             batch.tokens, batch.targets, batch.res, batch.s_in,
                             factors=batch.e_factors())


#: Above this many multiply-adds in one product (V*d*N), a reference for a check judged at
#: float32 or below is computed in float32: its rounding is the second of the two unit
#: roundoffs the bound allows (C = 2 in _tolerance), and a float64 reference would cost
#: several times the implementation it checks.  Smaller shapes always use float64.
FLOAT32_REFERENCE_ABOVE = 2**24


def working_dtype(size: int, precision: str) -> str:
    """The dtype the reference is computed in for a product of ``size`` multiply-adds."""
    return "float32" if precision != "float64" and size > FLOAT32_REFERENCE_ABOVE else "float64"


#: The SGD step ``tyingspec check`` and ``tie_survives_a_step`` take: the entry of E with the
#: largest gradient moves by this much.
SGD_STEP = 0.1
#: Rows of dE per block of the step: a few hundred KB, in cache between its two passes.
STEP_ROWS = 128


def sgd_step(batch: Batch, dE: Array, step: float = SGD_STEP) -> tuple[Batch, float] | None:
    """The batch at ``E - lr * dE`` (W and b kept), with ``lr`` chosen so the largest entry of
    E moves by ``step``; None when ``dE`` is zero and the step would not move E."""
    dE = np.asarray(dE)
    # max |dE| without an |dE| temporary (at V = 50257 each [V, d] one is a fresh 154 MB), and
    # the step below, a block of rows at a time on every core: two passes over [V, d] that
    # took 0.11 s a check at GPT-2 size on one core
    peaks = np.zeros(-(-dE.shape[0] // STEP_ROWS) if dE.ndim and dE.size else 0)

    def peak_of(b: slice) -> None:
        peaks[b.start // STEP_ROWS] = max(float(dE[b].max()), -float(dE[b].min()))

    if peaks.size:
        on_row_blocks(peak_of, dE.shape[0], STEP_ROWS)
    peak = float(peaks.max(initial=0.0))
    if peak == 0.0:
        return None
    lr = step / peak
    # in E's own precision, as an optimizer steps it (a float64 copy of a GPT-2-size E costs
    # seconds), in one [V, d] array: E + (-lr) dE is bit for bit E - lr dE (negation is exact)
    dt = batch.E.dtype
    E1 = memory.empty(dE.shape, dt)
    minus_lr = np.asarray(-lr, dtype=dt)

    def stepped(b: slice) -> None:
        np.multiply(dE[b], minus_lr, dtype=dt, casting="same_kind", out=E1[b])
        E1[b] += batch.E[b]

    on_row_blocks(stepped, dE.shape[0], STEP_ROWS)
    return replace(batch, E=E1), lr


#: Shapes up to this many entries of E use the sympy reference.  The derivation compiles in
#: under 0.35 s for each such (V, d, bias) (about 4 s for all of them, once per process); the
#: full symbolic range (V*d <= 12) costs ~36 s per process, too much for a property run.
SYMBOLIC_ENTRIES = 6


def model_reference(batch: Batch, precision: str = "float64") -> Paths:
    """The reference a model is judged against at ``precision``: sympy-derived paths on small
    shapes, the closed form beyond them (float64, or float32 at large shapes judged at float32
    or below)."""
    if batch.E.size > SYMBOLIC_ENTRIES:
        paths = closed_form(batch, working_dtype(batch.E.size * batch.tokens.shape[0],
                                                 precision))
    else:
        # lazy: the sympy reference, only where a shape is small enough to derive
        from tyingspec._src.core.symbolic import symbolic_paths

        paths = symbolic_paths(batch.E.astype(np.float64), batch.W.astype(np.float64),
                               None if batch.b is None else batch.b.astype(np.float64),
                               batch.tokens, batch.targets, batch.res, batch.s_in)
    return padded(paths, batch.padding_idx)


def padded(paths: Paths, padding_idx: int | None) -> Paths:
    """``paths`` under nn.Embedding(padding_idx=p) semantics: positions reading row p add
    nothing to the input path (their forward is unchanged); the output path is untouched."""
    if padding_idx is None:
        return paths
    rows = np.array(paths.per_position, copy=True)
    at_pad = np.asarray(paths.tokens) == padding_idx
    pad_input = np.asarray(rows[at_pad], dtype=np.float64).sum(axis=0)
    rows[at_pad] = 0
    sketch = None if paths.sketch is None else paths.sketch.with_exact(np.array([padding_idx]))
    return replace(paths, per_position=rows, padding_idx=padding_idx, sketch=sketch,
                   pad_input=pad_input,
                   dE_in=input_path(np.asarray(paths.tokens), rows, paths.dE_in.shape[0],
                                    factored=sketch is not None))


def kernel_paths(tokens: IntArray, dx: Array, h: Array, g: Array, V: int,
                 precision: str = "float64", *, sketch: bool | None = None) -> Paths:
    """The reference of a kernel on the inputs it was handed (float64, or float32 at large
    shapes judged at float32 or below; absent rows through projections above
    ``SKETCH_ABOVE``, or as ``sketch`` says)."""
    n, d = h.shape
    dt = working_dtype(V * d * n, precision)
    rows = np.asarray(dx, dtype=dt)
    drawn = draw_directions(V, d, n, tokens, None, sketch)
    terms, projected = kernel_terms(tokens, dx, h, g, V, None if drawn is None else drawn[0])
    dE_in, dE_out, judged = two_paths(tokens, rows, np.asarray(g, dtype=dt),
                                      np.asarray(h, dtype=dt), V,
                                      np.unique(tokens).astype(np.int64), drawn, projected)
    return Paths(loss=0.0, dE_in=dE_in, dE_out=dE_out, dW=np.zeros((0, 0)), db=None,
                 per_position=rows, tokens=tokens, terms=terms, sketch=judged)
