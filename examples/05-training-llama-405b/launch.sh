#!/usr/bin/env bash
# Chapter 5's launch: the 405B recipe on every host of a hosts file (one host per line, the
# first is the master), one meshrun per host in a detached tmux session, started over ssh by
# chapter 3's launch-ssh-tmux.sh. The repository, build and model folder must be at the same
# paths on every host; copy the model to node-local disk first (the guide: 3 minutes to start
# from local NVMe against 50 from a shared drive).
#
#   MODEL=/nvme/llama-3.1-405b DATA=corpus.jsonl examples/05-training-llama-405b/launch.sh hosts
#   tail -f logs/*/*/stdout.log               # on a host: every local rank's log
#   build/bin/meshtorch-top --hosts hosts     # every rank on every host, over ssh
#   xargs -a hosts -I{} ssh {} tmux kill-session -t llama-405b     # stop
#
# Extra arguments go to the training binary (e.g. --max-steps 10). Environment: MODEL, DATA,
# NPROC_PER_NODE (8), THREADS_PER_RANK (CPU threads for each rank's offloaded AdamW: the
# guide's 26 = 208 cores / 8 GPUs), EXPERIMENT (llama-405b), MASTER_PORT (5001), and
# launch-ssh-tmux.sh's (MESHTORCH_BIN, WORKDIR, DRY_RUN=1 to print the ssh commands).
set -euo pipefail
hosts_file=${1:?usage: launch.sh HOSTS_FILE [TRAIN FLAGS...]}
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
model=${MODEL:?set MODEL to the model folder (config.json, tokenizer, safetensors)}
data=${DATA:?set DATA to the data set (.txt, .jsonl or llm.c .bin)}
experiment=${EXPERIMENT:-llama-405b}

# The guide's NCCL settings: use every NIC for every ring, and let the collectives' own
# stream bookkeeping replace record_stream (fewer surprises in the caching allocator).
REMOTE_ENV="OMP_NUM_THREADS=${THREADS_PER_RANK:-26} NCCL_CROSS_NIC=1 TORCH_NCCL_AVOID_RECORD_STREAMS=1 ${REMOTE_ENV:-}"
export REMOTE_ENV
export TRAIN_BIN=05-training-llama-405b SESSION=${SESSION:-$experiment} MASTER_PORT=${MASTER_PORT:-5001}

# Sequence 4096, one sequence per rank, bf16 compute over fp32 shards in CPU memory; every
# layer checkpointed and the weights read by rank 0 are the binary's defaults.
exec "$here/../03-job-launchers/launch-ssh-tmux.sh" "$hosts_file" "${NPROC_PER_NODE:-8}" \
  -e "$experiment" -m "$model" -d "$data" -s 4096 -b 1 --dtype bfloat16 --cpu-offload --lr 1e-5 --log-freq 1 \
  --ckpt-freq 100 "$@"
