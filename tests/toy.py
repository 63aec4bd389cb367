"""A toy MoE model in both expert layouts, independent of moepec.models, for engine tests."""

from __future__ import annotations

import torch
from torch import nn


class StackedExperts(nn.Module):
    def __init__(self, n: int, d: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, d, f) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, f, d) * 0.1)


class Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, f) * 0.1)
        self.w2 = nn.Parameter(torch.randn(f, d) * 0.1)


class MoE(nn.Module):
    def __init__(self, n: int, d: int, f: int, layout: str) -> None:
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.layout = layout
        self.n = n
        if layout == "stacked":
            self.experts = StackedExperts(n, d, f)
        else:
            self.experts = nn.ModuleList(Expert(d, f) for _ in range(n))

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == "stacked":
            return self.experts.w1[e], self.experts.w2[e]
        return self.experts[e].w1, self.experts[e].w2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            mask = choice == e
            w1, w2 = self.weights(e)
            # every expert contributes (also with no tokens) so all get gradients
            out = out + torch.where(mask[:, None], torch.relu(x @ w1) @ w2, 0.0) \
                + 0.0 * (w1.sum() + w2.sum())
        return x + out, torch.bincount(choice, minlength=self.n)


class ToyMoE(nn.Module):
    """embed -> dense -> moe -> dense -> moe -> head; `norm_stat` is a buffer."""

    def __init__(self, n_experts: int = 4, d: int = 8, f: int = 16, layout: str = "stacked",
                 n_moe: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.dense = nn.ModuleList(nn.Linear(d, d) for _ in range(n_moe))
        self.moe = nn.ModuleList(MoE(n_experts, d, f, layout) for _ in range(n_moe))
        self.head = nn.Linear(d, 1)
        self.register_buffer("norm_stat", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.embed(x)
        counts = []
        for dense, moe in zip(self.dense, self.moe):
            h = torch.tanh(dense(h))
            h, c = moe(h)
            counts.append(c)
        with torch.no_grad():
            self.norm_stat.mul_(0.9).add_(0.1 * h.mean(0))
        return self.head(h).squeeze(-1), counts


class Counter:
    """A stand-in for a data loader's resumable position (has state_dict)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, d: dict) -> None:
        self.position = d["position"]


def make(seed: int = 0, layout: str = "stacked", n_experts: int = 4, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = ToyMoE(n_experts=n_experts, layout=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    return model, opt, sched


def train_step(model, opt, sched, gen: torch.Generator, batch: int = 32):
    x = torch.randn(batch, model.embed.in_features, generator=gen)
    y = torch.randn(batch, generator=gen)
    pred, counts = model(x)
    loss = ((pred - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    return loss, counts


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Deep copy of weights and optimizer state keyed by parameter name."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def run_loop(mgr, model, opt, sched, counter, gen: torch.Generator, start: int, steps: int,
             on_save=None) -> None:
    """The DESIGN.md training loop over the toy model, steps [start, start + steps)."""
    for step in range(start, start + steps):
        _, counts = train_step(model, opt, sched, gen)
        mgr.wait_for_snapshot()
        opt.step()
        sched.step()
        counter.position += 1
        mgr.observe_routing(counts)
        if mgr.step(step) and on_save is not None:
            on_save(step)
