"""One copy of a tensor's bytes into another, on the calling thread.

The snapshot, the restore and the RAM tier copy hundreds to thousands of tensors one by
one (one per expert slice at K=1). ``Tensor.copy_`` runs every copy above a few tens of
kB as a parallel region of torch's intra-op thread pool: each one wakes the pool's
threads and waits for all of them. On a busy host (or next to a training thread that
keeps the cores) that wait is a scheduler time slice, not a memcpy: measured on this
project's 2-core machine at load 13, 64 copies of 0.2 MB took 180-280 ms with two torch
threads and 10-24 ms with one (docs/results.md, section 8). A plain ``memmove`` on the
calling thread costs what the bytes cost, whatever the pool is doing, and releases the
GIL while it runs (ctypes releases it around every foreign call).
"""

from __future__ import annotations

import ctypes

import torch


def _plain(t: torch.Tensor) -> bool:
    """A dense CPU tensor whose bytes are its values in order (no wrapper subclass)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided
            and t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t.is_quantized)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``: one ``memmove`` on this thread when both are contiguous CPU
    tensors of one dtype and shape, else torch's own copy (another device, a cast, a
    broadcast, a strided view, a copy autograd records). Any thread; blocks until the
    bytes are copied. Bumps ``dst``'s version counter, as ``copy_`` does."""
    if (dst.dtype == src.dtype and dst.shape == src.shape and _plain(dst) and _plain(src)
            and not (dst.requires_grad and torch.is_grad_enabled())):
        n = dst.numel() * dst.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
            torch.autograd.graph.increment_version(dst)
        return
    dst.copy_(src)
