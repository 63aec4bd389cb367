"""What PEC is expected to lose before a run starts: PLT per fault, and the K or
interval that keeps it within a budget.

The same model serves the trainer's start-up warning, ``moepec simulate`` and
``moepec advise``. It is :func:`moepec.policy.plt.expected_plt_sequential` (uniform
routing, a fault uniformly at random over the run, sequential selection), computed in
O(N) instead of O(N * T / I):

    PLT per fault = I * E_f[ sum_j min(j // K, f // I) ] / (N * T)

where I is the checkpoint interval in steps, T the run's steps and N the experts per
MoE layer. In steady state (T >> I * N / K) it is I * A / T with the mean age
A = (1/N) sum_j j // K checkpoints, so a run with F faults loses about F * I * A / T,
which for faults every M steps is I * A / M whatever the run's length.

Routing assumption: under sequential selection the expectation does not depend on how
skewed the routing is, because every expert passes through every place of the rotation
(a hot expert is as often fresh as stale); skew changes the spread from fault to fault,
which ``moepec simulate --routing zipf`` measures with the library's own ledger.

Pure logic: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moepec.errors import ConfigError

__all__ = ["PLTOutlook", "largest_interval_within", "mean_age", "plt_outlook",
           "plt_per_fault", "smallest_k_within"]


def _check(n_experts: int, k: int, interval: int, total_steps: int) -> None:
    if not 1 <= k <= n_experts:
        raise ConfigError(f"k must be in 1..{n_experts} (the experts per MoE layer), got {k}")
    if interval < 1 or total_steps < 1:
        raise ConfigError(f"interval and total steps must be >= 1, got {interval} and "
                          f"{total_steps}")


def mean_age(n_experts: int, k: int) -> float:
    """Mean age in checkpoints of an expert's newest copy at a checkpoint, in steady
    state: (1/N) sum_j j // K (= (N/K - 1) / 2 when K divides N)."""
    _check(n_experts, k, 1, 1)
    return sum(j // k for j in range(n_experts)) / n_experts


def plt_per_fault(n_experts: int, k: int, interval: int, total_steps: int) -> float:
    """Expected PLT that one fault, uniformly random over a ``total_steps`` run, adds
    under sequential PEC with ``k`` of ``n_experts`` experts every ``interval`` steps.

    Equals ``expected_plt_sequential(n_experts, k, interval, total_steps, 1)``.
    Raises ConfigError for k outside 1..n_experts or non-positive steps.
    """
    _check(n_experts, k, interval, total_steps)
    ages = [j // k for j in range(n_experts)]
    full = sum(ages)
    n_ckpts = -(-total_steps // interval)
    weighted = covered = 0
    # Before checkpoint m = max age, some experts were never saved: age capped at m.
    for m in range(min(ages[-1], n_ckpts)):
        steps_with_m = min(interval, total_steps - m * interval)
        weighted += steps_with_m * sum(min(a, m) for a in ages)
        covered += steps_with_m
    weighted += (total_steps - covered) * full
    return interval * weighted / (n_experts * total_steps * total_steps)


def smallest_k_within(n_experts: int, interval: int, total_steps: int, faults: float,
                      budget: float) -> int | None:
    """The smallest K whose expected PLT (``faults`` * per fault) is within ``budget``;
    None if even K = N is not (it never is: a full checkpoint loses nothing)."""
    for k in range(1, n_experts + 1):
        if faults * plt_per_fault(n_experts, k, interval, total_steps) <= budget:
            return k
    return None


def largest_interval_within(n_experts: int, k: int, total_steps: int, faults: float,
                            budget: float) -> int | None:
    """The largest interval (steps) whose expected PLT is within ``budget`` at this K;
    None if not even interval 1 is (bisection: the PLT grows with the interval)."""
    def fits(i: int) -> bool:
        return faults * plt_per_fault(n_experts, k, i, total_steps) <= budget

    if not fits(1):
        return None
    lo, hi = 1, total_steps
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True, slots=True)
class PLTOutlook:
    """The expected PLT of a planned run and what would fit its budget."""

    n_experts: int
    """Experts per MoE layer."""
    k_persist: int
    """Experts per MoE layer persisted per checkpoint."""
    interval: int
    """Steps between checkpoints."""
    total_steps: int
    """Steps of the run."""
    faults: float
    """Faults assumed over the run (recoveries from storage)."""
    per_fault: float
    """Expected PLT added by one fault."""
    expected: float
    """faults * per_fault: the run's expected PLT."""
    budget: float
    """The PLT budget."""
    k_fit: int | None
    """Smallest K within budget at this interval (None: none)."""
    interval_fit: int | None
    """Largest interval within budget at this K (None: none)."""

    @property
    def over_budget(self) -> bool:
        return self.expected > self.budget

    def advice(self, k_name: str = "--k ", interval_name: str = "--ckpt-interval ",
               dynamic_name: str = "--dynamic-k") -> str:
        """One line naming the K or interval that would fit the budget. The names are
        the trainer's flags by default; a library caller passes its own (for instance
        ``"k_persist="``, ``"interval="``, ``"dynamic_k=True"``)."""
        fixes = []
        if self.k_fit is not None and self.k_fit != self.k_persist:
            fixes.append(f"{k_name}{self.k_fit}")
        if self.interval_fit is not None and self.interval_fit != self.interval:
            fixes.append(f"{interval_name}{self.interval_fit}")
        fixes.append(f"{dynamic_name} (raises K after a recovery over budget)")
        return "to fit, use " + " or ".join(fixes)


def plt_outlook(n_experts: int, k_persist: int, interval: int, total_steps: int, *,
                faults: float = 1.0, budget: float = 0.0375) -> PLTOutlook:
    """The expected PLT of a run and the K / interval that fit ``budget``.

    Called once at trainer start-up (rank 0) and by the simulator; pure and cheap
    (O(N^2 + N log T)). ``faults`` is the number of recoveries assumed (1 by default:
    "per fault"). Raises ConfigError for invalid values.
    """
    if faults < 0 or not 0 < budget < 1:
        raise ConfigError(f"need faults >= 0 and a budget in (0, 1), got {faults}, {budget}")
    per = plt_per_fault(n_experts, k_persist, interval, total_steps)
    return PLTOutlook(
        n_experts=n_experts, k_persist=k_persist, interval=interval, total_steps=total_steps,
        faults=faults, per_fault=per, expected=faults * per, budget=budget,
        k_fit=smallest_k_within(n_experts, interval, total_steps, faults, budget),
        interval_fit=largest_interval_within(n_experts, k_persist, total_steps, faults,
                                             budget))
