"""moepec: Partial Experts Checkpointing for Mixture-of-Experts training in PyTorch."""

from moepec.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    MoepecError,
    NoCheckpointError,
    PersistError,
    StructureMismatchError,
)
from moepec.events import CheckpointEvent, CommitRecord, SnapshotRecord, StopRecord
from moepec.hooks import FaultHooks
from moepec.manager.config import CheckpointConfig
from moepec.policy.plt import PLTLedger
from moepec.policy.selection_policy import (
    SelectionContext,
    SelectionPolicy,
    register_selection,
    selection_names,
    unregister_selection,
)
from moepec.state.experts import ExpertSpec

__version__ = "0.1.0"

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointError",
    "CheckpointEvent",
    "CommitRecord",
    "ConfigError",
    "CorruptCheckpointError",
    "ExpertSpec",
    "FaultHooks",
    "MoepecError",
    "NoCheckpointError",
    "PLTLedger",
    "Part",
    "PersistError",
    "RestoreReport",
    "SelectionContext",
    "SelectionPolicy",
    "SnapshotRecord",
    "StopRecord",
    "StructureMismatchError",
    "__version__",
    "register_selection",
    "selection_names",
    "unregister_selection",
]


def __getattr__(name: str):
    # Lazy: importing moepec stays cheap and side-effect free; the manager pulls in
    # torch.distributed.checkpoint.
    if name == "CheckpointManager":
        from moepec.manager.manager import CheckpointManager
        return CheckpointManager
    if name == "Part":  # CheckpointManager.share()'s argument (replica groups)
        from moepec.store.meta import Part
        return Part
    if name == "RestoreReport":
        from moepec.recovery.outcome import RestoreReport
        return RestoreReport
    raise AttributeError(f"module 'moepec' has no attribute {name!r}")
