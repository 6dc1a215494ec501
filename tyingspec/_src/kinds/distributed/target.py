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
    the gradient after the sync (an optimizer step leaves it; do not zero it at the end).

    ``layouts`` are the (pp, dp) layouts the target supports; every one is checked.
    ``batch_size`` x ``seq_len`` is the global batch every rank is handed; it splits into
    ``dp`` equal shares and each share into ``micro_batches``.
    """

    reference: Callable[[], Any]
    embedding: str
    setup: Callable[[World], tuple[Any, Any]]
    step: Callable[[World, Any, Any, Any], None]
    layouts: Sequence[Layout] = ((2, 1),)
    micro_batches: int = 2
    batch_size: int = 4
    seq_len: int = 6

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
    this replica (Megatron's ``_EMBEDDING_GROUP``; the one rank when pp = 1).  A group is
    ``None`` only before the world is up.
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
