"""GPT-MoE model: parameter naming, layouts, routing counts, capacity, sizes."""

from __future__ import annotations

import math
import re

import pytest
import torch

from moepec.errors import ConfigError
from moepec.models import (
    GPTMoE,
    GPTMoEConfig,
    checkpoint_bytes,
    convert_expert_layout,
    count_parameters,
    get_config,
)
from moepec.models.gpt_moe import MoEFeedForward, ffn


def _pair(**overrides: object) -> tuple[GPTMoE, GPTMoE]:
    """A stacked model and a modules-layout model holding the same weights."""
    torch.manual_seed(0)
    stacked = GPTMoE(get_config("tiny", **overrides))
    modules = GPTMoE(get_config("tiny", expert_layout="modules", **overrides))
    sd = convert_expert_layout(stacked.state_dict(), stacked.cfg.n_experts, to="modules")
    modules.load_state_dict(sd)  # strict: the converted names are exactly the module's
    return stacked, modules


@pytest.mark.parametrize("top_k", [1, 2])
def test_layouts_give_identical_outputs_and_grads(top_k: int) -> None:
    stacked, modules = _pair(top_k=top_k, capacity_factor=1.0)
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    a, b = stacked(idx, idx), modules(idx, idx)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.loss, b.loss)
    for ra, rb in zip(a.routing, b.routing, strict=True):
        assert torch.equal(ra.assigned, rb.assigned) and torch.equal(ra.processed, rb.processed)
    a.loss.backward()
    b.loss.backward()
    grads_b = {n: p.grad for n, p in modules.named_parameters()}
    grads_b = convert_expert_layout(grads_b, 4, to="stacked")
    for name, p in stacked.named_parameters():
        assert torch.equal(p.grad, grads_b[name]), name


def test_convert_round_trip_is_exact() -> None:
    stacked, _ = _pair()
    sd = stacked.state_dict()
    back = convert_expert_layout(convert_expert_layout(sd, 4, "modules"), 4, "stacked")
    assert list(back) == list(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ConfigError, match="expected 3"):
        convert_expert_layout(sd, 3, "modules")


def test_parameter_names_follow_the_contract() -> None:
    cfg = get_config("tiny", n_layer=4)
    shapes = {n: tuple(p.shape) for n, p in GPTMoE(cfg).named_parameters()}
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_ff
    for i in (1, 3):  # odd blocks are MoE
        assert shapes[f"blocks.{i}.ffn.experts.w1"] == (E, D, F)
        assert shapes[f"blocks.{i}.ffn.experts.b1"] == (E, F)
        assert shapes[f"blocks.{i}.ffn.experts.w2"] == (E, F, D)
        assert shapes[f"blocks.{i}.ffn.experts.b2"] == (E, D)
        assert shapes[f"blocks.{i}.ffn.router.weight"] == (E, D)
    for i in (0, 2):  # even blocks are dense
        assert shapes[f"blocks.{i}.ffn.w1"] == (D, F)
        assert shapes[f"blocks.{i}.ffn.b2"] == (D,)
    expert_names = [n for n in shapes if "experts" in n]
    assert all(re.fullmatch(r"blocks\.[13]\.ffn\.experts\.(w1|b1|w2|b2)", n) for n in expert_names)
    assert len(expert_names) == 8

    modules = {n: tuple(p.shape) for n, p in
               GPTMoE(get_config("tiny", n_layer=4, expert_layout="modules")).named_parameters()}
    assert modules["blocks.3.ffn.experts.2.w1"] == (D, F)
    assert modules["blocks.3.ffn.experts.2.b1"] == (F,)
    assert modules["blocks.3.ffn.experts.2.w2"] == (F, D)
    assert modules["blocks.3.ffn.experts.2.b2"] == (D,)
    expert_names = [n for n in modules if "experts" in n]
    assert all(re.fullmatch(r"blocks\.[13]\.ffn\.experts\.[0-3]\.(w1|b1|w2|b2)", n)
               for n in expert_names)
    assert len(expert_names) == 2 * 4 * 4


@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_counts_every_assignment(top_k: int) -> None:
    torch.manual_seed(0)
    model = GPTMoE(get_config("tiny", n_layer=4, top_k=top_k))
    idx = torch.randint(0, 256, (3, 32))
    out = model(idx)
    assert model.num_moe_layers == 2 and len(out.routing) == 2
    for stats in out.routing:
        assert stats.assigned.dtype == torch.int64 and stats.assigned.device.type == "cpu"
        assert stats.assigned.shape == (4,)
        assert int(stats.assigned.sum()) == 3 * 32 * top_k
        assert not stats.assigned.requires_grad
        assert stats.dropped == int(stats.assigned.sum() - stats.processed.sum())


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_are_counted(top_k: int) -> None:
    torch.manual_seed(0)
    model = GPTMoE(get_config("tiny", top_k=top_k, capacity_factor=0.3))
    out = model(torch.randint(0, 256, (4, 32)))
    (stats,) = out.routing
    assert stats.capacity == math.ceil(0.3 * 128 * top_k / 4)
    assert stats.dropped > 0
    assert bool((stats.processed <= stats.capacity).all())
    assert bool((stats.processed <= stats.assigned).all())
    assert torch.equal(stats.processed, torch.minimum(stats.assigned,
                                                      torch.tensor(stats.capacity)))
    assert stats.dropped == int((stats.assigned - stats.processed).sum())


