"""The test assets of tests/test_torchtitan.py, made in a fixture (no side effects on import,
unlike titan_shims)."""

from __future__ import annotations

import json
import os


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


