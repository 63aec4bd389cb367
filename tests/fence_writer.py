"""Child process for the fencing tests: trains the toy model into a checkpoint root until
a condition holds, then reports. Usage:
    fence_writer.py PATH STOP TAKEOVER(0|1) OUT [STORAGE_OPTIONS_JSON]
Prints "ready" once it committed a checkpoint. The new holder (TAKEOVER=1) stops once it
committed COMMITS checkpoints of its own; the old writer (TAKEOVER=0) stops once the file
STOP exists and it learnt it was fenced, then AFTER more checkpoints on. Each condition
has a deadline (DEADLINE_S, generous for a busy machine): past it the writer stops and
its report says what did not happen. OUT receives (torch.save, plain tensors) the state
of this run's newest committed step and a small JSON report beside it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moepec import CheckpointConfig, CheckpointManager, PersistError  # noqa: E402
from tests.toy import Counter, full_state, make, train_step  # noqa: E402

COMMITS = 5
"""Checkpoints the new holder commits before it stops."""
AFTER = 3
"""Checkpoints the old writer starts after it learnt it was fenced and was told to stop."""
DEADLINE_S = 600.0
"""How long a writer waits for its condition (its commits; the stop file; its fencing).
Generous: beside two busy loops and other work, a writer here once took 120 s for 6
commits (load average 8 on 2 cores); an idle run meets its conditions in seconds."""


def main() -> None:
    path, stop, takeover, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1", \
        sys.argv[4]
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=path, interval=3, k_persist=1, keep_last=2,
                           takeover=takeover, storage_options=options, ram_dir=None)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    report = mgr.restore()
    start = report.step + 1 if report else 0
    gen = torch.Generator().manual_seed(1 + takeover)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    errors, step, ready = [], start, False
    committed: set[str] = set()  # this run's commits seen (retention deletes the older)
    told = False  # the old writer saw the stop file
    after = -1  # checkpoints started since the old writer was told to stop and fenced
    # The old writer waits for the new holder's whole run before it is told to stop.
    deadline = time.monotonic() + DEADLINE_S * (1 if takeover else 2)
    timed_out = True
    while time.monotonic() < deadline:
        _, counts = train_step(model, opt, sched, gen)
        mgr.wait_for_snapshot()
        opt.step()
        sched.step()
        counter.position += 1
        mgr.observe_routing(counts)
        try:
            if mgr.step(step):
                saved[step] = full_state(model, opt)
                for old in [s for s in saved if s < step - 60]:
                    del saved[old]
                after += after >= 0
        except PersistError as exc:
            errors.append(str(exc))
        if mgr.last_committed is not None and mgr.last_committed.endswith("-" + mgr._run_id):
            committed.add(mgr.last_committed)
        if not ready and committed:
            print("ready", flush=True)
            ready = True
        step += 1
        if takeover and len(committed) >= COMMITS:
            timed_out = False
            break
        if not takeover and not told and stop.exists():
            told = True
            deadline = time.monotonic() + DEADLINE_S  # from now: until it learns of its fencing
        if told and after < 0 and mgr.fenced is not None:
            after = 0
        if after >= AFTER:
            timed_out = False
            break
        time.sleep(0.1)  # a training step of some length: checkpoints are not back to back
    try:
        mgr.close()
    except PersistError as exc:
        errors.append(str(exc))
    mine = [n for n in mgr._storage.committed() if n.endswith("-" + mgr._run_id)]
    newest = mine[-1] if mine else None
    newest_step = int(newest.split("-step")[1][:8]) if newest else -1
    torch.save(saved.get(newest_step, {}), out)
    with open(out + ".json", "w") as f:
        json.dump({"run_id": mgr._run_id, "fenced": mgr.fenced, "errors": errors,
                   "timed_out": timed_out, "told": told, "commits_seen": len(committed),
                   "newest": newest, "newest_step": newest_step,
                   "records": [[r.name, r.committed] for r in mgr._persister.records]}, f)
    print("done", flush=True)


if __name__ == "__main__":
    main()
