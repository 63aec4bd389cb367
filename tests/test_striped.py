"""Checkpoints striped over replica groups (one process plays two groups of one rank).

Two identical replicas train in lockstep; each writes its part of every checkpoint into
its own root. The parts are disjoint, about even, and together hold exactly what one
root holds when one group writes everything; a restore over both roots (and an export of
the folder holding them) equals that root's bit for bit. A part that never committed: the newest whole checkpoint
(all parts committed) is restored, and retention kept it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import NoCheckpointError
from moepec.keys import parse_key
from moepec.store.committed import committed_manifests
from moepec.store.meta import Part
from moepec.store.parts import protected
from moepec.store.storage import Storage
from tests.toy import Counter, full_state, make, train_step

INTERVAL = 4


class Replica:
    """One group: model, optimizer, schedule, data position, its manager."""

    def __init__(self, path: Path, peers: list[Path] | None = None, seed: int = 0,
                 keep_last: int = 8, k_snapshot: int | None = None) -> None:
        self.model, self.opt, self.sched = make(seed)
        self.counter = Counter()
        cfg = CheckpointConfig(path=str(path), interval=INTERVAL, k_persist=1,
                               k_snapshot=k_snapshot,
                               keep_last=keep_last, ram_dir=None, async_persist=False,
                               peer_paths=tuple(str(p) for p in peers or ()))
        self.mgr = CheckpointManager(self.model, self.opt, cfg,
                                     extra_state={"scheduler": self.sched,
                                                  "data": self.counter})

    def train(self, step: int, gen: torch.Generator, part: Part | None, save: bool = True
              ) -> None:
        _, counts = train_step(self.model, self.opt, self.sched, gen)
        self.mgr.wait_for_snapshot()
        self.opt.step()
        self.sched.step()
        self.counter.position += 1
        self.mgr.observe_routing(counts)
        if save:
            if self.mgr.due(step):
                self.mgr.share(part)
            self.mgr.step(step)


def _lockstep(tmp: Path, steps: int, *, keep_last: int = 8, stop_b_at: int | None = None,
              stop_ref_at: int | None = None, k_snapshot: int | None = None,
              close: bool = True) -> tuple[Replica, Replica, Replica]:
    """Groups a (part 0) and b (part 1) and a reference writing whole checkpoints."""
    roots = [tmp / "group-0", tmp / "group-1"]
    a = Replica(roots[0], [roots[1]], keep_last=keep_last, k_snapshot=k_snapshot)
    b = Replica(roots[1], [roots[0]], keep_last=keep_last, k_snapshot=k_snapshot)
    ref = Replica(tmp / "whole", k_snapshot=k_snapshot)
    gens = [torch.Generator().manual_seed(7) for _ in range(3)]
    for step in range(steps):
        first = step == INTERVAL - 1
        for i, (r, gen) in enumerate(zip((a, b, ref), gens)):
            part = Part(index=i, count=2, members=(0, 1), epoch="e1", full=first) \
                if i < 2 else None
            late = stop_b_at if i == 1 else stop_ref_at if i == 2 else None
            r.train(step, gen, part, save=late is None or step < late)
    for r in (a, b, ref) if close else ():
        r.mgr.close()
    return a, b, ref


def _manifests(path: Path) -> dict:
    return committed_manifests(Storage(str(path))).manifests


def _restored(path: Path, peers: list[Path] | None = None):
    fresh = Replica(path, peers, seed=1)
    report = fresh.mgr.restore()
    fresh.mgr.close()
    return report, full_state(fresh.model, fresh.opt), fresh.counter.position


def test_parts_are_disjoint_even_and_restore_whole_bit_for_bit(tmp_path, tmp_path_factory):
    _lockstep(tmp_path, 3 * INTERVAL)
    parts = [sorted(_manifests(tmp_path / f"group-{g}").values(), key=lambda m: m.step)
             for g in (0, 1)]
    whole = sorted(_manifests(tmp_path / "whole").values(), key=lambda m: m.step)
    assert [m.step for m in whole] == [m.step for m in parts[0]] == [m.step for m in parts[1]]
    for p0, p1, w in zip(*parts, whole):
        assert p0.meta.part["index"] == 0 and p1.meta.part["index"] == 1
        tensors = [{k for k in m.keys if not k.startswith("objects/")} for m in (p0, p1)]
        assert not tensors[0] & tensors[1]
        assert tensors[0] | tensors[1] == {k for k in w.keys if not k.startswith("objects/")}
        assert p0.bytes + p1.bytes >= w.bytes and 0.3 < p0.bytes / (p0.bytes + p1.bytes) < 0.7
        assert p0.meta.full == p1.meta.full == w.meta.full
    # Offline: the folder of the group roots exports what the whole root exports.
    from safetensors.torch import load_file

    from moepec.recovery.offline import export_view

    out = tmp_path_factory.mktemp("exports")
    export_view(str(tmp_path / "whole"), str(out / "whole.safetensors"), "safetensors")
    report = export_view(str(tmp_path), str(out / "striped.safetensors"), "safetensors")
    assert "+" in report.view.manifest.name and report.view.manifest.step == 3 * INTERVAL - 1
    exported = [load_file(str(out / f"{n}.safetensors")) for n in ("whole", "striped")]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(v, exported[1][k]) for k, v in exported[0].items())
    with pytest.raises(NoCheckpointError, match="pass the folder that holds the group"):
        export_view(str(tmp_path / "group-1"), str(out / "x.safetensors"), "safetensors")
    want, want_state, want_pos = _restored(tmp_path / "whole")
    for g in (0, 1):
        got, state, pos = _restored(tmp_path / f"group-{g}", [tmp_path / f"group-{1 - g}"])
        assert got.step == want.step == 3 * INTERVAL - 1 and pos == want_pos
        assert got.plt == want.plt and got.lost_total == want.lost_total
        assert state.keys() == want_state.keys()
        for k, v in want_state.items():
            assert torch.equal(state[k], v), k


def test_a_part_never_committed_restores_the_newest_whole_one_kept_by_retention(tmp_path):
    """Group b dies before its part of the last checkpoint commits (it never saves it);
    group a commits its part, and its retention (keep_last=1) keeps its part of the
    previous checkpoint, the newest whole one."""
    last = 3 * INTERVAL - 1
    _lockstep(tmp_path, 3 * INTERVAL, keep_last=1, stop_b_at=last, stop_ref_at=last)
    steps = sorted(m.step for m in _manifests(tmp_path / "group-0").values())
    assert steps[-1] == last and 2 * INTERVAL - 1 in steps
    assert max(m.step for m in _manifests(tmp_path / "group-1").values()) == 2 * INTERVAL - 1
    kept = protected(_manifests(tmp_path / "group-0"), [_manifests(tmp_path / "group-1")])
    assert any(f"step{2 * INTERVAL - 1:08d}" in name for name in kept), kept
    want, want_state, _ = _restored(tmp_path / "whole")
    got, state, _ = _restored(tmp_path / "group-0", [tmp_path / "group-1"])
    assert got.step == want.step == 2 * INTERVAL - 1
    for k, v in want_state.items():
        assert torch.equal(state[k], v), k


def test_a_restore_in_the_same_process_takes_the_groups_ram_snapshot(tmp_path):
    """The RAM snapshot holds the group's whole share with K_snapshot=2 experts (the parts
    on storage K_persist=1): restored as the base, the other experts from the roots, it
    equals the reference's RAM restore bit for bit."""
    a, b, ref = _lockstep(tmp_path, 3 * INTERVAL, k_snapshot=2, close=False)
    try:
        reports = [r.mgr.restore() for r in (a, ref)]
        assert [(x.tier, x.step) for x in reports] == [("ram", 3 * INTERVAL - 1)] * 2
        assert reports[0].lost_total == reports[1].lost_total
        want = full_state(ref.model, ref.opt)
        got = full_state(a.model, a.opt)
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    finally:
        for r in (a, b, ref):
            r.mgr.close()


