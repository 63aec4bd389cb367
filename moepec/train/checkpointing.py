"""What the trainer needs around its loop: metrics, checkpointing and fault injection.

Kept apart from :mod:`moepec.train.trainer` so the loop reads on its own: the manager is built
from the run's config here, commits and recoveries become metrics records here, and a
failed background persist is handled by one documented policy here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from moepec.errors import ConfigError, PersistError
from moepec.events import CheckpointEvent, CommitRecord
from moepec.hooks import FaultHooks
from moepec.keys import parse_checkpoint_name
from moepec.train.config import OnPersistError, TrainConfig

if TYPE_CHECKING:
    from moepec.train.dist import DistInfo

log = logging.getLogger(__name__)


class MetricsWriter:
    """JSON-lines metrics writer; a no-op on ranks other than 0 or without a path."""

    def __init__(self, path: str | None, enabled: bool, append: bool = False) -> None:
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        if path is not None and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # Kept open for the whole run (closed in close()): one line per log step.
            # A checkpointed run appends: a restarted worker continues the same file.
            self._file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        # Also called from the checkpoint persist thread (commit records): one lock.
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class CheckpointLog:
    """The checkpoints the manager started since the trainer last took them: the
    manager's ``on_checkpoint`` callback (training thread), read once per step."""

    def __init__(self) -> None:
        self._started: list[CheckpointEvent] = []

    def add(self, event: CheckpointEvent) -> None:
        self._started.append(event)

    def take(self) -> list[CheckpointEvent]:
        taken, self._started = self._started, []
        return taken


def build_manager(cfg: TrainConfig, model, optimizer, scheduler, loader, ep, *,
                  checkpoints: CheckpointLog | None = None,
                  metrics: MetricsWriter | None = None, hooks: FaultHooks | None = None):
    """The CheckpointManager of ``cfg.checkpoint``, or None when the run has none.

    Called by the trainer's set-up on every rank (the manager's constructor is
    collective). The checkpoint config is used as given, except that its path goes
    through the fault-injecting filesystem when storage faults are planned
    (:func:`ckpt_url`). Started checkpoints go to ``checkpoints``, commits become
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


def commit_logger(metrics: MetricsWriter):
    """The ``on_commit`` callback that writes a ``commit`` record for every checkpoint the
    persist worker commits (it runs on that thread; the writer has a lock)."""
    def on_commit(rec: CommitRecord) -> None:
        metrics.write({"event": "commit", "step": rec.step, "time": time.time(),
                       "checkpoint": rec.name, "bytes": rec.bytes,
                       "bytes_per_rank": list(rec.bytes_per_rank), "seconds": rec.seconds,
                       "k_persist": rec.k_persist, "full": rec.full})

    return on_commit


def checkpoint_record(event: CheckpointEvent) -> dict[str, Any]:
    """The ``checkpoint`` metrics record of a started checkpoint."""
    return {"event": "checkpoint", "step": event.step, "time": time.time(),
            "blocked_s": event.blocked_s, "snapshot_bytes": event.snapshot_bytes,
            "persist": event.persist, "full": event.full, "k_persist": event.k_persist}


def recovery_record(report, manager) -> dict[str, Any]:
    """The ``recovery`` metrics record of a RestoreReport."""
    return {"event": "recovery", "time": time.time(), "step": report.step,
            "checkpoint": report.checkpoint, "tier": report.tier, "plt": report.plt,
            "lost": report.lost_total, "seconds": report.seconds,
            "k_persist": manager.k_persist, "warnings": report.warnings,
            "units_from": report.units_from, "persisted": report.persisted_on_failure}


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
    dyn = "dynamic K is on: K doubles after a recovery over budget; " if ck.dynamic_k else ""
    log.warning("%s exceeds the PLT budget %.2f%%; %s%s", what, 100 * ck.plt_budget, dyn,
                o.advice())


def persist_guard(cfg: TrainConfig, metrics: MetricsWriter, step: int, call, *args) -> None:
    """Run a manager call; a failed background persist is logged and training goes on
    (on_persist_error="continue": snapshots to RAM continue, the next checkpoint retries)."""
    try:
        call(*args)
    except PersistError as exc:
        _persist_failed(cfg, metrics, step, exc)
        log.error("step %d: %s; training continues", step, str(exc).rstrip("."))


def close_manager(cfg: TrainConfig, metrics: MetricsWriter, manager, step: int) -> None:
    """Close the manager at the end of a run (waits for the last persist), with the same
    policy as :func:`persist_guard`: with on_persist_error="stop" a failed last persist
    raises its PersistError (the run fails); with "continue" the run ends normally, with
    one warning naming the newest committed checkpoint (what a restart resumes from)."""
    error: PersistError | None = None
    try:
        manager.close()
    except PersistError as exc:
        _persist_failed(cfg, metrics, step, exc)
        error = exc
    if error is None and not manager.last_persist_failed:
        return
    name = manager.last_committed
    newest = (f"step {parse_checkpoint_name(name).step} ({name})" if name
              else "none: no checkpoint of this run was committed")
    why = str(error).rstrip(".") if error is not None else "its persist failed, see above"
    log.warning("the run ends, but its last checkpoint was not persisted (%s); the newest "
                "committed checkpoint is %s (on_persist_error=continue; with stop this "
                "run would fail)", why, newest)


def _persist_failed(cfg: TrainConfig, metrics: MetricsWriter, step: int,
                    exc: PersistError) -> None:
    """Record a failed persist; re-raise it when the policy is to stop."""
    metrics.write({"event": "persist_error", "step": step, "time": time.time(),
                   "error": str(exc)})
    if cfg.on_persist_error == OnPersistError.STOP:
        raise exc


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

