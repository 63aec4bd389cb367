"""Which experts a checkpoint saves: the selection policies of PEC.

Pure logic: no I/O, no torch. The manager calls :meth:`Selector.select` on every rank
with identical state (the state travels in the checkpoint), so every rank gets the
same answer without a collective.

Policies
--------
``sequential`` is the paper's staggered round-robin. For K=1, MoE layer m saves expert
(m + c) mod N at checkpoint c. For K > 1 we generalise it as a cursor per layer that
starts at m mod N and advances past the K experts it takes, so with a constant K layer m
saves experts (m + c*K + j) mod N, j = 0..K-1. Why a cursor rather than the closed
formula: every expert is still saved at least every ceil(N/K) checkpoints, and the
rotation stays fair when K changes between checkpoints (dynamic K, or a tier that is
skipped once), because the next checkpoint always starts at the stalest expert.

``load_aware`` saves the experts with most token assignments since their last save (the
ones whose weights moved most); it has no staleness bound, which is why it is not the
default.

A policy of your own is registered under a name (:func:`register_selection`; the
interface, :class:`~moepec.policy.selection_policy.SelectionPolicy`, and its contract are
in :mod:`moepec.policy.selection_policy`) and configured by that name wherever the
built-in ones are. Its JSON state travels in the selector's state like theirs.

Two tiers
---------
:func:`select_two_tier` picks the persist set P (storage) and the snapshot set S (host
RAM) with P a subset of S. Note on the bound: with P forced to follow its own rotation,
"every expert in S at least every ceil(N/K_snapshot) checkpoints" is not always
achievable (N=6, K_persist=2, K_snapshot=3 admits no schedule at all). When K_persist
divides K_snapshot our schedule meets it exactly; otherwise it meets
:func:`snapshot_gap_bound`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moepec.errors import ConfigError, StructureMismatchError
from moepec.policy.selection_policy import (
    Selection,
    SelectionContext,
    SelectionPolicy,
    checked_answer,
    json_state,
    resolve_selection,
    user_policy,
)

__all__ = ["Selection", "Selector", "load_aware_pick", "select_two_tier", "sequential_pick",
           "snapshot_gap_bound", "snapshot_offsets"]


def _checked_exclude(n_experts: int, exclude: frozenset[int]) -> frozenset[int]:
    bad = sorted(e for e in exclude if not 0 <= e < n_experts)
    if bad:
        raise ConfigError(f"exclude holds expert ids {bad} outside 0..{n_experts - 1}")
    return frozenset(exclude)


def sequential_pick(
    cursor: int, n_experts: int, k: int, exclude: frozenset[int] = frozenset()
) -> tuple[tuple[int, ...], int]:
    """Next ``k`` experts in round-robin order from ``cursor`` (mod n), skipping ``exclude``.

    Returns (the taken experts sorted, the new cursor = one past the last taken, mod n).
    ``k`` is capped at ``n_experts - len(exclude)``; taking none leaves the cursor as is.
    Raises ConfigError for n_experts < 1, k < 0 or an exclude id outside 0..n-1.
    """
    if n_experts < 1:
        raise ConfigError(f"n_experts must be >= 1, got {n_experts}")
    if k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    exclude = _checked_exclude(n_experts, exclude)
    k = min(k, n_experts - len(exclude))
    cursor %= n_experts
    taken: list[int] = []
    pos = cursor
    while len(taken) < k:
        if pos not in exclude:
            taken.append(pos)
        pos = (pos + 1) % n_experts
    new_cursor = (taken[-1] + 1) % n_experts if taken else cursor
    return tuple(sorted(taken)), new_cursor


def load_aware_pick(
    tokens_since_save: Sequence[int],
    last_saved: Sequence[int],
    k: int,
    exclude: frozenset[int] = frozenset(),
) -> tuple[int, ...]:
    """The ``k`` experts with most token assignments since their last save, sorted by id.

    Ties go to the stalest expert (smallest ``last_saved``; -1 = never saved comes first),
    then to the lowest id. ``k`` is capped at the number of experts not in ``exclude``.
    Raises ConfigError if the two sequences differ in length or k < 0.
    """
    n = len(tokens_since_save)
    if len(last_saved) != n:
        raise ConfigError(
            f"tokens_since_save has {n} entries but last_saved has {len(last_saved)}; "
            "pass one entry per expert in both"
        )
    if k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    exclude = _checked_exclude(n, exclude)
    ranked = sorted(
        (e for e in range(n) if e not in exclude),
        key=lambda e: (-tokens_since_save[e], last_saved[e], e),
    )
    return tuple(sorted(ranked[:k]))


def _check_matrix(name: str, rows: Sequence[Sequence[int]], n_experts: tuple[int, ...]) -> None:
    if len(rows) != len(n_experts) or any(
        len(row) != n for row, n in zip(rows, n_experts)
    ):
        raise ConfigError(
            f"{name} must have one row per MoE layer with one entry per expert "
            f"(shape {list(n_experts)}), got row lengths {[len(r) for r in rows]}"
        )


@dataclass(kw_only=True, slots=True)
class Selector:
    """Stateful expert selector of one tier (snapshot or persist) over all MoE layers.

    Called on every rank with the same inputs; its state is plain JSON (see
    :meth:`state_dict`) and is saved with each checkpoint so a restored run continues
    the same rotation.
    """

    n_experts: tuple[int, ...]
    """Experts per MoE layer, in layer order (may differ per layer)."""
    policy: Selection | str = Selection.SEQUENTIAL
    """Which experts :meth:`select` picks: a built-in :class:`Selection` or the name of a
    registered user policy (:func:`register_selection`)."""
    cursors: list[int] = field(default_factory=list)
    """Sequential cursor per layer; empty means staggered: layer m starts at m % N_m."""
    last_saved: list[list[int]] = field(default_factory=list)
    """Checkpoint index of the last save per (layer, expert); -1 = never. Empty = all -1."""
    tokens_since_save: list[list[int]] = field(default_factory=list)
    """Token assignments since the last save per (layer, expert). Empty = all 0."""
    policy_state: list[Any] = field(default_factory=list)
    """A user policy's JSON state per layer (None for the built-in ones). Empty = the
    policy's ``initial_state``."""

    def __post_init__(self) -> None:
        self.n_experts = tuple(int(n) for n in self.n_experts)
        if any(n < 1 for n in self.n_experts):
            raise ConfigError(f"every MoE layer needs >= 1 expert, got {list(self.n_experts)}")
        self.policy = resolve_selection(self.policy, "selection policy")
        if not self.cursors:
            self.cursors = [m % n for m, n in enumerate(self.n_experts)]
        if not self.last_saved:
            self.last_saved = [[-1] * n for n in self.n_experts]
        if not self.tokens_since_save:
            self.tokens_since_save = [[0] * n for n in self.n_experts]
        if len(self.cursors) != len(self.n_experts):
            raise ConfigError(f"cursors needs one entry per MoE layer ({len(self.n_experts)})")
        self.cursors = [int(c) % n for c, n in zip(self.cursors, self.n_experts)]
        _check_matrix("last_saved", self.last_saved, self.n_experts)
        _check_matrix("tokens_since_save", self.tokens_since_save, self.n_experts)
        if not self.policy_state:
            self.policy_state = self._initial_states()
        if len(self.policy_state) != len(self.n_experts):
            raise ConfigError(f"policy_state needs one entry per MoE layer "
                              f"({len(self.n_experts)})")
        self.policy_state = json_state(self.policy, list(self.policy_state), "its state")

    def _initial_states(self) -> list[Any]:
        policy = user_policy(self.policy)
        if policy is None:
            return [None] * len(self.n_experts)
        return [json_state(self.policy, policy.initial_state(m, n),
                           f"initial_state of MoE layer {m}")
                for m, n in enumerate(self.n_experts)]

    @classmethod
    def create(cls, n_experts: Sequence[int], policy: Selection | str = Selection.SEQUENTIAL) -> Selector:
        """A fresh selector: staggered cursors, nothing saved, no tokens seen."""
        return cls(n_experts=tuple(n_experts), policy=policy)

    def observe(self, counts: Sequence[Sequence[int]]) -> None:
        """Add one step's token assignments per (layer, expert). Raises ConfigError on a bad shape."""
        _check_matrix("counts", counts, self.n_experts)
        for row, add in zip(self.tokens_since_save, counts):
            for e, c in enumerate(add):
                if c < 0:
                    raise ConfigError(f"token counts must be >= 0, got {c}")
                row[e] += int(c)

    def _check_k(self, k: int) -> None:
        top = min(self.n_experts, default=k)
        if not 1 <= k <= top:
            raise ConfigError(
                f"k={k} experts per layer is invalid; valid values are 1..{top} "
                "(the fewest experts of any MoE layer)"
            )

    def select(
        self, k: int, exclude: Sequence[frozenset[int]] | None = None,
        checkpoint_index: int | None = None,
    ) -> list[tuple[int, ...]]:
        """The experts to save per layer (sorted ids); does not change any state.

        ``exclude[m]`` are experts of layer m that must not be picked (for instance
        those already chosen by the other tier); fewer than k come back if exclusions
        leave fewer. ``checkpoint_index``: the checkpoint being planned, as a user
        policy sees it (None: one past the newest save recorded). Raises ConfigError for
        k outside 1..min(n_experts), and for a user policy's wrong answer.
        """
        self._check_k(k)
        if exclude is None:
            exclude = [frozenset()] * len(self.n_experts)
        if len(exclude) != len(self.n_experts):
            raise ConfigError(f"exclude needs one set per MoE layer ({len(self.n_experts)})")
        policy = user_policy(self.policy)
        if checkpoint_index is None:
            checkpoint_index = 1 + max((max(r) for r in self.last_saved), default=-1)
        picked: list[tuple[int, ...]] = []
        for layer, n in enumerate(self.n_experts):
            if policy is not None:
                experts = self._ask(policy, layer, k, exclude[layer], checkpoint_index)
            elif self.policy == "sequential":
                experts, _ = sequential_pick(self.cursors[layer], n, k, exclude[layer])
            else:
                experts = load_aware_pick(
                    self.tokens_since_save[layer], self.last_saved[layer], k, exclude[layer]
                )
            picked.append(experts)
        return picked

    def _ask(self, policy: SelectionPolicy, layer: int, k: int, exclude: frozenset[int],
             checkpoint_index: int) -> tuple[int, ...]:
        """The user policy's checked answer for one layer."""
        n = self.n_experts[layer]
        exclude = _checked_exclude(n, frozenset(exclude))
        k = min(k, n - len(exclude))
        if k == 0:  # nothing left to choose from (two tiers): no question to ask
            return ()
        ctx = SelectionContext(
            layer=layer, n_experts=n, k=k, checkpoint=checkpoint_index,
            tokens_since_save=tuple(self.tokens_since_save[layer]),
            last_saved=tuple(self.last_saved[layer]), exclude=exclude,
            # a copy: a policy that changed it in place would diverge from a restored run
            state=json_state(self.policy, self.policy_state[layer], "its state"))
        return checked_answer(str(self.policy), ctx, policy.select(ctx))

    def commit(self, selected: Sequence[Sequence[int]], checkpoint_index: int) -> None:
        """Record that ``selected[m]`` of every layer m were saved at ``checkpoint_index``.

        Call it once the checkpoint holding them is committed. Their ``last_saved``
        becomes the index and their token counts reset to 0. The sequential cursor moves
        past the run of saved experts that starts at it, in rotation order: after a
        sequential pick that is exactly one past the last taken; when an excluded
        expert sits inside the run (two tiers), commit the union so the run continues.
        Validates everything before changing anything; raises ConfigError.
        """
        if checkpoint_index < 0:
            raise ConfigError(f"checkpoint_index must be >= 0, got {checkpoint_index}")
        if len(selected) != len(self.n_experts):
            raise ConfigError(f"selected needs one entry per MoE layer ({len(self.n_experts)})")
        chosen = [frozenset(int(e) for e in experts) for experts in selected]
        for n, experts in zip(self.n_experts, chosen):
            _checked_exclude(n, experts)
        self.policy_state = self._states_after(chosen, checkpoint_index)
        for layer, (n, experts) in enumerate(zip(self.n_experts, chosen)):
            for e in experts:
                self.last_saved[layer][e] = checkpoint_index
                self.tokens_since_save[layer][e] = 0
            cursor, steps = self.cursors[layer], 0
            while cursor in experts and steps < n:
                cursor, steps = (cursor + 1) % n, steps + 1
            self.cursors[layer] = cursor

    def _states_after(self, chosen: Sequence[frozenset[int]], checkpoint_index: int
                      ) -> list[Any]:
        """A user policy's next state per layer after a save of ``chosen`` (computed, all
        checked, before :meth:`commit` changes anything)."""
        policy = user_policy(self.policy)
        if policy is None:
            return self.policy_state
        return [json_state(self.policy, policy.on_saved(
                    json_state(self.policy, state, "its state"), layer=layer, n_experts=n,
                    experts=tuple(sorted(experts)), checkpoint=checkpoint_index),
                    f"the state on_saved returned for MoE layer {layer}")
                for layer, (n, state, experts) in enumerate(
                    zip(self.n_experts, self.policy_state, chosen))]

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able deep copy of the state. ``policy_state`` is there only when a user
        policy keeps one (the built-in policies' state has no such key)."""
        d = {
            "n_experts": list(self.n_experts),
            "policy": str(self.policy),
            "cursors": list(self.cursors),
            "last_saved": [list(r) for r in self.last_saved],
            "tokens_since_save": [list(r) for r in self.tokens_since_save],
        }
        if any(s is not None for s in self.policy_state):
            d["policy_state"] = json_state(self.policy, self.policy_state, "its state")
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the state by one from :meth:`state_dict`.

        The policy stays as configured here, so a resumed run may switch policy: the
        common state (cursors, last saves, tokens since) carries over, and a user
        policy's own ``policy_state`` is taken only when ``d`` was saved under the same
        policy name (otherwise this policy starts from its ``initial_state``). The saving
        policy need not be registered here; its name and state are checked for shape
        only. Raises StructureMismatchError if the experts per layer differ, ConfigError
        for a malformed state.
        """
        loaded = Selector.loaded(self.n_experts, d, self.policy)
        self.cursors = loaded.cursors
        self.last_saved = loaded.last_saved
        self.tokens_since_save = loaded.tokens_since_save
        self.policy_state = loaded.policy_state

    @classmethod
    def loaded(cls, n_experts: Sequence[int], d: dict[str, Any],
               policy: Selection | str = Selection.SEQUENTIAL) -> Selector:
        """A new selector of ``policy`` holding the state ``d``: what
        ``create(n_experts, policy).load_state_dict(d)`` holds, with its checks and
        errors, built once (a restore checks two selectors of every manifest)."""
        n_experts = tuple(int(n) for n in n_experts)
        policy = resolve_selection(policy, "selection policy")
        if not isinstance(d.get("policy", ""), str):
            raise ConfigError(f"selector state names policy {d['policy']!r}, not a name")
        if tuple(d["n_experts"]) != n_experts:
            raise StructureMismatchError(
                f"selector state is for experts per layer {list(d['n_experts'])} but this "
                f"model has {list(n_experts)}; restore into the same MoE structure"
            )
        states = d.get("policy_state")
        if states is None:
            states = [None] * len(n_experts)
        if not isinstance(states, list) or len(states) != len(n_experts):
            raise ConfigError(f"policy_state needs one entry per MoE layer "
                              f"({len(n_experts)})")
        # d's policy state when it is this policy's, else this policy's initial one
        same = d.get("policy") == str(policy) and user_policy(policy) is not None
        return cls(n_experts=n_experts, policy=policy, cursors=list(d["cursors"]),
                   last_saved=[list(r) for r in d["last_saved"]],
                   tokens_since_save=[list(r) for r in d["tokens_since_save"]],
                   policy_state=list(states) if same else [])


def snapshot_offsets(n_experts: int, k_persist: int, k_snapshot: int) -> tuple[int, ...]:
    """Offsets from the persist cursor of the snapshot set when both tiers are sequential.

    r = k_snapshot // k_persist blocks, each at least k_persist wide (block 0 starts at
    offset 0 and so holds the persist window), separated by holes as equal as possible.
    The persist cursor moves k_persist per checkpoint, so relative to it each expert
    walks down by k_persist a checkpoint; a block k_persist wide cannot be jumped over,
    and a hole h long is crossed in at most ceil(h / k_persist) checkpoints.
    """
    r = k_snapshot // k_persist
    spare, holes = k_snapshot - r * k_persist, n_experts - k_snapshot
    offsets: list[int] = []
    start = 0
    for i in range(r):
        # Spare width goes to the far blocks first: next to the persist window it would
        # mostly hold experts that are persisted at the next checkpoint anyway.
        width = k_persist + spare // r + (1 if r - 1 - i < spare % r else 0)
        offsets.extend(range(start, start + width))
        start += width + holes // r + (1 if i < holes % r else 0)
    assert start == n_experts and len(offsets) == k_snapshot
    return tuple(offsets)


def snapshot_gap_bound(n_experts: int, k_persist: int, k_snapshot: int) -> int:
    """Most checkpoints between two snapshots of an expert under :func:`select_two_tier`.

    Holds when both tiers are sequential and K is constant: 1 + ceil((N - K_s) / (r K_p))
    with r = K_s // K_p. Equals ceil(N / K_s) when K_p divides K_s, and never exceeds
    the persist bound ceil(N / K_p).
    """
    r = k_snapshot // k_persist
    return 1 + -(-(n_experts - k_snapshot) // (r * k_persist))


def select_two_tier(
    persist: Selector, ram: Selector, k_persist: int, k_snapshot: int,
    checkpoint_index: int | None = None,
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Pick the snapshot set S and the persist set P per layer; returns (S, P), P within S.

    P = ``persist.select(k_persist)``. With both tiers sequential, S is P's window plus
    evenly spaced blocks (:func:`snapshot_offsets`), which gives the bound of
    :func:`snapshot_gap_bound`. Otherwise S = P plus ``ram.select(k_snapshot - k_persist,
    exclude=P)``. Changes no state: afterwards commit ``persist`` with P and ``ram`` with
    S. ``checkpoint_index``: the checkpoint planned, for a user policy
    (:meth:`Selector.select`). Raises ConfigError unless 1 <= k_persist <= k_snapshot <= N
    for every layer, or if the two selectors cover different layers.
    """
    if persist.n_experts != ram.n_experts:
        raise ConfigError(
            f"persist and RAM selectors cover different layers ({list(persist.n_experts)} vs "
            f"{list(ram.n_experts)}); create both from the same model"
        )
    top = min(persist.n_experts, default=k_snapshot)
    if not 1 <= k_persist <= k_snapshot <= top:
        raise ConfigError(
            f"need 1 <= k_persist <= k_snapshot <= {top}, got k_persist={k_persist}, "
            f"k_snapshot={k_snapshot}"
        )
    persisted = persist.select(k_persist, checkpoint_index=checkpoint_index)
    if k_snapshot == k_persist:
        return list(persisted), persisted
    if persist.policy == ram.policy == "sequential":
        snapshot = []
        for cursor, n in zip(persist.cursors, persist.n_experts):
            offsets = snapshot_offsets(n, k_persist, k_snapshot)
            snapshot.append(tuple(sorted((cursor + d) % n for d in offsets)))
    else:
        extra = ram.select(k_snapshot - k_persist, exclude=[frozenset(p) for p in persisted],
                           checkpoint_index=checkpoint_index)
        snapshot = [tuple(sorted(set(p) | set(x))) for p, x in zip(persisted, extra)]
    assert all(set(p) <= set(s) and len(s) == k_snapshot for p, s in zip(persisted, snapshot))
    return snapshot, persisted
