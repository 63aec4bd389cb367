"""What a training run is asked to do (TrainConfig) and what it reports (TrainResult)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from moepec import CheckpointConfig
from moepec.errors import ConfigError, check_choice
from moepec.models import GPTMoEConfig, get_config
from moepec.train.data import check_vocab


# The trainer's own closed choices live here, beside the field that holds them: the
# modules that act on them (trainer, checkpointing) import this one, so defining them there
# would make this module import them back.
class Device(StrEnum):
    """Where a rank trains."""

    AUTO = "auto"
    """The rank's CUDA device when CUDA is available, else the CPU."""
    CPU = "cpu"
    """The CPU, even when CUDA is available."""
    CUDA = "cuda"
    """The rank's LOCAL_RANK CUDA device; an error without CUDA."""


class OnPersistError(StrEnum):
    """What the trainer does when a background persist fails."""

    CONTINUE = "continue"
    """Log it and keep training (snapshots to RAM go on; the next checkpoint retries); a
    failed last persist ends the run normally, with a warning naming the newest committed
    checkpoint."""
    STOP = "stop"
    """Raise the PersistError: the run ends (the CLI exits 2)."""



class FtTransport(StrEnum):
    """How a restarted replica group receives the state of a live one (torchft)."""

    HTTP = "http"
    """torchft's HTTP checkpoint server on the live group's ranks."""
    PG = "pg"
    """The cross-group gloo process group of the quorum."""


class FtCheckpoints(StrEnum):
    """How replica groups write PEC checkpoints (for cold starts)."""

    STRIPED = "striped"
    """Each checkpoint is striped over the groups of the quorum: every rank of every
    group writes an even share into its group's root; a cold start restores it whole
    over all roots (the default)."""
    GROUP = "group"
    """Every group writes a whole checkpoint into its own root (G copies)."""


