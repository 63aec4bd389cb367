"""`moepec demo` end to end on the tiny model: faults, recovery, report and plots."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moepec.cli import demo
from moepec.cli import main as cli
from moepec.cli.demo import DemoSettings, _train_cmd, run_demo


@pytest.mark.parametrize("faulty", [False, True])
@pytest.mark.parametrize("ranks", [1, 2])
def test_demo_runs_are_the_train_configs_its_workers_parse(tmp_path, faulty, ranks):
    s = DemoSettings()
    cmd = _train_cmd(s, tmp_path, faulty, ranks)
    argv = cmd[cmd.index("moepec") + 1:]  # what every worker's `moepec` parses
    parsed = cli.train_config_from_args(cli.build_parser().parse_args(argv))
    assert parsed == s.train_config(tmp_path, faulty=faulty, ranks=ranks)
    ckpt = parsed.checkpoint
    if faulty:
        assert (ckpt.path, ckpt.interval, ckpt.k_persist, ckpt.k_snapshot, ckpt.dynamic_k,
                ckpt.timeout_s) == (str(tmp_path / "ckpt"), 10, 1, 2, True, 60.0)
        assert parsed.faults == s.faults
    else:
        assert ckpt is None and parsed.faults is None
    assert (parsed.threads, parsed.dist_timeout_s) == (1 if ranks > 1 else 2, 60.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_end_to_end(tmp_path, monkeypatch):
    # The storage fault comes last: the persist kill armed at 33 acts in the persist of the
    # next checkpoint, which a busy machine may still be writing when training reaches step
    # 40; a storage fault there would fire in the life that is killed, and the restarted
    # life (which resumes before it, with the fault spent) would never see storage fail.
    # After it, the replica-group run (300 tiny steps: its kill comes 1 s into training)
    # and the planned stop (SIGTERM to torchrun after step 15 of 30, then the rerun).
    s = DemoSettings(config="tiny", steps=60, ckpt_interval=6, batch_size=8,
                     faults="sigkill@20:r1,kill_persist@33:r0,exception@44:r1,enospc@48",
                     ft_steps=300, stop_steps=30)
    lines = []
    report = run_demo(tmp_path, s, say=lines.append)
    _assert_costs_side_by_side(report, tmp_path)
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds == ["sigkill", "kill_persist", "exception", "enospc"]
    assert report["recoveries"] == 3 and report["persist_errors"] >= 1
    assert report["final_step"] == 59 and report["data_state"] == report["clean_data_state"]
    assert all(f["recovered_to"] < f["step"] for f in report["faults"] if f["recovered_to"])
    assert 0 < report["bytes_partial"] < report["bytes_full"]
    for name in ("loss.png", "plt.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    assert "automatic recoveries: 3" in text and "final validation loss" in text
    assert json.loads((tmp_path / "report.json").read_text())["recoveries"] == 3
    # the fault-free reference is cached: a second demo (other faults, same reference)
    # reuses it and goes straight to its faulty run, stopped here
    runs = []

    def train_run(settings, out, *, faulty, say):
        runs.append(faulty)
        raise _Stop

    monkeypatch.setattr(demo, "_train_run", train_run)
    lines.clear()
    with pytest.raises(_Stop):
        run_demo(tmp_path, dataclasses.replace(s, faults="sigkill@30:r0"), say=lines.append)
    assert runs == [True] and any("cached" in line for line in lines)


class _Stop(Exception):
    pass


def _assert_costs_side_by_side(report: dict, out) -> None:
    """One fault three ways: restart-all redoes steps and loses tokens; the replica groups'
    survivor and a planned stop lose neither, and the planned stop's checkpoint is
    complete (every expert: bigger than a PEC one)."""
    costs = report["cost_per_fault"]
    ra, ft, stop = costs["restart_all"], costs["replica_groups"], costs["planned_stop"]
    assert ra["what"] == "sigkill@20:r1" and ra["steps_redone"] > 0 and ra["plt"] > 0
    assert ra["lost_s"] > ra["downtime_s"] > 0
    assert (ft["steps_redone"], ft["plt"], ft["same_final_state"]) == (0, 0.0, True)
    assert 0 < ft["lost_s"] and ft["rejoin_s"] > 0
    assert (stop["steps_redone"], stop["plt"]) == (0, 0.0)
    assert 0 < stop["signal_to_commit_s"] <= stop["signal_to_exit_s"] < stop["lost_s"]
    assert stop["complete_bytes"] > report["bytes_partial"]
    text = (out / "report.md").read_text()
    assert "cost per fault" in text and "planned stop" in text and "replica groups" in text
    assert "cost_per_fault.png" in report["plots"]
    assert (out / "cost_per_fault.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_says_why_plt_ends_over_budget_and_only_then():
    """The demo faults every ~100 steps, so its PLT ends over the 3.75% budget; the report
    says so (with dynamic K's steps) rather than leave a reader to think the budget broke,
    and says nothing when the PLT is within it."""
    from moepec.cli.demo_report import PLT_BUDGET, _over_budget

    faults = [{"recovered_to": 109, "k_after": 2}, {"recovered_to": None},
              {"recovered_to": 189, "k_after": 4}, {"recovered_to": 329, "k_after": 8}]
    r = {"plt": 0.15, "faults": faults, "settings": {"steps": 400, "k_persist": 1}}
    why = _over_budget(r)
    assert "3 recoveries in 400 steps (one every ~133)" in why
    assert "K_persist 1 -> 2 -> 4 -> 8" in why and "moepec advise" in why
    assert _over_budget({**r, "plt": PLT_BUDGET}) == ""
    assert _over_budget({**r, "faults": [{"recovered_to": None}]}) == ""
    fixed_k = [{**f, "k_after": None} for f in faults]
    assert "dynamic K" not in _over_budget({**r, "faults": fixed_k})
