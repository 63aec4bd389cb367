"""Trainer: learning, determinism, metrics, schedule, and data parallelism over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from moepec import CheckpointConfig
from moepec.errors import ConfigError
from moepec.models import GPTMoE, get_config
from moepec.train.dist import average_gradients
from moepec.train.trainer import (
    TrainConfig,
    build_optimizer,
    build_scheduler,
    param_digest,
    train,
    train_step,
)
from tests.spawning import start_processes

REPO = Path(__file__).resolve().parents[1]
FAST = dict(config="tiny", progress=False, eval_batches=2, threads=1)


def test_loss_falls_on_the_default_corpus() -> None:
    result = train(TrainConfig(**FAST, steps=150, batch_size=16, eval_interval=0))
    assert result.losses[0] > 5.0  # ~ln(256): an untrained byte model
    late = sum(result.losses[-10:]) / 10
    assert late < 3.5, late
    assert result.val_loss is not None and result.val_loss < 3.5
    assert result.steps == 150 and result.final_step == 149
    assert result.tokens == 150 * 16 * 32 and result.tokens_per_s > 0


def test_same_seed_same_losses_bit_for_bit() -> None:
    cfg = dict(**FAST, steps=12, batch_size=8, return_state=True)
    a, b = train(TrainConfig(**cfg, seed=7)), train(TrainConfig(**cfg, seed=7))
    assert a.losses == b.losses
    assert param_digest(a.model_state) == param_digest(b.model_state)
    c = train(TrainConfig(**cfg, seed=8))
    assert c.losses != a.losses


def test_run_freezes_gc_and_unfreezes_after(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    import moepec.train.trainer as train_mod

    seen = []
    loop = train_mod._loop
    monkeypatch.setattr(train_mod, "_loop",
                        lambda *a: (seen.append(gc.get_freeze_count()), loop(*a))[1])
    assert gc.get_freeze_count() == 0
    train(TrainConfig(**FAST, steps=2, batch_size=4, eval_interval=0))
    assert seen and seen[0] > 1000  # the set-up's objects are out of the GC's scans
    assert gc.get_freeze_count() == 0  # and given back at the end


def test_metrics_jsonl_and_summary(tmp_path: Path) -> None:
    train(TrainConfig(**FAST, steps=12, batch_size=4, log_interval=5, eval_interval=6,
                      out_dir=str(tmp_path / "run")))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 4, 5, 9, 11]
    assert {"step", "loss", "lr", "tokens_per_s", "dropped", "aux_loss"} <= set(lines[0])
    assert [r["step"] for r in lines if "val_loss" in r] == [5, 11]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["val_loss"] == lines[-1]["val_loss"]


def test_warmup_then_cosine_schedule() -> None:
    cfg = TrainConfig(config="tiny", steps=110, warmup=10, lr=1e-3, min_lr=1e-4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(cfg.steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(5.5e-4)  # halfway down the cosine
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    assert sched.state_dict()["last_epoch"] == 110


def test_train_step_updates_weights_and_clears_grads() -> None:
    torch.manual_seed(0)
    model = GPTMoE(get_config("tiny"))
    cfg = TrainConfig(config="tiny")
    opt = build_optimizer(model, cfg)
    before = param_digest(model)
    x = torch.randint(0, 256, (2, 32))
    result = train_step(model, opt, build_scheduler(opt, cfg), x, x, grad_clip=1.0)
    assert param_digest(model) != before
    assert all(p.grad is None for p in model.parameters())
    assert len(result.routing) == 1 and result.loss > 0
    # weight decay on matrices and embeddings only; stacked expert biases are exempt
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "blocks.1.ffn.experts.w1" in names and "blocks.1.ffn.experts.b1" not in names


def test_train_config_validation_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="valid names"):
        TrainConfig(config="nope")
    with pytest.raises(ConfigError, match="vocab mismatch"):
        TrainConfig(config="tiny", model_overrides={"vocab_size": 128})
    with pytest.raises(ConfigError, match="--k"):
        TrainConfig(config="tiny", checkpoint=CheckpointConfig(path="unused", k_persist=5))
    with pytest.raises(ConfigError, match="set checkpoint"):
        TrainConfig(config="tiny", restarts=1)


def test_train_config_choices_are_enums_validated_once() -> None:
    from moepec.train.config import Device, OnPersistError

    cfg = TrainConfig(config="tiny", device="cpu", on_persist_error="stop")
    assert cfg.device is Device.CPU and cfg.on_persist_error is OnPersistError.STOP
    with pytest.raises(ConfigError, match="unknown device 'tpu'; choose one of auto, cpu, cuda"):
        TrainConfig(config="tiny", device="tpu")
    with pytest.raises(ConfigError, match="unknown on_persist_error 'ignore'"):
        TrainConfig(config="tiny", on_persist_error="ignore")
    # the checkpoint's choices are its own config's, checked when it is built
    with pytest.raises(ConfigError, match="unknown selection 'bogus'"):
        CheckpointConfig(path="unused", selection="bogus")
    with pytest.raises(ConfigError, match="CheckpointConfig"):
        TrainConfig(config="tiny", checkpoint={"path": "d"})


# ---- data parallelism over gloo (2 spawned processes, file rendezvous: no ports) ----

DP_CFG = dict(**FAST, steps=6, batch_size=8, seed=3, eval_interval=0,
              # no aux loss and no drops: then 2 ranks x 4 sequences == 1 rank x 8
              model_overrides={"aux_loss_coef": 0.0, "capacity_factor": 8.0})


def _dp_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                  world_size=world)
    try:
        result = train(TrainConfig(**DP_CFG, return_state=True))
        torch.save({"losses": result.losses, "state": result.model_state,
                    "digest": param_digest(result.model_state),
                    "world_size": result.world_size}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def test_two_ranks_end_identical_and_match_one_rank(tmp_path: Path) -> None:
    start_processes(_dp_worker, (2, str(tmp_path / "store"), str(tmp_path)), 2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["world_size"] == 2
    assert r0["digest"] == r1["digest"]  # bit-identical weights on both ranks
    assert r0["losses"] == r1["losses"]  # the printed loss is the rank average
    single = train(TrainConfig(**DP_CFG, return_state=True))
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(single.losses),
                               rtol=1e-4, atol=1e-5)
    for name, value in single.model_state.items():
        torch.testing.assert_close(r0["state"][name], value, rtol=1e-3, atol=1e-5)


def _avg_worker(rank: int, store: str, out_dir: str) -> None:
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        a = torch.nn.Parameter(torch.zeros(2, 3))
        b = torch.nn.Parameter(torch.zeros(4))
        a.grad = torch.full((2, 3), float(rank + 1))
        if rank == 0:
            b.grad = torch.full((4,), 4.0)  # rank 1 has no grad for b: counts as zero
        average_gradients([a, b])
        torch.save({"a": a.grad, "b": b.grad}, Path(out_dir) / f"g{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def test_average_gradients_means_over_ranks(tmp_path: Path) -> None:
    start_processes(_avg_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    for r in range(2):
        g = torch.load(tmp_path / f"g{r}.pt")
        assert torch.equal(g["a"], torch.full((2, 3), 1.5))
        assert torch.equal(g["b"], torch.full((4,), 2.0))


@pytest.mark.slow
def test_torchrun_cli_two_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "moepec", "train", "--config", "tiny", "--steps", "5", "--batch-size",
           "8", "--no-progress", "--threads", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 5
    assert proc.stdout.count("first train loss") == 1  # only rank 0 prints
