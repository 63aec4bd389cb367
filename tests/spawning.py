"""Rank processes for the tests (torch.multiprocessing), forked from one fork server per
test session that imported torch, torch._dynamo (an optimizer's constructor imports it),
DCP, FSDP and moepec once: a rank costs its work, not 3-5 s of imports. Each rank is still
its own process with its own process group; what a fork server does not give a rank is
the test's environment at the time of the call, only the one of the server's start (the
first call): set a rank's variables inside it."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "moepec", "tests.toy", "tests.dist_worker"]


def start_processes(fn: Callable[..., Any], args: Sequence[Any], nprocs: int,
                    join: bool = True):
    """``torch.multiprocessing.start_processes`` over the session's fork server."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=join,
                              start_method="forkserver")
