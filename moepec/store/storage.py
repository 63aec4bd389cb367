"""Reading and writing checkpoints through torch.distributed.checkpoint on fsspec paths.

Layout under the checkpoint root ``PATH``::

    PATH/ckpt-000007-step00000064-<run>/      one plain DCP checkpoint (data files +
                                               .metadata), of run <run> (moepec.keys)
    PATH/ckpt-000007-step00000064-<run>/moepec.json   the manifest: written last; its
                                               presence is the commit (DESIGN.md)

Local paths use DCP's FileSystemWriter (fsync'd files); any other fsspec URL
(``s3://``, ``memory://``, ...) uses DCP's FsspecWriter. By default items are stored as
raw tensor bytes (``moepec.store.dcp_raw``: the same DCP metadata, no torch.save framing per
item); ``serialization="torch_save"`` writes stock DCP that any DCP reader loads. Reads
handle both. The chunks of a sharded tensor (chunk keys, moepec.keys) are DCP shards of
that tensor, so a DCP reader reshards them onto any layout. The manifest is written
atomically: on a local disk as a temporary file, fsync, rename (and the directory
fsync'd); on object stores as one PUT of the final object, which appears whole
or not at all.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from moepec.errors import CheckpointError, ManifestError, check_choice
from moepec.keys import (
    MANIFEST_NAME,
    is_legacy_name,
    parse_checkpoint_name,
)
from moepec.store import dcp_raw
from moepec.store import manifest as mf
from moepec.store.dcp_planner import ROOT_KEY, KeySavePlanner, keys_of
from moepec.store.dcp_raw import (
    RAW_DESCRIPTOR,
    RawFileSystemWriter,
    RawFsspecWriter,
)
from moepec.store.items import Encoding, Item, Serialization
from moepec.store.manifest import Manifest
from moepec.store.reader import CAN_MAP, confined, map_items, read_items

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Location:
    """Where one item's bytes are: its data file inside the checkpoint folder."""

    file: str
    offset: int
    length: int
    encoding: Encoding


