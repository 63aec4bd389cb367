"""Checkpointing over several ranks (gloo, spawned processes): sharded writes, restore
onto other (DP, EP) layouts, RAM recovery across ranks, rank death during a save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from moepec.store.storage import Storage
from tests import dist_worker as dw
from tests.spawning import start_processes

pytestmark = [pytest.mark.timeout(240)]


def spawn(fn, world: int, tmp: Path, *args) -> list[dict]:
    store = tmp / f"store-{fn.__name__}-{len(list(tmp.iterdir()))}"
    out = tmp / f"out-{store.name}"
    out.mkdir()
    start_processes(fn, (world, str(store), str(out), *args), world)
    return [json.loads((out / f"result-r{r}.json").read_text()) for r in range(world)], out


def spawn_nojoin(fn, world, tmp, *args):
    store = tmp / "store-kill"
    out = tmp / "out-kill"
    out.mkdir()
    ctx = start_processes(fn, (world, str(store), str(out), *args), world, join=False)
    for p in ctx.processes:
        p.join(120)
    results = []
    for r in range(world):
        path = out / f"result-r{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results, [p.exitcode for p in ctx.processes]


def ok(results):
    for r in results:
        assert r.get("ok"), r.get("trace")


def expected(out: Path, ckpt: Path, ep: int, world: int):
    """From the training ranks' histories: the state restore must reproduce."""
    st = Storage(str(ckpt))
    manifests = {n: st.read_manifest(n) for n in st.committed()}
    base = max(manifests.values(), key=lambda m: m.seq)
    hist = {}
    for path in out.glob("hist-r*-s*.pt"):
        r, s = path.stem[len("hist-r"):].split("-s")
        hist[(int(r), int(s))] = torch.load(path)
    want = dict(hist[(0, base.step)])
    for key in list(want):
        if key.startswith("E"):
            del want[key]
    # every expert: the state at its newest committed copy, from a rank that held it
    n_local = dw.N_GLOBAL // ep
    for layer in range(2):
        for e in range(dw.N_GLOBAL):
            steps = [m.step for m in manifests.values() if m.step <= base.step
                     and any(k.startswith(f"experts/{layer}/{e}/model/") for k in m.keys)]
            holder = next(r for r in range(world) if r % ep == e // n_local)
            src = hist[(holder, max(steps))]
            for k, v in src.items():
                if k.startswith(f"E{layer}.{e}."):
                    want[k] = v
    return base, want


def check_restored(out: Path, results, want, world_ep: tuple[int, int]):
    world, ep = world_ep
    n_local = dw.N_GLOBAL // ep
    states = [torch.load(out / f"restored-r{r}.pt") for r in range(world)]
    for r, state in enumerate(states):
        ep_rank = r % ep
        for k, v in state.items():
            assert torch.equal(v, want[k]), (r, k)
        owned = {f"E{li}.{ep_rank * n_local + i}." for li in range(2) for i in range(n_local)}
        assert {k for k in state if k.startswith("E")} == {
            k for k in want if k.startswith("E") and any(k.startswith(o) for o in owned)}
    assert len({json.dumps(r["lost"]) for r in results}) == 1  # all ranks agree on PLT


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "modules"])
def test_save_dp4_ep2_restore_on_other_layouts(tmp_path, layout):
    ckpt = tmp_path / "ckpt"
    results, out = spawn(dw.train_worker, 4, tmp_path, 2, layout, 8, str(ckpt), 1, 1,
                         "adaptive")
    ok(results)
    st = Storage(str(ckpt))
    names = st.committed()
    assert len(names) == 4
    for name in names:
        m = st.read_manifest(name)
        # every item written exactly once, by one of the ranks that hold it
        md = FileSystemReader(str(ckpt / name)).read_metadata()
        assert set(md.state_dict_metadata) == set(m.keys)
        for key, info in m.keys.items():
            if key.startswith("experts/"):
                e = int(key.split("/")[2])
                assert info.rank % 2 == e // 2, key
        assert sum(m.bytes_per_rank) == m.bytes
        assert sum(1 for b in m.bytes_per_rank if b > 0) == 4  # all ranks write
    base, want = expected(out, ckpt, ep=2, world=4)
    # plain DP and EP 2 on 2 ranks (the modules layout: one process only, to save time)
    for world, ep in [(2, 1), (2, 2)] if layout == "stacked" else []:
        res, rout = spawn(dw.restore_worker, world, tmp_path, ep, layout, str(ckpt))
        ok(res)
        assert all(r["step"] == base.step for r in res)
        check_restored(rout, res, want, (world, ep))
    # one process, no torch.distributed at all
    single = tmp_path / "single"
    single.mkdir()
    dw.restore_worker(0, 1, "", str(single), 1, layout, str(ckpt))
    res = [json.loads((single / "result-r0.json").read_text())]
    ok(res)
    check_restored(single, res, want, (1, 1))


