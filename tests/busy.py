"""Run a command beside CPU-bound busy processes: the suite on a busy machine (issue 35.4).

    python tests/busy.py                  # python -m pytest -q -ra, beside 2 busy loops
    python tests/busy.py -- python -m pytest -q tests/test_fencing.py
    python tests/busy.py --busy 3 -- CMD...

The busy processes are ``while True`` loops of this Python (one core each at full load).
They are stopped when the command ends, and also when this script is interrupted or
killed: SIGTERM, SIGINT and SIGHUP are passed on to the command and end the script; each
loop also ends on its own once this script is gone (it watches its parent), so not even
a SIGKILL of this script leaves one behind. Exits with the command's status (128 + the
signal's number when a signal ended it).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

BUSY_LOOP = ("import os\n"
             "parent = os.getppid()\n"
             "while os.getppid() == parent:  # ends once busy.py is gone, even SIGKILLed\n"
             "    for _ in range(200_000):\n"
             "        pass\n")
"""One busy process: pure CPU work, checking every few milliseconds that its parent lives."""


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes, each in its own session (a ^C at the terminal is this
    script's to handle, not theirs)."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True,
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def stop(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM each process still running, then SIGKILL what is left after ``grace_s``;
    reaps them all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Passed on to the command; each also ends this script."""


class Interrupted(Exception):
    """This script got a signal; it was passed on to the command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run(cmd: Sequence[str], n_busy: int) -> int:
    """Run ``cmd`` beside ``n_busy`` busy processes; its exit status (128 + signal number
    when a signal ended it or this script)."""
    busy: list[subprocess.Popen] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def on_signal(signum: int, frame: object) -> None:
        forward(signum, frame)
        raise Interrupted(signum)

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    t0 = time.monotonic()
    try:
        busy = start_busy(n_busy)
        print(f"busy.py: {n_busy} busy process(es) (pids {[p.pid for p in busy]}) beside: "
              f"{' '.join(cmd)}", flush=True)
        # Its own process group: a ^C at the terminal reaches it once, through forward().
        child = subprocess.Popen(cmd, process_group=0)
        code = child.wait()
    except Interrupted as exc:
        code = -exc.signum
    finally:
        for sig in SIGNALS:  # cleaning up: a second signal is passed on, nothing more
            signal.signal(sig, forward)
        stop(busy)
        if child is not None and child.poll() is None:  # interrupted: it had the signal
            try:
                code = child.wait(30)
            except subprocess.TimeoutExpired:
                stop([child])
    status = 128 - code if code < 0 else code
    print(f"busy.py: done in {time.monotonic() - t0:.0f} s, exit status {status}", flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="busy processes (default 2)")
    parser.add_argument("cmd", nargs="*", help="the command, after -- (default: "
                        "python -m pytest -q -ra)")
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error("--busy must be 0 or more")
    cmd = args.cmd or [sys.executable, "-m", "pytest", "-q", "-ra"]
    return run(cmd, args.busy)


if __name__ == "__main__":
    sys.exit(main())
