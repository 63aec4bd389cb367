"""DeepSpeed's own files from a moepec DeepSpeed save (``moepec materialize``), and the
stitched model by parameter name (``moepec export``; ``--fp32``: ZeRO's fp32 masters).

A moepec tag holds DeepSpeed's files as flat keys (:mod:`moepec.integrations.ds_files`)
and, at each file's path, a stub. :func:`materialize` writes a tag of real DeepSpeed files
(``torch.save``, as DeepSpeed's own engine writes them), each stitched from the experts'
newest copies, plus ``latest`` and DeepSpeed's recovery scripts: what a DeepSpeed without
moepec loads, and what ``zero_to_fp32.py`` and ``ds_to_universal`` read. No process
group; reads only inside the save directory, writes only inside the output folder: a
tag must be a plain folder name and a file name one DeepSpeed writes
(:data:`~moepec.integrations.ds_files.DS_FILE`), whatever the save directory says.
:func:`read_latest` reads DeepSpeed's ``latest`` for these tools and for the door's load.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from moepec.errors import CheckpointError, CorruptCheckpointError
from moepec.flat import FlatFrontEnd, read_small
from moepec.integrations.ds_files import (
    DS_FILE,
    HF_CHECKPOINT,
    SKELETON,
    file_keys,
    join_file,
    location,
)

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
LATEST_BYTES = 4096
"""The most of DeepSpeed's ``latest`` file (one tag name) that is read."""


@dataclass(frozen=True, slots=True)
class Materialized:
    tag: str
    files: list[str]
    out: str


def plain_tag(tag: str, save_dir: str, source: str = "the tag") -> str:
    """``tag`` if it is a plain folder name (DeepSpeed's tags are, e.g. ``global_step100``):
    not empty, no ``/`` or ``\\``, not ``.`` or ``..``, printable, at most 255
    characters; so that ``save_dir/tag`` is inside ``save_dir``. Raises CheckpointError
    naming ``source`` (where the tag came from) otherwise."""
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or len(tag) > 255 \
            or not tag.isprintable() or os.path.isabs(tag):
        raise CheckpointError(f"{source} {tag!r:.80} is not a plain folder name of "
                              f"{save_dir}; name a tag folder of it (such as global_step100)")
    return tag


def read_latest(save_dir: str) -> str | None:
    """The tag DeepSpeed's ``save_dir/latest`` names, None when there is no such file.
    Reads at most :data:`LATEST_BYTES` of a regular file, never through a symlink and
    never waiting on a FIFO or a device. Raises CheckpointError for a ``latest`` that is
    anything else, cannot be read, or names no plain tag (:func:`plain_tag`)."""
    path = os.path.join(save_dir, "latest")
    try:
        data = read_small(path, LATEST_BYTES + 1)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as exc:  # a link, a FIFO, a folder
        raise CheckpointError(f"{exc}; DeepSpeed's `latest` is a plain file naming a tag "
                              f"folder: replace it with one") from None
    except OSError as exc:
        raise CheckpointError(f"{path} (DeepSpeed's `latest`) cannot be read: "
                              f"{exc.strerror or exc}") from None
    if len(data) > LATEST_BYTES:
        raise CheckpointError(f"{path} holds more than {LATEST_BYTES} bytes; DeepSpeed's "
                              f"`latest` names one tag folder (such as global_step100)")
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text; DeepSpeed's `latest` names one tag "
                              f"folder (such as global_step100)") from None
    return plain_tag(tag, save_dir, f"{path}: its tag")


