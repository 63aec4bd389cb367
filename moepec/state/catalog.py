"""The checkpointable state of a training job as a flat catalogue of keys.

Every item of a checkpoint has a key (grammar in :mod:`moepec.keys`). Small objects
(RNG states, optimizer hyper-parameters, every ``extra_state`` entry's ``state_dict()``)
are stored as uint8 tensors holding pickle bytes, so every item on disk is a plain
tensor any DCP tool reads.

The catalogue reads live tensors (views, never copies) and writes restored values
back into the model, optimizer and extra state in place.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from moepec.errors import ConfigError, StructureMismatchError
from moepec.keys import EXPERT_PREFIX, expert_key, parse_key
from moepec.state.experts import ExpertMap, canonical_expert_name, expert_slice


def to_bytes_tensor(obj: Any) -> torch.Tensor:
    """Serialise a small object to a uint8 tensor (pickle; tensors inside pickle too)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)


def from_bytes_tensor(t: torch.Tensor) -> Any:
    # These bytes were written by moepec itself from the job's own state_dicts
    # (RNG, schedulers, loaders); like torch.load(weights_only=False), only load
    # checkpoints you trust.
    return pickle.loads(t.numpy().tobytes())


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StateCatalog:
    """Keys of the whole training state, and access to their live tensors.

    Built once per manager on every rank; cheap to query. Not thread-safe for
    writes: ``load`` is called on the training thread only.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 emap: ExpertMap, extra_state: Mapping[str, Any] | None = None,
                 ep_rank: int = 0, ep_size: int = 1) -> None:
        self.model = model
        # Expert parallelism: this rank holds experts [offset, offset + n_local) of
        # each layer; keys always carry global expert ids and canonical names.
        self.offsets = [ep_rank * lay.n_experts for lay in emap.layers]
        self.n_global = [lay.n_experts * ep_size for lay in emap.layers]
        self._full_of_canon: dict[str, str] = {}
        for lay in emap.layers:
            if lay.layout == "modules":
                for local, names in lay.modules.items():
                    g = self.offsets[lay.index] + local
                    for short, full in names.items():
                        self._full_of_canon[canonical_expert_name(lay, short, g)] = full
        self.optimizer = optimizer
        self.emap = emap
        self.extra_state = dict(extra_state or {})
        for name, obj in self.extra_state.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"extra_state[{name!r}] ({type(obj).__name__}) has no state_dict()/"
                    f"load_state_dict(); pass objects that do, or wrap it")
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self._name_of = {id(p): n for n, p in self.params.items()}
        self.buffers = {n: b for n, b in model.state_dict(keep_vars=True).items()
                        if n not in self.params}
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in self._name_of:
                        raise ConfigError(
                            "the optimizer holds a parameter that is not in the model; "
                            "pass the optimizer built from model.parameters()")

    # -- enumerating keys ------------------------------------------------------
    def non_expert_tensor_keys(self) -> list[str]:
        keys = [f"model/{n}" for n in self.emap.non_expert]
        keys += [f"model/{n}" for n in self.buffers]
        for pname, sk, _ in self._optim_items():
            if not self._is_expert_state(pname, sk):
                keys.append(f"optim/{pname}/{sk}")
        return keys

    def object_keys(self) -> list[str]:
        keys = ["objects/rng"]
        if self.optimizer is not None:
            keys.append("objects/optim_groups")
        keys += [f"objects/extra/{n}" for n in self.extra_state]
        return keys

    def owns(self, layer: int, expert: int) -> bool:
        """Whether this rank holds global expert ``expert`` of ``layer``."""
        off = self.offsets[layer]
        return off <= expert < off + self.emap.layers[layer].n_experts

    def covers_owned_experts(self, keys: Iterable[str], weights_in_view: bool = True) -> bool:
        """Whether ``keys`` hold a copy of every expert this rank owns: its weights, or with
        ``weights_in_view=False`` (pec_scope "optimizer": weights are non-expert state) any
        of its keys."""
        seen: dict[int, set[int]] = {}
        for k in keys:
            info = parse_key(k)
            if info.is_expert and (info.part == "model" or not weights_in_view):
                seen.setdefault(info.layer, set()).add(info.expert)
        for layer, n in enumerate(self.n_global):
            owned = {e for e in range(n) if self.owns(layer, e)}
            if not owned <= seen.get(layer, set()):
                return False
        return True

    def expert_keys(self, layer: int, expert: int, parts: Iterable[str] = ("model", "optim")
                    ) -> list[str]:
        """Keys of global expert ``expert`` (owned or not: experts of a layer are alike,
        so the keys of another rank's expert follow from this rank's first one)."""
        parts = tuple(parts)
        lay = self.emap.layers[layer]
        local = expert - self.offsets[layer] if self.owns(layer, expert) else 0
        names = lay.stacked if lay.layout == "stacked" else lay.modules[local]
        keys = []
        for short, full in names.items():
            canon = canonical_expert_name(lay, short, expert)
            if "model" in parts:
                keys.append(expert_key(layer, expert, "model", canon))
            if "optim" in parts:
                for sk, _ in self._param_state(full):
                    if self._is_expert_state(full, sk):
                        keys.append(expert_key(layer, expert, "optim", f"{canon}/{sk}"))
        return keys

    def nbytes(self, key: str) -> int:
        """Bytes of a tensor key, also for experts held by other ranks (alike by layer)."""
        info = parse_key(key)
        if info.is_expert and not self.owns(info.layer, info.expert):
            g0 = self.offsets[info.layer]
            key = key.replace(f"{EXPERT_PREFIX}{info.layer}/{info.expert}/",
                              f"{EXPERT_PREFIX}{info.layer}/{g0}/", 1)
            key = key.replace(f".experts.{info.expert}.", f".experts.{g0}.")
        t = self.tensor(key)
        return t.numel() * t.element_size()

    def _expert_param(self, layer: int, canon: str) -> str:
        """Local parameter name behind a canonical expert parameter name."""
        if self.emap.layers[layer].layout == "stacked":
            return canon
        return self._full_of_canon[canon]

    def _local_index(self, layer: int, expert: int) -> int:
        if not self.owns(layer, expert):
            raise KeyError(f"expert {expert} of layer {layer} is not held by this rank")
        return expert - self.offsets[layer]

    # -- live access -----------------------------------------------------------
    def tensor(self, key: str) -> torch.Tensor:
        """The live tensor (a view for expert slices) behind a tensor key."""
        info = parse_key(key)
        if info.is_expert:
            lay = self.emap.layers[info.layer]
            local = self._local_index(info.layer, info.expert)
            rest = key.split("/", 4)[4]
            if info.part == "model":
                pname = self._expert_param(info.layer, rest)
                return expert_slice(self.params[pname].detach(), lay, local)
            canon, sk = rest.rsplit("/", 1)
            pname = self._expert_param(info.layer, canon)
            return expert_slice(self._state(pname)[sk], lay, local)
        if info.part == "model":
            name = key[len("model/"):]
            t = self.params.get(name)
            return (t if t is not None else self.buffers[name]).detach()
        if info.part == "optim":
            pname, sk = key[len("optim/"):].rsplit("/", 1)
            return self._state(pname)[sk]
        raise KeyError(key)

    def capture_objects(self) -> dict[str, torch.Tensor]:
        """Serialise every object key now (called at snapshot time, on the training thread)."""
        out = {"objects/rng": to_bytes_tensor(rng_state())}
        if self.optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"}
                      for g in self.optimizer.param_groups]
            out["objects/optim_groups"] = to_bytes_tensor(groups)
        for name, obj in self.extra_state.items():
            out[f"objects/extra/{name}"] = to_bytes_tensor(obj.state_dict())
        return out

    def ensure_optimizer_state(self, shapes: Mapping[str, tuple[list[int], str]]) -> None:
        """Create missing optimizer state (a fresh optimizer has none) from saved shapes.

        ``shapes`` maps non-expert optim keys and expert optim keys to
        (shape, dtype) as recorded in the manifest.
        """
        if self.optimizer is None:
            return
        for key, (shape, dtype) in shapes.items():
            info = parse_key(key)
            if info.part != "optim":
                continue
            rest = key.split("/", 4)[4] if info.is_expert else key[len("optim/"):]
            pname, sk = rest.rsplit("/", 1)
            if info.is_expert:
                if not self.owns(info.layer, info.expert):
                    continue
                pname = self._expert_param(info.layer, pname)
            if pname not in self.params:
                raise StructureMismatchError(
                    f"checkpoint has optimizer state for {pname!r}, which the model lacks; "
                    f"restore into the model the checkpoint was saved from")
            p = self.params[pname]
            state = self.optimizer.state[p]
            if sk in state:
                continue
            dt = getattr(torch, dtype)
            if info.is_expert:
                full = p.shape  # the whole stacked (or per-expert) parameter
                state[sk] = torch.zeros(full, dtype=dt, device=p.device)
            else:
                device = p.device if list(shape) == list(p.shape) else "cpu"
                state[sk] = torch.zeros(shape, dtype=dt, device=device)

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy restored values into the live state (training thread only)."""
        with torch.no_grad():
            for key, value in values.items():
                if key.startswith("objects/"):
                    self._load_object(key, from_bytes_tensor(value))
                else:
                    self.tensor(key).copy_(value)

    # -- helpers ---------------------------------------------------------------
    def _load_object(self, key: str, obj: Any) -> None:
        if key == "objects/rng":
            set_rng_state(obj)
        elif key == "objects/optim_groups":
            if self.optimizer is not None:
                if len(obj) != len(self.optimizer.param_groups):
                    raise StructureMismatchError(
                        f"checkpoint has {len(obj)} optimizer param groups, the optimizer "
                        f"has {len(self.optimizer.param_groups)}; build the optimizer as "
                        f"when the checkpoint was saved")
                for group, saved in zip(self.optimizer.param_groups, obj):
                    group.update(saved)
        elif key.startswith("objects/extra/"):
            name = key[len("objects/extra/"):]
            if name in self.extra_state:
                self.extra_state[name].load_state_dict(obj)
        else:
            raise KeyError(key)

    def _optim_items(self):
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for sk, v in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v):
                        yield self._name_of[id(p)], sk, v

    def _param_state(self, pname: str) -> list[tuple[str, torch.Tensor]]:
        if self.optimizer is None:
            return []
        state = self.optimizer.state.get(self.params[pname], {})
        return [(k, v) for k, v in state.items() if torch.is_tensor(v)]

    def _state(self, pname: str) -> dict[str, Any]:
        assert self.optimizer is not None
        return self.optimizer.state[self.params[pname]]

    def _is_expert_state(self, pname: str, sk: str) -> bool:
        """Per-element state of an expert parameter is the expert's; scalars are not."""
        if pname not in self.emap.owner:
            return False
        state = self._state(pname).get(sk)
        return state is not None and tuple(state.shape) == tuple(self.params[pname].shape)
