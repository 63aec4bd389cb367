"""The Megatron-Core door's two levels (moepec.integrations.megatron.snapshot into the
flat front end's RAM tier) under torchrun with real SIGKILLs: one launch,
``--max-restarts 3``, four attempts of tests/megatron_ram_worker.py (what each does is in
its docstring), shared by the tests below."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ram_attempts import run_attempts

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "megatron_ram_worker.py"


@pytest.fixture(scope="module")
def attempts(tmp_path_factory):
    return run_attempts(WORKER, tmp_path_factory.mktemp("megatron_ram"), 4)


def test_a_killed_worker_resumes_from_ram_at_the_newest_snapshot_bit_for_bit(attempts):
    # Storage saved iteration 4; the RAM snapshot of 6 is newer; rank 1 died at 7.
    for got in attempts[1]:
        r = got["newest"]
        assert (r["tier"], r["step"], r["checkpoint"]) == ("ram", 6, "ram:6")
        assert r["units_from"] == {"ram": 8} and r["sources"] == [6]
        assert r["bad"] == [] and r["checked"] >= 20


def test_with_the_ram_tier_wiped_storage_serves_and_the_report_says_so(attempts):
    # The snapshot of 9 was wiped with the node's RAM; storage holds 8 (K = 1 of 4).
    for got in attempts[2]:
        r = got["newest"]
        assert (r["tier"], r["step"], r["checkpoint"]) == ("storage", 8, "iter_0000008")
        assert r["units_from"] == {"storage": 8} and r["sources"] == [4, 8]
        assert r["bad"] == [] and r["checked"] >= 20


def test_a_named_older_folder_loads_that_folder_and_abandons_later_snapshots(attempts):
    for got in attempts[2]:
        assert [(got[c]["tier"], got[c]["step"], got[c]["bad"]) for c in (
            "named", "after_named")] == [("storage", 4, []), ("storage", 8, [])]


def test_a_kill_during_a_snapshot_leaves_the_previous_one(attempts):
    # Rank 1 died inside the snapshot of 10 (copied, not sealed): every rank takes 9.
    for got in attempts[3]:
        r = got["newest"]
        assert (r["tier"], r["step"], r["bad"]) == ("ram", 9, [])


def test_adam_step_count_after_a_load_is_the_uninterrupted_runs(attempts):
    # Megatron keeps it in the common state (common.pt, read before the door runs): a
    # load from RAM sets the snapshot's (6, 9), not the storage folder's (4, 8).
    loads = [got[c] for a in (1, 2, 3) for got in attempts[a]
             for c in ("newest", "named", "after_named") if c in got]
    assert [r["tier"] for r in loads].count("ram") == 4
    for r in loads:
        assert r["adam_step"] == r["adam_step_then"] == r["step"], r


def test_megatron_lms_common_values_and_rng_states_are_the_loaded_steps(attempts):
    # Megatron-LM's load_checkpoint reads them from the merged dict after the load: from
    # a RAM load the snapshot's (6, 9), from storage the folder's (4, 8).
    loads = [got[c] for a in (1, 2, 3) for got in attempts[a]
             for c in ("newest", "named", "after_named") if c in got]
    assert sorted({r["step"] for r in loads}) == [4, 6, 8, 9]
    for r in loads:
        s = r["step"]
        assert r["lm"] == [s, 8 * s, "torch.float32", "auto", 8 * s, 1.5 * s, "MT19937",
                           True, True], r


def test_a_common_value_that_is_not_data_is_refused_naming_it(attempts):
    for got in attempts[0]:
        assert got["refused"] == (
            "snapshot()'s common state['args']['init'] is a function; moepec stores only "
            "JSON values and tensors: keep the common (non-sharded) values JSON values, "
            "tensors, numpy values, Namespaces, torch dtypes or Megatron's enums "
            "(megatron_checks.ENUMS), or move them into sharded objects")


def test_megatron_lms_args_with_megatrons_enums_round_trip():
    import signal
    from argparse import Namespace

    import torch
    from megatron.core.rerun_state_machine import RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    from moepec.flat import decode_object, encode_object
    from moepec.integrations.megatron_checks import ENUMS

    common = {"args": Namespace(attention_backend=AttnBackend.flash, exit_signal=signal.SIGINT,
                                cuda_graph_scope=[CudaGraphScope.attn], params_dtype=torch.half),
              "rerun_state_machine": {"mode": RerunMode.DISABLED,
                                      "state": RerunState.NOT_RUNNING_YET}}
    back = decode_object(encode_object(common, "c", enums=ENUMS), "c", enums=ENUMS)
    assert vars(back["args"]) == vars(common["args"])
    assert back["rerun_state_machine"] == common["rerun_state_machine"]


def test_snapshot_refuses_without_the_ram_level_or_with_another_iteration(tmp_path):
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import moepec
    import moepec.integrations.megatron as pec

    def sd():
        return {"iteration": 5, "w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(moepec.ConfigError, match="ram_dir="):
            pec.snapshot(sd(), 5, str(tmp_path))  # registered at import: no RAM level
        pec.register(k_persist=1, ram_dir=None)
        with pytest.raises(moepec.ConfigError, match="'iteration' is 5, not the 6 given"):
            pec.snapshot(sd(), 6, str(tmp_path))
        with pytest.raises(moepec.ConfigError, match="ram_dir must be"):
            pec.register(ram_dir="")
        with pytest.raises(moepec.ConfigError, match="ram_replicas must be 0, 1 or None"):
            pec.register(ram_dir="auto", ram_replicas=2)
        with pytest.raises(moepec.ConfigError, match="set ram_dir"):
            pec.register(ram_replicas=1)  # no RAM level to replicate
    finally:
        pec.register()
        dist.destroy_process_group()
