"""A torchrun worker for tests/test_deepspeed.py: DeepSpeed engines with the moepec door
on CPU (gloo, 2 ranks). ``python ds_worker.py OUT PHASE[,PHASE...]``; each phase writes
its results as JSON per rank in OUT:

- ``matrix=CASES``: for each case ``stage:dtype:ep``, train with K=2 of 8 and save every
  2 steps (4 saves), then a fresh engine (another seed) loads ``latest``; every
  parameter's weight, fp32 master and Adam moments are compared with their values at the
  step the load report names for its expert (the last save's for non-expert ones);
- ``exact``: K = N (``attach``, no config section); save at step 4, train 4 more steps; a fresh engine loads and trains
  the same 4 steps: the losses, bit for bit;
- ``deleted``: saves with K=2; the tag that holds two experts' newest copies is deleted:
  the load reads them from their older copies; then the first (full) tag is deleted
  too: the load refuses in one line naming a folder that is gone;
- ``materialized``: DeepSpeed without moepec loads what ``moepec materialize`` wrote;
- ``hf``: the Hugging Face Trainer with the section in its DeepSpeed config saves and
  resumes;
- ``refusals``: a section field that does not apply refused in one line; ZeRO-3 (a dense
  model with the section) taken;
- ``kill``: a committed save, then rank 1 is SIGKILLed inside the next save;
  ``afterkill`` (a new launch): ``latest`` loads the committed one, the killed tag
  is refused.

DeepSpeed's CPU shared-memory allreduce op is switched off (gloo does its work): it is
JIT-compiled on first use, minutes of the suite's time, and not what is under test.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys

import deepspeed
import deepspeed.ops
import torch
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

import moepec.integrations.deepspeed as door
from moepec.errors import CheckpointError

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
N_EXPERTS = 8


class Net(nn.Module):
    def __init__(self, ep: int) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 32)
        self.moe = MoE(hidden_size=32, expert=nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                                            nn.Linear(64, 32)),
                       num_experts=N_EXPERTS, ep_size=ep, k=2, min_capacity=4)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h, aux, _ = self.moe(self.emb(x))
        return self.head(h), aux


def engine(stage: int, dtype: str, ep: int, seed: int, section: dict | None):
    torch.manual_seed(seed)
    net = Net(ep)
    if dtype == "bf16":
        net = net.to(torch.bfloat16)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "p"})
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "steps_per_print": 10 ** 6}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if section is not None:
        cfg["moepec"] = section
    eng, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=cfg)
    return eng


def train(eng, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed * 1000 + int(eng.global_steps))
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g).to(next(eng.module.parameters()).dtype)
        y = torch.randint(0, 4, (4,), generator=g)
        out, aux = eng(x)
        loss = nn.functional.cross_entropy(out.float(), y) + aux.float()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def state(eng) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter on this rank: its weight, and its fp32 master and Adam moments (the
    fragment in this rank's partition, under ZeRO-1/2 and bf16)."""
    out = {name: {"w": p.detach().clone()} for name, p in eng.module.named_parameters()}
    sd = eng.optimizer.state_dict()
    if "param_slice_mappings" in sd:
        for g, mapping in enumerate(sd["param_slice_mappings"]):
            flat = sd["single_partition_of_fp32_groups"][g]
            st = sd["base_optimizer_state"]["state"][g]
            for name, a in mapping.items():
                cut = slice(a.start, a.start + a.numel)
                out[name] |= {"fp32": flat[cut].clone(), "m": st["exp_avg"][cut].clone(),
                              "v": st["exp_avg_sq"][cut].clone()}
        return out
    opt = getattr(eng.optimizer, "optimizer", eng.optimizer)
    high = dict(zip(map(id, sum(getattr(eng.optimizer, "fp16_groups", []), [])),
                    sum(getattr(eng.optimizer, "fp32_groups", []), [])))
    for name, p in eng.module.named_parameters():
        master = high.get(id(p), p)  # bf16 at ZeRO-0: the optimizer's fp32 copy
        st = opt.state[master]
        out[name] |= {"fp32": master.detach().float().clone(), "m": st["exp_avg"].clone(),
                      "v": st["exp_avg_sq"].clone()}
    return out


