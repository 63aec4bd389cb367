"""Where a model's experts are, read from its module structure (not from names alone).

The scan walks ``model.named_modules()`` and reports every *candidate*: a group of tensors
that looks like the experts of one MoE layer, whether it was taken or refused and why.
:func:`moepec.state.experts.discover` turns the taken ones into expert layers; the refused
ones are what the "no experts found" message and ``moepec experts`` list.

What counts as experts (issue 15: never guess):

- **stacked**: the direct parameters of an *experts module* -- one whose attribute name is
  ``experts``, ``routed_experts`` or ``inner_experts`` (torchtitan) or whose class name
  ends in ``Experts`` (Hugging Face ``MixtralExperts``, JetMoe's ``JetMoeParallelExperts``)
  -- or 3-D parameters of any module whose parent also holds a router/gate with E outputs.
  The ``[E, ...]`` tensors of 3 or more dimensions must agree on E. A 1-D or 2-D tensor
  joins them only inside such a module and only when its dim 0 is E too (GPT-OSS's
  ``gate_up_proj_bias [E, 2F]``); one alone (JetMoe's ``experts.bias [D]``) is never taken.
- **modules**: a ``ModuleList``/``ModuleDict`` with keys ``0..E-1`` named ``*experts``, or
  one of alike modules whose parent holds a router/gate with E outputs.
- Shared experts (attribute or class name containing ``shared``) are non-expert state:
  every token goes through them, so they are saved at every checkpoint.

Pure: reads the module tree, changes nothing, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from moepec.errors import ExpertDiscoveryError

CONTAINER_NAMES = frozenset({"experts", "routed_experts", "inner_experts"})
"""Attribute names of a module whose direct parameters are stacked experts."""
ROUTER_NAMES = frozenset({"gate", "router", "gating", "route", "classifier"})
"""Attribute names of a router (its 2-D weight has one row per expert)."""
_ROUTER_CLASS_WORDS = ("router", "gating", "topkgate", "gate")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One group of tensors that looks like the experts of an MoE layer."""

    prefix: str
    """Module path of the MoE layer (the experts module's parent)."""
    container: str
    """Attribute name of the experts module under ``prefix`` (``experts``, ``inner_experts``)."""
    layout: str
    """``stacked`` (``[E, ...]`` tensors) or ``modules`` (one module per expert)."""
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    """Full parameter names and shapes."""
    n_experts: int
    """E, the experts the group holds (0 where it has no agreed E)."""
    taken: bool
    """Whether discovery takes the tensors as experts."""
    why: str
    """In plain words, why it was taken or refused."""


def scan(model: nn.Module, ragged: bool = False) -> list[Candidate]:
    """Every expert candidate of ``model``, in module order.

    ``ragged`` (``ExpertSpec.ragged``): stacked tensors of one experts module may disagree
    on dim 0, E being the largest. Raises ExpertDiscoveryError for a layout moepec must
    not guess at: a module holding both layouts, stacked ``[E, ...]`` tensors of an
    experts module that disagree on E.
    """
    out: list[Candidate] = []
    for path, mod in model.named_modules():
        attr = path.rsplit(".", 1)[-1]
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else (
            model if path else None)
        shared = "shared" in attr.lower() or "shared" in type(mod).__name__.lower()
        if _is_indexed_list(mod):
            cand = _modules_candidate(path, attr, mod, parent, shared)
            if cand is not None:
                out.append(cand)
            continue
        direct = [(n, p) for n, p in mod.named_parameters(recurse=False) if p is not None]
        if not direct:
            continue
        named = attr in CONTAINER_NAMES or type(mod).__name__.lower().endswith("experts")
        out.extend(_stacked_candidates(path, attr, direct, named and not shared, shared,
                                       parent, mod, ragged))
    return out


def _is_indexed_list(mod: nn.Module) -> bool:
    keys = [n for n, _ in mod.named_children()]
    return isinstance(mod, nn.ModuleList | nn.ModuleDict) and bool(keys) and all(
        k.isdigit() for k in keys)


