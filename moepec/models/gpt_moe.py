"""A GPT with Mixture-of-Experts FFN layers, in the style of DeepSpeed's GPT-MoE.

Decoder-only, pre-LayerNorm, learned position embeddings, GELU FFNs with biases and
input/output embeddings tied (the output head reuses ``tok_emb.weight``, so the state
dict holds the matrix once). Every ``moe_every``-th block (blocks 1, 3, 5, ... for the
default 2) replaces its dense FFN with an MoE FFN: a linear router picks ``top_k``
experts per token and only those experts run on it.

Shape legend (tensor names and comments use these letters):
    B batch, S sequence length, T = B*S tokens, D d_model, F d_ff, E experts,
    K top_k, C expert capacity, V vocabulary.

Parameter names are a contract other modules rely on (expert discovery, checkpoints):
    stacked layout  ``blocks.{i}.ffn.experts.w1`` [E, D, F], ``.b1`` [E, F],
                    ``.w2`` [E, F, D], ``.b2`` [E, D]            (torchtitan style)
    modules layout  ``blocks.{i}.ffn.experts.{e}.w1`` [D, F], ``.b1`` [F],
                    ``.w2`` [F, D], ``.b2`` [D]                   (Hugging Face Mixtral style)
    router          ``blocks.{i}.ffn.router.weight`` [E, D] (no bias)
    dense FFN       ``blocks.{i}.ffn.w1`` [D, F], ``.b1``, ``.w2``, ``.b2``
No other parameter name contains the word ``experts``.

The MoE FFN (routing, capacity, expert parallelism) is in :mod:`moepec.models.moe`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moepec.errors import ConfigError
from moepec.models.moe import (  # noqa: F401 - re-exported
    Expert,
    FeedForward,
    GroupedExperts,
    MoEConfig,
    MoEFeedForward,
    RoutingStats,
    ffn,
)
from moepec.models.parallel import NO_EXPERT_PARALLEL, ExpertParallel

__all__ = [
    "EXPERT_LAYOUTS",
    "GPTMoE",
    "GPTMoEConfig",
    "ModelOutput",
    "RoutingStats",
    "convert_expert_layout",
]

EXPERT_LAYOUTS = ("stacked", "modules")
# The four tensors of one expert (and of a dense FFN), in a fixed order.
_FFN_TENSORS = ("w1", "b1", "w2", "b2")


@dataclass(kw_only=True, slots=True)
class GPTMoEConfig:
    """Shape and routing hyper-parameters of :class:`GPTMoE`."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte tokenizer, 50257 for the GPT-2 BPE."""
    seq_len: int = 128
    """Context length: the longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 128
    """Hidden size D."""
    d_ff: int = 512
    """Inner size F of every FFN, dense or expert."""
    n_experts: int = 8
    """Experts E per MoE layer."""
    top_k: int = 1
    """Experts per token: 1 (Switch) or 2 (GShard; gate weights renormalised)."""
    capacity_factor: float = 1.25
    """Expert capacity C = ceil(capacity_factor * T * top_k / E); extra assignments drop."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss, summed over MoE layers."""
    expert_layout: str = "stacked"
    """How expert weights are stored: ``stacked`` ([E, ...] tensors) or ``modules``."""
    moe_every: int = 2
    """Block i is MoE iff i % moe_every == moe_every - 1 (2: blocks 1, 3, 5, ...)."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches; 0 keeps runs deterministic."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff",
                    "n_experts", "moe_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "pick n_head that divides d_model"
            )
        if self.top_k not in (1, 2):
            raise ConfigError(f"model top_k must be 1 or 2, got {self.top_k!r}")
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                "use top_k=1 or more experts"
            )
        if not self.capacity_factor > 0:
            raise ConfigError(
                f"model capacity_factor must be > 0, got {self.capacity_factor!r} "
                "(1.0-2.0 is usual)"
            )
        if self.aux_loss_coef < 0:
            raise ConfigError(f"model aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ConfigError(
                f"model expert_layout must be one of {EXPERT_LAYOUTS}, "
                f"got {self.expert_layout!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model dropout must be in [0, 1), got {self.dropout!r}")

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` holds an MoE FFN (DeepSpeed GPT-MoE: every other block)."""
        return i % self.moe_every == self.moe_every - 1

    @property
    def moe_block_indices(self) -> list[int]:
        """Indices of the MoE blocks, in order."""
        return [i for i in range(self.n_layer) if self.is_moe_block(i)]

    def moe_config(self) -> MoEConfig:
        """What each MoE FFN of this model is built from."""
        return MoEConfig(d_model=self.d_model, d_ff=self.d_ff, n_experts=self.n_experts,
                         top_k=self.top_k, capacity_factor=self.capacity_factor,
                         expert_layout=self.expert_layout)