def matrix(out: str, cases: list[str]) -> dict:
    results = {}
    for case in cases:
        stage, dtype, ep = case.split(":")
        save_dir = os.path.join(out, case.replace(":", "_"))
        eng = engine(int(stage), dtype, int(ep), seed=1, section={"k_persist": 2})
        at = {}
        for _ in range(4):
            train(eng, 2, seed=1)
            eng.save_checkpoint(save_dir)
            at[int(eng.global_steps)] = state(eng)
        units = door.expert_params(eng)
        fresh = engine(int(stage), dtype, int(ep), seed=7, section={"k_persist": 2})
        fresh.load_checkpoint(save_dir)
        report = door.last_load_report()
        got = state(fresh)
        last = max(at)
        bad = []
        for name, vals in got.items():
            unit = units.get(name)
            step = last if unit is None else report.sources[
                f"{unit[0].removeprefix('layer_')}/{unit[1]}"]["step"]
            bad += [f"{name}.{k}@{step}" for k, v in vals.items()
                    if not torch.equal(v, at[step][name][k])]
        results[case] = {"bad": bad, "checked": len(got),
                         "sources": {k: v["step"] for k, v in report.sources.items()},
                         "step": report.step, "plt": report.plt,
                         "global_steps": int(fresh.global_steps)}
    return results


def exact(out: str) -> dict:
    save_dir = os.path.join(out, "exact")
    eng = engine(2, "fp32", 2, seed=3, section=None)
    door.attach(eng, k_persist=N_EXPERTS)  # the explicit call instead of the section
    train(eng, 4, seed=3)
    eng.save_checkpoint(save_dir)
    after = train(eng, 4, seed=3)
    fresh = engine(2, "fp32", 2, seed=9, section=None)
    door.attach(fresh, k_persist=N_EXPERTS)
    fresh.load_checkpoint(save_dir)
    return {"uninterrupted": after, "resumed": train(fresh, 4, seed=3),
            "sources": sorted({v["step"] for v in door.last_load_report().sources.values()})}


def deleted(out: str) -> dict:
    save_dir = os.path.join(out, "deleted")
    eng = engine(1, "fp32", 2, seed=4, section={"k_persist": 2})
    for _ in range(4):
        train(eng, 1, seed=4)
        eng.save_checkpoint(save_dir)
    door.wait()  # the last save is written before its folders are touched
    torch.distributed.barrier()
    import shutil
    out = {}
    for tag in ("global_step3", "global_step1"):
        torch.distributed.barrier()  # no rank still reads what is deleted next
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(os.path.join(save_dir, tag))
        torch.distributed.barrier()
        fresh = engine(1, "fp32", 2, seed=5, section={"k_persist": 2})
        try:
            fresh.load_checkpoint(save_dir)
            report = door.last_load_report()
            out[tag] = {"error": None, "warnings": report.warnings,
                        "steps": sorted({s["step"] for s in report.sources.values()})}
        except CheckpointError as exc:
            out[tag] = {"error": str(exc)}
    return out


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(16, generator=g),
                "labels": torch.randint(0, 4, (), generator=g)}


class _HFNet(Net):
    def forward(self, x, labels=None):
        out, aux = super().forward(x)
        return {"loss": nn.functional.cross_entropy(out, labels) + aux, "logits": out}


def hf(out: str) -> dict:
    """The Hugging Face Trainer with a DeepSpeed config holding the moepec section: saves
    every 2 steps to 6, then a new Trainer resumes from the last checkpoint to 10."""
    from transformers import Trainer, TrainingArguments

    def trainer(steps: int) -> Trainer:
        torch.manual_seed(0)
        ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
              "moepec": {"k_persist": 2}}
        args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=steps,
                                 per_device_train_batch_size=4, save_steps=2, use_cpu=True,
                                 deepspeed=ds, report_to=[], seed=0, learning_rate=1e-2,
                                 disable_tqdm=True, logging_steps=100)
        return Trainer(model=_HFNet(1), args=args, train_dataset=_Batches())

    trainer(6).train()
    resumed = trainer(10)
    resumed.train(resume_from_checkpoint=True)
    report = door.last_load_report()
    return {"step": report.step, "global_step": resumed.state.global_step,
            "sources": {k: v["step"] for k, v in report.sources.items()}}


