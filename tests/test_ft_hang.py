"""A rank other than 0 hangs in a replica group of two ranks, with the default flags.

Two groups of two ranks (one torchrun each, warm spares on by default). Rank 1 of group 1
is SIGSTOPped once it trains: it stops beating, its group's rank 0 cuts the group after
``--ft-timeout`` (10 s by default; record ``ft_cut``), the survivor trains alone within that
plus a few seconds, keeps its processes and never recovers; the supervisors kill the
stopped rank and fork a new generation, which heals from the survivor bit for bit. No
timeout warning fires with the defaults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's import: it logs every quorum
pytest.importorskip("torchft")

from moepec.integrations.torchft import start_lighthouse  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork + prctl")]

ROOT = Path(__file__).resolve().parent.parent
FT_TIMEOUT_S = 10.0
"""moepec train's default --ft-timeout (checked below against the parser)."""


def _launch(tmp: Path, address: str, group: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--monitor-interval", "0.1", "-m", "moepec", "train", "--config", "tiny",
           "--steps", "100000", "--batch-size", "8", "--threads", "1", "--no-progress",
           "--log-interval", "10", "--eval-batches", "0",
           "--data", str(tmp / "corpus" / "**" / "*.txt"), "--ckpt-dir", str(tmp / "ckpt"),
           "--ckpt-interval", "100", "--ram-dir", "none", "--out-dir", str(tmp / "out"),
           "--ft-lighthouse", address, "--ft-groups", "2", "--ft-group", str(group)]
    log = open(tmp / f"group{group}.log", "a")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)


def _records(tmp: Path, group: int) -> list[dict]:
    path = tmp / "out" / f"group-{group}" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.endswith("}")]


def _events(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("event") == name]


def _wait_for(predicate, timeout: float, what: str, procs, tmp: Path):
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            logs = "\n".join((tmp / f"group{g}.log").read_text()[-3000:] for g in (0, 1))
            raise AssertionError(f"{what} did not happen within {timeout:.0f}s:\n{logs}")
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each torchrun: it stops its workers (each supervisor passes it on to its
    child; the store keeper dies with rank 0's), SIGKILLing what is left after 30 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)


def test_defaults_need_no_warning():
    from moepec.cli.main import build_parser

    args = build_parser().parse_args(["train", "--config", "tiny"])
    assert args.ft_timeout == FT_TIMEOUT_S
    from moepec.train.replicas import CUT_MARGIN_S

    assert args.ft_timeout + CUT_MARGIN_S < args.ft_quorum_timeout


def test_a_hung_rank_1_of_2_is_cut_and_its_group_heals(tmp_path, text_files):
    lighthouse = start_lighthouse(0, heartbeat_timeout_ms=1000, join_timeout_ms=500)
    procs = [_launch(tmp_path, lighthouse.address, g) for g in (0, 1)]
    try:
        _hang_rank_1(tmp_path, procs)
    finally:
        _stop(procs)
        lighthouse.shutdown()


def _hang_rank_1(tmp: Path, procs: list[subprocess.Popen]) -> None:
    _wait_for(lambda: any(r.get("step", 0) >= 9 for r in _records(tmp, 1)), 180,
              "group 1 training", procs, tmp)
    (join,) = _events(_records(tmp, 1), "ft_join")
    t_stop = time.time()
    os.kill(join["pids"][1], signal.SIGSTOP)  # a warm spare's supervisor SIGKILLs it later
    # The survivor's commit that ends the stall the hang caused (alone, or with the hung
    # group's new generation when that rejoined first); a step the stopped rank had
    # already voted for may still commit just after the SIGSTOP.
    stall = _wait_for(lambda: [w for w in _events(_records(tmp, 0), "ft_stall")
                               if w["time"] > t_stop and w["seconds"] > 2.0], 60,
                      "the survivor's next commit", procs, tmp)[0]
    heal = _wait_for(lambda: [h for h in _events(_records(tmp, 1), "heal")
                              if h["time"] > t_stop], 60, "the hung group's heal", procs, tmp)[0]
    _wait_for(lambda: [c for c in _events(_records(tmp, 1), "ft_first_commit")
                       if c["time"] > heal["time"]], 60, "the healed group training", procs, tmp)
    paused = stall["time"] - t_stop
    print(f"hung rank 1 of 2: the survivor committed again {paused:.2f}s after SIGSTOP, the "
          f"hung group healed {heal['time'] - t_stop:.2f}s after it")
    assert paused < FT_TIMEOUT_S + 5.0
    survivor, hung = _records(tmp, 0), _records(tmp, 1)
    (cut,) = _events(hung, "ft_cut")
    assert cut["rank"] == 1 and cut["silent_s"] >= FT_TIMEOUT_S
    # The survivor kept its processes and never recovered; the hung group came back as a
    # new generation of the same supervisors and healed from it, bit for bit.
    assert len(_events(survivor, "ft_join")) == 1 and not _events(survivor, "recovery")
    joins = _events(hung, "ft_join")
    assert [j["spare"] for j in joins] == [0, 1] and len({j["ppid"] for j in joins}) == 1
    sent = {r["step"]: r for r in _events(survivor, "heal_sent")}
    for key in ("step", "model", "optimizer", "data"):
        assert heal[key] == sent[heal["step"]][key], key
    logs = "".join((tmp / f"group{g}.log").read_text() for g in (0, 1))
    assert "--ft-quorum-timeout" not in logs  # no timeout warning with the defaults
