#!/usr/bin/env bash
# torchrun starts the C++ binary directly (--no-python) with its c10d rendezvous; run the same
# command on every node. Needs a Python with torch only for torchrun itself.
#   examples/03-job-launchers/run-torchrun.sh 1 8 node-a:29500 -e my-run      (one node)
set -euo pipefail
nnodes=${1:?usage: run-torchrun.sh NNODES NPROC_PER_NODE HOST:PORT [TRAIN FLAGS...]}
nproc=${2:?usage: run-torchrun.sh NNODES NPROC_PER_NODE HOST:PORT [TRAIN FLAGS...]}
endpoint=${3:?usage: run-torchrun.sh NNODES NPROC_PER_NODE HOST:PORT [TRAIN FLAGS...]}
shift 3
exec torchrun --no-python --nnodes "$nnodes" --nproc-per-node "$nproc" \
  --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "${RDZV_ID:-meshtorch}" \
  --log-dir "${LOG_DIR:-logs}" --redirects 3 \
  "${MESHTORCH_BIN:-build/bin}/02-distributed-data-parallel" "$@"
