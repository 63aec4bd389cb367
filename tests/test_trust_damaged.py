"""Damaged checkpoints from strangers, found by a security review: each tool either works
(skipping what is advisory) or fails with a one-line MoepecError naming the file; nothing
allocates more than the checkpoint holds, nothing is read through a link out of the
folder given, and the command line never prints a C++ stack."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from moepec.cli import main as cli
from moepec.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from moepec.recovery.offline import consolidate, export_view, read_view
from moepec.recovery.offline_flat import export_flat, parse_shard_key
from moepec.recovery.offline_paths import group_roots
from moepec.recovery.records import lost_since, read_recoveries
from moepec.store.flat import FlatManifest, commit, read_records, write_rank
from moepec.store.lease import LEASE_NAME, Holder, pid_alive
from moepec.store.storage import Storage
from tests.test_trust import _fresh, _train


def _newest(root: Path) -> Path:
    return sorted(root.glob("ckpt-*"))[-1] / "moepec.json"


def _edit(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _error_line(err: str) -> str:
    """The one ``moepec: error`` line of stderr (log lines may precede it); no stack."""
    lines = [line for line in err.splitlines() if line.startswith("moepec: error")]
    assert len(lines) == 1, err
    assert "frame #" not in err and "Traceback" not in err, err
    return lines[0]


# -- B4: export sizes nothing from the manifest's structure alone -----------------------
def test_export_refuses_a_structure_larger_than_its_expert_items(tmp_path):
    root = tmp_path / "c"
    _train(root, steps=4)

    def grow(d):  # a stacked expert weight of 100000 experts; the layer has 4
        for p in d["structure"]["params"]:
            if p[0] == "moe.0.experts.w1":
                p[1] = [100_000, 8, 16]

    _edit(_newest(root), grow)
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match="structure"):
        export_view(str(root), str(out), "safetensors")
    assert not out.exists()


def test_consolidate_refuses_a_chunk_whose_global_shape_its_chunks_do_not_fill(tmp_path):
    root = tmp_path / "c"
    _train(root, steps=4)
    view = read_view(str(root))
    values = dict(view.values)
    key = next(k for k, v in values.items() if k.startswith("model/") and v.dim() == 2)
    value = values.pop(key)
    rows, cols = value.shape
    values[f"{key}#0,0+{rows},{cols}:4096,4096"] = value  # one 8x8 block of a 64 MB tensor
    with pytest.raises(ValueError, match="4096"):
        consolidate(view.manifest, values)
    # the chunks of a tensor that do fill it still put it together
    values.pop(f"{key}#0,0+{rows},{cols}:4096,4096")
    values[f"{key}#0,0+1,{cols}:{rows},{cols}"] = value[:1]
    values[f"{key}#1,0+{rows - 1},{cols}:{rows},{cols}"] = value[1:]
    whole = consolidate(view.manifest, values)
    assert torch.equal(whole[key.replace("/", ".")], value)


# -- C12: flat shard keys beyond int64 ---------------------------------------------------
def _flat(root: Path, tensors: dict[str, torch.Tensor], name: str = "iter_0000010") -> None:
    folder = root / name
    folder.mkdir(parents=True)
    write_rank(str(folder), tensors, 0)
    commit(str(root), FlatManifest(name=name, seq=0, step=10, parent=None,
                                   items=read_records(str(folder), 1),
                                   view={k: name for k in tensors}, experts={},
                                   experts_saved=[], k_persist=1, world_size=1, layers=[]))


def test_a_flat_shard_offset_beyond_int64_is_a_clear_error(tmp_path, capsys):
    root = tmp_path / "save"
    _flat(root, {f"w#0,{10**30}+0,1": torch.empty(0, 1), "ok#0+2": torch.ones(2)})
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptCheckpointError, match="iter_0000010"):
        export_flat(str(root), str(out), "safetensors")
    capsys.readouterr()
    assert cli.main(["export", str(root), str(out)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert str(root) in line and "please report" not in line
    with pytest.raises(CorruptCheckpointError):
        parse_shard_key(f"w#{2**63}+1")


def test_empty_flat_shards_far_outside_the_tensor_allocate_nothing(tmp_path):
    root = tmp_path / "save"
    big = 2**62
    _flat(root, {f"w#0,{big},{big}+0,1,1": torch.empty(0, 1, 1), "ok#0+2": torch.ones(2),
                 "v#0,0+2,2": torch.ones(2, 2), f"v#0,{big}+0,2": torch.empty(0, 2)})
    out = tmp_path / "out.safetensors"
    report = export_flat(str(root), str(out), "safetensors")  # no stride overflow
    assert (report.whole, report.shards) == (1, 3)  # ok whole; w and v as stored


# -- D14: a group-<I> link out of the folder given is not a group ----------------------
def test_a_symlinked_group_root_is_neither_listed_nor_read(tmp_path, capsys):
    outside = tmp_path / "outside"
    _train(outside, steps=4)
    given = tmp_path / "given"
    given.mkdir()
    os.symlink(outside, given / "group-0")
    assert group_roots(Storage(str(given))) == []
    with pytest.raises(NoCheckpointError):
        read_view(str(given))
    capsys.readouterr()
    assert cli.main(["inspect", str(given)]) == 2
    captured = capsys.readouterr()
    assert "ckpt-" not in captured.out and "group-0" not in captured.out
    assert "no committed checkpoint" in _error_line(captured.err)


# -- C9: recovery records are advisory ---------------------------------------------------
BAD_RECORDS = ['{"next_seq": 99, "base_seq": 0}', "[1, 2]", '{"time": "x"}',
               '{"time": 1}', '{"time": 1, "base_seq": 0, "next_seq": 99, "step": 1, '
               '"checkpoint": "c", "tier": "storage", "lost": [[1e400]], "plt": 0.0, '
               '"seconds": 0.1, "k_persist": 1, "warnings": []}']


def test_bad_recovery_records_are_skipped_by_restore_and_inspect(tmp_path, capsys, caplog):
    root, clean = tmp_path / "c", tmp_path / "clean"
    _train(root, steps=4)
    shutil.copytree(root, clean)
    (root / "recoveries").mkdir()
    for i, record in enumerate(BAD_RECORDS):
        (root / "recoveries" / f"rec-000099-{i}.json").write_text(record)
    reports = []
    for path in (clean, root):
        mgr, _, _ = _fresh(path)
        try:
            with caplog.at_level(logging.WARNING, logger="moepec"):
                reports.append(mgr.restore())
        finally:
            mgr.close()
    report = reports[1]
    assert report is not None and report.step == 3
    assert (report.lost, report.plt) == (reports[0].lost, reports[0].plt)  # none counted
    assert sum("recovery record" in r.getMessage() for r in caplog.records) >= len(BAD_RECORDS)
    records = read_recoveries(Storage(str(root)))
    assert [r["step"] for r in records] == [3]  # the one this restore wrote
    assert lost_since(records, 0, [4, 4]) == [[0] * 4, [0] * 4]
    capsys.readouterr()
    assert cli.main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "1 recovery(ies)" in out and "step       3 from ckpt-" in out


# -- C10: a lease whose pid is no pid is a damaged lease ---------------------------------
@pytest.mark.parametrize("pid", ["Infinity", "1e300", str(2**70), "-5"])
def test_a_lease_with_an_impossible_pid_is_taken_over(tmp_path, pid, caplog):
    raw = (f'{{"run_id": "abc", "host": "{socket.gethostname()}", "pid": {pid}, '
           f'"heartbeat": {time.time()}}}').encode()  # pid as written, not JSON-encoded
    assert Holder.parse(raw) is None
    root = tmp_path / "c"
    _train(root, steps=4)
    (root / LEASE_NAME).write_bytes(raw)
    mgr, _, _ = _fresh(root)
    try:
        with caplog.at_level(logging.WARNING, logger="moepec"):
            report = mgr.restore()
    finally:
        mgr.close()
    assert report is not None and report.step == 3
    assert any("unreadable lease" in r.getMessage() for r in caplog.records)


def test_pid_alive_is_false_for_a_pid_no_process_has():
    assert not pid_alive(2**70) and not pid_alive(2**31) and not pid_alive(0)
    assert pid_alive(os.getpid())


def test_a_heartbeat_file_with_a_huge_number_is_no_heartbeat(tmp_path):
    root = tmp_path / "c"
    _train(root, steps=4)
    raw = json.dumps({"run_id": "abc", "host": "elsewhere", "pid": 7,
                      "heartbeat": time.time() - 3600}).encode()
    (root / LEASE_NAME).write_bytes(raw)
    (root / f"{LEASE_NAME}.abc").write_text("1" + "0" * 400)  # float() of it overflows
    mgr, _, _ = _fresh(root, lease_timeout_s=60.0)
    try:
        assert mgr.restore().step == 3  # its heartbeat expired: taken over
    finally:
        mgr.close()


# -- the command line's last resort: one line, not a C++ stack --------------------------
def test_an_unexpected_error_prints_its_first_line_only(monkeypatch, capsys, tmp_path):
    def boom(args):
        raise RuntimeError("numel overflow\nException raised from x at y.h:79:\n"
                           "frame #0: c10::Error::Error() + 0x9d\nframe #1: _start + 0x21")

    monkeypatch.setitem(cli.COMMANDS, "inspect",
                        dataclasses.replace(cli.COMMANDS["inspect"], run=boom))
    assert cli.main(["inspect", str(tmp_path)]) == 1
    line = _error_line(capsys.readouterr().err)
    assert "RuntimeError: numel overflow" in line and "please report it" in line

