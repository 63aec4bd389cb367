"""Hunt the rare crash of torchtitan's FSDP life (docs/testing.md, "The torchtitan crash").

    python tests/titan_hunt.py                      # 40 lives, 2 at a time, each on one core
    python tests/titan_hunt.py --lives 100 --steps 80 --freecheck
    python tests/titan_hunt.py --no-pin --parallel 1

Each life is the test's torchtitan life (tests/titan_assets.py: FSDP over 2 gloo ranks,
moepec's K=1 asynchronous checkpoint and a full state dump every step) run for ``--steps``
steps, with core dumps on (``core`` files in the life's folder, where the kernel's
``core_pattern`` is a plain name). With ``--pin``, the default, both ranks of a life share
one core, life ``i`` of ``--parallel`` on core ``i``: the setting of the one crash seen
here. ``--freecheck`` preloads tests/freecheck.c (built with ``cc``), which reports a write
into a freed small heap block with the stack of its free().

A life that ends well is deleted; one that crashed, or whose freecheck reported, is kept
under ``--out`` and named in the summary. Exits 1 if any life crashed or reported, else 0.
Stops early, keeping what it found, at the first finding with ``--stop-at-first``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from titan_assets import OVERRIDE, life_command, write_assets  # noqa: E402

CRASH = re.compile(r"\((SIGSEGV|SIGBUS|SIGABRT|SIGFPE|SIGILL)\)|malloc\(\)|free\(\)|corrupt")
REPORT = "write after free"
RUNNING: set[subprocess.Popen] = set()
"""The lives running now (each torchrun in a session of its own, with its ranks)."""


def build_freecheck(folder: Path) -> Path:
    """tests/freecheck.c built as a shared library in ``folder``."""
    out = folder / "freecheck.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("titan_hunt: --freecheck needs a C compiler (cc or gcc) on PATH")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(TESTS / "freecheck.c")],
                   check=True)
    return out


def one_life(folder: Path, assets: tuple[str, str], steps: int, core: int | None,
             preload: Path | None, timeout_s: float) -> tuple[str, float]:
    """Runs one life in ``folder``; returns its verdict ("ok", "crash: ...", "freecheck:
    N report(s)", "timeout") and its seconds. Keeps the folder unless the verdict is ok."""
    folder.mkdir(parents=True)
    (folder / "dump").mkdir()
    cmd, env = life_command(folder, assets, 2, steps, OVERRIDE)
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)

    def setup() -> None:  # in the child, before torchrun: inherited by both ranks
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)
        if core is not None:
            os.sched_setaffinity(0, {core})

    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=setup,
                            start_new_session=True)
    RUNNING.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:  # torchrun and both ranks: the whole session
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        rc = None
    finally:
        RUNNING.discard(proc)
    seconds = time.monotonic() - start
    (folder / "stdout.txt").write_text(stdout)
    (folder / "stderr.txt").write_text(stderr)
    cores = list(folder.glob("core*"))
    crash = CRASH.search(stderr)
    if rc is None:
        verdict = "timeout"
    elif crash or cores or rc != 0:
        what = crash.group(0) if crash else f"rc {rc}"
        verdict = f"crash: {what}" + (f", {len(cores)} core file(s)" if cores else "")
    elif REPORT in stderr:
        verdict = f"freecheck: {stderr.count(REPORT)} report(s)"
    elif preload is not None:
        checked = stderr.count("freecheck pid")  # torchrun's agent and both ranks
        verdict = f"ok, freecheck clean in {checked} processes" if checked else \
            "freecheck did not run (no exit line)"
    else:
        verdict = "ok"
    if verdict.startswith("ok"):
        shutil.rmtree(folder)
    return verdict, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lives", type=int, default=40, help="lives in all (default 40)")
    p.add_argument("--steps", type=int, default=80, help="training steps a life (default 80)")
    p.add_argument("--parallel", type=int, default=2, help="lives at a time (default 2)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="both ranks of a life on one core (default on)")
    p.add_argument("--freecheck", action="store_true",
                   help="preload tests/freecheck.c (writes after free)")
    p.add_argument("--out", type=Path, default=None,
                   help="where kept lives go (default: a new folder under /tmp)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a life (default 1800)")
    p.add_argument("--stop-at-first", action="store_true", help="stop at the first finding")
    args = p.parse_args(argv)
    if args.lives < 1 or args.parallel < 1 or args.steps < 1:
        p.error("--lives, --parallel and --steps must be at least 1")
    cores = sorted(os.sched_getaffinity(0))
    out = args.out or Path(tempfile.mkdtemp(prefix="titan-hunt-"))
    out.mkdir(parents=True, exist_ok=True)
    assets = write_assets(str(out / "assets"))
    preload = build_freecheck(out) if args.freecheck else None
    print(f"titan_hunt: {args.lives} lives of {args.steps} steps, {args.parallel} at a time"
          f"{', pinned' if args.pin else ''}{', freecheck' if preload else ''}; kept in {out}",
          flush=True)

    lock = threading.Lock()
    todo = iter(range(1, args.lives + 1))
    found: list[str] = []
    done = [0]
    stop = threading.Event()

    def loop(slot: int) -> None:
        core = cores[slot % len(cores)] if args.pin else None
        while not stop.is_set():
            with lock:
                n = next(todo, None)
            if n is None:
                return
            folder = out / f"life-{n:04d}"
            verdict, seconds = one_life(folder, assets, args.steps, core, preload, args.timeout)
            with lock:
                done[0] += 1
                print(f"[{done[0]}/{args.lives}] life {n}: {verdict} ({seconds:.0f} s)",
                      flush=True)
                if not verdict.startswith("ok"):
                    found.append(f"{folder}: {verdict}")
                    if args.stop_at_first:
                        stop.set()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.parallel)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)  # the main thread stays free for ^C and SIGTERM
    finally:  # interrupted: no life goes on without its hunt
        stop.set()
        for proc in list(RUNNING):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"titan_hunt: {done[0]} lives, {len(found)} finding(s)")
    for line in found:
        print(f"  {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
