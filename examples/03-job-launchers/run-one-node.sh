#!/usr/bin/env bash
# One node, one rank per device (or per CPU socket share): meshrun starts the ranks.
#   examples/03-job-launchers/run-one-node.sh 4 -e my-run -b 8
set -euo pipefail
nproc=${1:?usage: run-one-node.sh NPROC [TRAIN FLAGS...]}
shift
bin=${MESHTORCH_BIN:-build/bin}
exec "$bin/meshrun" --nproc-per-node "$nproc" --master-port "${MASTER_PORT:-29500}" --log-dir "${LOG_DIR:-logs}" \
  -- "$bin/02-distributed-data-parallel" "$@"
