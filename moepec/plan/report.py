"""Tables, JSON and plots of ``moepec simulate`` (matplotlib, PNG next to the JSON)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from moepec.errors import ConfigError
from moepec.plan.advise import young_daly_steps
from moepec.plan.simulate import simulate, strategy
from moepec.plan.workload import Cluster, Failures, ModelShape, Timing, meta_mtbf_hours
from moepec.policy.plt_forecast import plt_per_fault

__all__ = ["default_interval", "print_table", "run_simulations", "write_outputs"]

SWEPT = ("full-sync", "full-async", "pec")
"""The strategies of the sweeps and plots (and pec-ft where its groups divide 1,024 GPUs)."""


def default_interval(shape: ModelShape, cluster: Cluster, timing: Timing,
                     failures: Failures, min_s: float = 60.0) -> int:
    """Young/Daly on the full checkpoint's write time, at least ``min_s`` seconds."""
    cost = cluster.write_seconds(shape.total_params * timing.bytes_per_param) + timing.commit_s
    return max(young_daly_steps(cost, failures.mtbf_s, timing.iteration_s),
               math.ceil(min_s / timing.iteration_s))


def run_simulations(shape: ModelShape, cluster: Cluster, timing: Timing, failures: Failures,
                    args) -> dict[str, Any]:
    """One simulation per strategy of ``args.strategies``; returns the JSON result."""
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not 1 <= args.k <= shape.n_experts:
        raise ConfigError(f"--k must be in 1..{shape.n_experts} (the model's experts), "
                          f"got {args.k}")
    if args.k_snapshot is not None and not args.k <= args.k_snapshot <= shape.n_experts:
        raise ConfigError(f"--k-snapshot must be in {args.k}..{shape.n_experts}")
    interval = args.interval or default_interval(shape, cluster, timing, failures)
    rows = [simulate(shape, cluster, strategy(n, interval, args.k, args.k_snapshot,
                                              args.ft_groups), timing,
                     failures, days=args.days, routing=args.routing,
                     sim_layers=args.sim_layers, budget=args.budget, seed=args.seed).as_dict()
            for n in names]
    return {"model": shape.name, "total_params": shape.total_params,
            "expert_params": shape.expert_params, "n_experts": shape.n_experts,
            "n_moe_layers": shape.n_moe_layers, "gpus": cluster.gpus,
            "mtbf_hours": failures.mtbf_s / 3600, "iteration_s": timing.iteration_s,
            "interval": interval, "k": args.k, "budget": args.budget,
            "ft_groups": args.ft_groups, "heal_s": failures.heal_s,
            "ft_pause_s": failures.ft_pause_s, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    """The result as a fixed-width table."""
    print(f"{result['model']}: {result['total_params'] / 1e9:.1f}B params, "
          f"{result['n_experts']} experts x {result['n_moe_layers']} MoE layers; "
          f"{result['gpus']} GPUs, MTBF {result['mtbf_hours']:.2f} h, "
          f"{result['iteration_s']:.3f} s/step, interval {result['interval']} steps, "
          f"K={result['k']}")
    if any(r["heals"] for r in result["rows"]):
        print(f"pec-ft: {result['ft_groups']} replica groups, heal {result['heal_s']:g} s, "
              f"survivors' pause {result['ft_pause_s']:g} s per fault")
    head = ("strategy", "ETTR", "stall/ckpt s", "recomputed", "restart h", "cold starts",
            "heal h", "PLT %", "PLT exp %", "GB/rank/day", "faults", "K end")
    table = [head] + [(
        r["plan"], f"{r['ettr']:.4f}", f"{r['stall_per_checkpoint_s']:.3f}",
        str(r["recomputed_steps"]), f"{r['restart_s'] / 3600:.1f}", str(r["cold_starts"]),
        f"{(r['ft_pause_s'] + r['reduced_width_s']) / 3600:.2f}", f"{100 * r['plt']:.2f}",
        f"{100 * r['plt_expected']:.2f}", f"{r['bytes_per_rank_per_day'] / 1e9:.1f}",
        str(r["failures"]), str(r["k_final"])) for r in result["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for j, row in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _sweeps(shape, cluster, timing, failures, args, interval) -> dict[str, Any]:
    """ETTR vs MTBF and vs GPUs (full-async and PEC), expected PLT vs K and interval."""
    kw = dict(days=args.days, seed=args.seed, track_plt=False)
    out: dict[str, Any] = {"mtbf": [], "gpus": [], "plt": []}
    names = SWEPT + (("pec-ft",) if 1024 % args.ft_groups == 0 else ())
    for hours in (0.25, 0.5, 1, 2, 4, 8, 16):
        f = replace(failures, mtbf_s=hours * 3600)
        out["mtbf"].append({"mtbf_hours": hours, **{
            n: simulate(shape, cluster, strategy(n, interval, args.k, groups=args.ft_groups),
                        timing, f, **kw).ettr for n in names}})
    for gpus in (1024, 2048, 4096, 8192, 16384):
        c, f = replace(cluster, gpus=gpus), replace(failures, mtbf_s=meta_mtbf_hours(gpus) * 3600)
        out["gpus"].append({"gpus": gpus, **{
            n: simulate(shape, c, strategy(n, interval, args.k, groups=args.ft_groups), timing,
                        f, **kw).ettr for n in names}})
    steps = max(1, round(args.days * 86400 / timing.iteration_s))
    faults = args.days * 86400 / failures.mtbf_s
    ks = sorted({min(2 ** i, shape.n_experts) for i in range(12)})
    for mult in (0.25, 0.5, 1, 2, 4):
        i = max(1, round(interval * mult))
        out["plt"].append({"interval": i, "plt": {k: faults * plt_per_fault(
            shape.n_experts, k, i, steps) for k in ks}})
    return out


def _plot(sweeps: dict[str, Any], result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for name, key, xlabel, logx in (("ettr_vs_mtbf.png", "mtbf_hours", "job MTBF (h)", True),
                                    ("ettr_vs_gpus.png", "gpus", "GPUs (Meta MTBF curve)",
                                     True)):
        rows = sweeps["mtbf" if key == "mtbf_hours" else "gpus"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in [s for s in rows[0] if s != key]:
            ax.plot([r[key] for r in rows], [r[s] for r in rows], "o-", label=s)
        ax.set(xlabel=xlabel, ylabel="ETTR", title=f"{result['model']}, interval "
               f"{result['interval']} steps, K={result['k']}")
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in sweeps["plt"]:
        ks = list(row["plt"])
        ax.plot(ks, [100 * row["plt"][k] for k in ks], "o-", label=f"interval {row['interval']}")
    ax.axhline(100 * result["budget"], color="k", ls="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="K (experts saved per MoE layer)", ylabel="expected PLT over the run (%)",
           title=result["model"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(out / "plt_vs_k.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return names + ["plt_vs_k.png"]


def write_outputs(result: dict[str, Any], shape, cluster, timing, failures, args) -> None:
    """simulate.json and the three PNGs under ``args.out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweeps = _sweeps(shape, cluster, timing, failures, args, result["interval"])
    result["plots"] = _plot(sweeps, result, out)
    (out / "simulate.json").write_text(json.dumps(dict(result, sweeps=sweeps), indent=1))
