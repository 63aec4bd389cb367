"""Benchmark script: see moepec/bench/size.py (also `moepec bench size`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moepec.bench.size import main  # noqa: E402

if __name__ == "__main__":
    main()
