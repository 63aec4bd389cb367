"""moepec's checkpoint manager against torchtitan's own in torchtitan's real Trainer.

Same model (deepseek_v3's debug model, 8 experts per MoE layer), same steps, same
interval, in one invocation: torchtitan's default DCP CheckpointManager with
``async_mode=async`` (the baseline), then moepec's PecCheckpointManager (K=1, async
snapshot and persist), alternating ``--repeats`` times. Per checkpoint it reports the bytes
written and the seconds the training loop spent blocked in the checkpointer (its
``save()`` and ``maybe_wait_for_staging()`` calls; the last step's synchronous save is left
out of both), and the ratios. Runs on CPU through the tests' shims (tests/titan_shims.py:
device type, SDPA attention, gloo-friendly reductions), under torchrun, so from a source
checkout (:mod:`moepec.bench.checkout`).

    moepec bench torchtitan                 # 1 process, 13 steps, a checkpoint every 3
    moepec bench torchtitan --nproc 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moepec.bench import at_least_one
from moepec.bench.checkout import REPO, tests_dir


def run_one(kind: str, work: Path, args: argparse.Namespace, assets: tuple[str, str]) -> dict:
    """One training run; returns its timings and checkpoint sizes."""
    tests = tests_dir("titan_launch.py")
    out = work / kind
    bench = work / f"{kind}.json"
    overrides = ["titan_shims.sdpa_attention"]
    if kind == "moepec":
        overrides.append('moepec.integrations.torchtitan.use_pec='
                         '{"k_persist": 1, "ram_dir": null}')
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", str(tests / "titan_launch.py"),
           "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
           "--override.imports", *overrides,
           "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs",
           "--hf_assets_path", assets[0], "--dataloader.dataset_path", assets[1],
           "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "2",
           "--training.steps", str(args.steps), "--dump_folder", str(out),
           "--checkpoint.enable", "--checkpoint.interval", str(args.interval),
           "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(REPO)]),
           "TITAN_BENCH": str(bench)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{kind} run failed:\n{proc.stderr[-4000:]}")
    t = json.loads(bench.read_text())
    saves = [s for s, last in zip(t["save_s"], t["last"]) if not last]
    n = len([s for s in range(1, args.steps) if s % args.interval == 0])
    blocked = (sum(saves) + sum(t["staging_s"])) / n
    return {"blocked_s": blocked, "bytes": _sizes(kind, out / "checkpoint", args),
            "step_s": statistics.median(t["step_s"])}


def _sizes(kind: str, folder: Path, args: argparse.Namespace) -> list[int]:
    """Bytes of each interval checkpoint (not the last step's), in step order."""
    steps = [s for s in range(1, args.steps) if s % args.interval == 0]
    if kind == "stock":
        return [sum(f.stat().st_size for f in (folder / f"step-{s}").rglob("*") if f.is_file())
                for s in steps]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    info = json.loads(subprocess.run([sys.executable, "-m", "moepec", "inspect", str(folder),
                                      "--json"], env=env, capture_output=True, text=True,
                                     check=True).stdout)
    by_step = {c["step"]: c["bytes"] for c in info["checkpoints"] if c["committed"]}
    return [by_step[s] for s in steps]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=at_least_one, default=1)
    args = p.parse_args(argv)
    tests = str(tests_dir("titan_assets.py"))
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from titan_assets import write_assets

    rows: dict[str, list[dict]] = {"stock": [], "moepec": []}
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as tmp:
        work = Path(tmp)
        assets = write_assets(str(work / "assets"))
        for r in range(args.repeats):
            for kind in ("stock", "moepec"):
                rows[kind].append(run_one(kind, work / f"r{r}", args, assets))
    stock, pec = rows["stock"], rows["moepec"]
    sb = statistics.mean(b for r in stock for b in r["bytes"])
    pb_full = statistics.mean(r["bytes"][0] for r in pec)
    pb = statistics.mean(b for r in pec for b in r["bytes"][1:])
    sblk = statistics.mean(r["blocked_s"] for r in stock)
    pblk = statistics.mean(r["blocked_s"] for r in pec)
    print(f"deepseek_v3 debugmodel, {args.nproc} process(es), {args.steps} steps, a checkpoint "
          f"every {args.interval}, seq_len {args.seq_len}, {args.repeats} repeat(s)")
    print("| checkpointer | bytes/checkpoint | blocked/checkpoint | median step |")
    print("|---|---|---|---|")
    print(f"| torchtitan CheckpointManager, async_mode=async | {sb / 1e6:.1f} MB | "
          f"{sblk * 1e3:.0f} ms | {statistics.mean(r['step_s'] for r in stock) * 1e3:.0f} ms |")
    print(f"| moepec PecCheckpointManager, K=1 (first, full: {pb_full / 1e6:.1f} MB) | "
          f"{pb / 1e6:.1f} MB | {pblk * 1e3:.0f} ms | "
          f"{statistics.mean(r['step_s'] for r in pec) * 1e3:.0f} ms |")
    print(f"ratio moepec/torchtitan: bytes {pb / sb:.3f}x (after the first), blocked "
          f"{pblk / sblk:.3f}x")


if __name__ == "__main__":
    main()
