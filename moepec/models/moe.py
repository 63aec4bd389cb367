"""The Mixture-of-Experts FFN of :class:`moepec.models.gpt_moe.GPTMoE`: router, experts
(both layouts), capacity and expert-parallel dispatch.

Shape legend: T tokens, D d_model, F d_ff, E experts, K top_k, C expert capacity.

Capacity rule (deterministic): each expert processes at most
``C = ceil(capacity_factor * T * K / E)`` token assignments per forward. Assignments
are admitted first-choice before second-choice (as in GShard), and within one choice
rank in token order (batch row, then position). Assignments past an expert's capacity
are dropped: that token gets no contribution from that expert and keeps only its
residual stream. Drops are reported in :class:`RoutingStats`.

Expert parallelism (``GPTMoE(cfg, ep)``, see :mod:`moepec.models.parallel`): a rank holds
E_local = E / ep.size experts per MoE layer (global ids ``ep.rank * E_local + i``), under
the same parameter names with E_local in place of E. The router stays replicated. Each
rank routes its own tokens exactly as without EP (gating, top-k, capacity on its local
T), so an EP run computes what the data-parallel run computes. Kept token copies then
travel to the ranks holding their experts and back with two autograd-aware
``all_to_all_single`` calls (``torch.distributed.nn.functional``) with variable splits;
gloo supports it in our torch build (checked with a 2-process probe, forward and
backward), so no all_gather fallback is needed. Variable splits, rather than buffers
padded to capacity, send only real tokens and stay correct when ranks hold different
numbers of tokens (e.g. a short last validation batch); the price is one small
all-to-all of the per-expert counts per layer.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor

from moepec.models.parallel import NO_EXPERT_PARALLEL, ExpertParallel


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The numbers one MoE FFN layer is built from (``GPTMoEConfig.moe_config()`` gives
    them for a whole model). Its own type, so this module does not depend on the model
    that uses it; validated by :class:`~moepec.models.gpt_moe.GPTMoEConfig`."""

    d_model: int
    """Hidden size D."""
    d_ff: int
    """Inner size F of every expert."""
    n_experts: int
    """Experts E of the layer (over all expert-parallel ranks)."""
    top_k: int
    """Experts per token K."""
    capacity_factor: float
    """Expert capacity C = ceil(capacity_factor * T * K / E)."""
    expert_layout: str
    """``stacked`` ([E, ...] tensors) or ``modules`` (one module per expert)."""


@dataclass(slots=True)
class RoutingStats:
    """Token counts of one MoE layer for one forward pass (detached, on CPU)."""

    assigned: torch.Tensor
    """int64 [E]: assignments the router sent to each global expert; sums to T * top_k
    (T: this rank's tokens, also under expert parallelism)."""
    processed: torch.Tensor
    """int64 [E]: assignments of this rank's tokens each global expert processed
    (<= capacity)."""
    dropped: int
    """assigned.sum() - processed.sum(): assignments lost to the capacity limit."""
    capacity: int
    """Per-expert capacity C used in this forward."""


def ffn(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
        b2: torch.Tensor) -> torch.Tensor:
    """GELU FFN on tokens ``x`` [N, D] with w1 [D, F], b1 [F], w2 [F, D], b2 [D].

    Both expert layouts and the dense FFN call this one function, so equal weights give
    bit-identical outputs whichever way they are stored.
    """
    return torch.addmm(b2, F.gelu(torch.addmm(b1, x, w1)), w2)


