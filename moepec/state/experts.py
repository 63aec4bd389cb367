"""Find the experts of a model and map each (layer, expert) to its tensors.

Two layouts are recognised (see DESIGN.md, "expert"):

- *stacked* (torchtitan, Hugging Face transformers 5.x): one parameter ``[E, ...]`` per
  expert weight; expert ``e`` is the slice ``[e]`` of dim 0.
- *modules* (Hugging Face transformers 4.x Mixtral): one module per expert,
  ``<layer>.experts.<e>.<name>``.

By default the experts are found from the module structure (:mod:`moepec.state.expert_scan`:
experts modules, routers, agreeing ``[E, ...]`` tensors), never from a name alone, and what
was looked at and refused is kept for the messages (:func:`describe`). An
:class:`ExpertSpec` with patterns switches to matching names instead.

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
from moepec.state.expert_scan import Candidate, is_router_name, scan, suggest_spec

STACKED_PATTERN = r"^(?P<layer>.+)\.experts\.(?P<name>[A-Za-z_][^.]*)$"
"""The name-only pattern of stacked experts moepec used before structural discovery."""
MODULES_PATTERN = r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<name>.+)$"
"""The name-only pattern of per-expert modules moepec used before structural discovery."""


@dataclass(kw_only=True, slots=True)
class ExpertSpec:
    """How to recognise expert parameters, when the structural discovery cannot.

    With no pattern (the default) experts are found from the module structure. Set
    ``stacked`` and/or ``modules`` to match parameter names instead (only the layouts
    whose pattern is set are looked for); ``moepec experts MODULE:FACTORY`` and the
    "no experts found" message print a ready one for the candidates they saw.
    """

    stacked: str | None = None
    """Regex with groups ``layer`` and ``name``: a stacked ``[E, ...]`` expert parameter."""
    modules: str | None = None
    """Regex with groups ``layer``, ``expert`` and ``name``: one expert's own parameter."""
    ragged: bool = False
    """Stacked tensors of one layer may disagree on dim 0: the routed experts are the first
    rows of every tensor and the larger ones fuse extra experts after them (LongcatFlash:
    ``gate_up_proj [routed + zero experts, ...]``, ``down_proj [routed, ...]``). The layer
    then has as many experts as the largest dim 0 (the router's outputs) and expert ``e`` is
    slice ``[e]`` of every tensor with more than ``e`` rows. Not with expert parallelism."""

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
        if not isinstance(self.ragged, bool):
            raise ExpertDiscoveryError(f"ExpertSpec.ragged must be True or False "
                                       f"(got {self.ragged!r})")

    @property
    def by_name(self) -> bool:
        """Whether this spec matches names (a pattern is set) instead of the structure."""
        return self.stacked is not None or self.modules is not None


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
    container: str = "experts"
    """Attribute name of the per-expert modules' list (``modules`` layout)."""
    rows: dict[str, int] = field(default_factory=dict)
    """Stacked: dim 0 of each tensor (all ``n_experts`` unless ``ExpertSpec.ragged``)."""

    def tensors_of(self, local: int) -> dict[str, str]:
        """Local name -> full parameter name of this rank's expert ``local``."""
        if self.layout == "modules":
            return self.modules[local]
        return {n: f for n, f in self.stacked.items()
                if self.rows.get(n, self.n_experts) > local}


@dataclass(slots=True)
class ExpertMap:
    """Result of discovery: the MoE layers and the non-expert parameter names."""

    layers: list[ExpertLayer]
    non_expert: list[str]
    # full parameter name -> (layer index, expert id or None for stacked)
    owner: dict[str, tuple[int, int | None]]
    candidates: list[Candidate] = field(default_factory=list)
    """What the structural scan looked at (empty for a spec that matches names)."""
    by_name: bool = False
    """Whether an ExpertSpec's patterns found the layers (else the structure did)."""

    @property
    def n_experts(self) -> tuple[int, ...]:
        return tuple(layer.n_experts for layer in self.layers)

    @property
    def ragged(self) -> bool:
        return any(len(set(lay.rows.values())) > 1 for lay in self.layers)


def discover(model: nn.Module, spec: ExpertSpec | None = None) -> ExpertMap:
    """Find the experts of ``model`` (any rank; pure: reads the model, changes nothing).

    Finding none is not an error here (the manager decides, ``require_experts``); see
    :func:`describe` for what was looked at. Raises ExpertDiscoveryError when the result
    is ambiguous (a layer in both layouts, stacked tensors disagreeing on E, experts with
    different tensors or non-contiguous ids); the message shows what was found and which
    ExpertSpec to pass.
    """
    spec = spec or ExpertSpec()
    params = dict(model.named_parameters())
    if spec.by_name:
        layers, non_expert = _match_names(params, spec)
        candidates: list[Candidate] = []
    else:
        candidates = scan(model, ragged=spec.ragged)
        layers = _layers_of(candidates, params)
        claimed = {f for lay in layers for f in _all_names(lay)}
        non_expert = [n for n in params if n not in claimed]
    order = {n: i for i, n in enumerate(params)}
    layers.sort(key=lambda lay: min(order[f] for f in _all_names(lay)))
    owner: dict[str, tuple[int, int | None]] = {}
    for i, layer in enumerate(layers):
        layer.index = i
        if layer.layout == "stacked":
            _check_stacked(layer, params, owner, spec.ragged)
        else:
            _check_modules(layer, params, owner)
    return ExpertMap(layers=layers, non_expert=non_expert, owner=owner,
                     candidates=candidates, by_name=spec.by_name)


