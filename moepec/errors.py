"""The one error hierarchy of moepec.

User mistakes raise subclasses of :class:`MoepecError` whose message names the fix.
``assert`` is kept for internal invariants only.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar


class MoepecError(Exception):
    """Base class of every error moepec raises on purpose."""


class ConfigError(MoepecError, ValueError):
    """A configuration value is invalid; the message says which value and how to fix it."""


class DataError(MoepecError):
    """The training corpus cannot be used (missing, empty, too small)."""


class ExpertDiscoveryError(MoepecError):
    """Experts of a model could not be found unambiguously; pass an explicit ExpertSpec."""


class StructureMismatchError(MoepecError):
    """A checkpoint was saved from a model with a different structure than the one restoring."""


class CheckpointError(MoepecError):
    """A checkpoint could not be written, read or verified."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match the checksum recorded in the manifest."""


class ManifestError(CheckpointError):
    """A committed manifest cannot be used: not JSON, a missing or mistyped field."""


class ManifestFormatError(ManifestError):
    """A manifest written in a format this moepec cannot read (a newer moepec wrote it)."""


class NoCheckpointError(CheckpointError):
    """No committed checkpoint can supply a key that recovery needs."""


class LeaseError(CheckpointError):
    """Another live run holds the checkpoint root (one writer per root)."""


class FencedError(LeaseError):
    """Another run took over the checkpoint root: this run never writes, renames or
    deletes anything there again (it may train on and keep RAM snapshots)."""


class PersistError(CheckpointError):
    """A background persist failed; raised in the training thread at its next call."""


class DistributedError(MoepecError):
    """Ranks disagree, or a collective failed or timed out."""


Choice = TypeVar("Choice", bound=StrEnum)


def check_choice(kind: type[Choice], value: object, name: str,
                 error: type[MoepecError] = ConfigError) -> Choice:
    """``value`` as a member of ``kind``; ``error`` naming the valid choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise error(f"unknown {name} {value!r}; choose one of "
                    f"{', '.join(m.value for m in kind)}") from None
