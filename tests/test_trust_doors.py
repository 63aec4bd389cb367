"""A DeepSpeed save directory from a stranger, through the DeepSpeed door's tools
(``moepec materialize``, ``moepec export``), the door's choice of tag and the flat front
end's read: nothing is written outside the output folder, nothing is read through a
``latest`` that leads outside the save directory or never ends, nothing is allocated
beyond what the checkpoint holds, and each refusal is a CheckpointError in one line.

Save directories are built with the store's own API (no DeepSpeed process): a committed
flat folder whose keys are DeepSpeed files as :mod:`moepec.integrations.ds_files` keys
them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moepec.cli import main as cli
from moepec.errors import CheckpointError, CorruptCheckpointError
from moepec.flat import FlatFrontEnd, encode_object
from moepec.integrations.ds_export import export_model, materialize, resolve_tag
from moepec.integrations.ds_files import SKELETON, join_file, split_file
from moepec.store.flat import FlatManifest, commit, read_records, write_rank

REPO = Path(__file__).resolve().parents[1]
TAG = "global_step1"
MODEL = "mp_rank_00_model_states.pt"


def committed(root: Path, tag: str, tensors: dict[str, torch.Tensor],
              view: dict[str, str] | None = None, seq: int = 0) -> None:
    """Commit folder ``tag`` of save directory ``root`` holding ``tensors``."""
    folder = root / tag
    folder.mkdir(parents=True)
    write_rank(str(folder), tensors, 0)
    commit(str(root), FlatManifest(
        name=tag, seq=seq, step=seq, parent=None, items=read_records(str(folder), 1),
        view=view if view is not None else {k: tag for k in tensors}, experts={},
        experts_saved=[], k_persist=1, world_size=1, layers=[]))


def ds_file(name: str, module: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSpeed file ``name`` holding ``{"module": module}`` as the door keys it."""
    return split_file(name, {"module": module}, {}, {}).tensors


def ds_save(root: Path, files: dict[str, torch.Tensor], tag: str = TAG) -> Path:
    """A DeepSpeed save directory: one committed tag holding ``files``' keys, `latest`."""
    committed(root, tag, files)
    (root / "latest").write_text(tag)
    return root