def _prefix_of(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _full(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def is_router_name(attr: str, cls: str) -> bool:
    """Whether a child named ``attr`` of class ``cls`` is taken for a router."""
    return attr in ROUTER_NAMES or any(w in cls.lower() for w in _ROUTER_CLASS_WORDS)


def router_outputs(mod: nn.Module | None) -> set[int]:
    """Rows of the 2-D weights of ``mod``'s router/gate children (its expert counts)."""
    if mod is None:
        return set()
    out: set[int] = set()
    for name, child in mod.named_children():
        if is_router_name(name, type(child).__name__):
            out |= {p.shape[0] for p in child.parameters() if p.dim() == 2}
    for name, p in mod.named_parameters(recurse=False):
        if name.split("_")[0] in ROUTER_NAMES and p.dim() == 2:
            out.add(p.shape[0])
    return out


def _modules_candidate(path: str, attr: str, mod: nn.Module, parent: nn.Module | None,
                       shared: bool) -> Candidate | None:
    """A list of per-expert modules, or None when it is an ordinary list (decoder layers)."""
    if any(True for _ in mod.named_parameters(recurse=False)):
        raise ExpertDiscoveryError(
            f"{path!r} holds per-expert modules and stacked tensors ({attr}.<e>.* and "
            f"{attr}.<name>): experts in both layouts; pass moepec.ExpertSpec(stacked=..., "
            f"modules=...) to say which parameters are experts")
    children = list(mod.named_children())
    tensors = tuple((_full(path, n), tuple(p.shape)) for n, p in mod.named_parameters())
    if not tensors:
        return None
    sigs = {tuple((n, tuple(p.shape)) for n, p in c.named_parameters()) for _, c in children}
    named = attr.lower().endswith("experts")
    if shared:
        return Candidate(_prefix_of(path), attr, "modules", tensors, len(children), False,
                         "shared experts: every token uses them; saved as non-expert state")
    if named:
        return Candidate(_prefix_of(path), attr, "modules", tensors, len(children), True,
                         f"a list of {len(children)} expert modules named {attr!r}")
    if len(sigs) == 1 and len(children) in router_outputs(parent):
        return Candidate(_prefix_of(path), attr, "modules", tensors, len(children), True,
                         f"{len(children)} alike modules beside a router with "
                         f"{len(children)} outputs")
    return None


def _stacked_candidates(path: str, attr: str, direct: list, named: bool, shared: bool,
                        parent: nn.Module | None, mod: nn.Module, ragged: bool
                        ) -> list[Candidate]:
    """The direct parameters of one module: taken as stacked experts, refused, or nothing."""
    prefix = _prefix_of(path)
    anchors = {n: p.shape[0] for n, p in direct if p.dim() >= 3}

    def cand(items, n_experts: int, taken: bool, why: str) -> Candidate:
        # An experts module's layer is its parent; a module holding [E, ...] tensors of its
        # own (beside its router) is the layer itself.
        return Candidate(prefix if named or shared else path, attr, "stacked",
                         tuple((_full(path, n), tuple(p.shape)) for n, p in items),
                         n_experts, taken, why)

    if shared:
        if anchors:
            return [cand(direct, 0, False, "shared experts: every token uses them; saved "
                                            "as non-expert state")]
        return []
    if not named:
        if not anchors:
            return []
        return _beside_router(direct, anchors, router_outputs(parent) | router_outputs(mod),
                              cand)
    return _in_experts_module(path, attr, direct, anchors, ragged, cand)


def _beside_router(direct: list, anchors: dict[str, int], routers: set[int],
                   cand: Callable[..., Candidate]) -> list[Candidate]:
    """[E, ...] tensors outside an experts module: taken when they agree on E and a
    router with E outputs sits beside them."""
    sizes = set(anchors.values())
    items = [(n, p) for n, p in direct if n in anchors]
    if len(sizes) == 1 and sizes <= routers:
        e = sizes.pop()
        return [cand(items, e, True, f"[E, ...] tensors agreeing on E={e} beside a "
                                     f"router with {e} outputs")]
    return [cand(items, 0, False,
                 f"[E, ...] tensors (dim 0: {sorted(sizes)}) outside an experts module "
                 f"and with no router of that many outputs beside them")]


def _in_experts_module(path: str, attr: str, direct: list, anchors: dict[str, int],
                       ragged: bool, cand: Callable[..., Candidate]) -> list[Candidate]:
    """The direct parameters of an experts module: the [E, ...] ones (E agreed, or
    ragged) are the experts, the rest non-expert state. Raises ExpertDiscoveryError when
    they disagree on E and ``ragged`` is off."""
    if not anchors:
        return [cand(direct, 0, False,
                     f"only 1-D/2-D tensors in the experts module {attr!r}: nothing shows "
                     f"which dimension counts experts")]
    sizes = set(anchors.values())
    if len(sizes) > 1 and not ragged:
        shapes = {n: list(p.shape) for n, p in direct if n in anchors}
        raise ExpertDiscoveryError(
            f"stacked expert tensors of {path!r} disagree on the expert dimension (dim 0): "
            f"{shapes}; if the larger ones fuse extra experts after the routed ones "
            f"(LongcatFlash's zero experts) pass moepec.ExpertSpec(ragged=True), else pass "
            f"moepec.ExpertSpec(stacked=...) matching only the [E, ...] expert weights")
    e = max(sizes)
    members = [(n, p) for n, p in direct if n in anchors or p.shape[0:1] == (e,)
               or (ragged and p.dim() >= 1 and p.shape[0] in sizes)]
    names = {n for n, _ in members}
    out = [cand(members, e, True,
                f"experts module {attr!r}: [E, ...] tensors agree on E={e}"
                + (f" (ragged: dim 0 in {sorted(sizes)})" if len(sizes) > 1 else ""))]
    rest = [(n, p) for n, p in direct if p.dim() < 3 and n not in names]
    if rest:
        out.append(cand(rest, 0, False, f"dim 0 differs from the experts' E={e} (or a "
                                         f"scalar): non-expert state"))
    return out


def _pattern_of(path: str) -> str:
    """A regex for a module path with every index generalised (``layers.3`` -> ``layers.\\d+``)."""
    return r"\.".join(r"\d+" if seg.isdigit() else re.escape(seg) for seg in path.split("."))


def suggest_spec(candidates: list[Candidate]) -> str:
    """A ready ``moepec.ExpertSpec(...)`` for the first refused candidate (or a template)."""
    refused = [c for c in candidates if not c.taken and "shared" not in c.why]
    # [E, ...] tensors first: a refused 1-D bias is rarely what the user means
    refused.sort(key=lambda c: -max(len(s) for _, s in c.tensors))
    if refused:
        c = refused[0]
        names = sorted({full[len(c.prefix) + 1 if c.prefix else 0:] for full, _ in c.tensors})
        if c.layout == "stacked":
            alt = "|".join(re.escape(n) for n in names)
            return (f'moepec.ExpertSpec(stacked=r"^(?P<layer>{_pattern_of(c.prefix)})\\.'
                    f'(?P<name>{alt})$")')
        return (f'moepec.ExpertSpec(modules=r"^(?P<layer>{_pattern_of(c.prefix)})\\.'
                f'{re.escape(c.container)}\\.(?P<expert>\\d+)\\.(?P<name>.+)$")')
    return ('moepec.ExpertSpec(stacked=r"^(?P<layer>.+)\\.experts\\.(?P<name>[^.]+)$", '
            'modules=r"^(?P<layer>.+)\\.experts\\.(?P<expert>\\d+)\\.(?P<name>.+)$")  '
            '# edit to your parameter names')