def materialized(out: str) -> dict:
    """`moepec materialize` of the ZeRO-2 EP-2 save: DeepSpeed without moepec loads the
    tag it wrote to the same state as the door's stitched load of the moepec save."""
    from moepec.integrations.ds_export import materialize

    save_dir, target = os.path.join(out, "2_fp32_2"), os.path.join(out, "materialized")
    if torch.distributed.get_rank() == 0:
        materialize(save_dir, target)
    torch.distributed.barrier()
    stitched = engine(2, "fp32", 2, seed=11, section={"k_persist": 2})
    stitched.load_checkpoint(save_dir)
    plain = engine(2, "fp32", 2, seed=12, section=None)
    plain.load_checkpoint(target)
    a, b = state(stitched), state(plain)
    return {"bad": [f"{n}.{k}" for n in a for k in a[n] if not torch.equal(a[n][k], b[n][k])],
            "checked": len(a), "steps": [int(stitched.global_steps), int(plain.global_steps)],
            "fp32": fp32_exports(out) if torch.distributed.get_rank() == 0 else {}}


def fp32_exports(out: str) -> dict:
    """`moepec export --fp32` of three saves against their model export: equal at fp32,
    rounding to it at bf16; a ZeRO-0 save refused."""
    from safetensors.torch import load_file

    from moepec.integrations.ds_export import export_fp32, export_model

    res = {}
    for case in ("2_fp32_2", "2_fp32_1", "1_bf16_2"):
        a, b = os.path.join(out, f"{case}.fp32.st"), os.path.join(out, f"{case}.model.st")
        export_fp32(os.path.join(out, case), a)
        export_model(os.path.join(out, case), b)
        fp32, model = load_file(a), load_file(b)
        res[case] = {"names": sorted(fp32) == sorted(model), "n": len(fp32),
                     "dtypes": sorted({str(t.dtype) for t in fp32.values()}),
                     "bad": [k for k in fp32
                             if not torch.equal(fp32[k].to(model[k].dtype), model[k])]}
    try:
        export_fp32(os.path.join(out, "0_bf16_1"), os.path.join(out, "zero0.st"))
        res["zero0"] = None
    except CheckpointError as exc:
        res["zero0"] = str(exc)
    return res


def refusals(out: str) -> dict:
    """What the door refuses, in one line each: a field that does not apply, ZeRO-3."""
    from moepec.errors import ConfigError

    said = {}
    for name, make in (
            ("field", lambda: engine(2, "fp32", 2, seed=1, section={"interval": 5})),
            ("zero3", lambda: _dense(3))):
        try:
            make().save_checkpoint(os.path.join(out, f"refused_{name}"))
            said[name] = None
        except ConfigError as exc:
            said[name] = str(exc)
    return said


def _dense(stage: int):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "moepec": {"k_persist": 2}}
    eng, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return eng


def kill(out: str) -> dict:
    save_dir = os.path.join(out, "killed")
    eng = engine(2, "fp32", 2, seed=6, section={"k_persist": 2})
    train(eng, 2, seed=6)
    eng.save_checkpoint(save_dir)
    train(eng, 2, seed=6)
    real = door.write_rank

    def dying(folder, tensors, rank):
        if rank == 1:  # rank 1 dies in the middle of writing its share
            half = dict(list(tensors.items())[: len(tensors) // 2])
            real(folder, half, rank)
            os.kill(os.getpid(), signal.SIGKILL)
        real(folder, tensors, rank)

    door.write_rank = dying
    with open(os.path.join(out, f"kill_started_{torch.distributed.get_rank()}"), "w"):
        pass
    eng.save_checkpoint(save_dir)
    return {"survived": True}


def afterkill(out: str) -> dict:
    save_dir = os.path.join(out, "killed")
    with open(os.path.join(save_dir, "latest")) as f:
        latest = f.read()
    fresh = engine(2, "fp32", 2, seed=8, section={"k_persist": 2})
    fresh.load_checkpoint(save_dir)
    report = door.last_load_report()
    try:
        engine(2, "fp32", 2, seed=8, section={"k_persist": 2}).load_checkpoint(
            save_dir, tag="global_step4")
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    return {"latest": latest, "step": report.step, "refused": refused}


if __name__ == "__main__":
    out, phases = sys.argv[1], sys.argv[2].split(",")
    results = {}
    for phase in phases:  # results after each phase: `kill` ends the process
        name, _, arg = phase.partition("=")
        results[name] = matrix(out, arg.split("+")) if name == "matrix" else \
            globals()[name](out)
        rank = torch.distributed.get_rank()
        with open(os.path.join(out, f"results_{name}_{rank}.json"), "w") as f:
            json.dump(results[name], f)
    # The engines' cycles freed, then the process groups left, before exit: one left to
    # the interpreter's teardown aborted a rank now and then ("terminate called without
    # an active exception", as tests/test_exit.py tells; seen once in a full suite run).
    gc.collect()
    torch.distributed.destroy_process_group()
