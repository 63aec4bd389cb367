"""A final save behind the flat front end: the save a framework (or its user) marks as
the last before a stop writes every expert of every MoE layer, so the stitched load of
that folder reads nothing older (PLT 0) and a rerun or an extension of the run loses
nothing.

A door cannot always tell which save is the last (Megatron-LM's end-of-training and
``--exit-signal-handler`` saves look like any other to the backend), so the mark is a
call: :meth:`FinalSaves.complete_next_save`, one-shot, consumed by the next save's plan.
A mark on one rank makes that save complete on every rank (the plan's gather carries it),
so a stop that reached one rank first still ends in one complete save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class FinalSaves:
    """The one-shot mark of :class:`moepec.flat.FlatFrontEnd` (its base)."""

    _final_asked: bool = False
    """Whether this process asked that the next save be complete (the class default;
    :meth:`complete_next_save` sets the instance's)."""

    def complete_next_save(self) -> None:
        """Any rank, any thread, no collective: the next save planned on this front end
        (:meth:`~moepec.flat.FlatFrontEnd.plan_save`) writes every expert (K = N for that
        save, whatever the schedule says; the schedule goes on after it). One rank's mark
        is enough; calling it on every rank is the same. A RAM snapshot does not take it."""
        self._final_asked = True

    def take_final_mark(self) -> bool:
        """In ``plan_save``, before its gather: this rank's mark, cleared (a mark set while
        the save is planned is the next save's, never lost between the two)."""
        asked, self._final_asked = self._final_asked, False
        return asked

    @staticmethod
    def final_agreed(gathered: Sequence[Sequence[Any]]) -> bool:
        """All ranks, in ``plan_save`` after its gather (each rank's tuple ends with its
        :meth:`take_final_mark`): whether any rank asked for a complete save."""
        return any(bool(g[-1]) for g in gathered)