@dataclass(kw_only=True, slots=True)
class FtConfig:
    """Replica groups on torchft (docs/replica-groups.md): this process's group, the
    Lighthouse, and the timeouts that bound a hung peer. Validated on construction."""

    lighthouse: str
    """Address of the torchft Lighthouse (``moepec lighthouse`` prints it)."""
    groups: int
    """Replica groups of the run (each trains its own shard of every global batch)."""
    group: int
    """This torchrun job's group, 0 <= group < groups."""
    timeout_s: float = 10.0
    """Bound on a cross-group all-reduce, commit vote and state transfer: what a hung
    (SIGSTOPped) peer costs at most before the step is retried without it."""
    quorum_timeout_s: float = 60.0
    """Bound on the wait for a quorum (and for connecting to the Lighthouse)."""
    transport: FtTransport = FtTransport.HTTP
    """How a restarted group receives the state: "http" or "pg"."""
    digests: bool = True
    """Put SHA-256 digests of the model, optimizer state, step and data position into the
    ``heal``, ``heal_sent`` and ``ft_end`` records (what the tests and ``bench ft``
    compare); hashing costs about a second per GB of state, on the heal's path."""
    checkpoints: FtCheckpoints = FtCheckpoints.STRIPED
    """Striped over the groups, or a whole copy per group."""

    def __post_init__(self) -> None:
        _need(bool(self.lighthouse), "ft: the Lighthouse address is empty; start one with "
              "`moepec lighthouse` and pass what it prints to --ft-lighthouse")
        _need(isinstance(self.groups, int) and self.groups >= 1,
              f"ft: groups must be >= 1, got {self.groups!r} (--ft-groups)")
        _need(isinstance(self.group, int) and 0 <= self.group < self.groups,
              f"ft: group must be in [0, {self.groups}), got {self.group!r} (--ft-group)")
        _need(self.timeout_s > 0 and self.quorum_timeout_s > 0,
              "ft: timeouts must be > 0 seconds (--ft-timeout)")
        self.transport = check_choice(FtTransport, self.transport, "ft transport")
        self.checkpoints = check_choice(FtCheckpoints, self.checkpoints, "ft checkpoints")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a training run needs. Validated on construction."""

    config: str = "small"
    """Named model config (see ``moepec model-info``)."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """GPTMoEConfig fields replacing the named config's, e.g. {"top_k": 2}."""
    steps: int = 200
    """Total optimizer steps of the run (a resumed run continues up to this number)."""
    batch_size: int = 16
    """Global batch in sequences, split evenly over the ranks."""
    lr: float = 3e-3
    """Peak learning rate, reached after ``warmup`` steps."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on weight matrices and embeddings (not on biases or norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_interval: int = 50
    """Compute the validation loss every this many steps (and at the end); 0: end only."""
    eval_batches: int = 4
    """Global batches in the fixed validation set; 0 disables validation."""
    log_interval: int = 10
    """Write a metrics line every this many steps (and at eval steps and the last step)."""
    seed: int = 0
    """Seeds model init and data order; same seed and threads give the same losses."""
    data: str | None = None
    """Glob of text files to train on; None: the Python standard library's sources."""
    threads: int | None = None
    """torch.set_num_threads for this process; None leaves torch's default."""
    log_jsonl: str | None = None
    """Path of the JSON-lines metrics file (rank 0); None: out_dir/metrics.jsonl or none."""
    out_dir: str | None = None
    """Directory for summary.json (and metrics.jsonl when log_jsonl is None); None: none."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    device: Device = Device.AUTO
    """Where each rank trains: "auto" (CUDA if available), "cpu" or "cuda" (the rank's
    LOCAL_RANK device)."""
    dist_timeout_s: float = 300.0
    """Timeout for joining the process group and for every collective."""
    checkpoint: CheckpointConfig | None = None
    """What, when and where to checkpoint (the library's own config); None: no
    checkpoints. ``moepec train`` sets its ``timeout_s`` to ``dist_timeout_s``."""
    on_persist_error: OnPersistError = OnPersistError.CONTINUE
    """A failed background persist: "continue" (log it, keep training and snapshotting to
    RAM, retry at the next checkpoint) or "stop" (raise)."""
    faults: str | None = None
    """Faults to inject, e.g. "sigkill@40:r1,exception@90,kill_persist@150" (moepec.train.faults)."""
    fault_mtbf: float = 0.0
    """Also inject random faults with this mean steps between faults (0: none)."""
    restarts: int = 0
    """After a failed step, rebuild and resume from the last checkpoint this many times."""
    return_state: bool = False
    """Put the final model state dict (on CPU) into TrainResult.model_state (under expert
    parallelism: this rank's experts only, local indices; under --fsdp: full tensors)."""
    ep: int = 1
    """Expert-parallel degree: ranks that split each MoE layer's experts between them;
    must divide the number of ranks and n_experts. 1: every rank holds every expert."""
    fsdp: bool = False
    """Shard the model as torchtitan does (FSDP2): ``fully_shard`` every transformer block
    and the root over the data-parallel ranks, so parameters and optimizer state are
    DTensor shards and each rank checkpoints its own. With ``ep`` > 1 a 2-D (dp, ep) mesh as
    torchtitan builds it: stacked experts sharded over ep on dim 0 and over dp on dim 1."""
    ft: FtConfig | None = None
    """Train as one replica group of a torchft run (None: this torchrun job is the run).
    Each group writes its metrics, summary and checkpoints under ``group-<I>`` of
    ``out_dir`` and of the checkpoint path."""

    def __post_init__(self) -> None:
        model_cfg = self.model_config()  # raises for unknown names or overrides
        check_vocab(model_cfg.vocab_size)  # the byte tokenizer feeds every model
        self._check_numbers()
        self.device = check_choice(Device, self.device, "device")
        self.on_persist_error = check_choice(OnPersistError, self.on_persist_error,
                                             "on_persist_error")
        self._check_checkpointing(model_cfg)
        _need(isinstance(self.ep, int) and self.ep >= 1,
              f"ep must be a positive integer, got {self.ep!r}; use --ep 1 to turn it off")
        _need(model_cfg.n_experts % self.ep == 0,
              f"ep={self.ep} does not divide n_experts={model_cfg.n_experts}; use an --ep "
              "that divides the number of experts")
        # DTensor placements give a stacked [E, ...] tensor's global expert ids; one
        # module per expert has no such tensor to shard over the EP dim.
        _need(not (self.fsdp and self.ep > 1 and model_cfg.expert_layout != "stacked"),
              f"--fsdp with --ep {self.ep} shards stacked experts over the EP dim; the "
              f"{model_cfg.expert_layout!r} expert layout has none: drop "
              "-O expert_layout=... or use --fsdp alone or --ep alone")
        _need(self.ft is None or isinstance(self.ft, FtConfig),
              f"ft must be a FtConfig or None, got {type(self.ft).__name__}")
        _need(self.ft is None or not self.fsdp,
              "replica groups (--ft-*) send plain tensors between groups; FSDP's DTensor "
              "shards are not supported there: drop --fsdp (DP and --ep work)")
        _need(self.ft is None or self.restarts == 0,
              "replica groups restart a failed group with torchrun --max-restarts; drop "
              "--restarts")

    def _check_numbers(self) -> None:
        _need(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _need(0 <= self.min_lr <= self.lr,
              f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        _need(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        _need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _need(self.grad_clip >= 0,
              f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        _need(self.eval_interval >= 0, f"eval_interval must be >= 0, got {self.eval_interval}")
        _need(self.eval_batches >= 0, f"eval_batches must be >= 0, got {self.eval_batches}")
        _need(self.log_interval >= 1, f"log_interval must be >= 1, got {self.log_interval}")
        _need(self.threads is None or self.threads >= 1,
              f"threads must be >= 1 (or unset), got {self.threads}")
        _need(self.dist_timeout_s > 0, f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        _need(self.restarts >= 0, f"restarts must be >= 0, got {self.restarts}")
        _need(self.fault_mtbf >= 0, f"fault_mtbf must be >= 0, got {self.fault_mtbf}")

    def _check_checkpointing(self, model_cfg: GPTMoEConfig) -> None:
        """What needs both the checkpoint config and the rest of the run. The checkpoint
        config validated its own fields (choices, K_persist <= K_snapshot) when built."""
        ckpt = self.checkpoint
        _need(ckpt is None or isinstance(ckpt, CheckpointConfig),
              f"checkpoint must be a moepec.CheckpointConfig or None, got {type(ckpt).__name__}")
        if ckpt is not None:
            _need(ckpt.k_snapshot is not None and ckpt.k_snapshot <= model_cfg.n_experts,
                  f"need 1 <= k_persist ({ckpt.k_persist}) <= k_snapshot ({ckpt.k_snapshot}) "
                  f"<= n_experts ({model_cfg.n_experts}); adjust --k / --k-snapshot")
        _need(not (self.faults or self.fault_mtbf) or ckpt is not None,
              "fault injection needs checkpoints to recover from; set --ckpt-dir")
        if self.faults:
            # Lazy: the fault machinery (fsspec filesystems, signals) is only needed here
            # when faults are asked for.
            from moepec.train.faults import FaultPlan

            # A bad spec, or a fault that can never fire in this run: ConfigError. The
            # ranks are checked once they are known (the trainer's set-up).
            FaultPlan.parse(self.faults).check(self.steps, interval=ckpt.interval)
        _need(self.restarts == 0 or ckpt is not None,
              "restarts need checkpoints to resume from; set checkpoint (--ckpt-dir) or "
              "restarts=0")

    def model_config(self) -> GPTMoEConfig:
        """The model config this run trains."""
        return get_config(self.config, **self.model_overrides)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(slots=True)
class TrainResult:
    """Summary of a training run (identical on every rank except model_state)."""

    steps: int
    """Optimizer steps taken by this call (fewer than cfg.steps after a resume)."""
    final_step: int
    """Index of the last step trained (cfg.steps - 1 when finished)."""
    losses: list[float] = field(default_factory=list)
    """Training LM loss of every step taken, rank-averaged."""
    val_loss: float | None = None
    """Validation LM loss at the end; None without a validation set."""
    val_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation loss) of every evaluation."""
    tokens_per_s: float = 0.0
    """Global training tokens per second of training time (evaluation excluded)."""
    wall_time_s: float = 0.0
    """Wall time of the whole call, set-up and evaluation included."""
    tokens: int = 0
    """Global tokens trained on by this call."""
    dropped: int = 0
    """Token assignments dropped for capacity over the run (all ranks, all layers)."""
    world_size: int = 1
    """Number of ranks."""
    ep_size: int = 1
    """Expert-parallel degree of the run (cfg.ep)."""
    resumed_from: int | None = None
    """Step of the checkpoint the run resumed from, if any."""
    data_state: dict[str, Any] = field(default_factory=dict)
    """The data loader's position at the end (epoch, position, seed)."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """One record per restore in this process: step, checkpoint, tier, PLT, seconds."""
    model_state: dict[str, torch.Tensor] | None = None
    """Final model weights on CPU if cfg.return_state, else None."""
    ft_group: int | None = None
    """The replica group this process trained in (None: not a replica-group run)."""
    heals: list[dict[str, Any]] = field(default_factory=list)
    """Replica groups: one record per state received from a live peer (step, seconds)."""
    reduced_width_steps: int = 0
    """Replica groups: committed steps that trained with fewer groups than the run has."""
    retried_steps: int = 0
    """Replica groups: steps that did not commit (a peer failed) and were trained again."""
    stopped: dict[str, Any] | None = None
    """A planned stop (a preemption signal, Ctrl-C) that ended the run early: the ``stop``
    metrics record (step, signal, the complete checkpoint, its bytes and seconds)."""

    def summary(self) -> dict[str, Any]:
        """JSON-able summary without the model state."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.pop("model_state")
        return out