def tree(*folders: Path) -> dict[str, list[str]]:
    """Everything under each folder (relative paths), to compare before and after."""
    return {str(f): sorted(str(p.relative_to(f)) for p in f.rglob("*")) for f in folders}


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI; it must fail with one line and no traceback. Returns that line."""
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1 and err.startswith("moepec: error:"), err
    assert "Traceback" not in err and "please report it" not in err, err
    return err


# -- A1: materialize writes only inside OUT/<tag> ----------------------------------------

@pytest.mark.parametrize("bad", ["../../ESCAPED.pt", "ABS", "sub/x.pt", "..", "evil.sh",
                                 "mp_rank_00_model_states.pt\\..\\x.pt"])
def test_materialize_refuses_a_file_name_deepspeed_never_writes(tmp_path, capsys, bad):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if bad == "ABS":
        bad = str(elsewhere / "ABS.pt")
    files = ds_file(MODEL, {"w": torch.ones(3)}) | ds_file(bad, {"w": torch.ones(3)})
    save = ds_save(tmp_path / "save", files)
    out = tmp_path / "out"
    # the parent's own entries (other tests' folders there may still change inside)
    before = (sorted(p.name for p in tmp_path.parent.iterdir()), tree(tmp_path, elsewhere))

    with pytest.raises(CorruptCheckpointError, match="not a name DeepSpeed writes") as exc:
        materialize(str(save), str(out))
    assert repr(bad)[:40] in str(exc.value)
    err = one_line_error(capsys, ["materialize", str(save), str(out)])
    assert "not a name DeepSpeed writes" in err

    after = (sorted(p.name for p in tmp_path.parent.iterdir()), tree(tmp_path, elsewhere))
    assert after == before  # out/ not even made
    assert not (tmp_path / "ESCAPED.pt").exists() and not (elsewhere / "ABS.pt").exists()


def test_materialize_writes_every_deepspeed_file_name_inside_out(tmp_path):
    names = [MODEL, "layer_0_expert_3_mp_rank_00_model_states.pt",
             "expert_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "expp_rank_0_mp_rank_00_optim_states.pt", "layer_01-model_states.pt",
             "layer_02-model_00-model_states.pt"]
    files = {}
    for i, n in enumerate(names):
        files |= ds_file(n, {"w": torch.full((2,), float(i))})
    # A value named like a skeleton inside a file is a value, not a file.
    files |= split_file(MODEL, {"module": {"w": torch.zeros(2)},
                                "client": {SKELETON: torch.ones(1)}}, {}, {}).tensors
    save = ds_save(tmp_path / "save", files)
    done = materialize(str(save), str(tmp_path / "out"))
    assert sorted(done.files) == sorted(names)
    assert sorted(os.listdir(tmp_path / "out" / TAG)) == sorted(names)
    assert (tmp_path / "out" / "latest").read_text() == TAG
    sd = torch.load(tmp_path / "out" / TAG / names[1], weights_only=True)
    assert torch.equal(sd["module"]["w"], torch.full((2,), 1.0))
    # ...and refuses a name that differs from DeepSpeed's by a path, even one that stays
    # inside out/ (DeepSpeed never writes into a subfolder of a tag).
    files |= ds_file(f"{TAG}/{MODEL}", {"w": torch.ones(1)})
    other = ds_save(tmp_path / "save2", files)
    with pytest.raises(CorruptCheckpointError, match="not a name DeepSpeed writes"):
        materialize(str(other), str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("latest", ["../x", "ABS", "..", ".", "a/../../x", ""])
def test_a_tag_leading_outside_the_save_directory_is_refused(tmp_path, capsys, latest):
    # A committed DeepSpeed-like folder outside the save directory, for `latest` to name.
    committed(tmp_path, "x", ds_file(MODEL, {"w": torch.ones(3)}))
    save = ds_save(tmp_path / "save", ds_file(MODEL, {"w": torch.ones(3)}))
    if latest == "ABS":
        latest = str(tmp_path / "x")
    (save / "latest").write_text(latest)
    out = tmp_path / "out"
    before = tree(tmp_path)

    with pytest.raises(CheckpointError, match="latest"):
        resolve_tag(str(save), None)
    with pytest.raises(CheckpointError, match="latest"):
        materialize(str(save), str(out))
    one_line_error(capsys, ["materialize", str(save), str(out)])
    # --tag is checked as `latest` is
    (save / "latest").write_text(TAG)
    if latest not in ("", "."):
        with pytest.raises(CheckpointError, match="not a plain"):
            materialize(str(save), str(out), tag=latest)
        one_line_error(capsys, ["materialize", str(save), str(out), "--tag", latest])
    assert tree(tmp_path) == before


# -- `latest` is read bounded, from a regular file, never through a symlink ---------------

def _door_tag(load_dir: Path) -> str | None:
    pytest.importorskip("deepspeed")
    from moepec.integrations.deepspeed import PecCheckpointEngine

    return PecCheckpointEngine.committed_tag(SimpleNamespace(front=FlatFrontEnd()),
                                             str(load_dir), None)


@pytest.mark.parametrize("kind", ["symlink", "dangling", "large", "dir"])
def test_latest_that_is_not_a_small_regular_file_is_refused(tmp_path, capsys, kind):
    save = ds_save(tmp_path / "save", ds_file(MODEL, {"w": torch.ones(3)}))
    latest = save / "latest"
    latest.unlink()
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text(TAG)
        latest.symlink_to(tmp_path / "elsewhere")
    elif kind == "dangling":
        latest.symlink_to(tmp_path / "nowhere")
    elif kind == "large":
        latest.write_text(TAG + " " * 8192)
    else:
        latest.mkdir()
    with pytest.raises(CheckpointError, match="latest"):
        resolve_tag(str(save), None)
    one_line_error(capsys, ["materialize", str(save), str(tmp_path / "out")])
    with pytest.raises(CheckpointError, match="latest"):
        _door_tag(save)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("latest", ["../x", "ABS", ".."])
def test_the_door_refuses_a_latest_leading_outside_the_save_directory(tmp_path, latest):
    committed(tmp_path, "x", ds_file(MODEL, {"w": torch.ones(3)}))
    save = ds_save(tmp_path / "save", ds_file(MODEL, {"w": torch.ones(3)}))
    (save / "latest").write_text(str(tmp_path / "x") if latest == "ABS" else latest)
    with pytest.raises(CheckpointError, match="latest"):
        _door_tag(save)
    (save / "latest").write_text(TAG)
    assert _door_tag(save) is None  # committed: DeepSpeed reads `latest` as it does


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_latest_is_refused_without_blocking(tmp_path):
    save = ds_save(tmp_path / "save", ds_file(MODEL, {"w": torch.ones(3)}))
    (save / "latest").unlink()
    os.mkfifo(save / "latest")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        p = subprocess.run([sys.executable, "-m", "moepec", "materialize", str(save),
                            str(tmp_path / "out")], capture_output=True, text=True,
                           timeout=60, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("moepec materialize blocked on a FIFO `latest`")
    assert p.returncode != 0
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "latest" in err and "Traceback" not in err, err
    with pytest.raises(CheckpointError, match="latest"):
        _door_tag(save)


# -- B5: a skeleton allocates no more than its pieces hold --------------------------------

def _flat_skeleton(numel: int, pieces: list) -> dict[str, torch.Tensor]:
    return {f"{MODEL}/{SKELETON}": encode_object(
        {"module": {"w": {"__moepec_ds__": "flat", "numel": numel, "dtype": "float32",
                          "pieces": pieces}}}, MODEL),
            f"{MODEL}/a": torch.ones(4), f"{MODEL}/b": torch.ones(2)}


@pytest.mark.parametrize("numel, pieces", [
    (10_000_000, []),                                     # nothing holds its values
    (10_000_000, [[0, 4, f"{MODEL}/a"]]),                 # most of it
    (8, [[0, 4, f"{MODEL}/a"], [6, 2, f"{MODEL}/b"]]),    # a hole
    (6, [[0, 4, f"{MODEL}/a"], [4, 4, f"{MODEL}/b"]]),    # a piece longer than its key
    (6, [[0, 4, f"{MODEL}/a"], [5, 2, f"{MODEL}/b"]]),    # past the end
    (4, [[-2, 4, f"{MODEL}/a"], [2, 2, f"{MODEL}/b"]]),   # before the start
    (4, [[0, 4, 7]]),                                     # not a key
    (4, [[0.5, 4, f"{MODEL}/a"]]),                        # not an offset
])
def test_a_flat_skeleton_that_its_pieces_do_not_fill_is_refused(numel, pieces):
    tensors = _flat_skeleton(numel, pieces)
    with pytest.raises(CorruptCheckpointError, match="does not fit its tensors"):
        join_file(MODEL, tensors)
    # what the door writes still joins: a ZeRO partition cut into fragments and gaps
    fragment_address = pytest.importorskip("deepspeed.utils.tensor_fragment").fragment_address

    flat = torch.arange(10.0)
    sd = {"param_slice_mappings": [{"e.w": fragment_address(numel=4, start=2)}],
          "single_partition_of_fp32_groups": [flat]}
    split = split_file("zero_pp_rank_0_mp_rank_00_optim_states.pt", sd, {"e.w": ("l", 0)},
                       {})
    assert len(split.tensors) == 4  # the skeleton, the fragment and two gaps
    back = join_file("zero_pp_rank_0_mp_rank_00_optim_states.pt", split.tensors)
    assert torch.equal(back["single_partition_of_fp32_groups"][0], flat)


def test_export_of_a_tiny_save_claiming_a_huge_tensor_is_refused(tmp_path, capsys):
    save = ds_save(tmp_path / "save", _flat_skeleton(50_000_000, []))
    with pytest.raises(CorruptCheckpointError, match="does not fit its tensors"):
        export_model(str(save), str(tmp_path / "model.safetensors"))
    one_line_error(capsys, ["export", str(save), str(tmp_path / "model.safetensors")])
    one_line_error(capsys, ["materialize", str(save), str(tmp_path / "out")])
    assert not (tmp_path / "model.safetensors").exists()


# -- C13: a view naming a folder without the key -----------------------------------------

def test_a_view_naming_a_folder_without_the_key_is_a_corrupt_checkpoint(tmp_path, capsys):
    save = tmp_path / "save"
    committed(save, "global_step1", {"other": torch.ones(1)}, seq=1)
    skeleton = f"{MODEL}/{SKELETON}"
    committed(save, "global_step2", {"x": torch.ones(1)},
              {"x": "global_step2", skeleton: "global_step1", "w#0+1": "global_step1"},
              seq=2)
    (save / "latest").write_text("global_step2")

    with pytest.raises(CorruptCheckpointError) as exc:
        FlatFrontEnd().read(str(save), "global_step2", [skeleton])
    assert skeleton in str(exc.value) and "global_step1" in str(exc.value)
    with pytest.raises(CorruptCheckpointError, match="'w#0\\+1' is not in global_step1"):
        FlatFrontEnd().shapes(str(save), "global_step2")
    one_line_error(capsys, ["materialize", str(save), str(tmp_path / "out")])
    err = one_line_error(capsys, ["export", str(save), str(tmp_path / "out.safetensors")])
    assert "global_step1" in err
