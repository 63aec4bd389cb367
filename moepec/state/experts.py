"""Find the experts of a model and map each (layer, expert) to its tensors.

Two layouts are recognised (see DESIGN.md, "expert"):

- *stacked* (torchtitan): one parameter ``[E, ...]`` per expert weight, named
  ``<layer>.experts.<name>``; expert ``e`` is the slice ``[e]`` of dim 0.
- *modules* (Hugging Face Mixtral): ``<layer>.experts.<e>.<name>``, one parameter
  per expert.

Layers are numbered 0.. in the order their first parameter appears in
``model.named_parameters()``; expert ids are global within a layer. Everything
that is not an expert tensor is *non-expert* state. Optimizer state follows its
parameter: a state tensor with the parameter's shape is sliced like the
parameter (Adam's ``exp_avg``/``exp_avg_sq``); any other state (the ``step``
counter) is non-expert.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from moepec.errors import ExpertDiscoveryError

STACKED_PATTERN = r"^(?P<layer>.+)\.experts\.(?P<name>[A-Za-z_][^.]*)$"
MODULES_PATTERN = r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<name>.+)$"


@dataclass(kw_only=True, slots=True)
class ExpertSpec:
    """How to recognise expert parameters by name.

    The defaults find both standard layouts. Override a pattern to teach moepec
    another naming scheme; set one to ``None`` to switch that layout off.
    """

    stacked: str | None = STACKED_PATTERN
    """Regex with groups ``layer`` and ``name``: a stacked ``[E, ...]`` expert parameter."""
    modules: str | None = MODULES_PATTERN
    """Regex with groups ``layer``, ``expert`` and ``name``: one expert's own parameter."""

    def __post_init__(self) -> None:
        for attr, groups in (("stacked", ("layer", "name")),
                             ("modules", ("layer", "expert", "name"))):
            pattern = getattr(self, attr)
            if pattern is None:
                continue
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ExpertDiscoveryError(
                    f"ExpertSpec.{attr} is not a valid regex ({exc}); fix the pattern") from exc
            missing = [g for g in groups if g not in compiled.groupindex]
            if missing:
                raise ExpertDiscoveryError(
                    f"ExpertSpec.{attr} must define named groups {groups}; "
                    f"missing {missing} in {pattern!r}")


@dataclass(slots=True)
class ExpertLayer:
    """One MoE layer: its name prefix, layout and expert tensors."""

    index: int
    prefix: str
    layout: str  # "stacked" | "modules"
    n_experts: int
    # stacked: local name -> full parameter name ([E, ...]).
    # modules: expert id -> {local name -> full parameter name}.
    stacked: dict[str, str] = field(default_factory=dict)
    modules: dict[int, dict[str, str]] = field(default_factory=dict)



@dataclass(slots=True)
class ExpertMap:
    """Result of discovery: the MoE layers and the non-expert parameter names."""

    layers: list[ExpertLayer]
    non_expert: list[str]
    # full parameter name -> (layer index, expert id or None for stacked)
    owner: dict[str, tuple[int, int | None]]

    @property
    def n_experts(self) -> tuple[int, ...]:
        return tuple(layer.n_experts for layer in self.layers)


def discover(model: nn.Module, spec: ExpertSpec | None = None) -> ExpertMap:
    """Find the experts of ``model``.

    Raises ExpertDiscoveryError when the result is ambiguous (a layer in both
    layouts, stacked tensors disagreeing on E, experts with different tensors or
    non-contiguous ids); the message shows what was found and how to override.
    """
    params = dict(model.named_parameters())
    layers, non_expert = _match_names(params, spec or ExpertSpec())
    owner: dict[str, tuple[int, int | None]] = {}
    for layer in layers:
        if layer.layout == "stacked":
            _check_stacked(layer, params, owner)
        else:
            _check_modules(layer, params, owner)
    return ExpertMap(layers=layers, non_expert=non_expert, owner=owner)


def _match_names(params: dict[str, nn.Parameter], spec: ExpertSpec
                 ) -> tuple[list[ExpertLayer], list[str]]:
    """Sort parameter names into expert layers (by the spec's patterns) and the rest."""
    stacked_re = re.compile(spec.stacked) if spec.stacked else None
    modules_re = re.compile(spec.modules) if spec.modules else None
    layers: dict[str, ExpertLayer] = {}
    non_expert: list[str] = []

    def layer_for(prefix: str, layout: str, name: str) -> ExpertLayer:
        layer = layers.get(prefix)
        if layer is None:
            layer = layers[prefix] = ExpertLayer(index=len(layers), prefix=prefix,
                                                 layout=layout, n_experts=0)
        elif layer.layout != layout:
            raise ExpertDiscoveryError(
                f"layer {prefix!r} has experts in both layouts (e.g. {name!r}); "
                f"pass moepec.ExpertSpec(stacked=..., modules=...) to say which parameters "
                f"are experts")
        return layer

    for name, param in params.items():
        m = modules_re.match(name) if modules_re else None
        if m:
            layer = layer_for(m["layer"], "modules", name)
            layer.modules.setdefault(int(m["expert"]), {})[m["name"]] = name
            continue
        m = stacked_re.match(name) if stacked_re else None
        if m:
            if param.dim() == 0:
                raise ExpertDiscoveryError(
                    f"{name!r} looks like a stacked expert weight but is a scalar; "
                    f"pass moepec.ExpertSpec(stacked=None) or a narrower pattern")
            layer_for(m["layer"], "stacked", name).stacked[m["name"]] = name
            continue
        non_expert.append(name)
    return list(layers.values()), non_expert


