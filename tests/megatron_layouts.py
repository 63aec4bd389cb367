"""The checks that the grouped-experts workers share (tests/megatron_te_worker.py:
TEGroupedMLP; tests/megatron_grouped_worker.py: the legacy GroupedMLP): each
(layer, expert) found once over the ranks with its shards, then three saves with K = 1
of 4 and a fresh model's load equal, bit for bit, to the documented rotation. Imports
megatron: the caller installs its stand-ins (and the CPU shims) first."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factories,
)
from megatron_model import N_EXPERTS, build, sharded
from megatron_worker import make_folder, oracle, train_a_bit

import moepec.integrations.megatron as mg
from moepec.integrations.megatron_ram import shards as door_shards


def set_metadata(model, singleton: bool) -> None:
    """The run's choice of sharded keys, for every sharded_state_dict() call."""
    if singleton:
        model.sharded_state_dict = functools.partial(
            model.sharded_state_dict, metadata={"singleton_local_shards": True})


def make(grouped: str, class_name: str, singleton: bool, seed: int):
    """A fresh model and optimizer with ``grouped`` experts (megatron_model.build), the
    expert class checked, saving with or without ``singleton_local_shards``."""
    model, opt = build(seed=seed, grouped=grouped)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == class_name
    set_metadata(model, singleton)
    return model, opt


def expert_shards(model, opt) -> dict:
    """This rank's expert units as the door reads them (Megatron's factories applied,
    as dist_checkpointing.save does; a shard of several experts cut per expert, as the
    door's one view of a sharded state dict does): unit -> Counter of shard names."""
    sd = sharded(model, opt)
    apply_factories(sd)
    units: dict = {}
    for x in door_shards(sd).values():
        if isinstance(x, ShardedTensor):
            unit = mg.expert_unit(x)
        elif isinstance(x, ShardedObject):
            unit = mg.object_unit(x)
        else:
            continue
        if unit is not None:  # the shard's name inside its expert: no layer, no expert
            name = re.sub(r"^\d+\.", "", x.key.rsplit("experts.", 1)[1])
            kind = x.key.split(".")[2] if x.key.startswith("optimizer.state.") else "param"
            units.setdefault(unit, Counter())[f"{kind}:{name}"] += 1
    return units


def swiglu_shards(singleton: bool) -> Counter:
    """An expert's shards with swiglu: ``linear_fc1``'s two halves (``..._w`` / ``..._v``
    keys with singleton shards), ``linear_fc2``'s weight, their Adam moments, and one
    ``_extra_state`` per linear."""
    fc1 = ("weight_w", "weight_v") if singleton else ("weight",) * 2
    want = Counter()
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        want.update(f"{kind}:linear_fc1.{w}" for w in fc1)
        want[f"{kind}:linear_fc2.weight"] += 1
    want.update(["param:linear_fc1._extra_state", "param:linear_fc2._extra_state"])
    return want


def check_identity(model, opt, want: Counter) -> None:
    """Every (layer, expert) found once over the ranks, this rank's own experts (EP =
    world size), each with the shards ``want``."""
    units = expert_shards(model, opt)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, units)
    found = [u for rank_units in every for u in rank_units]
    assert len(found) == len(set(found)) == 2 * N_EXPERTS, found  # each once, over ranks
    per_layer = Counter(layer for layer, _ in found)
    assert sorted(per_layer.values()) == [N_EXPERTS, N_EXPERTS], per_layer
    assert all(sorted(e for lay, e in found if lay == layer) == list(range(N_EXPERTS))
               for layer in per_layer), found
    per_rank = N_EXPERTS // dist.get_world_size()
    mine = range(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    assert sorted({e for _, e in units}) == list(mine), units
    for unit, shards in units.items():
        assert shards == want, (unit, shards, want)


def saves_and_load(root: str, singleton: bool, make: Callable, state: Callable,
                   tag: str, perturb: Callable | None = None) -> dict[str, torch.Tensor]:
    """Three saves with K = 1 of 4 into ``root`` (``make(seed)`` -> (model, opt) with the
    run's metadata set; weights and moments changed before each, and ``perturb(model,
    seed)`` if given), the identity checked after the first step; a fresh model loads the
    last folder and ``state(model, opt)`` must equal the oracle bit for bit. Prints
    ``rank R <tag> OK singleton=S <n> tensors <stale> stale of <units>``; returns the
    oracle (this rank's expected state)."""
    mg.register()  # a fresh front end for this save directory
    model, opt = make(1)
    history = []
    for c in range(3):
        train_a_bit(model, opt, seed=c)
        if c == 0:  # Adam's moments exist after its first step
            check_identity(model, opt, swiglu_shards(singleton))
        if perturb is not None:
            perturb(model, c)
        history.append(state(model, opt))
        folder = os.path.join(root, f"iter_{c * 10:07d}")
        make_folder(folder)
        dist_checkpointing.save(sharded(model, opt), folder, sharded_strategy=("moepec", 1))
    fresh, fresh_opt = load_fresh(make, folder)
    got, expected = state(fresh, fresh_opt), oracle(history)
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())[:5]
    diff = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not diff, f"rank {dist.get_rank()}: {len(diff)} differ, e.g. {diff[:3]}"
    report = mg.last_load_report()
    stale = sum(s["checkpoint"] != os.path.basename(folder) for s in report.sources.values())
    sys.stdout.write(f"rank {dist.get_rank()} {tag} OK singleton={singleton} {len(got)} "
                     f"tensors {stale} stale of {len(report.sources)}\n")
    sys.stdout.flush()
    return expected


def load_fresh(make: Callable, folder: str):
    """A fresh model and optimizer (``make(2)``) with ``folder`` loaded into them by a
    plain ``dist_checkpointing.load``."""
    fresh, fresh_opt = make(2)
    loaded = dist_checkpointing.load(sharded(fresh, fresh_opt, loading=True), folder)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    return fresh, fresh_opt
