"""Several torch optimizers over one model, seen as one by the state catalogue.

Current MoE runs train one model with several optimizers over disjoint parameter sets
(Muon for the matrices, AdamW for the rest; torchtitan builds one optimizer per
``optimizer_name`` of its ``param_groups``). moepec keys optimizer state by parameter
name (``optim/<param>/<state>``, ``experts/<l>/<e>/optim/<param>/<state>``: moepec.keys),
so with disjoint parameters every key still names one tensor of one optimizer, and each
optimizer's per-expert state goes with its expert exactly as a single optimizer's does.
:class:`OptimizerSet` presents the optimizers through the two attributes the catalogue
reads of an optimizer: ``param_groups`` (all groups, in optimizer order: the object
``objects/optim_groups`` holds them in that order) and ``state`` (each parameter's state
in the optimizer that owns it). Pure: no I/O, no collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from typing import Any

import torch

from moepec.errors import ConfigError

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
"""What :class:`moepec.CheckpointManager` takes as its optimizer: one, several over
disjoint parameters, or none."""


class OptimizerSet:
    """Several optimizers over disjoint parameters as one optimizer-like object.

    Built once per manager on every rank (``joint``). Holds the live optimizers: their
    param groups and state are read and written in place, never copied.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self._owner: dict[int, torch.optim.Optimizer] = {}
        for i, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    other = self._owner.setdefault(id(p), opt)
                    if other is not opt:
                        j = self.optimizers.index(other)
                        raise ConfigError(
                            f"optimizers {j} and {i} both update a parameter of shape "
                            f"{tuple(p.shape)}; give each parameter to one optimizer")
        self.state = _JointState(self._owner, self.optimizers)
        """Parameter -> its state dict, in the optimizer that owns the parameter."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups of all optimizers, in optimizer order (the live dicts)."""
        return [g for opt in self.optimizers for g in opt.param_groups]


class _JointState(Mapping):
    """``state`` of an :class:`OptimizerSet`: indexing a parameter creates its (empty)
    state in its own optimizer, as indexing a torch optimizer's ``state`` does."""

    def __init__(self, owner: Mapping[int, torch.optim.Optimizer],
                 optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._owner, self._optimizers = owner, optimizers

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        opt = self._owner.get(id(p))
        if opt is None:
            raise KeyError("a parameter that no optimizer of the set updates")
        return opt.state[p]

    def get(self, p: torch.Tensor, default: Any = None) -> Any:
        opt = self._owner.get(id(p))
        return default if opt is None else opt.state.get(p, default)

    def __contains__(self, p: object) -> bool:
        opt = self._owner.get(id(p))
        return opt is not None and p in opt.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return chain.from_iterable(opt.state for opt in self._optimizers)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)


def joint(optimizer: Optimizers) -> torch.optim.Optimizer | OptimizerSet | None:
    """The manager's ``optimizer`` argument as one optimizer-like object: a single
    optimizer (or a sequence of one) as it is, several as an :class:`OptimizerSet`, none
    (None or an empty sequence) as None. Raises ConfigError when two optimizers share a
    parameter or an item is not a torch optimizer."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    opts = list(optimizer)
    for i, opt in enumerate(opts):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer {i} is a {type(opt).__name__}, not a "
                              f"torch.optim.Optimizer; pass torch optimizers")
    if len(opts) <= 1:
        return opts[0] if opts else None
    return OptimizerSet(opts)
