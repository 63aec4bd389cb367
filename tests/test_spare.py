"""The warm spare of a one-rank replica group (moepec.train.spare), in real processes: a
supervisor forks the training process, replaces it when it dies after joining, passes
on the exit code of a run that ends (or fails before joining), forwards SIGTERM, and
takes its child with it when it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork + prctl")

DEADLINE_S = 300
"""How long a test waits for a process to end: each takes well under a second idle, but a
busy 2-core machine once needed more than 30 s (docs/testing.md, "On a busy machine")."""

SCRIPT = """
import os, signal, sys, time
from moepec.train.spare import joined, run_with_spares
mode = sys.argv[1]
def fn():
    life = int(os.environ["MOEPEC_SPARE_LIFE"])
    print(f"life {life} pid {os.getpid()} ppid {os.getppid()}", flush=True)
    if mode == "before":
        return 2  # e.g. a setup error, before the child joined its group
    joined()
    if mode == "crash" and life < 2 or mode == "spent":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "error" and life == 0:
        raise SystemExit(3)
    if mode == "wait":
        time.sleep(60)
    return 0
sys.exit(run_with_spares(fn, 2))
"""


def _start(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _lives(out: str) -> list[tuple[int, int, int]]:
    return [tuple(int(w) for w in line.split()[1::2]) for line in out.splitlines()
            if line.startswith("life ")]


@pytest.mark.parametrize("mode, code, lives", [
    ("crash", 0, [0, 1, 2]),   # two SIGKILLs after joining: two spares, then the run ends
    ("error", 0, [0, 1]),      # an error after joining is a fault too
    ("before", 2, [0]),        # an error before joining ends the run: no retries
    ("spent", 128 + 9, [0, 1, 2]),  # spares spent: the supervisor exits for torchrun
])
def test_the_supervisor_replaces_a_joined_child_and_passes_on_the_end(mode, code, lives):
    proc = _start(mode)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == code, err
    seen = _lives(out)
    assert [life for life, _, _ in seen] == lives, out
    assert len({pid for _, pid, _ in seen}) == len(lives)  # a new process each life
    assert {ppid for _, _, ppid in seen} == {proc.pid}  # all forked by the supervisor


def _wait_for_child(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()
    assert line.startswith("life 0"), line
    return _lives(line)[0][1]


def _gone(pid: int, timeout: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True  # a zombie: dead, not yet reaped
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_reaches_the_child_and_a_killed_supervisor_takes_it_along():
    proc = _start("wait")
    child = _wait_for_child(proc)
    proc.send_signal(signal.SIGTERM)  # torchrun stopping its worker
    proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 128 + signal.SIGTERM and _gone(child)
    proc = _start("wait")
    child = _wait_for_child(proc)
    proc.kill()  # the whole worker lost: its child must not train on as an orphan
    proc.communicate(timeout=DEADLINE_S)
    assert _gone(child)


GROUP_SCRIPT = """
import os, signal, sys, time
from datetime import timedelta
import torch.distributed as dist
from moepec.train.spare import child_store_prefix, joined, run_with_spares
def fn():
    life, rank = int(os.environ["MOEPEC_SPARE_LIFE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    stale = int(store.check(["manager_addr"]))
    print(f"life {life} pid {os.getpid()} stale {stale} prefix {child_store_prefix()}",
          flush=True)
    joined()
    if life == 0:
        if rank == 0:
            store.set("manager_addr", "old")  # what torchft's Manager leaves behind
            store.set("ready", "1")
            time.sleep(60)  # its supervisor kills it when rank 1's child dies
        store.wait(["ready"])
        os.kill(os.getpid(), signal.SIGKILL)
    return 0
sys.exit(run_with_spares(fn, 2))
"""


def test_the_supervisors_of_a_group_restart_every_rank_as_a_new_generation():
    """Two ranks, no torchrun: rank 0's supervisor hosts the group's store (its keeper).
    Rank 1's child dies; rank 0's supervisor kills its own child, both meet, torchft's key
    of the old generation is gone, and each forks the next generation, whose process group
    joins under a prefix of its own."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-c", GROUP_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r), WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    lines = [[line.split() for line in out.splitlines() if line.startswith("life ")]
             for out, _ in outs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    for rank_lines in lines:
        assert [int(w[1]) for w in rank_lines] == [0, 1]  # one new child per generation
        assert int(rank_lines[1][5]) == 0  # torchft's key of the old generation is gone
        assert rank_lines[0][7] != rank_lines[1][7]  # a store prefix per generation
    assert [w[7] for w in lines[0]] == [w[7] for w in lines[1]]  # the same on every rank
    assert "a peer rank of its group failed" in outs[0][1]
