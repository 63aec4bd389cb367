"""Building a training run: the model, optimizer, data and checkpoint manager of one
call to :func:`moepec.train.trainer.train`, in an order every rank follows.

Kept apart from :mod:`moepec.train.trainer` so the loop reads on its own.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from moepec.errors import ConfigError
from moepec.models import GPTMoE, GPTMoEConfig
from moepec.models.parallel import NO_EXPERT_PARALLEL, ExpertParallel, init_expert_parallel
from moepec.train import dist
from moepec.train.config import Device, TrainConfig
from moepec.train.data import TokenLoader, eval_batches, load_corpus
from moepec.train.fault_setup import build_injector
from moepec.train.manager_setup import build_manager, check_root_writable, log_plt_outlook
from moepec.train.metrics import CheckpointLog, MetricsWriter
from moepec.train.persist_errors import PersistGuard
from moepec.train.steps import build_optimizer, build_scheduler

__all__ = ["Run", "device_for", "setup"]

log = logging.getLogger(__name__)


def device_for(cfg: TrainConfig, info: dist.DistInfo) -> torch.device:
    """The torch device this rank trains on (``cfg.device``)."""
    if cfg.device == Device.CPU or (cfg.device == Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but CUDA is not available; use --device cpu")
    return torch.device("cuda", info.local_rank)


@dataclass(slots=True)
class Run:
    """The live objects of one training run (built once, reused across restarts)."""

    model: GPTMoE
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: TokenLoader
    val: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    manager: Any  # CheckpointManager or None
    tokens_per_step: int
    injector: Any = None  # moepec.train.faults.FaultInjector or None
    checkpoints: CheckpointLog = field(default_factory=CheckpointLog)
    """The checkpoints the manager started, not yet written as metrics records."""
    persist: PersistGuard | None = None
    """The policy for failed persists (``cfg.on_persist_error``) and the last one seen;
    set with the manager."""


def data_shard(cfg: TrainConfig, info: dist.DistInfo) -> tuple[int, int]:
    """(shard, shards) of every global batch this rank reads: its rank among all ranks
    of all replica groups (group-major), or its rank in the job without replica groups."""
    if cfg.ft is None:
        return info.rank, info.world_size
    return cfg.ft.group * info.world_size + info.rank, cfg.ft.groups * info.world_size


def _check_world(cfg: TrainConfig, info: dist.DistInfo) -> None:
    """What the config can only be checked against once the number of ranks is known."""
    shards = data_shard(cfg, info)[1]
    if cfg.batch_size % shards:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by {shards} ranks (of all replica "
            "groups); use a multiple of the number of ranks"
        )
    if info.world_size % cfg.ep:
        raise ConfigError(
            f"ep={cfg.ep} does not divide the {info.world_size} rank(s); use an --ep that "
            "divides the number of ranks (torchrun --nproc_per_node)"
        )
    if cfg.faults:
        from moepec.train.faults import FaultPlan

        FaultPlan.parse(cfg.faults).check(cfg.steps, world_size=info.world_size)


def _load_data(cfg: TrainConfig, info: dist.DistInfo, seq_len: int,
               ) -> tuple[TokenLoader, list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank's training loader and its share of the fixed validation batches."""
    corpus = load_corpus(cfg.data)
    shard, shards = data_shard(cfg, info)
    loader = TokenLoader(corpus.train, seq_len, cfg.batch_size, cfg.seed,
                         rank=shard, world_size=shards)
    val = eval_batches(corpus.val, seq_len, cfg.batch_size, cfg.eval_batches,
                       rank=info.rank, world_size=info.world_size)
    if cfg.eval_batches and not val and info.rank == 0:
        log.warning("validation split (%d tokens) is shorter than one sequence; "
                    "no validation loss", len(corpus.val))
    return loader, val


def _build_model(cfg: TrainConfig, model_cfg: GPTMoEConfig, ep: ExpertParallel,
                 device: torch.device, info: dist.DistInfo) -> GPTMoE:
    """The model, initialised alike on every rank (checked: collective).

    Leaves torch's RNG seeded per rank, for dropout, and Python's ``random`` and numpy's too (the
    checkpoints hold it: a resumed run ends with the uninterrupted run's RNG states).
    """
    # Same seed on every rank -> same init; built on CPU so CUDA runs start identically.
    # Under EP each rank keeps its experts' part of the same full init.
    torch.manual_seed(cfg.seed)
    model = GPTMoE(model_cfg, ep).to(device)
    # Non-expert weights must agree on all ranks, experts over their replicas (the
    # expert-data-parallel group; everyone when ep=1).
    expert, other = dist.split_expert_parameters(model)
    for params, group, what in ((other, None, "the initial non-expert weights"),
                                (expert, ep.expert_dp_group, "the initial expert weights")):
        checksum = sum(float(p.detach().double().sum()) for p in params)
        dist.check_same_across_ranks(checksum, what, group=group, device=device)
    # Different dropout masks per rank (the data already differs; this keeps it so).
    torch.manual_seed(cfg.seed + info.rank)
    random.seed(cfg.seed + info.rank)
    np.random.seed(cfg.seed + info.rank)
    return model


