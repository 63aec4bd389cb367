"""``moepec ram ls|clean``: see and free what the shared-memory RAM tier left behind.

A clean ``CheckpointManager.close()`` removes its slots; a crashed run's stay until its
restarted workers reuse them or this command removes them. Only RAM-tier job folders
(:func:`moepec.ram.jobs.is_job_folder`) are listed or removed: anything else under
``--ram-dir`` (a checkpoint root given by mistake, a home folder) is left alone, and
``clean`` of a folder holding only such things says so and exits 1. ``commands()``
returns the subcommand for ``moepec.cli.main`` to register (nothing happens at import).
"""

from __future__ import annotations

import argparse
import json
import sys

from moepec.ram.jobs import DEFAULT_DIR, list_jobs, looks_like, remove_job, scan


def _add_ram(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("ls", "clean"),
                   help="ls: list the RAM tier's folders; clean: remove them")
    p.add_argument("--ram-dir", default=DEFAULT_DIR,
                   help="the shared-memory folder of the RAM tier (%(default)s)")
    p.add_argument("--run", default=None, metavar="ID",
                   help="only the folder of this name, or holding slots of this run id")
    p.add_argument("--older-than", type=float, default=None, metavar="H",
                   help="only folders not written for H hours")
    p.add_argument("--force", action="store_true",
                   help="clean also folders whose writing process still runs")
    p.add_argument("--json", action="store_true", help="print JSON")


def _run_ram(args: argparse.Namespace) -> int:
    jobs, others = scan(args.ram_dir)
    if not jobs and others:  # the wrong folder: never list or remove what is not ours
        print(f"{args.ram_dir} holds no RAM-tier job folders ({looks_like(others)}); "
              f"nothing {'removed' if args.action == 'clean' else 'listed'}",
              file=sys.stderr if args.json else sys.stdout)
        if args.json:
            print("[]")
        return 1 if args.action == "clean" else 0
    rows = [r for r in list_jobs(args.ram_dir)
            if (args.run is None or args.run == r["job"] or args.run in r["runs"])
            and (args.older_than is None or r["age_h"] >= args.older_than)]
    if args.action == "clean":
        for r in rows:
            r["removed"] = not r["live"] or args.force
            if r["removed"]:
                remove_job(args.ram_dir, r["job"])
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"nothing under {args.ram_dir}" + (" matches" if args.run or args.older_than
                                                  else ""))
        return 0
    for r in rows:
        # A clean close removes its slots: what stays was left by a run that crashed, was
        # killed or is between a worker's death and its restart.
        state = ("removed" if r.get("removed") else "kept: its writer still runs (--force)"
                 if "removed" in r else "live" if r["live"]
                 else "no process: left by a run that crashed or was killed")
        print(f"{r['job']}  {r['bytes'] / 2**20:8.1f} MiB  {r['age_h']:6.1f} h  "
              f"step {r['newest_step']}  runs {','.join(r['runs']) or '-'}  "
              f"root {r['root'] or '?'}  ({state})")
    if args.action == "clean":
        freed = sum(r["bytes"] for r in rows if r["removed"])
        print(f"freed {freed / 2**20:.1f} MiB")
    if others:
        print(f"left alone: {len(others)} other entr{'y' if len(others) == 1 else 'ies'} of "
              f"{args.ram_dir} that {'is' if len(others) == 1 else 'are'} not RAM-tier job "
              f"folders")
    return 0


def commands():
    """(name, help, add_arguments, run) of the RAM tier's subcommand."""
    return [("ram", "list or remove shared-memory RAM snapshots that runs left (ls, clean)",
             _add_ram, _run_ram)]
