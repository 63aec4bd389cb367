"""Offline tools over a flat save directory (:mod:`moepec.store.flat`: Megatron-Core's,
one folder per iteration): inspect and export. Verify is
:func:`moepec.recovery.flat_view.verify_root`.

A flat checkpoint's keys are Megatron's shard keys: ``name#offsets+shape`` (the global
offsets and the local shape of one shard, prepended axes included), with ``~start:stop``
for a shard of a flattened range, and ``object:<key>`` for a sharded object (stored as
the uint8 tensor of its tagged JSON, :mod:`moepec.state.objects`). An export stitches the
newest committed folder's view (each key from the folder the view names, checksums
verified) and writes:

- ``name``: the whole tensor, where the shards of ``name`` tile it (its global shape is
  the maximum of offset + shape over the shards);
- the flat key as stored, for a shard of a flattened range or of shards that do not tile;
- ``object:<key>``: each object's stored bytes as a uint8 tensor (the convention of the
  manager's export, which writes objects as bytes; decode them with
  ``moepec.state.objects.decode_object``).

Reads the save directory only; no model needed.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moepec.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from moepec.recovery.offline import CheckpointRow, check_output, format_inspect
from moepec.recovery.offline_paths import nothing_committed
from moepec.store.flat import FlatManifest, empty_like_item, read_keys, scan
from moepec.store.storage import single_process_dcp

OBJECT_PREFIX = "object:"
_SHARD = re.compile(r"^(?P<name>.+)#(?P<offsets>\d+(?:,\d+)*)?\+(?P<shape>\d+(?:,\d+)*)?"
                    r"(?:~(?P<start>\d+):(?P<stop>\d+))?$")
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class ShardKey:
    """One parsed shard key ``name#offsets+shape[~start:stop]``."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flattened: tuple[int, int] | None
    """The flattened range (start, stop) the shard holds, None for a whole block."""


def parse_shard_key(key: str) -> ShardKey | None:
    """The parts of a shard key; None for an object or a key of another form. Raises
    CorruptCheckpointError for a shard that ends past what a tensor can index (int64):
    no framework writes one, and torch cannot allocate it."""
    m = _SHARD.match(key)
    if m is None or key.startswith(OBJECT_PREFIX):
        return None

    def ints(s: str | None) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split(",")) if s else ()

    offsets, shape = ints(m["offsets"]), ints(m["shape"])
    if len(offsets) != len(shape):
        return None
    flat = (int(m["start"]), int(m["stop"])) if m["start"] is not None else None
    if any(o + n > _INT64_MAX for o, n in zip(offsets, shape)) or (
            flat is not None and max(flat) > _INT64_MAX):
        raise CorruptCheckpointError(f"shard key {key!r:.160} reaches past the largest "
                                     f"tensor index (2**63 - 1); the key is damaged")
    return ShardKey(name=m["name"], offsets=offsets, shape=shape, flattened=flat)


