"""Which keys a checkpoint holds and this rank's share of them (the write plan applied).

Pure apart from reading tensor sizes from the catalogue; every rank calls it with the
same keys and gets a disjoint share, so the union of all shares is every key once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moepec.keys import parse_key
from moepec.policy.plan import PlanItem, make_plan
from moepec.state.catalog import StateCatalog


def rank_share(keys: list[str], catalog: StateCatalog, *, rank: int, world_size: int,
               ep_size: int, mode: str, part: int = 0, parts: int = 1) -> list[str]:
    """The write plan over ranks. An expert's weights (and, separately, its optimizer
    state) form one item: a unit restored whole must be written whole by one rank,
    so that the RAM share of a surviving rank holds complete units. A chunk of a sharded
    tensor (DTensor) is held by the ranks its placement says (one, or a replicate group):
    the chunks of an expert unit held by the same ranks form one item. ``parts`` replica
    groups of one layout stripe a checkpoint: the plan is over all their ranks (rank r of
    part p is ``p * world_size + r``); rank 0 of each group writes the small objects."""
    if parts > 1:
        return _striped_share(keys, catalog, rank=rank, world_size=world_size,
                              ep_size=ep_size, mode=mode, part=part, parts=parts)
    everyone = tuple(range(world_size))
    units: dict[str, list[str]] = {}
    items = []
    for k in keys:
        if k.startswith("objects/"):
            continue  # replicated small objects: rank 0 writes them
        info = parse_key(k)
        chunk_holders = catalog.holders(k)
        if info.is_expert:
            unit = f"{info.layer}/{info.expert}/{info.part}"
            if chunk_holders is not None:
                unit += "@" + ",".join(map(str, chunk_holders))
            if unit in units:
                units[unit].append(k)
                continue
            units[unit] = [k]
            if chunk_holders is not None:
                holders = chunk_holders
            else:
                n_local = catalog.emap.layers[info.layer].n_experts
                owner_ep = info.expert // n_local
                holders = tuple(r for r in everyone if r % ep_size == owner_ep)
            items.append(PlanItem(key=unit, nbytes=0, holders=holders, layer=info.layer,
                              expert=info.expert))
        else:
            items.append(PlanItem(key=k, nbytes=catalog.nbytes(k), holders=chunk_holders or everyone,
                              layer=_module_group(k)))
    sizes = {u: sum(catalog.nbytes(k) for k in ks) for u, ks in units.items()}
    items = [PlanItem(key=it.key, nbytes=sizes[it.key], holders=it.holders, layer=it.layer,
                  expert=it.expert) if it.key in sizes else it for it in items]
    plan = make_plan(items, world_size, mode)
    mine = set()
    for key in plan.keys_for(rank):
        mine.update(units.get(key, [key]))
    if rank == 0:
        mine.update(k for k in keys if k.startswith("objects/"))
    return [k for k in keys if k in mine]


def _striped_share(keys: list[str], catalog: StateCatalog, *, rank: int, world_size: int,
                   ep_size: int, mode: str, part: int, parts: int) -> list[str]:
    """rank_share over the ranks of ``parts`` groups (a chunk's holders in every group)."""
    virtual = _Holders(catalog, world_size, parts)
    mine = rank_share(keys, virtual, rank=part * world_size + rank,  # type: ignore[arg-type]
                      world_size=world_size * parts, ep_size=ep_size, mode=mode)
    if rank == 0 and part > 0:
        mine += [k for k in keys if k.startswith("objects/")]
    mine_set = set(mine)
    return [k for k in keys if k in mine_set]


class _Holders:
    """The catalogue seen by a plan over ``parts`` groups of ``world_size`` ranks: rank r
    of every group holds a chunk rank r holds."""

    def __init__(self, catalog: StateCatalog, world_size: int, parts: int) -> None:
        self.catalog, self.world_size, self.parts = catalog, world_size, parts
        self.emap = catalog.emap

    def holders(self, key: str) -> tuple[int, ...] | None:
        local = self.catalog.holders(key)
        if local is None:
            return None
        return tuple(p * self.world_size + r for p in range(self.parts) for r in local)

    def nbytes(self, key: str) -> int:
        return self.catalog.nbytes(key)


def _module_group(key: str) -> int:
    """Group non-expert keys by transformer block (``blocks.<i>.``) for layer-wise sharding."""
    for part in key.split("/", 2)[-1].split(".")[:-1]:
        if part.isdigit():
            return int(part)
    return -1


SCOPE_PARTS = {
    "all": (("model", "optim"), ()),
    "optimizer": (("optim",), ("model",)),
    "weights": (("model",), ("optim",)),
}
"""pec_scope -> (expert parts saved for the selected experts, parts saved for every expert)."""


class CheckpointKeys:
    """The keys of a checkpoint and this rank's share of them, with the live tensors
    behind them; cached between checkpoints.

    The cache is rebuilt only when the optimizer grew state (its first step) or after
    :meth:`invalidate` (a restore may replace tensors). Training thread only.
    """

    def __init__(self, catalog: StateCatalog, *, pec_scope: str, rank: int, world_size: int,
                 ep_size: int, write_mode: str) -> None:
        self.catalog = catalog
        self.sel_parts, self.all_parts = SCOPE_PARTS[pec_scope]
        self.rank, self.world_size, self.ep_size = rank, world_size, ep_size
        self.write_mode = write_mode
        self._cache: dict = {}

    def invalidate(self) -> None:
        self._cache = {}

    def _current(self) -> dict:
        opt = self.catalog.optimizer
        sig = len(opt.state) if opt is not None else 0
        if self._cache.get("sig") != sig:
            self._cache = {"sig": sig, "live": {}, "plans": {},
                           "base": self.catalog.non_expert_tensor_keys()
                           + self.catalog.object_keys()}
        return self._cache

    def live(self, key: str) -> torch.Tensor:
        """The live tensor behind a tensor key (a view, never a copy)."""
        live = self._current()["live"]
        t = live.get(key)
        if t is None:
            t = live[key] = self.catalog.tensor(key)
        return t

    def keys_for(self, selected: Sequence[Sequence[int]]) -> list[str]:
        """Every key of a checkpoint that saves the experts ``selected[layer]`` (all ranks)."""
        cache = self._current()
        keys = list(cache["base"])
        for layer, n in enumerate(self.catalog.n_global):
            chosen = set(selected[layer])
            for e in range(n):
                parts = self.all_parts + (self.sel_parts if e in chosen else ())
                if parts:
                    ck = (layer, e, parts)
                    if ck not in cache:
                        cache[ck] = self.catalog.expert_keys(layer, e, parts)
                    keys += cache[ck]
        return keys

    def mine(self, keys: list[str], part: tuple[int, int] = (0, 1)) -> list[str]:
        """This rank's share of ``keys`` under the write plan (all of them on one rank);
        ``part``: (this group's position, groups) when replica groups stripe it.

        Every rank computes the same plan: non-expert items are held by all ranks,
        an expert by the ranks of its expert-data-parallel group.
        """
        if self.world_size == 1 and part[1] == 1:
            return keys
        plans = self._current()["plans"]
        key = (tuple(keys), part)
        if key not in plans:
            if len(plans) >= 64:  # load_aware can pick many combinations: stay bounded
                plans.clear()
            plans[key] = rank_share(keys, self.catalog, rank=self.rank,
                                    world_size=self.world_size, ep_size=self.ep_size,
                                    mode=self.write_mode, part=part[0], parts=part[1])
        return plans[key]
