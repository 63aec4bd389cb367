"""A checkpoint root on any other fsspec filesystem: object stores (``s3://``, ``gs://``,
``az://``), ``memory://``, ...

Small files are one ``pipe_file`` each: on an object store one PUT, which appears whole
or not at all; the exclusive create is a conditional PUT (``mode="create"``: S3's
``If-None-Match: *``). Data goes through DCP's FsspecWriter. A filesystem whose
``pipe_file`` is neither atomic nor exclusive (a plain remote POSIX mount through
fsspec, say) does not honour the contract of :class:`Storage`: mount it and use the
local path instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.storage import StorageWriter

from moepec.errors import CorruptCheckpointError
from moepec.store.dcp_raw import RawFsspecWriter
from moepec.store.items import Item
from moepec.store.reader import SMALL_FILE_LIMIT, read_items
from moepec.store.storage.base import Storage, is_local_url


class FsspecStorage(Storage):
    """A checkpoint root on a remote fsspec filesystem (see :class:`Storage` for the
    contract and who calls what)."""

    local = False

    @classmethod
    def serves(cls, url: str) -> bool:
        return not is_local_url(url)

    def put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._full(path), data)

    def create(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._full(path), data, mode="create")

    def get(self, path: str, limit: int | None = None) -> bytes:
        # One ranged GET; one byte over the cap tells an oversized object.
        data = self.fs.cat_file(self._full(path), start=0,
                                end=SMALL_FILE_LIMIT + 1 if limit is None else limit)
        if limit is None and len(data) > SMALL_FILE_LIMIT:
            raise CorruptCheckpointError(f"{self.url}/{path} holds more than any moepec "
                                         f"small file ({SMALL_FILE_LIMIT} bytes)")
        return data

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._full(path))

    def listdir(self, path: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self._folder(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def makedirs(self, path: str = "") -> None:
        self.fs.makedirs(self._folder(path), exist_ok=True)

    def remove(self, path: str) -> None:
        full = self._full(path)
        with contextlib.suppress(FileNotFoundError):  # gone already (or a lagging listing)
            if self.fs.exists(full):
                self.fs.rm(full, recursive=True)

    def file_sizes(self, path: str) -> dict[str, int]:
        try:
            entries = self.fs.ls(self._full(path), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def writer(self, name: str, *, raw: bool) -> StorageWriter:
        self._full(name)  # a plain name
        return (RawFsspecWriter if raw else FsspecWriter)(
            f"{self.url}/{name}", sync_files=False, overwrite=True, **self.options)

    def read(self, name: str, targets: Mapping[str, torch.Tensor],
             items: Mapping[str, Item]) -> None:
        read_items(self.fs, (self.root, name), targets, items, local=False)