def _check_stacked(layer: ExpertLayer, params: dict[str, nn.Parameter],
                   owner: dict[str, tuple[int, int | None]]) -> None:
    """A stacked layer's tensors must agree on E (dim 0)."""
    sizes = {n: params[full].shape[0] for n, full in layer.stacked.items()}
    if len(set(sizes.values())) != 1:
        raise ExpertDiscoveryError(
            f"stacked expert tensors of {layer.prefix!r} disagree on the expert "
            f"dimension (dim 0): {sizes}; pass moepec.ExpertSpec(stacked=...) "
            f"matching only the [E, ...] expert weights")
    layer.n_experts = next(iter(sizes.values()))
    for full in layer.stacked.values():
        owner[full] = (layer.index, None)


def _check_modules(layer: ExpertLayer, params: dict[str, nn.Parameter],
                   owner: dict[str, tuple[int, int | None]]) -> None:
    """A modules layer's experts must be numbered 0..E-1 and alike."""
    ids = sorted(layer.modules)
    if ids != list(range(len(ids))):
        raise ExpertDiscoveryError(
            f"experts of {layer.prefix!r} have ids {ids}, expected 0..{len(ids) - 1}; "
            f"pass moepec.ExpertSpec(modules=...) with an `expert` group that "
            f"captures the expert index")
    shapes0 = {n: tuple(params[f].shape) for n, f in layer.modules[0].items()}
    for e in ids:
        shapes = {n: tuple(params[f].shape) for n, f in layer.modules[e].items()}
        if shapes != shapes0:
            raise ExpertDiscoveryError(
                f"expert {e} of {layer.prefix!r} has tensors {shapes} but expert 0 "
                f"has {shapes0}; experts of one layer must be alike")
        for full in layer.modules[e].values():
            owner[full] = (layer.index, e)
    layer.n_experts = len(ids)


def canonical_expert_name(layer: ExpertLayer, name: str, expert: int) -> str:
    """The layout- and placement-independent name of one expert's parameter.

    Stacked parameters keep their full name (the expert is a slice). Per-expert modules
    are named ``<layer prefix>.experts.<global id>.<name>`` whatever local index
    the module has on this rank, so a checkpoint saved under one expert-parallel
    placement restores under another.
    """
    if layer.layout == "stacked":
        return layer.stacked[name]
    return f"{layer.prefix}.experts.{expert}.{name}"


def structure_of(model: nn.Module, emap: ExpertMap, ep_size: int = 1) -> dict:
    """A JSON-able description of the model's global structure and its fingerprint.

    Expert tensors are described at their global size (all ``ep_size`` shards), so
    the same model trained at any (DP, EP) layout has the same structure.
    """
    params = []
    for name, p in model.named_parameters():
        dtype = str(p.dtype).removeprefix("torch.")
        owner = emap.owner.get(name)
        if owner is None:
            params.append([name, list(p.shape), dtype])
            continue
        layer = emap.layers[owner[0]]
        if layer.layout == "stacked":
            params.append([name, [p.shape[0] * ep_size] + list(p.shape[1:]), dtype])
        elif owner[1] == 0:
            local = next(n for n, full in layer.modules[0].items() if full == name)
            for g in range(layer.n_experts * ep_size):
                params.append([canonical_expert_name(layer, local, g), list(p.shape), dtype])
    params.sort()
    experts = [[layer.prefix, layer.layout, layer.n_experts * ep_size] for layer in emap.layers]
    digest = hashlib.sha256(repr((params, experts)).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "params": params, "experts": experts}


def structure_mismatches(saved: dict, current: dict, limit: int = 5) -> list[str]:
    """Human-readable differences between two ``structure_of`` results (first ``limit``)."""
    out: list[str] = []
    if saved["experts"] != current["experts"]:
        for i in range(max(len(saved["experts"]), len(current["experts"]))):
            a = saved["experts"][i] if i < len(saved["experts"]) else None
            b = current["experts"][i] if i < len(current["experts"]) else None
            if a != b:
                out.append(f"MoE layer {i}: checkpoint has {a}, model has {b}")
    sp = {n: (s, d) for n, s, d in saved["params"]}
    cp = {n: (s, d) for n, s, d in current["params"]}
    for name in sp.keys() - cp.keys():
        out.append(f"parameter {name!r} is in the checkpoint but not in the model")
    for name in cp.keys() - sp.keys():
        out.append(f"parameter {name!r} is in the model but not in the checkpoint")
    for name in sp.keys() & cp.keys():
        if sp[name] != cp[name]:
            out.append(f"parameter {name!r}: checkpoint shape/dtype {sp[name]}, "
                       f"model {cp[name]}")
    return sorted(out)[:limit] if len(out) > limit else sorted(out)


def expert_slice(tensor: torch.Tensor, layer: ExpertLayer, expert: int) -> torch.Tensor:
    """The part of ``tensor`` (a parameter or its per-element state) that is ``expert``."""
    return tensor[expert] if layer.layout == "stacked" else tensor
