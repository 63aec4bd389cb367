"""DeepSpeed: PEC for ``engine.save_checkpoint`` / ``engine.load_checkpoint``, driven by a
``"moepec"`` section of the DeepSpeed config.

Import this module once (before or after ``deepspeed.initialize``), and every engine
whose config has the section saves K of N experts per MoE layer::

    import moepec.integrations.deepspeed  # noqa: F401
    config = {..., "zero_optimization": {"stage": 2}, "moepec": {"k_persist": 2}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    engine.save_checkpoint(save_dir)       # a PEC save: tag folder, `latest`, as before
    engine.load_checkpoint(save_dir)       # a stitched load of `latest`
    moepec.integrations.deepspeed.last_load_report()   # a moepec.RestoreReport

or, without the section, :func:`attach` ``(engine, k_persist=2)``. The section takes the
``CheckpointConfig`` fields that apply (``moepec.flat.FLAT_FIELDS``), ``async_persist``,
``expert_spec`` (an ``ExpertSpec``'s fields), and the RAM level's ``snapshot_every``,
``ram_dir`` and ``ram_replicas`` (as ``CheckpointConfig``'s): with them,
:func:`snapshot` ``(engine, save_dir)`` after ``engine.step()`` copies every rank's state into shared memory (:mod:`moepec.flat.ram`), and a load of
``latest`` after a worker restart takes it when it is newer than storage's. The door is attached when the engine is
built (a section's mistakes, and a model with no experts found, are said then).

The experts: DeepSpeed's own ``deepspeed.moe.layer.MoE`` layers, else the one expert
discovery of every door (``moepec.state.experts``: a Hugging Face model's stacked or
module-list experts; shared experts and routers are non-expert state), with routing
counts from their routers (:mod:`moepec.integrations.ds_experts`). The door is a
DeepSpeed ``CheckpointEngine`` in the engine's ``checkpoint_engine`` seam: DeepSpeed
still decides what each file holds and names it; the door turns one save's files into
flat keys (:mod:`moepec.integrations.ds_files`: each expert's weights or rows, its parts
of ZeRO's flat partitions or ZeRO-0's per-parameter state) and saves them on the flat
front end (``moepec.flat``): K experts per MoE layer, all non-expert state every time,
writes spread over the ranks that hold each key. A load stitches each file from the
experts' newest copies; each rank's torch RNG state goes with the save. Nothing on the
load path unpickles; a tag saved without moepec loads as DeepSpeed loads it.

Supported: ZeRO stages 0-2 (native MoE, any expert parallelism) and 0-3 (other models),
fp32 and bf16. Refused in one line: native MoE at ZeRO-3, AutoEP, pipeline engines.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine

import moepec
from moepec.errors import CheckpointError, ConfigError, MoepecError
from moepec.flat import FLAT_FIELDS, FlatFrontEnd, write_rank
from moepec.integrations.ds_experts import (
    RouterCounts,
    check_supported,
    config_section,
    discover_experts,
    expert_params,
    module_replica,
    native_layers,
    no_experts_message,
    optimizer_index,
    spec_of,
    zero3_fragments,
)
from moepec.integrations.ds_files import (
    file_keys,
    is_stub,
    join_file,
    location,
    split_file,
    stub,
)
from moepec.integrations.ds_final import complete_next_save as complete_next_save  # public
from moepec.integrations.ds_ram import RNG as _RNG
from moepec.integrations.ds_ram import RamFiles, check_ram_fields
from moepec.integrations.ds_ram import snapshot as snapshot  # public: the RAM level
from moepec.integrations.ds_tags import MANIFEST as _MANIFEST
from moepec.integrations.ds_tags import TagChoice
from moepec.integrations.ds_writers import owned_keys
from moepec.state.experts import ExpertMap

log = logging.getLogger(__name__)

SECTION = "moepec"
_last: list[moepec.RestoreReport] = []
_doors: weakref.WeakSet[PecCheckpointEngine] = weakref.WeakSet()


def last_load_report() -> moepec.RestoreReport | None:
    """What the last ``load_checkpoint`` of a moepec tag in this process restored:
    ``sources["L/E"]["step"]`` (the global step of the save each expert came from; L the
    MoE layer in ``named_modules()`` order, E the global expert), ``lost``, ``plt``."""
    return _last[-1] if _last else None


def wait() -> None:
    """Block until this rank's share of every save this process has in flight is
    written (the last rank to finish commits); raise CheckpointError for one that
    failed. A load waits on every rank (and a barrier) first; so does the next save and
    the interpreter's exit."""
    for door in list(_doors):
        door.wait()


