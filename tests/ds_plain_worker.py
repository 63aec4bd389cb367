"""A torchrun worker that never imports moepec: DeepSpeed 0.19.8 as it is, loading a tag
``moepec materialize`` wrote (tests/test_deepspeed_hf.py). ``python ds_plain_worker.py
OUT SAVE_DIR``: the Qwen2-MoE model of tests/ds_hf_worker.py (another seed) at ZeRO-3,
``engine.load_checkpoint(SAVE_DIR)``, then this rank's state as :func:`raw` gives it in
``OUT/plain_<rank>.safetensors``. tests/ds_hf_worker.py imports :func:`raw` and
:func:`qwen2` from here, so both sides read the state one way."""

from __future__ import annotations

import os
import sys

import torch

V, H, E = 64, 16, 4


def qwen2_config():
    """Qwen2-MoE, 3 layers, 4 stacked experts and a shared expert per layer (tiny)."""
    import transformers

    return transformers.Qwen2MoeConfig(
        vocab_size=V, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=3, moe_intermediate_size=8, shared_expert_intermediate_size=16,
        num_experts=E, num_experts_per_tok=2)


def qwen2(seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen2MoeForCausalLM(qwen2_config())


def raw(engine) -> dict[str, torch.Tensor]:
    """A ZeRO-3 engine's state on this rank, whole: each optimizer sub-group's flat fp32
    partition and Adam moments, each parameter's partition (``ds_tensor``)."""
    sd = engine.optimizer.state_dict()
    out = {f"fp32.{g}": t for g, t in enumerate(sd["fp32_flat_groups"])}
    for g, st in sd["optimizer_state_dict"]["state"].items():
        out[f"exp_avg.{g}"], out[f"exp_avg_sq.{g}"] = st["exp_avg"], st["exp_avg_sq"]
    for name, p in engine.module.named_parameters():
        out[f"w.{name}"] = p.ds_tensor
    out["global_steps"] = torch.tensor(int(engine.global_steps))
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


if __name__ == "__main__":
    import deepspeed
    import deepspeed.ops
    from safetensors.torch import save_file

    # as tests/ds_worker.py: gloo serves the collectives; DeepSpeed's CPU shared-memory
    # op would JIT-compile first (minutes of g++ on a fresh machine)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    out, save_dir = sys.argv[1], sys.argv[2]
    net = qwen2(11)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "steps_per_print": 10 ** 6}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config)
    engine.load_checkpoint(save_dir)
    assert not any(m.startswith("moepec") for m in sys.modules), "moepec was imported"
    save_file(raw(engine), os.path.join(out, f"plain_{torch.distributed.get_rank()}"
                                             f".safetensors"))
