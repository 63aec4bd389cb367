"""The results report: every benchmark in one run, written to docs/results.md.

Sections (each a baseline and the method measured in the same run, reported as ratios):
1. checkpoint size vs K (:mod:`moepec.bench.size`), beside the paper's 54.2% / 57.7%;
2. per-rank checkpoint work (:mod:`moepec.bench.sharding`), beside the paper's 76.9%;
3. blocking time and iteration overhead (:mod:`moepec.bench.overhead`, Figure 12 analogue);
4. model quality under faults: the same fault schedule and seed for fault-free training,
   full-checkpoint recovery, PEC K=1 / K=2 sequential, PEC K=1 load-aware and dynamic K;
5. PLT vs (K, checkpoint interval) (Figure 5 analogue): the analytic expectation
   (:func:`moepec.policy.plt.expected_plt_sequential`), a PLTLedger simulation and real runs;
6. the machine, versions and the command.

Writes OUT/results.md, OUT/results.json (every raw number) and OUT/img/*.png. Seeds are
fixed; on 2 CPU cores the default settings take ~25-40 minutes, ``--quick`` ~1.

Run: moepec bench report [--quick] [--out docs]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from moepec.bench.plots import plots
from moepec.bench.render import PAPER, QUALITY_TOLERANCE, headline, markdown

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Settings:
    """How big each section's runs are (``FULL`` by default, ``QUICK`` for tests)."""

    size_argv: tuple[str, ...]
    """Arguments of moepec.bench.size (the scaled-down measured models)."""
    sharding_measured: tuple[tuple[str, int, int, int], ...]
    """(model, DP ranks, EP size, K) cases measured on real gloo ranks."""
    overhead_argv: tuple[str, ...]
    """Arguments of moepec.bench.overhead."""
    model: str
    """Model trained in sections 4 and 5 (8 experts)."""
    model_overrides: tuple[tuple[str, Any], ...]
    """GPTMoEConfig overrides of ``model``."""
    steps: int
    """Training steps of every quality run (and of the PLT scenario)."""
    interval: int
    """Checkpoint interval of the quality runs."""
    fault_every: int
    """A fault (an exception in the step, recovered in-process) every this many steps."""
    eval_interval: int
    """Steps between validation losses of the quality runs."""
    eval_batches: int
    """Batches of the fixed validation set."""
    plt_ks: tuple[int, ...]
    """K values of the PLT grid."""
    plt_intervals: tuple[int, ...]
    """Checkpoint intervals (steps) of the PLT grid."""
    plt_trials: int
    """Random fault schedules per cell of the PLTLedger simulation."""
    plt_real: tuple[tuple[int, int], ...]
    """(K, interval) cells also measured with real training runs of ``plt_model``."""
    plt_model: str
    """Model of those runs (with 8 experts, like ``model``; small enough to be quick)."""
    threads: int = 2
    """torch threads of the training runs."""


FULL = Settings(
    size_argv=("--scale", "4", "8"),
    sharding_measured=(("small", 2, 1, 1), ("small", 4, 2, 1)),
    overhead_argv=("--steps", "100", "--interval", "10"),
    model="small", model_overrides=(), steps=1000, interval=10, fault_every=200,
    eval_interval=50, eval_batches=8,
    plt_ks=(1, 2, 4, 8), plt_intervals=(5, 10, 20, 50, 100), plt_trials=200,
    plt_real=((1, 5), (2, 5), (1, 20), (4, 20), (1, 50), (2, 100)), plt_model="tiny")
QUICK = Settings(
    size_argv=("--scale", "32", "64", "--scopes", "all", "--ks", "1", "2"),
    sharding_measured=(),  # the full report measures; the quick one (tests) computes
    overhead_argv=("--config", "tiny", "--steps", "12", "--warmup", "2", "--interval", "4",
                   "--bw-config", "tiny", "--bw-scale", "1", "--bw-saves", "2"),
    model="tiny", model_overrides=(("n_experts", 8),), steps=20, interval=4, fault_every=7,
    eval_interval=10, eval_batches=2,
    plt_ks=(1, 2, 8), plt_intervals=(4, 8), plt_trials=10,
    plt_real=((2, 8),), plt_model="tiny")


