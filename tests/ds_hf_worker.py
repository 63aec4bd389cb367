"""A torchrun worker for tests/test_deepspeed_hf.py: transformers MoE models (random
weights from their config classes) under plain ``deepspeed.initialize`` with the moepec
door, CPU, gloo, 2 ranks. ``python ds_hf_worker.py OUT PHASE[,PHASE...]``; each phase
writes its results as JSON per rank in OUT:

- ``stitched=CASES`` (``model:stage``): K=2 of 4 experts per layer, a save after each of 4
  steps (the first full), the routers' own top-k choices counted beside the door; a fresh
  engine (another seed) loads ``latest``: every parameter's weight, fp32 master and Adam
  moments -- each expert's rows of a stacked parameter, or its module's parameters --
  compared with their values at the step the load report names for that expert (the
  last save's for non-expert state), on both ranks;
- ``exact=CASES``: K = N, a save at step 2, 2 more steps; a fresh engine loads and trains
  the same 2 steps: the losses, bit for bit;
- ``final``: ``complete_next_save`` before a save: every expert, and a resume from it
  bit-exact;
- ``dense``: a model with no experts and a section: the one-line warning;
- ``trainer=STAGES``: the Hugging Face Trainer on transformers' own Mixtral, saves and a
  resume (at ``FINAL_STAGES`` with the ``FinalSave`` callback: the last save complete);
- ``load_aware``: load-aware selection fed by the routers' counts;
- ``accelerate``: Accelerate's ``save_state``/``load_state`` with its DeepSpeed plugin
  at ZeRO-2, the same model.

Models: ``mixtral`` is transformers' Mixtral with each layer's experts as a module list
(one module per expert, ``experts.{e}.w1/w2/w3``: the layout of transformers 4.x and of
most fine-tuning code; transformers 5 stacks them), ``qwen2`` Qwen2-MoE (stacked
``[E, ...]`` experts and a shared expert), sized so that ZeRO-2's partition boundary
between the 2 ranks falls inside one expert's row of a stacked parameter.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

import deepspeed
import torch
import torch._dynamo  # noqa: F401 - before any zero.Init (see engine)
from torch import nn

import moepec.integrations.deepspeed as door
from moepec.integrations.ds_files import Rows
from tests.ds_plain_worker import E, H, V, qwen2, qwen2_config, raw
from tests.ds_worker import state

FINAL_STAGES = ("2", "3")
"""Trainer stages run with :class:`moepec.integrations.ds_trainer.FinalSave` (the others
without: their last save is K of N, and a resume stitches)."""


class ExpertMLP(nn.Module):
    """One Mixtral expert as transformers 4.x built it (``MixtralBlockSparseTop2MLP``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(H, 16, bias=False)
        self.w2 = nn.Linear(16, H, bias=False)
        self.w3 = nn.Linear(H, 16, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ExpertList(nn.ModuleList):
    """Mixtral's experts as a module list, called as transformers 5 calls its experts."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                part = expert(hidden[token]) * top_k_weights[token, slot, None]
                out.index_add_(0, token, part.to(out.dtype))
        return out


def model(name: str, seed: int) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    attn = dict(vocab_size=V, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=2)
    if name == "mixtral":
        m = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **attn, intermediate_size=16, num_local_experts=E, num_experts_per_tok=2))
        for layer in m.model.layers:
            layer.mlp.experts = ExpertList(ExpertMLP() for _ in range(E))
        return m
    # 3 layers: ZeRO-2's boundary between 2 ranks falls in expert 2's row of layer 1's
    # gate_up_proj (value 752 of it, 256 a row)
    return qwen2(seed)


def engine(name: str, stage: int | str, seed: int, section: dict | None):
    """``stage``: the ZeRO stage, ``"2bf16"`` for stage 2 in bf16, ``"3init"`` for stage 3
    with the model built under ``deepspeed.zero.Init`` (each parameter partitioned as it
    is made, as transformers does for ZeRO-3)."""
    bf16 = str(stage).endswith("bf16")
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": int(str(stage)[0])},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "steps_per_print": 10 ** 6}
    if str(stage).endswith("init"):  # qwen2 only
        # transformers builds and initializes it under zero.Init while an
        # HfDeepSpeedConfig of a ZeRO-3 config lives (from_pretrained / from_config).
        # torch._dynamo is imported at the top of this file: transformers imports it
        # lazily, and it refuses to be imported under zero.Init (which patches
        # torch.Tensor.__new__).
        from transformers import Qwen2MoeForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        alive = HfDeepSpeedConfig(cfg)
        torch.manual_seed(seed)
        net = Qwen2MoeForCausalLM._from_config(qwen2_config())
        del alive
    else:
        net = model(name, seed)
    if bf16:
        net = net.to(torch.bfloat16)
        cfg["bf16"] = {"enabled": True}
    if section is not None:
        cfg["moepec"] = section
    eng, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return eng


def train(eng, steps: int, seed: int) -> list[float]:
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + int(eng.global_steps) * 2
                                          + torch.distributed.get_rank())
        ids = torch.randint(0, V, (2, 8), generator=g)
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def routed(eng) -> tuple[list[list[int]], list]:
    """Count each MoE layer's top-k choices as the model makes them (the routers'
    ``top_k_index``), independently of the door: [layer][expert], and the hook handles."""
    counts: list[list[int]] = []
    handles = []
    for block in (m for m in eng.module.modules() if hasattr(m, "experts")
                  and hasattr(m, "gate")):
        row = [0] * E
        counts.append(row)

        def hook(_m, _i, out, row=row):
            for e in out[2].reshape(-1).tolist():
                row[e] += 1
        handles.append(block.gate.register_forward_hook(hook))
    return counts, handles


def snapshot(eng) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`tests.ds_worker.state`, and at ZeRO-3 each parameter's part of this rank's
    partition: its weights, fp32 master and Adam moments (padding left out)."""
    frags = door.zero3_fragments(eng)
    if frags is None:
        return state(eng)
    opt = eng.optimizer
    sd = opt.state_dict()
    names = dict(eng.module.named_parameters())
    out = {}
    for g, group in enumerate(frags):
        flat = sd["fp32_flat_groups"][g]
        st = sd["optimizer_state_dict"]["state"][g]
        for name, start, numel in group:
            cut = slice(start, start + numel)
            out[name] = {"w": names[name].ds_tensor.reshape(-1)[:numel].clone(),
                         "fp32": flat[cut].clone(), "m": st["exp_avg"][cut].clone(),
                         "v": st["exp_avg_sq"][cut].clone()}
    return out


def compare(got: dict, at: dict, experts: dict, source: dict, last: int) -> list[str]:
    """Each tensor of ``got`` against its value at the step its expert came from."""
    bad = []
    for name, vals in got.items():
        rule = experts.get(name)
        for k, v in vals.items():
            if rule is None or isinstance(rule, tuple):
                step = last if rule is None else source[_unit(rule)]
                if not torch.equal(v, at[step][name][k]):
                    bad.append(f"{name}.{k}@{step}")
                continue
            flat = v.reshape(-1)  # a stacked parameter: one expert's run of elements each
            offset = 0 if flat.numel() == rule.numel else rule.offset
            for start, n, unit in rule.pieces(0, flat.numel(), offset):
                step = source[_unit(unit)]
                if not torch.equal(flat[start:start + n],
                                   at[step][name][k].reshape(-1)[start:start + n]):
                    bad.append(f"{name}.{k}[{start}+{n}]@{step}")
    return bad


def _unit(unit: tuple[str, int]) -> str:
    return f"{unit[0].removeprefix('layer_')}/{unit[1]}"


def crossing(experts: dict) -> list[str]:
    """Stacked parameters whose ZeRO fragment on this rank starts or ends inside a row."""
    out = []
    for name, rule in experts.items():
        if isinstance(rule, Rows) and rule.offset:
            per = rule.numel // rule.experts
            if rule.offset % per:
                out.append(name)
    return out


def stitched(out: str, cases: list[str]) -> dict:
    results = {}
    for case in cases:
        name, stage = case.split(":")
        save_dir = os.path.join(out, case.replace(":", "_"))
        eng = engine(name, stage, seed=1, section={"k_persist": 2})
        counts, handles = routed(eng)
        at = {}
        for _ in range(4):
            train(eng, 1, seed=1)
            eng.save_checkpoint(save_dir)
            at[int(eng.global_steps)] = snapshot(eng)
        for h in handles:
            h.remove()
        door.wait()
        experts = door.attach(eng, k_persist=2).experts()
        fresh = engine(name, stage, seed=7, section={"k_persist": 2})
        fresh.load_checkpoint(save_dir)
        report = door.last_load_report()
        source = {k: v["step"] for k, v in report.sources.items()}
        if case == "qwen2:3":  # what a DeepSpeed without moepec loads from it materialized
            from safetensors.torch import save_file
            rank = torch.distributed.get_rank()
            save_file(raw(fresh), os.path.join(out, f"stitched_qwen2_3_{rank}.safetensors"))
        results[case] = {
            "bad": compare(snapshot(fresh), at, experts, source, max(at)),
            "checked": len(at[max(at)]), "sources": source, "step": report.step,
            "plt": report.plt, "global_steps": int(fresh.global_steps),
            "layouts": sorted({"rows" if isinstance(r, Rows) else "module"
                               for r in experts.values()}),
            "crossing": crossing(experts), "routed": counts,
            "experts": sorted({n for n in experts}),
        }
    return results


def load_aware(out: str, _cases: list[str]) -> dict:
    """``selection: load_aware``, K=1, qwen2 at ZeRO-2, a save after each of 3 steps: the
    routers' own choices counted beside the door after each save (cumulative)."""
    save_dir = os.path.join(out, "load_aware")
    eng = engine("qwen2", 2, seed=5, section={"k_persist": 1, "selection": "load_aware"})
    counts, handles = routed(eng)
    after = []
    for _ in range(3):
        train(eng, 1, seed=5)
        eng.save_checkpoint(save_dir)
        after.append([list(row) for row in counts])
    for h in handles:
        h.remove()
    door.wait()
    return {"after": after}


def exact(out: str, cases: list[str]) -> dict:
    results = {}
    for case in cases:
        name, stage = case.split(":")
        save_dir = os.path.join(out, "exact_" + case.replace(":", "_"))
        eng = engine(name, int(stage), seed=3, section={"k_persist": E})
        train(eng, 2, seed=3)
        eng.save_checkpoint(save_dir)
        after = train(eng, 2, seed=3)
        fresh = engine(name, int(stage), seed=9, section={"k_persist": E})
        fresh.load_checkpoint(save_dir)
        results[case] = {"uninterrupted": after, "resumed": train(fresh, 2, seed=3),
                         "sources": sorted({v["step"] for v in
                                            door.last_load_report().sources.values()})}
    return results


def final(out: str, _cases: list[str]) -> dict:
    """``complete_next_save``: qwen2 at ZeRO-2, K=1 of 4, saves at steps 2 (full) and 3
    (marked final: every expert), 2 more steps; a fresh engine loads ``latest`` and trains
    the same 2 steps: the losses, bit for bit; the save after the final one is K=1."""
    save_dir = os.path.join(out, "final")
    eng = engine("qwen2", 2, seed=4, section={"k_persist": 1})
    train(eng, 2, seed=4)
    eng.save_checkpoint(save_dir)
    train(eng, 1, seed=4)
    door.complete_next_save(eng)
    eng.save_checkpoint(save_dir)
    after = train(eng, 2, seed=4)
    eng.save_checkpoint(save_dir)
    door.wait()
    fresh = engine("qwen2", 2, seed=8, section={"k_persist": 1})
    fresh.load_checkpoint(save_dir, tag="global_step3")
    report = door.last_load_report()
    saved = {t: len(json.load(open(os.path.join(save_dir, t, "moepec.json")))["experts_saved"])
             for t in ("global_step2", "global_step3", "global_step5")}
    return {"uninterrupted": after, "resumed": train(fresh, 2, seed=4), "saved": saved,
            "sources": sorted({v["checkpoint"] for v in report.sources.values()}),
            "n": len(report.sources), "lost": report.lost_total, "plt": report.plt}


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer(out: str, stages: list[str]) -> dict:
    """The Hugging Face Trainer (``deepspeed=`` a config dict with the ZeRO stage and the
    section) on transformers' own Mixtral (stacked experts), per stage: saves every 2
    steps to 6, then a new Trainer resumes from the last checkpoint and trains to 10."""
    return {stage: _trainer(os.path.join(out, f"trainer_{stage}"), stage) for stage in stages}


def _trainer(out: str, stage: str) -> dict:
    """``stage``: the ZeRO stage; ``3leaf``: ZeRO-3 with the MoE blocks as leaf modules
    (``set_z3_leaf_modules``, as LLaMA-Factory and axolotl do) and the 16-bit weights
    gathered at each save (``stage3_gather_16bit_weights_on_model_save``)."""
    from transformers import Trainer, TrainingArguments

    from moepec.integrations.ds_trainer import FinalSave

    def run(steps: int) -> Trainer:
        net = mixtral(0)
        zero = {"stage": int(stage[0])}
        if stage == "3leaf":
            from deepspeed.utils import set_z3_leaf_modules
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

            set_z3_leaf_modules(net, [MixtralSparseMoeBlock])
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
              "moepec": {"k_persist": 1}}
        args = TrainingArguments(output_dir=out, max_steps=steps,
                                 per_device_train_batch_size=2, save_steps=2, use_cpu=True,
                                 deepspeed=ds, report_to=[], seed=0, learning_rate=1e-2,
                                 disable_tqdm=True, logging_steps=100)
        trainer = Trainer(model=net, args=args, train_dataset=_Tokens())
        if stage in FINAL_STAGES:  # the last save (max_steps) marked complete
            trainer.add_callback(FinalSave(trainer))
        return trainer

    run(6).train()
    resumed = run(10)
    resumed.train(resume_from_checkpoint=True)
    report = door.last_load_report()
    return {"step": report.step, "global_step": resumed.state.global_step,
            "sources": {k: v["step"] for k, v in report.sources.items()}, "plt": report.plt}


