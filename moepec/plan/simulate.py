"""An event-driven simulation of a training run with failures, for planning K, the
interval, K_snapshot and the RAM tier before paying for a real run.

The clock advances from event to event: a checkpoint (after every ``interval`` steps),
the end of its snapshot copy, its commit, a failure, the end of a restart. A failure
rolls the run back to the newest checkpoint it can recover from: the newest snapshot in
RAM when the process crashed and the node's RAM survived (or a replica exists), else the
newest committed one; the steps after it are recomputed. PEC's lost tokens are counted
by the library's own :class:`~moepec.policy.plt.PLTLedger`, with the experts chosen by
its own :class:`~moepec.policy.selection.Selector` (``select_two_tier``), under uniform
or Zipf-skewed routing, on ``sim_layers`` representative MoE layers (PLT is a mean over
layers, and staggered layers differ only by a relabelling of experts).

Cost model per checkpoint (bytes spread evenly over all ranks, a fully sharded write):
- ``full-sync``: the loop blocks for the device-to-host copy and the write;
- ``full-async`` (``dcp.async_save``): blocks for the staging copy; the write overlaps;
- PEC (moepec): the snapshot copy overlaps the next step (blocks only for what does
  not fit in one iteration, plus ``fixed_block_s``); the write overlaps.
A checkpoint due while the previous write is still running waits for it.

Replica groups (``pec-ft``, :mod:`moepec.plan.replicas`): a fault in one of G groups
costs the survivors ``Failures.ft_pause_s`` and the run a share 1/G of its throughput
until the group rejoins ``Failures.heal_s`` after the fault; nothing is rolled back. A
checkpoint being taken or written then is aborted (its writers included the failed
group), never half-committed. Only a fault in the last live group is a cold start, the
restart-from-checkpoint recovery above.

Failures arrive as a Poisson process of mean ``mtbf_s``. ``stratified`` sampling draws
the gaps at the exponential's quantiles, shuffled: a low-variance estimate, so that
curves over intervals are smooth enough to locate an optimum.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from moepec.errors import ConfigError
from moepec.plan.replicas import ReplicaGroups
from moepec.plan.workload import STRATEGIES, Cluster, Failures, ModelShape, Plan, Timing, strategy
from moepec.policy.plt import PLTLedger, dynamic_k
from moepec.policy.plt_forecast import plt_per_fault
from moepec.policy.selection import Selector, select_two_tier

__all__ = ["STRATEGIES", "Failures", "Plan", "SimResult", "SimRun", "Timing", "simulate",
           "strategy"]

@dataclass(slots=True)
class SimResult:
    """What one simulated run did."""

    plan: str
    wall_s: float
    productive_s: float
    ettr: float
    checkpoints: int
    failures: int
    stall_s: float
    stall_per_checkpoint_s: float
    recomputed_steps: int
    restart_s: float
    plt: float
    plt_expected: float
    ram_recoveries: int
    bytes_per_rank_per_day: float
    k_final: int
    cold_starts: int = 0
    """Recoveries from checkpoints (every fault, without replica groups)."""
    heals: int = 0
    """Faults the survivors trained through (replica groups)."""
    ft_pause_s: float = 0.0
    """Seconds the survivors stood still after those faults."""
    reduced_width_s: float = 0.0
    """Training lost while healing groups were missing, in seconds of the whole job."""
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Ckpt:
    idx: int
    step: int
    snap_done: float
    commit: float
    counts: list[list[int]] | None = None
    snap_set: list[tuple[int, ...]] | None = None
    selectors: tuple[dict, dict] | None = None


def _shares(n_layers: int, n: int, routing: str | list, rng: random.Random
            ) -> list[list[float]]:
    if isinstance(routing, list):  # measured shares per (layer, expert), cycled over layers
        return [[x / sum(routing[i % len(routing)]) for x in routing[i % len(routing)]]
                for i in range(n_layers)]
    if routing == "uniform":
        return [[1 / n] * n for _ in range(n_layers)]
    if routing != "zipf":
        raise ConfigError(f"routing is uniform or zipf, got {routing!r}")
    base = [1 / (r + 1) for r in range(n)]
    out = []
    for _ in range(n_layers):
        row = base[:]
        rng.shuffle(row)
        out.append([x / sum(row) for x in row])
    return out


class SimRun:
    """The state of one simulated run; :func:`simulate` drives it."""

    def __init__(self, shape: ModelShape, cluster: Cluster, plan: Plan, timing: Timing,
                 failures: Failures, *, routing: str | list, sim_layers: int, budget: float,
                 seed: int, track_plt: bool = True) -> None:
        self.shape, self.cluster, self.plan, self.timing = shape, cluster, plan, timing
        self.failures, self.budget = failures, budget
        self.rng = random.Random(seed + 1)
        g = plan.replica_groups
        if g > 1 and cluster.gpus % g:
            raise ConfigError(f"{g} replica groups (--ft-groups) cannot split {cluster.gpus} "
                              f"GPUs (--gpus) evenly; use a divisor of the GPUs")
        self.peers = ReplicaGroups(g, failures.heal_s, failures.ft_pause_s, seed) \
            if g > 1 else None
        n = shape.n_experts
        self.k = min(plan.k_persist or n, n)
        self.k_snap = min(max(plan.k_snapshot or self.k, self.k), n)
        self.track = track_plt and self.k < n
        layers = min(sim_layers, shape.n_moe_layers)
        if self.track:
            self.ledger = PLTLedger.create([n] * layers)
            self.sel_p, self.sel_s = Selector.create([n] * layers), Selector.create([n] * layers)
            self.chunk = [[round(s * plan.interval * 1000) for s in row]
                          for row in _shares(layers, n, routing, random.Random(seed))]
            self.copies: list[list[list[tuple[int, float, int]]]] = [
                [[] for _ in range(n)] for _ in range(layers)]
        self.t = self.persist_free = 0.0
        self.step = 0
        self.idx = 0
        self.ckpts: list[_Ckpt] = []
        self.from_ram = False
        self.resume_at = 0.0  # the end of the latest stall or pause of the survivors
        self.stats = dict(checkpoints=0, stall=0.0, recomputed=0, restart=0.0, failures=0,
                          ram=0, bytes=0.0, recoveries=0, pause=0.0)

    # ---------------------------------------------------------------- costs
    def _bytes(self, k: int) -> float:
        return self.shape.checkpoint_params(k) * self.timing.bytes_per_param

    def _snap_s(self, k: int) -> float:
        return self._bytes(k) / self.cluster.gpus / self.cluster.d2h_bw

    def costs(self) -> tuple[float, float, float]:
        """(blocking stall, snapshot copy time, write time) of a checkpoint now."""
        p = self.plan
        snap = self._snap_s(self.k_snap)
        write = self.cluster.write_seconds(self._bytes(self.k)) + self.timing.commit_s
        if not p.async_persist:
            return snap + write, snap, write
        if not p.overlap:
            return snap, snap, write
        return max(0.0, snap - self.timing.iteration_s) + self.timing.fixed_block_s, snap, write

    # ---------------------------------------------------------------- events
    def checkpoint(self) -> float:
        """Take the checkpoint due now; returns the time it blocks the loop."""
        stall, snap, write = self.costs()
        start_write = max(self.t + stall, self.persist_free) if self.plan.async_persist \
            else self.t
        stall += start_write - (self.t + stall) if self.plan.async_persist else 0.0
        commit = start_write + write if self.plan.async_persist else self.t + stall
        ck = _Ckpt(idx=self.idx, step=self.step, snap_done=self.t + stall + snap * (
            self.plan.overlap), commit=commit)
        if self.track:
            self._select(ck, commit)
        self.persist_free = commit
        self.ckpts = self.ckpts[-3:] + [ck]
        self.idx += 1
        self.stats["checkpoints"] += 1
        self.stats["bytes"] += self._bytes(self.k) / self.cluster.gpus
        return stall

    def _select(self, ck: _Ckpt, commit: float) -> None:
        self.ledger.observe(self.chunk)
        self.sel_p.observe(self.chunk)
        self.sel_s.observe(self.chunk)
        snap, pers = select_two_tier(self.sel_p, self.sel_s, self.k, self.k_snap)
        counts = self.ledger.counts()
        for layer, experts in enumerate(pers):
            for e in experts:
                hist = self.copies[layer][e]
                hist.append((ck.idx, commit, counts[layer][e]))
                del hist[:-3]
        self.sel_p.commit(pers, ck.idx)
        self.sel_s.commit(snap, ck.idx)
        ck.counts, ck.snap_set = counts, snap
        ck.selectors = (self.sel_p.state_dict(), self.sel_s.state_dict())

    def fail(self, t_fail: float) -> None:
        """A failure at ``t_fail``: choose the base, account the loss, roll back."""
        p, st = self.plan, self.stats
        st["failures"] += 1
        st["recoveries"] += 1
        ram_ok = p.ram_tier and (p.replicas or self.rng.random() < self.failures.ram_survives)
        ready = [c for c in self.ckpts
                 if (c.snap_done <= t_fail if ram_ok else c.commit <= t_fail)]
        base = ready[-1] if ready else None
        self.from_ram = ram_ok and base is not None
        st["ram"] += self.from_ram
        done = self.step + max(0, int((t_fail - self.t) / self.timing.iteration_s))
        new_step = base.step if base is not None else 0
        st["recomputed"] += max(0, done - new_step)
        if self.track and base is not None:
            self._account(base, t_fail, ram_ok)
        elif self.track:
            self._reset_tracking()
        self.ckpts = [c for c in self.ckpts if base is not None and c.idx <= base.idx]
        self.step = new_step
        self.t = t_fail
        self.persist_free = t_fail

    def survive(self, t_fail: float, pause_end: float, live: bool, stall: float = 0.0) -> None:
        """A fault the survivors ride out (replica groups), at ``t_fail`` or during the
        ``stall`` of the checkpoint just taken: nothing rolls back; training stands still
        until ``pause_end``. A fault in a training group (``live``) aborts the checkpoint
        in flight."""
        self.stats["failures"] += 1
        if live:
            self._abort_after(t_fail)
        if stall:
            self.t += stall
            self.stats["stall"] += stall
            self.resume_at = max(self.resume_at, self.t)
        # The progress of a step under way is kept and the clock slips by the time
        # nobody trains: from the fault, or from the end of a stall or earlier pause.
        start = max(t_fail, self.resume_at)
        shift = max(0.0, pause_end - start)
        self.t += shift
        self.resume_at = max(start, pause_end)
        self.stats["pause"] += shift

    def _abort_after(self, t_fail: float) -> None:
        """Forget the checkpoints not committed by ``t_fail`` (the selectors keep their
        rotation: an estimate)."""
        self.ckpts = [c for c in self.ckpts if c.commit <= t_fail]
        if self.track:
            for row in self.copies:
                for hist in row:
                    hist[:] = [h for h in hist if h[1] <= t_fail]
        self.persist_free = min(self.persist_free, t_fail)

    def _account(self, base: _Ckpt, t_fail: float, ram_ok: bool) -> None:
        assert base.counts is not None and base.snap_set is not None and base.selectors
        copy_counts = []
        for layer, row in enumerate(self.copies):
            out = []
            for e, hist in enumerate(row):
                if ram_ok and e in base.snap_set[layer]:
                    out.append(base.counts[layer][e])
                    continue
                usable = [c for i, tc, c in hist if i <= base.idx and tc <= t_fail]
                out.append(usable[-1] if usable else 0)
            copy_counts.append(out)
        self.ledger.record_recovery(base.counts, copy_counts)
        for row in self.copies:
            for hist in row:
                hist[:] = [h for h in hist if h[0] <= base.idx]
        self.sel_p.load_state_dict(base.selectors[0])
        self.sel_s.load_state_dict(base.selectors[1])
        if self.plan.dynamic_k:
            n = self.shape.n_experts
            self.k = dynamic_k(self.k, self.ledger.plt(), self.budget, n)
            self.k_snap = max(self.k_snap, self.k)

    def _reset_tracking(self) -> None:
        n, layers = self.shape.n_experts, len(self.copies)
        zero = [[0] * n for _ in range(layers)]
        self.ledger.record_recovery(zero, zero)
        self.copies = [[[] for _ in range(n)] for _ in range(layers)]
        self.sel_p, self.sel_s = Selector.create([n] * layers), Selector.create([n] * layers)

    def downtime(self, from_ram: bool) -> float:
        full = self._bytes(self.shape.n_experts) / self.cluster.gpus
        load = full / (self.cluster.d2h_bw if from_ram else self.cluster.read_bw_gpu)
        return self.failures.detect_s + self.failures.restart_s + load


def _fast_forward(run: SimRun, until: float) -> None:
    """Skip whole checkpoint cycles that nothing can change (no ledger, constant K).

    Right after a checkpoint the write in flight always has ``write`` seconds left, so
    every later cycle is the same: max(compute + stall, write) long (compute + stall +
    write when synchronous). Skipping n of them moves the clock, the counters and the
    recent checkpoints' times; the last two cycles before ``until`` are simulated.
    """
    if run.track or run.plan.dynamic_k or not run.ckpts or run.ckpts[-1].step != run.step:
        return
    stall, _, write = run.costs()
    compute = run.plan.interval * run.timing.iteration_s
    period = max(compute + stall, write) if run.plan.async_persist else compute + stall
    n = int((until - run.t) / period) - 2
    if n <= 0:
        return
    shift = n * period
    run.ckpts = [replace(c, step=c.step + n * run.plan.interval, idx=c.idx + n,
                         snap_done=c.snap_done + shift, commit=c.commit + shift)
                 for c in run.ckpts]
    run.step += n * run.plan.interval
    run.t += shift
    run.persist_free += shift
    run.idx += n
    run.stats["checkpoints"] += n
    run.stats["stall"] += n * (period - compute)
    run.stats["bytes"] += n * run._bytes(run.k) / run.cluster.gpus


def simulate(shape: ModelShape, cluster: Cluster, plan: Plan, timing: Timing,
             failures: Failures, *, days: float = 7.0, routing: str | list = "uniform",
             sim_layers: int = 4, budget: float = 0.0375, seed: int = 0,
             track_plt: bool = True) -> SimResult:
    """Simulate ``days`` of wall time of one strategy; returns its :class:`SimResult`.

    ``track_plt=False`` skips the ledger (PLT stays 0; ``plt_expected`` still comes from
    :mod:`moepec.policy.plt_forecast`), which lets whole checkpoint cycles be skipped: fast.

    Pure computation (no I/O). Raises ConfigError for invalid inputs.
    """
    if not days > 0 or sim_layers < 1:
        raise ConfigError(f"days must be > 0 and sim_layers >= 1, got {days}, {sim_layers}")
    run = SimRun(shape, cluster, plan, timing, failures, routing=routing,
               sim_layers=sim_layers, budget=budget, seed=seed, track_plt=track_plt)
    gaps = failures.gaps(days * 86400, seed)
    wall = sum(gaps) if failures.sampling == "stratified" else days * 86400
    fail_times = _cumsum(gaps)
    if failures.sampling == "stratified":
        fail_times = fail_times[:-1]  # the last gap ends the run, not a failure
    _drive(run, fail_times, wall)
    return _result(run, wall, days)


def _cumsum(xs: list[float]) -> list[float]:
    out, t = [], 0.0
    for x in xs:
        t += x
        out.append(t)
    return out


def _drive(run: SimRun, fail_times: list[float], wall: float) -> None:
    it, interval = run.timing.iteration_s, run.plan.interval
    fi = 0
    while run.t < wall:
        next_fail = fail_times[fi] if fi < len(fail_times) else math.inf
        _fast_forward(run, min(next_fail, wall))
        t_ck = run.t + (interval - run.step % interval) * it
        if min(next_fail, wall) <= t_ck:
            if next_fail > wall:
                run.step += int((wall - run.t) / it)
                run.t = wall
                break
            fi = _fault(run, next_fail, fail_times, fi + 1)
            continue
        run.step += interval - run.step % interval
        run.t = t_ck
        stall = run.checkpoint()
        if run.t + stall >= next_fail:  # failed while blocked: this checkpoint is lost
            run.ckpts.pop()
            fi = _fault(run, next_fail, fail_times, fi + 1, stall=stall)
            continue
        run.t += stall
        run.stats["stall"] += stall


def _fault(run: SimRun, t_fail: float, fail_times: list[float], fi: int,
           stall: float = 0.0) -> int:
    """A fault at ``t_fail`` (during a checkpoint's ``stall`` if given): the survivors
    train on while a replica group is left, else the job restarts from its checkpoints.
    Returns the index of the next failure."""
    hit = run.peers.fault(t_fail) if run.peers is not None else None
    if hit is None or hit.cold:
        if run.peers is not None:
            run.peers.reset(t_fail)
        return _recover(run, t_fail, fail_times, fi)
    run.survive(t_fail, hit.pause_end, hit.live, stall)
    return fi


def _recover(run: SimRun, t_fail: float, fail_times: list[float], fi: int) -> int:
    """Fail at ``t_fail`` and restart, failing again during the restart if due; returns
    the index of the next failure."""
    run.fail(t_fail)
    down = run.downtime(run.from_ram)
    while fi < len(fail_times) and fail_times[fi] < run.t + down:
        run.stats["restart"] += fail_times[fi] - run.t
        run.stats["failures"] += 1
        run.t = fail_times[fi]
        fi += 1
    run.stats["restart"] += down
    run.t += down
    run.persist_free = run.t
    return fi


def _result(run: SimRun, wall: float, days: float) -> SimResult:
    st, p = run.stats, run.plan
    narrow = 0.0
    if run.peers is not None:
        run.peers.close(wall)
        narrow = run.peers.lost_width_s
    productive = min(run.step * run.timing.iteration_s, wall) - narrow
    steps = max(1, run.step)
    k0 = min(p.k_persist or run.shape.n_experts, run.shape.n_experts)
    n, k_snap = run.shape.n_experts, min(max(p.k_snapshot or k0, k0), run.shape.n_experts)
    # A RAM recovery also finds the K_snapshot - K_persist extra experts of the newest
    # snapshot fresh; the others are as old as from storage (an estimate).
    per = plt_per_fault(n, k0, p.interval, steps) if k0 < n else 0.0
    fresh = (k_snap - k0) / (n - k0) if k0 < n else 0.0
    expected = (st["recoveries"] - st["ram"]) * per + st["ram"] * per * (1 - fresh)
    return SimResult(
        plan=p.name, wall_s=wall, productive_s=productive, ettr=productive / wall,
        checkpoints=st["checkpoints"], failures=st["failures"], stall_s=st["stall"],
        stall_per_checkpoint_s=st["stall"] / max(1, st["checkpoints"]),
        recomputed_steps=st["recomputed"], restart_s=st["restart"],
        plt=run.ledger.plt() if run.track else 0.0, plt_expected=expected,
        ram_recoveries=st["ram"],
        bytes_per_rank_per_day=st["bytes"] / (wall / 86400), k_final=run.k,
        cold_starts=st["recoveries"], heals=run.peers.heals if run.peers else 0,
        ft_pause_s=st["pause"], reduced_width_s=narrow,
        settings={"plan": asdict(p), "days": days, "mtbf_s": run.failures.mtbf_s,
                  "iteration_s": run.timing.iteration_s, "gpus": run.cluster.gpus,
                  "n_experts": n, "heal_s": run.failures.heal_s,
                  "ft_pause_s": run.failures.ft_pause_s})
