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
import math
import time
from collections.abc import Callable, Sequence
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
    """All recovery records under a checkpoint root, oldest first. A record that cannot be
    read, or is not the shape :func:`write_recovery` writes (a stranger's, a damaged
    one), is logged and skipped: every record returned has every field, typed."""
    names = sorted(n for n in storage.listdir(DIR)
                   if n.startswith("rec-") and n.endswith(".json"))  # not a write's temp file
    out = []
    for name in names:
        try:
            record = json.loads(storage.get(f"{DIR}/{name}"))
        except Exception:  # noqa: BLE001 - a damaged record is skipped
            log.warning("skipping unreadable recovery record %s/%s", DIR, name)
            continue
        problem = _problem(record)
        if problem:
            log.warning("skipping recovery record %s/%s: %s", DIR, name, problem)
            continue
        out.append(record)
    return sorted(out, key=lambda r: r["time"])


_COUNT_MAX = 2**53
"""A count beyond this is not a count of token assignments (nor exact in JSON)."""


def _number(v: object) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= _COUNT_MAX


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _COUNT_MAX


_FIELDS: dict[str, Callable[[object], bool]] = {
    "time": _number, "base_seq": _count, "next_seq": _count, "step": _count,
    "checkpoint": lambda v: isinstance(v, str), "tier": lambda v: isinstance(v, str),
    "lost": lambda v: isinstance(v, list) and all(
        isinstance(row, list) and all(map(_count, row)) for row in v),
    "plt": _number, "seconds": _number, "k_persist": _count,
    "warnings": lambda v: isinstance(v, list),
}
"""Each field :func:`write_recovery` writes, and what its value must be."""


def _problem(record: object) -> str | None:
    """Why ``record`` is not a recovery record as :func:`write_recovery` writes it, or
    None. Pure."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for field, ok in _FIELDS.items():
        if field not in record:
            return f"no field {field!r}"
        if not ok(record[field]):
            return f"field {field!r} is {record[field]!r:.60}"
    return None


def lost_since(records: Sequence[dict[str, Any]], base_seq: int,
               n_experts: Sequence[int]) -> list[list[int]]:
    """Token assignments lost by the recoveries made after checkpoint ``base_seq`` was
    taken (its ledger does not know them), per (layer, expert). ``records`` as
    :func:`read_recoveries` returns them (validated). Pure."""
    total = [[0] * n for n in n_experts]
    for rec in records:
        if rec.get("next_seq", -1) > base_seq and rec.get("base_seq", -1) <= base_seq:
            for layer, row in enumerate(rec["lost"][:len(total)]):
                for e, v in enumerate(row[:len(total[layer])]):
                    total[layer][e] += v
    return total
