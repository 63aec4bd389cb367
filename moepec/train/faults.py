"""Fault injection: deterministic by (rank, step) or seeded random, for tests and demos.

Kinds (``FaultPlan`` entries):
- ``sigkill``: SIGKILL this rank's process at the start of a step;
- ``exception``: raise :class:`InjectedFault` inside a training step (after backward);
- ``kill_persist``: SIGKILL while the persist worker writes checkpoint data;
- ``kill_commit``: SIGKILL after the data is written and before the manifest commit
  (both in the persist of the first checkpoint taken at or after their step);
- ``storage_error`` / ``enospc`` / ``slow_storage``: storage writes fail, fail with
  ENOSPC, or are slowed, through :class:`FaultyFileSystem` (an fsspec filesystem);
- ``corrupt``: flip bytes in a committed checkpoint's data file;
- ``kill_copy``: SIGKILL while the RAM snapshot of this step is copied (a torn slot);
- ``ram_lost``: remove this run's folder of the shared-memory RAM tier on this node (the
  one the manager resolved, :meth:`FaultInjector.use_ram`), then SIGKILL (the node's RAM
  is gone: recovery comes from a replica or storage). Refused without such a tier.

Faults fire once: a marker file under ``state_dir`` records those already fired, so a
restarted worker (torchrun ``--max-restarts``) does not fire the same fault again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from moepec.errors import ConfigError, MoepecError
from moepec.hooks import FaultHooks
from moepec.keys import parse_checkpoint_name
from moepec.store.storage import Storage

log = logging.getLogger(__name__)

KINDS = ("sigkill", "exception", "kill_persist", "kill_commit", "storage_error", "enospc",
         "slow_storage", "corrupt")
RAM_KINDS = ("kill_copy", "ram_lost")
"""Faults of the shared-memory RAM tier: named in plans, not drawn by random plans."""
NAMED_KINDS = RAM_KINDS + ("kill_allreduce",)
"""Faults named in plans only: the RAM tier's, and ``kill_allreduce`` (SIGKILL right after
backward, as the gradient all-reduce starts: with replica groups, while the other groups
wait in the cross-group all-reduce of that step)."""


class InjectedFault(MoepecError):
    """An exception raised on purpose inside a training step."""


# -- storage that fails on demand ------------------------------------------------
_EXEMPT = (".moepec-write-probe", "moepec.lease")
"""Names (prefixes) of the files the injected faults spare: the set-up's probes, the lease
and its heartbeat files, so that a fault hits the checkpoint data and manifests it is
meant for."""


def _exempt(path: object) -> bool:
    return os.path.basename(str(path)).startswith(_EXEMPT)


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
        if any(c in mode for c in "wa") and not _exempt(path):
            self._maybe_fail(path)
        return super()._open(path, mode=mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        if not _exempt(path):
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
            raise OSError(code, f"{os.strerror(code)} (injected by moepec.train.faults)", str(path))


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


# -- fault plans -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    step: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS + NAMED_KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}; choose from "
                              f"{', '.join(KINDS + NAMED_KINDS)}")
        if self.step < 0 or self.rank < 0:
            raise ConfigError(f"fault {self.key} can never fire: steps and ranks count "
                              "from 0")

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.step}:r{self.rank}"

    def never_fires(self, steps: int, *, interval: int | None = None,
                    world_size: int | None = None) -> str | None:
        """Why this fault can never fire in a run of ``steps`` steps (0 .. steps - 1),
        checkpointing every ``interval`` steps, on ``world_size`` ranks; None when it can
        (or when what it needs is not known: ``interval`` or ``world_size`` None). Pure."""
        if self.step >= steps:
            return (f"its step is past the run's last step {steps - 1} (--steps {steps} "
                    f"trains steps 0-{steps - 1}); move it before step {steps} or raise "
                    "--steps")
        if world_size is not None and self.rank >= world_size:
            return (f"the run has {world_size} rank(s), 0-{world_size - 1}; put it on a rank "
                    f"below {world_size}")
        if interval is None:
            return None
        # The manager checkpoints after step s when (s + 1) % interval == 0.
        last = steps // interval * interval - 1
        if self.kind in ("kill_persist", "kill_commit") and self.step > last:
            where = f"the last is after step {last}" if last >= 0 else "the run takes none"
            return (f"it strikes the persist of the first checkpoint at or after its step, "
                    f"and {where} (--ckpt-interval {interval}, --steps {steps}); move it "
                    "earlier")
        if self.kind == "kill_copy" and (self.step + 1) % interval:
            return (f"it strikes the RAM copy of the checkpoint of its own step, and step "
                    f"{self.step} takes none (--ckpt-interval {interval}: checkpoints after "
                    f"steps {interval - 1}, {2 * interval - 1}, ...); put it on such a step")
        return None


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
            kind, at, rest = part.partition("@")
            step, _, rank = rest.partition(":r")
            try:
                numbers = int(step), int(rank or 0)
            except ValueError:
                numbers = None
            if not at or numbers is None:
                raise ConfigError(f"bad fault {part!r}: write KIND@STEP or KIND@STEP:rRANK, "
                                  f"e.g. sigkill@40:r1")
            faults.append(Fault(kind=kind, step=numbers[0], rank=numbers[1]))
        return cls(faults=faults, state_dir=state_dir)

    def check(self, steps: int, *, interval: int | None = None,
              world_size: int | None = None) -> None:
        """Raise ConfigError naming the first fault that can never fire in this run
        (:meth:`Fault.never_fires`): an injected fault that silently does nothing would
        pass for a run that survived it."""
        for fault in self.faults:
            why = fault.never_fires(steps, interval=interval, world_size=world_size)
            if why is not None:
                raise ConfigError(f"fault {fault.key} can never fire: {why}")

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
        # Ranks (of one or several torchrun agents) sharing the folder may mark faults at
        # the same step: a lock keeps each read-modify-write whole (no mark is lost, which
        # would fire that fault again after the restart), and each writer renames its own
        # temporary file.
        with open(p.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = self.fired() | {fault.key}
            tmp = p.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(done)))
            os.replace(tmp, p)

    def due(self, step: int, rank: int, kinds: tuple[str, ...] | None = None) -> list[Fault]:
        fired = self.fired()
        return [f for f in self.faults if f.step == step and f.rank == rank
                and f.key not in fired and (kinds is None or f.kind in kinds)]


def remove_tree(folder: str, tries: int = 50) -> None:
    """Remove ``folder`` whole although a thread of this process may still be writing a
    file in it (the snapshot's seal writes its slot's header while the loop runs on): a
    file created after ``rmtree`` listed its folder leaves that folder behind, so it is
    removed again until it is gone (a writer cannot create a folder again; seen once in
    a full suite run)."""
    for _ in range(tries):
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.lexists(folder):
            return
        time.sleep(0.01)


def kill_self() -> None:
    """SIGKILL this process (no cleanup, no atexit: a real crash)."""
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def corrupt_item(ckpt_dir: str | Path, fqn: str) -> None:
    """Flip the bytes of the second half of item ``fqn`` in a local committed checkpoint
    folder (located through the checkpoint's manifest)."""
    folder = Path(ckpt_dir)
    item = Storage(str(folder.parent)).read_manifest(folder.name).keys[fqn]
    file = folder / item.file
    data = bytearray(file.read_bytes())
    for i in range(item.offset + item.length // 2, item.offset + item.length - 8):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def corrupt_newest(storage_url: str, rng: random.Random) -> str | None:
    """Flip bytes in one expert item of the newest committed checkpoint (local paths only).
    Returns 'checkpoint:key' or None when there is nothing to corrupt."""
    path = storage_url[len("faulty://"):] if storage_url.startswith("faulty://") else storage_url
    st = Storage(path)
    if not st.local:
        return None
    names = st.committed()
    if not names:
        return None
    name = names[-1]
    fqns = sorted(st.read_manifest(name).keys.expert_keys())  # (the items file unread)
    if not fqns:
        return None
    fqn = fqns[rng.randrange(len(fqns))]
    corrupt_item(Path(st.root) / name, fqn)
    return f"{name}:{fqn}"


class FaultInjector:
    """Fires a FaultPlan's faults from the training loop (one per rank).

    Call ``before_step(step)`` at the top of every step and ``after_backward(step)``
    after the backward pass; give ``hooks`` to the CheckpointManager
    (``CheckpointManager(..., hooks=injector.hooks)``): the faults inside a persist or a
    snapshot copy fire there. Fired faults are recorded before they act, so a restarted
    process does not fire them again. ``on_event`` receives a dict per fault.
    """

    def __init__(self, plan: FaultPlan, rank: int, ckpt_url: str | None, seed: int = 0,
                 storage_fault_steps: int = 16,
                 on_event: Callable[[dict], None] | None = None,
                 log_path: str | None = None) -> None:
        self.plan = plan
        self.rank = rank
        self.ckpt_url = ckpt_url
        self.rng = random.Random(seed * 1000 + rank)
        self.storage_fault_steps = storage_fault_steps
        self.on_event = on_event or (lambda e: None)
        self.log_path = log_path
        self._storage_until = -1
        self._step = -1
        self.ram_folder: str | None = None
        """What ``ram_lost`` removes: this run's shared-memory folder (:meth:`use_ram`)."""
        self._copy_kill: int | None = None
        """The step whose snapshot copy is to be killed (armed by kill_copy), or None."""
        self._persist_kill: tuple[Fault, int, float] | None = None
        """The armed kill_persist/kill_commit: (fault, step armed at, delay), or None."""
        self.hooks = FaultHooks(on_persist=self._in_persist, on_snapshot=self._in_snapshot)
        """The seams the faults inside a persist or a copy fire from (the manager's)."""

    def _fire(self, fault: Fault, step: int, **extra) -> None:
        self.plan.mark(fault)
        event = {"event": "fault", "kind": fault.kind, "step": step, "rank": self.rank,
                 "time": time.time(), **extra}
        log.warning("injecting fault %s at step %d on rank %d", fault.kind, step, self.rank)
        if self.log_path:
            # Any rank, before the fault acts (a SIGKILL leaves no chance later); one
            # O_APPEND write per line keeps lines of several ranks whole.
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, (json.dumps(event) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        self.on_event(event)

    def before_step(self, step: int) -> None:
        self._step = step
        if self._storage_until >= 0 and step >= self._storage_until:
            FaultyFileSystem.mode = None
            self._storage_until = -1
            log.warning("storage healthy again at step %d", step)
        for fault in self.plan.due(step, self.rank):
            if fault.kind == "sigkill":
                self._fire(fault, step)
                kill_self()
            elif fault.kind in ("kill_persist", "kill_commit"):
                # Recorded when it acts (in the persist of a later checkpoint), so its
                # step is the one training was at; marked now so it is armed only once.
                self.plan.mark(fault)
                self._arm_persist_kill(fault, step)
            elif fault.kind in ("storage_error", "enospc", "slow_storage"):
                self._fire(fault, step, until=step + self.storage_fault_steps)
                FaultyFileSystem.mode = {"storage_error": "error", "enospc": "enospc",
                                         "slow_storage": "slow"}[fault.kind]
                self._storage_until = step + self.storage_fault_steps
            elif fault.kind == "kill_copy":
                self._fire(fault, step)
                self._arm_copy_kill(step)
            elif fault.kind == "ram_lost":
                if self.ram_folder is None:  # use_ram refuses such a plan at set-up
                    raise ConfigError("ram_lost needs the shared-memory RAM tier's folder "
                                      "(FaultInjector.use_ram)")
                self._fire(fault, step, ram_dir=self.ram_folder)
                remove_tree(self.ram_folder)
                kill_self()
            elif fault.kind == "corrupt":
                target = corrupt_newest(self.ckpt_url, self.rng) if self.ckpt_url else None
                self._fire(fault, step, target=target)

    def use_ram(self, folder: str | None) -> None:
        """Where ``ram_lost`` strikes: ``folder``, the folder holding this run's slots in
        shared memory on this node (the RAM tier's resolved folder, never the raw
        ``ram_dir`` setting such as ``"auto"``), or None where the run has no shared-memory
        tier. Called by the set-up on every rank once the manager is built. Raises
        ConfigError when the plan has a ``ram_lost`` fault and ``folder`` is None (the
        fault would lose nothing: snapshots in the process die with it anyway)."""
        if folder is None and any(f.kind == "ram_lost" for f in self.plan.faults):
            raise ConfigError("the ram_lost fault needs a shared-memory RAM tier, and this run "
                              "keeps its snapshots in the process; give --ram-dir a folder "
                              "on shared memory (e.g. /dev/shm/moepec) or drop ram_lost")
        self.ram_folder = folder

    def after_backward(self, step: int) -> None:
        for fault in self.plan.due(step, self.rank, kinds=("exception", "kill_allreduce")):
            self._fire(fault, step)
            if fault.kind == "kill_allreduce":
                kill_self()
            raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")

    def _arm_copy_kill(self, step: int) -> None:
        self._copy_kill = step

    def _in_snapshot(self, where: str, at: int) -> None:
        """``hooks.on_snapshot``: the copying thread, at each snapshot point."""
        if where == "copy" and at == self._copy_kill:
            kill_self()  # the slot's header was removed; its data is half written

    def _arm_persist_kill(self, fault: Fault, armed_at: int) -> None:
        self._persist_kill = (fault, armed_at, self.rng.uniform(0.0, 0.01))

    def _in_persist(self, where: str, name: str) -> None:
        """``hooks.on_persist``: the persist worker, at each persist point. An armed kill
        strikes the persist of a checkpoint taken at or after the step it was armed at,
        never an older one still in flight (a slow persist of step 7 running when
        ``kill_commit@15`` is armed would otherwise be killed instead of step 15's)."""
        if self._persist_kill is None:
            return
        fault, armed_at, delay = self._persist_kill
        parsed = parse_checkpoint_name(name)
        if parsed is not None and parsed[1] < armed_at:
            return
        if fault.kind == "kill_persist" and where == "write":
            self._fire_in_persist(fault, armed_at, name)
            threading.Timer(delay, kill_self).start()  # while DCP writes the data
        elif fault.kind == "kill_commit" and where == ("before_commit" if self.rank == 0
                                                       else "written"):
            self._fire_in_persist(fault, armed_at, name)
            kill_self()  # data written, manifest not (rank 0 commits)

    def _fire_in_persist(self, fault: Fault, armed_at: int, name: str) -> None:
        # The persist of checkpoint step c runs while training is past step c.
        parsed = parse_checkpoint_name(name)
        at = max(self._step, parsed[1] + 1 if parsed else -1)
        self._fire(fault, at, armed_at=armed_at, checkpoint=name)
