"""The DCP save planner behind ``Storage.write``: one flat dict of keyed tensors in, DCP
shards of each tensor out (chunk keys, moepec.keys, become shards of their tensor), and
back from DCP's metadata to our keys (:func:`keys_of`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from moepec.errors import CheckpointError
from moepec.keys import CHUNK_MARK, chunk_key, split_chunk

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
        # DCP's check finds chunks out of bounds and overlapping ones (a sweep, not all
        # pairs); its volume check runs only across several plans, so it is done here.
        errors = [e for e in _validate_global_plan(plans, metadata) if "invalid fill" not in e]
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
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata


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
