"""What Megatron-Core's ``torch_dist`` backend refuses on a load, refused the same way by
the ``("moepec", 1)`` backend (:mod:`moepec.integrations.megatron`), and the running
megatron-core version, checked once.

``torch_dist`` (``MCoreLoadPlanner`` in ``megatron/core/dist_checkpointing/strategies/
torch.py``) refuses a ShardedTensor whose global shape is not the saved one, and a key the
checkpoint does not hold ("unexpected" keys, when ``strict`` leaves them to the strategy:
``StrictHandling.ASSUME_OK_UNEXPECTED``, the default), on every rank at once, with DCP's
``CheckpointException``. A tensor marked ``allow_shape_mismatch`` loads the part of its
box that the saved tensor covers, zeros elsewhere. Every other ``StrictHandling`` mode is
Megatron's own (``validation.py``), fed by the backend's ``load_sharded_metadata``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import signal
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.rerun_state_machine import RerunMode, RerunState
from megatron.core.transformer.enums import (
    AttnBackend,
    AttnMaskType,
    AttnType,
    CudaGraphScope,
    LayerType,
    ModelType,
)
from torch.distributed.checkpoint.api import CheckpointException

from moepec.flat import shard_key

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1",)
"""megatron-core versions the door's tests ran against (docs/megatron.md)."""
OBJECT = "object:"
"""The flat-key prefix of a ShardedObject (its unique key follows)."""
ENUMS = (AttnBackend, AttnMaskType, AttnType, CudaGraphScope, LayerType, ModelType, RerunMode,
         RerunState, signal.Signals)
"""The enum classes whose members the door's objects may hold (tagged JSON,
:mod:`moepec.state.objects`): those of Megatron-LM's ``args`` (``--attention-backend``,
``--cuda-graph-scope``, ``--exit-signal``, ...) and of its rerun state machine's state."""
Shape = tuple[int, ...]


class LoadRefused(CheckpointingException, CheckpointException):
    """A load the folder cannot answer as asked (a key it lacks, another global shape),
    raised on every rank. It is Megatron's ``CheckpointingException`` and, as
    ``torch_dist`` raises there, DCP's ``CheckpointException``: code written for either
    backend catches it."""

    def __init__(self, msg: str) -> None:
        CheckpointingException.__init__(self, msg)
        self._failures = {}  # DCP's per-rank failures: the message names the ranks

    def __str__(self) -> str:
        return str(self.args[0])


def refusals(shards: Mapping[str, ShardedTensor | ShardedObject],
             saved: Mapping[str, tuple[Shape, str]], objects: Iterable[str]) -> list[str]:
    """This rank's reasons to refuse the load (empty: none), as ``torch_dist``: requested
    keys the folder lacks; tensors of another global shape than ``saved`` (tensor key ->
    (global shape, dtype)) not marked ``allow_shape_mismatch``. ``objects``: the
    folder's object flat keys. Pure."""
    objects = set(objects)
    unexpected, out = set(), []
    for flat, sh in shards.items():
        if isinstance(sh, ShardedObject):
            if flat not in objects:
                unexpected.add(sh.key)
            continue
        if sh.key not in saved:
            unexpected.add(sh.key)
            continue
        shape = saved[sh.key][0]
        if tuple(sh.global_shape) == shape:
            continue
        if not sh.allow_shape_mismatch:
            out.append(f"Global shape mismatch for key {sh.key!r}: saved {shape}, the load "
                       f"asks for {tuple(sh.global_shape)}; build the model as it was "
                       f"saved, or mark the tensor allow_shape_mismatch=True to load what "
                       f"overlaps (zeros elsewhere)")
        elif sh.flattened_range is not None:
            out.append(f"{sh.key!r} is a flattened_range shard marked allow_shape_mismatch "
                       f"and saved with global shape {shape}, not {tuple(sh.global_shape)}: "
                       f"moepec cuts only whole boxes; load it without flattened_range")
    if unexpected:
        out.insert(0, f"Unexpected keys (not found in the checkpoint): {sorted(unexpected)}; "
                      f"load with strict='log_unexpected' or 'return_unexpected' to load "
                      f"the rest")
    return out


def refuse_on_every_rank(mine: Sequence[str], where: str) -> None:
    """All ranks (one all_gather of the reasons where there are several): raise
    :class:`LoadRefused` on every rank when any rank has a reason, this rank's first."""
    every = [list(mine)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, list(mine))
        rank = dist.get_rank()
        every = [every[rank]] + [e for r, e in enumerate(every) if r != rank]
    lines = list(dict.fromkeys(line for reasons in every for line in reasons))
    if lines:
        raise LoadRefused(f"moepec: {where}: {' | '.join(lines)}")


def box(sh: ShardedTensor) -> tuple[Shape, Shape]:
    """(global offset, shape) of a shard's box, its prepended axes included."""
    return tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape)


def overlap_key(sh: ShardedTensor, saved: Shape) -> str | None:
    """The flat key of the part of an ``allow_shape_mismatch`` shard's box inside the
    saved global shape, or None when none of it is."""
    offset, shape = box(sh)
    end = [min(o + n, s) for o, n, s in zip(offset, shape, saved)]
    if any(o >= e for o, e in zip(offset, end)):
        return None
    return shard_key(sh.key, offset, [e - o for o, e in zip(offset, end)])


def pad(sh: ShardedTensor, part: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An ``allow_shape_mismatch`` shard's value: ``part`` (what :func:`overlap_key`
    read) at the start of its box, zeros elsewhere, as ``torch_dist`` loads it."""
    _, shape = box(sh)
    out = torch.zeros(shape, dtype=part.dtype if part is not None else dtype)
    if part is not None:
        out[tuple(slice(0, n) for n in part.shape)] = part
    return out.reshape(sh.local_shape)


def version_warning(version: str | None) -> str | None:
    """The one-line warning for a megatron-core version the door was not tested with,
    None for a tested one. Pure."""
    if version in TESTED_VERSIONS:
        return None
    return (f"moepec: megatron-core {version or '(version unknown)'} is not one the "
            f"('moepec', 1) backend was tested with ({', '.join(TESTED_VERSIONS)}); if a "
            f"save or load misbehaves, pin megatron-core=={TESTED_VERSIONS[-1]} and report it")


@functools.cache
def check_version() -> None:
    """Once per process, on rank 0 (or without a process group): warn when the running
    megatron-core is not a tested version (:func:`version_warning`)."""
    try:
        version: str | None = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = None
    line = version_warning(version)
    if line and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("%s", line)
