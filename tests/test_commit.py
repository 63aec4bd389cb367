"""The commit rule, corruption fallback, structure checks and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
    PersistError,
    StructureMismatchError,
)
from moepec.recovery.offline import read_view
from moepec.store.committed import committed_manifests
from moepec.store.manifest import FORMAT
from moepec.store.storage import Storage
from moepec.train.faults import corrupt_item
from tests.toy import Counter, full_state, make, run_loop

ROOT = Path(__file__).resolve().parents[1]


def crash(path: Path, point: str, nth: int, steps: int = 12) -> int:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "crash_child.py"), str(path),
                           point, str(nth), str(steps)], cwd=ROOT, capture_output=True,
                          timeout=120)
    return proc.returncode


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def fresh(path, **kw):
    model, opt, sched = make(seed=3, layout=kw.pop("layout", "stacked"),
                             n_experts=kw.pop("n_experts", 4))
    counter = Counter()
    kw.setdefault("keep_last", 2)
    kw.setdefault("k_persist", 1)
    cfg = CheckpointConfig(path=str(path), interval=2, **kw)
    return CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter}), \
        model, counter


def test_kill_between_write_and_commit_leaves_last_commit(tmp_path):
    ckpt = tmp_path / "c"
    # checkpoints at steps 1, 3, 5: die before committing the third
    assert crash(ckpt, "before_commit", 3) == -9
    listing = Storage(str(ckpt)).list_checkpoints()
    assert [c for _, c in listing] == [True, True, False]
    uncommitted = listing[-1][0]
    assert (ckpt / uncommitted / ".metadata").exists()  # data fully written, no manifest
    manager, _, counter = fresh(ckpt)
    report = manager.restore()
    assert report.step == 3 and counter.position == 4
    assert report.checkpoint != uncommitted


def test_kill_during_retention_keeps_views(tmp_path):
    ckpt = tmp_path / "c"
    assert crash(ckpt, "retention", 4) == -9
    manager, _, _ = fresh(ckpt)
    report = manager.restore()
    assert report.step == 7


def test_next_save_after_crash_does_not_reuse_names(tmp_path):
    ckpt = tmp_path / "c"
    assert crash(ckpt, "before_commit", 2) == -9
    before = {n for n, _ in Storage(str(ckpt)).list_checkpoints()}
    manager, model, _ = fresh(ckpt)
    manager.restore()
    manager.save(step=1)
    manager.close()
    after = {n for n, c in Storage(str(ckpt)).list_checkpoints() if c}
    new = after - before
    assert len(new) == 1 and all(n > max(before) for n in new)


def _corrupt(ckpt_dir: Path, key: str) -> None:
    corrupt_item(ckpt_dir, key)


def _train(path, steps=8, **kw):
    manager, model, counter = fresh(path, **kw)
    opt = manager._catalog.optimizer
    sched = manager._catalog.extra_state["sched"]
    gen = torch.Generator().manual_seed(1)
    states = {}
    def save(step):
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}

    run_loop(manager, model, opt, sched, counter, gen, 0, steps, on_save=save)
    manager.close()
    return manager, states


def test_corrupt_expert_falls_back_to_previous_copy(tmp_path, caplog):
    ckpt = tmp_path / "c"
    manager, states = _train(ckpt, keep_last=4)
    st = manager._storage
    names = st.committed()
    newest = st.read_manifest(names[-1])
    layer0 = newest.meta.experts_saved[0][0]
    key = f"experts/0/{layer0}/model/moe.0.experts.w1"
    _corrupt(ckpt / names[-1], key)
    m2, model, _ = fresh(ckpt, keep_last=4)
    report = m2.restore()
    assert report.step == 7
    assert any("falling back" in w for w in report.warnings)
    src = report.sources[f"0/{layer0}"]
    assert src["checkpoint"] != names[-1] and src["step"] < 7
    assert torch.equal(model.moe[0].experts.w1[layer0], states[src["step"]]["moe.0.experts.w1"][layer0])
    # the fallback costs tokens that restoring the intact copy would not have lost
    assert report.lost[0][layer0] > 0


def test_corrupt_non_expert_state_uses_older_base(tmp_path):
    ckpt = tmp_path / "c"
    manager, states = _train(ckpt, keep_last=4)
    names = manager._storage.committed()
    _corrupt(ckpt / names[-1], "model/embed.weight")
    m2, model, counter = fresh(ckpt, keep_last=4)
    report = m2.restore()
    assert report.step == 5 and counter.position == 6
    assert torch.equal(model.embed.weight, states[5]["embed.weight"])


@pytest.mark.parametrize("serialization", ["raw", "torch_save"])
def test_truncated_data_file_falls_back_to_older_base(tmp_path, serialization):
    ckpt = tmp_path / "c"
    manager, states = _train(ckpt, keep_last=4, serialization=serialization)
    names = manager._storage.committed()
    data = next(p for p in (ckpt / names[-1]).iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    m2, model, counter = fresh(ckpt, keep_last=4, serialization=serialization)
    report = m2.restore()
    assert report.step == 5 and counter.position == 6
    assert torch.equal(model.embed.weight, states[5]["embed.weight"])


def test_newer_manifest_format_is_a_clear_error_and_changes_nothing(tmp_path):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=4, keep_last=4)
    newest = manager._storage.committed()[-1]
    path = ckpt / newest / "moepec.json"
    m = json.loads(path.read_text())
    assert m["format"] == FORMAT and m["serialization"] == "raw"
    m["format"] = "moepec/99"
    path.write_text(json.dumps(m))
    before = tree_digest(ckpt)
    m2, _, _ = fresh(ckpt, keep_last=4)
    with pytest.raises(CheckpointError, match="upgrade moepec"):
        m2.restore()
    assert tree_digest(ckpt) == before


def test_newer_manifest_format_stops_export_and_retention(tmp_path):
    """Neither export nor retention may act as if a newer checkpoint were absent."""
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=8, keep_last=1)
    newest = manager._storage.committed()[-1]
    path = ckpt / newest / "moepec.json"
    m = json.loads(path.read_text())
    m["format"] = "moepec/99"
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="upgrade moepec"):
        read_view(str(ckpt))
    # a run that resumes elsewhere and commits here must not delete what the newer
    # checkpoint's view needs
    found = committed_manifests(manager._storage)
    before = set(manager._storage.committed())
    m2, model, counter = fresh(ckpt, keep_last=1)
    m2.save(100)
    m2.close()
    assert found.newer_format() is not None
    assert before <= set(manager._storage.committed())


def test_a_manifest_must_name_its_own_folder(tmp_path):
    """A copied checkpoint folder would read another folder's data: it is damaged."""
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=4, keep_last=4)
    names = manager._storage.committed()
    copy = ckpt / "ckpt-000099-step00000099-0123456789ab"
    shutil.copytree(ckpt / names[-1], copy)
    found = committed_manifests(manager._storage)
    assert copy.name in found.damaged and "names checkpoint" in str(found.damaged[copy.name])
    assert set(found.manifests) == set(names)


