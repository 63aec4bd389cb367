"""The Megatron-Core door's RAM level, and what a shard of its sharded state dict is to
moepec (its flat key, the tensor written for it).

:meth:`MegatronRam.snapshot` (``moepec.integrations.megatron.snapshot``), next to the
training step, copies this rank's shards into the flat front end's RAM tier
(:class:`moepec.flat.RamLevel`: node-local shared memory that outlives the worker); a
``dist_checkpointing.load`` of the newest committed folder of a save directory (the one
Megatron-LM's ``--load`` picks) reads them back when the snapshot is newer than that
folder and of its lineage (:meth:`MegatronRam.load`, called by the door's load strategy).
A load of any other folder reads that folder, never RAM, and abandons the later
snapshots.

A snapshot holds every ShardedTensor's data and every ShardedObject (as tagged JSON,
:mod:`moepec.state.objects`: nothing is pickled, nor unpickled at a load) this rank holds,
replicas included, so a restarted rank reads its own shards alone at the same parallel
layout (another layout: storage serves); and the *common* state (the non-sharded values
Megatron writes to ``common.pt``: the optimizer's ``common_step``; of Megatron-LM's state
dict also its ``args``, ``iteration``, scheduler and FLOP count), as tagged JSON. ``dist_checkpointing.load`` reads the folder's ``common.pt`` before any sharded
strategy runs and refuses to merge a second value over it, so the RAM level's common load
strategy (:class:`CommonLoad`, Megatron's ``torch`` one that also hands the RAM level the
dict it read) lets a load from RAM set the snapshot's common values in that dict: what
Megatron-LM's ``load_checkpoint`` reads after the load (iteration, ``args``' sample
counts, scheduler, FLOP count; the RNG states are a sharded object) is the snapshot's.
:meth:`MegatronRam.snapshot_megatron_lm` builds the snapshot's dict with Megatron-LM's
own code (:mod:`moepec.integrations.megatron_lm`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.base import (
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

import moepec
from moepec.errors import ConfigError
from moepec.flat import (
    Choice,
    FlatFrontEnd,
    RamFound,
    RamLevel,
    decode_object,
    encode_object,
    split_folder,
)
from moepec.integrations.megatron_checks import ENUMS, OBJECT
from moepec.integrations.megatron_keys import flat_key, split_experts
from moepec.integrations.megatron_lm import megatron_lm_state_dict

log = logging.getLogger(__name__)

Shard = ShardedTensor | ShardedObject

COMMON = "common:"
"""The flat key of a snapshot's common state (tagged JSON; no shard's key: those hold a
``#``, a sharded object's begins with ``object:``)."""


def flat_key_of(x: Shard) -> str:
    return flat_key(x) if isinstance(x, ShardedTensor) else f"{OBJECT}{x.unique_key}"


def shards(sharded_state_dict: Any) -> dict[str, Shard]:
    """Every ShardedTensor and ShardedObject by flat key, one per expert
    (:class:`Pieces`)."""
    return Pieces(sharded_state_dict).by_key


class Pieces:
    """The door's one view of a sharded state dict (save, load and RAM snapshot alike):
    its shards, each shard of several experts cut into one per expert
    (``megatron_keys.split_experts``: views of its data), so that a save writes, and a
    load reads, the same per-expert shards whatever the key layout."""

    def __init__(self, sharded_state_dict: Any) -> None:
        self.parts = {id(x): split_experts(x) if isinstance(x, ShardedTensor) else [x]
                      for x in nested_values(sharded_state_dict)
                      if isinstance(x, (ShardedTensor, ShardedObject))}
        """Each ShardedTensor and ShardedObject of the dict by ``id``: its pieces."""
        self.by_key: dict[str, Shard] = {flat_key_of(p): p for ps in self.parts.values()
                                         for p in ps}
        """Every piece by flat key."""

    def whole(self, x: Any, loaded: Mapping[int, Any]) -> Any:
        """The loaded value of ``x`` (a leaf of the dict; any other than a shard is
        itself) from its pieces' (``loaded``, by the pieces' ``id``): ``x``'s own tensor
        when every piece was filled in place (views of it), else the pieces' values
        joined on the cut axis."""
        parts = self.parts.get(id(x)) if isinstance(x, (ShardedTensor, ShardedObject)) \
            else None
        if parts is None:
            return x
        if len(parts) == 1:
            return loaded[id(parts[0])]
        values = [loaded[id(p)] for p in parts]
        if x.data is not None and all(v is p.data for v, p in zip(values, parts, strict=True)):
            return x.data
        axis = next(a for a, (n, m) in enumerate(zip(x.local_shape, parts[0].local_shape,
                                                     strict=True)) if n != m)
        return torch.cat(values, dim=axis)


