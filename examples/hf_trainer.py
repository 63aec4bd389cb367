"""Train a tiny random Mixtral with the Hugging Face Trainer and moepec's PEC checkpoints.

Kill it at any point and run the same command again: it resumes from the newest
checkpoint (model, optimizer, LR scheduler, RNG, the Trainer's step and data position)
and ends where an uninterrupted run ends.

    pip install 'moepec[hf]'
    python examples/hf_trainer.py --ckpt ckpt/hf --steps 40 --interval 4

``--record FILE`` writes what the run did as JSON (its final step, the batches this
process trained, the restore), for tests/test_hf.py's kill-and-resume test;
``--sleep`` slows each step so a test can kill it mid-run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from transformers import MixtralConfig, MixtralForCausalLM, TrainerCallback, TrainingArguments

import moepec
from moepec.integrations.hf import MoepecTrainer

VOCAB, SEQ, SAMPLES = 64, 8, 48


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences; token 0 of sample i is i (the data position)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.ids[:, 0] = torch.arange(SAMPLES)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True))


class Recorder(TrainerCallback):
    """Slows each step (``--sleep``) and notes the step count; the batches come from
    RecordingTrainer.compute_loss."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.sleep)
        return control


class RecordingTrainer(MoepecTrainer):
    """Notes the first token (the sample index) of every batch trained by this process."""

    batches: list[list[int]]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.batches.append(inputs["input_ids"][:, 0].tolist())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="moepec checkpoint root")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--record", default=None, metavar="FILE")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=4,
            learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=4, seed=0,
            save_strategy="no", report_to="none", logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = RecordingTrainer(
            model=tiny_mixtral(), args=args, train_dataset=TokenData(),
            callbacks=[Recorder(a.sleep)],
            moepec_config=moepec.CheckpointConfig(path=a.ckpt, interval=a.interval,
                                                  k_persist=1))
        trainer.batches = []
        trainer.train()
    cb = trainer.moepec
    result = {
        "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
        "lr": trainer.lr_scheduler.get_last_lr()[0],
        "batches": trainer.batches,
        "resumed_global_step": cb.resumed_global_step,
        "restored_step": cb.report.step if cb.report else None,
        "plt": cb.report.plt if cb.report else None,
        "routing_observed": sum(map(sum, cb.manager.ledger.cumulative)) if cb.manager else 0,
    }
    if a.record:
        with open(a.record, "w") as f:
            json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}))
    return result


if __name__ == "__main__":
    main()
