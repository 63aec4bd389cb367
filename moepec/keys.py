"""The names moepec gives things: state keys and checkpoint folders. Pure.

State keys (one per item of a checkpoint; the key says what it is and whether it
belongs to an expert):

- ``model/<name>``: a non-expert parameter or persistent buffer;
- ``optim/<param name>/<state>``: optimizer state of a non-expert parameter, and
  the non-sliceable state (Adam's ``step``) of every parameter;
- ``experts/<layer>/<expert>/model/<param name>``: one expert's slice of a weight;
- ``experts/<layer>/<expert>/optim/<param name>/<state>``: its optimizer state;
- ``objects/<name>``: small Python objects (RNG states, optimizer hyper-parameters,
  every ``extra_state`` entry's ``state_dict()``), stored as uint8 tensors.

A tensor key may name one *chunk* of a sharded tensor (a DTensor's local shard):
``<key>#<offsets>+<shape>:<global shape>``, e.g. ``model/lin.weight#4,0+3,5:7,5`` is the
[3, 5] chunk at offset (4, 0) of the [7, 5] tensor ``model/lin.weight``.
For an expert key the global shape is one expert's slice. A key without ``#`` is the
whole tensor; the chunks of one key saved together never overlap.

Checkpoint folders are named ``ckpt-<seq>-step<step>-<run>`` (``checkpoint_name``): the
sequence number orders them, the step is the training step they hold, and the run id of
the run that wrote them makes the name unique to that run. Two runs on one root (a
takeover while the old run still lives) may reach the same sequence number, but never
the same folder: neither can write into, or delete, a folder the other's manifest names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

EXPERT_PREFIX = "experts/"
OBJECT_PREFIX = "objects/"
MANIFEST_NAME = "moepec.json"
"""The manifest file inside a checkpoint folder: written last, its presence is the commit."""

_RUN_ID = r"[0-9a-z]{1,32}"
RUN_ID_RE = re.compile(_RUN_ID)
"""A run id (``RootClaim`` draws 12 hex digits): it names folders and heartbeat files."""
_NAME_RE = re.compile(rf"^ckpt-(\d{{6,}})-step(\d{{8,}})-({_RUN_ID})$")
_LEGACY_NAME_RE = re.compile(r"^ckpt-\d{6,}-step\d{8,}$")
"""A folder name of a pre-release moepec (no run id): not readable by this version."""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What a key names: its expert (if any) and whether it is a weight or optimizer state."""

    key: str
    layer: int | None
    expert: int | None
    part: str  # "model" | "optim" | "objects"

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


@functools.lru_cache(maxsize=1 << 16)
def parse_key(key: str) -> KeyInfo:
    """Inverse of the key naming above (cached: a restore parses the same keys of many
    manifests; KeyInfo is immutable)."""
    if key.startswith(EXPERT_PREFIX):
        _, layer, expert, part, _ = key.split("/", 4)
        return KeyInfo(key=key, layer=int(layer), expert=int(expert), part=part)
    return KeyInfo(key=key, layer=None, expert=None, part=key.split("/", 1)[0])


_KEY_RE = re.compile(r"^(?:(?:model|optim|objects)/|experts/\d{1,6}/\d{1,6}/(?:model|optim)/)"
                     r"[^\x00]+$")
"""The grammar above as one expression (checked for every key of every manifest)."""


@functools.lru_cache(maxsize=1 << 16)
def is_state_key(key: str) -> bool:
    """Whether ``key`` follows the state-key grammar (cached: the manifests of a root
    repeat the same keys)."""
    return bool(_KEY_RE.match(key))


def expert_key(layer: int, expert: int, part: str, rest: str) -> str:
    """The key of expert ``expert`` of MoE layer ``layer`` (global ids); ``part`` is
    ``model`` or ``optim``, ``rest`` the canonical parameter name (and state name)."""
    return f"{EXPERT_PREFIX}{layer}/{expert}/{part}/{rest}"


