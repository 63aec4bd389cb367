"""The flat front end: PEC for a framework that hands moepec its own per-rank sharded
state dict (Megatron-Core's ``dist_checkpointing`` today), on the engine the manager uses.

A door turns the framework's shards into flat keys (one string per shard), expert units
and CPU tensors, and calls, in order:

1. :meth:`FlatFrontEnd.observe_routing` (any time, training thread): the tokens routed
   per (MoE layer, expert) on this rank, as the manager's ``observe_routing``;
2. :meth:`FlatFrontEnd.plan_save` (all ranks, collective): the experts this save writes
   (the schedule: selection policy, K, ``full_every``, dynamic K), the view it commits;
3. :func:`moepec.store.flat.write_rank` (any process, no collective): this rank's keys;
4. :meth:`FlatFrontEnd.finish_save` (all ranks, collective): rank 0 commits;
5. :meth:`FlatFrontEnd.load` (all ranks; with ``agree=True`` one collective that checks
   they chose the same copies, and one after the read: a rank's failed read fails the
   load on every rank): a stitched load of a folder,
   each expert's newest intact copy, with a :class:`moepec.RestoreReport` (PLT, paper
   Eq. 7, from the routing counts kept in the manifests).

Collectives run on the default process group of ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moepec.errors import CheckpointError, ConfigError, MoepecError
from moepec.flat.final import FinalSaves
from moepec.flat.lineage import (
    Choice,
    agreed,
    choose_copies,
    committed,
    item_in,
    manifest_or_none,
    settled,
    without_gone,
)
from moepec.flat.plan import (
    FlatPlan,
    Parent,
    Unit,
    account_load,
    flat_config,
    layer_sizes,
    plan_save,
    schedule_for,
)
from moepec.flat.regions import (
    assemble,
    global_shapes,
    overlapping,
    parse_shard_key,
    stored_region,
)
from moepec.keys import MANIFEST_NAME
from moepec.recovery.outcome import RestoreReport
from moepec.store.flat import (
    FlatManifest,
    commit,
    empty_like_item,
    read_keys,
    read_manifest,
    read_records,
    record_name,
    scan,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Known:
    """A folder this process committed or loaded last, for the next save to continue."""

    root: str
    parent: Parent
    committed_at: float
    """Its manifest's commit time: tells it from a later folder of the same name."""


def _parent_of(m: FlatManifest, ledger: Mapping[str, Any] | None = None) -> Parent:
    return Parent(m.name, m.seq, dict(m.view), list(m.layers), m.schedule, ledger,
                  m.uid, list(m.ancestors))


