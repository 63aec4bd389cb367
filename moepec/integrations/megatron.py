"""Megatron-Core: a ``dist_checkpointing`` backend ``("moepec", 1)`` that saves K of N
experts per MoE layer.

Importing this module registers the backend (save, async save, load) with Megatron's
strategy registry::

    import moepec.integrations.megatron  # registers ("moepec", 1), K = 1
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sd, f"{save}/iter_{it:07d}", sharded_strategy=("moepec", 1))
    state = dist_checkpointing.load(sd, f"{save}/iter_{it:07d}")  # no strategy argument

Every non-expert shard is written at every save; of each MoE layer's experts, K are,
chosen by the engine's schedule (``moepec.flat``: the same selection policies, K,
``full_every``, dynamic K and PLT ledger as ``CheckpointManager``; :func:`register`
takes the same field names). Expert identity comes from the sharded state dict itself:
the expert axis of SequentialMLP's (and GroupedMLP's factories': a shard of a rank's
local experts is cut into one per expert, at save and load alike)
``...experts.experts.*`` shards, or the per-expert keys ``...experts.<e>.*`` of
``metadata={'singleton_local_shards': True}``; optimizer state keyed by the parameter's
key (``optimizer.state.<name>.<param key>``: a plain optimizer, or the distributed
optimizer's ``fully_reshardable`` format) goes with its expert. The distributed
optimizer's ``dp_reshardable`` buckets lose which expert a value belongs to and are
refused. Each iteration folder is a moepec flat checkpoint (``moepec.store.flat``) whose
view names the sibling folders that hold older expert copies; ``load`` stitches each
expert's newest copy and reports it as a ``moepec.RestoreReport``
(:func:`last_load_report`: per-expert source steps, PLT in tokens from the routing
counts given to :func:`observe_routing` or counted by :func:`track_routing`);
``moepec verify SAVE_DIR`` says which folders each one still needs.

``ShardedObject`` s (e.g. ``_extra_state``) are stored as tagged JSON
(``moepec.state.objects``), an expert's with its expert. Megatron's own parts stay
Megatron's: the common state (``common.pt``, written and read by its ``torch`` common
strategy with ``torch.load``, weights_only by default in torch >= 2.6), and
``metadata.json`` (backend and version), written after moepec's manifest. A load may use
another sharding than the save's (TP, PP, EP, DP): each shard is cut from the saved shards
that overlap it (``moepec.flat.regions``), experts and their PLT accounting included. It
refuses, on every rank, what ``torch_dist`` refuses: another global shape, a key the
folder lacks (:mod:`moepec.integrations.megatron_checks`). A save without experts says so
once; ``moepec materialize`` turns a folder into a ``torch_dist`` checkpoint
(:mod:`moepec.integrations.megatron_export`). :func:`use_for_torch_dist`: moepec for
Megatron-LM's ``--ckpt-format torch_dist`` (:mod:`moepec.integrations.megatron_switch`).
:func:`snapshot` (with ``register(ram_dir=...)``): the RAM level, next to the training
step; a load of the newest folder takes it when newer (:mod:`.megatron_ram`);
:func:`snapshot_megatron_lm`: the same in Megatron-LM's ``train()`` (its ``--load``
resumes at the snapshot: :mod:`.megatron_lm`).
:func:`complete_next_save`: the run's last save writes every expert (Megatron-LM's own
last saves are told apart: ``megatron_switch.megatron_lm_stops_at``).
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

import moepec
from moepec.flat import (
    FlatFrontEnd,
    FlatPlan,
    Unit,
    decode_object,
    split_folder,
    write_rank,
)
from moepec.integrations.megatron_checks import (
    ENUMS,
    OBJECT,
    check_version,
    overlap_key,
    pad,
    refusals,
    refuse_on_every_rank,
)
from moepec.integrations.megatron_keys import (  # public: the routing ones
    expert_unit,
    moe_layer_index,
    moe_layer_names,
    object_unit,
    routed_tokens,
)
from moepec.integrations.megatron_ram import MegatronRam, Pieces, Shard
from moepec.integrations.megatron_ram import empty as _empty
from moepec.integrations.megatron_ram import shards as _shards
from moepec.integrations.megatron_ram import value as _value
from moepec.integrations.megatron_switch import (
    answer,
    answering,
    megatron_lm_stops_at,
    restore,
)

BACKEND = "moepec"
VERSION = 1
_BUCKETS = "optimizer.distributed."
_ITER = re.compile(r"(\d+)$")
_door: list[FlatFrontEnd] = []
_ram = MegatronRam(lambda: _door[-1])
snapshot = _ram.snapshot  # public: the RAM level (moepec.integrations.megatron_ram)
snapshot_megatron_lm = _ram.snapshot_megatron_lm  # public: the same, in Megatron-LM
close_ram = _ram.close  # public: at the clean end of a run, this rank's slots removed


def _front() -> FlatFrontEnd:
    """The front end the registered strategies share (the last :func:`register`)."""
    return _door[-1]


def complete_next_save() -> None:
    """Make this process's next moepec save complete: every expert of every MoE layer
    (K = N once; then the rotation goes on), for a run's last save (end of training,
    Megatron-LM's ``--exit-signal-handler``), whose being last the backend cannot see.
    Any rank, any thread (a signal handler's too), no collective: the save's plan
    carries a mark on one rank to every rank."""
    _front().complete_next_save()


def observe_routing(counts: Any) -> None:
    """Add this rank's tokens routed per (MoE layer L, global expert E) since the last
    call: a 2-D tensor or nested sequence, row L the whole model's L-th MoE layer
    (:func:`moe_layer_index`; with pipeline parallelism, rows of other stages' layers
    empty or zero). Summed over ranks at the next save; drives load-aware
    selection, dynamic K and the PLT of :func:`last_load_report`. :func:`track_routing`
    calls it from Megatron's routers."""
    _front().observe_routing(counts)


def last_load_report() -> moepec.RestoreReport | None:
    """What the last ``dist_checkpointing.load`` of a moepec folder in this process
    restored: ``sources["L/E"]`` (the step and folder of each expert's copy), ``lost``
    and ``plt`` (paper Eq. 7, from the routing counts the saves recorded)."""
    return _ram.report or _front().last_load_report()  # from RAM, or storage's


def _unit_of(x: Shard) -> Unit | None:
    return expert_unit(x) if isinstance(x, ShardedTensor) else object_unit(x)


def _main_shards(sharded_state_dict: Any) -> dict[str, Shard]:
    """This rank's main-replica shards by flat key; refuses dp_reshardable."""
    out: dict[str, Shard] = {}
    for key, sh in _shards(sharded_state_dict).items():
        if sh.key.startswith(_BUCKETS):
            raise CheckpointingException(
                "moepec: the distributed optimizer's 'dp_reshardable' format stores flat "
                "buckets that lose which expert a value belongs to; save with "
                "metadata={'distrib_optim_sharding_type': 'fully_reshardable'}")
        if is_main_replica(sh.replica_id) and not _empty(sh):
            out[key] = sh
    return out


def _stage(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The consistent snapshot: a host copy of every tensor to write, taken when the
    request is scheduled (training may change the live tensors right after)."""
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


class MoepecSaveStrategy(AsyncSaveShardedStrategy):
    """Saves non-expert shards and K experts per layer into a moepec flat checkpoint,
    on the engine's schedule (``moepec.flat``).

    ``async_save`` (all ranks, training thread) gathers every rank's keys, picks the
    experts, and returns an ``AsyncRequest`` whose preload copies the chosen tensors to
    host memory (what the training loop waits for), whose async function writes this
    rank's files (any process; no collective), and whose finalize function (all ranks)
    has rank 0 commit the manifest once every rank's record exists.
    """

    def __init__(self, front: FlatFrontEnd, backend: str = BACKEND,
                 version: int = VERSION) -> None:
        super().__init__(backend, version)
        self.front = front
        self.told_no_experts = False
        """Whether rank 0 said that a save found no experts (once per registration)."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # as JSON in moepec's files, K of N experts' too: nothing pickled

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike
                   ) -> AsyncRequest:
        check_version()
        root, name = split_folder(checkpoint_dir)
        m = _ITER.search(name)
        step = int(m[1]) if m else -1
        if megatron_lm_stops_at(step):  # Megatron-LM's last save before it exits
            self.front.complete_next_save()
        try:  # a rank's error must reach every rank: they all wait in the plan's gather
            shards = _main_shards(sharded_state_dict)
            values = {k: _value(sh) for k, sh in shards.items()
                      if isinstance(sh, ShardedObject)}
            units, error = {k: _unit_of(sh) for k, sh in shards.items()}, None
        except (CheckpointingException, moepec.MoepecError) as exc:
            shards, values, units, error = {}, {}, {}, str(exc).removeprefix("moepec: ")
        try:
            plan = self.front.plan_save(root, name, step, units, error)
        except moepec.MoepecError as exc:
            raise CheckpointingException(f"moepec: {exc}") from exc
        if not plan.layers:
            self._no_experts(root)
        tensors = {k: values[k] if k in values else shards[k].data
                   for k in shards if k in plan.written}
        folder = os.path.join(root, name)
        return AsyncRequest(write_rank, (folder, tensors, dist.get_rank()),
                            [functools.partial(self._finalize, plan)],
                            preload_fn=functools.partial(_stage, tensors))

    def _no_experts(self, root: str) -> None:
        """Never full in silence: rank 0 says once that no shard is an expert's.

        A ``UserWarning`` (shown on stderr by default), not a log record: the caller can
        act on it (the logging HOWTO's rule for ``warnings.warn``), as Megatron's own
        ``torch_dist`` strategy warns, and a stock save logs nothing, which Megatron's
        tests assert (``caplog.text == ''`` around a save and its loads)."""
        if not self.told_no_experts and dist.get_rank() == 0:
            warnings.warn(
                f"moepec: no expert shards in the sharded state dict saved to {root} "
                f"(looked for keys with an 'experts.' part: MoELayer's "
                f"'...experts.experts.*' and '...experts.<e>.*' with "
                f"singleton_local_shards); every save writes everything: build the MoE "
                f"layers with Megatron's MoELayer (its experts under '.experts'), or save a "
                f"dense model with torch_dist", UserWarning, stacklevel=2)
        self.told_no_experts = True

    def _finalize(self, plan: FlatPlan) -> None:
        """All ranks, after every rank's writer finished (Megatron joins each rank's
        writer on that rank only; the front end meets before reading the records)."""
        try:
            self.front.finish_save(plan)
        except moepec.MoepecError as exc:
            raise CheckpointingException(f"moepec: {exc}") from exc


class MoepecLoadStrategy(LoadShardedStrategy):
    """Loads a moepec folder: every requested shard from the folder its view names
    (each expert's newest copy), checksums verified. All ranks call ``load``; each
    reads only its own shards; no collective."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"moepec loads backend {BACKEND!r}, not "
                                         f"{loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"moepec reads backend version {VERSION}, not "
                                         f"{loaded_version}: use the moepec that wrote it")

    def __init__(self, front: FlatFrontEnd) -> None:
        super().__init__()
        self.front = front

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike) -> Any:
        """All ranks. Refuses on every rank (:mod:`~moepec.integrations.megatron_checks`)
        what ``torch_dist`` refuses: a key the folder lacks, a tensor of another global
        shape unless it allows the mismatch (then it gets what overlaps, zeros elsewhere)."""
        check_version()
        root, name = split_folder(checkpoint_dir)
        pieces = Pieces(sharded_state_dict)  # one shard per expert (views of stacked ones)
        shards = pieces.by_key
        saved: dict[str, tuple[tuple[int, ...], str]] = {}
        known = None
        try:  # the folder's manifests, read once for the checks and the load
            known = self.front.folder(root, name)
            saved = self.front.shapes(root, name, known)
            objects = [k for k in self.front.keys(root, name, known) if k.startswith(OBJECT)]
            reasons = refusals(shards, saved, objects)
        except moepec.MoepecError as exc:
            reasons = [str(exc)]
        refuse_on_every_rank(reasons, f"{root}/{name}")
        assert known is not None  # else every rank refused
        reads = {k: _to_read(k, sh, saved) for k, sh in shards.items()}
        try:
            targets = _ram.load(root, name, list(dict.fromkeys(  # RAM when newer
                r for r in reads.values() if r is not None)), into={  # one copy
                k: sh.data for k, sh in shards.items() if reads[k] == k}, known=known)
        except moepec.MoepecError as exc:
            raise CheckpointingException(f"moepec: {exc}") from exc
        loaded = {id(sh): _loaded(sh, k, reads[k], targets, saved, name)
                  for k, sh in shards.items()}
        return dict_list_map_inplace(lambda x: pieces.whole(x, loaded), sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike) -> Any:
        """Every tensor of the folder as a ShardedTensor without data or sharding (its
        global shape and dtype), by its key: what ``load_plain_tensors`` and Megatron's
        tools read first. From moepec's manifests; reads no tensor."""
        return self._metadata(checkpoint_dir)[0]

    def _metadata(self, checkpoint_dir: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
        """The tensors' metadata and every key, from one read of the manifests."""
        root, name = split_folder(checkpoint_dir)
        try:
            known = self.front.folder(root, name)
            shapes = self.front.shapes(root, name, known)
            keys = self.front.keys(root, name, known)
        except moepec.MoepecError as exc:
            raise CheckpointingException(f"moepec: {exc}") from exc
        return {key: ShardedTensor.from_rank_offsets(
                    key, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                ).without_data() for key, (shape, dtype) in shapes.items()}, keys

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> Any:
        """:meth:`load_tensors_metadata` and the folder's sharded objects (without
        data), by sharded key; one read of the manifests."""
        out, keys = self._metadata(checkpoint_dir)
        for key in keys:
            if key.startswith(OBJECT):
                obj = ShardedObject.empty_from_unique_key(key.removeprefix(OBJECT))
                out[obj.unique_key] = obj
        return out


def _to_read(key: str, sh: Shard, saved: Mapping[str, tuple[tuple[int, ...], str]]
             ) -> str | None:
    """The flat key a shard is read from: its own; for an ``allow_shape_mismatch`` tensor
    saved with another global shape, the part of its box the saved tensor covers; None
    when nothing is read (an empty shard, or no overlap)."""
    if _empty(sh):
        return None
    if isinstance(sh, ShardedTensor) and sh.allow_shape_mismatch \
            and tuple(sh.global_shape) != saved[sh.key][0]:
        return overlap_key(sh, saved[sh.key][0])
    return key


def _loaded(sh: Shard, key: str, read: str | None, targets: Mapping[str, torch.Tensor],
            saved: Mapping[str, tuple[tuple[int, ...], str]], name: str) -> Any:
    """A shard's loaded value from what was read (:func:`_to_read`)."""
    if isinstance(sh, ShardedObject):
        return decode_object(targets[key], f"{name}:{key}", enums=ENUMS)
    if _empty(sh):
        return _into(sh, torch.empty(0, dtype=sh.dtype))
    if read != key:  # allow_shape_mismatch: what overlaps, zeros elsewhere
        return _into(sh, pad(sh, targets.get(read), getattr(torch, saved[sh.key][1])))
    return _into(sh, targets[key])


def _into(sh: ShardedTensor, value: torch.Tensor) -> torch.Tensor:
    """The loaded value in the requested shard's tensor (in place where it has one of
    the same shape and dtype)."""
    data = sh.data
    if isinstance(data, torch.Tensor) and data.shape == value.shape \
            and data.dtype == value.dtype:
        with torch.no_grad():
            data.copy_(value)
        return data
    return value.view(sh.local_shape) if sh.flattened_range is None else value


def register(**fields: Any) -> None:
    """(Re-)register the ``("moepec", 1)`` backend with Megatron's strategy registry, on
    a fresh front end with ``fields``: the CheckpointConfig fields that apply
    (``k_persist``, ``selection``, ``full_every``, ``plt_budget``, ``dynamic_k``,
    ``dynamic_k_down``; same names, defaults and validation), and ``ram_dir`` (``"auto"``,
    a folder, or None: in the process) to turn the RAM level on (:func:`snapshot`; loads
    of the newest folder take RAM when newer), with ``ram_replicas`` (0, 1, or None: 1
    when the ranks span nodes; as ``CheckpointConfig``'s: each slot kept on the next
    node too, so a rank whose node was lost loads from RAM). Called at import with the defaults (K = 1,
    sequential, no RAM level). Raises moepec.ConfigError for a bad or foreign field."""
    front = FlatFrontEnd(**{k: v for k, v in fields.items()
                            if k not in ("ram_dir", "ram_replicas", "hooks")})
    _ram.configure(fields)  # after every field is checked: a refusal changes nothing
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                              MoepecSaveStrategy(front))
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                              MoepecLoadStrategy(front))
    _door[:] = [front]