class FeedForward(nn.Module):
    """Dense FFN with plain parameters named w1, b1, w2, b2 (no ``nn.Linear`` nesting)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(d_model, d_ff))
        self.b1 = nn.Parameter(torch.zeros(d_ff))
        self.w2 = nn.Parameter(torch.empty(d_ff, d_model))
        self.b2 = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return ffn(x.reshape(-1, shape[-1]), self.w1, self.b1, self.w2, self.b2).view(shape)


class Expert(FeedForward):
    """One expert of the ``modules`` layout: same tensors as a dense FFN."""


class GroupedExperts(nn.Module):
    """All E experts of a layer as stacked parameters (``stacked`` layout)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))  # [E, D, F]
        self.b1 = nn.Parameter(torch.zeros(n_experts, d_ff))  # [E, F]
        self.w2 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))  # [E, F, D]
        self.b2 = nn.Parameter(torch.zeros(n_experts, d_model))  # [E, D]

    def expert_tensors(self, e: int) -> tuple[torch.Tensor, ...]:
        """Local expert ``e``'s (w1, b1, w2, b2).

        Under FSDP x EP (torchtitan's layout) the parameters are DTensors sharded over
        the EP mesh dim on dim 0 (FSDP has all-gathered the dp dim for the forward): the
        rank's own experts are the local tensor, which ``to_local()`` gives with autograd.
        """
        # Slices along dim 0 are contiguous views, so ffn() sees the same memory layout
        # as the modules layout and computes the same bits.
        return tuple(_local(t)[e] for t in (self.w1, self.b1, self.w2, self.b2))

    def forward(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of ``grouped`` [N, D], grouped by local expert (``counts[i]`` rows for
        expert i, in order) -> each row through its expert, same order [N, D].

        Every expert runs, even on zero rows, so each gets a (possibly zero) gradient.
        A module call rather than a loop in the caller, so FSDP's hooks (all-gather
        before, reduce-scatter of the gradients after) run when the experts are their
        own FSDP unit, as under FSDP x EP.
        """
        ys, start = [], 0
        for i, n in enumerate(counts):
            ys.append(ffn(grouped[start:start + n], *self.expert_tensors(i)))
            start += n
        return torch.cat(ys)


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of FFN experts with a capacity limit.

    Holds the ``n_local`` experts of this rank (all E without expert parallelism);
    local expert i is global expert ``ep.rank * n_local + i``.
    """

    def __init__(self, cfg: MoEConfig, ep: ExpertParallel = NO_EXPERT_PARALLEL) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.n_local = ep.n_local(cfg.n_experts)
        self.ep = ep
        self.top_k = cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts: GroupedExperts | nn.ModuleList
        if cfg.expert_layout == "stacked":
            self.experts = GroupedExperts(self.n_local, cfg.d_model, cfg.d_ff)
        else:
            self.experts = nn.ModuleList(
                Expert(cfg.d_model, cfg.d_ff) for _ in range(self.n_local)
            )

    def _expert_tensors(self, e: int) -> tuple[torch.Tensor, ...]:
        if isinstance(self.experts, GroupedExperts):
            return self.experts.expert_tensors(e)
        expert = self.experts[e]
        return expert.w1, expert.b1, expert.w2, expert.b2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RoutingStats]:
        """Returns (output [B, S, D], aux loss scalar, routing stats)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, D]
        T, E, K = tokens.shape[0], self.n_experts, self.top_k

        # Routing in fp32: softmax over a few logits is cheap and sensitive to precision.
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # [T, E]
        gate, expert_idx = probs.topk(K, dim=-1)  # [T, K]
        if K > 1:
            # GShard: renormalise so a token's K gate weights sum to 1.
            gate = gate / gate.sum(dim=-1, keepdim=True)

        # Switch load-balancing loss E * sum_e f_e * P_e: f_e = share of assignments to
        # e (no gradient), P_e = mean router probability of e. Equals 1 when balanced.
        one_hot = F.one_hot(expert_idx, E)  # [T, K, E]
        frac = one_hot.sum(dim=(0, 1)).float() / (T * K)
        aux = E * torch.sum(frac * probs.mean(dim=0))

        # Capacity: order assignments choice-rank-major ([K, T] flattened) so first
        # choices are admitted before second ones, tokens in order within a rank; an
        # assignment is kept if fewer than C earlier ones went to its expert.
        capacity = math.ceil(self.capacity_factor * T * K / E)
        flat_expert = expert_idx.t().reshape(-1)  # [K*T]
        flat_onehot = one_hot.transpose(0, 1).reshape(K * T, E)
        slot = (flat_onehot.cumsum(dim=0) * flat_onehot).sum(dim=-1) - 1  # [K*T]
        keep = slot < capacity
        flat_token = torch.arange(T, device=x.device).repeat(K)
        flat_gate = gate.t().reshape(-1)

        # Group kept assignments by expert (stable sort keeps the admission order, so
        # the accumulation order below, and hence the result, is deterministic).
        kept_expert = flat_expert[keep]
        order = torch.sort(kept_expert, stable=True).indices
        kept_token = flat_token[keep][order]
        kept_gate = flat_gate[keep][order]
        processed = torch.bincount(kept_expert, minlength=E)
        if self.ep.enabled:
            out = self._experts_parallel(tokens, kept_token, kept_gate, processed)
        else:
            out = self._experts_local(tokens, kept_token, kept_gate, processed.tolist())

        assigned = torch.bincount(flat_expert, minlength=E).detach().cpu()
        processed = processed.detach().cpu()
        stats = RoutingStats(
            assigned=assigned,
            processed=processed,
            dropped=int(assigned.sum() - processed.sum()),
            capacity=capacity,
        )
        return out.view(shape), aux, stats

    def _experts_local(self, tokens: torch.Tensor, kept_token: torch.Tensor,
                       kept_gate: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """All experts on this rank: kept assignments grouped by expert -> [T, D]."""
        out = torch.zeros_like(tokens)
        start = 0
        # Every expert runs, even on zero tokens, so each gets a (possibly zero) gradient
        # in both layouts and every data-parallel rank has the same set of gradients.
        for e in range(self.n_experts):
            end = start + counts[e]
            idx = kept_token[start:end]
            y = ffn(tokens[idx], *self._expert_tensors(e))
            out.index_add_(0, idx, y * kept_gate[start:end, None].to(y.dtype))
            start = end
        return out

    def _experts_parallel(self, tokens: torch.Tensor, kept_token: torch.Tensor,
                          kept_gate: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
        """Experts spread over the EP group: dispatch, compute, return, combine -> [T, D].

        Collective over ``ep.group``: every rank of the group runs every MoE layer's
        forward (and backward) in the same order. The kept assignments arrive grouped
        by global expert, hence by destination rank (rank d holds experts
        [d*L, (d+1)*L)), which is the layout ``all_to_all_single`` sends.
        """
        P, L = self.ep.size, self.n_local
        group = self.ep.group
        send_counts = processed.view(P, L)  # [P, L]: to rank d, for its local expert i
        recv_counts = torch.empty_like(send_counts)  # [P, L]: from rank s, for my expert i
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()

        recv = _all_to_all(tokens[kept_token], recv_splits, send_splits, group)  # [R, D]
        # recv is source-rank-major; regroup by local expert (stable: source order kept).
        local_expert = torch.arange(L, device=tokens.device).repeat(P)
        row_expert = local_expert.repeat_interleave(recv_counts.reshape(-1))  # [R]
        order = torch.sort(row_expert, stable=True).indices
        per_expert = recv_counts.sum(dim=0).tolist()
        grouped = recv[order]
        if isinstance(self.experts, GroupedExperts):
            y = self.experts(grouped, per_expert)
        else:
            ys, start = [], 0
            # Every local expert runs, even on zero tokens, as in _experts_local.
            for i in range(L):
                end = start + per_expert[i]
                ys.append(ffn(grouped[start:end], *self._expert_tensors(i)))
                start = end
            y = torch.cat(ys)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y[inverse]  # back to source-rank-major order

        back = _all_to_all(y, send_splits, recv_splits, group)  # [N_kept, D], send order
        out = torch.zeros_like(tokens)
        return out.index_add_(0, kept_token, back * kept_gate[:, None].to(back.dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's local part of a DTensor (differentiable); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Autograd-aware all_to_all_single of the rows of ``x`` [N, D] (collective).

    The backward pass runs the reverse all-to-all, so a rank receives the gradients
    of the rows it sent.
    """
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    with warnings.catch_warnings():
        # torch marks torch.distributed.nn.functional deprecated in favour of the
        # private _functional_collectives; it is the public autograd-aware all-to-all
        # that works on gloo, so keep it and silence the per-call FutureWarning.
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"torch\.distributed\.nn\.functional")
        return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
