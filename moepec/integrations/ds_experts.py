"""Which of a DeepSpeed engine's parameters are experts, where this rank holds them, and
how many tokens their routers send each expert.

Two kinds of model, one answer (:data:`Experts`: parameter name -> what of it is whose):

- DeepSpeed's own ``deepspeed.moe.layer.MoE``: each expert module's parameters are one
  unit ``(layer, global expert)``, as DeepSpeed numbers them (its expert files);
- any other model, through the one expert discovery every door uses
  (:func:`moepec.state.experts.discover`, an ``ExpertSpec`` to override it): a
  Hugging Face model's module-list experts (each parameter one unit) or stacked
  ``[E, ...]`` expert parameters (:class:`~moepec.integrations.ds_files.Rows`: expert
  ``e`` is row ``e``, and a ZeRO-1/2 partition may hold any run of the parameter's
  elements, cut at expert boundaries; at ZeRO-3 each rank holds one run of every
  parameter, and discovery sees the partitioned parameters at their full shape). Shared
  experts and routers are non-expert state.

Routing counts (:class:`RouterCounts`): a forward hook per MoE layer on what discovery
found, counted on the device (:meth:`moepec.flat.FlatFrontEnd.observe_layer`). Also the
door's checks of an engine and its config section.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from moepec.errors import ConfigError, MoepecError
from moepec.flat import Unit
from moepec.integrations.ds_files import Rows, Split, layer_name, split_module
from moepec.state.experts import ExpertMap, ExpertSpec, discover, find_router, suggest_spec

Experts = dict[str, Unit | Rows]
"""Expert parameter name (as ``engine.module.named_parameters()``) -> its unit, or the
rows of a stacked one."""


def native_layers(module: nn.Module) -> list[nn.Module]:
    """DeepSpeed's own MoE layers of ``module``, in ``named_modules()`` order."""
    from deepspeed.moe.layer import MoE

    return [m for _, m in module.named_modules() if isinstance(m, MoE)]


def expert_params(engine: Any, emap: ExpertMap | None = None) -> Experts:
    """Each expert parameter of ``engine``'s module and what of it is whose: DeepSpeed's
    MoE layers if it has any (``emap`` is not used then), else ``emap`` (the door's
    discovery; discovered here when not given). A stacked parameter's :class:`Rows`
    carry where this rank's ZeRO-1/2 fragment of it starts (0 without one)."""
    if native_layers(engine.module):
        return _native(engine)
    emap = emap if emap is not None else discover_experts(engine.module)
    params = dict(engine.module.named_parameters())
    out: Experts = {}
    for layer in emap.layers:
        name = layer_name(layer.index)
        if layer.layout == "modules":
            for e, tensors in layer.modules.items():
                out |= dict.fromkeys(tensors.values(), (name, e))
            continue
        for full in layer.stacked.values():
            p = params[full]
            mapping = getattr(p, "_hp_mapping", None)
            offset = int(mapping.lp_fragment_address.start) if mapping is not None else 0
            if hasattr(p, "ds_id"):  # ZeRO-3: this rank's partition of the parameter
                offset = _partition_rank(p) * p.partition_numel()
                out[full] = Rows(name, int(p.ds_shape[0]), int(p.ds_numel), offset)
                continue
            out[full] = Rows(name, int(p.shape[0]), p.numel(), offset)
    return out


def _partition_rank(p: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group=getattr(p, "ds_process_group", None))


def discover_experts(module: nn.Module, spec: ExpertSpec | None = None) -> ExpertMap:
    """:func:`moepec.state.experts.discover` of an engine's module, ZeRO-3's partitioned
    parameters seen at their full shape."""
    with _full_shapes(module):
        return discover(module, spec)


@contextlib.contextmanager
def _full_shapes(module: nn.Module) -> Iterator[None]:
    """ZeRO-3 parameters (their data an empty placeholder) as zero-stride views of their
    full shape, no memory, for discovery; put back after."""
    saved = []
    for p in module.parameters():
        shape = getattr(p, "ds_shape", None)
        if shape is not None and tuple(p.shape) != tuple(shape):
            saved.append((p, p.data))
            p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(tuple(shape))
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def zero3_fragments(engine: Any) -> list[list[tuple[str, int, int]]] | None:
    """ZeRO-3: per optimizer sub-group, each parameter's part of this rank's flat fp32
    partition (and of each moment): (name, start, numel), padding left out. None below
    ZeRO-3."""
    opt = getattr(engine, "optimizer", None)
    groups = getattr(opt, "fp16_groups", None)
    if engine.zero_optimization_stage() < 3 or groups is None:
        return None
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for group in groups:
        at, frags = 0, []
        for p in group:
            part = int(p.partition_numel())
            valid = min(part, max(0, int(p.ds_numel) - _partition_rank(p) * part))
            frags.append((names.get(id(p), ""), at, valid))
            at += part
        out.append(frags)
    return out


