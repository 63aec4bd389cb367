"""Replica groups on torchft: survivors keep training, a restarted group heals from a live
peer, PEC checkpoints serve cold starts.

A run is G data-parallel replica groups, each its own ``torchrun`` job, joined through a
torchft Lighthouse (:func:`start_lighthouse`, ``moepec lighthouse``). Every step each
group asks the Lighthouse for a quorum (:meth:`ReplicaGroup.start_quorum`); a group that
restarted receives the whole training state from a live group there, through torchft's
checkpoint transport (HTTP, or the cross-group process group) -- no storage read.
Gradients, already averaged inside the group with its own collectives, are averaged
across the groups of the quorum (:meth:`ReplicaGroup.allreduce_gradients`, torchft's
fault-tolerant all-reduce, per bucket); the optimizer steps only when
:meth:`ReplicaGroup.should_commit` says every rank of the group saw a healthy step.

For a loop of your own (as torchtitan's torchft experiment has)::

    from moepec.integrations.torchft import ReplicaGroup, TrainingState

    # striped checkpoints: CheckpointConfig(path=group_root(P, I), peer_paths=(the other
    # groups' group_root(P, J)), ...); without peer_paths each group writes a whole copy
    state = TrainingState(model, optimizer, extra_state={"scheduler": sched, "data": loader},
                          manager=ckpt_manager)            # the CheckpointManager or None
    group = ReplicaGroup.join(state, group=I, groups=G, lighthouse=URL)  # after init_process_group
    group.start_quorum()
    if group.cold:                       # nobody trained yet: the first start, or every
        report = ckpt_manager.restore()  # group was lost -> PEC storage / RAM as today
        if report: group.set_step(report.step + 1)
        group.agree_on_restore(G, report.step + 1 if report else 0,
                               report.lost_total if report else 0)
        group.start_quorum()             # the others heal from the chosen group
    while group.step < total_steps:
        batch = ...; loss.backward()     # inside the group: your own collectives
        group.allreduce_gradients(model.parameters())
        group.prepare_checkpoint(group.step)  # striped: this group's part, when one is due
        ckpt_manager.wait_for_snapshot()
        if group.should_commit():
            optimizer.step(); ckpt_manager.step(group.step - 1)
        optimizer.zero_grad(); group.start_quorum()
    group.close()

Which state heals: ``model.state_dict()``, ``optimizer.state_dict()`` (Adam moments),
every ``extra_state`` object's ``state_dict()`` (LR schedule, data position), and the
checkpoint manager's :meth:`~moepec.CheckpointManager.live_state` (PLT ledger, selectors,
K, routing counts since the last checkpoint); torchft's own step comes with it. Rank r
of a group heals from rank r of a live group (the same layout: DP and EP inside a group;
FSDP's DTensor shards are not sent by this transport).

PEC checkpoints (cold starts): every group keeps its own checkpoint root,
:func:`group_root` (``<path>/group-<I>``), written by its own ranks with the usual commit
rule, so a group that dies while writing leaves its last committed part intact and never
a half-committed one, and no other group's root is touched. With ``peer_paths`` (striped,
the reference trainer's default) each checkpoint is striped over the quorum's groups
(:meth:`ReplicaGroup.prepare_checkpoint`: one write plan over all their ranks) and counts
once every part committed; without, each group writes a whole copy. A cold start
restores each group (striped: the newest whole checkpoint over all roots), then the
groups agree on one restored state (:meth:`ReplicaGroup.agree_on_restore`: the newest,
then the one that lost least) and the quorum that follows heals the others from it, so
all groups continue from the same state.

Failure detection: a killed rank's group leaves the quorum one Lighthouse heartbeat
timeout (``--heartbeat-timeout-ms``) after its rank 0's heartbeats stop; an all-reduce with
a dead peer fails at once (gloo sees the closed connection), one with a hung (SIGSTOPped)
peer after ``timeout_s``; either way the step does not commit and is retried with the
next quorum. A group whose rank other than 0 hangs keeps heartbeating, and the Lighthouse
forms no quorum of half or fewer of the heartbeating groups: such a group must leave by
itself (the reference trainer's ranks watch each other, :mod:`moepec.train.liveness`, and
end the group after ``timeout_s``). The trust boundary of healing is the job: torchft's HTTP transport unpickles
what a peer of the same job sends (``weights_only=False``); PEC checkpoints are never
unpickled.

torchft is imported only by this module (the ``ft`` extra: ``pip install moepec[ft]``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from moepec import Part
from moepec.errors import ConfigError

try:
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.coordination import LighthouseServer
    from torchft.process_group import ProcessGroupGloo
except ImportError as exc:  # the extra is not installed
    raise ConfigError(f"replica groups need torchft: pip install 'moepec[ft]' ({exc})") from exc

__all__ = ["Heal", "Lighthouse", "ReplicaGroup", "TrainingState", "Transport", "group_root",
           "start_lighthouse"]

log = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per cross-group all-reduce (one torchft ``allreduce(...).wait()`` each)."""


