"""The storage interface: the contract a backend honours, and the checkpoint layout on it.

Layout under the checkpoint root ``PATH``::

    PATH/ckpt-000007-step00000064-<run>/      one plain DCP checkpoint (data files +
                                               .metadata), of run <run> (moepec.keys)
    PATH/ckpt-000007-step00000064-<run>/view-<xxh3>.json, items-<xxh3>.json   its
                                               side files: the view, the non-expert items
                                               (written before the manifest, which names
                                               them with their lengths and checksums)
    PATH/ckpt-000007-step00000064-<run>/moepec.json   the manifest: written last, by an
                                               exclusive create; its presence is the commit
    PATH/moepec.lease, PATH/recoveries/        the root's lease (store.lease) and the
                                               recovery records (recovery.records)

By default items are stored as raw tensor bytes (``moepec.store.dcp_raw``: the same DCP
metadata, no torch.save framing per item); ``serialization="torch_save"`` writes stock
DCP that any DCP reader loads. Reads handle both. The chunks of a sharded tensor (chunk
keys, moepec.keys) are DCP shards of that tensor, so a DCP reader reshards them onto any
layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import split_protocol, url_to_fs
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.storage import StorageWriter

from moepec.errors import CheckpointError, CorruptCheckpointError, ManifestError, check_choice
from moepec.keys import MANIFEST_NAME, is_legacy_name, parse_checkpoint_name
from moepec.store import dcp_raw
from moepec.store import manifest as mf
from moepec.store.checksum import Verifier
from moepec.store.dcp_planner import ROOT_KEY, KeySavePlanner, StartedIndex, keys_of
from moepec.store.dcp_raw import RAW_DESCRIPTOR
from moepec.store.items import Encoding, Item, Serialization, parse_json
from moepec.store.manifest import Manifest
from moepec.store.quiet import single_process_dcp

log = logging.getLogger(__name__)

LOCAL_PROTOCOLS = (None, "file", "local")
"""fsspec protocols of the local file system (None: a plain path)."""


@dataclass(frozen=True, slots=True)
class Location:
    """Where one item's bytes are: its data file inside the checkpoint folder."""

    file: str
    offset: int
    length: int
    encoding: Encoding


