"""Who writes which bytes: the save plan of a fully sharded checkpoint.

Every item (a tensor, or a group of tensors saved under one key) is replicated on its
``holders`` and must be written by exactly one of them. :func:`make_plan` is a pure,
deterministic function, so every rank computes the same frozen :class:`WritePlan` from
the same inputs without a collective. No I/O, no torch.

Modes
-----
``baseline``
    Megatron-DeepSpeed: every item by its lowest holder (non-expert state by DP rank 0,
    experts by the first EP group).
``sharded``
    Non-expert items split by ``layer`` group over their holders (one group, one rank;
    groups dealt biggest first to the least-loaded holder); each expert's tensors
    spread over its replicas, biggest first to the least-loaded replica.
``adaptive``
    The paper's greedy. Expert items as in ``sharded``; non-expert items one by one,
    biggest first, to the least-loaded holder, where a rank's load starts at
    ``expected_expert_load[rank]``: the mean expert bytes it writes per checkpoint over
    one rotation. The non-expert part of the plan therefore does not change while the
    experts rotate and is balanced on average. Without ``expected_expert_load`` the load
    starts at this checkpoint's actual expert bytes.

Ties always go to the lowest rank, then items keep their order by key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from moepec.errors import ConfigError, check_choice


class WriteMode(StrEnum):
    """Who writes what across ranks (see the module docstring)."""

    BASELINE = "baseline"
    SHARDED = "sharded"
    ADAPTIVE = "adaptive"


MODES: tuple[str, ...] = tuple(m.value for m in WriteMode)


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One unit of checkpoint data and the ranks that hold an identical replica of it."""

    key: str
    """Unique name of the item in the checkpoint."""
    nbytes: int
    """Size in bytes."""
    holders: tuple[int, ...]
    """Ranks holding an identical replica; normalised to sorted and unique."""
    layer: int | None = None
    """MoE layer of an expert item, or the module group of a non-expert item."""
    expert: int | None = None
    """Global expert id of an expert item; None for non-expert state."""

    def __post_init__(self) -> None:
        holders = tuple(sorted(set(self.holders)))
        if not holders or holders[0] < 0:
            raise ConfigError(f"item {self.key!r} needs >= 1 holder, all >= 0, got {self.holders}")
        if self.nbytes < 0:
            raise ConfigError(f"item {self.key!r} has nbytes={self.nbytes}; sizes must be >= 0")
        object.__setattr__(self, "holders", holders)


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Which rank writes each key. Frozen; identical on every rank."""

    mode: str
    """The mode that made the plan, one of :data:`MODES`."""
    world_size: int
    """Number of ranks."""
    assignment: Mapping[str, int]
    """key -> the one rank that writes it (read-only), in the order items were given."""
    nbytes: Mapping[str, int]
    """key -> size in bytes (read-only), so the plan can report its balance."""

    def __post_init__(self) -> None:
        if self.assignment.keys() != self.nbytes.keys():
            raise ConfigError("assignment and nbytes must hold the same keys")
        bad = {k: r for k, r in self.assignment.items() if not 0 <= r < self.world_size}
        if bad:
            raise ConfigError(f"ranks outside 0..{self.world_size - 1}: {bad}")
        object.__setattr__(self, "assignment", MappingProxyType(dict(self.assignment)))
        object.__setattr__(self, "nbytes", MappingProxyType(dict(self.nbytes)))

    def __reduce__(self) -> tuple[Any, ...]:
        # mappingproxy does not pickle; rebuild from plain dicts.
        return (WritePlan, (self.mode, self.world_size, dict(self.assignment), dict(self.nbytes)))

    def keys_for(self, rank: int) -> tuple[str, ...]:
        """Keys ``rank`` writes, in plan order."""
        return tuple(k for k, r in self.assignment.items() if r == rank)

    def bytes_per_rank(self) -> tuple[int, ...]:
        """Bytes each rank writes."""
        out = [0] * self.world_size
        for key, rank in self.assignment.items():
            out[rank] += self.nbytes[key]
        return tuple(out)

    def max_over_mean(self) -> float:
        """Imbalance: the busiest rank's bytes over the mean (1.0 is perfect; 1.0 if empty)."""
        loads = self.bytes_per_rank()
        total = sum(loads)
        return max(loads) * self.world_size / total if total else 1.0


def _least_loaded(holders: tuple[int, ...], loads: list[float]) -> int:
    return min(holders, key=lambda r: (loads[r], r))


def _spread_experts(items: Iterable[PlanItem], loads: list[float], out: dict[str, int]) -> None:
    """Each expert's tensors, biggest first, to its least-loaded replica; updates loads."""
    by_expert: dict[tuple[int, int], list[PlanItem]] = {}
    for item in items:
        assert item.expert is not None
        layer = item.layer if item.layer is not None else -1
        by_expert.setdefault((layer, item.expert), []).append(item)
    for ident in sorted(by_expert):
        for item in sorted(by_expert[ident], key=lambda i: (-i.nbytes, i.key)):
            rank = _least_loaded(item.holders, loads)
            out[item.key] = rank
            loads[rank] += item.nbytes