def _native(engine: Any) -> Experts:
    """DeepSpeed's MoE layers: (MoE layer L in ``named_modules()`` order, global expert)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    out: Experts = {}
    layer = 0
    for prefix, module in engine.module.named_modules():
        if not isinstance(module, MoE):
            continue
        rank = groups._get_expert_parallel_rank(module.expert_group_name)
        local = module.num_local_experts
        experts = module.deepspeed_moe.experts.deepspeed_experts
        base = f"{prefix}." if prefix else ""
        for e, expert in enumerate(experts):
            for name, _ in expert.named_parameters():
                out[f"{base}deepspeed_moe.experts.deepspeed_experts.{e}.{name}"] = (
                    layer_name(layer), rank * local + e)
        layer += 1
    return out


def optimizer_index(engine: Any) -> dict[int, str]:
    """A torch optimizer's state index -> parameter name (ZeRO-0's state_dict(); under
    bf16/fp16 the optimizer's parameters are fp32 copies of the model's, in the same
    positions of ``fp32_groups`` and ``fp16_groups``)."""
    opt = getattr(engine, "optimizer", None)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    low, high = getattr(opt, "fp16_groups", None), getattr(opt, "fp32_groups", None)
    if low is not None and high is not None:
        names |= {id(h): names.get(id(lo), "") for gl, gh in zip(low, high)
                  for lo, h in zip(gl, gh)}
    inner = getattr(opt, "optimizer", opt)
    params = [p for g in getattr(inner, "param_groups", []) for p in g["params"]]
    return {i: names[id(p)] for i, p in enumerate(params) if names.get(id(p))}


def module_replica(engine: Any, info: Any, files: dict[str, Any], experts: Experts) -> Split:
    """On a data-parallel rank other than 0 (DeepSpeed hands its non-expert model file
    over on rank 0 alone): this rank's copy of that file's trained parameters (on their
    device: only those :func:`~moepec.integrations.ds_files.owned_keys` gives this rank
    are copied), keyed and cut into experts as
    :func:`~moepec.integrations.ds_files.split_file` does there, so that their writes can
    be spread. Parameters that train only: they are equal on every data-parallel rank
    after each step; buffers and frozen parameters may not be (rank 0's are DeepSpeed's).
    Empty where the file is this rank's. Raises MoepecError for anything unexpected (it
    reaches every rank)."""
    try:
        name = os.path.basename(engine._get_ckpt_name(info.save_dir, info.tag))
        if name in files:
            return Split({}, {})
        trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        state = engine._get_non_moe_state_dict(engine.module_state_dict())
        return split_module(name, {k: v.detach() for k, v in state.items() if k in trained},
                            experts)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not hang
        raise MoepecError(f"the non-expert parameters of this rank cannot be read "
                          f"({type(exc).__name__}: {exc})") from exc


def check_supported(engine: Any) -> None:
    """Raise ConfigError, in one line, for an engine the door does not take."""
    if engine.zero_optimization_stage() >= 3 and native_layers(engine.module):
        raise ConfigError("moepec's DeepSpeed door takes DeepSpeed's own MoE layers at ZeRO "
                          "stages 0, 1 and 2 (DeepSpeed's MoE refuses ZeRO-3); set "
                          "zero_optimization.stage to 2 or drop the moepec section")
    if type(engine).__name__ == "PipelineEngine":
        raise ConfigError("moepec's DeepSpeed door does not support pipeline engines; "
                          "drop the moepec section")
    for _, m in engine.module.named_modules():
        if type(m).__name__ == "AutoEPMoELayer":
            raise ConfigError("moepec's DeepSpeed door supports native "
                              "deepspeed.moe.layer.MoE layers, not AutoEP; drop the "
                              "moepec section")


def config_section(engine: Any, name: str) -> dict[str, Any] | None:
    """The DeepSpeed config's section ``name`` of ``engine``; None without one. Raises
    ConfigError for one that is not an object."""
    params = getattr(getattr(engine, "_config", None), "_param_dict", None)
    section = params.get(name) if isinstance(params, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f'the DeepSpeed config\'s "{name}" section must be an object '
                          f'such as {{"k_persist": 2}}')
    return section


def spec_of(section: Any) -> ExpertSpec | None:
    """The ``expert_spec`` of a door's fields: an ExpertSpec, its fields as a dict (the
    JSON config section), or None. Raises ConfigError (or ExpertDiscoveryError) naming
    the fix."""
    if section is None or isinstance(section, ExpertSpec):
        return section
    if not isinstance(section, dict):
        raise ConfigError(f'"expert_spec" must be an object such as {{"stacked": '
                          f'"^(?P<layer>.+)\\\\.experts\\\\.(?P<name>[^.]+)$"}} '
                          f"(got {section!r:.60})")
    unknown = sorted(set(section) - {"stacked", "modules", "ragged"})
    if unknown:
        raise ConfigError(f'"expert_spec" takes stacked, modules and ragged; not '
                          f'{", ".join(unknown)}')
    return ExpertSpec(**section)


def no_experts_message(model: str, emap: ExpertMap, section: str) -> str:
    """One line: a config section on a model where discovery found no experts (every
    save would be full), what was looked for and the ``expert_spec`` to name them."""
    found = dict(re.findall(r'(stacked|modules)=r"([^"]*)"', suggest_spec(emap.candidates)))
    spec = json.dumps(found or {"stacked": r"^(?P<layer>.+)\.experts\.(?P<name>[^.]+)$"})
    return (f"moepec: no experts found in {model} (looked for deepspeed.moe.layer.MoE "
            f"layers, stacked [E, ...] expert parameters and per-expert module lists beside "
            f"a router): every save writes the whole model; name the experts with "
            f'"expert_spec": {spec} in the "{section}" section')


class RouterCounts:
    """Tokens per expert of each MoE layer discovery found, from the model's own routing:
    a forward pre-hook on a stacked experts module that is given the chosen experts
    (transformers 5's ``experts(hidden, top_k_index, top_k_weights)``, exact whatever the
    router does, group-limited DeepSeek routing included), else a forward hook on the
    layer's router reading the expert indices it returns, or its logits' top-k (the
    block's ``top_k``/``num_experts_per_tok``). Counts in training mode only, summed on
    the device by ``observe``; one host copy per save."""

    def __init__(self, model: nn.Module, emap: ExpertMap,
                 observe: Callable[[int, torch.Tensor], None]) -> None:
        self.observe = observe
        self.handles: list[Any] = []
        self.missing: list[str] = []
        for layer in emap.layers:
            if not self._hook(model, layer.index, layer.prefix, layer.container,
                              layer.n_experts):
                self.missing.append(layer.prefix or "(root)")

    def _hook(self, model: nn.Module, index: int, prefix: str, container: str,
              n: int) -> bool:
        block = model.get_submodule(prefix) if prefix else model
        experts = getattr(block, container, None)
        if isinstance(experts, nn.Module) and "top_k_index" in _params_of(experts.forward):
            def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
                chosen = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
                if mod.training and isinstance(chosen, torch.Tensor):
                    self._add(index, chosen, n)
            self.handles.append(experts.register_forward_pre_hook(pre, with_kwargs=True))
            return True
        router = find_router(block, n)
        if router is None:
            return False
        top_k = next((v for a in ("top_k", "num_experts_per_tok")
                      if isinstance(v := getattr(block, a, None), int)), None)

        def post(mod: nn.Module, _inputs: Any, out: Any) -> None:
            if not mod.training:
                return
            outs = out if isinstance(out, tuple) else (out,)
            chosen = next((t for t in outs if isinstance(t, torch.Tensor)
                           and not t.is_floating_point()), None)
            if chosen is None and top_k is not None and outs[0].shape[-1] == n:
                chosen = outs[0].detach().reshape(-1, n).topk(top_k).indices
            if chosen is not None:
                self._add(index, chosen, n)
        self.handles.append(router.register_forward_hook(post))
        return True

    def _add(self, index: int, chosen: torch.Tensor, n: int) -> None:
        ids = chosen.detach().reshape(-1).to(torch.int64)
        self.observe(index, torch.bincount(ids[ids < n], minlength=n))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _params_of(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