class FlatFrontEnd(FinalSaves):
    """One door's PEC state in this process: its settings, the routing counts since the
    last save, the save in flight, the last one committed or loaded, a final save's mark."""

    def __init__(self, **fields: Any) -> None:
        """``fields``: :data:`moepec.flat.plan.FLAT_FIELDS` of CheckpointConfig (``k_persist``,
        ``selection``, ``full_every``, ``plt_budget``, ``dynamic_k``, ``dynamic_k_down``).
        Raises ConfigError for anything else."""
        self.config = flat_config(**fields)
        self._counts: list[list[int]] = []
        self._on_device: dict[int, torch.Tensor] = {}
        self._pending: FlatPlan | None = None
        self._head: _Known | None = None
        self._loaded: _Known | None = None
        self._report: RestoreReport | None = None
        self._read_cache: tuple[str, str, Choice] | None = None  # the last load's, for its files
        self._uids: dict[str, tuple[tuple, str]] = {}  # folder_uid's reads (rank 0 saves)
        self._rotating: set[str] = set()  # roots whose old folders get deleted: saves full

    # -- routing ---------------------------------------------------------------------
    def observe_routing(self, counts: Any) -> None:
        """Add this rank's token assignments per (MoE layer L, global expert E): a nested
        sequence or a 2-D tensor, layers in the model's order. Summed over ranks at the
        next save. Raises ConfigError for a negative count or a ragged input."""
        rows = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        for li, row in enumerate(rows):
            row = row.tolist() if isinstance(row, torch.Tensor) else list(row)
            if any(int(c) < 0 for c in row):
                raise ConfigError("routing counts must be >= 0")
            while len(self._counts) <= li:
                self._counts.append([])
            mine = self._counts[li]
            mine.extend([0] * (len(row) - len(mine)))
            for e, c in enumerate(row):
                mine[e] += int(c)

    def observe_layer(self, layer: int, counts: torch.Tensor) -> None:
        """Add one MoE layer's tokens per global expert from one forward (a door's router
        hook): summed on the tensor's device, read at the next save, so the training
        path never waits for a copy to the host."""
        counts = counts.detach().reshape(-1)
        held = self._on_device.get(layer)
        self._on_device[layer] = (counts.to(torch.int64, copy=True) if held is None
                                  else held.add_(counts.to(torch.int64)))

    def _take_counts(self, sizes: Sequence[int]) -> list[list[int]] | None:
        """All ranks: the counts since the last save summed over ranks, shaped to the
        model's layers; None when no rank observed any."""
        held, self._on_device = self._on_device, {}
        if held:  # one host copy per MoE layer, at the save
            rows: list[Any] = [[] for _ in range(max(held) + 1)]
            for layer, counts in held.items():
                rows[layer] = counts.cpu()
            self.observe_routing(rows)
        if len(self._counts) > len(sizes) or any(
                len(r) > n for r, n in zip(self._counts, sizes)):
            raise ConfigError(f"observe_routing got counts for {len(self._counts)} layers "
                              f"x up to {max(map(len, self._counts), default=0)} experts; "
                              f"the model has experts per MoE layer {list(sizes)}")
        t = torch.zeros(len(sizes) + 1, max(sizes, default=0) + 1, dtype=torch.int64)
        for li, row in enumerate(self._counts):
            t[li, :len(row)] = torch.tensor(row, dtype=torch.int64)
        t[-1, -1] = 1 if self._counts else 0
        dist.all_reduce(t)
        self._counts = []
        if not int(t[-1, -1]):
            return None
        return [t[li, :n].tolist() for li, n in enumerate(sizes)]

    # -- saving ----------------------------------------------------------------------
    def plan_save(self, root: str, name: str, step: int, units: Mapping[str, Unit | None],
                  error: str | None = None) -> FlatPlan:
        """All ranks: plan the save of folder ``name`` of save directory ``root``.
        ``units``: this rank's keys to save -> expert unit (None: non-expert state);
        ``error``: why this rank cannot save (it reaches every rank). Raises
        CheckpointError on every rank when a rank had an error, the directory cannot be
        read or the folder is committed already."""
        self._read_cache = None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dict(units), error, os.urandom(8).hex(),
                                          self.take_final_mark()))
        failed = [f"rank {r}: {e}" for r, (_, e, *_) in enumerate(gathered) if e is not None]
        if failed:
            raise CheckpointError(f"{root}/{name} not saved; {'; '.join(failed)}")
        every = [u for u, *_ in gathered]
        sizes = layer_sizes(every)
        counts = self._take_counts(list(sizes.values()))
        parent = self._parent(root, name)
        schedule = schedule_for(sizes, self.config, parent, dist.get_rank(), step)
        plan = plan_save(root, name, step, every, parent, schedule, counts,
                         uid=gathered[0][2], full=self.final_agreed(gathered))
        self._pending = plan
        return plan

    def _parent(self, root: str, name: str) -> Parent | None:
        """The folder this save continues: the pending save of this process, the last
        it committed, the one it loaded, else the newest committed (rank 0 reads)."""
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:  # whatever happens, the other ranks must hear of it (they wait below)
                box[0] = without_gone(root, self._read_parent(root, name), self._uids,
                                      self._rotating)
            except (OSError, MoepecError) as exc:
                box[0] = f"{root} cannot be read ({exc})"
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise CheckpointError(box[0])
        return box[0]

    def _read_parent(self, root: str, name: str) -> Parent | str | None:
        if os.path.exists(os.path.join(root, name, MANIFEST_NAME)):
            return f"{root}/{name} is a committed checkpoint; save into a new folder" + (
                " (Lightning: ModelCheckpoint(save_last=False))" * name.endswith(".ckpt"))
        if self._pending is not None and self._pending.root == root:
            p = self._pending
            return Parent(p.name, p.seq, p.view, p.layers, p.schedule, uid=p.uid,
                          ancestors=p.ancestors, pending=not committed(root, p.name))
        # A folder this process committed or loaded continues its lineage, if it is still
        # the same folder (a deleted and rewritten one of the same name is not).
        for mine in (self._head, self._loaded):
            if mine is not None and mine.root == root:
                m = manifest_or_none(root, mine.parent.name)
                if m is not None and m.committed_at == mine.committed_at:
                    return mine.parent
        head = scan(root).head
        return None if head is None else _parent_of(head)

    def lineage_uid(self, root: str) -> str:
        """The uid of the save of ``root`` this process's state continues (the save in
        flight, the last committed, or the one loaded), or "" when none: what a RAM
        snapshot records, so that a restarted worker reads it only within that lineage."""
        if self._pending is not None and self._pending.root == root:
            return self._pending.uid
        for mine in (self._head, self._loaded):
            if mine is not None and mine.root == root:
                return mine.parent.uid
        return ""

    def finish_save(self, plan: FlatPlan) -> None:
        """All ranks, after every rank's writer finished: rank 0 checks the records and
        commits; raises CheckpointError on every rank when the save is not committed."""
        dist.barrier()
        box: list[str | None] = [None]
        if dist.get_rank() == 0:
            try:
                _commit(plan)
            except (MoepecError, OSError, ValueError) as exc:  # every rank must hear it
                box[0] = f"{plan.root}/{plan.name} not committed: {exc}"
        dist.broadcast_object_list(box, src=0)
        if self._pending is plan:
            self._pending = None
        if box[0] is not None:
            raise CheckpointError(box[0])
        m = read_manifest(plan.root, plan.name)
        self._head = _Known(plan.root, _parent_of(m), m.committed_at)

    def commit_when_written(self, plan: FlatPlan) -> bool:
        """The end of an asynchronous save, any thread, no collective: call it on each
        rank after that rank's :func:`~moepec.store.flat.write_rank`. The rank that finds
        every rank's record there (the last to finish) checks and commits as
        :meth:`finish_save` does; the others return False at once. Raises CheckpointError
        when the check or the commit fails (the folder stays uncommitted)."""
        folder = os.path.join(plan.root, plan.name)
        if not all(os.path.exists(os.path.join(folder, record_name(r)))
                   for r in range(plan.world_size)):
            return False
        try:
            _commit(plan)
        except (MoepecError, OSError, ValueError) as exc:
            if committed(plan.root, plan.name):
                return True  # two ranks finished at once; the other one committed
            raise CheckpointError(f"{plan.root}/{plan.name} not committed: {exc}") \
                from None
        return True

    def settle(self) -> None:
        """All ranks, once every rank's asynchronous writer finished (after a barrier):
        the pending save is done; if it committed, the next save continues it."""
        p, self._pending = self._pending, None
        m = None if p is None else manifest_or_none(p.root, p.name)
        if m is not None:
            self._head = _Known(p.root, _parent_of(m), m.committed_at)

    # -- loading ---------------------------------------------------------------------
    def load(self, root: str, name: str, keys: Sequence[str], *, agree: bool = False,
             known: Choice | None = None) -> tuple[dict[str, torch.Tensor], RestoreReport]:
        """Any rank, no collective unless ``agree`` (a door: every rank loads; checks all
        ranks chose the same copies, as :func:`moepec.flat.lineage.agreed`, and that all
        read them, as :func:`moepec.flat.lineage.settled`): ``keys`` of folder ``name``,
        each from the folder its view names (an expert's newest copy), checksums verified. A
        shard key (:func:`moepec.flat.regions.shard_key`) the save did not write, as after a
        change of the parallel layout, is cut from the saved shards of its tensor that
        overlap it. Raises CheckpointError for a key the saved shards do not cover, a
        damaged item or a missing folder; CorruptCheckpointError naming the folder for a
        damaged shard key (:mod:`moepec.flat.regions`), before anything larger than the
        shards it reads is allocated. The next save continues this folder's lineage.
        ``known``: this folder's :meth:`folder`, already read (else read here)."""
        started = time.monotonic()
        known = self._known(root, name, known)
        def choose():
            return known if known is not None else self.folder(root, name)
        choice = agreed(choose, f"{root}/{name}") if agree else choose()
        head, manifests = choice.head, choice.manifests
        self._read_cache = (root, name, choice)
        def read():
            return self.read(root, name, keys, choice)
        out = settled(read, f"{root}/{name}") if agree else read()
        report, ledger = self._report_of(head, manifests, time.monotonic() - started)
        if keys:  # (none: a RAM load takes over this head's lineage; it says what it loaded)
            log.info("moepec: loaded %s (step %d): %d of %d expert(s) from older folders, "
                     "PLT %.3f%%", head.name, head.step, sum(
                         s["checkpoint"] != head.name for s in report.sources.values()),
                     len(report.sources), 100 * report.plt)
        report.warnings.extend(choice.warnings)
        self._loaded = _Known(root, _parent_of(
            head, ledger.state_dict() if ledger is not None else None), head.committed_at)
        self._pending = self._head = None
        self._report = report
        return out, report

    @staticmethod
    def folder(root: str, name: str) -> Choice:
        """Any rank, no collective: folder ``name``'s manifests, its own and those its view
        reads, and a line per expert read from an older copy (lineage's
        :func:`~moepec.flat.lineage.choose_copies`). Read once per load: :meth:`keys`,
        :meth:`shapes`, :meth:`load`, :meth:`read` take it as ``known``. Raises as
        :meth:`load`."""
        return choose_copies(root, name)

    def _known(self, root: str, name: str, known: Choice | None, last_load: bool = False
               ) -> Choice | None:
        """``known``, else (``last_load``) the last load's own choice of older copies for
        this folder, else None (read them)."""
        held = self._read_cache if last_load else None
        if known is None and held is not None and held[:2] == (root, name):
            known = held[2]
        return known

    def read(self, root: str, name: str, keys: Sequence[str],
             known: Choice | None = None) -> dict[str, torch.Tensor]:
        """As :meth:`load`, without the report and without changing the lineage the
        next save continues: more keys of a folder already loaded."""
        choice = self._known(root, name, known, last_load=True) or self.folder(root, name)
        head, manifests = choice.head, choice.manifests
        cut = {k: parse_shard_key(k) for k in keys if k not in head.view}
        if any(r is None for r in cut.values()):
            k = next(k for k, r in cut.items() if r is None)
            raise CheckpointError(f"{root}/{name} has no {k!r:.160}")
        with _naming(root, name):  # a damaged saved key
            pieces = overlapping(head.view, cut.values())
        direct = [k for k in keys if k in head.view]
        wanted = direct + sorted({k for ps in pieces.values() for _, k in ps})
        sources = {k: head.view[k] for k in wanted}
        items = {k: item_in(root, name, manifests, sources[k], k) for k in wanted}
        with _naming(root, name):  # a shard read as saved holds what its key says
            for k in direct:
                if "#" in k:
                    stored_region(k, math.prod(items[k].shape))
        targets = {k: empty_like_item(items[k]) for k in wanted}
        bad = read_keys(root, manifests, sources, targets)
        if bad:
            raise CheckpointError(f"{len(bad)} shard(s) are damaged (e.g. {sources[bad[0]]}:"
                                  f"{bad[0]}); run `moepec verify {root}`")
        out = {k: targets[k] for k in direct}
        with _naming(root, name):
            for k, want in cut.items():  # another layout than the save's: cut from shards
                out[k] = assemble(want, {r: targets[p] for r, p in pieces[want]})
        return out

    @staticmethod
    def newest(root: str, known: Choice | None = None) -> str | None:
        """The newest committed folder of save directory ``root``, or None; the manifests
        of ``known`` (a load's :meth:`folder` of a folder of ``root``) are not read again."""
        head = scan(root, None if known is None else known.manifests).head
        return None if head is None else head.name

    @staticmethod
    def keys(root: str, name: str, known: Choice | None = None) -> list[str]:
        """Any rank: every key of folder ``name``'s view (all ranks' shards); from
        ``known`` (its :meth:`folder`) when given, else its manifest is read."""
        return list((known.head if known is not None else read_manifest(root, name)).view)

    def shapes(self, root: str, name: str, known: Choice | None = None
               ) -> dict[str, tuple[tuple[int, ...], str]]:
        """Any rank: every tensor of folder ``name`` by its key (the part of a shard key
        before ``#``) -> (global shape, dtype name), from the manifests alone (``known``,
        its :meth:`folder`, when given). Raises CorruptCheckpointError naming the folder
        for a damaged shard key (one whose item is of another size, or shards whose keys
        claim more than they hold)."""
        choice = known if known is not None else self.folder(root, name)
        head, manifests = choice.head, choice.manifests
        shards = {key: item_in(root, name, manifests, folder, key)
                  for key, folder in head.view.items() if "#" in key}
        with _naming(root, name):
            return global_shapes((k, math.prod(i.shape), i.dtype) for k, i in shards.items())

    def _report_of(self, head: Any, manifests: Mapping[str, Any], seconds: float):
        sources, lost, ledger = account_load(head, manifests, head.view)
        report = RestoreReport(step=head.step, checkpoint=head.name, tier="storage",
                               sources=sources, lost=lost,
                               plt=ledger.plt() if ledger is not None else 0.0,
                               warnings=[], seconds=seconds,
                               units_from={"storage": len(sources)})
        return report, ledger

    def last_load_report(self) -> RestoreReport | None:
        """What the last :meth:`load` in this process restored, or None."""
        return self._report


