"""DCP's ``.metadata`` for ``Storage.write``: one flat dict of keyed tensors in, DCP
shards of each tensor out (chunk keys, moepec.keys, become shards of their tensor). A raw
save builds it from the items its ranks wrote (:class:`StartedIndex`, no ``dcp.save``); a
``torch_save`` one plans with ``dcp.save`` (:class:`KeySavePlanner`, and back from DCP's
metadata to our keys: :func:`keys_of`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from moepec.errors import CheckpointError
from moepec.keys import CHUNK_MARK, Chunk, chunk_key, split_chunk
from moepec.store.dcp_raw import RAW_DESCRIPTOR, RawWrite

ROOT_KEY = "moepec"
"""Storage.write hands dcp.save ``{ROOT_KEY: tensors}``; KeySavePlanner unwraps it."""


class KeySavePlanner(DefaultSavePlanner):
    """DCP's default save planner, cut to what moepec's flat dict of tensors needs.

    - A chunk key (``<key>#<offsets>+<shape>:<global shape>``, moepec.keys) is written as
      a DCP shard: a SHARD write item of fqn ``<key>`` at its global offsets. The
      ``.metadata`` then describes each sharded tensor once, with the chunks of all ranks,
      as DCP's own DTensor saves do, so a stock ``dcp.load`` reshards it onto any layout.
      Any other key is one whole tensor of that name.
    - ``dcp.save`` wraps every top-level key in a logging and Stateful check (~20 us per
      key, 12 ms per checkpoint of 600 items). It gets one key, ``ROOT_KEY``, and this
      planner plans the dict under it, as if the dict had been passed directly (nothing
      to flatten: it is flat already).
    - The global plan skips DCP's index-hint rewrite, which copies every write item twice
      (~40 us per item). The hint only speeds up finding a chunk among a tensor's chunks;
      a read matches an index by name and offsets.
    Ranks' keys are disjoint by construction (moepec.state.checkpoint_keys); a whole tensor written
    by two ranks still fails here (DCP's global plan refuses a second whole-tensor item),
    and so do the chunks of a tensor that do not tile it exactly (overlap, gap, out of
    bounds).

    Rank roles as in DCP: every rank calls ``set_up_planner``, ``create_local_plan`` and
    ``resolve_data`` (from its writer, on the calling thread); the coordinator calls
    ``create_global_plan``.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunk_keys: dict[tuple[str, tuple[int, ...]], str] = {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict[ROOT_KEY], storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, tensor in self.state_dict.items():
            base, chunk = split_chunk(key) if CHUNK_MARK in key else (key, None)
            if chunk is None:
                kind, offsets, size = WriteItemType.TENSOR, [0] * tensor.dim(), tensor.size()
            else:
                kind, offsets, size = WriteItemType.SHARD, chunk[0], chunk[2]
                if tuple(tensor.shape) != chunk[1]:
                    raise CheckpointError(f"{key}: the tensor is {list(tensor.shape)}, its "
                                          f"key names a {list(chunk[1])} chunk")
                self._chunk_keys[(base, chunk[0])] = key
            offsets = torch.Size(offsets)
            items.append(WriteItem(
                index=MetadataIndex(base, offsets), type=kind,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=torch.Size(size))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[self.key_of(index)]

    def key_of(self, index: MetadataIndex) -> str:
        """The key of ``state_dict`` that ``index`` (an item of this rank's plan) writes."""
        return self._chunk_keys.get((index.fqn, tuple(index.offset or ())), index.fqn)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        check_tiling(metadata)
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata


def check_tiling(metadata: Metadata) -> None:
    """Raise CheckpointError unless the chunks of every tensor of ``metadata`` tile it
    exactly (no chunk out of bounds, no overlap, no gap)."""
    # DCP's check finds chunks out of bounds and overlapping ones (a sweep, not all
    # pairs); its volume check runs only across several plans, so it is done here.
    errors = [e for e in _validate_global_plan([], metadata) if "invalid fill" not in e]
    for key, md in metadata.state_dict_metadata.items():
        chunks = getattr(md, "chunks", None)
        held = sum(math.prod(c.sizes) for c in chunks) if chunks is not None else 0
        if chunks is not None and held != md.size.numel():
            errors.append(f"the chunks of {key} hold {held} of its {md.size.numel()} "
                          f"elements")
    if errors:
        raise CheckpointError(f"the items written do not tile their tensors: {errors[0]}"
                              f" ({len(errors)} problems); moepec writes each block of a "
                              f"tensor once")


Entry = tuple[str, torch.Size, torch.dtype, int, int]
"""One item of a rank's data file written by ``RawWrite.start``: (key, shape,
dtype, offset, length)."""


class StartedIndex:
    """DCP's ``Metadata`` of a save whose ranks wrote their data files themselves
    (``RawWrite.start``), built from their items: what ``dcp.save`` with a
    :class:`KeySavePlanner` records for the same tensors (the same tensors, chunks and
    item locations; the deprecated ``TensorProperties`` fields at their defaults), without
    its plans. ``dcp.save`` plans ~600 items in ~10 ms of Python and allocates ~10,000
    objects that outlive a young garbage collection; on this project's machine those
    brought a full collection every ~7 persists, 150-250 ms with every thread held
    (docs/results.md, section 3, issue 50's tenth pass). A whole tensor's entries are
    kept from one save to the next (keyed by key, shape and dtype): a key's metadata is
    built once."""

    def __init__(self, *, chunks: bool = True) -> None:
        self.chunks = chunks
        """Whether a chunk key (moepec.keys) is a chunk of its tensor; False: every key
        is a whole tensor of that name (the flat front end's keys)."""
        self._whole: dict[str, tuple[torch.Size, torch.dtype, MetadataIndex,
                                     TensorStorageMetadata]] = {}
        self._properties: dict[torch.dtype, TensorProperties] = {}

    def build(self, entries: Sequence[Sequence[Entry]]
              ) -> tuple[Metadata, list[list[WriteResult]]]:
        """The ``Metadata`` (its tensors) and write results (rank by rank; rank ``r``'s
        items in its file ``__<r>_0.distcp``) of the ranks' ``entries``, for the
        writer's ``finish``. Raises CheckpointError when a tensor is written twice or
        its chunks do not tile it."""
        md: dict[str, Any] = {}
        sharded: dict[str, TensorStorageMetadata] = {}
        results, descriptors = [], [RAW_DESCRIPTOR]
        for rank, items in enumerate(entries):
            file, out = f"__{rank}_0{DEFAULT_SUFFIX}", []
            for key, shape, dtype, offset, length in items:
                chunk = split_chunk(key)[1] if self.chunks and CHUNK_MARK in key else None
                index = (self._whole_tensor(key, shape, dtype, md) if chunk is None
                         else self._chunk(key, chunk, shape, dtype, md, sharded))
                out.append(WriteResult(index=index, size_in_bytes=length, storage_data=(
                    _StorageInfo(file, offset, length, transform_descriptors=descriptors))))
            results.append(out)
        if sharded:
            check_tiling(Metadata(sharded))
        return Metadata(md), results

    def save(self, writer: RawWrite, tensors: Mapping[str, torch.Tensor],
             group: dist.ProcessGroup | None, distributed: bool) -> list[list[Entry]]:
        """Write this rank's ``tensors`` (``writer.start``) and, on the group's first rank,
        the save's ``.metadata`` from every rank's items; returns every rank's items. The
        caller then calls ``writer.wait_synced`` on every rank, also when this raised.
        Collective over ``group`` when ``distributed``: one gather of the ranks' items and
        one broadcast of the first rank's outcome (``dcp.save`` has two of each). Raises
        on every rank when a rank could not start its write or the first could not write
        ``.metadata`` (that rank's own error there, CheckpointError elsewhere)."""
        rank, world = ((dist.get_rank(group), dist.get_world_size(group)) if distributed
                       else (0, 1))
        error: Exception | None = None
        try:
            writer.start(tensors, rank)
            mine: Any = writer.entries
        except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
            error, mine = exc, f"{type(exc).__name__}: {exc}"
        every: list[Any] = [mine]
        if world > 1:  # a rank that failed still meets the others: none waits for it
            every = [None] * world
            dist.all_gather_object(every, mine, group=group)
        failed = [next((f"rank {r} could not write its data ({e})"
                        for r, e in enumerate(every) if isinstance(e, str)), None)]
        if rank == 0 and failed[0] is None:
            writer.set_up_storage_writer(True, rank=0, use_collectives=True)
            try:
                writer.finish(*self.build(every))
            except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
                error, failed = exc, [f"the first rank could not write the checkpoint's "
                                      f".metadata ({type(exc).__name__}: {exc})"]
        if world > 1:
            dist.broadcast_object_list(failed, group=group, group_src=0)
        if error is not None:
            raise error
        if failed[0] is not None:
            raise CheckpointError(f"{failed[0]}; none of this checkpoint is committed")
        return every

    def _whole_tensor(self, key: str, shape: torch.Size, dtype: torch.dtype,
                      md: dict[str, Any]) -> MetadataIndex:
        known = self._whole.get(key)
        if known is None or known[0] != shape or known[1] != dtype:
            size, zeros = torch.Size(shape), torch.Size([0] * len(shape))
            known = self._whole[key] = (size, dtype, MetadataIndex(key, zeros),
                                        TensorStorageMetadata(self._props(dtype), size, [
                                            ChunkStorageMetadata(zeros, size)]))
        if key in md:
            raise CheckpointError(f"{key} is written twice (by two ranks, or whole and in "
                                  f"chunks); moepec writes each block of a tensor once")
        md[key] = known[3]
        return known[2]

    def _chunk(self, key: str, chunk: Chunk, shape: torch.Size, dtype: torch.dtype,
               md: dict[str, Any], sharded: dict[str, TensorStorageMetadata]
               ) -> MetadataIndex:
        base = key.partition(CHUNK_MARK)[0]
        offsets, sizes, whole = chunk
        if tuple(shape) != sizes:
            raise CheckpointError(f"{key}: the tensor is {list(shape)}, its key names a "
                                  f"{list(sizes)} chunk")
        tmd = sharded.get(base)
        if tmd is None:
            if base in md:
                raise CheckpointError(f"{base} is written whole and in chunks; moepec "
                                      f"writes each block of a tensor once")
            tmd = md[base] = sharded[base] = TensorStorageMetadata(
                self._props(dtype), torch.Size(whole), [])
        elif tmd.size != whole or tmd.properties.dtype != dtype:
            raise CheckpointError(f"the chunks of {base} disagree on its shape or dtype: "
                                  f"{list(tmd.size)} {tmd.properties.dtype} and "
                                  f"{list(whole)} {dtype}")
        start = torch.Size(offsets)
        tmd.chunks.append(ChunkStorageMetadata(start, torch.Size(sizes)))
        return MetadataIndex(base, start)

    def _props(self, dtype: torch.dtype) -> TensorProperties:
        props = self._properties.get(dtype)
        if props is None:
            props = self._properties[dtype] = TensorProperties(dtype=dtype)
        return props


def keys_of(metadata: Metadata) -> dict[MetadataIndex, str]:
    """The moepec key of every written item: its fqn, or the chunk key of a shard (a
    tensor written in several chunks, told apart by their offsets)."""
    out = {}
    sizes: dict[str, dict[tuple[int, ...], torch.Size]] = {}
    for index in metadata.storage_data:
        md = metadata.state_dict_metadata[index.fqn]
        chunks = getattr(md, "chunks", None)
        if not chunks or len(chunks) == 1:
            out[index] = index.fqn
            continue
        of = sizes.get(index.fqn)
        if of is None:
            of = sizes[index.fqn] = {tuple(c.offsets): c.sizes for c in chunks}
        offsets = tuple(index.offset)
        out[index] = chunk_key(index.fqn, offsets, of[offsets], md.size)
    return out
