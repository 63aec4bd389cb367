"""Routing counts: token assignments per (MoE layer, expert), the input of PLT and of
load-aware selection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moepec.errors import ConfigError


class RoutingCounter:
    """This rank's token assignments since the last checkpoint, summed over ranks when a
    checkpoint is taken. Training thread only."""

    def __init__(self, n_experts: Sequence[int], distributed: bool) -> None:
        self.n_experts = tuple(n_experts)
        self.distributed = distributed
        self._pending = self._zeros()

    def _zeros(self) -> list[list[int]]:
        return [[0] * n for n in self.n_experts]

    def add(self, counts: Sequence[Any]) -> None:
        """Add one step's counts: ``counts[l]`` is a sequence or int tensor of length N_l.
        Raises ConfigError on a bad shape. No collective."""
        if len(counts) != len(self.n_experts):
            raise ConfigError(f"observe_routing got counts for {len(counts)} MoE layers; the "
                              f"model has {len(self.n_experts)}")
        for layer, row in enumerate(counts):
            values = row.tolist() if torch.is_tensor(row) else list(row)
            if len(values) != self.n_experts[layer]:
                raise ConfigError(f"observe_routing: layer {layer} has {self.n_experts[layer]} "
                                  f"experts, got {len(values)} counts")
            pend = self._pending[layer]
            for e, v in enumerate(values):
                pend[e] += int(v)

    def pending(self) -> list[list[int]]:
        """A copy of this rank's counts since the last checkpoint (not summed)."""
        return [list(row) for row in self._pending]

    def reset(self) -> None:
        """Forget the counts since the last checkpoint (after a restore)."""
        self._pending = self._zeros()

    def take(self) -> list[list[int]]:
        """The counts since the last call, summed over all ranks, and start again.
        Collective (all ranks, training thread) when distributed."""
        counts, self._pending = self._pending, self._zeros()
        if not (self.distributed and self.n_experts):
            return counts
        flat = torch.tensor([v for row in counts for v in row], dtype=torch.int64)
        dist.all_reduce(flat)
        values = flat.tolist()
        out, i = [], 0
        for n in self.n_experts:
            out.append(values[i:i + n])
            i += n
        return out