def _settle_before_load(door: PecCheckpointEngine) -> None:
    """All ranks, before a load: every save in flight written (committed or failed), and
    every rank told of a failure (the load goes on: it reads committed tags only)."""
    failed = None
    try:
        wait()
    except CheckpointError as exc:
        failed = str(exc)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, failed)
    door.front.settle()
    for r, e in enumerate(every):
        if e is not None and dist.get_rank() == 0:
            log.warning("moepec: a save in flight failed before this load (rank %d): %s",
                        r, e)


def _wait_at_exit() -> None:
    # An uncaught exception (the interpreter printed it) keeps the RAM snapshots for the
    # worker torchrun restarts; a clean exit removes them, as the manager's clean close.
    clean = getattr(sys, "last_value", None) is None
    for door in list(_doors):
        try:
            door.wait()
        except CheckpointError as exc:
            log.error("moepec: at exit: %s", exc)
        door.close_ram(unlink=clean)


atexit.register(_wait_at_exit)


def attach(engine: DeepSpeedEngine, **fields: Any) -> PecCheckpointEngine:
    """Make ``engine``'s checkpoints PEC checkpoints (``fields``: as the config section).
    Idempotent for the same fields. Raises ConfigError for a field that does not apply
    or a model the door does not support."""
    door = getattr(engine, "_moepec_door", None)
    if door is not None:
        if door.fields != fields:
            raise ConfigError("this engine has moepec attached with other settings")
        return door
    unknown = sorted(set(fields) - set(FLAT_FIELDS) - set(_DOOR_FIELDS))
    if unknown:
        raise ConfigError(f'{", ".join(unknown)}: not a field of the DeepSpeed config\'s '
                          f'"{SECTION}" section; the ones that apply: '
                          f'{", ".join(FLAT_FIELDS + _DOOR_FIELDS)}')
    check_supported(engine)
    check_ram_fields(fields)
    async_persist = fields.get("async_persist", True)
    if not isinstance(async_persist, bool):
        raise ConfigError(f"async_persist must be true or false (got {async_persist!r})")
    emap = None if native_layers(engine.module) else \
        discover_experts(engine.module, spec_of(fields.get("expert_spec")))
    if emap is not None and not emap.layers and (
            not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("%s", no_experts_message(type(engine.module).__name__, emap, SECTION))
    door = PecCheckpointEngine(engine, FlatFrontEnd(**{k: v for k, v in fields.items()
                                                      if k not in _DOOR_FIELDS}), fields, emap)
    engine._moepec_door = door
    engine.checkpoint_engine = door
    _doors.add(door)
    return door


_DOOR_FIELDS = ("async_persist", "expert_spec", "snapshot_every", "ram_dir", "ram_replicas")


def _door_of(engine: DeepSpeedEngine) -> PecCheckpointEngine | None:
    door = getattr(engine, "_moepec_door", None)
    if door is None and (section := config_section(engine, SECTION)) is not None:
        door = attach(engine, **section)
    return door


class PecCheckpointEngine(RamFiles, TagChoice, CheckpointEngine):
    """The engine's checkpoint engine: gathers one save's files and commits them as one
    PEC folder; loads each file stitched from its keys."""

    def __init__(self, engine: DeepSpeedEngine, front: FlatFrontEnd,
                 fields: dict[str, Any], emap: ExpertMap | None = None) -> None:
        super().__init__()
        self.name = "moepec"
        self.fields = dict(fields)
        self.async_persist = bool(fields.get("async_persist", True))
        self.front = front
        self._writer: threading.Thread | None = None
        self._error: str | None = None
        self._inner = engine.checkpoint_engine
        self._engine = engine
        self._info: Any = None
        self._files: dict[str, Any] = {}
        self._loading: tuple[str, str] | None = None
        self._rng: torch.Tensor | None = None
        self.emap = emap
        """Discovery's experts (None for DeepSpeed's own MoE layers)."""
        layers = native_layers(engine.module)
        self._layer = {id(m): i for i, m in enumerate(layers)}
        self._hooks = [m.register_forward_hook(self._count) for m in layers]
        self.routers = None if emap is None else \
            RouterCounts(engine.module, emap, front.observe_layer)
        """Routing counts of discovered MoE layers (their routers' forward hooks)."""
        self._experts: dict[str, Any] | None = None
        self.saving = False
        """Inside ``engine.save_checkpoint`` (every rank plans the save, files or not)."""
        self.last_save: tuple[str, str, int] | None = None
        """(save directory, tag, global step) of this engine's last save."""
        self._init_ram()

    # -- routing ---------------------------------------------------------------------
    def _count(self, module: Any, _inputs: Any, output: Any) -> None:
        """A MoE layer's forward in training: its tokens per global expert."""
        if not module.training or not isinstance(output, tuple) or len(output) < 3:
            return
        self.front.observe_layer(self._layer[id(module)], output[2])

    # -- saving ----------------------------------------------------------------------
    def experts(self) -> dict[str, Any]:
        """This engine's expert parameters (``ds_experts.expert_params``), found once."""
        if self._experts is None:
            self._experts = expert_params(self._engine, self.emap)
        return self._experts

    def create(self, info: Any) -> None:
        self._info, self._files = info, {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self.snapshotting is not None and self._in_tag(os.path.join(path, "x")):
            return  # a RAM snapshot's tag folder is never made
        self._inner.makedirs(path, exist_ok=exist_ok)

    def _in_tag(self, path: str) -> bool:
        info = self._info
        return info is not None and os.path.dirname(os.path.abspath(path)) == \
            os.path.abspath(os.path.join(info.save_dir, info.tag))

    def save(self, state_dict: Any, path: str) -> None:
        if self._in_tag(path):
            self._files[os.path.basename(path)] = state_dict
        else:  # not a checkpoint tag (e.g. save_16bit_model): DeepSpeed's own write
            self._inner.save(state_dict, path)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        # Every expert-data-parallel rank hands over its copy of the experts; the door
        # picks one writer per expert, spread over those ranks.
        return True

    def commit(self, info: Any) -> bool:
        """All ranks, at the end of ``save_checkpoint``: plan the save (collective), put
        a stub at each file's path, write this rank's keys (in the background with
        ``async_persist``: the tensors are DeepSpeed's clones, a consistent snapshot),
        and commit once every rank's share is written."""
        if self.snapshotting is not None:
            files, self._files = self._files, {}
            return self.snapshot_files(info, files)
        if not self.saving:  # not a save_checkpoint (save_16bit_model's file is written)
            return self._inner.commit(info)
        files, self._files = self._files, {}
        error = self._previous_error()
        dist.barrier()  # every rank's previous write finished: it committed or failed
        self.front.settle()
        root, where = location(info.save_dir, info.tag)
        tensors, units = {}, {}
        try:
            for name, sd in files.items():
                split = split_file(name, sd, self.experts(), optimizer_index(self._engine),
                                   zero3_fragments(self._engine))
                tensors |= split.tensors
                units |= split.units
            replica = module_replica(self._engine, info, files, self.experts())
            tensors |= replica.tensors
            units |= replica.units
        except MoepecError as exc:
            error = error or str(exc)
        rank = dist.get_rank()
        tensors[f"{_RNG}/rank_{rank}/torch"] = torch.get_rng_state()
        units[f"{_RNG}/rank_{rank}/torch"] = None
        mine = owned_keys(units, tensors)
        plan = self.front.plan_save(root, where, int(self._engine.global_steps), mine, error)
        share = {k: tensors[k].cpu() for k in mine if k in plan.written}
        tag_folder = os.path.join(os.path.abspath(info.save_dir), info.tag)
        for name in files:  # DeepSpeed's load looks for its files by name
            stub(os.path.join(tag_folder, name))
        folder = os.path.join(root, where)
        if not self.async_persist:
            write_rank(folder, share, rank)
            self.front.finish_save(plan)
            return True
        # The snapshot: DeepSpeed clones module state, not ZeRO's optimizer partitions.
        share = {k: v.clone() for k, v in share.items()}
        self._writer = threading.Thread(target=self._write, args=(plan, folder, share, rank),
                                        name="moepec-deepspeed-writer", daemon=True)
        self._writer.start()
        return True

    def _write(self, plan: Any, folder: str, share: dict[str, torch.Tensor],
               rank: int) -> None:
        try:
            write_rank(folder, share, rank)
            self.front.commit_when_written(plan)
        except Exception as exc:  # reported at the next save, load or wait()
            self._error = f"{folder} not committed: {exc}"
            log.error("moepec: %s", self._error)

    def wait(self) -> None:
        """Block until this rank's save in flight is written (and committed, if this rank
        finished last); raise CheckpointError if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(error)

    def _previous_error(self) -> str | None:
        try:
            self.wait()
        except CheckpointError as exc:
            return f"the previous save failed ({exc})"
        return None

    # -- loading ---------------------------------------------------------------------
    def load(self, path: str, map_location: Any = None) -> Any:
        folder, name = os.path.split(os.path.abspath(path))
        root, tag = location(*os.path.split(folder))
        if self._from_ram is not None and self._from_ram[:2] == (root, tag):
            state, report = self.load_ram(name)
            if report is not None:
                _last.append(report)
            return state
        if not os.path.exists(os.path.join(root, tag, _MANIFEST)):
            if is_stub(path):
                raise CheckpointError(f"{folder} is a moepec save that never committed (it "
                                      f"was interrupted); load another tag")
            return self._inner.load(path, map_location=map_location)
        view = self.front.keys(root, tag)
        keys = file_keys(name, view)
        if not keys:
            raise CheckpointError(f"{folder} has no {name} (saved with another "
                                  f"parallel layout?)")
        if self._loading != (root, tag):
            tensors, report = self.front.load(root, tag, keys + self._rng_key(view),
                                              agree=True)
            self._loading = (root, tag)
            self._rng = tensors.pop(self._rng_key(view)[0], None) \
                if self._rng_key(view) else None
            _last.append(report)
        else:
            tensors = self.front.read(root, tag, keys)
        return join_file(name, tensors)

    @staticmethod
    def _rng_key(view: Any) -> list[str]:
        key = f"{_RNG}/rank_{dist.get_rank()}/torch"
        return [key] if key in view else []

    def after_load(self, load_dir: str) -> None:
        """Restore this rank's RNG state, if the tag loaded had it; keep the RAM snapshot
        loaded (if any) and invalidate the slots of later steps (any, after a storage
        load: an abandoned future)."""
        if self._rng is not None:
            torch.set_rng_state(self._rng)
        self._rng, self._loading = None, None
        self.settle_ram(load_dir)


_ORIGINAL: dict[str, Any] = {}
"""DeepSpeedEngine's own methods, wrapped by :func:`_install`."""


def _save_checkpoint(self: DeepSpeedEngine, save_dir: str, tag: Any = None,
                     *args: Any, **kwargs: Any) -> Any:
    door = _door_of(self)
    if door is None:
        return _ORIGINAL["save_checkpoint"](self, save_dir, tag, *args, **kwargs)
    # The same tag again at the same step (the Trainer at ZeRO-3 saves twice per
    # checkpoint when it cannot gather the 16-bit weights): already saved, nothing to add.
    this = (os.path.abspath(save_dir), str(tag or f"global_step{self.global_steps}"),
            int(self.global_steps))
    if door.last_save == this:
        return True
    door.saving = True
    try:
        out = _ORIGINAL["save_checkpoint"](self, save_dir, tag, *args, **kwargs)
    finally:
        door.saving = False
    door.last_save = this
    return out


def _load_checkpoint(self: DeepSpeedEngine, load_dir: str, tag: str | None = None,
                     *args: Any, **kwargs: Any) -> Any:
    door = _door_of(self)
    if door is not None:
        _settle_before_load(door)
        newest = tag is None
        tag = door.committed_tag(load_dir, tag)
        if newest:  # the newest state: RAM when newer than storage (an explicit tag: never)
            tag = door.choose_ram(load_dir, tag) or tag
    try:
        out = _ORIGINAL["load_checkpoint"](self, load_dir, tag, *args, **kwargs)
    finally:
        if door is not None:
            door.last_save = None  # a state loaded: the next save of a step is new again
            door.after_load(load_dir)
    return out


def _ckpt_names(self: DeepSpeedEngine, checkpoints_path: str, tag: str) -> Any:
    # DeepSpeed finds a tag's model files by glob; a moepec tag lists them itself.
    door = getattr(self, "_moepec_door", None)
    pattern = os.path.basename(self._get_ckpt_name(
        checkpoints_path, tag, mp_placeholder="*",
        pp_placeholder="0" if self.load_universal_checkpoint() else None))
    found = None if door is None else door.model_files(checkpoints_path, tag, pattern)
    return _ORIGINAL["_get_all_ckpt_names"](self, checkpoints_path, tag) if found is None \
        else found


def _init(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL["__init__"](self, *args, **kwargs)
    _door_of(self)  # at deepspeed.initialize: a section's mistakes, no experts found


def _install() -> None:
    """Route every engine's save and load through its door when its config has one."""
    if _ORIGINAL:
        return
    for name, wrapper in (("save_checkpoint", _save_checkpoint),
                          ("load_checkpoint", _load_checkpoint),
                          ("_get_all_ckpt_names", _ckpt_names), ("__init__", _init)):
        _ORIGINAL[name] = original = getattr(DeepSpeedEngine, name)
        setattr(DeepSpeedEngine, name, functools.wraps(original)(wrapper))


_install()
