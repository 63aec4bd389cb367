"""DeepSpeed's checkpoint files as moepec flat keys, and back.

Each file DeepSpeed hands its checkpoint engine (``engine.checkpoint_engine.save(sd,
path)``) becomes flat keys ``"<file name>/<path in the state dict>"`` (CPU tensors) and
one skeleton key ``"<file name>/__skeleton__"``: the state dict with every tensor
replaced by a reference, as tagged JSON (:func:`moepec.flat.encode_object`; nothing is
unpickled on the way back). Which expert unit ``(layer, expert)`` a key belongs to:

- ``layer_{L}_expert_{E}_mp_rank_{MM}_model_states.pt``: every key (skeleton included) is
  expert ``E`` of MoE layer ``L`` (DeepSpeed's own numbering: the L-th ``MoE`` module in
  ``named_modules()`` order, E the global expert index);
- a flat optimizer partition (ZeRO-1/2's ``zero_pp_rank_*`` files, bf16's optimizer: any
  dict with ``param_slice_mappings``): each flat tensor of a parameter group that holds
  expert parameters (the fp32 master partition, each moment of the same length) is cut
  into one key per parameter fragment, an expert's with its unit, and the gaps between
  fragments (padding) as keys of their own;
- a torch optimizer's ``state_dict()`` (ZeRO-0: ``state`` keyed by parameter index):
  each parameter's state goes with that parameter's unit;
- anything else (non-expert module state, scalars, RNG) is non-expert state.

Expert tensors are named by a map from parameter name to unit, or to :class:`Rows` for a
stacked ``[E, ...]`` parameter (:mod:`moepec.integrations.ds_experts`): its tensors in the
module (``"module"``) and a torch optimizer's state are cut into one key per expert row,
its ZeRO-1/2 fragments at the row boundaries inside them (a fragment may start or end
inside a row: the partition boundary).

Pure (no I/O, no collectives), as are :func:`location` (where a save's files live) and
:data:`DS_FILE` (the file names a tag may hold).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moepec.errors import CorruptCheckpointError
from moepec.flat import Unit, decode_object, encode_object

HF_CHECKPOINT = re.compile(r"^checkpoint[-_]\d+$")
"""A checkpoint folder of the Hugging Face Trainer (``checkpoint-<N>``) or of Accelerate's
automatic naming (``checkpoint_<i>``): one DeepSpeed tag inside each."""
LIGHTNING_TAG = "checkpoint"
"""The tag Lightning's ``DeepSpeedStrategy.save_checkpoint`` always gives."""
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_\d+_model_states\.pt$")
DS_FILE = re.compile(
    r"(?:mp_rank_[0-9]+_model_states"                              # _get_ckpt_name
    r"|zero_pp_rank_[0-9]+_mp_rank_[0-9]+_model_states"            # ... at ZeRO-3
    r"|(?:bf16_)?zero_pp_rank_[0-9]+_mp_rank_[0-9]+_optim_states"  # _get_rank_zero_ckpt_name
    r"|expp_rank_[0-9]+_mp_rank_[0-9]+_optim_states"               # _get_optimizer_ckpt_name
    r"|(?:layer_[0-9]+_)?expert_[0-9]+_mp_rank_[0-9]+_model_states"  # _get_expert_ckpt_name
    r"|layer_[0-9]+(?:-[a-z]+_[0-9]+)*-model_states"               # PipelineModule's layers
    r")\.pt")
"""Every name DeepSpeed 0.19.8 gives a file of a checkpoint tag (``runtime/engine.py``,
``runtime/pipe/module.py``), for ``fullmatch``: a plain name, never a path. A file name
read from a checkpoint is used only if it is one of these."""
SKELETON = "__skeleton__"
_MARK = "__moepec_ds__"
_ALLOWED = {
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
}
"""DeepSpeed's own types found in its checkpoint files, rebuilt by name on load (their
plain fields), never by unpickling."""


