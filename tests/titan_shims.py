"""CPU shims for torchtitan 0.3.0 (the test helper of tests/test_torchtitan.py; none of this
is in the library). torchtitan is written for CUDA: each line below says which of its
limits it works around so that its real Trainer runs on this machine's CPUs under gloo.

Imported by tests/titan_launch.py before torchtitan builds anything; the attention swap
is an ``@override`` activated with ``--override.imports titan_shims.sdpa_attention``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torchtitan.tools.utils picks "cuda" when no accelerator is found: make it "cpu".
torch._utils._get_available_device_type = lambda: "cpu"
# The metrics processor's memory monitor calls torch.<device> memory APIs torch.cpu lacks.
for _name, _value in {"get_device_name": lambda *a: "cpu", "current_device": lambda: 0,
                      "reset_peak_memory_stats": lambda *a: None,
                      "empty_cache": lambda: None, "synchronize": lambda *a: None,
                      "memory_stats": lambda *a: {}}.items():
    if not hasattr(torch.cpu, _name) or _name in ("current_device", "synchronize"):
        setattr(torch.cpu, _name, _value)


class _CpuProps:  # torch.cpu has no get_device_properties(...).total_memory
    total_memory = 1 << 40


torch.cpu.get_device_properties = lambda *a: _CpuProps()
# torch.distributed.set_timeout is newer than torch 2.13 (torchtitan calls it after step 1).
if not hasattr(dist, "set_timeout"):
    dist.set_timeout = lambda timeout, group=None: None
# torchtitan's barrier passes device_ids, which gloo refuses.
_barrier = dist.barrier
dist.barrier = lambda group=None, async_op=False, device_ids=None: _barrier(group, async_op)

import torchtitan.tools.utils as _tt_utils  # noqa: E402  (after the device shim)

_tt_utils.device_type, _tt_utils.device_module = "cpu", torch.cpu

import torchtitan.distributed.fsdp as _tt_fsdp  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402


def _sum_reductions(model: torch.nn.Module) -> None:
    # gloo has no PREMUL_SUM, which FSDP uses for a divide factor of 1.0: plain sums.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


_tt_fsdp.disable_fsdp_gradient_division = _sum_reductions

from torchtitan.config.override import override  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)


@override(target=FlexAttention.Config, description="CPU: SDPA (FlexAttention has no CPU "
          "backward)")
def sdpa_attention(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    # FlexAttention has no CPU backward: causal scaled-dot-product attention instead.
    return ScaledDotProductAttention.Config()


def deepseek_v3_tiny():
    """torchtitan's ``deepseek_v3_debugmodel`` config with a smaller model (a test-time
    budget, not a CPU limit: see titan_models.tiny_deepseek_v3); ``--module titan_shims
    --config deepseek_v3_tiny``."""
    import dataclasses

    from titan_models import tiny_deepseek_v3
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.model_spec = dataclasses.replace(config.model_spec, model=tiny_deepseek_v3())
    return config


def _register_tiny() -> None:
    # Test size, not a CPU limit: list the tiny config among deepseek_v3's own, so that
    # `--module moepec.integrations.torchtitan --config deepseek_v3_tiny` finds it the way
    # it finds every upstream config name.
    import torchtitan.models.deepseek_v3.config_registry as registry

    registry.deepseek_v3_tiny = deepseek_v3_tiny


_register_tiny()
