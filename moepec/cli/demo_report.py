"""The demo's report: numbers from the runs' metrics, faults and checkpoints, and plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from moepec.cli.demo_compare import compare_table, restart_all_row
from moepec.recovery.offline import inspect_path
from moepec.recovery.records import read_recoveries
from moepec.store.storage import Storage

PLT_BUDGET = 0.0375


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _segments(records: list[dict]) -> list[list[dict]]:
    """Split a metrics stream appended over restarts into runs of increasing steps."""
    segs: list[list[dict]] = []
    for r in records:
        if "loss" not in r or "event" in r:
            continue
        if not segs or r["step"] <= segs[-1][-1]["step"]:
            segs.append([])
        segs[-1].append(r)
    return segs


def _commit_bytes(commits: list[dict], info: dict) -> tuple[int, dict[int, list[int]]]:
    """Bytes of a full checkpoint, and of the partial ones by their K_persist."""
    full_bytes = info.get("full_bytes") or max((c["bytes"] for c in commits), default=0)
    by_k: dict[int, list[int]] = {}
    for c in commits:
        if not c["full"]:
            by_k.setdefault(c["k_persist"], []).append(c["bytes"])
    return full_bytes, by_k


_STORAGE_FAULTS = ("enospc", "storage_error", "slow_storage", "corrupt")


def _fault_rows(faults: list[dict], recoveries: list[dict],
                persist_errors: list[dict]) -> list[dict[str, Any]]:
    """One row per injected fault: the recovery that followed it (none for storage
    faults, which training survives without one) and what it cost."""
    rows = []
    for f in sorted(faults, key=lambda f: f["time"]):
        after = [r for r in recoveries if r["time"] > f["time"]]
        rec = after[0] if after and f["kind"] not in _STORAGE_FAULTS else None
        errors = [e for e in persist_errors if e["time"] >= f["time"]]
        rows.append({
            "kind": f["kind"], "step": f["step"], "rank": f["rank"],
            "recovered_to": rec["step"] if rec else None,
            "tier": rec["tier"] if rec else None,
            "restore_s": rec["seconds"] if rec else None,
            "downtime_s": rec["time"] - f["time"] if rec else None,
            "steps_redone": f["step"] - rec["step"] - 1 if rec else 0,
            "plt_after": rec["plt"] if rec else None,
            "k_after": rec.get("k_persist") if rec else None,
            "note": (f"{len(errors)} failed persist(s), training went on"
                     if f["kind"] in ("enospc", "storage_error") else ""),
        })
    return rows


def _median_iteration_s(s, segs: list[list[dict]]) -> float:
    """Median seconds per training step, from the metrics lines' throughput."""
    from moepec.models.configs import get_config

    tokens_per_step = s.batch_size * get_config(s.config).seq_len
    iter_s = [tokens_per_step / r["tokens_per_s"] for seg in segs for r in seg
              if r.get("tokens_per_s")]
    return statistics.median(iter_s) if iter_s else float("nan")


