#!/usr/bin/env bash
# Greedy generation against transformers' generate (generate_parity.py) on a FAMILY folder that
# transformers writes. Exit 77 (CTest: skipped) when the bench environment (bench/setup-python) is
# not installed.
#
#   check_generate.sh VENV_PYTHON GENERATE_BINARY MAKE_FOLDER_PY FAMILY
set -euo pipefail
python="$1" generate="$2" make_folder="$3" family="$4"
if [[ ! -x "$python" ]]; then
  echo "skipped: no bench environment at $python (install it with bench/setup-python)"
  exit 77
fi
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
exec "$python" "$(dirname "$0")/generate_parity.py" "$generate" "$make_folder" "$family"
