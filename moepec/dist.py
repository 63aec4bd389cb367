"""Small torch.distributed helpers: process group from the torchrun environment,
rank/world queries, explicit gradient averaging and barriers with a timeout.

Every function works without a process group (one process): collectives become no-ops
and rank/world are 0/1. All collectives must be called by every rank of ``group``, on
the main thread (DESIGN habit: no collectives off the main thread).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moepec.errors import DistributedError

__all__ = [
    "DistInfo",
    "all_reduce_sum",
    "average_gradients",
    "barrier",
    "check_same_across_ranks",
    "destroy",
    "init_from_env",
    "is_initialized",
    "rank",
    "world_size",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int
    """Global rank (0 without a process group)."""
    world_size: int
    """Number of ranks (1 without a process group)."""
    local_rank: int
    """Rank on this host; selects the CUDA device."""
    initialized_here: bool
    """True if :func:`init_from_env` created the group, so the caller should destroy it."""


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> DistInfo:
    """Join the process group described by torchrun's environment, if any.

    Called once by the entry point on every rank; blocks until all ranks joined or
    ``timeout_s`` passed (the timeout also bounds every later collective). Without
    ``WORLD_SIZE`` in the environment (a plain ``python`` run) nothing is initialised.
    An existing group (e.g. created by a test) is reused. The backend defaults to NCCL
    when CUDA is available, gloo otherwise. Raises DistributedError if joining fails.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if is_initialized():
        return DistInfo(rank=rank(), world_size=world_size(), local_rank=local_rank,
                        initialized_here=False)
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(rank=0, world_size=1, local_rank=0, initialized_here=False)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # the launcher's errors vary; report them as one kind
        raise DistributedError(
            f"could not join the process group ({backend}, timeout {timeout_s:.0f}s): {exc}; "
            "launch with torchrun and check that all ranks start"
        ) from exc
    log.info("joined process group: rank %d of %d (%s)", rank(), world_size(), backend)
    return DistInfo(rank=rank(), world_size=world_size(), local_rank=local_rank,
                    initialized_here=True)


def destroy() -> None:
    """Leave the default process group if one exists (idempotent)."""
    if is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group`` and return it (blocking)."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def average_gradients(params: Iterable[torch.nn.Parameter],
                      group: dist.ProcessGroup | None = None) -> None:
    """Average the ``.grad`` of ``params`` over the ranks of ``group`` (blocking).

    One all_reduce over a flattened buffer instead of DDP, so that callers decide which
    group averages which parameters (expert parallelism averages experts over a
    different group than the rest). Every rank must pass the same parameters in the
    same order. A missing gradient counts as zero (and is materialised as zeros), so
    ranks whose batch did not touch a parameter still agree on the buffer layout.
    Parameters with ``requires_grad=False`` are skipped.
    """
    n = world_size(group)
    if n == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def barrier(timeout_s: float = DEFAULT_TIMEOUT_S, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` arrives, at most ``timeout_s``.

    On gloo this is ``monitored_barrier`` (which names the missing ranks); NCCL has no
    per-call timeout, so there the process group's timeout applies. Raises
    DistributedError on timeout or failure.
    """
    if world_size(group) == 1:
        return
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s))
        else:
            dist.barrier(group=group)
    except Exception as exc:
        raise DistributedError(f"barrier failed or timed out after {timeout_s:.0f}s: {exc}") \
            from exc


def check_same_across_ranks(value: float, what: str, group: dist.ProcessGroup | None = None,
                            device: torch.device | str = "cpu") -> None:
    """Raise DistributedError unless every rank passed the same ``value`` (collective)."""
    if world_size(group) == 1:
        return
    t = torch.tensor([value, -value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t[0].item() != value or -t[1].item() != value:
        raise DistributedError(
            f"ranks disagree on {what} (this rank {value!r}, range "
            f"[{-t[1].item()!r}, {t[0].item()!r}]); start every rank with the same seed and config"
        )
