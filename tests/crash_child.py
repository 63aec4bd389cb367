"""Child process for crash tests: trains the toy model and SIGKILLs itself at a chosen
point of the N-th checkpoint's persist. Usage: crash_child.py PATH POINT N STEPS"""

from __future__ import annotations

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moepec import CheckpointConfig, CheckpointManager, FaultHooks  # noqa: E402
from tests.toy import Counter, make, run_loop  # noqa: E402


def main() -> None:
    path, point, nth, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    seen = {"n": 0}

    def hook(where: str, name: str) -> None:
        if where == point:
            seen["n"] += 1
            if seen["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    # Storage alone: these crashes test the commit rule (the RAM tier has tests of its own).
    cfg = CheckpointConfig(path=path, interval=2, k_persist=1, keep_last=2, ram_dir=None)
    manager = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter},
                                hooks=FaultHooks(on_persist=hook))
    run_loop(manager, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, steps)
    manager.close()


if __name__ == "__main__":
    main()