class Transport(StrEnum):
    """How a restarted group receives the state from a live one."""

    HTTP = "http"
    """torchft's HTTP checkpoint server on every rank of the live group (the default)."""
    PG = "pg"
    """The cross-group gloo process group of the quorum (torchft's PGTransport)."""


def group_root(path: str, group: int) -> str:
    """Replica group ``group``'s own checkpoint root under ``path``."""
    return f"{path.rstrip('/')}/group-{group}"


@dataclass(frozen=True, slots=True)
class Heal:
    """A state this group received from a live peer."""

    step: int
    """The step the group continues at (the peer's next step)."""
    seconds: float
    """From the start of the quorum that healed to the state being loaded."""
    time: float
    """Wall-clock time (``time.time()``) the state was loaded."""


class TrainingState:
    """The whole training state of one rank as torchft's Manager sends and loads it.

    ``extra_state`` maps names to objects with ``state_dict()`` / ``load_state_dict()``
    (LR scheduler, data loader). ``manager`` is the run's CheckpointManager or None.
    Threads: torchft's quorum thread calls :meth:`serve` while the training thread waits
    in the synchronous quorum; the tensors stay live references, which torchft's HTTP
    server may still stream after the quorum returned, until ``should_commit`` (so the
    optimizer must step only after it, as :class:`ReplicaGroup` requires).
    :meth:`load_state_dict` runs on the training thread, inside ``start_quorum``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 extra_state: Mapping[str, Any] | None = None, manager: Any = None) -> None:
        self.model, self.optimizer, self.manager = model, optimizer, manager
        self.extra = dict(extra_state or {})
        self.on_load: Callable[[], None] | None = None
        """Called after a peer's state was loaded (the replica group's heal record)."""
        self.on_send: Callable[[dict[str, Any]], None] | None = None
        """Called with the state handed to torchft for a restarted group (its thread)."""

    def serve(self) -> dict[str, Any]:
        """What torchft's Manager sends to a restarted group: :meth:`state_dict`, shown to
        ``on_send`` first."""
        state = self.state_dict()
        if self.on_send is not None:
            self.on_send(state)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, extra state and checkpoint bookkeeping (live references to
        the model's tensors: torchft serialises them before the optimizer steps)."""
        return {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
                "pec": self.manager.live_state() if self.manager is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a peer's :meth:`state_dict` (same model structure; raises otherwise)."""
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])
        if self.manager is not None and state["pec"] is not None:
            self.manager.load_live_state(state["pec"])
        if self.on_load is not None:
            self.on_load()


