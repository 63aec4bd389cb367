"""Offline tools over a checkpoint root: inspect, verify, export.

They read storage only (no model needed), so they work on any machine that can
reach the path. Used by ``moepec inspect|verify|export``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moepec.errors import CheckpointError, ManifestError, NoCheckpointError
from moepec.keys import newest, parse_checkpoint_name, parse_key, split_chunk
from moepec.recovery.offline_paths import group_roots, nothing_committed
from moepec.recovery.stitch import read_verified, recover, storage_source
from moepec.recovery.striped import StripedViews, stitched_manifest
from moepec.recovery.views import Fallback, fallbacks, recover_stored, usable_manifests
from moepec.store.committed import committed_manifests
from moepec.store.items import DTYPE_SIZES
from moepec.store.lineage import lineage, view_age
from moepec.store.manifest import Manifest
from moepec.store.storage import Storage, single_process_dcp

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CheckpointRow:
    name: str
    step: int | None
    committed: bool
    bytes: int
    full: bool = False
    k_persist: int | None = None
    experts_saved: list[list[int]] = field(default_factory=list)
    plt: float | None = None
    bytes_per_rank: list[int] = field(default_factory=list)
    error: str | None = None


def inspect_path(path: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Table of checkpoints and the view of the newest one."""
    st = Storage(path, storage_options)
    found = committed_manifests(st, views=True)
    rows: list[CheckpointRow] = []
    for name, _ in found.listing:
        m = found.manifests.get(name)
        if m is not None:
            rows.append(CheckpointRow(name=name, step=m.step, committed=True, bytes=m.bytes,
                                      full=m.meta.full, k_persist=m.meta.k_persist,
                                      experts_saved=m.meta.experts_saved, plt=m.meta.plt,
                                      bytes_per_rank=m.bytes_per_rank))
        elif name in found.damaged:
            rows.append(CheckpointRow(name=name, step=_step_of(name), committed=False,
                                      bytes=0, error=str(found.damaged[name])))
        else:
            rows.append(CheckpointRow(name=name, step=_step_of(name), committed=False,
                                      bytes=st.data_bytes(name)))
    head = found.newest
    out: dict[str, Any] = {"path": path, "checkpoints": rows, "head": head}
    if head:
        m = found.manifests[head]
        out["view_age"] = view_age(m)
        out["structure"] = m.meta.structure["experts"]
        out["full_bytes"] = _full_bytes(m, found.manifests)
    return out


def _step_of(name: str) -> int:
    """The step in a checkpoint folder's name."""
    return parse_checkpoint_name(name)[1]


def _full_bytes(m: Manifest, manifests: Mapping[str, Manifest]) -> int:
    """Bytes of every key of the view (what a full checkpoint of that state holds)."""
    total = 0
    for key, src in m.view.items():
        try:
            item = manifests[src].keys.get(key) if src in manifests else None
        except ManifestError:  # a bad entry: verify reports it
            item = None
        total += item.nbytes if item else 0
    return total


@dataclass(slots=True)
class VerifyResult:
    checked: int = 0
    bad: list[str] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    damaged_manifests: list[str] = field(default_factory=list)
    broken_views: list[str] = field(default_factory=list)
    """Retained views that cannot be restored, with the reason."""
    views: int = 0
    """Retained views checked."""

    @property
    def ok(self) -> bool:
        """Every committed item intact, every retained view restorable, and there is at
        least one checkpoint (an empty or mistyped path is not OK)."""
        return (not self.bad and not self.damaged_manifests and not self.broken_views
                and self.views > 0)


