"""The model zoo: tiny random models from transformers' own config classes (no downloads).

Each is trained a few steps with PEC at K=1 (interval 2), restored into a fresh model and
checked bit for bit (non-expert state at the newest checkpoint, every expert at the step
it was last saved: stale on purpose), and its safetensors export is loaded with
``load_state_dict(strict=True)`` (tests/zoo_check.py). Skipped when transformers (the
``moepec[hf]`` extra) is not installed.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'moepec[hf]'")

from moepec.state.experts import discover  # noqa: E402
from tests.zoo_check import train_restore_export  # noqa: E402

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
