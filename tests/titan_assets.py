"""The test assets of tests/test_torchtitan.py, made in a fixture (no side effects on import,
unlike titan_shims), and the torchrun command of one training life (shared with
tests/titan_hunt.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

OVERRIDE = ["--module", "titan_shims", "--config", "deepseek_v3_tiny", "--override.imports",
            'moepec.integrations.torchtitan.use_pec={"k_persist": 1, "ram_dir": null, '
            '"dynamic_k": false}']
"""deepseek_v3's tiny config on torchtitan's stock registry, its checkpointer moepec's
(K=1, no RAM tier, fixed K)."""


def write_assets(folder: str) -> tuple[str, str]:
    """A small tokenizer (the ``tokenizers`` package; torchtitan's test tokenizer is not in
    its wheel) and a small text data set; returns (hf_assets_path, dataset_path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [f"w{i}" for i in range(300)]
    text = [" ".join(words[(i * 7 + j * 13) % 300] for j in range(60)) for i in range(64)]
    tok_dir, data_dir = os.path.join(folder, "tokenizer"), os.path.join(folder, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text, trainers.WordLevelTrainer(
        vocab_size=512, special_tokens=["<unk>", "<bos>", "<eos>"]))
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True,
                   "add_eos_token": True}, f)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for t in text:
            f.write(json.dumps({"text": t}) + "\n")
    return tok_dir, data_dir


def life_command(tmp: Path, assets: tuple[str, str], nproc: int, steps: int,
                 args: list[str], kill_at: int = 0) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one torchrun life of torchtitan's Trainer in ``tmp``
    (FSDP over ``nproc`` CPU ranks, an asynchronous checkpoint and a state dump into
    ``tmp/dump`` after every step, SIGKILLed at ``kill_at`` when set), ``args`` choosing
    the model and checkpointer (e.g. ``OVERRIDE``)."""
    tok, data = assets
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
           "TITAN_DUMP": str(tmp / "dump"), "TITAN_KILL_AT": str(kill_at),
           "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", str(TESTS / "titan_launch.py"),
           "--parallelism.spmd_backend", "partial_dtensor", "--hf_assets_path", tok,
           "--dataloader.dataset_path", data, "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--training.steps", str(steps),
           "--training.disable_cuda_graphs", "--dump_folder", str(tmp / "run"),
           "--checkpoint.enable", "--checkpoint.interval", "1",
           "--checkpoint.async_mode", "async", *args]
    return cmd, env
