"""Flat checkpoints (moepec.store.flat, moepec.recovery.flat_view) without any framework:
the view, the commit rule and the trust rules of the format the Megatron
backend writes."""

from __future__ import annotations

import json

import pytest
import torch

from moepec.errors import CheckpointError, ManifestError
from moepec.recovery.flat_view import (
    keys_to_write,
    next_view,
    verify_root,
)
from moepec.store.flat import (
    FlatManifest,
    commit,
    is_flat_root,
    read_keys,
    read_manifest,
    read_records,
    scan,
    write_rank,
)


def test_keys_to_write_and_the_view():
    units = {"dense": None, "e0": ("l", 0), "e1": ("l", 1), "new": ("l", 1)}
    assert keys_to_write(units, None, set()) == list(units)  # first save: everything
    parent = {"dense": "s0", "e0": "s0", "e1": "s0"}
    assert keys_to_write(units, parent, {("l", 0)}) == ["dense", "e0", "new"]
    view = next_view(parent, "s1", units, ["dense", "e0", "new"])
    assert view == {"dense": "s1", "e0": "s1", "e1": "s0", "new": "s1"}
    with pytest.raises(ValueError):
        next_view(parent, "s1", [*units, "lost"], ["dense"])


def _save(root, name, seq, parent, tensors, view, experts):
    folder = root / name
    folder.mkdir()
    write_rank(str(folder), tensors, 0)
    items = read_records(str(folder), 1)
    m = FlatManifest(name=name, seq=seq, step=seq * 10, parent=parent, items=items,
                     view=view, experts=experts, experts_saved=[], k_persist=1,
                     world_size=1)
    commit(str(root), m)
    return m


