"""A manual check, outside the suite (about 4 minutes on 2 cores): torchtitan's real
Trainer started from a stock DCP checkpoint of another run (``initial_load_path``, model
only), once with torchtitan's own checkpoint manager and once with moepec's; the first
losses must be equal (and differ from a fresh start's).

    python tests/titan_initial_load.py [WORKDIR]

Run A (stock, 2 steps) writes ``step-2``; B (stock) and C (moepec, through ``use_pec``)
start from it for 3 steps; D is a fresh start. Prints each run's losses, then ``EQUAL``
or ``DIFFER``; exits 1 on ``DIFFER``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_assets import OVERRIDE, life_command, write_assets  # noqa: E402

STOCK = ["--module", "titan_shims", "--config", "deepseek_v3_tiny"]


def life(work: Path, assets: tuple[str, str], name: str, steps: int, args: list[str]):
    """One single-process Trainer run; returns its (step, loss) lines."""
    tmp = work / name
    tmp.mkdir()
    cmd, env = life_command(tmp, assets, 1, steps, args)
    env["TITAN_DUMP"] = ""  # no state dumps: the stock manager has no loader_state
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    losses = re.findall(r"step:\s*(\d+).*?loss:\s*([-0-9.e+]+)", text)
    print(name, "rc", proc.returncode, losses, flush=True)
    if proc.returncode:
        sys.exit(text[-4000:])
    return losses


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="titan-init-"))
    assets = write_assets(str(work / "assets"))
    life(work, assets, "A", 2, STOCK + ["--checkpoint.no-last_save_model_only"])
    src = str(work / "A" / "run" / "checkpoint" / "step-2")
    stock = life(work, assets, "B_stock", 3, STOCK + ["--checkpoint.initial_load_path", src])
    ours = life(work, assets, "C_moepec", 3, OVERRIDE + ["--checkpoint.initial_load_path",
                                                         src])
    fresh = life(work, assets, "D_fresh", 3, STOCK)
    same = bool(stock) and stock == ours and stock != fresh
    print("EQUAL" if same else "DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