def mixtral(seed: int) -> nn.Module:
    """transformers' own Mixtral (stacked experts), tiny."""
    import transformers

    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=V, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=2, intermediate_size=16, num_local_experts=E,
        num_experts_per_tok=2))


def accelerate(out: str, _cases: list[str]) -> dict:
    """Accelerate's own loop with its DeepSpeed plugin (ZeRO-2, the section) and automatic
    checkpoint naming: ``save_state`` after steps 2, 4 and 6 (``checkpoints/checkpoint_<i>``,
    tag ``pytorch_model``); a new Accelerator and model (another seed) ``load_state``: every
    expert as at the step its report names, all else as at step 6."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DummyOptim, ProjectConfiguration

    def prepared(seed: int):
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "moepec": {"k_persist": 1}}
        # a new process's Accelerator (one DeepSpeed plugin per process; the Trainer
        # phase's, and the first run's, reset as the Trainer resets them)
        AcceleratorState._reset_state()
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds),
                          project_config=ProjectConfiguration(
                              project_dir=os.path.join(out, "accelerate"),
                              automatic_checkpoint_naming=True))
        net = mixtral(seed)
        eng, _ = acc.prepare(net, DummyOptim(net.parameters()))
        return acc, eng

    acc, eng = prepared(1)
    at = {}
    for _ in range(3):
        train(eng, 2, seed=1)
        acc.save_state()
        at[int(eng.global_steps)] = state(eng)
    door.wait()
    experts = door.attach(eng, k_persist=1).experts()
    acc2, fresh = prepared(7)
    acc2.load_state()
    report = door.last_load_report()
    source = {k: v["step"] for k, v in report.sources.items()}
    root = os.path.join(out, "accelerate", "checkpoints")
    saved = {f: len(json.load(open(os.path.join(root, f, "moepec.json")))["experts_saved"])
             for f in sorted(os.listdir(root))}
    return {"bad": compare(state(fresh), at, experts, source, max(at)), "sources": source,
            "step": report.step, "saved": saved}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def dense(out: str, _cases: list[str]) -> dict:
    """A section on a model without experts: the warning, at deepspeed.initialize."""
    lines = _Lines()
    logging.getLogger("moepec.integrations.deepspeed").addHandler(lines)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "moepec": {"k_persist": 2}}
    deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return {"warnings": [m for m in lines.lines if "no experts" in m]}


if __name__ == "__main__":
    out, phases = sys.argv[1], sys.argv[2].split(",")
    for phase in phases:
        name, _, arg = phase.partition("=")
        res = globals()[name](out, arg.split("+") if arg else [])
        rank = torch.distributed.get_rank()
        with open(os.path.join(out, f"results_{name}_{rank}.json"), "w") as f:
            json.dump(res, f)
    # The engines' cycles freed, then the process groups left, before exit: one left to
    # the interpreter's teardown aborted a rank now and then ("terminate called without
    # an active exception", as tests/test_exit.py tells; seen once in a full suite run).
    gc.collect()
    torch.distributed.destroy_process_group()
