"""A test-only stand-in for the ``grouped_gemm`` package (a CUDA extension that does not
install on a CPU-only machine), so that Megatron-Core's legacy ``GroupedMLP``
(megatron/core/transformer/moe/experts.py) builds: its constructor asserts that
``grouped_gemm`` imports, and its forward calls ``grouped_gemm.ops.gmm``. ``gmm`` here is
plain torch (a loop over the groups), so autograd gives its backward.

``install()`` puts the module in ``sys.modules``: call it before anything imports
megatron (Megatron's grouped_gemm_util reads it at import), in a process of its own."""

from __future__ import annotations

import sys
import types

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor,
        trans_b: bool = False) -> torch.Tensor:
    """Grouped matmul: ``a``'s rows in consecutive groups of ``batch_sizes[i]`` rows,
    group i times ``b[i]`` (``[k, n]``; ``[n, k]`` transposed with ``trans_b``).
    Returns ``[a.shape[0], n]``."""
    sizes = [int(n) for n in batch_sizes.tolist()]
    if len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: {len(sizes)} groups of {sum(sizes)} rows for "
                         f"{b.shape[0]} weights and {a.shape[0]} rows")
    weights = b.transpose(-1, -2) if trans_b else b
    outs = [rows @ w for rows, w in zip(torch.split(a, sizes), weights, strict=True)]
    return torch.cat(outs) if outs else a.new_empty(0, weights.shape[-1])


def install() -> None:
    """Put the stand-in ``grouped_gemm`` (with ``grouped_gemm.ops.gmm``) into
    ``sys.modules``."""
    if "grouped_gemm" in sys.modules:
        return
    if "megatron.core" in sys.modules:
        raise RuntimeError("install the grouped_gemm stand-in before importing megatron")
    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm = gmm
    package = types.ModuleType("grouped_gemm")
    package.ops = ops
    package.__path__ = []
    sys.modules["grouped_gemm"], sys.modules["grouped_gemm.ops"] = package, ops
