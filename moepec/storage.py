"""Reading and writing checkpoints through torch.distributed.checkpoint on fsspec paths.

Layout under the checkpoint root ``PATH``::

    PATH/ckpt-000007-step00000064/      one plain DCP checkpoint (data files + .metadata)
    PATH/ckpt-000007-step00000064/moepec.json   the manifest: written last; its presence
                                                 is the commit (DESIGN.md, commit rule)

Local paths use DCP's FileSystemWriter (fsync'd files); any other fsspec URL
(``s3://``, ``memory://``, ...) uses DCP's FsspecWriter. By default items are stored as
raw tensor bytes (``moepec.dcp_raw``: the same DCP metadata, no torch.save framing per
item); ``serialization="torch_save"`` writes stock DCP that any DCP reader loads. Reads
handle both. The manifest is written
atomically: on a local disk as a temporary file, fsync, rename (and the directory
fsync'd); on object stores as one PUT of the final object, which appears whole
or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.planner import SavePlan

from moepec import dcp_raw
from moepec.config import SERIALIZATIONS
from moepec.dcp_raw import (
    RawFileSystemReader,
    RawFileSystemWriter,
    RawFsspecReader,
    RawFsspecWriter,
)
from moepec.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST_NAME = "moepec.json"
_NAME_RE = re.compile(r"^ckpt-(\d{6,})-step(\d{8,})$")


def checkpoint_name(seq: int, step: int) -> str:
    return f"ckpt-{seq:06d}-step{step:08d}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    m = _NAME_RE.match(name)
    return (int(m[1]), int(m[2])) if m else None


class Storage:
    """One checkpoint root on any fsspec filesystem.

    Thread-safety: methods may be called from the persist worker thread; they
    hold no shared mutable state besides the fsspec filesystem object.
    """

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None,
                 serialization: str = "raw") -> None:
        if serialization not in SERIALIZATIONS:
            raise CheckpointError(f"unknown serialization {serialization!r}; choose one of "
                                  f"{', '.join(SERIALIZATIONS)}")
        if serialization == "raw" and not dcp_raw.SUPPORTED:
            log.warning("serialization='raw' needs a torch whose DCP records per-item "
                        "descriptors (torch %s does not); writing torch_save instead. "
                        "Upgrade torch to get the faster raw format.", torch.__version__)
            serialization = "torch_save"
        self.url = str(path).rstrip("/")
        self.options = dict(storage_options or {})
        self.serialization = serialization
        self.fs, self.root = url_to_fs(self.url, **self.options)
        self.local = "file" in _protocols(self.fs)

    # -- paths -----------------------------------------------------------------
    def _dir(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        """The DCP checkpoint_id of a checkpoint (local path or URL)."""
        if self.local:
            return self._dir(name)
        return f"{self.url}/{name}"

    def check_writable(self) -> None:
        """Fail early with a clear message if the root cannot be written."""
        probe = f"{self.root}/.moepec-write-probe"
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except Exception as exc:  # noqa: BLE001 - report any storage failure the same way
            raise CheckpointError(
                f"cannot write to checkpoint path {self.url!r} ({type(exc).__name__}: {exc}); "
                f"choose a writable --ckpt-dir or fix its permissions/credentials") from exc

    # -- data ------------------------------------------------------------------
    def write(self, name: str, tensors: Mapping[str, torch.Tensor],
              process_group: dist.ProcessGroup | None = None) -> None:
        """Write one rank's tensors of checkpoint ``name`` as a DCP checkpoint.

        Collective over ``process_group`` when torch.distributed is initialised
        (every rank of the group calls it, each with its own disjoint keys);
        otherwise single-process. Raises what the storage raised.
        """
        url = self.url_of(name)
        raw = self.serialization == "raw"
        if self.local:
            writer = (RawFileSystemWriter if raw else FileSystemWriter)(
                url, sync_files=True, overwrite=True)
        else:
            writer = (RawFsspecWriter if raw else FsspecWriter)(
                url, sync_files=False, overwrite=True, **self.options)
        distributed = dist.is_available() and dist.is_initialized()
        dcp.save({_ROOT: dict(tensors)}, storage_writer=writer, planner=_SavePlanner(),
                 process_group=process_group if distributed else None,
                 no_dist=not distributed)

    def read(self, name: str, targets: Mapping[str, torch.Tensor]) -> None:
        """Load ``targets`` (key -> preallocated tensor) from checkpoint ``name``.

        Reads only; every rank reads what it needs on its own (no collective). Reads
        raw and torch.save-framed items alike.
        """
        url = self.url_of(name)
        reader = (RawFileSystemReader(url) if self.local
                  else RawFsspecReader(url, **self.options))
        dcp.load(dict(targets), storage_reader=reader, no_dist=True)

    # -- manifests -------------------------------------------------------------
    def write_manifest(self, name: str, manifest: Mapping[str, Any]) -> None:
        """Commit checkpoint ``name`` by writing its manifest atomically."""
        # Compact: json's C encoder runs only without indent (5x faster for the ~1 MB
        # manifest of a large model). `moepec inspect` is the human-readable view.
        data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        final = f"{self._dir(name)}/{MANIFEST_NAME}"
        if self.local:
            tmp = final + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            dir_fd = os.open(self._dir(name), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        else:
            # One PUT: object stores make the object visible whole or not at all.
            self.fs.pipe_file(final, data)

    def read_manifest(self, name: str) -> dict[str, Any]:
        path = f"{self._dir(name)}/{MANIFEST_NAME}"
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{name} has no manifest (not committed)") from exc
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"manifest of {self.url}/{name} is not valid JSON ({exc}); the checkpoint "
                f"is damaged: delete that folder or run `moepec verify {self.url}`") from exc

    def list_checkpoints(self) -> list[tuple[str, bool]]:
        """(name, committed) for every checkpoint folder, oldest first by sequence."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if parse_checkpoint_name(name):
                found.append(name)
        found.sort(key=lambda n: parse_checkpoint_name(n))
        return [(n, self.fs.exists(f"{self._dir(n)}/{MANIFEST_NAME}")) for n in found]

    def committed(self) -> list[str]:
        return [n for n, ok in self.list_checkpoints() if ok]

    def delete(self, name: str) -> None:
        """Remove a checkpoint: the manifest first (un-commit), then the data."""
        manifest = f"{self._dir(name)}/{MANIFEST_NAME}"
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        if self.fs.exists(self._dir(name)):
            self.fs.rm(self._dir(name), recursive=True)

    def data_bytes(self, name: str) -> int:
        """Bytes of the data files of a checkpoint (everything but the manifest)."""
        total = 0
        for path, info in self.fs.find(self._dir(name), detail=True).items():
            if not path.endswith(MANIFEST_NAME):
                total += int(info.get("size") or 0)
        return total