# -- inspect ---------------------------------------------------------------------------
def _natural(name: str) -> list[Any]:
    """Numbers by value (``layers.2`` before ``layers.10``), as the rotation orders layers."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p]


def _step_of(folder: str) -> int | None:
    digits = re.search(r"(\d+)$", folder)
    return int(digits[1]) if digits else None


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def _row(m: FlatManifest, layers: list[str]) -> CheckpointRow:
    per_rank = [0] * max(m.world_size, 1 + max((i.rank or 0 for i in m.items.values()),
                                               default=0))
    for item in m.items.values():
        per_rank[item.rank or 0] += item.nbytes
    units = set(m.experts.values())
    saved = set(m.experts_saved)
    return CheckpointRow(
        name=m.name, step=m.step, committed=True, bytes=sum(per_rank),
        full=bool(units) and saved >= units, k_persist=getattr(m, "k_persist", None),
        experts_saved=[sorted(e for lay, e in saved if lay == layer) for layer in layers],
        bytes_per_rank=per_rank)


def _view_age(head: FlatManifest, steps: Mapping[str, int], layers: list[str]
              ) -> list[list[int]]:
    """Steps since each expert's copy in ``head``'s view, per layer (experts in order)."""
    oldest: dict[tuple[str, int], int] = {}
    for key, unit in head.experts.items():
        src = head.view.get(key, head.name)
        oldest[unit] = min(oldest.get(unit, head.step), steps.get(src, head.step))
    return [[head.step - s for (lay, _), s in sorted(oldest.items()) if lay == layer]
            for layer in layers]


def inspect_flat(root: str) -> dict[str, Any]:
    """What ``moepec inspect`` shows of a flat save directory: one row per folder (experts
    saved per layer, bytes per rank), the newest folder's view (age of each expert's copy,
    the folders it needs), the MoE layers' names."""
    found = scan(root)
    layers = sorted({u[0] for m in found.manifests.values()
                     for u in [*m.experts.values(), *m.experts_saved]}, key=_natural)
    rows = [_row(m, layers) for m in found.manifests.values()]
    rows += [CheckpointRow(name=n, step=_step_of(n), committed=False, bytes=0, error=e)
             for n, e in found.damaged.items()]
    rows += [CheckpointRow(name=n, step=_step_of(n), committed=False,
                           bytes=_folder_bytes(os.path.join(root, n)))
             for n in found.uncommitted]
    rows.sort(key=lambda r: (_natural(r.name)))
    head = found.head
    out: dict[str, Any] = {"path": root, "kind": "flat", "checkpoints": rows,
                           "head": head.name if head else None, "layers": layers,
                           "needs": {n: m.needs() for n, m in found.manifests.items()}}
    if head is not None:
        steps = {n: m.step for n, m in found.manifests.items()}
        out["view_age"] = _view_age(head, steps, layers)
        out["full_bytes"] = sum(found.manifests[src].items[k].nbytes
                                for k, src in head.view.items()
                                if src in found.manifests and k in found.manifests[src].items)
    return out


def format_inspect_flat(info: dict[str, Any]) -> str:
    """The ``moepec inspect`` table of a flat save directory."""
    lines = [format_inspect(info), "", "MoE layers (layer index: name):"]
    lines += [f"  layer {i}: {name}" for i, name in enumerate(info["layers"])]
    needs = {n: d for n, d in info["needs"].items() if d}
    if needs:
        lines.append("folders each view still reads (keep them):")
        lines += [f"  {n} needs {', '.join(d)}" for n, d in needs.items()]
    return "\n".join(lines)


# -- export ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FlatView:
    """The stitched state of a flat save directory's newest committed folder."""

    manifest: FlatManifest
    """The newest committed folder."""
    values: dict[str, torch.Tensor]
    """Every key of its view -> its value, read from the folder the view names."""


def read_flat_view(root: str) -> FlatView:
    """Read the newest committed folder's view, every key from the folder its view names,
    checksums verified (what a Megatron load of that folder reads). Raises
    NoCheckpointError (nothing committed) and CorruptCheckpointError (a needed folder or
    item missing or damaged), each in one line."""
    found = scan(root)
    head = found.head
    if head is None:
        raise NoCheckpointError(nothing_committed(root, found.uncommitted))
    gone = sorted({src for src in head.view.values() if src not in found.manifests})
    if gone:
        raise CorruptCheckpointError(f"{root}/{head.name} needs {', '.join(gone)}, which is "
                                     f"not committed or damaged; run `moepec verify {root}`")
    missing = [k for k, src in head.view.items() if k not in found.manifests[src].items]
    if missing:
        raise CorruptCheckpointError(f"{root}/{head.name}: {missing[0]!r:.160} is not in "
                                     f"{head.view[missing[0]]}, where its view says it is")
    targets = {k: empty_like_item(found.manifests[src].items[k])
               for k, src in head.view.items()}
    bad = read_keys(root, found.manifests, head.view, targets)
    if bad:
        raise CorruptCheckpointError(f"{len(bad)} item(s) of the view of {head.name} are "
                                     f"damaged (e.g. {head.view[bad[0]]}:{bad[0]}); run "
                                     f"`moepec verify {root}`")
    return FlatView(manifest=head, values=targets)


def _overlap(a: ShardKey, b: ShardKey) -> bool:
    return all(oa < ob + sb and ob < oa + sa
               for oa, sa, ob, sb in zip(a.offsets, a.shape, b.offsets, b.shape))


