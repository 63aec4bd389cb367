"""Small torch.distributed helpers: process group from the torchrun environment,
rank/world queries, explicit gradient averaging (data and expert parallel), gradient
clipping over expert-parallel ranks and barriers with a timeout.

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
from torch import nn

from moepec.errors import DistributedError
from moepec.models.parallel import ExpertParallel
from moepec.state.experts import discover

__all__ = [
    "DistInfo",
    "all_reduce_sum",
    "average_gradients",
    "average_gradients_ep",
    "barrier",
    "check_same_across_ranks",
    "clip_grad_norm_ep",
    "destroy",
    "init_from_env",
    "is_initialized",
    "rank",
    "split_expert_parameters",
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
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
        # torch issue 135712: with the rendezvous store shared, restarted workers can read
        # the previous round's addresses and fail to connect.
        log.warning("torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
                    "restarted workers may fail to connect; set it in torchrun's environment")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    try:
        _init_process_group(backend, timedelta(seconds=timeout_s))
    except Exception as exc:  # the launcher's errors vary; report them as one kind
        raise DistributedError(
            f"could not join the process group ({backend}, timeout {timeout_s:.0f}s): {exc}; "
            "launch with torchrun and check that all ranks start"
        ) from exc
    log.info("joined process group: rank %d of %d (%s)", rank(), world_size(), backend)
    return DistInfo(rank=rank(), world_size=world_size(), local_rank=local_rank,
                    initialized_here=True)


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """torchrun's ``env://`` group; a warm spare's child of a group of several ranks joins
    under its generation's store prefix instead (:mod:`moepec.train.spare`: the store
    outlives the generations, so an older one's keys must not be read)."""
    from moepec.train.spare import child_store_prefix

    prefix = child_store_prefix()
    if prefix is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(prefix, store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


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
    _sum_gradients(params, group, divisor=n)


def _sum_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None,
                   divisor: int) -> None:
    """Sum ``.grad`` over ``group`` (one flat all_reduce) and divide by ``divisor``."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def split_expert_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(expert, non-expert) parameters of ``model``, each in ``named_parameters`` order.

    Experts are what :func:`moepec.state.experts.discover` finds (both layouts), so there is
    one definition of "expert" in the project. Local, no communication.
    """
    owner = discover(model).owner
    expert: list[nn.Parameter] = []
    other: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        (expert if name in owner else other).append(p)
    return expert, other


def _fully_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def average_gradients_ep(model: nn.Module, ep: ExpertParallel,
                         world_group: dist.ProcessGroup | None = None) -> None:
    """Turn every rank's local ``.grad`` into the data-parallel gradient (blocking).

    Collective over the whole job: every rank calls it after backward. Non-expert
    gradients are averaged over ``world_group`` (the default group: all W ranks, as in
    :func:`average_gradients`). Expert gradients are summed over ``ep.expert_dp_group``
    and divided by W. Without expert parallelism this is :func:`average_gradients`.
    A model sharded with FSDP2 (``fully_shard``) has averaged its gradients itself; under
    FSDP x EP the experts' FSDP unit averaged over the dp mesh dim only, a sum over the
    ep ranks' losses (see below) / dp, so they are divided by ep here (local).
    """
    if _fully_sharded(model):
        if ep.enabled:
            with torch.no_grad():
                for p in split_expert_parameters(model)[0]:
                    if p.grad is not None:
                        p.grad.div_(ep.size)
        return
    if not ep.enabled:
        average_gradients(model.parameters(), world_group)
        return
    expert, other = split_expert_parameters(model)
    average_gradients(other, world_group)
    # Why sum-over-replicas / W is the data-parallel gradient: rank r's loss_r depends
    # on expert e only through the token copies its EP group sent to e's holder, and
    # the all-to-all backward returns d loss_r / d(output) of exactly those copies to
    # the holder. So after backward the holder's expert .grad is the sum over the ranks
    # r of its EP group of d loss_r / d w_e. Summing over the expert-DP group (one
    # holder of e per EP group) makes it the sum over all W ranks; the DP gradient,
    # the mean of the W per-rank losses' gradients, is (1/W) * sum_r d loss_r / d w_e.
    _sum_gradients(expert, ep.expert_dp_group, divisor=world_size(world_group))


def clip_grad_norm_ep(model: nn.Module, max_norm: float, ep: ExpertParallel) -> float:
    """Clip all gradients of ``model`` to a global norm of ``max_norm``; returns the norm.

    The norm is that of the whole (non-EP) model's gradient: non-expert gradients
    (equal on every rank after averaging) plus every expert's once, each EP group
    holding each expert once. Collective over ``ep.group`` when EP is enabled, so
    every rank clips by the same factor; otherwise plain ``clip_grad_norm_``.
    """
    if not ep.enabled:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        full = getattr(norm, "full_tensor", None)  # DTensor gradients (FSDP2)
        return float(full() if full is not None else norm)
    expert, other = split_expert_parameters(model)
    if _fully_sharded(model):
        return _clip_sharded(expert, other, max_norm)
    other_norm = nn.utils.get_total_norm([p.grad for p in other if p.grad is not None])
    expert_norm = nn.utils.get_total_norm([p.grad for p in expert if p.grad is not None])
    expert_sq = all_reduce_sum(expert_norm.double().pow(2).reshape(1), ep.group)
    total = (other_norm.double().pow(2) + expert_sq[0]).sqrt().to(other_norm.dtype)
    nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return float(total)


def _clip_sharded(expert: list[nn.Parameter], other: list[nn.Parameter], max_norm: float
                  ) -> float:
    """clip_grad_norm_ of FSDP x EP (collective over all ranks): expert gradients are
    DTensors on the (dp, ep) mesh, the others on the flat one. A norm is reduced per
    mesh (``full_tensor``: every element counted once) and the two combine, as
    torchtitan's clipping under EP does; torch's clip cannot mix the two meshes."""
    def norm(params: list[nn.Parameter]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        n = nn.utils.get_total_norm(grads)
        full = getattr(n, "full_tensor", None)
        return (full() if full is not None else n).double()

    total = torch.sqrt(norm(expert).pow(2) + norm(other).pow(2)).float()
    # torch's clip_grads_with_norm_ formula, in the gradients' dtype (float32).
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    with torch.no_grad():
        for p in (*expert, *other):
            if p.grad is not None:
                p.grad.mul_(coef)
    return float(total)


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