def test_capacity_keeps_earliest_tokens_and_dropped_tokens_get_nothing() -> None:
    torch.manual_seed(0)
    cfg = get_config("tiny", top_k=1, capacity_factor=0.5)
    moe = MoEFeedForward(cfg.moe_config())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(1, 64, cfg.d_model)
    y, _, stats = moe(x)
    choice = moe.router(x[0]).argmax(-1)
    seen = [0] * cfg.n_experts
    for t in range(64):
        e = int(choice[t])
        kept = seen[e] < stats.capacity
        seen[e] += 1
        assert bool(y[0, t].abs().sum() > 0) == kept, t
    assert stats.dropped > 0


def test_top2_gates_are_renormalised() -> None:
    # With identical experts and no drops, renormalised top-2 gates sum to one, so the
    # MoE layer equals that single FFN.
    torch.manual_seed(0)
    cfg = get_config("tiny", top_k=2, capacity_factor=4.0)
    moe = MoEFeedForward(cfg.moe_config())
    with torch.no_grad():
        for name in ("w1", "b1", "w2", "b2"):
            p = getattr(moe.experts, name)
            # the layer alone leaves its weights uninitialised (the model's init sets them):
            # torch.empty's memory, NaN now and then
            first = torch.randn_like(p[0]) * 0.02 if name.startswith("w") else p[0] + 0.1
            p.copy_(first.expand_as(p))
    x = torch.randn(2, 16, cfg.d_model)
    y, _, stats = moe(x)
    assert stats.dropped == 0 and torch.isfinite(y).all()
    ref = ffn(x.reshape(-1, cfg.d_model), *moe.experts.expert_tensors(0)).view_as(y)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_aux_loss_trains_the_router() -> None:
    torch.manual_seed(0)
    model = GPTMoE(get_config("tiny"))
    out = model(torch.randint(0, 256, (2, 32)))
    assert out.aux_loss.item() >= 0.99  # Switch loss is >= 1, 1 at perfect balance
    out.aux_loss.backward()
    assert model.blocks[1].ffn.router.weight.grad.abs().sum() > 0


def test_init_is_deterministic_and_gpt2_style() -> None:
    torch.manual_seed(3)
    a = GPTMoE(get_config("tiny"))
    torch.manual_seed(3)
    b = GPTMoE(get_config("tiny"))
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    sd = a.state_dict()
    assert torch.all(sd["blocks.1.ffn.experts.b1"] == 0)
    assert torch.all(sd["ln_f.weight"] == 1)
    assert abs(sd["tok_emb.weight"].std().item() - 0.02) < 0.002
    # residual projections are scaled down by sqrt(2 * n_layer) = 2
    assert abs(sd["blocks.1.ffn.experts.w2"].std().item() - 0.01) < 0.001


def test_paper_config_counts_323m_on_meta() -> None:
    counts = count_parameters(get_config("gpt-125m-8e"))
    assert abs(counts.total - 323e6) / 323e6 < 0.005
    assert counts.n_moe_layers == 6 and counts.n_experts == 8
    assert counts.per_expert == 2 * 768 * 3072 + 3072 + 768
    assert counts.expert == 6 * 8 * counts.per_expert
    assert counts.non_expert == counts.total - counts.expert
    assert checkpoint_bytes(get_config("gpt-125m-8e")) == counts.total * 4 * 3
    big = count_parameters(get_config("gpt-350m-16e"))
    assert big.n_moe_layers == 12 and big.n_experts == 16


def test_count_matches_a_real_model() -> None:
    cfg = get_config("tiny")
    real = sum(p.numel() for p in GPTMoE(cfg).parameters())
    assert count_parameters(cfg).total == real


@pytest.mark.parametrize("overrides, match", [
    (dict(d_model=33), "n_head"),
    (dict(top_k=3), "top_k"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(expert_layout="flat"), "expert_layout"),
    (dict(n_experts=0), "n_experts"),
])
def test_bad_model_config_names_the_fix(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        get_config("tiny", **overrides)


def test_unknown_config_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match="tiny, small, gpt-125m-8e, gpt-350m-16e"):
        get_config("gpt-7b")
    with pytest.raises(ConfigError, match="unknown model override"):
        get_config("tiny", n_expert=3)
    with pytest.raises(TypeError):
        GPTMoEConfig(256)  # type: ignore[misc]  # keyword-only
