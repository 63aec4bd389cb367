"""The job's shape as the manager sees it: ranks, the expert-parallel layout, the experts,
and the process groups the manager leaves at close.

Built once by the manager's constructor on every rank; nothing here does I/O or a
collective (the process group is only asked for the rank and the world size).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from moepec.errors import ConfigError, ExpertDiscoveryError
from moepec.manager.config import CheckpointConfig
from moepec.state.experts import ExpertMap, ExpertSpec, describe, discover

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Layout:
    """This rank in the job, and its expert-parallel group."""

    distributed: bool
    rank: int
    world_size: int
    ep_rank: int
    ep_size: int

    @classmethod
    def current(cls, expert_parallel: tuple[int, int] | None) -> Layout:
        """The layout of this process (checked against the process group). Raises
        ConfigError for an ``expert_parallel`` the ranks do not fit."""
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world_size = dist.get_world_size() if distributed else 1
        ep_rank, ep_size = expert_parallel or (0, 1)
        if ep_size > 1 and (world_size % ep_size or ep_rank != rank % ep_size):
            raise ConfigError(
                f"expert_parallel={expert_parallel} on rank {rank} of {world_size}: "
                f"ep_size must divide the world size and ep_rank must be rank % ep_size "
                f"(EP groups are contiguous ranks)")
        return cls(distributed, rank, world_size, ep_rank, ep_size)


def find_experts(model: nn.Module, spec: ExpertSpec | None, config: CheckpointConfig,
                 ep_size: int) -> tuple[ExpertMap, tuple[int, ...]]:
    """The model's experts and the global expert count per MoE layer (a rank holds
    n_local of them per layer under EP). Raises ExpertDiscoveryError when none are found
    and ``config.require_experts`` asks for them, ConfigError when K or the layout does
    not fit them."""
    emap = discover(model, spec)
    n_experts = tuple(n * ep_size for n in emap.n_experts)
    if not n_experts:
        found = describe(emap)
        if config.experts_required:
            raise ExpertDiscoveryError(
                f"{found}\nto checkpoint this model in full on purpose, pass "
                f"CheckpointConfig(require_experts=False)")
        if any(not c.taken for c in emap.candidates):  # something looked like experts
            log.warning("%s\nrequire_experts=False: every checkpoint will be a full one",
                        found)
        else:  # a dense model, checkpointed in full on purpose (the caller says so)
            log.debug("%s; require_experts=False: every checkpoint will be a full one", found)
    elif emap.ragged and ep_size > 1:
        raise ConfigError("ExpertSpec(ragged=True) does not work with expert parallelism; "
                          "run without expert_parallel")
    elif config.k_snapshot > min(n_experts):
        raise ConfigError(
            f"k_snapshot={config.k_snapshot} (and k_persist={config.k_persist}) must be "
            f"<= the experts per MoE layer ({min(n_experts)})")
    return emap, n_experts


def destroy_groups(groups: list[dist.ProcessGroup | None]) -> None:
    """Leave the process groups a manager created (after their threads stopped)."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # the default group went first: it took every subgroup with it
    for group in groups:
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - exiting anyway; say what stays
                log.debug("could not destroy a checkpoint process group: %s", exc)
