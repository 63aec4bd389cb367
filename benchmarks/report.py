"""Benchmark script: see moepec/bench/report.py (also `moepec bench report`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moepec.bench.report import main  # noqa: E402

if __name__ == "__main__":
    main()
