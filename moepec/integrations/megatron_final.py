"""Megatron-Core: a final save writes every expert (``moepec[megatron]``).

The ``("moepec", 1)`` backend sees each ``dist_checkpointing.save`` alike; which one is
the last (Megatron-LM's end-of-training save, its ``--exit-signal-handler`` and
``--exit-interval`` saves, your own loop's last) it cannot tell. Say so before it::

    from moepec.integrations.megatron_final import complete_next_save

    complete_next_save()            # any rank (every rank is the same), before the save
    dist_checkpointing.save(sd, f"{save}/iter_{it:07d}", sharded_strategy=("moepec", 1))

That save writes every expert of every MoE layer (K = N once), so a load of that folder
reads nothing older (PLT 0) and a rerun or an extension of the run loses nothing; the
saves after it rotate on. Through :func:`moepec.integrations.megatron.use_for_torch_dist`
the same holds for Megatron-LM's ``save_checkpoint``. A mark on one rank is enough (a
signal handler of one rank may set it): the save's plan carries it to every rank.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.strategies.base import (
    StrategyAction,
    get_default_strategy,
)

from moepec.integrations.megatron import BACKEND, VERSION


def complete_next_save() -> None:
    """Make this process's next moepec save complete (every expert). Any rank, any thread
    (a signal handler's too), no collective; the registered backend (the last
    :func:`moepec.integrations.megatron.register`) takes it."""
    get_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION).front \
        .complete_next_save()
