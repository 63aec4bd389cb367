"""A DCP storage writer and reader that store each tensor as its raw bytes.

DCP's stock writers frame every item with ``torch.save`` (a small zip archive per
tensor). For a checkpoint of many mid-sized tensors, as a PEC checkpoint is (one item
per expert slice and optimizer moment), that framing costs more than writing the
bytes: on this project's reference checkpoint (618 items, 94 MB) ``dcp.save`` with
``FileSystemWriter`` took 0.21 s against 0.08 s for the bytes alone.

These classes keep everything else of DCP: its planners, its collective save and
load, its ``.metadata`` file and its per-item ``_StorageInfo`` (file, offset, length).
Only the item bytes differ: each tensor (or shard of a sharded tensor, at the offsets
``.metadata`` records) is its contiguous storage bytes (native byte order), and its ``_StorageInfo.transform_descriptors`` is ``["moepec.raw/1"]``. A
stock ``FileSystemReader`` meets that descriptor and stops with
``Unknown extension name='moepec.raw'`` instead of misreading the bytes; read such a
checkpoint with :class:`RawFileSystemReader` (or ``moepec export --format dcp`` to
convert it to stock DCP). The readers here also read items written by the stock
writers, so one reader serves checkpoints of either serialization.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moepec.state.bytecopy import plain
from moepec.store.atomic import fsync_dir, fsync_file
from moepec.store.checksum import tensor_bytes

RAW_DESCRIPTOR = "moepec.raw/1"
SUPPORTED = "transform_descriptors" in {f.name for f in dataclasses.fields(_StorageInfo)}
"""Whether this torch's DCP records per-item descriptors (newer torch does), which the raw
items need to be told apart from torch.save-framed ones."""


class RawWrite:
    """``write_data`` for FileSystemWriter and FsspecWriter: one file per rank, the
    items back to back, fsync'd when the writer syncs files. A shard item (one chunk of a
    sharded tensor: a DTensor's local shard, a moepec chunk key) is stored as the bytes of
    that chunk; ``.metadata`` records its offsets and sizes, as for stock items. The stock
    writers' ``thread_count``, ``serialization_format`` and ``_extensions`` options do not
    apply here."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        offset = 0
        bufs = []
        for item in plan.items:
            data = planner.resolve_data(item)
            td = item.tensor_data
            if td is not None and tuple(data.shape) != tuple(td.chunk.sizes):
                raise ValueError(f"{item.index.fqn}: the data of the chunk at "
                                 f"{list(td.chunk.offsets)} is {list(data.shape)}, its "
                                 f"metadata says {list(td.chunk.sizes)}")
            buf = data.getbuffer() if item.type == WriteItemType.BYTE_IO else tensor_bytes(data)
            info = _StorageInfo(name, offset, len(buf), transform_descriptors=[RAW_DESCRIPTOR])
            results.append(WriteResult(index=item.index, size_in_bytes=len(buf),
                                       storage_data=info))
            bufs.append(buf)
            offset += len(buf)
        self._store(self.fs.concat_path(self.path, name), bufs)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _store(self, path: Any, bufs: list[memoryview]) -> None:
        """Write ``bufs`` back to back into the file ``path`` (fsync'd when the writer
        syncs files), through the writer's stream: one write per item."""
        with self.fs.create_stream(path, "wb") as stream:
            for buf in bufs:
                stream.write(buf)
            if self.sync_files:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()  # what DCP's own writers do on streams without a descriptor

    entries: list[tuple[str, torch.Size, torch.dtype, int, int]]
    """Set by :meth:`start`: (key, shape, dtype, offset, length) of every item, in the
    file's order (moepec.store.dcp_planner.Entry)."""

    def start(self, tensors: Mapping[str, torch.Tensor], rank: int) -> None:
        """Write ``tensors`` (key -> CPU tensor, key order) back to back into this rank's
        data file (``__<rank>_0.distcp``) now, through the writer's stream;
        :attr:`entries` says where each went, for ``dcp_planner.StartedIndex`` to record in
        ``.metadata`` (no ``dcp.save`` follows). :class:`RawFileSystemWriter` writes on a
        thread of its own instead."""
        self.fs.mkdir(self.path)  # (what DCP's prepare_local_plan does)
        entries, bufs, offset = [], [], 0
        for key, t in tensors.items():
            buf = tensor_bytes(t)
            entries.append((key, t.shape, t.dtype, offset, len(buf)))
            bufs.append(buf)
            offset += len(buf)
        self._store(self.fs.concat_path(self.path, f"__{rank}_0{DEFAULT_SUFFIX}"), bufs)
        self.entries = entries

    def wait_synced(self, *, raise_error: bool = True) -> None:
        """Block until the data file of the last write is durable (at once here: it was
        fsync'd, where the writer syncs files, before the write returned)."""


IOV_MAX = 1024
"""Buffers per ``writev`` (Linux's limit)."""