def resolve_tag(save_dir: str, tag: str | None) -> tuple[str, str, str]:
    """(DeepSpeed tag, moepec root, moepec folder) of ``save_dir``'s ``tag``, by default
    the one ``latest`` names; a Hugging Face Trainer's output folder means its newest
    committed ``checkpoint-<N>``, a Lightning ``ModelCheckpoint`` folder its newest
    ``<name>.ckpt``. Raises CheckpointError naming what is missing, or a
    tag that is not a plain folder name of ``save_dir`` (``latest`` read as
    :func:`read_latest` reads it)."""
    save_dir = os.path.abspath(save_dir)
    newest = FlatFrontEnd.newest(save_dir) \
        if not os.path.lexists(os.path.join(save_dir, "latest")) else None
    if newest is not None and (HF_CHECKPOINT.match(newest) or newest.endswith(".ckpt")):
        save_dir = os.path.join(save_dir, newest)  # a Trainer's or Lightning's folders
    if tag is None:
        tag = read_latest(save_dir)
        if tag is None:
            raise CheckpointError(f"{save_dir} has no `latest` file; name the tag with "
                                  f"--tag (a folder such as global_step100)")
    plain_tag(tag, save_dir)
    root, folder = location(save_dir, tag)
    if not os.path.exists(os.path.join(root, folder, "moepec.json")):
        raise CheckpointError(f"{os.path.join(save_dir, tag)} is not a committed moepec "
                              f"DeepSpeed checkpoint")
    return tag, root, folder


def materialize(save_dir: str, out: str, tag: str | None = None) -> Materialized:
    """Write ``out/<tag>/`` with every DeepSpeed file of ``save_dir``'s tag (stitched),
    ``out/latest`` and DeepSpeed's recovery scripts. Refuses an existing ``out/<tag>``;
    raises CorruptCheckpointError for a file name DeepSpeed does not write (nothing is
    written then) or a file that cannot be rebuilt (its partial folder is removed)."""
    tag, root, folder = resolve_tag(save_dir, tag)
    target = os.path.join(os.path.abspath(out), tag)
    if os.path.lexists(target):
        raise CheckpointError(f"{target} exists; materialize into a new folder")
    front = FlatFrontEnd()
    view = front.keys(root, folder)
    files = _file_names(view, os.path.join(root, folder))
    partial = target + ".partial"
    os.makedirs(partial)
    try:
        inside = os.path.realpath(partial)
        for name in files:
            path = os.path.join(partial, name)
            if os.path.dirname(os.path.realpath(path)) != inside:  # DS_FILE rules it out
                raise CorruptCheckpointError(f"{name!r:.160} leads out of {partial}")
            sd = join_file(name, front.read(root, folder, file_keys(name, view)))
            torch.save(sd, path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, target)
    for script in SCRIPTS:
        src = os.path.join(os.path.abspath(save_dir), script)
        if os.path.isfile(src) and not os.path.islink(src):
            shutil.copyfile(src, os.path.join(out, script))
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)
    return Materialized(tag, files, target)


def _file_names(view: list[str], where: str) -> list[str]:
    """The DeepSpeed files a tag holds (each has a skeleton key), sorted. Raises
    CorruptCheckpointError naming a skeleton key whose file name is not one DeepSpeed
    writes (:data:`~moepec.integrations.ds_files.DS_FILE`: a plain name, never a path)."""
    named = {k.removesuffix(f"/{SKELETON}") for k in view if k.endswith(f"/{SKELETON}")}
    files = {n for n in named if DS_FILE.fullmatch(n)}
    for n in sorted(named - files):
        if n.split("/", 1)[0] not in files:  # else a value named __skeleton__ in a file
            raise CorruptCheckpointError(f"{where}: its key {n + '/' + SKELETON!r:.200} "
                                         f"names a DeepSpeed file {n!r:.160}, which is not "
                                         f"a name DeepSpeed writes; the checkpoint is "
                                         f"damaged or not moepec's")
    return sorted(files)


def is_deepspeed_save(save_dir: str) -> bool:
    """Whether ``save_dir`` is a DeepSpeed save directory written through moepec (its
    `latest` tag, or a Trainer's checkpoint folders, hold DeepSpeed files as flat keys)."""
    try:
        _, root, folder = resolve_tag(save_dir, None)
    except CheckpointError:
        return False
    return any(k.endswith(f"/{SKELETON}") for k in FlatFrontEnd().keys(root, folder))


