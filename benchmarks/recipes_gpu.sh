#!/usr/bin/env bash
# The shipped recipes on one GPU through run_train.sh (benchmarks/recipes.py), one device call per target below,
# each ending within the call's 10-minute limit (a timeout stops it first; the rows written so far stay).
#
# On the dev machine first (once), the Python packages the recipes need beyond the GPU image (its pip list has no
# datasets, PyAV, math-verify or TensorBoard), kept out of git:
#   bash benchmarks/recipes_gpu.sh wheels          # writes .whl1 (TensorBoard, PyAV), .whl2 (datasets, math-verify)
# Then, with the folder each target needs carried (each installs what the image lacks into /tmp/site, kept while
# the machine stays warm):
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/recipes_gpu.sh 7b")
#       # qwen2_5_vl_7b with model.compile on (3 steps, save, resume + export), then the scale_bench row of the same
#       # settings (the benchmark is the product: both from run_train.sh, side by side)
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/recipes_gpu.sh 7b-off-3b")
#       # qwen2_5_vl_7b with model.compile off (3 steps), qwen2_5_vl_3b (the cycle)
#   run(carry=[".whl1"], needs_h200=true, command="bash benchmarks/recipes_gpu.sh video")   # video_reasoning_7b
#   run(carry=[".whl1"], kind="nvidia-h100-x1", command="bash benchmarks/recipes_gpu.sh 3b")  # qwen2_5_vl_3b alone,
#       # on an 80 GB H100 too
#   run(carry=[".whl2"], needs_h200=true, command="bash benchmarks/recipes_gpu.sh parquet") # clevr_count_7b,
#                                                                                            # geometry3k_7b
# RECIPES_S (seconds for a target's runs) and RECIPES_ARGS (more recipes.py arguments, e.g. "--no-cycle") fit a
# target into the device time left: RECIPES_S=300 RECIPES_ARGS=--no-cycle bash benchmarks/recipes_gpu.sh 3b
# Results land in $OUT (recipes-<date>-<target>.json, scale-<date>-<target>.json, the logs); commit the JSON under
# benchmarks/results/ (../shared/RESULTS.md).
#
# Where things go: the input checkpoints and run folders (HF exports) in memory (/dev/shm when it has 40 GB free),
# training checkpoints on the disk (a 7B checkpoint with its AdamW state is ~50 GB, the machine's disk 64 GB);
# recipes.py checks the room first.
# What differs from the recipes, for the device-time budget of a call: 16 prompts per step, 512 new tokens at most,
# 16 eval prompts (SET below; recorded in every row).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
SITE=/tmp/site
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:0:0 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
stamp=$(date -u +%Y%m%d)
SET=(--set data.prompts_per_step=16 --set rollout.max_new_tokens=512 --set data.eval_prompts=16)
MEM=/dev/shm
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 40 ] 2>/dev/null || MEM=/tmp
PLACES=(--ckpt-root "$MEM/ckpt" --work "$MEM/recipes" --save-root /tmp/recipes-save)

install() {  # the carried wheels whose package the image lacks
  local dir=$1; shift
  local missing=()
  for spec in "$@"; do  # module=wheel-name prefix
    python3 -c "import ${spec%%=*}" 2>/dev/null || missing+=("$dir/${spec#*=}"-*.whl)
  done
  if [ ${#missing[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${missing[@]}"
  fi
  python3 - <<'EOF'
import importlib, torch
for name in ("tensorboard", "absl", "av", "datasets", "pyarrow", "math_verify", "transformers"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as err:
        print(f"{name} missing: {err}")
print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
EOF
  df -h / /tmp /dev/shm | sed 's/^/    /'; free -g | sed 's/^/    /'
}

recipes() {  # target, then recipes.py arguments
  local target=$1; shift
  timeout -k 10 "${RECIPES_S:-560}" python3 benchmarks/recipes.py "${SET[@]}" "${PLACES[@]}" \
    --run-timeout-s "${RECIPES_S:-560}" \
    --watchdog-s "${RECIPES_S:-560}" --out "$OUT/recipes-$stamp-$target.json" "$@" ${RECIPES_ARGS:-} 2>&1 \
    | tee -a "$OUT/recipes-$target.log" || true
}

keep_logs() {  # every run's own log, one archive ($OUT takes few files)
  tar czf "$OUT/runlogs-$1.tgz" -C "$MEM" $(cd "$MEM" && ls -d recipes/*.log scale/*.log 2>/dev/null) 2>/dev/null || true
}
trap 'keep_logs "${1:-none}"' EXIT

case "${1:-}" in
  wheels)  # on the dev machine: the packages for CPython 3.12 manylinux (the GPU image's)
    dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
    dl .whl1 tensorboard==2.21.0 absl-py av==19.0.2 protobuf
    dl .whl2 datasets==5.2.0 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash fsspec==2026.9.0 \
      math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
    printf '/.whl1/\n/.whl2/\n' >> "$(git rev-parse --git-common-dir)/info/exclude"
    du -sh .whl1 .whl2 ;;
  7b)
    install .whl1 tensorboard=tensorboard absl=absl_py google.protobuf=protobuf
    RECIPES_S=400 recipes 7b --recipe qwen2_5_vl_7b --compile on
    timeout -k 10 150 python3 benchmarks/scale_bench.py --config train_configs/qwen2_5_vl_7b.toml --workload img \
      --prompts 16 --modes decomposed --repeats 2 --set model.compile=true "${SET[@]}" --work "$MEM/scale" \
      --ckpt-root "$MEM/ckpt" --watchdog-s 145 --out "$OUT/scale-$stamp-7b-recipe.json" 2>&1 | tee -a "$OUT/scale-7b.log" ;;
  7b-off-3b)
    install .whl1 tensorboard=tensorboard absl=absl_py google.protobuf=protobuf
    RECIPES_S=200 recipes 7b-off --recipe qwen2_5_vl_7b --compile off --no-cycle
    RECIPES_S=360 recipes 3b --recipe qwen2_5_vl_3b ;;
  3b)  # fits an 80 GB card as shipped (the 40 GiB KV pool included: tests/test_memory_estimate.py)
    install .whl1 tensorboard=tensorboard absl=absl_py google.protobuf=protobuf
    RECIPES_S=${RECIPES_S:-560} recipes 3b --recipe qwen2_5_vl_3b ;;
  video)
    install .whl1 tensorboard=tensorboard absl=absl_py google.protobuf=protobuf av=av
    recipes video --recipe video_reasoning_7b ;;
  parquet)
    install .whl2 pyarrow=pyarrow datasets=datasets dill=dill multiprocess=multiprocess xxhash=xxhash fsspec=fsspec \
      math_verify=math_verify latex2sympy2_extended=latex2sympy2_extended antlr4=antlr4_python3_runtime
    recipes parquet --recipe clevr_count_7b --recipe geometry3k_7b ;;
  *)
    echo "usage: $0 wheels | 7b | 7b-off-3b | 3b | video | parquet" >&2; exit 2 ;;
esac
