"""Checking a slot's tensors against its header's checksums, and reading them into a
loader's own tensors on the way (:meth:`moepec.ram.shm.SlotStore.intact`).

A slot an earlier worker left is mapped fresh by the restarted one, so the first pass
over its bytes pays a page fault per page of the mapping. A key the loader has a tensor
for is instead read from the slot's data file into that tensor (``preadv``: one copy,
from the pages tmpfs holds, no mapping touched) and the copy is checked, tensor by
tensor while it is in the cache: the bytes the loader uses are the bytes checked, after
the slot can no longer change them; a key the loader has no tensor for is read into a
new one (the few small ones: sharded objects, common state). Without a loader's
tensors (a recovery that keeps the slot's views), the keys are checked in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moepec.errors import ManifestError
from moepec.store.checksum import checksum_matches


def read_checked(entries: Mapping[str, Mapping[str, Any]],
                 view: Callable[[Mapping[str, Any]], torch.Tensor],
                 into: Mapping[str, Any] | None = None,
                 open_data: Callable[[], int] | None = None
                 ) -> tuple[dict[str, torch.Tensor], str | None]:
    """A slot's tensors by key, checked against the checksums its header's ``entries``
    record (shape, dtype, ``offset`` in its data file), and the first key that does not
    match (None when all do). With ``into`` (a loader's own tensors by key) and
    ``open_data``, every key is read from the file ``open_data()`` opens, into its
    tensor of ``into`` where that fits (contiguous, on the CPU, of the entry's shape and
    dtype), else into a new one, and that tensor is checked and returned; without, each
    is ``view(entry)`` (a view of the mapped slot), checked in place. Where a key does
    not match, the tensors of ``into`` hold garbage: the caller loads them again. Raises
    OSError when the file cannot be read, ManifestError for an entry's unknown dtype."""
    out: dict[str, torch.Tensor] = {}
    fd = None
    try:
        for k, e in entries.items():
            dst = (into or {}).get(k)
            if into is not None and open_data is not None:  # a loader's: nothing mapped
                fd = open_data() if fd is None else fd
                tensor = _read_into(fd, dst if _fits(dst, e) else _empty(e), e["offset"])
            else:
                tensor = view(e)
            if not checksum_matches(tensor, e.get("checksum")):
                return out, k
            out[k] = tensor
    finally:
        if fd is not None:
            os.close(fd)
    return out, None


def _fits(dst: Any, e: Mapping[str, Any]) -> bool:
    return isinstance(dst, torch.Tensor) and dst.device.type == "cpu" \
        and list(dst.shape) == list(e["shape"]) and str(dst.dtype) == f"torch.{e['dtype']}" \
        and dst.is_contiguous()


def _empty(e: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, e["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown dtype {e['dtype']!r}")
    return torch.empty(e["shape"], dtype=dtype)


def _read_into(fd: int, dst: torch.Tensor, offset: int) -> torch.Tensor:
    """``dst`` filled with its bytes at ``offset`` of the file ``fd``."""
    buf = memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the slot's data file ends {len(buf) - done} bytes short")
        done += got
    return dst
