"""The Hugging Face Trainer over DeepSpeed: its last save writes every expert.

The Trainer saves a DeepSpeed engine's checkpoint through ``engine.save_checkpoint``
(the door, :mod:`moepec.integrations.deepspeed`), which cannot tell the last save from
the others. :class:`FinalSave` can: after the last step (``max_steps``, or a callback that
stopped training) the Trainer's ``should_save`` is the final save, and the callback marks
it complete (:func:`moepec.integrations.ds_final.complete_next_save`)::

    trainer = Trainer(model=model, args=args, train_dataset=data)   # deepspeed=config
    trainer.add_callback(moepec.integrations.ds_trainer.FinalSave(trainer))
    trainer.train()       # checkpoint-<max_steps> holds every expert

Imports transformers (``moepec[hf]``); this is not the manager-based Trainer door
(:mod:`moepec.integrations.hf`), whose final save is its own.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from moepec.errors import ConfigError
from moepec.integrations.ds_final import complete_next_save


class FinalSave(TrainerCallback):
    """Marks the Trainer's final save complete on its DeepSpeed engine (every rank)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        """The Trainer: its ``model_wrapped`` is the engine once training started."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Refused here, not at the last step: a run must not end without its final save.
        if getattr(self.trainer.model_wrapped, "_moepec_door", None) is None:
            raise ConfigError("FinalSave needs the Trainer on a DeepSpeed engine with the "
                              "moepec door: pass deepspeed= a config with a \"moepec\" "
                              "section (and import moepec.integrations.deepspeed first)")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer's own flow (DefaultFlowCallback, first in the list) has decided
        # whether this step saves and whether training stops here.
        last = control.should_training_stop or state.global_step >= state.max_steps
        if control.should_save and last:
            complete_next_save(self.trainer.model_wrapped)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # save_strategy "epoch": the last epoch's save
        if control.should_save and state.global_step >= state.max_steps:
            complete_next_save(self.trainer.model_wrapped)
