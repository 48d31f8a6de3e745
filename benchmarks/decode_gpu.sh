#!/usr/bin/env bash
# The rollout's decode on one GPU (issue 46), one short device call per target below:
#   run(command="bash benchmarks/decode_gpu.sh ladder-check")  # the compiled, captured ladder decode against the
#                                                              # full-pool and eager decodes (debug geometry)
#   run(command="bash benchmarks/decode_gpu.sh decode")   # the decode step at each ladder size, 8 to 512 rows of a
#                                                         # pool of 64 groups x 8, 7B (meant to take under 2 minutes)
#   run(command="bash benchmarks/decode_gpu.sh decode-whole-layer")  # the same, each layer one compiled graph
# Results land in $OUT (decode-<date>-ladder.json and the log); commit the JSON under benchmarks/results/.
# DRY=1 prints the command.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:0:0
stamp=$(date -u +%Y%m%d)
case "${1:-}" in
  decode|decode-whole-layer)
    variant=(); [ "$1" = decode-whole-layer ] && variant=(--whole-layer)
    ${DRY:+echo} timeout -k 10 200 python3 benchmarks/decode_bench.py --geometry 7B --groups 64 --group 8 \
      --context 1050 --own 256 --rows 8 16 32 64 128 192 256 384 512 --steps 32 --watchdog-s 190 \
      ${variant[@]+"${variant[@]}"} --out "$OUT/$1-$stamp-ladder.json" 2>&1 | tee "$OUT/$1-$stamp.log" ;;
  ladder-check)
    ${DRY:+echo} timeout -k 10 300 python3 benchmarks/probes/ladder_gpu_check.py --watchdog-s 290 \
      --out "$OUT/decode-$stamp-ladder-check.json" 2>&1 | tee "$OUT/ladder-check-$stamp.log" ;;
  *)
    echo "usage: $0 ladder-check | decode | decode-whole-layer" >&2; exit 2 ;;
esac