@dataclass(slots=True)
class ModelOutput:
    """What :meth:`GPTMoE.forward` returns."""

    logits: torch.Tensor
    """[B, S, V] next-token logits."""
    loss: torch.Tensor | None
    """lm_loss + aux_loss_coef * aux_loss; None without targets."""
    lm_loss: torch.Tensor | None
    """Mean cross-entropy over all target tokens; None without targets."""
    aux_loss: torch.Tensor
    """Load-balancing loss summed over MoE layers (0 for a dense model)."""
    routing: list[RoutingStats] = field(default_factory=list)
    """One entry per MoE layer, in block order."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTMoEConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        # [B, S, D] -> [B, H, S, D/H]
        q, k, v = (t.view(B, S, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, S, D)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + ffn(ln2(x))."""

    def __init__(self, cfg: GPTMoEConfig, moe: bool,
                 ep: ExpertParallel = NO_EXPERT_PARALLEL) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn: MoEFeedForward | FeedForward = (
            MoEFeedForward(cfg.moe_config(), ep) if moe else FeedForward(cfg.d_model, cfg.d_ff)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                RoutingStats | None]:
        x = x + self.attn(self.ln1(x))
        if isinstance(self.ffn, MoEFeedForward):
            y, aux, stats = self.ffn(self.ln2(x))
            return x + self.drop(y), aux, stats
        return x + self.drop(self.ffn(self.ln2(x))), None, None


class GPTMoE(nn.Module):
    """The GPT-MoE language model. ``forward(idx, targets=None) -> ModelOutput``.

    ``ep`` (from :func:`moepec.models.parallel.init_expert_parallel`) splits the experts over
    an expert-parallel group; then forward and backward are collectives over
    ``ep.group`` and every rank of it must call them together. None: all experts
    here. Raises ConfigError when ``ep.size`` does not divide ``cfg.n_experts``.
    """

    def __init__(self, cfg: GPTMoEConfig, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ep = ep if ep is not None else NO_EXPERT_PARALLEL
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe_block(i), self.ep)
                                    for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters()

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE blocks (length of ``ModelOutput.routing``)."""
        return sum(isinstance(b.ffn, MoEFeedForward) for b in self.blocks)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled.

        Residual-branch outputs (attention ``proj`` and FFN ``w2``) use std
        0.02 / sqrt(2 * n_layer) so the residual stream's variance does not grow with
        depth. Parameters are visited in ``named_parameters`` order, so a fixed
        ``torch.manual_seed`` gives a fixed model.

        Under expert parallelism the parameters of the whole (non-EP) model are drawn
        in that same order and each rank keeps its own experts' part, so every rank gets
        the same non-expert weights and global expert e is initialised exactly as in
        a non-EP model with the same seed.
        """
        if not self.ep.enabled:
            for name, p in self.named_parameters():
                self._init_param(name, p)
            return
        with torch.device("meta"):  # names and shapes only; meta init draws no RNG
            full = GPTMoE(self.cfg)
        local = dict(self.named_parameters())
        n_local = self.cfg.n_experts // self.ep.size
        lo = self.ep.rank * n_local
        prefixes = tuple(f"{name}.experts." for name, m in full.named_modules()
                         if isinstance(m, MoEFeedForward))
        for name, meta in full.named_parameters():
            value = torch.empty(meta.shape, dtype=meta.dtype, device=self.tok_emb.weight.device)
            self._init_param(name, value)
            prefix = next((pre for pre in prefixes if name.startswith(pre)), None)
            if prefix is None:
                local[name].copy_(value)
                continue
            tail = name[len(prefix):]
            if "." not in tail:  # stacked [E, ...]: keep this rank's slice of dim 0
                local[name].copy_(value[lo:lo + n_local])
                continue
            e, leaf = tail.split(".", 1)  # modules: experts.{global e}.{leaf}
            if lo <= int(e) < lo + n_local:
                local[f"{prefix}{int(e) - lo}.{leaf}"].copy_(value)

    def _init_param(self, name: str, p: torch.Tensor) -> None:
        """Initialise one parameter (named as in the non-EP model) in place."""
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        leaf = name.rsplit(".", 1)[-1]
        if name.startswith("ln") or ".ln" in name:
            nn.init.ones_(p) if leaf == "weight" else nn.init.zeros_(p)
        elif leaf in ("bias", "b1", "b2"):
            nn.init.zeros_(p)
        elif leaf == "w2" or name.endswith("attn.proj.weight"):
            nn.init.normal_(p, mean=0.0, std=resid_std)
        else:
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> ModelOutput:
        """idx, targets: int64 [B, S] with S <= seq_len. Routing stats are on CPU."""
        B, S = idx.shape
        if S > self.cfg.seq_len:
            raise ConfigError(
                f"sequence length {S} exceeds the model's seq_len={self.cfg.seq_len}; "
                "use shorter sequences or a model config with a longer context"
            )
        pos = torch.arange(S, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        aux_total = torch.zeros((), device=idx.device)
        routing: list[RoutingStats] = []
        for block in self.blocks:
            x, aux, stats = block(x)
            if stats is not None:
                aux_total = aux_total + aux
                routing.append(stats)
        # Tied head: reuse the token embedding matrix as the output projection.
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)  # [B, S, V]
        if targets is None:
            return ModelOutput(logits=logits, loss=None, lm_loss=None, aux_loss=aux_total,
                               routing=routing)
        lm_loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        loss = lm_loss + self.cfg.aux_loss_coef * aux_total
        return ModelOutput(logits=logits, loss=loss, lm_loss=lm_loss, aux_loss=aux_total,
                           routing=routing)


