"""Expert discovery: both layouts, overrides, and clear errors when ambiguous."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import moepec
from moepec import CheckpointConfig, CheckpointManager, ExpertSpec
from moepec.errors import ConfigError, ExpertDiscoveryError
from moepec.models import GPTMoE, get_config
from moepec.state.experts import canonical_expert_name, describe, discover, structure_of
from tests.zoo_check import train_restore_export


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


# -- issue 15: structure-based discovery that refuses to guess ------------------------------
D, F, E = 4, 6, 4


class ParallelExperts(nn.Module):
    """JetMoe's JetMoeParallelExperts: one [E, out, in] weight."""

    def __init__(self, n: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d_out, d_in) * 0.1)

    def forward(self, x, e):
        return x @ self.weight[e].T


class TopKGating(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layer = nn.Linear(d, n, bias=False)


class JetLikeMoE(nn.Module):
    """JetMoe's FFN: a [D] output bias beside two experts modules and a router. D == E
    here, so only the structure (not a dimension that happens to match) can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(D))
        self.input_linear = ParallelExperts(E, D, F)
        self.output_linear = ParallelExperts(E, F, D)
        self.router = TopKGating(D, E)

    def forward(self, x):
        choice = self.router.layer(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            y = self.output_linear(torch.relu(self.input_linear(x, e)), e)
            out = out + torch.where((choice == e)[:, None], y, 0.0)
        return x + out + self.bias


class JetLikeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()  # JetMoe's JetMoeMoA, named `experts`, holds a [D] bias
        self.experts.bias = nn.Parameter(torch.zeros(D))
        self.kv_proj = nn.Linear(D, D)

    def forward(self, x):
        return self.kv_proj(x) + self.experts.bias


class JetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attention = JetLikeAttention()
        self.mlp = JetLikeMoE()

    def forward(self, x):
        return self.mlp(self.self_attention(x))


def test_jetmoe_like_1d_bias_is_never_taken_for_experts():
    model = JetLike()
    emap = discover(model)
    assert [(lay.prefix, lay.layout, lay.n_experts) for lay in emap.layers] == [
        ("mlp", "stacked", E)]
    assert set(emap.layers[0].stacked.values()) == {
        "mlp.input_linear.weight", "mlp.output_linear.weight"}
    assert {"self_attention.experts.bias", "mlp.bias"} <= set(emap.non_expert)
    text = describe(emap, dict(model.named_parameters()))
    assert "self_attention.experts.bias [4]: only 1-D/2-D tensors" in text
    assert "layer 0: mlp  stacked  E=4  input_linear.weight [4, 6, 4]" in text


class LongcatLikeExperts(nn.Module):
    """LongcatFlash: routed + zero (identity) experts fused in gate_up_proj's dim 0."""

    def __init__(self, routed: int, zero: int) -> None:
        super().__init__()
        self.routed = routed
        self.gate_up_proj = nn.Parameter(torch.randn(routed + zero, 2 * F, D) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(routed, D, F) * 0.1)


class LongcatLike(nn.Module):
    def __init__(self, routed: int = 4, zero: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.mlp = nn.Module()
        self.mlp.router = nn.Module()
        self.mlp.router.classifier = nn.Linear(D, routed + zero, bias=False)
        self.mlp.experts = LongcatLikeExperts(routed, zero)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        ex = self.mlp.experts
        choice = self.mlp.router.classifier(h).argmax(-1)
        out = torch.zeros_like(h)
        for e in range(ex.gate_up_proj.shape[0]):
            if e < ex.routed:
                g, u = (h @ ex.gate_up_proj[e].T).chunk(2, -1)
                y = (torch.relu(g) * u) @ ex.down_proj[e].T
            else:
                y = h  # a zero expert: identity, its gate_up_proj rows unused
            out = out + torch.where((choice == e)[:, None], y, 0.0)
        # every routed expert gets a gradient, whatever the routing
        out = out + 0.0 * (ex.gate_up_proj.sum() + ex.down_proj.sum())
        return self.head(h + out).squeeze(-1)


def _regression_loss(model, step, d=D):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, d, generator=g), torch.randn(16, generator=g)
    return ((model(x) - y) ** 2).mean()


def test_longcat_like_fused_zero_experts_error_then_ragged_spec(tmp_path):
    with pytest.raises(ExpertDiscoveryError, match=r"disagree.*ExpertSpec\(ragged=True\)"):
        discover(LongcatLike())
    spec = ExpertSpec(ragged=True)
    emap = discover(LongcatLike(), spec)
    lay = emap.layers[0]
    assert emap.n_experts == (6,) and lay.rows == {"gate_up_proj": 6, "down_proj": 4}
    assert set(lay.tensors_of(3)) == {"gate_up_proj", "down_proj"}
    assert set(lay.tensors_of(4)) == {"gate_up_proj"}  # a zero expert's unused rows
    facts = train_restore_export(tmp_path, LongcatLike, _regression_loss, spec=spec)
    assert facts["stale"] > 0  # restored experts come from older checkpoints, exactly


class TorchtitanGroupedExperts(nn.Module):
    """torchtitan 0.3 models/common/moe.py GroupedExperts: the exact parameter names."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.randn(n, hidden, dim) * 0.1)
        self.w2_EDF = nn.Parameter(torch.randn(n, dim, hidden) * 0.1)
        self.w3_EFD = nn.Parameter(torch.randn(n, hidden, dim) * 0.1)


class TorchtitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TorchtitanMoE(nn.Module):
    """moe.routed_experts.inner_experts.w1_EFD, moe.router.gate.weight,
    moe.shared_experts.w{1,2,3}.weight, buffers expert_bias_E / tokens_per_expert_E."""

    def __init__(self, dim: int = D, hidden: int = F, n: int = E) -> None:
        super().__init__()
        self.routed_experts = nn.Module()
        self.routed_experts.inner_experts = TorchtitanGroupedExperts(n, dim, hidden)
        self.router = nn.Module()
        self.router.gate = nn.Linear(dim, n, bias=False)
        self.shared_experts = TorchtitanFeedForward(dim, hidden)
        self.register_buffer("expert_bias_E", torch.zeros(n))
        self.register_buffer("tokens_per_expert_E", torch.zeros(n), persistent=False)

    def forward(self, x):
        ex = self.routed_experts.inner_experts
        choice = self.router.gate(x).argmax(-1)
        out = self.shared_experts(x)
        for e in range(ex.w1_EFD.shape[0]):
            y = (torch.nn.functional.silu(x @ ex.w1_EFD[e].T) * (x @ ex.w3_EFD[e].T)) \
                @ ex.w2_EDF[e].T
            out = out + torch.where((choice == e)[:, None], y, 0.0)
        return x + out + 0.0 * (ex.w1_EFD.sum() + ex.w2_EDF.sum() + ex.w3_EFD.sum())


class TorchtitanLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(D, D)
        self.layers = nn.ModuleDict({str(i): nn.Module() for i in range(2)})
        for block in self.layers.values():
            block.moe = TorchtitanMoE()
        self.output = nn.Linear(D, 1)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for block in self.layers.values():
            h = block.moe(h)
        return self.output(h).squeeze(-1)


def test_torchtitan_names_found_without_a_spec(tmp_path):
    emap = discover(TorchtitanLike())
    assert [(lay.prefix, lay.n_experts) for lay in emap.layers] == [
        ("layers.0.moe.routed_experts", E), ("layers.1.moe.routed_experts", E)]
    assert set(emap.layers[0].stacked.values()) == {
        f"layers.0.moe.routed_experts.inner_experts.{w}" for w in ("w1_EFD", "w2_EDF", "w3_EFD")}
    assert all("shared_experts" not in n and "router" not in n for n in emap.owner)
    facts = train_restore_export(tmp_path, TorchtitanLike, _regression_loss)
    assert facts["stale"] > 0


class Unnamed(nn.Module):
    """Experts nothing can recognise: a [E, ...] tensor with no router and no known name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.blocks:
            b.ffn_bank = nn.Parameter(torch.randn(E, D, D) * 0.1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + (h @ b.ffn_bank.sum(0))
        return h.sum(-1)


def test_no_experts_is_an_error_that_lists_candidates_and_a_spec_that_works(tmp_path, caplog):
    model = Unnamed()
    cfg = CheckpointConfig(path=str(tmp_path / "c"))
    with pytest.raises(ExpertDiscoveryError) as info:
        CheckpointManager(model, None, cfg)
    text = str(info.value)
    assert "no experts found" in text and "blocks.0.ffn_bank [4, 4, 4]" in text
    assert "require_experts=False" in text
    spec_src = re.search(r"expert_spec=(moepec\.ExpertSpec\(.*\))", text).group(1)
    spec = eval(spec_src, {"moepec": moepec})  # the printed spec, pasted as a user would
    emap = discover(model, spec)
    assert emap.n_experts == (E, E)
    assert set(emap.owner) == {"blocks.0.ffn_bank", "blocks.1.ffn_bank"}
    # on purpose full checkpoints: a warning, and the manager works
    with caplog.at_level(logging.WARNING):
        CheckpointManager(model, None, CheckpointConfig(path=str(tmp_path / "d"),
                                                        require_experts=False)).close()
    assert "every checkpoint will be a full one" in caplog.text
    CheckpointManager(model, None, CheckpointConfig(path=str(tmp_path / "e"),
                                                    full_every=1)).close()
    with pytest.raises(ConfigError, match="require_experts"):
        CheckpointConfig(path="x", require_experts="yes")


def test_alike_modules_beside_a_router_are_experts_but_decoder_layers_are_not():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(D, 3, bias=False)
            self.ffns = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))  # 3 alike, no router

    emap = discover(Net())
    assert [(lay.prefix, lay.layout, lay.container, lay.n_experts) for lay in emap.layers] \
        == [(f"layers.{i}", "modules", "ffns", 3) for i in range(3)]
    assert canonical_expert_name(emap.layers[0], "weight", 2) == "layers.0.ffns.2.weight"


def test_experts_command_prints_what_discovery_finds(capsys):
    from moepec.cli.main import main

    assert main(["experts", "tests.test_experts:TorchtitanLike"]) == 0
    out = capsys.readouterr().out
    assert "layer 1: layers.1.moe.routed_experts  stacked  E=4  inner_experts.w1_EFD" in out
    assert main(["experts", "tests.test_experts:Unnamed"]) == 1  # none found: exit 1
    assert 'ExpertSpec(stacked=r"^(?P<layer>blocks\\.\\d+)\\.(?P<name>ffn_bank)$")' in \
        capsys.readouterr().out
    assert main(["experts", "tests.test_experts:Unnamed", "--stacked",
                 r"^(?P<layer>blocks\.\d+)\.(?P<name>ffn_bank)$"]) == 0
    assert "found by the ExpertSpec's name patterns" in capsys.readouterr().out
    assert main(["experts", "tests.test_experts:NoSuch"]) == 2
    assert main(["experts", "no_such_module:f"]) == 2
    err = capsys.readouterr().err
    assert err.count("moepec: error:") == 2 and "Traceback" not in err