def test_parts_without_a_whole_checkpoint_are_refused(tmp_path):
    _lockstep(tmp_path, INTERVAL, stop_b_at=0)
    with pytest.raises(NoCheckpointError, match="no whole one"):
        _restored(tmp_path / "group-0", [tmp_path / "group-1"])


@pytest.mark.parametrize("ranks,parts", [(2, 2), (4, 2), (2, 3)])
def test_the_write_plan_over_all_groups_ranks_is_disjoint_complete_and_even(ranks, parts):
    """rank_share over ``parts`` groups of ``ranks`` ranks: every tensor key written once by
    exactly one rank of one group, the objects by rank 0 of each group, no rank more than
    the mean share plus one item (an expert unit is written whole: the greedy bound)."""
    from moepec.state.catalog import StateCatalog
    from moepec.state.checkpoint_keys import CheckpointKeys, rank_share
    from moepec.state.experts import discover

    model, opt, sched = make(0)
    train_step(model, opt, sched, torch.Generator().manual_seed(0))
    opt.step()
    catalog = StateCatalog(model, opt, discover(model), {"scheduler": sched})
    keys = CheckpointKeys(catalog, pec_scope="all", rank=0, world_size=ranks, ep_size=1,
                          write_mode="adaptive").keys_for([[0], [1]])
    shares = {(p, r): rank_share(keys, catalog, rank=r, world_size=ranks, ep_size=1,
                                 mode="adaptive", part=p, parts=parts)
              for p in range(parts) for r in range(ranks)}
    tensors = [k for k in keys if not k.startswith("objects/")]
    owners = {k: [pr for pr, share in shares.items() if k in share] for k in tensors}
    assert all(len(o) == 1 for o in owners.values()), owners
    for (_, r), share in shares.items():
        objects = [k for k in share if k.startswith("objects/")]
        assert objects == ([k for k in keys if k.startswith("objects/")] if r == 0 else [])
    load = [sum(catalog.nbytes(k) for k in share if not k.startswith("objects/"))
            for share in shares.values()]
    items: dict = {}
    for k in tensors:
        info = parse_key(k)
        unit = (info.layer, info.expert, info.part) if info.is_expert else k
        items[unit] = items.get(unit, 0) + catalog.nbytes(k)
    assert max(load) <= sum(load) / len(load) + max(items.values()), load
    assert min(load) > 0
