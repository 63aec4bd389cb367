"""Every tool reads every checkpoint: ``moepec inspect``, ``verify`` and ``export`` on a
flat save directory (Megatron-Core's, written here with moepec.store.flat directly, no
Megatron), on the folder of a replica-group run's ``group-<I>`` roots, and on a folder
with nothing committed yet (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from moepec.cli.main import main
from moepec.errors import CorruptCheckpointError
from moepec.recovery.offline_flat import (
    assemble,
    export_flat,
    inspect_flat,
    parse_shard_key,
    read_flat_view,
)
from moepec.state.objects import decode_object, encode_object
from moepec.store.flat import FlatManifest, commit, read_keys, read_records, scan, write_rank
from moepec.store.storage import single_process_dcp

LAYER = "decoder.layers.0.mlp.experts"
UNIT_LAYER = f"{LAYER}@()"
FC1 = f"{LAYER}.experts.linear_fc1.weight"
N = 4


def _global(version: int) -> dict[str, torch.Tensor]:
    """The whole tensors of one save (``version`` makes each save's values differ)."""
    g = torch.Generator().manual_seed(version)
    return {"dense.weight": torch.randn(4, 6, generator=g),
            FC1: torch.randn(N, 3, 2, generator=g),
            "exp_avg": torch.randn(2, 6, generator=g),
            "step": torch.tensor(version, dtype=torch.int64)}


def _rank_shards(version: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shards of a TP 2 / EP 2 layout: dense rows split, two experts each
    (one shard per expert, the expert axis prepended), the optimizer state as flattened
    ranges, two overlapping shards (which do not tile), an object."""
    t = _global(version)
    out = {f"dense.weight#{2 * rank},0+2,6": t["dense.weight"][2 * rank:2 * rank + 2].clone(),
           f"exp_avg#0,0+2,6~{6 * rank}:{6 * rank + 6}":
               t["exp_avg"].flatten()[6 * rank:6 * rank + 6].clone(),
           f"odd#{2 * rank}+3": torch.full((3,), float(version + rank)),
           f"object:rng/shard_0_{rank}": encode_object({"seed": version, "rank": rank}, "rng")}
    for e in (2 * rank, 2 * rank + 1):
        out[f"{FC1}#{e},0,0+1,3,2"] = t[FC1][e].clone()
    if rank == 0:
        out["step#+"] = t["step"].clone()
    return out


def _unit(key: str) -> tuple[str, int] | None:
    return (UNIT_LAYER, int(key.split("#")[1].split(",")[0])) if key.startswith(FC1) else None


def _save(root: Path, name: str, seq: int, parent: FlatManifest | None, version: int,
          experts: set[int]) -> FlatManifest:
    """One committed folder of two ranks: every non-expert key, the ``experts`` given."""
    folder = root / name
    folder.mkdir()
    for rank in (0, 1):
        write_rank(str(folder), {k: v for k, v in _rank_shards(version, rank).items()
                                 if _unit(k) is None or _unit(k)[1] in experts}, rank)
    items = read_records(str(folder), 2)
    keys = [k for r in (0, 1) for k in _rank_shards(version, r)]
    view = {k: name if k in items else parent.view[k] for k in keys}
    m = FlatManifest(name=name, seq=seq, step=10 * (seq + 1),
                     parent=parent.name if parent else None, items=items, view=view,
                     experts={k: _unit(k) for k in keys if _unit(k)},
                     experts_saved=[(UNIT_LAYER, e) for e in sorted(experts)], k_persist=1,
                     world_size=2)
    commit(str(root), m)
    return m


@pytest.fixture
def flat_root(tmp_path: Path) -> Path:
    """iter_0000010 (every expert), iter_0000020 (expert 1 only), iter_0000030 killed."""
    root = tmp_path / "save"
    root.mkdir()
    first = _save(root, "iter_0000010", 0, None, 1, set(range(N)))
    _save(root, "iter_0000020", 1, first, 2, {1})
    (root / "iter_0000030" / "moepec-r0").mkdir(parents=True)
    return root


def _expected() -> dict[str, torch.Tensor]:
    """The stitched state of iter_0000020, built from the whole tensors."""
    new, old = _global(2), _global(1)
    fc1 = old[FC1].clone()
    fc1[1] = new[FC1][1]
    out = {"dense.weight": new["dense.weight"], FC1: fc1, "step": new["step"]}
    for rank in (0, 1):
        shards = _rank_shards(2, rank)
        out.update({k: v for k, v in shards.items() if "~" in k or k.startswith(("odd", "obj"))})
    return out


def test_shard_keys_parse():
    assert parse_shard_key("a.b#0,4+2,3") .offsets == (0, 4)
    assert parse_shard_key("a#6+6~0:3").flattened == (0, 3)
    assert parse_shard_key("s#+").shape == ()
    assert parse_shard_key("object:x#0+1") is None and parse_shard_key("plain") is None


def test_inspect_a_flat_save_directory(flat_root: Path, capsys):
    info = inspect_flat(str(flat_root))
    rows = {r.name: r for r in info["checkpoints"]}
    assert [r.committed for r in rows.values()] == [True, True, False]
    assert info["head"] == "iter_0000020" and info["layers"] == [UNIT_LAYER]
    assert rows["iter_0000010"].full and rows["iter_0000010"].experts_saved == [[0, 1, 2, 3]]
    assert rows["iter_0000020"].experts_saved == [[1]] and not rows["iter_0000020"].full
    m = scan(str(flat_root)).manifests["iter_0000020"]
    per_rank = [sum(i.nbytes for i in m.items.values() if i.rank == r) for r in (0, 1)]
    assert rows["iter_0000020"].bytes_per_rank == per_rank and all(per_rank)
    assert info["view_age"] == [[10, 0, 10, 10]]
    assert info["needs"]["iter_0000020"] == ["iter_0000010"]
    assert main(["inspect", str(flat_root)]) == 0
    out = capsys.readouterr().out
    assert "bytes per rank" in out and "iter_0000030" in out and "uncommitted" in out
    assert f"layer 0: {UNIT_LAYER}" in out and "iter_0000020 needs iter_0000010" in out
    assert main(["inspect", str(flat_root), "--json"]) == 0
    assert '"experts_saved"' in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_export_a_flat_save_directory_equals_the_stitched_read(flat_root: Path, tmp_path,
                                                               capsys, fmt):
    out = tmp_path / ("w.safetensors" if fmt == "safetensors" else "w_dcp")
    assert main(["export", str(flat_root), str(out), "--format", fmt]) == 0
    assert "of iter_0000020 (step 20)" in capsys.readouterr().out
    want = _expected()
    if fmt == "safetensors":
        got = load_file(str(out))
    else:
        got = {k: torch.empty_like(v) for k, v in want.items()}
        with single_process_dcp():
            dcp.load(got, checkpoint_id=str(out), no_dist=True)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # the stitched read (each key from the folder its view names) assembles to the same
    found = scan(str(flat_root))
    head = found.manifests["iter_0000020"]
    targets = {k: torch.empty(found.manifests[s].items[k].shape,
                              dtype=getattr(torch, found.manifests[s].items[k].dtype))
               for k, s in head.view.items()}
    assert read_keys(str(flat_root), found.manifests, head.view, targets) == []
    assert all(torch.equal(v, got[k]) for k, v in assemble(targets).items())
    assert decode_object(got["object:rng/shard_0_1"], "x") == {"seed": 2, "rank": 1}
    assert torch.equal(read_flat_view(str(flat_root)).values["step#+"], want["step"])


def test_export_refuses_a_damaged_flat_view_in_one_line(flat_root: Path, tmp_path, capsys):
    item = scan(str(flat_root)).manifests["iter_0000010"].items[f"{FC1}#2,0,0+1,3,2"]
    data = flat_root / "iter_0000010" / "moepec-r1" / item.file  # expert 2: still in the view
    raw = bytearray(data.read_bytes())
    raw[item.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="iter_0000010"):
        export_flat(str(flat_root), str(tmp_path / "x.safetensors"), "safetensors")
    assert main(["export", str(flat_root), str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moepec verify" in err
    assert main(["verify", str(flat_root)]) == 1


def test_the_folder_of_group_roots(tmp_path: Path, capsys):
    from moepec.recovery.offline_groups import inspect_groups
    from tests.test_striped import INTERVAL, _lockstep

    _lockstep(tmp_path, 2 * INTERVAL)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    ok = next(line for line in out.splitlines() if line.startswith("OK: "))
    assert int(ok.split()[1]) > 0, out
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== group-0" in out and "== group-1" in out
    assert f"newest whole striped checkpoint: step {2 * INTERVAL - 1}" in out
    whole = inspect_groups(str(tmp_path))["whole"]
    assert whole.missing is None and whole.parts[1].startswith("group-1/ckpt-")
    assert whole.view_age and min(min(row) for row in whole.view_age) == 0
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert '"group-1"' in capsys.readouterr().out
    # one bad item in group-1: verify names it
    folder = sorted(p for p in (tmp_path / "group-1").iterdir() if p.name.startswith("ckpt-"))[-1]
    data = max(folder.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path)]) == 1
    assert "BAD item (checksum or read failed): group-1/" in capsys.readouterr().out


def _no_checkpoint(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    assert "FAILED" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moepec: error: ") and match in err[0], err


def test_nothing_committed_yet_says_so_and_exits_2(tmp_path: Path, capsys):
    empty, flat, manager, groups = (tmp_path / n for n in ("empty", "flat", "mgr", "groups"))
    empty.mkdir()
    (flat / "iter_0000010" / "moepec-r0").mkdir(parents=True)
    (manager / "ckpt-000001-step00000004-abc123").mkdir(parents=True)
    (groups / "group-0").mkdir(parents=True)
    (groups / "group-1").mkdir()
    for tool in (["inspect"], ["verify"], ["export"]):
        out = [str(tmp_path / "out.safetensors")] if tool == ["export"] else []
        for path in (empty, flat, manager, groups):
            _no_checkpoint(capsys, [*tool, str(path), *out],
                           f"no committed checkpoint in {path} yet")
        _no_checkpoint(capsys, [*tool, str(tmp_path / "nope"), *out],
                       f"{tmp_path / 'nope'} does not exist")
    _no_checkpoint(capsys, ["verify", str(flat)], "1 uncommitted: iter_0000010")
    _no_checkpoint(capsys, ["inspect", str(manager)], "ckpt-000001-step00000004-abc123")
