#!/usr/bin/env bash
# Megatron-Core 0.16.1's dist_checkpointing unit tests on CPU/gloo: stock torch_dist vs
# moepec's ("moepec", 1). Fetches nothing.
#
#   benchmarks/megatron_upstream/run.sh MEGATRON_LM_DIR [driver.py options] [FILE ...]
#
# MEGATRON_LM_DIR: an extracted Megatron-LM tree at tag core_v0.16.1 holding tests/ and
# megatron/{training,rl,post_training,legacy} (see README.md). Results: --out DIR
# (default /tmp/megatron_upstream_results): summary.md, summary.json, raw.json, and per
# backend and file the ranks' records and pytest.log.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -d "$1/tests/unit_tests/dist_checkpointing" ]; then
  echo "usage: $0 MEGATRON_LM_DIR [--nproc 4] [--timeout 180] [--out DIR] [-k EXPR] [FILE ...]" >&2
  exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
MEGATRON="$1"; shift
exec "$PY" "$HERE/driver.py" --megatron "$MEGATRON" "$@"
