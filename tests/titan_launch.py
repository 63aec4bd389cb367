"""Entry point of the torchtitan test runs (tests/test_torchtitan.py): the CPU shims, test
hooks, then torchtitan's own ``main()``.

Hooks, by environment variable (test-only; they wrap torchtitan's Trainer, not moepec):
- ``TITAN_DUMP=DIR``: after each step that saves a checkpoint, rank 0 writes the whole
  training state (full tensors: model, Adam state, train step) to ``DIR/step-S.pt``, and
  after a restore to ``DIR/restored.pt`` (plus the restore's expert sources as JSON); each
  rank writes its data-loader position as JSON beside it.
- ``TITAN_KILL_AT=S``: at the start of step S, wait for the checkpoint being written, then
  SIGKILL every rank (a crash between checkpoints).
- ``TITAN_BENCH=FILE`` (``moepec bench torchtitan``): rank 0 records the seconds the training
  loop spends in the checkpointer's ``save`` and ``maybe_wait_for_staging`` at each step
  and the step times, as JSON in FILE when the trainer closes.
"""

import json
import os
import signal
import time

import titan_shims  # noqa: F401  (before torchtitan builds anything)
import torch
import torch.distributed as dist
from torchtitan.train import main
from torchtitan.trainer import Trainer

DUMP = os.environ.get("TITAN_DUMP")
BENCH = os.environ.get("TITAN_BENCH")
_timings: dict[str, list] = {"save_s": [], "staging_s": [], "step_s": [], "last": []}
KILL_AT = int(os.environ.get("TITAN_KILL_AT", "0"))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def dump_state(trainer: Trainer, name: str) -> None:
    """Every rank calls it (full_tensor() is collective); rank 0 writes."""
    model = trainer.model_parts[0]
    opt = trainer.optimizers.optimizers[0]
    state = {}
    for n, p in model.named_parameters():  # the same order on every rank (collectives)
        state[f"model/{n}"] = _full(p)
        for k, v in sorted(opt.state.get(p, {}).items()):
            if torch.is_tensor(v):
                state[f"optim/{n}/{k}"] = _full(v)
    state["train_state/step"] = torch.tensor(trainer.step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    loader = trainer.checkpointer.loader_state
    with open(os.path.join(DUMP, f"{name}-loader-{rank}.json"), "w") as f:
        json.dump(loader.position(), f, default=repr)
    if rank == 0:
        torch.save(state, os.path.join(DUMP, f"{name}.pt"))
        if name == "restored":
            report = trainer.checkpointer.report
            with open(os.path.join(DUMP, "sources.json"), "w") as f:
                json.dump({"sources": report.sources, "plt": report.plt,
                           "lost": report.lost_total}, f)


_train_step = Trainer.train_step
_train = Trainer.train


def _timed(fn, bucket: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _timings[bucket].append(time.perf_counter() - t0)
        if bucket == "save_s":
            _timings["last"].append(bool(kwargs.get("last_step")))
        return out
    return wrapper


def train_step(self, data_iterator):
    if KILL_AT and self.step == KILL_AT:
        self.checkpointer.manager.wait_for_persist()
        os.kill(os.getpid(), signal.SIGKILL)
    _train_step(self, data_iterator)
    cfg = self.config.checkpoint
    if DUMP and (self.step % cfg.interval == 0 or self.step == self.config.training.steps):
        dump_state(self, f"step-{self.step}")


def train(self):
    load = self.checkpointer.load

    def load_and_dump(step=-1):
        restored = load(step)
        if DUMP and restored:
            dump_state(self, "restored")
        return restored

    self.checkpointer.load = load_and_dump
    if BENCH:
        self.checkpointer.save = _timed(self.checkpointer.save, "save_s")
        self.checkpointer.maybe_wait_for_staging = _timed(
            self.checkpointer.maybe_wait_for_staging, "staging_s")
        self.train_step = _timed(self.train_step, "step_s")
    _train(self)
    if BENCH:
        self.checkpointer.maybe_wait_for_saving()  # the last write, before the sizes are read
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(BENCH, "w") as f:
                json.dump(_timings, f)


Trainer.train_step = train_step
Trainer.train = train

if __name__ == "__main__":
    main()
