"""Shared fixtures for the model, data, trainer and CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def text_files(tmp_path: Path) -> Path:
    """A directory of 200 small, distinct text files (a corpus for --data)."""
    root = tmp_path / "corpus"
    for i in range(200):
        sub = root / f"d{i % 7}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:03d}.txt").write_text(f"file {i:03d}: " + "lorem ipsum dolor " * 20 + "\n")
    return root
