"""What the trainer's loops share around a step: the training timer, the result's
bookkeeping, evaluation when due and the metrics line (the plain loop in
:mod:`moepec.train.trainer`, the replica-group loop in :mod:`moepec.train.replicas`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moepec.train.config import TrainConfig, TrainResult
from moepec.train.metrics import MetricsWriter, stop_record
from moepec.train.setup import Run
from moepec.train.steps import StepResult, evaluate

__all__ = ["Timer", "evaluate_if_due", "log_step", "planned_stop", "record_step"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Timer:
    """Training seconds (evaluation excluded): of the whole call, and of the window
    since the last metrics line, whose throughput that line reports."""

    total: float = 0.0
    window: float = 0.0
    window_steps: int = 0

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.window += seconds
        self.window_steps += 1

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step * self.window_steps / max(self.window, 1e-9)

    def new_window(self) -> None:
        self.window, self.window_steps = 0.0, 0


def record_step(result: TrainResult, step: int, out: StepResult, tokens: int) -> None:
    result.losses.append(out.loss)
    result.steps += 1
    result.final_step = step
    result.tokens += tokens
    result.dropped += out.dropped


def evaluate_if_due(cfg: TrainConfig, run: Run, result: TrainResult, step: int,
                     is_main: bool) -> float | None:
    """The validation loss at evaluation steps (and the last), else None. Collective."""
    last = step == cfg.steps - 1
    if not run.val or not (last or (cfg.eval_interval and (step + 1) % cfg.eval_interval == 0)):
        return None
    val_loss = evaluate(run.model, run.val, device=run.device)
    if val_loss is not None:
        result.val_history.append((step, val_loss))
        if is_main:
            log.info("step %d: val loss %.4f", step, val_loss)
    return val_loss


def log_step(metrics: MetricsWriter, step: int, out: StepResult, lr: float, tok_s: float,
              grad_norm: float, val_loss: float | None, to_log: bool) -> None:
    """A metrics line for ``step`` (rank 0's writer; a no-op elsewhere), and a log line
    when no progress bar shows the numbers."""
    record = {"step": step, "loss": out.loss, "aux_loss": out.aux_loss, "lr": lr,
              "tokens_per_s": tok_s, "dropped": out.dropped, "grad_norm": grad_norm}
    if val_loss is not None:
        record["val_loss"] = val_loss
    metrics.write(record)
    if to_log:
        log.info("step %d: loss %.4f lr %.2e %.0f tok/s dropped %d",
                 step, out.loss, lr, tok_s, out.dropped)


def planned_stop(run: Run, result: TrainResult, step: int, metrics: MetricsWriter) -> bool:
    """Whether a planned stop (a preemption signal, Ctrl-C) ends the run after ``step``:
    every rank (of the replica group, in a replica-group run) agrees, and the manager has
    written a complete checkpoint there (its record becomes ``result.stopped`` and a
    ``stop`` metrics record). Collective: every rank, every step (every committed step of
    a replica group), last in the step (after evaluation, so nothing of it is redone)."""
    if not run.manager.should_stop(step):
        return False
    result.stopped = stop_record(run.manager.stopped)
    metrics.write(result.stopped)
    return True
