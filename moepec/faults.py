"""Fault injection: deterministic by (rank, step) or seeded random, for tests and demos.

Kinds (``FaultPlan`` entries):
- ``sigkill``: SIGKILL this rank's process at the start of a step;
- ``exception``: raise :class:`InjectedFault` inside a training step (after backward);
- ``kill_persist``: SIGKILL while the persist worker writes checkpoint data;
- ``kill_commit``: SIGKILL after the data is written and before the manifest commit;
- ``storage_error`` / ``enospc`` / ``slow_storage``: storage writes fail, fail with
  ENOSPC, or are slowed, through :class:`FaultyFileSystem` (an fsspec filesystem);
- ``corrupt``: flip bytes in a committed checkpoint's data file.

Faults fire once: a marker file under ``state_dir`` records those already fired, so a
restarted worker (torchrun ``--max-restarts``) does not fire the same fault again.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from moepec.errors import ConfigError, MoepecError

log = logging.getLogger(__name__)

KINDS = ("sigkill", "exception", "kill_persist", "kill_commit", "storage_error", "enospc",
         "slow_storage", "corrupt")


class InjectedFault(MoepecError):
    """An exception raised on purpose inside a training step."""


# -- storage that fails on demand ------------------------------------------------
class FaultyFileSystem(LocalFileSystem):
    """A local filesystem (``faulty://<path>``) whose writes can be made to fail or crawl.

    Switches are class-level so every instance fsspec creates sees them:
    ``FaultyFileSystem.mode`` is ``None`` (healthy), ``"error"`` (OSError EIO),
    ``"enospc"`` (OSError ENOSPC) or ``"slow"`` (sleep ``delay_s`` per write).
    """

    protocol = "faulty"
    root_marker = "/"
    mode: str | None = None
    delay_s: float = 0.05
    failures = 0
    _lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return LocalFileSystem._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wa") and not str(path).endswith("moepec-write-probe"):
            self._maybe_fail(path)
        return super()._open(path, mode=mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        self._maybe_fail(path)
        return super().pipe_file(path, value, **kwargs)

    @classmethod
    def _maybe_fail(cls, path) -> None:
        mode = cls.mode
        if mode == "slow":
            time.sleep(cls.delay_s)
        elif mode in ("error", "enospc"):
            with cls._lock:
                cls.failures += 1
            code = errno.ENOSPC if mode == "enospc" else errno.EIO
            raise OSError(code, f"{os.strerror(code)} (injected by moepec.faults)", str(path))


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


# -- fault plans -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    step: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}; choose from {', '.join(KINDS)}")

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.step}:r{self.rank}"


@dataclass(slots=True)
class FaultPlan:
    """Which faults fire where; fired ones are remembered in ``state_dir``."""

    faults: list[Fault] = field(default_factory=list)
    state_dir: str | None = None

    @classmethod
    def parse(cls, spec: str, state_dir: str | None = None) -> FaultPlan:
        """``"sigkill@40,exception@90:r1,kill_persist@150"`` -> FaultPlan."""
        faults = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            try:
                kind, rest = part.split("@", 1)
                step, _, rank = rest.partition(":r")
                faults.append(Fault(kind=kind, step=int(step), rank=int(rank or 0)))
            except ValueError as exc:
                raise ConfigError(f"bad fault {part!r}: write KIND@STEP or KIND@STEP:rRANK, "
                                  f"e.g. sigkill@40:r1") from exc
        return cls(faults=faults, state_dir=state_dir)

    @classmethod
    def random(cls, seed: int, steps: int, mtbf_steps: float, kinds: tuple[str, ...],
               world_size: int = 1, state_dir: str | None = None) -> FaultPlan:
        """Faults at exponential intervals of mean ``mtbf_steps``, seeded."""
        rng = random.Random(seed)
        faults, t = [], 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf_steps)
            if t >= steps:
                break
            faults.append(Fault(kind=rng.choice(kinds), step=max(1, int(t)),
                                rank=rng.randrange(world_size)))
        return cls(faults=faults, state_dir=state_dir)

    def _fired_path(self) -> Path | None:
        return Path(self.state_dir) / "faults-fired.json" if self.state_dir else None

    def fired(self) -> set[str]:
        p = self._fired_path()
        if p and p.exists():
            return set(json.loads(p.read_text()))
        return set()

    def mark(self, fault: Fault) -> None:
        p = self._fired_path()
        if p is None:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        done = self.fired() | {fault.key}
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(done)))
        os.replace(tmp, p)

    def due(self, step: int, rank: int, kinds: tuple[str, ...] | None = None) -> list[Fault]:
        fired = self.fired()
        return [f for f in self.faults if f.step == step and f.rank == rank
                and f.key not in fired and (kinds is None or f.kind in kinds)]


def kill_self() -> None:
    """SIGKILL this process (no cleanup, no atexit: a real crash)."""
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)
