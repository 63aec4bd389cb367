"""The model zoo: tiny random models from transformers' own config classes (no downloads)
and torchtitan's MoE layer (when importable).

Each is trained a few steps with PEC at K=1 (interval 2), restored into a fresh model and
checked bit for bit (non-expert state at the newest checkpoint, every expert at the step
it was last saved: stale on purpose), and its safetensors export is loaded with
``load_state_dict(strict=True)`` (tests/zoo_check.py). The transformers tests skip when
transformers (the ``moepec[hf]`` extra) is not installed; the torchtitan test when
torchtitan 0.3 is not importable (it needs ``spmd_types``, ``tyro`` and an importable
``triton``; its MoE then trains on CPU).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moepec import ExpertSpec
from moepec.errors import ExpertDiscoveryError
from moepec.state.experts import describe, discover
from tests.zoo_check import train_restore_export


def _transformers():
    return pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install 'moepec[hf]'")

V, H = 64, 16
ATTN = dict(vocab_size=V, hidden_size=H, num_attention_heads=2, num_key_value_heads=1)
MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
           v_head_dim=4)

# name: (config class, model class, config kwargs, experts per MoE layer found,
#        substrings of shared-expert parameter names)
ZOO = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(ATTN, num_hidden_layers=2, intermediate_size=16, num_local_experts=4,
                     num_experts_per_tok=2), (4, 4), ()),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(ATTN, num_hidden_layers=2, moe_intermediate_size=8, num_experts=4,
                       num_experts_per_tok=2, head_dim=8), (4, 4), ()),
    "qwen2_moe_shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         dict(ATTN, num_hidden_layers=2, moe_intermediate_size=8,
                              shared_expert_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2), (4, 4), ("shared_expert",)),
    "deepseek_v3_dense_first": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                                dict(ATTN, **MLA, num_hidden_layers=2, intermediate_size=16, num_key_value_heads=2,
                                     moe_intermediate_size=8, n_routed_experts=4,
                                     n_shared_experts=1, num_experts_per_tok=2,
                                     first_k_dense_replace=1, n_group=1, topk_group=1),
                                (4,), ("shared_experts",)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(ATTN, num_hidden_layers=2, intermediate_size=8, num_experts=4,
                   num_experts_per_tok=2, eos_token_id=None, pad_token_id=None),
              (4, 4), ()),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(ATTN, num_hidden_layers=2, intermediate_size=16, num_local_experts=4,
                     num_experts_per_tok=2, head_dim=8), (4, 4), ()),
}


def _builder(config_cls: str, model_cls: str, kwargs: dict):
    transformers = _transformers()
    config = getattr(transformers, config_cls)(**kwargs)

    def build():
        return getattr(transformers, model_cls)(config)
    return build


def _lm_loss(model, step):
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(step))
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_restores_exactly_and_exports(tmp_path, name):
    config_cls, model_cls, kwargs, n_experts, shared = ZOO[name]
    build = _builder(config_cls, model_cls, kwargs)
    emap = discover(build())
    assert emap.n_experts == n_experts
    assert all(lay.layout == "stacked" for lay in emap.layers)
    assert all(".mlp.experts." in n for n in emap.owner)  # routers, attention: non-expert
    for word in shared:  # shared experts: every token uses them, saved every time
        assert any(word in n for n in emap.non_expert)
        assert not any(word in n for n in emap.owner)
    if name == "deepseek_v3_dense_first":  # the dense first layer holds no experts
        assert [lay.prefix for lay in emap.layers] == ["model.layers.1.mlp"]
    facts = train_restore_export(tmp_path, build, _lm_loss)
    assert facts["stale"] > 0  # experts restored from older checkpoints, exactly


def test_zoo_jetmoe_takes_no_1d_bias_and_longcat_needs_ragged(tmp_path):
    """The two models discovery used to get wrong: JetMoe (a [D] bias in its attention's
    `experts` module) and LongcatFlash (routed and zero experts fused in one tensor)."""
    jet = _builder("JetMoeConfig", "JetMoeForCausalLM", dict(
        vocab_size=V, hidden_size=H, num_hidden_layers=1, num_key_value_heads=2,
        kv_channels=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2))
    emap = discover(jet())
    assert "model.layers.0.self_attention.experts.bias" in emap.non_expert
    assert "model.layers.0.mlp.bias" in emap.non_expert
    assert {"model.layers.0.mlp.input_linear.weight", "model.layers.0.mlp.output_linear.weight"
            } <= set(emap.owner)
    assert "only 1-D/2-D tensors" in describe(emap)
    assert train_restore_export(tmp_path / "jet", jet, _lm_loss)["stale"] > 0

    longcat = _builder("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(
        vocab_size=V, hidden_size=H, num_layers=1, num_attention_heads=2, ffn_hidden_size=16,
        expert_ffn_hidden_size=8, n_routed_experts=4, zero_expert_num=2, moe_topk=2, head_dim=4,
        **MLA))
    with pytest.raises(ExpertDiscoveryError, match=r"ExpertSpec\(ragged=True\)"):
        discover(longcat())
    spec = ExpertSpec(ragged=True)
    assert discover(longcat(), spec).n_experts == (6,)  # 4 routed + 2 zero, as the router
    facts = train_restore_export(tmp_path / "longcat", longcat, _lm_loss, spec=spec)
    assert facts["stale"] > 0


def _torchtitan_model():
    moe_mod = pytest.importorskip("torchtitan.models.common.moe",
                                  reason="torchtitan 0.3 is not importable")
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    d, f, e, k = 8, 16, 4, 2
    cfg = moe_mod.MoE.Config(
        num_experts=e, load_balance_coeff=1e-3,
        router=moe_mod.TokenChoiceTopKRouter.Config(
            num_experts=e, top_k=k, gate=Linear.Config(in_features=d, out_features=e)),
        routed_experts=moe_mod.RoutedExperts.Config(
            inner_experts=moe_mod.GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=e),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)),
        shared_experts=FeedForward.Config(
            w1=Linear.Config(in_features=d, out_features=f),
            w2=Linear.Config(in_features=f, out_features=d),
            w3=Linear.Config(in_features=d, out_features=f)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(d, d)
            self.layers = nn.ModuleList(cfg.build() for _ in range(2))
            for p in self.layers.parameters():  # torchtitan initialises in init_weights()
                nn.init.normal_(p, std=0.1)
            self.head = nn.Linear(d, 1)

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = h + layer(h)
            return self.head(h).squeeze(-1)

    return Net, d


def test_zoo_torchtitan_moe(tmp_path):
    build, d = _torchtitan_model()
    emap = discover(build())
    assert emap.n_experts == (4, 4)
    assert set(emap.owner) == {f"layers.{i}.routed_experts.inner_experts.{w}"
                               for i in range(2) for w in ("w1_EFD", "w2_EDF", "w3_EFD")}

    def loss(model, step):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 5, d, generator=g), torch.randn(2, 5, generator=g)
        return ((model(x) - y) ** 2).mean()

    assert train_restore_export(tmp_path, build, loss)["stale"] > 0
