"""Child process for the fencing tests: trains the toy model into a checkpoint root for a
number of seconds, then reports. Usage:
    fence_writer.py PATH SECONDS TAKEOVER(0|1) OUT [STORAGE_OPTIONS_JSON]
Prints "ready" once it committed a checkpoint. OUT receives (torch.save, plain tensors) the
state of this run's newest committed step and a small JSON report beside it."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moepec import CheckpointConfig, CheckpointManager, PersistError  # noqa: E402
from tests.toy import Counter, full_state, make, train_step  # noqa: E402


def main() -> None:
    path, seconds, takeover, out = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", \
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
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
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
        except PersistError as exc:
            errors.append(str(exc))
        if not ready and mgr.storage.committed():
            print("ready", flush=True)
            ready = True
        step += 1
        time.sleep(0.01)  # a training step of some length: checkpoints are not back to back
    try:
        mgr.close()
    except PersistError as exc:
        errors.append(str(exc))
    mine = [n for n in mgr.storage.committed() if n.endswith("-" + mgr.run_id)]
    newest = mine[-1] if mine else None
    newest_step = int(newest.split("-step")[1][:8]) if newest else -1
    torch.save(saved.get(newest_step, {}), out)
    with open(out + ".json", "w") as f:
        json.dump({"run_id": mgr.run_id, "fenced": mgr.fenced, "errors": errors,
                   "newest": newest, "newest_step": newest_step,
                   "records": [[r.name, r.committed] for r in mgr.persister.records]}, f)
    print("done", flush=True)


if __name__ == "__main__":
    main()
