"""Which (MoE layer, expert) a Megatron-Core shard belongs to, and its flat key: read from
the sharded state dict alone (:mod:`moepec.integrations.megatron`).

SequentialMLP's ``...experts.experts.*`` shards carry the expert on a prepended axis;
GroupedMLP's factories give the same keys with the expert on the first local axis (3 local
axes: the stacked weights, a rank's local experts in one shard, which
:func:`split_experts` cuts into one shard per expert);
``metadata={'singleton_local_shards': True}`` puts it in the key (``...experts.<e>.*``);
optimizer state keyed by the parameter's key (``optimizer.state.<name>.<param key>``)
goes with its expert. And a router's MoE layer (:func:`moe_layer_index`), for the
routing counts. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)

from moepec.flat import Unit, shard_key

_OPTIM_PREFIX = re.compile(r"^optimizer\.state\.[^.]+\.")
_SEQUENTIAL = re.compile(r"^(.*?)(?:^|\.)experts\.experts\.")
_SINGLETON = re.compile(r"^(.*?)(?:^|\.)experts\.(\d+)\.")
_GROUPED = re.compile(r"^(.*?)(?:^|\.)experts\.")
_GROUPED_NDIM = 3
"""GroupedMLP's weights, ``[local experts, out, in]`` (its factories' shards); an
expert's own weight (SequentialMLP, TEGroupedMLP) has 2 local axes, a bias 1."""


def flat_key(sh: ShardedTensor) -> str:
    """One shard's key in the flat checkpoint (``moepec.flat.shard_key``): the sharded
    key, its global offsets and local shape (prepended axes included) and, for a
    flattened shard, its range."""
    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    rng = sh.flattened_range
    return shard_key(sh.key, sh.global_offset, shape,
                     None if rng is None else (rng.start, rng.stop))


def expert_unit(sh: ShardedTensor) -> Unit | None:
    """(layer, expert) of an expert shard, None for any other. ``layer`` is the key
    prefix before ``experts`` with the offsets of the axes before the expert axis. A
    shard of several experts (:func:`split_experts` cuts all but a flattened one) is
    refused."""
    offsets = tuple(sh.global_offset)
    if m := _SINGLETON.match(_OPTIM_PREFIX.sub("", sh.key)):  # the expert is in the key
        return f"{m[1]}@{offsets[:sh.prepend_axis_num]}", int(m[2])
    if (found := _expert_axis(sh)) is None:
        return None
    prefix, axis = found
    if axis < 0 or (axis >= sh.prepend_axis_num
                    and sh.local_shape[axis - sh.prepend_axis_num] != 1):
        raise CheckpointingException(
            f"moepec: shard {sh.key!r} holds several experts in one shard that cannot be "
            f"cut per expert (a flattened range, or no expert axis); save with "
            f"metadata={{'singleton_local_shards': True}} so each expert is a shard")
    return f"{prefix}@{offsets[:axis]}", offsets[axis]


def split_experts(sh: ShardedTensor) -> list[ShardedTensor]:
    """The shard as one ShardedTensor per expert: ``[sh]`` unless it holds several
    experts on a local axis (GroupedMLP without ``singleton_local_shards``: a rank's
    local experts stacked on the first local axis). Then, for local expert ``i``, the
    same key over ``data.narrow(axis, i, 1)`` (a view: a load into the pieces fills the
    stacked tensor), ``global_offset`` advanced by ``i`` on that axis, local size 1 there
    (its fragmentation the axis' global size); the global shape, replica id and the rest
    as the shard's. A flattened shard is not cut (:func:`expert_unit` refuses it)."""
    found = _expert_axis(sh)
    local = -1 if found is None else found[1] - sh.prepend_axis_num
    if local < 0 or sh.flattened_range is not None or sh.local_shape[local] <= 1:
        return [sh]
    axis = found[1]
    frags = sh.axis_fragmentations
    return [replace(
        sh, data=None if sh.data is None else sh.data.narrow(local, i, 1),
        local_shape=_put(sh.local_shape, local, 1),
        global_offset=_put(sh.global_offset, axis, sh.global_offset[axis] + i),
        axis_fragmentations=None if frags is None else _put(frags, axis,
                                                             sh.global_shape[axis]),
    ) for i in range(sh.local_shape[local])]


def _put(values: Sequence[int], at: int, value: int) -> tuple[int, ...]:
    return (*values[:at], value, *values[at + 1:])


def _expert_axis(sh: ShardedTensor) -> tuple[str, int] | None:
    """The key prefix before ``experts`` and the global axis of the expert, None for a
    shard that is no expert's or has the expert in its key (``singleton_local_shards``)."""
    key = _OPTIM_PREFIX.sub("", sh.key)
    if _SINGLETON.match(key):
        return None
    if m := _SEQUENTIAL.match(key):  # SequentialMLP: the expert axis is prepended last
        axis = sh.prepend_axis_num - 1
        if len(sh.local_shape) == _GROUPED_NDIM:  # GroupedMLP's keys are the same
            axis = sh.prepend_axis_num
    elif m := _GROUPED.match(key):  # a GroupedMLP outside a MoELayer: the first local axis
        axis = sh.prepend_axis_num
        if _standalone_sequential(sh, m[1]):
            axis = sh.prepend_axis_num - 1
    else:
        return None
    return m[1], axis


def _standalone_sequential(sh: ShardedTensor, prefix: str) -> bool:
    """A SequentialMLP's shard outside a decoder (keys ``<prefix>experts.<name>``, as
    when it is built on its own): its one expert per shard sits on the last prepended
    axis, and its first local axis is the weight's own. (A GroupedMLP shard holds its
    experts on the first local axis; inside a decoder the prepended axis is the layers'.)"""
    return (sh.prepend_axis_num >= 1 and sh.local_shape[0] != 1
            and "layers" not in prefix.split("."))


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


def moe_layer_names(model: torch.nn.Module) -> list[str]:
    """The names of the model's MoE routers, in the order of layer L of
    :func:`observe_routing` (module order, which is depth order)."""
    return [name for name, mod in model.named_modules() if _is_router(mod)]


def _is_router(mod: torch.nn.Module) -> bool:
    return type(mod).__name__.endswith("Router") and hasattr(mod, "topk")


def routed_tokens(routing_map: torch.Tensor) -> torch.Tensor:
    """Tokens per expert of one router call: Megatron's count of a routing map
    (``[tokens, experts]``, True where a token goes), as its router and token
    dispatchers compute ``tokens_per_expert`` (this rank's tokens)."""
    return routing_map.sum(dim=0)


def moe_layer_index(router: torch.nn.Module, local: int) -> int:
    """Layer L of a router: how many MoE layers precede its layer in the whole model,
    from Megatron's global ``layer_number`` (1-based, pipeline offset included) and the
    config's ``moe_layer_freq`` (an int N: every N-th layer from the first; a list: 1 for
    MoE; layers numbered past the decoder, as multi-token-prediction ones, follow it).
    ``local`` (its place among this rank's routers) when the router has no layer number,
    as one built outside a TransformerLayer (right only without pipeline stages)."""
    number, config = getattr(router, "layer_number", None), getattr(router, "config", None)
    layers = getattr(config, "num_layers", None)
    if not isinstance(number, int) or not isinstance(layers, int) or not 0 < number:
        return local
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) \
        else [int(bool(x)) for x in freq]
    # past the decoder: multi-token-prediction layers, numbered on after it
    return sum(pattern[:number - 1]) + max(number - 1 - layers, 0)