@contextlib.contextmanager
def _naming(root: str, name: str) -> Iterator[None]:
    """Re-raise a CheckpointError of the block with folder ``root/name`` in its message."""
    try:
        yield
    except CheckpointError as exc:
        raise type(exc)(f"{root}/{name}: {exc}") from None


def _commit(plan: FlatPlan) -> None:
    """Rank 0: check every rank wrote what the plan says and every folder the view
    needs is committed, then write the manifest."""
    items = read_records(os.path.join(plan.root, plan.name), plan.world_size)
    if set(items) != plan.written:
        raise MoepecError(f"the ranks wrote {len(items)} items, the plan has "
                          f"{len(plan.written)}")
    gone = sorted(f for f in set(plan.view.values()) - {plan.name}
                  if not committed(plan.root, f))
    if plan.parent_pending and plan.parent in gone:
        raise MoepecError(f"its view needs {plan.parent}, which never committed (an "
                          f"earlier save failed)")
    if gone:  # committed when planned, deleted since (a rotation): committed all the same
        log.warning("moepec: %s/%s: %s was deleted while this save was written; a load "
                    "reads the experts it held from older copies, and the next save "
                    "writes them again", plan.root, plan.name, ", ".join(gone))
    commit(plan.root, plan.manifest(items))
    log.debug("moepec: committed %s/%s (%d items, %d expert unit(s) written)", plan.root,
             plan.name, len(items), len(plan.saved))