def build_report(s, clean: Path, faulty: Path, out: Path, *, ranks: int, wall_s: float,
                 compare: dict[str, Any] | None = None) -> dict[str, Any]:
    """The demo's numbers from the two runs' folders (and ``compare``: the replica-group
    and planned-stop rows, :mod:`moepec.cli.demo_compare`); writes report.md, report.json
    and the plots into ``out`` and returns the numbers (``text``: the report)."""
    clean_summary = json.loads((clean / "summary.json").read_text())
    summary = json.loads((faulty / "summary.json").read_text())
    metrics = _lines(faulty / "metrics.jsonl")
    faults = _lines(faulty / "faults.jsonl")
    events = [r for r in metrics if "event" in r]
    ev = {kind: [e for e in events if e["event"] == kind]
          for kind in ("recovery", "checkpoint", "persist_error", "commit")}
    recoveries, ckpts, persist_errors = ev["recovery"], ev["checkpoint"], ev["persist_error"]
    ckpt_root = faulty / "ckpt"
    full_bytes, by_k = _commit_bytes(ev["commit"], inspect_path(str(ckpt_root)))
    partial = by_k.get(min(by_k), [full_bytes]) if by_k else [full_bytes]
    segs = _segments(metrics)
    blocked = [c["blocked_s"] for c in ckpts]
    result = {
        "settings": {k: getattr(s, k) for k in s.__slots__},
        "ranks": ranks, "wall_s": wall_s,
        "final_step": summary["final_step"], "data_state": summary.get("data_state"),
        "clean_final_step": clean_summary["final_step"],
        "clean_data_state": clean_summary.get("data_state"),
        "val_loss": summary["val_loss"], "clean_val_loss": clean_summary["val_loss"],
        "faults": _fault_rows(faults, recoveries, persist_errors),
        "recoveries": len(recoveries),
        "plt": recoveries[-1]["plt"] if recoveries else 0.0,
        "checkpoints": len(ckpts), "persist_errors": len(persist_errors),
        "bytes_partial": statistics.mean(partial) if partial else 0, "bytes_full": full_bytes,
        "bytes_by_k": {k: statistics.mean(v) for k, v in sorted(by_k.items())},
        "commits": len(ev["commit"]),
        "blocked_mean_s": statistics.mean(blocked) if blocked else 0.0,
        "blocked_max_s": max(blocked) if blocked else 0.0,
        "iter_s": _median_iteration_s(s, segs),
        "recovery_records": read_recoveries(Storage(str(ckpt_root))),
    }
    result["val_gap"] = (result["val_loss"] - result["clean_val_loss"]) / result["clean_val_loss"]
    if compare is not None:
        result["cost_per_fault"] = {
            "restart_all": restart_all_row(result["faults"], result["iter_s"]), **compare}
    plots = _plots(s, clean, segs, faults, recoveries, ckpts, persist_errors, metrics, out,
                   result.get("cost_per_fault"))
    result["plots"] = plots
    result["text"] = _text(result)
    (out / "report.md").write_text(result["text"] + "\n\n" + "\n".join(
        f"![{p}]({p})" for p in plots) + "\n")
    (out / "report.json").write_text(json.dumps({k: v for k, v in result.items()
                                                 if k != "text"}, indent=1))
    return result


def _text(r: dict[str, Any]) -> str:
    s = r["settings"]
    same_end = r["final_step"] == r["clean_final_step"] and r["data_state"] == r["clean_data_state"]
    lines = [
        "moepec demo: fault-tolerant GPT-MoE training with Partial Experts Checkpointing",
        f"  model {s['config']}, {r['ranks']} rank(s), {s['steps']} steps, checkpoint every "
        f"{s['ckpt_interval']} steps, K_snapshot {s['k_snapshot']}, K_persist {s['k_persist']}"
        + (" (dynamic K)" if s.get("dynamic_k") else ""),
        f"  wall time {r['wall_s']:.0f} s (all runs)",
        "",
        f"faults injected: {len(r['faults'])}; automatic recoveries: {r['recoveries']}",
        f"  {'fault':<14}{'step':>6}{'rank':>6}  {'resumed at':>10}  {'from':<8}"
        f"{'restore':>9}{'downtime':>10}{'redone':>8}{'PLT':>9}",
    ]
    for f in r["faults"]:
        if f["recovered_to"] is None:
            lines.append(f"  {f['kind']:<14}{f['step']:>6}{f['rank']:>6}  {'-':>10}  "
                         f"{'':<8}{'':>9}{'':>10}{'':>8}{'':>9}  {f['note']}")
            continue
        lines.append(
            f"  {f['kind']:<14}{f['step']:>6}{f['rank']:>6}  {f['recovered_to'] + 1:>10}  "
            f"{f['tier']:<8}{f['restore_s']:>8.2f}s{f['downtime_s']:>9.1f}s"
            f"{f['steps_redone']:>8}{100 * f['plt_after']:>8.3f}%"
            + (f"  K_persist -> {f['k_after']}" if f.get("k_after") else ""))
    lines += [
        "",
        f"steps completed: {r['final_step'] + 1} (fault-free run: {r['clean_final_step'] + 1}); "
        f"data position {'identical' if same_end else 'DIFFERENT'} "
        f"({r['data_state']})",
        f"checkpoints: {r['checkpoints']} snapshots, {r['commits']} committed to storage, "
        f"{r['persist_errors']} failed persist(s) (storage full; training continued)",
        f"checkpoint bytes persisted: full {r['bytes_full'] / 1e6:.2f} MB; PEC "
        + ", ".join(f"K={k}: {b / 1e6:.2f} MB ({_smaller(b, r['bytes_full'])})"
                    for k, b in r["bytes_by_k"].items()),
        f"training loop blocked per checkpoint: mean {1e3 * r['blocked_mean_s']:.2f} ms, max "
        f"{1e3 * r['blocked_max_s']:.2f} ms (an iteration takes ~{1e3 * r['iter_s']:.0f} ms)",
        f"proportion of lost tokens (PLT): {100 * r['plt']:.3f}% "
        f"(budget {100 * PLT_BUDGET:.2f}%)" + _over_budget(r),
        f"final validation loss: {r['val_loss']:.4f} with faults vs {r['clean_val_loss']:.4f} "
        f"fault-free ({100 * r['val_gap']:+.2f}%)",
        f"plots: {', '.join(r['plots'])}",
    ]
    if r.get("cost_per_fault"):
        lines += ["", *compare_table(r["cost_per_fault"]), *_compare_notes(r["cost_per_fault"])]
    return "\n".join(lines)


