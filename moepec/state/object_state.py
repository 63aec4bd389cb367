"""The small objects of the training state: RNG states, the optimizer's hyper-parameters,
every ``extra_state`` entry's ``state_dict()``.

Each is one object key (``objects/...``, moepec.keys), stored as tagged JSON in a uint8
tensor (:mod:`moepec.state.objects`). :class:`ObjectState` captures them at snapshot time,
decodes and checks saved ones (no code runs), and applies them on restore.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from moepec.errors import ConfigError, CorruptCheckpointError, StructureMismatchError
from moepec.keys import OBJECT_PREFIX
from moepec.state.objects import decode_object, encode_object
from moepec.state.rng import check_rng_state, rng_state, set_rng_state

log = logging.getLogger(__name__)

EXTRA_PREFIX = f"{OBJECT_PREFIX}extra/"
_GROUPS_FIX = "keep the optimizer's param_groups hyper-parameters plain data"


def _extra_where(name: str) -> str:
    return f"extra_state[{name!r}] state_dict()"


class ObjectState:
    """The object keys of one training job. Built once per manager on every rank;
    ``capture``, ``decode`` and ``apply`` run on the training thread."""

    def __init__(self, optimizer: torch.optim.Optimizer | None,
                 extra_state: Mapping[str, Any] | None) -> None:
        self.optimizer = optimizer
        self.extra_state = dict(extra_state or {})
        for name, obj in self.extra_state.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"extra_state[{name!r}] ({type(obj).__name__}) has no state_dict()/"
                    f"load_state_dict(); pass objects that do, or wrap it")
            _check_storable(name, obj)

    def keys(self) -> list[str]:
        """Every object key, in a fixed order."""
        keys = ["objects/rng"]
        if self.optimizer is not None:
            keys.append("objects/optim_groups")
        keys += [f"objects/extra/{n}" for n in self.extra_state]
        return keys

    def capture(self) -> dict[str, torch.Tensor]:
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

    def decode(self, key: str, value: torch.Tensor) -> Any:
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

    def apply(self, key: str, obj: Any) -> None:
        """Set one decoded object (from ``decode``) into the live state."""
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
