"""``moepec demo``: a short CPU training run of the ``small`` model with a summary.

Kept as a function so the command line, notebooks and tests share it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from moepec.train import TrainConfig, TrainResult, train

__all__ = ["format_summary", "run_demo"]

log = logging.getLogger(__name__)


def run_demo(out_dir: str | Path = "demo-out", *, steps: int = 400, batch_size: int = 16,
             seed: int = 0, threads: int | None = None, progress: bool = True,
             config: str = "small") -> TrainResult:
    """Train ``config`` for ``steps`` steps, write metrics and summary to ``out_dir``.

    With the defaults this takes about 30-60 s on 2 CPU cores. Blocks; prints nothing
    (use :func:`format_summary`); raises like :func:`moepec.train.train`.
    """
    cfg = TrainConfig(config=config, steps=steps, batch_size=batch_size, seed=seed,
                      threads=threads, progress=progress, out_dir=str(out_dir),
                      eval_interval=max(1, steps // 4))
    log.info("demo: training %s for %d steps; outputs in %s", config, steps, out_dir)
    return train(cfg)


def format_summary(result: TrainResult) -> str:
    """A short human-readable table of a run's results."""
    rows = [
        ("steps", f"{result.steps}"),
        ("ranks", f"{result.world_size}"),
        ("tokens", f"{result.tokens:,}"),
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("wall time", f"{result.wall_time_s:.1f} s"),
        ("first train loss", f"{result.losses[0]:.4f}" if result.losses else "-"),
        ("last train loss", f"{result.losses[-1]:.4f}" if result.losses else "-"),
        ("val loss", f"{result.val_loss:.4f}" if result.val_loss is not None else "-"),
        ("dropped assignments", f"{result.dropped:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
