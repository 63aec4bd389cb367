"""PEC of FSDP2 (DTensor) models: each rank writes its own shards, restore onto another
layout is bit-exact.

Spawned gloo processes with a file rendezvous. A run trains the toy MoE under
``fully_shard`` (experts sharded on dim 0, or on dim 1 so that every rank holds a part
of every expert), checkpointing every step with K=1, and rank 0 records the full
(all-gathered) state after each step. Restores then run at other layouts (FSDP at
another degree, plain tensors in one process) and must reproduce exactly the stitched
state: non-expert state of the newest checkpoint, each expert (weights and Adam moments)
at the step of its newest saved copy.
"""

from __future__ import annotations

import json
import math
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import moepec
from moepec.errors import StructureMismatchError
from moepec.keys import parse_key, split_chunk
from moepec.store.manifest import FORMAT
from moepec.store.storage import Storage, single_process_dcp
from tests import toy
from tests.spawning import start_processes

pytestmark = [pytest.mark.timeout(240)]
STEPS = 4
EXPERT = re.compile(r"^moe\.(\d+)\.experts\.(w1|w2)$")
MODULE = re.compile(r"^moe\.(\d+)\.experts\.(\d+)\.(w1|w2)$")  # per-expert modules


# -- building and running (in the spawned ranks and in the test process) ---------------
def build(seed: int, world: int, expert_dim: int | None, n_experts: int = 4,
          layout: str = "stacked"):
    """The toy MoE with AdamW: plain (``expert_dim`` None) or fully_shard over ``world``
    ranks with stacked experts sharded on ``expert_dim``."""
    torch.manual_seed(seed)
    model = toy.ToyMoE(n_experts=n_experts, layout=layout)
    if expert_dim is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        mesh = init_device_mesh("cpu", (world,))
        def place(p):
            return Shard(expert_dim) if p.dim() == 3 else None
        for block in list(model.dense) + list(model.moe):
            fully_shard(block, mesh=mesh, shard_placement_fn=place)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def manager(model, opt, path: str, counter, hooks=None, **kw) -> moepec.CheckpointManager:
    kw = {"k_snapshot": 1, "ram_dir": None, **kw}  # restores from storage unless the test
    # keeps the manager (an in-process RAM tier goes with it)
    cfg = moepec.CheckpointConfig(path=path, interval=1, k_persist=1, async_snapshot=False,
                                  async_persist=False, keep_last=8, timeout_s=60, **kw)
    return moepec.CheckpointManager(model, opt, cfg, extra_state={"data": counter},
                                    hooks=hooks)


def full(model, opt) -> dict[str, torch.Tensor]:
    """Weights and optimizer state, all-gathered (collective for DTensors)."""
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": whole(p) for n, p in model.named_parameters()}
    out["model/norm_stat"] = model.norm_stat.detach().clone()
    for p in model.parameters():
        for k, v in opt.state[p].items():
            out[f"optim/{names[id(p)]}/{k}"] = whole(v)
    return out


def train(model, opt, mgr, counter, start: int, steps: int, on_step=None) -> None:
    # The same batches on every rank: the toy's buffer (a running mean of activations)
    # then stays replicated, as a model's buffers are.
    gen = torch.Generator().manual_seed(100 + start)
    sched = None
    for step in range(start, start + steps):
        _, counts = toy.train_step(model, opt, sched, gen, batch=8)
        mgr.wait_for_snapshot()
        opt.step()
        counter.position += 1
        mgr.observe_routing(counts)
        mgr.step(step)
        if on_step is not None:
            on_step(step)