class Storage(ABC):
    """One checkpoint root. ``Storage(path, storage_options)`` opens it with the backend
    that serves ``path`` (:meth:`serves`): ``LocalStorage`` for a local path or
    ``file://`` URL, ``FsspecStorage`` for any other fsspec URL (``s3://``, ``gs://``,
    ``memory://``, ...). A new backend is one subclass (its :meth:`serves` and the
    abstract methods) and one entry in tests/test_storage_contract.py.

    The contract every backend honours (the contract tests check it on each):

    - **Paths** are relative to the root: ``/``-separated plain names. A method given
      ``..``, ``.``, an empty part or an absolute path raises CheckpointError before it
      touches storage, so no name leads out of the root. On a local disk a link is the
      one way out: :meth:`remove` removes a link, never what it points to, and refuses a
      path through a link that leaves the root; data and view files are read only where
      they resolve inside the root (:meth:`confined`, moepec.store.reader.confined).
    - **Atomic small-file write** (:meth:`put`): a reader sees the old file (or none)
      or the new one whole, never a part, and once put returns the file survives a
      crash. Locally: temporary name, fsync, rename, folder fsync
      (moepec.store.atomic.write_atomic); on an object store: one PUT.
    - **Exclusive create** (:meth:`create`): atomic as put, and it raises
      FileExistsError, changing nothing, when the path exists, also when two processes
      create it at once. The commit rests on it: a commit never overwrites a manifest,
      and of two runs only one takes a free lease. Locally: a hard link of the fsync'd
      temporary file; on an object store: a conditional PUT (S3's ``If-None-Match``). A
      store that cannot create exclusively cannot hold moepec checkpoints.
    - **Read after write**: once put or create returned, :meth:`get` and :meth:`exists`
      of that path see it from any process, and once :meth:`remove` returned they do not.
    - **Listings may lag** (eventually consistent, e.g. a cached listing): :meth:`listdir`
      may miss a name just written or show one just removed. A listing only proposes
      names: whether a checkpoint is committed is decided by its manifest (exists, get),
      and removing what is already gone is no error.
    - **Data** goes through DCP's writer for the backend (:meth:`writer`); a checkpoint's
      data files are written before its manifest and never after it.

    Who calls what: every rank opens the root; :meth:`write` is collective; rank 0 alone
    commits (:meth:`write_manifest`), deletes, holds the lease (moepec.store.lease: put,
    create, get, remove) and writes recovery records; any rank reads. Every method blocks until storage answered. Methods may be
    called from the persist worker thread: a backend holds no mutable state but its
    filesystem object (and a warn-once flag).
    """

    local: ClassVar[bool]
    """Whether the root is a folder of this host (data files can be mapped)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Storage:
        if cls is Storage:  # opening the interface opens the backend serving the path
            path = args[0] if args else kwargs.get("path")
            if path is None:
                raise TypeError("Storage() needs the path of a checkpoint root")
            cls = backend_for(str(path))
        return super().__new__(cls)

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None,
                 serialization: str = Serialization.RAW) -> None:
        self.url = str(path).rstrip("/")
        if not self.serves(self.url):
            raise CheckpointError(f"{type(self).__name__} does not serve {self.url}; open "
                                  f"it with Storage(path)")
        self.options = dict(storage_options or {})
        self.serialization = _serialization(serialization)
        self.fs, self.root = _filesystem(self.url, self.options)
        """fsspec's filesystem and the root's path on it."""
        self._warned_legacy = False
        self._index = StartedIndex()

    # -- the backend: small files, listings, DCP -----------------------------------------
    @classmethod
    @abstractmethod
    def serves(cls, url: str) -> bool:
        """Whether this backend is the one for ``url`` (exactly one backend serves a
        URL). Pure."""

    @abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write the small file ``path`` whole and atomically, replacing any file there
        (the contract's atomic small-file write). The folder must exist on a local disk
        (:meth:`makedirs`). Rank 0 (lease, records, views); blocks until durable."""

    @abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Create the small file ``path`` whole and atomically; FileExistsError, nothing
        changed, when it exists (the contract's exclusive create: commits and the lease).
        Rank 0; blocks until durable."""

    @abstractmethod
    def get(self, path: str, limit: int | None = None) -> bytes:
        """The bytes of file ``path`` (at most ``limit``); FileNotFoundError when there
        is none. Any rank, any thread; blocks."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (read after write: strongly consistent). Any rank."""

    @abstractmethod
    def listdir(self, path: str = "") -> list[str]:
        """The names directly under folder ``path`` ("" is the root), in no order; []
        when there is no such folder. May lag writes (see the contract). Any rank."""

    @abstractmethod
    def makedirs(self, path: str = "") -> None:
        """Make folder ``path`` ("" is the root) and its parents, if missing (no-op on
        object stores, which have no folders). Any rank; blocks."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove file or folder ``path`` with all it holds; nothing when it is gone. A
        local ``path`` that is a link loses the link only; one reached through a link out
        of the root is refused (CheckpointError). Rank 0; blocks."""

    @abstractmethod
    def file_sizes(self, path: str) -> dict[str, int]:
        """Name -> bytes of the files directly in folder ``path`` ({} when there is no
        such folder, or it is a link out of the root). Any rank; blocks."""

    @abstractmethod
    def writer(self, name: str, *, raw: bool) -> StorageWriter:
        """DCP's storage writer for checkpoint folder ``name`` (``raw``: the raw-bytes
        writer of moepec.store.dcp_raw). Every rank, inside :meth:`write`."""

    @abstractmethod
    def read(self, name: str, targets: Mapping[str, torch.Tensor],
             items: Mapping[str, Item]) -> None:
        """Load ``targets`` (key -> preallocated tensor) from checkpoint ``name`` at the
        locations its manifest's ``items`` record (moepec.store.reader: no unpickling,
        paths confined to the root). Reads only; no collective; any thread."""

    def confined(self, path: str) -> str:
        """The backend's path of ``path``, refusing (CheckpointError) any that is not
        plain names under the root; a local backend also refuses one whose resolved path
        leaves the root. Pure but for a local backend's link lookups."""
        return self._full(path)

    @property
    def can_map(self) -> bool:
        """Whether :meth:`map` works here (a local root on a POSIX system)."""
        return False

    def map(self, name: str, keys: Sequence[str], items: Mapping[str, Item],
            verify: bool | Verifier = False) -> tuple[dict[str, torch.Tensor], list[str]]:
        """``keys`` of checkpoint ``name`` as tensors over private mappings of its data
        files, and (``verify``) the keys failing their checksums, or with a Verifier
        those found here, the mapped items' checks handed to it (moepec.store.reader.
        map_items). Only where :attr:`can_map`; any thread."""
        raise CheckpointError(f"{self.url}: only a local root can be mapped (on POSIX)")

    def _full(self, path: str) -> str:
        """``root/path`` for a path of plain names (CheckpointError for anything else)."""
        parts = path.split("/")
        if any(p in ("", ".", "..") or "\\" in p for p in parts):
            raise CheckpointError(f"{path!r} is not a path inside the checkpoint root "
                                  f"{self.url}; nothing read, written or deleted")
        return f"{self.root}/{path}"

    def _folder(self, path: str) -> str:
        """:meth:`_full`, where "" is the root itself."""
        return self.root if path == "" else self._full(path)

    # -- checkpoints, on the backend -----------------------------------------------------
    def check_writable(self) -> None:
        """Fail early with a clear message if the root cannot be written (rank 0, at the
        first save; blocks)."""
        # Named for this process: two runs probing one root never remove each other's.
        probe = f".moepec-write-probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            self.makedirs()
            self._probe(probe)
        except Exception as exc:  # noqa: BLE001 - report any storage failure the same way
            raise CheckpointError(
                f"cannot write to checkpoint path {self.url!r} ({type(exc).__name__}: {exc}); "
                f"choose a writable --ckpt-dir or fix its permissions/credentials") from exc

    def _probe(self, path: str) -> None:
        """Write a small file at ``path`` and remove it (:meth:`check_writable`)."""
        self.put(path, b"ok")
        self.remove(path)

    def write(self, name: str, tensors: Mapping[str, torch.Tensor],
              process_group: dist.ProcessGroup | None = None, *,
              meanwhile: Callable[[dict[str, Location]], None] | None = None
              ) -> dict[str, Location]:
        """Write one rank's tensors of checkpoint ``name`` as a DCP checkpoint; returns
        where every item of every rank landed (key -> Location), once it is durable.
        ``meanwhile(locations)`` runs once they are known, while the data file may still
        be synced (work that needs no durable data: never a commit).

        Collective over ``process_group`` when torch.distributed is initialised
        (every rank of the group calls it, each with its own disjoint keys; the chunk
        keys of one tensor, from all ranks together, tile it exactly);
        otherwise single-process. Blocks; raises what the storage raised.
        """
        writer = self.writer(name, raw=self.serialization == Serialization.RAW)
        distributed = dist.is_available() and dist.is_initialized()
        group = process_group if distributed else None
        if isinstance(writer, dcp_raw.RawWrite):  # the bytes written at once (locally on
            # a thread of their own), .metadata from the items written (StartedIndex)
            try:
                every = self._index.save(writer, tensors, group, distributed)
                where = {key: Location(f"__{rank}_0{DEFAULT_SUFFIX}", offset, length,
                                       Encoding.RAW)
                         for rank, items in enumerate(every)
                         for key, _, _, offset, length in items}
                if meanwhile is not None:
                    meanwhile(where)
            except BaseException:
                writer.wait_synced(raise_error=False)  # nothing reads ``tensors`` after
                raise
            writer.wait_synced()  # its data file's write and fsync ran beside this work
            return where
        with contextlib.nullcontext() if distributed else single_process_dcp():
            metadata = dcp.save({ROOT_KEY: dict(tensors)}, storage_writer=writer,
                                planner=KeySavePlanner(), process_group=group,
                                no_dist=not distributed)
        keys = keys_of(metadata)
        where = {keys[index]: Location(
            info.relative_path, info.offset, info.length,
            Encoding.RAW if RAW_DESCRIPTOR in (
                getattr(info, "transform_descriptors", None) or ()) else Encoding.TORCH_SAVE)
            for index, info in metadata.storage_data.items()}
        if meanwhile is not None:
            meanwhile(where)
        return where

    def write_view(self, name: str, view: Mapping[str, str]) -> mf.FileRef:
        """Write checkpoint ``name``'s view file (named by its checksum: never a commit,
        never a file another manifest names changed) and return its reference for
        :meth:`write_manifest`. Rank 0 only; blocks until durable."""
        return self.write_side(name, mf.encode_view(view))

    def write_items(self, name: str, items: Mapping[str, Item]) -> mf.FileRef:
        """Write the file of checkpoint ``name``'s non-expert items (as :meth:`write_view`)
        and return its reference for :meth:`write_manifest`. Rank 0 only; blocks until
        durable."""
        return self.write_side(name, mf.encode_items(items))

    def write_side(self, name: str, encoded: tuple[bytes, mf.FileRef]) -> mf.FileRef:
        """Write a side file of checkpoint ``name`` encoded already (``mf.encode_view``,
        ``mf.encode_items``: its bytes and reference) and return the reference. Rank 0
        only; blocks until durable."""
        blob, ref = encoded
        self.put(f"{name}/{ref.file}", blob)
        return ref

    def write_manifest(self, manifest: Manifest, view: mf.FileRef | None = None,
                       items: mf.FileRef | None = None) -> None:
        """Commit checkpoint ``manifest.name``: its side files, the view and the non-expert
        items (unless ``view``/``items`` name the ones :meth:`write_view` and
        :meth:`write_items` wrote for it), then its manifest by an exclusive create.
        Never overwrites a manifest (CheckpointError: the name is taken). Rank 0 only,
        after every rank's data is written; blocks until durable."""
        name = manifest.name
        final = f"{name}/{MANIFEST_NAME}"
        taken = f"{self.url}/{name} is committed already; a commit never overwrites a manifest"
        if self.exists(final):
            raise CheckpointError(taken)
        # The side files first, each in a file named by its checksum (so it never replaces
        # another manifest's); the manifest that names them is the commit.
        if view is None and not isinstance(manifest.view, mf.StoredView):
            view = self.write_view(name, manifest.view)
        if items is None:
            items = self.write_items(name, manifest.keys)
        # Compact: json's C encoder runs only without indent (5x faster for the ~1 MB
        # manifest of a large model). `moepec inspect` is the human-readable view.
        data = json.dumps(manifest.to_json(view, items), sort_keys=True,
                          separators=(",", ":")).encode()
        try:
            self.create(final, data)
        except FileExistsError:
            raise CheckpointError(taken) from None

    def read_manifest(self, name: str) -> Manifest:
        """The manifest of checkpoint ``name``. Raises CheckpointError when it has none,
        ManifestError when it cannot be used (ManifestFormatError: a newer format). Any
        rank, any thread; its side files (the view, the non-expert items) are read on
        first use."""
        where = f"{self.url}/{name}"
        try:
            raw = self.get(f"{name}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise CheckpointError(f"{name} has no manifest (not committed)") from exc
        except CorruptCheckpointError as exc:  # a link, a FIFO, an oversized file
            raise ManifestError(f"manifest of {where} cannot be read ({exc}); the checkpoint "
                                f"is damaged: delete that folder") from exc
        try:
            data = parse_json(raw)
        except ValueError as exc:  # (UnicodeDecodeError too)
            raise ManifestError(
                f"manifest of {where} is not valid JSON ({exc}); the checkpoint "
                f"is damaged: delete that folder or run `moepec verify {self.url}`") from exc
        return Manifest.from_json(data, where, lambda ref: self._read_side(name, ref))

    def _read_side(self, name: str, ref: mf.FileRef) -> bytes:
        """The bytes of a manifest's side file, its view or its non-expert items (at most
        one more than it claims: a longer file fails the length check without being read
        whole). Any thread."""
        path = f"{name}/{ref.file}"
        self.confined(path)  # a side file is data: never read through a link out
        return self.get(path, limit=ref.length + 1)

    def list_checkpoints(self) -> list[tuple[str, bool]]:
        """(name, committed) for every checkpoint folder, oldest first by sequence. The
        listing proposes names; each one's manifest decides whether it is committed."""
        found, legacy = [], []
        for name in self.listdir():
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
        return [(n, self.is_committed(n)) for n in found]

    def is_committed(self, name: str) -> bool:
        """Whether checkpoint ``name`` has its manifest."""
        return self.exists(f"{name}/{MANIFEST_NAME}")

    def committed(self) -> list[str]:
        """Names of the committed checkpoints, oldest first."""
        return [n for n, ok in self.list_checkpoints() if ok]

    def delete(self, name: str) -> None:
        """Remove a checkpoint: the manifest first (un-commit), then the data. Refuses
        (CheckpointError) anything but a checkpoint name. Rank 0; blocks."""
        if parse_checkpoint_name(name) is None:
            raise CheckpointError(f"{name!r} is not a checkpoint name; nothing deleted")
        self.remove(f"{name}/{MANIFEST_NAME}")
        self.remove(name)

    def data_bytes(self, name: str) -> int:
        """Bytes of the data files of a checkpoint (everything but the manifest)."""
        return sum(size for file, size in self.file_sizes(name).items()
                   if file != MANIFEST_NAME)


def backend_for(url: str) -> type[Storage]:
    """The backend class serving ``url``: the one subclass of Storage whose ``serves``
    says so (moepec.store.storage imports both built-in backends)."""
    served = [b for b in Storage.__subclasses__() if b.serves(url)]
    if len(served) != 1:
        raise CheckpointError(f"{url}: {len(served)} storage backends serve it "
                              f"({', '.join(b.__name__ for b in served) or 'none'})")
    return served[0]


def is_local_url(url: str) -> bool:
    """Whether ``url`` is a path of the local file system (a plain path or file://)."""
    return "::" not in url and split_protocol(url)[0] in LOCAL_PROTOCOLS


def _serialization(value: str) -> Serialization:
    value = check_choice(Serialization, value, "serialization", CheckpointError)
    if value == Serialization.RAW and not dcp_raw.SUPPORTED:
        log.warning("serialization='raw' needs a torch whose DCP records per-item "
                    "descriptors (torch %s does not); writing torch_save instead. "
                    "Upgrade torch to get the faster raw format.", torch.__version__)
        return Serialization.TORCH_SAVE
    return value


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