CHUNK_MARK = "#"
_DIMS = r"(\d{1,15}(?:,\d{1,15}){0,7})"
_CHUNK_RE = re.compile(rf"^{_DIMS}\+{_DIMS}:{_DIMS}$")


def chunk_key(base: str, offsets: Sequence[int], shape: Sequence[int],
              global_shape: Sequence[int]) -> str:
    """The key of the ``shape`` chunk at ``offsets`` of the ``global_shape`` tensor ``base``;
    ``base`` itself when the chunk is the whole tensor."""
    if not any(offsets) and list(shape) == list(global_shape):
        return base
    return (f"{base}{CHUNK_MARK}{','.join(map(str, offsets))}+{','.join(map(str, shape))}:"
            f"{','.join(map(str, global_shape))}")


Chunk = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""(offsets, shape, global shape) of a chunk key."""


def split_chunk(key: str) -> tuple[str, Chunk | None]:
    """(base key, (offsets, shape, global shape)) of a key; None for a whole-tensor key.
    Raises ValueError for a malformed chunk suffix or a chunk outside its tensor."""
    base, mark, suffix = key.partition(CHUNK_MARK)
    if not mark:
        return key, None
    m = _CHUNK_RE.match(suffix)
    if m is None:
        raise ValueError(f"{key[:120]!r}: a chunk suffix is #<offsets>+<shape>:<global shape>")
    offsets, shape, glob = (tuple(int(x) for x in m[i].split(",")) for i in (1, 2, 3))
    if not len(offsets) == len(shape) == len(glob) or any(
            o + n > g for o, n, g in zip(offsets, shape, glob)):
        raise ValueError(f"{key[:120]!r}: the chunk is not a block of its global shape")
    return base, (offsets, shape, glob)


class CheckpointName(NamedTuple):
    """What a checkpoint folder name says; ordered by (seq, step, run)."""

    seq: int
    step: int
    run: str


def checkpoint_name(seq: int, step: int, run: str) -> str:
    """The folder name of checkpoint number ``seq`` of run ``run``, holding training step
    ``step``."""
    assert RUN_ID_RE.fullmatch(run), run
    return f"ckpt-{seq:06d}-step{step:08d}-{run}"


@functools.lru_cache(maxsize=1 << 16)
def parse_checkpoint_name(name: str) -> CheckpointName | None:
    """(seq, step, run) of a checkpoint folder name, or None for any other name. Cached
    (an immutable result): a restore of E checkpoints checks every manifest's ancestors
    and view sources, E names each."""
    m = _NAME_RE.match(name)
    return CheckpointName(int(m[1]), int(m[2]), m[3]) if m else None


def is_legacy_name(name: str) -> bool:
    """A checkpoint folder name of a pre-release moepec (``ckpt-<seq>-step<step>``)."""
    return _LEGACY_NAME_RE.match(name) is not None


def seq_of(name: str) -> int:
    """The sequence number of a valid checkpoint name."""
    parsed = parse_checkpoint_name(name)
    assert parsed is not None, name
    return parsed.seq


def next_seq(names: Iterable[str]) -> int:
    """The sequence number after every checkpoint name's in ``names`` (other names are
    ignored; 0 when there is none)."""
    seqs = [p.seq for p in map(parse_checkpoint_name, names) if p is not None]
    return max(seqs, default=-1) + 1


def newest(names: Iterable[str]) -> str | None:
    """The valid checkpoint name with the highest sequence number (ties: name_order), or
    None."""
    names = list(names)
    return max(names, key=name_order) if names else None


def name_order(name: str) -> CheckpointName:
    """Sort key of a valid checkpoint name: oldest first, ties between runs broken by run
    id so that every rank and every tool orders one root the same way."""
    parsed = parse_checkpoint_name(name)
    assert parsed is not None, name
    return parsed
