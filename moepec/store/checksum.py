"""Checksums of tensors as stored: a fast hash of the raw bytes, plus dtype and shape.

XXH3-64 (``xxh3:<hex>``; ~16 GB/s on this project's machine, 2.6x XXH64); the prefix
names the algorithm, and a checksum of any other algorithm never matches.
"""

from __future__ import annotations

import functools

import torch
import xxhash

from moepec.state.bytecopy import in_threads, restore_threads, split_by_bytes

ALGORITHMS = {"xxh3": xxhash.xxh3_64}
DEFAULT_ALGORITHM = "xxh3"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes in native order, without a copy (one copy if it is not
    contiguous or is a lazy conjugate/negative view). Raises ValueError off the CPU."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor (got {t.device})")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def tensor_checksum(t: torch.Tensor, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """``<algorithm>:<hex>`` of the tensor's dtype, shape and bytes (copied to the CPU if
    it is elsewhere)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return stored_checksum(tensor_bytes(t), t.dtype, tuple(t.shape), algorithm)


def stored_checksum(data: memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...],
                    algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum of a tensor of ``dtype`` and ``shape`` whose bytes are ``data`` (as
    :func:`tensor_checksum`, straight from stored bytes: no tensor needed)."""
    h = ALGORITHMS[algorithm](_header(dtype, shape))
    h.update(data)
    return f"{algorithm}:{h.hexdigest()}"


@functools.lru_cache(maxsize=4096)
def _header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """What the checksum hashes before the bytes: the dtype and shape."""
    return str((dtype, shape)).encode()


def checksum_matches(t: torch.Tensor, expected: object) -> bool:
    """Whether ``t`` has the checksum ``expected`` (False if missing, not a string or of
    an unknown algorithm: such a copy cannot be verified)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return stored_matches(tensor_bytes(t), t.dtype, tuple(t.shape), expected)


def stored_matches(data: memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...],
                   expected: object) -> bool:
    """:func:`checksum_matches` for stored bytes of a tensor of ``dtype`` and ``shape``."""
    algorithm = expected.partition(":")[0] if isinstance(expected, str) else ""
    return algorithm in ALGORITHMS and stored_checksum(data, dtype, shape,
                                                       algorithm) == expected


class Verifier:
    """Checks of stored bytes against their checksums, gathered while a restore maps its
    items and made together by :meth:`finish`, split by bytes over two threads (the
    caller and one helper): XXH3 releases the GIL while it hashes, so the checks use both
    of a machine's cores, as ``dcp.load``'s copies do. (Checking on a helper while the
    caller maps would not pay: the mapping holds the GIL, and the helper would get it
    back once per switch interval, 5 ms.) One caller adds and finishes."""

    def __init__(self, threads: int | None = None) -> None:
        self._jobs: list[tuple[str, memoryview | bytes, torch.dtype, tuple[int, ...],
                               object]] = []
        self._threads = restore_threads() if threads is None else threads

    def add(self, key: str, data: memoryview | bytes, dtype: torch.dtype,
            shape: tuple[int, ...], expected: object) -> None:
        """Check at :meth:`finish` that ``data`` (stored bytes of ``key``, a tensor of
        ``dtype`` and ``shape``; kept alive until then) has the checksum ``expected``."""
        self._jobs.append((key, data, dtype, shape, expected))

    def finish(self) -> list[str]:
        """The keys added whose bytes fail their checksums, in the order added (each check
        made once; the added checks are dropped). Blocks until all are made; raises what a
        check raised."""
        jobs, self._jobs = self._jobs, []
        failed: list[list[str]] = []

        def check(share: list[tuple]) -> None:
            bad = [key for key, data, dtype, shape, expected in share
                   if not stored_matches(data, dtype, shape, expected)]
            failed.append(bad)

        in_threads(check, split_by_bytes(jobs, lambda job: len(job[1]), self._threads))
        bad = {k for keys in failed for k in keys}
        return [job[0] for job in jobs if job[0] in bad] if bad else []