def _all_names(layer: ExpertLayer) -> list[str]:
    if layer.layout == "stacked":
        return list(layer.stacked.values())
    return [f for names in layer.modules.values() for f in names.values()]


def _layers_of(candidates: list[Candidate], params: dict[str, nn.Parameter]
               ) -> list[ExpertLayer]:
    """One layer per MoE layer prefix from the taken candidates (JetMoe's ``input_linear``
    and ``output_linear`` experts modules under one ``mlp`` are one layer)."""
    layers: dict[str, ExpertLayer] = {}
    in_modules: set[str] = set()
    for c in candidates:
        if not c.taken or c.layout != "modules":
            continue
        layer = layers.setdefault(c.prefix, ExpertLayer(
            index=0, prefix=c.prefix, layout="modules", n_experts=0, container=c.container))
        base = f"{c.prefix}.{c.container}." if c.prefix else f"{c.container}."
        for full, _ in c.tensors:
            expert, local = full[len(base):].split(".", 1)
            layer.modules.setdefault(int(expert), {})[local] = full
            in_modules.add(full)
    for c in candidates:
        if not c.taken or c.layout != "stacked" or any(f in in_modules for f, _ in c.tensors):
            continue
        layer = layers.get(c.prefix)
        if layer is None:
            layer = layers[c.prefix] = ExpertLayer(index=0, prefix=c.prefix,
                                                   layout="stacked", n_experts=0)
        elif layer.layout != "stacked":
            raise ExpertDiscoveryError(
                f"layer {c.prefix!r} has experts in both layouts (e.g. {c.tensors[0][0]!r}); "
                f"pass moepec.ExpertSpec(stacked=..., modules=...) to say which parameters "
                f"are experts")
        base = f"{c.prefix}." if c.prefix else ""
        for full, _ in c.tensors:
            local = full[len(base):]
            layer.stacked[local.removeprefix("experts.")] = full
    return list(layers.values())


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
                   owner: dict[str, tuple[int, int | None]], ragged: bool = False) -> None:
    """A stacked layer's tensors must agree on E (dim 0), or with ``ragged`` the layer has
    as many experts as the largest dim 0."""
    sizes = {n: params[full].shape[0] for n, full in layer.stacked.items()}
    if len(set(sizes.values())) != 1 and not ragged:
        raise ExpertDiscoveryError(
            f"stacked expert tensors of {layer.prefix!r} disagree on the expert "
            f"dimension (dim 0): {sizes}; if the larger ones fuse extra experts after the "
            f"routed ones (LongcatFlash's zero experts) pass moepec.ExpertSpec(ragged=True), "
            f"else pass moepec.ExpertSpec(stacked=...) matching only the [E, ...] expert "
            f"weights")
    layer.n_experts = max(sizes.values())
    layer.rows = dict(sizes)
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
    are named ``<layer prefix>.<container>.<global id>.<name>`` whatever local index
    the module has on this rank, so a checkpoint saved under one expert-parallel
    placement restores under another.
    """
    if layer.layout == "stacked":
        return layer.stacked[name]
    prefix = f"{layer.prefix}." if layer.prefix else ""
    return f"{prefix}{layer.container}.{expert}.{name}"


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


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def describe(emap: ExpertMap, params: dict[str, nn.Parameter] | None = None,
             limit: int = 12) -> str:
    """What discovery found and what it refused, for people (``moepec experts``, the
    "no experts found" error). ``params`` (the model's) adds the shapes of taken tensors."""
    lines: list[str] = []
    how = "by the ExpertSpec's name patterns" if emap.by_name else "from the module structure"
    if emap.layers:
        lines.append(f"{len(emap.layers)} MoE layer(s) found {how}:")
        for lay in emap.layers[:limit]:
            names = lay.tensors_of(0) if lay.layout == "modules" else lay.stacked
            shown = ", ".join(
                f"{n} {_shape(params[f].shape)}" if params else n for n, f in names.items())
            where = f"{lay.prefix}.{lay.container}.<e>" if lay.layout == "modules" \
                else lay.prefix
            lines.append(f"  layer {lay.index}: {where or '(root)'}  {lay.layout}  "
                         f"E={lay.n_experts}  {shown}")
        if len(emap.layers) > limit:
            lines.append(f"  ... and {len(emap.layers) - limit} more")
    else:
        lines.append(f"no experts found {how}")
    refused = [c for c in emap.candidates if not c.taken]
    if refused:
        lines.append("not taken as experts:")
        seen: set[str] = set()
        for c in refused:
            tensors = ", ".join(f"{full} {_shape(s)}" for full, s in c.tensors[:4])
            key = re.sub(r"\.\d+\.", ".N.", tensors)  # one line per kind, not per layer
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"  {tensors}: {c.why}")
            if len(seen) >= limit:
                break
    if not emap.layers or any(len(shape) >= 3 and "shared" not in c.why
                              for c in refused for _, shape in c.tensors):
        lines.append(f"if these are experts, pass expert_spec={suggest_spec(emap.candidates)}")
    return "\n".join(lines)


def find_router(block: nn.Module, n_experts: int) -> nn.Module | None:
    """The router of the MoE layer ``block`` (an :class:`ExpertLayer`'s ``prefix``
    module): the child the structural scan takes as its router (named ``gate``,
    ``router``... or of a class named like one) with a 2-D weight of ``n_experts`` rows;
    None if it has none. For a door's routing counts; pure."""
    for name, child in block.named_children():
        if is_router_name(name, type(child).__name__) and any(
                p.dim() == 2 and p.shape[0] == n_experts for p in child.parameters()):
            return child
    return None
