"""The restore procedure: gather sources, agree, stitch, account; return the outcome.

:func:`restore_state` takes what it needs as arguments (:class:`RestoreContext`, the
committed manifests, this rank's RAM snapshot) and returns a :class:`RestoreOutcome`;
the manager applies it to itself and to the live training state. Every rank runs it
(collectives on the main thread, in the same order everywhere):

1. gather which RAM snapshots each rank still holds (in this process, or in shared
   memory left by the worker it replaces); the newest one the ranks hold completely
   (else the newest any rank holds) is served to all ranks by broadcast from the ranks
   holding its shares (a rank that lost it has none: storage covers its shares);
2. check the newest checkpoint was saved from this model;
3. choose a base and stitch every key (``recovery.stitch.recover``), then make all
   ranks agree on the base: if any rank had to fall back to an older base, all do;
4. account the lost tokens: the base's PLT ledger, plus recoveries recorded since the
   base was taken, plus this one (copy counts agreed over the ranks holding them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moepec.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DistributedError,
    ManifestError,
    NoCheckpointError,
    StructureMismatchError,
)
from moepec.keys import newest, parse_key, seq_of
from moepec.policy.plt import PLTLedger
from moepec.ram.snapshot import RamTier, Snapshot, clean_command, slot_jobs
from moepec.recovery.outcome import RestoreContext, RestoreOutcome
from moepec.recovery.records import lost_since, read_recoveries
from moepec.recovery.stitch import Recovered, Source, Tier, lost_tokens, recover
from moepec.recovery.views import StoredViews, same_runs, usable_manifests
from moepec.state.bytecopy import copy_into
from moepec.state.experts import structure_mismatches
from moepec.store.committed import Committed
from moepec.store.items import Item
from moepec.store.manifest import Manifest
from moepec.store.meta import CheckpointMeta
from moepec.store.persist import Persister

log = logging.getLogger(__name__)

_NO_COPY = 2**62  # "this rank restored no copy of that expert" in MIN-reductions


def restore_state(ctx: RestoreContext, found: Committed,
                  ram: Snapshot | Sequence[Snapshot] | None) -> RestoreOutcome | None:
    """Restore the newest view. All ranks call it (collective). Returns None when there is
    nothing to restore. Raises ManifestFormatError (a newer moepec wrote the newest
    checkpoints), StructureMismatchError, NoCheckpointError / CorruptCheckpointError."""
    manifests = usable_manifests(found)
    ram_src = gather_ram(ctx, ram)
    if not manifests and ram_src is None:
        return None
    head_name = newest(manifests)
    if head_name is not None:
        check_structure(ctx, manifests[head_name].meta)
    views = _Views(ctx, manifests, ram_src)
    snaps = [ram] if isinstance(ram, Snapshot) else list(ram or [])
    jobs = slot_jobs(snaps)
    where = ", ".join(map(str, jobs)) or "shared memory"
    # Every rank joins the vote, whatever it holds (no rank may skip a collective).
    if _any_rank(ctx, ram_src is not None and views.uncovered() is ram_src):
        # Slots that cannot be a base with what storage holds: storage serves, as
        # without the RAM tier (or nothing: a fresh start), instead of failing every run.
        if ctx.rank == 0:
            log.warning("not restoring from the RAM snapshot of step %d in %s: it does not "
                        "hold every expert of the model and %s has no checkpoint of its run "
                        "to complete it (deleted, or the slots were written with another "
                        "ExpertSpec); %s. To remove those slots: %s", ram_src.step, where,
                        ctx.storage.url, "restoring from storage" if manifests
                        else "starting fresh", clean_command(jobs))
        ram_src = None
        if not manifests:
            return None
        views = _Views(ctx, manifests, None)
    views.check_coverage()
    rec = agreed_recover(ctx, views)
    if rec.base.tier == Tier.RAM and not manifests and ctx.rank == 0 and (
            not snaps or any(s.origin != "process" for s in snaps)):
        # Meant for a first checkpoint that died before its commit; a user who deleted
        # the root to start over must hear that the slots bring the old run back.
        log.warning("restoring step %d from RAM slots in %s although %s holds no committed "
                    "checkpoint (its first checkpoint had not reached storage, or the "
                    "checkpoints were deleted). To start fresh instead, stop and run: %s",
                    rec.base.step, where, ctx.storage.url, clean_command(jobs))
    head = views.head_for(rec.base)
    ledger, lost = account(ctx, rec)
    sources, units_from = where_from(rec)
    return RestoreOutcome(values=rec.values, base=rec.base, head=head, ledger=ledger,
                          lost=lost, sources=sources, units_from=units_from,
                          warnings=rec.warnings)


def check_structure(ctx: RestoreContext, newest: CheckpointMeta) -> None:
    """Raises StructureMismatchError when ``newest`` was saved from another model."""
    mismatches = structure_mismatches(newest.structure, ctx.structure)
    if mismatches:
        raise StructureMismatchError(
            f"the checkpoint at {ctx.storage.url} was saved from a different model: "
            + "; ".join(mismatches)
            + ". Restore into the same model configuration or use another path")


def _mine(ctx: RestoreContext, key: str) -> bool:
    return ctx.catalog.wants(key)


class _Views:
    """The candidate bases, newest first, and for each its lineage and required keys."""

    def __init__(self, ctx: RestoreContext, manifests: Mapping[str, Manifest],
                 ram: Source | None) -> None:
        self.ctx = ctx
        self.manifests = manifests
        self.ram = ram
        self.stored = StoredViews(ctx.storage, manifests)
        self._required: dict[str, set[str]] = {}
        storage_bases = self.stored.bases
        # Newest first; a RAM snapshot before the committed copy of the same seq (it holds
        # K_snapshot experts), after any newer committed checkpoint.
        self.bases = sorted(([ram] if ram is not None and ram.complete else [])
                            + storage_bases, key=lambda s: (s.seq, s.tier == Tier.RAM),
                            reverse=True)
        # The committed checkpoint a RAM snapshot continues (its lineage on storage).
        self.ram_head = (newest(n for n in manifests if seq_of(n) <= ram.seq)
                         if ram is not None else None)
        if not self.bases:
            raise NoCheckpointError(f"no committed checkpoint under {ctx.storage.url} and "
                                    f"no complete RAM snapshot")

    def uncovered(self) -> Source | None:
        """The newest base whose view can be read (recover skips the others), when it
        does not hold every expert this rank owns; else None."""
        for base in self.bases:
            try:
                required = self.required_of(base)
            except ManifestError:
                continue
            if not self.ctx.catalog.covers_owned_experts(required, self.ctx.weights_in_view):
                return base
            return None
        return None

    def check_coverage(self) -> None:
        """Raises NoCheckpointError when the newest readable base lacks experts of the
        model (:meth:`uncovered`): it was saved with another ExpertSpec."""
        base = self.uncovered()
        if base is not None:
            raise NoCheckpointError(
                f"{base.name} does not hold every expert of the model (saved with a "
                f"different ExpertSpec?); restore with the spec it was saved with")

    def head_for(self, base: Source) -> Manifest | None:
        name = self.ram_head if base.tier == Tier.RAM else base.name
        return self.manifests[name] if name else None

    def lineage_of(self, base: Source) -> list[Source]:
        if base.tier == Tier.RAM:
            chain = self.stored.chain(self.ram_head) if self.ram_head else []
            return [base] + same_runs(base, chain)
        chain = self.stored.chain(base.name)
        ram = self.ram
        if ram is not None and ram.seq <= base.seq:
            # the same process's RAM copy, not newer than the base: a valid older copy
            pos = next((i for i, s in enumerate(chain) if s.seq < ram.seq), len(chain))
            chain.insert(pos, ram)
        return same_runs(base, chain)

    def required_of(self, base: Source) -> set[str]:
        """The keys of ``base``'s view this rank restores (computed once per base: the
        coverage check and the stitch both ask; callers only read the set)."""
        required = self._required.get(base.name)
        if required is None:
            if base.tier == Tier.RAM:
                view = self.manifests[self.ram_head].view if self.ram_head else {}
                keys = set(view) | set(base.keys)
            else:
                keys = self.stored.required_of(base)
            required = self._required[base.name] = {k for k in keys if _mine(self.ctx, k)}
        return required


# -- the RAM tier ---------------------------------------------------------------------
def _any_rank(ctx: RestoreContext, flag: bool) -> bool:
    """``flag`` on any rank (collective when distributed: every rank calls it)."""
    if ctx.world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_ram(ctx: RestoreContext, snaps: Snapshot | Sequence[Snapshot] | None
                ) -> Source | None:
    """The RAM snapshot to restore from, with every share a rank still has, materialised
    on every rank that needs it (broadcast from the holders). Collective.

    ``snaps``: the snapshots this rank holds, newest first. The chosen seq is the newest
    whose shares together hold every non-expert key (a complete base), else the newest
    any rank holds (its expert copies may still serve)."""
    if snaps is None:
        snaps = []
    elif isinstance(snaps, Snapshot):
        snaps = [snaps]
    # This rank's own share and the replicas it keeps of other ranks' shares, per seq.
    by_seq: dict[int, dict[str, torch.Tensor]] = {}
    first: dict[int, Snapshot] = {}
    for s in snaps:
        by_seq.setdefault(s.seq, {}).update(s.tensors)
        first.setdefault(s.seq, s)
    if ctx.world_size == 1:
        if not snaps:
            return None
        snap = max(snaps, key=lambda s: s.seq)
        return _ram_source(f"ram:{snap.seq}", snap.meta, dict(snap.tensors), complete=True)
    mine = [{"seq": seq, "meta": first[seq].meta, "all_keys": first[seq].all_keys,
             "keys": {k: (list(t.shape), str(t.dtype).removeprefix("torch."))
                      for k, t in tensors.items()}} for seq, tensors in by_seq.items()]
    held: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(held, mine)
    offers = [(r, h) for r, hs in enumerate(held) for h in hs]
    if not offers:
        return None
    choices = []
    for seq in sorted({h["seq"] for _, h in offers}, reverse=True):
        holders = [(r, h) for r, h in offers if h["seq"] == seq]
        owner: dict[str, int] = {}
        shapes: dict[str, tuple[list[int], str]] = {}
        for r, h in holders:
            for k, spec in h["keys"].items():
                owner.setdefault(k, r)
                shapes[k] = spec
        all_keys = holders[0][1]["all_keys"]
        complete = all(k in owner for k in all_keys if not parse_key(k).is_expert)
        choices.append((complete, seq, holders, owner, shapes, all_keys))
    complete, seq, holders, owner, shapes, all_keys = next(
        (c for c in choices if c[0]), choices[0])
    owner = _whole_units(owner, all_keys)
    values = _broadcast_shares(ctx, by_seq.get(seq), owner, shapes)
    log.info("RAM snapshot %d: %d of %d keys survive on %d rank(s)%s", seq, len(owner),
             len(all_keys), len(holders), "" if complete else " (not a complete base)")
    return _ram_source(f"ram:{seq}", holders[0][1]["meta"], values, complete)


def _whole_units(owner: Mapping[str, int], all_keys: Sequence[str]) -> dict[str, int]:
    """``owner`` without the expert units (layer, expert, part) of which some key is lost.

    A unit sharded over ranks (DTensor chunks) whose chunks were snapshotted by several
    ranks must come from one copy on all of them: were the survivors' chunks served from
    RAM and a restarted rank's from storage (an older step), the expert would be stitched
    from two steps. Dropped from the RAM source on every rank alike (``owner`` and
    ``all_keys`` are the same everywhere), the whole unit comes from storage.
    """
    lost = set()
    for k in all_keys:
        info = parse_key(k)
        if info.is_expert and k not in owner:
            lost.add((info.layer, info.expert, info.part))
    if not lost:
        return dict(owner)
    kept = {}
    for k, r in owner.items():
        info = parse_key(k)
        if not info.is_expert or (info.layer, info.expert, info.part) not in lost:
            kept[k] = r
    return kept


def _broadcast_shares(ctx: RestoreContext, held: Mapping[str, torch.Tensor] | None,
                      owner: Mapping[str, int],
                      shapes: Mapping[str, tuple[list[int], str]]) -> dict[str, torch.Tensor]:
    """Every surviving key, sent by its holder; kept where this rank needs it."""
    values: dict[str, torch.Tensor] = {}
    for key in sorted(owner):  # the same order on every rank
        shape, dtype = shapes[key]
        if owner[key] == ctx.rank:
            t = held[key].contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=owner[key])
        if _mine(ctx, key):
            values[key] = t
    return values


def _ram_source(name: str, meta: CheckpointMeta, values: dict[str, torch.Tensor],
                complete: bool) -> Source:
    keys = {k: Item(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for k, t in values.items()}

    def read(targets: dict[str, torch.Tensor]) -> None:
        for k, t in targets.items():
            copy_into(t, values[k])

    return Source(name=name, tier=Tier.RAM, meta=meta, keys=keys, read=read,
                  complete=complete)


# -- agreement and accounting ------------------------------------------------------------
def agreed_recover(ctx: RestoreContext, views: Any,
                   order: Callable[[Source], int] = lambda b: b.seq) -> Recovered:
    """recover(), then make every rank use the same base (the oldest any rank needed).
    ``views``: ``bases`` newest first, ``lineage_of``, ``required_of``; ``order``: a base's
    place, the same on every rank (the checkpoint seq of one root).

    Every iteration runs the same two collectives on every rank, so ranks that must
    go back and ranks that need not stay in step.
    """
    bases = views.bases
    while True:
        rec = recover(bases, views.lineage_of, views.required_of, verify=ctx.verify,
                      target=ctx.catalog.read_target if ctx.read_in_place else None,
                      wanted=ctx.catalog.wants)
        if ctx.world_size == 1:
            return rec
        seq = torch.tensor([order(rec.base)], dtype=torch.int64)
        low, high = seq.clone(), seq.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low.item() == high.item():
            return rec
        older = [b for b in bases if order(b) <= low.item()]
        if not older:
            raise DistributedError("ranks could not agree on a checkpoint to restore")
        if seq.item() != low.item():
            log.warning("another rank could not use checkpoint seq %d; restoring seq %d on "
                        "all ranks", seq.item(), low.item())
        bases = older


def account(ctx: RestoreContext, rec: Recovered, since_seq: int | None = None
            ) -> tuple[PLTLedger, list[list[int]]]:
    """The PLT ledger after this recovery, and what this recovery lost (the recoveries
    this root recorded after checkpoint ``since_seq``, default the base's, count too).
    Collective."""
    ledger = PLTLedger.create(ctx.n_experts)
    ledger.load_state_dict(rec.base.meta.ledger)
    since = rec.base.seq if since_seq is None else since_seq
    for layer, row in enumerate(_recorded_since(ctx, since)):
        for e, v in enumerate(row):
            ledger.lost[layer][e] += v
    at_base, at_copy = lost_tokens(rec)
    at_copy = _agree_copy_counts(ctx, rec, at_base, at_copy)
    try:
        lost = ledger.record_recovery(at_base, at_copy)
    except ValueError as exc:  # counts that contradict each other: damaged bookkeeping
        raise CorruptCheckpointError(
            f"{rec.base.name}: its routing counts contradict those of the copies restored "
            f"with it ({exc}); the checkpoint's bookkeeping is damaged. Run `moepec verify` "
            f"and restore an older checkpoint") from None
    return ledger, lost


def _recorded_since(ctx: RestoreContext, base_seq: int) -> list[list[int]]:
    """Lost counts of recoveries recorded after checkpoint ``base_seq`` was taken, read
    by rank 0 and broadcast (every rank must account the same)."""
    total = (lost_since(read_recoveries(ctx.storage), base_seq, ctx.n_experts)
             if ctx.rank == 0 else [[0] * n for n in ctx.n_experts])
    if ctx.world_size > 1 and ctx.n_experts:
        flat = torch.tensor([v for row in total for v in row], dtype=torch.int64)
        dist.broadcast(flat, src=0)
        total = _unflatten(flat.tolist(), ctx.n_experts)
    return total


def _agree_copy_counts(ctx: RestoreContext, rec: Recovered, at_base: list[list[int]],
                       at_copy: list[list[int]]) -> list[list[int]]:
    """Each rank knows the copies of the experts it holds; agree on all of them."""
    if ctx.world_size == 1 or not ctx.n_experts:
        return at_copy
    owned_units = {(layer, e) for (layer, e, part) in rec.unit_source if part == "model"}
    flat = [at_copy[layer][e] if (layer, e) in owned_units else _NO_COPY
            for layer, n in enumerate(ctx.n_experts) for e in range(n)]
    t = torch.tensor(flat, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = _unflatten(t.tolist(), ctx.n_experts)
    return [[at_base[layer][e] if v == _NO_COPY else v for e, v in enumerate(row)]
            for layer, row in enumerate(agreed)]


def _unflatten(values: Sequence[int], n_experts: Sequence[int]) -> list[list[int]]:
    out, i = [], 0
    for n in n_experts:
        out.append(list(values[i:i + n]))
        i += n
    return out


def where_from(rec: Recovered) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """RestoreReport.sources and units_from of a recovery."""
    sources: dict[str, dict[str, Any]] = {}
    units_from: dict[str, int] = {}
    for (layer, expert, part), src in sorted(rec.unit_source.items()):
        tier = str(src.tier)
        units_from[tier] = units_from.get(tier, 0) + 1
        if part == "model" or f"{layer}/{expert}" not in sources:
            sources[f"{layer}/{expert}"] = {"step": src.step, "tier": tier,
                                            "checkpoint": src.name}
    return sources, units_from


def persist_on_failure(snap: Snapshot | None, found: Committed, *, persister: Persister,
                       ram_tier: RamTier, distributed: bool, paused: bool) -> str | None:
    """Persist the RAM base a previous worker left in shared memory if storage lacks
    it (it was due for storage and its worker died first), before training resumes,
    so a second fault cannot lose it. All ranks (they agree on doing it; collective when
    ``distributed``); nothing when checkpoints are ``paused``. Returns the checkpoint
    name committed, or None."""
    due = (snap is not None and snap.origin == "shm" and snap.persist_experts is not None
           and not any(mf_seq >= snap.seq for mf_seq in
                       (m.seq for m in found.manifests.values())))
    if distributed:
        flag = torch.tensor([1 if due else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        due = bool(flag.item())
    if not due or paused:
        return None
    assert snap is not None
    # Written under this run's name: the dead worker's unfinished folder of the same
    # snapshot (another run's name) is left to retention, never written into.
    name = persister.name_of(snap)
    ram_tier.hold(snap)  # the persist worker's reference, released when written
    t0 = time.perf_counter()
    persister.submit(snap)
    persister.wait_idle()
    try:
        persister.check()
    except CheckpointError as exc:
        log.warning("could not persist the RAM snapshot of step %d: %s", snap.step, exc)
        return None
    log.info("persisted RAM snapshot of step %d (only in RAM when its worker died) as %s "
             "in %.2fs", snap.step, name, time.perf_counter() - t0)
    return name
