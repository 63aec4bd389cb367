"""Partial-experts checkpoints inside torchtitan's Trainer (torchtitan 0.3.0, ``moepec[titan]``).

:class:`PecCheckpointManager` takes the place of torchtitan's DCP ``CheckpointManager`` in
the Trainer's ``checkpoint`` slot. It saves what torchtitan saves -- the model part
(stacked-expert DTensors under FSDP / EP included), the optimizer's moments, the LR
schedulers, the data loader and the train state -- through :class:`moepec.CheckpointManager`:
every checkpoint holds all non-expert state and K of the N experts of each MoE layer;
the RAM snapshot is taken in the Trainer's ``maybe_wait_for_staging()`` slot right before
``optimizer.step()`` and the write runs in the background. ``load`` stitches each expert's
newest copy and logs the proportion of lost tokens (PLT), counted from torchtitan's own
per-expert token counts (``MoE.tokens_per_expert_E``). The checkpoint folder is a moepec
root: ``moepec inspect/verify/export`` work on it, and retention (``keep_latest_k``)
never deletes a checkpoint that the newest views still need.

Two ways in (docs/torchtitan.md): on any stock config, the ``@override`` hook
(``--override.imports 'moepec.integrations.torchtitan.use_pec={"k_persist": 1}'``), or a
config registry that wraps every upstream config name, so moepec's fields parse as flags
(``--module moepec.integrations.torchtitan --config NAME --checkpoint.k_persist 2``).

torchtitan's ``folder``, ``interval``, ``keep_latest_k``, ``async_mode`` and ``load_step``
map onto moepec's path, interval, ``keep_last``, asynchronous snapshot + persist and
``restore(step)``. What moepec's checkpoints are not for is left to torchtitan's own
manager over the same objects: the initial load of a folder without a checkpoint
(``initial_load_path``, ``initial_load_model_only``, ``initial_load_in_hf``) and the
model-only last save (``last_save_model_only``, a DCP folder ``step-<N>``). Several
optimizers per model part (one per ``optimizer_name``) each keep their per-expert state
with the expert; a model without experts gets full checkpoints and one warning saying so;
a bare tensor in ``states`` is saved with the non-expert state. The options moepec does
not implement (``last_save_in_hf``, seed checkpoints, pipeline parallelism, torchft's
``ft_manager``) are refused with a ``ConfigError`` that says what to do.

This is the only moepec module that imports torchtitan; it uses moepec's public API only.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.config.override import derive, override
from torchtitan.tools import filesystem

from moepec import CheckpointConfig, ExpertSpec, NoCheckpointError, RestoreReport
from moepec import CheckpointManager as PecManager
from moepec.errors import ConfigError, MoepecError
from moepec.integrations.titan_state import (
    DataLoaderState,
    RoutingTap,
    stateful_states,
)

log = logging.getLogger(__name__)

KEEP_ALL = 1_000_000
"""``keep_last`` for torchtitan's ``keep_latest_k=0`` (retain every checkpoint)."""


