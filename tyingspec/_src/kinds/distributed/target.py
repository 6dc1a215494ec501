"""``DistributedTarget``: a user's distributed training step and its single-process reference.

Importing this module does not import torch: a target module can be resolved (and its kind
checked) cheaply; the ranks and the worker import torch themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: A layout: (pipeline stages, data-parallel replicas); its world has pp * dp ranks.
Layout = tuple[int, int]

#: The layouts a target is checked on unless it declares its own: pp=2 alone (the embedding
#: group is the world: a sum over the wrong group cannot show there), pp=2 x dp=2 (the
#: embedding group is two of four ranks) and pp=3 (a middle stage holds no copy).
DEFAULT_LAYOUTS: tuple[Layout, ...] = ((2, 1), (2, 2), (3, 1))
#: The micro-batch counts drawn unless a target declares its own: three or more, so that what
#: goes wrong only from the third micro-batch on (a deferred head wgrad) is seen.  A layout
#: draws among the counts its share of the batch splits into: with the default 12 sequences,
#: 3 or 4 on dp=1 and 3 on dp=2.
DEFAULT_MICRO_BATCHES: tuple[int, ...] = (3, 4)


@dataclass(frozen=True)
class DistributedTarget:
    """A distributed training step under test.

    ``reference()`` builds the single-process model (called after ``torch.manual_seed(seed)``);
    its ``forward(tokens)`` returns logits ``[B, T, V]`` and the loss is their mean token
    cross-entropy.  ``embedding`` names its tied matrix (``named_parameters`` spelling, e.g.
    ``"wte.weight"``).

    ``setup(world)`` runs on every rank for every case, after the same
    ``torch.manual_seed(seed)``: it builds this rank's stage, shard or replica with the
    reference's initialisation (and its optimizer) and returns ``(state, copy)``, where
    ``copy`` is this rank's Parameter holding the tied matrix (``None`` on a rank that holds
    none; a DTensor under FSDP2 is gathered).  ``step(world, state, tokens, targets)`` then
    runs forward and backward on this rank's micro-batches (``world.micro_batches``), the
    user's own gradient sync and one optimizer step.  The copy's ``.grad`` after ``step`` is
    the gradient after the sync (an optimizer step leaves it; do not zero it at the end, zero
    it at the start: each case runs several steps on one setup, and every step's gradient
    must be its own).

    ``layouts`` are the (pp, dp) layouts the target supports; every one is checked.  The
    default holds one where the embedding group is not the world (pp=2 x dp=2) and one whose
    middle stage holds no copy (pp=3).  ``micro_batches`` are the micro-batch counts a step
    takes (an int: that count only); each case draws one per layout among those that split
    that layout's share of the batch.  The default draws three or four, so that a bug from the
    third micro-batch on shows.  ``batch_size`` x ``seq_len`` is the global batch every rank
    is handed; it splits into ``dp`` equal shares and each share into the drawn count of
    micro-batches.  The default (12 x 4) stays below a small test vocabulary, so that some
    rows carry the output path alone.
    """

    reference: Callable[[], Any]
    embedding: str
    setup: Callable[[World], tuple[Any, Any]]
    step: Callable[[World, Any, Any, Any], None]
    layouts: Sequence[Layout] = DEFAULT_LAYOUTS
    micro_batches: int | Sequence[int] = DEFAULT_MICRO_BATCHES
    batch_size: int = 12
    seq_len: int = 4

    def __call__(self) -> Any:
        """The reference model: a target is a factory like the torch kind's."""
        return self.reference()


def place(rank: int, dp: int) -> str:
    """A rank and its place in the layout (``World``'s rule), as every message names it."""
    return f"rank {rank} (stage {rank // dp}, replica {rank % dp})"


@dataclass
class World:
    """What one rank sees: its place in the layout and the process groups tyingspec made.

    Ranks are laid out as Megatron does (data-parallel fastest): ``stage = rank // dp``,
    ``replica = rank % dp``.  ``dp_group`` holds the ranks of this stage (one per replica),
    ``pp_group`` the stages of this replica, ``embedding_group`` the first and last stage of
    this replica (Megatron's ``_EMBEDDING_GROUP``; the one rank when pp = 1).  A middle stage
    (pp >= 3) holds no copy and is not in its replica's embedding group: torch's collectives
    on a group a rank is not in return at once on that rank.  A group is ``None`` only before
    the world is up.  ``micro_batch_count`` is the count drawn for the case (set before
    ``setup``).
    """

    rank: int
    size: int
    pp: int
    dp: int
    micro_batch_count: int = 1
    dp_group: Any = None
    pp_group: Any = None
    embedding_group: Any = None
    #: global ranks of the groups above, in order
    dp_ranks: tuple[int, ...] = ()
    pp_ranks: tuple[int, ...] = ()
    embedding_ranks: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> int:
        return self.rank // self.dp

    @property
    def replica(self) -> int:
        return self.rank % self.dp

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int, replica: int) -> int:
        """The global rank of ``stage`` in ``replica``."""
        return stage * self.dp + replica

    def shard(self, x: Any) -> Any:
        """This replica's share of a global batch ``[B, ...]`` (contiguous sequences)."""
        n = x.shape[0] // self.dp
        return x[self.replica * n:(self.replica + 1) * n]

    def micro_batches(self, x: Any) -> list[Any]:
        """This replica's share split into ``micro_batch_count`` equal micro-batches."""
        share = self.shard(x)
        n = share.shape[0] // self.micro_batch_count
        return [share[i * n:(i + 1) * n] for i in range(self.micro_batch_count)]
