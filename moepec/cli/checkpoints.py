"""Subcommands over checkpoints and benchmarks: inspect, verify, export, bench.

``commands()`` returns them for ``moepec.cli.main`` to register (nothing happens at import).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tqdm import tqdm

from moepec.errors import ConfigError

BENCHES = ("size", "overhead", "sharding", "restore", "report", "gpu", "validate", "ft")


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
    from moepec.recovery.offline import format_inspect, inspect_path
    from moepec.recovery.records import read_recoveries
    from moepec.store.storage import Storage

    opts = _storage_options(args)
    info = inspect_path(args.path, opts)
    recoveries = read_recoveries(Storage(args.path, opts))
    if args.json:
        out = dict(info, checkpoints=[asdict(r) for r in info["checkpoints"]],
                   recoveries=recoveries)
        print(json.dumps(out, indent=1))
        return 0
    print(format_inspect(info))
    if recoveries:
        print(f"\n{len(recoveries)} recovery(ies):")
        for r in recoveries:
            print(f"  step {r['step']:>7} from {r['checkpoint']} ({r['tier']}), "
                  f"{r['seconds']:.2f}s, lost {sum(map(sum, r['lost']))} token assignments, "
                  f"PLT {100 * r['plt']:.3f}%, K_persist {r['k_persist']}")
    return 0


def _add_verify(p: argparse.ArgumentParser) -> None:
    _add_path(p)


def _run_verify(args: argparse.Namespace) -> int:
    from moepec.recovery.offline import verify_path
    from moepec.store.flat import is_flat_root

    if is_flat_root(args.path):  # a save directory of flat checkpoints (Megatron-Core)
        return _run_verify_flat(args.path)
    bar = tqdm(total=0, unit="item", desc="verifying", disable=not sys.stderr.isatty())

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    res = verify_path(args.path, _storage_options(args), progress)
    bar.close()
    for msg in res.damaged_manifests:
        print(f"DAMAGED manifest: {msg}")
    for item in res.bad:
        print(f"BAD item (checksum or read failed): {item}")
    for view in res.broken_views:
        print(f"BROKEN view (cannot be restored): {view}")
    if res.views == 0 and not res.damaged_manifests:
        print(f"no committed checkpoint under {args.path}")
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

    res = verify_root(path)
    for line in res.lines():
        print(line)
    if not res.needs and not res.damaged:
        print(f"no committed checkpoint under {path}")
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


def _run_export(args: argparse.Namespace) -> int:
    from moepec.recovery.offline import export_view

    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "dcp")
    report = export_view(args.path, args.out, fmt, _storage_options(args))
    view = report.view.manifest
    print(f"exported {report.tensors} tensors of the view of {view.name} (step {view.step}) "
          f"of {args.path} to {args.out} ({fmt})")
    for line in report.notes():
        print(f"WARNING: {line}")
    return 0


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=BENCHES, help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"moepec.bench.{args.name}")
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
        ("bench", "run a benchmark: size, overhead, sharding, restore, report, gpu, validate, ft",
         _add_bench, _run_bench),
    ]
