"""Where a flat key's tensor sits in its global tensor, and a shard cut from saved shards
of another layout (resharding on load).

A door names each shard ``KEY#o0,o1,...+s0,s1,...`` (the global offset and local shape,
every axis) and, for a shard that is a flat slice of that box, ``~start:stop``
(:func:`shard_key`). A load that asks for a box the save did not write (another TP,
EP or DP split, an uneven 1-D sharding, a whole tensor) gets it assembled from the
saved boxes that overlap it (:func:`overlapping`, :func:`assemble`); a tensor's global
shape is read from its shards' keys (:func:`global_shapes`). Pure: keys and tensors in.

The keys come from the checkpoint, which may be a stranger's: a region past what a
tensor can index, a shard whose size is not its stored tensor's, or shards that overlap
is a CorruptCheckpointError, found before anything bigger than the saved shards is
allocated (a box is put together only from flat slices that fill it exactly).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from moepec.errors import CheckpointError, CorruptCheckpointError

_TAIL = re.compile(r"(\d+(?:,\d+)*)?\+(\d+(?:,\d+)*)?(?:~(\d+):(\d+))?")
"""What follows a shard key's last ``#`` (matched alone: half the cost of one pattern
for the whole key, and a load parses every shard key it reads)."""
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Region:
    """One shard's place: the box ``offset .. offset + shape`` of tensor ``key``, or
    the flat slice ``flat`` of that box."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat else math.prod(self.shape)

    def box(self) -> Region:
        return Region(self.key, self.offset, self.shape)


def shard_key(key: str, offset: Iterable[int], shape: Iterable[int],
              flat: tuple[int, int] | None = None) -> str:
    """The flat key of a shard (see the module docstring)."""
    out = f"{key}#{','.join(map(str, offset))}+{','.join(map(str, shape))}"
    return out if flat is None else f"{out}~{flat[0]}:{flat[1]}"


def parse_shard_key(flat_key: str) -> Region | None:
    """The region a flat key names, or None for a key not in that grammar. Raises
    CorruptCheckpointError for a region no save writes: one that ends past what a tensor
    can index (int64), or a flat slice that is reversed or ends past its box."""
    key, _, tail = flat_key.rpartition("#")
    m = _TAIL.fullmatch(tail) if key else None
    if m is None:
        return None
    offsets, sizes, a, b = m.groups()
    off = tuple(map(int, offsets.split(","))) if offsets else ()
    shape = tuple(map(int, sizes.split(","))) if sizes else ()
    if len(off) != len(shape):
        return None
    if any(o + n > _INT64_MAX for o, n in zip(off, shape)):
        raise CorruptCheckpointError(f"shard key {flat_key!r:.160} reaches past the "
                                     f"largest tensor index (2**63 - 1); the key is damaged")
    if a is None:
        return Region(key, off, shape)
    flat = (int(a), int(b))
    if not flat[0] <= flat[1] <= math.prod(shape):
        raise CorruptCheckpointError(f"shard key {flat_key!r:.160} names the flat range "
                                     f"{flat[0]}:{flat[1]} of a box of {math.prod(shape)} "
                                     f"values; the key is damaged")
    return Region(key, off, shape, flat)


def stored_region(flat_key: str, numel: int) -> Region | None:
    """As :func:`parse_shard_key`, for a key stored with ``numel`` values: raises
    CorruptCheckpointError when its region holds another number."""
    r = parse_shard_key(flat_key)
    if r is not None and r.numel != numel:
        raise _other_size(flat_key, numel, r.numel)
    return r


def _other_size(flat_key: str, held: int, named: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{flat_key!r:.160} holds {held} values, its key names "
                                  f"{named}; the checkpoint is damaged")


