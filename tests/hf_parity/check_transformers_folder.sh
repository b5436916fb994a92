#!/usr/bin/env bash
# A folder that transformers 5 wrote itself (save_pretrained: sharded safetensors, GQA, head_dim not
# hidden/heads, llama3 rope, rope_theta 50000 inside rope_parameters) of the FAMILY (llama, mistral,
# qwen3) loads in meshtorch and gives transformers' loss, and each position's loss, within 1e-5 on
# the same token batch; so does the same folder with config.json in the earlier generation's
# fields (--legacy-config).
# Exit 77 (CTest: skipped) when the bench environment (bench/setup-python) is not installed.
#
#   check_transformers_folder.sh VENV_PYTHON EVAL_LOSS_BINARY MAKE_FOLDER_PY HF_LOSS_PY FAMILY [--legacy-config]
set -euo pipefail
python="$1" eval_loss="$2" make_folder="$3" hf_loss="$4" family="$5"
shift 5
if [[ ! -x "$python" ]]; then
  echo "skipped: no bench environment at $python (install it with bench/setup-python)"
  exit 77
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1

"$python" "$make_folder" "$tmp/model" --family "$family" "$@"
"$eval_loss" "$tmp/model" "$tmp/ours.json" -b 4 -s 128
"$python" "$hf_loss" "$tmp/model" "$tmp/ours.json" --tol 1e-5 --family "$family"