def value(x: Shard) -> torch.Tensor:
    """What is written for a shard: its tensor, or its object as tagged JSON (no pickle;
    moepec.state.objects)."""
    if isinstance(x, ShardedTensor):
        return x.data
    return encode_object(x.data, f"ShardedObject {x.key!r}", enums=ENUMS,
                         fix="keep _extra_state and other sharded objects plain data")


def empty(sh: Shard) -> bool:
    """A shard with no values (a rank's zero-length part of an uneven split): nothing to
    write, and the load makes it without reading."""
    if not isinstance(sh, ShardedTensor):
        return False
    rng = sh.flattened_range
    return (rng.stop - rng.start if rng is not None else math.prod(sh.local_shape)) == 0


class CommonLoad(TorchCommonLoadStrategy):
    """Megatron's ``torch`` common load (``common.pt``), which also hands ``ram`` the dict
    it read: ``dist_checkpointing.load`` builds its result on it, and a load from RAM sets
    the snapshot's common values in it (:meth:`MegatronRam.load`)."""

    def __init__(self, ram: MegatronRam) -> None:
        super().__init__()
        self.ram = ram

    def load_common(self, checkpoint_dir: Any) -> Any:
        common = super().load_common(checkpoint_dir)
        self.ram.read_common(str(checkpoint_dir), common)
        return common


