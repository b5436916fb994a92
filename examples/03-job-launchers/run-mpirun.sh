#!/usr/bin/env bash
# OpenMPI starts the ranks; each reads OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK and the exported
# MASTER_ADDR/MASTER_PORT. No MPI library is linked: MPI only launches, c10d communicates.
#   examples/03-job-launchers/run-mpirun.sh hosts 8 -e my-run     (hosts: "node-a slots=8" lines)
set -euo pipefail
hosts_file=${1:?usage: run-mpirun.sh HOSTS_FILE NPROC_PER_NODE [TRAIN FLAGS...]}
nproc=${2:?usage: run-mpirun.sh HOSTS_FILE NPROC_PER_NODE [TRAIN FLAGS...]}
shift 2
nnodes=$(grep -cv '^[[:space:]]*\(#\|$\)' "$hosts_file")
master=$(awk '!/^[[:space:]]*(#|$)/ { print $1; exit }' "$hosts_file")
export MASTER_ADDR=$master MASTER_PORT=${MASTER_PORT:-29500} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec mpirun -np $((nnodes * nproc)) --hostfile "$hosts_file" -bind-to none -map-by slot \
  -x MASTER_ADDR -x MASTER_PORT -x OMP_NUM_THREADS -x PATH -x LD_LIBRARY_PATH \
  "${MESHTORCH_BIN:-build/bin}/02-distributed-data-parallel" "$@"
