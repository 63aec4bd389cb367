"""Chaos: processes SIGKILLed for real at seeded points of forward, backward, snapshot,
persist, commit and retention. After every kill, resume succeeds from a committed
checkpoint, uncommitted data is never loaded, committed checkpoints are intact, and the
resumed state equals the state saved at that checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager, FaultHooks
from moepec.keys import parse_checkpoint_name, parse_key
from moepec.recovery.offline import verify_path
from moepec.store.storage import Storage
from tests.toy import Counter, full_state, make, train_step

PHASES = ("forward", "backward", "snapshot", "persist", "commit", "retention")
TOTAL_STEPS = 14
N_KILLS = 18
"""Three kill points per phase (the first 18 of the seeded sequence the test once ran 24
of: each point costs two lives of a process)."""


def _cfg(path: str) -> CheckpointConfig:
    # Storage alone: the kills test the commit rule and stitching over committed
    # checkpoints (the shared-memory tier's kills are in test_ram_torchrun).
    return CheckpointConfig(path=path, interval=2, k_persist=1, k_snapshot=2, keep_last=2,
                            timeout_s=30, ram_dir=None)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def child(path: str, hist: str, phase: str | None, kill_step: int, delay: float) -> None:
    """Train (resuming if possible); die at (phase, kill_step) when phase is given."""
    torch.set_num_threads(1)

    def persist_hook(where: str, name: str) -> None:
        parsed = parse_checkpoint_name(name)
        step = parsed.step if parsed else -1
        if step < kill_step:
            return
        if phase == "persist" and where == "write":
            threading.Timer(delay, _die).start()  # somewhere inside the DCP write
        elif phase == "commit" and where == "before_commit":
            _die()
        elif phase == "retention" and where == "retention":
            _die()

    def snapshot_hook(where: str, step: int) -> None:
        if phase == "snapshot" and step >= kill_step:
            _die()

    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    mgr = CheckpointManager(model, opt, _cfg(path),
                            extra_state={"sched": sched, "data": counter},
                            hooks=FaultHooks(on_persist=persist_hook, on_snapshot=snapshot_hook))
    report = mgr.restore()
    start = report.step + 1 if report else 0
    gen = torch.Generator().manual_seed(1000 + start)
    for step in range(start, TOTAL_STEPS):
        if phase == "forward" and step == kill_step:
            _die()
        _, counts = train_step(model, opt, sched, gen)
        if phase == "backward" and step == kill_step:
            _die()
        mgr.wait_for_snapshot()
        opt.step()
        sched.step()
        counter.position += 1
        mgr.observe_routing(counts)
        if mgr.step(step):
            tmp = Path(hist) / f".s{step}.tmp"
            torch.save({"state": full_state(model, opt), "position": counter.position}, tmp)
            os.replace(tmp, Path(hist) / f"s{step}.pt")
    mgr.close()


def run_child(*args) -> int:
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=child, args=args)
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        pytest.fail(f"child {args} hung")
    return p.exitcode


def check_resume_state(path: Path, hist: Path) -> int:
    """Restore in this process; compare with what the children saved. Returns base step."""
    st = Storage(str(path))
    manifests = {n: st.read_manifest(n) for n in st.committed()}
    model, opt, sched = make(7, "stacked", 4)
    counter = Counter()
    mgr = CheckpointManager(model, opt, _cfg(str(path)),
                            extra_state={"sched": sched, "data": counter})
    report = mgr.restore()
    mgr.close()  # lets go of the root's lease: the next child writes there
    if report is None:
        assert not manifests
        return -1
    assert report.checkpoint in manifests  # only committed data is ever loaded
    base = report.step
    saved = torch.load(hist / f"s{base}.pt")
    assert counter.position == saved["position"]
    got = full_state(model, opt)
    for key, value in got.items():
        pname = key.split("/", 1)[1]
        pname = pname.rsplit("/", 1)[0] if key.startswith("optim/") else pname
        if ".experts." not in pname or key.endswith("/step"):
            assert torch.equal(value, saved["state"][key]), key
            continue
        part = "optim" if key.startswith("optim/") else "model"
        layer = int(pname.split(".")[1])
        for e in range(4):
            src = report.sources[f"{layer}/{e}"]
            copy = src["step"]
            if part == "optim":  # weights and moments of an expert travel together
                copy = max(m.step for m in manifests.values() if m.step <= base and any(
                    parse_key(k).layer == layer and parse_key(k).expert == e
                    and parse_key(k).part == "optim" for k in m.keys if k.startswith("exp")))
            expect = torch.load(hist / f"s{copy}.pt")["state"][key][e]
            assert torch.equal(value[e], expect), (key, e, copy)
    mgr.close()
    return base


def kill_points() -> list[tuple[str, int, float]]:
    rng = random.Random(2024)
    points = []
    for i in range(N_KILLS):
        phase = PHASES[i % len(PHASES)]
        # checkpoints at odd steps; retention first deletes at the 4th checkpoint (step 7)
        low = 7 if phase == "retention" else 1
        points.append((phase, rng.randint(low, TOTAL_STEPS - 2), rng.uniform(0.0, 0.02)))
    return points


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_kills_everywhere(tmp_path):
    died = {p: 0 for p in PHASES}
    for i, (phase, step, delay) in enumerate(kill_points()):
        path, hist = tmp_path / f"c{i}", tmp_path / f"h{i}"
        hist.mkdir()
        # a first life that dies at the kill point...
        code = run_child(str(path), str(hist), phase, step, delay)
        assert code in (-signal.SIGKILL, 0), (phase, step, code)
        died[phase] += code == -signal.SIGKILL
        res = verify_path(str(path))
        # every committed item intact and every retained view restorable; a death before
        # the first commit leaves no checkpoint, which verify reports as not OK
        assert not res.bad and not res.damaged_manifests and not res.broken_views, \
            (phase, step, res.bad, res.damaged_manifests, res.broken_views)
        assert res.ok or res.views == 0, (phase, step)
        base = check_resume_state(path, hist)
        # ...and a second life that resumes and finishes
        assert run_child(str(path), str(hist), None, -1, 0.0) == 0, (phase, step)
        assert verify_path(str(path)).ok
        assert check_resume_state(path, hist) == TOTAL_STEPS - 1
        assert base <= TOTAL_STEPS - 1
    assert sum(died.values()) >= 15, died
    assert all(died[p] >= 2 for p in PHASES), died
