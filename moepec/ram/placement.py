"""Where a RAM tier lives (node-local shared memory or the process), for both front ends.

:func:`choose_dir` resolves ``ram_dir`` (``"auto"``: ``/dev/shm/moepec`` when shared
memory exists and the tier fits its budget on every rank) and :func:`open_slots` opens
this rank's :class:`~moepec.ram.shm.SlotStore`. Both are collective when ``distributed``
(all ranks, training thread, in the same order), so all ranks pick one tier: a restore
meets over it. The manager (:mod:`moepec.manager.ram_setup`) and the flat front end
(:mod:`moepec.flat.ram`) call them alike.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from moepec.errors import ConfigError
from moepec.ram.jobs import DEFAULT_DIR, check_budget, folder_problem
from moepec.ram.shm import SlotsInUse, SlotStore

log = logging.getLogger(__name__)

AUTO = "auto"
"""``ram_dir="auto"``: shared memory when it exists and fits."""


def choose_dir(chosen: str | None, need_bytes: int, budget_bytes: int | None, root: str, *,
               rank: int, world_size: int, distributed: bool) -> str | None:
    """The folder of the shared-memory RAM tier, or None for in-process buffers.
    ``chosen`` other than AUTO is returned as it is (the caller checks its budget);
    AUTO: DEFAULT_DIR when shared memory exists and ``need_bytes`` fits on every rank,
    else None; one info line (rank 0) says which and why. Collective when distributed."""
    if chosen != AUTO:
        return chosen
    shm = os.path.dirname(DEFAULT_DIR)
    why = None
    mine = _not_own(DEFAULT_DIR)
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        why = f"no writable shared memory at {shm}; a restarted worker recovers from storage"
    elif mine is not None:  # another user's folder on a shared node
        why = f"{DEFAULT_DIR} {mine}; set ram_dir to a folder of your own to use the tier"
    else:
        try:
            check_budget(need_bytes, budget_bytes, shm, root)
        except ConfigError as exc:
            why = f"shared memory is too small: {str(exc).split(';')[0]}"
    if distributed:  # one tier for all ranks: the restore protocol meets over it
        whys: list[Any] = [None] * world_size
        dist.all_gather_object(whys, why)
        why = next((f"rank {r}: {w}" for r, w in enumerate(whys) if w), None)
    if rank == 0:
        if why is None:
            log.info("RAM tier: shared memory in %s (survives worker restarts; "
                     "ram_dir=None keeps it in the process)", DEFAULT_DIR)
        else:
            log.info("RAM tier: in-process buffers (%s)", why)
    return DEFAULT_DIR if why is None else None


def open_slots(ram_dir: str, root: str, peers: tuple[int, int] | None, *, rank: int,
               world_size: int, distributed: bool
               ) -> tuple[SlotStore | None, SlotStore | None]:
    """This rank's slot store (and its predecessor's replicas), or (None, None) on every
    rank when another live process of this host holds some rank's slots (a second run
    into the same root, as in a takeover while the old run lives): the tier is then in
    the process, with one warning. Collective when distributed. Raises ConfigError (on
    every rank) when a rank cannot open its slots."""
    slots = held = None
    busy = failed = None
    try:
        slots = SlotStore(ram_dir, root=root, rank=rank, world_size=world_size)
        if peers:
            held = SlotStore(ram_dir, root=root, rank=peers[1], world_size=world_size,
                             replica=True)
    except SlotsInUse as exc:
        busy = str(exc)
    except OSError as exc:
        failed = ConfigError(f"cannot keep RAM snapshots in ram_dir={ram_dir!r} ({exc}); "
                             f"use a writable folder on a shared-memory filesystem such "
                             f"as /dev/shm/moepec, or ram_dir=None")
        failed.__cause__ = exc
    except ConfigError as exc:  # a folder that is not this user's own (moepec.ram.jobs)
        failed = exc
    # Every rank hears every rank's outcome: a rank that cannot open its slots fails
    # on all ranks at once, not in the next collective's timeout.
    bad = None
    if distributed:
        outcomes: list[Any] = [None] * world_size
        dist.all_gather_object(outcomes, (busy, None if failed is None else str(failed)))
        busy = next((f"rank {r}: {b}" for r, (b, _) in enumerate(outcomes) if b), None)
        bad = next(((r, f) for r, (_, f) in enumerate(outcomes) if f), None)
    if busy is None and bad is None and failed is None:
        return slots, held
    for store in (slots, held):
        if store is not None:
            store.close(unlink=False)
    if failed is not None:
        raise failed
    if bad is not None:
        raise ConfigError(f"rank {bad[0]} cannot open its RAM slots: {bad[1]}")
    if rank == 0:
        log.warning("RAM tier: in-process buffers (%s)", busy)
    return None, None


def _not_own(path: str) -> str | None:
    """What makes an existing ``path`` unfit as the RAM tier's base folder, or None
    (also when it does not exist yet: the tier makes it)."""
    try:
        return folder_problem(os.lstat(path), shared=True)
    except FileNotFoundError:
        return None
