"""Format moepec/6: a manifest lists its expert items; its non-expert items (the state
every checkpoint repeats) are in a file of their own, committed by the manifest (length
and checksum), read only when the checkpoint is a restore's base or a tool needs every
item. moepec/5 checkpoints (every item in the manifest) still restore, bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import xxhash

from moepec import CheckpointConfig, CheckpointManager
from moepec.recovery.offline import inspect_path, verify_path
from moepec.store.manifest import FORMAT
from moepec.store.storage import Storage
from tests import manifest_docs
from tests.test_trust import _falls_back, _fresh, _train
from tests.toy import Counter, full_state, make, run_loop


def _restore(root):
    """(report, full state) of a fresh one-process restore of ``root``."""
    mgr, model, opt = _fresh(root)
    report = mgr.restore()
    mgr.close()
    return report, full_state(model, opt)


def _items_file(root, name):
    return root / name / json.loads((root / name / "moepec.json").read_text())[
        "items_file"]["file"]


def test_the_items_are_split_and_the_manifest_round_trips(tmp_path):
    root = tmp_path / "c"
    _train(root, steps=4)
    st = Storage(str(root))
    name = st.committed()[-1]
    stored = json.loads((root / name / "moepec.json").read_text())
    assert stored["format"] == FORMAT == "moepec/6"
    assert stored["keys"] and all(k.startswith("experts/") for k in stored["keys"])
    ref = stored["items_file"]
    blob = (root / name / ref["file"]).read_bytes()
    assert len(blob) == ref["length"] and ref["checksum"] == "xxh3:" + \
        xxhash.xxh3_64_hexdigest(blob) and ref["file"] == f"items-{ref['checksum'][5:]}.json"
    shared = json.loads(blob)
    assert shared and not any(k.startswith("experts/") for k in shared)
    assert any(k.startswith("objects/") for k in shared)
    typed = st.read_manifest(name)
    assert typed.to_json() == stored  # the typed form round-trips
    assert set(typed.keys) == set(stored["keys"]) | set(shared)
    assert sum(typed.keys[k].nbytes for k in typed.keys) == stored["bytes"]


def test_a_restore_reads_the_items_file_of_its_base_alone(tmp_path, monkeypatch):
    """An older checkpoint the restore takes experts from is read without its non-expert
    items: restore succeeds with that file gone (verify reports it missing)."""
    root = tmp_path / "c"
    _train(root)  # steps 1, 3, 5, 7: the newest view takes experts from all four
    pristine = tmp_path / "pristine"
    shutil.copytree(root, pristine)
    names = Storage(str(root)).committed()
    read = []
    real = Storage._read_side
    monkeypatch.setattr(Storage, "_read_side",
                        lambda self, name, ref: read.append((name, ref.file)) or
                        real(self, name, ref))
    report, state = _restore(root)
    assert {n for n, _ in read} == {names[-1]}  # the base's view and items, nothing else
    assert len({s["checkpoint"] for s in report.sources.values()}) > 1
    monkeypatch.undo()
    for name in names[:-1]:
        _items_file(root, name).unlink()
    again, state2 = _restore(root)
    assert again.checkpoint == report.checkpoint == names[-1]
    assert again.sources == report.sources
    assert state2.keys() == state.keys() and all(torch.equal(state2[k], state[k])
                                                  for k in state)
    res = verify_path(str(root))
    assert not res.ok and len(res.damaged_manifests) == len(names) - 1
    assert all("items" in d and "cannot be read" in d for d in res.damaged_manifests)
    assert inspect_path(str(root))["head"] == names[-1]
    assert verify_path(str(pristine)).ok


def test_a_damaged_or_swapped_items_file_of_the_base_sends_restore_to_an_older_base(
        tmp_path, caplog):
    pristine = tmp_path / "pristine"
    _, saved = _train(pristine)
    names = Storage(str(pristine)).committed()
    newest = names[-1]

    def flip(path):
        data = json.loads(path.read_bytes())
        key = next(k for k in sorted(data) if k.startswith("model/"))
        data[key]["offset"] += 4  # plausible JSON, not what the manifest commits
        path.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")))

    def swap(path):  # an older checkpoint's items file under the newest's name
        shutil.copyfile(_items_file(root, names[-2]), path)

    for i, (damage, warning) in enumerate([
            (flip, "does not match the length and checksum"),
            (swap, "does not match the length and checksum"),
            (lambda path: path.unlink(), "cannot be read")]):
        root = tmp_path / f"c{i}"
        shutil.copytree(pristine, root)
        damage(_items_file(root, newest))
        caplog.clear()
        _falls_back(root, saved, newest, caplog, warning)
        res = verify_path(str(root))
        assert not res.ok and any(newest in d and "items" in d for d in res.damaged_manifests)


def test_a_moepec_5_root_restores_bit_exact_and_continues_in_moepec_6(tmp_path):
    """A root of moepec/5 checkpoints (every item in the manifest, as moepec/5 wrote them)
    restores the same state, bit for bit, as the moepec/6 root it was made from; verify
    passes; a run continues it, writing moepec/6 on top, and restores again."""
    root = tmp_path / "c"
    _train(root)
    names = Storage(str(root)).committed()
    expect, state = _restore(root)
    for name in names:
        manifest_docs.downgrade(root / name)
    assert all(json.loads((root / n / "moepec.json").read_text())["format"] == "moepec/5"
               for n in names)
    report, old = _restore(root)
    assert (report.checkpoint, report.sources) == (expect.checkpoint, expect.sources)
    assert old.keys() == state.keys() and all(torch.equal(old[k], state[k]) for k in state)
    assert verify_path(str(root)).ok
    model, opt, sched = make(5, "stacked", 4)  # the run continues: moepec/6 on top
    counter = Counter()
    mgr = CheckpointManager(model, opt, CheckpointConfig(
        path=str(root), interval=2, k_persist=1, keep_last=8, async_persist=False,
        dynamic_k=False),
        extra_state={"sched": sched, "data": counter})
    assert mgr.restore().step == 7
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(2), 8, 4)
    mgr.close()
    names = Storage(str(root)).committed()
    formats = [json.loads((root / n / "moepec.json").read_text())["format"] for n in names]
    assert formats == ["moepec/5"] * 4 + ["moepec/6"] * 2
    report, now = _restore(root)
    assert report.step == 11 and {s["checkpoint"] for s in report.sources.values()} & set(
        names[:4])  # a stitch over both formats
    assert all(torch.equal(now[k], v) for k, v in full_state(model, opt).items()
               if ".experts." not in k)
    assert verify_path(str(root)).ok


def test_parse_json_gives_what_json_loads_gives(monkeypatch):
    """The manifests' parser (orjson, the standard library for what orjson refuses) reads
    every value json.loads reads, type for type; what is not JSON is a ValueError, deep
    nesting included (never a RecursionError); an integer beyond 64 bits is a float,
    which a count check refuses."""
    import moepec.store.items as items

    assert items.orjson is not None  # a dependency: the fast path is the one tested
    same = [b'{"a":1,"a":2,"b":[1,-0,2.5,1e-7,123456789012345678],"c":"\\u00e9\\n"}',
            b'[1e400,-1e400]', b'[NaN,Infinity]', b'["\\ud800"]', '{"x":[true,null]}',
            '{"u": 1}'.encode("utf-16"), b'{"k":{"n":[[0,1],[2,3]]}}', b'1.0', b'[]']
    for raw in same:
        expected = json.loads(raw)
        got = items.parse_json(raw)
        assert repr(got) == repr(expected), raw  # (nan != nan: compared by repr)
    for bad in (b"", b"{", b'{"a":1,}', b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(ValueError):
            items.parse_json(bad)
    assert type(items.parse_json(b"[18446744073709551616]")[0]) is float
    assert not items.is_count(items.parse_json(b"[18446744073709551616]")[0])
    monkeypatch.setattr(items, "orjson", None)  # without orjson: the standard library
    assert items.parse_json(same[0]) == json.loads(same[0])
    with pytest.raises(ValueError):
        items.parse_json(b"[" * 100_000 + b"]" * 100_000)


def test_a_manifest_with_a_huge_count_is_damaged_not_a_traceback(tmp_path):
    """A stranger's manifest whose step is an integer beyond 64 bits is listed as damaged
    (orjson reads it as a float, which the count check refuses), not a traceback, and the
    checkpoint before it stays usable."""
    ckpt = tmp_path / "c"
    _train(ckpt, 4)
    st = Storage(str(ckpt))
    names = st.committed()
    path = ckpt / names[-1] / "moepec.json"
    data = json.loads(path.read_text())
    data["step"] = 2**70
    path.write_text(json.dumps(data))
    from moepec.store.committed import committed_manifests

    found = committed_manifests(st)
    assert names[-1] in found.damaged and names[-2] in found.manifests
