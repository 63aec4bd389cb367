"""The source checkout that the framework benchmarks need.

``moepec bench megatron`` and ``moepec bench torchtitan`` run on CPU through the shims the
tests use (``tests/megatron_shims.py``, ``tests/titan_shims.py``, ``tests/titan_launch.py``),
which an installed wheel does not carry: these benchmarks run from a clone of the repository
(``pip install -e .``), as the tests do.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root, when this moepec is imported from one."""


def tests_dir(needs: str) -> Path:
    """The checkout's ``tests/`` folder, which must hold ``needs``; exits with one line
    saying so when this moepec is not imported from a source checkout."""
    tests = REPO / "tests"
    if not (tests / needs).is_file():
        raise SystemExit(f"this benchmark needs a source checkout of moepec ({tests / needs} "
                         "not found): clone the repository, `pip install -e .`, run it there")
    return tests
