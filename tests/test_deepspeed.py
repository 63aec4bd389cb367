"""The DeepSpeed door (moepec.integrations.deepspeed) on DeepSpeed's real engine: CPU
accelerator, gloo, 2 ranks under torchrun, native MoE with 8 experts. Two launches of
tests/ds_worker.py share their engines and saves between the tests below (module
fixtures); the second starts after the first's rank 1 was SIGKILLed inside a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moepec.flat import FLAT_FIELDS
from moepec.recovery.flat_view import verify_root

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test runs both launches

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "ds_worker.py"
CASES = ["0:fp32:2", "0:bf16:1", "1:bf16:2", "2:fp32:1", "2:fp32:2"]
"""ZeRO stage : dtype : expert parallelism: every stage, both dtypes and both EP sizes
(the 12 combinations all passed once, by hand; 5 keep the suite's time)."""


def torchrun(out: Path, phases: str, worker: Path = WORKER) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(worker), str(out), phases]
    with subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:  # the ranks too, not only torchrun
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def results(out: Path, phase: str) -> list[dict]:
    return [json.loads((out / f"results_{phase}_{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    first = torchrun(out, f"matrix={'+'.join(CASES)},materialized,exact,deleted,hf,refusals,kill")
    assert (out / "kill_started_0").exists(), first.stdout[-3000:] + first.stderr[-6000:]
    assert first.returncode != 0  # rank 1 was killed inside the last save
    second = torchrun(out, "afterkill")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-6000:]
    return out


def test_stitched_load_restores_every_expert_from_its_save(runs):
    """ZeRO 0/1/2, fp32/bf16, EP 1/2: K=2 of 8 per save, 4 saves; a fresh engine (other
    seed) loads `latest`: each expert's weight, fp32 master and Adam moments equal their
    values at the step its report names, everything else the last save's, on both ranks."""
    for rank, res in enumerate(results(runs, "matrix")):
        for case in CASES:
            r = res[case]
            assert r["bad"] == [], (rank, case, r["bad"][:5])
            assert r["checked"] >= 9  # weights of emb, gate, head and this rank's experts
            assert r["step"] == r["global_steps"] == 8
            # K=2 of 8 every 2 steps after a full first save: two experts per save
            steps = sorted(r["sources"].values())
            assert steps == [2, 2, 4, 4, 6, 6, 8, 8], (case, r["sources"])
            assert 0 < r["plt"] < 1


def test_k_equal_n_resume_is_bit_exact(runs):
    """K = N: the resumed engine's next losses equal the uninterrupted run's bit for bit
    (RNG state restored: DeepSpeed's gating draws from it)."""
    for res in results(runs, "exact"):
        assert res["sources"] == [4]
        assert res["resumed"] == res["uninterrupted"]


def test_a_deleted_tag_a_view_needs_is_read_past_or_named_in_one_line(runs):
    for res in results(runs, "deleted"):
        # K=2 of 8 at steps 1 (full), 2, 3, 4: step 3's two experts come from step 1
        past = res["global_step3"]
        assert past["error"] is None and past["steps"] == [1, 2, 4], past
        assert len(past["warnings"]) == 2 and all(
            "global_step3 is gone" in w and "global_step1" in w for w in past["warnings"])
        gone = res["global_step1"]["error"]
        assert gone is not None and "\n" not in gone and "no older copy" in gone
        assert "global_step1, which is gone" in gone or "global_step3, which is gone" in gone


def test_a_save_killed_mid_write_leaves_latest_loadable(runs):
    for res in results(runs, "afterkill"):
        # DeepSpeed wrote `latest` when the save returned (its write in the background):
        # either tag; the load takes the newest committed one
        assert res["latest"] in ("global_step2", "global_step4") and res["step"] == 2
        assert "never committed" in res["refused"]
    found = verify_root(str(runs / "killed"))
    assert "global_step4" in found.uncommitted and found.needs == {"global_step2": []}


def test_a_pec_save_writes_two_of_eight_experts(runs):
    """The saves' manifests: the first holds every expert, each later one two, and each
    expert's keys were written by one rank, spread over both (EP 1: both ranks hold all
    eight experts), as were the non-expert parameters."""
    save = runs / "2_fp32_1"
    manifests = {p.parent.name: json.loads(p.read_text())
                 for p in save.glob("global_step*/moepec.json")}
    saved = {n: len(m["experts_saved"]) for n, m in manifests.items()}
    assert saved == {"global_step2": 8, "global_step4": 2, "global_step6": 2,
                     "global_step8": 2}
    weights = [k for k in manifests["global_step2"]["items"] if k.startswith("layer_0_expert")]
    ranks = {manifests["global_step2"]["items"][k]["rank"] for k in weights}
    assert ranks == {0, 1}
    # The non-expert parameters (DeepSpeed writes them from data-parallel rank 0 only)
    # are spread too: every save's non-expert bytes are shared evenly. (An expert's
    # optimizer fragments can be written only by the rank whose ZeRO partition holds it.)
    for m in manifests.values():
        module = {k.removeprefix("mp_rank_00_model_states.pt/module/"): v
                  for k, v in m["items"].items()
                  if k.startswith("mp_rank_00_model_states.pt/module/")}
        # each parameter once, under rank 0's file key (a replica keyed otherwise would
        # be a second, unread copy), written by both ranks between them
        assert sorted(module) == ["emb.bias", "emb.weight", "head.bias", "head.weight",
                                  "moe.deepspeed_moe.gate.wg.weight"], sorted(module)
        assert {v["rank"] for v in module.values()} == {0, 1}
        per_rank = [sum(v["nbytes"] for k, v in m["items"].items()
                        if v["rank"] == r and k not in m["experts"]) for r in (0, 1)]
        assert max(per_rank) < 1.25 * min(per_rank), per_rank


def test_hugging_face_trainer_saves_pec_and_resumes(runs):
    """The Trainer with a DeepSpeed config holding {"moepec": {"k_persist": 2}}: its
    checkpoint-N folders are one lineage (the first full, then 2 of 8 experts each), and
    resume_from_checkpoint stitches checkpoint-6 from the older ones and trains on."""
    hf = runs / "hf"
    manifests = {p.parent.name: json.loads(p.read_text())
                 for p in hf.glob("checkpoint-*/moepec.json")}
    saved = {n: len(m["experts_saved"]) for n, m in manifests.items()}
    assert {n: saved[n] for n in ("checkpoint-2", "checkpoint-4", "checkpoint-6")} == {
        "checkpoint-2": 8, "checkpoint-4": 2, "checkpoint-6": 2}
    # After the resume, dynamic K (on by default) answered the recovery's PLT, far over
    # the 3.75% budget with K=2 of 8, by raising K; the saves follow the new K.
    k = manifests["checkpoint-8"]["k_persist"]
    assert k > 2 and saved["checkpoint-8"] == saved["checkpoint-10"] == k
    for res in results(runs, "hf"):
        assert res["step"] == 6 and res["global_step"] == 10
        assert sorted(res["sources"].values()) == [2, 2, 2, 2, 4, 4, 6, 6]


def test_materialized_tag_loads_in_deepspeed_without_moepec(runs):
    """`moepec materialize` writes DeepSpeed's own files (torch.save), each expert from its
    newest copy: a DeepSpeed engine without moepec loads them to the state the door's
    stitched load gives, every parameter's weight, fp32 master and moments."""
    for res in results(runs, "materialized"):
        assert res["bad"] == [] and res["checked"] >= 9 and res["steps"] == [8, 8]


def test_cli_export_and_materialize(runs, tmp_path):
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    save = runs / "2_fp32_2"
    out = tmp_path / "model.safetensors"
    cli = [sys.executable, "-m", "moepec"]
    done = subprocess.run(cli + ["export", str(save), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    model = load_file(str(out))
    experts = {k.split(".")[4] for k in model if ".deepspeed_experts." in k}
    assert experts == {str(e) for e in range(8)} and "emb.weight" in model
    # each expert as in DeepSpeed's own file of the materialized tag (experts 6, 7: step 2)
    expert = torch.load(runs / "materialized" / "global_step8" /
                        "layer_0_expert_6_mp_rank_00_model_states.pt", weights_only=True)
    for k, v in expert.items():
        assert torch.equal(model[k], v)
    again = subprocess.run(cli + ["materialize", str(save), str(runs / "materialized")],
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_fp32_export_joins_zero_masters_of_moe_tags(runs):
    """`moepec export --fp32` (what zero_to_fp32.py gives, which fails on MoE tags):
    every parameter's fp32 master joined from the ranks' ZeRO fragments, experts under
    their global names: equal to the module's weights (fp32), or rounding to them (bf16),
    at ZeRO-2 EP 2, ZeRO-2 EP 1 (each expert split over both ranks) and ZeRO-1 bf16."""
    res = results(runs, "materialized")[0]["fp32"]
    for case in ("2_fp32_2", "2_fp32_1", "1_bf16_2"):
        got = res[case]
        assert got["names"] and got["n"] == 37 and got["dtypes"] == ["torch.float32"], case
        assert got["bad"] == [], (case, got["bad"])
    assert res["zero0"] is not None and "ZeRO-1/2" in res["zero0"]


def test_what_the_door_refuses_it_refuses_in_one_line(runs):
    for res in results(runs, "refusals"):
        assert res["field"] is not None and "interval" in res["field"]
        assert "k_persist" in res["field"] and "\n" not in res["field"]
        # ZeRO-3 is taken (DeepSpeed refuses its own MoE layers there): a dense model
        # with the section saves, full (tests/test_deepspeed_hf.py: MoE models at ZeRO-3)
        assert res["zero3"] is None


def test_config_fields_are_the_flat_front_ends():
    from moepec.errors import ConfigError
    from moepec.flat import FlatFrontEnd

    assert "k_persist" in FLAT_FIELDS
    with pytest.raises(ConfigError, match="interval"):
        FlatFrontEnd(interval=3)
    assert torch.__version__.startswith("2.13")