# -- spawned ranks ------------------------------------------------------------------------
def _worker(rank: int, world: int, store: str, out: str, job: str, ckpt: str,
            expert_dim: int, plain_ckpt: str = "") -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    result: dict = {"ok": False}
    try:
        counter = toy.Counter()
        if job == "kill":
            _killed_save(rank, world, ckpt, counter)
            result["ok"] = True
            return
        if job == "save":
            model, opt = build(0, world, expert_dim)
            mgr = manager(model, opt, ckpt, counter)

            def record(step: int) -> None:
                state = full(model, opt)
                if rank == 0:
                    torch.save(state, Path(out) / f"hist-s{step}.pt")

            train(model, opt, mgr, counter, 0, STEPS, record)
            # Restore in the same processes: the RAM tier holds this rank's shards.
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            report = mgr.restore()
            result["ram"] = {"tier": report.tier, "step": report.step,
                             "sources": report.sources}
            state = full(model, opt)
            mgr.close()
            if rank == 0:
                torch.save(state, Path(out) / "ram-restored.pt")
            result["lost_ram"] = _lost_ram(rank, world, expert_dim, ckpt + "-lost-ram", out)
            expert_dim = 1 - expert_dim  # and from storage, experts sharded the other way
        model, opt = build(7, world, expert_dim)
        # Its checkpoint (job "save") is stock DCP (torch_save), the ones before it raw;
        # the save job reads straight into the DTensor shards (restore_in_place).
        mgr = manager(model, opt, ckpt, counter, serialization="torch_save",
                      restore_in_place=job == "save")
        report = mgr.restore()
        result.update(step=report.step, sources=report.sources, position=counter.position)
        state = full(model, opt)
        # Training goes on from the restored shards (optimizer state in place), and its
        # partial checkpoint in this layout stitches onto those of the other.
        if job == "save":
            train(model, opt, mgr, counter, report.step + 1, 1, record)
        mgr.close()
        if rank == 0:
            torch.save(state, Path(out) / f"{job}-restored.pt")
        if job == "save":
            _stock_load_resharded(rank, world, ckpt, out)
        if plain_ckpt:  # a checkpoint of plain tensors, into these shards
            model, opt = build(7, world, expert_dim)
            mgr = manager(model, opt, plain_ckpt, counter)
            result["plain"] = mgr.restore().sources
            state = full(model, opt)
            mgr.close()
            if rank == 0:
                torch.save(state, Path(out) / "plain-into-fsdp.pt")
        if job == "save" and world == 4:  # the same ranks as a 2-D mesh, FSDP 2 x EP 2
            model, opt = build_2d(7)  # FSDP 4's checkpoint, restored into it
            mgr = manager(model, opt, ckpt, toy.Counter())
            result["into_2d"] = mgr.restore().sources
            state = full(model, opt)
            mgr.close()
            if rank == 0:
                torch.save(state, Path(out) / "fsdp4-into-2d.pt")
            result["ep2d"] = _fsdp_x_ep(rank, ckpt + "-ep2d", out, toy.Counter())
        if job == "restore":
            # Plain data parallelism: every rank holds every tensor whole.
            model, opt = build(7, 1, None)
            mgr = manager(model, opt, ckpt, toy.Counter())
            result["plain_dp"] = mgr.restore().sources
            torch.save(full(model, opt), Path(out) / f"plain-dp-r{rank}.pt")
            mgr.close()
            result["modules"] = _modules(rank, world, ckpt + "-modules", out)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback
        result["trace"] = f"{exc!r}\n{traceback.format_exc()}"
    finally:
        (Path(out) / f"{job}-r{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def build_2d(seed: int):
    """torchtitan's MoE layout on a 2-D mesh of 4 ranks (dp 2 x ep 2): experts sharded
    over EP on dim 0 (Shard(0) on "ep") and over FSDP on dim 1, the rest fully_shard over
    all 4 ranks (collective)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(seed)
    model = toy.ToyMoE(n_experts=4)
    for moe in model.moe:
        for name in ("w1", "w2"):
            w = getattr(moe.experts, name)
            setattr(moe.experts, name,
                    nn.Parameter(distribute_tensor(w.data, mesh["ep"], [Shard(0)])))
        fully_shard(moe.experts, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
    flat = init_device_mesh("cpu", (4,))
    for block in model.dense:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    assert model.moe[0].experts.w1.placements == (Shard(1), Shard(0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps_with_set_gradients(model, opt, mgr, rank: int, out: str, tag: str) -> None:
    """STEPS optimizer steps on set gradients (for layouts the toy's forward does not
    drive), a checkpoint per step; rank 0 records the full state as ``{tag}-s{step}``."""
    for step in range(STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.01 * (step + 1) * (i + 1))
        mgr.wait_for_snapshot()
        opt.step()
        mgr.step(step)
        state = full(model, opt)
        if rank == 0:
            torch.save(state, Path(out) / f"{tag}-s{step}.pt")


def _fsdp_x_ep(rank: int, ckpt: str, out: str, counter) -> dict:
    """Training in :func:`build_2d`'s layout with set gradients (the toy's forward is not
    expert parallel); then a restore from the RAM tier in the same processes."""
    model, opt = build_2d(0)
    mgr = manager(model, opt, ckpt, counter)
    _steps_with_set_gradients(model, opt, mgr, rank, out, "ep2d")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    report = mgr.restore()
    assert report.tier == "ram"
    state = full(model, opt)
    mgr.close()
    if rank == 0:
        torch.save(state, Path(out) / "ep2d-restored.pt")
    return report.sources


def _stock_load_resharded(rank: int, world: int, ckpt: str, out: str) -> None:
    """DCP's own ``dcp.load`` of the newest checkpoint (torch_save, FileSystemReader) and
    of the one before it (raw, RawFileSystemReader) into DTensors of another layout: every
    tensor of 2+ dims sharded on its last dim, the others replicated. Rank 0 keeps the
    gathered tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from moepec.store.dcp_raw import RawFileSystemReader

    mesh = init_device_mesh("cpu", (world,))
    names = Storage(ckpt).committed()
    for name, reader in ((names[-1], FileSystemReader), (names[-2], RawFileSystemReader)):
        path = f"{ckpt}/{name}"
        md = reader(path).read_metadata().state_dict_metadata
        target = {}
        for fqn, tmd in md.items():
            assert isinstance(tmd, TensorStorageMetadata), fqn
            t = torch.zeros(tmd.size, dtype=tmd.properties.dtype)
            target[fqn] = t if t.dim() == 0 else distribute_tensor(
                t, mesh, [Shard(t.dim() - 1) if t.dim() >= 2 else Replicate()],
                src_data_rank=None)
        with single_process_dcp():  # stock DCP in one process: its own warning, not ours
            dcp.load(target, storage_reader=reader(path))
        whole = {k: v.full_tensor() if v.dim() else v for k, v in sorted(target.items())}
        if rank == 0:
            torch.save(whole, Path(out) / f"stock-{name}.pt")


