#!/usr/bin/env bash
# The SGLang backend on the H200 machine (issue 20), one device call per step below, in this order.
#
# On the dev machine first (once): fetch the wheels into the repo root and keep them out of git:
#   ../shared/gpu/sglang-wheels.sh .            # writes .sgl1 .sgl2 .sgl3 (< 60 MiB each)
#   printf '/.sgl1/\n/.sgl2/\n/.sgl3/\n' >> "$(git rev-parse --git-common-dir)/info/exclude"
# A device call carries at most 64 MiB, so each folder travels in its own call, installed into /tmp/site
# (kept while the machine stays warm; a fresh machine needs the three installs again):
#   run(carry=[".sgl1"], command="bash benchmarks/sglang_gpu.sh install 1")
#   run(carry=[".sgl2"], command="bash benchmarks/sglang_gpu.sh install 2")
#   run(carry=[".sgl3"], command="bash benchmarks/sglang_gpu.sh install 3")
# Then (each well under the 10-minute limit of a call):
#   run(command="bash benchmarks/sglang_gpu.sh check")   # SGLang and the transformers it needs import
#   run(command="bash benchmarks/sglang_gpu.sh train")   # GRPO steps, both backends -> $OUT/sglang-*-train.json
#   run(command="bash benchmarks/sglang_gpu.sh step")    # img-small + img P=8, both backends -> $OUT/sglang-*-step.json
#   run(command="RUN_S=400 bash benchmarks/sglang_gpu.sh overlap plain")  # prefix work beside SGLang's decode,
#   run(command="RUN_S=400 bash benchmarks/sglang_gpu.sh overlap mps")    # without / with MPS, one call each
#                                                        # -> $OUT/sglang-*-overlap.json, -overlap-mps.json
# and commit the JSON files that come back under benchmarks/results/.
# SGLang 0.5.17 imports only with transformers 5.12.1 / tokenizers 0.22.2 (in .sgl2): /tmp/site goes first on
# PYTHONPATH, ahead of the image's 5.17.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
# SGLang's TokenizerManager turns SIGTERM into a graceful drain that a hung scheduler never finishes: -k sends
# SIGKILL (GNU timeout signals its whole process group, the scheduler and detokenizer processes included) so a
# hang ends the call with an error well before the device call's 10-minute limit
bounded() { timeout -k 20 "$@"; }
# check + train share one device call (600 s): train gets what check (~30 s: the import) leaves, and one
# rollout SGLang does not answer in SGL_TIMEOUT_S fails its row (JSON kept) instead of reaching the kill
RUN_S=${RUN_S:-480}
SGL_TIMEOUT_S=${SGL_TIMEOUT_S:-120}
export PYTHONUNBUFFERED=1  # rows printed as they finish, even when the process is killed
# SGLang's memory saver refuses expandable segments (its scheduler dies at start-up): never inherit them here
unset PYTORCH_CUDA_ALLOC_CONF
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%d)
tiny() {  # the trainer's tiny checkpoint (few MB), written once per machine
  [ -f /tmp/tiny/config.json ] || bounded 120 python tools/make_tiny_checkpoint.py --output /tmp/tiny >/dev/null
}
ckpt7b() {  # the 7B geometry without weights (the overlap probe: random-init models, SGLang's dummy load), seconds
  [ -f /tmp/ckpt7b/config.json ] || bounded 120 python tools/make_tiny_checkpoint.py --size 7B --no-weights \
    --output /tmp/ckpt7b >/dev/null
}
case "${1:-}" in
  install)
    n=${2:?which folder: 1, 2 or 3}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      ".sgl$n"/*.whl
    du -sh "$SITE" ;;
  check)
    bounded 180 python -c "import sglang, transformers, tokenizers, torch
from sglang.srt.entrypoints.engine import Engine
print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__,
      'torch', torch.__version__)" ;;
  train)
    tiny
    bounded "$RUN_S" python benchmarks/sglang_bench.py --suite train --ckpt /tmp/tiny --steps 4 --timeout-s "$SGL_TIMEOUT_S" \
      --out "$OUT/sglang-$stamp-train.json" ;;
  step)
    # The tiny checkpoint's geometry (a 7B random checkpoint would need ~30 GB written from CPU first:
    #   python tools/make_tiny_checkpoint.py --size 7B --output /tmp/ckpt7b   then --ckpt /tmp/ckpt7b)
    tiny
    bounded "$RUN_S" python benchmarks/sglang_bench.py --suite step --ckpt "${CKPT:-/tmp/tiny}" --timeout-s "$SGL_TIMEOUT_S" \
      --workloads img-small,img --out "$OUT/sglang-$stamp-step.json" ;;
  overlap)
    # The trainer's prefix work beside SGLang's decode (benchmarks/probes/sglang_overlap.py): `overlap plain`
    # without MPS, `overlap mps` with an NVIDIA MPS daemon of our own (its pipe and log folders under /tmp, quit
    # when this command ends; the GPU's compute mode and settings are left as they are), `overlap` (both) one after
    # the other. Each probe takes ~210-280 s at 7B (SGLang's start, warm-ups, two repeats): one per device call
    # leaves it room. CKPT=/tmp/tiny for a quick check of the plumbing.
    which=${2:-both}
    ckpt=${CKPT:-/tmp/ckpt7b}
    if [ "$ckpt" = /tmp/ckpt7b ]; then ckpt7b; else tiny; fi
    probe() { bounded "$RUN_S" python benchmarks/probes/sglang_overlap.py --ckpt "$ckpt" --timeout-s "$SGL_TIMEOUT_S" \
      --watchdog-s "$RUN_S" ${PROBE_ARGS:-} "$@"; }  # PROBE_ARGS: e.g. "--repeats 1"
    status=0
    if [ "$which" = plain ] || [ "$which" = both ]; then
      probe --out "$OUT/sglang-$stamp-overlap.json" || status=$?  # the MPS run goes ahead either way
    fi
    if [ "$which" = mps ] || [ "$which" = both ]; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d
      trap 'echo quit | nvidia-cuda-mps-control' EXIT
      probe --mps --out "$OUT/sglang-$stamp-overlap-mps.json" || status=$?
    fi
    exit "$status" ;;
  *)
    echo "usage: $0 install N | check | train | step | overlap [plain|mps|both]" >&2; exit 2 ;;
esac
