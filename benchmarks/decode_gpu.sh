#!/usr/bin/env bash
# The rollout's decode on one GPU (issue 46), one short device call per target below:
#   run(command="bash benchmarks/decode_gpu.sh decode")   # the decode step at each ladder size, 8 to 512 rows of a
#                                                         # pool of 64 groups x 8, 7B (meant to take under 2 minutes)
# Results land in $OUT (decode-<date>-ladder.json and the log); commit the JSON under benchmarks/results/.
# DRY=1 prints the command.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:0:0
stamp=$(date -u +%Y%m%d)
case "${1:-}" in
  decode)
    ${DRY:+echo} timeout -k 10 200 python3 benchmarks/decode_bench.py --geometry 7B --groups 64 --group 8 \
      --context 1050 --own 256 --rows 8 16 32 64 128 192 256 384 512 --steps 32 --watchdog-s 190 \
      --out "$OUT/decode-$stamp-ladder.json" 2>&1 | tee "$OUT/decode-$stamp.log" ;;
  *)
    echo "usage: $0 decode" >&2; exit 2 ;;
esac
