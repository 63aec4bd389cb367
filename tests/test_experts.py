"""Expert discovery: both layouts, overrides, and clear errors when ambiguous."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from moepec import ExpertSpec
from moepec.errors import ExpertDiscoveryError
from moepec.models import GPTMoE, get_config
from moepec.state.experts import discover, structure_of


@pytest.mark.parametrize("layout", ["stacked", "modules"])
def test_gpt_moe_experts_found_in_both_layouts(layout):
    cfg = get_config("tiny", expert_layout=layout, n_layer=4)
    model = GPTMoE(cfg)
    emap = discover(model)
    assert emap.n_experts == (cfg.n_experts,) * 2
    assert {lay.layout for lay in emap.layers} == {layout}
    assert all(".ffn.router." in n or "experts" not in n for n in emap.non_expert)
    # every parameter is non-expert or belongs to exactly one expert layer
    names = set(dict(model.named_parameters()))
    assert names == set(emap.non_expert) | set(emap.owner)
    assert not set(emap.non_expert) & set(emap.owner)
    assert any("router" in n for n in emap.non_expert)


def test_layouts_have_the_same_structure_fingerprint_only_when_equal():
    a = GPTMoE(get_config("tiny"))
    b = GPTMoE(get_config("tiny", expert_layout="modules"))
    sa, sb = structure_of(a, discover(a)), structure_of(b, discover(b))
    assert sa["fingerprint"] != sb["fingerprint"]
    assert sa["fingerprint"] == structure_of(a, discover(a))["fingerprint"]


class Custom(nn.Module):
    """Experts named like neither standard layout: `moe_{layer}.ffn_{e}.weight`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        for layer in range(2):
            self.add_module(f"moe_{layer}", nn.ModuleDict(
                {f"ffn_{e}": nn.Linear(4, 4) for e in range(3)}))


def test_explicit_spec_finds_custom_experts():
    model = Custom()
    assert discover(model).layers == []  # nothing looks like an expert by default
    spec = ExpertSpec(stacked=None,
                      modules=r"^(?P<layer>moe_\d+)\.ffn_(?P<expert>\d+)\.(?P<name>.+)$")
    emap = discover(model, spec)
    assert emap.n_experts == (3, 3)
    assert emap.non_expert == ["embed.weight", "embed.bias"]


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Module()
        self.layer.experts = nn.ModuleList([nn.Linear(2, 2)])
        self.layer.register_parameter("experts_w", None)
        # a stacked weight in the same layer prefix, named like the stacked layout
        self.layer.experts.w1 = nn.Parameter(torch.zeros(1, 2, 2))


def test_both_layouts_in_one_layer_is_ambiguous():
    with pytest.raises(ExpertDiscoveryError, match="both layouts.*ExpertSpec"):
        discover(Mixed())


class BadStacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = nn.Module()
        self.moe.experts = nn.Module()
        self.moe.experts.w1 = nn.Parameter(torch.zeros(4, 2, 2))
        self.moe.experts.w2 = nn.Parameter(torch.zeros(3, 2, 2))


def test_stacked_disagreeing_expert_dim_is_an_error():
    with pytest.raises(ExpertDiscoveryError, match="disagree on the expert.*ExpertSpec"):
        discover(BadStacked())


class Gappy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = nn.Module()
        self.moe.experts = nn.ModuleDict({"0": nn.Linear(2, 2), "2": nn.Linear(2, 2)})


def test_non_contiguous_expert_ids_are_an_error():
    with pytest.raises(ExpertDiscoveryError, match=r"ids \[0, 2\]"):
        discover(Gappy())


def test_bad_spec_regex_is_reported():
    with pytest.raises(ExpertDiscoveryError, match="named groups"):
        ExpertSpec(modules=r"(.*)\.experts\.(\d+)")


@settings(max_examples=25, deadline=None)
@given(n_layers=st.integers(1, 3), n_experts=st.integers(1, 5),
       layout=st.sampled_from(["stacked", "modules"]))
def test_discovery_partitions_parameters(n_layers, n_experts, layout):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(2, 2)
            self.layers = nn.ModuleList()
            for _ in range(n_layers):
                layer = nn.Module()
                layer.router = nn.Linear(2, n_experts)
                if layout == "stacked":
                    layer.experts = nn.Module()
                    layer.experts.w = nn.Parameter(torch.zeros(n_experts, 2, 3))
                    layer.experts.b = nn.Parameter(torch.zeros(n_experts, 3))
                else:
                    layer.experts = nn.ModuleList(nn.Linear(2, 3) for _ in range(n_experts))
                self.layers.append(layer)

    model = M()
    emap = discover(model)
    assert emap.n_experts == (n_experts,) * n_layers
    assert set(emap.non_expert) | set(emap.owner) == set(dict(model.named_parameters()))
    assert not set(emap.non_expert) & set(emap.owner)
