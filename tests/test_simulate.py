"""The planning tools: the PLT outlook, `moepec simulate`, `moepec advise`, `moepec bench gpu`."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from moepec.cli import main as cli
from moepec.plan.simulate import simulate, strategy
from moepec.plan.workload import (
    Cluster,
    Failures,
    ModelShape,
    Timing,
    meta_mtbf_hours,
    shape_from_hf,
)
from moepec.policy.plt import expected_plt_sequential
from moepec.policy.plt_forecast import plt_outlook, plt_per_fault

MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
           "tie_word_embeddings": False}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "num_attention_heads": 128,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
               "tie_word_embeddings": False}


def _write(tmp_path: Path, name: str, cfg: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _shape(n_experts: int = 8) -> ModelShape:
    return ModelShape(name="x", expert_params=8 * 10**9, non_expert_params=2 * 10**9,
                      n_moe_layers=4, n_experts=n_experts, top_k=1)


# --------------------------------------------------------------------------- outlook


@pytest.mark.parametrize("n,k,interval,steps", [(8, 1, 32, 200), (8, 3, 5, 97), (16, 4, 10, 1000),
                                                 (6, 6, 3, 50), (64, 1, 7, 3000)])
def test_outlook_equals_the_ledgers_expectation(n: int, k: int, interval: int, steps: int) -> None:
    assert plt_per_fault(n, k, interval, steps) == pytest.approx(
        expected_plt_sequential(n, k, interval, steps, 1), rel=1e-12, abs=1e-15)


def test_outlook_names_the_k_and_interval_that_fit() -> None:
    o = plt_outlook(8, 1, 32, 200, budget=0.0375)  # the README's old torchrun example
    assert o.over_budget and o.per_fault > 0.25
    assert plt_per_fault(8, o.k_fit, 32, 200) <= 0.0375 < plt_per_fault(8, o.k_fit - 1, 32, 200)
    assert plt_per_fault(8, 1, o.interval_fit, 200) <= 0.0375 \
        < plt_per_fault(8, 1, o.interval_fit + 1, 200)
    assert f"--k {o.k_fit}" in o.advice() and f"--ckpt-interval {o.interval_fit}" in o.advice()
    assert not plt_outlook(8, 2, 10, 100_000, faults=10).over_budget


def test_trainer_warns_at_start_when_over_budget(caplog: pytest.LogCaptureFixture,
                                                 tmp_path: Path) -> None:
    from moepec.manager.config import CheckpointConfig
    from moepec.train.config import TrainConfig
    from moepec.train.manager_setup import log_plt_outlook

    def outlook(dynamic_k: bool) -> list[logging.LogRecord]:
        cfg = TrainConfig(config="small", steps=200, checkpoint=CheckpointConfig(
            path=str(tmp_path), interval=32, dynamic_k=dynamic_k))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            log_plt_outlook(cfg, 8)
        return caplog.records

    # dynamic K off: a warning naming every fix, dynamic K among them
    [off] = outlook(False)
    assert off.levelno == logging.WARNING
    text = off.getMessage()
    assert "exceeds the PLT budget 3.75%" in text and "--k 6" in text
    assert "--ckpt-interval 2" in text and "--dynamic-k" in text
    # dynamic K on (the default): it answers the outlook, so information, and no advice
    # to turn on what is on
    [on] = outlook(True)
    assert on.levelno == logging.INFO
    text = on.getMessage()
    assert "exceeds the PLT budget 3.75%" in text and "dynamic K is on" in text
    assert "--k 6" in text and "--ckpt-interval 2" in text and "--dynamic-k" not in text


# ------------------------------------------------------------------------- simulator


def test_young_daly_optimum_within_5_percent() -> None:
    """PEC off, no restart time: the best simulated interval is sqrt(2 C M)."""
    shape, cost, mtbf = _shape(), 20.0, 10800.0
    per_gpu = shape.total_params * 12 / 8
    cluster = Cluster(gpus=8, d2h_bw=1e18, storage_bw_gpu=per_gpu / cost,
                      storage_bw_node=1e18, storage_bw_total=1e18, read_bw_gpu=1e18)
    timing = Timing(iteration_s=1.0, commit_s=0.0)
    failures = Failures(mtbf_s=mtbf, detect_s=0, restart_s=0)
    intervals = list(range(350, 1250, 75))
    ettr = [simulate(shape, cluster, strategy("full-sync", i), timing, failures,
                     days=2000 * mtbf / 86400).ettr for i in intervals]
    fit = np.polyfit(np.log(intervals), ettr, 4)
    grid = np.linspace(math.log(intervals[0]), math.log(intervals[-1]), 4000)
    best = math.exp(grid[np.argmax(np.polyval(fit, grid))])
    young = math.sqrt(2 * cost * mtbf)
    assert abs(best - young) / young < 0.05, (best, young)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_simulated_plt_equals_the_librarys_expectation(k: int) -> None:
    """Uniform routing, sequential selection, storage recoveries: the ledger's PLT under
    simulated faults matches expected_plt_sequential for that many faults."""
    shape = ModelShape(name="small", expert_params=8 * 10**6, non_expert_params=2 * 10**6,
                       n_moe_layers=4, n_experts=8, top_k=1)  # writes take milliseconds
    res = simulate(shape, Cluster(gpus=8), strategy("pec", 32, k),
                   Timing(iteration_s=0.1, commit_s=0.0),
                   Failures(mtbf_s=60, detect_s=0, restart_s=0), days=0.1, sim_layers=2)
    steps = round(res.productive_s / 0.1)
    want = expected_plt_sequential(8, k, 32, steps, res.failures)
    assert res.failures > 100 and res.plt > 0
    assert res.plt == pytest.approx(want, rel=0.05)
    assert res.plt_expected == pytest.approx(want, rel=1e-6)


def test_ettr_grows_with_mtbf_and_pec_writes_less() -> None:
    shape, cluster, timing = _shape(), Cluster(gpus=64), Timing(iteration_s=2.0)
    for name in ("full-sync", "full-async", "pec"):
        ettr = [simulate(shape, cluster, strategy(name, 50), timing,
                         Failures(mtbf_s=h * 3600), days=20, track_plt=False).ettr
                for h in (0.5, 1, 2, 4, 8)]
        assert ettr == sorted(ettr) and 0 < ettr[0] < ettr[-1] < 1, (name, ettr)
    full, pec = (simulate(shape, cluster, strategy(n, 50), timing, Failures(mtbf_s=7200),
                          days=3) for n in ("full-async", "pec"))
    assert pec.bytes_per_rank_per_day < 0.4 * full.bytes_per_rank_per_day


# ------------------------------------------------------- pec-ft: replica groups on torchft

def _ft_run(groups: int, failures: Failures, days: float, track_plt: bool = False,
            name: str = "pec-ft"):
    """pec-ft on a model whose checkpoints cost nothing: ETTR = 1 without faults."""
    shape = ModelShape(name="small", expert_params=8 * 10**6, non_expert_params=2 * 10**6,
                       n_moe_layers=4, n_experts=8, top_k=1)
    return simulate(shape, Cluster(gpus=8, d2h_bw=1e18), strategy(name, 32, 1, None, groups),
                    Timing(iteration_s=0.5, fixed_block_s=0.0, commit_s=0.0), failures,
                    days=days, sim_layers=1, track_plt=track_plt)


@pytest.mark.parametrize("groups", [2, 4])
def test_pec_ft_loses_the_pause_and_a_share_of_the_heal_per_fault(groups: int) -> None:
    """Faults far apart (never two groups down): nothing rolls back, PEC loses nothing,
    and each fault costs pause + (heal - pause) / G of the run's time (the survivors stand
    still for the pause, then train without the healing group until it rejoins)."""
    pause, heal = 1.0, 2.0
    res = _ft_run(groups, Failures(mtbf_s=3600, heal_s=heal, ft_pause_s=pause), days=1,
                  track_plt=True)
    assert res.failures > 20 and res.heals == res.failures and res.cold_starts == 0
    assert res.recomputed_steps == 0 and res.plt == 0 and res.restart_s == 0
    assert res.ft_pause_s == pytest.approx(res.failures * pause)
    assert res.reduced_width_s == pytest.approx(res.failures * (heal - pause) / groups)
    want = 1 - res.failures * (pause + (heal - pause) / groups) / res.wall_s
    assert res.ettr == pytest.approx(want, abs=1e-5)  # the last step's fraction


def test_pec_ft_with_one_group_is_pec() -> None:
    """G = 1: every fault is a cold start, handled exactly as pec handles it."""
    failures = Failures(mtbf_s=1800, detect_s=60, restart_s=240)
    ft, pec = (_ft_run(1, failures, days=1, track_plt=True, name=n) for n in ("pec-ft", "pec"))
    assert ft.heals == 0 and ft.cold_starts > 30 and ft.plt > 0
    for name in ("ettr", "plt", "recomputed_steps", "restart_s", "failures", "cold_starts"):
        assert getattr(ft, name) == getattr(pec, name), name


@pytest.mark.parametrize("heal_share", [0.2, 0.5])
def test_pec_ft_cold_starts_when_both_groups_are_down(heal_share: float) -> None:
    """G = 2, heals as long as a share of the MTBF: a heal ends in a cold start when the
    other group fails before it, after any number of faults of the healing group itself:
    q = (p / 2) / (1 - p / 2) with p = 1 - exp(-heal / MTBF)."""
    mtbf = 600.0
    res = _ft_run(2, Failures(mtbf_s=mtbf, detect_s=0, restart_s=0, heal_s=heal_share * mtbf),
                  days=5)
    p = 1 - math.exp(-heal_share)
    assert res.heals > 400 and res.recomputed_steps > 0
    assert res.cold_starts / res.heals == pytest.approx(p / (2 - p), rel=0.2)


@pytest.mark.parametrize("seed", range(12))
def test_replica_groups_lost_width_equals_its_integral(seed: int) -> None:
    """Faults close together in 4 groups (never all down): the job-seconds lost to
    reduced width equal the integral, on a 1 ms grid, of the share of groups healing
    at times outside every survivors' pause."""
    from moepec.plan.replicas import ReplicaGroups

    rng, groups, heal, pause = np.random.default_rng(seed), 4, 3.0, 1.0
    peers = ReplicaGroups(groups, heal, pause, seed)
    times = np.sort(rng.uniform(0, 6, 3))
    hits = [peers.fault(float(t)) for t in times]
    peers.close(20.0)
    grid = np.arange(0, 20, 1e-3)
    paused = np.zeros_like(grid, dtype=bool)
    down = np.zeros_like(grid)
    for g in range(groups):
        windows: list[list[float]] = []  # [fault, rejoin] per heal of group g
        for t, hit in zip(times, hits):
            if hit.group != g:
                continue
            assert hit.live == (not windows or t >= windows[-1][1]) and not hit.cold
            if hit.live:
                windows.append([t, t + heal])
                paused |= (grid >= t) & (grid < t + pause)
            else:  # healing still: its heal starts over
                windows[-1][1] = t + heal
        for start, end in windows:
            down += (grid >= start) & (grid < end)
    want = float(np.sum(down * ~paused)) * 1e-3 / groups
    assert peers.lost_width_s == pytest.approx(want, abs=0.01)


