"""``moepec advise``: the K, interval and K_snapshot that maximise ETTR under a PLT
budget, with the runner-up and what a full-checkpoint baseline gives.

Search: every K in 1, 2, 4, ... N (and N), K_snapshot in {K, 2K} and an interval grid
around the Young/Daly optimum of each K's write time. Each candidate's ETTR comes from
:func:`moepec.plan.simulate.simulate` without the ledger (fast: the same failure
sequence for every candidate), its PLT from :mod:`moepec.policy.plt_forecast`. The winner
and the runner-up are then re-simulated with the library's ledger and selectors, so the
PLT shown is measured, not only predicted.

With replica groups (``groups`` >= 2: the ``pec-ft`` strategy) every candidate trains on
through faults and restarts from its checkpoints only on a cold start, which may not
happen at all in the simulated days. A plan then fits the budget only if one cold start
would keep PLT within it (the expected loss counts at least one), and the advice adds
the best plan without replica groups beside it. Cold starts are then rare enough
that most plans reach about the same ETTR: among those within ``ETTR_TIE`` of the best,
the one that writes the fewest bytes per rank is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from moepec.errors import ConfigError
from moepec.plan.simulate import Plan, SimResult, simulate
from moepec.plan.workload import Cluster, Failures, ModelShape, Timing
from moepec.policy.plt_forecast import plt_per_fault

__all__ = ["ETTR_TIE", "Advice", "advise", "cold_start_plt", "interval_grid",
           "young_daly_steps"]

ETTR_TIE = 1e-4
"""With replica groups, plans within this much ETTR of the best (about a minute a week)
count as equal, and the one writing the fewest bytes per rank wins."""


def young_daly_steps(cost_s: float, mtbf_s: float, iteration_s: float) -> int:
    """Young/Daly's optimal interval sqrt(2 * cost * MTBF), in steps (at least 1)."""
    return max(1, round(math.sqrt(2 * max(cost_s, 1e-9) * mtbf_s) / iteration_s))


def interval_grid(center: int, limit: int) -> list[int]:
    """About 14 intervals, log-spaced from center/16 to center*4, capped at ``limit``."""
    out = {max(1, min(limit, round(center * 2 ** (e / 2)))) for e in range(-8, 5)}
    return sorted(out | {1} if center <= 4 else out)


