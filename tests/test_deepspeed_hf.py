"""The DeepSpeed door on the models people train with it: transformers MoE models (random
weights from their config classes) under plain ``deepspeed.initialize``, CPU, gloo, 2
ranks under torchrun, found by the one expert discovery every door uses. One launch of
tests/ds_hf_worker.py serves every test below (a module fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.test_deepspeed import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "ds_hf_worker.py"
STITCHED = ["mixtral:0", "mixtral:2", "mixtral:3", "qwen2:0", "qwen2:1bf16", "qwen2:2",
            "qwen2:2bf16", "qwen2:3", "qwen2:3init"]
"""model : ZeRO stage (fp32, or bf16; ``3init``: built partitioned under ``zero.Init``, as
transformers' ``from_config`` does with a ZeRO-3 ``HfDeepSpeedConfig``). ``mixtral``:
module-list experts; ``qwen2``: stacked experts and a shared expert, its ZeRO-1/2
partition boundary inside an expert's row."""
EXACT = ["mixtral:2", "mixtral:3", "qwen2:0", "qwen2:2", "qwen2:3"]


def results(out: Path, phase: str) -> list[dict]:
    return [json.loads((out / f"results_{phase}_{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_hf")
    done = torchrun(out, f"stitched={'+'.join(STITCHED)},exact={'+'.join(EXACT)},final,dense,"
                    "trainer=0+2+3+3leaf,accelerate,load_aware",
                    WORKER)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def test_stitched_load_restores_every_expert_from_its_save(runs):
    """K=2 of 4 per layer, a save after each of 4 steps: a fresh engine's load gives each
    expert -- its module's parameters, or its rows of each stacked parameter and of their
    fp32 masters and Adam moments -- as it was at the step its report names, and every
    non-expert tensor (shared experts and routers included) as at the last save, on both
    ranks, at ZeRO-0, 1, 2 and 3 (each rank's partition of every parameter), fp32 and
    bf16 (whose fp32 copies are the masters), and a model built under ``zero.Init`` (its
    stacked experts found by their full shapes, ``ds_shape``)."""
    for rank, res in enumerate(results(runs, "stitched")):
        for case in STITCHED:
            r = res[case]
            assert r["bad"] == [], (rank, case, r["bad"][:5])
            assert r["step"] == r["global_steps"] == 4
            layers = 2 if case.startswith("mixtral") else 3
            # the first save full, then two of four experts per layer each save: the
            # newest copies of half of them are at step 3
            assert sorted(r["sources"].values()) == [3] * (2 * layers) + [4] * (2 * layers)
            assert r["layouts"] == (["module"] if case.startswith("mixtral") else ["rows"])
            assert not any("shared" in n or ".gate." in n for n in r["experts"])
            assert 0 < r["plt"] < 1


def test_a_stacked_experts_row_split_by_the_zero_partition_boundary_is_restored(runs):
    """The qwen2 model is sized so that rank 1's ZeRO-1/2 partition begins inside an
    expert's row of a stacked parameter: that expert's fp32 master and moments are cut
    from both ranks' partitions and restored whole (the stitched test's `bad` is empty)."""
    rank1 = results(runs, "stitched")[1]
    for case in ("qwen2:1bf16", "qwen2:2"):
        assert rank1[case]["crossing"] == ["model.layers.1.mlp.experts.gate_up_proj"]
        assert rank1[case]["bad"] == []


def test_each_save_writes_k_of_n_experts(runs):
    for case in ("mixtral_2", "qwen2_2"):
        manifests = {p.parent.name: json.loads(p.read_text())
                     for p in (runs / case).glob("global_step*/moepec.json")}
        layers = len(manifests["global_step1"]["layers"])
        assert layers == (2 if case.startswith("mixtral") else 3)
        saved = {n: len(m["experts_saved"]) for n, m in manifests.items()}
        assert saved == {"global_step1": 4 * layers, "global_step2": 2 * layers,
                         "global_step3": 2 * layers, "global_step4": 2 * layers}


def test_routing_counts_are_what_the_routers_routed(runs):
    """The door's counts (hooks on what discovery found, summed over ranks, in the last
    save's schedule) equal the routers' own top-k choices counted beside it."""
    res = results(runs, "stitched")
    for case in ("mixtral_2", "qwen2_2"):
        key = case.replace("_", ":")
        m = json.loads((runs / case / "global_step4" / "moepec.json").read_text())
        routed = [[a + b for a, b in zip(r0, r1)]
                  for r0, r1 in zip(res[0][key]["routed"], res[1][key]["routed"])]
        assert m["schedule"]["counts"] == routed
        assert sum(map(sum, routed)) == 4 * 2 * 16 * 2 * len(routed)  # steps ranks tokens k


def test_k_equal_n_resume_is_bit_exact(runs):
    for res in results(runs, "exact"):
        for case in EXACT:
            assert res[case]["sources"] == [2], case
            assert res[case]["resumed"] == res[case]["uninterrupted"], case


def test_a_section_on_a_model_without_experts_says_so_once_at_initialize(runs):
    said = [r["warnings"] for r in results(runs, "dense")]
    assert said[1] == [] and len(said[0]) == 1
    line = said[0][0]
    assert "\n" not in line and "no experts found in Sequential" in line
    assert "deepspeed.moe.layer.MoE" in line and '"expert_spec"' in line


@pytest.mark.parametrize("stage", ["0", "3leaf"])
def test_the_trainer_saves_k_experts_and_resumes_stitched(runs, stage):
    """The Trainer (``deepspeed=`` ZeRO-0 or 3 with ``{"moepec": {"k_persist": 1}}``) on
    transformers' own Mixtral (stacked experts), without the FinalSave callback: its
    checkpoint-N folders are one lineage (the first full, then one expert per layer), and
    resume_from_checkpoint stitches checkpoint-6 from the older ones and trains on to step
    10. ``3leaf``: ZeRO-3 with the MoE blocks as ``set_z3_leaf_modules`` leaves and the
    16-bit weights gathered at each save (DeepSpeed's own ``model.safetensors`` beside the
    PEC tag)."""
    saved = _saved(runs, stage)
    assert [saved[n] for n in ("checkpoint-2", "checkpoint-4", "checkpoint-6")] == [8, 2, 2]
    if stage == "3leaf":
        assert (runs / "trainer_3leaf" / "checkpoint-4" / "model.safetensors").is_file()
    for res in results(runs, "trainer"):
        res = res[stage]
        assert res["step"] == 6 and res["global_step"] == 10
        assert sorted(res["sources"].values()) == [2, 2, 2, 2, 4, 4, 6, 6]
        assert 0 < res["plt"] < 1


@pytest.mark.parametrize("stage", ["2", "3"])
def test_the_trainers_last_save_holds_every_expert_with_final_save(runs, stage):
    """The Trainer with ``moepec.integrations.ds_trainer.FinalSave`` at ZeRO-2 and 3: its
    saves are K = 1 of 4 but the one at ``max_steps`` (checkpoint-6, and the resumed run's
    checkpoint-10) holds every expert, so resume_from_checkpoint loads every expert from
    checkpoint-6, no token lost. At ZeRO-3 (16-bit weights not gathered) the Trainer calls
    save_checkpoint twice on one tag: the mark makes the first complete, the second
    changes nothing."""
    saved = _saved(runs, stage)
    assert saved == {"checkpoint-2": 8, "checkpoint-4": 2, "checkpoint-6": 8,
                     "checkpoint-8": 2, "checkpoint-10": 8}
    for res in results(runs, "trainer"):
        res = res[stage]
        assert res["step"] == 6 and res["global_step"] == 10
        assert sorted(res["sources"].values()) == [6] * 8 and res["plt"] == 0


def _saved(runs: Path, stage: str) -> dict[str, int]:
    """Experts each checkpoint-N folder of a Trainer stage wrote."""
    return {p.parent.name: len(json.loads(p.read_text())["experts_saved"])
            for p in (runs / f"trainer_{stage}").glob("checkpoint-*/moepec.json")}


def test_complete_next_save_writes_every_expert_and_resumes_bit_exact(runs):
    """``moepec.integrations.deepspeed.complete_next_save(engine)`` before a save (qwen2,
    ZeRO-2, K = 1 of 4 in 3 layers): that save writes all 12 experts, a fresh engine's load
    of it reads every expert from it (no token lost) and trains on with the uninterrupted
    run's losses, bit for bit, on both ranks; the save after it is K = 1 again."""
    for res in results(runs, "final"):
        assert res["saved"] == {"global_step2": 12, "global_step3": 12, "global_step5": 3}
        assert res["sources"] == ["global_step3"] and res["n"] == 12
        assert res["lost"] == 0
        assert res["resumed"] == res["uninterrupted"]


def test_load_aware_selection_takes_the_most_routed_expert(runs):
    """``selection: load_aware``, K=1: the second save (the first after the full one)
    takes, in each layer, an expert the routers sent the most tokens since the first."""
    res = results(runs, "load_aware")
    after = [[[a + b for a, b in zip(r0, r1)] for r0, r1 in zip(s0, s1)]
             for s0, s1 in zip(res[0]["after"], res[1]["after"])]  # summed over ranks
    m = json.loads((runs / "load_aware" / "global_step2" / "moepec.json").read_text())
    assert m["schedule"]["selectors"]["persist"]["policy"] == "load_aware"
    saved = dict(m["experts_saved"])
    for layer, (first, second) in enumerate(zip(after[0], after[1])):
        since = [b - a for a, b in zip(first, second)]
        assert since[saved[f"layer_{layer}"]] == max(since), (layer, since, saved)


def test_accelerate_save_state_folders_are_one_lineage_and_load_state_stitches(runs):
    """Accelerate's own loop, its DeepSpeed plugin at ZeRO-2, automatic checkpoint naming:
    ``save_state`` folders ``checkpoint_<i>`` (DeepSpeed tag ``pytorch_model`` in each) are
    one lineage, the first full, then one expert per layer; ``load_state`` gives every
    expert's weights, fp32 master and moments as at the step its report names."""
    for res in results(runs, "accelerate"):
        assert res["saved"] == {"checkpoint_0": 8, "checkpoint_1": 2, "checkpoint_2": 2}
        assert res["step"] == 6 and res["bad"] == []
        assert sorted(res["sources"].values()) == [2, 2, 2, 2, 4, 4, 6, 6]


class _Stacked(nn.Module):
    """Stacked [E, ...] expert weights that structural discovery cannot take (no experts
    module, no router beside them): the user names them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.blocks:
            b.ffn = nn.Module()
            b.ffn.w_in = nn.Parameter(torch.zeros(4, 8, 16))
            b.ffn.w_out = nn.Parameter(torch.zeros(4, 16, 8))
        self.head = nn.Linear(16, 4)


def test_the_no_experts_line_names_an_expert_spec_that_finds_them():
    """The warning's ``"expert_spec"`` is JSON for the section, and taken as it is it
    finds the experts the structure could not; a wrong field is refused in one line."""
    from moepec.errors import ConfigError
    from moepec.integrations.ds_experts import expert_params, no_experts_message, spec_of
    from moepec.integrations.ds_files import Rows
    from moepec.state.experts import discover

    model = _Stacked()
    assert discover(model).layers == []
    line = no_experts_message("_Stacked", discover(model), "moepec")
    assert "\n" not in line
    spec = json.loads(line.split('"expert_spec": ', 1)[1].removesuffix(
        ' in the "moepec" section'))
    emap = discover(model, spec_of(spec))
    assert emap.n_experts == (4, 4)
    engine = type("Engine", (), {"module": model})()
    found = expert_params(engine, emap)
    assert found["blocks.1.ffn.w_out"] == Rows("layer_1", 4, 4 * 16 * 8, 0)
    assert "head.weight" not in found
    with pytest.raises(ConfigError, match="stacked, modules and ragged"):
        spec_of({"stack": "x"})


def test_export_and_fp32_export_give_the_stitched_model(runs, tmp_path):
    """`moepec export` (the module weights) and `--fp32` (ZeRO-2's fp32 masters joined
    from both ranks' partitions, a stacked row split between them included) of the qwen2
    save agree and load into the model class strictly; `moepec materialize` writes
    DeepSpeed's own files, from which DeepSpeed's zero_to_fp32.py joins the same
    masters."""
    from safetensors.torch import load_file

    from moepec.integrations.ds_export import export_fp32, export_model, materialize
    from tests.ds_hf_worker import model

    export_model(str(runs / "qwen2_2"), str(tmp_path / "m.safetensors"))
    export_fp32(str(runs / "qwen2_2"), str(tmp_path / "f.safetensors"))
    weights, masters = (load_file(str(tmp_path / n)) for n in ("m.safetensors",
                                                              "f.safetensors"))
    assert sorted(weights) == sorted(masters)
    assert [k for k in weights if not torch.equal(weights[k], masters[k])] == []
    model("qwen2", 0).load_state_dict(weights, strict=True)
    # back to DeepSpeed's own format: its zero_to_fp32.py joins the same masters
    materialize(str(runs / "qwen2_2"), str(tmp_path / "ds"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(tmp_path / "ds" / "zero_to_fp32.py"),
                           str(tmp_path / "ds"), str(tmp_path / "z2f")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    joined = torch.load(tmp_path / "z2f" / "pytorch_model.bin", weights_only=True)
    assert sorted(joined) == sorted(masters)
    assert all(torch.equal(joined[k], masters[k]) for k in masters)


def test_a_zero3_save_exports_fp32_and_materialized_loads_without_moepec(runs, tmp_path):
    """The qwen2 ZeRO-3 save (K=2 of 4, stitched): `moepec export` refuses in one line
    naming ``--fp32`` (its model files hold no weights); `--fp32` joins every rank's
    partitions into the same masters as DeepSpeed's zero_to_fp32.py on the
    `moepec materialize`d tag, which load into the model class strictly; and that tag
    loads in a DeepSpeed process that never imports moepec (tests/ds_plain_worker.py,
    2 ranks) with every rank's fp32 partitions, Adam moments and parameter partitions
    equal to what moepec's stitched load gave."""
    from safetensors.torch import load_file

    from moepec.errors import CheckpointError
    from moepec.integrations.ds_export import export_fp32, export_model, materialize
    from tests.ds_hf_worker import model

    with pytest.raises(CheckpointError, match="ZeRO-3 save.*--fp32"):
        export_model(str(runs / "qwen2_3"), str(tmp_path / "z3.safetensors"))
    export_fp32(str(runs / "qwen2_3"), str(tmp_path / "z3f.safetensors"))
    masters = load_file(str(tmp_path / "z3f.safetensors"))
    materialize(str(runs / "qwen2_3"), str(tmp_path / "ds3"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(tmp_path / "ds3" / "zero_to_fp32.py"),
                           str(tmp_path / "ds3"), str(tmp_path / "z3ds")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    joined = torch.load(tmp_path / "z3ds" / "pytorch_model.bin", weights_only=True)
    assert sorted(joined) == sorted(masters)
    assert [k for k in masters if not torch.equal(joined[k], masters[k])] == []
    model("qwen2", 0).load_state_dict(masters, strict=True)
    # DeepSpeed without moepec loads the materialized tag
    (tmp_path / "plain").mkdir()
    done = torchrun(tmp_path / "plain", str(tmp_path / "ds3"),
                    REPO / "tests" / "ds_plain_worker.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in (0, 1):
        plain = load_file(str(tmp_path / "plain" / f"plain_{rank}.safetensors"))
        stitched = load_file(str(runs / f"stitched_qwen2_3_{rank}.safetensors"))
        assert sorted(plain) == sorted(stitched) and int(plain["global_steps"]) == 4
        assert [k for k in plain if not torch.equal(plain[k], stitched[k])] == []
