"""Keeping the process quiet around moepec's own work: no garbage-collection pauses while
manifests are parsed (:func:`no_gc`), and no DCP warning nor DCP trace record at each of
our own one-process saves and loads (:func:`single_process_dcp`). Any thread.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import threading
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside: parsing manifests (and restoring from them) allocates
    many small containers, and in a training process (a large heap) the collections they
    trigger took 10x the parse itself (0.38 s against 0.035 s for 64 manifests,
    measured). What runs inside makes no reference cycles worth collecting early; the
    caller's setting is restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SINGLE_PROCESS = (r"torch\.distributed is .*assuming the intent is to (save|load) in a single "
                   r"process")
"""DCP's UserWarning for a one-process save or load (worded alike from torch 2.4 to 2.13)."""


class _OwnCalls(logging.Filter):
    """Drops the DEBUG and INFO records that DCP's method logger emits from the threads
    inside :func:`single_process_dcp`; keeps its errors, and every record of any other
    thread (a user's own ``dcp.save`` is traced as before)."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: collections.Counter[int] = collections.Counter()
        """Threads inside, each with its depth (a nested use keeps the outer one's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.thread not in self.threads


def _dcp_logger() -> logging.Logger | None:
    """DCP's method logger (``c10d-...-dcp_logger``): at DEBUG and propagating nowhere, so
    it prints nothing by default, but a capture of every logger (pytest's ``caplog``
    attaches to each non-propagating one) gets a start and an end record of each step of
    each ``dcp.save``/``dcp.load``: about 20 per save. None where torch has no such
    logger."""
    try:
        from torch.distributed.checkpoint import logger as dcp_logging
    except ImportError:
        return None
    found = getattr(dcp_logging, "_dcp_logger", None)
    return found if isinstance(found, logging.Logger) else None


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Around our own one-process ``dcp.save`` / ``dcp.load``: silences exactly DCP's
    "torch.distributed is disabled ..., assuming the intent is to save in a single process"
    UserWarning, which torch raises at every call even with ``no_dist=True`` (the argument
    that says one process is the intent), so there is no argument that avoids it.

    Not ``warnings.catch_warnings()``: that saves and restores the whole global filter list
    and ``showwarning``, so on the persist thread it could undo a filter or a warnings
    recorder the training thread set meanwhile. This adds one filter and removes that one
    filter again, once the last thread inside has left (warnings merges identical
    filters into one entry, so each thread removing "its" filter would unfilter the
    others); any thread may use it.

    Also drops DCP's DEBUG trace of the call (:class:`_OwnCalls`, in this thread only):
    the user's operation is the framework's save or load, which a stock backend does
    without any such record (Megatron's own ``torch_dist`` calls DCP's planner and writer
    directly), so a test that asserts an empty log capture around it holds for moepec
    too."""
    thread = threading.get_ident()
    with _quiet_lock:
        if _quiet_users[0] == 0:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
            if (dcp_log := _dcp_logger()) is not None:
                dcp_log.addFilter(_OWN_CALLS)
        _quiet_users[0] += 1
        _OWN_CALLS.threads[thread] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users[0] -= 1
            _OWN_CALLS.threads[thread] -= 1
            if _OWN_CALLS.threads[thread] <= 0:
                del _OWN_CALLS.threads[thread]
            if _quiet_users[0] == 0:
                if (dcp_log := _dcp_logger()) is not None:
                    dcp_log.removeFilter(_OWN_CALLS)
                for item in [f for f in warnings.filters if f[0] == "ignore"
                             and f[2] is UserWarning and f[1] is not None
                             and f[1].pattern == _SINGLE_PROCESS]:
                    with contextlib.suppress(ValueError):  # another thread reset the list
                        warnings.filters.remove(item)
                # As warnings.filterwarnings does after a change: registries re-check.
                getattr(warnings, "_filters_mutated", lambda: None)()


_quiet_lock = threading.Lock()
_quiet_users = [0]
"""Threads inside :func:`single_process_dcp` (the filter is process-wide, so is this)."""
_OWN_CALLS = _OwnCalls()
"""The one filter on DCP's logger while any thread is inside; it knows which threads."""
