"""Named model configurations and parameter/byte accounting.

Sizes are counted on the meta device, so even the paper-sized configurations are counted
instantly and without allocating their weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from moepec.errors import ConfigError
from moepec.models.gpt_moe import GPTMoE, GPTMoEConfig

__all__ = [
    "CONFIGS",
    "ParamCounts",
    "checkpoint_bytes",
    "config_names",
    "count_parameters",
    "get_config",
]

# Name -> GPTMoEConfig arguments. The paper configs follow arXiv 2408.04307 Table 1
# (GPT-2 shapes, the BPE vocabulary, an MoE FFN in every other block, top-1 routing).
CONFIGS: dict[str, dict[str, Any]] = {
    # Unit tests: a forward+backward takes a few milliseconds on one CPU core.
    "tiny": dict(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32, d_ff=64,
                 n_experts=4, top_k=1),
    # The CPU demo: sized for a few thousand tokens/s on 2 cores (see `moepec demo`).
    "small": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128, d_ff=512,
                  n_experts=8, top_k=1),
    # Paper: 125M dense backbone, 6 MoE layers x 8 experts = 323M parameters.
    "gpt-125m-8e": dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768,
                        d_ff=3072, n_experts=8, top_k=1),
    # Paper: 350M dense backbone, 12 MoE layers x 16 experts.
    "gpt-350m-16e": dict(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024,
                         d_ff=4096, n_experts=16, top_k=1),
}


def config_names() -> list[str]:
    """Names accepted by :func:`get_config`, in definition order."""
    return list(CONFIGS)


def get_config(name: str, **overrides: Any) -> GPTMoEConfig:
    """Build the named config with ``overrides`` applied (validated like any config).

    Raises ConfigError for an unknown name or an unknown override field.
    """
    if name not in CONFIGS:
        raise ConfigError(
            f"unknown model config {name!r}; valid names: {', '.join(config_names())}"
        )
    fields = {f.name for f in dataclasses.fields(GPTMoEConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"unknown model override(s) {', '.join(unknown)}; valid fields: "
            f"{', '.join(sorted(fields))}"
        )
    return GPTMoEConfig(**{**CONFIGS[name], **overrides})


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter counts of a model configuration."""

    total: int
    """All parameters (tied embeddings counted once)."""
    expert: int
    """Parameters inside experts, summed over all MoE layers."""
    non_expert: int
    """total - expert: embeddings, attention, norms, dense FFNs, routers."""
    per_expert: int
    """Parameters of one expert (0 for a model without MoE layers)."""
    n_moe_layers: int
    """Number of MoE layers."""
    n_experts: int
    """Experts per MoE layer."""


def count_parameters(cfg: GPTMoEConfig) -> ParamCounts:
    """Count the parameters of ``GPTMoE(cfg)`` by building it on the meta device.

    A parameter is an expert parameter iff its name contains ``experts`` (the naming
    contract of :mod:`moepec.models.gpt_moe`).
    """
    with torch.device("meta"):
        model = GPTMoE(cfg)
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "experts" in name.split("."):
            expert += p.numel()
    n_moe = model.num_moe_layers
    per_expert = expert // (n_moe * cfg.n_experts) if n_moe else 0
    return ParamCounts(total=total, expert=expert, non_expert=total - expert,
                       per_expert=per_expert, n_moe_layers=n_moe, n_experts=cfg.n_experts)


def checkpoint_bytes(cfg: GPTMoEConfig, dtype_bytes: int = 4, adam: bool = True) -> int:
    """Bytes of a full checkpoint: weights, plus Adam ``exp_avg`` and ``exp_avg_sq``.

    ``dtype_bytes`` is the size of one stored element (4 for fp32, the default for
    weights and Adam moments alike). Step counters and other small state are ignored.
    """
    if dtype_bytes < 1:
        raise ConfigError(f"dtype_bytes must be >= 1, got {dtype_bytes}")
    copies = 3 if adam else 1
    return count_parameters(cfg).total * dtype_bytes * copies
