"""The restore benchmark runs both sides in one run and reports their ratio."""

from moepec.bench.restore import run


def test_restore_benchmark_times_both_and_reports_the_ratio():
    (row,) = run([4], repeats=1)
    assert row["experts"] == 4 and row["view_checkpoints"] == 4  # K=1: one per expert
    assert row["stitched_restore_s"] > 0 and row["dcp_load_full_s"] > 0
    assert abs(row["ratio"] - row["stitched_restore_s"] / row["dcp_load_full_s"]) < 1e-9