# -- sections: run ---------------------------------------------------------------------
def _bench(module, argv: list[str]) -> dict:
    """Run a benchmark's main() with this run's thread count restored afterwards."""
    threads = torch.get_num_threads()
    try:
        return module.main(argv)
    finally:
        torch.set_num_threads(threads)


def run_size(s: Settings, tmp: Path) -> dict:
    from moepec.bench import size

    return _bench(size, [*s.size_argv, "--out", str(tmp / "size.json")])


def run_sharding(s: Settings) -> dict:
    from moepec.bench import sharding

    # The cases of moepec.bench.sharding, built here so the measured set can be chosen.
    rows = [sharding.computed_case(*case) for case in sharding.CASES]
    rows += [sharding.measured_case(*case) for case in s.sharding_measured]
    return {"rows": rows, "paper_reduction": PAPER["per_rank"]}


def run_overhead(s: Settings, tmp: Path) -> dict:
    from moepec.bench import overhead

    return _bench(overhead, [*s.overhead_argv, "--out", str(tmp / "overhead.json")])


def fault_steps(s: Settings) -> list[int]:
    return list(range(s.fault_every, s.steps, s.fault_every))


QUALITY_RUNS = (  # name, CheckpointConfig fields (None: no checkpoints, no faults)
    ("fault-free", None),
    ("full recovery (K=8)", {"k_persist": 8}),
    ("PEC K=1 sequential", {"k_persist": 1}),
    ("PEC K=2 sequential", {"k_persist": 2}),
    ("PEC K=1 load-aware", {"k_persist": 1, "selection": "load_aware"}),
    ("PEC dynamic K (from 1)", {"k_persist": 1, "dynamic_k": True}),
)
DIST_TIMEOUT_S = 300.0
"""The runs' collective timeout, also their checkpoints' (as ``moepec train`` sets it)."""

# results.json keeps the flat settings record of each run it has always had (the renderer
# and saved results read it): checkpoint settings under TrainConfig's former names.
_FLAT_CHECKPOINT = {"ckpt_dir": "path", "ckpt_interval": "interval",
                    "ckpt_serialization": "serialization"} | {name: name for name in (
    "k_persist", "k_snapshot", "selection", "pec_scope", "full_every", "keep_last",
    "busy_policy", "write_mode", "dynamic_k", "dynamic_k_down", "plt_budget")}


def config_record(cfg) -> dict[str, Any]:
    """A run's TrainConfig as results.json records it (flat; JSON values)."""
    from moepec import CheckpointConfig

    ckpt = cfg.checkpoint  # None: no checkpoints; recorded as the defaults, as before
    values = ({f.name: f.default for f in fields(CheckpointConfig)} | {"path": None}
              if ckpt is None else {f.name: getattr(ckpt, f.name) for f in fields(ckpt)})
    record = {f.name: getattr(cfg, f.name) for f in fields(cfg)
              if f.name not in ("model_overrides", "checkpoint")}
    record |= {old: values[new] for old, new in _FLAT_CHECKPOINT.items()}
    record["ckpt_sync"] = not values["async_persist"]
    return json.loads(json.dumps(record))  # enum members -> their strings