def _compare_notes(rows: dict[str, Any]) -> list[str]:
    """What the comparison's columns measured, in a line each."""
    notes = ["  restart-all: every worker restarts and restores PEC checkpoints (RAM, else "
             "storage);"]
    ft, stop = rows.get("replica_groups"), rows.get("planned_stop")
    if ft:
        notes.append(f"  replica groups: the survivor trains on, the killed group trains "
                     f"again {ft['rejoin_s']:.2f}s after the kill, healed from the survivor "
                     f"({'bit-identical' if ft['same_final_state'] else 'DIFFERENT'} at the "
                     f"end);")
    else:
        notes.append("  replica groups: not measured (torchft missing, or the run ended "
                     "before its kill: see above);")
    if stop:
        notes.append(f"  planned stop: complete checkpoint ({stop['complete_bytes'] / 1e6:.2f} "
                     f"MB, every expert) committed {stop['signal_to_commit_s']:.2f}s after the "
                     f"signal, launcher exit after {stop['signal_to_exit_s']:.2f}s, the rerun "
                     f"restored it {stop['rerun_restore_s']:.2f}s after its start.")
    return notes


def _over_budget(r: dict[str, Any]) -> str:
    """Why the PLT ends over the budget, when it does: the demo's fault rate."""
    recovered = [f for f in r["faults"] if f["recovered_to"] is not None]
    if r["plt"] <= PLT_BUDGET or not recovered:
        return ""
    ks = [r["settings"]["k_persist"]] + [f["k_after"] for f in recovered if f.get("k_after")]
    raised = f"; dynamic K raised K_persist {' -> '.join(map(str, ks))}" if len(ks) > 1 else ""
    return (f"\n  over budget because the demo faults far more often than a cluster does: "
            f"{len(recovered)} recoveries in {r['settings']['steps']} steps (one every "
            f"~{r['settings']['steps'] // len(recovered)}){raised}\n  `moepec advise` sizes "
            f"K and the interval for a real failure rate (docs/planning.md)")