def use_for_torch_dist(**fields: Any) -> None:
    """Turn moepec on for ``--ckpt-format torch_dist`` (all ranks, before the first save):
    every default ``torch_dist`` save strategy lookup of this process (Megatron-LM's
    ``save_checkpoint``, ``dist_checkpointing.save`` with no strategy) answers the moepec
    one, which Megatron-LM wraps for its flags as its own. ``fields`` as :func:`register`
    (none: the registration in place); idempotent for the same fields. Loads need no
    switch: they follow the folder's ``metadata.json`` (``torch_dist`` ones stay stock)."""
    switch = answering(StrategyAction.SAVE_SHARDED)
    if switch is None or switch.how != fields:
        if fields:
            register(**fields)
        answer(StrategyAction.SAVE_SHARDED, ("torch_dist", 1), (BACKEND, VERSION), fields)


def stop_using_for_torch_dist() -> None:
    """Undo :func:`use_for_torch_dist` (no-op where off): ``torch_dist`` again."""
    restore(StrategyAction.SAVE_SHARDED)


def track_routing(model: torch.nn.Module) -> list[Any]:
    """Count every routed token of ``model`` for moepec: a forward hook on each MoE
    router (no fork; the hook reads the ``(probs, routing_map)`` it returns). Layer L is
    the router's MoE layer among the whole model's (:func:`moe_layer_index`), so a
    pipeline stage's routers count at their place in the model, as its saves key their
    experts. Counts are summed on the routers' device and read once per save
    (:meth:`FlatFrontEnd.observe_layer`). Returns
    the hook handles (``handle.remove()`` stops counting)."""
    names = moe_layer_names(model)
    modules = dict(model.named_modules())
    handles = []
    for local, name in enumerate(names):
        router = modules[name]
        index = moe_layer_index(router, local)

        def hook(_mod: Any, _inp: Any, out: Any, index: int = index) -> None:
            routing_map = out[1] if isinstance(out, tuple) else out
            _front().observe_layer(index, routed_tokens(routing_map.detach()))
        handles.append(router.register_forward_hook(hook))
    return handles


register()
