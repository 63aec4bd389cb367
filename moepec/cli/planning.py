"""``moepec simulate`` and ``moepec advise``: plan a run before paying for it.

``commands()`` returns them for ``moepec.cli.main`` to register. Every flag maps onto
one field of :class:`~moepec.plan.workload.Cluster`, ``Timing`` or ``Failures`` here,
in one place; bad values raise ConfigError (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moepec.errors import ConfigError

GB = 1e9


def _add_common(p: argparse.ArgumentParser) -> None:
    from moepec.plan.workload import FT_GROUPS, FT_HEAL_S, FT_PAUSE_S

    m = p.add_argument_group("model (one of)")
    m.add_argument("--config", default=None, help="named moepec config (see model-info)")
    m.add_argument("--hf-config", default=None, metavar="CONFIG_JSON",
                   help="a Hugging Face MoE config.json (Mixtral, Qwen-MoE, DeepSeek-V2/V3)")
    m.add_argument("--counts", default=None, metavar="E,NE,LAYERS,EXPERTS,TOPK",
                   help="explicit: expert params, non-expert params, MoE layers, experts, "
                        "top-k, e.g. 45.1e9,1.6e9,32,8,2")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=1024, help="GPUs of the job (%(default)s)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="(%(default)s)")
    c.add_argument("--d2h-gbps", type=float, default=12.0,
                   help="device-to-host GB/s per GPU (%(default)s)")
    c.add_argument("--storage-gbps-gpu", type=float, default=2.0,
                   help="storage write GB/s per rank (%(default)s)")
    c.add_argument("--storage-gbps-node", type=float, default=5.0,
                   help="storage write GB/s per node (%(default)s)")
    c.add_argument("--storage-gbps-total", type=float, default=200.0,
                   help="aggregate storage write GB/s (%(default)s)")
    c.add_argument("--read-gbps-gpu", type=float, default=4.0,
                   help="storage read GB/s per rank at recovery (%(default)s)")
    c.add_argument("--calibration", default=None, metavar="FILE",
                   help="JSON of `moepec bench gpu`: D2H bandwidth, blocking time, "
                        "iteration time (when not given otherwise)")
    t = p.add_argument_group("iteration")
    t.add_argument("--iteration-s", type=float, default=None,
                   help="seconds per step; default from --tokens-per-step and --mfu")
    t.add_argument("--tokens-per-step", type=float, default=16e6,
                   help="global batch in tokens, for the FLOPs estimate (%(default)s)")
    t.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation (%(default)s)")
    t.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak bf16 TFLOP/s per GPU (H100: %(default)s)")
    t.add_argument("--bytes-per-param", type=float, default=12.0,
                   help="checkpoint bytes per parameter (fp32 weight + Adam: %(default)s)")
    f = p.add_argument_group("failures")
    f.add_argument("--mtbf-hours", type=float, default=None,
                   help="job MTBF; default: Meta's published curve at --gpus")
    f.add_argument("--mtbf-gpu-hours", type=float, default=None,
                   help="MTBF of one GPU (job MTBF = this / GPUs)")
    f.add_argument("--ram-survives", type=float, default=0.5,
                   help="share of failures that keep the node's RAM (%(default)s)")
    f.add_argument("--detect-s", type=float, default=60.0, help="(%(default)s)")
    f.add_argument("--restart-s", type=float, default=240.0, help="(%(default)s)")
    r = p.add_argument_group("replica groups (pec-ft: survivors train on, a failed group "
                             "heals from a live peer)")
    r.add_argument("--ft-groups", type=int, default=FT_GROUPS,
                   help="data-parallel replica groups; a cold start only when all are down; "
                        "1 = restart-all, as pec (%(default)s)")
    r.add_argument("--heal-s", type=float, default=FT_HEAL_S,
                   help="from a fault to the failed group's rejoin; at scale its restart "
                        "time. Default: measured by `moepec bench ft` on 2 CPU cores "
                        "(docs/results.md) (%(default)s)")
    r.add_argument("--ft-pause-s", type=float, default=FT_PAUSE_S,
                   help="what a fault costs the surviving groups (to their next committed "
                        "step). Default: measured by `moepec bench ft` with a 1 s heartbeat "
                        "timeout (%(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--days", type=float, default=7.0, help="wall time simulated (%(default)s)")
    o.add_argument("--budget", type=float, default=0.0375, help="PLT budget (%(default)s)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--json", action="store_true", help="print JSON")
    o.add_argument("--out", default=None, metavar="DIR", help="write JSON and PNG plots here")


def shape_of(args: argparse.Namespace):
    """The ModelShape of --config, --hf-config or --counts (exactly one)."""
    from moepec.plan.workload import ModelShape, shape_from_hf, shape_from_name

    given = [x for x in (args.config, args.hf_config, args.counts) if x]
    if len(given) != 1:
        raise ConfigError("give the model as one of --config NAME, --hf-config "
                          "CONFIG_JSON or --counts E,NE,LAYERS,EXPERTS,TOPK")
    if args.config:
        return shape_from_name(args.config)
    if args.hf_config:
        return shape_from_hf(args.hf_config)
    try:
        e, ne, layers, experts, top_k = (float(x) for x in args.counts.split(","))
    except ValueError:
        raise ConfigError(f"--counts {args.counts!r} needs five numbers: expert params, "
                          "non-expert params, MoE layers, experts, top-k") from None
    return ModelShape(name="counts", expert_params=int(e), non_expert_params=int(ne),
                      n_moe_layers=int(layers), n_experts=int(experts), top_k=int(top_k))


def _calibration(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read calibration {path!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"calibration {path} must be the JSON object `moepec bench gpu` wrote")
    return data


def inputs_of(args: argparse.Namespace):
    """(shape, cluster, timing, failures) from the flags."""
    from moepec.plan.workload import Cluster, Failures, Timing, meta_mtbf_hours

    shape, cal = shape_of(args), _calibration(args.calibration)
    cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                      d2h_bw=cal.get("d2h_pinned_Bps", args.d2h_gbps * GB),
                      storage_bw_gpu=args.storage_gbps_gpu * GB,
                      storage_bw_node=args.storage_gbps_node * GB,
                      storage_bw_total=args.storage_gbps_total * GB,
                      read_bw_gpu=args.read_gbps_gpu * GB)
    it = args.iteration_s
    if it is None and "iteration_s" in cal:
        it = float(cal["iteration_s"])
    if it is None:
        if not (args.peak_tflops > 0 and args.tokens_per_step > 0):
            raise ConfigError("--peak-tflops and --tokens-per-step must be > 0")
        if not 0 < args.mfu <= 1:
            raise ConfigError(f"--mfu is a fraction of the peak FLOPs in (0, 1], e.g. 0.35 "
                              f"(got {args.mfu})")
        it = 6 * shape.active_params * args.tokens_per_step / (
            args.gpus * args.peak_tflops * 1e12 * args.mfu)
    block = cal.get("blocked_s", {}).get("moepec-pec")
    timing = Timing(iteration_s=it, bytes_per_param=args.bytes_per_param,
                    **({"fixed_block_s": float(block)} if block is not None else {}))
    if args.mtbf_hours is not None and args.mtbf_gpu_hours is not None:
        raise ConfigError("give --mtbf-hours (job) or --mtbf-gpu-hours (per GPU), not both")
    hours = args.mtbf_hours if args.mtbf_hours is not None else (
        args.mtbf_gpu_hours / args.gpus if args.mtbf_gpu_hours is not None
        else meta_mtbf_hours(args.gpus))
    if args.ft_groups < 1 or args.gpus % args.ft_groups:
        raise ConfigError(f"--ft-groups must be >= 1 and divide --gpus {args.gpus} into "
                          f"equal replica groups, got {args.ft_groups}")
    failures = Failures(mtbf_s=hours * 3600, ram_survives=args.ram_survives,
                        detect_s=args.detect_s, restart_s=args.restart_s,
                        heal_s=args.heal_s, ft_pause_s=args.ft_pause_s)
    return shape, cluster, timing, failures


def _add_simulate(p: argparse.ArgumentParser) -> None:
    from moepec.plan.simulate import STRATEGIES

    _add_common(p)
    s = p.add_argument_group("strategies")
    s.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated, of: " + ", ".join(STRATEGIES))
    s.add_argument("--k", type=int, default=1, help="K_persist of the PEC strategies (%(default)s)")
    s.add_argument("--k-snapshot", type=int, default=None, help="K_snapshot (default 2K "
                   "for pec-2level, K otherwise)")
    s.add_argument("--interval", type=int, default=None,
                   help="steps between checkpoints; default: Young/Daly on the full "
                        "checkpoint's cost, at least 60 s")
    s.add_argument("--routing", default="uniform", help="uniform or zipf (%(default)s)")
    s.add_argument("--sim-layers", type=int, default=4,
                   help="MoE layers whose PLT is tracked (%(default)s)")


def _run_simulate(args: argparse.Namespace) -> int:
    from moepec.plan.report import print_table, run_simulations, write_outputs

    if args.interval is not None and args.interval < 1:
        raise ConfigError(f"--interval is the steps between checkpoints, >= 1 (got "
                          f"{args.interval}); leave it out for the Young/Daly interval")
    if args.k < 1 or (args.k_snapshot is not None and args.k_snapshot < args.k):
        raise ConfigError(f"need --k >= 1 and --k-snapshot >= --k (got {args.k}, "
                          f"{args.k_snapshot})")
    shape, cluster, timing, failures = inputs_of(args)
    result = run_simulations(shape, cluster, timing, failures, args)
    if args.out:
        write_outputs(result, shape, cluster, timing, failures, args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    return 0


def _add_advise(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("--min-interval-s", type=float, default=60.0,
                   help="shortest interval considered, seconds (%(default)s)")
    p.add_argument("--no-ram-tier", action="store_true",
                   help="recover from storage only (no RAM tier)")
    p.add_argument("--strategy", choices=("pec", "pec-ft"), default="pec",
                   help="pec: every fault restarts the job from its checkpoints; pec-ft: "
                        "--ft-groups replica groups train on (%(default)s)")


def _run_advise(args: argparse.Namespace) -> int:
    from moepec.plan.advise import advise

    shape, cluster, timing, failures = inputs_of(args)
    adv = advise(shape, cluster, timing, failures, budget=args.budget, days=args.days,
                 ram_tier=not args.no_ram_tier, min_interval_s=args.min_interval_s,
                 seed=args.seed, groups=args.ft_groups if args.strategy == "pec-ft" else 1)
    out = dict(adv.as_dict(), model=shape.name, gpus=cluster.gpus,
               mtbf_hours=failures.mtbf_s / 3600, iteration_s=timing.iteration_s)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "advise.json").write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{shape.name}: {shape.total_params / 1e9:.1f}B params, {shape.n_experts} "
              f"experts x {shape.n_moe_layers} MoE layers; {cluster.gpus} GPUs, MTBF "
              f"{failures.mtbf_s / 3600:.2f} h, {timing.iteration_s:.2f} s/step")
        print("\n".join(adv.explain()))
    return 0


def commands():
    """(name, help, add_arguments, run) of each subcommand here."""
    return [
        ("simulate", "simulate a training run with failures: ETTR, stall, PLT per strategy",
         _add_simulate, _run_simulate),
        ("advise", "the K, interval and K_snapshot that maximise ETTR under a PLT budget",
         _add_advise, _run_advise),
    ]
