"""What ``moepec simulate`` and ``moepec advise`` plan for: the model's shape, the
cluster, and how often it fails.

A model comes from a named config (:mod:`moepec.models.configs`), a Hugging Face
``config.json`` (Mixtral, Qwen-MoE, DeepSeek-V2/V3 shapes) or explicit counts. Only
counts matter to the simulator: expert and non-expert parameters, MoE layers, experts
per layer, top-k. Shared experts are non-expert state (every checkpoint saves them).
Every user mistake raises :class:`moepec.errors.ConfigError` with a one-line fix.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moepec.errors import ConfigError

__all__ = ["FT_GROUPS", "FT_HEAL_S", "FT_PAUSE_S", "STRATEGIES", "Cluster", "Failures",
           "ModelShape", "Plan", "Timing", "strategy", "meta_mtbf_hours", "shape_from_hf",
           "shape_from_name"]

# Meta, "Revisiting Reliability in Large-Scale Machine Learning Research Clusters"
# (Kokolis et al., arXiv 2410.21680): mean time to failure 7.9 h at 1,024 GPUs and
# 1.8 h at 16,384. We fit MTTF = 7.9 h * (GPUs / 1024) ** -alpha through both points.
META_POINTS = ((1024, 7.9), (16384, 1.8))
META_ALPHA = math.log(META_POINTS[0][1] / META_POINTS[1][1]) / math.log(
    META_POINTS[1][0] / META_POINTS[0][0])

# Replica groups on torchft (the pec-ft strategy), measured on a 2-core CPU machine with
# gloo and a 1 s Lighthouse heartbeat timeout: torchft 0.2.0, two groups, one SIGKILLed
# (issue 22; `moepec bench ft` measures the same, its medians are in docs/results.md).
# The survivors committed their next step 1.0-1.1 s after the kill and the killed group
# rejoined, healed from the survivor, 1.9-2.2 s after it; the defaults are the slow ends.
FT_PAUSE_S = 1.1
FT_HEAL_S = 2.2
FT_GROUPS = 2


def meta_mtbf_hours(gpus: int) -> float:
    """Job MTBF in hours at ``gpus`` GPUs on Meta's published curve (power-law fit)."""
    if gpus < 1:
        raise ConfigError(f"gpus must be >= 1, got {gpus}")
    return META_POINTS[0][1] * (gpus / META_POINTS[0][0]) ** -META_ALPHA


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The counts the simulator needs of an MoE model."""

    name: str
    """Where it came from (config name or file)."""
    expert_params: int
    """Parameters of routed experts, all MoE layers."""
    non_expert_params: int
    """Everything else: embeddings, attention, dense FFNs, shared experts, routers, norms."""
    n_moe_layers: int
    """MoE layers."""
    n_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts per token."""

    def __post_init__(self) -> None:
        if self.expert_params < 0 or self.non_expert_params < 0:
            raise ConfigError("parameter counts must be >= 0")
        if self.n_moe_layers < 1 or self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"need >= 1 MoE layer, >= 1 expert and 1 <= top_k <= experts; "
                              f"got {self.n_moe_layers}, {self.n_experts}, {self.top_k}")

    @property
    def total_params(self) -> int:
        return self.expert_params + self.non_expert_params

    @property
    def per_expert(self) -> int:
        return self.expert_params // (self.n_moe_layers * self.n_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (non-expert + top-k experts per layer)."""
        return self.non_expert_params + self.n_moe_layers * self.top_k * self.per_expert

    def checkpoint_params(self, k: int) -> int:
        """Parameters a checkpoint saving ``k`` experts per MoE layer holds."""
        return self.non_expert_params + self.n_moe_layers * min(k, self.n_experts) \
            * self.per_expert


def shape_from_name(name: str) -> ModelShape:
    """The shape of a named moepec config (counted on the meta device)."""
    from moepec.models.configs import count_parameters, get_config

    cfg = get_config(name)
    c = count_parameters(cfg)
    return ModelShape(name=name, expert_params=c.expert, non_expert_params=c.non_expert,
                      n_moe_layers=c.n_moe_layers, n_experts=c.n_experts, top_k=cfg.top_k)


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise ConfigError(f"config.json lacks {' / '.join(names)}; is it an MoE model's "
                          "Hugging Face config?")
    return default


