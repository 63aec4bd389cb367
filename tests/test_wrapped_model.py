"""A model whose blocks are wrapped for activation checkpointing (as torchtitan wraps every
transformer block): the wrapper renames state_dict keys, which must not make the
parameters a second, non-expert copy in every checkpoint."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from toy import ToyMoE

import moepec


def test_checkpoint_wrapped_experts_saved_once(tmp_path):
    torch.manual_seed(0)
    model = ToyMoE()
    for i, moe in enumerate(model.moe):
        model.moe[i] = checkpoint_wrapper(moe)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    commits = []
    cfg = moepec.CheckpointConfig(path=str(tmp_path / "ckpt"), interval=1, k_persist=1,
                                  async_snapshot=False, async_persist=False, ram_dir=None)
    with moepec.CheckpointManager(model, opt, cfg, on_commit=commits.append) as manager:
        saved = []
        for step in range(3):
            model(torch.randn(4, 8))[0].sum().backward()
            manager.wait_for_snapshot()
            opt.step()
            opt.zero_grad()
            manager.step(step)
            saved.append({n: p.detach().clone() for n, p in model.named_parameters()})
    # every parameter is saved under its own name once: no second copy under the names
    # the wrapper gives state_dict keys (which would hold every expert, every time)
    from tests import manifest_docs
    for c in commits:
        keys = manifest_docs.load(tmp_path / "ckpt" / c.name / "moepec.json")[1]
        assert keys and not [k for k in keys if k.startswith("model/moe.") and
                    "_checkpoint_wrapped_module" not in k], c.name
    fresh = ToyMoE()
    for i, moe in enumerate(fresh.moe):
        fresh.moe[i] = checkpoint_wrapper(moe)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    report = moepec.CheckpointManager(fresh, fresh_opt, cfg).restore()
    assert report.step == 2
    for n, p in fresh.named_parameters():
        if ".experts." not in n:
            assert torch.equal(p, saved[2][n]), n
    for key, src in report.sources.items():  # each expert from its newest copy
        layer, e = map(int, key.split("/"))
        w1 = f"moe.{layer}._checkpoint_wrapped_module.experts.w1"
        assert torch.equal(dict(fresh.named_parameters())[w1][e], saved[src["step"]][w1][e])
