"""The DeepSpeed door under Lightning 2.6: its ``Trainer`` with ``DeepSpeedStrategy`` at
ZeRO-2 and ``{"moepec": {"k_persist": K}}`` on transformers' Mixtral, ``ModelCheckpoint``
saves and ``fit(ckpt_path=...)`` resumes, 2 CPU ranks under torchrun (the strategy's CUDA
checks shimmed: tests/lightning_shims.py). One launch of tests/lightning_worker.py
serves every test below (a module fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_deepspeed import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = Path(__file__).resolve().parent / "lightning_worker.py"


def results(out: Path, phase: str) -> list[dict]:
    return [json.loads((out / f"results_{phase}_{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    done = torchrun(out, "stitched,exact,rotate", WORKER)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def test_checkpoint_folders_are_one_lineage_and_a_resume_stitches(runs):
    """``ModelCheckpoint(save_top_k=-1)``, K=1 of 4: each ``epoch=E-step=S.ckpt`` folder
    (DeepSpeed's tag ``checkpoint`` inside) is a folder of one lineage, the first full,
    then one expert per layer; ``fit(ckpt_path=<the step-6 folder>)`` gives every
    expert's weights, fp32 master and Adam moments as at the step its report names, all
    else as at step 6, on both ranks; the resumed run's next save continues the lineage
    (K experts per layer, K raised after the lossy load, not a full save)."""
    for res in results(runs, "stitched"):
        saved = res["saved"]
        assert [saved[f"epoch={e}-step={2 * e + 2}.ckpt"] for e in range(3)] == [8, 2, 2]
        assert 2 <= saved["epoch=3-step=8.ckpt"] < 8
        assert res["bad"] == [] and res["checked"] > 0
        assert res["step"] == 6 and res["global_step"] == 8
        assert sorted(res["sources"].values()) == [2, 2, 2, 2, 4, 4, 6, 6]
        assert 0 < res["plt"] < 1


def test_a_k_equal_n_resume_gives_the_uninterrupted_losses(runs):
    for res in results(runs, "exact"):
        assert res["sources"] == [2]
        assert len(res["resumed"]) == 2 and res["resumed"] == res["uninterrupted"]


def test_rotation_by_save_top_k_1_makes_saves_full_said_once_and_the_last_loads(runs):
    """``ModelCheckpoint``'s default (``save_top_k=1``) deletes the previous folder after
    each save: the door says once, on rank 0, that every save is written full and which
    setting keeps K of N; the one folder left is full and loads alone."""
    rank0, rank1 = results(runs, "rotate")
    assert len(rank0["said"]) == 1 and rank1["said"] == []
    assert "save_top_k=-1" in rank0["said"][0] and "\n" not in rank0["said"][0]
    for res in (rank0, rank1):
        assert res["saved"] == {"epoch=2-step=6.ckpt": 8}
        assert res["warnings"] == [] and res["steps"] == [6]


def test_export_fp32_of_the_checkpoint_folder_loads_into_the_module(runs, tmp_path):
    """`moepec export --fp32` of ModelCheckpoint's directory takes its newest
    ``<name>.ckpt`` folder, stitched: the fp32 masters under the LightningModule's
    parameter names, which it loads strictly."""
    from safetensors.torch import load_file

    from moepec.integrations.ds_export import export_fp32
    from tests.lightning_worker import Lit

    tag, n = export_fp32(str(runs / "stitched"), str(tmp_path / "m.safetensors"))
    assert tag == "checkpoint" and n > 0
    Lit(0).load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
