"""Recovery records: one small JSON file per restore under ``<root>/recoveries/``.

They keep the PLT ledger cumulative across restarts: a checkpoint's ledger knows the
recoveries made before it was taken, and the records supply those made after it
(another fault can strike before the next checkpoint commits). ``moepec inspect`` and
the demo's report list them. Advisory: a record that cannot be written or read is
logged and skipped, never fatal.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from moepec.store.storage import Storage

log = logging.getLogger(__name__)

DIR = "recoveries"


def write_recovery(storage: Storage, report, *, base_seq: int, next_seq: int,
                   k_persist: int) -> None:
    """Store the record of a restore (rank 0, after it; one atomic put). ``report`` is
    the RestoreReport; ``base_seq`` is the restored base's sequence number, ``next_seq``
    the next checkpoint's, ``k_persist`` K after the recovery."""
    record = {"time": time.time(), "base_seq": base_seq, "next_seq": next_seq,
              "step": report.step, "checkpoint": report.checkpoint, "tier": report.tier,
              "lost": report.lost, "plt": report.plt, "seconds": report.seconds,
              "k_persist": k_persist, "warnings": report.warnings}
    try:
        storage.makedirs(DIR)
        storage.put(f"{DIR}/rec-{next_seq:06d}-{time.time_ns()}.json",
                    json.dumps(record).encode())
    except Exception as exc:  # noqa: BLE001 - the record is advisory; training goes on
        log.warning("could not write the recovery record: %s", exc)


def read_recoveries(storage: Storage) -> list[dict[str, Any]]:
    """All recovery records under a checkpoint root, oldest first."""
    names = sorted(n for n in storage.listdir(DIR)
                   if n.startswith("rec-") and n.endswith(".json"))  # not a write's temp file
    out = []
    for name in names:
        try:
            out.append(json.loads(storage.get(f"{DIR}/{name}")))
        except Exception:  # noqa: BLE001 - a damaged record is skipped
            log.warning("skipping unreadable recovery record %s/%s", DIR, name)
    return sorted(out, key=lambda r: r.get("time", 0))


def lost_since(records: Sequence[dict[str, Any]], base_seq: int,
               n_experts: Sequence[int]) -> list[list[int]]:
    """Token assignments lost by the recoveries made after checkpoint ``base_seq`` was
    taken (its ledger does not know them), per (layer, expert). Pure."""
    total = [[0] * n for n in n_experts]
    for rec in records:
        if rec.get("next_seq", -1) > base_seq and rec.get("base_seq", -1) <= base_seq:
            for layer, row in enumerate(rec["lost"][:len(total)]):
                for e, v in enumerate(row[:len(total[layer])]):
                    total[layer][e] += v
    return total
