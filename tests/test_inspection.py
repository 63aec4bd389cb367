"""inspect, verify and export: offline tools over a checkpoint root."""

from __future__ import annotations

import shutil

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from moepec.cli.main import main
from moepec.keys import parse_key
from moepec.recovery.offline import export_view, format_inspect, inspect_path, verify_path
from moepec.store.storage import single_process_dcp
from tests import manifest_docs
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
    name = manager._storage.committed()[-1]
    _corrupt(ckpt / name, "model/embed.weight")
    res = verify_path(str(ckpt))
    assert not res.ok and res.bad == [f"{name}:model/embed.weight"]


def test_export_safetensors_and_dcp_equal_restored_model(tmp_path):
    ckpt = tmp_path / "c"
    _train(ckpt, steps=8, keep_last=5)
    mgr, model, _ = fresh(ckpt, keep_last=5)
    mgr.restore()
    expect = model.state_dict()
    report = export_view(str(ckpt), str(tmp_path / "m.safetensors"), "safetensors")
    got = load_file(str(tmp_path / "m.safetensors"))
    assert report.tensors == len(got) and not report.notes() and set(got) == set(expect)
    assert all(torch.equal(got[k], expect[k]) for k in expect)
    export_view(str(ckpt), str(tmp_path / "dcp"), "dcp")
    # plain DCP, no moepec: read the model and the optimizer state back
    target = {f"model.{k}": torch.empty_like(v) for k, v in expect.items()}
    w1 = "moe.0.experts.w1"
    target[f"optim.{w1}.exp_avg"] = torch.empty_like(expect[w1])
    with single_process_dcp():  # the test's own stock call
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(target[f"model.{k}"], v) for k, v in expect.items())
    opt_state = mgr._catalog.optimizer.state[model.moe[0].experts.w1]["exp_avg"]
    assert torch.equal(target[f"optim.{w1}.exp_avg"], opt_state)


def test_cli_inspect_verify_export_exit_codes(tmp_path, capsys):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=6, keep_last=5)
    assert main(["inspect", str(ckpt)]) == 0
    assert "committed" in capsys.readouterr().out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    assert '"checkpoints"' in capsys.readouterr().out
    assert main(["verify", str(ckpt)]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "w.safetensors")]) == 0
    assert (tmp_path / "w.safetensors").exists()
    _corrupt(ckpt / manager._storage.committed()[-1], "model/embed.weight")
    assert main(["verify", str(ckpt)]) == 1
    assert "BAD item" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "c"), "--storage-options", "{bad"]) == 2
    assert "storage-options" in capsys.readouterr().err


def _damage_entry(root, name: str, key: str, field: str, value) -> None:
    """Set one field of ``key``'s item entry in checkpoint ``name``'s manifest."""
    path = root / name / "moepec.json"
    m, entries = manifest_docs.load(path)
    entries[key][field] = value
    manifest_docs.save(path, m, entries)


def _restored(ckpt):
    """(report, model.* and optim.*.* tensors) of a one-process CheckpointManager.restore()."""
    mgr, model, _ = fresh(ckpt, keep_last=5)
    report = mgr.restore()
    mgr.close()
    opt = mgr._catalog.optimizer
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out.update({f"optim.{name}.{s}": v for s, v in opt.state[p].items()})
    return report, out


def test_export_stitches_a_damaged_item_entry_as_restore_does(tmp_path, capsys):
    """A bad entry (dtype, path, offset) of the newest checkpoint: export falls back to the
    older copy exactly as restore does, bit for bit, and names the fallback."""
    pristine = tmp_path / "pristine"
    manager, _ = _train(pristine, steps=8, keep_last=5)
    newest = manager._storage.committed()[-1]
    keys = manifest_docs.load(pristine / newest / "moepec.json")[1]
    expert_key = next(k for k in sorted(keys) if k.startswith("experts/") and "/model/" in k)
    info = parse_key(expert_key)
    plain_key = next(k for k in sorted(keys) if k.startswith("model/"))
    cases = [(expert_key, "dtype", "object"), (expert_key, "file", "../x"),
             (expert_key, "offset", -1), (plain_key, "dtype", "object")]
    for i, (key, field, value) in enumerate(cases):
        ckpt = tmp_path / f"c{i}"
        shutil.copytree(pristine, ckpt)
        _damage_entry(ckpt, newest, key, field, value)
        report, expect = _restored(ckpt)
        capsys.readouterr()
        assert main(["export", str(ckpt), str(tmp_path / f"w{i}.safetensors")]) == 0, field
        text = capsys.readouterr().out
        if key == expert_key:  # an older copy of that expert, the newest base
            src = report.sources[f"{info.layer}/{info.expert}"]["checkpoint"]
            assert report.checkpoint == newest and src != newest
            assert (f"from an older copy: expert {info.expert} of MoE layer {info.layer} "
                    f"(model) from {src}") in text, text
        else:  # the older base
            assert report.checkpoint != newest
            assert f"the newest checkpoint {newest} cannot be restored" in text, text
        got = load_file(str(tmp_path / f"w{i}.safetensors"))
        model = {k: v for k, v in expect.items() if k.startswith("model.")}
        assert set(got) == {k.removeprefix("model.") for k in model}
        assert all(torch.equal(got[k.removeprefix("model.")], v) for k, v in model.items())
        assert main(["export", str(ckpt), str(tmp_path / f"d{i}"), "--format", "dcp"]) == 0
        target = {k: torch.empty_like(v) for k, v in expect.items()}
        with single_process_dcp():
            dcp.load(target, checkpoint_id=str(tmp_path / f"d{i}"), no_dist=True)
        assert all(torch.equal(target[k], v) for k, v in expect.items()), field


def test_export_with_no_intact_copy_of_an_expert_fails_in_one_line(tmp_path, capsys):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=8, keep_last=5)
    key = None
    for name in manager._storage.committed():  # every copy of one expert's weights
        keys = manifest_docs.load(ckpt / name / "moepec.json")[1]
        key = key or next(k for k in sorted(keys) if k.startswith("experts/") and "/model/" in k)
        if key in keys:
            _damage_entry(ckpt, name, key, "offset", -1)
    info = parse_key(key)
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("moepec: error:"))
    assert f"no intact copy left of expert {info.expert} of MoE layer {info.layer}" in line
    assert "Traceback" not in err and not (tmp_path / "w.safetensors").exists()
