"""A checkpoint root on the local file system (a plain path or a ``file://`` URL).

Small files go through moepec.store.atomic.write_atomic (temporary name, fsync,
rename or hard link, folder fsync); data through DCP's FileSystemWriter with every
file fsync'd; reads open files directly, and data files can be mapped copy-on-write
(moepec.store.reader.map_items). Links: a checkpoint folder that is a link into
another place is deleted as a link, never followed; nothing reached through a link out
of the root is deleted or read as data.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter

from moepec.errors import CheckpointError, CorruptCheckpointError
from moepec.keys import parse_checkpoint_name
from moepec.store.atomic import write_atomic
from moepec.store.checksum import Verifier
from moepec.store.dcp_raw import RawFileSystemWriter
from moepec.store.items import Item, Serialization
from moepec.store.reader import CAN_MAP, links_below, map_items, read_items, read_small
from moepec.store.storage.base import Storage, is_local_url


class LocalStorage(Storage):
    """A checkpoint root that is a folder of this host (see :class:`Storage` for the
    contract and who calls what)."""

    local = True

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None,
                 serialization: str = Serialization.RAW) -> None:
        super().__init__(path, storage_options, serialization)
        if os.path.isfile(self.root):
            raise CheckpointError(f"{self.url} is a file; a checkpoint root is a folder (or "
                                  f"an fsspec URL)")

    @classmethod
    def serves(cls, url: str) -> bool:
        return is_local_url(url)

    def _probe(self, path: str) -> None:
        # Nothing to keep: no fsync (a put's two took ~1 ms of every restore's claim).
        full = self._full(path)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(full)

    def put(self, path: str, data: bytes) -> None:
        write_atomic(self._full(path), data)

    def create(self, path: str, data: bytes) -> None:
        write_atomic(self._full(path), data, exclusive=True)

    def get(self, path: str, limit: int | None = None) -> bytes:
        # A small file of a stranger's root: never through a link, never a FIFO or a
        # device, never more than a small file holds (CorruptCheckpointError).
        return read_small(self.confined(path), limit)

    def is_committed(self, name: str) -> bool:
        try:
            self.confined(name)
        except CorruptCheckpointError:  # a folder linked out of the root: none of its
            return False  # commits, a leftover that retention removes (the link only)
        return super().is_committed(name)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._full(path))

    def listdir(self, path: str = "") -> list[str]:
        try:
            return os.listdir(self._folder(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str = "") -> None:
        os.makedirs(self._folder(path), exist_ok=True)

    def remove(self, path: str) -> None:
        full = self._full(path)
        if "/" in path:  # reached through a link out of the root: refused, not followed
            self.confined(path.rsplit("/", 1)[0])
        if os.path.islink(full) or os.path.isfile(full):
            os.unlink(full)
        elif os.path.isdir(full):
            shutil.rmtree(full)  # removes links inside, never follows them

    def file_sizes(self, path: str) -> dict[str, int]:
        full = self._full(path)
        if os.path.islink(full):
            return {}  # not ours to measure: it points outside the root
        try:
            with os.scandir(full) as entries:  # one scandir, no per-file stat calls
                return {e.name: e.stat().st_size for e in entries
                        if e.is_file(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def writer(self, name: str, *, raw: bool) -> StorageWriter:
        if raw:  # Storage.write starts its data file's write before DCP plans
            return RawFileSystemWriter(self._full(name), sync_files=True, overwrite=True)
        return FileSystemWriter(self._full(name), sync_files=True, overwrite=True)

    def read(self, name: str, targets: Mapping[str, torch.Tensor],
             items: Mapping[str, Item]) -> None:
        read_items(None, (self.root, name), targets, items, local=True)

    def confined(self, path: str) -> str:
        full = self._full(path)
        if not links_below(self.root, path.split("/")):
            return full  # (plain names, no link: it resolves to a path under the root's)
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(full)
        if not real.startswith(real_root.rstrip(os.sep) + os.sep):
            raise CorruptCheckpointError(f"{full} resolves to {real}, outside the checkpoint root "
                                  f"{real_root}; nothing read or deleted")
        return full

    @property
    def can_map(self) -> bool:
        return CAN_MAP

    def map(self, name: str, keys: Sequence[str], items: Mapping[str, Item],
            verify: bool | Verifier = False) -> tuple[dict[str, torch.Tensor], list[str]]:
        if not CAN_MAP:
            return super().map(name, keys, items, verify)
        return map_items((self.root, name), keys, items, verify)

    def delete(self, name: str) -> None:
        """As :meth:`Storage.delete`; a checkpoint folder that is a link loses the link
        only: nothing outside the root is ever deleted."""
        if parse_checkpoint_name(name) is not None and os.path.islink(self._full(name)):
            os.unlink(self._full(name))
            return
        super().delete(name)
