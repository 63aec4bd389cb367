"""A user's mistakes on the command line end in one line that names the fix: never a
traceback, never "please report it" (which is for moepec's own bugs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def moepec(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moepec", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def one_line(p: subprocess.CompletedProcess, rc: int, *words: str) -> str:
    err = p.stderr.strip()
    assert p.returncode == rc, (p.returncode, err[-2000:])
    assert "Traceback" not in err and "please report it" not in err, err[-2000:]
    last = err.splitlines()[-1]
    assert all(w in last for w in words), last
    return last


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "ck"
    p = moepec("train", "--config", "tiny", "--steps", "4", "--ckpt-interval", "2",
               "--ckpt-dir", str(root), "--ram-dir", "none", "--no-progress", cwd=root.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    return root


def test_a_dcp_export_onto_a_file_says_so_in_one_line(trained, tmp_path):
    (tmp_path / "afile").write_text("mine")
    one_line(moepec("export", str(trained), "afile", cwd=tmp_path), 1, "FileExistsError",
             "afile", "a new folder")
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_empty_output_path_is_refused(trained, tmp_path):
    one_line(moepec("export", str(trained), "", cwd=tmp_path), 2, "output path is empty")


def test_a_rank_variable_that_is_no_rank_is_refused(tmp_path):
    one_line(moepec("model-info", cwd=tmp_path, env={"RANK": "abc"}), 2, "RANK='abc'",
             "torchrun")


@pytest.mark.parametrize("port", ["-1", "70000", "http"])
def test_a_lighthouse_port_out_of_range_is_a_usage_error(tmp_path, port):
    p = moepec("lighthouse", "--port", port, cwd=tmp_path)
    assert p.returncode == 2 and "is not a port (0-65535" in p.stderr, p.stderr[-2000:]


def test_a_lighthouse_port_in_use_names_the_fix(tmp_path):
    pytest.importorskip("torchft")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line(moepec("lighthouse", "--port", str(port), cwd=tmp_path), 2,
                 f"port {port} is in use", "--port 0")


@pytest.mark.parametrize("code, words", [
    ("def build():\n    raise RuntimeError('boom')\n", ["build() failed", "boom", "your code"]),
    ("def build(width):\n    pass\n", ["needs arguments", "no arguments"]),
    ("def build(:\n", ["failed to load", "SyntaxError", "line 1", "your code"]),
    ("import not_a_package_anywhere\n", ["failed to load", "not_a_package_anywhere",
                                         "your code"]),
])
def test_an_error_in_the_users_model_code_is_theirs_in_one_line(tmp_path, code, words):
    (tmp_path / "m.py").write_text(code)
    one_line(moepec("experts", "m.py:build", cwd=tmp_path), 2, *words)


def test_a_hugging_face_config_with_a_bad_field_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": "x", "num_hidden_layers": 2, "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 16, "vocab_size": 32}))
    one_line(moepec("simulate", "--hf-config", "config.json", cwd=tmp_path), 2,
             "config.json", "not the number")


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_a_benchmark_run_zero_times_is_a_usage_error(tmp_path, repeats):
    p = moepec("bench", "overhead", "--repeats", repeats, cwd=tmp_path)
    assert p.returncode == 2 and "at least 1" in p.stderr, p.stderr[-2000:]


def test_one_checkpoint_given_for_its_root_names_the_root(trained, tmp_path):
    one = next(p for p in sorted(trained.iterdir()) if p.name.startswith("ckpt-"))
    for command in ("inspect", "verify"):
        one_line(moepec(command, str(one), cwd=tmp_path), 2, "one checkpoint of the root",
                 str(trained))


def test_a_plain_dcp_checkpoint_is_named_as_one(trained, tmp_path):
    p = moepec("export", str(trained), "plain", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    one_line(moepec("inspect", "plain", cwd=tmp_path), 2, "plain DCP checkpoint")