def location(save_dir: str, tag: str) -> tuple[str, str]:
    """Where the moepec checkpoint of DeepSpeed's ``save_dir/tag`` lives: (root, folder).
    Normally ``(save_dir, tag)``: the tags of one save directory are one lineage. A save
    directory named ``checkpoint-<N>`` (the Hugging Face Trainer's, one tag each) or
    ``checkpoint_<i>`` (Accelerate's ``save_state``, its tag always ``pytorch_model``) is
    itself the folder, its parent the root, so that those checkpoints are one lineage and
    a checkpoint folder deleted takes its experts' copies with it. So is a Lightning
    checkpoint (``DeepSpeedStrategy``: a folder ``<name>.ckpt`` holding the tag
    ``checkpoint``; ``ModelCheckpoint`` names them so)."""
    save_dir = os.path.abspath(save_dir)
    parent, base = os.path.split(save_dir)
    if HF_CHECKPOINT.match(base) or (str(tag) == LIGHTNING_TAG and base.endswith(".ckpt")):
        return parent, base
    return save_dir, str(tag)


def layer_name(layer: int) -> str:
    """The flat front end's name of DeepSpeed's MoE layer ``layer`` (natural order)."""
    return f"layer_{layer}"


def file_unit(name: str) -> Unit | None:
    """The expert unit of a whole file (an expert's weights file), None for others."""
    m = EXPERT_FILE.match(name)
    return (layer_name(int(m[1])), int(m[2])) if m else None


@dataclasses.dataclass(frozen=True, slots=True)
class Rows:
    """A stacked expert parameter ``[E, ...]`` of ``numel`` elements: expert ``e`` is its
    row ``e`` (``numel // experts`` elements, contiguous in the flattened parameter).
    ``offset``: where this rank's ZeRO-1/2 fragment of it starts (in the flattened
    parameter); a fragment may begin and end inside a row."""

    layer: str
    experts: int
    numel: int
    offset: int = 0

    def pieces(self, start: int, numel: int, offset: int) -> list[tuple[int, int, Unit]]:
        """The ``numel`` elements at ``start`` of a flat tensor, which hold this
        parameter's elements from ``offset`` on, cut at row boundaries: (start, numel,
        unit) per piece."""
        per = self.numel // self.experts
        out, at = [], 0
        while at < numel:
            e = (offset + at) // per
            end = min(numel, (e + 1) * per - offset)
            out.append((start + at, end - at, (self.layer, e)))
            at = end
        return out


Rule = Unit | Rows | None
"""What of a tensor is whose: one unit's, rows of units, or non-expert."""


@dataclasses.dataclass(slots=True)
class Split:
    """One file as flat keys."""

    tensors: dict[str, torch.Tensor]
    units: dict[str, Unit | None]


