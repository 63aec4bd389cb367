"""The restore benchmark runs both sides in one run and reports their ratio."""

import logging

from moepec.bench.restore import run


def test_restore_benchmark_times_both_and_reports_the_ratio(caplog):
    caplog.set_level(logging.INFO, logger="moepec")
    (row,) = run([4], repeats=1)
    # no warning of its own making (issue 50: each restore took over the root the one
    # before it had released)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert row["experts"] == 4 and row["view_checkpoints"] == 4  # K=1: one per expert
    assert row["stitched_restore_s"] > 0 and row["dcp_load_full_s"] > 0
    assert abs(row["ratio"] - row["stitched_restore_s"] / row["dcp_load_full_s"]) < 1e-9