def write_all(fd: int, bufs: list[memoryview]) -> None:
    """Write ``bufs`` back to back at ``fd``'s position in as few system calls as the
    kernel takes (``writev`` of up to :data:`IOV_MAX` buffers; a short write goes on where
    it stopped). Raises OSError as ``writev`` does."""
    bufs = [b for b in bufs if len(b)]
    i = 0
    while i < len(bufs):
        n = os.writev(fd, bufs[i:i + IOV_MAX])
        if n == 0:
            raise OSError(f"writev wrote nothing of {sum(map(len, bufs[i:]))} bytes")
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = memoryview(bufs[i]).cast("B")[n:]


class RawFileSystemWriter(RawWrite, FileSystemWriter):
    """FileSystemWriter storing raw tensor bytes (local paths; fsync'd by default).

    The data file is written with ``writev`` (a few system calls for all its items,
    not one per item), and fsync'd before ``write_data`` returns, as DCP's own writers
    do. :meth:`start` goes further: the bytes are written and fsync'd on a thread of
    their own from the start, and the caller's work runs while the kernel copies.
    ``dcp_planner.StartedIndex`` (which calls it) then builds ``.metadata`` from
    :attr:`entries`, without DCP's plans; a ``dcp.save`` through a started writer is
    refused (it would write the data again). :meth:`wait_synced`,
    which the caller must then call on every rank before it reports the data written,
    waits for that thread and raises its error.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync: tuple[threading.Thread, list[BaseException]] | None = None
        self._unsynced: str | None = None
        self._written: threading.Event | None = None
        """Set once a started write's ``writev`` returned (its fsync may still run)."""
        self.entries: list[tuple[str, torch.Size, torch.dtype, int, int]] = []

    def start(self, tensors: Mapping[str, torch.Tensor], rank: int) -> None:
        """Begin writing ``tensors`` (key -> CPU tensor, key order) into this rank's data
        file on a thread of its own; :attr:`entries` says where each goes, for
        ``dcp_planner.StartedIndex``. The file has the name DCP gives the data of the
        ``rank``-th rank of the save's group (``__<rank>_0.distcp``). The caller then
        calls :meth:`wait_synced`, also when what followed failed (the thread reads
        ``tensors`` until it returns)."""
        if self._sync is not None:
            raise RuntimeError("start() runs once per save")
        self.fs.mkdir(self.path)
        path = str(self.fs.concat_path(self.path, f"__{rank}_0{DEFAULT_SUFFIX}"))
        offset, entries = 0, []
        for key, t in tensors.items():
            n = t.numel() * t.element_size()
            entries.append((key, t.shape, t.dtype, offset, n))
            offset += n
        # The buffers are made here, not on the writing thread: it then holds the GIL
        # never, and its writev runs through the caller's work (which holds it).
        bufs = [_bytes_of(t) for t in tensors.values()]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        errors: list[BaseException] = []
        self._written = threading.Event()
        thread = threading.Thread(target=_write_close, name="moepec-data-write", args=(
            fd, bufs, list(tensors.values()), self.sync_files, errors, self._written))
        thread.start()
        self._sync = (thread, errors)
        self.entries = entries  # (key, shape, dtype, offset, length): dcp_planner.Entry

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._written is not None:
            raise RuntimeError("a started write is indexed by moepec.store.dcp_planner."
                               "StartedIndex, not by a dcp.save (which would write it again)")
        return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's ``finish``; after :meth:`start`, ``.metadata`` is fsync'd by
        :meth:`wait_synced` (with the folder), not here. Its fsync here waited for the
        data file's (ext4's ordered journal) and held up the caller's work beside it
        (~25 ms of a ~100 ms persist: docs/results.md, section 3, issue 50's eighth
        pass)."""
        if self._written is not None:
            # .metadata is written once the data's writev returned: a small file written
            # into the file system during a large write stalled that write 8-20x in 13 of
            # 40 tries here, against 1 of 40 alone (docs/results.md, section 3, issue 50's
            # ninth pass); during its fsync it does not.
            self._written.wait()
        if self._sync is None or not self.sync_files:
            super().finish(metadata, results)
            return
        self.sync_files = False
        try:
            super().finish(metadata, results)
        finally:
            self.sync_files = True
        self._unsynced = str(self._get_metadata_path(
            self.rank if not self.use_collectives and self.rank is not None else None))

    def _store(self, path: Any, bufs: list[memoryview]) -> None:
        errors: list[BaseException] = []
        _write_close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), bufs,
                     [], self.sync_files, errors)
        if errors:
            raise errors[0]

    def wait_synced(self, *, raise_error: bool = True) -> None:
        """Block until a started write is written and durable (its thread joined);
        raises the thread's OSError (``raise_error``). Every rank, after ``dcp.save``,
        before the data counts as written."""
        if self._sync is not None:
            (thread, errors), self._sync = self._sync, None
            thread.join()  # a write and an fsync: as long as synchronous ones would block
            if errors and raise_error:
                raise errors[0]
        if self._unsynced is not None:
            path, self._unsynced = self._unsynced, None
            if raise_error:  # (the save failed otherwise: nothing of it is committed)
                fsync_file(path)
                fsync_dir(os.path.dirname(path))


def _bytes_of(t: torch.Tensor) -> Any:
    """The bytes of ``t`` as a buffer for ``writev``: ``tensor_bytes(t)``, or for a plain
    CPU tensor a ctypes array over its memory (~0.4 us against ~9, and one object the
    garbage collector tracks instead of three; the caller keeps ``t`` alive while the
    array is used)."""
    if plain(t) and (n := t.nbytes):
        return (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return tensor_bytes(t)


def _write_close(fd: int, bufs: list[memoryview], tensors: list[torch.Tensor], sync: bool,
                 errors: list[BaseException], written: threading.Event | None = None) -> None:
    """Write ``bufs`` (views of ``tensors``, held here until written) at ``fd``, set
    ``written``, fsync it (``sync``) and close it; errors go to ``errors``."""
    try:
        try:
            write_all(fd, bufs)
        finally:
            if written is not None:
                written.set()
        if sync:
            os.fsync(fd)
    except BaseException as exc:  # noqa: BLE001 - raised by wait_synced
        errors.append(exc)
    finally:
        os.close(fd)


class RawFsspecWriter(RawWrite, FsspecWriter):
    """FsspecWriter storing raw tensor bytes (s3://, memory://, any fsspec URL)."""


def read_exact(stream: Any, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise OSError(f"{what}: file ends after {got} of {len(view)} bytes (truncated)")
        got += n


class _RawRead:
    """``read_data`` that reads raw items straight into their targets and hands any
    other (stock, torch.save-framed) item to the stock reader."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensor_md = metadata.state_dict_metadata
        self._chunk_sizes: dict[str, dict[tuple[int, ...], torch.Size]] = {}

    def _stored_size(self, fqn: str, offsets: tuple[int, ...], what: str) -> torch.Size:
        """The sizes of the stored chunk of ``fqn`` at ``offsets`` (whole tensor: one)."""
        md = self._tensor_md.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{what}: .metadata does not describe it as a tensor")
        sizes = self._chunk_sizes.get(fqn)
        if sizes is None:
            sizes = self._chunk_sizes[fqn] = {tuple(c.offsets): c.sizes for c in md.chunks}
        if offsets not in sizes:
            raise ValueError(f"{what}: .metadata has no chunk at {list(offsets)}")
        return sizes[offsets]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw, other = [], []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            (raw if RAW_DESCRIPTOR in (info.transform_descriptors or ()) else other).append(req)
        if other:
            super().read_data(LoadPlan(other, plan.storage_data), planner).wait()
        per_file = defaultdict(list)
        for req in raw:
            per_file[self.storage_data[req.storage_index].relative_path].append(req)
        for rel, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:
                for req in reqs:
                    self._read_one(stream, req, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, stream: Any, req, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        stream.seek(info.offset)
        what = f"{req.storage_index.fqn} in {info.relative_path}"
        if req.type == LoadItemType.BYTE_IO:
            buf = bytearray(info.length)
            read_exact(stream, memoryview(buf), what)
            planner.load_bytes(req, io.BytesIO(bytes(buf)))
            return
        # A raw item holds one stored chunk (the whole tensor, or a shard at its offsets);
        # the request reads ``lengths`` of it from ``storage_offsets`` (relative to it).
        size = self._stored_size(req.storage_index.fqn,
                                 tuple(req.storage_index.offset or ()), what)
        dtype = self._tensor_md[req.storage_index.fqn].properties.dtype
        target = planner.resolve_tensor(req).detach()
        whole = list(req.lengths) == list(size) and not any(req.storage_offsets)
        if (whole and target.is_cpu and target.is_contiguous() and target.dtype == dtype
                and not target.is_conj() and not target.is_neg()
                and target.numel() * target.element_size() == info.length):
            if info.length:
                read_exact(stream, tensor_bytes(target), what)
        else:
            src = torch.empty(size, dtype=dtype)
            if info.length != src.numel() * src.element_size():
                raise ValueError(f"{what}: {info.length} bytes stored, {size} {dtype} expected")
            if info.length:
                read_exact(stream, tensor_bytes(src), what)
            target.copy_(narrow_tensor_by_index(src, req.storage_offsets, req.lengths))
        planner.commit_tensor(req, target)


class RawFileSystemReader(_RawRead, FileSystemReader):
    """FileSystemReader that also reads raw items (local paths)."""


class RawFsspecReader(_RawRead, FsspecReader):
    """FsspecReader that also reads raw items (any fsspec URL)."""
