"""The ``moepec`` command line: one function per subcommand, registered in ``COMMANDS``.

To add a subcommand, write ``_add_NAME(parser)`` and ``_run_NAME(args) -> int`` and
call ``register(Command(...))``. ``main`` configures logging, dispatches, and turns any
:class:`moepec.errors.MoepecError` into one line ``moepec: error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moepec.cli.logging_setup import setup_logging
from moepec.errors import ConfigError, MoepecError

__all__ = ["COMMANDS", "Command", "build_parser", "checkpoint_config_from_args", "main",
           "register", "train_config_from_args"]

log = logging.getLogger(__name__)

EXIT_USAGE = 2


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand of ``moepec``."""

    name: str
    """What the user types after ``moepec``."""
    help: str
    """One-line description shown by ``moepec --help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's flags to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it; returns the exit code. Raises MoepecError for user mistakes."""


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> None:
    """Add a subcommand (a name can be registered once)."""
    if command.name in COMMANDS:
        raise ValueError(f"subcommand {command.name!r} is registered twice")
    COMMANDS[command.name] = command


# --------------------------------------------------------------------------- train


def _default(config_class: type, name: str) -> Any:
    # Flag defaults come from the config classes themselves, so the two never disagree.
    return {f.name: f for f in dataclasses.fields(config_class)}[name].default


def _train_default(name: str) -> Any:
    from moepec.train.config import TrainConfig

    return _default(TrainConfig, name)


