"""The trainer's loop as one replica group of a torchft run (``--ft-lighthouse`` ...).

Per step: a quorum (a restarted group heals from a live one in it, before it takes its
batch), forward and backward with the group's own collectives, routing counts summed and
gradients averaged across the quorum's groups (:mod:`moepec.integrations.torchft`), then
the optimizer step and the PEC checkpoint call only when the step commits; a step that
does not commit (a peer died or hung during it) puts the data position back and is
trained again with the next quorum. Survivors never restart and never roll back.

Records (rank 0 of each group, in its own metrics file): ``ft_join`` (this process
joined: pid, and ``pids``, every rank's), ``ft_first_commit`` (the first step this process
committed), ``ft_cut`` (a peer rank froze: this process ends so the group leaves the
quorum, :mod:`moepec.train.liveness`), ``ft_end`` (digests at the end), ``heal`` (state
received: step, seconds, digests), ``heal_sent`` (state sent to a restarted group, digests),
``ft_retry`` (a step that did not commit), ``ft_width`` (the step that first commits with
a new number of groups), ``ft_stall`` (a step committed more than 0.1 s after the one
before it: what a peer's fault cost this group, the seconds from commit to commit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from moepec.train import dist
from moepec.train.config import FtCheckpoints, TrainConfig, TrainResult
from moepec.train.liveness import PeerWatch
from moepec.train.loop_parts import Timer, evaluate_if_due, log_step, planned_stop, record_step
from moepec.train.metrics import MetricsWriter, checkpoint_record, recovery_record
from moepec.train.setup import Run
from moepec.train.spare import child_store_prefix, joined
from moepec.train.steps import forward_backward, optimizer_step

__all__ = ["for_group", "ft_loop", "state_digest"]

log = logging.getLogger(__name__)


def for_group(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with this replica group's own out_dir, metrics file and checkpoint root (and
    the other groups' roots, read for striped checkpoints)."""
    assert cfg.ft is not None
    from moepec.integrations.torchft import group_root

    g, ft = cfg.ft.group, cfg.ft
    ckpt = cfg.checkpoint
    if ckpt is not None:
        peers = tuple(group_root(ckpt.path, h) for h in range(ft.groups) if h != g) \
            if ft.checkpoints == FtCheckpoints.STRIPED else ()
        ckpt = dataclasses.replace(ckpt, path=group_root(ckpt.path, g), peer_paths=peers)
    return dataclasses.replace(
        cfg, out_dir=group_root(cfg.out_dir, g) if cfg.out_dir else None,
        log_jsonl=group_root(cfg.log_jsonl, g) + ".jsonl" if cfg.log_jsonl else None,
        checkpoint=ckpt)


