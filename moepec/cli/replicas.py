"""Replica groups on the command line: ``moepec lighthouse`` and the ``--ft-*`` flags of
``moepec train`` (docs/replica-groups.md). ``commands()`` returns the subcommand for
``moepec.cli.main`` to register (nothing happens at import; torchft is imported only
when a replica-group run or a Lighthouse is asked for).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from moepec.errors import ConfigError


def add_ft_flags(p: argparse.ArgumentParser) -> None:
    """The ``train`` flags of a replica-group run (environment fallbacks in brackets)."""
    g = p.add_argument_group("replica groups (torchft; pip install 'moepec[ft]')")
    g.add_argument("--ft-lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   metavar="URL", help="join the replica groups of this Lighthouse "
                   "(`moepec lighthouse` prints it) [TORCHFT_LIGHTHOUSE]")
    g.add_argument("--ft-groups", type=int, default=_env_int("MOEPEC_FT_GROUPS"), metavar="G",
                   help="replica groups of the run [MOEPEC_FT_GROUPS]")
    g.add_argument("--ft-group", type=int, default=_env_int("MOEPEC_FT_GROUP"), metavar="I",
                   help="this torchrun job's group, 0..G-1 [MOEPEC_FT_GROUP]")
    g.add_argument("--ft-timeout", type=float, default=10.0, metavar="S",
                   help="bound on a cross-group all-reduce, commit vote and state transfer, "
                        "and how long a rank of a group may be frozen before its group is cut "
                        "(and restarts): what a hung peer costs at most (%(default)s)")
    g.add_argument("--ft-quorum-timeout", type=float, default=60.0, metavar="S",
                   help="bound on the wait for a quorum; a cold start waits this long for "
                        "every group (%(default)s)")
    g.add_argument("--ft-no-digests", action="store_true",
                   help="leave the SHA-256 state digests out of the heal records (hashing "
                        "costs ~1 s per GB of state on the heal's path)")
    g.add_argument("--ft-spares", type=int, default=10, metavar="N",
                   help="warm spares: when a training process of the group dies, every "
                        "rank of the group is replaced at once by a process forked from its "
                        "already-started supervisor, N times at most, then torchrun's restart "
                        "(%(default)s; 0: off)")
    g.add_argument("--ft-transport", default="http",
                   help="how a restarted group receives the state: http or pg (%(default)s)")
    g.add_argument("--ft-checkpoints", default="striped",
                   help="PEC checkpoints for cold starts: striped (each striped over the "
                        "groups: every rank writes 1/(all ranks)) or group (a whole copy "
                        "per group) (%(default)s)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def ft_config_from_args(args: argparse.Namespace) -> Any:
    """The FtConfig of the ``--ft-*`` flags, or None when no Lighthouse is given."""
    if not args.ft_lighthouse:
        if args.ft_groups is not None or args.ft_group is not None:
            raise ConfigError("--ft-groups/--ft-group need --ft-lighthouse URL (start one with "
                              "`moepec lighthouse`)")
        return None
    if args.ft_spares < 0:
        raise ConfigError(f"--ft-spares must be >= 0 (got {args.ft_spares})")
    if args.ft_groups is None or args.ft_group is None:
        raise ConfigError("--ft-lighthouse needs --ft-groups G and --ft-group I (or "
                          "MOEPEC_FT_GROUPS / MOEPEC_FT_GROUP)")
    from moepec.train.config import FtConfig

    return FtConfig(lighthouse=args.ft_lighthouse, groups=args.ft_groups, group=args.ft_group,
                    timeout_s=args.ft_timeout, quorum_timeout_s=args.ft_quorum_timeout,
                    transport=args.ft_transport, digests=not args.ft_no_digests,
                    checkpoints=args.ft_checkpoints)


def _add_lighthouse(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=_port, default=29510, help="port, 0 for a free one (%(default)s)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="groups a quorum needs; 1 lets a survivor train on alone (%(default)s)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                   help="a group silent this long leaves the quorum: the failure-detection "
                        "time (%(default)s)")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="how long a quorum waits for a live group that has not asked yet "
                        "(%(default)s)")
    p.add_argument("--address-file", default=None, metavar="PATH",
                   help="also write the address to this file (for scripts)")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535; 0: a free one)")
    return port


def _run_lighthouse(args: argparse.Namespace) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft is imported: its logger
    from moepec.integrations.torchft import start_lighthouse

    try:
        lighthouse = start_lighthouse(args.port, min_replicas=args.min_replicas,
                                      heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                                      join_timeout_ms=args.join_timeout_ms)
    except RuntimeError as exc:
        if "in use" not in str(exc):
            raise
        raise ConfigError(f"port {args.port} is in use (another lighthouse?); pick another "
                          f"--port, or --port 0 for a free one") from None
    print(lighthouse.address, flush=True)
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(lighthouse.address + "\n")
        os.replace(tmp, args.address_file)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("lighthouse running; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    lighthouse.shutdown()
    return 0


def commands():
    """(name, help, add_arguments, run) of the replica-group subcommands."""
    return [("lighthouse", "start a torchft Lighthouse for replica groups and print its "
             "address", _add_lighthouse, _run_lighthouse)]