def _check_items(items: Sequence[PlanItem], world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    seen: set[str] = set()
    for item in items:
        if item.key in seen:
            raise ConfigError(f"duplicate key {item.key!r}; every item needs a unique key")
        seen.add(item.key)
        if item.holders[-1] >= world_size:
            raise ConfigError(
                f"item {item.key!r} lists holder {item.holders[-1]} but world_size is "
                f"{world_size}; holders must be ranks 0..{world_size - 1}"
            )


def _sharded(items: Sequence[PlanItem], world_size: int) -> dict[str, int]:
    """``sharded``: experts spread, non-expert items in groups (a layer, or one key) of
    the same holders, the largest group first to the least loaded holder."""
    out: dict[str, int] = {}
    _spread_experts([i for i in items if i.expert is not None], [0.0] * world_size, out)
    groups: dict[tuple[Any, ...], list[PlanItem]] = {}
    for item in (i for i in items if i.expert is None):
        ident = ("layer", item.layer) if item.layer is not None else ("key", item.key)
        groups.setdefault((*ident, item.holders), []).append(item)
    loads = [0.0] * world_size
    ordered = sorted(groups.items(), key=lambda g: (-sum(i.nbytes for i in g[1]), str(g[0])))
    for (*_, holders), members in ordered:
        rank = _least_loaded(holders, loads)
        for item in members:
            out[item.key] = rank
            loads[rank] += item.nbytes
    return out


def _adaptive(items: Sequence[PlanItem], world_size: int,
              expected_expert_load: Sequence[float] | None) -> dict[str, int]:
    """``adaptive``: experts spread, then each non-expert item, largest first, to the
    holder least loaded by the expected expert load (else this checkpoint's)."""
    out: dict[str, int] = {}
    actual = [0.0] * world_size
    _spread_experts([i for i in items if i.expert is not None], actual, out)
    loads = list(expected_expert_load) if expected_expert_load is not None else actual
    for item in sorted((i for i in items if i.expert is None), key=lambda i: (-i.nbytes, i.key)):
        rank = _least_loaded(item.holders, loads)
        out[item.key] = rank
        loads[rank] += item.nbytes
    return out


def make_plan(
    items: Sequence[PlanItem],
    world_size: int,
    mode: str,
    *,
    expected_expert_load: Sequence[float] | None = None,
) -> WritePlan:
    """The save plan of ``items`` over ``world_size`` ranks in ``mode`` (see module doc).

    Pure and deterministic: call it on every rank with the same arguments. Every item
    goes to exactly one of its holders. ``expected_expert_load`` (from
    :func:`expected_expert_load`) is used by ``adaptive`` only. Raises ConfigError for an
    unknown mode, duplicate keys, a holder >= world_size or a load of the wrong length.
    """
    mode = check_choice(WriteMode, mode, "write mode")
    _check_items(items, world_size)
    if expected_expert_load is not None and len(expected_expert_load) != world_size:
        raise ConfigError(
            f"expected_expert_load needs one value per rank ({world_size}), "
            f"got {len(expected_expert_load)}"
        )
    if mode == "baseline":
        out = {i.key: i.holders[0] for i in items}
    elif mode == "sharded":
        out = _sharded(items, world_size)
    else:
        out = _adaptive(items, world_size, expected_expert_load)
    return WritePlan(
        mode=mode,
        world_size=world_size,
        assignment={i.key: out[i.key] for i in items},
        nbytes={i.key: i.nbytes for i in items},
    )


def expected_expert_load(
    expert_items_per_checkpoint: Sequence[Sequence[PlanItem]], world_size: int
) -> list[float]:
    """Mean expert bytes each rank writes per checkpoint, over the checkpoints given.

    Pass the expert items of each checkpoint of one full rotation period (for sequential
    selection: ceil(N/K) checkpoints, or N/gcd(N, K) for an exact period). Experts are
    placed as ``make_plan`` places them. Raises ConfigError for a non-expert item or
    an empty list.
    """
    if not expert_items_per_checkpoint:
        raise ConfigError("pass the expert items of at least one checkpoint")
    total = [0.0] * world_size
    for items in expert_items_per_checkpoint:
        _check_items(items, world_size)
        if any(i.expert is None for i in items):
            raise ConfigError("expected_expert_load takes expert items only (expert is not None)")
        loads = [0.0] * world_size
        _spread_experts(items, loads, {})
        total = [t + x for t, x in zip(total, loads)]
    return [x / len(expert_items_per_checkpoint) for x in total]