def _ks(n: int) -> list[int]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@dataclass(slots=True)
class Advice:
    """The recommendation and what it was compared with."""

    best: SimResult
    """The highest-ETTR plan within budget (re-simulated with the ledger)."""
    runner_up: SimResult | None
    """The next one (another K or K_snapshot), re-simulated with the ledger."""
    baseline: SimResult
    """Full checkpoints (async, DCP-style staging) at their own best interval."""
    candidates: int
    """Plans tried."""
    budget: float
    """The PLT budget."""
    restart_all: SimResult | None = None
    """With replica groups: the best plan without them (every fault restarts the job)."""

    def explain(self) -> list[str]:
        """Three lines: the choice, why this K and interval, and the baseline; with
        replica groups a fourth: the best plan without them."""
        b, base = self.best, self.baseline
        p = b.settings["plan"]
        k, n = p["k_persist"] or 0, b.settings.get("n_experts", 0)
        ft = p["replica_groups"] > 1
        expected = f"expected {100 * b.plt_expected:.2f}%"
        head, tail = "use ", ""
        if ft:
            expected += f", one cold start {100 * cold_start_plt(b):.2f}%"
            head = f"use pec-ft with {p['replica_groups']} replica groups, "
            tail = f"; {b.cold_starts} cold starts of {b.failures} faults"
        lines = [f"{head}K_persist={k}, K_snapshot={p['k_snapshot'] or k}, interval="
                 f"{p['interval']} steps ({p['interval'] * b.settings['iteration_s']:.0f} s): "
                 f"ETTR {b.ettr:.4f}, PLT {100 * b.plt:.2f}% ({expected}, budget "
                 f"{100 * self.budget:.2f}%){tail}"]
        if self.runner_up is not None:
            r = self.runner_up
            rp = r.settings["plan"]
            why = (f"the fewest bytes per rank within {ETTR_TIE:g} of the best ETTR, one "
                   "cold start within budget" if ft else "the highest ETTR within budget")
            lines.append(f"why: {why}; runner-up K_persist="
                         f"{rp['k_persist']}, K_snapshot={rp['k_snapshot'] or rp['k_persist']}, "
                         f"interval {rp['interval']}: ETTR {r.ettr:.4f}, PLT {100 * r.plt:.2f}%"
                         + (f"; K={k // 2} would lose about {100 * self.smaller_k_plt:.1f}%"
                            if k > 1 and self.smaller_k_plt else ""))
        else:
            lines.append(f"why: no other K of the {n} experts fits the budget")
        lines.append(f"full checkpoints (async) at their best interval "
                     f"{base.settings['plan']['interval']}: ETTR {base.ettr:.4f}, stall "
                     f"{base.stall_per_checkpoint_s:.3f} s/checkpoint; "
                     f"{'pec-ft' if ft else 'PEC'} gains "
                     f"{100 * (b.ettr - base.ettr):+.2f} points of ETTR")
        if self.restart_all is not None:
            r = self.restart_all
            rp = r.settings["plan"]
            lines.append(f"without replica groups (every fault restarts the job): K_persist="
                         f"{rp['k_persist']}, interval {rp['interval']}: ETTR {r.ettr:.4f}, "
                         f"PLT {100 * r.plt:.2f}%; replica groups gain "
                         f"{100 * (b.ettr - r.ettr):+.2f} points of ETTR")
        return lines

    @property
    def smaller_k_plt(self) -> float:
        """Expected PLT at half the chosen K and the same interval (outlook model)."""
        p, b = self.best.settings["plan"], self.best
        k, n = p["k_persist"], b.settings.get("n_experts", 0)
        if not k or k < 2 or not n or k >= n or not b.plt_expected:
            return 0.0
        steps = max(1, round(b.productive_s / b.settings["iteration_s"]))
        ratio = plt_per_fault(n, k // 2, p["interval"], steps) / plt_per_fault(
            n, k, p["interval"], steps)
        return b.plt_expected * ratio

    def as_dict(self) -> dict[str, Any]:
        return {"best": self.best.as_dict(),
                "runner_up": self.runner_up.as_dict() if self.runner_up else None,
                "baseline": self.baseline.as_dict(), "candidates": self.candidates,
                "budget": self.budget, "explain": self.explain(),
                "restart_all": self.restart_all.as_dict() if self.restart_all else None}


def cold_start_plt(res: SimResult) -> float:
    """Expected PLT of one storage recovery of ``res``'s plan over its run (outlook)."""
    p, n = res.settings["plan"], res.settings.get("n_experts", 0)
    k = p["k_persist"] or n
    if not n or k >= n:
        return 0.0
    steps = max(1, round(res.productive_s / res.settings["iteration_s"]))
    return plt_per_fault(n, k, p["interval"], steps)


def _plt_bound(res: SimResult, measured: bool) -> float:
    """The PLT a plan is held to: the ledger's (``measured``) or the expected one, and
    with replica groups at least one cold start's worth (days without one do not make
    the next one free)."""
    own = res.plt if measured else res.plt_expected
    if res.settings["plan"]["replica_groups"] > 1:
        return max(own, cold_start_plt(res))
    return own


def _write_s(shape: ModelShape, cluster: Cluster, timing: Timing, k: int) -> float:
    return cluster.write_seconds(shape.checkpoint_params(k) * timing.bytes_per_param)


def _plans(shape: ModelShape, cluster: Cluster, timing: Timing, failures: Failures,
           ram_tier: bool, min_interval_s: float, groups: int) -> list[Plan]:
    n, it = shape.n_experts, timing.iteration_s
    limit = max(1, round(failures.mtbf_s / it))
    floor = max(1, math.ceil(min_interval_s / it))
    plans = []
    for k in _ks(n):
        cost = _write_s(shape, cluster, timing, k) if k < n else \
            shape.checkpoint_params(n) * timing.bytes_per_param / cluster.gpus / cluster.d2h_bw
        center = young_daly_steps(cost, failures.mtbf_s, it)
        for k_snap in sorted({k, min(2 * k, n)}):
            if k == n and k_snap != n:
                continue
            for interval in sorted({max(floor, i) for i in interval_grid(center, limit)}):
                name = f"K{k}/{k_snap} I{interval}" if k < n else "full"
                plans.append(Plan(name=("pec-ft " if groups > 1 else "") + name,
                                  interval=interval, k_persist=k, k_snapshot=k_snap,
                                  overlap=k < n, ram_tier=ram_tier, replica_groups=groups))
    return plans


