"""Replica groups on torchft: a real Lighthouse, one real torchrun per group, real SIGKILLs.

The survivor keeps its process and never recovers; the restarted group heals from it
bit for bit (model, Adam moments, step, data position); a killed persist leaves its root
verifiable. Every group lost: the next start restores each group from its RAM snapshot in
shared memory and the striped checkpoints of both roots, and both end at the same step
with bit-identical weights.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's import: it logs every quorum
pytest.importorskip("torchft")

from moepec.integrations.torchft import start_lighthouse  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 300


@pytest.fixture
def lighthouse():
    lh = start_lighthouse(0, heartbeat_timeout_ms=1000, join_timeout_ms=500)
    yield lh.address
    lh.shutdown()


def _launch(tmp: Path, address: str, group: int, *, steps: int = STEPS, faults: str = "",
            restarts: int = 0, interval: int = 50, spares: int = 10,
            ram_dir: str = "none") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1", "--max-restarts", str(restarts), "--monitor-interval", "0.1",
           "-m", "moepec", "train", "--config", "tiny", "--steps", str(steps),
           "--batch-size", "8", "--threads", "1", "--no-progress", "--log-interval", "100",
           "--eval-batches", "0", "--data", str(tmp / "corpus" / "**" / "*.txt"),
           "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-interval", str(interval), "--ram-dir", ram_dir,
           "--out-dir", str(tmp / "out"), "--ft-lighthouse", address, "--ft-groups", "2",
           "--ft-group", str(group), "--ft-timeout", "5", "--ft-quorum-timeout", "20",
           "--ft-spares", str(spares)]
    if faults:
        cmd += ["--faults", faults]
    log = open(tmp / f"group{group}.log", "a")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)


def _wait(procs: list[subprocess.Popen], tmp: Path, timeout: float = 150) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = "\n".join((tmp / f"group{g}.log").read_text()[-3000:] for g in (0, 1))
        raise AssertionError(f"replica groups did not finish:\n{logs}") from None


def _records(tmp: Path, group: int) -> list[dict]:
    path = tmp / "out" / f"group-{group}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _events(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("event") == name]


@pytest.fixture
def corpus(tmp_path: Path, text_files: Path) -> Path:
    return tmp_path


def _verify(root: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "moepec", "verify", str(root)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _wait_for(predicate, timeout: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{what} did not happen")
        time.sleep(0.05)


def _safe_records(tmp: Path, group: int) -> list[dict]:
    path = tmp / "out" / f"group-{group}" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.endswith("}")]


def test_survivor_keeps_training_the_killed_group_heals_and_a_cold_start_restores(
        corpus, lighthouse):
    """Group 1's rank is SIGKILLed while its persist writes the checkpoint of step 49, and
    again at step 120 as the cross-group all-reduce starts (the survivor waits in it, so
    that step of the survivor does not commit and is retried). Each time its warm spare (a
    process forked by the same supervisor, torch and moepec already imported) rejoins and
    heals from the survivor, which keeps its process. Then every group is SIGKILLed whole:
    the next start restores each group from its RAM snapshot (shared memory) and both
    finish as one."""
    tmp = corpus
    ram = f"/dev/shm/moepec-test-ft-{os.getpid()}-{tmp.name}"  # outlives the killed workers
    try:
        _survive_heal_and_cold_start(tmp, lighthouse, ram)
    finally:
        shutil.rmtree(ram, ignore_errors=True)


def _survive_heal_and_cold_start(tmp: Path, lighthouse: str, ram: str) -> None:
    procs = [_launch(tmp, lighthouse, 0, ram_dir=ram),
             _launch(tmp, lighthouse, 1, faults="kill_persist@40:r0,kill_allreduce@120:r0",
                     ram_dir=ram)]
    _wait_for(lambda: len(_events(_safe_records(tmp, 1), "heal")) == 2, 120,
              "group 1's two heals", procs)
    # Both train together; once each committed a checkpoint after the heal, both die.
    def committed_after_heal() -> bool:
        heals = _events(_safe_records(tmp, 1), "heal")
        return bool(heals) and all(
            any(c["step"] > heals[-1]["step"] for c in _events(_safe_records(tmp, g), "commit"))
            for g in (0, 1))

    _wait_for(committed_after_heal, 120, "a checkpoint after the heal", procs)
    for g in (0, 1):  # each worker whole: the supervisor (its child dies with it)
        os.kill(_events(_safe_records(tmp, g), "ft_join")[-1]["ppid"], signal.SIGKILL)
    assert all(rc != 0 for rc in _wait(procs, tmp))
    survivor, healed = _records(tmp, 0), _records(tmp, 1)
    # The survivor: one process, never recovered.
    assert len(_events(survivor, "ft_join")) == 1
    assert not _events(survivor, "recovery") and not _events(healed, "recovery")
    assert 120 in [r["step"] for r in _events(survivor, "ft_retry")]  # the kill in all-reduce
    joins = _events(healed, "ft_join")
    assert len({j["pid"] for j in joins}) == 3
    # ... by its warm spares: new processes forked by the same supervisor, not new Pythons
    assert [j["spare"] for j in joins] == [0, 1, 2] and len({j["ppid"] for j in joins}) == 1
    # Each heal: the state received equals the state sent, bit for bit, at the same step.
    heals = _events(healed, "heal")
    sent = {r["step"]: r for r in _events(survivor, "heal_sent")}
    assert [h["step"] in sent for h in heals] == [True, True]
    assert 49 < heals[0]["step"] <= 120 <= heals[1]["step"]
    for heal in heals:
        for key in ("step", "model", "optimizer", "data"):
            assert heal[key] == sent[heal["step"]][key], key
    # The killed persist never half-committed: every committed checkpoint verifies.
    _verify(tmp / "ckpt" / "group-1")
    # Every group lost: each restores from its RAM snapshot in shared memory (its other
    # experts from the striped checkpoints of both roots), then both end as one.
    procs = [_launch(tmp, lighthouse, g, ram_dir=ram) for g in (0, 1)]
    assert _wait(procs, tmp) == [0, 0]
    for g in (0, 1):
        (rec,) = _events(_records(tmp, g), "recovery")
        assert rec["tier"] == "ram" and rec["step"] > heal["step"] and "plt" in rec
    (end0,), (end1,) = (_events(_records(tmp, g), "ft_end") for g in (0, 1))
    assert end0["step"] == end1["step"] == STEPS
    assert end0["model"] == end1["model"] and end0["optimizer"] == end1["optimizer"]
    assert end0["data"] == end1["data"]
    summary = json.loads((tmp / "out" / "group-0" / "summary.json").read_text())
    assert summary["final_step"] == STEPS - 1
    _assert_striped(tmp / "ckpt")
    # A healed group's lineage in its root is new: the next checkpoint saves every expert
    # (also when the heal happened between two checkpoints of the same quorum).
    commits = _events(healed, "commit")
    for h in heals:
        first = next(c for c in commits if c["step"] >= h["step"])
        assert first["full"], (h["step"], first)


def _assert_striped(ckpt: Path) -> None:
    """Every checkpoint both groups committed is striped: two disjoint parts, about even."""
    from moepec.store.committed import committed_manifests
    from moepec.store.storage import Storage

    parts = [{m.step: m for m in committed_manifests(Storage(str(ckpt / f"group-{g}")))
              .manifests.values()} for g in (0, 1)]
    both = sorted(set(parts[0]) & set(parts[1]))
    assert both
    for step in both:
        p0, p1 = parts[0][step], parts[1][step]
        assert p0.meta.part["count"] == p1.meta.part["count"] == 2
        assert {p0.meta.part["index"], p1.meta.part["index"]} == {0, 1}
        tensors = [{k for k in m.keys if not k.startswith("objects/")} for m in (p0, p1)]
        assert not tensors[0] & tensors[1]
        assert 0.25 < p0.bytes / (p0.bytes + p1.bytes) < 0.75, step


def test_a_hung_group_is_dropped_within_the_timeouts_and_heals_when_it_wakes(corpus, lighthouse):
    """Group 1's rank hangs (SIGSTOP: no heartbeats, no collectives). The survivor commits
    a step without it within the Lighthouse's heartbeat timeout plus ``--ft-timeout`` (the
    bound on the all-reduce it may be waiting in). Woken (SIGCONT), the hung group's
    step does not commit; it rejoins the next quorum behind the survivor and heals from
    it in the same process; both end at the same step with bit-identical state."""
    tmp = corpus
    # Long enough that the survivor still trains when the woken group, its all-reduce
    # timed out (--ft-timeout 5), comes back: with 500 steps an idle machine's survivor
    # had finished 2 s before, and the woken group, alone, trained on without a heal.
    # 1,200 leaves 2.5 times that margin; each step after the heal is CPU the suite pays.
    steps = 1200
    procs = [_launch(tmp, lighthouse, g, steps=steps) for g in (0, 1)]
    _wait_for(lambda: any(r.get("step", 0) >= 99 for r in _safe_records(tmp, 1)), 120,
              "group 1 training", procs)
    (hung,) = _events(_safe_records(tmp, 1), "ft_join")
    t_stop = time.time()
    os.kill(hung["pid"], signal.SIGSTOP)
    try:
        _wait_for(lambda: any(w["groups"] == 1 and w["time"] > t_stop
                              for w in _events(_safe_records(tmp, 0), "ft_width")),
                  30, "the survivor training alone", procs[:1])
        (alone,) = [w for w in _events(_safe_records(tmp, 0), "ft_width") if w["groups"] == 1]
    finally:
        os.kill(hung["pid"], signal.SIGCONT)
    print(f"hung peer: the survivor trained alone {alone['time'] - t_stop:.2f}s after SIGSTOP")
    assert alone["time"] - t_stop < 1.0 + 5.0 + 2.0  # heartbeat timeout + --ft-timeout + slack
    assert _wait(procs, tmp) == [0, 0]
    survivor, woken = _records(tmp, 0), _records(tmp, 1)
    assert len(_events(survivor, "ft_join")) == len(_events(woken, "ft_join")) == 1
    assert not _events(survivor, "recovery") and not _events(woken, "recovery")
    (heal,) = _events(woken, "heal")
    sent = {r["step"]: r for r in _events(survivor, "heal_sent")}
    assert heal["time"] > t_stop and heal["step"] in sent
    for key in ("step", "model", "optimizer", "data"):
        assert heal[key] == sent[heal["step"]][key], key
    (end0,), (end1,) = (_events(r, "ft_end") for r in (survivor, woken))
    assert end0["step"] == end1["step"] == steps
    assert end0["model"] == end1["model"] and end0["optimizer"] == end1["optimizer"]


def test_sigterm_stops_each_group_with_a_complete_checkpoint_and_no_restart(corpus, lighthouse):
    """Planned stops of replica groups. SIGTERM to group 1's launcher: the group writes a
    complete checkpoint (every expert) into its own root and leaves, its worker exits 0
    (neither a warm spare nor torchrun restarts it); group 0 trains on alone. SIGTERM to
    group 0's launcher then does the same. The same commands again: the cold start
    restores group 0's complete checkpoint with nothing lost and no step redone, group 1
    continues from the same state, and both end as one, bit for bit."""
    tmp = corpus
    procs = [_launch(tmp, lighthouse, g, steps=100_000, interval=20) for g in (0, 1)]
    _wait_for(lambda: all(_events(_safe_records(tmp, g), "commit") for g in (0, 1)), 120,
              "a checkpoint of both groups", procs)
    stops = []
    for g in (1, 0):
        os.kill(procs[g].pid, signal.SIGTERM)
        procs[g].wait(timeout=60)
        records = _records(tmp, g)
        (stop,) = _events(records, "stop")
        assert stop["signal"] == "SIGTERM" and stop["committed"], stop
        # complete, committed, and the group's last word: not restarted (a periodic
        # checkpoint of the same step may come right before it: the stop's is the last)
        commits = _events(records, "commit")
        (commit,) = [c for c in commits if c["checkpoint"] == stop["checkpoint"]]
        assert commit["full"] and commit["step"] == stop["step"] and commit == commits[-1]
        assert len(_events(records, "ft_join")) == 1 and "Restarting" not in \
            (tmp / f"group{g}.log").read_text()
        stops.append(stop)
        if g == 1:  # the other group trains on alone, past the stopped one
            def alone(after=stop["step"]) -> bool:
                records = _safe_records(tmp, 0)
                return any(w["groups"] == 1 for w in _events(records, "ft_width")) and any(
                    c["step"] > after for c in _events(records, "commit"))

            _wait_for(alone, 60, "group 0 training on alone", procs[:1])
    stop1, stop0 = stops
    assert stop0["step"] > stop1["step"]
    _verify(tmp / "ckpt" / "group-0")
    before = [len(_records(tmp, g)) for g in (0, 1)]
    steps = stop0["step"] + 11
    procs = [_launch(tmp, lighthouse, g, steps=steps, interval=20) for g in (0, 1)]
    assert _wait(procs, tmp) == [0, 0]
    again = [_records(tmp, g)[before[g]:] for g in (0, 1)]
    (rec,) = _events(again[0], "recovery")
    assert rec["step"] == stop0["step"] and rec["lost"] == 0 and rec["plt"] == 0.0, rec
    trained = [r["step"] for r in again[0] if "loss" in r and "event" not in r]
    assert min(trained) == stop0["step"] + 1  # nothing redone
    (end0,), (end1,) = (_events(r, "ft_end") for r in again)
    assert end0["step"] == end1["step"] == steps
    assert end0["model"] == end1["model"] and end0["optimizer"] == end1["optimizer"]
