"""The Megatron-Core model of the Megatron tests (tests/megatron_worker.py,
tests/megatron_stock.py): a GPTModel with SequentialMLP (or grouped) experts and Megatron's
FP32Optimizer around Adam, built on the CPU. Imports no moepec (megatron_stock.py loads
with stock Megatron alone). Call megatron_shims.install() before building."""

from __future__ import annotations

import functools
import os

import megatron_shims
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

N_EXPERTS, N_LAYERS = 4, 2


def build(seed: int, grouped: str | None = None):
    """``grouped``: None for SequentialMLP experts; ``"te"`` for Transformer Engine's
    TEGroupedMLP with swiglu, as Megatron-LM builds them for ``--moe-grouped-gemm
    --swiglu`` (needs a ``transformer_engine``: tests/te_standin.py); ``"legacy"`` for
    Megatron's legacy GroupedMLP with swiglu, what the local spec builds for
    ``moe_grouped_gemm`` (needs ``grouped_gemm``: tests/grouped_gemm_standin.py)."""
    torch.manual_seed(seed)
    glu = {"moe_grouped_gemm": True, "gated_linear_unit": True,
           "activation_func": torch.nn.functional.silu} if grouped else {}
    cfg = TransformerConfig(
        num_layers=N_LAYERS, hidden_size=16, num_attention_heads=2,
        num_moe_experts=N_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=8,
        ffn_hidden_size=32, moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True, add_bias_linear=False, **glu)
    spec = get_gpt_layer_local_spec(num_experts=N_EXPERTS,
                                    moe_grouped_gemm=grouped == "legacy")
    if grouped == "te":  # the local layer with TE's experts (attention stays local)
        spec.submodules.mlp = get_moe_module_spec(use_te=True, num_experts=N_EXPERTS,
                                                  moe_grouped_gemm=True)
    model = GPTModel(cfg, spec, vocab_size=32, max_sequence_length=8)
    # Two groups as Megatron's get_megatron_optimizer makes them (its identifier keys).
    groups = [{"params": [p for n, p in model.named_parameters() if (".experts." in n) == e],
               "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": e,
               "is_decoupled_lr": False} for e in (False, True)]
    adam = torch.optim.Adam(groups, lr=1e-2)

    def init_state(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    opt = megatron_shims.fp32_optimizer(adam, OptimizerConfig(optimizer="adam", lr=1e-2),
                                        init_state)
    if os.environ.get("MOEPEC_TEST_SINGLETON") == "1":
        # The run's own choice of sharded keys: one key per (layer, expert), for every
        # sharded_state_dict() call (the guide's code included).
        model.sharded_state_dict = functools.partial(
            model.sharded_state_dict, metadata={"singleton_local_shards": True})
    return model, opt


def sharded(model, opt, loading: bool = False) -> dict:
    model_sd = model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading)}


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the training state by a stable name (weights and Adam moments)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"w:{name}"] = p.detach().clone()
        for k, v in opt.optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[f"{k}:{name}"] = v.detach().clone()
    return out
