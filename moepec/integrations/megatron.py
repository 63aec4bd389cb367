"""Megatron-Core: a ``dist_checkpointing`` backend ``("moepec", 1)`` that saves K of N
experts per MoE layer.

Importing this module registers the backend (save, async save, load) with Megatron's
strategy registry::

    import moepec.integrations.megatron  # registers ("moepec", 1), K = 1
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sd, f"{save}/iter_{it:07d}", sharded_strategy=("moepec", 1))
    state = dist_checkpointing.load(sd, f"{save}/iter_{it:07d}")  # no strategy argument

Every non-expert shard is written at every save; of each MoE layer's experts, K are
(round-robin, ``moepec.recovery.flat_view``). Expert identity comes from the sharded
state dict itself: the expert axis of SequentialMLP's (and GroupedMLP's factories')
``...experts.experts.*`` shards, or the per-expert keys ``...experts.<e>.*`` of
``metadata={'singleton_local_shards': True}``; optimizer state keyed by the parameter's
key (``optimizer.state.<name>.<param key>``: a plain optimizer, or the distributed
optimizer's ``fully_reshardable`` format) goes with its expert. The distributed
optimizer's ``dp_reshardable`` buckets lose which expert a value belongs to and are
refused. Each iteration folder is a moepec flat checkpoint (``moepec.store.flat``) whose
view names the sibling folders that hold older expert copies; ``load`` stitches each
expert's newest copy and reports the lost expert-steps (:func:`last_load_report`);
``moepec verify SAVE_DIR`` says which folders each one still needs.

``ShardedObject`` s (e.g. ``_extra_state``) are stored as tagged JSON
(``moepec.state.objects``), an expert's with its expert. Megatron's own parts stay
Megatron's: the common state (``common.pt``, written and read by its ``torch`` common
strategy with ``torch.load``, weights_only by default in torch >= 2.6), and
``metadata.json`` (backend and version), written after moepec's manifest. A load must use the sharding the save
used (same TP, PP and EP: shards are matched by their exact offsets, no resharding).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

from moepec.errors import MoepecError
from moepec.keys import MANIFEST_NAME
from moepec.recovery.flat_view import (
    StitchReport,
    Unit,
    keys_to_write,
    next_view,
    select_units,
    stitch_report,
)
from moepec.state.objects import decode_object, encode_object
from moepec.store.flat import (
    FlatManifest,
    commit,
    empty_like_item,
    read_keys,
    read_manifest,
    read_records,
    scan,
    split_folder,
    write_rank,
)

log = logging.getLogger(__name__)

BACKEND = "moepec"
VERSION = 1
_OPTIM_PREFIX = re.compile(r"^optimizer\.state\.[^.]+\.")
_SEQUENTIAL = re.compile(r"^(.*?)(?:^|\.)experts\.experts\.")
_SINGLETON = re.compile(r"^(.*?)(?:^|\.)experts\.(\d+)\.")
_GROUPED = re.compile(r"^(.*?)(?:^|\.)experts\.")
_BUCKETS = "optimizer.distributed."
_ITER = re.compile(r"(\d+)$")
_last_report: list[StitchReport] = []


def last_load_report() -> StitchReport | None:
    """What the last ``dist_checkpointing.load`` of a moepec folder in this process
    restored: the experts that came from older folders and the lost expert-steps."""
    return _last_report[-1] if _last_report else None


def flat_key(sh: ShardedTensor) -> str:
    """One shard's key in the flat checkpoint: the sharded key, its global offsets and
    local shape (prepended axes included) and, for a flattened shard, its range."""
    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    key = (f"{sh.key}#{','.join(map(str, sh.global_offset))}"
           f"+{','.join(map(str, shape))}")
    if sh.flattened_range is not None:
        key += f"~{sh.flattened_range.start}:{sh.flattened_range.stop}"
    return key


def expert_unit(sh: ShardedTensor) -> Unit | None:
    """(layer, expert) of an expert shard, None for any other. ``layer`` is the key
    prefix before ``experts`` with the offsets of the axes before the expert axis."""
    key = _OPTIM_PREFIX.sub("", sh.key)
    offsets = tuple(sh.global_offset)
    if m := _SINGLETON.match(key):  # singleton_local_shards: the expert is in the key
        return f"{m[1]}@{offsets[:sh.prepend_axis_num]}", int(m[2])
    if m := _SEQUENTIAL.match(key):  # SequentialMLP: the expert axis is prepended last
        axis = sh.prepend_axis_num - 1
    elif m := _GROUPED.match(key):  # GroupedMLP's factories: the first local axis
        axis = sh.prepend_axis_num
    else:
        return None
    if axis < 0 or (axis >= sh.prepend_axis_num
                    and sh.local_shape[axis - sh.prepend_axis_num] != 1):
        raise CheckpointingException(
            f"moepec: shard {sh.key!r} holds several experts in one shard; save with "
            f"metadata={{'singleton_local_shards': True}} so each expert is a shard")
    return f"{m[1]}@{offsets[:axis]}", offsets[axis]


def object_unit(obj: ShardedObject) -> Unit | None:
    """(layer, expert) of an expert's ShardedObject (its ``_extra_state``), None for any
    other: the expert is the last offset (or in the key, for singleton shards, whose
    last offset is a placeholder 0 of 1)."""
    offsets = tuple(obj.global_offset)
    if m := _SINGLETON.match(obj.key):
        return f"{m[1]}@{offsets[:-1]}", int(m[2])
    if (m := _GROUPED.match(obj.key)) and offsets:
        return f"{m[1]}@{offsets[:-1]}", offsets[-1]
    return None


Shard = ShardedTensor | ShardedObject


def _flat_key_of(x: Shard) -> str:
    return flat_key(x) if isinstance(x, ShardedTensor) else f"object:{x.unique_key}"


def _unit_of(x: Shard) -> Unit | None:
    return expert_unit(x) if isinstance(x, ShardedTensor) else object_unit(x)


def _value(x: Shard) -> torch.Tensor:
    """What is written for a shard: its tensor, or its object as tagged JSON (no pickle;
    moepec.state.objects)."""
    if isinstance(x, ShardedTensor):
        return x.data
    return encode_object(x.data, f"ShardedObject {x.key!r}",
                         fix="keep _extra_state and other sharded objects plain data")


def _shards(sharded_state_dict: Any) -> dict[str, Shard]:
    """Every ShardedTensor and ShardedObject by flat key."""
    return {_flat_key_of(x): x for x in nested_values(sharded_state_dict)
            if isinstance(x, (ShardedTensor, ShardedObject))}


def _main_shards(sharded_state_dict: Any) -> dict[str, Shard]:
    """This rank's main-replica shards by flat key; refuses dp_reshardable."""
    out: dict[str, Shard] = {}
    for key, sh in _shards(sharded_state_dict).items():
        if sh.key.startswith(_BUCKETS):
            raise CheckpointingException(
                "moepec: the distributed optimizer's 'dp_reshardable' format stores flat "
                "buckets that lose which expert a value belongs to; save with "
                "metadata={'distrib_optim_sharding_type': 'fully_reshardable'}")
        if is_main_replica(sh.replica_id):
            out[key] = sh
    return out