def state_digest(value: Any) -> str:
    """SHA-256 over a nested state (tensors by bytes, the rest as JSON, keys sorted):
    equal digests = equal states, bit for bit."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            h.update(f"K{k}".encode())
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(b"L")
        for v in value:
            _feed(h, v)
    else:
        h.update(json.dumps(value, sort_keys=True, default=str).encode())


def _digests(state: Mapping[str, Any], step: int, hashed: bool = True) -> dict[str, Any]:
    """What the heal records compare: model, Adam moments (the optimizer state), step and
    data position (the two digests only when ``hashed``)."""
    out: dict[str, Any] = {"step": step, "data": dict(state["extra"]["data"])}
    if hashed:
        opt = state.get("optimizer") or {}
        out |= {"model": state_digest(state["model"]),
                "optimizer": state_digest(opt.get("state", {}))}
    return out


class _Session:
    """The replica group and what the loop records of it (one per train() call)."""

    def __init__(self, cfg: TrainConfig, run: Run, metrics: MetricsWriter) -> None:
        # torchft's servers log every quorum at INFO (Rust's logger, set up when torchft
        # is imported): warnings only, unless the user asked for more.
        os.environ.setdefault("RUST_LOG", "warn")
        from moepec.integrations.torchft import ReplicaGroup, TrainingState

        assert cfg.ft is not None
        self.cfg, self.run, self.metrics = cfg, run, metrics
        self.state = TrainingState(run.model, run.optimizer,
                                   extra_state={"scheduler": run.scheduler, "data": run.loader},
                                   manager=run.manager)
        self.state.on_send = self._sent
        self.group = ReplicaGroup.join(self.state, group=cfg.ft.group, groups=cfg.ft.groups,
                                       lighthouse=cfg.ft.lighthouse, timeout_s=cfg.ft.timeout_s,
                                       quorum_timeout_s=cfg.ft.quorum_timeout_s,
                                       transport=str(cfg.ft.transport))
        self.width = cfg.ft.groups
        _warn_on_timeouts(cfg)
        joined()  # a warm spare's supervisor (if any) restarts this process from now on
        pids = _group_pids()
        metrics.write({"event": "ft_join", "time": time.time(), "pid": os.getpid(),
                       "ppid": os.getppid(), "spare": int(os.environ.get("MOEPEC_SPARE_LIFE", -1)),
                       "group": cfg.ft.group, "groups": cfg.ft.groups, "pids": pids})
        self.watch = _watch_peers(cfg, metrics) if len(pids) > 1 else None

    def _sent(self, state: Mapping[str, Any]) -> None:
        """The state handed to a restarted group (on torchft's quorum thread, while the
        training thread waits in the quorum)."""
        self.metrics.write({"event": "heal_sent", "time": time.time(),
                            **_digests(state, self.group.step, self.cfg.ft.digests)})

    def quorum(self, result: TrainResult) -> None:
        """The next step's quorum; a heal becomes a record."""
        if not self.group.start_quorum():
            return
        heal = self.group.heals[-1]
        record = {"event": "heal", "time": heal.time, "seconds": heal.seconds,
                  **_digests(self.state.state_dict(), heal.step, self.cfg.ft.digests)}
        result.heals.append(record)
        self.metrics.write(record)
        log.info("group %d healed from a live peer at step %d in %.2fs (no storage read)",
                 self.cfg.ft.group, heal.step, heal.seconds)

    def cold_start(self, result: TrainResult) -> None:
        """After the first quorum: when no group trained yet, restore this group from its
        own checkpoints (PEC storage or RAM, as without replica groups) and meet again, so
        groups that restored an older step heal from the newest. Every group of a cold
        quorum does this, so all of them meet again."""
        manager = self.run.manager
        assert self.cfg.ft is not None
        deadline = time.monotonic() + self.cfg.ft.quorum_timeout_s
        # The first quorum may have formed before every group's torchrun started: a cold
        # start waits for all groups (each restores its own root, then they agree).
        while self.group.cold and self.group.participants < self.cfg.ft.groups \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            self.quorum(result)
        if not self.group.cold:
            return
        if self.group.participants < self.cfg.ft.groups:
            log.warning("cold start: %d of %d replica groups joined within %.0fs; starting "
                        "without the others", self.group.participants, self.cfg.ft.groups,
                        self.cfg.ft.quorum_timeout_s)
        start = manager.restore() if manager is not None else None
        if start is not None:
            result.resumed_from = start.step
            record = recovery_record(start, manager)
            result.recoveries.append(record)
            self.metrics.write(record)
            log.info("cold start: group %d restored step %d from %s (PLT %.3f%%)",
                     self.cfg.ft.group, start.step, start.tier, 100 * start.plt)
            self.group.set_step(start.step + 1)
        # One state for all: groups that restored an older or lossier view heal from the
        # chosen one at the next quorum.
        self.group.agree_on_restore(self.cfg.ft.groups, start.step + 1 if start else 0,
                                    start.lost_total if start else 0)
        self.quorum(result)


CUT_MARGIN_S = 5.0
"""What the other groups wait for their quorum beyond ``--ft-timeout`` when a group cuts
itself (its rank 0's last heartbeat ageing out of the Lighthouse, then the quorum)."""
EXIT_FROZEN = 75
"""Exit code of a process that ended because a peer rank of its group froze."""


def _warn_on_timeouts(cfg: TrainConfig) -> None:
    """A group of several ranks whose rank froze cuts itself after --ft-timeout
    (:mod:`moepec.train.liveness`); until its rank 0's heartbeats age out, torchft's
    Lighthouse forms no quorum of half or fewer of the heartbeating groups (split brain), so
    with two groups the survivor waits that long for its quorum: past --ft-quorum-timeout it
    would fail and restart too."""
    assert cfg.ft is not None
    if dist.world_size() > 1 and cfg.ft.groups > 1 \
            and cfg.ft.timeout_s + CUT_MARGIN_S >= cfg.ft.quorum_timeout_s:
        log.warning("--ft-timeout %.0fs + %.0fs >= --ft-quorum-timeout %.0fs: a frozen rank's "
                    "group is cut after --ft-timeout, and the other groups' quorum could time "
                    "out first and restart them too; keep --ft-quorum-timeout above "
                    "--ft-timeout + %.0fs", cfg.ft.timeout_s, CUT_MARGIN_S,
                    cfg.ft.quorum_timeout_s, CUT_MARGIN_S)


def _group_pids() -> list[int]:
    """Every rank's pid in this group, by rank (collective inside the group)."""
    pids = torch.zeros(dist.world_size(), dtype=torch.int64)
    pids[dist.rank()] = os.getpid()
    return [int(p) for p in dist.all_reduce_sum(pids)]


def _watch_peers(cfg: TrainConfig, metrics: MetricsWriter) -> PeerWatch:
    """Start this rank's :class:`~moepec.train.liveness.PeerWatch`: a peer silent for
    ``--ft-timeout`` ends this process (record ``ft_cut``), so the group leaves the quorum."""
    assert cfg.ft is not None
    group = cfg.ft.group

    def frozen(rank: int, silent_s: float) -> None:
        log.error("rank %d of replica group %d was frozen for %.1fs (> --ft-timeout): cutting "
                  "the group so the others train on; it restarts and heals", rank, group,
                  silent_s)
        metrics.write({"event": "ft_cut", "time": time.time(), "rank": rank,
                       "silent_s": silent_s})
        logging.shutdown()
        os._exit(EXIT_FROZEN)

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"{child_store_prefix() or ''}moepec_watch/{attempt}/"
    return PeerWatch.start(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), prefix,
                           dist.rank(), dist.world_size(), cfg.ft.timeout_s, frozen)