@pytest.mark.parametrize("live", [True, False])
def test_pec_ft_fault_aborts_the_checkpoint_being_written(live: bool) -> None:
    """A fault in a training group while a persist runs: that checkpoint never commits
    (its writers included the failed group) and the next write may start at once; a
    fault in a group that was already healing changes nothing."""
    from moepec.plan.simulate import SimRun

    shape = ModelShape(name="big", expert_params=8 * 10**11, non_expert_params=2 * 10**11,
                       n_moe_layers=4, n_experts=8, top_k=1)
    run = SimRun(shape, Cluster(gpus=8), strategy("pec-ft", 10, 1), Timing(iteration_s=1.0),
                 Failures(mtbf_s=3600), routing="uniform", sim_layers=1, budget=0.0375,
                 seed=0)
    run.step, run.t = 10, 10.0
    run.t += run.checkpoint()
    ck = run.ckpts[-1]
    assert ck.commit > run.t + 60  # the write takes minutes
    t0 = run.t
    t_fail = t0 + 30
    run.survive(t_fail, t_fail + 1, live=live)
    if live:
        assert run.ckpts == [] and run.persist_free == t_fail
        assert not any(run.copies[0])  # its experts' copies are forgotten too
    else:
        assert run.ckpts == [ck] and run.persist_free == ck.commit
        assert any(run.copies[0])
    assert run.t == t0 + 1 and run.stats["pause"] == 1  # mid-step: the progress is kept


