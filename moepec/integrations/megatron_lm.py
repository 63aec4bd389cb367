"""Megatron-LM's own state dict for the Megatron-Core door's RAM level, built by
Megatron-LM itself (``megatron/training/checkpointing.py``, imported inside the call,
never at module import: a megatron-core user never installs Megatron-LM).

:func:`megatron_lm_state_dict` is what Megatron-LM's ``save_checkpoint`` hands
``dist_checkpointing.save`` with ``--ckpt-format torch_dist``: ``generate_state_dict``
with its RNG states (a ShardedObject), its rerun state machine's state (only while a
rerun asks for a checkpoint, as there), the content metadata its ``--load`` reads back,
and ``num_floating_point_operations_so_far``. Its common state (``args``, ``iteration``,
``checkpoint_version``, ``opt_param_scheduler``, the FLOP count) is what Megatron-LM's
``load_checkpoint`` reads after ``dist_checkpointing.load``, so a load from RAM resumes
Megatron-LM at the snapshot's iteration (docs/megatron.md, "Megatron-LM's --load").
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from moepec.errors import ConfigError


def megatron_lm_state_dict(model: Any, optimizer: Any, opt_param_scheduler: Any,
                           iteration: int, num_floating_point_operations_so_far: float,
                           train_data_iterator: Any = None) -> tuple[dict[str, Any], str]:
    """All ranks, inside Megatron-LM's ``train()`` (its args set): Megatron-LM's state
    dict of a ``torch_dist`` save of ``iteration`` (the arguments are ``save_checkpoint``'s:
    ``model`` its list of model chunks, wrapped or not) and the save directory
    (``args.save``). No collective unless ``--data-parallel-random-init`` (Megatron-LM
    gathers the RNG states then). Raises ConfigError outside Megatron-LM or with a
    ``--ckpt-format`` other than ``torch_dist``."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if args is None:
        raise ConfigError("snapshot_megatron_lm() runs inside Megatron-LM's training (its "
                          "args set, megatron.training imported); a megatron-core loop "
                          "calls snapshot(sharded_state_dict, iteration, save_dir)")
    if args.ckpt_format != "torch_dist" or not args.save:
        raise ConfigError(f"snapshot_megatron_lm() needs --ckpt-format torch_dist and --save "
                          f"(got {args.ckpt_format!r}, {args.save!r}): the RAM level "
                          f"serves the load of a torch_dist save directory")
    lm = importlib.import_module("megatron.training.checkpointing")
    mpu = lm.mpu
    rng = lm.get_rng_state(args.ckpt_format, mpu.get_tensor_model_parallel_group(),
                           mpu.get_pipeline_model_parallel_group())
    rerun = lm.get_rerun_state_machine().state_dict(data_iterator=train_data_iterator,
                                                    ckpt_format=args.ckpt_format)
    metadata = lm._build_sharded_state_dict_metadata(args)  # as save_checkpoint does
    chunks = model if isinstance(model, list) else [model]
    state = lm.generate_state_dict(
        args, lm.unwrap_model(chunks), optimizer, opt_param_scheduler, rng,
        iteration=iteration, optim_sd_kwargs={"metadata": metadata},
        model_sd_kwargs={"metadata": metadata}, rerun_state=rerun)
    state["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    return state, args.save
