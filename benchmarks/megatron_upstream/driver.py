"""Run Megatron-Core's dist_checkpointing unit tests under torchrun (gloo, CPU) with the
stock ``torch_dist`` backend and with moepec's ``("moepec", 1)``, and compare.

    python benchmarks/megatron_upstream/driver.py --megatron /tmp/megatron-lm \\
        [--nproc 4] [--timeout 180] [--backends torch_dist,moepec] [--out DIR] \\
        [-k EXPR] [FILE ...]

FILE: test files relative to the Megatron-LM root (default: the serialization, async
save, fully parallel and MoE experts tests). Each (backend, file) is one torchrun of
pytest with ``-p mcore_cpu_plugin``; a test that hangs is stopped by pytest-timeout
(thread method: that rank exits, torchrun stops the others) and the run resumes after
it, so one hang costs one test. Writes DIR/summary.json and DIR/summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_FILES = [
    "tests/unit_tests/dist_checkpointing/test_async_save.py",
    "tests/unit_tests/dist_checkpointing/test_fully_parallel.py",
    "tests/unit_tests/dist_checkpointing/test_serialization.py",
    "tests/unit_tests/dist_checkpointing/models/test_moe_experts.py",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_records(results: Path) -> tuple[dict, dict]:
    """finished[nodeid][rank] = record (the last one), started[nodeid] = ranks."""
    finished: dict = defaultdict(dict)
    started: dict = defaultdict(set)
    for f in results.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if rec["event"] == "start":
                started[rec["nodeid"]].add(rec["rank"])
            else:
                finished[rec["nodeid"]][rec["rank"]] = rec
    return finished, started


def run_file(args, backend: str, test_file: str, out: Path) -> dict:
    results = out / backend / Path(test_file).stem
    shutil.rmtree(results, ignore_errors=True)  # a fresh run: no records of an earlier one
    results.mkdir(parents=True, exist_ok=True)
    deselect = results / "deselect.txt"
    hung: dict[str, str] = {}
    log = open(results / "pytest.log", "a")
    for attempt in range(args.max_attempts):
        finished, _ = read_records(results)
        done = set(hung) | {n for n, r in finished.items() if len(r) == args.nproc}
        deselect.write_text("\n".join(sorted(done)))
        env = dict(os.environ, MCORE_BACKEND=backend, MCORE_RESULTS_DIR=str(results),
                   MCORE_DESELECT=str(deselect), MCORE_PG_TIMEOUT_S=str(args.timeout),
                   PYTHONPATH=os.pathsep.join(
                       [str(HERE), str(args.megatron), str(REPO),
                        os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(args.nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "pytest", "-p", "mcore_cpu_plugin",
               "-p", "no:cacheprovider", "--rootdir", str(args.megatron), "-q", "-rN",
               "--timeout", str(args.timeout), "--timeout-method", "thread", test_file]
        if args.k:
            cmd += ["-k", args.k]
        log.write(f"\n=== attempt {attempt}: {' '.join(cmd)}\n")
        log.flush()
        t0 = time.time()
        rc = subprocess.run(cmd, cwd=args.megatron, env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
        finished, started = read_records(results)
        unfinished = [n for n, ranks in started.items()
                      if n not in done and len(finished.get(n, {})) < args.nproc]
        print(f"  [{backend}] {test_file} attempt {attempt}: rc={rc} "
              f"{time.time() - t0:.0f}s, {len(finished)} finished, "
              f"unfinished={unfinished}", flush=True)
        if rc in (0, 1, 5) and not unfinished:
            break  # pytest ran to the end (1: some tests failed)
        if not unfinished:
            hung["<session>"] = f"pytest exited {rc} outside a test (see pytest.log)"
            break
        for n in unfinished:
            hung[n] = (f"timeout/crash: no result on ranks "
                       f"{sorted(set(range(args.nproc)) - set(finished.get(n, {})))}"
                       f" (pytest-timeout {args.timeout}s or a rank died)")
    log.close()
    finished, _ = read_records(results)
    out_tests = {}
    for nodeid, ranks in finished.items():
        if nodeid in hung:
            continue
        recs = [ranks[r] for r in sorted(ranks)]
        failed = [r for r in recs if r["outcome"] not in ("passed", "skipped")]
        if len(recs) < args.nproc:
            outcome, error = "failed", "timeout/crash: not all ranks reported"
        elif failed:
            outcome, error = "failed", failed[0]["error"]
        elif all(r["outcome"] == "skipped" for r in recs):
            outcome, error = "skipped", recs[0]["error"]
        elif any(r["outcome"] == "skipped" for r in recs):
            outcome, error = "skipped", "skipped on some ranks"
        else:
            outcome, error = "passed", None
        out_tests[nodeid] = {
            "outcome": outcome, "error": error,
            "saves": {b: max(r["saves"][b] for r in recs) for b in recs[0]["saves"]},
            "seconds": max(r["seconds"] for r in recs)}
    for nodeid, why in hung.items():
        if nodeid != "<session>":
            out_tests[nodeid] = {"outcome": "failed", "error": why, "saves": {},
                                 "seconds": args.timeout}
    return out_tests


def first_line(msg: str | None) -> str:
    line = (msg or "").strip().splitlines()[0] if (msg or "").strip() else "(no message)"
    return line[:300]


def cause_key(msg: str | None) -> str:
    """Group errors whose first lines differ only in numbers, paths and quoted names."""
    line = first_line(msg)
    line = re.sub(r"/[^\s'\"]+", "<path>", line)
    line = re.sub(r"'[^']*'", "'…'", line)
    return re.sub(r"\d+", "N", line)


def summarize(results: dict, backends: list[str]) -> tuple[dict, str]:
    stock, other = backends[0], backends[-1]
    summary: dict = {"files": {}}
    md = [f"# Megatron-Core dist_checkpointing tests: {stock} vs {other}", ""]
    md += [f"| file | collected | {stock} passed | {stock} skipped | {stock} failed "
           f"| {other} passed (of {stock} passed) | exercised {other} save |",
           "|---|---|---|---|---|---|---|"]
    causes: dict = defaultdict(list)
    stock_causes: dict = defaultdict(list)
    for f in results[stock]:
        s, o = results[stock][f], results.get(other, {}).get(f, {})
        sp = [n for n, r in s.items() if r["outcome"] == "passed"]
        op = [n for n in sp if o.get(n, {}).get("outcome") == "passed"]
        exercised = [n for n in sp if o.get(n, {}).get("saves", {}).get(other, 0) > 0]
        for n, r in s.items():
            if r["outcome"] == "failed":
                stock_causes[cause_key(r["error"])].append((n, first_line(r["error"])))
        for n in sp:
            if n in o and o[n]["outcome"] != "passed":
                causes[cause_key(o[n]["error"])].append((n, first_line(o[n]["error"])))
            elif n not in o:
                causes["not run"].append((n, "not run"))
        row = {"collected": len(s), f"{stock}_passed": len(sp),
               f"{stock}_skipped": sum(r["outcome"] == "skipped" for r in s.values()),
               f"{stock}_failed": sum(r["outcome"] == "failed" for r in s.values()),
               f"{other}_passed_of_{stock}_passed": len(op),
               f"{other}_save_exercised": len(exercised),
               f"{other}_save_exercised_and_passed": len(set(exercised) & set(op))}
        summary["files"][f] = row
        md.append(f"| {Path(f).name} | {row['collected']} | {len(sp)} | "
                  f"{row[f'{stock}_skipped']} | {row[f'{stock}_failed']} | {len(op)} | "
                  f"{len(exercised)} ({row[f'{other}_save_exercised_and_passed']} passed) |")

    def section(title, groups):
        md.extend(["", f"## {title}", ""])
        out = []
        for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            out.append({"cause": key, "count": len(items), "error": items[0][1],
                        "examples": [n for n, _ in items[:2]]})
            md.append(f"- **{len(items)}** × `{items[0][1]}`")
            for n, _ in items[:2]:
                md.append(f"  - `{n}`")
        return out

    summary[f"{other}_failures_of_{stock}_passed"] = section(
        f"{other} failures among tests passing with {stock}", causes)
    summary[f"{stock}_failures"] = section(f"{stock} failures on CPU/gloo (excluded)",
                                           stock_causes)
    return summary, "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron", type=Path, required=True,
                    help="root of an extracted Megatron-LM tree (its tests/ and "
                         "megatron/training, rl, post_training, legacy)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=180, help="per-test seconds")
    ap.add_argument("--max-attempts", type=int, default=12)
    ap.add_argument("--backends", default="torch_dist,moepec")
    ap.add_argument("--out", type=Path, default=Path("/tmp/megatron_upstream_results"))
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    args = ap.parse_args()
    if args.nproc > 4:
        raise SystemExit("at most 4 ranks on this machine")
    args.megatron = args.megatron.resolve()
    backends = args.backends.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {b: {} for b in backends}
    for f in args.files:
        for b in backends:
            print(f"{b}: {f}", flush=True)
            results[b][f] = run_file(args, b, f, args.out)
            (args.out / "raw.json").write_text(json.dumps(results, indent=1))
            summary, md = summarize(results, backends)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
            (args.out / "summary.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