def _modules(rank: int, world: int, ckpt: str, out: str) -> dict:
    """Experts as one module each (Hugging Face's layout), every expert module its own
    fully_shard unit (each rank holds a dim-0 part of every expert): set-gradient steps
    with a checkpoint each, then a storage restore into a fresh sharded model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build_modules(seed: int):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(seed)
        model = toy.ToyMoE(n_experts=4, layout="modules")
        for moe in model.moe:
            for expert in moe.experts:
                fully_shard(expert, mesh=mesh)
            fully_shard(moe, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.moe[0].experts[0].w1).__name__ == "DTensor"
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build_modules(0)
    mgr = manager(model, opt, ckpt, toy.Counter())
    _steps_with_set_gradients(model, opt, mgr, rank, out, "mod")
    mgr.close()
    model, opt = build_modules(7)
    mgr = manager(model, opt, ckpt, toy.Counter())
    report = mgr.restore()
    state = full(model, opt)
    mgr.close()
    if rank == 0:
        torch.save(state, Path(out) / "mod-restored.pt")
    return report.sources


def _lost_ram(rank: int, world: int, expert_dim: int, ckpt: str, out: str) -> dict:
    """Every expert in RAM (K_snapshot 4), one in storage per checkpoint (K_persist 1);
    after 2 steps rank 1 "restarts": its RAM snapshot is gone. Rank 0 serves what it holds
    from RAM where no other holder of that expert lost it; the rest comes from storage."""
    model, opt = build(0, world, expert_dim)
    counter = toy.Counter()
    mgr = manager(model, opt, ckpt, counter, k_snapshot=4)

    def record(step: int) -> None:
        state = full(model, opt)
        if rank == 0:
            torch.save(state, Path(out) / f"lost-s{step}.pt")

    train(model, opt, mgr, counter, 0, 2, record)
    if rank == 1:
        mgr._ram_tier.drop()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    report = mgr.restore()
    state = full(model, opt)
    mgr.close()
    if rank == 0:
        torch.save(state, Path(out) / "lost-ram-restored.pt")
    return {"tier": report.tier, "step": report.step, "sources": report.sources,
            "units_from": report.units_from}


def _killed_save(rank: int, world: int, ckpt: str, counter) -> None:
    """Rank 1 dies (SIGKILL) in the second checkpoint, after writing its shards and before
    all ranks meet; rank 0 must give up that checkpoint (PersistError), not commit it."""
    import os
    import signal

    from moepec.errors import PersistError

    hooks = moepec.FaultHooks()
    if rank == 1:
        seen = {"n": 0}

        def hook(point: str, name: str) -> None:
            if point == "written":
                seen["n"] += 1
                if seen["n"] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)

        hooks.on_persist = hook
    model, opt = build(0, world, 1)
    mgr = manager(model, opt, ckpt, counter, hooks=hooks)
    try:
        train(model, opt, mgr, counter, 0, 2)
    except PersistError:
        return  # not closed: close() would meet the dead rank
    raise AssertionError("the checkpoint of the killed rank did not fail")


def spawn(job: str, world: int, tmp: Path, ckpt: Path, expert_dim: int = 0,
          plain_ckpt: Path | None = None) -> list[dict]:
    store = tmp / f"store-{job}-{world}-{len(list(tmp.iterdir()))}"
    start_processes(_worker, (world, str(store), str(tmp), job, str(ckpt), expert_dim,
                              str(plain_ckpt or "")), world)
    results = [json.loads((tmp / f"{job}-r{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert r["ok"], r.get("trace")
    return results


# -- expectations ---------------------------------------------------------------------------
def expected(tmp: Path, base_step: int, sources: dict, hist: str = "hist"
             ) -> dict[str, torch.Tensor]:
    """The stitched state: everything from ``base_step``, each expert's weights and
    moments from the step of its restored copy."""
    steps = {base_step} | {s["step"] for s in sources.values()}
    hist = {s: torch.load(tmp / f"{hist}-s{s}.pt") for s in steps}
    want = {k: v.clone() for k, v in hist[base_step].items()}
    for key, value in want.items():
        base = key.split("/")[1]
        if key.endswith("/step"):
            continue  # Adam's step counter is a scalar: non-expert state, from the base
        mod = MODULE.match(base)
        if mod is not None:  # a whole tensor per expert
            want[key] = hist[sources[f"{mod[1]}/{mod[2]}"]["step"]][key].clone()
            continue
        m = EXPERT.match(base)
        if m is None:
            continue
        for e in range(value.shape[0]):
            src = sources[f"{m[1]}/{e}"]["step"]
            value[e] = hist[src][key][e]
    return want


def merged(per_rank) -> dict:
    """The sources of every rank's experts (a rank reports the experts it holds), which
    must agree where ranks share an expert."""
    out: dict = {}
    for sources in per_rank:
        for k, v in sources.items():
            assert out.setdefault(k, v) == v, k
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def check_shards(ckpt: Path, world: int, n: int = STEPS + 1) -> None:
    """Every chunk of every checkpoint written once: the chunks of a tensor tile it
    exactly, each by the rank holding it, and every rank wrote."""
    st = Storage(str(ckpt))
    names = st.committed()
    assert len(names) == n
    for name in names:
        m = st.read_manifest(name)
        assert m.format == FORMAT
        assert all(b > 0 for b in m.bytes_per_rank) and len(m.bytes_per_rank) == world
        tiles: dict[str, list] = {}
        for key, item in m.keys.items():
            base, chunk = split_chunk(key)
            if chunk is not None:
                tiles.setdefault(base, []).append((chunk, item.rank))
        assert tiles, name
        for base, parts in tiles.items():
            glob = parts[0][0][2]
            assert sum(math.prod(c[1]) for c, _ in parts) == math.prod(glob), base
            cells = set()
            for (offsets, shape, _), rank in parts:
                box = {tuple(o + i for o, i in zip(offsets, idx))
                       for idx in _indices(shape)}
                assert not cells & box, f"{base}: chunks overlap"
                cells |= box
                assert rank is not None and 0 <= rank < world


def _check_manifest_rules(ckpt: Path) -> None:
    """A chunk key needs a well-formed suffix (in items and in the view); a manifest of
    another format is refused."""
    import xxhash

    from moepec.errors import ManifestError
    from moepec.store.manifest import Manifest, ViewRef

    st = Storage(str(ckpt))
    name = st.committed()[-1]
    data = json.loads((ckpt / name / "moepec.json").read_text())
    assert data["format"] == FORMAT
    view = dict(st.read_manifest(name).view)
    chunk = next(k for k in view if "#" in k)
    inline = {k: v for k, v in data.items() if k != "view_file"}
    with pytest.raises(ManifestError, match="pre-release moepec"):  # one format only
        Manifest.from_json(dict(inline, format="moepec/3", view=view), name)
    blob = json.dumps({**view, chunk.split("#")[0] + "#1,2": name}).encode()
    ref = ViewRef(file="v.json", length=len(blob),
                  checksum="xxh3:" + xxhash.xxh3_64_hexdigest(blob))
    bad = Manifest.from_json(dict(data, view_file=ref.to_json()), name, lambda r: blob)
    with pytest.raises(ManifestError):  # a malformed chunk suffix in the view file
        dict(bad.view)


def test_chunk_keys_and_views() -> None:
    from moepec.keys import chunk_key
    from moepec.state.chunks import overlap
    from moepec.store.lineage import updated_view

    assert chunk_key("model/w", (0, 0), (7, 5), (7, 5)) == "model/w"
    key = chunk_key("optim/w/exp_avg", (4, 0), (3, 5), (7, 5))
    assert split_chunk(key) == ("optim/w/exp_avg", ((4, 0), (3, 5), (7, 5)))
    for bad in ("model/w#4,0+4,5:7,5", "model/w#4,0+3:7,5", "model/w#x"):
        with pytest.raises(ValueError):
            split_chunk(bad)
    assert overlap(((0, 0), (4, 5)), ((2, 1), (5, 4))) == ((2, 1), (2, 4))
    assert overlap(((0,), (4,)), ((4,), (3,))) is None
    # A tensor saved in another layout replaces every older chunk of it in the view.
    old = {"model/w#0,0+4,5:7,5": "ckpt-000001-step00000001-aaaaaaaaaaaa",
           "model/w#4,0+3,5:7,5": "ckpt-000001-step00000001-aaaaaaaaaaaa", "model/b": "ckpt-000001-step00000001-aaaaaaaaaaaa"}
    new = updated_view(old, "ckpt-000002-step00000002-aaaaaaaaaaaa", ["model/w"])
    assert new == {"model/w": "ckpt-000002-step00000002-aaaaaaaaaaaa", "model/b": "ckpt-000001-step00000001-aaaaaaaaaaaa"}


def check_stock_loads(ckpt: Path, tmp: Path) -> None:
    """The newest checkpoint (torch_save, stock FileSystemReader) and the one before it
    (raw, RawFileSystemReader; another layout): .metadata describes each tensor once, its chunks those of the
    manifest, tiling it, each where the manifest says; DCP's dcp.load reads it, in one
    process into whole tensors and on the ranks into DTensors of another layout (rank 0
    kept them in stock-<name>.pt), bit-exact: the non-expert state whole, each expert key
    the expert's slice of its stacked tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from moepec.store.dcp_raw import RawFileSystemReader

    st = Storage(str(ckpt))
    names = st.committed()
    for name, reader, encoding in ((names[-1], FileSystemReader, "torch_save"),
                                   (names[-2], RawFileSystemReader, "raw")):
        m = st.read_manifest(name)
        path = str(ckpt / name)
        meta = reader(path).read_metadata()
        md = meta.state_dict_metadata
        assert not any("#" in fqn for fqn in md)
        chunks: dict[str, set] = {}
        for key, item in m.keys.items():
            assert item.encoding == encoding, key
            base, chunk = split_chunk(key)
            offsets, sizes = chunk[:2] if chunk else ((0,) * len(item.shape), tuple(item.shape))
            chunks.setdefault(base, set()).add((offsets, sizes))
            info = meta.storage_data[MetadataIndex(base, offsets)]
            assert (info.relative_path, info.offset, info.length) == (
                item.file, item.offset, item.length), key
        assert set(md) == set(chunks)
        assert any(len(c) > 1 for c in chunks.values())
        for base, saved in chunks.items():
            assert {(tuple(c.offsets), tuple(c.sizes)) for c in md[base].chunks} == saved
            assert sum(math.prod(s) for _, s in saved) == math.prod(md[base].size), base
        plain = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.items()}
        with single_process_dcp():
            dcp.load(plain, storage_reader=reader(path), no_dist=True)
        hist = torch.load(tmp / f"hist-s{m.step}.pt")
        experts = 0
        for key, value in plain.items():
            if key.startswith("objects/"):
                continue
            info = parse_key(key)
            if info.is_expert:
                _, _, _, part, rest = key.split("/", 4)
                want = hist[f"{part}/{rest}"][info.expert]
                experts += 1
            else:
                want = hist[key]
            assert value.dtype == want.dtype and torch.equal(value, want), key
        assert experts and {k for k in hist if k.startswith("model/")
                            and not EXPERT.match(k.split("/")[1])} <= set(plain)
        assert_same(torch.load(tmp / f"stock-{name}.pt"), plain)


