"""Plots of the results report (matplotlib, written as PNG under OUT/img/)."""

from __future__ import annotations

import math
from pathlib import Path

from moepec.bench.render import PAPER


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