_ROOT = "moepec"
"""Storage.write hands dcp.save ``{_ROOT: tensors}``; _SavePlanner unwraps it."""


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, cut to what moepec's flat dict of whole tensors needs.

    - ``dcp.save`` wraps every top-level key in a logging and Stateful check (~20 us per
      key, 12 ms per checkpoint of 600 items). It gets one key, ``_ROOT``, and this
      planner plans the dict under it: the item names on disk are moepec's keys, as if
      the dict had been passed directly (nothing to flatten: it is flat already).
    - The global plan skips DCP's index-hint rewrite, which copies every write item twice
      (~40 us per item). The hint says which chunk of a sharded tensor an item is;
      moepec writes every tensor whole, as one chunk, and a read matches an index by name
      and offsets, not by the hint.
    Ranks' keys are disjoint by construction (moepec.rank_share); a key written by two
    ranks still fails here (DCP's global plan refuses a second whole-tensor item), and so
    does any tensor item that is not one whole tensor.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict[_ROOT], storage_meta, is_coordinator)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        for key, md in metadata.state_dict_metadata.items():
            chunks = getattr(md, "chunks", None)
            if chunks is not None and (len(chunks) != 1 or any(chunks[0].offsets)
                                       or chunks[0].sizes != md.size):
                raise CheckpointError(f"{key}: moepec writes whole tensors, got {chunks}")
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
