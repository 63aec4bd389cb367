"""torchtitan's state as moepec ``extra_state`` and its routing counts, for
:class:`moepec.integrations.torchtitan.PecCheckpointManager`: the data loader without
pickle, bare tensors of ``states``, and the tokens per expert from torchtitan's own
counters."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

from moepec import StructureMismatchError
from moepec.errors import ConfigError

log = logging.getLogger(__name__)


class DataLoaderState:
    """torchtitan's data loader as ``extra_state``, without pickle.

    torchtitan's ``ParallelAwareDataloader.state_dict()`` pickles the loader's state
    (moepec never unpickles what it loads), and each data-parallel rank holds its own
    position while moepec stores one copy of small objects. So :meth:`capture`
    (collective: every rank, training thread, before each save) gathers every rank's
    plain ``StatefulDataLoader`` state, and :meth:`load_state_dict` hands each rank its
    own. Restoring at another world size is refused, as torchtitan refuses it.
    """

    def __init__(self, loader: Any, group: Any | None) -> None:
        self.loader = loader
        self.group = group
        self.rank = dist.get_rank() if group is not None else 0
        self.world_size = dist.get_world_size() if group is not None else 1
        self._base = _stateful_base(loader)
        self._cached: dict[str, Any] = {"world_size": self.world_size, "ranks": {}}

    def position(self) -> dict[str, Any]:
        """This rank's loader position now (the plain ``StatefulDataLoader`` state)."""
        return self._base.state_dict(self.loader)

    def capture(self) -> None:
        """Gather the loader positions of all ranks (collective when distributed)."""
        mine = self.position()
        states = [mine]
        if self.group is not None:
            states = [None] * self.world_size
            dist.all_gather_object(states, mine, group=self.group)
        self._cached = {"world_size": self.world_size,
                        "ranks": {str(r): s for r, s in enumerate(states)}}

    def state_dict(self) -> dict[str, Any]:
        return self._cached

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved.get("world_size") != self.world_size:
            raise ConfigError(
                f"the checkpoint's data loader positions are of {saved.get('world_size')} "
                f"ranks, this run has {self.world_size}; torchtitan cannot reshard a data "
                f"loader: resume with the same number of ranks")
        own = saved.get("ranks", {}).get(str(self.rank))
        if own:
            self._base.load_state_dict(self.loader, own)
        self._cached = saved


def _stateful_base(loader: Any) -> type:
    """The class whose un-pickled state_dict/load_state_dict the loader inherits: the
    ``StatefulDataLoader`` below torchtitan's pickling wrapper, else the loader's own."""
    for cls in type(loader).__mro__:
        if cls.__name__ == "StatefulDataLoader":
            return cls
    return type(loader)


class RoutingTap:
    """Tokens per (MoE layer, expert) since the last call, from torchtitan's own counters.

    torchtitan's ``MoE`` adds each forward's routed tokens to its ``tokens_per_expert_E``
    buffer; its load-balancing hook zeroes the buffer in the optimizer step (when
    ``load_balance_coeff`` is set), otherwise the buffer only grows. :meth:`take` reads it
    before the optimizer step and returns what is new either way.
    """

    def __init__(self, model: nn.Module, n_experts: tuple[int, ...]) -> None:
        named = [(n, m) for n, m in model.named_modules()
                 if isinstance(getattr(m, "tokens_per_expert_E", None), torch.Tensor)]
        self.layers = [m for _, m in named]
        # torchtitan's own correction (_update_expert_bias): a block recomputed in the
        # backward (activation checkpointing, NO_REENTRANT) counts its tokens twice.
        recomputed = [n for n, m in model.named_modules()
                      if getattr(m, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT]
        self._halve = [any(n.startswith(f"{r}.") for r in recomputed) for n, _ in named]
        sizes = tuple(int(m.tokens_per_expert_E.shape[-1]) for m in self.layers)
        self.enabled = bool(self.layers) and sizes == tuple(n_experts)
        if self.layers and not self.enabled:
            log.warning("moepec: torchtitan's token counters (%s) do not match the experts "
                        "found (%s); PLT and load_aware selection get no counts", sizes,
                        tuple(n_experts))
        self._last: list[torch.Tensor | None] = [None] * len(self.layers)

    def take(self) -> list[torch.Tensor] | None:
        """This step's counts per layer (int64, CPU), or None when not available."""
        if not self.enabled:
            return None
        out = []
        for i, moe in enumerate(self.layers):
            buf = moe.tokens_per_expert_E
            cur = (buf.to_local() if hasattr(buf, "to_local") else buf).detach().cpu()
            cur = cur.to(torch.int64)
            if self._halve[i]:
                cur = cur // 2
            resets = getattr(moe, "load_balance_coeff", None) is not None
            last = self._last[i]
            out.append(cur if resets or last is None else (cur - last).clamp_min(0))
            self._last[i] = None if resets else cur
        return out

    def reset(self) -> None:
        """Start counting afresh (after a restore)."""
        self._last = [None] * len(self.layers)


class TensorState:
    """A bare tensor of torchtitan's ``states`` as ``extra_state``: saved with the
    non-expert state (its bytes, exactly) and restored into the same tensor, in place."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor.detach()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        value = saved.get("tensor")
        if not (isinstance(value, torch.Tensor) and value.shape == self.tensor.shape
                and value.dtype == self.tensor.dtype):
            raise StructureMismatchError(
                f"the checkpoint holds {getattr(value, 'dtype', type(value).__name__)} "
                f"{tuple(getattr(value, 'shape', ()))} where the states hold "
                f"{self.tensor.dtype} {tuple(self.tensor.shape)}; restore into the states "
                f"the checkpoint was saved from")
        with torch.no_grad():
            self.tensor.copy_(value)


def stateful_states(states: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's ``states`` as ``extra_state``: a bare tensor wrapped in TensorState."""
    return {k: TensorState(v) if isinstance(v, torch.Tensor) else v
            for k, v in states.items()}
