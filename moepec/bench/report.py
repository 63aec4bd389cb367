"""The results report: every benchmark in one run, written to docs/results.md.

Sections (each a baseline and the method measured in the same run, reported as ratios):
1. checkpoint size vs K (:mod:`moepec.bench.size`), beside the paper's 54.2% / 57.7%;
2. per-rank checkpoint work (:mod:`moepec.bench.sharding`), beside the paper's 76.9%;
3. blocking time and iteration overhead (:mod:`moepec.bench.overhead`, Figure 12 analogue);
4. model quality under faults: the same fault schedule and seed for fault-free training,
   full-checkpoint recovery, PEC K=1 / K=2 sequential, PEC K=1 load-aware and dynamic K;
5. PLT vs (K, checkpoint interval) (Figure 5 analogue): the analytic expectation
   (:func:`moepec.plt.expected_plt_sequential`), a PLTLedger simulation and real runs;
6. the machine, versions and the command.

Writes OUT/results.md, OUT/results.json (every raw number) and OUT/img/*.png. Seeds are
fixed; on 2 CPU cores the default settings take ~25-40 minutes, ``--quick`` ~1-2.

Run: python benchmarks/report.py (or: moepec bench report) [--quick] [--out docs]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PAPER = {"size_k1": {"gpt-125m-8e": 0.542, "gpt-350m-16e": 0.577}, "per_rank": 0.769,
         "plt_budget": 0.0375}
SECTIONS = ("Headline numbers", "1. Checkpoint size vs K", "2. Per-rank checkpoint work",
            "3. Checkpoint overhead", "4. Model quality under faults",
            "5. PLT vs K and checkpoint interval", "6. Machine, versions and commands")
QUALITY_TOLERANCE = 0.01  # "within 1% of full-checkpoint recovery's final val loss"


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
    size_argv=("--scale", "32", "64"),
    sharding_measured=(("tiny", 2, 1, 1),),
    overhead_argv=("--config", "tiny", "--steps", "12", "--warmup", "2", "--interval", "4",
                   "--bw-config", "tiny", "--bw-scale", "1", "--bw-saves", "2"),
    model="tiny", model_overrides=(("n_experts", 8),), steps=40, interval=4, fault_every=15,
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


QUALITY_RUNS = (  # name, TrainConfig checkpoint fields (None: no checkpoints, no faults)
    ("fault-free", None),
    ("full recovery (K=8)", {"k_persist": 8}),
    ("PEC K=1 sequential", {"k_persist": 1}),
    ("PEC K=2 sequential", {"k_persist": 2}),
    ("PEC K=1 load-aware", {"k_persist": 1, "selection": "load_aware"}),
    ("PEC dynamic K (from 1)", {"k_persist": 1, "dynamic_k": True}),
)


def _train(s: Settings, tmp: Path, name: str, ckpt: dict | None, *, model: str,
           overrides: dict, interval: int, eval_batches: int) -> dict:
    """One training run; faults (when checkpointing) at fault_steps(s), recovered
    in-process from the newest checkpoint. K_snapshot = K_persist, so the RAM copy a
    recovery reads holds exactly the experts storage holds: experts outside the newest
    checkpoint come back from older ones, stale, as after a crash."""
    from moepec.train import TrainConfig, train

    faults = fault_steps(s)
    extra: dict[str, Any] = {}
    if ckpt is not None:
        extra = dict(ckpt_dir=str(tmp / f"ckpt-{len(list(tmp.iterdir()))}"),
                     ckpt_interval=interval, faults=",".join(f"exception@{f}" for f in faults),
                     restarts=len(faults), plt_budget=PAPER["plt_budget"], **ckpt)
    cfg = TrainConfig(config=model, model_overrides=overrides, steps=s.steps, batch_size=16,
                      eval_interval=s.eval_interval if eval_batches else 0,
                      eval_batches=eval_batches, seed=0, threads=s.threads, progress=False,
                      log_interval=max(s.steps // 4, 1), **extra)
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
            "config": {k: v for k, v in asdict(cfg).items() if k != "model_overrides"},
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
    from moepec.plt import PLTLedger
    from moepec.selection import Selector

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
    from moepec.plt import expected_plt_sequential

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
    from moepec.plt import expected_plt_sequential

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


# -- sections: numbers -----------------------------------------------------------------
def _r(x: float, nd: int = 1) -> float:
    """A percentage as shown in the report (the JSON holds the same rounded value)."""
    return round(100 * x, nd)


def _size_k1(result: dict, name: str) -> tuple[float, float | None, int]:
    e = result["size"]["models"][name]
    a = next(r["reduction"] for r in e["analytic"] if r["scope"] == "all" and r["k"] == 1)
    m = next((r["reduction"] for r in e["scaled"]["rows"]
              if r["scope"] == "all" and r["k"] == 1), None)
    return a, m, e["scaled"]["scale"]


def _per_rank(result: dict) -> tuple[list[dict], list[dict]]:
    """(computed, measured) K=1 rows of the 8-expert model / the measured models."""
    rows = result["sharding"]["rows"]
    computed = [r for r in rows if r["source"] == "computed" and r["model"] == "gpt-125m-8e"
                and r["k"] == 1]
    return computed, [r for r in rows if r["source"] != "computed"]


def _methods(result: dict) -> dict[str, dict]:
    return {r["method"]: r for r in result["overhead"]["rows"]}


def _pec_runs(result: dict) -> list[dict]:
    return [r for r in result["quality"]["runs"] if r["name"].startswith("PEC")]


def headline(result: dict) -> list[dict]:
    """The numbers a README would quote: label, sentence, and the values it shows."""
    items = []
    for name, paper in PAPER["size_k1"].items():
        a, m, scale = _size_k1(result, name)
        vals = [_r(a), _r(m) if m is not None else None, _r(paper)]
        items.append({"label": f"Checkpoint size, {name}, K=1",
                      "text": f"{vals[0]}% smaller than a full checkpoint (analytic, "
                              f"full-size model); {vals[1]}% measured on disk at 1/{scale} "
                              f"scale; paper: {vals[2]}%",
                      "values": vals})
    computed, measured = _per_rank(result)
    red = [_r(r["reduction_vs_full_baseline"]) for r in computed]
    meas = measured[0] if measured else None
    vals = [min(red), max(red)] + ([_r(meas["reduction_vs_full_baseline"])] if meas else [])
    text = (f"the busiest rank writes {vals[0]}% to {vals[1]}% less per checkpoint than with the "
            f"baseline full checkpoint (gpt-125m-8e, K=1, adaptive sharding, {len(red)} "
            f"computed DP/EP layouts)")
    if meas:
        text += (f"; {vals[2]}% measured on {meas['dp']} real gloo ranks ({meas['model']} "
                 f"model, EP {meas['ep']})")
    vals.append(_r(PAPER["per_rank"]))
    items.append({"label": "Per-rank checkpoint work", "text": text + f"; paper: {vals[-1]}%",
                  "values": vals})
    by = _methods(result)
    pec, sync, dasync = by["moepec-pec"], by["dcp.save"], by["dcp.async_save"]
    vals = [round(1e3 * pec["blocked_s"], 2), _r(pec["blocked_frac_iter"]),
            round(sync["blocked_s"] / pec["blocked_s"], 1),
            round(dasync["blocked_s"] / pec["blocked_s"], 1),
            _r(pec["iter_overhead"]), _r(sync["iter_overhead"])]
    items.append({"label": "Blocking time",
                  "text": f"PEC async checkpointing blocks training {vals[0]} ms per checkpoint "
                          f"({vals[1]}% of an iteration): {vals[2]}x less than sync dcp.save, "
                          f"{vals[3]}x less than dcp.async_save; mean iteration time "
                          f"{vals[4]:+}% (dcp.save {vals[5]:+}%) vs no checkpointing",
                  "values": vals})
    q = result["quality"]
    pec_runs = _pec_runs(result)
    vals = [round(100 * r["vs_full"], 2) for r in pec_runs]
    within = sum(r["within_tolerance"] for r in pec_runs)
    parts = ", ".join(f"{r['name'].removeprefix('PEC ')} {v:+.2f}%"
                      for r, v in zip(pec_runs, vals))
    vals += [within, len(pec_runs), len(q["faults"])]
    items.append({"label": "Model quality under faults",
                  "text": f"final validation loss vs full-checkpoint recovery: {parts} "
                          f"({within} of {len(pec_runs)} PEC runs within 1%; "
                          f"{len(q['faults'])} faults in {q['steps']} steps)",
                  "values": vals})
    p = result["plt"]
    k1 = next((c for c in p["checks"] if c["k"] == 1 and "quality" in c["source"]), None)
    interval = result["quality"]["interval"]
    ok = sorted((c for c in p["grid"] if c["interval"] == interval
                 and c["analytic"] <= p["budget"]), key=lambda c: c["k"])
    vals = [result["settings"]["fault_every"], _r(PAPER["plt_budget"], 2), interval]
    text = (f"with a fault every {vals[0]} steps (a harsh rate), the {vals[1]}% PLT budget at "
            f"a checkpoint interval of {interval} steps needs ")
    if ok:
        vals += [ok[0]["k"], _r(ok[0]["analytic"], 2)]
        text += f"K={vals[-2]} (analytic PLT {vals[-1]}%)"
    elif any(c["interval"] == interval for c in p["grid"]):
        text += "more than the grid's largest K below N (analytic)"
    else:
        text += "a K the grid does not show (its intervals differ)"
    if k1:
        vals += [k1["interval"], _r(k1["measured"], 2), _r(k1["analytic"], 2)]
        text += (f"; the K=1 quality run (interval {k1['interval']}) measured PLT "
                 f"{vals[-2]}% (analytic {vals[-1]}%)")
    items.append({"label": "PLT", "text": text, "values": vals})
    return items


# -- plots -----------------------------------------------------------------------------
def plots(result: dict, img: Path) -> list[str]:
    """Write the PNGs (matplotlib, Agg); returns their names relative to ``img.parent``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for name, draw in (("size_vs_k.png", _plot_size), ("sharding.png", _plot_sharding),
                       ("overhead.png", _plot_overhead), ("quality.png", _plot_quality),
                       ("plt_grid.png", _plot_plt)):
        fig = draw(plt, result)
        fig.tight_layout()
        fig.savefig(img / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(f"{img.name}/{name}")
    return names


def _plot_size(plt, result):
    models = result["size"]["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, (name, e) in zip(axes[0], models.items()):
        for i, scope in enumerate(("all", "optimizer", "weights")):
            rows = [r for r in e["analytic"] if r["scope"] == scope]
            if not rows:
                continue
            ax.plot([r["k"] for r in rows], [100 * r["reduction"] for r in rows], "-",
                    color=f"C{i}", label=f"scope {scope} (analytic)")
            meas = [r for r in e["scaled"]["rows"] if r["scope"] == scope]
            ax.plot([r["k"] for r in meas], [100 * r["reduction"] for r in meas], "o",
                    color=f"C{i}", mfc="none",
                    label=f"scope {scope} (measured, 1/{e['scaled']['scale']} scale)")
        paper = e.get("paper_reduction_k1")
        if paper:
            ax.plot([1], [100 * paper], "k*", ms=12, label=f"paper K=1: {100 * paper:.1f}%")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set(title=name, xlabel="K (experts saved per MoE layer)",
               ylabel="checkpoint size reduction vs full (%)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


def _plot_sharding(plt, result):
    rows = result["sharding"]["rows"]
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['model'].removeprefix('gpt-')} DP{r['dp']} EP{r['ep']} K{r['k']}"
              + ("*" if r["source"] != "computed" else "") for r in rows]
    x = range(len(rows))
    w = 0.27
    for i, mode in enumerate(("baseline", "sharded", "adaptive")):
        ax.bar([j + (i - 1) * w for j in x],
               [100 * (1 - r[mode]["max"] / r["baseline_full_max"]) for r in rows], w,
               label=f"{mode} (PEC)")
    ax.axhline(100 * PAPER["per_rank"], color="k", ls="--",
               label=f"paper: {100 * PAPER['per_rank']:.1f}%")
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="busiest-rank bytes below\nbaseline full checkpoint (%)",
           title="Per-rank checkpoint work (* = measured on gloo ranks, others computed)")
    ax.set_ylim(0, 115)
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _plot_overhead(plt, result):
    rows = [r for r in result["overhead"]["rows"] if r["method"] != "none"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["method"] for r in rows]
    colors = ["C3" if "save" in n and "async" not in n else "C1" if "async" in n or "full" in n
              else "C2" for n in names]
    blocked = [1e3 * r["blocked_s"] for r in rows]
    bars = a1.bar(names, blocked, color=colors)
    a1.bar_label(bars, [f"{b:.2f}" for b in blocked], fontsize=8)
    a1.set_yscale("log")
    # log bars need a fixed floor: one decade under the smallest value
    a1.set_ylim(10 ** (math.floor(math.log10(max(min(blocked), 1e-3))) - 1), 3 * max(blocked))
    a1.set(ylabel="training blocked per checkpoint (ms, log)",
           title="Blocking time per checkpoint")
    over = [100 * r["iter_overhead"] for r in rows]
    a2.bar_label(a2.bar(names, over, color=colors), [f"{v:+.1f}%" for v in over], fontsize=8)
    a2.axhline(0, color="grey", lw=0.5)
    a2.set(ylabel="mean iteration time vs no checkpointing (%)",
           title=f"Iteration time overhead (no checkpointing: "
                 f"{1e3 * result['overhead']['baseline_iter_s']:.1f} ms)")
    a2.margins(y=0.15)
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=25)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("red: synchronous, orange: asynchronous without PEC, green: PEC async",
                 fontsize=9)
    return fig


