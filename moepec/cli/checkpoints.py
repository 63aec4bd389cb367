"""Subcommands over checkpoints and benchmarks: inspect, verify, export, bench.

``commands()`` returns them for ``moepec.cli.main`` to register (nothing happens at import).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, is_dataclass

from tqdm import tqdm

from moepec.errors import ConfigError, NoCheckpointError

BENCHES = {
    "size": "checkpoint bytes per K, beside the paper's 54.2% smaller",
    "sharding": "checkpoint work per rank, beside the paper's 76.9% less",
    "overhead": "the loop's blocking per checkpoint against dcp.save and dcp.async_save",
    "restore": "stitched restore against dcp.load of one full checkpoint",
    "ram-restore": "restore from the shared-memory RAM tier against storage (--s3: S3 too)",
    "report": "size, sharding, overhead, model quality and PLT into docs/results.md",
    "gpu": "GPU calibration for `moepec simulate --calibration` (one line without CUDA)",
    "validate": "the simulator against a real faulty run on this machine",
    "ft": "a fault with replica groups on torchft against restart-all",
    "megatron": "the Megatron-Core backend against torch_dist async (source checkout)",
    "torchtitan": "moepec against torchtitan's own checkpointer in its Trainer (source "
                  "checkout)",
    "deepspeed": "the DeepSpeed door against DeepSpeed's own checkpoint engines",
    "stop": "a planned stop (SIGTERM to torchrun) and its resume: seconds, bytes, nothing "
            "lost",
}
"""``moepec bench NAME``: module ``moepec.bench.<NAME with - as _>`` and what it measures."""


def _storage_options(args: argparse.Namespace) -> dict:
    if not args.storage_options:
        return {}
    try:
        opts = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--storage-options must be a JSON object ({exc}), e.g. "
                          f'\'{{"client_kwargs": {{"endpoint_url": "http://host:9000"}}}}\'') \
            from exc
    if not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object")
    return opts


def _add_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint root: a directory or an fsspec URL (s3://...)")
    p.add_argument("--storage-options", default=None, metavar="JSON",
                   help="fsspec options as JSON (e.g. endpoint_url and keys for s3://)")


def _add_inspect(p: argparse.ArgumentParser) -> None:
    _add_path(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_inspect(args: argparse.Namespace) -> int:
    from moepec.recovery.offline_paths import RootKind, root_kind

    opts = _storage_options(args)
    kind = root_kind(args.path, opts)
    if kind == RootKind.FLAT:
        from moepec.recovery.offline_flat import format_inspect_flat, inspect_flat

        info = inspect_flat(args.path)
        rows, text = info["checkpoints"], format_inspect_flat
    elif kind == RootKind.GROUPS:
        from moepec.recovery.offline_groups import format_inspect_groups, inspect_groups

        info = inspect_groups(args.path, opts)
        rows = [r for sub in info["groups"].values() for r in sub["checkpoints"]]
        text = format_inspect_groups
    else:
        info, rows, text = _inspect_manager(args.path, opts)
    if args.json:
        print(json.dumps(_jsonable(info), indent=1))
    elif rows:
        print(text(info))
    return _nothing_committed(args.path, rows)


def _inspect_manager(path: str, opts: dict):
    from moepec.recovery.offline import format_inspect, inspect_path
    from moepec.recovery.records import read_recoveries
    from moepec.store.storage import Storage

    info = inspect_path(path, opts)
    info["recoveries"] = read_recoveries(Storage(path, opts))

    def text(info: dict) -> str:
        lines = [format_inspect(info)]
        if info["recoveries"]:
            lines.append(f"\n{len(info['recoveries'])} recovery(ies):")
        for r in info["recoveries"]:
            lines.append(f"  step {r['step']:>7} from {r['checkpoint']} ({r['tier']}), "
                         f"{r['seconds']:.2f}s, lost {sum(map(sum, r['lost']))} token "
                         f"assignments, PLT {100 * r['plt']:.3f}%, K_persist {r['k_persist']}")
        return "\n".join(lines)

    return info, info["checkpoints"], text


def _jsonable(x):
    """``x`` with its dataclasses (checkpoint rows, the whole striped checkpoint) as dicts."""
    if is_dataclass(x) and not isinstance(x, type):
        return asdict(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _nothing_committed(path: str, rows) -> int:
    """0 when some checkpoint is committed (intact or damaged); otherwise raises the one-line
    NoCheckpointError (``moepec`` exits 2)."""
    from moepec.recovery.offline_paths import nothing_committed

    if any(r.committed or r.error for r in rows):
        return 0
    raise NoCheckpointError(nothing_committed(path, [r.name for r in rows]))


def _add_verify(p: argparse.ArgumentParser) -> None:
    _add_path(p)


def _run_verify(args: argparse.Namespace) -> int:
    from moepec.recovery.offline import verify_path
    from moepec.recovery.offline_paths import RootKind, nothing_committed, root_kind

    opts = _storage_options(args)
    kind = root_kind(args.path, opts)
    if kind == RootKind.FLAT:  # a save directory of flat checkpoints (Megatron-Core)
        return _run_verify_flat(args.path)
    bar = tqdm(total=0, unit="item", desc="verifying", disable=not sys.stderr.isatty())

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    if kind == RootKind.GROUPS:  # every group root, and the newest whole striped one
        from moepec.recovery.offline_groups import verify_groups

        res = verify_groups(args.path, opts, progress)
    else:
        res = verify_path(args.path, opts, progress)
    bar.close()
    for msg in res.damaged_manifests:
        print(f"DAMAGED manifest: {msg}")
    for item in res.bad:
        print(f"BAD item (checksum or read failed): {item}")
    for view in res.broken_views:
        print(f"BROKEN view (cannot be restored): {view}")
    if res.views == 0 and not res.damaged_manifests:
        raise NoCheckpointError(nothing_committed(args.path, res.uncommitted))
    if res.uncommitted:
        print(f"{len(res.uncommitted)} uncommitted checkpoint(s) (ignored by restore): "
              + ", ".join(res.uncommitted))
    status = "OK" if res.ok else "FAILED"
    print(f"{status}: {res.checked} item(s) checked, {len(res.bad)} bad, "
          f"{len(res.damaged_manifests)} damaged manifest(s), {res.views} retained view(s) "
          f"checked, {len(res.broken_views)} broken")
    return 0 if res.ok else 1


def _run_verify_flat(path: str) -> int:
    """``moepec verify`` of a save directory with one folder per iteration: each folder's
    items, and which sibling folders each view still needs."""
    from moepec.recovery.flat_view import verify_root
    from moepec.recovery.offline_paths import nothing_committed

    res = verify_root(path)
    for line in res.lines():
        print(line)
    if not res.needs and not res.damaged:
        raise NoCheckpointError(nothing_committed(path, res.uncommitted))
    status = "OK" if res.ok else "FAILED"
    print(f"{status}: {res.checked} item(s) checked, {len(res.bad)} bad, "
          f"{len(res.damaged)} damaged manifest(s), {len(res.needs)} folder(s) checked, "
          f"{len(res.broken)} cannot be loaded")
    return 0 if res.ok else 1


def _add_export(p: argparse.ArgumentParser) -> None:
    _add_path(p)
    p.add_argument("out", help="output: a DCP directory, or a .safetensors file")
    p.add_argument("--format", choices=("dcp", "safetensors"), default=None,
                   help="default: safetensors if OUT ends in .safetensors, else dcp")
    p.add_argument("--fp32", action="store_true",
                   help="a DeepSpeed save at ZeRO-1/2/3: its fp32 master weights (what "
                        "zero_to_fp32.py gives, MoE included) instead of the module's")


def _run_export(args: argparse.Namespace) -> int:
    from moepec.recovery.offline import export_view
    from moepec.recovery.offline_paths import RootKind, root_kind

    if not args.out.strip():
        raise ConfigError("the output path is empty; name a new folder (DCP) or a "
                          ".safetensors file")
    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "dcp")
    opts = _storage_options(args)
    if root_kind(args.path, opts) == RootKind.FLAT:
        from moepec.recovery.offline_flat import export_flat

        if fmt == "safetensors" and _deepspeed_save(args.path):
            from moepec.integrations.ds_export import export_fp32, export_model

            tag, n = (export_fp32 if args.fp32 else export_model)(args.path, args.out)
            what = "fp32 master weights" if args.fp32 else "model"
            print(f"exported the {what} of {args.path} tag {tag} ({n} tensors, each expert "
                  f"from its newest copy) to {args.out}; `moepec materialize` writes "
                  f"DeepSpeed's own files, optimizer included")
            return 0
        if args.fp32:
            return _not_deepspeed(args.path)
        flat = export_flat(args.path, args.out, fmt)
        m = flat.view.manifest
        print(f"exported {flat.tensors} tensors of the view of {m.name} (step {m.step}) of "
              f"{args.path} to {args.out} ({fmt}): {flat.whole} whole, {flat.shards} "
              f"shard(s) under their flat key, {flat.objects} object(s) as bytes")
        return 0
    if args.fp32:
        return _not_deepspeed(args.path)
    report = export_view(args.path, args.out, fmt, opts)
    view = report.view.manifest
    print(f"exported {report.tensors} tensors of the view of {view.name} (step {view.step}) "
          f"of {args.path} to {args.out} ({fmt})")
    for line in report.notes():
        print(f"WARNING: {line}")
    return 0


def _not_deepspeed(path: str) -> int:
    print(f"moepec: --fp32 exports a DeepSpeed save directory written through moepec (to "
          f"a .safetensors file); {path} is not one", file=sys.stderr)
    return 2


def _deepspeed_save(path: str) -> bool:
    try:
        from moepec.integrations.ds_export import is_deepspeed_save
    except ImportError:  # DeepSpeed is not installed: a plain flat save directory
        return False
    return is_deepspeed_save(path)


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "benchmarks:\n" + "\n".join(f"  {n:<12} {h}" for n, h in BENCHES.items())
    p.add_argument("name", choices=list(BENCHES), metavar="NAME",
                   help="which benchmark (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"moepec.bench.{args.name.replace('-', '_')}")
    module.main(args.args)
    return 0


def commands():
    """(name, help, add_arguments, run) of each subcommand here."""
    return [
        ("inspect", "table of checkpoints, their experts, bytes, PLT and the view's age",
         _add_inspect, _run_inspect),
        ("verify", "read every committed item and check its checksum (exit 1 if bad)",
         _add_verify, _run_verify),
        ("export", "write the newest view as one plain DCP checkpoint or safetensors file",
         _add_export, _run_export),
        ("bench", "run a benchmark (its baseline in the same run): " + ", ".join(BENCHES),
         _add_bench, _run_bench),
    ]
