"""The results report end to end at --quick settings: every section, plot and number."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moepec.bench.render import SECTIONS
from moepec.bench.report import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _section(md: str, title: str) -> str:
    start = md.index(f"## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start:] if end < 0 else md[start:end]


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~60 s of CPU in this process: 300 s ran out at load 10
def test_report_quick_end_to_end(tmp_path: Path) -> None:
    result = main(["--quick", "--out", str(tmp_path)])
    md = (tmp_path / "results.md").read_text()
    data = json.loads((tmp_path / "results.json").read_text())

    # every section, in order
    positions = [md.index(f"## {title}\n") for title in SECTIONS]
    assert positions == sorted(positions)

    # every referenced image exists and is a PNG; every written plot is referenced
    referenced = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(referenced) == 5 and sorted(referenced) == sorted(data["images"])
    for rel in referenced:
        png = (tmp_path / rel).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 1000, rel

    # the headline numbers in the markdown are the JSON's
    head = _section(md, SECTIONS[0])
    assert data["headline"] == json.loads(json.dumps(result["headline"]))
    assert len(data["headline"]) >= 5
    for item in data["headline"]:
        line = next(ln for ln in head.splitlines() if ln.startswith(f"- **{item['label']}**"))
        assert line == f"- **{item['label']}**: {item['text']}"
        shown = [float(x) for x in NUMBER.findall(line.split("**: ", 1)[1])]
        for value in item["values"]:
            if value is not None:
                assert any(abs(x - value) < 1e-9 for x in shown), (value, line)

    # the quality verdict is computed from the numbers in the table
    quality = data["quality"]
    full = next(r for r in quality["runs"] if r["name"].startswith("full"))
    for run in quality["runs"]:
        assert run["within_tolerance"] == (run["val_loss"] / full["val_loss"] - 1 <= 0.01)
        assert f"{run['val_loss']:.4f}" in _section(md, SECTIONS[4])
    # full-checkpoint recovery loses nothing; PEC K=1 with faults loses something
    by = {r["name"]: r for r in quality["runs"]}
    assert by["full recovery (K=8)"]["plt"] == 0.0
    assert by["PEC K=1 sequential"]["plt"] > 0.0
    assert len(by["PEC K=1 sequential"]["recoveries"]) == len(quality["faults"])
    # the PLT cross-check uses real runs and the simulation agrees with the formula's shape
    assert any("measured" in c["source"] for c in data["plt"]["checks"])
    assert {"cpu", "cores", "torch", "moepec"} <= set(data["machine"])
