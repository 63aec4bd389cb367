"""Partial-experts checkpoints for a Hugging Face ``transformers.Trainer``, with exact resume.

Use :class:`MoepecTrainer` in place of ``Trainer`` (same arguments, plus
``moepec_config``)::

    trainer = MoepecTrainer(model=model, args=args, train_dataset=data,
                            moepec_config=moepec.CheckpointConfig(path="ckpt", interval=50))
    trainer.train()          # the same command after a crash resumes where it stopped

Two parts:

- :class:`MoepecCallback` (a ``TrainerCallback``) builds the :class:`CheckpointManager` at
  ``on_train_begin`` (model, optimizer, LR scheduler and the Trainer's step as extra
  state), restores the newest view there, waits for the snapshot in
  ``on_pre_optimizer_step`` (before weights change), feeds routing counts, checkpoints
  and asks :meth:`CheckpointManager.should_stop` in ``on_step_end`` (a preemption signal
  ends training after a step all ranks agree on, with a complete checkpoint there), and
  closes the manager in ``on_train_end``: the Trainer's final step (``max_steps``) gets a
  complete checkpoint, every expert, so rerunning or extending the run loses nothing.
- :class:`MoepecTrainer` adds what the callback API cannot express: the Trainer decides
  which batches to skip on a resume *before* any callback runs, and only from its own
  checkpoint folder (``resume_from_checkpoint``), so a callback cannot move the data
  position. The subclass resumes its epoch loop at the restored step (``_run_epoch``,
  with the Trainer's own skip-batches logic) and re-applies the restored RNG state where
  the Trainer would re-load it (``_load_rng_state``). It also reads the router logits the
  model returns (``output_router_logits=True``) in ``compute_loss`` to count tokens per
  expert (``load_aware`` selection and the lost-token accounting need them).

The overridden methods are the Trainer's private API of the pinned transformers version
(``moepec[hf]``); a version without them raises ConfigError at construction.

Runs on every rank under ``torchrun``/``accelerate launch`` (the manager takes the process
group the Trainer set up). Tested on one CPU process (tests/test_hf.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from moepec import CheckpointConfig, CheckpointManager, ExpertSpec, RestoreReport
from moepec.errors import ConfigError
from moepec.state.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

RESTORED = "moepec://restored"
"""Stands for ``resume_from_checkpoint`` inside the Trainer's loop after a moepec restore."""

_TRAINER_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen")


