"""Snapshot slots in node-local shared memory that outlive the worker process.

One folder per checkpoint root and rank: ``<ram_dir>/<job>/rank<R>/`` holds at most
three slots (``slot<i>.data`` + ``slot<i>.json``), reused across checkpoints like the
in-process buffer pool. Files are created mode 0600 in folders of mode 0700. Shared
memory is shared by every user of the node: the folders must be this user's own
(:func:`moepec.ram.jobs.own_folder`), and no slot file is opened through a link, for
writing or reading (a link in a slot's place is refused, or the slot is torn).

A slot is committed like a checkpoint on storage: its header is removed before the
data is overwritten, the data is written, then the JSON header (keys with offsets,
dtypes, shapes and XXH3 checksums, the run, rank, world size, step and seq) is written
last under a temporary name and renamed into place. A slot whose header is missing,
does not parse, names another checkpoint root, rank or world size, or whose data does
not match its checksums is *torn* and never used.

``job`` is derived from the checkpoint root, not from the run id: the run id is drawn
anew by every manager (a worker restarted by torchrun gets a new one), while the root
is what a restarted worker shares with the one it replaces. Which run's slots a
restarted worker may read is decided against the storage's lineage by
:func:`admissible` (a slot from another run is never read).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import mmap
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moepec.errors import ConfigError, CorruptCheckpointError, ManifestError
from moepec.ram import pinning
from moepec.ram.header import SlotHeader
from moepec.ram.jobs import job_name, own_folder, read_header
from moepec.ram.readback import read_checked
from moepec.store.checksum import stored_checksum
from moepec.store.items import Item
from moepec.store.meta import CheckpointMeta

log = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of every tensor in a slot (any dtype may be viewed at it)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _at(base: torch.Tensor, offset: int, shape: Iterable[int], dtype: torch.dtype
        ) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` at ``offset`` of ``base`` (uint8)."""
    n = _nbytes(shape, dtype)
    return (base[offset:offset + n].view(dtype).view(list(shape)) if n
            else torch.empty(list(shape), dtype=dtype))


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r}")
    return dtype


@dataclass(slots=True)
class Slot:
    """One slot's files and mapping (owned by :class:`SlotStore`)."""

    index: int
    data_path: Path
    header_path: Path
    size: int = 0
    mm: mmap.mmap | None = None
    base: torch.Tensor | None = None
    """The whole mapping as uint8 (tensors are views of it)."""
    pinned: int | None = None
    """The address of the mapping while it is registered with CUDA (``SlotStore.pin``)."""
    in_use: bool = False
    seq: int = -1
    """The seq its valid header records (-1: none)."""
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    """The keys of the layout ``prepare`` laid out last, in its order."""
    plan: tuple[tuple, list[int], int] | None = None
    """That layout's (shapes and dtypes, offsets, size), reused while the shapes repeat."""
    views: tuple[tuple, mmap.mmap, list[torch.Tensor]] | None = None
    """The plan's views of the mapping, reused by ``prepare`` (its plan, mapping, views)."""


