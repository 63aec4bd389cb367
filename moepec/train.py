"""The trainer: data- and expert-parallel GPT-MoE training, one process or under torchrun.

``train(TrainConfig(...)) -> TrainResult`` is the Python API; ``moepec train`` wraps it.
Data parallelism is explicit: every rank holds the whole model (same seed, same init,
checked), reads a disjoint shard of every global batch, and gradients are averaged with
:func:`moepec.dist.average_gradients` (one all_reduce over a flat buffer, not DDP).
With ``ep`` > 1 (expert parallelism, :mod:`moepec.parallel`) each rank holds only its
EP group's share of the experts, tokens reach their experts by all-to-all, and expert
gradients are combined over the expert's replicas
(:func:`moepec.dist.average_gradients_ep`); the run computes what the ep=1 run would.
The per-step functions live in :mod:`moepec.steps`; ``TrainConfig`` and ``TrainResult``
in :mod:`moepec.train_config` (both importable from here).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from moepec import dist
from moepec.data import TokenLoader, eval_batches, load_corpus
from moepec.errors import ConfigError, DataError
from moepec.models import GPTMoE
from moepec.parallel import init_expert_parallel
from moepec.run_support import (
    MetricsWriter,
    build_injector,
    build_manager,
    log_commits,
    persist_guard,
    recovery_record,
)

# Re-exported so `from moepec.train import train_step` (tests, notebooks) keeps working.
from moepec.steps import (  # noqa: F401
    StepResult,
    build_optimizer,
    build_scheduler,
    evaluate,
    forward_backward,
    optimizer_step,
    param_digest,
    train_step,
)
from moepec.train_config import TrainConfig, TrainResult

__all__ = ["StepResult", "TrainConfig", "TrainResult", "build_optimizer", "build_scheduler",
           "evaluate", "forward_backward", "optimizer_step", "param_digest", "train",
           "train_step"]

log = logging.getLogger(__name__)

def _device(cfg: TrainConfig, info: dist.DistInfo) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but CUDA is not available; use --device cpu")
    return torch.device("cuda", info.local_rank)


@dataclass(slots=True)
class _Run:
    """The live objects of one training run (built once, reused across restarts)."""

    model: GPTMoE
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: TokenLoader
    val: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    manager: Any  # CheckpointManager or None
    tokens_per_step: int
    injector: Any = None  # moepec.faults.FaultInjector or None


def _setup(cfg: TrainConfig, info: dist.DistInfo) -> _Run:
    model_cfg = cfg.model_config()
    if cfg.batch_size % info.world_size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by {info.world_size} ranks; "
            "use a multiple of the number of ranks"
        )
    if info.world_size % cfg.ep:
        raise ConfigError(
            f"ep={cfg.ep} does not divide the {info.world_size} rank(s); use an --ep that "
            "divides the number of ranks (torchrun --nproc_per_node)"
        )
    device = _device(cfg, info)
    corpus = load_corpus(cfg.data)
    loader = TokenLoader(corpus.train, model_cfg.seq_len, cfg.batch_size, cfg.seed,
                         rank=info.rank, world_size=info.world_size)
    val = eval_batches(corpus.val, model_cfg.seq_len, cfg.batch_size, cfg.eval_batches,
                       rank=info.rank, world_size=info.world_size)
    if cfg.eval_batches and not val and info.rank == 0:
        log.warning("validation split (%d tokens) is shorter than one sequence; "
                    "no validation loss", len(corpus.val))
    # Collective: every rank creates every EP group (a no-op for ep=1).
    ep = init_expert_parallel(cfg.ep, cfg.dist_timeout_s)
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
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    manager = build_manager(cfg, model, optimizer, scheduler, loader, ep)
    if info.rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("training %s (%.2fM params on rank 0) on %d rank(s), ep %d, %s, %d steps, "
                 "global batch %d x %d tokens", cfg.config, n_params / 1e6, info.world_size,
                 ep.size, device, cfg.steps, cfg.batch_size, model_cfg.seq_len)
    return _Run(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, val=val,
                device=device, manager=manager,
                tokens_per_step=cfg.batch_size * model_cfg.seq_len,
                injector=build_injector(cfg, info))


def _loop(cfg: TrainConfig, run: _Run, result: TrainResult, metrics: MetricsWriter,
          is_main: bool) -> float:
    """Restore (when checkpointing) and train up to cfg.steps; returns training seconds.

    The shape of this loop is the checkpoint manager's contract (module docstring).
    """
    model, optimizer, scheduler, manager = run.model, run.optimizer, run.scheduler, run.manager
    injector = run.injector
    if manager is not None and is_main:
        log_commits(manager, metrics)
    start = manager.restore() if manager else None  # RestoreReport or None; .step
    first = start.step + 1 if start else 0
    if start is not None:
        result.resumed_from = start.step
        record = recovery_record(start, manager)
        result.recoveries.append(record)
        metrics.write(record)
        if is_main:
            log.info("resumed from the checkpoint of step %d (%s, %.2fs); PLT %.3f%%, "
                     "K_persist %d", start.step, start.tier, start.seconds, 100 * start.plt,
                     manager.k_persist)
    # disable=None: tqdm shows the bar only on a terminal; in log files the per-interval
    # log lines below take its place.
    bar = tqdm(total=cfg.steps, initial=first, disable=None if cfg.progress and is_main else True,
               unit="step", dynamic_ncols=True)
    train_time = window_time = 0.0
    window_steps = 0
    try:
        for step in range(first, cfg.steps):
            t0 = time.perf_counter()
            if injector is not None:
                injector.before_step(step)
            x, y = run.loader.next_batch()  # the batch of `step`: loader state matches step
            x, y = x.to(run.device), y.to(run.device)
            lr = optimizer.param_groups[0]["lr"]
            out = forward_backward(model, x, y)
            if injector is not None:
                injector.after_backward(step)
            if manager:
                persist_guard(cfg, metrics, step, manager.wait_for_snapshot)
            grad_norm = optimizer_step(model, optimizer, scheduler, cfg.grad_clip)
            if manager:
                manager.observe_routing([s.assigned for s in out.routing])
                n_events = len(manager.events)
                persist_guard(cfg, metrics, step, manager.step, step)
                if len(manager.events) > n_events:
                    ev = manager.events[-1]
                    metrics.write({"event": "checkpoint", "step": step, "time": time.time(),
                                   "blocked_s": ev["blocked_step_s"],
                                   "snapshot_bytes": ev["snapshot_bytes"],
                                   "persist": ev["persist"], "full": ev["full"],
                                   "k_persist": manager.k_persist})
            dt = time.perf_counter() - t0
            train_time += dt
            window_time += dt
            window_steps += 1

            result.losses.append(out.loss)
            result.steps += 1
            result.final_step = step
            result.tokens += run.tokens_per_step
            result.dropped += out.dropped
            last = step == cfg.steps - 1
            val_loss = None
            if run.val and (last or (cfg.eval_interval and (step + 1) % cfg.eval_interval == 0)):
                val_loss = evaluate(model, run.val, device=run.device)
                if val_loss is not None:
                    result.val_history.append((step, val_loss))
                    if is_main:
                        log.info("step %d: val loss %.4f", step, val_loss)
            tok_s = run.tokens_per_step * window_steps / max(window_time, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{out.loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            if step == first or last or val_loss is not None or (step + 1) % cfg.log_interval == 0:
                record = {"step": step, "loss": out.loss, "aux_loss": out.aux_loss, "lr": lr,
                          "tokens_per_s": tok_s, "dropped": out.dropped, "grad_norm": grad_norm}
                if val_loss is not None:
                    record["val_loss"] = val_loss
                metrics.write(record)
                if is_main and bar.disable:  # otherwise the bar shows it
                    log.info("step %d: loss %.4f lr %.2e %.0f tok/s dropped %d",
                             step, out.loss, lr, tok_s, out.dropped)
                window_time, window_steps = 0.0, 0
    finally:
        bar.close()
    return train_time


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
    injected on all ranks at the same step.
    """
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    info = dist.init_from_env(cfg.dist_timeout_s)
    is_main = info.rank == 0
    out_dir = Path(cfg.out_dir) if cfg.out_dir else None
    jsonl = cfg.log_jsonl or (str(out_dir / "metrics.jsonl") if out_dir else None)
    metrics = MetricsWriter(jsonl, enabled=is_main, append=cfg.ckpt_dir is not None)
    run: _Run | None = None
    try:
        run = _setup(cfg, info)
        # What exists now (torch's modules, the model, the data) lives for the whole run.
        # Freezing it leaves each full collection of the cyclic GC only what the run
        # allocates later; such a pause stops every thread, the training loop too
        # (measured: gen-2 pauses of 90-170 ms -> 15-35 ms beside checkpoint persists).
        gc.collect()
        gc.freeze()
        result = TrainResult(steps=0, final_step=-1, world_size=info.world_size,
                             ep_size=cfg.ep)
        train_time = 0.0
        for attempt in range(cfg.restarts + 1):
            try:
                train_time += _loop(cfg, run, result, metrics, is_main)
                break
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
        if run.manager:
            run.manager.close()  # waits for the last persist; raises its error
            run.manager = None
        result.val_loss = result.val_history[-1][1] if result.val_history else None
        result.data_state = dict(run.loader.state_dict())
        result.tokens_per_s = result.tokens / train_time if train_time > 0 else 0.0
        result.wall_time_s = time.perf_counter() - t_start
        if cfg.return_state:
            result.model_state = {k: v.detach().cpu().clone()
                                  for k, v in run.model.state_dict().items()}
        if out_dir is not None and is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "summary.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
        return result
    finally:
        if run is not None and run.manager:
            try:  # stop its background work, but keep the error that got us here
                run.manager.close()
            except Exception:
                log.exception("checkpoint manager failed to close after an error")
        gc.unfreeze()
        metrics.close()
        if info.initialized_here:
            dist.destroy()
        # The thread count is process-wide: give the caller (e.g. a test session) its own back.
        torch.set_num_threads(threads_before)
