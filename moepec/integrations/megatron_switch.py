"""The ``torch_dist`` switch of the Megatron-Core door: Megatron's default lookups of one
backend's strategy answered with another backend's.

Megatron-LM asks for its save strategy by the name of ``--ckpt-format``
(``get_default_save_sharded_strategy('torch_dist')``), and megatron-core writes its own
``torch_dist`` strategies back into the registry on every lookup
(``register_default_torch_strategies`` inside ``get_default_strategy``), so registering
another strategy under that name cannot take. Every lookup, whoever makes it, reads one
table per action: ``default_strategies[action]`` in
``megatron.core.dist_checkpointing.strategies.base``. :func:`answer` puts an
:class:`AnsweringTable` in its place, with the same entries, whose lookups of the alias
read the target's entry; megatron-core keeps writing its own entry there, unused until
:func:`restore` puts a plain table back. No function of Megatron is replaced.

:func:`megatron_lm_stops_at`: whether Megatron-LM's own loop is about to exit after the
save of an iteration (its last save, which the door makes complete), read from its
globals without importing Megatron-LM.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from megatron.core.dist_checkpointing.strategies import base
from megatron.core.dist_checkpointing.strategies.base import StrategyAction

Backend = tuple[str, int]


class AnsweringTable(dict):
    """Megatron's registry table of one action, whose lookup of ``alias`` (a
    ``(backend, version)``) answers ``target``'s strategy. Writes go to the key written,
    as in a plain table. ``how``: what the switch was turned on with (its caller's)."""

    def __init__(self, entries: dict[Backend, Any], alias: Backend, target: Backend,
                 how: Any) -> None:
        super().__init__(entries)
        self.alias = alias
        self.target = target
        self.how = how

    def __getitem__(self, key: Backend) -> Any:
        return super().__getitem__(self.target if key == self.alias else key)


def answer(action: StrategyAction, alias: Backend, target: Backend, how: Any = None) -> None:
    """Every default lookup of ``action`` for ``alias`` answers ``target``'s registered
    strategy from now on. Idempotent (a second call replaces the first's alias and
    target, never nests). Main thread, any rank; no collective."""
    table = base.default_strategies[action.value]
    base.default_strategies[action.value] = AnsweringTable(table, alias, target, how)


def restore(action: StrategyAction) -> None:
    """Undo :func:`answer` for ``action``: a plain table with every entry written so far
    (megatron-core's own included). Does nothing where no switch is on."""
    table = base.default_strategies[action.value]
    if isinstance(table, AnsweringTable):
        base.default_strategies[action.value] = dict(table)


def answering(action: StrategyAction) -> AnsweringTable | None:
    """The switch on ``action`` (its alias, target and ``how``), or None."""
    table = base.default_strategies[action.value]
    return table if isinstance(table, AnsweringTable) else None



def megatron_lm_stops_at(iteration: int) -> bool:
    """Whether Megatron-LM's ``pretrain()`` exits after its save of ``iteration``: the
    saves its ``train()`` makes right before it stops, told from what decided them (read
    from ``megatron.training``'s globals when that is imported; never imports it):
    the end of training (``iteration >= --train-iters``), ``--exit-interval`` and
    phase-transition iterations, a signal ``--exit-signal-handler`` caught on this rank
    (its handler's own flag: no collective; the save's plan carries one rank's mark to
    every rank), and ``--exit-duration-in-mins`` passed on this rank's clock. False
    outside Megatron-LM (a megatron-core loop says so with ``complete_next_save``)."""
    globals_ = sys.modules.get("megatron.training.global_vars")
    args = getattr(globals_, "_GLOBAL_ARGS", None)
    if args is None or iteration < 0:
        return False
    train_iters = getattr(args, "train_iters", None)
    exit_interval = getattr(args, "exit_interval", None)
    handler = getattr(globals_, "_GLOBAL_SIGNAL_HANDLER", None)
    minutes = getattr(args, "exit_duration_in_mins", None)
    started = getattr(sys.modules.get("megatron.training.training"), "_TRAIN_START_TIME", None)
    return bool(
        (train_iters and iteration >= train_iters)
        or (exit_interval and iteration % exit_interval == 0)
        or iteration in (getattr(args, "phase_transition_iterations", None) or ())
        or (getattr(args, "exit_signal_handler", False)
            and getattr(handler, "_signal_received", False))
        or (minutes and started is not None and (time.time() - started) / 60.0 > minutes))