def test_pec_ft_monotone_in_groups_heal_and_pause() -> None:
    """More groups: fewer cold starts and a smaller share missing while one heals; a
    longer heal or pause: less ETTR. Restart-all (G = 1) is worst while heals are short."""
    f = Failures(mtbf_s=3600, heal_s=600)
    by_groups = [_ft_run(g, f, days=20) for g in (1, 2, 4, 8)]
    assert [r.ettr for r in by_groups] == sorted(r.ettr for r in by_groups)
    colds = [r.cold_starts for r in by_groups]
    assert colds == sorted(colds, reverse=True) and colds[0] > colds[1] > 0 == colds[-1]
    by_heal = [_ft_run(2, Failures(mtbf_s=3600, heal_s=h), days=20).ettr
               for h in (2, 60, 600, 3000)]
    assert by_heal == sorted(by_heal, reverse=True) and by_heal[0] > by_groups[0].ettr
    by_pause = [_ft_run(2, Failures(mtbf_s=3600, ft_pause_s=p), days=20).ettr
                for p in (0.0, 1.1, 30.0)]
    assert by_pause == sorted(by_pause, reverse=True) and by_pause[0] > by_pause[-1]


def test_meta_curve_passes_through_its_points() -> None:
    assert meta_mtbf_hours(1024) == pytest.approx(7.9)
    assert meta_mtbf_hours(16384) == pytest.approx(1.8)