def export_model(save_dir: str, out: str, tag: str | None = None) -> tuple[str, int]:
    """Write the stitched model of ``save_dir``'s tag as one safetensors file, each
    parameter under its name in the model (experts by their global index, as DeepSpeed
    names them in its expert files). Returns (tag, tensors written)."""
    from safetensors.torch import save_file

    tag, root, folder = resolve_tag(save_dir, tag)
    front = FlatFrontEnd()
    view = front.keys(root, folder)
    model: dict[str, torch.Tensor] = {}
    for name in _file_names(view, os.path.join(root, folder)):
        if not name.endswith("_model_states.pt"):
            continue  # optimizer partitions: `moepec materialize` writes those
        if name.startswith("zero_pp_rank_"):
            raise CheckpointError(f"{os.path.join(save_dir, tag)} is a ZeRO-3 save: its model "
                                  f"files hold no weights; export its fp32 masters with "
                                  f"`moepec export --fp32`")
        sd = join_file(name, front.read(root, folder, file_keys(name, view)))
        part = sd.get("module", sd) if isinstance(sd, dict) else {}
        model |= {k: v.contiguous() for k, v in part.items() if isinstance(v, torch.Tensor)}
    save_file(model, out)
    return tag, len(model)


_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")


def export_fp32(save_dir: str, out: str, tag: str | None = None) -> tuple[str, int]:
    """Write the fp32 master weights of ``save_dir``'s tag (ZeRO-1/2/3) as one safetensors
    file, each parameter under its model name (experts by their global index): what
    DeepSpeed's ``zero_to_fp32.py`` gives, which fails on MoE tags (DeepSpeed #4497).
    Each parameter is joined from its fragments in every rank's partition (rank order
    within its group: all ranks for non-expert groups, the expert-data-parallel ranks of
    its expert-parallel rank for expert groups; DeepSpeed's group layout; at ZeRO-3
    :func:`_zero3`). Raises CheckpointError for a tag without ZeRO partitions or a
    fragment that does not fit."""
    from safetensors.torch import save_file

    tag, root, folder = resolve_tag(save_dir, tag)
    front = FlatFrontEnd()
    view = front.keys(root, folder)
    names = _file_names(view, os.path.join(root, folder))
    optim = {int(m[1]): n for n in names if (m := _OPTIM_FILE.match(n)) and m[2] == "00"}
    model_file = next((n for n in names if n.startswith("mp_rank_00_")), None)
    z3_file = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if optim and z3_file in names:
        def read(name: str) -> Any:
            return join_file(name, front.read(root, folder, file_keys(name, view)))
        model = _zero3_masters(read, z3_file, optim, os.path.join(save_dir, tag))
        save_file(model, out)
        return tag, len(model)
    if not optim or model_file is None:
        raise CheckpointError(f"{os.path.join(save_dir, tag)} has no ZeRO-1/2/3 optimizer "
                              f"partitions to join (a ZeRO-0 save): export it without "
                              f"--fp32 (its module weights), or `moepec materialize` it")
    shapes = join_file(model_file, front.read(root, folder, file_keys(model_file, view)))
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    shape_of: dict[str, tuple[int, ...]] = {}
    for rank, name in sorted(optim.items()):
        osd = join_file(name, front.read(root, folder, file_keys(name, view)))
        _fragments(osd["optimizer_state_dict"], shapes["param_shapes"], rank, len(optim),
                   pieces, shape_of)
    model = {pname: _joined(pname, parts, shape_of[pname]) for pname, parts in pieces.items()}
    save_file(model, out)
    return tag, len(model)