def verify_path(path: str, storage_options: dict | None = None,
                progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """Read every item of every committed checkpoint and compare checksums."""
    st = Storage(path, storage_options)
    found = committed_manifests(st, views=True)
    res = VerifyResult(uncommitted=list(found.uncommitted),
                       damaged_manifests=[f"{n}: {e}" for n, e in found.damaged.items()])
    manifests = dict(found.manifests)
    for name, m in found.manifests.items():  # restore checks entries on use; verify all
        try:
            for key in m.keys:
                m.keys[key]
        except ManifestError as exc:
            res.damaged_manifests.append(f"{name}: {exc}")
            del manifests[name]
    total = sum(len(m.keys) for m in manifests.values())
    for name, m in manifests.items():
        _, bad = read_verified(storage_source(st, m), sorted(m.keys))
        res.checked += len(m.keys)
        res.bad += [f"{name}:{key}" for key in bad]
        if progress:
            progress(res.checked, total)
    _check_views(manifests, set(res.bad), res)
    return res


def retained_heads(manifests: Mapping[str, Manifest]) -> list[str]:
    """The views retention keeps (the newest ``keep_last`` of the newest lineage, with the
    keep_last the newest checkpoint was saved with)."""
    head = newest(manifests)
    if head is None:
        return []
    keep = manifests[head].meta.config.get("keep_last", 1)
    keep = keep if isinstance(keep, int) and keep >= 1 else 1
    return lineage(manifests, head)[:keep]


def _check_views(manifests: Mapping[str, Manifest], bad: set[str], res: VerifyResult) -> None:
    """Every retained view: each key's source committed, holding the key, intact; and a
    copy of every expert's weights (not of a part of a checkpoint striped over replica
    groups: its view holds only this root's copies)."""
    for head in retained_heads(manifests):
        res.views += 1
        problem = _view_problem(manifests, head, bad)
        if problem:
            res.broken_views.append(f"{head}: {problem}")


def _view_problem(manifests: Mapping[str, Manifest], head: str, bad: set[str]) -> str | None:
    m = manifests[head]
    for key, src in sorted(m.view.items()):
        if src not in manifests:
            return f"{key} lives in {src}, which is missing or damaged"
        if key not in manifests[src].keys:
            return f"{key} is not in {src}, where the view says it is"
        if f"{src}:{key}" in bad:
            return f"{key} in {src} is corrupt"
    if m.meta.part is not None:
        return None  # one group's part of a striped checkpoint: the others hold the rest
    missing = missing_experts(m)
    return f"no copy of {missing}" if missing else None


def missing_experts(m: Manifest) -> str | None:
    """The first expert whose weights the view lacks, named, or None."""
    have = {(parse_key(k).layer, parse_key(k).expert) for k in m.view
            if k.startswith("experts/") and parse_key(k).part == "model"}
    for layer, entry in enumerate(m.meta.structure.get("experts", [])):
        n = entry[2] if isinstance(entry, list) and len(entry) == 3 else 0
        for e in range(n if isinstance(n, int) else 0):
            if (layer, e) not in have:
                return f"expert {e} of MoE layer {layer}"
    return None


@dataclass(frozen=True, slots=True)
class StitchedView:
    """The state a one-process ``CheckpointManager.restore()`` would load, read offline."""

    manifest: Manifest
    """The base checkpoint (the newest whose non-expert state is intact)."""
    values: dict[str, torch.Tensor]
    """Every key of its view -> value, each from its newest intact copy."""
    newest: str
    """The newest committed checkpoint (the base unless its own state is damaged)."""
    fallbacks: list[Fallback]
    """The expert units taken from an older copy than the base's view names."""
    warnings: list[str]
    """What the stitching skipped, and why (as ``RestoreReport.warnings``)."""


def read_view(path: str, storage_options: dict | None = None) -> StitchedView:
    """The newest view, stitched as restore stitches it (``recovery.views``): a damaged
    item falls back to an older copy, a damaged base to an older base. Reads only.
    Raises NoCheckpointError (nothing committed, no intact copy of some expert),
    CorruptCheckpointError, ManifestFormatError, each with a one-line message."""
    st = Storage(path, storage_options)
    found = committed_manifests(st)
    head = found.manifests.get(found.newest) if found.newest else None
    if head is not None and head.meta.part is not None:
        part = head.meta.part
        raise NoCheckpointError(
            f"{path} holds part {part['index'] + 1} of {part['count']} of checkpoints striped "
            f"over replica groups; the other groups' roots hold the rest: pass the folder "
            f"that holds the group-<I> roots (the --ckpt-dir of the run)")
    if not found.manifests:
        groups = group_roots(st)
        if groups:
            return _read_striped(st, groups, storage_options)
        if not found.damaged:
            raise NoCheckpointError(nothing_committed(path, found.uncommitted))
    rec = recover_stored(st, found)
    assert rec.base.manifest is not None and found.newest is not None, "a stored base"
    return StitchedView(manifest=rec.base.manifest, values=rec.values, newest=found.newest,
                        fallbacks=fallbacks(rec), warnings=rec.warnings)


def _read_striped(st: Storage, groups: list[str], storage_options: dict | None
                  ) -> StitchedView:
    """The newest whole checkpoint striped over the ``groups`` roots under ``st``."""
    storages = [Storage(f"{st.url}/{g}", storage_options) for g in groups]
    found = [committed_manifests(s) for s in storages]
    views = StripedViews(storages, [usable_manifests(f) for f in found])
    if not any(f.manifests for f in found):
        raise NoCheckpointError(nothing_committed(
            st.url, [f"{g}/{n}" for g, f in zip(groups, found) for n in f.uncommitted]))
    if not views.bases:
        raise NoCheckpointError(f"{st.url}: the replica groups' roots ({', '.join(groups)}) "
                                f"hold no checkpoint whose parts all committed")
    rec = recover(views.bases, views.lineage_of, views.required_of)
    return StitchedView(manifest=stitched_manifest(views, rec), values=rec.values,
                        newest=views.bases[0].name, fallbacks=[], warnings=rec.warnings)


def check_output(path: str, out: str) -> None:
    """An export never writes into the checkpoint root it reads."""
    local = "://" not in path or path.startswith("file://")
    if local and "://" not in out:
        root = os.path.realpath(path.removeprefix("file://"))
        target = os.path.realpath(out)
        if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
            raise CheckpointError(f"the output {out} is inside the checkpoint root {path}; "
                                  f"choose an output outside it")
    elif out.rstrip("/") == path.rstrip("/") or out.startswith(path.rstrip("/") + "/"):
        raise CheckpointError(f"the output {out} is inside the checkpoint root {path}; "
                              f"choose an output outside it")


def consolidate(manifest: Manifest, values: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """Reassemble a view into ordinary names: ``model.<param>`` and ``optim.<param>.<state>``
    full tensors (stacked experts put back at [e]); objects as ``objects.<name>`` bytes.

    A tensor put together from parts (a stacked expert weight from its experts' items, a
    sharded tensor from its chunks) is allocated only when its parts in ``values`` hold
    exactly as many elements as the shape the manifest claims for it: a stranger's
    manifest cannot make the export allocate more than the checkpoint holds. Raises
    ValueError (and, for parts that do not fit, IndexError or RuntimeError) when the
    manifest and its items disagree."""
    structure = manifest.meta.structure
    shapes = {n: (s, d) for n, s, d in structure["params"]}
    layouts = {i: lay for i, (_, lay, _) in enumerate(structure["experts"])}
    placed = []  # (output name, stacked param name or None, expert, chunk, value)
    held: dict[str, int] = {}  # elements of ``values`` in each tensor put together
    for key, value in values.items():
        key, chunk = split_chunk(key)  # a shard of a sharded tensor goes to its place
        info = parse_key(key)
        pname: str | None = None
        if not info.is_expert:
            part, rest = key.split("/", 1)
            name = f"{part}.{rest.replace('/', '.')}"
        else:
            rest = key.split("/", 4)[4]
            if info.part == "model":
                pname, name = rest, f"model.{rest}"
            else:
                pname = rest.rsplit("/", 1)[0]
                name = f"optim.{rest.replace('/', '.')}"
            if layouts[info.layer] != "stacked":
                pname = None
        if pname is not None or chunk is not None:
            held[name] = held.get(name, 0) + value.numel()
        placed.append((name, pname, info.expert, chunk, value))
    out: dict[str, torch.Tensor] = {}
    for name, pname, expert, chunk, value in placed:
        if pname is None:
            _put(out, name, value, chunk, held.get(name, 0))
            continue
        if name not in out:
            shape, dtype = shapes[pname]
            numel = math.prod(chunk[2]) if chunk else value.numel()
            if (math.prod(shape) != numel * shape[0] or math.prod(shape) != held[name]
                    or dtype not in DTYPE_SIZES):
                raise ValueError(f"{pname}: structure says {shape} {dtype}, its expert items "
                                 f"hold {held[name]} elements (one is {list(value.shape)})")
            out[name] = torch.zeros(shape, dtype=getattr(torch, dtype))
        _into(out[name][expert], value, chunk)
    return out


def _put(out: dict[str, torch.Tensor], name: str, value: torch.Tensor, chunk,
         held: int) -> None:
    """``out[name] = value``, or for a chunk its block of the whole tensor (whose chunks
    hold ``held`` elements in all: they must fill it)."""
    if chunk is None:
        out[name] = value
        return
    if name not in out:
        if math.prod(chunk[2]) != held:
            raise ValueError(f"{name}: its chunks claim a tensor of shape {list(chunk[2])} "
                             f"and hold {held} elements of it")
        out[name] = torch.zeros(chunk[2], dtype=value.dtype)
    _into(out[name], value, chunk)


def _into(whole: torch.Tensor, value: torch.Tensor, chunk) -> None:
    if chunk is None:
        whole.copy_(value)
        return
    for d, (o, n) in enumerate(zip(chunk[0], chunk[1])):
        whole = whole.narrow(d, o, n)
    whole.copy_(value)


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What ``export_view`` wrote."""

    tensors: int
    """Tensors written."""
    view: StitchedView
    """The view exported (its base, and which experts came from older copies)."""

    def notes(self) -> list[str]:
        """One line per way the export differs from the newest checkpoint's own view."""
        lines = []
        if self.view.manifest.name != self.view.newest:
            lines.append(f"the newest checkpoint {self.view.newest} cannot be restored; "
                         f"exported the view of {self.view.manifest.name} instead")
        lines += [f"from an older copy: {f}" for f in self.view.fallbacks]
        return lines


def export_view(path: str, out: str, fmt: str, storage_options: dict | None = None
                ) -> ExportReport:
    """Write the view a restore would load as one plain DCP checkpoint or safetensors file.

    The view is stitched as ``CheckpointManager.restore()`` stitches it (a damaged item
    falls back to an older copy, named in the report). Refuses an output inside the
    checkpoint root, a view with no intact copy of some key and a view that lacks an
    expert (the export would hold zeros for it); raises a CheckpointError naming the
    problem."""
    check_output(path, out)
    view = read_view(path, storage_options)
    manifest, values = view.manifest, view.values
    missing = missing_experts(manifest)
    if missing:
        raise CheckpointError(f"the newest view ({manifest.name}) has no copy of {missing}; "
                              f"an export would hold zeros for it. Run `moepec verify {path}`")
    try:
        tensors = consolidate(manifest, values)
    except (IndexError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{manifest.name}: the manifest's structure does not match its "
                              f"items ({type(exc).__name__}: {exc}); the checkpoint is "
                              f"damaged") from None
    if "://" not in out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        weights = {k[len("model."):]: v.contiguous() for k, v in tensors.items()
                   if k.startswith("model.")}
        save_file(weights, out, metadata={"moepec_step": str(manifest.step),
                                          "moepec_checkpoint": manifest.name})
        return ExportReport(tensors=len(weights), view=view)
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        with single_process_dcp():
            dcp.save(tensors, checkpoint_id=out, no_dist=True)
        return ExportReport(tensors=len(tensors), view=view)
    raise CheckpointError(f"unknown export format {fmt!r}; use dcp or safetensors")


def format_inspect(info: dict[str, Any]) -> str:
    """The `moepec inspect` table."""
    rows: list[CheckpointRow] = info["checkpoints"]
    if not rows:
        return f"{info['path']}: no checkpoints"
    lines = [f"{info['path']}: {sum(r.committed for r in rows)} committed, "
             f"{sum(not r.committed for r in rows)} uncommitted"]
    lines.append(f"{'checkpoint':<28}{'step':>8}  {'state':<12}{'MB':>9}  {'K':>2}  "
                 f"{'PLT':>8}  experts saved per layer")
    for r in rows:
        state = "committed" if r.committed else ("DAMAGED" if r.error else "uncommitted")
        experts = "all (full)" if r.full else " ".join(
            ",".join(map(str, layer)) for layer in r.experts_saved)
        plt = f"{100 * r.plt:.3f}%" if r.plt is not None else "-"
        k = str(r.k_persist) if r.k_persist is not None else "-"
        step = "-" if r.step is None else r.step
        lines.append(f"{r.name:<28}{step:>8}  {state:<12}{r.bytes / 1e6:>9.2f}  {k:>2}  "
                     f"{plt:>8}  {experts if r.committed else (r.error or '')}")
        if r.committed and len(r.bytes_per_rank) > 1:
            lines.append(f"{'':<28}{'':>8}  bytes per rank: "
                         + ", ".join(f"{b / 1e6:.2f}MB" for b in r.bytes_per_rank))
    if info.get("head"):
        head = next(r for r in rows if r.name == info["head"])
        lines.append("")
        lines.append(f"view of {info['head']} (step {head.step}); full checkpoint would be "
                     f"{info['full_bytes'] / 1e6:.2f} MB, this one is {head.bytes / 1e6:.2f} MB")
        lines.append("age of each expert's newest copy, in steps (layer: e0 e1 ...):")
        for layer, ages in enumerate(info["view_age"]):
            lines.append(f"  layer {layer}: " + " ".join(str(a) for a in ages))
    return "\n".join(lines)
