"""The run's CheckpointManager, built from its config: the checkpoint config as given (its
path through the fault-injecting filesystem when storage faults are planned), the trainer's
callbacks and the fault injector's hooks; and, at start-up, the expected PLT of the chosen
K and interval against the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from moepec.errors import CheckpointError, ConfigError
from moepec.hooks import FaultHooks
from moepec.train import dist
from moepec.train.config import TrainConfig
from moepec.train.fault_setup import ckpt_url
from moepec.train.metrics import CheckpointLog, MetricsWriter, commit_logger

if TYPE_CHECKING:
    from moepec.train.dist import DistInfo

log = logging.getLogger(__name__)


def check_root_writable(cfg: TrainConfig, info: DistInfo) -> None:
    """Refuse to start a run whose checkpoint root cannot be written: rank 0 probes it
    (``Storage.check_writable``, the probe the manager makes before its first write) and
    every rank raises the same CheckpointError, which names the path and the fix.

    Called by the trainer's set-up on every rank, before anything is built (collective
    when there is a process group). The manager itself would pause checkpoints to storage
    and train on with RAM snapshots alone, right for storage that fails during a run; at
    the start of one, a run that can never write a checkpoint is a mistake to stop on.
    A worker that torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` > 0) is in the middle
    of its run: it only warns, and the manager's pause applies (it resumes from RAM).
    """
    if cfg.checkpoint is None:
        return
    outcome: list[str | None] = [None]
    if info.rank == 0:
        from moepec.store.storage import Storage

        foreign = foreign_root(cfg.checkpoint.path)
        try:
            Storage(cfg.checkpoint.path, cfg.checkpoint.storage_options).check_writable()
        except (CheckpointError, OSError) as exc:
            outcome = [str(exc)]
        if foreign is not None:
            outcome = [f"!{foreign}"]
    if dist.is_initialized():
        import torch.distributed

        torch.distributed.broadcast_object_list(outcome, src=0)
    problem = outcome[0]
    if problem is None:
        return
    if problem.startswith("!"):
        raise ConfigError(problem[1:])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        if info.rank == 0:
            log.warning("%s; this worker was restarted mid-run, so training goes on and "
                        "checkpoints to storage are paused", problem.rstrip("."))
        return
    raise CheckpointError(f"{problem.rstrip('.')}; nothing was trained")


def foreign_root(path: str) -> str | None:
    """Why the local folder ``path`` is another tool's checkpoint (a run would start
    fresh beside it, since moepec restores only what it wrote), or None: a plain DCP
    checkpoint (``.metadata``: torch, torchtitan), a root of moepec's flat front end
    (the Megatron-Core and DeepSpeed doors), one moepec checkpoint given for its root, a
    DeepSpeed (``latest``) or Hugging Face Trainer (``trainer_state.json``) folder."""
    from moepec.keys import MANIFEST_NAME, parse_checkpoint_name
    from moepec.recovery.offline_paths import RootKind, root_kind

    local = path.removeprefix("file://") if path.startswith("file://") or "://" not in path \
        else None
    if local is None or not os.path.isdir(local):
        return None
    names = set(os.listdir(local))
    parent = os.path.dirname(os.path.abspath(local))
    kind = ("a plain DCP checkpoint (.metadata)" if ".metadata" in names
            else "a root of moepec's flat front end (Megatron-Core, DeepSpeed doors)"
            if root_kind(local) == RootKind.FLAT
            else f"one checkpoint of the moepec root {parent}"
            if MANIFEST_NAME in names and parse_checkpoint_name(os.path.basename(
                os.path.abspath(local))) is not None
            else "a DeepSpeed checkpoint folder (latest)" if "latest" in names
            else "a Hugging Face Trainer checkpoint (trainer_state.json)"
            if "trainer_state.json" in names else None)
    if kind is None:
        return None
    return (f"--ckpt-dir {path} is {kind}: a run there would start at step 0 beside it; "
            f"give the run a folder of its own (or moepec's root, for one checkpoint of it)")


def build_manager(cfg: TrainConfig, model, optimizer, scheduler, loader, ep, *,
                  checkpoints: CheckpointLog | None = None,
                  metrics: MetricsWriter | None = None, hooks: FaultHooks | None = None):
    """The CheckpointManager of ``cfg.checkpoint``, or None when the run has none.

    Called by the trainer's set-up on every rank (the manager's constructor is
    collective). The checkpoint config is used as given, except that its path goes
    through the fault-injecting filesystem when storage faults are planned
    (:func:`moepec.train.fault_setup.ckpt_url`). Started checkpoints go to ``checkpoints``, commits become
    ``commit`` records of ``metrics`` (pass it on rank 0 only: the rank that commits and
    writes metrics), ``hooks`` are the fault injector's.
    """
    if cfg.checkpoint is None:
        return None
    # Imported lazily: checkpointing sits above the trainer's core and is optional.
    from moepec import CheckpointManager

    ckpt_cfg = dataclasses.replace(cfg.checkpoint, path=ckpt_url(cfg))
    ep_kwargs = {"expert_parallel": (ep.rank, ep.size)} if ep.enabled else {}
    return CheckpointManager(model, optimizer, ckpt_cfg,
                             extra_state={"scheduler": scheduler, "data": loader},
                             on_checkpoint=checkpoints.add if checkpoints else None,
                             on_commit=commit_logger(metrics) if metrics else None,
                             hooks=hooks, **ep_kwargs)


def log_plt_outlook(cfg: TrainConfig, n_experts: int) -> None:
    """At start-up (rank 0): log the expected PLT per fault of the chosen K, interval and
    experts (:func:`moepec.policy.plt_forecast.plt_outlook`, the simulator's model), and warn,
    naming a K or interval that fits, when it exceeds the budget."""
    ck = cfg.checkpoint
    if ck is None or n_experts < 2:
        return
    from moepec.policy.plt_forecast import plt_outlook

    faults = max(1.0, cfg.steps / cfg.fault_mtbf) if cfg.fault_mtbf else 1.0
    k = min(ck.k_persist, n_experts)
    o = plt_outlook(n_experts, k, ck.interval, cfg.steps, faults=faults, budget=ck.plt_budget)
    what = (f"expected PLT {100 * o.per_fault:.2f}% per fault"
            + (f", {100 * o.expected:.2f}% over ~{faults:.1f} faults" if faults != 1 else "")
            + f" (K={k} of {n_experts} experts, interval {ck.interval}, {cfg.steps} steps)")
    if not o.over_budget:
        log.info("%s, within the PLT budget %.2f%%", what, 100 * ck.plt_budget)
        return
    if not ck.dynamic_k:
        log.warning("%s exceeds the PLT budget %.2f%%; %s", what, 100 * ck.plt_budget,
                    o.advice())
        return
    # Dynamic K is the mechanism that answers this: information, not a warning.
    fixes = [f"--k {o.k_fit}" if o.k_fit not in (None, k) else "",
             f"--ckpt-interval {o.interval_fit}"
             if o.interval_fit not in (None, ck.interval) else ""]
    start = " or ".join(f for f in fixes if f)
    log.info("%s exceeds the PLT budget %.2f%%; dynamic K is on: K doubles after a "
             "recovery that leaves PLT over the budget%s", what, 100 * ck.plt_budget,
             f" (to be within it from the start: {start})" if start else "")
