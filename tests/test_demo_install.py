"""`make demo` installs only what the demo needs (issue 35.6): the demo's code imports no
framework of the test extras, and the Makefile's two stamps install each set once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SKIPPED = ("transformers", "accelerate", "megatron", "torchtitan", "datasets", "tyro",
           "torchdata", "tokenizers")
"""What `make test` installs and `make demo` does not (triton is left out: torch itself
imports it where it is installed)."""


def test_the_demo_imports_no_framework_of_the_test_extras():
    code = (
        "import sys\n"
        "import moepec.cli.main as m, moepec.cli.demo, moepec.cli.demo_report\n"
        "import moepec.cli.demo_compare\n"
        "import moepec.bench.ft, moepec.train.trainer, moepec.train.setup\n"
        "import moepec.train.replicas, moepec.integrations.torchft\n"
        "m.build_parser()\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {SKIPPED!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_then_test_then_demo_installs_each_set_once(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)  # a venv exists: only pip is to be called

    def make(target: str) -> str:
        return subprocess.run(
            ["make", "--no-print-directory", "-s", "-C", str(REPO), f"VENV={venv}",
             "PIP=echo PIP", str(venv / target)],
            capture_output=True, text=True, timeout=60, check=True).stdout

    demo = make(".moepec-demo-installed")
    lines = demo.splitlines()
    assert lines[0].startswith("moepec: installing torch 2.13.0 (CPU), moepec and torchft")
    assert "a few minutes" in lines[0]
    assert lines[1:] == ["PIP torch==2.13.0", "PIP -e .[ft]"]
    full = make(".moepec-installed")  # make test after make demo: the rest only
    assert "torch==2.13.0" not in full
    assert "PIP -e .[dev,hf,ft,megatron,titan-deps,deepspeed,lightning]" in full
    assert "torchtitan==0.3.0" in full and "megatron-core==0.16.1" in full
    assert make(".moepec-demo-installed") == ""  # make demo after make test: nothing
    assert make(".moepec-installed") == ""