class ReplicaGroup:
    """This rank's membership in replica group ``group``: torchft's Manager, its
    cross-group process group (rank r of every group) and the heal records.

    Build with :meth:`join` on every rank of the group after ``torch.distributed`` is
    initialised (torchrun's store hosts the group's coordination). All methods: main
    thread, every rank of the group, in the same order.
    """

    def __init__(self, manager: Manager, state: TrainingState, group: int,
                 groups: int | None = None, timeout_s: float = 10.0) -> None:
        self.ft, self.state, self.group, self.groups = manager, state, group, groups
        # The commit vote waits for every rank of the group, and a rank may come to it up
        # to timeout_s late (its cross-group all-reduce with a hung peer timed out): a vote
        # bounded by timeout_s alone raised in its waiting peer instead of voting no.
        self._vote_timeout = timedelta(seconds=2 * timeout_s + 5)
        self.stripes = _Stripes()
        """Which part of each striped checkpoint this group writes (healed with the state)."""
        state.extra.setdefault("moepec_stripes", self.stripes)
        self._pending: Part | None = None
        self._wrote_part = False
        """A part was handed to this process's checkpoint manager (its root's lineage is
        this process's from then on)."""
        self.heals: list[Heal] = []
        """Every state received from a peer, oldest first."""
        self.cold = False
        """After :meth:`start_quorum`: no group of the quorum has trained a step yet (the
        first start, or every group was lost): restore from checkpoints now."""
        self._quorum_t0 = 0.0
        state.on_load = self._healed

    @classmethod
    def join(cls, state: TrainingState, *, group: int, groups: int | None = None,
             lighthouse: str | None = None, timeout_s: float = 10.0,
             quorum_timeout_s: float = 60.0,
             transport: Transport | str = Transport.HTTP) -> ReplicaGroup:
        """Join the Lighthouse at ``lighthouse`` (None: ``TORCHFT_LIGHTHOUSE``) as group
        ``group`` of ``groups`` (needed for striped checkpoints: a checkpoint manager with
        ``peer_paths``). ``timeout_s`` bounds every cross-group all-reduce, commit vote and
        state transfer (a hung peer costs at most that); ``quorum_timeout_s`` the wait for
        a quorum. Collective inside the group."""
        if state.manager is not None and state.manager.config.peer_paths and (
                groups is None or not 0 <= group < groups):
            raise ConfigError(f"striped checkpoints (peer_paths) need groups=G with "
                              f"0 <= group < G (got group={group}, groups={groups})")
        transport = Transport(transport)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        ckpt_transport = None
        if transport == Transport.PG:
            ckpt_transport = PGTransport(pg, timeout=timedelta(seconds=timeout_s),
                                         device=torch.device("cpu"))
        manager = Manager(pg=pg, load_state_dict=state.load_state_dict,
                          state_dict=state.serve, min_replica_size=1,
                          # Synchronous quorum: a restarted group loads the peer's state
                          # before it takes its batch, so the data position is the peer's.
                          use_async_quorum=False, init_sync=False,
                          timeout=timedelta(seconds=timeout_s),
                          quorum_timeout=timedelta(seconds=quorum_timeout_s),
                          connect_timeout=timedelta(seconds=quorum_timeout_s),
                          lighthouse_addr=lighthouse, replica_id=f"moepec_group_{group}",
                          checkpoint_transport=ckpt_transport)
        return cls(manager, state, group, groups, timeout_s)

    def _healed(self) -> None:
        now = time.perf_counter()
        self.heals.append(Heal(step=self.ft.current_step(), seconds=now - self._quorum_t0,
                               time=time.time()))

    @property
    def step(self) -> int:
        """The next step to train (the number of committed steps)."""
        return self.ft.current_step()

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum."""
        return self.ft.num_participants()

    def set_step(self, step: int) -> None:
        """Continue at ``step`` (after a cold start restored step - 1 from checkpoints)."""
        self.ft.load_state_dict({"step": step, "batches_committed": self.ft.batches_committed()})

    def agree_on_restore(self, groups: int, next_step: int, lost: int) -> bool:
        """Cold start, after every group restored from its own checkpoints (``next_step``:
        the restored step + 1, 0 for nothing; ``lost``: token assignments its restore
        lost): the groups of the quorum choose one state, the newest, then the one that
        lost least, then the lowest group. Every other group lowers its step below that
        one's, so the next :meth:`start_quorum` heals it from the chosen group (two groups
        may restore the same step with different PEC views). Returns True when this
        group's state is the chosen one. Collective over the quorum (one all-reduce)."""
        table = torch.zeros(groups, 3, dtype=torch.float64)
        table[self.group] = torch.tensor([float(next_step), float(lost),
                                          float(random.getrandbits(52))], dtype=torch.float64)
        self.allreduce_sum(table)
        rows = [(int(table[g, 0]), -int(table[g, 1]), -g) for g in range(groups)]
        best = max(range(groups), key=lambda g: rows[g])
        # A new epoch of striped checkpoints: parts written before this cold start never
        # combine with later ones; the first checkpoint is full (members unknown).
        self.stripes.epoch, self.stripes.members = f"{int(table[best, 2]):013x}", None
        if best == self.group or next_step == 0:
            return best == self.group
        self.set_step(min(next_step, rows[best][0] - 1))
        return False

    def start_quorum(self) -> bool:
        """The quorum of the next step; heals this group when a live peer is ahead.
        Blocks up to ``quorum_timeout_s``. Returns True when this group was healed."""
        self._quorum_t0 = time.perf_counter()
        healed = len(self.heals)
        self.ft.start_quorum()
        self.cold = self.step == 0 and len(self.heals) == healed
        return len(self.heals) > healed

    def allreduce_gradients(self, params: Iterable[nn.Parameter],
                            bucket_bytes: int = BUCKET_BYTES) -> None:
        """Average the gradients over the quorum's groups, bucket by bucket, each waited
        for (per-bucket waits after backward, not torchft's DDP hook: on gloo that hook
        turned a peer's death into an AssertionError out of backward). A missing gradient
        counts as zero. A failure is recorded by torchft: :meth:`should_commit` is then
        False (the gradients may be garbage; the caller zeroes them)."""
        grads = []
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for bucket in _buckets(grads, bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.ft.allreduce(flat).wait()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the quorum's groups in place (routing counts); returns it."""
        self.ft.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def prepare_checkpoint(self, step: int) -> None:
        """On a step whose checkpoint is due (striped checkpoints only; nothing otherwise):
        learn the quorum's groups (one all-reduce) and so this group's part; the part is
        handed to the checkpoint manager when the step commits (:meth:`should_commit`).
        The quorum changed since the last checkpoint (a group left or joined), or some
        group has written no part since its process started (it restarted and healed, even
        between two checkpoints of one quorum): this one saves every expert, so no
        expert's newest copy stays only in a root that left the stripe or in a restarted
        group's abandoned lineage. Before should_commit."""
        manager = self.state.manager
        self._pending = None
        if manager is None or not manager.config.peer_paths or not manager.due(step):
            return
        assert self.groups is not None, "checked by join()"
        # [g]: group g is in the quorum; [groups + g]: its lineage in its root is new
        table = torch.zeros(2 * self.groups, dtype=torch.float64)
        table[self.group] = 1.0
        table[self.groups + self.group] = 0.0 if self._wrote_part else 1.0
        self.allreduce_sum(table)  # garbage on a failure: the step does not commit then
        members = tuple(g for g in range(self.groups) if table[g].item() > 0.5)
        if self.group not in members:
            return
        fresh = bool((table[self.groups:] > 0.5).any())
        self._pending = Part(index=members.index(self.group), count=len(members),
                             members=members, epoch=self.stripes.epoch,
                             full=fresh or members != self.stripes.members)

    def should_commit(self) -> bool:
        """Whether the step may be applied: every rank of this group saw a healthy
        quorum and all-reduce (a vote inside the group, bounded by 2 x ``timeout_s`` + 5 s:
        a rank may come to it ``timeout_s`` late). Once per step. A committed step
        hands the part :meth:`prepare_checkpoint` worked out to the checkpoint manager."""
        ok = self.ft.should_commit(timeout=self._vote_timeout)
        part, self._pending = self._pending, None
        if ok and part is not None:
            self.state.manager.share(part)
            self.stripes.members = part.members
            self._wrote_part = True
        return ok

    def close(self) -> None:
        """Leave the quorum: torchft's Manager shuts its servers down (once, at the end)."""
        self.ft.shutdown(wait=False)


class _Stripes:
    """A replica group's bookkeeping of striped checkpoints: the epoch (drawn at each cold
    start) and the groups of the last checkpoint. Sent to a restarted group with the state."""

    def __init__(self) -> None:
        self.epoch = ""
        self.members: tuple[int, ...] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "members": list(self.members) if self.members is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = str(state["epoch"])
        members = state["members"]
        self.members = tuple(int(g) for g in members) if members is not None else None


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype, about ``bucket_bytes`` per bucket."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or size + nbytes > bucket_bytes or out[-1][0].dtype != g.dtype:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


@dataclass(slots=True)
class Lighthouse:
    """A running torchft Lighthouse (in this process)."""

    server: LighthouseServer
    address: str
    """What groups pass as ``--ft-lighthouse`` / ``TORCHFT_LIGHTHOUSE``."""

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(port: int = 0, *, min_replicas: int = 1, heartbeat_timeout_ms: int = 1000,
                     join_timeout_ms: int = 1000, quorum_tick_ms: int = 50) -> Lighthouse:
    """Start a Lighthouse on ``port`` (0: a free one). ``min_replicas``: groups a quorum
    needs (1: a survivor trains on alone); ``heartbeat_timeout_ms``: a group whose rank 0
    was silent this long leaves the quorum (the failure-detection time);
    ``join_timeout_ms``: how long a quorum waits for a live group that has not asked yet."""
    if min_replicas < 1 or heartbeat_timeout_ms < 1 or join_timeout_ms < 0:
        raise ConfigError("lighthouse: need min_replicas >= 1, heartbeat_timeout_ms >= 1 and "
                          "join_timeout_ms >= 0")
    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas,
                              join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    return Lighthouse(server=server, address=server.address())
