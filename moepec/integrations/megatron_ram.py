"""The Megatron-Core door's RAM level, and what a shard of its sharded state dict is to
moepec (its flat key, the tensor written for it).

:meth:`RamLevel.snapshot` (``moepec.integrations.megatron.snapshot``), next to the
training step, copies this rank's shards into the flat front end's RAM tier
(:class:`moepec.flat.FlatRam`: node-local shared memory that outlives the worker); a
``dist_checkpointing.load`` of the newest committed folder of a save directory (the one
Megatron-LM's ``--load`` picks) reads them back when the snapshot is newer than that
folder and of its lineage (:meth:`RamLevel.load`, called by the door's load strategy).
A load of any other folder reads that folder, never RAM, and abandons the later
snapshots.

A snapshot holds every ShardedTensor's data and every ShardedObject (as tagged JSON,
:mod:`moepec.state.objects`: nothing is pickled, nor unpickled at a load) this rank holds,
replicas included, so a restarted rank reads its own shards alone at the same parallel
layout (another layout: storage serves). It does not hold the *common* state (the
non-sharded values Megatron writes to ``common.pt``): ``dist_checkpointing.load`` reads
the folder's ``common.pt`` before any sharded strategy runs and refuses to merge a second
value over it, so a load from RAM returns the storage folder's common values. Keep what
changes every step in sharded objects, or take the step from ``last_load_report().step``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

from moepec.errors import ConfigError
from moepec.flat import FlatFrontEnd, FlatRam, encode_object, ram_report
from moepec.hooks import FaultHooks
from moepec.integrations.megatron_checks import OBJECT
from moepec.integrations.megatron_keys import flat_key

log = logging.getLogger(__name__)

Shard = ShardedTensor | ShardedObject


def flat_key_of(x: Shard) -> str:
    return flat_key(x) if isinstance(x, ShardedTensor) else f"{OBJECT}{x.unique_key}"


def shards(sharded_state_dict: Any) -> dict[str, Shard]:
    """Every ShardedTensor and ShardedObject by flat key."""
    return {flat_key_of(x): x for x in nested_values(sharded_state_dict)
            if isinstance(x, (ShardedTensor, ShardedObject))}


def value(x: Shard) -> torch.Tensor:
    """What is written for a shard: its tensor, or its object as tagged JSON (no pickle;
    moepec.state.objects)."""
    if isinstance(x, ShardedTensor):
        return x.data
    return encode_object(x.data, f"ShardedObject {x.key!r}",
                         fix="keep _extra_state and other sharded objects plain data")


def empty(sh: Shard) -> bool:
    """A shard with no values (a rank's zero-length part of an uneven split): nothing to
    write, and the load makes it without reading."""
    if not isinstance(sh, ShardedTensor):
        return False
    rng = sh.flattened_range
    return (rng.stop - rng.start if rng is not None else math.prod(sh.local_shape)) == 0


class RamLevel:
    """The door's RAM level in this process: off until :meth:`configure` is given a
    ``ram_dir``; one :class:`~moepec.flat.FlatRam` per save directory."""

    def __init__(self, front: Callable[[], FlatFrontEnd]) -> None:
        """``front``: the door's current front end (the lineage a snapshot continues)."""
        self._front = front
        self.on = False
        self.ram_dir: str | None = None
        self._rams: dict[str, FlatRam] = {}
        self.hooks: FaultHooks | None = None
        self.report: Any = None
        """The report of the last load if it was from RAM, else None."""
        self._told: set[str] = set()

    def configure(self, fields: dict[str, Any]) -> dict[str, Any]:
        """At :func:`~moepec.integrations.megatron.register`: take ``ram_dir`` (turns the
        level on: ``"auto"``, a folder, or None for in-process snapshots) out of
        ``fields`` and return the rest; ``hooks``: the snapshots' fault-injection seams
        (:class:`moepec.hooks.FaultHooks`, for tests). Drops the mappings of an earlier configuration."""
        rest = dict(fields)
        on, ram_dir = "ram_dir" in rest, rest.pop("ram_dir", None)
        if ram_dir is not None and (not isinstance(ram_dir, str) or not ram_dir):
            raise ConfigError(f"ram_dir must be 'auto', a folder path (e.g. /dev/shm/moepec) "
                              f"or None for in-process snapshots (got {ram_dir!r})")
        self.close(unlink=False)
        self.on, self.ram_dir, self.hooks = on, ram_dir, rest.pop("hooks", None)
        self.report = None
        return rest

    def ram(self, root: str) -> FlatRam:
        if root not in self._rams:
            self._rams[root] = FlatRam(root, ram_dir=self.ram_dir, hooks=self.hooks)
        return self._rams[root]

    def snapshot(self, sharded_state_dict: Any, iteration: int, checkpoint_dir: str) -> bool:
        """All ranks, after the optimizer step of ``iteration``: the frequent level of the
        two-level checkpoint. Copies this rank's shards of ``sharded_state_dict`` (built
        for this call, as for a save: its factories are applied to it) into a RAM slot,
        committed header last; blocks until it is. A restarted worker's
        ``dist_checkpointing.load`` of the newest folder of ``checkpoint_dir`` (the save
        directory, holding the ``iter_*`` folders) takes it when it is newer. Returns
        whether a snapshot was taken: none before the first save or load of
        ``checkpoint_dir`` in this process (nothing would name its lineage). Raises
        ConfigError when the RAM level is off or the common state holds ``iteration``
        (Megatron-LM's: a RAM load would mix iterations); CheckpointError when the copy
        failed."""
        if not self.on:
            raise ConfigError("snapshot() needs the RAM level: call pec.register(ram_dir="
                              "'auto', ...) (or use_for_torch_dist(ram_dir=...)) on every "
                              "rank before the first load or save")
        sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
        if "iteration" in common:
            raise ConfigError(
                "snapshot(): this state dict keeps 'iteration' in its common state (as "
                "Megatron-LM's checkpointing does), which a load from RAM would take from "
                "the storage folder while the weights come from the snapshot; the RAM "
                "level serves a loop that keeps its step outside the common state (resume "
                "after last_load_report().step): leave 'iteration' out of the snapshot's "
                "state dict")
        root = os.path.abspath(checkpoint_dir)
        parent = self._front().lineage_uid(root)
        if not parent:
            self._once(f"first:{root}", "moepec: RAM snapshots of %s start after its first "
                       "save or load", root)
            return False
        if common:
            self._once("common", "moepec: RAM snapshots hold the sharded state only; a load "
                       "from RAM returns these common (non-sharded) values as the storage "
                       "folder holds them: %s", ", ".join(_paths(common)[:8]),
                       level=logging.WARNING)
        tensors = {k: value(sh) for k, sh in shards(sharded).items() if not empty(sh)}
        self.ram(root).snapshot(int(iteration), tensors, parent)
        return True

    def load(self, root: str, name: str, reads: Sequence[str]) -> dict[str, torch.Tensor]:
        """All ranks, the door's load of ``reads`` (flat keys) of folder ``name``: from the
        newest RAM snapshot when ``name`` is the newest committed folder, the snapshot is
        newer and of its lineage, and every rank's snapshot holds every key it reads;
        else from storage. Afterwards the slots newer than what was loaded are
        invalidated. Returns copies by key; raises as ``FlatFrontEnd.load``."""
        found = self._newest(root, name, reads)
        targets, report = self._front().load(root, name, [] if found else reads, agree=True)
        self.report = None
        if found is not None:
            step, held = found
            targets = {k: held[k].clone() for k in reads}  # the slot is reused
            self.report = ram_report(report, step)
            if dist.get_rank() == 0:
                log.info("moepec: loaded the RAM snapshot of iteration %d (newer than %s)",
                         step, name)
        if self.on:
            self.ram(root).settle(None if found is None else found[0])
        return targets

    def _newest(self, root: str, name: str, reads: Sequence[str]
                ) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        if not self.on:
            return None
        ram, box = self.ram(root), [None]
        if dist.get_rank() == 0 and self._front().newest(root) == name:
            box[0] = (ram.head(name),)
        dist.broadcast_object_list(box, src=0)  # rank 0's view of the folders: one path
        if box[0] is None:
            return None
        found = ram.newest(box[0][0], lambda key: key)  # each rank holds its own
        if found is None:
            return None
        missing: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(missing, sum(k not in found[1] for k in reads))
        if any(missing):
            self._once(f"layout:{root}", "moepec: the RAM snapshot of step %d lacks %d "
                       "shard(s) this load reads (another parallel layout?); loading %s "
                       "from storage", found[0], sum(missing), name, level=logging.WARNING)
            return None
        return found

    def _once(self, what: str, message: str, *args: Any, level: int = logging.INFO) -> None:
        if what not in self._told and dist.get_rank() == 0:
            log.log(level, message, *args)
        self._told.add(what)

    def close(self, unlink: bool = True) -> None:
        """Drop the RAM tiers' mappings; with ``unlink`` (a clean end of the run) remove
        this rank's slots."""
        rams, self._rams = self._rams, {}
        for ram in rams.values():
            ram.close(unlink)


def _paths(common: Any, prefix: str = "") -> list[str]:
    """The dotted paths of the leaves of a common state dict."""
    if isinstance(common, dict) and common:
        return [p for k, v in common.items() for p in _paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]