class MegatronRam:
    """The door's RAM level in this process (:class:`moepec.flat.RamLevel`): off until
    :meth:`configure` is given a ``ram_dir``; what is Megatron's here: shards as flat
    keys, and which folder a load of "the newest" means."""

    def __init__(self, front: Callable[[], FlatFrontEnd]) -> None:
        """``front``: the door's current front end (the lineage a snapshot continues)."""
        self.level = RamLevel(front)
        self._front = front
        self._common: tuple[tuple[str, str], Any] | None = None
        """The common state dict the last common load read, and of which folder."""

    @property
    def report(self) -> moepec.RestoreReport | None:
        """The report of the last load if it was from RAM, else None."""
        return self.level.report

    def configure(self, fields: dict[str, Any]) -> dict[str, Any]:
        """At :func:`~moepec.integrations.megatron.register`: take ``ram_dir`` (turns the
        level on: ``"auto"``, a folder, or None for in-process snapshots), ``ram_replicas``
        (as ``CheckpointConfig``'s) and ``hooks``
        (the snapshots' fault-injection seams, :class:`moepec.hooks.FaultHooks`, for
        tests) out of ``fields`` and return the rest. Drops the mappings of an earlier
        configuration. With the level on, Megatron's default ``torch`` common load is
        :class:`CommonLoad` (else its own)."""
        rest = dict(fields)
        on, ram_dir = "ram_dir" in rest, rest.pop("ram_dir", None)
        self.level.configure(on, ram_dir, rest.pop("hooks", None),
                             rest.pop("ram_replicas", None))
        self._common = None
        register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1,
                                  CommonLoad(self) if on else TorchCommonLoadStrategy())
        return rest

    def read_common(self, checkpoint_dir: str, common: Any) -> None:
        """:class:`CommonLoad`: ``common`` is the common state dict of ``checkpoint_dir``
        that the load in progress returns."""
        self._common = (split_folder(checkpoint_dir), common)

    def snapshot(self, sharded_state_dict: Any, iteration: int, checkpoint_dir: str) -> bool:
        """All ranks, after the optimizer step of ``iteration``: the frequent level of the
        two-level checkpoint. Copies this rank's shards of ``sharded_state_dict`` (built
        for this call, as for a save: its factories are applied to it) into a RAM slot;
        blocks until copied (its seal, header last, follows on the copy thread). A
        restarted worker's ``dist_checkpointing.load`` of the newest folder of
        ``checkpoint_dir`` (the save directory, holding the ``iter_*`` folders) takes it
        when it is newer. Returns whether a snapshot was taken: none before the first
        save or load of ``checkpoint_dir`` in this process (nothing would name its
        lineage). Megatron-LM's own state dict (:meth:`snapshot_megatron_lm`) is taken
        whole, its ``iteration`` and ``args`` in the common state included. Raises
        ConfigError when the RAM level is off, the common state's ``iteration`` is not
        ``iteration``, or a value is of a type moepec does not store (naming it);
        CheckpointError when the copy failed."""
        if not self.level.on:
            raise ConfigError("snapshot() needs the RAM level: call pec.register(ram_dir="
                              "'auto', ...) (or use_for_torch_dist(ram_dir=...)) on every "
                              "rank before the first load or save")
        sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
        if common.get("iteration", iteration) != iteration:
            raise ConfigError(f"snapshot(): the state dict's 'iteration' is "
                              f"{common['iteration']!r}, not the {iteration} given: a load "
                              f"from RAM would resume at the wrong iteration; pass the same")

        def tensors() -> dict[str, torch.Tensor]:
            out = {k: value(sh) for k, sh in shards(sharded).items() if not empty(sh)}
            return out | ({COMMON: encode_object(
                common, "snapshot()'s common state", enums=ENUMS, fix="keep the common "
                "(non-sharded) values JSON values, tensors, numpy values, Namespaces, "
                "torch dtypes or Megatron's enums (megatron_checks.ENUMS), or move them "
                "into sharded objects")} if common else {})
        return self.level.snapshot(checkpoint_dir, iteration, tensors)

    def snapshot_megatron_lm(self, iteration: int, model: Any, optimizer: Any,
                             opt_param_scheduler: Any,
                             num_floating_point_operations_so_far: float,
                             train_data_iterator: Any = None) -> bool:
        """:meth:`snapshot` of Megatron-LM's own state dict (its ``save_checkpoint``'s
        arguments; :func:`~moepec.integrations.megatron_lm.megatron_lm_state_dict`) into
        its ``--save`` directory: all ranks, in Megatron-LM's ``train()`` after
        ``train_step`` (and the increments of ``iteration`` and the sample and FLOP
        counts that follow it). A restarted run's ``--load`` of that directory resumes at
        this iteration when the snapshot is newer than its newest folder. Returns and
        raises as :meth:`snapshot`."""
        state, save_dir = megatron_lm_state_dict(model, optimizer, opt_param_scheduler,
                                                 iteration,
                                                 num_floating_point_operations_so_far,
                                                 train_data_iterator)
        return self.snapshot(state, iteration, save_dir)

    def load(self, root: str, name: str, reads: Sequence[str],
             into: Mapping[str, Any] | None = None, known: Choice | None = None
             ) -> dict[str, torch.Tensor]:
        """All ranks, the door's load of ``reads`` (flat keys) of folder ``name``: from the
        newest RAM snapshot when ``name`` is the newest committed folder, the snapshot is
        newer and of its lineage, and every rank's snapshot holds every key it reads;
        else from storage. Afterwards the slots newer than what was loaded are
        invalidated. Returns copies by key (from RAM, a key's tensor of ``into`` of the
        same shape and dtype filled in place); raises as ``FlatFrontEnd.load``.
        ``known``: the folder's ``FlatFrontEnd.folder``, when the door read it already
        (its manifests are then read once in all)."""
        found = self._newest(root, name, reads, known, into)
        (folder, common), self._common = self._common or (None, None), None
        self.level.report = None
        if found is None:
            targets, _ = self._front().load(root, name, reads, agree=True, known=known)
        else:
            self.level.take(found, known)
            targets = self.level.copies(found, reads, into)
            if COMMON in found.tensors and folder == (root, name):
                _overlay(common, decode_object(found.tensors[COMMON], COMMON, enums=ENUMS))
            elif COMMON in found.tensors:
                self.level.once("common", "moepec: a load from RAM with a common strategy "
                                "of its own returns the storage folder's common values",
                                level=logging.WARNING)
        self.level.settle(root, None if found is None else found.step)
        return targets

    def _newest(self, root: str, name: str, reads: Sequence[str], known: Choice | None,
                into: Mapping[str, Any] | None = None) -> RamFound | None:
        if not self.level.on:
            return None
        box: list[Any] = [None]
        if dist.get_rank() == 0 and self._front().newest(root, known) == name:
            box[0] = (self.level.head(root, name) if known is None
                      else known.manifests[name],)
        dist.broadcast_object_list(box, src=0)  # rank 0's view of the folders: one path
        if box[0] is None:
            return None
        found = self.level.newest(root, name, box[0][0], into=into)  # its own, each rank
        if found is None:
            return None
        missing: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(missing, sum(k not in found.tensors for k in reads))
        if any(missing):
            self.level.once(f"layout:{root}", "moepec: the RAM snapshot of step %d lacks %d "
                            "shard(s) this load reads (another parallel layout?); loading "
                            "%s from storage", found.step, sum(missing), name,
                            level=logging.WARNING)
            return None
        return found

    def close(self, unlink: bool = True) -> None:
        """Drop the RAM tiers' mappings; with ``unlink`` (a clean end of the run) remove
        this rank's slots."""
        self.level.close(unlink)


def _overlay(into: Any, values: Any) -> Any:
    """``values`` set into ``into``, in place where both are dicts (or lists of one
    length): what ``into`` holds that ``values`` lacks (non-persistent values) stays."""
    if isinstance(into, dict) and isinstance(values, dict):
        for k, v in values.items():
            into[k] = _overlay(into[k], v) if k in into else v
        return into
    if isinstance(into, list) and isinstance(values, list) and len(into) == len(values):
        into[:] = [_overlay(a, b) for a, b in zip(into, values)]
        return into
    return values
