"""inspect, verify and export: offline tools over a checkpoint root."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from moepec.recovery.offline import export_view, format_inspect, inspect_path, verify_path
from tests.test_commit import _corrupt, _train, crash, fresh


def test_inspect_reports_commits_uncommitted_and_view_age(tmp_path):
    ckpt = tmp_path / "c"
    assert crash(ckpt, "before_commit", 3) == -9
    info = inspect_path(str(ckpt))
    states = [r.committed for r in info["checkpoints"]]
    assert states == [True, True, False]
    text = format_inspect(info)
    assert "uncommitted" in text and "committed" in text
    assert "all (full)" in text  # the first checkpoint of a run is full
    ages = info["view_age"]
    assert len(ages) == 2 and all(len(row) == 4 for row in ages)
    assert min(min(row) for row in ages) == 0 and max(max(row) for row in ages) == 2
    assert info["full_bytes"] > info["checkpoints"][1].bytes


def test_verify_finds_corruption(tmp_path):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=6, keep_last=5)
    res = verify_path(str(ckpt))
    assert res.ok and res.checked > 10
    name = manager.storage.committed()[-1]
    _corrupt(ckpt / name, "model/embed.weight")
    res = verify_path(str(ckpt))
    assert not res.ok and res.bad == [f"{name}:model/embed.weight"]


def test_export_safetensors_and_dcp_equal_restored_model(tmp_path):
    ckpt = tmp_path / "c"
    _train(ckpt, steps=8, keep_last=5)
    mgr, model, _ = fresh(ckpt, keep_last=5)
    mgr.restore()
    expect = model.state_dict()
    n = export_view(str(ckpt), str(tmp_path / "m.safetensors"), "safetensors")
    got = load_file(str(tmp_path / "m.safetensors"))
    assert n == len(got) and set(got) == set(expect)
    assert all(torch.equal(got[k], expect[k]) for k in expect)
    export_view(str(ckpt), str(tmp_path / "dcp"), "dcp")
    # plain DCP, no moepec: read the model and the optimizer state back
    target = {f"model.{k}": torch.empty_like(v) for k, v in expect.items()}
    w1 = "moe.0.experts.w1"
    target[f"optim.{w1}.exp_avg"] = torch.empty_like(expect[w1])
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(target[f"model.{k}"], v) for k, v in expect.items())
    opt_state = mgr.catalog.optimizer.state[model.moe[0].experts.w1]["exp_avg"]
    assert torch.equal(target[f"optim.{w1}.exp_avg"], opt_state)


def test_cli_inspect_verify_export_exit_codes(tmp_path, capsys):
    from moepec.cli.main import main

    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=6, keep_last=5)
    assert main(["inspect", str(ckpt)]) == 0
    assert "committed" in capsys.readouterr().out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    assert '"checkpoints"' in capsys.readouterr().out
    assert main(["verify", str(ckpt)]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "w.safetensors")]) == 0
    assert (tmp_path / "w.safetensors").exists()
    _corrupt(ckpt / manager.storage.committed()[-1], "model/embed.weight")
    assert main(["verify", str(ckpt)]) == 1
    assert "BAD item" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "c"), "--storage-options", "{bad"]) == 2
    assert "storage-options" in capsys.readouterr().err
