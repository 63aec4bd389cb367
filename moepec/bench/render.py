"""Rendering of the results report: headline numbers and markdown sections.

Pure functions of the raw results dictionary that :mod:`moepec.bench.report` builds
(and writes as results.json), so ``moepec bench report --render results.json`` can
redraw everything without running anything; the plots are in
:mod:`moepec.bench.plots`.
"""

from __future__ import annotations

from typing import Any

PAPER = {"size_k1": {"gpt-125m-8e": 0.542, "gpt-350m-16e": 0.577}, "per_rank": 0.769,
         "plt_budget": 0.0375}
SECTIONS = ("Headline numbers", "1. Checkpoint size vs K", "2. Per-rank checkpoint work",
            "3. Checkpoint overhead", "4. Model quality under faults",
            "5. PLT vs K and checkpoint interval", "6. Machine, versions and commands")
QUALITY_TOLERANCE = 0.01  # "within 1% of full-checkpoint recovery's final val loss"


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
            "moepec-pec": "PEC async (K=1)",
            "moepec-pec-shm": "PEC async (K=1), RAM tier in shared memory"}
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
        "", "Regenerate this page, its plots and results.json (fixed seeds) with:",
        "", "```", result["command"], "```", "",
        "`--quick` runs tiny settings (a minute or two; what the tests run); `--out DIR` "
        "writes elsewhere; `--render results.json` redraws this page and the plots from "
        "saved results without running anything. The sections call `moepec.bench.size` "
        f"(`{' '.join(result['settings']['size_argv'])}`), `moepec.bench.sharding` (its "
        "computed cases plus measured ones on spawned gloo ranks), `moepec.bench.overhead` "
        f"(`{' '.join(result['settings']['overhead_argv'])}`) and `moepec.train.trainer.train`; "
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
