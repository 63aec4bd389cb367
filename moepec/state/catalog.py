"""The checkpointable state of a training job as a flat catalogue of keys.

Every item of a checkpoint has a key (grammar in :mod:`moepec.keys`). Small objects
(RNG states, optimizer hyper-parameters, every ``extra_state`` entry's ``state_dict()``)
are stored as uint8 tensors holding a tagged JSON document (:mod:`moepec.state.objects`),
so every item on disk is a plain tensor any DCP tool reads, and loading one runs no
code. A value that JSON and tensors cannot hold is refused when the manager is built
(and at every capture), never silently dropped.

The catalogue reads live tensors (views, never copies) and writes restored values
back into the model, optimizer and extra state in place.

Sharded tensors (DTensor: FSDP2, expert parallelism over a device mesh) are catalogued as
chunks (:mod:`moepec.state.chunks`): every rank enumerates every rank's chunk keys (the
same list everywhere), holds the live local shard of its own, and on restore assembles
its local shard from whatever saved chunks overlap it, whatever layout saved them.
Expert ownership of a DTensor expert comes from its placement: a rank owns an expert
when its local shard holds any part of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from moepec.errors import ConfigError, StructureMismatchError
from moepec.keys import (
    CHUNK_MARK,
    EXPERT_PREFIX,
    OBJECT_PREFIX,
    chunk_key,
    expert_key,
    parse_key,
    split_chunk,
)
from moepec.state import chunks
from moepec.state.bytecopy import copy_all, copy_into, restore_threads
from moepec.state.chunks import Block, Layout
from moepec.state.experts import ExpertMap, canonical_expert_name, expert_slice
from moepec.state.object_state import ObjectState

log = logging.getLogger(__name__)

_AC_PREFIX = "_checkpoint_wrapped_module."
"""What torch's checkpoint_wrapper inserts in parameter names (and drops from state_dict keys)."""


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
        self.objects = ObjectState(optimizer, extra_state)
        """The small objects (RNG, optimizer hyper-parameters, extra_state)."""
        self.extra_state = self.objects.extra_state
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self._name_of = {id(p): n for n, p in self.params.items()}
        # Activation checkpointing's wrapper drops ``_checkpoint_wrapped_module.`` from
        # state_dict keys: such a key is its parameter, not a second, non-expert "buffer"
        # (a tied alias under another name, ``lm_head.weight``, stays one).
        unwrapped = {n.replace(_AC_PREFIX, ""): p for n, p in self.params.items()
                     if _AC_PREFIX in n}
        self.buffers = {n: b for n, b in model.state_dict(keep_vars=True).items()
                        if n not in self.params and unwrapped.get(n) is not b}
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in self._name_of:
                        raise ConfigError(
                            "the optimizer holds a parameter that is not in the model; "
                            "pass the optimizer built from model.parameters()")
        self._layouts: dict[tuple[str, int], Layout] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]] = {}
        """Chunk key -> (shape, dtype, holder ranks), for chunks of every rank."""
        self._owned: dict[int, set[int]] = {}
        """MoE layer with DTensor experts -> the experts this rank holds a part of."""
        self._init_sharded(ep_size)

    def _init_sharded(self, ep_size: int) -> None:
        """Layouts of DTensor parameters and the experts this rank holds of them."""
        for name, p in self.params.items():
            if chunks.is_sharded(p):
                self._layout(name, p)
        for lay in self.emap.layers:
            names = (lay.stacked.values() if lay.layout == "stacked"
                     else [f for m in lay.modules.values() for f in m.values()])
            sharded = [n for n in names if chunks.is_sharded(self.params[n])]
            if not sharded:
                continue
            if ep_size > 1:
                raise ConfigError(
                    f"the experts of {lay.prefix!r} are DTensors: their placement says which "
                    f"rank holds which expert; drop expert_parallel (it is for plain tensors)")
            owned = self._owned.setdefault(lay.index, set())
            for full in sharded:
                local = self._layout(full, self.params[full]).local
                if not all(local[1]):
                    continue
                if lay.layout == "stacked":
                    owned.update(range(local[0][0], local[0][0] + local[1][0]))
                else:
                    owned.add(self.emap.owner[full][1])

    # -- enumerating keys ------------------------------------------------------
    def non_expert_tensor_keys(self) -> list[str]:
        """Every non-expert tensor key of every rank (chunk keys for DTensors)."""
        keys: list[str] = []
        for n in self.emap.non_expert:
            keys += self._keys_of(f"model/{n}", n, self.params[n])
        for n, b in self.buffers.items():
            keys += self._keys_of(f"model/{n}", n, b)
        for pname, sk, v in self._optim_items():
            if not self._is_expert_state(pname, sk):
                keys += self._keys_of(f"optim/{pname}/{sk}", f"{pname}/{sk}", v)
        return keys

    def _keys_of(self, base: str, name: str, t: torch.Tensor, expert: int | None = None
                 ) -> list[str]:
        """``base`` for a plain tensor; for a DTensor the keys of every rank's chunk of it
        (of expert ``expert``'s slice for a stacked expert weight), recorded in _meta."""
        if not chunks.is_sharded(t):
            return [base]
        layout = self._layout(name, t)
        glob = layout.global_shape
        found: dict[Block, set[int]] = {}
        for block, holders in layout.blocks:
            if expert is not None:
                block = chunks.expert_block(block, expert)
                if block is None:
                    continue
            found.setdefault(block, set()).update(holders)
        if expert is not None:
            glob = glob[1:]
        keys = []
        for (offsets, shape), holders in found.items():
            key = chunk_key(base, offsets, shape, glob)
            self._meta[key] = (shape, t.dtype, tuple(sorted(holders)))
            keys.append(key)
        return keys

    def _layout(self, name: str, t: torch.Tensor) -> Layout:
        cached = self._layouts.get((name, id(t)))
        if cached is None:
            cached = self._layouts[(name, id(t))] = chunks.layout_of(t, name)
        return cached

    def holders(self, key: str) -> tuple[int, ...] | None:
        """The ranks holding chunk ``key`` of a DTensor; None for a plain tensor's key
        (replicated over data parallel ranks, or an expert of moepec's expert parallelism)."""
        meta = self._meta.get(key)
        return meta[2] if meta is not None else None

    def object_keys(self) -> list[str]:
        return self.objects.keys()

    def owns(self, layer: int, expert: int) -> bool:
        """Whether this rank holds global expert ``expert`` of ``layer`` (any part of it,
        for DTensor experts)."""
        owned = self._owned.get(layer)
        if owned is not None:
            return expert in owned
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
        if layer in self._owned:  # DTensor experts: every rank has every expert's params
            local = expert
        else:
            local = expert - self.offsets[layer] if self.owns(layer, expert) else 0
        names = lay.tensors_of(local)
        row = expert if lay.layout == "stacked" else None
        keys = []
        for short, full in names.items():
            canon = canonical_expert_name(lay, short, expert)
            if "model" in parts:
                keys += self._keys_of(expert_key(layer, expert, "model", canon), full,
                                      self.params[full], row)
            if "optim" in parts:
                for sk, v in self._param_state(full):
                    if self._is_expert_state(full, sk):
                        keys += self._keys_of(expert_key(layer, expert, "optim", f"{canon}/{sk}"),
                                              f"{full}/{sk}", v, row)
        return keys

    def nbytes(self, key: str) -> int:
        """Bytes of a tensor key, also for experts held by other ranks (alike by layer)
        and other ranks' chunks."""
        meta = self._meta.get(key)
        if meta is not None:
            return math.prod(meta[0]) * meta[1].itemsize
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
        """The live tensor (a view for expert slices; the local shard for a DTensor's
        chunk) behind a tensor key this rank holds; KeyError for any other."""
        base, chunk = split_chunk(key)
        live, block, glob = self._target(base)
        if chunk is None:
            if any(block[0]) or block[1] != glob:
                raise KeyError(f"{key}: this rank holds only a chunk of it")
        elif chunk[:2] != block or chunk[2] != glob:
            raise KeyError(f"{key}: this rank does not hold that chunk")
        return live

    def _target(self, base: str) -> tuple[torch.Tensor, Block, tuple[int, ...]]:
        """(live local tensor, its block, the global shape) of a whole-tensor key: the whole
        tensor for a plain one, the local shard for a DTensor. KeyError when this rank
        holds none of it (an expert of another rank, optimizer state not created yet)."""
        info = parse_key(base)
        if info.is_expert:
            lay = self.emap.layers[info.layer]
            rest = base.split("/", 4)[4]
            canon, sk = (rest, None) if info.part == "model" else rest.rsplit("/", 1)
            if info.layer in self._owned:
                if not self.owns(info.layer, info.expert):
                    raise KeyError(f"expert {info.expert} of layer {info.layer} is not held "
                                   f"by this rank")
                pname = self._expert_param(info.layer, canon)
                t = self.params[pname] if sk is None else self._state(pname)[sk]
                name = pname if sk is None else f"{pname}/{sk}"
                if not chunks.is_sharded(t):
                    return t.detach(), ((0,) * t.dim(), tuple(t.shape)), tuple(t.shape)
                layout = self._layout(name, t)
                local = t.to_local().detach()
                if lay.layout == "stacked":
                    block = chunks.expert_block(layout.local, info.expert)
                    if block is None:
                        raise KeyError(f"{base}: not held by this rank")
                    return (local[info.expert - layout.local[0][0]], block,
                            layout.global_shape[1:])
                return local, layout.local, layout.global_shape
            local = self._local_index(info.layer, info.expert)
            pname = self._expert_param(info.layer, canon)
            t = self.params[pname].detach() if sk is None else self._state(pname)[sk]
            t = expert_slice(t, lay, local)
            return t, ((0,) * t.dim(), tuple(t.shape)), tuple(t.shape)
        if info.part == "model":
            name = base[len("model/"):]
            t = self.params.get(name)
            t = t if t is not None else self.buffers[name]
        elif info.part == "optim":
            pname, sk = base[len("optim/"):].rsplit("/", 1)
            name = f"{pname}/{sk}"
            t = self._state(pname)[sk]
        else:
            raise KeyError(base)
        if chunks.is_sharded(t):
            layout = self._layout(name, t)
            return t.to_local().detach(), layout.local, layout.global_shape
        t = t.detach()
        return t, ((0,) * t.dim(), tuple(t.shape)), tuple(t.shape)

    def wants(self, key: str) -> bool:
        """Whether a restore on this rank needs saved ``key``: a non-expert key or one of an
        expert this rank holds, and of a chunk key only one that overlaps what this rank
        holds. Judged by the parameters (optimizer state follows its parameter's
        placement), so it works before a fresh optimizer has state."""
        if key.startswith(OBJECT_PREFIX):
            return True
        if CHUNK_MARK not in key:  # a whole tensor (a restore asks this of every key)
            info = parse_key(key)
            return not info.is_expert or self.owns(info.layer, info.expert)
        base, chunk = split_chunk(key)
        info = parse_key(base)
        if info.is_expert and not self.owns(info.layer, info.expert):
            return False
        try:
            _, block, glob = self._target(self._param_key(base))
        except KeyError:
            return True  # not in this model: load() reports it
        return glob != chunk[2] or chunks.overlap(block, chunk[:2]) is not None

    @staticmethod
    def _param_key(base: str) -> str:
        """The weight key whose placement the key ``base`` (weight or optimizer state)
        follows."""
        info = parse_key(base)
        if info.part != "optim":
            return base
        if info.is_expert:
            head, rest = base.split("/optim/", 1)
            return f"{head}/model/{rest.rsplit('/', 1)[0]}"
        return "model/" + base[len("optim/"):].rsplit("/", 1)[0]

    def capture_objects(self) -> dict[str, torch.Tensor]:
        """Encode every object key now (training thread, at snapshot time: the objects
        change during the next step). Raises ConfigError for a value moepec does not
        store (ObjectState.capture)."""
        return self.objects.capture()

    def read_target(self, key: str) -> torch.Tensor | None:
        """The live tensor a restore may read ``key`` into in place, or None (objects,
        experts of other ranks, optimizer state the optimizer does not have yet)."""
        if key.startswith(OBJECT_PREFIX):
            return None
        try:
            return self.tensor(key)
        except (KeyError, AssertionError):
            return None

    def ensure_optimizer_state(self, values: Mapping[str, torch.Tensor]) -> None:
        """Create missing optimizer state (a fresh optimizer has none) of the shapes and
        dtypes of the restored ``values`` (key -> tensor as read) of optim keys."""
        if self.optimizer is None:
            return
        for key, value in values.items():
            base, chunk = split_chunk(key) if CHUNK_MARK in key else (key, None)
            info = parse_key(base)
            if info.part != "optim":
                continue
            rest = base.split("/", 4)[4] if info.is_expert else base[len("optim/"):]
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
            dt, shape = value.dtype, value.shape
            # Per-element state (an expert's, a chunk's, or one of the parameter's shape)
            # takes the parameter's shape and placement; anything else is a plain tensor.
            if info.is_expert or chunk is not None or list(shape) == list(p.shape):
                state[sk] = torch.zeros_like(p.detach(), dtype=dt)
            else:
                state[sk] = torch.zeros(shape, dtype=dt, device="cpu")

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy restored values into the live state (training thread only).

        Every object is decoded and checked before anything is written, so a malformed
        one (CorruptCheckpointError) or a mismatched optimizer (StructureMismatchError)
        leaves the live state untouched."""
        objects = {k: self.objects.decode(k, v) for k, v in values.items()
                   if k.startswith(OBJECT_PREFIX)}
        plain, pieces = chunks.assembly(values, self._target)
        with torch.no_grad():
            # (not read in place already); on two threads: a restore copies hundreds of MB
            copy_all(((live, value) for live, value in plain
                      if live.data_ptr() != value.data_ptr() or live.shape != value.shape),
                     threads=restore_threads())
            for live, block, parts in pieces:
                for region, value, origin in parts:
                    dst = chunks.narrow(live, block[0], region)
                    src = chunks.narrow(value, origin, region)
                    if dst.data_ptr() != src.data_ptr():
                        copy_into(dst, src)
        for key, obj in objects.items():
            self.objects.apply(key, obj)

    # -- helpers ---------------------------------------------------------------
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
