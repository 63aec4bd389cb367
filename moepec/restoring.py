"""The restore procedure of CheckpointManager: gather sources, agree, stitch, apply.

Every rank runs it (collectives on the main thread, in the same order everywhere):

1. drain the snapshot and persist in flight;
2. read the committed manifests (shared storage: every rank sees the same);
3. gather which RAM snapshot each rank still holds; the newest one is served to all
   ranks by broadcast from the ranks holding its shares (a rank that restarted has
   none: its shares are missing, and storage covers them);
4. choose a base and stitch every key (``recovery.recover``), then make all ranks
   agree on the base: if any rank had to fall back to an older base, all do;
5. copy the values into the model, optimizer and extra state, and restore the
   bookkeeping (PLT ledger, selectors, K, lineage) from the base.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moepec import manifest as mf
from moepec.errors import (
    CheckpointError,
    DistributedError,
    NoCheckpointError,
    StructureMismatchError,
)
from moepec.experts import structure_mismatches
from moepec.recovery import RestoreReport, Source, lost_tokens, recover, storage_source
from moepec.state import parse_key

if TYPE_CHECKING:
    from moepec.manager import CheckpointManager

log = logging.getLogger(__name__)

_NO_COPY = 2**62  # "this rank restored no copy of that expert" in MIN-reductions


def restore(mgr: CheckpointManager) -> RestoreReport | None:
    t0 = time.perf_counter()
    _drain(mgr)
    manifests = _read_manifests(mgr)
    mgr.seq = max(mgr.seq, mgr._next_seq())
    ram = _gather_ram(mgr)
    if not manifests and ram is None:
        return None
    newest = mf.newest(manifests)
    if newest is not None:
        mismatches = structure_mismatches(manifests[newest]["structure"], mgr.structure)
        if mismatches:
            raise StructureMismatchError(
                f"the checkpoint at {mgr.config.path} was saved from a different model: "
                + "; ".join(mismatches)
                + ". Restore into the same model configuration or use another path")
    sources = {n: storage_source(mgr.storage, n, m) for n, m in manifests.items()}
    storage_bases = sorted(sources.values(), key=lambda s: mf.seq_of(s.name), reverse=True)
    ram_seq = ram.meta["seq"] if ram is not None else -1
    ram_is_base = ram is not None and ram.meta.get("complete", False)
    # The committed checkpoint a RAM snapshot continues (its lineage on storage).
    older = [n for n in manifests if mf.seq_of(n) <= ram_seq]
    head_for_ram = mf.newest(older) if ram is not None else None

    def lineage_of(base: Source) -> list[Source]:
        if base.tier == "ram":
            chain = mf.lineage(manifests, head_for_ram) if head_for_ram else []
            return [base] + [sources[n] for n in chain]
        chain = [sources[n] for n in mf.lineage(manifests, base.name)]
        if ram is not None and ram_seq <= base.meta["seq"]:
            # the same process's RAM copy, not newer than the base: a valid older copy
            pos = next((i for i, s in enumerate(chain) if s.meta["seq"] < ram_seq), len(chain))
            chain.insert(pos, ram)
        return chain

    def required_of(base: Source) -> set[str]:
        if base.tier == "ram":
            view = manifests[head_for_ram]["view"] if head_for_ram else {}
            keys = set(view) | set(base.keys)
        else:
            keys = set(base.meta["view"])
        return {k for k in keys if _mine(mgr, k)}

    bases = ([ram] if ram_is_base else []) + storage_bases
    if not bases:
        raise NoCheckpointError(
            f"no committed checkpoint under {mgr.config.path} and no complete RAM snapshot")
    if not covers_owned_experts(mgr, required_of(bases[0])):
        raise NoCheckpointError(
            f"{bases[0].name} does not hold every expert of the model (saved with a "
            f"different ExpertSpec?); restore with the spec it was saved with")
    rec = _agreed_recover(mgr, bases, lineage_of, required_of)

    shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch."))
              for k, v in rec.values.items()}
    mgr.catalog.ensure_optimizer_state(shapes)
    mgr.catalog.load(rec.values)
    mgr._key_cache = {}  # restored optimizer state may be new tensors

    meta = rec.base.meta
    mgr.ledger.load_state_dict(meta["ledger"])
    base_seq = meta["seq"]
    for layer, row in enumerate(_recoveries_since(mgr, base_seq)):
        for e, v in enumerate(row):
            mgr.ledger.lost[layer][e] += v
    at_base, at_copy = lost_tokens(rec, mgr.n_experts)
    at_copy = _agree_copy_counts(mgr, rec, at_base, at_copy)
    lost = mgr.ledger.record_recovery(at_base, at_copy)
    mgr.persist_selector.load_state_dict(meta["selectors"]["persist"])
    mgr.ram_selector.load_state_dict(meta["selectors"]["ram"])
    mgr.k_persist, mgr.k_snapshot = meta["k_persist"], meta["k_snapshot"]
    mgr.k_history = [list(x) for x in meta["k_history"]]
    mgr._index = meta["index"] + 1
    mgr._adjust_k(meta["step"])
    if rec.base.tier == "storage":
        mgr.persister.head = rec.base.name
        if mgr.ram is not None and mgr.ram.seq > base_seq:
            mgr._release(mgr.ram)  # a snapshot of the abandoned future
            mgr.ram = None
    else:
        mgr.persister.head = head_for_ram
    head = manifests.get(mgr.persister.head) if mgr.persister.head else None
    mgr.persister.head_view = dict(head["view"]) if head else {}
    mgr.persister.head_ancestors = list(head.get("ancestors", [])) if head else []
    mgr._covered = (None, False)  # recomputed from the restored head at the next save
    mgr._pending_counts = [[0] * n for n in mgr.n_experts]

    sources_report: dict[str, dict[str, Any]] = {}
    keys_from: dict[str, int] = {}
    for (layer, expert, part), src in sorted(rec.unit_source.items()):
        keys_from[src.tier] = keys_from.get(src.tier, 0) + 1
        if part == "model" or f"{layer}/{expert}" not in sources_report:
            sources_report[f"{layer}/{expert}"] = {"step": src.step, "tier": src.tier,
                                                   "checkpoint": src.name}
    report = RestoreReport(step=meta["step"], checkpoint=rec.base.name, tier=rec.base.tier,
                           sources=sources_report, lost=lost, plt=mgr.ledger.plt(),
                           warnings=rec.warnings, seconds=time.perf_counter() - t0,
                           keys_from=keys_from)
    _record_recovery(mgr, report, base_seq)
    mgr.restores.append(report)
    log.info("restored step %d from %s (%s); lost %d token assignments, PLT %.4f%%",
             report.step, report.checkpoint, report.tier, report.lost_total, 100 * report.plt)
    return report


# -- steps ----------------------------------------------------------------------------
def _drain(mgr: CheckpointManager) -> None:
    try:
        snap = mgr.snapshotter.wait()
        if snap is not None:
            mgr._promote(snap)
    except CheckpointError as exc:
        log.warning("discarding the snapshot in progress: %s", exc)
    mgr.persister.wait_idle()
    try:
        mgr.persister.check()
    except CheckpointError as exc:
        log.warning("%s", exc)


def _read_manifests(mgr: CheckpointManager) -> dict[str, dict[str, Any]]:
    out = {}
    for name, committed in mgr.storage.list_checkpoints():
        if not committed:
            continue
        try:
            manifest = mgr.storage.read_manifest(name)
        except CheckpointError as exc:
            log.warning("ignoring %s: %s", name, exc)
            continue
        if manifest.get("format") not in mf.KNOWN_FORMATS:
            # Not skipped: restoring older checkpoints past it would lose its progress.
            raise CheckpointError(
                f"{mgr.storage.url}/{name} has manifest format {manifest.get('format')!r}, "
                f"which this moepec cannot read (it reads {', '.join(mf.KNOWN_FORMATS)}); "
                f"it was written by a newer moepec: upgrade moepec")
        out[name] = manifest
    return out


def _mine(mgr: CheckpointManager, key: str) -> bool:
    info = parse_key(key)
    return not info.is_expert or mgr.catalog.owns(info.layer, info.expert)


def _gather_ram(mgr: CheckpointManager) -> Source | None:
    """The newest RAM snapshot any rank holds, with every share a rank still has,
    materialised on every rank that needs it (broadcast from the holders)."""
    snap = mgr.ram if (mgr.ram is not None and mgr.ram.done.is_set()
                       and mgr.ram.error is None) else None
    if mgr.world_size == 1:
        if snap is None:
            return None
        return _ram_source(f"ram:{snap.seq}", snap.step, snap.meta,
                           dict(snap.tensors), complete=True)
    mine = None
    if snap is not None:
        mine = {"seq": snap.seq, "step": snap.step, "meta": snap.meta, "all_keys": snap.all_keys,
                "keys": {k: (list(t.shape), str(t.dtype).removeprefix("torch."))
                         for k, t in snap.tensors.items()}}
    held: list[Any] = [None] * mgr.world_size
    dist.all_gather_object(held, mine)
    seqs = [h["seq"] for h in held if h is not None]
    if not seqs:
        return None
    seq = max(seqs)
    holders = [(r, h) for r, h in enumerate(held) if h is not None and h["seq"] == seq]
    owner: dict[str, int] = {}
    shapes: dict[str, tuple[list[int], str]] = {}
    for r, h in holders:
        for k, spec in h["keys"].items():
            owner.setdefault(k, r)
            shapes[k] = spec
    all_keys = holders[0][1]["all_keys"]
    non_expert = [k for k in all_keys if not parse_key(k).is_expert]
    complete = all(k in owner for k in non_expert)
    values: dict[str, torch.Tensor] = {}
    for key in sorted(owner):  # the same order on every rank
        shape, dtype = shapes[key]
        if owner[key] == mgr.rank:
            t = snap.tensors[key].contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=owner[key])
        if _mine(mgr, key):
            values[key] = t
    meta = holders[0][1]["meta"]
    log.info("RAM snapshot %d: %d of %d keys survive on %d rank(s)%s", seq, len(owner),
             len(all_keys), len(holders), "" if complete else " (not a complete base)")
    return _ram_source(f"ram:{seq}", holders[0][1]["step"], meta, values, complete)


def _ram_source(name: str, step: int, meta: dict[str, Any], values: dict[str, torch.Tensor],
                complete: bool) -> Source:
    keys = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for k, t in values.items()}
    meta = dict(meta, complete=complete)

    def read(targets: dict[str, torch.Tensor]) -> None:
        for k, t in targets.items():
            t.copy_(values[k])

    return Source(name=name, tier="ram", step=step, counts=meta["counts"], keys=keys,
                  read=read, meta=meta)


def covers_owned_experts(mgr: CheckpointManager, keys: set[str]) -> bool:
    seen: dict[int, set[int]] = {}
    for k in keys:
        info = parse_key(k)
        if info.is_expert and (info.part == "model" or mgr.config.pec_scope == "optimizer"):
            seen.setdefault(info.layer, set()).add(info.expert)
    for layer, n in enumerate(mgr.n_experts):
        owned = {e for e in range(n) if mgr.catalog.owns(layer, e)}
        if not owned <= seen.get(layer, set()):
            return False
    return True


def _agreed_recover(mgr, bases, lineage_of, required_of):
    """recover(), then make every rank use the same base (the oldest any rank needed).

    Every iteration runs the same two collectives on every rank, so ranks that must
    go back and ranks that need not stay in step.
    """
    while True:
        rec = recover(bases, lineage_of, required_of, verify=mgr.config.verify)
        if mgr.world_size == 1:
            return rec
        seq = torch.tensor([rec.base.meta["seq"]], dtype=torch.int64)
        low, high = seq.clone(), seq.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low.item() == high.item():
            return rec
        older = [b for b in bases if b.meta["seq"] <= low.item()]
        if not older:
            raise DistributedError("ranks could not agree on a checkpoint to restore")
        if seq.item() != low.item():
            log.warning("another rank could not use checkpoint seq %d; restoring seq %d on "
                        "all ranks", seq.item(), low.item())
        bases = older


def _agree_copy_counts(mgr, rec, at_base, at_copy):
    """Each rank knows the copies of the experts it holds; agree on all of them."""
    if mgr.world_size == 1 or not mgr.n_experts:
        return at_copy
    owned_units = {(layer, e) for (layer, e, part) in rec.unit_source if part == "model"}
    flat = []
    for layer, n in enumerate(mgr.n_experts):
        for e in range(n):
            flat.append(at_copy[layer][e] if (layer, e) in owned_units else _NO_COPY)
    t = torch.tensor(flat, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    values, i, out = t.tolist(), 0, []
    for layer, n in enumerate(mgr.n_experts):
        row = []
        for e in range(n):
            row.append(at_base[layer][e] if values[i] == _NO_COPY else values[i])
            i += 1
        out.append(row)
    return out


def _recoveries_dir(mgr: CheckpointManager) -> str:
    return f"{mgr.storage.root}/recoveries"


def _record_recovery(mgr: CheckpointManager, report: RestoreReport, base_seq: int) -> None:
    """Write a recovery record (rank 0): PLT stays cumulative across restarts even when
    another fault strikes before the next checkpoint commits."""
    if mgr.rank != 0:
        return
    record = {"time": time.time(), "base_seq": base_seq, "next_seq": mgr.seq,
              "step": report.step, "checkpoint": report.checkpoint, "tier": report.tier,
              "lost": report.lost, "plt": report.plt, "seconds": report.seconds,
              "k_persist": mgr.k_persist, "warnings": report.warnings}
    try:
        mgr.storage.fs.makedirs(_recoveries_dir(mgr), exist_ok=True)
        mgr.storage.fs.pipe_file(
            f"{_recoveries_dir(mgr)}/rec-{mgr.seq:06d}-{time.time_ns()}.json",
            json.dumps(record).encode())
    except Exception as exc:  # noqa: BLE001 - the record is advisory; training goes on
        log.warning("could not write the recovery record: %s", exc)


def read_recoveries(storage) -> list[dict[str, Any]]:
    """All recovery records under a checkpoint root, oldest first."""
    try:
        paths = sorted(storage.fs.ls(f"{storage.root}/recoveries", detail=False))
    except FileNotFoundError:
        return []
    out = []
    for path in paths:
        try:
            out.append(json.loads(storage.fs.cat_file(path)))
        except Exception:  # noqa: BLE001 - a damaged record is skipped
            log.warning("skipping unreadable recovery record %s", path)
    return sorted(out, key=lambda r: r.get("time", 0))


def _recoveries_since(mgr: CheckpointManager, base_seq: int) -> list[list[int]]:
    """Lost counts of recoveries made after checkpoint ``base_seq`` was taken (its ledger
    does not know them), agreed from rank 0."""
    total = [[0] * n for n in mgr.n_experts]
    if mgr.rank == 0:
        for rec in read_recoveries(mgr.storage):
            if rec.get("next_seq", -1) > base_seq and rec.get("base_seq", -1) <= base_seq:
                for layer, row in enumerate(rec["lost"][:len(total)]):
                    for e, v in enumerate(row[:len(total[layer])]):
                        total[layer][e] += v
    if mgr.world_size > 1 and mgr.n_experts:
        flat = torch.tensor([v for row in total for v in row], dtype=torch.int64)
        dist.broadcast(flat, src=0)
        values, i = flat.tolist(), 0
        for layer, n in enumerate(mgr.n_experts):
            total[layer] = values[i:i + n]
            i += n
    return total