class TrainerStateView:
    """The Trainer's step, epoch and counters as ``extra_state`` (state_dict/load_state_dict)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self.state, k) for k in _TRAINER_FIELDS}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        for k in _TRAINER_FIELDS:
            if k in saved:
                setattr(self.state, k, saved[k])


class MoepecCallback(TrainerCallback):
    """Checkpoints a Trainer's run with PEC (see the module docstring for the hooks).

    Alone (``Trainer(callbacks=[MoepecCallback(cfg)])``) it checkpoints and restores model,
    optimizer, scheduler, RNG and ``state.global_step``, but the Trainer then replays the
    data from the start of the epoch; :class:`MoepecTrainer` also resumes the data.
    """

    def __init__(self, config: CheckpointConfig, *, expert_spec: ExpertSpec | None = None,
                 extra_state: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.expert_spec = expert_spec
        self.extra_state = dict(extra_state or {})
        self.manager: CheckpointManager | None = None
        self.report: RestoreReport | None = None
        self.resumed_global_step: int | None = None
        """The Trainer's global step restored at train begin (None: a fresh start)."""
        self.restored_rng: dict | None = None
        self._counts: list[torch.Tensor] | None = None
        self._warned = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        extra = {"trainer_state": TrainerStateView(state), **self.extra_state}
        if lr_scheduler is not None:  # accelerate wraps both; moepec wants the torch objects
            extra["lr_scheduler"] = getattr(lr_scheduler, "scheduler", lr_scheduler)
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self.manager = CheckpointManager(model, optimizer, self.config, extra_state=extra,
                                         expert_spec=self.expert_spec)
        self.report = self.manager.restore()
        if self.report is not None:
            self.resumed_global_step = state.global_step
            self.restored_rng = rng_state()
            log.info("moepec: resumed at global step %d (checkpoint of step %d, PLT %.4f%%)",
                     state.global_step, self.report.step, 100 * self.report.plt)
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.wait_for_snapshot()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.manager is None:
            return control
        if self._counts is not None:
            self.manager.observe_routing(self._counts)
            self._counts = None
        # moepec labels a checkpoint with the 0-based index of the optimizer step it follows
        self.manager.step(state.global_step - 1)
        # A preemption signal (CheckpointConfig.stop_signals) on any rank: all ranks stop
        # after the same step, its complete checkpoint committed; the Trainer ends there.
        if self.manager.should_stop(state.global_step - 1):
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        # The Trainer's last step (max_steps, or a planned stop): close() writes the
        # complete checkpoint there (every expert), so the next run loses nothing.
        if self.manager is not None:
            self.manager.close()
        return control

    def observe_router_logits(self, router_logits: Sequence[torch.Tensor], top_k: int) -> None:
        """Count the tokens each expert got from one micro-batch's router logits (one
        ``[tokens, E]`` tensor per MoE layer); summed until the optimizer step."""
        if self.manager is None or not router_logits:
            return
        n_experts = self.manager.n_experts
        if len(router_logits) != len(n_experts) or any(
                lg.shape[-1] != n for lg, n in zip(router_logits, n_experts)):
            if not self._warned:
                log.warning("moepec: the model's router logits (%d layers) do not match the "
                            "experts found (%s); routing counts are not fed",
                            len(router_logits), n_experts)
                self._warned = True
            return
        counts = [torch.bincount(lg.detach().reshape(-1, lg.shape[-1]).topk(top_k).indices
                                 .reshape(-1).cpu(), minlength=n)
                  for lg, n in zip(router_logits, n_experts)]
        if self._counts is None:
            self._counts = counts
        else:
            self._counts = [a + b for a, b in zip(self._counts, counts)]


class MoepecTrainer(Trainer):
    """``transformers.Trainer`` with PEC checkpoints and exact resume (module docstring)."""

    def __init__(self, *args: Any, moepec_config: CheckpointConfig,
                 expert_spec: ExpertSpec | None = None,
                 extra_state: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        for name in ("_run_epoch", "_load_rng_state", "compute_loss"):
            if not hasattr(Trainer, name):
                raise ConfigError(f"this transformers has no Trainer.{name}; install the "
                                  f"version moepec[hf] pins")
        super().__init__(*args, **kwargs)
        self.moepec = MoepecCallback(moepec_config, expert_spec=expert_spec,
                                     extra_state=extra_state)
        self.add_callback(self.moepec)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        logits = outputs.get("router_logits") if isinstance(outputs, Mapping) else None
        if model.training and logits:
            config = getattr(self.model, "config", None)
            top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", 1)
            self.moepec.observe_router_logits(list(logits), int(top_k))
        return (loss, outputs) if return_outputs else loss

    def _run_epoch(self, **kwargs):
        step = self.moepec.resumed_global_step
        if step is None or kwargs.get("resume_from_checkpoint") is not None:
            return super()._run_epoch(**kwargs)
        per_epoch = kwargs["num_update_steps_per_epoch"]
        done = step // per_epoch
        if kwargs["epoch"] < done:
            return None  # trained before the restart
        if kwargs["epoch"] == done:
            skip = 0 if self.args.ignore_data_skip else \
                (step % per_epoch) * self.args.gradient_accumulation_steps
            kwargs.update(epochs_trained=done, steps_trained_in_current_epoch=skip,
                          resume_from_checkpoint=RESTORED)
        return super()._run_epoch(**kwargs)

    def _load_rng_state(self, checkpoint):
        if checkpoint == RESTORED:
            if self.moepec.restored_rng is not None:
                set_rng_state(self.moepec.restored_rng)
            return
        super()._load_rng_state(checkpoint)
