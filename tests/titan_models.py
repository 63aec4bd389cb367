"""Small torchtitan models for the tests (tests/test_torchtitan*.py); no side effects on
import, unlike titan_shims (which imports this module for its ``deepseek_v3_tiny``)."""

from __future__ import annotations

from typing import Any


def tiny_deepseek_v3() -> Any:
    """deepseek_v3's debug model config, narrower and shallower (1 dense + 2 MoE layers of
    8 experts), so that a CPU test step takes a fraction of a second and a checkpoint
    ~10 MB; its attention is SDPA (FlexAttention has no CPU backward)."""
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE

    dim, vocab, rope_dim = 64, 2048, 16
    layers = ds._build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70,
        dense_hidden_dim=128, moe_hidden_dim=32, num_experts=8, num_shared_experts=1,
        router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=512, theta=10000.0))
    tiny = ds.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=ds._output_linear_init(dim)),
        layers=layers, mtp_layers=[])
    for _fqn, _c, parent, attr in list(tiny.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return tiny