class _Splitter:
    def __init__(self, name: str, params: Mapping[str, Unit | Rows],
                 opt_index: Mapping[int, str], to_cpu: bool = True,
                 zero3: Sequence[Sequence[tuple[str, int, int]]] | None = None):
        self.name, self.params, self.opt_index = name, params, opt_index
        self.zero3 = zero3
        self.unit = file_unit(name)
        self.out = Split({}, {})
        self.to_cpu = to_cpu

    def key(self, path: list[Any]) -> str:
        return f"{self.name}/" + "/".join(str(p) for p in path)

    def put(self, t: torch.Tensor, path: list[Any], unit: Unit | None) -> dict[str, Any]:
        k = self.key(path)
        self.out.tensors[k] = t.detach().cpu() if self.to_cpu else t.detach()
        self.out.units[k] = self.unit if self.unit is not None else unit
        return {_MARK: "t", "k": k}

    def walk(self, x: Any, path: list[Any], unit: Rule = None) -> Any:
        if isinstance(x, torch.Tensor):
            if isinstance(unit, Rows):
                return self.rows(x, path, unit)
            return self.put(x, path, unit)
        if isinstance(x, dict):
            if path == ["module"]:  # the model's parameters by name
                return {k: self.walk(v, path + [k], self.params.get(k)) for k, v in x.items()}
            if "param_slice_mappings" in x:
                return self.flat_optimizer(x, path)
            if "fp32_flat_groups" in x and self.zero3 is not None:
                return self.zero3_optimizer(x, path)
            if _is_torch_optimizer(x):
                return self.torch_optimizer(x, path)
            if _is_grouped(x.get("fp32_groups")):  # fp16/bf16 at ZeRO-0: fp32 copies
                return {k: self.walk(v, path + [k]) if k != "fp32_groups" else
                        self.by_position(v, path + [k]) for k, v in x.items()}
            return {k: self.walk(v, path + [k], unit) for k, v in x.items()}
        if isinstance(x, torch.Size):  # ZeRO-3's param_shapes: DeepSpeed's tools call numel()
            return {_MARK: "size", "v": list(x)}
        if isinstance(x, list) or (isinstance(x, tuple) and not hasattr(x, "_fields")):
            return type(x)(self.walk(v, path + [i], unit) for i, v in enumerate(x))
        return _plain(x)

    def rows(self, t: torch.Tensor, path: list[Any], rows: Rows) -> Any:
        """A whole stacked parameter (or a state of its shape) as one key per expert; any
        other tensor of its optimizer state (a step count) as non-expert."""
        if t.dim() == 0 or t.shape[0] != rows.experts or t.numel() != rows.numel:
            return self.put(t, path, None)
        flat = self.cut(t.reshape(-1), path, rows.pieces(0, t.numel(), 0))
        return {**flat, "shape": list(t.shape)}

    def torch_optimizer(self, x: dict, path: list[Any]) -> Any:
        state = {i: {k: self.walk(v, path + ["state", i, k],
                                  self.params.get(self.opt_index.get(i, ""), None))
                     for k, v in s.items()} for i, s in x["state"].items()}
        rest = {k: self.walk(v, path + [k]) for k, v in x.items() if k != "state"}
        return {"state": state, **rest}

    def by_position(self, groups: list, path: list[Any]) -> Any:
        """Per-parameter tensors in the optimizer's order, each with its unit."""
        out, i = [], 0
        for g, group in enumerate(groups):
            row = []
            for j, t in enumerate(group):
                row.append(self.walk(t, path + [g, j],
                                     self.params.get(self.opt_index.get(i, ""))))
                i += 1
            out.append(row)
        return out

    def flat_optimizer(self, x: dict, path: list[Any]) -> Any:
        maps = x["param_slice_mappings"]
        flats: dict[int, list[tuple[int, int, Unit | None]]] = {}
        for g, mapping in enumerate(maps):
            frags = sorted(piece for n, a in mapping.items() for piece in
                           self.fragment(self.params.get(n), int(a.start), int(a.numel)))
            if any(u is not None for _, _, u in frags):
                flats[g] = frags
        return self._cut_partitions(x, path, flats, "single_partition_of_fp32_groups",
                                    "base_optimizer_state")

    def zero3_optimizer(self, x: dict, path: list[Any]) -> Any:
        """ZeRO-3's optimizer state: per sub-group a flat fp32 partition
        (``fp32_flat_groups``) and moments of its length (``optimizer_state_dict``),
        each cut by :attr:`zero3` (the parameters' parts, from the engine)."""
        flats = {}
        for g, frags in enumerate(self.zero3 or []):
            pieces = sorted(p for n, start, numel in frags if numel
                            for p in self.fragment(self.params.get(n), start, numel))
            if any(u is not None for _, _, u in pieces):
                flats[g] = pieces
        return self._cut_partitions(x, path, flats, "fp32_flat_groups",
                                    "optimizer_state_dict")

    def _cut_partitions(self, x: dict, path: list[Any], flats: dict, masters: str,
                        moments: str) -> Any:
        """A ZeRO optimizer file's flat partitions cut by ``flats`` (per group, the
        fragments of each partition): the fp32 masters (list field ``masters``) and the
        moments of the same length (``moments``' per-group ``state``); the rest walked."""
        out = {}
        for k, v in x.items():
            if k == masters:
                out[k] = [self.cut(t, path + [k, g], flats.get(g)) for g, t in enumerate(v)]
            elif k == moments and isinstance(v, dict) and "state" in v:
                out[k] = {**{kk: self.walk(vv, path + [k, kk]) for kk, vv in v.items()
                             if kk != "state"},
                          "state": {g: {n: self.cut(t, path + [k, "state", g, n],
                                                    flats.get(g))
                                        for n, t in s.items()}
                                    for g, s in v["state"].items()}}
            else:
                out[k] = self.walk(v, path + [k])
        return out

    @staticmethod
    def fragment(rule: Unit | Rows | None, start: int, numel: int
                 ) -> list[tuple[int, int, Unit | None]]:
        """A parameter's fragment at ``start`` of a flat partition: one piece, or its
        rows."""
        if isinstance(rule, Rows):
            return rule.pieces(start, numel, rule.offset)
        return [(start, numel, rule)]

    def cut(self, t: Any, path: list[Any], frags: list[tuple[int, int, Unit | None]] | None
            ) -> Any:
        """A flat tensor of an expert group as one key per fragment and gap."""
        if not isinstance(t, torch.Tensor) or frags is None or t.dim() != 1 \
                or t.numel() < max(s + n for s, n, _ in frags):
            return self.walk(t, path)
        pieces, at = [], 0
        for start, numel, unit in frags + [(t.numel(), 0, None)]:
            if start > at:  # a gap (alignment padding) before the next fragment
                pieces.append([at, start - at, self.put(t[at:start], path + [f"{at}+"
                                                                           f"{start - at}"],
                                                        None)["k"]])
            if numel:
                pieces.append([start, numel, self.put(t[start:start + numel],
                                                      path + [f"{start}+{numel}"],
                                                      unit)["k"]])
            at = max(at, start + numel)
        return {_MARK: "flat", "numel": t.numel(), "dtype": str(t.dtype).removeprefix(
            "torch."), "pieces": pieces}


