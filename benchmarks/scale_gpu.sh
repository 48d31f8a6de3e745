#!/usr/bin/env bash
# The step benchmarks of issues 18 and 19 on one H200, one device call per step below (each ends within the
# call's 10-minute limit: a timeout and scale_bench's watchdog stop it first, and the rows written so far stay):
#   run(command="bash benchmarks/scale_gpu.sh img-8-64")   # img P = 8 and 64, overlapped + decomposed (~400 s)
#   run(command="bash benchmarks/scale_gpu.sh img-8")      # img P = 8 alone, overlapped + decomposed, two warm-up
#                                                          # steps each (~170 s)
#   run(command="bash benchmarks/scale_gpu.sh img-64")     # img P = 64 alone, overlapped + decomposed, two warm-up
#                                                          # steps each (~500 s)
#   run(command="bash benchmarks/scale_gpu.sh sites-64")   # diagnostic: decomposed img P = 64, the allocator capped at
#                                                          # CAP_GIB (132.5): what is live where a step peaks above it
#   run(command="bash benchmarks/scale_gpu.sh vid-4")      # vid P = 4, overlapped + decomposed + serial (~360 s)
#   run(command="bash benchmarks/scale_gpu.sh vid-16")     # vid P = 16, overlapped + decomposed (~350 s)
#   run(command="bash benchmarks/scale_gpu.sh vid-16-pair") # vid-16 with two warm-up steps each (~400 s estimated)
#   run(command="bash benchmarks/scale_gpu.sh img-32")     # img P = 32, every mode, unbatched too (~490 s)
#   run(command="bash benchmarks/scale_gpu.sh img-32-pair") # img P = 32, overlapped + decomposed, two warm-up
#                                                          # steps each (~250 s)
#   run(command="bash benchmarks/scale_gpu.sh compact-32") # img-32-pair with --compact-decode (~320 s measured, the
#                                                          # first warm-up ~166 s); compare with img-32-pair
#   run(command="bash benchmarks/scale_gpu.sh compact-64") # img-64 with --compact-decode (~500 s estimated)
#   run(command="bash benchmarks/scale_gpu.sh compact-vid-16") # vid-16 with --compact-decode (~360 s estimated)
#   run(command="bash benchmarks/scale_gpu.sh serial-64")  # img P = 64, serial alone (~430 s measured: ~165 s a step)
#   run(command="bash benchmarks/scale_gpu.sh serial-vid-16") # vid P = 16, serial alone (~360 s measured)
#   run(command="bash benchmarks/scale_gpu.sh profile-32") # img P = 32 overlapped + decomposed, each profiled (~450 s)
#   run(command="bash benchmarks/scale_gpu.sh profile-64") # img P = 64 decomposed, profiled (~430 s)
#   run(command="bash benchmarks/scale_gpu.sh host-64")    # img P = 64 decomposed, training micro-batches 20-23 with
#                                                          # the host's events: where the GPU waits (~350 s)
#   run(command="bash benchmarks/scale_gpu.sh decode")     # the decode step at batch 64 (~100 s)
# Results land in $OUT (scale-<date>-<name>.json or decode-<date>-b64.json, a chart, the log); commit the JSON under
# benchmarks/results/ (both follow ../shared/RESULTS.md).
# Two warm-up steps: the second plans from what the first measured (held_cap_for_whole_graphs), and a batch shape
# the first did not meet compiles there rather than in the timed step.
# MODES=... overrides a step's modes (e.g. MODES=overlapped,decomposed-batched); DRY=1 prints the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:0:0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stamp=$(date -u +%Y%m%d)
common=(--repeats 1 --activation-checkpointing --ref-micro-batch 64 --max-step-s 240)
scale() {  # name workload prompts modes [more scale_bench arguments]
  local name=$1 workload=$2 prompts=$3 modes=${MODES:-$4}
  shift 4
  ${DRY:+echo} timeout -k 10 585 python benchmarks/scale_bench.py --workload "$workload" --prompts "$prompts" --modes "$modes" \
    "${common[@]}" --watchdog-s 575 --out "$OUT/scale-$stamp-$name.json" --plot "$OUT/scale-$stamp-$name.png" "$@" \
    2>&1 | tee "$OUT/scale-$stamp-$name.log"
}
case "${1:-}" in
  img-8-64) scale img-8-64 img 8,64 overlapped,decomposed --warmup modes ;;
  img-8) scale img-8 img 8 overlapped,decomposed --warmup modes --warm-up-steps 2 ;;
  img-64) scale img-64 img 64 overlapped,decomposed --warmup modes --warm-up-steps 2 ;;
  sites-64) scale img-64-sites img 64 decomposed --warmup modes --oom-sites --memory-cap-gib "${CAP_GIB:-132.5}" ;;
  vid-4) scale vid-4 vid 4 overlapped,decomposed,serial --warmup modes ;;
  vid-16) scale vid-16 vid 16 overlapped,decomposed --warmup modes ;;
  vid-16-pair) scale vid-16-pair vid 16 overlapped,decomposed --warmup modes --warm-up-steps 2 ;;
  img-32) scale img-32 img 32 overlapped,decomposed,serial,decomposed-unbatched --warmup modes ;;
  img-32-pair) scale img-32-pair img 32 overlapped,decomposed --warmup modes --warm-up-steps 2 ;;
  compact-32) scale img-32-compact img 32 overlapped,decomposed --warmup modes --warm-up-steps 2 --compact-decode ;;
  compact-64) scale img-64-compact img 64 overlapped,decomposed --warmup modes --warm-up-steps 2 --compact-decode ;;
  compact-vid-16) scale vid-16-compact vid 16 overlapped,decomposed --warmup modes --compact-decode ;;
  serial-64) scale img-64-serial img 64 serial --warmup modes ;;
  serial-vid-16) scale vid-16-serial vid 16 serial --warmup modes ;;
  profile-32) scale profile-32 img 32 overlapped,decomposed --warmup modes --profile 32:overlapped,decomposed ;;
  profile-64) scale profile-64 img 64 decomposed --warmup modes --profile 64:decomposed ;;
  host-64) scale host-64 img 64 decomposed --warmup modes --host-profile 64:decomposed:20:4 ;;
  decode)
    ${DRY:+echo} timeout -k 10 300 python benchmarks/decode_bench.py --geometry 7B --batch 64 --group 1 --context 2048 --steps 64 \
      --watchdog-s 290 --out "$OUT/decode-$stamp-b64.json" 2>&1 | tee "$OUT/decode-$stamp.log" ;;
  *)
    echo "usage: $0 img-8-64 | img-8 | img-64 | sites-64 | vid-4 | vid-16 | vid-16-pair | img-32 | img-32-pair | profile-32 |" \
      "compact-32 | compact-64 | compact-vid-16 | serial-64 | serial-vid-16 | profile-64 | host-64 | decode" >&2; exit 2 ;;
esac
