"""The flat front end (moepec.flat) on the engine's schedule, without any framework: the
selection policies, ``full_every``, dynamic K under a PLT budget, and a stitched load
whose RestoreReport (sources, lost, PLT) equals an independent computation from the
routing counts. One process, a one-rank gloo group (the front end's collectives)."""

from __future__ import annotations

import random

import pytest
import torch

import moepec
from moepec.flat import FlatFrontEnd, write_rank

N = 4
LAYERS = ("decoder.layers.mlp@(0,)", "decoder.layers.mlp@(1,)")
UNITS = {"dense": None} | {f"e{li}.{e}": (LAYERS[li], e) for li in range(2) for e in range(N)}


pytestmark = pytest.mark.usefixtures("one_rank")  # tests/conftest.py


def values(step: int) -> dict[str, torch.Tensor]:
    return {k: torch.full((3,), float(step * 100 + i)) for i, k in enumerate(UNITS)}


def save(front: FlatFrontEnd, root, step: int):
    plan = front.plan_save(str(root), f"iter_{step:07d}", step, UNITS)
    vals = values(step)
    write_rank(str(root / plan.name), {k: vals[k] for k in plan.written}, 0)
    front.finish_save(plan)
    return plan


def per_layer(plan) -> list[list[int]]:
    return [[e for lay, e in plan.saved if lay == layer] for layer in LAYERS]


def test_load_aware_selection_follows_the_routing_counts(tmp_path):
    front = FlatFrontEnd(k_persist=1, selection="load_aware")
    assert per_layer(save(front, tmp_path, 0)) == [[0, 1, 2, 3]] * 2  # the first is full
    front.observe_routing([[1, 2, 90, 3], [5, 0, 1, 70]])
    assert per_layer(save(front, tmp_path, 10)) == [[2], [3]]
    front.observe_routing(torch.tensor([[50, 2, 1, 3], [5, 60, 1, 0]]))
    front.observe_routing([[0, 0, 0, 1]])  # layer 0 only: rows may be short
    assert per_layer(save(front, tmp_path, 20)) == [[0], [1]]


def test_a_router_hooks_counts_are_summed_where_they_are_and_read_at_the_save(tmp_path):
    """observe_layer (the doors' router hooks): one layer's counts per forward, summed
    without a host copy; the save reads them as observe_routing's, once."""
    front = FlatFrontEnd(k_persist=1, selection="load_aware")
    save(front, tmp_path, 0)
    counts = torch.tensor([1, 2, 90, 3])
    front.observe_layer(1, counts)
    counts += 100  # the hook's tensor is the caller's: what was observed stays
    front.observe_layer(1, torch.tensor([[0, 0, 0, 5]]))
    front.observe_routing([[4, 0, 0, 0]])
    plan = save(front, tmp_path, 10)
    assert plan.schedule["counts"] == [[4, 0, 0, 0], [1, 2, 90, 8]]
    assert per_layer(plan) == [[0], [2]]
    assert save(front, tmp_path, 20).schedule["counts"] == [[4, 0, 0, 0], [1, 2, 90, 8]]


def test_sequential_rotation_and_full_every(tmp_path):
    front = FlatFrontEnd(k_persist=1, full_every=3)
    got = [per_layer(save(front, tmp_path, s)) for s in range(0, 70, 10)]
    # full at checkpoints 0, 3, 6; between them layer m saves (m + j) mod N, j = 0, 1, ...
    assert got == [[[0, 1, 2, 3]] * 2, [[0], [1]], [[1], [2]], [[0, 1, 2, 3]] * 2,
                   [[2], [3]], [[3], [0]], [[0, 1, 2, 3]] * 2]


