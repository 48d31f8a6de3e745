#!/usr/bin/env bash
# Launch torchplex training with torchrun, torchtitan style:
#
#   ./run_train.sh                                        # CPU debug run (train_configs/debug.toml)
#   NGPU=8 CONFIG_FILE=./train_configs/qwen2_5_vl_7b.toml ./run_train.sh --training.steps 100
#
# Environment:
#   NGPU          processes per node (default 1)
#   NNODES        nodes (default 1); for NNODES > 1 also set RDZV_ENDPOINT=<host of node 0>:<port>
#   CONFIG_FILE   TOML config; a path relative to where you call from, or to this folder (default debug.toml)
#   LOG_RANK      local ranks whose output is shown, comma separated (default 0)
#   PYTHON        interpreter; default: this repo's .venv/bin/python when it exists and no venv is
#                 active, else `python` on PATH (so an activated venv or conda env always wins), else `python3`
#   TRAIN_MODULE  module to run (default torchplex.train; tests swap in a stub)
#   OMP_NUM_THREADS  CPU threads per process (default 1)
# Extra arguments are config overrides (--section.key=value) and win over the file.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

NGPU=${NGPU:-1}
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}  # port 0: the c10d store picks a free one (single node)
TRAIN_MODULE=${TRAIN_MODULE:-torchplex.train}
# One CPU thread per process unless told otherwise: on small shared CPU machines OpenMP's second thread mostly
# spin-waits (measured 11x slower scoring of the tiny model with 2 threads than with 1 on a 2-core machine).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# Resolve a CONFIG_FILE given relative to the caller's folder before moving to the repo root, so both
# `CONFIG_FILE=my.toml ./path/to/run_train.sh` and the repo-relative default work from anywhere.
if [[ -n "${CONFIG_FILE:-}" && -f "${CONFIG_FILE}" ]]; then
    CONFIG_FILE="$(cd "$(dirname "${CONFIG_FILE}")" && pwd)/$(basename "${CONFIG_FILE}")"
elif [[ -n "${CONFIG_FILE:-}" && "${CONFIG_FILE}" != /* ]]; then
    CONFIG_FILE="${SCRIPT_DIR}/${CONFIG_FILE}"  # the repo-relative form (train_configs/x.toml) from anywhere
fi
CONFIG_FILE=${CONFIG_FILE:-${SCRIPT_DIR}/train_configs/debug.toml}

# Run from the repo root (so `-m torchplex.train` imports without an install); relative paths given on the command
# line still mean the caller's folder (torchplex/config/loader.py reads it here), a TOML's paths its own folder.
export TORCHPLEX_CALLER_DIR="${TORCHPLEX_CALLER_DIR:-${PWD}}"
cd "${SCRIPT_DIR}"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -z "${VIRTUAL_ENV:-}" && -x "${SCRIPT_DIR}/.venv/bin/python" ]]; then
        PYTHON="${SCRIPT_DIR}/.venv/bin/python"
    elif command -v python >/dev/null; then
        PYTHON=python
    else
        PYTHON=python3  # images that ship only python3
    fi
fi

# The config is checked before any process starts: a mistake prints its one line (exit 2), not torchrun's
# banner; --help prints every key with the values this config gives.
"${PYTHON}" -m torchplex.config --job.config_file "${CONFIG_FILE}" "$@" || exit $?
for arg in "$@"; do
    if [[ "${arg}" == "--help" || "${arg}" == "-h" ]]; then exit 0; fi
done
export LOG_RANK

# One process: run it directly (the trainer needs no process group), so its output is the terminal's (a
# progress bar redraws in place), Ctrl-C reaches it, and an error is its message without torchrun's report.
if [[ "${NGPU}" == "1" && "${NNODES}" == "1" ]]; then
    exec "${PYTHON}" -m "${TRAIN_MODULE}" --job.config_file "${CONFIG_FILE}" "$@"
fi

# `python -m torch.distributed.run` is `torchrun`, bound to the interpreter chosen above. No --tee: the ranks
# shown write to this terminal themselves (no `[rank0]:` prefix on every line, and a bar stays one line).
exec "${PYTHON}" -m torch.distributed.run \
    --nproc_per_node="${NGPU}" --nnodes="${NNODES}" \
    --rdzv_backend c10d --rdzv_endpoint="${RDZV_ENDPOINT}" \
    --local-ranks-filter "${LOG_RANK}" \
    -m "${TRAIN_MODULE}" --job.config_file "${CONFIG_FILE}" "$@"
