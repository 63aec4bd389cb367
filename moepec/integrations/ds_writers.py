"""Which rank writes each key of a DeepSpeed save (a collective over the ranks' keys)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from moepec.flat import Unit


def owned_keys(units: Mapping[str, Unit | None],
               tensors: Mapping[str, torch.Tensor]) -> dict[str, Unit | None]:
    """All ranks (a collective): of this rank's keys, those it writes. A key several
    ranks hold goes to one of them, so each rank writes an even share (the paper's fully
    sharded save): an expert's keys by its index over its expert-data-parallel holders;
    non-expert keys (every data-parallel rank holds the module's), largest first, each to
    the holder with the fewest bytes so far, after what each rank alone writes every
    save. Decided from the gathered keys alone: the same answer on every rank."""
    mine = {k: (-1 if u is None else u[1], tensors[k].numel() * tensors[k].element_size())
            for k, u in units.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    holders: dict[str, list[int]] = {}
    for r, keys in enumerate(every):
        for k in keys:
            holders.setdefault(k, []).append(r)
    load = [sum(n for k, (e, n) in keys.items() if e < 0 and len(holders[k]) == 1)
            for keys in every]
    owner = {k: ranks[0] for k, ranks in holders.items() if len(ranks) == 1}
    shared = [k for k, ranks in holders.items() if len(ranks) > 1]
    for k in sorted(shared, key=lambda k: (-every[holders[k][0]][k][1], k)):
        ranks = holders[k]
        expert, n = every[ranks[0]][k]
        if expert >= 0:
            owner[k] = ranks[expert % len(ranks)]
        else:
            owner[k] = min(ranks, key=lambda r: (load[r], r))
            load[owner[k]] += n
    me = dist.get_rank()
    return {k: u for k, u in units.items() if owner[k] == me}
