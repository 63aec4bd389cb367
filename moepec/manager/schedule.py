"""Which experts each checkpoint saves, and how many: the manager's PEC schedule.

:class:`ExpertSchedule` owns the two selectors (RAM and storage), K_persist / K_snapshot
and their history, the PLT ledger and the checkpoint index. The manager calls it on the
training thread, with the same inputs on every rank (the routing counts are summed over
ranks before ``observe``), so every rank makes the same choice; nothing here does I/O
or collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from moepec.errors import ConfigError
from moepec.manager.config import CheckpointConfig
from moepec.policy.plt import PLTLedger, dynamic_k
from moepec.policy.selection import Selector, select_two_tier
from moepec.policy.selection_policy import selection_names
from moepec.store.meta import CheckpointMeta

log = logging.getLogger(__name__)


class ExpertSchedule:
    """The selectors, K, the PLT ledger and the index of the next checkpoint."""

    def __init__(self, n_experts: tuple[int, ...], config: CheckpointConfig) -> None:
        self.n_experts = n_experts
        self.config = config
        self.k_persist = config.k_persist
        """Experts per MoE layer written to storage at each checkpoint (now)."""
        self.k_snapshot = config.k_snapshot
        """Experts per MoE layer copied to RAM at each checkpoint (now)."""
        self.k_history: list[list[int]] = [[-1, self.k_persist]]
        """[step, K_persist] at each change of K_persist (recorded in every manifest)."""
        self.persist_selector = Selector.create(n_experts, config.selection)
        self.ram_selector = Selector.create(n_experts, config.selection)
        self.ledger = PLTLedger.create(n_experts)
        self.index = 0
        """The index of the next checkpoint of this lineage (selectors rotate by it)."""

    def observe(self, counts: Any) -> None:
        """Routing counts since the last checkpoint, summed over ranks."""
        for tracker in (self.ledger, self.persist_selector, self.ram_selector):
            tracker.observe(counts)

    def is_full_by_period(self) -> bool:
        """Whether ``full_every`` asks for a full checkpoint now."""
        return self.config.full_every > 0 and self.index % self.config.full_every == 0

    def choose(self, full: bool, persist: bool
               ) -> tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]:
        """The experts per layer this checkpoint copies to RAM and (of them) writes to
        storage, committed to the selectors (the storage one only when ``persist``)."""
        if full:
            snap_sel = [tuple(range(n)) for n in self.n_experts]
            persist_sel = snap_sel
        else:
            snap_sel, persist_sel = select_two_tier(self.persist_selector, self.ram_selector,
                                                    self.k_persist, self.k_snapshot, self.index)
        self.ram_selector.commit(snap_sel, self.index)
        if persist:
            self.persist_selector.commit(persist_sel, self.index)
        return snap_sel, persist_sel

    def meta_fields(self) -> dict[str, Any]:
        """The schedule's part of a CheckpointMeta (what ``resume`` reads back)."""
        return dict(index=self.index, k_persist=self.k_persist, k_snapshot=self.k_snapshot,
                    counts=self.ledger.counts(), ledger=self.ledger.state_dict(),
                    plt=self.ledger.plt(),
                    selectors={"persist": self.persist_selector.state_dict(),
                               "ram": self.ram_selector.state_dict()},
                    k_history=[list(x) for x in self.k_history])

    def resume(self, meta: CheckpointMeta, ledger: PLTLedger) -> None:
        """Continue from a restored base: its selectors, K and index, and ``ledger``
        (the base's, plus the recoveries since)."""
        self.resume_from(dict(index=meta.index, k_persist=meta.k_persist,
                              k_snapshot=meta.k_snapshot, selectors=meta.selectors,
                              k_history=meta.k_history), ledger)

    def resume_from(self, fields: Mapping[str, Any], ledger: PLTLedger) -> None:
        """Continue after the checkpoint whose :meth:`meta_fields` are ``fields`` (its
        selectors, K and index; the flat front end keeps them in its manifest), with
        ``ledger``. Raises StructureMismatchError when the experts per layer differ."""
        self.ledger = ledger
        self._note_policy_switch(fields["selectors"]["persist"])
        self.persist_selector.load_state_dict(fields["selectors"]["persist"])
        self.ram_selector.load_state_dict(fields["selectors"]["ram"])
        self.k_persist, self.k_snapshot = int(fields["k_persist"]), int(fields["k_snapshot"])
        self.k_history = [list(x) for x in fields["k_history"]]
        self.index = int(fields["index"]) + 1

    def live_state(self) -> dict[str, Any]:
        """The schedule as a live peer hands it over (JSON-able, a copy)."""
        return {"ledger": self.ledger.state_dict(),
                "selectors": {"persist": self.persist_selector.state_dict(),
                              "ram": self.ram_selector.state_dict()},
                "k": [self.k_persist, self.k_snapshot],
                "k_history": [list(x) for x in self.k_history], "index": self.index}

    def load_live_state(self, state: dict[str, Any]) -> None:
        """Adopt a peer's :meth:`live_state`."""
        self.ledger.load_state_dict(state["ledger"])
        self._note_policy_switch(state["selectors"]["persist"])
        self.persist_selector.load_state_dict(state["selectors"]["persist"])
        self.ram_selector.load_state_dict(state["selectors"]["ram"])
        self.k_persist, self.k_snapshot = (int(k) for k in state["k"])
        self.k_history = [list(x) for x in state["k_history"]]
        self.index = int(state["index"])

    def _note_policy_switch(self, saved: Mapping[str, Any]) -> None:
        """Warn when the restored selectors were chosen by a user policy this process has
        not registered. Not an error: the config names the policy that runs (a name it
        does not know is refused there, before any restore), so this is a switch, allowed
        as between the built-in policies, and the only way off a policy whose code is
        gone; the rotation goes on from each expert's last save, and the old policy's own
        state is dropped (policy.selection_policy explains the choice)."""
        old, now = saved.get("policy"), str(self.config.selection)
        if old is None or old == now or old in selection_names():
            return
        log.warning("the checkpoint's experts were chosen by selection policy %r, which is "
                    "not registered in this process; this run selects with %r (configured) "
                    "from each expert's last save on, and %r's own state is dropped. To go "
                    "on with %r, call moepec.register_selection(%r, policy) on every rank "
                    "before creating the CheckpointConfig, and set selection=%r",
                    old, now, old, old, old, old)

    def set_k(self, k_persist: int, k_snapshot: int | None, step: int) -> None:
        """New K from the next checkpoint on (``step``: the last one trained). Raises
        ConfigError unless 1 <= k_persist <= k_snapshot <= the experts per MoE layer."""
        k_snapshot = max(self.k_snapshot, k_persist) if k_snapshot is None else k_snapshot
        top = min(self.n_experts, default=0)
        if not 1 <= k_persist <= k_snapshot <= top:
            raise ConfigError(f"set_k({k_persist}, {k_snapshot}): need 1 <= k_persist <= "
                              f"k_snapshot <= {top} (the experts per MoE layer)")
        if k_persist != self.k_persist:
            self.k_history.append([step, k_persist])
        self.k_persist, self.k_snapshot = k_persist, k_snapshot

    def adjust_k(self, step: int, rank: int, lossless: bool = False) -> None:
        """Dynamic K after a recovery (policy.plt.dynamic_k), when configured; without it,
        a warning (rank 0) when the recovery left PLT over the budget. A ``lossless``
        restore (nothing lost: a resume) never raises K nor warns; it may only lower K
        (``dynamic_k_down``)."""
        if not self.n_experts:
            return
        config = self.config
        if lossless and not (config.dynamic_k and config.dynamic_k_down):
            return
        if not config.dynamic_k:
            if self.ledger.plt() > config.plt_budget and rank == 0:
                log.warning("PLT is %.2f%% after this recovery, over the budget %.2f%%, and "
                            "dynamic K is off: set CheckpointConfig(dynamic_k=True) "
                            "(moepec train --dynamic-k), or save more experts per checkpoint "
                            "(k_persist) or checkpoint more often (interval)",
                            100 * self.ledger.plt(), 100 * config.plt_budget)
            return
        plt = self.ledger.plt()
        new = dynamic_k(self.k_persist, plt, config.plt_budget, min(self.n_experts),
                        config.dynamic_k_down)
        if lossless:
            new = min(new, self.k_persist)
        if new != self.k_persist:
            log.info("dynamic K: PLT %.3f%% vs budget %.3f%%: K_persist %d -> %d", 100 * plt,
                     100 * config.plt_budget, self.k_persist, new)
            self.k_persist = new
            self.k_snapshot = max(self.k_snapshot, new)
            self.k_history.append([step, new])