def advise(shape: ModelShape, cluster: Cluster, timing: Timing, failures: Failures, *,
           budget: float = 0.0375, days: float = 7.0, ram_tier: bool = True,
           sim_layers: int = 1, min_interval_s: float = 60.0, seed: int = 0,
           groups: int = 1) -> Advice:
    """Search the plans (see module doc). ``min_interval_s`` is the shortest interval
    considered: the model charges nothing for background writes competing with
    training for the network, so it would otherwise pick checkpoints every few steps.
    The winner is re-simulated over ``days`` with ``sim_layers`` MoE layers tracked.
    ``groups`` >= 2 plans ``pec-ft`` with that many replica groups; the baseline stays
    full checkpoints with restart-all recovery.
    Raises ConfigError for a budget outside (0, 1) or groups that do not divide the GPUs.
    """
    if not 0 < budget < 1:
        raise ConfigError(f"the PLT budget is a fraction in (0, 1), got {budget}")
    # At least ~300 failures' worth of wall time: ETTR is a rate, and a longer horizon
    # makes the comparison between candidates less noisy.
    horizon = max(days, 300 * failures.mtbf_s / 86400)
    tried = [(p, simulate(shape, cluster, p, timing, failures, days=horizon, seed=seed,
                          budget=budget, track_plt=False))
             for p in _plans(shape, cluster, timing, failures, ram_tier, min_interval_s,
                             groups)]
    full = [(p, r) for p, r in tried if p.k_persist == shape.n_experts]
    fits = [(p, r) for p, r in tried
            if p.k_persist < shape.n_experts and _plt_bound(r, measured=False) <= budget]
    fits.sort(key=lambda pr: -pr[1].ettr)
    if groups > 1 and fits:  # ETTR barely depends on the plan: the cheapest of the best
        top = fits[0][1].ettr
        fits.sort(key=lambda pr: (pr[1].ettr < top - ETTR_TIE, pr[1].bytes_per_rank_per_day))
    baseline_plan = max(full, key=lambda pr: pr[1].ettr)[0]
    baseline = simulate(shape, cluster, replace(baseline_plan, name="full-async",
                                                ram_tier=False, replica_groups=1),
                        timing, failures, days=horizon, seed=seed, track_plt=False)
    if not fits:
        best = baseline
        return Advice(best=best, runner_up=None, baseline=baseline, candidates=len(tried),
                      budget=budget)
    best, runner_up = _verified(fits, shape, cluster, timing, failures, budget,
                                dict(days=days, seed=seed, sim_layers=sim_layers))
    restart_all = None
    if groups > 1:  # the same search without replica groups
        restart_all = advise(shape, cluster, timing, failures, budget=budget, days=days,
                             ram_tier=ram_tier, sim_layers=sim_layers,
                             min_interval_s=min_interval_s, seed=seed).best
    return Advice(best=best or baseline, runner_up=runner_up, baseline=baseline,
                  candidates=len(tried), budget=budget, restart_all=restart_all)


def _verified(fits, shape, cluster, timing, failures, budget, kw):
    """The first candidates whose PLT, re-simulated with the ledger, is within budget:
    (best, runner-up with another K or K_snapshot); at most 6 re-simulations."""
    found: list[SimResult] = []
    seen: set[tuple] = set()
    for plan, _ in fits[:6]:
        key = (plan.k_persist, plan.k_snapshot)
        if key in seen:
            continue
        res = simulate(shape, cluster, plan, timing, failures, budget=budget, **kw)
        if _plt_bound(res, measured=True) <= budget:
            found.append(res)
            seen.add(key)
        if len(found) == 2:
            break
    return (found[0] if found else None), (found[1] if len(found) > 1 else None)