class SlotStore:
    """One rank's slots under one checkpoint root's folder. Thread-safe.

    ``reserve`` (training thread) picks a free slot and does no file I/O; ``prepare``
    (copy thread) removes its header, then creates or grows and maps its file for a
    layout; ``commit`` (copy thread) writes the header last; ``release`` (either thread)
    frees it, keeping its header (a valid older copy until reused).
    """

    def __init__(self, ram_dir: str, *, root: str, rank: int, world_size: int,
                 replica: bool = False, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() and not replica if pin is None else pin
        """Whether the slots' mappings are registered with CUDA (page-locked), so that a
        snapshot's device-to-host copies run at the pinned rate straight into memory
        that outlives the process. Default: when CUDA is available (not for replicas:
        they are filled from the network)."""
        self.job_dir = Path(ram_dir) / job_name(root)
        self.dir = self.job_dir / (f"replica-of-rank{rank}" if replica else f"rank{rank}")
        self.root, self.rank, self.world_size = root, rank, world_size
        own_folder(Path(ram_dir), shared=True)
        own_folder(self.job_dir)
        own_folder(self.dir)
        self._owner = _lock_owner(self.dir)
        self._lock = threading.Lock()
        self.slots: list[Slot] = []
        try:
            for path in sorted(self.dir.glob("slot*")):
                m = re.fullmatch(r"slot(\d+)\.(data|json)", path.name)
                if m and not stat.S_ISREG((st := os.lstat(path)).st_mode):
                    raise ConfigError(_not_a_slot_file(path, st))  # refused before any use
                if m and m.group(2) == "data":
                    self.slots.append(self._slot(int(m.group(1))))
        except BaseException:
            os.close(self._owner)
            raise
        self.slots.sort(key=lambda s: s.index)
        for slot in self.slots:
            slot.seq = self._peek_seq(slot)

    def _slot(self, index: int) -> Slot:
        return Slot(index, self.dir / f"slot{index}.data", self.dir / f"slot{index}.json")

    @property
    def allocated_bytes(self) -> int:
        return sum(s.size for s in self.slots)

    # -- writing ----------------------------------------------------------------
    def reserve(self) -> Slot:
        """A free slot for the next snapshot (the one with the oldest copy, or a new one),
        marked in use. Training thread: no file I/O and no page faults here (a new slot
        is only a name until :meth:`prepare` creates its file). Its header stays valid
        until ``prepare`` removes it: nothing is written into the slot before that."""
        with self._lock:
            free = [s for s in self.slots if not s.in_use]
            slot = (min(free, key=lambda s: (s.seq, s.index)) if free
                    else self._slot(max((s.index for s in self.slots), default=-1) + 1))
            if not free:
                self.slots.append(slot)
            slot.in_use = True
        return slot

    def prepare(self, slot: Slot, layout: Mapping[str, tuple[tuple[int, ...], Any]] | list[str],
                shapes: tuple[tuple[tuple[int, ...], Any], ...] | None = None) -> dict[str, Any]:
        """Views of ``slot`` (from :meth:`reserve`) laid out for ``layout`` (key -> (shape,
        dtype); or the keys, their (shape, dtype) in ``shapes``): its header is removed
        first (the slot is torn from here until ``commit``), then its file is created or
        grown and mapped. The copy thread calls it, so that file creation and first-touch
        page faults never block training."""
        keys = list(layout)
        shapes = tuple(layout.values()) if shapes is None else shapes  # type: ignore[union-attr]
        # Checkpoints of one K lay a slot out alike (other experts' keys, same shapes): the
        # last layout's offsets and views are reused (building ~500 entries and views cost
        # ~1.5 ms of every copy); the header's entries are built by ``commit``, after it.
        if slot.plan is None or slot.plan[0] != shapes:
            offsets, offset = [], 0
            for shape, dtype in shapes:
                offsets.append(offset)
                offset = _align(offset + _nbytes(shape, dtype))
            slot.plan = (shapes, offsets, max(offset, 1))
        self._open(slot, slot.plan[2])
        slot.keys = keys
        if slot.views is None or slot.views[0] is not slot.plan or slot.views[1] is not slot.mm:
            slot.views = (slot.plan, slot.mm, [_at(slot.base, o, shape, dtype) for o, (
                shape, dtype) in zip(slot.plan[1], shapes, strict=True)])
        return dict(zip(keys, slot.views[2], strict=True))

    def commit(self, slot: Slot, header: SlotHeader) -> dict[str, str]:
        """Checksum the slot's data (laid out by ``prepare``) and write its header last
        (temporary name, rename); returns the checksums by key."""
        assert slot.plan is not None and slot.mm is not None
        entries, data = {}, memoryview(slot.mm)
        try:
            for key, (shape, dtype), offset in zip(slot.keys, *slot.plan[:2], strict=True):
                n = _nbytes(shape, dtype)
                entries[key] = {"offset": offset, "shape": list(shape),
                                "dtype": str(dtype).removeprefix("torch."), "nbytes": n,
                                "checksum": stored_checksum(data[offset:offset + n], dtype,
                                                            tuple(shape))}
        finally:
            data.release()
        slot.entries = header.entries = entries
        self._write_header(slot, json.dumps(header.to_json()).encode())
        slot.seq = header.seq
        return {key: e["checksum"] for key, e in entries.items()}

    def write_raw(self, header: bytes, data: torch.Tensor) -> None:
        """Store a slot another rank committed (a replica): its data bytes as they are,
        then its header, last. The header's checksums are verified when it is loaded."""
        slot = self.reserve()
        try:
            self._open(slot, max(data.numel(), 1))
            slot.base[:data.numel()].copy_(data)
            self._write_header(slot, header)
            slot.seq = json.loads(header).get("seq", -1)
        finally:
            self.release(slot)

    def _open(self, slot: Slot, nbytes: int) -> None:
        """Make a reserved slot torn (its header removed) and map it for ``nbytes``."""
        slot.header_path.unlink(missing_ok=True)
        slot.seq = -1
        self._map(slot, nbytes)

    @staticmethod
    def _write_header(slot: Slot, header: bytes) -> None:
        """The slot's header, written last: temporary name (mode 0600), then rename."""
        tmp = slot.header_path.with_name(f".{slot.header_path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)  # a leftover (or a link): made anew, never written through
        fd = _open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
        os.replace(tmp, slot.header_path)

    def raw(self, slot: Slot) -> tuple[bytes, torch.Tensor]:
        """A committed slot's header bytes and used data bytes (to send as a replica)."""
        end = max((e["offset"] + e["nbytes"] for e in slot.entries.values()), default=0)
        return read_header(slot.header_path), slot.base[:end]

    def release(self, slot: Slot) -> None:
        with self._lock:
            slot.in_use = False

    def invalidate(self, pred: Callable[[int], bool]) -> None:
        """Remove the headers of free slots whose seq satisfies ``pred`` (an abandoned
        future after a restore)."""
        with self._lock:
            for s in self.slots:
                if not s.in_use and s.seq >= 0 and pred(s.seq):
                    s.header_path.unlink(missing_ok=True)
                    s.seq = -1

    def _map(self, slot: Slot, need: int) -> None:
        if slot.mm is not None and slot.size >= need:
            return
        fd = _open_file(slot.data_path, os.O_RDWR | os.O_CREAT)
        try:
            size = max(os.fstat(fd).st_size, need)  # grows only: older views stay valid
            # The pages are allocated here, by fallocate, which releases the GIL (a full
            # tmpfs fails now with ENOSPC, not later with SIGBUS in the copy); the copy
            # then only maps them, in torch's copy_, which releases it too. Not
            # MAP_POPULATE: mmap() holds the GIL, and populating a slot stalled every
            # other thread, the training loop included, for ~1 ms per MB.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        # The previous mapping (if any) is dropped, not closed: views may still hold it.
        # Unregistered first: no copy into it is in flight (copies run on this thread).
        _unpin(slot)
        slot.mm, slot.size = mm, size
        slot.base = torch.frombuffer(mm, dtype=torch.uint8)
        if self.pin:
            try:
                pinning.register(slot.base.data_ptr(), size)
                slot.pinned = slot.base.data_ptr()
            except RuntimeError as exc:  # e.g. the memlock limit: slower copies, no failure
                log.warning("RAM slots stay unpinned (device copies at the pageable "
                            "rate): %s", exc)
                self.pin = False

    def _view(self, slot: Slot, e: Mapping[str, Any], size: int = 1) -> torch.Tensor:
        self._map(slot, max(size, 1))  # (mapped at the first view: none for a load's keys)
        return _at(slot.base, e["offset"], e["shape"], _dtype(e["dtype"]))

    # -- reading ----------------------------------------------------------------
    def _peek_seq(self, slot: Slot) -> int:
        header = self._header(slot, quiet=True)
        return header.seq if header is not None else -1

    def _header(self, slot: Slot, quiet: bool = False) -> SlotHeader | None:
        where = str(slot.header_path)
        try:
            header = SlotHeader.from_json(json.loads(read_header(slot.header_path)), where)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, ManifestError, CorruptCheckpointError, TypeError) as exc:
            if not quiet:
                log.warning("ignoring RAM slot %s: %s", where, exc)
            return None
        ident = (header.root, header.rank, header.world_size)
        if ident != (self.root, self.rank, self.world_size):
            if not quiet:
                log.warning("ignoring RAM slot %s: it belongs to %s rank %d of %d", where,
                            header.root, header.rank, header.world_size)
            return None
        return header

    def load(self, verify: bool = True) -> list[tuple[Slot, SlotHeader, dict[str, torch.Tensor]]]:
        """Every free slot whose header and checksums are intact, newest first, mapped.
        The caller marks the ones it keeps with ``hold``; a torn slot is skipped (logged).
        Without ``verify`` only the headers are read (no tensors, nothing mapped): the
        caller maps the one it takes with :meth:`intact` (a load that takes one of three)."""
        out = []
        for slot in self.slots:
            if slot.in_use:
                continue
            header = self._header(slot)
            tensors = None if header is None else \
                self._verified(slot, header.entries, header.seq) if verify else {}
            if tensors is None:
                if header is not None:
                    slot.header_path.unlink(missing_ok=True)
                slot.seq = -1
                continue
            slot.entries, slot.seq = header.entries, header.seq
            out.append((slot, header, tensors))
        return sorted(out, key=lambda x: x[1].seq, reverse=True)

    def hold(self, slot: Slot) -> None:
        with self._lock:
            slot.in_use = True

    def intact(self, slot: Slot, into: Mapping[str, Any] | None = None
               ) -> dict[str, torch.Tensor] | None:
        """The tensors of a slot :meth:`load` found without ``verify``, mapped, once its
        data file fits its header and matches its checksums; else None (a torn slot: its
        header is removed, it is never read again). ``into``: as ``read_checked``."""
        tensors = self._verified(slot, slot.entries, slot.seq, into)
        if tensors is None:
            slot.header_path.unlink(missing_ok=True)
        return tensors

    def _verified(self, slot: Slot, entries: Mapping[str, Mapping[str, Any]], seq: int,
                  into: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor] | None:
        where = str(slot.header_path)
        try:
            st = os.lstat(slot.data_path)  # (a link to identical bytes is not this slot)
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(_not_a_slot_file(slot.data_path, st))
            size = st.st_size
            for key, e in entries.items():
                # The typed reader of stored tensors checks shape, dtype and size (the
                # slot's entries are items without a file: the slot's data file holds them).
                item = Item.from_json(e, f"entry {key!r}")
                offset = e.get("offset")
                if type(offset) is not int or offset < 0 or offset + item.nbytes > size:
                    raise ManifestError(f"entry {key!r} does not fit the data file")
            tensors, bad = read_checked(entries, lambda e: self._view(slot, e, size), into,
                                        lambda: _open_file(slot.data_path, os.O_RDONLY))
            if bad is not None:
                raise ManifestError(f"{bad} does not match its checksum")
            return tensors
        except (OSError, ManifestError, RuntimeError, ValueError) as exc:
            log.warning("ignoring torn RAM slot %s (seq %d): %s", where, seq, exc)
            return None

    def close(self, unlink: bool) -> None:
        """Drop the mappings; with ``unlink`` remove this rank's files and folder (a clean
        close), and the job folder once no rank's folder is left."""
        for s in self.slots:
            _unpin(s)
            s.base, s.mm, s.views, s.plan = None, None, None, None
        if unlink:
            shutil.rmtree(self.dir, ignore_errors=True)
            try:
                self.job_dir.rmdir()
            except OSError:
                pass  # another rank's folder is still there
        if self._owner is not None:
            os.close(self._owner)  # lets go of the folder (after its files went)
            self._owner = None


def _unpin(slot: Slot) -> None:
    if slot.pinned is not None:
        address, slot.pinned = slot.pinned, None
        try:
            pinning.unregister(address)
        except (RuntimeError, AssertionError) as exc:  # torch's helper asserts
            log.warning("could not unregister RAM slot %s from CUDA: %s", slot.data_path, exc)


class SlotsInUse(OSError):
    """Another live process of this host holds this rank's slot folder (a second run into
    the same checkpoint root: a takeover while the old run lives)."""


OWNER_NAME = "owner.lock"


def _lock_owner(folder: Path) -> int:
    """Hold an exclusive lock on ``folder``'s owner file for this process's lifetime (the
    kernel drops it when the process dies, so a restarted worker gets it). Raises
    SlotsInUse while another live process holds it: two writers must never share slots."""
    fd = _open_file(folder / OWNER_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SlotsInUse(f"another live process on this host uses the RAM slots in {folder} "
                         f"(a second run into the same checkpoint root?)") from None
    return fd


def _not_a_slot_file(path: Path, st: os.stat_result) -> str:
    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
    return (f"{path} is {what}, not a file moepec made (nothing was written through it); "
            f"remove it, or set ram_dir to a folder of your own")


def _open_file(path: Path, flags: int) -> int:
    """Open a file of a slot folder (mode 0600 when created) without following a link at
    ``path`` and without blocking on a FIFO. Raises ConfigError for a link or anything
    but a regular file (closing it), else OSError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ConfigError(_not_a_slot_file(path, os.lstat(path))) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(_not_a_slot_file(path, st))
    return fd


def admissible(meta: CheckpointMeta, head: CheckpointMeta | None) -> bool:
    """Whether a slot written by ``meta``'s run may be read when storage's newest
    committed checkpoint is ``head``: it continues the head's lineage or is in it (a
    slot of an unrelated run into the same root is never read)."""
    if head is None:
        return True
    return head.run_id in meta.run_lineage or meta.run_id in head.run_lineage