def _train_ft_step(s: _Session, step: int, result: TrainResult) -> tuple[Any, float, float] | None:
    """One step of the group; returns (result, lr, grad norm) when it committed, None when
    it did not (the data position is put back; the caller trains the step again)."""
    cfg, run, group = s.cfg, s.run, s.group
    if run.injector is not None:
        run.injector.before_step(step)
    position = dict(run.loader.state_dict())
    x, y = run.loader.next_batch()
    lr = run.optimizer.param_groups[0]["lr"]
    out = forward_backward(run.model, x.to(run.device), y.to(run.device))
    if run.injector is not None:
        run.injector.after_backward(step)
    counts = torch.stack([r.assigned for r in out.routing]) if out.routing else None
    if counts is not None:
        group.allreduce_sum(counts)  # every group's routing: the PLT and the selectors
    group.allreduce_gradients(run.model.parameters())
    if run.manager:
        group.prepare_checkpoint(step)  # which part of a striped checkpoint, if due
        run.persist.call(step, run.manager.wait_for_snapshot)
    if not group.should_commit():
        run.optimizer.zero_grad(set_to_none=True)
        run.loader.load_state_dict(position)
        result.retried_steps += 1
        s.metrics.write({"event": "ft_retry", "step": step, "time": time.time()})
        return None
    grad_norm = optimizer_step(run.model, run.optimizer, run.scheduler, cfg.grad_clip)
    if run.manager:
        if counts is not None:
            run.manager.observe_routing(list(counts))
        run.persist.call(step, run.manager.step, step)
        for event in run.checkpoints.take():
            s.metrics.write(checkpoint_record(event))
    return out, lr, grad_norm


def ft_loop(cfg: TrainConfig, run: Run, result: TrainResult, metrics: MetricsWriter,
            is_main: bool) -> float:
    """Train this replica group up to cfg.steps; returns training seconds. Every rank of
    the group (collective inside it); replaces the restart loop of the plain trainer."""
    assert cfg.ft is not None
    s = _Session(cfg, run, metrics)
    result.ft_group = cfg.ft.group
    timer = Timer()
    last_commit = None
    try:
        s.quorum(result)
        s.cold_start(result)
        first, started = s.group.step, True
        while s.group.step < cfg.steps:
            if not started:
                s.quorum(result)
            started = False
            step = s.group.step
            if step >= cfg.steps:
                break
            t0 = time.perf_counter()
            done = _train_ft_step(s, step, result)
            if done is None:
                continue
            out, lr, grad_norm = done
            timer.add(time.perf_counter() - t0)
            if last_commit is None:  # this process trains again (after a heal: its rejoin)
                metrics.write({"event": "ft_first_commit", "step": step, "time": time.time()})
            last_commit = _record_stall(s, step, last_commit)
            _record_width(s, result, step)
            record_step(result, step, out, run.tokens_per_step * s.width // cfg.ft.groups)
            val_loss = evaluate_if_due(cfg, run, result, step, is_main)
            if step == first or step == cfg.steps - 1 or val_loss is not None \
                    or (step + 1) % cfg.log_interval == 0:
                log_step(metrics, step, out, lr, timer.tokens_per_s(run.tokens_per_step),
                          grad_norm, val_loss, to_log=is_main and not cfg.progress)
                timer.new_window()
            # A planned stop (this group's launcher got SIGTERM): a complete checkpoint in
            # this group's own root, then the group leaves; exit 0 under torchrun, so it is
            # not restarted; the other groups train on unless they were stopped too.
            if run.manager and planned_stop(run, result, step, metrics):
                break
        metrics.write({"event": "ft_end", "time": time.time(),
                       **_digests(s.state.state_dict(), s.group.step, cfg.ft.digests)})
    finally:
        if s.watch is not None:
            s.watch.close()
        s.group.close()
    return timer.total


STALL_S = 0.1
"""A commit this long after the one before it is recorded (``ft_stall``)."""


def _record_stall(s: _Session, step: int, last: float | None) -> float:
    """Record a gap between two commits longer than STALL_S; returns this commit's time."""
    now = time.time()
    if last is not None and now - last > STALL_S:
        s.metrics.write({"event": "ft_stall", "step": step, "time": now, "seconds": now - last})
    return now


def _record_width(s: _Session, result: TrainResult, step: int) -> None:
    """Count a committed step trained by fewer groups; record a change of width."""
    assert s.cfg.ft is not None
    width = s.group.participants
    if width < s.cfg.ft.groups:
        result.reduced_width_steps += 1
    if width != s.width:
        s.metrics.write({"event": "ft_width", "step": step, "time": time.time(),
                         "groups": width, "of": s.cfg.ft.groups})
        s.width = width