def _plot_quality(plt, result):
    q = result["quality"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
    full = dict(next(r for r in q["runs"] if r["name"].startswith("full"))["val_history"])
    for i, r in enumerate(q["runs"]):
        steps, losses = zip(*r["val_history"]) if r["val_history"] else ((), ())
        style = "--" if r["name"] == "fault-free" else "-"
        a1.plot(steps, losses, style, color=f"C{i}", label=r["name"], lw=1.2)
        diff = [(st, 100 * (v / full[st] - 1)) for st, v in r["val_history"] if st in full]
        if diff:
            a2.plot(*zip(*diff), style, color=f"C{i}", lw=1.2)
    for ax in (a1, a2):
        for f in q["faults"]:
            ax.axvline(f, color="red", ls=":", lw=1)
        ax.grid(alpha=0.3)
    a1.set(ylabel="validation loss", title=f"{q['model']}: validation loss, faults (red) "
           f"every {result['settings']['fault_every']} steps, checkpoint every "
           f"{q['interval']} steps")
    a1.legend(fontsize=8)
    a2.axhline(100 * q["tolerance"], color="k", ls="--", lw=0.8, label="+1%")
    a2.set(xlabel="step", ylabel="vs full recovery (%)")
    a2.legend(fontsize=8)
    fig.align_ylabels()
    return fig


def _plot_plt(plt, result):
    p = result["plt"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, interval in enumerate(sorted({c["interval"] for c in p["grid"]})):
        cells = sorted((c for c in p["grid"] if c["interval"] == interval), key=lambda c: c["k"])
        ks = [c["k"] for c in cells]
        ax.plot(ks, [100 * c["analytic"] for c in cells], "-", color=f"C{i}",
                label=f"interval {interval} (analytic)")
        ax.plot(ks, [100 * c["simulated_random_faults"] for c in cells], "o", color=f"C{i}",
                mfc="none", ms=7)
        for c in p["checks"]:
            if c["interval"] == interval:
                ax.plot([c["k"]], [100 * c["measured"]], "*" if "quality" in c["source"]
                        else "x", color=f"C{i}", ms=11, mew=2)
    ax.axhline(100 * p["budget"], color="k", ls="--", label=f"budget {100 * p['budget']:.2f}%")
    ax.set_xscale("log", base=2)
    ks = sorted({c["k"] for c in p["grid"]})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_yscale("symlog", linthresh=0.1)  # K=N loses nothing: 0 must be on the axis
    ax.set_ylim(bottom=0)
    ax.set(xlabel="K (experts saved per MoE layer)", ylabel="PLT (%)",
           title=f"PLT vs K and checkpoint interval: N={p['n_experts']}, {p['steps']} steps, "
                 f"{p['n_faults']} faults\nline: analytic; o: PLTLedger simulation (random "
                 f"faults); x: real run; *: quality run")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig


# -- markdown --------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _pct(x: float | None, nd: int = 1, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.{nd}f}%" if sign else f"{100 * x:.{nd}f}%"


def _md_size(result: dict) -> list[str]:
    out = ["Bytes of one checkpoint (fp32 weights + both Adam moments) that saves K experts "
           "per MoE layer, against a full checkpoint. *Analytic*: from the parameter counts "
           "of the paper-sized models. *Measured*: moepec checkpoints written to disk for "
           "scaled-down copies (hidden size, FFN, vocabulary and context divided by the "
           "scale), against moepec's full checkpoint of the same model and optimizer in "
           "the same run (same on-disk format). `pec_scope` says what PEC skips for unselected experts: `all` "
           "(weights and moments), `optimizer` (only the moments) or `weights` (only the "
           "weights). The first checkpoint of every run is full; the rows are the "
           "checkpoints after it.", ""]
    for name, e in result["size"]["models"].items():
        sc = e["scaled"]
        meas = {(r["scope"], r["k"]): r for r in sc["rows"]}
        out += [f"**{name}**: {e['params'] / 1e6:.1f}M parameters ({e['expert_params'] / 1e6:.1f}M "
                f"in experts); measured at 1/{sc['scale']} scale ({sc['params'] / 1e6:.2f}M "
                f"parameters). Paper at K=1: {_pct(e['paper_reduction_k1'])}.", ""]
        scopes = sorted({r["scope"] for r in e["analytic"]}, key=("all", "optimizer",
                                                                  "weights").index)
        header = ["K"]
        for scope in scopes:
            header += [f"{scope}: analytic", f"{scope}: measured"]
        header.append("measured bytes vs analytic (all)")
        rows = []
        for k in sorted({r["k"] for r in e["analytic"]}):
            row: list[Any] = [k]
            for scope in scopes:
                a = next(r for r in e["analytic"] if r["scope"] == scope and r["k"] == k)
                m = meas.get((scope, k))
                row += [_pct(a["reduction"]), _pct(m["reduction"]) if m else "-"]
            m = meas.get(("all", k))
            row.append(_pct(m["measured_vs_analytic"], 2, sign=True) if m else "-")
            rows.append(row)
        out += [_table(header, rows), ""]
    out += ["The measured reduction is of the scaled-down model, whose non-expert share "
            "differs a little from the full-size model's; the last column compares its "
            "bytes on disk with the analytic bytes of that same scaled model (the "
            "difference is DCP's `.metadata` file: moepec stores raw tensor bytes).", "",
            "![checkpoint size reduction vs K](img/size_vs_k.png)", ""]
    return out


def _md_sharding(result: dict) -> list[str]:
    rows = []
    for r in result["sharding"]["rows"]:
        rows.append([r["model"], r["dp"], r["ep"], r["k"], r["source"],
                     f"{r['baseline_full_max'] / 1e6:.1f}",
                     *(f"{r[m]['max'] / 1e6:.1f}" for m in ("baseline", "sharded", "adaptive")),
                     f"{r['adaptive']['max_over_mean']:.3f}",
                     _pct(r["reduction_vs_full_baseline"])])
    computed, measured = _per_rank(result)
    return [
        "Bytes the busiest rank writes per checkpoint (MB; weights + Adam moments, mean "
        "over one rotation of the sequential selection). *Baseline* is Megatron-DeepSpeed's "
        "plan (DP rank 0 writes all non-expert state, the first EP group the experts); "
        "*sharded* splits the non-expert state over all ranks; *adaptive* is the paper's "
        "greedy balance. *Full baseline* is the baseline plan for a full checkpoint (all "
        "experts), the paper's reference for its 76.9%. Rows marked *computed* use the real "
        "planner on the real tensor sizes (meta device); rows marked *measured* ran the "
        "CheckpointManager on real gloo ranks (spawned processes) and read the bytes each "
        "rank wrote from the committed manifests.", "",
        _table(["model", "DP", "EP", "K", "source", "full baseline", "PEC baseline",
                "PEC sharded", "PEC adaptive", "adaptive max/mean", "busiest rank vs full "
                "baseline"], rows), "",
        f"Paper: {_pct(PAPER['per_rank'])} less work per rank (8-expert GPT-MoE). Here, "
        f"gpt-125m-8e at K=1: {min(_pct(r['reduction_vs_full_baseline']) for r in computed)}"
        f" to {max(_pct(r['reduction_vs_full_baseline']) for r in computed)} (computed)"
        + "".join(f"; {_pct(r['reduction_vs_full_baseline'])} measured on {r['dp']} ranks "
                  f"({r['model']}, EP {r['ep']})" for r in measured) + ".", "",
        "![per-rank checkpoint work](img/sharding.png)", ""]


def _md_overhead(result: dict) -> list[str]:
    o = result["overhead"]
    by = _methods(result)
    sync = by["dcp.save"]
    kind = {"none": "no checkpointing", "torch.save": "sync", "dcp.save": "sync (baseline)",
            "dcp.async_save": "async, no PEC", "moepec-full": "async, no PEC (K=N)",
            "moepec-pec": "PEC async (K=1)"}
    rows = [[r["method"], kind.get(r["method"], ""), f"{1e3 * r['blocked_s']:.2f}",
             _pct(r["blocked_frac_iter"]),
             f"{sync['blocked_s'] / r['blocked_s']:.1f}x" if r["method"] != "none" else "-",
             f"{1e3 * r['iter_s']:.1f}", _pct(r["iter_overhead"], sign=True)]
            for r in o["rows"]]
    c = o["config"]
    out = [f"One process trains `{c['config']}` ({c['steps']} steps, batch {c['batch']}, "
           f"{c['threads']} training thread(s), a checkpoint every {c['interval']} steps) once "
           "per method, in the same run. *Blocked* is the time the training loop waits per "
           "checkpoint (for moepec: starting the snapshot plus any wait before the next "
           "optimizer step); *iteration* is the mean step time after warm-up, checkpoint "
           "steps included. Figure 12 analogue.", "",
           _table(["method", "kind", "blocked ms/ckpt", "% of iteration",
                   "dcp.save blocked / this", "iteration ms", "vs no checkpointing"], rows), "",
           f"Machine bandwidth measured in the same run: memcpy "
           f"{o['memcpy_Bps'] / 1e9:.2f} GB/s; fsync'd file write "
           f"{o['write_fresh_Bps'] / 1e9:.2f} GB/s into new files in a row and "
           f"{o['write_rewrite_Bps'] / 1e9:.2f} GB/s rewriting a file just unlinked."]
    bw = o.get("bandwidth")
    if bw:
        ts = bw["torch_save"]
        out[-1] += (f" On {bw['config']} ({bw['params'] / 1e6:.1f}M parameters, K=1 "
                    f"checkpoints of {bw['persist_bytes'] / 1e6:.1f} MB) moepec's snapshot "
                    f"copies at {bw['snapshot_Bps'] / 1e9:.2f} GB/s "
                    f"({_pct(bw['snapshot_frac_memcpy'], 0)} of memcpy) and persists at "
                    f"{bw['persist_Bps'] / 1e9:.2f} GB/s: **{_pct(bw['persist_frac_write'], 0)}** "
                    f"of the {bw['write_Bps'] / 1e9:.2f} GB/s of plain fsync'd writes of the "
                    f"same bytes (medians over {len(bw['persist_s'])} pairs; over all pairs, "
                    f"stalls included: {_pct(bw['persist_frac_write_all'], 0)}). With stock DCP "
                    f"framing (`serialization=\"torch_save\"`) the persist reaches "
                    f"{_pct(ts['persist_frac_write'], 0)} "
                    f"({_pct(ts['persist_frac_write_all'], 0)} over all pairs).")
        out += ["", "Why paired writes: this machine is a VM whose free memory is handed "
                "back to the host, so a write into page-cache pages the host must back "
                "first runs 4-5x slower than one into pages just freed, and which one a "
                "write gets depends on what ran a moment before. Each timed write (persist "
                "or plain) therefore starts right after a scratch file is unlinked (for "
                "the persist, right before its DCP write), and the order alternates. Even "
                "so, some persists of a run stall ~3x in the write system calls (not in "
                "moepec's code) while the plain writes beside them do not; the medians "
                "give the typical persist, the all-pairs figure counts the stalls."]
    out += ["", "Training uses one thread here so that the background snapshot and persist "
            "work of the asynchronous methods has the second core; the mean iteration times "
            "differ by a few percent from run to run on this shared 2-core machine, so "
            "iteration-time differences of that size (including negative ones) are noise, "
            "while the blocking times are the checkpoint's own cost.", "",
            "![checkpoint overhead](img/overhead.png)", ""]
    return out


def _md_quality(result: dict) -> list[str]:
    q = result["quality"]
    s = result["settings"]
    full = next(r for r in q["runs"] if r["name"].startswith("full"))
    free = next(r for r in q["runs"] if r["name"] == "fault-free")
    rows = []
    for r in q["runs"]:
        c = r["config"]
        ck = bool(c.get("ckpt_dir"))
        rows.append([r["name"], r["k_persist"] or "-", c["selection"] if ck else "-",
                     len(r["recoveries"]), f"{r['val_loss']:.4f}",
                     _pct(r["vs_full"], 2, sign=True), _pct(r["vs_fault_free"], 2, sign=True),
                     _pct(r["plt"], 2) if ck else "-", r["final_k"] or "-",
                     f"{r['wall_s']:.0f}"])
    mc = ", ".join(f"{k}={v}" for k, v in q["overrides"].items())
    out = [f"The `{q['model']}` GPT-MoE{f' ({mc})' if mc else ''}, 8 experts per MoE layer, "
           f"trained for {q['steps']} steps (batch 16, seed 0, {s['threads']} threads) on "
           "the default corpus (the Python standard library's sources). Every run with "
           f"checkpoints takes one every {q['interval']} steps and gets the same faults: an "
           f"exception inside steps {', '.join(map(str, q['faults']))}, after which training "
           "restores the newest checkpoint in-process and continues (K_snapshot = "
           "K_persist, so the restored copy holds exactly the experts storage holds; the "
           "experts it lacks come back from older checkpoints, stale, as after a crash). "
           "The fault-free run has no checkpoints. Validation loss on a fixed held-out set "
           f"of {s['eval_batches']} batches; PLT is Eq. 7 over the whole run (lost token "
           "assignments over all assignments of the run).", "",
           _table(["run", "K_persist", "selection", "recoveries", "final val loss",
                   "vs full recovery", "vs fault-free", "PLT", "final K", "wall s"], rows), ""]
    verdicts = []
    for r in _pec_runs(result):
        verdicts.append(f"- {r['name']}: {_pct(r['vs_full'], 2, sign=True)} vs full-checkpoint "
                        f"recovery (PLT {_pct(r['plt'], 2)}): "
                        + ("**within 1%**." if r["within_tolerance"] else "**not within 1%**."))
    bad = [r["name"] for r in _pec_runs(result) if not r["within_tolerance"]]
    summary = ("Every PEC run stays within 1% of full-checkpoint recovery's final validation "
               "loss." if not bad else
               f"PEC does not stay within 1% of full-checkpoint recovery in: {', '.join(bad)}; "
               "the others do.")
    dyn = next((r for r in q["runs"] if r["config"].get("dynamic_k")), None)
    if dyn and dyn["recoveries"]:
        ks = ", ".join(str(rec["k_persist"]) for rec in dyn["recoveries"])
        verdicts.append(f"- Dynamic K starts at K_persist = 1 and doubles it after a recovery "
                        f"that leaves the PLT so far over {_pct(PAPER['plt_budget'], 2)}; "
                        f"K_persist after each recovery: {ks}. PLT is cumulative, so the "
                        "loss of the early recoveries stays in it.")
    ck_walls = [r["wall_s"] for r in q["runs"] if r["config"].get("ckpt_dir")]
    walls = (f"Wall time: {min(ck_walls):.0f}-{max(ck_walls):.0f} s per run with checkpoints "
             f"every {q['interval']} steps and {len(q['faults'])} recoveries, "
             f"{free['wall_s']:.0f} s fault-free without checkpoints. Here training uses "
             f"{s['threads']} threads on {result['machine']['cores']} cores, so the background "
             "snapshot and persist work competes with it for the cores (section 3 leaves a "
             "core free for it); this is the price on this machine, not a blocking time.")
    out += [summary, "", *verdicts, "", walls, "",
            f"Full-checkpoint recovery ends {_pct(full['vs_fault_free'], 3, sign=True)} from "
            f"the fault-free run ({full['val_loss']:.5f} vs {free['val_loss']:.5f}): recovery "
            "from a full checkpoint replays the lost steps and should land on the fault-free "
            "trajectory.", "", "![validation loss under faults](img/quality.png)", ""]
    return out


def _md_plt(result: dict) -> list[str]:
    p = result["plt"]
    ks = sorted({c["k"] for c in p["grid"]})
    rows = []
    for interval in sorted({c["interval"] for c in p["grid"]}):
        row: list[Any] = [interval]
        for k in ks:
            c = next(c for c in p["grid"] if c["k"] == k and c["interval"] == interval)
            cell = f"{_pct(c['analytic'], 2)} ({_pct(c['simulated_random_faults'], 2)})"
            row.append(f"**{cell}**" if c["analytic"] <= p["budget"] else cell)
        rows.append(row)
    checks = [[c["k"], c["interval"], c["source"], _pct(c["analytic"], 2),
               _pct(c["simulated_these_faults"], 2), _pct(c["measured"], 2)]
              for c in p["checks"]]
    return [
        f"Expected PLT of sequential PEC for N={p['n_experts']} experts per layer, a run of "
        f"{p['steps']} steps and {p['n_faults']} faults (the quality section's scenario), "
        "as a function of K and the checkpoint interval (Figure 5 analogue). Each cell: "
        "`expected_plt_sequential` (analytic; uniform routing, uniformly random fault "
        f"steps) and, in parentheses, the mean of {p['trials']} PLTLedger simulations with "
        "random fault steps (the real PLTLedger and Selector, uniform routing). **Bold**: "
        f"within the paper's {_pct(p['budget'], 2)} budget.", "",
        _table(["interval \\ K", *ks], rows), "",
        "Cross-check of single cells with real training runs (the fault steps of the quality "
        "section). *Simulated, these faults*: the PLTLedger simulation at exactly these "
        "fault steps with uniform routing, and with the first checkpoint full as moepec "
        "makes it (the analytic formula assumes it is not, and averages over fault "
        "positions). *Measured*: the PLT the real run's ledger recorded (real, non-uniform "
        "routing).", "",
        _table(["K", "interval", "source", "analytic", "simulated, these faults", "measured"],
               checks), "",
        "![PLT vs K and checkpoint interval](img/plt_grid.png)", ""]


def _md_machine(result: dict) -> list[str]:
    m = result["machine"]
    secs = result["seconds"]
    ram = f"{m['ram_bytes'] / 2**30:.1f} GiB" if m.get("ram_bytes") else "unknown"
    return [
        _table(["", ""], [
            ["CPU", m["cpu"]], ["cores", m["cores"]], ["RAM", ram],
            ["platform", m["platform"]],
            ["load average at start / end (1, 5, 15 min)",
             f"{', '.join(f'{x:.2f}' for x in m['load_avg'])} / "
             f"{', '.join(f'{x:.2f}' for x in m['load_avg_end'])}"],
            ["python", m["python"]], ["torch", m["torch"]], ["moepec", m["moepec"]],
            ["numpy", m["numpy"]], ["matplotlib", m["matplotlib"]],
            ["git commit", (m["git_commit"] or "unknown")
             + (" (with uncommitted changes)" if m.get("git_dirty") else "")],
            ["date (UTC)", result["date"]],
            ["wall time", f"{secs['total'] / 60:.1f} min ("
             + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items() if k != "total") + ")"]]),
        "", "Regenerate this page, its plots and results.json (fixed seeds) with either of:",
        "", "```", result["command"],
        "python benchmarks/report.py" + result["command"].removeprefix(
            "python -m moepec bench report"),
        "```", "",
        "`--quick` runs tiny settings (a minute or two; what the tests run); `--out DIR` "
        "writes elsewhere; `--render results.json` redraws this page and the plots from "
        "saved results without running anything. The sections call `moepec.bench.size` "
        f"(`{' '.join(result['settings']['size_argv'])}`), `moepec.bench.sharding` (its "
        "computed cases plus measured ones on spawned gloo ranks), `moepec.bench.overhead` "
        f"(`{' '.join(result['settings']['overhead_argv'])}`) and `moepec.train.train`; "
        "every setting is in results.json under `settings`.", ""]


def markdown(result: dict) -> str:
    """docs/results.md from the result dict (pure: no I/O)."""
    secs = result["seconds"]["total"]
    out = ["# moepec results", "",
           f"Generated by `{result['command']}` on {result['date'][:10]} in "
           f"{secs / 60:.1f} minutes on {result['machine']['cores']} CPU cores"
           + (" with `--quick` (tiny settings: the numbers only show the pipeline works)"
              if result["quick"] else "")
           + ". Every number is in [results.json](results.json). Reference: Cai, Qin, "
           "Huang, *Partial Experts Checkpoint* / MoC-System, arXiv 2408.04307.", "",
           f"## {SECTIONS[0]}", ""]
    out += [f"- **{h['label']}**: {h['text']}" for h in result["headline"]]
    out.append("")
    for title, body in zip(SECTIONS[1:], (_md_size, _md_sharding, _md_overhead, _md_quality,
                                          _md_plt, _md_machine)):
        out += [f"## {title}", "", *body(result)]
    return "\n".join(out).rstrip() + "\n"


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
    started = datetime.datetime.now(datetime.timezone.utc)
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
