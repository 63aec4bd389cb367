"""Byte-level tokenizer, training corpus and a resumable, rank-sharded batch loader.

Corpus: by default the source text of the running Python's standard library: every
``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, recursively, skipping
``site-packages``/``dist-packages``, ``__pycache__`` and test directories, in sorted
relative-path order so the corpus is the same on every run and rank. ``data_glob`` uses
any text files instead. Files are split into train/val BY FILE with a stable hash
(CRC32) of the relative path, about ``val_fraction`` of them to val, so the split never
depends on Python's randomised ``hash()``. When that leaves val empty (a handful of
files) or the glob matches a single file, the concatenated bytes are split instead: the
last ``val_fraction`` goes to val. Files are concatenated, each followed by a
``SEPARATOR`` byte, into one contiguous uint8 array (``np.save``/``np.load(mmap_mode=
"r")`` friendly; :class:`TokenLoader` accepts memory-mapped arrays).
"""

from __future__ import annotations

import glob
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moepec.errors import ConfigError, DataError

__all__ = [
    "SEPARATOR",
    "ByteTokenizer",
    "Corpus",
    "TokenLoader",
    "check_vocab",
    "default_corpus_files",
    "eval_batches",
    "load_corpus",
]

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
# NUL never occurs in source text, so it marks file boundaries unambiguously.
SEPARATOR = 0
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                        "idle_test"})


class ByteTokenizer:
    """Token = byte of the UTF-8 encoding; vocabulary of 256."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> np.ndarray:
        """Text -> uint8 token array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens: np.ndarray | torch.Tensor | list[int]) -> str:
        """Token ids -> text (invalid UTF-8 sequences are replaced, never raised)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def check_vocab(vocab_size: int) -> None:
    """Raise ConfigError unless a model with ``vocab_size`` can embed every byte."""
    if vocab_size < VOCAB_SIZE:
        raise ConfigError(
            f"vocab mismatch: the byte tokenizer needs vocab_size >= {VOCAB_SIZE}, "
            f"the model has {vocab_size}; use a config with vocab_size >= {VOCAB_SIZE}"
        )


@dataclass(frozen=True, slots=True)
class Corpus:
    """A tokenised corpus split into train and val token arrays (uint8)."""

    train: np.ndarray
    """Training tokens."""
    val: np.ndarray
    """Validation tokens (may be shorter than one sequence; then no validation)."""
    n_files: int
    """Number of non-empty files read."""
    source: str
    """Human-readable description of where the text came from."""


def default_corpus_files() -> tuple[Path, list[Path]]:
    """(root, sorted files) of the default corpus: the stdlib's ``*.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subdirs, names in os.walk(root):  # pruned: rglob walked test/ (30x the CPU)
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        files += [p for p in (Path(folder, n) for n in names if n.endswith(".py"))
                  if p.is_file()]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # CRC32 is stable across processes and Python versions, unlike hash().
    return zlib.crc32(rel_path.encode("utf-8")) % 10_000 < val_fraction * 10_000


def _glob_files(pattern: str) -> tuple[Path, list[Path]]:
    matches = sorted(
        Path(p).resolve() for p in glob.glob(os.path.expanduser(pattern), recursive=True)
        if os.path.isfile(p)
    )
    if not matches:
        raise DataError(f"--data {pattern!r} matches no files; pass a glob of text files "
                        "(quote it so the shell does not expand it)")
    root = Path(os.path.commonpath([p.parent for p in matches]))
    return root, matches


