"""CPU shims for Megatron-Core 0.16.1, for the tests and the benchmark only (never the
library). Megatron-Core assumes CUDA in a few calls of its checkpointing path; each
line below says which one it stands in for. ``install()`` is idempotent."""

from __future__ import annotations

import sys

import torch


def install() -> None:
    """Make Megatron-Core's checkpointing path run on a CPU-only torch."""
    # TemporalAsyncCaller.schedule_async_call and the torch_dist strategy call
    # torch.cuda.synchronize() before forking the writer: nothing to wait for on CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # AsyncCallsQueue.maybe_finalize_async_calls / sync_all_async_calls allocate their
    # all_reduce flags on torch.cuda.current_device(): gloo reduces CPU tensors.
    torch.cuda.current_device = lambda: torch.device("cpu")
    if "megatron.core.jit" not in sys.modules:
        _eager_jit()


def _eager_jit() -> None:
    """Import Megatron-Core with its fused kernels eager, as its own
    ``megatron.core.jit.disable_jit_fuser()`` makes them. Megatron binds ``torch.compile``
    as its ``jit_fuser`` when ``megatron.core`` is imported, and each function decorated
    with it then imports TorchDynamo and TorchInductor: 4.6 of the 8.1 s of CPU that
    importing ``megatron.core.models.gpt`` takes here, paid by every worker process of
    the tests. Nothing on the checkpointing path is compiled; ``torch.compile`` itself is
    restored once ``megatron.core`` is imported."""
    compile_ = torch.compile

    def eager(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = eager
    try:
        import megatron.core.jit as jit

        jit.disable_jit_fuser()  # modules imported later bind the eager one too
    finally:
        torch.compile = compile_


def fp32_optimizer(optimizer: torch.optim.Optimizer, config, init_state_fn):
    """Megatron's FP32Optimizer around ``optimizer``, built on the CPU."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, optimizer, config, init_state_fn)
    # FP32Optimizer.__init__ allocates its (unused, constant) loss scale with device='cuda'.
    opt._scale = torch.tensor([1.0], dtype=torch.float)
    opt.is_stub_optimizer = optimizer is None  # the rest of FP32Optimizer.__init__
    return opt
