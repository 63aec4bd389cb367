"""Page-locking host memory for CUDA that torch did not allocate: the mappings of the
shared-memory slots (:mod:`moepec.ram.shm`), so that a snapshot's device-to-host copies
run at the pinned rate into memory that outlives the process. Through torch's own helper,
the one DCP's shared-memory staging uses (cudaHostRegister, portable)."""

from __future__ import annotations


def register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` (CUDA available). Raises RuntimeError when
    CUDA refuses (a memlock limit, an earlier CUDA error)."""
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(address, nbytes)


def unregister(address: int) -> None:
    """Undo :func:`register` (cudaHostUnregister). Raises AssertionError (torch's helper)
    when CUDA refuses."""
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(address)
