"""The DeepSpeed door's part of the RAM level (:func:`moepec.integrations.deepspeed.snapshot`):
the files a save would write, snapshotted as flat keys through the flat front end's RAM
level (:class:`moepec.flat.RamLevel`, which does the rest), and the tag DeepSpeed is handed
for a load of the newest state from it. Methods of
:class:`~moepec.integrations.deepspeed.PecCheckpointEngine` (this class is one of its
bases, which sets the fields they use: ``fields``, ``front``, ``_engine``, ``_loading``,
``_rng``, ``experts()``)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

import moepec
from moepec.errors import CheckpointError, ConfigError
from moepec.flat import RamFound, RamLevel, check_ram_dir, check_ram_replicas
from moepec.integrations.ds_experts import module_replica, optimizer_index, zero3_fragments
from moepec.integrations.ds_export import read_latest
from moepec.integrations.ds_files import file_keys, join_file, location, split_file

log = logging.getLogger(__name__)

RNG = "moepec_rng"
"""The prefix of each rank's torch RNG state key (saved and snapshotted with the files)."""


def snapshot(engine: Any, save_dir: str) -> bool:
    """All ranks, after ``engine.step()``: the frequent level of the two-level checkpoint.
    When due (every ``snapshot_every`` global steps, a field of the ``"moepec"`` section
    that turns the RAM tier on), copy this rank's whole training state (the files a save of
    ``save_dir`` would write, every expert) into a RAM slot in node-local shared memory
    (``ram_dir``, default ``"auto"``); blocks until it is copied (the slot's commit,
    header last, follows on the copy thread). A restarted
    worker's ``engine.load_checkpoint(save_dir)`` (tag None) takes it when it is newer
    than the storage save ``latest`` names. Returns whether a snapshot was taken.
    Raises ConfigError for an engine without the field; CheckpointError when it failed."""
    door = getattr(engine, "_moepec_door", None)  # attached when the engine was built
    every = 0 if door is None else door.fields.get("snapshot_every", 0)
    if not every:
        raise ConfigError('snapshot(engine, save_dir) needs "snapshot_every" (steps >= 1) in '
                          'the DeepSpeed config\'s "moepec" section (or attach(engine, '
                          'snapshot_every=N, ...))')
    step = int(engine.global_steps)
    if step % every:
        return False
    door.snapshotting = os.path.abspath(save_dir)
    try:  # DeepSpeed's own save hands the files to the door, which keeps them in RAM
        engine.save_checkpoint(save_dir, f"moepec_ram_step{step}", save_latest=False)
    finally:
        door.snapshotting = None
    return True


def check_ram_fields(fields: dict[str, Any]) -> None:
    """Raise ConfigError, in one line, for a RAM level field of the section that is wrong."""
    every = fields.get("snapshot_every", 0)
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ConfigError(f"snapshot_every must be a whole number of steps >= 0 (got "
                          f"{every!r}); 0 (the default) turns the RAM tier off")
    check_ram_dir(fields.get("ram_dir", "auto"))
    check_ram_replicas(fields.get("ram_replicas"), fields.get("ram_dir", "auto"))


class RamFiles:
    """The RAM level's state and methods of the door: DeepSpeed's files as flat keys."""

    fields: dict[str, Any]
    front: Any
    _engine: Any
    _loading: tuple[str, str] | None
    _rng: torch.Tensor | None

    def experts(self) -> dict[str, Any]:
        raise NotImplementedError

    def _init_ram(self) -> None:
        self.snapshotting: str | None = None
        """Inside :func:`snapshot`: its save directory (files go to RAM, not storage)."""
        self.level = RamLevel(lambda: self.front)
        self.level.configure(bool(self.fields.get("snapshot_every")),
                             self.fields.get("ram_dir", "auto"),
                             ram_replicas=self.fields.get("ram_replicas"))
        self._from_ram: RamFound | None = None
        """The load in progress from RAM."""

    def close_ram(self, unlink: bool) -> None:
        """Drop the RAM tiers' mappings; with ``unlink`` remove this rank's slots."""
        self.level.close(unlink)

    def snapshot_files(self, info: Any, files: dict[str, Any]) -> bool:
        """All ranks, inside :func:`snapshot`: this rank's keys of ``files`` (every one it
        holds, not only those it would write) into a RAM slot."""
        assert self.snapshotting is not None

        def tensors() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for name, sd in files.items():
                out |= split_file(name, sd, self.experts(), optimizer_index(self._engine),
                                  zero3_fragments(self._engine)).tensors
            out |= module_replica(self._engine, info, files, self.experts()).tensors
            return out | {f"{RNG}/rank_{dist.get_rank()}/torch": torch.get_rng_state()}
        self.level.snapshot(self.snapshotting, int(self._engine.global_steps), tensors)
        return True

    def choose_ram(self, load_dir: str, tag: str | None) -> str | None:
        """All ranks, before a load of the newest state of ``load_dir`` (``tag``: what
        :meth:`committed_tag` chose, None for ``latest``): when every rank holds a RAM
        snapshot newer than that storage save (and of its lineage), the tag to
        hand DeepSpeed (that save's; its files are read from RAM), else None."""
        if not self.level.on:
            return None
        named = tag if tag is not None else read_latest(load_dir)
        root, where = location(load_dir, named) if named is not None else (None, None)
        ram = self.level.ram(load_dir)
        head = None if root is None or root != ram.root else ram.head(where)
        found = self.level.newest(load_dir, where or "", head,
                                  lambda key: key.split("/", 1)[0])
        if found is None or head is None:  # no moepec save: RAM is not read
            return None
        self._from_ram = found
        return named

    def load_ram(self, name: str) -> tuple[Any, moepec.RestoreReport | None]:
        """File ``name`` of the load from RAM in progress, and at its first file the
        load's report (``ram``; the lineage of the storage head is taken over)."""
        found = self._from_ram
        assert found is not None
        report = None
        if self._loading != found[:2]:
            report = self.level.take(found)
            self._loading = (found.root, found.name)
            rng = f"{RNG}/rank_{dist.get_rank()}/torch"
            self._rng = found.tensors[rng].clone() if rng in found.tensors else None
        keys = file_keys(name, found.tensors)
        if not keys:
            raise CheckpointError(f"the RAM snapshot of step {found.step} has no {name} on "
                                  f"this rank (another parallel layout?); load a tag "
                                  f"explicitly: engine.load_checkpoint(dir, tag=...)")
        return join_file(name, self.level.copies(found, keys)), report

    def settle_ram(self, load_dir: str) -> None:
        """All ranks, after a load: keep the RAM snapshot loaded (if any) and invalidate
        the slots of later steps (any, after a storage load: an abandoned future)."""
        found, self._from_ram = self._from_ram, None
        self.level.settle(load_dir, None if found is None else found.step)