def _fsdp_mesh(cfg: TrainConfig, device: torch.device, info: dist.DistInfo):
    """The device mesh of ``--fsdp`` (collective: every rank creates its groups).

    1-D over all ranks; with ``--ep N`` torchtitan's 2-D (dp, ep) mesh, row-major, so an
    EP group is N contiguous ranks as :func:`moepec.models.parallel.init_expert_parallel`
    lays them out.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not torch.distributed.is_initialized():
        raise ConfigError("--fsdp shards the model over the ranks of a torchrun job; run "
                          "`torchrun --nproc_per_node N -m moepec train --fsdp ...` (one "
                          "process has nothing to shard over)")
    if cfg.ep == 1:
        return init_device_mesh(device.type, (info.world_size,))
    return init_device_mesh(device.type, (info.world_size // cfg.ep, cfg.ep),
                            mesh_dim_names=("dp", "ep"))


def _mesh_expert_parallel(mesh) -> ExpertParallel:
    """The model's EP view of a (dp, ep) mesh: token all-to-all over the ``ep`` dim, expert
    replicas along ``dp`` (no new groups: the mesh's)."""
    return ExpertParallel(rank=mesh.get_local_rank("ep"), size=mesh["ep"].size(),
                          group=mesh["ep"].get_group(), expert_dp_group=mesh["dp"].get_group())


def _fully_shard(model: GPTMoE, mesh, info: dist.DistInfo) -> None:
    """FSDP2 as torchtitan applies it: every transformer block is its own unit
    (all-gathered for its forward and backward, then freed), the root holds the rest
    (embeddings, final norm, head). Parameters become DTensors sharded on dim 0; FSDP
    averages the gradients (reduce-scatter), so the step does not.

    On a 2-D (dp, ep) mesh the stacked experts of each MoE layer (this rank's E/ep
    experts, built by the EP model) become DTensors sharded over ``ep`` on dim 0, then
    their own FSDP unit over ``dp`` sharded on dim 1, so the two shardings do not
    collide: placements (Shard(1), Shard(0)). Everything else is sharded over all ranks
    (a flat mesh), as torchtitan's dp_shard with EP borrowing its ranks: non-expert
    weights are replicated over the EP dim anyway, so sharding them over the whole world
    rather than over dp alone divides their memory by ep more and costs the same
    reduce-scatter. An expert's gradient on its holder sums the losses of its EP group's
    ranks and FSDP averages it over dp, so it is ep times the data-parallel mean:
    :func:`moepec.train.dist.average_gradients_ep` divides it by ep (torchtitan sets
    ``set_gradient_divide_factor`` instead, whose PREMUL_SUM gloo lacks).
    """
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    flat = mesh
    if mesh.ndim == 2:
        flat = init_device_mesh(mesh.device_type, (info.world_size,))
        for block in model.blocks:
            experts = getattr(block.ffn, "experts", None)
            if experts is None:
                continue
            for name, p in list(experts.named_parameters(recurse=False)):
                local = DTensor.from_local(p.detach(), mesh["ep"], [Shard(0)], run_check=False)
                setattr(experts, name, nn.Parameter(local))
            fully_shard(experts, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
    for block in model.blocks:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)


def setup(cfg: TrainConfig, info: dist.DistInfo, metrics: MetricsWriter | None = None) -> Run:
    """Build everything a run needs. Called by :func:`moepec.train.trainer.train` on every
    rank, once per call (restarts reuse it); collective: the EP groups, the init check and
    the checkpoint manager meet all ranks, in this order. ``metrics`` (rank 0's writer)
    receives the manager's commit records."""
    model_cfg = cfg.model_config()
    _check_world(cfg, info)
    check_root_writable(cfg, info)  # before anything is built: a refusal costs nothing
    device = device_for(cfg, info)
    loader, val = _load_data(cfg, info, model_cfg.seq_len)
    # Collective: every rank creates every EP group (a no-op for ep=1), or the mesh.
    mesh = _fsdp_mesh(cfg, device, info) if cfg.fsdp else None
    if mesh is not None and mesh.ndim == 2:
        ep = _mesh_expert_parallel(mesh)
    else:
        ep = init_expert_parallel(cfg.ep, cfg.dist_timeout_s)
    model = _build_model(cfg, model_cfg, ep, device, info)
    if mesh is not None:
        _fully_shard(model, mesh, info)  # before the optimizer: it holds the shards
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    injector = build_injector(cfg, info)
    checkpoints = CheckpointLog()
    # Under FSDP the DTensor placements say which experts a rank holds.
    manager = build_manager(cfg, model, optimizer, scheduler, loader,
                            NO_EXPERT_PARALLEL if cfg.fsdp else ep, checkpoints=checkpoints,
                            metrics=metrics if info.rank == 0 else None,
                            hooks=injector.hooks if injector is not None else None)
    if injector is not None:  # faults need checkpoints (TrainConfig): the manager exists
        try:
            injector.use_ram(manager.ram_folder)
        except ConfigError:  # every rank refuses the same plan: close (collective), raise
            manager.close()
            raise
    if info.rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("training %s (%.2fM params) on %d rank(s), ep %d%s, %s, %d steps, "
                 "global batch %d x %d tokens", cfg.config, n_params / 1e6, info.world_size,
                 ep.size, ", fsdp" if cfg.fsdp else "", device, cfg.steps, cfg.batch_size,
                 model_cfg.seq_len)
        log_plt_outlook(cfg, model_cfg.n_experts)
    return Run(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, val=val,
               device=device, manager=manager,
               tokens_per_step=cfg.batch_size * model_cfg.seq_len,
               injector=injector, checkpoints=checkpoints,
               persist=PersistGuard(cfg.on_persist_error,
                                    metrics or MetricsWriter(None, enabled=False)))
