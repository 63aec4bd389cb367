"""DeepSpeed: a final save writes every expert (``moepec[deepspeed]``).

``engine.save_checkpoint`` looks the same whether it is a periodic save or the last one
before a stop, so the door cannot tell; :func:`complete_next_save` says so::

    moepec.integrations.deepspeed.complete_next_save(engine)
    engine.save_checkpoint(save_dir)     # every expert: K = N for this save

The next storage save of that engine (a RAM snapshot does not take the mark) writes
every expert of every MoE layer, so a load of that tag reads nothing older (PLT 0) and a
rerun or an extension of the run loses nothing; the saves after it rotate on. Under the
Hugging Face Trainer, :class:`moepec.integrations.ds_trainer.FinalSave` calls it when the
Trainer's last step saves (``should_save`` at ``max_steps``); under Accelerate, call it
before the last ``save_state()``.

Imports neither DeepSpeed nor the door: it reaches the door the engine carries.
"""

from __future__ import annotations

from typing import Any

from moepec.errors import ConfigError


def complete_next_save(engine: Any) -> None:
    """Make ``engine``'s next ``save_checkpoint`` a complete one (every expert). Any
    rank, no collective: a mark on one rank makes that save complete on every rank
    (calling it on every rank is the same). Raises ConfigError for an engine without the
    moepec door (no ``"moepec"`` section in its config, nor ``attach``)."""
    door = getattr(engine, "_moepec_door", None)
    if door is None:
        raise ConfigError(f"{type(engine).__name__} has no moepec door: put a \"moepec\" "
                          f"section in its DeepSpeed config (or call "
                          f"moepec.integrations.deepspeed.attach(engine)) before its saves")
    door.front.complete_next_save()