def _is_torch_optimizer(x: dict) -> bool:
    return set(x) >= {"state", "param_groups"} and isinstance(x["state"], dict) \
        and all(isinstance(i, int) for i in x["state"])


def _is_grouped(x: Any) -> bool:
    return isinstance(x, list) and all(
        isinstance(g, list) and all(isinstance(t, torch.Tensor) for t in g) for g in x)


def _plain(x: Any) -> Any:
    """DeepSpeed's own small types as marked plain dicts; the rest as it is (encode_object
    refuses what JSON cannot hold, naming where it sits)."""
    cls = type(x)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name not in _ALLOWED:
        return x
    if isinstance(x, enum.Enum):
        return {_MARK: "enum", "type": name, "value": x.value}
    return {_MARK: "obj", "type": name, "state": {k: _plain(v) for k, v in vars(x).items()}}


def split_file(name: str, sd: Any, params: Mapping[str, Unit | Rows],
               opt_index: Mapping[int, str],
               zero3: Sequence[Sequence[tuple[str, int, int]]] | None = None) -> Split:
    """File ``name``'s state dict ``sd`` as flat keys. ``params``: expert parameter name
    -> its unit or rows (``sd["module"]``'s tensors, a torch optimizer's per-parameter
    state, ZeRO's flat fragments go with them); ``opt_index``: a torch optimizer's parameter index -> parameter name.
    Raises ConfigError naming a value moepec does not store."""
    s = _Splitter(name, params, opt_index, zero3=zero3)
    skeleton = s.walk(sd, [])
    s.out.tensors[f"{name}/{SKELETON}"] = encode_object(
        skeleton, f"DeepSpeed checkpoint file {name}",
        fix="keep client_state to JSON values and tensors")
    s.out.units[f"{name}/{SKELETON}"] = s.unit
    return s.out


def split_module(name: str, module: Mapping[str, torch.Tensor],
                 params: Mapping[str, Unit | Rows]) -> Split:
    """The keys :func:`split_file` gives ``module`` as file ``name``'s ``"module"``
    (another data-parallel rank's copy of rank 0's), tensors left on their device, no
    skeleton."""
    s = _Splitter(name, params, {}, to_cpu=False)
    s.walk({"module": dict(module)}, [])
    return s.out


def file_keys(name: str, view: Mapping[str, str]) -> list[str]:
    """Every key of file ``name`` in a folder's view."""
    prefix = f"{name}/"
    return [k for k in view if k.startswith(prefix)]


