"""Reference GPT-MoE models. Knows nothing of checkpoints (DESIGN.md layer 1)."""

from moepec.models.configs import (
    CONFIGS,
    ParamCounts,
    checkpoint_bytes,
    config_names,
    count_parameters,
    get_config,
)
from moepec.models.gpt_moe import (
    EXPERT_LAYOUTS,
    GPTMoE,
    GPTMoEConfig,
    ModelOutput,
    RoutingStats,
    convert_expert_layout,
)

__all__ = [
    "CONFIGS",
    "EXPERT_LAYOUTS",
    "GPTMoE",
    "GPTMoEConfig",
    "ModelOutput",
    "ParamCounts",
    "RoutingStats",
    "checkpoint_bytes",
    "config_names",
    "convert_expert_layout",
    "count_parameters",
    "get_config",
]
