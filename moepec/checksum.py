"""Checksums of tensors as stored: xxh64 over the raw bytes, plus dtype and shape."""

from __future__ import annotations

import torch
import xxhash


def tensor_checksum(t: torch.Tensor) -> str:
    """``xxh64:<hex>`` of the tensor's bytes (CPU, contiguous; copied if not)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    h = xxhash.xxh64()
    h.update(str((t.dtype, tuple(t.shape))).encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return "xxh64:" + h.hexdigest()