def _indices(shape):
    import itertools
    return itertools.product(*(range(n) for n in shape))


def restore_plain(ckpt: Path, n_experts: int = 4, layout: str = "stacked"):
    model, opt = build(7, 1, None, n_experts, layout)
    counter = toy.Counter()
    mgr = manager(model, opt, str(ckpt), counter)
    try:
        report = mgr.restore()
        return report, full(model, opt), counter
    finally:
        mgr.close()


# -- tests -------------------------------------------------------------------------------------
def _save_and_restore(tmp_path: Path, world: int, expert_dim: int
                      ) -> tuple[Path, list[dict]]:
    """Train at FSDP ``world`` with experts sharded on ``expert_dim``; restore from the RAM
    tier (same processes), from storage with experts sharded on the other dim (same
    processes), and in one process with plain tensors; restore a checkpoint of plain
    tensors into FSDP shards: all bit-exact."""
    ckpt, plain = tmp_path / "ckpt", tmp_path / "plain"
    model, opt = build(0, 1, None)
    counter = toy.Counter()
    mgr = manager(model, opt, str(plain), counter)
    train(model, opt, mgr, counter, 0, 2, lambda s: torch.save(
        full(model, opt), tmp_path / f"plain-s{s}.pt"))
    mgr.close()
    saved = spawn("save", world, tmp_path, ckpt, expert_dim, plain)
    check_shards(ckpt, world)
    assert all(r["ram"]["tier"] == "ram" and r["ram"]["step"] == STEPS - 1 for r in saved)
    sources = merged(r["ram"]["sources"] for r in saved)
    want = expected(tmp_path, STEPS - 1, sources)
    assert_same(torch.load(tmp_path / "ram-restored.pt"), want)
    # Rank 1 lost its RAM snapshot. Every expert ends at one step on all its holders
    # (merged() checks the ranks agree) and the state is bit-exact. With whole experts
    # per rank (dim 0), rank 0's are at the newest step, served from its RAM.
    lost = [r["lost_ram"] for r in saved]
    assert all(r["step"] == 1 for r in lost)
    assert lost[1]["units_from"].get("ram", 0) == 0 and lost[1]["units_from"]["storage"] > 0
    lost_sources = merged(r["sources"] for r in lost)
    if expert_dim == 0:
        assert lost[0]["units_from"].get("ram", 0) > 0
        mine = list(lost[0]["sources"])  # at step 1: from RAM, or storage's copy of it
        assert mine and all(lost_sources[k]["step"] == 1 for k in mine)
        assert any(lost_sources[k]["tier"] == "ram" for k in mine)
    assert_same(torch.load(tmp_path / "lost-ram-restored.pt"),
                expected(tmp_path, 1, lost_sources, "lost"))
    # Partial checkpoints: some expert is stale, restored exactly at its saved step.
    assert any(s["step"] < STEPS - 1 for s in sources.values())
    from_storage = merged(r["sources"] for r in saved)
    assert {k: v["step"] for k, v in from_storage.items()} == {
        k: v["step"] for k, v in sources.items()}
    assert_same(torch.load(tmp_path / "save-restored.pt"), want)
    _check_manifest_rules(ckpt)
    check_stock_loads(ckpt, tmp_path)
    # Export puts every shard in its place: the weights of the newest (sharded) view.
    from safetensors.torch import load_file

    from moepec.recovery.offline import export_view

    export_view(str(ckpt), str(tmp_path / "export.safetensors"), "safetensors")
    exported = load_file(str(tmp_path / "export.safetensors"))
    # One process, plain tensors, from the newest checkpoint (written in the other layout)
    # and older ones (this layout).
    report, got, counter = restore_plain(ckpt)
    assert report.step == STEPS and counter.position == STEPS + 1
    assert {s["step"] for s in report.sources.values()} >= {STEPS, STEPS - 1}
    assert_same(got, expected(tmp_path, STEPS, report.sources))
    assert_same({f"model/{k}": v for k, v in exported.items()},
                {k: v for k, v in got.items() if k.startswith("model/")})
    # A model that cannot hold the checkpoint: a one-line error naming the mismatch.
    with pytest.raises(StructureMismatchError) as err:
        restore_plain(ckpt, n_experts=8)
    assert "\n" not in str(err.value) and "MoE layer 0" in str(err.value)
    # A checkpoint of plain tensors (one process) restored into FSDP shards.
    want = expected(tmp_path, 1, merged(r["plain"] for r in saved), "plain")
    assert_same(torch.load(tmp_path / "plain-into-fsdp.pt"), want)
    return ckpt, saved