def test_commit_stitch_verify_and_trust(tmp_path):
    a, b = torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.int64)
    experts = {"e": ("l", 0)}
    m0 = _save(tmp_path, "iter_0000000", 0, None, {"d": a, "e": b},
               {"d": "iter_0000000", "e": "iter_0000000"}, experts)
    with pytest.raises(CheckpointError, match="never overwrites"):
        commit(str(tmp_path), m0)
    m1 = _save(tmp_path, "iter_0000010", 1, "iter_0000000", {"d": a + 1},
               {"d": "iter_0000010", "e": "iter_0000000"}, experts)
    (tmp_path / "iter_0000020" / "moepec-r0").mkdir(parents=True)  # a killed save
    other = tmp_path / "plain-root" / "ckpt-000001-step00000001-abc"
    other.mkdir(parents=True)
    (other / "moepec.json").write_text("{}")  # a CheckpointManager root is not flat
    assert is_flat_root(str(tmp_path)) and not is_flat_root(str(tmp_path / "plain-root"))
    found = scan(str(tmp_path))
    assert list(found.manifests) == ["iter_0000000", "iter_0000010"]
    assert found.uncommitted == ["iter_0000020"] and found.head.name == "iter_0000010"
    targets = {"d": torch.empty(2, 3), "e": torch.empty(4, dtype=torch.int64)}
    assert read_keys(str(tmp_path), found.manifests, m1.view, targets) == []
    assert torch.equal(targets["d"], a + 1) and torch.equal(targets["e"], b)
    res = verify_root(str(tmp_path))
    assert res.ok and res.needs["iter_0000010"] == ["iter_0000000"], res.lines()
    # one flipped byte: its checksum fails, and the view that needs it cannot be loaded
    data = next((tmp_path / "iter_0000000" / "moepec-r0").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    res = verify_root(str(tmp_path))
    assert not res.ok and res.bad == ["iter_0000000:e"]
    assert any(b.startswith("iter_0000010:") for b in res.broken)


@pytest.mark.parametrize("field,value,match", [
    ("view", {"d": "../outside"}, "plain folder name"),
    ("format", "moepec-flat/1", "format"),
    ("format", "moepec/99", "upgrade moepec"),
    ("kind", "manager", "CheckpointManager's manifest"),
    ("schedule", {"index": 0, "k_persist": 1, "k_snapshot": 1, "counts": [[1, 2]],
                  "ledger": {}, "selectors": {}, "k_history": []}, "schedule"),
    ("items", {"d": {"shape": [2], "dtype": "float32", "nbytes": 8, "rank": 0,
                     "file": "../x", "offset": 0, "length": 8}}, "file"),
])
def test_a_bad_manifest_is_refused_in_one_line(tmp_path, field, value, match):
    m = _save(tmp_path, "iter_0000000", 0, None, {"d": torch.zeros(2)},
              {"d": "iter_0000000"}, {})
    data = m.to_json()
    data[field] = value
    path = tmp_path / "iter_0000000" / "moepec.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=match):
        read_manifest(str(tmp_path), "iter_0000000")
    assert "iter_0000000" in scan(str(tmp_path)).damaged


def test_one_format_for_both_front_ends(tmp_path):
    """A flat manifest is of the manager's format with kind "flat"; each reader refuses
    the other's in one line; a folder committed as moepec-flat/2 is still read."""
    from moepec.store.manifest import FORMAT, Manifest

    m = _save(tmp_path, "iter_0000000", 0, None, {"d": torch.zeros(2)},
              {"d": "iter_0000000"}, {})
    data = m.to_json()
    assert (data["format"], data["kind"]) == (FORMAT, "flat")
    with pytest.raises(ManifestError, match="flat folder's manifest"):
        Manifest.from_json(data, "x", read_side=lambda ref: b"")
    # the schedule's fields pass the manager's own bookkeeping check
    data |= {"layers": ["l"], "schedule": {
        "index": 0, "k_persist": 1, "k_snapshot": 1, "counts": [[1, 2]], "ledger": {},
        "selectors": {"persist": {}, "ram": {}}, "k_history": []}}
    with pytest.raises(ManifestError, match="bookkeeping"):
        FlatManifest.from_json(data, "x")
    data |= {"layers": [], "schedule": None, "format": "moepec-flat/2"}
    del data["kind"]
    (tmp_path / "iter_0000000" / "moepec.json").write_text(json.dumps(data))
    assert read_manifest(str(tmp_path), "iter_0000000").items.keys() == {"d"}


@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")  # (stock DCP's)
def test_a_ranks_folder_is_the_dcp_checkpoint_dcp_save_writes_and_loads_bit_for_bit(
        tmp_path):
    """write_rank writes the data file itself and DCP's .metadata from its items (no
    dcp.save plans): the tensors and every item's location are those a one-process
    dcp.save with DCP's default planner and the raw writer records, every key is a
    whole tensor of its name (a '#' in a flat key is no chunk), and dcp.load reads the
    folder back bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from moepec.store.dcp_raw import RawFileSystemReader, RawFileSystemWriter
    from moepec.store.flat import rank_dir, write_rank

    g = torch.Generator().manual_seed(5)
    tensors = {"module.w": torch.randn(4, 3, generator=g),
               "odd#name": torch.arange(6, dtype=torch.int32),
               "optimizer.step": torch.tensor(7, dtype=torch.int64),
               "half": torch.randn(5, generator=g).to(torch.bfloat16)}
    write_rank(str(tmp_path / "c"), tensors, 1)
    sub = tmp_path / "c" / rank_dir(1)
    dcp.save(dict(tensors), planner=DefaultSavePlanner(), no_dist=True,
             storage_writer=RawFileSystemWriter(str(tmp_path / "dcp")))
    ours, theirs = (FileSystemReader(str(p)).read_metadata() for p in (sub, tmp_path / "dcp"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    back = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(back, storage_reader=RawFileSystemReader(str(sub)), no_dist=True)
    assert all(torch.equal(back[k].view(torch.uint8), tensors[k].view(torch.uint8))
               for k in tensors if tensors[k].dim())
    assert torch.equal(back["optimizer.step"], tensors["optimizer.step"])
