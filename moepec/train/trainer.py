"""The trainer: data- and expert-parallel GPT-MoE training, one process or under torchrun.

``train(TrainConfig(...)) -> TrainResult`` is the Python API; ``moepec train`` wraps it.
Data parallelism is explicit: every rank holds the whole model (same seed, same init,
checked), reads a disjoint shard of every global batch, and gradients are averaged with
:func:`moepec.train.dist.average_gradients` (one all_reduce over a flat buffer, not DDP).
With ``ep`` > 1 (expert parallelism, :mod:`moepec.models.parallel`) each rank holds only its
EP group's share of the experts, tokens reach their experts by all-to-all, and expert
gradients are combined over the expert's replicas
(:func:`moepec.train.dist.average_gradients_ep`); the run computes what the ep=1 run would.
The per-step functions live in :mod:`moepec.train.steps`, the set-up of a run in
:mod:`moepec.train.setup`; ``TrainConfig`` and ``TrainResult`` in :mod:`moepec.train.config`
(both importable from here).

The loop has the shape the checkpoint manager expects (DESIGN.md "Public API contract"):
the batch for ``step`` is taken at the top of the iteration, so the loader state saved
with step s resumes at s + 1; ``manager.wait_for_snapshot()`` runs after backward and
before ``optimizer.step()`` mutates the weights.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moepec.errors import ConfigError, DataError
from moepec.keys import parse_checkpoint_name
from moepec.train import dist
from moepec.train.config import TrainConfig, TrainResult
from moepec.train.loop_parts import Timer, evaluate_if_due, log_step, planned_stop, record_step
from moepec.train.metrics import MetricsWriter, checkpoint_record, recovery_record
from moepec.train.setup import Run, setup

# Re-exported so `from moepec.train.trainer import train_step` (tests, notebooks) keeps working.
from moepec.train.steps import (  # noqa: F401
    StepResult,
    build_optimizer,
    build_scheduler,
    evaluate,
    forward_backward,
    optimizer_step,
    param_digest,
    train_step,
)

__all__ = ["StepResult", "TrainConfig", "TrainResult", "TrainingInterrupted", "build_optimizer",
           "build_scheduler", "evaluate", "forward_backward", "optimizer_step", "param_digest",
           "train", "train_step"]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- the loop


def _resume(run: Run, result: TrainResult, metrics: MetricsWriter, is_main: bool) -> int:
    """Restore the newest checkpoint when there is one; returns the first step to train.

    Collective (the manager's restore meets all ranks).
    """
    manager = run.manager
    if manager is None:
        return 0
    start = manager.restore()  # RestoreReport or None; .step
    if start is None:
        return 0
    result.resumed_from = start.step
    record = recovery_record(start, manager)
    result.recoveries.append(record)
    metrics.write(record)
    if is_main:
        log.info("resumed from the checkpoint of step %d (%s, %.2fs); PLT %.3f%%, "
                 "K_persist %d", start.step, start.tier, start.seconds, 100 * start.plt,
                 manager.k_persist)
    return start.step + 1


def _train_one_step(cfg: TrainConfig, run: Run, step: int,
                    metrics: MetricsWriter) -> tuple[StepResult, float, float]:
    """One optimizer step with its fault hooks and checkpoint calls; returns the step's
    result, its learning rate and the gradient norm. Collective (all ranks, in order).

    The order is the checkpoint manager's contract (module docstring).
    """
    injector, manager = run.injector, run.manager
    if injector is not None:
        injector.before_step(step)
    x, y = run.loader.next_batch()  # the batch of `step`: loader state matches step
    x, y = x.to(run.device), y.to(run.device)
    lr = run.optimizer.param_groups[0]["lr"]
    out = forward_backward(run.model, x, y)
    if injector is not None:
        injector.after_backward(step)
    if manager:
        run.persist.call(step, manager.wait_for_snapshot)
    grad_norm = optimizer_step(run.model, run.optimizer, run.scheduler, cfg.grad_clip)
    if manager:
        _checkpoint(cfg, run, step, out, metrics)
    return out, lr, grad_norm


def _checkpoint(cfg: TrainConfig, run: Run, step: int, out: StepResult,
                metrics: MetricsWriter) -> None:
    """Hand the step's routing to the manager and let it checkpoint when due; a started
    checkpoint (the manager's CheckpointEvent) becomes a ``checkpoint`` metrics record."""
    manager = run.manager
    manager.observe_routing([s.assigned for s in out.routing])
    run.persist.call(step, manager.step, step)
    for event in run.checkpoints.take():
        metrics.write(checkpoint_record(event))


def _loop(cfg: TrainConfig, run: Run, result: TrainResult, metrics: MetricsWriter,
          is_main: bool) -> float:
    """Restore (when checkpointing) and train up to cfg.steps; returns training seconds.

    Called by :func:`train` on every rank (collective), once per attempt.
    """
    first = _resume(run, result, metrics, is_main)
    # disable=None: tqdm shows the bar only on a terminal; in log files the per-interval
    # log lines take its place.
    bar = tqdm(total=cfg.steps, initial=first, disable=None if cfg.progress and is_main else True,
               unit="step", dynamic_ncols=True)
    timer = Timer()
    try:
        for step in range(first, cfg.steps):
            t0 = time.perf_counter()
            out, lr, grad_norm = _train_one_step(cfg, run, step, metrics)
            timer.add(time.perf_counter() - t0)
            record_step(result, step, out, run.tokens_per_step)
            val_loss = evaluate_if_due(cfg, run, result, step, is_main)
            tok_s = timer.tokens_per_s(run.tokens_per_step)
            bar.update(1)
            bar.set_postfix(loss=f"{out.loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            last = step == cfg.steps - 1
            if step == first or last or val_loss is not None or (step + 1) % cfg.log_interval == 0:
                log_step(metrics, step, out, lr, tok_s, grad_norm, val_loss,
                          to_log=is_main and bar.disable)  # otherwise the bar shows it
                timer.new_window()
            if run.manager and planned_stop(run, result, step, metrics):
                break
    finally:
        bar.close()
    return timer.total


# --------------------------------------------------------------------------------- train


def _train_with_restarts(cfg: TrainConfig, run: Run, result: TrainResult,
                         metrics: MetricsWriter, is_main: bool) -> float:
    """Run the loop, and after a failed step resume it from the last checkpoint up to
    ``cfg.restarts`` times; returns the training seconds of the attempt that finished
    (a failed attempt's seconds are not counted). Collective, like the loop."""
    for attempt in range(cfg.restarts + 1):
        try:
            return _loop(cfg, run, result, metrics, is_main)
        except (ConfigError, DataError):
            raise  # a user mistake: retrying cannot help
        except Exception as exc:
            if attempt == cfg.restarts:
                raise
            # An injected fault is expected: one line; anything else: the traceback.
            (log.warning if type(exc).__name__ == "InjectedFault" else log.exception)(
                "step failed (%s); restart %d of %d from the last checkpoint", exc,
                attempt + 1, cfg.restarts)
            run.optimizer.zero_grad(set_to_none=True)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _finish(cfg: TrainConfig, run: Run, result: TrainResult, train_time: float,
            t_start: float) -> None:
    """Fill in the end-of-run fields of ``result`` (after the manager closed)."""
    result.val_loss = result.val_history[-1][1] if result.val_history else None
    result.data_state = dict(run.loader.state_dict())
    result.tokens_per_s = result.tokens / train_time if train_time > 0 else 0.0
    result.wall_time_s = time.perf_counter() - t_start
    if cfg.return_state:
        # DTensors (--fsdp) are all-gathered (collective: every rank runs _finish).
        result.model_state = {k: getattr(v, "full_tensor", v.detach)().detach().cpu().clone()
                              for k, v in run.model.state_dict().items()}


def _metrics_path(cfg: TrainConfig) -> str | None:
    if cfg.log_jsonl:
        return cfg.log_jsonl
    return str(Path(cfg.out_dir) / "metrics.jsonl") if cfg.out_dir else None


def _write_summary(out_dir: Path, result: TrainResult) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(result.summary(), indent=2) + "\n")


def _close_quietly(manager) -> None:
    """Stop the manager's background work after an error, keeping that error."""
    try:
        manager.close()
    except Exception:
        log.exception("checkpoint manager failed to close after an error")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped :func:`train`. The checkpoint manager was closed first (its
    persist in flight finished); the message says at which step, and what a rerun of the
    same command resumes from."""


def _interrupted(cfg: TrainConfig, run: Run | None, result: TrainResult,
                 is_main: bool) -> TrainingInterrupted:
    """Close the manager after Ctrl-C and say, in one line (rank 0 logs it), where the run
    stopped and what a rerun resumes from; returns the exception to raise."""
    if run is None:
        message = ("interrupted during set-up, before a step was trained; rerun the same "
                   "command to start")
    else:
        if result.final_step >= 0:
            step = result.final_step + 1  # the step in progress
        else:
            step = 0 if result.resumed_from is None else result.resumed_from + 1
        manager, run.manager = run.manager, None
        if manager is not None:
            try:
                manager.close()  # waits for the persist in flight
            except Exception as exc:  # noqa: BLE001 - said in one line: the user stopped it
                log.warning("the checkpoint manager did not close cleanly after Ctrl-C: %s",
                            exc)
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, still one line
                log.warning("second Ctrl-C: not waiting for the checkpoint in flight")
        name = manager.last_committed if manager is not None else None
        parsed = parse_checkpoint_name(name) if name else None
        if cfg.checkpoint is None:
            then = "this run keeps no checkpoints (no --ckpt-dir): a rerun starts at step 0"
        elif name is None:
            then = ("no checkpoint was committed yet: rerunning the same command starts at "
                    "step 0")
        else:
            newest = f"step {parsed.step} ({name})" if parsed is not None else name
            then = (f"the newest committed checkpoint is {newest}; rerun the same command "
                    "to resume")
        message = f"interrupted at step {step}; {then}"
    if is_main:
        log.warning("%s", message)
    return TrainingInterrupted(message)


def train(cfg: TrainConfig) -> TrainResult:
    """Train as ``cfg`` says; every rank of a torchrun job calls this.

    Uses ``cfg.threads`` torch threads for the run and restores the previous count at
    the end. Joins the torchrun process group if the environment describes one (and leaves it
    at the end); reuses a group that already exists. Blocks until the run ends. Only
    rank 0 logs, shows progress and writes the metrics and summary files. Raises
    ConfigError/DataError for bad settings or data and DistributedError when ranks fail
    to meet or disagree. Any other error of a step is retried ``cfg.restarts`` times:
    the same model, optimizer and loader are restored from the latest checkpoint (the
    manager's RAM copy when it has one) and training continues; after that it is
    re-raised. Restarts are in-process, meant for single-process runs and faults
    injected on all ranks at the same step. A checkpoint root that cannot be written when
    the run starts raises CheckpointError before anything is built. Ctrl-C closes the
    manager and raises :class:`TrainingInterrupted` (a KeyboardInterrupt) saying where the
    run stopped and what a rerun resumes from.
    """
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    if cfg.ft is not None:
        from moepec.train.replicas import for_group

        cfg = for_group(cfg)  # this group's own out_dir, metrics and checkpoint root
    info = dist.init_from_env(cfg.dist_timeout_s)
    is_main = info.rank == 0
    # A checkpointed run appends: a restarted worker continues the same metrics file.
    metrics = MetricsWriter(_metrics_path(cfg), enabled=is_main,
                            append=cfg.checkpoint is not None)
    run: Run | None = None
    result = TrainResult(steps=0, final_step=-1, world_size=info.world_size, ep_size=cfg.ep)
    try:
        run = setup(cfg, info, metrics)
        # What exists now (torch's modules, the model, the data) lives for the whole run.
        # Freezing it leaves each full collection of the cyclic GC only what the run
        # allocates later; such a pause stops every thread, the training loop too
        # (measured: gen-2 pauses of 90-170 ms -> 15-35 ms beside checkpoint persists).
        gc.collect()
        gc.freeze()
        if cfg.ft is not None:
            from moepec.train.replicas import ft_loop

            train_time = ft_loop(cfg, run, result, metrics, is_main)
        else:
            train_time = _train_with_restarts(cfg, run, result, metrics, is_main)
        if run.manager:
            # waits for the last persist; its error is handled per on_persist_error
            run.persist.close(run.manager, result.final_step)
            run.manager = None
        _finish(cfg, run, result, train_time, t_start)
        if cfg.out_dir and is_main:
            _write_summary(Path(cfg.out_dir), result)
        return result
    except KeyboardInterrupt:
        raise _interrupted(cfg, run, result, is_main) from None
    finally:
        if run is not None and run.manager:
            _close_quietly(run.manager)
        gc.unfreeze()
        metrics.close()
        if info.initialized_here:
            # What the run built (FSDP state, device meshes, pending work handles) sits in
            # reference cycles that gc.freeze kept: freed now, while the process groups
            # they hold still exist, instead of during interpreter exit.
            run = None
            gc.collect()
            dist.destroy()
        # The thread count is process-wide: give the caller (e.g. a test session) its own back.
        torch.set_num_threads(threads_before)