def test_fsdp2_partial_experts_restore_bit_exact_on_other_layouts(tmp_path: Path) -> None:
    """Experts sharded on dim 1: every rank holds part of every expert."""
    _save_and_restore(tmp_path, 2, 1)


@pytest.mark.slow
def test_rank_killed_during_sharded_save_leaves_no_commit(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    store = tmp_path / "store-kill"
    ctx = start_processes(_worker, (2, str(store), str(tmp_path), "kill", str(ckpt), 1), 2,
                          join=False)
    for proc in ctx.processes:
        proc.join(120)
    codes = [proc.exitcode for proc in ctx.processes]
    assert codes[1] == -9
    result = json.loads((tmp_path / "kill-r0.json").read_text())
    assert result["ok"], result.get("trace")
    listing = Storage(str(ckpt)).list_checkpoints()
    assert [committed for _, committed in listing] in ([True], [True, False])


@pytest.mark.slow
def test_fsdp4_and_fsdp_x_ep_restore_on_other_layouts(tmp_path: Path) -> None:
    """Experts sharded on dim 0 over 4 ranks (each holds one of 4 experts), restored at
    FSDP 2 (each holds two) after the restores of _save_and_restore; and torchtitan's
    FSDP 2 x EP 2 mesh on the same 4 ranks, restored from RAM and in one process."""
    ckpt, saved = _save_and_restore(tmp_path, 4, 0)
    res = spawn("restore", 2, tmp_path, ckpt, 0)
    assert all(r["step"] == STEPS for r in res)  # the newest: FSDP 4, experts on dim 1
    sources = merged(r["sources"] for r in res)
    want = expected(tmp_path, STEPS, sources)
    assert_same(torch.load(tmp_path / "restore-restored.pt"), want)
    # The same checkpoint at plain DP (2 ranks, whole tensors: both equal) and at
    # FSDP 2 x EP 2 (the 4 ranks of the save job as a 2-D mesh).
    steps = {k: v["step"] for k, v in sources.items()}
    for r in (0, 1):
        assert {k: v["step"] for k, v in res[r]["plain_dp"].items()} == steps
        assert_same(torch.load(tmp_path / f"plain-dp-r{r}.pt"), want)
    assert {k: v["step"] for k, v in merged(r["into_2d"] for r in saved).items()} == steps
    assert_same(torch.load(tmp_path / "fsdp4-into-2d.pt"), want)
    # Per-expert modules, each its own fully_shard unit: restored in those shards and in
    # one process of plain tensors, stale experts at their steps.
    mod_sources = merged(r["modules"] for r in res)
    assert any(s["step"] < STEPS - 1 for s in mod_sources.values())
    mod_want = expected(tmp_path, STEPS - 1, mod_sources, "mod")
    assert_same(torch.load(tmp_path / "mod-restored.pt"), mod_want)
    report, got, _ = restore_plain(Path(f"{ckpt}-modules"), layout="modules")
    assert {k: v["step"] for k, v in report.sources.items()} == {
        k: v["step"] for k, v in mod_sources.items()}
    assert_same(got, mod_want)
    # FSDP 2 x EP 2 (2-D mesh).
    ckpt = Path(f"{ckpt}-ep2d")
    check_shards(ckpt, 4, STEPS)
    sources = merged(r["ep2d"] for r in saved)
    want = expected(tmp_path, STEPS - 1, sources, "ep2d")
    assert any(s["step"] < STEPS - 1 for s in sources.values())
    assert_same(torch.load(tmp_path / "ep2d-restored.pt"), want)
    report, got, _ = restore_plain(ckpt)
    assert {k: v["step"] for k, v in report.sources.items()} == {
        k: v["step"] for k, v in sources.items()}
    assert_same(got, want)


# -- the reference trainer ---------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--fsdp", "--ep", "2", "-O", "expert_layout=modules"], "'modules' expert layout"),
    (["--fsdp"], "torchrun --nproc_per_node N -m moepec train --fsdp"),
])
def test_train_fsdp_bad_layout_is_a_one_line_error(argv, message, capsys) -> None:
    from moepec.cli.main import main

    code = main(["train", "--config", "tiny", "--steps", "1", "--batch-size", "2",
                 "--eval-batches", "0", "--no-progress", "--device", "cpu", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) >= 1 and message in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.slow
def test_train_fsdp_checkpoints_and_resumes_in_one_process(tmp_path: Path) -> None:
    """`moepec train --fsdp` under torchrun writes sharded checkpoints (format 4, both
    ranks write); a one-process run of plain tensors resumes from them."""
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    common = ["--config", "tiny", "--batch-size", "4", "--ckpt-dir", str(ckpt),
              "--ckpt-interval", "2", "--device", "cpu", "--threads", "1", "--no-progress",
              "--eval-batches", "0", "--no-final-checkpoint"]  # the periodic ones only
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", "-m", "moepec", "train", "--fsdp",
                          "--steps", "4", *common], capture_output=True, text=True,
                         timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    st = Storage(str(ckpt))
    names = st.committed()
    assert len(names) == 2
    for name in names:
        m = st.read_manifest(name)
        assert m.format == FORMAT and all(b > 0 for b in m.bytes_per_rank)
    run = subprocess.run([sys.executable, "-m", "moepec", "train", "--steps", "6", *common],
                         capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"restored step 3 from ckpt-000001-step00000003-[0-9a-f]{12} ", run.stderr)
    assert len(st.committed()) == 3