class Storage:
    """One checkpoint root on any fsspec filesystem.

    Thread-safety: methods may be called from the persist worker thread; they
    hold no shared mutable state besides the fsspec filesystem object.
    """

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None,
                 serialization: str = Serialization.RAW) -> None:
        serialization = check_choice(Serialization, serialization, "serialization",
                                     CheckpointError)
        if serialization == Serialization.RAW and not dcp_raw.SUPPORTED:
            log.warning("serialization='raw' needs a torch whose DCP records per-item "
                        "descriptors (torch %s does not); writing torch_save instead. "
                        "Upgrade torch to get the faster raw format.", torch.__version__)
            serialization = Serialization.TORCH_SAVE
        self.url = str(path).rstrip("/")
        self.options = dict(storage_options or {})
        self.serialization = serialization
        self.fs, self.root = _filesystem(self.url, self.options)
        self.local = "file" in _protocols(self.fs)
        self._warned_legacy = False
        if self.local and os.path.isfile(self.root):
            raise CheckpointError(f"{self.url} is a file; a checkpoint root is a folder (or an "
                                  f"fsspec URL)")

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
        # Named for this process: two runs probing one root never remove each other's.
        probe = f"{self.root}/.moepec-write-probe-{os.getpid()}-{os.urandom(4).hex()}"
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
              process_group: dist.ProcessGroup | None = None) -> dict[str, Location]:
        """Write one rank's tensors of checkpoint ``name`` as a DCP checkpoint; returns
        where every item of every rank landed (key -> Location).

        Collective over ``process_group`` when torch.distributed is initialised
        (every rank of the group calls it, each with its own disjoint keys; the chunk
        keys of one tensor, from all ranks together, tile it exactly);
        otherwise single-process. Raises what the storage raised.
        """
        url = self.url_of(name)
        raw = self.serialization == Serialization.RAW
        if self.local:
            writer = (RawFileSystemWriter if raw else FileSystemWriter)(
                url, sync_files=True, overwrite=True)
        else:
            writer = (RawFsspecWriter if raw else FsspecWriter)(
                url, sync_files=False, overwrite=True, **self.options)
        distributed = dist.is_available() and dist.is_initialized()
        with contextlib.nullcontext() if distributed else single_process_dcp():
            metadata = dcp.save({ROOT_KEY: dict(tensors)}, storage_writer=writer,
                                planner=KeySavePlanner(),
                                process_group=process_group if distributed else None,
                                no_dist=not distributed)
        keys = keys_of(metadata)
        return {keys[index]: Location(
            info.relative_path, info.offset, info.length,
            Encoding.RAW if RAW_DESCRIPTOR in (getattr(info, "transform_descriptors", None)
                                               or ()) else Encoding.TORCH_SAVE)
            for index, info in metadata.storage_data.items()}

    def read(self, name: str, targets: Mapping[str, torch.Tensor],
             items: Mapping[str, Item]) -> None:
        """Load ``targets`` (key -> preallocated tensor) from checkpoint ``name`` at the
        locations its manifest's ``items`` record (moepec.store.reader: no unpickling,
        paths confined to the root). Reads only; no collective; any thread."""
        read_items(self.fs, (self.root, name), targets, items, local=self.local)

    @property
    def can_map(self) -> bool:
        """Whether :meth:`map` works here (a local root on a POSIX system)."""
        return self.local and CAN_MAP

    def map(self, name: str, keys: Sequence[str], items: Mapping[str, Item],
            verify: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
        """``keys`` of checkpoint ``name`` as tensors over private mappings of its data
        files, and (``verify``) the keys failing their checksums (local roots only:
        moepec.store.reader.map_items). Any thread."""
        if not self.can_map:
            raise CheckpointError(f"{self.url}: only a local root can be mapped (on POSIX)")
        return map_items((self.root, name), keys, items, verify)

    # -- manifests -------------------------------------------------------------
    def write_manifest(self, manifest: Manifest) -> None:
        """Commit checkpoint ``manifest.name`` by writing its manifest atomically. Never
        overwrites an existing manifest (CheckpointError: the name is taken).

        Called by the coordinator (rank 0) only, after every rank's data is written.
        """
        name = manifest.name
        final = f"{self._dir(name)}/{MANIFEST_NAME}"
        ref = None
        if not isinstance(manifest.view, mf.StoredView):
            # The view first, in a file named by its checksum (so it never replaces another
            # manifest's view); the manifest that names it is the commit.
            if self.fs.exists(final):
                raise CheckpointError(f"{self.url}/{name} is committed already; a commit "
                                      f"never overwrites a manifest")
            blob, ref = mf.encode_view(manifest.view)
            self._write_file(f"{self._dir(name)}/{ref.file}", blob)
        # Compact: json's C encoder runs only without indent (5x faster for the ~1 MB
        # manifest of a large model). `moepec inspect` is the human-readable view.
        data = json.dumps(manifest.to_json(ref), sort_keys=True,
                          separators=(",", ":")).encode()
        if self.local:
            tmp = final + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)  # unlike rename, fails when the manifest exists
            except FileExistsError:
                raise CheckpointError(f"{self.url}/{name} is committed already; a commit "
                                      f"never overwrites a manifest") from None
            finally:
                os.unlink(tmp)
            dir_fd = os.open(self._dir(name), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        else:
            # One conditional PUT (If-None-Match on S3): the object appears whole or not at
            # all, and never replaces an existing manifest.
            try:
                self.fs.pipe_file(final, data, mode="create")
            except FileExistsError:
                raise CheckpointError(f"{self.url}/{name} is committed already; a commit "
                                      f"never overwrites a manifest") from None

    def read_manifest(self, name: str) -> Manifest:
        """The manifest of checkpoint ``name``. Raises CheckpointError when it has none,
        ManifestError when it cannot be used (ManifestFormatError: a newer format)."""
        path = f"{self._dir(name)}/{MANIFEST_NAME}"
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{name} has no manifest (not committed)") from exc
        where = f"{self.url}/{name}"
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(
                f"manifest of {where} is not valid JSON ({exc}); the checkpoint "
                f"is damaged: delete that folder or run `moepec verify {self.url}`") from exc
        return Manifest.from_json(data, where, lambda ref: self._read_view(name, ref))

    def _read_view(self, name: str, ref: mf.ViewRef) -> bytes:
        """The bytes of a manifest's view file (at most one more than it claims: a longer
        file fails the length check without being read whole). Any thread."""
        path = confined(self.root, name, ref.file, local=self.local)
        with (open(path, "rb") if self.local else self.fs.open(path, "rb")) as f:
            return f.read(ref.length + 1)

    def _write_file(self, path: str, data: bytes) -> None:
        """Write a small file whole (fsync'd on a local disk)."""
        if self.local:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(path, data)

    def list_checkpoints(self) -> list[tuple[str, bool]]:
        """(name, committed) for every checkpoint folder, oldest first by sequence."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found, legacy = [], []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if parse_checkpoint_name(name):
                found.append(name)
            elif is_legacy_name(name):
                legacy.append(name)
        if legacy and not self._warned_legacy:
            self._warned_legacy = True
            log.warning("%s holds %d checkpoint(s) written by a pre-release moepec (e.g. %s); "
                        "not readable by this version: they are ignored, never deleted",
                        self.url, len(legacy), sorted(legacy)[-1])
        found.sort(key=parse_checkpoint_name)
        return [(n, self.fs.exists(f"{self._dir(n)}/{MANIFEST_NAME}")) for n in found]

    def is_committed(self, name: str) -> bool:
        """Whether checkpoint ``name`` has its manifest."""
        return self.fs.exists(f"{self._dir(name)}/{MANIFEST_NAME}")

    def committed(self) -> list[str]:
        """Names of the committed checkpoints, oldest first."""
        return [n for n, ok in self.list_checkpoints() if ok]

    def delete(self, name: str) -> None:
        """Remove a checkpoint: the manifest first (un-commit), then the data. A
        checkpoint folder that is a symlink loses the link only: nothing outside the
        root is ever deleted."""
        if parse_checkpoint_name(name) is None:
            raise CheckpointError(f"{name!r} is not a checkpoint name; nothing deleted")
        folder = self._dir(name)
        if self.local and os.path.islink(folder):
            os.unlink(folder)
            return
        manifest = f"{folder}/{MANIFEST_NAME}"
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        if self.fs.exists(folder):
            self.fs.rm(folder, recursive=True)

    def data_bytes(self, name: str) -> int:
        """Bytes of the data files of a checkpoint (everything but the manifest)."""
        total = 0
        if self.local and os.path.islink(self._dir(name)):
            return 0  # not ours to measure: it points outside the root
        if self.local:  # one scandir, not fsspec's per-file info calls
            with os.scandir(self._dir(name)) as entries:
                return sum(e.stat().st_size for e in entries
                           if e.name != MANIFEST_NAME and e.is_file())
        for path, info in self.fs.find(self._dir(name), detail=True).items():
            if not path.endswith(MANIFEST_NAME):
                total += int(info.get("size") or 0)
        return total


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside: parsing manifests (and restoring from them) allocates
    many small containers, and in a training process (a large heap) the collections they
    trigger took 10x the parse itself (0.38 s against 0.035 s for 64 manifests,
    measured). What runs inside makes no reference cycles worth collecting early; the
    caller's setting is restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SINGLE_PROCESS = (r"torch\.distributed is .*assuming the intent is to (save|load) in a single "
                   r"process")
"""DCP's UserWarning for a one-process save or load (worded alike from torch 2.4 to 2.13)."""


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Around our own one-process ``dcp.save`` / ``dcp.load``: silences exactly DCP's
    "torch.distributed is disabled ..., assuming the intent is to save in a single process"
    UserWarning, which torch raises at every call even with ``no_dist=True`` (the argument
    that says one process is the intent), so there is no argument that avoids it.

    Not ``warnings.catch_warnings()``: that saves and restores the whole global filter list
    and ``showwarning``, so on the persist thread it could undo a filter or a warnings
    recorder the training thread set meanwhile. This adds one filter and removes that one
    filter again, once the last thread inside has left (warnings merges identical
    filters into one entry, so each thread removing "its" filter would unfilter the
    others); any thread may use it."""
    with _quiet_lock:
        if _quiet_users[0] == 0:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        _quiet_users[0] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users[0] -= 1
            if _quiet_users[0] == 0:
                for item in [f for f in warnings.filters if f[0] == "ignore"
                             and f[2] is UserWarning and f[1] is not None
                             and f[1].pattern == _SINGLE_PROCESS]:
                    with contextlib.suppress(ValueError):  # another thread reset the list
                        warnings.filters.remove(item)
                # As warnings.filterwarnings does after a change: registries re-check.
                getattr(warnings, "_filters_mutated", lambda: None)()


_quiet_lock = threading.Lock()
_quiet_users = [0]
"""Threads inside :func:`single_process_dcp` (the filter is process-wide, so is this)."""


_PACKAGES = {"s3": "moepec[s3] (s3fs)", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
             "abfs": "adlfs"}


def _filesystem(url: str, options: Mapping[str, Any]):
    """fsspec's filesystem and path for ``url``; CheckpointError naming the fix when the
    protocol is unknown or its package is missing."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        return url_to_fs(url, **options)
    except ImportError as exc:
        package = _PACKAGES.get(protocol, "the fsspec implementation of that protocol")
        raise CheckpointError(f"{url}: {protocol}:// needs {package}: pip install "
                              f"{package.split(' ')[0]!r} ({exc})") from None
    except ValueError as exc:
        raise CheckpointError(f"{url}: {exc}; use a local path or an fsspec URL such as "
                              f"s3://bucket/run or memory://run") from None
    except TypeError as exc:
        raise CheckpointError(f"{url}: the storage options do not fit this filesystem "
                              f"({exc})") from None


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
