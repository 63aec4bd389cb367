"""CPU shims for Megatron-Core 0.16.1, for the tests and the benchmark only (never the
library). Megatron-Core assumes CUDA in a few calls of its checkpointing path; each
line below says which one it stands in for. ``install()`` is idempotent."""

from __future__ import annotations

import torch


def install() -> None:
    """Make Megatron-Core's checkpointing path run on a CPU-only torch."""
    # TemporalAsyncCaller.schedule_async_call and the torch_dist strategy call
    # torch.cuda.synchronize() before forking the writer: nothing to wait for on CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # AsyncCallsQueue.maybe_finalize_async_calls / sync_all_async_calls allocate their
    # all_reduce flags on torch.cuda.current_device(): gloo reduces CPU tensors.
    torch.cuda.current_device = lambda: torch.device("cpu")


def fp32_optimizer(optimizer: torch.optim.Optimizer, config, init_state_fn):
    """Megatron's FP32Optimizer around ``optimizer``, built on the CPU."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, optimizer, config, init_state_fn)
    # FP32Optimizer.__init__ allocates its (unused, constant) loss scale with device='cuda'.
    opt._scale = torch.tensor([1.0], dtype=torch.float)
    opt.is_stub_optimizer = optimizer is None  # the rest of FP32Optimizer.__init__
    return opt
