#!/usr/bin/env bash
# Several nodes without a scheduler: one meshrun per host in a detached tmux session, started
# over ssh from a hosts file (one host name per line; the first is the master). The repository
# and build must be at the same path on every host (shared storage or a copy).
#
#   examples/03-job-launchers/launch-ssh-tmux.sh hosts 8 -e my-run -b 8    # start
#   tail -f logs/0/*/stdout.log                                             # watch (on a host)
#   xargs -a hosts -I{} ssh {} tmux kill-session -t my-run                   # stop
#
# TRAIN_BIN names the training binary in $MESHTORCH_BIN (default 02-distributed-data-parallel);
# REMOTE_ENV holds VAR=value words set for meshrun and the ranks on every host (chapter 5's
# launch.sh passes its NCCL and thread settings this way). DRY_RUN=1 prints the ssh commands
# instead of running them.
set -euo pipefail
hosts_file=${1:?usage: launch-ssh-tmux.sh HOSTS_FILE NPROC_PER_NODE [TRAIN FLAGS...]}
nproc=${2:?usage: launch-ssh-tmux.sh HOSTS_FILE NPROC_PER_NODE [TRAIN FLAGS...]}
shift 2
mapfile -t hosts < <(grep -v '^[[:space:]]*\(#\|$\)' "$hosts_file")
nnodes=${#hosts[@]}
(( nnodes > 0 )) || { echo "$hosts_file lists no host" >&2; exit 1; }
master=${hosts[0]}
port=${MASTER_PORT:-29500}
session=${SESSION:-meshtorch}
workdir=${WORKDIR:-$PWD}
bin=${MESHTORCH_BIN:-build/bin}
train_bin=${TRAIN_BIN:-02-distributed-data-parallel}
train_args=$(printf ' %q' "$@")
read -r -a remote_env <<< "${REMOTE_ENV:-}"
env_prefix=""
(( ${#remote_env[@]} == 0 )) || env_prefix="env$(printf ' %q' "${remote_env[@]}") "

for node_rank in "${!hosts[@]}"; do
  host=${hosts[$node_rank]}
  remote="cd $(printf %q "$workdir") && ${env_prefix}$bin/meshrun --nnodes $nnodes --node-rank $node_rank"
  remote+=" --nproc-per-node $nproc --master-addr $master --master-port $port --log-dir logs"
  remote+=" -- $bin/$train_bin$train_args"
  command=(ssh "$host" tmux new-session -d -s "$session" "$(printf %q "$remote")")
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%s\n' "${command[*]}"
  else
    "${command[@]}"
  fi
done