def _concat(chunks: list[bytes]) -> np.ndarray:
    out = np.empty(sum(len(c) + 1 for c in chunks), dtype=np.uint8)
    pos = 0
    for chunk in chunks:
        out[pos:pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        out[pos + len(chunk)] = SEPARATOR
        pos += len(chunk) + 1
    return out


@lru_cache(maxsize=4)
def load_corpus(data_glob: str | None = None, val_fraction: float = 0.05) -> Corpus:
    """Read and split the corpus (cached per process; the arrays are read-only).

    Raises DataError when the glob matches no files or only empty ones.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if data_glob is None:
        root, files = default_corpus_files()
        source = f"Python standard library at {root}"
        if not files:
            raise DataError(f"no *.py files found under {root}; pass --data GLOB")
    else:
        root, files = _glob_files(data_glob)
        source = f"--data {data_glob}"
    train_chunks: list[bytes] = []
    val_chunks: list[bytes] = []
    for path in files:
        text = path.read_bytes()
        if not text:
            continue
        rel = path.relative_to(root).as_posix()
        (val_chunks if _is_val(rel, val_fraction) else train_chunks).append(text)
    n_files = len(train_chunks) + len(val_chunks)
    if n_files == 0:
        raise DataError(f"{source} matches only empty files; point --data at non-empty text files")
    if n_files == 1 or not val_chunks or not train_chunks:
        # Too few files for a file-level split: hold out the tail bytes instead.
        tokens = _concat(train_chunks + val_chunks)
        cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
        train, val = tokens[:cut], tokens[cut:]
    else:
        train, val = _concat(train_chunks), _concat(val_chunks)
    train.flags.writeable = False
    val.flags.writeable = False
    log.info("corpus: %s: %d files, %d train / %d val tokens",
             source, n_files, len(train), len(val))
    return Corpus(train=train, val=val, n_files=n_files, source=source)


def _n_windows(n_tokens: int, seq_len: int) -> int:
    # A window at start s needs tokens s .. s+seq_len (inputs plus the shifted target).
    return max(0, (n_tokens - 1) // seq_len)


def _window_batch(tokens: np.ndarray, starts: np.ndarray,
                  seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts])
    rows_t = torch.from_numpy(rows.astype(np.int64))
    return rows_t[:, :-1].contiguous(), rows_t[:, 1:].contiguous()


class TokenLoader:
    """Endless stream of (x, y) int64 batches [batch_size // world_size, seq_len].

    Windows are the non-overlapping ``seq_len``-token slices of ``tokens`` (y is x
    shifted by one). Each epoch visits them in a permutation drawn from
    ``np.random.default_rng((seed, epoch))`` (keyed by both, so seed 1/epoch 0 and
    seed 0/epoch 1 differ); global batch b of an epoch is permutation entries
    ``[b*batch_size, (b+1)*batch_size)``, the incomplete tail is skipped. Rank r takes
    sequences ``r::world_size`` of every global batch, so ranks see disjoint data and
    together exactly the global batch. The state (epoch, position, seed) is the same on
    every rank, small and JSON-able; ``load_state_dict`` continues the stream exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ConfigError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        if batch_size < world_size:
            raise ConfigError(
                f"batch_size {batch_size} is smaller than world_size {world_size}; "
                "use a global batch of at least one sequence per rank"
            )
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"corpus has {len(tokens)} tokens, fewer than one sequence of seq_len+1="
                f"{seq_len + 1}; use more data or a shorter seq_len"
            )
        n = _n_windows(len(tokens), seq_len)
        if n < batch_size:
            raise DataError(
                f"corpus has only {n} windows of {seq_len} tokens, fewer than batch_size="
                f"{batch_size}; use more data or a smaller --batch-size"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.n_windows = n
        self.batches_per_epoch = n // batch_size
        self.epoch = 0
        self.position = 0  # index of the next global batch within the epoch
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng((self.seed, self.epoch))
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch; advances the state."""
        b = self.position
        window_ids = self._permutation()[b * self.batch_size:(b + 1) * self.batch_size]
        mine = window_ids[self.rank::self.world_size]
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return _window_batch(self.tokens, mine * self.seq_len, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "position", "seed"}: where the stream stands (same on all ranks)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by :meth:`state_dict` (adopts the saved seed)."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise DataError(f"loader state lacks {sorted(missing)}; pass a TokenLoader.state_dict()")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise DataError(
                f"loader state epoch={epoch} position={position} does not fit this corpus "
                f"({self.batches_per_epoch} batches per epoch); resume with the same data, "
                "seq_len and batch_size"
            )
        self.epoch, self.position, self.seed = epoch, position, int(state["seed"])
        self._perm_epoch = -1


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int,
                 rank: int = 0, world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: up to ``n_batches`` global batches of evenly spread windows.

    Deterministic (no RNG), so every evaluation of a run scores the same text. Rank r
    gets sequences ``r::world_size`` of each batch; a batch where this rank has no
    sequence is omitted. Returns [] when ``tokens`` is shorter than one window.
    """
    n = _n_windows(len(tokens), seq_len)
    want = min(n, n_batches * batch_size)
    if want == 0:
        return []
    window_ids = np.linspace(0, n - 1, want).round().astype(np.int64)
    out = []
    for b in range(0, want, batch_size):
        mine = window_ids[b:b + batch_size][rank::world_size]
        if len(mine):
            out.append(_window_batch(tokens, mine * seq_len, seq_len))
    return out
