"""Reading a checkpoint's items by the locations its manifest records.

No DCP ``.metadata`` (a pickle) is read and nothing is unpickled: each item's data file,
offset, length and encoding come from the validated JSON manifest
(:class:`moepec.store.items.Item`). Raw items are read straight into their target
tensors; ``torch_save`` items (stock DCP framing) are decoded with
``torch.load(weights_only=True)``. Items of one file are read in offset order through
one open file, so a restore that stitches a view from many checkpoints makes one
sequential pass per data file and no planning round trips.

On a local disk, :func:`map_items` maps the data files instead (a private, copy-on-write
``mmap``): raw items become tensors over the page cache with no allocation and no read
copy, so verifying them and copying them into the live state once all are verified costs
what a read straight into the live tensors costs, yet a failed restore leaves the live
state untouched. A mapping is never written through to the file.

Every path is confined to the checkpoint root: a data file is a plain name inside its
checkpoint folder (the manifest's validation), and on a local disk the resolved path
must lie inside the resolved root, so a symlink cannot lead out of it.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import stat
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch

from moepec.errors import CheckpointError, CorruptCheckpointError
from moepec.store.checksum import Verifier, checksum_matches, stored_matches, tensor_bytes
from moepec.store.dcp_raw import read_exact
from moepec.store.items import DTYPE_SIZES, Encoding, Item


def confined(root: str, *parts: str, local: bool) -> str:
    """``root/parts...``, refusing anything that resolves outside ``root`` (local disks:
    symlinks followed; object stores have none). Raises CorruptCheckpointError."""
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part:
            raise CorruptCheckpointError(f"{part!r} is not a plain name inside {root}")
    path = "/".join((root,) + parts)
    if local and links_below(root, parts):
        real_root = os.path.realpath(root)
        real = os.path.realpath(path)
        if not real.startswith(real_root.rstrip(os.sep) + os.sep):
            raise CorruptCheckpointError(f"{path} resolves to {real}, outside the checkpoint "
                                         f"root {real_root}")
    return path


def links_below(root: str, parts: Iterable[str]) -> bool:
    """Whether ``root/parts...`` (each part a plain name) passes through a symbolic link
    below ``root``: only then can it resolve outside ``root``, so only then does the
    caller resolve the whole path (``os.path.realpath``: an ``lstat`` per component of
    ``root`` too, ~60-130 us a path, which a restore of a 64-expert view paid ~260 times).
    An absent part ends the walk: nothing below it exists to resolve."""
    path = root
    for part in parts:
        path = f"{path}/{part}"
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return True
        except OSError:
            return False
    return False


SMALL_FILE_LIMIT = 256 << 20
"""The most bytes a small file of a checkpoint (manifest, lease, record) may hold: a
manifest of a million items is about 200 MB."""


def read_small(path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (or the whole file, which
    must not exceed SMALL_FILE_LIMIT). Never follows a link at ``path``, never blocks on
    a FIFO or device: CorruptCheckpointError for those and for an oversized file;
    FileNotFoundError when there is none."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{path} is a link; moepec reads no checkpoint file "
                                         f"through a link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file")
    with open(fd, "rb") as f:
        if limit is None and st.st_size > SMALL_FILE_LIMIT:
            raise CorruptCheckpointError(f"{path} holds {st.st_size} bytes, more than any "
                                         f"moepec small file ({SMALL_FILE_LIMIT})")
        return f.read(-1 if limit is None else limit)


_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}
"""torch dtypes by the names an item records (checked against DTYPE_SIZES)."""

CAN_MAP = hasattr(mmap, "MAP_PRIVATE")
"""Whether this platform maps files copy-on-write (POSIX); elsewhere items are read."""


def map_items(folder_parts: tuple[str, str], keys: Sequence[str],
              items: Mapping[str, Item], verify: bool | Verifier = False
              ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``keys`` of the local checkpoint folder ``root/name`` as tensors over private
    mappings of their data files: raw items aligned to their dtype are mapped, any other
    item is read into a new tensor. With ``verify``, also the keys whose bytes fail the
    manifest's checksum (hashed from the mapping, no tensor needed), else []; a
    :class:`Verifier` is handed the mapped items' checks instead (its ``finish`` names
    the failures; the keys returned are those read and checked here). Reads only; any
    thread. Raises CheckpointError (or OSError) for anything missing, short or
    inconsistent, as :func:`read_items`."""
    root, name = folder_parts
    out: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    verifier = verify if isinstance(verify, Verifier) else None
    for file, file_items in _by_file(name, keys, items).items():
        path = confined(root, name, file, local=True)
        with open(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            mapped = (mmap.mmap(stream.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None)
            view = memoryview(mapped) if mapped is not None else None
            for key, item in file_items:
                dtype = _DTYPES[item.dtype]
                start, length = item.offset, item.length
                if start + length > size:
                    raise CheckpointError(f"{key}: {path} ends at byte {size}, the item at "
                                          f"{start}+{length} (truncated)")
                if (view is not None and item.encoding == Encoding.RAW and length
                        and start % dtype.itemsize == 0):
                    out[key] = torch.frombuffer(mapped, dtype=dtype,
                                                count=length // dtype.itemsize,
                                                offset=start).view(item.shape)
                    data = view[start:start + length]
                    if verifier is not None:
                        verifier.add(key, data, dtype, tuple(item.shape), item.checksum)
                    elif verify and not stored_matches(data, dtype, tuple(item.shape),
                                                       item.checksum):
                        bad.append(key)
                else:
                    out[key] = torch.empty(item.shape, dtype=dtype)
                    _read_one(stream, key, item, out[key])
                    if verify and not checksum_matches(out[key], item.checksum):
                        bad.append(key)
    return out, bad


def release_later(values: dict[str, torch.Tensor]) -> threading.Thread:
    """Empty ``values`` (a restore's tensors, most over private mappings of data files,
    copied into the model already) and drop them on a helper thread, returned started.
    Unmapping is work for the pages read (their page-table entries): ~5 ms for the
    64-expert restore's 210 MB, which training, resuming meanwhile, need not wait
    for (``munmap`` runs without the GIL)."""
    held = dict(values)
    values.clear()
    thread = threading.Thread(target=held.clear, name="moepec-unmap", daemon=True)
    thread.start()
    return thread


def _by_file(name: str, keys: Iterable[str], items: Mapping[str, Item]
             ) -> dict[str, list[tuple[str, Item]]]:
    """``(key, item)`` of ``keys`` grouped by data file, each group in offset order (each
    item looked up once: a manifest's Items checks an entry on first use)."""
    by_file: dict[str, list[tuple[str, Item]]] = defaultdict(list)
    for key in keys:
        item = items[key]
        if item.file is None:
            raise CheckpointError(
                f"{name} was written by an older moepec whose manifest does not record where "
                f"items are; this moepec does not read it (it would have to unpickle DCP's "
                f".metadata). Restore it with the moepec that wrote it, or start a new run")
        by_file[item.file].append((key, item))
    for file_items in by_file.values():
        file_items.sort(key=_offset)
    return by_file


def _offset(entry: tuple[str, Item]) -> int:
    return entry[1].offset


def read_items(fs, folder_parts: tuple[str, str], targets: Mapping[str, torch.Tensor],
               items: Mapping[str, Item], *, local: bool) -> None:
    """Fill ``targets`` (key -> preallocated tensor of the item's shape and dtype) from
    the checkpoint folder ``root/name`` (``folder_parts``). Reads only; no collective;
    any thread. Raises CheckpointError (or OSError) for anything missing, short or
    inconsistent: the caller isolates the bad key."""
    root, name = folder_parts
    for file, file_items in _by_file(name, targets, items).items():
        path = confined(root, name, file, local=local)
        with (open(path, "rb") if local else fs.open(path, "rb")) as stream:
            for key, item in file_items:
                _read_one(stream, key, item, targets[key])


def _read_one(stream, key: str, item: Item, target: torch.Tensor) -> None:
    if list(target.shape) != item.shape or str(target.dtype).removeprefix("torch.") != item.dtype:
        raise CheckpointError(f"{key}: the target is {list(target.shape)} {target.dtype}, the "
                              f"item {item.shape} {item.dtype}")
    size = _stream_size(stream)
    if size is not None and item.offset + item.length > size:  # before allocating for it
        raise CheckpointError(f"{key}: its file ends at byte {size}, the item at "
                              f"{item.offset}+{item.length} (truncated or damaged)")
    stream.seek(item.offset)
    if item.encoding == Encoding.RAW:
        if target.is_cpu and target.is_contiguous() and not target.is_conj() \
                and not target.is_neg():
            read_exact(stream, tensor_bytes(target), key)
        else:
            src = torch.empty_like(target, device="cpu", memory_format=torch.contiguous_format)
            read_exact(stream, tensor_bytes(src), key)
            target.copy_(src)
        return
    buf = bytearray(item.length)
    read_exact(stream, memoryview(buf), key)
    try:
        value = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a damaged record
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptCheckpointError(f"{key}: the stored record does not decode as a "
                                     f"tensor ({first:.200})") from exc
    if not torch.is_tensor(value) or list(value.shape) != item.shape:
        raise CorruptCheckpointError(f"{key}: the stored record is not the {item.shape} tensor "
                                     f"the manifest describes")
    target.copy_(value)


def _stream_size(stream) -> int | None:
    """The size of the file under ``stream`` (a local file or an fsspec file), or None
    where the stream does not tell."""
    try:
        return os.fstat(stream.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        size = getattr(stream, "size", None)
        return size if isinstance(size, int) else None
