"""What recovery lost: the proportion of lost tokens (PLT, paper Eq. 7).

    PLT = (1/N_moe) * sum_i [ sum_faults L_ij ] / (T_i * TopK_i)

L_ij = token assignments to experts of MoE layer i whose updates recovery j lost;
T_i * TopK_i = all token assignments of layer i in the run.

Accounting model. ``cumulative[l][e]`` counts assignments to expert e of layer l since
the run started, along the surviving trajectory. Every checkpoint stores a copy of it as
of its step t, and every saved expert copy remembers ``cumulative[l][e]`` at its own save
step s. Recovering to the checkpoint at step t with an expert restored from an older copy
loses cumulative_t - cumulative_s assignments of that expert (steps s+1..t). Work after t
is recomputed, not lost, so the counters rewind to cumulative_t.

Pure logic: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moepec.errors import ConfigError, StructureMismatchError


def _check_counts(name: str, rows: Sequence[Sequence[int]], n_experts: tuple[int, ...]) -> None:
    if len(rows) != len(n_experts) or any(len(r) != n for r, n in zip(rows, n_experts)):
        raise ConfigError(
            f"{name} must have one row per MoE layer with one entry per expert "
            f"(shape {list(n_experts)}), got row lengths {[len(r) for r in rows]}"
        )
    if rows and min(map(min, rows)) < 0:  # every row has >= 1 entry (checked above)
        raise ConfigError(f"{name} holds a negative token count; counts must be >= 0")


@dataclass(kw_only=True, slots=True)
class PLTLedger:
    """Running PLT account of one run. Same inputs on every rank give the same state."""

    n_experts: tuple[int, ...]
    """Experts per MoE layer, in layer order."""
    cumulative: list[list[int]] = field(default_factory=list)
    """Assignments per (layer, expert) since run start on the surviving trajectory."""
    lost: list[list[int]] = field(default_factory=list)
    """Lost assignments per (layer, expert), summed over all recoveries."""
    recoveries: int = 0
    """Recoveries recorded so far."""

    def __post_init__(self) -> None:
        self.n_experts = tuple(int(n) for n in self.n_experts)
        if any(n < 1 for n in self.n_experts):
            raise ConfigError(f"every MoE layer needs >= 1 expert, got {list(self.n_experts)}")
        if not self.cumulative:
            self.cumulative = [[0] * n for n in self.n_experts]
        if not self.lost:
            self.lost = [[0] * n for n in self.n_experts]
        _check_counts("cumulative", self.cumulative, self.n_experts)
        _check_counts("lost", self.lost, self.n_experts)
        if self.recoveries < 0:
            raise ConfigError(f"recoveries must be >= 0, got {self.recoveries}")

    @classmethod
    def create(cls, n_experts: Sequence[int]) -> PLTLedger:
        """A fresh ledger: nothing seen, nothing lost."""
        return cls(n_experts=tuple(n_experts))

    def observe(self, counts: Sequence[Sequence[int]]) -> None:
        """Add one step's assignments per (layer, expert). Raises ConfigError on a bad shape."""
        _check_counts("counts", counts, self.n_experts)
        for row, add in zip(self.cumulative, counts):
            for e, c in enumerate(add):
                row[e] += int(c)

    def counts(self) -> list[list[int]]:
        """A deep copy of ``cumulative``: store it with a checkpoint and with each expert copy."""
        return [list(r) for r in self.cumulative]

    def record_recovery(
        self,
        at_step_counts: Sequence[Sequence[int]],
        copy_counts: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        """Account one recovery; returns its lost assignments per (layer, expert).

        ``at_step_counts``: ``cumulative`` as stored with the restored non-expert state
        (step t). ``copy_counts[l][e]``: ``cumulative[l][e]`` stored when the restored copy
        of that expert was saved (0 for the initial weights). Adds the loss to ``lost``,
        rewinds ``cumulative`` to ``at_step_counts`` and counts the recovery.
        Raises ConfigError on a bad shape and ValueError (before changing anything) if a
        copy claims more assignments than step t: the bookkeeping is corrupted.
        """
        _check_counts("at_step_counts", at_step_counts, self.n_experts)
        _check_counts("copy_counts", copy_counts, self.n_experts)
        this: list[list[int]] = []
        for layer, (at, copy) in enumerate(zip(at_step_counts, copy_counts)):
            row = [int(a) - int(c) for a, c in zip(at, copy)]
            bad = [e for e, x in enumerate(row) if x < 0]
            if bad:
                raise ValueError(
                    f"layer {layer} experts {bad}: restored copies claim more token "
                    "assignments than the checkpoint they are restored into; the stored "
                    "counts are corrupted"
                )
            this.append(row)
        for total, row in zip(self.lost, this):
            for e, x in enumerate(row):
                total[e] += x
        self.cumulative = [[int(a) for a in r] for r in at_step_counts]
        self.recoveries += 1
        return this

    def layer_plt(self) -> list[float]:
        """Per layer: lost / all assignments of the run so far; 0.0 for a layer with none."""
        out = []
        for lost, total in zip(self.lost, self.cumulative):
            denom = sum(total)
            out.append(sum(lost) / denom if denom else 0.0)
        return out

    def plt(self) -> float:
        """Eq. 7: the mean of :meth:`layer_plt` over MoE layers (0.0 with no layers)."""
        per_layer = self.layer_plt()
        return sum(per_layer) / len(per_layer) if per_layer else 0.0

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able deep copy of the state."""
        return {
            "n_experts": list(self.n_experts),
            "cumulative": self.counts(),
            "lost": [list(r) for r in self.lost],
            "recoveries": self.recoveries,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the state by one from :meth:`state_dict`.

        Raises StructureMismatchError if the experts per layer differ.
        """
        loaded = PLTLedger.loaded(self.n_experts, d)
        self.cumulative, self.lost, self.recoveries = (
            loaded.cumulative,
            loaded.lost,
            loaded.recoveries,
        )

    @classmethod
    def loaded(cls, n_experts: Sequence[int], d: dict[str, Any]) -> PLTLedger:
        """A new ledger holding the state ``d``: what ``create(n_experts)
        .load_state_dict(d)`` holds, with its checks and errors, built once."""
        n_experts = tuple(int(n) for n in n_experts)
        if tuple(d["n_experts"]) != n_experts:
            raise StructureMismatchError(
                f"PLT state is for experts per layer {list(d['n_experts'])} but this model "
                f"has {list(n_experts)}; restore into the same MoE structure"
            )
        return cls(n_experts=n_experts, cumulative=[list(r) for r in d["cumulative"]],
                   lost=[list(r) for r in d["lost"]], recoveries=int(d["recoveries"]))


def plt_from_history(
    history: Sequence[Sequence[Sequence[int]]],
    faults: Sequence[tuple[int, int, Sequence[Sequence[int]]]],
) -> float:
    """Reference PLT straight from Eq. 7, to cross-check :class:`PLTLedger` in tests.

    ``history[s][l][e]``: assignments at step s of the final surviving trajectory.
    ``faults``: in order, (fault_step, restore_step t, copy_steps) where copy_steps[l][e]
    is the step whose copy of expert e was restored (-1 = initial weights) and t = -1
    means a restart from scratch. A fault loses, per expert, the assignments of steps
    copy_step+1..t. Precondition: no recovery rewinds behind an earlier one's t (steps
    up to t are then never recomputed, so ``history`` holds the counts that were lost).
    Raises ValueError when the inputs break these rules.
    """
    n_layers = len(history[0]) if history else 0
    lost = [0] * n_layers
    floor = -1
    for fault_step, t, copy_steps in faults:
        if not floor <= t < fault_step <= len(history):
            raise ValueError(f"need earlier t <= t={t} < fault_step={fault_step} <= steps")
        floor = t
        for layer in range(n_layers):
            for e, s in enumerate(copy_steps[layer]):
                if not -1 <= s <= t:
                    raise ValueError(f"copy step {s} is not in -1..{t}")
                lost[layer] += sum(history[step][layer][e] for step in range(s + 1, t + 1))
    ratios = []
    for layer in range(n_layers):
        total = sum(sum(step[layer]) for step in history)
        ratios.append(lost[layer] / total if total else 0.0)
    return sum(ratios) / n_layers if n_layers else 0.0


def expected_plt_sequential(
    n_experts: int, k: int, interval_steps: int, total_steps: int, n_faults: int
) -> float:
    """Expected PLT of sequential PEC under uniform routing and uniformly random faults.

    Derivation. Checkpoint c is taken after step (c+1)*I - 1 (I = ``interval_steps``).
    A fault during step f (uniform over the T = ``total_steps`` steps of the surviving
    trajectory) restores the latest checkpoint before f, number m - 1 with m = f // I
    (m = 0: restart from scratch, nothing lost). At that checkpoint the expert j places
    behind the rotation cursor (j = 0..N-1) was last saved j // K checkpoints earlier,
    or never, which is age m in checkpoints; so its age is min(j // K, m). Each age
    unit is I steps of its N-th share of the layer's assignments, and the run holds T
    steps of assignments, so the fault loses I * sum_j min(j // K, m) / (N * T) of the
    layer (the same for every layer: staggering only relabels experts). The loss does
    not depend on other faults (the rotation is restored with the checkpoint), hence

        E[PLT] = n_faults * E_f[ I * sum_j min(j // K, f // I) ] / (N * T).

    In steady state (T >> I * N / K) this is about n_faults * I * A / T with mean age
    A = (1/N) sum_j j // K = (N/K - 1) / 2 when K divides N.
    Raises ConfigError for values outside 1 <= k <= n_experts, positive steps, faults >= 0.
    """
    if not 1 <= k <= n_experts:
        raise ConfigError(f"k must be in 1..{n_experts}, got {k}")
    if interval_steps < 1 or total_steps < 1 or n_faults < 0:
        raise ConfigError("interval_steps and total_steps must be >= 1 and n_faults >= 0")
    ages = [j // k for j in range(n_experts)]
    expected_age_sum = 0.0
    for m in range(-(-total_steps // interval_steps)):
        steps_with_m = min(interval_steps, total_steps - m * interval_steps)
        expected_age_sum += steps_with_m * sum(min(a, m) for a in ages)
    expected_age_sum /= total_steps
    return n_faults * interval_steps * expected_age_sum / (n_experts * total_steps)


def dynamic_k(k_persist: int, plt: float, budget: float, n_experts: int,
              allow_down: bool = False) -> int:
    """The paper's dynamic-K rule, applied after a recovery: double K_persist (up to N)
    while PLT is over the budget; with ``allow_down``, halve it (down to 1) when PLT is
    under a quarter of the budget. Returns the new K_persist."""
    if plt > budget:
        return min(2 * k_persist, n_experts)
    if allow_down and plt < budget / 4:
        return max(k_persist // 2, 1)
    return k_persist