def _tile(shards: list[tuple[ShardKey, torch.Tensor]]) -> torch.Tensor | None:
    """The whole tensor the shards tile, or None when they do not (a gap, an overlap, a
    shape or dtype that disagrees)."""
    first, value = shards[0]
    ndim, dtype = len(first.shape), value.dtype
    if any(len(s.shape) != ndim or v.dtype != dtype or v.numel() != math.prod(s.shape)
           for s, v in shards):
        return None
    # The tensor is what the non-empty shards cover; an empty shard adds no element, so
    # it may not stretch the tensor (a stranger's empty shard at offset 2**62 would).
    boxes = [s for s, _ in shards if math.prod(s.shape)]
    size = tuple(max(s.offsets[d] + s.shape[d] for s in boxes or [s for s, _ in shards])
                 for d in range(ndim))
    if any(o + n > g for s, _ in shards for o, n, g in zip(s.offsets, s.shape, size)):
        return None  # an empty shard outside the tensor the others tile
    if not boxes and math.prod(max(g, 1) for g in size) > _INT64_MAX:
        return None  # only empty shards, claiming a shape torch cannot even describe
    if sum(math.prod(s.shape) for s in boxes) != math.prod(size) or any(
            _overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
        return None
    whole = torch.empty(size, dtype=dtype)
    for s, v in shards:
        block = whole
        for d, (o, n) in enumerate(zip(s.offsets, s.shape)):
            block = block.narrow(d, o, n)
        block.copy_(v.reshape(s.shape))
    return whole


def assemble(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A flat view's values under export names (see the module docstring): shards that
    tile a tensor as the whole tensor under its name, every other key as stored. Raises
    CheckpointError when a whole tensor's name is also a stored key, CorruptCheckpointError
    for a shard key past int64 (:func:`parse_shard_key`)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, list[tuple[ShardKey, torch.Tensor]]] = {}
    keys: dict[str, list[str]] = {}
    for key, value in values.items():
        shard = parse_shard_key(key)
        if shard is None or shard.flattened is not None:
            out[key] = value
        else:
            groups.setdefault(shard.name, []).append((shard, value))
            keys.setdefault(shard.name, []).append(key)
    for name, shards in groups.items():
        whole = _tile(shards)
        if whole is None:
            out.update((k, v) for k, (_, v) in zip(keys[name], shards))
        elif name in out:
            raise CheckpointError(f"{name!r:.160} is both a tensor and a stored key; "
                                  f"export it with --format dcp of the flat keys")
        else:
            out[name] = whole
    return out


@dataclass(frozen=True, slots=True)
class FlatExport:
    """What :func:`export_flat` wrote."""

    view: FlatView
    whole: int
    """Tensors under a plain name (assembled whole from their shards)."""
    shards: int
    """Shards written under their flat key (flattened ranges, shards that do not tile)."""
    objects: int
    """Objects written as their stored bytes."""

    @property
    def tensors(self) -> int:
        return self.whole + self.shards + self.objects


def export_flat(root: str, out: str, fmt: str) -> FlatExport:
    """Write the stitched state of ``root``'s newest committed folder (:func:`read_flat_view`,
    :func:`assemble`) as one safetensors file or one plain DCP checkpoint. Refuses an
    output inside ``root``; raises what :func:`read_flat_view` and :func:`assemble` raise
    (a damaged shard key: CorruptCheckpointError naming the folder)."""
    check_output(root, out)
    if fmt not in ("safetensors", "dcp"):
        raise CheckpointError(f"unknown export format {fmt!r}; use dcp or safetensors")
    view = read_flat_view(root)
    try:
        tensors = {k: v.contiguous() for k, v in assemble(view.values).items()}
    except CorruptCheckpointError as exc:  # a damaged shard key: name the folder
        raise CorruptCheckpointError(f"{root}/{view.manifest.name}: {exc}; run `moepec "
                                     f"verify {root}`") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, out, metadata={"moepec_step": str(view.manifest.step),
                                          "moepec_checkpoint": view.manifest.name,
                                          "moepec_objects": "object:<key>: tagged JSON bytes"})
    else:
        import torch.distributed.checkpoint as dcp

        with single_process_dcp():
            dcp.save(tensors, checkpoint_id=out, no_dist=True)
    objects = sum(k.startswith(OBJECT_PREFIX) for k in tensors)
    shards = sum(parse_shard_key(k) is not None for k in tensors)
    return FlatExport(view=view, whole=len(tensors) - shards - objects, shards=shards,
                      objects=objects)