def global_shapes(shards: Iterable[tuple[str, int, str]]
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's global shape (the end of its farthest shard) and dtype from its
    shards ``(flat key, values stored, dtype)``; keys of another grammar are skipped.
    Raises CorruptCheckpointError (:func:`stored_region`) for shards of one tensor with
    different numbers of axes, or a shape larger than its shards hold (what a load of
    the whole tensor would allocate)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    held: dict[str, int] = {}
    for key, numel, dtype in shards:
        r = stored_region(key, numel)
        if r is None:
            continue
        end = tuple(o + n for o, n in zip(r.offset, r.shape))
        shape, _ = out.get(r.key, (end, ""))
        if len(shape) != len(end):
            raise CorruptCheckpointError(f"the shards of {r.key!r:.160} have {len(shape)} "
                                         f"and {len(end)} axes; the checkpoint is damaged")
        out[r.key] = (tuple(max(a, b) for a, b in zip(shape, end)), dtype)
        held[r.key] = held.get(r.key, 0) + r.numel
    for key, (shape, _) in out.items():
        if math.prod(shape) > held[key]:
            raise CorruptCheckpointError(f"the shards of {key!r:.160} hold {held[key]} "
                                         f"values, their keys place them in a tensor of "
                                         f"shape {list(shape)}; the checkpoint is damaged")
    return out


def overlapping(keys: Iterable[str], wants: Iterable[Region]
                ) -> dict[Region, list[tuple[Region, str]]]:
    """For each wanted region, the saved shard keys of its tensor (among ``keys``) whose
    boxes overlap it, with their regions. Raises CorruptCheckpointError for a damaged
    key (:func:`parse_shard_key`), shards of one tensor with different numbers of axes or
    two keys naming one region; CheckpointError for a tensor saved with another number
    of axes than the load asks for."""
    wants = list(wants)
    names = {w.key for w in wants}  # parse only the keys of tensors a cut needs
    by_tensor: dict[str, dict[Region, str]] = {}
    for key in keys:
        if key.rpartition("#")[0] not in names:
            continue
        r = parse_shard_key(key)
        if r is None:
            continue
        mine = by_tensor.setdefault(r.key, {})
        if r in mine or (mine and len(next(iter(mine)).offset) != len(r.offset)):
            other = mine.get(r) or next(iter(mine.values()))
            raise CorruptCheckpointError(f"its keys {other!r:.160} and {key!r:.160} "
                                         f"name shards that cannot both be saved; the "
                                         f"checkpoint is damaged")
        mine[r] = key
    out: dict[Region, list[tuple[Region, str]]] = {}
    for want in wants:
        saved = by_tensor.get(want.key, {})
        if saved and len(axes := next(iter(saved)).offset) != len(want.offset):
            raise CheckpointError(f"{want.key!r:.160} was saved with {len(axes)} axes, "
                                  f"the load asks for {len(want.offset)}")
        out[want] = [(r, k) for r, k in saved.items() if all(
            a < b + m and b < a + n for a, n, b, m in
            zip(r.offset, r.shape, want.offset, want.shape))]
    return out


def _boxes(pieces: Mapping[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
    """Saved flat slices put back into their boxes, whole boxes as they are. Raises
    CorruptCheckpointError for a shard whose size is not its region's, slices of a box
    that overlap or do not fill it, or shards of one tensor of different dtypes."""
    dtype = next(iter(pieces.values())).dtype
    out: dict[Region, torch.Tensor] = {}
    slices: dict[Region, list[tuple[Region, torch.Tensor]]] = {}
    for r, t in pieces.items():
        if t.numel() != r.numel:
            raise _other_size(shard_key(r.key, r.offset, r.shape, r.flat), t.numel(), r.numel)
        if t.dtype != dtype:
            raise CorruptCheckpointError(f"the saved shards of {r.key!r:.160} are of "
                                         f"dtypes {dtype} and {t.dtype}; the checkpoint "
                                         f"is damaged")
        if not r.numel:
            continue  # holds no value (and its shape may be one no stride can describe)
        if r.flat is None:
            out[r] = t.reshape(r.shape)
        else:
            slices.setdefault(r.box(), []).append((r, t))
    for box, parts in slices.items():
        # Sizes are the stored tensors' (checked above): the box is allocated only once
        # its slices, end to end, fill it exactly.
        parts.sort(key=lambda p: p[0].flat)
        end = 0
        for r, _ in parts:
            if r.flat[0] != end:
                break
            end = r.flat[1]
        if end != box.numel:
            raise CorruptCheckpointError(
                f"the flat slices of {shard_key(box.key, box.offset, box.shape)!r:.160} "
                f"({', '.join(f'{a}:{b}' for (a, b) in (r.flat for r, _ in parts[:8]))}"
                f"{', ...' if len(parts) > 8 else ''}) do not fill its {box.numel} values "
                f"end to end; the checkpoint is damaged")
        out[box] = torch.cat([t.reshape(-1) for _, t in parts]).reshape(box.shape)
    return out


def assemble(want: Region, pieces: Mapping[Region, torch.Tensor]) -> torch.Tensor:
    """The tensor of region ``want`` cut from saved ``pieces`` (regions of the same key
    that do not overlap each other). Raises CheckpointError when they do not cover it,
    CorruptCheckpointError when they are damaged (:func:`_boxes`, or boxes that overlap
    in it)."""
    if not pieces:
        raise CheckpointError(f"no saved shard of {want.key!r:.160}")
    dtype = next(iter(pieces.values())).dtype
    parts = []
    for r, t in _boxes(pieces).items():
        if len(r.offset) != len(want.offset):
            raise CheckpointError(f"{want.key!r:.160} was saved with {len(r.offset)} axes, "
                                  f"the load asks for {len(want.offset)}")
        lo = [max(a, b) for a, b in zip(r.offset, want.offset)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(r.offset, r.shape, want.offset,
                                                      want.shape)]
        if all(low < h for low, h in zip(lo, hi)):
            parts.append((lo, hi, r, t))
    _disjoint(parts)
    out = torch.zeros(want.shape, dtype=dtype)
    covered = 0
    for lo, hi, r, t in parts:
        src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, r.offset))
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, want.offset))
        out[dst] = t[src]
        covered += math.prod(h - low for low, h in zip(lo, hi))
    if covered != math.prod(want.shape):
        raise CheckpointError(f"the saved shards of {want.key!r:.160} cover {covered} of the "
                              f"{math.prod(want.shape)} values the load asks for at offset "
                              f"{list(want.offset)}; the checkpoint was saved with another "
                              f"global shape")
    if want.flat is not None:
        return out.reshape(-1)[want.flat[0]:want.flat[1]].clone()
    return out


def _disjoint(parts: list[tuple[list[int], list[int], Region, torch.Tensor]]) -> None:
    """CorruptCheckpointError when two of the boxes ``lo .. hi`` overlap: no save writes
    a value twice, and with an overlap the count of covered values hides a gap. Sorted
    by the first axis, a box is compared only with those starting before it ends there
    (shards split by rows: one comparison each)."""
    parts.sort(key=lambda p: p[0])
    for i, (lo, hi, r, _) in enumerate(parts):
        for j in range(i + 1, len(parts)):
            lo2, hi2, r2, _ = parts[j]
            if lo and lo2[0] >= hi[0]:
                break
            if all(a < h2 and a2 < h for a, h, a2, h2 in zip(lo, hi, lo2, hi2)):
                raise CorruptCheckpointError(
                    f"the saved shards {shard_key(r.key, r.offset, r.shape)!r:.160} and "
                    f"{shard_key(r2.key, r2.offset, r2.shape)!r:.160} overlap; the "
                    f"checkpoint is damaged")