@pytest.mark.parametrize("change, field", [
    ({"step": "abc"}, "step"), ({"keys": []}, "keys"), ({"full": 1}, "full"),
    ({"name": "../x"}, "name"), ({"counts": None}, "counts")])
def test_a_mistyped_manifest_is_damaged_and_skipped(tmp_path, caplog, change, field):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=6, keep_last=4)
    newest = manager._storage.committed()[-1]
    path = ckpt / newest / "moepec.json"
    m = json.loads(path.read_text())
    m.update(change)
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=repr(field)):
        manager._storage.read_manifest(newest)
    m2, _, _ = fresh(ckpt, keep_last=4)
    assert m2.restore().step == 3  # the older checkpoint serves
    assert newest in caplog.text


def test_a_recovery_over_budget_warns_when_dynamic_k_is_off(tmp_path, caplog):
    ckpt = tmp_path / "c"
    _train(ckpt, steps=8)
    m2, _, _ = fresh(ckpt, dynamic_k=False)
    report = m2.restore()
    assert report.plt > m2.config.plt_budget and m2.k_persist == 1
    assert "over the budget 3.75%, and dynamic K is off" in caplog.text
    assert "dynamic_k=True" in caplog.text


def test_dynamic_k_is_on_by_default_and_raises_k_after_a_recovery_over_budget(tmp_path,
                                                                             caplog):
    ckpt = tmp_path / "c"
    _train(ckpt, steps=8)
    m2, _, _ = fresh(ckpt)
    report = m2.restore()
    assert report.plt > m2.config.plt_budget
    assert m2.k_persist == 2 and "dynamic K is off" not in caplog.text


