#!/usr/bin/env bash
# HF parity: train a model for 2 steps with our chapter-1 binary, save a checkpoint, consolidate
# it into an HF folder (meshtorch-consolidate), compute our loss on a fixed batch from that folder
# (meshtorch-eval-loss), and check that transformers' model of the FAMILY (LlamaForCausalLM,
# Qwen3ForCausalLM, ...), loaded from the same folder with from_pretrained, gives the same loss within
# 1e-5 (fp32), and the same per-position losses when the JSON carries them. The batch is 4 x 128:
# at 2 x 32 a config whose llama3 rope scaling is ignored still passes on the mean.
# Exit 77 (CTest: skipped) when the bench environment (bench/setup-python) is not installed.
#
#   check.sh VENV_PYTHON TRAIN_BINARY CONSOLIDATE_BINARY EVAL_LOSS_BINARY HF_LOSS_PY MODEL FAMILY [SEQ]
#
# SEQ (default 128): the positions trained and compared; at most a sliding window's.
set -euo pipefail
python="$1" train="$2" consolidate="$3" eval_loss="$4" hf_loss="$5" model="$6" family="$7" seq="${8:-128}"

if [[ ! -x "$python" ]]; then
  echo "skipped: no bench environment at $python (install it with bench/setup-python)"
  exit 77
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$train" -m "$model" -d builtin -s "$seq" -e hfp --save-dir "$tmp" --max-steps 2 --ckpt-freq 2 --log-freq 1 \
  --dtype float32 --device cpu >"$tmp/train.log" 2>&1 || { cat "$tmp/train.log"; exit 1; }
"$consolidate" "$tmp/hfp/checkpoint" "$tmp/hf" >"$tmp/consolidate.log" 2>&1 || { cat "$tmp/consolidate.log"; exit 1; }
ckpt="$tmp/hf"
[[ -f "$ckpt/config.json" && -f "$ckpt/model.safetensors" ]] || {
  echo "no config.json + model.safetensors in $ckpt after consolidating step 2"; ls -lR "$tmp"; exit 1; }
"$eval_loss" "$ckpt" "$tmp/ours.json" -b 4 -s "$seq"
"$python" "$hf_loss" "$ckpt" "$tmp/ours.json" --tol 1e-5 --family "$family"
