"""A torchrun worker for tests/test_lightning.py: Lightning 2.6's ``Trainer`` with its
``DeepSpeedStrategy`` at ZeRO-2 (tests/lightning_shims.py lets it run on CPU) and the
``"moepec"`` section, on transformers' own Mixtral (stacked experts), 2 ranks, gloo.
``python lightning_worker.py OUT PHASE[,PHASE...]``; each phase writes its results as
JSON per rank in OUT. Two steps per epoch (8 samples, 2 per rank), a checkpoint at each
epoch's end (``ModelCheckpoint``: a folder ``epoch=E-step=S.ckpt`` each, DeepSpeed's tag
``checkpoint`` inside):

- ``stitched``: K=1 of 4, ``save_top_k=-1`` (the setting docs/deepspeed.md recommends),
  3 epochs; a new Trainer and model (another seed) resumes with ``ckpt_path=`` the last
  folder: at ``on_train_start`` every expert's weights, fp32 master and Adam moments as at
  the step the load report names, all else as at the last save; one more epoch saves;
- ``exact``: K = N, 2 epochs; a new Trainer resumes from the first epoch's folder: the
  second epoch's losses, bit for bit;
- ``rotate``: K=1 and ``ModelCheckpoint``'s default ``save_top_k=1`` (it deletes the
  previous folder after each save), 3 epochs: the save at step 4 reads experts from the
  one at step 2, deleted after it; the save at step 6 finds that and is full: the
  warning, the saves, and a resume from the one folder left.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

import moepec.integrations.deepspeed as door
from tests.ds_hf_worker import V, compare, mixtral
from tests.ds_worker import state
from tests.lightning_shims import CpuDeepSpeedStrategy


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Lit(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = mixtral(seed)

    def training_step(self, batch: dict, _index: int) -> torch.Tensor:
        return self.net(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Tokens(), batch_size=2)


class Record(Callback):
    """The engine's state at each epoch's end (before ModelCheckpoint, which Lightning
    runs last: the state it saves), at the start of training (after a resume's load),
    and each step's loss."""

    def __init__(self) -> None:
        self.at: dict[int, dict] = {}
        self.start: dict | None = None
        self.losses: list[float] = []

    def on_train_start(self, trainer, _module) -> None:
        if trainer.global_step:  # resumed (a fresh optimizer has no moments to read)
            self.start = state(trainer.strategy.deepspeed_engine)

    def on_train_batch_end(self, _trainer, _module, outputs, _batch, _index) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_epoch_end(self, trainer, _module) -> None:
        self.at[trainer.global_step] = state(trainer.strategy.deepspeed_engine)


def fit(dirpath: str, k: int, epochs: int, seed: int, ckpt_path: str | None = None,
        **checkpoint) -> tuple[pl.Trainer, Record]:
    record = Record()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "moepec": {"k_persist": k}}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=CpuDeepSpeedStrategy(config=config),
        max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=dirpath,
        callbacks=[record, ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, **checkpoint)])
    pl.seed_everything(0, verbose=False)  # the samplers' order; ``seed``: the model's
    trainer.fit(Lit(seed), ckpt_path=ckpt_path)
    door.wait()  # this rank's write; the last rank to finish commits
    torch.distributed.barrier()
    return trainer, record


def saved(dirpath: str) -> dict[str, int]:
    """Experts saved per checkpoint folder (its moepec manifest)."""
    return {f: len(json.load(open(os.path.join(dirpath, f, "moepec.json")))["experts_saved"])
            for f in sorted(os.listdir(dirpath)) if f.endswith(".ckpt")}


def stitched(out: str) -> dict:
    dirpath = os.path.join(out, "stitched")
    trainer, first = fit(dirpath, 1, 3, seed=1, save_top_k=-1)
    experts = door.attach(trainer.strategy.deepspeed_engine, k_persist=1).experts()
    trainer, resumed = fit(dirpath, 1, 4, seed=7, save_top_k=-1,
                           ckpt_path=os.path.join(dirpath, "epoch=2-step=6.ckpt"))
    report = door.last_load_report()
    source = {k: v["step"] for k, v in report.sources.items()}
    return {"bad": compare(resumed.start, first.at, experts, source, max(first.at)),
            "checked": len(resumed.start), "sources": source, "step": report.step,
            "plt": report.plt, "global_step": trainer.global_step, "saved": saved(dirpath)}


def exact(out: str) -> dict:
    dirpath = os.path.join(out, "exact")
    _, whole = fit(dirpath, 4, 2, seed=3, save_top_k=-1)
    _, resumed = fit(dirpath, 4, 2, seed=9, save_top_k=-1,
                     ckpt_path=os.path.join(dirpath, "epoch=0-step=2.ckpt"))
    return {"uninterrupted": whole.losses[2:], "resumed": resumed.losses,
            "sources": sorted({v["step"] for v in door.last_load_report().sources.values()})}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def rotate(out: str) -> dict:
    lines = _Lines()
    logging.getLogger("moepec").addHandler(lines)
    dirpath = os.path.join(out, "rotate")
    fit(dirpath, 1, 3, seed=5)  # save_top_k=1: ModelCheckpoint's default
    folders = saved(dirpath)
    said = [m for m in lines.lines if "written full" in m]
    fit(dirpath, 1, 3, seed=6, ckpt_path=os.path.join(dirpath, "epoch=2-step=6.ckpt"))
    report = door.last_load_report()
    return {"saved": folders, "said": said, "warnings": report.warnings,
            "steps": sorted({v["step"] for v in report.sources.values()})}


if __name__ == "__main__":
    out, phases = sys.argv[1], sys.argv[2].split(",")
    for phase in phases:
        res = globals()[phase](out)
        rank = torch.distributed.get_rank()
        with open(os.path.join(out, f"results_{phase}_{rank}.json"), "w") as f:
            json.dump(res, f)
