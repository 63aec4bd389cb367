"""The way back to stock Megatron-Core: a folder of a save directory written through the
``("moepec", 1)`` backend, written again as a ``torch_dist`` checkpoint (``moepec
materialize SAVE_DIR OUT``).

A moepec folder is not a ``torch_dist`` folder: it holds its own experts' copies only
(K of N), names the sibling folders that hold the others, and stores tensors as raw bytes
with a JSON manifest, which Megatron's ``torch_dist`` loader (DCP's ``.metadata``) cannot
read. :func:`materialize` reads the folder's stitched view (each expert from its newest
copy, optimizer state included; every tensor whole) and saves it with Megatron's own
``torch_dist`` strategy, beside Megatron's common state as saved: a Megatron without
moepec loads it, at any parallel layout, as it loads its own saves.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import maybe_load_config
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

from moepec.errors import CheckpointError
from moepec.flat import FlatFrontEnd, decode_object, shard_key, split_folder
from moepec.integrations.megatron_checks import ENUMS, OBJECT
from moepec.keys import MANIFEST_NAME


@dataclass(frozen=True, slots=True)
class Materialized:
    """What :func:`materialize` wrote."""

    folder: str
    """The moepec folder it read (its stitched view)."""
    out: str
    tensors: int
    objects: int


def materialize(path: str, out: str) -> Materialized:
    """Write the stitched view of ``path`` (a folder of a Megatron save directory written
    through moepec, or the directory itself: its newest committed folder) as a
    ``torch_dist`` checkpoint in ``out`` (a new folder). One process, all in host memory;
    it starts a one-rank process group when none is running. Megatron's ``torch_dist``
    save calls CUDA (``torch.cuda.synchronize``, ``current_device``): run it where torch
    has CUDA. Raises CheckpointError for a folder that is not moepec's or an ``out`` that
    exists."""
    root, name = _folder(path)
    if os.path.exists(out):
        raise CheckpointError(f"{out} exists; materialize into a new folder")
    front = FlatFrontEnd()
    known = front.folder(root, name)  # the manifests, read once
    shapes = front.shapes(root, name, known)
    objects = [k for k in front.keys(root, name, known) if k.startswith(OBJECT)]
    whole = {key: shard_key(key, [0] * len(shape), shape) for key, (shape, _) in shapes.items()}
    values = front.read(root, name, [*whole.values(), *objects], known)
    folder = os.path.join(root, name)
    state: dict = dict(_common(folder))
    for key, flat in whole.items():
        state[f"moepec.tensor:{key}"] = ShardedTensor.from_rank_offsets(key, values[flat])
    for flat in objects:
        obj = ShardedObject.empty_from_unique_key(flat.removeprefix(OBJECT))
        obj.data = decode_object(values[flat], f"{name}:{flat}", enums=ENUMS)
        state[f"moepec.object:{obj.unique_key}"] = obj
    with _one_rank():
        os.makedirs(out)
        dist_checkpointing.save(state, out, sharded_strategy=("torch_dist", 1))
    return Materialized(folder, out, len(whole), len(objects))


def _common(folder: str) -> dict:
    """Megatron's common state of ``folder``, read by the common strategy its
    ``metadata.json`` names (``torch``: ``common.pt`` with ``torch.load``, weights only)."""
    config = maybe_load_config(folder)
    if config is None:
        raise CheckpointError(f"{folder} has no Megatron metadata.json")
    return get_default_strategy(StrategyAction.LOAD_COMMON, config.common_backend,
                                config.common_backend_version).load_common(folder)


def _folder(path: str) -> tuple[str, str]:
    """(save directory, folder name) of a moepec folder, or of a save directory's newest
    committed one."""
    path = os.path.abspath(path)
    newest = FlatFrontEnd.newest(path)
    if newest is not None:
        return path, newest
    root, name = split_folder(path)
    if FlatFrontEnd.newest(root) is None or not os.path.isfile(
            os.path.join(path, MANIFEST_NAME)):
        raise CheckpointError(f"{path} is neither a Megatron save directory written through "
                              f"moepec nor a committed folder of one")
    return root, name


class _one_rank:
    """A one-rank gloo process group for the save when none is running (removed after)."""

    def __enter__(self) -> None:
        self.mine = not dist.is_initialized()
        if self.mine:
            self.tmp = tempfile.TemporaryDirectory()
            store = dist.FileStore(os.path.join(self.tmp.name, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def __exit__(self, *exc: object) -> None:
        if self.mine:
            dist.destroy_process_group()
            self.tmp.cleanup()