def _zero3_masters(read: Any, z3_file: str, optim: dict[int, str],
                   where: str) -> dict[str, torch.Tensor]:
    """The fp32 masters of a ZeRO-3 tag: ``read(name)`` one of its files (stitched),
    ``optim`` rank -> its optimizer file. Tied parameters under both names, as
    ``zero_to_fp32``; raises CheckpointError for frozen ones and for files that are not
    DeepSpeed's."""
    states = read(z3_file)
    if not isinstance(states, dict) or sorted(optim) != list(range(len(optim))):
        raise CheckpointError(f"{where}: its ZeRO-3 files are not DeepSpeed's "
                              f"(a damaged or foreign save?)")
    if states.get("frozen_param_shapes"):
        raise CheckpointError(f"{where} has frozen parameters, which --fp32 does not "
                              f"join at ZeRO-3: `moepec materialize` the tag and run "
                              f"DeepSpeed's zero_to_fp32.py on the copy")
    try:
        model = _zero3(states["param_shapes"],
                       [read(optim[r])["optimizer_state_dict"]["fp32_flat_groups"]
                        for r in sorted(optim)], where)
        for name, holder in (states.get("shared_params") or {}).items():
            model[name] = model[holder].clone()  # tied: saved once, as zero_to_fp32
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: its ZeRO-3 files lack DeepSpeed's {exc} (a "
                              f"damaged or foreign save?)") from None
    return model


def _zero3(param_shapes: list, flats: list[list[torch.Tensor]],
           where: str) -> dict[str, torch.Tensor]:
    """ZeRO-3's fp32 masters joined: in each optimizer sub-group, each parameter (in
    ``param_shapes`` order) holds ceil(numel / ranks) values of every rank's flat fp32
    partition ``flats[rank][group]``, at the same offset on every rank; the parameter is
    those runs in rank order, its padding (at the end) cut off."""
    ranks, model = len(flats), {}
    for g, shapes in enumerate(param_shapes):
        at = 0
        for pname, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            part = -(-numel // ranks)
            if any(g >= len(f) or at + part > f[g].numel() for f in flats):
                raise CheckpointError(f"{where}: {pname}'s fp32 partition does not fit "
                                      f"its ranks' flat groups (a damaged save?)")
            joined = torch.cat([f[g][at:at + part].float() for f in flats])
            model[pname] = joined[:numel].view(tuple(shape)).contiguous()
            at += part
    return model


def _fragments(osd: dict, param_shapes: list, rank: int, world: int,
               pieces: dict[str, list[tuple[int, torch.Tensor]]],
               shape_of: dict[str, tuple[int, ...]]) -> None:
    """Add rank ``rank``'s fp32 fragments (ZeRO's flat partition per group, cut by its
    ``param_slice_mappings``) to ``pieces``, under each parameter's global name."""
    for g, (flat, mapping) in enumerate(zip(osd["single_partition_of_fp32_groups"],
                                            osd["param_slice_mappings"])):
        local = param_shapes[g]
        experts = sorted({int(m[2]) for n in local if (m := _EXPERT.search(n))})
        ep = world // int(osd["partition_count"][g]) if experts else 1
        for pname, frag in mapping.items():
            shape = tuple(local[pname])
            if experts:  # rank r is expert-parallel rank r % ep (DeepSpeed's groups)
                e = int(_EXPERT.search(pname)[2]) + (rank % ep) * len(experts)
                pname = _EXPERT.sub(lambda m, e=e: f"{m[1]}{e}{m[3]}", pname, count=1)
            start, numel = int(frag.start), int(frag.numel)
            pieces.setdefault(pname, []).append((rank, flat[start:start + numel]))
            shape_of[pname] = shape


def _joined(pname: str, parts: list[tuple[int, torch.Tensor]],
            shape: tuple[int, ...]) -> torch.Tensor:
    """One parameter from its fragments in rank order; CheckpointError if they do not
    make its shape."""
    joined = torch.cat([t.float() for _, t in sorted(parts, key=lambda p: p[0])])
    if joined.numel() != int(torch.Size(shape).numel()):
        raise CheckpointError(f"{pname}: its fp32 fragments hold {joined.numel()} values, "
                              f"its shape {shape} needs {torch.Size(shape).numel()}")
    return joined.view(shape).contiguous()
