"""A check for one suspect of the torchtitan crash (docs/testing.md): pybind11's instance
registration racing between threads (pybind11 issue 5473).

A pybind11 constructor bound as a factory with the interpreter lock released (in c10d:
``ProcessGroupGloo(store, rank, size, timeout)``, ``Backend.Options``, ``TCPStore``)
registers the new object in pybind11's global instance map without that lock, while any
other thread may be creating or dropping pybind11 objects with it (every collective makes
an options object and a ``Work``). Were that a race in the installed torch, the map, made
of small heap blocks, would be corrupted as in the crash. This script races the two for
``--seconds`` in each pairing and prints how many of each it made; a crash or an
"unregistered instance" abort means the race is real here.

    python tests/pybind_race.py [--seconds 60]
"""

import argparse
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, Backend, HashStore, ProcessGroupGloo


def race(build, seconds: float) -> tuple[int, int]:
    """``build()`` in one thread, pybind11 options objects made and dropped in another,
    for ``seconds``; returns how many of each were made."""
    stop = time.monotonic() + seconds
    made = [0, 0]

    def builder() -> None:
        while time.monotonic() < stop:
            build(made[0])
            made[0] += 1

    def churner() -> None:
        while time.monotonic() < stop:
            batch = [AllreduceOptions() for _ in range(50)]
            del batch
            made[1] += 50

    threads = [threading.Thread(target=builder), threading.Thread(target=churner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made[0], made[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per pairing")
    args = parser.parse_args()
    timeout = timedelta(seconds=5)
    builds = {
        "ProcessGroupGloo": lambda i: ProcessGroupGloo(
            dist.PrefixStore(f"g{i}/", HashStore()), 0, 1, timeout),
        "Backend.Options": lambda i: Backend.Options("gloo", timeout),
    }
    for name, build in builds.items():
        built, churned = race(build, args.seconds)
        print(f"{name}: {built} built beside {churned} pybind11 objects made and dropped; "
              f"no crash")


if __name__ == "__main__":
    main()