@pytest.mark.slow
def test_ram_recovery_across_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    results, out = spawn(dw.train_worker, 2, tmp_path, 1, "stacked", 7, str(ckpt), 1, 3,
                         "sharded", None, True)
    ok(results)
    assert {r["step"] for r in results} == {5}
    assert all(r["tier"] == "ram" and r["units_from"].get("ram", 0) > 0 for r in results)
    hist = {r: torch.load(out / f"hist-r{r}-s5.pt") for r in range(2)}
    for r in range(2):
        restored = torch.load(out / f"restored-r{r}.pt")
        assert torch.equal(restored["embed.weight"], hist[0]["embed.weight"])
    # identical on both ranks
    a, b = (torch.load(out / f"restored-r{r}.pt") for r in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert results[0]["lost"] == results[1]["lost"]


@pytest.mark.slow
def test_restarted_rank_uses_storage_survivor_serves_its_ram(tmp_path):
    ckpt = tmp_path / "ckpt"
    results, out = spawn(dw.train_worker, 2, tmp_path, 1, "stacked", 8, str(ckpt), 1, 3,
                         "sharded", None, True, 1)
    ok(results)
    # base: the newest committed checkpoint (rank 1 lost its share of the RAM snapshot)
    assert {r["step"] for r in results} == {7} and {r["tier"] for r in results} == {"storage"}
    # ...but rank 0's surviving RAM copies of that step supply experts storage lacks
    assert all(r["units_from"].get("ram", 0) > 0 for r in results)
    a, b = (torch.load(out / f"restored-r{r}.pt") for r in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    hist = torch.load(out / "hist-r0-s7.pt")
    assert torch.equal(a["embed.weight"], hist["embed.weight"])
    assert results[0]["lost"] == results[1]["lost"]
    # fewer tokens lost than from storage alone
    res, _ = spawn(dw.restore_worker, 2, tmp_path, 1, "stacked", str(ckpt))
    ok(res)
    assert sum(map(sum, results[0]["lost"])) < sum(map(sum, res[0]["lost"]))


@pytest.mark.slow
def test_rank_killed_during_save_aborts_that_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    results, codes = spawn_nojoin(dw.train_worker, 2, tmp_path, 1, "stacked", 8, str(ckpt),
                                  1, 1, "sharded", "write:2")
    assert codes[1] == -9
    assert results[0] is not None and "error" in results[0]  # rank 0 gave up, did not hang
    listing = Storage(str(ckpt)).list_checkpoints()
    assert listing[0][1] is True
    assert all(not committed for _, committed in listing[1:])


@pytest.mark.slow
def test_different_expert_count_refused_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    results, _ = spawn(dw.train_worker, 2, tmp_path, 1, "stacked", 4, str(ckpt), 1, 1,
                       "sharded")
    ok(results)
    res, _ = spawn(dw.restore_worker, 2, tmp_path, 1, "stacked", str(ckpt), 8)
    errors = {r["error"] for r in res}
    assert len(errors) == 1
    (msg,) = errors
    assert msg.startswith("StructureMismatchError") and "MoE layer 0" in msg


@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")  # (the test's load)
def test_a_raw_save_of_two_ranks_writes_one_metadata_and_a_failed_rank_fails_both_at_once(
        tmp_path):
    """Storage.write over two gloo ranks (no dcp.save: each rank writes its data file,
    the first writes .metadata from both ranks' items): every rank learns where every
    item landed, and DCP loads the whole tensor from both ranks' chunks bit for bit. A
    rank that cannot start its data file fails the save on both ranks at once (the
    other is told which rank, never left waiting for a collective), and no .metadata
    is written."""
    import torch.distributed.checkpoint as dcp

    from moepec.store.dcp_raw import RawFileSystemReader

    root = tmp_path / "root"
    results, _ = spawn(dw.started_write_worker, 2, tmp_path, str(root), -1)
    ok(results)
    assert results[0]["where"] == results[1]["where"]
    assert {k for k, *_ in results[0]["where"]} == {"own0", "own1", "w#0,0+2,3:4,3",
                                                    "w#2,0+2,3:4,3"}
    back = {"w": torch.zeros(4, 3), "own0": torch.ones(5), "own1": torch.zeros(5)}
    dcp.load(back, storage_reader=RawFileSystemReader(str(root / "c")), no_dist=True)
    assert torch.equal(back["w"], torch.arange(12, dtype=torch.float32).view(4, 3))
    assert torch.equal(back["own0"], torch.zeros(5)) and torch.equal(back["own1"], torch.ones(5))

    root = tmp_path / "failing"
    results, _ = spawn(dw.started_write_worker, 2, tmp_path, str(root), 1)
    assert not results[0]["ok"] and not results[1]["ok"]
    assert "No space left" in results[1]["error"]
    assert "rank 1 could not write its data" in results[0]["error"], results[0]["error"]
    assert max(r["seconds"] for r in results) < 30  # (the group's timeout is 60 s)
    assert not (root / "c" / ".metadata").exists()
