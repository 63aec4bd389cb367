"""The DeepSpeed door's two levels (moepec.integrations.deepspeed.snapshot into the flat
front end's RAM tier, moepec.flat.ram) under torchrun with real SIGKILLs: one launch,
``--max-restarts 3``, four attempts of tests/ds_ram_worker.py (what each does is in its
docstring), shared by the tests below."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ram_attempts import run_attempts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "ds_ram_worker.py"


@pytest.fixture(scope="module")
def attempts(tmp_path_factory):
    return run_attempts(WORKER, tmp_path_factory.mktemp("deepspeed_ram"), 4, DS_ACCELERATOR="cpu")


def test_a_killed_worker_resumes_from_ram_at_the_newest_snapshot_bit_for_bit(attempts):
    # Storage saved step 4; the RAM snapshot of step 6 is newer; rank 1 died at step 7.
    for got in attempts[1]:
        r = got["newest"]
        assert (r["tier"], r["step"], r["checkpoint"], r["global_steps"]) == \
            ("ram", 6, "ram:6", 6)
        assert r["units_from"] == {"ram": 8} and r["sources"] == [6]
        assert r["bad"] == [] and r["checked"] > 80 and r["rng"]


def test_with_the_ram_tier_wiped_storage_serves_and_the_report_says_so(attempts):
    # The snapshot of step 9 was wiped with the node's RAM; storage holds step 8.
    for got in attempts[2]:
        r = got["newest"]
        assert (r["tier"], r["step"], r["checkpoint"], r["global_steps"]) == \
            ("storage", 8, "global_step8", 8)
        assert r["units_from"] == {"storage": 8} and r["bad"] == [] and r["rng"]


def test_a_named_tag_loads_that_tag_never_ram_and_abandons_later_snapshots(attempts):
    for got in attempts[2]:
        for case in ("named", "after_named"):
            r = got[case]
            assert (r["tier"], r["step"], r["checkpoint"]) == ("storage", 8, "global_step8")
            assert r["bad"] == []


def test_a_kill_during_a_snapshot_leaves_the_previous_one(attempts):
    # Rank 1 died inside its snapshot of step 12 (copied, not sealed), before the save of
    # 12: storage holds 8, and every rank takes its intact snapshot of 9, bit for bit.
    for got in attempts[3]:
        r = got["newest"]
        assert (r["tier"], r["step"], r["checkpoint"], r["global_steps"]) == \
            ("ram", 9, "ram:9", 9)
        assert r["bad"] == [] and r["checked"] > 80 and r["rng"]


def test_the_sections_ram_replicas_is_checked_like_the_managers():
    from moepec.errors import ConfigError
    from moepec.integrations.ds_ram import check_ram_fields

    pytest.importorskip("deepspeed")
    from moepec.integrations.deepspeed import _DOOR_FIELDS

    assert "ram_replicas" in _DOOR_FIELDS  # a field of the "moepec" section
    for fine in ({"ram_replicas": None}, {"ram_replicas": 0}, {"ram_replicas": 1},
                 {"ram_dir": None, "ram_replicas": 0}):
        check_ram_fields({"snapshot_every": 5, **fine})
    with pytest.raises(ConfigError, match="ram_replicas must be 0, 1 or None"):
        check_ram_fields({"snapshot_every": 5, "ram_replicas": 2})
    with pytest.raises(ConfigError, match="set ram_dir"):
        check_ram_fields({"snapshot_every": 5, "ram_dir": None, "ram_replicas": 1})
