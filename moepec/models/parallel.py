"""Expert parallelism (EP): which rank holds which experts, and the process groups.

With W ranks and ``ep_size`` P (P divides W and the number of experts E):

- EP groups are contiguous ranks: group g = ranks [g*P, (g+1)*P). The ranks of one
  EP group together hold every expert once and exchange tokens with all-to-all.
- ``ep_rank = rank % P``. A rank holds ``E // P`` experts per MoE layer, global ids
  ``ep_rank * (E // P) + i`` for local index i.
- The expert-data-parallel group of a rank is every rank with the same ``ep_rank``
  (W / P ranks, one per EP group): they hold replicas of the same experts and
  all-reduce those experts' gradients.

Layer 1 of DESIGN.md sits on this module (the model takes an :class:`ExpertParallel`),
so it imports nothing from moepec except errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from moepec.errors import ConfigError

__all__ = ["NO_EXPERT_PARALLEL", "ExpertParallel", "global_expert_ids", "init_expert_parallel"]


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """This rank's place in expert parallelism (see the module docstring)."""

    rank: int
    """Index of this rank inside its EP group: global rank % size."""
    size: int
    """Ranks per EP group (the EP degree); 1 disables expert parallelism."""
    group: dist.ProcessGroup | None
    """The EP group (token all-to-all); None when size is 1."""
    expert_dp_group: dist.ProcessGroup | None
    """Ranks holding the same experts (expert-gradient all-reduce); None when size is 1."""

    @property
    def enabled(self) -> bool:
        """Whether experts are split over ranks (size > 1)."""
        return self.size > 1

    def n_local(self, n_experts: int) -> int:
        """Experts per MoE layer on this rank; raises ConfigError unless size divides n_experts."""
        if n_experts % self.size:
            raise ConfigError(
                f"expert parallel size {self.size} does not divide n_experts={n_experts}; "
                "pick --ep that divides the number of experts"
            )
        return n_experts // self.size


# What a single process, or a run with ep_size 1, uses.
NO_EXPERT_PARALLEL = ExpertParallel(rank=0, size=1, group=None, expert_dp_group=None)


def init_expert_parallel(ep_size: int, timeout_s: float | None = None) -> ExpertParallel:
    """Create the EP and expert-data-parallel groups; returns this rank's view.

    Collective: every rank of the default process group calls it with the same
    ``ep_size`` (``dist.new_group`` must see every group created on every rank, in the
    same order). Blocks until the groups exist. ``ep_size`` 1, or no process group,
    returns rank 0 / size 1 with no groups and creates nothing. ``timeout_s`` bounds
    the collectives of the new groups (None: torch's default). Raises ConfigError when
    ``ep_size`` is not a positive divisor of the world size.
    """
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ConfigError(f"expert parallel size must be a positive integer, got {ep_size!r}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % ep_size:
        raise ConfigError(
            f"expert parallel size {ep_size} does not divide the {world} rank(s); "
            f"use --ep that divides the number of ranks, or launch a multiple of {ep_size} "
            "ranks with torchrun --nproc_per_node"
        )
    if ep_size == 1:
        return NO_EXPERT_PARALLEL
    rank = dist.get_rank()
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    ep_group = expert_dp_group = None
    for g in range(world // ep_size):
        ranks = list(range(g * ep_size, (g + 1) * ep_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            ep_group = group
    for j in range(ep_size):
        ranks = list(range(j, world, ep_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            expert_dp_group = group
    return ExpertParallel(rank=rank % ep_size, size=ep_size, group=ep_group,
                          expert_dp_group=expert_dp_group)


def global_expert_ids(ep: ExpertParallel, n_experts: int) -> list[int]:
    """Global ids of the experts this rank holds, in local-index order."""
    n_local = ep.n_local(n_experts)
    return list(range(ep.rank * n_local, (ep.rank + 1) * n_local))
