"""Where a flat key's tensor sits in its global tensor, and a shard cut from saved shards
of another layout (resharding on load).

A door names each shard ``KEY#o0,o1,...+s0,s1,...`` (the global offset and local shape,
every axis) and, for a shard that is a flat slice of that box, ``~start:stop``
(:func:`shard_key`). A load that asks for a box the save did not write (another TP,
EP or DP split, an uneven 1-D sharding, a whole tensor) gets it assembled from the
saved boxes that overlap it (:func:`assemble`). Pure: tensors in, tensor out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from moepec.errors import CheckpointError

_KEY = re.compile(r"^(?P<key>.+)#(?P<off>\d+(?:,\d+)*)?\+(?P<shape>\d+(?:,\d+)*)?"
                  r"(?:~(?P<a>\d+):(?P<b>\d+))?$")


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
    """The region a flat key names, or None for a key not in that grammar."""
    m = _KEY.match(flat_key)
    if m is None:
        return None
    off = tuple(int(x) for x in m["off"].split(",")) if m["off"] else ()
    shape = tuple(int(x) for x in m["shape"].split(",")) if m["shape"] else ()
    if len(off) != len(shape):
        return None
    flat = (int(m["a"]), int(m["b"])) if m["a"] is not None else None
    return Region(m["key"], off, shape, flat)


def _boxes(pieces: Mapping[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
    """Saved flat slices put back into their boxes (a box whose slices do not all come
    back stays out); whole boxes as they are."""
    out = {r: t.reshape(r.shape) for r, t in pieces.items() if r.flat is None}
    slices: dict[Region, list[tuple[Region, torch.Tensor]]] = {}
    for r, t in pieces.items():
        if r.flat is not None:
            slices.setdefault(r.box(), []).append((r, t))
    for box, parts in slices.items():
        flat = torch.empty(box.numel, dtype=parts[0][1].dtype)
        covered = 0
        for r, t in parts:
            flat[r.flat[0]:r.flat[1]] = t.reshape(-1)
            covered += r.numel
        if covered == box.numel:
            out[box] = flat.reshape(box.shape)
    return out


def assemble(want: Region, pieces: Mapping[Region, torch.Tensor]) -> torch.Tensor:
    """The tensor of region ``want`` cut from saved ``pieces`` (regions of the same key
    that do not overlap each other). Raises CheckpointError when they do not cover it."""
    if not pieces:
        raise CheckpointError(f"no saved shard of {want.key!r:.160}")
    boxes = _boxes(pieces)
    dtype = next(iter(pieces.values())).dtype
    out = torch.zeros(want.shape, dtype=dtype)
    covered = 0
    for r, t in boxes.items():
        if len(r.offset) != len(want.offset):
            raise CheckpointError(f"{want.key!r:.160} was saved with {len(r.offset)} axes, "
                                  f"the load asks for {len(want.offset)}")
        lo = [max(a, b) for a, b in zip(r.offset, want.offset)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(r.offset, r.shape, want.offset,
                                                      want.shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
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
