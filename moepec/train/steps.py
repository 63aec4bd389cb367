"""One training step and its parts: optimizer and schedule, forward/backward with
gradient averaging, the optimizer step, evaluation, and a weight digest.

Data parallel and expert parallel alike: the model carries its
:class:`~moepec.models.parallel.ExpertParallel` (``model.ep``), and these functions choose the
collectives from it, so the trainer calls them the same way in every layout. Every
function that communicates is a collective over the whole job: all ranks call it, in
the same order, on the main thread.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch.optim.lr_scheduler import LambdaLR

from moepec.models import GPTMoE, RoutingStats
from moepec.models.parallel import NO_EXPERT_PARALLEL, ExpertParallel
from moepec.train import dist
from moepec.train.config import TrainConfig

__all__ = [
    "StepResult",
    "build_optimizer",
    "build_scheduler",
    "evaluate",
    "forward_backward",
    "optimizer_step",
    "param_digest",
    "train_step",
]


@dataclass(slots=True)
class StepResult:
    """What one forward/backward produced, already averaged over ranks."""

    loss: float
    """Language-model cross-entropy (nats/token), mean over ranks."""
    aux_loss: float
    """Load-balancing loss (summed over MoE layers), mean over ranks."""
    dropped: int
    """Token assignments dropped for capacity, summed over MoE layers and ranks."""
    routing: list[RoutingStats]
    """This rank's routing stats, one per MoE layer."""


def _ep(model: torch.nn.Module) -> ExpertParallel:
    return getattr(model, "ep", NO_EXPERT_PARALLEL)


def param_digest(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a model's (or state dict's) tensors by name: equal digests = equal weights."""
    state = (model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module)
             else model_or_state)
    h = hashlib.sha256()
    for name, p in sorted(state.items()):
        h.update(name.encode())
        h.update(_raw_bytes(p))
    return h.hexdigest()


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in native order (on the CPU, contiguous, conjugation resolved)."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings, none on biases and norms.

    Decided by name rather than ``p.dim()`` because stacked expert biases are 2-D
    ([E, F]); this way both expert layouts train identically.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        is_bias = leaf in ("bias", "b1", "b2") or ".ln" in name or name.startswith("ln")
        (no_decay if is_bias else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.min_lr at cfg.steps."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        span = max(1, cfg.steps - cfg.warmup)
        progress = min(1.0, (step - cfg.warmup) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def forward_backward(model: GPTMoE, x: torch.Tensor, y: torch.Tensor,
                     group: torch_dist.ProcessGroup | None = None) -> StepResult:
    """Forward, backward and gradient averaging over ``group`` (collective on all ranks).

    ``group`` is the whole job (None: the default group). With expert parallelism
    (``model.ep``) experts' gradients are combined over their replicas instead, see
    :func:`moepec.train.dist.average_gradients_ep`; either way every rank ends with the
    data-parallel gradient. Gradients are accumulated into ``.grad`` (the caller
    zeroes them after the optimizer step). Returns losses averaged and drops summed
    over ranks.
    """
    model.train()
    out = model(x, y)
    assert out.loss is not None and out.lm_loss is not None
    out.loss.backward()
    dist.average_gradients_ep(model, _ep(model), group)
    dropped = sum(s.dropped for s in out.routing)
    # One small all_reduce for the scalars the log shows.
    stats = torch.tensor([out.lm_loss.item(), out.aux_loss.item(), float(dropped)],
                         dtype=torch.float64, device=x.device)
    dist.all_reduce_sum(stats, group)
    n = dist.world_size(group)
    return StepResult(loss=stats[0].item() / n, aux_loss=stats[1].item() / n,
                      dropped=int(stats[2].item()), routing=out.routing)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: LambdaLR, grad_clip: float) -> float:
    """Clip, step the optimizer and the schedule, zero the gradients; returns grad norm.

    Gradients must already be averaged over ranks, so every rank clips alike and the
    weights stay identical. With expert parallelism the norm covers every expert
    (collective over the EP group). Returns NaN when clipping is disabled.
    """
    norm = math.nan
    if grad_clip > 0:
        norm = dist.clip_grad_norm_ep(model, grad_clip, _ep(model))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def train_step(model: GPTMoE, optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
               x: torch.Tensor, y: torch.Tensor, grad_clip: float,
               group: torch_dist.ProcessGroup | None = None) -> StepResult:
    """One whole step without checkpoint hooks: forward_backward then optimizer_step."""
    result = forward_backward(model, x, y, group)
    optimizer_step(model, optimizer, scheduler, grad_clip)
    return result


@torch.no_grad()
def evaluate(model: GPTMoE, batches: list[tuple[torch.Tensor, torch.Tensor]],
             group: torch_dist.ProcessGroup | None = None,
             device: torch.device | str = "cpu") -> float | None:
    """Mean validation LM loss per token over all ranks' batches (collective).

    Under expert parallelism a forward is a collective over the EP group, so a rank
    with fewer batches than its group's largest count runs uncounted forwards on a
    placeholder sequence until the group is even. Returns None when no rank has a
    validation batch.
    """
    model.eval()
    ep = _ep(model)
    n_forwards = len(batches)
    if ep.enabled:
        count = torch.tensor([n_forwards], dtype=torch.int64, device=device)
        torch_dist.all_reduce(count, op=torch_dist.ReduceOp.MAX, group=ep.group)
        n_forwards = int(count.item())
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss * tokens, tokens]
    for i in range(n_forwards):
        if i >= len(batches):
            pad = torch.zeros(1, model.cfg.seq_len, dtype=torch.int64, device=device)
            model(pad)  # only feeds the EP group's all-to-alls; result unused
            continue
        x, y = batches[i]
        x, y = x.to(device), y.to(device)
        out = model(x, y)
        assert out.lm_loss is not None
        total[0] += out.lm_loss.double() * y.numel()
        total[1] += y.numel()
    dist.all_reduce_sum(total, group)
    model.train()
    return None if total[1].item() == 0 else total[0].item() / total[1].item()