@dataclass(frozen=True, slots=True)
class _Plan:
    """One save as planned on every rank (the same on all but ``tensors``)."""

    root: str
    name: str
    seq: int
    step: int
    parent: str | None
    view: dict[str, str]
    experts: dict[str, Unit]
    saved: list[Unit]
    written: frozenset[str]
    k_persist: int
    world_size: int


def _stage(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The consistent snapshot: a host copy of every tensor to write, taken when the
    request is scheduled (training may change the live tensors right after)."""
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


class MoepecSaveStrategy(AsyncSaveShardedStrategy):
    """Saves non-expert shards and K experts per layer into a moepec flat checkpoint.

    ``async_save`` (all ranks, training thread) gathers every rank's keys, picks the
    experts, and returns an ``AsyncRequest`` whose preload copies the chosen tensors to
    host memory (what the training loop waits for), whose async function writes this
    rank's files (any process; no collective), and whose finalize function (all ranks)
    has rank 0 commit the manifest once every rank's record exists.
    """

    def __init__(self, k_persist: int = 1, backend: str = BACKEND,
                 version: int = VERSION) -> None:
        super().__init__(backend, version)
        if not isinstance(k_persist, int) or k_persist < 1:
            raise ValueError(f"k_persist must be an int >= 1 (got {k_persist!r})")
        self.k_persist = k_persist
        self._pending: _Plan | None = None
        self._head: _Plan | None = None  # the last save this process committed

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # as JSON in moepec's files, K of N experts' too: nothing pickled

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike
                   ) -> AsyncRequest:
        root, name = split_folder(checkpoint_dir)
        shards = _main_shards(sharded_state_dict)
        units = {k: _unit_of(sh) for k, sh in shards.items()}
        every: list[dict[str, Unit | None]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, units)
        parent = self._parent(root, name)
        plan = self._plan(root, name, every, parent)
        written = [k for k in shards if k in plan.written]
        tensors = {k: _value(shards[k]) for k in written}
        self._pending = plan
        folder = os.path.join(root, name)
        return AsyncRequest(write_rank, (folder, tensors, dist.get_rank()),
                            [functools.partial(self._finalize, plan)],
                            preload_fn=functools.partial(_stage, tensors))

    def _parent(self, root: str, name: str) -> tuple[str, int, dict[str, str]] | None:
        """(name, seq, view) of the folder this save continues: the pending save of this
        process, else the newest committed one (rank 0 reads, all ranks agree)."""
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:  # whatever happens, the other ranks must hear of it (they wait below)
                box[0] = self._read_parent(root, name)
            except OSError as exc:
                box[0] = f"moepec: {root} cannot be read ({exc})"
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise CheckpointingException(box[0])
        return box[0]

    def _read_parent(self, root: str, name: str) -> tuple[str, int, dict[str, str]] | str | None:
        """Rank 0: the parent as :meth:`_parent` returns it, or an error message."""
        known = self._pending or self._head
        if known is not None and known.root == root and known.name != name and \
                (known is self._pending or _committed(root, known.name)):
            return known.name, known.seq, known.view  # no need to read it again
        found = scan(root)
        if name in found.manifests:
            return f"moepec: {root}/{name} is a committed checkpoint; save into a new folder"
        head = found.head
        return (head.name, head.seq, dict(head.view)) if head is not None else None

    def _plan(self, root: str, name: str, every: list[dict[str, Unit | None]],
              parent: tuple[str, int, dict[str, str]] | None) -> _Plan:
        n_per_layer: dict[str, int] = {}
        experts: dict[str, Unit] = {}
        for units in every:
            for key, unit in units.items():
                if unit is not None:
                    experts[key] = unit
                    n_per_layer[unit[0]] = max(n_per_layer.get(unit[0], 0), unit[1] + 1)
        seq = parent[1] + 1 if parent else 0
        view = parent[2] if parent else None
        selected = select_units(n_per_layer, seq, self.k_persist)
        written = frozenset(k for units in every for k in keys_to_write(units, view, selected))
        all_keys = [k for units in every for k in units]
        m = _ITER.search(name)
        return _Plan(root=root, name=name, seq=seq, step=int(m[1]) if m else seq,
                     parent=parent[0] if parent else None,
                     view=next_view(view, name, all_keys, written), experts=experts,
                     saved=sorted({experts[k] for k in written if k in experts}),
                     written=written, k_persist=self.k_persist,
                     world_size=len(every))

    def _finalize(self, plan: _Plan) -> None:
        """All ranks, after every rank's writer finished: rank 0 commits; every rank
        learns the outcome (CheckpointingException on all ranks when it failed)."""
        # Megatron joins each rank's writer on that rank only: meet before reading the
        # records (its torch_dist finalize meets in a gather).
        dist.barrier()
        box: list[str | None] = [None]
        if dist.get_rank() == 0:
            try:
                _commit(plan)
            except (MoepecError, OSError, ValueError) as exc:  # every rank must hear it
                box[0] = f"moepec: {plan.root}/{plan.name} not committed: {exc}"
        dist.broadcast_object_list(box, src=0)
        if self._pending is plan:
            self._pending = None
        if box[0] is not None:
            raise CheckpointingException(box[0])
        self._head = plan


def _commit(plan: _Plan) -> None:
    """Rank 0: check every rank wrote what the plan says and every folder the view
    needs is committed, then write the manifest."""
    items = read_records(os.path.join(plan.root, plan.name), plan.world_size)
    if set(items) != plan.written:
        raise MoepecError(f"the ranks wrote {len(items)} items, the plan has "
                          f"{len(plan.written)}")
    gone = sorted(f for f in set(plan.view.values()) - {plan.name}
                  if not _committed(plan.root, f))
    if gone:
        raise MoepecError(f"its view needs {', '.join(gone)}, which is not committed (an "
                          f"earlier save failed or was deleted)")
    commit(plan.root, FlatManifest(
        name=plan.name, seq=plan.seq, step=plan.step, parent=plan.parent, items=items,
        view=plan.view, experts={k: plan.experts[k] for k in plan.view if k in plan.experts},
        experts_saved=plan.saved, k_persist=plan.k_persist, world_size=plan.world_size))
    log.info("moepec: committed %s/%s (%d items, %d expert unit(s) written)", plan.root,
             plan.name, len(items), len(plan.saved))


def _committed(root: str, name: str) -> bool:
    """Whether folder ``name`` of ``root`` has its manifest (the commit rule)."""
    return os.path.exists(os.path.join(root, name, MANIFEST_NAME))


class MoepecLoadStrategy(LoadShardedStrategy):
    """Loads a moepec folder: every requested shard from the folder its view names
    (each expert's newest copy), checksums verified. All ranks call ``load``; each
    reads only its own shards; no collective."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"moepec loads backend {BACKEND!r}, not "
                                         f"{loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"moepec reads backend version {VERSION}, not "
                                         f"{loaded_version}: use the moepec that wrote it")

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike) -> Any:
        try:
            return self._load(sharded_state_dict, checkpoint_dir)
        except MoepecError as exc:
            raise CheckpointingException(f"moepec: {exc}") from exc

    def _load(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike) -> Any:
        root, name = split_folder(checkpoint_dir)
        head = read_manifest(root, name)
        manifests = {name: head} | {n: read_manifest(root, n) for n in head.needs()}
        shards = _shards(sharded_state_dict)
        missing = [k for k in shards if k not in head.view]
        if missing:
            raise MoepecError(f"{root}/{name} has no shard {missing[0]!r:.160} (and "
                              f"{len(missing) - 1} more): load with the parallel layout "
                              f"the checkpoint was saved with")
        sources = {k: head.view[k] for k in shards}
        targets = {k: empty_like_item(manifests[sources[k]].items[k]) for k in shards}
        bad = read_keys(root, manifests, sources, targets)
        if bad:
            raise MoepecError(f"{len(bad)} shard(s) are damaged (e.g. {sources[bad[0]]}:"
                              f"{bad[0]}); run `moepec verify {root}`")
        report = stitch_report(head, {n: m.step for n, m in manifests.items()})
        _last_report[:] = [report]
        log.info("moepec: loaded %s", report.summary())
        loaded = {id(sh): _into(sh, targets[k]) if isinstance(sh, ShardedTensor)
                  else decode_object(targets[k], f"{sources[k]}:{k}")
                  for k, sh in shards.items()}
        return dict_list_map_inplace(
            lambda x: loaded[id(x)] if isinstance(x, (ShardedTensor, ShardedObject)) else x,
            sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike) -> Any:
        raise CheckpointingException("moepec: tensor metadata without a sharded state dict "
                                     "is not supported; load with the model's sharded "
                                     "state dict")


def _into(sh: ShardedTensor, value: torch.Tensor) -> torch.Tensor:
    """The loaded value in the requested shard's tensor (in place where it has one of
    the same shape and dtype)."""
    data = sh.data
    if isinstance(data, torch.Tensor) and data.shape == value.shape \
            and data.dtype == value.dtype:
        with torch.no_grad():
            data.copy_(value)
        return data
    return value.view(sh.local_shape) if sh.flattened_range is None else value


def register(k_persist: int = 1) -> None:
    """(Re-)register the ``("moepec", 1)`` backend with Megatron's strategy registry:
    saves with ``k_persist`` experts per layer; loads. Called at import with K = 1."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                              MoepecSaveStrategy(k_persist))
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                              MoepecLoadStrategy())


register()
