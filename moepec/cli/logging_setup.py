"""Logging configuration, applied once by the entry point (never at import).

Library modules only call ``logging.getLogger(__name__)``; this module decides where
records go. Records are written through ``tqdm.write`` so they do not tear the
progress bar. Ranks other than 0 log warnings and errors only, prefixed with their rank.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

__all__ = ["setup_logging"]

_HANDLER_MARK = "_moepec_handler"


class _TqdmHandler(logging.Handler):
    """A stderr handler that prints above an active tqdm bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # Look sys.stderr up at each call (not at construction) so redirections,
            # e.g. pytest's capture, are honoured.
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never crash the program
            self.handleError(record)


def setup_logging(level: str | int = "INFO", rank: int = 0) -> None:
    """Attach one handler to the ``moepec`` logger; later calls only update the level.

    Called by ``moepec.cli.main.main``; library code and tests should not call it.
    """
    logger = logging.getLogger("moepec")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    effective = level if rank == 0 else max(level, logging.WARNING)
    logger.setLevel(effective)
    if any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        return
    handler = _TqdmHandler()
    prefix = f"[rank {rank}] " if rank else ""
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S"))
    setattr(handler, _HANDLER_MARK, True)
    # Records still propagate: the root logger has no handler unless an application
    # (or pytest's caplog) adds one, so nothing is printed twice.
    logger.addHandler(handler)
