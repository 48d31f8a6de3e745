#!/usr/bin/env bash
# The step benchmarks at real batch sizes on one H200, through run_train.sh (benchmarks/scale_bench.py: the 7B
# recipe's TOML, the reference workloads of ../shared/WORKLOADS.md), one device call per target below, each ending
# within the call's 10-minute limit (a timeout stops it first; the rows written so far stay):
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/scale_gpu.sh img-32")  # decomposed, overlapped
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/scale_gpu.sh img-64")  # decomposed, overlapped
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/scale_gpu.sh serial-32")   # serial alone
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/scale_gpu.sh serial-64")
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/scale_gpu.sh vid-16")  # decomposed, overlapped
# Issue 49 (topic microbatch), on one H100 or H200: the 3B recipe on 4 img prompts x G = 8 with exactly 256 response
# tokens, serial, decomposed and overlapped, each with the micro-batch token budgets the planner picks from the
# memory budget: the card's memory (microbatch), then one peak-memory cap shared by the three (microbatch-cap:
# memory.budget_gib = CAP_GIB, 48 by default). A call that would pass its limit splits with MODES (the rows of
# microbatch-serial then come in a file of their own):
#   run(carry=[".whl1"], command="bash benchmarks/scale_gpu.sh microbatch")
#   run(carry=[".whl1"], command="bash benchmarks/scale_gpu.sh microbatch-cap")
#   run(carry=[".whl1"], command="MODES=serial bash benchmarks/scale_gpu.sh microbatch")   # a split, if needed
# (.whl1: TensorBoard, which the recipe logs to and the GPU image lacks: benchmarks/recipes_gpu.sh wheels.)
# Results land in $OUT (<topic>-<date>-<target>.json, a chart, the log); commit the JSON under benchmarks/results/.
# MODES=... overrides a target's modes; SET="key=value ..." adds config overrides; DRY=1 prints the command.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
SITE=/tmp/site
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:0:0 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
for module in tensorboard absl; do
  python3 -c "import $module" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target "$SITE" .whl1/tensorboard-*.whl .whl1/absl_py-*.whl
done
MEM=/dev/shm
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 20 ] 2>/dev/null || MEM=/tmp
stamp=$(date -u +%Y%m%d)
sets=()
for kv in ${SET:-}; do sets+=(--set "$kv"); done
scale() {  # name workload prompts modes [more scale_bench arguments]; TOPIC=... names the results (scale)
  local name=$1 workload=$2 prompts=$3 modes=${MODES:-$4} topic=${TOPIC:-scale}
  shift 4
  ${DRY:+echo} timeout -k 10 585 python3 benchmarks/scale_bench.py --workload "$workload" --prompts "$prompts" \
    --modes "$modes" --work "$MEM/scale" --watchdog-s 580 --run-timeout-s 570 --topic "$topic" \
    --out "$OUT/$topic-$stamp-$name.json" --plot "$OUT/$topic-$stamp-$name.png" "${sets[@]}" "$@" 2>&1 \
    | tee "$OUT/$topic-$stamp-$name.log"
}
microbatch() {  # name budget_gib: issue 49's shape on the 3B recipe, the KV pool sized from the budget
  local name=$1
  [ -n "${MODES:-}" ] && name="$name-${MODES//,/-}"
  TOPIC=microbatch scale "$name" img-256 4 serial,decomposed,overlapped --config train_configs/qwen2_5_vl_3b.toml \
    --budgets "$2" --set rollout.kv_pool_gib=0
}
case "${1:-}" in
  img-8) scale img-8 img 8 decomposed,overlapped,serial ;;
  img-32) scale img-32 img 32 decomposed,overlapped ;;
  img-64) scale img-64 img 64 decomposed,overlapped ;;
  serial-32) scale img-32-serial img 32 serial --repeats 1 ;;
  serial-64) scale img-64-serial img 64 serial --repeats 1 ;;
  vid-16) scale vid-16 vid 16 decomposed,overlapped ;;
  serial-vid-16) scale vid-16-serial vid 16 serial --repeats 1 ;;
  microbatch) microbatch 3b-img256 0 ;;
  microbatch-cap) microbatch "3b-img256-cap${CAP_GIB:-48}" "${CAP_GIB:-48}" ;;
  *)
    echo "usage: $0 img-8 | img-32 | img-64 | serial-32 | serial-64 | vid-16 | serial-vid-16 | microbatch" \
      "| microbatch-cap" >&2; exit 2 ;;
esac
