"""Replica groups in the simulator (the ``pec-ft`` strategy): which of G data-parallel
replica groups are healing, when a fault forces a cold start, and how much training the
healing groups cost the run.

The model (torchft: groups train in lockstep through a Lighthouse quorum):
- a fault hits one group, uniformly at random;
- if another group is live, the survivors lose ``pause_s`` (kill to their next committed
  step: the heartbeat timeout, a new quorum, the aborted step redone) and train on; the
  failed group rejoins ``heal_s`` after the fault, healed from a live peer. From the end
  of the pause until it rejoins the run trains at width (G - down) / G: each step commits
  fewer tokens. Nothing is rolled back, PEC loses nothing;
- a fault in a group that is still healing restarts its heal (the survivors, which do
  not wait for it, lose nothing);
- a fault in the last live group loses every replica of the state: a cold start, which
  the caller handles like any restart-from-checkpoint recovery (and then calls
  :meth:`ReplicaGroups.reset`: the restarted job has every group).

Lost throughput is counted in job-seconds: a window of ``w`` seconds with one of G groups
missing costs ``w / G``, less the part of the window that falls in a survivors' pause
(nobody trains then; the pause is counted whole on its own).

Pure computation: no I/O. Owned and driven by :class:`moepec.plan.simulate.SimRun`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moepec.errors import ConfigError

__all__ = ["Hit", "ReplicaGroups"]


@dataclass(frozen=True, slots=True)
class Hit:
    """What one fault did to the replica groups."""

    group: int
    """The group the fault hit."""
    cold: bool
    """Every group is down: the job restarts from its checkpoints."""
    live: bool
    """The group hit was training (False: it was still healing)."""
    pause_end: float
    """When the survivors commit their next step (the fault's time if nobody waits)."""


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], e) - max(a[0], s)) for s, e in spans)


class ReplicaGroups:
    """The health of ``groups`` replica groups over simulated time.

    Call :meth:`fault` at every fault in time order, :meth:`reset` after a cold start
    and :meth:`close` at the end of the run; :attr:`lost_width_s` then holds the
    job-seconds of training lost to reduced width.
    """

    def __init__(self, groups: int, heal_s: float, pause_s: float, seed: int) -> None:
        if groups < 2:
            raise ConfigError(f"replica groups that survive a fault need at least 2 groups, "
                              f"got {groups}")
        if heal_s < 0 or pause_s < 0:
            raise ConfigError(f"heal and pause times must be >= 0, got {heal_s}, {pause_s}")
        self.groups, self.heal_s, self.pause_s = groups, heal_s, pause_s
        self.rng = random.Random(seed + 2)  # its own stream: the others' draws unchanged
        self.down: list[tuple[float, float] | None] = [None] * groups
        """Per group: (start of its reduced-width window, its rejoin time), or None."""
        self.pauses: list[tuple[float, float]] = []
        """Survivors' pauses since every group was last live (merged, in time order)."""
        self.lost_width_s = 0.0
        self.heals = 0

    def fault(self, t: float) -> Hit:
        """A fault at ``t`` in a random group (times never decrease between calls). On a
        cold start the caller restarts the job, then calls :meth:`reset`."""
        self._rejoin(t)
        g = self.rng.randrange(self.groups)
        window = self.down[g]
        if window is not None:  # already healing: its heal starts over
            self.down[g] = (window[0], t + self.heal_s)
            return Hit(group=g, cold=False, live=False, pause_end=t)
        if sum(w is None for w in self.down) == 1:
            return Hit(group=g, cold=True, live=True, pause_end=t)
        end = t + self.pause_s
        if self.pauses and self.pauses[-1][1] >= t:
            self.pauses[-1] = (self.pauses[-1][0], max(self.pauses[-1][1], end))
        else:
            self.pauses.append((t, end))
        self.down[g] = (end, t + self.heal_s)
        self.heals += 1
        return Hit(group=g, cold=False, live=True, pause_end=end)

    def reset(self, t: float) -> None:
        """A cold start at ``t``: every healing window ends there, every group comes back."""
        for g in range(self.groups):
            self._charge(g, t)
        self.pauses.clear()

    def close(self, t: float) -> None:
        """The run ends at ``t``: charge the windows still open."""
        self.reset(t)

    def _rejoin(self, t: float) -> None:
        for g, w in enumerate(self.down):
            if w is not None and w[1] <= t:
                self._charge(g, t)
        if all(w is None for w in self.down):
            self.pauses.clear()

    def _charge(self, g: int, t: float) -> None:
        w = self.down[g]
        if w is None:
            return
        span = (w[0], min(w[1], t))
        if span[1] > span[0]:
            self.lost_width_s += (span[1] - span[0] - _overlap(span, self.pauses)) / self.groups
        self.down[g] = None
