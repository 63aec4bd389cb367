"""The run's metrics: a JSON-lines writer (rank 0), and the records the checkpoint
manager's callbacks and restore reports become in it (``checkpoint``, ``commit``,
``recovery``).

What the records hold is documented in docs/trainer-and-faults.md; the trainer's loop writes
them, the persist worker writes ``commit`` records through :func:`commit_logger`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import IO, Any

from moepec.events import CheckpointEvent, CommitRecord


class MetricsWriter:
    """JSON-lines metrics writer; a no-op on ranks other than 0 or without a path."""

    def __init__(self, path: str | None, enabled: bool, append: bool = False) -> None:
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        if path is not None and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # Kept open for the whole run (closed in close()): one line per log step.
            # A checkpointed run appends: a restarted worker continues the same file.
            self._file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        # Also called from the checkpoint persist thread (commit records): one lock.
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class CheckpointLog:
    """The checkpoints the manager started since the trainer last took them: the
    manager's ``on_checkpoint`` callback (training thread), read once per step."""

    def __init__(self) -> None:
        self._started: list[CheckpointEvent] = []

    def add(self, event: CheckpointEvent) -> None:
        self._started.append(event)

    def take(self) -> list[CheckpointEvent]:
        taken, self._started = self._started, []
        return taken


def commit_logger(metrics: MetricsWriter):
    """The ``on_commit`` callback that writes a ``commit`` record for every checkpoint the
    persist worker commits (it runs on that thread; the writer has a lock)."""
    def on_commit(rec: CommitRecord) -> None:
        metrics.write({"event": "commit", "step": rec.step, "time": time.time(),
                       "checkpoint": rec.name, "bytes": rec.bytes,
                       "bytes_per_rank": list(rec.bytes_per_rank), "seconds": rec.seconds,
                       "k_persist": rec.k_persist, "full": rec.full})

    return on_commit


def checkpoint_record(event: CheckpointEvent) -> dict[str, Any]:
    """The ``checkpoint`` metrics record of a started checkpoint."""
    return {"event": "checkpoint", "step": event.step, "time": time.time(),
            "blocked_s": event.blocked_s, "snapshot_bytes": event.snapshot_bytes,
            "persist": event.persist, "full": event.full, "k_persist": event.k_persist}


def recovery_record(report, manager) -> dict[str, Any]:
    """The ``recovery`` metrics record of a RestoreReport."""
    return {"event": "recovery", "time": time.time(), "step": report.step,
            "checkpoint": report.checkpoint, "tier": report.tier, "plt": report.plt,
            "lost": report.lost_total, "seconds": report.seconds,
            "k_persist": manager.k_persist, "warnings": report.warnings,
            "units_from": report.units_from, "persisted": report.persisted_on_failure}


def stop_record(stop) -> dict[str, Any]:
    """The ``stop`` metrics record of a planned stop (the manager's StopRecord)."""
    return {"event": "stop", "time": time.time(), "step": stop.step, "signal": stop.signal,
            "checkpoint": stop.checkpoint, "committed": stop.committed, "bytes": stop.bytes,
            "save_seconds": stop.save_seconds, "signal_to_commit_s": stop.signal_to_commit_s}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a run is writing (metrics, faults): [] before it
    exists; a line not yet whole (being written) is left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
