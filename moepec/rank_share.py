"""This rank's share of a checkpoint's items: the write plan applied to the state's keys.

Pure apart from reading tensor sizes from the catalogue; every rank calls it with the
same keys and gets a disjoint share, so the union of all shares is every key once.
"""

from __future__ import annotations

from moepec.plan import Item, make_plan
from moepec.state import StateCatalog, parse_key


def rank_share(keys: list[str], catalog: StateCatalog, *, rank: int, world_size: int,
               ep_size: int, mode: str) -> list[str]:
    """The write plan over ranks. An expert's weights (and, separately, its optimizer
    state) form one item: a unit restored whole must be written whole by one rank,
    so that the RAM share of a surviving rank holds complete units."""
    everyone = tuple(range(world_size))
    units: dict[str, list[str]] = {}
    items = []
    for k in keys:
        if k.startswith("objects/"):
            continue  # replicated small objects: rank 0 writes them
        info = parse_key(k)
        if info.is_expert:
            unit = f"{info.layer}/{info.expert}/{info.part}"
            if unit in units:
                units[unit].append(k)
                continue
            units[unit] = [k]
            n_local = catalog.emap.layers[info.layer].n_experts
            owner_ep = info.expert // n_local
            holders = tuple(r for r in everyone if r % ep_size == owner_ep)
            items.append(Item(key=unit, nbytes=0, holders=holders, layer=info.layer,
                              expert=info.expert))
        else:
            items.append(Item(key=k, nbytes=catalog.nbytes(k), holders=everyone,
                              layer=_module_group(k)))
    sizes = {u: sum(catalog.nbytes(k) for k in ks) for u, ks in units.items()}
    items = [Item(key=it.key, nbytes=sizes[it.key], holders=it.holders, layer=it.layer,
                  expert=it.expert) if it.key in sizes else it for it in items]
    plan = make_plan(items, world_size, mode)
    mine = set()
    for key in plan.keys_for(rank):
        mine.update(units.get(key, [key]))
    if rank == 0:
        mine.update(k for k in keys if k.startswith("objects/"))
    return [k for k in keys if k in mine]


def _module_group(key: str) -> int:
    """Group non-expert keys by transformer block (``blocks.<i>.``) for layer-wise sharding."""
    for part in key.split("/", 2)[-1].split(".")[:-1]:
        if part.isdigit():
            return int(part)
    return -1