class PecCheckpointManager(BaseCheckpointManager):
    """torchtitan checkpoint manager that writes moepec partial-experts checkpoints.

    Built by the Trainer from :class:`PecCheckpointManager.Config` on every rank with the
    same arguments as torchtitan's own manager. Raises ConfigError for a setting it does
    not support (the message names what to do instead).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint options plus moepec's (``--checkpoint.*``). ``folder``,
        ``interval``, ``keep_latest_k`` and ``async_mode`` keep their torchtitan meaning;
        ``async_mode`` other than ``disabled`` snapshots and persists in the background."""

        k_persist: int = 1
        """Experts per MoE layer written to storage at each checkpoint (K_persist)."""
        k_snapshot: int | None = None
        """Experts per MoE layer copied to host RAM (>= k_persist); None: k_persist."""
        selection: str = "sequential"
        """Which experts: ``sequential`` (round-robin) or ``load_aware``."""
        pec_scope: str = "all"
        """What PEC skips for unselected experts: ``all``, ``optimizer`` or ``weights``."""
        full_every: int = 0
        """Make every M-th checkpoint a full one (all experts); 0 = never."""
        plt_budget: float = 0.0375
        """Budget of the proportion of lost tokens (PLT); dynamic K doubles K past it."""
        dynamic_k: bool = True
        """After a recovery that leaves PLT over the budget, double k_persist."""
        ram_dir: str | None = "auto"
        """RAM tier: ``auto`` (node-local shared memory when it fits), a folder on a
        shared-memory filesystem, or None (in the training process)."""
        write_mode: str = "adaptive"
        """Who writes what across ranks: ``baseline``, ``sharded`` or ``adaptive``."""
        serialization: str = "raw"
        """``raw`` tensor bytes (fast) or ``torch_save`` (stock ``dcp.load`` reads it)."""
        timeout_s: float = 600.0
        """Upper bound of every wait (snapshot, persist, collective)."""
        takeover: bool = False
        """Take the folder's lease from the run holding it (one writer per folder)."""
        expert_stacked: str | None = None
        """Name the experts when discovery finds none: a regex with groups ``layer`` and
        ``name`` matching stacked ``[E, ...]`` expert parameters (``ExpertSpec.stacked``)."""
        expert_modules: str | None = None
        """A regex with groups ``layer``, ``expert`` and ``name`` matching one expert's own
        parameters (``ExpertSpec.modules``)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            try:
                self.moepec_config("validate")
                self.expert_spec()
            except MoepecError as e:
                raise ValueError(f"--checkpoint: {e}") from e

        def expert_spec(self) -> ExpertSpec | None:
            """The experts as named by ``expert_stacked`` / ``expert_modules``, or None
            (found from the module structure)."""
            if self.expert_stacked is None and self.expert_modules is None:
                return None
            return ExpertSpec(stacked=self.expert_stacked, modules=self.expert_modules)

        def moepec_config(self, path: str, dense: bool = False) -> CheckpointConfig:
            """moepec's CheckpointConfig for a checkpoint root at ``path``; ``dense``: the
            model has no MoE layer (full checkpoints, not an error)."""
            background = self.async_mode != "disabled"
            return CheckpointConfig(
                path=path, interval=self.interval, k_persist=self.k_persist,
                k_snapshot=self.k_snapshot, selection=self.selection,
                pec_scope=self.pec_scope, full_every=self.full_every,
                keep_last=self.keep_latest_k or KEEP_ALL, async_snapshot=background,
                async_persist=background, plt_budget=self.plt_budget,
                dynamic_k=self.dynamic_k, ram_dir=self.ram_dir, write_mode=self.write_mode,
                serialization=self.serialization, timeout_s=self.timeout_s,
                takeover=self.takeover, require_experts=False if dense else None)

    def __init__(self, config: Config, *, dataloader: Any | None, model_parts: list[nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any | None, base_folder: str = "",
                 ft_manager: Any | None = None) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        _refuse_unsupported(config, model_parts, optimizers, ft_manager)
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.report: RestoreReport | None = None
        """What the last ``load`` restored (None: a fresh start)."""
        distributed = dist.is_available() and dist.is_initialized()
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))
                       if distributed else None)
        torch_optimizers, whole = _optimizers_of(optimizers)
        extra: dict[str, Any] = {"lr_scheduler": lr_schedulers, **stateful_states(states)}
        if whole is not None:
            extra["optimizer"] = whole
        self.loader_state = None
        if dataloader is not None:
            self.loader_state = DataLoaderState(dataloader, self._group)
            extra["dataloader"] = self.loader_state
        spec = config.expert_spec()
        dense = spec is None and not any(_is_moe(m) for m in model_parts[0].modules())
        self.manager = PecManager(model_parts[0], torch_optimizers,
                                  config.moepec_config(self.folder, dense), extra_state=extra,
                                  expert_spec=spec)
        self.routing = RoutingTap(model_parts[0], self.manager.n_experts)
        self._stock_args = dict(dataloader=dataloader, model_parts=model_parts,
                                optimizers=optimizers, lr_schedulers=lr_schedulers,
                                states=states, sd_adapter=sd_adapter)
        """What torchtitan's own manager is built with, for what moepec leaves to it:
        the initial load and the model-only last save."""
        if not self.manager.n_experts:
            _say_no_experts(self.folder)
        else:
            log.info("moepec: partial-experts checkpoints (K=%d of %s experts per layer, %d "
                     "optimizer(s)) in %s", self.manager.k_persist, self.manager.n_experts,
                     len(torch_optimizers), self.folder)

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        """torchtitan's own rule (CheckpointManager._should_save)."""
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Start a checkpoint labelled ``curr_step`` (returns once the RAM snapshot is
        under way; the write runs in the background unless ``async_mode=disabled``); the
        last step's is complete (every expert), or the model alone as torchtitan's own
        with ``last_save_model_only``."""
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and self.config.last_save_model_only:
            # torchtitan's own last save: the model alone, in export_dtype, a DCP folder
            # step-<N> beside moepec's checkpoints (training is over; nothing resumes it)
            self.manager.wait_for_persist()
            return self._stock(self.folder).save(curr_step, last_step=True)
        if self.loader_state is not None:
            self.loader_state.capture()
        # torchtitan's last step, when it saves the training state: every expert, so a
        # rerun or an extension of the run (more steps) restores it with PLT 0
        self.manager.save(curr_step, final=last_step)
        return True

    def _stock(self, folder: str) -> CheckpointManager:
        """torchtitan's own manager over the same objects, saving and loading in
        ``folder``, synchronous and without retention."""
        config = derive(self.config, CheckpointManager.Config, async_mode="disabled",
                        keep_latest_k=0, folder=folder)
        args = {**self._stock_args, "states": dict(self._stock_args["states"])}
        return CheckpointManager(config, **args)  # it adds its own entries to states

    def _initial_load(self) -> bool:
        """A folder without a moepec checkpoint: torchtitan's own initial load
        (``initial_load_path``: a DCP folder, or Hugging Face safetensors with
        ``initial_load_in_hf``; ``initial_load_model_only``), by torchtitan's manager
        reading from a folder that never exists (so it takes the initial path). The next
        save is a full one. False when there is nothing to load (a fresh start)."""
        if not (self.config.initial_load_path or self.config.initial_load_in_hf):
            log.info("moepec: no checkpoint in %s, this is a fresh start", self.folder)
            return False
        loaded = self._stock(filesystem.join(self.folder, ".initial-load")).load()
        log.info("moepec: no checkpoint in %s; started from %s (%s)", self.folder,
                 self.config.initial_load_path or "the HF assets",
                 "model only" if self.config.initial_load_model_only else "training state")
        return loaded

    def _maybe_wait_for_staging(self) -> None:
        """Right before ``optimizer.step()``: feed this step's token counts, and wait for
        the snapshot in flight (weights must not change under its copy)."""
        counts = self.routing.take()
        if counts is not None:
            self.manager.observe_routing(counts)
        self.manager.wait_for_snapshot()

    def _load(self, step: int = -1) -> bool:
        """Restore the newest view (each expert from its newest copy); False when the
        folder holds no checkpoint (a fresh start). ``step`` (``--checkpoint.load_step``):
        the newest view at or before that step -- that step's own when its view is whole
        -- and FileNotFoundError when the folder holds none, as torchtitan's manager."""
        try:
            self.report = self.manager.restore(None if step == -1 else step)
        except NoCheckpointError as exc:
            if step == -1:
                raise
            raise FileNotFoundError(
                f"--checkpoint.load_step={step}: the view at that step is no longer whole "
                f"({exc}); retention keeps the views of the newest keep_latest_k checkpoints "
                f"whole: load a newer step (keep_latest_k 0 keeps every view)") from exc
        self.routing.reset()
        if self.report is None and step != -1:
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found: {self.folder} "
                                    f"holds no checkpoint at or before step {step}")
        if self.report is None:
            return self._initial_load()
        if step not in (-1, self.report.step):
            log.warning("moepec: --checkpoint.load_step=%d: no whole view at that step; "
                        "loaded step %d, the newest before it", step, self.report.step)
        log.info("moepec: restored step %d from %s (%s); PLT %.4f%%", self.report.step,
                 self.report.checkpoint, self.report.tier, 100 * self.report.plt)
        return True

    def _wait_for_saving(self) -> None:
        self.manager.wait_for_persist()
        self.save_future = None

    def _close(self) -> None:
        """Wait for the write in flight and stop moepec's threads (idempotent)."""
        self.manager.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def _refuse_unsupported(config: PecCheckpointManager.Config, model_parts: list[nn.Module],
                        optimizers: Any, ft_manager: Any | None) -> None:
    """ConfigError for what this manager does not do, each naming what to do instead."""
    if ft_manager is not None:
        raise ConfigError(
            "torchtitan's torchft experiment passed an ft_manager: PecCheckpointManager "
            "does not join torchft replica groups; run without --fault_tolerance.enable, "
            "or use moepec's own torchft support (`moepec train --ft-lighthouse ...`)")
    if len(model_parts) != 1:
        raise ConfigError(f"{len(model_parts)} model parts (pipeline parallelism): moepec "
                          f"checkpoints one model part per rank; run without "
                          f"--parallelism.pipeline_parallel_degree")
    unsupported = {
        "last_save_in_hf": "run `moepec export FOLDER OUT --format safetensors` after training",
        "create_seed_checkpoint": "create seed checkpoints with torchtitan's own manager",
        "exclude_from_loading": "moepec restores the whole training state",
    }
    for name, fix in unsupported.items():
        if getattr(config, name):
            raise ConfigError(f"--checkpoint.{name} is not supported by moepec's checkpoint "
                              f"manager: {fix}")


