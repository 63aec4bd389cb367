"""The process's random number generators: capture, check and restore their states.

The state is a dict keyed by generator kind, in the shapes :mod:`moepec.state.objects`
stores: ``"torch"`` (the CPU generator, a uint8 tensor), ``"python"`` (``random``'s
``(version, tuple of 625 ints, gauss)``), ``"numpy"`` (the legacy global
``np.random`` state ``("MT19937", uint32 array [624], pos, has_gauss, gauss)``) and,
when CUDA is initialised, ``"cuda"`` (a list of uint8 tensors, one per device). After
:func:`set_rng_state` every generator draws exactly what it drew after the capture.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from moepec.errors import CorruptCheckpointError

log = logging.getLogger(__name__)

KINDS = ("torch", "python", "numpy", "cuda")
"""Generator kinds a state may hold."""
_MT_WORDS = 624


def rng_state() -> dict[str, Any]:
    """Every generator's state now (training thread: they are process-global)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def check_rng_state(state: Any, key: str) -> dict[str, Any]:
    """``state`` if it is a decoded :func:`rng_state` of this build's shapes; raises
    CorruptCheckpointError naming ``key`` and the generator otherwise (nothing applied)."""
    if type(state) is not dict:
        raise _bad(key, "generators", "not a dict by generator kind")
    kinds = set(state)
    if not kinds <= set(KINDS) or not {"torch", "python", "numpy"} <= kinds:
        raise _bad(key, "generators", f"kinds {sorted(map(repr, kinds))[:8]}, expected "
                   f"torch, python, numpy and optionally cuda")
    _check_bytes(state["torch"], torch.get_rng_state().numel(), key, "torch")
    _check_python(state["python"], key)
    _check_numpy(state["numpy"], key)
    cuda = state.get("cuda", [])
    if type(cuda) is not list:
        raise _bad(key, "cuda", "not a list of device states")
    for s in cuda:
        _check_bytes(s, None, key, "cuda")
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore a state checked by :func:`check_rng_state` (training thread). CUDA states
    are skipped, with a warning, where CUDA is not available."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda", [])
    if not cuda:
        return
    if not torch.cuda.is_available():
        log.warning("the checkpoint holds CUDA RNG states but CUDA is not available; "
                    "CUDA random streams start afresh")
        return
    n = torch.cuda.device_count()
    if n != len(cuda):
        log.warning("the checkpoint holds %d CUDA RNG states for %d devices here; "
                    "restoring the first %d", len(cuda), n, min(n, len(cuda)))
    torch.cuda.set_rng_state_all(cuda[:n])


def _bad(key: str, kind: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint item {key!r}: the {kind} RNG state is malformed ({what}); the item is "
        f"damaged or was written by another build of torch/numpy")


def _check_bytes(t: Any, numel: int | None, key: str, kind: str) -> None:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        raise _bad(key, kind, "not a 1-d uint8 tensor")
    if numel is not None and t.numel() != numel:
        raise _bad(key, kind, f"{t.numel()} bytes, this torch uses {numel}")


def _words(x: Any, n: int) -> bool:
    return type(x) is tuple and len(x) == n and all(type(v) is int and 0 <= v < 2**32
                                                    for v in x)


def _check_python(s: Any, key: str) -> None:
    if not (type(s) is tuple and len(s) == 3 and type(s[0]) is int
            and _words(s[1], _MT_WORDS + 1) and s[1][-1] <= _MT_WORDS
            and (s[2] is None or type(s[2]) is float)):
        raise _bad(key, "python", "not (version, 625 ints, gauss)")


def _check_numpy(s: Any, key: str) -> None:
    if not (type(s) is tuple and len(s) == 5 and s[0] == "MT19937"
            and isinstance(s[1], np.ndarray) and s[1].dtype == np.uint32
            and s[1].shape == (_MT_WORDS,)
            and type(s[2]) is int and 0 <= s[2] <= _MT_WORDS
            and type(s[3]) is int and type(s[4]) is float):
        raise _bad(key, "numpy", "not ('MT19937', uint32[624], pos, has_gauss, gauss)")