def _ckpt_default(name: str) -> Any:
    from moepec import CheckpointConfig

    return _default(CheckpointConfig, name)


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--model-override {text!r} is not KEY=VALUE, e.g. top_k=2")
    try:
        return key, json.loads(value)  # numbers, true/false
    except json.JSONDecodeError:
        return key, value  # plain strings such as expert_layout=modules


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    d = _train_default
    g = p.add_argument_group("model")
    g.add_argument("--config", default=d("config"),
                   help="named model config (see `moepec model-info`); default %(default)s")
    g.add_argument("--model-override", "-O", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. -O top_k=2 (repeatable)")


def _add_optimisation_flags(p: argparse.ArgumentParser) -> None:
    d = _train_default
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d("steps"), help="total steps (%(default)s)")
    g.add_argument("--batch-size", type=int, default=d("batch_size"),
                   help="global batch in sequences, split over ranks (%(default)s)")
    g.add_argument("--lr", type=float, default=d("lr"), help="peak learning rate (%(default)s)")
    g.add_argument("--min-lr", type=float, default=d("min_lr"),
                   help="final learning rate of the cosine decay (%(default)s)")
    g.add_argument("--warmup", type=int, default=d("warmup"), help="warm-up steps (%(default)s)")
    g.add_argument("--weight-decay", type=float, default=d("weight_decay"),
                   help="AdamW weight decay (%(default)s)")
    g.add_argument("--grad-clip", type=float, default=d("grad_clip"),
                   help="max gradient norm, 0 disables (%(default)s)")
    g.add_argument("--seed", type=int, default=d("seed"),
                   help="seed of init and data order (%(default)s)")


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    d = _train_default
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--data", default=d("data"), metavar="GLOB",
                   help="text files to train on (quote the glob); default: the Python stdlib")
    g.add_argument("--eval-interval", type=int, default=d("eval_interval"),
                   help="steps between validation losses, 0: end only (%(default)s)")
    g.add_argument("--eval-batches", type=int, default=d("eval_batches"),
                   help="global batches of the validation set, 0 disables (%(default)s)")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    d = _train_default
    g = p.add_argument_group("run")
    g.add_argument("--threads", type=int, default=d("threads"),
                   help="torch threads per process (default: torch's choice)")
    g.add_argument("--device", default=d("device"), help="auto, cpu or cuda (%(default)s)")
    g.add_argument("--ep", type=int, default=d("ep"), metavar="N",
                   help="expert parallel: N ranks split each MoE layer's experts; must divide "
                        "the number of ranks and of experts (%(default)s)")
    g.add_argument("--fsdp", action="store_true", default=d("fsdp"),
                   help="shard the model with FSDP2 (fully_shard each block and the root over "
                        "the ranks, as torchtitan does); each rank checkpoints its shards; "
                        "with --ep N a 2-D (dp, ep) mesh, experts sharded over both")
    g.add_argument("--dist-timeout", type=float, default=d("dist_timeout_s"),
                   help="seconds to wait for other ranks (%(default)s)")
    g.add_argument("--jsonl", default=d("log_jsonl"), metavar="PATH",
                   help="write metrics as JSON lines here (rank 0)")
    g.add_argument("--log-interval", type=int, default=d("log_interval"),
                   help="steps between metrics lines (%(default)s)")
    g.add_argument("--out-dir", default=d("out_dir"),
                   help="directory for summary.json (and metrics.jsonl)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    # Mapped onto a CheckpointConfig by checkpoint_config_from_args, except the last
    # two, which are the trainer's own (TrainConfig).
    d, t = _ckpt_default, _train_default
    g = p.add_argument_group("checkpointing")
    g.add_argument("--ckpt-dir", default=t("checkpoint"), metavar="PATH_OR_URL",
                   help="checkpoint location; unset: no checkpoints")
    g.add_argument("--ckpt-interval", type=int, default=d("interval"),
                   help="steps between checkpoints (%(default)s)")
    g.add_argument("--k", "--k-persist", dest="k_persist", type=int, default=d("k_persist"),
                   help="experts per MoE layer persisted per checkpoint (%(default)s)")
    g.add_argument("--k-snapshot", type=int, default=d("k_snapshot"),
                   help="experts per MoE layer snapshotted to RAM (default: = --k)")
    g.add_argument("--selection", default=d("selection"),
                   help="sequential or load_aware (%(default)s)")
    g.add_argument("--pec-scope", default=d("pec_scope"),
                   help="all, optimizer or weights: what PEC skips for unselected experts "
                        "(%(default)s)")
    g.add_argument("--full-every", type=int, default=d("full_every"), metavar="M",
                   help="every M-th checkpoint is a full one; 0 never (%(default)s)")
    g.add_argument("--keep-last", type=int, default=d("keep_last"),
                   help="committed views to retain (%(default)s)")
    g.add_argument("--ckpt-sync", action="store_true",
                   help="checkpoint synchronously (for comparison with the async default)")
    g.add_argument("--ckpt-takeover", action="store_true",
                   help="take the checkpoint root from the run holding its lease (one writer "
                        "per root; a dead process's lease is taken without it)")
    g.add_argument("--ram-dir", default=d("ram_dir"), metavar="DIR",
                   help="RAM snapshots in shared memory under DIR, kept across worker "
                        "restarts; 'auto' (default): /dev/shm/moepec when it exists and "
                        "fits, else in the process; 'none': in the process")
    g.add_argument("--ckpt-serialization", default=d("serialization"),
                   help="raw (tensor bytes, fast) or torch_save (stock DCP) (%(default)s)")
    g.add_argument("--busy-policy", default=d("busy_policy"),
                   help="checkpoint due while the last persist writes: wait or skip "
                        "(%(default)s)")
    g.add_argument("--write-mode", default=d("write_mode"),
                   help="baseline, sharded or adaptive write plan over ranks (%(default)s)")
    g.add_argument("--dynamic-k", action=argparse.BooleanOptionalAction,
                   default=d("dynamic_k"),
                   help="double K after a recovery that leaves PLT over --plt-budget "
                        "(default: on)")
    g.add_argument("--dynamic-k-down", action="store_true",
                   help="with --dynamic-k, also halve K when PLT is far under budget")
    g.add_argument("--plt-budget", type=float, default=d("plt_budget"),
                   help="budget of the proportion of lost tokens (%(default)s)")
    g.add_argument("--final-checkpoint", action=argparse.BooleanOptionalAction,
                   default=d("final_checkpoint"),
                   help="a complete checkpoint (every expert) at the last step, so a rerun "
                        "or a longer run loses nothing (default: on; preemption signals "
                        "always write one)")
    g.add_argument("--on-persist-error", default=t("on_persist_error"),
                   help="continue (log, keep training, retry; a failed last persist is a "
                        "warning, exit 0) or stop (exit 2) (%(default)s)")
    g.add_argument("--restarts", type=int, default=t("restarts"),
                   help="resume from the last checkpoint after this many failures (%(default)s)")


def _add_fault_flags(p: argparse.ArgumentParser) -> None:
    d = _train_default
    g = p.add_argument_group("fault injection")
    g.add_argument("--faults", default=d("faults"), metavar="SPEC",
                   help="e.g. sigkill@40:r1,exception@90,kill_persist@150; kinds: sigkill, "
                        "exception, kill_persist, kill_commit, storage_error, enospc, "
                        "slow_storage, corrupt")
    g.add_argument("--fault-mtbf", type=float, default=d("fault_mtbf"), metavar="STEPS",
                   help="also inject random faults, this many steps apart on average")


def _add_train(p: argparse.ArgumentParser) -> None:
    from moepec.cli.replicas import add_ft_flags

    for add_group in (_add_model_flags, _add_optimisation_flags, _add_data_flags,
                      _add_run_flags, _add_checkpoint_flags, _add_fault_flags, add_ft_flags):
        add_group(p)


_NO_CKPT_DIR = "(no --ckpt-dir)"


def checkpoint_config_from_args(args: argparse.Namespace) -> Any:
    """The CheckpointConfig the ``train`` checkpoint flags describe, or None without
    ``--ckpt-dir`` (raises ConfigError when a flag is invalid).

    The one place where those flags map onto checkpoint fields. The checkpoint waits
    for other ranks as long as the trainer does (``--dist-timeout``), and
    ``--ckpt-sync`` turns both background tiers off.
    """
    if not args.dist_timeout > 0:  # named by its flag, before it becomes timeout_s
        raise ConfigError(f"--dist-timeout must be > 0 seconds (got {args.dist_timeout})")
    try:
        ckpt = _checkpoint_config(args)
    except ConfigError as exc:  # the user typed flags: the message names them
        raise ConfigError(_FIELD_NAMES.sub(lambda m: _FLAG_OF[m.group(0)], str(exc))) \
            from None
    # Built, and so validated, even without --ckpt-dir: a mistyped checkpoint flag fails
    # now, as it always has, rather than in the run that turns checkpointing on.
    return None if args.ckpt_dir is None else ckpt


_FLAG_OF = {"interval": "--ckpt-interval", "k_persist": "--k", "k_snapshot": "--k-snapshot",
            "selection": "--selection", "pec_scope": "--pec-scope",
            "full_every": "--full-every", "keep_last": "--keep-last",
            "serialization": "--ckpt-serialization", "busy_policy": "--busy-policy",
            "write_mode": "--write-mode", "plt_budget": "--plt-budget",
            "timeout_s": "--dist-timeout", "ram_dir": "--ram-dir",
            "final_checkpoint": "--final-checkpoint"}
"""The checkpoint fields the ``train`` flags set, and the flag of each."""
_FIELD_NAMES = re.compile(r"(?<![\w-])(" + "|".join(_FLAG_OF) + r")(?![\w(])")


def _checkpoint_config(args: argparse.Namespace) -> Any:
    from moepec import CheckpointConfig

    return CheckpointConfig(
        path=_NO_CKPT_DIR if args.ckpt_dir is None else args.ckpt_dir,
        interval=args.ckpt_interval, k_persist=args.k_persist, k_snapshot=args.k_snapshot,
        selection=args.selection, pec_scope=args.pec_scope, full_every=args.full_every,
        keep_last=args.keep_last, async_snapshot=not args.ckpt_sync,
        takeover=args.ckpt_takeover,
        async_persist=not args.ckpt_sync, serialization=args.ckpt_serialization,
        busy_policy=args.busy_policy, write_mode=args.write_mode, dynamic_k=args.dynamic_k,
        dynamic_k_down=args.dynamic_k_down, plt_budget=args.plt_budget,
        timeout_s=args.dist_timeout, final_checkpoint=args.final_checkpoint,
        ram_dir=_ram_dir_arg(args.ram_dir))


def train_config_from_args(args: argparse.Namespace) -> Any:
    """The TrainConfig the ``train`` flags describe (raises ConfigError when invalid)."""
    from moepec.cli.replicas import ft_config_from_args
    from moepec.train.config import TrainConfig

    return TrainConfig(
        ft=ft_config_from_args(args),
        config=args.config,
        model_overrides=dict(_parse_override(o) for o in args.model_override),
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr,
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        eval_interval=args.eval_interval, eval_batches=args.eval_batches,
        log_interval=args.log_interval, seed=args.seed, data=args.data,
        threads=args.threads, log_jsonl=args.jsonl, out_dir=args.out_dir,
        progress=not args.no_progress, device=args.device, dist_timeout_s=args.dist_timeout,
        checkpoint=checkpoint_config_from_args(args), restarts=args.restarts, ep=args.ep,
        fsdp=args.fsdp,
        on_persist_error=args.on_persist_error, faults=args.faults,
        fault_mtbf=args.fault_mtbf,
    )


def _run_train(args: argparse.Namespace) -> int:
    try:
        return _train_from_args(args)
    except ConfigError as exc:  # the user typed flags: the message names them
        raise ConfigError(_flag_names(str(exc))) from None


def _flag_names(message: str) -> str:
    """``message`` with the ``train`` flags' config field names (those with an underscore:
    never a plain word) replaced by the flags (``k_persist`` -> ``--k``)."""
    parser = argparse.ArgumentParser()
    _add_train(parser)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    flags |= {f: flag for f, flag in _FLAG_OF.items() if "_" in f}
    flags |= {f"{name}_s": flag for name, flag in flags.items()
              if f"{name}_s" not in flags}  # dist_timeout_s: --dist-timeout
    names = re.compile(r"(?<![\w-])(" + "|".join(
        sorted((re.escape(f) for f in flags if "_" in f), key=len, reverse=True))
        + r")(?![\w(])")
    return names.sub(lambda m: flags[m.group(0)], message)


def _train_from_args(args: argparse.Namespace) -> int:
    cfg = train_config_from_args(args)  # a flag's mistake ends here, before any fork
    if cfg.ft is not None:
        from moepec.train.spare import run_with_spares, spares_apply

        if spares_apply(args.ft_spares):
            return run_with_spares(lambda: _train_and_report(cfg), args.ft_spares,
                                   warm=lambda: _warm_spare(cfg))
    return _train_and_report(cfg)


def _warm_spare(cfg: Any) -> None:
    """What a restarted worker spends its first seconds on, done once by the supervisor:
    torch and what it imports lazily (an optimizer's constructor imports torch._dynamo,
    1.5 s here), DCP, torchft, moepec, and the corpus (read-only, shared with the forks)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import moepec
    import moepec.integrations.torchft  # noqa: F401
    import moepec.train.trainer  # noqa: F401
    from moepec.train.data import load_corpus

    moepec.CheckpointManager  # noqa: B018 (imported on first use: the manager and DCP)
    load_corpus(cfg.data)


def _train_and_report(cfg: Any) -> int:
    from moepec.cli.demo import format_summary
    from moepec.train.trainer import train

    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(result))
    return stop_exit_code(result.stopped["signal"]) if result.stopped else 0


def stop_exit_code(signal_name: str) -> int:
    """The exit code of a run that a planned stop ended (its complete checkpoint written):
    0 under torchrun, whose agent restarts (``--max-restarts``) every worker that exits
    otherwise, so a worker that stopped for a preemption is never restarted into a job
    being shut down, and one that alone got the signal ends the job; elsewhere 128 + the
    signal's number (143 for SIGTERM, 130 for Ctrl-C), as a shell reports a process the
    signal ended, so a scheduler's script can tell a stop from a finished run."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return 0
    return 128 + int(signal.Signals[signal_name])


# ---------------------------------------------------------------------- model-info


def _add_model_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", metavar="NAME",
                   help="config to describe (repeatable); default: all")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _human(n: float, unit: str = "") -> str:
    # Counts read 1.87B (billions); byte sizes read 22.39GB (decimal units).
    giga = "G" if unit else "B"
    for suffix, scale in ((giga, 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _run_model_info(args: argparse.Namespace) -> int:
    from moepec.models import checkpoint_bytes, config_names, count_parameters, get_config

    rows = []
    for name in args.config or config_names():
        cfg = get_config(name)
        counts = count_parameters(cfg)
        rows.append({
            "config": name,
            "layers": cfg.n_layer,
            **dataclasses.asdict(counts),
            "checkpoint_bytes": checkpoint_bytes(cfg),
            "weight_bytes": checkpoint_bytes(cfg, adam=False),
        })
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
        return 0
    header = ("config", "layers", "MoE layers", "experts", "total params", "expert",
              "non-expert", "per expert", "ckpt fp32+Adam")
    table = [header] + [(
        r["config"], str(r["layers"]), str(r["n_moe_layers"]), str(r["n_experts"]),
        _human(r["total"]), _human(r["expert"]), _human(r["non_expert"]),
        _human(r["per_expert"]), _human(r["checkpoint_bytes"], "B"),
    ) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for j, row in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0


# ---------------------------------------------------------------------------- demo


def _add_demo(p: argparse.ArgumentParser) -> None:
    from moepec.cli.demo import DemoSettings

    d = DemoSettings()
    p.add_argument("--out-dir", default="demo-out", help="where outputs go (%(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (%(default)s)")
    p.add_argument("--ranks", type=int, default=d.ranks, help="torchrun ranks (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed (%(default)s)")
    p.add_argument("--faults", default=d.faults, help="fault spec (%(default)s)")
    p.add_argument("--ckpt-interval", type=int, default=d.ckpt_interval,
                   help="steps between checkpoints (%(default)s)")
    p.add_argument("--ram-lost", action="store_true",
                   help="also wipe the node's shared-memory RAM tier once (storage recovers)")
    p.add_argument("--ram-dir", default=d.ram_dir, metavar="DIR",
                   help="the faulty run's shared-memory RAM tier (%(default)s); 'none': "
                        "in-process snapshots (restarted workers recover from storage)")
    p.add_argument("--ft-steps", type=int, default=d.ft_steps,
                   help="steps of the replica-group run (%(default)s)")
    p.add_argument("--stop-steps", type=int, default=d.stop_steps,
                   help="steps of the planned-stop run, SIGTERM half-way (%(default)s)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the replica-group run and the planned stop after the faulty "
                        "run (their cost per fault beside restart-all's)")
    p.add_argument("--ft", action="store_true",
                   help="replica groups on torchft instead: 2 groups, a SIGKILL of one "
                        "group's rank mid-run, beside the same fault under restart-all "
                        "(needs moepec[ft])")


def _ram_dir_arg(value: str | None) -> str | None:
    """``--ram-dir``: a folder, ``auto``, or ``none`` (in-process snapshots)."""
    return None if value is None or value.lower() == "none" else value


def _run_demo(args: argparse.Namespace) -> int:
    from moepec.cli.demo import DemoSettings, run_demo

    if args.ft:
        from moepec.bench.ft import run_demo_ft

        run_demo_ft(args.out_dir)
        print(f"report: {os.path.join(args.out_dir, 'ft', 'report.md')}")
        return 0

    settings = DemoSettings(steps=args.steps, ranks=args.ranks, seed=args.seed,
                            faults=args.faults, ckpt_interval=args.ckpt_interval,
                            ram_lost=args.ram_lost, compare=not args.no_compare,
                            ft_steps=args.ft_steps, stop_steps=args.stop_steps,
                            ram_dir=_ram_dir_arg(args.ram_dir))
    run_demo(args.out_dir, settings)
    print(f"report: {os.path.join(args.out_dir, 'report.md')}")
    return 0


register(Command("train", "train a GPT-MoE (one process, or every rank under torchrun)",
                 _add_train, _run_train))
register(Command("model-info", "parameter counts and checkpoint sizes of the named configs",
                 _add_model_info, _run_model_info))
register(Command("demo", "fault-tolerant training end to end: faults, recovery, report",
                 _add_demo, _run_demo))


def _register_checkpoint_commands() -> None:
    from moepec.cli.checkpoints import commands
    from moepec.cli.deepspeed import commands as deepspeed_commands
    from moepec.cli.experts import commands as experts_commands
    from moepec.cli.planning import commands as planning_commands
    from moepec.cli.ram import commands as ram_commands
    from moepec.cli.replicas import commands as replica_commands

    for name, help_, add, run in (commands() + planning_commands() + experts_commands()
                                  + ram_commands() + replica_commands()
                                  + deepspeed_commands()):
        register(Command(name, help_, add, run))


_register_checkpoint_commands()


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(
        prog="moepec", description="Partial Experts Checkpointing for MoE training")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="DEBUG, INFO, WARNING or ERROR (%(default)s)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS.values():
        sp = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sp)
        sp.set_defaults(_command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moepec`` and ``python -m moepec``; returns the exit code.

    User mistakes (any MoepecError) print one line ``moepec: error: ...`` on stderr and
    return 2, without a traceback; argparse usage errors also return 2.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2) already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    rank = os.environ.get("RANK", "0")
    if not rank.isdigit():
        print(f"moepec: error: the environment's RANK={rank!r:.40} is not a rank (a whole "
              f"number, set by torchrun); unset it or run under torchrun", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(args.log_level, rank=int(rank))
    try:
        return args._command.run(args)
    except MoepecError as exc:
        print(f"moepec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a path, a permission, a full disk, a network: one line
        print(f"moepec: error: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        # Leaving now: a further Ctrl-C (while the interpreter joins threads and exits)
        # must not end in a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not str(exc):  # the trainer's own says where it stopped (TrainingInterrupted)
            print("moepec: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        name = type(exc).__name__
        if "Credentials" in name:  # botocore's NoCredentialsError and kin
            options = (" or --storage-options '{\"key\": ..., \"secret\": ...}'"
                       if hasattr(args, "storage_options") else "")
            print(f"moepec: error: {exc}: set the storage's credentials (for s3://, "
                  f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY{options})", file=sys.stderr)
            return EXIT_USAGE
        if "EndpointConnection" in name or "ConnectTimeout" in name \
                or "ClientConnector" in name:  # botocore's, aiohttp's: no server there
            print(f"moepec: error: cannot reach the storage server ({exc}); is it running, "
                  f"and is the endpoint (AWS_ENDPOINT_URL or the endpoint_url storage "
                  f"option) right?", file=sys.stderr)
            return 1
        if isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc) \
                and getattr(args, "storage_options", None):
            print(f"moepec: error: a storage option is not one this filesystem takes ({exc}); "
                  f"check --storage-options against its documentation", file=sys.stderr)
            return EXIT_USAGE
        # Not a user's mistake we know of: still one line (a C++ error's message goes on
        # with its stack frames), the whole message and the traceback under DEBUG.
        log.debug("unexpected error", exc_info=True)
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        print(f"moepec: error: {type(exc).__name__}: {first.strip()} (rerun with --log-level "
              f"DEBUG for the whole message and the traceback; please report it)",
              file=sys.stderr)
        return 1
    except BaseException as exc:
        if type(exc).__name__ != "CheckpointException":  # SystemExit and kin: as they are
            raise
        # DCP's error (a BaseException, so not caught above): each rank's cause, one line.
        causes = [f"rank {r}: {_cause(f)}" for r, f in sorted(exc.failures.items())]
        print(f"moepec: error: DCP failed ({'; '.join(causes) or exc}); check the path "
              f"(a new folder that can be written)", file=sys.stderr)
        return 1


def _cause(failure: Any) -> str:
    """One line of a DCP rank's failure (its wrapped exception, where DCP wrapped it)."""
    exc = failure[0] if isinstance(failure, tuple) else failure  # DCP's (exc, traceback)
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first.strip()}"
