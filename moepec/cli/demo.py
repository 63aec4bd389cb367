"""``moepec demo``: fault-tolerant MoE training end to end, on this machine's CPUs.

The demo trains the ``small`` GPT-MoE on the default corpus under torchrun with 2 ranks
(one process if torchrun cannot start), with PEC on (K_snapshot 2, K_persist 1), injects
faults of several kinds (a SIGKILL of a rank, a kill while a persist writes, a full
disk, an exception inside a step), lets torchrun restart the workers, and resumes each
time from the newest view: from the RAM snapshots in shared memory (``/dev/shm``) that
the killed workers left, else from storage. ``ram_lost`` adds a fault that wipes the
node's shared memory, to show the storage path too. A fault-free run of the same seed (cached
in the output folder) gives the reference loss. The report (``report.md`` and plots
in the output folder) is built by :mod:`moepec.cli.demo_report`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moepec import CheckpointConfig
from moepec.errors import ConfigError, MoepecError
from moepec.train.config import TrainConfig, TrainResult
from moepec.train.faults import Fault, FaultPlan

__all__ = ["DemoSettings", "format_summary", "run_demo", "train_argv"]

log = logging.getLogger(__name__)

DEFAULT_STEPS = 300
"""The demo's length, for which its default faults are placed (300: the demo's four runs
fit in about 4 minutes on 2 idle CPU cores)."""
DEFAULT_FAULTS = "sigkill@82:r1,kill_persist@138:r0,enospc@180,exception@247:r1"
"""The faulty run's faults, placed for DEFAULT_STEPS steps on 2 ranks; another length or
fewer ranks get them moved to the same fractions of the run (:meth:`DemoSettings.planned_faults`)."""


@dataclass(kw_only=True, slots=True)
class DemoSettings:
    """What the demo runs. The defaults take a few minutes on 2 CPU cores. Validated on
    construction (ConfigError naming the flag): everything either run needs is checked
    before the first run starts."""

    steps: int = DEFAULT_STEPS
    """Training steps of each run."""
    batch_size: int = 16
    """Global batch (sequences of 128 bytes)."""
    ranks: int = 2
    """torchrun processes (data parallel)."""
    seed: int = 0
    """Seed of both runs (the same model init and data order)."""
    config: str = "small"
    """Model config."""
    ckpt_interval: int = 10
    """Steps between checkpoints."""
    k_persist: int = 1
    """Experts per MoE layer persisted per checkpoint."""
    k_snapshot: int = 2
    """Experts per MoE layer snapshotted to RAM per checkpoint."""
    faults: str = DEFAULT_FAULTS
    """Faults of the faulty run (moepec.train.faults spec). The default ones are moved to
    the same fractions of a run of other ``steps`` (and onto rank 0 with one rank); faults
    given otherwise are used as they are, and refused when one can never fire."""
    dynamic_k: bool = True
    """Double K_persist after a recovery that leaves PLT over the 3.75% budget."""
    max_restarts: int = 6
    """torchrun --max-restarts."""
    timeout_s: float = 60.0
    """Collective timeout of the runs."""
    ram_dir: str | None = field(default_factory=lambda: _default_ram_dir())
    """Shared-memory folder of the faulty run's RAM tier (its slots outlive the killed
    workers); None: in-process snapshots (every torchrun restart recovers from storage).
    Default: ``/dev/shm/moepec-demo`` where /dev/shm exists."""
    ram_lost: bool = False
    """Add a ``ram_lost`` fault (the node's ``ram_dir`` wiped, then SIGKILL) at 70% of
    the run: that recovery comes from storage."""
    compare: bool = True
    """After the faulty (restart-all) run, also run the same kill with replica groups and
    a planned stop with its rerun, and put the cost per fault of the three side by side
    (:mod:`moepec.cli.demo_compare`)."""
    ft_steps: int = 80
    """Steps of the replica-group run (its kill comes 1 s into training)."""
    stop_steps: int = 40
    """Steps of the planned-stop run (SIGTERM to its launcher half-way)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"ranks must be >= 1, got {self.ranks!r}; --ranks sets the "
                              "torchrun processes (1: one process)")
        if self.ram_lost and self.ram_dir is None:
            raise ConfigError("the ram_lost fault wipes the shared-memory RAM tier, and "
                              "--ram-dir none keeps snapshots in the process; give --ram-dir "
                              "a folder on shared memory or drop --ram-lost")
        for name in ("ft_steps", "stop_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 10:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be an integer >= 10 (steps of that run), got "
                                  f"{getattr(self, name)!r}")
        # Both runs' configs (the faulty one has every field the fault-free one has):
        # steps, interval, K and the fault spec against steps and interval.
        cfg = self.train_config("demo-out", faulty=True, ranks=self.ranks)
        FaultPlan.parse(cfg.faults or "").check(self.steps, world_size=self.ranks)

    def planned_faults(self) -> tuple[str, str | None]:
        """The faults of the faulty run without ``ram_lost``, and a line saying how the
        default ones were moved (None when they were not). The default faults keep their
        fractions of the run (sigkill at 27.5%, ...), go to rank 0 with one rank, and one
        that could not act in a run this short is left out; faults given otherwise are
        returned as they are."""
        if self.faults != DEFAULT_FAULTS:
            return self.faults, None
        planned = FaultPlan.parse(DEFAULT_FAULTS).faults
        kept, dropped = [], []
        for f in planned:
            moved = Fault(kind=f.kind, step=f.step * self.steps // DEFAULT_STEPS,
                          rank=f.rank if f.rank < self.ranks else 0)
            why = moved.never_fires(self.steps, interval=self.ckpt_interval,
                                    world_size=self.ranks)
            if why is None:
                kept.append(moved)
            else:
                dropped.append(f"{moved.key} is left out: {why.split('; ')[0]}")
        if kept == planned:
            return DEFAULT_FAULTS, None  # they fit this run as they are
        spec = ",".join(f.key for f in kept)
        note = "; ".join([f"the default faults are placed for {DEFAULT_STEPS} steps on 2 "
                          f"ranks; this run's {self.steps} step(s) on {self.ranks} rank(s) "
                          f"get {spec or 'none'}", *dropped])
        return spec, note

    def fault_spec(self) -> str:
        """The faults of the faulty run: :meth:`planned_faults` plus the ``ram_lost`` one."""
        extra = f"ram_lost@{int(self.steps * 0.7)}:r0" if self.ram_lost else ""
        return ",".join(x for x in (self.planned_faults()[0], extra) if x)

    def key(self) -> str:
        """Identifies the fault-free run these settings need (for its cache)."""
        d = asdict(self)
        for k in ("faults", "max_restarts", "k_persist", "k_snapshot", "ckpt_interval",
                  "dynamic_k", "ram_dir", "ram_lost", "compare", "ft_steps", "stop_steps"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def train_config(self, out: str | Path, *, faulty: bool, ranks: int) -> TrainConfig:
        """The TrainConfig of the faulty run (PEC checkpoints in ``out/ckpt``, the faults)
        or of the fault-free reference (no checkpoints), writing to ``out``, on ``ranks``
        processes. Every worker gets it as ``moepec train`` flags (:func:`train_argv`)."""
        checkpoint = None
        if faulty:
            # --ckpt-sync unset: both tiers in the background; the checkpoint waits for
            # other ranks as long as the trainer does (as ``moepec train`` sets it).
            checkpoint = CheckpointConfig(
                path=str(Path(out) / "ckpt"), interval=self.ckpt_interval,
                k_persist=self.k_persist, k_snapshot=self.k_snapshot, dynamic_k=self.dynamic_k,
                timeout_s=self.timeout_s, ram_dir=self.ram_dir)
        return TrainConfig(
            config=self.config, steps=self.steps, batch_size=self.batch_size, seed=self.seed,
            # Sized for 2 CPU cores: one torch thread per rank, or two for a single process.
            threads=1 if ranks > 1 else 2, eval_interval=max(1, self.steps // 8),
            eval_batches=4, log_interval=5, progress=False, out_dir=str(out),
            dist_timeout_s=self.timeout_s, checkpoint=checkpoint,
            faults=(self.fault_spec() or None) if faulty else None)


def train_argv(cfg: TrainConfig) -> list[str]:
    """The ``moepec train`` arguments that parse back to ``cfg``, for the fields the demo
    sets (:meth:`DemoSettings.train_config`; the others must have their defaults)."""
    args = ["train", "--config", cfg.config, "--steps", str(cfg.steps), "--batch-size",
            str(cfg.batch_size), "--seed", str(cfg.seed), "--threads", str(cfg.threads),
            "--eval-interval", str(cfg.eval_interval), "--eval-batches", str(cfg.eval_batches),
            "--log-interval", str(cfg.log_interval)]
    args += [] if cfg.progress else ["--no-progress"]
    args += [] if cfg.out_dir is None else ["--out-dir", cfg.out_dir]
    args += ["--dist-timeout", str(cfg.dist_timeout_s)]
    ckpt = cfg.checkpoint
    if ckpt is not None:
        args += ["--ckpt-dir", ckpt.path, "--ckpt-interval", str(ckpt.interval),
                 "--k", str(ckpt.k_persist), "--k-snapshot", str(ckpt.k_snapshot)]
    args += [] if cfg.faults is None else ["--faults", cfg.faults]
    if ckpt is not None:
        args += ["--dynamic-k" if ckpt.dynamic_k else "--no-dynamic-k"]
    args += [] if ckpt is None else ["--ram-dir", ckpt.ram_dir or "none"]
    return args


def _default_ram_dir() -> str | None:
    return "/dev/shm/moepec-demo" if os.path.isdir("/dev/shm") else None


def _train_cmd(s: DemoSettings, out: Path, faulty: bool, ranks: int) -> list[str]:
    """The command of one run: torchrun with ``ranks`` workers, or one process."""
    args = ["-m", "moepec", "--log-level", "WARNING",
            *train_argv(s.train_config(out, faulty=faulty, ranks=ranks))]
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(ranks), "--max-restarts",
                str(s.max_restarts if faulty else 0), *args]
    return [sys.executable, *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    # torch issue 135712: restarted workers must not share torchrun's rendezvous store.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _run(cmd: list[str], log_path: Path, timeout: float) -> int:
    with open(log_path, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(),
                              timeout=timeout)
    return proc.returncode


def _supervise(cmd: list[str], log_path: Path, restarts: int, timeout: float) -> int:
    """What torchrun does for one process: restart it after a crash."""
    code = 1
    for _ in range(restarts + 1):
        code = _run(cmd, log_path, timeout)
        if code == 0:
            return 0
    return code


def _train_run(s: DemoSettings, out: Path, faulty: bool, say) -> int:
    """One run; returns the number of ranks it used."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train.log"
    ranks = s.ranks
    if ranks > 1:
        code = _run(_train_cmd(s, out, faulty, ranks), log_path, timeout=1800)
        if code == 0:
            return ranks
        if (out / "summary.json").exists() or (out / "metrics.jsonl").exists():
            raise MoepecError(f"the {'faulty' if faulty else 'fault-free'} run failed "
                              f"(exit {code}); see {log_path}")
        say(f"torchrun could not start {ranks} ranks (exit {code}); running in one process "
            f"instead (see {log_path})")
        ranks = 1
        if faulty:
            s = _in_one_process(s, say)
    cmd = _train_cmd(s, out, faulty, 1)
    code = _supervise(cmd, log_path, s.max_restarts if faulty else 0, timeout=1800)
    if code != 0:
        raise MoepecError(f"the {'faulty' if faulty else 'fault-free'} run failed (exit "
                          f"{code}); see {log_path}")
    return 1


def _in_one_process(s: DemoSettings, say) -> DemoSettings:
    """The settings of the faulty run in one process: every fault on rank 0 (a fault on
    another rank could never fire)."""
    plan = FaultPlan.parse(s.faults).faults
    faults = ",".join(f"{f.kind}@{f.step}:r0" for f in plan)
    if any(f.rank for f in plan):
        say(f"in one process the faults go to rank 0: {faults}")
    return dataclasses.replace(s, ranks=1, faults=faults)


def run_demo(out_dir: str | Path = "demo-out", settings: DemoSettings | None = None,
             say=print) -> dict:
    """Run the fault-free (cached) and the faulty (restart-all) run, then, with
    ``settings.compare``, the replica-group run and the planned stop, and build the report.

    Blocks for a few minutes; writes everything under ``out_dir``; returns the report's
    numbers. Raises MoepecError when a run fails beyond its restarts.
    """
    from moepec.cli.demo_report import build_report

    s = settings or DemoSettings()  # validated: nothing below fails on a setting
    faults, note = s.planned_faults()
    if note:
        say(note)
    s = dataclasses.replace(s, faults=faults)
    cores = os.cpu_count() or 1
    if s.ranks > cores:
        log.warning("%d ranks on %d CPU core(s): the ranks share cores, and the runs take "
                    "longer than they would with --ranks %d", s.ranks, cores, cores)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    parts = 4 if s.compare else 2
    clean = out / "fault-free" / s.key()
    if (clean / "summary.json").exists():
        say(f"fault-free reference: cached in {clean}")
    else:
        shutil.rmtree(clean, ignore_errors=True)
        say(f"[1/{parts}] fault-free reference run: {s.config}, {s.steps} steps, {s.ranks} ranks ...")
        _train_run(s, clean, faulty=False, say=say)
    faulty = out / "faulty"
    shutil.rmtree(faulty, ignore_errors=True)
    say(f"[2/{parts}] restart-all: faulty run with PEC (K_snapshot {s.k_snapshot}, K_persist {s.k_persist}), "
        f"faults {s.fault_spec()}, RAM tier {s.ram_dir or 'in the process'} ...")
    ranks = _train_run(s, faulty, faulty=True, say=say)
    compare = _compare(s, out, ranks, say) if s.compare else None
    report = build_report(s, clean, faulty, out, ranks=ranks, wall_s=time.time() - t0,
                          compare=compare)
    say(report["text"])
    return report


def _compare(s: DemoSettings, out: Path, ranks: int, say) -> dict:
    """The replica-group run and the planned stop (parts 3 and 4): their rows of the
    cost-per-fault comparison (:mod:`moepec.cli.demo_compare`)."""
    from moepec.cli.demo_compare import planned_stop_row, replica_group_row, stop_settings

    for name in ("replica-groups", "planned-stop"):
        shutil.rmtree(out / name, ignore_errors=True)
    say(f"[3/4] replica groups: 2 groups on torchft, {s.ft_steps} steps, the same SIGKILL "
        "of a rank (the other group trains on; the killed one heals from it) ...")
    ft = replica_group_row(dataclasses.replace(s, ranks=ranks), out / "replica-groups", say)
    say(f"[4/4] planned stop: {s.stop_steps} steps, SIGTERM to the launcher half-way, then "
        "the same command again ...")
    stop_s = stop_settings(dataclasses.replace(s, ranks=ranks))
    stop = planned_stop_row(stop_s, out / "planned-stop",
                            lambda st, o: _train_cmd(st, o, True, st.ranks), _env(), say)
    return {"replica_groups": ft, "planned_stop": stop}


def format_summary(result: TrainResult) -> str:
    """A short human-readable table of a run's results."""
    rows = [
        ("steps", f"{result.steps}"),
        ("ranks", f"{result.world_size}"),
        ("tokens", f"{result.tokens:,}"),
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("wall time", f"{result.wall_time_s:.1f} s"),
        ("first train loss", f"{result.losses[0]:.4f}" if result.losses else "-"),
        ("last train loss", f"{result.losses[-1]:.4f}" if result.losses else "-"),
        ("val loss", f"{result.val_loss:.4f}" if result.val_loss is not None else "-"),
        ("dropped assignments", f"{result.dropped:,}"),
    ]
    # A restore that lost nothing (a complete checkpoint) is a resume, not a recovery.
    lossy = [r for r in result.recoveries if r.get("lost", 1)]
    if lossy:
        rows.append(("recoveries", f"{len(lossy)}"))
        rows.append(("PLT", f"{100 * result.recoveries[-1]['plt']:.3f}%"))
    if result.resumed_from is not None and not lossy:
        rows.append(("resumed", f"after step {result.resumed_from}, nothing lost"))
    if result.stopped:
        rows.append(("stopped", f"after step {result.stopped['step']} on "
                                f"{result.stopped['signal']}, complete checkpoint "
                                f"{result.stopped['checkpoint'] or 'not committed'}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