def test_a_final_save_writes_every_expert_once_and_loads_with_plt_0(tmp_path):
    """complete_next_save (moepec.flat.final): the next save writes every expert (K = N
    once), its load reads nothing older (PLT 0, no token lost), and the rotation goes on
    after it (the mark is one-shot)."""
    front = FlatFrontEnd(k_persist=1, dynamic_k=False)
    for step in (0, 10, 20):
        front.observe_routing([[5, 6, 7, 8], [1, 2, 3, 4]])
        save(front, tmp_path, step)
    front.complete_next_save()
    front.observe_routing([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert per_layer(save(front, tmp_path, 30)) == [[0, 1, 2, 3]] * 2
    _, report = FlatFrontEnd(k_persist=1).load(str(tmp_path), "iter_0000030", list(UNITS))
    assert {s["checkpoint"] for s in report.sources.values()} == {"iter_0000030"}
    assert len(report.sources) == 2 * N and report.lost_total == 0 and report.plt == 0
    assert per_layer(save(front, tmp_path, 40)) == [[2], [3]]  # one-shot; rotation on


def test_a_stitched_load_reports_sources_and_plt_from_the_counts(tmp_path):
    rng = random.Random(7)
    front = FlatFrontEnd(k_persist=1, dynamic_k=False)
    saves, intervals = [], []
    for step in (0, 10, 20, 30):
        counts = [[rng.randrange(100) for _ in range(N)] for _ in LAYERS]
        intervals.append(counts)
        front.observe_routing(counts)
        saves.append((step, save(front, tmp_path, step)))
    fresh = FlatFrontEnd(k_persist=1, dynamic_k=False)
    targets, report = fresh.load(str(tmp_path), "iter_0000030", list(UNITS))
    assert isinstance(report, moepec.RestoreReport) and report.step == 30
    assert fresh.last_load_report() is report
    # Independent: each expert's copy is from the newest save that wrote it; the tokens
    # routed to it after that save (through the last one) are lost.
    lost = [[0] * N for _ in LAYERS]
    for li, layer in enumerate(LAYERS):
        for e in range(N):
            i = max(i for i, (_, plan) in enumerate(saves) if (layer, e) in plan.saved)
            step = saves[i][0]
            assert report.sources[f"{li}/{e}"]["step"] == step
            assert torch.equal(targets[f"e{li}.{e}"], values(step)[f"e{li}.{e}"])
            lost[li][e] = sum(intervals[j][li][e] for j in range(i + 1, len(saves)))
    assert torch.equal(targets["dense"], values(30)["dense"])
    assert report.lost == lost
    totals = [sum(sum(c[li]) for c in intervals) for li in range(len(LAYERS))]
    expected = sum(sum(lost[li]) / totals[li] for li in range(len(LAYERS))) / len(LAYERS)
    assert report.plt == pytest.approx(expected, rel=1e-12) and report.plt > 0


def test_dynamic_k_raises_k_after_a_load_over_the_plt_budget(tmp_path):
    front = FlatFrontEnd(k_persist=1, plt_budget=0.01)
    for step in (0, 10, 20):
        front.observe_routing([[10, 20, 30, 40], [40, 30, 20, 10]])
        save(front, tmp_path, step)
    fresh = FlatFrontEnd(k_persist=1, plt_budget=0.01)
    _, report = fresh.load(str(tmp_path), "iter_0000020", list(UNITS))
    assert report.plt > 0.01
    plan = save(fresh, tmp_path, 30)
    assert plan.parent == "iter_0000020" and plan.k_persist == 2
    assert [len(x) for x in per_layer(plan)] == [2, 2]
    # the ledger carries the recovery: a later load counts it once more, not less
    _, again = FlatFrontEnd().load(str(tmp_path), "iter_0000030", list(UNITS))
    assert again.plt >= report.plt


def test_a_door_takes_only_the_fields_that_apply():
    with pytest.raises(moepec.ConfigError, match="interval.*k_persist"):
        FlatFrontEnd(interval=3)
    with pytest.raises(moepec.ConfigError, match="k_persist must be >= 1"):
        FlatFrontEnd(k_persist=0)
    with pytest.raises(moepec.ConfigError, match="selection"):
        FlatFrontEnd(selection="random")


def test_regions_cut_any_box_or_flat_slice_from_saved_shards():
    from moepec.flat import Region, parse_shard_key, shard_key
    from moepec.flat.regions import assemble
    whole = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    key = shard_key("w", (2, 0), (2, 8), (3, 11))
    assert key == "w#2,0+2,8~3:11" and parse_shard_key(key) == Region("w", (2, 0), (2, 8),
                                                                       (3, 11))
    assert parse_shard_key("object:x") is None and parse_shard_key("w#1,2+3") is None
    # saved: three uneven row blocks, the middle one as two flat slices
    saved = {Region("w", (0, 0), (1, 8)): whole[0:1],
             Region("w", (1, 0), (3, 8), (0, 10)): whole[1:4].reshape(-1)[:10],
             Region("w", (1, 0), (3, 8), (10, 24)): whole[1:4].reshape(-1)[10:],
             Region("w", (4, 0), (2, 8)): whole[4:6]}
    for want, expect in [
            (Region("w", (0, 0), (6, 8)), whole),                     # the whole tensor
            (Region("w", (0, 4), (6, 4)), whole[:, 4:]),              # a column split
            (Region("w", (3, 2), (2, 3)), whole[3:5, 2:5]),            # a box across blocks
            (Region("w", (2, 0), (3, 8), (5, 20)), whole[2:5].reshape(-1)[5:20])]:
        assert torch.equal(assemble(want, saved), expect), want
    with pytest.raises(moepec.CheckpointError, match="cover 32 of the 48"):
        assemble(Region("w", (0, 0), (6, 8)), {r: t for r, t in saved.items()
                                               if r.offset != (4, 0)})


def test_a_load_at_another_layout_cuts_shards_and_keeps_the_accounting(tmp_path):
    """Saved as two row blocks per expert tensor (like TP 2); loaded as whole tensors (TP
    1) and as column halves: bit for bit, with the same sources and PLT as a load at the
    save's own layout."""
    from moepec.flat import shard_key
    full = {f"x{e}": torch.randn(4, 6, generator=torch.Generator().manual_seed(e))
            for e in range(N)}
    units = {shard_key(f"x{e}", (e, r * 2, 0), (1, 2, 6)): (LAYERS[0], e)
             for e in range(N) for r in range(2)}
    front = FlatFrontEnd(k_persist=2)
    saved_at = {}
    for step in (0, 10):
        vals = {k: full[k.split("#")[0]][None, int(k.split(",")[1]):][:, :2] + step
                for k in units}
        front.observe_routing([[5, 6, 7, 8]])
        plan = front.plan_save(str(tmp_path), f"iter_{step:07d}", step, units)
        write_rank(str(tmp_path / plan.name), {k: vals[k] for k in plan.written}, 0)
        front.finish_save(plan)
        saved_at.update({e: step for (_, e) in plan.saved})
    same, report = FlatFrontEnd().load(str(tmp_path), "iter_0000010", list(units))
    whole = {shard_key(f"x{e}", (e, 0, 0), (1, 4, 6)): e for e in range(N)}
    cols = {shard_key(f"x{e}", (e, 0, 3), (1, 4, 3)): e for e in range(N)}
    got, other = FlatFrontEnd().load(str(tmp_path), "iter_0000010", [*whole, *cols])
    for k, e in whole.items():
        assert torch.equal(got[k][0], full[f"x{e}"] + saved_at[e])
    for k, e in cols.items():
        assert torch.equal(got[k][0], full[f"x{e}"][:, 3:] + saved_at[e])
    assert other.sources == report.sources and other.plt == report.plt > 0
    with pytest.raises(moepec.CheckpointError, match="no saved shard"):
        FlatFrontEnd().load(str(tmp_path), "iter_0000010", [shard_key("y", (0,), (2,))])


def test_a_folder_deleted_and_written_again_is_not_continued_from_memory(tmp_path):
    """Megatron's tests reuse folder names in one directory: a save continues the folder
    on disk, not the one this process remembers under the same name."""
    import shutil
    first = FlatFrontEnd(k_persist=1)
    save(first, tmp_path, 0)
    shutil.rmtree(tmp_path / "iter_0000000")
    other = FlatFrontEnd(k_persist=1)  # a new folder of the same name, other keys
    fewer = {k: u for k, u in UNITS.items() if u is None or u[0] == LAYERS[0]}
    p0 = other.plan_save(str(tmp_path), "iter_0000000", 0, fewer)
    write_rank(str(tmp_path / p0.name), {k: values(0)[k] for k in p0.written}, 0)
    other.finish_save(p0)
    plan = save(first, tmp_path, 10)
    assert plan.parent == "iter_0000000"
    targets, report = FlatFrontEnd().load(str(tmp_path), "iter_0000010", list(UNITS))
    assert report.step == 10 and torch.equal(targets["dense"], values(10)["dense"])


def test_an_expert_whose_newest_folder_is_gone_loads_from_its_older_copy(tmp_path):
    """A folder a view needs is deleted (by hand, or a framework's rotation such as the
    Trainer's save_total_limit): each expert it held comes from its newest older copy in
    the lineage, said in the report's warnings, its loss in the PLT; a folder written
    again under an ancestor's name is not that ancestor."""
    import shutil

    front = FlatFrontEnd(k_persist=1, dynamic_k=False)
    plans = {}
    for step in (0, 10, 20, 30):
        front.observe_routing([[10, 20, 30, 40], [40, 30, 20, 10]])
        plans[step] = save(front, tmp_path, step)
    _, before = FlatFrontEnd().load(str(tmp_path), "iter_0000030", list(UNITS))
    shutil.rmtree(tmp_path / "iter_0000010")
    targets, report = FlatFrontEnd().load(str(tmp_path), "iter_0000030", list(UNITS))
    moved = plans[10].saved  # K=1: one expert per layer, now from the full save at 0
    assert len(moved) == 2 and len(report.warnings) == 2
    for li, layer in enumerate(LAYERS):
        for e in range(N):
            newest = max(s for s, p in plans.items() if (layer, e) in p.saved and s != 10)
            assert report.sources[f"{li}/{e}"]["step"] == newest
            assert torch.equal(targets[f"e{li}.{e}"], values(newest)[f"e{li}.{e}"])
            if (layer, e) in moved:
                assert before.sources[f"{li}/{e}"]["step"] == 10
                assert any(f"{li}" in w and "iter_0000010 is gone" in w and
                           "iter_0000000" in w for w in report.warnings)
    assert report.plt > before.plt
    # the next save continues from the view as loaded: it needs no gone folder
    front = FlatFrontEnd(k_persist=1, dynamic_k=False)
    front.load(str(tmp_path), "iter_0000030", list(UNITS))
    plan = save(front, tmp_path, 40)
    assert "iter_0000010" not in plan.view.values()
    # the full save at 0 deleted and written again by another lineage: not an ancestor
    shutil.rmtree(tmp_path / "iter_0000000")
    other = FlatFrontEnd(k_persist=1)
    other_plan = other.plan_save(str(tmp_path / "elsewhere"), "iter_0000000", 0, UNITS)
    assert other_plan.seq == 0
    save(FlatFrontEnd(k_persist=1), tmp_path / "x", 0)  # a root of its own
    shutil.copytree(tmp_path / "x" / "iter_0000000", tmp_path / "iter_0000000")
    with pytest.raises(moepec.CheckpointError, match="no older copy"):
        FlatFrontEnd().load(str(tmp_path), "iter_0000030", list(UNITS))


def test_a_save_after_a_needed_folder_is_deleted_writes_its_experts_again(tmp_path):
    """A rotation that deletes old folders (the Trainer's save_total_limit) must not fail
    every later commit: the next save writes again each expert whose newest copy was in
    the deleted folder, and its view needs only folders that exist."""
    import shutil

    front = FlatFrontEnd(k_persist=1)
    plans = [save(front, tmp_path, step) for step in (0, 10, 20)]
    shutil.rmtree(tmp_path / "iter_0000000")  # the full save: 6 of 8 experts' copies
    plan = save(front, tmp_path, 30)
    only_there = {u for u in UNITS.values() if u is not None} - set(plans[1].saved) \
        - set(plans[2].saved)  # K=1 a layer at 10 and 20: four experts' copies were there
    assert len(only_there) == 4 and set(plan.saved) >= only_there
    assert "iter_0000000" not in plan.view.values()
    targets, report = FlatFrontEnd().load(str(tmp_path), "iter_0000030", list(UNITS))
    assert not report.warnings
    for key in UNITS:
        src = int(plan.view[key].removeprefix("iter_"))
        assert torch.equal(targets[key], values(src)[key])


def test_a_save_after_a_needed_folder_is_written_again_writes_its_experts_again(tmp_path):
    """A folder the view needs deleted and written again under its name by another save
    (its manifest there, another uid): the next save does not lean on that save's data,
    it writes those experts again, and the load needs no older copy."""
    import shutil

    front = FlatFrontEnd(k_persist=1)
    plans = [save(front, tmp_path, step) for step in (0, 10, 20)]
    shutil.rmtree(tmp_path / "iter_0000000")
    save(FlatFrontEnd(k_persist=1), tmp_path / "other", 0)  # same name, another save
    shutil.copytree(tmp_path / "other" / "iter_0000000", tmp_path / "iter_0000000")
    plan = save(front, tmp_path, 30)
    only_there = {u for u in UNITS.values() if u is not None} - set(plans[1].saved) \
        - set(plans[2].saved)
    assert len(only_there) == 4 and set(plan.saved) >= only_there
    assert "iter_0000000" not in plan.view.values()
    targets, report = FlatFrontEnd().load(str(tmp_path), "iter_0000030", list(UNITS))
    assert not report.warnings
    for key in UNITS:
        assert torch.equal(targets[key], values(int(plan.view[key][5:]))[key])


def test_a_folder_deleted_while_a_save_is_written_does_not_fail_its_commit(tmp_path):
    """The Trainer rotates (deletes old checkpoints) right after its save returns, while
    the door may still be writing: that save commits; a load reads the deleted folder's
    experts from older copies; the next save writes them again."""
    import shutil

    front = FlatFrontEnd(k_persist=1)
    for step in (0, 10):
        save(front, tmp_path, step)
    plan = front.plan_save(str(tmp_path), "iter_0000020", 20, UNITS)
    vals = values(20)
    write_rank(str(tmp_path / plan.name), {k: vals[k] for k in plan.written}, 0)
    shutil.rmtree(tmp_path / "iter_0000010")  # needed by the view of 20
    front.finish_save(plan)  # committed all the same
    first, report = FlatFrontEnd().load(str(tmp_path), "iter_0000020", list(UNITS))
    assert len(report.warnings) == 2 and all("iter_0000010 is gone" in w
                                             for w in report.warnings)
    # a door's load from the manifests it read for its checks says the same
    door = FlatFrontEnd()
    known = door.folder(str(tmp_path), "iter_0000020")
    got, again = door.load(str(tmp_path), "iter_0000020", list(UNITS), known=known)
    assert again.warnings == report.warnings and again.sources == report.sources
    assert all(torch.equal(got[k], v) for k, v in first.items())
    after = save(front, tmp_path, 30)
    assert "iter_0000010" not in after.view.values()


def test_a_rotation_that_keeps_one_folder_makes_every_save_full_and_says_so_once(
        tmp_path, caplog):
    """Lightning's ModelCheckpoint(save_top_k=1) (or save_total_limit=1) deletes the
    previous folder right after each save returns: a K-of-N save would need the folder
    deleted next. From the first save that finds a needed folder deleted on, every save
    into that root is full, said once; the newest folder then loads alone, nothing
    stale."""
    import shutil

    front = FlatFrontEnd(k_persist=1)
    kept, plans = None, []
    with caplog.at_level("WARNING", logger="moepec.flat.lineage"):
        for step in range(0, 70, 10):
            plans.append(save(front, tmp_path, step))
            if kept is not None:
                shutil.rmtree(tmp_path / kept)
            kept = plans[-1].name
    full = 2 * N
    assert [len(p.saved) for p in plans[:2]] == [full, 2]  # the rotation not seen yet
    assert all(len(p.saved) == full for p in plans[2:])
    said = [r.getMessage() for r in caplog.records if "written full" in r.getMessage()]
    assert len(said) == 1 and "save_top_k=-1" in said[0] and "\n" not in said[0]
    targets, report = FlatFrontEnd().load(str(tmp_path), kept, list(UNITS))
    assert not report.warnings and {s["step"] for s in report.sources.values()} == {60}
    assert all(torch.equal(targets[k], values(60)[k]) for k in UNITS)


def test_a_save_whose_parent_in_flight_never_commits_is_not_committed(tmp_path):
    """Only folders committed when the save was planned may vanish under it: a parent
    still in flight then that never commits (its folder gone or not) fails the save."""
    import shutil

    front = FlatFrontEnd(k_persist=1)
    save(front, tmp_path, 0)
    first = front.plan_save(str(tmp_path), "iter_0000010", 10, UNITS)  # never written
    plan = front.plan_save(str(tmp_path), "iter_0000020", 20, UNITS)
    assert plan.parent == first.name and plan.parent_pending
    vals = values(20)
    write_rank(str(tmp_path / plan.name), {k: vals[k] for k in plan.written}, 0)
    shutil.rmtree(tmp_path / "iter_0000010", ignore_errors=True)
    with pytest.raises(moepec.CheckpointError, match="iter_0000010, which never committed"):
        front.finish_save(plan)


def _two_ranks_load(rank: int, world: int, root: str, interfere: str) -> None:
    """A rank of test_ranks_that_choose_different_copies_all_refuse_the_load and
    test_a_read_that_fails_on_one_rank_fails_the_load_on_every_rank: ``interfere`` is
    "", "choice" (a folder moved between the ranks' choices) or "read" (moved after both
    chose, once rank 0 has read and before rank 1 reads)."""
    import json
    import os
    import time
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    base = Path(root) / "save"
    front = FlatFrontEnd(k_persist=1)
    mine = {k: u for k, u in UNITS.items() if (u is not None and u[0] == LAYERS[1]) == rank}
    for step in (0, 10, 20):
        plan = front.plan_save(str(base), f"iter_{step:07d}", step, mine)
        write_rank(str(base / plan.name), {k: values(step)[k] for k in plan.written
                                           if k in mine}, rank)
        front.finish_save(plan)
    chosen, read_ = Path(root) / "rank0-chose", Path(root) / "rank0-read"
    if interfere == "read":
        read = FlatFrontEnd.read

        def reading(*args, **kwargs):
            if rank == 1:  # a folder the view needs goes after rank 0 read it
                while not read_.exists():
                    time.sleep(0.01)
                os.rename(base / "iter_0000010", Path(root) / "moved-away")
            out = read(*args, **kwargs)
            read_.touch()
            return out
        FlatFrontEnd.read = reading
    if interfere == "choice" and rank == 0:  # say when this rank has chosen its copies
        choose = FlatFrontEnd.folder

        def noting(*args, **kwargs):
            out = choose(*args, **kwargs)
            chosen.touch()
            return out
        FlatFrontEnd.folder = staticmethod(noting)
    if interfere == "choice" and rank == 1:  # a folder the view needs goes before it chose
        while not chosen.exists():
            time.sleep(0.01)
        os.rename(base / "iter_0000010", Path(root) / "moved-away")
    try:
        targets, report = FlatFrontEnd().load(str(base), "iter_0000020", list(UNITS),
                                              agree=True)
        result = {"ok": True, "dense": targets["dense"].tolist(), "step": report.step}
    except moepec.CheckpointError as exc:
        result = {"ok": False, "error": str(exc)}
    (Path(root) / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("interfere", ["", "choice"])
def test_ranks_that_choose_different_copies_all_refuse_the_load(tmp_path, interfere):
    """A door's load (agree=True) over two gloo ranks: when a folder the view needs is
    deleted after one rank chose its copies and before the other did, the ranks would
    read different copies of an expert; every rank refuses the load in one line instead.
    Undisturbed, both load the same state."""
    import json

    from tests.spawning import start_processes

    start_processes(_two_ranks_load, (2, str(tmp_path), interfere), 2)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    if not interfere:
        assert all(r["ok"] and r["step"] == 20 for r in results), results
        assert results[0]["dense"] == results[1]["dense"] == values(20)["dense"].tolist()
        return
    assert not any(r["ok"] for r in results), results
    assert all("read different copies" in r["error"] and "iter_0000020" in r["error"]
               for r in results), results


def test_a_read_that_fails_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    """A door's load (agree=True) over two gloo ranks: a folder the view needs moved away
    after both ranks chose the same copies, once rank 0 has read and before rank 1 reads.
    Rank 1's read fails; rank 0's succeeded, but it refuses the load too, with rank 1's
    reason, rather than going on alone into the framework's next collective."""
    import json

    from tests.spawning import start_processes

    start_processes(_two_ranks_load, (2, str(tmp_path), "read"), 2)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert not any(r["ok"] for r in results), results
    assert results[0]["error"] == results[1]["error"], results
    assert "iter_0000020 not loaded; rank 1: " in results[0]["error"], results
    assert "rank 0:" not in results[0]["error"], results


def test_a_load_says_what_it_read_and_a_load_of_no_keys_says_nothing(tmp_path, caplog):
    """One INFO line per load from storage (the folder, its step, the experts from older
    folders, the PLT); a load of no keys (a RAM load taking over the folder's lineage,
    which logs what it loaded itself) reads nothing and says nothing."""
    front = FlatFrontEnd(k_persist=1, dynamic_k=False)
    for step in (0, 10, 20):
        save(front, tmp_path, step)
    with caplog.at_level("INFO", logger="moepec.flat.front"):
        FlatFrontEnd(k_persist=1).load(str(tmp_path), "iter_0000020", [])
        assert not [r for r in caplog.records if "loaded" in r.getMessage()]
        out, _ = FlatFrontEnd(k_persist=1).load(str(tmp_path), "iter_0000020", list(UNITS))
    said = [r.getMessage() for r in caplog.records if "loaded" in r.getMessage()]
    assert said == ["moepec: loaded iter_0000020 (step 20): 6 of 8 expert(s) from older "
                    "folders, PLT 0.000%"]
    assert torch.equal(out["dense"], values(20)["dense"])