def _optimizers_of(optimizers: Any) -> tuple[list[torch.optim.Optimizer], Any | None]:
    """(the torch optimizers of torchtitan's ``OptimizersContainer``: one per optimizer
    name, each keeping its per-expert state with the expert; another stateful object,
    stored whole with the non-expert state, or None). ConfigError for anything else."""
    if optimizers is None:
        return [], None
    inner = getattr(optimizers, "optimizers", None)
    if isinstance(inner, list) and all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return inner, None
    if hasattr(optimizers, "state_dict") and hasattr(optimizers, "load_state_dict"):
        log.info("moepec: the optimizers (%s) are not torch optimizers in an "
                 "OptimizersContainer: their state_dict() is saved whole, every time",
                 type(optimizers).__name__)
        return [], optimizers
    raise ConfigError(f"optimizers: a {type(optimizers).__name__} is neither torchtitan's "
                      f"OptimizersContainer nor stateful; pass the Trainer's optimizers")


def _say_no_experts(folder: str) -> None:
    """Never full in silence: rank 0 says, in one line, that no experts were found."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(
            "moepec: no experts found in the model (looked for torchtitan MoE layers, whose "
            "tokens_per_expert_E counts their experts, and for stacked [E, ...] expert "
            "parameters and experts.<e> modules): every checkpoint in %s is a full one; if "
            "the model has experts, name them with --checkpoint.expert_stacked REGEX "
            "(groups layer, name) or --checkpoint.expert_modules REGEX (groups layer, "
            "expert, name)", folder)


def _is_moe(module: nn.Module) -> bool:
    """A torchtitan MoE layer (it counts the tokens routed to each of its experts)."""
    return isinstance(getattr(module, "tokens_per_expert_E", None), torch.Tensor)


@override(target=CheckpointManager.Config,
          description="moepec: partial-experts checkpoints (moepec.integrations.torchtitan)")
def use_pec(cfg: CheckpointManager.Config, **fields: Any) -> PecCheckpointManager.Config:
    """The ``@override`` factory: torchtitan's checkpoint config as moepec's, with
    ``fields`` (the JSON of ``--override.imports '...use_pec={"k_persist": 1}'``) set."""
    unknown = set(fields) - set(PecCheckpointManager.Config.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"use_pec: unknown field(s) {sorted(unknown)}; the fields are "
                          f"those of PecCheckpointManager.Config (docs/torchtitan.md)")
    return derive(cfg, PecCheckpointManager.Config, **fields)


def pec_config(config: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with its checkpoint slot moepec's."""
    config.checkpoint = derive(config.checkpoint, PecCheckpointManager.Config)
    return config


def upstream_config(name: str) -> Callable[[], Any] | None:
    """torchtitan's own config function ``name`` (from any model's config_registry)."""
    from torchtitan.models import _supported_models
    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    return None


def __getattr__(name: str) -> Callable[[], Any]:
    """``--module moepec.integrations.torchtitan --config NAME``: torchtitan's config
    function NAME, with moepec's checkpoint manager in its checkpoint slot."""
    if name.startswith("_") or not name[:1].islower():
        raise AttributeError(name)
    fn = upstream_config(name)
    if fn is None:
        raise AttributeError(f"no torchtitan config function named {name!r}")

    def wrapped() -> Any:
        return pec_config(fn())

    wrapped.__name__ = name
    wrapped.__doc__ = f"torchtitan's {name} with moepec's checkpoint manager."
    return wrapped
