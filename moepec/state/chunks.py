"""Sharded tensors (DTensor) as chunks: which rank holds which block of a tensor.

FSDP2 (``fully_shard``) and expert parallelism over a device mesh turn parameters and
their optimizer state into DTensors: each rank holds a block (its local shard) of the
global tensor. moepec saves each block as one item named by its global offsets
(:func:`moepec.keys.chunk_key`) and restores any block of any layout from the saved
blocks that overlap it.

Supported placements: ``Shard(d)`` and ``Replicate()`` on any mesh dimension, applied in
mesh-dimension order as DTensor does (each split is ``torch.chunk``-like: ceil division,
trailing ranks may hold less or nothing). ``Partial`` (pending reductions) and strided
shards (``_StridedShard``, from nesting FSDP over an already sharded dim) are refused
with a ConfigError when the manager is built, except on a mesh dimension of size 1, where
no placement splits anything (torchtitan's expert FSDP mesh at EP = data-parallel degree).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from moepec.errors import ConfigError, StructureMismatchError
from moepec.keys import OBJECT_PREFIX, split_chunk

Block = tuple[tuple[int, ...], tuple[int, ...]]
"""(global offsets, shape) of one chunk."""
Target = tuple[torch.Tensor, Block, tuple[int, ...]]
"""(live local tensor, its block, the global shape) of a tensor this rank holds."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How one DTensor is laid out over the ranks of its mesh."""

    global_shape: tuple[int, ...]
    local: Block
    """This rank's block."""
    blocks: tuple[tuple[Block, tuple[int, ...]], ...]
    """Every distinct non-empty block and the global ranks holding it (sorted)."""


def is_sharded(t: object) -> bool:
    return isinstance(t, DTensor)


def layout_of(t: DTensor, name: str) -> Layout:
    """The layout of DTensor ``t`` (``name`` for errors). Raises ConfigError for a
    placement moepec does not save (see the module docstring)."""
    mesh = t.device_mesh
    shape = tuple(t.shape)
    for n, p in zip(mesh.mesh.shape, t.placements):
        if n > 1 and not (type(p) is Shard or isinstance(p, Replicate)):
            raise ConfigError(
                f"{name} is a DTensor placed {t.placements}; moepec saves Shard(d) and "
                f"Replicate() placements only. Shard it with plain Shard placements "
                f"(fully_shard's default)")
    ranks = mesh.mesh
    holders: dict[Block, list[int]] = {}
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        block = _block(shape, ranks.shape, coord, t.placements)
        if math.prod(block[1]):
            holders.setdefault(block, []).append(int(ranks[coord]))
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError(f"{name} is a DTensor on a mesh this rank is not part of")
    local = _block(shape, ranks.shape, tuple(coord), t.placements)
    if tuple(t.to_local().shape) != local[1]:
        raise ConfigError(f"{name}: its local shard is {list(t.to_local().shape)}, moepec "
                          f"expects {list(local[1])} for {t.placements}; an uneven custom "
                          f"sharding is not supported")
    return Layout(global_shape=shape, local=local,
                  blocks=tuple((b, tuple(sorted(r))) for b, r in holders.items()))


def _block(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
           placements: Sequence[object]) -> Block:
    offsets = [0] * len(shape)
    sizes = list(shape)
    for n, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard) and n > 1:
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            step = -(-sizes[d] // n)
            start = min(c * step, sizes[d])
            offsets[d] += start
            sizes[d] = min(start + step, sizes[d]) - start
    return tuple(offsets), tuple(sizes)


def expert_block(block: Block, expert: int) -> Block | None:
    """The part of a stacked ``[E, ...]`` block that is expert ``expert``, in the
    coordinates of one expert's slice (dim 0 dropped), or None when it holds none."""
    (offsets, sizes) = block
    if not offsets[0] <= expert < offsets[0] + sizes[0]:
        return None
    return offsets[1:], sizes[1:]


def overlap(a: Block, b: Block) -> Block | None:
    """The intersection of two blocks of one tensor, or None when empty."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def narrow(t: torch.Tensor, origin: Sequence[int], block: Block) -> torch.Tensor:
    """The view of ``t`` (a block starting at ``origin``) that is ``block``."""
    for d, (o, n) in enumerate(zip(block[0], block[1])):
        t = t.narrow(d, o - origin[d], n)
    return t


def assembly(values: Mapping[str, torch.Tensor], target: Callable[[str], Target]
             ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                        list[tuple[torch.Tensor, Block, list]]]:
    """Sort restored tensors into plain copies ((live, value) pairs) and, per live tensor
    restored from chunks (or a whole value into a local shard), the overlapping
    regions to copy: (live, its block, [(region, value, value's offsets)]). ``target``
    gives a whole-tensor key's (live local tensor, its block, global shape). Checks,
    before anything is written, that the saved chunks are of a tensor of the model's
    global shape and cover every element this rank holds; raises StructureMismatchError
    naming the mismatch."""
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    by_base: dict[str, list[tuple[str, tuple[int, ...] | None]]] = {}
    for key in values:
        if key.startswith(OBJECT_PREFIX):
            continue
        base, chunk = split_chunk(key)
        by_base.setdefault(base, []).append((key, chunk))
    pieces = []
    for base, saved in by_base.items():
        live, block, glob = target(base)
        if len(saved) == 1 and saved[0][1] is None and block[1] == glob:
            plain.append((live, values[saved[0][0]]))
            continue
        parts, covered = [], 0
        for key, chunk in saved:
            value = values[key]
            offsets, sglob = (chunk[0], chunk[2]) if chunk else (
                (0,) * value.dim(), tuple(value.shape))
            if sglob != glob:
                raise StructureMismatchError(
                    f"checkpoint item {key} is part of a {list(sglob)} tensor, the model's "
                    f"is {list(glob)}; restore into the model the checkpoint was saved "
                    f"from")
            region = overlap(block, (offsets, tuple(value.shape)))
            if region is not None:
                parts.append((region, value, offsets))
                covered += math.prod(region[1])
        if covered != math.prod(block[1]):
            raise StructureMismatchError(
                f"the checkpoint's chunks of {base} cover {covered} of the "
                f"{math.prod(block[1])} elements this rank holds (block {list(block[0])} "
                f"+ {list(block[1])}); it cannot fill this layout")
        pieces.append((live, block, parts))
    return plain, pieces
