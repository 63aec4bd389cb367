"""Command line: model-info, train, demo, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moepec.cli import main as cli
from moepec.cli.demo import format_summary
from moepec.train.trainer import TrainConfig, train

REPO = Path(__file__).resolve().parents[1]
TINY = ["train", "--config", "tiny", "--no-progress", "--threads", "1"]


def test_model_info_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model-info"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "small", "gpt-125m-8e", "gpt-350m-16e"):
        assert name in out
    assert "322.82M" in out and "non-expert" in out

    assert cli.main(["model-info", "--config", "gpt-125m-8e", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert abs(info["total"] - 323e6) / 323e6 < 0.005
    assert info["expert"] + info["non_expert"] == info["total"]
    assert info["checkpoint_bytes"] == info["total"] * 12  # fp32 weights + 2 Adam moments


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("moepec: error:")]
    assert len(errors) == 1 and match in errors[0], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("argv, match", [
    (["model-info", "--config", "gpt-9000"], "valid names: tiny"),
    (TINY[:2] + ["bogus"], "unknown model config 'bogus'"),
    (TINY + ["-O", "vocab_size=128"], "vocab mismatch"),
    (TINY + ["-O", "top_k=5"], "top_k"),
    # a mistake in a flag names the flag typed, not the config field behind it
    (TINY + ["--ckpt-dir", "unused", "--k", "9"], "need 1 <= --k (9) <= --k-snapshot (9)"),
    (TINY + ["--batch-size", "0"], "--batch-size must be >= 1"),
    (TINY + ["--ckpt-dir", "unused", "--selection", "bogus"],
     "unknown --selection 'bogus'; choose one of sequential, load_aware"),
    (TINY + ["--selection", "bogus"], "unknown --selection 'bogus'"),  # checked without a dir
    (TINY + ["--device", "tpu"], "unknown device 'tpu'; choose one of auto, cpu, cuda"),
    (TINY + ["--on-persist-error", "ignore"], "unknown --on-persist-error 'ignore'"),
])
def test_config_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                    match: str) -> None:
    _one_line_error(capsys, argv, match)


def test_checkpoint_flags_map_onto_one_checkpoint_config() -> None:
    from moepec import CheckpointConfig

    argv = TINY + ["--ckpt-dir", "d", "--ckpt-interval", "5", "--k", "2", "--k-snapshot", "3",
                   "--selection", "load_aware", "--ckpt-sync", "--dist-timeout", "30"]
    cfg = cli.train_config_from_args(cli.build_parser().parse_args(argv))
    assert cfg.checkpoint == CheckpointConfig(
        path="d", interval=5, k_persist=2, k_snapshot=3, selection="load_aware",
        async_snapshot=False, async_persist=False, timeout_s=30.0)
    assert cfg.dist_timeout_s == 30.0
    assert cfg == TrainConfig(config="tiny", progress=False, threads=1, dist_timeout_s=30.0,
                              checkpoint=cfg.checkpoint)
    # No --ckpt-dir: no checkpoints. Every other default is the config classes' own.
    plain = cli.train_config_from_args(cli.build_parser().parse_args(TINY))
    assert plain.checkpoint is None
    assert plain == TrainConfig(config="tiny", progress=False, threads=1)
    args = cli.build_parser().parse_args(TINY + ["--ckpt-dir", "d"])
    assert cli.checkpoint_config_from_args(args) == CheckpointConfig(
        path="d", timeout_s=TrainConfig(config="tiny").dist_timeout_s)


def test_data_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _one_line_error(capsys, TINY + ["--data", str(tmp_path / "missing*.txt")],
                    "matches no files")
    (tmp_path / "empty.txt").write_text("")
    _one_line_error(capsys, TINY + ["--data", str(tmp_path / "empty.txt")], "only empty files")
    (tmp_path / "short.txt").write_text("print('hi')\n")
    _one_line_error(capsys, TINY + ["--data", str(tmp_path / "short.txt")],
                    "fewer than one sequence")


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--steps", "many"]) == 2
    assert cli.main([]) == 2
    capsys.readouterr()


def test_train_on_a_glob(capsys: pytest.CaptureFixture[str], text_files: Path,
                         tmp_path: Path) -> None:
    jsonl = tmp_path / "m.jsonl"
    argv = TINY + ["--steps", "4", "--batch-size", "4", "--data", str(text_files / "**/*.txt"),
                   "--jsonl", str(jsonl), "-O", "top_k=2", "--log-interval", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "first train loss" in out and "val loss" in out
    assert [json.loads(x)["step"] for x in jsonl.read_text().splitlines()] == [0, 1, 2, 3]


def test_every_registered_command_has_help() -> None:
    assert {"train", "model-info", "demo"} <= set(cli.COMMANDS)
    for name in cli.COMMANDS:
        assert cli.main([name, "--help"]) == 0


def test_train_summary(tmp_path: Path) -> None:
    result = train(TrainConfig(config="tiny", steps=3, batch_size=4, threads=1,
                               progress=False, out_dir=str(tmp_path)))
    text = format_summary(result)
    assert "tokens/s" in text and "val loss" in text
    assert (tmp_path / "summary.json").exists() and (tmp_path / "metrics.jsonl").exists()


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "moepec", "model-info", "--config", "small"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "small" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "moepec", "train", "--config", "nope"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("moepec: error: unknown model config 'nope'")
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("serialization, stock_readable", [("torch_save", True), ("raw", False)])
def test_train_ckpt_serialization_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                       serialization: str, stock_readable: bool) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from moepec.store.dcp_raw import RAW_DESCRIPTOR
    from moepec.store.storage import Storage

    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--steps", "4", "--batch-size", "2", "--ckpt-dir", str(ckpt),
                   "--ckpt-interval", "2", "--ckpt-serialization", serialization]
    assert cli.main(argv) == 0
    capsys.readouterr()
    names = Storage(str(ckpt)).committed()
    assert len(names) == 3  # steps 1 and 3, and the complete checkpoint of the last step
    md = FileSystemReader(str(ckpt / names[-1])).read_metadata()
    raw = [RAW_DESCRIPTOR in (i.transform_descriptors or ()) for i in md.storage_data.values()]
    assert raw and all(r != stock_readable for r in raw)
    _one_line_error(capsys, TINY + ["--ckpt-dir", str(ckpt), "--ckpt-serialization", "zip"],
                    "unknown --ckpt-serialization")


@pytest.mark.parametrize("policy, fault_step, code, newest", [
    ("continue", 5, 0, "step 3 (ckpt-000001-step00000003"),  # storage full to the end
    ("stop", 7, 2, None),  # only the final persist fails
])
def test_exit_status_of_a_failed_final_persist_follows_on_persist_error(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, policy: str, fault_step: int,
        code: int, newest: str | None) -> None:
    from moepec.store.storage import Storage
    from moepec.train.faults import FaultyFileSystem

    argv = TINY + ["--steps", "8", "--batch-size", "2", "--eval-batches", "0",
                   "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval", "2",
                   "--out-dir", str(tmp_path), "--on-persist-error", policy,
                   # synchronous: the persist before the fault has finished when it starts
                   "--ckpt-sync",
                   "--faults", f"enospc@{fault_step}"]  # storage fails from then to the end
    capsys.readouterr()
    try:
        assert cli.main(argv) == code
    finally:
        FaultyFileSystem.mode = None
    err = capsys.readouterr().err
    assert "Traceback" not in err
    committed = [n for n in Storage(str(tmp_path / "ckpt")).committed()]
    assert f"-step{fault_step - 2:08d}-" in committed[-1]  # the last before the fault
    if newest is None:
        assert "moepec: error: checkpoint persist failed" in err and "No space left" in err
    else:
        final = [x for x in err.splitlines() if "the run ends" in x]
        assert len(final) == 1 and "WARNING" in final[0], err
        assert f"the newest committed checkpoint is {newest}-" in final[0]
        assert "No space left" in err
