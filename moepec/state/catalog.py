"""The checkpointable state of a training job as a flat catalogue of keys.

Every item of a checkpoint has a key (grammar in :mod:`moepec.keys`). Small objects
(RNG states, optimizer hyper-parameters, every ``extra_state`` entry's ``state_dict()``)
are stored as uint8 tensors holding a tagged JSON document (:mod:`moepec.state.objects`),
so every item on disk is a plain tensor any DCP tool reads, and loading one runs no
code. A value that JSON and tensors cannot hold is refused when the manager is built
(and at every capture), never silently dropped.

The catalogue reads live tensors (views, never copies) and writes restored values
back into the model, optimizer and extra state in place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from moepec.errors import ConfigError, CorruptCheckpointError, StructureMismatchError
from moepec.keys import EXPERT_PREFIX, OBJECT_PREFIX, expert_key, parse_key
from moepec.state.experts import ExpertMap, canonical_expert_name, expert_slice
from moepec.state.objects import decode_object, encode_object
from moepec.state.rng import check_rng_state, rng_state, set_rng_state

log = logging.getLogger(__name__)

EXTRA_PREFIX = f"{OBJECT_PREFIX}extra/"
_GROUPS_FIX = "keep the optimizer's param_groups hyper-parameters plain data"


def _extra_where(name: str) -> str:
    return f"extra_state[{name!r}] state_dict()"


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
            _check_storable(name, obj)
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
        names = lay.tensors_of(local)
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
        """Encode every object key now (training thread, at snapshot time: the objects
        change during the next step). Raises ConfigError, naming the entry, the key path
        and the type, for a value moepec does not store."""
        out = {"objects/rng": encode_object(rng_state(), "the RNG state")}
        if self.optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"}
                      for g in self.optimizer.param_groups]
            out["objects/optim_groups"] = encode_object(groups, "optimizer.param_groups",
                                                        _GROUPS_FIX)
        for name, obj in self.extra_state.items():
            out[f"{EXTRA_PREFIX}{name}"] = encode_object(obj.state_dict(), _extra_where(name))
        return out

    def read_target(self, key: str) -> torch.Tensor | None:
        """The live tensor a restore may read ``key`` into in place, or None (objects,
        experts of other ranks, optimizer state the optimizer does not have yet)."""
        if key.startswith(OBJECT_PREFIX):
            return None
        try:
            return self.tensor(key)
        except (KeyError, AssertionError):
            return None

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
        """Copy restored values into the live state (training thread only).

        Every object is decoded and checked before anything is written, so a malformed
        one (CorruptCheckpointError) or a mismatched optimizer (StructureMismatchError)
        leaves the live state untouched."""
        objects = {k: self._decode(k, v) for k, v in values.items()
                   if k.startswith(OBJECT_PREFIX)}
        with torch.no_grad():
            for key, value in values.items():
                if not key.startswith(OBJECT_PREFIX):
                    live = self.tensor(key)
                    if live.data_ptr() != value.data_ptr() or live.shape != value.shape:
                        live.copy_(value)  # not read in place already
        for key, obj in objects.items():
            self._apply_object(key, obj)

    # -- helpers ---------------------------------------------------------------
    def _decode(self, key: str, value: torch.Tensor) -> Any:
        """A saved object, decoded (no code runs) and checked against this catalogue."""
        obj = decode_object(value, key)
        if key == "objects/rng":
            return check_rng_state(obj, key)
        if key == "objects/optim_groups":
            return self._check_groups(obj, key)
        if key.startswith(EXTRA_PREFIX):
            if not isinstance(obj, dict):
                raise CorruptCheckpointError(
                    f"checkpoint item {key!r} holds a {type(obj).__name__}, not the dict a "
                    f"state_dict() returns; the item is damaged")
            return obj
        raise CorruptCheckpointError(f"checkpoint item {key!r} is an object this moepec does "
                                     f"not know; the manifest is damaged or from a newer moepec")

    def _check_groups(self, groups: Any, key: str) -> list[dict[str, Any]]:
        if type(groups) is not list or not all(
                type(g) is dict and "params" not in g and all(type(k) is str for k in g)
                for g in groups):
            raise CorruptCheckpointError(
                f"checkpoint item {key!r} is not a list of hyper-parameter dicts; the item "
                f"is damaged")
        if self.optimizer is not None and len(groups) != len(self.optimizer.param_groups):
            raise StructureMismatchError(
                f"checkpoint has {len(groups)} optimizer param groups, the optimizer "
                f"has {len(self.optimizer.param_groups)}; build the optimizer as "
                f"when the checkpoint was saved")
        return groups

    def _apply_object(self, key: str, obj: Any) -> None:
        if key == "objects/rng":
            set_rng_state(obj)
        elif key == "objects/optim_groups":
            if self.optimizer is not None:
                for group, saved in zip(self.optimizer.param_groups, obj):
                    _update_group(group, saved)
        else:
            name = key[len(EXTRA_PREFIX):]
            if name in self.extra_state:
                self.extra_state[name].load_state_dict(obj)

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


def _update_group(group: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Set a param group's hyper-parameters; a tensor one (a tensor ``lr``) is copied into
    in place, keeping its device and identity (fused and captured optimizers hold it)."""
    for k, v in saved.items():
        live = group.get(k)
        if isinstance(live, torch.Tensor) and isinstance(v, torch.Tensor) \
                and live.shape == v.shape:
            with torch.no_grad():
                live.copy_(v)
        else:
            group[k] = v


def _check_storable(name: str, obj: Any) -> None:
    """Refuse an extra_state entry whose state_dict() moepec cannot store, when the
    manager is built rather than at the first checkpoint. A state_dict() that fails
    now (state not ready yet) is checked at capture instead."""
    try:
        state = obj.state_dict()
    except Exception as exc:  # noqa: BLE001 - user code; capture_objects checks again
        log.debug("extra_state[%r].state_dict() failed at construction (%s); checked "
                  "at the first checkpoint", name, exc)
        return
    encode_object(state, _extra_where(name))