def _train(s: Settings, tmp: Path, name: str, ckpt: dict | None, *, model: str,
           overrides: dict, interval: int, eval_batches: int) -> dict:
    """One training run; faults (when checkpointing) at fault_steps(s), recovered
    in-process from the newest checkpoint. K_snapshot = K_persist, so the RAM copy a
    recovery reads holds exactly the experts storage holds: experts outside the newest
    checkpoint come back from older ones, stale, as after a crash."""
    from moepec import CheckpointConfig
    from moepec.train.trainer import TrainConfig, train

    faults = fault_steps(s)
    extra: dict[str, Any] = {}
    if ckpt is not None:
        checkpoint = CheckpointConfig(
            path=str(tmp / f"ckpt-{len(list(tmp.iterdir()))}"), interval=interval,
            plt_budget=PAPER["plt_budget"], timeout_s=DIST_TIMEOUT_S,
            **{"dynamic_k": False, **ckpt})  # K stays as named unless the run says dynamic
        extra = dict(checkpoint=checkpoint, faults=",".join(f"exception@{f}" for f in faults),
                     restarts=len(faults))
    cfg = TrainConfig(config=model, model_overrides=overrides, steps=s.steps, batch_size=16,
                      eval_interval=s.eval_interval if eval_batches else 0,
                      eval_batches=eval_batches, seed=0, threads=s.threads, progress=False,
                      log_interval=max(s.steps // 4, 1), dist_timeout_s=DIST_TIMEOUT_S,
                      **extra)
    t0 = time.perf_counter()
    res = train(cfg)
    mc = cfg.model_config()
    # Eq. 7 over the whole run: every step routes the same number of token assignments
    # per MoE layer, so the layers' denominators are equal and the mean of ratios is
    # the summed loss over all assignments of the run.
    total = s.steps * cfg.batch_size * mc.seq_len * mc.top_k * len(mc.moe_block_indices)
    lost = sum(r["lost"] for r in res.recoveries)
    history: dict[int, float] = {}
    for step, loss in res.val_history:  # a recovery replays steps: keep the survivor
        history = {k: v for k, v in history.items() if k < step}
        history[step] = loss
    return {"name": name, "k_persist": (ckpt or {}).get("k_persist"),
            "config": config_record(cfg),
            "val_loss": res.val_loss, "val_history": sorted(history.items()),
            "recoveries": res.recoveries, "lost": lost, "plt": lost / total if total else 0.0,
            "final_k": res.recoveries[-1]["k_persist"] if res.recoveries else None,
            "tokens_per_s": res.tokens_per_s, "wall_s": time.perf_counter() - t0}


def run_quality(s: Settings, tmp: Path) -> dict:
    overrides = dict(s.model_overrides)
    runs = []
    for name, ckpt in QUALITY_RUNS:
        log.info("quality run: %s", name)
        runs.append(_train(s, tmp, name, dict(ckpt) if ckpt else None, model=s.model,
                           overrides=overrides, interval=s.interval,
                           eval_batches=s.eval_batches))
    by = {r["name"]: r for r in runs}
    full, free = by["full recovery (K=8)"]["val_loss"], by["fault-free"]["val_loss"]
    for r in runs:
        r["vs_full"] = r["val_loss"] / full - 1
        r["vs_fault_free"] = r["val_loss"] / free - 1
        r["within_tolerance"] = r["vs_full"] <= QUALITY_TOLERANCE
    return {"model": s.model, "overrides": overrides, "steps": s.steps,
            "interval": s.interval, "faults": fault_steps(s), "runs": runs,
            "tolerance": QUALITY_TOLERANCE}


def simulate_plt(n: int, k: int, interval: int, total: int, faults: list[int],
                 first_full: bool) -> float:
    """PLT of one run under uniform routing, from the real PLTLedger and Selector.

    One MoE layer (staggering only relabels experts), one assignment per expert per
    step, a checkpoint after every ``interval``-th step; a fault during step f restores
    the newest checkpoint before f (its rotation state too) and replays from there.
    ``first_full``: the first checkpoint holds every expert, as moepec's does; the
    analytic formula assumes it does not.
    """
    from moepec.policy.plt import PLTLedger
    from moepec.policy.selection import Selector

    ledger, sel = PLTLedger.create([n]), Selector.create([n])
    copies = [0] * n  # cumulative count when each expert's newest saved copy was taken
    ckpts: list[tuple[int, list[int], list[int], dict]] = []
    pending, step = sorted(faults), 0
    while step < total:
        if pending and step == pending[0]:
            pending.pop(0)
            if ckpts:
                at, copies, state = ckpts[-1][1], list(ckpts[-1][2]), ckpts[-1][3]
                ledger.record_recovery([at], [copies])
                sel.load_state_dict(state)
                step = ckpts[-1][0] + 1
            else:  # nothing to restore: start over, nothing lost
                ledger.record_recovery([[0] * n], [[0] * n])
                step = 0
            continue
        ledger.observe([[1] * n])
        if (step + 1) % interval == 0:
            chosen = tuple(range(n)) if first_full and not ckpts else sel.select(k)[0]
            sel.commit([chosen], len(ckpts))
            for e in chosen:
                copies[e] = ledger.cumulative[0][e]
            ckpts.append((step, ledger.counts()[0], list(copies), sel.state_dict()))
        step += 1
    return ledger.plt()


def run_plt(s: Settings, tmp: Path, quality: dict) -> dict:
    from moepec.models import get_config
    from moepec.policy.plt import expected_plt_sequential

    n = get_config(s.model, **dict(s.model_overrides)).n_experts
    faults = fault_steps(s)
    rng = random.Random(0)
    grid = []
    for interval in s.plt_intervals:
        for k in s.plt_ks:
            sims = [simulate_plt(n, k, interval, s.steps,
                                 rng.sample(range(s.steps), len(faults)), first_full=False)
                    for _ in range(s.plt_trials)]
            grid.append({"k": k, "interval": interval,
                         "analytic": expected_plt_sequential(n, k, interval, s.steps,
                                                             len(faults)),
                         "simulated_random_faults": sum(sims) / len(sims)})
    checks = []
    overrides = {"n_experts": n}
    for k, interval in s.plt_real:
        log.info("PLT run: %s K=%d interval %d", s.plt_model, k, interval)
        run = _train(s, tmp, f"{s.plt_model} K={k} I={interval}", {"k_persist": k},
                     model=s.plt_model, overrides=overrides, interval=interval, eval_batches=0)
        checks.append(_plt_check(n, k, interval, s, run, f"measured ({s.plt_model}, 8 experts)"))
    for r in quality["runs"]:
        cfg = r["config"]
        if cfg.get("ckpt_dir") and cfg["selection"] == "sequential" and not cfg["dynamic_k"] \
                and r["k_persist"] < n:
            checks.append(_plt_check(n, r["k_persist"], s.interval, s, r,
                                     f"measured ({s.model} quality run)"))
    return {"n_experts": n, "steps": s.steps, "faults": faults, "n_faults": len(faults),
            "budget": PAPER["plt_budget"], "trials": s.plt_trials, "grid": grid,
            "checks": checks}


def _plt_check(n: int, k: int, interval: int, s: Settings, run: dict, source: str) -> dict:
    from moepec.policy.plt import expected_plt_sequential

    faults = fault_steps(s)
    return {"k": k, "interval": interval, "source": source, "measured": run["plt"],
            "analytic": expected_plt_sequential(n, k, interval, s.steps, len(faults)),
            "simulated_these_faults": simulate_plt(n, k, interval, s.steps, faults,
                                                   first_full=True),
            "wall_s": run["wall_s"]}


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem = next((int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), None)
    import matplotlib
    import numpy

    import moepec

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem,
            "load_avg": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "moepec": moepec.__version__, "numpy": numpy.__version__,
            "matplotlib": matplotlib.__version__, "git_commit": commit,
            "git_dirty": dirty}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# -- main ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings (~1-2 min), for tests")
    ap.add_argument("--out", default="docs", help="folder for results.md, results.json, img/")
    ap.add_argument("--render", metavar="RESULTS_JSON",
                    help="run nothing: rewrite the markdown and plots from an earlier "
                         "results.json (after changing how they are drawn)")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    out = Path(args.out)
    (out / "img").mkdir(parents=True, exist_ok=True)
    if args.render:
        return write(json.loads(Path(args.render).read_text()), out)
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.UTC)
    result: dict[str, Any] = {"settings": asdict(s), "quick": args.quick, "paper": PAPER,
                              "machine": machine_info(), "seconds": {},
                              "date": started.isoformat(timespec="seconds"),
                              "command": _command(argv)}
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="moepec-report-") as tmp_name:
            tmp = Path(tmp_name)
            steps = [("size", lambda: run_size(s, tmp)),
                     ("sharding", lambda: run_sharding(s)),
                     ("overhead", lambda: run_overhead(s, tmp)),
                     ("quality", lambda: run_quality(s, tmp)),
                     ("plt", lambda: run_plt(s, tmp, result["quality"]))]
            for name, fn in steps:
                t0 = time.perf_counter()
                print(f"== report: {name} ...", flush=True)
                result[name] = fn()
                result["seconds"][name] = time.perf_counter() - t0
                print(f"== report: {name} done in {result['seconds'][name]:.0f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
    result["seconds"]["total"] = time.perf_counter() - t_start
    result["machine"]["load_avg_end"] = os.getloadavg()
    return write(result, out)


def write(result: dict, out: Path) -> dict:
    """Headline, plots, OUT/results.json and OUT/results.md from the raw results."""
    result["headline"] = headline(result)
    result["images"] = plots(result, out / "img")
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(result))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and "
          f"{len(result['images'])} plots ({result['seconds']['total']:.0f} s of runs)")
    return result


def _command(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m moepec bench report", *args]).strip()


if __name__ == "__main__":
    main()