def join_file(name: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The state dict of file ``name`` from its keys (as :func:`split_file` made them).
    Raises CorruptCheckpointError for a skeleton that does not fit its keys."""
    key = f"{name}/{SKELETON}"
    if key not in tensors:
        raise CorruptCheckpointError(f"{name}: no skeleton in the checkpoint")
    return _rebuild(decode_object(tensors[key], key), tensors, name)


def _rebuild(x: Any, tensors: Mapping[str, torch.Tensor], name: str) -> Any:
    if isinstance(x, list):
        return [_rebuild(v, tensors, name) for v in x]
    if isinstance(x, tuple):
        return tuple(_rebuild(v, tensors, name) for v in x)
    if not isinstance(x, dict):
        return x
    kind = x.get(_MARK)
    if kind is None:
        return {k: _rebuild(v, tensors, name) for k, v in x.items()}
    try:
        if kind == "t":
            return tensors[x["k"]]
        if kind == "flat":
            return _flat(x, tensors)
        if kind == "size" and all(type(d) is int and d >= 0 for d in x["v"]):
            return torch.Size(x["v"])
        if kind in ("enum", "obj") and x["type"] in _ALLOWED:
            return _build(x)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{name}: its skeleton does not fit its tensors "
                                     f"({type(exc).__name__}: {exc})") from None
    raise CorruptCheckpointError(f"{name}: unknown value in its skeleton ({kind!r:.40})")


def _flat(x: dict, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A flat tensor from its pieces (as :meth:`_Splitter.cut` made them: fragments and
    gaps that cover it from 0 to its end), allocated only once they are found to cover
    it: a skeleton never makes moepec allocate more than its tensors hold. Raises
    ValueError (or KeyError, TypeError) for anything else."""
    numel, dtype = x["numel"], getattr(torch, str(x["dtype"]), None)
    if type(numel) is not int or numel < 0 or not isinstance(dtype, torch.dtype):
        raise ValueError(f"a flat tensor of {numel!r:.40} values of {x['dtype']!r:.40}")
    pieces = []
    for start, n, k in x["pieces"]:
        if type(start) is not int or type(n) is not int or start < 0 or n < 0 \
                or start + n > numel:
            raise ValueError(f"a piece [{start!r:.20}, {n!r:.20}] of {numel} values")
        t = tensors[k]
        if t.dim() != 1 or t.numel() != n:
            raise ValueError(f"{k!r:.160} holds {t.numel()} values, its piece {n}")
        pieces.append((start, n, t))
    at = 0
    for start, n, _ in sorted(pieces, key=lambda p: p[0]):
        if start > at:
            break
        at = max(at, start + n)
    if at != numel:
        raise ValueError(f"its pieces leave values {at}.. of its {numel} unfilled")
    shape = x.get("shape")
    if shape is not None and (not isinstance(shape, list) or any(
            type(d) is not int or d < 0 for d in shape) or _prod(shape) != numel):
        raise ValueError(f"a shape {shape!r:.60} of {numel} values")
    out = torch.empty(numel, dtype=dtype)
    for start, n, t in pieces:
        out[start:start + n] = t
    return out if shape is None else out.view(shape)


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _build(x: dict) -> Any:
    import importlib

    module, _, qual = x["type"].rpartition(".")
    cls = getattr(importlib.import_module(module), qual)
    if x[_MARK] == "enum":
        return cls(x["value"])
    obj = cls.__new__(cls)
    obj.__dict__.update({k: _build(v) if isinstance(v, dict) and _MARK in v else v
                         for k, v in x["state"].items()})
    return obj


STUB = (b"moepec: this DeepSpeed file is stored in the moepec checkpoint of this folder "
        b"(moepec.json); DeepSpeed loads it with `import moepec.integrations.deepspeed`, "
        b"`moepec export` writes it out\n")
"""What stands at each DeepSpeed file's path (DeepSpeed checks they exist)."""


def stub(path: str) -> None:
    with open(path, "wb") as f:
        f.write(STUB)


def is_stub(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(STUB)) == STUB
    except OSError:
        return False