def test_a_failed_restore_leaves_the_model_as_it_was(tmp_path):
    """All or nothing by default: reading happens into new tensors."""
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=4, keep_last=4)
    key = "experts/0/1/model/moe.0.experts.w1"
    for name in manager._storage.committed():  # every copy of one expert: after the
        if key in manager._storage.read_manifest(name).keys:  # non-expert reads
            _corrupt(ckpt / name, key)
    m2, model, _ = fresh(ckpt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError):
        m2.restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_restore_in_place_gives_the_same_state(tmp_path):
    ckpt = tmp_path / "c"
    _train(ckpt, steps=8, keep_last=4)
    states = []
    for in_place in (False, True):
        m2, model, _ = fresh(ckpt, restore_in_place=in_place)
        m2.restore()
        states.append(full_state(model, m2._catalog.optimizer))
        m2.close()
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_everything_corrupt_is_an_error(tmp_path):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=4, keep_last=4)
    for name in manager._storage.committed():
        _corrupt(ckpt / name, "model/embed.weight")
    m2, _, _ = fresh(ckpt)
    with pytest.raises(CorruptCheckpointError, match="moepec verify"):
        m2.restore()


@pytest.mark.parametrize("change", [{"n_experts": 8}, {"layout": "modules"}])
def test_structure_mismatch_names_differences_and_changes_nothing(tmp_path, change):
    ckpt = tmp_path / "c"
    _train(ckpt, steps=4)
    digest = tree_digest(ckpt)
    m2, model, _ = fresh(ckpt, **change)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StructureMismatchError, match="different model") as err:
        m2.restore()
    assert "moe.0" in str(err.value)
    assert tree_digest(ckpt) == digest
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_manifest_not_json_is_skipped_with_warning(tmp_path, caplog):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=6, keep_last=4)
    names = manager._storage.committed()
    (ckpt / names[-1] / "moepec.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        manager._storage.read_manifest(names[-1])
    m2, _, _ = fresh(ckpt, keep_last=4)
    assert m2.restore().step == 3
    assert "not valid JSON" in caplog.text


def test_unwritable_path_is_a_clear_error(tmp_path):
    """An unwritable root pauses checkpoints to storage with a clear error at each save;
    the snapshot is taken all the same (a restore of committed checkpoints would work)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    manager, model, counter = fresh(blocker / "sub")
    assert manager.restore() is None
    with pytest.raises(PersistError, match="cannot write to checkpoint path"):
        manager.save(0)
    manager.wait_for_snapshot()
    assert manager._ram_tier.newest is not None and manager._ram_tier.newest.step == 0
    manager.close()


@pytest.mark.parametrize("kw,match", [
    ({"selection": "random"}, "unknown selection"),
    ({"pec_scope": "grads"}, "unknown pec_scope"),
    ({"k_persist": 3, "k_snapshot": 2}, "k_snapshot"),
    ({"interval": 0}, "interval"),
])
def test_bad_config_is_rejected(kw, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(path="x", **kw)


def test_k_larger_than_experts_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="experts per MoE layer"):
        fresh(tmp_path / "c", k_persist=5)


def test_manifest_records_what_design_promises(tmp_path):
    manager, _ = _train(tmp_path / "c", steps=4)
    name = manager._storage.committed()[-1]
    m = json.loads((tmp_path / "c" / name / "moepec.json").read_text())  # as stored
    for field in ("step", "keys", "view_file", "k_persist", "selection", "counts", "plt",
                  "structure", "experts_saved", "bytes_per_rank"):
        assert field in m
    assert all(v["checksum"].startswith("xxh3:") for v in m["keys"].values())
    # The view is a file of its own, named by its checksum, which the manifest commits.
    ref = m["view_file"]
    blob = (tmp_path / "c" / name / ref["file"]).read_bytes()
    assert len(blob) == ref["length"] and ref["checksum"] == "xxh3:" + xxhash.xxh3_64_hexdigest(
        blob) and ref["file"] == f"view-{ref['checksum'][5:]}.json"
    view = json.loads(blob)
    assert view and set(view.values()) <= set(manager._storage.committed())
    typed = manager._storage.read_manifest(name)
    assert dict(typed.view) == view
    assert typed.to_json() == m  # the typed form round-trips
    assert json.loads(json.dumps(m)) == m
    assert not os.path.exists(tmp_path / "c" / m["name"] / "moepec.json.tmp")


def test_one_format_a_pre_release_manifest_is_damaged_everywhere(tmp_path, caplog):
    """Issue 23.1: a manifest of any other format is refused in one line and is damaged
    for restore, inspect and verify; a pre-release folder name (no run id) is ignored,
    reported once, never deleted."""
    from moepec.recovery.offline import inspect_path, verify_path

    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=6, keep_last=4)
    names = manager._storage.committed()
    path = ckpt / names[-1] / "moepec.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), format="moepec/4")))
    legacy = ckpt / "ckpt-000099-step00000099"
    shutil.copytree(ckpt / names[0], legacy)
    found = committed_manifests(Storage(str(ckpt)))
    msg = str(found.damaged[names[-1]])
    assert "written by a pre-release moepec (format 'moepec/4'); not readable by this " \
           "version" in msg and "\n" not in msg
    assert legacy.name not in dict(found.listing)
    assert caplog.text.count("written by a pre-release moepec (e.g. ckpt-000099") == 1
    fresh_mgr, _, _ = fresh(ckpt)
    assert fresh_mgr.restore().checkpoint == names[-2]  # restore skips it
    fresh_mgr.close()
    res = verify_path(str(ckpt))
    assert not res.ok and any("pre-release" in d for d in res.damaged_manifests)
    report = json.dumps(inspect_path(str(ckpt)), default=str)
    assert "pre-release moepec (format 'moepec/4')" in report
    assert legacy.exists()  # retention never touched it


def test_a_failed_fsync_of_the_data_commits_nothing_though_its_view_was_written(
        tmp_path, monkeypatch):
    """While the data file is synced, a one-rank persist writes the view file (named by
    its checksum: no commit) and makes the manifest; when that fsync fails, no manifest
    is created, the error surfaces once naming what is intact, and a new run restores
    the last committed checkpoint."""
    ckpt = tmp_path / "c"
    model, opt, sched = make(seed=3, layout="stacked", n_experts=4)
    counter = Counter()
    manager = CheckpointManager(model, opt, CheckpointConfig(
        path=str(ckpt), interval=2, keep_last=2, k_persist=1),
        extra_state={"sched": sched, "data": counter})
    gen = torch.Generator().manual_seed(0)
    run_loop(manager, model, opt, sched, counter, gen, 0, 4)  # commits steps 1 and 3
    manager.wait_for_persist()
    committed = [n for n, c in Storage(str(ckpt)).list_checkpoints() if c]
    assert len(committed) == 2
    real_fsync, failed = os.fsync, []

    def data_fsync_fails(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            failed.append(fd)
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", data_fsync_fails)
    views = []
    write_side = Storage.write_side
    monkeypatch.setattr(Storage, "write_side",
                        lambda self, *a: views.append(write_side(self, *a)) or views[-1])
    run_loop(manager, model, opt, sched, counter, gen, 4, 2)  # the save of step 5
    manager.wait_for_persist()
    monkeypatch.undo()
    with pytest.raises(PersistError, match="last committed checkpoint is intact"):
        manager.wait_for_snapshot()  # the failure surfaces on the next call that checks
    # the view was written before the data's fsync failed
    assert failed and any(ref.file.startswith("view-") for ref in views)
    listing = Storage(str(ckpt)).list_checkpoints()
    assert [n for n, c in listing if c] == committed
    manager.close()
    again, _, counter = fresh(ckpt)
    assert again.restore().step == 3 and counter.position == 4
    again.close()


def test_retention_after_a_restore_reads_no_manifest_the_restore_read(tmp_path, monkeypatch):
    """The manifests a restore read are the persister's known ones (a committed manifest
    never changes): the next save's retention reads none of them, nor the one it
    committed itself."""
    import moepec.store.persist as persist

    ckpt = tmp_path / "c"
    _train(ckpt, steps=8, keep_last=2)
    manager, model, _ = fresh(ckpt, keep_last=2, async_persist=False)
    before = set(manager._storage.committed())
    read: list[str] = []
    real = Storage.read_manifest
    monkeypatch.setattr(Storage, "read_manifest",
                        lambda self, name: read.append(name) or real(self, name))
    retained: list[set[str]] = []
    real_committed = persist.committed_manifests
    monkeypatch.setattr(persist, "committed_manifests", lambda st, known=None: (
        retained.append(set(known or ())) or real_committed(st, known)))
    manager.restore()
    assert sorted(read) == sorted(before)
    read.clear()
    manager.save(100)
    manager.close()
    assert len(retained) == 1 and retained[0] >= before  # retention ran, knowing them
    assert read == []