def _plots(s, clean: Path, segs, faults, recoveries, ckpts, persist_errors, metrics,
           out: Path, costs: dict[str, Any] | None) -> list[str]:
    """Draw the report's plots into ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed (or present on a server)
    import matplotlib.pyplot as plt

    names = []

    def save(name: str, size: tuple[float, float], draw, *args) -> None:
        fig, ax = plt.subplots(figsize=size)
        draw(ax, *args)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    save("loss.png", (9, 4.5), _draw_loss, clean, segs, faults, metrics)
    save("plt.png", (7, 3.5), _draw_plt, s.steps, recoveries)
    save("timeline.png", (9, 2.8), _draw_timeline, faults, recoveries, ckpts, persist_errors)
    if costs:
        save("cost_per_fault.png", (7, 3.2), _draw_costs, costs)
    return names


def _draw_loss(ax, clean: Path, segs, faults, metrics) -> None:
    """Training and validation loss of both runs, the faults marked."""
    clean_recs = [r for r in _lines(clean / "metrics.jsonl") if "loss" in r and "event" not in r]
    ax.plot([r["step"] for r in clean_recs], [r["loss"] for r in clean_recs], color="0.55",
            lw=2.5, alpha=0.6, label="fault-free: train loss", zorder=3)
    for i, seg in enumerate(segs):
        ax.plot([r["step"] for r in seg], [r["loss"] for r in seg], color="C0", lw=1,
                label="with faults: train loss" if i == 0 else None)
    vals = [(r["step"], r["val_loss"]) for r in metrics if "val_loss" in r]
    cvals = [(r["step"], r["val_loss"]) for r in clean_recs if "val_loss" in r]
    if cvals:
        ax.plot(*zip(*cvals), "s--", color="0.3", ms=4, label="fault-free: val loss")
    if vals:
        ax.plot(*zip(*vals), "o", color="C1", ms=4, label="with faults: val loss")
    for f in faults:
        ax.axvline(f["step"], color="C3", ls=":", lw=1)
        ax.text(f["step"], ax.get_ylim()[1], f" {f['kind']}", rotation=90, va="top",
                ha="right", fontsize=8, color="C3")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("Training with injected faults (red) and automatic recovery")
    ax.legend(fontsize=8, loc="upper right")


def _draw_plt(ax, steps: int, recoveries) -> None:
    """The cumulative proportion of lost tokens after each recovery, and the budget."""
    if recoveries:
        ax.step([0] + [r["step"] for r in recoveries], [0] + [100 * r["plt"] for r in recoveries],
                where="post", marker="o", label="cumulative PLT after each recovery")
    ax.axhline(100 * PLT_BUDGET, color="C3", ls="--", label="budget 3.75%")
    ax.set_xlim(0, steps)
    ax.set_xlabel("step restored")
    ax.set_ylabel("PLT (%)")
    ax.set_title("Proportion of lost tokens")
    ax.legend(fontsize=8)


def _draw_costs(ax, costs: dict[str, Any]) -> None:
    """Lost seconds per fault: restart-all, replica groups, a planned stop (the steps
    redone and the PLT added written on each bar)."""
    names = [("restart_all", "restart-all"), ("replica_groups", "replica groups"),
             ("planned_stop", "planned stop")]
    rows = [(title, costs[key]) for key, title in names if costs.get(key)]
    bars = ax.barh([t for t, _ in rows], [r["lost_s"] for _, r in rows],
                   color=["C3", "C2", "C0"][:len(rows)])
    for bar, (_, r) in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f"  {r['lost_s']:.1f}s, {r['steps_redone']} steps redone, PLT "
                f"+{100 * r['plt']:.2f}%", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.6 * max(r["lost_s"] for _, r in rows))
    ax.set_xlabel("training seconds lost per fault")
    ax.set_title("What one fault costs")


def _draw_timeline(ax, faults, recoveries, ckpts, persist_errors) -> None:
    """Checkpoints, failed persists, faults and recoveries over wall time."""
    times = [e["time"] for e in ckpts] + [f["time"] for f in faults] + \
        [r["time"] for r in recoveries]
    t0 = min(times) if times else 0.0
    ok = [e for e in ckpts if e["persist"]]
    ax.scatter([e["time"] - t0 for e in ok], [2] * len(ok), marker="|", s=200, color="C0",
               label="checkpoint (snapshot + persist)")
    ram = [e for e in ckpts if not e["persist"]]
    ax.scatter([e["time"] - t0 for e in ram], [2] * len(ram), marker="|", s=200, color="C1",
               label="checkpoint kept in RAM only")
    ax.scatter([e["time"] - t0 for e in persist_errors], [1.5] * len(persist_errors),
               marker="v", color="C1", label="persist failed")
    ax.scatter([f["time"] - t0 for f in faults], [1] * len(faults), marker="x", s=60,
               color="C3", label="fault")
    ax.scatter([r["time"] - t0 for r in recoveries], [0.5] * len(recoveries), marker="^",
               s=50, color="C2", label="recovered")
    ax.set_yticks([])
    ax.set_ylim(0, 2.6)
    ax.set_xlabel("seconds since the first checkpoint")
    ax.set_title("Checkpoint timeline")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3))


def _smaller(nbytes: int, full: int) -> str:
    """How much smaller than a full checkpoint, or "all experts" when it is one."""
    pct = 100 * (1 - nbytes / max(full, 1))
    return "all experts" if abs(pct) < 0.05 else f"{pct:.1f}% smaller"
