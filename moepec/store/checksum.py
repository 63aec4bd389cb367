"""Checksums of tensors as stored: a fast hash of the raw bytes, plus dtype and shape.

XXH3-64 (``xxh3:<hex>``; ~16 GB/s on this project's machine, 2.6x XXH64); the prefix
names the algorithm, and a checksum of any other algorithm never matches.
"""

from __future__ import annotations

import functools

import torch
import xxhash

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
