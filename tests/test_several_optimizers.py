"""Several torch optimizers over one model (moepec.state.optimizers): each optimizer's
per-expert state is saved K of N with its expert and restored from that expert's copy.

Two optimizers over disjoint parameter groups of the toy MoE (AdamW over every ``w1``,
the router and the embedding; SGD with momentum or Adagrad over every ``w2`` and the
rest), so every expert has state in both. Saved with K=1 of 4 at every step; restored
into fresh objects, every expert's weights and its state in both optimizers equal, bit
for bit, their values at the step the RestoreReport names for that expert, and
everything else the newest checkpoint's.
"""

from __future__ import annotations

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import ConfigError
from tests.toy import ToyMoE

N_EXPERTS, STEPS = 4, 7


def _optimizers(model: ToyMoE, second: str) -> list[torch.optim.Optimizer]:
    first = [p for n, p in model.named_parameters()
             if n.endswith("w1") or ".router." in n or n.startswith("embed.")]
    taken = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in taken]
    other = (torch.optim.SGD(rest, lr=0.05, momentum=0.9) if second == "sgd"
             else torch.optim.Adagrad(rest, lr=0.05))
    return [torch.optim.AdamW(first, lr=1e-2), other]


def _state(model: ToyMoE, opts: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Weights and each optimizer's state, deep-copied, keyed by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, opt in enumerate(opts):
        for p, st in opt.state.items():
            for k, v in st.items():
                out[f"optim{i}/{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def _config(tmp_path) -> CheckpointConfig:
    return CheckpointConfig(path=str(tmp_path / "ckpt"), interval=1, k_persist=1,
                            async_snapshot=False, async_persist=False, ram_dir=None,
                            dynamic_k=False)


def _train(tmp_path, layout: str, second: str) -> dict[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = ToyMoE(n_experts=N_EXPERTS, layout=layout)
    opts = _optimizers(model, second)
    manager = CheckpointManager(model, opts, _config(tmp_path))
    gen = torch.Generator().manual_seed(1)
    history = {}
    for step in range(STEPS):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, generator=gen)
        pred, counts = model(x)
        for opt in opts:
            opt.zero_grad()
        ((pred - y) ** 2).mean().backward()
        manager.wait_for_snapshot()
        for opt in opts:
            opt.step()
        manager.observe_routing(counts)
        if manager.step(step):
            history[step] = _state(model, opts)
    manager.close()
    return history


@pytest.mark.parametrize(("layout", "second"), [("stacked", "sgd"), ("modules", "adagrad")])
def test_each_optimizers_expert_state_goes_with_its_expert(tmp_path, layout, second):
    history = _train(tmp_path, layout, second)
    torch.manual_seed(99)
    model = ToyMoE(n_experts=N_EXPERTS, layout=layout)
    opts = _optimizers(model, second)
    manager = CheckpointManager(model, opts, _config(tmp_path))
    report = manager.restore()
    emap = manager._emap
    manager.close()
    assert report is not None and report.step == STEPS - 1
    restored, base = _state(model, opts), history[STEPS - 1]
    assert restored.keys() == base.keys()
    moment = "momentum_buffer" if second == "sgd" else "sum"
    assert any(k.startswith("optim0/") and k.endswith("w1/exp_avg") for k in restored)
    assert any(k.startswith("optim1/") and k.endswith(f"w2/{moment}") for k in restored)
    older = 0
    for key, value in restored.items():
        pname = key.split("/", 1)[1].rsplit("/", 1)[0] if key.startswith("optim") \
            else key.split("/", 1)[1]
        if pname not in emap.owner or value.dim() == 0:  # non-expert (and step counters)
            assert torch.equal(value, base[key]), key
            continue
        layer, owner = emap.owner[pname]
        for e in range(N_EXPERTS) if owner is None else [owner]:
            src = report.sources[f"{layer}/{e}"]["step"]
            got = value[e] if owner is None else value
            want = history[src][key][e] if owner is None else history[src][key]
            assert torch.equal(got, want), (key, e, src)
            older += src != STEPS - 1 and not torch.equal(got, base[key][e] if owner is None
                                                          else base[key])
    assert older > 0  # some experts came from older checkpoints, in both optimizers
    assert {s["step"] for s in report.sources.values()} != {STEPS - 1}
    for opt in opts:  # the restored optimizers keep training
        for p in (q for g in opt.param_groups for q in g["params"]):
            p.grad = torch.ones_like(p)
        opt.step()


def test_optimizers_sharing_a_parameter_are_refused(tmp_path):
    model = ToyMoE(n_experts=N_EXPERTS)
    both = [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.head.parameters())]
    with pytest.raises(ConfigError, match="optimizers 0 and 1 both update"):
        CheckpointManager(model, both, _config(tmp_path))