@pytest.mark.slow
def test_train_fsdp_x_ep_survives_a_sigkill_and_resumes_in_one_process(
        tmp_path: Path, text_files: Path) -> None:
    """`moepec train --fsdp --ep 2` on 4 ranks (dp 2 x ep 2): rank 1 is SIGKILLed at step
    5, torchrun restarts the workers, they restore from storage and finish. Every
    checkpoint's shards were each written once by their holder. Then one process of plain
    tensors (no --fsdp, no --ep) restores the newest view: weights, Adam moments and step
    counters equal the saved items bit for bit, stale experts included."""
    import os
    import subprocess
    import sys

    from moepec.cli.main import build_parser, train_config_from_args
    from moepec.recovery.offline import consolidate, read_view
    from moepec.train.dist import DistInfo
    from moepec.train.setup import setup

    ckpt, repo = tmp_path / "ckpt", Path(__file__).resolve().parents[1]
    common = ["--config", "tiny", "--batch-size", "8", "--ckpt-dir", str(ckpt),
              "--ckpt-interval", "2", "--k", "1", "--device", "cpu", "--threads", "1",
              "--no-progress", "--eval-batches", "0", "--steps", "6",
              "--no-final-checkpoint",  # the last view keeps its stale experts
              "--data", str(text_files / "**/*.txt")]  # a small corpus: quick to load
    # torch issue 135712: restarted workers need a rendezvous store of their own.
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "4", "--max-restarts", "1", "-m", "moepec",
                          "train", "--fsdp", "--ep", "2", "--faults", "sigkill@5:r1",
                          "--ram-dir", "none",  # the restart restores from storage
                          "--dist-timeout", "30", "--log-interval", "1", "--out-dir",
                          str(tmp_path), *common], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    faults = [json.loads(x) for x in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["rank"], f["step"]) for f in faults] == [("sigkill", 1, 5)]
    recovery = [r for r in recs if r.get("event") == "recovery"]
    assert len(recovery) == 1 and recovery[0]["tier"] == "storage"
    assert recovery[0]["step"] in (1, 3)
    assert json.loads((tmp_path / "summary.json").read_text())["final_step"] == 5
    st = Storage(str(ckpt))
    names = st.committed()
    check_shards(ckpt, 4, len(names))
    assert "-step00000005-" in names[-1]

    # One process, plain tensors: the trainer's own set-up, then the library's restore.
    args = build_parser().parse_args(["train", *common])
    run1 = setup(train_config_from_args(args), DistInfo(0, 1, 0, False))
    try:
        report = run1.manager.restore()
        assert report.step == 5
        assert any(s["step"] < 5 for s in report.sources.values())  # stale experts
        view = read_view(str(ckpt))
        saved = consolidate(view.manifest, view.values)
        n = 0
        for name, p in run1.model.named_parameters():
            assert torch.equal(p.detach(), saved[f"model.{name}"]), name
            state = run1.optimizer.state[p]
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, name
            for k, v in state.items():
                assert torch.equal(v, saved[f"optim.{name}.{k}"]), (name, k)
                n += 1
        assert n == 3 * len(list(run1.model.parameters()))
        assert float(run1.optimizer.state[p]["step"]) == 6  # 6 optimizer steps: 0..5
        assert run1.loader.state_dict() is not None
    finally:
        run1.manager.close()