# ----------------------------------------------------------------- config.json shapes


def test_hf_config_parameter_counts(tmp_path: Path) -> None:
    mixtral = shape_from_hf(_write(tmp_path, "mixtral.json", MIXTRAL))
    assert mixtral.total_params == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.02)
    v3 = shape_from_hf(_write(tmp_path, "v3.json", DEEPSEEK_V3))
    assert v3.total_params == pytest.approx(671e9, rel=0.01)
    assert v3.active_params == pytest.approx(37e9, rel=0.03)
    assert (v3.n_moe_layers, v3.n_experts, v3.top_k) == (58, 256, 8)


def test_simulate_cli_on_a_named_config_and_config_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--config", "gpt-125m-8e", "--gpus", "8", "--days", "1",
                     "--strategies", "full-sync,pec", "--mtbf-hours", "2"]) == 0
    out = capsys.readouterr().out
    assert "full-sync" in out and "ETTR" in out
    path = _write(tmp_path, "mixtral.json", MIXTRAL)
    assert cli.main(["simulate", "--hf-config", path, "--json", "--days", "2",
                     "--strategies", "full-async,pec,pec-dynamic", "--k", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["plan"] for r in res["rows"]] == ["full-async", "pec", "pec-dynamic"]
    assert all(0 < r["ettr"] < 1 for r in res["rows"])
    out_dir = tmp_path / "sim"
    assert cli.main(["simulate", "--config", "small", "--gpus", "8", "--iteration-s", "0.5",
                     "--days", "0.5", "--strategies", "pec", "--out", str(out_dir)]) == 0
    assert {"simulate.json", "ettr_vs_mtbf.png", "ettr_vs_gpus.png", "plt_vs_k.png"} \
        <= {p.name for p in out_dir.iterdir()}


def test_advise_cli_fits_the_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "v3.json", DEEPSEEK_V3)
    assert cli.main(["advise", "--hf-config", path, "--gpus", "16384", "--json",
                     "--days", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["best"]["plt"] <= 0.0375 and res["best"]["ettr"] >= res["baseline"]["ettr"]
    assert len(res["explain"]) == 3 and res["runner_up"] is not None
    assert cli.main(["advise", "--config", "gpt-125m-8e", "--gpus", "8",
                     "--mtbf-hours", "4"]) == 0
    assert capsys.readouterr().out.count("\n") == 4


def test_pec_ft_in_simulate_and_advise(capsys: pytest.CaptureFixture[str]) -> None:
    """The flags reach the model: a long heal at 4 groups against 2; advise plans pec-ft
    for one cold start within budget and shows the best plan without replica groups."""
    rows = {}
    for groups in (2, 4):
        assert cli.main(["simulate", "--config", "gpt-125m-8e", "--gpus", "64", "--days", "2",
                         "--mtbf-hours", "1", "--strategies", "pec,pec-ft", "--json",
                         "--ft-groups", str(groups), "--heal-s", "600",
                         "--ft-pause-s", "5"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert (res["ft_groups"], res["heal_s"], res["ft_pause_s"]) == (groups, 600, 5)
        rows[groups] = {r["plan"]: r for r in res["rows"]}
    pec, ft2, ft4 = rows[2]["pec"], rows[2]["pec-ft"], rows[4]["pec-ft"]
    assert pec["cold_starts"] > 0 and pec["heals"] == 0 and rows[4]["pec"] == pec
    assert ft2["heals"] > 0 and ft2["ft_pause_s"] == pytest.approx(5 * ft2["heals"])
    assert ft4["cold_starts"] <= ft2["cold_starts"] < pec["cold_starts"]
    assert pec["ettr"] < ft2["ettr"] < ft4["ettr"]
    assert cli.main(["advise", "--config", "gpt-125m-8e", "--gpus", "8", "--mtbf-hours", "4",
                     "--strategy", "pec-ft", "--json", "--days", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    best, restart_all = res["best"], res["restart_all"]
    assert best["settings"]["plan"]["replica_groups"] == 2 and len(res["explain"]) == 4
    assert restart_all["settings"]["plan"]["replica_groups"] == 1
    assert restart_all["cold_starts"] > 0 and restart_all["plt"] <= 0.0375
    assert best["ettr"] > restart_all["ettr"] and best["ettr"] > res["baseline"]["ettr"]
    one = plt_per_fault(8, best["settings"]["plan"]["k_persist"],
                        best["settings"]["plan"]["interval"],
                        round(best["productive_s"] / best["settings"]["iteration_s"]))
    assert 0 < one <= 0.0375 and "one cold start" in res["explain"][0]


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--hf-config", "/nonexistent/config.json"], "cannot read config.json"),
    (["simulate"], "give the model as one of"),
    (["simulate", "--counts", "1,2,3"], "needs five numbers"),
    (["simulate", "--config", "tiny", "--k", "9"], "--k must be in 1..4"),
    (["simulate", "--config", "tiny", "--mtbf-hours", "-1"], "MTBF must be > 0"),
    (["advise", "--config", "tiny", "--budget", "2"], "budget"),
    (["simulate", "--config", "tiny", "--gpus", "0"], "gpus"),
    (["simulate", "--config", "tiny", "--calibration", "/nonexistent.json"], "calibration"),
    (["simulate", "--config", "tiny", "--gpus", "8", "--ft-groups", "3"], "--ft-groups"),
    (["simulate", "--config", "tiny", "--ft-groups", "0"], "--ft-groups"),
    (["advise", "--config", "tiny", "--strategy", "pec-ft", "--heal-s", "-1"], "--heal-s"),
])
def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                 needle: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moepec: error:") and needle in err and err.count("\n") == 1


def test_bench_gpu_without_cuda_prints_one_line(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA" in out
