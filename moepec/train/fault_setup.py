"""A run's fault injection, from its config: the fault plan (named faults and seeded random
ones), the folder that remembers which faults already fired (so a restarted worker skips
them), and the checkpoint path routed through the fault-injecting filesystem when storage
faults are planned. The injector itself is :mod:`moepec.train.faults`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moepec.errors import ConfigError
from moepec.train.config import TrainConfig

if TYPE_CHECKING:
    from moepec.train.dist import DistInfo


_STORAGE_FAULTS = ("storage_error", "enospc", "slow_storage")


def ckpt_url(cfg: TrainConfig) -> str:
    """The checkpoint path, routed through the fault-injecting filesystem when storage
    faults are planned for a local directory."""
    assert cfg.checkpoint is not None
    path = cfg.checkpoint.path
    wants = any(k in (cfg.faults or "") for k in _STORAGE_FAULTS) or cfg.fault_mtbf > 0
    if wants and "://" not in path:
        return "faulty://" + str(Path(path).resolve())
    return path


def fault_state_dir(cfg: TrainConfig) -> str:
    # Fired faults are remembered next to the run so that restarted workers skip them.
    if cfg.out_dir:
        return cfg.out_dir
    assert cfg.checkpoint is not None
    if "://" in cfg.checkpoint.path:
        raise ConfigError("fault injection with a remote --ckpt-dir needs --out-dir (a local "
                          "folder that remembers which faults already fired)")
    return cfg.checkpoint.path


def build_injector(cfg: TrainConfig, info: DistInfo):
    """The FaultInjector of ``cfg.faults`` / ``cfg.fault_mtbf`` for this rank, or None.

    Called by the trainer's set-up on every rank; each rank fires only its own faults.
    """
    if not (cfg.faults or cfg.fault_mtbf):
        return None
    assert cfg.checkpoint is not None  # TrainConfig requires it with faults
    from moepec.train.faults import KINDS, FaultInjector, FaultPlan

    state = fault_state_dir(cfg)
    plan = FaultPlan.parse(cfg.faults or "", state_dir=state)
    if cfg.fault_mtbf:
        kinds = tuple(k for k in KINDS if k != "corrupt")
        plan.faults += FaultPlan.random(cfg.seed, cfg.steps, cfg.fault_mtbf, kinds,
                                        info.world_size).faults
    return FaultInjector(plan, info.rank, ckpt_url(cfg), seed=cfg.seed,
                         storage_fault_steps=2 * cfg.checkpoint.interval,
                         log_path=str(Path(state) / "faults.jsonl"))
