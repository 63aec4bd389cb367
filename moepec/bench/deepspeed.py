"""DeepSpeed: the moepec door against DeepSpeed's own checkpoint engines, on the same
MoE model, ZeRO stage and Adam state, in the same run.

    moepec bench deepspeed [--model native|mixtral --layers 4 --experts 8 --hidden 256
                            --ffn 1024 --checkpoints 6 --steps 3 --k 1 --stage 2
                            --repeats 3 --s3/--no-s3]

``--model native``: DeepSpeed's own ``deepspeed.moe.layer.MoE`` layers; ``mixtral``:
transformers' ``MixtralForCausalLM`` from its config class (random weights, stacked
experts, vocabulary ``--vocab``), its parameters as they are (found by moepec's expert
discovery).

For each method, a fresh engine (same seed) trains ``--steps`` steps between
checkpoints; per ``engine.save_checkpoint`` call: the bytes its tag folder holds once
written, and how long the call blocked the training loop. Methods: ``deepspeed``
(DeepSpeed's default engine, ``torch.save`` of every file in the call), ``decoupled``
(DeepSpeed's decoupled writer, ``"checkpoint": {"writer": {"type": "python",
"decoupled": true}}``, where it starts), ``moepec`` (PEC K of N, written in the
background: ``async_persist``) and ``moepec-sync``. The first save of a PEC lineage
writes every expert; the table reports the later ones (the steady state) and the first
apart. One process (gloo, world size 1, ``DS_ACCELERATOR=cpu`` unless set).

Then the two levels (:func:`two_level`, unless ``--no-two-level``): after a first save
names the lineage, a RAM snapshot per checkpoint (``snapshot(engine, dir)``, the whole
state into shared memory), its blocking against DeepSpeed's own ``save_checkpoint``
above; and the restore of a restarted worker (a fresh engine, ``load_checkpoint(dir)``)
from RAM against the same load from storage (a local folder, page cache warm) and, with
``--s3`` (the default when moto and s3fs import), from S3: ``latest``, its tag folder
and the folders its view reads downloaded from a bucket on moto's server into a fresh
local folder, then the same load (:mod:`moepec.bench.s3_root`); alternating, medians of
``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moepec.bench.s3_root import S3Copies, add_flag, choose, report_line

METHODS = ("deepspeed", "decoupled", "moepec", "moepec-sync")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moepec bench deepspeed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("native", "mixtral"), default="native",
                   help="DeepSpeed's MoE layers, or transformers' Mixtral")
    p.add_argument("--vocab", type=int, default=1024, help="mixtral: vocabulary size")
    p.add_argument("--layers", type=int, default=4, help="MoE layers")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="training steps between saves")
    p.add_argument("--k", type=int, default=1, help="experts per layer a PEC save writes")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3),
                   help="ZeRO stage (3: --model mixtral; DeepSpeed's MoE refuses it)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (both methods)")
    p.add_argument("--repeats", type=int, default=3, help="two levels: restores per tier")
    p.add_argument("--no-two-level", dest="two_level", action="store_false",
                   help="skip the RAM level's snapshot and restore measurements")
    add_flag(p)
    p.add_argument("--methods", nargs="+", default=["deepspeed", "moepec", "moepec-sync"],
                   choices=METHODS,
                   help="decoupled: DeepSpeed 0.19.8's decoupled writer; on CPU it fails "
                        "(it sends its writer process a tensor that requires grad)")
    return p.parse_args(argv)


def _mixtral(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=args.experts, num_experts_per_tok=2))


def expert_share(net: torch.nn.Module) -> float:
    """The experts' share of the model's parameters (moepec's discovery; ZeRO-3's
    partitioned parameters at their full size)."""
    from moepec.integrations.ds_experts import discover_experts

    numel = {n: int(getattr(p, "ds_numel", p.numel())) for n, p in net.named_parameters()}
    return sum(numel[n] for n in discover_experts(net).owner) / sum(numel.values())


def _model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model == "mixtral":
        return _mixtral(args)
    from deepspeed.moe.layer import MoE
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(64, args.hidden)
            self.moes = nn.ModuleList(
                MoE(hidden_size=args.hidden, num_experts=args.experts, ep_size=1, k=2,
                    expert=nn.Sequential(nn.Linear(args.hidden, args.ffn), nn.ReLU(),
                                         nn.Linear(args.ffn, args.hidden)))
                for _ in range(args.layers))
            self.head = nn.Linear(args.hidden, 8)

        def forward(self, x):
            h, aux = self.emb(x), 0.0
            for m in self.moes:
                out, a, _ = m(h)
                h, aux = h + out, aux + a
            return self.head(h), aux

    torch.manual_seed(0)
    return Net()


def _engine(args: argparse.Namespace, method: str, section: dict | None = None):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    net = _model(args)
    groups = list(net.parameters()) if args.model == "mixtral" else \
        split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "p"})
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": args.stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "steps_per_print": 10 ** 9}
    if method == "decoupled":
        cfg["checkpoint"] = {"writer": {"type": "python", "decoupled": True}}
    if method.startswith("moepec"):
        cfg["moepec"] = section or {"k_persist": args.k, "async_persist": method == "moepec"}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=cfg)
    return engine


def _train(engine, steps: int, vocab: int | None = None) -> float:
    from torch import nn

    started = time.perf_counter()
    for _ in range(steps):
        if vocab is not None:  # a causal LM
            ids = torch.randint(0, vocab, (8, 32))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            continue
        x = torch.randn(8, 64)
        out, aux = engine(x)
        loss = nn.functional.cross_entropy(out, torch.randint(0, 8, (8,))) + aux
        engine.backward(loss)
        engine.step()
    return (time.perf_counter() - started) / steps


def two_level(args: argparse.Namespace, root: Path) -> dict:
    """RAM snapshots (blocking) and restores from RAM and from storage (module docstring)."""
    import moepec.integrations.deepspeed as door

    ram_dir = tempfile.mkdtemp(prefix="moepec-bench-", dir="/dev/shm") \
        if os.access("/dev/shm", os.W_OK) else None
    save_dir, vocab = str(root / "two-level"), (args.vocab if args.model == "mixtral"
                                                else None)
    section = {"k_persist": args.k, "async_persist": False, "snapshot_every": 1,
               "ram_dir": ram_dir}
    s3 = None
    try:
        engine = _engine(args, "moepec", section)
        _train(engine, 1, vocab)
        engine.save_checkpoint(save_dir)  # names the lineage the snapshots continue
        blocked = []
        for _ in range(args.checkpoints):
            _train(engine, args.steps, vocab)
            started = time.perf_counter()
            assert door.snapshot(engine, save_dir)
            blocked.append(time.perf_counter() - started)
        door.attach(engine, **section).close_ram(unlink=False)  # as a dead worker leaves them
        s3 = S3Copies(Path(save_dir), root) if args.s3 else None
        times = _restores(args, save_dir, section, s3)
        engine.destroy()
    finally:  # the slots go with the folder
        if ram_dir is not None:
            shutil.rmtree(ram_dir, ignore_errors=True)
        if s3 is not None:
            s3.close()
    return {"snapshot": statistics.median(blocked[1:] or blocked), "s3_why": args.s3_why,
            **{t: statistics.median(v) for t, v in times.items()}}


def _restores(args: argparse.Namespace, save_dir: str, section: dict,
              s3: S3Copies | None) -> dict[str, list[float]]:
    """A restarted worker's restores (a fresh engine, ``load_checkpoint``), alternating:
    from RAM, from the local folder, and from S3 (a download of what the load of
    ``latest`` reads, then the load of the copy; its weights checked equal to the local
    folder's)."""
    import moepec.integrations.deepspeed as door

    tiers = ("ram", "local", "s3") if s3 is not None else ("ram", "local")
    times: dict[str, list[float]] = {t: [] for t in tiers}
    stored: dict[str, torch.Tensor] = {}
    tag = (Path(save_dir) / "latest").read_text().strip()
    for _ in range(args.repeats):
        for tier in tiers:
            fresh = _engine(args, "moepec", section if tier == "ram" else
                            {"k_persist": args.k, "async_persist": False})
            folder, fetch_s = s3.fetch(tag) if tier == "s3" else (Path(save_dir) / tag, 0.0)
            started = time.perf_counter()
            fresh.load_checkpoint(str(folder.parent))
            times[tier].append(fetch_s + time.perf_counter() - started)
            got = door.last_load_report().tier
            assert got == ("ram" if tier == "ram" else "storage"), got
            if tier == "ram":
                door.attach(fresh, **section).close_ram(unlink=False)
            weights = {k: v.clone() for k, v in fresh.module.state_dict().items()}
            stored = weights if tier == "local" else stored
            if tier == "s3":
                assert all(torch.equal(weights[k], v) for k, v in stored.items())
            fresh.destroy()
    return times


def report_levels(levels: dict, rows: list[dict]) -> list[str]:
    base = next((r for r in rows if r["method"] == "deepspeed"), None)
    snap, ram, local = (1e3 * levels[k] for k in ("snapshot", "ram", "local"))
    lines = [f"two levels: RAM snapshot (whole state) blocks {snap:.1f} ms"]
    if base is not None:
        own = 1e3 * statistics.median(base["blocked"][1:])
        lines[0] += f"; DeepSpeed's save_checkpoint {own:.1f} ms: {snap / own:.3f}x " \
                    "(goal <= 0.25x)"
    lines.append(f"restore of a restarted worker: from RAM {ram:.1f} ms, from storage "
                 f"(local folder, warm) {local:.1f} ms: RAM / local {ram / local:.3f}x "
                 f"(goal <= 1x)")
    lines.append(report_line(levels["ram"], levels.get("s3"), levels["s3_why"]))
    return lines


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_method(args: argparse.Namespace, method: str, root: Path) -> dict:
    import moepec.integrations.deepspeed as door

    engine = _engine(args, method)
    vocab = args.vocab if args.model == "mixtral" else None
    save_dir = root / method
    blocked, step_s = [], []
    for _ in range(args.checkpoints):
        step_s.append(_train(engine, args.steps, vocab))
        started = time.perf_counter()
        engine.save_checkpoint(str(save_dir))
        blocked.append(time.perf_counter() - started)
    _train(engine, 1, vocab)  # the decoupled engine commits at the next step
    if method.startswith("moepec"):
        door.wait()
    cleanup = getattr(engine.checkpoint_engine, "cleanup", None)
    if method == "decoupled" and cleanup is not None:
        cleanup()
    tags = sorted((p for p in save_dir.iterdir() if p.is_dir()),
                  key=lambda p: int(p.name.removeprefix("global_step")))
    sizes = [_bytes(t) for t in tags]
    return {"method": method, "blocked": blocked, "bytes": sizes,
            "step_s": statistics.median(step_s), "share": expert_share(engine.module)}


def _setup(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533",
                 # what DeepSpeed's launcher sets and its decoupled writer reads
                 "LOCAL_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    torch.set_num_threads(args.threads)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def report(rows: list[dict], args: argparse.Namespace) -> list[str]:
    base = next((r for r in rows if r["method"] == "deepspeed"), rows[0])
    b_blocked = statistics.median(base["blocked"][1:])
    b_bytes = statistics.median(base["bytes"][1:])
    model = "DeepSpeed MoE" if args.model == "native" else \
        f"transformers Mixtral (vocabulary {args.vocab})"
    lines = [f"{model}: {args.layers} MoE layers x {args.experts} experts, hidden "
             f"{args.hidden}, ffn {args.ffn}, experts {100 * base['share']:.1f}% of the "
             f"parameters, ZeRO-{args.stage}, fp32 Adam; K={args.k}; "
             f"{args.checkpoints} saves, {args.steps} steps apart; medians over saves 2..",
             f"{'method':<12} {'MB/save':>8} {'x bytes':>8} {'first MB':>9} "
             f"{'blocked ms':>11} {'x blocked':>10} {'step ms':>8}"]
    for r in rows:
        blocked = statistics.median(r["blocked"][1:])
        size = statistics.median(r["bytes"][1:])
        lines.append(f"{r['method']:<12} {size / 1e6:>8.2f} {size / b_bytes:>8.3f} "
                     f"{r['bytes'][0] / 1e6:>9.2f} {1e3 * blocked:>11.1f} "
                     f"{blocked / b_blocked:>10.3f} {1e3 * r['step_s']:>8.1f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = _parse(list(argv or []))
    args.s3, args.s3_why = choose(args.s3)
    if args.stage == 3 and args.model == "native":
        raise SystemExit("moepec bench deepspeed: DeepSpeed's MoE layers refuse ZeRO-3; "
                         "use --model mixtral --stage 3")
    _setup(args)
    root = Path(tempfile.mkdtemp(prefix="moepec-bench-deepspeed-"))
    rows = []
    try:
        for method in args.methods:
            try:
                rows.append(run_method(args, method, root))
            except Exception as exc:  # a DeepSpeed writer that does not start here
                print(f"{method}: did not run ({type(exc).__name__}: {exc})"[:300])
        print("\n".join(report(rows, args)))
        if args.two_level:
            print("\n".join(report_levels(two_level(args, root), rows)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