def convert_expert_layout(state_dict: dict[str, torch.Tensor], n_experts: int,
                          to: str) -> dict[str, torch.Tensor]:
    """Return a copy of a model state dict with its experts stored in layout ``to``.

    ``to="modules"`` splits every ``...experts.{w1,b1,w2,b2}`` [E, ...] into
    ``...experts.{e}.{name}``; ``to="stacked"`` stacks them back. Keys without experts,
    and keys already in the target layout, pass through unchanged. Tensors are cloned
    so the result never aliases the input. Raises ConfigError for an unknown layout
    or when a stacked tensor's first dimension is not ``n_experts``.
    """
    if to not in EXPERT_LAYOUTS:
        raise ConfigError(f"convert_expert_layout: to must be one of {EXPERT_LAYOUTS}, got {to!r}")
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}  # stacked key -> {expert: tensor}
    for key, value in state_dict.items():
        parts = key.split(".")
        if "experts" not in parts:
            out[key] = value.clone()
            continue
        i = parts.index("experts")
        tail = parts[i + 1:]
        prefix = ".".join(parts[: i + 1])
        if to == "modules" and len(tail) == 1 and tail[0] in _FFN_TENSORS:
            if value.shape[0] != n_experts:
                raise ConfigError(
                    f"{key} has {value.shape[0]} experts in dim 0, expected {n_experts}; "
                    "pass the model's n_experts"
                )
            for e in range(n_experts):
                out[f"{prefix}.{e}.{tail[0]}"] = value[e].clone()
        elif to == "stacked" and len(tail) == 2 and tail[0].isdigit():
            stacked_key = f"{prefix}.{tail[1]}"
            if stacked_key not in pending:
                out[stacked_key] = value  # placeholder that keeps the key order; replaced below
            pending.setdefault(stacked_key, {})[int(tail[0])] = value
        else:
            out[key] = value.clone()
    for key, per_expert in pending.items():
        if sorted(per_expert) != list(range(n_experts)):
            raise ConfigError(
                f"{key}: found experts {sorted(per_expert)}, expected 0..{n_experts - 1}; "
                "pass the model's n_experts or a complete state dict"
            )
        out[key] = torch.stack([per_expert[e] for e in range(n_experts)])
    return out
