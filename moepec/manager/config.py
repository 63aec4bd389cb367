"""Configuration of checkpointing: one small validated dataclass."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from fsspec.core import split_protocol

from moepec.errors import ConfigError, check_choice
from moepec.policy.plan import WriteMode
from moepec.policy.selection_policy import Selection, resolve_selection
from moepec.ram.replica import check_ram_replicas
from moepec.store.items import Serialization
from moepec.store.storage.base import is_local_url

AUTO = "auto"
"""``CheckpointConfig.ram_dir="auto"``: shared memory when it exists and fits."""


class PecScope(StrEnum):
    """What PEC skips for the experts a checkpoint does not select."""

    ALL = "all"
    """Weights and optimizer state."""
    OPTIMIZER = "optimizer"
    """Only optimizer state: weights are saved every time."""
    WEIGHTS = "weights"
    """Only weights: optimizer state is saved every time."""


class BusyPolicy(StrEnum):
    """What a checkpoint does when the previous persist is still writing."""

    WAIT = "wait"
    """Wait for it (blocks the training loop)."""
    SKIP = "skip"
    """Keep this checkpoint in RAM only."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """What, when and where moepec checkpoints. Validated on construction."""

    path: str
    """Checkpoint root: a local directory or any fsspec URL (s3://bucket/run, memory://run)."""
    interval: int = 32
    """Checkpoint after every ``interval`` optimizer steps (when (step + 1) % interval == 0)."""
    k_persist: int = 1
    """Experts per MoE layer written to storage at each checkpoint (K_persist)."""
    k_snapshot: int | None = None
    """Experts per MoE layer copied to host RAM at each checkpoint (K_snapshot >= K_persist).
    None means equal to ``k_persist``."""
    selection: Selection | str = Selection.SEQUENTIAL
    """Which experts: ``sequential`` (staggered round-robin), ``load_aware``, or the name of
    a policy of your own registered beforehand with :func:`moepec.register_selection` (on
    every rank; the manifest records the name). A user policy has no staleness bound
    unless it keeps one: ``full_every`` is the safety net."""
    pec_scope: PecScope = PecScope.ALL
    """What PEC skips for unselected experts: ``all`` (weights and optimizer state),
    ``optimizer`` (only optimizer state; weights every time) or ``weights``."""
    full_every: int = 0
    """Make every M-th checkpoint a full one (all experts); 0 = never."""
    keep_last: int = 2
    """Committed views to retain; older checkpoints go once no retained view needs them."""
    async_snapshot: bool = True
    """Copy to RAM in a background thread overlapped with the next step (False: copy inline)."""
    async_persist: bool = True
    """Write to storage in a background thread (False: write before step() returns)."""
    busy_policy: BusyPolicy = BusyPolicy.WAIT
    """When a checkpoint is due while the previous persist is still writing: ``wait`` for it
    (blocks the loop) or ``skip`` persisting this one and keep it only in RAM."""
    write_mode: WriteMode = WriteMode.ADAPTIVE
    """Who writes what across ranks: ``baseline``, ``sharded`` or ``adaptive``."""
    plt_budget: float = 0.0375
    """Budget for the cumulative proportion of lost tokens (PLT), used by dynamic K."""
    dynamic_k: bool = True
    """After a recovery that leaves PLT over the budget, double K_persist (up to N). On by
    default: it costs nothing until a recovery breaks the budget (README, "Plan a run")."""
    dynamic_k_down: bool = False
    """Also halve K_persist again when PLT is under a quarter of the budget after a recovery."""
    serialization: Serialization = Serialization.RAW
    """How DCP items are stored: ``raw`` tensor bytes (fast; read by moepec's DCP reader,
    ``moepec export --format dcp`` converts) or ``torch_save`` (stock DCP: any
    ``dcp.load`` with a FileSystemReader reads it; slower to write many small items)."""
    verify: bool = True
    """Verify checksums of everything restored."""
    restore_in_place: bool = False
    """Read restored values straight into the live model and optimizer tensors (faster:
    no second copy, no new memory). The price: a restore that then fails on damage
    (NoCheckpointError, CorruptCheckpointError) leaves them partly overwritten, so rebuild
    them before training without a checkpoint. False: all or nothing."""
    timeout_s: float = 600.0
    """Upper bound of every wait (snapshot, persist, collective)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec (e.g. endpoint_url, key, secret for s3://)."""
    takeover: bool = False
    """Take the checkpoint root's lease from the run holding it (one writer per root)."""
    lease_timeout_s: float = 300.0
    """A lease whose holder has not refreshed it for this long is free to take."""
    ram_dir: str | None = "auto"
    """Where RAM snapshots live. ``"auto"`` (default): in node-local shared memory,
    ``/dev/shm/moepec``, when that exists and the tier fits its budget (one info line
    says so), else in the training process (one info line says why). A folder on a
    shared-memory filesystem: snapshot slots there, which outlive the worker, so a worker
    restarted by ``torchrun --max-restarts`` recovers from RAM (refused with a
    ConfigError when it cannot be used). None: in the training process (lost with it; an
    in-process restart still recovers from them). A clean close removes the slots; after
    a crash they stay for the restarted worker (``moepec ram clean`` removes them)."""
    ram_replicas: int | None = None
    """Copies of each rank's committed RAM slot kept on another node (ring over node ids:
    ``MOEPEC_NODE_ID``, default the hostname), so a lost node's shares restore from RAM.
    0 or 1; None: 1 when the ranks span several nodes, else 0. Needs ``ram_dir``."""
    ram_budget_bytes: int | None = None
    """Shared memory the RAM tier may use on one node (three slots per local rank, twice
    that with replicas); None: half of the free space of ``ram_dir``'s filesystem. A
    tier that cannot fit is refused before training starts."""
    require_experts: bool | None = None
    """What the manager does when discovery finds no experts: True raises
    ExpertDiscoveryError (listing what it looked at and a ready ExpertSpec), False takes
    full checkpoints, with a warning when something looked like experts but was not
    taken. None (default): True unless ``full_every=1`` asked for full checkpoints anyway
    -- a partial-experts checkpointer that silently checkpoints in full is the failure
    this guards against."""
    peer_paths: tuple[str, ...] = ()
    """The other replica groups' roots when checkpoints are striped over groups
    (:meth:`CheckpointManager.share`; the reference trainer's ``--ft-checkpoints
    striped``): :meth:`~CheckpointManager.restore` restores the newest checkpoint whole
    over all the roots, and retention keeps this root's part of it. Read, never written.
    Same ``storage_options``."""
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1")
    """Signals that mean a planned stop (a preemption, a launcher shutting down, Ctrl-C),
    caught from the loop's first :meth:`~CheckpointManager.should_stop` call: the ranks
    agree on a step, write a complete checkpoint there (every expert) and
    ``should_stop`` returns True. Handlers only set a flag; a handler of the user's that
    was there before is called too. A second one more than 2 s later stops at once (as
    before). ``()``: no handlers."""
    stop_grace_s: float = 20.0
    """Seconds from a stop signal within which the complete checkpoint should be
    committed: ``should_stop`` waits for its commit at most this long after the signal
    (then says so and returns). Fits torchrun's 30 s ``--shutdown-timeout`` (after which it
    SIGKILLs its workers); set it below your scheduler's grace period."""
    final_checkpoint: bool | None = None
    """Whether ``close()`` after a clean end (no exception in flight) writes a complete
    checkpoint at the last step passed to ``step()``, unless the newest checkpoint is one,
    so that a rerun or an extension with more steps restores with PLT 0. None (default):
    when the loop asks :meth:`~CheckpointManager.should_stop` (it follows the planned-stop
    contract); True: always; False: never."""

    @property
    def experts_required(self) -> bool:
        """``require_experts`` with its default resolved."""
        if self.require_experts is None:
            return self.full_every != 1
        return self.require_experts

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("CheckpointConfig.path must be a non-empty path or URL")
        self._check_types()
        if self.interval < 1:
            raise ConfigError(f"interval must be >= 1 (got {self.interval})")
        if self.k_persist < 1:
            raise ConfigError(f"k_persist must be >= 1 (got {self.k_persist})")
        if self.k_snapshot is None:
            self.k_snapshot = self.k_persist
        if self.k_snapshot < self.k_persist:
            raise ConfigError(
                f"k_snapshot ({self.k_snapshot}) must be >= k_persist ({self.k_persist}): the "
                f"experts written to storage are a subset of those copied to RAM")
        self.selection = resolve_selection(self.selection, "selection")
        self.pec_scope = check_choice(PecScope, self.pec_scope, "pec_scope")
        self.busy_policy = check_choice(BusyPolicy, self.busy_policy, "busy_policy")
        self.write_mode = check_choice(WriteMode, self.write_mode, "write_mode")
        self.serialization = check_choice(Serialization, self.serialization, "serialization")
        if self.full_every < 0:
            raise ConfigError(f"full_every must be >= 0 (got {self.full_every}); 0 disables it")
        if self.keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 (got {self.keep_last})")
        self._check_peers()
        if not 0 < self.plt_budget < 1:
            raise ConfigError(f"plt_budget is a fraction in (0, 1) (got {self.plt_budget})")
        if self.ram_dir is not None and (not isinstance(self.ram_dir, str) or not self.ram_dir):
            raise ConfigError(f"ram_dir must be 'auto', a folder path (e.g. /dev/shm/moepec) "
                              f"or None for in-process snapshots (got {self.ram_dir!r})")
        if self.ram_budget_bytes is not None and (
                not isinstance(self.ram_budget_bytes, int) or isinstance(self.ram_budget_bytes, bool)
                or self.ram_budget_bytes <= 0):
            raise ConfigError(f"ram_budget_bytes must be a whole number of bytes > 0 or None "
                              f"for half the free shared memory (got {self.ram_budget_bytes!r})")
        self._check_ram_dir_apart()
        check_ram_replicas(self.ram_replicas, self.ram_dir)
        self._check_stop()
        for name in ("timeout_s", "lease_timeout_s", "stop_grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number of seconds > 0 "
                                  f"(got {value})")

    def _check_stop(self) -> None:
        from moepec.manager.stop import signal_number  # the one parser of signal names

        if isinstance(self.stop_signals, str) or not all(
                isinstance(n, str) for n in self.stop_signals):
            raise ConfigError(f"stop_signals must be a tuple of signal names such as "
                              f"('SIGTERM', 'SIGUSR1'), or () (got {self.stop_signals!r})")
        self.stop_signals = tuple(self.stop_signals)
        for name in self.stop_signals:
            signal_number(name)
        if self.final_checkpoint is not None and not isinstance(self.final_checkpoint, bool):
            raise ConfigError(f"final_checkpoint must be True, False or None (got "
                              f"{self.final_checkpoint!r})")

    def _check_peers(self) -> None:
        self.peer_paths = tuple(self.peer_paths)
        own = self.path.rstrip("/")
        if not all(isinstance(p, str) and p for p in self.peer_paths) \
                or len({p.rstrip("/") for p in self.peer_paths} | {own}) \
                != len(self.peer_paths) + 1:
            raise ConfigError(f"peer_paths must be the other groups' checkpoint roots, each "
                              f"once and none equal to path (got {list(self.peer_paths)})")

    def _check_ram_dir_apart(self) -> None:
        """A ``ram_dir`` folder apart from the checkpoint root: neither the same folder
        nor one inside the other (their files would mix; ``moepec ram clean`` of one
        would meet the other's)."""
        if self.ram_dir in (None, AUTO) or not is_local_url(self.path):
            return
        root = os.path.realpath(split_protocol(self.path)[1])
        ram = os.path.realpath(self.ram_dir)
        if os.path.commonpath([root, ram]) not in (root, ram):
            return
        how = ("are the same folder" if root == ram
               else "nest: ram_dir is inside the checkpoint root" if ram.startswith(root)
               else "nest: the checkpoint root is inside ram_dir")
        raise ConfigError(f"ram_dir ({self.ram_dir}) and the checkpoint root ({self.path}) "
                          f"{how}; give the RAM tier a folder of its own, apart from the "
                          f"checkpoint root (e.g. /dev/shm/moepec)")

    def _check_types(self) -> None:
        """Whole numbers are ints, fractions numbers, switches bools, options a dict."""
        ints = ("interval", "k_persist", "full_every", "keep_last") + (
            () if self.k_snapshot is None else ("k_snapshot",))
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be a whole number (got {value!r} of type "
                                  f"{type(value).__name__})")
        for name in ("plt_budget", "timeout_s", "lease_timeout_s", "stop_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"{name} must be a number (got {value!r})")
        if self.require_experts is not None and not isinstance(self.require_experts, bool):
            raise ConfigError(f"require_experts must be True, False or None (got "
                              f"{self.require_experts!r})")
        for name in ("async_snapshot", "async_persist", "dynamic_k", "dynamic_k_down",
                     "verify", "takeover", "restore_in_place"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False (got "
                                  f"{getattr(self, name)!r})")
        if not isinstance(self.storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options (got "
                              f"{type(self.storage_options).__name__})")

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values, for the manifest (without storage_options,
        which may hold credentials)."""
        d = asdict(self)
        d.pop("storage_options")
        d["peer_paths"] = list(self.peer_paths)
        d["stop_signals"] = list(self.stop_signals)
        return {k: v.value if isinstance(v, StrEnum) else v for k, v in d.items()}