def _attention_params(cfg: dict[str, Any], d: int) -> int:
    heads = int(_first(cfg, "num_attention_heads"))
    if cfg.get("kv_lora_rank"):  # DeepSeek multi-head latent attention
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        v, kv_rank = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"])
        q_rank = cfg.get("q_lora_rank")
        q = d * heads * (nope + rope) if not q_rank else \
            d * q_rank + q_rank + q_rank * heads * (nope + rope)
        kv = d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * d
    head_dim = int(cfg.get("head_dim") or d // heads)
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    bias = 3 * heads * head_dim if cfg.get("qkv_bias") or "qwen2" in str(
        cfg.get("model_type", "")) else 0
    return 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + bias


def _moe_layers(cfg: dict[str, Any], n_layers: int) -> list[bool]:
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    every = int(cfg.get("moe_layer_freq") or cfg.get("decoder_sparse_step") or 1)
    skip = set(cfg.get("mlp_only_layers") or [])
    return [i >= first_dense and i % every == 0 and i not in skip
            if "first_k_dense_replace" in cfg else (i + 1) % every == 0 and i not in skip
            for i in range(n_layers)]


def shape_from_hf(path: str) -> ModelShape:
    """The shape of a Hugging Face MoE ``config.json`` (gated FFNs, 3 matrices each).

    Raises ConfigError for a missing or unreadable file and for a config without experts.
    """
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config.json {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} must hold a JSON object (a Hugging Face config.json)")
    try:
        return _hf_shape(cfg, path)
    except (TypeError, ValueError) as exc:  # a field of the wrong type: "x" for a size
        raise ConfigError(f"{path}: a field is not the number it should be ({exc}); check "
                          f"its sizes and expert counts") from None


def _hf_shape(cfg: dict, path: str) -> ModelShape:
    d, n_layers = int(_first(cfg, "hidden_size")), int(_first(cfg, "num_hidden_layers"))
    n_exp = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts"))
    top_k = int(_first(cfg, "num_experts_per_tok", "moe_top_k"))
    dense_ff = int(_first(cfg, "intermediate_size"))
    moe_ff = int(_first(cfg, "moe_intermediate_size", default=dense_ff))
    shared = int(cfg.get("n_shared_experts") or 0) * moe_ff \
        + int(cfg.get("shared_expert_intermediate_size") or 0)
    vocab = int(_first(cfg, "vocab_size"))
    moe = _moe_layers(cfg, n_layers)
    n_moe = sum(moe)
    if n_moe == 0:
        raise ConfigError(f"{path} describes no MoE layer; check its expert fields")
    embed = vocab * d * (1 if cfg.get("tie_word_embeddings") else 2)
    per_layer = _attention_params(cfg, d) + 2 * d  # attention and two norms
    dense_layers = n_layers - n_moe
    router = d * n_exp + (d if cfg.get("shared_expert_intermediate_size") else 0)
    non_expert = embed + d + n_layers * per_layer + dense_layers * 3 * d * dense_ff \
        + n_moe * (3 * d * shared + router)
    return ModelShape(name=Path(path).name if Path(path).name != "config.json"
                      else str(Path(path).parent.name or path),
                      expert_params=n_moe * n_exp * 3 * d * moe_ff,
                      non_expert_params=non_expert, n_moe_layers=n_moe, n_experts=n_exp,
                      top_k=top_k)


@dataclass(frozen=True, slots=True)
class Cluster:
    """The machines and their speeds. Bandwidths in bytes/s."""

    gpus: int = 1024
    """GPUs of the job."""
    gpus_per_node: int = 8
    """GPUs per node (a node loss takes this many ranks' RAM)."""
    d2h_bw: float = 12e9
    """Device-to-host copy bandwidth per GPU (pinned memory)."""
    storage_bw_gpu: float = 2e9
    """Storage write bandwidth one rank reaches."""
    storage_bw_node: float = 5e9
    """Storage write bandwidth of one node (its NICs)."""
    storage_bw_total: float = 200e9
    """Aggregate bandwidth of the storage system."""
    read_bw_gpu: float = 4e9
    """Storage read bandwidth per rank at recovery."""
    host_ram_per_node: float = 2e12
    """Host RAM per node, bytes (the RAM tier must fit in a share of it)."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"gpus and gpus per node must be >= 1, got {self.gpus}, "
                              f"{self.gpus_per_node}")
        for name in ("d2h_bw", "storage_bw_gpu", "storage_bw_node", "storage_bw_total",
                     "read_bw_gpu", "host_ram_per_node"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def write_seconds(self, total_bytes: float) -> float:
        """Seconds to write ``total_bytes`` spread evenly over all ranks (fully sharded)."""
        per_gpu = total_bytes / self.gpus
        return max(per_gpu / self.storage_bw_gpu,
                   per_gpu * min(self.gpus, self.gpus_per_node) / self.storage_bw_node,
                   total_bytes / self.storage_bw_total)


@dataclass(frozen=True, slots=True)
class Failures:
    """How the job fails and comes back."""

    mtbf_s: float
    """Mean time between failures of the whole job, seconds."""
    ram_survives: float = 0.5
    """Share of failures after which the node's RAM survives (process crash)."""
    detect_s: float = 60.0
    """From the failure to the start of the restart."""
    restart_s: float = 240.0
    """Rescheduling and re-initialising the job (loading the checkpoint is extra)."""
    sampling: str = "stratified"
    """``stratified`` (quantiles of the exponential, shuffled) or ``random``."""
    heal_s: float = FT_HEAL_S
    """Replica groups only: from a fault to the failed group's rejoin, healed from a live
    peer (at scale: its workers' restart, plus rescheduling a lost node, plus the state
    transfer)."""
    ft_pause_s: float = FT_PAUSE_S
    """Replica groups only: what a fault in another group costs the survivors (the fault
    to their next committed step: heartbeat timeout, new quorum, aborted step)."""

    def __post_init__(self) -> None:
        if not self.mtbf_s > 0:
            raise ConfigError(f"MTBF must be > 0, got {self.mtbf_s}")
        if not 0 <= self.ram_survives <= 1 or self.detect_s < 0 or self.restart_s < 0:
            raise ConfigError("need 0 <= ram_survives <= 1 and detect/restart times >= 0")
        if not (math.isfinite(self.heal_s) and math.isfinite(self.ft_pause_s)) \
                or self.heal_s < 0 or self.ft_pause_s < 0:
            raise ConfigError(f"heal and survivor pause times must be finite seconds >= 0 "
                              f"(--heal-s, --ft-pause-s), got {self.heal_s}, {self.ft_pause_s}")
        if self.sampling not in ("stratified", "random"):
            raise ConfigError(f"sampling is stratified or random, got {self.sampling!r}")

    def gaps(self, wall_s: float, seed: int) -> list[float]:
        """Seconds between failures over ``wall_s`` of wall time."""
        rng = random.Random(seed)
        if self.sampling == "random":
            out, t = [], 0.0
            while True:
                g = rng.expovariate(1 / self.mtbf_s)
                if t + g >= wall_s:
                    return out
                out.append(g)
                t += g
        n = max(1, round(wall_s / self.mtbf_s))
        out = [-self.mtbf_s * math.log(1 - (i + 0.5) / n) for i in range(n)]
        rng.shuffle(out)
        return out


@dataclass(frozen=True, slots=True)
class Timing:
    """Iteration time and per-checkpoint costs in seconds, from a shape and cluster."""

    iteration_s: float
    """One training step."""
    bytes_per_param: float = 12.0
    """Stored bytes per parameter (fp32 weight + two fp32 Adam moments = 12)."""
    fixed_block_s: float = 0.002
    """What an overlapped snapshot still blocks per checkpoint (measured: ~2 ms)."""
    commit_s: float = 1.0
    """Fixed cost of each persist besides its bytes: the ranks meet, the manifest is
    written (so a write path cannot commit more often than this)."""

    def __post_init__(self) -> None:
        if not self.iteration_s > 0 or not self.bytes_per_param > 0 or self.fixed_block_s < 0 \
                or self.commit_s < 0:
            raise ConfigError("iteration time and bytes per parameter must be > 0")


STRATEGIES = ("full-sync", "full-async", "pec", "pec-2level", "pec-dynamic", "pec-ram",
              "pec-ram-replica", "pec-ft")


@dataclass(frozen=True, slots=True)
class Plan:
    """One checkpointing strategy with its settings."""

    name: str
    """Label in tables and plots."""
    interval: int
    """Steps between checkpoints."""
    k_persist: int | None = None
    """Experts per MoE layer written to storage; None = all (a full checkpoint)."""
    k_snapshot: int | None = None
    """Experts per MoE layer copied to RAM; None = k_persist."""
    overlap: bool = True
    """The snapshot copy overlaps the next step (moepec); False: it blocks (DCP)."""
    async_persist: bool = True
    """The write runs in the background."""
    ram_tier: bool = False
    """Recover from the newest RAM snapshot when the node's RAM survived."""
    replicas: bool = False
    """The RAM snapshot is replicated to another node: a node loss keeps it too."""
    dynamic_k: bool = False
    """Double K_persist after a recovery that leaves PLT over budget."""
    replica_groups: int = 1
    """Data-parallel replica groups that train on through a fault in one of them (torchft,
    see :mod:`moepec.plan.replicas`); a cold start only when every group is down. 1: every
    fault restarts the whole job from its checkpoints."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"interval must be >= 1 step, got {self.interval}")
        if self.k_persist is not None and self.k_persist < 1:
            raise ConfigError(f"K must be >= 1, got {self.k_persist}")
        if self.replica_groups < 1:
            raise ConfigError(f"replica groups (--ft-groups) must be >= 1, got "
                              f"{self.replica_groups}")


def strategy(name: str, interval: int, k: int = 1, k_snapshot: int | None = None,
             groups: int = FT_GROUPS) -> Plan:
    """The named strategy (see STRATEGIES) at this interval and K; ``groups`` is the
    number of replica groups of ``pec-ft`` (the others restart the whole job)."""
    presets: dict[str, dict[str, Any]] = {
        "full-sync": dict(overlap=False, async_persist=False),
        "full-async": dict(overlap=False),
        "pec": dict(k_persist=k),
        "pec-2level": dict(k_persist=k, k_snapshot=k_snapshot or min(2 * k, 10**9),
                           ram_tier=True),
        "pec-dynamic": dict(k_persist=k, dynamic_k=True),
        "pec-ram": dict(k_persist=k, k_snapshot=k_snapshot, ram_tier=True),
        "pec-ram-replica": dict(k_persist=k, k_snapshot=k_snapshot, ram_tier=True,
                                replicas=True),
        # pec's checkpoints (spread over the ranks of all groups) serve the cold starts
        "pec-ft": dict(k_persist=k, replica_groups=groups),
    }
    if name not in presets:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return Plan(name=name, interval=interval, **presets[name])
